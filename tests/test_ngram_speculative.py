"""n-gram (prompt lookup) speculative decoding: the lookup finds what a brute-force search
finds, tokens never change (greedy, seeded sampling, grammars, chunking, memory pressure,
prefix hits, a PD hand-off), drafts are really kept, and the flags of SGLang's NGRAM and
vLLM's ngram method set it up."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsakv import LLM, SamplingParams
from dsakv.engine import Engine, EngineConfig
from dsakv.engine.speculative import ngram_drafts
from dsakv.memory import copy_tokens
from dsakv.models.tiny import TINY_PRESETS, write_tiny_model

from .conftest import cli_config, cli_error_line
from .test_speculative import EXACT, GREEDY, _run

NGRAM = dict(speculative_algorithm="ngram")


def _brute_force(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The longest suffix of length n in [lo, hi] that occurred earlier, its latest earlier
    occurrence, and the k tokens after it, copied on past the end as a repeat would go."""
    last = len(tokens) - 1
    for n in range(hi, lo - 1, -1):
        suffix = tokens[last - n + 1 :] if n <= last + 1 else None
        for end in range(last - 1, n - 2, -1):
            if suffix is not None and tokens[end - n + 1 : end + 1] == suffix:
                seq = list(tokens)
                for i in range(k):
                    seq.append(seq[end + 1 + i])
                return seq[last + 1 :]
    return []


@settings(max_examples=300, deadline=None)
@given(
    # (2 to 4 distinct tokens, up to 200: the last often ends more earlier matches than the
    # latest ones `ngram_drafts` narrows first)
    tokens=st.integers(1, 3).flatmap(
        lambda v: st.lists(st.integers(0, v), min_size=1, max_size=200)
    ),
    k=st.integers(0, 6),
    lo=st.integers(1, 5),
    extra=st.integers(0, 6),
)
def test_lookup_matches_a_brute_force_search(tokens, k, lo, extra):
    hi = lo + extra
    got = ngram_drafts(np.array(tokens, dtype=np.int64), k, lo, hi)
    assert got == _brute_force(tokens, k, lo, hi)


def test_lookup_prefers_the_longest_then_the_latest_match():
    t = [1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3]
    assert ngram_drafts(np.array(t), 3, 1, 4) == [9, 2, 3]  # "1 2 3" beats the later "2 3"
    assert ngram_drafts(np.array(t), 3, 1, 2) == [8, 7, 1]  # capped at 2: the latest "2 3"
    assert ngram_drafts(np.array(t), 3, 4, 5) == []  # no earlier 4-gram ends in "1 2 3"
    # A loop: the copy goes on past the end (period 2 here, 5 drafts).
    assert ngram_drafts(np.array([5, 1, 2, 1, 2, 1, 2]), 5, 1, 3) == [1, 2, 1, 2, 1]
    assert ngram_drafts(np.array([4, 4, 4]), 3, 1, 5) == [4, 4, 4]
    # The longest match long before the latest candidates: found all the same.
    t = [7, 1, 2, 3, 9] + [3, 5] * 100 + [1, 2, 3]
    assert ngram_drafts(np.array(t), 3, 1, 4) == [9, 3, 5]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """glm-tiny with index_topk covering every context here (exact equality is fair), and
    an MTP layer that n-gram drafting must leave unloaded."""
    preset = {**TINY_PRESETS["glm-tiny"], "index_topk": 1024}
    return str(write_tiny_model(tmp_path_factory.mktemp("ngram") / "m", preset, mtp="random"))


def _repetitive(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase (what prompt lookup is for), and random ones."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        phrase = [rng.randrange(256) for _ in range(rng.randint(5, 14))]
        tail = [rng.randrange(256) for _ in range(rng.randint(0, 30))]
        out.append(phrase * rng.randint(2, 4) + tail if i % 3 else tail + phrase)
    return out


@pytest.fixture(scope="module")
def reference(model):
    prompts = _repetitive(6)
    return prompts, _run(model, prompts)[0]


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_tokens_equal_without_drafts(model, reference, k):
    prompts, ref = reference
    tokens, engine = _run(model, prompts, speculative_num_steps=k, **NGRAM)
    assert tokens == ref
    c = engine.counters()
    assert 0 < c["spec_accepted_tokens"] <= c["spec_draft_tokens"]
    assert c["steps"] < c["output_tokens"]  # drafts were really kept
    # No draft layer: the MTP checkpoint's is neither built nor given KV.
    assert engine.plan.num_draft_layers == 0 == engine.model.num_draft_layers
    assert engine.layout.bytes_per_token == _run(model, prompts[:1])[1].layout.bytes_per_token


@pytest.mark.parametrize(
    "variant",
    [
        dict(chunked_prefill_size=16),
        dict(max_running_requests=2, speculative_ngram_min_match_window_size=2),
        dict(num_pages=9, enable_prefix_cache=False),  # retraction by recompute
        dict(num_pages=9, host_pool_gib=0.05),  # retraction to the host tier and back
    ],
    ids=["chunked", "max2-min2", "retract", "retract-host"],
)
def test_greedy_equal_under_chunking_and_memory_pressure(model, reference, variant):
    prompts, ref = reference
    tokens, engine = _run(model, prompts, **NGRAM, **variant)
    assert tokens == ref
    assert engine.counters()["spec_accepted_tokens"] > 0
    if "num_pages" in variant:
        assert engine.counters()["retractions"] > 0


def test_greedy_equal_with_prefix_hits(model):
    rng = random.Random(5)
    shared = [rng.randrange(256) for _ in range(12)] * 4
    prompts = [shared + [rng.randrange(256) for _ in range(rng.randint(1, 20))] for _ in range(5)]
    ref, _ = _run(model, prompts, max_running_requests=1)
    tokens, engine = _run(model, prompts, max_running_requests=1, **NGRAM)
    assert tokens == ref
    assert engine.counters()["prefix_hit_tokens"] >= 4 * 48


def test_the_drafter_keeps_no_tokens_of_a_request_gone(model):
    """The drafter's copy of each request's tokens goes with the request, aborted ones too
    (a server aborts each request whose client hangs up: they were kept for good), and it
    never holds more than the context."""
    engine = Engine(EngineConfig(model, **EXACT, num_pages=64, max_model_len=128, **NGRAM))
    prompts = [[i, *range(10, 20)] * 7 for i in range(4)]  # 77 tokens, then up to 40 more
    reqs = [engine.add_request(p, GREEDY) for p in prompts]
    for _ in range(3):
        engine.step()
    kept = engine.drafter._tokens
    assert set(kept) == {r.rid for r in reqs}
    assert all(len(tokens) <= 128 for tokens, _ in kept.values())
    for req in reqs[:2]:
        engine.abort(req.rid)
    assert set(kept) == {r.rid for r in reqs[2:]}
    while engine.has_unfinished():
        engine.step()
    assert not kept
    engine.check_integrity()


def test_seeded_sampling_emits_the_tokens_it_would_without_drafts(model, reference):
    """A seeded request's token i is drawn by (seed, i), drafts or not: a draft is kept
    iff it is that token, so sampled outputs are unchanged, not only alike in law."""
    prompts, _ = reference
    params = [
        SamplingParams(max_tokens=30, temperature=0.7, top_k=4, seed=s, ignore_eos=True)
        for s in range(len(prompts))
    ]
    ref, _ = _run(model, prompts, params)
    tokens, engine = _run(model, prompts, params, **NGRAM)
    assert tokens == ref
    assert engine.counters()["spec_accepted_tokens"] > 0


def test_structured_output_drafts_only_what_the_grammar_allows(model):
    """Lookup drafts are cut at the first token the request's grammar refuses (the
    matcher rolled back): outputs equal decoding without drafts and parse."""
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"a": {"type": "array", "items": {"enum": ["xy", "zw"]}, "maxItems": 12}},
        "required": ["a"],
    }
    params = SamplingParams(
        max_tokens=120, temperature=0, grammar=("json_schema", json.dumps(schema))
    )
    prompts = _repetitive(3, seed=4)
    ref, _ = _run(model, prompts, params)
    tokens, engine = _run(model, prompts, params, **NGRAM)
    assert tokens == ref
    llm = LLM(model, **EXACT, num_pages=64, **NGRAM)
    for o in llm.generate(prompts, params, use_tqdm=False):
        jsonschema.validate(json.loads(o.text), schema)
    assert engine.counters()["spec_accepted_tokens"] > 0


def test_lookup_drafts_are_cut_where_the_grammar_refuses(model):
    """`_allowed`: the longest prefix of the drafts the grammar accepts, nothing past the
    end of what it allows, and the matcher left as it was (the engine's verify masks
    refused drafts too, so tokens alone cannot show the cut)."""
    from transformers import AutoTokenizer

    from dsakv.engine.grammar import GrammarCache
    from dsakv.engine.speculative import _allowed

    tok = AutoTokenizer.from_pretrained(model)
    a, b, x = (tok.convert_tokens_to_ids(c) for c in "abx")
    cache = GrammarCache(tok, 264, (257,))  # (glm-tiny: its vocabulary and EOS)
    m = cache.matcher(("regex", "ab(ab)?"))
    assert _allowed(m, [a, b, x, a]) == [a, b]
    assert _allowed(m, [a, b, a, b, a]) == [a, b, a, b]  # (not past the grammar's end)
    assert _allowed(m, [x, a]) == []
    assert m.accept_token(a) and not m.accept_token(a)  # (where it started: "a" then "b")


def test_prefill_decode_handoff(model):
    """A decode engine drafting by lookup takes a plain prefill engine's pages (the layouts
    agree: neither has a draft layer) and decodes as one engine does."""
    from dsakv.engine import disagg

    prompt = _repetitive(3, seed=7)[1]
    n = len(prompt)
    prefill = Engine(EngineConfig(model, **EXACT, num_pages=32))
    first = prefill.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
    disagg.hold(prefill, first)
    prefill.step()
    decode = Engine(EngineConfig(model, **EXACT, num_pages=32, **NGRAM))
    assert decode.layout == prefill.layout
    req = disagg.reserve(decode, prompt, GREEDY)
    copy_tokens(
        decode.pool, decode.scheduler.slots(req, n), prefill.pool, prefill.scheduler.slots(first, n)
    )
    disagg.release_held(prefill, first)
    disagg.start_decoding(decode, req, first.output_ids[0])
    while decode.has_unfinished():
        decode.step()
    assert req.output_ids == _run(model, [prompt])[0][0]
    assert decode.counters()["spec_accepted_tokens"] > 0
    prefill.check_integrity()
    decode.check_integrity()


def test_sglang_and_vllm_flags():
    """SGLang's NGRAM command (its draft tokens count the last token; its tree and cache
    settings taken, speed only) and vLLM's ngram method, JSON and dotted."""
    tiny = ["serve", "glm-tiny"]
    c = cli_config(
        *tiny, "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5",
        "--speculative-ngram-min-match-window-size", "2",
        "--speculative-ngram-max-match-window-size", "6",
        "--speculative-ngram-max-bfs-breadth", "10", "--speculative-ngram-match-type", "BFS",
        "--speculative-ngram-branch-length", "18", "--speculative-ngram-capacity", "1000000",
    )  # fmt: skip
    assert (c.speculative_algorithm, c.speculative_num_steps, c.ngram_window) == (
        "ngram",
        4,
        (2, 6),
    )
    c = cli_config(*tiny, "--speculative-algorithm", "ngram")
    assert (c.speculative_num_steps, c.ngram_window) == (None, (1, 12))  # (SGLang's window)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    c = cli_config(*tiny, "--speculative-config", json.dumps(spec))
    assert (c.speculative_algorithm, c.speculative_num_steps, c.ngram_window) == (
        "ngram",
        3,
        (4, 4),
    )
    c = cli_config(
        *tiny, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'
    )
    assert c.ngram_window == (5, 5)  # (vLLM's default)
    c = cli_config(
        *tiny, "--speculative-config.method", "ngram",
        "--speculative-config.num_speculative_tokens", "2",
        "--speculative-config.prompt_lookup_min", "2", "--speculative-config.prompt_lookup_max", "3",
    )  # fmt: skip
    assert (c.speculative_algorithm, c.speculative_num_steps, c.ngram_window) == (
        "ngram",
        2,
        (2, 3),
    )


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--speculative-ngram-max-match-window-size", "4"], "need --speculative-algorithm ngram"),
        (
            ["--speculative-algorithm", "ngram", "--speculative-ngram-min-match-window-size", "5",
             "--speculative-ngram-max-match-window-size", "3"],
            "1 <= min <= max",
        ),
        (["--speculative-config", '{"method": "ngram"}'], "ngram needs num_speculative_tokens"),
        (["--speculative-config", '{"method": "mtp", "prompt_lookup_min": 2}'], "dsakv takes"),
        (
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
             "--speculative-ngram-max-match-window-size", "3"],
            "give one",
        ),
        (
            ["--speculative-algorithm", "ngram", "--speculative-num-steps", "3",
             "--speculative-num-draft-tokens", "6"],
            "give 4 or leave it out",
        ),
        # (alone, the count sets the drafts: out of range, the error names it, not
        # --speculative-num-steps, which was not given)
        (
            ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "24"],
            "--speculative-num-draft-tokens 24: n-gram drafting verifies 2..17 tokens",
        ),
        (
            ["--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "1"],
            "--speculative-num-draft-tokens 1: n-gram drafting verifies 2..17 tokens",
        ),
    ],
)  # fmt: skip
def test_bad_flags_are_one_line(flags, said, capsys):
    assert said in cli_error_line(["serve", "glm-tiny", *flags], capsys)


@pytest.mark.parametrize("kw", [dict(tp=2), dict(tp=2, dp_attention=True)], ids=["tp2", "dp2"])
def test_two_ranks_decode_as_one(model, reference, kw):
    """Drafts are rank 0's under TP (its forwards carry them) and each rank's own under DP
    attention (no draft forward to keep in lockstep): tokens as one rank's."""
    prompts, ref = reference
    with LLM(model, **EXACT, num_pages=64, **NGRAM, **kw) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        c = llm.engine.counters()
    assert [o.token_ids for o in outs] == ref
    assert sum(o.metrics["spec_accepted_tokens"] for o in outs) == c["spec_accepted_tokens"] > 0
