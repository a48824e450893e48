"""Radix prefix cache over page-aligned token sequences, with an optional host tier.

Each node is one full page of tokens: its key is that page's token ids, its value the
device page holding their KV (latent and, for layers that own it, index-K — a page is the
unit the pools store both in). Unreferenced pages are evicted least-recently-used first;
with a host tier they are demoted to host memory and promoted back on a hit.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from dsakv.memory.allocator import OutOfPages, PageAllocator, page_slots
from dsakv.memory.host import HostPool

_clock = itertools.count()


@dataclass(eq=False)
class Node:
    key: tuple[int, ...]
    parent: Node | None
    page: int | None = None  # device page, or None while the KV lives on the host
    host_slots: torch.Tensor | None = None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = field(default_factory=lambda: next(_clock))


class PrefixCache:
    """Matches, locks, inserts and evicts cached pages; owns the pages it holds."""

    def __init__(self, allocator: PageAllocator, host: HostPool | None = None) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.host = host
        self.root = Node((), None)
        self.num_device_pages = 0  # pages the tree holds on the device
        self.num_host_pages = 0
        self.demoted_pages = 0
        self.promoted_pages = 0

    # --- lookups ---------------------------------------------------------------------------

    def match(self, tokens: list[int], max_pages: int) -> list[Node]:
        """Nodes for the longest cached page-aligned prefix of `tokens` (≤ `max_pages`)."""
        node, out, tick = self.root, [], next(_clock)
        ps = self.page_size
        for i in range(min(max_pages, len(tokens) // ps)):
            child = node.children.get(tuple(tokens[i * ps : (i + 1) * ps]))
            if child is None:
                break
            child.last_access = tick
            out.append(child)
            node = child
        return out

    def lock(self, nodes: list[Node]) -> None:
        for n in nodes:
            n.lock_ref += 1

    def unlock(self, nodes: list[Node]) -> None:
        for n in nodes:
            if n.lock_ref <= 0:
                raise AssertionError("unlock of an unlocked prefix-cache node")
            n.lock_ref -= 1

    def promote(self, nodes: list[Node]) -> None:
        """Bring host-resident nodes back to device pages (nodes must be locked)."""
        for n in nodes:
            if n.page is not None:
                continue
            assert self.host is not None and n.host_slots is not None
            (page,) = self.alloc(1)
            self.host.load(n.host_slots, page_slots([page], self.page_size))
            self.host.free(n.host_slots)
            n.page, n.host_slots = page, None
            self.num_device_pages += 1
            self.num_host_pages -= 1
            self.promoted_pages += 1

    # --- insertion -------------------------------------------------------------------------

    def insert(self, tokens: list[int], pages: list[int], start: int = 0) -> list[Node]:
        """Adopt the full pages of `tokens`; pages already cached are freed as duplicates.

        `pages[i]` holds tokens of page i; pages before `start` are already tree nodes (the
        caller's locked prefix). Returns the path of nodes covering every full page.
        """
        ps = self.page_size
        node, path, tick = self.root, [], next(_clock)
        duplicates: list[int] = []
        for i in range(len(tokens) // ps):
            key = tuple(tokens[i * ps : (i + 1) * ps])
            child = node.children.get(key)
            if child is None:
                child = Node(key, node, page=pages[i])
                node.children[key] = child
                self.num_device_pages += 1
            elif i >= start:
                if child.page is None:  # our copy replaces the host-resident one
                    self.host.free(child.host_slots)
                    child.page, child.host_slots = pages[i], None
                    self.num_host_pages -= 1
                    self.num_device_pages += 1
                elif child.page != pages[i]:
                    duplicates.append(pages[i])
            child.last_access = tick
            path.append(child)
            node = child
        if duplicates:
            self.allocator.free(duplicates)
        return path

    # --- eviction --------------------------------------------------------------------------

    def alloc(self, n: int) -> list[int]:
        """Allocate device pages, evicting unreferenced cached pages if needed."""
        short = n - self.allocator.num_free_pages
        if short > 0:
            self.evict(short)
        return self.allocator.alloc(n)

    @property
    def num_evictable_pages(self) -> int:
        return sum(1 for n in self._nodes() if n.page is not None and n.lock_ref == 0)

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` device pages, LRU leaves first; returns how many."""
        freed = 0
        while freed < num_pages:
            victims = [
                n
                for n in self._nodes()
                if n.page is not None
                and n.lock_ref == 0
                and all(c.page is None for c in n.children.values())
            ]
            if not victims:
                break
            victims.sort(key=lambda n: n.last_access)
            for n in victims:
                if freed >= num_pages:
                    break
                self._evict_one(n)
                freed += 1
        return freed

    def _evict_one(self, n: Node) -> None:
        slots = page_slots([n.page], self.page_size)
        host_slots = None
        if self.host is not None:
            if self.host.num_free_pages == 0:
                self._drop_host_leaves(1)
            try:
                host_slots = self.host.backup(slots)
            except OutOfPages:
                host_slots = None
        self.allocator.free([n.page])
        self.num_device_pages -= 1
        n.page = None
        if host_slots is not None:
            n.host_slots = host_slots
            self.num_host_pages += 1
            self.demoted_pages += 1
        else:
            self._remove_subtree(n)

    def _drop_host_leaves(self, count: int) -> None:
        leaves = [n for n in self._nodes() if n.page is None and not n.children and n.lock_ref == 0]
        leaves.sort(key=lambda n: n.last_access)
        for n in leaves[:count]:
            self._remove_subtree(n)

    def _remove_subtree(self, n: Node) -> None:
        """Detach `n` (no device pages below it) and free its host copies."""
        for c in list(n.children.values()):
            self._remove_subtree(c)
        if n.host_slots is not None:
            self.host.free(n.host_slots)
            n.host_slots = None
            self.num_host_pages -= 1
        if n.parent is not None:
            n.parent.children.pop(n.key, None)

    def reset(self) -> None:
        """Drop everything not locked by a running request."""
        self.evict(self.num_device_pages)
        for n in list(self.root.children.values()):
            if n.page is None and n.lock_ref == 0:
                self._remove_subtree(n)

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())
