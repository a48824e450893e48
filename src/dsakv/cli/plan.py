"""`dsakv plan`: the KV capacity plan, dense and elided side by side, without loading a model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dsakv.config.layer_plan import plan_overrides
from dsakv.errors import DsakvError

from .args import (
    EP,
    TP,
    add_aliased,
    add_dp_args,
    add_hisparse_args,
    add_layout_args,
    check_dp_size,
    draft_layers,
    fold_expert_parallel,
    fraction,
    nonnegative_float,
    positive_float,
    positive_int,
)


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
    check_dp_size(args)
    fold_expert_parallel(args)
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


def add_commands(sub: Any) -> None:
    p = sub.add_parser("plan", help="KV capacity plan: bytes per token and pool tokens")
    p.add_argument("model", help="preset (glm-5, glm-5.2, deepseek-v3.2) or model path")
    add_aliased(p, TP, "tensor-parallel degree", dest="tp", type=positive_int, default=1)
    add_aliased(p, EP, "expert-parallel groups (default 1)", dest="ep", type=positive_int)
    p.add_argument("--enable-expert-parallel", action="store_true", help=argparse.SUPPRESS)
    add_dp_args(p, "one scheduler and pool per rank")
    p.add_argument("--kv-budget-gib", type=positive_float, help="explicit KV budget")
    p.add_argument("--gpu-memory-gib", type=positive_float, help="GPU memory per rank")
    p.add_argument("--mem-fraction-static", type=fraction, help="of --gpu-memory-gib (default 0.9)")
    p.add_argument(
        "--weights-gib", type=nonnegative_float, help="override the estimated weights per rank"
    )
    p.add_argument("--reserve-gib", type=nonnegative_float, help="activations etc. (default 0)")
    p.add_argument("--draft-layers", type=draft_layers, default=0, help="MTP/EAGLE draft layers")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_layout_args(p)
    add_hisparse_args(p, "plan the HiSparse split")
    p.set_defaults(func=_cmd_plan)
