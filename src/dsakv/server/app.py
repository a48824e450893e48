"""The OpenAI-compatible FastAPI app over one shared `AsyncEngine`: its routes (their
handlers: `handlers`; /v1/responses: `responses`; Anthropic's /v1/messages: `anthropic`;
SGLang's /generate and admin routes: `generate`; /v1/score: `score`; OpenAI's /v1/files and
/v1/batches: `batch`; LoRA adapters loaded at run time: `lora`), /health, /metrics and
SGLang's probes, errors in OpenAI's shape (in Anthropic's on its routes), and every
response counted by endpoint."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from dsakv import __version__
from dsakv.errors import DsakvError
from dsakv.metrics import ServerMetrics, held_pages

from .anthropic import add_anthropic_routes
from .auth import require_api_key
from .batch import add_batch_routes
from .chat import ChatParsers
from .error_handlers import add_error_handlers
from .generate import add_generate_route
from .handlers import Handlers
from .http_config import HTTPConfig, route_path
from .lora import add_lora_routes
from .openai_format import ResponseDefaults
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    invocation_path,
    list_page,
)
from .request_log import RequestLogConfig
from .responses import add_responses_routes
from .runner import AsyncEngine
from .score import add_score_route
from .sessions import add_session_routes
from .tracing import RequestTracer, TraceConfig

_ENDPOINTS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/invocations",
    "/v1/responses",
    "/v1/responses/{response_id}",  # (any id: `_endpoint`)
    "/v1/responses/{response_id}/cancel",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/generate",
    "/v1/score",
    "/v1/files",
    "/v1/files/{file_id}",  # (any id, and its /content: `_endpoint`)
    "/v1/files/{file_id}/content",
    "/v1/batches",
    "/v1/batches/{batch_id}",  # (any id, and its /cancel: `_endpoint`)
    "/v1/batches/{batch_id}/cancel",
    "/abort_request",
    "/open_session",
    "/close_session",
    "/configure_logging",
    "/update_weights_from_disk",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/destroy_weights_update_group",
    "/get_weight_version",
    "/update_weight_version",
    "/pause_generation",
    "/continue_generation",
    "/pause",
    "/resume",
    "/is_paused",
    "/flush_cache",
    "/reset_prefix_cache",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/load_lora_adapter",
    "/unload_lora_adapter",
    "/v1/models",
    "/v1/models/{model}",  # (any model: `_endpoint`)
    "/version",
    "/tokenize",
    "/detokenize",
    "/v1/tokenize",
    "/v1/detokenize",
    "/health",
    "/ping",
    "/get_load",
    "/load",
    "/health_generate",
    "/metrics",
    "/model_info",
    "/get_model_info",
    "/server_info",
    "/get_server_info",
)


_HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's: a probe stuck behind a long queue is unhealthy


def build_app(
    async_engine: AsyncEngine,
    model_name: str | Sequence[str],
    api_key: str | None = None,
    chat_parsers: ChatParsers | None = None,
    aliases: Sequence[str] = (),
    request_log: RequestLogConfig | None = None,
    http: HTTPConfig | None = None,
    defaults: ResponseDefaults | None = None,
    tracing: TraceConfig | None = None,
) -> FastAPI:
    """The app for one engine. `model_name`: the served name, or several (vLLM's
    `--served-model-name`): /v1/models lists each, responses report the first, a request
    may name any, or one of `aliases` (accepted, not listed: `make_server` gives the model's
    path). With `api_key`, every route needs `Authorization: Bearer` (checked before the
    body is read: `BearerAuth`) but those left open for probes and scrapers (`OPEN_PATHS`):
    /health, /version, /metrics and SGLang's probes (/health_generate, /model_info,
    /server_info, and their older /get_* names, which routers such as sglang-router read at
    registration); a path no route serves is a 404 with or without it. `chat_parsers`
    defaults to the model type's tool-call and reasoning parsers. `request_log`: what the
    generation routes log of each request (default: nothing; `request_log`). `http`: CORS
    (every origin by default, as vLLM's) and the root path (`HTTPConfig`); `defaults`: vLLM's
    server-wide defaults for what a request leaves out (`ResponseDefaults`). `tracing`: where
    each request's OpenTelemetry span goes (`tracing`; None: no spans, no SDK loaded)."""
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    if not names or not all(names):
        raise DsakvError("a served model name must be a non-empty string")
    model_name = names[0]
    app = FastAPI(
        title="dsakv", docs_url=None, redoc_url=None, openapi_url=None, lifespan=_lifespan
    )
    role = async_engine.server_info()["disaggregation_mode"]  # (SGLang's engine_type)
    config, max_model_len = async_engine.engine.config, async_engine.engine.max_model_len
    metrics = ServerMetrics(
        model_name,
        config.page_size,
        role,
        max_model_len=max_model_len,
        storage_backend=config.hicache_storage_backend,
        max_loras=config.max_loras if config.enable_lora else None,
    )
    app.state.async_engine, app.state.model_name, app.state.metrics = (
        async_engine,
        model_name,
        metrics,
    )
    require_api_key(app, api_key)  # (inside the counting: a 401 is counted)
    (http or HTTPConfig()).install(app)  # (outside the key check: preflights need none)
    app.add_middleware(_CountRequests, metrics=metrics)
    add_error_handlers(app)  # (the router's too)
    if chat_parsers is None:
        chat_parsers = ChatParsers.for_engine(async_engine.engine)
    app.state.chat_parsers = chat_parsers
    tracer = None
    if tracing is not None:
        tracer = RequestTracer(tracing, model_name, config.detailed_traces, role)
    api = Handlers(
        async_engine, names, metrics, chat_parsers, aliases, request_log, defaults, tracer
    )
    app.state.handlers = api  # (closed with the app: `_lifespan`)

    async def health() -> Response:
        if not async_engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ping", health, methods=["GET", "POST"])  # (vLLM's, SageMaker's)

    @app.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        """SGLang's: the load on each DP rank: under `--dp-attention` each rank's counters
        as the `counters` call just read them (`DPEngine.rank_snapshot`), else this
        engine's, as rank 0's."""
        total = await async_engine.counters() or {}
        ranks = getattr(async_engine.engine, "rank_snapshot", None) or [total]
        page_size = async_engine.engine.config.page_size
        return [_rank_load(rank, c, page_size) for rank, c in enumerate(ranks)]

    @app.get("/load")
    async def load() -> dict[str, int]:  # (vLLM's: the generation requests in flight)
        return {"server_load": api.in_flight.count}

    @app.get("/health_generate")
    async def health_generate() -> Response:
        try:
            await asyncio.wait_for(async_engine.probe(), _HEALTH_GENERATE_TIMEOUT_S)
        except (RuntimeError, asyncio.TimeoutError) as e:
            message = f"the engine did not generate a token: {str(e) or 'timed out'}"
            return JSONResponse(error_body(message, "server_error"), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:  # (vLLM's)
        return {"version": __version__}

    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, api.model_info, methods=["GET"])
    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, api.server_info, methods=["GET"])

    @app.get("/metrics")
    async def prometheus() -> Response:
        snapshot = await async_engine.counters()  # (never waits out a long step)
        text = metrics.render(snapshot, async_engine.lora_snapshot)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:  # (vLLM's: a card per served name, per adapter)
        # (a page: Anthropic's SDK's models.list reads its fields too; one holds them all)
        return list_page(api.model_cards(), has_more=False)

    # OpenAI's retrieve-model (`client.models.retrieve`); `path`: a served name may hold "/"
    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        api.check_model(model)
        return api.model_card(model)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await api.completion(body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await api.chat(body, raw)

    @app.post("/invocations")
    async def invocations(body: dict[str, Any], raw: Request) -> Response:
        """vLLM's (SageMaker's): the route `invocation_path` picks, its answers and 400s."""
        if invocation_path(body) == "/v1/chat/completions":
            return await api.chat(_validated(ChatCompletionRequest, body), raw)
        return await api.completion(_validated(CompletionRequest, body), raw)

    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await asyncio.to_thread(api.tokenize, body)  # (10 MB held every route 10 s)

    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await asyncio.to_thread(api.detokenize, body)

    for prefix in ("", "/v1"):  # (SGLang's /v1 names too)
        app.add_api_route(f"{prefix}/tokenize", tokenize, methods=["POST"])
        app.add_api_route(f"{prefix}/detokenize", detokenize, methods=["POST"])

    # SGLang's /flush_cache and vLLM's /reset_prefix_cache (benchmarks call them between runs)
    app.add_api_route("/flush_cache", api.flush_cache, methods=["GET", "POST"])
    app.add_api_route("/reset_prefix_cache", api.flush_cache, methods=["POST"])

    add_generate_route(app, api)  # SGLang's native /generate
    add_responses_routes(app, api)  # OpenAI's Responses API
    add_anthropic_routes(app, api)  # Anthropic's Messages API
    add_score_route(app, api)  # SGLang's /v1/score
    add_lora_routes(app, api)  # vLLM's and SGLang's LoRA adapter loading
    add_session_routes(app, api.sessions)  # SGLang's /open_session, /close_session
    # OpenAI's Batch API, over the routes above: as many of a batch's requests in flight as
    # the engine runs at once (it stays full; other requests wait behind that many at most)
    window = async_engine.engine.config.max_running_requests
    add_batch_routes(app, window, model_name, disaggregated=role != "null")
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """What the app holds of its own, released when its server stops (the engine is the
    server's to close: `run_server`): the batches still running, then the handlers'
    grammar compile threads (which a batch's requests would compile on)."""
    try:
        yield
    finally:
        await app.state.batches.stop()
        await app.state.handlers.close()


def _rank_load(rank: int, c: dict[str, float], page_size: int) -> dict[str, int]:
    """SGLang's /get_load entry for one rank's counters: `num_tokens` the tokens requests
    hold (not the prefix cache's evictable pages) and those the waiting ones will."""
    running, waiting = int(c.get("running_requests", 0)), int(c.get("waiting_requests", 0))
    held = int(held_pages(c))
    return {
        "dp_rank": rank,
        "num_reqs": running + waiting,
        "num_waiting_reqs": waiting,
        "num_tokens": held * page_size + int(c.get("waiting_tokens", 0)),
    }


def _validated(model: type[BaseModel], body: dict[str, Any]) -> Any:
    """`body` as `model`, as FastAPI validates a route's body: a 400 the same as there."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = [{**error, "loc": ("body", *error["loc"])} for error in e.errors()]
        raise RequestValidationError(errors) from None


def _preflight(scope: dict) -> bool:
    """A CORS preflight: what a browser asks before its call (`HTTPConfig.install`)."""
    if scope["method"] != "OPTIONS":
        return False
    return any(k == b"access-control-request-method" for k, _ in scope.get("headers", ()))


class _CountRequests:
    """Pure ASGI middleware counting responses by endpoint and status (keeps streaming and
    disconnect detection untouched, unlike `BaseHTTPMiddleware`). A response the client
    hung up on before its end counts as 499, a stream's too (its 200 went out first)."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or _preflight(scope):  # (a browser's, not a call)
            await self.app(scope, receive, send)
            return
        status, ended, left = 500, False, False

        async def receive_disconnect() -> dict:
            nonlocal left
            message = await receive()
            left = left or message["type"] == "http.disconnect"
            return message

        async def send_status(message: dict) -> None:
            nonlocal status, ended, left
            if message["type"] == "http.response.start":
                status = message["status"]
            try:
                await send(message)
            except OSError:  # (the connection is gone)
                left = True
                raise
            ended = ended or (
                message["type"] == "http.response.body" and not message.get("more_body", False)
            )

        try:
            await self.app(scope, receive_disconnect, send_status)
        finally:
            if left and not ended:
                status = 499  # (nginx's "client closed request", as for the others)
            self.metrics.requests.labels(_endpoint(route_path(scope)), str(status)).inc()


def _endpoint(path: str) -> str:
    """A request's `endpoint` label: its route, one label for every model's retrieve."""
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    if path.startswith("/v1/responses/"):
        cancel = path.endswith("/cancel") and path.count("/") == 4
        return "/v1/responses/{response_id}" + ("/cancel" if cancel else "")
    for collection, name in (("/v1/files/", "{file_id}"), ("/v1/batches/", "{batch_id}")):
        if path.startswith(collection):  # (its id as a name; anything after it kept)
            tail = path[len(collection) :].partition("/")[2]
            path = collection + name + (f"/{tail}" if tail else "")
    return path if path in _ENDPOINTS else "other"
