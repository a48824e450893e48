"""Page allocator and request-to-token table: bookkeeping only, no KV tensors.

Kept apart from the pools (DESIGN.md §6) so the scheduler, the prefix cache and the host
tier can each own pages without knowing what a page holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from dsakv.errors import is_int


class OutOfPages(RuntimeError):
    """Not enough free pages; nothing was allocated."""


class PageError(ValueError):
    """A page was freed twice, or never handed out by this allocator."""


class PageAllocator:
    """Fixed set of pages `0..num_pages-1`; a free stack plus an in-use bitmap (O(1) a page)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if not is_int(num_pages) or not is_int(page_size):
            raise TypeError(
                f"num_pages and page_size must be ints, got {num_pages!r}, {page_size!r}"
            )
        if num_pages < 0 or page_size < 1:
            raise ValueError(
                f"need num_pages >= 0 and page_size >= 1, got {num_pages}, {page_size}"
            )
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self._in_use = bytearray(num_pages)

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n_pages: int) -> list[int]:
        """`n_pages` pages, or `OutOfPages` (and no change) when fewer are free."""
        if not is_int(n_pages):
            raise TypeError(f"the number of pages must be an int, got {n_pages!r}")
        if n_pages < 0:
            raise ValueError(f"cannot allocate {n_pages} pages")
        if n_pages > len(self._free):
            raise OutOfPages(
                f"need {n_pages} pages but only {len(self._free)} of {self.num_pages} are free"
            )
        pages = [self._free.pop() for _ in range(n_pages)]
        for p in pages:
            self._in_use[p] = 1
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages; checks the whole batch first so a bad call frees nothing."""
        pages = list(pages)
        seen: set[int] = set()
        for p in pages:
            if not is_int(p):  # int("0") or int(0.5) would free some other page
                raise TypeError(f"pages must be ints, got {p!r}")
            if not 0 <= p < self.num_pages:
                raise PageError(
                    f"page {p} was never handed out by this allocator (pages 0..{self.num_pages - 1})"
                )
            if not self._in_use[p] or p in seen:
                raise PageError(f"double free of page {p}")
            seen.add(p)
        for p in pages:
            self._in_use[p] = 0
            self._free.append(p)

    def check(self) -> None:
        """Integrity: free + in use == total, no page both free and in use, no duplicates."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("free list holds duplicate pages")
        used = sum(self._in_use)
        if len(free) + used != self.num_pages:
            raise AssertionError(f"{len(free)} free + {used} in use != {self.num_pages} pages")
        both = next((p for p in free if self._in_use[p]), None)
        if both is not None:
            raise AssertionError(f"page {both} is both free and in use")


def page_slots(pages: Sequence[int] | torch.Tensor, page_size: int) -> torch.Tensor:
    """Token slots of `pages`, in order: slot = page * page_size + offset (on the pages'
    device)."""
    p = torch.as_tensor(pages)
    if p.numel():  # (an empty list is float32 to torch)
        if p.is_floating_point() or p.dtype == torch.bool:
            raise TypeError(f"pages must be integers, got {p.dtype}")
        if p.min() < 0:
            raise ValueError(f"page {int(p.min())} is negative")
    p = p.to(torch.long).reshape(-1, 1)
    return (p * page_size + torch.arange(page_size, dtype=torch.long, device=p.device)).reshape(-1)


def pages_of(slots: torch.Tensor, page_size: int) -> list[int]:
    """Distinct pages the slots fall in, in first-seen order."""
    return list(dict.fromkeys((torch.as_tensor(slots).reshape(-1) // page_size).tolist()))


class ReqToTokenTable:
    """Per request, the physical token slot of each logical position (0, 1, 2, ...)."""

    def __init__(self) -> None:
        self._slots: dict[int, list[int]] = {}

    def __contains__(self, rid: int) -> bool:
        return rid in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def extend(self, rid: int, slots: Iterable[int] | torch.Tensor) -> None:
        if isinstance(slots, torch.Tensor):
            slots = slots.reshape(-1).tolist()
        self._slots.setdefault(rid, []).extend(int(s) for s in slots)

    def get(self, rid: int, n: int | None = None) -> torch.Tensor:
        """Slots of the first `n` positions (all when `n` is None) as a LongTensor."""
        row = self._row(rid)
        if n is not None and not 0 <= n <= len(row):
            raise IndexError(f"request {rid} has {len(row)} positions, asked for {n}")
        return torch.tensor(row if n is None else row[:n], dtype=torch.long)

    def release(self, rid: int) -> None:
        """Forget the request (its pages are freed from `Request.pages`, not from here)."""
        self._row(rid)
        del self._slots[rid]

    def _row(self, rid: int) -> list[int]:
        try:
            return self._slots[rid]
        except KeyError:
            raise KeyError(f"unknown request {rid}") from None
