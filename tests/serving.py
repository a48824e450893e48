"""Running a real dsakv server on a loopback port for a test, and stopping it after."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from dsakv.engine import EngineConfig
from dsakv.server import make_server
from dsakv.server.runner import AsyncEngine

TIMEOUT = 30.0  # every wait on a server is bounded by this


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(server: uvicorn.Server) -> Iterator[str]:
    """Run a uvicorn server on a thread; yields its base URL and stops it afterwards."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)
        assert not thread.is_alive(), "server did not stop"


@contextlib.contextmanager
def serving(config: EngineConfig, **server_args) -> Iterator[tuple[str, AsyncEngine]]:
    """`make_server(config)` running: yields (base URL, its AsyncEngine)."""
    server, async_engine = make_server(config, port=free_port(), log_level="warning", **server_args)
    try:
        with running(server) as base:
            yield base, async_engine
    finally:
        async_engine.shutdown()
