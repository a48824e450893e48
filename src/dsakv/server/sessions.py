"""SGLang's sessions ("continual prompting"): `/open_session`, `/close_session` and
/generate's `session_params`, which builds a request's input from an earlier request of the
session (its prompt and output, cut at `offset`) as SGLang's `Session.create_req` does. The
engine needs nothing of its own for it: the new input starts with the earlier request's
tokens, which the prefix cache holds. So a session is a tree of the requests it ran, here in
the server, each storing only the tokens it added (so `capacity_of_str_len`, the most tokens
a session holds, is about its conversation's length, however many turns it took)."""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from .protocol import APIError, new_id
from .submit import Call, InFlight, Result

# A server's open sessions, and the most tokens one holds whatever its capacity_of_str_len
# asks (more than a DeepSeek-V3.2 context): 4 bytes a token, at most 1 GiB for them all.
MAX_SESSIONS = 1024
MAX_SESSION_TOKENS = 1 << 18


class OpenSessionRequest(BaseModel):
    """SGLang's `OpenSessionReqInput`; its `streaming` sessions (one request at a time, plain
    appends) are not run here."""

    model_config = ConfigDict(strict=True, extra="ignore")
    capacity_of_str_len: int
    session_id: str | None = None
    streaming: bool | None = None
    timeout: float | int | None = None  # (seconds idle before the session closes itself)


class CloseSessionRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    session_id: str


class SessionParams(BaseModel):
    """/generate's `session_params` (SGLang's `SessionParams`); without an `id` the request
    is in no session, as SGLang's."""

    model_config = ConfigDict(strict=True, extra="forbid")
    id: str | None = None
    rid: str | None = None
    offset: int | None = None
    replace: bool | None = None
    drop_previous_output: bool | None = None


class SessionRefused(APIError):
    """SGLang's abort of a session request that cannot run (an unknown session or parent,
    a parent still running): a 400 unstreamed, streamed a finished-with-abort output."""

    def __init__(self, message: str) -> None:
        super().__init__(400, message, param="session_params")

    def finish_reason(self) -> dict[str, Any]:
        return {
            "type": "abort",
            "message": self.message,
            "status_code": 400,
            "err_type": "BadRequestError",
        }

    def result(self) -> Result:
        """Its streamed output's: SGLang's aborted request runs on a one-token placeholder
        prompt (`Req.set_finish_with_abort`), so it reports 1 prompt token."""
        return Result(finish_reason="abort", prompt_tokens=1)


@dataclass(eq=False)
class _Node:
    """A request the session ran (SGLang's `SessionReqNode`): its input is its parent's
    first `base` tokens (prompt, then output unless `with_output` is False) and its own
    `tail`; its output is what its handler read so far (`result`), kept as `output` once it
    ended, up to its `max_tokens`. `shadows`: the node its rid named as it started, named so
    again if it never runs (`_ending`), until its call closes."""

    rid: str
    parent: _Node | None
    base: int
    with_output: bool
    tail: array
    max_tokens: int
    result: Result | None = field(default_factory=Result)
    output: array | None = None
    children: list[_Node] = field(default_factory=list)
    shadows: _Node | None = None

    @property
    def finished(self) -> bool:
        return self.result is None or self.result.finish_reason is not None

    def out(self) -> list[int]:
        if self.result is None:
            return list(self.output or ())
        return self.result.token_ids[: self.max_tokens]

    def tokens(self) -> int:
        """What it holds: its own tokens and output, one at least (a request is held)."""
        return max(1, len(self.tail) + len(self.out()))

    def prompt(self) -> list[int]:
        path = []
        node: _Node | None = self
        while node is not None:
            path.append(node)
            node = node.parent
        ids: list[int] = []
        for parent, node in zip([None, *reversed(path)], reversed(path)):
            if parent is not None:  # (in place: a chain of many turns stays linear)
                if node.with_output:
                    ids += parent.out()
                del ids[node.base :]
            ids += node.tail
        return ids

    def ended(self) -> None:
        """Its request is over: the output it has is its output (a dropped `Result`)."""
        if self.result is not None:
            self.output = array("i", self.out())
            self.result = None


@dataclass(eq=False)
class _Session:
    id: str
    capacity: int
    timeout: float | None
    nodes: dict[str, _Node] = field(default_factory=dict)
    active: float = field(default_factory=time.monotonic)

    def held(self, without: set[_Node]) -> int:
        """The tokens of its requests but `without`'s: those it names, and the earlier ones
        they follow (one whose rid a later request took is held still)."""
        seen, total = set(without), 0
        for node in self.nodes.values():
            while node is not None and node not in seen:
                seen.add(node)
                total += node.tokens()
                node = node.parent
        return total

    @property
    def running(self) -> bool:
        """Whether a request of it runs (the latest first: the likeliest to)."""
        return not all(n.finished for n in reversed(self.nodes.values()))


@dataclass(frozen=True)
class _Replace:
    """What a `replace` drops once its request runs (`Sessions.took`): the requests that
    followed `parent` (without one: all the session's) as it started, and what followed
    them since; `parent` itself is aborted where running (SGLang's)."""

    session: _Session
    parent: _Node | None
    roots: list[_Node]


@dataclass
class Turn:
    """A /generate request's place in its session: its own token ids and its tokenizer's
    BOS (`Sessions.prompt`), its output as its handler reads it (`result`: the stream's
    so-far, or what `collect_all` fills), and what its `replace` drops once it runs."""

    params: SessionParams
    ids: list[int] = field(default_factory=list)
    bos: int | None = None
    result: Result = field(default_factory=Result)
    replace: _Replace | None = None


@dataclass(frozen=True)
class _Plan:
    session: _Session
    parent: _Node | None
    base: int
    with_output: bool
    tail: list[int]
    replaced: list[_Node]  # (replace: the requests that followed, each with its subtree)
    head: list[int]  # (the parent's prompt, and its output unless dropped: built once)

    @property
    def input(self) -> list[int]:
        """The request's input: its first `base` tokens of `head`, then its own."""
        return self.head[: self.base] + self.tail


class Sessions:
    """The server's open sessions, for the calls in flight (`in_flight`, whose aborts reach
    the requests a `replace` drops)."""

    def __init__(self, in_flight: InFlight) -> None:
        self.in_flight = in_flight
        self._sessions: dict[str, _Session] = {}

    def open(self, body: OpenSessionRequest) -> str:
        self._reap()
        if body.streaming:
            raise APIError(400, "streaming sessions are not supported", param="streaming")
        if body.capacity_of_str_len < 1:
            raise APIError(
                400, "capacity_of_str_len must be at least 1", param="capacity_of_str_len"
            )
        if body.timeout is not None and body.timeout <= 0:
            raise APIError(400, "timeout must be positive (seconds)", param="timeout")
        sid = new_id() if body.session_id is None else body.session_id
        if sid in self._sessions:  # (SGLang's words)
            raise APIError(
                400,
                "Failed to open the session. Check if a session with the same id is still open.",
                param="session_id",
            )
        if len(self._sessions) >= MAX_SESSIONS:
            raise APIError(
                400, f"this server holds at most {MAX_SESSIONS} open sessions; close one first"
            )
        capacity = min(body.capacity_of_str_len, MAX_SESSION_TOKENS)
        timeout = None if body.timeout is None else float(body.timeout)
        self._sessions[sid] = _Session(sid, capacity, timeout)
        return sid

    def close(self, session_id: str) -> None:
        """SGLang's: the session is gone (an unknown one: nothing happens); its requests
        still running run on to their end."""
        self._sessions.pop(session_id, None)

    def turn(self, params: SessionParams | None, prompts: int, n: int, pd: bool) -> Turn | None:
        """The request's `Turn` (None: in no session); what a session request cannot be is
        a 400: a batch or n > 1 (SGLang runs each prompt and sample as a session request of
        its own, n > 1 adding a prefix-caching one, a `replace` among them aborting the
        others), or on a prefill or decode server (each runs half a request)."""
        if params is None or params.id is None:
            return None
        if prompts != 1 or n != 1:
            raise APIError(
                400, "session_params takes one prompt with n = 1", param="session_params"
            )
        if pd:
            raise APIError(
                400,
                "session_params is not supported with prefill/decode disaggregation",
                param="session_params",
            )
        return Turn(params)

    def prompt(self, turn: Turn, ids: list[int], bos: int | None) -> list[int]:
        """The input the request's own token `ids` stand for in its session, as SGLang's
        `create_req` builds it (a leading `bos` dropped where it follows another request);
        nothing changes yet (`start`)."""
        turn.ids, turn.bos = ids, bos
        return self._plan(turn).input

    def start(self, turn: Turn, rid: str, max_tokens: int, call: Call) -> list[int]:
        """`prompt` again (the session may have changed meanwhile), and the request (`rid`)
        is now a node of its session, its output `turn.result` until `call` closes. What a
        `replace` drops is dropped once the engine takes the request (`took`): a request
        refused leaves its session as it was, no node of its own (unless one follows it
        already), the one whose rid it took named so again. Its output counts up to its
        `max_tokens`."""
        plan = self._plan(turn)
        s = plan.session
        cleared = {d for r in plan.replaced for d in _subtree(r)}
        held = s.held(cleared) + max(1, len(plan.tail))
        if held > s.capacity:
            raise APIError(
                400,
                f"session {s.id} would hold {held} tokens, past its capacity_of_str_len "
                f"({s.capacity}); open another session, or replace what it holds",
                param="session_params",
            )
        if turn.params.replace:
            turn.replace = _Replace(s, plan.parent, plan.replaced)
        tail = array("i", plan.tail)
        node = _Node(rid, plan.parent, plan.base, plan.with_output, tail, max_tokens, turn.result)
        node.shadows = s.nodes.get(rid)
        if plan.parent is not None:
            plan.parent.children.append(node)
        call.on_close.append(_ending(s, node, call))
        s.nodes[rid] = node
        return plan.input

    def took(self, turn: Turn) -> None:
        """The engine took the request: its `replace` drops what it replaces (aborted
        where running), as SGLang's does as its scheduler takes it."""
        r = turn.replace
        if r is None:
            return
        turn.replace = None
        for node in dict.fromkeys(d for root in r.roots for d in _subtree(root)):
            named = r.session.nodes.get(node.rid)
            if named is node:
                del r.session.nodes[node.rid]
            elif named is not None and named.shadows is node:  # (not to come back: `_ending`)
                named.shadows = None
            self._abort(node)
        if r.parent is not None:
            self._abort(r.parent)
            r.parent.children = [c for c in r.parent.children if c not in r.roots]

    def _plan(self, turn: Turn) -> _Plan:
        """SGLang's `Session.create_req`, without its changes to the session."""
        params, ids, bos = turn.params, turn.ids, turn.bos
        self._reap()
        s = self._sessions.get(params.id or "")
        if s is None:
            raise SessionRefused(f"Invalid request: session id {params.id} does not exist")
        s.active = time.monotonic()
        parent, replaced = None, []
        if params.rid is not None:
            parent = s.nodes.get(params.rid)
            if parent is None:
                raise SessionRefused("Invalid request session id")
            if params.replace:
                replaced = list(parent.children)
            elif not parent.finished:
                raise SessionRefused(
                    "Session request is appending to a request that hasn't finished."
                )
        elif params.replace:
            replaced = list(s.nodes.values())
        if parent is None:
            return _Plan(s, None, 0, False, list(ids), replaced, [])
        tail = ids[1:] if bos is not None and ids and ids[0] == bos else list(ids)
        with_output = not params.drop_previous_output
        head = parent.prompt() + parent.out() if with_output else parent.prompt()
        base = len(range(len(head))[: params.offset]) if params.offset else len(head)
        return _Plan(s, parent, base, with_output, tail, replaced, head)

    def _abort(self, node: _Node) -> None:
        if not node.finished:
            self.in_flight.abort(node.rid)

    def _reap(self) -> None:
        """Sessions idle past their `timeout` close (SGLang's): none of their requests
        running since (`_ending`)."""
        now = time.monotonic()
        for s in [s for s in self._sessions.values() if s.timeout is not None]:
            if now - s.active > s.timeout and not s.running:
                del self._sessions[s.id]


def _subtree(node: _Node) -> list[_Node]:
    """`node` and its descendants (a session's chain of turns may be deep)."""
    out, todo = [], [node]
    while todo:
        out.append(todo.pop())
        todo += out[-1].children
    return out


def _ending(s: _Session, node: _Node, call: Call) -> Callable[[], None]:
    """What runs as `node`'s call closes; one that never ran, nothing following it, leaves
    the session as it found it (its rid naming the node it `shadows`, unless dropped since)."""

    def ended() -> None:
        node.ended()
        s.active = time.monotonic()
        named, node.shadows = node.shadows, None
        if call.streams or node.children:
            return
        if s.nodes.get(node.rid) is node:
            if named is None:
                del s.nodes[node.rid]
            else:
                s.nodes[node.rid] = named
        if node.parent is not None and node in node.parent.children:  # (not replaced)
            node.parent.children.remove(node)

    return ended


def add_session_routes(app: FastAPI, sessions: Sessions) -> None:
    """SGLang's `/open_session` (its answer the session id, a JSON string) and
    `/close_session` (an empty 200), GET or POST with a JSON body, as SGLang's."""

    async def open_session(body: OpenSessionRequest) -> Response:
        return JSONResponse(sessions.open(body))

    async def close_session(body: CloseSessionRequest) -> Response:
        sessions.close(body.session_id)
        return Response(status_code=200)

    app.add_api_route("/open_session", open_session, methods=["GET", "POST"])
    app.add_api_route("/close_session", close_session, methods=["GET", "POST"])
