"""`dsakv router --otlp-traces-endpoint` (`dsakv.disagg.router_tracing`): real prefill and
decode servers and the router, all tracing to one in-process OTLP collector
(`test_tracing`'s); a request with the client's traceparent is one trace: the client's span,
the router's span, and the servers' `llm_request` spans under it, the router's naming the
servers it used, the servers it passed over, and its errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
from starlette.requests import Request

from dsakv.cli import build_parser, main
from dsakv.cli.args import trace_config
from dsakv.disagg.policy import PolicyConfig
from dsakv.disagg.router import Router
from dsakv.engine import EngineConfig
from dsakv.procs import free_port
from dsakv.server.tracing import TraceConfig

from .conftest import cli_error_line
from .serving import NO_THINKING, TIMEOUT, routing, serving_disagg
from .test_tracing import (
    ENGINE_ARGS,
    GREEDY,
    MODEL,
    ROUTES,
    SPAN_KIND_SERVER,
    STATUS_ERROR,
    _attrs,
    _check_span,
    _context,
    _ids_and_usage,
    http_collector,
)

ROUTER_SPAN = "http_request"


@pytest.fixture(scope="module")
def pd(glm_tiny) -> Iterator[SimpleNamespace]:
    """A prefill and a decode server sending their spans to a collector, and the args of a
    router (`routing`) tracing to that collector (`dsakv router`'s flags), each kind picked
    in turn (the first first)."""
    config = EngineConfig(model=glm_tiny, **ENGINE_ARGS)
    with (
        http_collector() as (url, spans),
        pytest.MonkeyPatch.context() as env,
        contextlib.ExitStack() as stack,
    ):
        env.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        serve = build_parser().parse_args(["serve", "--otlp-traces-endpoint", url])
        served = {"served_model_name": MODEL, "tracing": trace_config(serve)}
        urls = {
            mode: stack.enter_context(serving_disagg(config, mode, server_args=served))[0]
            for mode in ("prefill", "decode")
        }
        tracing = trace_config(build_parser().parse_args(["router", "--otlp-traces-endpoint", url]))
        router = {"policy": PolicyConfig(policy="round_robin"), "tracing": tracing}
        yield SimpleNamespace(spans=spans, router=router, **urls)


def _trace(pd: SimpleNamespace, trace_id: str, span_id: str, count: int = 3):
    """The router's span of trace `trace_id` (a child of the client's span `span_id`), its
    attributes, and the trace's other spans."""
    spans = pd.spans.of_trace(trace_id, count)
    (router,) = [s for s in spans if s.name == ROUTER_SPAN]
    assert router.kind == SPAN_KIND_SERVER and router.parent_span_id.hex() == span_id
    assert router.trace_state == "client=1"
    return router, _attrs(router), [s for s in spans if s is not router]


def _events(span) -> list[tuple[str, dict]]:
    return [(e.name, _attrs(e)) for e in span.events]


def test_the_router_span_is_the_clients_child_and_the_servers_parent(pd):
    """A completion and a streamed chat through the router: each is one trace, the router's
    span a child of the client's and the prefill and decode servers' spans its children; it
    names the route, the servers and policies used, the bootstrap room and the status (the
    gateway's names, and OpenTelemetry's HTTP ones)."""
    requests = {
        "/v1/completions": {"prompt": "Route me", "max_tokens": 3},
        "/v1/chat/completions": {
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True,
            **NO_THINKING,
        },
    }  # fmt: skip
    with routing([pd.prefill], [pd.decode], **pd.router) as router:
        for path, body in requests.items():
            trace_id, span_id, headers = _context()
            body = {"model": MODEL, **body, **GREEDY}
            r = httpx.post(f"{router}{path}", json=body, headers=headers, timeout=TIMEOUT)
            assert r.status_code == 200, r.text
            span, a, servers = _trace(pd, trace_id, span_id)
            assert a["route"] == path and a["stream"] is (path != "/v1/completions")
            assert (a["prefill_url"], a["decode_url"]) == (pd.prefill, pd.decode)
            assert a["prefill_policy"] == a["decode_policy"] == "round_robin"
            assert a["prefill_retries"] == a["decode_retries"] == 0
            assert a["status_code"] == 200 and span.status.code != STATUS_ERROR
            assert a["http.request.method"] == "POST" and a["http.response.status_code"] == 200
            assert a["http.route"] == a["url.path"] == path
            (room,) = a["bootstrap_room"]
            assert 0 <= room < 1 << 62
            found = [_check_span(s, span.span_id.hex()) for s in servers]  # (llm_request)
            assert sorted(x["gen_ai.usage.completion_tokens"] for x in found) == [1, 3]
            tried = [(n, e["worker_type"], e["url"]) for n, e in _events(span)]
            assert tried == [
                ("worker_tried", "prefill", pd.prefill),
                ("worker_tried", "decode", pd.decode),
            ]


def test_the_router_and_each_kind_of_server_are_a_service_of_their_own(pd):
    """One request's spans, by service.name: the router's dsakv-router, the prefill
    server's (its one token) dsakv-prefill, the decode server's dsakv-decode."""
    trace_id, span_id, headers = _context()
    body = {"model": MODEL, "prompt": "Who is who?", "max_tokens": 2, **GREEDY}
    with routing([pd.prefill], [pd.decode], **pd.router) as router:
        r = httpx.post(f"{router}/v1/completions", json=body, headers=headers, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    span, _, servers = _trace(pd, trace_id, span_id)
    assert pd.spans.service(span) == "dsakv-router"
    by_tokens = {_attrs(s)["gen_ai.usage.completion_tokens"]: s for s in servers}
    assert [pd.spans.service(by_tokens[n]) for n in (1, 2)] == ["dsakv-prefill", "dsakv-decode"]


def _shown(path: str, rid: str) -> str | None:
    """The id a route's client sees for a request named `rid` (None: not of it)."""
    prefix = {"/v1/completions": "cmpl-", "/v1/chat/completions": "chatcmpl-"}
    return None if path == "/v1/messages" else prefix.get(path, "") + rid


def test_both_halves_of_a_request_go_by_one_id_told_to_the_client_and_the_routers_span(pd):
    """A request without X-Request-Id, on each generating route: the router gives it an id
    of its own (a new one each request), which both servers go by (their spans' request id,
    the id the client sees: cmpl-/chatcmpl- and it, a /generate rid, a response's id) and
    which comes back in X-Request-Id and is the router span's request_id. A client's own
    X-Request-Id passes through as it is; a request of two prompts is still one, by one
    id (n > 1 is a 400 in PD)."""
    routes = {"completions": ("/v1/completions", {"prompt": "Name me", "max_tokens": 3})}
    routes |= ROUTES
    seen = set()
    with routing([pd.prefill], [pd.decode], **pd.router) as router:
        for path, body in routes.values():
            trace_id, span_id, headers = _context()
            body = {"model": MODEL, **body, **({} if path == "/generate" else GREEDY)}
            r = httpx.post(f"{router}{path}", json=body, headers=headers, timeout=TIMEOUT)
            assert r.status_code == 200, (path, r.text)
            rid = r.headers["x-request-id"]
            assert rid not in seen, path
            seen.add(rid)
            span, a, servers = _trace(pd, trace_id, span_id)
            assert a["request_id"] == rid, path
            if (shown := _shown(path, rid)) is not None:
                assert _ids_and_usage(path, r)[0] == shown, path
                assert [_attrs(s)["gen_ai.request.id"] for s in servers] == [shown] * 2, path

        trace_id, span_id, headers = _context()
        headers["X-Request-Id"] = "the-clients-own"
        body = {"model": MODEL, "prompt": ["Mine", "Also mine"], "max_tokens": 2, **GREEDY}
        r = httpx.post(f"{router}/v1/completions", json=body, headers=headers, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "the-clients-own"
    assert r.json()["id"] == "cmpl-the-clients-own" and len(r.json()["choices"]) == 2
    spans = pd.spans.of_trace(trace_id, 5)  # (the router's, and each prompt's on each server)
    (span,) = [s for s in spans if s.name == ROUTER_SPAN]
    assert _attrs(span)["request_id"] == "the-clients-own"
    ids = {_attrs(s)["gen_ai.request.id"] for s in spans if s is not span}
    assert ids == {"cmpl-the-clients-own"}


def test_the_router_span_records_the_servers_passed_over(pd):
    """A dead prefill server and a dead decode server picked first: the request goes to
    the live ones, and the router's span counts a retry of each kind, an event naming each
    dead server and why, and the servers that did serve it (their spans its children)."""
    dead_p, dead_d = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
    trace_id, span_id, headers = _context()
    body = {"model": MODEL, "prompt": "Fail over", "max_tokens": 2, **GREEDY}
    with routing([dead_p, pd.prefill], [dead_d, pd.decode], **pd.router) as router:
        r = httpx.post(f"{router}/v1/completions", json=body, headers=headers, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    span, a, servers = _trace(pd, trace_id, span_id)
    assert (a["prefill_url"], a["decode_url"]) == (pd.prefill, pd.decode)
    assert a["prefill_retries"] == a["decode_retries"] == 1
    failed = {e["url"]: e for n, e in _events(span) if n == "worker_failed"}
    assert sorted(failed) == sorted([dead_p, dead_d])
    assert failed[dead_p]["worker_type"] == "prefill" and "ConnectError" in failed[dead_p]["error"]
    assert failed[dead_d]["worker_type"] == "decode" and "ConnectError" in failed[dead_d]["error"]
    assert span.status.code != STATUS_ERROR
    assert [_check_span(s, span.span_id.hex()) for s in servers]


def test_a_request_no_server_could_take_is_an_error_span(pd):
    """Every prefill server dead: the client's 502, and the router's span (the trace's only
    one: no server saw the request) with its status code and its message as the error."""
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    trace_id, span_id, headers = _context()
    body = {"model": MODEL, "prompt": "Nowhere", "max_tokens": 2}
    with routing(dead, [pd.decode], **pd.router) as router:
        r = httpx.post(f"{router}/v1/completions", json=body, headers=headers, timeout=TIMEOUT)
    assert r.status_code == 502, r.text
    span, a, servers = _trace(pd, trace_id, span_id, count=1)
    assert servers == [] and a["status_code"] == 502 and a["prefill_retries"] == 1
    assert "prefill_url" not in a and "decode_url" not in a
    assert span.status.code == STATUS_ERROR
    assert span.status.message == r.json()["error"]["message"]


def test_router_tracing_flags(glm_tiny, capsys, monkeypatch):
    """`dsakv router` takes vLLM's --otlp-traces-endpoint and SGLang's --enable-trace (its
    localhost:4317), a bad value one error line; serve-pd gives its router the config and
    its servers the flags."""
    from dsakv.disagg import launch

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    parse = lambda *flags: trace_config(build_parser().parse_args(["router", *flags]))  # noqa: E731
    assert parse() is None
    assert parse("--enable-trace").endpoint == "localhost:4317"
    assert parse("--otlp-traces-endpoint", "c:4317").endpoint == "c:4317"
    line = cli_error_line(["router", "--otlp-traces-endpoint", ""], capsys)
    assert "--otlp-traces-endpoint must not be empty" in line
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    line = cli_error_line(["router", "--otlp-traces-endpoint", "c:4318"], capsys)
    assert "OTLP over HTTP needs the collector's URL" in line
    started = []
    monkeypatch.setattr(launch, "run_router_on", lambda *a: started.append(a))
    url = "http://c:4318/v1/traces"
    argv = ["router", "--port", str(free_port()), "--otlp-traces-endpoint", url]
    assert main([*argv, "--prefill", "http://p:1", "--decode", "http://d:1"]) == 0
    assert started[0][-1].endpoint == url and started[0][-1].protocol == "http/protobuf"
    monkeypatch.setattr(launch, "serve_pd", lambda *a, **kw: started.append((a, kw)))
    argv = ["serve-pd", glm_tiny, "--port", str(free_port()), "--otlp-traces-endpoint", url]
    assert main(argv) == 0
    args, kw = started[1]
    assert kw["tracing"].endpoint == url
    assert " ".join(args[1]).count(f"--otlp-traces-endpoint {url}") == 1  # (the servers')


def test_the_router_failing_mid_stream_is_its_error_not_a_client_gone():
    """A stream the router itself fails midway (a bug: no decode server lost, no client
    gone): the router's span ends once, its error the router's (it was told the client
    left). The servers are the router's client's mock transport: no model needed."""
    trace_id, _, headers = _context()
    chat = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}
    raw = json.dumps(chat).encode()

    async def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/disagg/info":
            return httpx.Response(200, json={"mode": "prefill", "bootstrap_port": 1})
        if request.url.host == "p":
            return httpx.Response(200, json={})

        async def chunks():
            yield b"data: {}\n\n"
            raise RuntimeError("a bug")

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=chunks())

    async def receive() -> dict:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def route(router: Router) -> None:
        router._client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
                 "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}  # fmt: skip
        response = await router.generate("/v1/chat/completions", Request(scope, receive))
        with pytest.raises(RuntimeError, match="a bug"):
            async for _ in response.body_iterator:
                pass
        await asyncio.gather(*router._tasks)
        await router._client.aclose()

    with http_collector() as (url, spans):
        router = Router(["http://p:1"], ["http://d:1"], tracing=TraceConfig(url, "http/protobuf"))
        asyncio.run(route(router))
        router.tracer.shutdown()
        (span,) = spans.of_trace(trace_id)
    assert span.name == ROUTER_SPAN and span.status.code == STATUS_ERROR
    assert span.status.message == "the router failed mid-stream: RuntimeError('a bug')"
