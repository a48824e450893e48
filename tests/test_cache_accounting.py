"""Prefix-cache accounting: what `prefix_hit_tokens` (SGLang's `cached_tokens`) counts across
retractions, and what `flush_cache` (SGLang's /flush_cache, vLLM's /reset_prefix_cache)
drops, copies and keeps, with a host tier and an L3 store under it."""

from __future__ import annotations

import random

import pytest

from dsakv import LLM, SamplingParams
from dsakv.engine import Engine, EngineConfig
from dsakv.metrics import EngineCollector
from dsakv.models.tiny import write_tiny_model

PS = 16
EXACT = dict(kv_cache_dtype="fp32", index_k_dtype="fp32", device="cpu", page_size=PS)
LONG = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("acct") / "tiny", preset="glm-tiny"))


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def _drive(engine: Engine, prompts: list[list[int]], params: SamplingParams):
    """Add the prompts two steps apart (the later ones retract the earlier on a tight pool)."""
    reqs = []
    for p in prompts:
        reqs.append(engine.add_request(p, params))
        for _ in range(2):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()
    return reqs


def _hit_rate(counters: dict) -> float:
    collector = EngineCollector("m")
    collector.update(counters)
    (family,) = [f for f in collector.collect() if f.name == "dsakv_prefix_cache_hit_rate"]
    return family.samples[0].value


def test_a_retracted_request_counts_its_own_pages_as_no_hit(tiny):
    """10 pages for three 33-token prompts decoding 60 tokens: requests are retracted and
    recomputed, finding their own pages in the prefix cache. That is no hit: nothing is
    shared, so every count stays 0 (it was 32 per re-admission, past the prompt's length)."""
    e = Engine(EngineConfig(model=tiny, **EXACT, num_pages=10, chunked_prefill_size=16))
    reqs = _drive(e, [_prompt(i, 33) for i in range(3)], LONG)
    assert sum(r.metrics.retractions for r in reqs) > 0
    assert [r.metrics.prefix_hit_tokens for r in reqs] == [0, 0, 0]
    c = e.counters()
    assert c["prefix_hit_tokens"] == 0 and c["prompt_tokens"] == 99
    assert _hit_rate(c) == 0.0


def test_a_retracted_request_keeps_its_first_admissions_hit(tiny):
    """Two pages of a shared prefix are cached before three requests extend it: each hits
    them once (32 tokens) however often it is retracted, and the hit rate stays a share."""
    e = Engine(EngineConfig(model=tiny, **EXACT, num_pages=10, chunked_prefill_size=16))
    shared = _prompt(100, 32)
    _drive(e, [shared + [1]], SHORT)
    before = e.counters()
    reqs = _drive(e, [shared + [2 + i] for i in range(3)], LONG)
    assert sum(r.metrics.retractions for r in reqs) > 0
    assert [r.metrics.prefix_hit_tokens for r in reqs] == [32, 32, 32]
    c = e.counters()
    assert c["prefix_hit_tokens"] - before["prefix_hit_tokens"] == 96
    assert c["prefix_hit_tokens"] <= c["prompt_tokens"]
    assert 0.0 < _hit_rate(c) <= 1.0
    assert _hit_rate(c) == 3 * 32 / (33 + 3 * 33)  # each prompt counted once, retracted or not


def test_the_hit_rate_is_hit_tokens_over_prompt_tokens(tiny):
    """A 33-token prompt caches two pages; a 47-token prompt sharing them hits 32 tokens:
    32 of the 80 prompt tokens, 0.4 (a gauge at 1.0 whenever anything hit passed above)."""
    e = Engine(EngineConfig(model=tiny, **EXACT, num_pages=32))
    shared = _prompt(500, 32)
    _drive(e, [shared + [1]], SHORT)
    assert _hit_rate(e.counters()) == 0.0
    (req,) = _drive(e, [shared + _prompt(501, 15)], SHORT)
    assert req.metrics.prefix_hit_tokens == 32
    assert _hit_rate(e.counters()) == 32 / (33 + 47)
    assert _hit_rate({"prompt_tokens": 8, "prefix_hit_tokens": 2}) == 0.25


def test_flush_cache_drops_device_and_host_pages_without_copying(tiny):
    """Evictions put pages on the host tier; the flush then drops those and the device's
    cached pages alike, copying none to the host (it used to demote each device page first)."""
    prompts = [_prompt(200 + i, 70) for i in range(6)]
    llm = LLM(tiny, **EXACT, num_pages=14, host_pool_gib=0.05)
    e = llm.engine
    cold = [o.token_ids for o in llm.generate(prompts, SHORT)]
    before = e.counters()
    assert before["pages_cached"] > 0 and before["host_pages_used"] > 0
    assert e.flush_cache()
    e.check_integrity()
    c = e.counters()
    assert (c["pages_cached"], c["host_pages_used"]) == (0, 0)
    assert e.allocator.num_free_pages == e.allocator.num_pages
    assert e.cache.num_host_pages == 0 and not e.cache.root.children
    assert c["prefix_pages_demoted"] == before["prefix_pages_demoted"]
    assert c["host_bytes_to_host"] == before["host_bytes_to_host"]
    again = llm.generate(prompts[-1:], SHORT)[0]  # cached before the flush: computed again
    assert again.token_ids == cold[-1] and again.metrics["prefix_hit_tokens"] == 0
    e.check_integrity()


def test_llm_reset_prefix_cache_as_vllm_and_flush_cache_as_sglang(tiny):
    """`LLM.reset_prefix_cache` (vLLM's) and `LLM.flush_cache` (SGLang's) drop what the
    server's /reset_prefix_cache and /flush_cache drop: a repeated prompt is computed again.
    While a request waits or runs, False and nothing dropped (SGLang's; vLLM's refuses only
    while a request holds pages)."""
    llm = LLM(tiny, **EXACT, num_pages=32)
    prompt = _prompt(400, 40)

    def cached() -> int:
        return llm.generate(prompt, SHORT, use_tqdm=False)[0].num_cached_tokens

    cached()
    assert cached() == 32
    assert llm.reset_prefix_cache() is True
    assert llm.engine.counters()["pages_cached"] == 0
    assert cached() == 0 and cached() == 32
    e = llm.engine
    e.add_request(_prompt(401, 20), SHORT)  # (added directly: generate returns with none)
    assert llm.reset_prefix_cache() is False and llm.flush_cache() is False  # waiting
    e.step()
    assert e.scheduler.running and llm.reset_prefix_cache() is False  # running
    assert cached() == 32  # (generate ran it too)
    assert llm.flush_cache() is True
    assert cached() == 0
    e.check_integrity()


def test_cache_reset_keeps_what_a_running_request_locked(tiny):
    """`PrefixCache.reset` under a running request (the engine's flush refuses then, the
    cache itself does not): the request's locked prefix stays, everything else goes."""
    e = Engine(EngineConfig(model=tiny, **EXACT, num_pages=32, host_pool_gib=0.05))
    shared = _prompt(300, 32)
    _drive(e, [shared + [1], _prompt(301, 40)], SHORT)
    req = e.add_request(shared + [2], LONG)
    e.step()
    assert req.metrics.prefix_hit_tokens == 32 and len(req.prefix_nodes) == 2
    demoted = e.cache.demoted_pages
    e.cache.reset()
    assert e.cache.num_device_pages == 2 and e.cache.demoted_pages == demoted
    assert e.cache.num_host_pages == 0
    assert [n.page for n in req.prefix_nodes] == req.pages[:2]
    while e.has_unfinished():
        e.step()
    e.check_integrity()
    alone = Engine(EngineConfig(model=tiny, **EXACT, num_pages=32, enable_prefix_cache=False))
    assert req.output_ids == _drive(alone, [shared + [2]], LONG)[0].output_ids


@pytest.mark.parametrize("host", [False, True], ids=["no-host", "host"])
def test_flush_cache_under_write_back_l3_stores_the_pages_first(tiny, tmp_path, host):
    """Write-back L3 stores pages as they leave the cache for good; a flush is such a
    leaving, so the dropped prefix comes back from L3, not from recompute."""
    prompt = _prompt(400, 150)  # 9 full pages + 6 tokens
    kw = dict(
        EXACT,
        num_pages=64,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path),
        hicache_write_policy="write_back",
    )
    if host:
        kw["host_pool_gib"] = 0.05
    llm = LLM(tiny, **kw)
    try:
        e = llm.engine
        cold = llm.generate([prompt], SHORT)[0].token_ids
        assert e.l3.drain(30) and e.counters()["l3_pages_written"] == 0
        demoted = e.cache.demoted_pages
        assert e.flush_cache()
        e.check_integrity()
        assert e.l3.drain(30)
        c = e.counters()
        assert c["l3_pages_written"] == 9 and c["pages_cached"] == 0
        assert e.cache.demoted_pages == demoted and c["host_pages_used"] == 0
        assert llm.generate([prompt], SHORT)[0].token_ids == cold
        c = e.counters()
        assert c["l3_hits"] == 9 and c["l3_corrupt_objects"] == 0
        e.check_integrity()
    finally:
        llm.close()
