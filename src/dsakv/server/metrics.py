"""Prometheus metrics: engine counters read at scrape time, plus per-request latencies.

Each app gets its own `CollectorRegistry`, so several servers (or tests) in one process
never clash. The engine snapshot comes from the engine thread (`AsyncEngine.counters`)
right before rendering, or, while one long step holds that thread, the last one it took:
either way gauges are consistent with one another.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .runner import Update

PREFIX = "dsakv_"

# engine.counters() key -> (metric name, kind, help). Keys not listed become gauges.
_ENGINE_METRICS: dict[str, tuple[str, str, str]] = {
    "pages_used": ("kv_pages_used", "gauge", "Device KV pages in use (requests + prefix cache)"),
    "pages_total": ("kv_pages_total", "gauge", "Device KV pages in the pool"),
    "pages_cached": ("kv_pages_cached", "gauge", "Device KV pages held by the prefix cache"),
    "pages_evictable": (
        "kv_pages_evictable",
        "gauge",
        "Prefix-cache device pages no request holds (freed on demand)",
    ),
    "waiting_tokens": ("waiting_tokens", "gauge", "Tokens of the waiting requests (outputs too)"),
    "gen_throughput": (
        "gen_throughput",
        "gauge",
        "Output tokens per second over the engine's last 5-10 s",
    ),
    "host_pages_used": ("host_pages_used", "gauge", "Host-tier KV pages in use"),
    "host_pages_total": ("host_pages_total", "gauge", "Host-tier KV pages"),
    "running_requests": ("running_requests", "gauge", "Requests holding KV pages"),
    "waiting_requests": ("waiting_requests", "gauge", "Requests queued or retracted"),
    "peak_running_requests": ("peak_running_requests", "gauge", "Most requests running at once"),
    "bytes_per_token": ("kv_bytes_per_token", "gauge", "KV cache bytes per token (all layers)"),
    "index_k_bytes_per_token_saved": (
        "index_k_bytes_per_token_saved",
        "gauge",
        "KV bytes per token saved by eliding shared layers' index-K",
    ),
    "prompt_tokens": (  # per choice, as vLLM's prompt_tokens_total counts its n child requests
        "prompt_tokens",
        "counter",
        "Prompt tokens received (an n > 1 request's prompt counts n times)",
    ),
    "output_tokens": ("generation_tokens", "counter", "Tokens generated"),
    "computed_tokens": ("computed_tokens", "counter", "Tokens run through the model"),
    "prefix_hit_tokens": (
        "prefix_hit_tokens",
        "counter",
        "Prompt tokens served from the prefix cache",
    ),
    "retractions": ("retractions", "counter", "Requests retracted for lack of KV pages"),
    "retractions_to_host": (
        "retractions_to_host",
        "counter",
        "Retractions backed up to the host tier",
    ),
    "host_bytes_to_host": ("host_bytes_to_host", "counter", "KV bytes copied device -> host"),
    "host_bytes_to_device": ("host_bytes_to_device", "counter", "KV bytes copied host -> device"),
    "prefix_pages_demoted": (
        "prefix_cache_pages_demoted",
        "counter",
        "Prefix-cache pages evicted to the host tier (kept for a later hit)",
    ),
    "prefix_pages_promoted": (
        "prefix_cache_pages_promoted",
        "counter",
        "Prefix-cache pages loaded back from the host tier on a hit",
    ),
    "spec_draft_tokens": ("spec_draft_tokens", "counter", "Draft tokens verified (MTP or n-gram)"),
    "spec_accepted_tokens": (
        "spec_accepted_tokens",
        "counter",
        "Draft tokens accepted (MTP or n-gram)",
    ),
    "spec_verify_steps": (
        "spec_verify_steps",
        "counter",
        "Request-steps in which the target verified drafts",
    ),
    "finished_requests": ("finished_requests", "counter", "Requests finished"),
    "steps": ("engine_steps", "counter", "Engine steps run"),
    "step_time_s": ("engine_step_time_seconds", "counter", "Time spent in engine steps"),
    "decode_steps": (
        "decode_request_steps",
        "counter",
        "Request-steps that ran one token past the prompt (one per decoding request per "
        "step, with any drafts it verified)",
    ),
    "aborted_requests": (
        "aborted_requests",
        "counter",
        "Requests the engine aborted (one aborted before the engine took it counts only in "
        "request_success_total, finished_reason abort)",
    ),
    # L3 storage tier (dsakv.engine.l3)
    "l3_hits": ("l3_hits", "counter", "KV pages loaded from L3 storage"),
    "l3_hit_tokens": ("l3_hit_tokens", "counter", "Prompt tokens served from L3 storage"),
    "l3_misses": ("l3_misses", "counter", "L3 lookups that stopped at a missing or bad page"),
    "l3_lookups": ("l3_lookups", "counter", "L3 lookups started for new requests"),
    "l3_bytes_read": ("l3_bytes_read", "counter", "KV bytes read from L3 and verified"),
    "l3_bytes_written": ("l3_bytes_written", "counter", "KV bytes written to L3"),
    "l3_pages_written": ("l3_pages_written", "counter", "KV pages written to L3"),
    "l3_objects_evicted": ("l3_objects_evicted", "counter", "L3 objects evicted by the size cap"),
    "l3_corrupt_objects": (
        "l3_corrupt_objects",
        "counter",
        "L3 objects found truncated or failing their checksum (deleted)",
    ),
    "l3_write_failures": ("l3_write_failures", "counter", "L3 writes refused or failed"),
    "l3_writes_dropped": ("l3_writes_dropped", "counter", "L3 writes dropped: queue full"),
    "l3_prefetch_timeouts": (
        "l3_prefetch_timeouts",
        "counter",
        "L3 lookups cut short by the prefetch timeout",
    ),
    "l3_errors": (
        "l3_errors",
        "counter",
        "L3 operations that found the store unreachable or failed a write",
    ),
    # HiSparse (dsakv.engine.hisparse)
    "hisparse_device_tokens_total": (
        "hisparse_device_tokens_total",
        "gauge",
        "HiSparse device latent slots (hot buffers and prompts being prefilled)",
    ),
    "hisparse_device_tokens_used": (
        "hisparse_device_tokens_used",
        "gauge",
        "HiSparse device latent slots in use",
    ),
    "hisparse_host_tokens_total": (
        "hisparse_host_tokens_total",
        "gauge",
        "HiSparse logical tokens: latent in host memory, index-K on the device",
    ),
    "hisparse_host_tokens_used": (
        "hisparse_host_tokens_used",
        "gauge",
        "HiSparse logical tokens in use (requests + prefix cache)",
    ),
    "hisparse_hot_buffers": (
        "hisparse_hot_buffers",
        "gauge",
        "Requests decoding from a hot buffer",
    ),
    "hisparse_hits": ("hisparse_hits", "counter", "Top-k entries found in a hot buffer"),
    "hisparse_misses": ("hisparse_misses", "counter", "Top-k entries copied in from the host"),
    "hisparse_resolves": (
        "hisparse_resolves",
        "counter",
        "Hot-buffer resolutions (one per full layer per step)",
    ),
    "hisparse_rows_to_device": (
        "hisparse_rows_to_device",
        "counter",
        "Latent rows (one token, one layer) copied host -> device",
    ),
    "hisparse_bytes_to_device": (
        "hisparse_bytes_to_device",
        "counter",
        "Latent bytes copied host -> device",
    ),
    "hisparse_rows_to_host": (
        "hisparse_rows_to_host",
        "counter",
        "Latent rows written to the host (every computed token, every layer)",
    ),
    "hisparse_bytes_to_host": (
        "hisparse_bytes_to_host",
        "counter",
        "Latent bytes written to the host",
    ),
    "l3_write_queue": ("l3_write_queue", "gauge", "KV pages waiting to be written to L3"),
}


class EngineCollector(Collector):
    """Renders the latest engine counters snapshot (set by `update`) as metric families."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: Mapping[str, float] = {}

    def update(self, snapshot: Mapping[str, float]) -> None:
        self.snapshot = dict(snapshot)

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        labels = ["model_name"]
        for key, value in sorted(snap.items()):
            name, kind, doc = _ENGINE_METRICS.get(key, (key, "gauge", f"engine counter {key}"))
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            m = family(PREFIX + name, doc, labels=labels)
            m.add_metric([self.model_name], float(value))
            yield m
        if snap:
            prompt = snap.get("prompt_tokens", 0)
            rate = snap.get("prefix_hit_tokens", 0) / prompt if prompt else 0.0
            m = GaugeMetricFamily(
                PREFIX + "prefix_cache_hit_rate",
                "Prefix-cache hit tokens / prompt tokens",
                labels=labels,
            )
            m.add_metric([self.model_name], rate)
            yield m
            steps = snap.get("spec_verify_steps", 0)
            m = GaugeMetricFamily(
                PREFIX + "spec_accept_length",
                "Mean tokens emitted per verification of drafts (accepted drafts + 1)",
                labels=labels,
            )
            m.add_metric(
                [self.model_name], 1 + snap["spec_accepted_tokens"] / steps if steps else 0
            )
            yield m


class ServerMetrics:
    """The app's registry: engine gauges/counters plus HTTP request and latency metrics."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.engine = EngineCollector(model_name)
        self.registry.register(self.engine)
        self.requests = Counter(
            PREFIX + "http_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time to first token",
            buckets=buckets,
            registry=self.registry,
        )
        self.latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Request latency",
            buckets=buckets,
            registry=self.registry,
        )
        self.inter_token = Histogram(  # (vLLM's inter_token_latency_seconds)
            PREFIX + "inter_token_latency_seconds",
            "Time between a request's consecutive output tokens (one per engine step)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2)
            + (0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.success = Counter(  # (vLLM's request_success_total)
            PREFIX + "request_success",
            "Requests (each choice) finished, by finish reason",
            ["finished_reason"],
            registry=self.registry,
        )

    def request(self) -> RequestTimes:
        """A tracker for one engine request (one choice) whose updates a handler reads."""
        return RequestTimes(self)

    def render(self, snapshot: Mapping[str, float] | None) -> bytes:
        if snapshot is not None:
            self.engine.update(snapshot)
        return generate_latest(self.registry)


class RequestTimes:
    """One engine request's (one choice's: vLLM counts its n child requests each) metrics,
    fed each update its handler reads. TTFT is taken at the first update that has it, the
    first token's, so a request aborted after it (a client gone mid-stream) still counts,
    as vLLM records TTFT when the token is produced; e2e latency needs an end, so only a
    request that finished (and did not fail) has one, as vLLM's."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics, self.timed = metrics, False

    def observe(self, u: Update) -> None:
        m = self.metrics
        if u.ttft_s is not None and not self.timed:
            self.timed = True
            m.ttft.observe(u.ttft_s)
        for gap in u.token_gaps_s:
            m.inter_token.observe(gap)
        if u.finished:
            m.success.labels(u.finish_reason or "abort").inc()
            if u.error is None and u.latency_s is not None:
                m.latency.observe(u.latency_s)
