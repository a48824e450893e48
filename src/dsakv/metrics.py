"""Prometheus metrics: engine counters read at scrape time, plus per-request latencies.

A leaf beside errors.py (it needs only prometheus_client): the server's /metrics and
`LLM.get_metrics` (the engine package) both build on it.

Each app gets its own `CollectorRegistry`, so several servers (or tests) in one process
never clash. The engine snapshot comes from the engine thread (`AsyncEngine.counters`)
right before rendering, or, while one long step holds that thread, the last one it took:
either way gauges are consistent with one another.

Every value is rendered under up to three names: dsakv's (`dsakv_*`), vLLM's (`vllm:*`)
and SGLang's (`sglang:*`), so the tools built around those servers' names (the Gateway API
Inference Extension's endpoint picker, routers, autoscaling rules, dashboards) read a dsakv
server as they read theirs. Engine values and request counts are kept once and read under
each name at scrape time; a per-request measure (`_HISTOGRAMS`: latencies, vLLM's phases,
token counts and parameters) is observed into each name's own histogram (its server's
buckets) as a request ends; the tokens of each engine step (vLLM's iteration_tokens_total)
are counted by the engine into fixed buckets (`STEP_TOKEN_BOUNDS`) and read as the rest of its
counters. The server
(`RequestTimes`, fed its handlers' updates) and `LLM` (`LoopTimes`, fed its loop's steps)
observe them alike; `LLM.get_metrics` reads the vLLM ones as vLLM's does (`vllm_metrics`).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Literal, NamedTuple, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import Counter as PromCounter
from prometheus_client import Histogram as PromHistogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.core import Metric as PromMetric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

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
        "Prompt tokens served from the prefix cache (device pages, host tier, L3)",
    ),
    "prefix_device_hit_tokens": (
        "prefix_device_hit_tokens",
        "counter",
        "Prompt tokens served from the prefix cache's device pages",
    ),
    "prefix_external_query_tokens": (
        "prefix_external_query_tokens",
        "counter",
        "Prompt tokens past the device hit, looked up in the host tier and L3 (with one on)",
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
    "prefix_pages_evicted": (
        "prefix_cache_pages_evicted",
        "counter",
        "Prefix-cache device pages evicted (to the host tier, or dropped)",
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


VLLM, SGLANG = "vllm:", "sglang:"

# vLLM's iteration_tokens_total buckets. The engine counts each step's tokens into them
# (`EngineStats.ran`, `bucket_index`) and reports the counts among its counters, one key a
# bucket (`+Inf` last, not cumulative): read at scrape time, summed over DP ranks as every
# count is. So under DP the histogram's count is every rank's steps that ran tokens, while
# dsakv_engine_steps_total is rank 0's (`DPEngine.counters`): they agree only at dp = 1.
STEP_TOKEN_BOUNDS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
STEP_TOKEN_KEYS = (*(f"step_tokens_le_{b}" for b in STEP_TOKEN_BOUNDS), "step_tokens_le_inf")


@dataclass(frozen=True)
class LoraRequests:
    """The requests on each LoRA adapter, by its name: running, and waiting (a PD decode
    server's adopted ones too, waiting for a slot); `Engine.lora_requests`, beside the
    counters (names are not counters), for vLLM's lora_requests_info (`_lora_info`)."""

    running: Mapping[str, int]
    waiting: Mapping[str, int]

    @classmethod
    def of(cls, running: Iterable[Any], waiting: Iterable[Any]) -> LoraRequests:
        """From requests (`params.lora_name`; the base model's left out)."""

        def count(reqs: Iterable[Any]) -> dict[str, int]:
            out: dict[str, int] = {}
            for name in (r.params.lora_name for r in reqs):
                if name is not None:
                    out[name] = out.get(name, 0) + 1
            return out

        return cls(count(running), count(waiting))


# Values computed from a snapshot (`_derived`): key -> (dsakv name or None, kind, help)
_DERIVED: dict[str, tuple[str | None, str, str]] = {
    "prefix_cache_hit_rate": (
        "prefix_cache_hit_rate",
        "gauge",
        "Prefix-cache hit tokens / prompt tokens (since the start)",
    ),
    "spec_accept_length": (
        "spec_accept_length",
        "gauge",
        "Mean tokens emitted per verification of drafts (accepted drafts + 1)",
    ),
    "spec_accept_rate": (
        "spec_accept_rate",
        "gauge",
        "Draft tokens accepted / draft tokens verified (since the start)",
    ),
    "prefix_external_hit_tokens": (
        None,
        "counter",
        "Prompt tokens served from the host tier and L3 (vLLM's KV connector's hits)",
    ),
    # vLLM's and SGLang's usage: the pages requests hold, the prefix cache's evictable ones
    # (no request holds them: freed on demand) counted free, as both count theirs
    "kv_cache_usage": (None, "gauge", "KV cache usage: pages requests hold / pages (0 to 1)"),
    "kv_tokens_used": (None, "gauge", "Tokens of the KV pages requests hold"),
    "kv_tokens_total": (None, "gauge", "Tokens the device KV pool holds"),
    "page_size": (None, "gauge", "Tokens per KV page"),
    # the tiers' page counts in tokens, as SGLang counts them (`_IN_TOKENS`)
    "host_tokens_used": (None, "gauge", "Tokens of the host-tier KV pages in use"),
    "host_tokens_total": (None, "gauge", "Tokens the host-tier KV pool holds"),
    "prefix_tokens_evicted": (
        None,
        "counter",
        "Tokens of the prefix-cache device pages evicted (to the host tier, or dropped)",
    ),
    "prefix_tokens_promoted": (
        None,
        "counter",
        "Tokens of the prefix-cache pages loaded back from the host tier",
    ),
    "l3_tokens_written": (None, "counter", "Tokens of the KV pages written to L3 storage"),
}
_IN_TOKENS = {
    "host_tokens_used": "host_pages_used",
    "host_tokens_total": "host_pages_total",
    "prefix_tokens_evicted": "prefix_pages_evicted",
    "prefix_tokens_promoted": "prefix_pages_promoted",
    "l3_tokens_written": "l3_pages_written",
}


class Tiered(NamedTuple):
    """A twin labelled as its KV tier's collector labels it (`EngineCollector.labels_of`),
    plus `extra` labels: SGLang's and vLLM's servers make the host tier's and storage's
    metrics only with that tier on, their radix cache's always (labelled by its class);
    `doc` for a family several keys fill."""

    name: str
    tier: Literal["host", "storage", "radix"]
    extra: tuple[tuple[str, str], ...] = ()
    doc: str = ""


def _offload_bytes(direction: str) -> Tiered:
    """vLLM's offloading connector's bytes copied one way (its transfer_type: media)."""
    doc = "KV bytes copied between the device and the host tier, by direction"
    return Tiered(VLLM + "kv_offload_total_bytes", "host", (("transfer_type", direction),), doc)


# The same values under vLLM's and SGLang's names (their servers' /metrics), by counter or
# `_DERIVED` key; their kind is the key's. A counter is named without `_total`, which the
# exposition appends, as prometheus_client's own counters do. The KV tiers' (`Tiered`):
# SGLang's HiCache host pool gauges and vLLM's offloading connector bytes with a host tier,
# SGLang's radix-cache eviction and load-back tokens, its storage (L3) prefetched and
# backed-up tokens with a storage backend.
_TWINS: dict[str, tuple[str | Tiered, ...]] = {
    "running_requests": (VLLM + "num_requests_running", SGLANG + "num_running_reqs"),
    "waiting_requests": (VLLM + "num_requests_waiting", SGLANG + "num_queue_reqs"),
    "kv_cache_usage": (VLLM + "kv_cache_usage_perc", SGLANG + "token_usage"),
    "kv_tokens_used": (SGLANG + "num_used_tokens",),
    "kv_tokens_total": (SGLANG + "max_total_num_tokens",),
    "pages_total": (SGLANG + "num_pages",),
    "page_size": (SGLANG + "page_size",),
    "gen_throughput": (SGLANG + "gen_throughput",),
    # vLLM's prefix-cache queries are the prompt tokens looked up (here counted on arrival:
    # each request is looked up once, a retracted one's re-admission finds its own pages)
    "prompt_tokens": (
        VLLM + "prompt_tokens",
        VLLM + "prefix_cache_queries",
        SGLANG + "prompt_tokens",
    ),
    "output_tokens": (VLLM + "generation_tokens", SGLANG + "generation_tokens"),
    # SGLang's cached tokens are every tier's; vLLM's prefix-cache hits the device's, its
    # KV connector's (an offloading or storage one: the host tier, L3) external ones
    "prefix_hit_tokens": (SGLANG + "cached_tokens",),
    "prefix_device_hit_tokens": (VLLM + "prefix_cache_hits",),
    "prefix_external_query_tokens": (VLLM + "external_prefix_cache_queries",),
    "prefix_external_hit_tokens": (VLLM + "external_prefix_cache_hits",),
    "prefix_cache_hit_rate": (SGLANG + "cache_hit_rate",),
    "retractions": (VLLM + "num_preemptions", SGLANG + "num_retracted_requests"),
    "spec_verify_steps": (VLLM + "spec_decode_num_drafts",),
    "spec_draft_tokens": (VLLM + "spec_decode_num_draft_tokens",),
    "spec_accepted_tokens": (VLLM + "spec_decode_num_accepted_tokens",),
    "spec_accept_length": (SGLANG + "spec_accept_length",),
    "spec_accept_rate": (SGLANG + "spec_accept_rate",),
    "host_tokens_used": (Tiered(SGLANG + "hicache_host_used_tokens", "host"),),
    "host_tokens_total": (Tiered(SGLANG + "hicache_host_total_tokens", "host"),),
    "host_bytes_to_host": (_offload_bytes("GPU_to_CPU"),),
    "host_bytes_to_device": (_offload_bytes("CPU_to_GPU"),),
    "prefix_tokens_evicted": (Tiered(SGLANG + "evicted_tokens", "radix"),),
    "prefix_tokens_promoted": (Tiered(SGLANG + "load_back_tokens", "radix"),),
    # tokens read from storage into use (SGLang's: into the host tier, per prefetch), and
    # written to it (a page already stored is not written again, nor counted)
    "l3_hit_tokens": (Tiered(SGLANG + "prefetched_tokens", "storage"),),
    "l3_tokens_written": (Tiered(SGLANG + "backuped_tokens", "storage"),),
}


def bucket_index(bounds: Sequence[float], value: float) -> int:
    """The bucket of fixed `bounds` that `value` counts in, as a histogram kept as one count
    a bucket (not cumulative, `+Inf` last: index `len(bounds)`) counts it: the first whose
    bound is >= it, Prometheus' `le`."""
    return bisect_left(bounds, value)


def histogram_family(
    name: str,
    doc: str,
    labels: Sequence[str],
    bounds: Sequence[float],
    rows: Iterable[tuple[Sequence[str], Sequence[float], float]],
) -> HistogramMetricFamily:
    """A histogram family from counts kept by `bucket_index` over `bounds`: one series a
    row of (label values, bucket counts, sum); the exposition's buckets are cumulative."""
    m = HistogramMetricFamily(name, doc, labels=list(labels))
    les = [floatToGoString(b) for b in bounds] + ["+Inf"]
    for values, counts, total in rows:
        m.add_metric(list(values), list(zip(les, accumulate(counts))), total)
    return m


def family_labels(model_name: str, role: str = "null") -> dict[str, dict[str, str]]:
    """Each family's labels, by prefix: vLLM's `engine` is "0", one series as dsakv's is
    under DP attention too (the ranks' sum: an endpoint picker reads a server's first
    series); SGLang's `engine_type` is its PD role (`role`: SGLang's disaggregation_mode)."""
    engine_type = "unified" if role == "null" else role
    return {
        PREFIX: {"model_name": model_name},
        VLLM: {"model_name": model_name, "engine": "0"},
        SGLANG: {"model_name": model_name, "engine_type": engine_type},
    }


def _family_of(name: str) -> str:
    return next(p for p in (VLLM, SGLANG, PREFIX) if name.startswith(p))


def held_pages(c: Mapping[str, float]) -> float:
    """Device KV pages requests hold: the used ones less the prefix cache's evictable ones
    (what vLLM's and SGLang's usage count, and SGLang's /get_load)."""
    return c.get("pages_used", 0) - c.get("pages_evictable", 0)


def _derived(snap: Mapping[str, float], page_size: int | None) -> dict[str, float]:
    """`_DERIVED`'s values (the token ones only with `page_size`)."""
    prompt, steps, drafts, total = (
        snap.get(k, 0)
        for k in ("prompt_tokens", "spec_verify_steps", "spec_draft_tokens", "pages_total")
    )
    accepted = snap.get("spec_accepted_tokens", 0)
    hits = snap.get("prefix_hit_tokens", 0)
    out = {
        "prefix_cache_hit_rate": hits / prompt if prompt else 0.0,
        "prefix_external_hit_tokens": hits - snap.get("prefix_device_hit_tokens", 0),
        "spec_accept_length": 1 + accepted / steps if steps else 0,
        "spec_accept_rate": accepted / drafts if drafts else 0.0,
        "kv_cache_usage": held_pages(snap) / total if total else 0.0,
    }
    if page_size is not None:
        out.update(
            kv_tokens_used=held_pages(snap) * page_size,
            kv_tokens_total=total * page_size,
            page_size=page_size,
        )
        out.update({k: snap.get(pages, 0) * page_size for k, pages in _IN_TOKENS.items()})
    return out


class EngineCollector(Collector):
    """Renders the latest engine counters snapshot (set by `update`) as metric families,
    each under its dsakv name and its vLLM and SGLang twins (`_TWINS`). `page_size`: the
    pool's, for SGLang's token counts and both servers' cache info (None: left out);
    `storage_backend`: the L3 tier's (`--hicache-storage-backend`), None without one;
    `max_loras`: the adapters resident at once under --enable-lora (None: LoRA off, no
    `vllm:lora_requests_info`)."""

    def __init__(
        self,
        model_name: str,
        page_size: int | None = None,
        role: str = "null",
        storage_backend: str | None = None,
        max_loras: int | None = None,
    ) -> None:
        self.page_size = page_size
        self.labels = family_labels(model_name, role)
        self.storage_backend = storage_backend
        self.max_loras = max_loras
        self.snapshot: Mapping[str, float] = {}
        self.lora: LoraRequests | None = None

    def update(self, snapshot: Mapping[str, float], lora: LoraRequests | None = None) -> None:
        """The counters to render, and the requests on each adapter read with them."""
        self.snapshot = dict(snapshot)
        self.lora = lora

    def collect(self) -> Iterator[PromMetric]:
        snap = self.snapshot
        if not snap:
            return
        if self.max_loras is not None:
            yield _lora_info(self.lora or LoraRequests({}, {}), self.max_loras)
        values = dict(snap)
        values.update(_derived(snap, self.page_size))
        steps = [values.pop(k, 0) for k in STEP_TOKEN_KEYS]
        yield self._step_tokens(steps, snap.get("computed_tokens", 0))
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}  # (by name: one each)
        for key, value in sorted(values.items()):
            name, kind, doc = _ENGINE_METRICS.get(key) or _DERIVED.get(key) or (key, "gauge", "")
            for twin in ([PREFIX + name] if name else []) + list(_TWINS.get(key, ())):
                full, labels = self.labels_of(twin, snap)
                if labels is None:
                    continue
                if (m := families.get(full)) is None:
                    family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                    help_ = getattr(twin, "doc", "") or doc or f"engine counter {key}"
                    m = families[full] = family(full, help_, labels=list(labels))
                m.add_metric(list(labels.values()), float(value))
        yield from families.values()
        if self.page_size is not None:  # (the endpoint picker's prefix-cache sizing)
            pages, size = str(int(snap.get("pages_total", 0))), str(self.page_size)
            info = {"engine": "0", "block_size": size, "num_gpu_blocks": pages}
            yield _info(VLLM + "cache_config_info", info)
            yield _info(SGLANG + "cache_config_info", {"page_size": size, "num_pages": pages})

    def labels_of(
        self, twin: str | Tiered, snap: Mapping[str, float]
    ) -> tuple[str, dict[str, str] | None]:
        """A twin's name and labels: its family's, or its tier's (None: that tier is off).
        SGLang's storage metrics carry its StorageMetricsCollector's labels (the backend,
        rank 0), its radix cache's the cache class (HiRadixCache with a host tier)."""
        if isinstance(twin, str):
            return twin, self.labels[_family_of(twin)]
        host = snap.get("host_pages_total", 0) > 0
        base: dict[str, str] | None
        if twin.tier == "host":
            base = self.labels[_family_of(twin.name)] if host else None
        elif twin.tier == "storage":
            backend = self.storage_backend
            base = (
                None if backend is None else dict(storage_backend=backend, tp_rank="0", dp_rank="0")
            )
        else:
            base = {"cache_type": "HiRadixCache" if host else "RadixCache"}
        return twin.name, None if base is None else {**base, **dict(twin.extra)}

    def _step_tokens(self, counts: Sequence[float], total: float) -> HistogramMetricFamily:
        """vLLM's iteration_tokens_total from the engine's bucket counts; its sum is every
        token the engine ran (a step that ran none is left out, adding nothing)."""
        labels = self.labels[VLLM]
        return histogram_family(
            VLLM + "iteration_tokens_total",
            "Tokens one engine step ran",
            list(labels),
            STEP_TOKEN_BOUNDS,
            [(list(labels.values()), counts, total)],
        )


def _lora_info(lora: LoraRequests, max_loras: int) -> GaugeMetricFamily:
    """vLLM's `lora_requests_info`: the adapters with requests running and waiting, each
    label their names comma-separated (vLLM's format), its value the time they were read,
    as vLLM sets it."""

    def names(counts: Mapping[str, int]) -> str:
        return ",".join(sorted(name for name, n in counts.items() if n > 0))

    labels = ["max_lora", "waiting_lora_adapters", "running_lora_adapters"]
    m = GaugeMetricFamily(
        VLLM + "lora_requests_info", "Running stats on LoRA requests.", labels=labels
    )
    m.add_metric([str(max_loras), names(lora.waiting), names(lora.running)], time.time())
    return m


def _info(name: str, labels: Mapping[str, str]) -> GaugeMetricFamily:
    """An info metric as vLLM and SGLang write theirs: a gauge at 1, the facts its labels."""
    m = GaugeMetricFamily(name, "KV cache settings (labels)", labels=list(labels))
    m.add_metric(list(labels.values()), 1.0)
    return m


# Histogram buckets: dsakv's, and vLLM's (PrometheusStatLogger's) and SGLang's defaults
# (its TokenizerMetricsCollector's and SchedulerMetricsCollector's), which their dashboards'
# quantiles are read from. `_BY_CONTEXT`, in place of a name's buckets: vLLM's 1-2-5 series
# up to the max_model_len (`_by_context`), known once a server is built (`Distribution`).
_DSAKV_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_VLLM_REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0)
_VLLM_REQUEST += (50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_SGLANG_TOKENS = (100, 300, 500, 700, 1000, 1500, 2000, 3000, 4000, 5000, 6000, 7000, 8000)
_SGLANG_TOKENS += (9000, 10000, 12000, 15000, 20000, 22000, 25000, 30000, 35000, 40000)
_SGLANG_TOKENS += (66000, 99000, 132000, 300000, 600000, 900000, 1100000)
_BY_CONTEXT: Literal["by_context"] = "by_context"

# What a request is measured by -> (help, {name: its buckets}): one value observed under
# each name. dsakv's own only for the latencies (its buckets resolve the milliseconds vLLM's
# request buckets, from 0.3 s, do not); counts under vLLM's and SGLang's.
_HISTOGRAMS: dict[str, tuple[str, dict[str, tuple[float, ...] | Literal["by_context"]]]] = {
    "ttft": (
        "Time to first token",
        {
            PREFIX + "time_to_first_token_seconds": _DSAKV_BUCKETS,
            VLLM + "time_to_first_token_seconds": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06)
            + (0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
            + (160.0, 640.0, 2560.0),
            SGLANG + "time_to_first_token_seconds": (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8)
            + (10, 20, 40, 60, 80, 100, 200, 400),
        },
    ),
    "e2e": (
        "Request latency",
        {
            PREFIX + "e2e_request_latency_seconds": _DSAKV_BUCKETS,
            VLLM + "e2e_request_latency_seconds": _VLLM_REQUEST,
            SGLANG + "e2e_request_latency_seconds": (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8)
            + (10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400),
        },
    ),
    "inter_token": (
        "Time between a request's consecutive output tokens (one per engine step)",
        {
            PREFIX + "inter_token_latency_seconds": (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04)
            + (0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60),
            VLLM + "inter_token_latency_seconds": (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2)
            + (0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
            SGLANG + "inter_token_latency_seconds": (0.002, 0.004, 0.006, 0.008, 0.01)
            + (0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1, 0.2, 0.4, 0.6, 0.8)
            + (1.0, 2.0, 4.0, 6.0, 8.0),
        },
    ),
    "queued": (
        "Time a request waited from its arrival to its first scheduling",
        {
            PREFIX + "request_queue_time_seconds": _DSAKV_BUCKETS,
            VLLM + "request_queue_time_seconds": _VLLM_REQUEST,
            SGLANG + "queue_time_seconds": (0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30)
            + (40, 50, 60, 70, 80, 90, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000)
            + (1200, 1400, 1600, 1800, 2000, 2500, 3000),
        },
    ),
    "prefill": (
        "Time from a request's first scheduling to its first token",
        {
            PREFIX + "request_prefill_time_seconds": _DSAKV_BUCKETS,
            VLLM + "request_prefill_time_seconds": _VLLM_REQUEST,
        },
    ),
    "decode": (
        "Time from a request's first token to its last",
        {
            PREFIX + "request_decode_time_seconds": _DSAKV_BUCKETS,
            VLLM + "request_decode_time_seconds": _VLLM_REQUEST,
        },
    ),
    "inference": (
        "Time from a request's first scheduling to its last token (prefill and decode)",
        {
            PREFIX + "request_inference_time_seconds": _DSAKV_BUCKETS,
            VLLM + "request_inference_time_seconds": _VLLM_REQUEST,
        },
    ),
    "prompt_tokens": (
        "Prompt tokens of a finished request (each choice)",
        {
            VLLM + "request_prompt_tokens": _BY_CONTEXT,
            SGLANG + "prompt_tokens_histogram": _SGLANG_TOKENS,
        },
    ),
    "generation_tokens": (
        "Tokens a finished request (each choice) generated",
        {
            VLLM + "request_generation_tokens": _BY_CONTEXT,
            SGLANG + "generation_tokens_histogram": _SGLANG_TOKENS,
        },
    ),
    "max_tokens": (
        "The max_tokens of a finished request (each choice; as the context cut it)",
        {VLLM + "request_params_max_tokens": _BY_CONTEXT},
    ),
    "n": (
        "The n of a request, once its choices all ended",
        {VLLM + "request_params_n": (1, 2, 5, 10, 20)},
    ),
    "most_tokens": (
        "The most tokens one of a request's choices generated, once they all ended",
        {VLLM + "request_max_num_generation_tokens": _BY_CONTEXT},
    ),
    "retractions": (
        "Times a finished request was retracted for lack of KV pages",
        {SGLANG + "num_retractions": (*range(11), 15, 20, 25, 30, 40, 50, 75, 100)},
    ),
}


def _by_context(max_model_len: int) -> tuple[int, ...]:
    """vLLM's `build_1_2_5_buckets`: 1, 2, 5, 10, 20, ... up to `max_model_len`."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class Distribution:
    """One measure (`_HISTOGRAMS`) under each of its names, each its own prometheus_client
    histogram with that name's buckets and its family's labels (dsakv's unlabelled):
    observing three costs microseconds and keeps the library's rendering (`_created`
    included)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        key: str,
        labels: Mapping[str, Mapping[str, str]],
        max_model_len: int,
    ) -> None:
        doc, names = _HISTOGRAMS[key]
        self.histograms: list[Any] = []
        for name, bounds in names.items():
            family = _family_of(name)
            shown = {} if family == PREFIX else labels[family]
            buckets = _by_context(max_model_len) if bounds == _BY_CONTEXT else bounds
            h = PromHistogram(name, doc, list(shown), registry=registry, buckets=buckets)
            self.histograms.append(h.labels(*shown.values()) if shown else h)

    def observe(self, value: float) -> None:
        for h in self.histograms:
            h.observe(value)


class _RequestCounts(Collector):
    """vLLM's and SGLang's request counts, read from `ServerMetrics.success` at scrape time
    (one count kept, whatever name it is read under)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[PromMetric]:
        m, labels = self.metrics, self.metrics.engine.labels
        (success,) = m.success.collect()
        done = {
            s.labels["finished_reason"]: s.value
            for s in success.samples
            if s.name.endswith("_total")
        }
        vllm = CounterMetricFamily(
            VLLM + "request_success",
            "Requests (each choice) finished, by finish reason",
            labels=[*labels[VLLM], "finished_reason"],
        )
        for reason, n in sorted(done.items()):
            vllm.add_metric([*labels[VLLM].values(), reason], n)
        yield vllm
        sglang = labels[SGLANG]
        for name, n in (
            ("num_requests", sum(done.values())),
            ("num_aborted_requests", done.get("abort", 0.0)),
        ):
            c = CounterMetricFamily(
                SGLANG + name, "Requests (each choice) finished", labels=list(sglang)
            )
            c.add_metric(list(sglang.values()), n)
            yield c


# vLLM's finish reasons (FINISH_REASON_STRINGS), dsakv's too: each one's series of
# request_success_total is there from the first scrape, at 0, as vLLM makes them
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


class ServerMetrics:
    """The app's registry: engine gauges/counters plus HTTP request and per-request
    metrics. `page_size`, `role` (SGLang's disaggregation_mode), `storage_backend` and
    `max_loras` as `EngineCollector` takes them; `max_model_len` bounds vLLM's token-count buckets, as its
    own."""

    def __init__(
        self,
        model_name: str,
        page_size: int | None = None,
        role: str = "null",
        *,
        max_model_len: int,
        storage_backend: str | None = None,
        max_loras: int | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.engine = EngineCollector(model_name, page_size, role, storage_backend, max_loras)
        self.registry.register(self.engine)
        self.requests = PromCounter(
            PREFIX + "http_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.success = PromCounter(  # (vLLM's request_success_total)
            PREFIX + "request_success",
            "Requests (each choice) finished, by finish reason",
            ["finished_reason"],
            registry=self.registry,
        )
        for reason in FINISH_REASONS:
            self.success.labels(reason)
        self.measures = {
            key: Distribution(self.registry, key, self.engine.labels, max_model_len)
            for key in _HISTOGRAMS
        }
        self.registry.register(_RequestCounts(self))

    def observe(self, key: str, value: float) -> None:
        self.measures[key].observe(value)

    def request(self) -> RequestTimes:
        """A tracker for one engine request (one choice) whose updates a handler reads."""
        return RequestTimes(self)

    def render(
        self, snapshot: Mapping[str, float] | None, lora: LoraRequests | None = None
    ) -> bytes:
        """/metrics: the engine's `snapshot` of counters and its `lora` requests read with
        it (`EngineCollector.update`; None: the last ones stay), and the server's own."""
        if snapshot is not None:
            self.engine.update(snapshot, lora)
        return generate_latest(self.registry)

    def vllm_metrics(
        self, snapshot: Mapping[str, float], lora: LoraRequests | None = None
    ) -> list[Metric]:
        """vLLM's `get_metrics_snapshot` over this registry: its `vllm:` families as `Metric`s
        (`LLM.get_metrics`)."""
        self.engine.update(snapshot, lora)
        return read_vllm_metrics(self.registry)


class Times(Protocol):
    """A request's stamps as `RequestTimes` reads them (`dsakv.engine.RequestMetrics`: a
    protocol, as this leaf imports nothing of the engine's)."""

    queued: float | None
    prefill: float | None
    decode: float | None
    inference: float | None
    retractions: int
    choices: Any  # its request's other choices (`dsakv.engine.request.Choices`), or None


class Progress(Protocol):
    """What `RequestTimes` reads of an update: the server's (`dsakv.server.runner.Update`),
    or `LoopTimes`'. `times` and `max_tokens` are read once it finished."""

    ttft_s: float | None
    latency_s: float | None
    token_gaps_s: Sequence[float]
    finished: bool
    finish_reason: str | None
    error: Any
    prompt_tokens: int
    completion_tokens: int
    times: Times | None
    max_tokens: int | None


class RequestTimes:
    """One engine request's (one choice's: vLLM counts its n child requests each) metrics,
    fed each update its handler reads. TTFT is taken at the first update that has it, the
    first token's, so a request aborted after it (a client gone mid-stream) still counts,
    as vLLM records TTFT when the token is produced; the rest needs an end, so only a
    request that finished (and did not fail) counts, as vLLM's: its e2e latency, its
    phases (queued, prefill, decode, inference: `RequestMetrics`), token counts and
    max_tokens; and a request's n, and the most tokens one of its choices generated, once
    its choices all finished so (vLLM's, at its last child; one aborted leaves it out, as
    it leaves its own latency out)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics, self.timed = metrics, False

    def observe(self, u: Progress) -> None:
        m = self.metrics
        if u.ttft_s is not None and not self.timed:
            self.timed = True
            m.observe("ttft", u.ttft_s)
        for gap in u.token_gaps_s:
            m.observe("inter_token", gap)
        if not u.finished:
            return
        m.success.labels(u.finish_reason or "abort").inc()
        if u.error is not None or u.latency_s is None:
            return
        m.observe("e2e", u.latency_s)
        m.observe("prompt_tokens", u.prompt_tokens)
        m.observe("generation_tokens", u.completion_tokens)
        if u.max_tokens:
            m.observe("max_tokens", u.max_tokens)
        t = u.times
        if t is None:
            return
        for key in ("queued", "prefill", "decode", "inference"):
            took = getattr(t, key)
            if took is not None:
                m.observe(key, took)
        m.observe("retractions", t.retractions)
        if t.choices is None:
            m.observe("n", 1)
            m.observe("most_tokens", u.completion_tokens)
        elif t.choices.ended(u.completion_tokens):
            m.observe("n", t.choices.n)
            m.observe("most_tokens", t.choices.most_tokens)


class _Stepped(NamedTuple):
    ttft_s: float | None
    latency_s: float | None
    token_gaps_s: tuple[float, ...]
    finished: bool
    finish_reason: str | None
    error: Any
    prompt_tokens: int
    completion_tokens: int
    times: Times
    max_tokens: int | None


class LoopTimes:
    """`RequestTimes` for requests an engine loop steps itself (`LLM`'s): a request's gap
    since its previous tokens is taken when a step returns it with more, as the server
    takes it when such a step's update arrives."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.open: dict[Any, tuple[RequestTimes, int, float | None]] = {}

    def stepped(self, reqs: Iterable[Any]) -> None:
        """Observe the requests (`Request`s) a step returned."""
        now = time.perf_counter()
        for r in reqs:
            times, had, last = self.open.get(r.rid) or (self.metrics.request(), 0, None)
            gaps: tuple[float, ...] = ()
            n = len(r.output_ids)
            if n > had:
                gaps, last = (() if last is None else (now - last,)), now
            m = r.metrics
            times.observe(
                _Stepped(
                    ttft_s=m.ttft,
                    latency_s=m.latency,
                    token_gaps_s=gaps,
                    finished=r.finished,
                    finish_reason=r.finish_reason,
                    error=r.error,
                    prompt_tokens=len(r.prompt_ids),
                    completion_tokens=n,
                    times=m,
                    max_tokens=r.params.max_tokens,
                )
            )
            if r.finished:
                self.open.pop(r.rid, None)
            else:
                self.open[r.rid] = (times, n, last)


# vLLM's reader types (vllm/v1/metrics/reader.py): what `LLM.get_metrics` returns


@dataclass
class Metric:
    """One series of a `vllm:` metric: its family name (a counter's without `_total`) and
    labels."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    """`buckets`: cumulative counts by upper bound as the exposition writes it ("0.5",
    "+Inf"); `count` is the "+Inf" one."""

    count: int
    sum: float
    buckets: dict[str, int]


def read_vllm_metrics(registry: CollectorRegistry) -> list[Metric]:
    """`registry`'s `vllm:` series as vLLM's reader returns them (counters and bucket
    counts as ints)."""
    out: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith(VLLM):
            continue
        if family.type == "gauge":
            out += [Gauge(family.name, s.labels, s.value) for s in family.samples]
        elif family.type == "counter":
            out += [
                Counter(family.name, s.labels, int(s.value))
                for s in family.samples
                if s.name.endswith("_total")
            ]
        elif family.type == "histogram":
            by: dict[str, dict[str, Any]] = {}
            for s in family.samples:
                labels = {k: v for k, v in s.labels.items() if k != "le"}
                h = by.setdefault(repr(sorted(labels.items())), {"labels": labels, "buckets": {}})
                if s.name.endswith("_bucket"):
                    h["buckets"][s.labels["le"]] = int(s.value)
                elif s.name.endswith("_sum"):
                    h["sum"] = s.value
            out += [
                Histogram(family.name, h["labels"], h["buckets"]["+Inf"], h["sum"], h["buckets"])
                for h in by.values()
            ]
    return out
