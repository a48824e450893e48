"""vLLM's thinking_token_budget: past N tokens inside the reasoning block the end marker is
forced, on the tiny GLM and DeepSeek-V3.2 models with thinking on (their prompts end with
`<think>`; the random models never close the block themselves). Their byte-level tokenizers
spell both markers in several tokens, so the multi-token forcing is what runs here."""

from __future__ import annotations

import httpx
import pytest

from dsakv.engine import EngineConfig, SamplingParams
from dsakv.engine.chat_format import render_chat
from dsakv.engine.llm import LLM
from dsakv.errors import DsakvError
from dsakv.models.tiny import write_tiny_model

from .serving import TIMEOUT, serving

EXACT = dict(kv_cache_dtype="fp32", index_k_dtype="fp32", device="cpu", page_size=16)
USER = [{"role": "user", "content": "Why is the sky blue?"}]
MODEL_TYPES = {"glm": "glm_moe_dsa", "deepseek": "deepseek_v32"}
THINKING = {"glm": {}, "deepseek": {"thinking": True}}


def _greedy(budget: int | None, max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, thinking_token_budget=budget
    )


@pytest.fixture(scope="module")
def glm(glm_tiny_dense_mtp) -> str:
    """glm-tiny with an MTP layer fitted to it (drafts often kept), all of its context
    indexed so greedy runs with and without MTP are exactly equal."""
    return glm_tiny_dense_mtp


@pytest.fixture(scope="module")
def llm(glm) -> LLM:
    return LLM(glm, **EXACT, num_pages=64)


@pytest.fixture(scope="module")
def prompts(llm) -> list[str]:
    """Chat prompts with thinking on (ending with `<think>`), and one whose reasoning is
    already 3 tokens in (a completion continuing it)."""
    chat = render_chat(llm.engine.tokenizer, USER, "glm_moe_dsa")
    assert chat.endswith("<think>")
    return [chat, chat + "abc"]


def _closes(tokens: list[int], end: list[int]) -> int:
    """Where `end` first starts in `tokens` (-1: nowhere)."""
    n = len(end)
    return next((i for i in range(len(tokens) - n + 1) if tokens[i : i + n] == end), -1)


@pytest.mark.parametrize("budget", [0, 1, 5, 17])
def test_budget_closes_the_reasoning_after_n_tokens(llm, prompts, budget):
    """The reasoning is N tokens (those the prompt already had counted), then the whole end
    marker; after it the output runs on unforced: it is the plain greedy continuation of the
    prompt and the forced prefix."""
    _, end = llm.engine.think_marker_ids
    assert len(end) > 1  # (the multi-token case)
    for prompt, thought in zip(prompts, (0, 3)):
        out = llm.generate([prompt], _greedy(budget))[0].token_ids
        n = max(budget - thought, 0)
        assert _closes(out, end) == n, (budget, thought, out)
        closed = n + len(end)
        rest = llm.generate([llm.engine.encode(prompt) + out[:closed]], _greedy(None, 40 - closed))
        assert rest[0].token_ids == out[closed:]


def test_unlimited_budget_forces_nothing(llm, prompts):
    """-1 and None are unlimited: the random model never closes its reasoning itself."""
    _, end = llm.engine.think_marker_ids
    for prompt in prompts:
        plain = llm.generate([prompt], _greedy(None, 64))[0].token_ids
        assert _closes(plain, end) == -1
        assert llm.generate([prompt], _greedy(-1, 64))[0].token_ids == plain


def test_no_open_block_forces_nothing(llm):
    """A prompt whose reasoning block is closed (thinking off: `<think></think>`) or never
    opened is not forced, whatever the budget."""
    off = render_chat(llm.engine.tokenizer, USER, "glm_moe_dsa", enable_thinking=False)
    assert off.rstrip().endswith("</think>")
    for prompt in (off, "Why is the sky blue?"):
        plain = llm.generate([prompt], _greedy(None))[0].token_ids
        assert llm.generate([prompt], _greedy(0))[0].token_ids == plain


def test_budget_under_mtp_equals_plain_greedy(glm, llm, prompts):
    """Drafts are checked against the forced rows: greedy output with MTP is the output
    without it, drafts kept on both sides of the forced end marker (mixed budgets in one
    batch)."""
    jobs = [(p, b) for p in prompts for b in (0, 2, 9, None)]
    want = [llm.generate([p], _greedy(b))[0].token_ids for p, b in jobs]
    mtp = LLM(glm, **EXACT, num_pages=64, speculative_algorithm="mtp", speculative_num_steps=3)
    reqs = [mtp.engine.add_request(p, _greedy(b)) for p, b in jobs]
    while mtp.engine.has_unfinished():
        mtp.engine.step()
    assert [r.output_ids for r in reqs] == want
    assert mtp.engine.counters()["spec_accepted_tokens"] > 0
    mtp.engine.check_integrity()


def test_deepseek_thinking_prompt(tmp_path):
    """DeepSeek-V3.2's thinking prompt (its encoding ends with `<think>`) likewise."""
    path = write_tiny_model(tmp_path / "ds", "deepseek-tiny", seed=0)
    llm = LLM(str(path), **EXACT, num_pages=32)
    prompt = render_chat(llm.engine.tokenizer, USER, "deepseek_v32", thinking=True)
    assert prompt.endswith("<think>")
    _, end = llm.engine.think_marker_ids
    assert _closes(llm.generate([prompt], _greedy(None))[0].token_ids, end) == -1
    assert _closes(llm.generate([prompt], _greedy(4))[0].token_ids, end) == 4


@pytest.mark.parametrize("bad", [-2, 1.5, True, "3"])
def test_bad_budget_is_refused(bad):
    with pytest.raises(DsakvError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=bad)
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None


# --- the OpenAI routes ------------------------------------------------------------------------


@pytest.fixture(scope="module", params=sorted(MODEL_TYPES))
def served(request, tmp_path_factory):
    family = request.param
    path = write_tiny_model(tmp_path_factory.mktemp(family) / family, f"{family}-tiny", seed=0)
    config = EngineConfig(model=str(path), **EXACT, num_pages=64)
    with serving(config) as (base, engine), httpx.Client(base_url=base, timeout=TIMEOUT) as c:
        yield family, c, engine.engine


def test_chat_reasoning_is_the_budget(served):
    """/v1/chat/completions: the reasoning is the first N tokens, the answer follows the
    forced `</think>`; /v1/completions takes the field too."""
    family, client, engine = served
    kw = THINKING[family]
    _, end = engine.think_marker_ids
    for budget in (0, 6):
        r = client.post(
            "/v1/chat/completions",
            json={
                "messages": USER,
                "max_tokens": 20,
                "temperature": 0,
                "thinking_token_budget": budget,
                "return_token_ids": True,
                "chat_template_kwargs": kw,
            },
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        ids = choice["token_ids"]
        assert _closes(ids, end) == budget, ids
        assert (choice["message"].get("reasoning_content") or "") == engine.tokenizer.decode(
            ids[:budget], skip_special_tokens=True
        )
        assert "</think>" not in choice["message"]["content"]
    prompt = render_chat(engine.tokenizer, USER, MODEL_TYPES[family], **kw)
    body = {"prompt": prompt, "max_tokens": 20, "temperature": 0, "return_token_ids": True}
    r = client.post("/v1/completions", json={**body, "thinking_token_budget": 3})
    assert r.status_code == 200, r.text
    assert _closes(r.json()["choices"][0]["token_ids"], end) == 3


@pytest.mark.parametrize("bad", [-2, 1.5, True, "3"])
def test_bad_budget_is_a_400(served, bad):
    _, client, _ = served
    for route, body in (
        ("/v1/chat/completions", {"messages": USER}),
        ("/v1/completions", {"prompt": "x"}),
    ):
        r = client.post(route, json={**body, "max_tokens": 2, "thinking_token_budget": bad})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "thinking_token_budget", r.text


def test_budget_needs_a_reasoning_parser(tmp_path):
    """vLLM's rule: without a reasoning parser the budget has no markers to count in."""
    path = write_tiny_model(tmp_path / "glm", "glm-tiny", seed=0)
    config = EngineConfig(model=str(path), **EXACT, num_pages=32)
    with serving(config, reasoning_parser="none") as (base, _):
        body = {"prompt": "x", "max_tokens": 2}
        r = httpx.post(f"{base}/v1/completions", json={**body, "thinking_token_budget": 4})
        assert r.status_code == 400 and "reasoning parser" in r.json()["error"]["message"]
        r = httpx.post(f"{base}/v1/completions", json={**body, "thinking_token_budget": -1})
        assert r.status_code == 200, r.text
        r = httpx.post(f"{base}/v1/completions", json={**body, "thinking_token_budget": -2})
        assert r.status_code == 400 and "reasoning parser" not in r.text  # (the value's error)
