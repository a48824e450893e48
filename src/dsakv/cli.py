"""dsakv, an inference engine for DeepSeek Sparse Attention models (GLM-5.x, DeepSeek-V3.2),
whose shared-indexer layers keep no index-K cache."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import errno
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from dsakv.config.layer_plan import plan_overrides
from dsakv.disagg.config import DEFAULT_BOOTSTRAP_PORT, MODES, DisaggConfig
from dsakv.errors import DsakvError
from dsakv.procs import Listener, interrupts_deferred
from dsakv.writable import can_append, write_blocker


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad arguments as one `error:` line and exit code 2, and takes
    no abbreviated flags: SGLang's `--dp 2` would otherwise be `--dp-attention`, then
    "unrecognized arguments: 2"."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)

    def _get_option_tuples(self, option_string: str) -> list[Any]:
        """Single-dash flags unabbreviated too (argparse before 3.12 abbreviates them even
        without `allow_abbrev`: `-d 2` was vLLM's `-dp 2`); a short flag with its value
        attached (`-v`'s kind) still parses."""
        tuples = super()._get_option_tuples(option_string)
        return [t for t in tuples if t[1] == option_string[:2]]


# Sizes (GiB) and seconds past this are typos; beyond ~1e300 they overflowed into tracebacks.
_MAX_FLOAT = 1e12


def _checked(text: str, convert: Callable[[str], Any], ok: Callable[[Any], bool], want: str) -> Any:
    """`convert(text)` where `ok` holds for it. Unparsable text gets the same "must be ..."
    message: argparse's own would name the type function ("invalid _positive_int value")."""
    try:
        value = convert(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    return _checked(text, float, lambda v: 0 < v <= _MAX_FLOAT, f"a number in (0, {_MAX_FLOAT:g}]")


def _fraction(text: str) -> float:
    return _checked(text, float, lambda v: 0 < v <= 1, "a number in (0, 1]")


def _nonnegative_float(text: str) -> float:
    return _checked(text, float, lambda v: 0 <= v <= _MAX_FLOAT, f"a number in [0, {_MAX_FLOAT:g}]")


def port(text: str) -> int:
    return _checked(text, int, lambda v: 0 < v < 65536, "an integer in 1..65535")


def listen(host: str, port: int):
    """A `Listener` on `host:port`: a port in use or a bad address fails now, in one line,
    not after the engine has loaded, in uvicorn's words; and nothing can take the port
    while it loads (the server serves these sockets)."""
    return Listener(host, port)


def check_listen(host: str, port: int) -> None:
    """Fail now, in one line, where `host:port` cannot be listened on (a port another
    process of ours will bind)."""
    listen(host, port).close()


def _draft_layers(text: str) -> int:
    return _checked(text, int, lambda v: 0 <= v <= 64, "an integer in 0..64")


def _nonnegative_int(text: str) -> int:
    return _checked(text, int, lambda v: v >= 0, "an integer >= 0")


def _positive_int(text: str) -> int:
    return _checked(text, int, lambda v: v >= 1, "an integer >= 1")


def _chunk_size(text: str) -> int:
    """argparse type: a size, or SGLang's -1 (no chunking: `_fold_foreign` makes it the
    context length)."""
    return _checked(text, int, lambda v: v >= 1 or v == -1, "an integer >= 1, or -1 (no chunking)")


def _speculative_config(text: str) -> int:
    """argparse type for vLLM's --speculative-config JSON: its MTP methods, as drafts per
    step (dsakv's --speculative-num-steps)."""
    try:
        spec = json.loads(text)
    except (ValueError, RecursionError):
        spec = None
    want = '{"method": "deepseek_mtp" or "mtp", "num_speculative_tokens": N in 1..16}'
    keys = {"method", "num_speculative_tokens"}
    if not isinstance(spec, dict) or not spec or not set(spec) <= keys:
        raise argparse.ArgumentTypeError(f"dsakv takes {want}, got {text!r}")
    # vLLM's defaults for these models: their own MTP layer, as many drafts as it has (one)
    n = spec.get("num_speculative_tokens", 1)
    method = spec.get("method", "mtp")
    if method not in ("deepseek_mtp", "mtp") or type(n) is not int or not 1 <= n <= 16:
        raise argparse.ArgumentTypeError(f"dsakv takes {want}, got {text!r}")
    return n


def _seed(text: str) -> int:
    return _checked(text, int, lambda v: 0 <= v < 2**64, "an integer in 0..2**64-1")


def _spelled(aliases: dict[str, str], fold_case: bool = False) -> Callable[[str], str]:
    """argparse type: vLLM's / SGLang's spellings of a value as dsakv's own, before `choices`
    checks it (so --help lists dsakv's names; anything else is still one "invalid choice")."""

    def convert(text: str) -> str:
        return aliases.get(text.lower() if fold_case else text, text)

    return convert


def _only(supported: Sequence[str], why: str) -> Callable[[str], str]:
    """argparse type for a vLLM / SGLang flag taken for the values that are what dsakv does
    anyway; another asks for what it does not: one line naming what it takes."""

    def check(text: str) -> str:
        if text not in supported:
            raise argparse.ArgumentTypeError(
                f"dsakv takes {' or '.join(supported)} ({why}), got {text!r}"
            )
        return text

    return check


def _refused(why: str) -> Callable[[str], str]:
    """argparse type for a vLLM / SGLang flag that asks, whatever its value, for what dsakv
    does not do: one line saying why."""

    def check(text: str) -> str:
        raise argparse.ArgumentTypeError(why)

    return check


def _kv_cache_dtype(text: str) -> str:
    """argparse type: "auto" (vLLM's and SGLang's default) is dsakv's default, "fp8" e4m3
    (as SGLang maps it), "bfloat16" bf16."""
    from dsakv.memory.layout import DEFAULT_LATENT_DTYPE

    return _spelled({"auto": DEFAULT_LATENT_DTYPE, "fp8": "fp8_e4m3", "bfloat16": "bf16"})(text)


_DTYPE = _spelled({"half": "float16", "float": "float32"})  # (vLLM's and SGLang's)
# SGLang runs DeepSeek / GLM MTP as NEXTN or EAGLE (with no draft model: the nextn layer)
_SPECULATIVE = _spelled({"nextn": "mtp", "eagle": "mtp", "mtp": "mtp"}, fold_case=True)

# SGLang's names for --tp and --ep (vLLM's the long ones) besides dsakv's own.
_TP = ("--tp", "--tp-size", "--tensor-parallel-size", "-tp")
_EP = ("--ep", "--ep-size", "--expert-parallel-size")
# SGLang's (and vLLM's) data-parallel size: dsakv's is --tp's under --dp-attention, else 1.
_DP = ("--dp-size", "--dp", "--data-parallel-size", "-dp")
# Hidden flags with no field of their own: `_fold_foreign` checks them against dsakv's
# flags, then they are dropped (never passed on: serve-pd passes what they checked).
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # (vLLM's)
_FOLDED = (
    "enforce_eager",
    "enable_chunked_prefill",
    "max_prefill_tokens",
    "schedule_policy",
    "dp_size",
    "enable_expert_parallel",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "speculative_config",
    "spec_method",
    "spec_num_speculative_tokens",
)


def _add_model_option(p: argparse.ArgumentParser) -> None:
    """SGLang's --model-path and vLLM's --model, hidden: the model as a flag
    (`_fold_model_option` makes it the positional's)."""
    for flag in ("--model-path", "--model"):
        p.add_argument(flag, dest="model_option", help=argparse.SUPPRESS)


def _fold_model_option(args: argparse.Namespace) -> None:
    option = getattr(args, "model_option", None)
    if option is None:
        return
    if args.model is not None and args.model != option:
        raise DsakvError(
            f"the model is given twice ({args.model!r} and --model-path/--model {option!r})"
        )
    args.model = option


def _add_aliased(g: Any, flags: Sequence[str], help: str, **kw: Any) -> None:
    """`flags[0]` and, hidden, its other spellings: --help shows dsakv's name and an error
    the spelling given (not "--tp/--tp-size/--tensor-parallel-size")."""
    g.add_argument(flags[0], help=f"{help} (also {', '.join(flags[1:])})", **kw)
    for alias in flags[1:]:
        g.add_argument(alias, help=argparse.SUPPRESS, **kw)


def _add_dp_args(g: Any, help: str) -> None:
    """--dp-attention (SGLang's --enable-dp-attention too) and, hidden, the DP size's
    spellings, each kept with the flag given: `_check_dp_size` names it."""
    help += " (also --enable-dp-attention; --dp-size, --dp or --data-parallel-size: --tp's N)"
    g.add_argument("--dp-attention", action="store_true", help=help)
    g.add_argument(
        "--enable-dp-attention", dest="dp_attention", action="store_true", help=argparse.SUPPRESS
    )
    for flag in _DP:
        g.add_argument(
            flag,
            dest="dp_size",
            type=lambda text, flag=flag: (flag, _positive_int(text)),
            help=argparse.SUPPRESS,
        )


def _fold_expert_parallel(args: argparse.Namespace) -> None:
    """vLLM's --enable-expert-parallel: the experts split over every rank (after
    `_check_dp_size`: vLLM's -dp N is N ranks here), dsakv's --ep set to the ranks."""
    if not args.enable_expert_parallel:
        return
    ranks = args.tp or 1
    if args.ep not in (None, ranks):
        raise DsakvError(
            f"--enable-expert-parallel splits the experts over all {ranks} rank(s); "
            f"--ep {args.ep} says otherwise: give one"
        )
    args.ep = ranks if ranks > 1 else args.ep
    args.enable_expert_parallel = False


def _check_dp_size(args: argparse.Namespace) -> None:
    """SGLang's / vLLM's DP size as dsakv's layout: under DP attention one DP rank per TP
    rank, without it one replica (1 is the no-op default); anything else is refused. vLLM's
    --data-parallel-size N alone is N ranks of data-parallel attention (vLLM's for MLA
    models: GPUs = DP × TP), dsakv's --tp N --dp-attention."""
    if args.dp_size is None:
        return
    (flag, n), tp = args.dp_size, args.tp or 1
    if flag in ("--data-parallel-size", "-dp") and n > 1 and not args.dp_attention:
        if tp > 1:
            raise DsakvError(
                f"{flag} {n} with --tp {tp} is (as vLLM's) {tp * n} ranks with "
                f"attention split {tp} ways in each DP group, which dsakv does not run: its DP "
                f"attention is one DP rank per rank (--tp {tp * n} --dp-attention)"
            )
        args.tp = tp = n
        args.dp_attention = True
    if args.dp_attention and n != tp:
        raise DsakvError(
            f"{flag} {n} with --tp {tp}: dsakv's DP attention runs one DP rank per TP rank "
            f"(attention split over ranks within a DP group is not supported): give {flag} "
            f"{tp} or leave it out"
        )
    if not args.dp_attention and n > 1:
        raise DsakvError(
            f"{flag} {n} without DP attention asks for {n} replicas, and a dsakv server is "
            f"one: run {n} `dsakv serve` behind sglang-router (README), or DP attention over "
            f"the ranks with --tp {n} --dp-attention"
        )


def add_layout_args(p: argparse.ArgumentParser) -> None:
    """Cache-layout and layer-plan flags, shared by every command that builds a pool."""
    from dsakv.memory.layout import DEFAULT_LATENT_DTYPE, INDEX_K_DTYPES, LATENT_DTYPES

    g = p.add_argument_group("cache layout and layer plan")
    g.add_argument(
        "--kv-cache-dtype",
        type=_kv_cache_dtype,
        choices=LATENT_DTYPES,
        default=None,
        help=f"latent (default {DEFAULT_LATENT_DTYPE}, also spelled auto or fp8; bfloat16: bf16)",
    )
    g.add_argument("--index-k-dtype", choices=INDEX_K_DTYPES, default=None)
    _add_aliased(
        g,
        ("--page-size", "--block-size"),
        "tokens per page",
        dest="page_size",
        type=_positive_int,
        default=None,
    )
    g.add_argument("--no-elide-index-k", action="store_true", help="dense index-K on every layer")
    g.add_argument("--index-topk-pattern", help="per-layer F/S string overriding the checkpoint")
    g.add_argument("--index-topk-freq", type=int, help="run the indexer every N layers")
    g.add_argument("--index-skip-topk-offset", type=int, help="first layer the freq applies from")
    g.add_argument("--no-index-share", action="store_true", help="every layer runs its indexer")


# --- plan ----------------------------------------------------------------------------------


def _check_indexers(model: str, plan: Any) -> None:
    """A plan whose full layers a checkpoint has no indexer weights for is refused, as the
    engine refuses it (a config-only folder or a preset: nothing to check against)."""
    from dsakv.config.checkpoint import checkpoint_files, indexer_layers, no_indexer_problem

    path = Path(model)
    if not path.is_dir():
        return
    try:
        names = checkpoint_files(path)
    except DsakvError:
        return
    lacking = set(plan.full_layers) - indexer_layers(names)
    if lacking:
        raise DsakvError(f"{model}: {no_indexer_problem(lacking, plan.pattern)}")


def _cmd_plan(args: argparse.Namespace) -> int:
    from dsakv.config import LayerPlan, ModelConfig
    from dsakv.config.hisparse import check_runs_with
    from dsakv.distributed import ParallelConfig
    from dsakv.errors import ConfigError
    from dsakv.memory import CacheLayout, estimate_weight_bytes, plan_capacity
    from dsakv.memory.capacity import GIB, gain_pct
    from dsakv.memory.layout import DEFAULT_LATENT_DTYPE

    config = ModelConfig.resolve(args.model)
    hisparse = _hisparse_config(args, config)
    plan = LayerPlan.from_config(config, draft_layers=args.draft_layers, **plan_overrides(args))
    _check_indexers(args.model, plan)
    elided = CacheLayout.from_plan(
        config,
        plan,
        args.kv_cache_dtype or DEFAULT_LATENT_DTYPE,
        args.index_k_dtype or "fp8",
        args.page_size or 64,
    )
    dense = elided.dense()
    if args.gpu_memory_gib is None:  # they size a budget from GPU memory, else are dropped
        given = [
            f
            for f in ("weights_gib", "mem_fraction_static", "reserve_gib")
            if getattr(args, f) is not None
        ]
        if given:
            flags = ", ".join("--" + f.replace("_", "-") for f in given)
            raise DsakvError(f"{flags} need{'s' if len(given) == 1 else ''} --gpu-memory-gib")
        if args.kv_budget_gib is None:
            args.kv_budget_gib = 100.0
    _check_dp_size(args)
    _fold_expert_parallel(args)
    args.ep = args.ep or 1
    parallel = ParallelConfig(tp=args.tp, ep=args.ep, dp_attention=args.dp_attention)
    parallel.check_model(config)
    if hisparse is not None:  # what the engine refuses is not planned
        check_runs_with(
            mtp="--draft-layers" if args.draft_layers else None, ranks=parallel.world_size
        )
    subtracted = args.gpu_memory_gib is not None and args.weights_gib is None
    try:
        weights = estimate_weight_bytes(
            config, plan, args.tp, ep=args.ep, dp_attention=args.dp_attention
        )
    except ConfigError:  # weights it cannot price (the parallel flags are checked above)
        if subtracted:
            raise
        weights = None  # the budget does not need them: reported as unknown
    budget = dict(
        kv_budget_gib=args.kv_budget_gib,
        gpu_memory_gib=args.gpu_memory_gib,
        mem_fraction_static=0.9 if args.mem_fraction_static is None else args.mem_fraction_static,
        reserve_gib=args.reserve_gib or 0.0,
    )
    # Per layout: its budget, capacity and weights per rank (what the budget subtracted, else
    # the estimate). The dense layout also builds the indexers that shared layers skip.
    per_layout = []
    for layout, extra in ((elided, 0), (dense, weights.indexer_bytes_saved if weights else 0)):
        estimate = None if weights is None else weights.total_bytes + extra
        given = {**budget, "weights_gib": estimate / GIB if subtracted else args.weights_gib}
        cap = plan_capacity(layout, **given)
        per_layout.append((given, cap, estimate if cap.weight_bytes is None else cap.weight_bytes))
    (budget_e, cap_elided, weights_e), (budget_d, cap_dense, weights_d) = per_layout
    chosen = cap_dense if args.no_elide_index_k else cap_elided
    chosen_layout = dense if args.no_elide_index_k else elided
    report = {
        "model_type": config.model_type,
        "num_layers": plan.num_layers,
        "num_draft_layers": plan.num_draft_layers,
        "indexer_types": list(plan.indexer_types),
        "layer_pattern": plan.pattern,
        "plan_source": plan.source,
        "num_full_layers": plan.num_full_layers,
        "num_shared_layers": plan.num_shared_layers,
        "elide_index_k": not args.no_elide_index_k,
        "kv_cache_dtype": elided.kv_cache_dtype,
        "index_k_dtype": elided.index_k_dtype,
        "page_size": elided.page_size,
        "latent_bytes_per_token": chosen_layout.latent_bytes_per_token,
        "index_k_bytes_per_token": chosen_layout.index_k_bytes_per_token,
        "bytes_per_token": chosen_layout.bytes_per_token,
        "bytes_per_token_elided": elided.bytes_per_token,
        "bytes_per_token_dense": dense.bytes_per_token,
        "kv_budget_bytes": chosen.kv_budget_bytes,
        "max_total_num_tokens": chosen.max_total_num_tokens,
        "max_total_num_tokens_elided": cap_elided.max_total_num_tokens,
        "max_total_num_tokens_dense": cap_dense.max_total_num_tokens,
        "token_gain_pct": gain_pct(cap_elided.max_total_num_tokens, cap_dense.max_total_num_tokens),
        "tp": args.tp,
        "ep": args.ep,
        "dp_attention": args.dp_attention,
        "weight_bytes_per_rank": weights_d if args.no_elide_index_k else weights_e,
        # Every rank holds a pool; plain TP replicates it, DP attention fills each its own.
        "max_total_num_tokens_per_rank": chosen.max_total_num_tokens,
        "max_total_num_tokens_aggregate": chosen.max_total_num_tokens * parallel.dp,
        "indexer_weight_bytes_saved": weights and weights.indexer_bytes_saved,
    }
    splits = None
    if hisparse is not None:
        from dsakv.memory import plan_hisparse

        splits = (
            plan_hisparse(dense, hisparse, **budget_d),
            plan_hisparse(elided, hisparse, **budget_e),
        )
        chosen_split = splits[0] if args.no_elide_index_k else splits[1]
        page = chosen_layout.page_size
        hisparse.check_pool(chosen_split.device_tokens // page, page)  # as the engine refuses
        report["hisparse"] = {
            **hisparse.to_dict(),
            "dense": splits[0].as_dict(),
            "elided": splits[1].as_dict(),
            # Budget-independent: the ratio of device bytes per device token.
            "device_tokens_elided_over_dense": round(
                splits[0].device_bytes_per_device_token / splits[1].device_bytes_per_device_token, 3
            ),
        }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_plan_table(report, elided, dense, cap_elided, cap_dense, (weights_d, weights_e)))
        if splits is not None:
            print(_hisparse_table(*splits))
    return 0


def _hisparse_config(args: argparse.Namespace, config: Any) -> Any:
    """`--enable-hisparse` / `--hisparse-config` as a HiSparseConfig, or None when off."""
    from dsakv.config import HiSparseConfig

    if not args.enable_hisparse:
        if args.hisparse_config is not None:
            raise DsakvError("--hisparse-config needs --enable-hisparse")
        return None
    return HiSparseConfig.parse(args.hisparse_config, config)


def _hisparse_table(dense: Any, elided: Any) -> str:
    """The HiSparse split, dense and elided side by side (DESIGN.md §13)."""
    from dsakv.memory.capacity import gain_pct

    gib = 1 << 30
    h = elided.hisparse
    rows: list[tuple[str, Any, Any, bool]] = [
        ("device bytes/device token", dense.device_bytes_per_device_token,
         elided.device_bytes_per_device_token, True),
        ("device bytes/logical token", dense.device_bytes_per_logical_token,
         elided.device_bytes_per_logical_token, True),
        ("host bytes/token", dense.host_bytes_per_token, elided.host_bytes_per_token, False),
        ("device tokens", dense.device_tokens, elided.device_tokens, True),
        ("logical tokens", dense.logical_tokens, elided.logical_tokens, True),
        ("host memory (GiB)", dense.host_bytes / gib, elided.host_bytes / gib, False),
        ("concurrent hot buffers", dense.concurrent_hot_buffers,
         elided.concurrent_hot_buffers, True),
    ]  # fmt: skip
    lines = [
        "",
        f"HiSparse: top_k {h.top_k:,}, device buffer {h.device_buffer_size:,} "
        f"(+1 slot, rounded up to whole pages: {elided.hot_buffer_slots:,} slots per request), "
        f"host:device ratio {h.host_to_device_ratio}",
        "device: latent hot buffers + index-K of every logical token; host: every layer's latent",
        "",
        f"{'':28}{'dense':>16}{'elided':>16}{'gain':>10}",
    ]
    for name, d, e, show_gain in rows:
        fmt = (lambda v: f"{v:>16,.1f}") if isinstance(d, float) else (lambda v: f"{v:>16,}")
        if name.startswith("host memory"):
            fmt = lambda v: f"{v:>16,.3f}"
        gain = ""
        if show_gain:  # bytes: the saving as tokens gained per byte; counts: tokens gained
            gain = _pct(gain_pct(d, e) if name.startswith("device bytes") else gain_pct(e, d))
        lines.append(f"{name:28}{fmt(d)}{fmt(e)}{gain}")
    share = f"{100 * dense.index_k_share:.1f}%", f"{100 * elided.index_k_share:.1f}%"
    lines.append(f"{'index-K share of device':28}{share[0]:>16}{share[1]:>16}")
    return "\n".join(lines)


def _pct(gain: float | None) -> str:
    return f"{'n/a':>10}" if gain is None else f"{gain:>+9.2f}%"


def _plan_table(
    r: dict[str, Any],
    elided: Any,
    dense: Any,
    cap_e: Any,
    cap_d: Any,
    weights: tuple[int | None, int | None],
) -> str:
    """The plan, dense and elided side by side; with GPU memory, each column's KV budget is
    memory × fraction − its weights − reserve."""
    from dsakv.memory.capacity import gain_pct

    gib = 1 << 30
    weights_d, weights_e = (None if w is None else w / gib for w in weights)
    rows = [
        ("latent bytes/token", dense.latent_bytes_per_token, elided.latent_bytes_per_token),
        ("index-K bytes/token", dense.index_k_bytes_per_token, elided.index_k_bytes_per_token),
        ("cell bytes/token", dense.bytes_per_token, elided.bytes_per_token),
        ("weights/rank (GiB)", weights_d, weights_e),
        ("KV budget (GiB)", cap_d.kv_budget_bytes / gib, cap_e.kv_budget_bytes / gib),
        ("max_total_num_tokens", cap_d.max_total_num_tokens, cap_e.max_total_num_tokens),
    ]
    lines = [
        f"dsakv plan: {r['model_type']}, {r['num_layers']} layers"
        f" (+{r['num_draft_layers']} draft), {r['num_full_layers']} full / "
        f"{r['num_shared_layers']} shared ({r['plan_source']})",
        f"layers: {r['layer_pattern']}",
        f"cache: latent {r['kv_cache_dtype']}, index-K {r['index_k_dtype']}, "
        f"page size {r['page_size']}, TP {r['tp']}, EP {r['ep']}"
        + (", DP attention" if r["dp_attention"] else ""),
        "",
        f"{'':24}{'dense':>16}{'elided':>16}{'gain':>10}",
    ]
    for name, d, e in rows:
        cells = "".join(
            f"{'n/a':>16}" if v is None else f"{v:>16,.3f}" if isinstance(v, float) else f"{v:>16,}"
            for v in (d, e)
        )
        gain = ""
        if name.startswith("cell"):
            gain = _pct(gain_pct(d, e))  # the saving, as tokens gained per byte
        elif name.startswith("max"):
            gain = _pct(gain_pct(e, d))
        lines.append(f"{name:24}{cells}{gain}")
    saved = r["indexer_weight_bytes_saved"]
    layout = "elided" if r["elide_index_k"] else "dense"
    lines.append("")
    lines.append(
        f"{layout} layout: KV tokens per rank {r['max_total_num_tokens_per_rank']:,}, "
        f"in aggregate {r['max_total_num_tokens_aggregate']:,}"
    )
    lines.append(
        "indexer weights not built by shared layers: "
        + ("n/a (unknown weights)" if saved is None else f"{saved / gib:.3f} GiB per rank")
        + f" ({r['num_shared_layers']} layers)"
    )
    return "\n".join(lines)


def _add_plan(sub: Any) -> None:
    p = sub.add_parser("plan", help="KV capacity plan: bytes per token and pool tokens")
    p.add_argument("model", help="preset (glm-5, glm-5.2, deepseek-v3.2) or model path")
    _add_aliased(p, _TP, "tensor-parallel degree", dest="tp", type=_positive_int, default=1)
    _add_aliased(p, _EP, "expert-parallel groups (default 1)", dest="ep", type=_positive_int)
    p.add_argument("--enable-expert-parallel", action="store_true", help=argparse.SUPPRESS)
    _add_dp_args(p, "one scheduler and pool per rank")
    p.add_argument("--kv-budget-gib", type=_positive_float, help="explicit KV budget")
    p.add_argument("--gpu-memory-gib", type=_positive_float, help="GPU memory per rank")
    p.add_argument(
        "--mem-fraction-static", type=_fraction, help="of --gpu-memory-gib (default 0.9)"
    )
    p.add_argument(
        "--weights-gib", type=_nonnegative_float, help="override the estimated weights per rank"
    )
    p.add_argument("--reserve-gib", type=_nonnegative_float, help="activations etc. (default 0)")
    p.add_argument("--draft-layers", type=_draft_layers, default=0, help="MTP/EAGLE draft layers")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_layout_args(p)
    add_hisparse_args(p, "plan the HiSparse split")
    p.set_defaults(func=_cmd_plan)


def add_hisparse_args(p: argparse.ArgumentParser, what: str) -> None:
    """SGLang's HiSparse flags (DESIGN.md §13)."""
    g = p.add_argument_group("HiSparse (latent on the host, hot buffers on the device)")
    g.add_argument("--enable-hisparse", action="store_true", help=what)
    g.add_argument(
        "--hisparse-config",
        metavar="JSON",
        help='{"top_k": index_topk, "device_buffer_size": 2×top_k, "host_to_device_ratio": 2}',
    )


# --- engine commands: init-tiny, generate, serve ----------------------------------------------


def add_engine_args(p: argparse.ArgumentParser, seed: bool = True) -> None:
    """Every `EngineConfig` field as a flag (defaults live in `EngineConfig`); `seed=False`
    where the command's --seed is the requests' own (generate's)."""
    add_layout_args(p)
    g = p.add_argument_group("engine")
    _add_aliased(
        g,
        ("--tokenizer", "--tokenizer-path"),
        "the tokenizer's folder, where not the model's: its chat template and special tokens "
        "too (vLLM's)",
        dest="tokenizer",
        metavar="DIR",
    )
    g.add_argument("--kv-budget-gib", type=_positive_float, help="device KV pool size (default 1)")
    g.add_argument("--num-pages", type=_positive_int, help="device KV pool size in pages")
    g.add_argument(
        "--mem-fraction-static",
        type=_fraction,
        help="CUDA: size the KV pool as SGLang does: the memory free after the load less "
        "(1 - F) of the memory free before it, the least over ranks",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        help="vLLM's: taken and refused (dsakv cannot hold the whole instance to a share of "
        "the GPU); give --mem-fraction-static",
    )
    _add_aliased(  # (vLLM's --swap-space: the host memory a preempted request's KV goes to)
        g,
        ("--host-pool-gib", "--swap-space"),
        "host (CPU) KV tier size per rank, for retracted requests and evicted prefix pages; "
        "0 = off",
        dest="host_pool_gib",
        type=_nonnegative_float,
    )
    g.add_argument(
        "--chunked-prefill-size",
        type=_chunk_size,
        help="prefill tokens per step (-1: no chunking, whole prompts up to the context "
        "length; vLLM's --max-num-batched-tokens N is taken as N here, though vLLM counts a "
        "step's decode tokens in it too)",
    )
    g.add_argument(  # (no -1: vLLM's takes none)
        "--max-num-batched-tokens",
        dest="chunked_prefill_size",
        type=_positive_int,
        help=argparse.SUPPRESS,
    )
    # vLLM's switch for the above (on by default; off: every prompt whole) and SGLang's cap on
    # a step's prefill tokens, which bounds dsakv's only without chunking (`_fold_foreign`)
    g.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, help=argparse.SUPPRESS
    )
    g.add_argument("--max-prefill-tokens", type=_positive_int, help=argparse.SUPPRESS)
    _add_aliased(
        g,
        ("--max-running-requests", "--max-num-seqs"),
        "concurrency cap",
        dest="max_running_requests",
        type=_positive_int,
    )
    g.add_argument(  # SGLang's values dsakv runs: its fcfs, with or without priority, and lpm
        "--schedule-policy",
        type=_only(
            ("fcfs", "lpm"),
            "SGLang's priority order is --enable-priority-scheduling; dfs-weight, lof, random "
            "and routing-key it does not run",
        ),
        help=argparse.SUPPRESS,
    )
    g.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority", "lpm"),
        help="which waiting request runs first: fcfs (default), or priority: the requests' "
        "priority field, lower values first, then arrival; running ones of lower priority "
        "keep no room from it and are retracted first (vLLM's); lpm: the most cached prompt "
        "pages first (SGLang's --schedule-policy lpm, which takes fcfs too)",
    )
    g.add_argument(
        "--enable-priority-scheduling",
        action="store_true",
        help="SGLang's priority scheduling: higher values first, and a waiting request "
        "retracts running ones of lower priority to be admitted",
    )
    g.add_argument(
        "--schedule-low-priority-values-first",
        action="store_true",
        help="with --enable-priority-scheduling: lower values first (SGLang's)",
    )
    g.add_argument(
        "--priority-scheduling-preemption-threshold",
        type=_nonnegative_int,
        metavar="N",
        help="with --enable-priority-scheduling: a waiting request retracts running ones "
        "whose priority is worse than its own by more than N (default 10; SGLang's)",
    )
    _add_aliased(
        g,
        ("--max-model-len", "--context-length"),
        "context length in tokens",
        dest="max_model_len",
        type=_positive_int,
    )
    g.add_argument("--device", help="auto (default), cpu, cuda, cuda:N")
    g.add_argument(
        "--dtype",
        type=_DTYPE,
        choices=("auto", "float32", "bfloat16", "float16"),
        help="compute dtype (vLLM's half and float: float16, float32)",
    )
    _add_aliased(
        g,
        ("--no-prefix-cache", "--disable-radix-cache", "--no-enable-prefix-caching"),
        "disable the radix cache",
        dest="no_prefix_cache",
        action="store_true",
    )
    g.add_argument(  # vLLM's, the default: it undoes an earlier --no-enable-prefix-caching
        "--enable-prefix-caching",
        dest="no_prefix_cache",
        action="store_false",
        default=False,
        help=argparse.SUPPRESS,
    )
    g.add_argument(
        "--generation-config",
        choices=("auto", "vllm"),
        help="what requests leave out: auto (default), generation_config.json's sampling "
        "fields and max_new_tokens; vllm, SamplingParams' own (vLLM's flag)",
    )
    g.add_argument(
        "--attention-backend",
        help="auto (default: flashmla, else triton on CUDA, else cpu on a CPU), torch (the "
        "reference), cpu, triton, flashmla",
    )
    g.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        help="run CUDA decode steps eagerly (vLLM's --enforce-eager too)",
    )
    g.add_argument("--enforce-eager", action="store_true", help=argparse.SUPPRESS)
    g.add_argument(
        "--cuda-graph-max-bs",
        type=_positive_int,
        metavar="N",
        help="decode batches of up to N requests run as CUDA graphs, larger ones eagerly "
        "(default 128; SGLang's)",
    )
    g.add_argument(
        "--enable-torch-compile",
        action="store_true",
        help="cpu backend: decode steps of up to 4 requests run the layers' blocks the native "
        "kernels do not cover (no C++ compiler, a bf16 model) through torch.compile "
        "(a warm-up of 10-45 s per process)",
    )
    g.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="SGLang's: return_routed_experts (/generate, completions, chat; SamplingParams "
        "offline) may ask for the experts each token was routed to (its steps run eager, off "
        "the CUDA graphs)",
    )
    g.add_argument(
        "--enable-return-hidden-states",
        action="store_true",
        help="SGLang's: return_hidden_states (/generate, completions, chat) may ask for each "
        "token's last hidden state",
    )
    det = g.add_mutually_exclusive_group()
    det.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="require one per-token reduction order for every step: a request's tokens and "
        "logprobs do not depend on its batch, chunking, cache path or thread count (the "
        "default wherever it runs: the cpu backend, fp32 compute, one rank)",
    )
    det.add_argument(
        "--disable-deterministic-inference",
        action="store_true",
        help="the batched path of before (torch GEMMs for steps over 64 tokens)",
    )
    g.add_argument(
        "--speculative-algorithm",
        type=_SPECULATIVE,
        choices=("mtp",),
        help="draft with the MTP layer, verify (SGLang's NEXTN and EAGLE are it)",
    )
    g.add_argument(
        "--speculative-num-steps",
        type=_positive_int,
        help="MTP drafts per step, one chain (default 3; SGLang's --speculative-eagle-topk 1 "
        "and --speculative-num-draft-tokens N+1, vLLM's --speculative-config, taken)",
    )
    for flag in ("--speculative-eagle-topk", "--speculative-num-draft-tokens"):
        g.add_argument(flag, type=_positive_int, help=argparse.SUPPRESS)
    g.add_argument("--speculative-config", type=_speculative_config, help=argparse.SUPPRESS)
    for key in ("method", "num_speculative_tokens"):  # vLLM's dotted spelling (its recipes')
        g.add_argument(f"--speculative-config.{key}", dest=f"spec_{key}", help=argparse.SUPPRESS)
    if seed:
        g.add_argument(
            "--seed",
            type=_seed,
            help="the engine's: starts the generator requests without their own seed share "
            "(default 0)",
        )
    add_hisparse_args(p, "every token's latent on the host, a hot buffer per request here")
    add_parallel_args(p)


def add_ignored_args(p: argparse.ArgumentParser, serve: bool = False) -> None:
    """vLLM's / SGLang's switches that dsakv has no use for: taken, so their launch commands
    run, and ignored."""
    g = p.add_argument_group("accepted and ignored (vLLM / SGLang switches)")
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="dsakv runs no code from the model's folder: its own model code, the tokenizer "
        "without remote code",
    )
    g.add_argument(
        "--load-format",
        type=_only(("auto", "safetensors"), "it reads safetensors checkpoints"),
        metavar="{auto,safetensors}",
        help="vLLM's: the checkpoint is read as safetensors either way",
    )
    g.add_argument(
        "--tokenizer-mode",
        type=_only(
            ("auto", "hf", "deepseek_v32"),
            "the tokenizer is transformers' fast one and chats go through its Jinja chat "
            "template or --chat-template (DeepSeek-V3.2's, without one, through its "
            "encoding in code)",
        ),
        metavar="{auto,hf,deepseek_v32}",
        help="vLLM's: the tokenizer is transformers' fast one either way; deepseek_v32 (a "
        "DeepSeek-V3.2 model only) is its chat encoding, which dsakv runs in code",
    )
    g.add_argument(
        "--chat-template-content-format",
        type=_only(("auto", "string"), "it joins a message's text parts into one string"),
        metavar="{auto,string}",
        help="vLLM's: a message's text parts reach the template joined (its string format)",
    )
    for flag in ("--revision", "--tokenizer-revision"):  # (vLLM's; SGLang's --revision)
        g.add_argument(
            flag,
            type=_refused(
                "dsakv loads local folders only, not a version from the Hugging Face Hub: "
                "download that revision (huggingface-cli download --revision) and give its folder"
            ),
            help=argparse.SUPPRESS,
        )
    g.add_argument(
        "--max-seq-len-to-capture",
        type=_refused(
            "vLLM's (gone since vLLM 0.11): dsakv captures decode graphs for every context up "
            "to --max-model-len; --cuda-graph-max-bs caps their batch, --disable-cuda-graph "
            "turns them off"
        ),
        help=argparse.SUPPRESS,
    )
    if serve:
        g.add_argument(
            "--disable-log-requests",
            action="store_true",
            help="vLLM's: dsakv logs no requests",
        )
        g.add_argument(
            "--uvicorn-log-level",
            choices=UVICORN_LOG_LEVELS,
            help="vLLM's: the server's (uvicorn's) log level (default --log-level's, else info)",
        )
        g.add_argument(
            "--log-level",
            choices=UVICORN_LOG_LEVELS,
            help="SGLang's: every logger's level (dsakv's own default warning, -v info; "
            "trace is debug), and uvicorn's unless --uvicorn-log-level",
        )
        g.add_argument(
            "--disable-uvicorn-access-log",
            action="store_true",
            help="vLLM's: no log line per HTTP request",
        )
        g.add_argument("--max-log-len", type=int, metavar="N", help="vLLM's: dsakv logs no prompts")
        g.add_argument(
            "--enable-metrics", action="store_true", help="SGLang's: /metrics is always served"
        )
        g.add_argument(
            "--enable-auto-tool-choice",
            action="store_true",
            help='tool_choice "auto" needs no switch here (calls are parsed by --tool-call-parser)',
        )


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """Ranks and how the model is split over them (SGLang's flag names)."""
    g = p.add_argument_group("parallelism")
    _add_aliased(g, _TP, "tensor-parallel ranks, one process each", dest="tp", type=_positive_int)
    _add_aliased(g, _EP, "expert-parallel groups of whole experts", dest="ep", type=_positive_int)
    _add_dp_args(g, "each rank schedules its own requests")
    g.add_argument("--enable-expert-parallel", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--nnodes", type=_positive_int, help="machines the ranks span")
    g.add_argument("--node-rank", type=int, help="this machine's index (0 runs the server)")
    g.add_argument("--dist-init-addr", help="HOST:PORT of node 0's rendezvous")


def add_storage_args(p: argparse.ArgumentParser) -> None:
    """The L3 storage tier for prefix KV (SGLang's HiCache flag names where it has them)."""
    from dsakv.memory.storage import BACKENDS, WRITE_POLICIES

    g = p.add_argument_group("L3 prefix storage (KV that outlives the process)")
    g.add_argument("--hicache-storage-backend", choices=BACKENDS, help="off by default")
    g.add_argument("--hicache-storage-dir", metavar="DIR", help="file: where objects go")
    g.add_argument(
        "--hicache-storage-max-gib",
        type=_positive_float,
        help="file: size cap, LRU objects evicted (default none); mooncake: memory this "
        "engine lends the store (default 1)",
    )
    g.add_argument("--hicache-mooncake-master", metavar="HOST:PORT", help="mooncake_master")
    g.add_argument(
        "--hicache-mooncake-start-master",
        action="store_true",
        help="start a mooncake_master at --hicache-mooncake-master (127.0.0.1) for this machine",
    )
    g.add_argument(
        "--hicache-write-policy",
        choices=WRITE_POLICIES,
        help="write_through (default): every newly cached page; write_back: evicted pages",
    )
    g.add_argument(
        "--hicache-storage-prefetch-timeout",
        type=_nonnegative_float,
        metavar="S",
        help="longest a new request waits for its L3 lookup (default 2 s)",
    )


# Engine flags that set an `EngineConfig` field of another name: flag -> (field, value).
_OFF_FLAGS = {
    "no_elide_index_k": ("elide_index_k", False),
    "no_prefix_cache": ("enable_prefix_cache", False),
    "disable_deterministic_inference": ("enable_deterministic_inference", False),
}


def _fold_foreign(args: argparse.Namespace, model_dir: str) -> None:
    """SGLang's / vLLM's values and flags (`_FOLDED`) as dsakv's own flags, set in `args`
    (what serve-pd passes on), or refused where dsakv has no such meaning."""
    from dsakv.config import ModelConfig
    from dsakv.engine.engine import DRAFT_STEPS

    _check_dp_size(args)
    _fold_expert_parallel(args)
    if args.scheduling_policy == "fcfs" and args.enable_priority_scheduling:
        raise DsakvError("--scheduling-policy fcfs and --enable-priority-scheduling contradict")
    if getattr(args, "tokenizer_mode", None) == "deepseek_v32":
        model_type = ModelConfig.from_hf(model_dir).model_type
        if model_type != "deepseek_v32":
            raise DsakvError(
                f"--tokenizer-mode deepseek_v32 is DeepSeek-V3.2's chat encoding; this model "
                f"is {model_type}"
            )
    if args.enforce_eager:  # vLLM's: no CUDA graphs, nothing compiled
        if args.enable_torch_compile:
            raise DsakvError(
                "--enforce-eager (vLLM's: no CUDA graphs, nothing compiled) and "
                "--enable-torch-compile contradict: give one"
            )
        args.disable_cuda_graph, args.enforce_eager = True, False
    if args.schedule_policy == "lpm":
        if args.scheduling_policy not in (None, "lpm"):
            raise DsakvError(
                f"--schedule-policy lpm and --scheduling-policy {args.scheduling_policy}: give one"
            )
        args.scheduling_policy = "lpm"
    args.schedule_policy = None
    _fold_prefill_budget(args, model_dir)
    dotted = {
        "method": args.spec_method,
        "num_speculative_tokens": args.spec_num_speculative_tokens,
    }
    if dotted != dict.fromkeys(dotted):  # vLLM's --speculative-config.KEY VALUE flags
        if args.speculative_config is not None:
            raise DsakvError("--speculative-config and --speculative-config.KEY: give one")
        given = {k: v for k, v in dotted.items() if v is not None}
        with contextlib.suppress(KeyError, ValueError):
            given["num_speculative_tokens"] = int(given["num_speculative_tokens"])
        try:
            args.speculative_config = _speculative_config(json.dumps(given))
        except argparse.ArgumentTypeError as e:
            raise DsakvError(
                f"--speculative-config.method / .num_speculative_tokens: {e}"
            ) from None
        args.spec_method = args.spec_num_speculative_tokens = None
    if args.speculative_config is not None:
        if args.speculative_algorithm or args.speculative_num_steps:
            raise DsakvError(
                "--speculative-config and --speculative-algorithm / --speculative-num-steps "
                "both ask for speculative decoding: give one"
            )
        args.speculative_algorithm, args.speculative_num_steps = "mtp", args.speculative_config
        args.speculative_config = None  # (folded: a second call finds dsakv's flags alone)
    topk, tokens = args.speculative_eagle_topk, args.speculative_num_draft_tokens
    for flag, value in (("eagle-topk", topk), ("num-draft-tokens", tokens)):
        if value is not None and args.speculative_algorithm is None:
            raise DsakvError(f"--speculative-{flag} needs --speculative-algorithm")
    if topk not in (None, 1):
        raise DsakvError(
            f"--speculative-eagle-topk {topk}: dsakv drafts one chain (the top token at each "
            "step), not a tree: give 1 or leave it out"
        )
    steps = args.speculative_num_steps or DRAFT_STEPS
    if tokens is not None and tokens != steps + 1:
        raise DsakvError(
            f"--speculative-num-draft-tokens {tokens}: a chain of {steps} drafts "
            f"(--speculative-num-steps) verifies {steps + 1} tokens: give {steps + 1} or "
            "leave it out"
        )


def _fold_prefill_budget(args: argparse.Namespace, model_dir: str) -> None:
    """SGLang's `--chunked-prefill-size -1`, vLLM's `--no-enable-chunked-prefill` and
    SGLang's `--max-prefill-tokens` as dsakv's one per-step budget, which is the chunk size
    too: without chunking it is the context length (every prompt whole), or SGLang's cap on
    a step's prompt tokens where that is more; with chunking that cap cannot bind if it is
    at least the chunk, and is refused below it (SGLang still chunks at the chunk size)."""
    from dsakv.config import ModelConfig
    from dsakv.engine import EngineConfig

    size, cap = args.chunked_prefill_size, args.max_prefill_tokens
    if args.enable_chunked_prefill is not None or size == -1 or cap is not None:
        context = args.max_model_len or ModelConfig.from_hf(model_dir).max_position_embeddings
    if args.enable_chunked_prefill is False:  # vLLM's: a prompt runs whole
        if size not in (None, -1) and size < context:
            raise DsakvError(
                f"--no-enable-chunked-prefill with a budget of {size} prefill tokens a step "
                f"(--max-num-batched-tokens / --chunked-prefill-size): a prompt of up to the "
                f"context length, {context}, must fit one step (as vLLM requires): give at "
                "least that, or leave it out"
            )
        size = -1 if size is None else size
    elif args.enable_chunked_prefill and size == -1:
        raise DsakvError("--enable-chunked-prefill and --chunked-prefill-size -1 contradict")
    if size == -1:  # every prompt whole: a budget no prompt exceeds
        size = max(context, cap or 0)
    elif cap is not None and cap < (chunk := size or EngineConfig.chunked_prefill_size):
        raise DsakvError(
            f"--max-prefill-tokens {cap} is below the {chunk}-token chunk: dsakv's one "
            f"per-step prefill budget is the chunk size, so give --chunked-prefill-size {cap}"
        )
    args.chunked_prefill_size = size
    args.enable_chunked_prefill = args.max_prefill_tokens = None


def engine_config_from_args(args: argparse.Namespace):
    """The `EngineConfig` the engine flags (`add_engine_args`, `add_storage_args`) give:
    each flag given sets the field of its name (`_OFF_FLAGS`: another's), so a new flag
    cannot be forgotten here; a flag left out leaves the field's default."""
    from dsakv.engine import EngineConfig
    from dsakv.models.tiny import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    _fold_foreign(args, model_dir)
    kw: dict[str, Any] = {}
    for action in _actions(add_engine_args) + _actions(add_storage_args):
        if action.dest in _FOLDED:
            continue
        value = getattr(args, action.dest, None)
        if value is not None and value is not False:  # (given)
            name, value = _OFF_FLAGS.get(action.dest, (action.dest, value))
            kw[name] = value
    return EngineConfig.from_kwargs(model_dir, **kw)


def _cmd_init_tiny(args: argparse.Namespace) -> int:
    from dsakv.models.tiny import TINY_PRESETS, write_tiny_model

    if args.preset not in TINY_PRESETS:
        raise DsakvError(f"unknown preset {args.preset!r} (choose from {', '.join(TINY_PRESETS)})")
    if not 0 <= args.seed < 2**63 - 1:  # (torch.manual_seed takes seed and seed + 1)
        raise DsakvError(f"--seed must be in 0..{2**63 - 2}, got {args.seed}")
    if not args.dir:  # (Path("") is the current directory)
        raise DsakvError("init-tiny needs a directory to write into, got an empty path")
    out = Path(args.dir)
    if out.exists() and not out.is_dir():
        raise DsakvError(f"{args.dir} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):  # never write over someone's files or model
        raise DsakvError(f"{args.dir} is not empty; init-tiny writes into a new or empty directory")
    path = write_tiny_model(
        args.dir, preset=args.preset, seed=args.seed, mtp=args.mtp, weights=args.weights
    )
    print(
        f"wrote {args.preset} (seed {args.seed}, {args.weights} weights, MTP layer: {args.mtp}) "
        f"to {path}"
    )
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from dsakv.engine import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        stop=tuple(args.stop or ()),
        ignore_eos=args.ignore_eos,
    )
    config = engine_config_from_args(args)
    with LLM(config) as llm:
        if llm.tokenizer is None:  # the engine's own message offers token ids: not a flag here
            raise DsakvError(
                f"{config.model} has no tokenizer, so generate cannot encode text "
                "(the Python API, LLM.generate, takes token ids)"
            )
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    if args.json:
        rows = [
            {
                "prompt": p,
                "text": o.text,
                "token_ids": o.token_ids,
                "finish_reason": o.finish_reason,
                "metrics": o.metrics,
            }
            for p, o in zip(args.prompt, outputs)
        ]
        print(json.dumps(rows, indent=2))
    else:
        for p, o in zip(args.prompt, outputs):
            print(f"{p!r} -> {o.text!r} ({o.finish_reason}, {len(o.token_ids)} tokens)")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from dsakv.server import run_server

    with contextlib.ExitStack() as held:  # the ports, taken before the engine loads
        listener = held.enter_context(listen(args.host, args.port))
        config, bridge = engine_config_from_args(args), None
        disaggregation = disagg_config_from_args(args)
        if disaggregation is not None:  # a prefill or decode server
            from dsakv.disagg.serving import bridge_for

            bootstrap = None
            if disaggregation.mode == "prefill":  # it listens twice
                if disaggregation.bootstrap_port == args.port:
                    raise DsakvError("--disaggregation-bootstrap-port must differ from --port")
                bootstrap = held.enter_context(listen(args.host, disaggregation.bootstrap_port))
            bridge = bridge_for(disaggregation, config, args.host, reserved=bootstrap)
        run_server(
            config,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            served_model_name=args.served_model_name,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            bridge=bridge,
            listener=listener,
            chat_template=args.chat_template,
            log_level=_uvicorn_log_level(args),
            access_log=not args.disable_uvicorn_access_log,
        )
    return 0


def _uvicorn_log_level(args: argparse.Namespace) -> str:
    """vLLM's --uvicorn-log-level, else SGLang's --log-level (its HTTP server's default)."""
    return args.uvicorn_log_level or args.log_level or "info"


def _chat_template(value: str) -> str:
    """argparse type for --chat-template: the template, read and parsed now."""
    from dsakv.server.chat import load_chat_template

    try:
        return load_chat_template(value)
    except DsakvError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _chat_parser(kind: str) -> Callable[[str], str]:
    """argparse type for --tool-call-parser / --reasoning-parser (names live in the server)."""

    def check(name: str) -> str:
        from dsakv.server.parsers import resolve_parsers

        try:
            resolve_parsers("", *((name, None) if kind == "tool" else (None, name)))
        except DsakvError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return name

    return check


def _add_engine_commands(sub: Any) -> None:
    p = sub.add_parser("init-tiny", help="write a deterministic random tiny model")
    p.add_argument("dir")
    p.add_argument("--preset", default="glm-tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--mtp",
        choices=("fit", "random", "none"),
        default="fit",
        help="MTP draft layer: fitted to the target (default), unfitted, or none",
    )
    p.add_argument(
        "--weights",
        choices=("fp32", "bf16", "fp8"),
        default="fp32",
        help="how the checkpoint stores the weights: fp32 (default), bf16, or fp8: the "
        "layers' projections as e4m3 128x128 blocks with fp32 scales, the rest bf16",
    )
    p.set_defaults(func=_cmd_init_tiny)

    p = sub.add_parser("generate", help="complete prompts offline")
    p.add_argument("model", nargs="?", help="model directory or tiny preset (default: embedded)")
    _add_model_option(p)
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    p.add_argument("--max-tokens", type=_positive_int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument(
        "--seed",
        type=int,
        dest="sampling_seed",
        metavar="SEED",
        help="every prompt's sampling seed (the engine's seed stays its default)",
    )
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true")
    add_engine_args(p, seed=False)
    add_storage_args(p)
    add_ignored_args(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("model", nargs="?", help="model directory or tiny preset (default: embedded)")
    _add_model_option(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=8000)
    p.add_argument("--api-key", help="require this Bearer token")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        help="name(s) clients use; the first is reported (default: the model dir's name)",
    )
    p.add_argument(
        "--tool-call-parser",
        type=_chat_parser("tool"),
        default="auto",
        help="glm47, glm45, deepseekv32, none (default auto: the model type's)",
    )
    p.add_argument(
        "--reasoning-parser",
        type=_chat_parser("reasoning"),
        default="auto",
        help="glm45, deepseek-v3, none (default auto: the model type's)",
    )
    p.add_argument(
        "--chat-template",
        type=_chat_template,
        help="a Jinja chat template, or a file holding one (default: the tokenizer's)",
    )
    add_engine_args(p)
    add_storage_args(p)
    add_disagg_args(p)
    add_ignored_args(p, serve=True)
    p.set_defaults(func=_cmd_serve)


# --- prefill/decode disaggregation -------------------------------------------------------------


def add_disagg_args(p: argparse.ArgumentParser) -> None:
    """`dsakv serve` flags (SGLang's names) that make it a prefill or decode server."""
    g = p.add_argument_group("prefill/decode disaggregation")
    g.add_argument(
        "--disaggregation-mode", choices=MODES, help="serve as a prefill or decode server"
    )
    g.add_argument(
        "--disaggregation-bootstrap-port",
        type=int,
        default=DEFAULT_BOOTSTRAP_PORT,
        help=f"prefill: handshake port for decode servers (default {DEFAULT_BOOTSTRAP_PORT})",
    )
    g.add_argument(
        "--disaggregation-timeout",
        type=_positive_float,
        default=60.0,
        help="seconds either side waits for the other (default 60)",
    )
    g.add_argument(
        "--disaggregation-transfer-host",
        help="address Mooncake listens on (default: --host, or this machine's if a wildcard)",
    )


def disagg_config_from_args(args: argparse.Namespace) -> DisaggConfig | None:
    if not getattr(args, "disaggregation_mode", None):
        return None
    return DisaggConfig(
        args.disaggregation_mode,
        args.disaggregation_bootstrap_port,
        args.disaggregation_timeout,
        args.disaggregation_transfer_host,
    )


def _cmd_router(args: argparse.Namespace) -> int:
    from dsakv.disagg.launch import run_router_on
    from dsakv.disagg.router import build_router_app

    build_router_app(args.prefill, args.decode)  # bad URLs fail before anything listens
    with listen(args.host, args.port) as listener:
        run_router_on(listener, args.prefill, args.decode)
    return 0


def _cmd_serve_pd(args: argparse.Namespace) -> int:
    from dsakv.disagg.launch import serve_pd
    from dsakv.models.tiny import resolve_model_dir

    ports = [args.port, args.prefill_port, args.decode_port, args.bootstrap_port]
    given = [p for p in ports if p is not None]
    if len(set(given)) < len(given):
        raise DsakvError("--port, --prefill-port, --decode-port and --bootstrap-port must differ")
    config = engine_config_from_args(args)  # what either server would refuse, refused once
    for mode in MODES:  # (first: a bad flag is its own error, whoever holds the port)
        DisaggConfig(mode, timeout_s=args.disaggregation_timeout).check_engine(config)
    with listen(args.host, args.port) as listener:  # the router's, held from now
        for p in ports[1:]:
            if p is not None:  # (each server takes its own at its start)
                check_listen("127.0.0.1", p)
        flags = _flags(args, add_engine_args)
        flags += ["--disaggregation-timeout", str(args.disaggregation_timeout)]
        if args.served_model_name:
            flags += ["--served-model-name", *args.served_model_name]
        if args.api_key:
            flags += ["--api-key", args.api_key]
        flags += ["--uvicorn-log-level", _uvicorn_log_level(args)]
        level = args.log_level or ("info" if args.verbose else None)  # (-v's too: theirs)
        if level:
            flags += ["--log-level", level]
        if args.disable_uvicorn_access_log:
            flags += ["--disable-uvicorn-access-log"]
        serve_pd(
            resolve_model_dir(args.model),
            flags,
            args.host,
            args.port,
            args.prefill_port,
            args.decode_port,
            args.bootstrap_port,
            listener=listener,
        )
    return 0


def _actions(add_args: Callable[[argparse.ArgumentParser], None]) -> list[argparse.Action]:
    """The arguments `add_args` defines (to read them back from parsed args)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_args(parser)
    return parser._actions


def _flags(args: argparse.Namespace, add_args: Any) -> list[str]:
    """The flags `add_args` defines, as given on this command line (to pass them on)."""
    out: list[str] = []
    for action in _actions(add_args):
        if action.help == argparse.SUPPRESS:
            continue  # (a hidden alias: dsakv's own flag passes the value)
        value = getattr(args, action.dest, None)
        if value is None or value is False or value == action.default:
            continue
        flag = action.option_strings[-1]
        out += [flag] if value is True else [flag, str(value)]
    return out


def _add_disagg_commands(sub: Any) -> None:
    """`dsakv router` and `dsakv serve-pd`."""
    p = sub.add_parser("router", help="OpenAI front door over prefill and decode servers")
    p.add_argument("--prefill", action="append", required=True, metavar="URL", help="repeatable")
    p.add_argument("--decode", action="append", required=True, metavar="URL", help="repeatable")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=8000)
    p.set_defaults(func=_cmd_router)

    p = sub.add_parser(
        "serve-pd", help="a prefill server, a decode server and the router, on this machine"
    )
    p.add_argument("model", nargs="?", help="model directory or tiny preset (default: embedded)")
    _add_model_option(p)
    p.add_argument("--host", default="127.0.0.1", help="the router's address")
    p.add_argument("--port", type=port, default=8000, help="the router's port")
    p.add_argument("--prefill-port", type=port, help="(default: a free port)")
    p.add_argument("--decode-port", type=port, help="(default: a free port)")
    p.add_argument("--bootstrap-port", type=port, help="(default: a free port)")
    p.add_argument(
        "--disaggregation-timeout",
        type=_positive_float,
        default=60.0,
        help="seconds either side waits for the other (default 60)",
    )
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("--api-key")
    add_engine_args(p)
    add_ignored_args(p, serve=True)
    p.set_defaults(func=_cmd_serve_pd)


# --- bench -----------------------------------------------------------------------------------


# bench's one-section modes: (flag, the other flags it takes besides --model, --quick, --json)
_BENCH_MODES = {
    "enable_deterministic_inference": ("--enable-deterministic-inference", ()),
    "weight_formats": ("--weight-formats", ()),
    "enable_hisparse": ("--enable-hisparse", ("device", "hisparse_config")),
    "sparse_vs_dense": ("--sparse-vs-dense", ("lengths",)),
    "serving": ("--serving", ("device", "engine_arg", "repeats")),
}
# The rest of bench's flags, with their defaults: what the main job (no mode) takes.
_BENCH_FLAGS = {
    "full": False,
    "plot": None,
    "tp": 1,
    "pd": False,
    "device": "cpu",
    "hicache_storage_backend": None,
    "hicache_storage_dir": None,
    "hicache_mooncake_master": None,
    "lengths": None,
    "engine_arg": None,
    "repeats": None,
    "hisparse_config": None,
}
_MAIN_JOB = ("full", "plot", "tp", "pd", "device", "hicache_storage_backend",
             "hicache_storage_dir", "hicache_mooncake_master")  # fmt: skip


def _check_bench_flags(args: argparse.Namespace) -> str | None:
    """The mode `args` asks for (None: the main job), once its flags are known to go
    together and its outputs can be written: refused now, not after minutes of work."""
    modes = [m for m in _BENCH_MODES if getattr(args, m)]
    if len(modes) > 1:
        names = " and ".join(_BENCH_MODES[m][0] for m in modes)
        raise DsakvError(f"{names} each run one section alone: pick one")
    mode = modes[0] if modes else None
    takes = _BENCH_MODES[mode][1] if mode else _MAIN_JOB
    stray = _stray_flags(args, _BENCH_FLAGS, takes)
    if stray:
        what = f"{_BENCH_MODES[mode][0]} runs only its section: it" if mode else "the main job"
        hint = " (engine settings go in --engine-arg KEY=VALUE)" if mode == "serving" else ""
        raise DsakvError(f"{what} does not take {', '.join(stray)}{hint}")
    if mode is None and not args.full and args.hicache_storage_backend:
        raise DsakvError("the L3 section runs with --full: add it, or drop --hicache-*")
    _check_output_file("--json", args.json)
    for flag, where in (("--plot", args.plot), ("--hicache-storage-dir", args.hicache_storage_dir)):
        if where is None:
            continue
        if Path(where).exists() and not Path(where).is_dir():
            raise DsakvError(f"{flag} {where} exists and is not a directory")
        if (blocker := write_blocker(Path(where))) is not None:
            raise DsakvError(f"{flag} {where}: cannot create files under {blocker}")
    return mode


def _stray_flags(
    args: argparse.Namespace, defaults: dict[str, Any], takes: Sequence[str]
) -> list[str]:
    """The flags given (not at their `defaults`) that a mode does not take."""
    return [
        "--" + key.replace("_", "-")
        for key, default in defaults.items()
        if key not in takes and getattr(args, key) not in (default, [])
    ]


def _check_output_file(flag: str, path: str | None) -> None:
    """`path` can be written as a file: not a directory, its folder creatable and writable
    (tried, see `dsakv.writable`)."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise DsakvError(f"{flag} {path} is a directory; give a file")
    if p.exists():
        if not can_append(p):
            raise DsakvError(f"{flag} {path} cannot be written")
    elif (blocker := write_blocker(p.parent)) is not None:
        raise DsakvError(f"{flag} {path}: cannot create it under {blocker}")


def _cmd_bench(args: argparse.Namespace) -> int:
    mode = _check_bench_flags(args)
    if mode is not None:
        return {
            "enable_deterministic_inference": _bench_determinism,
            "weight_formats": _bench_weight_formats,
            "enable_hisparse": _bench_hisparse,
            "sparse_vs_dense": _bench_sparse_vs_dense,
            "serving": _bench_serving,
        }[mode](args)
    from dsakv.bench import run_bench

    if args.tp > 1 or args.full:  # sections that come late: check the model now
        from dsakv.config import ModelConfig
        from dsakv.distributed import ParallelConfig
        from dsakv.models.tiny import resolve_model_dir

        config = ModelConfig.from_hf(resolve_model_dir(args.model, "glm-bench"))
        ParallelConfig(tp=args.tp).check_model(config)
        if args.full and not config.num_nextn_predict_layers:
            raise DsakvError(
                "--full runs the MTP section: this model has no MTP layer "
                "(num_nextn_predict_layers 0; init-tiny writes one unless --mtp none)"
            )
    run_bench(
        args.model,
        quick=args.quick,
        json_path=args.json,
        plot_dir=args.plot,
        tp_size=args.tp,
        pd=args.pd,
        device=_bench_device(args.device),
        storage=_bench_storage(args),
        full=args.full,
    )
    return 0


def _section_report(args: argparse.Namespace, r: dict, lines: list[str]) -> int:
    """A one-section bench's figures: into `--json` when given, its summary on stdout."""
    from pathlib import Path

    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(r, indent=2))
    print("\n".join(lines))
    return 0


def _bench_sparse_vs_dense(args: argparse.Namespace) -> int:
    """`dsakv bench --sparse-vs-dense`: only the prefill comparison (`bench.prefill`)."""
    from dsakv.bench.prefill import run_prefill_sparse_vs_dense, summary_lines

    lengths = args.lengths or ((512, 1024) if args.quick else (1024, 4096, 8192))
    r = run_prefill_sparse_vs_dense(args.model, lengths)
    return _section_report(args, r, summary_lines(r))


def _bench_determinism(args: argparse.Namespace) -> int:
    """`dsakv bench --enable-deterministic-inference`: only its cost (`bench.determinism`)."""
    from dsakv.bench.determinism import run_determinism_bench, summary_lines

    r = run_determinism_bench(args.model, quick=args.quick)
    return _section_report(args, r, summary_lines(r))


def _bench_weight_formats(args: argparse.Namespace) -> int:
    """`dsakv bench --weight-formats`: fp32 vs bf16 vs FP8-block weights (`bench.weight_formats`)."""
    from dsakv.bench.weight_formats import run_weight_formats_bench, summary_lines
    from dsakv.models.tiny import TINY_PRESETS

    preset = args.model or "glm-bench"
    if preset not in TINY_PRESETS:
        raise DsakvError(
            f"--weight-formats writes its own bf16 and fp8 checkpoints: --model must be a tiny "
            f"preset ({', '.join(TINY_PRESETS)}), got {preset!r}"
        )
    r = run_weight_formats_bench(preset, quick=args.quick)
    return _section_report(args, r, summary_lines(r))


def _bench_hisparse(args: argparse.Namespace) -> int:
    """`dsakv bench --enable-hisparse`: only the HiSparse section (`bench.hisparse`)."""
    from dsakv.bench.hisparse import run_hisparse_bench, summary_lines

    r = run_hisparse_bench(
        args.model, args.hisparse_config, quick=args.quick, device=_bench_device(args.device)
    )
    return _section_report(args, r, summary_lines(r))


def _lengths(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(","))
    except ValueError:
        out = ()
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1024,4096, got {text!r}")
    return out


def _bench_serving(args: argparse.Namespace) -> int:
    """`dsakv bench --serving`: only the in-process vs `dsakv serve` decode-rate section."""
    from dataclasses import replace

    from dsakv.bench import serving_rate as sr
    from dsakv.engine import EngineConfig
    from dsakv.models.tiny import resolve_model_dir

    engine_args = dict(args.engine_arg or [])
    if args.device != "cpu" or "device" in engine_args:
        engine_args.setdefault("device", args.device)
    path = resolve_model_dir(args.model, "glm-bench")
    sr.serve_flags(EngineConfig.from_kwargs(path, **engine_args), engine_args)  # fail fast
    sizes = sr.QUICK if args.quick else sr.DEFAULT
    if args.repeats is not None:
        sizes = replace(sizes, repeats=args.repeats)
    sr.run_serving_rate(
        path,
        quick=args.quick,
        sizes=sizes,
        engine_args=engine_args,
        json_path=args.json,
        print_summary=True,
    )
    return 0


def _engine_arg(text: str) -> tuple[str, Any]:
    """argparse type for --engine-arg KEY=VALUE: VALUE as JSON (numbers, true, null), else
    as the string it is."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):  # (not JSON; or past its digit or nesting limits)
        parsed = value
    return key.strip().replace("-", "_"), parsed


def _bench_device(name: str) -> str:
    from dsakv.engine.engine import resolve_device

    return str(resolve_device(name))


def _bench_storage(args: argparse.Namespace) -> dict[str, Any] | None:
    """Where the L3 section stores (default: files in a temporary directory)."""
    from dsakv.procs import split_address

    backend, where = args.hicache_storage_backend, args.hicache_storage_dir
    master = args.hicache_mooncake_master
    if backend is None and (where or master):
        raise DsakvError(
            "--hicache-storage-dir / --hicache-mooncake-master need --hicache-storage-backend"
        )
    if backend == "file" and master or backend == "mooncake" and where:
        raise DsakvError(
            "--hicache-storage-dir is for file, --hicache-mooncake-master for mooncake"
        )
    if master:
        split_address(master, "--hicache-mooncake-master")
    if backend is None:
        return None
    return {"backend": backend, "storage_dir": where, "mooncake_master": master}


def _add_bench(sub: Any) -> None:
    p = sub.add_parser("bench", help="capacity, throughput and parity of index-K elision")
    p.add_argument("--model", help="model directory or tiny preset (default: embedded glm-bench)")
    p.add_argument(
        "--full",
        action="store_true",
        help="every section (transformers baseline, IndexCache, FP8 vs fp32, KV movement, MTP, "
        "L3 storage, CPU paths); by default only capacity, elided vs dense throughput and parity",
    )
    p.add_argument(
        "--quick", action="store_true", help="with --full: smaller workloads (the core's sizes)"
    )
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    p.add_argument("--plot", metavar="DIR", help="write PNG charts")
    p.add_argument(
        "--tp", type=_positive_int, default=1, help="add the tensor / DP-attention section"
    )
    p.add_argument("--pd", action="store_true", help="add prefill -> decode KV transfer")
    p.add_argument(
        "--sparse-vs-dense",
        action="store_true",
        help="only prefill time, sparse vs dense attention, cpu vs torch backend "
        "(default model glm-bench-short; 1K/4K/8K, --quick 512/1K)",
    )
    p.add_argument(
        "--lengths", type=_lengths, metavar="L1,L2", help="context lengths for --sparse-vs-dense"
    )
    p.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="only what the mode costs: prefill and decode tok/s at 1 and 32 requests, off "
        "vs on (default model glm-bench; --quick: one round, 8 decode tokens)",
    )
    p.add_argument(
        "--weight-formats",
        action="store_true",
        help="only decode / prefill tok/s of the model's weights held as fp32, bf16 and FP8 "
        "blocks (CPU; a tiny preset, default glm-bench, written both ways; --quick: 8 requests, "
        "one round)",
    )
    p.add_argument(
        "--device", default="cpu", help="where the engine sections run: cpu (default), cuda, auto"
    )
    add_hisparse_args(
        p,
        "run only the HiSparse section: off / on-dense / on-elided at one device budget "
        "(default model glm-hisparse: glm-bench-short with index_topk 64; config default "
        '{"host_to_device_ratio": 4})',
    )
    g = p.add_argument_group("serving rate (decode tok/s in process vs through dsakv serve)")
    g.add_argument(
        "--serving",
        action="store_true",
        help="run only this section: 1 and 32 requests (--quick: 1 and 8, 32 tokens)",
    )
    g.add_argument(
        "--engine-arg",
        type=_engine_arg,
        action="append",
        metavar="KEY=VALUE",
        help="an engine argument for both sides, e.g. attention_backend=torch (repeatable)",
    )
    g.add_argument("--repeats", type=_positive_int, help="rounds per concurrency, medians reported")
    from dsakv.memory.storage import BACKENDS

    g = p.add_argument_group("L3 section (default: files in a temporary directory)")
    g.add_argument("--hicache-storage-backend", choices=BACKENDS)
    g.add_argument("--hicache-storage-dir", metavar="DIR")
    g.add_argument(
        "--hicache-mooncake-master", metavar="HOST:PORT", help="(default: start one on loopback)"
    )
    p.set_defaults(func=_cmd_bench)


# --- device-check ----------------------------------------------------------------------------


def _cmd_device_check(args: argparse.Namespace) -> int:
    mode = "--compile-only" if args.compile_only else "--prepare" if args.prepare else None
    if mode is not None:
        takes = ("triton_path",) if args.compile_only else ("dry_run", "prepare")
        defaults = dict(dry_run=False, out=None, models=None, stages=None, deadline=[],
                        budget=None, bench=False, prepare=None)  # fmt: skip
        stray = _stray_flags(args, defaults, takes)
        if stray:
            raise DsakvError(f"{mode} does not take {', '.join(stray)}")
    if args.compile_only:  # no GPU: a clean subprocess compiles every kernel for sm_90
        from dsakv.kernels.triton_aot import run_compile_only

        return run_compile_only(args.triton_path)
    if args.triton_path:
        raise DsakvError("--triton-path goes with --compile-only")
    from dsakv.bench import device_check as dc

    if args.prepare:
        for row in dc.prepare_models(args.prepare, dry_run=args.dry_run):
            print(json.dumps(row))
        return 0
    deadlines = {}
    for item in args.deadline:
        name, _, secs = item.partition("=")
        try:
            deadlines[name] = float(secs)
        except ValueError:
            raise DsakvError(f"--deadline wants STAGE=SECONDS, got {item!r}") from None
    try:
        result = dc.run_device_check(
            args.out,
            dry_run=args.dry_run,
            models=args.models,
            stages=args.stages.split(",") if args.stages else None,
            deadlines=deadlines,
            budget=args.budget,
            bench=args.bench,
        )
    except ValueError as e:
        raise DsakvError(str(e)) from None
    print(dc.summary(result), flush=True)
    print(f"wrote {args.out or dc.default_out()}/{dc.JSON_NAME}", flush=True)
    return 0 if result["ok"] else 1


def _add_device_check(sub: Any) -> None:
    p = sub.add_parser("device-check", help="the one prepared GPU run (kernels, graphs, decode)")
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    p.add_argument("--out", default=None, help="results folder ($OUT, else device-check-out)")
    p.add_argument("--models", metavar="DIR", help="prepared models (default: .device-models)")
    p.add_argument("--prepare", metavar="DIR", help="only write the models into DIR")
    p.add_argument("--stages", help="a subset, e.g. decode,kernel_bandwidth")
    p.add_argument("--deadline", action="append", default=[], metavar="STAGE=SECONDS",
                   help="override one stage's deadline (repeatable)")  # fmt: skip
    p.add_argument("--budget", type=_positive_float, help="seconds for all stages (GPU: 525)")
    p.add_argument("--bench", action="store_true", help="then `dsakv bench --quick`, in time left")
    p.add_argument("--compile-only", action="store_true",
                   help="no GPU: compile every Triton kernel for sm_90, ptxas resource use")  # fmt: skip
    p.add_argument("--triton-path", metavar="DIR",
                   help="with --compile-only: another triton's folder first (e.g. .triton-3.6)")  # fmt: skip
    p.set_defaults(func=_cmd_device_check)


# --- calibrate-pattern -----------------------------------------------------------------------


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from dsakv.calibrate import (
        Pricing,
        calibrate_pattern,
        check_config_dir,
        check_plot_path,
        report_text,
        write_config,
        write_plot,
    )
    from dsakv.models.loader import torch_dtype
    from dsakv.models.tiny import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    if args.write_config:
        check_config_dir(model_dir, args.write_config)
    if args.plot:
        check_plot_path(args.plot)

    def on_step(s: Any) -> None:
        if not args.json:
            print(f"{s.num_full_layers} full: KL {s.kl:.4e} ({s.pattern})", file=sys.stderr)

    result = calibrate_pattern(
        model_dir,
        data=args.data,
        num_full_layers=args.num_full_layers,
        target_bytes_per_token=args.target_bytes_per_token,
        pricing=Pricing(
            args.kv_cache_dtype,
            args.index_k_dtype,
            args.page_size,
            args.draft_layers,
            args.kv_budget_gib,
        ),
        max_seq_len=args.max_seq_len,
        batch_size=args.batch_size,
        seed=args.seed,
        device=args.device,
        dtype=torch_dtype(args.dtype),
        on_step=on_step,
    )
    report = result.to_json()
    report["model"] = model_dir
    if args.write_config:
        report["config_dir"] = str(write_config(model_dir, args.write_config, result.plan))
    if args.plot:
        report["plot"] = str(write_plot(result, args.plot))
    print(json.dumps(report, indent=2) if args.json else report_text(result))
    return 0


def _add_calibrate(sub: Any) -> None:
    from dsakv.memory.layout import DEFAULT_LATENT_DTYPE, INDEX_K_DTYPES, LATENT_DTYPES

    p = sub.add_parser(
        "calibrate-pattern", help="IndexCache greedy search: which layers keep their indexer"
    )
    p.add_argument("model", help="model directory or tiny preset")
    p.add_argument("--data", metavar="FILE.jsonl", help='{"text"} or {"token_ids"} per line')
    budget = p.add_mutually_exclusive_group()
    budget.add_argument(
        "--num-full-layers", type=_positive_int, metavar="N", help="default: layers // 4"
    )
    budget.add_argument(
        "--target-bytes-per-token", type=_positive_int, metavar="B", help="stop at <= B"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--write-config", metavar="DIR", help="config.json with the pattern + links")
    p.add_argument("--plot", metavar="FILE.png", help="KL and bytes/token per full-layer count")
    p.add_argument("--seed", type=int, default=0, help="tie order and built-in data")
    p.add_argument("--max-seq-len", type=_positive_int, help="default: 2 x index_topk")
    p.add_argument("--batch-size", type=_positive_int, default=4, help="sequences per forward")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N")
    p.add_argument("--dtype", type=_DTYPE, choices=("float32", "bfloat16"), default="float32")
    g = p.add_argument_group("pricing (as dsakv plan)")
    g.add_argument(
        "--kv-cache-dtype",
        type=_kv_cache_dtype,
        choices=LATENT_DTYPES,
        default=DEFAULT_LATENT_DTYPE,
    )
    g.add_argument("--index-k-dtype", choices=INDEX_K_DTYPES, default="fp8")
    g.add_argument("--page-size", type=_positive_int, default=64)
    g.add_argument("--draft-layers", type=_draft_layers, default=0, help="MTP/EAGLE draft layers")
    g.add_argument("--kv-budget-gib", type=_positive_float, default=100.0)
    p.set_defaults(func=_cmd_calibrate)


# --- entry point -----------------------------------------------------------------------------

_COMMANDS: list[Callable[[Any], None]] = [
    _add_plan,
    _add_engine_commands,
    _add_disagg_commands,
    _add_bench,
    _add_calibrate,
    _add_device_check,
]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dsakv", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        with interrupts_deferred():
            # torch's own imports swallow a Ctrl-C or leave numpy half-loaded ("cannot load
            # module more than once"); the parser's choices import it anyway.
            import torch  # noqa: F401
        args = build_parser().parse_args(argv)
        _fold_model_option(args)
        logging.basicConfig(level=_log_level(args), format="%(levelname)s %(name)s: %(message)s")
        code = args.func(args) or 0
        sys.stdout.flush()  # (a reader gone shows here, not at exit)
        return code
    except BrokenPipeError:
        if not _stdout_gone():
            raise
        # The reader went away (`dsakv plan … | head -1`): stop quietly, as other CLIs do, and
        # leave the exit status a process that SIGPIPE ended has (128 + 13).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the exit flush)
        return 141
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # A full disk (`dsakv plan … > /dev/full`, a model written there): one line and
        # status 1, as other CLIs say it (not 2: nothing the user gave was wrong).
        print(f"error: cannot write the output: {e.strerror}", file=sys.stderr)
        with contextlib.suppress(OSError):  # (a stdout without a file descriptor)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the exit flush)
        return 1
    except DsakvError as e:
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)  # 2: bad input; a rank that died says 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        from dsakv.distributed.parallel import is_dist_error

        if not is_dist_error(e):
            raise
        print(f"error: a rank failed: {e}".splitlines()[0], file=sys.stderr)
        return 1


def _log_level(args: argparse.Namespace) -> int:
    """-v's INFO, or SGLang's --log-level (`serve`; uvicorn's trace is debug here)."""
    level = getattr(args, "log_level", None)
    if level is None:
        return logging.INFO if args.verbose else logging.WARNING
    if args.verbose and level != "info":
        raise DsakvError(f"-v (info) and --log-level {level} disagree: give one")
    return logging.DEBUG if level == "trace" else getattr(logging, level.upper())


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (any other broken pipe is a
    failure to report)."""
    import select

    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll(), or no real stdout
        return False


def run() -> NoReturn:
    """The `dsakv` command: `main`, then exit. Where a thread of ours is still running at
    the end (an engine load that a Ctrl-C cut short goes on inside torch), the interpreter's
    own exit would abort the process ("terminate called without an active exception",
    SIGABRT) as it stops that thread in C++ code: end it here instead, once the atexit
    hooks have run."""
    try:
        code = main()
    except SystemExit as e:  # (argparse's: --help, a bad flag)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    sys.stdout.flush()
    sys.stderr.flush()
    if any(t.daemon and t.name.startswith("dsakv-") for t in threading.enumerate()):
        atexit._run_exitfuncs()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
