"""Seeded sampling keyed by the token's position (SGLang's `sampling_seed`): a seeded
request's output token i is drawn with a generator seeded from (seed, i) alone, so it is
the same whatever the batch, with MTP on or off, and over HTTP as offline."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from dsakv import LLM, SamplingParams
from dsakv.engine import EngineConfig
from dsakv.engine.sampling import Sampler, draw, filtered_probs, finite_rows, token_seed
from dsakv.engine.speculative import verify
from dsakv.memory import copy_tokens
from dsakv.models.tiny import default_model_dir

from .test_speculative import DRAFT_SCHEMA

# Prompts of at most 40 tokens and at most 32 prefill tokens a step: every step stays
# within the per-token (batch-invariant) kernels, so a row's logits do not depend on its batch.
EXACT = dict(
    kv_cache_dtype="fp32",
    index_k_dtype="fp32",
    device="cpu",
    page_size=16,
    num_pages=64,
    chunked_prefill_size=32,
    max_running_requests=8,
)
MTP = dict(speculative_algorithm="mtp")
VOCAB = 264


@pytest.fixture(scope="module")
def model() -> str:
    """The cached glm-tiny (its MTP layer fitted to the target, so drafts get accepted)."""
    return str(default_model_dir("glm-tiny"))


def _prompts(n: int, seed: int, lo: int = 6, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _flat_logits(rows: int, seed: int = 0) -> torch.Tensor:
    """Near-uniform rows: two independent draws agree with probability about 1/VOCAB."""
    return 0.3 * torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def _keyed(logits_row: torch.Tensor, params: SamplingParams, index: int) -> int:
    """The definition: multinomial with a fresh generator seeded from (seed, index)."""
    g = torch.Generator().manual_seed(token_seed(params.seed, index))
    return int(torch.multinomial(filtered_probs(logits_row, params), 1, generator=g))


# --- unit: the keyed draw ---------------------------------------------------------------------


def test_token_seed_is_a_fixed_mix_below_2_63():
    seeds = [0, 1, 7, -1, -12345, 2**64 + 7, 2**63 + 5]
    keys = {(s, i): token_seed(s, i) for s in seeds for i in range(50)}
    assert all(0 <= k < 2**63 for k in keys.values())
    # seeds equal mod 2**64 are one seed; otherwise (seed, index) pairs do not collide
    assert token_seed(2**64 + 7, 5) == token_seed(7, 5)
    distinct = {k for (s, i), k in keys.items() if s != 2**64 + 7}
    assert len(distinct) == 6 * 50
    # neighbouring seeds do not give shifted copies of one stream
    assert {token_seed(1, i) for i in range(1, 50)}.isdisjoint(token_seed(0, i) for i in range(50))


def test_draw_depends_only_on_probs_seed_and_index():
    probs = torch.softmax(_flat_logits(1)[0], -1)
    shared = torch.Generator().manual_seed(0)
    first = [draw(probs, 11, i, shared) for i in range(40)]
    before = shared.get_state()
    torch.rand(100, generator=shared)  # the shared stream moves: keyed draws do not care
    assert [draw(probs, 11, i, shared) for i in reversed(range(40))] == first[::-1]
    assert not torch.equal(shared.get_state(), before)
    assert len(set(first)) > 20  # the index matters (not one token repeated)
    assert [draw(probs, 12, i, shared) for i in range(40)] != first  # so does the seed
    # unseeded: the shared generator, as before
    a = torch.Generator().manual_seed(5)
    assert draw(probs, None, 0, a) == int(torch.multinomial(probs, 1, generator=a.manual_seed(5)))


def test_sampler_row_is_the_same_alone_or_in_any_batch():
    """A seeded row's token at index i is the keyed draw from its own filtered probs,
    whatever rows (other seeds, unseeded, greedy) and indices surround it."""
    sampler = Sampler(torch.device("cpu"), 0)
    probe = SamplingParams(temperature=0.8, top_p=0.95, seed=1234)
    others = [
        SamplingParams(temperature=0.8, seed=99),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_k=5, seed=1234),  # same seed, other filter
    ]
    logits = _flat_logits(5, seed=3)
    alone, mixed = [], []
    for i in range(30):
        alone.append(sampler.sample(logits[:1], [probe], [i], finite_rows(logits[:1]))[0])
        rows = torch.cat([logits[1:3], logits[:1], logits[3:]])
        params = [*others[:2], probe, *others[2:]]
        out = sampler.sample(rows, params, [3, 0, i, 7, i + 1], finite_rows(rows))
        mixed.append(out[2])
        assert out[3] == int(rows[3].argmax())
    assert mixed == alone == [_keyed(logits[0], probe, i) for i in range(30)]
    assert len(set(alone)) > 10


# --- unit: MTP verification -------------------------------------------------------------------


def test_seeded_verify_accepts_a_draft_iff_it_is_the_keyed_sample():
    logits = _flat_logits(4, seed=7)  # three drafts, then the bonus row
    params = SamplingParams(temperature=0.8, seed=42)
    shared = torch.Generator().manual_seed(0)
    state = shared.get_state()
    for first in (1, 5, 17):
        t = [_keyed(logits[j], params, first + j) for j in range(4)]
        for m in range(4):  # drafts match the target's samples up to position m
            drafts = t[:3]
            if m < 3:
                drafts = [*t[:m], (t[m] + 1) % VOCAB, *t[m + 1 : 3]]
            assert verify(logits, drafts, params, shared, first) == t[: m + 1]
        # A draft of the sample keyed one index off is not the target's token there.
        wrong = [_keyed(logits[0], params, first + 1)]
        if wrong[0] != t[0]:
            assert verify(logits[:2], wrong, params, shared, first) == [t[0]]
    assert torch.equal(shared.get_state(), state)  # seeded rows leave the shared stream alone


def test_seeded_verify_accepts_with_probability_p_of_the_draft():
    p = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    logits = torch.log(p).repeat(2, 1)
    shared = torch.Generator().manual_seed(0)
    n = 2000
    kept = sum(
        len(verify(logits, [3], SamplingParams(temperature=1.0, seed=s), shared, 4)) == 2
        for s in range(n)
    )
    assert abs(kept / n - 0.3) < 0.04


# --- engine -----------------------------------------------------------------------------------

SEEDED = SamplingParams(max_tokens=16, temperature=0.8, seed=2024, ignore_eos=True)


@pytest.fixture(scope="module")
def probe() -> list[int]:
    return _prompts(1, seed=31, lo=30, hi=30)[0]


@pytest.fixture(scope="module")
def alone(model, probe):
    """The probe's seeded output with nothing else running."""
    return LLM(model, **EXACT).generate([probe], SEEDED)[0]


def test_seeded_tokens_do_not_depend_on_the_batch(model, probe, alone):
    prompts = _prompts(7, seed=32)
    params = [
        SamplingParams(max_tokens=8 + 2 * i, temperature=[0.8, 1.0, 0][i % 3], ignore_eos=True,
                       seed=None if i % 2 else 100 + i)
        for i in range(7)
    ]  # fmt: skip
    llm = LLM(model, **EXACT)
    outs = llm.generate([*prompts[:3], probe, *prompts[3:]], [*params[:3], SEEDED, *params[3:]])
    llm.engine.check_integrity()
    assert outs[3].token_ids == alone.token_ids
    assert llm.engine.counters()["steps"] > 10  # mixed prefill/decode steps, not one batch
    other = LLM(model, **EXACT).generate([probe], replace(SEEDED, seed=7))
    assert other[0].token_ids != alone.token_ids


def test_the_engines_seed_makes_unseeded_sampling_reproducible(model):
    """vLLM's LLM(seed=...): unseeded requests draw from a generator the engine's seed
    starts (it started from the OS's entropy, whatever the seed)."""
    params = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    prompts = _prompts(3, seed=5)
    runs = []
    for seed in (1234, 1234, 99):
        with LLM(model, **EXACT, seed=seed) as llm:
            runs.append([o.token_ids for o in llm.generate(prompts, params)])
    assert runs[0] == runs[1] != runs[2]


def test_seeded_tokens_equal_with_mtp_on_and_off(model):
    """Every token MTP emits for a seeded request is its keyed sample, so the outputs are
    the ones without MTP; drafts are accepted as often as the target samples them (here
    top_k=4 and text-like prompts, as the draft layer was fitted on, so some are)."""
    rng = random.Random(34)
    prompts = [
        [256] + [rng.randrange(32, 127) for _ in range(rng.randint(10, 39))] for _ in range(4)
    ]
    params = [
        SamplingParams(max_tokens=16, temperature=0.8, top_k=4, seed=s, ignore_eos=True)
        for s in range(4)
    ]
    base = LLM(model, **EXACT).generate(prompts, params)
    for k in (1, 3):
        llm = LLM(model, **EXACT, **MTP, speculative_num_steps=k)
        spec = llm.generate(prompts, params)
        llm.engine.check_integrity()
        assert [o.token_ids for o in spec] == [o.token_ids for o in base]
        c = llm.engine.counters()
        assert c["spec_verify_steps"] > 0
        assert 0 < c["spec_accepted_tokens"] < c["spec_draft_tokens"]


def test_seeded_grammar_tokens_equal_with_mtp_on_and_off(model):
    """Under structured output the drafts are checked against grammar-masked rows
    (`apply_drafts`); the keyed samples from those rows are still the tokens without MTP."""
    import json

    schema = DRAFT_SCHEMA
    rng = random.Random(35)
    prompts = [
        [256] + [rng.randrange(32, 127) for _ in range(rng.randint(10, 30))] for _ in range(4)
    ]
    params = [
        SamplingParams(
            max_tokens=40,
            temperature=0.8,
            top_k=4,
            seed=s,
            grammar=("json_schema", json.dumps(schema)),
        )
        for s in range(4)
    ]
    base = LLM(model, **EXACT).generate(prompts, params)
    llm = LLM(model, **EXACT, **MTP)
    spec = llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in base]
    assert len({o.text for o in spec}) > 1
    assert llm.engine.counters()["spec_accepted_tokens"] > 0


def test_seeded_tokens_survive_a_prefill_decode_handoff(model, probe, alone):
    """Disaggregation in process: the prefill engine draws token 0, the decode engine
    (a new request object there) goes on from token 1; together they give one engine's
    tokens."""
    from dsakv.engine import Engine, disagg

    config = EngineConfig(model, **EXACT)
    prefill = Engine(config)
    first = prefill.add_request(probe, replace(SEEDED, max_tokens=1))
    disagg.hold(prefill, first)
    while prefill.has_unfinished():
        prefill.step()
    n = len(probe)
    decode = Engine(config)
    req = disagg.reserve(decode, probe, SEEDED)
    src = prefill.scheduler.slots(first, n)
    copy_tokens(decode.pool, decode.scheduler.slots(req, n), prefill.pool, src)
    disagg.release_held(prefill, first)
    disagg.start_decoding(decode, req, first.output_ids[0])
    while decode.has_unfinished():
        decode.step()
    assert req.output_ids == alone.token_ids
    prefill.check_integrity()
    decode.check_integrity()


# --- HTTP: SGLang's sampling_seed -------------------------------------------------------------


def test_sampling_seed_is_an_alias_of_seed(model, probe, alone):
    import httpx

    from .serving import TIMEOUT, serving

    body = dict(model="m", prompt=probe, max_tokens=16, temperature=0.8, ignore_eos=True)
    with serving(EngineConfig(model, **EXACT), served_model_name="m") as (base, _):
        url = f"{base}/v1/completions"

        def text(**kw) -> str:
            r = httpx.post(url, json={**body, **kw}, timeout=TIMEOUT)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        assert text(sampling_seed=2024) == text(seed=2024) == alone.text
        assert text(seed=2024, sampling_seed=2024) == alone.text
        assert text(sampling_seed=7) != alone.text
        r = httpx.post(url, json={**body, "seed": 1, "sampling_seed": 2}, timeout=TIMEOUT)
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "sampling_seed"
        r = httpx.post(url, json={**body, "sampling_seed": "2"}, timeout=TIMEOUT)
        assert r.status_code == 400
