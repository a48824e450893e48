"""`dsakv bench`: the main job or one section, its flags checked before minutes of work."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dsakv.errors import DsakvError
from dsakv.writable import can_append, write_blocker

from .args import add_hisparse_args, positive_int, stray_flags

# bench's one-section modes: (flag, the other flags it takes besides --model, --quick, --json)
_BENCH_MODES = {
    "enable_deterministic_inference": ("--enable-deterministic-inference", ("tp",)),
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
    stray = stray_flags(args, _BENCH_FLAGS, takes)
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
        from dsakv.config.parallel import ParallelConfig
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

    r = run_determinism_bench(args.model, quick=args.quick, tp=args.tp)
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
    from dsakv.engine.config import resolve_device

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


def add_commands(sub: Any) -> None:
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
        "--tp",
        type=positive_int,
        default=1,
        help="add the tensor / DP-attention section (with --enable-deterministic-inference: "
        "its engines run on this many ranks)",
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
    g.add_argument("--repeats", type=positive_int, help="rounds per concurrency, medians reported")
    from dsakv.memory.storage import BACKENDS

    g = p.add_argument_group("L3 section (default: files in a temporary directory)")
    g.add_argument("--hicache-storage-backend", choices=BACKENDS)
    g.add_argument("--hicache-storage-dir", metavar="DIR")
    g.add_argument(
        "--hicache-mooncake-master", metavar="HOST:PORT", help="(default: start one on loopback)"
    )
    p.set_defaults(func=_cmd_bench)
