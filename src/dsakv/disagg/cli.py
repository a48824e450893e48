"""Command-line pieces of disaggregation: `serve` flags, `dsakv router`, `dsakv serve-pd`."""

from __future__ import annotations

import argparse
from typing import Any

from dsakv.errors import DsakvError

from .config import DEFAULT_BOOTSTRAP_PORT, MODES, DisaggConfig


def add_serve_args(p: argparse.ArgumentParser) -> None:
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
        type=float,
        default=60.0,
        help="seconds either side waits for the other (default 60)",
    )
    g.add_argument(
        "--disaggregation-transfer-host",
        help="address Mooncake listens on (default: --host, or this machine's if a wildcard)",
    )


def config_from_args(args: argparse.Namespace) -> DisaggConfig | None:
    if not getattr(args, "disaggregation_mode", None):
        return None
    return DisaggConfig(
        args.disaggregation_mode,
        args.disaggregation_bootstrap_port,
        args.disaggregation_timeout,
        args.disaggregation_transfer_host,
    )


def _cmd_router(args: argparse.Namespace) -> int:
    from dsakv.cli import check_listen

    from .router import build_router_app, run_router

    build_router_app(args.prefill, args.decode)  # bad URLs fail before anything listens
    check_listen(args.host, args.port)
    run_router(args.prefill, args.decode, args.host, args.port)
    return 0


def _cmd_serve_pd(args: argparse.Namespace) -> int:
    from dsakv.cli import add_engine_args, check_listen, engine_config_from_args
    from dsakv.models.tiny import resolve_model_dir

    from .launch import serve_pd

    ports = [args.port, args.prefill_port, args.decode_port, args.bootstrap_port]
    given = [p for p in ports if p is not None]
    if len(set(given)) < len(given):
        raise DsakvError("--port, --prefill-port, --decode-port and --bootstrap-port must differ")
    check_listen(args.host, args.port)
    for p in ports[1:]:
        if p is not None:
            check_listen("127.0.0.1", p)
    config = engine_config_from_args(args)  # what either server would refuse, refused once
    for mode in MODES:
        DisaggConfig(mode).check_engine(config)
    flags = _flags(args, add_engine_args)
    flags += ["--disaggregation-timeout", str(args.disaggregation_timeout)]
    for name in ("served_model_name", "api_key"):
        if getattr(args, name):
            flags += [f"--{name.replace('_', '-')}", getattr(args, name)]
    serve_pd(
        resolve_model_dir(args.model),
        flags,
        args.host,
        args.port,
        args.prefill_port,
        args.decode_port,
        args.bootstrap_port,
    )
    return 0


def _flags(args: argparse.Namespace, add_args: Any) -> list[str]:
    """The flags `add_args` defines, as given on this command line (to pass them on)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_args(parser)
    out: list[str] = []
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if value is None or value is False or value == action.default:
            continue
        flag = action.option_strings[-1]
        out += [flag] if value is True else [flag, str(value)]
    return out


def add_commands(sub: Any) -> None:
    """`dsakv router` and `dsakv serve-pd`."""
    from dsakv.cli import add_engine_args, port

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
    p.add_argument("--host", default="127.0.0.1", help="the router's address")
    p.add_argument("--port", type=port, default=8000, help="the router's port")
    p.add_argument("--prefill-port", type=port, help="(default: a free port)")
    p.add_argument("--decode-port", type=port, help="(default: a free port)")
    p.add_argument("--bootstrap-port", type=port, help="(default: a free port)")
    p.add_argument("--disaggregation-timeout", type=float, default=60.0)
    p.add_argument("--served-model-name")
    p.add_argument("--api-key")
    add_engine_args(p)
    p.set_defaults(func=_cmd_serve_pd)
