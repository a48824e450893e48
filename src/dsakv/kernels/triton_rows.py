"""Copy rows between buffers by slot lists: `copy_rows` (`dev[dst[i]] = host[src[i]]`, one
layer or a stack of them in one launch) and `store_rows` (`data[slots[i]] = rows[i]`).

HiSparse copies a decode step's missed rows from pinned host memory with it, and the Triton
backend stores plain latent / index-K rows (bf16, fp32) with it. One program per ROWS
entries and layer; row words (int32 where the row bytes allow) are copied with masked
loads and stores, so a −1 entry (a padding row of a CUDA-graph decode batch, an unused
copy-list entry) writes nothing, which an `index_copy_` cannot express without a host sync
or a scratch row. On CUDA a host tensor must be pinned: the kernel reads it over UVA
(Triton's launcher maps the pinned pointer to its device address with
cuPointerGetAttribute; pageable memory is refused with "cannot be accessed from Triton (cpu
tensor?)"), so the launch is capturable, copy included.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import hisparse_ops as _ref
from ._triton import cdiv, next_pow2, require_triton, tl, triton

ROWS = 8  # copy-list entries per copy program
_COPY_BLOCK = 256  # words per row chunk in the copy kernel


@triton.jit
def _copy_rows_kernel(
    host,
    s_host,
    s_hlayer,
    dev,
    s_dev,
    s_dlayer,
    src,
    dst,
    n,
    W: tl.constexpr,
    BLOCK_W: tl.constexpr,
    ROWS: tl.constexpr,
    IDENTITY: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    layer = tl.program_id(1).to(tl.int64)
    if IDENTITY:  # src is 0..n−1 (a store of rows in order): nothing to read
        s = tl.where(i < n, i, -1)
    else:
        s = tl.load(src + i, mask=i < n, other=-1).to(tl.int64)
    d = tl.load(dst + i, mask=i < n, other=-1).to(tl.int64)
    ok = (s >= 0) & (d >= 0)
    h_row = host + layer * s_hlayer + tl.where(ok, s, 0) * s_host  # int64 row offsets
    d_row = dev + layer * s_dlayer + tl.where(ok, d, 0) * s_dev
    w = tl.arange(0, BLOCK_W)
    for w0 in tl.static_range(0, W, BLOCK_W):
        ww = w0 + w
        m = ok[:, None] & (ww[None, :] < W)
        x = tl.load(h_row[:, None] + ww[None, :], mask=m)
        tl.store(d_row[:, None] + ww[None, :], x, mask=m)


_WORDS = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _word_size(*ts: torch.Tensor) -> int:
    """The widest word (4, 2, 1 B) that every row, stride and start of `ts` is a multiple of."""
    for word in (4, 2):
        if all(
            (t.shape[-1] * t.element_size()) % word == 0
            and t.data_ptr() % word == 0
            and all((st * t.element_size()) % word == 0 for st in t.stride()[:-1])
            for t in ts
        ):
            return word
    return 1


def _as_words(t: torch.Tensor, word: int) -> torch.Tensor:
    dt = _WORDS[word]
    return t if t.dtype == dt else t.view(dt)


def copy_rows(
    host: torch.Tensor,
    dev: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
) -> None:
    """Triton `hisparse_ops.copy_rows`: `dev[dst[i]] = host[src[i]]` where both are ≥ 0 (one
    layer `[slots, W]`, or G layers `[G, slots, W]` in one launch); −1 entries store nothing
    (masked stores: no scratch row needed). Real entries must have distinct `dst`. On CUDA
    `host` must be pinned (read over UVA); rows of any dtype are copied as raw words."""
    _ref._check_copy(host, dev, src, dst)
    _copy(host, dev, src, dst)


def _copy(host: torch.Tensor, dev: torch.Tensor, src: torch.Tensor | None, dst: torch.Tensor):
    """The launch; `src` None copies host row i (every layer's) to `dst[i]`."""
    require_triton()
    n = dst.shape[0]
    h3 = host if host.dim() == 3 else host.unsqueeze(0)
    d3 = dev if dev.dim() == 3 else dev.unsqueeze(0)
    if n == 0 or h3.shape[0] == 0:
        return
    if h3.stride(-1) != 1 or d3.stride(-1) != 1:
        raise ValueError("host and dev rows must be contiguous along W")
    word = _word_size(h3, d3)
    hv, dv = _as_words(h3, word), _as_words(d3, word)
    words = hv.shape[-1]
    _copy_rows_kernel[(cdiv(n, ROWS), hv.shape[0])](
        hv, hv.stride(1), hv.stride(0), dv, dv.stride(1), dv.stride(0),
        dst if src is None else src, dst, n,
        W=words, BLOCK_W=min(next_pow2(words), _COPY_BLOCK), ROWS=ROWS,
        IDENTITY=src is None, num_warps=4,
    )  # fmt: skip


def copy_rows_layers(
    hosts: Sequence[torch.Tensor],
    devs: Sequence[torch.Tensor],
    src: torch.Tensor,
    dst: torch.Tensor,
) -> None:
    """Replay one copy list over layers held in separate tensors, one launch per layer (for
    layers stacked as `[G, slots, W]` views, `copy_rows` does it in one launch)."""
    if len(hosts) != len(devs):
        raise ValueError(f"{len(hosts)} host layers vs {len(devs)} device layers")
    for h, d in zip(hosts, devs, strict=True):
        copy_rows(h, d, src, dst)


def store_rows(rows: torch.Tensor, data: torch.Tensor, slots: torch.Tensor) -> None:
    """`data[slots[i]] = rows[i]` (cast to `data`'s dtype) for every slot ≥ 0."""
    n, width = rows.shape
    if data.dim() != 2 or data.shape[1] != width or slots.shape != (n,):
        raise ValueError(
            f"rows {tuple(rows.shape)}, data {tuple(data.shape)}, slots {tuple(slots.shape)}"
        )
    _copy(rows.to(data.dtype).contiguous(), data, None, slots.contiguous())


__all__ = ["copy_rows", "copy_rows_layers", "store_rows"]
