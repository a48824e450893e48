"""`dsakv router` and `dsakv serve-pd`, and the flags that make `dsakv serve` a prefill or
decode server."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from dsakv.disagg.config import DEFAULT_BOOTSTRAP_PORT, MODES, DisaggConfig
from dsakv.disagg.policy import DEFAULT_POLICIES, POLICIES, PolicyConfig
from dsakv.errors import DsakvError

from .args import (
    add_engine_args,
    add_http_args,
    add_ignored_args,
    add_model_option,
    add_request_log_args,
    add_response_args,
    add_trace_args,
    api_key,
    check_listen,
    engine_config_from_args,
    given_flags,
    http_config,
    listen,
    port,
    positive_float,
    positive_int,
    request_log_config,
    response_defaults,
    trace_config,
    uvicorn_log_level,
)

if TYPE_CHECKING:
    from dsakv.disagg.router import HealthConfig


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
        type=positive_float,
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

    policy, tracing, health = policy_config(args), trace_config(args), health_config(args)
    build_router_app(args.prefill, args.decode)  # bad URLs fail before anything listens
    http = http_config(args)
    with listen(args.host, args.port) as listener:
        run_router_on(
            listener, args.prefill, args.decode, args.api_key, http, policy, health, tracing
        )
    return 0


class _PrefillAction(argparse.Action):
    """SGLang router's `--prefill URL [BOOTSTRAP_PORT]`: the URL kept, the port checked and
    not needed (`Router.bootstrap_of` asks the server, which knows its own)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        url, *rest = values
        if len(rest) > 1 or (rest and rest[0].lower() != "none" and not _is_port(rest[0])):
            parser.error(f"argument --prefill: expected URL [BOOTSTRAP_PORT], got {values}")
        setattr(namespace, self.dest, [*getattr(namespace, self.dest), url])  # (not the default's)


def _is_port(text: str) -> bool:
    try:
        port(text)
    except argparse.ArgumentTypeError:
        return False
    return True


def add_health_args(p: argparse.ArgumentParser) -> None:
    """`dsakv router`'s active health checks: SGLang router's flags and defaults (its
    seconds as whole numbers; fractions taken here too)."""
    g = p.add_argument_group("health checks (SGLang router's)")
    g.add_argument(
        "--health-check-interval-secs", type=positive_float, metavar="S", default=60.0,
        help="seconds between probes of each server (default 60)",
    )  # fmt: skip
    g.add_argument(
        "--health-check-timeout-secs", type=positive_float, metavar="S", default=5.0,
        help="seconds a probe waits for its answer (default 5)",
    )  # fmt: skip
    g.add_argument(
        "--health-failure-threshold", type=positive_int, metavar="N", default=3,
        help="failed probes in a row that mark a server unhealthy: passed over (default 3)",
    )  # fmt: skip
    g.add_argument(
        "--health-success-threshold", type=positive_int, metavar="N", default=2,
        help="passed probes in a row that mark it healthy again (default 2)",
    )  # fmt: skip
    g.add_argument(
        "--health-check-endpoint", metavar="PATH", default="/health",
        help="the path probed; a 2xx passes (default /health)",
    )  # fmt: skip
    g.add_argument(
        "--disable-health-check", action="store_true",
        help="no probes: a server's health is learnt from requests and /health calls only",
    )  # fmt: skip


def health_config(args: argparse.Namespace) -> HealthConfig:
    """The router's `HealthConfig` from its flags (a bad endpoint: the DsakvError)."""
    from dsakv.disagg.router import HealthConfig  # (fastapi: not for every command)

    return HealthConfig(
        args.health_check_interval_secs,
        args.health_check_timeout_secs,
        args.health_failure_threshold,
        args.health_success_threshold,
        args.health_check_endpoint,
        not args.disable_health_check,
    )


def add_policy_args(p: argparse.ArgumentParser) -> None:
    """`dsakv router`'s load balancing: SGLang router's flags and defaults."""
    g = p.add_argument_group("load balancing (SGLang router's policies)")
    default = ", ".join(f"{v} for {k} servers" for k, v in DEFAULT_POLICIES.items())
    g.add_argument(
        "--policy", choices=POLICIES,
        help=f"how each request's servers are picked (default: {default})",
    )  # fmt: skip
    for kind in MODES:
        g.add_argument(
            f"--{kind}-policy", choices=POLICIES, help=f"{kind} servers' (over --policy)"
        )
    d = PolicyConfig()
    g.add_argument(
        "--cache-threshold", type=float, metavar="X", default=d.cache_threshold,
        help="cache_aware: the share of a prompt a server's tree must match for it to go there, "
        f"else to the server with the smallest tree (0..1, default {d.cache_threshold})",
    )  # fmt: skip
    g.add_argument(
        "--balance-abs-threshold", type=int, metavar="N", default=d.balance_abs_threshold,
        help="cache_aware: to the least loaded server (requests in flight) while the most "
        f"loaded has more than this many more (default {d.balance_abs_threshold}) ...",
    )  # fmt: skip
    g.add_argument(
        "--balance-rel-threshold", type=float, metavar="X", default=d.balance_rel_threshold,
        help=f"... and more than this many times as many (default {d.balance_rel_threshold})",
    )  # fmt: skip
    g.add_argument(
        "--eviction-interval-secs", "--eviction-interval", type=int, metavar="S", default=120,
        dest="eviction_interval_secs",
        help="SGLang's seconds between its background cuts of the trees: accepted (its command "
        "lines run), no effect here: a tree is cut as a request takes it past --max-tree-size",
    )  # fmt: skip
    g.add_argument(
        "--max-tree-size", type=int, metavar="N", default=d.max_tree_size,
        help=f"cache_aware: characters of prompts kept per server (default {d.max_tree_size})",
    )  # fmt: skip


def policy_config(args: argparse.Namespace) -> PolicyConfig:
    if args.eviction_interval_secs < 0:  # (unused, but SGLang's range all the same)
        raise DsakvError(
            f"--eviction-interval-secs must be an integer >= 0, got {args.eviction_interval_secs}"
        )
    return PolicyConfig(**{f.name: getattr(args, f.name) for f in fields(PolicyConfig)})


def _cmd_serve_pd(args: argparse.Namespace) -> int:
    from dsakv.disagg.launch import serve_pd
    from dsakv.models.tiny import resolve_model_dir

    ports = [args.port, args.prefill_port, args.decode_port, args.bootstrap_port]
    given = [p for p in ports if p is not None]
    if len(set(given)) < len(given):
        raise DsakvError("--port, --prefill-port, --decode-port and --bootstrap-port must differ")
    config = engine_config_from_args(args)  # what either server would refuse, refused once
    request_log_config(args)  # (a bad combination too, before the servers start)
    response_defaults(args)
    # (the router's, and both servers' by their flags)
    tracing = trace_config(args, args.collect_detailed_traces)
    http = http_config(args)  # the router's: the front door (its servers listen on loopback)
    health = health_config(args)  # (the router's checks of its two servers)
    for mode in MODES:  # (first: a bad flag is its own error, whoever holds the port)
        DisaggConfig(mode, timeout_s=args.disaggregation_timeout).check_engine(config)
    decode_flags = _decode_kv_events(config)
    with listen(args.host, args.port) as listener:  # the router's, held from now
        for p in ports[1:]:
            if p is not None:  # (each server takes its own at its start)
                check_listen("127.0.0.1", p)
        flags = given_flags(args, add_engine_args)
        flags += ["--disaggregation-timeout", str(args.disaggregation_timeout)]
        if args.served_model_name:
            flags += ["--served-model-name", *args.served_model_name]
        if args.api_key:
            flags += ["--api-key", args.api_key]
        flags += ["--uvicorn-log-level", uvicorn_log_level(args)]
        level = args.log_level or ("info" if args.verbose else None)  # (-v's too: theirs)
        if level:
            flags += ["--log-level", level]
        if args.disable_uvicorn_access_log:
            flags += ["--disable-uvicorn-access-log"]
        flags += given_flags(args, add_request_log_args)  # (both servers log their requests)
        flags += given_flags(args, add_response_args)  # (the decode server's answers relayed)
        flags += given_flags(args, add_trace_args)  # (both servers trace)
        serve_pd(
            resolve_model_dir(args.model),
            flags,
            args.host,
            args.port,
            args.prefill_port,
            args.decode_port,
            args.bootstrap_port,
            listener=listener,
            api_key=args.api_key,
            http=http,
            decode_flags=decode_flags,
            tracing=tracing,
            health=health,
        )
    return 0


def _decode_kv_events(config: Any) -> list[str]:
    """Each server publishes its own KV cache events: the decode server on the ports after
    the prefill server's (one per DP rank), so the two do not bind one port."""
    events = config.kv_events
    if events is None:
        return []
    ranks = config.parallel.dp
    try:
        events.check_ranks(2 * ranks)  # (both servers' ports, none bound twice)
    except DsakvError as e:
        raise DsakvError(
            f"--kv-events-config: the decode server publishes on the prefill server's ports "
            f"plus {ranks}, and {e}"
        ) from None
    return ["--kv-events-config", events.shifted(ranks).to_json()]


def add_commands(sub: Any) -> None:
    """`dsakv router` and `dsakv serve-pd`."""
    p = sub.add_parser("router", help="OpenAI front door over prefill and decode servers")
    p.add_argument(  # (none given: servers added later, POST /workers)
        "--prefill", action=_PrefillAction, nargs="+", default=[],
        metavar=("URL", "BOOTSTRAP_PORT"),
        help="repeatable; SGLang router's one bootstrap port (or none) after the URL is taken "
        "(the router asks each prefill server its own); none given: add servers with POST "
        "/workers",
    )  # fmt: skip
    p.add_argument(
        "--decode", action="append", default=[], metavar="URL",
        help="repeatable; none given: add servers with POST /workers",
    )  # fmt: skip
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=8000)
    p.add_argument(
        "--api-key",
        type=api_key,
        help="require this Bearer token (and relay it: the servers check theirs)",
    )
    add_policy_args(p)
    add_health_args(p)
    add_http_args(p)
    add_trace_args(p)
    p.set_defaults(func=_cmd_router, loads_torch=False)

    p = sub.add_parser(
        "serve-pd", help="a prefill server, a decode server and the router, on this machine"
    )
    p.add_argument("model", nargs="?", help="model directory or tiny preset (default: embedded)")
    add_model_option(p)
    p.add_argument("--host", default="127.0.0.1", help="the router's address")
    p.add_argument("--port", type=port, default=8000, help="the router's port")
    p.add_argument("--prefill-port", type=port, help="(default: a free port)")
    p.add_argument("--decode-port", type=port, help="(default: a free port)")
    p.add_argument("--bootstrap-port", type=port, help="(default: a free port)")
    p.add_argument(
        "--disaggregation-timeout",
        type=positive_float,
        default=60.0,
        help="seconds either side waits for the other (default 60)",
    )
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument(
        "--api-key", type=api_key, help="require this Bearer token (the router and both servers)"
    )
    add_engine_args(p)
    add_request_log_args(p)
    add_http_args(p)  # (the router's)
    add_health_args(p)  # (the router's)
    add_response_args(p)
    add_trace_args(p)
    add_ignored_args(p, serve=True)
    p.set_defaults(func=_cmd_serve_pd)
