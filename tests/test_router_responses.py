"""OpenAI's Responses API through `dsakv router`: a prefill server, two decode servers and a
plain server (the reference) as real processes on the GLM tiny model (index_topk covering
every context: exact), the `openai` client in front. A response, streamed or not, equals
the plain server's; a stored response lives on the decode server that wrote it, and the
router finds it there for GET, DELETE, cancel and previous_response_id (the prefill server
gets the whole conversation); an id nobody holds is the servers' 404."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI

from dsakv.disagg.launch import wait_healthy
from dsakv.disagg.router import build_router_app
from dsakv.models.tiny import TINY_PRESETS, write_tiny_model

from .serving import (
    ServerProcess,
    free_port,
    running,
    scrape_metrics,
    start_decode,
    start_prefill,
    wait_idle,
)

TINY = ["--kv-cache-dtype", "fp32", "--index-k-dtype", "fp32", "--page-size", "16",
        "--num-pages", "256", "--device", "cpu"]  # fmt: skip
QUIET = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("router_responses")
    model = {**TINY_PRESETS["glm-tiny"], "index_topk": 1024}
    tiny = str(write_tiny_model(root / "tiny", model))
    procs: dict[str, ServerProcess] = {}
    try:
        procs["prefill"], _ = start_prefill(root, "prefill", tiny, *TINY)
        procs["decode"] = start_decode(root, "decode", tiny, *TINY)
        procs["decode2"] = start_decode(root, "decode2", tiny, *TINY)
        procs["plain"] = ServerProcess(root, "plain", tiny, *TINY)
        for name, p in procs.items():
            try:
                wait_healthy([p.url], [p.proc], 180)
            except Exception as e:
                pytest.fail(f"{name} did not start: {e}\n{p.tail()}")
        decode = [procs["decode"].url, procs["decode2"].url]
        app = build_router_app([procs["prefill"].url], decode)
        server = uvicorn.Server(uvicorn.Config(app, port=free_port(), log_level="warning"))
        with running(server) as base:
            yield {"router": base, **procs}
    finally:
        for p in procs.values():
            p.stop()


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=60, max_retries=0)


def _both(servers) -> tuple[openai.OpenAI, openai.OpenAI]:
    return _client(servers["router"]), _client(servers["plain"].url)


def _respond(client: openai.OpenAI, **kw):
    return client.responses.create(model="m", max_output_tokens=10, temperature=0, **kw)


def _same(got, want, cached: bool = True) -> None:
    """The same response but for its id, time and items' ids; its usage too, cached tokens
    included (the prefill server's prefix cache, which ran the prompts the plain server
    ran). `cached` False: the prompts differ there (a previous output only the plain server
    computed and cached, as the prefill server computes no output)."""
    assert got.output_text == want.output_text
    assert [i.type for i in got.output] == [i.type for i in want.output]
    skip = None if cached else {"input_tokens_details"}
    usage = [r.usage.model_dump(exclude=skip) for r in (got, want)]
    assert (got.status, usage[0]) == (want.status, usage[1])


def _holders(servers, rid: str) -> list[str]:
    """Which decode servers hold response `rid`."""
    names = ("decode", "decode2")
    return [n for n in names if httpx.get(f"{servers[n].url}/v1/responses/{rid}").is_success]


def test_a_response_through_the_router_equals_a_plain_servers(servers):
    """Each decode server in turn writes a response (round robin): each equals the plain
    server's, streamed (the events passed through as they are) or not."""
    routed, plain = _both(servers)
    for extra in (QUIET, {}, QUIET):
        got = _respond(routed, input="Name a colour.", extra_body=extra)
        want = _respond(plain, input="Name a colour.", extra_body=extra)
        _same(got, want)
    kinds, final = [], []
    for c in (routed, plain):
        events = list(
            c.responses.create(
                model="m",
                input="Count to three.",
                max_output_tokens=10,
                temperature=0,
                stream=True,
                extra_body=QUIET,
            )  # fmt: skip
        )
        kinds.append([e.type for e in events])
        final.append(events[-1].response)
    assert kinds[0] == kinds[1] and kinds[0][-1] == "response.incomplete"
    _same(*final)
    got = final[0]
    assert _holders(servers, got.id) != []
    for name in ("prefill", "decode", "decode2"):
        wait_idle(servers[name].url)


def test_a_conversation_goes_on_where_its_responses_are_stored(servers):
    """previous_response_id, over three turns (reasoning items and instructions in them),
    streamed or not, equals the plain server's conversation; each continuation is stored
    where its previous response is, whichever decode server's turn it was."""
    routed, plain = _both(servers)
    first = [
        _respond(c, input="Hello there.", instructions="Be brief.", extra_body=QUIET)
        for c in (routed, plain)
    ]
    second = [_respond(c, input=[{"role": "user", "content": "And then?"}],
                       previous_response_id=r.id) for c, r in zip((routed, plain), first)]  # fmt: skip
    _same(*second)
    third = [
        c.responses.create(
            model="m",
            input="Why?",
            previous_response_id=r.id,
            max_output_tokens=8,
            temperature=0,
            stream=True,
            extra_body=QUIET,
        )  # fmt: skip
        for c, r in zip((routed, plain), second)
    ]
    done = [list(events)[-1].response for events in third]
    _same(*done)
    holders = {_holders(servers, r.id)[0] for r in (first[0], second[0], done[0])}
    assert len(holders) == 1
    # A conversation started on the other decode server goes on there
    other = _respond(routed, input="Hi.", extra_body=QUIET)
    if _holders(servers, other.id) == list(holders):
        other = _respond(routed, input="Hi.", extra_body=QUIET)
    assert _holders(servers, other.id) != list(holders)
    on = _respond(routed, input="Go on.", previous_response_id=other.id, extra_body=QUIET)
    assert _holders(servers, on.id) == _holders(servers, other.id)
    start = _respond(plain, input="Hi.", extra_body=QUIET)
    again = _respond(plain, input="Go on.", previous_response_id=start.id, extra_body=QUIET)
    _same(on, again, cached=False)


def test_a_fresh_router_continues_a_conversation(servers):
    """A router that never saw a conversation (restarted) continues it: it finds the decode
    server holding the previous response and rebuilds the prefill server's conversation
    from that server's input items and output; the same as the plain server's, and its
    input items the conversation's (through the router, as the decode server lists them)."""
    routed, plain = _both(servers)
    first = [_respond(c, input="Hello there.", instructions="Be brief.") for c in (routed, plain)]
    second = [
        _respond(c, input=[{"role": "user", "content": "And then?"}], previous_response_id=r.id,
                 extra_body=QUIET)
        for c, r in zip((routed, plain), first)
    ]  # fmt: skip
    app = build_router_app(
        [servers["prefill"].url], [servers["decode"].url, servers["decode2"].url]
    )
    server = uvicorn.Server(uvicorn.Config(app, port=free_port(), log_level="warning"))
    with running(server) as base:
        fresh = _client(base)
        third = [
            _respond(c, input="Why?", previous_response_id=r.id, extra_body=QUIET)
            for c, r in zip((fresh, plain), second)
        ]
        _same(*third)
        assert _holders(servers, third[0].id) == _holders(servers, first[0].id)
        items = [c.responses.input_items.list(third[0].id, limit=100) for c in (fresh, routed)]
        holder = _client(servers[_holders(servers, third[0].id)[0]].url)
        want = holder.responses.input_items.list(third[0].id, limit=100).model_dump()
        assert [page.model_dump() for page in items] == [want, want]
        ids = [i.id for i in items[0].data[::-1]]  # (oldest first)
        assert ids[1 : 1 + len(first[0].output)] == [o.id for o in first[0].output]
        assert len(ids) == 1 + len(first[0].output) + 1 + len(second[0].output) + 1


def test_stored_responses_are_retrieved_and_deleted_through_the_router(servers):
    routed, plain = _both(servers)
    created = _respond(routed, input="Remember me.", extra_body=QUIET)
    got = routed.responses.retrieve(created.id)
    assert got.model_dump() == created.model_dump()
    assert routed.responses.delete(created.id) is None  # (the SDK returns nothing)
    assert _holders(servers, created.id) == []
    for call in (routed.responses.retrieve, routed.responses.delete, routed.responses.cancel):
        with pytest.raises(openai.NotFoundError):
            call(created.id)
    # Unknown ids: the servers' 404, to the byte
    for method, path in (("GET", ""), ("DELETE", ""), ("POST", "/cancel")):
        answers = [
            httpx.request(method, f"{base}/v1/responses/resp_nobody{path}")
            for base in (servers["router"], servers["plain"].url)
        ]
        assert [a.status_code for a in answers] == [404, 404]
        assert answers[0].json() == answers[1].json()
    answers = [
        httpx.post(f"{base}/v1/responses", json={"input": "x", "previous_response_id": "resp_x"})
        for base in (servers["router"], servers["plain"].url)
    ]
    assert [a.status_code for a in answers] == [404, 404]
    assert answers[0].json() == answers[1].json()
    # A synchronous response cannot be cancelled: the decode server's 400
    with pytest.raises(openai.BadRequestError, match="synchronous"):
        routed.responses.cancel(_respond(routed, input="Hi.").id)


# Conversations whose turns go on across a response's end: the first response's input (its
# output one message, completed: `ONE_OF`), then the continuation's input and arguments.
ONE_OF = {
    "format": {"type": "json_schema", "name": "x", "schema": {"type": "string", "enum": ["a"]}}
}
CALL = [
    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "42"},
]
F = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
THOUGHT = {
    "type": "reasoning",
    "summary": [],
    "content": [{"type": "reasoning_text", "text": "hm"}],
}
ACROSS = {
    "call after a message": ("hi", CALL, {"tools": [F]}),
    "message after reasoning": ([{"role": "user", "content": "q"}, THOUGHT], "next", {}),
}


@pytest.mark.parametrize("case", ACROSS)
def test_turns_joined_across_a_response_end_through_the_router(servers, case):
    """A continuation whose turns join the previous response's (a call after its message,
    its message after the reasoning its input ended with): the prefill server's copy (the
    conversation's items as its input) is the decode server's prompt, token for token,
    and the response the plain server's."""
    first_input, then, kw = ACROSS[case]
    got = []
    for c in _both(servers):
        first = _respond(c, input=first_input, text=ONE_OF, extra_body=QUIET)
        assert first.status == "completed"
        got.append(_respond(c, input=then, previous_response_id=first.id, extra_body=QUIET, **kw))
    _same(*got)


def test_input_items_that_go_nowhere_are_a_502():
    """A decode server whose input_items pages lead back to themselves (one id twice, from
    before duplicates were refused): the router stops there, a 502, not a loop."""
    fake = FastAPI()
    item = {"id": "msg_1", "type": "message", "role": "user", "content": "x"}

    @fake.get("/v1/responses/{rid}")
    def response(rid: str) -> dict:
        return {"id": rid, "output": []}

    @fake.get("/v1/responses/{rid}/input_items")
    def input_items(rid: str) -> dict:
        return {"data": [item], "first_id": "msg_1", "last_id": "msg_1", "has_more": True}

    decode = uvicorn.Server(uvicorn.Config(fake, port=free_port(), log_level="warning"))
    with running(decode) as decode_url:
        app = build_router_app(["http://127.0.0.1:9"], [decode_url])  # (no prefill asked)
        server = uvicorn.Server(uvicorn.Config(app, port=free_port(), log_level="warning"))
        with running(server) as base:
            body = {"model": "m", "input": "x", "previous_response_id": "resp_1"}
            r = httpx.post(f"{base}/v1/responses", json=body, timeout=10)
    assert r.status_code == 502 and "endlessly" in r.json()["error"]["message"]


def test_a_background_responses_events_come_through_the_router_as_it_runs(servers):
    """GET ?stream=true through the router is passed on as the decode server writes it:
    the first event arrives while the response still runs."""
    routed = _client(servers["router"])
    r = routed.responses.create(
        model="m", input="Tell a long story.", background=True, max_output_tokens=1500,
        temperature=0, extra_body=QUIET,
    )  # fmt: skip
    holder = servers[_holders(servers, r.id)[0]].url
    try:
        url = f"{servers['router']}/v1/responses/{r.id}"
        with httpx.stream("GET", url, params={"stream": "true"}, timeout=60) as events:
            assert events.headers["content-type"].startswith("text/event-stream")
            first = next(events.iter_lines())
            status = httpx.get(f"{holder}/v1/responses/{r.id}").json()["status"]
        assert first == "event: response.created"
        assert status in ("queued", "in_progress")
    finally:
        httpx.post(f"{holder}/v1/responses/{r.id}/cancel")
        wait_idle(holder)


def test_a_request_id_is_taken_once_through_the_router(servers):
    """A client's request_id is refused (the servers' 400) while a request under it still
    runs (not stored yet: on whichever decode server the next one would go to)."""
    base = servers["router"]
    body = {"model": "m", "input": "Tell a long story.", "max_output_tokens": 1500,
            "temperature": 0, "request_id": "resp_once", **QUIET}  # fmt: skip
    decode = [servers[n].url for n in ("decode", "decode2")]
    with ThreadPoolExecutor(1) as pool:
        # (the client leaves after 5 s: the router ends the request)
        timeout = httpx.Timeout(60, read=5)
        first = pool.submit(httpx.post, f"{base}/v1/responses", json=body, timeout=timeout)
        deadline = time.monotonic() + 60
        while not any(scrape_metrics(u).get("dsakv_running_requests") for u in decode):
            assert time.monotonic() < deadline and not first.done()
            time.sleep(0.05)
        second = httpx.post(f"{base}/v1/responses", json=body, timeout=60)
        with contextlib.suppress(httpx.ReadTimeout):  # (or it ended first: 1500 tokens)
            first.result()
    assert second.status_code == 400, second.text[:200]
    assert second.json()["error"]["param"] == "request_id"
    assert "exists already" in second.json()["error"]["message"]
    for u in decode:
        wait_idle(u)


def test_a_clients_id_is_an_id_not_a_path_and_one_too_long_the_servers_400(servers):
    """previous_response_id and request_id go into the URLs the router asks the decode
    servers, quoted: "../../v1/models" fetched a decode server's /v1/models (its 404 named
    the model), a NUL was a 500; one with a "/" is not asked for (its "%2F" is decoded
    there: "{id}/input_items" was a held response's items), nor "." or ".." (path steps
    however quoted: "/v1/responses/.." is /v1). An id longer than the servers
    take (512 characters) is theirs to refuse, not looked up (70,000 characters: too long
    a URL, a 500)."""
    base = servers["router"]
    held = _respond(_client(base), input="Hi.", extra_body=QUIET).id
    body = {"model": "m", "input": "Hi.", "max_output_tokens": 2}
    for previous in ("../../v1/models", "a\x00b", f"{held}/input_items", ".", ".."):
        r = httpx.post(f"{base}/v1/responses", json={**body, "previous_response_id": previous},
                       timeout=60)  # fmt: skip
        assert r.status_code == 404, r.text
        assert r.json()["error"]["param"] == "previous_response_id", r.text
    for name in ("previous_response_id", "request_id"):
        r = httpx.post(f"{base}/v1/responses", json={**body, name: "r" * 70_000}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text[:300]


def _fresh_router(servers, decode: list[str]) -> uvicorn.Server:
    app = build_router_app([servers["prefill"].url], [servers[n].url for n in decode])
    return uvicorn.Server(uvicorn.Config(app, port=free_port(), log_level="warning"))


def test_a_fresh_router_refuses_a_request_id_a_decode_server_holds(servers):
    """A router that does not know a response (restarted, or another router took it) asks
    the decode servers before a client's request_id goes to one that does not hold it."""
    taken = _respond(_client(servers["router"]), input="Hi.", extra_body=QUIET).id
    with running(_fresh_router(servers, ["decode", "decode2"])) as base:
        body = {"model": "m", "input": "Hi.", "max_output_tokens": 2, "request_id": taken}
        answers = [httpx.post(f"{base}/v1/responses", json=body, timeout=60) for _ in range(2)]
    assert [a.status_code for a in answers] == [400, 400]  # (round robin: both servers)
    assert {a.json()["error"]["param"] for a in answers} == {"request_id"}
    assert len(_holders(servers, taken)) == 1


def test_a_servers_refusal_does_not_make_it_the_holder(servers):
    """A router that does not know a response asks each decode server: one that refuses
    the request (a bad limit) is not the one holding it; the holder is found after."""
    rid = _respond(_client(servers["router"]), input="Hi.", extra_body=QUIET).id
    holder = _holders(servers, rid)[0]
    other = "decode2" if holder == "decode" else "decode"
    with running(_fresh_router(servers, [other, holder])) as base:
        url = f"{base}/v1/responses/{rid}"
        bad = httpx.get(f"{url}/input_items", params={"limit": 500}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"
        assert httpx.get(url, timeout=60).status_code == 200
        on = _respond(_client(base), input="Go on.", previous_response_id=rid, extra_body=QUIET)
    assert _holders(servers, on.id) == [holder]
