"""The CPU backend's decode attention: latent rows read from the pool's bytes and attended
in one function that `torch.compile` (inductor's C++ code generation) turns into a few
loops, so the gathered context is never materialised as an fp32 copy op by op.

Eager, the same function is the torch reference's arithmetic (`MLAMath.decode` in absorb
mode) with one difference in reading: rows are decoded from the stored bytes here, not
through `DSAKVPool.gather_latent`; the values are the same (e4m3 and bf16 widen exactly).
Compiled, the reductions may run in another order (differences at fp32 rounding).
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from dsakv.memory.fp8 import FP8_BLOCK, FP8_DTYPE, e4m3_to_float

from .torch_ops import per_head

log = logging.getLogger(__name__)


def latent_rows(
    data: torch.Tensor, slots: torch.Tensor, kind: str, lora: int, rope: int
) -> torch.Tensor:
    """fp32 rows `[*slots.shape, lora + rope]` of the latent buffer `data` (as the pool
    stores it: e4m3 / bf16 / fp32 rows, or uint8 `fp8_ds_mla` rows)."""
    if kind == "fp8_e4m3":
        return _widen_e4m3(data.view(torch.uint8)[slots])
    if kind == "fp8_ds_mla":
        raw = data[slots]
        nb = -(-lora // FP8_BLOCK)
        scales = raw[..., lora : lora + 4 * nb].contiguous().view(torch.float32)
        scales = scales.repeat_interleave(FP8_BLOCK, dim=-1)[..., :lora]
        nope = _widen_e4m3(raw[..., :lora]) * scales
        k_rope = raw[..., lora + 4 * nb :].contiguous().view(torch.bfloat16).float()
        return torch.cat([nope, k_rope], dim=-1)
    return data[slots].float()


def _widen_e4m3(raw: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes to fp32: a cast inside compiled code (one vectorised loop), the pool's
    table lookup in eager mode (where torch's scalar cast is several times slower)."""
    if torch.compiler.is_compiling():
        return raw.view(FP8_DTYPE).float()
    return e4m3_to_float(raw)


def decode_attention(
    q: torch.Tensor,
    data: torch.Tensor,
    slots: torch.Tensor,
    valid: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    kind: str,
    lora: int,
    rope: int,
) -> torch.Tensor:
    """Absorbed MLA for every decode request at once: `q[B, H, lora + rope]` (the latent
    query ‖ its rope part), `slots[B, k]` the rows each reads, `valid[B, k]` -> `[B, H, v]`."""
    ctx = latent_rows(data, slots, kind, lora, rope).to(q.dtype)
    scores = torch.bmm(q, ctx.transpose(1, 2))
    probs = (
        (scores * scale)
        .masked_fill(~valid[:, None, :], float("-inf"))
        .softmax(-1, dtype=torch.float32)
    )
    o_lat = torch.bmm(probs.to(ctx.dtype), ctx[..., :lora])
    return per_head(o_lat, w_uv)


class Compiled:
    """`torch.compile(fn, dynamic=True)` made once per process, with its warm-up timed.

    Shapes are dynamic (batch and context vary every step), so one compilation serves
    every step; a batch of one is specialised once more. `warmup_s` is the time the first
    calls of each specialisation spent compiling (inductor caches the code on disk, so a
    second process mostly re-traces).
    """

    def __init__(self, fn) -> None:
        self.fn = fn
        self.warmup_s = 0.0
        self._compiled = None
        self._seen: set[tuple] = set()
        self._lock = threading.Lock()

    def __call__(self, *args, **kwargs):
        key = tuple((a.shape[0] == 1, a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
        if key in self._seen:
            return self._compiled(*args, **kwargs)
        with self._lock:  # engines in threads of one process share the compiled code
            if self._compiled is None:
                from torch import _dynamo

                # Every engine of the process (other cache dtypes, model dtypes) adds one.
                _dynamo.config.cache_size_limit = max(_dynamo.config.cache_size_limit, 64)
                self._compiled = torch.compile(self.fn, dynamic=True)
            t0 = time.perf_counter()
            out = self._compiled(*args, **kwargs)
            spent = time.perf_counter() - t0
            self.warmup_s += spent
            self._seen.add(key)
        log.info("torch.compile warm-up of %s: %.1f s", self.fn.__name__, spent)
        return out


compiled_decode_attention = Compiled(decode_attention)
