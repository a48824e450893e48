"""Engine behaviour: continuous batching, chunked prefill, prefix cache, retraction, sampling."""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsakv import LLM, Logprob, SamplingParams
from dsakv.engine import Engine, EngineConfig
from dsakv.engine.engine import find_stop
from dsakv.errors import DsakvError
from dsakv.metrics import EngineCollector
from dsakv.models.tiny import write_tiny_model

from .conftest import assert_integrity_catches, flat_logprobs

EXACT = dict(kv_cache_dtype="fp32", index_k_dtype="fp32", device="cpu", page_size=16)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("glm-tiny"), preset="glm-tiny", seed=0))


def _prompts(n: int, seed: int = 0, lo: int = 20, hi: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def _run(model: str, prompts, params=GREEDY, **kw) -> tuple[list[list[int]], Engine]:
    llm = LLM(model, **{**EXACT, "num_pages": 64, **kw})
    outs = llm.generate(prompts, params)
    llm.engine.check_integrity()
    return [o.token_ids for o in outs], llm.engine


@pytest.fixture(scope="module")
def reference(tiny):
    """Greedy tokens with a roomy pool, no chunking, no prefix cache."""
    prompts = _prompts(6, lo=20, hi=60)
    tokens, _ = _run(tiny, prompts, chunked_prefill_size=4096, enable_prefix_cache=False)
    return prompts, tokens


def test_generate_returns_text_ids_reason_metrics(tiny):
    llm = LLM(tiny, **EXACT, num_pages=32)
    (out,) = llm.generate(
        "hello world", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    )
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    whole = llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.text == whole.rstrip("\ufffd")  # less an unfinished last character (vLLM's)
    assert out.prompt_token_ids == llm.tokenizer.encode("hello world", add_special_tokens=False)
    assert out.metrics["ttft_s"] > 0 and out.metrics["output_tokens"] == 5
    llm.engine.check_integrity()


def test_output_text_grows_by_each_tokens_text(tiny):
    """Sampled bytes split UTF-8 characters across tokens and hit special ids: the text,
    decoded as the tokens come, only ever grows and is what the output adds to the prompt's
    text, decoded whole (less a character still incomplete at the end)."""
    llm = LLM(tiny, **EXACT, num_pages=64)
    e, tok = llm.engine, llm.tokenizer
    reqs = [
        e.add_request(p, SamplingParams(max_tokens=48, temperature=2.0, seed=i, ignore_eos=True))
        for i, p in enumerate(_prompts(6, seed=3))
    ]
    seen = {r.rid: "" for r in reqs}
    while e.has_unfinished():
        e.step()
        for r in reqs:
            prompt = tok.decode(r.prompt_ids, skip_special_tokens=True)
            whole = tok.decode(r.all_ids, skip_special_tokens=True)
            held = whole[len(os.path.commonprefix([prompt, whole])) :].rstrip("\ufffd")
            assert r.output_text == held and r.output_text.startswith(seen[r.rid])
            seen[r.rid] = r.output_text
    assert any(not text.isascii() for text in seen.values())  # multi-byte characters met


@pytest.mark.parametrize(
    "variant",
    [
        dict(chunked_prefill_size=16),  # chunks across contexts longer than index_topk (16)
        dict(chunked_prefill_size=7),
        dict(enable_prefix_cache=True),
        dict(elide_index_k=False),
        dict(num_pages=9, enable_prefix_cache=False),  # forces retraction and recompute
        dict(num_pages=9, host_pool_gib=0.05),  # retraction to the host tier
        dict(max_running_requests=2),
    ],
    ids=["chunk16", "chunk7", "prefix", "dense", "retract", "retract-host", "max2"],
)
def test_greedy_outputs_identical(tiny, reference, variant):
    prompts, expected = reference
    tokens, engine = _run(tiny, prompts, **variant)
    assert tokens == expected
    c = engine.counters()
    if variant.get("num_pages") == 9:
        assert c["retractions"] > 0
    if "host_pool_gib" in variant:
        assert c["retractions_to_host"] > 0 and c["host_bytes_to_device"] > 0


def test_retraction_makes_room_on_a_host_full_of_cached_prefixes(tiny):
    """Retraction found the host tier full of cached prefix pages and recomputed instead;
    it drops the coldest of them to keep the running request's KV."""
    prompts = _prompts(4, seed=7)
    expected, _ = _run(tiny, prompts)
    llm = LLM(tiny, **EXACT, num_pages=9, host_pool_gib=0.004)  # 13 host pages
    e = llm.engine
    warm = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for i in range(12):  # evicted prefixes fill the host
        llm.generate(_prompts(2, seed=100 + i, lo=60, hi=60), warm)
    assert e.host.num_free_pages == 0 and e.cache.num_host_pages > 0
    cached = e.cache.num_host_pages
    e.cache.free_host_pages(e.host.allocator.num_pages + 1)  # could never fit: drop nothing
    assert e.cache.num_host_pages == cached
    before = e.counters()
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    c = e.counters()
    assert c["retractions"] > before["retractions"]
    assert (
        c["retractions_to_host"] - before["retractions_to_host"]
        == c["retractions"] - before["retractions"]
    )
    e.check_integrity()


def test_prefix_hit_longer_than_index_topk_matches_no_hit(tiny):
    shared = _prompts(1, seed=5, lo=80, hi=80)[0]  # 5 pages, far beyond index_topk=16
    prompts = [shared + tail for tail in _prompts(3, seed=6, lo=3, hi=9)]
    cold, _ = _run(tiny, prompts, enable_prefix_cache=False)
    llm = LLM(tiny, **EXACT, num_pages=64)
    llm.generate([shared + [1, 2, 3]], GREEDY)  # warm the cache
    warm = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert llm.engine.counters()["prefix_hit_tokens"] >= 3 * 80
    assert warm == cold
    llm.engine.check_integrity()


def test_prefix_cache_demotes_to_host_and_promotes_back(tiny):
    shared = _prompts(1, seed=7, lo=64, hi=64)[0]
    first = [shared + [9, 9, 9]]
    others = _prompts(6, seed=8, lo=60, hi=60)  # unrelated traffic that evicts the prefix
    cold, _ = _run(tiny, first, enable_prefix_cache=False)
    llm = LLM(tiny, **EXACT, num_pages=14, host_pool_gib=0.05)
    llm.generate(first, GREEDY)
    llm.generate(others, GREEDY)
    before = llm.engine.counters()
    assert before["prefix_pages_demoted"] > 0 and before["prefix_pages_promoted"] == 0
    again = [o.token_ids for o in llm.generate(first, GREEDY)]
    after = llm.engine.counters()
    assert after["prefix_pages_promoted"] > 0
    collector = EngineCollector("m")  # /metrics: counters, by their own names
    collector.update(after)
    kinds = {f.name: f.type for f in collector.collect()}
    assert kinds["dsakv_prefix_cache_pages_demoted"] == "counter"
    assert kinds["dsakv_prefix_cache_pages_promoted"] == "counter"
    assert again == cold
    llm.engine.check_integrity()


def test_seeded_sampling_reproducible_regardless_of_batch(tiny):
    p = SamplingParams(
        max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True
    )
    target = _prompts(1, seed=11)[0]
    alone, _ = _run(tiny, [target], p)
    others = _prompts(4, seed=12)
    mixed, _ = _run(
        tiny,
        others[:2] + [target] + others[2:],
        [SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)] * 2 + [p] + [GREEDY] * 2,
    )
    assert mixed[2] == alone[0]
    other_seed, _ = _run(
        tiny, [target], SamplingParams(max_tokens=12, temperature=0.9, seed=99, ignore_eos=True)
    )
    assert other_seed[0] != alone[0]


def test_vanishing_temperature_is_greedy_and_spares_the_batch(tiny, reference):
    """A temperature so small that logits / temperature overflow (1e-45) samples greedily,
    as vLLM does below 1e-5; it once made the step's softmax NaN and failed every request
    in the batch."""
    prompts, ref = reference
    cold = SamplingParams(max_tokens=40, temperature=1e-45, ignore_eos=True)
    tokens, _ = _run(tiny, prompts, [GREEDY, cold] * (len(prompts) // 2))
    assert tokens == ref


def test_max_tokens_beyond_the_context_is_cut_to_it(tiny):
    """Admission reserves pages for a share of max_tokens; a max_tokens far past what the
    context leaves (10**8 here, a 32-page pool) is cut to it, so the request runs to the
    context limit instead of never being admitted (it used to end with no tokens)."""
    llm = LLM(tiny, **EXACT, num_pages=32)
    limit = llm.engine.max_model_len
    prompt = _prompts(1, seed=7)[0]
    huge, some = (SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (10**8, 3))
    out, other = llm.generate([prompt, prompt[:20]], [huge, some])
    assert len(out.token_ids) == limit - len(prompt) and out.finish_reason == "length"
    assert len(other.token_ids) == 3
    llm.engine.check_integrity()


def test_stop_conditions_and_logprobs(tiny):
    llm = LLM(tiny, **EXACT, num_pages=32)
    prompt = _prompts(1, seed=3)[0]
    (free,) = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    stop_tok = free.token_ids[5]
    (out,) = llm.generate(
        [prompt],
        SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[stop_tok], ignore_eos=True),
    )
    assert (
        out.finish_reason == "stop"
        and out.token_ids == free.token_ids[: free.token_ids.index(stop_tok) + 1]
    )
    assert (out.outputs[0].stop_reason, free.outputs[0].stop_reason) == (stop_tok, None)
    text = free.text
    if len(text) >= 6:
        stop = text[3:6]
        (out,) = llm.generate(
            [prompt], SamplingParams(max_tokens=16, temperature=0, stop=[stop], ignore_eos=True)
        )
        assert out.finish_reason == "stop" and out.text == text[: text.find(stop)]
        assert out.outputs[0].stop_reason == stop  # (vLLM's: the string, or the token id)
    (out,) = llm.generate(
        [prompt], SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True)
    )
    (c,) = out.outputs
    tops = flat_logprobs(c.logprobs, c.token_ids, k=3)
    assert len(c.logprobs) == 4 and all(len(t) == 3 for t in tops)
    # Greedy picks the most likely token, so its logprob is the top one (rank 1).
    lps = flat_logprobs(c.logprobs, c.token_ids)
    assert all(abs(lp - top[0][1]) < 1e-6 for lp, top in zip(lps, tops))
    assert all(d[t].rank == 1 for t, d in zip(c.token_ids, c.logprobs))
    llm.engine.check_integrity()


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=2), "min_p"),
        (dict(seed="x"), "seed"),
        (dict(seed=2**63), "seed must be a 64-bit signed integer"),
        (dict(seed=-(2**63) - 1), "seed must be a 64-bit signed integer"),
        (dict(logprobs=99), "logprobs"),
        (dict(logprobs_mode="sglang"), "logprobs_mode must be one of raw, processed, got 'sg"),
        (dict(stop=[""]), "stop"),
        (dict(stop=5), "stop must be a string or a list of strings, got 5"),
        (dict(stop_token_ids=5), "stop_token_ids must be a list of token ids, got 5"),
        (dict(ignore_eos="no"), "ignore_eos must be True or False, got 'no'"),
        (dict(include_stop_str_in_output=1), "include_stop_str_in_output must be True or"),
        (dict(skip_special_tokens=None), "skip_special_tokens must be True or False"),
    ],
)
def test_invalid_sampling_params(kw, message):
    with pytest.raises(DsakvError, match=message):
        SamplingParams(**kw)


def test_bad_requests_and_engine_args(tiny):
    with pytest.raises(DsakvError, match="unknown engine argument"):
        LLM(tiny, bogus=1)
    with pytest.raises(DsakvError, match="page_size"):
        EngineConfig(model=tiny, page_size=0)
    llm = LLM(tiny, **EXACT, num_pages=4)
    # 4 pages of 16: a 64-token context, one position of it kept for the output
    with pytest.raises(DsakvError, match=r"100 tokens; at most 63 fit \(the context is 64"):
        llm.engine.add_request(list(range(100)), GREEDY)
    with pytest.raises(DsakvError, match="empty"):
        llm.engine.add_request([], GREEDY)
    with pytest.raises(DsakvError, match="vocabulary"):
        llm.engine.add_request([10**6], GREEDY)
    # the engine checks ids itself (int() took bytes as ids, True as 1, 2.7 as 2)
    for prompt, message in [
        (b"hi", "a prompt is text or a list of token ids, got b'hi'"),
        ([1, True], "token ids must be ints, got True"),
        ([1, 2.7], "token ids must be ints, got 2.7"),
    ]:
        with pytest.raises(DsakvError, match=message):
            llm.engine.add_request(prompt, GREEDY)
    assert not llm.engine.has_unfinished()
    with pytest.raises(DsakvError, match="a prompt is a string, a list of int token ids"):
        llm.generate([1.5], GREEDY)


def test_ctrl_c_takes_effect_between_steps_and_leaves_nothing_queued(tiny, monkeypatch):
    """SIGINT inside a step is raised after it (with several ranks, one between a step's
    collectives left rank 0 out of step with the others); the call's requests are aborted,
    so the next call runs alone and gets the same tokens."""
    import signal

    llm = LLM(tiny, **EXACT, num_pages=32)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = llm.generate([[5, 6, 7]], params)[0].token_ids
    step, steps = llm.engine.step, []

    def interrupted_step():
        signal.raise_signal(signal.SIGINT)  # lands mid-step
        steps.append(1)
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted_step)
    # Python's own handler, as in a terminal (a background job inherits SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[1, 2, 3], [5, 6, 7]], params)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(steps) == 1 and not llm.engine.has_unfinished()  # the step ran out, then stop
    monkeypatch.undo()
    assert llm.generate([[5, 6, 7]], params)[0].token_ids == want
    llm.engine.check_integrity()


def test_generate_takes_vllm_prompt_dicts(tiny):
    """vLLM's TextPrompt and TokensPrompt, alone or in a list: the dict's text or ids run
    (a TokensPrompt used to run the text "prompt_token_ids")."""
    llm = LLM(tiny, **EXACT, num_pages=32)
    params = SamplingParams(max_tokens=2, temperature=0)
    (out,) = llm.generate({"prompt_token_ids": [104, 105]}, params)
    assert out.prompt_token_ids == [104, 105]
    text, ids = llm.generate([{"prompt": "hi"}, {"prompt_token_ids": (104, 105)}], params)
    assert text.prompt_token_ids == llm.generate("hi", params)[0].prompt_token_ids
    assert ids.token_ids == out.token_ids
    llm.engine.check_integrity()


def test_generate_takes_numpy_token_ids(small_llm):
    """As vLLM's TokensPrompt: a 1-D integer array, or a list of numpy ints, is token ids
    (Python's ints in the output); they were refused as "a prompt is ..., got np.int64(5)".
    Floats, bools and 2-D arrays are still refused, and nothing is queued."""
    params = SamplingParams(max_tokens=2, temperature=0)
    want = small_llm.generate([[104, 105, 106]], params)[0].token_ids
    for prompt in (
        np.array([104, 105, 106]),
        np.array([104, 105, 106], dtype=np.uint16),
        [np.int64(104), np.int32(105), 106],
        {"prompt_token_ids": np.array([104, 105, 106])},
    ):
        (out,) = small_llm.generate(prompt, params)
        assert out.token_ids == want and out.prompt_token_ids == [104, 105, 106]
        assert all(type(t) is int for t in out.prompt_token_ids)
    both = small_llm.generate([np.array([104, 105, 106]), np.array([7, 8])], params)
    assert len(both) == 2 and both[0].token_ids == want
    for prompt, message in (
        (np.array([1.0, 2.0]), "token-id array must be 1-D of integers, got 1-D of float64"),
        (np.array([True, False]), "1-D of integers, got 1-D of bool"),
        (np.array([[1, 2], [3, 4]]), "1-D of integers, got 2-D of int64"),
        ([np.True_, np.int64(1)], "token ids must be ints, got (np.)?True"),
        ([[1, np.float64(2)]], r"token ids must be ints, got (np.float64\()?2.0"),
    ):
        with pytest.raises(DsakvError, match=message):
            small_llm.generate(prompt, params)
        assert not small_llm.engine.has_unfinished()
    small_llm.engine.check_integrity()


def test_request_outputs_have_vllms_request_id_and_finished(small_llm):
    """vLLM's `RequestOutput.request_id` (a string) and `finished`: one id per prompt, the
    engine's id of its first choice, never reused; every output of generate and chat is
    finished."""
    params = SamplingParams(max_tokens=2, temperature=0, n=2)
    outs = small_llm.generate(["hi", [5, 6]], params)
    outs += small_llm.generate([[5, 6]], params)
    outs += small_llm.chat([{"role": "user", "content": "hi"}], params)
    ids = [o.request_id for o in outs]
    assert all(isinstance(i, str) and i.isdigit() for i in ids) and len(set(ids)) == 4
    assert all(o.finished for o in outs)


def test_get_tokenizer_is_the_models_or_says_there_is_none(small_llm, tiny, tmp_path):
    """vLLM's `LLM.get_tokenizer()`; a model without a tokenizer is an error naming it
    rather than a None to fail later (`LLM.tokenizer` is None there, to check first)."""
    tok = small_llm.get_tokenizer()
    assert tok is small_llm.tokenizer and tok.decode(tok.encode("hi", add_special_tokens=False))
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).symlink_to(Path(tiny) / name)
    llm = LLM(str(bare), **EXACT, num_pages=8)
    assert llm.tokenizer is None
    with pytest.raises(DsakvError, match="bare has no tokenizer; give prompts as token ids"):
        llm.get_tokenizer()


def test_generate_shows_a_progress_bar_by_default_as_vllm(small_llm, capsys):
    """vLLM's `use_tqdm=True` default: a bar on stderr (and nothing on stdout), off with
    use_tqdm=False; chat passes it on."""
    params = SamplingParams(max_tokens=2, temperature=0)
    small_llm.generate([[5, 6], [7, 8]], params)
    out, err = capsys.readouterr()
    assert out == "" and "generate" in err and "2/2" in err
    small_llm.chat([{"role": "user", "content": "hi"}], params)
    assert "1/1" in capsys.readouterr().err
    small_llm.generate([[5, 6]], params, use_tqdm=False)
    small_llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize(
    ("prompts", "params", "message"),
    [
        (b"hi", GREEDY, r"prompts must be a prompt \(a string.*got b'hi'"),
        (None, GREEDY, "prompts must be a prompt .*got None"),
        (5, GREEDY, "prompts must be a prompt .*got 5"),
        ([True, False, True], GREEDY, "token ids must be ints, got True"),
        ([[1, 2.0]], GREEDY, "token ids must be ints, got 2.0"),
        ([b"hi"], GREEDY, "a prompt is a string, .*got b'hi'"),
        ({"prompt_ids": [1]}, GREEDY, r"one key, 'prompt' .*got keys \['prompt_ids'\]"),
        ({"prompt": "a", "prompt_token_ids": [1]}, GREEDY, "a prompt dict has one key"),
        ({"prompt": [1, 2]}, GREEDY, "'prompt' must be a string"),
        ({"prompt_token_ids": "hi"}, GREEDY, "'prompt_token_ids' must be a list of ints"),
        ("hi", {"max_tokens": 2}, r"params must be a SamplingParams .*SamplingParams\(\*\*"),
        ("hi", [GREEDY, None], "params must be a SamplingParams or a list of them"),
        (["a", "b"], [GREEDY], "2 prompts but 1 sampling params"),
    ],
)
def test_generate_refuses_what_it_would_misread(small_llm, prompts, params, message):
    """Each a DsakvError saying what is wrong, and nothing queued: bytes and bools used to
    run as token ids, None and a dict of params to fail inside Python's own errors."""
    with pytest.raises(DsakvError, match=message):
        small_llm.generate(prompts, params)
    assert not small_llm.engine.has_unfinished()


def test_generate_reads_an_iterable_of_prompts_once(small_llm):
    """A generator of prompts (vLLM takes any iterable) gives one output each; reading it
    twice (the prompts, then their salts) gave none."""
    want = small_llm.generate([[5, 6], {"prompt_token_ids": [7, 8]}], GREEDY, use_tqdm=False)
    got = small_llm.generate(
        (p for p in ([5, 6], {"prompt_token_ids": [7, 8], "cache_salt": "s"})),
        GREEDY,
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_llm_takes_what_the_commands_take_as_model(tmp_path):
    """A tiny preset's name (its cached directory, as `dsakv generate glm-tiny` runs it);
    anything else that is no model directory is one error saying so (it was "no model
    config at ...")."""
    from dsakv.models.tiny import default_model_dir

    params = SamplingParams(max_tokens=3, temperature=0)
    by_name = LLM("glm-tiny", **EXACT, num_pages=8).generate("hi", params)[0]
    by_dir = LLM(str(default_model_dir("glm-tiny")), **EXACT, num_pages=8).generate("hi", params)
    assert by_name.token_ids == by_dir[0].token_ids
    for model, message in (
        (str(tmp_path), "is not a model directory .*nor a tiny preset"),
        (None, "model must be a model directory, a tiny preset's name or an EngineConfig"),
    ):
        with pytest.raises(DsakvError, match=message):
            LLM(model)


def test_n_choices_per_prompt_come_back_in_vllms_shape(tiny):
    """`SamplingParams(n=3)` (vLLM's): each prompt's choices in `outputs`, seeded choice i
    from seed + i (as `Engine.add_requests` and the server's n make them), the prompt's
    pages shared; `n` was an unknown keyword."""
    llm = LLM(tiny, **EXACT, num_pages=32)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=3, logprobs=0)
    prompts = ["hello there", [104, 105, 106]]
    outs = llm.generate(prompts, params)
    assert [len(o.outputs) for o in outs] == [3, 3]
    for prompt, out in zip(prompts, outs):
        for i, choice in enumerate(out.outputs):
            alone = llm.generate(prompt, dataclasses.replace(params, n=1, seed=7 + i))[0]
            assert (choice.index, choice.token_ids, choice.text) == (i, alone.token_ids, alone.text)
            c = alone.outputs[0]
            assert choice.cumulative_logprob == pytest.approx(
                sum(flat_logprobs(c.logprobs, c.token_ids))
            )
        assert out.token_ids == out.outputs[0].token_ids and out.text == out.outputs[0].text
        assert out.metrics["output_tokens"] == 18
    assert outs[1].prompt_token_ids == [104, 105, 106]
    with pytest.raises(DsakvError, match="n must be an integer >= 1"):
        SamplingParams(n=0)
    llm.engine.check_integrity()


def test_chat_completes_each_conversation_as_its_chat_template_renders_it(small_llm):
    """vLLM's `LLM.chat`: one conversation or a list of them, each the prompt transformers'
    own `apply_chat_template` makes (with the generation prompt, or continuing the last
    assistant message), completed as `generate` completes that text."""
    tok = small_llm.tokenizer
    asked = [{"role": "user", "content": "Name a colour."}]
    begun = [*asked, {"role": "assistant", "content": "Sure: bl"}]
    (one,) = small_llm.chat(asked, GREEDY)
    assert (
        one.prompt_token_ids
        == tok.apply_chat_template(asked, add_generation_prompt=True)["input_ids"]
    )
    text = tok.apply_chat_template(asked, add_generation_prompt=True, tokenize=False)
    assert one.token_ids == small_llm.generate(text, GREEDY)[0].token_ids
    other = [{"role": "user", "content": "Count to three."}]
    again, two = small_llm.chat([asked, other], GREEDY)  # in order
    assert again.token_ids == one.token_ids and two.prompt_token_ids != one.prompt_token_ids
    (cont,) = small_llm.chat(
        begun, GREEDY, add_generation_prompt=False, continue_final_message=True
    )
    assert tok.decode(cont.prompt_token_ids).endswith("Sure: bl")
    for messages, kw, message in (
        (asked, {"continue_final_message": True}, "needs add_generation_prompt=False"),
        ("hi", {}, "messages must be a conversation"),
        ([asked, []], {}, "messages must be a conversation"),
    ):
        with pytest.raises(DsakvError, match=message):
            small_llm.chat(messages, GREEDY, **kw)
    assert not small_llm.engine.has_unfinished()


def test_chat_takes_openai_messages_as_the_server_does(small_llm):
    """Content parts (text joined by newlines, vLLM's) and tool calls whose arguments are
    JSON text, OpenAI's format: the repr of the parts went into the prompt, and the
    arguments failed in the template."""
    tok = small_llm.tokenizer
    parts = [{"role": "user", "content": [{"type": "text", "text": t} for t in ("A.", "B.")]}]
    (out,) = small_llm.chat(parts, GREEDY)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "A.\nB."}], add_generation_prompt=True, tokenize=False
    )
    assert out.prompt_token_ids == small_llm.generate(text, GREEDY)[0].prompt_token_ids
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    turns = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]
    as_dict = [
        turns[0],
        {**turns[1], "tool_calls": [{**call, "function": {"name": "f", "arguments": {"x": 1}}}]},
        turns[2],
    ]
    (a,), (b,) = small_llm.chat(turns, GREEDY), small_llm.chat(as_dict, GREEDY)
    assert a.prompt_token_ids == b.prompt_token_ids
    assert small_llm.generate("hi", GREEDY)[0].prompt == "hi"  # vLLM's RequestOutput.prompt
    assert small_llm.generate([[104, 105]], GREEDY)[0].prompt is None
    for bad, message in (
        ([{"role": "user", "content": [{"type": "image_url"}]}], "content part type 'image_url'"),
        ([{"role": "user", "content": "x"}, "hi"], r"messages\[1\] must be a message dict"),
        (
            [
                turns[0],
                {
                    **turns[1],
                    "tool_calls": [{**call, "function": {"name": "f", "arguments": "[1]"}}],
                },
            ],
            "must be a JSON object",
        ),
    ):
        with pytest.raises(DsakvError, match=message):
            small_llm.chat(bad, GREEDY)


def test_generate_and_chat_take_vllms_sampling_params_keyword(small_llm):
    """vLLM's code names it `sampling_params=` (a TypeError here); `params` still works, and
    both at once are refused rather than one silently winning."""
    asked = [{"role": "user", "content": "hi"}]
    want = small_llm.generate("hi", GREEDY)[0].token_ids
    assert small_llm.generate("hi", sampling_params=GREEDY)[0].token_ids == want
    assert small_llm.generate("hi", params=GREEDY)[0].token_ids == want
    chat = small_llm.chat(asked, GREEDY)[0].token_ids
    assert small_llm.chat(asked, sampling_params=GREEDY)[0].token_ids == chat
    for call in (small_llm.generate, small_llm.chat):
        with pytest.raises(DsakvError, match="give params or sampling_params"):
            call("hi" if call == small_llm.generate else asked, GREEDY, sampling_params=GREEDY)
    assert not small_llm.engine.has_unfinished()


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ({"role": "user", "content": 5}, r"messages\[1\]: content must be a string or a list"),
        ({"role": "user", "content": [{"type": "text", "text": 5}]}, r"messages\[1\]: a text"),
        ({"role": "assistant", "tool_calls": {"id": "1"}}, r"messages\[1\].tool_calls must be"),
        ({"role": "assistant", "tool_calls": ["call"]}, r"messages\[1\].tool_calls\[0\] must"),
        (
            {"role": "assistant", "tool_calls": [{"function": "f"}]},
            r"messages\[1\].tool_calls\[0\].function must be a dict",
        ),
    ],
)
def test_malformed_chat_messages_name_the_message(small_llm, message, error):
    """Each one DsakvError naming the message, as the other malformed ones are (a TypeError
    or AttributeError from inside the rendering)."""
    with pytest.raises(DsakvError, match=error):
        small_llm.chat([{"role": "user", "content": "go"}, message], GREEDY)


def test_a_broken_tokenizer_fails_before_the_weights_load(tiny, tmp_path):
    """The tokenizer is loaded first: a broken one is refused in a second, not after a
    checkpoint's load (nor after the L3 tier started its threads and master)."""
    path = shutil.copytree(tiny, tmp_path / "bad")
    (path / "tokenizer.json").write_text("{bad")
    (path / "model.safetensors").write_text("garbage")
    with pytest.raises(DsakvError, match="tokenizer.json"):
        LLM(str(path), **EXACT, num_pages=8)


def test_llm_of_an_engine_config_checks_its_keywords(tiny):
    """`LLM(EngineConfig(...), **kw)` refuses an unknown keyword as `LLM(model, **kw)` does
    (it was dataclasses.replace's TypeError), and applies the known ones."""
    config = EngineConfig(model=tiny, **EXACT, num_pages=8)
    with pytest.raises(DsakvError, match="unknown engine argument.*: bogus"):
        LLM(config, bogus=1)
    assert LLM(config, num_pages=6).engine.allocator.num_pages == 6


def test_an_address_of_the_wrong_type_names_its_flag(tiny):
    with pytest.raises(DsakvError, match="--dist-init-addr must be HOST:PORT .*got 5"):
        EngineConfig(model=tiny, dist_init_addr=5)


def test_a_request_id_in_use_is_refused(small_llm):
    """vLLM refuses a duplicate request id: the second replaced the first in
    `Engine.requests`, and aborting it then broke every later step (KeyError)."""
    e = small_llm.engine
    e.add_request([1, 2, 3], GREEDY, rid=10**9)
    with pytest.raises(DsakvError, match="request id 1000000000 is already in use"):
        e.add_request([4, 5, 6], GREEDY, rid=10**9)
    e.step()
    e.abort(10**9)
    assert not e.has_unfinished()
    assert len(small_llm.generate([[7, 8]], GREEDY)[0].token_ids) == GREEDY.max_tokens
    e.check_integrity()


def test_stop_strings_need_a_tokenizer(tiny, tmp_path):
    """As bad_words and grammars: stop strings are matched in the output's text, which a
    model without a tokenizer has none of (they were accepted and never applied)."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).symlink_to(Path(tiny) / name)
    llm = LLM(str(bare), **EXACT, num_pages=8)
    with pytest.raises(DsakvError, match="stop needs a tokenizer"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, stop=["a"]))
    assert not llm.engine.has_unfinished()
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))[0].token_ids) == 4


@pytest.fixture(scope="module")
def small_llm(tiny):
    """One engine for many cases that refuse before anything runs."""
    return LLM(tiny, **EXACT, num_pages=8)


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_pages=2.5),
        dict(num_pages="4"),
        dict(num_pages=True),
        dict(kv_budget_gib="1"),
        dict(kv_budget_gib=float("inf")),
        dict(host_pool_gib=float("nan")),
        dict(max_model_len=0),
        dict(max_model_len="10"),
        dict(seed="x"),
        dict(device=None),
        dict(enable_hisparse="yes"),
        dict(enable_deterministic_inference="x"),
        dict(enable_prefix_cache=0),
        dict(tokenizer=7),  # (a TypeError from Path)
    ],
)
def test_engine_args_of_the_wrong_type_or_range(tiny, kw):
    """Each a DsakvError naming the argument, not a torch error later or a silent default
    (max_model_len 0 read as unset, a NaN host pool turning the tier off)."""
    with pytest.raises(DsakvError, match=next(iter(kw))):
        EngineConfig(model=tiny, **kw)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(num_pages=8, kv_budget_gib=0.5), "--kv-budget-gib and --num-pages"),
        (dict(speculative_num_steps=2), "--speculative-num-steps needs"),
        (dict(hicache_write_policy="write_back"), "--hicache-write-policy needs"),
        (dict(hicache_storage_prefetch_timeout=1.0), "--hicache-storage-prefetch-timeout needs"),
    ],
)
def test_settings_that_act_only_beside_another_are_refused_alone(tiny, kw, message):
    """num_pages silently won over kv_budget_gib, and the others did nothing; refused in the
    config, so `LLM(...)` and `bench --serving --engine-arg` refuse them as the flags do."""
    with pytest.raises(DsakvError, match=message):
        EngineConfig(model=tiny, **kw).storage  # noqa: B018 - the L3 settings' check


def test_every_bool_engine_arg_must_be_a_bool(tiny):
    """A truthy string such as "no" used to switch the feature on."""
    names = [f.name for f in fields(EngineConfig) if f.type in ("bool", "bool | None")]
    assert {"enable_hisparse", "enable_deterministic_inference", "dp_attention"} <= set(names)
    for name in names:
        with pytest.raises(DsakvError, match=f"{name} must be True(,| or) False"):
            EngineConfig(model=tiny, **{name: "no"})


def test_a_bad_prompt_queues_none_of_its_call(tiny):
    """generate() with a bad prompt after good ones raises, and leaves none of them queued
    (they used to run, unseen, inside the next call)."""
    llm = LLM(tiny, **EXACT, num_pages=32)
    with pytest.raises(DsakvError, match="empty"):
        llm.generate([[1, 2, 3], [4, 5, 6], []], GREEDY)
    assert not llm.engine.has_unfinished()
    (out,) = llm.generate([[9, 9, 9]], SamplingParams(max_tokens=3, temperature=0))
    assert len(out.token_ids) == 3
    assert llm.engine.counters()["finished_requests"] == 1
    llm.engine.check_integrity()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_idle_integrity_after_random_workload(tiny_engine, data):
    """Random arrivals, lengths, shared prefixes and aborts; idle ⇒ free + cached == total."""
    engine = tiny_engine
    prefix = data.draw(st.lists(st.integers(0, 255), min_size=16, max_size=40))
    live = []
    for _ in range(data.draw(st.integers(1, 25))):
        action = data.draw(st.sampled_from(["add", "add", "step", "step", "abort"]))
        if action == "add":
            tail = data.draw(st.lists(st.integers(0, 255), min_size=1, max_size=30))
            use_prefix = data.draw(st.booleans())
            params = SamplingParams(
                max_tokens=data.draw(st.integers(1, 12)), temperature=0, ignore_eos=True
            )
            live.append(engine.add_request((prefix if use_prefix else []) + tail, params))
        elif action == "step":
            engine.step()
        elif live:
            engine.abort(data.draw(st.sampled_from(live)).rid)
        engine.allocator.check()
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()
    assert engine.counters()["pages_used"] == engine.cache.num_device_pages


@pytest.fixture(scope="module")
def tiny_engine(tiny):
    return Engine(
        EngineConfig(model=tiny, **EXACT, num_pages=10, host_pool_gib=0.02, chunked_prefill_size=24)
    )


def test_running_request_shares_its_prefix(tiny):
    """A request that arrives while another with the same prefix still decodes hits its pages."""
    engine = Engine(EngineConfig(model=tiny, **EXACT, num_pages=32))
    shared = _prompts(1, seed=21, lo=48, hi=48)[0]
    first = engine.add_request(shared + [1], GREEDY)
    while not first.output_ids:
        engine.step()
    second = engine.add_request(shared + [2], GREEDY)
    engine.step()
    assert not first.finished
    assert second.metrics.prefix_hit_tokens == 48
    assert second.prefix_nodes[:3] == first.prefix_nodes[:3]
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()
    alone, _ = _run(tiny, [shared + [2]], enable_prefix_cache=False)
    assert second.output_ids == alone[0]


def test_logprobs_are_kept_only_for_requests_that_asked(tiny):
    """A batch-mate asking for logprobs filled every request's lists (held to the end)."""
    llm = LLM(tiny, **EXACT, num_pages=32)
    e = llm.engine
    plain = e.add_request([1, 2, 3, 4], SamplingParams(max_tokens=4, temperature=0))
    asked = e.add_request([5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0, logprobs=2))
    while e.has_unfinished():
        e.step()
    assert plain.logprobs == [] and plain.top_logprobs == []
    assert len(asked.logprobs) == len(asked.output_ids) and len(asked.top_logprobs[0]) == 2


def test_processed_logprobs_are_the_same_through_mtp_verification():
    """logprobs_mode="processed" (SGLang's): a verified draft's logprob is of its own
    position's penalized, tempered row, as when each token is sampled alone (seeded, the
    tokens are the same too); raw ones are not."""
    from dsakv.models.tiny import default_model_dir

    model = str(default_model_dir("glm-tiny"))  # (cached, its MTP layer fitted)
    # (top_k 2: drafts are often kept; the logprobs are of the whole tempered row still)
    common = dict(max_tokens=40, temperature=0.5, top_k=2, seed=3, ignore_eos=True, logprobs=2)
    penalties = dict(presence_penalty=0.2, frequency_penalty=0.1, repetition_penalty=1.1)
    params = SamplingParams(**common, **penalties, logprobs_mode="processed")
    prompts = _prompts(4, lo=8, hi=70)
    prompts.append(prompts[0])  # (its raw logprobs)
    runs = []
    for kw in ({}, {"speculative_algorithm": "mtp", "speculative_num_steps": 3}):
        llm = LLM(model, **EXACT, num_pages=64, **kw)
        runs.append(
            llm.generate(prompts, [*[params] * 4, dataclasses.replace(params, logprobs_mode="raw")])
        )
        llm.engine.check_integrity()
    assert llm.engine.counters()["spec_accepted_tokens"] > 0
    for a, b in zip(*runs):
        assert a.token_ids == b.token_ids
        a, b = a.outputs[0], b.outputs[0]
        lps = [flat_logprobs(c.logprobs, c.token_ids) for c in (a, b)]
        assert lps[0] == pytest.approx(lps[1], abs=1e-4)
        tops = [flat_logprobs(c.logprobs, c.token_ids, k=2) for c in (a, b)]
        assert [[t for t, _ in top] for top in tops[0]] == [[t for t, _ in top] for top in tops[1]]
    processed, raw = (c.outputs[0] for c in (runs[0][0], runs[0][4]))
    assert processed.token_ids == raw.token_ids  # (the mode changes no sample)
    assert flat_logprobs(processed.logprobs, processed.token_ids) != pytest.approx(
        flat_logprobs(raw.logprobs, raw.token_ids), abs=1e-2
    )


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc\ufffd", max_size=12),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=3), min_size=1, max_size=4),
    floor=st.integers(0, 12),
)
def test_find_stop_is_the_first_stop_ending_past_the_floor(text, stops, floor):
    """Searched by last character (`SamplingParams.stops_by_last`), the answer is the
    definition's: of every occurrence ending past `floor`, the first to start."""
    floor = min(floor, len(text))
    hits = [
        (i, s)
        for s in stops
        for i in range(len(text) - len(s) + 1)
        if text[i : i + len(s)] == s and i + len(s) > floor
    ]
    want = min(((min(i for i, t in hits if t == s), s) for s in {s for _, s in hits}), default=None)
    assert find_stop(text, SamplingParams(stop=stops).stops_by_last, floor) == want


def test_a_gpu_device_always_carries_its_index(monkeypatch):
    """`--device cuda` (or auto) resolved to an index-less `cuda`, while every tensor says
    `cuda:0`: tables kept per device were built twice. And `cuda:N` past the machine's GPUs
    was taken, to fail later in a kernel."""
    import torch

    from dsakv.engine.config import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(DsakvError, match="has 2 GPU"):
        resolve_device("cuda:2")
    assert resolve_device("cpu") == torch.device("cpu")


def test_max_tokens_none_runs_to_the_contexts_end(tiny):
    """vLLM's `max_tokens=None`: as many tokens as the context leaves (resolved per request,
    n's forks included), with `min_tokens` checked against that; it was refused."""
    llm = LLM(tiny, **EXACT, num_pages=16, max_model_len=64)
    params = SamplingParams(max_tokens=None, min_tokens=5, temperature=0, ignore_eos=True, n=2)
    (out,) = llm.generate([[104, 105, 106]], params)
    assert [len(c.token_ids) for c in out.outputs] == [61, 61]
    assert {c.finish_reason for c in out.outputs} == {"length"}
    llm.engine.check_integrity()


def test_num_cached_tokens_is_the_first_choices_prefix_hit(tiny):
    """vLLM's `RequestOutput.num_cached_tokens`: the prompt tokens the prefix cache held."""
    llm = LLM(tiny, **EXACT, num_pages=32)
    prompt, params = _prompts(1, seed=3, lo=40, hi=40)[0], SamplingParams(max_tokens=2, n=2)
    (first,) = llm.generate([prompt], params)
    (again,) = llm.generate([prompt], params)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32  # (2 full pages)
    assert again.metrics["prefix_hit_tokens"] == 64  # (summed over the choices)


def test_n_choices_count_as_requests_from_the_start(tiny):
    """The gauges count each of n's choices from the start, as vLLM's and SGLang's queue n
    requests (the prompt-token counter already did): the forks that wait for the first
    choice's prefill are waiting requests (they were in neither gauge)."""
    llm = LLM(tiny, **EXACT, num_pages=64, chunked_prefill_size=16)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, n=4)
    llm.engine.add_requests(_prompts(1, seed=5, lo=80, hi=80)[0], params)
    seen = []
    while llm.engine.has_unfinished():
        c = llm.engine.counters()
        live = sum(not r.finished for r in llm.engine.requests.values())
        seen.append((c["running_requests"], c["waiting_requests"], live))
        llm.engine.step()
    assert seen[0] == (0, 4, 4) and seen[1] == (1, 3, 4), seen  # (prefilled in 16-token chunks)
    assert all(running + waiting == live for running, waiting, live in seen), seen
    c = llm.engine.counters()
    assert (c["running_requests"], c["waiting_requests"]) == (0, 0)
    reqs = llm.engine.add_requests(_prompts(1, seed=6, lo=80, hi=80)[0], params)
    llm.engine.abort(reqs[2].rid)  # (a fork aborted before it left its first choice)
    assert llm.engine.counters()["waiting_requests"] == 3
    while llm.engine.has_unfinished():
        llm.engine.step()
    llm.engine.check_integrity()


def test_logprobs_come_in_vllms_shape(tiny):
    """vLLM's: per output token a dict of the token and its top-k, each a `Logprob` with
    its rank among the vocabulary and its text; prompt logprobs likewise, None first."""
    llm = LLM(tiny, **EXACT, num_pages=32)
    prompt = llm.tokenizer.encode("a plain prompt", add_special_tokens=False)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=1, logprobs=2, prompt_logprobs=1)
    (out,) = llm.generate([prompt], params)
    (c,) = out.outputs
    assert len(c.logprobs) == len(c.token_ids) == 6 and c.finished()
    for t, d in zip(c.token_ids, c.logprobs):
        assert next(iter(d)) == t and all(isinstance(x, Logprob) for x in d.values())
        others = sorted((x for u, x in d.items() if u != t), key=lambda x: x.rank)
        assert len(d) in (2, 3) and [x.rank for x in others][:1] in ([1], [2])
        assert d[t].rank == 1 + sum(x.logprob > d[t].logprob for x in d.values()) or d[t].rank > 2
    assert "".join(d[t].decoded_token for t, d in zip(c.token_ids, c.logprobs)) == c.text
    assert c.cumulative_logprob == pytest.approx(
        sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs))
    )
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for t, d in zip(prompt[1:], out.prompt_logprobs[1:]):
        assert d[t].rank >= 1 and d[t].decoded_token == llm.tokenizer.decode([t])
    # Ranks (one more copy per step) only for requests that asked
    e = llm.engine
    plain, asked = (
        e.add_request([1, 2, 3], SamplingParams(max_tokens=3, logprobs=k)) for k in (None, 0)
    )
    while e.has_unfinished():
        e.step()
    assert plain.ranks == [] and len(asked.ranks) == 3
    (none,) = llm.generate([prompt], SamplingParams(max_tokens=2))
    assert none.outputs[0].logprobs is none.outputs[0].cumulative_logprob is None
    assert none.prompt_logprobs is None


def test_chat_template_kwargs_may_set_the_named_arguments(small_llm):
    """vLLM's `LLM.chat` merges chat_template_kwargs over its own arguments (it raised
    "multiple values"), the continue_final_message check on the merged values."""
    asked = [{"role": "user", "content": "Hi"}]
    (plain,) = small_llm.chat(asked, GREEDY, add_generation_prompt=False)
    (kw,) = small_llm.chat(asked, GREEDY, chat_template_kwargs={"add_generation_prompt": False})
    assert kw.prompt == plain.prompt
    (raw,) = small_llm.chat(asked, GREEDY, chat_template_kwargs={"chat_template": "{{ 'X' }}"})
    assert raw.prompt == "X"
    with pytest.raises(DsakvError, match="needs add_generation_prompt=False"):
        small_llm.chat(asked, GREEDY, chat_template_kwargs={"continue_final_message": True})


def test_sampling_params_take_vllms_spellings():
    """seed -1 is unseeded, logprobs True is 1, clone() a copy (vLLM's)."""
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2
    assert SamplingParams(logprobs=True).logprobs == 1
    sp = SamplingParams(max_tokens=3, stop=["x"])
    assert sp.clone() == sp
    with pytest.raises(DsakvError, match="bad_words must be strings with more than whitespace"):
        SamplingParams(bad_words=[" "])


def test_unseeded_minus_one_samples_anew_each_call(small_llm):
    sp = SamplingParams(seed=-1, max_tokens=8, temperature=1.0)
    outs = [small_llm.generate([[104, 105]], sp)[0].token_ids for _ in range(3)]
    assert not outs[0] == outs[1] == outs[2]


def test_bad_words_ban_the_word_without_its_leading_space(small_llm):
    """vLLM's: " ab" bans "ab" (its token sequences are of the word lstripped)."""
    from dsakv.engine.sampling import bad_word_ids

    tok = small_llm.tokenizer
    assert bad_word_ids(tok, [" ab"]) == bad_word_ids(tok, ["ab"])
    sp = SamplingParams(
        max_tokens=16, temperature=1.0, seed=0, n=4, allowed_token_ids=[97, 98], bad_words=[" ab"]
    )
    (out,) = small_llm.generate("Hi", sp)
    assert not any("ab" in c.text for c in out.outputs)


def test_allowed_token_ids_hold_where_bans_would_empty_them(small_llm):
    """`allowed_token_ids` were applied after min_tokens' and bad_words' bans: where those
    banned every allowed id, the mask gave way and the whole vocabulary was open (tokens the
    client ruled out, no error). The bans give way instead, as they do to a grammar; bad
    words that ban every allowed token are refused."""
    eos = small_llm.engine.eos_token_ids[0]
    for allowed, extra in (
        ([eos], {"min_tokens": 3}),
        ([65, 66], {"stop_token_ids": [65, 66], "min_tokens": 3}),
        ([65, 66], {"bad_words": ["AB"], "seed": 1, "temperature": 1.0}),
    ):
        params = {"max_tokens": 6, "temperature": 0.0, "allowed_token_ids": allowed, **extra}
        (out,) = small_llm.generate("Hi", SamplingParams(**params))
        assert out.token_ids and set(out.token_ids) <= set(allowed), (allowed, extra)
    with pytest.raises(DsakvError, match="bad_words ban every token allowed_token_ids allows"):
        small_llm.generate("Hi", SamplingParams(allowed_token_ids=[65], bad_words=["A"]))


def test_detokenize_false_gives_token_ids_alone(small_llm):
    """vLLM's `detokenize=False` (an RL rollout's: ids only) and
    `spaces_between_special_tokens` were a TypeError here. The tokens are those of a
    detokenized run; the text and the logprobs' token texts are left out."""
    greedy = {"max_tokens": 8, "temperature": 0.0, "logprobs": 2, "ignore_eos": True}
    (want,) = small_llm.generate("Hello", SamplingParams(**greedy))
    sp = SamplingParams(**greedy, detokenize=False, spaces_between_special_tokens=False)
    (got,) = small_llm.generate("Hello", sp)
    c = got.outputs[0]
    assert c.token_ids == want.token_ids and want.text and c.text == ""
    assert flat_logprobs(c.logprobs, c.token_ids) == flat_logprobs(
        want.outputs[0].logprobs, want.token_ids
    )
    assert all(x.decoded_token is None for d in c.logprobs for x in d.values())
    with pytest.raises(DsakvError, match="detokenize=False"):
        small_llm.generate("Hello", SamplingParams(stop=["a"], detokenize=False))
    with pytest.raises(DsakvError, match="detokenize must be"):
        SamplingParams(detokenize="no")


# --- the integrity check the other tests use as their oracle ------------------------------


@pytest.fixture(scope="module")
def idle_engine(tiny) -> Engine:
    """Idle after one request: two prompt pages in the prefix cache, a host tier beside it."""
    llm = LLM(tiny, **EXACT, num_pages=32, host_pool_gib=0.01)
    llm.generate([_prompts(1, seed=9, lo=40, hi=40)[0]], GREEDY)
    assert llm.engine.cache.num_device_pages > 0
    return llm.engine


def _duplicate_free_page(e: Engine):
    e.allocator._free.append(e.allocator._free[-1])
    return e.allocator._free.pop


def _leak_device_page(e: Engine):
    pages = e.allocator.alloc(1)
    return lambda: e.allocator.free(pages)


def _leave_a_request_row(e: Engine):
    e.scheduler.req_to_token.extend(10**6, [0, 1])
    return lambda: e.scheduler.req_to_token.release(10**6)


def _leak_host_page(e: Engine):
    pages = e.host.allocator.alloc(1)
    return lambda: e.host.allocator.free(pages)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (_duplicate_free_page, "duplicate pages"),
        (_leak_device_page, "cached != 32 pages"),
        (_leave_a_request_row, "still maps request slots"),
        (_leak_host_page, "host pages used"),
    ],
    ids=["allocator", "leaked-page", "request-row", "host-page"],
)
def test_check_integrity_fails_on_each_invariant_it_checks(idle_engine, corrupt, message):
    """~70 tests take a passing `check_integrity` as proof that nothing leaked: it must
    raise on each kind of leak it claims to catch, and pass again once it is undone."""
    assert_integrity_catches(idle_engine, corrupt, message)


def test_check_integrity_fails_on_a_prefix_lock_left_behind(idle_engine):
    """A request's lock on cached pages outliving it pins them for good (never evictable):
    idle, no request holds a page, and so no cached page may be locked."""
    e = idle_engine
    prompt = _prompts(1, seed=9, lo=40, hi=40)[0]
    nodes = e.cache.match(prompt, 8)
    assert nodes
    e.cache.lock(nodes)
    try:
        with pytest.raises(AssertionError):
            e.check_integrity()
    finally:
        e.cache.unlock(nodes)
    e.check_integrity()
