"""Prefill/decode disaggregation end to end: a prefill server, decode servers and the router
as real processes on loopback, KV pages written over the Mooncake Transfer Engine, the
official `openai` client in front, and an offline `LLM` on the same model as reference."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import numpy as np
import openai
import pytest
import torch
import uvicorn

from dsakv.bench.pd import run_pd_bench, summary_lines
from dsakv.config import ModelConfig
from dsakv.config.checkpoint import model_identity
from dsakv.disagg.bootstrap import (
    BootstrapError,
    BootstrapServer,
    describe,
    differences,
    request_kv,
)
from dsakv.disagg.launch import wait_healthy
from dsakv.disagg.router import Router, build_router_app
from dsakv.disagg.transfer import (
    KVTransfer,
    PeerBuffer,
    TransferError,
    import_transfer_engine,
    plan_writes,
)
from dsakv.engine import LLM, EngineConfig, SamplingParams
from dsakv.memory import CacheLayout, DSAKVPool
from dsakv.models.tiny import TINY_PRESETS, default_model_dir, write_tiny_model

from .serving import (
    GREEDY,
    NO_THINKING,
    TIMEOUT,
    ServerProcess,
    check_pd_chat,
    disagg_info,
    free_port,
    running,
    scrape_metrics,
    serving,
    sglang_generate,
    sglang_stream,
    start_decode,
    start_prefill,
    wait_idle,
)

EXACT = ["--kv-cache-dtype", "fp32", "--index-k-dtype", "fp32", "--page-size", "16"]
TINY = [*EXACT, "--num-pages", "256", "--device", "cpu", "--max-running-requests", "64"]
ROUTED = ["--enable-return-routed-experts"]  # (the router's pair: SGLang's R3 under PD)


# --- the transfer layer, in one process --------------------------------------------------------


def _filled_pool(layout: CacheLayout, num_pages: int, seed: int) -> DSAKVPool:
    pool = DSAKVPool(layout, num_pages)
    g = torch.Generator().manual_seed(seed)
    slots = torch.arange(pool.num_tokens)
    for layer in range(layout.num_layers):
        pool.write_latent(layer, slots, torch.randn(len(slots), layout.latent_dim, generator=g))
        if pool.has_index_k(layer):
            keys = torch.randn(len(slots), layout.index_head_dim, generator=g)
            pool.write_index_k(layer, slots, keys)
    return pool


def _slots(pages: list[int], n: int, page_size: int) -> torch.Tensor:
    return torch.tensor([pages[i // page_size] * page_size + i % page_size for i in range(n)])


@pytest.mark.parametrize("elide, cell", [(True, 47_700), (False, 55_224)])
def test_page_writes_move_the_layout_cell_bit_exactly(elide, cell):
    """GLM-5.2's per-token dims (the glm-bench preset), fp8 latent and fp8 index-K: the
    counters say 47,700 bytes per token elided, 55,224 dense, and the decode pool's pages
    hold the prefill pool's bytes exactly; nothing past the last token is written."""
    layout = CacheLayout.for_model(TINY_PRESETS["glm-bench"], elide_index_k=elide, page_size=16)
    assert layout.bytes_per_token == cell
    src = _filled_pool(layout, 6, seed=1)
    dst = DSAKVPool(layout, 8)
    a, b = KVTransfer(src), KVTransfer(dst)
    try:
        n, src_pages, dst_pages = 38, [1, 2, 4], [7, 3, 4]  # 2 full pages + 6 tokens
        peer = [PeerBuffer.of(d) for d in b.buffers]
        nbytes, seconds = a.write(b.session, peer, src_pages, dst_pages, n)
        assert nbytes == n * cell and seconds > 0
        assert a.stats.snapshot()["bytes"] / a.stats.snapshot()["tokens"] == cell
        got = dst.read_tokens(_slots(dst_pages, n, 16))
        want = src.read_tokens(_slots(src_pages, n, 16))
        assert got.keys() == want.keys()
        assert sum(1 for k in got if k.startswith("index_k")) == len(layout.index_k_layers)
        for key in want:
            for g, w in zip(got[key], want[key]):
                assert torch.equal(g, w), key
        tail = torch.arange(4 * 16 + 6, 5 * 16)  # the rest of the last destination page
        rest = dst.read_tokens(tail)
        assert all(int(t.count_nonzero()) == 0 for parts in rest.values() for t in parts)
    finally:
        a.close()
        b.close()


def test_plan_merges_consecutive_pages_and_refuses_other_layouts():
    layout = CacheLayout.for_model(TINY_PRESETS["glm-bench"], page_size=16)
    pool = DSAKVPool(layout, 8)
    mine = pool.transfer_descriptors()
    peer = [PeerBuffer.of(d) for d in mine]
    srcs, _, lens = plan_writes(mine, peer, [0, 1, 2], [5, 6, 7], 48, 16)
    assert len(srcs) == len(mine) and sum(lens) == 48 * layout.bytes_per_token
    dense = DSAKVPool(layout.dense(), 8).transfer_descriptors()
    with pytest.raises(TransferError, match="buffers"):
        plan_writes(mine, [PeerBuffer.of(d) for d in dense], [0], [0], 16, 16)


def test_a_write_to_a_dead_peer_fails_at_once():
    layout = CacheLayout.for_model(TINY_PRESETS["glm-tiny"], page_size=16)
    a = KVTransfer(DSAKVPool(layout, 2))
    try:
        peer = [PeerBuffer.of(d) for d in a.buffers]
        start = time.monotonic()
        with pytest.raises(TransferError, match="failed"):
            a.write(f"127.0.0.1:{free_port()}", peer, [0], [1], 16)
        assert time.monotonic() - start < 10
        assert a.stats.snapshot()["bytes"] == 0
    finally:
        a.close()


def test_handshake_answers_as_soon_as_the_kv_is_written_and_names_layout_differences():
    """The decode side hears `done` at once, not at the next keepalive (5 s: the most
    `BootstrapServer` waits between lines, so the only bound the code sets); a registration
    from another layout or checkpoint is refused, naming the field, and the prefill side's
    claim fails with the same message."""
    layout = CacheLayout.for_model(TINY_PRESETS["glm-tiny"], page_size=16)
    mine = describe(layout, ModelConfig.resolve(TINY_PRESETS["glm-tiny"]), "ckpt", "fp32")
    server = BootstrapServer("127.0.0.1", free_port(), mine, timeout=20.0)  # keepalive 5 s
    reg = {"layout": mine, "session": "s", "buffers": [], "pages": [], "prompt_ids": [1]}

    async def run() -> tuple[dict, float, str]:
        async def prefill_side() -> None:
            r = await server.claim(1)
            await asyncio.sleep(0.2)
            r.done(first_token=7, bytes=0, tokens=0, seconds=0.0)

        start = time.monotonic()
        task = asyncio.create_task(prefill_side())
        reply = await request_kv("127.0.0.1", server.port, {**reg, "room": 1}, 20.0)
        took = time.monotonic() - start
        await task
        other = {**mine, "elide_index_k": False, "page_size": 64, "checkpoint": "seed1"}
        with pytest.raises(BootstrapError) as refused:
            await request_kv("127.0.0.1", server.port, {**reg, "room": 2, "layout": other}, 20.0)
        with pytest.raises(BootstrapError) as claimed:
            await server.claim(2)
        assert str(claimed.value) == str(refused.value)
        return reply, took, str(refused.value)

    try:
        reply, took, refused = asyncio.run(run())
    finally:
        server.close()
    assert reply["first_token"] == 7 and took < 5.0  # done 0.2 s in; a keepalive tick: >= 5 s
    assert "elide_index_k: prefill True, decode False" in refused
    assert "page_size: prefill 16, decode 64" in refused
    assert "checkpoint: prefill 'ckpt', decode 'seed1'" in refused  # other weights


def test_servers_apart_only_in_the_per_token_path_are_told_how_to_pair():
    """A --tp 1 and a --tp 2 server on a CPU compute apart by default (one rank takes the
    per-token path), and with it on both (its bits are one split's of the sums): their
    refusal names the flags that pair them; another dtype does not."""
    one = {"compute": "float32|cpu|deterministic=True"}
    two = {"compute": "float32|cpu|deterministic=False"}
    (line,) = differences(one, two, "prefill", "decode")
    assert line.startswith("compute: prefill 'float32|cpu|deterministic=True', decode")
    assert "--disable-deterministic-inference" in line
    (line,) = differences(one, {"compute": "bfloat16|cpu|deterministic=False"}, "p", "d")
    assert "deterministic-inference" not in line
    # Both per-token, over other splits of the sums (`Engine.compute` under --tp)
    split = {"compute": "float32|cpu|deterministic=True|sums over tp 2, ep 1"}
    (line,) = differences(one, split, "p", "d")
    assert "give both the same --tp, --ep and --dp-attention" in line


def test_a_refused_room_is_the_decode_sides_error_at_once_before_or_after_it_registers():
    """A prompt the prefill server refuses (longer than its context, say) never gets a
    claim: the decode server waited out the room's timeout, then answered a 502."""
    layout = CacheLayout.for_model(TINY_PRESETS["glm-tiny"], page_size=16)
    mine = describe(layout, ModelConfig.resolve(TINY_PRESETS["glm-tiny"]), "ckpt", "fp32")
    server = BootstrapServer("127.0.0.1", free_port(), mine, timeout=20.0)
    reg = {"layout": mine, "session": "s", "buffers": [], "pages": [], "prompt_ids": [1]}

    async def refused(room: int, registered_first: bool) -> BootstrapError:
        if not registered_first:
            server.refuse(room, "prompt has 405 tokens; at most 299 fit", 400, "prompt")
        wait = asyncio.create_task(request_kv("127.0.0.1", server.port, {**reg, "room": room}, 20))
        if registered_first:
            while server.open_rooms == 0:
                await asyncio.sleep(0.01)
            server.refuse(room, "prompt has 405 tokens; at most 299 fit", 400, "prompt")
        with pytest.raises(BootstrapError) as e:
            await wait
        return e.value

    try:
        for registered_first in (False, True):
            error = asyncio.run(refused(3 + registered_first, registered_first))
            assert (str(error), error.status) == ("prompt has 405 tokens; at most 299 fit", 400)
            assert error.param == "prompt"  # (the decode server's 400 names the field too)
    finally:
        server.close()


def test_a_refused_room_is_not_an_open_room():
    """A refused room is kept for the timeout to answer a late registration; `open_rooms`
    (`/disagg/info`: rooms claimed or registered) counted it all that time."""
    layout = CacheLayout.for_model(TINY_PRESETS["glm-tiny"], page_size=16)
    mine = describe(layout, ModelConfig.resolve(TINY_PRESETS["glm-tiny"]), "ckpt", "fp32")
    server = BootstrapServer("127.0.0.1", free_port(), mine, timeout=20.0)
    reg = {"room": 7, "layout": mine, "session": "s", "buffers": [], "pages": [], "prompt_ids": [1]}

    async def open_while_claimed() -> int:
        claim = asyncio.create_task(server.claim(8))
        while server.open_rooms == 0:
            await asyncio.sleep(0.01)
        claim.cancel()
        return server.open_rooms

    try:
        server.refuse(7, "prompt has 405 tokens; at most 299 fit", 400)
        assert server.open_rooms == 0
        with pytest.raises(BootstrapError) as e:  # a late registration still hears it
            asyncio.run(request_kv("127.0.0.1", server.port, reg, 20))
        assert e.value.status == 400 and server.open_rooms == 0
        assert asyncio.run(asyncio.wait_for(open_while_claimed(), 10)) == 1
    finally:
        server.close()


def test_a_claim_cancelled_as_its_room_is_registered_answers_the_decode_server():
    """The prefill request is cancelled (aborted, its client gone) in the very loop pass its
    room's registration lands: the decode server hears so at once and gives its reserved
    pages back. (The claim forgot the room, registration and all: the decode server waited
    out the room's timeout.)"""
    layout = CacheLayout.for_model(TINY_PRESETS["glm-tiny"], page_size=16)
    mine = describe(layout, ModelConfig.resolve(TINY_PRESETS["glm-tiny"]), "ckpt", "fp32")
    server = BootstrapServer("127.0.0.1", free_port(), mine, timeout=20.0)
    reg = {"room": 5, "layout": mine, "session": "s", "buffers": [], "pages": [], "prompt_ids": [1]}
    answer: dict = {}

    def decode_side() -> None:
        start = time.monotonic()
        try:
            asyncio.run(request_kv("127.0.0.1", server.port, reg, 20))
        except BootstrapError as e:
            answer.update(status=e.status, message=str(e))
        answer["took"] = time.monotonic() - start

    async def cancelled_as_registered() -> None:
        claim = asyncio.create_task(server.claim(5))
        while server.open_rooms == 0:
            await asyncio.sleep(0.01)
        decode = threading.Thread(target=decode_side)
        decode.start()
        slot = server._rooms[5]
        while not slot.registered.done():  # (the loop blocked: the claim cannot see it yet)
            time.sleep(0.001)
        claim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await claim
        await asyncio.to_thread(decode.join, 30)

    try:
        asyncio.run(cancelled_as_registered())
        assert answer["status"] == 499 and "cancelled" in answer["message"], answer
        assert answer["took"] < 10, answer
        assert server.open_rooms == 0
    finally:
        server.close()


def test_a_late_registration_hears_the_prefill_server_gave_up():
    """A decode server that registers just after the prefill server's claim timed out (its
    pages reserved late, the pool full) hears so at once, not after a timeout of its own."""
    layout = CacheLayout.for_model(TINY_PRESETS["glm-tiny"], page_size=16)
    mine = describe(layout, ModelConfig.resolve(TINY_PRESETS["glm-tiny"]), "ckpt", "fp32")
    server = BootstrapServer("127.0.0.1", free_port(), mine, timeout=20.0)
    reg = {"room": 6, "layout": mine, "session": "s", "buffers": [], "pages": [], "prompt_ids": [1]}
    try:
        with pytest.raises(BootstrapError, match="no decode server registered room 6"):
            asyncio.run(server.claim(6, timeout=0.2))
        start = time.monotonic()
        with pytest.raises(BootstrapError) as e:
            asyncio.run(request_kv("127.0.0.1", server.port, reg, 20))
        assert e.value.status == 502 and "gave up" in str(e.value), e.value
        assert time.monotonic() - start < 10 and server.open_rooms == 0
    finally:
        server.close()


def test_a_room_registered_before_new_weights_is_refused_when_claimed():
    """A decode server registered a room, then the prefill server's weights were updated
    (its request for the room waited for the update): the claim checks the layout again,
    and both sides hear it differs (the prefill server shipped KV of the new weights to a
    decode server on the old)."""
    layout = CacheLayout.for_model(TINY_PRESETS["glm-tiny"], page_size=16)
    old = describe(layout, ModelConfig.resolve(TINY_PRESETS["glm-tiny"]), "ckpt-a", "fp32")
    server = BootstrapServer("127.0.0.1", free_port(), old, timeout=20.0)
    reg = {"room": 9, "layout": old, "session": "s", "buffers": [], "pages": [], "prompt_ids": [1]}

    async def run() -> tuple[BootstrapError, BootstrapError]:
        decode = asyncio.ensure_future(request_kv("127.0.0.1", server.port, reg, 20))
        while server.open_rooms == 0:
            await asyncio.sleep(0.01)
        server.layout = {**old, "checkpoint": "ckpt-b"}  # (`weights_updated`)
        with pytest.raises(BootstrapError) as claimed:
            await server.claim(9, timeout=5)
        with pytest.raises(BootstrapError) as heard:
            await decode
        return claimed.value, heard.value

    try:
        claimed, heard = asyncio.run(asyncio.wait_for(run(), 30))
        for e in (claimed, heard):
            assert "different KV layouts" in str(e) and "checkpoint" in str(e), e
    finally:
        server.close()


def test_dsakv_imports_without_mooncake_and_says_how_to_get_it(monkeypatch):
    code = (
        "import sys; sys.modules['mooncake'] = None; sys.modules['mooncake.engine'] = None\n"
        "import dsakv.cli, dsakv.server, dsakv.disagg.serving, dsakv.disagg.router, dsakv.bench\n"
        "print('ok')"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    layout = CacheLayout.for_model(TINY_PRESETS["glm-tiny"], page_size=16)
    with pytest.raises(TransferError, match="CPU build"):  # GPU pools need the CUDA build
        KVTransfer(DSAKVPool(layout, 1, device="meta"))
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(TransferError, match="pip install mooncake-transfer-engine-non-cuda"):
        import_transfer_engine()


def test_bench_pd_section_reports_both_layouts_side_by_side():
    r = run_pd_bench(lengths=(100, 200), repeats=1)
    assert r["elided"]["counter_bytes_per_token"] == 47_700
    assert r["dense"]["counter_bytes_per_token"] == 55_224
    for name in ("elided", "dense"):
        rows = r[name]["requests"]
        assert [x["prompt_tokens"] for x in rows] == [100, 200]
        assert all(x["bit_exact"] and x["seconds_per_request"] > 0 for x in rows)
        assert [x["bytes_per_request"] for x in rows] == [
            n * r[name]["bytes_per_token"] for n in (100, 200)
        ]
    assert r["bytes_ratio"] == pytest.approx(47_700 / 55_224)
    lines = summary_lines(r)
    assert "55,224 vs 47,700 B/token" in lines[0] and len(lines) == 4


def _slowed(fn):
    """`fn` behind a long engine step: a call queued meanwhile waits for it."""
    return lambda *a: (time.sleep(0.6), fn(*a))[1]


def _cancel_while_queued(bridge, target, late: bool = False) -> tuple[int, int]:
    """Cancel a bridge's `generate_n` while its (slowed) engine-thread call is queued, as
    the server does when the client leaves; the pool's free pages before and after.
    `late`: the cancel lands in the loop pass that delivers the call's result."""
    from dsakv.disagg import handoff

    async def run() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        free = lambda e: e.scheduler.available_pages()  # noqa: E731
        before = await bridge.call(free)
        handoff._current.set(handoff._Targets([target]))
        submit = asyncio.ensure_future(
            bridge.generate_n(list(range(1, 40)), SamplingParams(max_tokens=4), 1)
        )
        await asyncio.sleep(0.2)
        if late:  # posted by the engine thread right behind the result; the loop is busy
            cancel = lambda e: loop.call_soon_threadsafe(submit.cancel)  # noqa: E731
            bridge._commands.put(("call", (cancel, loop, loop.create_future(), None)))
            time.sleep(1.0)
        else:
            submit.cancel()
        with pytest.raises(asyncio.CancelledError):
            await submit
        deadline = time.monotonic() + TIMEOUT  # (the call runs, and then what undoes it)
        while (after := await bridge.call(free)) != before and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return before, after

    try:
        return asyncio.run(run())
    finally:
        bridge.shutdown()


def test_a_client_gone_before_its_body_is_whole_is_quiet_at_the_router(caplog):
    """The router read the body unguarded: an ASGI traceback per such client. (And its 404s
    are in OpenAI's error shape, as its servers' are.)"""
    app = build_router_app(["http://127.0.0.1:9"], ["http://127.0.0.1:10"])
    server = uvicorn.Server(uvicorn.Config(app, port=free_port(), log_level="warning"))
    with running(server) as base:
        logging.getLogger("uvicorn.error").addHandler(caplog.handler)  # (it does not propagate)
        with socket.create_connection(("127.0.0.1", server.config.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")  # fmt: skip
        time.sleep(0.5)
        assert httpx.get(f"{base}/metrics", timeout=10).status_code == 200
        logging.getLogger("uvicorn.error").removeHandler(caplog.handler)
        r = httpx.get(f"{base}/no_such_route", timeout=10)
        assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found", r.text
    assert "Exception in ASGI application" not in caplog.text


def test_a_cancelled_handoff_gives_its_pages_back(tmp_path, monkeypatch):
    """A decode server reserves pages on its engine thread; a prefill server adds and holds
    the request there. A client that leaves cancels the handler while that call is queued:
    the call still runs, and nothing gave back what it took (pages lost for good)."""
    from dsakv.disagg.config import DisaggConfig
    from dsakv.disagg.handoff import BootstrapTarget
    from dsakv.disagg.serving import DecodeAsyncEngine, PrefillAsyncEngine
    from dsakv.engine import Engine, EngineConfig
    from dsakv.engine import disagg as engine_ops

    model = str(write_tiny_model(tmp_path / "m", "glm-tiny"))
    config = EngineConfig(model, device="cpu", num_pages=32, page_size=16,
                          kv_cache_dtype="fp32", index_k_dtype="fp32")  # fmt: skip
    monkeypatch.setattr(engine_ops, "reserve", _slowed(engine_ops.reserve))
    for late in (False, True):
        decode = DecodeAsyncEngine(Engine(config), DisaggConfig("decode"), "127.0.0.1")
        target = BootstrapTarget(7, "127.0.0.1", free_port())
        before, after = _cancel_while_queued(decode, target, late)
        assert after == before, late

    port = free_port()
    prefill = PrefillAsyncEngine(
        Engine(config), DisaggConfig("prefill", bootstrap_port=port), "127.0.0.1"
    )
    failed = []

    class Registration:  # what `claim` returns once a decode server registered the room
        room, prompt_ids, lora = 7, list(range(1, 40)), None

        def fail(self, message, status=502):
            failed.append(message)

    async def claim(room, timeout=None):
        return Registration()

    prefill.bootstrap.claim = claim
    prefill._add_held = _slowed(prefill._add_held)
    before, after = _cancel_while_queued(prefill, BootstrapTarget(7, None, port))
    assert after == before and failed == ["the prefill server's client hung up"]
    assert prefill.stats.snapshot()["failures"] == 0


def test_a_request_waits_for_pages_parked_by_a_handoff(tmp_path):
    """Pages a prefill server holds until shipped, or a decode server reserved for KV on its
    way, come back without a step: a request that cannot be admitted meanwhile waits for
    them (it was finished at once as "length", cut short, with a 502 on a prefill server)."""
    from dsakv.engine import Engine, EngineConfig
    from dsakv.engine import disagg as engine_ops

    model = str(write_tiny_model(tmp_path / "m", "glm-tiny"))
    config = EngineConfig(model, device="cpu", num_pages=8, page_size=16,
                          kv_cache_dtype="fp32", index_k_dtype="fp32")  # fmt: skip
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompt = list(range(1, 81))  # 5 of the 8 pages, 6 with its outputs: two cannot run at once
    other = list(range(81, 161))  # (not the same prompt: it would share the cached pages)
    alone = LLM(model, **{k: getattr(config, k) for k in ("device", "num_pages", "page_size",
                "kv_cache_dtype", "index_k_dtype")}).generate([other], params)[0].token_ids  # fmt: skip

    def wait_then_run(engine: Engine, release) -> list[int]:
        req = engine.add_request(other, params)
        for _ in range(3):
            assert engine.step() == [] and not req.finished  # waits: nothing admitted
        release()
        while engine.has_unfinished():
            engine.step()
        assert req.finish_reason == "length" and len(req.output_ids) == 20
        return req.output_ids

    decode = Engine(config)
    reserved = engine_ops.reserve(decode, prompt, params)
    assert reserved is not None
    assert wait_then_run(decode, lambda: engine_ops.drop(decode, reserved)) == alone
    decode.check_integrity()

    prefill = Engine(config)
    first = prefill.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
    engine_ops.hold(prefill, first)
    while prefill.has_unfinished():
        prefill.step()
    assert wait_then_run(prefill, lambda: engine_ops.release_held(prefill, first)) == alone
    prefill.check_integrity()


def test_a_decode_server_keeps_to_max_running_requests(tmp_path):
    """Reservations count as running: a decode server with --max-running-requests 2 ran all
    8 concurrent requests at once (it checked only pages); a third waits for a slot."""
    from dsakv.engine import Engine, EngineConfig
    from dsakv.engine import disagg as engine_ops

    model = str(write_tiny_model(tmp_path / "m", "glm-tiny"))
    config = EngineConfig(model, device="cpu", num_pages=64, page_size=16, kv_cache_dtype="fp32",
                          index_k_dtype="fp32", max_running_requests=2)  # fmt: skip
    engine = Engine(config)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    prompts = [[k + 1] * (5 + k) for k in range(3)]
    first, second = (engine_ops.reserve(engine, p, params) for p in prompts[:2])
    assert first is not None and second is not None
    assert engine_ops.reserve(engine, prompts[2], params) is None  # pages enough, no slot
    engine_ops.start_decoding(engine, first, 7)
    assert engine_ops.reserve(engine, prompts[2], params) is None  # one runs, one on its way
    engine_ops.drop(engine, second)
    third = engine_ops.reserve(engine, prompts[2], params)
    assert third is not None
    engine_ops.start_decoding(engine, third, 7)
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.stats.peak_running == 2
    engine.check_integrity()


def test_servers_computing_in_other_dtypes_are_refused_naming_it(tmp_path):
    """An fp32 prefill server and a bf16 decode server (same cache dtypes) paired silently:
    the decode server's tokens matched neither server alone. Their handshake names how each
    computes, the string L3's namespace keys on."""
    from dsakv.disagg.serving import _describe
    from dsakv.engine import Engine, EngineConfig

    model = str(write_tiny_model(tmp_path / "m", "glm-tiny"))
    exact = dict(device="cpu", num_pages=8, page_size=16, kv_cache_dtype="fp32",
                 index_k_dtype="fp32")  # fmt: skip
    fp32 = Engine(EngineConfig(model, dtype="float32", **exact))
    bf16 = Engine(EngineConfig(model, dtype="bfloat16", **exact))
    server = BootstrapServer("127.0.0.1", free_port(), _describe(fp32), timeout=20.0)
    reg = {"room": 1, "layout": _describe(bf16), "session": "s", "buffers": [], "pages": [],
           "prompt_ids": [1]}  # fmt: skip
    try:
        with pytest.raises(BootstrapError) as e:
            asyncio.run(request_kv("127.0.0.1", server.port, reg, 20.0))
    finally:
        server.close()
    assert f"compute: prefill {fp32.compute!r}, decode {bf16.compute!r}" in str(e.value)
    assert "torch.float32" in fp32.compute and "torch.bfloat16" in bf16.compute


def test_a_hisparse_decode_server_takes_prompts_past_its_device_pool(tmp_path, monkeypatch):
    """A decode server's prompt latent arrives in its host memory: only the hot buffer needs
    the device, so a prompt longer than the device latent pool (100 tokens, 64 slots) is
    served (it was refused: "under HiSparse a prompt is prefilled on the device") and gives
    one roomy engine's tokens (glm-tiny's top-k 16 is sparse here; fp32, exact). And the
    prefill server reads the checkpoint's fingerprint once (it did twice, ~4 MB a shard).
    `truncate_prompt_tokens=-1` keeps what the decode server's context holds (its logical
    pool, 512 tokens, here less than the prefill server's): each side kept its own, and the
    request was a 502 blaming the tokenizers."""
    from dsakv.disagg import handoff, serving
    from dsakv.disagg.config import DisaggConfig
    from dsakv.disagg.handoff import BootstrapTarget
    from dsakv.disagg.serving import DecodeAsyncEngine, PrefillAsyncEngine
    from dsakv.engine import Engine, EngineConfig
    from dsakv.engine import disagg as ops
    from dsakv.engine import engine as engine_module

    model = str(write_tiny_model(tmp_path / "m", "glm-tiny"))
    exact = dict(device="cpu", page_size=8, kv_cache_dtype="fp32", index_k_dtype="fp32")
    prompt = [(5 * j) % 250 + 1 for j in range(100)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = LLM(model, num_pages=64, **exact).generate([prompt], params)[0].token_ids
    reads = []

    def fingerprint(path):
        reads.append(path)
        return model_identity(path)

    for module in (engine_module, serving):  # (serving no longer imports it)
        monkeypatch.setattr(module, "model_identity", fingerprint, raising=False)
    port = free_port()
    prefill = PrefillAsyncEngine(
        Engine(EngineConfig(model, num_pages=128, **exact)),
        DisaggConfig("prefill", bootstrap_port=port),
        "127.0.0.1",
    )
    assert reads == [model]
    hisparse = dict(enable_hisparse=True, hisparse_config={"host_to_device_ratio": 8})
    decode = DecodeAsyncEngine(
        Engine(EngineConfig(model, num_pages=8, **hisparse, **exact)),
        DisaggConfig("decode"),
        "127.0.0.1",
    )
    assert decode.engine.pool.num_latent_tokens == 64 < len(prompt)

    async def side(bridge, target, prompt, params) -> tuple[list[int], str | None]:
        handoff._current.set(handoff._Targets([target]))
        (stream,) = await bridge.generate_n(prompt, params, 1)
        ids, u = [], None
        while u is None or not u.finished:
            u = await stream.get()
            assert u.error is None, u.error
            ids += u.token_ids
        return ids, u.finish_reason

    async def run(room: int, prompt, params) -> list[tuple[list[int], str | None]]:
        return await asyncio.gather(
            side(prefill, BootstrapTarget(room, None, port), prompt, params),
            side(decode, BootstrapTarget(room, "127.0.0.1", port), prompt, params),
        )

    long = [(3 * j) % 250 + 1 for j in range(700)]
    cut = dataclasses.replace(params, max_tokens=2, truncate_prompt_tokens=-1)
    assert decode.engine.max_model_len == 512 < prefill.engine.max_model_len
    try:
        (first, _), (got, reason) = asyncio.run(run(1, prompt, params))
        (_, _), (kept, ended) = asyncio.run(run(2, long, cut))
        # A reservation no request in flight holds (a garbled reply left one) is a leak;
        # a request's own counts as `pending` until it starts decoding.
        held = asyncio.run(decode.call(lambda e: ops.reserve(e, prompt, params)))
        assert asyncio.run(decode._integrity()).startswith("leak")
        asyncio.run(decode.call(lambda e: ops.drop(e, held)))
        assert asyncio.run(decode._integrity()) == "ok"
    finally:
        prefill.shutdown()
        decode.shutdown()
    assert first == want[:1] and got == want and reason == "length"
    assert decode.engine.counters()["hisparse_misses"] > 0
    # (511 tokens leave the decode server's context room for one)
    ref = LLM(model, num_pages=128, **exact).generate([long[-511:]], cut)[0].token_ids
    assert kept == ref[:1] and ended == "length"


# --- servers ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[dict]:
    """glm-tiny with index_topk covering every context (exact against one engine): a
    prefill server, two decode servers and the router process (its pair returning routed
    experts), the prefill server and the second decode server over one L3 store; a
    dense-layout decode server (short timeout); GLM-5.2-shaped (glm-bench, fp8) prefill and
    decode servers.
    All start at once, so their model loads overlap."""
    root = tmp_path_factory.mktemp("disagg")
    tiny = str(write_tiny_model(root / "tiny", {**TINY_PRESETS["glm-tiny"], "index_topk": 1024}))
    bench = str(default_model_dir("glm-bench", weights="bf16"))  # (no MTP layer: no fit)
    procs: dict[str, ServerProcess] = {}
    try:
        store = ["--hicache-storage-backend", "file", "--hicache-storage-dir", str(root / "l3")]
        procs["prefill"], bport = start_prefill(root, "prefill", tiny, *TINY, *ROUTED, *store,
                                                "--disaggregation-timeout", "20")  # fmt: skip
        procs["decode"] = start_decode(root, "decode", tiny, *TINY, *ROUTED)
        procs["decode2"] = start_decode(root, "decode2", tiny, *TINY, *store)
        procs["dense"] = start_decode(root, "dense", tiny, *TINY, "--no-elide-index-k",
                                 "--disaggregation-timeout", "3")  # fmt: skip
        procs["hisparse"] = start_decode(root, "hisparse", tiny, *TINY, "--enable-hisparse")
        procs["bench_prefill"], _ = start_prefill(root, "bench_prefill", bench, "--num-pages", "16")
        procs["bench_decode"] = start_decode(root, "bench_decode", bench, "--num-pages", "16")
        rport = free_port()
        cmd = [sys.executable, "-m", "dsakv.cli", "router", "--prefill", procs["prefill"].url]
        cmd += ["--decode", procs["decode"].url, "--port", str(rport)]
        router = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for name, p in procs.items():
                try:
                    wait_healthy([p.url], [p.proc], 180)
                except Exception as e:
                    pytest.fail(f"{name} did not start: {e}\n{p.tail()}")
            wait_healthy([f"http://127.0.0.1:{rport}"], [router], 60)
            yield {
                "model": tiny,
                "router": f"http://127.0.0.1:{rport}",
                "bootstrap_port": bport,
                **procs,
            }
        finally:
            router.kill()
            router.wait(TIMEOUT)
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture(scope="module")
def reference(cluster) -> LLM:
    return LLM(cluster["model"], kv_cache_dtype="fp32", index_k_dtype="fp32", page_size=16,
               num_pages=256, device="cpu")  # fmt: skip


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=60, max_retries=0)


@contextmanager
def _router(prefill: ServerProcess | str, decode: ServerProcess | str, *more: str) -> Iterator[str]:
    """A router in this process; `more`: a prefill and a decode URL first in the lists
    (servers that are down)."""
    urls = [p if isinstance(p, str) else p.url for p in (prefill, decode)]
    app = build_router_app([*more[:1], urls[0]], [*more[1:], urls[1]])
    server = uvicorn.Server(uvicorn.Config(app, port=free_port(), log_level="warning"))
    with running(server) as base:
        yield base


# --- through the router -------------------------------------------------------------------------


def test_completions_and_chat_equal_one_engine(cluster, reference):
    """Greedy outputs equal one engine's, streamed or not; the second run of a prompt starts
    from the prefill server's prefix cache and still ships (and matches) the whole prompt."""
    client = _client(cluster["router"])
    prompt = "The quick brown fox jumps over the lazy dog. " * 3  # several pages, one partial
    want = reference.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    got = client.completions.create(model="m", prompt=prompt, max_tokens=12, **GREEDY)
    assert got.choices[0].text == want[0].text and got.usage.completion_tokens == 12
    chunks = list(
        client.completions.create(model="m", prompt=prompt, max_tokens=12, stream=True, **GREEDY)
    )
    assert "".join(c.choices[0].text for c in chunks) == want[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert scrape_metrics(cluster["prefill"].url)["dsakv_prefix_hit_tokens_total"] >= 16

    check_pd_chat(client, cluster["decode"].url, reference, 10)


def test_the_router_passes_over_servers_that_are_down(cluster, reference):
    """A prefill or decode server refusing connections failed every other request through
    the router (round robin), and /v1/models asked only the first decode server: the next
    server takes them."""
    prompts = [f"Failover {i}: " + "abc " * i for i in range(4)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    want = [o.text for o in reference.generate(prompts, params)]
    down = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    with _router(cluster["prefill"], cluster["decode"], *down) as base:
        client = _client(base)
        got = [
            client.completions.create(model="m", prompt=p, max_tokens=4, **GREEDY).choices[0].text
            for p in prompts
        ]
        models = [m.id for m in client.models.list().data]
    assert got == want
    assert models == [m.id for m in _client(cluster["decode"].url).models.list().data]
    wait_idle(cluster["prefill"].url)


def test_concurrent_requests_through_the_router_all_find_the_server_that_is_up():
    """Each try of each request advanced one shared rotation: while a request waited on a
    server that was down, another's try moved the rotation past the one that was up, and
    the first was told that no server was usable. And a server that failed is asked last
    for a while (a host dropping packets cost every Nth request a connect timeout)."""
    router = Router(["http://down:1", "http://up:1"], ["http://down:2", "http://up:2"])
    asked: list[str] = []

    async def answer(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.host)
        if request.url.host == "down":
            await asyncio.sleep(0.2)  # (a connect timeout, shortened)
            raise httpx.ConnectError("down", request=request)
        if request.url.path == "/disagg/info":
            return httpx.Response(200, json={"mode": "prefill", "bootstrap_port": 9000})
        return httpx.Response(200, json={})

    async def run():
        router._client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        picks = [router._pick_prefill("", "/v1/completions") for _ in range(4)]
        sends = [router._send_decode("/v1/completions", b"{}", {}) for _ in range(4)]
        found = await asyncio.gather(*picks, *sends)
        asked.clear()
        await asyncio.gather(
            router._pick_prefill("", "/generate"), router._send_decode("/generate", b"{}", {})
        )
        return found

    found = asyncio.run(run())
    assert [f[0] for f in found] == ["http://up:1"] * 4 + ["http://up:2"] * 4
    assert asked == ["up"]  # (the prefill server's port was kept; the decode server asked)


def test_sglangs_generate_through_the_router_equals_one_engine(cluster, reference):
    """SGLang's native /generate goes through `dsakv router` too, a room per prompt."""
    prompts = ["The quick brown fox jumps over the lazy dog. " * 2, "Hello there."]
    want = reference.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    sp = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    url = f"{cluster['router']}/generate"
    one = httpx.post(url, json={"text": prompts[0], "sampling_params": sp}, timeout=60).json()
    assert (one["text"], one["output_ids"]) == (want[0].text, want[0].token_ids)
    both = httpx.post(url, json={"text": prompts, "sampling_params": sp}, timeout=60).json()
    assert [o["output_ids"] for o in both] == [w.token_ids for w in want]
    # truncate_prompt_tokens: both servers run the same last tokens (else the layouts differ)
    ids = reference.tokenizer.encode(prompts[0], add_special_tokens=False)
    (cut,) = reference.generate([ids[-9:]], SamplingParams(max_tokens=16, temperature=0))
    body = {"prompt": prompts[0], "temperature": 0, "truncate_prompt_tokens": 9}  # (16 tokens)
    r = httpx.post(f"{cluster['router']}/v1/completions", json=body, timeout=60).json()
    assert r["choices"][0]["text"] == cut.text and r["usage"]["prompt_tokens"] == 9
    wait_idle(cluster["prefill"].url)


def test_routed_experts_cross_with_the_first_token(cluster):
    """SGLang's return_routed_experts through `dsakv router`: the prompt's rows come from the
    prefill server with its first token, the output's from the decode server; /generate
    (streamed too), completions and chat give the rows a plain server gives for the same
    prompt and greedy output (transformers' too), from `routed_experts_start_len`; hidden
    states stay a 400 (the prompt's are the prefill server's)."""
    from transformers import AutoModelForCausalLM

    from .conftest import hf_reference
    from .test_routed_experts import EXACT as ONE_ENGINE
    from .test_routed_experts import _decoded

    model, router = cluster["model"], cluster["router"]
    ids = httpx.post(f"{cluster['decode'].url}/tokenize", json={"prompt": "Routing " * 20})
    prompt = ids.json()["tokens"]
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    asks = {"input_ids": prompt, "sampling_params": sp, "return_routed_experts": True}
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = {"messages": messages, **NO_THINKING, **body, "return_routed_experts": True}
    config = EngineConfig(model, **ONE_ENGINE, num_pages=64, enable_return_routed_experts=True)
    with serving(config) as (plain, _):
        want = sglang_generate(plain, **asks)
        want_chat = httpx.post(f"{plain}/v1/chat/completions", json=chat, timeout=60).json()
    routed = _decoded(want["meta_info"])
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ref = hf_reference(hf, prompt + want["output_ids"][:-1])[0]
    np.testing.assert_array_equal(np.sort(routed, -1), ref)

    got = sglang_generate(router, **asks)
    assert got["output_ids"] == want["output_ids"]
    np.testing.assert_array_equal(_decoded(got["meta_info"]), routed)
    streamed = sglang_stream(router, **asks)
    np.testing.assert_array_equal(_decoded(streamed[-1]["meta_info"]), routed)
    late = sglang_generate(router, **asks, routed_experts_start_len=len(prompt) - 3)
    np.testing.assert_array_equal(_decoded(late["meta_info"]), routed[len(prompt) - 3 :])
    body = {"prompt": prompt, **body}
    asked = {**body, "return_routed_experts": True}
    r = httpx.post(f"{router}/v1/completions", json=asked, timeout=60)
    np.testing.assert_array_equal(_decoded(r.json()["sglext"]), routed)
    r = httpx.post(f"{router}/v1/chat/completions", json=chat, timeout=60).json()
    assert r["choices"][0]["message"] == want_chat["choices"][0]["message"]
    np.testing.assert_array_equal(_decoded(r["sglext"]), _decoded(want_chat["sglext"]))

    hidden = {**body, "return_hidden_states": True}
    r = httpx.post(f"{router}/v1/completions", json=hidden, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_hidden_states"
    wait_idle(cluster["prefill"].url)


@contextmanager
def _tap(port: int) -> Iterator[tuple[int, bytearray]]:
    """A TCP relay to 127.0.0.1:`port`: (its own port, what the far side has sent back)."""
    heard, listener = bytearray(), socket.create_server(("127.0.0.1", free_port()))

    def pipe(src: socket.socket, dst: socket.socket, record: bytearray | None) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if record is not None:
                    record += data
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                near, _ = listener.accept()
                far = socket.create_connection(("127.0.0.1", port))
                threading.Thread(target=pipe, args=(near, far, None), daemon=True).start()
                threading.Thread(target=pipe, args=(far, near, heard), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1], heard
    finally:
        listener.close()


def test_the_hand_off_carries_routed_experts_only_when_asked(cluster):
    """The prefill server's `done` line, as the decode server reads it: the prompt's rows
    where the request asked for them, and not a byte more where it did not (it sent
    `"routed_experts": null` to every request)."""
    prefill, decode = cluster["prefill"].url, cluster["decode"].url
    bport = cluster["bootstrap_port"]
    body = {"prompt": "Routing " * 8, "max_tokens": 2, "temperature": 0}
    for room, asked in ((8181, False), (8282, True)):
        ask = {**body, "return_routed_experts": True} if asked else body
        with _tap(bport) as (port, heard), ThreadPoolExecutor(2) as pool:
            headers = {"x-dsakv-bootstrap-room": str(room), "x-dsakv-bootstrap-host": "127.0.0.1"}
            answers = [
                pool.submit(httpx.post, f"{url}/v1/completions", json=ask, timeout=60,
                            headers={**headers, "x-dsakv-bootstrap-port": str(p)})
                for url, p in ((decode, port), (prefill, bport))
            ]  # fmt: skip
            assert [a.result().status_code for a in answers] == [200, 200]
        (done,) = [m for m in map(json.loads, heard.splitlines()) if m["type"] == "done"]
        assert ("routed_experts" in done) == asked == ("sglext" in answers[0].result().json())
    wait_idle(prefill)
    wait_idle(decode)


def test_cached_tokens_are_the_prefill_servers_prefix_hit(cluster):
    """A prompt sent twice: the second's cached tokens (completions, chat, /generate) are
    what the prefill server's prefix cache served, as one engine reports for the same
    sequence; the decode server, which answers the client, had reported 0."""
    decode, prefill = cluster["decode"].url, cluster["prefill"].url
    text = "is a prompt long enough to fill several pages of the prefix cache. " * 3
    chat = {"messages": [{"role": "user", "content": "Chat " + text}], **NO_THINKING}
    body = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    asks = {
        "/v1/completions": ({"prompt": "Completions " + text}, {"prompt": "Completions " + text}),
        "/v1/chat/completions": (chat, chat),
        "/generate": ({"text": "Generate " + text}, {"prompt": "Generate " + text}),
    }
    one = LLM(cluster["model"], kv_cache_dtype="fp32", index_k_dtype="fp32", page_size=16,
              num_pages=256, device="cpu")  # fmt: skip
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    own = scrape_metrics(decode)["dsakv_prefix_hit_tokens_total"]
    for path, (ask, tokenize) in asks.items():
        ids = httpx.post(f"{decode}/tokenize", json=tokenize).json()["tokens"]
        want = [one.generate([ids], params)[0].num_cached_tokens for _ in range(2)]
        got, hits = [], []
        for _ in range(2):
            before = scrape_metrics(prefill)["dsakv_prefix_hit_tokens_total"]
            if path == "/generate":
                sp = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
                r = httpx.post(
                    cluster["router"] + path, json={**ask, "sampling_params": sp}, timeout=60
                )
                got.append(r.json()["meta_info"]["cached_tokens"])
            else:
                r = httpx.post(
                    cluster["router"] + path, json={"model": "m", **ask, **body}, timeout=60
                )
                got.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            hits.append(scrape_metrics(prefill)["dsakv_prefix_hit_tokens_total"] - before)
        assert got == hits == want and want[1] > 0, path
    # (its metric stays its own prefix cache's: a decode server hits none of it)
    assert scrape_metrics(decode)["dsakv_prefix_hit_tokens_total"] == own
    wait_idle(prefill)


def test_32_concurrent_requests_none_lost_and_bytes_per_token(cluster, reference):
    prompts = [f"Request {i}: " + "abcdefghij"[: i % 10] * (1 + i % 7) for i in range(32)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = [o.text for o in reference.generate(prompts, params)]
    before = scrape_metrics(cluster["prefill"].url)
    client = _client(cluster["router"])

    def one(i: int) -> str:
        r = client.completions.create(model="m", prompt=prompts[i], max_tokens=6, **GREEDY)
        return r.choices[0].text

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(one, range(32)))
    assert got == want
    after = wait_idle(cluster["prefill"].url)
    received = wait_idle(cluster["decode"].url)
    # Shipped pages are ordinary pages: full ones join each side's prefix cache.
    assert after["dsakv_kv_pages_cached"] > 0 and received["dsakv_kv_pages_cached"] > 0
    sent = {k: after[k] - before[k] for k in after if k.startswith("dsakv_kv_transfer_")}
    assert sent["dsakv_kv_transfer_requests_total"] == 32
    assert sent["dsakv_kv_transfer_failures_total"] == 0
    tokens = sent["dsakv_kv_transfer_tokens_total"]
    assert tokens == sum(len(reference.engine.prompt_ids(p)) for p in prompts)
    cell = after["dsakv_kv_bytes_per_token"]  # fp32 latent and index-K, 4 of 8 layers own it
    assert cell == 8 * 2304 + 4 * 512
    assert sent["dsakv_kv_transfer_bytes_total"] == tokens * cell


def test_glm52_shaped_servers_send_47700_bytes_per_token(cluster):
    with _router(cluster["bench_prefill"], cluster["bench_decode"]) as base:
        r = _client(base).completions.create(model="m", prompt="x" * 150, max_tokens=2, **GREEDY)
    assert r.usage.completion_tokens == 2
    sent = scrape_metrics(cluster["bench_prefill"].url)
    got = scrape_metrics(cluster["bench_decode"].url)
    assert sent["dsakv_kv_transfer_tokens_total"] == 150
    assert sent["dsakv_kv_transfer_bytes_total"] / 150 == 47_700
    assert got["dsakv_kv_transfer_bytes_total"] == sent["dsakv_kv_transfer_bytes_total"]
    wait_idle(cluster["bench_prefill"].url)
    wait_idle(cluster["bench_decode"].url)


def test_hisparse_decode_server_takes_the_latent_into_host_memory(cluster, reference):
    """A decode server with --enable-hisparse registers its host latent rows for the prefill
    server's writes (index-K, full layers only, into its device pool) and loads each
    request's hot buffer from there: the tokens equal one engine's."""
    prompts = [f"HiSparse {i}: " + "lorem ipsum " * (2 + i) for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = [o.text for o in reference.generate(prompts, params)]
    with _router(cluster["prefill"], cluster["hisparse"]) as base:
        client = _client(base)
        got = [
            client.completions.create(model="m", prompt=p, max_tokens=8, **GREEDY).choices[0].text
            for p in prompts
        ]
    assert got == want
    m = wait_idle(cluster["hisparse"].url)
    tokens = m["dsakv_kv_transfer_tokens_total"]
    assert tokens == sum(len(reference.engine.prompt_ids(p)) for p in prompts)
    assert m["dsakv_kv_transfer_bytes_total"] == tokens * (8 * 2304 + 4 * 512)
    assert m["dsakv_hisparse_rows_to_device_total"] == tokens * 8  # each buffer, once
    assert m["dsakv_hisparse_hot_buffers"] == 0 and m["dsakv_hisparse_device_tokens_used"] == 0


def test_l3_behind_both_servers_serves_the_next_turn(cluster, reference):
    """Both servers write through to one L3 store: the prefill server its prompts' pages, the
    decode server a finished request's, answer included (SGLang's decode-side offload).
    With the prefill server's own cache flushed, the next turn (prompt, answer and more)
    reads every full page from the store, two of them pages only the decode server held,
    and its tokens equal one engine's."""
    rng = random.Random(11)
    first = [rng.randrange(1, 250) for _ in range(70)]
    prefill, decode = cluster["prefill"].url, cluster["decode2"].url
    ask = dict(model="m", max_tokens=40, temperature=0)
    ask["extra_body"] = {"ignore_eos": True, "return_token_ids": True}
    with _router(cluster["prefill"], cluster["decode2"]) as base:
        answer = _client(base).completions.create(prompt=first, **ask)
        said = answer.choices[0].token_ids
        # 70 + 40 tokens: 109 positions computed, 6 full pages; the first 4 the prefill
        # server stored (as it let them go, before the first decode step)
        deadline = time.monotonic() + TIMEOUT
        for server, pages in ((prefill, 4), (decode, 2)):  # (neither steps again meanwhile)
            while scrape_metrics(server)["dsakv_l3_pages_written_total"] < pages:
                assert time.monotonic() < deadline, server
                time.sleep(0.1)
        wait_idle(prefill)
        assert httpx.post(f"{prefill}/flush_cache", timeout=TIMEOUT).status_code == 200
        turn = first + said[:30] + [rng.randrange(1, 250) for _ in range(10)]
        before = scrape_metrics(prefill)
        got = _client(base).completions.create(prompt=turn, **ask)
    hits = scrape_metrics(prefill)["dsakv_l3_hits_total"] - before["dsakv_l3_hits_total"]
    assert hits == 6  # (110 prompt tokens: 6 full pages; the 4 of the first prompt the
    # prefill server stored too, the next 2 only the decode server)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = reference.generate([first, turn], params)
    assert [said, got.choices[0].token_ids] == [o.token_ids for o in want]
    wait_idle(prefill)
    wait_idle(decode)


def test_a_prefill_server_refuses_hisparse(tmp_path):
    p, _ = start_prefill(tmp_path, "p", "glm-tiny", "--enable-hisparse", "--device", "cpu")
    try:
        assert p.proc.wait(TIMEOUT) == 2
    finally:
        p.stop()
    assert "--enable-hisparse is for the decode server" in p.tail()


def test_mismatched_layouts_are_refused_before_any_byte_moves(cluster):
    before = scrape_metrics(cluster["prefill"].url)
    with (
        _router(cluster["prefill"], cluster["dense"]) as base,
        pytest.raises(openai.APIStatusError) as e,
    ):
        _client(base).completions.create(model="m", prompt="hello", max_tokens=4)
    assert e.value.status_code == 502
    assert "elide_index_k: prefill True, decode False" in e.value.message
    after = wait_idle(cluster["prefill"].url)
    for key in ("dsakv_kv_transfer_bytes_total", "dsakv_computed_tokens_total"):
        assert after[key] == before[key], key  # the prompt never even ran
    wait_idle(cluster["dense"].url)


# --- faults -------------------------------------------------------------------------------------


def test_decode_killed_mid_stream_client_errors_prefill_goes_idle(cluster):
    decode2 = cluster["decode2"]
    with _router(cluster["prefill"], decode2) as base:
        stream = _client(base).completions.create(
            model="m", prompt="Tell me a long story.", max_tokens=3000, stream=True, **GREEDY
        )
        try:
            first = next(iter(stream))
            assert first.choices[0].text is not None
            decode2.proc.send_signal(signal.SIGKILL)
            with pytest.raises(openai.APIError, match="lost the decode server"):
                for _ in stream:
                    pass
        finally:
            stream.close()
    wait_idle(cluster["prefill"].url)
    r = _client(cluster["router"]).completions.create(
        model="m", prompt="Hi", max_tokens=3, **GREEDY
    )
    assert r.usage.completion_tokens == 3  # the prefill server keeps serving


def _registration(cluster, room: int, prompt_ids: list[int], **change) -> bytes:
    """What a decode server would send, for a pool on this side of the test."""
    model = cluster["model"]
    layout = CacheLayout.for_model(model, kv_cache_dtype="fp32", index_k_dtype="fp32", page_size=16)
    pool = DSAKVPool(layout, 4)
    compute = disagg_info(cluster["prefill"].url)["compute"]  # (dtype, backend: the server's)
    mine = describe(layout, ModelConfig.resolve(model), model_identity(model), compute)
    reg = {
        "room": room,
        "layout": {**mine, **change},
        "session": f"127.0.0.1:{free_port()}",  # no Mooncake there: the decode side is gone
        "buffers": [PeerBuffer.of(d).to_json() for d in pool.transfer_descriptors()],
        "pages": [0, 1],
        "prompt_ids": prompt_ids,
        "timeout": 10,
    }
    return json.dumps(reg).encode() + b"\n"


def _prefill_request(cluster, room: int) -> httpx.Response:
    headers = {"x-dsakv-bootstrap-room": str(room)}
    body = {"prompt": "hello world", "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{cluster['prefill'].url}/v1/completions", json=body, headers=headers,
                      timeout=60)  # fmt: skip


def test_decode_gone_during_the_write_frees_prefill_pages(cluster):
    prefill = cluster["prefill"]
    ids = httpx.post(f"{prefill.url}/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    before = scrape_metrics(prefill.url)
    with socket.create_connection(("127.0.0.1", cluster["bootstrap_port"]), timeout=30) as s:
        s.sendall(_registration(cluster, 4242, ids))
        r = _prefill_request(cluster, 4242)
        lines = s.makefile().read().splitlines()
    assert r.status_code == 500 and "KV transfer for room 4242 failed" in r.text, r.text
    last = json.loads(lines[-1])
    assert last["type"] == "error" and "failed" in last["message"]
    after = wait_idle(prefill.url)
    assert (
        after["dsakv_kv_transfer_failures_total"] == before["dsakv_kv_transfer_failures_total"] + 1
    )
    assert after["dsakv_kv_transfer_bytes_total"] == before["dsakv_kv_transfer_bytes_total"]


@contextmanager
def _fake_prefill(how: str) -> Iterator[int]:
    """A bootstrap port that reads a registration, then hangs up ("died"), stays silent, or
    answers a line that is not JSON ("garbage") or a `done` without its sizes."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    answers = {"garbage": b"not json\n", "done-garbled": b'{"type": "done"}\n'}

    def serve() -> None:
        conn, _ = server.accept()
        conn.makefile().readline()
        if how == "silent":
            held.append(conn)
        else:
            conn.sendall(answers.get(how, b""))
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        thread.join(TIMEOUT)
        for c in held:
            c.close()
        server.close()


@pytest.mark.parametrize(
    "how, message",
    [
        ("died", "closed the connection"),
        ("silent", "no word from the prefill server"),
        ("garbage", "answered garbage"),  # (was a 500, its pages held for good)
        ("done-garbled", "answered garbage"),
    ],
)
def test_decode_frees_reserved_pages_when_the_prefill_side_fails(cluster, how, message):
    dense = cluster["dense"]  # --disaggregation-timeout 3
    hang = how == "silent"
    with _fake_prefill(how) as port:
        headers = {"x-dsakv-bootstrap-room": "7", "x-dsakv-bootstrap-host": "127.0.0.1",
                   "x-dsakv-bootstrap-port": str(port)}  # fmt: skip
        body = {"prompt": "hello " * 20, "max_tokens": 4}
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(httpx.post, f"{dense.url}/v1/completions", json=body,
                              headers=headers, timeout=60)  # fmt: skip
            if hang:  # pages stay reserved while the prefill side might still write
                deadline = time.monotonic() + 10
                while scrape_metrics(dense.url)["dsakv_kv_pages_used"] == 0:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                assert disagg_info(dense.url)["pending"] == 1
            r = fut.result()
    assert r.status_code == 502, r.text
    assert message in r.json()["error"]["message"]
    if hang:  # it gave up on its own 3 s timeout, not on another
        assert f"prefill server 127.0.0.1:{port} for 3 s" in r.json()["error"]["message"]
    wait_idle(dense.url)


def test_servers_refuse_requests_without_a_room(cluster):
    for name in ("prefill", "decode"):
        r = httpx.post(f"{cluster[name].url}/v1/completions", json={"prompt": "hi"}, timeout=30)
        assert r.status_code == 400 and "dsakv router" in r.json()["error"]["message"]


# --- dsakv serve-pd ----------------------------------------------------------------------------


def test_serve_pd_serves_and_stops_when_a_server_dies(cluster, reference):
    """`dsakv serve-pd`: its two servers and router answer what one engine does; when a
    server dies, serve-pd stops (its router would answer every request with an error while
    /health said ok) and takes the other server down with it. Its `--api-key` is its
    router's too: a keyless client cannot add a worker (a decode server of its own, sent
    the prompts)."""
    port, dport = free_port(), free_port()
    cmd = [sys.executable, "-m", "dsakv.cli", "serve-pd", cluster["model"], *TINY]
    cmd += ["--port", str(port), "--decode-port", str(dport), "--api-key", "sekret"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy([f"http://127.0.0.1:{port}"], [proc], 180)
        spy = {"url": cluster["decode2"].url, "worker_type": "decode"}
        r = httpx.post(f"http://127.0.0.1:{port}/workers", json=spy, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        prompt = "serve-pd says hello"
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="sekret", timeout=60, max_retries=0
        )
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, **GREEDY)
        key = {"Authorization": "Bearer sekret"}
        r = httpx.get(f"http://127.0.0.1:{port}/workers", headers=key, timeout=30)
        assert r.json()["total"] == 2, r.text  # (the spy was not added)
        assert got.choices[0].text == reference.generate(prompt, params)[0].text
        pgrep = ["pgrep", "-P", str(proc.pid)]
        children = subprocess.run(pgrep, capture_output=True, text=True).stdout.split()
        decode = subprocess.run([*pgrep, "-f", f"serve .* --port {dport} "], capture_output=True, text=True)  # fmt: skip
        assert len(children) == 2 and decode.stdout.split()[0] in children, (children, decode)
        os.kill(int(decode.stdout.split()[0]), signal.SIGKILL)
        assert proc.wait(60) != 0
        assert "a server exited with code -9" in proc.stderr.read()
        time.sleep(1)  # (the prefill server, stopped, is reaped by init once serve-pd is gone)
        assert not any(os.path.exists(f"/proc/{pid}") for pid in children)
    finally:
        proc.terminate()  # (serve-pd stops its servers; a kill would leave them running)
        try:
            proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(TIMEOUT)


def test_a_client_leaving_a_non_streamed_request_aborts_it(cluster):
    """Through the router, a client that gives up on a non-streamed request stops its
    generation on the decode server (it used to run to max_tokens, holding its pages)."""
    decode = cluster["decode"].url
    before = scrape_metrics(decode)["dsakv_generation_tokens_total"]
    body = {"model": "m", "prompt": "Tell me a long story.", "max_tokens": 3000}
    client = httpx.Client(base_url=cluster["router"], timeout=2.0)
    with client, pytest.raises(httpx.TimeoutException):
        client.post("/v1/completions", json={**body, "temperature": 0, "ignore_eos": True})
    made = wait_idle(decode)["dsakv_generation_tokens_total"] - before
    assert 0 < made < 3000, made


def test_a_client_leaving_during_prefill_is_no_failure_and_no_traceback(cluster):
    """A client gone while its prompt is prefilled: the prefill server counted a transfer
    failure and the decode server logged "Task exception was never retrieved"."""
    failures = scrape_metrics(cluster["prefill"].url)["dsakv_kv_transfer_failures_total"]
    body = {"model": "m", "prompt": "x" * 3000, "max_tokens": 4, "temperature": 0}
    for _ in range(2):
        client = httpx.Client(base_url=cluster["router"], timeout=0.3)
        with client, pytest.raises(httpx.TimeoutException):
            client.post("/v1/completions", json=body)
    wait_idle(cluster["prefill"].url)
    wait_idle(cluster["decode"].url)
    after = scrape_metrics(cluster["prefill"].url)["dsakv_kv_transfer_failures_total"]
    assert after == failures
    assert "never retrieved" not in cluster["decode"].log.read_text()
    assert "never retrieved" not in cluster["prefill"].log.read_text()


def test_the_request_id_header_goes_through_the_router(cluster):
    """vLLM's X-Request-Id reaches both servers and comes back: the response's id, and
    the name /abort_request (broadcast) ends the stream by; the router dropped it, so the
    id was a random one and the abort reached nothing."""
    router, body = cluster["router"], {"prompt": "x", "max_tokens": 3}
    named = {"X-Request-Id": "via-header"}
    for stream in (False, True):
        r = httpx.post(f"{router}/v1/completions", json={**body, "stream": stream},
                       headers=named, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        first = json.loads(r.text.split("\n")[0][6:]) if stream else r.json()
        assert first["id"] == "cmpl-via-header" and r.headers["x-request-id"] == "via-header"
    # (max_tokens null: to the context's end)
    body = {"prompt": "hello", "max_tokens": None, "ignore_eos": True, "stream": True}
    named = {"X-Request-Id": "to-abort"}
    with httpx.stream("POST", f"{router}/v1/completions", json=body, headers=named,
                      timeout=60) as r:  # fmt: skip
        assert r.headers["x-request-id"] == "to-abort"
        chunks = (json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {"))
        assert next(chunks)["id"] == "cmpl-to-abort"
        a = httpx.post(f"{router}/abort_request", json={"rid": "to-abort"}, timeout=60)
        assert a.status_code == 200, a.text
        *_, last = chunks
    assert last["choices"][0]["finish_reason"] == "abort"
    wait_idle(cluster["prefill"].url)
    wait_idle(cluster["decode"].url)


def test_a_list_of_prompts_through_the_router(cluster, reference):
    """A completions request with several prompts: one bootstrap room each (it failed with
    a 502, or a 400 "more prompts than bootstrap rooms")."""
    prompts = ["Hello", "World wide", "Third prompt here"]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = [o.text for o in reference.generate(prompts, params)]
    got = _client(cluster["router"]).completions.create(
        model="m", prompt=prompts, max_tokens=6, **GREEDY
    )
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == want
    assert got.usage.completion_tokens == 18
    wait_idle(cluster["prefill"].url)
    wait_idle(cluster["decode"].url)


@pytest.mark.parametrize("prompt", ["", "x" * 5000], ids=["empty", "past-the-context"])
def test_a_refused_prompt_is_a_400_before_the_room_is_claimed(cluster, prompt):
    """The prefill server checks the prompt before it claims the bootstrap room: no decode
    server registers a prompt it refused too, so claiming first held the request for the
    room's whole timeout (20 s here, 60 by default) before a 502."""
    before = scrape_metrics(cluster["prefill"].url)["dsakv_kv_transfer_failures_total"]
    headers = {"x-dsakv-bootstrap-room": "9191"}
    r = httpx.post(f"{cluster['prefill'].url}/v1/completions", headers=headers, timeout=60,
                   json={"prompt": prompt, "max_tokens": 4})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    after = scrape_metrics(cluster["prefill"].url)["dsakv_kv_transfer_failures_total"]
    assert after == before
    # The decode server that registers the room (its context may be longer) hears the 400.
    registration = {"room": 9191, "layout": {}}
    with pytest.raises(BootstrapError) as e:
        asyncio.run(request_kv("127.0.0.1", cluster["bootstrap_port"], registration, 20))
    assert e.value.status == 400 and str(e.value) == r.json()["error"]["message"]


def test_a_prefill_servers_error_answer_is_the_decode_servers_at_once(cluster):
    """A request the prefill server answers with an error before its engine sees it (here a
    404, an unknown model; an API key only the prefill server has, a 401, alike) never
    claims its room: the decode server waited out the whole timeout (20 s here, 60 by
    default), then answered a 502 "no request for room N". It answers the prefill server's
    status and message now, whether it registered first or the refusal came first; so do
    rooms named in SGLang's body fields."""
    prefill, decode = cluster["prefill"].url, cluster["decode"].url
    headers = {"x-dsakv-bootstrap-room": "7171", "x-dsakv-bootstrap-host": "127.0.0.1",
               "x-dsakv-bootstrap-port": str(cluster["bootstrap_port"])}  # fmt: skip
    body = {"model": "m", "prompt": "hello", "max_tokens": 4}
    rooms = disagg_info(prefill)["open_rooms"]
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(httpx.post, f"{decode}/v1/completions", json=body,
                              headers=headers, timeout=60)  # fmt: skip
        deadline = time.monotonic() + 10
        while disagg_info(prefill)["open_rooms"] == rooms:  # the decode server registered
            assert time.monotonic() < deadline and not waiting.done()
            time.sleep(0.05)
        r = httpx.post(f"{prefill}/v1/completions", json={**body, "model": "nope"},
                       headers=headers, timeout=60)  # fmt: skip
        assert r.status_code == 404, r.text
        answer = waiting.result()
    assert answer.status_code == 404, answer.text
    assert answer.json()["error"]["message"] == r.json()["error"]["message"]
    assert answer.json()["error"]["param"] == r.json()["error"]["param"] == "model"
    r = httpx.post(f"{prefill}/v1/completions", timeout=60,
                   json={**body, "max_tokens": "four", "bootstrap_room": 7272})  # fmt: skip
    assert r.status_code == 400, r.text
    with pytest.raises(BootstrapError) as e:
        asyncio.run(request_kv("127.0.0.1", cluster["bootstrap_port"], {"room": 7272}, 20))
    assert e.value.status == 400 and str(e.value) == r.json()["error"]["message"]
    wait_idle(prefill)
    wait_idle(decode)


def test_a_request_the_decode_server_refuses_leaves_no_claim_waiting(cluster):
    """`stream_options` without `stream` is the decode server's 400, but the prefill server's
    copy (sent without either) is valid: it claimed a room and waited out its timeout (20 s
    here, 60 by default) for a decode server that had refused the request, then counted a
    transfer failure. The router hangs up on it now, and the claim goes with the connection."""
    prefill = cluster["prefill"].url
    failures = scrape_metrics(prefill)["dsakv_kv_transfer_failures_total"]
    routed = scrape_metrics(cluster["router"])["dsakv_router_failures_total"]
    body = {"prompt": "x", "max_tokens": 4, "stream_options": {"include_usage": True}}
    r = httpx.post(f"{cluster['router']}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
    time.sleep(2)  # the copy has reached the prefill server
    deadline = time.monotonic() + 8
    while disagg_info(prefill)["open_rooms"]:
        assert time.monotonic() < deadline, "the prefill server still waits for the room"
        time.sleep(0.1)
    assert scrape_metrics(prefill)["dsakv_kv_transfer_failures_total"] == failures
    assert scrape_metrics(cluster["router"])["dsakv_router_failures_total"] == routed
    wait_idle(prefill)


def test_the_router_asks_again_for_a_bootstrap_port_that_stopped_answering(cluster, reference):
    """A prefill server restarted on another bootstrap port: the router's first request fails
    (it knew the old port), and it asked no more, so every later one failed too."""
    prefill, decode = cluster["prefill"], cluster["decode"]
    app = build_router_app([prefill.url], [decode.url])
    server = uvicorn.Server(uvicorn.Config(app, port=free_port(), log_level="warning"))
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    want = reference.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))[0].text
    with running(server) as base:
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
        app.state.router._bootstrap[prefill.url] = ("127.0.0.1", free_port())  # the old port
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 502
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
    wait_idle(prefill.url)
    wait_idle(decode.url)


def test_processors_carry_across_and_a_dead_grammar_is_a_400(cluster, reference):
    """The prefill server samples the first token: logit bias, penalties and min_tokens
    apply there as on one engine; a grammar with no first token fails that request alone,
    a 400 through the router (a 502 and a transfer failure before)."""
    prompt = [5, 17, 99, 3, 250, 41]
    plain = reference.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0]
    kw = dict(max_tokens=8, temperature=0.0, ignore_eos=True, repetition_penalty=1.5,
              logit_bias={plain.token_ids[0]: -100.0}, min_tokens=4,
              stop_token_ids=(plain.token_ids[1],))  # fmt: skip
    want = reference.generate([prompt], SamplingParams(**kw))[0]
    body = {**kw, "prompt": prompt, "logit_bias": {str(plain.token_ids[0]): -100}}
    r = httpx.post(f"{cluster['router']}/v1/completions", json=body, timeout=60).json()
    assert r["choices"][0]["text"] == want.text and want.token_ids[0] != plain.token_ids[0]
    before = scrape_metrics(cluster["prefill"].url)["dsakv_kv_transfer_failures_total"]
    body = {"prompt": "x", "max_tokens": 4, "regex": r"[^\s\S]"}
    r = httpx.post(f"{cluster['router']}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and "cannot be completed" in r.text, r.text
    after = scrape_metrics(cluster["prefill"].url)["dsakv_kv_transfer_failures_total"]
    assert after == before
    wait_idle(cluster["decode"].url)
