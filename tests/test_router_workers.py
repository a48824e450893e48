"""Workers joining and leaving `dsakv router` while it runs, through SGLang Model Gateway's
worker API (`POST /workers`, `GET /workers`, `GET` / `DELETE /workers/{url}`) and its older
router's `/add_worker`, `/remove_worker`, `/list_workers`: a prefill server and two decode
servers on loopback (all in this process, glm-tiny on the CPU), the router started with one
pair. A decode server added takes its turn with the same greedy answers; one removed gets no
new request, finishes the stream it was sending, and the responses it stores are forgotten;
every refusal is a 4xx in the servers' error shape (a server with another KV layout too); an
abort still reaches a removed server's stream; with no decode server left a request is a
503 naming it; one server is one worker whatever the spelling of its URL; with `--api-key`,
the worker API needs the key as the rest of the router does; the router starts with no
server (or none of a kind) and serves once a pair is added; of two adds racing with no
server registered, the second is checked against the first; adds at once past a server
that never answers wait for it together, not in turn."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from types import SimpleNamespace
from urllib.parse import quote, urlsplit

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from dsakv.disagg import router as router_module
from dsakv.disagg.router import build_router_app
from dsakv.engine import EngineConfig
from dsakv.errors import DsakvError
from dsakv.models.tiny import write_tiny_model
from dsakv.procs import stop_process
from dsakv.server.app import build_app

from .serving import (
    TIMEOUT,
    engine_stops_stepping_at,
    free_port,
    routing,
    running,
    serving_disagg,
    until_in_flight,
)

PROMPT = "The quick brown fox jumps over the lazy dog."
GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 4}


@pytest.fixture(scope="module")
def pd(tmp_path_factory) -> Iterator[SimpleNamespace]:
    """A prefill server, two decode servers (the second not yet the router's), the router
    over the first pair; `want`: the pair's greedy completion of PROMPT."""
    model = str(write_tiny_model(tmp_path_factory.mktemp("workers") / "m", "glm-tiny"))
    conf = EngineConfig(model, device="cpu", num_pages=64, page_size=16,
                        kv_cache_dtype="fp32", index_k_dtype="fp32")  # fmt: skip
    bport = free_port()
    with ExitStack() as stack:
        prefill, _ = stack.enter_context(serving_disagg(conf, "prefill", bootstrap_port=bport))
        decode, _ = stack.enter_context(serving_disagg(conf, "decode"))
        decode2, engine2 = stack.enter_context(serving_disagg(conf, "decode"))
        router = stack.enter_context(routing([prefill], [decode]))
        yield SimpleNamespace(
            router=router, prefill=prefill, decode=decode, decode2=decode2, engine2=engine2,
            bootstrap_port=bport, want=_complete(router), conf=conf,
        )  # fmt: skip


@pytest.fixture
def restored(pd) -> Iterator[None]:
    """The router over its first pair again after the test, whatever it changed."""
    yield
    for url in (pd.decode2, pd.prefill, pd.decode):
        _delete(pd.router, url)
    for url in (pd.prefill, pd.decode):
        r = _add(pd.router, url=url)
        assert r.status_code == 200, r.text


def _complete(base: str, prompt: str = PROMPT, **kw) -> str:
    body = {"prompt": prompt, **GREEDY}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT, **kw)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _served(url: str, endpoint: str = "/v1/completions") -> int:
    """The requests to `endpoint` a server answered 200 (its own HTTP counter)."""
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    return sum(
        int(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "dsakv_http_requests_total"
        and s.labels == {"endpoint": endpoint, "status": "200"}
    )


def _add(base: str, headers: dict[str, str] | None = None, **spec) -> httpx.Response:
    return httpx.post(f"{base}/workers", json=spec, headers=headers, timeout=TIMEOUT)


def _delete(base: str, url: str, **kw) -> httpx.Response:
    return httpx.delete(f"{base}/workers/{quote(url, safe='')}", timeout=TIMEOUT, **kw)  # (escaped)


def _listed(base: str, **kw) -> list[tuple[str, str]]:
    got = httpx.get(f"{base}/workers", timeout=TIMEOUT, **kw).json()
    assert got["total"] == len(got["workers"])
    return [(w["worker_type"], w["url"]) for w in got["workers"]]


def _refusal(r: httpx.Response, status: int, param: str | None, code: str | None = None) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    return error["message"]


def test_a_decode_server_added_takes_its_turn_and_one_removed_gets_no_more(pd, restored):
    """POST /workers: the next requests alternate over both decode servers, the answers the
    single pair's; DELETE: the removed one gets none of the next, and is no longer listed."""
    r = _add(pd.router, url=pd.decode2 + "/", worker_type="decode")  # (its trailing slash goes)
    assert r.status_code == 200, r.text
    got = r.json()
    assert (
        got["success"] is True
        and got["message"] == f"Successfully added decode server: {pd.decode2}"
    )
    assert {k: got["worker"][k] for k in ("url", "worker_type", "is_healthy")} == {
        "url": pd.decode2, "worker_type": "decode", "is_healthy": True,
    }  # fmt: skip
    assert _listed(pd.router) == [
        ("prefill", pd.prefill),
        ("decode", pd.decode),
        ("decode", pd.decode2),
    ]
    stats = httpx.get(f"{pd.router}/workers", timeout=TIMEOUT).json()["stats"]
    assert (stats["prefill_count"], stats["decode_count"]) == (1, 2)
    before = _served(pd.decode), _served(pd.decode2)
    assert [_complete(pd.router) for _ in range(4)] == [pd.want] * 4
    assert (_served(pd.decode) - before[0], _served(pd.decode2) - before[1]) == (2, 2)
    # SGLang's /get_load names the new server too
    loads = httpx.get(f"{pd.router}/get_load", timeout=TIMEOUT).json()
    assert {e["worker"] for e in loads if e["worker_type"] == "decode"} == {pd.decode, pd.decode2}

    r = httpx.get(f"{pd.router}/workers/{pd.decode2}", timeout=TIMEOUT)  # (not escaped)
    assert r.status_code == 200 and r.json()["worker_type"] == "decode", r.text
    r = _delete(pd.router, pd.decode2)
    assert r.status_code == 200, r.text
    assert r.json() == {
        "success": True,
        "message": f"Successfully removed decode server: {pd.decode2}",
    }
    before = _served(pd.decode), _served(pd.decode2)
    assert [_complete(pd.router) for _ in range(3)] == [pd.want] * 3
    assert (_served(pd.decode) - before[0], _served(pd.decode2) - before[1]) == (3, 0)
    assert _listed(pd.router) == [("prefill", pd.prefill), ("decode", pd.decode)]
    r = httpx.get(f"{pd.router}/workers/{quote(pd.decode2, safe='')}", timeout=TIMEOUT)
    _refusal(r, 404, "url", "WORKER_NOT_FOUND")


def test_a_removed_decode_server_finishes_the_stream_it_is_sending(pd, restored):
    """A stream in flight on a decode server is not cut when the server leaves: it ends
    with the whole answer; the next request goes to the server that stays."""
    assert _add(pd.router, url=pd.decode2, worker_type="decode").status_code == 200
    assert _delete(pd.router, pd.decode).status_code == 200  # (so decode2 takes the stream)
    body = {"prompt": PROMPT, **GREEDY, "stream": True}

    def stream() -> str:
        with httpx.stream("POST", f"{pd.router}/v1/completions", json=body, timeout=TIMEOUT) as r:
            assert r.status_code == 200
            lines = [x for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
        return "".join(json.loads(x[6:])["choices"][0]["text"] for x in lines)

    with ThreadPoolExecutor(1) as pool:
        with engine_stops_stepping_at(pd.engine2, 2):
            held = pool.submit(stream)
            until_in_flight(pd.decode2, held)
            assert _add(pd.router, url=pd.decode, worker_type="decode").status_code == 200
            assert _delete(pd.router, pd.decode2).status_code == 200
            assert not held.done()
        assert held.result() == pd.want
    before = _served(pd.decode2)
    assert _complete(pd.router) == pd.want
    assert _served(pd.decode2) == before


def test_an_abort_reaches_a_removed_server_until_its_stream_ends(pd, restored):
    """/abort_request (as every admin call the router fans out) still reaches a removed
    decode server while a request through the router streams from it: the stream ends
    with finish_reason "abort"; once it has ended, the server is no longer asked. (The
    abort answered 200 having reached only the servers the router still had, and the
    stream ran to `length`.)"""
    assert _add(pd.router, url=pd.decode2, worker_type="decode").status_code == 200
    assert _delete(pd.router, pd.decode).status_code == 200  # (so decode2 takes the stream)
    body = {"prompt": PROMPT, **GREEDY, "max_tokens": 16, "stream": True}
    named = {"X-Request-Id": "removed-abort"}

    def stream() -> str:
        with httpx.stream("POST", f"{pd.router}/v1/completions", json=body, headers=named,
                          timeout=TIMEOUT) as r:  # fmt: skip
            assert r.status_code == 200
            chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        return chunks[-1]["choices"][0]["finish_reason"]

    with ThreadPoolExecutor(1) as pool:
        with engine_stops_stepping_at(pd.engine2, 2):
            held = pool.submit(stream)
            until_in_flight(pd.decode2, held)
            assert _add(pd.router, url=pd.decode, worker_type="decode").status_code == 200
            assert _delete(pd.router, pd.decode2).status_code == 200
            abort = {"rid": "removed-abort"}
            r = httpx.post(f"{pd.router}/abort_request", json=abort, timeout=TIMEOUT)
            assert r.status_code == 200, r.text
        assert held.result() == "abort"
    asked = _served(pd.decode2, "/abort_request")
    r = httpx.post(f"{pd.router}/abort_request", json=abort, timeout=TIMEOUT)
    assert r.status_code == 200 and _served(pd.decode2, "/abort_request") == asked, r.text


def test_a_server_with_another_kv_layout_is_refused(pd):
    """A server whose /disagg/info tells another KV layout than the deployment's servers
    (here: another page size) is the 400 naming what differs, as the handoff's 502 would
    have for every request it shared with another server; nothing is added."""
    conf = dataclasses.replace(pd.conf, page_size=32)
    with serving_disagg(conf, "decode") as (odd, _):
        try:
            message = _refusal(_add(pd.router, url=odd, worker_type="decode"), 400, "url")
        finally:
            _delete(pd.router, odd)  # (were it added)
    assert "different KV layouts: fingerprint: " in message and odd in message, message
    assert _listed(pd.router) == [("prefill", pd.prefill), ("decode", pd.decode)]


def test_responses_stored_on_a_removed_server_are_forgotten(pd, restored):
    """The router finds a response on the decode server that stored it; once that server
    leaves, the router asks only those it has: the id is their 404."""
    assert _add(pd.router, url=pd.decode2, worker_type="decode").status_code == 200
    body = {"input": "Say something.", "max_output_tokens": 2, "temperature": 0}
    on_decode2 = None
    for _ in range(2):  # (round robin: one of two lands on decode2)
        r = httpx.post(f"{pd.router}/v1/responses", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        if httpx.get(f"{pd.decode2}/v1/responses/{rid}", timeout=TIMEOUT).status_code == 200:
            on_decode2 = rid
    assert on_decode2 is not None
    assert httpx.get(f"{pd.router}/v1/responses/{on_decode2}", timeout=TIMEOUT).status_code == 200
    assert _delete(pd.router, pd.decode2).status_code == 200
    r = httpx.get(f"{pd.router}/v1/responses/{on_decode2}", timeout=TIMEOUT)
    assert r.status_code == 404, r.text
    assert httpx.get(f"{pd.decode2}/v1/responses/{on_decode2}", timeout=TIMEOUT).status_code == 200


def test_sglangs_older_query_string_calls(pd, restored):
    """/add_worker?url= (the server's mode decides its kind) and /remove_worker?url= answer
    in plain text, as SGLang's router did; /list_workers is {"urls": [...]}."""
    r = httpx.post(f"{pd.router}/add_worker", params={"url": pd.decode2}, timeout=TIMEOUT)
    assert (r.status_code, r.text) == (200, f"Successfully added decode server: {pd.decode2}")
    assert r.headers["content-type"].startswith("text/plain")
    r = httpx.get(f"{pd.router}/list_workers", timeout=TIMEOUT)
    assert r.json() == {"urls": [pd.prefill, pd.decode, pd.decode2]}
    r = httpx.post(f"{pd.router}/add_worker", params={"url": pd.decode2}, timeout=TIMEOUT)
    _refusal(r, 409, "url", "WORKER_ALREADY_EXISTS")
    r = httpx.post(f"{pd.router}/remove_worker", params={"url": pd.decode2}, timeout=TIMEOUT)
    assert (r.status_code, r.text) == (200, f"Successfully removed decode server: {pd.decode2}")
    assert httpx.get(f"{pd.router}/list_workers", timeout=TIMEOUT).json() == {
        "urls": [pd.prefill, pd.decode]
    }
    r = httpx.post(f"{pd.router}/remove_worker", params={"url": pd.decode2}, timeout=TIMEOUT)
    _refusal(r, 404, "url", "WORKER_NOT_FOUND")
    _refusal(httpx.post(f"{pd.router}/add_worker", timeout=TIMEOUT), 400, "url")


def test_every_refusal_names_what_is_wrong_and_changes_nothing(pd):
    down = f"http://127.0.0.1:{free_port()}"
    netloc = urlsplit(pd.decode2).netloc
    cases = [
        ({"url": pd.decode2, "worker_type": "regular"}, 400, "worker_type", None, "'regular'"),
        (
            {"url": pd.decode2, "worker_type": "prefill"},
            400,
            "worker_type",
            None,
            "a decode server",
        ),
        (
            {"url": pd.decode, "worker_type": "decode"},
            409,
            "url",
            "WORKER_ALREADY_EXISTS",
            "already",
        ),
        ({"url": pd.prefill}, 409, "url", "WORKER_ALREADY_EXISTS", "a prefill worker already"),
        ({"url": down, "worker_type": "decode"}, 400, "url", None, down),
        ({"url": "ftp://127.0.0.1:1"}, 400, "url", None, "http(s)://HOST[:PORT]"),
        ({"url": 8000}, 400, "url", None, "string"),
        (
            {"url": pd.router},
            400,
            "url",
            None,
            "not a prefill or decode server",
        ),  # (no /disagg/info)
        ({"url": pd.decode2, "bootstrap_port": 8998}, 400, "bootstrap_port", None, "not 8998"),
        ({"url": pd.decode2, "bootstrap_port": "x"}, 400, "bootstrap_port", None, "port number"),
        # SGLang's per-worker key: the router relays the client's instead
        ({"url": pd.decode2, "api_key": "k"}, 400, "api_key", None, "Authorization header"),
        # credentials (httpx's Basic auth in place of the client's key; listed for anyone),
        # a query or a fragment (every request a 404), port 0
        ({"url": f"http://u:secret@{netloc}"}, 400, "url", None, "no user or password"),
        ({"url": f"{pd.decode2}#x"}, 400, "url", None, "no query or fragment"),
        ({"url": f"{pd.decode2}?a=1"}, 400, "url", None, "no query or fragment"),
        ({"url": "http://127.0.0.1:0"}, 400, "url", None, "1..65535"),
        # a bracketed host that is no IPv6 address (urlsplit's ValueError was a 500)
        ({"url": "http://[::1"}, 400, "url", None, "http(s)://HOST[:PORT]"),
        ({"url": "http://[zz]:80"}, 400, "url", None, "http(s)://HOST[:PORT]"),
    ]
    for spec, status, param, code, said in cases:
        message = _refusal(_add(pd.router, **spec), status, param, code)
        assert said in message and "secret" not in message, (spec, message)
    r = httpx.post(f"{pd.router}/workers", content=b"[1]", timeout=TIMEOUT)
    assert (
        r.status_code == 400
        and r.json()["error"]["message"] == "request body must be a JSON object"
    )
    _refusal(_delete(pd.router, down), 404, "url", "WORKER_NOT_FOUND")
    for bad in ("http://[::1", "http://[zz]:80"):  # (no worker's, as `down` is none)
        r = httpx.post(f"{pd.router}/add_worker", params={"url": bad}, timeout=TIMEOUT)
        _refusal(r, 400, "url")
        r = httpx.post(f"{pd.router}/remove_worker", params={"url": bad}, timeout=TIMEOUT)
        _refusal(r, 404, "url", "WORKER_NOT_FOUND")
        _refusal(_delete(pd.router, bad), 404, "url", "WORKER_NOT_FOUND")
        r = httpx.get(f"{pd.router}/workers/{quote(bad, safe='')}", timeout=TIMEOUT)
        _refusal(r, 404, "url", "WORKER_NOT_FOUND")
    deep = b'{"url": ' + b"[" * 3000 + b"]" * 3000 + b"}"  # (a RecursionError: a 500)
    r = httpx.post(f"{pd.router}/workers", content=deep, timeout=TIMEOUT)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    assert _listed(pd.router) == [("prefill", pd.prefill), ("decode", pd.decode)]


def test_with_no_decode_or_prefill_server_left_a_request_is_a_503_naming_it(pd, restored):
    """Removing the last of a kind is allowed (as in SGLang's gateway); requests then get a
    503 naming what is missing, until one is added again. A prefill server comes back with
    its bootstrap port (a wrong one given is refused)."""
    assert _delete(pd.router, pd.decode).status_code == 200
    for path, body in [
        ("/v1/completions", {"prompt": PROMPT, **GREEDY}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], **GREEDY}),
        ("/v1/responses", {"input": "Hi", "previous_response_id": "resp_x"}),
    ]:
        r = httpx.post(f"{pd.router}{path}", json=body, timeout=TIMEOUT)
        assert r.status_code == 503, (path, r.text)
        assert r.json()["error"]["message"].startswith("no decode workers available"), r.text
    assert httpx.get(f"{pd.router}/v1/models", timeout=TIMEOUT).status_code == 503
    health = httpx.get(f"{pd.router}/health", timeout=TIMEOUT)
    assert health.status_code == 503 and "no decode worker" in health.json()["unhealthy"]

    assert _delete(pd.router, pd.prefill).status_code == 200
    r = httpx.post(
        f"{pd.router}/v1/completions", json={"prompt": PROMPT, **GREEDY}, timeout=TIMEOUT
    )
    assert r.status_code == 503
    assert r.json()["error"]["message"].startswith("no prefill and no decode workers available")
    assert _listed(pd.router) == []
    r = httpx.post(f"{pd.router}/flush_cache", timeout=TIMEOUT)  # (an admin call: to nobody)
    assert r.status_code == 503 and r.json()["error"] == {
        "message": "no workers available: add one (POST /workers)",
        "type": "server_error", "param": None, "code": "server_selection_failed",
    }, r.text  # fmt: skip

    wrong = pd.bootstrap_port + 1
    r = _add(pd.router, url=pd.prefill, worker_type="prefill", bootstrap_port=wrong)
    assert f"bootstrap port is {pd.bootstrap_port}" in _refusal(r, 400, "bootstrap_port")
    r = _add(pd.router, url=pd.prefill, worker_type="prefill", bootstrap_port=pd.bootstrap_port)
    assert r.status_code == 200 and r.json()["worker"]["bootstrap_port"] == pd.bootstrap_port
    assert _add(pd.router, url=pd.decode, worker_type="decode").status_code == 200
    assert _complete(pd.router) == pd.want


def test_a_stored_response_asked_with_no_decode_server_is_the_503(pd, restored):
    """GET, DELETE, cancel and input_items of a stored response with no decode server left
    are the 503 naming it, as a new response is (they were a 502 "no decode server holding
    resp_x answered: ", naming none, and counted as a failure)."""
    assert _delete(pd.router, pd.decode).status_code == 200
    for method, path in [
        ("GET", "/v1/responses/resp_x"),
        ("DELETE", "/v1/responses/resp_x"),
        ("POST", "/v1/responses/resp_x/cancel"),
        ("GET", "/v1/responses/resp_x/input_items"),
    ]:
        r = httpx.request(method, f"{pd.router}{path}", timeout=TIMEOUT)
        assert r.status_code == 503, (method, path, r.text)
        assert r.json()["error"]["message"].startswith("no decode workers available"), r.text


def test_one_server_is_one_worker_whatever_the_spelling_of_its_url(pd, restored):
    """A server registered already is the 409 under another spelling of its URL (scheme or
    host in capitals, a trailing slash, https for the port that serves http: one port is
    one server), and GET and DELETE /workers/{url} find it under any; it is listed, and
    added, under one spelling, its scheme's default port left out. (Each spelling was a
    worker of its own: the same server twice in the round robin, and never wholly removed
    but by the spelling it was added under.)"""
    port = urlsplit(pd.decode).port
    for spelling in (f"HTTP://127.0.0.1:{port}/", f"https://127.0.0.1:{port}"):
        message = _refusal(_add(pd.router, url=spelling), 409, "url", "WORKER_ALREADY_EXISTS")
        assert "a decode worker already" in message and pd.decode in message, message
    r = httpx.get(f"{pd.router}/workers/HTTP://127.0.0.1:{port}/", timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["url"] == pd.decode, r.text
    r = _delete(pd.router, f"http://127.0.0.1:{port}//")
    assert r.json()["message"] == f"Successfully removed decode server: {pd.decode}", r.text
    assert _listed(pd.router) == [("prefill", pd.prefill)]
    r = _add(pd.router, url=f"HTTP://127.0.0.1:{port}/", worker_type="decode")
    assert r.status_code == 200 and r.json()["worker"]["url"] == pd.decode, r.text
    assert _listed(pd.router) == [("prefill", pd.prefill), ("decode", pd.decode)]
    assert _complete(pd.router) == pd.want
    app = build_router_app(["HTTP://Prefill:80/"], ["https://[::1]:443", "https://d:80"])
    assert app.state.router.prefill == ["http://prefill"]
    assert app.state.router.decode == ["https://[::1]", "https://d:80"]
    # so too at the start: one given twice is refused, naming both spellings (it was twice in
    # the round robin, a prefill server a decode server too, and removed by one spelling only)
    for decode, named in [
        (["http://b:1", "https://B:1/"], "--decode http://b:1 and --decode https://B:1/"),
        (["http://b:1", "http://a:1"], "--prefill http://a:1 and --decode http://a:1"),
    ]:
        with pytest.raises(DsakvError, match=f"^{named} are one server"):
            build_router_app(["http://a:1"], decode)


def test_the_routers_api_key_guards_its_routes_and_the_worker_api(pd):
    """`dsakv router --api-key`: without the key, or with another, a completion and every
    worker call is the 401 `dsakv serve --api-key` answers, and no worker is added or
    removed; with it they work (the key relayed to the servers too); the probes stay open.
    (The router checked no key: anyone reaching its port could add a decode server of
    their own and be sent other clients' prompts.)"""
    key = {"Authorization": "Bearer sekret"}
    with routing([pd.prefill], [pd.decode], api_key="sekret") as base:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            for method, path, kw in [
                ("POST", "/v1/completions", {"json": {"prompt": PROMPT, **GREEDY}}),
                ("POST", "/workers", {"json": {"url": pd.decode2, "worker_type": "decode"}}),
                ("GET", "/workers", {}),
                ("DELETE", f"/workers/{quote(pd.decode, safe='')}", {}),
                ("POST", "/add_worker", {"params": {"url": pd.decode2}}),
                ("POST", "/remove_worker", {"params": {"url": pd.decode}}),
                ("GET", "/list_workers", {}),
            ]:
                r = httpx.request(method, f"{base}{path}", headers=headers, timeout=TIMEOUT, **kw)
                assert r.status_code == 401, (headers, method, path, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key", r.text
        for probe in ("/health", "/liveness", "/readiness"):  # (Kubernetes sends no key)
            assert httpx.get(f"{base}{probe}", timeout=TIMEOUT).status_code == 200, probe
        assert _listed(base, headers=key) == [("prefill", pd.prefill), ("decode", pd.decode)]
        assert _complete(base, headers=key) == pd.want
        r = _add(base, url=pd.decode2, worker_type="decode", headers=key)
        assert r.status_code == 200, r.text
        assert _delete(base, pd.decode2, headers=key).status_code == 200
        assert _listed(base, headers=key) == [("prefill", pd.prefill), ("decode", pd.decode)]


def test_a_key_no_client_can_send_is_refused_when_the_app_is_built(pd):
    """The router's and `dsakv serve`'s app builders refuse an empty key (it left every
    route open), one with a space or a character past visible ASCII (none could ever
    match; the router failed each request it relayed with a plain-text 500)."""
    for key in ("", " sekret", "sekret\n", "sekr\u00e9t"):
        with pytest.raises(DsakvError, match="an API key must"):
            build_router_app([pd.prefill], [pd.decode], api_key=key)
        with pytest.raises(DsakvError, match="an API key must"):
            build_app(pd.engine2, "m", api_key=key)


def _no_worker(r: httpx.Response, missing: str) -> None:
    """SGLang's gateway's 503 for a request needing servers the router has none of."""
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["message"].startswith(f"no {missing} workers available"), r.text
    assert error["code"] == "server_selection_failed", r.text


def test_the_cli_router_starts_with_no_server_and_serves_once_a_pair_is_added(pd):
    """`dsakv router` with neither --prefill nor --decode starts (an orchestrator adds the
    servers, as to SGLang's gateway): a completion is the 503 naming both kinds, /health
    the 503 naming them, the worker list empty; a prefill and a decode server added through
    POST /workers (their mode taken from /disagg/info) then serve the pair's answer. (Both
    flags were required: the CLI refused to start.)"""
    port = free_port()
    cmd = [sys.executable, "-m", "dsakv.cli", "router", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:  # (its port is taken before it serves: a request then waits)
            assert proc.poll() is None, proc.stderr.read()
            try:
                assert _listed(base) == []
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline, "the router did not start"
                time.sleep(0.05)
        body = {"prompt": PROMPT, **GREEDY}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
        _no_worker(r, "prefill and no decode")
        health = httpx.get(f"{base}/health", timeout=TIMEOUT)
        assert health.status_code == 503, health.text
        assert health.json()["unhealthy"] == ["no prefill worker", "no decode worker"]
        # SGLang Model Gateway's probes: alive, not ready
        assert httpx.get(f"{base}/liveness", timeout=TIMEOUT).status_code == 200
        assert httpx.get(f"{base}/readiness", timeout=TIMEOUT).status_code == 503
        for url in (pd.prefill, pd.decode):
            assert _add(base, url=url).status_code == 200
        assert _listed(base) == [("prefill", pd.prefill), ("decode", pd.decode)]
        assert _complete(base) == pd.want
        for probe in ("/health", "/readiness", "/liveness"):
            assert httpx.get(f"{base}{probe}", timeout=TIMEOUT).status_code == 200, probe
    finally:
        stop_process(proc)
        proc.stderr.close()


def test_a_router_started_with_one_kind_serves_once_the_other_is_added(pd):
    """A router given prefill servers only answers the 503 naming the decode servers it
    lacks; one added, the pair's answer. (It refused to be built.)"""
    with routing([pd.prefill], []) as base:
        r = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT, **GREEDY},
                       timeout=TIMEOUT)  # fmt: skip
        _no_worker(r, "decode")
        assert _add(base, url=pd.decode, worker_type="decode").status_code == 200
        assert _complete(base) == pd.want


@contextlib.contextmanager
def _mute_server(hold_s: float = 1.0) -> Iterator[str]:
    """A server that takes connections and answers none (one restarting, say): those open
    are closed once two are, or `hold_s` seconds after the first; yields its URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", free_port()))
    sock.listen()
    sock.settimeout(0.05)
    stop = threading.Event()

    def serve() -> None:
        held: list[socket.socket] = []
        since = 0.0
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                held.append(sock.accept()[0])
                since = time.monotonic() if len(held) == 1 else since
            if held and (len(held) == 2 or time.monotonic() - since > hold_s):
                for conn in held:
                    conn.close()
                held = []
        for conn in held:
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(TIMEOUT)
        sock.close()


def test_of_two_adds_racing_with_no_layout_known_the_second_is_checked_against_the_first(pd):
    """Two decode servers of different KV layouts added at once to a router with no server,
    or whose one server (a prefill server) cannot tell its layout: exactly one is registered,
    the other is the 400 naming the difference. (Each was checked against the servers
    registered when its check began, and passed when none told a layout: both were added,
    and every request they shared failed in the handoff.)"""
    conf = dataclasses.replace(pd.conf, page_size=32)
    with serving_disagg(conf, "decode") as (odd, _), _mute_server() as mute:
        for prefill in ([], [mute]):
            with routing(prefill, []) as base, ThreadPoolExecutor(2) as pool:
                adds = {u: pool.submit(_add, base, url=u) for u in (pd.decode2, odd)}
                answers = {u: a.result() for u, a in adds.items()}
                added = [u for u, r in answers.items() if r.status_code == 200]
                assert len(added) == 1, (prefill, {u: r.text for u, r in answers.items()})
                (refused,) = set(answers) - set(added)
                message = _refusal(answers[refused], 400, "url")
                assert "different KV layouts: fingerprint: " in message, message
                assert added[0] in message and refused in message, message
                assert _listed(base) == [("prefill", u) for u in prefill] + [("decode", added[0])]


def test_adds_at_once_past_a_server_that_never_answers_wait_for_it_together(monkeypatch):
    """Three decode servers added at once to a router whose one server (a prefill server)
    takes connections and never answers: all three are added within about one wait for its
    /disagg/info, not three. (Its layout was asked under the adds' lock, so each add waited
    its timeout in turn: N adds, N timeouts.)"""
    timeout = 2.0
    monkeypatch.setattr(router_module, "_INFO_TIMEOUT_S", timeout)
    app = FastAPI()
    app.get("/disagg/info")(lambda: {"mode": "decode", "fingerprint": "f", "compute": "c"})

    def fake() -> uvicorn.Server:
        return uvicorn.Server(uvicorn.Config(app, port=free_port(), log_level="warning"))

    with ExitStack() as stack:
        mute = stack.enter_context(_mute_server(hold_s=TIMEOUT))
        fakes = [stack.enter_context(running(fake())) for _ in range(3)]
        base = stack.enter_context(routing([mute], []))
        start = time.monotonic()
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda u: _add(base, url=u), fakes))
        took = time.monotonic() - start
        assert [r.status_code for r in answers] == [200] * 3, [r.text for r in answers]
        assert took < 1.5 * timeout, f"the adds took {took:.1f} s: one after another"
        want = [("prefill", mute)] + [("decode", u) for u in fakes]
        assert sorted(_listed(base)) == sorted(want)
