"""`L3Cache`: the storage tier under the prefix cache (device pages L1, host tier L2, storage
L3), so a prefix computed once is reused after a restart and by other engines.

Writes. The step loop only snapshots page bytes (`PageRows.read_pages`: the layout's
bytes, elided, as `DSAKVPool.read_pages` gives them) and queues them; a writer thread
checksums and stores them. Which pages:

- `write_through` (default): every page the prefix cache adopts (a prefill chunk's full
  pages, a finished request's pages), snapshotted at the end of the step, once the MTP
  draft layer's KV for those positions is written too;
- `write_back`: only pages leaving the cache for good: evicted from the host tier, or
  from the device when there is no host tier (or it is full);
- both: pages the cache still holds when the engine closes (bounded by a timeout).

A request the model failed (a NaN: `Request.model_fault`) may have had earlier prefill
chunks' pages written through: they are deleted as it ends (`withdraw`), after their write
(a delete is never dropped: with the queue full, the step waits for the writer's next).

A page already stored or queued (known by its hash) is not copied again; a full write
queue drops the page (counted), it never blocks the step. A page's key is its chain hash
(`prefix_cache`), which starts from its request's `cache_salt` (`root_hash`): a salted
prefix is never found by a lookup of another salt, or of none.

Reads. When a request is queued, its full prompt pages beyond the device/host prefix
match are looked up in order by a reader thread, which stops at the first page that is
missing or corrupt and keeps the verified payloads. The request is admitted once that
lookup is done, or at its deadline (`prefetch_timeout_s`) with the pages read so far; while
it waits, running requests keep stepping, and only an otherwise idle engine blocks on it.
Admission writes the payloads into the request's own pages and counts them computed, so
they join the prefix cache like any prefill.

Ranks. Under TP and pipeline stages rank 0's tier serves them all, through `PageRows`
(the model runner): a snapshot is the whole model's page, its pool's bytes (every TP rank's
is a replica) and each later stage's of its own layers; the pages it reads reach every
rank's pool as it writes them, before any step reads them. Under DP attention each rank
schedules its own requests and keeps a tier of its own over the one store.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from dsakv.memory.layout import CacheLayout
from dsakv.memory.storage import (
    CorruptObject,
    StorageBackend,
    StorageConfig,
    StorageError,
    decode_object,
    encode_object,
    make_backend,
    object_key,
    page_hash_of,
    start_mooncake_master,
)
from dsakv.procs import stop_process

from .prefix_cache import Node, chain_hashes

log = logging.getLogger(__name__)

_KNOWN_MAX = 1 << 20  # page hashes remembered as stored (16 B each)
_WRITE_QUEUE_BYTES = 256 << 20  # snapshots waiting for the writer, at most
_CLOSE_BATCH = 64  # pages read at once while closing


class PageRows(Protocol):
    """Whole pages as the layout's bytes, uint8 `[pages, bytes a page]` on the CPU: every
    stage's layers, side by side (`ModelRunner`); rows written reach every rank's pool."""

    def read_pages(self, pages: Sequence[int], host: bool = False) -> torch.Tensor: ...

    def write_pages(self, pages: Sequence[int], rows: torch.Tensor) -> None: ...


@dataclass
class L3Stats:
    """Counters for /metrics (`l3_*` in `Engine.counters`); updated from several threads."""

    hits: int = 0  # pages loaded from storage into the pool
    hit_tokens: int = 0
    misses: int = 0  # lookups that stopped at a page with no usable object
    lookups: int = 0
    bytes_read: int = 0  # payload bytes read and verified
    bytes_written: int = 0  # payload bytes stored (the layout's bytes per page, per page)
    pages_written: int = 0
    corrupt_objects: int = 0
    write_failures: int = 0  # refused by the store (full, too large) or store down
    writes_dropped: int = 0  # the write queue was full
    prefetch_timeouts: int = 0
    errors: int = 0  # store unreachable, or a write failed (disk full, read-only)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self, k, getattr(self, k) + v)


@dataclass(eq=False)
class _Lookup:
    """One request's read-ahead: pages `first..first+len(hashes)-1` of its prompt."""

    hashes: list[bytes]
    first: int
    deadline: float
    payloads: list[torch.Tensor] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    limit: int | None = None  # pages usable, fixed when the step loop stops waiting

    def usable(self) -> list[torch.Tensor]:
        return self.payloads[: self.limit if self.limit is not None else len(self.payloads)]


class L3Cache:
    """Storage tier of one scheduler (rank 0 under TP, each rank under DP attention):
    snapshots, lookups, counters."""

    def __init__(
        self,
        config: StorageConfig,
        backend: StorageBackend,
        pages: PageRows,
        layout: CacheLayout,
        num_pages: int,
        namespace: bytes,
        master: Any = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.pages = pages  # the pools' pages as the whole model's bytes
        self.num_pages = num_pages  # the device pool's
        self.namespace = namespace
        self.page_size = layout.page_size
        self.page_bytes = layout.bytes_per_page  # (every layer's, every stage's)
        self.write_through = config.write_policy == "write_through"
        self.master = master  # a mooncake_master this engine started, stopped on close
        self.stats = L3Stats()
        self._writes: queue.Queue = queue.Queue(max(4, _WRITE_QUEUE_BYTES // self.page_bytes))
        self._reads: queue.Queue = queue.Queue()
        self._lookups: dict[int, _Lookup] = {}  # by request id
        self._known: OrderedDict[bytes, None] = OrderedDict()  # stored or queued hashes
        self._adopted: list[Node] = []
        self._lock = threading.Lock()
        self._last_warning = 0.0
        self._closed = False
        self._threads = [
            threading.Thread(target=self._write_loop, name="dsakv-l3-write", daemon=True),
            threading.Thread(target=self._read_loop, name="dsakv-l3-read", daemon=True),
        ]
        for t in self._threads:
            t.start()

    @classmethod
    def create(
        cls,
        config: StorageConfig,
        pages: PageRows,
        layout: CacheLayout,
        num_pages: int,
        namespace: bytes,
    ) -> L3Cache:
        """The configured backend (starting a local Mooncake master if asked)."""
        master = None
        if config.start_master:
            master = start_mooncake_master(config.mooncake_master)
        try:
            return cls(config, make_backend(config), pages, layout, num_pages, namespace, master)
        except BaseException:
            if master is not None:
                stop_process(master)
            raise

    # --- writes (step loop side) ------------------------------------------------------------

    def adopted(self, node: Node) -> None:
        """The prefix cache took a new page; write-through snapshots it in `flush`."""
        if self.write_through and not self._is_known(node.hash):
            self._adopted.append(node)

    def leaving(self, node: Node) -> None:
        """A page leaves the prefix cache for good (evicted from the host tier, or from the
        device with no room on the host): snapshot it now, before its page is reused."""
        if self._is_known(node.hash):
            return
        if node.page is not None:
            self._enqueue(node.hash, self.pages.read_pages([node.page])[0])
        elif node.host_slots is not None:
            page = int(node.host_slots[0]) // self.page_size
            self._enqueue(node.hash, self.pages.read_pages([page], host=True)[0])

    def withdraw(self, node: Node) -> None:
        """A failed request's page leaves the cache, its KV not to be served (it may hold
        the NaN that failed it): its write-through copy, stored or queued, is deleted (the
        one writer takes the delete after the write). One adopted this step is not copied:
        its `page` is gone by `flush`."""
        if self._closed or not self._is_known(node.hash):
            return
        self._forget(node.hash)
        self._writes.put((node.hash, None))  # (a full queue: waits for the writer's next)

    def flush(self) -> None:
        """End of a step: snapshot the pages adopted during it (their KV, the draft layer's
        included, is complete now)."""
        nodes, self._adopted = self._adopted, []
        nodes = [n for n in nodes if not self._is_known(n.hash)]
        on_device = [n for n in nodes if n.page is not None]
        if on_device:
            rows = self.pages.read_pages([n.page for n in on_device])
            for n, row in zip(on_device, rows):
                self._enqueue(n.hash, row)
        for n in nodes:
            if n.page is None:
                self.leaving(n)  # evicted within the step; `leaving` skips it if saved

    def _enqueue(self, page_hash: bytes, row: torch.Tensor, timeout: float | None = None) -> bool:
        self._remember(page_hash)
        try:
            if timeout is None:
                self._writes.put_nowait((page_hash, row))
            else:
                self._writes.put((page_hash, row), timeout=max(timeout, 0.001))
        except queue.Full:
            self.stats.add(writes_dropped=1)
            self._forget(page_hash)
            return False
        return True

    # --- reads (step loop side) -------------------------------------------------------------

    def prefetch(
        self, rid: int, tokens: Sequence[int], matched: int, parent: bytes, max_pages: int
    ) -> None:
        """Start looking up pages `matched..max_pages-1` of `tokens` (the first `matched`
        are in the prefix cache; `parent` is the hash of the last of them). With none to
        look up, the lookup only records where it starts (`starts_at`)."""
        self.cancel(rid)
        stop = min(max_pages, matched + self.num_pages)
        if self._closed:
            return
        hashes = chain_hashes(tokens, self.page_size, matched, stop, parent)
        lookup = _Lookup(hashes, matched, time.monotonic() + self.config.prefetch_timeout_s)
        self._lookups[rid] = lookup
        if not hashes:
            lookup.done.set()
            return
        self.stats.add(lookups=1)
        self._reads.put(lookup)

    def starts_at(self, rid: int) -> int | None:
        """The page request `rid`'s lookup starts at: the prefix cache held those before it
        (None: no lookup)."""
        lookup = self._lookups.get(rid)
        return None if lookup is None else lookup.first

    def ready(self, rid: int, idle: bool) -> bool:
        """Whether request `rid` may be admitted now. It waits for its lookup until the
        deadline; an `idle` engine (nothing running) blocks on it, a busy one steps on."""
        lookup = self._lookups.get(rid)
        if lookup is None or lookup.limit is not None or lookup.done.is_set():
            return True
        left = lookup.deadline - time.monotonic()
        if left > 0 and not idle:
            return False
        if left > 0:
            lookup.done.wait(min(left, threading.TIMEOUT_MAX))
        if not lookup.done.is_set():
            lookup.cancelled = True
            lookup.limit = len(lookup.payloads)
            self.stats.add(prefetch_timeouts=1)
        return True

    def pages_for(self, rid: int, matched: int) -> list[torch.Tensor]:
        """Verified payloads of the pages right after the first `matched` (call after
        `ready`); empty when the tree lost pages the lookup started after (the scheduler
        then looks again: `Scheduler._admit`)."""
        lookup = self._lookups.get(rid)
        if lookup is None or matched < lookup.first:
            return []
        return lookup.usable()[matched - lookup.first :]

    def admitted(self, rid: int, payloads: list[torch.Tensor], pages: list[int]) -> None:
        """The request got pages for its L3 prefix: write the payloads into them."""
        self._lookups.pop(rid, None)
        if payloads:
            self.pages.write_pages(pages, torch.stack(payloads))
            self.stats.add(hits=len(payloads), hit_tokens=len(payloads) * self.page_size)

    def cancel(self, rid: int) -> None:
        lookup = self._lookups.pop(rid, None)
        if lookup is not None:
            lookup.cancelled = True

    # --- bookkeeping ------------------------------------------------------------------------

    def _is_known(self, page_hash: bytes) -> bool:
        with self._lock:
            return page_hash in self._known

    def _remember(self, page_hash: bytes) -> None:
        with self._lock:
            self._known[page_hash] = None
            self._known.move_to_end(page_hash)
            if len(self._known) > _KNOWN_MAX:
                self._known.popitem(last=False)

    def _forget(self, page_hash: bytes) -> None:
        with self._lock:
            self._known.pop(page_hash, None)

    def _store_down(self, e: Exception) -> None:
        self.stats.add(errors=1)
        self._warn(f"L3 storage unavailable ({e}); serving on without it")

    def _warn(self, message: str) -> None:
        """`message`, at most once every 30 s: a store down or full fails every page."""
        now = time.monotonic()
        if now - self._last_warning > 30:
            self._last_warning = now
            log.warning("%s", message)

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write is done (a hand-off to another engine, the bench)."""
        deadline = time.monotonic() + timeout_s
        while self._writes.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def rename(self, namespace: bytes) -> None:
        """Store and look up under `namespace` from now on (new weights: the pages stored
        under the old one are another model's KV); call it drained."""
        with self._lock:
            self.namespace = namespace
            self._known.clear()

    def counters(self) -> dict[str, float]:
        s = self.stats
        with s._lock:
            out = {f"l3_{k}": v for k, v in vars(s).items() if not k.startswith("_")}
        out["l3_objects_evicted"] = self.backend.evicted
        out["l3_write_queue"] = self._writes.qsize()
        return out

    # --- worker threads ---------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            page_hash, row = item
            key = object_key(self.namespace, page_hash)
            if row is None:  # (`withdraw`)
                self._delete(key)
                self._writes.task_done()
                continue
            ok = stored = failed = False
            try:
                stored = self.backend.exists(key)  # another engine (or an earlier run) wrote it
                if stored:
                    self.backend.touch(key)
                else:
                    payload = memoryview(row.numpy())
                    ok = self.backend.put(key, encode_object(self.namespace, page_hash, payload))
            except StorageError as e:
                self._store_down(e)
                failed = True
            except Exception:  # noqa: BLE001 - a store bug must not end the writer
                log.exception("L3 write of %s failed", key)
                failed = True
            finally:
                self._writes.task_done()
            if ok:
                self.stats.add(pages_written=1, bytes_written=self.page_bytes)
            elif not stored:
                if not failed:
                    self._warn("L3 storage refused a page (full, or the page past its cap)")
                self.stats.add(write_failures=1)
                self._forget(page_hash)
            # Objects the store dropped to make room are no longer stored: a page still in
            # the prefix cache is written again when it leaves it, or at close (a prefix kept
            # hot on the device is never read from the store, so it was the first dropped).
            for evicted in self.backend.take_evicted():
                if (h := page_hash_of(evicted, self.namespace)) is not None:
                    self._forget(h)

    def _read_loop(self) -> None:
        while True:
            lookup = self._reads.get()
            if lookup is None:
                return
            try:
                self._read(lookup)
            except Exception:  # noqa: BLE001 - a store bug must not end the reader
                log.exception("L3 lookup failed")
            finally:
                lookup.done.set()

    def _read(self, lookup: _Lookup) -> None:
        for page_hash in lookup.hashes:
            if lookup.cancelled or time.monotonic() > lookup.deadline:
                return
            key = object_key(self.namespace, page_hash)
            try:
                blob = self.backend.get(key)
            except StorageError as e:
                self._store_down(e)
                self.stats.add(misses=1)
                return
            if blob is None:
                self.stats.add(misses=1)
                return
            try:
                payload = decode_object(blob, self.namespace, page_hash, self.page_bytes)
            except CorruptObject as e:
                log.warning("L3 object %s is corrupt (%s): deleted", key, e)
                self.stats.add(corrupt_objects=1, misses=1)
                self._forget(page_hash)
                self._delete(key)
                return
            lookup.payloads.append(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            self.stats.add(bytes_read=len(payload))
            self._remember(page_hash)

    def _delete(self, key: str) -> None:
        """Delete one object (from a worker thread)."""
        try:
            self.backend.delete(key)
        except StorageError as e:
            self._store_down(e)
        except Exception:  # noqa: BLE001 - a store bug must not end the worker
            log.exception("L3 delete of %s failed", key)

    # --- shutdown ---------------------------------------------------------------------------

    def close(self, cache: Any, timeout_s: float = 30.0) -> None:
        """Store what the prefix cache still holds (parents first), drain the queue, stop
        the threads and the backend (and a master this engine started). Bounded by
        `timeout_s`: whatever is not written by then is lost, never half-written. The
        threads stop even where reading the pages failed (a rank gone)."""
        if self._closed:
            return
        deadline = time.monotonic() + timeout_s
        try:
            self._store_cached(cache, deadline)
        finally:
            self._stop(deadline)

    def _store_cached(self, cache: Any, deadline: float) -> None:
        self.flush()
        # Least recently used first (a parent before its children), the stored ones only
        # marked used where that orders the store's evictions: where it must drop some to
        # stay under its cap, it drops the coldest and keeps whole chains of the hottest.
        nodes, todo = [], deque(n for r in cache.roots.values() for n in r.children.values())
        while todo:
            nodes.append(todo.popleft())
            todo.extend(nodes[-1].children.values())
        # A stored page goes with its row too: the writer only marks it used, or writes it
        # again where the store no longer has it (another engine sharing it dropped it).
        # Read a batch at a time (under pipeline stages each read is a message to them all).
        todo = [
            n
            for n in sorted(nodes, key=lambda n: n.last_access)
            if (n.page is not None or n.host_slots is not None)
            and (self.backend.evicts_by_use or not self._is_known(n.hash))
        ]
        for lo in range(0, len(todo), _CLOSE_BATCH):
            if time.monotonic() >= deadline:
                break
            batch = todo[lo : lo + _CLOSE_BATCH]
            rows = self._rows(batch)
            for n in batch:
                if not self._enqueue(n.hash, rows[id(n)], timeout=deadline - time.monotonic()):
                    return

    def _rows(self, nodes: list[Node]) -> dict[int, torch.Tensor]:
        """Each node's page bytes (by `id`), from the device pool or the host tier: one
        read each."""
        device = [n for n in nodes if n.page is not None]
        host = [n for n in nodes if n.page is None]
        out: dict[int, torch.Tensor] = {}
        if device:
            out.update(zip(map(id, device), self.pages.read_pages([n.page for n in device])))
        if host:
            pages = [int(n.host_slots[0]) // self.page_size for n in host]
            out.update(zip(map(id, host), self.pages.read_pages(pages, host=True)))
        return out

    def abandon(self, timeout_s: float = 5.0) -> None:
        """Stop the threads, the backend and a master this engine started, storing nothing:
        for an engine whose start failed after its tiers were made (it has no prefix cache
        to store, and a started master would hold its port against a retry)."""
        if not self._closed:
            self._stop(time.monotonic() + timeout_s)

    def _stop(self, deadline: float) -> None:
        self._closed = True
        for rid in list(self._lookups):
            self.cancel(rid)
        self._reads.put(None)
        try:
            self._writes.put(None, timeout=max(0.001, deadline - time.monotonic()))
        except queue.Full:
            log.warning("L3: %d page writes still queued at shutdown", self._writes.qsize())
        for t in self._threads:
            t.join(max(0.1, deadline - time.monotonic()))
        try:
            self.backend.close()
        finally:
            if self.master is not None:
                stop_process(self.master)


def zero_counters() -> dict[str, float]:
    """`L3Cache.counters()` of an engine without a storage tier."""
    out = {f"l3_{k}": 0 for k in vars(L3Stats()) if not k.startswith("_")}
    return {**out, "l3_objects_evicted": 0, "l3_write_queue": 0}
