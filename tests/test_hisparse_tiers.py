"""HiSparse with the tiers under the prefix cache: the host tier (L2) and L3 storage.

Under HiSparse a logical token is its index-K in the device pool and its latent in the host
rows (`DSAKVPool.attach_host_latent`), so the host tier and L3 move whole tokens as they do
for the dense layout: a page demoted to the host tier, promoted back, stored to L3 or read
from it carries the same bytes, index-K for full layers only. A decoding request retracted to
the host tier comes back as a PD decode request does: its latent in the host rows, a hot
buffer only on the device, loaded at its next step.

fp32 caches make the comparisons exact (as in test_hisparse_engine): tokens from prefix hits
and from requests that came back from the host are the cold run's.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from dsakv import LLM, SamplingParams
from dsakv.models.tiny import write_tiny_model

from .test_hisparse_engine import EXACT, GREEDY, _engine, _pd, _prompts, _run
from .test_storage import PAGES, PROMPT, _file, _objects
from .test_storage import _run as _l3_run

HS2 = {"host_to_device_ratio": 2}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("glm-tiny"), preset="glm-tiny", seed=0))


def _conversations(waves: int, seed: int = 0) -> list[list[list[int]]]:
    """`waves` rounds of four conversations: each round one 64-token shared prefix (8 pages)
    per conversation and a new tail."""
    rng = random.Random(seed)
    shared = [[rng.randrange(1, 250) for _ in range(64)] for _ in range(4)]
    return [
        [s + [rng.randrange(1, 250) for _ in range(rng.randint(3, 9))] for s in shared]
        for _ in range(waves)
    ]


def test_prefix_pages_go_to_the_host_tier_and_come_back(tiny):
    """40 logical pages hold the four prefixes (32 pages) and little else: each round evicts
    cached pages to the host tier (index-K from the device, latent from the host rows) and
    the next round's hits promote them back, then copy their latent into the device pool
    from the host rows. Every round's tokens are the cold run's."""
    waves = _conversations(3)
    cold = _engine(tiny, num_pages=256, enable_prefix_cache=False)
    want = [_run(cold, w) for w in waves]
    on = _engine(tiny, num_pages=20, enable_hisparse=True, hisparse_config=HS2, host_pool_ratio=4)
    assert on.pool.num_pages == 40 and on.host.num_pages == 160
    for wave, tokens in zip(waves, want):
        assert _run(on, wave) == tokens
    c = on.counters()
    assert c["prefix_pages_demoted"] > 0 and c["prefix_pages_promoted"] >= 8
    assert c["prefix_hit_tokens"] >= 2 * 4 * 64
    assert c["hisparse_rows_to_device"] >= c["prefix_hit_tokens"] * 8  # (8 layers a token)


def test_a_decoding_request_retracted_to_the_host_tier_comes_back_decoding(tiny, reference):
    """host_to_device_ratio 1: the logical pages run out mid-decode and the newest request is
    retracted. With a host tier its KV goes there and it comes back with a hot buffer only,
    loaded from the host rows, and decodes on: nothing is computed again."""
    prompts, want = reference
    kw = dict(num_pages=36, enable_hisparse=True, hisparse_config={"host_to_device_ratio": 1})
    recomputed = _engine(tiny, **kw)
    assert _run(recomputed, prompts) == want
    on = _engine(tiny, **kw, host_pool_ratio=2)
    assert _run(on, prompts) == want
    c, r = on.counters(), recomputed.counters()
    assert c["retractions"] == r["retractions"] > 0
    assert c["retractions_to_host"] == c["retractions"]
    assert c["computed_tokens"] < r["computed_tokens"]


@pytest.mark.parametrize("host", [None, 2], ids=["recomputed", "host-tier"])
def test_a_request_retracted_mid_prefill_resumes_from_the_host_tier(tiny, host):
    """SGLang's pause "retract" of a decoding request and of one part-way through its chunked
    prefill. With a host tier both go there: the decoding one comes back with its context as a
    prefix hit and decodes on, the other resumes its prefill where it stopped (its chunks'
    latent is in the host rows); nothing is computed twice. Without one both are recomputed."""
    prompts = _prompts(2, seed=7, lo=90, hi=100)
    want = _run(_engine(tiny, num_pages=256), prompts, check_every_step=False)
    tier = {} if host is None else {"host_pool_ratio": host}
    e = _engine(tiny, num_pages=40, chunked_prefill_size=16, enable_hisparse=True,
                hisparse_config=HS2, **tier)  # fmt: skip
    decoding = e.add_request(prompts[0], GREEDY)
    while len(decoding.output_ids) < 3:
        e.step()
    prefilling = e.add_request(prompts[1], GREEDY)
    e.step()
    assert 0 < prefilling.num_computed < len(prompts[1])
    e.retract_all()
    assert (decoding.host_slots is not None) == (prefilling.host_slots is not None) == bool(host)
    while e.has_unfinished():
        e.step()
        e.check_integrity()
    assert [decoding.output_ids, prefilling.output_ids] == want
    c = e.counters()
    assert c["retractions"] == 2 and c["retractions_to_host"] == (2 if host else 0)
    once = sum(map(len, prompts)) + 2 * (GREEDY.max_tokens - 1)  # (each token's KV, once)
    assert (c["computed_tokens"] == once) == bool(host)


@pytest.fixture(scope="module")
def reference(tiny):
    prompts = _prompts(8, seed=3)
    return prompts, _run(_engine(tiny, num_pages=256), prompts, check_every_step=False)


@pytest.mark.parametrize("paused", [False, True], ids=["outgrown", "paused-before-a-step"])
def test_a_pd_request_no_device_prefill_holds_comes_back_from_the_host_tier(tiny, paused):
    """`test_a_retracted_pd_request_is_recomputed_or_cut_short_at_once`'s 85-token case: a
    PD request whose prompt no device prefill holds was cut short when retracted. With a host
    tier it goes there and comes back: both finish with every token. So too when SGLang's
    pause "retract" comes before their first step (their latent is in the host rows)."""
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(85)] for i in range(2)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = _run(_engine(tiny, num_pages=256), prompts, params, check_every_step=False)
    prefill = _engine(tiny, num_pages=64)
    decode = _engine(tiny, num_pages=10, enable_hisparse=True, host_pool_ratio=2,
                     hisparse_config={"host_to_device_ratio": 3})  # fmt: skip
    with _pd(prefill, decode) as start:
        reqs = [start(p, params) for p in prompts]
        if paused:
            decode.retract_all()
            assert all(r.host_slots is not None for r in reqs)
    while decode.has_unfinished():
        decode.step()
        decode.check_integrity()
    c = decode.counters()
    assert c["retractions"] == c["retractions_to_host"] >= (2 if paused else 1)
    assert [r.output_ids for r in reqs] == want


def test_new_reservations_leave_the_host_tiers_requests_their_buffers(tiny):
    """Two PD requests whose prompts no device prefill holds wait on the host tier for hot
    buffers; a stream of new PD reservations (`reserve_detached`) takes none of the device
    latent pages they are owed, so they come back first."""
    prompts = [[(k * j) % 250 + 1 for j in range(85)] for k in (3, 5)]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    prefill = _engine(tiny, num_pages=256)
    decode = _engine(tiny, num_pages=10, enable_hisparse=True, host_pool_ratio=2,
                     hisparse_config={"host_to_device_ratio": 8})  # fmt: skip
    short = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    with _pd(prefill, decode) as start:
        a, b = [start(p, params) for p in prompts]
        decode.step()
        decode.retract_all()
        steps = 0
        while a.host_slots is not None or b.host_slots is not None:
            late = start([(7 * j + steps) % 250 + 1 for j in range(20)], short)
            assert late is None, f"step {steps}: a reservation took a retracted one's buffer"
            decode.step()
            steps += 1
        while decode.has_unfinished():
            decode.step()
    decode.check_integrity()
    assert len(a.output_ids) == len(b.output_ids) == 60


def test_l3_pages_are_the_dense_engines_byte_for_byte(tmp_path: Path):
    """A HiSparse engine stores the pages a dense-pool engine stores, the same objects byte
    for byte (its latent read from the host rows), and each reads the other's: every full
    prompt page a hit, tokens unchanged."""
    model = str(write_tiny_model(tmp_path / "tiny", preset="glm-tiny"))
    hs = dict(enable_hisparse=True, hisparse_config=HS2)
    (cold,), _ = _l3_run(model, [PROMPT], **_file(tmp_path / "dense"))
    (on,), c = _l3_run(model, [PROMPT], **_file(tmp_path / "hisparse"), **hs)
    assert on == cold and c["l3_pages_written"] == PAGES
    dense, mine = _objects(tmp_path / "dense"), _objects(tmp_path / "hisparse")
    assert [p.name for p in mine] == [p.name for p in dense]
    assert [p.read_bytes() for p in mine] == [p.read_bytes() for p in dense]
    for store, kw in (("dense", hs), ("hisparse", {})):
        (warm,), c = _l3_run(model, [PROMPT], **_file(tmp_path / store), **kw)
        assert warm == cold and c["l3_hits"] == PAGES and c["l3_misses"] == 0
        assert c["prefix_hit_tokens"] == PAGES * 16


def test_tp2_replicas_agree_with_the_host_tier(glm_tiny):
    """Under `--tp 2` on one machine the ranks map one host latent, which rank 0 writes:
    rank 1's host tier holds and moves index-K only (`HostPool`). With pages demoted and
    promoted and decoding requests retracted to the host tier and back, both ranks' hot
    buffers agree after every step, and the tokens are one rank's."""
    waves = _conversations(2, seed=1)
    kw = dict(**EXACT, num_pages=24, enable_hisparse=True,
              hisparse_config={"host_to_device_ratio": 1}, host_pool_ratio=4)  # fmt: skip
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = {}
    for tp in (1, 2):
        with LLM(glm_tiny, tp=tp, **kw) as llm:
            outs[tp] = [_run(llm.engine, w, params) for w in waves]
            c = llm.engine.counters()
            assert c["prefix_pages_promoted"] >= 8 and c["retractions_to_host"] > 0
    assert outs[2] == outs[1]
