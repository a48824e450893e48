"""Logit processors a vLLM or OpenAI client expects: `logit_bias`, `min_tokens`, and the
repetition, frequency and presence penalties. Greedy tokens are checked against
transformers' own processors (`generate` with `sequence_bias`, `repetition_penalty`,
`min_new_tokens`) on the same checkpoint, and MTP must not change what they pick."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from dsakv import LLM, SamplingParams
from dsakv.engine.sampling import (
    allow,
    bad_word_ids,
    ban,
    banned_words_next,
    filtered_probs,
    penalize,
)
from dsakv.errors import DsakvError
from dsakv.models.tiny import TINY_PRESETS, default_model_dir, hf_config, random_hf_model

from .conftest import flat_logprobs

# fp32 caches, index_topk over the whole context: the engine's greedy tokens are
# transformers' (as in test_model_parity), so only the processors can make them differ.
EXACT = dict(
    kv_cache_dtype="fp32",
    index_k_dtype="fp32",
    device="cpu",
    page_size=16,
    num_pages=32,
    chunked_prefill_size=32,
)
PROMPT = [17, 3, 99, 3, 250, 41, 8, 17, 17, 200, 5, 64, 3, 77, 120, 9]
NEW = 24


# --- unit: one row ------------------------------------------------------------------------------


def test_penalize_matches_the_definitions():
    torch.manual_seed(0)
    row = torch.randn(50)
    prompt, output = [1, 2, 2, 7], [7, 7, 3, 9, 3, 7]
    p = SamplingParams(
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.3,
        logit_bias={4: 2.0, 7: -1.0},
    )
    want = row.clone()
    for t, b in p.logit_bias:
        want[t] += b
    for t in set(prompt + output):  # repetition: each seen token once, whatever its count
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    for t in set(output):
        want[t] -= 0.25 * output.count(t) + 0.5
    got = row.clone()
    penalize(got, p, prompt, output)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    untouched = [t for t in range(50) if t not in {1, 2, 3, 4, 7, 9}]
    assert torch.equal(got[untouched], row[untouched])
    assert not SamplingParams().penalized and p.penalized


@pytest.mark.parametrize(
    "probs, params, want",
    [
        # min_p before top-p (vLLM's order): min_p keeps .4 and .3, top_p .5 then the first
        ([0.4, 0.3, 0.1, 0.1, 0.1], dict(top_p=0.5, min_p=0.5), [1, 0, 0, 0, 0]),
        # top-p keeps the smallest prefix whose mass reaches it, exactly reached too
        ([0.5, 0.25, 0.25], dict(top_p=0.5), [1, 0, 0]),
        ([0.25] * 4, dict(top_p=0.5), [0.5, 0.5, 0, 0]),
        ([0.5, 0.25, 0.25], dict(top_p=0.75), [2 / 3, 1 / 3, 0]),
        ([0.5, 0.3, 0.2], dict(top_p=0.7), [0.5 / 0.8, 0.3 / 0.8, 0]),
        # top-k after min_p: of the two min_p keeps, top_k 3 changes nothing
        ([0.4, 0.3, 0.1, 0.1, 0.1], dict(top_k=3, min_p=0.5), [4 / 7, 3 / 7, 0, 0, 0]),
    ],
)
def test_filtered_probs_in_vllms_order(probs, params, want):
    got = filtered_probs(torch.tensor(probs).log(), SamplingParams(**params))
    torch.testing.assert_close(got, torch.tensor(want, dtype=got.dtype), rtol=0, atol=1e-6)


def test_ban_gives_way_when_nothing_else_is_left():
    row = torch.tensor([0.0, 1.0, 2.0])
    ban(row, [2])
    assert row.argmax() == 1 and row[2] == -torch.inf
    only = torch.tensor([-torch.inf, -torch.inf, 3.0])  # a grammar that allows only EOS
    ban(only, [2])
    assert only[2] == 3.0
    row = torch.tensor([0.0, 1.0, 2.0, 3.0])
    allow(row, [0, 1])
    assert row.tolist() == [0.0, 1.0, -torch.inf, -torch.inf]
    allow(only, [0])  # (the grammar's one token stays)
    assert only[2] == 3.0


def test_bad_words_ban_the_token_that_would_finish_one():
    """vLLM's rule: a one-token word is never picked; a longer one's last token is banned
    right after the rest of it was output."""
    words = [[7], [3, 4, 5]]
    assert banned_words_next(words, []) == [7]
    assert banned_words_next(words, [1, 3, 4]) == [7, 5]
    assert banned_words_next(words, [3, 4, 1]) == [7]
    assert banned_words_next([[3, 4]], [4]) == [] and banned_words_next([[3, 4]], [3]) == [4]


def test_top_k_zero_is_off_as_in_vllm():
    assert SamplingParams(top_k=0).top_k == -1 == SamplingParams().top_k


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("presence_penalty", dict(presence_penalty=2.5)),
        ("frequency_penalty", dict(frequency_penalty=float("nan"))),
        ("repetition_penalty", dict(repetition_penalty=0.0)),
        ("logit_bias", dict(logit_bias={3: 101.0})),
        ("logit_bias", dict(logit_bias={-1: 1.0})),
        ("logit_bias", dict(logit_bias=[(3, 1.0), (3, 2.0)])),
        ("logit_bias", dict(logit_bias="3")),
        ("min_tokens", dict(max_tokens=4, min_tokens=5)),
        ("min_tokens", dict(min_tokens=-1)),
        ("stop", dict(stop=5)),
        ("stop_token_ids", dict(stop_token_ids=5)),
        ("ignore_eos", dict(ignore_eos="no")),
        ("allowed_token_ids", dict(allowed_token_ids=[])),
        ("allowed_token_ids", dict(allowed_token_ids=[-1])),
        ("bad_words", dict(bad_words=[""])),
        ("bad_words", dict(bad_words=5)),
        ("truncate_prompt_tokens", dict(truncate_prompt_tokens=0)),
    ],
)
def test_bad_values_name_their_field(field, kwargs):
    with pytest.raises(DsakvError, match=field) as e:
        SamplingParams(**kwargs)
    assert e.value.param == field


def test_logit_bias_errors_say_whether_the_key_or_the_bias_is_wrong():
    """A JSON-style string key used to be reported as a bias out of range."""
    with pytest.raises(DsakvError, match="logit_bias keys must be int token ids"):
        SamplingParams(logit_bias={"1": 1.0})
    with pytest.raises(DsakvError, match=r"biases in \[-100, 100\]"):
        SamplingParams(logit_bias={1: 101.0})


# --- greedy tokens vs transformers --------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A glm-tiny written by transformers, with the transformers model that wrote it."""
    raw = copy.deepcopy(TINY_PRESETS["glm-tiny"])
    raw["index_topk"] = 256
    hf = random_hf_model(hf_config(raw), seed=3)
    path = tmp_path_factory.mktemp("penalties")
    hf.save_pretrained(str(path))
    with LLM(str(path), **EXACT) as llm:
        yield hf, llm


def _hf_greedy(hf, **processors) -> list[int]:
    out = hf.generate(
        torch.tensor([PROMPT]),
        max_new_tokens=NEW,
        do_sample=False,
        pad_token_id=0,
        **processors,
    )
    return out[0, len(PROMPT) :].tolist()


def _greedy(llm: LLM, **params) -> list[int]:
    sp = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, **params)
    return llm.generate([PROMPT], sp)[0].token_ids


def test_plain_greedy_is_transformers(checkpoint):
    hf, llm = checkpoint
    assert _greedy(llm) == _hf_greedy(hf, eos_token_id=None)


def test_repetition_penalty_and_logit_bias_match_transformers(checkpoint):
    hf, llm = checkpoint
    plain = _greedy(llm)
    boost, sink = 5, plain[0]  # a token to favour, and the plain first choice, pushed away
    got = _greedy(llm, repetition_penalty=1.8, logit_bias={boost: 4.0, sink: -100.0})
    want = _hf_greedy(
        hf,
        eos_token_id=None,
        repetition_penalty=1.8,
        sequence_bias=[[[boost], 4.0], [[sink], -100.0]],
    )
    assert got == want
    assert got != plain and sink not in got


def test_allowed_token_ids_match_transformers_prefix_constraint(checkpoint):
    """vLLM's allowed_token_ids: transformers' `prefix_allowed_tokens_fn` with a fixed set."""
    hf, llm = checkpoint
    allowed = [3, 8, 17, 41, 99, 250]
    got = _greedy(llm, allowed_token_ids=allowed)
    assert got == _hf_greedy(hf, eos_token_id=None, prefix_allowed_tokens_fn=lambda *_: allowed)
    assert set(got) <= set(allowed) and got != _greedy(llm)


def test_bad_words_are_never_output():
    """vLLM's bad_words: the words' token sequences never appear; before a word could end,
    nothing changes."""
    with LLM(str(default_model_dir("glm-tiny")), **EXACT) as llm:
        tok = llm.tokenizer
        plain = _greedy(llm)
        word = tok.decode(plain[2:4])
        seqs = bad_word_ids(tok, [word])
        assert plain[2:4] in seqs

        def first_end(out: list[int]) -> int | None:  # where a bad word would end first
            ends = [j for s in seqs for j in range(len(out)) if out[: j + 1][-len(s) :] == s]
            return min(ends, default=None)

        got = _greedy(llm, bad_words=[word])
        cut = first_end(plain)
        assert cut is not None and got[:cut] == plain[:cut] and got[cut] != plain[cut]
        assert first_end(got) is None


def test_min_tokens_bans_stop_tokens_as_transformers_does(checkpoint):
    hf, llm = checkpoint
    plain = _greedy(llm)
    stop = plain[2]  # without min_tokens the request would end at its third token
    assert _greedy(llm, stop_token_ids=(stop,))[-1] == stop
    got = _greedy(llm, stop_token_ids=(stop,), min_tokens=8)
    want = _hf_greedy(hf, eos_token_id=stop, min_new_tokens=8)
    if stop in want[8:]:  # transformers pads after EOS; dsakv ends there
        want = want[: want.index(stop, 8) + 1]
    assert got == want and len(got) >= 8 and stop not in got[:8]


def _hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    """transformers' log-softmax of its raw logits at each output position of
    `PROMPT + tokens`: row i scores output token i."""
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + tokens])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(PROMPT) - 1 : -1]


# Processed requests, each given the plain greedy tokens (to bias or ban those).
PROCESSED = {
    "plain": lambda plain: dict(temperature=0.0),
    "temperature": lambda plain: dict(temperature=0.5, seed=7, top_k=20),
    "penalties": lambda plain: dict(
        temperature=0.0, repetition_penalty=1.8, frequency_penalty=1.0, presence_penalty=1.0
    ),
    "logit_bias": lambda plain: dict(temperature=0.0, logit_bias={5: 4.0, plain[0]: -100.0}),
    "min_tokens": lambda plain: dict(temperature=0.0, min_tokens=8, stop_token_ids=set(plain)),
}


@pytest.mark.parametrize("name", PROCESSED)
def test_logprobs_are_the_models_raw_ones(checkpoint, name):
    """vLLM's default (`logprobs_mode` raw_logprobs): the reported logprobs are the model's,
    before logit_bias, penalties, min_tokens' bans and temperature (they had been of the
    penalized, biased and banned logits), so a processed request reports what a plain one
    does for the same tokens."""
    hf, llm = checkpoint
    params = PROCESSED[name](_greedy(llm)[:8])
    sp = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3, **params)
    (out,) = llm.generate([PROMPT], sp)
    want = _hf_logprobs(hf, out.token_ids)
    got = [want[i, t].item() for i, t in enumerate(out.token_ids)]
    (c,) = out.outputs
    assert flat_logprobs(c.logprobs, c.token_ids) == pytest.approx(got, abs=1e-4)
    for top, row in zip(flat_logprobs(c.logprobs, c.token_ids, k=3), want):
        values, ids = row.topk(3)
        assert [t for t, _ in top] == ids.tolist()
        assert [x for _, x in top] == pytest.approx(values.tolist(), abs=1e-4)


# --- MTP and the server ---------------------------------------------------------------------------


def test_mtp_keeps_the_processed_tokens():
    """Drafts come from the draft layer, which knows no penalties: verification must still
    emit exactly the tokens the processed target distribution gives, greedy and seeded,
    and report the same (raw) logprobs."""
    model = str(default_model_dir("glm-tiny"))
    exact = {**EXACT, "num_pages": 64, "max_running_requests": 8}
    prompts = [PROMPT, PROMPT[:9], [5, 6, 7, 8] * 5]
    params = [
        SamplingParams(
            max_tokens=20,
            temperature=0.0,
            ignore_eos=True,
            repetition_penalty=1.5,
            frequency_penalty=0.7,
            logit_bias={3: 3.0},
            min_tokens=10,
            stop_token_ids=(12,),
            logprobs=2,
        ),
        SamplingParams(max_tokens=20, temperature=0.8, seed=11, presence_penalty=1.5),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(
            max_tokens=20,
            temperature=0.0,
            ignore_eos=True,
            allowed_token_ids=[5, 6, 7, 8, 30, 31],
            bad_words=["ab"],
        ),
    ]
    prompts.append([5, 6, 7, 8] * 4)
    runs, logprobs = [], []
    for extra in ({}, {"speculative_algorithm": "mtp", "speculative_num_steps": 3}):
        with LLM(model, **exact, **extra) as llm:
            out = llm.generate(prompts, params)
            runs.append([o.token_ids for o in out])
            logprobs.append(flat_logprobs(out[0].outputs[0].logprobs, out[0].token_ids))
            if extra:
                assert llm.engine.stats.accepted_tokens > 0  # the drafts were checked
    assert runs[0] == runs[1]
    assert logprobs[1] == pytest.approx(logprobs[0], abs=1e-4)
    assert len(runs[0][0]) >= 10 and 12 not in runs[0][0][:10]


def test_min_tokens_ignores_stop_strings_before_it():
    with LLM(str(default_model_dir("glm-tiny")), **EXACT) as llm:
        tok = llm.tokenizer
        plain = _greedy(llm)[:12]
        text = [tok.decode(plain[:i]) for i in range(13)]
        stop = text[2][len(text[1]) :]  # the second token's text
        assert stop and _greedy_text(llm, stop=(stop,)).token_ids == plain[:2]
        got = _greedy_text(llm, stop=(stop,), min_tokens=6)
        # The first occurrence that ends past the first six tokens' text (vLLM's).
        cut = text[12].find(stop, len(text[6]) - len(stop) + 1)
        assert len(got.token_ids) >= 6 and got.token_ids == plain[: len(got.token_ids)]
        assert got.text == (text[12] if cut < 0 else text[12][:cut])


def test_a_stop_string_ending_in_the_min_tokens_th_token_is_ignored():
    """As vLLM (and as the EOS ban, which covers token `min_tokens` too): "hello" ends in
    token 5 of a byte-by-byte output, so under min_tokens 5 the next one stops it. It used
    to stop the first: five tokens, empty text."""
    forced = ("regex", "hello world, hello there")
    sp = SamplingParams(max_tokens=40, min_tokens=5, stop=["hello"], grammar=forced)
    with LLM(str(default_model_dir("glm-tiny")), **EXACT) as llm:
        out = llm.generate("x", sp)[0]
    assert (out.text, out.finish_reason, out.outputs[0].stop_reason) == (
        "hello world, ",
        "stop",
        "hello",
    )


def test_min_tokens_counts_a_stop_whose_character_ends_past_it(tmp_path):
    """A stop string that ends past `min_tokens` counts, though its character's first
    bytes came before: where the output is decoded whole each token (a tokenizer asking
    to clean up spaces), those bytes were a U+FFFD counted as seen."""
    path = shutil.copytree(default_model_dir("glm-tiny"), tmp_path / "m")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(
        json.dumps({**config, "clean_up_tokenization_spaces": True})
    )
    # "a中cd" byte by byte: 中's last byte is token 4, past min_tokens 3
    sp = SamplingParams(
        max_tokens=6, min_tokens=3, stop=["中"], ignore_eos=True, grammar=("regex", "a中cd")
    )
    for model in (default_model_dir("glm-tiny"), path):
        with LLM(str(model), **EXACT) as llm:
            out = llm.generate("x", sp)[0]
            assert (out.text, out.finish_reason) == ("a", "stop"), model


def _greedy_text(llm: LLM, **params):
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **params)
    return llm.generate([PROMPT], sp)[0]
