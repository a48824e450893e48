"""Lightning-indexer logits straight from dsakv's paged fp8 index-K (no dequantised copy).

Layout read (`dsakv.memory.pool._PageMajorFp8`, DeepGEMM's paged layout at ps 64): one
uint8 row per page of `ps·(D+4)` bytes, all `ps × D` e4m3 key bytes first (token-major),
then `ps` fp32 scales (one per key: D = 128 is one scale block). Slot = page·ps + offset.

logits[q, s] = Σ_h w[q, h] · ReLU(q_h · k_s), k_s = e4m3(bytes_s) · scale_s, and −inf for
keys the query may not see. The caller folds every scalar factor (1/√d, 1/√heads, a q
scale) into `w`, and passes the rotated query (`DSAKVPool.prepare_index_q`). Since scales
are positive powers of two, ReLU(q·e·scale) = ReLU(q·e)·scale: the dot runs on the decoded
bytes and the scale is applied per column.

One program scores BLOCK_N keys for one query with a `tl.dot` over [heads × D] × [D × keys]
(heads padded to ≥ 16 and masked). Lengths / positions are read on the device and blocks
past them skip their loads, so a fixed-width launch is CUDA-graph safe. Dot precision
follows q's dtype: bf16 q → a bf16 dot (e4m3 keys are bf16-exact, so every product is
exact, as in tf32, at twice tf32's tensor-core rate; the interpreter dots the same values
in fp32), fp32 q → `tf32x3`.
"""

import torch

from ._triton import cdiv, interpreting, next_pow2, one_context, require_triton, tl, triton
from .triton_fp8 import bf16_to_f32, e4m3_to_f32

BLOCK_N = 64  # keys per program
NUM_WARPS = 4


@triton.jit
def _score_keys(
    q,
    s_qh,
    w,
    kp,
    kp_f32,
    page,
    off,
    valid,
    s_page,
    s_page_f32,
    n_heads,
    PS: tl.constexpr,
    D: tl.constexpr,
    Q_BF16: tl.constexpr,
    BF16_DOT: tl.constexpr,
    BLOCK_HI: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Σ_h w_h ReLU(q_h · k) for keys at (page, off) [BN]; q / w point at one query's row."""
    h = tl.arange(0, BLOCK_HI)
    d = tl.arange(0, BLOCK_D)
    hm = h < n_heads
    qm = hm[:, None] & (d[None, :] < D)
    if Q_BF16:
        qt = bf16_to_f32(tl.load(q + h[:, None] * s_qh + d[None, :], mask=qm, other=0))
    else:
        qt = tl.load(q + h[:, None] * s_qh + d[None, :], mask=qm, other=0.0)
    wt = tl.load(w + h, mask=hm, other=0.0)
    key_at = page[:, None] * s_page + off[:, None] * D + d[None, :]
    km = valid[:, None] & (d[None, :] < D)
    k = e4m3_to_f32(tl.load(kp + key_at, mask=km, other=0))
    scale = tl.load(kp_f32 + page * s_page_f32 + (PS * D) // 4 + off, mask=valid, other=0.0)
    if BF16_DOT:  # both operands are bf16-exact: a bf16 dot (fp32 accumulation) loses nothing
        s = tl.dot(qt.to(tl.bfloat16), tl.trans(k.to(tl.bfloat16)))  # [heads, keys]
    else:  # fp32 q (or the interpreter's stand-in for the bf16 dot: exact products too)
        s = tl.dot(qt, tl.trans(k), input_precision="tf32x3")
    s = tl.maximum(s, 0.0) * scale[None, :]
    return tl.sum(s * wt[:, None], 0)


@triton.jit
def _paged_logits_kernel(
    q,
    s_qb,
    s_qh,
    w,
    s_wb,
    kp,
    kp_f32,
    s_page,
    s_page_f32,
    block_table,
    s_bt,
    n_table,
    lens,
    out,
    s_ob,
    width,
    n_heads,
    PS: tl.constexpr,
    D: tl.constexpr,
    Q_BF16: tl.constexpr,
    BF16_DOT: tl.constexpr,
    BLOCK_HI: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK_N
    offs = start + tl.arange(0, BLOCK_N)
    n = tl.load(lens + b)
    logits = tl.full([BLOCK_N], float("-inf"), tl.float32)
    if start < n:  # device-side early exit: blocks past the length only write −inf
        valid = (offs < n) & (offs < width) & (offs // PS < n_table)
        page = tl.load(block_table + b * s_bt + offs // PS, mask=valid, other=0).to(tl.int64)
        score = _score_keys(
            q + b * s_qb,
            s_qh,
            w + b * s_wb,
            kp,
            kp_f32,
            page,
            offs % PS,
            valid,
            s_page,
            s_page_f32,
            n_heads,
            PS,
            D,
            Q_BF16,
            BF16_DOT,
            BLOCK_HI,
            BLOCK_D,
        )
        logits = tl.where(valid, score, float("-inf"))
    tl.store(out + b * s_ob + offs, logits, mask=offs < width)


@triton.jit
def _extend_logits_kernel(
    q,
    s_qb,
    s_qh,
    w,
    s_wb,
    kp,
    kp_f32,
    s_page,
    s_page_f32,
    ctx,
    ctx_start,
    ctx_len,
    q_pos,
    width,
    out,
    s_ob,
    n_heads,
    PS: tl.constexpr,
    D: tl.constexpr,
    Q_BF16: tl.constexpr,
    BF16_DOT: tl.constexpr,
    BLOCK_HI: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK_N
    offs = start + tl.arange(0, BLOCK_N)
    my_pos = tl.load(q_pos + e)
    n_ctx = tl.load(ctx_len + e)
    logits = tl.full([BLOCK_N], float("-inf"), tl.float32)
    if start <= my_pos:  # causal early exit
        valid = (offs <= my_pos) & (offs < n_ctx)
        my_ctx = ctx + tl.load(ctx_start + e)  # this query's request's context slots
        slot = tl.load(my_ctx + offs, mask=valid, other=0).to(tl.int64)
        slot = tl.where(valid, slot, 0)
        score = _score_keys(
            q + e * s_qb,
            s_qh,
            w + e * s_wb,
            kp,
            kp_f32,
            slot // PS,
            slot % PS,
            valid,
            s_page,
            s_page_f32,
            n_heads,
            PS,
            D,
            Q_BF16,
            BF16_DOT,
            BLOCK_HI,
            BLOCK_D,
        )
        logits = tl.where(valid, score, float("-inf"))
    tl.store(out + e * s_ob + offs, logits, mask=offs < width)


def _prepare(q: torch.Tensor, w: torch.Tensor, kpages: torch.Tensor, page_size: int):
    """Validate shapes/dtypes (metadata only) and build the dtype views the kernels read."""
    require_triton()
    if q.dim() != 3 or q.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"q must be fp32/bf16 [N, heads, D], got {q.dtype} {tuple(q.shape)}")
    n, heads, dim = q.shape
    if dim > 128:
        raise ValueError(f"index head dim {dim} > 128 needs several scales per key (unsupported)")
    if w.shape != (n, heads):
        raise ValueError(f"w must be [{n}, {heads}], got {tuple(w.shape)}")
    row = page_size * (dim + 4)
    if kpages.dtype != torch.uint8 or kpages.dim() != 2 or kpages.shape[1] != row:
        raise ValueError(
            f"kpages must be uint8 [P, {row}], got {kpages.dtype} {tuple(kpages.shape)}"
        )
    if kpages.stride(1) != 1 or kpages.stride(0) % 4 or (page_size * dim) % 4:
        raise ValueError("kpages rows must be contiguous and 4-byte aligned (fp32 scales)")
    q = q if q.stride(2) == 1 else q.contiguous()
    q_bf16 = q.dtype == torch.bfloat16
    qv = q.view(torch.int16) if q_bf16 else q
    w = w.float()
    w = w if w.stride(1) == 1 else w.contiguous()
    f32 = kpages.view(torch.float32)
    meta = dict(
        PS=page_size, D=dim, Q_BF16=q_bf16,
        BF16_DOT=q_bf16 and not interpreting(_paged_logits_kernel),
        BLOCK_HI=next_pow2(heads, 16), BLOCK_N=BLOCK_N, BLOCK_D=next_pow2(dim, 16),
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return qv, w, f32, meta


def index_logits_paged(
    q: torch.Tensor,
    w: torch.Tensor,
    kpages: torch.Tensor,
    block_table: torch.Tensor,
    lens: torch.Tensor,
    page_size: int,
    width: int,
) -> torch.Tensor:
    """Decode logits `[B, width]` fp32 over each query's pages: `q` `[B, Hi, D]` (fp32/bf16,
    rotated), `w` `[B, Hi]` fp32 head weights, `kpages` the fp8 index-K buffer (uint8
    `[P, ps·(D+4)]`), `block_table` int `[B, max_pages]` page ids in position order,
    `lens` int `[B]` (read on the device). Column s ≥ lens[b] is −inf; every column is written."""
    qv, w, f32, meta = _prepare(q, w, kpages, page_size)
    b = q.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != b or lens.shape != (b,):
        raise ValueError(
            f"block_table must be [{b}, pages] and lens [{b}], got "
            f"{tuple(block_table.shape)} and {tuple(lens.shape)}"
        )
    block_table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    out = torch.empty((b, width), dtype=torch.float32, device=q.device)
    if b == 0 or width == 0:
        return out
    _paged_logits_kernel[(b, cdiv(width, BLOCK_N))](
        qv, qv.stride(0), qv.stride(1), w, w.stride(0), kpages, f32,
        kpages.stride(0), f32.stride(0),
        block_table, block_table.stride(0), block_table.shape[1], lens.contiguous(),
        out, out.stride(0), width, q.shape[1], **meta,
    )  # fmt: skip
    return out


def index_logits_extend(
    q: torch.Tensor,
    w: torch.Tensor,
    kpages: torch.Tensor,
    ctx_slots: torch.Tensor,
    q_pos: torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    """One request's prefill logits `[E, L]` fp32: queries `q` `[E, Hi, D]` at positions
    `q_pos` `[E]` against the keys of its context `ctx_slots` `[L]` (slot = page·ps + off)
    in `kpages`; −inf where the key position > q_pos[e]."""
    if ctx_slots.dim() != 1:
        raise ValueError(f"ctx_slots must be [L], got {tuple(ctx_slots.shape)}")
    length = ctx_slots.shape[0]
    start, lens = one_context(q.shape[0], length, q.device)
    return index_logits_extend_varlen(
        q, w, kpages, ctx_slots, start, lens, length, q_pos, page_size
    )


def index_logits_extend_varlen(
    q: torch.Tensor,
    w: torch.Tensor,
    kpages: torch.Tensor,
    ctx_slots: torch.Tensor,
    ctx_start: torch.Tensor,
    ctx_len: torch.Tensor,
    width: int,
    q_pos: torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    """`index_logits_extend` for the chunks of several requests in one launch, `[E, width]`:
    query e's context is `ctx_slots[ctx_start[e] : ctx_start[e] + ctx_len[e]]` (`width` ≥
    every `ctx_len`); −inf past its own position and past its context."""
    qv, w, f32, meta = _prepare(q, w, kpages, page_size)
    e = q.shape[0]
    if ctx_slots.dim() != 1 or q_pos.shape != (e,):
        raise ValueError(
            f"ctx_slots must be [L] and q_pos [{e}], got "
            f"{tuple(ctx_slots.shape)} and {tuple(q_pos.shape)}"
        )
    if ctx_start.shape != (e,) or ctx_len.shape != (e,):
        raise ValueError(
            f"ctx_start and ctx_len must be [{e}], got "
            f"{tuple(ctx_start.shape)} and {tuple(ctx_len.shape)}"
        )
    out = torch.empty((e, width), dtype=torch.float32, device=q.device)
    if e == 0 or width == 0:
        return out
    _extend_logits_kernel[(e, cdiv(width, BLOCK_N))](
        qv, qv.stride(0), qv.stride(1), w, w.stride(0), kpages, f32,
        kpages.stride(0), f32.stride(0),
        ctx_slots.contiguous(), ctx_start.contiguous(), ctx_len.contiguous(),
        q_pos.contiguous(), width, out, out.stride(0), q.shape[1],
        **meta,
    )  # fmt: skip
    return out


def block_table_from_slots(req_slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """int32 `[B, W/ps]` page ids from a page-aligned slot table `[B, W]` (requests own
    whole pages, so every ps-th slot starts a page); −1 padding gives −1, never read
    (the kernel masks columns ≥ lens)."""
    return (req_slots[:, ::page_size] // page_size).to(torch.int32)


__all__ = [
    "block_table_from_slots",
    "index_logits_extend",
    "index_logits_extend_varlen",
    "index_logits_paged",
]
