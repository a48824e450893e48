"""`run_server`: build the engine, the bridge and the app, and serve them with uvicorn."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

import uvicorn

from dsakv.engine import EngineConfig
from dsakv.engine.launch import create_engine
from dsakv.procs import exit_on_sigterm

from .app import build_app
from .chat import ChatParsers
from .parsers import resolve_parsers
from .runner import AsyncEngine, Bridge, EngineThread

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """Aborts in-flight requests first on shutdown, so open streams end at once (with
    finish_reason "abort") instead of holding shutdown until they complete."""

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine) -> None:
        super().__init__(config)
        self.async_engine = async_engine

    async def shutdown(self, sockets=None) -> None:
        self.async_engine.abort_all()
        await super().shutdown(sockets)


def make_server(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    log_level: str = "info",
    tool_call_parser: str | None = "auto",
    reasoning_parser: str | None = "auto",
    bridge: Bridge | None = None,
) -> tuple[uvicorn.Server, AsyncEngine]:
    """The server `run_server` runs, not yet started (tests drive it on a thread). Parser
    names: "auto" (the model type's own), "none", or one of `parsers.TOOL_PARSERS` /
    `parsers.REASONING_PARSERS`. `bridge`: what the app talks to (default: a plain
    `AsyncEngine`)."""
    resolve_parsers("", tool_call_parser, reasoning_parser)  # bad names fail before loading
    # Built on the thread that will step it: one OpenMP team in the process (`EngineThread`).
    thread = EngineThread()
    try:
        engine = thread.call(lambda: create_engine(config, exit_on_rank_death=True))
        async_engine = (bridge or AsyncEngine)(engine, thread)
    except BaseException:
        thread.close()  # a no-op once the step loop started
        raise
    name = served_model_name or Path(config.model).name or str(config.model)
    parsers = ChatParsers.for_model(
        engine.model_config.model_type, tool_call_parser, reasoning_parser
    )
    app = build_app(async_engine, name, api_key=api_key, chat_parsers=parsers)
    async_engine.attach(app)
    uv = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    return _Server(uv, async_engine), async_engine


def run_server(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    tool_call_parser: str | None = "auto",
    reasoning_parser: str | None = "auto",
    bridge: Bridge | None = None,
) -> None:
    """Serve `config`'s model over the OpenAI API until interrupted (`dsakv serve`)."""
    server, async_engine = make_server(
        config,
        host,
        port,
        api_key,
        served_model_name,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        bridge=bridge,
    )
    shown = f"[{host}]" if ":" in host else host
    name = server.config.app.state.model_name
    log.info("serving %r at http://%s:%d/v1 (metrics at /metrics)", name, shown, port)
    print(f"dsakv: serving {name!r} at http://{shown}:{port}/v1", flush=True)
    # uvicorn re-raises the SIGTERM it caught once it has stopped: make that an exception,
    # so the engine still closes (the L3 storage tier writes what it holds) on `kill`.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, exit_on_sigterm) if main else None
    try:
        server.run()
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        async_engine.shutdown()
        async_engine.close_engine()
