"""OpenTelemetry request tracing: vLLM's --otlp-traces-endpoint and --collect-detailed-traces,
SGLang's --enable-trace.

Each engine request a generation route makes gets a span named "llm_request" (SpanKind
SERVER), so each choice of an n > 1 request gets its own, as vLLM's child requests do (a
beam search's requests, one per beam and step, get none); its parent is the trace the
client's W3C `traceparent` / `tracestate` headers name (none: a trace of its own). Its
attributes carry vLLM's names (`ATTR`; OpenTelemetry's GenAI ones for the finish reasons and
the cached prompt tokens, which vLLM does not record), its times are the engine's own stamps
(`RequestMetrics`, those the /metrics histograms read) mapped to the wall clock; a request
aborted, failed or refused ends it with an error status. Spans leave in batches (the SDK's
`BatchSpanProcessor`, set by its OTEL_BSP_* variables) over OTLP, gRPC or HTTP/protobuf as
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL says (vLLM's choice, gRPC by default), the last ones as
the app stops (`Tracing.shutdown`, which gives a collector that does not take them
`FLUSH_S`). `dsakv router`'s spans leave the same way (`Tracing`). Each app's spans are its
service's (`service_name`: dsakv, dsakv-prefill, dsakv-decode, dsakv-router), unless
OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES names it.

Light until a server traces: the OpenTelemetry SDK is imported by `Tracing` only."""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dsakv.errors import DsakvError

if TYPE_CHECKING:
    from dsakv.engine import SamplingParams

    from .protocol import APIError
    from .runner import RequestStream, Update
    from .submit import Call

PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
PROTOCOLS = ("grpc", "http/protobuf")
SGLANG_ENDPOINT = "localhost:4317"  # SGLang's --otlp-traces-endpoint default (--enable-trace)
SPAN_NAME = "llm_request"
# How long a stopping server waits for its last spans to leave: the exporter retries each batch
# a collector refuses (or holds) for up to OTEL_EXPORTER_OTLP_TRACES_TIMEOUT (10 s), and the
# SDK's shutdown waits on them 30 s, past a supervisor's stop timeout
FLUSH_S = 5.0

# vLLM's span attribute names (its `SpanAttributes`)
ATTR = {
    "id": "gen_ai.request.id",
    "model": "gen_ai.response.model",
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "max_tokens": "gen_ai.request.max_tokens",
    "n": "gen_ai.request.n",
    "finish_reasons": "gen_ai.response.finish_reasons",  # (OpenTelemetry's: a string array)
    "prompt_tokens": "gen_ai.usage.prompt_tokens",
    "completion_tokens": "gen_ai.usage.completion_tokens",
    "cached_tokens": "gen_ai.usage.cache_read.input_tokens",  # (OpenTelemetry's)
    "queue": "gen_ai.latency.time_in_queue",
    "ttft": "gen_ai.latency.time_to_first_token",
    "e2e": "gen_ai.latency.e2e",
    "prefill": "gen_ai.latency.time_in_model_prefill",
    "decode": "gen_ai.latency.time_in_model_decode",
    "inference": "gen_ai.latency.time_in_model_inference",
    "scheduler": "gen_ai.latency.time_in_scheduler",
    "forward": "gen_ai.latency.time_in_model_forward",
    "execute": "gen_ai.latency.time_in_model_execute",
}


def service_name(role: str) -> str:
    """The OpenTelemetry service.name of a server in disaggregation mode `role` ("null",
    "prefill", "decode") or of the router ("router"): dsakv, dsakv-prefill, dsakv-decode,
    dsakv-router. vLLM names none (OTEL_SERVICE_NAME, else the SDK's
    unknown_service:python); SGLang names its servers "sglang" whatever their role and its
    gateway "sgl-router". A role of its own: the tiers are scaled and fail apart, and a
    trace backend lists, colours and filters spans by service first (Jaeger's search, its
    dependency graph: router -> prefill, router -> decode). OTEL_SERVICE_NAME or
    OTEL_RESOURCE_ATTRIBUTES' service.name, set, is the name instead."""
    return "dsakv" if role == "null" else f"dsakv-{role}"


@dataclass(frozen=True)
class TraceConfig:
    """Where spans go: `endpoint`, a collector's gRPC address (host:port, or a URL) or its
    OTLP/HTTP URL (/v1/traces included: the exporters take it as given), over `protocol`."""

    endpoint: str
    protocol: str = "grpc"

    def __post_init__(self) -> None:
        if not self.endpoint:
            raise DsakvError("--otlp-traces-endpoint must not be empty")
        if self.protocol not in PROTOCOLS:
            raise DsakvError(
                f"{PROTOCOL_ENV} must be grpc or http/protobuf (vLLM's), got {self.protocol!r}"
            )
        if self.protocol == "http/protobuf" and not self.endpoint.startswith(
            ("http://", "https://")
        ):
            raise DsakvError(
                f"--otlp-traces-endpoint {self.endpoint}: OTLP over HTTP needs the collector's "
                "URL (e.g. http://localhost:4318/v1/traces)"
            )

    @classmethod
    def from_env(cls, endpoint: str) -> TraceConfig:
        """`endpoint` over the protocol OTEL_EXPORTER_OTLP_TRACES_PROTOCOL names (gRPC)."""
        return cls(endpoint, os.environ.get(PROTOCOL_ENV, "grpc"))


class Tracing:
    """An app's tracer (`scope`: its name), on a provider of its own: not the process'
    global one, which can be set once (several apps in one process, as the tests run, each
    export to their own collector); its spans batched to `config`'s collector, as those of
    `service` (`service_name`). A server's (`RequestTracer`) and the router's
    (`dsakv.disagg.router_tracing`)."""

    def __init__(self, config: TraceConfig, scope: str, service: str) -> None:
        from opentelemetry.sdk.resources import OTELResourceDetector, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        # (`Resource.create`'s attributes win over OTEL_SERVICE_NAME and
        # OTEL_RESOURCE_ATTRIBUTES: the variables' are merged over them again)
        named = Resource.create({"service.name": service}).merge(OTELResourceDetector().detect())
        self.provider, self.exporter = TracerProvider(resource=named), _exporter(config)
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer(scope)
        self.propagator = TraceContextTextMapPropagator()
        self.kind = SpanKind.SERVER
        self.failed = lambda why: Status(StatusCode.ERROR, why)

    def shutdown(self) -> None:
        """Export what is left and stop (blocks). A collector that has not taken it in
        `FLUSH_S` (down, unreachable, hung) loses it: the exporter, shut down, drops its
        retries and gRPC its call in flight (an HTTP request sent runs to its timeout), so
        the SDK's worker ends too."""
        flush = threading.Thread(target=self.provider.shutdown, name="dsakv-trace-flush")
        flush.start()
        flush.join(FLUSH_S)
        if flush.is_alive():
            self.exporter.shutdown()
            flush.join()


class RequestTracer(Tracing):
    """A server's spans (`Handlers.tracer`). `model`: the name responses report (the first
    served name); `detailed`: what the engine times per request
    (`EngineConfig.detailed_traces`); `role`: its disaggregation mode, its service's name's
    (`service_name`)."""

    def __init__(
        self, config: TraceConfig, model: str, detailed: frozenset[str], role: str
    ) -> None:
        super().__init__(config, "dsakv.server", service_name(role))
        self.model, self.detailed = model, detailed
        self.spans: weakref.WeakKeyDictionary[RequestStream, RequestSpan] = (
            weakref.WeakKeyDictionary()
        )

    def call(self, headers: Mapping[str, str], call: Call | None) -> CallTrace:
        """The spans of generation call `call` (its id: `Call.shown`), their parent the
        trace `headers` carry (W3C trace context)."""
        shown = call.shown if call is not None else None
        return CallTrace(self, self.propagator.extract(headers), shown, time.perf_counter())

    def span(self, stream: RequestStream) -> RequestSpan | None:
        """`stream`'s span, to feed its updates and end (None: not traced), once."""
        return self.spans.pop(stream, None)

    def emit(
        self,
        parent: Any,
        attributes: dict[str, Any],
        start: float,
        end: float,
        error: str | None,
    ) -> None:
        """One span from `start` to `end` (`time.perf_counter` stamps, as the engine's)."""
        now_ns, now = time.time_ns(), time.perf_counter()
        span = self.tracer.start_span(
            SPAN_NAME,
            context=parent,
            kind=self.kind,
            attributes=attributes,
            start_time=now_ns - int((now - start) * 1e9),
        )
        if error is not None:
            span.set_status(self.failed(error))
        span.end(end_time=now_ns - int((now - end) * 1e9))


@dataclass
class CallTrace:
    """The spans of one generation call (`SubmitMixin.submit_all`): its parent context, the
    id its client sees (vLLM's request id: the choices of a request share it) and when it
    began (where no engine request stamps its arrival: a prompt refused)."""

    tracer: RequestTracer
    parent: Any
    request_id: str | None
    began: float

    def took(self, streams: Sequence[RequestStream], params: SamplingParams, n: int) -> None:
        """The engine took these `n` choices of one prompt: a span each, from its arrival."""
        attributes = self._attributes(params, n)
        for s in streams:
            self.tracer.spans[s] = RequestSpan(self, s.arrival, attributes)

    def refused(self, params: SamplingParams, n: int, error: APIError) -> None:
        """A prompt refused before the engine took it (too long, the engine asleep, the
        client gone): one span for its choices, with the error the client got."""
        attributes = self._attributes(params, n)
        self.tracer.emit(self.parent, attributes, self.began, time.perf_counter(), error.message)

    def dropped(self, streams: Sequence[RequestStream]) -> None:
        """Choices the engine took for a call that then failed (a later prompt refused),
        aborted unread."""
        for s in streams:
            if (span := self.tracer.span(s)) is not None:
                span.end("aborted: the request failed")

    def _attributes(self, params: SamplingParams, n: int) -> dict[str, Any]:
        a = {
            ATTR["model"]: self.tracer.model,
            ATTR["temperature"]: params.temperature,
            ATTR["top_p"]: params.top_p,
            ATTR["max_tokens"]: params.max_tokens,
            ATTR["n"]: n,
        }
        if self.request_id is not None:
            a[ATTR["id"]] = self.request_id
        return a


@dataclass
class RequestSpan:
    """One engine request's span, fed the updates its handler reads (`_updates`) and ended
    when it stops reading: at the request's end, or when its client left first (an error,
    with what was known then)."""

    call: CallTrace
    arrival: float
    attributes: dict[str, Any]
    ttft: float | None = None
    last: Update | None = None

    def observe(self, u: Update) -> None:
        if self.ttft is None:
            self.ttft = u.ttft_s
        self.last = u

    def end(self, unread: str = "aborted before its end (the client left, or it failed)") -> None:
        """The span, ended now; `unread`: why, where the request's end was not read."""
        u, a = self.last, dict(self.attributes)
        end, error = time.perf_counter(), unread
        if u is not None:
            a[ATTR["prompt_tokens"]] = u.prompt_tokens
            a[ATTR["completion_tokens"]] = u.completion_tokens
            a[ATTR["cached_tokens"]] = u.cached_tokens
            if self.ttft is not None:
                a[ATTR["ttft"]] = self.ttft
        if u is not None and u.finished:
            a[ATTR["finish_reasons"]] = [u.finish_reason or "abort"]
            if (m := u.times) is not None:
                end = m.finish_time or end  # (an abort stamps none: when it was seen)
                a.update(_latencies(m, self.call.tracer.detailed))
            error = None
            if u.finish_reason in ("abort", "error"):
                error = u.error or ("aborted" if u.abort_asked else "aborted by the server")
        self.call.tracer.emit(self.call.parent, a, self.arrival, end, error)


def _latencies(m: Any, detailed: frozenset[str]) -> dict[str, float]:
    """vLLM's latency attributes `m`'s stamps give (`RequestMetrics`; those it lacks left
    out), and with `detailed` the step times the engine summed for it."""
    took = {
        "e2e": m.latency,
        "queue": m.queued,
        "prefill": m.prefill,
        "decode": m.decode,
        "inference": m.inference,
    }
    got = {ATTR[name]: t for name, t in took.items() if t is not None}
    if detailed:
        got[ATTR["scheduler"]] = m.scheduler_time
    if "model" in detailed:
        got[ATTR["forward"]] = m.forward_time
    if "worker" in detailed:
        got[ATTR["execute"]] = m.execute_time
    return got


def _exporter(config: TraceConfig) -> Any:
    """The OTLP span exporter of `config.protocol`; gRPC in the clear unless the endpoint
    says https (vLLM's)."""
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=config.endpoint, insecure=True)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HTTPSpanExporter,
    )

    return HTTPSpanExporter(endpoint=config.endpoint)
