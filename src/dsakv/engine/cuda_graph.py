"""CUDA-graph decode: one captured target forward per batch-size bucket.

A decode step of a small batch is launch-bound on a GPU (hundreds of small kernels per
token), so the whole forward is captured once per bucket and replayed. Everything a
replay reads lives in static device buffers that are refreshed in place before it: the
tokens, positions, output slots, the context table (slots of every position, padded to a
fixed width) and the lengths. The captured ops must not sync with the host, which is why
only graph-safe backends (`triton`, `flashmla`) are captured; `ForwardBatch.padded_decode`
makes every Python-level branch in the model independent of the real lengths.

Eager runs of the same padded batch (`--disable-cuda-graph`, or a batch too large or too
long for the buffers) go through `ForwardBatch.padded_decode` too, so a graph replay and
an eager step compute the same numbers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from dsakv.models.forward_batch import ForwardBatch

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


class DecodeGraphs:
    """Static decode buffers and one graph per bucket, captured on first use."""

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
        ps = pool.page_size
        self.width = -(-max_len // ps) * ps
        n, long = self.buckets[-1], torch.long
        self.input_ids = torch.zeros(n, dtype=long, device=device)
        self.positions = torch.zeros(n, dtype=long, device=device)
        self.out_slots = torch.full((n,), -1, dtype=long, device=device)
        self.table = torch.zeros(n, self.width, dtype=long, device=device)
        self.lens = torch.zeros(n, dtype=long, device=device)
        self.use_graphs = use_graphs and device.type == "cuda"
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._mempool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # Host staging: one pinned copy per step instead of one small copy per request.
        pin = device.type == "cuda"
        self._host_table = torch.zeros(n, self.width, dtype=long, pin_memory=pin)
        self._host_rows = torch.zeros(4, n, dtype=long, pin_memory=pin)

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
        self._fill(new_tokens, slots, bucket)
        if not self.use_graphs:
            with torch.inference_mode():
                return self.model(self._batch(bucket), self.pool)[:b]
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket)
        graph, out = self.graphs[bucket]
        graph.replay()
        return out[:b]

    def _fill(self, new_tokens, slots, bucket: int) -> None:
        rows, table = self._host_rows, self._host_table
        rows[:, :bucket] = 0
        rows[2, :bucket] = -1  # padding rows write nowhere
        table[:bucket] = 0
        for i, (tok, s) in enumerate(zip(new_tokens, slots)):
            n = s.shape[0]
            table[i, :n] = s
            rows[0, i], rows[1, i], rows[2, i], rows[3, i] = tok[0], n - 1, int(s[n - 1]), n
        self.table[:bucket].copy_(table[:bucket], non_blocking=True)
        for dst, src in zip((self.input_ids, self.positions, self.out_slots, self.lens), rows):
            dst[:bucket].copy_(src[:bucket], non_blocking=True)

    def _batch(self, bucket: int) -> ForwardBatch:
        return ForwardBatch.padded_decode(
            self.input_ids[:bucket],
            self.positions[:bucket],
            self.out_slots[:bucket],
            self.table[:bucket],
            self.lens[:bucket],
        )

    def _capture(self, bucket: int):
        batch = self._batch(bucket)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # warm-up: kernel compilation and allocator state
                self.model(batch, self.pool)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool), torch.inference_mode():
            out = self.model(batch, self.pool)
        log.info("captured a decode graph for batch %d (context width %d)", bucket, self.width)
        return graph, out
