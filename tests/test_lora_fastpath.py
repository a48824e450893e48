"""--enable-lora's fast path: a step whose rows hold no adapter runs what an engine without
--enable-lora runs (on a CPU the native per-token path, layer loop and MTP draft chain
included; padded decode steps on a graph-safe backend), so its tokens and logprobs are
that engine's bit for bit; a step with adapter rows runs eager, its adapter rows matching
transformers + PEFT, its base rows the base model's tokens.

On glm-tiny with every context selected whole (`dense_tiny`): a base request's greedy
tokens under an adapter step's eager blocks equal the native path's (no near-ties)."""

from __future__ import annotations

import pytest
import torch

from dsakv.engine import Engine, EngineConfig

from .host_sync import guarding
from .test_lora import EXACT, _peft_model, _prompt, _requests, dense_tiny, reference

STEPS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return dense_tiny(tmp_path_factory.mktemp("fastpath"))


@pytest.fixture(scope="module")
def adapter(model, tmp_path_factory) -> tuple[str, object]:
    """Its path, and transformers + PEFT's model under it (the reference)."""
    pm = _peft_model(model, seed=1)
    path = tmp_path_factory.mktemp("adapter") / "a"
    pm.save_pretrained(str(path))
    return str(path), pm


def _engine(model: str, lora: str | None = None, **kw) -> Engine:
    """The CPU's default engine (fp32 caches); with `lora`, --enable-lora and it loaded as a."""
    with_lora = dict(enable_lora=True, max_lora_rank=8) if lora else {}
    engine = Engine(EngineConfig(model, **{**EXACT, "num_pages": 64, **with_lora, **kw}))
    if lora:
        engine.load_lora("a", lora)
    return engine


@pytest.fixture(scope="module")
def plain(model) -> Engine:
    return _engine(model)


@pytest.fixture(scope="module")
def served(model, adapter) -> Engine:
    return _engine(model, adapter[0])


def _run(engine: Engine, jobs: list[tuple[list[int], str | None, int]], ids=None) -> list:
    """Each job's request (`test_lora._requests`), with its top-2 logprobs (and those of
    the token `ids`)."""
    return _requests(engine, jobs, max_tokens=STEPS, logprobs=2, token_ids_logprob=ids)


def _out(req) -> tuple:
    return req.output_ids, req.logprobs, req.top_logprobs


def _alone(engine: Engine, prompt: list[int]) -> tuple:
    return _out(_run(engine, [(prompt, None, 0)])[0])


def test_base_only_steps_are_the_engine_without_enable_lora_bit_for_bit(plain, served):
    """Two base requests (prefill beside decode, then decode steps) under --enable-lora with
    an adapter loaded: the native per-token path (its decode steps one layer loop), the
    same tokens and logprobs as the engine without --enable-lora."""
    jobs = [(_prompt(11, 30), None, 0), (_prompt(12, 45), None, 2)]
    got = [_out(r) for r in _run(served, jobs)]
    assert got == [_out(r) for r in _run(plain, jobs)]
    assert served.deterministic and served.backend.deterministic
    made_for, loop = served.model._layer_loop
    assert made_for is served.pool and loop is not None
    # (its adapter steps' base rows are not these bits: no L3 page or PD pairing with the
    # deterministic engine's)
    assert served.compute != plain.compute and served.compute.endswith("deterministic=False")


def test_adapter_steps_between_base_only_steps(plain, served, adapter):
    """Base-only steps (c1 alone), then steps mixing the adapter's request (a) with base
    rows (b, c1's last), then base-only steps again (c2 alone, the slot still resident):
    a's logprobs and tokens are transformers + PEFT's, b's and c1's tokens the base
    model's, and c2 is the engine without --enable-lora's bit for bit."""
    a, b, c1, c2 = _prompt(21, 40), _prompt(22, 33), _prompt(23, 20), _prompt(24, 26)
    ref = reference(adapter[1], a, STEPS)
    ids = sorted(set(ref["logprobs"].topk(12).indices.flatten().tolist()))
    jobs = [(c1, None, 0), (a, "a", 3), (b, None, 3), (c2, None, 3 + STEPS + 2)]
    got = _run(served, jobs, ids)
    assert served.lora.slots[0] is not None  # (c2 ran beside a resident adapter slot)
    lora = torch.tensor(got[1].token_ids_logprobs)
    # Measured (fp32): max |Δlogprob| ~2e-6 (test_lora's tolerance)
    assert (lora - ref["logprobs"][:, ids]).abs().max().item() <= 1e-3
    assert got[1].output_ids == ref["tokens"]
    assert got[1].output_ids != _alone(plain, a)[0]  # (the adapter changes them)
    for req, prompt in ((got[2], b), (got[0], c1)):
        assert req.output_ids == _alone(plain, prompt)[0]
    assert _out(got[3]) == _alone(plain, c2)


@pytest.fixture(scope="module")
def padded(model, adapter) -> tuple[Engine, Engine]:
    """The triton backend on the CPU (its interpreter): padded decode steps, eager (no CUDA
    graphs); without and with --enable-lora."""
    pytest.importorskip("triton", reason="the Triton backend needs triton")
    kw = dict(attention_backend="triton", max_model_len=96)
    return _engine(model, **kw), _engine(model, adapter[0], **kw)


def test_base_only_decode_steps_run_padded_under_enable_lora(padded, adapter):
    """Under --enable-lora decode steps are padded (`decode_graph_blocker` None): the
    adapter's request runs eager (transformers + PEFT's tokens), then a base request's
    decode steps run padded, without a host sync (the LoRA hooks inert, the adapter's slot
    still resident), giving the engine without --enable-lora's tokens and logprobs."""
    base, lora = padded
    assert lora.decode_graph_blocker is None and lora.runner.decode_graphs is not None
    with guarding(lora.runner.decode_graphs) as guards:
        a, prompt = _prompt(32, 18), _prompt(31, 24)
        (req,) = _run(lora, [(a, "a", 0)])
        assert req.output_ids == reference(adapter[1], a, STEPS)["tokens"]
        assert guards == []  # (no padded step)
        got = _alone(lora, prompt)
    assert len(guards) == STEPS - 1  # (every decode step of the base request)
    assert got == _alone(base, prompt)


def test_mtp_base_only_steps_are_the_engine_without_enable_lora(model, adapter):
    """MTP under --enable-lora: a base request's verify steps and its draft chain run the
    native path (the draft layer's loop), so tokens and logprobs are those without it."""
    kw = dict(speculative_algorithm="mtp")
    prompt = _prompt(41, 28)
    lora = _engine(model, adapter[0], **kw)
    assert _alone(lora, prompt) == _alone(_engine(model, **kw), prompt)
    made_for, loop = lora.model.mtp._layer_loop
    assert made_for is lora.pool and loop is not None
