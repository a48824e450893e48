"""lm-evaluation-harness against a real `dsakv serve` process, offline: `local-completions`
on a local multiple-choice task (echo + prompt logprobs, batched token-id prompts) and a local
generate-until task (tests/data/*.yaml), checked against the offline engine."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dsakv.engine import LLM, SamplingParams
from dsakv.models.tiny import write_tiny_model

from .conftest import flat_logprobs
from .serving import free_port

DATA = Path(__file__).parent / "data"
MODEL = "tiny-eval"
ENGINE_FLAGS = {
    "kv_cache_dtype": "fp32",
    "index_k_dtype": "fp32",
    "num_pages": "128",
    "page_size": "16",
    "device": "cpu",
}
OFFLINE = {"kv_cache_dtype": "fp32", "index_k_dtype": "fp32", "num_pages": 128, "page_size": 16}
START_TIMEOUT = 120.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("lmeval") / MODEL, preset="glm-tiny", seed=3)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """`dsakv serve` in its own process; yields its /v1/completions URL."""
    port = free_port()
    flags = [x for k, v in ENGINE_FLAGS.items() for x in (f"--{k.replace('_', '-')}", v)]
    cmd = [sys.executable, "-m", "dsakv.cli", "serve", str(model_dir), "--port", str(port)]
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd + flags, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert proc.poll() is None, f"dsakv serve exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"dsakv serve did not start:\n{log.read_text()}"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield f"{base}/v1/completions"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def results(server, model_dir, monkeypatch_module, tmp_path_factory):
    import lm_eval
    from lm_eval.tasks import TaskManager

    cache = tmp_path_factory.mktemp("hf")
    for key, value in {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(cache),
        "HF_DATASETS_CACHE": str(cache / "datasets"),
    }.items():
        monkeypatch_module.setenv(key, value)
    model_args = {
        "base_url": server,
        "model": MODEL,
        "tokenizer_backend": "huggingface",
        "tokenizer": str(model_dir),
        "tokenized_requests": True,
        "batch_size": 4,  # loglikelihood prompts go four to a request (a list of token lists)
        "max_retries": 1,
        "max_length": 1024,
    }
    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=["dsakv_mc", "dsakv_gen"],
        task_manager=TaskManager(include_path=str(DATA), include_defaults=False),
        limit=6,
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def offline(model_dir) -> LLM:
    return LLM(str(model_dir), **OFFLINE, device="cpu")


def test_multiple_choice_matches_offline_loglikelihoods(results, offline):
    acc = results["results"]["dsakv_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    samples = results["samples"]["dsakv_mc"]
    assert len(samples) == 6
    tok = offline.tokenizer
    for s in samples:
        scored = [r[0][0] for r in s["resps"]]  # lm-eval's loglikelihood of each choice
        want = []
        for context, continuation in (a for a in s["arguments"]):
            ctx = tok.encode(context, add_special_tokens=False)
            ids = tok.encode(context + continuation, add_special_tokens=False)
            (out,) = offline.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0))
            want.append(sum(flat_logprobs(out.prompt_logprobs, ids)[len(ctx) :]))
        assert all(math.isfinite(x) for x in scored)
        assert max(abs(a - b) for a, b in zip(scored, want)) < 1e-4
        best = max(range(len(want)), key=want.__getitem__)
        assert max(range(len(scored)), key=scored.__getitem__) == best
        assert s["acc"] == float(best == s["target"])


def test_generate_until_matches_offline_greedy(results, offline):
    em = results["results"]["dsakv_gen"]["exact_match,none"]
    assert 0.0 <= em <= 1.0
    samples = results["samples"]["dsakv_gen"]
    assert len(samples) == 4
    for s in samples:
        context, gen_kwargs = s["arguments"][0]
        sp = SamplingParams(max_tokens=8, temperature=0, stop=tuple(gen_kwargs["until"]))
        (out,) = offline.generate([context], sp)
        assert s["resps"][0][0] == out.text
