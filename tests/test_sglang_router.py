"""SGLang's router (`sglang-router`, the Rust gateway SGLang deployments put in front of their
servers) in front of dsakv: PD mode over a dsakv prefill and decode server (its
`bootstrap_room` / `bootstrap_host` / `bootstrap_port` body fields are dsakv's handoff), and
regular mode over two plain replicas with the cache-aware policy. Real processes on
loopback, the official `openai` client in front, an offline `LLM` on the same model as the
reference."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from dsakv.disagg.handoff import (
    BootstrapMiddleware,
    BootstrapTarget,
    from_body,
    from_headers,
    next_target,
)
from dsakv.disagg.launch import wait_healthy
from dsakv.disagg.router import build_router_app
from dsakv.engine import LLM, EngineConfig, SamplingParams
from dsakv.models.tiny import TINY_PRESETS, write_tiny_model
from dsakv.server.protocol import APIError

from .conftest import flat_logprobs
from .serving import (
    GREEDY,
    GREEDY_CHAT,
    NO_THINKING,
    TIMEOUT,
    ServerProcess,
    check_pd_chat,
    free_port,
    running,
    scrape_metrics,
    serving,
    start_decode,
    start_prefill,
    wait_idle,
)

ENGINE = dict(kv_cache_dtype="fp32", index_k_dtype="fp32", page_size=16, num_pages=256)
TINY = ["--kv-cache-dtype", "fp32", "--index-k-dtype", "fp32", "--page-size", "16",
        "--num-pages", "256", "--device", "cpu"]  # fmt: skip


@contextmanager
def sglang_router(log: Path, workers: list[str], *args: str) -> Iterator[str]:
    """`python -m sglang_router.launch_router ARGS` on loopback (its metrics port too); yields
    its URL once every worker in `workers` is registered, healthy and named "m" (the name
    comes from dsakv's /server_info). Killed afterwards."""
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", *args]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1"]
    cmd += ["--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1"]
    cmd += ["--log-level", "warn"]
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not _registered(url, workers):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        yield url
    finally:
        proc.kill()
        proc.wait(TIMEOUT)


def _registered(router: str, workers: list[str]) -> bool:
    try:
        listed = httpx.get(f"{router}/workers", timeout=5).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    ready = {w["url"] for w in listed if w["is_healthy"] and w["model_id"] == "m"}
    return set(workers) <= ready


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """glm-tiny with index_topk covering every context (exact against one engine)."""
    root = tmp_path_factory.mktemp("tiny")
    return str(write_tiny_model(root, {**TINY_PRESETS["glm-tiny"], "index_topk": 1024}))


@pytest.fixture(scope="module")
def pd(model, tmp_path_factory) -> Iterator[dict]:
    """A dsakv prefill server, two decode servers (the second one is killed by a test) and
    sglang-router in PD mode over the prefill server and the first decode server."""
    logs = tmp_path_factory.mktemp("pd")
    procs: dict[str, ServerProcess] = {}
    try:
        procs["prefill"], bport = start_prefill(logs, "prefill", model, *TINY,
                                                "--disaggregation-timeout", "20")  # fmt: skip
        procs["decode"] = start_decode(logs, "decode", model, *TINY)
        procs["decode2"] = start_decode(logs, "decode2", model, *TINY)
        for name, p in procs.items():
            try:
                wait_healthy([p.url], [p.proc], 180)
            except Exception as e:
                pytest.fail(f"{name} did not start: {e}\n{p.tail()}")
        p_url, d_url = procs["prefill"].url, procs["decode"].url
        args = ["--pd-disaggregation", "--prefill", p_url, str(bport), "--decode", d_url]
        with sglang_router(logs / "router.log", [p_url, d_url], *args) as router:
            yield {"router": router, "bootstrap_port": bport, "logs": logs, **procs}
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture(scope="module")
def reference(model) -> LLM:
    return LLM(model, device="cpu", **ENGINE)


# --- PD mode ------------------------------------------------------------------------------------


def test_pd_completions_and_chat_equal_one_engine(pd, reference):
    """Streamed or not, completions and chat equal one engine's greedy output; every request
    moved its prompt's KV from the prefill server to the decode server."""
    client = _client(pd["router"])
    before = scrape_metrics(pd["prefill"].url)
    prompt = "The quick brown fox jumps over the lazy dog. " * 2  # two pages and a partial
    want = reference.generate(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    got = client.completions.create(model="m", prompt=prompt, max_tokens=10, **GREEDY)
    assert got.choices[0].text == want[0].text and got.usage.completion_tokens == 10
    chunks = list(
        client.completions.create(model="m", prompt=prompt, max_tokens=10, stream=True, **GREEDY)
    )
    assert "".join(c.choices[0].text for c in chunks) == want[0].text
    assert chunks[-1].choices[0].finish_reason == "length"

    chunks = check_pd_chat(
        client, pd["decode"].url, reference, 8, stream_options={"include_usage": True}
    )
    assert chunks[-1].usage.completion_tokens == 8

    sent = wait_idle(pd["prefill"].url)
    wait_idle(pd["decode"].url)
    assert (
        sent["dsakv_kv_transfer_requests_total"] - before["dsakv_kv_transfer_requests_total"] == 4
    )
    assert sent["dsakv_kv_transfer_failures_total"] == before["dsakv_kv_transfer_failures_total"]


def test_pd_prompt_lists_get_one_room_per_prompt(pd, reference):
    """For a list of prompts the router sends lists of rooms; prompt i uses room i."""
    prompts = ["Hello there.", "A longer second prompt, to differ in length."]
    want = reference.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    r = _client(pd["router"]).completions.create(model="m", prompt=prompts, max_tokens=5, **GREEDY)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [o.text for o in want]
    wait_idle(pd["prefill"].url)


def test_generate_logprobs_give_the_prompts_entry_once_through_either_router(pd, reference):
    """sglang-router joins the prefill server's `input_token_logprobs` onto the decode
    server's (its streams pass the decode server's alone), `dsakv router` passes the decode
    server's: the prefill server sends none, so both give one engine's once."""
    ids = reference.tokenizer.encode("The sky is blue and", add_special_tokens=False)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=1)
    (want,) = reference.generate([ids], params)
    sp = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": ids, "sampling_params": sp, "return_logprob": True, "top_logprobs_num": 1}
    app = build_router_app([pd["prefill"].url], [pd["decode"].url])
    server = uvicorn.Server(uvicorn.Config(app, port=free_port(), log_level="warning"))
    with running(server) as dsakv_router:
        for router in (pd["router"], dsakv_router):
            for stream in (False, True):
                r = httpx.post(f"{router}/generate", json={**body, "stream": stream}, timeout=60)
                assert r.status_code == 200, r.text
                if stream:
                    events = [x[6:] for x in r.text.splitlines() if x.startswith("data: {")]
                    m = json.loads(events[-1])["meta_info"]
                else:
                    m = r.json()["meta_info"]
                case = (router, stream)
                assert m["input_token_logprobs"] == [[None, ids[-1], None]], case
                assert m["input_top_logprobs"] == [None], case
                out = m["output_token_logprobs"]
                assert [t for _, t, _ in out] == want.token_ids, case
                assert all(
                    abs(x - y) < 1e-4
                    for (x, _, _), y in zip(
                        out, flat_logprobs(want.outputs[0].logprobs, want.token_ids)
                    )
                ), case
    wait_idle(pd["prefill"].url)
    wait_idle(pd["decode"].url)


def test_probes_answer_in_sglangs_shape(pd):
    """What the router reads at registration: /server_info (served_model_name names the
    worker's model, the PD role and bootstrap port), /model_info, and /health_generate (one
    generated token, no peer needed)."""
    for role in ("prefill", "decode"):
        base = pd[role].url
        for path in ("/server_info", "/get_server_info"):
            info = httpx.get(f"{base}{path}", timeout=30).json()
            assert info["served_model_name"] == "m" and info["disaggregation_mode"] == role
            assert info["max_total_num_tokens"] == 256 * 16 and info["page_size"] == 16
        for path in ("/model_info", "/get_model_info"):
            info = httpx.get(f"{base}{path}", timeout=30).json()
            assert info["model_type"] == "glm_moe_dsa" and info["is_generation"] is True
        before = scrape_metrics(base)["dsakv_finished_requests_total"]
        r = httpx.get(f"{base}/health_generate", timeout=30)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert scrape_metrics(base)["dsakv_finished_requests_total"] == before + 1
        wait_idle(base)
    info = httpx.get(f"{pd['prefill'].url}/server_info", timeout=30).json()
    assert info["disaggregation_bootstrap_port"] == pd["bootstrap_port"]
    workers = httpx.get(f"{pd['router']}/workers", timeout=30).json()["workers"]
    assert {w["worker_type"] for w in workers} == {"prefill", "decode"}
    assert all(w["metadata"]["model_type"] == "glm_moe_dsa" for w in workers)


def test_decode_killed_mid_stream_client_errors_prefill_leaks_nothing(pd):
    decode2 = pd["decode2"]
    p_url, d_url = pd["prefill"].url, decode2.url
    args = ["--pd-disaggregation", "--prefill", p_url, str(pd["bootstrap_port"]), "--decode", d_url]
    with sglang_router(pd["logs"] / "router2.log", [p_url, d_url], *args) as router:
        stream = _client(router).completions.create(
            model="m", prompt="Tell me a long story.", max_tokens=3000, stream=True, **GREEDY
        )
        try:
            first = next(iter(stream))
            assert first.choices[0].text is not None
            decode2.proc.send_signal(signal.SIGKILL)
            with pytest.raises(openai.APIError) as e:  # the router drops the connection
                for _ in stream:
                    pass
            assert not isinstance(e.value, openai.APITimeoutError)  # not our 60 s patience
        finally:
            stream.close()
    after = wait_idle(pd["prefill"].url)  # every page free or prefix-cached
    assert after["dsakv_kv_transfer_pending"] == 0
    r = _client(pd["router"]).completions.create(model="m", prompt="Hi", max_tokens=3, **GREEDY)
    assert r.usage.completion_tokens == 3  # the prefill server keeps serving


# --- the handoff fields, one by one -------------------------------------------------------------


def test_body_fields_become_one_target_per_prompt():
    assert from_body({"prompt": "x"}) is None
    assert from_body({"bootstrap_room": None}) is None
    assert from_body({"bootstrap_room": 7, "bootstrap_host": "h", "bootstrap_port": None}) == [
        BootstrapTarget(7, "h", None)
    ]
    body = {"bootstrap_room": [1, 2**63], "bootstrap_host": "[::1]", "bootstrap_port": [9, 10]}
    assert from_body(body) == [BootstrapTarget(1, "::1", 9), BootstrapTarget(2**63, "::1", 10)]
    headers = {"x-dsakv-bootstrap-room": "5", "x-dsakv-bootstrap-host": "h"}
    assert from_headers({**headers, "x-dsakv-bootstrap-port": "80"}) == [
        BootstrapTarget(5, "h", 80)
    ]
    assert from_headers({"other": "1"}) is None


@pytest.mark.parametrize(
    "body, param",
    [
        ({"bootstrap_room": "12"}, "bootstrap_room"),
        ({"bootstrap_room": 1.5}, "bootstrap_room"),
        ({"bootstrap_room": True}, "bootstrap_room"),
        ({"bootstrap_room": -1}, "bootstrap_room"),
        ({"bootstrap_room": 2**64}, "bootstrap_room"),
        ({"bootstrap_room": []}, "bootstrap_room"),
        ({"bootstrap_room": [1, "2"]}, "bootstrap_room"),
        ({"bootstrap_room": [1, 2], "bootstrap_port": [1]}, "bootstrap_room"),
        ({"bootstrap_room": 1, "bootstrap_host": ["h"]}, "bootstrap_host"),
        ({"bootstrap_room": 1, "bootstrap_host": 5}, "bootstrap_host"),
        ({"bootstrap_room": 1, "bootstrap_port": "80"}, "bootstrap_port"),
        ({"bootstrap_room": 1, "bootstrap_port": 0}, "bootstrap_port"),
        ({"bootstrap_room": 1, "bootstrap_port": 70000}, "bootstrap_port"),
    ],
)
def test_bad_body_fields_are_a_400_naming_the_field(body, param):
    with pytest.raises(APIError) as e:
        from_body(body)
    assert e.value.status == 400 and e.value.param == param


def test_middleware_hands_out_targets_in_prompt_order_and_replays_the_body():
    app = FastAPI()
    app.add_middleware(BootstrapMiddleware)

    @app.post("/v1/completions")
    async def handler(request: Request) -> JSONResponse:
        body = await request.json()
        try:
            rooms = [next_target("decode").room for _ in range(body["prompts"])]
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return JSONResponse({"rooms": rooms, "body": body})

    client = TestClient(app)
    body = {"prompts": 2, "bootstrap_room": [4, 5], "bootstrap_host": "h", "bootstrap_port": 9}
    r = client.post("/v1/completions", json=body)
    assert r.json() == {"rooms": [4, 5], "body": body}  # the app reads the same body
    r = client.post("/v1/completions", json={**body, "prompts": 3})
    assert r.status_code == 400 and "more prompts than bootstrap rooms (2)" in r.text
    headers = {"x-dsakv-bootstrap-room": "8", "x-dsakv-bootstrap-host": "h"}
    r = client.post("/v1/completions", json={**body, "prompts": 1}, headers=headers)
    assert r.json()["rooms"] == [8]  # dsakv router's headers win
    r = client.post("/v1/completions", json={"prompts": 1})
    assert r.status_code == 400 and "`dsakv router` or SGLang's router" in r.text
    r = client.post("/v1/completions", json={"prompts": 1, "bootstrap_room": {}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_room"


def test_servers_answer_bad_fields_with_one_json_400(pd):
    """Through the servers' middleware, before any page is reserved or room claimed."""
    wrong_port = pd["bootstrap_port"] + 1
    cases = [
        ("decode", {"bootstrap_room": "12", "bootstrap_host": "127.0.0.1"}, "bootstrap_room"),
        ("decode", {"bootstrap_room": 3, "bootstrap_port": 80}, None),  # no host
        ("prefill", {"bootstrap_room": 3, "bootstrap_port": wrong_port}, "bootstrap_port"),
    ]
    for role, fields, param in cases:
        url = f"{pd[role].url}/v1/completions"
        r = httpx.post(url, json={"prompt": "a", **fields}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (role, r.text)
    r = httpx.post(
        f"{pd['decode'].url}/v1/completions",
        json={"prompt": "a"},
        headers={"x-dsakv-bootstrap-room": "x"},
        timeout=30,
    )
    assert r.status_code == 400 and "X-Dsakv-Bootstrap" in r.json()["error"]["message"]
    wait_idle(pd["decode"].url)
    wait_idle(pd["prefill"].url)


# --- regular mode -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def replicas(model, tmp_path_factory) -> Iterator[dict]:
    """Two plain dsakv servers (in this process) behind sglang-router's cache-aware policy."""
    logs = tmp_path_factory.mktemp("regular")
    config = EngineConfig(model=model, device="cpu", **ENGINE)
    with ExitStack() as stack:
        urls = [stack.enter_context(serving(config, served_model_name="m"))[0] for _ in "ab"]
        args = ["--worker-urls", *urls, "--policy", "cache_aware"]
        router = stack.enter_context(sglang_router(logs / "router.log", urls, *args))
        yield {"router": router, "urls": urls}


def test_regular_mode_cache_aware_keeps_a_prompt_on_one_replica(replicas, reference):
    """Two replicas behind `--policy cache_aware`: a repeated prompt always goes where its
    prefix is cached (at random, 4 in a row on one replica: 1 in 8), and chat streams
    through too; the router lists the replicas' model under its served name."""
    client = _client(replicas["router"])
    urls = replicas["urls"]
    count = lambda: [scrape_metrics(u)["dsakv_finished_requests_total"] for u in urls]
    prompt = "Once upon a time in a land far away, there lived a cat. " * 2
    want = reference.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    before = count()
    for _ in range(4):
        r = client.completions.create(model="m", prompt=prompt, max_tokens=6, **GREEDY)
        assert r.choices[0].text == want[0].text
    served = [a - b for a, b in zip(count(), before)]
    assert sorted(served) == [0, 4], served
    messages = [{"role": "user", "content": "Name a colour."}]
    stream = client.chat.completions.create(
        model="m", messages=messages, max_tokens=6, stream=True, **GREEDY_CHAT
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    body = {"messages": messages, **NO_THINKING}
    ids = httpx.post(f"{urls[0]}/tokenize", json=body).json()["tokens"]
    ref = reference.generate([ids], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert text == ref[0].text
    models = httpx.get(f"{replicas['router']}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == ["m"]
