"""The OpenAI-compatible FastAPI app: /v1/completions, /v1/chat/completions, /v1/models,
/health and /metrics (/v1/responses: `responses`; SGLang's /generate: `generate`), over one
shared `AsyncEngine`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsakv import __version__
from dsakv.config.model import SAMPLING_FIELDS
from dsakv.distributed.weight_sync import GroupUpdate, WeightGroup
from dsakv.engine import SamplingParams
from dsakv.engine.beam_search import (
    BeamSearch,
    BeamSearchParams,
    Step,
    advance_all,
    live_prompts,
    step_failed,
)
from dsakv.engine.chat_format import has_chat_format
from dsakv.engine.grammar import GrammarCache, GrammarError, after_reasoning
from dsakv.engine.info import engine_info
from dsakv.engine.sampling import MAX_LOGPROBS, SEED_MAX, SEED_MIN
from dsakv.engine.sleep import EngineAsleep
from dsakv.errors import DsakvError

from .auth import require_api_key
from .chat import (
    ChatParsers,
    PreparedChat,
    chat_delta,
    chat_message,
    echo_content,
    prepare_chat,
    reply_role,
)
from .metrics import ServerMetrics
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerationRequest,
    TokenizeRequest,
    client_left,
    error_body,
    invocation_path,
)
from .rows import routed_base64, row_params
from .runner import AsyncEngine, RequestStream, Update, aborted_waiting, finished_stream

# Grammar compiles at once, and how long a request waits for its grammar.
GRAMMAR_WORKERS = 2
GRAMMAR_TIMEOUT_S = 60.0
# SGLang's weight version until an update names another (/update_weights_from_disk,
# /update_weight_version): /model_info's, and each /generate output's meta_info
WEIGHT_VERSION = "default"
# How long a weight update waits for the engine to be idle once no generation call is in
# flight (a /health_generate probe, a prefill server's pages awaiting their decode server).
_UPDATE_IDLE_TIMEOUT_S = 60.0

_ENDPOINTS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/invocations",
    "/v1/responses",
    "/v1/responses/{response_id}",  # (any id: `_endpoint`)
    "/v1/responses/{response_id}/cancel",
    "/generate",
    "/v1/score",
    "/abort_request",
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
_MIN_LOGPROB = -9999.0  # JSON has no -inf
_HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's: a probe stuck behind a long queue is unhealthy


def build_app(
    async_engine: AsyncEngine,
    model_name: str | Sequence[str],
    api_key: str | None = None,
    chat_parsers: ChatParsers | None = None,
    aliases: Sequence[str] = (),
) -> FastAPI:
    """The app for one engine. `model_name`: the served name, or several (vLLM's
    `--served-model-name`): /v1/models lists each, responses report the first, a request
    may name any, or one of `aliases` (accepted, not listed: `make_server` gives the model's
    path). With `api_key`, every route needs `Authorization: Bearer` (checked before the
    body is read: `BearerAuth`) but those left open for probes and scrapers (`OPEN_PATHS`):
    /health, /version, /metrics and SGLang's probes (/health_generate, /model_info,
    /server_info, and their older /get_* names, which routers such as sglang-router read at
    registration); a path no route serves is a 404 with or without it. `chat_parsers`
    defaults to the model type's tool-call and reasoning parsers."""
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    if not names or not all(names):
        raise DsakvError("a served model name must be a non-empty string")
    model_name = names[0]
    app = FastAPI(title="dsakv", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServerMetrics(model_name)
    app.state.async_engine, app.state.model_name, app.state.metrics = (
        async_engine,
        model_name,
        metrics,
    )
    require_api_key(app, api_key)  # (inside the counting: a 401 is counted)
    app.add_middleware(_CountRequests, metrics=metrics)
    _install_error_handlers(app)
    if chat_parsers is None:
        chat_parsers = ChatParsers.for_model(async_engine.engine.model_config.model_type)
    api = Handlers(async_engine, names, metrics, chat_parsers, aliases)

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
        return Response(
            metrics.render(snapshot), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:  # (vLLM's: a card per served name)
        return {"object": "list", "data": [api.model_card(name) for name in api.model_names]}

    # OpenAI's retrieve-model (`client.models.retrieve`); `path`: a served name may hold "/"
    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        api._check_model(model)
        return api.model_card(model if model in api.model_names else api.model_name)

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

    from .generate import add_generate_route  # (here: these modules import this one)
    from .responses import add_responses_routes
    from .score import add_score_route

    add_generate_route(app, api)  # SGLang's native /generate
    add_responses_routes(app, api)  # OpenAI's Responses API
    add_score_route(app, api)  # SGLang's /v1/score
    return app


# --- handlers ---------------------------------------------------------------------------------


@dataclass
class _Result:
    """A finished request's updates folded together (non-streaming responses)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    top_texts: list[list[str]] = field(default_factory=list)
    token_ids_logprobs: list[list[float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    abort_asked: str | None = None  # (`Update.abort_asked`)
    first: Update | None = None  # carries the prompt (and its logprobs when scored)
    routed_experts: np.ndarray | None = None  # (`Update.routed_experts`: the last update's)
    hidden_states: np.ndarray | None = None

    def add(self, u: Update) -> None:
        self.first = self.first or u
        self.text += u.text
        self.token_ids += u.token_ids
        self.logprobs += u.logprobs or []
        self.top_logprobs += u.top_logprobs or []
        self.texts += u.texts or []
        self.top_texts += u.top_texts or []
        self.token_ids_logprobs += u.token_ids_logprobs or []
        self.finish_reason, self.stop_reason = u.finish_reason, u.stop_reason
        self.prompt_tokens, self.completion_tokens = u.prompt_tokens, u.completion_tokens
        self.cached_tokens = u.cached_tokens
        self.abort_asked = u.abort_asked
        if u.routed_experts is not None:
            self.routed_experts = u.routed_experts
        if u.hidden_states is not None:
            self.hidden_states = u.hidden_states

    def as_update(self) -> Update:
        f = self.first
        return Update(
            self.token_ids,
            self.text,
            self.logprobs,
            self.top_logprobs,
            texts=self.texts,
            top_texts=self.top_texts,
            prompt_token_ids=f.prompt_token_ids if f else None,
            prompt_logprobs=f.prompt_logprobs if f else None,
            prompt_top_logprobs=f.prompt_top_logprobs if f else None,
            prompt_ranks=f.prompt_ranks if f else None,
            prompt_texts=f.prompt_texts if f else None,
            prompt_top_texts=f.prompt_top_texts if f else None,
            token_ids_logprobs=self.token_ids_logprobs,
            prompt_token_ids_logprobs=f.prompt_token_ids_logprobs if f else None,
        )


@dataclass(eq=False)
class _Call:
    """One generation call's outputs as /abort_request finds them: each output's names (a
    /generate output's `meta_info.id` and the rid its prompt was given; none on /v1), the
    streams the engine took for them so far (in output order), the outputs an abort
    reached before the engine took them, and the engine's `generate_n` taking the next
    `waiting_n` outputs while it runs."""

    names: list[frozenset[str]]
    streams: list[RequestStream] = field(default_factory=list)
    early: set[int] = field(default_factory=set)
    waiting: asyncio.Future | None = None
    waiting_n: int = 0


@dataclass(frozen=True)
class ChatRun:
    """A chat request the engine took (`Handlers.start_chat`): how to read its output back,
    its choices' streams, its /abort_request entry, and (streamed, with return_token_ids)
    the prompt's token ids."""

    prep: PreparedChat
    streams: list[RequestStream]
    call: _Call
    params: SamplingParams
    prompt_ids: list[int] | None = None
    as_ids: bool = False  # logprobs' tokens as "token_id:N" (vLLM's return_tokens_as_token_ids)


class InFlight:
    """The generation calls in flight, for SGLang's /abort_request: a call is opened before
    its prompts are tokenized or its grammar compiled, and closed when its answer ends, so
    an abort also reaches an output the engine has not taken yet. An engine still taking it
    (its `generate_n` waiting: a decode server's for room or for the prefill server's KV, a
    busy engine thread) is cancelled and the output ends at once as aborted while waiting
    (`Handlers._submit_n`), as SGLang's abort empties its queues; one still tokenizing or
    its grammar compiling ends so before its `generate_n` starts. (One of a prompt's
    several samples, which the engine takes together, is aborted as the engine takes it.)
    A name is one call's at a time (SGLang refuses a duplicate rid in flight), so an abort
    never reaches another client's request."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._calls: set[_Call] = set()
        self._named: dict[str, _Call] = {}
        self._idle = asyncio.Event()  # set while no call is in flight
        self._idle.set()

    def open(self, names: Iterable[Iterable[str]], param: str = "rid") -> _Call:
        """A call for outputs named `names` (outputs of one prompt share its rid); a name
        already in flight is a 400, as SGLang's (`param`: the field that named it)."""
        call = _Call([frozenset(x) for x in names])
        taken = set().union(*call.names)
        for name in sorted(taken):
            if name in self._named:
                raise APIError(400, f"Duplicate request ID detected: {name}", param=param)
        self._calls.add(call)
        self._named.update(dict.fromkeys(taken, call))
        self._idle.clear()
        return call

    def close(self, call: _Call | None) -> None:
        if call is None or call not in self._calls:
            return
        self._calls.discard(call)
        for name in set().union(*call.names):
            del self._named[name]
        if not self._calls:
            self._idle.set()

    @property
    def count(self) -> int:
        """Calls in flight (vLLM's /load)."""
        return len(self._calls)

    async def drained(self) -> None:
        """Until no call is in flight."""
        while self._calls:
            await self._idle.wait()

    def waiting(self, call: _Call, submit: asyncio.Future, n: int) -> None:
        """`submit`, the engine's `generate_n`, takes `call`'s next `n` outputs: an abort of
        them all cancels it (at once, if it came earlier)."""
        call.waiting, call.waiting_n = submit, n
        self._cancel_waiting(call)

    def aborted(self, call: _Call | None, n: int) -> bool:
        """Whether an abort reached each of `call`'s next `n` outputs before they were taken."""
        if call is None:
            return False
        start = len(call.streams)
        return all(i in call.early for i in range(start, start + n))

    def took(self, call: _Call, streams: list[RequestStream]) -> None:
        """The engine took `call`'s next outputs; those already aborted are aborted now."""
        call.waiting = None
        start = len(call.streams)
        call.streams += streams
        for i in range(start, len(call.streams)):
            if i in call.early:
                self.engine.abort(call.streams[i], asked=True)

    def abort(self, rid: str) -> None:
        """Abort every output named `rid`; none: nothing happens (SGLang's)."""
        call = self._named.get(rid)
        if call is not None:
            self._abort(call, lambda names: rid in names)

    def abort_all(self) -> None:
        for call in self._calls:
            self._abort(call, lambda names: True)

    def _abort(self, call: _Call, match: Callable[[frozenset[str]], bool]) -> None:
        for i, names in enumerate(call.names):
            if not match(names):
                continue
            if i < len(call.streams):
                self.engine.abort(call.streams[i], asked=True)
            else:
                call.early.add(i)
        self._cancel_waiting(call)

    def _cancel_waiting(self, call: _Call) -> None:
        if call.waiting is not None and self.aborted(call, call.waiting_n):  # (None: taken)
            call.waiting.cancel()


class Handlers:
    def __init__(
        self,
        async_engine: AsyncEngine,
        model_names: Sequence[str],
        metrics: ServerMetrics,
        chat_parsers: ChatParsers,
        aliases: Sequence[str] = (),
    ) -> None:
        self.engine = async_engine
        self.model_names = list(model_names)
        self.model_name = self.model_names[0]  # what responses report
        self._accepted = frozenset((*self.model_names, *aliases))
        self.metrics = metrics
        self.chat_parsers = chat_parsers
        self.in_flight = InFlight(async_engine)
        # SGLang's model_update_lock: generation calls start while `_serving` is set (an
        # update clears it, then waits for the calls in flight), one update at a time.
        self.weight_version = WEIGHT_VERSION
        self._serving = asyncio.Event()
        self._serving.set()
        self._updating = asyncio.Lock()
        # SGLang's is_pause: generation calls start while it is set (`pause_generation`)
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._grammars_lock = threading.Lock()  # the engine builds its GrammarCache lazily
        # Grammars compile on threads of their own: schemas slow to compile (seconds each,
        # and xgrammar cannot stop one) queue behind each other, not other requests' prompts
        self._compiles = ThreadPoolExecutor(GRAMMAR_WORKERS, thread_name_prefix="dsakv-grammar")

    # --- endpoints ----------------------------------------------------------------------------

    async def completion(self, body: CompletionRequest, raw: Request) -> Response:
        """Completions for every prompt of the request, `n` choices each (choice index
        `prompt * n + j`). With `echo`, each choice starts with its prompt, and with
        `logprobs` too, the prompt tokens' teacher-forced logprobs (the first is null) come
        before the generated ones; `max_tokens: 0` then only scores the prompt."""
        self._check_model(body.model)
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        n = self._n(body)
        if body.best_of is not None and body.best_of < n:  # OpenAI's and vLLM's words
            raise APIError(400, "best_of must be greater than or equal to n", param="best_of")
        if body.best_of not in (None, n):
            raise APIError(400, "best_of must equal n (no server-side ranking)", param="best_of")
        prompts = _prompt_list(body.prompt)
        echo = bool(body.echo)
        # vLLM's CompletionRequest: max_tokens left out is 16; an explicit null, up to the
        # context's end (what chat gets either way)
        null = "max_tokens" in body.model_fields_set and body.max_tokens is None
        most = self.engine.engine.max_model_len if null else 16
        params = self._params(
            body, body.max_tokens, most, body.logprobs, "logprobs", min_max_tokens=0 if echo else 1
        )
        # vLLM's: echo with logprobs scores the prompt too (unless prompt_logprobs says how),
        # and the choices then carry its prompt_logprobs
        scored = body.prompt_logprobs is not None or (echo and body.logprobs is not None)
        if body.prompt_logprobs is None and echo and body.logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=body.logprobs)
        beam = self._beam(body, params)
        if body.truncation_side == "right":
            cut = [await self._first_tokens(p, params, body.add_special_tokens) for p in prompts]
            prompts, params = cut, dataclasses.replace(params, truncate_prompt_tokens=None)
        given = "max_tokens" if body.max_tokens is not None else None
        count = len(prompts)
        named = _request_id(body, raw)
        await self.weights_ready()
        # Opened before the grammar compiles: an abort meanwhile ends it once compiled
        call = self.in_flight.open([_names(named)] * (count * n), "request_id")
        try:
            params = await self._ready_grammar(params, _grammar_field(body))
            if beam is not None:
                streams = await self._submit_beams(
                    prompts, params, beam, raw, given, special=body.add_special_tokens, call=call
                )
            else:
                streams = await self._submit_all(
                    prompts,
                    [params] * count,
                    n,
                    raw,
                    [given] * count,
                    special=body.add_special_tokens,
                    call=call,
                )
        except BaseException:  # (from here `_collect_all` or `_stream_response` closes it)
            self.in_flight.close(call)
            raise
        keep = params.truncate_prompt_tokens
        if keep is not None and keep <= 0:  # (-1: as many as the context leaves room for)
            keep = self.engine.engine.max_model_len - 1
        as_ids = bool(body.return_tokens_as_token_ids)
        choices = [
            _CompletionChoice(i, s, prompts[i // n], echo, keep, as_ids)
            for i, s in enumerate(streams)
        ]
        base = named or uuid.uuid4().hex
        rid, created = f"cmpl-{base}", int(time.time())
        head = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": self.model_name,
        }
        want_logprobs, ids = body.logprobs is not None, bool(body.return_token_ids)
        tokenizer = self.engine.engine.tokenizer

        if body.stream:
            usage, running = _stream_usage(body)

            async def events() -> AsyncIterator[str]:
                totals, ended = _Result(), {}
                async for i, u in self._merged(streams):
                    c = choices[i]
                    text = c.echo_text(u, tokenizer) + u.text
                    lp = c.logprobs(u) if want_logprobs else None
                    wanted = (lp and lp["tokens"]) or (ids and (u.token_ids or u.prompt_token_ids))
                    if not (text or u.finished or wanted):
                        continue  # held-back text and nobody wants the tokens yet
                    choice = {
                        "index": i,
                        "text": text,
                        "logprobs": lp,
                        "finish_reason": _reason(u),
                        "stop_reason": u.stop_reason,
                        **(_token_ids(u) if ids else {}),
                    }
                    yield _sse({**head, "choices": [choice], **_chunk_usage(usage, running, u)})
                    if u.finished:
                        ended[i] = u
                        totals.completion_tokens += u.completion_tokens
                        if i % n == 0:  # (each prompt once: its first choice ran it)
                            totals.prompt_tokens += u.prompt_tokens
                            totals.cached_tokens += u.cached_tokens
                for chunk in _sglang_extras(body, ended, usage, running, chat=False):
                    yield _sse({**head, **chunk})
                if usage:
                    yield _sse({**head, "choices": [], "usage": _usage(totals)})

            return self._stream_response(events(), streams, call, _id_header(base))

        results = await self._collect_all(streams, raw, call)
        out = []
        for c, r in zip(choices, results):
            u = r.as_update()
            out.append(
                {
                    "index": c.index,
                    "text": c.echo_text(u, tokenizer) + r.text,
                    "logprobs": c.logprobs(u) if want_logprobs else None,
                    "finish_reason": r.finish_reason,
                    "stop_reason": r.stop_reason,
                    **({"prompt_logprobs": _prompt_logprobs(u)} if scored else {}),
                    **(_token_ids(u) if ids else {}),
                    **({"hidden_states": _last_hidden(r)} if body.return_hidden_states else {}),
                }
            )
        total = _Result(
            prompt_tokens=sum(r.prompt_tokens for r in results[::n]),
            completion_tokens=sum(r.completion_tokens for r in results),
            cached_tokens=sum(r.cached_tokens for r in results[::n]),
        )
        answer = {**head, "choices": out, "usage": _usage(total), **_sglext(body, results)}
        return JSONResponse(answer, headers=_id_header(base))

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        named = _request_id(body, raw)
        run = await self.start_chat(body, raw, named)
        prep, streams, call, n = run.prep, run.streams, run.call, len(run.streams)
        top_n = (body.top_logprobs or 0) if body.logprobs else None
        ids, thinking = bool(body.return_token_ids), body.include_reasoning is not False
        as_ids, tracked = run.as_ids, run.params.logprob_token_ids is not None
        echo, role = echo_content(body), reply_role(body)
        base = named or uuid.uuid4().hex
        rid, created = f"chatcmpl-{base}", int(time.time())
        head = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": self.model_name,
        }

        if body.stream:
            usage, running = _stream_usage(body)

            async def events() -> AsyncIterator[str]:
                for i in range(n):
                    opening = {
                        "index": i,
                        "delta": {"role": role, "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    start = _Result(prompt_tokens=streams[i].prompt_tokens)  # no tokens yet
                    first = {"prompt_token_ids": run.prompt_ids} if i == 0 and ids else {}
                    chunk = {**head, **first, "choices": [opening]}
                    yield _sse({**chunk, **_chunk_usage(usage, running, start)})
                for i in range(n if echo else 0):  # (vLLM's: after the role chunks)
                    said = {"index": i, "delta": {"content": echo}, "logprobs": None}
                    start = _Result(prompt_tokens=streams[i].prompt_tokens)
                    chunk = {**head, "choices": [{**said, "finish_reason": None}]}
                    yield _sse({**chunk, **_chunk_usage(usage, running, start)})
                parsers = [prep.output_parser() for _ in range(n)]  # one per choice
                held = [""] * n  # SGLang's stream_reasoning false: each one's, until over
                totals, ended = _Result(), {}
                async for i, u in self._merged(streams):
                    parser = parsers[i]
                    cut = _reason(u) in CUT_SHORT
                    d = parser.feed(u.text, final=u.finished, cut=cut)
                    if body.stream_reasoning is False:
                        held[i] += d.reasoning
                        r = parser.reasoning_parser
                        if u.finished or r is None or r.done:
                            d, held[i] = dataclasses.replace(d, reasoning=held[i]), ""
                        else:
                            d = dataclasses.replace(d, reasoning="")
                    delta = chat_delta(d, thinking)
                    if not (delta or u.finished or ((top_n is not None or ids) and u.token_ids)):
                        continue  # held-back text and nobody wants the tokens yet
                    lp = _chat_logprobs(u, as_ids, tracked) if top_n is not None else None
                    if not (delta or u.finished):
                        delta = {"content": ""}
                    reason = prep.finish_reason(parser, _reason(u))
                    choice = {
                        "index": i,
                        "delta": delta,
                        "logprobs": lp,
                        "finish_reason": reason,
                        "stop_reason": u.stop_reason,
                        **({"token_ids": u.token_ids} if ids else {}),
                    }
                    yield _sse({**head, "choices": [choice], **_chunk_usage(usage, running, u)})
                    if u.finished:
                        ended[i] = u
                        totals.prompt_tokens = u.prompt_tokens
                        totals.completion_tokens += u.completion_tokens
                        if i == 0:  # (the prompt's: the forks found it cached)
                            totals.cached_tokens = u.cached_tokens
                for chunk in _sglang_extras(body, ended, usage, running, chat=True):
                    yield _sse({**head, **chunk})
                if usage:
                    yield _sse({**head, "choices": [], "usage": _usage(totals)})

            return self._stream_response(events(), streams, call, _id_header(base))

        results = await self._collect_all(streams, raw, call)
        choices = []
        for i, r in enumerate(results):  # n choices of one prompt
            parser = prep.output_parser()
            parser.feed(r.text, final=True, cut=r.finish_reason in CUT_SHORT)
            message = {**chat_message(parser, thinking), "role": role}
            if echo:
                message["content"] = echo + (message["content"] or "")
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": (
                        _chat_logprobs(r.as_update(), as_ids, tracked)
                        if top_n is not None
                        else None
                    ),
                    "finish_reason": prep.finish_reason(parser, r.finish_reason),
                    "stop_reason": r.stop_reason,
                    **({"token_ids": r.token_ids} if ids else {}),
                    **({"hidden_states": _last_hidden(r)} if body.return_hidden_states else {}),
                }
            )
        total = _Result(
            prompt_tokens=results[0].prompt_tokens,
            completion_tokens=sum(r.completion_tokens for r in results),
            cached_tokens=results[0].cached_tokens,
        )
        out = {**head, "object": "chat.completion", "choices": choices, "usage": _usage(total)}
        out.update(_sglext(body, results))
        if body.prompt_logprobs is not None:  # vLLM's: the response's, not a choice's
            out["prompt_logprobs"] = _prompt_logprobs(results[0].as_update())
        if ids:
            out["prompt_token_ids"] = results[0].as_update().prompt_token_ids
        return JSONResponse(out, headers=_id_header(base))

    async def start_chat(
        self, body: ChatCompletionRequest, raw: Request, name: str | None = None
    ) -> ChatRun:
        """A chat request's prompt rendered (tools, reasoning: `prepare_chat`) and its `n`
        choices handed to the engine: what /v1/chat/completions and /v1/responses share.
        The caller owns the run's streams and call from here (`_collect_all`,
        `_stream_response`). `name`: the client's request id (`_request_id`)."""
        self._check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        tokenizer = self.engine.engine.tokenizer
        model_type = self.engine.engine.model_config.model_type
        if not has_chat_format(tokenizer, model_type):
            raise APIError(400, "this model has no chat template; use /v1/completions")
        prep = prepare_chat(body, tokenizer, self.chat_parsers, model_type)  # tools, reasoning
        prompt = prep.prompt
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
        grammar_param = _grammar_field(body)
        if prep.grammar is not None:  # tool_choice forces a call
            if params.grammar is not None:
                raise APIError(
                    400,
                    "a required or named tool_choice cannot be combined with another grammar",
                    param="tool_choice",
                )
            params = dataclasses.replace(params, grammar=prep.grammar)
            grammar_param = "tools"
        # Structured output is the answer's (`content`): where the model reasons first, the
        # grammar starts once the reasoning is over, whichever field asked for it (vLLM's
        # reasoning parsers; SGLang's ReasonerGrammarBackend, for its regex / ebnf /
        # json_schema and structural tags too); /generate keeps a grammar over the whole
        # output. A forcing tool_choice's tag holds the reasoning itself (`prepare_chat`
        # gives it reasoning "disabled").
        n = self._n(body)
        beam = self._beam(body, params)
        given = param if max_tokens is not None else None
        special = body.add_special_tokens  # (vLLM's: none, the template holds its own)
        if body.truncation_side == "right":  # (the rendered prompt's first tokens, as vLLM's)
            prompt = await self._first_tokens(prompt, params, special)
            params = dataclasses.replace(params, truncate_prompt_tokens=None)
        await self.weights_ready()
        call = self.in_flight.open([_names(name)] * n, "request_id")  # (as completion's)
        streams: list[RequestStream] = []
        prompt_ids = None
        try:
            params = await self._ready_grammar(params, grammar_param, prep.reasoning)
            if beam is not None:
                streams = await self._submit_beams(
                    [prompt], params, beam, raw, given, "messages", special, call=call
                )
            else:
                streams = await self._submit_all(
                    [prompt], [params], n, raw, [given], "messages", special, call=call
                )
            if body.stream and body.return_token_ids:  # (vLLM's first chunk carries them)
                keep = params.truncate_prompt_tokens
                prompt_ids = await asyncio.to_thread(
                    self.engine.engine.prompt_ids, prompt, keep, special
                )
        except BaseException:
            for s in streams:
                self.engine.abort(s)
            self.in_flight.close(call)
            raise
        as_ids = bool(body.return_tokens_as_token_ids)
        return ChatRun(prep, streams, call, params, prompt_ids, as_ids)

    async def flush_cache(self) -> Response:
        """Drop the prefix cache (`Engine.flush_cache`); a 400 while requests run or wait,
        as SGLang's."""
        try:
            flushed = await self.engine.call(lambda e: e.flush_cache())
        except DsakvError as e:
            raise APIError(400, str(e)) from None
        except RuntimeError as e:
            raise APIError(503, str(e), type="server_error") from None
        if not flushed:
            raise APIError(400, "the cache was not flushed: requests are running or waiting")
        return Response("Cache flushed.\n", media_type="text/plain")

    async def weights_ready(self) -> None:
        """Until no weight update runs or waits and generation is not paused: a generation
        call awaits it right before it opens (`InFlight.open`), so that an update never runs
        under a call it did not mean to (a paused one's)."""
        while not (self._serving.is_set() and self._unpaused.is_set()):
            await self._unpaused.wait()
            await self._serving.wait()

    async def pause_generation(self, mode: str) -> None:
        """SGLang's /pause_generation: new generation calls wait until
        `continue_generation`; "abort" ends every call in flight (as /abort_request's) and
        returns once they ended, "in_place" stops the engine stepping (requests keep their
        KV) and "retract" also has the running requests give their KV back, to compute it
        again when they go on. Paused requests' clients only wait. An "abort" or "wait"
        pause over an in-place one has the engine step again (new calls still wait), so
        that its requests end."""
        was = self._unpaused.is_set()
        self._unpaused.clear()
        if mode in ("abort", "wait"):  # ("wait", vLLM's /pause: the calls in flight end first)
            if mode == "abort":
                self.in_flight.abort_all()
            if not was:  # (paused in place: its requests end only if the engine steps)
                await self.engine.resume()
            await self.in_flight.drained()
            return
        try:
            await self.engine.pause(retract=mode == "retract")
        except DsakvError as e:
            if was:
                self._unpaused.set()
            raise APIError(400, str(e)) from None

    async def continue_generation(self) -> None:
        await self.engine.resume()
        self._unpaused.set()

    @property
    def generation_paused(self) -> bool:
        return not self._unpaused.is_set()

    @property
    def disaggregated(self) -> bool:
        """Whether this is a prefill or decode server (its bridge's SGLang
        `disaggregation_mode`)."""
        return self.engine.server_info()["disaggregation_mode"] != "null"

    async def paused_requests(self) -> int:
        """The requests a pause holds in the engine (in place or retracted: a weight update
        runs under them, SGLang's num_paused_requests); none while generation goes on."""
        if self._unpaused.is_set():
            return 0
        c = await self.engine.call(lambda e: e.counters())
        return int(c["running_requests"] + c["waiting_requests"])

    async def update_weights(
        self, source: str | GroupUpdate, abort_all: bool = False, version: str | None = None
    ) -> tuple[bool, str]:
        """SGLang's /update_weights_from_disk (`source` a checkpoint path) and
        /update_weights_from_distributed (a trainer's tensors over a group `join_weight_group`
        joined): new generation calls wait, the ones in flight end first (`abort_all`:
        aborted, as /abort_request's), then the engine loads `source` between steps
        (`Engine.update_weights`: the prefix cache is dropped, an update that does not fit
        changes nothing). While generation is paused, as SGLang's, it does not wait for the
        calls in flight: paused requests go on with the new weights once generation
        continues. (success, SGLang's message)."""
        if abort_all:
            self.in_flight.abort_all()
        async with self._updating:
            paused = not self._unpaused.is_set()
            self._serving.clear()
            try:
                if not paused:
                    await self.in_flight.drained()
                deadline = time.monotonic() + _UPDATE_IDLE_TIMEOUT_S
                while not await self.engine.call(lambda e: e.update_weights(source)):
                    if time.monotonic() > deadline:  # (a trainer's tensors received first)
                        busy = "the engine stayed busy"
                        await self.engine.call(lambda e, why=busy: e.refuse_update(source, why))
                    await asyncio.sleep(0.01)
                await asyncio.to_thread(self.engine.weights_updated)
                if version is not None:
                    self.weight_version = version
            except Exception as e:  # noqa: BLE001 - the answer says it; the weights stand
                return False, f"Failed to update weights: {e}"
            finally:
                self._serving.set()
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        return True, message

    async def join_weight_group(self, spec: WeightGroup) -> tuple[bool, str]:
        """SGLang's /init_weights_update_group: every engine rank joins the trainer's group
        (the engine thread waits for the trainer meanwhile: `Engine.join_weight_group`).
        Not on a prefill or decode server: their handshake compares checkpoints on disk."""
        if self.disaggregated:
            return False, (
                "Failed to init weights update group: a prefill or decode server is updated "
                "from a checkpoint (/update_weights_from_disk): their handshake compares "
                "checkpoints"
            )
        try:
            await self.engine.call(lambda e: e.join_weight_group(spec))
        except DsakvError as e:
            return False, f"Failed to init weights update group: {e}"
        return True, "Succeeded to initialize custom process group."

    async def leave_weight_group(self, name: str) -> tuple[bool, str]:
        try:
            await self.engine.call(lambda e: e.leave_weight_group(name))
        except DsakvError as e:
            return False, f"Failed to destroy weights update group: {e}"
        return True, "Succeeded to destroy custom process group."

    def model_card(self, name: str) -> dict[str, Any]:
        """A served name's card, as /v1/models lists it and /v1/models/{model} returns it."""
        e = self.engine.engine
        return {
            "id": name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "dsakv",
            "root": e.config.model,
            "max_model_len": e.max_model_len,
        }

    def model_info(self) -> dict[str, Any]:
        """SGLang's `/model_info` shape (sglang-router reads `model_type` from it)."""
        e = self.engine.engine
        return {
            "model_path": e.weights_path,  # (as SGLang's, the last update's)
            "tokenizer_path": None if e.tokenizer is None else e.config.tokenizer or e.config.model,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": e.model_config.model_type,
        }

    async def server_info(self) -> dict[str, Any]:
        """SGLang's `/server_info` shape: the engine's settings (`dsakv.engine.info`, what
        `LLM.get_server_info` returns) with the server's own: its served name (what its
        /v1/models lists) and PD role."""
        counters = await self.engine.counters()  # (the last ones during a long step)
        info = engine_info(self.engine.engine, counters, self.model_name)
        return {**info, **self.engine.server_info()}

    # --- plumbing -----------------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self._accepted:
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
        min_max_tokens: int = 1,
        generation_config: bool = True,
    ) -> SamplingParams:
        """Sampling params from the request (n is each handler's business: `_n`);
        `generation_config`: whether the model's defaults fill in what it leaves out (not
        on SGLang's /generate)."""
        self._n(body)
        if body.prompt_logprobs is not None and body.stream:  # (vLLM's rule)
            raise APIError(
                400, "prompt_logprobs are not available with stream: true", param="prompt_logprobs"
            )
        try:  # (refused before the prompt is tokenized)
            self.engine.engine.check_priority(body.priority)
        except DsakvError as e:
            raise APIError(400, str(e), param=e.param) from None
        for name in _NOT_RUN:  # (each was accepted and ignored)
            if getattr(body, name, None) not in (None, False):
                raise APIError(400, f"{name} is not supported", param=name)
        named_ids = self._logprob_token_ids(body, logprobs, logprobs_param, max_tokens)
        # SGLang's (stop_regex: a sampling param on /generate, `generate._SAMPLING_NOT_RUN`)
        for name in (*SGLANG_NOT_RUN, "stop_regex"):
            if getattr(body, name, None):
                raise APIError(400, f"{name} is not supported by this server", param=name)
        budget = body.thinking_token_budget
        if budget is not None and budget >= 0 and self.chat_parsers.reasoning is None:
            raise APIError(  # (vLLM's rule: the budget counts inside the parser's markers)
                400,
                "thinking_token_budget needs a reasoning parser; this server runs none",
                param="thinking_token_budget",
            )
        if body.truncation_side not in (None, "left", "right"):
            raise APIError(
                400,
                f"truncation_side must be 'left' or 'right', got {body.truncation_side!r}",
                param="truncation_side",
            )
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options needs stream: true", param="stream_options")
        if max_tokens is not None and max_tokens < min_max_tokens:
            raise APIError(
                400,
                f"{max_tokens_param} must be at least {min_max_tokens}, got {max_tokens}",
                param=max_tokens_param,
            )
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise APIError(
                400,
                f"{logprobs_param} must be in 0..{MAX_LOGPROBS}, got {logprobs}",
                param=logprobs_param,
            )
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        seed = body.sampling_seed if body.seed is None else body.seed
        if body.sampling_seed not in (None, seed):
            raise APIError(
                400,
                f"seed ({body.seed}) and sampling_seed ({body.sampling_seed}) differ; "
                "they are one setting, give one of them",
                param="sampling_seed",
            )
        if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
            # (SamplingParams' check, here to name the field the request sent)
            name = "seed" if body.seed is not None else "sampling_seed"
            raise APIError(
                400,
                f"{name} must be a 64-bit signed integer ({SEED_MIN}..{SEED_MAX}), got {seed}",
                param=name,
            )
        # What the request leaves out: the model's generation_config.json, else OpenAI's
        # (SamplingParams' own defaults).
        defaults = self.engine.engine.model_config.sampling_defaults
        sampling = dict(defaults if generation_config else {})
        sampling.update((k, v) for k in SAMPLING_FIELDS if (v := getattr(body, k)) is not None)
        most = max_tokens if max_tokens is not None else default_max_tokens
        most = min(most, sampling.pop("max_tokens", most))  # max_new_tokens caps (vLLM's)
        try:
            return SamplingParams(
                max_tokens=most,
                **sampling,
                seed=seed,
                stop=tuple(stop),
                stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=bool(body.ignore_eos),
                include_stop_str_in_output=bool(
                    body.include_stop_str_in_output or body.no_stop_trim
                ),
                skip_special_tokens=body.skip_special_tokens is not False,
                min_tokens=body.min_tokens or 0,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                logit_bias=self._logit_bias(body.logit_bias),
                logprobs=None if named_ids else logprobs,  # (vLLM's: then their count)
                logprob_token_ids=named_ids,
                repetition_detection=(
                    body.repetition_detection and body.repetition_detection.model_dump()
                ),
                grammar=_grammar(body),
                allowed_token_ids=body.allowed_token_ids,
                bad_words=tuple(body.bad_words or ()),
                truncate_prompt_tokens=body.truncate_prompt_tokens,
                cache_salt=request_salt(body.cache_salt, body.extra_key),
                priority=body.priority,
                thinking_token_budget=body.thinking_token_budget,
                **row_params(body, body.return_hidden_states),  # (`_sglext`, `_last_hidden`)
                prompt_logprobs=(
                    body.prompt_logprobs
                    if body.prompt_logprobs is not None
                    else (0 if max_tokens == 0 else None)
                ),
            )
        except DsakvError as e:
            raise APIError(400, str(e), param=e.param) from None

    def _logprob_token_ids(
        self,
        body: GenerationRequest,
        logprobs: int | None,
        logprobs_param: str,
        max_tokens: int | None,
    ) -> list[int] | None:
        """vLLM's `logprob_token_ids` (None where not asked, or empty: the top ones), refused
        where vLLM refuses it: without logprobs (chat's `logprobs: true`), with beam search,
        or with no output token to score (echo's `max_tokens: 0`). `SamplingParams` and the
        engine check the ids."""
        ids, name = body.logprob_token_ids, "logprob_token_ids"
        if not ids:
            return None
        if body.use_beam_search:
            raise APIError(400, "logprob_token_ids is not supported with beam search", param=name)
        if logprobs is None:
            needs = "logprobs: true" if logprobs_param == "top_logprobs" else "logprobs"
            raise APIError(400, f"logprob_token_ids needs {needs}", param=name)
        if max_tokens == 0:
            raise APIError(
                400, "logprob_token_ids scores output tokens; max_tokens is 0", param=name
            )
        return ids

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float]:
        """OpenAI's logit_bias: token ids (as JSON object keys, so strings) to biases."""
        vocab = self.engine.engine.model_config.vocab_size
        out: dict[int, float] = {}
        for key, value in (bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                token = -1
            if not 0 <= token < vocab or token in out:
                raise APIError(
                    400,
                    f"logit_bias keys must be distinct token ids in 0..{vocab - 1}, got {key!r}",
                    param="logit_bias",
                )
            out[token] = value
        return out

    def _n(self, body: GenerationRequest) -> int:
        n = 1 if body.n is None else body.n
        limit = self.engine.engine.max_choices
        if not 1 <= n <= limit:
            raise APIError(400, f"n must be in 1..{limit}, got {n}", param="n")
        return n

    async def _ready_grammar(
        self, params: SamplingParams, param: str | None, reasoning: str | None = None
    ) -> SamplingParams:
        """`params` with its grammar compiled, on a worker thread, into the engine's cache,
        where the engine thread then finds it: a schema that takes seconds to compile keeps
        only its own request waiting, not every stream the engine is stepping (vLLM compiles
        off its step loop too). With `reasoning` (`PreparedChat.reasoning`), the grammar
        starts once the output's reasoning block is over. A grammar that does not compile is
        a 400 naming `param`."""
        grammar = params.grammar
        if grammar is None:
            return params

        def build() -> tuple[str, str]:
            g = after_reasoning(grammar, reasoning or "disabled")
            self._grammar_cache().compile(g)
            return g

        compiling = asyncio.get_running_loop().run_in_executor(self._compiles, build)
        try:
            grammar = await asyncio.wait_for(compiling, GRAMMAR_TIMEOUT_S)
        except DsakvError as e:  # GrammarError; or a model without a tokenizer
            raise APIError(400, str(e), param=param) from None
        except asyncio.TimeoutError:  # (SGLang's SGLANG_GRAMMAR_TIMEOUT)
            raise APIError(
                400, f"the grammar did not compile within {GRAMMAR_TIMEOUT_S:g} s", param=param
            ) from None
        return dataclasses.replace(params, grammar=grammar)

    def _grammar_cache(self) -> GrammarCache:
        """The engine's `GrammarCache`: built on first use, by one thread only. The engine
        thread asks for it only for requests with a grammar, which came through here first."""
        with self._grammars_lock:
            return self.engine.engine.grammars

    async def _submit_n(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        n: int,
        raw: Request,
        prompt_param: str = "prompt",
        max_tokens_param: str | None = None,
        special: bool = True,
        call: _Call | None = None,
    ) -> list[RequestStream]:
        """`n` choices of one prompt (they share its KV pages); a rejected prompt or grammar
        is a 400, and so is one that leaves too little room in the context for the
        `max_tokens` the client gave (in the field `max_tokens_param`; vLLM's check: the
        engine would cut the output short at the context). A client that leaves before the
        engine takes them cancels them: a prefill server waits here for its decode server,
        which never comes for a request the decode server refused (the router hangs up).
        So does an abort of them all (`call`'s, `InFlight`): they then end at once, aborted
        while waiting. The prompt is tokenized here, off the engine thread (a 5 MB one held
        every stream five seconds there)."""
        prompt = await self._fitting(prompt, params, max_tokens_param, prompt_param, special)
        started = False

        async def generate_n() -> list[RequestStream]:
            nonlocal started
            started = True
            return await self.engine.generate_n(prompt, params, n)

        submit = asyncio.ensure_future(generate_n())
        if call is not None:
            self.in_flight.waiting(call, submit, n)  # (aborted while it tokenized: cancelled)
        watcher = asyncio.create_task(_when_left(raw, submit.cancel))
        try:
            return await submit
        except asyncio.CancelledError:
            if not started:  # the engine never saw it
                with contextlib.suppress(APIError):
                    self.engine.forgo(n)
            if self.in_flight.aborted(call, n) and not _cancelling():
                return [aborted_waiting(len(prompt)) for _ in range(n)]
            if not watcher.done():
                raise  # this handler was cancelled, not the client gone
            raise APIError(499, "the client closed the request") from None
        except (DsakvError, RuntimeError) as e:
            raise refusal(e, prompt_param) from None
        finally:
            watcher.cancel()

    async def _fitting(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        param: str | None,
        prompt_param: str,
        special: bool = True,
    ) -> list[int]:
        """`prompt`'s token ids (truncated as `params` says), if `params.max_tokens` more
        fit in the context after them where the client gave it (in field `param`); else
        vLLM's 400. Tokenized off the event loop (a long prompt takes a while)."""
        e, max_tokens = self.engine.engine, params.max_tokens
        try:
            keep = params.truncate_prompt_tokens
            ids = await asyncio.to_thread(e.prompt_ids, prompt, keep, special)
        except DsakvError as err:
            raise APIError(400, str(err), param=err.param or prompt_param) from None
        if param is not None and len(ids) + max_tokens > e.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {e.max_model_len} tokens. However, "
                f"you requested {len(ids) + max_tokens} tokens ({len(ids)} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages "
                "or completion.",
                param=param,
            )
        return ids

    async def _first_tokens(
        self, prompt: str | list[int], params: SamplingParams, special: bool = True
    ) -> str | list[int]:
        """vLLM's truncation_side "right": the prompt's first `truncate_prompt_tokens` token
        ids, where it has more (else the prompt as given, as "left" leaves it). A text is
        tokenized whole, as a left-truncated one (`Engine.prompt_ids`), then cut: a cut of
        its characters first could tokenize otherwise (BPE merges across the cut). -1 ("as
        many as fit") is refused under PD, where each server would cut at its own context
        (the left cut's suffix check, `PrefillAsyncEngine.generate_n`, has no prefix one)."""
        e, keep = self.engine.engine, params.truncate_prompt_tokens
        if keep is None:
            return prompt
        if keep == -1 and self.disaggregated:
            raise APIError(
                400,
                "truncate_prompt_tokens -1 with truncation_side right is not supported with "
                "prefill/decode disaggregation",
                param="truncate_prompt_tokens",
            )
        keep = keep if keep > 0 else e.max_model_len - 1
        try:
            if isinstance(prompt, str):
                ids = await asyncio.to_thread(e.encode, prompt, special)
            else:
                ids = list(prompt)
        except DsakvError as err:
            raise APIError(400, str(err), param=err.param or "prompt") from None
        return ids[:keep] if len(ids) > keep else prompt

    async def _submit_all(
        self,
        prompts: list[str | list[int]],
        params: Sequence[SamplingParams],
        n: int,
        raw: Request,
        max_tokens_params: Sequence[str | None],
        prompt_param: str = "prompt",
        special: bool = True,
        call: _Call | None = None,
    ) -> list[RequestStream]:
        """Every prompt's `n` choices, in order, each prompt with its own params (and the
        field its client's max_tokens came in: `_submit_n`); if one is rejected, the others
        are aborted (and `call` closed: `InFlight`, which learns of each prompt's choices
        as the engine takes them)."""
        streams: list[RequestStream] = []
        try:
            for prompt, p, given in zip(prompts, params, max_tokens_params, strict=True):
                taken = await self._submit_n(prompt, p, n, raw, prompt_param, given, special, call)
                streams += taken
                if call is not None:
                    self.in_flight.took(call, taken)
        except BaseException:
            for s in streams:
                self.engine.abort(s)
            self.in_flight.close(call)
            raise
        return streams

    def _beam(self, body: GenerationRequest, params: SamplingParams) -> BeamSearchParams | None:
        """vLLM's `use_beam_search` (None: not asked for): `n` is the beam width, with the
        request's max_tokens, temperature, stops, ignore_eos, include_stop_str_in_output and
        length_penalty. What it does not run is a 400 naming it (vLLM's ignores it): a
        sampling field the request sets (a model's generation_config defaults are not the
        request's), structured output, tools, prompt scoring; and prefill/decode
        disaggregation, whose router pairs each request with a prefill server's."""
        if not body.use_beam_search:
            return None
        if self.disaggregated:
            raise APIError(
                400,
                "use_beam_search is not supported with prefill/decode disaggregation (each "
                "step of the search is a request of its own, which no router paired)",
                param="use_beam_search",
            )
        if getattr(body, "tools", None):
            raise APIError(400, "tools are not supported with use_beam_search", param="tools")
        if params.grammar is not None:
            raise APIError(
                400,
                "structured output is not supported with use_beam_search",
                param=_grammar_field(body),
            )
        if params.prompt_logprobs is not None:
            name = "prompt_logprobs" if body.prompt_logprobs is not None else "echo"
            raise APIError(
                400,
                f"{name} (scoring the prompt) is not supported with use_beam_search",
                param=name,
            )
        sent = {k: v for k in SAMPLING_FIELDS if (v := getattr(body, k)) is not None}
        asked, off = SamplingParams(**sent), SamplingParams()
        for name in _NOT_IN_BEAM_SEARCH:
            value = getattr(asked if name in SAMPLING_FIELDS else params, name, None)
            if value != getattr(off, name, None):
                raise APIError(400, f"{name} is not supported with use_beam_search", param=name)
        try:
            return BeamSearchParams(
                beam_width=self._n(body),
                max_tokens=params.max_tokens,
                ignore_eos=params.ignore_eos,
                temperature=params.temperature,
                length_penalty=1.0 if body.length_penalty is None else body.length_penalty,
                include_stop_str_in_output=params.include_stop_str_in_output,
                stop=params.stop,
                stop_token_ids=params.stop_token_ids,
            )
        except DsakvError as e:
            raise APIError(400, str(e), param="n" if e.param == "beam_width" else e.param) from None

    async def _submit_beams(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams,
        beam: BeamSearchParams,
        raw: Request,
        given: str | None,
        prompt_param: str = "prompt",
        special: bool = True,
        call: _Call | None = None,
    ) -> list[RequestStream]:
        """`use_beam_search`'s outputs: each prompt's best `beam_width` sequences, best
        first, as finished streams, read back as any request's (`finished_stream`). The
        search runs (`_beam_steps`) as `_submit_n`'s engine call waits: a client that leaves
        cancels it, and so does an abort of all its outputs, which then end as aborted while
        waiting. Prompts are checked (and tokenized) as `_submit_n`'s."""
        e = self.engine.engine
        ids = [await self._fitting(p, params, given, prompt_param, special) for p in prompts]
        try:
            searches = [BeamSearch(e, x, beam, params.skip_special_tokens) for x in ids]
        except DsakvError as err:
            raise APIError(400, str(err), param=err.param) from None
        extra = dict(cache_salt=params.cache_salt, priority=params.priority, seed=params.seed)
        step = beam.step_params(params.logprobs, **extra)
        n = len(ids) * beam.beam_width
        search = asyncio.ensure_future(self._beam_steps(searches, step, raw))
        if call is not None:
            self.in_flight.waiting(call, search, n)
        watcher = asyncio.create_task(_when_left(raw, search.cancel))
        try:
            ended = await search
        except asyncio.CancelledError:
            if self.in_flight.aborted(call, n) and not _cancelling():
                return [aborted_waiting(len(x)) for x in ids for _ in range(beam.beam_width)]
            if not watcher.done():
                raise  # this handler was cancelled, not the client gone
            raise APIError(499, "the client closed the request") from None
        finally:
            watcher.cancel()
        if not ended:  # (a step aborted: the search ends as an abort of all its outputs)
            return [aborted_waiting(len(x)) for x in ids for _ in range(beam.beam_width)]
        streams = [
            finished_stream(e, req) for s in searches for req, _ in s.results(params.logprobs)
        ]
        if call is not None:
            self.in_flight.took(call, streams)
        return streams

    async def _beam_steps(
        self, searches: list[BeamSearch], step: SamplingParams, raw: Request
    ) -> bool:
        """Run `searches` to their end, a step at a time: one request per live beam of each,
        all handed to the engine at once (so that one engine step runs them) and read back
        whole (`advance_all`). False: a step's request was aborted (as /abort_request
        aborts: its output so far, here none), which ends the search; one that ended
        otherwise without its token fails it, as the offline call's (`Step.of`)."""
        while prompts := live_prompts(searches):
            submits = (self.engine.generate_n(p, step, 1) for p in prompts)
            taken = await asyncio.gather(*submits, return_exceptions=True)
            streams = [x[0] for x in taken if isinstance(x, list)]
            failed = next((x for x in taken if isinstance(x, BaseException)), None)
            if failed is not None:
                for stream in streams:
                    self.engine.abort(stream)
                if isinstance(failed, (DsakvError, RuntimeError)):
                    raise refusal(failed, None) from None
                raise failed
            results = await self._collect_all(streams, raw)
            if cut := next((r for r in results if not r.token_ids), None):
                if cut.finish_reason == "abort":
                    return False
                why = f"it ended without a token ({cut.finish_reason})"
                raise refusal(step_failed(why), None)
            advance_all(
                searches,
                (Step(r.token_ids[0], r.logprobs[0], None, r.top_logprobs[0]) for r in results),
            )
        return True

    async def _merged(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, Update]]:
        """(choice index, update) from all streams as they arrive, until all finished."""
        if len(streams) == 1:
            async for u in self._updates(streams[0]):
                yield 0, u
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for u in self._updates(stream):
                    await merged.put((i, u, None))
            except APIError as e:
                await merged.put((i, None, e))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            left = len(streams)
            while left:
                i, u, error = await merged.get()
                if error is not None:
                    raise error
                yield i, u
                left -= u.finished
        finally:
            for t in tasks:
                t.cancel()

    async def _collect_all(
        self, streams: list[RequestStream], raw: Request, call: _Call | None = None
    ) -> list[_Result]:
        """`_collect` for every stream at once; the first failure aborts the rest. `call`
        is closed at the end."""
        if len(streams) == 1:
            try:
                return [await self._collect(streams[0], raw)]
            finally:
                self.in_flight.close(call)
        tasks = [asyncio.ensure_future(self._collect(s, raw)) for s in streams]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            self.in_flight.close(call)
            for s in streams:
                self.engine.abort(s)  # (a finished one: nothing to do)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for t in tasks:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()
        return [t.result() for t in tasks]

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's /tokenize: the ids /v1/completions (`prompt`) or /v1/chat/completions
        (`messages`, through the chat template) would run."""
        self._check_model(body.model)
        e = self.engine.engine
        if e.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            if not body.messages:
                raise APIError(400, "messages is empty", param="messages")
            chat = ChatCompletionRequest(
                messages=body.messages,
                tools=body.tools,
                chat_template_kwargs=body.chat_template_kwargs,
                chat_template=body.chat_template,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
            )
            try:
                model_type = e.model_config.model_type
                text = prepare_chat(chat, e.tokenizer, self.chat_parsers, model_type).prompt
                tokens = e.encode(text, special=bool(body.add_special_tokens))
            except DsakvError as err:
                raise APIError(400, str(err), param="messages") from None
        else:
            try:
                special = True if body.add_special_tokens is None else body.add_special_tokens
                tokens = e.encode(body.prompt, special=special)
            except DsakvError as err:
                raise APIError(400, str(err), param="prompt") from None
        return {"tokens": tokens, "count": len(tokens), "max_model_len": e.max_model_len}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self._check_model(body.model)
        e = self.engine.engine
        if e.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        vocab = e.model_config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens must be in 0..{vocab - 1}", param="tokens")
        text = e.tokenizer.decode(body.tokens)
        return {"prompt": text, "text": text}  # (vLLM's key, SGLang's)

    async def _updates(self, stream: RequestStream) -> AsyncIterator[Update]:
        """A request's updates up to and including the finishing one; errors raise."""
        finished, times = False, self.metrics.request()
        try:
            while True:
                u = await stream.get()
                times.observe(u)
                finished = u.finished
                if u.error is not None:
                    raise _update_error(u)
                yield u
                if u.finished:
                    return
        finally:
            if not finished:  # the client left, or another choice failed: it is aborted
                self.metrics.success.labels("abort").inc()

    async def _collect(self, stream: RequestStream, raw: Request) -> _Result:
        """Wait for the whole output, aborting if the client goes away meanwhile."""

        # (an abort ends the stream with finish_reason "abort")
        watcher = asyncio.create_task(_when_left(raw, lambda: self.engine.abort(stream)))
        result, finished, times = _Result(), False, self.metrics.request()
        try:
            while not finished:
                u = await stream.get()
                times.observe(u)
                finished = u.finished
                if u.error is not None:
                    raise _update_error(u)
                result.add(u)
        finally:
            if not finished:  # (cancelled: another choice failed)
                self.metrics.success.labels("abort").inc()
            left = watcher.done() and not watcher.cancelled()
            watcher.cancel()
            self.engine.abort(stream)  # a no-op when it already finished
        if result.finish_reason == "abort":
            if left:  # nobody hears this answer; it is counted as the client's doing
                raise APIError(499, "the client closed the request")
            if result.abort_asked is None:  # (asked: the output so far, as SGLang answers)
                raise APIError(503, "request aborted (server shutting down)", type="server_error")
        return result

    def _stream_response(
        self,
        events: AsyncIterator[str],
        stream: RequestStream | list[RequestStream],
        call: _Call | None = None,
        headers: dict[str, str] | None = None,
    ) -> Response:
        """The SSE response; its engine requests are aborted and `call` closed however it
        ends, its building (`headers` not sendable) included."""
        streams = stream if isinstance(stream, list) else [stream]

        async def sse() -> AsyncIterator[str]:
            try:
                async for chunk in events:
                    yield chunk
            except APIError as e:
                yield _sse(e.body())
            yield "data: [DONE]\n\n"

        def close() -> None:
            self.in_flight.close(call)
            for s in streams:
                self.engine.abort(s)

        return _AbortingStream(sse(), close, headers)


class _AbortingStream(StreamingResponse):
    """An SSE response that aborts its engine request however it ends (disconnect
    included), or fails to be built."""

    def __init__(
        self,
        content: AsyncIterator[str],
        on_close: Callable[[], None],
        headers: dict[str, str] | None = None,
    ) -> None:
        self._on_close = on_close
        try:
            super().__init__(
                content,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", **(headers or {})},
            )
        except BaseException:
            on_close()
            raise

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _cancelling() -> bool:
    """Whether this task itself is being cancelled (its handler, not what it awaited);
    Python 3.10 has no `Task.cancelling`, and there only the awaited task was."""
    me = asyncio.current_task()
    cancelling = getattr(me, "cancelling", None)
    return bool(cancelling and cancelling())


def _rank_load(rank: int, c: dict[str, float], page_size: int) -> dict[str, int]:
    """SGLang's /get_load entry for one rank's counters: `num_tokens` the tokens requests
    hold (not the prefix cache's evictable pages) and those the waiting ones will."""
    running, waiting = int(c.get("running_requests", 0)), int(c.get("waiting_requests", 0))
    held = int(c.get("pages_used", 0)) - int(c.get("pages_evictable", 0))
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


async def _when_left(raw: Request, then: Callable[[], Any]) -> None:
    """Call `then` once the client has hung up (run as a task; cancel it when done)."""
    await client_left(raw)
    then()


# --- formatting -------------------------------------------------------------------------------


def _request_id(body: GenerationRequest, raw: Request) -> str | None:
    """The client's id for a request, vLLM's: its X-Request-Id header, else the body's
    `request_id` (the response's id is "cmpl-" or "chatcmpl-" and it). Like a /generate
    rid it names the request for /abort_request, one call's at a time. A body id that
    cannot be the X-Request-Id header it comes back in is a 400 before anything runs."""
    named = raw.headers.get("x-request-id")
    if named:
        return named
    if body.request_id and not _HEADER_SAFE.fullmatch(body.request_id):
        raise APIError(
            400,
            "request_id must be printable ASCII without leading or trailing spaces "
            f"(it is sent back as the X-Request-Id header), got {body.request_id!r}",
            param="request_id",
        )
    return body.request_id or None


# What an HTTP header value may be (RFC 9110's field-value), in ASCII
_HEADER_SAFE = re.compile(r"[\x21-\x7e]+(?:[ \t]+[\x21-\x7e]+)*")


def _names(name: str | None) -> tuple[str, ...]:
    return (name,) if name else ()


def _id_header(base: str) -> dict[str, str]:
    """The response's id as its X-Request-Id header (vLLM's, with
    --enable-request-id-headers)."""
    return {"X-Request-Id": base}


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _update_error(u: Update) -> APIError:
    if u.error_status < 500:
        return APIError(u.error_status, u.error)
    return APIError(u.error_status, u.error, type="server_error")


# Finish reasons that cut the output short: a tool call still open there is reported
# unclosed, not closed with the arguments written so far.
CUT_SHORT = ("length", "repetition")


def refusal(e: DsakvError | RuntimeError, param: str | None) -> APIError:
    """The HTTP error for the engine's refusal of a request: its grammar (compiled by
    `_ready_grammar`: only if evicted since) or its fields a 400 (`param` where the error
    names none); asleep (sleep mode: it takes requests again later) or stopped a 503."""
    if isinstance(e, GrammarError):
        return APIError(400, str(e))
    if isinstance(e, EngineAsleep) or not isinstance(e, DsakvError):
        return APIError(503, str(e), type="server_error")
    return APIError(400, str(e), param=e.param or param)


def _reason(u: Update) -> str | None:
    return u.finish_reason if u.finished else None


def _stream_usage(body: GenerationRequest) -> tuple[bool, bool]:
    """(a usage chunk at the end, usage on every chunk): `stream_options.include_usage`, and
    with it vLLM's `continuous_usage_stats` (each chunk: its choice's tokens so far)."""
    opts = body.stream_options
    usage = bool(opts and opts.include_usage)
    return usage, usage and bool(opts and opts.continuous_usage_stats)


def _chunk_usage(usage: bool, running: bool, u: Update | _Result) -> dict[str, Any]:
    """A streamed chunk's `usage` field: absent without include_usage, else null, or with
    continuous_usage_stats its choice's tokens so far."""
    if not usage:
        return {}
    return {"usage": _usage(u) if running else None}


def _usage(u: Update | _Result) -> dict[str, Any]:
    """OpenAI's usage; `prompt_tokens_details.cached_tokens`: the prompt tokens the prefix
    cache held."""
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def _lp(x: float) -> float:
    x = float(x)
    return x if x > _MIN_LOGPROB else _MIN_LOGPROB  # -inf and NaN too


def _completion_logprobs(u: Update, as_ids: bool = False) -> dict[str, Any]:
    tops = u.top_logprobs or []
    texts = list(u.texts or [""] * len(u.token_ids))
    scores = u.logprobs or []
    alts = _or_blank(u.top_texts, tops)
    if as_ids:
        texts, alts = _id_texts(u.token_ids), [_id_texts(t for t, _ in top) for top in tops]
    return {
        "tokens": texts,
        "token_logprobs": [_lp(x) for x in scores],
        "top_logprobs": [_top_dict(*z) for z in zip(tops, alts, texts, scores)],
    }


def _id_texts(ids: Iterable[int]) -> list[str]:
    """vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:N" (a token
    that is part of a character has no text of its own)."""
    return [f"token_id:{t}" for t in ids]


def _or_blank(texts: list[list[str]] | None, tops: list) -> list[list[str]]:
    """Token texts, or "" for each where the model has no tokenizer."""
    return texts if texts is not None else [[""] * len(top or ()) for top in tops]


def _top_dict(
    top: list[tuple[int, float]], texts: list[str], chosen: str, chosen_logprob: float
) -> dict[str, float]:
    """Completions' {token text: logprob}: the top `logprobs` tokens and the chosen one (the
    sampled token, or the prompt's under echo), so up to logprobs + 1 entries, as OpenAI's
    legacy completions and vLLM give them (`logprobs: 0`: the chosen token alone). Where two
    tokens add the same text (two bytes of one unfinished character both add "") the
    likelier one keeps it, so the max stays the top-1 logprob."""
    out: dict[str, float] = {}
    for (_, x), s in zip(top, texts):
        out.setdefault(s, _lp(x))
    out.setdefault(chosen, _lp(chosen_logprob))  # (ranked below every top one, or among them)
    return out


def _token_ids(u: Update) -> dict[str, list[int] | None]:
    """vLLM's `return_token_ids` on a completions choice: the prompt's ids (in its first
    update) and the ids this update adds."""
    return {"prompt_token_ids": u.prompt_token_ids, "token_ids": u.token_ids}


def _sglext(body: GenerationRequest, ended: Iterable[Update | _Result]) -> dict[str, Any]:
    """SGLang's `sglext` of a /v1 response (or its stream's last chunk before usage): the
    routed experts of the first choice that has them (SGLang's are per request, taken from
    its first output, n > 1 too), where asked for; empty (no field) otherwise."""
    if not body.return_routed_experts:
        return {}
    rows = next((r.routed_experts for r in ended if r.routed_experts is not None), None)
    encoded = routed_base64(rows) if rows is not None else ""
    return {"sglext": {"routed_experts": encoded}} if encoded else {}


def _sglang_extras(
    body: GenerationRequest, ended: dict[int, Update], usage: bool, running: bool, chat: bool
) -> Iterator[dict[str, Any]]:
    """SGLang's stream chunks after the choices' own (before the usage chunk): each ended
    choice's hidden state (only those that have rows: an aborted one has none), then the
    response's `sglext`; under include_usage each has `usage` as every chunk does (null,
    or with continuous_usage_stats a choice's its tokens)."""
    for i, u in sorted(ended.items()) if body.return_hidden_states else ():
        if u.hidden_states is None:
            continue
        state = _last_hidden(u)
        said: dict[str, Any] = {"index": i, "text": "", "hidden_states": state}
        if chat:
            said = {"index": i, "delta": {"hidden_states": state}}
        said.update(logprobs=None, finish_reason=None)
        yield {"choices": [said], **_chunk_usage(usage, running, u)}
    if ext := _sglext(body, [u for _, u in sorted(ended.items())]):
        yield {"choices": [], **ext, **({"usage": None} if usage else {})}


def _last_hidden(r: Update | _Result) -> list[float] | None:
    """SGLang's /v1 `hidden_states` of a choice (`process_hidden_states_from_ret`): of its
    meta_info rows (the prompt's as one, then one per output token but the last) the last
    one, the state that gave its last token; [] where only the prompt's are there."""
    if r.hidden_states is None:
        return None
    return r.hidden_states[-1].tolist() if len(r.hidden_states) > r.prompt_tokens else []


def _prompt_logprobs(u: Update) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (null for the first), {token id: its
    logprob, rank and text} for the token itself and its top alternatives."""
    ids = u.prompt_token_ids or []
    texts = u.prompt_texts or [None] * len(ids)
    tops = u.prompt_top_logprobs or [None] * len(ids)
    alts = u.prompt_top_texts or [[None] * len(top or ()) for top in tops]
    out: list[dict[str, dict[str, Any]] | None] = []
    for p, (token, x) in enumerate(zip(ids, u.prompt_logprobs or [None] * len(ids))):
        if x is None:
            out.append(None)
            continue
        entry = {
            str(token): {"logprob": _lp(x), "rank": u.prompt_ranks[p], "decoded_token": texts[p]}
        }
        for rank, ((t, y), s) in enumerate(zip(tops[p] or (), alts[p]), 1):
            entry.setdefault(str(t), {"logprob": _lp(y), "rank": rank, "decoded_token": s})
        out.append(entry)
    return out


def _chat_logprobs(u: Update, as_ids: bool = False, tracked: bool = False) -> dict[str, Any]:
    """`as_ids`: tokens named "token_id:N" (`_id_texts`); a chosen token's `bytes` stay its
    text's, its top ones' are the name's, as vLLM gives them. `tracked`: vLLM's
    `logprob_token_ids`, whose `top_logprobs` are the chosen token, then the asked ones
    (without it)."""

    def entry(s: str, x: float) -> dict[str, Any]:
        return {"token": s, "logprob": _lp(x), "bytes": list(s.encode("utf-8"))}

    tops = u.top_logprobs or []
    texts = u.texts or [""] * len(u.token_ids)
    alts = _or_blank(u.top_texts, tops)
    names = _id_texts(u.token_ids) if as_ids else texts
    if as_ids:
        alts = [_id_texts(t for t, _ in top) for top in tops]
    content = []
    for t, s, name, x, top, a in zip(u.token_ids, texts, names, u.logprobs or [], tops, alts):
        listed = [entry(b, y) for (i, y), b in zip(top, a) if not (tracked and i == t)]
        content.append(
            {
                **entry(s, x),
                "token": name,
                "top_logprobs": [entry(name, x)] + listed if tracked else listed,
            }
        )
    return {"content": content}


_MAX_PROMPTS = 256  # prompts in one /v1/completions request


def _prompt_list(prompt: Any) -> list[str | list[int]]:
    """A completions `prompt` as a list: a string, token ids, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if len(prompt) > _MAX_PROMPTS:
        raise APIError(400, f"at most {_MAX_PROMPTS} prompts per request", param="prompt")
    return [p if isinstance(p, str) else list(p) for p in prompt]


@dataclass
class _CompletionChoice:
    """One completions choice: with `echo`, its first update also carries the prompt."""

    index: int
    stream: RequestStream
    prompt: str | list[int]
    echo: bool
    keep: int | None = None  # truncate_prompt_tokens, in tokens
    as_ids: bool = False  # return_tokens_as_token_ids (`_id_texts`)
    offset: int = 0  # text_offset of the next token

    def echo_text(self, u: Update, tokenizer: Any) -> str:
        """The prompt that ran: a text prompt as given, unless truncate_prompt_tokens may
        have cut it; then, as token ids are, its kept tokens decoded (what prompt_tokens
        and the logprobs' tokens and offsets describe)."""
        if not self.echo or u.prompt_token_ids is None:
            return ""
        ids = u.prompt_token_ids
        if isinstance(self.prompt, str) and (self.keep is None or len(ids) < self.keep):
            return self.prompt
        return tokenizer.decode(ids) if tokenizer is not None else ""

    def logprobs(self, u: Update) -> dict[str, Any]:
        """This update's `logprobs` block (prompt tokens first when echoing)."""
        prompt: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        shown: list[str] = []  # (the tokens' texts, for text_offset, whatever they are named)
        if self.echo and u.prompt_token_ids is not None:
            scored = u.prompt_logprobs or [None] * len(u.prompt_token_ids)
            tops = u.prompt_top_logprobs or [None] * len(u.prompt_token_ids)
            alts = u.prompt_top_texts or _or_blank(None, tops)
            texts = shown = list(u.prompt_texts or [""] * len(u.prompt_token_ids))
            if self.as_ids:
                texts = _id_texts(u.prompt_token_ids)
                alts = [_id_texts(t for t, _ in top or ()) for top in tops]
            prompt = {
                "tokens": texts,
                "token_logprobs": [None if x is None else _lp(x) for x in scored],
                "top_logprobs": [
                    None if top is None or x is None else _top_dict(top, a, s, x)
                    for top, a, s, x in zip(tops, alts, texts, scored)
                ],
            }
        gen = _completion_logprobs(u, self.as_ids)
        out = {k: prompt[k] + gen[k] for k in ("tokens", "token_logprobs", "top_logprobs")}
        out["text_offset"] = []
        for s in shown + list(u.texts or [""] * len(u.token_ids)):
            out["text_offset"].append(self.offset)
            self.offset += len(s)
        return out


# What beam search does not run (`Handlers._beam`): a 400 where a request sets it.
_NOT_IN_BEAM_SEARCH = (
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "min_tokens",
    "bad_words",
    "allowed_token_ids",
    "thinking_token_budget",
    "repetition_detection",
    "return_routed_experts",  # (SGLang's: each beam's rows are no choice's)
    "return_hidden_states",
)

# vLLM's request fields whose feature dsakv does not run: a 400 unless off.
_NOT_RUN = (
    "prompt_embeds",
    "kv_transfer_params",  # (P/D through a KV connector: dsakv's is `dsakv.disagg`)
)


def request_salt(cache_salt: str | None, extra_key: str | None) -> str | None:
    """A request's prefix-cache salt (`SamplingParams.cache_salt`): vLLM's `cache_salt`,
    refused empty (vLLM's words), then SGLang's `extra_key` appended (its OpenAI routes join
    the two; an empty one is none)."""
    if cache_salt == "":
        raise APIError(
            400,
            "Parameter 'cache_salt' must be a non-empty string if provided.",
            param="cache_salt",
        )
    return (cache_salt or "") + (extra_key or "") or None


# SGLang's request fields, on /generate and the OpenAI routes alike, whose feature dsakv
# does not run: a 400 unless unset (null, false, or empty as its clients send them).
SGLANG_NOT_RUN = (
    "lora_path",
    "custom_logit_processor",
    "session_params",
)


# Request fields that ask for structured output, and the grammar kind each gives.
_GRAMMAR_FIELDS = (
    ("regex", "regex"),
    ("guided_regex", "regex"),
    ("ebnf", "ebnf"),
    ("guided_grammar", "ebnf"),
    ("json_schema", "json_schema"),
    ("guided_json", "json_schema"),
)


def _grammar(body: GenerationRequest) -> tuple[str, str] | None:
    """The (kind, spec) grammar a request asks for, from whichever one field it used."""
    found = _grammar_request(body)
    return found[1] if found else None


def _grammar_field(body: GenerationRequest) -> str | None:
    """The field the request's grammar came from (None: no grammar)."""
    found = _grammar_request(body)
    return found[0] if found else None


def _grammar_request(body: GenerationRequest) -> tuple[str, tuple[str, str]] | None:
    """(field, (kind, spec)) of the one structured output a request asks for."""
    found: list[tuple[str, tuple[str, str]]] = []
    rf = body.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", ("json_object", "")))
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError(
                    400,
                    "response_format json_schema needs json_schema.schema",
                    param="response_format",
                )
            found.append(("response_format", ("json_schema", json.dumps(rf.json_schema.schema_))))
        elif rf.type == "structural_tag":
            tag = rf.model_dump(
                include={"type", "format", "structures", "triggers", "at_least_one"}
            )
            tag = {k: v for k, v in tag.items() if v is not None}
            found.append(("response_format", ("structural_tag", json.dumps(tag))))
        else:
            raise APIError(
                400,
                "response_format type must be text, json_object, json_schema or "
                f"structural_tag, not {rf.type!r}",
                param="response_format",
            )
    for name, kind in _GRAMMAR_FIELDS:
        value = getattr(body, name)
        if value is not None:
            found.append((name, (kind, _spec(value))))
    if body.guided_choice is not None:
        found.append(("guided_choice", _choice_grammar(body.guided_choice, "guided_choice")))
    if (so := body.structured_outputs) is not None:
        name = "structured_outputs"
        asked = [
            *([("json_schema", _spec(so.json_))] if so.json_ is not None else []),
            *([("regex", so.regex)] if so.regex is not None else []),
            *([_choice_grammar(so.choice, name)] if so.choice is not None else []),
            *([("ebnf", so.grammar)] if so.grammar is not None else []),
            *([("json_object", "")] if so.json_object else []),
            *([("structural_tag", so.structural_tag)] if so.structural_tag is not None else []),
        ]
        if len(asked) != 1:
            raise APIError(400, f"{name} takes one constraint, got {len(asked)}", param=name)
        found.append((name, asked[0]))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise APIError(
            400, f"ask for one structured output at a time, not {names}", param=found[1][0]
        )
    return found[0] if found else None


def _spec(value: str | dict[str, Any]) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _choice_grammar(choices: list[str], param: str) -> tuple[str, str]:
    """vLLM's `choice`: the output is exactly one of `choices`."""
    if not choices or not all(choices):
        raise APIError(400, f"{param} must be a list of non-empty strings", param=param)
    # EBNF string literals take JSON's escapes: one alternative per choice, exactly.
    alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    return ("ebnf", f"root ::= {alternatives}")


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
        message = f"internal error: {str(e) or type(e).__name__}"  # (TimeoutError(): "")
        return JSONResponse(error_body(message, "server_error"), status_code=500)


class _CountRequests:
    """Pure ASGI middleware counting responses by endpoint and status (keeps streaming and
    disconnect detection untouched, unlike `BaseHTTPMiddleware`). A response the client
    hung up on before its end counts as 499, a stream's too (its 200 went out first)."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
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
            self.metrics.requests.labels(_endpoint(scope.get("path", "")), str(status)).inc()


def _endpoint(path: str) -> str:
    """A request's `endpoint` label: its route, one label for every model's retrieve."""
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    if path.startswith("/v1/responses/"):
        cancel = path.endswith("/cancel") and path.count("/") == 4
        return "/v1/responses/{response_id}" + ("/cancel" if cancel else "")
    return path if path in _ENDPOINTS else "other"
