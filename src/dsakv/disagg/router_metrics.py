"""`dsakv router`'s /metrics: its own bookkeeping under SGLang router's names, those of
sgl-router's `src/metrics.rs` (`sgl_router_*`, sglang-router up to 0.2, the names SGLang's
router docs and older dashboards use) and of SGLang Model Gateway's
`src/observability/metrics.rs` (`smg_*`, sglang-router 0.3 on: its HTTP PD router's labels,
`router_type` "http", `backend_type` "pd", `connection_mode` "http", `model` "default", as
it labels a request naming no model: a client's model names would be series without
bound), beside dsakv's `dsakv_router_requests_total` and `dsakv_router_failures_total`.

As `dsakv.metrics.ServerMetrics`: a registry per app (several routers in one process never
clash), each count kept once and read under each of its names at scrape time; the
durations too (the names share sgl-router's buckets: one observation, a fraction of a
prometheus_client histogram's, read under each name). Light: prometheus_client only (no
torch).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.core import Metric as PromMetric
from prometheus_client.registry import Collector

from dsakv.metrics import bucket_index, histogram_family

from .config import MODES

SGL, SMG = "sgl_router_", "smg_"
# sgl-router's buckets (the gateway's too), for each of its *_duration_seconds histograms
_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0,
            30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 240.0)  # fmt: skip
# The gateway's labels of a request (`router_type`, `backend_type`, `connection_mode`,
# `model`), and of a worker (`connection_mode`, `model`), the same for each of dsakv's
_ROUTER = ("http", "pd", "http", "default")
_WORKER = ("http", "default")
# The gateway's `endpoint` of a route (its `route_to_endpoint`; else "other"), and its
# `error_type` of dsakv's (else "backend_error": a server's failure)
_ENDPOINTS = {"/v1/chat/completions": "chat", "/generate": "generate",
              "/v1/completions": "completions", "/v1/rerank": "rerank",
              "/v1/responses": "responses", "/v1/messages": "messages"}  # fmt: skip
_ERROR_TYPES = {"no_available_workers": "no_workers"}


@dataclass(frozen=True)
class Worker:
    """A registered server as a scrape finds it (`Router.state`)."""

    kind: str  # "prefill" or "decode"
    url: str
    healthy: bool  # (its last contact did not fail: `Router._healthy`)


@dataclass(frozen=True)
class State:
    """What the router holds at a scrape, read then (`Router.state`)."""

    workers: list[Worker]
    policies: Mapping[str, str]  # each kind's policy (its name)
    running: Mapping[tuple[str, str], int]  # (kind, url): in flight there, removed or not
    trees: Mapping[str, int]  # a cache_aware policy's server: the characters its tree holds
    hits: int  # cache_aware picks by a match over --cache-threshold
    misses: int  # (not: the server with the smallest tree)
    rebalanced: int  # (neither: the least loaded, the loads imbalanced)
    failures: int  # requests the servers failed (dsakv_router_failures_total)


class RouterMetrics:
    """The counts the router keeps as requests pass (by route, by server), the durations,
    and at scrape time `state()`."""

    def __init__(self, state: Callable[[], State]) -> None:
        self.registry = CollectorRegistry()
        self.requests: Counter[str] = Counter()  # by route
        self.streamed: Counter[str] = Counter()  # by route: those asking for a stream
        self.errors: Counter[tuple[str, str]] = Counter()  # by (route, error type)
        self.retries: Counter[tuple[str, str]] = Counter()  # by (kind, route): tries past a
        # request's first
        self.sent: Counter[tuple[str, str]] = Counter()  # by (kind, server)
        self.decisions: Counter[tuple[str, str]] = Counter()  # by (kind, server): its picks
        self.failed: Counter[tuple[str, str]] = Counter()  # by (kind, server)
        self.streams_lost: Counter[str] = Counter()  # by decode server
        self.health_checks: Counter[tuple[str, str]] = Counter()  # by (kind, result)
        # by route: each bucket's count (not cumulative, +Inf's last), then their sum
        self.durations: dict[str, list[float]] = {}
        self.registry.register(_Families(self, state))

    def started(self, route: str) -> Callable[[int, str | None], None]:
        """A request to `route` (the path it is relayed as) counted; what to call once its
        answer is whole (the router's `_whole`: a stream's last chunk, or the client gone),
        which times it."""
        self.requests[route] += 1
        start = time.monotonic()
        return lambda status, error: self._observe(route, start)

    def _observe(self, route: str, start: float) -> None:
        took = time.monotonic() - start
        counts = self.durations.get(route)
        if counts is None:
            counts = self.durations[route] = [0.0] * (len(_BUCKETS) + 2)  # (+Inf, sum)
        counts[bucket_index(_BUCKETS, took)] += 1
        counts[-1] += took

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Families(Collector):
    """The counts (`RouterMetrics`) and the state (`State`) as metric families."""

    def __init__(self, metrics: RouterMetrics, state: Callable[[], State]) -> None:
        self.metrics, self.state = metrics, state

    def collect(self) -> Iterator[PromMetric]:
        m, s = self.metrics, self.state()
        policy = s.policies.__getitem__
        smg_requests: Counter = Counter()  # (by streaming: a series once it counts one)
        for route, n in m.requests.items():
            for streaming, count in (("true", m.streamed[route]), ("false", n - m.streamed[route])):
                if count:
                    smg_requests[(*_ROUTER, _endpoint(route), streaming)] += count
        route_labels = ["router_type", "backend_type", "connection_mode", "model", "endpoint"]
        counters = [
            ("dsakv_router_requests", "Requests routed to the servers", [],
             {(): sum(m.requests.values())}),
            ("dsakv_router_failures",
             "Requests the servers failed (5xx, unreachable), not the clients' errors", [],
             {(): s.failures}),
            (SGL + "requests", "Total number of requests by route", ["route"], m.requests),
            (SGL + "pd_requests", "Total PD requests by route", ["route"], m.requests),
            (SGL + "request_errors", "Total number of request errors by route and error type",
             ["route", "error_type"], m.errors),
            (SGL + "pd_errors", "Total PD errors by error type", ["error_type"],
             _grouped(m.errors, lambda k: k[1])),
            (SGL + "retries", "Total number of request retries by route", ["route"],
             _grouped(m.retries, lambda k: k[1])),
            (SGL + "processed_requests", "Total requests processed by each worker", ["worker"],
             _grouped(m.sent, lambda k: k[1])),
            (SGL + "pd_prefill_requests", "Total prefill requests per worker", ["worker"],
             _grouped(m.sent, _of("prefill"))),
            (SGL + "pd_decode_requests", "Total decode requests per worker", ["worker"],
             _grouped(m.sent, _of("decode"))),
            (SGL + "pd_prefill_errors", "Total prefill server errors", ["worker"],
             _grouped(m.failed, _of("prefill"))),
            (SGL + "pd_decode_errors", "Total decode server errors", ["worker"],
             _grouped(m.failed, _of("decode"))),
            (SGL + "pd_stream_errors", "Total streaming errors per worker", ["worker"],
             m.streams_lost),
            (SGL + "policy_decisions", "Total routing policy decisions by policy and worker",
             ["policy", "worker"], _grouped(m.decisions, lambda k: (policy(k[0]), k[1]))),
            (SGL + "cache_hits", "Total cache hits", [], {(): s.hits}),
            (SGL + "cache_misses", "Total cache misses", [], {(): s.misses}),
            (SGL + "load_balancing_events", "Total load balancing trigger events", [],
             {(): s.rebalanced}),
            (SMG + "router_requests",
             "Total routed requests by router_type, backend_type, connection_mode, model, "
             "endpoint, streaming", [*route_labels, "streaming"], smg_requests),
            (SMG + "router_request_errors",
             "Router errors by router_type, backend_type, connection_mode, model, endpoint, "
             "error_type", [*route_labels, "error_type"],
             _grouped(m.errors, lambda k: (*_ROUTER, _endpoint(k[0]),
                                           _ERROR_TYPES.get(k[1], "backend_error")))),
            (SMG + "worker_selection",
             "Worker selection events by worker_type, connection_mode, model, policy",
             ["worker_type", "connection_mode", "model", "policy"],
             _grouped(m.decisions, lambda k: (k[0], *_WORKER, policy(k[0])))),
            (SMG + "worker_retries", "Total retry attempts by worker_type and endpoint",
             ["worker_type", "endpoint"], _grouped(m.retries, lambda k: (k[0], _endpoint(k[1])))),
            (SMG + "worker_health_checks", "Health check results by worker_type and result",
             ["worker_type", "result"], m.health_checks),
        ]  # fmt: skip
        for name, doc, labels, values in counters:
            yield _labelled(CounterMetricFamily, name, doc, labels, values)
        running = _grouped(s.running, lambda k: k[1])  # (removed servers' too, while they run)
        running.update(dict.fromkeys((w.url for w in s.workers), 0))  # (idle: 0, not absent)
        health = {w.url: w.healthy for w in s.workers}
        registered, healthy = Counter(dict.fromkeys(MODES, 0)), Counter(dict.fromkeys(MODES, 0))
        for w in s.workers:
            registered[w.kind] += 1
            healthy[w.kind] += w.healthy
        gauges = [
            (SGL + "active_workers", "Number of currently active workers", [],
             {(): sum(healthy.values())}),
            (SGL + "worker_health", "Worker health status (1=healthy, 0=unhealthy)", ["worker"],
             health),
            (SGL + "running_requests", "Number of running requests per worker", ["worker"],
             running),
            (SGL + "worker_load", "Current load on each worker", ["worker"], running),
            (SGL + "tree_size", "Current tree size for cache-aware routing", ["worker"], s.trees),
            ("dsakv_router_workers", "Workers registered, by role", ["worker_type"], registered),
            ("dsakv_router_healthy_workers", "Workers registered and healthy, by role",
             ["worker_type"], healthy),
            (SMG + "worker_requests_active", "Currently running requests per worker", ["worker"],
             running),
            (SMG + "worker_health", "Worker health status (1=healthy, 0=unhealthy)", ["worker"],
             health),
            (SMG + "worker_pool_size",
             "Current worker pool size by worker_type, connection_mode, model",
             ["worker_type", "connection_mode", "model"],
             {(kind, *_WORKER): n for kind, n in registered.items()}),
        ]  # fmt: skip
        for name, doc, labels, values in gauges:
            yield _labelled(GaugeMetricFamily, name, doc, labels, values)
        for name, doc, labels, by in [
            (SGL + "request_duration_seconds", "Request duration in seconds by route",
             ["route"], lambda route: route),
            (SGL + "pd_request_duration_seconds", "PD request duration by route", ["route"],
             lambda route: route),
            (SMG + "router_request_duration_seconds",
             "Router request duration by router_type, backend_type, connection_mode, model, "
             "endpoint", route_labels, lambda route: (*_ROUTER, _endpoint(route))),
        ]:  # fmt: skip
            yield _histogram(name, doc, labels, _summed(m.durations, by))


def _endpoint(route: str) -> str:
    return _ENDPOINTS.get(route, "other")


def _of(kind: str) -> Callable[[tuple[str, str]], str | None]:
    """The server of a (kind, server) key of `kind`, else None (left out: `_grouped`)."""
    return lambda key: key[1] if key[0] == kind else None


def _grouped(counts: Mapping[Hashable, float], by: Callable[[Hashable], Hashable]) -> Counter:
    """`counts` summed by `by(key)` (the server, the error type, another name's labels), of
    the keys it gives no None."""
    out: Counter = Counter()
    for key, n in counts.items():
        if (group := by(key)) is not None:
            out[group] += n
    return out


def _summed(
    durations: Mapping[str, list[float]], by: Callable[[str], Hashable]
) -> dict[Hashable, list[float]]:
    """`RouterMetrics.durations` summed bucket by bucket by `by(route)`."""
    out: dict[Hashable, list[float]] = {}
    for route, counts in durations.items():
        into = out.setdefault(by(route), [0.0] * len(counts))
        for i, n in enumerate(counts):
            into[i] += n
    return out


def _labelled(family: type, name: str, doc: str, labels: list[str], values: Mapping) -> PromMetric:
    """A family of one sample per key of `values` (a label's value, or a tuple of them:
    `()` for a family with no labels)."""
    m = family(name, doc, labels=labels)
    for key, value in sorted(values.items()):
        m.add_metric(list(key) if isinstance(key, tuple) else [key], float(value))
    return m


def _histogram(
    name: str, doc: str, labels: list[str], values: Mapping[Hashable, list[float]]
) -> HistogramMetricFamily:
    """A histogram family of one series per key of `values` (as `_labelled`'s), each
    `RouterMetrics.durations`' bucket counts and sum."""
    rows = (
        (list(key) if isinstance(key, tuple) else [key], counts[:-1], counts[-1])
        for key, counts in sorted(values.items())
    )
    return histogram_family(name, doc, labels, _BUCKETS, rows)
