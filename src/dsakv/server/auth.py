"""The API key check `dsakv serve --api-key` and `dsakv router --api-key` share: light (no
torch), so that the router, which imports it, stays light."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.routing import Match, Router

from dsakv.errors import DsakvError

from .http_config import route_path
from .protocol import APIError, error_for

# Routes open without the API key: probes and scrapers.
OPEN_PATHS = (
    "/health",
    "/ping",
    "/get_load",
    "/load",
    "/health_generate",
    "/version",
    "/metrics",
    "/model_info",
    "/get_model_info",
    "/server_info",
    "/get_server_info",
    "/disagg/info",  # (a prefill or decode server's: `dsakv.disagg.serving`)
    "/liveness",  # (the router's: SGLang Model Gateway's probes)
    "/readiness",
)


def checked_api_key(key: str) -> str:
    """`key` if it can be a bearer token, else the DsakvError saying why: an empty key (an
    unset `--api-key "$KEY"`) would leave every route open, a space or a character outside
    visible ASCII can never be sent (the header's value is trimmed; httpx cannot encode it,
    so no relayed request could carry it)."""
    if not key:
        raise DsakvError("an API key must not be empty (that would leave every route open)")
    for at, c in enumerate(key):
        if not "!" <= c <= "~":
            raise DsakvError(
                "an API key must be visible ASCII characters (0x21-0x7e), "
                f"got {c!r} at position {at}"
            )
    return key


def key_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The client's API key as it sent it (`Authorization`, Anthropic's `x-api-key`), for the
    requests made on its behalf: the router's to its servers, a batch's lines."""
    return {k: headers[k] for k in ("authorization", "x-api-key") if k in headers}


def require_api_key(app: FastAPI, api_key: str | None) -> None:
    """With `api_key` (checked: `checked_api_key`), `app`'s routes need it (`BearerAuth`)."""
    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=checked_api_key(api_key), router=app.router)


class BearerAuth:
    """Pure ASGI middleware: a request to any route but `OPEN_PATHS` needs `Authorization:
    Bearer <api_key>` (or Anthropic's `x-api-key: <api_key>`, what its clients send; their
    routes' 401 is in Anthropic's shape), checked before routing and body parsing (vLLM's
    order): a keyless request to a served path is a 401 whatever its body or method (a
    method the path does not take too: its 405 would tell who has no key which methods it
    takes), and so is one to any path under /v1 (vLLM guards that whole prefix). A keyless
    request to a path no route serves goes on to the router's 404, as vLLM's only guards
    its API."""

    def __init__(self, app: Any, api_key: str, router: Router) -> None:
        self.app, self.expected, self.router = app, f"Bearer {api_key}".encode(), router
        self.key = api_key.encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = route_path(scope)  # (under --root-path, without it)
        if scope["type"] != "http" or path in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        got, key = headers.get(b"authorization", b""), headers.get(b"x-api-key", b"")
        if (
            secrets.compare_digest(got, self.expected)
            or secrets.compare_digest(key, self.key)
            or not self._guarded(scope)
        ):
            await self.app(scope, receive, send)
            return
        error = APIError(401, "invalid or missing API key", code="invalid_api_key")
        body = error_for(path, error.status, error.body())
        await JSONResponse(body, status_code=error.status)(scope, receive, send)

    def _guarded(self, scope: dict) -> bool:
        """Whether the path is under /v1 or a route serves it, in any method, or would
        redirect to one across a trailing slash (the router's `redirect_slashes`): the
        router's own matching, on the scope alone (no body read)."""
        path = route_path(scope)
        if path == "/v1" or path.startswith("/v1/"):
            return True
        scopes = [scope]
        if self.router.redirect_slashes and path != "/":
            other = path.rstrip("/") if path.endswith("/") else path + "/"
            scopes.append({**scope, "path": other})
        return any(r.matches(s)[0] is not Match.NONE for s in scopes for r in self.router.routes)
