"""The KV tiers' values under vLLM's and SGLang's names, where those servers have a metric for
the same quantity, read from the count dsakv keeps: SGLang's HiCache host pool gauges,
radix-cache eviction and load-back tokens, storage (L3) prefetched and backed-up tokens;
vLLM's offloading connector bytes each way and its prefix-cache hits split into the
device's and its KV connector's (the host tier's and L3's); SGLang's speculative acceptance
rate. One server with a host tier, a file L3 store and n-gram drafts; its requests demote,
promote, write and read L3."""

from __future__ import annotations

import random
import time

import httpx
import pytest

from dsakv.engine import EngineConfig

from .conftest import synchronous_l3
from .serving import TIMEOUT, metric, scrape_metrics, serving

PS = 16
MODEL = "tiny"
DSAKV = {"model_name": MODEL}
VLLM = {"model_name": MODEL, "engine": "0"}
SGLANG = {"model_name": MODEL, "engine_type": "unified"}
STORAGE = {"storage_backend": "file", "tp_rank": "0", "dp_rank": "0"}  # SGLang's, rank 0
HICACHE = {"cache_type": "HiRadixCache"}
PREFIX_HITS = ("prefix_cache_hits", "external_prefix_cache_hits")  # vLLM's: device, tiers
# 150 tokens: 9 full pages; with 8 outputs a request holds 10 of the 24 device pages
PROMPTS = [[random.Random(s).randrange(0, 256) for _ in range(150)] for s in range(3)]


@pytest.fixture(scope="module")
def served(glm_tiny, tmp_path_factory):
    config = EngineConfig(
        model=glm_tiny,
        kv_cache_dtype="fp32",
        index_k_dtype="fp32",
        device="cpu",
        page_size=PS,
        num_pages=24,
        host_pool_gib=0.05,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path_factory.mktemp("l3")),
        speculative_algorithm="ngram",
    )
    with serving(config, served_model_name=MODEL) as (base, async_engine):
        synchronous_l3(async_engine.engine.l3)  # (a lookup sees every page written before it)
        yield base


def _complete(base: str, prompt: list[int]) -> None:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT).raise_for_status()


def _idle(base: str) -> dict:
    """/metrics once nothing runs and L3 has written what it was given."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        m = scrape_metrics(base, labels=True)
        busy = ("running_requests", "waiting_requests", "l3_write_queue")
        if not any(metric(m, f"dsakv_{k}", **DSAKV) for k in busy):
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


def _twins_read_dsakvs_counts(m: dict) -> None:
    def own(name: str) -> float:
        return metric(m, f"dsakv_{name}", **DSAKV)

    host = {
        "sglang:hicache_host_used_tokens": PS * own("host_pages_used"),
        "sglang:hicache_host_total_tokens": PS * own("host_pages_total"),
    }
    for name, value in host.items():
        assert metric(m, name, **SGLANG) == value, name
    for direction, name in (("GPU_to_CPU", "to_host"), ("CPU_to_GPU", "to_device")):
        offloaded = metric(m, "vllm:kv_offload_total_bytes_total", **VLLM, transfer_type=direction)
        assert offloaded == own(f"host_bytes_{name}_total"), direction
    radix = {
        "sglang:evicted_tokens_total": "prefix_cache_pages_evicted_total",
        "sglang:load_back_tokens_total": "prefix_cache_pages_promoted_total",
    }
    for name, pages in radix.items():
        assert metric(m, name, **HICACHE) == PS * own(pages), name
    assert metric(m, "sglang:prefetched_tokens_total", **STORAGE) == own("l3_hit_tokens_total")
    written = PS * own("l3_pages_written_total")
    assert metric(m, "sglang:backuped_tokens_total", **STORAGE) == written
    # vLLM's prefix-cache hits are the device's; the host tier's and L3's its connector's,
    # asked about the prompt past the device hit (every request here admitted once)
    device = own("prefix_device_hit_tokens_total")
    assert metric(m, "vllm:prefix_cache_hits_total", **VLLM) == device
    external = metric(m, "vllm:external_prefix_cache_hits_total", **VLLM)
    assert external == own("prefix_hit_tokens_total") - device
    queried = metric(m, "vllm:external_prefix_cache_queries_total", **VLLM)
    assert queried == own("prefix_external_query_tokens_total")
    assert queried == own("prompt_tokens_total") - device
    drafts, accepted = own("spec_draft_tokens_total"), own("spec_accepted_tokens_total")
    rate = metric(m, "sglang:spec_accept_rate", **SGLANG)
    assert rate == own("spec_accept_rate") == (accepted / drafts if drafts else 0)


def test_tier_metrics_read_the_tiers_counts(served):
    """Three prompts on 24 device pages: the third evicts the first's pages to the host
    tier, the first again loads them back; a flush drops both tiers, and the first comes
    back from L3, 9 pages. Each twin equals dsakv's count (in tokens where SGLang counts
    tokens) at every stage, under its server's labels; the pages from the host tier and L3
    are vLLM's external prefix-cache hits, not its prefix-cache (device) hits."""
    base = served
    for prompt in (*PROMPTS, PROMPTS[0]):
        _complete(base, prompt)
    m = _idle(base)
    _twins_read_dsakvs_counts(m)
    assert metric(m, "sglang:hicache_host_used_tokens", **SGLANG) > 0  # (demoted, still there)
    for name in ("sglang:evicted_tokens_total", "sglang:load_back_tokens_total"):
        assert metric(m, name, **HICACHE) > 0, name
    for direction in ("GPU_to_CPU", "CPU_to_GPU"):
        assert metric(m, "vllm:kv_offload_total_bytes_total", **VLLM, transfer_type=direction) > 0
    # every full page of the three prompts, once (a page already stored is not written again)
    assert metric(m, "sglang:backuped_tokens_total", **STORAGE) == 3 * 9 * PS
    assert metric(m, "sglang:prefetched_tokens_total", **STORAGE) == 0
    assert metric(m, "dsakv_spec_draft_tokens_total", **DSAKV) > 0
    # the fourth request's 9 pages: those loaded back from the host tier are external hits
    hits = {k: metric(m, f"vllm:{k}_total", **VLLM) for k in PREFIX_HITS}
    assert hits["external_prefix_cache_hits"] > 0
    assert sum(hits.values()) == 9 * PS == metric(m, "dsakv_prefix_hit_tokens_total", **DSAKV)

    httpx.post(f"{base}/flush_cache", timeout=TIMEOUT).raise_for_status()
    _complete(base, PROMPTS[0])
    m = _idle(base)
    _twins_read_dsakvs_counts(m)
    assert metric(m, "sglang:prefetched_tokens_total", **STORAGE) == 9 * PS
    assert metric(m, "sglang:backuped_tokens_total", **STORAGE) == 3 * 9 * PS
    after = {k: metric(m, f"vllm:{k}_total", **VLLM) for k in PREFIX_HITS}
    assert after["prefix_cache_hits"] == hits["prefix_cache_hits"]  # (L3's: none the device's)
    assert after["external_prefix_cache_hits"] == hits["external_prefix_cache_hits"] + 9 * PS
