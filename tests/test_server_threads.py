"""Which OS thread does the server's torch work, and `dsakv bench --serving` end to end.

On the CPU, torch runs parallel ops in an OpenMP team per OS thread. The server once built
its engine on the main thread and stepped it on another: two teams, more libgomp threads
than cores on 2 cores, and libgomp then sleeps between ops, which halved the decode rate.
These tests pin the structure that avoids it (one thread builds, steps and closes the
engine); the speed itself is `dsakv bench --serving`'s to report, never asserted here.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from pathlib import Path

import httpx
import pytest

from dsakv.cli import main
from dsakv.engine import EngineConfig
from dsakv.errors import DsakvError
from dsakv.models.tiny import write_tiny_model
from dsakv.server import make_server, serve
from dsakv.server.runner import EngineThread

from .serving import free_port, serving

ENGINE_ARGS = dict(
    kv_cache_dtype="fp32", index_k_dtype="fp32", num_pages=64, page_size=16, device="cpu"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("threads") / "tiny"
    write_tiny_model(path, preset="glm-tiny", seed=0)
    return path


def _on_engine_thread(async_engine, fn):
    async def go():
        return await asyncio.wait_for(async_engine.call(lambda e: fn()), 30)

    return asyncio.run(go())


def test_the_engine_is_built_and_stepped_on_one_thread(model_dir, monkeypatch):
    """The thread that built the engine (and so ran its first torch ops) is the one that
    steps it, and it is not the thread that runs the HTTP server."""
    built_on: list[int] = []
    real = serve.create_engine

    def create_engine(*args, **kwargs):
        built_on.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(serve, "create_engine", create_engine)
    with serving(EngineConfig(model=str(model_dir), **ENGINE_ARGS)) as (_, async_engine):
        steps_on = _on_engine_thread(async_engine, threading.get_ident)  # between steps
    assert built_on == [steps_on]
    assert steps_on != threading.main_thread().ident


def test_prompts_are_tokenized_off_the_engine_thread_and_the_event_loop(model_dir):
    """A long prompt's tokenization held every stream on the engine thread (a request
    without max_tokens) or every route on the event loop (/tokenize): 5 MB, 5 s."""
    with serving(EngineConfig(model=str(model_dir), **ENGINE_ARGS)) as (base, async_engine):
        engine = async_engine.engine
        steps_on = _on_engine_thread(async_engine, threading.get_ident)
        calls: list[tuple[int, bool]] = []

        def spy(real):
            def encode(*args, **kwargs):
                try:
                    asyncio.get_running_loop()
                    on_loop = True
                except RuntimeError:
                    on_loop = False
                calls.append((threading.get_ident(), on_loop))
                return real(*args, **kwargs)

            return encode

        tok = engine.tokenizer
        engine.encode, tok.encode = spy(engine.encode), spy(tok.encode)
        try:
            for path in ("/v1/completions", "/tokenize"):  # (completions: no max_tokens)
                calls.clear()
                r = httpx.post(f"{base}{path}", json={"prompt": "a long prompt"}, timeout=30)
                assert r.status_code == 200, r.text
                assert calls and all(t != steps_on and not loop for t, loop in calls), path
        finally:
            del engine.encode, tok.encode


def test_close_engine_runs_on_the_engine_thread_then_ends_it(model_dir, monkeypatch):
    """`run_server`'s teardown: the engine (other ranks, L3 tier) closes on its own thread,
    so rank processes tied to that thread outlive the step loop until they were stopped."""
    config = EngineConfig(model=str(model_dir), **ENGINE_ARGS)
    _, async_engine = make_server(config, port=free_port(), log_level="warning")
    steps_on = _on_engine_thread(async_engine, threading.get_ident)
    closed_on: list[int] = []
    real_close = async_engine.engine.close

    def close() -> None:
        closed_on.append(threading.get_ident())
        real_close()

    monkeypatch.setattr(async_engine.engine, "close", close)
    async_engine.shutdown()
    assert not async_engine.alive
    async_engine.close_engine()
    assert closed_on == [steps_on]
    async_engine._owner.thread.join(10)
    assert not async_engine._owner.thread.is_alive()


def test_a_stopped_server_leaves_no_grammar_compile_thread(model_dir):
    """The grammar compile threads (`Handlers._compiles`) outlived their server: each app
    built in a process (several over one engine in tests) left its own. The app's lifespan
    now ends them when its server stops."""

    def compiling() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("dsakv-grammar")}

    before = compiling()  # (another module's app, if one still runs)
    body = {"prompt": "x", "max_tokens": 2, "response_format": {"type": "json_object"}}
    with serving(EngineConfig(model=str(model_dir), **ENGINE_ARGS)) as (base, _):
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert compiling() - before  # (its grammar compiled on one)
    assert not compiling() - before


def test_a_failed_build_raises_in_the_caller_and_ends_the_thread(tmp_path):
    before = set(threading.enumerate())
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(Exception):  # noqa: B017 - whatever loading a broken model raises
        make_server(EngineConfig(model=str(tmp_path), **ENGINE_ARGS), port=free_port())
    started = [t for t in threading.enumerate() if t not in before and t.name == "dsakv-engine"]
    for t in started:
        t.join(10)
        assert not t.is_alive()


def test_engine_thread_hands_back_results_and_any_exception():
    worker = EngineThread(name="dsakv-test")
    try:
        assert worker.call(threading.get_ident) == worker.thread.ident
        with pytest.raises(DsakvError, match="bad"):
            worker.call(lambda: (_ for _ in ()).throw(DsakvError("bad")))
        # A non-zero rank's create_engine ends with sys.exit(0): the caller must exit too.
        with pytest.raises(SystemExit):
            worker.call(lambda: sys.exit(0))
        assert worker.thread.is_alive()
    finally:
        worker.close()
    worker.thread.join(10)
    assert not worker.thread.is_alive()


# --- dsakv bench --serving ------------------------------------------------------------------------


def test_bench_serving_quick_end_to_end(tmp_path, capsys):
    """In process and through a real `dsakv serve`, 1 and 8 requests of 32 tokens: the
    report's structure and that every request got its tokens (no speed is asserted)."""
    out = tmp_path / "serving.json"
    code = main(["bench", "--serving", "--quick", "--model", "glm-tiny", "--json", str(out)])
    assert code == 0
    r = json.loads(out.read_text())
    assert set(r) >= {"meta", "in_process", "server", "ratios", "target"}
    assert r["meta"]["sizes"] == {
        "concurrency": [1, 8],
        "prompt_len": 128,
        "output_len": 32,
        "repeats": 1,
    }
    for n in ("1", "8"):
        for side in ("in_process", "server"):
            row = r[side][n]
            assert row["requests"] == int(n)
            assert row["output_tokens"] == int(n) * 32
            assert 0 < row["decode_tokens"] < row["output_tokens"]
            assert row["decode_tokens_per_s"] > 0 and row["decode_s"] > 0
            assert len(row["runs"]) == 1
        assert r["ratios"][n] > 0
        assert isinstance(r["target"]["met"][n], bool)
    text = capsys.readouterr().out
    assert "dsakv serve" in text and "in-process" in text


@pytest.mark.parametrize(
    "extra",
    [
        ["--engine-arg", "no_such_arg=1"],
        ["--engine-arg", "page_size=0"],
        ["--engine-arg", "attention_backend"],
        ["--pd"],
        ["--tp", "2"],
    ],
)
def test_bench_serving_bad_input_is_one_error_line(extra, capsys):
    with pytest.raises(SystemExit) as exc:
        sys.exit(main(["bench", "--serving", "--model", "glm-tiny", *extra]))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err


def test_engine_args_without_serving_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        sys.exit(main(["bench", "--engine-arg", "attention_backend=torch"]))
    assert exc.value.code == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_serve_flags_round_trip_through_the_cli(model_dir):
    from dsakv.bench.serving_rate import serve_flags

    args = {
        "attention_backend": "torch",
        "elide_index_k": False,
        "enable_prefix_cache": False,
        "num_pages": 32,
        "kv_cache_dtype": "fp32",
    }
    config = EngineConfig.from_kwargs(str(model_dir), **args)
    flags = serve_flags(config, args)
    assert "--no-elide-index-k" in flags and "--no-prefix-cache" in flags
    assert flags[flags.index("--attention-backend") + 1] == "torch"


def test_a_request_whose_update_fails_fails_alone(model_dir, monkeypatch):
    """A request's update (its texts, its alternatives' texts) was built outside the step's
    guard: one request failing there ended the engine thread, and the server answered 503
    until restarted. Now that request ends with its error; the others run on, unchanged."""
    from dsakv.engine import SamplingParams
    from dsakv.engine.launch import create_engine
    from dsakv.server import runner

    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    thread = EngineThread()
    config = EngineConfig(model=str(model_dir), **ENGINE_ARGS)
    async_engine = runner.AsyncEngine(thread.call(lambda: create_engine(config)), thread)

    async def one(prompt: list[int]) -> tuple[list[int], str | None, str | None]:
        (stream,) = await async_engine.generate_n(prompt, params, 1)
        tokens: list[int] = []
        while True:
            update = await asyncio.wait_for(stream.get(), 60)
            tokens += update.token_ids
            if update.finished:
                return tokens, update.finish_reason, update.error

    async def both():
        return await asyncio.gather(one([5, 6, 7, 8]), one([7, 7, 7, 9]))

    real = runner._update

    def update(engine, stream, req):
        if list(req.prompt_ids[:3]) == [7, 7, 7] and len(req.output_ids) >= 2:
            raise RuntimeError("boom")
        return real(engine, stream, req)

    try:
        want = asyncio.run(one([5, 6, 7, 8]))
        monkeypatch.setattr(runner, "_update", update)
        good, bad = asyncio.run(both())
        assert good == want and len(want[0]) == 8
        assert bad[1:] == ("error", "engine error: boom") and len(bad[0]) < 8
        assert async_engine.alive
        monkeypatch.undo()
        assert asyncio.run(one([5, 6, 7, 8])) == want
        in_flight = asyncio.run(async_engine.call(lambda e: e.check_integrity() or e.requests))
        assert not in_flight
    finally:
        async_engine.shutdown()
        async_engine.close_engine()
