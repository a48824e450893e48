"""FP8 helpers for the KV cache: Hadamard rotation and block-wise e4m3 quantisation.

The index-K cache stores keys as e4m3 with one power-of-two fp32 scale per 128 values,
after a normalised Walsh–Hadamard rotation (DESIGN.md §3). The rotation spreads outliers
across the block so one large value does not flush the rest to zero; because H/√d is
orthogonal, rotating both q and k leaves every q·k unchanged (§7.7: both or neither).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from .layout import FP8_BLOCK, scale_blocks

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


@lru_cache(maxsize=32)
def hadamard_matrix(d: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Sylvester Hadamard matrix scaled by 1/√d (orthogonal and symmetric)."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two dimension, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).to(device=device, dtype=dtype)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """`x @ H/√d` over the last dim; computed in fp32 (fp64 stays fp64), returned in x's dtype."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = hadamard_matrix(x.shape[-1], x.device, compute)
    return (x.to(compute) @ h).to(x.dtype)


@lru_cache(maxsize=8)
def _e4m3_table(device: torch.device) -> torch.Tensor:
    """fp32 value of each of the 256 e4m3 bit patterns."""
    return torch.arange(256, dtype=torch.uint8, device=device).view(FP8_DTYPE).float()


def e4m3_to_float(q: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes (`uint8`) to fp32 by table lookup: bit-identical to a cast, and several
    times faster than `.to(float32)` on CPU, where the cache is read every decode step."""
    table = _e4m3_table(q.device)
    return table.index_select(0, q.reshape(-1).int()).view(q.shape)


def pow2_block_scale(amax: torch.Tensor) -> torch.Tensor:
    """2**ceil(log2(amax/448)) per element (fp32 amax >= 0), 1.0 where amax == 0, exactly.

    Computed from the exponent, not with `log2`: fp32 `log2` rounds a quotient just above a
    power of two (e.g. amax = nextafter(14, inf), amax/448 = 2^-5·(1+2^-23)) to the integer
    itself, so `ceil` lands one exponent low and the block saturates at ±448. With
    amax = m·2^e (`frexp`, m in [0.5, 1)), amax <= 448·2^k = 0.875·2^(k+9) iff k >= e-9,
    plus one when m > 0.875. This equals the bit rule on fl(amax/448) (exponent field, +1
    unless the mantissa is zero) wherever that quotient is a normal fp32 (amax >= 2^-117);
    below it the quotient itself rounds, and this stays exact. k >= -149 (smallest fp32
    power of two). The Triton store kernels (`dsakv.kernels.triton_fp8.pow2_exponent`) use
    the same rule, so CPU and GPU pools stay byte-equal.
    """
    m, e = torch.frexp(amax.float())
    k = torch.where(amax > 0, e - 9 + (m > 0.875).to(e.dtype), torch.zeros_like(e))
    k = k.to(torch.int32).clamp(min=-149)
    normal = ((k.clamp(min=-126) + 127) << 23).view(torch.float32)
    sub = (torch.ones_like(k) << (k + 149).clamp(0, 22)).view(torch.float32)
    return torch.where(k >= -126, normal, sub)


def quantize_e4m3_blockwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x[N, d]` -> (e4m3 bytes `uint8[N, d]`, fp32 scales `[N, ceil(d/128)]`).

    scale = 2**ceil(log2(amax/448)) per block of 128 values (1.0 for an all-zero block), so
    dividing by it is exact and every scaled value fits e4m3 without saturating. The
    exponent is taken exactly (`pow2_block_scale`), not through a rounded `log2`.
    """
    if x.dim() != 2:
        raise ValueError(f"expected a [N, d] tensor, got shape {tuple(x.shape)}")
    n, d = x.shape
    nb = scale_blocks(d)
    xf = x.float()
    if nb * FP8_BLOCK != d:  # pad a partial last block with zeros (does not change amax)
        xf = torch.nn.functional.pad(xf, (0, nb * FP8_BLOCK - d))
    blocks = xf.view(n, nb, FP8_BLOCK)
    scale = pow2_block_scale(blocks.abs().amax(-1))
    q = (blocks / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(n, nb * FP8_BLOCK)[:, :d].view(torch.uint8).contiguous(), scale


def dequantize_e4m3_blockwise(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `quantize_e4m3_blockwise`: `uint8[N, d]` + `fp32[N, nb]` -> `dtype[N, d]`."""
    d = q.shape[-1]
    vals = e4m3_to_float(q)
    s = scale.float().repeat_interleave(FP8_BLOCK, dim=-1)[..., :d]
    return (vals * s).to(dtype)
