"""SGLang's `--watchdog-timeout`: a server whose engine step never returns (a collective a
dead peer will never join, a kernel that spins, a deadlock) exits instead of hanging.

Hung, it would keep answering /health while every request waits forever; exited, whatever
supervises it (systemd, Kubernetes, a router's health checks) sees it gone and restarts or
routes around it. Only steps are timed: an idle, paused or sleeping engine, and the calls
run between steps (weight updates, /stop_profile's trace write), never trip it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)

WATCHDOG_EXIT_CODE = 70  # (EX_SOFTWARE: an internal error, not a bad request or argument)


class StepWatchdog:
    """Times each engine step (`with watchdog.step():`) from a thread of its own; a step
    running past `timeout_s` logs every thread's stack (where it hangs) and ends the process
    at once (`os._exit`: the stuck engine thread could never run a clean shutdown; rank
    processes follow their parent's death, `procs.die_with_parent`). `timeout_s` None: no
    watch (nothing is timed)."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self._started: float | None = None  # the running step's start (monotonic), or None
        self._closed = threading.Event()
        if timeout_s is not None:
            threading.Thread(target=self._watch, name="dsakv-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        self._started = time.monotonic()
        try:
            yield
        finally:
            self._started = None

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        assert self.timeout_s is not None
        poll = min(1.0, max(self.timeout_s / 10, 0.01))  # (a tiny timeout: no busy loop)
        while not self._closed.wait(poll):
            started = self._started
            if started is not None and time.monotonic() - started > self.timeout_s:
                self._fire(time.monotonic() - started)

    def _fire(self, ran_s: float) -> None:
        log.critical(
            "watchdog: an engine step has run %.1f s, past --watchdog-timeout %g s; the "
            "engine is stuck: every thread's stack follows, then the server exits",
            ran_s,
            self.timeout_s,
        )
        with contextlib.suppress(Exception):  # (stderr closed: exit all the same)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
        os._exit(WATCHDOG_EXIT_CODE)
