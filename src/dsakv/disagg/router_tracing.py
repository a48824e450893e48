"""`dsakv router --otlp-traces-endpoint` (SGLang Model Gateway's --enable-trace too): a span
per routed request (completions, chat, /generate, the Responses and Messages APIs).

Its name is the gateway's for the span of a request it serves, "http_request" (SpanKind
SERVER), its service dsakv-router (`service_name`); its parent is the client's W3C trace
context, and the prefill and decode requests carry its own, so the servers' `llm_request`
spans (`dsakv.server.tracing`) are its children. Its attributes say what the router did
with the request: `route` (the path it was relayed as), `stream` (the client asked to),
`prefill_policy` and `decode_policy`, the servers it went to (`prefill_url`, `decode_url`:
the names the gateway's events use), those passed over first (`prefill_retries`,
`decode_retries`), `bootstrap_room` (one per prompt), `status_code` and `request_id` (the
id both servers got, the client's X-Request-Id back: `Router` names each request); and
OpenTelemetry's HTTP server names (`HTTP`), which a trace backend reads without knowing the
gateway's. Each server tried is a `worker_tried` event (the first's time less the span's
start: how long picking took), each one that failed a `worker_failed` event saying why. It
ends when the answer is whole (a stream's last chunk); a 5xx, a stream cut short or a
client gone first is its error status. The router's code finds the span of the request it
serves in `current` (as OpenTelemetry's current span is found), not in an argument of each
call on the way.

Off, the router makes no span and imports no SDK; on, a request costs one span: under
0.1 ms of the router's CPU (about 80 us on a loaded 2-core machine), and its share of a
batch's export on the SDK's thread."""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

from starlette.requests import Request

from dsakv.server.tracing import TraceConfig, Tracing, service_name

SPAN_NAME = "http_request"  # (SGLang Model Gateway's)
# OpenTelemetry's HTTP server span attributes (its semantic conventions), beside the gateway's
HTTP = {
    "method": "http.request.method",
    "route": "http.route",
    "path": "url.path",
    "status": "http.response.status_code",
}
# The span of the request the router serves (None: not traced), for the code answering it:
# set by the router (`Router._traced`) while the answer is made (the tasks it starts copy
# it); a stream relayed after that is handed it.
current: ContextVar[RouteSpan | None] = ContextVar("dsakv_route_span", default=None)


class RouteTracer(Tracing):
    """The router's spans (`Router.tracer`); `policies`: each kind's policy, by name."""

    def __init__(self, config: TraceConfig, policies: Mapping[str, str]) -> None:
        super().__init__(config, "dsakv.router", service_name("router"))
        self.policies = {f"{kind}_policy": name for kind, name in policies.items()}

    def start(self, route: str, request: Request) -> RouteSpan:
        """The span of `request` (relayed as `route`), from now until its `end` (the
        router's `_whole`: once the answer is whole)."""
        parent = self.propagator.extract(request.headers)
        matched = request.scope.get("route")  # (the app's route: /invocations is its own)
        attributes = {
            "route": route,
            **self.policies,
            HTTP["method"]: request.method,
            HTTP["route"]: getattr(matched, "path", route),
            HTTP["path"]: request.url.path,
        }
        opened = self.tracer.start_span(
            SPAN_NAME, context=parent, kind=self.kind, attributes=attributes
        )
        return RouteSpan(self, opened)


class RouteSpan:
    """One routed request's span (`RouteTracer.start`), told what the router does."""

    def __init__(self, tracer: RouteTracer, span: Any) -> None:
        self.tracer, self.span = tracer, span
        self.tries = {"prefill": 0, "decode": 0}
        self.using: dict[str, str | None] = {}  # each kind's server tried last, unless it failed
        self.lost: str | None = None  # why the stream was cut short (the decode server gone)

    def context(self) -> dict[str, str]:
        """The span's W3C trace context (`traceparent`, the client's `tracestate`), for the
        servers: their spans are its children."""
        from opentelemetry.trace import set_span_in_context

        carrier: dict[str, str] = {}
        self.tracer.propagator.inject(carrier, set_span_in_context(self.span))
        return carrier

    def set(self, key: str, value: Any) -> None:
        self.span.set_attribute(key, value)

    def tried(self, kind: str, url: str) -> None:
        """The request goes to the `kind` server `url`, unless it fails there (`failed`)."""
        self.tries[kind] += 1
        self.using[kind] = url
        self.span.add_event("worker_tried", {"worker_type": kind, "url": url})

    def failed(self, kind: str, url: str, error: BaseException) -> None:
        """`url` could not take the request: the next server of its kind may."""
        self.using[kind] = None
        event = {"worker_type": kind, "url": url, "error": repr(error)}
        self.span.add_event("worker_failed", event)

    def end(self, status: int, error: str | None) -> None:
        """The answer is whole (`status`); `error`: what went wrong, else (None) the stream
        cut short (`lost`), if it was."""
        error = self.lost if error is None else error
        for kind, tries in self.tries.items():
            if tries:
                self.span.set_attribute(f"{kind}_retries", tries - 1)
                if (url := self.using[kind]) is not None:
                    self.span.set_attribute(f"{kind}_url", url)
        self.span.set_attributes({"status_code": status, HTTP["status"]: status})
        if error is not None:
            self.span.set_status(self.tracer.failed(error))
        self.span.end()
