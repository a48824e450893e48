"""A NaN or an inf from the model itself ends only its own request: finish_reason "error"
with the reason, every other request exact, its KV kept out of the prefix cache and its
freed pages harmless to the requests that reuse them.

Two real sources of non-finite logits: a LoRA adapter whose huge (finite) A and B overflow
layer 0's kv_a projection to inf for its requests alone (--enable-lora: the torch path), and
a checkpoint whose embedding row for one token is inf, so a request fails from the step that
feeds that token (any path: the native CPU one, MTP verification, HiSparse)."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from dsakv import LLM, BeamSearchParams, LoRARequest, SamplingParams
from dsakv.engine import Engine, EngineConfig
from dsakv.errors import DsakvError

from .conftest import assert_taken_and_ignored
from .serving import TIMEOUT, serving

EXACT = dict(device="cpu", page_size=16, kv_cache_dtype="fp32", index_k_dtype="fp32")
NOT_FINITE = "the model's logits for this request are not finite (NaN or inf) at "
GOOD = [[3 + (i * 5) % 200 for i in range(37)], [9 + (i * 11) % 190 for i in range(21)]]


@pytest.fixture(scope="module")
def bad_adapter(glm_tiny, tmp_path_factory) -> str:
    """A PEFT adapter on layer 0's kv_a_proj_with_mqa: A and B of 1e20 each, finite, whose
    product overflows fp32 (every latent inf, then NaN through its norm)."""
    out = tmp_path_factory.mktemp("bad-adapter")
    config = json.loads((Path(glm_tiny) / "config.json").read_text())
    width = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    name = "base_model.model.model.layers.0.self_attn.kv_a_proj_with_mqa"
    tensors = {
        f"{name}.lora_A.weight": torch.full((1, config["hidden_size"]), 1e20),
        f"{name}.lora_B.weight": torch.full((width, 1), 1e20),
    }
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter = {
        "peft_type": "LORA",
        "r": 1,
        "lora_alpha": 1,
        "target_modules": ["kv_a_proj_with_mqa"],
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter))
    return str(out)


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 8, "temperature": 0, "ignore_eos": True, **kw})


def _run(engine: Engine, prompt: list[int], **params) -> object:
    req = engine.add_request(prompt, _params(**params))
    while engine.has_unfinished():
        engine.step()
    return req


def _assert_same(got, want) -> None:
    """Tokens exact; logprobs to fp32 rounding (the torch path is not batch invariant)."""
    assert got.output_ids == want.output_ids and got.finish_reason == "length"
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


# --- one bad request in a batch ---------------------------------------------------------


def test_a_bad_adapters_requests_fail_alone(glm_tiny, bad_adapter):
    """Base requests (greedy, seeded sampling) beside requests on the overflowing adapter
    (greedy, sampled, scoring their prompt): the bad ones end "error" with the reason, none
    of their pages in the prefix cache, and each base one gives its alone tokens. (Before:
    greedy ones took token 0 with NaN logprobs, and a sampled one failed the whole step.)"""
    engine = Engine(EngineConfig(glm_tiny, **EXACT, num_pages=64, enable_lora=True))
    engine.load_lora("bad", bad_adapter)
    base = [dict(logprobs=2), dict(logprobs=2, temperature=1.0, seed=5)]
    alone = []
    for prompt, params in zip(GOOD, base):
        engine.flush_cache()
        alone.append(_run(engine, prompt, **params))
    engine.flush_cache()
    bad = [dict(), dict(temperature=1.0, seed=1, logprobs=2), dict(prompt_logprobs=1)]
    reqs = [engine.add_request(p, _params(**kw)) for p, kw in zip(GOOD, base)]
    prompt = [7 + i % 50 for i in range(40)]
    failed = [engine.add_request(prompt, _params(lora_name="bad", **kw)) for kw in bad]
    while engine.has_unfinished():
        engine.step()
    for got, want in zip(reqs, alone):
        _assert_same(got, want)
    for req, at in zip(failed, ["output token 0", "output token 0", "prompt token 1"]):
        assert (req.finish_reason, req.error) == ("error", NOT_FINITE + at)
        assert req.output_ids == [] and not req.logprobs  # (no NaN logprob kept)
    key = failed[0].cache_key
    assert engine.cache.match(prompt, len(prompt) // 16, key) == []
    engine.check_integrity()


def test_beam_search_on_a_bad_adapter_is_one_clear_error(glm_tiny, bad_adapter):
    """Beam search reads each step's logprobs: NaN ones made beams of token 0."""
    with LLM(glm_tiny, **EXACT, num_pages=64, enable_lora=True) as llm:
        bad = LoRARequest("bad", 1, bad_adapter)
        with pytest.raises(DsakvError, match="not finite"):
            llm.beam_search([{"prompt": "hello"}], BeamSearchParams(2, 4), lora_request=bad)
        (out,) = llm.beam_search([{"prompt": "hello"}], BeamSearchParams(2, 4))
        assert len(out.sequences) == 2


# --- a token whose embedding is inf: the native path, MTP, reused pages --------------------


# Its greedy output takes a new token at output index 7 (see `poisoned`), under MTP as a
# target token whose next step verifies drafts (measured)
BAD = [(85 + i * 3) % 40 + 210 for i in range(12)]


@pytest.fixture(scope="module")
def poisoned(glm_tiny, tmp_path_factory) -> tuple[str, int, int]:
    """glm-tiny with one token's embedding row inf, that token one BAD's greedy output
    takes on the plain model and no other prompt here holds: (model, token, the output
    index that takes it)."""
    plain = _run(Engine(EngineConfig(glm_tiny, **EXACT, num_pages=64)), BAD, max_tokens=12)
    seen, index = set(BAD + GOOD[0] + GOOD[1]), 7
    assert plain.output_ids[index] not in seen | set(plain.output_ids[:index])
    token = plain.output_ids[index]
    out = tmp_path_factory.mktemp("poisoned") / "model"
    shutil.copytree(glm_tiny, out)
    weights = load_file(str(out / "model.safetensors"))
    weights["model.embed_tokens.weight"][token] = float("inf")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out), token, index


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
def test_a_request_fails_at_the_token_whose_logits_are_not_finite(poisoned, glm_tiny, mtp):
    """On the default (native) path, with and without MTP drafts verified: the request that
    samples the poisoned token keeps its tokens up to it and ends at the next, its neighbour
    exact."""
    model, token, index = poisoned
    kw = dict(speculative_algorithm="mtp") if mtp else {}
    engine = Engine(EngineConfig(model, **EXACT, num_pages=64, **kw))
    want = _run(Engine(EngineConfig(glm_tiny, **EXACT, num_pages=64)), GOOD[1], logprobs=1)
    bad = engine.add_request(BAD, _params(max_tokens=12))
    good = engine.add_request(GOOD[1], _params(logprobs=1))
    while engine.has_unfinished():
        engine.step()
    assert bad.output_ids[-1] == token and len(bad.output_ids) == index + 1
    assert (bad.finish_reason, bad.error) == ("error", NOT_FINITE + f"output token {index + 1}")
    _assert_same(good, want)
    engine.check_integrity()


@pytest.mark.parametrize("path", ["native", "torch", "hisparse"])
def test_a_failed_requests_pages_do_not_poison_those_who_reuse_them(poisoned, path):
    """A request whose whole KV is NaN (its prompt all the poisoned token) fails, caching
    nothing; a later request that gets its freed pages (a 4-page pool) has the tokens it
    has on a fresh engine."""
    model, token, _ = poisoned
    kw = {
        "native": dict(num_pages=4),
        "torch": dict(num_pages=4, enable_deterministic_inference=False),
        "hisparse": dict(
            num_pages=8,
            page_size=8,
            enable_hisparse=True,
            hisparse_config={"host_to_device_ratio": 2},
        ),
    }[path]
    config = EngineConfig(model, **{**EXACT, **kw})
    want = _run(Engine(config), GOOD[0], logprobs=1)
    engine = Engine(config)
    bad = _run(engine, [token] * 60)
    assert bad.finish_reason == "error" and bad.error.startswith(NOT_FINITE)
    assert engine.cache.num_device_pages == 0
    got = _run(engine, GOOD[0], logprobs=1)
    assert (got.output_ids, got.logprobs) == (want.output_ids, want.logprobs)
    engine.check_integrity()


# --- the server ---------------------------------------------------------------------------


def test_the_server_answers_a_bad_request_and_serves_the_rest(glm_tiny, bad_adapter):
    """Non-stream: a 500 (the server's fault, not the request's) with the reason; stream:
    its error event; a good request beside them completes."""
    config = EngineConfig(
        glm_tiny, **EXACT, num_pages=64, enable_lora=True, lora_modules=(("bad", bad_adapter),)
    )
    with serving(config, served_model_name="m") as (base, _):
        body = {"prompt": "hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}

        def post(model: str, stream: bool = False):
            return httpx.post(
                f"{base}/v1/completions",
                json={**body, "model": model, "stream": stream},
                timeout=TIMEOUT,
            )

        with ThreadPoolExecutor(3) as pool:
            bad, streamed, good = pool.map(lambda a: post(*a), [("bad",), ("bad", True), ("m",)])
        assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] == "length"
        assert bad.status_code == 500, bad.text
        assert bad.json()["error"]["message"].startswith(NOT_FINITE)
        assert bad.json()["error"]["type"] == "server_error"
        assert NOT_FINITE in streamed.text and '"error"' in streamed.text


def test_sglangs_nan_detection_flag_is_taken(glm_tiny, capsys):
    assert_taken_and_ignored(glm_tiny, ["--enable-nan-detection"], [], capsys)


def test_a_failed_requests_pages_written_through_to_l3_are_taken_back(
    glm_tiny, bad_adapter, tmp_path
):
    """Write-through L3 stores each prefill chunk's full pages at the end of its step, before
    the last chunk's logits tell the request failed: those objects are deleted as it ends,
    so a later request finds no NaN KV in L3 (before: two objects stayed, and were hit)."""
    store = tmp_path / "store"
    config = EngineConfig(
        glm_tiny,
        **EXACT,
        num_pages=64,
        enable_lora=True,
        chunked_prefill_size=16,
        hicache_storage_backend="file",
        hicache_storage_dir=str(store),
    )
    engine = Engine(config)
    try:
        engine.load_lora("bad", bad_adapter)
        prompt = [5 + i % 90 for i in range(46)]
        bad = _run(engine, prompt, lora_name="bad")
        assert (bad.finish_reason, bad.error) == ("error", NOT_FINITE + "output token 0")
        assert engine.l3.drain(TIMEOUT)
        assert engine.counters()["l3_pages_written"] == 2  # (chunks 1 and 2, before it failed)
        assert sorted(store.glob("*/*.kv")) == []
        again = _run(engine, prompt, lora_name="bad")
        assert again.finish_reason == "error" and engine.counters()["l3_hits"] == 0
        engine.check_integrity()
    finally:
        engine.close()


def test_a_dp_peers_model_fault_reaches_rank_0(glm_tiny, bad_adapter):
    """Under DP attention rank 0 mirrors a peer's requests from its reports: a model fault
    there must stay one (the server's 500), not read as the request's own fault (a 400).
    (One rank's engine stands in for the peer, as in test_distributed.)"""
    from dsakv.engine.dp import _Reporter

    engine = Engine(EngineConfig(glm_tiny, **EXACT, num_pages=16, enable_lora=True))
    engine.load_lora("bad", bad_adapter)
    peer = _Reporter(engine)
    peer.apply(("step", [(0, 7, [3, 4, 5], _params(lora_name="bad"))], [], []))
    ups = []
    while engine.has_unfinished():
        ups += peer.report(engine.step()).updates
    assert ups[-1]["finish_reason"] == "error" and ups[-1]["model_fault"] is True


def test_a_pd_prefill_servers_model_fault_is_its_500_not_a_transfer_failure(poisoned):
    """On a PD prefill server a request the model failed is answered to the decode server
    (and the client) with its own error and a 500; nothing was sent, so no KV transfer
    failed (before: "KV transfer for room 7 failed: ...", a 502, one more failure)."""
    import asyncio

    from dsakv.disagg import handoff
    from dsakv.disagg.bootstrap import Registration
    from dsakv.disagg.config import DisaggConfig
    from dsakv.disagg.serving import PrefillAsyncEngine
    from dsakv.procs import free_port

    model, token, _ = poisoned
    port = free_port()
    prefill = PrefillAsyncEngine(
        Engine(EngineConfig(model, **EXACT, num_pages=16)),
        DisaggConfig("prefill", bootstrap_port=port),
        "127.0.0.1",
    )
    prompt = [token] * 20
    reg = Registration(7, "", [], [0, 1], prompt)

    async def claim(room, timeout=None):
        return reg

    prefill.bootstrap.claim = claim

    async def run():
        handoff._current.set(handoff._Targets([handoff.BootstrapTarget(7, None, port)]))
        (stream,) = await prefill.generate_n(prompt, _params(), 1)
        while not (u := await stream.get()).finished:
            pass
        return u

    try:
        u = asyncio.run(run())
    finally:
        prefill.shutdown()
    why = NOT_FINITE + "output token 0"
    assert (u.finish_reason, u.error, u.error_status) == ("error", why, 500)
    assert reg.result.result(0) == {
        "type": "error", "message": why, "status": 500, "param": None, "code": None
    }  # fmt: skip
    assert prefill.stats.snapshot()["failures"] == 0


def test_n_choices_whose_prompt_fails_all_end_with_its_error(glm_tiny, bad_adapter):
    """n=2 scoring the prompt: the first choice fails at a prompt token; the other, which
    waited for its prefill, ends in that same step with the same error and none of its
    NaN prompt logprobs (before: it took them, ran, and failed at "output token 0")."""
    engine = Engine(EngineConfig(glm_tiny, **EXACT, num_pages=64, enable_lora=True))
    engine.load_lora("bad", bad_adapter)
    prompt = [7 + i % 50 for i in range(40)]
    reqs = engine.add_requests(prompt, _params(n=2, prompt_logprobs=1, lora_name="bad"))
    ended = []
    while engine.has_unfinished():
        ended += [r for r in engine.step() if r.finished]
    assert ended == reqs  # (each reported: the server's streams hear it)
    for req in reqs:
        assert (req.finish_reason, req.error) == ("error", NOT_FINITE + "prompt token 1")
        assert req.model_fault and req.output_ids == []
    assert all(lp is None or lp == lp for lp in reqs[1].prompt_logprobs)  # (no NaN)
    engine.check_integrity()


def test_the_server_counts_n_choices_cut_short_by_a_failed_one_as_errors(glm_tiny, bad_adapter):
    """n=2 on the overflowing adapter, streamed and not: the first choice to fail ends the
    call, and the other, cut short for it, counts as an error in /metrics too, as both do
    offline (before: as an abort, the count of requests clients gave up on)."""
    from .serving import grown, scrape_metrics

    config = EngineConfig(
        glm_tiny, **EXACT, num_pages=64, enable_lora=True, lora_modules=(("bad", bad_adapter),)
    )
    body = {"prompt": "hello", "max_tokens": 8, "n": 2, "temperature": 1.0, "model": "bad"}
    with serving(config, served_model_name="m") as (base, _):
        for stream in (False, True):
            before = scrape_metrics(base, labels=True)
            r = httpx.post(
                f"{base}/v1/completions", json={**body, "stream": stream}, timeout=TIMEOUT
            )
            assert NOT_FINITE in r.text, r.text
            after = scrape_metrics(base, labels=True)
            done = {
                reason: grown(
                    before, after, "vllm:request_success_total",
                    engine="0", finished_reason=reason, model_name="m",
                )
                for reason in ("error", "abort")
            }  # fmt: skip
            assert done == {"error": 2, "abort": 0}, (stream, done)
