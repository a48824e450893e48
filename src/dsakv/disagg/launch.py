"""`dsakv serve-pd`: one prefill server, one decode server and the router on one machine."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import httpx

from dsakv.errors import DsakvError
from dsakv.procs import Listener, exit_on_sigterm, free_port, serve_app, stop_processes
from dsakv.server.http_config import HTTPConfig
from dsakv.server.tracing import TraceConfig

from .policy import PolicyConfig
from .router import HealthConfig, build_router_app


def serve_command(model: str, mode: str, port: int, bootstrap_port: int, flags: Sequence[str]):
    """The `dsakv serve` command line of one role."""
    cmd = [sys.executable, "-m", "dsakv.cli", "serve", model, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--disaggregation-mode", mode]
    cmd += ["--disaggregation-bootstrap-port", str(bootstrap_port), *flags]
    # (behind the router, on loopback: no browser page should reach a server directly)
    return [*cmd, "--allowed-origins", "[]"]


def wait_healthy(urls: Sequence[str], procs: Sequence[subprocess.Popen], timeout: float) -> None:
    """Until every server answers /health; a server process that exits is an error."""
    deadline = time.monotonic() + timeout
    pending = list(urls)
    while pending:
        for p in procs:
            if p.poll() is not None:
                raise DsakvError(f"a server exited with code {p.returncode}: {' '.join(p.args)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{pending[0]}/health", timeout=2).status_code == 200:
                pending.pop(0)
                continue
        if time.monotonic() > deadline:
            raise DsakvError(f"{pending[0]} did not come up within {timeout:g} s")
        time.sleep(0.3)


def _watch(procs: Sequence[subprocess.Popen], done: threading.Event) -> None:
    """Stop serve-pd when one of its servers exits: its router would answer every request
    with an error while its /health said ok."""
    while not done.wait(1.0):
        for p in procs:
            if p.poll() is not None:
                print(
                    f"error: a server exited with code {p.returncode}: {' '.join(p.args)}",
                    file=sys.stderr,
                    flush=True,
                )
                os.kill(os.getpid(), signal.SIGTERM)  # the router stops, then the other server
                return


def run_router_on(
    listener: Listener,
    prefill: list[str],
    decode: list[str],
    api_key: str | None = None,
    http: HTTPConfig | None = None,
    policy: PolicyConfig | None = None,
    health: HealthConfig | None = None,
    tracing: TraceConfig | None = None,
) -> None:
    """The router (`build_router_app`) on sockets taken earlier; says where it routes once
    it serves. `http`: its CORS, TLS and root path (the front door's, as `dsakv serve`'s);
    `policy`: how it picks servers; `health`: how it probes them; `tracing`: where its
    spans go."""
    http = http or HTTPConfig()
    app = build_router_app(prefill, decode, api_key, policy, health, tracing)
    http.install(app)
    host, port = listener.host, listener.port
    shown = f"[{host}]" if ":" in host else host
    where = f"{http.scheme}://{shown}:{port}/v1"
    banner = f"dsakv: router at {where} -> prefill {prefill}, decode {decode}"
    serve_app(app, listener, banner, **http.uvicorn_kwargs())


def serve_pd(
    model: str,
    flags: Sequence[str],
    host: str = "127.0.0.1",
    port: int = 8000,
    prefill_port: int | None = None,
    decode_port: int | None = None,
    bootstrap_port: int | None = None,
    startup_timeout: float = 600.0,
    listener: Listener | None = None,
    api_key: str | None = None,
    http: HTTPConfig | None = None,
    decode_flags: Sequence[str] = (),
    tracing: TraceConfig | None = None,
    health: HealthConfig | None = None,
) -> None:
    """Start both servers as child processes (engine `flags` go to both, `decode_flags`
    after them to the decode server), wait until they are up, then serve the router on
    `host:port` until interrupted; the children go too.
    The router's port is held from the start (`listener`, else taken here), not bound
    once the servers are up. `api_key`, `http` (CORS, TLS, root path), `tracing` and
    `health` (its checks of the two): the router's (the servers' key and tracing flags are
    in `flags`; they listen on loopback behind it)."""
    listener = listener or Listener(host, port)
    pp, dp = prefill_port or free_port(), decode_port or free_port()
    bp = bootstrap_port or free_port()
    # Their own sessions: a terminal's Ctrl-C reaches this process alone, which stops them
    # below (so a server exiting always means it failed, see `_watch`).
    own = {"prefill": (), "decode": tuple(decode_flags)}
    procs = [
        subprocess.Popen(
            serve_command(model, mode, at, bp, [*flags, *own[mode]]), start_new_session=True
        )
        for mode, at in (("prefill", pp), ("decode", dp))
    ]
    urls = [f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{dp}"]
    # uvicorn re-raises the SIGTERM it caught once it has stopped: make that an exception,
    # so the servers below are stopped too rather than orphaned.
    previous = signal.signal(signal.SIGTERM, exit_on_sigterm)
    done = threading.Event()
    try:
        wait_healthy(urls, procs, startup_timeout)
        threading.Thread(target=_watch, args=(procs, done), daemon=True).start()
        run_router_on(listener, [urls[0]], [urls[1]], api_key, http, health=health, tracing=tracing)
    finally:
        listener.close()
        done.set()
        signal.signal(signal.SIGTERM, previous)
        stop_processes(procs, 10)
