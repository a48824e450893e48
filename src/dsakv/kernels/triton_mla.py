"""Sparse MLA attention over dsakv's latent rows (absorbed form), split-K in two stages.

Math (what `torch_ops.MLAMath.decode` / `_absorbed` compute in torch): each query head is
already in latent space, q = [q_nope·W_uk ‖ q_rope] (kv_lora + rope values); each selected
cache row is [latent ‖ k_rope]; out = softmax(q·row · sm_scale over valid rows) @ latent.
The caller applies W_uv afterwards.

Cache rows are read in the pool's own byte layout (`dsakv.memory.pool`), one row per slot:

- `"fp8_ds_mla"` (`_DsMlaLatent`): uint8 `[S, W]`, W = kv_lora e4m3 bytes ‖ fp32 scale per
  128 nope values ‖ bf16 rope (656 B for 512 + 64).
- `"fp8_e4m3"` (`_TokenMajor`): `[S, kv_lora + rope]` plain e4m3 (unit scale), as float8 or
  its uint8 view.
- `"bf16"` / `"fp32"` (`_TokenMajor`): `[S, kv_lora + rope]` as stored.

Stage 1 gives every (query, split, head block) program a contiguous chunk of the selected
rows; it scores BLOCK_H heads × BLOCK_N rows with `tl.dot` and keeps an online-softmax
(max, sum, acc) in fp32. Stage 2 merges the splits. Rows are located on the device
(slots, or positions mapped through the request's slots), −1 / out-of-range / future rows
are masked, and the grid, the split boundaries and the merge order depend on tensor
shapes only: no host syncs, CUDA-graph safe, deterministic.

Precision follows the query dtype and the row kind (`_launch_config`), not the device:

- bf16 q over bf16 / fp8_e4m3 / fp8_ds_mla rows (what the CUDA model runs): rows are
  decoded to bf16 in registers, exactly (e4m3 has 4 significant bits and bf16's exponent
  range covers e4m3 times any power-of-two block scale down to 2^-124, i.e. block amax ≥
  ~2^-116; below that a value rounds by < 2^-133, or flushes, absolutely). QK is a
  bf16 × bf16 dot with fp32 accumulation, so every product is exact; P is rounded to
  bf16 for PV (the kernel's one rounding: ≤ 2^-8 relative per weight) and l sums the
  rounded weights. Up to 64 heads share a program (wgmma on sm_90, each row read once
  per 64 heads; 128 heads take two head blocks).
- fp32 q or fp32 rows: IEEE fp32 dots, 16 heads per program.

The interpreter has no bf16 dot: there the bf16 path holds the same bf16 values in fp32
and rounds P to bf16 by bits, so interpreter tests see the GPU's numerics.
"""

import math

import torch

from dsakv.memory.layout import latent_bytes

from ._triton import cdiv, interpreting, next_pow2, one_context, require_triton, tl, triton
from .triton_fp8 import bf16_to_f32, e4m3_to_f32, f32_to_bf16_bits

LATENT_KINDS = ("fp32", "bf16", "fp8_e4m3", "fp8_ds_mla")
_KIND_ID = {k: i for i, k in enumerate(LATENT_KINDS)}
_MODE_SLOTS, _MODE_TOPK_POS, _MODE_DENSE = 0, 1, 2

# Dot operand modes (constexpr DOT of the stage-1 kernel):
_DOT_F32 = 0  # fp32 operands, IEEE fp32 dots (FMA): fp32 q or fp32 rows
_DOT_BF16 = 1  # bf16 operands (wgmma on sm_90), fp32 accumulation: bf16 q, bf16-exact rows
_DOT_BF16_EMU = 2  # the same values held in fp32 (the interpreter has no bf16 dot)

# Launch shape (GPU tuning knobs; the interpreter ignores warps/stages). Measured with an
# sm_90a compile (Triton 3.6 and 3.9, ptxas -v): see `_launch_config`.
MAX_BLOCK_H = 64  # heads per program on the bf16 path: acc [64, 512] fp32 = 128 regs/thread
MAX_BLOCK_H_F32 = 16  # heads per program on the fp32 path (FMA dots in registers)
BLOCK_N = 32  # cache rows per step on the bf16 path (64: fp8 rows spill on Triton 3.6)
BLOCK_N_F32 = 16
NUM_WARPS = 8  # two warpgroups: wgmma splits QK's rows and PV's 512 columns between them
# No software pipelining: with it Triton 3.6 crashes on the bf16-row kernel (the `if` that
# hides S from the layout heuristic) and the fp8 decode gains nothing from it.
NUM_STAGES = 1
_TARGET_PROGRAMS = 256  # stage-1 programs the default split count aims for
_MIN_BLOCKS_PER_SPLIT = 2  # row blocks each split covers at least


@triton.jit
def _load_latent_rows(
    kv,
    kv_f32,
    kv_i16,
    row,
    valid,
    s_row,
    s_row_f32,
    s_row_i16,
    KV_LORA: tl.constexpr,
    ROPE: tl.constexpr,
    KIND: tl.constexpr,
    TO_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DR: tl.constexpr,
):
    """Decode rows `row` (int64 [BN], masked by `valid`) to (nope [BN, DV], rope [BN, DR]):
    fp32, or bf16 when TO_BF16 (exact for every kind but fp32, see the module doc)."""
    d = tl.arange(0, BLOCK_DV)
    dr = tl.arange(0, BLOCK_DR)
    mn = valid[:, None] & (d[None, :] < KV_LORA)
    mr = valid[:, None] & (dr[None, :] < ROPE)
    if KIND == 3:  # fp8_ds_mla: e4m3 nope, fp32 scale per 128, bf16 rope
        nope = e4m3_to_f32(tl.load(kv + row[:, None] * s_row + d[None, :], mask=mn, other=0))
        # One fp32 scale per 128 values: NB small loads and a select, not a [BN, DV] gather
        # (the gather's addresses alone cost more registers than the whole decode).
        scale_row = kv_f32 + row * s_row_f32 + KV_LORA // 4
        blk = d[None, :] // 128
        scale = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
        for j in tl.static_range((KV_LORA + 127) // 128):
            s_j = tl.load(scale_row + j, mask=valid, other=0.0)
            scale = tl.where(blk == j, s_j[:, None], scale)
        nope = nope * scale
        rope_at = row[:, None] * s_row_i16 + (KV_LORA + 4 * ((KV_LORA + 127) // 128)) // 2
        rope = tl.load(kv_i16 + rope_at + dr[None, :], mask=mr, other=0)
        if TO_BF16:
            nope = nope.to(tl.bfloat16)
            rope = rope.to(tl.bfloat16, bitcast=True)
        else:
            rope = bf16_to_f32(rope)
    elif KIND == 1:  # bf16
        nope = tl.load(kv + row[:, None] * s_row + d[None, :], mask=mn, other=0.0)
        rope = tl.load(kv + row[:, None] * s_row + KV_LORA + dr[None, :], mask=mr, other=0.0)
        if not TO_BF16:
            nope = bf16_to_f32(nope.to(tl.int16, bitcast=True))
            rope = bf16_to_f32(rope.to(tl.int16, bitcast=True))
    elif KIND == 2:  # plain e4m3 bytes
        nope = e4m3_to_f32(tl.load(kv + row[:, None] * s_row + d[None, :], mask=mn, other=0))
        rope_p = kv + row[:, None] * s_row + KV_LORA + dr[None, :]
        rope = e4m3_to_f32(tl.load(rope_p, mask=mr, other=0))
        if TO_BF16:
            nope = nope.to(tl.bfloat16)
            rope = rope.to(tl.bfloat16)
    else:  # fp32 (never TO_BF16: fp32 rows are not exact in bf16)
        nope = tl.load(kv + row[:, None] * s_row + d[None, :], mask=mn, other=0.0)
        rope = tl.load(kv + row[:, None] * s_row + KV_LORA + dr[None, :], mask=mr, other=0.0)
    return nope, rope


@triton.jit
def _mla_partial_kernel(
    q,
    s_qb,
    s_qh,
    kv,
    kv_f32,
    kv_i16,
    s_row,
    s_row_f32,
    s_row_i16,
    idx,
    s_idx,
    ctx,
    ctx_start,
    ctx_len,
    qpos,
    n_idx,
    chunk,
    acc_out,
    ml_out,
    H,
    qk_scale,
    KV_LORA: tl.constexpr,
    ROPE: tl.constexpr,
    KIND: tl.constexpr,
    MODE: tl.constexpr,
    Q_BF16: tl.constexpr,
    DOT: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DR: tl.constexpr,
):
    """One (query b, split s, head block) program: online softmax over rows [start, end)."""
    b = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, BLOCK_DV)
    dr = tl.arange(0, BLOCK_DR)

    q_row = q + b.to(tl.int64) * s_qb + heads[:, None] * s_qh
    qm = hmask[:, None] & (d[None, :] < KV_LORA)
    qrm = hmask[:, None] & (dr[None, :] < ROPE)
    if DOT == 1:  # bf16 straight into the dot: a plain load lets wgmma read q from smem
        q_nope = tl.load(q_row + d[None, :], mask=qm, other=0.0)
        q_rope = tl.load(q_row + KV_LORA + dr[None, :], mask=qrm, other=0.0)
    elif Q_BF16:  # decoded by bits (the interpreter has no bf16 arithmetic)
        q_nope = tl.load(q_row + d[None, :], mask=qm, other=0.0).to(tl.int16, bitcast=True)
        q_rope = tl.load(q_row + KV_LORA + dr[None, :], mask=qrm, other=0.0)
        q_nope = bf16_to_f32(q_nope)
        q_rope = bf16_to_f32(q_rope.to(tl.int16, bitcast=True))
    else:
        q_nope = tl.load(q_row + d[None, :], mask=qm, other=0.0)
        q_rope = tl.load(q_row + KV_LORA + dr[None, :], mask=qrm, other=0.0)

    start = split * chunk
    end = tl.minimum(start + chunk, n_idx)
    if MODE != 0:  # positions into the query's own request's context slots
        my_pos = tl.load(qpos + b).to(tl.int32)
        my_ctx = ctx + tl.load(ctx_start + b)
        n_ctx = tl.load(ctx_len + b)
        if MODE == 2:  # dense causal: nothing past this query's own position
            end = tl.minimum(end, my_pos + 1)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        inb = offs < end
        if MODE == 0:  # physical slots, −1 = invalid
            slot = tl.load(idx + b.to(tl.int64) * s_idx + offs, mask=inb, other=-1)
            valid = slot >= 0
        else:
            if MODE == 1:  # selected positions into the request's context
                pos = tl.load(idx + b.to(tl.int64) * s_idx + offs, mask=inb, other=-1)
            else:
                pos = offs
            valid = inb & (pos >= 0) & (pos <= my_pos) & (pos < n_ctx)
            slot = tl.load(my_ctx + tl.where(valid, pos, 0), mask=valid, other=0)
        row = tl.where(valid, slot, 0).to(tl.int64)
        nope, rope = _load_latent_rows(
            kv,
            kv_f32,
            kv_i16,
            row,
            valid,
            s_row,
            s_row_f32,
            s_row_i16,
            KV_LORA,
            ROPE,
            KIND,
            DOT == 1,
            BLOCK_N,
            BLOCK_DV,
            BLOCK_DR,
        )
        # Two independent dots (not acc-chained) and everything derived from them inside
        # the `if` below: Triton's MMA layout heuristic gives a dot whose result reaches
        # another dot all warps along M ([8, 1]); with 64 heads that is both warpgroups
        # computing the same S, twice the QK work and twice the smem descriptors (the
        # cause of the spills). Out of sight of the PV dot, QK splits N over the two
        # warpgroups ([4, 2]). `n0 < end` always holds here; the compiler cannot fold it.
        s_nope = tl.dot(q_nope, tl.trans(nope), input_precision=PREC)
        s_rope = tl.dot(q_rope, tl.trans(rope), input_precision=PREC)
        if DOT == 1:
            p_op = tl.zeros([BLOCK_H, BLOCK_N], tl.bfloat16)
        else:
            p_op = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
        alpha = tl.full([BLOCK_H], 1.0, tl.float32)  # were the `if` skipped: a no-op block
        m_new = m_i
        l_new = l_i
        if n0 < end:
            s = tl.where(valid[None, :], s_nope * qk_scale + s_rope * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far: no NaN
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            # P feeds the PV dot in the operand dtype: on the bf16 paths it is rounded to
            # bf16 (the one rounding of the kernel) and l sums the rounded weights, so the
            # output stays a convex combination of the rows.
            if DOT == 1:
                p_op = p.to(tl.bfloat16)
                l_new = l_i * alpha + tl.sum(p_op.to(tl.float32), 1)
            elif DOT == 2:
                p_op = bf16_to_f32(f32_to_bf16_bits(p))
                l_new = l_i * alpha + tl.sum(p_op, 1)
            else:
                p_op = p
                l_new = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p_op, nope, acc=acc * alpha[:, None], input_precision=PREC)
        m_i = m_new
        l_i = l_new

    base = (b.to(tl.int64) * n_splits + split) * H + heads
    tl.store(acc_out + base[:, None] * BLOCK_DV + d[None, :], acc, mask=hmask[:, None])
    tl.store(ml_out + base * 2, m_i, mask=hmask)
    tl.store(ml_out + base * 2 + 1, l_i, mask=hmask)


@triton.jit
def _mla_combine_kernel(
    acc_in,
    ml_in,
    out,
    H,
    n_splits,
    KV_LORA: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Merge the splits of one (query, head): Σ 2^(m_s − M) acc_s / Σ 2^(m_s − M) l_s."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    base = (b * n_splits + s) * H + h
    m = tl.load(ml_in + base * 2, mask=s < n_splits, other=float("-inf"))
    lsum = tl.load(ml_in + base * 2 + 1, mask=s < n_splits, other=0.0)
    m_max = tl.max(m, 0)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    denom = tl.sum(tl.exp2(m - m_use) * lsum, 0)
    d = tl.arange(0, BLOCK_DV)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for i in range(0, n_splits):
        at = (b * n_splits + i) * H + h
        w = tl.exp2(tl.load(ml_in + at * 2) - m_use)
        acc += w * tl.load(acc_in + at * BLOCK_DV + d)
    res = tl.where(denom > 0.0, acc / tl.where(denom > 0.0, denom, 1.0), 0.0)
    tl.store(out + (b * H + h) * KV_LORA + d, res, mask=d < KV_LORA)


# --- wrappers -----------------------------------------------------------------------------------


def _cache_views(cache: torch.Tensor, kind: str, kv_lora: int, rope_dim: int):
    """(main, fp32 view, int16 view, their row strides) of one layer's latent buffer."""
    if kind not in _KIND_ID:
        raise ValueError(f"unknown latent kind {kind!r} (choose from {', '.join(LATENT_KINDS)})")
    if cache.dim() != 2 or cache.stride(1) != 1:
        raise ValueError(
            f"latent cache must be a row-major [S, W] tensor, got {tuple(cache.shape)}"
        )
    width = cache.shape[1]
    if kind == "fp8_ds_mla":
        want = latent_bytes("fp8_ds_mla", kv_lora, rope_dim)
        if cache.dtype != torch.uint8 or width != want:
            raise ValueError(
                f"fp8_ds_mla cache must be uint8 [S, {want}], got {cache.dtype} {width}"
            )
        if width % 4 or kv_lora % 4 or cache.stride(0) % 4:
            raise ValueError("fp8_ds_mla rows must be 4-byte aligned to read the fp32 scales")
        f32, i16 = cache.view(torch.float32), cache.view(torch.int16)
        return cache, f32, i16, cache.stride(0), f32.stride(0), i16.stride(0)
    if width != kv_lora + rope_dim:
        raise ValueError(f"{kind} cache must be [S, {kv_lora + rope_dim}], got width {width}")
    want_dtype = {
        "fp32": (torch.float32,),
        "bf16": (torch.bfloat16,),
        "fp8_e4m3": (torch.float8_e4m3fn, torch.uint8),
    }[kind]
    if cache.dtype not in want_dtype:
        raise ValueError(f"{kind} cache has dtype {cache.dtype}")
    main = cache if kind in ("fp32", "bf16") else cache.view(torch.uint8)
    return main, main, main, main.stride(0), main.stride(0), main.stride(0)


def _query_view(q: torch.Tensor, dim: int) -> tuple[torch.Tensor, bool]:
    if q.dim() != 3 or q.shape[2] != dim:
        raise ValueError(f"q must be [B, H, {dim}], got {tuple(q.shape)}")
    if q.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"q must be float32 or bfloat16, got {q.dtype}")
    if q.stride(2) != 1:
        q = q.contiguous()
    return q, q.dtype == torch.bfloat16


def default_num_splits(n_rows: int, n_programs: int, block_n: int = BLOCK_N) -> int:
    """Splits per query from shapes only: ~_TARGET_PROGRAMS stage-1 programs (n_programs =
    queries × head blocks), ≥ _MIN_BLOCKS_PER_SPLIT row blocks of `block_n` each, at most 64."""
    by_rows = max(1, cdiv(n_rows, _MIN_BLOCKS_PER_SPLIT * block_n))
    return max(1, min(cdiv(_TARGET_PROGRAMS, max(n_programs, 1)), by_rows, 64))


def _launch_config(
    kind: str, q_bf16: bool, heads: int, kv_lora: int, rope_dim: int, interpret: bool = False
) -> tuple[dict, dict]:
    """(stage-1 constexprs but MODE, launch options) for one specialisation; shapes only.

    bf16 q over bf16-exact rows (bf16, e4m3, fp8_ds_mla) takes the bf16 dot: QK products
    are exact and accumulate in fp32, P is rounded to bf16 for PV (the one rounding), and
    up to MAX_BLOCK_H heads share a program, so each row is read once per 64 heads. fp32
    q or fp32 rows take IEEE fp32 dots (FMA, no rounding beyond fp32's), 16 heads each.
    """
    if q_bf16 and kind != "fp32":
        dot = _DOT_BF16_EMU if interpret else _DOT_BF16
        block_h, block_n = min(next_pow2(heads, 16), MAX_BLOCK_H), BLOCK_N
    else:
        dot = _DOT_F32
        block_h, block_n = min(next_pow2(heads, 16), MAX_BLOCK_H_F32), BLOCK_N_F32
    const = dict(
        KV_LORA=kv_lora, ROPE=rope_dim, KIND=_KIND_ID[kind], Q_BF16=q_bf16, DOT=dot,
        PREC="ieee", BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_DV=next_pow2(kv_lora, 16),
        BLOCK_DR=next_pow2(rope_dim, 16),
    )  # fmt: skip
    return const, dict(num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def _attend(
    q: torch.Tensor,
    cache: torch.Tensor,
    kind: str,
    mode: int,
    idx: torch.Tensor,
    ctx: torch.Tensor,
    ctx_start: torch.Tensor,
    ctx_len: torch.Tensor,
    qpos: torch.Tensor,
    n_idx: int,
    sm_scale: float,
    kv_lora: int,
    rope_dim: int,
    num_splits: int | None,
) -> torch.Tensor:
    require_triton()
    qv, q_bf16 = _query_view(q, kv_lora + rope_dim)
    main, f32, i16, s_row, s_f32, s_i16 = _cache_views(cache, kind, kv_lora, rope_dim)
    nq, heads = q.shape[0], q.shape[1]
    out = torch.zeros((nq, heads, kv_lora), dtype=torch.float32, device=q.device)
    if nq == 0 or heads == 0:
        return out
    const, opts = _launch_config(
        kind, q_bf16, heads, kv_lora, rope_dim, interpreting(_mla_partial_kernel)
    )
    block_n, block_dv = const["BLOCK_N"], const["BLOCK_DV"]
    hblocks = cdiv(heads, const["BLOCK_H"])
    splits = num_splits or default_num_splits(n_idx, nq * hblocks, block_n)
    if splits < 1:
        raise ValueError(f"num_splits must be ≥ 1, got {splits}")
    chunk = cdiv(cdiv(max(n_idx, 1), splits), block_n) * block_n
    acc = torch.empty((nq, splits, heads, block_dv), dtype=torch.float32, device=q.device)
    ml = torch.empty((nq, splits, heads, 2), dtype=torch.float32, device=q.device)
    _mla_partial_kernel[(nq, splits, hblocks)](
        qv, qv.stride(0), qv.stride(1),
        main, f32, i16, s_row, s_f32, s_i16,
        idx, idx.stride(0) if idx.dim() == 2 else 0, ctx, ctx_start, ctx_len, qpos,
        n_idx, chunk,
        acc, ml,
        heads, float(sm_scale) * math.log2(math.e),
        MODE=mode, **const, **opts,
    )  # fmt: skip
    _mla_combine_kernel[(nq, heads)](
        acc, ml, out, heads, splits,
        KV_LORA=kv_lora, BLOCK_DV=block_dv, BLOCK_S=next_pow2(splits, 2),
    )  # fmt: skip
    return out


def sparse_mla_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    kind: str,
    slots: torch.Tensor,
    sm_scale: float,
    kv_lora: int,
    rope_dim: int,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention of `q` `[B, H, kv_lora+rope]` (fp32/bf16, latent space) over the
    physical rows `slots` `[B, K]` (int32/int64, −1 = skip) of one layer's latent `cache`
    (layout named by `kind`, see module doc). Returns fp32 `[B, H, kv_lora]`; a query with
    no valid slot gets zeros. `num_splits` (default: from shapes) splits K per query."""
    if slots.dim() != 2 or slots.shape[0] != q.shape[0]:
        raise ValueError(f"slots must be [B, K] with B = {q.shape[0]}, got {tuple(slots.shape)}")
    if slots.stride(1) != 1:
        slots = slots.contiguous()
    return _attend(
        q, cache, kind, _MODE_SLOTS, slots, slots, slots, slots, slots, slots.shape[1],
        sm_scale, kv_lora, rope_dim, num_splits,
    )  # fmt: skip


def sparse_mla_extend(
    q: torch.Tensor,
    cache: torch.Tensor,
    kind: str,
    ctx_slots: torch.Tensor,
    q_pos: torch.Tensor,
    topk_pos: torch.Tensor | None,
    sm_scale: float,
    kv_lora: int,
    rope_dim: int,
) -> torch.Tensor:
    """One request's queries `q` `[E, H, kv_lora+rope]` at positions `q_pos` `[E]` against
    its own context: `ctx_slots` `[L]` are the slots of positions 0..L−1 in the latent
    `cache` (layout `kind`). `topk_pos` `[E, K]` lists positions to attend (−1 invalid;
    positions > q_pos[e] are masked too); `None` means dense causal (0..q_pos[e]).
    Returns fp32 `[E, H, kv_lora]`."""
    if ctx_slots.dim() != 1:
        raise ValueError(f"ctx_slots must be [L], got {tuple(ctx_slots.shape)}")
    length = ctx_slots.shape[0]
    start, lens = one_context(q.shape[0], length, q.device)
    return sparse_mla_extend_varlen(
        q, cache, kind, ctx_slots, start, lens, length, q_pos, topk_pos, sm_scale, kv_lora, rope_dim
    )


def sparse_mla_extend_varlen(
    q: torch.Tensor,
    cache: torch.Tensor,
    kind: str,
    ctx_slots: torch.Tensor,
    ctx_start: torch.Tensor,
    ctx_len: torch.Tensor,
    max_len: int,
    q_pos: torch.Tensor,
    topk_pos: torch.Tensor | None,
    sm_scale: float,
    kv_lora: int,
    rope_dim: int,
) -> torch.Tensor:
    """`sparse_mla_extend` for the chunks of several requests in one launch: `ctx_slots`
    holds their contexts one after another, and query e's context is
    `ctx_slots[ctx_start[e] : ctx_start[e] + ctx_len[e]]` (`max_len` ≥ every `ctx_len`,
    from the host: the scan bound of dense causal queries, read without a sync)."""
    e = q.shape[0]
    if ctx_slots.dim() != 1 or q_pos.shape != (e,):
        raise ValueError(
            f"ctx_slots must be [L] and q_pos [E={e}], got "
            f"{tuple(ctx_slots.shape)} and {tuple(q_pos.shape)}"
        )
    if ctx_start.shape != (e,) or ctx_len.shape != (e,):
        raise ValueError(
            f"ctx_start and ctx_len must be [E={e}], got "
            f"{tuple(ctx_start.shape)} and {tuple(ctx_len.shape)}"
        )
    ctx_slots, q_pos = ctx_slots.contiguous(), q_pos.contiguous()
    ctx_start, ctx_len = ctx_start.contiguous(), ctx_len.contiguous()
    ctx = (ctx_slots, ctx_start, ctx_len, q_pos)
    if topk_pos is None:
        return _attend(
            q, cache, kind, _MODE_DENSE, ctx_slots, *ctx, max_len,
            sm_scale, kv_lora, rope_dim, None,
        )  # fmt: skip
    if topk_pos.dim() != 2 or topk_pos.shape[0] != e:
        raise ValueError(f"topk_pos must be [E, K], got {tuple(topk_pos.shape)}")
    topk_pos = topk_pos.contiguous()
    return _attend(
        q, cache, kind, _MODE_TOPK_POS, topk_pos, *ctx, topk_pos.shape[1],
        sm_scale, kv_lora, rope_dim, None,
    )  # fmt: skip


__all__ = [
    "LATENT_KINDS",
    "default_num_splits",
    "sparse_mla_decode",
    "sparse_mla_extend",
    "sparse_mla_extend_varlen",
]
