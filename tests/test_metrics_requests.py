"""vLLM's and SGLang's per-request histograms (phases, token counts, parameters) and vLLM's
tokens per engine step, alike on a server's /metrics and through `LLM.get_metrics()`, and
vLLM's request_success series there at 0 from the first scrape; a beam search counted as its
step requests, and an aborted request in none of a finished one's histograms."""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import httpx
import pytest

from dsakv.engine import LLM, EngineConfig, SamplingParams
from dsakv.metrics import FINISH_REASONS, Counter, Histogram

from .serving import TIMEOUT, engine_stops_stepping_at, grown, metric, scrape_metrics, serving

ENGINE_ARGS = dict(
    kv_cache_dtype="fp32", index_k_dtype="fp32", num_pages=64, page_size=16, device="cpu"
)
MODEL = "tiny"
VLLM = {"model_name": MODEL, "engine": "0"}
SGLANG = {"model_name": MODEL, "engine_type": "unified"}
# (prompt, max_tokens, n) of each request; ignore_eos: each choice writes max_tokens
WORK = [([5] * 20, 4, 1), ([7] * 35, 3, 2), ([9] * 12, 5, 3)]
CHOICES = sum(n for _, _, n in WORK)
PROMPT_TOKENS = sum(len(p) * n for p, _, n in WORK)
GENERATED = sum(most * n for _, most, n in WORK)
PHASES = ("queue", "prefill", "decode", "inference")


@pytest.fixture(scope="module")
def served(glm_tiny):
    """A server, and its /metrics as first scraped, before any request."""
    config = EngineConfig(model=glm_tiny, **ENGINE_ARGS)
    with serving(config, served_model_name=MODEL) as (base, async_engine):
        yield base, async_engine, scrape_metrics(base, labels=True)


def _les(m: dict, name: str) -> list[float]:
    return [float(dict(labels)["le"]) for (n, labels) in m if n == name + "_bucket"]


def _vllm_1_2_5(most: int) -> list[float]:
    """vLLM's build_1_2_5_buckets(max_model_len)."""
    return [float(m * 10**e) for e in range(7) for m in (1, 2, 5) if m * 10**e <= most]


def test_request_success_is_there_at_zero_from_the_first_scrape(served):
    """Each finish reason vLLM has (its FINISH_REASON_STRINGS) is a series of
    request_success_total at 0 before any request, as vLLM pre-creates them (a rate() or
    a dashboard's sum by finished_reason finds them from the start); the new histograms
    are there empty, with vLLM's and SGLang's buckets."""
    base, async_engine, first = served
    vllms = ("stop", "length", "abort", "error", "repetition")  # its FINISH_REASON_STRINGS
    success = "vllm:request_success_total"
    assert {dict(labels)["finished_reason"] for n, labels in first if n == success} == {*vllms}
    for reason in vllms:
        assert metric(first, success, **VLLM, finished_reason=reason) == 0
        assert metric(first, "dsakv_request_success_total", finished_reason=reason) == 0
    assert metric(first, "sglang:num_requests_total", **SGLANG) == 0
    for name in (
        *(f"vllm:request_{p}_time_seconds" for p in PHASES),
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
        "vllm:request_params_n",
        "vllm:request_params_max_tokens",
        "vllm:request_max_num_generation_tokens",
        "vllm:iteration_tokens_total",
    ):
        assert metric(first, name + "_count", **VLLM) == 0, name
    for name in ("queue_time_seconds", "prompt_tokens_histogram", "num_retractions"):
        assert metric(first, f"sglang:{name}_count", **SGLANG) == 0, name
    inf = [float("inf")]
    most = async_engine.engine.max_model_len
    assert _les(first, "vllm:request_prompt_tokens") == _vllm_1_2_5(most) + inf
    assert _les(first, "vllm:request_params_max_tokens") == _vllm_1_2_5(most) + inf
    assert _les(first, "vllm:request_params_n") == [1, 2, 5, 10, 20, *inf]
    steps = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    assert _les(first, "vllm:iteration_tokens_total") == [*steps, *inf]
    vllm_request = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0]
    vllm_request += [50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0, *inf]
    for p in PHASES:
        assert _les(first, f"vllm:request_{p}_time_seconds") == vllm_request
    assert _les(first, "sglang:queue_time_seconds")[:4] == [0.0, 0.1, 0.2, 0.5]


def test_server_histograms_count_the_requests(served):
    """Requests of known prompt lengths, max_tokens and n: each choice is one observation
    of its prompt and generated tokens and its max_tokens, each request one of its n and
    its longest choice; the phases split each choice's latency as vLLM's do (queued +
    prefill = TTFT, prefill + decode = inference, queued + inference = e2e, from the same
    stamps); the steps' tokens add up to the tokens the engine ran."""
    base = served[0]
    before = scrape_metrics(base, labels=True)
    for prompt, most, n in WORK:
        body = {"prompt": prompt, "max_tokens": most, "n": n, "ignore_eos": True}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
    grew = partial(grown, before, scrape_metrics(base, labels=True))

    def vllm(name: str) -> tuple[float, float]:
        return grew(name + "_count", **VLLM), grew(name + "_sum", **VLLM)

    _check_counts(vllm)
    for name, total in (
        ("prompt_tokens_histogram", PROMPT_TOKENS),
        ("generation_tokens_histogram", GENERATED),
    ):
        assert grew(f"sglang:{name}_count", **SGLANG) == CHOICES, name
        assert grew(f"sglang:{name}_sum", **SGLANG) == total, name
    # (the phases under SGLang's and dsakv's names: the same observations)
    assert grew("sglang:queue_time_seconds_count", **SGLANG) == CHOICES
    assert (
        grew("sglang:queue_time_seconds_sum", **SGLANG)
        == vllm("vllm:request_queue_time_seconds")[1]
    )
    for p in PHASES:
        name = f"request_{p}_time_seconds"
        assert (grew(f"dsakv_{name}_count"), grew(f"dsakv_{name}_sum")) == vllm("vllm:" + name)
    assert grew("sglang:num_retractions_count", **SGLANG) == CHOICES
    assert grew("sglang:num_retractions_sum", **SGLANG) == grew(
        "vllm:num_preemptions_total", **VLLM
    )
    # (one rank: under DP the count is every rank's steps that ran tokens, the steps rank 0's)
    assert vllm("vllm:iteration_tokens_total") == (
        grew("dsakv_engine_steps_total", model_name=MODEL),
        grew("dsakv_computed_tokens_total", model_name=MODEL),
    )
    assert grew("vllm:request_success_total", **VLLM, finished_reason="length") == CHOICES
    n_by_le = {
        le: grew("vllm:request_params_n_bucket", **VLLM, le=le) for le in ("1.0", "2.0", "5.0")
    }
    assert n_by_le == {"1.0": 1, "2.0": 2, "5.0": 3}  # (cumulative: n = 1, 2, 3)


def test_llm_get_metrics_has_the_same_histograms(glm_tiny):
    """Offline, `LLM.get_metrics()` reads the same histograms the server serves, fed by its
    own loop: the same counts and the same splits of each request's latency."""
    with LLM(glm_tiny, disable_log_stats=False, **ENGINE_ARGS) as llm:
        plist = [SamplingParams(max_tokens=most, n=n, ignore_eos=True) for _, most, n in WORK]
        llm.generate([p for p, _, _ in WORK], plist, use_tqdm=False)
        metrics = llm.get_metrics()
        counters = llm.engine.counters()
    by = {m.name: m for m in metrics if "finished_reason" not in m.labels}
    assert all(isinstance(by[f"vllm:request_{p}_time_seconds"], Histogram) for p in PHASES)

    def vllm(name: str) -> tuple[float, float]:
        h = by[name]
        assert h.labels == {"model_name": glm_tiny, "engine": "0"}
        return h.count, h.sum

    _check_counts(vllm)
    assert vllm("vllm:iteration_tokens_total") == (counters["steps"], counters["computed_tokens"])
    success = {
        m.labels["finished_reason"]: m.value for m in metrics if m.name == "vllm:request_success"
    }
    assert all(isinstance(m, Counter) for m in metrics if m.name == "vllm:request_success")
    assert success == {"stop": 0, "length": CHOICES, "abort": 0, "error": 0, "repetition": 0}


def _check_counts(vllm) -> None:
    """`WORK`'s counts in vLLM's histograms, read by `vllm(name)` as (count, sum) grown."""
    assert vllm("vllm:request_prompt_tokens") == (CHOICES, PROMPT_TOKENS)
    assert vllm("vllm:request_generation_tokens") == (CHOICES, GENERATED)
    assert vllm("vllm:request_params_max_tokens") == (CHOICES, GENERATED)
    assert vllm("vllm:request_params_n") == (len(WORK), CHOICES)
    assert vllm("vllm:request_max_num_generation_tokens") == (len(WORK), sum(m for _, m, _ in WORK))
    e2e, ttft = vllm("vllm:e2e_request_latency_seconds"), vllm("vllm:time_to_first_token_seconds")
    took = {p: vllm(f"vllm:request_{p}_time_seconds") for p in PHASES}
    assert e2e[0] == ttft[0] == CHOICES and all(c == CHOICES for c, _ in took.values())
    s = {p: total for p, (_, total) in took.items()}
    assert all(v >= 0 for v in s.values())
    assert s["queue"] <= ttft[1] <= e2e[1] and s["inference"] <= e2e[1]
    same = dict(rel_tol=1e-9, abs_tol=1e-6)  # (sums of differences of the same stamps)
    assert math.isclose(s["queue"] + s["prefill"], ttft[1], **same)
    assert math.isclose(s["prefill"] + s["decode"], s["inference"], **same)
    assert math.isclose(s["queue"] + s["inference"], e2e[1], **same)
    assert e2e[1] > 0 and s["decode"] > 0  # (every choice wrote tokens after its first)


def test_beam_search_counts_its_step_requests_only(served):
    """A beam search's steps are engine requests (one per live beam, max_tokens 1), counted
    as vLLM's; the sequences it answers with ran as none and are not counted again: every
    request counted as finished has one n, one prompt and one latency."""
    base = served[0]
    before = scrape_metrics(base, labels=True)
    body = {
        "prompt": [5] * 10,
        "max_tokens": 3,
        "n": 2,
        "use_beam_search": True,
        "ignore_eos": True,
    }
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    grew = partial(grown, before, scrape_metrics(base, labels=True))
    ended = sum(
        grew("vllm:request_success_total", **VLLM, finished_reason=r) for r in FINISH_REASONS
    )
    assert ended >= 3  # (the first step's beam, then each step's two)
    for name in (
        "vllm:request_params_n",
        "vllm:request_max_num_generation_tokens",
        "vllm:request_prompt_tokens",
        "vllm:e2e_request_latency_seconds",
    ):
        assert grew(name + "_count", **VLLM) == ended, name
    assert grew("vllm:request_params_n_sum", **VLLM) == ended  # (each step's request: n 1)


def test_an_aborted_request_is_in_none_of_the_finished_histograms(served):
    """A request aborted while it runs (SGLang's /abort_request) counts as an abort and in
    TTFT (its first token came), but in none of the histograms of a finished request: not
    its latency, sizes or phases, nor its n (vLLM's observed with the rest, per finished
    request), so their counts stay equal."""
    base = served[0]
    before = scrape_metrics(base, labels=True)

    def grew(name: str, **labels: str) -> float:  # (vLLM's, scraped now)
        return grown(before, scrape_metrics(base, labels=True), name, **VLLM, **labels)

    body = {
        "input_ids": [5] * 10,
        "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True},
        "rid": "aborted",
    }
    # (stepping stops at 3 tokens: it is running when aborted, however fast the machine)
    with engine_stops_stepping_at(served[1], 3), ThreadPoolExecutor(1) as pool:
        out = pool.submit(httpx.post, f"{base}/generate", json=body, timeout=TIMEOUT)
        deadline = time.monotonic() + TIMEOUT
        while not grew("vllm:time_to_first_token_seconds_count"):  # (it runs)
            assert time.monotonic() < deadline and not out.done()
            time.sleep(0.01)
        r = httpx.post(f"{base}/abort_request", json={"rid": "aborted"}, timeout=TIMEOUT)
        assert r.status_code == 200
        r = out.result(TIMEOUT)
    assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert grew("vllm:request_success_total", finished_reason="abort") == 1
    for name in (
        "vllm:e2e_request_latency_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_queue_time_seconds",
        "vllm:request_params_n",
        "vllm:request_max_num_generation_tokens",
    ):
        assert grew(name + "_count") == 0, name
