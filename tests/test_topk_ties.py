"""Deterministic top-k (DESIGN.md §7.8): indexer score ties go to the lower position, so a
request's selection, and its greedy tokens, never depend on padding or batch companions."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from dsakv import LLM, SamplingParams
from dsakv.kernels import topk_by_position
from dsakv.models.tiny import TINY_PRESETS, write_tiny_model


def test_ties_go_to_the_lower_position_whatever_the_padding():
    g = torch.Generator().manual_seed(0)
    # Mostly exact zeros (ReLU), some -0.0 (a negative head weight times 0), a few positives.
    scores = torch.randint(-1, 3, (6, 200), generator=g).float().clamp_min(0)
    scores[:, ::7] = -0.0
    scores[:, 150:] = float("-inf")  # masked (future / beyond the context)
    k = 40
    want = torch.sort(scores + 0.0, dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(topk_by_position(scores, k), want)
    for width in (150, 173, 512):  # the same rows padded to another batch width
        padded = torch.full((6, width), float("-inf"))
        padded[:, :150] = scores[:, :150]
        assert torch.equal(topk_by_position(padded, k), want)
    assert (want < 150).all()


@pytest.fixture(scope="module")
def tie_model(tmp_path_factory):
    """glm-tiny with 3 indexer heads: with so few heads many tokens' ReLU scores are all
    exactly 0 and index_topk (16) is far below the contexts, so the k-th place is a tie.
    With `topk` alone (the old code) the 41- and 70-token requests' greedy tokens change
    when batched with the others (checked when this test was written)."""
    config = copy.deepcopy(TINY_PRESETS["glm-tiny"])
    config["index_n_heads"] = 3
    return str(write_tiny_model(tmp_path_factory.mktemp("ties"), config, seed=0))


def test_greedy_tokens_are_the_same_batched_and_alone(tie_model):
    rng = random.Random(2)  # with plain `topk`, requests 0 and 1 differ batched vs alone
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (41, 70, 96)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    kw = dict(kv_cache_dtype="fp32", index_k_dtype="fp32", device="cpu", page_size=16)
    llm = LLM(tie_model, num_pages=64, enable_prefix_cache=False, **kw)
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    assert batched == alone
