"""SGLang's /pause_generation and /continue_generation (RL frameworks' interruptible
sampling) end to end on a tiny model: a streamed request paused in place or retracted goes
on after continue to the output an unpaused run gives (retracted, its pages freed while
paused), an abort pause ends it as SGLang's abort, a request sent while paused waits for
continue, and a weight update while paused does not wait for the paused request, which then
ends, new requests on the new weights."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from dsakv.config.presets import TINY_PRESETS
from dsakv.engine import EngineConfig
from dsakv.models.tiny import write_tiny_model

from .serving import TIMEOUT, serving

# index_topk over every context: chunked prefill and cached prefixes change no number.
from .test_update_weights import ENGINE_ARGS

PROMPT = list(range(5, 45))
TOKENS = 24  # the request's output
AT = 6  # output tokens it has when paused
GREEDY = {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
ASK = {"input_ids": PROMPT, "sampling_params": GREEDY}


def _model(root, seed: int):
    p = copy.deepcopy(TINY_PRESETS["glm-tiny"])
    p["index_topk"] = 4096
    return write_tiny_model(root / f"glm-{seed}", preset=p, seed=seed, weights="fp32")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[int, Any]:
    root = tmp_path_factory.mktemp("pause")
    return {seed: _model(root, seed) for seed in (0, 1)}


def _config(path) -> EngineConfig:
    return EngineConfig(model=str(path), **ENGINE_ARGS)


def _generate(base: str, **body: Any) -> dict:
    r = httpx.post(f"{base}/generate", json={**ASK, **body}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def _post(base: str, path: str, timeout: float = TIMEOUT, **body: Any) -> httpx.Response:
    r = httpx.post(f"{base}{path}", json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    return r


def _on_engine(async_engine, fn):
    return asyncio.run(asyncio.wait_for(async_engine.call(fn), TIMEOUT))


class _Stream:
    """A streamed /generate read on a thread: each chunk as it comes."""

    def __init__(self, base: str, **body: Any) -> None:
        self.chunks: list[dict] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._read, args=(base, body), daemon=True)
        self.thread.start()

    def _read(self, base: str, body: dict) -> None:
        try:
            with httpx.stream(
                "POST", f"{base}/generate", json={**ASK, **body, "stream": True}, timeout=TIMEOUT
            ) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self.chunks.append(json.loads(line[6:]))
        except BaseException as e:  # noqa: BLE001 - raised by `last`
            self.error = e

    def tokens(self) -> int:
        return len(self.chunks[-1]["output_ids"]) if self.chunks else 0

    def wait_tokens(self, n: int) -> None:
        deadline = time.monotonic() + TIMEOUT
        while self.tokens() < n:
            assert self.error is None and time.monotonic() < deadline, self.error
            time.sleep(0.01)

    def last(self) -> dict:
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive(), "the stream did not end"
        assert self.error is None, self.error
        return self.chunks[-1]


@contextlib.contextmanager
def _frozen_at(async_engine, tokens: int) -> Iterator[None]:
    """Until the block ends, the engine takes no step once every request in it has `tokens`
    output tokens (its thread still goes through its commands between): the request is
    still running when the test pauses it, however fast the machine."""
    engine = async_engine.engine
    step, frozen = engine.step, threading.Event()
    frozen.set()

    def gated():
        live = [r for r in engine.requests.values() if not r.finished]
        if frozen.is_set() and live and all(len(r.output_ids) >= tokens for r in live):
            time.sleep(0.002)
            return []
        return step()

    engine.step = gated
    try:
        yield
    finally:
        frozen.clear()
        del engine.step


def _idle_and_intact(async_engine) -> None:
    def check(e) -> bool:
        e.check_integrity()
        return e.has_unfinished()

    assert not _on_engine(async_engine, check)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_paused_request_goes_on_to_its_unpaused_output(models, mode):
    """Paused with AT tokens, the request takes no step while paused (in place its KV kept;
    retracted, every page it held freed), then ends with an unpaused run's tokens."""
    with serving(_config(models[0])) as (base, async_engine):
        want = _generate(base)["output_ids"]
        _post(base, "/flush_cache")
        with _frozen_at(async_engine, AT):
            stream = _Stream(base)
            stream.wait_tokens(AT)
            r = _post(base, "/pause_generation", mode=mode)
        assert r.json() == {"message": "Generation paused successfully.", "status": "ok"}

        def state(e) -> dict:
            (req,) = e.requests.values()
            return {
                "running": len(e.scheduler.running),
                "waiting": len(e.scheduler.waiting),
                "pages": len(req.pages),
                "outputs": len(req.output_ids),
                "held": e.allocator.num_used_pages - e.cache.num_evictable_pages,
            }

        time.sleep(0.2)  # (no step may run meanwhile, nor after a call wakes the thread)
        paused = _on_engine(async_engine, state)
        time.sleep(0.2)
        assert _on_engine(async_engine, state) == paused
        assert paused["outputs"] == AT
        assert stream.tokens() == AT and stream.thread.is_alive()
        if mode == "in_place":
            assert paused["running"] == 1 and paused["pages"] > 0 and paused["held"] > 0
            assert httpx.post(f"{base}/flush_cache", timeout=TIMEOUT).status_code == 400
        else:  # back in the queue, no page its own nor locked: all free or evictable
            assert paused == {"running": 0, "waiting": 1, "pages": 0, "outputs": AT, "held": 0}
            _post(base, "/flush_cache")  # (SGLang's: retracted requests compute theirs again)
        r = _post(base, "/continue_generation")
        assert r.json() == {"message": "Generation continued successfully.", "status": "ok"}
        last = stream.last()
        assert last["output_ids"] == want
        assert last["meta_info"]["finish_reason"] == {"type": "length", "length": TOKENS}
        _idle_and_intact(async_engine)


def test_abort_pause_ends_requests_and_holds_new_ones(models):
    """Mode abort (the default) ends the request in flight as SGLang's abort, and returns
    once it ended; a request sent while paused waits for continue, then runs."""
    with serving(_config(models[0])) as (base, async_engine):
        want = _generate(base)["output_ids"]
        with _frozen_at(async_engine, AT):
            stream = _Stream(base)
            stream.wait_tokens(AT)
            _post(base, "/pause_generation")  # (no body: mode abort)
        last = stream.last()
        assert len(last["output_ids"]) == AT
        reason = last["meta_info"]["finish_reason"]
        assert reason == {
            "type": "abort",
            "message": "Aborted",
            "status_code": None,
            "err_type": None,
        }

        later: list[dict] = []
        sent = threading.Thread(target=lambda: later.append(_generate(base)), daemon=True)
        sent.start()
        time.sleep(0.5)
        assert sent.is_alive() and not later  # waiting, not refused
        assert _on_engine(async_engine, lambda e: len(e.requests)) == 0  # (nor in the engine)
        _post(base, "/continue_generation")
        sent.join(TIMEOUT)
        assert later and later[0]["output_ids"] == want
        _idle_and_intact(async_engine)


def test_a_wait_or_abort_pause_over_an_in_place_one_ends_its_request(models):
    """Paused in place, a "wait" pause has the engine step again and returns once the
    request ended (its whole output), an "abort" one (SGLang's too) aborts it at once;
    either way generation stays paused: a request sent meanwhile waits for /resume."""
    with serving(_config(models[0])) as (base, async_engine):
        want = _generate(base)["output_ids"]
        for pause in ({"mode": "wait"}, {"mode": "abort"}, None):
            with _frozen_at(async_engine, AT):
                stream = _Stream(base)
                stream.wait_tokens(AT)
                r = httpx.post(f"{base}/pause", params={"mode": "keep"}, timeout=TIMEOUT)
                assert r.status_code == 200, r.text
            time.sleep(0.1)
            if pause is None:
                _post(base, "/pause_generation", timeout=10, mode="abort")
            else:
                r = httpx.post(f"{base}/pause", params=pause, timeout=10)
                assert r.status_code == 200, r.text
            last = stream.last()
            if pause == {"mode": "wait"}:
                assert last["output_ids"] == want
                assert last["meta_info"]["finish_reason"]["type"] == "length"
            else:
                assert len(last["output_ids"]) == AT
                assert last["meta_info"]["finish_reason"]["type"] == "abort"
            assert httpx.get(f"{base}/is_paused", timeout=TIMEOUT).json() == {"is_paused": True}
            later: list[dict] = []
            ask = lambda got=later: got.append(_generate(base))  # noqa: E731
            sent = threading.Thread(target=ask, daemon=True)
            sent.start()
            time.sleep(0.3)
            assert sent.is_alive() and not later
            _post(base, "/resume")
            sent.join(TIMEOUT)
            assert later and later[0]["output_ids"] == want
        _idle_and_intact(async_engine)


def test_pause_refuses_an_unknown_mode(models):
    with serving(_config(models[0])) as (base, _):
        r = httpx.post(f"{base}/pause_generation", json={"mode": "sleep"}, timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["param"] == "mode", r.text
        assert _generate(base)["output_ids"]  # not paused


def test_update_while_paused_does_not_wait_for_the_paused_request(models):
    """Paused in place, an update returns at once although the request is still in flight;
    after continue that request ends (its last tokens from the new weights) and a new one
    answers as a fresh server on the new checkpoint does."""
    other = {"input_ids": list(range(50, 70))}  # (a prompt the paused request never cached)
    with serving(_config(models[1])) as (base, _):
        want_new = _generate(base, **other)["output_ids"]
    with serving(_config(models[0])) as (base, async_engine):
        want_old = _generate(base)["output_ids"]
        with _frozen_at(async_engine, AT):
            stream = _Stream(base)
            stream.wait_tokens(AT)
            _post(base, "/pause_generation", mode="in_place")
        began = time.monotonic()
        r = _post(
            base,
            "/update_weights_from_disk",
            timeout=10,
            model_path=str(models[1]),
            weight_version="v1",
        )
        assert r.json()["success"] is True and r.json()["num_paused_requests"] == 1
        assert time.monotonic() - began < 10
        assert stream.thread.is_alive() and stream.tokens() == AT
        assert _on_engine(async_engine, lambda e: len(e.requests)) == 1  # still there
        _post(base, "/continue_generation")
        last = stream.last()
        assert last["output_ids"][:AT] == want_old[:AT]
        assert len(last["output_ids"]) == TOKENS
        assert last["meta_info"]["finish_reason"]["type"] == "length"
        out = _generate(base, **other)
        assert out["output_ids"] == want_new
        assert out["meta_info"]["weight_version"] == "v1"
        _idle_and_intact(async_engine)


def test_a_paused_update_under_the_l3_tier_is_refused(models, tmp_path):
    """With the L3 tier, an update under paused requests is refused and changes nothing:
    their pages (KV of the old weights, then mixed) would be stored under the new weights'
    namespace when they end, for every later engine to read."""
    from dsakv.engine import LLM, SamplingParams
    from dsakv.errors import DsakvError

    store = dict(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path))
    llm = LLM(str(models[0]), **ENGINE_ARGS, **store)
    try:
        e = llm.engine
        e.add_request(list(range(1, 40)), SamplingParams(max_tokens=8, temperature=0))
        e.step()
        e.paused = True  # (the server's /pause_generation in place)
        with pytest.raises(DsakvError, match="L3 tier .* under paused requests"):
            e.update_weights(str(models[1]))
        assert e.weights_path == str(models[0])
        e.paused = False
        while e.has_unfinished():
            e.step()
        assert e.update_weights(str(models[1])) and e.weights_path == str(models[1])
        e.check_integrity()
    finally:
        llm.close()


def test_vllm_pause_resume_and_is_paused(models):
    """vLLM's /pause, /resume and /is_paused, the same pause: mode "keep" holds the request
    with its KV until /resume, "wait" returns once the calls in flight ended (their whole
    output, the prefix cache then dropped unless clear_cache=false), the default aborts."""
    with serving(_config(models[0])) as (base, async_engine):
        want = _generate(base)["output_ids"]
        assert httpx.get(f"{base}/is_paused", timeout=TIMEOUT).json() == {"is_paused": False}
        with _frozen_at(async_engine, AT):
            stream = _Stream(base)
            stream.wait_tokens(AT)
            r = httpx.post(f"{base}/pause", params={"mode": "keep"}, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json() == {"status": "paused"}, r.text
        assert httpx.get(f"{base}/is_paused", timeout=TIMEOUT).json() == {"is_paused": True}
        time.sleep(0.2)
        running = _on_engine(async_engine, lambda e: [len(r.pages) for r in e.scheduler.running])
        assert stream.tokens() == AT and len(running) == 1 and running[0] > 0
        assert _post(base, "/resume").json() == {"status": "resumed"}
        assert stream.last()["output_ids"] == want
        assert httpx.get(f"{base}/is_paused", timeout=TIMEOUT).json() == {"is_paused": False}

        cached = lambda e: e.cache.num_evictable_pages  # noqa: E731
        for clear in (False, True):
            stream = _Stream(base)
            stream.wait_tokens(1)
            r = httpx.post(
                f"{base}/pause", params={"mode": "wait", "clear_cache": clear}, timeout=TIMEOUT
            )
            assert r.status_code == 200, r.text
            last = stream.last()  # (its whole output: not aborted)
            assert last["output_ids"] == want
            assert last["meta_info"]["finish_reason"]["type"] == "length"
            assert (_on_engine(async_engine, cached) > 0) is not clear
            _post(base, "/resume")

        with _frozen_at(async_engine, AT):
            stream = _Stream(base)
            stream.wait_tokens(AT)
            _post(base, "/pause")  # (vLLM's default: abort)
        assert stream.last()["meta_info"]["finish_reason"]["type"] == "abort"
        r = httpx.post(f"{base}/pause", params={"mode": "sleep"}, timeout=TIMEOUT)
        assert r.status_code == 400, r.text
        _post(base, "/resume")
        assert _generate(base)["output_ids"] == want
        _idle_and_intact(async_engine)
