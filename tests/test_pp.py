"""Pipeline parallelism (`--pp-size`) on CPU ranks (gloo): each stage builds, loads and
caches only its layers, a stage starting on a shared layer receives its source's top-k, and
the outputs are the one-stage engine's, bit for bit (the same computation per layer): the
even split, a custom partition with the host tier and n-gram drafts, TP x PP, MTP, weight
updates and sleep mode; what pp > 1 refuses is one error line."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file

from dsakv import LLM, SamplingParams
from dsakv.distributed.parallel import ParallelConfig, ParallelState
from dsakv.errors import DsakvError
from dsakv.memory import CacheLayout
from dsakv.memory.pool import DSAKVPool
from dsakv.models import load_model, loader
from dsakv.models.dsa import MissingLayer

from .conftest import cli_error_line, flat_logprobs

EXACT = dict(kv_cache_dtype="fp32", index_k_dtype="fp32", device="cpu", page_size=16)
# Chunked prefill (16-token chunks), sampled-token and prompt logprobs (`runner.logits`)
PARAMS = SamplingParams(
    max_tokens=16, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1
)
CACHED = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
ENGINE = dict(EXACT, num_pages=48, chunked_prefill_size=16)
# glm-tiny: indexer_types F F S S F S F S, index_topk 16 (every context here passes it).
PARTITION = (3, 5)  # stage 1 starts on shared layer 3, whose top-k is layer 1's (stage 0)


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(256) for _ in range(rng.randint(8, 60))] for _ in range(n)]


PROMPTS = _prompts(5) + [list(range(40, 100))]
# After PROMPTS: a prefix-cache hit on the last one's first 3 pages
AGAIN = [PROMPTS[-1][:48] + [1, 2, 3]]


def _outputs(llm: LLM, prompts=PROMPTS, params=PARAMS, again=AGAIN) -> list:
    """Each request's tokens, their top-2 logprobs and its prompt logprobs: `prompts`, then
    `again` (once the first are cached; without prompt logprobs, which skip the cache)."""
    outs = llm.generate(prompts, params) + (llm.generate(again, CACHED) if again else [])
    llm.engine.check_integrity()
    return [
        (
            o.outputs[0].token_ids,
            flat_logprobs(o.outputs[0].logprobs, o.outputs[0].token_ids, 2),
            o.prompt_logprobs and flat_logprobs(o.prompt_logprobs, o.prompt_token_ids),
        )
        for o in outs
    ]


def _run(model: str, **kw) -> tuple[list, dict]:
    with LLM(model, **{**ENGINE, **kw}) as llm:
        return _outputs(llm), llm.engine.counters()


@pytest.fixture(scope="module")
def reference(glm_tiny):
    return _run(glm_tiny)


@pytest.fixture(scope="class")
def pp2(glm_tiny):
    """A 2-stage engine (4 + 4 layers) for `TestEvenSplit`, closed after it (one multi-rank
    engine a process)."""
    with LLM(glm_tiny, **ENGINE, pp=2) as llm:
        yield llm


class TestEvenSplit:
    def test_two_stages_equal_one(self, reference, pp2):
        """The even split (4 + 4 layers): same tokens, logprobs and prompt logprobs over
        chunked prefills and a prefix-cache hit."""
        outs, counters = reference
        assert _outputs(pp2) == outs
        hits = pp2.engine.counters()["prefix_hit_tokens"]
        assert hits == counters["prefix_hit_tokens"] > 0

    def test_weight_updates_and_sleep_reach_every_stage(self, glm_tiny, reference, pp2):
        """A tensor of stage 1's layer updated and read back by name, sleep mode level 2 (the
        weights discarded) and the checkpoint loaded again: each stage reads its own tensors."""
        name = "model.layers.6.self_attn.kv_b_proj.weight"
        stored = load_file(f"{glm_tiny}/model.safetensors")[name]
        assert pp2.get_weights_by_name(name, 2) == stored[:2].tolist()
        pp2.update_weights_from_tensor([(name, torch.zeros_like(stored))])
        assert pp2.get_weights_by_name(name, 2) == torch.zeros(2, stored.shape[1]).tolist()
        pp2.sleep(level=2)
        pp2.wake_up()
        pp2.update_weights(glm_tiny)
        assert pp2.get_weights_by_name(name, 2) == stored[:2].tolist()
        assert _outputs(pp2) == reference[0]


def test_a_stage_starting_on_a_shared_layer_gets_its_topk(glm_tiny):
    """Partition 3,5: layer 3 (stage 1) reads layer 1's top-k, sent with the hidden rows.
    With a small pool and a host tier (a prefix goes to the host and back, each stage
    replaying rank 0's copies on its own layers) and n-gram drafts (verify rows)."""
    kw = dict(num_pages=10, host_pool_gib=0.01, speculative_algorithm="ngram")
    one, c1 = _run(glm_tiny, **kw)
    two, c2 = _run(glm_tiny, pp=2, pp_layer_partition=PARTITION, **kw)
    assert two == one
    assert c2["retractions_to_host"] > 0 and c2["host_bytes_to_device"] > 0
    assert c2["spec_verify_steps"] == c1["spec_verify_steps"] > 0


def test_a_stage_builds_loads_and_caches_only_its_layers(glm_tiny, monkeypatch):
    """Stage 1 of partition 3,5 (built without a process group: nothing runs): layers 3..7
    and the MTP layer, no indexer on shared layer 3, no index-K buffer for it; the other
    stage's parts are placeholders that say where they run, and are never read."""
    read: list[str] = []
    copy = loader._copy
    monkeypatch.setattr(loader, "_copy", lambda name, *a: (read.append(name), copy(name, *a)))
    stage = ParallelState(ParallelConfig(pp=2, pp_partition=PARTITION), rank=1)
    model, config, plan = load_model(glm_tiny, parallel=stage, draft_layers=1)
    layers = {int(n.split(".")[2]) for n, _ in model.named_parameters() if ".layers." in n}
    assert layers == {3, 4, 5, 6, 7, 8}
    assert {int(n.split(".")[2]) for n in read if ".layers." in n} == layers
    assert plan.carried_sources(3) == (1,)
    assert not hasattr(model.model.layers[3].self_attn, "indexer")
    assert hasattr(model.model.layers[4].self_attn, "indexer")
    assert isinstance(model.model.layers[2], MissingLayer)
    with pytest.raises(DsakvError, match="model.layers.2 is held by pipeline stage 0"):
        model.model.layers[2](None)
    layout = CacheLayout.for_model(glm_tiny, "fp32", "fp32", 16, draft_layers=1)
    pool = DSAKVPool(layout.for_stage(range(3, 8)), 2, torch.device("cpu"))
    assert [i for i in range(3, 9) if pool.has_index_k(i)] == [4, 6, 8]
    with pytest.raises(Exception, match="stage"):
        pool.has_index_k(2)


def test_tp2_by_pp2_equals_tp2(glm_tiny):
    """4 ranks (2 stages of 2 TP ranks) against the 2 TP ranks: the model's collectives run
    over each stage's TP group; same tokens and logprobs."""
    prompts, params = PROMPTS[:3], SamplingParams(max_tokens=8, temperature=0, logprobs=1)
    outs = {}
    for pp in (1, 2):
        with LLM(glm_tiny, **ENGINE, tp=2, pp=pp) as llm:
            outs[pp] = _outputs(llm, prompts, params, again=None)
    assert outs[2] == outs[1]


def test_mtp_on_the_last_stage_keeps_tokens_and_drafts(glm_tiny, reference):
    """The MTP layer on the last stage (its draft logits sent to rank 0, chained there):
    the greedy tokens are the target's, and the drafts and acceptances one stage makes."""
    mtp = dict(speculative_algorithm="mtp", speculative_num_steps=3)
    one, c1 = _run(glm_tiny, **mtp)
    two, c2 = _run(glm_tiny, pp=2, **mtp)
    assert [t for t, *_ in two] == [t for t, *_ in reference[0]]
    assert two == one
    keys = ("spec_draft_tokens", "spec_accepted_tokens", "spec_verify_steps")
    assert [c2[k] for k in keys] == [c1[k] for k in keys]
    assert c2["spec_accepted_tokens"] > 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--enable-lora"], "--enable-lora does not run with --pp-size 2 (> 1) yet"),
        (["--enable-hisparse"], "--enable-hisparse does not run with --pp-size 2"),
        (["--hicache-storage-backend", "file"], "--hicache-storage-backend does not run with"),
        (["--enable-return-hidden-states"], "--enable-return-hidden-states does not run with"),
        (["--disaggregation-mode", "prefill"], "no --tp / --pp-size / --dp-attention"),
        (["--pp-layer-partition", "3,4"], "covers 7 layers; the model has 8"),
        (["--pp-layer-partition", "2,2,4"], "must be 2 integers >= 1"),
        (["--tp", "2", "--dp-attention"], "--dp-attention with --pp-size > 1 is not supported"),
    ],
)
def test_what_stages_refuse_is_one_error_line(glm_tiny, flags, message, capsys):
    line = cli_error_line(["serve", glm_tiny, "--pp-size", "2", *flags], capsys)
    assert message in line, line
