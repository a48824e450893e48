"""A weight update under requests paused in place (or retracted to the host tier): they go
on with the KV the old weights computed (partial rollouts accept it), but none of it is
served from the prefix cache to a request admitted after the update, neither the pages they
locked when it came (still in the tree: `PrefixCache.reset` drops only unlocked ones) nor
those they cache later (a prefill chunk's, their own at the end): such a request answers as
a fresh engine on the new checkpoint does, bit for bit."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from dsakv.config.presets import TINY_PRESETS
from dsakv.engine import LLM, SamplingParams
from dsakv.models.tiny import write_tiny_model

# index_topk over every context: chunked prefill and cached prefixes change no number.
from .test_update_weights import ENGINE_ARGS

PROMPT = list(range(5, 45))  # two whole pages cached while it prefills, then decodes
LONG = list(range(100, 200))  # three prefill chunks of 40: paused after the first
TOKENS, AT = 24, 6  # a paused request's output, and how much of it it has when paused
ASK = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[int, Any]:
    root = tmp_path_factory.mktemp("paused-cache")
    out = {}
    for name in ("glm-tiny", "deepseek-tiny"):
        p = copy.deepcopy(TINY_PRESETS[name])
        p["index_topk"] = 4096
        for s in (0, 1):
            out[name, s] = write_tiny_model(root / f"{name}-{s}", preset=p, seed=s)
    return out


def _answer(llm: LLM, prompt: list[int]) -> tuple:
    out = llm.generate([prompt], ASK)[0].outputs[0]
    return out.token_ids, out.logprobs


def _step_until(e, done) -> None:
    while not done():
        e.step()


@pytest.mark.parametrize(
    "case, preset, args",
    [
        # its prompt's pages locked when the update comes, then its own
        ("decoding", "glm-tiny", {}),
        # paused between prefill chunks: the next chunks' pages too
        ("prefilling", "glm-tiny", {}),
        # its KV back from the host tier after
        ("retracted", "glm-tiny", {"host_pool_gib": 0.05}),
        # the MTP layer's KV in the same pages
        ("decoding", "deepseek-tiny", {"speculative_algorithm": "mtp"}),
    ],
    ids=["decoding", "prefilling", "retracted-to-host", "mtp"],
)
def test_no_old_kv_is_served_after_a_paused_update(models, case, preset, args):
    engine_args = {**ENGINE_ARGS, **args}
    prompt = LONG if case == "prefilling" else PROMPT
    paused_at = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    fresh = LLM(str(models[preset, 1]), **engine_args)
    llm = LLM(str(models[preset, 0]), **engine_args)
    try:
        e = llm.engine
        a = e.add_request(prompt, paused_at)
        if case == "prefilling":
            e.step()
            assert 0 < a.num_computed < len(prompt)
        else:
            _step_until(e, lambda: len(a.output_ids) >= AT)
        e.paused = True  # (the server's /pause_generation)
        if case == "retracted":
            e.retract_all()
            assert a.host_slots is not None
        assert e.update_weights(str(models[preset, 1]))
        e.paused = False
        # admitted while the paused request still holds its pages: none of them
        assert _answer(llm, prompt) == _answer(fresh, prompt)
        _step_until(e, lambda: a.finished)
        assert len(a.output_ids) == TOKENS
        # after it ended: nor what it cached since, its whole sequence included
        for p in (prompt, a.all_ids[: len(prompt) + 16], a.all_ids):
            assert _answer(llm, p) == _answer(fresh, p)
        e.check_integrity()
        # the new weights' own pages are still shared
        assert llm.generate([prompt], ASK)[0].num_cached_tokens > 0
    finally:
        llm.close()
        fresh.close()


def test_two_paused_requests_sharing_a_prefix(models):
    """Two requests paused on one cached prompt prefix (both lock its pages), through two
    paused updates (their KV then mixes both weights): no request admitted after serves any
    of it, and each page goes back to the pool once, when the last of them ends."""
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    fresh = LLM(str(models["glm-tiny", 0]), **ENGINE_ARGS)
    llm = LLM(str(models["glm-tiny", 0]), **ENGINE_ARGS)
    try:
        e = llm.engine
        a = e.add_request(PROMPT, params)
        _step_until(e, lambda: len(a.output_ids) >= 2)
        b = e.add_request(PROMPT + [7, 8], params)
        _step_until(e, lambda: len(b.output_ids) >= 2)
        assert b.metrics.prefix_hit_tokens == 32
        for seed in (1, 0):
            e.paused = True
            assert e.update_weights(str(models["glm-tiny", seed]))
            e.paused = False
            for _ in range(3):
                e.step()
        _step_until(e, lambda: a.finished)
        assert _answer(llm, a.all_ids) == _answer(fresh, a.all_ids)
        _step_until(e, lambda: not e.has_unfinished())
        e.check_integrity()
        for p in (PROMPT, a.all_ids, b.all_ids):
            assert _answer(llm, p) == _answer(fresh, p)
        e.check_integrity()
    finally:
        llm.close()
        fresh.close()
