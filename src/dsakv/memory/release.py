"""Freeing tensors' memory and bringing it back, for sleep mode
(`Engine.release_memory_occupation`).

The storage under the tensors is resized to nothing: the tensors, and every view of them
(the pool's per-token parts, HiSparse's device rows, the attention's weight views), stay
the same objects with the same shapes and see the memory again once it is back; only the
addresses change, so whatever holds raw pointers (native kernels' tables, CUDA graphs) is
made again.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .pool import advise_huge_pages, allocation_failed, pinned_empty


def storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct storages under `tensors`, those that hold memory (views and tied
    weights share one)."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            out.append(s)
    return out


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes `tensors` hold in memory (each storage once): 0 once released."""
    return sum(s.nbytes() for s in storages(tensors))


def _bytes(s: torch.UntypedStorage) -> torch.Tensor:
    """`s` as one uint8 tensor over all of its bytes."""
    return torch.empty(0, dtype=torch.uint8, device=s.device).set_(s, 0, (s.nbytes(),), (1,))


class Stash:
    """The storages under some tensors, to be freed (`free`) and brought back (`restore`):
    with `keep`, a host copy of their bytes made now (page-locked for a GPU's, one block for
    all) comes back bit for bit; without, zeros come back (what a fresh pool holds).
    `huge_pages`: CPU memory comes back advised for huge pages, as a CPU model's weights
    are loaded (`huge_page_empty_like`); the allocator's new memory is not."""

    def __init__(self, tensors: Iterable[torch.Tensor], keep: bool, huge_pages: bool = False):
        self._held = [(s, s.nbytes()) for s in storages(tensors)]
        self._huge_pages = huge_pages
        self._copy: torch.Tensor | None = None
        if keep and self._held:
            total = sum(n for _, n in self._held)
            gpu = self._held[0][0].device.type == "cuda"
            try:
                copy = (
                    pinned_empty((total,), torch.uint8)
                    if gpu
                    else torch.empty(total, dtype=torch.uint8)
                )
            except (RuntimeError, MemoryError) as e:
                if not allocation_failed(e):
                    raise
                raise MemoryError(
                    f"no host memory for a {total / 2**30:.2f} GiB copy of the weights"
                ) from None
            at = 0
            for s, n in self._held:
                copy[at : at + n].copy_(_bytes(s))
                at += n
            self._copy = copy

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self._held)

    def free(self) -> None:
        for s, _ in self._held:
            s.resize_(0)

    def restore(self) -> None:
        """Every storage at its size again, its bytes (or zeros) in it; if one cannot be
        allocated, all are freed again and the error raised (the stash stays usable)."""
        try:
            at = 0
            for s, n in self._held:
                s.resize_(n)
                if self._huge_pages and s.device.type == "cpu":
                    advise_huge_pages(s.data_ptr(), n)
                b = _bytes(s)
                if self._copy is None:
                    b.zero_()
                else:
                    b.copy_(self._copy[at : at + n], non_blocking=True)
                at += n
            if self._held and self._held[0][0].device.type == "cuda":
                torch.cuda.synchronize(self._held[0][0].device)
        except BaseException:
            self.free()
            raise
