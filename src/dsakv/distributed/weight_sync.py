"""The process group a trainer opens to send the served model its weights (SGLang's
/init_weights_update_group and /update_weights_from_distributed, as RL frameworks such as
slime, verl and AReaL call them): a group of its own beside the engine's ranks' (never the
default one), the trainer its rank 0 and engine rank r its rank `rank_offset + r`; an update
is the trainer broadcasting the named tensors it listed, in that order. The group is made as
those trainers make theirs (`torch.distributed`'s rendezvous over `tcp://`, then its group
helper), so the two sides meet."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from dsakv.errors import DsakvError

# How long joining waits for the trainer and the other ranks, and how long a broadcast waits
# for the trainer's tensors.
JOIN_TIMEOUT = datetime.timedelta(seconds=120)
RECEIVE_TIMEOUT = datetime.timedelta(minutes=10)
BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class WeightGroup:
    """SGLang's `InitWeightsUpdateGroupReqInput`."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"

    def check(self, ranks: int, device: torch.device) -> None:
        """One clear error for a group this engine's `ranks` cannot join on `device`."""
        if self.backend not in BACKENDS:
            raise DsakvError(f"backend {self.backend!r} is not supported ({', '.join(BACKENDS)})")
        if self.backend == "nccl" and device.type != "cuda":
            raise DsakvError(
                f"backend nccl needs CUDA (this engine runs on {device.type}): use gloo"
            )
        if self.rank_offset < 1 or self.rank_offset + ranks > self.world_size:
            raise DsakvError(
                f"rank_offset {self.rank_offset} and world_size {self.world_size} leave no room "
                f"for this engine's {ranks} rank(s) after the trainer's rank 0"
            )
        if not 0 < self.master_port < 65536:
            raise DsakvError(f"master_port {self.master_port} is not a port")


@dataclass(frozen=True)
class GroupUpdate:
    """SGLang's `UpdateWeightsFromDistributedReqInput`: the tensors the trainer broadcasts
    over `group_name`, by checkpoint name, in order; `flush_cache` drops the prefix cache
    after (a trainer sending its weights in buckets keeps it until the last)."""

    group_name: str
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    flush_cache: bool = True

    def check(self) -> list[torch.dtype]:
        """The tensors' dtypes; one clear error for metadata that cannot be received (what
        can be received but not loaded is refused after it: `loader.check_tensors`)."""
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise DsakvError(
                f"names, dtypes and shapes differ in length ({len(self.names)}, "
                f"{len(self.dtypes)}, {len(self.shapes)})"
            )
        if any(d < 0 for shape in self.shapes for d in shape):
            raise DsakvError("a shape has a negative size")
        return [_dtype(name) for name in self.dtypes]


@dataclass(frozen=True, eq=False)
class TensorUpdate:
    """SGLang's `Engine.update_weights_from_tensor`: named tensors this process holds (a
    trainer's in the same process), by checkpoint name, some or all of the model's; under
    `--tp` they go to every rank with the update's message."""

    tensors: tuple[tuple[str, torch.Tensor], ...]
    flush_cache: bool = True


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise DsakvError(f"dtype {name!r} is not a torch dtype")
    return dtype


def join(spec: WeightGroup, rank: int) -> dist.ProcessGroup:
    """Join the trainer's group as `rank` (waits for every member: `JOIN_TIMEOUT`)."""
    url = f"tcp://{spec.master_address}:{spec.master_port}"
    try:
        store, rank, world = next(c10d.rendezvous(url, rank, spec.world_size, timeout=JOIN_TIMEOUT))
        store.set_timeout(JOIN_TIMEOUT)  # (the group's connections wait on the store)
        group, _ = c10d._new_process_group_helper(
            world,
            rank,
            [],
            spec.backend,
            store,
            group_name=spec.group_name,
            timeout=RECEIVE_TIMEOUT,
        )
        store.set_timeout(RECEIVE_TIMEOUT)
    except (RuntimeError, ValueError, OSError) as e:  # (torch's DistError too)
        raise DsakvError(f"joining {spec.group_name!r} at {url} failed: {e}") from None
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}
    return group


def receive(
    group: dist.ProcessGroup, update: GroupUpdate, backend: str, device: torch.device
) -> list[tuple[str, torch.Tensor]]:
    """The tensors the trainer broadcasts for `update` (on `device` over nccl, else on the
    CPU)."""
    where = device if backend == "nccl" else torch.device("cpu")
    tensors = [
        torch.empty(shape, dtype=dtype, device=where)
        for shape, dtype in zip(update.shapes, update.check())
    ]
    try:
        works = [dist.broadcast(t, group=group, group_src=0, async_op=True) for t in tensors]
        for work in works:
            work.wait()
    except (RuntimeError, ValueError) as e:
        raise DsakvError(f"receiving the weights over {update.group_name!r} failed: {e}") from None
    return list(zip(update.names, tensors))


def leave(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)
