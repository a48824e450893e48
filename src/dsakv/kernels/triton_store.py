"""Quantise-and-store kernels, byte-identical to `DSAKVPool.write_*` on the CPU.

One program per ROWS input rows: quantise in registers and scatter the bytes to the row's slot
(slots < 0 are skipped, on the device), replacing the CPU path's encode + cat + index_put.
The scale rule is `dsakv.memory.fp8.pow2_block_scale` (exact, from the exponent bits):
scale = 2^ceil(log2(amax/448)) per 128 values, 1.0 for an all-zero block; values are
divided by it exactly and rounded to e4m3 nearest-even. Every byte is written through one
uint8 tensor (little-endian fp32 scales and bf16 rope), so the kernels need no aligned views.

Layouts written (see `dsakv.memory.pool`):

- `store_index_k_fp8` → `_PageMajorFp8`: page row of `ps·(D+4·nb)` bytes: key bytes at
  `off·D`, then scales at `ps·D + off·4·nb`.
- `store_latent_ds_mla` → `_DsMlaLatent`: row = e4m3 nope ‖ fp32 scale per 128 ‖ bf16 rope.
- `store_latent_fp8_e4m3` → `_TokenMajor` e4m3: saturating plain cast (clamp ±448, RNE).

Inputs must be finite (NaN/inf are not given torch's exact bytes). Slots must be < the
buffer's token count: nothing is checked on the host, so the launch is CUDA-graph safe.
"""

import torch

from dsakv.memory.layout import scale_blocks

from ._triton import cdiv, next_pow2, require_triton, tl, triton
from .triton_fp8 import bf16_to_f32, f32_to_bf16_bits, f32_to_e4m3, mul_exp2, pow2_exponent

NUM_WARPS = 4


ROWS = 16  # input rows per program (2-D tiles: [ROWS, 128])


@triton.jit
def _load_rows(x, at, mask, X_BF16: tl.constexpr):
    # One return: the compiler rejects a `return` under a constexpr `if` followed by
    # another (the interpreter accepts it).
    if X_BF16:
        v = bf16_to_f32(tl.load(x + at, mask=mask, other=0))
    else:
        v = tl.load(x + at, mask=mask, other=0.0)
    return v


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
def _index_k_kernel(
    keys,
    s_key,
    n_rows,
    dst,
    s_page,
    slots,
    PS: tl.constexpr,
    D: tl.constexpr,
    NB: tl.constexpr,
    X_BF16: tl.constexpr,
    ROWS: tl.constexpr,
):
    n, slot, ok = _row_slots(slots, n_rows, ROWS)
    page_at = (slot // PS) * s_page
    off = slot % PS
    c = tl.arange(0, 128)
    for blk in tl.static_range(NB):
        d = blk * 128 + c
        dm = (n[:, None] < n_rows) & (d[None, :] < D)
        codes, scale_bits = _quantize_blocks(
            _load_rows(keys, n[:, None] * s_key + d[None, :], dm, X_BF16)
        )
        key_at = (page_at + off * D)[:, None] + d[None, :]
        tl.store(dst + key_at, codes.to(tl.uint8), mask=ok[:, None] & (d[None, :] < D))
        _store_u32(dst, page_at + PS * D + off * (4 * NB) + 4 * blk, scale_bits, ok)


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


@triton.jit
def _e4m3_kernel(
    rows,
    s_row,
    n_rows,
    dst,
    s_dst,
    slots,
    DIM: tl.constexpr,
    X_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    n, slot, ok = _row_slots(slots, n_rows, ROWS)
    d = tl.arange(0, BLOCK)
    for d0 in tl.static_range(0, DIM, BLOCK):
        dd = d0 + d
        x = _load_rows(
            rows,
            n[:, None] * s_row + dd[None, :],
            (n[:, None] < n_rows) & (dd[None, :] < DIM),
            X_BF16,
        )
        at = (slot * s_dst)[:, None] + dd[None, :]
        tl.store(dst + at, f32_to_e4m3(x).to(tl.uint8), mask=ok[:, None] & (dd[None, :] < DIM))


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


def store_index_k_fp8(
    keys: torch.Tensor, kpages: torch.Tensor, slots: torch.Tensor, page_size: int
) -> None:
    """Quantise Hadamard-rotated `keys` `[N, D]` (fp32/bf16; rotate first with
    `fp8.hadamard_rotate`) into the page-major fp8 index-K buffer `kpages` (uint8
    `[P, ps·(D+4·nb)]`) at `slots` `[N]`; slot < 0 is skipped."""
    require_triton()
    slots = _slots(slots)
    dim = keys.shape[-1]
    nb = scale_blocks(dim)
    kv, x_bf16 = _rows_view(keys, dim, slots.shape[0])
    if kpages.dtype != torch.uint8 or kpages.dim() != 2 or kpages.stride(1) != 1:
        raise ValueError("kpages must be a row-major uint8 [P, ps·(D+4·nb)] tensor")
    if kpages.shape[1] != page_size * (dim + 4 * nb):
        raise ValueError(f"kpages rows are {kpages.shape[1]} B, want {page_size * (dim + 4 * nb)}")
    if slots.shape[0]:
        _index_k_kernel[(cdiv(slots.shape[0], ROWS),)](
            kv, kv.stride(0), slots.shape[0], kpages, kpages.stride(0), slots,
            PS=page_size, D=dim, NB=nb, X_BF16=x_bf16, ROWS=ROWS, num_warps=NUM_WARPS,
        )  # fmt: skip


def store_latent_ds_mla(
    rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, kv_lora: int, rope_dim: int
) -> None:
    """Write latent rows `[N, kv_lora+rope]` (fp32/bf16) into the fp8_ds_mla buffer `cache`
    (uint8 `[S, kv_lora + 4·nb + 2·rope]`, 656 B for 512+64) at `slots`; slot < 0 skipped."""
    require_triton()
    slots = _slots(slots)
    nb = scale_blocks(kv_lora)
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


def store_latent_fp8_e4m3(rows: torch.Tensor, cache_u8: torch.Tensor, slots: torch.Tensor) -> None:
    """Plain saturating e4m3 store (clamp ±448, round-to-nearest-even) of `rows` `[N, D]`
    (fp32/bf16) into `cache_u8` (`[S, D]`, uint8 or float8_e4m3fn) at `slots`."""
    require_triton()
    slots = _slots(slots)
    dst = cache_u8.view(torch.uint8) if cache_u8.dtype == torch.float8_e4m3fn else cache_u8
    if dst.dtype != torch.uint8 or dst.dim() != 2 or dst.stride(1) != 1:
        raise ValueError("cache must be a row-major uint8 / float8_e4m3fn [S, D] tensor")
    dim = dst.shape[1]
    rv, x_bf16 = _rows_view(rows, dim, slots.shape[0])
    if slots.shape[0]:
        _e4m3_kernel[(cdiv(slots.shape[0], ROWS),)](
            rv, rv.stride(0), slots.shape[0], dst, dst.stride(0), slots,
            DIM=dim, X_BF16=x_bf16, BLOCK=min(next_pow2(dim), 128), ROWS=ROWS,
            num_warps=NUM_WARPS,
        )  # fmt: skip


__all__ = ["store_index_k_fp8", "store_latent_ds_mla", "store_latent_fp8_e4m3"]
