"""The OpenAI-compatible FastAPI app: /v1/completions, /v1/chat/completions, /v1/models,
/health and /metrics, over one shared `AsyncEngine`."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsakv.engine import SamplingParams
from dsakv.errors import DsakvError

from .metrics import ServerMetrics
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    error_body,
)
from .runner import AsyncEngine, RequestStream, Update

_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
_DISCONNECT_POLL_S = 0.5
_MIN_LOGPROB = -9999.0  # JSON has no -inf


def build_app(async_engine: AsyncEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    """The app for one engine. With `api_key`, every /v1 route needs `Authorization: Bearer`;
    /health and /metrics stay open for probes and scrapers."""
    app = FastAPI(title="dsakv", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServerMetrics(model_name)
    app.state.async_engine, app.state.model_name, app.state.metrics = (
        async_engine,
        model_name,
        metrics,
    )
    app.add_middleware(_CountRequests, metrics=metrics)
    _install_error_handlers(app)
    api = Handlers(async_engine, model_name, metrics)
    auth = [Depends(_bearer_check(api_key))] if api_key else []

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        snapshot = None
        if async_engine.alive:
            snapshot = await asyncio.wait_for(async_engine.call(lambda e: e.counters()), 30)
        return Response(
            metrics.render(snapshot), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        e = async_engine.engine
        card = {
            "id": model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "dsakv",
            "root": e.config.model,
            "max_model_len": e.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await api.completion(body, raw)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await api.chat(body, raw)

    return app


# --- handlers ---------------------------------------------------------------------------------


@dataclass
class _Result:
    """A finished request's updates folded together (non-streaming responses)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    token_text: dict[int, str] = field(default_factory=dict)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, u: Update) -> None:
        self.text += u.text
        self.token_ids += u.token_ids
        self.logprobs += u.logprobs or []
        self.top_logprobs += u.top_logprobs or []
        self.token_text.update(u.token_text)
        self.finish_reason = u.finish_reason
        self.prompt_tokens, self.completion_tokens = u.prompt_tokens, u.completion_tokens

    def as_update(self) -> Update:
        return Update(
            self.token_ids, self.text, self.logprobs, self.top_logprobs, token_text=self.token_text
        )


class Handlers:
    def __init__(self, async_engine: AsyncEngine, model_name: str, metrics: ServerMetrics) -> None:
        self.engine = async_engine
        self.model_name = model_name
        self.metrics = metrics

    # --- endpoints ----------------------------------------------------------------------------

    async def completion(self, body: CompletionRequest, raw: Request) -> Response:
        self._check_model(body.model)
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if body.best_of not in (None, 1):
            raise APIError(400, "best_of > 1 is not supported", param="best_of")
        prompt = _single_prompt(body.prompt)
        params = self._params(body, body.max_tokens, 16, body.logprobs, "logprobs")
        stream = await self._submit(prompt, params)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": self.model_name,
        }
        want_logprobs = body.logprobs is not None

        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)

            async def events() -> AsyncIterator[str]:
                offset = 0
                async for u in self._updates(stream):
                    lp = None
                    if want_logprobs:
                        lp = _completion_logprobs(u, offset)
                        offset = (
                            lp["text_offset"][-1] + len(lp["tokens"][-1])
                            if lp["tokens"]
                            else offset
                        )
                    if not (u.text or u.finished or (want_logprobs and u.token_ids)):
                        continue  # held-back text and nobody wants the tokens yet
                    choice = {
                        "index": 0,
                        "text": u.text,
                        "logprobs": lp,
                        "finish_reason": _reason(u),
                    }
                    yield _sse({**head, "choices": [choice], **({"usage": None} if usage else {})})
                    if u.finished and usage:
                        yield _sse({**head, "choices": [], "usage": _usage(u)})

            return self._stream_response(events(), stream)

        r = await self._collect(stream, raw)
        lp = _completion_logprobs(r.as_update(), 0) if want_logprobs else None
        choice = {"index": 0, "text": r.text, "logprobs": lp, "finish_reason": r.finish_reason}
        return JSONResponse({**head, "choices": [choice], "usage": _usage(r)})

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        self._check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        tokenizer = self.engine.engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions")
        messages = [{"role": m.role, "content": _content_text(m.content)} for m in body.messages]
        try:
            prompt = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except Exception as e:  # jinja raise_exception: bad roles / order
            raise APIError(400, f"chat template failed: {e}", param="messages") from None
        max_tokens = (
            body.max_completion_tokens
            if body.max_completion_tokens is not None
            else body.max_tokens
        )
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        top_n = (body.top_logprobs or 0) if body.logprobs else None
        # No max_tokens: generate until the context is full (the engine stops at its limit).
        params = self._params(
            body, max_tokens, self.engine.engine.max_model_len, top_n, "top_logprobs", param
        )
        stream = await self._submit(prompt, params)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": self.model_name,
        }

        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            extra = {"usage": None} if usage else {}

            async def events() -> AsyncIterator[str]:
                role = {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield _sse({**head, "choices": [role], **extra})
                async for u in self._updates(stream):
                    if not (u.text or u.finished or (top_n is not None and u.token_ids)):
                        continue  # held-back text and nobody wants the tokens yet
                    lp = _chat_logprobs(u) if top_n is not None else None
                    delta = {"content": u.text} if u.text or not u.finished else {}
                    choice = {
                        "index": 0,
                        "delta": delta,
                        "logprobs": lp,
                        "finish_reason": _reason(u),
                    }
                    yield _sse({**head, "choices": [choice], **extra})
                    if u.finished and usage:
                        yield _sse({**head, "choices": [], "usage": _usage(u)})

            return self._stream_response(events(), stream)

        r = await self._collect(stream, raw)
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": r.text},
            "logprobs": _chat_logprobs(r.as_update()) if top_n is not None else None,
            "finish_reason": r.finish_reason,
        }
        return JSONResponse(
            {**head, "object": "chat.completion", "choices": [choice], "usage": _usage(r)}
        )

    # --- plumbing -----------------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _params(
        self,
        body: GenerationRequest,
        max_tokens: int | None,
        default_max_tokens: int,
        logprobs: int | None,
        logprobs_param: str,
        max_tokens_param: str = "max_tokens",
    ) -> SamplingParams:
        if body.n not in (None, 1):
            raise APIError(400, "n > 1 is not supported; send n separate requests", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name):
                raise APIError(400, f"{name} is not supported", param=name)
        if body.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        if max_tokens is not None and max_tokens < 1:
            raise APIError(
                400,
                f"{max_tokens_param} must be at least 1, got {max_tokens}",
                param=max_tokens_param,
            )
        if logprobs is not None and not 0 <= logprobs <= 20:
            raise APIError(
                400, f"{logprobs_param} must be in 0..20, got {logprobs}", param=logprobs_param
            )
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        try:
            return SamplingParams(
                max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=-1 if body.top_k is None else body.top_k,
                min_p=0.0 if body.min_p is None else body.min_p,
                seed=body.seed,
                stop=tuple(stop),
                stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=bool(body.ignore_eos),
                logprobs=logprobs,
            )
        except DsakvError as e:
            raise APIError(400, str(e)) from None

    async def _submit(self, prompt: str | list[int], params: SamplingParams) -> RequestStream:
        try:
            return await self.engine.generate(prompt, params)
        except DsakvError as e:
            raise APIError(400, str(e), param="prompt") from None
        except RuntimeError as e:
            raise APIError(503, str(e), type="server_error") from None

    async def _updates(self, stream: RequestStream) -> AsyncIterator[Update]:
        """A request's updates up to and including the finishing one; errors raise."""
        while True:
            u = await stream.get()
            if u.error is not None:
                raise APIError(500, u.error, type="server_error")
            yield u
            if u.finished:
                self.metrics.observe_request(u.ttft_s, u.latency_s)
                return

    async def _collect(self, stream: RequestStream, raw: Request) -> _Result:
        """Wait for the whole output, aborting if the client goes away meanwhile."""

        async def watch() -> None:
            while not await raw.is_disconnected():
                await asyncio.sleep(_DISCONNECT_POLL_S)
            self.engine.abort(stream)  # ends the stream with finish_reason "abort"

        watcher = asyncio.create_task(watch())
        result = _Result()
        try:
            while True:
                u = await stream.get()
                if u.error is not None:
                    raise APIError(500, u.error, type="server_error")
                result.add(u)
                if u.finished:
                    self.metrics.observe_request(u.ttft_s, u.latency_s)
                    break
        finally:
            watcher.cancel()
            self.engine.abort(stream)  # a no-op when it already finished
        if result.finish_reason == "abort":
            raise APIError(
                503, "request aborted (client gone or server shutting down)", type="server_error"
            )
        return result

    def _stream_response(self, events: AsyncIterator[str], stream: RequestStream) -> Response:
        async def sse() -> AsyncIterator[str]:
            try:
                async for chunk in events:
                    yield chunk
            except APIError as e:
                yield _sse(e.body())
            yield "data: [DONE]\n\n"

        return _AbortingStream(sse(), lambda: self.engine.abort(stream))


class _AbortingStream(StreamingResponse):
    """An SSE response that aborts its engine request however it ends (disconnect included)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


# --- formatting -------------------------------------------------------------------------------


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _reason(u: Update) -> str | None:
    return u.finish_reason if u.finished else None


def _usage(u: Update | _Result) -> dict[str, int]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def _lp(x: float) -> float:
    return max(float(x), _MIN_LOGPROB)


def _completion_logprobs(u: Update, offset: int) -> dict[str, Any]:
    tokens = [u.token_text.get(t, "") for t in u.token_ids]
    text_offset = []
    for s in tokens:
        text_offset.append(offset)
        offset += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [_lp(x) for x in u.logprobs or []],
        "top_logprobs": [
            {u.token_text.get(t, ""): _lp(x) for t, x in top} for top in u.top_logprobs or []
        ],
        "text_offset": text_offset,
    }


def _chat_logprobs(u: Update) -> dict[str, Any]:
    def entry(t: int, x: float) -> dict[str, Any]:
        s = u.token_text.get(t, "")
        return {"token": s, "logprob": _lp(x), "bytes": list(s.encode("utf-8"))}

    content = []
    for t, x, top in zip(u.token_ids, u.logprobs or [], u.top_logprobs or []):
        content.append({**entry(t, x), "top_logprobs": [entry(i, y) for i, y in top]})
    return {"content": content}


def _single_prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if len(prompt) == 1:
        return prompt[0] if isinstance(prompt[0], str) else list(prompt[0])
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    raise APIError(
        400, "only one prompt per request is supported; send separate requests", param="prompt"
    )


def _content_text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.type != "text":
            raise APIError(
                400, f"content part type {part.type!r} is not supported", param="messages"
            )
        parts.append(part.text or "")
    return "".join(parts)


# --- errors, auth, request counting -----------------------------------------------------------


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
        if first.get("type") == "json_invalid":
            error = first.get("ctx", {}).get("error", first["msg"])
            message, param = f"request body is not valid JSON: {error}", None
        else:
            # loc is ("body", field, ...); a union field adds one error per alternative type.
            loc = [x for x in first.get("loc", ()) if x != "body"]
            param = str(loc[0]) if loc else None
            same = [x for x in errors if x.get("loc", ())[1:2] == first.get("loc", ())[1:2]]
            message = f"{param}: {first['msg']}" if param else str(first["msg"])
            if len(same) > 1:
                message += " (nor any other accepted type)"
            if len(errors) > len(same):
                message += f"; and {len(errors) - len(same)} more error(s)"
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(
            error_body(str(e.detail), kind), status_code=e.status_code, headers=e.headers
        )

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {e}", "server_error"), status_code=500)


def _bearer_check(api_key: str) -> Callable[[Request], None]:
    expected = f"Bearer {api_key}".encode()

    def check(request: Request) -> None:
        got = request.headers.get("authorization", "").encode()
        if not secrets.compare_digest(got, expected):
            raise APIError(401, "invalid or missing API key", code="invalid_api_key")

    return check


class _CountRequests:
    """Pure ASGI middleware counting responses by endpoint and status (keeps streaming and
    disconnect detection untouched, unlike `BaseHTTPMiddleware`)."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            self.metrics.requests.labels(path if path in _ENDPOINTS else "other", str(status)).inc()
