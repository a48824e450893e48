"""OpenAI's Responses API (`/v1/responses`), as vLLM serves it, over the chat path: input
items become chat messages (rendered with tools and reasoning by `Handlers.start_chat`,
exactly as /v1/chat/completions renders them), and the chat parser's reasoning, content and
tool calls become output items (`reasoning`, `message`, `function_call`; a custom tool's
call a `custom_tool_call`), whole or as the API's stream events. Responses are kept in
memory (`store`, on by default as OpenAI's) for `previous_response_id`, GET, the input
items' listing, and `background`'s polling, streaming and cancel."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from pydantic_core import from_json

from .chat import PreparedChat
from .handlers import ChatRun, Handlers
from .openai_format import chat_logprobs
from .parsers import THINK_START, ChatDelta, reasoning_parser
from .protocol import (
    RESPONSES_KEPT,
    APIError,
    ChatCompletionRequest,
    ResponsesRequest,
    ServingExtras,
    check_metadata,
    list_page,
    new_id,
)
from .submit import AbortingStream, Result, sse_event

# A background response's stream events kept for GET ?stream=true (a client attaching, or
# coming back): its newest EVENTS_KEPT, and once it ended, only for the STREAMS_KEPT
# background responses that ended last (vLLM keeps every event of every one).
EVENTS_KEPT = 10_000
STREAMS_KEPT = 16
# A previous response's output item that can start the next turn unfinished (vLLM's partial
# continuation: the model goes on writing it)
_UNFINISHED = ("in_progress", "incomplete")
# chat's names for a request's fields, in the Responses API's words (errors name those)
_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "truncate_prompt_tokens": "truncation",
}
_LOGPROBS = "message.output_text.logprobs"


def add_responses_routes(app: FastAPI, api: Handlers) -> None:
    """POST /v1/responses, GET and DELETE /v1/responses/{id}, GET .../input_items, POST
    .../cancel."""
    store = ResponseStore()

    async def create(body: ResponsesRequest, raw: Request) -> Response:
        return await _create(api, store, body, raw)

    async def retrieve(
        response_id: str, stream: bool = False, starting_after: int | None = None
    ) -> Any:
        """The response; with `stream`, a background response's events (from the one after
        `starting_after`, or the first) and then, while it runs, each as it comes."""
        stored = store.get(response_id)
        if not stream:
            return stored.response
        log = stored.log
        if log is None:
            raise APIError(
                400,
                f"response '{response_id}' cannot be streamed: only a background one can, "
                f"while its events are kept",
                param="stream",
            )
        start = -1 if starting_after is None else starting_after
        if start < -1:
            raise APIError(
                400,
                f"starting_after must be an event's sequence number (0 or more), or -1 "
                f"(from the first), got {start}",
                param="starting_after",
            )
        if start + 1 < log.first:
            raise APIError(
                400,
                f"the events of response '{response_id}' before {log.first} are no longer kept",
                param="starting_after",
            )
        return _event_stream(log.replay(start))

    async def input_items(
        response_id: str,
        after: str | None = None,
        before: str | None = None,
        limit: int = 20,
        order: Literal["asc", "desc"] = "desc",
    ) -> dict[str, Any]:
        """OpenAI's list of the items a response was made from: as there, a continuation's
        are the whole conversation (each earlier response's input and output items, then
        its own input), newest first unless `order` is asc; a page of `limit` (1 to 100),
        after or before the item with that id."""
        if not 1 <= limit <= 100:
            raise APIError(400, f"limit must be 1 to 100, got {limit}", param="limit")
        items = store.get(response_id).items
        items = items[::-1] if order == "desc" else list(items)
        lo, hi = 0, len(items)
        for param, cursor in (("after", after), ("before", before)):
            if cursor is None:
                continue
            at = next((i for i, x in enumerate(items) if x.get("id") == cursor), None)
            if at is None:
                message = f"no input item with id '{cursor}' in response '{response_id}'"
                raise APIError(400, message, param=param)
            lo, hi = (max(lo, at + 1), hi) if param == "after" else (lo, min(hi, at))
        page = items[lo:hi][:limit] if before is None else items[lo:hi][-limit:]
        return list_page(page, len(page) < max(hi - lo, 0))

    async def delete(response_id: str) -> dict[str, Any]:
        stored = store.get(response_id)
        _cancel(api, stored)
        store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def cancel(response_id: str) -> dict[str, Any]:
        """vLLM's and OpenAI's: a background response still running ends, cancelled, with
        the output it had; any other is a 400."""
        stored = store.get(response_id)
        status = stored.response["status"]
        if not stored.response["background"]:
            raise APIError(400, "Cannot cancel a synchronous response.", param="response_id")
        if status not in ("queued", "in_progress"):
            raise APIError(400, f"Cannot cancel a response that is {status}.", param="response_id")
        _cancel(api, stored)
        if stored.task is not None:
            await asyncio.shield(stored.task)  # (ends at the engine's next step)
        return stored.response

    app.add_api_route("/v1/responses", create, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", retrieve, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", delete, methods=["DELETE"])
    app.add_api_route("/v1/responses/{response_id}/input_items", input_items, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"])


# --- the store --------------------------------------------------------------------------------


@dataclass(eq=False)
class _Stored:
    response: dict[str, Any]
    # the items it was made from: its previous responses' input and output, then its input
    items: list[dict[str, Any]] = field(default_factory=list)
    run: ChatRun | None = None  # while it runs
    task: asyncio.Task | None = None  # a background response's
    cancelled: bool = False
    log: _EventLog | None = None  # a background response's stream events


class _EventLog:
    """A background response's stream events, numbered from 0 (`EVENTS_KEPT` newest kept),
    for any number of readers, each from where it starts."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.first = 0  # the number of events[0] (older ones dropped)
        self.done = False
        self._wake = asyncio.Event()

    def add(self, event: str | None) -> None:
        """Append `event` (None: the response ended) and wake the readers."""
        if event is None:
            self.done = True
        else:
            self.events.append(event)
            if len(self.events) > EVENTS_KEPT:
                drop = len(self.events) - EVENTS_KEPT
                del self.events[:drop]
                self.first += drop
        self._wake.set()
        self._wake = asyncio.Event()

    async def replay(self, after: int) -> AsyncIterator[str]:
        """The events after number `after`, then each new one, until the response ends. A
        reader that fell behind what is kept (it read slower than the response wrote) ends
        with an `error` event (at the number of the first one it missed), not a gap."""
        n = after + 1
        while True:
            wake = self._wake
            while n < self.first + len(self.events):
                if n < self.first:
                    message = (
                        f"events {n} to {self.first - 1} are no longer kept: read them "
                        f"faster, or GET the response"
                    )
                    yield _sse("error", n, code="events_dropped", message=message, param=None)
                    return
                event = self.events[n - self.first]
                n += 1
                yield event
            if self.done:
                return
            await wake.wait()


class ResponseStore:
    """Responses by id, in memory, the least recently used dropped past `capacity` (never
    one still running). An id is taken from its request's start (`reserve`), so a second
    request cannot take it while the first runs."""

    def __init__(self, capacity: int = RESPONSES_KEPT) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[str, _Stored] = OrderedDict()
        self._reserved: set[str] = set()
        self._logs: OrderedDict[int, _Stored] = OrderedDict()  # ended, with their events

    def ended(self, stored: _Stored) -> None:
        """Background response `stored` ended: its events are kept among the last
        STREAMS_KEPT."""
        self._logs[id(stored)] = stored
        while len(self._logs) > STREAMS_KEPT:
            self._logs.popitem(last=False)[1].log = None

    @contextlib.contextmanager
    def reserve(self, rid: str) -> Iterator[None]:
        """Hold `rid` while its request starts (a 400 if it is taken)."""
        if rid in self._kept or rid in self._reserved:
            raise APIError(400, f"a response with id '{rid}' exists already", param="request_id")
        self._reserved.add(rid)
        try:
            yield
        finally:
            self._reserved.discard(rid)

    def put(self, rid: str, stored: _Stored) -> None:
        self._kept[rid] = stored
        self._kept.move_to_end(rid)
        for old in [k for k, s in self._kept.items() if s.run is None and k != rid]:
            if len(self._kept) <= self.capacity:
                break
            del self._kept[old]

    def get(self, rid: str, param: str = "response_id") -> _Stored:
        stored = self._kept.get(rid)
        if stored is None:
            raise APIError(404, f"Response with id '{rid}' not found.", param=param)
        self._kept.move_to_end(rid)
        return stored

    def delete(self, rid: str) -> None:
        self._kept.pop(rid, None)

    def continued(self, rid: str) -> _Stored:
        """Response `rid`, to continue (`previous_response_id`): it and each response
        before it must be completed or incomplete."""
        first = stored = self.get(rid, "previous_response_id")
        while True:
            status = stored.response["status"]
            if status not in ("completed", "incomplete"):
                raise APIError(
                    400,
                    f"previous response '{rid}' is {status}; only a completed or incomplete "
                    "one can be continued",
                    param="previous_response_id",
                )
            rid = stored.response["previous_response_id"]
            if rid is None:
                return first
            stored = self.get(rid, "previous_response_id")


# --- POST /v1/responses -----------------------------------------------------------------------


async def _create(
    api: Handlers, store: ResponseStore, body: ResponsesRequest, raw: Request
) -> Response:
    api.check_model(body.model)
    for name in ("prompt", "conversation"):
        if getattr(body, name) is not None:
            raise APIError(400, f"{name} is not supported", param=name)
    for name in ("return_hidden_states", "return_routed_experts"):  # (SGLang's unset: false)
        if getattr(body, name):
            raise APIError(400, f"{name} is not supported on /v1/responses", param=name)
    if body.background and body.store is False:
        raise APIError(400, "background needs store: true", param="background")
    check_metadata(body.metadata)
    rid = body.request_id or new_id("resp_")
    with store.reserve(rid):
        turns = input_messages(body.input)
        items = _with_ids(body.input)
        if body.previous_response_id:
            # The conversation's items read as one input (turns merge across a response's
            # end): the turns of the same items sent again, and of the prefill server's copy
            # through the router, which gets them so.
            previous = store.continued(body.previous_response_id)
            earlier = previous.items + previous.response["output"]
            turns = input_messages(earlier + _as_items(body.input))
            items = earlier + items
        _check_ids(items)
        chat = _chat_request(body, turns, api.engine.engine.max_model_len)
        run = await _start(api, chat, _DETACHED if body.background else raw, rid)
        # (vLLM's: a background response is `queued` until its task starts)
        response = _response(rid, body, api, run, "queued" if body.background else "in_progress")
        stored = _Stored(response, items, run)
        if body.background:
            stored.log = _EventLog()
            store.put(rid, stored)
            answer = JSONResponse(response) if not body.stream else None
            stored.task = asyncio.create_task(_run_in_background(api, store, stored))
            return answer or _event_stream(stored.log.replay(-1))
        if body.stream:
            if body.store is not False:
                store.put(rid, stored)
            return _stream(api, stored)
        results = await api.collect_all(run.streams, raw, run.call)
        _finish(api, stored, _full_output(stored, results[0]), results[0])
        if body.store is not False:
            store.put(rid, stored)
        return JSONResponse(stored.response)


async def _start(api: Handlers, chat: ChatCompletionRequest, raw: Any, rid: str) -> ChatRun:
    """`start_chat` under the response's id (SGLang's /abort_request takes it), its errors
    naming the Responses API's fields."""
    try:
        return await api.start_chat(chat, raw, rid)
    except APIError as e:
        param = _PARAMS.get(e.param or "", e.param)
        message = e.message
        for chat_name, name in _PARAMS.items():
            if chat_name != "messages":
                message = message.replace(chat_name, name)
        raise APIError(e.status, message, e.type, param, e.code) from None


async def _run_in_background(api: Handlers, store: ResponseStore, stored: _Stored) -> None:
    """A background response run to its end as its stream events, kept (`_EventLog`) for
    its streams to read (none needed: GET polls the response)."""
    run, log = stored.run, stored.log
    assert run is not None and log is not None
    try:
        async for event in _events(api, stored):
            log.add(event)
    except Exception as e:  # noqa: BLE001 - nobody awaits this task: the response says it
        message = e.message if isinstance(e, APIError) else f"internal error: {e!r}"
        stored.response.update(status="failed", error={"code": "server_error", "message": message})
        stored.run = None
        log.add(_sse("response.failed", log.first + len(log.events), response=stored.response))
    finally:
        api.closer(run.call, run.streams)()
        log.add(None)
        store.ended(stored)


def _cancel(api: Handlers, stored: _Stored) -> None:
    """End a running response where it stands (its output so far kept), cancelled."""
    if stored.run is None:
        return
    stored.cancelled = True
    for s in stored.run.streams:
        api.engine.abort(s, asked=True)


def _finish(api: Handlers, stored: _Stored, output: _Output, r: Result) -> None:
    """The response's final state: its output, status, usage."""
    run = stored.run
    assert run is not None
    if stored.cancelled or r.finish_reason == "abort":
        status = "cancelled"
    elif r.finish_reason == "length":
        status = "incomplete"
    else:
        status = "completed"
    output.finish("incomplete" if status != "completed" else "completed")
    tokenizer = api.engine.engine.tokenizer
    stored.response.update(
        status=status,
        output=output.items,
        incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
        usage={
            "input_tokens": r.prompt_tokens,
            "input_tokens_details": {"cached_tokens": r.cached_tokens},
            "output_tokens": r.completion_tokens,
            "output_tokens_details": {
                "reasoning_tokens": _reasoning_tokens(run.prep, tokenizer, r.token_ids)
            },
            "total_tokens": r.prompt_tokens + r.completion_tokens,
        },
    )
    stored.run = None


def _full_output(stored: _Stored, r: Result) -> _Output:
    assert stored.run is not None
    reader, output = _Reader(stored.run), _Output(_tools(stored.response["tools"]).calls)
    for d, logprobs in reader.feed(r.as_update(), r.text, True, r.finish_reason == "length"):
        output.feed(d, logprobs)
    return output


# --- streaming --------------------------------------------------------------------------------


def _stream(api: Handlers, stored: _Stored) -> Response:
    """A response streamed to its client (`_events`). A client that leaves aborts it (the
    stored response then reads cancelled)."""
    run = stored.run
    assert run is not None

    end = api.closer(run.call, run.streams)

    def close() -> None:
        end()
        if stored.run is not None:  # (the client left before the end)
            stored.response["status"] = "cancelled"
            stored.run = None

    return AbortingStream(_events(api, stored), close)


def _event_stream(events: AsyncIterator[str]) -> Response:
    """A background response's events: its client leaving leaves it running."""
    return StreamingResponse(
        events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def _events(api: Handlers, stored: _Stored) -> AsyncIterator[str]:
    """The response as OpenAI's stream events: `response.created` (a background one's
    `queued`), `response.in_progress`, each item added, its text or arguments in deltas and
    done, then `response.completed` (or `response.incomplete`, cut by max_output_tokens; a
    cancelled one's is `response.completed`, its response `cancelled`: OpenAI's events have
    no `response.cancelled`), each with its `sequence_number`; an engine failure ends it
    with `response.failed`."""
    run = stored.run
    assert run is not None
    response = stored.response
    seq = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal seq
        seq += 1
        return _sse(kind, seq - 1, **fields)

    yield event("response.created", response=copy.deepcopy(response))
    response["status"] = "in_progress"
    yield event("response.in_progress", response=copy.deepcopy(response))
    reader, output, totals = _Reader(run), _Output(_tools(response["tools"]).calls), Result()
    try:
        async for _, u in api.merged_updates(run.streams):
            totals.add(u)
            cut = u.finished and u.finish_reason == "length"
            for d, logprobs in reader.feed(u, u.text, u.finished, cut):
                for kind, fields in output.feed(d, logprobs):
                    yield event(kind, **fields)
    except APIError as e:
        response.update(status="failed", error={"code": "server_error", "message": e.message})
        stored.run = None
        yield event("response.failed", response=response)
        return
    _finish(api, stored, output, totals)
    for kind, fields in output.events:
        yield event(kind, **fields)
    status = response["status"]
    done = "response.incomplete" if status == "incomplete" else "response.completed"
    yield event(done, response=response)


def _sse(kind: str, seq: int, **fields: Any) -> str:
    return sse_event({"type": kind, "sequence_number": seq, **fields}, kind)


class _Reader:
    """A run's output through its chat parser. With `include: ["message.output_text.logprobs"]`
    it is fed token by token, and each token's logprob entry (chat's: `chat_logprobs`, the
    same values /v1/chat/completions gives) goes to the message text it wrote: the text the
    parser settles is found last in the output it has given out (all but what it holds back:
    whitespace, a tag begun; or dropped: a tag begun when max_output_tokens cut it), after
    the reasoning (one piece from where it opens), and the tokens whose text it covers are
    the text's. So reasoning and tool-call markup keep theirs, and tokens of a stop string
    (never in the text), of a dropped tag and the end token (no text) have none. A token whose text is partly reasoning or
    markup and partly message text (one holding `</think>` and what follows it) counts as
    the text's; the tokens of a character split across tokens go with the token that
    completes it; text the parser gives back that the output does not hold as it stands
    (the whole of a `<tool_call>` that turned out not to be one, read at once) has none."""

    def __init__(self, run: ChatRun) -> None:
        self.parser = run.prep.output_parser()
        self.logprobs = run.params.logprobs is not None
        self.as_ids = bool(run.as_ids)  # (vLLM's return_tokens_as_token_ids)
        self.text = ""  # the output's text fed so far
        self.settled = 0  # where what the parser settled ends in `text`
        r = self.parser.reasoning_parser
        # where the reasoning begins in `text` (None: not known yet): at once when the prompt
        # opened it, else after the output's own `<think>`
        self.reasoning_at: int | None = 0 if r is not None and r.seen else None
        self.tokens: list[tuple[int, int, dict[str, Any]]] = []  # span in the text, entry
        self.end = 0  # where the tokens' texts end
        self.next = 0  # the first token not placed yet

    def feed(
        self, u: Any, text: str, final: bool, cut: bool
    ) -> list[tuple[ChatDelta, list[dict[str, Any]] | None]]:
        """Update `u` (its new `text`): the parser's deltas, each with its text's logprobs."""
        if not self.logprobs:
            return [(self.parser.feed(text, final=final, cut=cut), None)]
        for share, entry in zip(u.texts or [], chat_logprobs(u, self.as_ids)["content"]):
            self.tokens.append((self.end, self.end + len(share), entry))
            self.end += len(share)
        cuts = sorted({e - len(self.text) for _, e, _ in self.tokens if e > len(self.text)})
        chunks, at = [], 0
        for c in cuts:
            if at < c < len(text):
                chunks.append(text[at:c])
                at = c
        chunks.append(text[at:])
        out = []
        for i, chunk in enumerate(chunks):
            self.text += chunk
            last = i == len(chunks) - 1
            d = self.parser.feed(chunk, final=final and last, cut=cut and last)
            if d.reasoning:  # (one piece of text, verbatim: its tokens may end in the text)
                r = self.parser.reasoning_parser
                assert r is not None
                if self.reasoning_at is None:
                    opened = len(self.text) - len(self.text.lstrip())
                    self.reasoning_at = opened + len(THINK_START)
                self.settled = self.reasoning_at + len(r.reasoning)
            out.append((d, self._settle(d.content)))
        return out

    def _settle(self, piece: str) -> list[dict[str, Any]]:
        """The entries of the tokens whose text message text `piece` (settled now) covers."""
        if not piece:
            return []
        p = self.text.rfind(piece, self.settled, len(self.text) - self.parser.held)
        if p < 0:
            return []
        q, self.settled = p + len(piece), p + len(piece)
        took, i = [], self.next
        while i < len(self.tokens) and self.tokens[i][0] < q:
            s, e, entry = self.tokens[i]
            if e > p or s == e >= p:
                took.append(entry)
            i += 1
        self.next = i
        return took


# --- output items -----------------------------------------------------------------------------


@dataclass
class _Output:
    """A response's output items, built from a chat parser's deltas, and the stream events
    each delta makes: an item is added (a text item with its one content part), written in
    deltas, and done when the next item starts or the response ends; ids are the same in
    the events and the final output (the SDK's stream helper checks them). A call is the
    item `tools` (`_tools`) says for the name the model called: a `function_call`, or a
    custom tool's `custom_tool_call`, its `input` the call's one string argument, streamed
    as that string is written (`_input`)."""

    tools: dict[str, dict[str, str]] = field(default_factory=dict)
    items: list[dict[str, Any]] = field(default_factory=list)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # `finish`'s
    _open: dict[str, Any] | None = None
    _calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # tool-call index -> item
    # A custom call's arguments as written (JSON: its item holds the input read from them),
    # by item id
    _arguments: dict[str, str] = field(default_factory=dict)

    def feed(
        self, d: ChatDelta, logprobs: list[dict[str, Any]] | None = None
    ) -> list[tuple[str, dict[str, Any]]]:
        """`d`'s events (`logprobs`: its text's tokens', `_Reader`)."""
        out: list[tuple[str, dict[str, Any]]] = []
        for kind, part in d.parts(set(self._calls)):
            if kind == "call":
                self._call(part, out)
            elif kind == "reasoning":
                self._text("reasoning", part, out)
            else:
                self._text("message", part, out, logprobs or [])
        return out

    def finish(self, status: str) -> None:
        """Close the item being written (`status`: how the response ended)."""
        self.events = []
        self._close(self.events, status)

    def _add(self, item: dict[str, Any], out: list) -> dict[str, Any]:
        self._close(out)
        self.items.append(item)
        self._open = item
        out.append(("response.output_item.added", self._at(item, item=copy.deepcopy(item))))
        return item

    def _text(self, kind: str, text: str, out: list, logprobs: list | None = None) -> None:
        item = self._open
        if item is None or item["type"] != kind:
            if kind == "reasoning":
                item = {"id": new_id("rs_"), "type": "reasoning", "summary": [], "content": []}
                part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
            else:
                item = {"id": new_id("msg_"), "type": "message", "role": "assistant", "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["status"] = "in_progress"
            self._add(item, out)
            item["content"].append(part)
            out.append(
                ("response.content_part.added", self._at(item, content_index=0, part=dict(part)))
            )
        item["content"][0]["text"] += text
        if logprobs:  # (a new list: the events before hold the old one)
            item["content"][0]["logprobs"] = item["content"][0]["logprobs"] + logprobs
        if kind == "reasoning":
            out.append(
                ("response.reasoning_text.delta", self._at(item, content_index=0, delta=text))
            )
        else:
            out.append(
                (
                    "response.output_text.delta",
                    self._at(item, content_index=0, delta=text, logprobs=logprobs or []),
                )
            )

    def _call(self, call: dict[str, Any], out: list) -> None:
        if "id" in call:  # a call starts
            name = call["function"]["name"]
            what = self.tools.get(name) or {"type": "function_call", "name": name}
            custom = what["type"] == "custom_tool_call"
            item = {
                "id": new_id(_ITEM_IDS[what["type"]]),
                "type": what["type"],
                "call_id": call["id"],
                **what,
                "input" if custom else "arguments": "",
                "status": "in_progress",
            }
            if custom:
                self._arguments[item["id"]] = ""
            self._calls[call["index"]] = self._add(item, out)
        item = self._calls[call["index"]]
        fragment = call["function"].get("arguments") or ""
        if fragment and item["type"] == "custom_tool_call":
            self._arguments[item["id"]] += fragment
            self._input(item, out)
        elif fragment:
            item["arguments"] += fragment
            out.append(("response.function_call_arguments.delta", self._at(item, delta=fragment)))

    def _close(self, out: list, status: str = "completed") -> None:
        item, self._open = self._open, None
        if item is None:
            return
        item["status"] = status
        if item["type"] == "function_call":
            done = self._at(item, arguments=item["arguments"], name=item["name"])
            out.append(("response.function_call_arguments.done", done))
        elif item["type"] == "custom_tool_call":
            self._input(item, out, final=True)
            item["input"] = _custom_input(self._arguments[item["id"]])
            done = self._at(item, input=item["input"])
            out.append(("response.custom_tool_call_input.done", done))
        else:
            part = item["content"][0]
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            extra = {"logprobs": part["logprobs"]} if kind == "output_text" else {}
            out.append(
                (
                    f"response.{kind}.done",
                    self._at(item, content_index=0, text=part["text"], **extra),
                )
            )
            out.append(
                ("response.content_part.done", self._at(item, content_index=0, part=dict(part)))
            )
        out.append(("response.output_item.done", self._at(item, item=copy.deepcopy(item))))

    def _input(self, item: dict[str, Any], out: list, final: bool = False) -> None:
        """A custom call's input as far as its arguments read (`final`: all of them), what
        it grew by since a `response.custom_tool_call_input.delta`, as OpenAI's stream it.
        (Arguments that turn out not to be the one string, text after it say, end as
        `_custom_input` reads them whole: `.done`'s input, which the deltas may not make.)"""
        text = _custom_input(self._arguments[item["id"]], final)
        if len(text) > len(item["input"]) and text.startswith(item["input"]):
            delta, item["input"] = text[len(item["input"]) :], text
            out.append(("response.custom_tool_call_input.delta", self._at(item, delta=delta)))

    def _at(self, of: dict[str, Any], **fields: Any) -> dict[str, Any]:
        """An event's fields about item `of`: its id (unless the event carries the item)
        and its place in the output."""
        index = next(i for i, x in enumerate(self.items) if x is of)
        if "item" in fields:
            return {"output_index": index, **fields}
        return {"item_id": of["id"], "output_index": index, **fields}


def _reasoning_tokens(prep: PreparedChat, tokenizer: Any, ids: list[int]) -> int:
    """How many of the output tokens `ids` the reasoning took (the one that ended it
    included): the fewest whose text carries the parser past the reasoning, found by
    bisection (the text of a longer prefix only adds to it)."""
    name = prep.parsers.reasoning
    if name is None or tokenizer is None or not ids:
        return 0

    def parsed(k: int) -> Any:
        parser = reasoning_parser(name, prep.prompt)
        assert parser is not None
        parser.feed(tokenizer.decode(ids[:k], skip_special_tokens=True))
        return parser

    whole = parsed(len(ids))
    if not whole.seen:
        return 0
    if not whole.done:
        return len(ids)  # (cut off while reasoning)
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if parsed(mid).done:
            hi = mid
        else:
            lo = mid + 1
    return lo


# --- the request as a chat request ------------------------------------------------------------


def input_messages(items: str | list[dict[str, Any]], where: str = "input") -> list[dict]:
    """Responses API items as chat messages (OpenAI's turns, as vLLM reads them): a message
    item is a turn (`developer` is the system's), a `function_call` an assistant turn's
    tool call (consecutive calls one turn; one cut off, `incomplete`, is left out: its
    arguments are not JSON), a `custom_tool_call` one too (its `input` the call's one
    argument, as `_tools` shows a custom tool; either one's `namespace` part of the
    name the model was shown), a `function_call_output` or
    `custom_tool_call_output` a tool turn, and a `reasoning` item the reasoning of the
    assistant turn it opens (its `content`, else its `summary`: an `encrypted_content` is
    another server's, which nothing here can read). An assistant turn left unfinished
    (`in_progress`, `incomplete`) is continued by the assistant turn that follows it, or,
    last, by the response (`_chat_request`)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        unfinished = item.get("status") in _UNFINISHED
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(
                    400,
                    f"{at}.role must be user, system, developer or assistant, got {role!r}",
                    param=where,
                )
            content = _text(item.get("content"), f"{at}.content", where)
            if role != "assistant":
                _append(
                    messages,
                    {"role": "system" if role == "developer" else role, "content": content},
                )
                continue
            _append(messages, _turn(content=content, _unfinished=unfinished))
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list):
                raise APIError(400, f"{at}.content must be a list of parts", param=where)
            text = "".join(_field(p, "text", f"{at}.content", where) for p in parts)
            _append(messages, _turn(reasoning_content=text, _opened=True, _unfinished=unfinished))
        elif kind in ("function_call", "custom_tool_call"):
            call_id, name = _field(item, "call_id", at, where), _field(item, "name", at, where)
            if item.get("namespace"):
                name = _flat_name(_field(item, "namespace", at, where), name)
            if kind == "function_call":
                arguments = _field(item, "arguments", at, where)
            else:
                arguments = json.dumps({"input": _field(item, "input", at, where)})
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            if item.get("status") != "incomplete":
                _append(messages, _turn(tool_calls=[call]), calls=True)
            elif not (messages and messages[-1].get("tool_calls")):
                # (cut off: the turn it was in goes on, unless it made calls: a template
                # continuing a turn cuts it at its text, before its calls)
                _append(messages, _turn(content="", _unfinished=True), calls=True)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, f"{at}.output", where)
            call_id = _field(item, "call_id", at, where)
            _append(messages, {"role": "tool", "tool_call_id": call_id, "content": content})
        else:
            raise APIError(
                400,
                f"{at}.type {kind!r} is not supported (message, reasoning, function_call, "
                "function_call_output, custom_tool_call and custom_tool_call_output items "
                "are)",
                param=where,
            )
    for m in messages:
        m.pop("_opened", None)
    return messages


_ITEM_IDS = {
    "message": "msg_",
    "reasoning": "rs_",
    "function_call": "fc_",
    "custom_tool_call": "ctc_",
}


def _as_items(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An input as items (text is one user message)."""
    return [{"role": "user", "content": items}] if isinstance(items, str) else list(items)


def _with_ids(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as the items input_items lists (OpenAI's): each with an id (one given
    unless it had one), text as a message, a message's text as its one content part."""
    out = []
    for i, item in enumerate(_as_items(items)):
        if "id" in item and not isinstance(item["id"], str):
            raise APIError(400, f"input[{i}].id must be a string", param="input")
        kind = item.get("type", "message" if "role" in item else None)
        item = {"id": new_id(_ITEM_IDS.get(kind, "item_")), "type": kind, **item}
        if kind == "message" and isinstance(item.get("content"), str):
            own = item.get("role") == "assistant"
            part = {"type": "output_text", "annotations": []} if own else {"type": "input_text"}
            item["content"] = [{**part, "text": item["content"]}]
        out.append(item)
    return out


def _check_ids(items: list[dict[str, Any]]) -> None:
    """OpenAI's 400 for an item id given twice in a conversation (its items are listed,
    and paged through, by id)."""
    seen: set[str] = set()
    for item in items:
        if item["id"] in seen:
            raise APIError(
                400,
                f"Duplicate item found with id {item['id']}. Remove duplicate items from your "
                "input and try again.",
                param="input",
            )
        seen.add(item["id"])


def _turn(**fields: Any) -> dict[str, Any]:
    """An assistant turn (only the fields given: content None, as OpenAI's, with calls)."""
    out: dict[str, Any] = {"role": "assistant", "content": fields.pop("content", None)}
    out.update((k, v) for k, v in fields.items() if v)
    return out


def _append(messages: list[dict[str, Any]], m: dict[str, Any], calls: bool = False) -> None:
    """Add turn `m`; an assistant turn goes on in the assistant turn before it where that
    one is open (a reasoning item opened it) or unfinished (cut off), and a tool call
    (`calls`) joins the assistant turn just before it."""
    last = messages[-1] if messages else None
    if (
        last is None
        or not last["role"] == "assistant" == m["role"]
        or not (calls or last.get("_opened") or last.get("_unfinished"))
    ):
        messages.append(m)
        return
    for key in ("reasoning_content", "content"):
        if m.get(key):
            last[key] = _joined(last.get(key)) + _joined(m[key])
    if m.get("tool_calls"):
        last["tool_calls"] = last.get("tool_calls", []) + m["tool_calls"]
    last["_unfinished"] = bool(m.get("_unfinished"))
    if not m.get("_opened"):  # (a reasoning item keeps the turn open for what follows)
        last.pop("_opened", None)


def _joined(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(part["text"] for part in content)


def _field(item: Any, key: str, at: str, where: str) -> str:
    value = item.get(key) if isinstance(item, dict) else None
    if not isinstance(value, str):
        raise APIError(400, f"{at}.{key} must be a string", param=where)
    return value


def _text(content: Any, at: str, where: str) -> str | list[dict[str, str]]:
    """A message's content: text, or its text parts (the chat template joins them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{at} must be a string or a list of content parts", param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            raise APIError(
                400, f"{at}[{j}]: content part type {kind!r} is not supported", param=where
            )
        parts.append({"type": "text", "text": _field(part, "text", f"{at}[{j}]", where)})
    return parts


def _chat_request(
    body: ResponsesRequest, turns: list[dict[str, Any]], max_model_len: int
) -> ChatCompletionRequest:
    """The chat request that runs `body`: its instructions first (a system turn), then the
    conversation's `turns` (so far, and its own input)."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += [dict(m) for m in turns]
    unfinished = bool(messages) and messages[-1].pop("_unfinished", False)
    for m in messages:
        m.pop("_unfinished", None)
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "tools": _tools(body.tools).chat or None,
        "tool_choice": _tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "max_completion_tokens": body.max_output_tokens,
        "response_format": _response_format(body),
        "reasoning_effort": body.reasoning.effort if body.reasoning else None,
        "chat_template_kwargs": body.chat_template_kwargs,
        "truncate_prompt_tokens": _truncation(body, max_model_len),
    }
    if unfinished:
        chat.update(add_generation_prompt=False, continue_final_message=True)
    if _LOGPROBS in (body.include or ()):  # (vLLM's: top_logprobs without it asks nothing)
        chat.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    for key in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "stop",
        "logit_bias",
        *ServingExtras.model_fields,
    ):
        chat[key] = getattr(body, key)
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in chat.items() if v is not None}
        )
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        param = _PARAMS.get(str(first["loc"][0]), str(first["loc"][0]))
        raise APIError(400, f"{loc}: {first['msg']}", param=param) from None


@dataclass(frozen=True)
class _Tools:
    chat: list[dict[str, Any]]  # the tools the model is shown, as chat's function tools
    # what a call of each is, by the name the model was shown: its item's type, name and
    # namespace (`_Output`)
    calls: dict[str, dict[str, str]]


def _tools(tools: list[dict[str, Any]] | None) -> _Tools:
    """The client's tools (`_client_tools`) as the model is shown them and as its calls of
    them are items: a function tool as it is, its call a `function_call`; a custom
    (freeform) tool as a function of one string, `input` (its grammar, if it has one, told
    in that string's description: not enforced), its call a `custom_tool_call`."""
    chat, calls = [], {}
    for name, tool, namespace in _client_tools(tools):
        custom = tool["type"] == "custom"
        kind = "custom_tool_call" if custom else "function_call"
        calls[name] = {"type": kind, "name": tool["name"]}
        if namespace is not None:
            calls[name]["namespace"] = namespace
        if not custom:
            fn = {k: tool[k] for k in ("description", "parameters", "strict") if k in tool}
        else:
            fn = {k: tool[k] for k in ("description",) if k in tool}
            fmt = tool.get("format")
            text: dict[str, Any] = {"type": "string"}
            if isinstance(fmt, dict) and fmt.get("type") == "grammar":
                text["description"] = f"{fmt.get('syntax')} grammar:\n{fmt.get('definition')}"
            fn["parameters"] = {
                "type": "object",
                "properties": {"input": text},
                "required": ["input"],
            }
        chat.append({"type": "function", "function": {"name": name, **fn}})
    return _Tools(chat, calls)


def _client_tools(
    tools: list[dict[str, Any]] | None,
) -> Iterator[tuple[str, dict[str, Any], str | None]]:
    """The tools the client runs, each with the name the model is shown and its namespace:
    function and custom tools, and those a namespace tool groups (Codex's MCP servers'),
    named `<namespace>__<name>` as vLLM names them. Any other type is left out, as vLLM
    leaves them: those are tools OpenAI's servers run (web_search, local_shell,
    file_search, mcp, ...), which nothing here runs; Codex sends some with every request,
    so refusing them would refuse it all."""
    for i, tool in enumerate(tools or []):
        group: list[tuple[dict[str, Any], str | None]] = [(tool, None)]
        if tool.get("type") == "namespace":
            space = _field(tool, "name", f"tools[{i}]", "tools")
            group = [(t, space) for t in tool.get("tools") or [] if isinstance(t, dict)]
        for t, namespace in group:
            if t.get("type") not in ("function", "custom"):
                continue
            name = _field(t, "name", f"tools[{i}]", "tools")
            yield (name if namespace is None else _flat_name(namespace, name)), t, namespace


def _flat_name(namespace: str, name: str) -> str:
    """The name a namespace's tool is shown to the model by (vLLM's)."""
    return f"{namespace}__{name}"


def _custom_input(arguments: str, final: bool = True) -> str:
    """A custom tool call's `input`: its arguments' one string (`_tools`), as far as
    it was written where max_output_tokens cut it off (the JSON around it is the function
    the tool was shown as, not the model's input); arguments that hold something else
    (the model wrote something else) are given as they are, once `final` (until then they
    may yet become the string: nothing)."""
    try:
        value = from_json(arguments, allow_partial="trailing-strings")
    except ValueError:
        return arguments if final else ""
    text = value.get("input") if isinstance(value, dict) else None
    if isinstance(text, str):
        return text
    return arguments if final and value else ""  # (cut off before its string: none written)


def _truncation(body: ResponsesRequest, max_model_len: int) -> int | None:
    """vLLM's `truncation: "auto"`: the prompt's first tokens dropped to leave room for
    `max_output_tokens` (or one token), as chat's `truncate_prompt_tokens` drops them."""
    if body.truncation != "auto":
        return None
    room = body.max_output_tokens or 1
    return max_model_len - room if room < max_model_len else None


def _tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") in ("function", "custom") and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(
        400,
        'tool_choice must be "none", "auto", "required" or {"type": "function" or "custom", '
        '"name": ...}',
        param="tool_choice",
    )


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.type == "json_schema":
        schema = fmt.model_dump(by_alias=True, exclude_none=True, exclude={"type"})
        return {"type": "json_schema", "json_schema": schema}
    raise APIError(400, f"text.format type {fmt.type!r} is not supported", param="text.format")


def _response(
    rid: str, body: ResponsesRequest, api: Handlers, run: ChatRun, status: str
) -> dict[str, Any]:
    """The response object, as it stands before its output (`_finish` completes it)."""
    p = run.params
    fmt = body.text.format if body.text and body.text.format else None
    text = {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}}
    if body.text and body.text.verbosity is not None:  # (echoed: the model is not told)
        text["verbosity"] = body.text.verbosity
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "background": bool(body.background),
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": p.max_tokens,
        "max_tool_calls": body.max_tool_calls,
        "metadata": body.metadata or {},
        "model": api.served_name(p),
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": body.reasoning.model_dump() if body.reasoning else None,
        "service_tier": body.service_tier or "auto",
        "store": body.store is not False,
        "temperature": p.temperature,
        "text": text,
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": body.tools or [],
        "top_logprobs": body.top_logprobs,
        "top_p": p.top_p,
        "truncation": body.truncation or "disabled",
        "usage": None,
        "user": body.user,
        # hints, echoed (a prompt_cache_key is OpenAI's routing hint: the prefix cache here
        # needs none, and it is not a cache_salt, which would wall the cache off)
        "prompt_cache_key": body.prompt_cache_key,
        "safety_identifier": body.safety_identifier,
    }


class _Detached:
    """A background response's `raw` request: a client that never leaves (the response
    runs on whether its POST's connection stays or not), on its route (the request log's)."""

    scope = {"type": "http", "path": "/v1/responses"}

    async def receive(self) -> dict[str, Any]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


_DETACHED: Any = _Detached()
