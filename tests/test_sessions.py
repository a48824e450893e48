"""SGLang's sessions ("continual prompting": `dsakv.server.sessions`) end to end on a tiny
model: /open_session and /close_session as SGLang's, and /generate's `session_params`
building a request's input from an earlier one of its session (its prompt and output, cut
at `offset`, or its prompt alone), which then runs as a plain /generate of those ids does,
its prefix cached; `replace` drops (and aborts) what followed, and what SGLang aborts is
aborted in its words. `dsakv router` answers sessions with a 501."""

# ruff: noqa: F811 - the tests take the imported fixtures by their names

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from dsakv.disagg.router import build_router_app
from dsakv.server.runner import aborted_waiting
from dsakv.server.sessions import OpenSessionRequest, SessionParams, Sessions, Turn
from dsakv.server.submit import Call, InFlight

from .serving import TIMEOUT, engine_stops_stepping_at, sglang_generate, sglang_stream

# The completions tests' model, engine and server, their fixtures imported
from .test_completions_api import ENGINE_ARGS, model_dir, reference, served  # noqa: F401
from .test_generate_api import _ABORTED, _check_clean, _wait_live

GREEDY = {"temperature": 0, "ignore_eos": True}
BOS = 256  # the tiny tokenizer's (its encode adds none)


def _open(base: str, **body: Any) -> str:
    body = {"capacity_of_str_len": 1000, **body}
    r = httpx.post(f"{base}/open_session", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def _close(base: str, sid: str) -> None:
    r = httpx.post(f"{base}/close_session", json={"session_id": sid}, timeout=TIMEOUT)
    assert (r.status_code, r.content) == (200, b""), r.text


def _turn(
    base: str, sid: str | None, ids: list[int], on: str | None = None, n: int = 4, **extra
) -> dict:
    """One session request after the one named `on`, greedy, `n` new tokens (`extra`: its
    `rid`, and the rest of its session_params): its output."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, **GREEDY}}
    if "rid" in extra:
        body["rid"] = extra.pop("rid")
    return sglang_generate(base, **body, session_params={"id": sid, "rid": on, **extra})


def _plain(base: str, ids: list[int], n: int = 4) -> dict:
    return sglang_generate(base, input_ids=ids, sampling_params={"max_new_tokens": n, **GREEDY})


def _refused(base: str, body: dict, message: str, param: str = "session_params") -> None:
    r = httpx.post(f"{base}/generate", json=body, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["message"], err["param"], err["type"]) == (message, param, "invalid_request_error")


def _ids(reference, text: str) -> list[int]:
    return reference.tokenizer.encode(text, add_special_tokens=False)


class _Streamed:
    """A streamed /generate read on a thread: `seen` is set once its output has `tokens`
    tokens (the server's handler has read them), `result()` its chunks."""

    def __init__(self, base: str, body: dict, tokens: int) -> None:
        self.seen, self.chunks = threading.Event(), []
        self._pool = ThreadPoolExecutor(1)
        self._done = self._pool.submit(self._read, base, {**body, "stream": True}, tokens)

    def _read(self, base: str, body: dict, tokens: int) -> list[dict]:
        with httpx.stream("POST", f"{base}/generate", json=body, timeout=TIMEOUT) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.chunks.append(json.loads(line[6:]))
                    if len(self.chunks[-1]["output_ids"]) >= tokens:
                        self.seen.set()
        return self.chunks

    def result(self) -> list[dict]:
        try:
            return self._done.result(TIMEOUT)
        finally:
            self._pool.shutdown()


def test_open_and_close_session_as_sglang(base):
    """The id comes back as a JSON string (a new one, or the one given); an id open already,
    a body without capacity_of_str_len or a streaming session is a 400; closing answers an
    empty 200, an unknown id too, and the id may be opened again."""
    sid = _open(base)
    assert isinstance(sid, str) and len(sid) == 32
    assert _open(base, session_id="mine") == "mine"
    r = httpx.post(f"{base}/open_session", json={"capacity_of_str_len": 9, "session_id": "mine"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["message"].startswith("Failed to open the session.") and err["param"] == "session_id"
    for body, param in (
        ({"session_id": "x"}, "capacity_of_str_len"),
        ({"capacity_of_str_len": 9, "streaming": True}, "streaming"),
        ({"capacity_of_str_len": 0}, "capacity_of_str_len"),
        ({"capacity_of_str_len": 9, "timeout": -1}, "timeout"),
    ):
        r = httpx.post(f"{base}/open_session", json=body, timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    _close(base, "mine")
    _close(base, "mine")  # (SGLang's: nothing to close is no error)
    assert _open(base, session_id="mine") == "mine"
    r = httpx.get(f"{base}/close_session", timeout=TIMEOUT)  # (no body)
    assert r.status_code == 400
    for s in (sid, "mine"):
        _close(base, s)
    brief = _open(base, timeout=0.01)  # (newer SGLang's: idle seconds, then it closes)
    time.sleep(0.05)
    body = {"input_ids": [1], "session_params": {"id": brief}}
    _refused(base, body, f"Invalid request: session id {brief} does not exist")


def test_turns_run_as_plain_requests_of_their_whole_input(base, reference):
    """Each turn's input is its parent's prompt and output then its own ids (a leading BOS
    dropped): its greedy output, and its prompt_tokens, are a plain /generate's of those
    ids, and the parent's tokens came from the prefix cache. `offset` cuts the parent's
    sequence first (-1: less its last output token, whose KV no step wrote: SGLang's
    test), `drop_previous_output` takes its prompt alone."""
    page = ENGINE_ARGS["page_size"]
    chunks = [_ids(reference, t) for t in ("Let me tell you about France. ", "Its capital is")]
    more = _ids(reference, " and its river is")
    r = httpx.post(f"{base}/flush_cache", timeout=TIMEOUT)
    assert r.status_code == 200
    sid = _open(base)
    first = _turn(base, sid, chunks[0], n=20, rid="t1")
    assert first["meta_info"]["id"] == "t1"
    seq = chunks[0] + first["output_ids"]
    second = _turn(base, sid, [BOS, *chunks[1]], on="t1")  # (its BOS dropped)
    meta = second["meta_info"]
    assert meta["prompt_tokens"] == len(seq) + len(chunks[1])
    # (the parent's prompt and output, but the last token (no KV yet), in whole pages)
    assert meta["cached_tokens"] == (len(seq) - 1) // page * page > len(chunks[0])
    plain = _plain(base, seq + chunks[1])
    assert second["output_ids"] == plain["output_ids"] and second["text"] == plain["text"]

    seq2 = seq + chunks[1] + second["output_ids"]
    cut = _turn(base, sid, more, on=meta["id"], offset=-1)
    assert cut["meta_info"]["prompt_tokens"] == len(seq2) - 1 + len(more)
    assert cut["output_ids"] == _plain(base, seq2[:-1] + more)["output_ids"]
    at = _turn(base, sid, more, on="t1", offset=len(chunks[0]) + 3)
    assert at["output_ids"] == _plain(base, seq[: len(chunks[0]) + 3] + more)["output_ids"]
    dropped = _turn(base, sid, more, on="t1", drop_previous_output=True)
    assert dropped["meta_info"]["prompt_tokens"] == len(chunks[0]) + len(more)
    assert dropped["output_ids"] == _plain(base, chunks[0] + more)["output_ids"]
    # (text too, streamed: the same input; a request in no session is plain)
    streamed = sglang_stream(
        base,
        text=" and its river is",
        sampling_params={"max_new_tokens": 4, **GREEDY},
        session_params={"id": sid, "rid": "t1", "drop_previous_output": True},
    )
    assert streamed[-1]["output_ids"] == dropped["output_ids"]
    none = _turn(base, None, more)
    assert none["meta_info"]["prompt_tokens"] == len(more)
    _close(base, sid)


def test_unknown_session_or_rid_is_sglangs_abort(base, reference):
    """SGLang's abort of a session request that cannot run: unstreamed a 400 in its words,
    streamed one output whose finish_reason says so (a 200), of 1 prompt token as SGLang's;
    nothing runs."""
    ids = _ids(reference, "hello")
    sid = _open(base)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, **GREEDY}}
    gone = {**body, "session_params": {"id": "nobody"}}
    _refused(base, gone, "Invalid request: session id nobody does not exist")
    unknown = {**body, "session_params": {"id": sid, "rid": "nothing"}}
    _refused(base, unknown, "Invalid request session id")
    _refused(base, {**unknown, "session_params": {"id": sid, "rid": "x", "replace": True}},
             "Invalid request session id")  # fmt: skip
    with httpx.stream(
        "POST", f"{base}/generate", json={**unknown, "stream": True, "rid": "r"}, timeout=TIMEOUT
    ) as r:
        assert r.status_code == 200
        events = [x for x in r.iter_lines() if x.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) == 2
    out = json.loads(events[0][6:])
    assert out["output_ids"] == [] and out["meta_info"]["id"] == "r"
    # (SGLang's runs on a one-token placeholder prompt: `Req.set_finish_with_abort`)
    assert (out["meta_info"]["prompt_tokens"], out["meta_info"]["completion_tokens"]) == (1, 0)
    assert out["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Invalid request session id",
        "status_code": 400,
        "err_type": "BadRequestError",
    }
    _close(base, sid)


def _streamed_turn(
    base: str, sid: str, ids: list[int], on: str | None = None, n: int = 4, **extra
) -> list[dict]:
    """`_turn` streamed: its chunks (each the output so far, SGLang's)."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, **GREEDY}}
    if "rid" in extra:
        body["rid"] = extra.pop("rid")
    return sglang_stream(base, **body, session_params={"id": sid, "rid": on, **extra})


def _until_no_call(base: str) -> None:
    """Until the server has no generation call in flight (a streamed one's hang-up seen)."""
    deadline = time.monotonic() + TIMEOUT
    while httpx.get(f"{base}/load", timeout=TIMEOUT).json()["server_load"]:
        assert time.monotonic() < deadline, "the server never saw its client hang up"
        time.sleep(0.02)


def test_a_streamed_turn_runs_and_joins_as_an_unstreamed_one(base, reference):
    """SGLang streams a session request as a plain /generate: the same chunks, its output
    that of the same turn unstreamed, and the turn joins its session, the next turn
    following its output."""
    ids, more = _ids(reference, "Streams take turns too."), _ids(reference, " Then")
    sid = _open(base)
    a = _turn(base, sid, ids, rid="a")
    seq = ids + a["output_ids"]
    chunks = _streamed_turn(base, sid, [BOS, 7, 8], on="a", n=6, rid="s")
    assert len(chunks) > 1 and all(c["meta_info"]["id"] == "s" for c in chunks)
    last = chunks[-1]
    unstreamed = _turn(base, sid, [7, 8], on="a", n=6, rid="u")  # (the same history)
    assert (last["output_ids"], last["text"]) == (unstreamed["output_ids"], unstreamed["text"])
    assert last["meta_info"]["prompt_tokens"] == unstreamed["meta_info"]["prompt_tokens"]
    assert last["meta_info"]["prompt_tokens"] == len(seq) + 2
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    history = seq + [7, 8] + last["output_ids"]
    after = _streamed_turn(base, sid, more, on="s", rid="t")[-1]  # (streamed on streamed)
    assert after["meta_info"]["prompt_tokens"] == len(history) + len(more)
    assert after["output_ids"] == _plain(base, history + more)["output_ids"]
    _close(base, sid)


def test_a_streamed_turn_whose_client_left_keeps_the_output_it_had(base, served, reference):
    """SGLang's: a turn aborted as its client hung up mid-stream stays in its session with
    the output it had; the next turn follows it."""
    async_engine = served[1]
    ids, more = _ids(reference, "Hang up halfway."), _ids(reference, " Again")
    sid = _open(base)
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 300, **GREEDY},
        "rid": "h",
        "session_params": {"id": sid},
        "stream": True,
    }
    with engine_stops_stepping_at(async_engine, 3):
        with (
            httpx.Client(timeout=TIMEOUT) as http,
            http.stream("POST", f"{base}/generate", json=body) as r,
        ):
            assert r.status_code == 200
            for line in r.iter_lines():
                if (
                    line.startswith("data: {")
                    and len(had := json.loads(line[6:])["output_ids"]) >= 3
                ):
                    break
        _until_no_call(base)  # (before the engine steps again: it has 3 tokens)
    assert len(had) == 3
    after = _turn(base, sid, more, on="h")
    assert after["meta_info"]["prompt_tokens"] == len(ids) + 3 + len(more)
    assert after["output_ids"] == _plain(base, ids + had + more)["output_ids"]
    _close(base, sid)
    _check_clean(async_engine)


def test_a_streamed_replace_drops_what_followed_as_it_starts(base, served, reference):
    """A streamed `replace` drops (aborting) what followed its rid once the engine takes it,
    as an unstreamed one: not what joined while it streamed; refused (past the context),
    it drops nothing."""
    async_engine = served[1]
    ids = _ids(reference, "Rewind, streaming.")
    sid = _open(base)
    a = _turn(base, sid, ids, rid="a")
    seq = ids + a["output_ids"]
    long = {"max_new_tokens": 300, **GREEDY}
    too_long = {"max_new_tokens": reference.engine.max_model_len, **GREEDY}
    with engine_stops_stepping_at(async_engine, 3):
        b = _Streamed(base, {"input_ids": [7], "sampling_params": long, "rid": "b",
                             "session_params": {"id": sid, "rid": "a"}}, 3)  # fmt: skip
        assert b.seen.wait(TIMEOUT)
        refused = {"input_ids": [9], "sampling_params": too_long, "stream": True}
        r = httpx.post(
            f"{base}/generate",
            json={**refused, "session_params": {"id": sid, "rid": "a", "replace": True}},
            timeout=TIMEOUT,
        )
        assert r.status_code == 400 and "context length" in r.json()["error"]["message"], r.text
        append = {"input_ids": [4], "session_params": {"id": sid, "rid": "b"}}
        _refused(base, append, "Session request is appending to a request that hasn't finished.")
        replace = {"max_new_tokens": 6, **GREEDY}
        c = _Streamed(base, {"input_ids": [9], "sampling_params": replace, "rid": "c",
                             "session_params": {"id": sid, "rid": "a", "replace": True}}, 3)  # fmt: skip
        assert c.seen.wait(TIMEOUT)
        b_chunks = b.result()
        d = _turn(base, sid, [5], on="a", n=2, rid="d")  # (joins while c streams)
    c_chunks = c.result()
    assert b_chunks[-1]["meta_info"]["finish_reason"] == _ABORTED
    assert c_chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert c_chunks[-1]["output_ids"] == _plain(base, seq + [9], 6)["output_ids"]
    body = {"input_ids": [4], "session_params": {"id": sid, "rid": "b"}}
    _refused(base, body, "Invalid request session id")  # (b was dropped)
    for on, added in (("c", [9] + c_chunks[-1]["output_ids"]), ("d", [5] + d["output_ids"])):
        after = _turn(base, sid, [4], on=on, n=1)  # (c and d stay)
        assert after["meta_info"]["prompt_tokens"] == len(seq) + len(added) + 1
    _close(base, sid)
    _check_clean(async_engine)


def test_replace_drops_and_aborts_what_followed(base, served, reference):
    """`replace` on a request aborts its children still running (their answer: the output
    so far, SGLang's abort) and drops them from the session; the new turn follows it as an
    append would. On a request still running it aborts that request, and follows the
    output it had. `replace` with no rid drops the whole session."""
    async_engine = served[1]
    ids = _ids(reference, "Sessions branch and rewind.")
    sid = _open(base)
    a = _turn(base, sid, ids, rid="a")
    seq = ids + a["output_ids"]
    long = {"max_new_tokens": 300, **GREEDY}
    child = {"input_ids": [7, 8], "sampling_params": long, "rid": "b"}
    with ThreadPoolExecutor(1) as pool, engine_stops_stepping_at(async_engine, 3):
        b = pool.submit(sglang_generate, base, **child, session_params={"id": sid, "rid": "a"})
        _wait_live(async_engine, 1, 3)
        c = _turn(base, sid, [9], on="a", n=3, replace=True)
        out = b.result(TIMEOUT)
    assert out["meta_info"]["finish_reason"] == _ABORTED and len(out["output_ids"]) >= 3
    assert c["output_ids"] == _plain(base, seq + [9], n=3)["output_ids"]
    body = {"input_ids": [5], "session_params": {"id": sid, "rid": "b"}}
    _refused(base, body, "Invalid request session id")  # (b was dropped)

    running = {"input_ids": seq, "sampling_params": long, "rid": "p"}
    with engine_stops_stepping_at(async_engine, 3):
        p = _Streamed(base, {**running, "session_params": {"id": sid}}, 3)
        assert p.seen.wait(TIMEOUT)
        d = _turn(base, sid, [9], on="p", n=3, replace=True)
        chunks = p.result()
    assert chunks[-1]["meta_info"]["finish_reason"] == _ABORTED
    assert d["meta_info"]["prompt_tokens"] == len(seq) + 3 + 1
    had = chunks[-1]["output_ids"][:3]
    assert d["output_ids"] == _plain(base, seq + had + [9], 3)["output_ids"]
    _turn(base, sid, [4], replace=True)  # (everything dropped)
    for rid in ("a", "p", d["meta_info"]["id"]):
        _refused(base, {**body, "session_params": {"id": sid, "rid": rid}},
                 "Invalid request session id")  # fmt: skip
    _close(base, sid)
    _check_clean(async_engine)


def test_appending_to_a_running_request_is_refused(base, served, reference):
    """SGLang's: an append to a request still running is aborted (a 400 in its words), and
    that request runs on; once it ended it may be appended to."""
    async_engine = served[1]
    ids = _ids(reference, "Not yet.")
    sid = _open(base)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, **GREEDY}, "rid": "r"}
    with ThreadPoolExecutor(1) as pool, engine_stops_stepping_at(async_engine, 3):
        running = pool.submit(sglang_generate, base, **body, session_params={"id": sid})
        _wait_live(async_engine, 1, 3)
        append = {"input_ids": [5], "session_params": {"id": sid, "rid": "r"}}
        _refused(base, append, "Session request is appending to a request that hasn't finished.")
        assert not running.done()
    out = running.result(TIMEOUT)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    after = _turn(base, sid, [5], on="r")
    assert after["meta_info"]["prompt_tokens"] == len(ids) + 6 + 1
    _close(base, sid)


def test_close_session_lets_its_running_request_end(base, served, reference):
    """SGLang's close_session drops the session, not its requests: one running ends as it
    would have; the session then takes no request."""
    async_engine = served[1]
    ids = _ids(reference, "Closing time.")
    sid = _open(base)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, **GREEDY}, "rid": "q"}
    with ThreadPoolExecutor(1) as pool, engine_stops_stepping_at(async_engine, 3):
        running = pool.submit(sglang_generate, base, **body, session_params={"id": sid})
        _wait_live(async_engine, 1, 3)
        _close(base, sid)
        assert not running.done()
    out = running.result(TIMEOUT)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert out["output_ids"] == _plain(base, ids, 6)["output_ids"]
    append = {"input_ids": [5], "session_params": {"id": sid, "rid": "q"}}
    _refused(base, append, f"Invalid request: session id {sid} does not exist")
    _check_clean(async_engine)


def test_a_session_holds_at_most_its_capacity(base, reference):
    """capacity_of_str_len: the most tokens a session holds, each turn counting the tokens
    it added and its output (a 400 past it); a replace of everything frees them."""
    sid = _open(base, capacity_of_str_len=12)
    _turn(base, sid, [1, 2, 3, 4], rid="a")  # (8 held)
    _turn(base, sid, [5], on="a", n=2, replace=False)  # (11)
    r = httpx.post(
        f"{base}/generate",
        json={"input_ids": [6, 7], "session_params": {"id": sid, "rid": "a"}},
        timeout=TIMEOUT,
    )
    assert r.status_code == 400 and "capacity_of_str_len (12)" in r.json()["error"]["message"]
    _turn(base, sid, [1, 2, 3, 4], replace=True)
    _close(base, sid)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input_ids": [[1], [2]]}, "session_params takes one prompt with n = 1"),
        (
            {"input_ids": [1], "sampling_params": {"n": 2}},
            "session_params takes one prompt with n = 1",
        ),
    ],
)
def test_session_params_take_one_prompt(base, body, message):
    sid = _open(base)
    _refused(base, {**body, "session_params": {"id": sid}}, message)
    r = httpx.post(
        f"{base}/generate",
        json={"input_ids": [1], "session_params": {"id": sid, "what": 1}},
        timeout=TIMEOUT,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_params"
    _close(base, sid)


def test_openai_routes_refuse_session_params_for_generate(base):
    """SGLang's OpenAI routes run no session: a 400 pointing at /generate."""
    for path, body in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        r = httpx.post(base + path, json={**body, "session_params": {"id": "s"}}, timeout=TIMEOUT)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "session_params" and "/generate" in err["message"]


def test_router_answers_sessions_501():
    """`dsakv router` does not relay sessions (a session's turns must reach the server
    holding the earlier ones, and it splits each request over two): a 501 saying so."""
    with TestClient(build_router_app([], [])) as client:
        for path in ("/open_session", "/close_session"):
            r = client.post(path, json={"capacity_of_str_len": 9, "session_id": "s"})
            assert r.status_code == 501 and "dsakv serve" in r.json()["error"]["message"]
        body = {"input_ids": [1], "session_params": {"id": "s"}}
        r = client.post("/generate", json=body)
        assert r.status_code == 501 and r.json()["error"]["param"] == "session_params"
        r = client.post("/generate", json={"input_ids": [1], "session_params": {}})
        assert r.status_code == 503  # (no session: relayed, here to no server)


def test_capacity_counts_every_request_the_session_holds(base):
    """A request that takes the rid of one its session holds still holds that one's tokens
    (the earlier request is what it follows); one that adds no token counts one (so a
    session's requests are bounded too)."""
    sid = _open(base, capacity_of_str_len=12)
    _turn(base, sid, [1, 2, 3, 4], rid="x")  # (8 held)
    _turn(base, sid, [5], on="x", n=2, rid="x")  # (11: the first "x" is its earlier turn)
    body = {"input_ids": [6, 7], "rid": "x", "session_params": {"id": sid, "rid": "x"}}
    r = httpx.post(f"{base}/generate", json=body, timeout=TIMEOUT)
    assert r.status_code == 400 and "capacity_of_str_len (12)" in r.json()["error"]["message"]
    _close(base, sid)
    sid = _open(base, capacity_of_str_len=3)
    _turn(base, sid, [1, 2], rid="a", n=0)
    _turn(base, sid, [BOS], on="a", n=0)  # (no token of its own: one counted, 3 held)
    r = httpx.post(
        f"{base}/generate",
        json={
            "input_ids": [BOS],
            "sampling_params": {"max_new_tokens": 0},
            "session_params": {"id": sid, "rid": "a"},
        },
        timeout=TIMEOUT,
    )
    assert r.status_code == 400 and "capacity_of_str_len (3)" in r.json()["error"]["message"]
    _close(base, sid)


def _joined(
    sessions: Sessions, sid: str, name: str, ids: list[int], **params: Any
) -> tuple[Turn, Call]:
    """`name` a request of session `sid` (its own `ids`; `params`: the rest of its
    session_params), and its call, open."""
    turn = sessions.turn(SessionParams(id=sid, **params), 1, 1, False)
    sessions.prompt(turn, ids, None)
    call = sessions.in_flight.open([{name}])
    sessions.start(turn, name, 16, call)
    return turn, call


def _ran(sessions: Sessions, joined: tuple[Turn, Call], out: list[int]) -> None:
    """The engine took the request and it ended with output `out` (run in a loop)."""
    turn, call = joined
    sessions.in_flight.took(call, [aborted_waiting(1)])
    sessions.took(turn)
    turn.result.token_ids, turn.result.finish_reason = list(out), "length"
    sessions.in_flight.close(call)


def test_a_request_refused_after_joining_leaves_nothing():
    """A request the engine never took (refused once its input was built: past the
    context, say) is no request of its session, nor a child of the one it followed."""

    async def run() -> None:
        sessions = Sessions(InFlight(None))  # (no engine: nothing here runs or aborts)
        sid = sessions.open(OpenSessionRequest(capacity_of_str_len=100))
        a = _joined(sessions, sid, "a", [1, 2, 3])
        _ran(sessions, a, [4, 5])
        _, refused = _joined(sessions, sid, "b", [6] * 50, rid="a")
        sessions.in_flight.close(refused)  # (no stream taken)
        session = sessions._sessions[sid]
        assert list(session.nodes) == ["a"] and session.nodes["a"].children == []
        _, dropped = _joined(sessions, sid, "b", [6], rid="a")
        replacing = _joined(sessions, sid, "c", [7], rid="a", replace=True)
        assert list(session.nodes) == ["a", "b", "c"]  # (nothing dropped until it runs)
        sessions.took(replacing[0])  # (drops b, aborting it)
        sessions.in_flight.close(dropped)
        assert list(session.nodes) == ["a", "c"] and session.nodes["a"].children == [
            session.nodes["c"]
        ]
        _ran(sessions, replacing, [8])
        c = session.nodes["c"]
        _, refused = _joined(sessions, sid, "c", [9], rid="c")  # (its rid: c's, held still)
        assert session.nodes["c"] is not c
        sessions.in_flight.close(refused)
        assert session.nodes["c"] is c and c.children == []

    asyncio.run(run())


def test_a_replace_is_not_undone_by_a_refused_request_on_a_rid_it_dropped():
    """A request that takes a finished request's rid and is then refused names that one
    again, unless a `replace` that ran meanwhile dropped it (for good)."""

    async def run() -> None:
        sessions = Sessions(InFlight(None))
        for replace in ({"replace": True}, {"rid": "a", "replace": True}):  # (all; a's)
            sid = sessions.open(OpenSessionRequest(capacity_of_str_len=100))
            session = sessions._sessions[sid]
            _ran(sessions, _joined(sessions, sid, "a", [1, 2, 3]), [4])
            _ran(sessions, _joined(sessions, sid, "b", [5], rid="a"), [6])
            replacing = _joined(sessions, sid, "r", [7], **replace)
            _, reusing = _joined(sessions, sid, "b", [8])  # (b's rid, by a request to come)
            _ran(sessions, replacing, [9])  # (drops b)
            sessions.in_flight.close(reusing)  # (refused)
            assert "b" not in session.nodes, replace
            assert list(session.nodes) == (["r"] if "rid" not in replace else ["a", "r"])

    asyncio.run(run())


def test_a_session_running_a_request_is_not_idle():
    """`timeout` counts idle seconds: not while a request of the session runs, and from
    when its last one ended."""

    async def run() -> None:
        sessions = Sessions(InFlight(None))
        sid = sessions.open(OpenSessionRequest(capacity_of_str_len=100, timeout=60))
        a = _joined(sessions, sid, "a", [1, 2, 3])
        sessions._sessions[sid].active -= 120  # (two minutes since it began)
        sessions.open(OpenSessionRequest(capacity_of_str_len=1))  # (which reaps idle ones)
        assert sid in sessions._sessions
        _ran(sessions, a, [4, 5])
        sessions.open(OpenSessionRequest(capacity_of_str_len=1))
        b = sessions.turn(SessionParams(id=sid, rid="a"), 1, 1, False)
        assert sessions.prompt(b, [6], None) == [1, 2, 3, 4, 5, 6]

    asyncio.run(run())


def test_a_refused_replace_leaves_the_session_as_it_was(base, served, reference):
    """A `replace` the server then refuses (past the context here) never ran: what it would
    have dropped is still there, a running request it would have aborted runs on, and the
    next turn follows the whole history."""
    async_engine = served[1]
    ids = _ids(reference, "Keep what you had.")
    sid = _open(base)
    a = _turn(base, sid, ids, rid="a")
    b = _turn(base, sid, [7, 8], on="a", rid="b")
    too_long = {"max_new_tokens": reference.engine.max_model_len, **GREEDY}
    for on in ("a", None):  # (a replace of a's children, then of everything)
        body = {"input_ids": [9], "sampling_params": too_long}
        r = httpx.post(
            f"{base}/generate",
            json={**body, "session_params": {"id": sid, "rid": on, "replace": True}},
            timeout=TIMEOUT,
        )
        assert r.status_code == 400 and "context length" in r.json()["error"]["message"], r.text
    c = _turn(base, sid, [9], on="b", rid="c")
    history = ids + a["output_ids"] + [7, 8] + b["output_ids"]
    assert c["meta_info"]["prompt_tokens"] == len(history) + 1
    assert c["output_ids"] == _plain(base, history + [9])["output_ids"]

    long = {"input_ids": [5], "sampling_params": {"max_new_tokens": 6, **GREEDY}, "rid": "r"}
    with ThreadPoolExecutor(1) as pool, engine_stops_stepping_at(async_engine, 3):
        running = pool.submit(sglang_generate, base, **long, session_params={"id": sid, "rid": "c"})
        _wait_live(async_engine, 1, 3)
        body = {"input_ids": [9], "sampling_params": too_long}
        r = httpx.post(
            f"{base}/generate",
            json={**body, "session_params": {"id": sid, "rid": "r", "replace": True}},
            timeout=TIMEOUT,
        )
        assert r.status_code == 400, r.text
    assert running.result(TIMEOUT)["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    _close(base, sid)
    _check_clean(async_engine)
