"""The engine's LoRA adapters (`--enable-lora`): which are served, by name; which the ranks
hold in host memory (at most `max_cpu_loras`, least recently used first out); and which sit
in the model's `max_loras` slots (`dsakv.models.lora.LoraSlots`), for rank 0's scheduler.

A running request pins its adapter's slot; a waiting one whose adapter is not resident is
admitted only once a slot is free or holds an adapter no running request uses (the least
recently used such slot is taken). Every request, waiting too, holds its adapter's weights
in host memory. Loading past `max_cpu_loras` evicts the least recently used adapter no
request holds, as vLLM's LRU cache of loaded adapters does: it stays served, and its files
are read again from its path by the next request naming it (vLLM's serving layer keeps an
adapter loaded over HTTP the same way: its request carries the path). Adapters requests
hold are never evicted: while they hold more than the cap, memory holds them all, and the
cap is met again as they end. An unloaded (or replaced) adapter stays with the requests
already on it, counted against the cap (new ones are refused by name), and is dropped on
every rank once the last has ended.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import count

from dsakv.errors import DsakvError


@dataclass(frozen=True)
class LoraRef:
    """A loaded adapter as its requests hold it: the engine's id for it (vLLM's lora_int_id,
    told in KV events; a new one for each load), its name, path and the digest of its
    files (the prefix cache's namespace: `Request.cache_key`)."""

    id: int
    name: str
    path: str
    digest: str


class LoraRegistry:
    def __init__(self, max_loras: int, max_cpu_loras: int | None) -> None:
        self.max_cpu_loras = max_cpu_loras
        self.loaded: dict[str, LoraRef] = {}  # served, by name (in host memory or evicted)
        # The adapters whose weights the ranks hold, least recently used first: the served
        # ones not evicted, and the unloaded ones requests still hold
        self.in_memory: dict[int, LoraRef] = {}
        self.held: dict[int, LoraRef] = {}  # the adapter of each request (by rid) not ended
        self.refs: Counter[int] = Counter()  # requests holding each adapter
        self.unloaded: dict[int, LoraRef] = {}  # dropped once no request holds them
        self.slots: list[LoraRef | None] = [None] * max_loras
        self.users: Counter[int] = Counter()  # running requests on each adapter
        self._last_use = [0] * max_loras
        self._clock = count(1)
        self._ids = count(1)

    def check_new(self, name: str) -> None:
        """Why an adapter cannot be loaded as `name`, if it cannot."""
        if not isinstance(name, str) or not name:
            raise DsakvError(
                f"a LoRA adapter's name must be a non-empty string, got {name!r}", "lora_name"
            )
        if name in self.loaded:
            raise DsakvError(f"LoRA adapter {name!r} is already loaded", "lora_name")

    def new_id(self) -> int:
        return next(self._ids)

    def resolve(self, name: str) -> LoraRef:
        ref = self.loaded.get(name)
        if ref is None:
            raise DsakvError(f"LoRA adapter {name!r} is not loaded", "lora_name")
        return ref

    def evicted(self, ref: LoraRef) -> bool:
        """Whether `ref`'s weights left host memory (read again before a request runs it)."""
        return ref.id not in self.in_memory

    def trim(self, keep: LoraRef | None = None) -> list[LoraRef]:
        """Evict adapters no request holds (but `keep`, just read and served: read first, so
        a load that fails evicts nothing), the least recently used first, until memory
        holds `max_cpu_loras`; the evicted, for the engine to drop on every rank. Held
        ones are never evicted: while requests in flight hold more adapters than that,
        memory holds them all, and the cap is met again as they end (`release`)."""
        cap = self.max_cpu_loras
        if cap is None:
            return []
        over = len(self.in_memory) - cap
        free = [r for r in self.in_memory.values() if not self.refs[r.id] and r != keep]
        gone = free[: max(over, 0)]
        for ref in gone:
            self._forget(ref)
        return gone

    def serve(self, ref: LoraRef) -> LoraRef | None:
        """`ref`, just read on every rank, served under its name, in place of the adapter
        loaded under it if any (`retire`); that one, where its weights go now."""
        old = self.loaded.get(ref.name)
        self.loaded[ref.name] = ref
        self.in_memory[ref.id] = ref
        return old if old is not None and self.retire(old) else None

    def unload(self, name: str) -> LoraRef | None:
        """Stop serving `name`; the adapter, where its weights go now (`retire`)."""
        ref = self.loaded.pop(name, None)
        if ref is None:
            raise DsakvError(f"LoRA adapter {name!r} is not loaded", "lora_name")
        return ref if self.retire(ref) else None

    def retire(self, ref: LoraRef) -> bool:
        """`ref` is served no more: kept while requests hold it, else forgotten; True when
        the ranks hold its weights and should drop them now."""
        if self.refs[ref.id]:
            self.unloaded[ref.id] = ref
            return False
        return self._forget(ref)

    def _forget(self, ref: LoraRef) -> bool:
        """`ref`'s weights leave host memory (and its slot); whether they were there."""
        self.slots = [None if r == ref else r for r in self.slots]
        return self.in_memory.pop(ref.id, None) is not None

    def hold(self, rid: int, ref: LoraRef) -> None:
        """Request `rid` on `ref` came in (its adapter stays until it ends)."""
        self.held[rid] = ref
        self.refs[ref.id] += 1
        self._touch(ref)

    def release(self, rid: int) -> list[LoraRef]:
        """Request `rid` ended (once or again); the adapters whose weights the engine drops
        now on every rank: its own where it was unloaded and this was its last request,
        and those `max_cpu_loras` evicts once it no longer holds its own."""
        ref = self.held.pop(rid, None)
        if ref is None:
            return []
        self._touch(ref)
        self.refs[ref.id] -= 1
        if self.refs[ref.id] > 0:
            return []
        del self.refs[ref.id]
        gone = self.unloaded.pop(ref.id, None)
        if gone is not None:
            self._forget(gone)
        return ([] if gone is None else [gone]) + self.trim()

    def _touch(self, ref: LoraRef) -> None:
        """`ref` was used: the most recently used in host memory."""
        if self.in_memory.pop(ref.id, None) is not None:
            self.in_memory[ref.id] = ref

    # --- slots (the scheduler's) ----------------------------------------------------------

    def can_run(self, ref: LoraRef | None) -> bool:
        """Whether a request on `ref` may start running now (a slot for its adapter)."""
        return ref is None or ref in self.slots or self._free_slot() is not None

    def start(self, ref: LoraRef | None) -> None:
        """A request on `ref` starts running (`can_run` said it may): its adapter's slot."""
        if ref is None:
            return
        if ref not in self.slots:
            slot = self._free_slot()
            assert slot is not None, "start without can_run"
            self.slots[slot] = ref
        self.users[ref.id] += 1
        self._last_use[self.slots.index(ref)] = next(self._clock)

    def stop(self, ref: LoraRef | None) -> None:
        """A running request on `ref` stopped (finished or retracted): its slot may go."""
        if ref is not None:
            self.users[ref.id] -= 1

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used one no running request needs."""
        free = [s for s, r in enumerate(self.slots) if r is None or not self.users[r.id]]
        empty = [s for s in free if self.slots[s] is None]
        return (empty or sorted(free, key=self._last_use.__getitem__) or [None])[0]

    def step(self, refs: list[LoraRef | None]) -> tuple[tuple[int, ...], list[int]] | None:
        """A step's LoRA table for the model (`LoraSlots.prepare`): the adapter id in each
        slot and each request's slot (-1: base); None when no request of it has one. The
        slots it uses are the most recently used."""
        if all(r is None for r in refs):
            return None
        tick = next(self._clock)
        slot_of = [-1 if r is None else self.slots.index(r) for r in refs]
        for s in set(slot_of) - {-1}:
            self._last_use[s] = tick
        return tuple(0 if r is None else r.id for r in self.slots), slot_of


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's `LoRARequest` for `LLM.generate` / `LLM.chat`: the adapter at `lora_path`,
    loaded by its `lora_name` on first use (`lora_int_id`: vLLM's id, checked, not used:
    the engine numbers its loads)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise DsakvError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise DsakvError(f"lora_int_id must be an integer, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise DsakvError(f"lora_int_id must be > 0, got {self.lora_int_id}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise DsakvError(f"lora_path must be a non-empty string, got {self.lora_path!r}")
