"""What `dsakv router` relays besides generation, on a prefill/decode pair behind it (all in
this process, on loopback, glm-tiny on the CPU): vLLM's pausing (/pause, its query too,
/resume, /is_paused: paused only while every server is), /reset_prefix_cache and SGLang's
profiling reach every server, a pause that fails somewhere being undone; tokenizing, a
model's card, /version and /get_weights_by_name are one server's answer; /load is the
decode servers' requests in flight; SGLang's /server_info and /get_load gather every
server's; SageMaker's /ping and /invocations (a chat or a completions request, told apart
by its shape)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from types import SimpleNamespace

import httpx
import pytest
import torch

from dsakv.engine import EngineConfig
from dsakv.models.tiny import write_tiny_model

from .serving import (
    NO_THINKING,
    TIMEOUT,
    engine_stops_stepping_at,
    free_port,
    routing,
    scrape_metrics,
    serving_disagg,
    until_in_flight,
    wait_idle,
)
from .test_invocations import NO_HANDLER

GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "Name a colour."}], **NO_THINKING, **GREEDY}


@pytest.fixture(scope="module")
def pd(tmp_path_factory) -> Iterator[SimpleNamespace]:
    """A prefill server and a decode server, the router in front."""
    model = str(write_tiny_model(tmp_path_factory.mktemp("relays") / "m", "glm-tiny"))
    conf = EngineConfig(model, device="cpu", num_pages=64, page_size=16,
                        kv_cache_dtype="fp32", index_k_dtype="fp32",
                        expert_distribution_recorder_mode="stat")  # fmt: skip
    with ExitStack() as stack:
        p_url, _ = stack.enter_context(serving_disagg(conf, "prefill"))
        d_url, decode = stack.enter_context(serving_disagg(conf, "decode"))
        router = stack.enter_context(routing([p_url], [d_url]))
        yield SimpleNamespace(router=router, prefill_url=p_url, decode_url=d_url, decode=decode)


def _get(base: str, path: str, **kw) -> httpx.Response:
    return httpx.get(f"{base}{path}", timeout=TIMEOUT, **kw)


def _post(base: str, path: str, **kw) -> httpx.Response:
    return httpx.post(f"{base}{path}", timeout=TIMEOUT, **kw)


def _is_paused(base: str) -> bool:
    r = _get(base, "/is_paused")
    assert r.status_code == 200, r.text
    return r.json()["is_paused"]


def _cached(base: str) -> float:
    """The pages a server's prefix cache holds."""
    return scrape_metrics(base)["dsakv_kv_pages_cached"]


def _complete(base: str, path: str, body: dict) -> dict:
    r = _post(base, path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_vllms_pause_resume_and_is_paused_reach_every_server(pd):
    """/pause's query goes with it (`keep`: the prefix cache stays, where the default
    `abort` drops it); /is_paused is true only while every server is paused (a trainer
    reading true may swap the weights: no server generates)."""
    _complete(pd.router, "/v1/chat/completions", CHAT)
    wait_idle(pd.prefill_url)
    cached = _cached(pd.prefill_url)
    assert cached > 0
    servers = (pd.prefill_url, pd.decode_url)
    r = _post(pd.router, "/pause", params={"mode": "keep"})
    assert (r.status_code, r.json()) == (200, {"status": "paused"}), r.text
    assert [_is_paused(u) for u in servers] == [True, True]
    assert _is_paused(pd.router) is True
    assert _cached(pd.prefill_url) == cached
    assert _post(pd.decode_url, "/resume").status_code == 200  # one server resumed alone
    assert _is_paused(pd.router) is False
    r = _post(pd.router, "/resume")
    assert (r.status_code, r.json()) == (200, {"status": "resumed"}), r.text
    assert [_is_paused(u) for u in servers] == [False, False]
    r = _post(pd.router, "/pause")  # (abort: then the cache is dropped)
    assert r.status_code == 200, r.text
    assert [_is_paused(u) for u in servers] == [True, True]
    assert _cached(pd.prefill_url) == 0
    assert _post(pd.router, "/resume").status_code == 200
    assert _complete(pd.router, "/v1/chat/completions", CHAT)["usage"]["completion_tokens"] == 4


def test_a_pause_that_fails_on_one_server_is_undone_on_the_others(pd):
    """(As SGLang's /pause_generation is.) A call for one server passes over one that is
    down."""
    dead = f"http://127.0.0.1:{free_port()}"
    with routing([pd.prefill_url], [dead, pd.decode_url]) as router:
        r = _post(router, "/pause", params={"mode": "keep"})
        assert r.status_code == 502 and dead in r.json()["error"]["message"], r.text
        assert "1 of 3" in r.json()["error"]["message"]
        assert [_is_paused(u) for u in (pd.prefill_url, pd.decode_url)] == [False, False]
        r = _get(router, "/is_paused")
        assert r.status_code == 502 and dead in r.json()["error"]["message"], r.text
        r = _post(router, "/tokenize", json={"prompt": "Hi"})
        assert r.json() == _post(pd.decode_url, "/tokenize", json={"prompt": "Hi"}).json()


def test_reset_prefix_cache_and_profiling_reach_every_server(pd):
    """vLLM's /reset_prefix_cache drops both servers' prefix caches; /start_profile and
    /stop_profile (GET or POST, as SGLang's) get the servers' own answers, their 400s too."""
    _complete(pd.router, "/v1/completions", {"prompt": "A prompt to cache.", **GREEDY})
    wait_idle(pd.prefill_url)
    wait_idle(pd.decode_url)
    assert _cached(pd.prefill_url) > 0
    r = _post(pd.router, "/reset_prefix_cache")
    assert (r.status_code, r.text) == (200, "Cache flushed.\n")
    assert [_cached(u) for u in (pd.prefill_url, pd.decode_url)] == [0, 0]
    r = _post(pd.router, "/start_profile", json={"activities": ["TPU"]})
    assert r.status_code == 400 and "activities" in r.json()["error"]["message"], r.text
    for method in ("GET", "POST"):
        r = httpx.request(method, f"{pd.router}/stop_profile", timeout=TIMEOUT)
        assert r.status_code == 400 and "no profile is running" in r.text, r.text


def test_the_expert_distribution_record_reaches_every_server(pd, tmp_path, monkeypatch):
    """SGLang's /start_, /stop_ and /dump_expert_distribution_record (GET or POST) reach
    both servers: each writes its own dump, and each counted the tokens it routed (the
    prefill server the prompt, the decode server the tokens it generated)."""
    monkeypatch.setenv("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", str(tmp_path))
    r = httpx.get(f"{pd.router}/start_expert_distribution_record", timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    _complete(pd.router, "/v1/completions", {"prompt": "Count my experts.", **GREEDY})
    wait_idle(pd.prefill_url)
    wait_idle(pd.decode_url)
    for path in ("/stop_expert_distribution_record", "/dump_expert_distribution_record"):
        assert _post(pd.router, path).status_code == 200
    dumps = sorted(tmp_path.glob("expert_distribution_recorder_*.pt"))
    assert len(dumps) == 2, dumps
    counts = [int(torch.load(f)["logical_count"].sum()) for f in dumps]
    assert all(c > 0 for c in counts), counts


def test_an_expert_record_start_that_fails_on_one_server_is_undone(pd, tmp_path, monkeypatch):
    """(As a pause is.) The servers that started recording stop again (their steps would
    run eager, off the CUDA graphs, for a window nobody dumps): a request after it is
    counted nowhere."""
    monkeypatch.setenv("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", str(tmp_path))
    dead = f"http://127.0.0.1:{free_port()}"
    with routing([pd.prefill_url], [dead, pd.decode_url]) as router:
        r = _post(router, "/start_expert_distribution_record")
        assert r.status_code == 502 and dead in r.json()["error"]["message"], r.text
    _complete(pd.router, "/v1/completions", {"prompt": "Count nothing.", **GREEDY})
    wait_idle(pd.prefill_url)
    wait_idle(pd.decode_url)
    assert _post(pd.router, "/dump_expert_distribution_record").status_code == 200
    dumps = sorted(tmp_path.glob("expert_distribution_recorder_*.pt"))
    assert len(dumps) == 2, dumps
    assert [int(torch.load(f)["logical_count"].sum()) for f in dumps] == [0, 0]


def test_tokenizing_cards_version_and_weights_are_one_servers_answer(pd):
    name = _get(pd.router, "/v1/models").json()["data"][0]["id"]
    calls = [
        ("POST", "/tokenize", {"prompt": "Hello there"}),
        ("POST", "/v1/tokenize", {"messages": CHAT["messages"]}),
        ("POST", "/detokenize", {"tokens": [72, 101, 108]}),
        ("POST", "/v1/detokenize", {"tokens": [72]}),
        ("GET", "/version", None),
        ("GET", "/model_info", None),
        ("GET", "/get_model_info", None),
        ("GET", f"/v1/models/{name}", None),
        ("GET", "/v1/models/not-served", None),  # (its 404, as it is)
        ("GET", "/get_weights_by_name", {"name": "model.embed_tokens.weight", "truncate_size": 2}),
        ("POST", "/get_weights_by_name", {"name": "model.nope.weight"}),  # (its 400)
    ]
    for method, path, body in calls:
        got, want = (
            httpx.request(method, f"{base}{path}", json=body, timeout=TIMEOUT)
            for base in (pd.router, pd.decode_url)
        )
        assert (got.status_code, got.json()) == (want.status_code, want.json()), path
    assert _get(pd.router, "/v1/models/not-served").status_code == 404
    rows = httpx.request(
        "GET", f"{pd.router}/get_weights_by_name", json=calls[9][2], timeout=TIMEOUT
    )
    assert rows.status_code == 200 and len(rows.json()) == 2, rows.text


def test_load_counts_the_requests_in_flight_on_the_decode_servers(pd):
    assert _get(pd.router, "/load").json() == {"server_load": 0}
    body = {"prompt": "Hold on.", "temperature": 0, "ignore_eos": True, "max_tokens": 100}
    with ThreadPoolExecutor(1) as pool, engine_stops_stepping_at(pd.decode, 2):
        held = pool.submit(_post, pd.router, "/v1/completions", json=body)
        until_in_flight(pd.decode_url, held)
        assert _get(pd.router, "/load").json() == {"server_load": 1}
        assert _post(pd.router, "/abort_request", json={"abort_all": True}).status_code == 200
        assert held.result().json()["choices"][0]["finish_reason"] == "abort"
    assert _get(pd.router, "/load").json() == {"server_load": 0}


def test_server_info_and_get_load_gather_every_server(pd):
    """SGLang's /server_info (and /get_server_info), as its PD load balancer answers it:
    each server's own under its role, the decode servers' internal_states on top (where
    bench_serving reads them); /get_load each server's entries, naming the server and its
    role, the decode servers' first."""
    wait_idle(pd.prefill_url)
    wait_idle(pd.decode_url)
    stable = ("model_path", "page_size", "max_total_num_tokens", "disaggregation_mode")
    for path in ("/server_info", "/get_server_info"):
        r = _get(pd.router, path)
        assert r.status_code == 200, r.text
        got = r.json()
        for role, url in (("prefill", pd.prefill_url), ("decode", pd.decode_url)):
            (info,) = got[role]
            own = _get(url, path).json()
            assert {k: info[k] for k in stable} == {k: own[k] for k in stable}, role
            assert info["disaggregation_mode"] == role
        assert got["internal_states"] == got["decode"][0]["internal_states"]
        assert "last_gen_throughput" in got["internal_states"][0]
    r = _get(pd.router, "/get_load")
    assert r.status_code == 200, r.text
    rows = r.json()
    servers = [(pd.decode_url, "decode"), (pd.prefill_url, "prefill")]
    assert [(e["worker"], e["worker_type"]) for e in rows] == servers
    for entry, (url, _) in zip(rows, servers):
        (own,) = _get(url, "/get_load").json()  # (one rank each)
        assert {k: entry[k] for k in own} == own and own["num_reqs"] == 0


def test_sagemakers_ping_and_invocations(pd):
    """/invocations is chat for a body with messages (first, as vLLM's), completions for one
    with a prompt, the same answer as that route's, streamed too; a body with neither is
    vLLM's 400."""
    for method in ("GET", "POST"):
        r = httpx.request(method, f"{pd.router}/ping", timeout=TIMEOUT)
        assert (r.status_code, r.json()) == (200, {"status": "ok"})
    prompt = {"prompt": "Once upon a time", **GREEDY}
    for body, path in ((CHAT, "/v1/chat/completions"), (prompt, "/v1/completions")):
        got = _complete(pd.router, "/invocations", body)
        want = _complete(pd.router, path, body)
        assert got["object"] == want["object"]
        assert got["choices"] == want["choices"]
        tokens = ("prompt_tokens", "completion_tokens")  # (cached tokens differ: the 2nd hits)
        assert [got["usage"][k] for k in tokens] == [want["usage"][k] for k in tokens]
    both = _complete(pd.router, "/invocations", {**CHAT, "prompt": "ignored"})
    assert both["object"] == "chat.completion"
    r = _post(pd.router, "/invocations", json={**CHAT, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[0])["object"] == "chat.completion.chunk"
    r = _post(pd.router, "/invocations", json={"input": "Hi"})
    assert r.status_code == 400 and r.json()["error"]["message"] == NO_HANDLER, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = _post(pd.router, "/invocations", content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], r.text


def test_the_router_loads_no_torch():
    """`dsakv router` is the light process in front of the servers: starting it (the CLI,
    its app, its launcher) imports neither torch nor the engine (it once did, through the
    server's app module for two small helpers)."""
    import subprocess
    import sys

    code = (
        "import sys, dsakv.cli, dsakv.disagg.router, dsakv.disagg.launch\n"
        "print(sorted(m for m in ('torch', 'dsakv.engine', 'dsakv.server.app') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_the_cli_parses_and_plans_without_torch(glm_tiny):
    """`dsakv --help`, a command's --help and a flag the parser refuses answered after
    torch's 2 s import (the parser read its dtype and storage choices from `dsakv.memory`,
    whose package import loaded torch); `dsakv router` loaded it too, from `main`, and
    `dsakv plan` (ParallelConfig's module, the engine's draft steps, safetensors' torch
    reader for a checkpoint's names). Now none of them does; a command that runs a model
    loads it after parsing. serve's and run-batch's refusals (an unknown flag, a missing
    one) loaded it too: argparse checks the chat parsers' default, whose module loads torch."""
    import subprocess
    import sys

    code = f"""import contextlib, io, sys
from dsakv.cli import main
for argv in (["--help"], ["serve", "--help"], ["generate", "m", "--tp", "0"], ["router", "--help"],
             ["serve", "m", "--bogus"], ["run-batch", "-o", "out.jsonl"],
             ["plan", "glm-5.2", "--tp", "8", "--enable-hisparse", "--host-pool-gib", "100"],
             ["plan", {glm_tiny!r}, "--tp", "2", "--draft-layers", "1"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    print(argv[0], code, "torch" in sys.modules)
import dsakv.memory
print("dir", "DSAKVPool" in dir(dsakv.memory), "torch" in sys.modules)  # (lazy names listed)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:-1] == ["--help 0 False", "serve 0 False", "generate 2 False",
                                        "router 0 False", "serve 2 False", "run-batch 2 False",
                                        "plan 0 False", "plan 0 False", "dir True False"]  # fmt: skip
