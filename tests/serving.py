"""Running real dsakv servers on loopback ports for a test (on a thread, or as `dsakv serve`
processes), reading their metrics, and stopping them after."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from dsakv.disagg.config import DisaggConfig
from dsakv.disagg.launch import wait_healthy
from dsakv.disagg.router import build_router_app
from dsakv.disagg.serving import bridge_for
from dsakv.engine import EngineConfig
from dsakv.errors import DsakvError
from dsakv.models.tiny import write_tiny_model
from dsakv.procs import free_port
from dsakv.server import make_server
from dsakv.server.runner import AsyncEngine

from .conftest import flat_logprobs

TIMEOUT = 30.0  # every wait on a server is bounded by this


def port_taken(port: int) -> bool:
    """Whether another process could not listen on `port` now (bound as uvicorn binds)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return True
    return False


@contextlib.contextmanager
def running(server: uvicorn.Server) -> Iterator[str]:
    """Run a uvicorn server on a thread; yields its base URL and stops it afterwards."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)
        assert not thread.is_alive(), "server did not stop"


@contextlib.contextmanager
def serving(config: EngineConfig, **server_args) -> Iterator[tuple[str, AsyncEngine]]:
    """`make_server(config)` running: yields (base URL, its AsyncEngine)."""
    server, async_engine = make_server(config, port=free_port(), log_level="warning", **server_args)
    try:
        with running(server) as base:
            yield base, async_engine
    finally:
        async_engine.shutdown()
        async_engine.close_engine()  # on the engine thread, which then ends


@contextlib.contextmanager
def serving_disagg(
    config: EngineConfig,
    mode: str,
    api_key: str | None = None,
    server_args: dict[str, Any] | None = None,
    **disagg: Any,
) -> Iterator[tuple[str, AsyncEngine]]:
    """`serving` a prefill or decode server (`DisaggConfig(mode, **disagg)`; waits on its
    peer 30 s unless `timeout_s` says, a prefill server's bootstrap on a free port unless
    `bootstrap_port` says), behind `api_key` if given, `make_server` given `server_args`
    too: yields (base URL, its AsyncEngine)."""
    disagg = {"timeout_s": 30, **disagg}
    if mode == "prefill":
        disagg.setdefault("bootstrap_port", free_port())
    bridge = bridge_for(DisaggConfig(mode, **disagg), config, "127.0.0.1")
    with serving(config, bridge=bridge, api_key=api_key, **(server_args or {})) as served:
        yield served


@contextlib.contextmanager
def serving_two_prefills(model_dir: Path) -> Iterator[SimpleNamespace]:
    """Two prefill servers (`prefill`, their URLs) and a decode server (`decode`) on a
    glm-tiny model written to `model_dir`: a deployment whose router has a pick to make."""
    model = str(write_tiny_model(model_dir, "glm-tiny"))
    conf = EngineConfig(model, device="cpu", num_pages=64, page_size=16,
                        kv_cache_dtype="fp32", index_k_dtype="fp32")  # fmt: skip
    with contextlib.ExitStack() as stack:
        prefill = [stack.enter_context(serving_disagg(conf, "prefill"))[0] for _ in range(2)]
        decode, _ = stack.enter_context(serving_disagg(conf, "decode"))
        yield SimpleNamespace(prefill=prefill, decode=decode)


@contextlib.contextmanager
def routing(
    prefill: list[str], decode: list[str], api_key: str | None = None, **router_args: Any
) -> Iterator[str]:
    """`dsakv router` over the servers `prefill` and `decode` (on a thread), given
    `build_router_app`'s `router_args` (`policy`, `tracing`): yields its URL."""
    app = build_router_app(prefill, decode, api_key, **router_args)
    server = uvicorn.Server(uvicorn.Config(app, port=free_port(), log_level="warning"))
    with running(server) as base:
        yield base


def until_in_flight(url: str, held) -> None:
    """Wait until the server `url` has one request in flight (`held`, its client's future,
    still running)."""
    deadline = time.monotonic() + TIMEOUT
    while httpx.get(f"{url}/load", timeout=TIMEOUT).json()["server_load"] != 1:
        assert not held.done(), held.result()
        assert time.monotonic() < deadline, f"the request never reached {url}"
        time.sleep(0.05)


@contextlib.contextmanager
def engine_held_until_an_abort(async_engine, monkeypatch) -> Iterator[None]:
    """Hold the engine thread (between steps) until the server asks for an abort, so a
    request cannot finish before its client's hang-up is seen, however fast the machine
    (the tiny models write 500 tokens in half a second)."""
    asked = threading.Event()
    abort = async_engine.abort

    def abort_and_tell(stream, **kw) -> None:
        abort(stream, **kw)
        asked.set()

    monkeypatch.setattr(async_engine, "abort", abort_and_tell)
    with _held(async_engine, asked):
        yield
        assert asked.wait(TIMEOUT), "the server asked no abort"


class _Paused:
    """The engine as the server's engine thread sees it: without work (so it takes no step)
    once every request in flight has `tokens` output tokens; everything else is the engine's,
    so the thread still applies adds, aborts, counter reads and calls (`Engine.flush_cache`
    asks the engine itself: requests in flight still count there)."""

    def __init__(self, engine, tokens: int) -> None:
        self.engine, self.tokens = engine, tokens

    def has_unfinished(self) -> bool:
        reqs = self.engine.requests.values()
        short = any(len(r.output_ids) < self.tokens for r in reqs if not r.finished)
        return short and self.engine.has_unfinished()

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


@contextlib.contextmanager
def engine_stops_stepping_at(async_engine, tokens: int) -> Iterator[None]:
    """Inside the block, the server's engine steps only until each request in flight has
    `tokens` output tokens: a request is still running when the test looks, however fast
    the machine (the tiny models write 900 tokens in a second), and can only end by an
    abort. Its thread blocks on its command queue meanwhile (as when idle), not spinning."""
    paused = _Paused(async_engine.engine, tokens)
    async_engine.engine = paused
    try:
        yield
    finally:
        async_engine.engine = paused.engine
        if async_engine.alive:  # wake the thread, blocked while it saw no work
            asyncio.run(asyncio.wait_for(async_engine.call(lambda e: None), TIMEOUT))


def engine_thread_held(async_engine) -> contextlib.AbstractContextManager[None]:
    """The engine thread held between steps (in a call) from the block's start to its end, as
    by one long step: whatever is queued meanwhile waits for it. The hold is known to have
    begun when the block starts, and ends only with the block (or after `TIMEOUT`)."""
    return _held(async_engine, threading.Event())


@contextlib.contextmanager
def _held(async_engine, release: threading.Event) -> Iterator[None]:
    """The engine thread held in a call from the block's start until `release` is set (at
    the block's end at the latest, or after `TIMEOUT`)."""
    held = threading.Event()
    holder = threading.Thread(
        target=lambda: asyncio.run(async_engine.call(lambda e: held.set() or release.wait(TIMEOUT)))
    )
    holder.start()
    try:
        assert held.wait(TIMEOUT), "the engine thread was not held"
        yield
    finally:
        release.set()
        holder.join(TIMEOUT)


# --- `dsakv serve` processes (prefill/decode disaggregation, kill tests) -------------------------


class ServerProcess:
    """A `dsakv serve` process (model name "m") with its log in a file; killed by `stop`."""

    def __init__(self, log_dir: Path, name: str, model: str, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"{name}.log"
        cmd = [sys.executable, "-m", "dsakv.cli", "serve", model, "--port", str(self.port)]
        cmd += ["--served-model-name", "m", *flags]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(TIMEOUT)

    def tail(self) -> str:
        return self.log.read_text()[-3000:]

    def wait_healthy(self, timeout: float = TIMEOUT) -> None:
        """Until it answers /health; its log's tail if it exits or `timeout` passes first."""
        try:
            wait_healthy([self.url], [self.proc], timeout)
        except DsakvError as e:
            raise AssertionError(f"{e}\n{self.tail()}") from None


@contextlib.contextmanager
def servers_at_once(procs: dict[str, ServerProcess], timeout: float) -> Iterator[SimpleNamespace]:
    """Yields a function that waits for every server in `procs` (started meanwhile, so
    their loads overlap) and gives their URLs by name; every one is stopped after (its
    other ranks die with it: parent-death signal), one that failed to start too."""
    try:
        yield lambda: _healthy(procs, timeout)
    finally:
        for p in procs.values():
            p.stop()


def _healthy(procs: dict[str, ServerProcess], timeout: float) -> SimpleNamespace:
    for p in procs.values():
        p.wait_healthy(timeout)
    return SimpleNamespace(**{name: p.url for name, p in procs.items()})


def start_prefill(log_dir: Path, name: str, model: str, *flags: str) -> tuple[ServerProcess, int]:
    """A prefill server on a free bootstrap port; returns it and that port."""
    bport = free_port()
    p = ServerProcess(log_dir, name, model, "--disaggregation-mode", "prefill",
                      "--disaggregation-bootstrap-port", str(bport), *flags)  # fmt: skip
    return p, bport


def start_decode(log_dir: Path, name: str, model: str, *flags: str) -> ServerProcess:
    return ServerProcess(log_dir, name, model, "--disaggregation-mode", "decode", *flags)


def scrape_metrics(base: str, labels: bool = False) -> dict[Any, float]:
    """A server's /metrics samples by name (the last sample of each name), or with `labels`
    by (name, its labels sorted)."""
    out: dict[Any, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=30).text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items()))) if labels else s.name] = s.value
    return out


def metric(m: dict, name: str, **labels: str) -> float:
    """The sample of `name` with exactly `labels` in a `scrape_metrics(..., labels=True)`."""
    return m[(name, tuple(sorted(labels.items())))]


def grown(before: dict, after: dict, name: str, **labels: str) -> float:
    """How much `metric` grew from one labelled scrape to a later one (absent before: 0)."""
    key = (name, tuple(sorted(labels.items())))
    return after[key] - before.get(key, 0)


def disagg_info(base: str) -> dict:
    return httpx.get(f"{base}/disagg/info", timeout=30).json()


def wait_idle(base: str) -> dict[str, float]:
    """Poll a prefill/decode server until it is idle with every page free or prefix-cached
    (no leak); returns its metrics then."""
    deadline = time.monotonic() + TIMEOUT
    while (info := disagg_info(base))["integrity"] != "ok":
        assert time.monotonic() < deadline, info
        time.sleep(0.1)
    m = scrape_metrics(base)
    assert m["dsakv_kv_pages_used"] == m["dsakv_kv_pages_cached"], m
    assert m["dsakv_kv_transfer_pending"] == 0
    return m


GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})  # openai-client greedy kwargs
# Chat without the reasoning block the tiny GLM template opens (as GLM-5's): the output is
# all content, comparable with a completion of the rendered prompt.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
GREEDY_CHAT = dict(temperature=0, extra_body={"ignore_eos": True, **NO_THINKING})


def check_pd_chat(client, decode_url: str, reference, max_tokens: int, **stream_kw):
    """Chat through a PD pair equals one engine's greedy output, logprobs included (the
    first token's logprob comes from the prefill server); returns the streamed chunks."""
    import pytest

    from dsakv.engine import SamplingParams

    messages = [{"role": "user", "content": "Name a colour."}]
    body = {"messages": messages, **NO_THINKING}
    ids = httpx.post(f"{decode_url}/tokenize", json=body).json()["tokens"]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2)
    ref = reference.generate([ids], params)[0]
    r = client.chat.completions.create(
        model="m", messages=messages, max_tokens=max_tokens, logprobs=True, top_logprobs=2,
        **GREEDY_CHAT,
    )  # fmt: skip
    assert r.choices[0].message.content == ref.text
    want = flat_logprobs(ref.outputs[0].logprobs, ref.token_ids)
    assert [x.logprob for x in r.choices[0].logprobs.content] == pytest.approx(want, abs=1e-4)
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=messages,
            max_tokens=max_tokens,
            stream=True,
            **stream_kw,
            **GREEDY_CHAT,
        )  # fmt: skip
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    return chunks


def sglang_generate(base: str, headers: dict | None = None, **body: Any) -> Any:
    """SGLang's /generate, answered 200: its JSON."""
    r = httpx.post(f"{base}/generate", json=body, headers=headers, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def sglang_stream(base: str, path: str = "/generate", **body: Any) -> list[dict]:
    """SGLang's /generate (or `path`) streamed: each event's JSON, the stream ended by
    [DONE]."""
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        events = [x for x in r.iter_lines() if x.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    return [json.loads(x[6:]) for x in events[:-1]]


# --- OpenAI's Batch API (`dsakv serve`'s, the router's, `dsakv run-batch`'s) --------------------


def batch_until(client: Any, batch_id: str, *statuses: str) -> Any:
    """The batch (through the openai `client`) once its status is one of `statuses`."""
    deadline = time.monotonic() + TIMEOUT
    while (got := client.batches.retrieve(batch_id)).status not in statuses:
        assert time.monotonic() < deadline, got
        time.sleep(0.05)
    return got


def batch_lines(client: Any, file_id: str | None) -> list[dict]:
    """The lines of a batch's output or error file (none: no such file)."""
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def answer_of(body: Any) -> Any:
    """A response body without what differs from one call to the next (its ids and times)
    or with the prefix cache (cached tokens)."""
    if isinstance(body, list):
        return [answer_of(x) for x in body]
    if not isinstance(body, dict):
        return body
    varies = ("id", "created", "created_at", "completed_at")
    varies += ("prompt_tokens_details", "input_tokens_details")
    return {k: answer_of(v) for k, v in body.items() if k not in varies}
