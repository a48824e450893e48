"""`src/dsakv/kernels/triton_store.py` at commit 4f57181 (before 53668be), cut to what
`test_triton_aot.test_catches_two_returns_under_a_constexpr_if` compiles: `_load_rows`
returns under `if X_BF16:` and again after it, which the interpreter runs and the
compiler rejects for the bf16-rows specialisation. Test data: loaded as
`dsakv.kernels._old_store` (its relative imports resolve there), never imported as is.
"""

import torch

from ._triton import cdiv, next_pow2, require_triton, tl, triton
from .triton_fp8 import bf16_to_f32, f32_to_bf16_bits, f32_to_e4m3, mul_exp2, pow2_exponent

_FP8_BLOCK = 128
NUM_WARPS = 4


ROWS = 16  # input rows per program (2-D tiles: [ROWS, 128])


@triton.jit
def _load_rows(x, at, mask, X_BF16: tl.constexpr):
    if X_BF16:
        return bf16_to_f32(tl.load(x + at, mask=mask, other=0))
    return tl.load(x + at, mask=mask, other=0.0)


@triton.jit
def _row_slots(slots, n_rows, ROWS: tl.constexpr):
    """(row ids int64 [ROWS], their slots int64 (0 where skipped), store predicate)."""
    n = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    slot = tl.load(slots + n, mask=n < n_rows, other=-1).to(tl.int64)
    ok = slot >= 0
    return n, tl.where(ok, slot, 0), ok


@triton.jit
def _quantize_blocks(x):
    """x [ROWS, 128] (masked lanes 0) -> (e4m3 bits [ROWS, 128], fp32 scale bits [ROWS])."""
    k = pow2_exponent(tl.max(tl.abs(x), 1))
    codes = f32_to_e4m3(mul_exp2(x, -k[:, None]))
    scale_bits = tl.where(
        k >= -126, (tl.maximum(k, -126) + 127) << 23, 1 << tl.minimum(tl.maximum(k + 149, 0), 22)
    )
    return codes, scale_bits


@triton.jit
def _store_u32(dst, at, bits, ok):
    """Little-endian bytes of int32 `bits` [ROWS] at dst + at[r] .. + 3 where ok[r]."""
    i = tl.arange(0, 4)
    byte = ((bits[:, None] >> (8 * i[None, :])) & 0xFF).to(tl.uint8)
    tl.store(dst + at[:, None] + i[None, :], byte, mask=ok[:, None] & (i[None, :] < 4))


@triton.jit
def _ds_mla_kernel(
    rows,
    s_row,
    n_rows,
    dst,
    s_dst,
    slots,
    KV_LORA: tl.constexpr,
    ROPE: tl.constexpr,
    NB: tl.constexpr,
    X_BF16: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ROWS: tl.constexpr,
):
    n, slot, ok = _row_slots(slots, n_rows, ROWS)
    out_at = slot * s_dst
    in_row = n[:, None] < n_rows
    c = tl.arange(0, 128)
    for blk in tl.static_range(NB):
        d = blk * 128 + c
        x = _load_rows(
            rows, n[:, None] * s_row + d[None, :], in_row & (d[None, :] < KV_LORA), X_BF16
        )
        codes, scale_bits = _quantize_blocks(x)
        m = ok[:, None] & (d[None, :] < KV_LORA)
        tl.store(dst + out_at[:, None] + d[None, :], codes.to(tl.uint8), mask=m)
        _store_u32(dst, out_at + KV_LORA + 4 * blk, scale_bits, ok)
    r = tl.arange(0, BLOCK_R)
    x = _load_rows(
        rows, n[:, None] * s_row + KV_LORA + r[None, :], in_row & (r[None, :] < ROPE), X_BF16
    )
    bits = f32_to_bf16_bits(x)
    rope_at = out_at[:, None] + KV_LORA + 4 * NB + 2 * r[None, :]
    m = ok[:, None] & (r[None, :] < ROPE)
    tl.store(dst + rope_at, (bits & 0xFF).to(tl.uint8), mask=m)
    tl.store(dst + rope_at + 1, (bits >> 8).to(tl.uint8), mask=m)


def _rows_view(x: torch.Tensor, dim: int, n: int) -> tuple[torch.Tensor, bool]:
    if x.dim() != 2 or x.shape != (n, dim):
        raise ValueError(f"rows must be [{n}, {dim}], got {tuple(x.shape)}")
    if x.dtype == torch.bfloat16:
        x = x if x.stride(1) == 1 else x.contiguous()
        return x.view(torch.int16), True
    x = x.float()
    return (x if x.stride(1) == 1 else x.contiguous()), False


def _slots(slots: torch.Tensor) -> torch.Tensor:
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"slots must be a 1-D int32/int64 tensor, got {slots.dtype} {tuple(slots.shape)}"
        )
    return slots.contiguous()


def store_latent_ds_mla(
    rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, kv_lora: int, rope_dim: int
) -> None:
    """Write latent rows `[N, kv_lora+rope]` (fp32/bf16) into the fp8_ds_mla buffer `cache`
    (uint8 `[S, kv_lora + 4·nb + 2·rope]`, 656 B for 512+64) at `slots`; slot < 0 skipped."""
    require_triton()
    slots = _slots(slots)
    nb = cdiv(kv_lora, _FP8_BLOCK)
    rv, x_bf16 = _rows_view(rows, kv_lora + rope_dim, slots.shape[0])
    width = kv_lora + 4 * nb + 2 * rope_dim
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.shape[1] != width:
        raise ValueError(f"fp8_ds_mla cache must be uint8 [S, {width}], got {tuple(cache.shape)}")
    if cache.stride(1) != 1:
        raise ValueError("fp8_ds_mla cache rows must be contiguous")
    if slots.shape[0]:
        _ds_mla_kernel[(cdiv(slots.shape[0], ROWS),)](
            rv, rv.stride(0), slots.shape[0], cache, cache.stride(0), slots,
            KV_LORA=kv_lora, ROPE=rope_dim, NB=nb, X_BF16=x_bf16,
            BLOCK_R=next_pow2(rope_dim), ROWS=ROWS, num_warps=NUM_WARPS,
        )  # fmt: skip


__all__ = ["store_latent_ds_mla"]
