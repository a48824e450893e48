"""SGLang's return_routed_experts and return_hidden_states (`--enable-return-routed-experts`,
`--enable-return-hidden-states`), which RL frameworks read (routing replay, draft-model
training): each position's experts equal the top-k transformers' reference gates compute
over prompt + output, each position's hidden state its final-normed last hidden state; the
same through chunked prefill, the prefix cache, n > 1, a retraction, MTP verification (a
rejected draft leaves nothing) and DP attention; /generate's base64 int32 rows decode as
SGLang's clients decode them, and the OpenAI routes' `sglext` and `hidden_states` are the
same rows; requests that do not ask pay nothing; refusals."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json

import httpx
import numpy as np
import pytest

from dsakv import LLM, SamplingParams
from dsakv.cli import build_parser, engine_config_from_args
from dsakv.config.presets import TINY_PRESETS
from dsakv.engine import CompletionOutput, Engine, EngineConfig
from dsakv.errors import DsakvError
from dsakv.models.tiny import write_tiny_model
from dsakv.procs import free_port
from dsakv.server.protocol import APIError

from .conftest import hf_reference
from .serving import (
    NO_THINKING,
    TIMEOUT,
    engine_stops_stepping_at,
    serving,
    sglang_generate,
    sglang_stream,
)

EXACT = dict(kv_cache_dtype="fp32", index_k_dtype="fp32", device="cpu", page_size=16)
FLAGS = dict(enable_return_routed_experts=True, enable_return_hidden_states=True)
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
ASKED = dataclasses.replace(GREEDY, return_routed_experts=True, return_hidden_states=True)
LAYERS, TOP_K = 8, 2  # glm-tiny's (its layer 0 dense: first_k_dense_replace 1)
HIDDEN_ATOL = 1e-4  # fp32 both sides; measured max |Δ| about 3e-6


def _check(hf, prompt: list[int], out, start: int = 0) -> None:
    """`out`'s (a `CompletionOutput`) rows are the reference's for prompt + output but the
    last token, the routed experts from position `start`."""
    ids = prompt + out.token_ids[:-1]
    routed, hidden = hf_reference(hf, ids)
    assert out.routed_experts.dtype == np.int32
    assert out.routed_experts.shape == (len(ids) - start, LAYERS, TOP_K)
    np.testing.assert_array_equal(np.sort(out.routed_experts, -1), routed[start:])
    assert out.hidden_states.shape == hidden.shape
    np.testing.assert_allclose(out.hidden_states, hidden, rtol=0, atol=HIDDEN_ATOL)


def _prompts() -> list[list[int]]:
    return [[(7 * i + 3 * j) % 250 + 1 for j in range(9 + 13 * i)] for i in range(4)]


class _Counted:
    """Counts the steps that record their routing (`DSAForCausalLM.record_routing`)."""

    def __init__(self, model) -> None:
        self.model, self.calls, self.real = model, 0, model.record_routing
        model.record_routing = self

    def __call__(self, tokens: int):
        self.calls += 1
        return self.real(tokens)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_rows_are_the_reference_models_and_change_nothing(glm_tiny, glm_tiny_hf, backend):
    """Prompts of 9 to 48 tokens, chunked by 24, prefilled beside others' decode steps: each
    asked-for position's experts and hidden state are transformers'; routing from
    `routed_experts_start_len` on; the tokens and logprobs are those of a run that asks for
    nothing, which records no step (the native kernels and the torch path alike)."""
    llm = LLM(glm_tiny, **EXACT, num_pages=64, chunked_prefill_size=24, attention_backend=backend,
              **FLAGS)  # fmt: skip
    prompts = _prompts()
    counted = _Counted(llm.engine.model)
    plain = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert counted.calls == 0
    assert all(o.outputs[0].routed_experts is None for o in plain)
    started = dataclasses.replace(ASKED, routed_experts_start_len=5)
    hidden_only = dataclasses.replace(GREEDY, return_hidden_states=True)
    params = [ASKED, GREEDY, started, hidden_only]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert counted.calls > 0
    for a, b in zip(outs, plain):
        (ca,), (cb,) = a.outputs, b.outputs
        assert ca.token_ids == cb.token_ids
        assert [d[t].logprob for t, d in zip(ca.token_ids, ca.logprobs)] == pytest.approx(
            [d[t].logprob for t, d in zip(cb.token_ids, cb.logprobs)], abs=1e-5
        )
    _check(glm_tiny_hf, prompts[0], outs[0].outputs[0])
    assert outs[1].outputs[0].routed_experts is None and outs[1].outputs[0].hidden_states is None
    _check(glm_tiny_hf, prompts[2], outs[2].outputs[0], start=5)
    only = outs[3].outputs[0]
    assert only.routed_experts is None
    want = hf_reference(glm_tiny_hf, prompts[3] + only.token_ids[:-1])[1]
    np.testing.assert_allclose(only.hidden_states, want, rtol=0, atol=HIDDEN_ATOL)


def test_decode_steps_record_in_the_layer_loop(glm_tiny, glm_tiny_hf, monkeypatch):
    """Under deterministic inference a decode step that records its routing still runs in
    one native call (`LayerLoop`): each MoE layer's experts are the per-layer path's and
    transformers', and the tokens and logprobs the bits of the run that asks for nothing."""
    from dsakv.kernels import cpu_native
    from dsakv.models import dsa

    llm = LLM(glm_tiny, **EXACT, num_pages=64, enable_deterministic_inference=True, **FLAGS)
    model, real = llm.engine.model, cpu_native.LayerLoop.__call__
    recording: list[bool] = []  # per loop call: whether its step records

    def counted(self, *args, **kw):
        recording.append(model.routed is not None)
        return real(self, *args, **kw)

    monkeypatch.setattr(cpu_native.LayerLoop, "__call__", counted)
    prompts = _prompts()
    routed = dataclasses.replace(GREEDY, return_routed_experts=True)
    plain = llm.generate(prompts, GREEDY, use_tqdm=False)
    looped = llm.generate(prompts, routed, use_tqdm=False)
    assert recording.count(True) >= GREEDY.max_tokens - 1  # (the decode steps)
    monkeypatch.setattr(dsa, "LOOP_EXTEND", 0)  # every step on the per-layer path
    calls = len(recording)
    per_layer = llm.generate(prompts, routed, use_tqdm=False)
    assert len(recording) == calls
    for prompt, *outs in zip(prompts, looped, per_layer, plain):
        (a,), (b,), (c,) = (o.outputs for o in outs)
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.logprobs == b.logprobs == c.logprobs
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
        want, _ = hf_reference(glm_tiny_hf, prompt + a.token_ids[:-1])
        np.testing.assert_array_equal(np.sort(a.routed_experts, -1), want)


def test_prefix_cache_forks_and_a_retraction_keep_every_row(glm_tiny, glm_tiny_hf):
    """The prefix cache serves an asking request only what it does not ask for (the
    positions before `routed_experts_start_len`); n > 1 choices take the prompt's rows
    from the first and their pages from the cache; a request retracted mid-decode and
    computed again reports the rows of its own tokens."""
    llm = LLM(glm_tiny, **EXACT, num_pages=64, **FLAGS)
    prompt = _prompts()[3]  # 48 tokens: 3 pages of 16
    llm.generate([prompt], GREEDY, use_tqdm=False)  # its pages cached
    (whole,) = llm.generate([prompt], ASKED, use_tqdm=False)
    assert whole.num_cached_tokens == 0
    _check(glm_tiny_hf, prompt, whole.outputs[0])
    tail = dataclasses.replace(ASKED, routed_experts_start_len=33, return_hidden_states=False)
    (part,) = llm.generate([prompt], tail, use_tqdm=False)
    assert part.num_cached_tokens == 32  # (whole pages up to position 33)
    np.testing.assert_array_equal(
        part.outputs[0].routed_experts, whole.outputs[0].routed_experts[33:]
    )

    sampled = dataclasses.replace(ASKED, temperature=1.0, seed=7, n=3, max_tokens=5)
    (forks,) = llm.generate([prompt[:40]], sampled, use_tqdm=False)
    assert forks.metrics["prefix_hit_tokens"] > 0  # (the later choices')
    assert len({tuple(c.token_ids) for c in forks.outputs}) > 1
    for c in forks.outputs:
        _check(glm_tiny_hf, prompt[:40], c)

    engine = llm.engine
    req = engine.add_request(prompt[:30], dataclasses.replace(ASKED, max_tokens=8))
    while len(req.output_ids) < 4:
        engine.step()
    engine.retract_all()
    while not req.finished:
        engine.step()
    assert req.metrics.retractions == 1
    out = CompletionOutput.from_request(0, req)
    _check(glm_tiny_hf, prompt[:30], out)


def test_a_late_start_keeps_no_rows_before_it(glm_tiny):
    """A multi-turn rollout asks for its last turn's routing alone (`routed_experts_start_len`
    deep in its context): the host keeps no row before the start, and the rows it reports,
    through a retraction too, are the tail of a request that asks from position 0."""
    llm = LLM(glm_tiny, **EXACT, num_pages=128, **FLAGS)
    prompt = [(5 * j) % 250 + 1 for j in range(600)]
    routed = dataclasses.replace(GREEDY, return_routed_experts=True)
    (whole,) = llm.generate([prompt], routed, use_tqdm=False)
    start = 590
    engine = llm.engine
    req = engine.add_request(prompt, dataclasses.replace(routed, routed_experts_start_len=start))
    while len(req.output_ids) < 3:
        engine.step()
    assert req.capture.routed.shape[0] < start  # (not a row per position before it)
    engine.retract_all()
    while not req.finished:
        engine.step()
    assert req.metrics.retractions == 1
    np.testing.assert_array_equal(req.routed_experts, whole.outputs[0].routed_experts[start:])


def test_mtp_verification_leaves_no_rejected_draft(glm_tiny, glm_tiny_hf):
    """With MTP the target checks several drafts a step: the positions of drafts it
    rejects are run again as the next step's tokens; the rows are the single-step run's,
    transformers' own."""
    llm = LLM(glm_tiny, **EXACT, num_pages=64, speculative_algorithm="mtp",
              speculative_num_steps=3, **FLAGS)  # fmt: skip
    prompts = _prompts()
    params = dataclasses.replace(ASKED, max_tokens=16)
    outs = llm.generate(prompts, params, use_tqdm=False)
    c = llm.engine.counters()
    assert 0 < c["spec_accepted_tokens"] < c["spec_draft_tokens"]
    for prompt, out in zip(prompts, outs):
        _check(glm_tiny_hf, prompt, out.outputs[0])


def test_refused_where_not_allowed_or_not_run(glm_tiny, tmp_path):
    """Without the engine's flag, asking is SGLang's error (offline too); a start past the
    prompt, or one alone, is refused; a model without MoE layers routes nothing; a
    prefill/decode server refuses hidden states (the decode server never sees the prompt's
    rows; its routed experts come with the first token: `test_disagg`)."""
    llm = LLM(glm_tiny, **EXACT, num_pages=32)
    for name in ("return_routed_experts", "return_hidden_states"):
        with pytest.raises(DsakvError) as e:
            llm.generate([[1, 2, 3]], dataclasses.replace(GREEDY, **{name: True}), use_tqdm=False)
        flag = "--enable-" + name.replace("_", "-")
        assert e.value.param == name and f"Please set `{flag}`" in str(e.value)
    flagged = LLM(glm_tiny, **EXACT, num_pages=32, **FLAGS)
    with pytest.raises(DsakvError, match="higher than the number of input tokens"):
        flagged.generate([[1, 2, 3]], dataclasses.replace(ASKED, routed_experts_start_len=4))
    with pytest.raises(DsakvError, match="needs return_routed_experts"):
        SamplingParams(routed_experts_start_len=2)
    with pytest.raises(DsakvError, match="routed_experts_start_len must be an integer >= 0"):
        SamplingParams(return_routed_experts=True, routed_experts_start_len=-1)
    with pytest.raises(DsakvError, match="return_hidden_states must be True or False"):
        SamplingParams(return_hidden_states="yes")

    args = build_parser().parse_args(
        ["serve", glm_tiny, "--enable-return-routed-experts", "--enable-return-hidden-states"]
    )
    config = engine_config_from_args(args)
    assert config.enable_return_routed_experts and config.enable_return_hidden_states

    all_dense = {**TINY_PRESETS["glm-tiny"], "first_k_dense_replace": LAYERS}
    dense = write_tiny_model(tmp_path / "dense", preset=all_dense, mtp="none")
    with pytest.raises(DsakvError, match="needs an MoE model"):
        Engine(EngineConfig(str(dense), **EXACT, num_pages=8, enable_return_routed_experts=True))

    from dsakv.disagg import handoff
    from dsakv.disagg.config import DisaggConfig
    from dsakv.disagg.handoff import BootstrapTarget
    from dsakv.disagg.serving import PrefillAsyncEngine

    port = free_port()
    prefill = PrefillAsyncEngine(
        Engine(EngineConfig(glm_tiny, **EXACT, num_pages=32, **FLAGS)),
        DisaggConfig("prefill", bootstrap_port=port),
        "127.0.0.1",
    )

    async def ask(params: SamplingParams):
        handoff._current.set(handoff._Targets([BootstrapTarget(1, None, port)]))
        await prefill.generate_n([1, 2, 3], params, 1)

    try:
        with pytest.raises(APIError) as e:
            asyncio.run(ask(dataclasses.replace(GREEDY, return_hidden_states=True)))
        assert e.value.status == 400 and e.value.param == "return_hidden_states"
        assert "prefill/decode disaggregation" in e.value.message
    finally:
        prefill.shutdown()


def test_dp_attention_brings_each_ranks_rows_back(glm_tiny, glm_tiny_hf):
    """Under DP attention each rank routes every rank's tokens together; each request's
    rows are its own rank's share, as one engine reports them."""
    prompts = _prompts()
    with LLM(glm_tiny, **EXACT, num_pages=64, tp=2, dp_attention=True, **FLAGS) as llm:
        outs = llm.generate(prompts, ASKED, use_tqdm=False)
        assert all(c["finished_requests"] > 0 for c in llm.engine.rank_counters())
    for prompt, out in zip(prompts, outs):
        _check(glm_tiny_hf, prompt, out.outputs[0])


def test_pipeline_stages_bring_every_stages_rows_back(glm_tiny, glm_tiny_hf):
    """Under --pp-size each stage routes its own layers and the last holds the final hidden
    states: rank 0 gathers them (each stage's TP rank 0's), and each request's rows are
    transformers', as one engine's (a stage's layers alone: the others' read as expert 0)."""
    prompts = _prompts()
    layout = dict(tp=2, pp=2, pp_layer_partition="3,5")
    with LLM(glm_tiny, **EXACT, num_pages=64, chunked_prefill_size=24, **layout, **FLAGS) as llm:
        outs = llm.generate(prompts, [ASKED, GREEDY, ASKED, ASKED], use_tqdm=False)
    for i in (0, 2, 3):
        _check(glm_tiny_hf, prompts[i], outs[i].outputs[0])
    assert outs[1].outputs[0].routed_experts is None


# --- SGLang's /generate --------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(glm_tiny):
    with serving(EngineConfig(model=glm_tiny, **EXACT, num_pages=64, **FLAGS)) as served:
        yield served


def _decoded(meta: dict) -> np.ndarray:
    """SGLang's client-side decode (`extract_routed_experts_from_meta_info`)."""
    flat = np.frombuffer(base64.b64decode(meta["routed_experts"].encode("utf-8")), np.int32)
    return flat.reshape(-1, LAYERS, TOP_K)


def test_generate_returns_sglangs_rows(served, glm_tiny_hf):
    """A batch asking for routed experts (from `routed_experts_start_len`) and, per
    prompt, hidden states: meta_info's `routed_experts` is base64 of int32
    `[tokens, layers, top_k]` (SGLang's), `hidden_states` the prompt's rows then one per
    output token but the last; the prompt that does not ask for hidden states gets none,
    a request that asks for nothing neither; streamed, the last chunk brings them."""
    base, _ = served
    prompts = _prompts()[1:3]
    sampling = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    outs = sglang_generate(base, input_ids=prompts, sampling_params=sampling,
                           return_routed_experts=True, routed_experts_start_len=3,
                           return_hidden_states=[True, False])  # fmt: skip
    for prompt, out, hidden in zip(prompts, outs, (True, False)):
        meta = out["meta_info"]
        ids = prompt + out["output_ids"][:-1]
        routed, states = hf_reference(glm_tiny_hf, ids)
        got = _decoded(meta)
        assert got.shape == (len(ids) - 3, LAYERS, TOP_K)
        np.testing.assert_array_equal(np.sort(got, -1), routed[3:])
        if not hidden:
            assert "hidden_states" not in meta
            continue
        rows = meta["hidden_states"]
        assert len(rows) == 1 + len(out["output_ids"]) - 1 == 5
        assert np.array(rows[0]).shape == (len(prompt), states.shape[1])
        assert all(np.array(r).shape == (states.shape[1],) for r in rows[1:])
        flat = np.array([*rows[0], *rows[1:]])
        np.testing.assert_allclose(flat, states, rtol=0, atol=HIDDEN_ATOL)

    plain = sglang_generate(base, input_ids=prompts[0], sampling_params=sampling)
    assert not {"routed_experts", "hidden_states"} & set(plain["meta_info"])
    chunks = sglang_stream(base, input_ids=prompts[0], sampling_params=sampling,
                           return_routed_experts=True)  # fmt: skip
    assert all("routed_experts" not in c["meta_info"] for c in chunks[:-1])
    whole = sglang_generate(base, input_ids=prompts[0], sampling_params=sampling,
                            return_routed_experts=True)  # fmt: skip
    np.testing.assert_array_equal(_decoded(chunks[-1]["meta_info"]), _decoded(whole["meta_info"]))


def test_openai_routes_return_sglangs_rows(served, glm_tiny_hf):
    """SGLang's OpenAI routes: the response's `sglext.routed_experts` is its first
    choice's (n > 1 too), the rows /generate gives for the same prompt and greedy output
    (transformers' too), from `routed_experts_start_len`; each choice's `hidden_states` is
    the last of /generate's rows; streamed, after the choices' chunks, one chunk a choice
    with its hidden state, then one with `sglext` and no choices; unasked, none of it."""
    base, _ = served
    asks = {"return_routed_experts": True, "return_hidden_states": True}
    greedy = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    sp = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": "Name a colour."}], **NO_THINKING}
    chat_ids = httpx.post(f"{base}/tokenize", json=chat, timeout=TIMEOUT).json()["tokens"]
    prompt = _prompts()[1]
    for path, ids, body in (
        ("/v1/completions", prompt, {"prompt": prompt}),
        ("/v1/chat/completions", chat_ids, chat),
    ):
        want = sglang_generate(base, input_ids=ids, sampling_params=sp, **asks)
        routed, rows = _decoded(want["meta_info"]), want["meta_info"]["hidden_states"]
        ref_routed, ref_hidden = hf_reference(glm_tiny_hf, ids + want["output_ids"][:-1])
        np.testing.assert_array_equal(np.sort(routed, -1), ref_routed)
        np.testing.assert_allclose(rows[-1], ref_hidden[-1], rtol=0, atol=HIDDEN_ATOL)

        ask = {**body, **greedy, **asks, "n": 2}
        r = httpx.post(base + path, json=ask, timeout=TIMEOUT).json()
        np.testing.assert_array_equal(_decoded(r["sglext"]), routed)
        assert [c["index"] for c in r["choices"]] == [0, 1]
        for c in r["choices"]:
            np.testing.assert_allclose(c["hidden_states"], rows[-1], rtol=0, atol=HIDDEN_ATOL)

        chunks = sglang_stream(base, path, **ask)
        *text, h0, h1, ext = chunks
        assert ext["choices"] == [] and set(ext["sglext"]) == {"routed_experts"}
        np.testing.assert_array_equal(_decoded(ext["sglext"]), routed)
        for i, h in enumerate((h0, h1)):
            (c,) = h["choices"]
            hidden = c["delta"]["hidden_states"] if "delta" in c else c["hidden_states"]
            assert c["index"] == i and c["finish_reason"] is None
            np.testing.assert_allclose(hidden, rows[-1], rtol=0, atol=HIDDEN_ATOL)
        assert not any("sglext" in t or "hidden_states" in json.dumps(t) for t in text)

        late = {**body, **greedy, "return_routed_experts": True, "routed_experts_start_len": 3}
        r = httpx.post(base + path, json=late, timeout=TIMEOUT).json()
        np.testing.assert_array_equal(_decoded(r["sglext"]), routed[3:])
        assert "hidden_states" not in r["choices"][0]
        plain = httpx.post(base + path, json={**body, **greedy}, timeout=TIMEOUT).json()
        assert "sglext" not in plain and "hidden_states" not in plain["choices"][0]


def test_streamed_extras_keep_usage_and_skip_aborted_choices(served):
    """Under stream_options.include_usage the hidden-state and `sglext` chunks carry `usage`
    as every other chunk does (null; with continuous_usage_stats a choice's chunk its
    choice's tokens): they had none. A choice aborted mid-stream has no rows: no chunk for
    it (SGLang's: only the choices that have them), where it got `hidden_states: null`."""
    base, async_engine = served
    asks = {"return_routed_experts": True, "return_hidden_states": True, "n": 2}
    greedy = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": "Name a colour."}], **NO_THINKING}
    for path, body in (("/v1/completions", {"prompt": _prompts()[1]}),
                       ("/v1/chat/completions", chat)):  # fmt: skip
        for running in (False, True):
            opts = {"include_usage": True, "continuous_usage_stats": running}
            *chunks, last = sglang_stream(base, path, **body, **greedy, **asks, stream_options=opts)
            assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
            *_, h0, h1, ext = chunks
            assert "sglext" in ext and all("usage" in c for c in chunks), (path, running)
            assert ext["usage"] is None
            for h in (h0, h1):  # (its choice's: 3 tokens)
                assert (h["usage"] or {}).get("completion_tokens") == (3 if running else None)

    long = {"prompt": _prompts()[1], "max_tokens": 500, "ignore_eos": True, "stream": True}
    with (
        engine_stops_stepping_at(async_engine, tokens=2),  # (it cannot finish by itself)
        httpx.stream("POST", f"{base}/v1/completions", json={**long, **asks}, timeout=TIMEOUT) as r,
    ):
        lines = r.iter_lines()  # (kept: a dropped iterator closes the stream)
        next(x for x in lines if x.startswith("data: "))
        httpx.post(f"{base}/abort_request", json={"abort_all": True}, timeout=TIMEOUT)
        rest = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert {c["choices"][0]["finish_reason"] for c in rest} >= {"abort"}
    assert not any("hidden_states" in c["choices"][0] or "sglext" in c for c in rest), rest


_BAD = [
    ({"routed_experts_start_len": 99, "return_routed_experts": True}, "routed_experts_start_len"),
    ({"routed_experts_start_len": -1, "return_routed_experts": True}, "routed_experts_start_len"),
    ({"routed_experts_start_len": 2}, "routed_experts_start_len"),
    ({"return_hidden_states": [True, False]}, "return_hidden_states"),
]


def test_bad_requests_are_400s_naming_the_field(served, glm_tiny):
    base, _ = served
    for extra, param in _BAD:
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}, **extra}
        r = httpx.post(f"{base}/generate", json=body, timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    v1 = [  # (/v1/responses does not take them; beam search's beams are no choice's)
        ("/v1/responses", {"input": "x", "return_routed_experts": True}, "return_routed_experts"),
        ("/v1/responses", {"input": "x", "return_hidden_states": True}, "return_hidden_states"),
        ("/v1/completions", {"prompt": "x", "use_beam_search": True, "n": 2,
                             "return_routed_experts": True}, "return_routed_experts"),
        ("/v1/completions", {"prompt": "x", "routed_experts_start_len": 1},
         "routed_experts_start_len"),
        ("/v1/completions", {"prompt": "x", "return_hidden_states": "last"},
         "return_hidden_states"),
    ]  # fmt: skip
    for path, body, param in v1:
        r = httpx.post(base + path, json=body, timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)

    with serving(EngineConfig(model=glm_tiny, **EXACT, num_pages=32)) as (plain, _):
        for name in ("return_routed_experts", "return_hidden_states"):
            for path, body in (
                ("/generate", {"input_ids": [5, 6, 7], name: True}),
                ("/v1/completions", {"prompt": [5, 6, 7], name: True}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                          name: True}),
            ):  # fmt: skip
                r = httpx.post(plain + path, json=body, timeout=TIMEOUT)
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert err["param"] == name and err["message"].startswith(
                    "The server is not configured to return the "
                ), (path, err)
