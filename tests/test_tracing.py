"""OpenTelemetry request tracing (`dsakv.server.tracing`): vLLM's --otlp-traces-endpoint and
--collect-detailed-traces, SGLang's --enable-trace. Real collectors in this process (an
OTLP/HTTP one on http.server, an OTLP/gRPC one on grpcio) receive the spans of real servers
over one tiny engine: a span per engine request on every generation route, its parent the
client's traceparent, vLLM's attributes, an error status where the request was aborted or
refused; the last spans sent as the server stops; the router passing the trace context on
to a prefill/decode pair."""

from __future__ import annotations

import contextlib
import gzip
import http.server
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from types import SimpleNamespace
from typing import Any

import grpc
import httpx
import pytest
import uvicorn
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from dsakv.cli import build_parser
from dsakv.cli.args import trace_config
from dsakv.engine import EngineConfig
from dsakv.procs import free_port
from dsakv.server import build_app

from .conftest import cli_error_line
from .serving import (
    NO_THINKING,
    TIMEOUT,
    engine_stops_stepping_at,
    routing,
    running,
    serving,
    serving_disagg,
    until_in_flight,
)

MODEL = "tiny"
ENGINE_ARGS = dict(
    kv_cache_dtype="fp32",
    index_k_dtype="fp32",
    num_pages=64,
    page_size=16,
    device="cpu",
)
GREEDY = {"temperature": 0, "ignore_eos": True}
SPAN_KIND_SERVER = trace_pb2.Span.SpanKind.SPAN_KIND_SERVER
STATUS_ERROR = trace_pb2.Status.StatusCode.STATUS_CODE_ERROR


class Collector:
    """The spans an OTLP collector received (decoded `Span` protos), waited for by trace."""

    def __init__(self) -> None:
        self.spans: list[trace_pb2.Span] = []
        self.paths: set[str] = set()
        self.resources: dict[bytes, dict] = {}  # span id -> its resource's attributes
        self._lock = threading.Condition()

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self._lock:
            for resource in request.resource_spans:
                attributes = {kv.key: _value(kv.value) for kv in resource.resource.attributes}
                for scope in resource.scope_spans:
                    self.spans.extend(scope.spans)
                    self.resources.update(
                        dict.fromkeys((s.span_id for s in scope.spans), attributes)
                    )
            self._lock.notify_all()

    def service(self, span: trace_pb2.Span) -> str:
        """The service.name of the app that sent `span`."""
        return self.resources[span.span_id]["service.name"]

    def of_trace(self, trace_id: str, count: int = 1) -> list[trace_pb2.Span]:
        """The `count` spans of trace `trace_id` (hex), once they came (bounded wait)."""
        deadline = time.monotonic() + TIMEOUT
        with self._lock:
            while len(got := [s for s in self.spans if s.trace_id.hex() == trace_id]) < count:
                left = deadline - time.monotonic()
                assert left > 0, f"{len(got)} of {count} spans of trace {trace_id} came"
                self._lock.wait(left)
        return got


@contextlib.contextmanager
def http_collector() -> Iterator[tuple[str, Collector]]:
    """An OTLP/HTTP protobuf collector (stdlib http.server): yields its /v1/traces URL."""
    collector = Collector()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(body)
            collector.paths.add(self.path)
            collector.add(request)
            answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", collector
    finally:
        server.shutdown()
        server.server_close()
        thread.join(TIMEOUT)


@contextlib.contextmanager
def grpc_collector(hung: threading.Event | None = None) -> Iterator[tuple[str, Collector]]:
    """An OTLP/gRPC collector (grpcio's server, the proto's TraceService): yields host:port.
    `hung`: it takes each export and answers none until this is set."""
    collector = Collector()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            if hung is not None:
                hung.wait(TIMEOUT)
            collector.add(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    server.start()
    try:
        yield address, collector
    finally:
        server.stop(None).wait(TIMEOUT)


def _tracing(monkeypatch, *flags: str, protocol: str = "http/protobuf", delay_ms: int = 50):
    """`dsakv serve`'s tracing config for `flags`, under `protocol`, and the batch delay the
    span processor (built next, by the app) reads."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", str(delay_ms))
    return trace_config(build_parser().parse_args(["serve", *flags]))


def _app(stack, engine, tracing) -> str:
    """Another app over `engine`, with `tracing`, running: its base URL."""
    app = build_app(engine, MODEL, tracing=tracing)
    uv = uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    return stack.enter_context(running(uvicorn.Server(uv)))


@pytest.fixture(scope="module")
def served(glm_tiny):
    """The engine (every step timed: --collect-detailed-traces all) behind a server sending
    its spans over OTLP/HTTP, and a second app over it sending them over gRPC."""
    config = EngineConfig(model=glm_tiny, collect_detailed_traces="all", **ENGINE_ARGS)
    with (
        http_collector() as (url, spans),
        grpc_collector() as (address, grpc_spans),
        pytest.MonkeyPatch.context() as env,
        contextlib.ExitStack() as stack,
    ):
        tracing = _tracing(env, "--otlp-traces-endpoint", url, "--collect-detailed-traces", "all")
        base, engine = stack.enter_context(
            serving(config, served_model_name=MODEL, tracing=tracing)
        )
        grpc_tracing = _tracing(env, "--otlp-traces-endpoint", address, protocol="grpc")
        grpc_base = _app(stack, engine, grpc_tracing)
        yield SimpleNamespace(
            base=base, engine=engine, spans=spans, grpc_base=grpc_base, grpc_spans=grpc_spans
        )


_traces = iter(range(1, 1 << 30))


def _context() -> tuple[str, str, dict[str, str]]:
    """A new client trace: (trace id, the client span's id, its W3C headers)."""
    trace_id, span_id = f"{next(_traces) + 0xABC0000:032x}", f"{os.getpid() + 7:016x}"
    headers = {"traceparent": f"00-{trace_id}-{span_id}-01", "tracestate": "client=1"}
    return trace_id, span_id, headers


def _value(v) -> Any:
    """An OTLP `AnyValue` as Python's (an array as a list)."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


def _attrs(span: trace_pb2.Span) -> dict:
    return {kv.key: _value(kv.value) for kv in span.attributes}


def _check_span(span, span_id: str) -> dict:
    """`span` is vLLM's request span, a child of the client's span `span_id`: its
    attributes."""
    assert span.name == "llm_request" and span.kind == SPAN_KIND_SERVER
    assert span.parent_span_id.hex() == span_id
    assert span.trace_state == "client=1"
    assert span.start_time_unix_nano <= span.end_time_unix_nano
    a = _attrs(span)
    assert a["gen_ai.response.model"] == MODEL
    return a


def _check_latencies(a: dict) -> None:
    """The latencies are there, non-negative and in order."""
    names = ("time_in_queue", "time_to_first_token", "e2e", "time_in_model_prefill")
    names += ("time_in_model_decode", "time_in_model_inference", "time_in_scheduler")
    names += ("time_in_model_forward", "time_in_model_execute")
    lat = {name: a[f"gen_ai.latency.{name}"] for name in names}
    assert all(v >= 0 for v in lat.values()), lat
    assert lat["time_in_queue"] <= lat["time_to_first_token"] <= lat["e2e"], lat
    assert lat["time_in_model_inference"] <= lat["e2e"], lat
    assert lat["time_in_model_forward"] <= lat["time_in_model_execute"], lat


def test_a_completion_span_per_choice_joins_the_clients_trace(served):
    """n = 2: two spans (vLLM's child requests), each a child of the client's span, with
    the request's sampling params, its id, the usage the response reports and the engine's
    latencies (the detailed ones too: --collect-detailed-traces all)."""
    trace_id, span_id, headers = _context()
    body = {"model": MODEL, "prompt": "Trace me", "max_tokens": 5, "n": 2}
    body |= {"temperature": 0.7, "top_p": 0.9, "seed": 3, "ignore_eos": True}
    r = httpx.post(f"{served.base}/v1/completions", json=body, headers=headers, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    answer = r.json()
    spans = served.spans.of_trace(trace_id, 2)
    assert served.spans.paths == {"/v1/traces"}
    found = [_check_span(s, span_id) for s in spans]
    for a in found:
        assert a["gen_ai.request.id"] == answer["id"]
        assert a["gen_ai.request.temperature"] == pytest.approx(0.7)
        assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
        assert a["gen_ai.request.max_tokens"] == 5 and a["gen_ai.request.n"] == 2
        assert a["gen_ai.usage.prompt_tokens"] == answer["usage"]["prompt_tokens"]
        assert a["gen_ai.response.finish_reasons"] == ["length"]  # (a string array)
        assert 0 <= a["gen_ai.usage.cache_read.input_tokens"] < a["gen_ai.usage.prompt_tokens"]
        _check_latencies(a)
    assert sum(a["gen_ai.usage.completion_tokens"] for a in found) == 10
    assert answer["usage"]["completion_tokens"] == 10
    assert all(s.status.code != STATUS_ERROR for s in spans)


ROUTES = {
    "chat, streamed": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True,
         "stream_options": {"include_usage": True}, **NO_THINKING},
    ),
    "generate": (
        "/generate",
        {"text": "Hi", "sampling_params": {"max_new_tokens": 4, **GREEDY}},
    ),
    "responses": ("/v1/responses", {"input": "Hi", "max_output_tokens": 4, **NO_THINKING}),
    "messages": (
        "/v1/messages",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
         "thinking": {"type": "disabled"}},
    ),
}  # fmt: skip


def _ids_and_usage(path: str, r: httpx.Response) -> tuple[str, int]:
    """The id the client sees and the output tokens the answer reports."""
    if path == "/v1/chat/completions":
        chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
        return chunks[0]["id"], chunks[-1]["usage"]["completion_tokens"]
    body = r.json()
    if path == "/generate":
        return body["meta_info"]["id"], body["meta_info"]["completion_tokens"]
    if path == "/v1/completions":
        return body["id"], body["usage"]["completion_tokens"]
    return body["id"], body["usage"]["output_tokens"]


@pytest.mark.parametrize("route", ROUTES)
def test_every_generating_route_traces_its_request(served, route):
    """Chat (streamed), SGLang's /generate, the Responses API and Anthropic's Messages API:
    a span each, the client's span its parent, the id and output tokens the client got."""
    path, body = ROUTES[route]
    trace_id, span_id, headers = _context()
    body = {"model": MODEL, **body, **({} if path == "/generate" else GREEDY)}
    r = httpx.post(f"{served.base}{path}", json=body, headers=headers, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    rid, output_tokens = _ids_and_usage(path, r)
    (span,) = served.spans.of_trace(trace_id)
    a = _check_span(span, span_id)
    assert a["gen_ai.request.id"] == rid
    assert a["gen_ai.usage.completion_tokens"] == output_tokens == 4
    assert a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]


def test_an_aborted_request_span_is_an_error(served):
    """/abort_request ends a running request: its client gets the output so far, its span
    an error status and finish reason abort."""
    trace_id, span_id, headers = _context()
    body = {"model": MODEL, "prompt": "Abort me", "max_tokens": 400, **GREEDY}
    with (
        futures.ThreadPoolExecutor(1) as pool,
        engine_stops_stepping_at(served.engine, 3),
        httpx.Client(timeout=TIMEOUT) as http,
    ):
        done = pool.submit(
            http.post,
            f"{served.base}/v1/completions",
            json=body,
            headers={**headers, "X-Request-Id": "to-abort"},
        )
        until_in_flight(served.base, done)
        assert http.post(f"{served.base}/abort_request", json={"rid": "to-abort"}).is_success
        r = done.result(TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "abort"
    (span,) = served.spans.of_trace(trace_id)
    a = _check_span(span, span_id)
    assert span.status.code == STATUS_ERROR and span.status.message == "aborted"
    assert a["gen_ai.response.finish_reasons"] == ["abort"]
    assert a["gen_ai.request.id"] == "cmpl-to-abort"
    assert a["gen_ai.usage.completion_tokens"] == r.json()["usage"]["completion_tokens"]


def test_a_refused_request_span_is_an_error_with_the_clients_message(served):
    """A prompt the engine refuses (no room for max_tokens in the context): the 400 the
    client gets, and a span with its message as the error status."""
    trace_id, span_id, headers = _context()
    body = {"model": MODEL, "prompt": "Too much", "max_tokens": 1_000_000}
    r = httpx.post(f"{served.base}/v1/completions", json=body, headers=headers, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    (span,) = served.spans.of_trace(trace_id)
    a = _check_span(span, span_id)
    assert span.status.code == STATUS_ERROR
    assert span.status.message == r.json()["error"]["message"]
    assert a["gen_ai.request.max_tokens"] == 1_000_000
    assert "gen_ai.latency.e2e" not in a


def test_spans_go_over_grpc_too(served):
    """OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc (vLLM's default): the span reaches a gRPC
    collector, the client's span its parent."""
    trace_id, span_id, headers = _context()
    body = {"model": MODEL, "prompt": "gRPC", "max_tokens": 2, **GREEDY}
    r = httpx.post(f"{served.grpc_base}/v1/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    (span,) = served.grpc_spans.of_trace(trace_id)
    assert _check_span(span, span_id)["gen_ai.request.id"] == r.json()["id"]


def test_the_last_spans_are_sent_as_the_server_stops(served, monkeypatch):
    """A span still batched (the processor's delay an hour) is sent by the app's lifespan
    as its server stops."""
    trace_id, span_id, headers = _context()
    with http_collector() as (url, spans), contextlib.ExitStack() as stack:
        tracing = _tracing(monkeypatch, "--otlp-traces-endpoint", url, delay_ms=3_600_000)
        base = _app(stack, served.engine, tracing)
        body = {"model": MODEL, "prompt": "Flush me", "max_tokens": 2, **GREEDY}
        assert httpx.post(f"{base}/v1/completions", json=body, headers=headers).is_success
        stack.close()  # (the server stops)
        (span,) = spans.of_trace(trace_id)
    _check_span(span, span_id)


def test_a_servers_spans_are_the_dsakv_service_unless_the_environment_names_one(
    served, monkeypatch
):
    """A server's spans carry service.name dsakv (the SDK's unknown_service:python told a
    trace backend nothing); OTEL_RESOURCE_ATTRIBUTES' service.name wins over it (its other
    attributes kept), and OTEL_SERVICE_NAME over both, as the SDK's precedence goes."""
    body = {"model": MODEL, "prompt": "Who sent me?", "max_tokens": 1, **GREEDY}

    def service_of(base: str, spans: Collector) -> dict:
        trace_id, _, headers = _context()
        r = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        (span,) = spans.of_trace(trace_id)
        return spans.resources[span.span_id]

    assert service_of(served.base, served.spans)["service.name"] == "dsakv"
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=llm-a,deployment.environment=prod")
    with http_collector() as (url, spans), contextlib.ExitStack() as stack:
        base = _app(stack, served.engine, _tracing(monkeypatch, "--otlp-traces-endpoint", url))
        got = service_of(base, spans)
        assert (got["service.name"], got["deployment.environment"]) == ("llm-a", "prod")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "llm-b")
        base = _app(stack, served.engine, _tracing(monkeypatch, "--otlp-traces-endpoint", url))
        got = service_of(base, spans)
        assert (got["service.name"], got["deployment.environment"]) == ("llm-b", "prod")


def test_the_router_passes_the_trace_context_to_prefill_and_decode(glm_tiny, monkeypatch):
    """A request through `dsakv router`, on each generating route: the prefill server's span
    and the decode server's are both children of the client's span, the decode server's
    with the id and output tokens the client got."""
    config = EngineConfig(model=glm_tiny, **ENGINE_ARGS)
    routes = {"completions": ("/v1/completions", {"prompt": "Split me", "max_tokens": 3})}
    routes |= ROUTES
    with http_collector() as (url, spans), contextlib.ExitStack() as stack:
        tracing = _tracing(monkeypatch, "--otlp-traces-endpoint", url)
        served = {"served_model_name": MODEL, "tracing": tracing}
        urls = {
            mode: stack.enter_context(serving_disagg(config, mode, server_args=served))[0]
            for mode in ("prefill", "decode")
        }
        router = stack.enter_context(routing([urls["prefill"]], [urls["decode"]]))
        for path, body in routes.values():
            trace_id, span_id, headers = _context()
            body = {"model": MODEL, **body, **({} if path == "/generate" else GREEDY)}
            r = httpx.post(f"{router}{path}", json=body, headers=headers, timeout=TIMEOUT)
            assert r.status_code == 200, (path, r.text)
            rid, output_tokens = _ids_and_usage(path, r)
            found = [_check_span(s, span_id) for s in spans.of_trace(trace_id, 2)]
            by_tokens = {a["gen_ai.usage.completion_tokens"]: a for a in found}
            # (the prefill server's one token, the decode server's all)
            assert sorted(by_tokens) == [1, output_tokens] and output_tokens > 1, path
            assert by_tokens[output_tokens]["gen_ai.request.id"] == rid, path


def test_a_collector_that_never_answers_holds_no_request_nor_the_stop(served, monkeypatch):
    """A collector that takes the export and never answers, the exporter willing to wait an
    hour: the request is answered, and the server stops (`running` bounds it), its last span
    given up after `FLUSH_S` (the SDK alone waits 30 s), no exporting thread left behind."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "3600")
    before = set(threading.enumerate())
    hung = threading.Event()
    with grpc_collector(hung) as (address, spans), contextlib.ExitStack() as stack:
        tracing = _tracing(monkeypatch, "--otlp-traces-endpoint", address, protocol="grpc")
        base = _app(stack, served.engine, tracing)
        body = {"model": MODEL, "prompt": "Hung", "max_tokens": 2, **GREEDY}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        stack.close()  # (the server stops while the collector holds the export)
        left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
        hung.set()
    assert not [name for name in left if "Otel" in name or "trace" in name], left


def test_tracing_flags(capsys, monkeypatch):
    """Bad values are one error line; --enable-trace alone is SGLang's localhost:4317 over
    gRPC; no flag, no tracing."""
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    parse = lambda *flags: trace_config(build_parser().parse_args(["serve", *flags]))  # noqa: E731
    assert parse() is None
    sglang = parse("--enable-trace")
    assert (sglang.endpoint, sglang.protocol) == ("localhost:4317", "grpc")
    assert parse("--enable-trace", "--otlp-traces-endpoint", "c:4317").endpoint == "c:4317"
    bad = {
        ("--collect-detailed-traces", "model"): "--collect-detailed-traces needs",
        ("--otlp-traces-endpoint", "c:4317", "--collect-detailed-traces", "model,gpu"): (
            "collect_detailed_traces must be model, worker or all"
        ),
        ("--otlp-traces-endpoint", ""): "--otlp-traces-endpoint must not be empty",
    }
    for flags, error in bad.items():
        assert error in cli_error_line(["serve", *flags], capsys)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    line = cli_error_line(["serve", "--otlp-traces-endpoint", "http://c:4318/v1/traces"], capsys)
    assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be grpc or http/protobuf" in line
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    line = cli_error_line(["serve", "--otlp-traces-endpoint", "c:4318"], capsys)
    assert "OTLP over HTTP needs the collector's URL" in line


def test_tracing_flags_load_nothing_heavy_and_a_server_without_them_no_sdk():
    """`import dsakv.cli` loads no OpenTelemetry, torch or FastAPI, and reading the tracing
    flags no OpenTelemetry; a server's modules without tracing load no OpenTelemetry SDK
    (FastAPI itself imports its API)."""
    script = (
        "import sys\n"
        "import dsakv.cli\n"
        "heavy = ('opentelemetry', 'torch', 'fastapi')\n"
        "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith(heavy)}))\n"
        "from dsakv.cli.args import trace_config\n"
        "args = dsakv.cli.build_parser().parse_args(['serve', '--otlp-traces-endpoint', 'c:1'])\n"
        "assert trace_config(args).endpoint == 'c:1'\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
        "import dsakv.server.serve, dsakv.server.app\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    ).stdout.splitlines()
    assert out == ["[]", "[]", "[]"]
