"""One rank's view of how the model is split across ranks (`ParallelState`, over
`dsakv.config.parallel.ParallelConfig`), with the few collectives the model needs.

Under pipeline parallelism (`--pp-size`) the target layers are split into stages, each
stage `tp` ranks; the model's collectives run over the stage's TP group, the control plane
(rank 0's messages, the every-rank outcomes) over every rank, and a stage hands its
output to the same TP rank of the next stage point to point.

The layout follows SGLang (DESIGN.md §8):
- attention side (embedding, MLA, indexer, lm_head) is split over the *attention group*:
  every rank under plain TP, each rank alone under DP attention (whole weights per rank);
- FFN side (dense MLP, shared and routed experts) is split over all ranks: routed experts
  into `ep` groups of whole experts, each group splitting its experts' intermediate size
  over `tp / ep` ranks; one all-reduce after routed + shared.
Under DP attention each rank runs its own requests; the FFN gathers every rank's tokens
first and hands each rank its rows back.
"""

from __future__ import annotations

import datetime
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dsakv.config.parallel import ParallelConfig

ROWS_CHUNK_BYTES = 64 << 20  # the most one broadcast of `broadcast_rows` carries

# What a point-to-point message between ranks holds: each tensor's (shape, dtype), in order
Wire = list[tuple[tuple[int, ...], torch.dtype]]


class ParallelState:
    """One rank's place in the layout, and the collectives over its process group.

    `group` is this rank's pipeline stage's TP group (the model's collectives; None: the
    default group, every rank, as with one stage); `cpu_group` carries control messages
    over every rank. With one rank every collective is the identity, so the model code
    has one path.
    """

    def __init__(
        self,
        config: ParallelConfig | None = None,
        rank: int = 0,
        group: Any = None,
        cpu_group: Any = None,
    ) -> None:
        self.config = config or ParallelConfig()
        if not 0 <= rank < self.config.world_size:
            raise ValueError(f"rank {rank} outside 0..{self.config.world_size - 1}")
        self.rank = rank
        self.group = group  # the model's collectives (NCCL on CUDA, gloo on CPU)
        self.cpu_group = cpu_group  # control messages (always gloo)

    @classmethod
    def single(cls) -> ParallelState:
        return cls()

    # --- where this rank sits -------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Every rank (tp × pp): the control plane's."""
        return self.config.world_size

    @property
    def tp_size(self) -> int:
        """The ranks of this rank's stage (the model's collectives)."""
        return self.config.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.config.tp

    @property
    def pp_size(self) -> int:
        return self.config.pp

    @property
    def stage(self) -> int:
        """This rank's pipeline stage (ranks are stage-major)."""
        return self.rank // self.config.tp

    def stage_layers(self, num_layers: int) -> range:
        """The target layers this rank's stage runs (all of them with one stage)."""
        return self.config.stage_layers(num_layers)[self.stage]

    @property
    def is_driver(self) -> bool:
        """Rank 0 owns the scheduler (the first scheduler under DP attention) and the server."""
        return self.rank == 0

    @property
    def attn_size(self) -> int:
        return self.config.attn_tp

    @property
    def attn_rank(self) -> int:
        return 0 if self.config.dp_attention else self.tp_rank

    @property
    def ep_rank(self) -> int:
        """Which group of whole experts this rank serves."""
        return self.tp_rank // self.config.moe_tp

    @property
    def moe_tp_rank(self) -> int:
        """Which slice of its experts' intermediate size this rank holds."""
        return self.tp_rank % self.config.moe_tp

    # --- collectives over the stage's TP group (identity on one rank) ---------------------

    def tp_sync(self, device: torch.device) -> None:
        """Return once every rank of the stage's TP group has come here (a one-element
        all-reduce the host waits for): host memory one of them wrote before it is what the
        others read after it."""
        if self.tp_size > 1:
            x = torch.zeros(1, device=device)
            dist.all_reduce(x, group=self.group)
            x.item()  # (on CUDA the host waits for it here)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the stage's ranks (after o_proj under TP, after the FFN)."""
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_attn(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the attention group (a no-op under DP attention)."""
        if self.attn_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def sum_in_rank_order(self, x: torch.Tensor) -> torch.Tensor:
        """`all_reduce`, each value summed in rank order whatever the tensor's size (the
        native blocks' sums under --tp, per-token batch invariant): gloo's ring adds a
        value in an order set by where its chunk falls, which moves with the batch. Two
        ranks add once, and addition commutes: the plain all-reduce."""
        if self.tp_size <= 2:
            return self.all_reduce(x)
        parts = self.all_gather_run(x, self.tp_size)
        out = parts[0].clone()
        for part in parts[1:]:
            out += part
        return out

    def all_gather_attn(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate each attention rank's `x` along `dim` (vocab-parallel logits)."""
        if self.attn_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.attn_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def all_gather_run(self, x: torch.Tensor, parts: int) -> torch.Tensor:
        """Each `x` of the `parts` ranks from `tp_rank // parts * parts` on (the ranks that
        split one weight: the stage's every rank, or an expert group's moe_tp ranks),
        stacked `[parts, ...]`. A run shorter than the stage gathers over all of it and
        keeps its own: the one group the model has, no subgroup to create
        (--fully-sharded-loras' small shrinks)."""
        if parts == 1:
            return x[None]
        out = x.new_empty(self.tp_size, *x.shape)
        dist.all_gather(list(out.unbind(0)), x.contiguous(), group=self.group)
        start = self.tp_rank // parts * parts
        return out[start : start + parts]

    def gather_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """DP attention: every rank's rows `[T_r, H]`, stacked `[Σ T_r, H]`, and the counts.

        Ranks send different numbers of tokens (zero included), so rows are padded to the
        largest count for the all-gather and the padding is dropped again.
        """
        if self.tp_size == 1 or not self.config.dp_attention:
            return x, [x.shape[0]]
        n = torch.tensor([x.shape[0]], dtype=torch.long, device=x.device)
        counts_t = [torch.empty_like(n) for _ in range(self.tp_size)]
        dist.all_gather(counts_t, n, group=self.group)
        counts = [int(c) for c in counts_t]
        width = max(counts)
        padded = x.new_zeros(width, *x.shape[1:])
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(self.tp_size)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p[:c] for p, c in zip(parts, counts)]), counts

    def scatter_tokens(self, y: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """DP attention: sum every rank's partial FFN output over all tokens, keep own rows.

        (An all-reduce then a slice: gloo has no reduce-scatter, and the sum is the same.)
        """
        if self.tp_size == 1 or not self.config.dp_attention:
            return self.all_reduce(y)
        self.all_reduce(y)
        return y[self.own_rows(counts)]

    def own_rows(self, counts: list[int]) -> slice:
        """This rank's rows of `gather_tokens`' stacked rows (all of them but under DP
        attention)."""
        if self.tp_size == 1 or not self.config.dp_attention:
            return slice(None)
        start = sum(counts[: self.tp_rank])
        return slice(start, start + counts[self.tp_rank])

    # --- point to point between pipeline stages (the default group) -----------------------

    def send_next(self, tensors: list[torch.Tensor], like: Wire) -> None:
        """This stage's output to the same TP rank of the next stage, in order, as `like`
        (the `recv_prev` there reads) says (`agreed`)."""
        for t in agreed(tensors, like):
            dist.send(t, self.rank + self.tp_size)

    def recv_prev(self, like: Wire, device: torch.device) -> list[torch.Tensor]:
        """What the previous stage's same TP rank sent (`send_next`): one tensor of each
        (shape, dtype) of `like`, in order."""
        out = []
        for shape, dtype in like:
            t = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(t, self.rank - self.tp_size)
            out.append(t)
        return out

    def to_driver(
        self, x: torch.Tensor | None, shape: tuple[int, ...], device: torch.device
    ) -> torch.Tensor | None:
        """The last stage's `x` (its TP rank 0's: its ranks hold the same) on rank 0, which
        returns it; the last stage returns its own, the other ranks None. The identity with
        one stage."""
        if self.pp_size == 1:
            return x
        last = (self.pp_size - 1) * self.tp_size
        if self.rank == last:
            (x,) = agreed([x], [(shape, torch.float32)])
            dist.send(x, 0)
        elif self.rank == 0:
            x = torch.empty(shape, dtype=torch.float32, device=device)
            dist.recv(x, last)
        return x

    def stages_to_driver(self, x: torch.Tensor) -> torch.Tensor | None:
        """The sum on rank 0 of every stage's `x` (its TP rank 0's), each stage having
        filled only its own part of it, zeros elsewhere (its layers' routing); the other
        ranks None. The identity with one stage."""
        if self.pp_size == 1:
            return x
        if self.rank == 0:
            total = x.clone()
            for stage in range(1, self.pp_size):
                part = torch.empty_like(x)
                dist.recv(part, stage * self.tp_size)
                total += part
            return total
        if self.tp_rank == 0:
            dist.send(x.contiguous(), 0)
        return None

    def stages_side_by_side(
        self, x: torch.Tensor | None, widths: Sequence[int]
    ) -> torch.Tensor | None:
        """On rank 0, every stage's `x` (its TP rank 0's, `[n, widths[stage]]`) side by side
        in stage order, on the CPU (a stage's layers follow the one before's: the whole
        model's page rows); the other ranks None. One stage: `x`."""
        if self.pp_size == 1:
            return x
        if self.rank == 0:
            assert x is not None
            parts = [x]
            for stage in range(1, self.pp_size):
                parts.append(x.new_empty(x.shape[0], widths[stage]))
                dist.recv(parts[-1], stage * self.tp_size)
            return torch.cat(parts, dim=1).cpu()
        if self.tp_rank == 0:
            assert x is not None
            dist.send(x.contiguous(), 0)
        return None

    def stage_columns(
        self, x: torch.Tensor | None, widths: Sequence[int], n: int, device: torch.device
    ) -> torch.Tensor | None:
        """Rank 0's `x` (`[n, sum(widths)]`, stage after stage) cut by stage: each stage's TP
        rank 0 gets its `widths[stage]` columns (on `device`), rank 0 keeping its own; the
        other ranks None. One stage: `x`."""
        if self.pp_size == 1:
            return x
        if self.rank == 0:
            assert x is not None
            cols = x.to(device).split(list(widths), dim=1)
            for stage in range(1, self.pp_size):
                dist.send(cols[stage].contiguous(), stage * self.tp_size)
            return cols[0]
        if self.tp_rank != 0:
            return None
        part = torch.empty(n, widths[self.stage], dtype=torch.uint8, device=device)
        dist.recv(part, 0)
        return part

    def broadcast_rows(
        self,
        n: int,
        width: int,
        read: Callable[[slice], torch.Tensor],
        write: Callable[[slice, torch.Tensor], Any],
        device: torch.device,
        control: bool = False,
    ) -> None:
        """Rows [0, n) of `width` bytes that only the stage's first rank holds (`read(rows)`,
        uint8 `[len, width]`) into every other rank of the stage (`write(rows, data)`), at
        most `ROWS_CHUNK_BYTES` a broadcast: over the model's group (NCCL on CUDA, tensors on
        `device`), or with `control` CPU tensors over gloo (one stage only: the control group
        is every rank's)."""
        if self.tp_size == 1:
            return
        group, src = self.group, self.rank - self.tp_rank
        if control:
            assert self.pp_size == 1, "the control group spans every stage"
            group, src, device = self.cpu_group, 0, torch.device("cpu")
        step = max(1, ROWS_CHUNK_BYTES // width)
        for lo in range(0, n, step):
            rows = slice(lo, min(n, lo + step))
            if self.rank == src:
                dist.broadcast(read(rows).contiguous(), src=src, group=group)
                continue
            data = torch.empty((rows.stop - lo, width), dtype=torch.uint8, device=device)
            dist.broadcast(data, src=src, group=group)
            write(rows, data)

    # --- control plane (rank 0 → everyone, pickled, over gloo) ----------------------------

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0 sends `obj`; every rank returns it."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Rank 0 receives every rank's `obj` (in rank order); other ranks get None."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.cpu_group)
        return out

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (in rank order) on every rank: a decision all ranks must take
        alike from each one's outcome (`Engine.update_weights_here`'s phases)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out


def agreed(tensors: list[torch.Tensor], like: Wire) -> list[torch.Tensor]:
    """`tensors` as their receiver reads them (`like`): each cast to its dtype, contiguous.
    NCCL and gloo move bytes and check neither dtype nor shape, so a tensor the sender made
    otherwise is cast here, never misread there; a count or shape the receiver does not
    expect is a bug, said here."""
    shapes = [tuple(t.shape) for t in tensors]
    if shapes != [tuple(shape) for shape, _ in like]:
        raise RuntimeError(f"sending {shapes} where the receiver reads {like}")
    return [t.to(dtype).contiguous() for t, (_, dtype) in zip(tensors, like)]


def init_parallel(
    config: ParallelConfig,
    rank: int,
    init_method: str,
    device: torch.device,
) -> ParallelState:
    """Join the process group (NCCL on CUDA, gloo on CPU) and return this rank's state."""
    timeout = datetime.timedelta(seconds=config.timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    global _excepthook
    _excepthook = sys.excepthook  # (torch wraps it, adding "[rankN]: "; put back on destroy)
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=config.world_size,
        timeout=timeout,
        **({"device_id": device} if device.type == "cuda" else {}),
    )
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    return ParallelState(
        config, rank, group=_stage_group(config, rank, timeout), cpu_group=cpu_group
    )


def _stage_group(config: ParallelConfig, rank: int, timeout: datetime.timedelta) -> Any:
    """This rank's stage's TP group (None with one stage: the default group). Every rank
    makes every stage's group, in the same order, as `dist.new_group` requires."""
    if config.pp == 1:
        return None
    groups = [
        dist.new_group(range(s * config.tp, (s + 1) * config.tp), timeout=timeout)
        for s in range(config.pp)
    ]
    return groups[rank // config.tp]


_excepthook = None


def destroy_parallel() -> None:
    global _excepthook
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if _excepthook is not None:  # (else each engine's group added one more "[rank0]: ")
        sys.excepthook, _excepthook = _excepthook, None


def is_dist_error(e: BaseException) -> bool:
    """A collective failed (a peer rank died or timed out), not a bug in this process."""
    return isinstance(e, getattr(dist, "DistError", ())) or "gloo" in str(e).lower()
