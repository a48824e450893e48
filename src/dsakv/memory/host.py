"""`HostPool`: the CPU tier. Same elided layout as the device pool (DESIGN.md §1, §7.3):
shared layers own no index-K on the host either, and full layers' index-K always travels
with the latent, so a restored prefix is exactly what was evicted. Under `--pp-size` each
stage's host tier mirrors its device pool's layers only (its layout: its bytes per page).
Under HiSparse the latent comes from and goes to the host rows (`copy_tokens`); where the
TP ranks of a machine map rank 0's, the other ranks' tiers hold index-K only.
"""

from __future__ import annotations

import torch

from .allocator import PageAllocator, page_slots, pages_of
from .pool import DSAKVPool, copy_tokens


class HostPool:
    """A CPU `DSAKVPool` (pinned when the device pool is on CUDA) plus its own allocator.
    `index_k_only`: no latent (a TP rank's under HiSparse, whose device pool moves index-K
    only: rank 0 writes the host rows the ranks map, and rank 0's tier holds their latent)."""

    def __init__(
        self,
        device_pool: DSAKVPool,
        num_pages: int,
        pin_memory: bool | None = None,
        index_k_only: bool = False,
    ) -> None:
        if not isinstance(device_pool, DSAKVPool):
            raise TypeError(f"a host tier backs a DSAKVPool, got {type(device_pool).__name__}")
        if pin_memory is None:
            pin_memory = device_pool.device.type == "cuda"
        self.device_pool = device_pool
        self.layout = device_pool.layout
        latent = 0 if index_k_only else None
        self.pool = DSAKVPool(
            self.layout, num_pages, "cpu", pin_memory=pin_memory, latent_pages=latent
        )
        self.allocator = PageAllocator(num_pages, self.layout.page_size)
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        # Under tensor parallelism every rank holds a replica of the pool: rank 0 records
        # its copies here and the other ranks `replay` them before the next forward. The
        # journal names slots only, so a pipeline stage replays it over its own layers.
        self.journal: list[tuple[str, torch.Tensor, torch.Tensor]] | None = None

    # --- sizes -------------------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free_pages

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    @property
    def bytes_copied(self) -> dict[str, int]:
        """Total bytes moved each way: device→host (`d2h`) and host→device (`h2d`)."""
        return {"d2h": self.bytes_to_host, "h2d": self.bytes_to_device}

    # --- transfers ---------------------------------------------------------------------------

    def backup(self, device_slots: torch.Tensor) -> torch.Tensor:
        """Copy tokens to freshly allocated host pages; returns their host slots, in order.

        Raises `OutOfPages` (allocating nothing) when the host tier has no room; the caller
        decides what to evict.
        """
        n = int(torch.as_tensor(device_slots).numel())
        pages = self.allocator.alloc(-(-n // self.layout.page_size))
        host_slots = page_slots(pages, self.layout.page_size)[:n]
        try:
            self.bytes_to_host += copy_tokens(self.pool, host_slots, self.device_pool, device_slots)
        except BaseException:
            self.allocator.free(pages)
            raise
        self._record("d2h", device_slots, host_slots)
        return host_slots

    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copy backed-up tokens into device slots (the host copy stays until `free`)."""
        self.bytes_to_device += copy_tokens(self.device_pool, device_slots, self.pool, host_slots)
        self._record("h2d", device_slots, host_slots)

    def free(self, host_slots: torch.Tensor) -> None:
        """Release the host pages behind slots returned by `backup`."""
        self.allocator.free(pages_of(host_slots, self.layout.page_size))

    # --- replicas (tensor parallelism) -------------------------------------------------------

    def _record(self, kind: str, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        if self.journal is not None:
            dev = torch.as_tensor(device_slots).reshape(-1).to("cpu", torch.int32)
            self.journal.append((kind, dev, host_slots.to(torch.int32)))

    def take_journal(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """The copies made since the last call (rank 0 sends them to its peers)."""
        ops, self.journal = self.journal or [], []
        return ops

    def replay(self, ops: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        """Repeat another rank's copies on this rank's replica (same slots, same order)."""
        for kind, dev, host in ops:
            dev, host = dev.long(), host.long()
            if kind == "d2h":
                self.bytes_to_host += copy_tokens(self.pool, host, self.device_pool, dev)
            else:
                self.bytes_to_device += copy_tokens(self.device_pool, dev, self.pool, host)
