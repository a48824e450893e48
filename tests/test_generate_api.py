"""SGLang's native /generate (`dsakv.server.generate`), end to end on a tiny model: its
outputs, finish reasons and logprobs equal the offline engine's, streamed or not, in SGLang's
request and response shapes; bad input is one 400 naming the field."""

# ruff: noqa: F811 - the tests take the imported fixtures by their names

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch

from dsakv.engine import LLM, EngineConfig, SamplingParams
from dsakv.models import ForwardBatch
from dsakv.models.loader import load_model

from .conftest import flat_logprobs
from .model_driver import make_pool
from .serving import (
    TIMEOUT,
    engine_held_until_an_abort,
    engine_stops_stepping_at,
    engine_thread_held,
    serving,
    sglang_generate,
    sglang_stream,
)

# The completions tests' model, engine and server (index_topk over every context: chunking
# changes nothing), their fixtures imported: both files run the same setup.
from .test_completions_api import ENGINE_ARGS, model_dir, reference, served  # noqa: F401

TEXTS = [
    "The quick brown fox jumps over the lazy dog, then naps in the warm sun until dusk.",
    "RL frameworks roll out with SGLang's native API and train on its token ids.",
]
GREEDY = {"temperature": 0, "ignore_eos": True}


def _ids(reference: LLM, text: str) -> list[int]:
    return reference.tokenizer.encode(text, add_special_tokens=False)


def _same(a: Any, b: Any) -> bool:
    """Equal, floats to 1e-4 (the same numbers through another batch)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) < 1e-4
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_greedy_outputs_equal_the_offline_engines(base, reference):
    """Text or token ids, one prompt (an object) or a list (a list, in order), one
    sampling_params for all or one each; `rid` comes back as meta_info.id."""
    ids = [_ids(reference, t) for t in TEXTS]
    refs = reference.generate(TEXTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    sp = {"max_new_tokens": 6, **GREEDY}
    one = sglang_generate(base, text=TEXTS[0], sampling_params=sp, rid="mine")
    assert (one["text"], one["output_ids"]) == (refs[0].text, refs[0].token_ids)
    meta = one["meta_info"]
    assert meta["id"] == "mine" and meta["finish_reason"] == {"type": "length", "length": 6}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(ids[0]), 6)
    assert meta["e2e_latency"] > 0 and meta["cached_tokens"] >= 0
    assert "output_token_logprobs" not in meta  # (not asked)
    by_ids = sglang_generate(base, input_ids=ids[0], sampling_params=sp)
    assert (by_ids["text"], by_ids["output_ids"]) == (one["text"], one["output_ids"])
    page = ENGINE_ARGS["page_size"]  # the first request's full pages are cached now
    assert by_ids["meta_info"]["cached_tokens"] == (len(ids[0]) - 1) // page * page > 0
    for name, prompts in (("text", TEXTS), ("input_ids", ids)):
        outs = sglang_generate(base, **{name: prompts}, sampling_params=sp, rid="b")
        assert [(o["text"], o["output_ids"]) for o in outs] == [(r.text, r.token_ids) for r in refs]
        assert [o["meta_info"]["id"] for o in outs] == ["b_0", "b_1"]  # SGLang's batch ids
    each = [{"max_new_tokens": 2, **GREEDY}, {"max_new_tokens": 4, **GREEDY}]
    outs = sglang_generate(base, text=TEXTS, sampling_params=each, rid=["x", "y"])
    assert [o["output_ids"] for o in outs] == [refs[0].token_ids[:2], refs[1].token_ids[:4]]
    assert [o["meta_info"]["id"] for o in outs] == ["x", "y"]


def test_n_samples_are_seeded_and_prompt_major(base, reference):
    """n > 1: a list, prompt i's sample j at i * n + j, sample j seeded with
    sampling_seed + j as offline: the same on every call."""
    sp = {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 7, "n": 3, "ignore_eos": True}
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=3, ignore_eos=True)
    refs = reference.generate(TEXTS, params)
    a = sglang_generate(base, text=TEXTS[0], sampling_params=sp)
    assert [o["output_ids"] for o in a] == [c.token_ids for c in refs[0].outputs]
    assert len({tuple(o["output_ids"]) for o in a}) > 1
    again = sglang_generate(base, text=TEXTS[0], sampling_params=sp)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in a]
    assert len({o["meta_info"]["id"] for o in a + again}) == 6  # a new id per sample
    batch = sglang_generate(base, text=TEXTS, sampling_params={**sp, "n": 2})
    want = [c.token_ids for r in refs for c in r.outputs[:2]]
    assert [o["output_ids"] for o in batch] == want


def test_finish_reasons_name_what_matched(base, reference):
    """SGLang's finish_reason objects: length, a stop token, a stop string, EOS (the EOS
    token, as SGLang's); the stop's text is trimmed unless no_stop_trim."""
    tok = reference.tokenizer
    prompt = _ids(reference, TEXTS[1])
    plain = reference.generate([prompt], SamplingParams(max_tokens=6, temperature=0))[0]
    stop = plain.token_ids[3]
    first = plain.token_ids.index(stop)
    sp = {"max_new_tokens": 6, "temperature": 0, "stop_token_ids": [stop]}
    out = sglang_generate(base, input_ids=prompt, sampling_params=sp)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == plain.token_ids[: first + 1]
    # (the text less an unfinished last character: the engine's one text, as vLLM's)
    assert out["text"] == tok.decode(plain.token_ids[:first]).rstrip("\ufffd")
    kept = sglang_generate(base, input_ids=prompt, sampling_params={**sp, "no_stop_trim": True})
    assert kept["text"] == tok.decode(plain.token_ids[: first + 1]).rstrip("\ufffd")

    (a,) = _ids(reference, "a")
    sp = {"max_new_tokens": 8, "temperature": 0, "logit_bias": {str(a): 100}, "stop": "aaa"}
    out = sglang_generate(base, text=TEXTS[1], sampling_params=sp)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "aaa"}
    assert out["text"] == "" and out["output_ids"] == [a, a, a]
    kept = sglang_generate(base, text=TEXTS[1], sampling_params={**sp, "no_stop_trim": True})
    assert kept["text"] == "aaa"

    eos = reference.engine.eos_token_ids[0]
    sp = {"max_new_tokens": 8, "temperature": 0, "logit_bias": {str(eos): 100}}
    (ref,) = reference.generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0, logit_bias={eos: 100})
    )
    assert (ref.token_ids, ref.finish_reason, ref.outputs[0].stop_reason) == ([eos], "stop", None)
    out = sglang_generate(base, input_ids=prompt, sampling_params=sp)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert (out["text"], out["output_ids"]) == (ref.text, [eos])


def test_logprobs_equal_the_offline_engines(base, reference):
    """return_logprob: [logprob, token id, text] per output token and per prompt token from
    logprob_start_len (the first null, as SGLang's; by default only the last prompt token),
    with the top top_logprobs_num at each; texts with return_text_in_logprobs."""
    ids = _ids(reference, TEXTS[0])
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0, logprobs=2)
    (ref,) = reference.generate([ids], SamplingParams(**{**vars(params), "prompt_logprobs": 2}))
    (c,) = ref.outputs
    sp = {"max_new_tokens": 4, **GREEDY}
    for start in (0, 5):
        m = sglang_generate(
            base,
            input_ids=ids,
            sampling_params=sp,
            return_logprob=True,
            logprob_start_len=start,
            top_logprobs_num=2,
        )["meta_info"]
        out = m["output_token_logprobs"]
        assert [t for _, t, _ in out] == ref.token_ids
        assert _same([x for x, _, _ in out], flat_logprobs(c.logprobs, c.token_ids))
        assert all(s is None for *_, s in out)
        tops = m["output_top_logprobs"]
        want = flat_logprobs(c.logprobs, c.token_ids, k=2)
        assert _same([[[t, x] for x, t, _ in top] for top in tops], want)
        inp = m["input_token_logprobs"]
        assert [t for _, t, _ in inp] == ids[start:]
        assert inp[0][0] is None and _same(
            [x for x, _, _ in inp[1:]], flat_logprobs(ref.prompt_logprobs, ids)[start + 1 :]
        )
        tops = m["input_top_logprobs"]
        assert tops[0] is None and len(tops) == len(ids) - start
        want = flat_logprobs(ref.prompt_logprobs, ids, k=2)[start + 1 :]
        assert _same([[[t, x] for x, t, _ in top] for top in tops[1:]], want)

    tok = reference.tokenizer
    m = sglang_generate(
        base, input_ids=ids, sampling_params=sp, return_logprob=True, return_text_in_logprobs=True
    )["meta_info"]
    assert m["input_token_logprobs"] == [[None, ids[-1], tok.decode([ids[-1]])]]
    out = m["output_token_logprobs"]
    assert [s for *_, s in out] == [tok.decode([t]) for t in ref.token_ids]
    assert _same([x for x, _, _ in out], flat_logprobs(c.logprobs, c.token_ids))
    assert "output_top_logprobs" not in m and "input_top_logprobs" not in m  # (num 0)
    # max_new_tokens 0 only scores the prompt (SGLang's prefill-only request)
    m = sglang_generate(
        base,
        input_ids=ids,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=0,
    )["meta_info"]
    assert m["finish_reason"] == {"type": "length", "length": 0}
    assert _same(
        [x for x, _, _ in m["input_token_logprobs"]], flat_logprobs(ref.prompt_logprobs, ids)
    )


def test_streaming_joins_to_the_whole_response(base, reference):
    """SSE chunks as SGLang's: each carries the output so far (text, output_ids and
    logprobs: cumulative), the last one is the non-streamed response; a batch's chunks
    carry their output's `index`; data: [DONE] ends it."""
    body = dict(
        text=TEXTS[1],
        sampling_params={"max_new_tokens": 6, **GREEDY},
        return_logprob=True,
        logprob_start_len=2,
        top_logprobs_num=1,
        rid="s",
    )
    whole = sglang_generate(base, **body)
    chunks = sglang_stream(base, **body)
    assert len(chunks) == 6  # one per token
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"])
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
        assert a["meta_info"]["finish_reason"] is None and "e2e_latency" not in a["meta_info"]
    for x in (whole, chunks[-1]):
        assert x["meta_info"].pop("e2e_latency") > 0
    assert _same(chunks[-1], whole)

    sp = {"max_new_tokens": 3, **GREEDY, "n": 2}
    outs = sglang_generate(base, text=TEXTS, sampling_params=sp)
    last = {c["index"]: c for c in sglang_stream(base, text=TEXTS, sampling_params=sp)}
    assert sorted(last) == [0, 1, 2, 3]
    assert [last[i]["output_ids"] for i in range(4)] == [o["output_ids"] for o in outs]
    assert [last[i]["text"] for i in range(4)] == [o["text"] for o in outs]


_BAD = [
    ({"sampling_params": {}}, "text"),
    ({"text": "x", "input_ids": [1]}, "text"),
    ({"text": []}, "text"),
    ({"text": ""}, "text"),  # (GLM's tokenizer adds nothing to it; DeepSeek's adds a BOS)
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, "a"]}, "input_ids"),
    ({"text": "x", "sampling_params": {"max_tokens": 3}}, "sampling_params.max_tokens"),
    ({"text": "x", "sampling_params": {"stop_regex": "a+"}}, "sampling_params.stop_regex"),
    ({"text": "x", "sampling_params": {"stop_regex": ["a+"]}}, "sampling_params.stop_regex"),
    ({"text": "x", "sampling_params": {"stream_interval": -1}}, "sampling_params.stream_interval"),
    ({"text": "x", "sampling_params": {"stream_interval": 1.5}}, "sampling_params.stream_interval"),
    (
        {"text": "x", "sampling_params": {"custom_params": {"a": 1}}},
        "sampling_params.custom_params",
    ),
    ({"text": "x", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ({"text": "x", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    (
        {"text": "x", "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}},
        "sampling_params.min_new_tokens",
    ),
    ({"text": "x", "sampling_params": {"n": 99}}, "sampling_params.n"),
    ({"text": "x", "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ({"text": "x", "sampling_params": {"regex": "a("}}, "sampling_params.regex"),
    (
        {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}},
        "sampling_params.ebnf",
    ),
    ({"text": "x", "sampling_params": {"max_new_tokens": 10**6}}, "sampling_params.max_new_tokens"),
    ({"text": ["x", "y"], "sampling_params": [{}]}, "sampling_params"),
    ({"text": "x", "sampling_params": [{}]}, "sampling_params"),
    ({"text": ["x", "y"], "sampling_params": [{"n": 2}, {}]}, "sampling_params.n"),
    ({"text": ["x", "y"], "rid": ["a"]}, "rid"),
    ({"text": ["x", "y"], "rid": ["a", "a"]}, "rid"),
    ({"text": "x", "rid": ["a"]}, "rid"),
    # (ids are 512 characters at most: they come back in headers and URLs)
    ({"text": "x", "rid": "r" * 513}, "rid"),
    ({"text": ["x", "y"], "rid": ["a", "r" * 513]}, "rid"),
    # (n is checked first: a huge one made prompts * n ids, out of memory, before its 400)
    ({"text": ["x", "y"], "rid": ["a"], "sampling_params": {"n": 2**63}}, "sampling_params.n"),
    ({"text": "x", "image_data": "cat.png"}, "image_data"),
    ({"text": "x", "return_logprob": True, "logprob_start_len": 5}, "logprob_start_len"),
    ({"text": "x", "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
    ({"text": "x", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
    ({"text": ["x", "y"], "return_logprob": [True]}, "return_logprob"),
    ({"text": "x", "return_logprob": [True, True]}, "return_logprob"),
    ({"text": ["x", "y"], "return_logprob": True, "logprob_start_len": [0]}, "logprob_start_len"),
    (
        {"text": ["x", "y"], "return_logprob": True, "logprob_start_len": [0, -2]},
        "logprob_start_len",
    ),
    ({"text": ["x", "y"], "return_logprob": True, "top_logprobs_num": [1, 21]}, "top_logprobs_num"),
    (
        {"text": ["x", "y"], "return_logprob": True, "top_logprobs_num": [1, 2, 3]},
        "top_logprobs_num",
    ),
    (  # (SGLang's: a list is per prompt, not per sample)
        {"text": ["x", "y"], "return_logprob": [True, True], "sampling_params": {"n": 2}},
        "return_logprob",
    ),
    ({"input_ids": [10**7]}, "input_ids"),
]


@pytest.mark.parametrize(("body", "param"), _BAD, ids=range(len(_BAD)))
def test_bad_input_is_a_400_naming_the_field(base, body, param):
    r = httpx.post(f"{base}/generate", json=body, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param, err
    assert "max_tokens" not in err["message"] or param.endswith("max_tokens"), err  # SGLang's


def _engine_counters(async_engine) -> dict[str, float]:
    async def get() -> dict[str, float]:
        return await asyncio.wait_for(async_engine.call(lambda e: e.counters()), TIMEOUT)

    return asyncio.run(get())


def _wait_aborted(async_engine, at_least: float) -> None:
    deadline = time.monotonic() + TIMEOUT
    while True:
        c = _engine_counters(async_engine)
        if c["aborted_requests"] >= at_least and c["running_requests"] == 0:
            return
        assert time.monotonic() < deadline, c
        time.sleep(0.05)


def test_a_client_that_leaves_aborts_its_requests(base, served, monkeypatch):
    """Streamed or not, the engine stops a request whose client hung up."""
    async_engine = served[1]
    before = _engine_counters(async_engine)["aborted_requests"]
    body = {"text": TEXTS[0], "sampling_params": {"max_new_tokens": 500, **GREEDY}}
    with engine_held_until_an_abort(async_engine, monkeypatch), pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/generate", json=body, timeout=httpx.Timeout(TIMEOUT, read=0.5))
    _wait_aborted(async_engine, before + 1)
    with engine_stops_stepping_at(async_engine, 2):  # (it cannot finish before the hang-up)
        with (
            httpx.Client(timeout=TIMEOUT) as http,
            http.stream("POST", f"{base}/generate", json={**body, "stream": True}) as r,
        ):
            lines = r.iter_lines()  # (referenced: dropping it closes the connection)
            assert next(lines).startswith("data: {")
        _wait_aborted(async_engine, before + 2)


_ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
_ABORTED_WAITING = {"type": "abort", "message": "Abort in waiting queue"}


def _abort(base: str, headers: dict | None = None, **body: Any) -> None:
    """SGLang's /abort_request: a 200 with an empty body, whatever it found."""
    r = httpx.post(f"{base}/abort_request", json=body, headers=headers, timeout=TIMEOUT)
    assert (r.status_code, r.content) == (200, b""), r.text


def _live(async_engine) -> list[int]:
    """The output lengths of the requests in the engine (read on its thread)."""

    def lengths(e) -> list[int]:
        return [len(r.output_ids) for r in e.requests.values() if not r.finished]

    async def get() -> list[int]:
        return await asyncio.wait_for(async_engine.call(lengths), TIMEOUT)

    return asyncio.run(get())


def _wait_live(async_engine, count: int, tokens: int) -> None:
    """Until `count` requests are in the engine, each with `tokens` output tokens or more."""
    deadline = time.monotonic() + TIMEOUT
    while not ((got := _live(async_engine)) and len(got) == count and min(got) >= tokens):
        assert time.monotonic() < deadline, got
        time.sleep(0.02)


def _check_clean(async_engine) -> None:
    """Once idle, every page is free or cached (`Engine.check_integrity`)."""
    deadline = time.monotonic() + TIMEOUT
    while _live(async_engine):
        assert time.monotonic() < deadline
        time.sleep(0.02)

    async def check() -> None:
        await asyncio.wait_for(async_engine.call(lambda e: e.check_integrity()), TIMEOUT)

    asyncio.run(check())


def _as_it_stood(out: dict, reference: LLM, ref, rid: str) -> None:
    """An output aborted while running: the greedy output so far (some tokens, and their
    text), SGLang's abort finish reason."""
    meta = out["meta_info"]
    assert (meta["id"], meta["finish_reason"]) == (rid, _ABORTED)
    got = out["output_ids"]
    assert 3 <= len(got) < 400 and got == ref.token_ids[: len(got)]
    assert meta["completion_tokens"] == len(got)
    assert out["text"] == reference.tokenizer.decode(got) != ""


def test_abort_request_by_rid_ends_that_request_as_it_stands(base, served, reference):
    """SGLang's /abort_request {"rid"}: that request ends at once with the output it has,
    finish_reason abort (a 200, streamed or not); an unknown rid changes nothing (a 200 too),
    and another client's request runs on to its end. The engine is left clean."""
    async_engine = served[1]
    # Text, not the random model's bytes (U+FFFD), and a stop string never met: the text
    # held back while it could still grow into the stop comes with the abort too.
    word = _ids(reference, "x")[0]
    sp = {"max_new_tokens": 400, "stop": ["@@@@@@@@@@"], "logit_bias": {str(word): 100.0}}
    params = SamplingParams(
        max_tokens=400, temperature=0, ignore_eos=True, stop=tuple(sp["stop"]),
        logit_bias={word: 100.0},
    )  # fmt: skip
    (ref,) = reference.generate([TEXTS[0]], params)
    assert ref.text
    # (16: each of the three arrivals may step the others up to 3 tokens; 8 could end first)
    (plain_ref,) = reference.generate(
        [TEXTS[0]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    )
    long = {"text": TEXTS[0], "sampling_params": {**sp, **GREEDY}}
    short = {"text": TEXTS[0], "sampling_params": {"max_new_tokens": 16, **GREEDY}}
    before = _engine_counters(async_engine)["aborted_requests"]
    with ThreadPoolExecutor(3) as pool, engine_stops_stepping_at(async_engine, 3):
        plain = pool.submit(sglang_generate, base, **long, rid="plain")
        streamed = pool.submit(sglang_stream, base, **long, rid="streamed")
        other = pool.submit(sglang_generate, base, **short, rid="other")
        _wait_live(async_engine, 3, 3)
        _abort(base, rid="nobody")
        _abort(base)  # (SGLang's: no rid, nothing happens)
        _abort(base, rid="plain")
        _as_it_stood(plain.result(TIMEOUT), reference, ref, "plain")
        _abort(base, rid="streamed")
        chunks = streamed.result(TIMEOUT)
        assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
        _as_it_stood(chunks[-1], reference, ref, "streamed")
        assert len(_live(async_engine)) == 1 and not other.done()
        r = httpx.post(f"{base}/abort_request", json={"rid": 5}, timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["param"] == "rid"
    out = other.result(TIMEOUT)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 16}
    assert out["output_ids"] == plain_ref.token_ids
    assert _engine_counters(async_engine)["aborted_requests"] == before + 2
    _check_clean(async_engine)


def test_abort_all_ends_every_request_in_flight(base, served):
    """{"abort_all": true} ends every generation in flight, /generate's (a batch, streamed)
    and the OpenAI routes' (a 200, finish_reason "abort", as SGLang's); a prompt's rid ends
    its n samples, which have ids of their own."""
    async_engine = served[1]
    sp = {"max_new_tokens": 400, **GREEDY}
    cmpl = {"prompt": TEXTS[1], "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(4) as pool, engine_stops_stepping_at(async_engine, 2):
        samples = pool.submit(
            sglang_generate, base, text=TEXTS[1], sampling_params={**sp, "n": 2}, rid="g"
        )
        batch = pool.submit(sglang_generate, base, text=TEXTS, sampling_params=sp, rid="b")
        streamed = pool.submit(sglang_stream, base, text=TEXTS[0], sampling_params=sp)
        openai = pool.submit(
            httpx.post, f"{base}/v1/completions", json=cmpl, timeout=TIMEOUT
        )  # fmt: skip
        _wait_live(async_engine, 6, 2)
        _abort(base, rid="g")
        outs = samples.result(TIMEOUT)
        assert [o["meta_info"]["finish_reason"] for o in outs] == [_ABORTED] * 2
        assert len({o["meta_info"]["id"] for o in outs} | {"g"}) == 3
        assert len(_live(async_engine)) == 4
        _abort(base, abort_all=True)
        outs = [*batch.result(TIMEOUT), streamed.result(TIMEOUT)[-1]]
        assert [o["meta_info"]["finish_reason"] for o in outs] == [_ABORTED] * 3
        assert [o["meta_info"]["id"] for o in outs[:2]] == ["b_0", "b_1"]
        assert all(len(o["output_ids"]) >= 2 for o in outs)
        r = openai.result(TIMEOUT)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "abort"
        assert r.json()["usage"]["completion_tokens"] >= 2
    _check_clean(async_engine)


def test_an_abort_reaches_a_request_the_engine_has_not_taken_yet(base, served):
    """An abort that comes while its request is still on its way into the engine (here the
    engine thread is busy) ends it at once, not when the engine takes it: aborted in the
    waiting queue, no output. (Its add, queued, is undone.)"""
    async_engine = served[1]
    body = {"text": TEXTS[0], "sampling_params": {"max_new_tokens": 400, **GREEDY}}
    with (
        ThreadPoolExecutor(1) as pool,
        engine_stops_stepping_at(async_engine, 0),  # (nothing runs: it stays queued)
        engine_thread_held(async_engine),
    ):
        early = pool.submit(sglang_generate, base, **body, rid="early")
        deadline = time.monotonic() + TIMEOUT
        while async_engine._commands.qsize() == 0:  # (its add, queued behind the hold)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        _abort(base, rid="early")
        out = early.result(10)  # (the engine thread held: up to TIMEOUT)
    assert out["meta_info"]["finish_reason"] == _ABORTED_WAITING
    assert (out["output_ids"], out["meta_info"]["completion_tokens"]) == ([], 0)
    _check_clean(async_engine)


def test_an_abort_while_the_grammar_compiles_ends_the_request(base, served, monkeypatch):
    """An abort that comes while its request's grammar compiles (seconds, for a large
    schema) is not lost: the request ends once the compile is done, aborted in the waiting
    queue, and the engine never sees it (SGLang's abort empties its grammar queue; a version
    of this handed it to the engine, which could prefill it for nothing). Another request
    compiling meanwhile runs on; an abort_all reaches the OpenAI routes' compiling requests
    too."""
    async_engine = served[1]
    cache = async_engine.engine.grammars
    compile_, entered, release = cache.compile, [], threading.Event()

    def held_compile(grammar):  # (the compile itself is the engine's; it only starts later)
        entered.append(grammar)
        assert release.wait(TIMEOUT)
        return compile_(grammar)

    def wait_entered(count: int) -> None:
        deadline = time.monotonic() + TIMEOUT
        while len(entered) < count:
            assert time.monotonic() < deadline, entered
            time.sleep(0.01)

    monkeypatch.setattr(cache, "compile", held_compile)
    sp = {"max_new_tokens": 8, "regex": "[a-z ]+", **GREEDY}
    cmpl = {"prompt": TEXTS[1], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    cmpl["structured_outputs"] = {"regex": "[a-z ]+"}
    before = _engine_counters(async_engine)
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(sglang_generate, base, text=TEXTS[0], sampling_params=sp, rid="slow")
        other = pool.submit(httpx.post, f"{base}/v1/completions", json=cmpl, timeout=TIMEOUT)
        wait_entered(2)
        _abort(base, rid="slow")
        assert not slow.done()
        release.set()
        out = slow.result(TIMEOUT)
        r = other.result(TIMEOUT)
    assert out["meta_info"]["finish_reason"] == _ABORTED_WAITING, out
    assert out["output_ids"] == []
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    _check_clean(async_engine)
    after = _engine_counters(async_engine)  # (the other request's prompt alone)
    assert after["prompt_tokens"] - before["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert after["aborted_requests"] == before["aborted_requests"]
    entered.clear()  # (the engine thread looked them up in the cache too)
    release.clear()
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.post, f"{base}/v1/completions", json=cmpl, timeout=TIMEOUT)
        wait_entered(1)
        _abort(base, abort_all=True)
        release.set()
        r = held.result(TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "abort"
    _check_clean(async_engine)


def test_a_rid_in_flight_is_refused(base, served, reference):
    """SGLang's: a /generate naming a rid already in flight (its output's id, or a prompt's
    rid) is a 400, so another client's abort cannot reach a request that is not its own;
    the request in flight runs on untouched, and once it ended its rid is free again."""
    async_engine = served[1]
    # (16: each arrival may step the others up to 3 tokens; 8 could end before the checks)
    (ref,) = reference.generate([TEXTS[0]], SamplingParams(max_tokens=16, **GREEDY))
    short = {"text": TEXTS[0], "sampling_params": {"max_new_tokens": 16, **GREEDY}}
    samples = {"max_new_tokens": 16, **GREEDY}
    with ThreadPoolExecutor(2) as pool, engine_stops_stepping_at(async_engine, 3):
        first = pool.submit(sglang_generate, base, **short, rid="dup")
        batch = pool.submit(sglang_generate, base, text=TEXTS, sampling_params=samples, rid="b")
        _wait_live(async_engine, 3, 3)
        for again in (
            {**short, "rid": "dup"},
            {"text": TEXTS, "rid": ["x", "dup"]},
            {"text": TEXTS[1], "rid": "b_1"},  # (the batch's second prompt)
        ):
            r = httpx.post(f"{base}/generate", json=again, timeout=TIMEOUT)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "rid" and err["message"].startswith("Duplicate request ID")
        assert not first.done() and len(_live(async_engine)) == 3
        _abort(base, rid="b_0")  # (nothing else had the name)
    out = first.result(TIMEOUT)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 16}
    assert out["output_ids"] == ref.token_ids
    outs = batch.result(TIMEOUT)
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort", "length"]
    again = sglang_generate(base, **short, rid="dup")
    assert (again["meta_info"]["id"], again["output_ids"]) == ("dup", ref.token_ids)
    _check_clean(async_engine)


def test_generation_config_defaults_and_the_api_key(model_dir, reference, tmp_path):
    """/generate ignores generation_config.json (here greedy, at most 5 new tokens), as
    SGLang's, which applies it to its chat route alone: what sampling_params leave out is
    SGLang's default (temperature 1); the OpenAI routes still take it. With --api-key
    /generate needs the key too, and so does /abort_request."""
    path = shutil.copytree(model_dir, tmp_path / "m")
    gen = {"temperature": 0.0, "max_new_tokens": 5}
    (path / "generation_config.json").write_text(json.dumps(gen))
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    (ref,) = reference.generate([TEXTS[0]], params)
    (greedy,) = reference.generate(
        [TEXTS[0]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    )
    assert ref.token_ids[:5] != greedy.token_ids
    config = EngineConfig(model=str(path), **ENGINE_ARGS)
    key = {"Authorization": "Bearer sekret"}
    with serving(config, api_key="sekret") as (base, _):
        sp = {"ignore_eos": True, "sampling_seed": 3, "max_new_tokens": 8}
        body = {"text": TEXTS[0], "sampling_params": sp}
        r = httpx.post(f"{base}/generate", json=body, timeout=TIMEOUT)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        out = sglang_generate(base, key, **body)
        r = httpx.post(f"{base}/abort_request", json={"abort_all": True}, timeout=TIMEOUT)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        _abort(base, key, abort_all=True)
        cmpl = {"prompt": TEXTS[0], "max_tokens": 8, "seed": 3, "ignore_eos": True}
        r = httpx.post(f"{base}/v1/completions", json=cmpl, headers=key, timeout=TIMEOUT)
    assert out["output_ids"] == ref.token_ids
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert r.json()["choices"][0]["text"] == greedy.text  # (the OpenAI route's defaults)


def test_sglang_clients_unset_sampling_params_are_taken(base, reference):
    """sgl.gen (`RuntimeEndpoint`) always sends stop_regex: []; SGLang takes empty values
    of the params dsakv does not run as unset."""
    (ref,) = reference.generate([TEXTS[0]], SamplingParams(max_tokens=3, **GREEDY))
    for unset in ({"stop_regex": []}, {"stop_regex": ""}, {"custom_params": {}}):
        sp = {"max_new_tokens": 3, **GREEDY, **unset, "stream_interval": 0}
        out = sglang_generate(base, text=TEXTS[0], sampling_params=sp)
        assert out["output_ids"] == ref.token_ids


def test_meta_info_has_the_weight_version(base):
    """SGLang's meta_info.weight_version, /model_info's (slime's router reads it)."""
    version = httpx.get(f"{base}/model_info", timeout=TIMEOUT).json()["weight_version"]
    out = sglang_generate(base, text=TEXTS[0], sampling_params={"max_new_tokens": 1})
    assert out["meta_info"]["weight_version"] == version == "default"
    chunks = sglang_stream(base, text=TEXTS[0], sampling_params={"max_new_tokens": 2})
    assert all(c["meta_info"]["weight_version"] == "default" for c in chunks)


def test_a_weight_version_no_answer_could_quote_is_refused_not_set(base):
    """A lone surrogate is no JSON text: refused as the body arrives (taken, it was set, and
    every /generate and /get_weight_version after it a 500)."""
    raw = b'{"new_version": "v\\ud800", "abort_all_requests": false}'
    r = httpx.post(f"{base}/update_weight_version", content=raw, timeout=TIMEOUT,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and "lone surrogate" in r.json()["error"]["message"], r.text
    got = httpx.get(f"{base}/get_weight_version", timeout=TIMEOUT)
    assert got.json() == {"weight_version": "default"}
    out = sglang_generate(base, text="x", sampling_params={"max_new_tokens": 1})
    assert out["meta_info"]["weight_version"] == "default"


def test_max_new_tokens_null_runs_to_the_context_limit(base, reference):
    """max_new_tokens: null is SGLang's "up to the context", not its default of 128 (the
    default when the key is left out)."""
    room = 131
    prompt = [i % 200 + 10 for i in range(reference.engine.max_model_len - room)]
    out = sglang_generate(
        base, input_ids=prompt, sampling_params={"max_new_tokens": None, "ignore_eos": True}
    )
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": room}
    out = sglang_generate(base, input_ids=prompt, sampling_params={"ignore_eos": True})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 128}


def test_logprob_start_len_at_the_prompts_end_scores_nothing(base, reference):
    """logprob_start_len equal to the prompt's length is SGLang's no input logprobs (only
    one past it is an error)."""
    ids = _ids(reference, TEXTS[1])
    for top in (0, 2):
        m = sglang_generate(
            base,
            input_ids=ids,
            sampling_params={"max_new_tokens": 2, **GREEDY},
            return_logprob=True,
            logprob_start_len=len(ids),
            top_logprobs_num=top,
        )["meta_info"]
        assert m["input_token_logprobs"] == [] and len(m["output_token_logprobs"]) == 2
        assert m.get("input_top_logprobs", []) == []


def _meta_free(out: dict) -> dict:
    """An output less what differs from call to call (its id, latency and cache hit)."""
    varies = ("id", "e2e_latency", "cached_tokens")
    meta = {k: v for k, v in out["meta_info"].items() if k not in varies}
    return {**{k: v for k, v in out.items() if k != "index"}, "meta_info": meta}


def test_logprob_start_len_lets_the_prefix_cache_serve_the_prefix(base, served, reference):
    """As SGLang's, the prefix cache serves a scored prompt up to logprob_start_len, whose
    row scores the token after it (so a start one short of a page keeps that page out): the
    logprobs are those of the whole prompt scored; from 0 nothing comes from the cache.
    A fork (n > 1) and every sample get the same scores."""
    ids = _ids(reference, "Scored prefix: " + TEXTS[0] * 3)  # (no other test caches it)
    page = ENGINE_ARGS["page_size"]
    assert len(ids) > 4 * page + 2
    params = SamplingParams(
        max_tokens=3, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=2
    )
    (ref,) = reference.generate([ids], params)  # (scored whole: no cache hit)
    (c,) = ref.outputs
    scores = flat_logprobs(ref.prompt_logprobs, ids)
    tops = flat_logprobs(ref.prompt_logprobs, ids, k=2)
    sglang_generate(
        base, input_ids=ids, sampling_params={"max_new_tokens": 1, **GREEDY}
    )  # cache it
    last = len(ids) - 2
    for start, cached in (
        (3 * page - 1, 2 * page),
        (3 * page, 3 * page),
        (last, last // page * page),
        (0, 0),
    ):
        before = _engine_counters(served[1])["prefix_hit_tokens"]
        m = sglang_generate(
            base,
            input_ids=ids,
            sampling_params={"max_new_tokens": 3, **GREEDY},
            return_logprob=True,
            logprob_start_len=start,
            top_logprobs_num=2,
        )["meta_info"]
        assert m["cached_tokens"] == cached, start
        assert _engine_counters(served[1])["prefix_hit_tokens"] - before == cached
        inp = m["input_token_logprobs"]
        assert [t for _, t, _ in inp] == ids[start:] and inp[0][0] is None
        assert _same([x for x, _, _ in inp[1:]], scores[start + 1 :]), start
        got = [[[t, x] for x, t, _ in top] for top in m["input_top_logprobs"][1:]]
        assert _same(got, tops[start + 1 :])
        out = m["output_token_logprobs"]
        assert [t for _, t, _ in out] == ref.token_ids
        assert _same([x for x, _, _ in out], flat_logprobs(c.logprobs, c.token_ids))

    start = 3 * page - 1
    outs = sglang_generate(
        base,
        input_ids=ids,
        sampling_params={"max_new_tokens": 2, "temperature": 1.0, "sampling_seed": 3, "n": 2},
        return_logprob=True,
        logprob_start_len=start,
    )
    assert outs[0]["meta_info"]["cached_tokens"] == 2 * page
    for o in outs:
        inp = o["meta_info"]["input_token_logprobs"]
        assert _same([x for x, _, _ in inp[1:]], scores[start + 1 :])


def test_a_scored_request_retracted_mid_prefill_is_scored_again(reference):
    """Offline, `prompt_logprobs_start` (the route's logprob_start_len): a request retracted
    while its prompt is scored (no host tier: recomputed) is served by the prefix cache
    only up to the start again, and its scores are those of the prompt scored whole."""
    engine = reference.engine
    page, chunk = ENGINE_ARGS["page_size"], ENGINE_ARGS["chunked_prefill_size"]
    ids = _ids(reference, "Retracted: " + TEXTS[1] * 5)
    assert len(ids) > page + chunk + 2
    greedy = dict(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=1)
    (whole,) = reference.generate([ids], SamplingParams(**greedy))  # (and caches it)
    start = page + 3
    (req,) = engine.add_requests(ids, SamplingParams(**greedy, prompt_logprobs_start=start))
    for _ in range(2):  # admitted, then re-admitted after the retraction
        engine.step()
        assert req.score_prompt and req.num_computed == page + chunk  # (one page cached)
        if not req.metrics.retractions:
            engine.scheduler.retract(req)
    while engine.has_unfinished():
        engine.step()
    assert req.output_ids == whole.token_ids and req.metrics.prefix_hit_tokens == page
    assert req.prompt_logprobs[: start + 1] == [None] * (start + 1)
    want = flat_logprobs(whole.prompt_logprobs, ids)[start + 1 :]
    assert _same(req.prompt_logprobs[start + 1 :], want)
    engine.check_integrity()


def test_logprob_params_per_prompt(base, reference):
    """return_logprob, logprob_start_len and top_logprobs_num as SGLang's: one for all
    prompts, or a list of one each (a single prompt's list of one is its value); each
    prompt gets what it would alone, streamed or not."""
    ids = [_ids(reference, t) for t in TEXTS]
    sp = {"max_new_tokens": 3, **GREEDY}
    asks = [
        {"return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 1},
        {"return_logprob": False, "logprob_start_len": 0, "top_logprobs_num": 3},
    ]
    alone = [sglang_generate(base, input_ids=i, sampling_params=sp, **a) for i, a in zip(ids, asks)]
    lists = {k: [a[k] for a in asks] for k in asks[0]}
    batch = sglang_generate(base, input_ids=ids, sampling_params=sp, **lists)
    assert _same([_meta_free(o) for o in batch], [_meta_free(o) for o in alone])
    assert len(batch[0]["meta_info"]["input_top_logprobs"]) == len(ids[0]) - 2
    assert "output_token_logprobs" not in batch[1]["meta_info"]
    last = {c["index"]: c for c in sglang_stream(base, input_ids=ids, sampling_params=sp, **lists)}
    assert _same([_meta_free(last[i]) for i in range(2)], [_meta_free(o) for o in alone])

    mixed = {"return_logprob": True, "logprob_start_len": [0, -1], "top_logprobs_num": 2}
    batch = sglang_generate(base, input_ids=ids, sampling_params=sp, **mixed)
    for i, start in enumerate(mixed["logprob_start_len"]):
        one = sglang_generate(
            base,
            input_ids=ids[i],
            sampling_params=sp,
            return_logprob=True,
            logprob_start_len=start,
            top_logprobs_num=2,
        )
        assert _same(_meta_free(batch[i]), _meta_free(one))
    one = sglang_generate(
        base, input_ids=ids[0], sampling_params=sp, **{k: [v] for k, v in asks[0].items()}
    )
    assert _same(_meta_free(one), _meta_free(alone[0]))


def _logits(model_dir, ids: list[int]) -> torch.Tensor:
    """The model's fp32 logits of one prefill over `ids`: row p predicts token p + 1."""
    model, config, plan = load_model(str(model_dir))
    pool = make_pool(config, plan, num_tokens=256)
    fb = ForwardBatch.from_requests([ids], [torch.arange(len(ids))])
    with torch.inference_mode():
        return model.compute_logits(model(fb, pool)).float()


def _penalized(row: torch.Tensor, output: list[int]) -> torch.Tensor:
    """`PENALTIES` on one row by their definitions, in vLLM's order: bias, repetition
    (SGLang's: the output's tokens), then frequency and presence (the output's)."""
    row = row.clone()
    for t, b in PENALTIES["logit_bias"].items():
        row[int(t)] += b
    r = PENALTIES["repetition_penalty"]
    for t in set(output):
        row[t] = row[t] / r if row[t] > 0 else row[t] * r
    for t in set(output):
        row[t] -= PENALTIES["frequency_penalty"] * output.count(t) + PENALTIES["presence_penalty"]
    return row


PENALTIES = {
    "repetition_penalty": 1.3,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.25,
    "logit_bias": {"7": 2.0},
}


@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_output_logprobs_are_sglangs_processed_ones(base, reference, model_dir, temperature):
    """SGLang's output logprobs: log_softmax(logits / T) of the logits after penalties and
    bias (T 1 when greedy), the top ones of the same distribution; the OpenAI route's stay
    vLLM's raw ones (of the model's logits) at the same settings."""
    ids = _ids(reference, TEXTS[0])
    sp = {"max_new_tokens": 6, "temperature": temperature, "sampling_seed": 5, **PENALTIES}
    out = sglang_generate(
        base,
        input_ids=ids,
        sampling_params={**sp, "ignore_eos": True},
        return_logprob=True,
        top_logprobs_num=3,
    )
    tokens = out["output_ids"]
    logits = _logits(model_dir, ids + tokens)
    m = out["meta_info"]
    for j, t in enumerate(tokens):
        row = _penalized(logits[len(ids) - 1 + j], tokens[:j])
        want = torch.log_softmax(row / (temperature or 1.0), -1)
        assert m["output_token_logprobs"][j][:2] == [pytest.approx(float(want[t]), abs=1e-4), t]
        values, top = want.topk(3)
        got = m["output_top_logprobs"][j]
        assert [x[1] for x in got] == top.tolist()
        assert [x[0] for x in got] == pytest.approx(values.tolist(), abs=1e-4)

    body = {"prompt": ids, "max_tokens": 6, "temperature": temperature, "seed": 5, **PENALTIES}
    body.update(ignore_eos=True, logprobs=1, return_token_ids=True)
    choice = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT).json()["choices"][0]
    tokens = choice["token_ids"]
    raw = torch.log_softmax(_logits(model_dir, ids + tokens), -1)
    want = [float(raw[len(ids) - 1 + j, t]) for j, t in enumerate(tokens)]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(want, abs=1e-4)


def test_repetition_penalty_counts_the_outputs_tokens_only(base, reference):
    """SGLang's repetition penalty (its /generate's) counts the output's tokens, not the
    prompt's as vLLM's does: the first token is never penalized."""
    greedy = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prompt = _ids(reference, TEXTS[0])
    for _ in range(8):  # a prompt holding the token it continues with
        first = reference.generate([prompt], greedy)[0].token_ids[0]
        if first in prompt:
            break
        prompt = [first, *prompt]
    assert first in prompt
    penalty = {"repetition_penalty": 100.0, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    vllm = reference.generate([prompt], SamplingParams(**penalty))[0].token_ids
    sglang = reference.generate(
        [prompt], SamplingParams(**penalty, repetition_penalty_prompt=False)
    )[0].token_ids
    assert vllm[0] != first and sglang[0] == first
    sp = {"repetition_penalty": 100.0, "max_new_tokens": 6, **GREEDY}
    out = sglang_generate(base, input_ids=prompt, sampling_params=sp)
    assert out["output_ids"] == sglang
