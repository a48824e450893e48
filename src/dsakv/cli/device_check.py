"""`dsakv device-check`: the one prepared GPU run (`dsakv.bench.device_check`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from dsakv.errors import DsakvError

from .args import positive_float, stray_flags


def _cmd_device_check(args: argparse.Namespace) -> int:
    mode = "--compile-only" if args.compile_only else "--prepare" if args.prepare else None
    if mode is not None:
        takes = ("triton_path",) if args.compile_only else ("dry_run", "prepare")
        defaults = dict(dry_run=False, out=None, models=None, stages=None, deadline=[],
                        budget=None, bench=False, prepare=None)  # fmt: skip
        stray = stray_flags(args, defaults, takes)
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


def add_commands(sub: Any) -> None:
    p = sub.add_parser("device-check", help="the one prepared GPU run (kernels, graphs, decode)")
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    p.add_argument("--out", default=None, help="results folder ($OUT, else device-check-out)")
    p.add_argument("--models", metavar="DIR", help="prepared models (default: .device-models)")
    p.add_argument("--prepare", metavar="DIR", help="only write the models into DIR")
    p.add_argument("--stages", help="a subset, e.g. decode,kernel_bandwidth")
    p.add_argument("--deadline", action="append", default=[], metavar="STAGE=SECONDS",
                   help="override one stage's deadline (repeatable)")  # fmt: skip
    p.add_argument("--budget", type=positive_float, help="seconds for all stages (GPU: 525)")
    p.add_argument("--bench", action="store_true", help="then `dsakv bench --quick`, in time left")
    p.add_argument("--compile-only", action="store_true",
                   help="no GPU: compile every Triton kernel for sm_90, ptxas resource use")  # fmt: skip
    p.add_argument("--triton-path", metavar="DIR",
                   help="with --compile-only: another triton's folder first (e.g. .triton-3.6)")  # fmt: skip
    p.set_defaults(func=_cmd_device_check)
