"""Radix prefix cache over page-aligned token sequences, with an optional host tier.

Each node is one full page of tokens: its key is that page's token ids, its value the
device page holding their KV (latent and, for layers that own it, index-K — a page is the
unit the pools store both in). Unreferenced pages are evicted least-recently-used first;
with a host tier they are demoted to host memory and promoted back on a hit.

Each node also carries `hash`, a digest of every token from the start of the sequence to
the end of its page (a hash chain over pages): the name of that page's KV anywhere outside
this tree, e.g. in the L3 storage tier (`dsakv.engine.l3`), which this cache tells about
pages it adopts (`adopted`) and pages about to leave it for good (`leaving`).

A request's `cache_salt` (vLLM's; SGLang's `extra_key`) picks the tree it shares: each salt
has its own root, whose hash starts the chain (`root_hash`), so requests with different
salts (or one salted, one not) never share a page: not on the device, not in the host
tier, not in L3, whose keys are the chain's hashes. A LoRA request's tree is its salt's
and its adapter's (`LoraNamespace`; `Request.cache_key` makes the key).

With KV cache events on (`dsakv.engine.kv_events`), `events` collects what a router is
told: pages stored and removed, on the device ("GPU") or the host tier ("CPU"), and a
clear.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dsakv.memory.allocator import OutOfPages, PageAllocator, page_slots
from dsakv.memory.host import HostPool

from .kv_events import CLEARED, MEDIUM_CPU, MEDIUM_GPU, REMOVED, STORED

if TYPE_CHECKING:  # (l3 imports this module)
    from .l3 import L3Cache

_clock = itertools.count()
ROOT_HASH = b"\0" * 16


@dataclass(frozen=True)
class LoraNamespace:
    """A LoRA request's tree: its salt and its adapter's name and digest (of its files),
    not the adapter's engine id (told in KV events): the same adapter loaded again, or
    after a restart, finds its L3 pages; other weights under its name do not."""

    salt: str | None
    name: str
    digest: str
    id: int = field(default=0, compare=False)


# A tree's key: a request's `cache_salt`, or its `LoraNamespace` (`Request.cache_key`)
CacheKey = str | LoraNamespace | None


def root_hash(salt: CacheKey) -> bytes:
    """The hash a chain starts from: `ROOT_HASH` unsalted (L3 keys stored before salts
    existed still match), else a digest of the salt (and the adapter)."""
    if salt is None:
        return ROOT_HASH
    if isinstance(salt, LoraNamespace):
        data = b"dsakv-lora\0" + json.dumps([salt.salt, salt.name, salt.digest]).encode()
    else:
        data = b"dsakv-cache-salt\0" + salt.encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).digest()[:16]


def page_hash(parent: bytes, key: Sequence[int]) -> bytes:
    """The chain link: 16 bytes naming a page by its tokens and every token before them."""
    return hashlib.sha256(parent + array("q", key).tobytes()).digest()[:16]


def chain_hashes(tokens: Sequence[int], page_size: int, start: int, stop: int, parent: bytes):
    """Hashes of pages `start..stop-1` of `tokens`, given the hash of page `start - 1`."""
    out = []
    for i in range(start, stop):
        parent = page_hash(parent, tokens[i * page_size : (i + 1) * page_size])
        out.append(parent)
    return out


@dataclass(eq=False)
class Node:
    key: tuple[int, ...]
    parent: Node | None
    page: int | None = None  # device page, or None while the KV lives on the host
    host_slots: torch.Tensor | None = None
    hash: bytes = ROOT_HASH  # chain hash of the tokens from the start through this page
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = field(default_factory=lambda: next(_clock))
    stale: bool = False  # out of the tree since `retire`: freed when its last lock goes
    lora: tuple[int, str] | None = None  # its adapter (id, name) as stored, for KV events


@dataclass(eq=False)
class Root(Node):
    """A tree's root (no page): `hash` is `root_hash(ns)`, `ns` its key in `roots`; the
    salt itself goes out with its first pages' KV cache events, for routers that hash
    tokens themselves."""

    ns: CacheKey = None

    @property
    def salt(self) -> str | None:
        return self.ns.salt if isinstance(self.ns, LoraNamespace) else self.ns


class PrefixCache:
    """Matches, locks, inserts and evicts cached pages; owns the pages it holds."""

    def __init__(
        self, allocator: PageAllocator, host: HostPool | None = None, l3: L3Cache | None = None
    ) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.host = host
        self.root = Root((), None)  # the unsalted tree's; a salted one's is in `roots`
        self.roots: dict[CacheKey, Root] = {None: self.root}  # by salt (`CacheKey`)
        self.num_device_pages = 0  # pages the tree holds on the device
        self.num_host_pages = 0
        self.demoted_pages = 0  # to the host tier on eviction; promoted: back on a hit
        self.promoted_pages = 0
        self.evicted_pages = 0  # device pages evicted: demoted, or dropped (SGLang's evicted)
        self.l3 = l3  # the storage tier, told about pages coming and going
        # Weights the KV is computed with: `retire` counts each update; a request's KV from
        # an earlier epoch (`Request.kv_epoch`) never joins the tree.
        self.epoch = 0
        # KV cache events since the engine last published them (None: events off)
        self.events: list[tuple] | None = None

    # --- lookups ---------------------------------------------------------------------------

    def match(self, tokens: list[int], max_pages: int, salt: CacheKey = None) -> list[Node]:
        """Nodes for the longest cached page-aligned prefix of `tokens` (≤ `max_pages`) in
        the tree of `salt` (a request's `cache_key`)."""
        node, out, tick = self.roots.get(salt), [], next(_clock)
        if node is None:
            return out
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
            if n.stale and not n.lock_ref:
                self.allocator.free([n.page])
                n.page = None
                self.num_device_pages -= 1

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
            self._removed(n, MEDIUM_CPU)
            self._stored(n, MEDIUM_GPU)

    # --- insertion -------------------------------------------------------------------------

    def insert(
        self,
        tokens: list[int],
        pages: list[int],
        start: int = 0,
        salt: CacheKey = None,
    ) -> list[Node]:
        """Adopt the full pages of `tokens` into the tree of `salt` (a request's
        `cache_key`); pages already cached are freed as duplicates.

        `pages[i]` holds tokens of page i; pages before `start` are already tree nodes (the
        caller's locked prefix). Returns the path of nodes covering every full page.
        """
        ps = self.page_size
        # The adapter KV events tell for the pages stored now: the inserting request's
        # load of it (the tree outlives a load: an unload and load again keep its pages)
        lora = (salt.id, salt.name) if isinstance(salt, LoraNamespace) else None
        if salt not in self.roots and len(tokens) >= ps:  # (its hash: once, for its tree)
            self.roots[salt] = Root((), None, hash=root_hash(salt), ns=salt)
        node, path, tick = self.roots.get(salt), [], next(_clock)
        duplicates: list[int] = []
        for i in range(len(tokens) // ps):
            key = tuple(tokens[i * ps : (i + 1) * ps])
            child = node.children.get(key)
            if child is None:
                child = Node(key, node, pages[i], hash=page_hash(node.hash, key), lora=lora)
                node.children[key] = child
                self.num_device_pages += 1
                self._stored(child, MEDIUM_GPU)
                if self.l3 is not None:
                    self.l3.adopted(child)
            elif i >= start:
                if child.page is None:  # our copy replaces the host-resident one
                    self.host.free(child.host_slots)
                    child.page, child.host_slots, child.lora = pages[i], None, lora
                    self.num_host_pages -= 1
                    self.num_device_pages += 1
                    self._removed(child, MEDIUM_CPU)
                    self._stored(child, MEDIUM_GPU)
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
        """Demote `n`'s device page to the host tier, or drop it with its subtree (no host
        tier, or no room there); either way one device page evicted."""
        self.evicted_pages += 1
        slots = page_slots([n.page], self.page_size)
        host_slots = None
        if self.host is not None:
            if self.host.num_free_pages == 0:
                self._drop_host_leaves(1)
            try:
                host_slots = self.host.backup(slots)
            except OutOfPages:
                host_slots = None
        if host_slots is None:  # leaves the tree for good (L3 gets its last copy)
            self._drop_subtree(n)
            return
        self.allocator.free([n.page])
        self.num_device_pages -= 1
        n.page = None
        n.host_slots = host_slots
        self.num_host_pages += 1
        self.demoted_pages += 1
        self._removed(n, MEDIUM_GPU)
        self._stored(n, MEDIUM_CPU)

    def free_host_pages(self, pages: int) -> None:
        """Drop the least recently used host-only pages until `pages` host pages are free,
        or nothing unlocked is left to drop; none when the host tier is smaller than that."""
        if pages > self.host.allocator.num_pages:
            return
        while self.host.num_free_pages < pages:
            before = self.host.num_free_pages
            self._drop_host_leaves(pages - before)
            if self.host.num_free_pages == before:
                return

    def _drop_host_leaves(self, count: int) -> None:
        leaves = [n for n in self._nodes() if n.page is None and not n.children and n.lock_ref == 0]
        leaves.sort(key=lambda n: n.last_access)
        for n in leaves[:count]:
            self._drop_subtree(n)

    def reset(self) -> None:
        """Drop everything not locked by a running request, device pages and host copies
        alike. Nothing is demoted to the host on the way out (SGLang's /flush_cache and
        vLLM's /reset_prefix_cache drop, they do not offload); L3 still gets each page's
        last copy (`leaving`), as on eviction. Emptied, the cache tells one clear, not
        each page."""
        mark = len(self.events) if self.events is not None else 0
        stack = [n for r in list(self.roots.values()) for n in r.children.values()]
        while stack:
            n = stack.pop()
            if n.lock_ref:
                stack.extend(n.children.values())
            else:
                self._drop_subtree(n)  # nothing below is locked: a lock covers a root path
        if next(self._nodes(), None) is None:
            self._cleared(mark)

    def retire(self) -> None:
        """`reset` for a weight update: the pages requests still lock (paused ones', their KV
        the old weights') stay theirs but leave the tree too, so that no request admitted
        from now on matches them; each is freed when its last lock goes. Nothing reaches
        L3, which takes no update under paused requests."""
        mark = len(self.events) if self.events is not None else 0
        self.reset()
        stack = list(self._nodes())  # (all locked: `reset` left no other)
        for n in stack:
            n.stale = True
        self.root.children = {}
        self.roots = {None: self.root}
        self.epoch += 1
        self._cleared(mark)

    def discard(self, nodes: list[Node]) -> None:
        """Take a failed request's own nodes (`nodes`, a path's tail) out of the tree, their
        KV not to be served (it may hold the NaN that failed it), deepest first, stopping
        at one another request holds or extends; L3 takes back what write-through stored
        of them (an earlier prefill chunk's pages: `L3Cache.withdraw`)."""
        for n in reversed(nodes):
            if n.lock_ref or n.children or n.stale or n.page is None:
                return
            if self.l3 is not None:
                self.l3.withdraw(n)
            self._drop_subtree(n, last_copy=False)

    def _drop_subtree(self, top: Node, last_copy: bool = True) -> None:
        """Detach `top` with every node below it (none locked), freeing their device and host
        pages; each reaches L3 first (`leaving`: its last copy, unless not `last_copy`),
        parents before children."""
        stack = [top]
        while stack:
            n = stack.pop()
            if self.l3 is not None and last_copy:
                self.l3.leaving(n)
            if n.page is not None:
                self.allocator.free([n.page])
                n.page = None
                self.num_device_pages -= 1
                self._removed(n, MEDIUM_GPU)
            if n.host_slots is not None:
                self.host.free(n.host_slots)
                n.host_slots = None
                self.num_host_pages -= 1
                self._removed(n, MEDIUM_CPU)
            stack.extend(n.children.values())
            n.children = {}
        parent = top.parent
        if parent is not None:
            parent.children.pop(top.key, None)
            if not parent.children and isinstance(parent, Root) and parent is not self.root:
                self.roots.pop(parent.ns, None)  # a salt's last page: its root goes too

    # --- KV cache events (`dsakv.engine.kv_events`) ----------------------------------------

    def _stored(self, n: Node, medium: str) -> None:
        if self.events is not None:
            p = n.parent
            lora = () if n.lora is None else (n.lora,)  # (its adapter's, in a LoRA tree)
            if isinstance(p, Root):  # a tree's first page: no parent, the tree's salt
                self.events.append((STORED, medium, n.hash, None, n.key, p.salt, *lora))
            else:
                self.events.append((STORED, medium, n.hash, p.hash, n.key, None, *lora))

    def _removed(self, n: Node, medium: str) -> None:
        if self.events is not None:
            self.events.append((REMOVED, medium, n.hash))

    def _cleared(self, mark: int) -> None:
        """Everything left the tree: the events since `mark` (its pages' removals) become
        one clear."""
        if self.events is not None:
            del self.events[mark:]
            self.events.append((CLEARED,))

    def _nodes(self):
        stack = [n for r in self.roots.values() for n in r.children.values()]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())
