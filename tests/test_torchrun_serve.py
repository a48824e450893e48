"""`dsakv serve` with more than one process: only rank 0's process takes --port. Every
process took it before the engine loaded, so under torchrun local rank 1 failed on
"Address already in use", as did node 1 of two nodes on one host sharing --port."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest

from dsakv.config.parallel import ParallelConfig
from dsakv.engine import launch
from dsakv.engine.launch import process_rank

from .conftest import cli_error_line

MASTER_PORT, PORT = 18670, 18671  # (this file's ports)


def test_only_rank_0s_process_serves(monkeypatch):
    """The rank `create_engine` gives this process decides who listens: torchrun's RANK,
    else the node's first rank; one rank is rank 0 whatever the environment says."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert process_rank(ParallelConfig(tp=2)) == 0
    nodes = dict(nnodes=2, node_rank=1, dist_init_addr=f"127.0.0.1:{MASTER_PORT}")
    assert process_rank(ParallelConfig(tp=2, **nodes)) == 1
    assert process_rank(ParallelConfig(tp=2, pp=2, **nodes)) == 2
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        assert process_rank(ParallelConfig(tp=2)) == rank
    monkeypatch.setenv("RANK", "1")
    assert process_rank(ParallelConfig()) == 0  # (one rank: torchrun's env is not read)


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--served-model-name", ""], "a served model name must not be empty"),
        (["--served-model-name", "a", "--enable-lora", "--lora-modules", "a=/x"], "adapter name"),
    ],
)
def test_a_follower_refuses_what_rank_0s_server_refuses(glm_tiny, monkeypatch, capsys, flags, said):
    """Torchrun's rank 1 refuses, before its engine starts, what rank 0's server refuses
    before the load (`check_serving`; parser names and TLS files fail in every process
    earlier): every process fails at once (it waited out the rendezvous for a rank 0 that
    had failed)."""

    def loaded(*args, **kwargs):
        raise AssertionError("the follower's engine started before the server's checks")

    monkeypatch.setattr(launch, "create_engine", loaded)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["serve", glm_tiny, "--device", "cpu", "--tp", "2", *flags]
    assert said in cli_error_line(argv, capsys)


def _wait_up(proc: subprocess.Popen, url: str) -> None:
    """Until `url` answers 200; the server's process ending first fails with its stderr."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"torchrun exited {proc.returncode}: {proc.communicate()[1][-2000:]}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail("the server did not come up in 120 s")


def test_serve_under_torchrun_tp2(glm_tiny):
    """torchrun --nproc-per-node 2 serve --tp 2: rank 0 serves, rank 1 follows (it took
    the port too and failed); a completion runs over both ranks."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(MASTER_PORT), "-m", "dsakv.cli", "serve", glm_tiny,
        "--device", "cpu", "--tp", "2", "--port", str(PORT), "--num-pages", "16",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_up(proc, f"http://127.0.0.1:{PORT}/health")
        body = {"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True}
        r = httpx.post(f"http://127.0.0.1:{PORT}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        info = httpx.get(f"http://127.0.0.1:{PORT}/server_info", timeout=10).json()
        assert info["tp_size"] == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    assert "Address already in use" not in err
