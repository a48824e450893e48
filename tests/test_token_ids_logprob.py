"""SGLang's token_ids_logprob (`SamplingParams.token_ids_logprob`): with return_logprob, each
output position's logprobs of exactly the asked ids, and each scored prompt position's, in
SGLang's [logprob, id, text] triples; equal to the same ids' entries of a full-vocabulary
log_softmax, the same through MTP verification, DP attention and a prefill/decode handoff.
vLLM's logprob_token_ids, the same gather, in the place of the top logprobs."""

# ruff: noqa: F811 - the tests take the imported fixtures by their names

from __future__ import annotations

import asyncio
import dataclasses
import json
import math

import httpx
import pytest
import torch

from dsakv import LLM, SamplingParams
from dsakv.errors import DsakvError
from dsakv.models.tiny import default_model_dir
from dsakv.procs import free_port
from dsakv.server.protocol import APIError

from .serving import NO_THINKING, TIMEOUT, sglang_generate, sglang_stream

# The completions tests' model, engine and server, their fixtures imported (as /generate's)
from .test_completions_api import (  # noqa: F401
    _full_forward_logprobs,
    model_dir,
    reference,
    served,
)

TEXT = "The quick brown fox jumps over the lazy dog, then naps in the warm sun until dusk."
GREEDY = {"temperature": 0, "ignore_eos": True}
ASKED = [3, 17, 101]
EXACT = dict(kv_cache_dtype="fp32", index_k_dtype="fp32", device="cpu", page_size=16)


def _ids(reference: LLM, text: str = TEXT) -> list[int]:
    return reference.tokenizer.encode(text, add_special_tokens=False)


def _values(triples: list[list]) -> list[float]:
    return [x for x, _, _ in triples]


def test_generate_reports_the_asked_ids_of_a_full_log_softmax(base, model_dir, reference):
    """Per output token and per prompt token from logprob_start_len (the first null, as
    input_top_logprobs'), one [logprob, id, text] per asked id in the asked order: the
    same ids' entries of log_softmax over one full forward of prompt + output."""
    ids = _ids(reference)
    start = 5
    m = sglang_generate(
        base,
        input_ids=ids,
        sampling_params={"max_new_tokens": 4, **GREEDY},
        return_logprob=True,
        logprob_start_len=start,
        token_ids_logprob=ASKED,
        return_text_in_logprobs=True,
    )
    out, meta = m["output_ids"], m["meta_info"]
    rows = _full_forward_logprobs(model_dir, ids + out[:-1])
    full = rows[:, ASKED]
    tok = reference.tokenizer
    texts = [tok.decode([t]) for t in ASKED]
    got = meta["output_token_ids_logprobs"]
    assert len(got) == len(out) == 4
    for j, triples in enumerate(got):
        assert [t for _, t, _ in triples] == ASKED and [s for *_, s in triples] == texts
        want = full[len(ids) - 1 + j].tolist()
        assert _values(triples) == pytest.approx(want, abs=1e-4)
    # (the sampled token's own logprob is the same row's)
    sampled = [rows[len(ids) - 1 + j, t].item() for j, t in enumerate(out)]
    assert _values(meta["output_token_logprobs"]) == pytest.approx(sampled, abs=1e-4)
    inputs = meta["input_token_ids_logprobs"]
    assert len(inputs) == len(ids) - start and inputs[0] is None
    for p, triples in enumerate(inputs[1:], start + 1):  # prompt token p: row p - 1
        assert [t for _, t, _ in triples] == ASKED
        assert _values(triples) == pytest.approx(full[p - 1].tolist(), abs=1e-4)

    plain = sglang_generate(base, input_ids=ids, sampling_params={"max_new_tokens": 2, **GREEDY},
                            return_logprob=True)["meta_info"]  # fmt: skip
    assert "output_token_ids_logprobs" not in plain and "input_token_ids_logprobs" not in plain
    # by default only the last prompt token, which nothing scores (as SGLang's)
    m = sglang_generate(base, input_ids=ids, sampling_params={"max_new_tokens": 2, **GREEDY},
                        return_logprob=True, token_ids_logprob=ASKED)["meta_info"]  # fmt: skip
    assert m["input_token_ids_logprobs"] == [None]
    assert [t for _, t, s in m["output_token_ids_logprobs"][0] if s is None] == ASKED


def test_one_list_for_all_prompts_or_one_each_streamed_or_not(base, reference):
    """A list of ids is every prompt's (n > 1 too); a list of lists is one per prompt; a
    stream's last event carries what the whole response does."""
    prompts = [_ids(reference), _ids(reference, "Hello there, reward model.")]
    sp = {"max_new_tokens": 3, **GREEDY}
    each = [[5], [7, 9, 5]]
    outs = sglang_generate(
        base, input_ids=prompts, sampling_params=sp, return_logprob=True, token_ids_logprob=each
    )
    for o, asked in zip(outs, each):
        got = o["meta_info"]["output_token_ids_logprobs"]
        assert len(got) == 3 and all([t for _, t, _ in x] == asked for x in got)
    # the same id in either list has the same logprob at the same position of one prompt
    alone = sglang_generate(base, input_ids=prompts[1], sampling_params=sp, return_logprob=True,
                            token_ids_logprob=[5])["meta_info"]  # fmt: skip
    second = outs[1]["meta_info"]["output_token_ids_logprobs"]
    assert [x[0][0] for x in alone["output_token_ids_logprobs"]] == pytest.approx(
        [x[2][0] for x in second], abs=1e-5
    )

    body = dict(input_ids=prompts[0], return_logprob=True, token_ids_logprob=ASKED)
    samples = sglang_generate(base, sampling_params={**sp, "n": 2}, **body)
    assert [len(o["meta_info"]["output_token_ids_logprobs"]) for o in samples] == [3, 3]
    whole = sglang_generate(base, sampling_params=sp, **body)["meta_info"]
    last = sglang_stream(base, sampling_params=sp, **body)[-1]["meta_info"]
    for name in ("output_token_ids_logprobs", "input_token_ids_logprobs"):
        assert last[name] == whole[name]


def test_a_prompts_empty_list_asks_for_no_ids(base, reference):
    """One prompt's empty list is asked with no ids, as SGLang's (only a top-level empty list
    is not asked): an empty list per output and scored prompt position, streamed or not."""
    prompts = [_ids(reference), _ids(reference, "Hello there, reward model.")]
    sp = {"max_new_tokens": 3, **GREEDY}
    body = dict(input_ids=prompts, return_logprob=True, logprob_start_len=2)
    outs = sglang_generate(base, sampling_params=sp, token_ids_logprob=[[], [5]], **body)
    meta = outs[0]["meta_info"]
    assert meta["output_token_ids_logprobs"] == [[], [], []]
    assert meta["input_token_ids_logprobs"] == [None] + [[]] * (len(prompts[0]) - 3)
    assert [[t for _, t, _ in x] for x in outs[1]["meta_info"]["output_token_ids_logprobs"]] == [
        [5]
    ] * 3
    last = sglang_stream(base, sampling_params=sp, **{**body, "input_ids": prompts[0]},
                         token_ids_logprob=[[]])[-1]["meta_info"]  # fmt: skip
    assert last["output_token_ids_logprobs"] == meta["output_token_ids_logprobs"]
    assert last["input_token_ids_logprobs"] == meta["input_token_ids_logprobs"]
    plain = sglang_generate(base, sampling_params=sp, token_ids_logprob=[], **body)
    assert all("output_token_ids_logprobs" not in o["meta_info"] for o in plain)


_BAD = [
    {"token_ids_logprob": [10**6]},  # past the vocabulary
    {"token_ids_logprob": [-1]},
    {"token_ids_logprob": [[1], [2]]},  # two lists, one prompt
    {"token_ids_logprob": "1"},
    {"token_ids_logprob": [[1]], "sampling_params": {"n": 2}},  # (SGLang's rule)
]


def test_bad_token_ids_logprob_is_a_400_naming_it(base):
    body = {"text": "x", "return_logprob": True, "token_ids_logprob": [1]}
    assert httpx.post(f"{base}/generate", json=body, timeout=TIMEOUT).status_code == 200
    for extra in _BAD:
        r = httpx.post(f"{base}/generate", json={**body, **extra}, timeout=TIMEOUT)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == "token_ids_logprob", (extra, r.text)


def test_sampling_params_check_token_ids_logprob():
    assert SamplingParams(logprobs=0, token_ids_logprob=[]).token_ids_logprob is None
    assert SamplingParams(logprobs=0, token_ids_logprob=[4, 2]).token_ids_logprob == (4, 2)
    for bad in (dict(token_ids_logprob=[1]), dict(logprobs=0, token_ids_logprob=[-2]),
                dict(logprobs=0, token_ids_logprob=5)):  # fmt: skip
        with pytest.raises(DsakvError) as e:
            SamplingParams(**bad)
        assert e.value.param == "token_ids_logprob"


def test_vllms_logprob_token_ids_replace_the_top_ones(base, model_dir, reference):
    """vLLM's `logprob_token_ids` on /v1/completions and /v1/chat/completions: each output
    position's alternatives are the sampled token and exactly the asked ids, whatever
    `logprobs` or `top_logprobs` say (completions' {token: logprob}, chat's list with the
    sampled token first), their values those of a full log_softmax; streamed the same. An
    empty list asks for the top ones."""
    ids = _ids(reference)
    named = {"logprob_token_ids": ASKED, "return_tokens_as_token_ids": True,
             "return_token_ids": True, "max_tokens": 4, **GREEDY}  # fmt: skip
    body = {"prompt": ids, "logprobs": 5, **named}
    choice = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT).json()["choices"][0]
    out, tops = choice["token_ids"], choice["logprobs"]["top_logprobs"]
    rows = _full_forward_logprobs(model_dir, ids + out[:-1])
    assert len(tops) == len(out) == 4
    for j, (t, top) in enumerate(zip(out, tops)):
        want = {f"token_id:{i}": rows[len(ids) - 1 + j, i].item() for i in [t, *ASKED]}
        assert top == pytest.approx(want, abs=1e-4)
    with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True},
                      timeout=TIMEOUT) as s:  # fmt: skip
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    streamed = [x for c in chunks for ch in c["choices"] for x in ch["logprobs"]["top_logprobs"]]
    assert len(streamed) == len(tops)
    assert all(a == pytest.approx(b, abs=1e-5) for a, b in zip(streamed, tops))
    natural = {"prompt": ids, "logprobs": 2, "max_tokens": 2, **GREEDY}
    got = [httpx.post(f"{base}/v1/completions", json=b, timeout=TIMEOUT).json()["choices"][0]
           for b in ({**natural, "logprob_token_ids": []}, natural)]  # fmt: skip
    assert got[0]["logprobs"] == got[1]["logprobs"]

    chat = {"messages": [{"role": "user", "content": TEXT}], "logprobs": True,
            "top_logprobs": 2, **NO_THINKING, **named}  # fmt: skip
    r = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=TIMEOUT).json()
    prompt, (choice,) = r["prompt_token_ids"], r["choices"]
    out, content = choice["token_ids"], choice["logprobs"]["content"]
    rows = _full_forward_logprobs(model_dir, prompt + out[:-1])
    assert len(content) == len(out)
    for j, (t, entry) in enumerate(zip(out, content)):
        listed = list(dict.fromkeys([t, *ASKED]))  # (the sampled token once)
        assert [x["token"] for x in entry["top_logprobs"]] == [f"token_id:{i}" for i in listed]
        want = [rows[len(prompt) - 1 + j, i].item() for i in listed]
        assert [x["logprob"] for x in entry["top_logprobs"]] == pytest.approx(want, abs=1e-4)


def test_logprob_token_ids_named_twice_are_listed_once(base):
    """An id asked for twice is one alternative, as vLLM's logprobs dict keeps it: chat's
    `top_logprobs` list it once (the sampled token first), streamed too."""
    chat = {"messages": [{"role": "user", "content": TEXT}], "logprobs": True, "max_tokens": 3,
            "logprob_token_ids": [17, 3, 17], "return_tokens_as_token_ids": True,
            "return_token_ids": True, **NO_THINKING, **GREEDY}  # fmt: skip
    (choice,) = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=TIMEOUT).json()[
        "choices"
    ]
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**chat, "stream": True},
                      timeout=TIMEOUT) as s:  # fmt: skip
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    streamed = [x for c in chunks for ch in c["choices"] for x in (ch["logprobs"] or {}).get(
        "content", [])]  # fmt: skip
    for content in (choice["logprobs"]["content"], streamed):
        assert len(content) == 3
        for t, entry in zip(choice["token_ids"], content):
            listed = [f"token_id:{i}" for i in dict.fromkeys([t, 17, 3])]
            assert [x["token"] for x in entry["top_logprobs"]] == listed


def test_logprob_token_ids_refused_as_vllm_refuses_them(base):
    """A 400 naming logprob_token_ids: without logprobs (chat's `logprobs: true`), with echo's
    `max_tokens: 0` (no output token to score), ids outside the vocabulary, over 128 ids."""
    cmpl = {"prompt": "x", "max_tokens": 2, "logprob_token_ids": [1]}
    chat = {"messages": [{"role": "user", "content": "x"}], **NO_THINKING, "max_tokens": 2,
            "logprob_token_ids": [1]}  # fmt: skip
    for route, body in (("completions", {**cmpl, "logprobs": 0}),
                        ("chat/completions", {**chat, "logprobs": True})):  # fmt: skip
        assert httpx.post(f"{base}/v1/{route}", json=body, timeout=TIMEOUT).status_code == 200
    bad = [
        ("completions", cmpl),
        ("chat/completions", chat),
        ("chat/completions", {**chat, "logprobs": False}),
        ("completions", {**cmpl, "logprobs": 1, "echo": True, "max_tokens": 0}),
        ("completions", {**cmpl, "logprobs": 1, "logprob_token_ids": [10**6]}),
        ("completions", {**cmpl, "logprobs": 1, "logprob_token_ids": [-1]}),
        ("completions", {**cmpl, "logprobs": 1, "logprob_token_ids": list(range(129))}),
    ]
    for route, body in bad:
        r = httpx.post(f"{base}/v1/{route}", json=body, timeout=TIMEOUT)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == "logprob_token_ids", (body, r.text)


def test_sampling_params_take_vllms_logprob_token_ids():
    """Offline, vLLM's field: `logprobs` unset is their count; given, it must be."""
    p = SamplingParams(logprob_token_ids=[4, 2])
    assert (p.logprobs, p.token_ids_logprob, p.num_top_logprobs) == (2, (4, 2), 0)
    assert SamplingParams(logprob_token_ids=[4, 2], logprobs=2).logprob_token_ids == (4, 2)
    assert SamplingParams(logprob_token_ids=[]).logprobs is None  # (the top ones)
    for bad in (dict(logprob_token_ids=[4, 2], logprobs=1), dict(logprob_token_ids=[-1]),
                dict(logprob_token_ids=range(129)), dict(logprob_token_ids="12"),
                dict(logprob_token_ids=[1], token_ids_logprob=[2])):  # fmt: skip
        with pytest.raises(DsakvError) as e:
            SamplingParams(**bad)
        assert e.value.param == "logprob_token_ids", bad


@pytest.fixture(scope="module")
def mtp_model() -> str:
    return str(default_model_dir("glm-tiny"))  # (cached, its MTP layer fitted)


def _prompts() -> list[list[int]]:
    return [[(7 * i + j) % 250 + 1 for j in range(9 + 13 * i)] for i in range(4)]


def test_offline_whole_vocabulary_is_the_logprobs_and_mtp_changes_nothing(mtp_model):
    """Asking for every id gives a full log_softmax row: it sums to 1 and holds the sampled
    token's logprob and the top ones (SGLang's processed logprobs: penalized, tempered),
    each prompt token's too (raw). Through MTP verification every value is the same."""
    vocab = 264
    params = SamplingParams(max_tokens=24, temperature=0.7, top_k=3, seed=5, ignore_eos=True,
                            repetition_penalty=1.1, presence_penalty=0.2, logprobs=2,
                            logprobs_mode="processed", prompt_logprobs=1,
                            token_ids_logprob=range(vocab))  # fmt: skip
    runs = []
    for kw in ({}, {"speculative_algorithm": "mtp", "speculative_num_steps": 3}):
        llm = LLM(mtp_model, **EXACT, num_pages=64, **kw)
        assert llm.engine.model_config.vocab_size == vocab
        runs.append(llm.generate(_prompts(), params, use_tqdm=False))
    assert llm.engine.counters()["spec_accepted_tokens"] > 0
    for a, b in zip(*runs):
        (ca,), (cb,) = a.outputs, b.outputs
        assert ca.token_ids == cb.token_ids and len(ca.token_ids_logprobs) == 24
        for da, db in zip(ca.token_ids_logprobs, cb.token_ids_logprobs):
            assert list(da) == list(range(vocab))
            assert list(da.values()) == pytest.approx(list(db.values()), abs=1e-4)
        for t, d, lp in zip(ca.token_ids, ca.token_ids_logprobs, ca.logprobs):
            assert torch.logsumexp(torch.tensor(list(d.values())), 0) == pytest.approx(0, abs=1e-5)
            assert d[t] == pytest.approx(lp[t].logprob, abs=1e-6)
            assert all(d[u] == pytest.approx(x.logprob, abs=1e-6) for u, x in lp.items())
        assert a.prompt_token_ids_logprobs[0] is None
        for t, d, lp in zip(a.prompt_token_ids[1:], a.prompt_token_ids_logprobs[1:],
                            a.prompt_logprobs[1:]):  # fmt: skip
            assert d[t] == pytest.approx(lp[t].logprob, abs=1e-6)
            assert math.fsum(math.exp(x) for x in d.values()) == pytest.approx(1, abs=1e-4)


def test_offline_logprob_token_ids_are_each_positions_logprobs_through_mtp(mtp_model):
    """`LLM.generate` with vLLM's `logprob_token_ids`: each position's `logprobs` dict is the
    sampled token's entry, then the asked ids' (the gather's values); through MTP
    verification the same."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                            logprob_token_ids=ASKED)  # fmt: skip
    runs = []
    for kw in ({}, {"speculative_algorithm": "mtp", "speculative_num_steps": 3}):
        llm = LLM(mtp_model, **EXACT, num_pages=64, **kw)
        runs.append(llm.generate(_prompts(), params, use_tqdm=False))
    assert llm.engine.counters()["spec_accepted_tokens"] > 0
    for a, b in zip(*runs):
        (ca,), (cb,) = a.outputs, b.outputs
        assert ca.token_ids == cb.token_ids and len(ca.logprobs) == 24
        for t, da, db, by_id in zip(ca.token_ids, ca.logprobs, cb.logprobs, ca.token_ids_logprobs):
            assert list(da) == list(db) == list(dict.fromkeys([t, *ASKED]))
            values = [x.logprob for x in db.values()]
            assert [x.logprob for x in da.values()] == pytest.approx(values, abs=1e-4)
            assert [da[i].logprob for i in ASKED] == pytest.approx([by_id[i] for i in ASKED])


def _flat(positions: list[dict[int, float]]) -> list[float]:
    return [x for d in positions for x in d.values()]


def test_dp_attention_and_prefill_decode_handoff_report_the_same(mtp_model):
    """Under DP attention a request another rank served brings its values back; through a
    prefill/decode handoff the first token's come from the prefill server, the rest from
    the decode server: one engine's values either way. Scoring the prompt stays refused
    on a PD server, its asked ids with it."""
    from dsakv.disagg import handoff
    from dsakv.disagg.config import DisaggConfig
    from dsakv.disagg.handoff import BootstrapTarget
    from dsakv.disagg.serving import DecodeAsyncEngine, PrefillAsyncEngine
    from dsakv.engine import Engine, EngineConfig

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0,
                            token_ids_logprob=ASKED)  # fmt: skip
    scored = dataclasses.replace(params, prompt_logprobs=0)
    prompts = _prompts()
    single = LLM(mtp_model, **EXACT, num_pages=64).generate(prompts, scored, use_tqdm=False)
    with LLM(mtp_model, **EXACT, num_pages=64, tp=2, dp_attention=True) as llm:
        dp = llm.generate(prompts, scored, use_tqdm=False)
    for a, b in zip(dp, single):
        assert _flat(a.outputs[0].token_ids_logprobs) == pytest.approx(
            _flat(b.outputs[0].token_ids_logprobs), abs=1e-5
        )
        assert a.prompt_token_ids_logprobs[0] is None
        assert _flat(a.prompt_token_ids_logprobs[1:]) == pytest.approx(
            _flat(b.prompt_token_ids_logprobs[1:]), abs=1e-5
        )

    port = free_port()
    config = EngineConfig(mtp_model, **EXACT, num_pages=64)
    prefill = PrefillAsyncEngine(
        Engine(config), DisaggConfig("prefill", bootstrap_port=port), "127.0.0.1"
    )
    decode = DecodeAsyncEngine(Engine(config), DisaggConfig("decode"), "127.0.0.1")

    async def side(bridge, target, prompt, params) -> list[list[float]]:
        handoff._current.set(handoff._Targets([target]))
        (stream,) = await bridge.generate_n(prompt, params, 1)
        got, u = [], None
        while u is None or not u.finished:
            u = await stream.get()
            assert u.error is None, u.error
            got += u.token_ids_logprobs or []
        return got

    async def run(room: int, prompt: list[int], params: SamplingParams):
        return await asyncio.gather(
            side(prefill, BootstrapTarget(room, None, port), prompt, params),
            side(decode, BootstrapTarget(room, "127.0.0.1", port), prompt, params),
        )

    try:
        for room, (prompt, ref) in enumerate(zip(prompts[:2], single), 1):
            first, got = asyncio.run(asyncio.wait_for(run(room, prompt, params), TIMEOUT))
            want = [[d[t] for t in ASKED] for d in ref.outputs[0].token_ids_logprobs]
            assert len(first) == 1 and len(got) == len(want) == 6
            assert sum(first + got, []) == pytest.approx(sum(want[:1] + want, []), abs=1e-5)
        with pytest.raises(APIError) as e:
            asyncio.run(side(decode, BootstrapTarget(9, "127.0.0.1", port), prompts[0], scored))
        assert e.value.status == 400 and "scoring the prompt" in e.value.message
    finally:
        prefill.shutdown()
        decode.shutdown()
