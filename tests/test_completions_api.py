"""Completions features evaluators use, end to end through the `openai` client: `echo` with
prompt logprobs, `n > 1`, lists of prompts, /tokenize and /detokenize; and the offline
engine's teacher-forced prompt logprobs they are checked against."""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
from dataclasses import replace

import httpx
import openai
import pytest
import torch

from dsakv.engine import LLM, EngineConfig, RepetitionDetectionParams, SamplingParams
from dsakv.errors import ConfigError, DsakvError
from dsakv.models import ForwardBatch
from dsakv.models.loader import load_model
from dsakv.models.tiny import TINY_PRESETS, write_tiny_model
from dsakv.server.runner import RequestStream, _update
from dsakv.server.submit import AbortingStream

from .conftest import flat_logprobs
from .model_driver import make_pool
from .serving import TIMEOUT, serving

MODEL = "tiny-dense"
# index_topk covers every context here, so DSA attends to all tokens and a chunked,
# prefix-cached prefill must give the same numbers as one full-sequence forward.
ENGINE_ARGS = dict(
    kv_cache_dtype="fp32",
    index_k_dtype="fp32",
    num_pages=96,
    page_size=16,
    chunked_prefill_size=40,
    device="cpu",
)
TEXTS = [
    "The quick brown fox jumps over the lazy dog, then naps in the warm sun until dusk.",
    "Evaluators score models with loglikelihoods: every prompt token needs its logprob. "
    "That is why echo matters.",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    preset = copy.deepcopy(TINY_PRESETS["glm-tiny"])
    preset["index_topk"] = 4096
    return write_tiny_model(tmp_path_factory.mktemp("cmpl") / MODEL, preset=preset, seed=1)


@pytest.fixture(scope="module")
def reference(model_dir) -> LLM:
    return LLM(str(model_dir), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def served(model_dir):
    with serving(EngineConfig(model=str(model_dir), **ENGINE_ARGS)) as served:
        yield served


def _counters(async_engine) -> dict[str, float]:
    async def get():
        return await asyncio.wait_for(async_engine.call(lambda e: e.counters()), TIMEOUT)

    return asyncio.run(get())


def _full_forward_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    """log_softmax of one prefill over the whole sequence: row p scores token p + 1."""
    model, config, plan = load_model(str(model_dir))
    pool = make_pool(config, plan, num_tokens=256)
    fb = ForwardBatch.from_requests([ids], [torch.arange(len(ids))])
    with torch.inference_mode():
        logits = model.compute_logits(model(fb, pool))
    return torch.log_softmax(logits.float(), dim=-1)


# --- offline: teacher-forced prompt logprobs -----------------------------------------------------


def test_prompt_logprobs_are_teacher_forced_whatever_the_cache(model_dir, reference):
    """Scores match a full-sequence forward, chunked or not, with the prompt's prefix already
    in the prefix cache (the scored request must not skip those rows)."""
    ids = reference.tokenizer.encode(TEXTS[0] * 2, add_special_tokens=False)
    full = _full_forward_logprobs(model_dir, ids)
    want = [None] + [float(full[p, ids[p + 1]]) for p in range(len(ids) - 1)]
    reference.generate([ids[:70]], SamplingParams(max_tokens=1, temperature=0))  # cache it
    hits = reference.engine.scheduler.stats.prefix_hit_tokens
    (out,) = reference.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=3))
    assert reference.engine.scheduler.stats.prefix_hit_tokens == hits  # scored from row 0
    assert out.token_ids == [] and out.finish_reason == "length"
    assert out.prompt_logprobs[0] is None
    got = flat_logprobs(out.prompt_logprobs, ids)[1:]
    assert max(abs(a - b) for a, b in zip(got, want[1:])) < 1e-5
    ranks = [int((full[p] > full[p, ids[p + 1]]).sum()) + 1 for p in range(len(ids) - 1)]
    assert [d[t].rank for t, d in zip(ids[1:], out.prompt_logprobs[1:])] == ranks
    tops = flat_logprobs(out.prompt_logprobs, ids, k=3)
    for p in range(1, len(ids)):
        top = tops[p]
        ref_v, ref_i = torch.topk(full[p - 1], 3)
        assert [t for t, _ in top] == ref_i.tolist()
        assert max(abs(x - float(v)) for (_, x), v in zip(top, ref_v)) < 1e-5
    reference.engine.check_integrity()


def test_forks_share_the_prompt_pages(reference):
    """n choices: the first runs the prompt, the others start from its cached pages."""
    ids = reference.tokenizer.encode(TEXTS[1], add_special_tokens=False)
    engine = reference.engine
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=1)
    reqs = engine.add_requests(ids, replace(params, n=4))
    while engine.has_unfinished():
        engine.step()
    full_pages = (len(ids) - 1) // ENGINE_ARGS["page_size"] * ENGINE_ARGS["page_size"]
    assert reqs[0].metrics.prefix_hit_tokens == 0
    assert [r.metrics.prefix_hit_tokens for r in reqs[1:]] == [full_pages] * 3
    assert len({tuple(r.output_ids) for r in reqs}) == 1  # greedy: the same completion
    assert all(r.prompt_logprobs == reqs[0].prompt_logprobs for r in reqs[1:])
    engine.check_integrity()


# --- echo -----------------------------------------------------------------------------------------


def test_echo_logprobs_equal_offline_teacher_forced(client, reference, model_dir):
    refs = reference.generate(TEXTS, SamplingParams(max_tokens=0, prompt_logprobs=2))
    r = client.completions.create(
        model=MODEL, prompt=TEXTS, max_tokens=0, echo=True, logprobs=2, temperature=0
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 0
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in refs)
    for choice, text, ref in zip(r.choices, TEXTS, refs):
        lp = choice.logprobs
        assert choice.text == text
        assert len(lp.tokens) == len(ref.prompt_token_ids) == len(lp.text_offset)
        assert "".join(lp.tokens) == text  # byte-level tokens of ASCII text
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ids = ref.prompt_token_ids
        diffs = [
            abs(a - b)
            for a, b in zip(lp.token_logprobs[1:], flat_logprobs(ref.prompt_logprobs, ids)[1:])
        ]
        assert max(diffs) < 1e-5
        pairs = zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:])
        for (tok, x, top), ref_top in zip(pairs, flat_logprobs(ref.prompt_logprobs, ids, k=2)[1:]):
            # the top 2 and the prompt token (ASCII here: one token per text), keyed by text
            assert 1 <= len(top) <= 3 and top[tok] == pytest.approx(x, abs=1e-5)
            assert max(top.values()) == pytest.approx(ref_top[0][1], abs=1e-5)
            known = [x] + [y for _, y in ref_top]
            assert all(any(abs(v - y) < 1e-5 for y in known) for v in top.values())
    # ...and the offline engine agrees with one full-sequence forward.
    ids = refs[1].prompt_token_ids
    full = _full_forward_logprobs(model_dir, ids)
    want = [float(full[p, ids[p + 1]]) for p in range(len(ids) - 1)]
    got = flat_logprobs(refs[1].prompt_logprobs, ids)[1:]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5


def test_echo_with_generation_and_lm_eval_shape(client, reference):
    """lm-eval's loglikelihood request: token ids, echo, max_tokens 1, logprobs 1."""
    ids = reference.tokenizer.encode(TEXTS[0], add_special_tokens=False)
    (ref,) = reference.generate(
        [ids], SamplingParams(max_tokens=1, temperature=0, logprobs=1, prompt_logprobs=1)
    )
    body = {"prompt": [ids], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    out = httpx.post(f"{client.base_url}completions", json=body, timeout=TIMEOUT).json()
    (choice,) = out["choices"]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1
    assert choice["text"] == TEXTS[0] + ref.text
    (c,) = ref.outputs
    assert lp["token_logprobs"][-1] == pytest.approx(
        c.logprobs[0][c.token_ids[0]].logprob, abs=1e-5
    )
    # is_greedy as lm-eval computes it: each token's logprob equals its top-1 logprob.
    pairs = zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:])
    greedy = [t == max(top.values()) for t, top in pairs]
    tops = flat_logprobs(ref.prompt_logprobs, ids, k=1)
    want = [tops[p][0][0] == ids[p] for p in range(1, len(ids))]
    assert greedy[:-1] == want and greedy[-1]


def test_prompt_logprobs_as_vllm_gives_them(base, client, reference, model_dir):
    """vLLM's `prompt_logprobs`: per prompt token (null for the first) {token id: logprob,
    rank, decoded_token} for the token and its top-k; on the completions choices, and at the
    top of a chat response."""
    ids = reference.tokenizer.encode(TEXTS[1], add_special_tokens=False)
    full = _full_forward_logprobs(model_dir, ids)
    body = {"prompt": ids, "max_tokens": 2, "prompt_logprobs": 2, "temperature": 0}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT).json()
    (choice,) = r["choices"]
    scores = choice["prompt_logprobs"]
    assert len(scores) == len(ids) and scores[0] is None
    assert choice["logprobs"] is None and not choice["text"].startswith(TEXTS[1])  # no echo
    ranks = []
    for p in range(1, len(ids)):
        row, entry = full[p - 1], scores[p]
        mine = entry[str(ids[p])]
        assert mine["logprob"] == pytest.approx(float(row[ids[p]]), abs=1e-5)
        assert mine["rank"] == int((row > row[ids[p]]).sum()) + 1
        assert mine["decoded_token"] == reference.tokenizer.decode([ids[p]])  # ASCII text
        top_v, top_i = torch.topk(row, 2)
        for rank, (t, v) in enumerate(zip(top_i.tolist(), top_v.tolist()), 1):
            assert entry[str(t)]["logprob"] == pytest.approx(v, abs=1e-5)
            assert entry[str(t)]["rank"] == rank
        assert len(entry) == 2 + (str(ids[p]) not in {str(t) for t in top_i.tolist()})
        ranks.append(mine["rank"])
    assert max(ranks) > 2  # the test text is not the model's own: some tokens rank low
    # echo with logprobs (lm-eval's request) carries them too, as vLLM's choices do
    echoed = httpx.post(
        f"{base}/v1/completions",
        json={"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2},
        timeout=TIMEOUT,
    ).json()["choices"][0]
    assert echoed["prompt_logprobs"] == scores
    plain = httpx.post(
        f"{base}/v1/completions",
        json={"prompt": ids, "max_tokens": 0, "echo": True},
        timeout=TIMEOUT,
    ).json()["choices"][0]
    assert "prompt_logprobs" not in plain
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": TEXTS[0]}],
        max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    ).model_extra["prompt_logprobs"]
    (ref,) = reference.chat(
        [{"role": "user", "content": TEXTS[0]}], SamplingParams(max_tokens=1, prompt_logprobs=0)
    )
    assert len(chat) == len(ref.prompt_token_ids) and chat[0] is None
    for p, (t, entry) in enumerate(zip(ref.prompt_token_ids[1:], chat[1:]), 1):
        assert list(entry) == [str(t)]
        assert entry[str(t)]["logprob"] == pytest.approx(
            ref.prompt_logprobs[p][t].logprob, abs=1e-5
        )
        assert entry[str(t)]["rank"] == ref.prompt_logprobs[p][t].rank


@pytest.mark.parametrize("prompt", [TEXTS[0], "Lines\u2028and\x85paragraphs\u2029apart."])
def test_echo_streaming_starts_with_the_prompt(base, prompt):
    """The second prompt: a stream's JSON held U+2028, U+2029 and NEL raw, line breaks to
    `str.splitlines`, so httpx's `iter_lines` cut its events in two (not JSON)."""
    body = {
        "prompt": prompt,
        "max_tokens": 3,
        "echo": True,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=TIMEOUT) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert chunks[0]["choices"][0]["text"].startswith(prompt)
    plain = httpx.post(
        f"{base}/v1/completions", json={**body, "stream": False}, timeout=TIMEOUT
    ).json()
    assert text == plain["choices"][0]["text"]


def test_echo_of_a_truncated_text_prompt_is_the_prompt_that_ran(base, reference):
    """With truncate_prompt_tokens, a text prompt echoes its kept tokens, as a token-id
    prompt does: the text the usage, the logprobs' tokens and their offsets describe."""
    ids = reference.tokenizer.encode(TEXTS[0], add_special_tokens=False)
    kept = reference.tokenizer.decode(ids[-5:])
    assert kept != TEXTS[0]
    body = {"max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 0, "ignore_eos": True}
    got = {}
    for prompt in (TEXTS[0], ids):
        for stream in (False, True):
            b = {**body, "prompt": prompt, "truncate_prompt_tokens": 5, "stream": stream}
            if stream:
                with httpx.stream("POST", f"{base}/v1/completions", json=b, timeout=TIMEOUT) as r:
                    chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
                text = "".join(c["choices"][0]["text"] for c in chunks)
                tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
                offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
            else:
                r = httpx.post(f"{base}/v1/completions", json=b, timeout=TIMEOUT)
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                assert r.json()["usage"]["prompt_tokens"] == 5
                text, tokens = choice["text"], choice["logprobs"]["tokens"]
                offsets = choice["logprobs"]["text_offset"]
            assert text.startswith(kept) and "".join(tokens[:5]) == kept, (prompt, stream, text)
            assert all(text[o : o + len(t)] == t for t, o in zip(tokens, offsets))
            got[isinstance(prompt, str), stream] = text
    assert len(set(got.values())) == 1, got
    # Not cut (it has fewer tokens than it may keep): the text as given.
    b = {**body, "prompt": TEXTS[0], "truncate_prompt_tokens": len(ids) + 1}
    r = httpx.post(f"{base}/v1/completions", json=b, timeout=TIMEOUT).json()
    assert r["choices"][0]["text"].startswith(TEXTS[0])


def _completion(base: str, body: dict) -> tuple[str, list[str], int | None]:
    """A completion's text, logprobs tokens and prompt_tokens, streamed or not."""
    if not body.get("stream"):
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["text"], choice["logprobs"]["tokens"], r.json()["usage"]["prompt_tokens"]
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=TIMEOUT) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    return text, [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]], None


def test_truncation_side_right_keeps_the_prompts_first_tokens(base, reference):
    """vLLM's truncation_side "right": truncate_prompt_tokens keeps the prompt's first
    tokens; the echo, logprobs and usage are of those, as under "left" of the last ones."""
    ids = reference.tokenizer.encode(TEXTS[0], add_special_tokens=False)
    kept = reference.tokenizer.decode(ids[:5])
    body = {"max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 0, "ignore_eos": True}
    want, _, _ = _completion(base, {**body, "prompt": ids[:5]})  # (nothing to cut)
    for prompt in (TEXTS[0], ids):
        for stream in (False, True):
            b = {**body, "prompt": prompt, "stream": stream, "truncate_prompt_tokens": 5}
            text, tokens, used = _completion(base, {**b, "truncation_side": "right"})
            assert text == want and "".join(tokens[:5]) == kept, (prompt, stream, text)
            assert used in (None, 5)
    b = {**body, "prompt": TEXTS[0], "truncate_prompt_tokens": len(ids) + 1}
    text, _, _ = _completion(base, {**b, "truncation_side": "right"})
    assert text.startswith(TEXTS[0])  # not cut: the text as given
    # chat: the rendered prompt's first tokens
    tok = reference.tokenizer
    messages = [{"role": "user", "content": TEXTS[1]}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat = {"messages": messages, "max_tokens": 2, "truncate_prompt_tokens": 4}
    chat.update(truncation_side="right", return_token_ids=True)
    r = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["prompt_token_ids"] == tok.encode(rendered, add_special_tokens=False)[:4]
    assert r.json()["usage"]["prompt_tokens"] == 4


def test_truncation_side_right_tokenizes_the_whole_prompt(model_dir, tmp_path):
    """truncation_side "right" under a tokenizer with no characters-per-token bound (a
    normalizer step that may change the text): the first tokens of the whole prompt's
    tokenization, as vLLM's, completions and chat."""
    copy_dir = tmp_path / MODEL
    shutil.copytree(model_dir, copy_dir)
    spec = json.loads((copy_dir / "tokenizer.json").read_text())
    steps = [spec["normalizer"]] if spec.get("normalizer") else []
    noop = {"type": "Replace", "pattern": {"String": "\r"}, "content": "\r"}
    spec["normalizer"] = {"type": "Sequence", "normalizers": [*steps, noop]}
    (copy_dir / "tokenizer.json").write_text(json.dumps(spec))
    with serving(EngineConfig(model=str(copy_dir), **ENGINE_ARGS)) as (base, async_engine):
        e = async_engine.engine
        assert e.chars_per_token is None
        body = {"max_tokens": 1, "truncate_prompt_tokens": 5, "truncation_side": "right"}
        body["return_token_ids"] = True
        r = httpx.post(f"{base}/v1/completions", json={**body, "prompt": TEXTS[0]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["prompt_token_ids"] == e.encode(TEXTS[0])[:5]
        messages = [{"role": "user", "content": TEXTS[1]}]
        r = httpx.post(f"{base}/v1/chat/completions", json={**body, "messages": messages})
        assert r.status_code == 200, r.text
        rendered = e.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        assert r.json()["prompt_token_ids"] == e.encode(rendered, special=False)[:5]


def test_truncation_side_right_as_many_as_fit_is_a_400_under_pd(model_dir):
    """-1 ("as many as fit") with truncation_side right is refused on a prefill or decode
    server (here a prefill server, asked as a router asks it, before it waits for the
    room): each would cut at its own context, and the servers' prompts then differ."""
    from dsakv.disagg.config import DisaggConfig
    from dsakv.disagg.serving import bridge_for
    from dsakv.procs import free_port

    config = EngineConfig(model=str(model_dir), **ENGINE_ARGS)
    disagg = DisaggConfig("prefill", bootstrap_port=free_port(), timeout_s=5)
    with serving(config, bridge=bridge_for(disagg, config, "127.0.0.1")) as (base, _):
        body = {"max_tokens": 1, "truncate_prompt_tokens": -1, "truncation_side": "right"}
        body["bootstrap_room"] = 7
        chat = {**body, "messages": [{"role": "user", "content": "Hi"}]}
        for route, b in (("completions", {**body, "prompt": "Hi"}), ("chat/completions", chat)):
            r = httpx.post(f"{base}/v1/{route}", json=b, timeout=TIMEOUT)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_chat_echo_prepends_the_last_assistant_message(base):
    """vLLM's chat echo: a reply starts with the last message's content when that is in
    the reply's role (assistant; any role under add_generation_prompt false), streamed as
    the chunk after the role's; else the reply as without echo."""
    said = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, "}]
    body = {"messages": said, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    body.update(add_generation_prompt=False, continue_final_message=True)
    url = f"{base}/v1/chat/completions"
    plain = httpx.post(url, json=body, timeout=TIMEOUT).json()["choices"][0]["message"]
    r = httpx.post(url, json={**body, "echo": True}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "Sure, " + plain["content"]
    with httpx.stream("POST", url, json={**body, "echo": True, "stream": True}) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0]["role"] == "assistant" and deltas[1] == {"content": "Sure, "}
    assert "".join(d.get("content") or "" for d in deltas) == "Sure, " + plain["content"]
    asked = {**body, "messages": said[:1], "add_generation_prompt": True}
    asked["continue_final_message"] = False
    plain = httpx.post(url, json=asked, timeout=TIMEOUT).json()["choices"][0]["message"]
    echoed = httpx.post(url, json={**asked, "echo": True}, timeout=TIMEOUT).json()
    assert echoed["choices"][0]["message"] == plain  # a user message last: nothing echoed


def test_chat_reply_is_in_the_last_messages_role_without_a_generation_prompt(base):
    """vLLM's `get_chat_request_role`: under add_generation_prompt false the reply goes on
    with the last message, in its role (echo prepends it), streamed or not."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "echo": True}
    body.update(temperature=0, ignore_eos=True, add_generation_prompt=False)
    url = f"{base}/v1/chat/completions"
    r = httpx.post(url, json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["role"] == "user" and message["content"].startswith("Hi")
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=TIMEOUT) as s:
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0]["role"] == "user" and deltas[1] == {"content": "Hi"}
    asked = httpx.post(url, json={**body, "add_generation_prompt": True}, timeout=TIMEOUT)
    assert asked.json()["choices"][0]["message"]["role"] == "assistant"


def _top_logprobs_chunks(base: str, body: dict) -> list:
    """A streamed completion's top_logprobs, all chunks' joined."""
    with httpx.stream(
        "POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT
    ) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    return [top for c in chunks for top in c["choices"][0]["logprobs"]["top_logprobs"]]


@pytest.mark.parametrize("k", [0, 1, 3])
def test_top_logprobs_hold_the_chosen_token(base, k):
    """OpenAI's legacy completions and vLLM: each position's top_logprobs holds the top `k`
    tokens and the chosen one (sampled, or the prompt's under echo), so up to k + 1 entries;
    `logprobs: 0` gives the chosen token alone (they were the top k only: `{}` at 0).
    Streamed the same."""
    body = {"prompt": TEXTS[0][:24], "max_tokens": 12, "temperature": 1.5, "seed": 3,
            "echo": True, "logprobs": k, "ignore_eos": True}  # fmt: skip
    out = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT).json()
    lp = out["choices"][0]["logprobs"]
    assert lp["top_logprobs"][0] is None and lp["token_logprobs"][0] is None
    rows = list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))[1:]
    assert len(rows) == len(TEXTS[0][:24]) - 1 + 12
    for tok, x, top in rows:
        assert tok in top and 1 <= len(top) <= k + 1, (tok, x, top)
        # (a likelier token adding the same text, "" for part of a character, keeps the key)
        assert top[tok] == pytest.approx(x, abs=1e-5) or top[tok] > x
        if k == 0:
            assert top == {tok: pytest.approx(x, abs=1e-5)}
    if k == 1:  # sampled hot, some tokens were not the top 1: two entries there
        assert any(len(top) == 2 for _, _, top in rows)
    assert _top_logprobs_chunks(base, body) == lp["top_logprobs"]


def test_best_of_below_n_is_a_400(base):
    """OpenAI and vLLM refuse best_of < n (best_of 1 with n 2 was taken as n 2)."""
    body = {"prompt": "x", "max_tokens": 2, "n": 2, "best_of": 1}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] == "best_of must be greater than or equal to n"
    assert err["param"] == "best_of"
    ok = httpx.post(f"{base}/v1/completions", json={**body, "best_of": 2}, timeout=TIMEOUT)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


# --- n, prompt lists -------------------------------------------------------------------------------


def test_n_choices_greedy_and_seeded(client, reference, served):
    before = _counters(served[1])
    r = client.completions.create(
        model=MODEL, prompt=TEXTS[1], n=4, max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    (ref,) = reference.generate(
        [TEXTS[1]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.text == ref.text for c in r.choices)
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == 20
    n_pages = (len(ref.prompt_token_ids) - 1) // ENGINE_ARGS["page_size"]
    counters = _counters(served[1])
    hits = counters["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    assert hits >= 3 * n_pages * ENGINE_ARGS["page_size"]  # the forks reused the prompt
    # Each choice counts its prompt, as vLLM's prompt_tokens_total (whose n > 1 requests run
    # as n child requests, each counted).
    assert counters["prompt_tokens"] - before["prompt_tokens"] == 4 * len(ref.prompt_token_ids)

    kw = dict(model=MODEL, prompt=TEXTS[0], n=4, max_tokens=6, temperature=1.0, seed=7)
    a = client.completions.create(**kw, extra_body={"ignore_eos": True})
    b = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1
    for i, c in enumerate(a.choices):  # choice i samples with seed + i
        sp = SamplingParams(max_tokens=6, temperature=1.0, seed=7 + i, ignore_eos=True)
        assert c.text == reference.generate([TEXTS[0]], sp)[0].text


def test_prompt_list_with_n_streams_by_index(client, base, reference):
    body = {"prompt": TEXTS, "n": 2, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT).json()
    texts = {c["index"]: c["text"] for c in plain["choices"]}
    refs = reference.generate(TEXTS, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert texts == {i: refs[i // 2].text for i in range(4)}  # choice = prompt * n + j
    got: dict[int, str] = {}
    stream = client.completions.create(
        model=MODEL, prompt=TEXTS, n=2, max_tokens=4, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for chunk in stream:
        for c in chunk.choices:
            got[c.index] = got.get(c.index, "") + c.text
    assert got == texts


def test_chat_n_choices(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        n=3,
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) == 1
    assert r.usage.completion_tokens == 12
    # Streamed: every choice opens with its role, and the deltas add up to the same texts.
    seeded = dict(temperature=1.0, seed=3)
    want = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=3, max_tokens=6, **seeded
    )
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=3, max_tokens=6,
        stream=True, stream_options={"include_usage": True}, **seeded,
    )  # fmt: skip
    got, roles, usage = {}, set(), None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            roles |= {c.index} if c.delta.role == "assistant" else set()
            got[c.index] = got.get(c.index, "") + (c.delta.content or "")
    assert roles == {0, 1, 2}
    assert got == {c.index: c.message.content for c in want.choices}
    assert usage.completion_tokens == want.usage.completion_tokens


# --- /tokenize, /detokenize -------------------------------------------------------------------


def test_tokenize_and_detokenize(base, reference):
    tok = reference.tokenizer
    r = httpx.post(f"{base}/tokenize", json={"prompt": TEXTS[0]}, timeout=TIMEOUT).json()
    assert r["tokens"] == tok.encode(TEXTS[0], add_special_tokens=False)
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == reference.engine.max_model_len
    back = httpx.post(f"{base}/detokenize", json={"tokens": r["tokens"]}, timeout=TIMEOUT).json()
    assert back == {"prompt": TEXTS[0], "text": TEXTS[0]}  # (vLLM's key, SGLang's)
    messages = [{"role": "user", "content": "Hello"}]
    r = httpx.post(f"{base}/tokenize", json={"messages": messages}, timeout=TIMEOUT).json()
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert r["tokens"] == tok.encode(text, add_special_tokens=False)


# --- bad input ----------------------------------------------------------------------------------

_BAD = [
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 17}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 99}, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "echo": True, "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": ["ok", ""]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [99999]]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
    ("/detokenize", {"tokens": [1, 99999]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [100000]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 1e-40}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    # vLLM's fields that change what is run: honoured, or refused (they were ignored)
    ("/v1/completions", {"prompt": "x", "priority": 5}, "priority"),
    ("/v1/completions", {"prompt": "x", "logprob_token_ids": [1]}, "logprob_token_ids"),
    ("/v1/completions", {"prompt": "x", "cache_salt": ""}, "cache_salt"),
    ("/v1/completions", {"prompt": "x", "prompt_embeds": "AAAA"}, "prompt_embeds"),
    (
        "/v1/completions",
        {"prompt": "x", "repetition_detection": {"max_pattern_size": 2, "min_count": 1}},
        "repetition_detection",
    ),
    ("/v1/completions", {"prompt": "x", "thinking_token_budget": -2}, "thinking_token_budget"),
    ("/v1/completions", {"prompt": "x", "kv_transfer_params": {}}, "kv_transfer_params"),
    # SGLang's fields that change what is run, refused as /generate refuses them
    ("/v1/completions", {"prompt": "x", "stop_regex": ["\\w"]}, "stop_regex"),
    ("/v1/completions", {"prompt": "x", "custom_logit_processor": "{}"}, "custom_logit_processor"),
    ("/v1/completions", {"prompt": "x", "lora_path": "adapter"}, "lora_path"),
    ("/v1/completions", {"prompt": "x", "session_params": {"id": "s"}}, "session_params"),
    ("/v1/completions", {"prompt": "x", "return_hidden_states": True}, "return_hidden_states"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "return_routed_experts": True},
        "return_routed_experts",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "bogus"},
        "reasoning_effort",
    ),
    ("/v1/completions", {"prompt": "x", "truncation_side": "middle"}, "truncation_side"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "n": 11}, "n"),  # (its width)
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [99999]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "bad_words": [""]}, "bad_words"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    (
        "/v1/completions",
        {"prompt": "x", "structured_outputs": {"regex": "a+", "choice": ["a"]}},
        "structured_outputs",
    ),
    (
        "/v1/completions",
        {"prompt": "x", "structured_outputs": {"whitespace_pattern": " "}},
        "structured_outputs",
    ),
    (
        "/v1/completions",
        {"prompt": "x", "structured_outputs": {"choice": ["a"]}, "regex": "a"},
        "structured_outputs",
    ),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 0, "stream": True},
        "prompt_logprobs",
    ),
]


@pytest.mark.parametrize(("path", "body", "param"), _BAD, ids=range(len(_BAD)))
def test_bad_input_is_a_400(base, served, path, body, param):
    r = httpx.post(base + path, json=body, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param, err


def test_unset_sglang_fields_are_taken(base):
    """Null, false or empty is SGLang's unset (sgl.gen sends stop_regex: [])."""
    body = {"prompt": "x", "max_tokens": 2, "stop_regex": [], "lora_path": None,
            "return_hidden_states": False, "session_params": {}}  # fmt: skip
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text


def test_structured_outputs_takes_what_the_offline_params_take(base):
    """`structured_outputs` over HTTP takes the fields `StructuredOutputsParams` takes
    offline (`disable_any_whitespace` was a 400 here, taken there)."""
    so = {"choice": ["yes", "no"], "disable_any_whitespace": True, "disable_fallback": True}
    body = {"prompt": "x", "max_tokens": 5, "temperature": 0, "structured_outputs": so}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in so["choice"]


def test_request_id_names_the_response_as_vllm(base):
    """vLLM's: the X-Request-Id header, else the body's request_id, is the response's id
    (after "cmpl-" / "chatcmpl-"), and comes back in the X-Request-Id header."""
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for path, body, prefix in (
        ("/v1/completions", {"prompt": "x", "max_tokens": 2}, "cmpl-"),
        ("/v1/chat/completions", chat, "chatcmpl-"),
    ):
        for stream in (False, True):
            b = {**body, "stream": stream, "request_id": "body-id"}
            for headers, want in (({}, "body-id"), ({"X-Request-Id": "hdr-id"}, "hdr-id")):
                r = httpx.post(base + path, json=b, headers=headers, timeout=TIMEOUT)
                assert r.status_code == 200, r.text
                first = r.json() if not stream else json.loads(r.text.split("\n")[0][6:])
                assert first["id"] == prefix + want
                assert r.headers["x-request-id"] == want
        r = httpx.post(base + path, json=body, timeout=TIMEOUT)
        rid = r.json()["id"]
        assert rid.startswith(prefix) and r.headers["x-request-id"] == rid[len(prefix) :]


def test_a_request_id_that_cannot_be_a_header_is_a_400(base):
    """A body request_id the X-Request-Id header cannot carry is a 400 before anything
    runs: it was a 500 or a dropped connection after the whole generation, and streamed,
    the call was never closed (/load stayed 1, the id "in flight", an abort-mode pause
    waited forever)."""
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                       ("/v1/chat/completions", chat)):  # fmt: skip
        for rid in ("日本", "a\nb", " padded"):
            for stream in (False, True):
                b = {**body, "request_id": rid, "stream": stream}
                r = httpx.post(base + path, json=b, timeout=TIMEOUT)
                assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"
    assert httpx.get(f"{base}/load", timeout=TIMEOUT).json() == {"server_load": 0}
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 2,
                   "request_id": "a b"}, timeout=TIMEOUT)  # fmt: skip
    assert r.status_code == 200 and r.headers["x-request-id"] == "a b", r.text


def test_a_stream_response_that_cannot_be_built_closes_its_call():
    """Whatever stops an SSE response being built (a header it cannot send) still ends
    its engine requests and closes its call, as a stream that ends does."""

    async def nothing():
        yield ""

    closed = []
    with pytest.raises(UnicodeEncodeError):
        AbortingStream(nothing(), lambda: closed.append(True), {"X-Request-Id": "日本"})
    assert closed == [True]


def _ids(ids) -> list[str]:
    return [f"token_id:{t}" for t in ids]


@pytest.mark.parametrize("stream", [False, True])
def test_return_tokens_as_token_ids_as_vllm_gives_them(base, stream):
    """vLLM's return_tokens_as_token_ids: each logprobs token (and top one) is named
    "token_id:N"; the scores are those of the same request without it."""
    body = {"prompt": TEXTS[0][:20], "max_tokens": 6, "temperature": 0, "echo": True,
            "logprobs": 2, "return_token_ids": True, "stream": stream}  # fmt: skip

    def completion(**kw):
        r = httpx.post(f"{base}/v1/completions", json={**body, **kw}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        if not stream:
            return r.json()["choices"][0]
        chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
        out = {"prompt_token_ids": [], "token_ids": [], "logprobs": {}}
        for c in chunks:
            ch = c["choices"][0]
            out["prompt_token_ids"] += ch.get("prompt_token_ids") or []
            out["token_ids"] += ch["token_ids"]
            for k, v in ch["logprobs"].items():
                out["logprobs"][k] = out["logprobs"].get(k, []) + v
        return out

    plain, named = completion(), completion(return_tokens_as_token_ids=True)
    ids = named["prompt_token_ids"] + named["token_ids"]
    lp, want = named["logprobs"], plain["logprobs"]
    assert lp["tokens"] == _ids(ids) and ids == plain["prompt_token_ids"] + plain["token_ids"]
    assert lp["token_logprobs"] == want["token_logprobs"]
    assert lp["text_offset"] == want["text_offset"]  # (the text's, as without)
    assert lp["top_logprobs"][0] is None
    for tok, top, plain_top in zip(
        lp["tokens"][1:], lp["top_logprobs"][1:], want["top_logprobs"][1:]
    ):
        assert tok in top and all(k.startswith("token_id:") for k in top)
        assert max(top.values()) == pytest.approx(max(plain_top.values()), abs=1e-6)

    chat = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6,
            "temperature": 0, "logprobs": True, "top_logprobs": 2, "return_token_ids": True}  # fmt: skip
    plain = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=TIMEOUT).json()
    chat["return_tokens_as_token_ids"] = True
    named = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=TIMEOUT).json()
    content, want = (
        named["choices"][0]["logprobs"]["content"],
        plain["choices"][0]["logprobs"]["content"],
    )
    assert [e["token"] for e in content] == _ids(named["choices"][0]["token_ids"])
    for e, w in zip(content, want, strict=True):
        assert e["bytes"] == w["bytes"] and e["logprob"] == w["logprob"]  # (the text's bytes)
        for t in e["top_logprobs"]:
            assert t["token"].startswith("token_id:") and t["bytes"] == list(t["token"].encode())


def test_small_endpoints_of_vllm_and_sglang(base, served):
    """vLLM's /ping and /load, SGLang's /v1/tokenize, /v1/detokenize, /get_load and
    /server_info's internal_states."""
    for method in ("GET", "POST"):
        r = httpx.request(method, f"{base}/ping", timeout=TIMEOUT)
        assert r.status_code == 200, r.text
    ids = httpx.post(f"{base}/tokenize", json={"prompt": "hello"}, timeout=TIMEOUT).json()
    assert (
        httpx.post(f"{base}/v1/tokenize", json={"prompt": "hello"}, timeout=TIMEOUT).json() == ids
    )
    text = httpx.post(f"{base}/detokenize", json={"tokens": ids["tokens"]}, timeout=TIMEOUT)
    again = httpx.post(f"{base}/v1/detokenize", json={"tokens": ids["tokens"]}, timeout=TIMEOUT)
    assert again.json() == text.json() and text.json()["text"] == text.json()["prompt"]
    # An idle server's load is none, though its prefix cache holds pages (SGLang's
    # num_tokens leaves the evictable ones out; it counted them)
    body = {"prompt": TEXTS[1], "max_tokens": 3}
    httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
    assert _counters(served[1])["pages_evictable"] > 0
    load = httpx.get(f"{base}/get_load", timeout=TIMEOUT).json()
    assert [sorted(x) for x in load] == [["dp_rank", "num_reqs", "num_tokens", "num_waiting_reqs"]]
    assert load[0]["num_reqs"] == load[0]["num_waiting_reqs"] == load[0]["num_tokens"] == 0
    assert httpx.get(f"{base}/load", timeout=TIMEOUT).json() == {"server_load": 0}
    # The engine's recent throughput: a read does not reset it for the next reader
    states = [
        httpx.get(f"{base}/server_info", timeout=TIMEOUT).json()["internal_states"]
        for _ in range(2)
    ]
    for (state,) in states:
        assert state["last_gen_throughput"] > 0 and "avg_spec_accept_length" not in state
    first, second = (s[0]["last_gen_throughput"] for s in states)
    assert second == pytest.approx(first, rel=0.5)


def test_llm_get_server_info_is_the_servers_less_its_own(base, reference, model_dir):
    """`LLM.get_server_info` (SGLang's `Engine.get_server_info`): /server_info's fields of an
    engine of the same settings, in its order, less the PD role only a server has; served
    under the model's path (SGLang's default `served_model_name`)."""
    info = reference.get_server_info()
    served = httpx.get(f"{base}/server_info", timeout=TIMEOUT).json()
    assert list(served) == [*info, "disaggregation_mode"]
    assert list(info)[:3] == ["model_path", "tokenizer_path", "served_model_name"]
    assert info["served_model_name"] == str(model_dir) and served["served_model_name"] == MODEL
    for key in set(info) - {"internal_states", "served_model_name"}:  # (the throughput:
        assert info[key] == served[key], key  # each engine's own)
    assert info["max_total_num_tokens"] == ENGINE_ARGS["num_pages"] * ENGINE_ARGS["page_size"]
    assert [sorted(s) for s in info["internal_states"]] == [["last_gen_throughput"]]


def test_token_texts_join_to_the_text_across_multibyte_characters(base, client):
    """Each byte of é or 日 is a token here: those that leave a character unfinished add ""
    and the one finishing it adds the character, so tokens join to the text, text_offset
    indexes into it and the greedy token is its top-1's key (lm-eval's is_greedy)."""
    prompt = "héllo 日本, naïve café"
    r = httpx.post(
        f"{base}/v1/completions",
        json={"prompt": prompt, "echo": True, "logprobs": 3, "max_tokens": 8, "temperature": 0},
        timeout=TIMEOUT,
    ).json()["choices"][0]
    lp, text = r["logprobs"], r["text"]
    joined = "".join(lp["tokens"])
    assert text.startswith(prompt) and text.startswith(joined)
    assert set(text[len(joined) :]) <= {"\ufffd"}  # an unfinished last character
    assert lp["tokens"][:3] == ["h", "", "é"]
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    n = len(lp["tokens"]) - 8
    for tok, top in zip(lp["tokens"][n:], lp["top_logprobs"][n:]):
        assert max(top, key=top.get) == tok
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},  # all of it content
    ).choices[0]
    content = b"".join(bytes(x.bytes) for x in chat.logprobs.content).decode()
    assert chat.message.content.startswith(content)
    assert all(x.token == x.top_logprobs[0].token for x in chat.logprobs.content)


def _joins(base: str, **body) -> dict:
    """A greedy completion with logprobs whose token texts must join to its text."""
    body = {"max_tokens": 12, "temperature": 0, "logprobs": 1, **body}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT).json()["choices"][0]
    assert "".join(r["logprobs"]["tokens"]) == r["text"], r
    return r


def test_token_texts_join_for_4_byte_characters_cut_ends_and_special_tokens(base, reference):
    """Runs of 4-byte characters (the 6-token window starts mid-character), an output cut
    mid-character (the finished text leaves it out, as vLLM's), echoed special tokens."""
    assert _joins(base, prompt="x", regex="🇯🇵😀")["text"] == "🇯🇵😀"
    cut = _joins(base, prompt="x", regex="(😀){3}", max_tokens=6)
    assert cut["text"] == "😀" and cut["finish_reason"] == "length"
    bos = reference.tokenizer.convert_tokens_to_ids("<|bos|>")
    echoed = _joins(base, prompt=[bos, 104, 105], echo=True, max_tokens=1)
    assert echoed["text"].startswith("<|bos|>hi")


def test_a_stop_tokens_text_is_not_output(client, reference):
    """As vLLM: the text of the token that stopped the request is left out, unless
    include_stop_str_in_output asks for it (its logprob entry stays)."""
    prompt = reference.tokenizer.encode(TEXTS[1], add_special_tokens=False)
    plain = reference.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))[0]
    stop = plain.token_ids[3]
    first = plain.token_ids.index(stop)

    def text(ids: list[int]) -> str:  # (less an unfinished last character: vLLM's)
        return reference.tokenizer.decode(ids).rstrip("\ufffd")

    kw = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=1)
    r = client.completions.create(**kw, extra_body={"stop_token_ids": [stop]})
    assert r.choices[0].text == text(plain.token_ids[:first])
    assert len(r.choices[0].logprobs.tokens) == first + 1
    assert r.choices[0].model_extra["stop_reason"] == stop  # vLLM's: what stopped it
    extra = {"stop_token_ids": [stop], "include_stop_str_in_output": True}
    r = client.completions.create(**kw, extra_body=extra)
    assert r.choices[0].text == text(plain.token_ids[: first + 1])
    r = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert r.choices[0].model_extra["stop_reason"] is None  # length


def test_vllms_token_constraints_and_truncation(base, reference):
    """structured_outputs (vLLM's since it dropped guided_*), allowed_token_ids, bad_words,
    truncate_prompt_tokens, top_k 0 and SGLang's no_stop_trim: each does what it does in
    vLLM (or SGLang), offline and over HTTP alike (they were accepted and ignored)."""
    ids = reference.tokenizer.encode(TEXTS[0], add_special_tokens=False)

    def text(**body) -> dict:
        body = {"prompt": ids, "max_tokens": 8, "temperature": 0, **body}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        return r.json()

    for so, ok in [
        ({"choice": ["yes", "no"]}, lambda s: s in ("yes", "no")),
        ({"regex": "[ab]{3}"}, lambda s: len(s) == 3 and set(s) <= {"a", "b"}),
        ({"json": {"type": "integer"}}, lambda s: s.strip().lstrip("-").isdigit()),
    ]:
        got = text(structured_outputs=so, max_tokens=12)["choices"][0]["text"]
        assert ok(got), (so, got)
    allowed = [ord(c) for c in "xyz"]  # (byte-level tokens)
    params = SamplingParams(max_tokens=8, temperature=0, allowed_token_ids=allowed)
    want = reference.generate([ids], params)[0]
    assert set(want.token_ids) <= set(allowed)
    assert text(allowed_token_ids=allowed)["choices"][0]["text"] == want.text
    ab = {str(t): 100 for t in reference.tokenizer.encode("ab", add_special_tokens=False)}
    plain = text(ignore_eos=True, logit_bias=ab)["choices"][0]["text"]  # a's and b's
    word = plain[1:3]
    banned = text(ignore_eos=True, logit_bias=ab, bad_words=[word])["choices"][0]["text"]
    assert word not in banned and len(banned) == len(plain) and set(banned) <= {"a", "b"}
    short = text(truncate_prompt_tokens=5)
    assert short["usage"]["prompt_tokens"] == 5
    alone = reference.generate([ids[-5:]], SamplingParams(max_tokens=8, temperature=0))[0]
    assert short["choices"][0]["text"] == alone.text
    assert (
        text(top_k=0, temperature=0.7, seed=1)["choices"][0]["text"]
        == (text(top_k=-1, temperature=0.7, seed=1)["choices"][0]["text"])
    )
    (a,) = reference.tokenizer.encode("a", add_special_tokens=False)
    kept = text(logit_bias={str(a): 100}, stop=["aa"], no_stop_trim=True)["choices"][0]
    assert (kept["text"], kept["stop_reason"]) == ("aa", "aa")


def test_return_token_ids_as_vllm_gives_them(base, reference):
    """vLLM's return_token_ids: the prompt's ids and each choice's, streamed (the prompt's
    on the first chunk, each chunk its own ids) or not; completions and chat."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = reference.generate(TEXTS[0], params)[0]
    chat_want = reference.chat([{"role": "user", "content": TEXTS[1]}], params)[0]
    common = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    bodies = {
        "completions": {"prompt": TEXTS[0], **common},
        "chat/completions": {"messages": [{"role": "user", "content": TEXTS[1]}], **common},
    }
    for route, body in bodies.items():
        ref = want if route == "completions" else chat_want
        r = httpx.post(f"{base}/v1/{route}", json=body, timeout=TIMEOUT).json()
        holder = r["choices"][0] if route == "completions" else r
        assert holder["prompt_token_ids"] == ref.prompt_token_ids
        assert r["choices"][0]["token_ids"] == ref.token_ids
        with httpx.stream(
            "POST", f"{base}/v1/{route}", json={**body, "stream": True}, timeout=TIMEOUT
        ) as s:
            chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
        first = chunks[0]["choices"][0] if route == "completions" else chunks[0]
        assert first["prompt_token_ids"] == ref.prompt_token_ids
        streamed = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
        assert streamed == ref.token_ids
    plain = httpx.post(f"{base}/v1/completions", json={"prompt": "x"}, timeout=TIMEOUT).json()
    assert "token_ids" not in plain["choices"][0]


def test_stop_reason_is_the_stop_string_streamed_or_not(base, reference):
    """vLLM's `stop_reason`: the stop string that ended a choice (on the last chunk)."""
    (a,) = reference.tokenizer.encode("a", add_special_tokens=False)
    user = [{"role": "user", "content": TEXTS[1]}]
    for key, value in [("prompt", TEXTS[1]), ("messages", user)]:
        route = "completions" if key == "prompt" else "chat/completions"
        body = {key: value, "max_tokens": 8, "temperature": 0, "logit_bias": {str(a): 100}}
        free = httpx.post(f"{base}/v1/{route}", json=body, timeout=TIMEOUT).json()["choices"][0]
        assert free["stop_reason"] is None and free["finish_reason"] == "length"
        stop = {**body, "stop": ["\u2603", "aaa"]}
        r = httpx.post(f"{base}/v1/{route}", json=stop, timeout=TIMEOUT).json()["choices"][0]
        assert (r["finish_reason"], r["stop_reason"]) == ("stop", "aaa")
        with httpx.stream(
            "POST", f"{base}/v1/{route}", json={**stop, "stream": True}, timeout=TIMEOUT
        ) as s:
            chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
        last = [c["choices"][0] for c in chunks if c["choices"]][-1]
        assert (last["finish_reason"], last["stop_reason"]) == ("stop", "aaa")


def _repeats_naively(ids: list[int], longest: int, shortest: int, count: int) -> bool:
    """vLLM's repetition test, as it reads: the last n * count tokens are the last n, count
    times over, for an n in shortest..longest."""
    return any(
        n * count <= len(ids) and ids[len(ids) - n * count :] == ids[len(ids) - n :] * count
        for n in range(max(shortest, 1), longest + 1)
    )


def test_repetition_detection_is_vllms_test_of_the_tail():
    """`RepetitionDetectionParams.repeats` (its tail scan) agrees with the test as vLLM
    states it, on every prefix of random short-alphabet outputs; bad sizes are refused."""
    gen = torch.Generator().manual_seed(0)
    for case in range(300):
        ids = torch.randint(0, 1 + case % 3, (40,), generator=gen).tolist()
        longest, shortest, count = 1 + case % 7, case % 4 % (1 + case % 7), 2 + case % 3
        rep = RepetitionDetectionParams(longest, shortest, count)
        for end in range(len(ids) + 1):
            got = rep.repeats(ids[:end])
            assert got == _repeats_naively(ids[:end], longest, shortest, count), (ids[:end], rep)
    for bad in (dict(max_pattern_size=2, min_count=1), dict(max_pattern_size=-1),
                dict(max_pattern_size=2, min_pattern_size=3, min_count=2)):  # fmt: skip
        with pytest.raises(DsakvError) as e:
            SamplingParams(repetition_detection=bad)
        assert e.value.param == "repetition_detection"
    assert SamplingParams(repetition_detection={}).repetition_detection is None  # (off)


def test_repetition_detection_ends_a_looping_output_as_vllms(base, reference):
    """vLLM's `repetition_detection`: an output whose tail is one pattern `min_count` times
    over ends there with finish_reason "repetition" and stop_reason "repetition_detected"
    (streamed too), not before min_tokens; max_pattern_size 0 is off; offline, where a
    free greedy run first repeats so."""
    (a,) = reference.tokenizer.encode("a", add_special_tokens=False)
    user = [{"role": "user", "content": TEXTS[1]}]
    rep = {"max_pattern_size": 2, "min_count": 3}
    for key, value in [("prompt", TEXTS[1]), ("messages", user)]:
        route = "completions" if key == "prompt" else "chat/completions"
        body = {key: value, "max_tokens": 8, "temperature": 0, "logit_bias": {str(a): 100},
                "return_token_ids": True}  # fmt: skip
        for extra, n, why in [
            ({"repetition_detection": rep}, 3, ("repetition", "repetition_detected")),
            ({"repetition_detection": rep, "min_tokens": 5}, 5, ("repetition", "repetition_detected")),
            ({"repetition_detection": {"max_pattern_size": 0}}, 8, ("length", None)),
        ]:  # fmt: skip
            r = httpx.post(f"{base}/v1/{route}", json={**body, **extra}, timeout=TIMEOUT)
            choice = r.json()["choices"][0]
            assert (choice["finish_reason"], choice["stop_reason"]) == why, (route, extra)
            assert choice["token_ids"] == [a] * n, (route, extra)
        with httpx.stream("POST", f"{base}/v1/{route}", timeout=TIMEOUT,
                          json={**body, "repetition_detection": rep, "stream": True}) as s:  # fmt: skip
            chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
        last = [c["choices"][0] for c in chunks if c["choices"]][-1]
        assert (last["finish_reason"], last["stop_reason"]) == ("repetition", "repetition_detected")
    for bad in ({"max_pattern_size": 2, "min_count": 1}, {"max_pattern_size": "2"}):
        r = httpx.post(f"{base}/v1/completions", timeout=TIMEOUT,
                       json={"prompt": "x", "repetition_detection": bad})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_detection"

    prompts = [reference.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    free = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    sizes = RepetitionDetectionParams(max_pattern_size=6, min_pattern_size=2, min_count=2)
    watched = replace(free, repetition_detection=sizes)
    cuts = []
    for plain, cut in zip(reference.generate(prompts, free), reference.generate(prompts, watched)):
        ids = plain.token_ids
        ends = [n for n in range(1, 49) if _repeats_naively(ids[:n], 6, 2, 2)]
        cuts.append(ends[0] if ends else None)
        assert cut.token_ids == (ids[: ends[0]] if ends else ids)
        assert cut.finish_reason == ("repetition" if ends else "length")
        assert cut.outputs[0].stop_reason == ("repetition_detected" if ends else None)
    assert any(cuts), cuts  # (the model does loop: one output at least was cut)


def test_penalties_and_logit_bias_through_the_openai_client(client, reference):
    """The server's processed greedy tokens are the offline engine's, field for field."""
    prompt = reference.tokenizer.encode(TEXTS[0], add_special_tokens=False)
    plain = reference.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
    sink = plain.token_ids[0]
    params = SamplingParams(
        max_tokens=12,
        temperature=0.0,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        repetition_penalty=1.2,
        logit_bias={sink: -100.0, 7: 3.0},
        min_tokens=4,
    )
    want = reference.generate([prompt], params)[0]
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0.0,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        logit_bias={str(sink): -100, "7": 3},
        extra_body={"repetition_penalty": 1.2, "min_tokens": 4},
    )
    assert r.choices[0].text == want.text and r.usage.completion_tokens == len(want.token_ids)
    assert want.token_ids != plain.token_ids and sink not in want.token_ids


def _too_long(n: int, prompt: int, max_tokens: int) -> str:
    """vLLM's words for a prompt and max_tokens past the context."""
    return (
        f"This model's maximum context length is {n} tokens. However, you requested "
        f"{prompt + max_tokens} tokens ({prompt} in the messages, {max_tokens} in the "
        "completion). Please reduce the length of the messages or completion."
    )


def test_max_tokens_past_the_context_is_a_400(base, reference):
    """As vLLM's server: a prompt plus the max_tokens the client gave that do not fit in the
    context are a 400 (they were cut at the context, finish_reason "length"); without
    max_tokens the output still runs up to the context."""
    n, tok = reference.engine.max_model_len, reference.tokenizer
    ids, long = [5, 6, 7, 8] * 3, [5] * (n - 3)
    text_len = len(tok.encode(TEXTS[0], add_special_tokens=False))
    messages = [{"role": "user", "content": "Hi"}]
    chat = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat_len = len(tok.encode(chat, add_special_tokens=False))
    cases = [
        ("/v1/completions", {"prompt": long, "max_tokens": 4}, "max_tokens", n - 3),
        ("/v1/completions", {"prompt": ids, "max_tokens": n - 11}, "max_tokens", len(ids)),
        ("/v1/completions", {"prompt": [TEXTS[0]], "max_tokens": n}, "max_tokens", text_len),
        ("/v1/completions", {"prompt": [[1, 2], ids], "max_tokens": n - 11}, "max_tokens", 12),
        ("/v1/chat/completions", {"max_tokens": n}, "max_tokens", chat_len),
        ("/v1/chat/completions", {"max_completion_tokens": n}, "max_completion_tokens", chat_len),
    ]
    for path, body, param, prompt in cases:
        body = {"messages": messages, **body} if "chat" in path else body
        r = httpx.post(base + path, json=body, timeout=TIMEOUT)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["message"] == _too_long(n, prompt, body[param]) and err["param"] == param
        assert err["code"] == "context_length_exceeded"  # (OpenAI's, what clients read)
    # A prompt too long alone: the same code
    for path, body in [
        ("/v1/completions", {"prompt": [5] * (n + 1)}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": " a" * (2 * n)}]}),
    ]:
        r = httpx.post(base + path, json=body, timeout=TIMEOUT)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded", r.text
    # What fits runs: up to the context exactly, or without max_tokens (16 by default) cut
    # at the context.
    for max_tokens in (3, None):
        body = {"prompt": long, "max_tokens": max_tokens, "ignore_eos": True}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 3


def test_max_tokens_null_runs_to_the_context(base, reference):
    """vLLM's: an explicit `"max_tokens": null` runs up to the context's end (completions gave
    it their default 16), while left out it is 16 on completions; on chat both, and
    `max_completion_tokens: null`, run up to the context's end."""
    n, tok = reference.engine.max_model_len, reference.tokenizer
    room = 24  # more than 16
    for body, want in [({"max_tokens": None}, room), ({}, 16)]:
        body = {"prompt": [5] * (n - room), "ignore_eos": True, **body}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == want, body.keys()

    def room_left(k: int) -> int:  # after a chat prompt of k words
        chat = tok.apply_chat_template(
            [{"role": "user", "content": " a" * k}], add_generation_prompt=True, tokenize=False
        )
        return n - len(tok.encode(chat, add_special_tokens=False))

    lo, hi = 0, n  # the most words that leave `room`
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if room_left(mid) >= room else (lo, mid - 1)
    messages, left = [{"role": "user", "content": " a" * lo}], room_left(lo)
    assert 16 < left < 2 * room
    for extra in ({}, {"max_tokens": None}, {"max_completion_tokens": None}):
        body = {"messages": messages, "ignore_eos": True, **extra}
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == left, extra
        assert r.json()["choices"][0]["finish_reason"] == "length"


def test_token_texts_come_from_the_engines_one_decoder(reference):
    """A logprob request's token texts are those the engine's incremental decoder made its
    text from: one `DecodeStream` per request, not a second one in the server."""
    e = reference.engine
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True)
    req = e.add_request("héllo 日本, naïve", params)
    loop = asyncio.new_event_loop()
    stream, texts = RequestStream(loop), []
    while not req.finished:
        if req in e.step():
            texts += _update(e, stream, req).texts
    loop.close()
    assert stream.texts is None  # the server decoded nothing itself
    assert texts[:-1] == req.detokenizer.texts[:-1]  # (the last gets what is held back)
    assert "".join(texts) == req.output_text


def test_still_serves_after_bad_input(client, served):
    with pytest.raises(openai.BadRequestError, match="n must be in 1..16"):
        client.completions.create(model=MODEL, prompt="x", n=40)
    r = client.completions.create(model=MODEL, prompt=["a", "b"], n=2, max_tokens=2)
    assert len(r.choices) == 4
    counters = _counters(served[1])
    assert counters["running_requests"] == 0 and counters["waiting_requests"] == 0


def test_aborted_choices_free_everything(reference):
    """Aborting a waiting fork drops it; aborting the first choice lets the others run alone."""
    engine = reference.engine
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    reqs = engine.add_requests(TEXTS[0], replace(params, n=3))
    engine.abort(reqs[1].rid)  # still waiting for the prompt
    engine.step()
    engine.abort(reqs[0].rid)  # mid-prefill: its remaining fork starts on its own
    while engine.has_unfinished():
        engine.step()
    assert [r.finish_reason for r in reqs] == ["abort", "abort", "length"]
    assert len(reqs[2].output_ids) == 3
    engine.check_integrity()
    with pytest.raises(DsakvError, match="n must be in 1..16"):
        engine.add_requests("x", replace(params, n=17))
    with pytest.raises(DsakvError, match="add_request makes one choice"):  # (it made one)
        engine.add_request("x", replace(params, n=2))


def test_what_a_request_leaves_out_comes_from_generation_config(model_dir, tmp_path):
    """A model's generation_config.json sets the sampling a request (or `LLM.generate`
    without params) does not, as vLLM's and SGLang's servers do (it was not read): here
    temperature 0, so a request without one is greedy, and one with 1.0 samples."""
    path = shutil.copytree(model_dir, tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 0}))
    prompt = {"model": MODEL, "prompt": TEXTS[0], "max_tokens": 12, "ignore_eos": True}
    greedy = LLM(str(path), **ENGINE_ARGS).generate(
        TEXTS[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )[0]
    with serving(EngineConfig(model=str(path), **ENGINE_ARGS), served_model_name=MODEL) as (
        base,
        _,
    ):
        left_out = httpx.post(f"{base}/v1/completions", json=prompt, timeout=TIMEOUT).json()
        hot = {**prompt, "temperature": 1.0, "seed": 3}
        sampled = httpx.post(f"{base}/v1/completions", json=hot, timeout=TIMEOUT).json()
    assert left_out["choices"][0]["text"] == greedy.text != sampled["choices"][0]["text"]
    offline = LLM(str(path), **ENGINE_ARGS)
    assert offline.get_default_sampling_params().temperature == 0.0
    alone = offline.generate(TEXTS[0])[0].token_ids
    assert alone == offline.generate(TEXTS[0], SamplingParams(temperature=0))[0].token_ids
    (path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ConfigError, match="generation_config.json: .*temperature"):
        LLM(str(path), **ENGINE_ARGS)


def test_generation_configs_max_new_tokens_is_the_default_and_the_cap(model_dir, tmp_path):
    """vLLM's reading of max_new_tokens: what a request without max_tokens gets (a chat
    request ran to the context's end) and the most any request gets."""
    path = shutil.copytree(model_dir, tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 5}))
    offline = LLM(str(path), **ENGINE_ARGS)
    assert offline.get_default_sampling_params().max_tokens == 5
    assert len(offline.generate(TEXTS[0])[0].token_ids) <= 5
    chat = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    with serving(EngineConfig(model=str(path), **ENGINE_ARGS), served_model_name=MODEL) as (
        base,
        _,
    ):
        for route, body in [
            ("chat/completions", chat),
            ("chat/completions", {**chat, "max_completion_tokens": 9}),
            ("completions", {"prompt": TEXTS[0], "max_tokens": 9, "ignore_eos": True}),
        ]:
            r = httpx.post(f"{base}/v1/{route}", json=body, timeout=TIMEOUT).json()
            assert r["usage"]["completion_tokens"] == 5, (route, body, r)
            assert r["choices"][0]["finish_reason"] == "length"
        short = {"prompt": TEXTS[0], "max_tokens": 3, "ignore_eos": True}
        r = httpx.post(f"{base}/v1/completions", json=short, timeout=TIMEOUT).json()
        assert r["usage"]["completion_tokens"] == 3
    # vLLM's --generation-config vllm: SamplingParams' own defaults, no cap
    plain = LLM(str(path), **ENGINE_ARGS, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    with pytest.raises(DsakvError, match="generation_config must be auto or vllm"):
        EngineConfig(model=str(path), generation_config="hf")
    (path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 0}))
    with pytest.raises(ConfigError, match="generation_config.json: max_new_tokens"):
        LLM(str(path), **ENGINE_ARGS)
