"""OpenAI-compatible HTTP server over the engine (`dsakv serve`). Its names are imported on
first use, so that `dsakv router`, which shares the wire format (`protocol`) and the API key
check (`auth`), loads no torch."""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "AsyncEngine": ".runner",
    "build_app": ".app",
    "make_server": ".serve",
    "run_server": ".serve",
}
__all__ = list(_NAMES)


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_NAMES[name], __name__), name)
