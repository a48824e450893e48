"""`HotBuffers`: HiSparse in the engine (DESIGN.md §13).

Every token's latent lives in host memory (`host[layer]`, one row per logical slot, the
stored bytes of the device pool's format); the device latent pool holds only device slots,
a second address space with its own page allocator: the whole prompt while a request is
prefilled, then its hot buffer of `device_buffer_size` slots and a reserved slot for each
token a step computes (1, or 1 + drafts under speculative decoding). Index-K stays on the
device for every logical token, on full layers only when elided: the indexer scores the
whole history.

A request's life, as the scheduler and the step drive it:

- `can_admit` / `admit`: latent pages for max(prompt, buffer_slots) positions, and the latent
  of prefix-cache hits copied in from the host (a hit's rows are on the host: every computed
  token is written there right after its step, `end_step`).
- Multi-token steps read and write its latent pages like the dense layout.
- Its first decode step (one token, or one verifying drafts: `begin_step`) shrinks it to
  its hot buffer: the first buffer pages stay, entry j holding position j; the rest go
  back. From then on each full layer's top-k is resolved against the buffer (hits stay,
  least recently used entries make room, misses are copied from the host) and the layers
  sharing that top-k replay the same copy list: the buffer state is per IndexShare group,
  the slots are the same in every layer. A verify's tokens run as decode rows of their own
  (`HotStep.decode_rows`); the union of their top-k is resolved at once, since one
  attention launch reads it.
- `free`: on finish, abort and retraction. A retracted request goes to the host tier if
  there is one (every computed token's latent is in the host rows) and comes back with what
  it computed as a prefix hit (`admit`), or, past what a prefill holds, as a PD decode
  request does (`resumes_detached`); without one it is recomputed: prefilled if the device
  holds its context, else its prompt prefilled and its outputs decoded again; a PD decode
  request whose prompt the device cannot hold ends instead, cut short, as
  `Engine._fail_unschedulable` says.

Under tensor (and expert) parallelism every rank holds a replica: the same device slots
and hot buffers of its own. The host latent is the same on every rank, so on one machine
the ranks map one (`machine_shared_empty`) and only rank 0 writes it (`end_step`; the
others read those rows in later steps, after the message that follows the write); across
machines each rank holds and writes its own.
Under pipeline parallelism each stage's hot buffers hold its own layers: their device and
host latent rows, and the state of each IndexShare group it holds a layer of (a stage's TP
ranks map one host latent, its layers'). A group whose full layer is an earlier stage's
gets that top-k with the hidden states (`dsakv.models.stages`) and the stage resolves it
against its own replica of the group's state: the same top-k against the same state, so
the replicas stay the same. Every stage takes every step, the MTP layer's too, so the
step clock and request state are every rank's.
Rank 0's admissions and releases go into `journal`, which the other ranks replay before
the step that follows them; each rank then runs `begin_step`, the resolves of its own
layers and `end_step` over the same step (`ModelRunner`). Rank 0's counters are the
engine's.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import NamedTuple

import torch

from dsakv.config import HiSparseConfig, LayerPlan
from dsakv.config.hisparse import shares_host_latent, writes_host_latent
from dsakv.distributed import ParallelState
from dsakv.distributed.shared_memory import machine_shared_empty
from dsakv.errors import ConfigError
from dsakv.kernels.hisparse_ops import bind_newest, init_buffers
from dsakv.memory.allocator import OutOfPages, PageAllocator, page_slots
from dsakv.memory.layout import CacheLayout
from dsakv.memory.pool import (
    DSAKVPool,
    allocation_failed,
    check_fits,
    page_lock,
    pinned_empty,
)

from .request import Request


def check_host_latent(layout: CacheLayout, num_pages: int) -> str:
    """Refuse a host latent of `num_pages` logical pages (every held layer's latent row of
    each of their tokens) past the machine's memory, as the pool and host tier are refused
    (`check_fits`; the engine has checked a node's host latents and tiers together,
    `Engine._check_host_memory`). Returns how a failed allocation's error begins."""
    need = num_pages * layout.page_size * layout.latent_bytes_per_token
    return check_fits(need, torch.device("cpu"), "HiSparse host latent")


@dataclass
class HotStats:
    """Counters for /metrics and the bench (rows are one token's latent in one layer)."""

    rows_to_device: int = 0  # host -> device latent rows of prefix hits (misses: on device)
    rows_to_host: int = 0  # device -> host latent rows (every computed token, every layer)
    resolves: int = 0  # (full layer, step) resolutions


class Take(NamedTuple):
    """A request takes `pages` device latent pages; its prefix hit's latent (logical
    `hit_slots`) comes in from the host; `on_host`: its prompt's latent arrives there (PD)."""

    rid: int
    pages: int
    hit_slots: torch.Tensor | None
    on_host: bool = False


class Free(NamedTuple):
    """A request gives its device latent pages and hot-buffer state back."""

    rid: int


@dataclass
class _Hot:
    pages: list[int] = field(default_factory=list)  # device latent pages
    row: int = -1  # hot-buffer state row (>= 0 once decoding)
    on_host: bool = False  # its computed latent is on the host only (a PD decode request)


_COUNTERS = (
    "hisparse_device_tokens_total",
    "hisparse_device_tokens_used",
    "hisparse_host_tokens_total",
    "hisparse_host_tokens_used",
    "hisparse_hot_buffers",
    "hisparse_hits",
    "hisparse_misses",
    "hisparse_resolves",
    "hisparse_rows_to_device",
    "hisparse_bytes_to_device",
    "hisparse_rows_to_host",
    "hisparse_bytes_to_host",
)


class HotBuffers:
    """The device latent slots, the host latent and every request's hot-buffer state.

    State is per (IndexShare group, request row): `buf_pos` (position each entry holds, −1
    empty) and `stamp` (recency); `buf_slot` (the entry's device slot) and `reserved` (the
    slots of the tokens a step computes past the buffer) are per request, the same in every
    layer. The ops that read and update them are the backend's (`hot_resolve`, `hot_copy`:
    torch or Triton).
    """

    def __init__(
        self,
        config: HiSparseConfig,
        pool: DSAKVPool,
        plan: LayerPlan,
        backend,
        device: torch.device,
        parallel: ParallelState,
    ) -> None:
        self.config, self.pool, self.backend, self.device = config, pool, backend, device
        ps, s = pool.page_size, config.device_buffer_size
        self.page_size, self.size, self.step_tokens = ps, s, config.step_tokens
        config.check_pool(pool.latent_pages, ps)
        self.buffer_pages = config.buffer_pages(ps)
        self.allocator = PageAllocator(pool.latent_pages, ps)
        # The layers this rank's pool holds (its pipeline stage's): target layers, then the
        # MTP layer (its own group: it runs its own indexer), whose forwards are steps of
        # their own (`begin_step(draft=True)`). A group is keyed by its full layer, which
        # may be an earlier stage's: then the top-k arrives with the hidden states and this
        # stage resolves it against its own replica of the group's state.
        layers = pool.layout.held_layers
        self.target_layers = tuple(i for i in layers if i < plan.num_layers)
        self.draft_layers = tuple(i for i in layers if i >= plan.num_layers)
        groups = {
            f: [i for i in layers if plan.topk_source(i) == f] for f in range(plan.num_total_layers)
        }
        self.groups = {f: g for f, g in groups.items() if g}
        self._group = {f: i for i, f in enumerate(self.groups)}
        # Requests whose release waits for the draft layer's catch-up over their last step
        # (`defer_free`)
        self.deferred: set[int] = set()
        # (by layer index; the host rows too)
        self.device_rows = {i: pool.latent_data(i).view(torch.uint8) for i in layers}
        width = self.device_rows[layers[0]].shape[1]
        # Under TP on one machine every rank's latent is a replica: a stage's ranks map one
        # host latent, which its TP rank 0 writes (`writes_host`); else each holds its own.
        self.shared_host = shared = shares_host_latent(parallel.config)
        self.writes_host = writes_host_latent(parallel.config, parallel.tp_rank)
        shape = (len(layers), pool.num_tokens, width)
        # (held: the page lock lasts as long as this tensor object, not its views)
        self._host_block = self._host_latent(pool, shape, device, parallel, shared)
        self.host = dict(zip(layers, self._host_block.view(shape).unbind(0), strict=True))
        self._all_rows = (list(self.host.values()), list(self.device_rows.values()))
        # token and page moves (host tier, L3, KV transfer) read and write the latent here
        pool.attach_host_latent(self.host, writes=self.writes_host)
        rows = max(1, pool.latent_pages // self.buffer_pages)
        g = len(self.groups)
        self.buf_pos = torch.full((g, rows, s), -1, dtype=torch.int32, device=device)
        self.stamp = torch.full((g, rows, s), -1, dtype=torch.int64, device=device)
        # int32 positions and slots, int64 recency: the dtypes the compile check builds
        self.buf_slot = torch.zeros(rows, s, dtype=torch.int32, device=device)
        self.reserved = torch.zeros(rows, config.step_tokens, dtype=torch.int32, device=device)
        self._free_rows = list(range(rows - 1, -1, -1))
        self._reqs: dict[int, _Hot] = {}
        self._clock = 0
        self.stats = HotStats()
        # hits, misses, rows copied for misses: summed on the device, read by `counters`
        self._counts = torch.zeros(3, dtype=torch.int64, device=device)
        # Rank 0's admissions and releases (`Take`, `Free`), for the other TP ranks'
        # replicas (None: one rank, or a rank that replays)
        self.journal: list[Take | Free] | None = None

    @staticmethod
    def _host_latent(
        pool: DSAKVPool,
        shape: tuple[int, ...],
        device: torch.device,
        parallel: ParallelState,
        shared: bool,
    ) -> torch.Tensor:
        """Every layer's host latent rows (uint8) in one block, page-locked on CUDA; mapped
        by every rank when `shared` (`machine_shared_empty`). Not zero-filled (hundreds of
        GB at real sizes): a row is written before it is read."""
        cannot = check_host_latent(pool.layout, pool.num_pages)
        try:
            if not shared and device.type == "cuda":
                return pinned_empty(shape, torch.uint8)
            if not shared:
                return torch.empty(shape, dtype=torch.uint8)
            block = machine_shared_empty(parallel, math.prod(shape), "hisparse-host-latent")
            return page_lock(block, block.numel()) if device.type == "cuda" else block
        except (RuntimeError, MemoryError) as e:  # (less free than the machine has, say)
            if not allocation_failed(e):
                raise
            raise ConfigError(f"{cannot} ({str(e).splitlines()[0]})") from None

    # --- sizes -----------------------------------------------------------------------------

    @property
    def host_nbytes(self) -> int:
        return sum(h.numel() for h in self.host.values())

    @property
    def row_bytes(self) -> int:
        """One token's latent in one layer, as stored."""
        return next(iter(self.host.values())).shape[1]

    def holds_group(self, full_layer: int) -> bool:
        """Whether this rank's stage holds a layer of `full_layer`'s IndexShare group."""
        return full_layer in self._group

    def _copy_in(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Host rows `src` into device latent slots `dst`, in every layer held."""
        self.backend.hot_copy(*self._all_rows, src, dst)
        self.stats.rows_to_device += src.numel() * len(self.host)

    @property
    def num_latent_tokens_used(self) -> int:
        return self.allocator.num_used_pages * self.page_size

    @staticmethod
    def zero_counters() -> dict[str, int]:
        """`counters()` of an engine without HiSparse (one /metrics schema either way)."""
        return dict.fromkeys(_COUNTERS, 0)

    def layer_counters(self) -> dict[str, int]:
        """The counters of what this rank's layers did (a pipeline stage's own; the
        lookups counted on the stage holding each group's full layer): `counters` takes
        them summed over the stages."""
        hits, misses, miss_rows = self._counts.tolist()
        st = self.stats
        return {
            "hisparse_hits": hits,
            "hisparse_misses": misses,
            "hisparse_resolves": st.resolves,
            "hisparse_rows_to_device": st.rows_to_device + miss_rows,
            "hisparse_rows_to_host": st.rows_to_host,
        }

    def counters(self, host_tokens_used: int, layered: dict[str, int]) -> dict[str, int]:
        """`host_tokens_used`: logical tokens held (their latent is in host memory);
        `layered`: `layer_counters`, of every pipeline stage."""
        to_device, to_host = layered["hisparse_rows_to_device"], layered["hisparse_rows_to_host"]
        out = {
            "hisparse_device_tokens_total": self.allocator.num_pages * self.page_size,
            "hisparse_device_tokens_used": self.num_latent_tokens_used,
            "hisparse_host_tokens_total": self.pool.num_tokens,
            "hisparse_host_tokens_used": host_tokens_used,
            "hisparse_hot_buffers": sum(1 for h in self._reqs.values() if h.row >= 0),
            "hisparse_hits": layered["hisparse_hits"],
            "hisparse_misses": layered["hisparse_misses"],
            "hisparse_resolves": layered["hisparse_resolves"],
            "hisparse_rows_to_device": to_device,
            "hisparse_bytes_to_device": to_device * self.row_bytes,
            "hisparse_rows_to_host": to_host,
            "hisparse_bytes_to_host": to_host * self.row_bytes,
        }
        assert tuple(out) == _COUNTERS
        return out

    # --- admission and release (the scheduler) ---------------------------------------------

    def prefill_end(self, req: Request) -> int:
        """How many of `req`'s tokens a prefill holds on the device at once before it runs
        one token a step: all of them when the device latent pool can, else its prompt. A
        request retracted and recomputed may have outgrown the pool while it decoded (only
        its hot buffer is on the device then): its outputs are decoded again, as they were."""
        return req.seq_len if self.fits(req.seq_len) else len(req.prompt_ids)

    def resumes_detached(self, req: Request) -> bool:
        """Whether `req`, back from the host tier, computed past what a prefill holds on the
        device (`prefill_end`): it decodes on, its latent in the host rows, and takes a hot
        buffer only (`admit_detached`); else what it computed is a prefix hit (`admit`)."""
        return req.host_slots is not None and req.host_slots.numel() >= self.prefill_end(req)

    def _pages_for(self, req: Request) -> int:
        if self.resumes_detached(req):
            return self.buffer_pages
        return -(-max(self.prefill_end(req), self.config.buffer_slots) // self.page_size)

    def fits(self, prompt_len: int) -> bool:
        """Whether a prompt can ever be prefilled: its latent must all be on the device."""
        need = max(prompt_len + 1, self.config.buffer_slots)
        return -(-need // self.page_size) <= self.allocator.num_pages

    def can_admit(
        self, req: Request, detached: bool = False, behind: Iterable[Request] = (), freed: int = 0
    ) -> bool:
        """Whether the device latent pool holds this request's prompt (and, later, buffer);
        `detached`: its prompt's latent arrives in host memory (PD), only the buffer. The
        pages `behind` (retracted requests that come back first) need stay theirs; `freed`
        more would be free (requests that would be retracted: `held_pages`)."""
        need = self.buffer_pages if detached else self._pages_for(req)
        owed = sum(
            self._pages_for(r)
            for r in behind
            if r.host_slots is not None or self.fits(len(r.prompt_ids))
        )
        return need + owed <= self.allocator.num_free_pages + freed

    def held_pages(self, req: Request) -> int:
        """The device latent pages `req` holds."""
        hot = self._reqs.get(req.rid)
        return 0 if hot is None else len(hot.pages)

    def admit(self, req: Request, hit_slots: torch.Tensor) -> None:
        """Take the request's latent pages; bring the latent of its prefix hit (the logical
        slots `hit_slots` of positions 0..hit-1) from the host."""
        self._do(Take(req.rid, self._pages_for(req), hit_slots.cpu()))

    def admit_from_host(self, req: Request, slots: torch.Tensor) -> None:
        """A request back from the host tier (its KV loaded into the logical `slots` of
        what it computed): detached past what a prefill holds (`resumes_detached`), else
        with what it computed as a prefix hit of its own."""
        if self.resumes_detached(req):
            self.admit_detached(req)
        else:
            self.admit(req, slots)

    def admit_detached(self, req: Request) -> None:
        """A PD decode request, or one back from the host tier: buffer pages only; its latent
        is in host memory (the prefill server writes it there, or the host tier loads it)
        and its first decode step loads the buffer from there."""
        self._do(Take(req.rid, self.buffer_pages, None, on_host=True))

    def free(self, req: Request) -> None:
        """Give back a finished, aborted or retracted request's latent slots and LRU state
        (a `deferred` one's at `release_deferred`)."""
        if req.rid in self._reqs and req.rid not in self.deferred:
            self._do(Free(req.rid))

    def defer_free(self, rid: int) -> None:
        """Keep a finished request's hot buffer past `free` until `release_deferred`: the
        draft layer catches up over its last step (`MTPDrafter.finish`: pages the prefix
        cache keeps must hold its rows)."""
        self.deferred.add(rid)

    def release_deferred(self) -> None:
        """Free the deferred requests' slots and state, their catch-up done."""
        for rid in sorted(self.deferred):
            if rid in self._reqs:
                self._do(Free(rid))
        self.deferred.clear()

    def take_journal(self) -> list[Take | Free]:
        """The admissions and releases since the last call (rank 0 sends them on)."""
        ops, self.journal = self.journal or [], []
        return ops

    def replay(self, ops: list[Take | Free]) -> None:
        """Repeat rank 0's admissions and releases on this rank's replica, in order."""
        for op in ops:
            self._apply(op)

    def _do(self, op: Take | Free) -> None:
        """Apply `op`, then journal it: one that failed (no pages left) never ran here."""
        self._apply(op)
        if self.journal is not None:
            self.journal.append(op)

    def _apply(self, op: Take | Free) -> None:
        if isinstance(op, Free):
            self._free(op.rid)
            return
        if op.rid in self._reqs:
            raise RuntimeError(f"request {op.rid} already holds device latent slots")
        hot = self._reqs[op.rid] = _Hot(self.allocator.alloc(op.pages), on_host=op.on_host)
        n = 0 if op.hit_slots is None else op.hit_slots.numel()
        if n:
            dst = page_slots(hot.pages, self.page_size)[:n].to(self.device)
            self._copy_in(op.hit_slots.to(self.device), dst)

    def _free(self, rid: int) -> None:
        hot = self._reqs.pop(rid)
        self.allocator.free(hot.pages)
        if hot.row >= 0:
            self.buf_pos[:, hot.row] = -1
            self.stamp[:, hot.row] = -1
            self._free_rows.append(hot.row)

    def check(self, idle: bool) -> None:
        """Integrity: every used latent page and state row belongs to one request; idle,
        none is used."""
        self.allocator.check()
        held = sum(len(h.pages) for h in self._reqs.values())
        if held != self.allocator.num_used_pages:
            raise AssertionError(
                f"requests hold {held} latent pages, {self.allocator.num_used_pages} used"
            )
        rows = sum(1 for h in self._reqs.values() if h.row >= 0)
        if rows + len(self._free_rows) != self.buf_slot.shape[0]:
            raise AssertionError("hot-buffer state rows leaked")
        if idle and self._reqs:
            raise AssertionError(f"idle engine still holds hot buffers for {sorted(self._reqs)}")

    def replica_state(self) -> dict[str, object]:
        """What every rank's replica must agree on (`Engine.check_integrity` compares them),
        by name: each request's device pages and state row, the free rows, the step clock,
        the free pages, checksums of the slots and, per IndexShare group (by its full
        layer: the ranks of the stages that hold a layer of it), of its buffers' positions
        and recency."""
        state: dict[str, object] = {
            "requests' pages and rows": sorted(
                (rid, tuple(h.pages), h.row, h.on_host) for rid, h in self._reqs.items()
            ),
            "free state rows": tuple(self._free_rows),
            "step clock": self._clock,
            "free device pages": self.allocator.num_free_pages,
        }

        def crc(t: torch.Tensor) -> int:
            return zlib.crc32(t.cpu().numpy().tobytes())

        for name in ("buf_slot", "reserved"):
            state[f"{name} checksum"] = crc(getattr(self, name))
        for f, g in self._group.items():
            state[f"group {f} buf_pos checksum"] = crc(self.buf_pos[g])
            state[f"group {f} stamp checksum"] = crc(self.stamp[g])
        return state

    # --- the step --------------------------------------------------------------------------

    def begin_step(
        self,
        entries: Sequence[tuple[int, int, int]],
        slots: Sequence[torch.Tensor],
        draft: bool = False,
    ) -> HotStep:
        """Where this step's latent goes and comes from: `entries[i]` is request i's (rid,
        first position, tokens the scheduler gave it) this step, `slots[i]` its logical slots
        of every position the step covers (the drafts a decode step verifies included).
        `draft`: a forward of the MTP layer (a catch-up over what the target computed, or a
        chain step), whose tokens are as many as the entry says."""
        self._clock += 1
        outs: list[torch.Tensor | None] = []
        req_slots, rows, first_pos, counts = [], [], [], []
        for (rid, start, n), sl in zip(entries, slots, strict=True):
            hot = self._reqs[rid]
            if n == 1 and hot.row < 0:
                self._enter_decode(hot, start, sl)
            if hot.row < 0:  # prefilling: the prompt's latent is all on the device
                lat = page_slots(hot.pages, self.page_size)[: start + n]
                outs.append(lat[start:])
                req_slots.append(lat)
            else:
                tokens = sl.shape[0] - start  # (its one token and the drafts after it)
                if n != (tokens if draft else 1) or tokens > self.step_tokens:
                    raise RuntimeError(
                        f"request {rid} decodes {tokens} tokens ({n} scheduled); its hot "
                        f"buffer reserves slots for {self.step_tokens}"
                    )
                rows.append(hot.row)
                first_pos.append(start)
                counts.append(tokens)
                outs.append(None)  # bound below
                req_slots.append(None)
        step = HotStep(self, list(entries), rows, first_pos, counts, req_slots, draft)
        if not entries:  # (an idle rank's step under DP attention)
            return step
        if rows:  # the new tokens' latent slots: their own entries while < S, else reserved
            bound = step.bind_new().long().cpu()
            taken = iter(b[:t] for b, t in zip(bound, counts, strict=True))
            outs = [next(taken) if o is None else o for o in outs]
        step.out_slots = torch.cat(outs).to(self.device)
        step.logical_out = torch.cat(
            [sl[start:] for (_, start, _), sl in zip(entries, slots, strict=True)]
        ).to(self.device)
        return step

    def layers_of(self, step: HotStep) -> tuple[int, ...]:
        """The layers a step runs here: the target's, or the MTP layer's (a draft step)."""
        return self.draft_layers if step.draft else self.target_layers

    def end_step(self, step: HotStep) -> None:
        """Every token this step computed goes to the host, in every layer the step ran: the
        newest ones' slots are overwritten next step, and evicted or prefix-hit rows are read
        from there."""
        layers = self.layers_of(step)
        # (TP rank 0 writes the one a stage shares; a stage before the last runs no draft)
        if not self.writes_host or not step.entries or not layers:
            return
        src, dst = step.out_slots, step.logical_out.cpu()
        rows = torch.stack([self.device_rows[i].index_select(0, src) for i in layers]).cpu()
        for i, r in zip(layers, rows, strict=True):  # one device -> host copy above
            self.host[i].index_copy_(0, dst, r)
        self.stats.rows_to_host += src.numel() * len(layers)

    def _enter_decode(self, hot: _Hot, computed: int, logical: torch.Tensor) -> None:
        """Shrink a request to its hot buffer: its first `buffer_pages` latent pages stay,
        entry j holding position j (resident for j < computed), the slots after them are
        reserved for the tokens of a step. A PD request loads those entries from the host
        (`logical`: its logical slots)."""
        keep, extra = hot.pages[: self.buffer_pages], hot.pages[self.buffer_pages :]
        if extra:
            self.allocator.free(extra)
        hot.pages = keep
        if not self._free_rows:
            raise OutOfPages("no hot-buffer state row left")  # rows >= buffers the pool holds
        hot.row = r = self._free_rows.pop()
        lat = page_slots(keep, self.page_size).to(self.device)
        self.buf_slot[r] = lat[: self.size]
        self.reserved[r] = lat[self.size : self.size + self.step_tokens]
        if hot.on_host:
            n = min(computed, self.size)
            self._copy_in(logical[:n].to(self.device), lat[:n])
            hot.on_host = False
        at = torch.tensor([computed], device=self.device)
        self.buf_pos[:, r], self.stamp[:, r] = init_buffers(at, self.size)


class HotStep:
    """One step's hot-buffer view for the model (`ForwardBatch.hot`): the decoding requests'
    state rows in batch order, the first position each computes this step (`first_pos`)
    and how many (`counts`: 1, or 1 + the drafts it verifies), and `resolve` for each full
    layer; `entries`, what it was built from (`HotBuffers.begin_step`), for the other ranks.

    The model runs a decoding request's tokens as decode rows of their own (`decode_rows`):
    row j at position first_pos + j over its context up to there. A full layer resolves the
    union of a request's rows' top-k against its buffer at once, since one attention launch
    reads every row's (the config keeps step_tokens × top_k within the buffer)."""

    def __init__(
        self,
        hb: HotBuffers,
        entries: list[tuple[int, int, int]],
        rows: list[int],
        first_pos: list[int],
        counts: list[int],
        req_slots: list[torch.Tensor | None],
        draft: bool = False,
    ) -> None:
        dev = hb.device
        self.hb, self.entries, self.counts, self.draft = hb, entries, counts, draft
        self.rows = torch.tensor(rows, dtype=torch.long, device=dev)
        self.first_pos = torch.tensor(first_pos, dtype=torch.long, device=dev)
        # Per request: decoding (None) or its latent slots (extending); per model request
        # after `decode_rows`: an extending request's latent slots, nothing for a decode row.
        self.decoding = [s is None for s in req_slots]
        none, per_count = torch.empty(0, dtype=torch.long, device=dev), iter(counts)
        self.req_slots = []
        for s in req_slots:
            self.req_slots += [none] * next(per_count) if s is None else [s.to(dev)]
        # Decode row q is token j of decoding request owner[q]; `union_at` places it in the
        # [B × width] stack that `resolve` reads as one row of width × K columns a request.
        self.width = max(counts, default=1)
        owner = [i for i, t in enumerate(counts) for _ in range(t)]
        at = [i * self.width + j for i, t in enumerate(counts) for j in range(t)]
        self.owner = torch.tensor(owner, dtype=torch.long, device=dev)
        self.union_at = torch.tensor(at, dtype=torch.long, device=dev)
        self.row_start = self.first_pos.index_select(0, self.owner)
        firsts = [0, *accumulate(counts)][:-1]  # (each request's first decode row)
        self.first_rows = torch.tensor(firsts, dtype=torch.long, device=dev)
        # `hot_resolve`'s newest position and its slot, for every row: none (this step's
        # positions are mapped to their bound slots around it, a verify's several at once)
        self.unbound = torch.full((len(rows),), -1, dtype=torch.int32, device=dev)
        self.out_slots = torch.empty(0, dtype=torch.long, device=dev)  # this step's latent
        self.logical_out = torch.empty(0, dtype=torch.long, device=dev)  # ... and host rows
        self.new_slots = torch.empty(0, 0, dtype=torch.int32, device=dev)

    def decode_rows(
        self, new_tokens: Sequence[Sequence[int]], req_slots: Sequence
    ) -> tuple[list[Sequence[int]], list]:
        """The step's requests as the model runs them: a decoding request's tokens one
        decode row each, row j over the slots of its context up to its own position."""
        toks: list[Sequence[int]] = []
        slots: list = []
        for t, sl, decoding in zip(new_tokens, req_slots, self.decoding, strict=True):
            if not decoding or len(t) == 1:
                toks.append(t)
                slots.append(sl)
                continue
            first = len(sl) - len(t)
            for j, token in enumerate(t):
                toks.append([token])
                slots.append(sl[: first + j + 1])
        return toks, slots

    def bind_new(self) -> torch.Tensor:
        """Each decoding request's new tokens' slots `[B, width]`: token j (at first_pos + j)
        takes buffer entry first_pos + j while that is < S (it stays resident, in every group
        whose layers the step runs), else reserved slot j; columns past a request's count
        are not read.

        A draft step first drops the entries holding a position it writes: a chain step
        past S reads the chain's earlier positions as misses, and the catch-up after the
        verify rewrites them (as the dense layout rewrites the slot), so the buffer must
        not keep the chain's rows. A target step never finds its new positions held: they
        are past everything it looked up before."""
        hb, r = self.hb, self.rows
        slot, reserved = hb.buf_slot.index_select(0, r), hb.reserved.index_select(0, r)
        counts = torch.tensor(self.counts, dtype=torch.long, device=hb.device)
        ran = hb.layers_of(self)
        groups = [g for f, g in hb._group.items() if hb.groups[f][0] in ran]
        new = [torch.where(j < counts, self.first_pos + j, -1) for j in range(self.width)]
        cols = None
        for g in groups:
            pos = hb.buf_pos[g].index_select(0, r)
            if self.draft:
                held = torch.stack([pos == at[:, None] for at in new]).any(0) & (pos >= 0)
                pos.masked_fill_(held, -1)
                stamp = hb.stamp[g].index_select(0, r).masked_fill_(held, -1)
                hb.stamp[g].index_copy_(0, r, stamp)
            cols = [bind_newest(pos, slot, at, reserved[:, j]) for j, at in enumerate(new)]
            hb.buf_pos[g].index_copy_(0, r, pos)
        if cols is None:  # (no group here: a later stage's draft step; the slots do not
            # depend on a group's state)
            pos = torch.full_like(slot, -1, dtype=hb.buf_pos.dtype)
            cols = [bind_newest(pos, slot, at, reserved[:, j]) for j, at in enumerate(new)]
        self.new_slots = torch.stack(cols, 1)
        return self.new_slots

    def resolves(self, full_layer: int) -> bool:
        """Whether this rank `resolve`s `full_layer`'s top-k: its pipeline stage holds a
        layer of that IndexShare group (`HotBuffers.holds_group`)."""
        return self.hb.holds_group(full_layer)

    def resolve(
        self, layer: int, positions: torch.Tensor, valid: torch.Tensor, table: torch.Tensor
    ) -> torch.Tensor:
        """Device latent slots `[Q, K]` of a full layer's top-k for the step's decode rows
        (`positions` into each row's context, `table[Q, W]` its logical slots). A position
        this step computes takes the slot `bind_new` gave it; a request's others are
        resolved against its buffer, the misses' rows copied from the host into this layer
        and every layer sharing its top-k (one copy list for the group). Invalid columns
        get slot 0, which attention masks."""
        hb = self.hb
        g, r = hb._group[layer], self.rows
        b, k = r.shape[0], positions.shape[1]
        topk = torch.where(valid, positions, -1)
        new = topk >= self.row_start[:, None]  # (-1 never is)
        looked = torch.where(new, -1, topk).to(torch.int32)
        union = looked
        if self.width > 1:
            union = torch.full((b * self.width, k), -1, dtype=torch.int32, device=hb.device)
            union = union.index_copy_(0, self.union_at, looked).view(b, self.width * k)
        pos = hb.buf_pos[g].index_select(0, r)
        stamp = hb.stamp[g].index_select(0, r)
        slots, miss_pos, miss_slot = hb.backend.hot_resolve(
            union,
            self.unbound,
            self.unbound,
            pos,
            stamp,
            hb.buf_slot.index_select(0, r),
            hb._clock,
        )
        hb.buf_pos[g].index_copy_(0, r, pos)
        hb.stamp[g].index_copy_(0, r, stamp)
        if self.width > 1:
            slots = slots.view(b * self.width, k).index_select(0, self.union_at)
        step = (topk - self.row_start[:, None]).clamp(0, self.width - 1)
        bound = self.new_slots.index_select(0, self.owner).gather(1, step)
        slots = torch.where(new, bound.to(slots.dtype), slots)
        missed = miss_pos >= 0
        # (every row's context covers what its request misses: positions before first_pos)
        ctx = table if self.width == 1 else table.index_select(0, self.first_rows)
        src = torch.where(missed, ctx.gather(1, miss_pos.long().clamp(min=0)), -1)
        group = hb.groups[layer]
        hb.backend.hot_copy(
            [hb.host[i] for i in group],
            [hb.device_rows[i] for i in group],
            src.reshape(-1),
            miss_slot.reshape(-1),
        )
        n_miss = missed.sum()
        if layer in hb.device_rows:  # (the full layer's stage counts the group's lookups)
            looked_up = _distinct(union) if self.width > 1 else (union >= 0).sum()
            hb._counts += torch.stack([looked_up - n_miss, n_miss, n_miss * len(group)])
            hb.stats.resolves += 1
        else:  # (a later stage makes the same lookups, and copies rows of its own layers)
            hb._counts[2] += n_miss * len(group)
        return torch.where(valid, slots, 0).long()


def _distinct(topk: torch.Tensor) -> torch.Tensor:
    """How many distinct positions (≥ 0) each row of `topk` looks up, summed: a verify's
    rows pick many of the same."""
    srt = topk.sort(1).values
    first = torch.ones_like(srt, dtype=torch.bool)
    first[:, 1:] = srt[:, 1:] != srt[:, :-1]
    return (first & (srt >= 0)).sum()
