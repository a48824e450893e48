"""HiSparse hot-buffer ops, torch reference: resolve top-k positions to device slots, and copy
missed latent rows from host memory (DESIGN §13).

Both ops take fixed shapes and do only masked, fixed-shape tensor work on the device (sort,
searchsorted, cumsum, gather, scatter over permutations): no `.item()`, no `nonzero`, no
boolean-mask indexing, no Python branch on a tensor value, so a CUDA graph can capture
`resolve` (and the device side of `copy_rows`). `dsakv.kernels.triton_hisparse` holds the
Triton kernels; they return exactly what these functions return, state included.

State of one request row r of the batch (device int tensors, `resolve` updates them in place):

- `buf_pos[B, S]` int32/int64: the logical position each buffer entry holds (−1: empty).
  Its non-negative values must be unique per row (`resolve` keeps them so).
- `stamp[B, S]` int64: recency, bigger = more recent; an empty entry must carry a stamp
  below every filled one (`init_buffers` gives empties −1 and resident entries 0, and decode
  steps start at 1) so that empties are evicted first.
- `buf_slot[B, S]` int32/int64: the device latent slot of each entry, fixed for the
  request's life: entry e's rows live at `buf_slot[r, e]` in every layer (lockstep buffers).
- `reserved_slot[B]`: the device slot of the newest token; `newest[B]` its position
  (len − 1 of the sequence being decoded; −1 for a padding row).

`resolve` rules (SGLang's HiSparse): the newest position maps to the reserved slot (never a
miss, and its buffer entry, if one holds it, is not hit); a position some entry holds is a
hit; every other position ≥ 0 is a miss, one per distinct position, ranked by the column of
its first occurrence. Evictable entries are those not hit this step, ordered oldest stamp
first, ties by lower entry index; the j-th miss takes the j-th evictable entry. Afterwards hit
entries carry stamp 2·step+1 (the MRU end), fresh misses 2·step (just below the hits),
every other entry keeps its stamp; an evicted entry's position becomes the missed one.
With K ≤ S there are always enough evictable entries (hits + misses ≤ K); `resolve` raises
ValueError on K > S (shapes are host-known). Limits of the packed sort keys (shared with
the Triton kernel, not checked on the device): positions < 2^40, |stamp| < 2^45
(step < 2^44), S ≤ 2^16.

Prefill end (`init_buffers`): SGLang keeps the first min(len, S) positions as the hot buffer,
so entry j holds position j. While the newest position is < S the caller writes the new
token straight into entry `newest` (`bind_newest` marks it resident and returns its slot as
the token's reserved slot), so every position of a request no longer than its buffer stays
resident and `resolve` never reports a miss for it; past S the token goes to the real
reserved slot, is backed up to the host, and comes back as a miss when the indexer picks it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from dsakv.config.hisparse import MAX_DEVICE_BUFFER_SIZE as MAX_BUFFER

# Sentinel position of a top-k column that is not looked up (padding / the newest token);
# it sorts after every real position (< 2^40).
_NO_POS = 1 << 46
_STAMP_MAX = torch.iinfo(torch.int64).max  # the sort key of a hit entry (never evicted)

_INT = (torch.int32, torch.int64)


def _check_resolve(topk, newest, reserved_slot, buf_pos, stamp, buf_slot) -> tuple[int, int, int]:
    if buf_pos.dim() != 2:
        raise ValueError(f"buf_pos must be [B, S], got {tuple(buf_pos.shape)}")
    b, s = buf_pos.shape
    if topk.dim() != 2 or topk.shape[0] != b:
        raise ValueError(f"topk must be [{b}, K], got {tuple(topk.shape)}")
    k = topk.shape[1]
    if stamp.shape != (b, s) or buf_slot.shape != (b, s):
        raise ValueError(
            f"stamp and buf_slot must be [{b}, {s}], got {tuple(stamp.shape)}, "
            f"{tuple(buf_slot.shape)}"
        )
    if newest.shape != (b,) or reserved_slot.shape != (b,):
        raise ValueError(
            f"newest and reserved_slot must be [{b}], got {tuple(newest.shape)}, "
            f"{tuple(reserved_slot.shape)}"
        )
    for name, t in (("topk", topk), ("newest", newest), ("reserved_slot", reserved_slot),
                    ("buf_pos", buf_pos), ("buf_slot", buf_slot)):  # fmt: skip
        if t.dtype not in _INT:
            raise TypeError(f"{name} must be int32/int64, got {t.dtype}")
    if stamp.dtype != torch.int64:
        raise TypeError(f"stamp must be int64, got {stamp.dtype}")
    if not 1 <= k <= s:
        raise ValueError(
            f"top-k width {k} must be in [1, device_buffer_size={s}]: with K > S a step can "
            "miss more positions than the buffer has evictable entries"
        )
    if s > MAX_BUFFER:
        raise ValueError(f"device_buffer_size {s} > {MAX_BUFFER} (the sort keys pack entry ids)")
    return b, s, k


def _stamps(step) -> tuple:
    """(2·step, 2·step + 1) as Python ints or 0-d int64 tensors (no host read either way)."""
    if isinstance(step, torch.Tensor):
        s = step.to(torch.int64)
        return 2 * s, 2 * s + 1
    return 2 * int(step), 2 * int(step) + 1


def resolve(
    topk: torch.Tensor,
    newest: torch.Tensor,
    reserved_slot: torch.Tensor,
    buf_pos: torch.Tensor,
    stamp: torch.Tensor,
    buf_slot: torch.Tensor,
    step: int | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Map the indexer's `topk[B, K]` positions (−1 padding; duplicates allowed, they share
    one slot and count as one miss) to device slots and update the buffers in place (rules:
    module docstring). `step`: an int or a 0-d int tensor, strictly increasing across calls.

    Returns `(slots[B, K], miss_pos[B, K], miss_slot[B, K])`: the device slot of every
    column (−1 where padding), and the copy list: row r's misses in the order of their first
    column, packed at the front (position to fetch, device slot it goes to), −1 after them.
    `slots`/`miss_slot` have `buf_slot`'s dtype, `miss_pos` has `topk`'s.

    Cost per row: four sorts (K, S, S, K) and three searchsorted; no [B, K, S] comparison.
    """
    b, s, k = _check_resolve(topk, newest, reserved_slot, buf_pos, stamp, buf_slot)
    dev = topk.device
    lo_stamp, hi_stamp = _stamps(step)
    pos = topk.to(torch.int64)
    nw = newest.to(torch.int64)[:, None]
    valid = pos >= 0
    is_new = valid & (pos == nw)
    cand = valid & (pos != nw)  # positions looked up in the buffer
    col = torch.arange(k, device=dev).expand(b, k)

    # Sorted candidate positions (stable: equal positions keep column order).
    ckey = torch.where(cand, pos, _NO_POS)
    csorted, corder = torch.sort(ckey, dim=1, stable=True)
    # Sorted buffer positions (empties as −1, below every real position).
    bp = buf_pos.to(torch.int64)
    bkey = torch.where(bp >= 0, bp, -1)
    bsorted, border = torch.sort(bkey, dim=1, stable=True)

    # Column -> the entry holding its position (a hit).
    at = torch.searchsorted(bsorted, pos).clamp_(max=s - 1)
    found = cand & (bsorted.gather(1, at) == pos)
    hit_entry = border.gather(1, at)
    # Entry -> is its position among this step's candidates (a hit entry)?
    at = torch.searchsorted(csorted, bkey).clamp_(max=k - 1)
    hit = (bkey >= 0) & (csorted.gather(1, at) == bkey)
    # Column -> the first column holding the same position (its miss's leader).
    at = torch.searchsorted(csorted, ckey).clamp_(max=k - 1)
    leader = corder.gather(1, at)

    miss = cand & ~found
    first = miss & (leader == col)
    rank = first.to(torch.int64).cumsum(1) - 1  # j of the j-th miss, at its first column
    n_miss = first.sum(1, keepdim=True)
    mrank = rank.gather(1, leader).clamp_(0, s - 1)  # every column of a miss: its j

    # Eviction order: not-hit entries by (stamp, entry), hits last.
    eorder = torch.sort(torch.where(hit, _STAMP_MAX, stamp), dim=1, stable=True).indices
    take = eorder.gather(1, mrank)  # entry the column's miss goes to

    bslot = buf_slot.to(torch.int64)
    slots = torch.where(
        found,
        bslot.gather(1, hit_entry),
        torch.where(
            miss,
            bslot.gather(1, take),
            torch.where(is_new, reserved_slot.to(torch.int64)[:, None], -1),
        ),
    )

    # Copy list: the first column of each miss, in column order, then padding.
    mcol = torch.argsort(torch.where(first, col, col + k), dim=1)
    live = col < n_miss
    miss_pos = torch.where(live, pos.gather(1, mcol), -1)
    ev = eorder[:, :k]
    miss_slot = torch.where(live, bslot.gather(1, ev), -1)

    # State, written through the eviction permutation (every entry exactly once).
    live_s = torch.arange(s, device=dev).expand(b, s) < n_miss
    new_pos = torch.where(live_s, F.pad(miss_pos, (0, s - k), value=-1), bp.gather(1, eorder))
    new_stamp = torch.where(live_s, lo_stamp, torch.where(hit, hi_stamp, stamp).gather(1, eorder))
    buf_pos.scatter_(1, eorder, new_pos.to(buf_pos.dtype))
    stamp.scatter_(1, eorder, new_stamp)
    return (
        slots.to(buf_slot.dtype),
        miss_pos.to(topk.dtype),
        miss_slot.to(buf_slot.dtype),
    )


def init_buffers(
    seq_lens: torch.Tensor, buffer_size: int, pos_dtype: torch.dtype = torch.int32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hot-buffer state at prefill end for prompts of `seq_lens[B]` tokens: SGLang keeps the
    first min(len, S) positions resident, entry j holding position j (its rows are where
    `buf_slot[r, j]` points: the caller copies or prefills them there), stamp 0; entries past
    the prompt are empty (position −1, stamp −1, evicted first). Decode steps start at 1.
    Returns `(buf_pos[B, S], stamp[B, S])` on `seq_lens`' device."""
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens must be [B], got {tuple(seq_lens.shape)}")
    if not 1 <= buffer_size <= MAX_BUFFER:
        raise ValueError(f"buffer_size must be in [1, {MAX_BUFFER}], got {buffer_size}")
    j = torch.arange(buffer_size, device=seq_lens.device).expand(seq_lens.shape[0], -1)
    resident = j < seq_lens.to(torch.int64)[:, None]
    buf_pos = torch.where(resident, j, -1).to(pos_dtype)
    stamp = torch.where(resident, 0, -1).to(torch.int64)
    return buf_pos, stamp


def bind_newest(
    buf_pos: torch.Tensor,
    buf_slot: torch.Tensor,
    newest: torch.Tensor,
    reserved_slot: torch.Tensor,
) -> torch.Tensor:
    """Where the newest token of each row is written this step (call before `resolve`, and
    pass the result to it as `reserved_slot`): while 0 ≤ newest < S, buffer entry `newest`
    (marked resident in place: it holds the token from now on, so a request no longer than
    its buffer never needs the host), else `reserved_slot`. Only for buffers laid out by
    `init_buffers` (entry j ↔ position j), which stay so while the request is ≤ S long."""
    b, s = buf_pos.shape
    nw = newest.to(torch.int64)
    inside = (nw >= 0) & (nw < s)
    at = torch.where(inside, nw, 0)[:, None]
    keep = buf_pos.gather(1, at)
    buf_pos.scatter_(1, at, torch.where(inside[:, None], nw[:, None].to(buf_pos.dtype), keep))
    slot = buf_slot.gather(1, at)[:, 0].to(torch.int64)
    return torch.where(inside, slot, reserved_slot.to(torch.int64)).to(reserved_slot.dtype)


# --- host -> device row copies ------------------------------------------------------------------


def _check_copy(host, dev, src, dst) -> None:
    if host.dim() not in (2, 3) or dev.dim() != host.dim():
        raise ValueError(
            f"host and dev must both be [slots, W] or [G, slots, W], got {tuple(host.shape)} "
            f"and {tuple(dev.shape)}"
        )
    if host.dtype != dev.dtype or host.shape[-1] != dev.shape[-1]:
        raise ValueError(
            f"host {host.dtype} [..., {host.shape[-1]}] and dev {dev.dtype} "
            f"[..., {dev.shape[-1]}] rows differ"
        )
    if host.dim() == 3 and host.shape[0] != dev.shape[0]:
        raise ValueError(f"{host.shape[0]} host layers vs {dev.shape[0]} device layers")
    if src.dim() != 1 or dst.shape != src.shape or src.dtype not in _INT or dst.dtype not in _INT:
        raise ValueError("src and dst must be 1-D int32/int64 tensors of one length")


def copy_rows(
    host: torch.Tensor,
    dev: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    scratch_row: int | None = None,
) -> None:
    """`dev[dst[i]] = host[src[i]]` for every i with src[i] ≥ 0 and dst[i] ≥ 0 (one layer's
    rows `[slots, W]`, or G layers `[G, slots, W]` replaying one copy list); entries with a
    −1 write nothing. Real entries must have distinct `dst` (a copy list from `resolve` has).

    Fixed shapes, and padding never writes a row a real entry writes: with `scratch_row` (a
    device row nothing reads) padding goes there; without one it repeats the first real entry
    (same source, same row: identical bytes, whatever order the writes land in), or, in a
    list with no real entry, rewrites device row 0 with the bytes it already holds.

    On CUDA the host gather (`host.index_select` over pinned memory) runs on the CPU: it
    reads `src` there (a host sync) and cannot be captured in a CUDA graph. This is the
    reference and the CPU path; `triton_rows.copy_rows` is the capturable one (the
    kernel reads pinned host rows directly over UVA).
    """
    _check_copy(host, dev, src, dst)
    if src.shape[0] == 0:
        return
    ddev = dev.device
    s = src.to(ddev, torch.int64)
    d = dst.to(ddev, torch.int64)
    ok = (s >= 0) & (d >= 0)
    real = None
    if scratch_row is not None:
        s = torch.where(ok, s, 0)
        d = torch.where(ok, d, scratch_row)
    else:
        first = torch.argmax(ok.to(torch.int8)).reshape(1)  # 0 when no entry is real
        real = ok.index_select(0, first)  # [1]: the list has a real entry
        s = torch.where(ok, s, s.index_select(0, first).clamp(min=0))
        d = torch.where(ok, d, torch.where(real, d.index_select(0, first), 0))
    axis = host.dim() - 2
    rows = host.index_select(axis, s.to(host.device)).to(ddev)
    if real is not None:
        rows = torch.where(real, rows, dev.index_select(axis, d))
    dev.index_copy_(axis, d, rows)


def copy_rows_layers(
    hosts: Sequence[torch.Tensor],
    devs: Sequence[torch.Tensor],
    src: torch.Tensor,
    dst: torch.Tensor,
    scratch_row: int | None = None,
) -> None:
    """Replay one copy list over several layers held in separate tensors (the shared layers of
    an IndexShare group: lockstep buffers put a token at the same device slot in each)."""
    if len(hosts) != len(devs):
        raise ValueError(f"{len(hosts)} host layers vs {len(devs)} device layers")
    for h, d in zip(hosts, devs, strict=True):
        copy_rows(h, d, src, dst, scratch_row)


__all__ = [
    "MAX_BUFFER",
    "bind_newest",
    "copy_rows",
    "copy_rows_layers",
    "init_buffers",
    "resolve",
]
