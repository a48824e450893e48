"""`run_server`: build the engine, the bridge and the app, and serve them with uvicorn."""

from __future__ import annotations

import logging
from pathlib import Path

import uvicorn

from dsakv.engine import Engine, EngineConfig

from .app import build_app
from .runner import AsyncEngine

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
) -> tuple[uvicorn.Server, AsyncEngine]:
    """The server `run_server` runs, not yet started (tests drive it on a thread)."""
    engine = Engine(config)
    async_engine = AsyncEngine(engine)
    name = served_model_name or Path(config.model).name or str(config.model)
    app = build_app(async_engine, name, api_key=api_key)
    uv = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    return _Server(uv, async_engine), async_engine


def run_server(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
) -> None:
    """Serve `config`'s model over the OpenAI API until interrupted (`dsakv serve`)."""
    server, async_engine = make_server(config, host, port, api_key, served_model_name)
    shown = f"[{host}]" if ":" in host else host
    name = server.config.app.state.model_name
    log.info("serving %r at http://%s:%d/v1 (metrics at /metrics)", name, shown, port)
    print(f"dsakv: serving {name!r} at http://{shown}:{port}/v1", flush=True)
    try:
        server.run()
    finally:
        async_engine.shutdown()
