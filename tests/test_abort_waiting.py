"""SGLang's /abort_request of a request still waiting to be taken, on a prefill/decode pair
behind `dsakv router` (all in this process, on loopback): a decode server's request waiting
for room, or for a busy prefill server's KV, ends at once as aborted in the waiting queue,
its reserved pages back; the router relays the abort to every server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from dsakv.engine import EngineConfig
from dsakv.models.tiny import write_tiny_model

from .serving import (
    TIMEOUT,
    disagg_info,
    engine_stops_stepping_at,
    engine_thread_held,
    free_port,
    routing,
    scrape_metrics,
    serving_disagg,
    sglang_generate,
    sglang_stream,
    wait_idle,
)

TEXTS = ["The quick brown fox jumps over the lazy dog.", "RL frameworks roll out and abort."]
GREEDY = {"temperature": 0, "ignore_eos": True}
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORTED_WAITING = {"type": "abort", "message": "Abort in waiting queue"}
# Well inside the servers' 30 s disaggregation timeout, after which a waiting request ends
# (and reserved pages come back) by itself
PROMPTLY = 10.0


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Iterator[SimpleNamespace]:
    """A prefill server, a decode server that runs one request at a time
    (--max-running-requests 1: a second waits for room) and a router in front."""
    model = str(write_tiny_model(tmp_path_factory.mktemp("abortw") / "m", "glm-tiny"))
    common = dict(device="cpu", num_pages=64, page_size=16, kv_cache_dtype="fp32",
                  index_k_dtype="fp32")  # fmt: skip
    p_conf = EngineConfig(model, **common)
    d_conf = EngineConfig(model, max_running_requests=1, **common)
    with ExitStack() as stack:
        p_url, prefill = stack.enter_context(serving_disagg(p_conf, "prefill"))
        d_url, decode = stack.enter_context(serving_disagg(d_conf, "decode"))
        router = stack.enter_context(routing([p_url], [d_url]))
        # (the router asks the prefill server for its bootstrap port on the first request)
        sglang_generate(router, text="hi", sampling_params={"max_new_tokens": 2, **GREEDY})
        yield SimpleNamespace(
            router=router, prefill_url=p_url, decode_url=d_url, prefill=prefill, decode=decode,
            model=model, common=common,
        )  # fmt: skip


def _abort(base: str, **body: Any) -> None:
    r = httpx.post(f"{base}/abort_request", json=body, timeout=TIMEOUT)
    assert (r.status_code, r.content) == (200, b""), r.text


def _wait(condition: Callable[[], bool], seconds: float = TIMEOUT) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _running(async_engine) -> int:
    """Requests running in the engine (read on its thread)."""

    def count(e) -> int:
        return sum(not r.finished for r in e.requests.values())

    return asyncio.run(asyncio.wait_for(async_engine.call(count), TIMEOUT))


def _aborted_waiting(out: dict, rid: str) -> None:
    meta = out["meta_info"]
    assert (meta["id"], meta["finish_reason"]) == (rid, ABORTED_WAITING), meta
    assert (out["output_ids"], meta["completion_tokens"]) == ([], 0)
    assert meta["prompt_tokens"] > 0


def test_an_abort_ends_requests_waiting_for_room_at_once(pair):
    """Requests a decode server has no room for (its one slot runs another) wait for it, up
    to the disaggregation timeout: an abort (by the client's rid, through the router) ends
    one at once, streamed or not, as SGLang's in its waiting queue; abort_all ends a /v1
    request waiting too, and the one running. Every page comes back."""
    decode = pair.decode
    sp = {"max_new_tokens": 400, **GREEDY}
    cmpl = {"model": "m", "prompt": TEXTS[1], "max_tokens": 400, **GREEDY}
    with ThreadPoolExecutor(4) as pool, engine_stops_stepping_at(decode, 2):
        holder = pool.submit(
            sglang_generate, pair.router, text=TEXTS[0], sampling_params=sp, rid="h"
        )
        _wait(lambda: _running(decode) == 1)
        plain = pool.submit(
            sglang_generate, pair.router, text=TEXTS[1], sampling_params=sp, rid="p"
        )
        streamed = pool.submit(
            sglang_stream, pair.router, text=TEXTS[1], sampling_params=sp, rid="s"
        )
        v1 = pool.submit(httpx.post, f"{pair.router}/v1/completions", json=cmpl, timeout=TIMEOUT)
        _wait(lambda: decode.pending == 3)  # (each waiting for the slot)
        _abort(pair.router, rid="p")
        _aborted_waiting(plain.result(PROMPTLY), "p")
        _abort(pair.router, rid="s")
        chunks = streamed.result(PROMPTLY)
        _aborted_waiting(chunks[-1], "s")
        assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
        assert decode.pending == 1 and not holder.done() and not v1.done()
        _abort(pair.router, abort_all=True)
        r = v1.result(PROMPTLY)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "abort"
        assert r.json()["usage"]["completion_tokens"] == 0
        out = holder.result(PROMPTLY)
        assert out["meta_info"]["finish_reason"] == ABORTED and len(out["output_ids"]) >= 2
    wait_idle(pair.decode_url)  # (`Engine.check_integrity`: every page free or cached)
    wait_idle(pair.prefill_url)


def test_an_abort_of_one_prompt_of_a_batch_ends_that_prompt_alone(pair):
    """A /generate batch: its second prompt waits for room while the first runs; aborting
    the second (its rid) ends it at once, and the first runs on to its end."""
    decode = pair.decode
    sp = {"max_new_tokens": 6, **GREEDY}
    with ThreadPoolExecutor(1) as pool:
        with engine_stops_stepping_at(decode, 2):
            batch = pool.submit(sglang_generate, pair.router, text=TEXTS, sampling_params=sp,
                                rid=["a", "b"])  # fmt: skip
            _wait(lambda: _running(decode) == 1 and decode.pending == 1)
            _abort(pair.router, rid="b")
            _wait(lambda: decode.pending == 0, PROMPTLY)  # (b no longer waits for room)
            assert not batch.done() and _running(decode) == 1
        a, b = batch.result(TIMEOUT)
    assert a["meta_info"]["id"] == "a" and len(a["output_ids"]) == 6
    assert a["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    _aborted_waiting(b, "b")
    wait_idle(pair.decode_url)
    wait_idle(pair.prefill_url)


def test_an_abort_that_finds_the_servers_at_different_prompts_ends_its_prompt_alone(pair):
    """A /generate batch through the router: the prefill server (its engine paused) has
    taken prompt a and waits for b's room, while the decode server waits for a's KV and has
    not begun b. Aborting b ends b alone: each server still gives b its bootstrap room (a
    prompt whose engine never ran left its room to the next, and the whole batch failed)."""
    decode, prefill = pair.decode, pair.prefill
    sp = {"max_new_tokens": 6, **GREEDY}
    texts = [*TEXTS, "A third prompt, after the aborted one."]
    with ThreadPoolExecutor(1) as pool:
        with engine_stops_stepping_at(prefill, 0):
            batch = pool.submit(sglang_generate, pair.router, text=texts, sampling_params=sp,
                                rid=["a", "b", "c"])  # fmt: skip
            _wait(lambda: decode.pending == 1 and prefill.bootstrap.open_rooms == 2)
            _abort(pair.router, rid="b")
        a, b, c = batch.result(TIMEOUT)
    for out, rid in ((a, "a"), (c, "c")):
        assert out["meta_info"]["id"] == rid and len(out["output_ids"]) == 6, out
    _aborted_waiting(b, "b")
    wait_idle(pair.decode_url)
    wait_idle(pair.prefill_url)


def test_an_abort_while_the_prefill_server_is_busy_gives_the_pages_back(pair):
    """A decode server holds pages for a request whose prefill server has not taken it yet
    (its engine busy): the abort ends the request at once, and reaches the prefill server's
    copy through the router, which refuses the room, so the decode server's pages come back
    at once too (it waited for the prefill server's timeout)."""
    decode, prefill = pair.decode, pair.prefill
    sp = {"max_new_tokens": 8, **GREEDY}
    with ThreadPoolExecutor(1) as pool, engine_thread_held(prefill):
        held = pool.submit(sglang_generate, pair.router, text=TEXTS[0], sampling_params=sp, rid="w")
        _wait(lambda: decode.pending == 1 and prefill.bootstrap.open_rooms == 1)
        assert scrape_metrics(pair.decode_url)["dsakv_kv_pages_used"] > 0  # (reserved)
        _abort(pair.router, rid="w")
        _aborted_waiting(held.result(PROMPTLY), "w")
        _wait(lambda: disagg_info(pair.decode_url)["integrity"] == "ok", PROMPTLY)
        m = scrape_metrics(pair.decode_url)
        assert m["dsakv_kv_pages_used"] == m["dsakv_kv_pages_cached"]
    wait_idle(pair.decode_url)
    wait_idle(pair.prefill_url)


def test_the_router_relays_abort_request_to_every_server(pair):
    """A body the servers refuse is their 400; a server the router cannot reach is a 502
    naming it (the others still hear the abort)."""
    r = httpx.post(f"{pair.router}/abort_request", json={"rid": 5}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid", r.text
    dead = f"http://127.0.0.1:{free_port()}"
    with routing([pair.prefill_url, dead], [pair.decode_url]) as router:
        r = httpx.post(f"{router}/abort_request", json={"abort_all": True}, timeout=TIMEOUT)
        assert r.status_code == 502 and dead in r.json()["error"]["message"], r.text
        assert "1 of 3" in r.json()["error"]["message"]
        # a pause that failed on one server pauses none: the others continue at once
        r = httpx.post(f"{router}/pause_generation", json={}, timeout=TIMEOUT)
        assert r.status_code == 502, r.text
    out = sglang_generate(
        pair.router, text=TEXTS[0], sampling_params={"max_new_tokens": 3, **GREEDY}
    )
    assert len(out["output_ids"]) == 3


def test_the_router_relays_the_admin_calls_to_every_server(pair):
    """SGLang's /flush_cache and weight-version calls, which RL frameworks send the one
    address they know, reach every server behind the router."""
    for method in ("GET", "POST"):
        r = httpx.request(method, f"{pair.router}/flush_cache", timeout=TIMEOUT)
        assert (r.status_code, r.text) == (200, "Cache flushed.\n")
    body = {"new_version": "rollout-7", "abort_all_requests": False}
    r = httpx.post(f"{pair.router}/update_weight_version", json=body, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["new_version"] == "rollout-7", r.text
    for url in (pair.prefill_url, pair.decode_url):
        version = httpx.get(f"{url}/get_weight_version", timeout=TIMEOUT).json()
        assert version == {"weight_version": "rollout-7"}
    for path in ("/pause_generation", "/continue_generation"):
        r = httpx.post(f"{pair.router}{path}", json={}, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    r = httpx.post(f"{pair.router}/update_weights_from_disk", json={}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model_path", r.text


def test_a_weight_update_is_what_the_handshake_checks(pair, tmp_path):
    """After /update_weights_from_disk the prefill/decode handshake describes the weights
    served now: a prefill server updated alone is refused by its decode server (it went on
    checking the old checkpoint: the decode server took KV the other weights computed),
    and once both serve the new checkpoint, requests run on it."""
    from dsakv.engine import LLM, SamplingParams

    other = str(write_tiny_model(tmp_path / "b", "glm-tiny", seed=1))
    sp = {"max_new_tokens": 6, **GREEDY}
    (want,) = LLM(other, **pair.common).generate([TEXTS[0]], SamplingParams(max_tokens=6, **GREEDY))

    def update(url: str, path: str) -> None:
        r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": path}, timeout=60)
        assert r.status_code == 200 and r.json()["success"], r.text

    try:
        update(pair.prefill_url, other)
        r = httpx.post(f"{pair.router}/generate", json={"text": TEXTS[0], "sampling_params": sp},
                       timeout=TIMEOUT)  # fmt: skip
        assert r.status_code == 502 and "different KV layouts" in r.text, r.text
        update(pair.decode_url, other)
        out = sglang_generate(pair.router, text=TEXTS[0], sampling_params=sp)
        assert out["output_ids"] == want.outputs[0].token_ids
    finally:
        update(pair.prefill_url, pair.model)
        update(pair.decode_url, pair.model)
    wait_idle(pair.decode_url)
    wait_idle(pair.prefill_url)
