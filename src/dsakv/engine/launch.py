"""Start an engine's ranks: one process per rank, each with its own device (CUDA) or its
own share of the CPU threads.

`create_engine(config)` is what `LLM`, `dsakv generate/serve/bench` call. With `--tp 1`
it is just `Engine(config)`. Otherwise this process becomes the first rank of its node
and spawns the node's other ranks (or, under `torchrun`, every process is one rank
already). Rank 0 gets the engine back; every other rank follows rank 0 until it stops,
then exits. A watchdog on each node notices a rank process that dies, names it, and ends
every local rank, so nothing hangs and nothing is orphaned; a rank whose parent dies is
killed with it (Linux parent-death signal).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
from tqdm import tqdm

from dsakv.config import ModelConfig
from dsakv.distributed.parallel import ParallelConfig, destroy_parallel, init_parallel
from dsakv.errors import DsakvError
from dsakv.procs import die_with_parent, free_port

from .dp import DPEngine, serve_dp_peer
from .engine import Engine, resolve_device

log = logging.getLogger(__name__)


def create_engine(config: Any, *, exit_on_rank_death: bool = False) -> Any:
    """An `Engine` (one rank), or rank 0's `Engine` / `DPEngine` with the other ranks
    running. `exit_on_rank_death`: a dead rank ends this process (servers, CLI) instead of
    surfacing as an error from the next step (library use)."""
    pc: ParallelConfig = config.parallel
    if pc.world_size == 1:
        return Engine(config)
    pc.check_model(ModelConfig.from_hf(config.model))
    device_type = resolve_device(config.device).type
    if device_type == "cuda" and torch.cuda.device_count() < pc.ranks_per_node:
        raise DsakvError(
            f"--tp {pc.tp} over {pc.nnodes} node(s) needs {pc.ranks_per_node} CUDA devices "
            f"per node, found {torch.cuda.device_count()}"
        )
    torchrun = _torchrun_rank(pc)
    if torchrun is not None:
        rank, init, procs = torchrun, "env://", {}
    else:
        rank = pc.node_rank * pc.ranks_per_node
        addr = pc.dist_init_addr or f"127.0.0.1:{free_port()}"
        init = f"tcp://{addr}"
        ctx = mp.get_context("spawn")
        pipes = {r: ctx.Pipe(duplex=False) for r in range(rank + 1, rank + pc.ranks_per_node)}
        procs = {
            r: ctx.Process(target=_rank_main, args=(config, r, init, send), name=f"dsakv-rank{r}")
            for r, (_, send) in pipes.items()
        }
        for p in procs.values():
            p.start()
        for _, send in pipes.values():
            send.close()  # the child's end: EOF here once it has gone
        _wait_started(procs, {r: recv for r, (recv, _) in pipes.items()}, pc.timeout_s)
    watchdog = Watchdog(procs, exit_on_rank_death or rank != 0)
    try:
        engine = _start_rank(config, rank, init)
    except BaseException:
        watchdog.close(kill=True)
        raise
    if rank != 0:  # this process only follows rank 0
        engine.close()
        watchdog.close()
        sys.exit(0)
    engine.on_close.append(watchdog.close)
    return engine


def _start_rank(config: Any, rank: int, init: str) -> Any:
    """Join the group and build this rank's engine; rank 0's is returned, others serve."""
    pc: ParallelConfig = config.parallel
    local_rank = rank % pc.ranks_per_node
    device = resolve_device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // pc.ranks_per_node))
    parallel = init_parallel(pc, rank, init, device)
    engine = Engine(config, parallel, device)
    if rank == 0:
        return DPEngine(engine) if pc.dp_attention else engine
    try:
        if pc.dp_attention:
            serve_dp_peer(engine)
        else:
            engine.runner.serve()
    finally:
        destroy_parallel()
    return engine


def _wait_started(procs: dict[int, Any], started: dict[int, Connection], timeout: float) -> None:
    """Until every spawned rank has started (`_rank_main` runs): one that dies first, or
    is not there within `timeout` seconds, is an error here. Rank 0 would otherwise wait for
    it in the group's rendezvous; under `LLM(tp=2)` a script without a main guard kills
    every rank this way (spawn re-runs the script's top level in the child, which may not
    start processes)."""
    waiting = dict(started)
    deadline = time.monotonic() + timeout
    while waiting:
        ready = wait(list(waiting.values()), max(0.0, deadline - time.monotonic()))
        if not ready:
            for p in procs.values():
                p.kill()
            raise DsakvError(
                f"rank(s) {sorted(waiting)} did not start within {timeout:g} s (a script "
                "that creates a multi-rank LLM runs again in each rank up to its "
                '`if __name__ == "__main__":` guard)'
            )
        for r, conn in list(waiting.items()):
            if conn not in ready:
                continue
            del waiting[r]
            try:
                conn.recv()
            except EOFError:
                for p in procs.values():
                    p.kill()
                procs[r].join()
                raise DsakvError(
                    f"rank {r} exited with code {procs[r].exitcode} before it started (its "
                    "error is above); a script that creates a multi-rank LLM needs an "
                    '`if __name__ == "__main__":` guard, as spawned processes re-run its '
                    "top level"
                ) from None
            finally:
                conn.close()


def _rank_main(config: Any, rank: int, init: str, started: Connection) -> None:
    """Entry point of a spawned rank process."""
    die_with_parent(signal.SIGKILL)  # killed when the process that spawned it dies
    # This process ends with os._exit, so nothing would release a multiprocessing lock
    # (tqdm makes one for its bars): a thread lock serves one process as well.
    tqdm.set_lock(threading.RLock())
    started.send(rank)
    started.close()
    try:
        _start_rank(config, rank, init)
    except BaseException as e:  # noqa: BLE001 - report any failure as this rank's
        print(f"dsakv rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    os._exit(0)


class Watchdog:
    """Watches this node's spawned ranks; one that exits unexpectedly ends them all."""

    def __init__(self, procs: dict[int, Any], exit_on_death: bool) -> None:
        self.procs = procs
        self.exit_on_death = exit_on_death
        self.failure: str | None = None
        self._closing = threading.Event()
        if procs:
            threading.Thread(target=self._watch, name="dsakv-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while not self._closing.wait(0.2):
            for rank, p in self.procs.items():
                if p.exitcode is None or self._closing.is_set():
                    continue
                self.failure = f"rank {rank} exited with code {p.exitcode}"
                print(f"dsakv: {self.failure}; stopping every rank", file=sys.stderr, flush=True)
                self._kill_all()
                if self.exit_on_death:
                    os._exit(1)
                return

    def _kill_all(self) -> None:
        for p in self.procs.values():
            if p.exitcode is None:
                p.kill()
        for p in self.procs.values():
            p.join(5)

    def close(self, kill: bool = False, timeout: float = 30.0) -> None:
        """Wait for the ranks to leave (after rank 0 said stop); kill stragglers."""
        self._closing.set()
        deadline = time.monotonic() + (0 if kill else timeout)
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill_all()


def _torchrun_rank(pc: ParallelConfig) -> int | None:
    """This process's rank when started by torchrun (RANK / WORLD_SIZE in the env)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    if world != pc.world_size:
        raise DsakvError(f"torchrun started {world} processes but --tp is {pc.tp}")
    return int(os.environ["RANK"])
