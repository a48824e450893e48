"""OpenAI's Batch API through `dsakv router` (`dsakv.server.batch` on the router's app), over
a prefill/decode pair behind it (in this process, on loopback, glm-tiny on the CPU), every
one behind the same API key: the openai client's files/batches flow, each output or error
line what the same request gets from the router directly (its lines go through the
router's routes with the batch creator's key, relayed to both servers); a streamed line
refused; as many lines in flight as the decode servers run at once; cancel, which ends
a line on both servers."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient

from dsakv.disagg.router import Router, build_router_app
from dsakv.engine import EngineConfig
from dsakv.procs import free_port
from dsakv.server import batch as batch_module
from dsakv.server.batch import BatchLine, BatchRunner
from dsakv.server.protocol import error_body

from .serving import (
    NO_THINKING,
    TIMEOUT,
    answer_of,
    batch_lines,
    batch_until,
    engine_stops_stepping_at,
    engine_thread_held,
    routing,
    running,
    scrape_metrics,
    serving_disagg,
)

KEY = "router-batch-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = {"temperature": 0, "ignore_eos": True}


def _chat(text: str, max_tokens: int = 4, **extra: Any) -> dict:
    messages = [{"role": "user", "content": text}]
    return {"messages": messages, "max_tokens": max_tokens, **NO_THINKING, **GREEDY, **extra}


@pytest.fixture(scope="module")
def pd(glm_tiny) -> Iterator[SimpleNamespace]:
    """A prefill server and a decode server (each running 2 requests at most), the router in
    front, all behind `KEY`."""
    conf = EngineConfig(glm_tiny, device="cpu", num_pages=64, page_size=16,
                        kv_cache_dtype="fp32", index_k_dtype="fp32",
                        max_running_requests=2)  # fmt: skip
    with ExitStack() as stack:
        p_url, prefill = stack.enter_context(serving_disagg(conf, "prefill", api_key=KEY))
        d_url, decode = stack.enter_context(serving_disagg(conf, "decode", api_key=KEY))
        router = stack.enter_context(routing([p_url], [d_url], api_key=KEY))
        yield SimpleNamespace(
            router=router, prefill_url=p_url, prefill=prefill, decode_url=d_url, decode=decode
        )


@pytest.fixture(scope="module")
def client(pd) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{pd.router}/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)


def _batch(client: openai.OpenAI, url: str, lines: dict[str, dict]):
    """A batch of `lines` (custom_id: body) to `url`, created from an uploaded file."""
    rows = [{"custom_id": c, "method": "POST", "url": url, "body": b} for c, b in lines.items()]
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    up = client.files.create(file=("batch.jsonl", data), purpose="batch")
    assert client.files.content(up.id).content == data
    return client.batches.create(input_file_id=up.id, endpoint=url, completion_window="24h")


def _load(base: str) -> int:
    return httpx.get(f"{base}/load", timeout=TIMEOUT).json()["server_load"]


@pytest.mark.parametrize(
    "url, lines",
    [
        (
            "/v1/chat/completions",
            {
                "hi": _chat("Hi there", 5),
                "bye": _chat("Bye", 3),
                "no-messages": {"max_tokens": 2},
                "other-model": _chat("Hi", model="nope"),
            },
        ),
        (
            "/v1/completions",
            {
                "two-prompts": {"prompt": ["The cat", "A dog ran"], "max_tokens": 4, **GREEDY},
                "logprobs": {"prompt": "Hello", "max_tokens": 3, "logprobs": 2, **GREEDY},
                "too-long": {"prompt": "x", "max_tokens": 5000},
            },
        ),
    ],
)
def test_each_line_is_answered_as_the_router_answers_it(client, pd, url, lines):
    created = _batch(client, url, {**lines, "streamed": {**_chat("Hi"), "stream": True}})
    done = batch_until(client, created.id, "completed", "failed")
    assert done.status == "completed", done.errors
    total = len(lines) + 1
    ran = batch_lines(client, done.output_file_id) + batch_lines(client, done.error_file_id)
    assert sorted(x["custom_id"] for x in ran) == sorted([*lines, "streamed"])
    assert done.request_counts.completed + done.request_counts.failed == total
    by_id = {x["custom_id"]: x for x in ran}
    streamed = by_id.pop("streamed")
    assert streamed["response"]["status_code"] == 400
    assert streamed["error"]["param"] == "stream"
    answered = 0
    for custom_id, line in by_id.items():
        direct = httpx.post(f"{pd.router}{url}", json=lines[custom_id], headers=AUTH,
                            timeout=TIMEOUT)  # fmt: skip
        assert line["response"]["status_code"] == direct.status_code, (custom_id, line)
        if direct.status_code == 200:
            answered += 1
            assert line["error"] is None
            assert answer_of(line["response"]["body"]) == answer_of(direct.json()), custom_id
        else:
            assert line["error"] == direct.json()["error"], custom_id
    assert done.request_counts.completed == answered >= 2
    assert done.model == client.models.list().data[0].id  # (the servers': asked as it began)


def test_a_routers_batch_errors_do_not_say_server(client):
    """The Batch API's errors are the router's own: their words fit it as a server's."""
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError) as f:
        up = client.files.create(file=("x.jsonl", b"{}\n"), purpose="batch")
        client.batches.create(
            input_file_id=up.id, endpoint="/v1/embeddings", completion_window="24h"
        )
    for err in (e.value, f.value):
        assert "server" not in err.message, err.message


def test_the_batch_routes_need_the_routers_key(pd):
    keyless = openai.OpenAI(base_url=f"{pd.router}/v1", api_key="wrong", timeout=TIMEOUT)
    with pytest.raises(openai.AuthenticationError):
        keyless.files.create(file=("x.jsonl", b"{}\n"), purpose="batch")
    with pytest.raises(openai.AuthenticationError):
        keyless.batches.list()


def test_a_batch_keeps_only_what_the_decode_servers_run_in_flight(client, pd):
    """The decode server runs 2 requests at once (its /server_info's max_running_requests):
    once the batch's first two hold there (its engine stepping them no further), the third
    is not sent; a cancel aborts the two, and every line is the cancel's error line."""
    body = {"prompt": "x", "max_tokens": 200, **GREEDY}

    def held() -> bool:  # (two in the engine, each stepped as far as it will be)
        def look(engine) -> bool:
            reqs = list(engine.requests.values())
            return len(reqs) == 2 and all(len(r.output_ids) >= 2 for r in reqs)

        return _load(pd.decode_url) == 2 and asyncio.run(pd.decode.call(look))

    with engine_stops_stepping_at(pd.decode, 2):
        created = _batch(client, "/v1/completions", {c: body for c in "xyz"})
        deadline = time.monotonic() + TIMEOUT
        while not held():
            assert time.monotonic() < deadline, client.batches.retrieve(created.id)
            time.sleep(0.05)
        assert _load(pd.decode_url) == 2  # (z is not sent)
        assert client.batches.retrieve(created.id).request_counts.completed == 0
        cancelling = client.batches.cancel(created.id)
        assert cancelling.status == "cancelling"
        done = batch_until(client, created.id, "cancelled")
    errors = batch_lines(client, done.error_file_id)
    assert [x["custom_id"] for x in errors] == ["x", "y", "z"]
    assert {x["error"]["code"] for x in errors} == {"batch_cancelled"}
    deadline = time.monotonic() + TIMEOUT
    while _load(pd.decode_url) != 0:  # (the decode server saw the router hang up: aborted)
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_cancel_hangs_up_on_the_prefill_server_too(client, pd):
    """A line cancelled while its prefill server has not run it yet (its engine held): the
    router hangs up on both servers, as for a client that left, so the prefill server
    drops its copy at once (not once it has run it, for a decode server that has gone)."""
    body = {"prompt": "x", "max_tokens": 4, **GREEDY}
    # (the router learns the prefill server's bootstrap port first: asked with its engine
    # held, the server would not answer)
    direct = httpx.post(f"{pd.router}/v1/completions", json=body, headers=AUTH, timeout=TIMEOUT)
    assert direct.status_code == 200, direct.text
    with engine_thread_held(pd.prefill):  # (for TIMEOUT at most: all this within half)
        deadline = time.monotonic() + TIMEOUT / 2
        created = _batch(client, "/v1/completions", {"x": body})
        while _load(pd.prefill_url) != 1 or _load(pd.decode_url) != 1:
            got = client.batches.retrieve(created.id)
            assert got.request_counts.failed == 0, batch_lines(client, got.error_file_id)
            assert time.monotonic() < deadline, got
            time.sleep(0.05)
        client.batches.cancel(created.id)
        done = batch_until(client, created.id, "cancelled")
        while _load(pd.prefill_url) or _load(pd.decode_url):
            assert time.monotonic() < deadline, "a server kept the cancelled line's request"
            time.sleep(0.05)
    errors = batch_lines(client, done.error_file_id)
    assert [x["error"]["code"] for x in errors] == ["batch_cancelled"]


def test_a_stopping_router_ends_its_batches_and_hangs_up_their_lines(pd):
    """A router stopping mid-batch (it had no lifespan) left its batches to the event loop's
    end and its HTTP client open. Now it stops them as a server does (`Batches.stop`: each
    run cancelled, its lines hung up on both servers), then closes its client."""
    app = build_router_app([pd.prefill_url], [pd.decode_url], api_key=KEY)
    server = uvicorn.Server(uvicorn.Config(app, port=free_port(), log_level="warning"))
    body = {"prompt": "x", "max_tokens": 200, **GREEDY}
    with engine_stops_stepping_at(pd.decode, 2):  # (the lines can only end by an abort)
        with running(server) as base:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, timeout=TIMEOUT)
            created = _batch(client, "/v1/completions", {c: body for c in "xy"})
            deadline = time.monotonic() + TIMEOUT
            while _load(pd.decode_url) != 2:
                assert time.monotonic() < deadline, client.batches.retrieve(created.id)
                time.sleep(0.05)
            client.close()
        batch = app.state.batches.batches[created.id]
        assert batch.task.cancelled() and batch.info["status"] == "in_progress"
        deadline = time.monotonic() + TIMEOUT
        while _load(pd.decode_url) or _load(pd.prefill_url):
            assert time.monotonic() < deadline, "a server kept a stopped batch's line"
            time.sleep(0.05)
    assert app.state.router._client is None  # (closed)


def test_an_unexpected_error_in_a_router_route_is_a_json_500(monkeypatch):
    """A bug inside a router route was Starlette's plain-text 500: a client got no error
    object, a batch line "the route answered 500 without a JSON body". Now it is a
    server's JSON 500 (Anthropic's shape on its routes)."""

    async def broken(*_: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(Router, "generate", broken)
    monkeypatch.setattr(Router, "one", broken)
    app = build_router_app(["http://127.0.0.1:9"], ["http://127.0.0.1:10"])  # (never asked)
    client = TestClient(app, raise_server_exceptions=False)
    r = client.post("/v1/chat/completions", json=_chat("Hi"))
    assert r.status_code == 500
    assert r.json() == error_body("internal error: boom", "server_error")
    r = client.post("/v1/messages/count_tokens", json={})
    assert r.status_code == 500
    assert r.json() == {
        "type": "error",
        "error": {"type": "api_error", "message": "internal error: boom"},
    }
    line = BatchLine("a", "POST", "/v1/chat/completions", _chat("Hi"))
    output = asyncio.run(BatchRunner(app).run_line(line))
    assert output["response"]["status_code"] == 500
    assert output["error"]["message"] == "internal error: boom"


def test_a_pd_server_runs_no_batches_but_names_the_router(pd):
    for base in (pd.prefill_url, pd.decode_url):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:
            client.batches.create(
                input_file_id="file-x", endpoint="/v1/completions", completion_window="24h"
            )
        assert e.value.status_code == 501, base
        assert e.value.body["code"] == "not_implemented", e.value.body
        assert "dsakv router" in e.value.body["message"], e.value.body


def test_sglangs_engine_type_is_each_servers_role(pd):
    for role, base in (("prefill", pd.prefill_url), ("decode", pd.decode_url)):
        samples = scrape_metrics(base, labels=True)
        types = {
            dict(labels).get("engine_type")
            for name, labels in samples
            if name.startswith("sglang:")
        }
        types.discard(None)  # (its cache_config_info: the KV layout only)
        assert types == {role}, (base, types)


def test_a_batch_runs_when_no_server_answers_its_model(monkeypatch):
    """A router's batch asks its servers' /v1/models as it starts, for its `model`: a server
    that takes the connection and never answers leaves it without one (after a while),
    its lines run all the same. (It guards that bound, `_MODEL_ASK_S`: a batch learning
    its `model` from its servers at all is tested elsewhere, and a tree without that
    passes here too.)"""
    monkeypatch.setattr(batch_module, "_MODEL_ASK_S", 0.05)
    sent: list[str] = []

    async def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            await asyncio.Event().wait()  # (a server stopped: connected, never answering)
        if request.url.path == "/server_info":
            return httpx.Response(200, json={"max_running_requests": 8})
        if request.url.path == "/disagg/info":
            return httpx.Response(200, json={"mode": "prefill", "bootstrap_port": 9})
        sent.append(f"{request.url.host}{request.url.path}")
        return httpx.Response(200, json={"id": "x", "choices": []})

    async def ran() -> Any:
        app = build_router_app(["http://p:1"], ["http://d:1"])
        app.state.router._client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app))
        client = openai.AsyncOpenAI(base_url="http://r/v1", api_key="x", http_client=http)
        row = {"custom_id": "0", "method": "POST", "url": "/v1/completions",
               "body": {"model": "m", "prompt": "hi", "max_tokens": 1}}  # fmt: skip
        up = await client.files.create(file=("b.jsonl", json.dumps(row).encode()), purpose="batch")
        created = await client.batches.create(
            input_file_id=up.id, endpoint="/v1/completions", completion_window="24h"
        )
        deadline = time.monotonic() + TIMEOUT
        ended = ("completed", "failed", "cancelled")
        while (got := await client.batches.retrieve(created.id)).status not in ended:
            assert time.monotonic() < deadline, got
            await asyncio.sleep(0.01)
        await http.aclose()
        await app.state.router.close()
        return got

    got = asyncio.run(ran())
    assert got.status == "completed" and got.model is None, got
    assert got.request_counts.model_dump() == {"total": 1, "completed": 1, "failed": 0}
    assert sorted(sent) == ["d/v1/completions", "p/v1/completions"]  # (its line, relayed)


def test_a_batch_cancelled_while_the_router_asks_its_servers_sends_no_line():
    """Before a batch's lines go, the router asks its decode servers how many requests
    they run (/server_info, up to its timeout): a cancel meanwhile ends the batch with no
    line sent (it waited for their answer, then sent every line, each then cancelled)."""
    asked, release = asyncio.Event(), asyncio.Event()
    sent: list[str] = []

    async def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/server_info":
            asked.set()
            await release.wait()
            return httpx.Response(200, json={"max_running_requests": 8})
        if request.url.path == "/disagg/info":
            return httpx.Response(200, json={"mode": "prefill", "bootstrap_port": 9})
        if request.url.path == "/v1/models":  # (the batch's model, asked as it starts)
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m"}]})
        sent.append(f"{request.url.host}{request.url.path}")
        return httpx.Response(200, json={"id": "x", "choices": []})

    async def cancelled() -> list[dict]:
        app = build_router_app(["http://p:1"], ["http://d:1"])
        app.state.router._client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app))
        client = openai.AsyncOpenAI(base_url="http://r/v1", api_key="x", http_client=http)
        body = {"model": "m", "prompt": "hi", "max_tokens": 1}
        rows = [{"custom_id": str(i), "method": "POST", "url": "/v1/completions", "body": body}
                for i in range(4)]  # fmt: skip
        data = "".join(json.dumps(r) + "\n" for r in rows).encode()
        up = await client.files.create(file=("batch.jsonl", data), purpose="batch")
        created = await client.batches.create(
            input_file_id=up.id, endpoint="/v1/completions", completion_window="24h"
        )
        await asyncio.wait_for(asked.wait(), TIMEOUT)
        assert (await client.batches.cancel(created.id)).status == "cancelling"
        release.set()  # (the servers answer: the batch is cancelled all the same)
        deadline = time.monotonic() + TIMEOUT
        while (got := await client.batches.retrieve(created.id)).status == "cancelling":
            assert time.monotonic() < deadline, got
            await asyncio.sleep(0.01)
        assert got.status == "cancelled" and got.output_file_id is None, got
        errors = (await client.files.content(got.error_file_id)).text
        await http.aclose()
        await app.state.router.close()
        return [json.loads(x) for x in errors.splitlines()]

    errors = asyncio.run(cancelled())
    assert [x["error"]["code"] for x in errors] == ["batch_cancelled"] * 4
    assert sent == []
