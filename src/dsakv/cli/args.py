"""The flags the commands share, their argparse types, and the `EngineConfig` they give:
vLLM's and SGLang's spellings taken, folded into dsakv's own, or refused in one line. With
them the log levels they set, and which flags a command line gave (to pass them on:
`given_flags`; to refuse those a mode does not take: `stray_flags`). What a flag sets is
read off its definition (`actions`, `OFF_FLAGS`, `FOLDED`), by `dsakv bench` too."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from dsakv.config.layer_plan import PARTITION_WANT, parse_layer_partition
from dsakv.errors import DsakvError, load_json
from dsakv.procs import Listener
from dsakv.server.tracing import SGLANG_ENDPOINT as SGLANG_TRACES_ENDPOINT


class Parser(argparse.ArgumentParser):
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
    message: argparse's own would name the type function ("invalid positive_int value")."""
    try:
        value = convert(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    return _checked(text, float, lambda v: 0 < v <= _MAX_FLOAT, f"a number in (0, {_MAX_FLOAT:g}]")


def fraction(text: str) -> float:
    return _checked(text, float, lambda v: 0 < v <= 1, "a number in (0, 1]")


def nonnegative_float(text: str) -> float:
    return _checked(text, float, lambda v: 0 <= v <= _MAX_FLOAT, f"a number in [0, {_MAX_FLOAT:g}]")


def port(text: str) -> int:
    return _checked(text, int, lambda v: 0 < v < 65536, "an integer in 1..65535")


def api_key(text: str) -> str:
    """`--api-key` (serve, router, serve-pd): a key a client can send (`checked_api_key`)."""
    from dsakv.server.auth import checked_api_key  # (fastapi: not for every command)

    try:
        return checked_api_key(text)
    except DsakvError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def listen(host: str, port: int):
    """A `Listener` on `host:port`: a port in use or a bad address fails now, in one line,
    not after the engine has loaded, in uvicorn's words; and nothing can take the port
    while it loads (the server serves these sockets)."""
    return Listener(host, port)


def check_listen(host: str, port: int) -> None:
    """Fail now, in one line, where `host:port` cannot be listened on (a port another
    process of ours will bind)."""
    listen(host, port).close()


def draft_layers(text: str) -> int:
    return _checked(text, int, lambda v: 0 <= v <= 64, "an integer in 0..64")


def _nonnegative_int(text: str) -> int:
    return _checked(text, int, lambda v: v >= 0, "an integer >= 0")


def positive_int(text: str) -> int:
    return _checked(text, int, lambda v: v >= 1, "an integer >= 1")


def layer_partition(text: str) -> tuple[int, ...]:
    """argparse type for --pp-layer-partition: each stage's target layers, comma-separated
    (SGLang's SGLANG_PP_LAYER_PARTITION)."""
    return _checked(text, parse_layer_partition, lambda v: True, PARTITION_WANT)


def add_pp_args(g: Any, help: str, **kw: Any) -> None:
    """--pp-size (its vLLM spelling hidden) and --pp-layer-partition."""
    add_aliased(g, PP, help, dest="pp", type=positive_int, **kw)
    g.add_argument(
        "--pp-layer-partition",
        type=layer_partition,
        metavar="N,N,...",
        help="target layers per pipeline stage (default: as even as vLLM's and SGLang's split)",
    )


def _chunk_size(text: str) -> int:
    """argparse type: a size, or SGLang's -1 (no chunking: `_fold_foreign` makes it the
    context length)."""
    return _checked(text, int, lambda v: v >= 1 or v == -1, "an integer >= 1, or -1 (no chunking)")


def _speculative_config(text: str) -> tuple[str, int, int | None, int | None]:
    """argparse type for vLLM's --speculative-config JSON: its MTP methods and its n-gram
    prompt lookup, as (algorithm, drafts per step, shortest and longest n-gram matched)."""
    try:
        spec = json.loads(text)
    except (ValueError, RecursionError):
        spec = None
    want = (
        '{"method": "deepseek_mtp" or "mtp", "num_speculative_tokens": N in 1..16} or '
        '{"method": "ngram", "num_speculative_tokens": N, "prompt_lookup_min": A, '
        '"prompt_lookup_max": B}'
    )
    keys = {"method", "num_speculative_tokens", *_LOOKUP}
    if not isinstance(spec, dict) or not spec or not set(spec) <= keys:
        raise argparse.ArgumentTypeError(f"dsakv takes {want}, got {text!r}")
    method = {"deepseek_mtp": "mtp", "mtp": "mtp", "ngram": "ngram", "ngram_gpu": "ngram"}.get(
        spec.get("method", "mtp")
    )
    # vLLM's defaults: for these models their own MTP layer, as many drafts as it has (one);
    # n-gram lookup needs the count, and matches 5 tokens unless told (one bound: both)
    n = spec.get("num_speculative_tokens", 1 if method == "mtp" else None)
    if method == "ngram" and n is None:
        raise argparse.ArgumentTypeError(f"ngram needs num_speculative_tokens, got {text!r}")
    lo, hi = (spec.get(k) for k in _LOOKUP)
    lookup = (lo, hi) != (None, None)
    if method is None or (method == "mtp" and lookup) or not (type(n) is int and 1 <= n <= 16):
        raise argparse.ArgumentTypeError(f"dsakv takes {want}, got {text!r}")
    if method == "mtp":
        return method, n, None, None
    lo, hi = (lo, hi) if lookup else (5, 5)
    lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
    if not all(type(v) is int and 1 <= v <= 1024 for v in (lo, hi)) or lo > hi:
        raise argparse.ArgumentTypeError(
            f"prompt_lookup_min <= prompt_lookup_max, each in 1..1024, got {text!r}"
        )
    return method, n, lo, hi


_LOOKUP = ("prompt_lookup_min", "prompt_lookup_max")  # (vLLM's n-gram keys)


def _structured_outputs_config(text: str) -> dict[str, str]:
    """argparse type for vLLM's --structured-outputs-config JSON (its StructuredOutputsConfig),
    as what dsakv takes of it: `backend` (`_grammar_backend`) and `reasoning_parser` (vLLM's
    --reasoning-parser: `_fold_structured_outputs` sets it; empty, vLLM's default, sets
    nothing). Keys for what dsakv does anyway are taken: `disable_any_whitespace` (its JSON
    grammars admit no free whitespace, asked or not), `disable_fallback` (one backend, none
    to fall back to), and the defaults of the rest; what those ask for otherwise (the
    guidance backend's switch, a grammar inside the reasoning, plugin code) is one line."""
    try:
        spec = json.loads(text)
    except (ValueError, RecursionError):
        spec = None
    if not isinstance(spec, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    unknown = sorted(set(spec) - set(_STRUCTURED_KEYS))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown key(s) {', '.join(unknown)} (vLLM's StructuredOutputsConfig has "
            f"{', '.join(_STRUCTURED_KEYS)})"
        )
    for key, value in spec.items():
        if type(value) is not _STRUCTURED_KEYS[key]:
            want = "a string" if _STRUCTURED_KEYS[key] is str else "true or false"
            raise argparse.ArgumentTypeError(f"{key} must be {want}, got {value!r}")
    refused = (
        (
            "disable_additional_properties",
            "disable_additional_properties is the guidance backend's (vLLM refuses it beside "
            "xgrammar too): dsakv's structured output runs on xgrammar",
        ),
        (
            "enable_in_reasoning",
            "enable_in_reasoning: dsakv enforces a grammar once the reasoning is over (vLLM's "
            "default): give false or leave it out",
        ),
        (
            "reasoning_parser_plugin",
            "reasoning_parser_plugin: dsakv runs no plugin code, its reasoning parsers are "
            "--reasoning-parser's",
        ),
    )
    for key, why in refused:
        if spec.get(key):
            raise argparse.ArgumentTypeError(why)
    out = {}
    if "backend" in spec:
        try:
            out["backend"] = _grammar_backend(spec["backend"])
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"backend: {e}") from None
    if spec.get("reasoning_parser"):
        out["reasoning_parser"] = chat_parser("reasoning")(spec["reasoning_parser"])
    return out


# vLLM's StructuredOutputsConfig: each key and the JSON type of its value
_STRUCTURED_KEYS = {
    "backend": str,
    "disable_fallback": bool,
    "disable_any_whitespace": bool,
    "disable_additional_properties": bool,
    "reasoning_parser": str,
    "reasoning_parser_plugin": str,
    "enable_in_reasoning": bool,
}


def _kv_events_config(text: str) -> str:
    """argparse type for vLLM's and SGLang's --kv-events-config: the JSON, checked, kept as
    text (what serve-pd passes on)."""
    from dsakv.config.kv_events import KVEventsConfig

    try:
        KVEventsConfig.parse(text)
    except DsakvError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _byte_count(text: str) -> int:
    """argparse type for vLLM's --kv-cache-memory-bytes: bytes, with vLLM's suffixes too
    (`human_readable_int`): k, m, g, t decimal (25.6k: 25,600), K, M, G, T binary and whole
    (2G: 2 × 2³⁰)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text.strip())
    value = None
    if match:
        number, suffix = match.groups()
        if "." in number and not suffix.islower():
            value = None  # (vLLM's: no fractions of a byte or of a binary unit)
        elif suffix:
            unit = 1000 if suffix.islower() else 1024
            value = int(float(number) * unit ** ("kmgt".index(suffix.lower()) + 1))
        else:
            value = int(number)
    if value is None or not 1 <= value <= _MAX_FLOAT * 2**30:
        raise argparse.ArgumentTypeError(
            f"must be a number of bytes >= 1 (vLLM's suffixes: 25.6k, 512M, 2G), got {text!r}"
        )
    return value


def _generation_overrides(text: str) -> str:
    """argparse type for vLLM's --override-generation-config: the JSON, checked, kept as
    text (what serve-pd passes on)."""
    from dsakv.engine.config import check_generation_overrides

    try:
        check_generation_overrides(text)
    except DsakvError as e:
        message = str(e).removeprefix("override_generation_config: ")
        raise argparse.ArgumentTypeError(message) from None
    return text


def _json_strings(text: str) -> tuple[str, ...]:
    """argparse type for vLLM's --allowed-origins / --allowed-methods / --allowed-headers:
    a JSON list of strings."""
    value = _json_as(text, list)
    if value is None or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(
            f"must be a JSON list of strings (vLLM's), e.g. '[\"https://app.example\"]', "
            f"got {text!r}"
        )
    return tuple(value)


def _adapter(name: str, path: str, text: str) -> tuple[str, str]:
    """(name, path) of one adapter given at start, both non-empty."""
    if not name or not path:
        raise argparse.ArgumentTypeError(f"an adapter needs a name and a path, got {text!r}")
    return name, path


def _lora_module(text: str) -> tuple[str, str]:
    """argparse type for vLLM's --lora-modules: NAME=PATH, or its JSON
    {"name", "path", "base_model_name"} (the base model is the one served: its name is
    taken, and the adapter's card names the served one)."""
    if not text.lstrip().startswith("{"):
        name, _, path = text.partition("=")
        return _adapter(name, path, text)
    spec = _json_object(text, {"name": str, "path": str, "base_model_name": str})
    return _adapter(spec.get("name", ""), spec.get("path", ""), text)


def _lora_path(text: str) -> tuple[str, str]:
    """argparse type for SGLang's --lora-paths: NAME=PATH, a bare PATH (named by it), or its
    JSON {"lora_name", "lora_path", "pinned"} (pinned false: dsakv pins no adapter)."""
    if not text.lstrip().startswith("{"):
        name, eq, path = text.partition("=")
        return _adapter(name, path, text) if eq else _adapter(text, text, text)
    spec = _json_object(text, {"lora_name": str, "lora_path": str, "pinned": bool})
    if spec.get("pinned"):
        raise argparse.ArgumentTypeError(
            "pinned: dsakv keeps no adapter in a slot of its own (slots go to the adapters "
            "running requests use, least recently used first): give false or leave it out"
        )
    return _adapter(spec.get("lora_name", ""), spec.get("lora_path", ""), text)


def _json_object(text: str, keys: dict[str, type]) -> dict[str, Any]:
    """`text` as a JSON object whose keys are among `keys`, each value of its type."""
    spec = _json_as(text, dict)
    want = ", ".join(keys)
    if spec is None or not set(spec) <= set(keys):
        raise argparse.ArgumentTypeError(f"must be a JSON object of {want}, got {text!r}")
    for key, value in spec.items():
        if type(value) is not keys[key]:
            raise argparse.ArgumentTypeError(f"{key} must be a {keys[key].__name__}, got {text!r}")
    return spec


def _json_as(text: str, kind: type) -> Any:
    """`text` as JSON of type `kind`; None where it is not (not JSON, past `load_json`'s
    limits, another type): the caller's argparse error says what it must be."""
    try:
        value = load_json(text, "not JSON")
    except DsakvError:
        return None
    return value if isinstance(value, kind) else None


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


def _only_number(supported: float, why: str) -> Callable[[str], float]:
    """`_only` for a numeric flag: any spelling of the one value dsakv takes (0, 0.0, 00)."""

    def check(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        if value != supported:
            raise argparse.ArgumentTypeError(f"dsakv takes {supported:g} ({why}), got {text!r}")
        return value

    return check


# vLLM's structured-output backends dsakv takes: xgrammar, and auto (vLLM's pick; dsakv's
# is xgrammar always)
_grammar_backend = _only(("xgrammar", "auto"), "its structured output runs on xgrammar")


def _detailed_traces(text: str) -> str:
    """argparse type for vLLM's --collect-detailed-traces (`detailed_trace_modules`): a bad
    value is one error line before anything starts."""
    from dsakv.engine.config import detailed_trace_modules

    try:
        detailed_trace_modules(text)
    except DsakvError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _refused(why: str) -> Callable[[str], str]:
    """argparse type for a vLLM / SGLang flag that asks, whatever its value, for what dsakv
    does not do: one line saying why."""

    def check(text: str) -> str:
        raise argparse.ArgumentTypeError(why)

    return check


def kv_cache_dtype(text: str) -> str:
    """argparse type: "auto" (vLLM's and SGLang's default) is dsakv's default, "fp8" e4m3
    (as SGLang maps it), "bfloat16" bf16."""
    from dsakv.memory.layout import DEFAULT_LATENT_DTYPE

    return _spelled({"auto": DEFAULT_LATENT_DTYPE, "fp8": "fp8_e4m3", "bfloat16": "bf16"})(text)


DTYPE = _spelled({"half": "float16", "float": "float32"})  # (vLLM's and SGLang's)
# SGLang runs DeepSeek / GLM MTP as NEXTN or EAGLE (with no draft model: the nextn layer)
# (and SGLang's NGRAM is vLLM's ngram: prompt lookup)
_SPECULATIVE = _spelled(
    {"nextn": "mtp", "eagle": "mtp", "mtp": "mtp", "ngram": "ngram"}, fold_case=True
)

# SGLang's names for --tp and --ep (vLLM's the long ones) besides dsakv's own.
TP = ("--tp", "--tp-size", "--tensor-parallel-size", "-tp")
EP = ("--ep", "--ep-size", "--expert-parallel-size")
# SGLang's --pp-size and vLLM's --pipeline-parallel-size.
PP = ("--pp-size", "--pipeline-parallel-size", "-pp")
# SGLang's (and vLLM's) data-parallel size: dsakv's is --tp's under --dp-attention, else 1.
_DP = ("--dp-size", "--dp", "--data-parallel-size", "-dp")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # (vLLM's)
# SGLang's kernel choices within its DSA attention backend and for its MoE layers: taken
# and ignored, dsakv's kernels being --attention-backend's.
_SGLANG_DSA_KERNELS = ("flashmla_sparse", "flashmla_sparse_q8", "flashmla_kv", "flashmla_auto")
_SGLANG_DSA_KERNELS += ("flashinfer_sparse_mla", "fa3", "tilelang", "aiter", "trtllm")
_SGLANG_MOE_KERNELS = ("auto", "deep_gemm", "triton", "triton_kernel", "flashinfer_trtllm")
_SGLANG_MOE_KERNELS += ("flashinfer_trtllm_routed", "flashinfer_cutlass", "flashinfer_mxfp4")
_SGLANG_MOE_KERNELS += ("flashinfer_cutedsl", "cutlass", "aiter", "marlin")
# Hidden flags with no field of their own: `_fold_foreign` checks them against dsakv's
# flags, then they are dropped (never passed on: serve-pd passes what they checked).
FOLDED = (
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
    "spec_prompt_lookup_min",
    "spec_prompt_lookup_max",
    "enable_hierarchical_cache",
    "hicache_ratio",
    "hicache_size",
    "moe_a2a_backend",
    "kv_cache_memory_bytes",
    "lora_paths",
)


def add_model_option(p: argparse.ArgumentParser) -> None:
    """SGLang's --model-path and vLLM's --model, hidden: the model as a flag
    (`fold_model_option` makes it the positional's)."""
    for flag in ("--model-path", "--model"):
        p.add_argument(flag, dest="model_option", help=argparse.SUPPRESS)


def fold_model_option(args: argparse.Namespace) -> None:
    option = getattr(args, "model_option", None)
    if option is None:
        return
    if args.model is not None and args.model != option:
        raise DsakvError(
            f"the model is given twice ({args.model!r} and --model-path/--model {option!r})"
        )
    args.model = option


def add_aliased(g: Any, flags: Sequence[str], help: str, **kw: Any) -> None:
    """`flags[0]` and, hidden, its other spellings: --help shows dsakv's name and an error
    the spelling given (not "--tp/--tp-size/--tensor-parallel-size")."""
    g.add_argument(flags[0], help=f"{help} (also {', '.join(flags[1:])})", **kw)
    for alias in flags[1:]:
        g.add_argument(alias, help=argparse.SUPPRESS, **kw)


def add_dp_args(g: Any, help: str) -> None:
    """--dp-attention (SGLang's --enable-dp-attention too) and, hidden, the DP size's
    spellings, each kept with the flag given: `check_dp_size` names it."""
    help += " (also --enable-dp-attention; --dp-size, --dp or --data-parallel-size: --tp's N)"
    g.add_argument("--dp-attention", action="store_true", help=help)
    g.add_argument(
        "--enable-dp-attention", dest="dp_attention", action="store_true", help=argparse.SUPPRESS
    )
    for flag in _DP:
        g.add_argument(
            flag,
            dest="dp_size",
            type=lambda text, flag=flag: (flag, positive_int(text)),
            help=argparse.SUPPRESS,
        )


def fold_expert_parallel(args: argparse.Namespace) -> None:
    """vLLM's --enable-expert-parallel and SGLang's --moe-a2a-backend deepep (which sets its
    ep size to its tp size): the experts split over every rank (after `check_dp_size`:
    vLLM's -dp N is N ranks here), dsakv's --ep set to the ranks."""
    a2a, args.moe_a2a_backend = getattr(args, "moe_a2a_backend", None), None
    if a2a == "deepep":
        flag = "--moe-a2a-backend deepep"
    elif args.enable_expert_parallel:
        flag = "--enable-expert-parallel"
    else:
        return
    ranks = args.tp or 1
    if args.ep not in (None, ranks):
        raise DsakvError(
            f"{flag} splits the experts over all {ranks} rank(s); --ep {args.ep} says "
            "otherwise: give one"
        )
    args.ep = ranks if ranks > 1 else args.ep
    args.enable_expert_parallel = False


def check_dp_size(args: argparse.Namespace) -> None:
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
        type=kv_cache_dtype,
        choices=LATENT_DTYPES,
        default=None,
        help=f"latent (default {DEFAULT_LATENT_DTYPE}, also spelled auto or fp8; bfloat16: bf16)",
    )
    g.add_argument("--index-k-dtype", choices=INDEX_K_DTYPES, default=None)
    add_aliased(
        g,
        ("--page-size", "--block-size"),
        "tokens per page",
        dest="page_size",
        type=positive_int,
        default=None,
    )
    g.add_argument("--no-elide-index-k", action="store_true", help="dense index-K on every layer")
    g.add_argument("--index-topk-pattern", help="per-layer F/S string overriding the checkpoint")
    g.add_argument("--index-topk-freq", type=int, help="run the indexer every N layers")
    g.add_argument("--index-skip-topk-offset", type=int, help="first layer the freq applies from")
    g.add_argument("--no-index-share", action="store_true", help="every layer runs its indexer")


def add_host_tier_args(g: Any) -> None:
    """The host KV tier's sizes (`fold_host_tier` reads SGLang's)."""
    add_aliased(  # (vLLM's --swap-space: the host memory a preempted request's KV goes to)
        g,
        ("--host-pool-gib", "--swap-space"),
        "host (CPU) KV tier size per rank, for retracted requests and evicted prefix pages; "
        "0 = off",
        dest="host_pool_gib",
        type=nonnegative_float,
    )
    g.add_argument(
        "--host-pool-ratio",
        type=positive_float,
        metavar="R",
        help="the host KV tier as R times the device pool's pages, sized with the pool "
        "(SGLang's --enable-hierarchical-cache [--hicache-ratio R, default 2]; its "
        "--hicache-size G, G GB per rank, is --host-pool-gib)",
    )
    # SGLang's host tier: its switch and sizes, folded into the two above (`_fold_foreign`)
    g.add_argument("--enable-hierarchical-cache", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--hicache-ratio", type=positive_float, help=argparse.SUPPRESS)
    g.add_argument("--hicache-size", type=nonnegative_float, help=argparse.SUPPRESS)


def add_hisparse_args(p: argparse.ArgumentParser, what: str) -> None:
    """SGLang's HiSparse flags (DESIGN.md §13)."""
    g = p.add_argument_group("HiSparse (latent on the host, hot buffers on the device)")
    g.add_argument("--enable-hisparse", action="store_true", help=what)
    g.add_argument(
        "--hisparse-config",
        metavar="JSON",
        help='{"top_k": index_topk, "device_buffer_size": 2×top_k ((K+2)×top_k with K drafts), '
        '"host_to_device_ratio": 2}',
    )


def add_chat_args(p: argparse.ArgumentParser) -> None:
    """What a server's OpenAI routes answer as: the model's names, its chat template and
    the parsers of its output (`serve`'s, and `run-batch`'s, which runs those routes)."""
    p.add_argument(
        "--served-model-name",
        nargs="+",
        help="name(s) clients use; the first is reported (default: the model dir's name)",
    )
    p.add_argument(
        "--tool-call-parser",
        type=chat_parser("tool"),
        default="auto",
        help="glm47, glm45, deepseekv32, deepseekv31, none (default auto: the model type's)",
    )
    p.add_argument(
        "--reasoning-parser",
        type=chat_parser("reasoning"),
        default="auto",
        help="glm45, deepseek-v3, none (default auto: the model type's)",
    )
    p.add_argument(
        "--chat-template",
        type=chat_template,
        help="a Jinja chat template, or a file holding one (default: the tokenizer's)",
    )


def chat_template(value: str) -> str:
    """argparse type for --chat-template: the template, read and parsed now."""
    from dsakv.server.chat import load_chat_template

    try:
        return load_chat_template(value)
    except DsakvError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def chat_parser(kind: str) -> Callable[[str], str]:
    """argparse type for --tool-call-parser / --reasoning-parser (names live in the server)."""

    def check(name: str) -> str:
        if name == "auto":  # (the default, which argparse checks on every parse: at once,
            return name  # as the parsers' module loads torch)
        from dsakv.server.parsers import resolve_parsers

        try:
            resolve_parsers("", *((name, None) if kind == "tool" else (None, name)))
        except DsakvError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return name

    return check


def add_engine_args(p: argparse.ArgumentParser, seed: bool = True, serve: bool = True) -> None:
    """Every `EngineConfig` field as a flag (defaults live in `EngineConfig`); `seed=False`
    where the command's --seed is the requests' own (generate's); `serve=False` leaves off
    the flags only a server's routes use (generate's)."""
    add_layout_args(p)
    g = p.add_argument_group("engine")
    add_aliased(
        g,
        ("--tokenizer", "--tokenizer-path"),
        "the tokenizer's folder, where not the model's: its chat template and special tokens "
        "too (vLLM's)",
        dest="tokenizer",
        metavar="DIR",
    )
    g.add_argument(
        "--kv-budget-gib",
        type=positive_float,
        help="device KV pool size (default 1; vLLM's --kv-cache-memory-bytes N: N / 2^30)",
    )
    g.add_argument("--kv-cache-memory-bytes", type=_byte_count, help=argparse.SUPPRESS)
    g.add_argument(
        "--num-pages",
        type=positive_int,
        help="device KV pool size in pages",
    )
    g.add_argument(
        "--max-total-tokens",
        type=positive_int,
        metavar="T",
        help="cap on the device KV pool, in tokens (SGLang's): the least of what its size "
        "gives and T, in whole pages (a warning where T is more)",
    )
    g.add_argument(
        "--mem-fraction-static",
        type=fraction,
        help="CUDA: size the KV pool as SGLang does: the memory free after the load less "
        "(1 - F) of the memory free before it, the least over ranks",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=fraction,
        help="vLLM's: taken and refused (dsakv cannot hold the whole instance to a share of "
        "the GPU); give --mem-fraction-static",
    )
    add_host_tier_args(g)
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
        type=positive_int,
        help=argparse.SUPPRESS,
    )
    # vLLM's switch for the above (on by default; off: every prompt whole) and SGLang's cap on
    # a step's prefill tokens, which bounds dsakv's only without chunking (`_fold_foreign`)
    g.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, help=argparse.SUPPRESS
    )
    g.add_argument("--max-prefill-tokens", type=positive_int, help=argparse.SUPPRESS)
    add_aliased(
        g,
        ("--max-running-requests", "--max-num-seqs"),
        "concurrency cap",
        dest="max_running_requests",
        type=positive_int,
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
    add_aliased(
        g,
        ("--max-model-len", "--context-length"),
        "context length in tokens",
        dest="max_model_len",
        type=positive_int,
    )
    g.add_argument("--device", help="auto (default), cpu, cuda, cuda:N")
    g.add_argument(
        "--dtype",
        type=DTYPE,
        choices=("auto", "float32", "bfloat16", "float16"),
        help="compute dtype (vLLM's half and float: float16, float32)",
    )
    add_aliased(
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
    if serve:  # (generate's sampling is its own flags': their defaults, greedy)
        g.add_argument(
            "--generation-config",
            choices=("auto", "vllm"),
            help="what requests leave out: auto (default), generation_config.json's sampling "
            "fields and max_new_tokens; vllm, SamplingParams' own (vLLM's flag)",
        )
        g.add_argument(
            "--override-generation-config",
            type=_generation_overrides,
            metavar="JSON",
            help="vLLM's: sampling defaults over --generation-config's, e.g. "
            "'{\"temperature\": 0.6}' (temperature, top_p, top_k, min_p, "
            "repetition_penalty, max_new_tokens; null drops the model's); a request's own "
            "values still win",
        )
    g.add_argument(
        "--attention-backend",
        type=_spelled({"nsa": "auto", "dsa": "auto"}),
        help="auto (default: flashmla, else triton on CUDA, else cpu on a CPU), torch (the "
        "reference), cpu, triton, flashmla (SGLang's nsa and dsa, its DSA backend: auto)",
    )
    g.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        help="run CUDA decode steps eagerly (vLLM's --enforce-eager too)",
    )
    g.add_argument("--enforce-eager", action="store_true", help=argparse.SUPPRESS)
    g.add_argument(
        "--cuda-graph-max-bs",
        type=positive_int,
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
    if serve:
        g.add_argument(
            "--collect-detailed-traces",
            type=_detailed_traces,
            metavar="MODULES",
            help="vLLM's (with --otlp-traces-endpoint): each request's span also carries the "
            "time its steps spent in the scheduler, and with worker their run "
            "(time_in_model_execute), with model the model's forward pass alone "
            "(time_in_model_forward: the GPU synced around it, a cost each step); model, "
            "worker, all, or several comma-separated",
        )
        g.add_argument(
            "--enable-return-routed-experts",
            action="store_true",
            help="SGLang's: return_routed_experts (/generate, completions, chat) may ask for "
            "the experts each token was routed to (its steps run eager, off the CUDA graphs)",
        )
        g.add_argument(
            "--enable-return-hidden-states",
            action="store_true",
            help="SGLang's: return_hidden_states (/generate, completions, chat) may ask for "
            "each token's last hidden state",
        )
        g.add_argument(
            "--expert-distribution-recorder-mode",
            choices=["stat", "per_token"],
            help="SGLang's: /start_expert_distribution_record, /stop_... and /dump_... count "
            "the experts each MoE layer routes tokens to (stat: EPLB's per-layer counts; "
            "per_token: each token's experts), written under "
            "$SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR (default /tmp); steps run eager while "
            "recording",
        )
        g.add_argument(
            "--expert-distribution-recorder-buffer-size",
            type=int,
            help="SGLang's: a stat dump keeps the last N steps' counts (default 1000; -1: all)",
        )
        g.add_argument(
            "--stream-interval",
            type=positive_int,
            metavar="N",
            help="SGLang's and vLLM's: a request's tokens reach its stream N at a time (its "
            "first and last at once): fewer, larger chunks (default 1)",
        )
        g.add_argument(
            "--watchdog-timeout",
            type=positive_float,
            metavar="S",
            help="SGLang's: an engine step running longer than S seconds means the engine is "
            "stuck: the server logs every thread's stack and exits (code 70) for its "
            "supervisor to restart it (default 300)",
        )
        g.add_argument(
            "--kv-events-config",
            type=_kv_events_config,
            metavar="JSON",
            help="vLLM's and SGLang's: publish the prefix cache's pages stored and removed "
            "over ZMQ for KV-aware routers (Dynamo, llm-d), e.g. "
            '{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5558"} '
            "(vLLM's keys and defaults: endpoint tcp://*:5557, topic empty; SGLang's "
            '{"publisher": "zmq"} too; DP rank r publishes on the ports plus r)',
        )
    det = g.add_mutually_exclusive_group()
    det.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="require one per-token reduction order for every step: a request's tokens and "
        "logprobs do not depend on its batch, chunking, cache path or thread count (the "
        "default wherever it runs: the cpu backend, fp32 compute, one rank a stage; under "
        "--tp on request)",
    )
    det.add_argument(
        "--disable-deterministic-inference",
        action="store_true",
        help="the batched path of before (torch GEMMs for steps over 64 tokens)",
    )
    g.add_argument(
        "--speculative-algorithm",
        type=_SPECULATIVE,
        choices=("mtp", "ngram"),
        help="draft with the MTP layer (SGLang's NEXTN and EAGLE are it) or by n-gram lookup "
        "in the request's own tokens (SGLang's NGRAM, vLLM's ngram), verify",
    )
    g.add_argument(
        "--speculative-num-steps",
        type=positive_int,
        help="drafts per step, one chain (default 3; SGLang's --speculative-eagle-topk 1 "
        "and --speculative-num-draft-tokens N+1, vLLM's --speculative-config, taken)",
    )
    for end in ("min", "max"):
        g.add_argument(
            f"--speculative-ngram-{end}-match-window-size",
            type=positive_int,
            help=f"n-gram drafts: the {'shortest' if end == 'min' else 'longest'} suffix "
            f"looked up (SGLang's; default {1 if end == 'min' else 12})",
        )
    for flag in ("--speculative-eagle-topk", "--speculative-num-draft-tokens"):
        g.add_argument(flag, type=positive_int, help=argparse.SUPPRESS)
    g.add_argument("--speculative-config", type=_speculative_config, help=argparse.SUPPRESS)
    # vLLM's dotted spelling (its recipes')
    for key in ("method", "num_speculative_tokens", *_LOOKUP):
        g.add_argument(f"--speculative-config.{key}", dest=f"spec_{key}", help=argparse.SUPPRESS)
    if seed:
        add_aliased(
            g,
            ("--seed", "--random-seed"),
            "the engine's: starts the generator requests without their own seed share (default 0)",
            dest="seed",
            type=_seed,
        )
    add_hisparse_args(p, "every token's latent on the host, a hot buffer per request here")
    if serve:  # (a server's requests pick their adapter: `model`, /generate's lora_path)
        add_lora_args(p)
    add_parallel_args(p)


def add_lora_args(p: argparse.ArgumentParser) -> None:
    """LoRA adapters, vLLM's flags and SGLang's (`_fold_lora` folds SGLang's --lora-paths
    into --lora-modules)."""
    g = p.add_argument_group("LoRA adapters")
    g.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve PEFT LoRA adapters beside the base model: a request names one by its "
        "`model` (/generate: lora_path); steps with adapter rows run the torch path",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        type=_lora_module,
        metavar="NAME=PATH",
        help="adapters loaded at start (vLLM's; its JSON form too: "
        '{"name": N, "path": P, "base_model_name": B})',
    )
    g.add_argument(  # SGLang's: NAME=PATH, a bare PATH (its name), or its JSON
        "--lora-paths", nargs="+", action="extend", type=_lora_path, help=argparse.SUPPRESS
    )
    add_aliased(
        g,
        ("--max-loras", "--max-loras-per-batch"),
        "adapters resident at once: distinct adapters in one running batch (default 1)",
        dest="max_loras",
        type=positive_int,
    )
    g.add_argument(
        "--max-lora-rank",
        type=positive_int,
        help="the largest adapter rank r taken (default 16; a larger one is refused)",
    )
    add_aliased(
        g,
        ("--max-cpu-loras", "--max-loaded-loras"),
        "adapters kept loaded in host memory (default: no limit)",
        dest="max_cpu_loras",
        type=positive_int,
    )
    g.add_argument(
        "--lora-target-modules",
        nargs="+",
        action="extend",
        metavar="MODULE",
        help="SGLang's: the modules given adapter slots (q_a_proj, o_proj, gate_proj, ..., "
        "gate_up_proj, or all: the default); an adapter adapting another is refused",
    )
    g.add_argument(
        "--fully-sharded-loras",
        action="store_true",
        help="vLLM's: under --tp split the slots' other half too (column-parallel layers' A by "
        "rank, row-parallel ones' B by rows, the routed experts' over their MoE TP ranks), "
        "for one small collective per adapted layer; --max-lora-rank must divide by --tp",
    )


def add_ignored_lora_args(g: argparse._ArgumentGroup) -> None:
    """vLLM's and SGLang's LoRA settings for what dsakv does its own way: taken, no effect."""
    g.add_argument(
        "--lora-dtype",
        choices=("auto", "float16", "bfloat16", "float32"),
        help="vLLM's: an adapter's A and B are held in its base layer's dtype",
    )
    g.add_argument(
        "--lora-backend",
        metavar="KERNEL",
        help="SGLang's LoRA kernel: dsakv adds each token's delta its own way",
    )
    g.add_argument(
        "--lora-eviction-policy",
        type=_only(("lru",), "it evicts the least recently used adapter no request holds"),
        metavar="{lru}",
        help="SGLang's: adapters leave their slot and host memory least recently used first",
    )


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
    g.add_argument(
        "--quantization",
        type=_only(
            ("fp8",),
            "it reads an FP8 checkpoint's blocks (config.json's quantization_config) as they "
            "are, and quantizes nothing itself",
        ),
        metavar="{fp8}",
        help="SGLang's and vLLM's: fp8 on an FP8 block-quantized checkpoint, read as such "
        "anyway (on another checkpoint an error: dsakv quantizes nothing at load)",
    )
    for stage in ("prefill", "decode"):  # (SGLang's DSA_CHOICES; nsa: its older name)
        add_aliased(
            g,
            (f"--dsa-{stage}-backend", f"--nsa-{stage}-backend"),
            f"SGLang's kernel for its DSA {stage}: dsakv's kernels are --attention-backend's",
            choices=_SGLANG_DSA_KERNELS,
            metavar="KERNEL",
        )
    g.add_argument(
        "--moe-runner-backend",
        choices=_SGLANG_MOE_KERNELS,
        metavar="KERNEL",
        help="SGLang's MoE kernel: dsakv runs its own",
    )
    for flag in ("min-bfs-breadth", "max-bfs-breadth", "branch-length", "capacity"):
        g.add_argument(
            f"--speculative-ngram-{flag}",
            type=positive_int,
            metavar="N",
            help="SGLang's n-gram draft tree and its cache across requests: dsakv's n-gram "
            "drafts are one chain from the request's own tokens",
        )
    g.add_argument(
        "--speculative-ngram-match-type",
        choices=("BFS", "PROB"),
        help="SGLang's n-gram tree expansion: dsakv drafts what followed the latest match",
    )
    for flag, why in (
        ("--disable-overlap-schedule", "dsakv schedules a step after the last ends (no overlap)"),
        ("--enable-mixed-chunk", "dsakv's steps always run decode tokens beside prefill chunks"),
        ("--disable-shared-experts-fusion", "dsakv's shared experts are never fused"),
        ("--enable-flashinfer-allreduce-fusion", "dsakv's all-reduce is torch's, unfused"),
        (
            "--enable-nan-detection",
            "dsakv always checks the model's logits: a request whose are not finite ends "
            "alone, with an error",
        ),
    ):
        g.add_argument(flag, action="store_true", help=f"SGLang's: {why}")
    g.add_argument(
        "--hicache-io-backend",
        choices=("direct", "kernel", "kernel_ascend"),
        help="SGLang's host-tier copy kernel: dsakv copies pages its own way",
    )
    g.add_argument(
        "--hicache-mem-layout",
        choices=("layer_first", "page_first", "page_first_direct", "page_first_kv_split")
        + ("page_head",),
        metavar="LAYOUT",
        help="SGLang's host-tier layout: dsakv's host pages are laid out as its device pages",
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        help="vLLM's: dsakv schedules a step once the last has ended, either way",
    )
    g.add_argument(
        "--distributed-executor-backend",
        type=_only(
            ("mp", "uni"),
            "its ranks are processes of its own, the first in this one; it runs no Ray",
        ),
        metavar="{mp,uni}",
        help="vLLM's: dsakv's ranks are its own processes (no Ray)",
    )
    g.add_argument(
        "--cpu-offload-gb",
        type=_only_number(0, "it keeps every weight on the device"),
        metavar="0",
        help="vLLM's: dsakv offloads no weights to the CPU",
    )
    g.add_argument(
        "--compilation-config",
        metavar="JSON",
        help="vLLM's torch.compile and CUDA-graph config: taken and ignored, dsakv compiles "
        "nothing by it (its CUDA graphs: --cuda-graph-max-bs, --disable-cuda-graph; "
        "torch.compile: --enable-torch-compile)",
    )
    g.add_argument(
        "--hf-overrides",
        type=_refused(
            "dsakv does not rewrite the model's config: edit config.json in a copy of the "
            "model's folder and give that folder"
        ),
        help=argparse.SUPPRESS,
    )
    if serve:
        add_aliased(
            g,
            ("--grammar-backend", "--guided-decoding-backend"),
            "SGLang's (vLLM's the other, whose default auto is taken too): dsakv's "
            "structured output runs on xgrammar",
            dest="grammar_backend",
            type=_grammar_backend,
            metavar="{xgrammar,auto}",
        )
        g.add_argument(
            "--structured-outputs-config",
            type=_structured_outputs_config,
            metavar="JSON",
            help="vLLM's: backend xgrammar or auto (dsakv's structured output runs on "
            "xgrammar), reasoning_parser as --reasoning-parser; disable_any_whitespace taken "
            "(dsakv's JSON grammars admit no free whitespace), disable_fallback taken",
        )
        # vLLM's dotted spelling of its backend (`_fold_structured_outputs`)
        g.add_argument(
            "--structured-outputs-config.backend",
            dest="structured_outputs_backend",
            type=_grammar_backend,
            help=argparse.SUPPRESS,
        )
        for flag, why in (
            ("--enable-prompt-tokens-details", "usage's cached_tokens is always reported"),
            ("--enable-server-load-tracking", "/load is always served"),
            ("--enable-sleep-mode", "/sleep, /wake_up and /is_sleeping always work"),
            ("--disable-frontend-multiprocessing", "the server and engine share one process"),
            ("--disable-fastapi-docs", "dsakv serves no docs"),
            ("--enable-reasoning", "reasoning is parsed by --reasoning-parser"),
        ):
            g.add_argument(flag, action="store_true", help=f"vLLM's: {why}")
        one_server = "it runs one API server: several `dsakv serve` behind a router scale out"
        g.add_argument(
            "--api-server-count",
            "-asc",
            type=_only_number(1, one_server),
            metavar="1",
            help="vLLM's: dsakv runs one API server process",
        )
        g.add_argument(
            "--tool-parser-plugin",
            type=_refused(
                "dsakv runs no plugin code: its tool-call parsers are --tool-call-parser's"
            ),
            help=argparse.SUPPRESS,
        )
        g.add_argument(
            "--enable-cache-report",
            action="store_true",
            help="SGLang's: usage.prompt_tokens_details.cached_tokens is always reported",
        )
        add_ignored_lora_args(g)
        g.add_argument(
            "--skip-server-warmup",
            action="store_true",
            help="SGLang's: dsakv's server sends itself no warm-up request",
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
        g.add_argument(
            "--enable-metrics", action="store_true", help="SGLang's: /metrics is always served"
        )
        g.add_argument(
            "--disable-log-stats",
            action="store_true",
            help="vLLM's: dsakv logs no periodic stats line, and /metrics is always served",
        )
        g.add_argument(
            "--enable-auto-tool-choice",
            action="store_true",
            help='tool_choice "auto" needs no switch here (calls are parsed by --tool-call-parser)',
        )


def add_request_log_args(p: argparse.ArgumentParser) -> None:
    """The request log's flags, SGLang's and vLLM's (`RequestLogConfig.from_flags`;
    `request_log_config` reads them back)."""
    g = p.add_argument_group("logging")
    g.add_argument(
        "--log-requests",
        action="store_true",
        help="SGLang's: log each generation request as it arrives and as it ends (how much: "
        "--log-requests-level)",
    )
    g.add_argument(
        "--log-requests-level",
        type=int,
        choices=(0, 1, 2, 3),
        default=2,
        help="SGLang's: 0 ids, routes, finish reasons, token counts and latency; 1 and "
        "sampling params; 2 and prompts and outputs cut to 2048 characters or ids; 3 whole "
        "(default 2)",
    )
    g.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="vLLM's: log each generation request with its sampling params, and its end",
    )
    g.add_argument(
        "--enable-log-outputs",
        action="store_true",
        help="vLLM's: and its output text (with --enable-log-requests or --log-requests)",
    )
    g.add_argument(
        "--max-log-len",
        type=_nonnegative_int,
        metavar="N",
        help="vLLM's: each prompt and output logged cut to its first N characters or ids",
    )
    g.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="vLLM's: log no requests (the default)",
    )


def request_log_config(args: argparse.Namespace):
    """The `RequestLogConfig` of `add_request_log_args`' flags."""
    from dsakv.server.request_log import RequestLogConfig

    return RequestLogConfig.from_flags(
        args.log_requests,
        args.log_requests_level,
        args.enable_log_requests,
        args.enable_log_outputs,
        args.max_log_len,
        args.disable_log_requests,
    )


def add_trace_args(p: argparse.ArgumentParser) -> None:
    """OpenTelemetry request tracing, vLLM's flag and SGLang's (`trace_config` reads them
    back; --collect-detailed-traces is an engine flag: the engine times the steps). A
    server's span is per engine request, the router's per request it routes."""
    g = p.add_argument_group("tracing (OpenTelemetry)")
    g.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="send a span per request (a server's: each choice of n) to this OTLP collector, "
        "over gRPC (host:port) or, with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf, "
        "HTTP (its URL, /v1/traces included); a request's traceparent header is its parent",
    )
    g.add_argument(
        "--enable-trace",
        action="store_true",
        help=f"SGLang's switch: trace, to {SGLANG_TRACES_ENDPOINT} unless "
        "--otlp-traces-endpoint says",
    )


def trace_config(args: argparse.Namespace, collect_detailed_traces: str | None = None):
    """The `TraceConfig` of `add_trace_args`' flags (the protocol from the environment, as
    vLLM reads it), or None: not traced. `collect_detailed_traces`: a server's engine flag
    (the router has none), which needs an endpoint to send its times to."""
    from dsakv.server.tracing import TraceConfig

    endpoint = args.otlp_traces_endpoint
    if endpoint is None and args.enable_trace:
        endpoint = SGLANG_TRACES_ENDPOINT
    if endpoint is None:
        if collect_detailed_traces is not None:
            raise DsakvError(
                "--collect-detailed-traces needs --otlp-traces-endpoint (or SGLang's "
                "--enable-trace): the times go in the requests' spans"
            )
        return None
    return TraceConfig.from_env(endpoint)


def add_http_args(p: argparse.ArgumentParser) -> None:
    """vLLM's flags for the HTTP front door (`serve`'s server; the router of `serve-pd` and
    `dsakv router`): CORS, TLS, a proxy's path prefix (`http_config` reads them back)."""
    g = p.add_argument_group("HTTP: CORS, TLS, root path (vLLM's)")
    for what in ("origins", "methods", "headers"):
        g.add_argument(
            f"--allowed-{what}",
            type=_json_strings,
            metavar="JSON",
            help=f'CORS: the {what} browsers may call from, a JSON list (default ["*"])',
        )
    g.add_argument(
        "--allow-credentials", action="store_true", help="CORS: allow credentials (cookies)"
    )
    g.add_argument("--ssl-keyfile", metavar="FILE", help="TLS: the server's private key")
    g.add_argument(
        "--ssl-certfile", metavar="FILE", help="TLS: the server's certificate (serves https)"
    )
    g.add_argument(
        "--ssl-ca-certs", metavar="FILE", help="TLS: the CAs client certificates are checked by"
    )
    g.add_argument(
        "--ssl-cert-reqs",
        type=int,
        choices=(0, 1, 2),
        help="TLS: client certificates none (0, default), optional (1) or required (2), as "
        "Python's ssl.CERT_*",
    )
    g.add_argument(
        "--root-path",
        metavar="PATH",
        help="the path prefix a proxy serves the API under: a request reaches its route "
        "with it or without it (FastAPI's root_path)",
    )


def http_config(args: argparse.Namespace):
    """The `HTTPConfig` of `add_http_args`' flags, its TLS files loaded (a bad one is one
    error now)."""
    from dsakv.server.http_config import HTTPConfig

    given = {
        key: getattr(args, key)
        for key in ("allowed_origins", "allowed_methods", "allowed_headers", "ssl_keyfile")
        + ("ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs", "root_path")
        if getattr(args, key) is not None
    }
    config = HTTPConfig(**given, allow_credentials=args.allow_credentials)
    config.check_files()
    return config


def add_response_args(p: argparse.ArgumentParser) -> None:
    """vLLM's server-wide defaults for what completions and chat requests leave out
    (`response_defaults` reads them back; serve-pd hands them to its servers)."""
    g = p.add_argument_group("response defaults (vLLM's)")
    g.add_argument(
        "--response-role",
        default="assistant",
        metavar="ROLE",
        help="chat: the reply's role (under add_generation_prompt; default assistant)",
    )
    g.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help='logprobs name each token "token_id:N" unless the request says '
        "return_tokens_as_token_ids false",
    )
    g.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="every stream carries the usage, whatever its stream_options say: on each chunk "
        "and in a usage chunk at the end (vLLM's since its PR #37923)",
    )


def response_defaults(args: argparse.Namespace):
    """The `ResponseDefaults` of `add_response_args`' flags."""
    from dsakv.server.openai_format import ResponseDefaults

    if not args.response_role:
        raise DsakvError("--response-role must not be empty")
    return ResponseDefaults(
        args.response_role, args.return_tokens_as_token_ids, args.enable_force_include_usage
    )


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """Ranks and how the model is split over them (SGLang's flag names)."""
    g = p.add_argument_group("parallelism")
    add_aliased(g, TP, "tensor-parallel ranks, one process each", dest="tp", type=positive_int)
    add_aliased(g, EP, "expert-parallel groups of whole experts", dest="ep", type=positive_int)
    add_pp_args(g, "pipeline stages, each of --tp ranks")
    add_dp_args(g, "each rank schedules its own requests")
    g.add_argument("--enable-expert-parallel", action="store_true", help=argparse.SUPPRESS)
    g.add_argument(  # SGLang's DeepEP all-to-all, which splits the experts over every rank
        "--moe-a2a-backend",
        type=_only(
            ("none", "deepep"),
            "deepep: its experts split over every rank (SGLang's ep = tp), exchanged dsakv's way",
        ),
        help=argparse.SUPPRESS,
    )
    g.add_argument("--nnodes", type=positive_int, help="machines the ranks span")
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
        type=positive_float,
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
        type=nonnegative_float,
        metavar="S",
        help="longest a new request waits for its L3 lookup (default 2 s)",
    )


# Engine flags that set an `EngineConfig` field of another name: flag -> (field, value).
OFF_FLAGS = {
    "no_elide_index_k": ("elide_index_k", False),
    "no_prefix_cache": ("enable_prefix_cache", False),
    "disable_deterministic_inference": ("enable_deterministic_inference", False),
}


def _fold_foreign(args: argparse.Namespace, model_dir: str) -> None:
    """SGLang's / vLLM's values and flags (`FOLDED`) as dsakv's own flags, set in `args`
    (what serve-pd passes on), or refused where dsakv has no such meaning."""
    from dsakv.config import ModelConfig
    from dsakv.config.layer_plan import DRAFT_STEPS, MAX_DRAFT_STEPS

    check_dp_size(args)
    fold_expert_parallel(args)
    _fold_structured_outputs(args)
    _fold_lora(args)
    if args.scheduling_policy == "fcfs" and args.enable_priority_scheduling:
        raise DsakvError("--scheduling-policy fcfs and --enable-priority-scheduling contradict")
    if getattr(args, "tokenizer_mode", None) == "deepseek_v32":
        model_type = ModelConfig.from_hf(model_dir).model_type
        if model_type != "deepseek_v32":
            raise DsakvError(
                f"--tokenizer-mode deepseek_v32 is DeepSeek-V3.2's chat encoding; this model "
                f"is {model_type}"
            )
    if getattr(args, "quantization", None) == "fp8":  # (SGLang's online FP8 elsewhere)
        quantized = ModelConfig.from_hf(model_dir).quantization_config or {}
        if quantized.get("quant_method") != "fp8":
            raise DsakvError(
                "--quantization fp8: this checkpoint holds no FP8 blocks (config.json's "
                "quantization_config), and dsakv quantizes nothing at load: give an FP8 "
                "checkpoint or leave --quantization out"
            )
    _fold_pool_sizes(args)
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
    dotted = {key: getattr(args, f"spec_{key}") for key in ("method", "num_speculative_tokens")}
    dotted.update({key: getattr(args, f"spec_{key}") for key in _LOOKUP})
    if dotted != dict.fromkeys(dotted):  # vLLM's --speculative-config.KEY VALUE flags
        if args.speculative_config is not None:
            raise DsakvError("--speculative-config and --speculative-config.KEY: give one")
        given = {k: v for k, v in dotted.items() if v is not None}
        for key in ("num_speculative_tokens", *_LOOKUP):
            with contextlib.suppress(KeyError, ValueError):
                given[key] = int(given[key])
        try:
            args.speculative_config = _speculative_config(json.dumps(given))
        except argparse.ArgumentTypeError as e:
            raise DsakvError(f"--speculative-config.KEY: {e}") from None
        for key in dotted:
            setattr(args, f"spec_{key}", None)
    window = ("speculative_ngram_min_match_window_size", "speculative_ngram_max_match_window_size")
    if args.speculative_config is not None:
        if args.speculative_algorithm or args.speculative_num_steps:
            raise DsakvError(
                "--speculative-config and --speculative-algorithm / --speculative-num-steps "
                "both ask for speculative decoding: give one"
            )
        if any(getattr(args, w) is not None for w in window):
            raise DsakvError(
                "--speculative-config and --speculative-ngram-min/max-match-window-size both "
                "set the n-gram match window: give one"
            )
        args.speculative_algorithm, args.speculative_num_steps, lo, hi = args.speculative_config
        if args.speculative_algorithm == "ngram":
            args.speculative_ngram_min_match_window_size = lo
            args.speculative_ngram_max_match_window_size = hi
        args.speculative_config = None  # (folded: a second call finds dsakv's flags alone)
    topk, tokens = args.speculative_eagle_topk, args.speculative_num_draft_tokens
    steps_given = args.speculative_num_steps is not None
    for flag, value in (("eagle-topk", topk), ("num-draft-tokens", tokens)):
        if value is not None and args.speculative_algorithm is None:
            raise DsakvError(f"--speculative-{flag} needs --speculative-algorithm")
    if topk not in (None, 1):
        raise DsakvError(
            f"--speculative-eagle-topk {topk}: dsakv drafts one chain (the top token at each "
            "step), not a tree: give 1 or leave it out"
        )
    if tokens is not None and args.speculative_algorithm == "ngram" and not steps_given:
        # (SGLang's NGRAM counts the last token among them, as its EAGLE does)
        if not 2 <= tokens <= MAX_DRAFT_STEPS + 1:
            raise DsakvError(
                f"--speculative-num-draft-tokens {tokens}: n-gram drafting verifies "
                f"2..{MAX_DRAFT_STEPS + 1} tokens a step (1..{MAX_DRAFT_STEPS} drafts, then the "
                "last token)"
            )
        args.speculative_num_steps = tokens - 1
    steps = args.speculative_num_steps or DRAFT_STEPS
    if tokens is not None and tokens != steps + 1:
        raise DsakvError(
            f"--speculative-num-draft-tokens {tokens}: a chain of {steps} drafts "
            f"(--speculative-num-steps) verifies {steps + 1} tokens: give {steps + 1} or "
            "leave it out"
        )


def _fold_structured_outputs(args: argparse.Namespace) -> None:
    """vLLM's --structured-outputs-config, JSON or its dotted .backend (one of the two), as
    dsakv's flags: its reasoning_parser is --reasoning-parser's (the same parser, or that
    flag left out), which serve-pd has none of (its servers parse the model type's way)."""
    spec = getattr(args, "structured_outputs_config", None)
    if spec is not None and getattr(args, "structured_outputs_backend", None) is not None:
        raise DsakvError(
            "--structured-outputs-config and --structured-outputs-config.backend: give one"
        )
    name = (spec or {}).get("reasoning_parser")
    if name is None:
        return
    given = getattr(args, "reasoning_parser", None)
    if given is None:
        raise DsakvError(
            "--structured-outputs-config reasoning_parser: serve-pd's servers parse reasoning "
            "with the model type's parser (dsakv serve takes one)"
        )
    if given not in ("auto", name):
        raise DsakvError(
            f"--structured-outputs-config reasoning_parser {name!r} and --reasoning-parser "
            f"{given!r}: give one"
        )
    args.reasoning_parser = name


def _fold_lora(args: argparse.Namespace) -> None:
    """SGLang's --lora-paths as --lora-modules (and, as in SGLang, --enable-lora: its
    adapters given are its switch). Without --max-lora-rank the adapters given at start
    set it, SGLang's inference: their largest rank (vLLM's default 16 without any), under
    --fully-sharded-loras rounded up to a multiple of --tp (each rank's share of a slot)."""
    if paths := getattr(args, "lora_paths", None):
        args.lora_modules = [*(args.lora_modules or ()), *paths]
        args.enable_lora, args.lora_paths = True, None
    if getattr(args, "enable_lora", False) and getattr(args, "max_lora_rank", 0) is None:
        ranks = [r for _, path in args.lora_modules or () if (r := _adapter_rank(path))]
        if ranks:
            split = getattr(args, "fully_sharded_loras", False)
            tp = (getattr(args, "tp", None) or 1) if split else 1
            args.max_lora_rank = -(-max(ranks) // tp) * tp


def _adapter_rank(path: str) -> int | None:
    """The largest rank of the PEFT adapter at `path` (its r, its rank_pattern's); None
    where its config says none (loading it then says why)."""
    from dsakv.models.lora import CONFIG_FILE

    try:  # (`load_json`: a config nested too deeply is its error, loading it says so)
        config = load_json((Path(path) / CONFIG_FILE).read_bytes(), CONFIG_FILE)
        ranks = [config.get("r"), *(config.get("rank_pattern") or {}).values()]
    except (OSError, DsakvError, AttributeError):
        return None
    ranks = [r for r in ranks if type(r) is int and r > 0]
    return max(ranks, default=None)


def _fold_pool_sizes(args: argparse.Namespace) -> None:
    """vLLM's `--kv-cache-memory-bytes N` as `--kv-budget-gib` N / 2^30 (per rank, as
    vLLM's per GPU), `--gpu-memory-utilization` beside it dropped (vLLM ignores it then),
    and SGLang's host tier sizes (`fold_host_tier`). Another size beside any of these is
    one error. (SGLang's `--max-total-tokens` caps whichever sizes the pool:
    `EngineConfig.max_total_tokens`.)"""
    kv_bytes = getattr(args, "kv_cache_memory_bytes", None)
    if kv_bytes is not None:
        sizes = ("--num-pages", "--kv-budget-gib", "--mem-fraction-static")
        for flag in sizes:
            if getattr(args, flag[2:].replace("-", "_")) is not None:
                raise DsakvError(
                    f"--kv-cache-memory-bytes and {flag} both size the KV pool: give one"
                )
        args.kv_budget_gib, args.kv_cache_memory_bytes = kv_bytes / 2**30, None
        args.gpu_memory_utilization = None
    fold_host_tier(args)


def fold_host_tier(args: argparse.Namespace) -> None:
    """SGLang's host tier, `--enable-hierarchical-cache`, as `--host-pool-gib` for
    `--hicache-size G` (G GB per rank: 1e9 bytes, as SGLang's; 0 is its unset), else
    `--host-pool-ratio`, its `--hicache-ratio` (default 2); without the switch both are
    ignored, as SGLang ignores them."""
    ratio, size = args.hicache_ratio, args.hicache_size
    args.hicache_ratio = args.hicache_size = None
    if not args.enable_hierarchical_cache:
        return
    for flag in ("--host-pool-gib", "--host-pool-ratio"):
        if getattr(args, flag[2:].replace("-", "_")) is not None:
            raise DsakvError(
                f"--enable-hierarchical-cache and {flag} both size the host KV tier: give one"
            )
    if size:  # (SGLang's --hicache-size overrides its ratio)
        args.host_pool_gib = size * 1e9 / 2**30
    else:
        args.host_pool_ratio = 2.0 if ratio is None else ratio
    args.enable_hierarchical_cache = False


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
    each flag given sets the field of its name (`OFF_FLAGS`: another's), so a new flag
    cannot be forgotten here; a flag left out leaves the field's default."""
    from dsakv.engine import EngineConfig
    from dsakv.models.tiny import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    _fold_foreign(args, model_dir)
    kw: dict[str, Any] = {}
    for action in actions(add_engine_args) + actions(add_storage_args):
        if action.dest in FOLDED:
            continue
        value = getattr(args, action.dest, None)
        if value is not None and value is not False:  # (given)
            name, value = OFF_FLAGS.get(action.dest, (action.dest, value))
            kw[name] = tuple(value) if isinstance(value, list) else value  # (nargs: frozen)
    return EngineConfig.from_kwargs(model_dir, **kw)


def log_level(args: argparse.Namespace) -> int:
    """-v's INFO, or SGLang's --log-level (`serve`; uvicorn's trace is debug here)."""
    level = getattr(args, "log_level", None)
    if level is None:
        return logging.INFO if args.verbose else logging.WARNING
    if args.verbose and level != "info":
        raise DsakvError(f"-v (info) and --log-level {level} disagree: give one")
    return logging.DEBUG if level == "trace" else getattr(logging, level.upper())


def uvicorn_log_level(args: argparse.Namespace) -> str:
    """vLLM's --uvicorn-log-level, else SGLang's --log-level (its HTTP server's default)."""
    return args.uvicorn_log_level or args.log_level or "info"


def actions(add_args: Callable[[argparse.ArgumentParser], None]) -> list[argparse.Action]:
    """The arguments `add_args` defines (to read them back from parsed args)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_args(parser)
    return parser._actions


def given_flags(args: argparse.Namespace, add_args: Any) -> list[str]:
    """The flags `add_args` defines, as given on this command line (to pass them on)."""
    out: list[str] = []
    for action in actions(add_args):
        if action.help == argparse.SUPPRESS:
            continue  # (a hidden alias: dsakv's own flag passes the value)
        value = getattr(args, action.dest, None)
        if value is None or value is False or value == action.default:
            continue
        flag = action.option_strings[-1]
        if isinstance(value, list):  # (nargs; --lora-modules' (name, path) as its JSON form:
            # NAME=PATH would read a name holding "=", or starting with "{", another way)
            out += [flag, *(_as_lora_module(v) if isinstance(v, tuple) else str(v) for v in value)]
        elif isinstance(value, tuple):  # (--pp-layer-partition's N,N,...)
            out += [flag, ",".join(map(str, value))]
        else:
            out += [flag] if value is True else [flag, str(value)]
    return out


def _as_lora_module(adapter: tuple[str, str]) -> str:
    name, path = adapter
    return json.dumps({"name": name, "path": path})


def stray_flags(
    args: argparse.Namespace, defaults: dict[str, Any], takes: Sequence[str]
) -> list[str]:
    """The flags given (not at their `defaults`) that a mode does not take."""
    return [
        "--" + key.replace("_", "-")
        for key, default in defaults.items()
        if key not in takes and getattr(args, key) not in (default, [])
    ]
