"""Sleep mode: an engine's memory (weights, KV pool, CUDA graphs) given to a colocated
trainer and back (SGLang's release/resume_memory_occupation, vLLM's sleep and wake_up), as
`Engine`'s mixin."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import reprlib
from collections.abc import Iterable
from typing import Any

import torch

from dsakv.errors import DsakvError, is_int, is_list
from dsakv.memory.capacity import GIB
from dsakv.memory.release import Stash

from .ranks import gather_outcome, said

log = logging.getLogger(__name__)


class EngineAsleep(DsakvError, RuntimeError):
    """A request while the engine's memory is released (sleep mode), or its discarded
    weights are not all loaded again: a `DsakvError` (one line, no traceback), and a
    `RuntimeError`, which the server answers 503 as a stopped engine's (try again later)."""


# What `Engine.release_memory_occupation` frees (SGLang's GPU memory types); vLLM's sleep
# mode frees the first two.
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


# This mixin's calls that every rank runs (`Engine.every_rank_call`)
SLEEP_CALLS = ("release_memory_here", "resume_memory_here")


class SleepMixin:
    """`Engine`'s sleep mode. Its host holds the state (`released`, `_stashes`, `_unloaded`,
    made by `Engine.__init__` and written here only: a weight update tells `_note_loaded`
    what it loaded) and what is released (`model`, `pool`, `cache`, `l3`, `runner`) on
    `device`, says whether requests hold memory (`has_unfinished`, `paused`, `scheduler`)
    and runs calls on every rank (`_on_every_rank`, `parallel`)."""

    def release_memory_occupation(
        self, tags: Iterable[str] | None = None, discard_weights: bool = False
    ) -> None:
        """SGLang's /release_memory_occupation (vLLM's /sleep: `sleep`), on every rank: free
        what `tags` name (None or none: all of `MEMORY_TAGS`) for a trainer sharing the
        device. "kv_cache": the pool's buffers, the prefix cache dropped first so that no
        page refers to them (its host-tier copies too; L3 keeps its pages); "weights": the
        model's parameters and buffers, copied to host memory first to come back bit for bit,
        or with `discard_weights` (vLLM's level 2) the parameters dropped: they come back as
        zeros, and nothing is generated until weight updates have loaded every one of them
        again (checkpoint tensor by tensor, in as many updates as the trainer likes); "cuda_graph":
        the captured decode graphs. Whatever holds the weights' or the pool's addresses (the
        graphs, the native CPU path's tables) goes with either, made again once both are
        back. Freed for real: the storage goes, not just a flag. A tag released already is
        left as it is. Refused while a request holds KV or waits to run (pause with mode
        "retract" first, and the paused requests may wait through it: they hold none); new
        requests are refused (`EngineAsleep`) until `resume_memory_occupation` brought every
        tag back."""
        tags = memory_tags(tags)
        if self.has_unfinished() and not self.paused:
            raise DsakvError(_HOLDING)
        outcome = self._on_every_rank("release_memory_here", tags, bool(discard_weights))
        if outcome is not None:
            raise DsakvError(outcome)

    def resume_memory_occupation(self, tags: Iterable[str] | None = None) -> None:
        """SGLang's /resume_memory_occupation (vLLM's /wake_up): bring back what `tags`
        name (None or none: all), on every rank: the weights as they were (or zeros, after
        `discard_weights`), the pool zeroed and its prefix cache empty; the decode graphs
        are captured again once weights and pool are both back (and the weights loaded).
        A tag that is not released is left as it is. A device that cannot hold it all (the
        trainer still holds its memory) is an error, nothing brought back on any rank."""
        outcome = self._on_every_rank("resume_memory_here", memory_tags(tags))
        if outcome is not None:
            raise DsakvError(outcome)

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode: level 1 frees the KV cache and moves the weights to host memory
        (`wake_up` brings them back bit for bit), level 2 frees both, the weights dropped
        (for a trainer that sends new ones after `wake_up`). `release_memory_occupation` of
        weights and kv_cache."""
        if not is_int(level) or level not in (1, 2):
            raise DsakvError(
                f"level must be 1 (the weights kept in host memory) or 2 (dropped), got {level!r}",
                "level",
            )
        self.release_memory_occupation(("weights", "kv_cache"), discard_weights=level == 2)

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """vLLM's: `resume_memory_occupation(tags)` (None: everything)."""
        self.resume_memory_occupation(tags)

    def is_sleeping(self) -> bool:
        """vLLM's: whether any tag is released (until every one is back)."""
        return bool(self.released)

    @property
    def asleep(self) -> bool:
        """Whether generation waits: memory released, or discarded weights not all loaded
        again (the server takes no step meanwhile: a retracted request waits it out)."""
        return bool(self.released) or self._unloaded is not None

    def check_awake(self) -> None:
        """`EngineAsleep` unless the engine can generate: nothing released, and the weights
        loaded again if discarded (on every rank)."""
        if self.released:
            raise EngineAsleep(
                f"the engine is asleep (its {', '.join(sorted(self.released))} memory released "
                "for a trainer): wake it first (/wake_up, /resume_memory_occupation; "
                "LLM.wake_up)"
            )
        if self._unloaded is not None:
            left = sorted(self._unloaded)
            which = (
                f"{len(left)} of this rank's weights, e.g. {', '.join(left[:2])}"
                if left
                else "another rank's weights"
            )
            raise EngineAsleep(
                f"the weights were discarded (sleep level 2) and not all loaded again "
                f"({which}): load them with /update_weights_from_disk, "
                "/update_weights_from_distributed or update_weights_from_tensor, every "
                "checkpoint tensor"
            )

    def release_memory_here(self, tags: tuple[str, ...], discard: bool) -> str | None:
        """This rank's part of `release_memory_occupation`, between steps, in two rounds
        whose outcomes every rank hears: (1) each checks it holds no request's KV; (2) each
        readies what `tags` name (the prefix cache dropped; the buffers, and the parameters
        unless `discard`, copied to the host); only if every rank could does each free its
        memory. None, or what refused it (alike on every rank)."""
        s = self.scheduler
        busy = _HOLDING if s.running or s.held or s.parked else None
        holding = gather_outcome(self.parallel, None, busy)
        if isinstance(holding, str):
            return holding
        new = [t for t in tags if t not in self.released]
        stashes: dict[str, list[Stash]] = {}
        why = None
        try:
            if "kv_cache" in new:
                self.cache.reset()  # (first: L3 gets each page's last copy, `leaving`)
                if self.l3 is not None and not self.l3.drain():
                    raise DsakvError("L3 storage did not take the cached pages in time")
                stashes["kv_cache"] = [Stash(self.pool.buffers(), keep=False)]
            if "weights" in new:
                params = Stash(self.model.parameters(), keep=not discard, huge_pages=True)
                slots = () if self.model.lora is None else self.model.lora.tensors()
                buffers = Stash([*self.model.buffers(), *slots], keep=True)  # (slots: adapters')
                stashes["weights"] = [params, buffers]
        except Exception as e:  # noqa: BLE001 - every rank hears it: none frees anything
            why = said(e)
        outcome = gather_outcome(self.parallel, None, why)
        if isinstance(outcome, str):
            return f"nothing was released: {outcome}"
        self._forget_addresses()
        for tag, stash in stashes.items():
            for part in stash:
                part.free()
            self._stashes[tag] = stash
        if discard and "weights" in stashes:
            from dsakv.models.loader import weight_parts

            self._unloaded = weight_parts(self.model)
        self.released.update(new)
        _give_back_memory(self.device)
        if self.parallel.is_driver and new:
            freed = sum(p.nbytes for stash in stashes.values() for p in stash)
            kept = " (weights discarded)" if discard and "weights" in stashes else ""
            log.info("released %s: %.2f GiB freed%s", ", ".join(new), freed / GIB, kept)
        return None

    def resume_memory_here(self, tags: tuple[str, ...]) -> str | None:
        """This rank's part of `resume_memory_occupation`: each brings its memory back; if
        any rank could not, every rank frees again what it brought back. None, or why not."""
        back = [t for t in tags if t in self._stashes]
        done: list[Stash] = []
        why = None
        try:
            for tag in back:
                for part in self._stashes[tag]:
                    part.restore()
                    done.append(part)
        except Exception as e:  # noqa: BLE001 - every rank hears it: all free it again
            why = said(e)
        outcome = gather_outcome(self.parallel, None, why)
        if isinstance(outcome, str):
            for part in done:
                part.free()
            _give_back_memory(self.device)
            return f"the memory was not brought back (is the trainer holding it?): {outcome}"
        for tag in back:
            del self._stashes[tag]
        self.released.difference_update(tags)
        self._capture_again()
        if self.parallel.is_driver and back:
            log.info("resumed %s", ", ".join(back))
        return None

    def _forget_addresses(self) -> None:
        """Drop what holds the weights' or the pool's addresses, which release moves: the
        decode graphs, the native CPU path's tables (made again on their next use), and the
        last step's outputs."""
        if self.runner.decode_graphs is not None:
            self.runner.decode_graphs.drop()
        self.model.forget_addresses()
        self.runner.last.clear()

    def _capture_again(self) -> None:
        """The decode graphs captured again, once everything they read is back: the weights
        (loaded, if they were discarded), the pool, and the graphs' own tag."""
        graphs = self.runner.decode_graphs
        if graphs is not None and not self.released and self._unloaded is None:
            graphs.capture_all()

    def _note_loaded(self, checked: Any) -> None:
        """After weights were discarded: cross off what an update loaded (a checkpoint: all
        of it; named tensors: their parts), and once every rank has it all, generate again."""
        if self._unloaded is None:
            return
        if isinstance(checked, list):  # (`loader.check_tensors`' pieces)
            for _, piece, _ in checked:
                left = self._unloaded.get(piece.target)
                if left is not None:
                    left.difference_update(piece.parts)
                    if not left:
                        del self._unloaded[piece.target]
        else:
            self._unloaded.clear()
        if not any(self.parallel.all_gather_objects(bool(self._unloaded))):
            self._unloaded = None
            self._capture_again()


_HOLDING = (
    "memory is released only with no request running or waiting: abort them "
    '(/abort_request, /pause_generation with mode "abort") or pause with mode "retract" '
    "(they give their KV back and wait) first"
)


def memory_tags(tags: Iterable[str] | None) -> tuple[str, ...]:
    """`tags` as `Engine.release_memory_occupation` takes them (SGLang's: None or none, all
    of `MEMORY_TAGS`), checked."""
    if tags is None:
        return MEMORY_TAGS
    if not is_list(tags) or not all(isinstance(t, str) for t in tags):
        raise DsakvError(
            f"tags must be a list of {', '.join(MEMORY_TAGS)}, got {reprlib.repr(tags)}", "tags"
        )
    bad = sorted(set(tags) - set(MEMORY_TAGS))
    if bad:
        raise DsakvError(
            f"unknown memory tag(s) {', '.join(map(repr, bad))}: the tags are "
            f"{', '.join(MEMORY_TAGS)}",
            "tags",
        )
    return tuple(t for t in MEMORY_TAGS if t in tags) or MEMORY_TAGS


def _give_back_memory(device: torch.device) -> None:
    """Hand freed memory back to whoever needs it next: the caching allocator's blocks to
    the driver on a GPU, the heap's free pages to the OS on a CPU (glibc keeps them:
    `keep_freed_memory`)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
