"""`ModelRunner`: runs the model for one engine step, on one rank or on all of them.

Under plain tensor parallelism only rank 0 schedules. Before each forward its runner
broadcasts what the other ranks need (the step's tokens and slots, and the host-tier
copies the scheduler made since the last step, so every rank's pool replica stays
identical); the other ranks sit in `serve()` and make the same calls, which meet in the
model's collectives. Under DP attention every rank schedules for itself, so nothing is
broadcast here (see `dsakv.distributed.dp`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from dsakv.distributed.leader import Leader
from dsakv.distributed.parallel import ParallelState
from dsakv.memory.host import HostPool
from dsakv.memory.pool import DSAKVPool
from dsakv.models.forward_batch import ForwardBatch


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        pool: DSAKVPool,
        host: HostPool | None,
        parallel: ParallelState,
        device: torch.device,
    ) -> None:
        self.model, self.pool, self.host = model, pool, host
        self.parallel, self.device = parallel, device
        follows_rank0 = parallel.world_size > 1 and not parallel.config.dp_attention
        if follows_rank0 and host is not None:
            host.journal = []
        self.leader = Leader(parallel) if follows_rank0 and parallel.is_driver else None

    def forward(
        self, new_tokens: Sequence[Sequence[int]], slots: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """Run one step's tokens (their KV goes to `slots`' tails); returns hidden `[T, H]`."""
        with self._leading() as send:
            if send:
                host_ops = self.host.take_journal() if self.host is not None else []
                packed = [torch.as_tensor(s).to("cpu", torch.int32) for s in slots]
                send(("forward", [list(t) for t in new_tokens], packed, host_ops))
            return self._forward(new_tokens, slots)

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[len(rows), vocab]` for `hidden[rows]` (a vocab-parallel all-gather)."""
        with self._leading() as send:
            if send:
                send(("logits", rows.cpu()))
            with torch.inference_mode():
                return self.model.compute_logits(hidden[rows])

    def stop(self) -> None:
        """Release the other ranks from `serve()`."""
        if self.leader is not None:
            self.leader.stop()

    def serve(self) -> None:
        """The other ranks under plain TP: make rank 0's calls until it says stop."""
        hidden = None
        while True:
            msg = self.parallel.broadcast_object()
            if msg[0] == "forward":
                _, tokens, slots, host_ops = msg
                if host_ops:
                    self.host.replay(host_ops)
                hidden = self._forward(tokens, [s.long() for s in slots])
            elif msg[0] == "logits":
                with torch.inference_mode():
                    self.model.compute_logits(hidden[msg[1].to(hidden.device)])
            elif msg[0] == "stop":
                return

    @contextlib.contextmanager
    def _leading(self):
        """Holds the leader's lock for a message and its collectives; yields its `send`."""
        if self.leader is None:
            yield None
            return
        with self.leader.lock:
            yield self.leader.send

    def _forward(self, new_tokens, slots) -> torch.Tensor:
        fb = ForwardBatch.from_requests(new_tokens, slots, device=self.device)
        with torch.inference_mode():
            return self.model(fb, self.pool)
