"""SGLang's `--watchdog-timeout`: a server whose engine step hangs logs where every thread
stands and exits (a hung server would keep answering /health while its requests wait
forever); steps that end in time, and an idle server, never trip it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from dsakv.disagg.launch import wait_healthy
from dsakv.engine import EngineConfig
from dsakv.errors import DsakvError
from dsakv.procs import free_port
from dsakv.server.runner import _watchdog_timeout
from dsakv.server.watchdog import WATCHDOG_EXIT_CODE

TIMEOUT_S = 5  # the server's watchdog (a tiny model's step takes milliseconds)
HANG = [7, 7, 7]  # a prompt starting so makes the step hang

# `dsakv serve` whose engine step never returns once a request starting with HANG is in the
# batch: a stand-in for a collective whose peer is gone or a kernel that spins.
_SERVE_WITH_A_HANGING_STEP = textwrap.dedent(f"""
    import sys, time
    from dsakv.engine.engine import Engine

    step = Engine.step

    def hanging_step(self):
        if any(r.prompt_ids[:3] == {HANG} for r in self.requests.values()):
            time.sleep(3600)
        return step(self)

    Engine.step = hanging_step
    from dsakv.cli import main

    sys.exit(main(sys.argv[1:]))
""")


def _completion(base: str, prompt: list[int], timeout: float) -> httpx.Response:
    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=timeout)


def test_a_hung_step_ends_the_server_with_every_thread_s_stack(glm_tiny, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-c", _SERVE_WITH_A_HANGING_STEP, "serve", glm_tiny]
    cmd += ["--port", str(port), "--served-model-name", "m"]
    cmd += ["--watchdog-timeout", str(TIMEOUT_S)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy([base], [proc], 180)
        assert _completion(base, [5, 6, 8, 9], 60).status_code == 200  # (steps in time)
        time.sleep(TIMEOUT_S + 2)  # idle past the timeout: no step runs, nothing trips
        assert proc.poll() is None, log.read_text()[-3000:]
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        threading.Thread(  # (its client waits with the server: never answered)
            target=lambda: pytest.raises(httpx.HTTPError, _completion, base, HANG + [9], 120),
            daemon=True,
        ).start()
        code = proc.wait(TIMEOUT_S + 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    text = log.read_text()
    assert code == WATCHDOG_EXIT_CODE, text[-3000:]
    assert f"past --watchdog-timeout {TIMEOUT_S:g} s" in text, text[-3000:]
    assert "hanging_step" in text  # (the dump shows where the engine thread hangs)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "300", True])
def test_a_timeout_no_clock_can_keep_is_refused(bad):
    with pytest.raises(DsakvError, match="watchdog_timeout must be a positive number"):
        EngineConfig(model="glm-tiny", watchdog_timeout=bad)


def test_a_step_s_wait_for_stored_pages_is_not_a_hang(tmp_path):
    """An idle engine's step waits for a request's L3 pages up to the prefetch timeout by
    design (a slow store): the watchdog allows that wait on top of its own timeout."""
    store = dict(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path))
    slow = EngineConfig(model="glm-tiny", watchdog_timeout=5, **store,
                        hicache_storage_prefetch_timeout=30)  # fmt: skip
    assert _watchdog_timeout(slow) == 35
    assert _watchdog_timeout(EngineConfig(model="glm-tiny", watchdog_timeout=5)) == 5
    assert _watchdog_timeout(EngineConfig(model="glm-tiny", watchdog_timeout=None)) is None
