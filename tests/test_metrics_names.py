"""/metrics under vLLM's and SGLang's names (what endpoint pickers, routers, autoscalers and
dashboards read) beside dsakv's, one value each, and vLLM's offline `LLM.get_metrics()`."""

from __future__ import annotations

import json
import random
import time
from functools import partial

import httpx
import pytest

from dsakv.engine import LLM, EngineConfig, SamplingParams
from dsakv.errors import DsakvError
from dsakv.metrics import Counter, Gauge, Histogram

from .serving import TIMEOUT, engine_stops_stepping_at, grown, metric, scrape_metrics, serving

ENGINE_ARGS = dict(
    kv_cache_dtype="fp32", index_k_dtype="fp32", num_pages=64, page_size=16, device="cpu"
)
MODEL = "tiny"
VLLM = {"model_name": MODEL, "engine": "0"}
SGLANG = {"model_name": MODEL, "engine_type": "unified"}
# vLLM's PrometheusStatLogger buckets, which its Grafana dashboard's quantiles read
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5]
VLLM_TTFT += [5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]


@pytest.fixture(scope="module")
def served(glm_tiny):
    config = EngineConfig(model=glm_tiny, **ENGINE_ARGS)
    with serving(config, served_model_name=MODEL) as served:
        yield served


def _wait_idle(base: str) -> dict:
    deadline = time.monotonic() + TIMEOUT
    while True:
        m = scrape_metrics(base, labels=True)
        running, waiting, used, cached = (
            metric(m, "dsakv_" + k, model_name=MODEL)
            for k in ("running_requests", "waiting_requests", "kv_pages_used", "kv_pages_cached")
        )
        if running == waiting == 0 and used == cached:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


def test_vllm_and_sglang_names_report_dsakvs_values(served):
    """Each engine value under its three names, equal, and consistent with the requests:
    vLLM's counters with their `_total`, its `model_name`/`engine` labels, SGLang's
    `model_name`/`engine_type`; idle, nothing runs or waits and no page is held."""
    base = served[0]
    before = _wait_idle(base)
    usage = [0, 0]
    for prompt, n in (([5] * 20, 1), ([7] * 35, 2)):
        body = {"prompt": prompt, "max_tokens": 4, "ignore_eos": True, "n": n}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT).json()
        usage[0] += r["usage"]["prompt_tokens"] * n  # (each choice counts its prompt, as vLLM's)
        usage[1] += r["usage"]["completion_tokens"]
    m = _wait_idle(base)
    grew = partial(grown, before, m)
    dsakv = {"model_name": MODEL}
    twins = {  # dsakv's sample -> its vLLM and SGLang ones
        "dsakv_prompt_tokens_total": [
            ("vllm:prompt_tokens_total", VLLM),
            ("vllm:prefix_cache_queries_total", VLLM),
            ("sglang:prompt_tokens_total", SGLANG),
        ],
        "dsakv_generation_tokens_total": [
            ("vllm:generation_tokens_total", VLLM),
            ("sglang:generation_tokens_total", SGLANG),
        ],
        "dsakv_prefix_hit_tokens_total": [("sglang:cached_tokens_total", SGLANG)],
        "dsakv_prefix_device_hit_tokens_total": [("vllm:prefix_cache_hits_total", VLLM)],
        "dsakv_retractions_total": [
            ("vllm:num_preemptions_total", VLLM),
            ("sglang:num_retracted_requests_total", SGLANG),
        ],
        "dsakv_running_requests": [
            ("vllm:num_requests_running", VLLM),
            ("sglang:num_running_reqs", SGLANG),
        ],
        "dsakv_waiting_requests": [
            ("vllm:num_requests_waiting", VLLM),
            ("sglang:num_queue_reqs", SGLANG),
        ],
        "dsakv_prefix_cache_hit_rate": [("sglang:cache_hit_rate", SGLANG)],
        "dsakv_gen_throughput": [("sglang:gen_throughput", SGLANG)],
        "dsakv_kv_pages_total": [("sglang:num_pages", SGLANG)],
        "dsakv_spec_draft_tokens_total": [("vllm:spec_decode_num_draft_tokens_total", VLLM)],
    }
    for own, others in twins.items():
        for name, labels in others:
            assert metric(m, name, **labels) == metric(m, own, **dsakv), (own, name)
    assert grew("vllm:prompt_tokens_total", **VLLM) == usage[0] == 20 + 2 * 35
    assert grew("vllm:generation_tokens_total", **VLLM) == usage[1] == 3 * 4
    assert metric(m, "vllm:prefix_cache_hits_total", **VLLM) > 0  # (the second choice's prompt)
    for name, labels in (("vllm:num_requests_running", VLLM), ("sglang:num_queue_reqs", SGLANG)):
        assert metric(m, name, **labels) == 0
    assert metric(m, "vllm:kv_cache_usage_perc", **VLLM) == 0  # (cached pages no request holds)
    assert metric(m, "sglang:token_usage", **SGLANG) == 0
    assert metric(m, "sglang:page_size", **SGLANG) == 16
    assert metric(m, "sglang:max_total_num_tokens", **SGLANG) == 64 * 16
    info = {"engine": "0", "block_size": "16", "num_gpu_blocks": "64"}
    assert metric(m, "vllm:cache_config_info", **info) == 1
    assert metric(m, "sglang:cache_config_info", page_size="16", num_pages="64") == 1

    # Request latencies: one observation each, under each name with its server's buckets
    for suffix in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        counts = [
            grew(f"dsakv_{suffix}_count"),
            grew(f"vllm:{suffix}_count", **VLLM),
            grew(f"sglang:{suffix}_count", **SGLANG),
        ]
        assert counts == [3, 3, 3], suffix
        sums = [metric(m, f"dsakv_{suffix}_sum"), metric(m, f"vllm:{suffix}_sum", **VLLM)]
        assert sums[0] == sums[1] == metric(m, f"sglang:{suffix}_sum", **SGLANG)
    itl = "inter_token_latency_seconds"
    assert grew(f"vllm:{itl}_count", **VLLM) == grew(f"dsakv_{itl}_count") == 3 * 3
    les = [
        float(dict(labels)["le"])
        for (name, labels) in m
        if name == "vllm:time_to_first_token_seconds_bucket"
    ]
    assert les == [*VLLM_TTFT, float("inf")]
    ok = grew("vllm:request_success_total", **VLLM, finished_reason="length")
    assert ok == grew("dsakv_request_success_total", finished_reason="length") == 3
    assert grew("sglang:num_requests_total", **SGLANG) == 3


def test_kv_cache_usage_counts_the_pages_requests_hold(served):
    """Mid-request: vLLM's kv_cache_usage_perc and SGLang's token_usage are the pages
    requests hold over the pool (the prefix cache's evictable pages free, as both count
    theirs), SGLang's num_used_tokens those pages' tokens; one request runs."""
    base, async_engine = served
    _wait_idle(base)
    body = {"prompt": [9] * 40, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with (
        engine_stops_stepping_at(async_engine, tokens=4),
        httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=TIMEOUT) as r,
    ):
        lines = r.iter_lines()
        while not (line := next(lines)).startswith("data: {"):
            pass
        assert json.loads(line[6:])["choices"][0]["text"] is not None
        m = scrape_metrics(base, labels=True)
    _wait_idle(base)
    pages = {k: metric(m, f"dsakv_kv_pages_{k}", model_name=MODEL) for k in ("used", "evictable")}
    held = pages["used"] - pages["evictable"]
    assert held >= 3  # 40 prompt tokens and the first outputs, in 16-token pages
    usage = metric(m, "vllm:kv_cache_usage_perc", **VLLM)
    assert 0 < usage <= 1 and usage == held / 64 == metric(m, "sglang:token_usage", **SGLANG)
    assert metric(m, "sglang:num_used_tokens", **SGLANG) == held * 16
    assert metric(m, "vllm:num_requests_running", **VLLM) == 1
    assert metric(m, "sglang:num_running_reqs", **SGLANG) == 1


def test_tier_metrics_only_for_the_tiers_a_server_has(served):
    """Without a host tier or a storage backend, SGLang's HiCache and storage metrics and
    vLLM's offloading ones are left out, as those servers make them only with the tier on
    (test_metrics_tiers: with them); SGLang's radix-cache counts are there, its plain
    RadixCache's (its eviction count too, read from dsakv's: 72 full pages of prompts
    through the 64-page pool evict some)."""
    base = served[0]
    for seed in range(6):
        prompt = [random.Random(seed).randrange(256) for _ in range(12 * 16)]
        body = {"prompt": prompt, "max_tokens": 1}
        httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT).raise_for_status()
    m = _wait_idle(base)
    names = {name for name, _ in m}
    absent = ["sglang:hicache_host_used_tokens", "sglang:hicache_host_total_tokens"]
    absent += ["sglang:prefetched_tokens_total", "sglang:backuped_tokens_total"]
    assert names.isdisjoint([*absent, "vllm:kv_offload_total_bytes_total"])
    evicted = metric(m, "dsakv_prefix_cache_pages_evicted_total", model_name=MODEL)
    assert evicted > 0
    assert metric(m, "sglang:evicted_tokens_total", cache_type="RadixCache") == 16 * evicted
    assert metric(m, "sglang:load_back_tokens_total", cache_type="RadixCache") == 0
    assert metric(m, "sglang:spec_accept_rate", **SGLANG) == 0  # (no drafts)
    # every hit is the device's: vLLM's external (KV connector) ones are there, at 0
    hits = metric(m, "dsakv_prefix_hit_tokens_total", model_name=MODEL)
    assert metric(m, "vllm:prefix_cache_hits_total", **VLLM) == hits
    for name in ("external_prefix_cache_queries_total", "external_prefix_cache_hits_total"):
        assert metric(m, f"vllm:{name}", **VLLM) == 0, name


def test_llm_get_metrics_is_vllms_offline_snapshot(glm_tiny):
    """vLLM's LLM.get_metrics(): its vllm: metrics as Counter, Gauge and Histogram, with
    the offline requests' latencies; only with disable_log_stats=False, as vLLM's."""
    with (
        LLM(glm_tiny, **ENGINE_ARGS) as plain,
        pytest.raises(DsakvError, match="disable_log_stats=False"),
    ):
        plain.get_metrics()
    with LLM(glm_tiny, disable_log_stats=False, **ENGINE_ARGS) as llm:
        params = SamplingParams(max_tokens=4, ignore_eos=True, n=2)
        outs = llm.generate([[5] * 20, [7] * 33], params, use_tqdm=False)
        metrics = llm.get_metrics()
        counters = llm.engine.counters()
    assert all(m.name.startswith("vllm:") for m in metrics)
    by = {m.name: m for m in metrics if "finished_reason" not in m.labels}
    assert all(m.labels == {"model_name": glm_tiny, "engine": "0"} for m in by.values()
               if m.name != "vllm:cache_config_info")  # fmt: skip
    prompt = by["vllm:prompt_tokens"]
    assert isinstance(prompt, Counter) and prompt.value == counters["prompt_tokens"]
    assert prompt.value == sum(len(o.prompt_token_ids) * 2 for o in outs) == 2 * (20 + 33)
    assert by["vllm:generation_tokens"].value == 4 * 4
    assert isinstance(by["vllm:num_requests_running"], Gauge)
    assert by["vllm:num_requests_running"].value == 0
    ttft, itl = by["vllm:time_to_first_token_seconds"], by["vllm:inter_token_latency_seconds"]
    assert isinstance(ttft, Histogram) and ttft.count == 4 and ttft.sum > 0
    assert list(ttft.buckets) == [str(b) for b in VLLM_TTFT] + ["+Inf"]
    assert ttft.buckets["+Inf"] == ttft.count
    assert itl.count == 4 * 3  # one gap per step after each choice's first token
    assert by["vllm:e2e_request_latency_seconds"].count == 4
    ok = {m.labels["finished_reason"]: m.value for m in metrics if m.name == "vllm:request_success"}
    assert ok["length"] == 4 and sum(ok.values()) == 4  # (every reason's series, at 0 but one)
