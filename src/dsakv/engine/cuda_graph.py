"""CUDA-graph decode: one captured target forward per (batch, context width) bucket.

A decode step of a small batch is launch-bound on a GPU (hundreds of small kernels per
token), so the whole forward is captured once per bucket and replayed. Everything a
replay reads lives in static device buffers that are refreshed in place before it: the
tokens, positions, output slots and lengths (one `[4, B]` copy) and the requests' page
tables (`[B, W/ps]` int32, one copy; requests own whole pages, so slot = page·ps + offset
and the slot table the model reads is expanded from it on the device, inside the graph).
The captured ops must not sync with the host, which is why only backends without a
`graph_blocker` are captured; `ForwardBatch.padded_decode` makes every Python-level branch
in the model independent of the real lengths.

The step is sized by the batch's real context: the width is the smallest bucket (a power
of `WIDTH_STEP` below the longest, page-aligned) holding the batch's longest request, so
the indexers score and the host copies about the context, not `max_model_len`. Every
bucket is captured at start-up (`capture_all`, largest first, so the smaller graphs reuse
the memory pool's blocks); none is captured inside a timed step.

Eager runs of the same padded batch (`--disable-cuda-graph`, or a batch too large or too
long for the buffers) go through `ForwardBatch.padded_decode` too, so a graph replay and
an eager step compute the same numbers.

Under --enable-lora a graph holds no adapter: it is captured with the LoRA slots inert (no
step table: every hook returns the base output, on the host, no sync) and replayed only
for steps whose rows hold no adapter (`ModelRunner._forward`); the others run eager.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from dsakv.models.forward_batch import ForwardBatch

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
WIDTH_STEP = 4  # each context-width bucket is 4x the next smaller one
MIN_WIDTH = 256


def width_buckets(max_len: int, page_size: int) -> list[int]:
    """Context widths, ascending: `max_len` page-aligned, then each `WIDTH_STEP`× smaller
    (page-aligned) down to `MIN_WIDTH`."""
    full = -(-max_len // page_size) * page_size
    widths = [full]
    while widths[-1] // WIDTH_STEP >= max(MIN_WIDTH, page_size):
        widths.append(-(-(widths[-1] // WIDTH_STEP) // page_size) * page_size)
    return sorted(set(widths))


class DecodeGraphs:
    """Static decode buffers and one graph per (batch, width) bucket."""

    def __init__(
        self,
        model: torch.nn.Module,
        pool,
        device: torch.device,
        max_batch: int,
        max_len: int,
        use_graphs: bool,
    ) -> None:
        self.model, self.pool, self.device = model, pool, device
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.ps = ps = pool.page_size
        self.widths = width_buckets(max_len, ps)
        n, full = self.buckets[-1], self.widths[-1]
        self.width = full
        # tokens, positions, out slots, lengths: one [4, B] buffer, one copy a step.
        self._rows = torch.zeros(4, n, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.out_slots, self.lens = self._rows
        self.out_slots.fill_(-1)  # a capture before any step writes nowhere
        # Page tables, packed at the front as [bucket, width/ps] (contiguous: one copy).
        self._pages = torch.zeros(n * (full // ps), dtype=torch.int32, device=device)
        self._offsets = torch.arange(ps, dtype=torch.long, device=device)
        self.use_graphs = use_graphs and device.type == "cuda"
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self._mempool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        pin = device.type == "cuda"
        self._host_rows = torch.zeros(4, n, dtype=torch.long, pin_memory=pin)
        self._host_pages = torch.zeros(n * (full // ps), dtype=torch.int32, pin_memory=pin)
        # Marks the last step's copies out of the pinned buffers: until it has passed, a
        # non-blocking copy may still be reading them, so the next step's fill waits on it.
        self._copied = torch.cuda.Event() if pin else None

    def fits(self, new_tokens: Sequence[Sequence[int]], slots: Sequence[torch.Tensor]) -> bool:
        return (
            0 < len(new_tokens) <= self.buckets[-1]
            and all(len(t) == 1 for t in new_tokens)
            and all(s.shape[0] <= self.width for s in slots)
        )

    def run(self, new_tokens: Sequence[Sequence[int]], slots: Sequence[torch.Tensor]):
        """Hidden states `[B, H]` of one decode step (`fits` must hold)."""
        b = len(new_tokens)
        bucket = next(n for n in self.buckets if n >= b)
        longest = max(s.shape[0] for s in slots)
        width = next(w for w in self.widths if w >= longest)
        self._fill(new_tokens, slots, bucket, width)
        if not self.use_graphs:
            return self._step(bucket, width)[:b]
        if (bucket, width) not in self.graphs:  # not captured at start-up (capture_all)
            self._capture(bucket, width)
        graph, out = self.graphs[bucket, width]
        graph.replay()
        return out[:b]

    def capture_all(self) -> None:
        """Capture every bucket now, largest first (the smaller graphs reuse its memory)."""
        if not self.use_graphs:
            return
        for width in reversed(self.widths):
            for bucket in reversed(self.buckets):
                if (bucket, width) not in self.graphs:
                    self._capture(bucket, width)
        log.info(
            "captured %d decode graphs (batches %s × widths %s) in %.1f s",
            len(self.graphs),
            self.buckets,
            self.widths,
            self.capture_seconds,
        )

    def drop(self) -> None:
        """Forget every captured graph: each replays the addresses of the weights and the
        pool it was captured over, which sleep mode moves; `capture_all` captures them again,
        in a memory pool of their own (the old one's blocks go with its graphs)."""
        if not self.graphs:
            return
        torch.cuda.synchronize(self.device)
        self.graphs.clear()
        self._mempool = torch.cuda.graph_pool_handle()
        self.out_slots.fill_(-1)  # (a capture writes nowhere, as at start-up: not the last step's)

    def _fill(self, new_tokens, slots, bucket: int, width: int) -> None:
        ps, cols = self.ps, width // self.ps
        if self._copied is not None:
            self._copied.synchronize()
        rows, pages = self._host_rows, self._host_pages[: bucket * cols].view(bucket, cols)
        rows[:, :bucket] = 0
        rows[2, :bucket] = -1  # padding rows write nowhere
        pages.zero_()
        for i, (tok, s) in enumerate(zip(new_tokens, slots)):
            n = s.shape[0]
            pages[i, : -(-n // ps)] = s[::ps] // ps
            rows[0, i], rows[1, i], rows[2, i], rows[3, i] = tok[0], n - 1, int(s[n - 1]), n
        self._pages[: bucket * cols].copy_(self._host_pages[: bucket * cols], non_blocking=True)
        self._rows[:, :bucket].copy_(rows[:, :bucket], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _step(self, bucket: int, width: int) -> torch.Tensor:
        """The padded forward over the static buffers; the slot table is expanded from the
        page tables here, on the device (inside the graph when captured)."""
        cols = width // self.ps
        pages = self._pages[: bucket * cols].view(bucket, cols).long()
        table = (pages[:, :, None] * self.ps + self._offsets).view(bucket, width)
        batch = ForwardBatch.padded_decode(
            self.input_ids[:bucket],
            self.positions[:bucket],
            self.out_slots[:bucket],
            table,
            self.lens[:bucket],
        )
        with torch.inference_mode():
            return self.model(batch, self.pool)

    def _capture(self, bucket: int, width: int) -> None:
        start = time.perf_counter()
        lora = getattr(self.model, "lora", None)
        if lora is not None:  # (inert: not the last step's table, after sleep mode's drop)
            lora.prepare(None, ())
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: kernel compilation and allocator state
                self._step(bucket, width)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            out = self._step(bucket, width)
        self.graphs[bucket, width] = (graph, out)
        self.capture_seconds += time.perf_counter() - start
        log.debug("captured a decode graph for batch %d, context width %d", bucket, width)
