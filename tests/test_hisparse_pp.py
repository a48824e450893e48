"""HiSparse under pipeline parallelism (`--pp-size`, DESIGN.md §13 across stages).

Each stage's hot buffers hold its own layers: device latent rows, host latent rows and the
state of each IndexShare group it holds a layer of. A group whose full layer is an earlier
stage's gets that layer's top-k with the hidden states, and the stage resolves it against
its own replica of the group's state: the same top-k against the same state gives the same
copy list, so every stage's replica of a group stays the same (`check_integrity` compares
them, group by group, after every step here).

glm-tiny's layers are F F S S F S F S; partition 3,5 puts shared layer 3 (layer 1's group)
on stage 1. fp32 caches make the comparisons exact: the same tokens and logprobs as one
stage with HiSparse, and the same tokens as a roomy pool without it.
"""

from __future__ import annotations

import json
import random

import pytest

from dsakv import LLM, SamplingParams
from dsakv.cli import main

from .conftest import assert_integrity_catches

EXACT = dict(kv_cache_dtype="fp32", index_k_dtype="fp32", device="cpu", page_size=8)
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
HS = dict(enable_hisparse=True, hisparse_config={"host_to_device_ratio": 8}, num_pages=20)
VARIANTS = {
    # MTP on the last stage: the other stages' hot buffers take its steps too
    "mtp": dict(
        enable_hisparse=True,
        hisparse_config={"device_buffer_size": 64, "host_to_device_ratio": 4},
        num_pages=40,
        speculative_algorithm="mtp",
    ),
    # every request past its buffer retracted to the host tier and back (ratio 1)
    "retract-to-host": dict(
        enable_hisparse=True,
        hisparse_config={"host_to_device_ratio": 1},
        num_pages=24,
        host_pool_ratio=4,
    ),
}
COUNTED = ("spec_accepted_tokens", "spec_verify_steps", "retractions", "retractions_to_host")
# What each stage counts of its own layers, summed over the stages in rank 0's counters
LAYERED = ("hisparse_hits", "hisparse_misses", "hisparse_resolves", "hisparse_rows_to_device",
           "hisparse_bytes_to_host", "host_bytes_to_host", "host_bytes_to_device")  # fmt: skip


def _prompts() -> list[list[int]]:
    """Six prompts past the 32-slot buffer, and two that start inside it (their first
    decoded tokens take buffer entries of their own in every group a stage holds)."""
    rng = random.Random(0)
    lengths = [rng.randint(60, 120) for _ in range(6)] + [9, 14]
    return [[rng.randrange(1, 250) for _ in range(n)] for n in lengths]


def _run(model: str, **kw) -> tuple[list, dict]:
    """Each request's tokens and logprobs, stepped by hand with an integrity check (every
    rank's HiSparse replica included) after every step; and rank 0's counters."""
    with LLM(model, **EXACT, **kw) as llm:
        e = llm.engine
        reqs = [e.add_request(p, PARAMS) for p in _prompts()]
        while e.has_unfinished():
            e.step()
            e.check_integrity()
        return [(r.output_ids, r.logprobs) for r in reqs], e.counters()


@pytest.fixture(scope="module")
def roomy(glm_tiny) -> list:
    """The greedy tokens of a pool that holds every request, without HiSparse."""
    with LLM(glm_tiny, **EXACT, num_pages=256) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(_prompts(), PARAMS)]


@pytest.fixture(scope="module")
def one_stage(glm_tiny) -> tuple[list, dict]:
    return _run(glm_tiny, **HS)


@pytest.mark.parametrize(
    "stages", [dict(pp=2, pp_layer_partition="3,5"), dict(pp=3, pp_layer_partition="2,1,5")]
)
def test_stages_give_one_stages_tokens_and_logprobs(glm_tiny, roomy, one_stage, stages):
    """Decode steps miss on every stage (each resolves its groups' top-k); tokens and
    logprobs are one stage's, tokens the roomy pool's; rank 0's HiSparse counters are one
    stage's (each stage's rows, each group's lookups once: they were stage 0's alone)."""
    got, counters = _run(glm_tiny, **HS, **stages)
    assert got == one_stage[0]
    assert [t for t, _ in got] == roomy
    assert counters["hisparse_misses"] > 0
    assert {k: counters[k] for k in LAYERED} == {k: one_stage[1][k] for k in LAYERED}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mtp_and_the_host_tier_across_stages(glm_tiny, roomy, variant):
    """MTP (drafts made and kept) and retraction to the host tier give one stage's tokens,
    logprobs and counts."""
    kw = VARIANTS[variant]
    one, c1 = _run(glm_tiny, **kw)
    two, c2 = _run(glm_tiny, **kw, pp=2, pp_layer_partition="3,5")
    assert two == one and [t for t, _ in two] == roomy
    assert [c2[k] for k in COUNTED + LAYERED] == [c1[k] for k in COUNTED + LAYERED]
    counted = "spec_accepted_tokens" if variant == "mtp" else "retractions_to_host"
    assert c2[counted] > 0


def _one_at_a_time(model: str, **kw) -> list:
    """Six requests alone, twice over: the second round's prefixes come back from the
    host tier (promoted pages); tokens and logprobs."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    with LLM(model, **EXACT, **kw) as llm:
        e, out = llm.engine, []
        for _ in range(2):
            for p in _prompts()[:6]:
                r = e.add_request(p, params)
                while e.has_unfinished():
                    e.step()
                out.append((r.output_ids, r.logprobs))
        e.check_integrity()
        assert e.counters()["prefix_pages_promoted"] > 0
        return out


def test_tp2_by_pp2_reads_the_host_rows_its_stage_wrote(glm_tiny):
    """Four ranks, a host tier: each stage's TP ranks map their stage's host latent (its
    layers), which its TP rank 0 writes as it replays host-tier loads and after each step;
    the others read it only after it has (logprobs 0.06-0.4 off from a promoted prefix,
    and other tokens, before). Tokens are one rank's, logprobs within 1e-4 (TP sums in
    another order)."""
    kw = dict(HS, num_pages=20, host_pool_ratio=4, hisparse_config={"host_to_device_ratio": 2})
    got = _one_at_a_time(glm_tiny, **kw, tp=2, pp=2, pp_layer_partition="3,5")
    want = _one_at_a_time(glm_tiny, **kw)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, lp), (_, ref) in zip(got, want, strict=True):
        assert lp == pytest.approx(ref, abs=1e-4)


def test_a_stage_holds_its_groups_and_a_differing_replica_is_caught(glm_tiny):
    """Stage 0 (layers 0-2) holds groups 0 and 1, stage 1 (layers 3-7) groups 1, 4 and 6:
    group 1's state is on both and compared; one rank's changed state is caught."""
    with LLM(glm_tiny, **EXACT, **HS, pp=2, pp_layer_partition="3,5") as llm:
        e = llm.engine
        reqs = [e.add_request(p, PARAMS) for p in _prompts()[:2]]
        while not any(e.hot._reqs[r.rid].row >= 0 for r in reqs if r.rid in e.hot._reqs):
            e.step()
        states = e._on_every_rank("hisparse_replicas")
        groups = [{k.split()[1] for k in s if k.startswith("group ")} for s in states]
        assert groups == [{"0", "1"}, {"1", "4", "6"}]

        def corrupt(engine):
            g = engine.hot._group[1]
            engine.hot.buf_pos[g] += 1
            return lambda: engine.hot.buf_pos[g].sub_(1)

        message = "rank 1's HiSparse replica differs from rank 0's: group 1 buf_pos checksum"
        assert_integrity_catches(e, corrupt, message)
        for r in reqs:
            e.abort(r.rid)


def test_the_plan_is_the_stages_pool(glm_tiny, capsys):
    """`dsakv plan DIR --enable-hisparse --pp-size 2` gives the device latent slots and
    logical tokens the engine's stages hold (the least stage's), and stage 0's host
    latent; a node holds each stage's."""
    budget = "0.002"
    flags = ["--kv-cache-dtype", "fp32", "--index-k-dtype", "fp32", "--page-size", "8"]
    flags += ["--kv-budget-gib", budget, "--enable-hisparse", "--pp-size", "2"]
    flags += ["--pp-layer-partition", "3,5", "--hisparse-config", '{"host_to_device_ratio": 8}']
    assert main(["plan", glm_tiny, *flags, "--json"]) == 0
    split = json.loads(capsys.readouterr().out)["hisparse"]["elided"]
    hs = dict(HS, num_pages=None, kv_budget_gib=float(budget))
    with LLM(glm_tiny, **EXACT, **hs, pp=2, pp_layer_partition="3,5") as llm:
        e = llm.engine
        assert (split["device_tokens"], split["logical_tokens"]) == (
            e.pool.num_latent_tokens,
            e.pool.num_tokens,
        )
        assert split["stages_host_bytes"][0] == e.hot.host_nbytes
    assert split["host_bytes_per_node"] == sum(split["stages_host_bytes"])
