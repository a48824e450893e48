"""`ModelRunner`: runs the model for one engine step, on one rank or on all of them.

Under plain tensor parallelism only rank 0 schedules. Before each call its runner
broadcasts what the other ranks need (the step's tokens and slots, and the host-tier
copies made since its last message, so every rank's pool replica stays identical); the
other ranks sit in `serve()` and make the same calls, which meet in the model's
collectives. Hidden states never travel: every rank keeps the last target and
draft outputs ("target", "draft") and messages name rows of them. Between steps rank 0
may have every rank make one of the engine's every-rank calls (`Engine.every_rank_call`:
sleep mode, weight updates, profiles, the expert distribution). Under DP attention every
rank schedules for itself, so nothing is broadcast here (see `dsakv.engine.dp`).

Under HiSparse every rank holds hot buffers of its own (`dsakv.engine.hisparse`): rank
0's admissions and releases travel with its messages as the host copies do, and each
forward names the step's requests, so every rank builds the same `HotStep`. On one machine
the ranks map one host latent, which rank 0 writes after each step: a rank reads rows only
in a later step, whose message comes after that write.

Under pipeline parallelism every rank still runs each message: a stage runs its layers
and hands its output to the next (`dsakv.models.stages`); hidden states stay on the last
stage (its "target" and "draft"), which also runs the MTP layer, and logits are computed
there and sent to rank 0 (`ParallelState.to_driver`), which returns them as one stage
would. The L3 tier's whole pages travel the same way: each stage's part of a snapshot to
rank 0, each stage's columns of a page read back from rank 0 (`read_pages`, `write_pages`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dsakv.distributed.leader import NOOP, STOP, Leader
from dsakv.distributed.parallel import ParallelState
from dsakv.memory.allocator import page_slots
from dsakv.memory.host import HostPool
from dsakv.memory.pool import DSAKVPool
from dsakv.models.forward_batch import ForwardBatch, padded_slots

from .cuda_graph import DecodeGraphs
from .hisparse import HotBuffers, HotStep

TARGET, DRAFT = "target", "draft"


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        pool: DSAKVPool,
        host: HostPool | None,
        parallel: ParallelState,
        device: torch.device,
        decode_graphs: DecodeGraphs | None = None,
        on_every_rank: Callable[..., Any] | None = None,
        hot_buffers: HotBuffers | None = None,
        stage_page_bytes: Sequence[int] = (),
    ) -> None:
        self.model, self.pool, self.host, self.hot = model, pool, host, hot_buffers
        # A page's bytes in each pipeline stage's pool (its layers'), in stage order
        self.stage_page_bytes = tuple(stage_page_bytes) or (pool.page_bytes(),)
        # The tiers whose changes rank 0 journals and the other ranks replay, in this order
        # (the same on every rank: one config)
        self.journaled = [t for t in (host, hot_buffers) if t is not None]
        self.parallel, self.device = parallel, device
        self.decode_graphs = decode_graphs  # padded (CUDA-graph) decode steps
        self.on_every_rank = on_every_rank  # this rank's part (`Engine.every_rank_call`)
        follows_rank0 = parallel.world_size > 1 and not parallel.config.dp_attention
        if follows_rank0 and parallel.is_driver:
            for tier in self.journaled:
                tier.journal = []
        self.leader = Leader(parallel) if follows_rank0 and parallel.is_driver else None
        # A later pipeline stage's TP ranks map one host latent that its TP rank 0 writes
        # here in `serve` (the host-tier loads it replays, each step's `end_step`), not
        # before rank 0's message as on stage 0: the ranks meet before they read it.
        self.meets_before_reads = (
            hot_buffers is not None and hot_buffers.shared_host and parallel.stage > 0
        )
        self.last: dict[str, torch.Tensor] = {}  # the latest output of each model part

    def forward(
        self,
        new_tokens: Sequence[Sequence[int]],
        slots: Sequence[torch.Tensor],
        hot: HotStep | None = None,
        rows: Sequence[int] = (),
        record: bool = False,
        lora: tuple[tuple[int, ...], list[int]] | None = None,
        keep_hidden: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Run the target over one step's tokens (their KV goes to `slots`' tails);
        returns hidden `[T, H]` (final-normed), the fp32 logits of its `rows` (as
        `logits`; None without rows), in the same native call where the step has one, and
        with `record`, the experts the tokens were routed to (`record_routing`'s
        `[T, layers, top_k]`; other ranks route alike); else None.
        Under pipeline parallelism the hidden rows returned on rank 0 are its stage's
        output (un-normed; the last stage keeps the final ones), or with `keep_hidden` the
        last stage's (in fp32), the logits the last stage's, and the experts every stage's
        of its own layers. A step that records runs eager: not a CUDA graph (SGLang's
        captures it). `hot`:
        the step's HiSparse latent slots (`dsakv.engine.hisparse.HotStep`: rank 0's; the
        other ranks build theirs from its entries).
        `lora`: the step's LoRA table (`LoraRegistry.step`), None without LoRA requests; a
        step with adapter rows runs eager too, one without runs as without --enable-lora."""
        with self._leading() as send:
            if send:
                entries = None if hot is None else hot.entries
                packed = (_pack(new_tokens), _pack_slots(slots), list(rows), lora, entries)
                send("forward", *packed, record, keep_hidden)
            return self._forward(new_tokens, slots, hot, rows, record, lora, keep_hidden)

    def forward_draft(
        self,
        new_tokens: Sequence[Sequence[int]],
        slots: Sequence[torch.Tensor],
        source: str,
        rows: torch.Tensor,
        entries: list[tuple[int, int, int]] | None = None,
    ) -> torch.Tensor | None:
        """Run the MTP layer: token t of `new_tokens` pairs with `self.last[source][rows[t]]`
        (the target's hidden state, or the draft's own previous output when chaining).
        Only the last pipeline stage holds it (the others return None). `entries`: under
        HiSparse, its requests as `HotBuffers.begin_step` takes them (each rank steps the
        draft layer's hot buffers over them)."""
        with self._leading() as send:
            if send:
                packed = (_pack(new_tokens), _pack_slots(slots), source, rows.cpu(), entries)
                send("draft", *packed)
            return self._forward_draft(new_tokens, slots, source, rows, entries)

    def catch_up(
        self,
        new_tokens: Sequence[Sequence[int]],
        slots: Sequence[torch.Tensor],
        hidden: torch.Tensor,
    ) -> None:
        """`forward_draft` with the h rows given (`hidden`, kept from earlier steps: a
        deferred catch-up); one rank only, as only a lone rank defers."""
        assert self.leader is None, "the other ranks do not hold these rows"
        fb = ForwardBatch.from_requests(new_tokens, slots, device=self.device)
        with torch.inference_mode():
            self.model.forward_draft(fb, self.pool, hidden.to(self.device))

    def draft_chain(
        self,
        new_tokens: Sequence[Sequence[int]],
        slots: Sequence[torch.Tensor],
        rows: torch.Tensor,
        ends: Sequence[int],
        want: Sequence[int],
        chain: Sequence[torch.Tensor],
    ) -> list[list[int]] | None:
        """`forward_draft(new_tokens, slots, TARGET, rows)`, then each request's greedy
        drafts in a chain (`DSAForCausalLM.draft_chain`: the catch-up's row `ends[r]` on,
        `want[r]` of them, the chain's slots `chain[r]`), all in one native call; None
        where there is none (several ranks, no native form): the caller chains in Python."""
        if self.leader is not None or not new_tokens:
            return None
        fb = ForwardBatch.from_requests(new_tokens, slots, device=self.device)
        with torch.inference_mode():
            h = self.last[TARGET][rows.to(self.device)]
            ends_t, want_t = torch.tensor(ends), torch.tensor(want)
            drafts = self.model.draft_chain(fb, self.pool, h, ends_t, want_t, padded_slots(chain))
        if drafts is None:
            return None
        return [d[:k] for d, k in zip(drafts.tolist(), want)]

    def logits(self, rows: torch.Tensor, source: str = TARGET) -> torch.Tensor:
        """fp32 logits `[len(rows), vocab]` of `self.last[source][rows]` (vocab-parallel)."""
        with self._leading() as send:
            if send:
                send("logits", rows.cpu(), source)
            return self._logits(rows, source)

    def share_kv(self, pages: Sequence[int], latent_slots: torch.Tensor | None = None) -> None:
        """Give every rank's replica rank 0's bytes of `pages` (and under HiSparse, of the
        host latent rows at `latent_slots`), which only rank 0 holds: a PD decode request's
        prompt KV, written there by the prefill server. One message, then the bytes over
        the model's group (device to device on CUDA)."""
        if self.leader is None or not pages:
            return
        with self._leading() as send:
            send("kv", list(pages), latent_slots)
            self._share_kv(list(pages), latent_slots)

    def _share_kv(self, pages: list[int], latent_slots: torch.Tensor | None) -> None:
        """`share_kv`'s bytes, sent on rank 0 and received on the others (the shapes come
        from the pool, the host latent and the message)."""
        hot = self.hot is not None  # (a HiSparse pool's latent is in the host rows)
        self.parallel.broadcast_rows(
            len(pages),
            self.pool.page_bytes(index_k_only=hot),
            lambda r: self.pool.read_pages(pages[r], on_device=True, index_k_only=hot),
            lambda r, data: self.pool.write_pages(pages[r], data, index_k_only=hot),
            self.device,
        )
        # The host latent rows, where the ranks hold one each (across machines): on one
        # machine they map rank 0's (each layer's, host memory to host memory).
        if latent_slots is None or self.hot.shared_host:
            return
        for host in self.hot.host.values():
            self.parallel.broadcast_rows(
                latent_slots.numel(),
                host.shape[1],
                lambda r, h=host: h.index_select(0, latent_slots[r]),
                lambda r, data, h=host: h.index_copy_(0, latent_slots[r], data),
                self.device,
                control=True,
            )

    def read_pages(self, pages: Sequence[int], host: bool = False) -> torch.Tensor:
        """The whole model's bytes of device `pages` (`host`: host-tier pages), uint8
        `[len(pages), bytes a page]` on the CPU, on rank 0: its own pool's with one stage
        (every TP rank's is a replica); under pipeline stages each stage's TP rank 0 sends
        its layers' part, side by side in stage order (the layout's)."""
        if self.parallel.pp_size == 1:
            return (self.host.pool if host else self.pool).read_pages(pages)
        with self._leading() as send:
            send("read_pages", list(pages), host)
            return self._read_pages(list(pages), host)

    def _read_pages(self, pages: list[int], host: bool) -> torch.Tensor | None:
        rows = None
        if self.parallel.tp_rank == 0:  # (a stage's ranks hold one replica)
            rows = (self.host.pool if host else self.pool).read_pages(pages, on_device=True)
        return self.parallel.stages_side_by_side(rows, self.stage_page_bytes)

    def write_pages(self, pages: Sequence[int], rows: torch.Tensor) -> None:
        """The whole model's `rows` of device `pages` (as `read_pages` gives them) into
        every rank's pool: each stage its layers' columns, each TP rank its replica (under
        HiSparse their index-K, and their host latent rows where the ranks hold one each)."""
        pages = list(pages)
        if self.parallel.pp_size > 1:
            with self._leading() as send:
                send("write_pages", pages)
                self._write_pages(pages, rows)
            return
        self.pool.write_pages(pages, rows)
        latent = None if self.hot is None else page_slots(pages, self.pool.page_size)
        self.share_kv(pages, latent)

    def _write_pages(self, pages: list[int], rows: torch.Tensor | None = None) -> None:
        """Each stage's TP rank 0 writes its columns, then gives them its stage's ranks."""
        widths, n = self.stage_page_bytes, len(pages)
        mine = self.parallel.stage_columns(rows, widths, n, self.pool.device)
        if mine is not None:
            self.pool.write_pages(pages, mine)
        self._share_kv(pages, None)

    def every_rank(self, method: str, *args: Any) -> Any:
        """Have every rank run `on_every_rank(method, *args)` now, between steps (the other
        ranks from `serve`), whose collectives meet across them (a weight update, a trainer's
        group joined or left); returns rank 0's outcome."""
        with self._leading() as send:
            if send:
                send("every_rank", method, *args)
            assert self.on_every_rank is not None
            return self.on_every_rank(method, *args)

    def stop(self) -> None:
        """Release the other ranks from `serve()`."""
        if self.leader is not None:
            self.leader.stop()

    def serve(self) -> None:
        """The other ranks under plain TP: make rank 0's calls until it says stop."""
        while True:
            msg = self.parallel.broadcast_object()
            if msg == STOP:
                return
            if msg == NOOP:  # (the leader's heartbeat: it said nothing for a while)
                continue
            kind, journals, *args = msg
            # rank 0's host copies and HiSparse admissions since its last message, made
            # before it
            # (under `meets_before_reads`: after the writer's last step, and after the
            # host-tier loads it replays, before the hot buffers read a row)
            if self.meets_before_reads:
                self.parallel.tp_sync(self.device)
            for tier, ops in zip(self.journaled, journals, strict=True):
                if ops:
                    tier.replay(ops)
                    if tier is self.host and self.meets_before_reads:
                        self.parallel.tp_sync(self.device)
            if kind == "forward":
                tokens, slots, rows, lora, entries, record, keep_hidden = args
                slots = [s.long() for s in slots]
                hot = None if entries is None else self.hot.begin_step(entries, slots)
                # (routing is read on rank 0, which each later stage sends its part)
                record = record and self.parallel.pp_size > 1
                self._forward(tokens, slots, hot, rows, record, lora, keep_hidden)
                if hot is not None:
                    self.hot.end_step(hot)
            elif kind == "draft":
                tokens, slots, source, rows, entries = args
                self._forward_draft(tokens, [s.long() for s in slots], source, rows, entries)
            elif kind == "logits":
                self._logits(*args)
            elif kind == "kv":
                self._share_kv(*args)
            elif kind == "read_pages":
                self._read_pages(*args)
            elif kind == "write_pages":
                self._write_pages(*args)
            elif kind == "every_rank":
                assert self.on_every_rank is not None
                self.on_every_rank(*args)

    @contextlib.contextmanager
    def _leading(self):
        """Holds the leader's lock for a message and its collectives; yields its `send`,
        which adds the host copies and HiSparse admissions made since the last message:
        the other ranks replay them first (a draft step's page reservation may back a page
        up to the host, then the chain writes that page)."""
        if self.leader is None:
            yield None
            return

        def send(kind: str, *args: Any) -> None:
            self.leader.send((kind, [t.take_journal() for t in self.journaled], *args))

        with self.leader.lock:
            yield send

    def _forward(
        self,
        new_tokens,
        slots,
        hot=None,
        rows: Sequence[int] = (),
        record=False,
        lora=None,
        keep_hidden=False,
    ):
        graphs, logits, routed = self.decode_graphs, None, None
        if self.model.lora is not None:
            self.model.lora.prepare(lora, [len(t) for t in new_tokens])
            if self.model.lora.used:  # (adapter rows: eager; the graphs hold no LoRA)
                graphs = None
        picked = torch.tensor(rows, dtype=torch.long) if rows else None
        if graphs is not None and not record and graphs.fits(new_tokens, slots):
            self.last[TARGET] = graphs.run(new_tokens, slots)
            if rows:
                logits = self._logits(picked, TARGET)
        else:
            fb = ForwardBatch.from_requests(new_tokens, slots, device=self.device, hot=hot)
            ctx = self.model.record_routing(fb.num_tokens) if record else contextlib.nullcontext()
            with torch.inference_mode(), ctx as routed:
                if rows:
                    self.last[TARGET], logits = self.model.forward_logits(fb, self.pool, picked)
                    logits = self._to_driver(logits, len(rows))
                else:
                    self.last[TARGET] = self.model(fb, self.pool)
        hidden = self.last[TARGET]
        if self.parallel.pp_size > 1:  # (each stage holds its layers' part)
            if record:
                routed = self.parallel.stages_to_driver(routed)
            if keep_hidden:
                shape = (hidden.shape[0], self.model.config.hidden_size)
                hidden = self.parallel.to_driver(hidden, shape, self.device)
        return hidden, logits, routed

    def _forward_draft(
        self, new_tokens, slots, source: str, rows: torch.Tensor, entries=None
    ) -> torch.Tensor | None:
        # (every stage's hot buffers take the step: their state stays the last stage's)
        hot = None if entries is None else self.hot.begin_step(entries, slots, draft=True)
        if not self.model.model.parts.is_last:  # (the MTP layer is the last stage's)
            return None
        fb = ForwardBatch.from_requests(new_tokens, slots, device=self.device, hot=hot)
        with torch.inference_mode():
            h = self.last[source][rows.to(self.device)]
            self.last[DRAFT] = self.model.forward_draft(fb, self.pool, h)
        if hot is not None:
            self.hot.end_step(hot)  # (its rows to the host)
        return self.last[DRAFT]

    def _logits(self, rows: torch.Tensor, source: str) -> torch.Tensor | None:
        logits = None
        if self.model.model.parts.is_last:
            with torch.inference_mode():
                h = self.last[source][rows.to(self.device)]
                logits = self.model.compute_logits(h, draft=source == DRAFT)
        return self._to_driver(logits, len(rows))

    def _to_driver(self, logits: torch.Tensor | None, n: int) -> torch.Tensor | None:
        """The last pipeline stage's `n` rows of fp32 logits, on rank 0 (as they are with
        one stage)."""
        shape = (n, self.model.config.vocab_size)
        return self.parallel.to_driver(logits, shape, self.device)


def _pack(new_tokens: Sequence[Sequence[int]]) -> list[list[int]]:
    return [list(t) for t in new_tokens]


def _pack_slots(slots: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.as_tensor(s).to("cpu", torch.int32) for s in slots]
