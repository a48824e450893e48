"""OpenAI-compatible HTTP server over the engine (`dsakv serve`)."""

from .app import build_app
from .runner import AsyncEngine
from .serve import make_server, run_server

__all__ = ["AsyncEngine", "build_app", "make_server", "run_server"]
