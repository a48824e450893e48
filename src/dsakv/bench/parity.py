"""Parity: elided vs dense greedy outputs (must be identical), FP8 vs fp32 cache top-1.

The FP8-vs-fp32 figure is teacher-forced: both pools decode the same tokens (the fp32
pool's greedy choice), so every step compares the two caches on the same context.
"""

from __future__ import annotations

from typing import Any

import torch
from tqdm.auto import tqdm

from dsakv.errors import DsakvError
from dsakv.memory import CacheLayout, DSAKVPool
from dsakv.models import DSAForCausalLM, ForwardBatch


class ParityError(DsakvError):
    """Elided and dense index-K layouts produced different greedy tokens."""


def compare_outputs(elided: list[list[int]], dense: list[list[int]]) -> dict[str, Any]:
    mismatched = [i for i, (a, b) in enumerate(zip(elided, dense)) if a != b]
    if len(elided) != len(dense):
        mismatched.append(-1)
    return {
        "requests": len(elided),
        "tokens": sum(map(len, elided)),
        "mismatched_requests": mismatched,
        "identical": not mismatched,
    }


def fp8_vs_fp32(
    model: DSAForCausalLM, prompts: list[list[int]], steps: int, page_size: int = 64
) -> dict[str, Any]:
    """Top-1 agreement of fp8_e4m3/fp8 (elided) vs fp32/fp32 caches over `steps` decodes."""
    config, plan = model.config, model.plan
    layouts = {
        "fp32": CacheLayout.from_plan(config, plan, "fp32", "fp32", page_size),
        "fp8": CacheLayout.from_plan(config, plan, "fp8_e4m3", "fp8", page_size),
    }
    per_req = -(-(max(map(len, prompts)) + steps + 1) // page_size)
    pools = {k: DSAKVPool(v, per_req * len(prompts)) for k, v in layouts.items()}
    base = [
        torch.arange(r * per_req * page_size, (r + 1) * per_req * page_size)
        for r in range(len(prompts))
    ]
    lens = [len(p) for p in prompts]

    def run(pool: DSAKVPool, new: list[list[int]]) -> torch.Tensor:
        fb = ForwardBatch.from_requests(new, [b[:n] for b, n in zip(base, lens)])
        hidden = model(fb, pool)
        return model.compute_logits(hidden[fb.last_token_indices()])

    agree = total = 0
    first_mismatch: int | None = None
    max_diff = 0.0
    new = [list(p) for p in prompts]
    for step in tqdm(range(steps + 1), desc="fp8 vs fp32", unit="step", leave=False):
        ref = run(pools["fp32"], new)
        got = run(pools["fp8"], new)
        ref_tok, got_tok = ref.argmax(-1), got.argmax(-1)
        same = int((ref_tok == got_tok).sum())
        if step:  # step 0 is the prefill's prediction; count decode steps only
            agree += same
            total += len(prompts)
            if same < len(prompts) and first_mismatch is None:
                first_mismatch = step
        max_diff = max(max_diff, float((ref - got).abs().max()))
        new = [[t] for t in ref_tok.tolist()]
        lens = [n + 1 for n in lens]
    return {
        "sequences": len(prompts),
        "prompt_lens": [len(p) for p in prompts],
        "decode_steps": steps,
        "compared": total,
        "agree": agree,
        "top1_agreement": agree / total if total else None,
        "first_mismatch_step": first_mismatch,
        "max_abs_logit_diff": max_diff,
    }
