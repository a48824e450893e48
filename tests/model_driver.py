"""Test driver for `DSAForCausalLM`: page-aligned slots from a counter, prefill + greedy decode."""

from __future__ import annotations

import weakref

import torch

from dsakv.memory import CacheLayout, DSAKVPool
from dsakv.models import ForwardBatch

PAGE = 16


def make_pool(config, plan, num_tokens: int = 4096, **layout_kw) -> DSAKVPool:
    layout_kw = {"kv_cache_dtype": "fp32", "index_k_dtype": "fp32", **layout_kw}
    layout = CacheLayout.from_plan(config, plan, page_size=PAGE, **layout_kw)
    return DSAKVPool(layout, num_tokens // PAGE)


_next_page: weakref.WeakKeyDictionary[DSAKVPool, int] = weakref.WeakKeyDictionary()


class Request:
    """One sequence: tokens so far and page-aligned slots from a per-pool page counter."""

    def __init__(self, pool: DSAKVPool, prompt: list[int], max_len: int) -> None:
        pages = -(-max_len // PAGE)
        first = _next_page.get(pool, 0)
        if (first + pages) * PAGE > pool.num_tokens:
            raise ValueError("test pool is full")
        _next_page[pool] = first + pages
        base = first * PAGE
        self.all_slots = torch.arange(base, base + pages * PAGE)
        self.tokens = list(prompt)
        self.done = 0  # tokens already in the pool

    def step(self, n: int | None = None) -> tuple[list[int], torch.Tensor]:
        """The next `n` (default: all pending) tokens and the slots of the context after them."""
        n = len(self.tokens) - self.done if n is None else n
        new = self.tokens[self.done : self.done + n]
        self.done += n
        return new, self.all_slots[: self.done]


def run_batch(model, pool, reqs: list[Request], sizes: list[int | None]) -> torch.Tensor:
    """One engine step over several requests; returns fp32 logits of each request's last token."""
    parts = [r.step(n) for r, n in zip(reqs, sizes)]
    batch = ForwardBatch.from_requests([p[0] for p in parts], [p[1] for p in parts])
    hidden = model(batch, pool)
    return model.compute_logits(hidden[batch.last_token_indices()])


def greedy(
    model,
    pool,
    prompt: list[int],
    steps: int,
    chunk: int | None = None,
    force: list[int] | None = None,
) -> tuple[list[int], torch.Tensor]:
    """Prefill (in `chunk`-sized pieces) then `steps` decode steps; returns tokens and logits.

    With `force`, those tokens are fed instead of the argmax (teacher forcing); the returned
    tokens are still the model's own argmax at each step.
    """
    req = Request(pool, prompt, len(prompt) + steps + 1)
    while req.done < len(req.tokens):
        n = min(chunk or len(prompt), len(req.tokens) - req.done)
        logits = run_batch(model, pool, [req], [n])
    out_tokens, out_logits = [], [logits[0]]
    for i in range(steps):
        nxt = int(logits[0].argmax())
        out_tokens.append(nxt)
        req.tokens.append(force[i] if force is not None else nxt)
        if i + 1 < steps:
            logits = run_batch(model, pool, [req], [1])
            out_logits.append(logits[0])
    return out_tokens, torch.stack(out_logits)


def fp8_block_quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`w` as DeepSeek/GLM FP8 releases ship it: 128×128-block e4m3 weight and its
    per-block `weight_scale_inv`; also returns the dequantised weight (what loading gives)."""
    w = w.float()
    r, c = w.shape
    pr, pc = -(-r // 128) * 128, -(-c // 128) * 128
    blocks = torch.nn.functional.pad(w, (0, pc - c, 0, pr - r)).view(pr // 128, 128, pc // 128, 128)
    scale = blocks.abs().amax((1, 3)).clamp_min(1e-12) / 448.0
    s = scale.repeat_interleave(128, 0)[:r].repeat_interleave(128, 1)[:, :c]
    q = (w / s).to(torch.float8_e4m3fn)
    return q, scale, q.float() * s
