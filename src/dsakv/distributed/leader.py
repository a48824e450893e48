"""`Leader`: rank 0's channel to the other ranks, one message at a time.

The other ranks wait in a broadcast for rank 0's next message. A collective that waits
longer than the timeout fails (that is how a dead rank is noticed), so while rank 0 has
nothing to say it sends a heartbeat. `lock` is held for a message and the collectives
that follow it, so a heartbeat never lands between them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from .parallel import ParallelState, is_dist_error

log = logging.getLogger(__name__)

NOOP = ("noop",)
STOP = ("stop",)


class Leader:
    def __init__(self, parallel: ParallelState) -> None:
        self.parallel = parallel
        self.lock = threading.RLock()
        self.stopped = False
        self._last_sent = time.monotonic()
        threading.Thread(target=self._heartbeat, name="dsakv-heartbeat", daemon=True).start()

    def send(self, msg: Any) -> None:
        """Broadcast `msg` to every rank (call with `lock` held)."""
        self.parallel.broadcast_object(msg)
        self._last_sent = time.monotonic()

    def stop(self) -> None:
        """Tell the other ranks to leave their loop; idempotent. In a group a dead rank
        broke there is no one left to tell: closing goes on (the watchdog ends the rest)."""
        with self.lock:
            if self.stopped:
                return
            self.stopped = True
            try:
                self.send(STOP)
            except Exception as e:
                if not is_dist_error(e):
                    raise
                log.info("the other ranks could not be told to stop: %s", e)

    def _heartbeat(self) -> None:
        period = self.parallel.config.timeout_s / 4
        while not self.stopped:
            time.sleep(min(period, 1.0))
            if time.monotonic() - self._last_sent < period:
                continue
            with self.lock:
                if self.stopped:
                    return
                try:
                    self.send(NOOP)
                except Exception:  # the step loop reports the broken group
                    return
