"""`dsakv router`'s /metrics, under SGLang router's names (sgl-router's `sgl_router_*`) and
dsakv's two: on a real deployment (two prefill servers and a decode server, glm-tiny on the
CPU, in this process) each count is what the router did (the requests each server was
sent, each policy's picks, cache_aware's hits over a shared prefix and its trees), and
servers that are down or fail show up in the errors, retries and health; servers of our
own (FastAPI apps) hold a request in flight or fail one as a real one would. And a server
whose /disagg/info answers JSON that is no object is no prefill or decode server (it was
a 500)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from dsakv.disagg import router as router_module
from dsakv.disagg.policy import PolicyConfig
from dsakv.disagg.router import HealthConfig

from .serving import (
    TIMEOUT,
    free_port,
    routing,
    running,
    scrape_metrics,
    serving_two_prefills,
)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# SGLang Model Gateway's labels of a request through its HTTP PD router
SMG = {"router_type": "http", "backend_type": "pd", "connection_mode": "http", "model": "default"}
SYSTEM = "You are a careful assistant. Answer every question in a single short word. " * 3


@pytest.fixture(scope="module")
def pd(tmp_path_factory) -> Iterator[SimpleNamespace]:
    with serving_two_prefills(tmp_path_factory.mktemp("metrics") / "m") as pd:
        yield pd


@contextmanager
def _serving(app: FastAPI) -> Iterator[str]:
    """A server of our own (`app`) on a thread: yields its URL."""
    with running(
        uvicorn.Server(uvicorn.Config(app, port=free_port(), log_level="warning"))
    ) as base:
        yield base


def _post(base: str, path: str = COMPLETIONS, **body) -> httpx.Response:
    if path == CHAT:
        body = {"messages": [{"role": "user", "content": "Hi"}], **body}
    elif path == COMPLETIONS:
        body.setdefault("prompt", "The quick brown fox")
    return httpx.post(f"{base}{path}", json={"model": "m", "max_tokens": 2, **body},
                      timeout=TIMEOUT)  # fmt: skip


class _Metrics:
    """A router's /metrics samples, read as `m("name", label=value, ...)` (absent: 0)."""

    def __init__(self, base: str) -> None:
        self.samples = scrape_metrics(base, labels=True)

    def __call__(self, name: str, **labels: str) -> float:
        return self.samples.get((name, tuple(sorted(labels.items()))), 0.0)

    def named(self, name: str) -> dict[tuple, float]:
        """Every sample of `name`, by its labels."""
        return {labels: v for (n, labels), v in self.samples.items() if n == name}


def _settled(base: str) -> _Metrics:
    """The metrics once no request is in flight through the router (a prefill server's
    copy may end after the client's answer)."""
    for _ in range(int(TIMEOUT / 0.05)):
        m = _Metrics(base)
        if not any(m.named("sgl_router_running_requests").values()):
            return m
        time.sleep(0.05)
    raise AssertionError(f"requests stayed in flight: {m.named('sgl_router_running_requests')}")


def test_each_workers_counts_are_the_requests_it_was_sent(pd):
    """Round robin over both kinds: each server's processed and PD counts, the policy's
    decisions, the requests and durations by route (a stream's too), health and roles."""
    (p0, p1), d = pd.prefill, pd.decode
    with routing(pd.prefill, [d], policy=PolicyConfig(policy="round_robin")) as base:
        for _ in range(3):
            assert _post(base).status_code == 200
        with httpx.stream("POST", f"{base}{COMPLETIONS}", timeout=TIMEOUT,
                          json={"prompt": "Hi", "max_tokens": 2, "stream": True}) as r:  # fmt: skip
            assert r.status_code == 200 and "[DONE]" in r.read().decode()
        for _ in range(2):
            assert _post(base, CHAT).status_code == 200
        m = _settled(base)
    for name in ("sgl_router_processed_requests_total", "sgl_router_pd_prefill_requests_total"):
        assert m(name, worker=p0) == m(name, worker=p1) == 3, m.named(name)
    assert m("sgl_router_processed_requests_total", worker=d) == 6
    assert m("sgl_router_pd_decode_requests_total", worker=d) == 6
    assert m.named("sgl_router_policy_decisions_total") == {
        (("policy", "round_robin"), ("worker", u)): n for u, n in ((p0, 3), (p1, 3), (d, 6))
    }
    for name in ("sgl_router_requests_total", "sgl_router_pd_requests_total",
                 "sgl_router_request_duration_seconds_count",
                 "sgl_router_pd_request_duration_seconds_count"):  # fmt: skip
        assert m(name, route=COMPLETIONS) == 4 and m(name, route=CHAT) == 2, m.named(name)
    assert m("dsakv_router_requests_total") == 6 and m("dsakv_router_failures_total") == 0
    for u in (p0, p1, d):
        assert m("sgl_router_worker_health", worker=u) == 1
        assert m("sgl_router_running_requests", worker=u) == 0  # (idle: there, at 0)
        assert ("sgl_router_worker_load", (("worker", u),)) in m.samples
    assert m("sgl_router_active_workers") == 3
    for name in ("dsakv_router_workers", "dsakv_router_healthy_workers"):
        assert m(name, worker_type="prefill") == 2 and m(name, worker_type="decode") == 1
    assert not m.named("sgl_router_request_errors_total")
    assert not m.named("sgl_router_retries_total")
    assert m("sgl_router_cache_hits_total") == m("sgl_router_cache_misses_total") == 0
    assert not m.named("sgl_router_tree_size")  # (no cache_aware policy: no tree)
    # the gateway's names (sglang-router 0.3 on), read from the same counts
    assert m.named("smg_router_requests_total") == {
        tuple(sorted({**SMG, "endpoint": e, "streaming": s}.items())): n
        for e, s, n in (
            ("completions", "false", 3),
            ("completions", "true", 1),
            ("chat", "false", 2),
        )
    }
    for e, n in (("completions", 4), ("chat", 2)):
        assert m("smg_router_request_duration_seconds_count", endpoint=e, **SMG) == n
        buckets = {
            labels: v
            for labels, v in m.named("smg_router_request_duration_seconds_bucket").items()
            if ("endpoint", e) in labels
        }
        assert len(buckets) == 21 and max(buckets.values()) == n  # (cumulative, to +Inf)
    for kind, n in (("prefill", 6), ("decode", 6)):
        labels = {"worker_type": kind, "connection_mode": "http", "model": "default"}
        assert m("smg_worker_selection_total", policy="round_robin", **labels) == n
        assert m("smg_worker_pool_size", **labels) == {"prefill": 2, "decode": 1}[kind]
    for u in (p0, p1, d):
        assert m("smg_worker_health", worker=u) == 1
        assert ("smg_worker_requests_active", (("worker", u),)) in m.samples
    assert not m.named("smg_router_request_errors_total")
    assert not m.named("smg_worker_retries_total")


def test_cache_aware_hits_a_shared_prefix_and_its_trees_hold_what_was_sent(pd):
    """By default (cache_aware prefill picks): the first of four prompts sharing a long
    system prompt is a miss (no tree matches it), the next three hits on that server; a
    prompt sharing nothing is a miss, sent to the server with the smaller tree. Each tree's
    size is the characters its server was sent, shared runs once."""
    (p0, p1), d = pd.prefill, pd.decode
    questions = [f"Question {i}: a colour?" for i in range(4)]
    other = "Tell me something else entirely, please."
    with routing(pd.prefill, [d]) as base:
        for q in questions:
            assert _post(base, prompt=SYSTEM + q).status_code == 200
        m = _Metrics(base)
        assert (m("sgl_router_cache_misses_total"), m("sgl_router_cache_hits_total")) == (1, 3)
        assert _post(base, prompt=other).status_code == 200
        m = _settled(base)
    assert (m("sgl_router_cache_misses_total"), m("sgl_router_cache_hits_total")) == (2, 3)
    assert m("sgl_router_load_balancing_events_total") == 0
    shared = len(SYSTEM + "Question ")  # (then each its own "i: a colour?")
    assert m.named("sgl_router_tree_size") == {
        (("worker", p0),): shared + sum(len(q) - len("Question ") for q in questions),
        (("worker", p1),): len(other),
    }  # (none for the decode server: its policy, round robin, keeps no tree)
    assert m("sgl_router_policy_decisions_total", policy="cache_aware", worker=p0) == 4
    assert m("sgl_router_policy_decisions_total", policy="cache_aware", worker=p1) == 1
    assert m("sgl_router_policy_decisions_total", policy="round_robin", worker=d) == 5
    assert m("sgl_router_processed_requests_total", worker=p0) == 4


def test_servers_down_show_up_in_retries_errors_and_health(pd, monkeypatch):
    """A prefill server down: the request its pick sent there is retried on the other (a
    retry, that server's error, unhealthy), the next goes to the other at once. The only
    decode server down: the request fails (its error by type, the decode server's error, a
    failure). No server at all: SGLang's 503, counted as no_available_workers."""
    monkeypatch.setattr(router_module, "_DOWN_S", 3600.0)  # (however slow the first request)
    (p0, _), d = pd.prefill, pd.decode
    down = f"http://127.0.0.1:{free_port()}"
    with routing([down, p0], [d], policy=PolicyConfig(policy="round_robin")) as base:
        assert _post(base).status_code == 200 and _post(base).status_code == 200
        m = _settled(base)
    assert m.named("sgl_router_retries_total") == {(("route", COMPLETIONS),): 1}
    assert m.named("sgl_router_pd_prefill_errors_total") == {(("worker", down),): 1}
    assert m("sgl_router_policy_decisions_total", policy="round_robin", worker=down) == 1
    assert m("sgl_router_policy_decisions_total", policy="round_robin", worker=p0) == 1
    assert m("sgl_router_processed_requests_total", worker=p0) == 2
    assert m("sgl_router_processed_requests_total", worker=down) == 0
    assert m("sgl_router_worker_health", worker=down) == 0
    assert m("sgl_router_worker_health", worker=p0) == 1
    assert m("sgl_router_active_workers") == 2
    assert m("dsakv_router_workers", worker_type="prefill") == 2
    assert m("dsakv_router_healthy_workers", worker_type="prefill") == 1
    assert not m.named("sgl_router_request_errors_total")  # (both were answered)
    assert m.named("smg_worker_retries_total") == {
        (("endpoint", "completions"), ("worker_type", "prefill")): 1
    }
    assert m("smg_worker_health", worker=down) == 0

    with routing([p0], [down]) as base:
        assert _post(base, CHAT).status_code == 502
        m = _settled(base)
    assert m.named("sgl_router_request_errors_total") == {
        (("error_type", "decode_unreachable"), ("route", CHAT)): 1
    }
    assert m.named("sgl_router_pd_errors_total") == {(("error_type", "decode_unreachable"),): 1}
    assert m.named("sgl_router_pd_decode_errors_total") == {(("worker", down),): 1}
    assert m("dsakv_router_failures_total") == 1 and m("sgl_router_requests_total", route=CHAT) == 1
    assert m.named("smg_router_request_errors_total") == {
        tuple(sorted({**SMG, "endpoint": "chat", "error_type": "backend_error"}.items())): 1
    }

    with routing([], []) as base:
        assert _post(base).status_code == 503
        assert _post(base, "/v1/responses", input="Hi").status_code == 503
        m = _Metrics(base)
    assert m.named("sgl_router_request_errors_total") == {
        (("error_type", "no_available_workers"), ("route", r)): 1
        for r in (COMPLETIONS, "/v1/responses")
    }
    assert m.named("smg_router_request_errors_total") == {
        tuple(sorted({**SMG, "endpoint": e, "error_type": "no_workers"}.items())): 1
        for e in ("completions", "responses")
    }
    assert m("dsakv_router_failures_total") == 0  # (no server failed)
    assert (
        m("sgl_router_active_workers") == 0 and m("dsakv_router_workers", worker_type="decode") == 0
    )


def test_a_body_no_server_could_be_sent_is_the_servers_400_and_no_failure(pd):
    """A lone surrogate or NaN in a body, or JSON nested past the interpreter's limit: the
    router answers the 400 a server does, at once, no server blamed. (The prefill half,
    encoded anew, could not be sent: the decode server waited 60 s for its room, then a
    502, the healthy prefill server counted failed and asked its port again; the nesting
    was a 500.)"""
    p0, d = pd.prefill[0], pd.decode
    bodies = [
        b'{"prompt": "x", "max_tokens": 2, "user": "\\ud800"}',
        b'{"prompt": "x", "max_tokens": 2, "length_penalty": NaN}',
        b'{"prompt": "x", "max_tokens": 2, "user": ' + b'{"a": ' * 3000 + b"1" + b"}" * 3001,
    ]
    json_type = {"content-type": "application/json"}
    with routing([p0], [d]) as base:
        for raw in bodies:
            got, want = (
                httpx.post(f"{url}{COMPLETIONS}", content=raw, headers=json_type, timeout=TIMEOUT)
                for url in (base, d)
            )
            assert (got.status_code, got.json()) == (400, want.json()), got.text
            assert got.json()["error"]["message"].startswith("request body is not valid JSON")
        assert _post(base).status_code == 200  # (the prefill server serves on)
        m = _settled(base)
    assert m("dsakv_router_failures_total") == 0
    assert not m.named("sgl_router_pd_prefill_errors_total")
    assert m("sgl_router_worker_health", worker=p0) == 1


def _fake_prefill() -> FastAPI:
    """A prefill server that tells a bootstrap port and answers its copy at once."""
    app = FastAPI()
    app.get("/disagg/info")(lambda: {"mode": "prefill", "bootstrap_port": 1})
    app.post(COMPLETIONS)(lambda: {})
    return app


async def _dropped() -> AsyncIterator[bytes]:
    """A decode server's stream, dropped after its first event."""
    yield b'data: {"choices": []}\n\n'
    raise RuntimeError("the decode server died mid-stream")


def test_a_request_in_flight_is_its_decode_servers_load_and_failures_are_its_errors():
    """A decode server holding a request: it is that server's running request (its load)
    until answered. A decode server answering a 5xx, and one dropping a stream midway:
    each the route's error by type, the server's error (a stream's too), a failure."""
    arrived, release = threading.Event(), threading.Event()
    decode = FastAPI()

    @decode.post(COMPLETIONS)
    async def complete(body: dict) -> Response:
        if body["prompt"] == "hold":
            arrived.set()
            await asyncio.to_thread(release.wait, TIMEOUT)
            return JSONResponse({"choices": []})
        if body["prompt"] == "fail":
            return JSONResponse({"error": {"message": "broken"}}, status_code=500)
        return StreamingResponse(_dropped(), media_type="text/event-stream")

    with ExitStack() as stack:
        p = stack.enter_context(_serving(_fake_prefill()))
        d = stack.enter_context(_serving(decode))
        base = stack.enter_context(routing([p], [d]))
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(_post, base, prompt="hold")
            assert arrived.wait(TIMEOUT)
            m = _Metrics(base)
            assert m("sgl_router_running_requests", worker=d) == 1
            assert m("sgl_router_worker_load", worker=d) == 1
            release.set()
            assert held.result().status_code == 200
        assert _settled(base)("sgl_router_running_requests", worker=d) == 0
        assert _post(base, prompt="fail").status_code == 500
        with httpx.stream("POST", f"{base}{COMPLETIONS}", timeout=TIMEOUT,
                          json={"prompt": "drop", "stream": True}) as r:  # fmt: skip
            assert "mid-stream" in r.read().decode()
        m = _settled(base)
    assert m.named("sgl_router_request_errors_total") == {
        (("error_type", e), ("route", COMPLETIONS)): 1 for e in ("server_error", "decode_failed")
    }
    assert m.named("sgl_router_pd_decode_errors_total") == {(("worker", d),): 2}
    assert m.named("sgl_router_pd_stream_errors_total") == {(("worker", d),): 1}
    assert m("dsakv_router_failures_total") == 2
    assert m("sgl_router_processed_requests_total", worker=d) == 3


def test_a_stored_responses_stream_lost_counts_under_its_route():
    """A stored response's events (GET /v1/responses/{id}?stream=true) the decode server
    drops midway: a request and its error under the route's template (not its path: a
    label value per response id and query), the server's error, a failure."""
    decode = FastAPI()
    decode.get("/v1/responses/{rid}")(
        lambda rid: StreamingResponse(_dropped(), media_type="text/event-stream")
    )
    route = "/v1/responses/{response_id}"
    with ExitStack() as stack:
        p = stack.enter_context(_serving(_fake_prefill()))
        d = stack.enter_context(_serving(decode))
        base = stack.enter_context(routing([p], [d]))
        url = f"{base}/v1/responses/resp_0?stream=true&starting_after=0"
        with httpx.stream("GET", url, timeout=TIMEOUT) as r:
            assert r.status_code == 200 and "mid-stream" in r.read().decode()
        m = _settled(base)
    assert m.named("sgl_router_requests_total") == {(("route", route),): 1}
    assert m.named("sgl_router_request_errors_total") == {
        (("error_type", "decode_failed"), ("route", route)): 1
    }
    assert m("sgl_router_request_duration_seconds_count", route=route) == 1
    assert m.named("sgl_router_pd_stream_errors_total") == {(("worker", d),): 1}
    assert m("dsakv_router_failures_total") == 1


def _fake(mode: str) -> FastAPI:
    """A prefill or decode server that answers its /health and a completion at once."""
    app = _fake_prefill() if mode == "prefill" else FastAPI()
    app.get("/health")(lambda: {"status": "ok"})
    if mode == "decode":
        app.post(COMPLETIONS)(lambda: {"choices": []})
    return app


def _health_told(base: str, url: str) -> tuple:
    """What the router tells of prefill server `url`'s health, and of its workers': its
    health in /metrics (SGLang router's and the gateway's name), the healthy workers (all,
    and prefill), and /workers' is_healthy."""
    m = _Metrics(base)
    listed = httpx.get(f"{base}/workers", timeout=TIMEOUT).json()["workers"]
    return (
        m("sgl_router_worker_health", worker=url), m("smg_worker_health", worker=url),
        m("sgl_router_active_workers"), m("dsakv_router_healthy_workers", worker_type="prefill"),
        {w["url"]: w["is_healthy"] for w in listed}[url],
    )  # fmt: skip


def test_a_dead_server_stays_unhealthy_until_a_contact_with_it_succeeds(monkeypatch):
    """A prefill server down (of two, and a decode server): the request it failed makes it
    unhealthy in /metrics and /workers, and it stays so though routing tries it again (its
    window here 0 s: at once), as /health says; up again, it is healthy once a request it
    takes succeeds. /health's probe is a contact too: a dead server it finds (with the
    health checks on, one a request found) stays unhealthy, and back, is healthy without
    a request."""
    monkeypatch.setattr(router_module, "_DOWN_S", 0.0)
    port = free_port()
    down = f"http://127.0.0.1:{port}"
    unhealthy, healthy = (0, 0, 2, 1, False), (1, 1, 3, 2, True)
    revived = lambda: uvicorn.Server(  # noqa: E731  (the dead server back, on its port)
        uvicorn.Config(_fake("prefill"), port=port, log_level="warning")
    )
    with ExitStack() as stack:
        p = stack.enter_context(_serving(_fake("prefill")))
        d = stack.enter_context(_serving(_fake("decode")))
        base = stack.enter_context(
            routing([down, p], [d], policy=PolicyConfig(policy="round_robin"))
        )
        assert _post(base).status_code == 200  # (round robin: `down` first, then `p`)
        assert _settled(base)("sgl_router_pd_prefill_errors_total", worker=down) == 1
        assert _health_told(base, down) == unhealthy
        health = httpx.get(f"{base}/health", timeout=TIMEOUT)
        assert health.status_code == 503 and health.json()["status"] == "degraded"
        assert [u for u in health.json()["unhealthy"] if u.startswith(down)], health.text
        assert _health_told(base, down) == unhealthy
        with running(revived()):
            for _ in range(3):  # (until its turn comes: every other request)
                assert _post(base).status_code == 200
            assert _settled(base)("sgl_router_pd_prefill_requests_total", worker=down) >= 1
            assert _health_told(base, down) == healthy
            assert httpx.get(f"{base}/health", timeout=TIMEOUT).json() == {"status": "ok"}

    for checks in (HealthConfig(), HealthConfig(enabled=False)):
        with ExitStack() as stack:  # (no request once it is back: /health's probe alone)
            d = stack.enter_context(_serving(_fake("decode")))
            base = stack.enter_context(routing([down], [d], health=checks))
            assert _health_told(base, down)[-1] is True  # (none asked it yet)
            if checks.enabled:  # (/health asks only a server a contact found down)
                assert _post(base).status_code == 502
            assert httpx.get(f"{base}/health", timeout=TIMEOUT).status_code == 503
            assert _health_told(base, down) == (0, 0, 1, 0, False)
            with running(revived()):
                assert httpx.get(f"{base}/health", timeout=TIMEOUT).json() == {"status": "ok"}
                assert _health_told(base, down) == (1, 1, 2, 1, True)


@pytest.mark.parametrize("answer", [[1], "a string", None, "not JSON"])
def test_a_server_whose_disagg_info_is_no_json_object_is_no_prefill_or_decode_server(answer):
    """/disagg/info answering JSON that is no object (a list, a string, null) is taken as
    an answer that is not JSON: a request's prefill server passed over (the 502 naming it,
    it was a 500), and the server refused as a worker (the 400 naming the url)."""
    app = FastAPI()
    if answer == "not JSON":
        app.get("/disagg/info")(lambda: PlainTextResponse("mode=prefill"))
    else:
        app.get("/disagg/info")(lambda: JSONResponse(answer))
    down = f"http://127.0.0.1:{free_port()}"  # (never asked: the prefill server fails first)
    with _serving(app) as odd, routing([odd], [down]) as base:
        r = _post(base)
        assert r.status_code == 502, r.text
        message = r.json()["error"]["message"]
        assert message.startswith(f"no prefill server is usable: {odd}: "), message
        m = _Metrics(base)
        assert m.named("sgl_router_request_errors_total") == {
            (("error_type", "prefill_unreachable"), ("route", COMPLETIONS)): 1
        }
        assert m.named("sgl_router_pd_prefill_errors_total") == {(("worker", odd),): 1}
        with routing([], []) as empty:
            r = httpx.post(f"{empty}/workers", json={"url": odd}, timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["param"] == "url", r.text
        said = f"{odd} did not answer GET /disagg/info as a prefill or decode server: "
        assert r.json()["error"]["message"].startswith(said), r.text


def test_a_request_the_decode_server_was_sent_counts_there_though_never_answered():
    """A decode server sent a request whose client left before its answer (as a batch
    line cancelled): it ran it, so it is that server's request all the same (processed,
    decode, and its cache_aware policy's tree holds its text), timed once, and no longer
    running there."""
    arrived, release = threading.Event(), threading.Event()
    decode = FastAPI()

    @decode.post(COMPLETIONS)
    async def complete() -> Response:
        arrived.set()
        await asyncio.to_thread(release.wait, TIMEOUT)
        return JSONResponse({"choices": []})

    async def leave_once_arrived(base: str) -> None:
        """The request sent, its client gone (its connection closed) once the decode
        server has it."""
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            body = {"prompt": "held prompt"}
            post = asyncio.ensure_future(client.post(f"{base}{COMPLETIONS}", json=body))
            assert await asyncio.to_thread(arrived.wait, TIMEOUT)
            post.cancel()
            with pytest.raises(asyncio.CancelledError):
                await post

    with ExitStack() as stack:
        p = stack.enter_context(_serving(_fake_prefill()))
        d = stack.enter_context(_serving(decode))
        policy = PolicyConfig(decode_policy="cache_aware")
        base = stack.enter_context(routing([p], [d], policy=policy))
        stack.callback(release.set)  # (first, on the way out: the servers stop after it)
        asyncio.run(leave_once_arrived(base))
        m = _settled(base)
    for name in ("sgl_router_processed_requests_total", "sgl_router_pd_decode_requests_total"):
        assert m(name, worker=d) == 1, m.named(name)
    assert m("sgl_router_tree_size", worker=d) == len("held prompt")
    assert m("sgl_router_request_duration_seconds_count", route=COMPLETIONS) == 1
    assert not m.named("sgl_router_request_errors_total")  # (the client's leaving: no error)
