"""LoRA adapters over HTTP (`dsakv.server.lora`, `Handlers.lora_name`): a request picks its
adapter by `model` (vLLM's; SGLang's `base:adapter`) or /generate's `lora_path`, and runs
as the offline engine runs it with the same `LoRARequest`; /v1/models lists the adapters;
vLLM's and SGLang's routes load and unload them at run time; /metrics carries vLLM's
lora_requests_info, as `LLM.get_metrics()` does; the flags are vLLM's and SGLang's, refused without --enable-lora; a
prefill/decode pair behind the router serves an adapter both loaded, and refuses one only
one of them loaded."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from dsakv.cli import build_parser, engine_config_from_args
from dsakv.cli.args import add_engine_args, given_flags
from dsakv.engine import LLM, EngineConfig, SamplingParams
from dsakv.metrics import Gauge
from dsakv.procs import free_port

from .conftest import assert_taken_and_ignored, cli_config, cli_error_line
from .serving import (
    TIMEOUT,
    engine_stops_stepping_at,
    routing,
    scrape_metrics,
    serving,
    serving_disagg,
    until_in_flight,
    wait_idle,
)

ENGINE_ARGS = dict(
    kv_cache_dtype="fp32", index_k_dtype="fp32", num_pages=64, page_size=16, device="cpu"
)
# Attention projections an adapter may target (kv_b_proj too: tests/test_lora.py's). PEFT
# turns gate/up/down_proj on this MoE model into the routed experts' fused tensors, which
# dsakv refuses: the MLPs' adapters are tests/test_lora.py's, from their own weights.
TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"]
PROMPT = "The quick brown fox jumps over the lazy dog, then"
GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 8}
NAMES = ("sql", "chat")  # the adapters, each its own LoRARequest id: 1, 2


def write_adapter(model: str, out: Path, seed: int, r: int = 4) -> str:
    """A PEFT LoRA adapter (rank `r`, random A and B: it changes the output) for `model`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    get_peft_model(hf, config).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def adapters(glm_tiny, tmp_path_factory) -> dict[str, str]:
    """Two adapters' paths: "sql" (loaded at start), "chat" (loaded at run time)."""
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_adapter(glm_tiny, root / name, seed) for seed, name in enumerate(NAMES)}


@pytest.fixture(scope="module")
def served(glm_tiny, adapters) -> Iterator[tuple[str, object]]:
    """A server with --enable-lora --max-loras 2 --lora-modules sql=PATH, named "m"."""
    config = EngineConfig(glm_tiny, enable_lora=True, max_loras=2,
                          lora_modules=(("sql", adapters["sql"]),), **ENGINE_ARGS)  # fmt: skip
    with serving(config, served_model_name="m") as served:
        yield served


@pytest.fixture(scope="module")
def reference(glm_tiny) -> Iterator[LLM]:
    config = EngineConfig(glm_tiny, enable_lora=True, max_loras=2, **ENGINE_ARGS)
    with LLM(config, disable_log_stats=False) as llm:  # (`get_metrics`)
        yield llm


def offline(reference: LLM, adapters: dict[str, str], name: str | None) -> list[int]:
    """The greedy tokens of `PROMPT` offline, on adapter `name` (None: the base model)."""
    from dsakv import LoRARequest

    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    lora = None if name is None else LoRARequest(name, 1 + NAMES.index(name), adapters[name])
    return list(reference.generate([PROMPT], params, lora_request=lora)[0].token_ids)


def complete(base: str, model: str, **body) -> list[int]:
    """The greedy tokens of `PROMPT` from /v1/completions, asking for `model`."""
    body = {"model": model, "prompt": PROMPT, "return_token_ids": True, **GREEDY, **body}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_model_picks_the_adapter_as_offline(served, reference, adapters):
    """`model` naming an adapter runs it (vLLM's), SGLang's `base:adapter` too: the greedy
    tokens are the offline engine's with its LoRARequest, and differ from the base model's,
    which are unchanged; the response reports the adapter's name."""
    import openai

    base = served[0]
    sql, plain = offline(reference, adapters, "sql"), offline(reference, adapters, None)
    assert sql != plain
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=TIMEOUT, max_retries=0)
    extra = {"ignore_eos": True, "return_token_ids": True}
    r = client.completions.create(
        model="sql", prompt=PROMPT, max_tokens=8, temperature=0, extra_body=extra
    )
    assert r.model == "sql" and r.choices[0].token_ids == sql
    assert complete(base, "m:sql") == sql  # (SGLang's base-model:adapter)
    assert complete(base, "m") == plain
    hi = [{"role": "user", "content": "hi"}]
    assert client.chat.completions.create(model="sql", messages=hi, max_tokens=2).model == "sql"


def test_generate_takes_lora_path_per_prompt(served, reference, adapters):
    """SGLang's /generate: `lora_path` one adapter name for all prompts, or a list of one
    each (null: the base model; with n > 1 too, each prompt's samples on its adapter, as
    SGLang repeats the list per sample); a name not loaded is a 400 naming it."""
    base = served[0]
    sql, plain = offline(reference, adapters, "sql"), offline(reference, adapters, None)
    sampling = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    body = {"text": [PROMPT, PROMPT], "sampling_params": sampling, "lora_path": ["sql", None]}
    r = httpx.post(f"{base}/generate", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert [o["output_ids"] for o in r.json()] == [sql, plain]
    two = {**body, "sampling_params": {**sampling, "n": 2}}
    r = httpx.post(f"{base}/generate", json=two, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert [o["output_ids"] for o in r.json()] == [sql, sql, plain, plain]
    one = {**body, "text": PROMPT, "lora_path": "sql"}
    assert httpx.post(f"{base}/generate", json=one, timeout=TIMEOUT).json()["output_ids"] == sql
    r = httpx.post(f"{base}/generate", json={**body, "lora_path": "nope"}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
    # and on the /v1 routes, as SGLang's take it
    assert complete(base, "m", lora_path="sql") == sql


def test_models_lists_the_adapters_as_vllm(served, adapters):
    """/v1/models: the base model's card, then each adapter's (id its name, root its path,
    parent the base model's served name); the cards keep Anthropic's fields; retrieving an
    adapter's card by its name works, an unknown name is the 404."""
    base = served[0]
    cards = httpx.get(f"{base}/v1/models", timeout=TIMEOUT).json()["data"]
    assert [c["id"] for c in cards] == ["m", "sql"]
    assert cards[1]["root"] == adapters["sql"] and cards[1]["parent"] == "m"
    assert all(c["type"] == "model" and c["display_name"] == c["id"] for c in cards)
    assert httpx.get(f"{base}/v1/models/sql", timeout=TIMEOUT).json() == cards[1]
    assert httpx.get(f"{base}/v1/models/nope", timeout=TIMEOUT).status_code == 404


def test_adapters_load_and_unload_at_run_time(served, reference, adapters, tmp_path):
    """vLLM's /v1/load_lora_adapter serves a new adapter (its tokens the offline engine's),
    SGLang's /unload_lora_adapter stops it (requests naming it are then the 404, a second
    unload vLLM's 404), SGLang's load answers in its shape, vLLM's load_inplace replaces
    the adapter's weights in one call (a bad adapter there leaves the old one served),
    vLLM's unload answers in its words."""
    base = served[0]
    garbled = tmp_path / "garbled"
    shutil.copytree(adapters["chat"], garbled)
    (garbled / "adapter_model.safetensors").write_bytes(b"not safetensors")
    body = {"lora_name": "chat", "lora_path": adapters["chat"]}
    r = httpx.post(f"{base}/v1/load_lora_adapter", json=body, timeout=TIMEOUT)
    assert r.status_code == 200 and "added successfully" in r.text, r.text
    assert complete(base, "chat") == offline(reference, adapters, "chat")
    r = httpx.post(f"{base}/unload_lora_adapter", json={"lora_name": "chat"}, timeout=TIMEOUT)
    left = {"sql": adapters["sql"]}
    assert r.json() == {"success": True, "error_message": "", "loaded_adapters": left}
    r = httpx.post(f"{base}/v1/completions", json={"model": "chat", "prompt": "x"}, timeout=TIMEOUT)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "'m' and the LoRA adapters 'sql'" in r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "chat"}, timeout=TIMEOUT)
    assert r.status_code == 404, r.text
    r = httpx.post(f"{base}/load_lora_adapter", json=body, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["loaded_adapters"] == adapters, r.text
    # vLLM's load_inplace: "chat" now serves sql's weights (none of its cached KV is reused);
    # a bad adapter in its place is a 400 that leaves "chat" served as it was
    chat = complete(base, "chat")  # (its prompt's pages cached under the old weights)
    bad = {"lora_name": "chat", "lora_path": str(garbled), "load_inplace": True}
    r = httpx.post(f"{base}/v1/load_lora_adapter", json=bad, timeout=TIMEOUT)
    assert r.status_code == 400 and "cannot be read" in r.json()["error"]["message"], r.text
    assert complete(base, "chat") == chat
    swap = {"lora_name": "chat", "lora_path": adapters["sql"], "load_inplace": True}
    r = httpx.post(f"{base}/v1/load_lora_adapter", json=swap, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert complete(base, "chat") == offline(reference, adapters, "sql")
    r = httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "chat"}, timeout=TIMEOUT)
    assert r.status_code == 200 and "removed successfully" in r.text


@pytest.mark.parametrize(
    "body, words",
    [
        ({"lora_name": "sql", "lora_path": "PATH"}, "sql"),  # (loaded already)
        ({"lora_name": "m", "lora_path": "PATH"}, "the base model's name"),
        ({"lora_name": "", "lora_path": "PATH"}, "non-empty"),
        ({"lora_name": "x", "lora_path": "PATH", "pinned": True}, "pinned"),
    ],
)
def test_bad_loads_are_a_400(served, adapters, body, words):
    """A load that cannot serve the adapter (no adapter at its path, a name in use or the
    base model's, an empty name, SGLang's pinning) is vLLM's 400 error and SGLang's 400
    with success false; nothing is loaded."""
    base = served[0]
    body = {k: adapters["chat"] if v == "PATH" else v for k, v in body.items()}
    r = httpx.post(f"{base}/v1/load_lora_adapter", json=body, timeout=TIMEOUT)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    r = httpx.post(f"{base}/load_lora_adapter", json=body, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["success"] is False, r.text
    assert words in r.json()["error_message"]
    assert r.json()["loaded_adapters"] == {"sql": adapters["sql"]}


def test_a_path_with_no_adapter_is_vllms_404(served, adapters):
    """A load whose path holds no adapter is vLLM's 404 NotFoundError ("No adapter found"
    in its words) on its route, SGLang's 400 with success false on its own."""
    base = served[0]
    body = {"lora_name": "x", "lora_path": "/no/such/adapter"}
    r = httpx.post(f"{base}/v1/load_lora_adapter", json=body, timeout=TIMEOUT)
    error = r.json()["error"]
    assert r.status_code == 404 and error["type"] == "NotFoundError", r.text
    assert error["message"] == "Loading lora x failed: No adapter found for /no/such/adapter"
    r = httpx.post(f"{base}/load_lora_adapter", json=body, timeout=TIMEOUT)
    assert r.status_code == 400 and "/no/such/adapter" in r.json()["error_message"], r.text
    assert r.json()["loaded_adapters"] == {"sql": adapters["sql"]}
    # a path no file system takes (too long a name: ENAMETOOLONG) holds none either: not a 500
    body = {"lora_name": "x", "lora_path": "a" * 5000}
    r = httpx.post(f"{base}/v1/load_lora_adapter", json=body, timeout=TIMEOUT)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError", r.text[:300]


def test_beam_search_runs_on_the_adapter(served, reference, adapters):
    """use_beam_search on an adapter's `model` searches with it: the offline
    `LLM.beam_search` with its LoRARequest, not the base model's search."""
    from dsakv import BeamSearchParams, LoRARequest

    base, got = served[0], {}
    body = {"prompt": PROMPT, "use_beam_search": True, "n": 2, "max_tokens": 6}
    for model in ("sql", "m"):
        body = {**body, "model": model, "temperature": 0, "return_token_ids": True}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        got[model] = [c["token_ids"] for c in r.json()["choices"]]
    prompt = r.json()["choices"][0]["prompt_token_ids"]
    lora = LoRARequest("sql", 1, adapters["sql"])
    (want,) = reference.beam_search([prompt], BeamSearchParams(2, 6), lora_request=lora)
    assert got["sql"] == [s.tokens[len(prompt) :] for s in want.sequences] != got["m"]


def test_score_takes_lora_path(served):
    """/v1/score runs the adapter `model` names or SGLang's `lora_path` names, as the other
    /v1 routes: the same scores either way, not the base model's."""
    base = served[0]
    body = {"query": PROMPT, "items": [" yes", " no"], "label_token_ids": [5, 6, 7]}
    scores = []
    for extra in ({"model": "sql"}, {"lora_path": "sql"}, {}):
        r = httpx.post(f"{base}/v1/score", json={**body, **extra}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        scores.append(sum(r.json()["scores"], []))
    model, path, plain = scores
    assert path == pytest.approx(model) and plain != pytest.approx(model)


def test_the_metrics_name_the_adapters_running(served):
    """vLLM's vllm:lora_requests_info: max_lora, and the adapters with requests running (a
    request held running on "sql") and waiting; its value the time it was read."""
    base, async_engine = served
    with engine_stops_stepping_at(async_engine, 2), ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.post, f"{base}/v1/completions", timeout=TIMEOUT,
                           json={"model": "sql", "prompt": PROMPT, **GREEDY})  # fmt: skip
        until_in_flight(base, held)
        deadline = time.monotonic() + TIMEOUT
        while True:  # (until the request, waiting first, runs)
            now, scraped = time.time(), scrape_metrics(base, labels=True).items()
            info = [(dict(k[1]), v) for k, v in scraped if k[0] == "vllm:lora_requests_info"]
            ((labels, value),) = info
            if labels["running_lora_adapters"] == "sql" or time.monotonic() > deadline:
                break
        httpx.post(f"{base}/abort_request", json={"abort_all": True}, timeout=TIMEOUT)
        held.result(TIMEOUT)
    assert labels == {"max_lora": "2", "running_lora_adapters": "sql", "waiting_lora_adapters": ""}
    assert abs(value - now) < 60


def test_llm_get_metrics_names_the_adapters_as_the_server(reference, adapters):
    """Offline, `LLM.get_metrics()` has vLLM's lora_requests_info too, as vLLM's LLM:
    max_lora, and the adapters with requests waiting (one queued on "sql") and running;
    its value the time it was read."""
    offline(reference, adapters, "sql")  # (loads "sql")

    def info() -> tuple[dict[str, str], float]:
        (gauge,) = [m for m in reference.get_metrics() if m.name == "vllm:lora_requests_info"]
        assert isinstance(gauge, Gauge)
        return gauge.labels, gauge.value

    labels, value = info()
    assert labels == {"max_lora": "2", "waiting_lora_adapters": "", "running_lora_adapters": ""}
    assert abs(value - time.time()) < 60
    params = SamplingParams(max_tokens=2, lora_name="sql")
    req = reference.engine.add_request(PROMPT, params)
    try:
        assert info()[0]["waiting_lora_adapters"] == "sql"
    finally:
        reference.engine.abort(req.rid)
    assert info()[0]["waiting_lora_adapters"] == ""


def test_a_server_without_lora_refuses_the_adapter_calls(glm_tiny):
    """Without --enable-lora: the load and unload routes (behind --api-key, as the other
    admin routes) and a lora_path are a 400 saying so; /metrics has no lora_requests_info."""
    key = {"Authorization": "Bearer k"}
    with serving(EngineConfig(glm_tiny, **ENGINE_ARGS), api_key="k") as (base, _):
        load = {"lora_name": "a", "lora_path": "/p"}
        assert httpx.post(f"{base}/v1/load_lora_adapter", json=load).status_code == 401
        r = httpx.post(f"{base}/v1/load_lora_adapter", json=load, headers=key)
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
        r = httpx.post(f"{base}/unload_lora_adapter", json={"lora_name": "a"}, headers=key)
        assert r.status_code == 400 and "--enable-lora" in r.json()["error_message"]
        body = {"text": "x", "lora_path": "a"}
        r = httpx.post(f"{base}/generate", json=body, headers=key, timeout=TIMEOUT)
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
        assert "vllm:lora_requests_info" not in scrape_metrics(base)


def test_the_flags_are_vllms_and_sglangs(glm_tiny):
    """vLLM's --lora-modules (NAME=PATH, its JSON), SGLang's --lora-paths (NAME=PATH, a bare
    path, its JSON: its adapters enable LoRA, as there), --max-loras-per-batch and
    --max-loaded-loras set the engine's fields; serve-pd hands them to its servers (a name
    holding "=" or starting with "{" too)."""
    vllm = ["--enable-lora", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}',
            '{"name": "c=d", "path": "/z"}', '{"name": "{e", "path": "/w"}',
            "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "3"]  # fmt: skip
    config = cli_config("serve", glm_tiny, *vllm)
    adapters = (("a", "/x"), ("b", "/y"), ("c=d", "/z"), ("{e", "/w"))
    assert config.enable_lora and config.lora_modules == adapters
    assert (config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (2, 8, 3)
    args = build_parser().parse_args(["serve-pd", glm_tiny, *vllm])
    engine_config_from_args(args)
    assert cli_config("serve", glm_tiny, *given_flags(args, add_engine_args)) == config
    sglang = ["--lora-paths", "a=/x", "/y", '{"lora_name": "c", "lora_path": "/z"}',
              "--max-loras-per-batch", "2", "--max-loaded-loras", "4"]  # fmt: skip
    config = cli_config("serve", glm_tiny, *sglang)
    assert config.enable_lora and config.lora_modules == (("a", "/x"), ("/y", "/y"), ("c", "/z"))
    assert (config.max_loras, config.max_cpu_loras) == (2, 4)
    args = build_parser().parse_args(["serve-pd", glm_tiny, *sglang])
    engine_config_from_args(args)
    assert cli_config("serve", glm_tiny, *given_flags(args, add_engine_args)) == config


def test_max_lora_rank_is_the_start_adapters_largest(glm_tiny, adapters, tmp_path):
    """Without --max-lora-rank the adapters given at start set it, as SGLang infers it:
    their largest rank r (rank_pattern's too); given, or no adapter at start, it is the
    flag's, or vLLM's default 16."""
    wide = tmp_path / "wide"
    shutil.copytree(adapters["chat"], wide)
    config = json.loads((wide / "adapter_config.json").read_text())
    config["rank_pattern"] = {"o_proj": 24}
    (wide / "adapter_config.json").write_text(json.dumps(config))
    sql = f"sql={adapters['sql']}"
    assert cli_config("serve", glm_tiny, "--lora-paths", sql).max_lora_rank == 4
    both = cli_config("serve", glm_tiny, "--enable-lora", "--lora-modules", sql, f"w={wide}")
    assert both.max_lora_rank == 24
    given = cli_config("serve", glm_tiny, "--lora-paths", sql, "--max-lora-rank", "8")
    assert given.max_lora_rank == 8
    assert cli_config("serve", glm_tiny, "--enable-lora").max_lora_rank == 16
    # --fully-sharded-loras: rounded up to a multiple of --tp (each rank's share of a slot)
    split = cli_config("serve", glm_tiny, "--lora-paths", sql, "--tp", "8", "--fully-sharded-loras")
    assert split.max_lora_rank == 8


def test_a_deeply_nested_config_at_start_is_one_error_line(glm_tiny, adapters, tmp_path, capsys):
    """An adapter_config.json nested past the recursion limit, given at start: the rank read
    from it (no --max-lora-rank) and the load each say so in one line, not a traceback."""
    deep = tmp_path / "deep"
    shutil.copytree(adapters["chat"], deep)
    (deep / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    err = cli_error_line(
        ["serve", glm_tiny, "--port", str(free_port()), "--lora-paths", f"d={deep}"], capsys
    )
    assert "adapter_config.json is not valid JSON: nested too deeply" in err, err


def test_vllm_and_sglang_lora_switches_are_taken_and_ignored(glm_tiny, capsys):
    """vLLM's --lora-dtype, SGLang's --lora-backend and --lora-eviction-policy lru: taken,
    the engine unchanged (serve, serve-pd; generate takes none). (--lora-target-modules:
    tests/test_lora_targets.py; --fully-sharded-loras: tests/test_lora_sharded.py.)"""
    server = [["--lora-dtype", "bfloat16"]]
    server += [["--lora-backend", "csgmv"], ["--lora-eviction-policy", "lru"]]
    assert_taken_and_ignored(glm_tiny, [], server, capsys)


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--lora-eviction-policy", "fifo"], "dsakv takes lru"),
        (["--max-loras", "2"], "--max-loras needs --enable-lora"),
        (["--max-loras-per-batch", "2"], "--max-loras needs --enable-lora"),
        (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
        (["--max-lora-rank", "8"], "--max-lora-rank needs --enable-lora"),
        (["--max-cpu-loras", "2"], "--max-cpu-loras needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "=/x"], "an adapter needs a name and a path"),
        (["--enable-lora", "--lora-modules", '{"name": "a"}'], "needs a name and a path"),
        (["--enable-lora", "--lora-modules", '{"nom": "a"}'], "must be a JSON object of name"),
        (["--lora-paths", '{"lora_name": "a", "lora_path": "/p", "pinned": true}'], "pinned"),
        (["--enable-lora", "--max-loras", "0"], "--max-loras: must be an integer >= 1"),
        (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "names an adapter twice"),
        (["--enable-lora", "--lora-modules", "m=/x", "--served-model-name", "m"], "base model's"),
    ],
)
def test_bad_lora_flags_are_one_error_line(glm_tiny, flags, words, capsys):
    """LoRA settings without --enable-lora, and bad adapters or values: one line, exit 2,
    before anything loads."""
    err = cli_error_line(["serve", glm_tiny, "--port", str(free_port()), *flags], capsys)
    assert words in err, err


@pytest.fixture(scope="module")
def pd_pair(glm_tiny, adapters) -> Iterator[tuple[str, tuple, tuple]]:
    """A prefill and a decode server that both loaded "sql" at start, behind the router
    (the prefill server holds 2 adapters in host memory: --max-cpu-loras 2, of rank 4 at
    most: --max-lora-rank 4): yields (router URL, (prefill URL, its AsyncEngine), (decode
    URL, its AsyncEngine))."""
    config = EngineConfig(glm_tiny, enable_lora=True, max_loras=2,
                          lora_modules=(("sql", adapters["sql"]),), **ENGINE_ARGS)  # fmt: skip
    capped = dataclasses.replace(config, max_cpu_loras=2, max_lora_rank=4)
    named = {"served_model_name": "m"}
    with ExitStack() as stack:
        prefill = stack.enter_context(serving_disagg(capped, "prefill", server_args=named))
        decode = stack.enter_context(serving_disagg(config, "decode", server_args=named))
        yield stack.enter_context(routing([prefill[0]], [decode[0]])), prefill, decode


def _nothing_held(*servers: tuple) -> None:
    """Each PD server idle with every page free or prefix-cached, no request holding an
    adapter and none kept past its unload (or its eviction)."""
    for url, async_engine in servers:
        wait_idle(url)
        held, kept, loaded = asyncio.run(async_engine.call(
            lambda e: (e.lora.held, set(e.model.lora.adapters), set(e.lora.in_memory))
        ))  # fmt: skip
        assert not held and kept == loaded, url


def test_a_pd_pair_serves_an_adapter_both_loaded(pd_pair, reference, adapters):
    """Both servers loaded "sql" (at start) and "chat" (the router's load reaches both): a
    request on either through the router gives the offline engine's tokens on it, a base
    request the base model's; /v1/models shows the adapters; the router's unload reaches
    both servers; nothing stays held."""
    router, prefill, decode = pd_pair
    body = {"lora_name": "chat", "lora_path": adapters["chat"]}
    r = httpx.post(f"{router}/v1/load_lora_adapter", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    for url in (router, prefill[0], decode[0]):
        cards = httpx.get(f"{url}/v1/models", timeout=TIMEOUT).json()["data"]
        assert [c["id"] for c in cards] == ["m", "sql", "chat"], url
    for name in ("sql", "chat", None):
        assert complete(router, name or "m") == offline(reference, adapters, name), name
    assert complete(router, "m", lora_path="sql") == offline(reference, adapters, "sql")
    r = httpx.post(f"{router}/unload_lora_adapter", json={"lora_name": "chat"}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["success"], r.text
    for url, _ in (prefill, decode):
        r = httpx.post(f"{url}/v1/completions", json={"model": "chat", "prompt": "x"})
        assert r.status_code == 404, url
    _nothing_held(prefill, decode)


def test_an_adapter_one_pd_server_lacks_is_a_client_error(pd_pair, adapters):
    """An adapter only the decode server (or only the prefill server) loaded is a 4xx
    through the router naming it, at once; one loaded on both from different weights is a
    502 saying so (the decode server caches the KV under its adapter's weights). No pages
    and no adapter stay held: an unload then drops the adapter."""
    router, prefill, decode = pd_pair
    for name, (url, _), path in (("solo", decode, "sql"), ("lone", prefill, "sql"),
                                 ("twin", prefill, "sql"), ("twin", decode, "chat")):  # fmt: skip
        body = {"lora_name": name, "lora_path": adapters[path]}
        r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
    for name in ("solo", "lone"):
        body = {"model": name, "prompt": PROMPT, **GREEDY}
        r = httpx.post(f"{router}/v1/completions", json=body, timeout=TIMEOUT)
        assert 400 <= r.status_code < 500 and name in r.json()["error"]["message"], r.text
    body = {"model": "twin", "prompt": PROMPT, **GREEDY}
    r = httpx.post(f"{router}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 502 and "different weights" in r.json()["error"]["message"], r.text
    for name, servers in (("solo", [decode]), ("lone", [prefill]), ("twin", [prefill, decode])):
        for url, _ in servers:
            r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name})
            assert r.status_code == 200, r.text
    _nothing_held(prefill, decode)


def test_an_adapter_read_again_from_changed_files_is_a_502(pd_pair, adapters, tmp_path):
    """An adapter the prefill server evicted (--max-cpu-loras) is read again by the next
    request naming it: if its files changed meanwhile, the weights it now runs are not the
    decode server's, and the request is the 502 (compared after the read, not before). No
    pages and no adapter stay held."""
    router, prefill, decode = pd_pair
    drift = tmp_path / "drift"
    shutil.copytree(adapters["sql"], drift)
    body = {"lora_name": "drift", "lora_path": str(drift)}
    r = httpx.post(f"{router}/v1/load_lora_adapter", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    for name in ("x", "y"):  # the prefill server evicts "drift", the least recently used
        body = {"lora_name": name, "lora_path": adapters["sql"]}
        r = httpx.post(f"{prefill[0]}/v1/load_lora_adapter", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
    shutil.copytree(adapters["chat"], drift, dirs_exist_ok=True)
    body = {"model": "drift", "prompt": PROMPT, **GREEDY}
    r = httpx.post(f"{router}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 502 and "different weights" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{router}/v1/unload_lora_adapter", json={"lora_name": "drift"})
    assert r.status_code == 200, r.text
    for name in ("x", "y"):
        r = httpx.post(f"{prefill[0]}/v1/unload_lora_adapter", json={"lora_name": name})
        assert r.status_code == 200, r.text
    _nothing_held(prefill, decode)


def test_a_load_in_place_one_server_refuses_is_undone_to_the_old_adapter(
    pd_pair, glm_tiny, reference, adapters, tmp_path
):
    """vLLM's load_inplace through the router that one server refuses (the prefill server's
    --max-lora-rank 4, a rank-8 adapter) is that server's 400, and undone where it was
    taken by loading the adapter's old path back in place (an unload would serve no "sql"
    at all): both serve the old "sql" again, and run it as offline. An adapter new to the
    servers, loaded so, is unloaded where it was taken (SGLang's route alike); a load in
    place both take is kept."""
    router, prefill, decode = pd_pair
    wide = write_adapter(glm_tiny, tmp_path / "wide", seed=3, r=8)

    def roots(name: str) -> list[str | None]:
        cards = [httpx.get(f"{url}/v1/models", timeout=TIMEOUT).json()["data"]
                 for url, _ in (prefill, decode)]  # fmt: skip
        return [next((c["root"] for c in data if c["id"] == name), None) for data in cards]

    body = {"lora_name": "sql", "lora_path": wide, "load_inplace": True}
    r = httpx.post(f"{router}/v1/load_lora_adapter", json=body, timeout=TIMEOUT)
    assert r.status_code == 400 and "--max-lora-rank 4" in r.json()["error"]["message"], r.text
    assert roots("sql") == [adapters["sql"], adapters["sql"]]
    assert complete(router, "sql") == offline(reference, adapters, "sql")
    body = {"lora_name": "fresh", "lora_path": wide, "load_inplace": True}
    for path in ("/v1/load_lora_adapter", "/load_lora_adapter"):
        r = httpx.post(f"{router}{path}", json=body, timeout=TIMEOUT)
        assert r.status_code == 400, r.text
        assert roots("fresh") == [None, None], path
    swap = {"lora_name": "sql", "lora_path": adapters["chat"], "load_inplace": True}
    r = httpx.post(f"{router}/v1/load_lora_adapter", json=swap, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert roots("sql") == [adapters["chat"], adapters["chat"]]
    back = {**swap, "lora_path": adapters["sql"]}
    r = httpx.post(f"{router}/v1/load_lora_adapter", json=back, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert roots("sql") == [adapters["sql"], adapters["sql"]]
    _nothing_held(prefill, decode)
