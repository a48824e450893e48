"""HiSparse hot-buffer ops: `resolve` and `copy_rows`, the torch reference (under
`no_host_sync`) and the Triton kernels (the interpreter without CUDA), against plain-Python
references written here with loops and dicts. Outputs and state must match exactly."""

from __future__ import annotations

import contextlib
import os
import random

import pytest
import torch

from dsakv.kernels import hisparse_ops as ref  # noqa: E402
from tests.host_sync import no_host_sync  # noqa: E402

try:
    import triton  # noqa: F401

    from dsakv.kernels import triton_hisparse as tri
    from dsakv.kernels import triton_rows as rows_kernels
except ImportError:  # pragma: no cover - triton is a dev extra
    tri = rows_kernels = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
IMPLS = [("torch", ref.resolve)] + ([("triton", tri.resolve)] if tri is not None else [])


# --- the plain-Python reference -----------------------------------------------------------------


def py_resolve(topk, newest, reserved, buf_pos, stamp, buf_slot, step):
    """Lists in; `buf_pos` / `stamp` (lists of lists) updated in place; (slots, miss_pos,
    miss_slot) lists out."""
    slots, miss_pos, miss_slot = [], [], []
    for r, row in enumerate(topk):
        size, k = len(buf_pos[r]), len(row)
        held = {}
        for e, p in enumerate(buf_pos[r]):
            if p >= 0:
                held.setdefault(p, e)
        hits, misses = set(), []
        for p in row:
            if p < 0 or p == newest[r]:
                continue
            if p in held:
                hits.add(held[p])
            elif p not in misses:
                misses.append(p)
        evictable = sorted((stamp[r][e], e) for e in range(size) if e not in hits)
        goes = {p: evictable[j][1] for j, p in enumerate(misses)}
        out = []
        for p in row:
            if p < 0:
                out.append(-1)
            elif p == newest[r]:
                out.append(reserved[r])
            elif p in held:
                out.append(buf_slot[r][held[p]])
            else:
                out.append(buf_slot[r][goes[p]])
        slots.append(out)
        miss_pos.append(misses + [-1] * (k - len(misses)))
        miss_slot.append([buf_slot[r][goes[p]] for p in misses] + [-1] * (k - len(misses)))
        for e in hits:
            stamp[r][e] = 2 * step + 1
        for p, e in goes.items():
            buf_pos[r][e] = p
            stamp[r][e] = 2 * step
    return slots, miss_pos, miss_slot


# --- scenarios ----------------------------------------------------------------------------------


class State:
    """One batch's buffers as lists (the Python reference's) and as tensors per implementation."""

    def __init__(self, buf_pos, stamp, buf_slot, reserved, newest, pos_dtype=torch.int64):
        self.py = ([list(r) for r in buf_pos], [list(r) for r in stamp])
        self.buf_slot, self.reserved, self.newest = buf_slot, reserved, list(newest)
        self.pos_dtype = pos_dtype
        self.t = {
            name: (torch.tensor(buf_pos, dtype=pos_dtype, device=DEVICE),
                   torch.tensor(stamp, dtype=torch.int64, device=DEVICE))
            for name in ("torch", "triton")
        }  # fmt: skip

    def step(self, topk, step, step_as_tensor=False):
        k = len(topk[0])
        want = py_resolve(topk, self.newest, self.reserved, *self.py, self.buf_slot, step)
        args = (
            torch.tensor(topk, dtype=self.pos_dtype, device=DEVICE).view(len(topk), k),
            torch.tensor(self.newest, dtype=torch.int64, device=DEVICE),
            torch.tensor(self.reserved, dtype=torch.int32, device=DEVICE),
        )
        slot_t = torch.tensor(self.buf_slot, dtype=torch.int32, device=DEVICE)
        st = torch.tensor(step, device=DEVICE) if step_as_tensor else step
        for name, fn in IMPLS:
            bp, stamp = self.t[name]
            with no_host_sync() as guard:
                got = fn(*args, bp, stamp, slot_t, st)
            assert guard.calls > 0
            for what, g, w in zip(("slots", "miss_pos", "miss_slot"), got, want, strict=True):
                assert g.tolist() == w, f"{name} {what}"
            assert got[0].dtype == torch.int32 and got[1].dtype == self.pos_dtype
            assert bp.tolist() == self.py[0], f"{name} buf_pos"
            assert stamp.tolist() == self.py[1], f"{name} stamp"
        return want


def random_batch(rng: random.Random, b: int, size: int, pos_dtype=torch.int64) -> State:
    newest, buf_pos, stamp = [], [], []
    slots = rng.sample(range(10 * b * size), b * size + b)
    for _ in range(b):
        top = rng.randint(size // 2, 3 * size)  # positions 0 .. top-1 exist
        mode = rng.choice(["empty", "full", "partial", "prefix"])
        if mode == "prefix":
            held = list(range(min(top, size)))
        else:
            n = {"empty": 0, "full": size, "partial": rng.randint(1, size - 1)}[mode]
            held = rng.sample(range(max(top, n)), n)
        row = held + [-1] * (size - len(held))
        rng.shuffle(row)
        buf_pos.append(row)
        # small stamp range: plenty of ties (broken by the lower entry index)
        stamp.append([rng.randint(-1, 4) if p >= 0 else -1 for p in row])
        newest.append(max(top, max(held, default=-1) + 1))
    if b > 1 and rng.random() < 0.5:  # a padding row
        newest[-1] = -1
    buf_slot = [slots[r * size : (r + 1) * size] for r in range(b)]
    reserved = slots[b * size :]
    return State(buf_pos, stamp, buf_slot, reserved, newest, pos_dtype)


def random_topk(rng: random.Random, st: State, k: int) -> list[list[int]]:
    rows = []
    for r, nw in enumerate(st.newest):
        if nw < 0:
            rows.append([-1] * k)
            continue
        held = [p for p in st.py[0][r] if p >= 0]
        n = rng.randint(k // 2, k)
        pool = list(range(nw))
        picks = []
        for _ in range(n):
            roll = rng.random()
            if roll < 0.4 and held:
                picks.append(rng.choice(held))  # likely a hit
            elif roll < 0.5 and picks:
                picks.append(rng.choice(picks))  # a duplicate
            elif roll < 0.55:
                picks.append(nw)  # the newest
            else:
                picks.append(rng.choice(pool))
        row = picks + [-1] * (k - n)
        rng.shuffle(row)
        rows.append(row)
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_resolve_random_steps_match_python(seed):
    rng = random.Random(seed)
    b = rng.randint(1, 4)
    size = rng.choice([16, 24, 32, 64])
    k = 1 if seed == 2 else rng.choice([size // 4 + 1, size // 2, size])
    st = random_batch(rng, b, size, torch.int32 if seed % 2 else torch.int64)
    step0 = 1 if seed != 5 else 1 << 40  # large stamps still order exactly
    for i in range(4):
        st.step(random_topk(rng, st, k), step0 + i, step_as_tensor=i % 2 == 1)
        st.newest = [n + 1 if n >= 0 else n for n in st.newest]


def _fixed(buf_pos, stamp, newest, size=None):
    b = len(buf_pos)
    size = size or len(buf_pos[0])
    buf_slot = [[1000 * (r + 1) + 10 * e for e in range(size)] for r in range(b)]
    return State(buf_pos, stamp, buf_slot, [7 + r for r in range(b)], newest)


def test_resolve_full_buffer_evicts_oldest_then_lower_index():
    # entries hold 0..7; stamps tie at 0 except entry 2 (older) and entry 5 (newer)
    st = _fixed([list(range(8))], [[0, 0, -3, 0, 0, 9, 0, 0]], [20])
    slots, miss_pos, miss_slot = st.step([[11, 3, 12, 12, 13, 19, 20, -1]], 1)
    # misses 11, 12, 13, 19 (12 once) take entries 2 (oldest), then 0, 1, 4 (ties by index)
    assert miss_pos[0][:4] == [11, 12, 13, 19] and miss_pos[0][4:] == [-1] * 4
    assert miss_slot[0][:4] == [1020, 1000, 1010, 1040]
    assert slots[0] == [1020, 1030, 1000, 1000, 1010, 1040, 7, -1]
    assert st.py[0][0] == [12, 13, 11, 3, 19, 5, 6, 7]
    assert st.py[1][0] == [2, 2, 2, 3, 2, 9, 0, 0]  # hit 3 at the MRU end, misses just below
    # next step: the entries stamped 0 go first, fresh misses (2) before the hit (3)
    st.newest = [21]
    st.step([[30, 31, 32, 33, 6, -1, -1, -1]], 2)
    # evictable by (stamp, entry): 7 (0), 0, 1, 2, 4 (2), 3 (3), 5 (9); 6 is hit
    assert st.py[0][0] == [31, 32, 33, 3, 19, 5, 6, 30]
    assert st.py[1][0] == [4, 4, 4, 3, 2, 9, 5, 4]


def test_resolve_empty_buffer_hits_only_and_padding_row():
    size = 16
    st = _fixed([[-1] * size, list(range(size)), [-1] * size],
                [[-1] * size, [0] * size, [-1] * size], [40, 16, -1])  # fmt: skip
    topk = [
        [5, 3, 5, 40, 9, -1, 2, 1],  # empty buffer: every non-newest position misses
        [15, 0, 16, 7, 7, -1, -1, 3],  # every position resident: hits only (16 = newest)
        [-1] * 8,  # padding row
    ]
    slots, miss_pos, _ = st.step(topk, 1)
    assert miss_pos[0][:6] == [5, 3, 9, 2, 1, -1] and miss_pos[1] == [-1] * 8
    assert slots[0][:5] == [1000, 1010, 1000, 7, 1020]
    assert slots[2] == [-1] * 8 and st.py[0][2] == [-1] * size
    assert st.py[1][1] == [3, 0, 0, 3, 0, 0, 0, 3] + [0] * 7 + [3]


def test_resolve_newest_held_in_buffer_is_not_a_hit():
    # entry 1 holds the newest position 9: its column maps to the reserved slot, the entry
    # is not hit (keeps its stamp) and stays evictable.
    st = _fixed([[4, 9, -1, -1]], [[5, 0, -1, -1]], [9])
    slots, miss_pos, _ = st.step([[9, 4, 1, 2]], 3)
    assert slots[0] == [7, 1000, 1020, 1030] and miss_pos[0][:2] == [1, 2]
    assert st.py[1][0] == [7, 0, 6, 6]


def test_resolve_k_equals_s_every_entry_evicted():
    size = 16
    st = _fixed([list(range(size))], [list(range(size))], [100])
    topk = [list(range(50, 50 + size))]
    _, miss_pos, miss_slot = st.step(topk, 1)
    assert miss_pos[0] == topk[0] and sorted(miss_slot[0]) == [1000 + 10 * e for e in range(size)]


def test_resolve_rejects_k_over_s():
    z = torch.zeros(1, 8, dtype=torch.int64)
    args = (torch.zeros(1, 9, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
            torch.zeros(1, dtype=torch.int64), z.clone(), z.clone(), z.clone(), 1)  # fmt: skip
    with pytest.raises(ValueError, match="top-k width"):
        ref.resolve(*args)
    if tri is not None:
        with pytest.raises(ValueError, match="top-k width"):
            tri.resolve(*args)


def test_short_request_never_misses_after_prefill():
    """init_buffers + bind_newest: a request no longer than its buffer keeps every position
    resident; past the buffer the newest token goes to the reserved slot and misses later."""
    size, k, prompt = 16, 8, 10
    rng = random.Random(7)
    buf_pos, stamp = ref.init_buffers(torch.tensor([prompt, 3], device=DEVICE), size)
    assert buf_pos[0].tolist() == list(range(prompt)) + [-1] * (size - prompt)
    assert stamp[1].tolist() == [0] * 3 + [-1] * (size - 3)
    buf_slot = torch.arange(2 * size, dtype=torch.int32, device=DEVICE).view(2, size) + 100
    reserved = torch.tensor([7, 8], dtype=torch.int32, device=DEVICE)
    state = {name: (buf_pos.clone(), stamp.clone()) for name, _ in IMPLS}
    missed_at = None
    for step in range(1, 12):
        lens = [prompt + step - 1, 3 + step - 1]
        newest = torch.tensor(lens, device=DEVICE)
        topk = torch.tensor([[rng.randrange(n + 1) for _ in range(k)] for n in lens], device=DEVICE)
        outs = []
        for name, fn in IMPLS:
            bp, st = state[name]
            with no_host_sync():
                slot_new = ref.bind_newest(bp, buf_slot, newest, reserved)
                outs.append(fn(topk, newest, slot_new, bp, st, buf_slot, step))
            inside = newest < size
            assert torch.equal(
                slot_new, torch.where(inside, newest.int() + buf_slot[:, 0], reserved)
            )
        for i, (name, _) in enumerate(IMPLS[1:], 1):  # the Triton kernel equals the reference
            assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[i], strict=True))
            assert all(torch.equal(a, b) for a, b in zip(state["torch"], state[name], strict=True))
        slots, miss_pos, _ = outs[0]
        if lens[0] <= size:  # every earlier position is resident
            assert (miss_pos[0] == -1).all(), step
            want = torch.where(topk[0] == newest[0], slot_new[0].long(), topk[0] + 100)
            assert torch.equal(slots[0].long(), want)
        elif missed_at is None and (miss_pos[0] >= 0).any():
            missed_at = step
        assert (miss_pos[1] == -1).all()  # row 1 stays within its buffer
    assert missed_at is not None  # past the buffer the old newest tokens come from the host


# --- copy_rows ----------------------------------------------------------------------------------

ROW_KINDS = [(torch.uint8, 656), (torch.uint8, 576), (torch.bfloat16, 576),
             (torch.float32, 576), (torch.uint8, 7)]  # fmt: skip


def _rows(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return torch.randn(shape, generator=g).to(dtype)


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory() if DEVICE.type == "cuda" else t


def py_copy(host, dev, src, dst):
    want = dev.clone()
    for s, d in zip(src, dst, strict=True):
        if s >= 0 and d >= 0:
            want[..., d, :] = host[..., s, :]
    return want


def _copy_impls(scratch_row):
    impls = [("torch", lambda *a: ref.copy_rows(*a, scratch_row=scratch_row))]
    if tri is not None:
        impls.append(("triton", rows_kernels.copy_rows))
    return impls


def _check_copy(host, dev, src, dst, scratch_row=None, view=None):
    """Every implementation leaves `dev` (or `view(base)` of a copy of `dev`) as the Python
    reference does, byte for byte: rows no real entry names keep their bytes."""
    want = py_copy(host, dev if view is None else view(dev), src, dst)
    s = torch.tensor(src, dtype=torch.int64, device=DEVICE)
    d = torch.tensor(dst, dtype=torch.int32, device=DEVICE)
    for name, fn in _copy_impls(scratch_row):
        base = dev.clone().to(DEVICE)
        got = base if view is None else view(base)
        # on CUDA the torch reference gathers on the host (a sync, said in its docstring)
        sync_free = DEVICE.type == "cpu" or name == "triton"
        with no_host_sync() if sync_free else contextlib.nullcontext():
            fn(_host(host), got, s, d)
        got = got.cpu()
        if scratch_row is not None and name == "torch":
            got[..., scratch_row, :] = want[..., scratch_row, :]  # scratch may hold anything
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name


@pytest.mark.parametrize("dtype,width", ROW_KINDS)
def test_copy_rows_skips_write_nothing(dtype, width):
    host, dev = _rows(dtype, (40, width), 1), _rows(dtype, (12, width), 2)
    # real entries, −1 sources, −1 destinations, a −1 pair, and padding sharing a real
    # entry's destination row (must not touch it)
    src = [3, -1, 17, 5, -1, 39, -1, 0]
    dst = [4, 4, 0, -1, 11, 7, -1, 2]
    _check_copy(host, dev, src, dst)
    _check_copy(host, dev, src, dst, scratch_row=10)


@pytest.mark.parametrize("dtype,width", ROW_KINDS[:1] + ROW_KINDS[3:])
def test_copy_rows_all_valid_and_all_skipped(dtype, width):
    host, dev = _rows(dtype, (40, width), 3), _rows(dtype, (12, width), 4)
    _check_copy(host, dev, [8, 1, 30, 2, 22, 9], [0, 11, 5, 6, 1, 3])
    _check_copy(host, dev, [-1] * 6, [-1] * 6)  # only padding: nothing written
    _check_copy(host, dev, [-1, -1, 4, -1], [-1, 2, -1, -1])


def test_copy_rows_layers_and_offset_views():
    """One copy list over G stacked layers in one launch (per-layer offsets), over a list of
    layers, and over row views that start mid-allocation (narrower words)."""
    g, width = 3, 576
    host, dev = _rows(torch.bfloat16, (g, 30, width), 5), _rows(torch.bfloat16, (g, 9, width), 6)
    src, dst = [4, -1, 29, 0], [8, 3, 0, 2]
    _check_copy(host, dev, src, dst)
    s = torch.tensor(src, device=DEVICE)
    d = torch.tensor(dst, device=DEVICE)
    want = py_copy(host, dev, src, dst)
    for layers in [ref.copy_rows_layers] + ([rows_kernels.copy_rows_layers] if tri else []):
        got = [dev[i].clone().to(DEVICE) for i in range(g)]
        layers([_host(host[i].clone()) for i in range(g)], got, s, d)
        assert all(torch.equal(got[i].cpu(), want[i]) for i in range(g))
    # uint8 rows starting one byte into their allocation: copied bytewise
    big_h, big_d = _rows(torch.uint8, (20, 659), 7), _rows(torch.uint8, (6, 659), 8)
    _check_copy(big_h[:, 1:657], big_d, [2, -1, 19], [5, 0, 1], view=lambda t: t[:, 3:])
    _check_copy(big_h[:, 1:657], big_d, [2, -1, 19], [5, 0, 1], view=lambda t: t[:, 3:],
                scratch_row=3)  # fmt: skip
