"""Start an engine's ranks: one process per rank, each with its own device (CUDA) or its
own share of the CPU threads.

`create_engine(config)` is what `LLM`, `dsakv generate/serve/bench` call. With one rank
(`--tp 1`, `--pp-size 1`) it is just `Engine(config)`. Otherwise there are tp × pp ranks:
this process becomes the first rank of its node and starts the node's other ranks (or,
under `torchrun`, every process is one rank already). They are forked from a forkserver of
dsakv's own (`_rank_server`), which imports torch and dsakv once (a spawned rank imported
them itself, ~2.5 s of CPU each), and take this process's environment, umask, stdout and
stderr as they are when each starts. Rank 0 gets the engine back; every other rank follows
rank 0 until it stops, then exits. A watchdog on each node notices a rank process that
dies, names it, and ends every local rank, so nothing hangs and nothing is orphaned; a rank
whose launcher dies kills itself, and one still running when the launcher exits is killed
then. A rank ignores SIGINT and SIGTERM: a Ctrl-C or a `kill` sent to the whole process
group is the launcher's to act on (it stops its ranks, or they die with it). A rank that
fails while the engine starts is reported once, by the launcher (`RankDied`, or the same
`DsakvError` every rank met: rank 0's own wins), at once even when it dies before the
process group has formed. One multi-rank engine runs in a process at a time (they would
share torch.distributed's default process group): a second is refused until the first
closes.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from multiprocessing import context, forkserver, popen_forkserver, reduction, resource_tracker
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from tqdm import tqdm

from dsakv.config import ModelConfig
from dsakv.config.parallel import ParallelConfig
from dsakv.distributed.parallel import destroy_parallel, init_parallel, is_dist_error
from dsakv.errors import DsakvError
from dsakv.procs import (
    Listener,
    die_with_parent,
    free_port,
    ignore_stop_signals,
    name_process,
    split_address,
    stop_signals_blocked,
)

from .config import resolve_device
from .dp import DPEngine, serve_dp_peer
from .engine import Engine, RankDied

log = logging.getLogger(__name__)


def create_engine(config: Any, *, exit_on_rank_death: bool = False) -> Any:
    """An `Engine` (one rank), or rank 0's `Engine` / `DPEngine` with the other ranks
    running. `exit_on_rank_death`: a dead rank ends this process (servers, CLI) instead of
    surfacing as an error from the next step (library use)."""
    pc: ParallelConfig = config.parallel
    if pc.world_size == 1:
        return Engine(config)
    if getattr(mp.current_process(), "_inheriting", False):
        # A spawned rank re-running the script that made this engine at its top level (no
        # `if __name__ == "__main__":` guard): it leaves quietly, and its parent says why.
        # (os._exit: the forkserver turns a SystemExit raised this early into exit code 1.)
        sys.stdout.flush()
        os._exit(_NO_MAIN_GUARD)
    if (
        _torchrun_rank(pc) is None
        and getattr(sys.modules["__main__"], "__file__", None) == "<stdin>"
    ):
        # (each rank imports the launcher's main script: rank 1's FileNotFoundError was
        # reported as "rank 1 exited with code 1 during startup", its cause in a traceback)
        raise DsakvError(
            f"{pc.ranks_flags} starts its ranks from the main script, and this one was read "
            "from standard input: save it to a file and run that"
        )
    pc.check_model(ModelConfig.from_hf(config.model))
    device_type = resolve_device(config.device).type
    if device_type == "cuda" and torch.cuda.device_count() < pc.ranks_per_node:
        raise DsakvError(
            f"{pc.ranks_flags} over {pc.nnodes} node(s) needs {pc.ranks_per_node} CUDA devices "
            f"per node, found {torch.cuda.device_count()}"
        )
    release = _claim_process_group()
    try:
        engine = _launch(config, exit_on_rank_death)
    except BaseException:
        release()
        raise
    engine.on_close.insert(0, release)  # the last to run: after the ranks have left
    return engine


def _launch(config: Any, exit_on_rank_death: bool) -> Any:
    pc: ParallelConfig = config.parallel
    torchrun, rank = _torchrun_rank(pc), process_rank(pc)
    reports: dict[int, Connection] = {}
    if torchrun is not None:
        init, procs = "env://", {}
    else:
        if pc.nnodes > 1 and not pc.dist_init_addr:  # (torchrun's env names its own)
            raise DsakvError("--nnodes > 1 needs --dist-init-addr HOST:PORT")
        if rank == 0 and pc.dist_init_addr:
            _check_rendezvous_port(pc.dist_init_addr)
        addr = pc.dist_init_addr or f"127.0.0.1:{free_port()}"
        init = f"tcp://{addr}"
        pipes = {r: mp.Pipe(duplex=False) for r in range(rank + 1, rank + pc.ranks_per_node)}
        inherited = _Inherited(dict(os.environ), _umask())
        procs = {
            r: _RankProcess(
                target=_rank_main,
                args=(config, r, init, send, inherited, _Stdio()),
                name=f"dsakv-rank{r}",
            )
            for r, (_, send) in pipes.items()
        }
        # (Started by the first `start`, multiprocessing's resource tracker would unblock
        # them after: it blocks the same two signals while it starts its own process.)
        resource_tracker.ensure_running()
        # Blocked until each rank has called `ignore_stop_signals`, and for good in the
        # rank server (its children inherit its mask): a stop sent to the process group is
        # the launcher's to act on, as for the ranks.
        with stop_signals_blocked():
            for p in procs.values():
                p.start()
                _spawned.add(p)
        for _, send in pipes.values():
            send.close()  # the child's end: EOF here once it has gone
        reports = {r: recv for r, (recv, _) in pipes.items()}
        try:
            _wait_started(procs, reports, pc.timeout_s, pc.rank_name)
        except BaseException:  # (a Ctrl-C too: the ranks ignore it)
            _kill(procs.values())
            for conn in reports.values():
                conn.close()
            raise
    watchdog = Watchdog(procs, exit_on_rank_death or rank != 0, reports, pc.rank_name)
    try:
        engine = _start_rank(config, rank, init, watchdog)
    except BaseException as e:
        failure = watchdog.startup_failure(e)
        watchdog.close(kill=True)
        if failure is not None:  # what ended rank 0's startup: another rank's failure
            raise failure from None
        raise
    if rank != 0:  # this process only follows rank 0
        engine.close()
        watchdog.close()
        sys.exit(0)
    engine.on_close.append(watchdog.close)
    return engine


def _check_rendezvous_port(addr: str) -> None:
    """Rank 0's rendezvous (a TCPStore) listens on `addr`'s port on every address: one in
    use is one line now, before any rank starts. It used to be rank 0's EADDRINUSE after
    every rank had started, and another rank's C++ stacks from pinging what held the port."""
    _, port = split_address(addr, "--dist-init-addr")
    try:
        Listener("0.0.0.0", port).close()
    except DsakvError as e:
        raise DsakvError(f"--dist-init-addr {addr}: rank 0's rendezvous {e}") from None


# One multi-rank engine per process: its ranks share torch.distributed's default group.
_group_lock = threading.Lock()
_group_owner: list[bool] = []  # [True] while this process runs one


def _claim_process_group() -> Callable[[], None]:
    """Refuse a second multi-rank engine while one runs here (torch.distributed has one
    default process group a process; the second died in `init_process_group`, a traceback
    after spawning its ranks); the function returned gives the claim back, once."""
    with _group_lock:
        if _group_owner:
            raise DsakvError(
                "one multi-rank engine per process: close the other first "
                "(`with LLM(...) as llm:` or `llm.close()`)"
            )
        if dist.is_available() and dist.is_initialized():
            raise DsakvError(
                "torch.distributed's default process group is already initialized in this "
                "process; a multi-rank engine makes its own (destroy the other first)"
            )
        _group_owner.append(True)
    done = threading.Event()

    def release() -> None:
        if done.is_set():
            return
        done.set()
        destroy_parallel()  # (Engine.close would next: this claim ends with the group)
        with _group_lock:
            _group_owner.clear()

    return release


def _start_rank(config: Any, rank: int, init: str, watchdog: Watchdog | None = None) -> Any:
    """Join the group and build this rank's engine; rank 0's is returned, others serve.
    `watchdog`: the launcher's, over the ranks it spawned (told when startup is over)."""
    pc: ParallelConfig = config.parallel
    local_rank = rank % pc.ranks_per_node
    device = resolve_device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // pc.ranks_per_node))

    def join() -> Any:
        if device.type == "cuda":
            torch.cuda.set_device(device)  # (the current device is per thread)
        return init_parallel(pc, rank, init, device)

    parallel = join() if watchdog is None else watchdog.rendezvous(join)
    engine = Engine(config, parallel, device)
    if watchdog is not None:
        engine.rank_failure = lambda: watchdog.failure_seen(_DEATH_SEEN_S)
    # Startup ends on every rank together: rank 0's fails (and says why) if another rank's
    # does, rather than serving until its first step meets the dead rank.
    parallel.broadcast_object(None)
    if watchdog is not None:
        watchdog.started()
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


# A spawned rank's exit code when it found itself re-running a script without a main guard.
_NO_MAIN_GUARD = 87
# After another rank died during startup, how long rank 0's own startup may take to fail
# (a collective with the dead rank fails within seconds) before a server ends itself.
_STARTUP_GRACE_S = 10.0
# How long a collective that broke waits for the watch to see a rank's exit (its poll: 0.2 s)
# and name the rank with its error, rather than report the transport's
_DEATH_SEEN_S = 2.0


def _exit_text(rank: str, code: int | None, during_startup: bool) -> str:
    """How a rank's process ended, in words (`rank`: its `ParallelConfig.rank_name`)."""
    when = " during startup" if during_startup else ""
    if code is not None and code < 0:
        try:
            name = f", {signal.Signals(-code).name}"
        except ValueError:
            name = ""
        return f"{rank} died{when} (signal {-code}{name})"
    return f"{rank} exited with code {code}{when}"


def _wait_started(
    procs: dict[int, Any],
    started: dict[int, Connection],
    timeout: float,
    name: Callable[[int], str],
) -> None:
    """Until every spawned rank has started (`_rank_main` runs): one that dies first, or
    is not there within `timeout` seconds, is an error here. Rank 0 would otherwise wait for
    it in the group's rendezvous. Under `LLM(tp=2)` in a script without a main guard each
    spawned rank re-runs the script's top level, meets the `LLM` there and leaves with
    `_NO_MAIN_GUARD`: that is the error that names the guard."""
    waiting = dict(started)
    deadline = time.monotonic() + timeout
    while waiting:
        ready = wait(list(waiting.values()), max(0.0, deadline - time.monotonic()))
        if not ready:
            for p in procs.values():
                p.kill()
            raise RankDied(f"rank(s) {sorted(waiting)} did not start within {timeout:g} s")
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
                if procs[r].exitcode == _NO_MAIN_GUARD:
                    raise DsakvError(
                        "a script that creates a multi-rank LLM needs an "
                        '`if __name__ == "__main__":` guard around it: each rank is a spawned '
                        "process, which re-runs the script's top level"
                    ) from None
                raise RankDied(_exit_text(name(r), procs[r].exitcode, True)) from None


def _rank_main(
    config: Any, rank: int, init: str, conn: Connection, inherited: _Inherited, stdio: Any
) -> None:
    """Entry point of a rank process. `conn` tells the launcher it started and, if it
    fails, why (the launcher reports it once: rank 0's own error wins). `inherited` and
    `stdio` (`_Stdio`): the launcher's now, where the rank server's are as they were when
    it started."""
    die_with_parent(signal.SIGKILL)  # killed when the rank server that forked it dies
    name_process(mp.current_process().name)  # ("dsakv-rank1": `ps`, `top`, `pgrep`)
    ignore_stop_signals()  # the launcher stops it (module docstring)
    os.environ.clear()
    os.environ.update(inherited.env)
    if inherited.umask is not None:
        os.umask(inherited.umask)
    for fd, launchers in zip((1, 2), stdio, strict=True):
        os.dup2(launchers, fd)
        os.close(launchers)
    # The launcher's death closes its end of the pipe multiprocessing gave this process
    # (its sentinel); the forkserver, this process's parent, outlives it while ranks run.
    launcher = mp.parent_process()
    threading.Thread(target=_die_with, args=(launcher,), name="dsakv-launcher", daemon=True).start()
    # This process ends with os._exit, so nothing would release a multiprocessing lock
    # (tqdm makes one for its bars): a thread lock serves one process as well.
    tqdm.set_lock(threading.RLock())
    try:
        conn.send(rank)
    except OSError:  # the launcher died as this rank started: go quietly
        os._exit(1)
    try:
        _start_rank(config, rank, init)
    except BaseException as e:  # noqa: BLE001 - report any failure as this rank's
        try:
            conn.send((isinstance(e, DsakvError), f"{type(e).__name__}: {e}", str(e)))
        except OSError:  # the launcher has gone: say it here
            said = f"{config.parallel.rank_name(rank)}: {type(e).__name__}: {e}"
            print(f"dsakv {said}", file=sys.stderr, flush=True)
        os._exit(1)
    os._exit(0)


def _die_with(launcher: Any) -> None:
    launcher.join()
    os.kill(os.getpid(), signal.SIGKILL)


class _Inherited(NamedTuple):
    """What a rank takes from its launcher as it starts (`_rank_main`; multiprocessing
    passes the working directory and sys.path)."""

    env: dict[str, str]
    umask: int | None


def _umask() -> int | None:
    """This process's umask, read without setting it (Linux: /proc; elsewhere None)."""
    with contextlib.suppress(OSError, StopIteration, ValueError):
        status = Path("/proc/self/status").read_text().splitlines()
        return int(next(ln for ln in status if ln.startswith("Umask:")).split()[1], 8)
    return None


# The ranks' forkserver: multiprocessing's, but an instance of dsakv's own, not the one its
# "forkserver" context shares with the user's processes. It imports this module (torch and
# dsakv) once, and blocks SIGINT and SIGTERM for good: the user's forkserver children keep
# their own preloads and signals. A rank takes from it what it does not take from its
# launcher (`_Inherited`, `_Stdio`): CPU affinity, niceness and resource limits, so a
# launcher whose own have changed since gets a new server.
_server_lock = threading.Lock()
_server: list[tuple[forkserver.ForkServer, tuple[Any, ...]]] = []


def _server_state() -> tuple[Any, ...]:
    import resource

    limits = [getattr(resource, n) for n in dir(resource) if n.startswith("RLIMIT_")]
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    return affinity, nice, tuple(resource.getrlimit(r) for r in sorted(limits))


def _rank_server() -> forkserver.ForkServer:
    """The running rank server whose process state is this process's (call with stop
    signals blocked: a new one keeps the mask)."""
    state = _server_state()
    with _server_lock:
        if _server and _server[0][1] == state:
            return _server[0][0]
        if _server:  # (it leaves once its ranks have: their copies of its pipe close)
            old = _server.pop()[0]
            os.close(old._forkserver_alive_fd)
            threading.Thread(target=os.waitpid, args=(old._forkserver_pid, 0), daemon=True).start()
        server = forkserver.ForkServer()
        server.set_forkserver_preload([__name__])
        server.ensure_running()
        _server.append((server, state))
        return server


class _RankPopen(popen_forkserver.Popen):
    """Starts a rank through the rank server: multiprocessing's launch, with its module's
    `connect_to_new_process` (the shared server's) pointed at the rank server meanwhile
    (started, like the ranks, with stop signals blocked: `_launch`)."""

    _routing = threading.Lock()

    def _launch(self, process_obj: Any) -> None:
        server = _rank_server()
        with self._routing:
            shared = forkserver.connect_to_new_process
            forkserver.connect_to_new_process = server.connect_to_new_process
            try:
                super()._launch(process_obj)
            finally:
                forkserver.connect_to_new_process = shared


class _RankProcess(context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> _RankPopen:
        return _RankPopen(process_obj)


class _Stdio:
    """The launcher's stdout and stderr as a rank starts, passed as file descriptors: the
    forkserver's are the launcher's when it started (under pytest, a finished test's
    captured output)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _detach, (reduction.DupFd(1), reduction.DupFd(2))


def _detach(*fds: Any) -> tuple[int, ...]:
    return tuple(fd.detach() for fd in fds)


class Watchdog:
    """Watches this node's spawned ranks; one that exits unexpectedly ends them all.

    While this node's engine starts, a rank that dies is not reported here: the startup of
    this process fails too (a collective with it breaks), and `startup_failure` says which
    error to raise, so the rank's failure is reported once (a bad setting fails every rank
    alike: rank 0's own error wins). Only a startup that has not failed `_STARTUP_GRACE_S`
    later is ended here (under `exit_on_death`)."""

    def __init__(
        self,
        procs: dict[int, Any],
        exit_on_death: bool,
        reports: dict[int, Connection],
        name: Callable[[int], str],
    ) -> None:
        self.procs = procs
        self.name = name  # (`ParallelConfig.rank_name`)
        self.exit_on_death = exit_on_death
        self.failure: str | None = None
        self._failed = threading.Event()  # (`failure` is set)
        self._first_dead: int | None = None  # (the others may die of `_kill_all`)
        self._reports = dict(reports)
        self._read: dict[int, tuple[bool, str, str] | None] = {}
        self._lock = threading.Lock()
        self._starting = True
        self._closing = threading.Event()
        if procs:
            threading.Thread(target=self._watch, name="dsakv-watchdog", daemon=True).start()

    def started(self) -> None:
        """This process's engine is built: a rank that dies from now on is reported here."""
        self._starting = False

    def failure_seen(self, within: float) -> str | None:
        """`failure`, waiting up to `within` seconds for the watch to see a rank's exit: a
        rank that raises breaks its collectives as it exits, a poll before the watch sees
        that (a hung rank: None, after the wait)."""
        self._failed.wait(within)
        return self.failure

    def _report(self, rank: int) -> tuple[bool, str, str] | None:
        """What rank `rank` said when it failed (DsakvError?, "Type: message", message),
        once it has exited; None if it said nothing (killed, or exited cleanly)."""
        with self._lock:
            if rank not in self._read:
                conn, report = self._reports.pop(rank, None), None
                if conn is not None:
                    try:
                        while conn.poll():
                            report = conn.recv()
                    except (EOFError, OSError):
                        pass
                    conn.close()
                self._read[rank] = report if isinstance(report, tuple) else None
            return self._read[rank]

    def _describe(self, rank: int, during_startup: bool) -> str:
        report = self._report(rank)
        if report is not None:
            when = " during startup" if during_startup else ""
            return f"{self.name(rank)} failed{when}: {report[1].splitlines()[0]}"
        return _exit_text(self.name(rank), self.procs[rank].exitcode, during_startup)

    def _dead(self) -> int | None:
        """The rank that died first (as far as can be told), or None."""
        if self._first_dead is not None:
            return self._first_dead
        return next((r for r, p in self.procs.items() if p.exitcode is not None), None)

    def _watch(self) -> None:
        while not self._closing.wait(0.2):
            rank = self._dead()
            if rank is None or self._closing.is_set():
                continue
            if _exiting.is_set():
                return  # the interpreter exits and killed it (`_kill_ranks_at_exit`)
            self._first_dead = rank
            self.failure = self._describe(rank, self._starting)
            self._failed.set()
            if self._starting:
                self._kill_all()  # so a collective this process waits in fails now
                deadline = time.monotonic() + _STARTUP_GRACE_S
                while self._starting and time.monotonic() < deadline:
                    if self._closing.wait(0.1):
                        return  # this process's startup failed, and reports it
                if self._starting and not self.exit_on_death:
                    return  # (it will fail: its group is broken)
            print(f"dsakv: {self.failure}; stopping every rank", file=sys.stderr, flush=True)
            self._kill_all()
            if self.exit_on_death:
                os._exit(1)
            return

    def rendezvous(self, join: Callable[[], Any]) -> Any:
        """`join()` (this rank joining the group), waited for here: a spawned rank that dies
        first ends the wait at once (a `DistError`, which `startup_failure` names), where the
        rendezvous would wait for it until the timeout. `join` runs on a helper thread, which
        is then left to fail at that timeout, unheard."""
        if not self.procs:
            return join()
        done: Future[Any] = Future()

        def run() -> None:
            try:
                done.set_result(join())
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                done.set_exception(e)

        threading.Thread(target=run, name="dsakv-rendezvous", daemon=True).start()
        while not wait_futures([done], 0.1).done:
            if self._dead() is not None:
                raise dist.DistError("a rank died before the process group formed")
        return done.result()

    def startup_failure(self, error: BaseException) -> DsakvError | None:
        """What to raise for `error`, which ended this process's startup: None (itself)
        when it is this process's own `DsakvError` (bad input, seen alike by every rank)
        or nothing shows another rank failed; else the error of the rank that failed."""
        if not self.procs or isinstance(error, DsakvError) or not isinstance(error, Exception):
            return None
        if self.failure is None and not is_dist_error(error):
            return None
        sentinels = [p.sentinel for p in self.procs.values()]
        if self._dead() is None:  # the peer's exit may not show yet
            wait(sentinels, 3.0)
        rank = self._dead()
        if rank is None:
            return None
        report = self._report(rank)
        if report is not None and report[0]:
            return DsakvError(report[2])  # bad input that only that rank saw
        return RankDied(self._describe(rank, True))

    def _kill_all(self) -> None:
        _kill(self.procs.values())

    def close(self, kill: bool = False, timeout: float = 30.0) -> None:
        """Wait for the ranks to leave (after rank 0 said stop); kill stragglers."""
        self._closing.set()
        deadline = time.monotonic() + (0 if kill else timeout)
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill_all()
        with self._lock:
            for conn in self._reports.values():
                conn.close()
            self._reports.clear()


def _kill(procs: Iterable[Any]) -> None:
    """SIGKILL each rank process still running, then reap them."""
    procs = list(procs)
    for p in procs:
        if p.exitcode is None:
            p.kill()
    for p in procs:
        p.join(5)


# The rank processes spawned here (until they are gone), and whether the interpreter exits.
_spawned: weakref.WeakSet[Any] = weakref.WeakSet()
_exiting = threading.Event()


def _kill_ranks_at_exit() -> None:
    """At the interpreter's exit, kill the ranks still running (an engine whose startup a
    Ctrl-C cut short on another thread, as `dsakv serve`'s): they ignore SIGINT/SIGTERM and
    wait for rank 0, and multiprocessing's exit hook would wait for them."""
    _exiting.set()
    _kill(_spawned)


# Registered after multiprocessing's exit hook (`multiprocessing.connection`, imported
# above, registers it), so it runs before that hook; an `LLM`'s own close runs before both.
atexit.register(_kill_ranks_at_exit)


def process_rank(pc: ParallelConfig) -> int:
    """The rank `create_engine` makes this process: torchrun's RANK, else its node's first
    (`--node-rank` × ranks per node); 0 with one rank. Only rank 0's process serves (the
    others follow it), so `dsakv serve` takes its port there only."""
    if pc.world_size == 1:
        return 0
    torchrun = _torchrun_rank(pc)
    return pc.node_rank * pc.ranks_per_node if torchrun is None else torchrun


def _torchrun_rank(pc: ParallelConfig) -> int | None:
    """This process's rank when started by torchrun (RANK / WORLD_SIZE in the env)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    if world != pc.world_size:
        raise DsakvError(
            f"torchrun started {world} processes but {pc.ranks_flags} makes {pc.world_size} ranks"
        )
    return int(os.environ["RANK"])
