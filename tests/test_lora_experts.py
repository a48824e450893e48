"""LoRA on the routed experts (`--enable-lora`): PEFT's `target_parameters` adapters on the
fused `mlp.experts.gate_up_proj` / `down_proj` match transformers + PEFT, vLLM's per-expert
format (`experts.{e}.gate_proj` ...) of the same deltas gives the same output, batches
mixing base, expert and other adapters give each request its alone tokens (only the
tokens whose adapter holds expert weights run the LoRA loop, the others the backend's op),
an FP8 checkpoint's packed experts take an adapter as dequantized ones, TP=2 and TP=2 +
EP=2 give TP=1's, and malformed expert adapters are one clear error each.

The tiny GLM-5 model is dense (index_topk covering every context), fp32: exact comparisons
are fair."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsakv import LLM, LoRARequest, SamplingParams
from dsakv.kernels import TorchBackend, torch_ops
from dsakv.models.tiny import TINY_PRESETS, write_tiny_model

from .test_lora import (
    EXACT,
    GREEDY,
    _engine,
    _peft_model,
    _prompt,
    _run,
    assert_refused,
    dense_tiny,
    reference,
)

peft = pytest.importorskip("peft")

FUSED = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ATTENTION = ["q_a_proj", "o_proj"]
KW = dict(EXACT, num_pages=64, enable_lora=True, max_lora_rank=8)
STEPS = 10
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return dense_tiny(tmp_path_factory.mktemp("experts"))


def _reference(pm, prompt: list[int]) -> dict:
    return reference(pm, prompt, STEPS)


def _per_expert(pm, fused: Path, out: Path) -> str:
    """`pm`'s adapter (saved at `fused`) with its experts' deltas as per-expert keys: expert
    e's gate / up / down A_e and B_e (PEFT's `get_delta_factors`: A's rows expert-major, B's
    columns rank-major), read off each `ParamWrapper` by the param it wraps, not by key."""
    from peft.tuners.lora.layer import ParamWrapper

    tensors = {k: t for k, t in load_file(fused / WEIGHTS).items() if ".mlp.experts." not in k}
    for name, mod in pm.named_modules():
        if not isinstance(mod, ParamWrapper):
            continue
        prefix = name.removeprefix("base_model.model.").replace(".base_layer", "")
        e = mod.num_experts
        a, b = mod.lora_A["default"].weight.detach(), mod.lora_B["default"].weight.detach()
        r = a.shape[0] // e
        a, b = a.view(e, r, -1), b.view(b.shape[0], r, e)
        for x in range(e):
            ax, bx = a[x], b[:, :, x]
            if mod.parameter_name == "down_proj":
                parts = {"down_proj": (ax, bx)}
            else:
                n = bx.shape[0] // 2
                parts = {"gate_proj": (ax, bx[:n]), "up_proj": (ax, bx[n:])}
            for proj, (pa, pb) in parts.items():
                key = f"base_model.model.{prefix}.{x}.{proj}.lora_"
                tensors[key + "A.weight"], tensors[key + "B.weight"] = pa.clone(), pb.clone()
    out.mkdir()
    save_file(tensors, str(out / WEIGHTS))
    config = json.loads((fused / "adapter_config.json").read_text())
    config.update(target_parameters=None, target_modules=[*ATTENTION, "gate_proj", "up_proj",
                                                          "down_proj"])  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(config))
    return str(out)


def _without_experts(fused: Path, out: Path) -> str:
    shutil.copytree(fused, out)
    tensors = load_file(out / WEIGHTS)
    save_file({k: t for k, t in tensors.items() if ".mlp.experts." not in k}, str(out / WEIGHTS))
    return str(out)


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory) -> dict:
    """PEFT adapters of random A and B: `fused` (target_parameters on both expert params,
    plus attention), `renamed` (PEFT's own rename of transformers-4 gate_proj/up_proj
    targets: target_parameters gate_up_proj at rank 2r by rank_pattern / alpha_pattern),
    and the fused one's deltas per expert, without its experts, and attention only."""
    root = tmp_path_factory.mktemp("adapters")
    prompt = _prompt(0)
    fused = _peft_model(model, 3, r=4, target_modules=ATTENTION, target_parameters=FUSED)
    fused.save_pretrained(str(root / "fused"))
    renamed = _peft_model(model, 5, r=4, target_modules=["gate_proj", "up_proj"], rename=True)
    renamed.save_pretrained(str(root / "renamed"))
    attention = _peft_model(model, 4, r=4, target_modules=ATTENTION)
    attention.save_pretrained(str(root / "attention"))
    return {
        "fused": str(root / "fused"),
        "renamed": str(root / "renamed"),
        "attention": str(root / "attention"),
        "per_expert": _per_expert(fused, root / "fused", root / "per_expert"),
        "no_experts": _without_experts(root / "fused", root / "no_experts"),
        "reference": {"fused": _reference(fused, prompt), "renamed": _reference(renamed, prompt)},
    }


@pytest.fixture(scope="module")
def llm(model):
    with LLM(model, **KW) as llm:
        yield llm


def _logprobs(llm, path: str | None, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, logprob_token_ids=ids)
    lora = None if path is None else LoRARequest(Path(path).name, 1, path)
    (out,) = llm.generate([_prompt(0)], params, use_tqdm=False, lora_request=lora)
    got = torch.tensor([[d[t].logprob for t in ids] for d in out.outputs[0].logprobs])
    return got, list(out.outputs[0].token_ids)


# --- parity with transformers + PEFT --------------------------------------------------------


@pytest.mark.parametrize("case", ["fused", "renamed"])
def test_expert_adapter_matches_transformers_peft(llm, adapters, case):
    """dsakv's logprobs of each step's likeliest tokens and its greedy tokens are
    transformers + PEFT's. Measured (fp32): max |Δlogprob| 1.4e-6 for both (the base model
    is 2.7 and 0.59 off); the fused adapter without its experts' keys is 0.73 off (checked
    here: the experts' delta is what the tolerance tests)."""
    ref = adapters["reference"][case]
    ids = sorted(set(ref["logprobs"].topk(12).indices.flatten().tolist()))
    got, tokens = _logprobs(llm, adapters[case], ids)
    assert (got - ref["logprobs"][:, ids]).abs().max().item() <= 1e-3
    assert tokens == ref["tokens"]
    # (the adapter changes them; the fused one's experts too)
    for other in [None] + (["no_experts"] if case == "fused" else []):
        off, _ = _logprobs(llm, other and adapters[other], ids)
        assert (off - ref["logprobs"][:, ids]).abs().max().item() > 0.05, other


def test_per_expert_keys_give_the_fused_adapters_output(llm, adapters):
    """vLLM's per-expert keys holding the fused adapter's A_e and B_e rows: the same
    logprobs to fp32 rounding (measured: max |Δ| 9.5e-7), the same tokens. Experts or
    projections an adapter leaves out are zero in its slots; the MTP layer's expert keys
    are skipped (the draft runs base weights)."""
    ids = sorted(
        set(adapters["reference"]["fused"]["logprobs"].topk(12).indices.flatten().tolist())
    )
    fused, fused_tokens = _logprobs(llm, adapters["fused"], ids)
    per_expert, tokens = _logprobs(llm, adapters["per_expert"], ids)
    assert (per_expert - fused).abs().max().item() <= 1e-4 and tokens == fused_tokens
    subset = Path(adapters["per_expert"]).parent / "subset"
    shutil.copytree(adapters["per_expert"], subset)
    tensors = load_file(subset / WEIGHTS)
    keep = {k: t for k, t in tensors.items() if ".experts." not in k or ".experts.2.gate_proj" in k}
    mtp = {
        k.replace("layers.1.", "layers.8."): t.clone()
        for k, t in keep.items()
        if "layers.1.mlp" in k
    }
    save_file({**keep, **mtp}, str(subset / WEIGHTS))
    llm.engine.load_lora("subset", str(subset))
    held = llm.engine.model.lora.adapters[llm.engine.lora.loaded["subset"].id].weights
    a, b = held["model.layers.1.mlp.experts.gate_proj"]
    assert a.shape == (8, 4, 64) and b.shape == (8, 32, 4)
    assert a[2].abs().sum() > 0 and not a[[0, 1, *range(3, 8)]].any() and not b[:2].any()
    assert "model.layers.1.mlp.experts.up_proj" not in held
    assert mtp and not [name for name in held if "layers.8." in name]


# --- batches and ranks ----------------------------------------------------------------------


# (adapter, prompt seed, prompt length): prompts of several chunks and of one
JOBS = [
    (None, 1, 45), ("fused", 2, 37), ("attention", 3, 20), ("per_expert", 4, 12),
    ("fused", 5, 50), (None, 6, 9),
]  # fmt: skip


@pytest.fixture(scope="module")
def alone(model, adapters) -> dict:
    """Each job's greedy tokens run alone (TP=1)."""
    engine = _engine(model, max_loras=2, max_lora_rank=8)
    for name in ("fused", "attention", "per_expert"):
        engine.load_lora(name, adapters[name])
    out = {}
    for job in JOBS:
        engine.flush_cache()
        out[job] = _run(engine, [(_prompt(job[1], job[2]), job[0], 0)])[0]
    return out


def test_a_batch_mixing_base_expert_and_other_adapters_gives_each_its_alone_tokens(
    model, adapters, alone
):
    """Requests arriving over steps (chunks beside decodes; base, expert adapters and an
    attention-only one side by side, two slots) each give their alone tokens (equal
    logprobs to fp32 rounding; the dense model's greedy picks have no near-ties)."""
    engine = _engine(model, max_loras=2, max_lora_rank=8, chunked_prefill_size=16)
    for name in ("fused", "attention", "per_expert"):
        engine.load_lora(name, adapters[name])
    jobs = [(_prompt(s, n), lora, i) for i, (lora, s, n) in enumerate(JOBS)]
    assert _run(engine, jobs) == [alone[job] for job in JOBS]
    assert alone[JOBS[1]] != _run(engine, [(_prompt(*JOBS[1][1:]), None, 0)])[0]


@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=2, ep=2)], ids=["tp2", "tp2-ep2"])
def test_tp2_and_ep2_give_tp1_tokens(model, adapters, alone, layout):
    """Under --tp 2 each rank holds its intermediate slice of every expert's gate/up B rows
    and down A columns (a partial delta, reduced with the base output); under --ep 2 its
    own experts whole. The tokens are TP=1's."""
    with LLM(model, **KW, **layout, max_loras=2) as llm:
        prompts = [_prompt(s, n) for _, s, n in JOBS]
        loras = [None if x is None else LoRARequest(x, 1, adapters[x]) for x, _, _ in JOBS]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
        assert [list(o.outputs[0].token_ids) for o in outs] == [alone[job] for job in JOBS]
        held = llm.engine.model.lora.adapters[llm.engine.lora.loaded["fused"].id].weights
        gate_a, gate_b = held["model.layers.1.mlp.experts.gate_proj"]
        down_a, _ = held["model.layers.1.mlp.experts.down_proj"]
        experts, inter = (4, 32) if "ep" in layout else (8, 16)  # (of 8 experts, I = 32)
        assert gate_a.shape == (experts, 4, 64) and gate_b.shape == (experts, inter, 4)
        assert down_a.shape == (experts, 4, inter)


# --- FP8 checkpoints; which tokens run the loop ---------------------------------------------


def test_an_fp8_checkpoints_packed_experts_take_the_adapter_as_dequantized_ones(
    model, adapters, tmp_path
):
    """On the CPU (`--dtype auto`) FP8 experts stay packed (each row's e4m3 bytes, then its
    block scales: the last dim is the packed width): the slots take the experts' sizes, and
    the loop unpacks each expert as it runs, so the adapter gives the logprobs the same
    checkpoint dequantized at load (`--dtype float32`) gives under it (measured: equal
    bit for bit), its experts' delta included."""
    dense = copy.deepcopy(TINY_PRESETS["glm-tiny"])
    dense["index_topk"] = 4096
    fp8 = str(write_tiny_model(tmp_path / "fp8", preset=dense, seed=1, weights="fp8"))
    ids = list(range(0, 256, 8))
    got = {}
    for dtype in ("auto", "float32"):
        with LLM(fp8, **KW, dtype=dtype) as llm:
            packed = llm.engine.model.target_layers[1].mlp.experts.down_proj
            assert (packed.dtype == torch.uint8) == (dtype == "auto")
            got[dtype] = [_logprobs(llm, adapters[x], ids) for x in ("fused", "no_experts")]
    (fused, tokens), (no_experts, _) = got["auto"]
    assert (fused - got["float32"][0][0]).abs().max().item() <= 1e-5
    assert tokens == got["float32"][0][1]
    assert (fused - no_experts).abs().max().item() > 0.05  # (the experts' delta is there)


def test_a_request_whose_adapter_holds_no_expert_weights_runs_the_backends_op(model, adapters):
    """An attention-only adapter's request while an expert adapter holds the other slot
    runs the experts as without LoRA (the backend's op, here the CPU one-token GEMV at
    decode): its logprobs are bit for bit those it has before any expert adapter was
    loaded (the loop's differed: 9.5e-7)."""
    ids = list(range(0, 256, 8))
    with LLM(model, **KW, max_loras=2) as llm:
        before, _ = _logprobs(llm, adapters["attention"], ids)
        _logprobs(llm, adapters["fused"], ids)
        assert llm.engine.lora.loaded["fused"].id in llm.engine.model.lora.resident
        llm.engine.flush_cache()
        after, _ = _logprobs(llm, adapters["attention"], ids)
    assert torch.equal(after, before)


class _Grouped(TorchBackend):
    """The CUDA backend's experts op (`experts_grouped`, batch invariant), which runs on the
    CPU too; its bf16 sums differ from the loop's (by up to 7.8e-3 on this layer)."""

    def experts(self, x, ids, weights, gate_up, down, first, last):
        return torch_ops.experts_grouped(x, ids, weights, gate_up, down, first, last)


@pytest.mark.parametrize("slots", [(-1, 0, 1), (1, -1)], ids=["mixed", "no-expert-weights"])
def test_only_tokens_whose_adapter_holds_expert_weights_run_the_loop(model, adapters, slots):
    """In a step with an expert adapter (slot 0) beside base tokens and an attention-only
    adapter's (slot 1), these run the backend's op: their rows are what the step gives
    without LoRA, bit for bit (bf16, the batch-invariant grouped op); the adapter's rows
    are the loop's, with its delta. A step whose tokens' adapters hold no expert weights
    runs the op alone."""
    engine = _engine(model, max_loras=2, max_lora_rank=8)
    for name in ("fused", "attention"):
        engine.load_lora(name, adapters[name])
    table = [engine.lora.loaded[name].id for name in ("fused", "attention")]
    moe = engine.model.target_layers[1].mlp
    moe.experts.ops = _Grouped()
    lens = [3, 4, 5][: len(slots)]
    engine.model.lora.prepare((table, slots), lens)
    x = torch.randn(sum(lens), 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.inference_mode():
        ids, weights = moe.gate(x)
        got = moe.experts(x, ids, weights)
        gate_up, down = moe.experts.gate_up_proj, moe.experts.down_proj
        without = moe.experts.ops.experts(x, ids, weights, gate_up, down, 0, 8)
    adapted = torch.tensor([s == 0 for s, n in zip(slots, lens) for _ in range(n)])
    assert torch.equal(got[~adapted], without[~adapted])
    if adapted.any():
        args = (gate_up, down, 0, engine.model.lora.mask[adapted])
        with torch.inference_mode():
            loop = moe.experts.lora.experts(x[adapted], ids[adapted], weights[adapted], *args)
        assert torch.equal(got[adapted], loop)
        assert (got[adapted] - without[adapted]).abs().amax(-1).min().item() > 0.01


# --- refusals -------------------------------------------------------------------------------


def _edit(path: Path, change) -> None:
    tensors = load_file(path / WEIGHTS)
    change(tensors)
    save_file(tensors, str(path / WEIGHTS))


def _config(path: Path, **changes) -> None:
    config = path / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **changes}))


def _copied(old: str, new: str):
    """An edit adding a copy of each tensor whose key holds `old`, under `new`."""
    return lambda t: t.update({k.replace(old, new): v.clone() for k, v in t.items() if old in k})


def _key(tensors: dict, part: str) -> str:
    return next(k for k in sorted(tensors) if part in k)


def _bad(adapters: dict, root: Path, case: str) -> str:
    source = "per_expert" if case in ("index", "shape", "dense", "mixed") else "fused"
    out = root / case
    shutil.copytree(adapters[source], out)
    if case == "experts":  # gate_up_proj's A and B of 7 experts, for 8

        def seven(t: dict) -> None:
            a = _key(t, "layers.1.mlp.experts.base_layer.lora_A")
            b = a.replace("lora_A", "lora_B")
            t[a], t[b] = t[a][:-4].contiguous(), t[b][:, :-4].contiguous()

        _edit(out, seven)
    elif case == "index":
        _edit(out, _copied("experts.7.", "experts.8."))
    elif case == "shape":

        def narrow(t: dict) -> None:
            k = _key(t, "layers.1.mlp.experts.0.gate_proj.lora_A")
            t[k] = t[k][:, :-1].contiguous()

        _edit(out, narrow)
    elif case == "dense":  # layer 0 has a dense MLP
        _edit(out, _copied("layers.1.mlp", "layers.0.mlp"))
    elif case == "mixed":
        fused = load_file(Path(adapters["fused"]) / WEIGHTS)
        _edit(out, lambda t: t.update({k: v for k, v in fused.items() if "layers.1.mlp" in k}))
        _config(out, target_parameters=FUSED)
    elif case == "target":
        _config(out, target_parameters=[*FUSED, "self_attn.o_proj.weight"])
    elif case == "nesting":  # two wrappers' keys, one param named
        _config(out, target_parameters=["mlp.experts.down_proj"])
    elif case in ("nan", "inf"):
        part, value = {"nan": ("o_proj.lora_B", "nan"), "inf": ("experts.lora_A", "inf")}[case]

        def poison(t: dict) -> None:
            t[_key(t, part)][0, 0] = float(value)

        _edit(out, poison)
    return str(out)


REFUSED = {
    "experts": r"layers\.1\.mlp\.experts\.gate_up_proj: lora_A \[28, 64\] and lora_B \[64, 28\] "
    r"do not fit its base weight \[8, 64, 64\] \(8 experts\)",
    "index": r"layers\.1\.mlp\.experts\.8: no expert 8 \(layer 1 has experts 0\.\.7",
    "shape": r"experts\.0\.gate_proj: lora_A \[4, 63\] and lora_B \[32, 4\] do not fit",
    "dense": "layer 0 has no routed experts",
    "mixed": "both per-expert keys and target_parameters' fused keys",
    "target": "target_parameters 'self_attn.o_proj.weight': only the routed experts' fused",
    "nesting": r"do not match target_parameters' \['down_proj'\]",
    "nan": r"tensor base_model\.model\.model\.layers\.0\.self_attn\.o_proj\.lora_B\.weight "
    "holds NaN or inf",
    "inf": r"tensor base_model\.model\.model\.layers\.1\.mlp\.experts\.lora_A\.weight holds",
}


@pytest.fixture(scope="module")
def refusing(model):
    return _engine(model, max_lora_rank=8)


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_bad_expert_adapter_is_one_clear_error(adapters, refusing, tmp_path, case):
    assert_refused(refusing, _bad(adapters, tmp_path, case), REFUSED[case])
