"""`dsakv router`: the OpenAI-compatible front door of a prefill/decode deployment.

Each completions, chat, Responses API or Anthropic Messages API request goes to one
prefill server and one decode server (each kind's policy picks them: `policy.py`; by
default the prefill server whose cache likely holds the longest prefix of the prompt, the
decode servers in turn) with the same bootstrap room and one request id (`_name`: the
client's X-Request-Id, else one the router gives it, told back in X-Request-Id); the decode
server's answer (streamed or not) is the client's. A stored response lives on the decode
server that wrote it: the router remembers which (else asks each), for GET, DELETE, cancel,
its input items and `previous_response_id`. The prefill server's own answer (its one
token) is only logged when it fails: any failure reaches the client through the decode
server, which hears it in the handshake. SGLang's and vLLM's admin calls (/abort_request,
/flush_cache, the weight updates, pausing, profiling, LoRA adapters loaded and unloaded) go
to every server; calls every server answers alike (/v1/models, /tokenize) to one; SGLang's
probes of them all (/server_info, /get_load) gather their answers.
OpenAI's Batch API (/v1/files, /v1/batches) is the servers' own (`dsakv.server.batch`, which
SGLang's gateway lacks): the router keeps the files, and sends each of a batch's requests
through its own routes as a client's, as many at once as its decode servers run together.
SGLang's sessions (/open_session, /close_session, /generate's session_params) are a 501
saying where they run. /metrics counts what the router did under SGLang router's names
(`router_metrics`). Light on purpose: no torch, no engine.

Workers join and leave while the router runs, through SGLang Model Gateway's worker API:
`POST /workers` (`{"url", "worker_type": "prefill"|"decode", "bootstrap_port"}`; the
server's `/disagg/info` must agree, and tell the deployment's KV layout), `GET /workers`,
`GET` and `DELETE /workers/{url}`, and its older router's `/add_worker?url=`,
`/remove_worker?url=` and `/list_workers`. A removed server finishes what it was sent (the
admin calls still reach it meanwhile); new requests go to the others. With `--api-key`,
these and every other route but the probes need the key, as `dsakv serve --api-key`'s do.
The router may start with no server, or none of a kind (an orchestrator adds them): until
it has both kinds, requests get SGLang's 503, and the first server added sets the KV layout
the others must have. The router probes each server's /health as SGLang's router does
(`HealthConfig`): one failing is passed over until it passes again, no request needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from dsakv.errors import DsakvError, load_json
from dsakv.server.auth import key_headers, require_api_key
from dsakv.server.batch import add_batch_routes
from dsakv.server.error_handlers import NOT_JSON, add_error_handlers
from dsakv.server.http_config import route_path
from dsakv.server.protocol import (
    ANTHROPIC_PATHS,
    HEADER_SAFE,
    MAX_ID_CHARS,
    RESPONSES_KEPT,
    APIError,
    anthropic_error_body,
    client_left,
    error_body,
    error_for,
    invocation_path,
    new_id,
)
from dsakv.server.tracing import TraceConfig

from .config import HOST_HEADER, MODES, PORT_HEADER, ROOM_HEADER
from .handoff import GENERATE_PATHS
from .policy import CacheAware, Policy, PolicyConfig, make_policy, routing_text
from .router_metrics import RouterMetrics, State, Worker
from .router_tracing import RouteSpan, RouteTracer, current

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealthConfig:
    """SGLang router's active health checks, under its flags' defaults: each server's
    `endpoint` asked every `interval_s` seconds (`timeout_s` to answer with a 2xx), so that
    a dead server is found, and a recovered one taken back, with no request sent to it
    (else only contacts tell: `Router._healthy`). Unhealthy after `failure_threshold` failed
    probes in a row, healthy again after `success_threshold` passed; `enabled` False:
    SGLang's --disable-health-check, no probes."""

    interval_s: float = 60.0
    timeout_s: float = 5.0
    failure_threshold: int = 3
    success_threshold: int = 2
    endpoint: str = "/health"
    enabled: bool = True

    def __post_init__(self) -> None:
        for name in ("interval_s", "timeout_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise DsakvError(f"health check {name} must be > 0, got {getattr(self, name)}")
        for name in ("failure_threshold", "success_threshold"):
            if getattr(self, name) < 1:
                raise DsakvError(f"health {name} must be >= 1, got {getattr(self, name)}")
        if not self.endpoint.startswith("/"):
            raise DsakvError(f"the health check endpoint must be a path, got {self.endpoint!r}")


def _error(
    status: int,
    message: str,
    type: str = "server_error",
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status)


def _client_error(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    """The client's error (a 4xx), in the servers' shape; `code`: SGLang's, where it has one."""
    return _error(status, message, "invalid_request_error", param, code)


def _not_found(rid: str, param: str) -> JSONResponse:
    """The servers' answer for a response id they do not hold."""
    return _client_error(404, f"Response with id '{rid}' not found.", param)


def _no_such_worker(url: str) -> JSONResponse:
    """SGLang's answer for a worker the router does not have."""
    return _client_error(404, f"worker {url} not found", "url", "WORKER_NOT_FOUND")


def _taken(rid: str) -> JSONResponse:
    """The servers' answer for a request_id a response has (or a request runs under)."""
    return _client_error(400, f"a response with id '{rid}' exists already", "request_id")


def _sse_error(message: str, path: str) -> bytes:
    """A stream's failure as the route's clients read one: Anthropic's `error` event on its
    routes (its SDK skips an event with no name: the stream ended as if whole), else
    OpenAI's error chunk and [DONE]."""
    if path in ANTHROPIC_PATHS:
        return f"event: error\ndata: {json.dumps(anthropic_error_body(502, message))}\n\n".encode()
    body = error_body(message, "server_error")
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


class Router:
    """Pairs of prefill and decode servers, as each kind's policy picks them (`policy`,
    SGLang's: by default `DEFAULT_POLICIES`); one shared HTTP client. `health`: how the
    servers are probed while the router serves (`start`; None: SGLang's defaults), with
    `api_key` if given. `tracing`: where each routed request's span goes (`router_tracing`;
    None: no spans)."""

    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        policy: PolicyConfig | None = None,
        health: HealthConfig | None = None,
        tracing: TraceConfig | None = None,
        api_key: str | None = None,
    ) -> None:
        # Replaced, never changed in place, as workers come and go: a loop over a list
        # (across awaits) sees the servers of when it began.
        self.prefill = [_server_url(u) for u in prefill]
        self.decode = [_server_url(u) for u in decode]
        _check_distinct([("--prefill", u) for u in prefill] + [("--decode", u) for u in decode])
        policy = policy or PolicyConfig()
        self._policies: dict[str, Policy] = {
            kind: make_policy(policy.policy_of(kind), policy) for kind in MODES
        }
        # whether a request's text is read (`routing_text`): by cache_aware, of either kind
        self._needs_text = any(p.needs_text for p in self._policies.values())
        self._bootstrap: dict[str, tuple[str, int]] = {}
        # server -> when its last contact failed (none since succeeded): unhealthy
        # (`_healthy`), and tried after the others for `_DOWN_S` seconds (`_in_turn`); inf:
        # the health checks found it down, tried after the others until they find it up
        self._down: dict[str, float] = {}
        self.health_config = health or HealthConfig()
        # The router's key on each probe (`_probe_health`): no client's request to relay
        # one from, and a --health-check-endpoint such as /v1/models needs it. SGLang's
        # router gives its key to the workers it starts with; every server here has it.
        self._probe_headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # server -> its health probes' last result and how many in a row had it (`_probed`)
        self._streaks: dict[str, tuple[bool, int]] = {}
        self._client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task] = set()
        # The decode server holding each stored response, by id, the least recently used
        # forgotten first; as many as the decode servers keep (each its own RESPONSES_KEPT).
        # One forgotten (or from before a restart) is asked of each decode server.
        self._responses: OrderedDict[str, str] = OrderedDict()
        self._pending: set[str] = set()  # the clients' request_ids sent, not yet answered
        # Requests in flight through the router, by (kind, server): a server removed while
        # it has some stays in the admin calls' reach (an abort, a pause) until they end.
        self._busy: Counter[tuple[str, str]] = Counter()
        # Held from an added server's layout check to its registration: a second add is
        # checked against the first (else two racing while no registered server tells its
        # layout, none or one restarting, both pass: each checked against nothing).
        self._adding = asyncio.Lock()
        # The KV layout (`_layout`) of each server, as its /disagg/info last told it: the
        # check under the lock asks no server (one that never answers would hold every add
        # queued behind it for its timeout, one after another).
        self._layouts: dict[str, dict[str, Any]] = {}
        self.failures = 0  # requests the servers failed (5xx, unreachable)
        self.metrics = RouterMetrics(self.state)
        self.tracer = None
        if tracing is not None:
            names = {kind: p.name for kind, p in self._policies.items()}
            self.tracer = RouteTracer(tracing, names)

    @property
    def responses_kept(self) -> int:
        return RESPONSES_KEPT * len(self.decode)

    def _ranked(self, kind: str, text: str) -> list[str]:
        """The `kind` servers in the order a request tries them: its policy's pick (of
        those up, if any are) first, the others after it in turn, those that failed in the
        last `_DOWN_S` seconds last (`_in_turn`). `text`: the request's (`routing_text`),
        for a policy that reads it. A server's load: its requests in flight (`_busy`)."""
        urls = getattr(self, kind)
        if not urls:
            return []
        now = time.monotonic()
        up = [u for u in urls if not _resting(self._down, u, now)]
        pick = self._policies[kind].pick(up or urls, lambda u: self._busy[kind, u], text)
        self.metrics.decisions[kind, pick] += 1
        return _in_turn(urls, urls.index(pick), self._down, now)

    def _healthy(self, url: str) -> bool:
        """Whether `url` is healthy, as /metrics, /workers and /health tell it: its last
        contact did not fail (a connection, its bootstrap port asked, a /health probe; none
        yet: healthy) and the health checks did not find it down (`_probed`). Not the
        routing's `_DOWN_S` window, after which it is tried again: a dead server stays
        unhealthy until a contact succeeds, or enough health checks in a row."""
        return url not in self._down

    def _checks_found_down(self, url: str) -> bool:
        """Whether the health checks found `url` down (`_unreachable(probed=True)`), not
        only a contact: unhealthy until they find it up."""
        return self._down.get(url) == math.inf

    def _unreachable(self, url: str, probed: bool = False) -> None:
        """A contact with `url` failed (`_healthy`), or the health checks found it down
        (`probed`: tried after the others until they find it up, not only for `_DOWN_S`
        seconds). A prefill server's bootstrap port is asked again, so that its next pick
        contacts it (a port remembered is no contact); passed health checks count again
        from here, towards its recovery."""
        now = math.inf if probed else time.monotonic()
        self._down[url] = max(now, self._down.get(url, -math.inf))
        self._bootstrap.pop(url, None)
        if self._streaks.get(url, (False, 0))[0]:
            del self._streaks[url]

    def _sent(self, kind: str, url: str, text: str) -> None:
        """A request went to the `kind` server `url` (its pick's, or one after it): its
        policy hears it (`Policy.sent`), the metrics count it."""
        self._policies[kind].sent(url, text)
        self.metrics.sent[kind, url] += 1

    def state(self) -> State:
        """What a /metrics scrape reads of the router's bookkeeping (`RouterMetrics`)."""
        workers = [Worker(k, u, self._healthy(u)) for k in MODES for u in getattr(self, k)]
        trees = {k: p for k, p in self._policies.items() if isinstance(p, CacheAware)}
        return State(
            workers=workers,
            policies={k: p.name for k, p in self._policies.items()},
            running=dict(self._busy),
            trees={w.url: trees[w.kind].tree.size(w.url) for w in workers if w.kind in trees},
            hits=sum(p.hits for p in trees.values()),
            misses=sum(p.misses for p in trees.values()),
            rebalanced=sum(p.rebalanced for p in trees.values()),
            failures=self.failures,
        )

    def _admin_targets(self, kind: str) -> list[str]:
        """The `kind` servers an admin call goes to: the router's, and those removed that
        still have requests in flight through it (an abort must find those requests)."""
        now = getattr(self, kind)
        return now + [url for was, url in self._busy if was == kind and url not in now]

    async def _open(self, url: str, send: httpx.Request) -> httpx.Response:
        """`send` to the decode server `url`, its answer streamed: a request in flight there
        (`_busy`) from now until the caller's `_finished("decode", url)`, once the answer is
        read (or `_drop`)."""
        self._busy["decode", url] += 1
        try:
            return await self.client.send(send, stream=True)
        except BaseException:  # (cancelled too: the client left)
            self._finished("decode", url)
            raise

    async def _drop(self, sent: tuple[str, httpx.Response]) -> None:
        """A decode server's answer (`_open`) nobody will read, its request cancelled as it
        came (`_unless_left`): closed, and no longer in flight there."""
        url, resp = sent
        self._finished("decode", url)
        await resp.aclose()

    def _finished(self, kind: str, url: str) -> None:
        """A request to `url` ended: a removed server's last leaves the admin calls' reach."""
        self._busy[kind, url] -= 1
        if self._busy[kind, url] <= 0:
            del self._busy[kind, url]

    def _missing(self, *kinds: str) -> Response | None:
        """The 503 for a request needing a kind of server the router has none of (all
        removed), as SGLang's gateway answers it."""
        gone = [kind for kind in kinds if not getattr(self, kind)]
        return _none_of(gone) if gone else None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:  # created on the serving loop
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(None, connect=10.0),
                # Idle connections are dropped before the servers drop them (uvicorn: after
                # 5 s): a request sent on one the server is closing fails with no answer.
                limits=httpx.Limits(
                    max_connections=None, max_keepalive_connections=64, keepalive_expiry=2.0
                ),
            )
        return self._client

    async def bootstrap_of(self, prefill_url: str) -> tuple[str, int]:
        """(host, port) of a prefill server's bootstrap, asked once from `/disagg/info`."""
        if prefill_url not in self._bootstrap:
            info = await self._disagg_info(prefill_url)
            if info.get("mode") != "prefill":
                raise ValueError(f"{prefill_url} is not a prefill server (mode {info.get('mode')})")
            self._bootstrap[prefill_url] = _bootstrap_address(prefill_url, info)
        return self._bootstrap[prefill_url]

    async def _disagg_info(self, url: str) -> dict[str, Any]:
        """A server's `/disagg/info` (its mode, a prefill server's bootstrap port); a
        registered server's KV layout is remembered (a prefill server restarted is asked
        again once it fails a request: its new layout replaces the old)."""
        r = await self.client.get(f"{url}/disagg/info", timeout=_INFO_TIMEOUT_S)
        r.raise_for_status()
        info = r.json()  # (not JSON: a ValueError)
        if not isinstance(info, dict):  # (no prefill or decode server's: as if not JSON)
            raise ValueError(f"GET /disagg/info answered {r.text[:200]!r}, not a JSON object")
        if url in self.prefill + self.decode:
            self._layouts[url] = _layout(info)
        return info

    async def generate(self, path: str, request: Request) -> Response:
        """A request to a prefill and a decode server (`_pair`)."""
        return await self._traced(path, request, self._generate(path, request))

    async def _traced(self, path: str, request: Request, answer: Awaitable[Response]) -> Response:
        """`answer`, counted and timed by its route (`path`: `RouterMetrics.started`), in a
        span of its own if the router traces (`RouteTracer.start`; `current` while `answer`
        runs), each ended once the answer is whole (`_whole`); its id (`_name`) the
        X-Request-Id header of the answer."""
        ends = [self.metrics.started(path)]
        if self.tracer is None:
            return await _whole(_told_id(request, answer), ends)
        span = self.tracer.start(path, request)
        token = current.set(span)
        try:
            return await _whole(_told_id(request, answer), [*ends, span.end])
        finally:
            current.reset(token)

    async def _generate(self, path: str, request: Request) -> Response:
        got = await _json_body(request)
        if isinstance(got, Response):
            return got
        raw, body = got
        rid = _name(request, body.get("rid" if path == "/generate" else "request_id"))
        if path == "/generate" and body.get("rid") is None and rid is not None:
            body["rid"] = rid  # (SGLang's servers name a /generate request by its rid alone)
            raw = json.dumps(body).encode()
        self.metrics.streamed[path] += body.get("stream") is True
        if (span := current.get()) is not None:
            span.set("stream", body.get("stream") is True)
        if _in_session(body):
            return _error(501, _NO_SESSIONS, param="session_params", code="not_implemented")
        # The prefill server answers with its one token; only the decode server streams.
        p_body = {**body, "stream": False}
        p_body.pop("stream_options", None)
        return await self._pair(path, request, raw, p_body, _num_prompts(body))

    async def responses(self, request: Request) -> Response:
        return await self._traced("/v1/responses", request, self._new_response(request))

    async def _new_response(self, request: Request) -> Response:
        """POST /v1/responses, relayed as chat is, with an id the router gives it (unless
        the client did: `request_id`, a 400 while a response has it, or a request under it
        is not yet answered, as the servers') so it knows where the response is stored. A
        continuation (`previous_response_id`) goes to the decode server holding the
        previous response; the prefill server, which holds no stored response (its copy is
        not stored: `store` false), gets the whole conversation as its input instead, as the
        decode server tells it (`_conversation`). The decode server renders the same turns
        from its store, and the prefill server checks the prompts are the same tokens (a
        502 if not)."""
        if (missing := self._missing("prefill", "decode")) is not None:
            self.metrics.errors["/v1/responses", "no_available_workers"] += 1
            return missing  # (else a continuation's previous response is "not found")
        got = await _json_body(request)
        if isinstance(got, Response):
            return got
        raw, body = got
        self.metrics.streamed["/v1/responses"] += body.get("stream") is True
        if (span := current.get()) is not None:
            span.set("stream", body.get("stream") is True)
        rid = body.get("request_id")
        given = rid is not None
        if not given:
            rid = body["request_id"] = new_id("resp_")
            raw = json.dumps(body).encode()
        _name(request, rid)  # (the response's id, unless the client's X-Request-Id names it)
        if given and isinstance(rid, str) and _askable(rid):
            # (another decode server than the one it goes to may hold it, or run it)
            if rid in self._responses or rid in self._pending:
                return _taken(rid)
            self._pending.add(rid)
            try:
                if await self._held(rid, key_headers(request.headers)):
                    return _taken(rid)
                return await self._respond(request, raw, body, rid)
            finally:
                self._pending.discard(rid)
        return await self._respond(request, raw, body, rid)

    async def _respond(
        self, request: Request, raw: bytes, body: dict[str, Any], rid: Any
    ) -> Response:
        """The request (`raw`, `body`) to a prefill and a decode server: `responses`."""
        p_body = {**body, "stream": False, "store": False, "background": False}
        p_body.pop("stream_options", None)
        decode = None
        previous = body.get("previous_response_id")
        if previous is not None:
            found = await self._conversation(previous, body.get("input"), request)
            if isinstance(found, Response):
                return found
            decode, p_body["input"] = found
            del p_body["previous_response_id"]
        stored = body.get("store") is not False and isinstance(rid, str)
        return await self._pair(
            "/v1/responses", request, raw, p_body, 1, decode, rid if stored else None
        )

    async def _conversation(
        self, previous: Any, own: Any, request: Request
    ) -> tuple[str | None, Any] | Response:
        """The decode server holding response `previous`, and the conversation up to it
        followed by `own` input, as input items: what the decode server makes of the
        request from its store. It tells it: the items `previous` was made from (its
        input_items: the earlier responses' input and output, then its own input; their
        instructions left out, as there) and its output, so the router needs to have
        seen none of them (it may have restarted since)."""
        askable = isinstance(previous, str) and _askable(previous)
        if not askable or not isinstance(own, (str, list)):
            return None, own  # (the decode server refuses it, naming the field)
        headers = key_headers(request.headers)
        found = await self._holder(previous, headers)
        if isinstance(found, Response):
            return found
        decode, response = found
        url = _stored_url(decode, previous, "/input_items")
        items: list[Any] = []
        params: dict[str, Any] = {"order": "asc", "limit": 100}
        cursors: set[Any] = set()
        for _ in range(_ITEM_PAGES):
            try:
                call = self.client.get(url, params=params, headers=headers)
                answer = await _unless_left(call, request)
            except httpx.HTTPError as e:
                self._count_failure("/v1/responses", "decode_unreachable")
                self.metrics.failed["decode", decode] += 1
                return _error(502, f"decode server {decode} is unreachable: {e!r}")
            if answer is None:
                return Response(status_code=499)
            if answer.status_code != 200:  # (deleted meanwhile: its 404)
                return _answer(answer)
            page = answer.json()
            items += page["data"]
            if not page["has_more"]:
                return decode, items + response["output"] + _items(own)
            if not page["data"] or page["last_id"] in cursors:
                break  # (a page that goes nowhere: the next would be the same)
            cursors.add(page["last_id"])
            params["after"] = page["last_id"]
        self._count_failure("/v1/responses", "decode_failed")
        self.metrics.failed["decode", decode] += 1
        return _error(502, f"decode server {decode} lists the input items of {previous} endlessly")

    async def _holder(
        self, rid: str, headers: dict[str, str]
    ) -> tuple[str, dict[str, Any]] | Response:
        """The decode server holding response `rid` (the one remembered, else the first of
        them that has it), and the response; else a server's error (other than its 404),
        the servers' 404, or a 502."""
        known = self._responses.get(rid)
        errors, refused = [], None
        for url in [known] if known is not None else self.decode:
            try:
                answer = await self.client.get(_stored_url(url, rid), headers=headers)
            except httpx.HTTPError as e:
                errors.append(f"{url}: {e!r}")
                self.metrics.failed["decode", url] += 1
                continue
            if answer.status_code == 200:
                self._keep(rid, url)
                return url, answer.json()
            if answer.status_code != 404:  # (e.g. a bad key: another may hold it all the same)
                refused = refused or answer
        if refused is not None:
            return _answer(refused)
        self._responses.pop(rid, None)
        if errors:
            self._count_failure("/v1/responses", "decode_unreachable")
            return _error(502, f"no decode server holding {rid} answered: {'; '.join(errors)}")
        return _not_found(rid, "previous_response_id")

    async def _held(self, rid: str, headers: dict[str, str]) -> bool:
        """Whether a decode server holds response `rid` (then remembered): a request_id the
        router does not know (it restarted, or another router took it)."""
        for url in self.decode:
            try:
                answer = await self.client.get(_stored_url(url, rid), headers=headers)
            except httpx.HTTPError:
                continue  # (down: the request goes to another)
            if answer.status_code == 200:
                self._keep(rid, url)
                return True
        return False

    async def stored(self, request: Request, rid: str) -> Response:
        """GET or DELETE /v1/responses/{id}, GET .../input_items, POST .../cancel: at the
        decode server holding the response. One the router does not know (it restarted, or
        forgot it) is asked of each decode server until one answers it (2xx); none does: the
        first error other than a 404 (e.g. a bad limit), else their 404. A stream (a
        background response's events) is passed on as it comes; with no decode server, the
        503 naming it (as for a new response). Counted and timed by its route's template
        (`/v1/responses/{response_id}`...: an id or a query is no label value), as its
        stream's loss is."""
        route = request.scope["route"].path
        return await _whole(self._stored(request, rid, route), [self.metrics.started(route)])

    async def _stored(self, request: Request, rid: str, route: str) -> Response:
        if (missing := self._missing("decode")) is not None:
            return missing
        known = self._responses.get(rid)
        if known is not None:
            self._responses.move_to_end(rid)
        got = await _as_sent(request)
        if isinstance(got, Response):
            return got
        raw, headers, path = got
        answers: list[tuple[httpx.Response, bytes]] = []
        errors = []
        for url in [known] if known is not None else self.decode:
            send = self.client.build_request(
                request.method, f"{url}{path}", content=raw, headers=headers
            )
            try:
                r = await _unless_left(
                    self._open(url, send), request, lambda r, url=url: self._drop((url, r))
                )
                if r is None:
                    return Response(status_code=499)
                if r.is_success and "text/event-stream" in r.headers.get("content-type", ""):
                    self._keep(rid, url)
                    return StreamingResponse(
                        self._relay(r, url, route),
                        media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache"},
                    )
                try:
                    content = await _unless_left(r.aread(), request)
                finally:
                    self._finished("decode", url)
                    await r.aclose()
            except httpx.HTTPError as e:
                errors.append(f"{url}: {e!r}")
                continue
            if content is None:
                return Response(status_code=499)
            answers.append((r, content))
            if r.is_success:
                self._keep(rid, url)
                break
        answers.sort(key=lambda a: (not a[0].is_success, a[0].status_code == 404))
        if not answers or (answers[0][0].status_code == 404 and errors):
            self.failures += 1
            return _error(502, f"no decode server holding {rid} answered: {'; '.join(errors)}")
        answer, content = answers[0]
        if answer.status_code == 404 or (request.method == "DELETE" and answer.is_success):
            self._responses.pop(rid, None)
        kind = answer.headers.get("content-type")
        return Response(content, answer.status_code, media_type=kind)

    def _keep(self, rid: str, decode: str) -> None:
        if decode not in self.decode:
            return  # (removed while it answered: forgotten with the others it holds)
        self._responses[rid] = decode
        self._responses.move_to_end(rid)
        self._trim_responses()

    def _trim_responses(self) -> None:
        """The least recently used stored responses forgotten, past `responses_kept`."""
        while len(self._responses) > self.responses_kept:
            self._responses.popitem(last=False)

    async def _pair(
        self,
        path: str,
        request: Request,
        raw: bytes,
        p_body: dict[str, Any],
        prompts: int,
        decode: str | None = None,
        rid: str | None = None,
    ) -> Response:
        """`raw` to a decode server (`decode`, else the policy's), `p_body` to the prefill
        server the policy picks; `rid`: the response the decode server stores if it takes it.
        The request's span (`router_tracing.current`, if traced) hears what happens."""
        if (missing := self._missing("prefill", "decode")) is not None:
            self.metrics.errors[path, "no_available_workers"] += 1
            return missing  # (removed while the request came in)
        # (the prefill server's body: a continuation's whole conversation)
        text = routing_text(p_body) if self._needs_text else ""
        try:
            p_url, host, port = await self._pick_prefill(text, path)
        except _Unusable as e:
            self._count_failure(path, "prefill_unreachable")
            return _error(502, f"no prefill server is usable: {e}")
        rooms = [secrets.randbits(62) for _ in range(prompts)]
        headers = {ROOM_HEADER: ",".join(map(str, rooms)), HOST_HEADER: host}
        headers[PORT_HEADER] = str(port)
        headers.update(key_headers(request.headers))
        headers.update(_id_header(request))  # (both servers' name for it: /abort_request's)
        if (span := current.get()) is None:
            headers.update(_trace_context(request))  # (both servers' spans join the client's trace)
        else:
            span.set("bootstrap_room", rooms)
            headers.update(span.context())  # (both servers' spans are the router's span's children)
        prefill = self._spawn(self._prefill(p_url, path, p_body, headers))
        prefill.add_done_callback(lambda _: self._finished("prefill", p_url))  # (its pick's)
        d_headers = {**headers, "content-type": "application/json"}
        try:  # (a non-streamed answer's headers come when it is complete)
            sending = self._send_decode(path, raw, d_headers, decode, text)
            sent = await _unless_left(sending, request, self._drop)
        except _Unreachable as e:
            self._failed(p_url, prefill, path, "decode_unreachable")
            return _error(502, f"decode server {e.url} is unreachable: {e.error!r}")
        except _NoWorker:
            prefill.cancel()
            self.metrics.errors[path, "no_available_workers"] += 1
            return _none_of(["decode"])
        except httpx.HTTPError as e:
            self._failed(p_url, prefill, path, "decode_failed")
            return _error(502, f"the decode server failed: {e!r}")
        except asyncio.CancelledError:  # (a batch's line cancelled: a client gone, as below)
            prefill.cancel()
            raise
        if sent is None:
            prefill.cancel()
            return Response(status_code=499)  # the client left: nobody to answer
        d_url, resp = sent
        if rid is not None and resp.status_code == 200:
            self._keep(rid, d_url)
        kind = resp.headers.get("content-type", "")
        if resp.status_code != 200 or "text/event-stream" not in kind:
            try:
                content = await _unless_left(resp.aread(), request)
            except httpx.HTTPError as e:
                self._failed(p_url, prefill, path, "decode_failed", d_url)
                return _error(502, f"lost the decode server {d_url}: {e!r}")
            finally:
                self._finished("decode", d_url)
                await resp.aclose()
            if content is None:
                prefill.cancel()
                return Response(status_code=499)
            if resp.status_code >= 500:
                self._failed(p_url, prefill, path, "server_error", d_url)
            elif resp.status_code != 200:  # the client's error: the prefill server's copy
                prefill.cancel()  # would wait for a decode server that refused it
            return Response(content, resp.status_code, media_type=kind or None)
        return StreamingResponse(
            self._relay(resp, d_url, path, span),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def broadcast(self, path: str, request: Request) -> Response:
        """An admin call every server must hear (`BROADCAST`), its body relayed to every
        decode server, then to every prefill server. For SGLang's /abort_request the rid is
        the client's on both, as the router passes each request on (a prefill server's
        copy waiting for its decode server ends too); decode servers first: a request the
        prefill server's abort reached first would end with the handshake's error instead.
        The first decode server's answer when all answered 200; else a server's 4xx (the
        client's error, e.g. a bad key or body), or a 502 naming the servers that failed."""
        answers = await self._everyone(path, request)
        if isinstance(answers, Response):
            return answers
        first = answers[0]
        return Response(first.content, 200, media_type=first.headers.get("content-type"))

    async def every_server(self, path: str, request: Request) -> Response:
        """vLLM's GET /is_paused and /is_sleeping, true only while every server is: a trainer
        reading true swaps the weights (or uses the memory), which is safe only once no
        server generates (a pause or a sleep that failed somewhere is undone, so a mixed
        state is a server restarted or resumed alone; asking again, as false bids, mends
        it)."""
        answers = await self._everyone(path, request)
        if isinstance(answers, Response):
            return answers
        key = path.lstrip("/")
        return JSONResponse({key: all(r.json()[key] is True for r in answers)})

    async def load(self, request: Request) -> Response:
        """vLLM's GET /load: the decode servers' requests in flight together (each request
        through the router is in flight on one decode server from start to end, and only
        part of that time on its prefill server too)."""
        answers = await self._everyone("/load", request, (self.decode,))
        if isinstance(answers, Response):
            return answers
        return JSONResponse({"server_load": sum(int(r.json()["server_load"]) for r in answers)})

    async def capacity(self) -> int:
        """How many requests the decode servers run at once together (their /server_info's
        `max_running_requests`; one that does not answer counts none), at least 1: as many
        of a batch's requests as the router keeps in flight (each is on one decode server
        from start to end), as a server keeps its own engine's (`dsakv.server.batch`)."""

        async def of(url: str) -> int:
            try:
                r = await self.client.get(f"{url}/server_info", timeout=_INFO_TIMEOUT_S)
                return int(r.raise_for_status().json()["max_running_requests"])
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                return 0

        return max(1, sum(await asyncio.gather(*(of(u) for u in self.decode))))

    async def server_info(self, request: Request) -> Response:
        """SGLang's /server_info (/get_server_info), as its PD load balancer answers it:
        each server's own, under `prefill` and `decode`, and at the top the decode servers'
        `internal_states` together (they generate: `bench_serving` reads its throughput and
        MTP's accept length there, as of one server)."""
        asked = (self.decode, self.prefill)  # (as they are now: workers may come meanwhile)
        answers = await self._everyone("/server_info", request, asked)
        if isinstance(answers, Response):
            return answers
        infos = [r.json() for r in answers]
        decode, prefill = infos[: len(asked[0])], infos[len(asked[0]) :]
        states = [s for info in decode for s in info.get("internal_states") or []]
        return JSONResponse({"internal_states": states, "prefill": prefill, "decode": decode})

    async def get_load(self, request: Request) -> Response:
        """SGLang's GET /get_load: each server's entries (one per DP rank, in its shape),
        each naming its server and role (`worker`, `worker_type`: sglang-router's names for
        them), the decode servers' first, as one flat list over every server: a client
        that sums one server's entries sums the deployment's."""
        asked = (self.decode, self.prefill)  # (as they are now: workers may come meanwhile)
        roles = [("decode", u) for u in asked[0]] + [("prefill", u) for u in asked[1]]
        answers = await self._everyone("/get_load", request, asked)
        if isinstance(answers, Response):
            return answers
        return JSONResponse(
            [
                {"worker": url, "worker_type": role, **entry}
                for (role, url), r in zip(roles, answers)
                for entry in r.json()
            ]
        )

    async def _everyone(
        self, path: str, request: Request, groups: tuple[list[str], ...] | None = None
    ) -> list[httpx.Response] | Response:
        """`request` (its method, query, body and key) at `path` to every server (decode
        first, then prefill, those still leaving included: `_admin_targets`), or to `groups`
        in turn: their answers, when each is a 2xx; else a server's 4xx, or a 502 naming
        those that failed. A pause that failed somewhere pauses nothing, nor a LoRA load
        loads anything (`_undo`); with no server to ask, the 503."""
        groups = groups or (self._admin_targets("decode"), self._admin_targets("prefill"))
        if not any(groups):
            return _none_of([])
        try:
            raw = await request.body()
        except ClientDisconnect:
            return Response(status_code=499)
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        headers.update(key_headers(request.headers))
        query = request.url.query
        replaced = _replaced(raw) if _UNDO.get(path, (None, False))[1] else None  # (a load's)
        before = None  # (a LoRA load in place: the adapter each server had, for `_undo`)
        if replaced is not None:
            before = await self._adapter_paths(replaced, [u for g in groups for u in g], headers)
        answers = []
        for urls in groups:
            calls = (self._call(u, path, request.method, raw, headers, query) for u in urls)
            answers += await asyncio.gather(*calls)
        failed = [(u, r) for u, r in answers if not isinstance(r, httpx.Response) or r.is_error]
        if not failed:
            return [r for _, r in answers]
        took = [u for u, r in answers if (u, r) not in failed]
        await self._undo(path, raw, headers, took, before)
        for _, r in failed:
            if isinstance(r, httpx.Response) and r.status_code < 500:  # the client's
                return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        self.failures += 1
        named = "; ".join(f"{u}: {_said(r)}" for u, r in failed)
        return _error(502, f"{path} failed on {len(failed)} of {len(answers)}: {named}")

    async def _undo(
        self,
        path: str,
        raw: bytes,
        headers: dict[str, str],
        took: list[str],
        before: dict[str, str | None] | None,
    ) -> None:
        """Broadcast call `path` (its body `raw`) undone on the servers that `took` it,
        another having failed it (`_UNDO`). A LoRA load in place (`before`: each server's
        path of the adapter it replaced, `_adapter_paths`) is undone by loading that path
        back in place, an unload only where the adapter was new (else the server would serve
        no adapter of that name where it served the old one); a server whose adapters were
        not told is left as it is."""
        undo, same_body = _UNDO.get(path, (None, False))
        if undo is None:
            return
        calls = []
        for url in took:
            if before is None:  # (a pause's undo; a load's: its name's unload)
                calls.append(self._call(url, undo, "POST", raw if same_body else b"{}", headers))
            elif url in before and (old := before[url]) is None:
                calls.append(self._call(url, undo, "POST", raw, headers))
            elif url in before:
                back = json.dumps({**json.loads(raw), "lora_path": old}).encode()
                calls.append(self._call(url, path, "POST", back, headers))
        for url, r in await asyncio.gather(*calls):
            if not isinstance(r, httpx.Response) or r.is_error:
                log.warning("router: undoing %s on %s failed: %s", path, url, _said(r))

    async def _adapter_paths(
        self, name: str, urls: list[str], headers: dict[str, str]
    ) -> dict[str, str | None]:
        """Each server's path of LoRA adapter `name` (its `/v1/models` card's `root`, as
        vLLM's), None where it serves none of that name; one that does not tell is left
        out."""

        async def path_of(url: str) -> tuple[str, str | None] | None:
            _, r = await self._call(url, "/v1/models", "GET", b"", headers)
            if not isinstance(r, httpx.Response) or not r.is_success:
                return None
            try:
                cards = [c for c in r.json()["data"] if c["id"] == name and "parent" in c]
                return url, str(cards[0]["root"]) if cards else None
            except (ValueError, KeyError, TypeError, IndexError):
                return None

        told = await asyncio.gather(*(path_of(u) for u in urls))
        return dict(t for t in told if t is not None)

    async def _call(
        self,
        url: str,
        path: str,
        method: str,
        raw: bytes,
        headers: dict[str, str],
        query: str = "",
    ) -> tuple[str, httpx.Response | httpx.HTTPError]:
        target = f"{url}{path}" + (f"?{query}" if query else "")
        try:
            return url, await self.client.request(
                method, target, content=raw, headers=headers, timeout=BROADCAST.get(path, 30.0)
            )
        except httpx.HTTPError as e:
            return url, e

    async def one(self, request: Request) -> Response:
        """`request` as it is (method, path, query, body, key) to the first decode server
        that answers it without a 5xx (one loading or restarting: the next): a call every
        server answers alike, as they serve one model (/v1/models, /tokenize, ...: `_ONE`)."""
        if (missing := self._missing("decode")) is not None:
            return missing
        got = await _as_sent(request)
        if isinstance(got, Response):
            return got
        raw, headers, path = got
        errors = []
        for url in self.decode:
            try:
                r = await self.client.request(
                    request.method, f"{url}{path}", content=raw, headers=headers
                )
            except httpx.HTTPError as e:
                errors.append(f"{url}: {e!r}")
                continue
            if r.status_code >= 500:
                errors.append(f"{url}: {r.status_code}")
                continue
            return _answer(r)
        return _error(502, f"no decode server is reachable: {'; '.join(errors)}")

    async def invocations(self, request: Request) -> Response:
        """vLLM's (SageMaker's) POST /invocations: relayed as the route its body's shape
        picks (`invocation_path`, as the servers pick it)."""
        got = await _json_body(request)
        if isinstance(got, Response):
            return got
        try:
            path = invocation_path(got[1])
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return await self.generate(path, request)

    async def _pick_prefill(self, text: str, path: str) -> tuple[str, str, int]:
        """The first prefill server (`_ranked`) that tells its bootstrap port, with that
        port: one that cannot (down, restarting) is passed over, not handed every Nth
        request, and asked last for a while (a host that drops packets costs a connect
        timeout each time). The request is in flight there (`_busy`) from its pick, as
        SGLang counts a worker's load, until the caller's `_finished`: the requests of a
        burst, picked before any is sent, each see those picked before it. The policy hears
        which server it goes to (`_sent`): its pick's may have been passed over (a retry
        of request `path`)."""
        errors, span = [], current.get()
        for url in self._ranked("prefill", text):
            if errors:
                self.metrics.retries["prefill", path] += 1
            if span is not None:
                span.tried("prefill", url)
            self._busy["prefill", url] += 1
            try:
                host, port = await self.bootstrap_of(url)
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                self._finished("prefill", url)
                if span is not None:
                    span.failed("prefill", url, e)
                errors.append(f"{url}: {e!r}")
                self._unreachable(url)
                self.metrics.failed["prefill", url] += 1
                continue
            except BaseException:  # (not going there: cancelled too)
                self._finished("prefill", url)
                raise
            self._down.pop(url, None)
            self._sent("prefill", url, text)
            return url, host, port
        raise _Unusable("; ".join(errors))

    async def _send_decode(
        self,
        path: str,
        raw: bytes,
        headers: dict[str, str],
        only: str | None = None,
        text: str = "",
    ) -> tuple[str, httpx.Response]:
        """The request sent to the first decode server (`_ranked`) that takes the
        connection (`only`: to that one). A refused connection carried none of the
        request, so the next server may have it: the prefill server's copy waits for
        whichever decode server asks for its room (a retry). The policy hears which server
        took it (`_sent`)."""
        if only is not None:
            urls = [only]
        elif not self.decode:
            raise _NoWorker  # (the last removed while the prefill server was picked)
        else:
            urls = self._ranked("decode", text)
        span = current.get()
        for i, url in enumerate(urls, 1):
            if i > 1:
                self.metrics.retries["decode", path] += 1
            if span is not None:
                span.tried("decode", url)
            try:
                resp = await self._post(url, path, raw, headers)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                self.metrics.failed["decode", url] += 1
                if span is not None:
                    span.failed("decode", url, e)
                if i == len(urls):
                    raise _Unreachable(url, e) from e
                log.warning("decode %s refused the connection (%r): trying the next", url, e)
                continue
            except BaseException as e:  # (it went, and failed on its way or its client left)
                self._sent("decode", url, text)  # (the server may have run it all the same)
                if isinstance(e, httpx.HTTPError):
                    self.metrics.failed["decode", url] += 1
                raise
            self._sent("decode", url, text)
            return url, resp

    async def _post(
        self, url: str, path: str, raw: bytes, headers: dict[str, str]
    ) -> httpx.Response:
        """`raw` sent to `url`, its answer streamed (`_open`: the caller's `_finished` once
        read); a server refusing the connection is marked down for a while (`_in_turn`)."""
        send = self.client.build_request("POST", f"{url}{path}", content=raw, headers=headers)
        try:
            resp = await self._open(url, send)
        except (httpx.ConnectError, httpx.ConnectTimeout):
            self._unreachable(url)
            raise
        self._down.pop(url, None)
        return resp

    async def _relay(
        self, resp: httpx.Response, d_url: str, path: str, span: RouteSpan | None = None
    ) -> AsyncIterator[bytes]:
        """The decode server's SSE bytes as they come; if it dies, an error event (and the
        request's `span` its error). The stream's end is the request's there (`_finished`)."""
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            self._count_failure(path, "decode_failed")
            self.metrics.failed["decode", d_url] += 1
            self.metrics.streams_lost[d_url] += 1
            lost = f"lost the decode server {d_url} mid-stream: {e!r}"
            if span is not None:
                span.lost = lost
            yield _sse_error(lost, path)
        finally:
            self._finished("decode", d_url)
            await resp.aclose()

    async def _prefill(
        self, p_url: str, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> None:
        """The prefill server's copy (in flight there since its pick: `_pick_prefill`);
        cancelled, its connection closes and the server drops the request. Its answer is a
        contact that succeeded, as a decode server's is (`_post`): a mark the health checks
        set again since its pick (its bootstrap ask) is cleared."""
        try:
            send = self.client.build_request("POST", f"{p_url}{path}", json=body, headers=headers)
            r = await self.client.send(send, stream=True)
            self._down.pop(p_url, None)
            try:
                await r.aread()
            finally:
                await r.aclose()
            if r.status_code != 200:
                log.warning("prefill %s answered %d: %s", p_url, r.status_code, r.text[:500])
                if r.status_code >= 500 or r.json()["error"].get("param") == "bootstrap_port":
                    self._bootstrap.pop(p_url, None)
                    self.metrics.failed["prefill", p_url] += 1
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            log.warning("prefill %s failed: %r", p_url, e)
            self._bootstrap.pop(p_url, None)
            self.metrics.failed["prefill", p_url] += 1
            if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
                self._unreachable(p_url)  # (it died after telling its port)

    def _count_failure(self, path: str, kind: str) -> None:
        """A request to `path` the servers failed (`kind`: how): the router's count and its
        route's, kept together."""
        self.failures += 1
        self.metrics.errors[path, kind] += 1

    def _failed(
        self, p_url: str, prefill: asyncio.Task, path: str, error: str, decode: str | None = None
    ) -> None:
        """A request to `path` the servers failed (`error`: how, for the metrics; `decode`:
        the decode server that failed it, once known): its prefill half goes, and the
        prefill server's bootstrap port is asked again next time (a restarted server may
        have a new one)."""
        self._count_failure(path, error)
        if decode is not None:
            self.metrics.failed["decode", decode] += 1
        prefill.cancel()
        self._bootstrap.pop(p_url, None)

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- workers joining and leaving: SGLang Model Gateway's worker API -------------------

    def _find(self, url: str) -> tuple[str, str] | None:
        """(kind, registered URL) of the worker `url` names, in any spelling (`_address`)."""
        try:
            at = _address(url)
        except DsakvError:
            return None  # (no server's URL)
        for kind in ("prefill", "decode"):
            for known in getattr(self, kind):
                if _address(known) == at:
                    return kind, known
        return None

    def _already_registered(self, url: str) -> Response | None:
        """The 409 for a server registered already (as either kind, under any spelling)."""
        found = self._find(url)
        if found is None:
            return None
        kind, known = found
        message = f"{url} is a {kind} worker already" + (f" (as {known})" if known != url else "")
        return _client_error(409, message, "url", "WORKER_ALREADY_EXISTS")

    def worker(self, url: str) -> dict[str, Any] | None:
        """What the router knows of a worker (`url` in any spelling), else None."""
        found = self._find(url)
        return None if found is None else self._info(*found)

    def _info(self, kind: str, url: str) -> dict[str, Any]:
        """A worker in the fields of SGLang's WorkerInfo: healthy unless its last contact
        failed (`_healthy`); a prefill server's bootstrap port once asked (else null)."""
        info = {
            "id": url,
            "url": url,
            "worker_type": kind,
            "connection_mode": "http",
            "is_healthy": self._healthy(url),
        }
        if kind == "prefill":
            info["bootstrap_port"] = self._bootstrap[url][1] if url in self._bootstrap else None
        return info

    def workers(self) -> dict[str, Any]:
        """SGLang's `GET /workers`: every worker, prefill servers first, and the counts."""
        listed = [
            self._info(kind, url) for kind in ("prefill", "decode") for url in getattr(self, kind)
        ]
        counts = {"prefill_count": len(self.prefill), "decode_count": len(self.decode)}
        return {"workers": listed, "total": len(listed), "stats": {**counts, "regular_count": 0}}

    async def add_worker(self, spec: dict[str, Any]) -> dict[str, Any] | Response:
        """A server joining, `spec` in SGLang's fields (`url`, `worker_type`, a prefill
        server's `bootstrap_port`; `_checked_spec`), its `/disagg/info` agreeing (`_probe`)
        and its KV layout the deployment's (`_layout_differs`: checked and registered one add
        at a time, so that of two racing, the second is checked against the first; the
        layouts not yet known asked before, all at once: `_learn_layouts`). It takes requests
        from the next one on. SGLang's answer, else the 4xx naming the field."""
        checked = _checked_spec(spec)
        if isinstance(checked, Response):
            return checked
        url, kind, port = checked
        if (taken := self._already_registered(url)) is not None:
            return taken
        probed = await self._probe(url, kind, port)  # (outside the lock: it may be slow)
        if isinstance(probed, Response):
            return probed
        await self._learn_layouts()  # (before the lock: the check under it asks no server)
        async with self._adding:
            return self._register(url, *probed)

    def _register(
        self, url: str, mode: str, address: tuple[str, int] | None, info: dict[str, Any]
    ) -> dict[str, Any] | Response:
        """`add_worker`'s last step, under its lock: the server `url` (its `/disagg/info`:
        `info`) registered, unless registered meanwhile or its KV layout differs from the
        deployment's servers' (none yet: it sets the layout)."""
        if (taken := self._already_registered(url)) is not None:  # (added while it was asked)
            return taken
        if (differs := self._layout_differs(url, info)) is not None:
            return _client_error(400, differs, "url")
        if address is not None:
            self._bootstrap[url] = address
        self._layouts[url] = _layout(info)
        self._down.pop(url, None)
        self._streaks.pop(url, None)
        setattr(self, mode, [*getattr(self, mode), url])
        log.info("router: %s server %s added", mode, url)
        message = f"Successfully added {mode} server: {url}"
        return {"success": True, "message": message, "worker": self._info(mode, url)}

    async def _probe(
        self, url: str, kind: str | None, port: int | None
    ) -> tuple[str, tuple[str, int] | None, dict[str, Any]] | Response:
        """The mode of the server `url`, a prefill server's bootstrap (host, port), and its
        `/disagg/info`: it must answer, in the mode `kind` names (None: its mode is taken),
        with the bootstrap `port` if one is given; else the 400 naming the field."""
        try:
            info = await self._disagg_info(url)
            mode = info.get("mode")
            address = _bootstrap_address(url, info) if mode == "prefill" else None
        except httpx.HTTPStatusError as e:
            status = e.response.status_code
            message = f"{url} is not a prefill or decode server: GET /disagg/info answered {status}"
            return _client_error(400, message, "url")
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            message = f"{url} did not answer GET /disagg/info as a prefill or decode server: {e!r}"
            return _client_error(400, message, "url")
        if mode not in ("prefill", "decode"):
            message = f"{url} is not a prefill or decode server (mode {mode!r})"
            return _client_error(400, message, "url")
        if kind is not None and mode != kind:
            message = f"{url} is a {mode} server, not a {kind} server"
            return _client_error(400, message, "worker_type")
        if port is not None and (address is None or port != address[1]):
            told = f"is {address[1]}" if address else "is none (a decode server)"
            message = f"{url}'s bootstrap port {told}, not {port}"
            return _client_error(400, message, "bootstrap_port")
        return mode, address, info

    async def _learn_layouts(self) -> None:
        """The registered servers' KV layouts the router is unsure of (a server given at the
        start and not yet asked, or one marked down: restarting, maybe with another layout)
        asked all at once: a server that never answers costs adds at once one timeout, not
        one each in turn. One that does not answer stays as known (or unknown)."""

        async def ask(url: str) -> None:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                await self._disagg_info(url)

        unsure = [
            u for u in self.prefill + self.decode if u not in self._layouts or u in self._down
        ]
        await asyncio.gather(*(ask(u) for u in unsure))

    def _layout_differs(self, url: str, info: dict[str, Any]) -> str | None:
        """How the server `url` (its `/disagg/info`: `info`) differs from the deployment in
        what a handoff needs equal (the KV layout, how the KV is computed), against the
        first of the router's servers whose layout it knows (`_layouts`); else None (also
        when there is none: the handshake still checks). Added, it would fail every request
        it shared with another (the handoff's 502)."""
        for known in _in_turn(self.prefill + self.decode, 0, self._down, time.monotonic()):
            if (theirs := self._layouts.get(known)) is None:
                continue
            diffs = [
                f"{key}: {known} {theirs.get(key)!r}, {url} {info.get(key)!r}"
                for key in _LAYOUT_KEYS
                if theirs.get(key) != info.get(key)
            ]
            if diffs:
                return f"{url} and the deployment have different KV layouts: {'; '.join(diffs)}"
            return None
        return None

    def remove_worker(self, url: str) -> dict[str, Any] | Response:
        """A server leaving: new requests go to the others, those it has finish (a decode
        server still streams its answers through the router; admin calls such as an abort
        reach it until they end: `_admin_targets`), and the stored responses the router knew
        it held are forgotten. The last of a kind may go too, as in SGLang's gateway:
        requests then get the 503 naming what is missing until one is added."""
        found = self._find(url)
        if found is None:
            return _no_such_worker(url)
        kind, url = found  # (its one entry: `_check_distinct`, `_already_registered`)
        setattr(self, kind, [u for u in getattr(self, kind) if u != url])
        self._bootstrap.pop(url, None)
        self._layouts.pop(url, None)  # (re-added, it is asked again: another layout maybe)
        self._down.pop(url, None)
        self._streaks.pop(url, None)
        self._policies[kind].forget(url)  # (what it was sent leaves the prefix trees)
        for rid in [rid for rid, held in self._responses.items() if held == url]:
            del self._responses[rid]
        self._trim_responses()
        log.info("router: %s server %s removed", kind, url)
        return {"success": True, "message": f"Successfully removed {kind} server: {url}"}

    async def health(self) -> Response:
        """/health (/readiness, /ping): degraded (503) while a kind has no server or a
        server is unhealthy, as /workers and /metrics tell it (`_healthy`). One the health
        checks found down stays so until they find it up (SGLang router's answer: no probe
        of its own ahead of their thresholds). One only a contact found down (a request, a
        bootstrap ask) is probed first (`_probe_health`), a contact like any other: a pass
        clears it, a failure keeps it. Else a server briefly down would be reported until a
        request to it succeeds or the checks' success threshold passes (SGLang's router
        marks no worker unhealthy for a failed request: its circuit breaker, which its
        /health does not read, takes those). With the checks off, every server is probed:
        else only requests would ever find one down."""
        servers = self.prefill + self.decode
        if self.health_config.enabled:
            servers = [u for u in servers if u in self._down and not self._checks_found_down(u)]
        passed = await asyncio.gather(*(self._probe_health(url) for url in servers))
        for url, ok in zip(servers, passed):
            if url not in self.prefill + self.decode:  # (removed meanwhile)
                continue
            if not ok:
                self._unreachable(url)
            elif not self._checks_found_down(url):  # (not if the checks found it down since)
                self._down.pop(url, None)
        bad = [f"no {kind} worker" for kind in ("prefill", "decode") if not getattr(self, kind)]
        for url in self.prefill + self.decode:
            if not self._healthy(url):
                probed = self._checks_found_down(url)
                bad.append(f"{url}: " + ("failed its health checks" if probed else "unreachable"))
        if bad:
            return JSONResponse({"status": "degraded", "unhealthy": bad}, status_code=503)
        return JSONResponse({"status": "ok"})

    def start(self) -> None:
        """The router begins serving (its lifespan: `build_router_app`): the health checks
        start, unless disabled (`HealthConfig`); `close` stops them."""
        if self.health_config.enabled:
            self._spawn(self._check_health())

    async def _check_health(self) -> None:
        """SGLang router's active health checks: every `interval_s` seconds, each server
        registered then probed at once (`_probe_health`), each result told `_probed`."""
        while True:
            await asyncio.sleep(self.health_config.interval_s)
            probed = [(kind, url) for kind in MODES for url in getattr(self, kind)]
            results = await asyncio.gather(*(self._probe_health(url) for _, url in probed))
            for (kind, url), ok in zip(probed, results):
                self._probed(kind, url, ok)

    async def _probe_health(self, url: str) -> bool:
        """Whether `url` answers the health check endpoint with a 2xx in time. Any error
        fails this probe alone: one escaping would end `_check_health` for good."""
        h = self.health_config
        try:
            r = await self.client.get(
                f"{url}{h.endpoint}", headers=self._probe_headers, timeout=h.timeout_s
            )
        except httpx.HTTPError as e:
            log.debug("health check of %s failed: %r", url, e)
            return False
        except Exception as e:  # noqa: BLE001 - httpx.InvalidURL (an odd endpoint or URL)...
            log.warning("health check of %s failed: %r", url, e)
            return False
        return r.is_success

    def _probed(self, kind: str, url: str, ok: bool) -> None:
        """A health check of the `kind` server `url` passed (`ok`) or failed: counted
        (`smg_worker_health_checks_total`), and `failure_threshold` failed in a row mark it
        down (`_unreachable`), `success_threshold` passed in a row up again (a contact
        succeeding meanwhile marks it up at once, as always). A server removed while it was
        probed is left alone."""
        if url not in getattr(self, kind):
            return
        self.metrics.health_checks[kind, "success" if ok else "failure"] += 1
        last, n = self._streaks.get(url, (ok, 0))
        n = n + 1 if last == ok else 1
        self._streaks[url] = (ok, n)
        h = self.health_config
        if not ok and n >= h.failure_threshold and not self._checks_found_down(url):
            log.warning("router: %s server %s failed %d health checks: unhealthy", kind, url, n)
            self._unreachable(url, probed=True)
        elif ok and n >= h.success_threshold and url in self._down:
            log.info("router: %s server %s passed %d health checks: healthy", kind, url, n)
            del self._down[url]

    async def close(self) -> None:
        """Hang up on the servers, the router stopping (its lifespan: `build_router_app`):
        the prefill halves still running and the health checks are cancelled, then the
        client closed (a new one is made if the app serves again)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()


class _Unusable(Exception):
    """No prefill server told its bootstrap port."""


class _NoWorker(Exception):
    """No decode server left to send a request to."""


class _Unreachable(Exception):
    """No decode server took the connection; the last one tried, and its error."""

    def __init__(self, url: str, error: Exception) -> None:
        super().__init__(url, error)
        self.url, self.error = url, error


# A server URL's schemes, and their default ports.
_PORTS = {"http": 80, "https": 443}
# What a server's /disagg/info tells of its KV that a handoff needs equal on both sides.
_LAYOUT_KEYS = ("fingerprint", "compute")
# How long the router waits for a server's /disagg/info.
_INFO_TIMEOUT_S = 10.0
# The most pages (of 100) of a previous response's input items the router reads: more than
# any context holds.
_ITEM_PAGES = 10_000
# The older worker calls' (/add_worker, /remove_worker) answer to one without ?url=.
_URL_IN_QUERY = "give the worker's URL as ?url="
_NO_SESSIONS = (
    "the router runs no SGLang sessions (/open_session, /close_session, session_params): a "
    "session's requests build on its earlier ones, held by the server that ran them, and the "
    "router splits each request over a prefill and a decode server; open sessions on a "
    "`dsakv serve` without prefill/decode disaggregation"
)
# How long a server that failed to connect is asked after the others.
_DOWN_S = 10.0
# SGLang's admin calls the router relays to every server, and how long it waits for each
# server's answer (a weight update loads a checkpoint after the requests in flight end).
BROADCAST = {
    "/abort_request": 30.0,
    "/configure_logging": 30.0,  # (the request log: each server logs its own calls)
    "/flush_cache": 30.0,
    "/update_weights_from_disk": None,
    "/update_weight_version": 30.0,
    "/pause_generation": None,  # ("abort" answers once the requests in flight ended)
    "/continue_generation": 30.0,
    # vLLM's names for pausing and for /flush_cache; profiling (SGLang's and vLLM's)
    "/pause": None,
    "/resume": 30.0,
    "/reset_prefix_cache": 30.0,
    "/start_profile": 30.0,
    "/stop_profile": None,  # (every rank writes its trace first)
    # SGLang's expert distribution recorder: each server writes its own dump
    "/start_expert_distribution_record": 30.0,
    "/stop_expert_distribution_record": 30.0,
    "/dump_expert_distribution_record": None,
    # sleep mode for a colocated trainer (SGLang's, vLLM's): weights copied to or from the host
    "/release_memory_occupation": None,
    "/resume_memory_occupation": None,
    "/sleep": None,
    "/wake_up": None,
    # LoRA adapters (vLLM's names, SGLang's): both servers of a request run its adapter
    "/v1/load_lora_adapter": None,
    "/v1/unload_lora_adapter": 30.0,
    "/load_lora_adapter": None,
    "/unload_lora_adapter": 30.0,
}
# Broadcast calls SGLang takes as GET too.
_GET_TOO = (
    "/configure_logging",
    "/flush_cache",
    "/start_profile",
    "/stop_profile",
    "/start_expert_distribution_record",
    "/stop_expert_distribution_record",
    "/dump_expert_distribution_record",
    "/release_memory_occupation",
    "/resume_memory_occupation",
)
# The call that undoes a broadcast one (on the servers it reached) when another server failed
# it, and whether it is sent the call's body (else {}): a LoRA load's (its name), but for one
# in place (`_replaced`: the old path loaded back, `Router._undo`).
_UNDO = {
    "/pause_generation": ("/continue_generation", False),
    "/pause": ("/resume", False),
    "/release_memory_occupation": ("/resume_memory_occupation", False),
    "/sleep": ("/wake_up", False),
    "/start_expert_distribution_record": ("/stop_expert_distribution_record", False),  # (eager)
    "/v1/load_lora_adapter": ("/v1/unload_lora_adapter", True),  # (the load's body: its name)
    "/load_lora_adapter": ("/unload_lora_adapter", True),
}
# Calls every server answers alike, asked of one decode server (`Router.one`), and methods.
_ONE = {
    "/v1/models": ["GET"],
    "/v1/models/{model:path}": ["GET"],  # (OpenAI's retrieve; a served name may hold "/")
    "/tokenize": ["POST"],
    "/detokenize": ["POST"],
    "/v1/tokenize": ["POST"],
    "/v1/detokenize": ["POST"],
    "/version": ["GET"],
    "/model_info": ["GET"],
    "/get_model_info": ["GET"],
    "/get_weights_by_name": ["GET", "POST"],
}


def _server_url(url: str) -> str:
    """`url` checked (http(s)://HOST[:PORT], a path allowed) and spelt one way: scheme and
    host in lower case, no default port, no trailing slash (so one server is one worker,
    `_address`). Refused too: a user and password (httpx would send them as Basic auth in
    place of the client's key, and the worker listings show them), a query or a fragment
    (every request's path would be wrong: 404s) and port 0."""
    try:
        parts = urlsplit(url.strip())
    except ValueError:  # (a bracketed host that is no IPv6 address, "http://[::1")
        raise DsakvError(f"a server URL must be http(s)://HOST[:PORT], got {url!r}") from None
    user, at, _ = parts.netloc.rpartition("@")
    shown = url.replace(user + at, "…@", 1) if at else url  # (no password in a message)
    if at:
        raise DsakvError(
            f"a server URL takes no user or password, got {shown!r}: the router passes on "
            "each client's Authorization header (the servers' --api-key checks it)"
        )
    if "?" in url or "#" in url:
        raise DsakvError(
            f"a server URL takes no query or fragment, got {url!r}: the router appends each "
            "request's path to it"
        )
    try:
        port = parts.port  # (a port past 65535 raises only here, else: every request)
    except ValueError:
        port = 0
    if parts.scheme.lower() not in _PORTS or not parts.hostname or port == 0:
        raise DsakvError(f"a server URL must be http(s)://HOST[:PORT], PORT 1..65535, got {url!r}")
    scheme, host = parts.scheme.lower(), parts.hostname  # (hostname: lower case)
    netloc = f"[{host}]" if ":" in host else host
    if port is not None and port != _PORTS[scheme]:
        netloc += f":{port}"
    return urlunsplit((scheme, netloc, parts.path.rstrip("/"), "", ""))


def _check_distinct(given: list[tuple[str, str]]) -> None:
    """Each server given once (`_address`: however its URL is spelt), else the DsakvError
    naming both spellings: a server given twice (or as a prefill and a decode server) would
    take two turns, and removing one would leave the other."""
    seen: dict[tuple[str, int, str], str] = {}
    for flag, url in given:
        at = _address(url)
        if at in seen:
            raise DsakvError(f"{seen[at]} and {flag} {url} are one server: give it once")
        seen[at] = f"{flag} {url}"


def _checked_spec(spec: dict[str, Any]) -> tuple[str, str | None, int | None] | Response:
    """A worker's `url` (spelt one way: `_server_url`), `worker_type` and `bootstrap_port`
    (None where not given), else the 400 naming the field; SGLang's `api_key` too: the
    router passes on each client's key instead."""
    url = spec.get("url")
    if not isinstance(url, str):
        return _client_error(400, "url must be the server's URL, a string", "url")
    try:
        url = _server_url(url)
    except DsakvError as e:
        return _client_error(400, str(e), "url")
    kind = spec.get("worker_type")
    if kind not in (None, "prefill", "decode"):
        message = f"worker_type must be 'prefill' or 'decode' (what it pairs), got {kind!r}"
        return _client_error(400, message, "worker_type")
    if spec.get("api_key") is not None:
        message = (
            "api_key is not taken: the router relays each client's Authorization header "
            "to the servers, which check their own --api-key"
        )
        return _client_error(400, message, "api_key")
    port = spec.get("bootstrap_port")
    if port is not None and (type(port) is not int or not 0 < port < 65536):
        message = f"bootstrap_port must be a port number, got {port!r}"
        return _client_error(400, message, "bootstrap_port")
    return url, kind, port


def _address(url: str) -> tuple[str, int, str]:
    """Where a server URL leads: its host, port and path, whatever the scheme (one port
    serves http or https, not both)."""
    parts = urlsplit(_server_url(url))
    return parts.hostname or "", parts.port or _PORTS[parts.scheme], parts.path


def _replaced(raw: bytes) -> str | None:
    """The adapter a LoRA load's body replaces (vLLM's load_inplace: its `lora_name`), else
    None: a failed one is undone by loading each server's old path back (`Router._undo`)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict) or body.get("load_inplace") is not True:
        return None
    name = body.get("lora_name")
    return name if isinstance(name, str) and name else None


def _askable(rid: str) -> bool:
    """Whether a decode server can be asked of its stored response `rid` (`_stored_url`):
    not an id longer than the servers take (`ClientId`: theirs to refuse, naming it), nor
    one holding a "/" (its "%2F" decoded there, the URL is another route's), nor "." or
    ".." (path steps however quoted: the URL would be resolved to another route)."""
    return len(rid) <= MAX_ID_CHARS and "/" not in rid and rid not in (".", "..")


def _stored_url(server: str, rid: str, tail: str = "") -> str:
    """Where server `server` answers of its stored response `rid` (a client's id: quoted,
    so that "../v1/models" or a NUL in it is an id it has not, not another path)."""
    return f"{server}/v1/responses/{quote(rid, safe='')}{tail}"


def _layout(info: dict[str, Any]) -> dict[str, Any]:
    """What a server's `/disagg/info` tells of its KV that a handoff needs equal."""
    return {key: info.get(key) for key in _LAYOUT_KEYS}


def _bootstrap_address(prefill_url: str, info: dict[str, Any]) -> tuple[str, int]:
    """A prefill server's bootstrap (host, port): its URL's host, the port its
    `/disagg/info` tells."""
    return urlsplit(prefill_url).hostname or "127.0.0.1", int(info["bootstrap_port"])


def _none_of(kinds: list[str]) -> JSONResponse:
    """SGLang's gateway's 503 for a request needing servers the router has none of: of
    `kinds`, or (none named) of any kind."""
    named = " and no ".join(kinds) + " " if kinds else ""
    message = f"no {named}workers available: add one (POST /workers)"
    return _error(503, message, code="server_selection_failed")


def _in_turn(urls: list[str], start: int, down: dict[str, float], now: float) -> list[str]:
    """`urls` from `start` round, those that failed in the `_DOWN_S` seconds before `now`
    last. One start per request: concurrent requests advancing a shared cycle per try could
    each skip the one server that is up."""
    turn = urls[start:] + urls[:start]
    return sorted(turn, key=lambda u: _resting(down, u, now))


def _resting(down: dict[str, float], url: str, now: float) -> bool:
    """Whether `url` failed in the `_DOWN_S` seconds before `now`: routing tries it after
    the others (then again in turn, though still unhealthy until a contact succeeds)."""
    return now - down.get(url, -math.inf) < _DOWN_S


def _answer(answer: httpx.Response) -> Response:
    """A server's answer, as it is, for the client."""
    kind = answer.headers.get("content-type")
    return Response(answer.content, answer.status_code, media_type=kind)


def _said(answer: httpx.Response | httpx.HTTPError) -> str:
    if isinstance(answer, httpx.Response):
        return f"{answer.status_code} {answer.text[:200]}"
    return repr(answer)


async def _json_body(request: Request) -> tuple[bytes, dict[str, Any]] | Response:
    """The request's body, raw and as the JSON object it must be (else the error)."""
    try:
        raw = await request.body()
    except ClientDisconnect:
        return Response(status_code=499)  # gone before its request was whole
    try:  # (as a server reads it, `StrictJSONRoute`: else its halves could not be sent)
        body = load_json(raw, NOT_JSON, strict=True)
    except DsakvError as e:
        return _client_error(400, str(e), e.param)
    if not isinstance(body, dict):
        return _client_error(400, "request body must be a JSON object")
    return raw, body


async def _as_sent(request: Request) -> tuple[bytes, dict[str, str], str] | Response:
    """`request` as a server is to get it: its body, its key (and the body's type), its path
    with its query; the 499 when the client left before its body was whole."""
    try:
        raw = await request.body()
    except ClientDisconnect:
        return Response(status_code=499)
    headers = key_headers(request.headers)
    if raw:
        headers["content-type"] = request.headers.get("content-type", "application/json")
    path = route_path({**request.scope, "path": request.url.path})  # (under --root-path)
    return raw, headers, path + (f"?{request.url.query}" if request.url.query else "")


def _shaped(path: str, answer: Response) -> Response:
    """An answer to route `path`: an error the router gave itself (OpenAI's shape, as its
    others) as the route's clients read errors (`error_for`: Anthropic's on its routes), as
    the servers give theirs (relayed as they are)."""
    if answer.status_code < 400 or not isinstance(answer, JSONResponse):
        return answer
    body = error_for(path, answer.status_code, json.loads(answer.body))
    kept = {k: v for k, v in answer.headers.items() if k == "x-request-id"}  # (`_told_id`'s)
    return JSONResponse(body, answer.status_code, kept)


def _name(request: Request, given: Any = None) -> str | None:
    """The id of a request the router splits, given once to both servers as vLLM's
    X-Request-Id (`_id_header`: the response's id, /abort_request's name, their spans'
    `gen_ai.request.id` and request log lines alike, but for a Messages API `msg_` id,
    each server's own), and to the client and the router's span (`_told_id`): the
    client's X-Request-Id; else the id the body gives (`given`: vLLM's `request_id`,
    SGLang's `rid`, a response's id), which both servers get too; else a new one (as a
    server makes its own: vLLM's PD proxies give each request one, SGLang's gateway tells
    it the client). None: the body's id is no header's value (a list of rids, or one the
    servers refuse). Kept in `request.state`."""
    rid = request.headers.get("x-request-id") or None
    if rid is None:
        if given is None:
            rid = new_id()
        elif isinstance(given, str) and len(given) <= MAX_ID_CHARS and HEADER_SAFE.fullmatch(given):
            rid = given
    request.state.request_id = rid
    return rid


def _id_header(request: Request) -> dict[str, str]:
    """The request's id (`_name`; not named yet: the client's) as an X-Request-Id header."""
    rid = getattr(request.state, "request_id", None) or request.headers.get("x-request-id")
    return {"x-request-id": rid} if rid else {}


async def _told_id(request: Request, answer: Awaitable[Response]) -> Response:
    """`answer`, whoever made it (a server, the router's own error), with the request's id
    as its X-Request-Id header (and its span's `request_id`): the client's back, else the
    one the router gave it."""
    response = await answer
    if told := _id_header(request):
        response.headers.update(told)
        if (span := current.get()) is not None:
            span.set("request_id", told["x-request-id"])
    return response


# How an answer ended (`_whole`): its status code, and what went wrong (None: nothing)
_Ended = Callable[[int, str | None], None]


async def _whole(answer: Awaitable[Response], ends: list[_Ended]) -> Response:
    """`answer`, each of `ends` called once it is whole: at once, or at a stream's end
    (`_until_end`); the router failing first, a 500 (cancelled: the client gone, 499)."""
    try:
        response = await answer
    except BaseException as e:  # (a bug's 500, or this handler cancelled)
        gone = isinstance(e, asyncio.CancelledError)
        for end in ends:
            end(499 if gone else 500, "cancelled" if gone else f"the router failed: {e!r}")
        raise
    if isinstance(response, StreamingResponse):
        response.body_iterator = _until_end(response.body_iterator, ends)
    else:
        for end in ends:
            end(response.status_code, _error_of(response))
    return response


async def _until_end(body: AsyncIterator[Any], ends: list[_Ended]) -> AsyncIterator[Any]:
    """A stream's chunks, then `ends` called (its 200 sent): whole, left by the client
    (closed or cancelled first), or failed by the router."""
    error: str | None = "the client left mid-stream"
    try:
        async for chunk in body:
            yield chunk
        error = None
    except Exception as e:  # (a bug: the connection goes, its 200 sent)
        error = f"the router failed mid-stream: {e!r}"
        raise
    finally:
        for end in ends:
            end(200, error)
        await body.aclose()  # type: ignore[attr-defined]  (its own cleanup at once)


def _error_of(response: Response) -> str | None:
    """What went wrong, by a whole answer: a 5xx's message, a client gone (499); None for
    the others (a 4xx is the client's error, not the router's)."""
    if response.status_code == 499:
        return "the client left"
    if response.status_code < 500:
        return None
    try:
        return str(json.loads(response.body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"status {response.status_code}"


def _trace_context(request: Request) -> dict[str, str]:
    """The client's W3C trace context (`traceparent`, `tracestate`), for the servers: the
    spans they make of the request (`--otlp-traces-endpoint`) join the client's trace."""
    return {k: request.headers[k] for k in ("traceparent", "tracestate") if k in request.headers}


def _in_session(body: dict[str, Any]) -> bool:
    """Whether a /generate body names a session (SGLang's `session_params` with an id)."""
    given = body.get("session_params")
    each = given if isinstance(given, list) else [given]
    return any(isinstance(p, dict) and p.get("id") is not None for p in each)


def _items(input: Any) -> list[Any]:
    """A Responses API input as items (text is one user message)."""
    return [{"role": "user", "content": input}] if isinstance(input, str) else list(input or [])


def _num_prompts(body: dict[str, Any]) -> int:
    """How many prompts a body holds (each needs its own bootstrap room): completions'
    `prompt`, SGLang's /generate `text` / `input_ids`, or its /v1/score `items`."""
    for key in ("prompt", "text", "input_ids", "items"):
        value = body.get(key)
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            return len(value)  # a list of texts or of token-id lists
    return 1


async def _unless_left(
    call: Any, request: Request, drop: Callable[[Any], Awaitable[None]] | None = None
) -> Any:
    """`call`'s result, or None once the client has gone: the call (to the decode server)
    is cancelled, which closes its connection, and the decode server aborts the request as
    it does for a client of its own (through the router it generated on to max_tokens).
    This handler cancelled (a batch's line stopped) in the loop turn the result came, the
    result is nobody's: `drop` releases it (an answer still open: `Router._drop`)."""
    task = asyncio.ensure_future(call)
    left = asyncio.ensure_future(client_left(request))
    try:
        await asyncio.wait({task, left}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # (this handler cancelled)
        left.cancel()
        if not task.done():
            task.cancel()
        elif drop is not None and not task.cancelled() and task.exception() is None:
            await drop(task.result())
        raise
    left.cancel()
    if not task.done():
        task.cancel()  # (the client left)
        return None
    return task.result()


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The router's health checks started (`Router.start`), and what it holds released
    when it stops (as a server's app does): the batches still running (`Batches.stop`:
    their lines hung up on both servers), then its client, then its last spans sent
    (`Tracing.shutdown`)."""
    app.state.router.start()
    try:
        yield
    finally:
        await app.state.batches.stop()
        await app.state.router.close()
        if (tracer := app.state.router.tracer) is not None:
            await asyncio.to_thread(tracer.shutdown)


def build_router_app(
    prefill: list[str],
    decode: list[str],
    api_key: str | None = None,
    policy: PolicyConfig | None = None,
    health: HealthConfig | None = None,
    tracing: TraceConfig | None = None,
) -> FastAPI:
    """The router's app, picking servers as `policy` says (`Router`), its servers probed
    as `health` says (`HealthConfig`), a span per request to `tracing`'s collector if given
    (`router_tracing`). With `api_key`, its routes need `Authorization: Bearer` as
    `dsakv serve --api-key`'s do (`require_api_key`, the same probes open): the worker API
    above all, else anyone reaching the port could add a decode server of their own and be
    sent the prompts. The client's header still goes on to the servers, which check their
    own key; the health checks, which have no client, send `api_key` itself."""
    router = Router(prefill, decode, policy, health, tracing, api_key)
    app = FastAPI(
        title="dsakv router", docs_url=None, redoc_url=None, openapi_url=None, lifespan=_lifespan
    )
    app.state.router = router
    require_api_key(app, api_key)
    add_error_handlers(app)  # (its errors, a bug's 500 too, answered as a server's are)

    for path in GENERATE_PATHS:

        async def generate(request: Request, path: str = path) -> Response:
            return await router.generate(path, request)

        app.add_api_route(path, generate, methods=["POST"])

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await router.responses(request)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:  # (Anthropic's: relayed as chat is)
        return _shaped("/v1/messages", await router.generate("/v1/messages", request))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return _shaped("/v1/messages/count_tokens", await router.one(request))

    async def stored(request: Request, response_id: str) -> Response:
        return await router.stored(request, response_id)

    app.add_api_route("/v1/responses/{response_id}", stored, methods=["GET", "DELETE"])
    app.add_api_route("/v1/responses/{response_id}/cancel", stored, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}/input_items", stored, methods=["GET"])

    for path in BROADCAST:

        async def broadcast(request: Request, path: str = path) -> Response:
            return await router.broadcast(path, request)

        methods = ["GET", "POST"] if path in _GET_TOO else ["POST"]
        app.add_api_route(path, broadcast, methods=methods)

    for path in ("/is_paused", "/is_sleeping"):

        async def every_server(request: Request, path: str = path) -> Response:
            return await router.every_server(path, request)

        app.add_api_route(path, every_server, methods=["GET"])

    @app.get("/load")
    async def load(request: Request) -> Response:
        return await router.load(request)

    async def server_info(request: Request) -> Response:
        return await router.server_info(request)

    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, server_info, methods=["GET"])

    @app.get("/get_load")
    async def get_load(request: Request) -> Response:
        return await router.get_load(request)

    async def one(request: Request) -> Response:
        return await router.one(request)

    for path, methods in _ONE.items():
        app.add_api_route(path, one, methods=methods)

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        return await router.invocations(request)

    add_batch_routes(app, router.capacity)  # OpenAI's Batch API, over the routes above

    async def no_sessions() -> Response:
        return _error(501, _NO_SESSIONS, code="not_implemented")

    for path in ("/open_session", "/close_session"):
        app.add_api_route(path, no_sessions, methods=["GET", "POST"])

    async def health() -> Response:
        return await router.health()

    # SGLang Model Gateway's worker API (a worker's URL in the path, escaped or not) and
    # its older router's query-string calls, which answered in plain text.
    @app.post("/workers")
    async def add_worker(request: Request) -> Response:
        got = await _json_body(request)
        if isinstance(got, Response):
            return got
        added = await router.add_worker(got[1])
        return added if isinstance(added, Response) else JSONResponse(added)

    @app.get("/workers")
    async def list_workers() -> Response:
        return JSONResponse(router.workers())

    @app.get("/workers/{url:path}")
    async def get_worker(url: str) -> Response:
        info = router.worker(url)
        if info is None:
            return _no_such_worker(url)
        return JSONResponse(info)

    @app.delete("/workers/{url:path}")
    async def delete_worker(url: str) -> Response:
        removed = router.remove_worker(url)
        return removed if isinstance(removed, Response) else JSONResponse(removed)

    @app.post("/add_worker")
    async def add_worker_legacy(request: Request) -> Response:
        spec: dict[str, Any] = dict(request.query_params)
        if "url" not in spec:
            return _client_error(400, _URL_IN_QUERY, "url")
        if "bootstrap_port" in spec:
            port = spec["bootstrap_port"]
            spec["bootstrap_port"] = int(port) if port.isdecimal() else port
        added = await router.add_worker(spec)
        return added if isinstance(added, Response) else PlainTextResponse(added["message"])

    @app.post("/remove_worker")
    async def remove_worker_legacy(url: str | None = None) -> Response:
        if url is None:
            return _client_error(400, _URL_IN_QUERY, "url")
        removed = router.remove_worker(url)
        return removed if isinstance(removed, Response) else PlainTextResponse(removed["message"])

    @app.get("/list_workers")
    async def list_workers_legacy() -> Response:
        return JSONResponse({"urls": router.prefill + router.decode})

    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/ping", health, methods=["GET", "POST"])  # (vLLM's, SageMaker's)
    # SGLang Model Gateway's Kubernetes probes: ready (/health's answer) once it has a
    # healthy prefill and decode server; alive while it answers at all
    app.add_api_route("/readiness", health, methods=["GET"])

    @app.get("/liveness")
    async def liveness() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:  # (SGLang router's, and dsakv's two: `router_metrics`)
        text = router.metrics.render()
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
