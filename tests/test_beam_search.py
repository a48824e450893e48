"""vLLM's beam search (`LLM.beam_search`, the server's `use_beam_search`): token ids equal
transformers' beam search on the checkpoint it wrote (index_topk covering every context,
fp32 caches: the engine's logprobs are transformers'), scores are the engine's own
teacher-forced ones, and the HTTP routes answer what the offline call does."""

from __future__ import annotations

import copy
import json
import math
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from dsakv import LLM, BeamSearchParams, SamplingParams
from dsakv.engine import EngineConfig
from dsakv.engine.beam_search import beam_score
from dsakv.errors import DsakvError
from dsakv.models.tiny import TINY_PRESETS, hf_config, random_hf_model, write_tiny_model

from .conftest import flat_logprobs
from .serving import TIMEOUT, engine_stops_stepping_at, serving

EXACT = dict(
    kv_cache_dtype="fp32",
    index_k_dtype="fp32",
    device="cpu",
    page_size=16,
    num_pages=64,
    chunked_prefill_size=64,
)
PRESET = {**copy.deepcopy(TINY_PRESETS["glm-tiny"]), "index_topk": 256}
SEED = 0


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)  # (bytes: none is the pad id transformers would mask)
    return [[rng.randrange(0, 256) for _ in range(rng.randint(12, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """glm-tiny written by transformers (with its tokenizer), index_topk over every context."""
    return str(write_tiny_model(tmp_path_factory.mktemp("beam") / "m", PRESET, SEED, mtp="none"))


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir, **EXACT) as llm:
        yield llm


@pytest.fixture(scope="module")
def served(model_dir):
    with serving(EngineConfig(model=model_dir, **EXACT)) as served:
        yield served


def _output(seq, prompt: list[int]) -> list[int]:
    assert seq.tokens[: len(prompt)] == prompt
    return seq.tokens[len(prompt) :]


def _teacher_forced(llm: LLM, prompt: list[int], output: list[int]) -> list[float]:
    """The engine's logprob of each of `output`'s tokens after `prompt`, scored as a prompt."""
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0)
    (out,) = llm.generate([prompt + output], sp, use_tqdm=False)
    return flat_logprobs(out.prompt_logprobs, out.prompt_token_ids)[len(prompt) :]


# --- against transformers -----------------------------------------------------------------------


@pytest.mark.parametrize("width, steps, length_penalty", [(4, 16, 1.0), (3, 20, 0.0), (2, 12, 2.0)])
def test_token_ids_are_transformers_beam_search(llm, width, steps, length_penalty):
    """vLLM's test: transformers' `generate(num_beams=...)` finds the same sequences in the
    same order (no EOS: every sequence runs `steps` tokens, so transformers' length
    normalization, by output tokens, and vLLM's, by prompt and output, order them alike),
    and its sequence scores are the cumulative logprobs over that length."""
    hf = random_hf_model(hf_config(PRESET), seed=SEED)
    prompts = _prompts(2, seed=width)
    params = BeamSearchParams(width, steps, ignore_eos=True, length_penalty=length_penalty)
    outs = llm.beam_search(prompts, params)  # (both searched at once, step by step)
    for prompt, out in zip(prompts, outs):
        want = hf.generate(
            torch.tensor([prompt]),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            max_new_tokens=steps,
            length_penalty=length_penalty,
            eos_token_id=None,
            pad_token_id=PRESET["pad_token_id"],
            output_scores=True,
            return_dict_in_generate=True,
        )
        assert [_output(s, prompt) for s in out.sequences] == [
            s[len(prompt) :].tolist() for s in want.sequences
        ]
        scores = (want.sequences_scores * steps**length_penalty).tolist()
        assert [s.cum_logprob for s in out.sequences] == pytest.approx(scores, abs=1e-3)
        assert all(s.finish_reason == "length" and s.stop_reason is None for s in out.sequences)


def test_width_one_is_greedy(llm):
    prompts = _prompts(3, seed=7)
    greedy = llm.generate(
        prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False
    )
    outs = llm.beam_search(prompts, BeamSearchParams(1, 12, ignore_eos=True))
    for prompt, g, o in zip(prompts, greedy, outs):
        (seq,) = o.sequences
        assert _output(seq, prompt) == g.token_ids


# --- scores, stops, the prefix cache ------------------------------------------------------------


def test_scores_are_the_engines_logprobs_and_best_comes_first(llm):
    """Each sequence's cumulative logprob is the sum of its tokens' teacher-forced logprobs
    (the engine scoring prompt + sequence), each token's `Logprob` is its own, and the
    sequences come best first by vLLM's length-penalized score."""
    (prompt,) = _prompts(1, seed=11)
    width = 4
    (out,) = llm.beam_search([prompt], BeamSearchParams(width, 10, length_penalty=0.5))
    assert len(out.sequences) == width
    for seq in out.sequences:
        output = _output(seq, prompt)
        forced = _teacher_forced(llm, prompt, output)
        assert seq.cum_logprob == pytest.approx(sum(forced), abs=1e-4)
        assert flat_logprobs(seq.logprobs, output) == pytest.approx(forced, abs=1e-4)
        assert all(len(d) >= 2 * width for d in seq.logprobs)  # (the step's likeliest)
        assert seq.text.startswith(llm.tokenizer.decode(prompt))  # (vLLM's: prompt and output)
    scores = [beam_score(len(s.tokens), s.cum_logprob, 0.5) for s in out.sequences]
    assert scores == sorted(scores, reverse=True)


def test_a_stop_token_ends_a_beam_as_an_eos(llm):
    """A candidate that is a stop token (or EOS) is finished, not extended: with the
    likeliest first token as the stop, the one-token sequence is among the finished (its
    score is one step's logprob); its token is left out of `tokens` unless
    `include_stop_str_in_output`, but its logprob is in `cum_logprob` (vLLM's)."""
    (prompt,) = _prompts(1, seed=13)
    (first,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    stop = first.token_ids[0]
    for kept in (False, True):
        params = BeamSearchParams(
            3, 8, ignore_eos=True, stop_token_ids=[stop], include_stop_str_in_output=kept
        )
        (out,) = llm.beam_search([prompt], params)
        stopped = [s for s in out.sequences if s.finish_reason == "stop"]
        assert stopped and all(s.stop_reason == stop for s in stopped)
        for seq in out.sequences:
            output = _output(seq, prompt)
            ended = seq.finish_reason == "stop"
            assert stop not in output[: len(output) - (ended and kept)]
            scored = output if kept or not ended else output + [stop]
            assert seq.cum_logprob == pytest.approx(
                sum(_teacher_forced(llm, prompt, scored)), abs=1e-4
            )
        assert (prompt + [stop] if kept else prompt) in [s.tokens for s in stopped]


def test_a_stop_string_ends_a_beam_with_its_text_cut(llm):
    """dsakv's: `stop` strings end a beam where its text completes one, the text cut
    before it (kept with include_stop_str_in_output), every token kept."""
    (prompt,) = _prompts(1, seed=17)
    (free,) = llm.beam_search([prompt], BeamSearchParams(2, 10, ignore_eos=True))
    text = free.sequences[0].text[len(llm.tokenizer.decode(prompt)) :]
    stop = next(c for c in text[2:] if c != "\ufffd")
    for kept in (False, True):
        params = BeamSearchParams(
            2, 10, ignore_eos=True, stop=stop, include_stop_str_in_output=kept
        )
        (out,) = llm.beam_search([prompt], params)
        stopped = [s for s in out.sequences if s.finish_reason == "stop"]
        assert stopped
        for seq in stopped:
            assert seq.stop_reason == stop
            cut = seq.text[len(llm.tokenizer.decode(prompt)) :]
            assert cut.endswith(stop) if kept else stop not in cut


def test_each_step_reuses_the_beams_cached_pages(llm):
    """vLLM's way: each step's request for a beam has its whole sequence as the prompt, but
    the prefix cache serves it all but the last partial page, so a step computes at most a
    page per beam (without the cache, a 60-token prompt would be computed every step)."""
    prompt = _prompts(1, seed=19)[0] + list(range(40))  # several pages
    before = llm.engine.counters()
    width, steps = 3, 8
    llm.beam_search([prompt], BeamSearchParams(width, steps, ignore_eos=True))
    after = llm.engine.counters()
    computed = after["computed_tokens"] - before["computed_tokens"]
    assert after["finished_requests"] - before["finished_requests"] == 1 + (steps - 1) * width
    assert computed <= len(prompt) + (steps - 1) * width * EXACT["page_size"]
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] >= (steps - 1) * width * 32


def test_dp_attention_and_mtp_search_as_one_plain_engine(model_dir, llm):
    """Under DP attention a step's requests run on either rank (gloo on CPU); MTP drafts
    after the first token, which is all a step samples. Both find what one engine does."""
    prompts = _prompts(2, seed=23)
    params = BeamSearchParams(3, 8, ignore_eos=True)

    def found(outs):
        return [[(s.tokens, round(s.cum_logprob, 3)) for s in o.sequences] for o in outs]

    want = found(llm.beam_search(prompts, params))
    mtp_dir = write_tiny_model(f"{model_dir}-mtp", PRESET, SEED, mtp="random")
    mtp = dict(speculative_algorithm="mtp", speculative_num_steps=2)
    for path, kw in ((model_dir, dict(tp=2, dp_attention=True)), (mtp_dir, mtp)):
        with LLM(str(path), **{**EXACT, **kw}) as other:
            assert found(other.beam_search(prompts, params)) == want
            other.engine.check_integrity()


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, param",
    [
        (dict(beam_width=0), "beam_width"),
        (dict(beam_width=11), "beam_width"),
        (dict(beam_width=True), "beam_width"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(length_penalty=math.nan), "length_penalty"),
        (dict(temperature=-1.0), "temperature"),
        (dict(stop=5), "stop"),
    ],
)
def test_bad_params_name_their_field(kw, param):
    with pytest.raises(DsakvError) as e:
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kw})
    assert e.value.param == param


def test_the_offline_call_refuses_what_it_cannot_run(llm):
    with pytest.raises(DsakvError, match="BeamSearchParams") as e:
        llm.beam_search([[1, 2, 3]], SamplingParams(n=2))
    assert e.value.param == "params"
    with pytest.raises(DsakvError, match="stop_token_ids"):
        llm.beam_search([[1, 2, 3]], BeamSearchParams(2, 4, stop_token_ids=[10**6]))
    with pytest.raises(DsakvError, match="concurrency_limit"):
        llm.beam_search([[1, 2, 3]], BeamSearchParams(2, 4), concurrency_limit=0)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("length_penalty", [400.0, -400.0])
def test_a_length_penalty_past_a_floats_range_is_refused(llm, length_penalty):
    """The score divides by the length to the `length_penalty`: 30 ** 400 overflows a float
    (OverflowError) and 30 ** -400 is 0.0 (ZeroDivisionError), which failed the search
    after its first step; refused before it starts, naming the field."""
    with pytest.raises(DsakvError, match="length_penalty") as e:
        llm.beam_search([list(range(30))], BeamSearchParams(2, 4, length_penalty=length_penalty))
    assert e.value.param == "length_penalty"
    assert not llm.engine.has_unfinished()


# --- the server ---------------------------------------------------------------------------------


def _post(base: str, path: str, **body) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=TIMEOUT)


def test_completions_answer_n_beams_as_the_offline_call(served, llm):
    """`n` choices per prompt (index prompt * n + j), best first, the offline sequences'
    tokens and logprobs; streamed, each choice whole in one chunk."""
    base = served[0]
    prompts, width, steps = _prompts(2, seed=29), 3, 8
    want = llm.beam_search(prompts, BeamSearchParams(width, steps))
    body = dict(prompt=prompts, use_beam_search=True, n=width, max_tokens=steps, temperature=0)
    r = _post(base, "/v1/completions", **body, return_token_ids=True, logprobs=2)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(2 * width))
    for c in choices:
        prompt, seq = prompts[c["index"] // width], want[c["index"] // width]
        seq = seq.sequences[c["index"] % width]
        assert c["token_ids"] == _output(seq, prompt) and c["prompt_token_ids"] == prompt
        assert c["finish_reason"] == "length"
        lps = c["logprobs"]["token_logprobs"]
        assert lps == pytest.approx(flat_logprobs(seq.logprobs, c["token_ids"]), abs=1e-4)
        assert all(len(top) <= 3 for top in c["logprobs"]["top_logprobs"])
    assert r.json()["usage"]["completion_tokens"] == 2 * width * steps
    with httpx.stream(
        "POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT
    ) as s:
        texts = {}
        for line in s.iter_lines():
            if line.startswith("data: {"):
                (c,) = json.loads(line[6:])["choices"]
                assert c["index"] not in texts and c["finish_reason"] == "length"
                texts[c["index"]] = c["text"]
    assert [texts[c["index"]] for c in choices] == [c["text"] for c in choices]


def test_chat_answers_n_beams_as_the_offline_call(served, llm):
    base = served[0]
    messages = [{"role": "user", "content": "Name a colour."}]
    r = _post(
        base,
        "/v1/chat/completions",
        messages=messages,
        use_beam_search=True,
        n=2,
        max_tokens=6,
        temperature=0,
        length_penalty=0.0,
        return_token_ids=True,
    )
    assert r.status_code == 200, r.text
    out = r.json()
    prompt = out["prompt_token_ids"]
    (want,) = llm.beam_search([prompt], BeamSearchParams(2, 6, length_penalty=0.0))
    got = [c["token_ids"] for c in out["choices"]]
    assert got == [_output(s, prompt) for s in want.sequences]


def test_a_step_aborted_as_a_client_asks_ends_the_search_as_an_abort(served):
    """A step's request aborted as /abort_request aborts (`asked`: the output so far) comes
    back without a token: the search ends as an abort of all its outputs does, each choice
    aborted, not a 500."""
    base, async_engine = served
    body = dict(prompt=_prompts(1, seed=37)[0], use_beam_search=True, n=2, max_tokens=4)
    with ThreadPoolExecutor(1) as pool, engine_stops_stepping_at(async_engine, 0):
        answer = pool.submit(_post, base, "/v1/completions", **body, temperature=0)
        deadline = time.monotonic() + TIMEOUT
        while not async_engine._streams:  # (the first step's request, held before its token)
            assert time.monotonic() < deadline, "no step reached the engine"
            time.sleep(0.01)
        for stream in list(async_engine._streams.values()):
            async_engine.abort(stream, asked=True)
        r = answer.result(TIMEOUT)
    assert r.status_code == 200, r.text
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["abort", "abort"]


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("/v1/completions", dict(n=11), "n"),
        ("/v1/completions", dict(top_p=0.5), "top_p"),
        ("/v1/completions", dict(frequency_penalty=1.0), "frequency_penalty"),
        ("/v1/completions", dict(logit_bias={"5": 1.0}), "logit_bias"),
        ("/v1/completions", dict(min_tokens=2), "min_tokens"),
        ("/v1/completions", dict(response_format={"type": "json_object"}), "response_format"),
        ("/v1/completions", dict(echo=True, logprobs=1), "echo"),
        ("/v1/completions", dict(prompt_logprobs=1), "prompt_logprobs"),
        ("/v1/completions", dict(length_penalty=-400.0), "length_penalty"),
        (
            "/v1/chat/completions",
            dict(tools=[{"type": "function", "function": {"name": "f"}}]),
            "tools",
        ),  # fmt: skip
        ("/v1/chat/completions", dict(regex="a+"), "regex"),
    ],
)
def test_what_beam_search_does_not_run_is_a_400_naming_it(served, path, extra, param):
    body = dict(use_beam_search=True, max_tokens=4, temperature=0)
    if path == "/v1/completions":
        body["prompt"] = [1, 2, 3]
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    r = _post(served[0], path, **{**body, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_a_prefill_or_decode_server_refuses_beam_search(model_dir):
    """Each step is a request of its own, which no router paired with a prefill server: a
    400 saying so, before anything waits on a peer."""
    from dsakv.disagg.config import DisaggConfig
    from dsakv.disagg.serving import bridge_for
    from dsakv.procs import free_port

    config = EngineConfig(model=model_dir, **{**EXACT, "num_pages": 16})
    bridge = bridge_for(DisaggConfig("decode", bootstrap_port=free_port()), config, "127.0.0.1")
    with serving(config, bridge=bridge) as (base, _):
        body = dict(prompt=[1, 2, 3], use_beam_search=True, n=2, max_tokens=4)
        r = _post(base, "/v1/completions", **body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "use_beam_search" and "disaggregation" in error["message"]
