"""`dsakv calibrate-pattern`: the IndexCache greedy search (`dsakv.calibrate`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .args import DTYPE, draft_layers, kv_cache_dtype, positive_float, positive_int


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


def add_commands(sub: Any) -> None:
    from dsakv.memory.layout import DEFAULT_LATENT_DTYPE, INDEX_K_DTYPES, LATENT_DTYPES

    p = sub.add_parser(
        "calibrate-pattern", help="IndexCache greedy search: which layers keep their indexer"
    )
    p.add_argument("model", help="model directory or tiny preset")
    p.add_argument("--data", metavar="FILE.jsonl", help='{"text"} or {"token_ids"} per line')
    budget = p.add_mutually_exclusive_group()
    budget.add_argument(
        "--num-full-layers", type=positive_int, metavar="N", help="default: layers // 4"
    )
    budget.add_argument(
        "--target-bytes-per-token", type=positive_int, metavar="B", help="stop at <= B"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--write-config", metavar="DIR", help="config.json with the pattern + links")
    p.add_argument("--plot", metavar="FILE.png", help="KL and bytes/token per full-layer count")
    p.add_argument("--seed", type=int, default=0, help="tie order and built-in data")
    p.add_argument("--max-seq-len", type=positive_int, help="default: 2 x index_topk")
    p.add_argument("--batch-size", type=positive_int, default=4, help="sequences per forward")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N")
    p.add_argument("--dtype", type=DTYPE, choices=("float32", "bfloat16"), default="float32")
    g = p.add_argument_group("pricing (as dsakv plan)")
    g.add_argument(
        "--kv-cache-dtype",
        type=kv_cache_dtype,
        choices=LATENT_DTYPES,
        default=DEFAULT_LATENT_DTYPE,
    )
    g.add_argument("--index-k-dtype", choices=INDEX_K_DTYPES, default="fp8")
    g.add_argument("--page-size", type=positive_int, default=64)
    g.add_argument("--draft-layers", type=draft_layers, default=0, help="MTP/EAGLE draft layers")
    g.add_argument("--kv-budget-gib", type=positive_float, default=100.0)
    p.set_defaults(func=_cmd_calibrate)
