"""The answers to the errors routes raise (`APIError`, a body FastAPI could not validate, an
HTTP error, a bug), in OpenAI's shape (Anthropic's on its routes): light (no torch), so that
`dsakv router`, whose Batch API routes (`batch`) raise them as a server's do, answers them
alike (and a batch line it runs reads a JSON error, not Starlette's plain-text 500)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsakv.errors import DsakvError, load_json

from .http_config import route_path
from .protocol import APIError, error_body, error_for


def add_error_handlers(app: FastAPI) -> None:
    """`app` answers an `APIError` with its status and body, a request FastAPI could not
    validate with a 400 naming the first field that failed (vLLM's, not FastAPI's 422), an
    HTTP error (a 404, a 405) in the same shape, and any other exception with a JSON 500.
    It also sets `app.router.route_class` to `StrictJSONRoute`: the routes added after it
    read their JSON bodies strictly, a body not JSON being its 400 (`_NotJSON`); call it
    before adding any route (the server and the router do)."""
    app.router.route_class = StrictJSONRoute

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(request, e.body(), e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        # (no "json_invalid": a body not JSON is `_NotJSON`'s, every route being strict)
        # loc is ("body", field, ...); a union field adds one error per alternative type.
        loc = [x for x in first.get("loc", ()) if x != "body"]
        param = str(loc[0]) if loc else None
        same = [x for x in errors if x.get("loc", ())[1:2] == first.get("loc", ())[1:2]]
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
        if len(same) > 1:
            message += " (nor any other accepted type)"
        if len(errors) > len(same):
            message += f"; and {len(errors) - len(same)} more error(s)"
        return error_response(request, error_body(message, "invalid_request_error", param), 400)

    @app.exception_handler(_NotJSON)
    async def not_json(request: Request, e: _NotJSON) -> JSONResponse:
        return error_response(request, error_body(e.detail, "invalid_request_error", e.param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return error_response(request, error_body(str(e.detail), kind), e.status_code, e.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        message = f"internal error: {str(e) or type(e).__name__}"  # (TimeoutError(): "")
        return error_response(request, error_body(message, "server_error"), 500)


def error_response(
    request: Request, body: dict[str, Any], status: int, headers: dict[str, str] | None = None
) -> JSONResponse:
    """An error (`body`: OpenAI's shape) as the route's clients read errors (`error_for`)."""
    body = error_for(route_path(request.scope), status, body)
    return JSONResponse(body, status_code=status, headers=headers)


class StrictJSONRoute(APIRoute):
    """A route whose JSON body is read as `load_json(strict=True)` reads it: NaN, a lone
    surrogate, a number past a double are a 400 as the body arrives (RFC 8259 has none of
    them), not a 500 when an answer quotes them back, nor stored (a batch's metadata, a
    response's user) for every later read of them to fail."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handle(_StrictJSONRequest(request.scope, request.receive, request._send))

        return strict


class _StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = load_json(await self.body(), NOT_JSON, strict=True)
            except DsakvError as e:
                raise _NotJSON(str(e), e.param) from None
        return self._json


class _NotJSON(StarletteHTTPException):
    """A body `load_json` refused; an HTTP error, as FastAPI passes on (any other error
    reading a body it answers "There was an error parsing the body"), naming its field."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(400, message)
        self.param = param


NOT_JSON = "request body is not valid JSON"  # (the router's words too)
