"""`dsakv init-tiny`, `dsakv generate` and `dsakv serve`: a tiny model written, prompts
completed offline, the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any

from dsakv.errors import DsakvError

from .args import (
    add_chat_args,
    add_engine_args,
    add_http_args,
    add_ignored_args,
    add_model_option,
    add_request_log_args,
    add_response_args,
    add_storage_args,
    add_trace_args,
    api_key,
    engine_config_from_args,
    http_config,
    listen,
    port,
    positive_int,
    request_log_config,
    response_defaults,
    trace_config,
    uvicorn_log_level,
)
from .disagg import add_disagg_args, disagg_config_from_args


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
    from dsakv.engine.launch import process_rank
    from dsakv.server import run_server

    request_log = request_log_config(args)
    tracing = trace_config(args, args.collect_detailed_traces)
    http, defaults = http_config(args), response_defaults(args)
    config = engine_config_from_args(args)
    if process_rank(config.parallel) != 0:
        return _follow(args, config, http)
    with contextlib.ExitStack() as held:  # the ports, taken before the engine loads
        listener = held.enter_context(listen(args.host, args.port))
        bridge = None
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
            log_level=uvicorn_log_level(args),
            access_log=not args.disable_uvicorn_access_log,
            request_log=request_log,
            http=http,
            defaults=defaults,
            tracing=tracing,
        )
    return 0


def _follow(args: argparse.Namespace, config: Any, http: Any) -> int:
    """A process of a rank other than 0 (torchrun's, or another `--node-rank`'s): it runs
    rank 0's steps until rank 0 stops and serves nothing, so it takes no port (rank 0's
    process, on this host too, listens on --port). It checks what rank 0's server checks
    before the load (`check_serving`), so a bad flag fails every process at once."""
    from dsakv.engine.launch import create_engine
    from dsakv.server.serve import check_serving

    check_serving(
        config, args.served_model_name, args.tool_call_parser, args.reasoning_parser, http
    )
    disaggregation = disagg_config_from_args(args)
    if disaggregation is not None:  # (what rank 0 would refuse, refused in every process)
        disaggregation.check_engine(config)
    create_engine(config, exit_on_rank_death=True)  # (exits once rank 0 has stopped)
    return 0


def add_commands(sub: Any) -> None:
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
    add_model_option(p)
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    p.add_argument("--max-tokens", type=positive_int, default=32)
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
    add_engine_args(p, seed=False, serve=False)
    add_storage_args(p)
    add_ignored_args(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("model", nargs="?", help="model directory or tiny preset (default: embedded)")
    add_model_option(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=8000)
    p.add_argument("--api-key", type=api_key, help="require this Bearer token")
    add_chat_args(p)
    add_engine_args(p)
    add_storage_args(p)
    add_disagg_args(p)
    add_request_log_args(p)
    add_http_args(p)
    add_response_args(p)
    add_trace_args(p)
    add_ignored_args(p, serve=True)
    p.set_defaults(func=_cmd_serve)
