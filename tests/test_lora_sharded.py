"""vLLM's --fully-sharded-loras: under --tp every adapter tensor of every slot is split over
the ranks that split its layer (column-parallel A by rank, row-parallel B by rows, the
routed experts' over their moe_tp ranks), and the tokens and logprobs are TP=1's; the
per-rank slot bytes are exactly what the shapes say, less than without it; a rank that
does not split over --tp is refused in one line. Under --pp-size each stage holds and reads
its own layers' part of an adapter, for TP=1's tokens too.

The tiny GLM-5 model is dense (index_topk covering every context), fp32: tight comparisons
are fair."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsakv import LLM, LoRARequest, SamplingParams
from dsakv.config.parallel import ParallelConfig
from dsakv.distributed.parallel import ParallelState
from dsakv.engine import EngineConfig
from dsakv.errors import DsakvError
from dsakv.models.loader import load_model
from dsakv.models.lora import LoraSlots, read_adapter
from dsakv.models.tiny import TINY_PRESETS

from .conftest import cli_error_line
from .test_lora import EXACT, _peft_model, _prompt, dense_tiny
from .test_lora_experts import FUSED, _per_expert

peft = pytest.importorskip("peft")

S, R = 2, 8  # --max-loras, --max-lora-rank
KW = dict(EXACT, num_pages=64, enable_lora=True, max_loras=S, max_lora_rank=R)
IDS = list(range(0, 256, 4))  # (the logprobs compared: 64 fixed ids each step)
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprob_token_ids=IDS)
# (adapter, prompt seed, prompt length): base beside both adapters in one batch
JOBS = [(None, 1, 45), ("every", 2, 37), ("experts", 3, 20), ("every", 4, 12), ("experts", 5, 50)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return dense_tiny(tmp_path_factory.mktemp("sharded"))


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory) -> dict[str, str]:
    """`every`: rank R on every module (attention, indexer, dense MLP, shared experts,
    PEFT's fused routed experts); `experts`: rank R / 2 (so rank 1's A rows are the zero
    padding) on q_a_proj, o_proj and the routed experts, as vLLM's per-expert keys."""
    root = tmp_path_factory.mktemp("adapters")
    _peft_model(model, 11, r=R, target_parameters=FUSED).save_pretrained(str(root / "every"))
    pm = _peft_model(model, 12, r=R // 2, target_modules=["q_a_proj", "o_proj"],
                     target_parameters=FUSED)  # fmt: skip
    pm.save_pretrained(str(root / "fused"))
    return {
        "every": str(root / "every"),
        "experts": _per_expert(pm, root / "fused", root / "experts"),
    }


def _generate(model: str, adapters: dict, **layout) -> tuple[list[list[int]], torch.Tensor]:
    """Every job's greedy tokens and their steps' logprobs of `IDS`, in one batch."""
    with LLM(model, **KW, **layout) as llm:
        prompts = [_prompt(s, n) for _, s, n in JOBS]
        loras = [None if x is None else LoRARequest(x, 1 + (x == "experts"), adapters[x])
                 for x, _, _ in JOBS]  # fmt: skip
        outs = llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=loras)
        if layout.get("fully_sharded_loras"):
            assert llm.engine.model.lora.fully_sharded
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = torch.tensor(
        [[[d[t].logprob for t in IDS] for d in o.outputs[0].logprobs] for o in outs]
    )
    return tokens, logprobs


@pytest.fixture(scope="module")
def tp1(model, adapters):
    return _generate(model, adapters)


LAYOUTS = [dict(tp=2), dict(tp=2, ep=2), dict(tp=4, ep=2)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["tp2", "tp2-ep2", "tp4-ep2"])
def test_fully_sharded_gives_tp1_tokens_and_logprobs(model, adapters, tp1, layout):
    """Base, a rank-R adapter on every module and a rank-R/2 one on attention and the
    experts (vLLM's per-expert keys) in one batch: TP=1's greedy tokens, and its logprobs
    to fp32 rounding (measured: max |Δ| 2.9e-6 in each layout, as plain TP=2's 4.3e-6;
    tolerance 1e-4; the shrinks gathered in the wrong column order are 1.6 off). Under
    --tp 2 --ep 2 each expert group is one rank, its experts' slots whole; under --tp 4
    --ep 2 they split over the group's two moe_tp ranks, gathered and reduced within it."""
    tokens, logprobs = _generate(model, adapters, **layout, fully_sharded_loras=True)
    assert tokens == tp1[0]
    assert (logprobs - tp1[1]).abs().max().item() <= 1e-4
    assert tokens[1] != tokens[0] and tokens[2] != tokens[0]  # (the adapters do act)


def test_pipeline_stages_give_tp1_tokens_and_logprobs(model, adapters, tp1):
    """Under --pp-size each stage reads and holds its own layers' part of every adapter
    (here 2 x 2 ranks, fully sharded, stage 1 from layer 3): TP=1's greedy tokens, and its
    logprobs to fp32 rounding (measured: 2.9e-6; 1.4e-6 over two stages of one rank; a
    step with adapter rows runs eager)."""
    layout = dict(tp=2, pp=2, pp_layer_partition="3,5", fully_sharded_loras=True)
    tokens, logprobs = _generate(model, adapters, **layout)
    assert tokens == tp1[0]
    assert (logprobs - tp1[1]).abs().max().item() <= 1e-4


def test_each_stage_holds_and_reads_only_its_layers(model, adapters, tmp_path):
    """A stage's slots and its copy of an adapter are its own layers' (built without a
    process group), summing over the stages to one stage's; an adapter one stage refuses
    (a shape that is not the base model's, in stage 1's layer 6) is refused on both, and
    none of it is kept."""
    whole, _, _ = load_model(model)
    sizes, read = [], []
    for rank in (0, 1):
        parallel = ParallelState(ParallelConfig(pp=2, pp_layer_partition=(3, 5)), rank=rank)
        net, _, _ = load_model(model, parallel=parallel)
        slots = net.lora = LoraSlots(net, S, R)
        mine = range(3) if rank == 0 else range(3, 8)
        assert {int(name.split(".")[2]) for name in slots.layers} == set(mine)
        held = read_adapter(adapters["every"], net, R).weights
        assert {int(name.split(".")[2]) for name in held} == set(mine)
        sizes.append(slots.nbytes)
        read += held
    assert sum(sizes) == LoraSlots(whole, S, R).nbytes
    assert sorted(read) == sorted(read_adapter(adapters["every"], whole, R).weights)
    bad = tmp_path / "bad"
    shutil.copytree(adapters["every"], bad)
    weights = load_file(bad / "adapter_model.safetensors")
    key = next(k for k in weights if ".layers.6.self_attn.q_a_proj.lora_A" in k)
    weights[key] = weights[key][:, :-1].contiguous()
    save_file(weights, bad / "adapter_model.safetensors")
    with LLM(model, **KW, pp=2, pp_layer_partition="3,5") as llm:
        with pytest.raises(DsakvError, match=r"rank 1: .*layers\.6\.self_attn\.q_a_proj"):
            llm.engine.load_lora("bad", str(bad))
        assert llm.engine.loras() == {}
        llm.engine.load_lora("every", adapters["every"])
        assert llm.engine.loras() == {"every": adapters["every"]}


# --- per-rank slot bytes, from the shapes -------------------------------------------------


def _expected_values(tp: int, ep: int, sharded: bool, indexer_layers: int) -> int:
    """The slot values rank 0 holds (S slots of rank R, every module targeted) on the tiny
    GLM-5 model: column-parallel A `[S·R (/ n), in]` B `[out / n, S·R]`, row-parallel A
    `[S·R, in / n]` B `[out (/ n), S·R]`, replicated both whole; `(/ n)` under the flag."""
    c = TINY_PRESETS["glm-tiny"]
    h, sr = c["hidden_size"], S * R

    def column(inp: int, out: int, n: int) -> int:
        return sr // (n if sharded else 1) * inp + out // n * sr

    def row(inp: int, out: int, n: int) -> int:
        return sr * (inp // n) + out // (n if sharded else 1) * sr

    def whole(inp: int, out: int) -> int:
        return sr * (inp + out)

    heads, nope, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["v_head_dim"]
    rope = c["qk_rope_head_dim"]
    q, kv = c["q_lora_rank"], c["kv_lora_rank"]
    attention = (
        whole(h, q)  # q_a_proj
        + column(q, heads * (nope + rope), tp)  # q_b_proj
        + whole(h, kv + rope)  # kv_a_proj_with_mqa
        + sr * kv + heads * (nope + v) // tp * sr  # kv_b_proj: its A whole in both modes
        + row(heads * v, h, tp)  # o_proj
    )  # fmt: skip
    n_idx, d_idx = c["index_n_heads"], c["index_head_dim"]
    indexer = whole(q, n_idx * d_idx) + whole(h, d_idx) + whole(h, n_idx)

    def mlp(inter: int, n: int) -> int:
        return 2 * column(h, inter, n) + row(inter, h, n)

    moe_tp, experts = tp // ep, c["n_routed_experts"] // ep
    moe = mlp(c["moe_intermediate_size"], tp) + experts * mlp(c["moe_intermediate_size"], moe_tp)
    layers, dense = c["num_hidden_layers"], c["first_k_dense_replace"]
    return (
        layers * attention
        + indexer_layers * indexer
        + dense * mlp(c["intermediate_size"], tp)
        + (layers - dense) * moe
    )


@pytest.mark.parametrize("tp, ep", [(2, 1), (2, 2), (4, 2)])
def test_per_rank_slot_bytes_are_the_shapes_and_less_with_the_flag(model, adapters, tp, ep):
    """Rank 0's slots (built without a process group: building needs no collective) hold
    exactly the values the shapes give, fewer with the flag; its host copy of an adapter
    is its slots' slices (rank R, every module: the same shapes as the slots' one slot)."""
    parallel = ParallelState(ParallelConfig(tp=tp, ep=ep), rank=0)
    net, _, plan = load_model(model, parallel=parallel)
    full = sum(plan.runs_indexer(i) for i in range(plan.num_layers))
    sizes = {}
    for sharded in (False, True):
        slots = net.lora = LoraSlots(net, S, R, fully_sharded=sharded)
        sizes[sharded] = slots.nbytes
        assert slots.nbytes == 4 * _expected_values(tp, ep, sharded, full)  # (fp32)
        held = read_adapter(adapters["every"], net, R).weights
        for name, layer in slots.layers.items():
            a, b = held[name]
            assert a.shape[-2] == layer.a.shape[-2] // S and b.shape == layer.b[..., :R].shape
            for t in (a, b):  # (its own bytes, not a view keeping the whole tensor)
                assert t.untyped_storage().nbytes() == t.nbytes, name
    assert sizes[True] < sizes[False]
    gate = slots.layers["model.layers.1.mlp.experts.gate_proj"]
    assert gate.a.shape == (8 // ep, S * R // (tp // ep), 64)  # (split over moe_tp ranks)


# --- refusals ---------------------------------------------------------------------------


def test_a_rank_that_does_not_split_over_tp_is_refused(model, capsys):
    """vLLM asserts --max-lora-rank divides by the TP size; here one line, at start (the
    config, before any rank starts), naming both flags; the flag without --enable-lora is
    one line too, as the other LoRA flags."""
    with pytest.raises(DsakvError, match="--max-lora-rank 6 is not divisible by --tp 4"):
        EngineConfig(model, **{**KW, "max_lora_rank": 6}, tp=4, fully_sharded_loras=True)
    EngineConfig(model, **{**KW, "max_lora_rank": 6}, tp=2, fully_sharded_loras=True)
    argv = ["serve", model, "--enable-lora", "--tp", "4", "--max-lora-rank", "6"]
    err = cli_error_line([*argv, "--fully-sharded-loras"], capsys)
    assert "--max-lora-rank 6 is not divisible by --tp 4" in err, err
    err = cli_error_line(["serve", model, "--fully-sharded-loras"], capsys)
    assert "--fully-sharded-loras needs --enable-lora" in err, err
