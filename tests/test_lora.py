"""LoRA adapters (`--enable-lora`): PEFT adapters on tiny GLM-5 / DeepSeek-V3.2 models match
transformers + PEFT, batches mixing adapters give each request its own tokens, the prefix
cache never shares KV between adapters, admission keeps to `max_loras` slots, bad adapters
are one clear error, and TP=2 gives TP=1's tokens.

Adapters are PEFT's own (`get_peft_model(...).save_pretrained`, random A and B). PEFT (with
transformers 5) renames this architecture's gate/up/down_proj targets to the routed experts'
fused parameters (`target_parameters`: tests/test_lora_experts.py); the dense MLP and the
shared experts are plain Linears, targeted by name here with that rename off."""

from __future__ import annotations

import contextlib
import copy
import json
import random
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsakv import LLM, BeamSearchParams, LoRARequest, SamplingParams
from dsakv.engine import Engine, EngineConfig
from dsakv.engine.kv_events import to_events
from dsakv.engine.prefix_cache import LoraNamespace, root_hash
from dsakv.errors import DsakvError
from dsakv.models.tiny import TINY_PRESETS, write_tiny_model

peft = pytest.importorskip("peft")

PS = 16
EXACT = dict(device="cpu", page_size=PS, kv_cache_dtype="fp32", index_k_dtype="fp32")
# Every projection dsakv adapts: attention (kv_b_proj too), indexer, dense MLP, shared experts
TARGETS = (
    r".*\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj"
    r"|indexer\.(wq_b|wk|weights_proj))|mlp\.(shared_experts\.)?(gate_proj|up_proj|down_proj))"
)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _prompt(seed: int, n: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


def _peft_model(model_dir: str, seed: int, **lora):
    """transformers' model (fp32) under a PEFT LoRA of random A and B."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import transformers_weight_conversion as conversion
    from transformers import AutoModelForCausalLM

    rename = lora.pop("rename", False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = LoraConfig(
        **{"r": 8, "lora_alpha": 16, "init_lora_weights": False, "target_modules": TARGETS, **lora}
    )
    torch.manual_seed(seed)
    off = mock.patch.object(
        conversion, "convert_peft_config_for_transformers", lambda *a, **k: None
    )
    with contextlib.nullcontext() if rename else off:
        return get_peft_model(hf, config).eval()


def _adapter(model_dir: str, out: Path, seed: int, **lora) -> str:
    _peft_model(model_dir, seed, **lora).save_pretrained(str(out))
    return str(out)


def dense_tiny(root: Path) -> str:
    """glm-tiny with every context selected whole (index_topk 4096): exact equality is fair."""
    dense = copy.deepcopy(TINY_PRESETS["glm-tiny"])
    dense["index_topk"] = 4096
    return str(write_tiny_model(root / "dense", preset=dense, seed=1))


def reference(pm, prompt: list[int], steps: int) -> dict:
    """transformers + PEFT's greedy tokens and each step's logprobs."""
    gen = pm.generate(
        torch.tensor([prompt]),
        max_new_tokens=steps,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=258,
        eos_token_id=None,
    )
    logprobs = torch.log_softmax(torch.stack(gen.logits)[:, 0].float(), -1)
    return dict(tokens=gen.sequences[0, len(prompt) :].tolist(), logprobs=logprobs)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora")
    return {
        "sparse": str(write_tiny_model(root / "sparse", "glm-tiny", seed=1)),
        "dense": dense_tiny(root),
    }


@pytest.fixture(scope="module")
def adapters(models, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": _adapter(models["dense"], root / "a", seed=1),
        "b": _adapter(models["dense"], root / "b", seed=2, r=4, lora_alpha=32, use_rslora=True),
    }


def _engine(model: str, **kw) -> Engine:
    return Engine(EngineConfig(model, **{**EXACT, "num_pages": 64, "enable_lora": True, **kw}))


def _run(engine: Engine, jobs: list[tuple[list[int], str | None, int]]) -> list[list[int]]:
    """Greedy tokens of each (prompt, adapter, the step it arrives at)."""
    return [r.output_ids for r in _requests(engine, jobs)]


def _requests(engine: Engine, jobs: list[tuple[list[int], str | None, int]], **params) -> list:
    """Each (prompt, adapter, the step it arrives at) job's request, greedy (with `params`
    on top), run until every one ended."""
    reqs: dict[int, object] = {}
    step = 0
    while len(reqs) < len(jobs) or engine.has_unfinished():
        for i, (prompt, lora, at) in enumerate(jobs):
            if at == step:
                sampling = SamplingParams(**{**_greedy(), **params, "lora_name": lora})
                reqs[i] = engine.add_request(prompt, sampling)
        engine.step()
        step += 1
    engine.check_integrity()
    return [reqs[i] for i in range(len(jobs))]


def _greedy() -> dict:
    return dict(max_tokens=8, temperature=0, ignore_eos=True)


# --- parity with transformers + PEFT --------------------------------------------------------


@pytest.mark.parametrize("targets", [TARGETS, ["kv_b_proj"]], ids=["all", "kv_b_proj"])
def test_adapter_logits_and_greedy_match_transformers_peft(models, tmp_path, targets):
    """Every adaptable projection (indexer included, its top-k exercised: index_topk 16 <
    a 40-token prompt), and kv_b_proj alone, under a random adapter: dsakv's logprobs of
    each step's likeliest tokens and its greedy tokens are transformers + PEFT's, through
    vLLM's offline API. (PEFT adds kv_b's delta to the up-projected keys and values; dsakv
    to the latent query and the latent output, kv_b being absorbed there.)"""
    pm = _peft_model(models["sparse"], seed=3, target_modules=targets)
    pm.save_pretrained(str(tmp_path / "a"))
    prompt, steps = _prompt(0), 10
    ref = reference(pm, prompt, steps)
    hf_tokens, hf_logprobs = ref["tokens"], ref["logprobs"]
    ids = sorted(set(hf_logprobs.topk(12).indices.flatten().tolist()))  # (at most 128 ids)
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, logprob_token_ids=ids)
    with LLM(models["sparse"], **EXACT, num_pages=64, enable_lora=True, max_lora_rank=8) as llm:
        lora = LoRARequest("a", 1, str(tmp_path / "a"))
        (out,) = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)
        (base,) = llm.generate([prompt], params, use_tqdm=False)
        assert llm.engine.loras() == {"a": str(tmp_path / "a")}
        held = llm.engine.model.lora.adapters[llm.engine.lora.loaded["a"].id].weights
        layers = llm.engine.model_config.num_hidden_layers
        kv_b = {f"model.layers.{i}.self_attn.kv_b_proj" for i in range(layers)}
        assert kv_b <= set(held) and (targets == TARGETS or set(held) == kv_b)
    got = torch.tensor([[d[t].logprob for t in ids] for d in out.outputs[0].logprobs])
    # Measured (fp32): max |Δlogprob| ~2e-6 (the parity test's tolerance on logits)
    assert (got - hf_logprobs[:, ids]).abs().max().item() <= 1e-3
    assert list(out.outputs[0].token_ids) == hf_tokens
    assert list(base.outputs[0].token_ids) != hf_tokens  # (the adapter changes them)


# --- batches ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def alone(models, adapters) -> dict:
    """Each job's greedy tokens run alone (enable_lora, max_loras 2). Beside other requests
    a job's logprobs agree with these to fp32 rounding only (--enable-lora's torch path is
    not batch invariant), so the tests' exact token equality holds barring near-ties: on
    the dense model (index_topk covering every context) its greedy picks have none."""
    engine = _engine(models["dense"], max_loras=2, max_lora_rank=8)
    for name, path in adapters.items():
        engine.load_lora(name, path)
    out = {}
    for job in JOBS:
        engine.flush_cache()
        out[job] = _run(engine, [(_prompt(job[1], job[2]), job[0], 0)])[0]
    return out


# (adapter, prompt seed, prompt length): prompts of several chunks and of one
JOBS = [(None, 1, 45), ("a", 2, 37), ("b", 3, 20), ("a", 4, 12), ("b", 5, 50), (None, 6, 9)]


def test_a_batch_mixing_base_and_two_adapters_gives_each_its_alone_tokens(models, adapters, alone):
    """Requests arriving over steps (prefill chunks beside decodes, base beside A beside B,
    chunked at 16 tokens) each give their alone tokens (equal logprobs to fp32 rounding:
    `alone`); adapters do change the tokens."""
    engine = _engine(models["dense"], max_loras=2, max_lora_rank=8, chunked_prefill_size=16)
    for name, path in adapters.items():
        engine.load_lora(name, path)
    jobs = [(_prompt(s, n), lora, i) for i, (lora, s, n) in enumerate(JOBS)]
    assert _run(engine, jobs) == [alone[job] for job in JOBS]
    for lora in ("a", "b"):
        (prompt, _, _), *_ = [j for j in jobs if j[1] == lora]
        base = _run(engine, [(prompt, None, 0)])[0]
        assert base != _run(engine, [(prompt, lora, 0)])[0]


def test_a_base_request_under_enable_lora_gives_the_tokens_without_lora(models, alone):
    """The base model's tokens under --enable-lora (the torch path, no native blocks) are
    those of an engine without it, both on its torch path and on its default (native,
    deterministic) path. The paths' logprobs differ by fp32 rounding (other kernels), so
    tokens agree barring near-ties; measured: equal on both, on this dense model."""
    base_jobs = [job for job in JOBS if job[0] is None]
    for kw in (dict(enable_deterministic_inference=False), {}):
        engine = Engine(EngineConfig(models["dense"], **EXACT, num_pages=64, **kw))
        for job in base_jobs:
            assert _run(engine, [(_prompt(job[1], job[2]), None, 0)])[0] == alone[job], kw


# --- the prefix cache ---------------------------------------------------------------------


def test_the_prefix_cache_keeps_adapters_apart(models, adapters):
    """One prompt under A, B and the base model shares no page; under A again it hits; A
    unloaded and other weights loaded under its name do not hit its old pages. KV events
    carry each page's adapter (vLLM's lora_id, lora_name, its name in extra_keys)."""
    engine = _engine(models["dense"], max_loras=2, max_lora_rank=8)
    for name, path in adapters.items():
        engine.load_lora(name, path)
    engine.cache.events = []
    prompt = _prompt(7, 150)
    hit = (len(prompt) - 1) // PS * PS

    def once(lora: str | None) -> tuple[int, list[int], object]:
        req = engine.add_request(prompt, SamplingParams(**{**_greedy(), "lora_name": lora}))
        while engine.has_unfinished():
            engine.step()
        pages = [n.page for n in engine.cache.match(prompt, hit // PS, req.cache_key)]
        return req.metrics.prefix_hit_tokens, pages, req

    cold = {lora: once(lora) for lora in ("a", "b", None)}
    assert [h for h, _, _ in cold.values()] == [0, 0, 0]
    assert all(len(p) == hit // PS for _, p, _ in cold.values())
    a, b, base = (set(p) for _, p, _ in cold.values())
    assert not (a & b or a & base or b & base)
    again, pages, _ = once("a")
    assert again == hit and set(pages) == a

    ref = engine.lora.loaded["a"]
    stored = [e for e in to_events(engine.cache.events, PS) if type(e).__name__ == "BlockStored"]
    mine = [e for e in stored if e.lora_name == "a"]
    assert mine and all(e.lora_id == ref.id and e.extra_keys[0] == ("a",) for e in mine)
    assert all(e.lora_id is None for e in stored if e.lora_name is None)

    engine.unload_lora("a")
    assert engine.loras() == {"b": adapters["b"]}
    with pytest.raises(DsakvError, match="'a' is not loaded"):
        engine.add_request(prompt, SamplingParams(lora_name="a"))
    engine.load_lora("a", adapters["b"])  # other weights under the same name
    fresh, pages, req = once("a")
    assert fresh == 0 and not set(pages) & a
    assert once("b")[0] == hit  # (B's own tree: its name is part of it)
    # B unloaded and loaded again from its files: its tree stays, and the pages a request
    # on it stores there now carry the new load's lora_id
    engine.unload_lora("b")
    engine.load_lora("b", adapters["b"])
    engine.cache.events = []
    req = engine.add_request(prompt + _prompt(9, 40), SamplingParams(**_greedy(), lora_name="b"))
    while engine.has_unfinished():
        engine.step()
    assert req.metrics.prefix_hit_tokens == hit
    stored = [e for e in to_events(engine.cache.events, PS) if type(e).__name__ == "BlockStored"]
    assert stored and {e.lora_id for e in stored} == {engine.lora.loaded["b"].id}
    engine.check_integrity()
    # The namespace is the adapter's name and files, not its load: L3 finds it again.
    ns = req.cache_key
    same = LoraNamespace(ns.salt, ns.name, ns.digest, id=ns.id + 10)
    assert same == ns and root_hash(same) == root_hash(ns) != root_hash(None)


# --- slots --------------------------------------------------------------------------------


def test_more_adapters_than_slots_all_finish_with_their_alone_tokens(models, adapters, alone):
    """max_loras=1: A and B requests in flight at once wait for the slot (never two
    adapters running together), and every one finishes with its alone tokens."""
    engine = _engine(models["dense"], max_loras=1, max_lora_rank=8)
    for name, path in adapters.items():
        engine.load_lora(name, path)
    reqs = []
    for lora, s, n in JOBS:
        reqs.append(engine.add_request(_prompt(s, n), SamplingParams(**_greedy(), lora_name=lora)))
    while engine.has_unfinished():
        engine.step()
        running = {r.lora.name for r in engine.scheduler.running if r.lora is not None}
        assert len(running) <= 1
    assert [r.output_ids for r in reqs] == [alone[job] for job in JOBS]
    engine.check_integrity()


def test_a_request_waiting_for_a_slot_holds_back_no_other(models, adapters, alone):
    """max_loras=1 with A's request running: B's waits for the slot, keeping its place, and
    the base model's and A's requests queued behind it start at once (vLLM's scheduler
    skips B's, as here); B's then starts once A's end, and each gives its alone tokens.
    `lora_requests` counts them by adapter beside the counters, whose keys stay fixed."""
    from dsakv.metrics import LoraRequests

    engine = _engine(models["dense"], max_loras=1, max_lora_rank=8)
    for name, path in adapters.items():
        engine.load_lora(name, path)
    keys = set(engine.counters())
    jobs = [JOBS[1], JOBS[2], JOBS[0], JOBS[3]]  # A's, then B's, the base's, A's again

    def add(job: tuple) -> object:
        lora, seed, n = job
        return engine.add_request(_prompt(seed, n), SamplingParams(**_greedy(), lora_name=lora))

    a = add(jobs[0])
    engine.step()
    b, base, a2 = map(add, jobs[1:])
    engine.step()
    assert engine.scheduler.running == [a, base, a2] and list(engine.scheduler.waiting) == [b]
    assert engine.lora_requests() == LoraRequests({"a": 2}, {"b": 1})
    assert set(engine.counters()) == keys
    while engine.has_unfinished():
        engine.step()
    assert [r.output_ids for r in (a, b, base, a2)] == [alone[job] for job in jobs]
    engine.check_integrity()


def test_a_slot_goes_to_the_adapter_least_recently_used(models, adapters):
    """max_loras=2: A's request admitted first but decoding longer than B's; both ended, a
    request on C (A's weights under another name) takes B's slot, the one least recently
    used in a step, not A's, the one admitted first."""
    engine = _engine(models["dense"], max_loras=2, max_lora_rank=8)
    for name, path in {**adapters, "c": adapters["a"]}.items():
        engine.load_lora(name, path)
    for lora, most in (("a", 12), ("b", 2)):
        params = SamplingParams(**{**_greedy(), "max_tokens": most}, lora_name=lora)
        engine.add_request(_prompt(9, 20), params)
    while engine.has_unfinished():
        engine.step()
    engine.add_request(_prompt(10, 20), SamplingParams(**_greedy(), lora_name="c"))
    engine.step()
    assert [r.name for r in engine.lora.slots] == ["a", "c"]


def test_max_cpu_loras_evicts_the_least_recently_used_adapter(models, adapters, alone):
    """--max-cpu-loras 2: loading past it evicts the least recently used adapter no request
    holds from host memory (vLLM's LRU cache); it stays served and a request naming it
    reads it again, with its alone tokens. An adapter a request holds is never evicted
    (nor an unloaded one requests still hold, which counts); once they end, memory holds
    two again. Offline, LoRARequests on more adapters than that run."""
    engine = _engine(models["dense"], max_lora_rank=8, max_cpu_loras=2)
    paths = {**adapters, "c": adapters["a"], "d": adapters["b"]}

    def in_memory() -> list[str]:
        kept = set(engine.model.lora.adapters)
        assert kept == set(engine.lora.in_memory)
        return sorted(r.name for r in engine.lora.in_memory.values())

    for name in ("a", "b", "c"):
        engine.load_lora(name, paths[name])
    assert in_memory() == ["b", "c"] and sorted(engine.loras()) == ["a", "b", "c"]
    job = JOBS[1]
    req = engine.add_request(_prompt(job[1], job[2]), SamplingParams(**_greedy(), lora_name="a"))
    assert in_memory() == ["a", "c"]  # (read again; b the least recently used)
    engine.step()
    engine.unload_lora("a")  # (held by its request: it stays, and counts)
    engine.load_lora("d", paths["d"])
    assert in_memory() == ["a", "d"]
    on_b, on_d = JOBS[2], JOBS[4]  # (d: b's weights)
    d = engine.add_request(_prompt(*on_d[1:]), SamplingParams(**_greedy(), lora_name="d"))
    b = engine.add_request(_prompt(*on_b[1:]), SamplingParams(**_greedy(), lora_name="b"))
    assert in_memory() == ["a", "b", "d"]  # (each held: over the cap, for now)
    while engine.has_unfinished():
        engine.step()
    assert [r.output_ids for r in (req, b, d)] == [alone[job], alone[on_b], alone[on_d]]
    assert in_memory() == ["b", "d"] and sorted(engine.loras()) == ["b", "c", "d"]
    engine.check_integrity()
    with LLM(models["dense"], **EXACT, num_pages=64, enable_lora=True, max_lora_rank=8,
             max_cpu_loras=1) as llm:  # fmt: skip
        jobs = [job for job in JOBS if job[0] is not None]
        loras = [LoRARequest(lora, 1 + "ab".index(lora), adapters[lora]) for lora, _, _ in jobs]
        prompts = [_prompt(s, n) for _, s, n in jobs]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
        assert [list(o.outputs[0].token_ids) for o in outs] == [alone[job] for job in jobs]


def test_a_load_that_fails_evicts_nothing(models, adapters, alone, tmp_path):
    """--max-cpu-loras 2, full with A and B: a load that fails (a new name, load_inplace,
    or an evicted adapter's files read again) is read before anything is evicted, so A and
    B stay in host memory, unchanged, and serve their alone tokens."""
    engine = _engine(models["dense"], max_lora_rank=8, max_cpu_loras=2)
    gone = tmp_path / "gone"
    shutil.copytree(adapters["a"], gone)
    for name, path in {"gone": str(gone), **adapters}.items():  # (B evicts "gone")
        engine.load_lora(name, path)
    kept = dict(engine.lora.in_memory)
    assert sorted(r.name for r in kept.values()) == ["a", "b"]
    (gone / "adapter_model.safetensors").unlink()
    bad = _bad(models, tmp_path, "dora")
    for fails in (
        lambda: engine.load_lora("c", bad),
        lambda: engine.replace_lora("a", bad),
        lambda: engine.add_request([1, 2, 3], SamplingParams(lora_name="gone")),
    ):
        with pytest.raises(DsakvError):
            fails()
        assert engine.lora.in_memory == kept and set(engine.model.lora.adapters) == set(kept)
    jobs = [(_prompt(s, n), lora, 0) for lora, s, n in (JOBS[1], JOBS[2])]
    assert _run(engine, jobs) == [alone[JOBS[1]], alone[JOBS[2]]]
    assert engine.lora.in_memory == kept


def test_replace_lora_swaps_the_weights_in_one_call(models, adapters, alone, tmp_path):
    """vLLM's load_inplace (`Engine.replace_lora`): a bad adapter is refused and the old one
    stays served; a good one serves new requests on the name, while a request already on
    the old one finishes on its weights, which are dropped with it."""
    engine = _engine(models["dense"], max_lora_rank=8)
    engine.load_lora("x", adapters["a"])
    on_a, on_b = JOBS[1], JOBS[2]
    old = engine.add_request(_prompt(*on_a[1:]), SamplingParams(**_greedy(), lora_name="x"))
    engine.step()
    with pytest.raises(DsakvError, match=REFUSED["dora"]):
        engine.replace_lora("x", _bad(models, tmp_path, "dora"))
    assert engine.loras() == {"x": adapters["a"]}
    engine.replace_lora("x", adapters["b"])
    assert engine.loras() == {"x": adapters["b"]} and len(engine.model.lora.adapters) == 2
    new = engine.add_request(_prompt(*on_b[1:]), SamplingParams(**_greedy(), lora_name="x"))
    while engine.has_unfinished():
        engine.step()
    assert (old.output_ids, new.output_ids) == (alone[on_a], alone[on_b])
    assert list(engine.model.lora.adapters) == [engine.lora.loaded["x"].id]
    engine.check_integrity()


def test_beam_search_runs_on_the_adapter(models, adapters, alone):
    """vLLM's `LLM.beam_search(..., lora_request=)`: every step's requests run on it, so a
    one-beam search gives the adapter's greedy tokens (the base model's without it)."""
    kw = dict(EXACT, num_pages=64, enable_lora=True, max_lora_rank=8)
    with LLM(models["dense"], **kw) as llm:
        for lora, job in (("a", JOBS[1]), (None, JOBS[0])):
            prompt = _prompt(*job[1:])
            lr = None if lora is None else LoRARequest(lora, 1, adapters[lora])
            params = BeamSearchParams(1, 8, ignore_eos=True)
            (out,) = llm.beam_search([prompt], params, lora_request=lr)
            assert out.sequences[0].tokens[len(prompt) :] == alone[job], lora


@pytest.mark.parametrize("algorithm", ["mtp", "ngram"])
def test_speculative_decoding_keeps_each_requests_tokens(models, adapters, alone, algorithm):
    """Drafts (the MTP layer's run base weights) verified under each request's adapter:
    the same tokens as without drafts."""
    engine = _engine(models["dense"], max_loras=2, max_lora_rank=8, speculative_algorithm=algorithm)
    for name, path in adapters.items():
        engine.load_lora(name, path)
    jobs = [(_prompt(s, n), lora, i) for i, (lora, s, n) in enumerate(JOBS)]
    assert _run(engine, jobs) == [alone[job] for job in JOBS]


def test_unloading_lets_running_requests_finish(models, adapters, alone):
    engine = _engine(models["dense"], max_lora_rank=8)
    engine.load_lora("a", adapters["a"])
    job = JOBS[1]
    req = engine.add_request(_prompt(job[1], job[2]), SamplingParams(**_greedy(), lora_name="a"))
    engine.step()
    engine.unload_lora("a")
    assert engine.loras() == {} and engine.model.lora.adapters  # (kept for its request)
    while engine.has_unfinished():
        engine.step()
    assert req.output_ids == alone[job]
    assert not engine.model.lora.adapters  # dropped with its last request
    with pytest.raises(DsakvError, match="'a' is not loaded"):
        engine.unload_lora("a")


def test_a_pd_decode_request_holds_its_adapter_and_waits_for_a_slot(models, adapters, alone):
    """Prefill/decode disaggregation's engine side (`dsakv.engine.disagg`; the KV copied
    pool to pool, as the servers' transfer writes it): a decode request on an adapter holds
    it from its reservation (a reservation refused, or dropped, lets it go: an unload then
    drops it) and, max_loras=1 with B's request running, starts decoding on A (and C, A's
    weights under another name) only once the slot frees, one adapter at a time; each gives
    its alone tokens, and A's pages are cached under A's name."""
    from dsakv.engine import disagg
    from dsakv.memory import copy_tokens

    kw = dict(max_loras=1, max_lora_rank=8, max_running_requests=3)
    prefill, decode = _engine(models["dense"], **kw), _engine(models["dense"], **kw)
    for engine in (prefill, decode):
        for name, path in {**adapters, "c": adapters["a"]}.items():
            engine.load_lora(name, path)

    def handed_off(job: tuple) -> object:
        lora, seed, n = job
        prompt = _prompt(seed, n)
        one = SamplingParams(**{**_greedy(), "max_tokens": 1}, lora_name=lora)
        first = prefill.add_request(prompt, one)
        disagg.hold(prefill, first)
        while prefill.has_unfinished():
            prefill.step()
        req = disagg.reserve(decode, prompt, SamplingParams(**_greedy(), lora_name=lora))
        src, dst = prefill.scheduler.slots(first, n), decode.scheduler.slots(req, n)
        copy_tokens(decode.pool, dst, prefill.pool, src)
        disagg.release_held(prefill, first)
        disagg.start_decoding(decode, req, first.output_ids[0])
        return req

    on_a, on_b = JOBS[1], JOBS[2]
    b = handed_off(on_b)
    decode.step()
    a, c = handed_off(on_a), handed_off(("c", *on_a[1:]))
    assert not {a, c} & set(decode.scheduler.running)  # B holds the slot
    assert disagg.reserve(decode, [1, 2], SamplingParams(lora_name="a")) is None  # 3 admitted
    assert sorted(decode.lora.held) == sorted([a.rid, b.rid, c.rid])  # (the refused let A go)
    while decode.has_unfinished():
        decode.step()
        assert len({r.lora.name for r in decode.scheduler.running}) <= 1
    assert [r.output_ids for r in (a, b, c)] == [alone[on_a], alone[on_b], alone[on_a]]
    prompt = _prompt(on_a[1], on_a[2])
    assert decode.cache.match(prompt, 2, a.cache_key) and not decode.cache.match(prompt, 2, None)

    ref = decode.lora.loaded["a"]
    req = disagg.reserve(decode, prompt, SamplingParams(**_greedy(), lora_name="a"))
    decode.unload_lora("a")
    assert ref.id in decode.model.lora.adapters  # (kept for the reservation)
    disagg.drop(decode, req)
    assert ref.id not in decode.model.lora.adapters and not decode.lora.held
    decode.check_integrity()
    prefill.check_integrity()


# --- refusals -----------------------------------------------------------------------------


def _edit_config(path: str, **changes) -> None:
    config = Path(path) / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **changes}))


def _bad(models, root: Path, case: str) -> str:
    out = root / case
    good = dict(target_modules=["q_a_proj", "o_proj"])
    if case == "rank":
        return _adapter(models["dense"], out, 0, r=16, **good)
    if case == "dora":
        return _adapter(models["dense"], out, 0, use_dora=True, **good)
    path = _adapter(models["dense"], out, 0, **good)
    weights = Path(path) / "adapter_model.safetensors"
    if case == "bias":
        _edit_config(path, bias="all")
    elif case == "modules_to_save":
        _edit_config(path, modules_to_save=["lm_head"])
    elif case == "bdlora":
        _edit_config(path, use_bdlora={"target_modules_bd_a": ["o_proj"], "nblocks": 2})
    elif case == "peft_type":
        _edit_config(path, peft_type="IA3")
    elif case == "shape":
        tensors = load_file(str(weights))
        key = next(k for k in tensors if "o_proj.lora_A" in k)
        tensors[key] = tensors[key][:, :-1].contiguous()
        save_file(tensors, str(weights))
    elif case == "0-dim":
        tensors = load_file(str(weights))
        key = next(k for k in tensors if "o_proj.lora_A" in k)
        tensors[key] = torch.tensor(1.0)
        save_file(tensors, str(weights))
    elif case == "pattern":
        _edit_config(path, alpha_pattern={"o_proj(": 4})
    elif case == "alpha":
        _edit_config(path, lora_alpha=float("nan"))
    elif case == "nested":
        (Path(path) / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    elif case == "layer":  # (a 5,000-digit layer number: int() refused it, a traceback)
        tensors = load_file(str(weights))
        for key in [k for k in tensors if "layers.0.self_attn.o_proj.lora_" in k]:
            tensors[key.replace("layers.0.", "layers." + "9" * 5000 + ".")] = tensors.pop(key)
        save_file(tensors, str(weights))
    elif case == "missing":
        weights.unlink()
    elif case == "garbled":
        weights.write_bytes(b"not safetensors")
    return path


REFUSED = {
    "rank": r"\.\w+ has rank 16, more than --max-lora-rank 8",
    "bdlora": r"block-diagonal LoRA \(use_bdlora\) is not supported",
    "dora": "use_dora",
    "bias": "bias 'all' is not supported",
    "modules_to_save": "modules_to_save is not supported",
    "peft_type": "peft_type is 'IA3'",
    "shape": r"o_proj: lora_A \[8, 127\] and lora_B \[64, 8\] do not fit its base weight",
    "0-dim": r"o_proj: lora_A \[\] and lora_B \[64, 8\] do not fit its base weight",
    "pattern": "alpha_pattern key 'o_proj\\(': not a regex",
    "alpha": "lora_alpha nan is not a finite number",
    "nested": "adapter_config.json is not valid JSON: nested too deeply",
    "layer": r"layers\.9{5000}\.self_attn\.o_proj: this module cannot be adapted",
    "missing": "no adapter_model.safetensors",
    "garbled": "adapter_model.safetensors cannot be read",
}


@pytest.fixture(scope="module")
def refusing(models) -> Engine:
    return _engine(models["dense"], max_lora_rank=8)


def assert_refused(engine: Engine, path: str, pattern: str) -> None:
    """Loading the adapter at `path` is one error line naming it and matching `pattern`,
    and leaves nothing loaded."""
    with pytest.raises(DsakvError, match=pattern) as e:
        engine.load_lora("x", path)
    assert "\n" not in str(e.value) and path in str(e.value)
    assert engine.loras() == {} and not engine.model.lora.adapters


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_bad_adapter_is_one_clear_error(models, refusing, tmp_path, case):
    assert_refused(refusing, _bad(models, tmp_path, case), REFUSED[case])


def test_a_rank_pattern_matching_no_module_sizes_nothing(models, refusing, tmp_path):
    """PEFT ignores a rank_pattern key that matches no module (it warns); the tensors' own
    ranks are what --max-lora-rank bounds."""
    path = _adapter(models["dense"], tmp_path / "a", seed=3, r=4, target_modules=["o_proj"])
    _edit_config(path, rank_pattern={"lm_head": 64})
    refusing.load_lora("unmatched", path)
    assert refusing.loras() == {"unmatched": path}
    refusing.unload_lora("unmatched")


def test_requests_and_settings_refused(models, refusing, adapters):
    with pytest.raises(DsakvError, match="'nope' is not loaded"):
        refusing.add_request([1, 2, 3], SamplingParams(lora_name="nope"))
    with pytest.raises(DsakvError, match="already loaded"):
        refusing.load_lora("a", adapters["a"])
        refusing.load_lora("a", adapters["a"])
    refusing.unload_lora("a")
    plain = Engine(EngineConfig(models["dense"], **EXACT, num_pages=16))
    with pytest.raises(DsakvError, match="--enable-lora"):
        plain.add_request([1, 2, 3], SamplingParams(lora_name="a"))
    assert plain.loras() == {}
    for kw, message in (
        (dict(max_loras=2), "--max-loras needs --enable-lora"),
        (dict(lora_modules=[("a", "p")]), "--lora-modules needs --enable-lora"),
        (dict(enable_lora=True, max_lora_rank=0), "max_lora_rank must be"),
        (dict(enable_lora=True, max_loras=2, max_cpu_loras=1), "--max-cpu-loras 1 is less"),
        (dict(enable_lora=True, enable_torch_compile=True), "--enable-torch-compile"),
        (dict(enable_lora=True, tp=2, dp_attention=True), "--dp-attention"),
    ):
        with pytest.raises(DsakvError, match=message):
            EngineConfig(models["dense"], **kw)
    with pytest.raises(DsakvError, match="lora_name must be"):
        SamplingParams(lora_name="")


def test_a_shared_layers_indexer_keys_are_skipped(tmp_path):
    """DeepSeek-V3.2 has an indexer on every layer; with index sharing dsakv builds one on
    the full layers only, and an adapter on every layer's wq_b loads (the shared layers'
    keys skipped, and the MTP layer's: the draft runs base weights) and runs."""
    preset = copy.deepcopy(TINY_PRESETS["deepseek-tiny"])
    model = str(write_tiny_model(tmp_path / "ds", preset=preset, seed=2))
    path = _adapter(model, tmp_path / "wq_b", 0, target_modules=["wq_b"])
    layers = preset["num_hidden_layers"]
    weights = f"{path}/adapter_model.safetensors"
    tensors = load_file(weights)
    assert len(tensors) == 2 * layers
    mtp = {k.replace(".0.", f".{layers}."): t.clone() for k, t in tensors.items() if ".0." in k}
    save_file({**tensors, **mtp}, weights)
    engine = _engine(model, max_lora_rank=8, index_topk_freq=2, lora_modules=[("w", path)])
    held = engine.model.lora.adapters[engine.lora.loaded["w"].id].weights
    full = [i for i in range(layers) if engine.plan.runs_indexer(i)]
    assert 0 < len(full) < layers
    assert sorted(held) == [f"model.layers.{i}.self_attn.indexer.wq_b" for i in full]
    assert len(_run(engine, [(_prompt(8, 30), "w", 0)])[0]) == 8


# --- ranks --------------------------------------------------------------------------------


def test_tp2_gives_tp1_tokens_with_adapters(models, adapters, alone, tmp_path):
    """Under --tp 2 each rank holds its slices of A / B (kv_b_proj's B: its heads' rows);
    adapters loaded at start and at run time reach both ranks, a bad one is refused on
    both, and the tokens are TP=1's."""
    kw = dict(EXACT, num_pages=64, tp=2, enable_lora=True, max_loras=2, max_lora_rank=8)
    with LLM(models["dense"], **kw, lora_modules=[("a", adapters["a"])]) as llm:
        prompts = [_prompt(s, n) for _, s, n in JOBS]
        loras = [
            None if lora is None else LoRARequest(lora, 1, adapters[lora]) for lora, _, _ in JOBS
        ]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
        assert [list(o.outputs[0].token_ids) for o in outs] == [alone[job] for job in JOBS]
        key = "base_model.model.model.layers.0.self_attn.kv_b_proj.lora_{}.weight"
        full = load_file(f"{adapters['a']}/adapter_model.safetensors")
        held = llm.engine.model.lora.adapters[llm.engine.lora.loaded["a"].id].weights
        a, b = held["model.layers.0.self_attn.kv_b_proj"]  # (rank 0's: the first heads)
        assert a.shape == full[key.format("A")].shape
        assert 2 * b.shape[0] == full[key.format("B")].shape[0]
        with pytest.raises(DsakvError, match=REFUSED["dora"]):
            llm.engine.load_lora("bad", _bad(models, tmp_path, "dora"))
        assert sorted(llm.engine.loras()) == ["a", "b"]
        # unloaded under its running request: dropped on every rank as that one ends
        engine, job = llm.engine, JOBS[1]
        req = engine.add_request(_prompt(*job[1:]), SamplingParams(**_greedy(), lora_name="a"))
        engine.step()
        engine.unload_lora("a")
        assert _run(engine, [(_prompt(*JOBS[2][1:]), "b", 0)]) == [alone[JOBS[2]]]
        assert req.output_ids == alone[job] and list(engine.model.lora.adapters) == [2]
        engine.check_integrity()


def test_sleep_gives_back_the_adapter_slots_and_wakes_with_them(models, adapters):
    """Sleep mode frees the adapters' slots with the weights (they were left on the device),
    and wake_up brings them back bit for bit: the adapter's tokens are unchanged."""
    engine = _engine(models["dense"])
    engine.load_lora("a", adapters["a"])
    before = _run(engine, [(_prompt(7), "a", 0)])
    slots = list(engine.model.lora.tensors())
    engine.sleep(1)
    assert all(t.untyped_storage().size() == 0 for t in slots)
    engine.wake_up()
    assert _run(engine, [(_prompt(7), "a", 0), (_prompt(7), None, 0)])[0] == before[0]
