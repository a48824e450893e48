"""Child processes and local ports: the few helpers every layer that starts a process or
listens needs (the Mooncake master, engine ranks, `dsakv serve-pd`'s servers, bench's
server, uvicorn serving a `Listener`'s sockets). They sit at the bottom, beside `errors`,
so each of those layers uses this one copy instead of its own."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import uvicorn

from dsakv.errors import DsakvError

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # prctl options, <linux/prctl.h>
_PR_SET_NAME = 15


_GIVEN: set[int] = set()  # ports `free_port` handed out, maybe not bound yet
_GIVEN_LOCK = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at `host` now (the OS picks it), and not one this
    process was given before: a server told a port binds it later, and meanwhile the OS
    may offer the same one again."""
    with _GIVEN_LOCK:
        while True:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _GIVEN:
                _GIVEN.add(port)
                return port


def split_address(address: str, flag: str, note: str = "") -> tuple[str, int]:
    """`HOST:PORT` as (host, port), the port in 1..65535; anything else is refused in one
    line naming `flag` (`note` follows `HOST:PORT` in it)."""
    if not isinstance(address, str):  # (a port number alone, say: it had no rpartition)
        raise DsakvError(f"{flag} must be HOST:PORT{note}, got {address!r}")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DsakvError(f"{flag} must be HOST:PORT{note}, got {address!r}")
    return host, int(port)


def die_with_parent(sig: int) -> None:
    """Linux: have this process sent `sig` when its parent dies (parent-death signal);
    elsewhere nothing. Call it in the child: a `preexec_fn`, a spawned process's entry."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


def name_process(name: str) -> None:
    """Linux: show this process as `name` (its first 15 bytes) in `ps -o comm`, `top` and
    `pgrep`, where a forked process shows its parent's name; elsewhere nothing."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15])


# What a terminal's Ctrl-C, `timeout`, or systemd's KillMode=control-group sends to every
# process of the job at once, a parent and the children it stops itself alike.
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block SIGINT and SIGTERM in this thread while the body starts children that its
    process stops itself: a child inherits the mask, so one sent to the whole process group
    before the child has called `ignore_stop_signals` waits there (and is then dropped)
    instead of killing it halfway through its imports. Here it is delivered on exit."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_stop_signals() -> None:
    """In a child started under `stop_signals_blocked` (its main thread): ignore SIGINT and
    SIGTERM from now on, dropping any that wait. Its parent stops it, and it dies with its
    parent (`die_with_parent`), so a stop sent to the group is the parent's to act on."""
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[Callable[[], None]]:
    """Hold a Ctrl-C until the body calls the check it is given (which raises it), or
    until the body ends: for work that an interrupt must not cut in the middle (a step's
    collectives, which left ranks out of step; torch's imports, which swallow it or leave a
    half-loaded module behind). Only the main thread receives signals; elsewhere, or where
    SIGINT is ignored, nothing is held."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield lambda: None
        return
    hits: list[int] = []

    def check() -> None:
        if hits:
            hits.clear()
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, lambda signum, frame: hits.append(signum))
    try:
        yield check
    finally:
        signal.signal(signal.SIGINT, previous)
    check()


def exit_on_sigterm(signum: int, frame: object) -> None:
    """A SIGTERM handler that raises SystemExit, so `finally` blocks still run: uvicorn
    re-raises the SIGTERM it caught once it has stopped."""
    raise SystemExit(128 + signum)


def stop_processes(procs: Sequence[subprocess.Popen], timeout_s: float = 5.0) -> None:
    """Terminate every one still running, then wait for each; kill one that has not
    exited within `timeout_s`."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)


def stop_process(proc: subprocess.Popen, timeout_s: float = 5.0) -> None:
    """`stop_processes` for one."""
    stop_processes([proc], timeout_s)


_BACKLOG = 2048  # uvicorn's default


class Listener:
    """TCP sockets listening on `host:port` from now on, bound as uvicorn binds (one per
    address the host resolves to, SO_REUSEADDR, IPv6 only on an IPv6 one, as asyncio's
    `create_server` does), for a server to serve later (`uvicorn.Server.run(sockets=...)`):
    nothing else can take the port meanwhile, and connections made before the server
    starts wait in the backlog. A bad address or a port in use is one `DsakvError` line."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.sockets: list[socket.socket] = []
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            for family, kind, proto, _, address in dict.fromkeys(infos):
                sock = socket.socket(family, kind, proto)
                self.sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
                sock.listen(_BACKLOG)
        except OSError as e:
            self.close()
            raise DsakvError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None

    def close(self) -> None:
        """Stop listening (idempotent)."""
        for sock in self.sockets:
            sock.close()

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AppServer(uvicorn.Server):
    """Serves `sockets` when given (bound before the engine loaded) and prints `banner`
    once it listens; aborts in-flight requests first on shutdown, so open streams end at
    once (with finish_reason "abort") instead of holding shutdown until they complete."""

    def __init__(
        self,
        config: uvicorn.Config,
        async_engine: Any = None,  # (`AsyncEngine`)
        sockets: list[socket.socket] | None = None,
        banner: str | None = None,
    ) -> None:
        super().__init__(config)
        self.async_engine = async_engine
        self.sockets = sockets
        self.banner = banner

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        await super().serve(sockets if sockets is not None else self.sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.banner:
            log.info("%s", self.banner)
            print(self.banner, flush=True)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.async_engine is not None:
            self.async_engine.abort_all()
        await super().shutdown(sockets)


def serve_app(
    app: Any, listener: Listener, banner: str, log_level: str = "warning", **uvicorn_kw: Any
) -> None:
    """Serve an ASGI `app` on `listener`'s sockets until interrupted, printing `banner`
    once it serves (the router: here, below the engine, so that it loads no torch);
    `uvicorn_kw`: more of uvicorn's settings (TLS)."""
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5, **uvicorn_kw)
    AppServer(config, sockets=listener.sockets, banner=banner).run()
