"""The OpenAI-compatible server, end to end: a real uvicorn server on a loopback port, the
official `openai` client, and an offline `LLM` on the same tiny model as the reference."""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from dsakv import __version__
from dsakv.cli import main as cli_main
from dsakv.engine import LLM, EngineConfig, SamplingParams
from dsakv.errors import DsakvError
from dsakv.models.tiny import write_tiny_model
from dsakv.server import build_app, make_server
from dsakv.server.chat import load_chat_template
from dsakv.server.serve import model_names

from .conftest import flat_logprobs
from .serving import (
    TIMEOUT,
    engine_held_until_an_abort,
    engine_stops_stepping_at,
    engine_thread_held,
    free_port,
    port_taken,
    running,
    serving,
)

ENGINE_ARGS = dict(
    kv_cache_dtype="fp32", index_k_dtype="fp32", num_pages=64, page_size=16, device="cpu"
)
MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("server") / MODEL
    write_tiny_model(path, preset="glm-tiny", seed=0)
    return path


@pytest.fixture(scope="module")
def reference(model_dir) -> LLM:
    return LLM(str(model_dir), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def served(model_dir):
    """(base_url, AsyncEngine) of the shared server."""
    with serving(EngineConfig(model=str(model_dir), **ENGINE_ARGS)) as served:
        yield served


def _metrics(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=TIMEOUT).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model_name") == MODEL:
                out[s.name] = s.value
    return out


def _wait_idle(base: str, aborted_at_least: float = 0) -> dict[str, float]:
    """Poll /metrics until no request holds pages (used == prefix-cached) and the abort
    count reached `aborted_at_least`."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        m = _metrics(base)
        idle = m["dsakv_running_requests"] == 0 and m["dsakv_waiting_requests"] == 0
        if (
            idle
            and m["dsakv_kv_pages_used"] == m["dsakv_kv_pages_cached"]
            and m["dsakv_aborted_requests_total"] >= aborted_at_least
        ):
            return m
        assert time.monotonic() < deadline, f"engine did not go idle: {m}"
        time.sleep(0.05)


def _check_integrity(async_engine) -> None:
    async def check() -> None:
        await asyncio.wait_for(async_engine.call(lambda e: e.check_integrity()), TIMEOUT)

    asyncio.run(check())


def _ref(llm: LLM, prompt: str, **kw):
    kw.setdefault("temperature", 0.0)
    return llm.generate(prompt, SamplingParams(**kw))[0]


def _chat_prompt(llm: LLM, messages: list[dict]) -> str:
    return llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


# --- happy paths ------------------------------------------------------------------------------


def test_health_and_models(base, client):
    assert httpx.get(f"{base}/health", timeout=TIMEOUT).json() == {"status": "ok"}
    assert httpx.get(f"{base}/version", timeout=TIMEOUT).json() == {"version": __version__}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_matches_offline(client, reference):
    ref = _ref(reference, "The capital of France is", max_tokens=12, logprobs=3, ignore_eos=True)
    r = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=12,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    choice = r.choices[0]
    assert choice.text == ref.text
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert choice.logprobs.token_logprobs == pytest.approx(_flat(ref), abs=1e-4)
    assert all(len(top) <= 3 for top in choice.logprobs.top_logprobs)
    # Token ids as the prompt give the same answer.
    r2 = client.completions.create(
        model=MODEL,
        prompt=ref.prompt_token_ids,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r2.choices[0].text == ref.text


def test_chat_matches_offline(client, reference):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ]
    ref = _ref(
        reference, _chat_prompt(reference, messages), max_tokens=10, logprobs=2, ignore_eos=True
    )
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    choice = r.choices[0]
    # GLM-5 thinks unless told not to: its prompt opens `<think>`, the output is reasoning
    assert choice.message.role == "assistant" and choice.message.reasoning_content == ref.text
    assert choice.message.content == "" and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == 10
    lps = choice.logprobs.content
    assert [x.logprob for x in lps] == pytest.approx(_flat(ref), abs=1e-4)
    assert all(len(x.top_logprobs) == 2 for x in lps)


_TEMPLATE = (
    "{% if reasoning_effort %}[effort {{ reasoning_effort }}]{% endif %}"
    "{% for d in documents or [] %}[doc {{ d.title }}]{% endfor %}"
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


def test_chat_template_flag_replaces_the_tokenizers(model_dir, reference, tmp_path, capsys):
    """vLLM's --chat-template (a file, or the template itself) renders chat and /tokenize;
    LLM.chat takes one too. A request's own template is refused (it was ignored), and a
    missing file or a template that does not parse is one CLI error, before loading."""
    path = tmp_path / "t.jinja"
    path.write_text(_TEMPLATE)
    messages = [{"role": "user", "content": "Name a colour."}]
    rendered = "[user] Name a colour.\n[assistant] "
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = reference.generate(rendered, params)[0]
    assert reference.chat(messages, params, chat_template=_TEMPLATE)[0].text == want.text
    template = load_chat_template(str(path))
    with serving(EngineConfig(model=str(model_dir), **ENGINE_ARGS), chat_template=template) as (
        base,
        _,
    ):
        body = {"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=TIMEOUT).json()
        assert r["choices"][0]["message"]["content"] == want.text
        assert r["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
        tokens = httpx.post(f"{base}/tokenize", json={"messages": messages}, timeout=TIMEOUT)
        assert tokens.json()["tokens"] == want.prompt_token_ids
        # vLLM's reasoning_effort and documents reach the template
        extra = {"reasoning_effort": "low", "documents": [{"title": "T", "text": "t"}]}
        r = httpx.post(f"{base}/v1/chat/completions", json={**body, **extra}, timeout=TIMEOUT)
        rendered = reference.generate("[effort low][doc T]" + rendered, params)[0]
        assert r.json()["usage"]["prompt_tokens"] == len(rendered.prompt_token_ids)
        for route in ("/v1/chat/completions", "/tokenize"):
            r = httpx.post(f"{base}{route}", json={**body, "chat_template": "x"}, timeout=TIMEOUT)
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    assert load_chat_template(_TEMPLATE) == _TEMPLATE  # inline
    capsys.readouterr()  # the reference's progress bars
    for bad, message in [("nofile", "no such file"), ("{% if %}", "line 1: ")]:
        with pytest.raises(SystemExit) as e:
            cli_main(["serve", "glm-tiny", "--chat-template", bad])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and message in err[0], err


def test_flush_cache_drops_the_prefix_cache_when_idle(base, served):
    """SGLang's /flush_cache (and vLLM's /reset_prefix_cache): the cached pages go, the
    next run of a prompt finds nothing; while a request runs it is a 400, nothing dropped."""
    prompt = {"prompt": "flush me " * 8, "max_tokens": 2, "temperature": 0}
    httpx.post(f"{base}/v1/completions", json=prompt, timeout=TIMEOUT)
    assert _wait_idle(base)["dsakv_kv_pages_cached"] > 0
    long = {"prompt": "busy", "max_tokens": 600, "ignore_eos": True, "stream": True}
    long |= {"return_token_ids": True}  # (a line per token, held-back text or not)
    with (
        engine_stops_stepping_at(served[1], tokens=4),
        httpx.stream("POST", f"{base}/v1/completions", json=long, timeout=TIMEOUT) as r,
    ):
        lines = r.iter_lines()  # (kept: a dropped iterator closes the stream)
        next(lines)  # running now, and still running: it cannot finish in the block
        refused = httpx.post(f"{base}/flush_cache", timeout=TIMEOUT)
    assert refused.status_code == 400 and "running or waiting" in refused.text
    assert _wait_idle(base, aborted_at_least=1)["dsakv_kv_pages_cached"] > 0
    for path in ("/flush_cache", "/reset_prefix_cache"):
        r = httpx.post(f"{base}{path}", timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        m = _wait_idle(base)
        assert m["dsakv_kv_pages_cached"] == m["dsakv_kv_pages_used"] == 0
    hits = _metrics(base)["dsakv_prefix_hit_tokens_total"]
    httpx.post(f"{base}/v1/completions", json=prompt, timeout=TIMEOUT)
    assert _metrics(base)["dsakv_prefix_hit_tokens_total"] == hits  # nothing was left
    _check_integrity(served[1])


def test_content_parts_are_joined_by_newlines_as_vllm_does(base):
    parts = [{"type": "text", "text": "A."}, {"type": "text", "text": "B."}]

    def tokens(content) -> list[int]:
        body = {"messages": [{"role": "user", "content": content}]}
        return httpx.post(f"{base}/tokenize", json=body, timeout=TIMEOUT).json()["tokens"]

    assert tokens(parts) == tokens("A.\nB.")


def test_chat_continues_the_final_message(base, client, reference):
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "The colour is"},
    ]
    prompt = reference.tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True, tokenize=False
    )
    assert prompt.endswith("The colour is")
    ref = _ref(reference, prompt, max_tokens=6, ignore_eos=True)
    extra = {"add_generation_prompt": False, "continue_final_message": True, "ignore_eos": True}
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body=extra
    )
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    tokens = httpx.post(f"{base}/tokenize", json=body, timeout=TIMEOUT).json()["tokens"]
    assert tokens == ref.prompt_token_ids


def test_skip_special_tokens(client, reference):
    tok = reference.tokenizer
    special = next(
        t for t in tok.all_special_ids if t not in tok.convert_tokens_to_ids([tok.eos_token])
    )
    kw = dict(model=MODEL, prompt="Special:", max_tokens=2, temperature=0)
    extra = {"ignore_eos": True, "logit_bias": {str(special): 100}}
    shown = client.completions.create(**kw, extra_body={**extra, "skip_special_tokens": False})
    hidden = client.completions.create(**kw, extra_body=extra)
    assert shown.choices[0].text == tok.decode([special, special])
    assert hidden.choices[0].text == ""


def test_streaming_completion_and_chat(client, reference):
    ref = _ref(reference, "Once upon a time", max_tokens=16, ignore_eos=True)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == ref.text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16

    messages = [{"role": "user", "content": "Tell me a story."}]
    ref = _ref(reference, _chat_prompt(reference, messages), max_tokens=16, ignore_eos=True)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == ref.text
    assert not "".join(d.content or "" for d in deltas)  # (the prompt opened `<think>`)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_continuous_usage_stats(client):
    """vLLM's `stream_options.continuous_usage_stats` (with include_usage): every chunk carries
    its choice's usage so far, the final usage chunk stays the request's total."""
    kw = dict(
        model=MODEL,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    chunks = list(
        client.completions.create(
            prompt="Once upon a time", logprobs=0, extra_body={"ignore_eos": True}, **kw
        )
    )
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == 6
    seen = 0
    for c in chunks[:-1]:
        seen += len(c.choices[0].logprobs.tokens)  # tokens streamed so far
        u = c.usage
        assert (u.prompt_tokens, u.completion_tokens) == (final.usage.prompt_tokens, seen)
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert seen == 6

    messages = [{"role": "user", "content": "Tell me a story."}]
    chunks = list(client.chat.completions.create(messages=messages, **kw))
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens <= 6
    prompt = final.usage.prompt_tokens
    usages = [(c.usage.prompt_tokens, c.usage.completion_tokens) for c in chunks[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant" and usages[0] == (prompt, 0)
    assert usages[-1] == (prompt, final.usage.completion_tokens)
    assert all(p == prompt for p, _ in usages)
    assert [n for _, n in usages] == sorted(n for _, n in usages)
    # include_usage alone: null on each chunk, as before
    plain = list(
        client.completions.create(prompt="x", **{**kw, "stream_options": {"include_usage": True}})
    )
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage is not None


def test_raw_sse_ends_with_done(base):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [x for x in r.iter_lines() if x]
    assert all(x.startswith("data: ") for x in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_stop_seed_and_sampling_extras(client, reference):
    ref = _ref(reference, "Stop test:", max_tokens=12, ignore_eos=True)
    stop = ref.text[4:6]
    assert stop and "\ufffd" not in stop, f"pick another prompt: {ref.text!r}"
    expect = ref.text[: ref.text.find(stop)]
    kw = dict(model=MODEL, prompt="Stop test:", max_tokens=12, temperature=0, stop=[stop])
    r = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expect, "stop")
    streamed = client.completions.create(**kw, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == expect
    extra = {"ignore_eos": True, "include_stop_str_in_output": True}
    r = client.completions.create(**kw, extra_body=extra)
    assert r.choices[0].text == expect + stop

    # Seeded sampling is reproducible, streamed or not, and matches the offline engine.
    kw = dict(model=MODEL, prompt="Seed:", max_tokens=8, temperature=0.9, top_p=0.95, seed=1234)
    extra = {"top_k": 50, "min_p": 0.01, "ignore_eos": True}
    a = client.completions.create(**kw, extra_body=extra).choices[0].text
    b = "".join(
        c.choices[0].text for c in client.completions.create(**kw, stream=True, extra_body=extra)
    )
    ref = _ref(
        reference,
        "Seed:",
        max_tokens=8,
        temperature=0.9,
        top_p=0.95,
        seed=1234,
        top_k=50,
        min_p=0.01,
        ignore_eos=True,
    )
    assert a == b == ref.text


def test_seed_takes_the_int64_range(base):
    """Both ends of OpenAI's and vLLM's int64 range sample (n > 1 too: choice i takes seed
    + i), reproducibly; one past either end is a 400 naming `seed`."""
    for seed in (2**63 - 1, -(2**63)):
        body = {"prompt": "Seed:", "max_tokens": 6, "temperature": 1.0, "seed": seed, "n": 2}
        runs = [httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT) for _ in "ab"]
        assert all(r.status_code == 200 for r in runs), runs[0].text
        assert runs[0].json()["choices"] == runs[1].json()["choices"]
    for seed in (2**63, -(2**63) - 1):
        body = {"prompt": "Seed:", "max_tokens": 1, "seed": seed}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
        assert "seed must be" in r.json()["error"]["message"]


def test_64_concurrent_streams(base, served, reference):
    """64 streaming clients at once: every one gets its complete greedy answer."""
    prompts = [f"Client {i} asks about item #{i * 7}:" for i in range(64)]
    refs = reference.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None, int]:
        text, reason, usage = "", None, 0
        stream = await aclient.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, reason, usage

    async def run_all() -> list[tuple[str, str | None, int]]:
        limits = httpx.Limits(max_connections=64)
        async with openai.AsyncOpenAI(
            base_url=f"{base}/v1",
            api_key="unused",
            timeout=TIMEOUT,
            max_retries=0,
            http_client=openai.DefaultAsyncHttpxClient(limits=limits),
        ) as aclient:
            return await asyncio.wait_for(
                asyncio.gather(*(one(aclient, p) for p in prompts)), 2 * TIMEOUT
            )

    start = time.perf_counter()
    results = asyncio.run(run_all())
    wall = time.perf_counter() - start
    print(f"64 concurrent streams x 8 tokens: {wall:.2f}s")
    assert [r[0] for r in results] == [x.text for x in refs]
    assert all(r[1] == "length" and r[2] == 8 for r in results)
    m = _wait_idle(base)
    assert m["dsakv_peak_running_requests"] > 1  # they really were batched together
    _check_integrity(served[1])


# --- bad input --------------------------------------------------------------------------------

_BAD = [
    ("/v1/completions", b'{"model": "tiny", "prompt": "x",', 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1.0}, 400, None),
    ("/v1/completions", b'{"prompt": "x", "temperature": 1e309}', 400, None),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, None),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, None),
    ("/v1/completions", {"prompt": "x", "n": 99}, 400, "n"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", ""]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "word " * 600}, 400, "prompt"),
    ("/v1/completions", {"prompt": "\ud800"}, 400, "prompt"),  # a lone surrogate
    ("/tokenize", {"prompt": "\ud800"}, 400, "prompt"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "\ud800"}]},
        400,
        "messages",
    ),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    # seeds outside int64 (OpenAI's and vLLM's range; the sampler would alias them)
    ("/v1/completions", {"prompt": "x", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": 2**63}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "sampling_seed": -(2**63) - 1}, 400, "sampling_seed"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "seed": 2**64},
        400,
        "seed",
    ),
    (
        "/generate",
        {"text": "x", "sampling_params": {"sampling_seed": 2**70}},
        400,
        "sampling_params.sampling_seed",
    ),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "word " * 600}]},
        400,
        "messages",
    ),
    (
        "/v1/completions",
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
        400,
        "stream_options",
    ),
    (
        "/v1/completions",
        {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": 1}},
        400,
        "stream_options",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "assistant", "content": "x"}], "continue_final_message": True},
        400,
        "continue_final_message",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
        400,
        "continue_final_message",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "n": 99, "stream": True},
        400,
        "n",
    ),
    (
        "/v1/chat/completions",
        {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
        404,
        "model",
    ),
    # a temperature past float32's, the sampler's, is inf there: a masked logit over it NaN,
    # which failed the engine's step, every request in flight a 500
    ("/v1/completions", {"prompt": "x", "temperature": 1e40, "regex": "a+"}, 400, "temperature"),
    (
        "/v1/completions",
        {"prompt": "x", "temperature": 1e40, "allowed_token_ids": [5, 6]},
        400,
        "temperature",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "temperature": 1e39,
            "response_format": {"type": "json_object"},
        },
        400,
        "temperature",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), _BAD, ids=range(len(_BAD)))
def test_bad_input_gets_openai_error(base, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        base + path, content=content, headers={"Content-Type": "application/json"}, timeout=TIMEOUT
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err


def test_server_still_serves_after_bad_input(base, client, reference):
    with pytest.raises(openai.BadRequestError, match="n must be in"):
        client.completions.create(model=MODEL, prompt="x", n=99)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    for path, body, _, _ in _BAD[:4]:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        httpx.post(base + path, content=content, timeout=TIMEOUT)
    ref = _ref(reference, "Still alive?", max_tokens=6, ignore_eos=True)
    r = client.completions.create(
        model=MODEL,
        prompt="Still alive?",
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == ref.text
    _wait_idle(base)


_JSON = {"Content-Type": "application/json"}


@pytest.mark.parametrize(
    "raw",
    [
        b'{"messages": [{"role": "\\ud800", "content": "x"}], "max_tokens": 1}',
        b'{"messages": [{"role": "user", "content": "x\\udc00"}], "max_tokens": 1}',
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "top_p": NaN}',
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "seed": Infinity}',
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "top_p": 1e999}',
    ],
)
def test_json_no_answer_could_quote_back_is_a_400(base, raw):
    """NaN, Infinity, a number past a double and a lone surrogate are no RFC 8259 JSON, yet
    Python's parser takes them: refused as the body arrives, on every route, in its error
    shape (a role "\\ud800", quoted back in chat's 400, was a 500)."""
    for path in ("/v1/chat/completions", "/v1/messages", "/tokenize"):
        r = httpx.post(base + path, content=raw, headers=_JSON, timeout=TIMEOUT)
        assert r.status_code == 400, (path, r.text)
        message = r.json()["error"]["message"]
        assert message.startswith("request body is not valid JSON: "), message
    # a surrogate pair is a character, an escaped backslash no escape: both are taken
    for text in ("\\ud83d\\ude00", "\\\\ud800"):
        raw = b'{"messages": [{"role": "user", "content": "%s"}], "max_tokens": 1}' % text.encode()
        r = httpx.post(base + "/v1/chat/completions", content=raw, headers=_JSON, timeout=TIMEOUT)
        assert r.status_code == 200, r.text


def test_valid_json_is_taken_by_the_strict_read(base):
    """What RFC 8259 JSON holds is taken by the strict read (`load_json`): an escaped
    surrogate pair, 1e308 and a 30-digit integer where a field takes any JSON (Anthropic's
    metadata: /generate has none), and a UTF-8 BOM before the body (dropped, as json.loads
    drops it)."""
    pair, big, model = b"x\\ud83d\\ude00", b"1" * 30, MODEL.encode()
    bodies = {
        "/v1/messages": b'{"model": "%s", "messages": [{"role": "user", "content": "%s"}], '
        b'"max_tokens": 1, "metadata": {"n": %s, "x": 1e308}}' % (model, pair, big),
        "/generate": b'{"text": "%s", "sampling_params": {"max_new_tokens": 1}}' % pair,
    }
    for path, raw in bodies.items():
        for content in (raw, b"\xef\xbb\xbf" + raw):
            r = httpx.post(base + path, content=content, headers=_JSON, timeout=TIMEOUT)
            assert r.status_code == 200, (path, content[:3], r.text)


# --- disconnects, auth, metrics, shutdown -----------------------------------------------------


def test_disconnect_mid_stream_frees_pages(base, served):
    """Aborted, its pages back, and counted as the client's doing (499), though the stream's
    200 went out before it hung up."""
    before, statuses = _wait_idle(base), _statuses(base)
    body = {
        "prompt": "A long story:",
        "max_tokens": 900,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,  # (a line per token, held-back text or not)
    }
    with engine_stops_stepping_at(served[1], tokens=20):  # (it cannot finish before the hang-up)
        with (
            httpx.Client(timeout=TIMEOUT) as http,
            http.stream("POST", f"{base}/v1/completions", json=body) as r,
        ):
            assert r.status_code == 200
            lines = r.iter_lines()  # keep it referenced: dropping it closes the connection
            events = [x for x in (next(lines) for _ in range(6)) if x.startswith("data: ")]
            assert len(events) == 3
            m = _metrics(base)
            assert m["dsakv_running_requests"] == 1, m
            assert m["dsakv_kv_pages_used"] > m["dsakv_kv_pages_cached"]  # it holds pages
        # The connection is closed: the request is aborted and every page it held comes back.
        after = _wait_idle(base, aborted_at_least=before["dsakv_aborted_requests_total"] + 1)
    assert after["dsakv_generation_tokens_total"] - before["dsakv_generation_tokens_total"] < 900
    _check_integrity(served[1])
    deadline = time.monotonic() + TIMEOUT
    while (now := _statuses(base)).get("499", 0) == statuses.get("499", 0):
        assert time.monotonic() < deadline, now
        time.sleep(0.05)
    assert now.get("200", 0) == statuses.get("200", 0)


def _statuses(base: str) -> dict[str, float]:
    """/v1/completions answers by HTTP status, from /metrics."""
    text = httpx.get(f"{base}/metrics", timeout=TIMEOUT).text
    return {
        s.labels["status"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "dsakv_http_requests_total" and s.labels["endpoint"] == "/v1/completions"
    }


def test_disconnect_while_waiting_for_full_response(base, served, monkeypatch):
    """Aborted, and counted as the client's doing (499), not as a server error (503)."""
    before, statuses = _wait_idle(base), _statuses(base)
    body = {
        "prompt": "Another long story:",
        "max_tokens": 900,
        "temperature": 0,
        "ignore_eos": True,
    }
    with engine_held_until_an_abort(served[1], monkeypatch), pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/completions", json=body, timeout=httpx.Timeout(TIMEOUT, read=0.5))
    after = _wait_idle(base, aborted_at_least=before["dsakv_aborted_requests_total"] + 1)
    assert after["dsakv_generation_tokens_total"] - before["dsakv_generation_tokens_total"] < 900
    _check_integrity(served[1])
    deadline = time.monotonic() + TIMEOUT
    while (now := _statuses(base)).get("499", 0) == statuses.get("499", 0):
        assert time.monotonic() < deadline, now
        time.sleep(0.05)
    assert now.get("503", 0) == statuses.get("503", 0)


def test_a_hang_up_after_a_pipelined_request_aborts(base, served):
    """A client that sent its next request down the same connection, then hung up: uvicorn
    stops reading a connection while its request runs, until a fresh `receive`; a watcher
    in one long `receive` never saw the hang-up (the request ran to max_tokens)."""
    before = _wait_idle(base)

    def raw(body: dict) -> bytes:
        data = json.dumps(body).encode()
        head = "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        return f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data

    long = {"prompt": "A long story:", "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    with engine_stops_stepping_at(served[1], 4):  # (still running when the client leaves)
        with socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1]))) as s:
            s.sendall(raw(long))
            deadline = time.monotonic() + TIMEOUT
            while _metrics(base)["dsakv_running_requests"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            s.sendall(raw({"prompt": "x", "max_tokens": 2}))
            time.sleep(0.3)  # (read and paused on before the hang-up)
        _wait_idle(base, aborted_at_least=before["dsakv_aborted_requests_total"] + 1)
    _check_integrity(served[1])


def test_refused_choices_leave_no_unread_errors(base, caplog):
    """All n choices of a refused prompt are refused alike and the handler reads one: asyncio
    logged each other one, with its traceback, as an exception never retrieved."""
    body = {"prompt": "x", "max_tokens": 2, "n": 3, "regex": "a(b"}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "regex"
    gc.collect()
    time.sleep(0.2)
    gc.collect()
    assert "never retrieved" not in caplog.text


def test_api_key(served):
    _, async_engine = served
    app = build_app(async_engine, MODEL, api_key="sekret")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    with running(server) as url:
        assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200
        r = httpx.post(
            f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=TIMEOUT
        )
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/v1/models", timeout=TIMEOUT).status_code == 401
        wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", timeout=TIMEOUT, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model=MODEL, prompt="x", max_tokens=1)
        right = openai.OpenAI(
            base_url=f"{url}/v1", api_key="sekret", timeout=TIMEOUT, max_retries=0
        )
        r = right.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens >= 1


def test_retrieve_model(client, served):
    """OpenAI's GET /v1/models/{model} (`client.models.retrieve`): the card /v1/models
    lists, for a served name with a "/" in it too; another name is a 404
    model_not_found; and behind the API key as /v1/models is."""
    card = client.models.retrieve(MODEL).model_dump()
    listed = client.models.list().data[0].model_dump()
    assert {**card, "created": 0} == {**listed, "created": 0} and card["id"] == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"

    app = build_app(served[1], "org/tiny", api_key="sekret")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    with running(server) as url:
        right = openai.OpenAI(
            base_url=f"{url}/v1", api_key="sekret", timeout=TIMEOUT, max_retries=0
        )
        assert right.models.retrieve("org/tiny").id == "org/tiny"  # (sent as org%2Ftiny)
        r = httpx.get(f"{url}/v1/models/org/tiny", headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200 and r.json()["id"] == "org/tiny"
        for name in ("org", "tiny", "org/tiny/x"):
            with pytest.raises(openai.NotFoundError) as e:
                right.models.retrieve(name)
            assert e.value.status_code == 404
            assert set(e.value.body) == {"message", "type", "param", "code"}
            assert e.value.body["code"] == "model_not_found"
        assert httpx.get(f"{url}/v1/models/org/tiny", timeout=TIMEOUT).status_code == 401
        wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", timeout=TIMEOUT, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.retrieve("org/tiny")


def test_a_request_may_name_the_model_path(base, model_dir):
    """vLLM names the model after `--model` as given, SGLang after its model path: scripts
    written for them send the path, which was a 404 here. It (and its resolved form) is
    accepted beside the directory's name, which /v1/models still lists and responses
    report."""
    for name in (str(model_dir), str(model_dir.resolve()), MODEL, None):
        body = {"model": name, "prompt": "x", "max_tokens": 1}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["model"] == MODEL, (name, r.text)
        chat = {"model": name, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        r = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["model"] == MODEL, (name, r.text)
    quoted = str(model_dir).replace("/", "%2F")
    r = httpx.get(f"{base}/v1/models/{quoted}", timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["id"] == MODEL
    assert [m["id"] for m in httpx.get(f"{base}/v1/models", timeout=TIMEOUT).json()["data"]] == [
        MODEL
    ]
    for other in (f"{model_dir}/x", str(model_dir.parent), "gpt-4"):
        body = {"model": other, "prompt": "x", "max_tokens": 1}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", other


def test_several_served_model_names(served, tmp_path, monkeypatch):
    """vLLM's `--served-model-name a b`: /v1/models lists every name, a request may name any
    (and no other, as vLLM's), and responses, /server_info and the metrics report the
    first. Without it, the directory's name, and the path as given or resolved."""
    (tmp_path / "m").mkdir()
    rel = Path(tmp_path.name) / "m"  # a relative path, as given on a command line
    monkeypatch.chdir(tmp_path.parent)
    names, aliases = model_names(str(rel), ["first", "org/second"])
    paths = [str(rel), str((tmp_path / "m").resolve())]
    assert model_names(str(rel)) == (["m"], paths) == model_names(str(rel), "")
    assert names == ["first", "org/second"] and aliases == []
    with pytest.raises(DsakvError, match="must not be empty"):
        model_names(str(rel), ["first", ""])
    # a tiny preset's cache answers to the preset's name too (`dsakv serve glm-tiny`)
    (tmp_path / "m" / ".complete").write_text('{"preset": "glm-tiny", "seed": 0}')
    assert model_names(str(rel)) == (["m"], [*paths, "glm-tiny"])
    assert model_names(str(rel), "first") == (["first"], [])

    app = build_app(served[1], names, aliases=aliases)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    )
    with running(server) as url:
        listed = httpx.get(f"{url}/v1/models", timeout=TIMEOUT).json()["data"]
        assert [m["id"] for m in listed] == names
        for name in (*names, *aliases):
            body = {"model": name, "prompt": "x", "max_tokens": 1}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)
            assert r.status_code == 200 and r.json()["model"] == "first", (name, r.text)
        r = httpx.get(f"{url}/v1/models/org/second", timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["id"] == "org/second"
        info = httpx.get(f"{url}/server_info", timeout=TIMEOUT).json()
        assert info["served_model_name"] == "first"
        assert 'model_name="first"' in httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
        for other in ("second", "m", str(rel)):
            body = {"model": other, "prompt": "x", "max_tokens": 1}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)
            assert r.status_code == 404, other


def test_metrics(base, served):
    m = _wait_idle(base)
    engine = served[1].engine
    assert m["dsakv_kv_pages_total"] == 64
    assert m["dsakv_kv_bytes_per_token"] == engine.layout.bytes_per_token
    assert m["dsakv_index_k_bytes_per_token_saved"] > 0  # glm-tiny shares 4 of 8 layers
    assert m["dsakv_prompt_tokens_total"] > 0 and m["dsakv_generation_tokens_total"] > 0
    assert 0 <= m["dsakv_prefix_cache_hit_rate"] <= 1
    assert "dsakv_retractions_total" in m
    text = httpx.get(f"{base}/metrics", timeout=TIMEOUT).text
    assert 'dsakv_http_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert "dsakv_time_to_first_token_seconds_count" in text


def test_shutdown_ends_open_streams(model_dir):
    """Stopping the server aborts in-flight streams (they end with [DONE]) and frees pages."""
    config = EngineConfig(model=str(model_dir), **ENGINE_ARGS)
    server, async_engine = make_server(config, port=free_port(), log_level="warning")
    body = {
        "prompt": "Forever:",
        "max_tokens": 900,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,  # (a line per token, held-back text or not)
    }
    try:
        with (
            running(server) as url,
            engine_stops_stepping_at(async_engine, tokens=4),  # (still running at the stop)
            httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as r,
        ):
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            server.should_exit = True
            rest = [x for x in lines if x]
            assert rest[-1] == "data: [DONE]"
            assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "abort"
        _check_integrity(async_engine)  # idle, so: no request holds a page
    finally:
        async_engine.shutdown()


# --- streaming text hold-back (pure) ----------------------------------------------------------


def test_stable_len_holds_back_partial_chars_and_stop_prefixes():
    from dsakv.server.runner import _stable_len

    assert _stable_len("hello", 0) == 5
    assert _stable_len("hello\ufffd", 0) == 5  # a multi-byte character still arriving
    assert _stable_len("\ufffd\ufffd", 0) == 0
    assert _stable_len("hello wor", len("world")) == 5  # "wor" could still become the stop
    assert _stable_len("ab", len("xyz")) == 0
    assert _stable_len("abc", 1) == 3  # a one-character stop is cut as soon as it appears
    assert SamplingParams(stop=["a", "world", "xyz"]).longest_stop == 5
    assert SamplingParams().longest_stop == 0


# --- the listening port, taken before the engine loads ----------------------------------------


@pytest.mark.parametrize("role", [None, "prefill"])
def test_serve_holds_its_ports_while_the_engine_loads(model_dir, monkeypatch, capsys, role):
    """`dsakv serve` checked its port free before the model loaded and bound it after: a
    process that took it meanwhile made uvicorn fail ("address already in use", exit 3)
    after "serving" had been printed. Now the socket is bound and listening before the
    engine loads and uvicorn serves that one; "serving" comes once it does. A prefill
    server holds its bootstrap port the same way until its bootstrap server binds it."""
    from dsakv import cli, procs
    from dsakv.server import serve

    port, bootstrap = free_port(), free_port()
    seen: dict[str, list[bool]] = {"loading": [], "serving": []}
    real_create, real_startup = serve.create_engine, procs.AppServer.startup

    def create_engine(config, **kw):
        seen["loading"] += [port_taken(port), port_taken(bootstrap)]
        return real_create(config, **kw)

    async def startup(self, sockets=None):
        await real_startup(self, sockets)
        seen["serving"] += [port_taken(port), port_taken(bootstrap)]
        self.should_exit = True  # stop at once

    monkeypatch.setattr(serve, "create_engine", create_engine)
    monkeypatch.setattr(procs.AppServer, "startup", startup)
    args = ["serve", str(model_dir), "--port", str(port), "--device", "cpu", "--num-pages", "16"]
    args += ["--kv-cache-dtype", "fp32", "--index-k-dtype", "fp32"]
    if role:
        args += ["--disaggregation-mode", role, "--disaggregation-bootstrap-port", str(bootstrap)]
    assert cli.main(args) == 0
    assert seen["loading"] == [True, role == "prefill"]
    assert seen["serving"] == [True, role == "prefill"]
    out = capsys.readouterr().out
    assert f"dsakv: serving 'tiny' at http://127.0.0.1:{port}/v1" in out
    assert not port_taken(port) and not port_taken(bootstrap)  # both given back


# --- aborts' usage, latency metrics, scrapes during long steps, auth order ---------------------


def _families(base: str) -> dict[str, tuple[str, dict[tuple, float]]]:
    """/metrics as {family name: (type, {(sample name, labels without model_name): value})}."""
    text = httpx.get(f"{base}/metrics", timeout=TIMEOUT).text
    out = {}
    for f in text_string_to_metric_families(text):
        samples = {
            (
                s.name,
                tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")),
            ): s.value
            for s in f.samples
        }
        out[f.name] = (f.type, samples)
    return out


def _sample(fams: dict, family: str, name: str, **labels: str) -> float:
    return fams[family][1].get((name, tuple(sorted(labels.items()))), 0.0)


def _sse_events(lines) -> list:
    return [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]


def test_aborted_streams_report_their_usage(base, served):
    """An abort's last update (server shutdown: `abort_all`) carried the prompt's token count
    as stop_reason and zero usage; /generate's, the output length as cached_tokens. Now:
    no stop_reason, and the real prompt tokens and the tokens generated so far (vLLM's)."""
    _wait_idle(base)
    prompt, ids = [41, 42, 43, 44, 45, 46, 47], [51, 52, 53, 54, 55, 56, 57, 58, 59]
    cmpl = {"prompt": prompt, "max_tokens": 900, "ignore_eos": True, "stream": True}
    cmpl |= {"stream_options": {"include_usage": True}, "return_token_ids": True}
    gen = {"input_ids": ids, "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    with (
        engine_stops_stepping_at(served[1], tokens=10),  # (both still running at the abort)
        httpx.Client(timeout=TIMEOUT) as http,
        http.stream("POST", f"{base}/v1/completions", json=cmpl) as r1,
        http.stream("POST", f"{base}/generate", json={**gen, "stream": True}) as r2,
    ):
        lines1, lines2 = r1.iter_lines(), r2.iter_lines()
        first = [next(lines1) for _ in range(6)] + [next(lines2) for _ in range(6)]
        served[1].abort_all()
        c = _sse_events(first[:6] + list(lines1))
        g = _sse_events(first[6:] + list(lines2))
    last, usage = c[-2]["choices"][0], c[-1]["usage"]
    assert last["finish_reason"] == "abort" and last["stop_reason"] is None
    streamed = sum(len(e["choices"][0]["token_ids"]) for e in c[:-1])
    assert streamed >= 3
    assert usage["prompt_tokens"] == len(prompt) and usage["completion_tokens"] == streamed
    meta, before = g[-1]["meta_info"], g[-2]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert meta["prompt_tokens"] == len(ids)
    assert meta["completion_tokens"] == len(g[-1]["output_ids"]) >= 3
    assert meta["cached_tokens"] == before["cached_tokens"] < len(ids)
    _wait_idle(base)


def test_a_failed_step_ends_requests_with_their_usage(base, served, monkeypatch):
    """`_fail_all`'s last update: finish_reason "error", no stop_reason, the prompt's tokens
    and the tokens generated before the step failed. `Update` takes its fields after the
    first four by keyword only, so a new field cannot shift them again."""
    from dsakv.server.runner import Update

    with pytest.raises(TypeError):
        Update([], "", None, None, True, "abort")
    _wait_idle(base)
    async_engine = served[1]
    engine, real, calls = async_engine.engine, async_engine.engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("injected")
        return real()

    monkeypatch.setattr(engine, "step", step)

    async def run() -> list:
        params = SamplingParams(max_tokens=50, ignore_eos=True, temperature=0.0)
        (stream,) = await async_engine.generate_n([61, 62, 63, 64, 65], params, 1)
        updates = [await stream.get()]
        while not updates[-1].finished:
            updates.append(await asyncio.wait_for(stream.get(), TIMEOUT))
        return updates

    updates = asyncio.run(run())
    monkeypatch.undo()
    end = updates[-1]
    assert end.error == "engine error: injected" and end.finish_reason == "error"
    assert end.stop_reason is None and end.prompt_tokens == 5
    assert end.completion_tokens == sum(len(u.token_ids) for u in updates) == 3
    _wait_idle(base)


def test_ttft_and_latency_count_the_wait_for_the_engine_thread(base, served, monkeypatch):
    """A request that arrives while the engine thread is inside a long step waits for it;
    its TTFT and e2e latency count that wait, as the client sees it (vLLM measures from the
    API server's arrival), not from when the engine thread took it."""
    _wait_idle(base)
    before = _families(base)
    async_engine, arrived = served[1], threading.Event()
    submit = async_engine.generate_n

    async def generate_n(*args, **kw):
        task = asyncio.ensure_future(submit(*args, **kw))
        await asyncio.sleep(0)  # (it ran up to its wait: its arrival is stamped, it is queued)
        arrived.set()
        return await task

    monkeypatch.setattr(async_engine, "generate_n", generate_n)
    body = {"input_ids": [71, 72, 73], "sampling_params": {"max_new_tokens": 1}}
    with ThreadPoolExecutor(1) as pool:
        with engine_thread_held(async_engine):
            r = pool.submit(httpx.post, f"{base}/generate", json=body, timeout=TIMEOUT)
            assert arrived.wait(TIMEOUT)
            time.sleep(1.5)  # the request waits at least this long for the engine thread
        assert r.result().status_code == 200
    after = _families(base)
    for name in ("dsakv_time_to_first_token_seconds", "dsakv_e2e_request_latency_seconds"):
        count = [_sample(m, name, name + "_count") for m in (before, after)]
        fast = [_sample(m, name, name + "_bucket", le="1.0") for m in (before, after)]
        assert count[1] == count[0] + 1 and fast[1] == fast[0], name  # it took over 1 s


def test_scrapes_do_not_wait_out_a_long_step(base, served):
    """/metrics gave a 500 with an empty message once one engine step ran past 30 s, and
    waited that long first; /server_info waited for the step. Both answer while the step
    lasts now, with the engine counters the engine thread last read. (The step lasts until
    both answered: one that waited for it would time out.)"""
    _wait_idle(base)
    with engine_thread_held(served[1]):
        text = httpx.get(f"{base}/metrics", timeout=10).text
        assert "dsakv_kv_pages_total" in text
        info = httpx.get(f"{base}/server_info", timeout=10).json()
        assert info["max_total_num_tokens"] == 64 * 16


@pytest.fixture(scope="module")
def dp_served(model_dir):
    """(base_url, AsyncEngine) of a `--tp 2 --dp-attention` server (its peer rank on gloo)."""
    config = EngineConfig(model=str(model_dir), **ENGINE_ARGS, tp=2, dp_attention=True)
    with serving(config) as served:
        yield served


def test_server_info_reports_the_data_parallel_size(base, dp_served):
    """/server_info said dp_size 1 under DP attention, where each of the --tp ranks schedules
    its own requests: now SGLang's dp_size (what sglang-router's dp-aware mode reads), 1
    without it."""
    info = httpx.get(f"{base}/server_info", timeout=TIMEOUT).json()
    assert (info["tp_size"], info["dp_size"], info["enable_dp_attention"]) == (1, 1, False)
    info = httpx.get(f"{dp_served[0]}/server_info", timeout=TIMEOUT).json()
    assert (info["tp_size"], info["dp_size"], info["enable_dp_attention"]) == (2, 2, True)
    assert info["ep_size"] == 1  # (SGLang's field too: --ep's groups of whole experts)


def test_get_load_answers_each_dp_rank(dp_served):
    """/get_load answered one entry under DP attention, every rank's sum, where SGLang answers
    one per DP rank: now each rank's. A request routed to a peer waits for the next step to
    be sent there; it counts as waiting on that rank meanwhile (it counted nowhere)."""
    base, async_engine = dp_served
    two = {"prompt": "busy", "max_tokens": 600, "ignore_eos": True, "stream": True, "n": 2}
    with (
        engine_stops_stepping_at(async_engine, tokens=4),
        httpx.stream("POST", f"{base}/v1/completions", json=two, timeout=TIMEOUT) as r,
    ):
        lines, seen = r.iter_lines(), set()
        while seen != {0, 1}:  # (the choices go to a rank each, in the same step)
            line = next(lines)
            if line.startswith("data: {"):
                seen.update(c["index"] for c in json.loads(line[6:])["choices"])
        load = httpx.get(f"{base}/get_load", timeout=TIMEOUT).json()
    assert [x["dp_rank"] for x in load] == [0, 1], load
    assert all((x["num_reqs"], x["num_waiting_reqs"]) == (1, 0) for x in load), load
    assert load[0]["num_tokens"] == load[1]["num_tokens"] > 0
    _wait_idle(base)

    def routed(e) -> tuple[float, list[float]]:
        """Two requests added with no step after: one on rank 0, one queued for rank 1."""
        params = SamplingParams(max_tokens=1)
        reqs = [e.add_request([t] * 20, params) for t in (1, 2)]
        try:
            return e.counters()["waiting_requests"], [
                c["waiting_requests"] for c in e.rank_snapshot
            ]
        finally:
            for req in reqs:
                e.abort(req.rid)

    total, ranks = asyncio.run(asyncio.wait_for(async_engine.call(routed), TIMEOUT))
    assert (total, ranks) == (2, [1, 1])
    _wait_idle(base)
    _check_integrity(async_engine)


def test_an_internal_error_without_a_message_names_its_type(served):
    from fastapi.testclient import TestClient

    app = build_app(served[1], MODEL)

    @app.get("/boom")
    async def boom() -> None:
        raise TimeoutError()

    r = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "internal error: TimeoutError"


def test_api_key_is_checked_before_the_body(served):
    """With --api-key, a keyless request whose body is not JSON was a 400 (auth ran after
    parsing): now a 401, as vLLM checks before routing. The probes stay open."""
    from fastapi.testclient import TestClient

    client = TestClient(build_app(served[1], MODEL, api_key="sekret"))
    key = {"Authorization": "Bearer sekret"}
    for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/tokenize"):
        r = client.post(path, content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        r = client.post(path, content=b"{not json", headers={**key, "Content-Type": "x"})
        assert r.status_code == 400, path
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers=key).status_code == 200
    assert client.post("/flush_cache", headers={"Authorization": "Bearer no"}).status_code == 401
    for path in ("/health", "/version", "/metrics", "/model_info", "/server_info"):
        assert client.get(path).status_code == 200, path


def test_api_key_leaves_unserved_paths_a_404(served):
    """With --api-key, a keyless request to a path no route serves was a 401: now the same
    404 a keyed one gets (vLLM's middleware guards only its API), body unread. A served
    path still needs the key: in a method it does not take (no 405 without it), across a
    trailing slash, and for a route added after the app was built; so does any /v1 path."""
    from fastapi.testclient import TestClient

    app = build_app(served[1], MODEL, api_key="sekret")

    @app.post("/later")
    async def later() -> dict:
        return {}

    client = TestClient(app, follow_redirects=False)
    key = {"Authorization": "Bearer sekret"}
    bad = {"content": b"{not json", "headers": {"Content-Type": "application/json"}}
    keyed = client.post("/nope", **{**bad, "headers": {**bad["headers"], **key}})
    assert keyed.status_code == 404
    for method in ("GET", "POST", "DELETE"):
        r = client.request(method, "/nope", **bad)
        assert r.status_code == 404 and r.json() == keyed.json(), method
    assert keyed.json()["error"]["type"] == "invalid_request_error"
    assert client.get("/", headers={"Authorization": "Bearer no"}).status_code == 404
    guarded = [
        ("GET", "/v1/completions"),
        ("DELETE", "/flush_cache"),
        ("GET", "/reset_prefix_cache"),
        ("POST", "/tokenize/"),
        ("GET", "/v1/nope"),
        ("POST", "/v1"),
        ("POST", "/later"),
    ]
    for method, path in guarded:
        r = client.request(method, path, **bad)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    assert client.get("/v1/completions", headers=key).status_code == 405
    assert client.post("/tokenize/", headers=key).status_code == 307
    assert client.post("/later", headers=key).status_code == 200


def test_engine_counters_are_counters_and_endpoints_are_labelled(base, client):
    """Step counts and time only go up: counters, not gauges. /version, /reset_prefix_cache
    and /v1/models/{model} were counted as "other"."""
    _wait_idle(base)
    httpx.get(f"{base}/version", timeout=TIMEOUT)
    httpx.post(f"{base}/reset_prefix_cache", timeout=TIMEOUT)
    client.models.retrieve(MODEL)
    fams = _families(base)
    for name in ("engine_steps", "engine_step_time_seconds", "decode_request_steps"):
        assert fams["dsakv_" + name][0] == "counter", name
        assert _sample(fams, "dsakv_" + name, f"dsakv_{name}_total") > 0, name
    assert "dsakv_steps" not in fams and "dsakv_decode_steps" not in fams
    http = fams["dsakv_http_requests"][1]
    labels = {dict(k[1])["endpoint"] for k in http}
    assert {"/version", "/reset_prefix_cache", "/v1/models/{model}"} <= labels


def test_inter_token_latency_and_success_by_finish_reason(base):
    """vLLM's inter_token_latency_seconds (one gap per step between a request's tokens)
    and request_success_total by finish reason, for streamed and whole responses."""
    _wait_idle(base)
    before = _families(base)
    body = {"prompt": [81, 82, 83], "max_tokens": 5, "ignore_eos": True}
    assert httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT).status_code == 200
    with httpx.stream(
        "POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT
    ) as r:
        assert _sse_events(r.iter_lines())[-1]["choices"][0]["finish_reason"] == "length"
    after = _families(base)
    itl = "dsakv_inter_token_latency_seconds"
    gaps = [_sample(m, itl, itl + "_count") for m in (before, after)]
    assert gaps[1] - gaps[0] == 2 * 4  # 5 tokens each: 4 gaps
    ok = [
        _sample(m, "dsakv_request_success", "dsakv_request_success_total", finished_reason="length")
        for m in (before, after)
    ]
    assert ok[1] - ok[0] == 2


def test_ttft_is_recorded_at_the_first_token_once_per_choice(base, served):
    """TTFT went unrecorded for a request aborted after its first token (a stream the
    client closed, or a whole response it stopped waiting for): it was taken only from
    the finishing update. Now at the first token, as vLLM does, once per choice (vLLM's
    n child requests each), aborted later or not; e2e latency only for a finished one."""
    ttft, e2e = "dsakv_time_to_first_token_seconds", "dsakv_e2e_request_latency_seconds"

    def counts() -> tuple[float, float]:
        fams = _families(base)
        return _sample(fams, ttft, ttft + "_count"), _sample(fams, e2e, e2e + "_count")

    def tokens() -> float:
        return _metrics(base)["dsakv_generation_tokens_total"]

    aborted = _wait_idle(base)["dsakv_aborted_requests_total"]
    before = counts()
    body = {"prompt": [91, 92, 93], "max_tokens": 900, "ignore_eos": True}
    stream = {**body, "n": 2, "stream": True, "return_token_ids": True}
    with (
        engine_stops_stepping_at(served[1], tokens=4),  # (neither can finish before the close)
        httpx.Client(timeout=TIMEOUT) as http,
        http.stream("POST", f"{base}/v1/completions", json=stream) as r,
    ):
        lines, seen = r.iter_lines(), set()
        while seen != {0, 1}:
            events = _sse_events([next(lines)])
            seen |= {c["index"] for e in events for c in e["choices"] if c["token_ids"]}
    _wait_idle(base, aborted_at_least=aborted + 2)
    assert counts() == (before[0] + 2, before[1])

    # A whole response the client stops waiting for once its first token is out.
    host, port = base.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    started = tokens()
    with (
        engine_stops_stepping_at(served[1], tokens=4),  # (it cannot finish before the close)
        socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock,
    ):
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        sock.sendall(head.encode() + data)
        deadline = time.monotonic() + TIMEOUT
        while tokens() == started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    _wait_idle(base, aborted_at_least=aborted + 3)
    assert counts() == (before[0] + 3, before[1])

    r = httpx.post(f"{base}/v1/completions", json={**body, "max_tokens": 3}, timeout=TIMEOUT)
    assert r.status_code == 200
    assert counts() == (before[0] + 4, before[1] + 1)


def test_usage_reports_cached_prompt_tokens(base):
    """OpenAI's usage.prompt_tokens_details.cached_tokens: the prompt tokens the prefix
    cache held (its full 16-token pages), streamed or not; for n > 1 the prompt's, which
    its first choice ran (the other choices find it cached)."""
    _wait_idle(base)

    def usage(path: str, body: dict, stream: bool = False) -> dict:
        if not stream:
            r = httpx.post(f"{base}{path}", json=body, timeout=TIMEOUT)
            return r.json()["usage"]
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{base}{path}", json=body, timeout=TIMEOUT) as r:
            return _sse_events(r.iter_lines())[-1]["usage"]

    prompt = [(7 * i) % 200 + 20 for i in range(40)]
    cmpl = {"prompt": prompt, "max_tokens": 2}
    cached = lambda u: u["prompt_tokens_details"]["cached_tokens"]  # noqa: E731
    assert cached(usage("/v1/completions", {**cmpl, "n": 2})) == 0  # first choice's
    assert cached(usage("/v1/completions", cmpl)) == 32
    assert cached(usage("/v1/completions", cmpl, stream=True)) == 32
    chat = {"messages": [{"role": "user", "content": "cache me " * 12}], "max_tokens": 2}
    first = usage("/v1/chat/completions", chat)
    assert cached(first) == 0 and first["prompt_tokens"] > 32
    assert cached(usage("/v1/chat/completions", chat)) > 0
    assert cached(usage("/v1/chat/completions", {**chat, "n": 2}, stream=True)) > 0


def _flat(out) -> list[float]:
    """The first choice's sampled-token logprobs of an offline output."""
    return flat_logprobs(out.outputs[0].logprobs, out.token_ids)


def test_refusal_answers_a_dead_rank_as_a_server_error():
    """A decode server's rank that died while rank 0 shared a request's KV is the engine's
    fault: a 500 as a failed step's, not a 400 naming the prompt (`RankDied` is a
    DsakvError, which the server answers 400 otherwise)."""
    from dsakv.engine.engine import RankDied
    from dsakv.server.submit import refusal

    e = refusal(RankDied("rank 1 died (signal 9, SIGKILL); stopping every rank"), "prompt")
    assert (e.status, e.type, e.param) == (500, "server_error", None)
    assert e.message.startswith("engine error: rank 1 died")
