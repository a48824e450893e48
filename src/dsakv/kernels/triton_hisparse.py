"""HiSparse hot-buffer ops as Triton kernels, equal to `dsakv.kernels.hisparse_ops` (the torch
reference: rules, state layout and limits are described there) output for output and state
for state, ties included. Fixed shapes, no host reads: both launches can be captured.

`resolve`: one program per request row, the reference's sort + searchsorted plan in
registers plus a per-row global scratch (`resolve_scratch_size` int64 words): sorts are
`tl.sort` bitonic sorts of packed int64 keys, searches are branchless binary searches over
the sorted scratch, and `tl.debug_barrier` separates the phases that hand data from lane to
lane. Four phases, each reloading what it needs so that little stays live across the sorts:

1. sort the buffer's positions as `pos·2^LOG_BS | entry` (empty −1, pad lanes a sentinel)
   and the top-k candidates as `pos·2^LOG_BK | column` (padding and the newest: a sentinel
   past every position) into the scratch;
2. each entry searches the candidate keys (is it hit?); sort `stamp·2^LOG_BS | entry` with
   hits and pad lanes keyed past every stamp: the j-th key is the j-th evictable entry;
   hit entries get stamp 2·step+1;
3. each column searches the buffer keys (its hit entry; the lowest entry index on equal
   positions) and the candidate keys (its leader: the first column of its position); misses
   are ranked by `tl.cumsum` at their first column, and the j-th miss's column is recorded;
4. columns gather their miss's evicted entry; the copy list and the evicted entries'
   position / stamp are masked stores (evicted and hit entries are disjoint, and distinct
   misses take distinct entries, so no address is written twice).

Compiles for sm_90 with Triton 3.6 and 3.9 (S 4096 / K 2048: 16 warps, ≤ 128 registers,
16-32 KB shared memory for the sorts; its first compile takes ~2-3 minutes on a CPU core).
Under speculative decoding a row is a verify's union (K = (1 + drafts) × top_k): GLM-5.2's
MTP default, S 10,240 / K 8,192, compiled with Triton 3.9 at 128 registers and 3.4 KB a
thread spilled (32 KB shared; ~6 minutes on a busy core, so not in the compile check).

Its copy list goes to `triton_rows.copy_rows`, the row copy every store of plain rows uses.
"""

from __future__ import annotations

import torch

from . import hisparse_ops as _ref
from ._triton import next_pow2, require_triton, tl, triton

_NO_POS = _ref._NO_POS  # top-k sentinel (> every position) and the pad-entry position
_HIT_STAMP = 1 << 46  # eviction key of a hit / pad entry: past every stamp (|stamp| < 2^45)


def _resolve_warps(block_s: int) -> int:
    return 4 if block_s <= 512 else 8 if block_s <= 2048 else 16


@triton.jit
def _lower_bound(arr, target, N: tl.constexpr, LOG_N: tl.constexpr):
    """min(#elements < target, N−1) per lane over the sorted int64 arr[0:N] (N = 2^LOG_N):
    the index of the first element ≥ target when there is one."""
    at = tl.zeros(target.shape, tl.int32)
    for i in tl.static_range(LOG_N):
        half = N >> (i + 1)
        v = tl.load(arr + at + (half - 1))
        at = tl.where(v < target, at + half, at)
    return at


@triton.jit
def _buffer_keys(row_pos, em, NO_POS: tl.constexpr):
    """Each entry's position as a sort key: empty −1, pad lanes (past S) NO_POS."""
    bp = tl.load(row_pos + tl.arange(0, em.shape[0]), mask=em, other=-1).to(tl.int64)
    return tl.where(em, tl.where(bp >= 0, bp, -1), NO_POS)


@triton.jit
def _topk_keys(row_topk, cm, nw):
    """(positions, looked up in the buffer?, the newest?) per top-k column."""
    pos = tl.load(row_topk + tl.arange(0, cm.shape[0]), mask=cm, other=-1).to(tl.int64)
    valid = pos >= 0
    return pos, valid & (pos != nw), valid & (pos == nw)


@triton.jit
def _resolve_kernel(
    topk,
    s_topk,
    newest,
    reserved,
    buf_pos,
    s_pos,
    stamp,
    s_stamp,
    buf_slot,
    s_slot,
    step,
    slots,
    s_out,
    miss_pos,
    s_mpos,
    miss_slot,
    s_mslot,
    scratch,
    s_scratch,
    S,
    K,
    BS: tl.constexpr,
    LOG_BS: tl.constexpr,
    BK: tl.constexpr,
    LOG_BK: tl.constexpr,
    NO_POS: tl.constexpr,
    HIT_STAMP: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BK)
    e = tl.arange(0, BS)
    c64 = c.to(tl.int64)
    e64 = e.to(tl.int64)
    cm = c < K
    em = e < S
    scr = scratch + r * s_scratch
    sb = scr  # [BS] sorted buffer keys
    sc = scr + BS  # [BK] sorted candidate keys
    rk = sc + BK  # [BK] miss rank at each column
    mc = rk + BK  # [BK] column of the j-th miss
    eo = mc + BK  # [BS] entry of the j-th eviction

    nw = tl.load(newest + r).to(tl.int64)
    row_topk = topk + r * s_topk
    row_pos = buf_pos + r * s_pos
    row_stamp = stamp + r * s_stamp
    row_slot = buf_slot + r * s_slot
    lo_stamp = 2 * tl.load(step).to(tl.int64)

    # Phase 1: sorted buffer keys and sorted candidate keys. Values that later phases need
    # are reloaded there, not kept live across the register-heavy sorts.
    bkey = _buffer_keys(row_pos, em, NO_POS)
    tl.store(sb + e, tl.sort((bkey << LOG_BS) | e64))
    pos, cand, _ = _topk_keys(row_topk, cm, nw)
    tl.store(sc + c, tl.sort((tl.where(cand, pos, NO_POS) << LOG_BK) | c64))
    tl.debug_barrier()

    # Phase 2: hit entries (their position is a candidate), then the eviction order:
    # (stamp, entry) ascending, hits and pad entries last.
    bkey = _buffer_keys(row_pos, em, NO_POS)
    w = tl.load(sc + _lower_bound(sc, bkey << LOG_BK, BK, LOG_BK))
    hit = em & (bkey >= 0) & ((w >> LOG_BK) == bkey)
    st = tl.load(row_stamp + e, mask=em, other=0)
    ekey = tl.where(hit | (em == 0), HIT_STAMP, st)
    tl.store(eo + e, tl.sort((ekey << LOG_BS) | e64) & (BS - 1))
    tl.debug_barrier()
    # every stamp is read: hits go to the MRU end
    tl.store(row_stamp + e, tl.zeros([BS], tl.int64) + (lo_stamp + 1), mask=hit)

    # Phase 3: per column, its hit entry and its leader (first column of its position);
    # misses are ranked at their first column.
    pos, cand, is_new = _topk_keys(row_topk, cm, nw)
    v = tl.load(sb + _lower_bound(sb, pos << LOG_BS, BS, LOG_BS))
    found = cand & ((v >> LOG_BS) == pos)
    hit_entry = v & (BS - 1)
    ckey = tl.where(cand, pos, NO_POS)
    leader = tl.load(sc + _lower_bound(sc, ckey << LOG_BK, BK, LOG_BK)) & (BK - 1)
    miss = cand & (found == 0)
    first = miss & (leader == c64)
    rank = tl.cumsum(first.to(tl.int32), 0) - 1
    n_miss = tl.sum(first.to(tl.int32), 0)
    tl.store(rk + c, rank)
    tl.store(mc + tl.maximum(rank, 0), c, mask=first)
    tl.debug_barrier()

    # Phase 4: slots per column; the copy list (the j-th miss at j) and the evicted state.
    mrank = tl.minimum(tl.maximum(tl.load(rk + leader), 0), BS - 1)
    take = tl.load(eo + mrank)
    slot_hit = tl.load(row_slot + hit_entry, mask=found, other=-1).to(tl.int64)
    slot_miss = tl.load(row_slot + take, mask=miss, other=-1).to(tl.int64)
    rs = tl.load(reserved + r).to(tl.int64)
    out = tl.where(found, slot_hit, tl.where(miss, slot_miss, tl.where(is_new, rs, -1)))
    tl.store(slots + r * s_out + c, out, mask=cm)
    live = c < n_miss
    j_col = tl.load(mc + c, mask=live, other=0)
    j_pos = tl.load(row_topk + j_col, mask=live, other=-1).to(tl.int64)
    j_ent = tl.load(eo + c, mask=live, other=0)
    j_slot = tl.load(row_slot + j_ent, mask=live, other=-1).to(tl.int64)
    tl.store(miss_pos + r * s_mpos + c, tl.where(live, j_pos, -1), mask=cm)
    tl.store(miss_slot + r * s_mslot + c, tl.where(live, j_slot, -1), mask=cm)
    tl.store(row_pos + j_ent, j_pos, mask=live)
    tl.store(row_stamp + j_ent, tl.zeros([BK], tl.int64) + lo_stamp, mask=live)


def resolve_scratch_size(buffer_size: int, top_k: int) -> int:
    """int64 words of scratch one row of `resolve` needs."""
    bs, bk = next_pow2(buffer_size), next_pow2(top_k)
    return 2 * bs + 3 * bk


def resolve(
    topk: torch.Tensor,
    newest: torch.Tensor,
    reserved_slot: torch.Tensor,
    buf_pos: torch.Tensor,
    stamp: torch.Tensor,
    buf_slot: torch.Tensor,
    step: int | torch.Tensor,
    scratch: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `hisparse_ops.resolve` (same arguments, results and in-place state update).

    `step`: a 0-d int tensor on the device (graph-safe: the kernel reads it) or an int (put
    in a fresh device tensor by a fill, no copy). `scratch`: int64 `[B, resolve_scratch_size]`
    (allocated when None); `out`: preallocated `(slots, miss_pos, miss_slot)` `[B, K]`.
    State tensors need unit stride along S and topk along K."""
    require_triton()
    b, s, k = _ref._check_resolve(topk, newest, reserved_slot, buf_pos, stamp, buf_slot)
    dev = topk.device
    for name, t in (("topk", topk), ("buf_pos", buf_pos), ("stamp", stamp),
                    ("buf_slot", buf_slot)):  # fmt: skip
        if t.stride(1) != 1:
            raise ValueError(f"{name} must have unit stride along its last dim")
    if not isinstance(step, torch.Tensor):
        step = torch.full((), int(step), dtype=torch.int64, device=dev)
    elif step.numel() != 1:
        raise ValueError("step must be an int or a 0-d tensor")
    bs, bk = next_pow2(s), next_pow2(k)
    if scratch is None:
        scratch = torch.empty(b, resolve_scratch_size(s, k), dtype=torch.int64, device=dev)
    elif (scratch.dtype != torch.int64 or scratch.dim() != 2 or scratch.shape[0] < b
          or scratch.shape[1] < resolve_scratch_size(s, k) or scratch.stride(1) != 1):  # fmt: skip
        raise ValueError(f"scratch must be int64 [≥{b}, ≥{resolve_scratch_size(s, k)}]")
    if out is None:
        slots = torch.empty(b, k, dtype=buf_slot.dtype, device=dev)
        miss_pos = torch.empty(b, k, dtype=topk.dtype, device=dev)
        miss_slot = torch.empty(b, k, dtype=buf_slot.dtype, device=dev)
    else:
        slots, miss_pos, miss_slot = out
        for t in out:
            if t.shape != (b, k) or t.stride(1) != 1:
                raise ValueError(f"out tensors must be [{b}, {k}] with unit last stride")
    if b:
        _resolve_kernel[(b,)](
            topk, topk.stride(0), newest, reserved_slot, buf_pos, buf_pos.stride(0),
            stamp, stamp.stride(0), buf_slot, buf_slot.stride(0), step,
            slots, slots.stride(0), miss_pos, miss_pos.stride(0), miss_slot, miss_slot.stride(0),
            scratch, scratch.stride(0), s, k,
            BS=bs, LOG_BS=bs.bit_length() - 1, BK=bk, LOG_BK=bk.bit_length() - 1,
            NO_POS=_NO_POS, HIT_STAMP=_HIT_STAMP, num_warps=_resolve_warps(bs),
        )  # fmt: skip
    return slots, miss_pos, miss_slot


# --- host -> device row copies ------------------------------------------------------------------


__all__ = ["resolve", "resolve_scratch_size"]
