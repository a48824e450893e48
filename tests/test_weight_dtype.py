"""Weights as the checkpoint stores them: on a CPU, `--dtype auto` keeps a bf16
checkpoint's weight matrices bf16 in memory, and an FP8-block checkpoint's e4m3 matrices
packed with their block scales, while the model computes in fp32. The native blocks read
them in place (bf16 widened in registers, FP8 a few rows at a time into cache), the eager
ops widen them where they read them; each value is what the loader's widening gives, so
every output is bit-identical to the model widened to fp32 at load (`--dtype float32`),
at half (a quarter) of the weight bytes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsakv import LLM, SamplingParams
from dsakv.config import ModelConfig
from dsakv.kernels import cpu_native
from dsakv.kernels.torch_ops import pack_fp8, unpack_fp8, widened
from dsakv.memory import CacheLayout, DSAKVPool
from dsakv.models.loader import _read_dequant, _read_packed, load_model
from dsakv.models.tiny import default_model_dir, quantize_fp8_blocks, write_tiny_model

from .conftest import flat_logprobs

native = pytest.mark.skipif(
    not cpu_native.available(), reason="no C++ compiler: the cpu backend runs its torch ops"
)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
KW = dict(device="cpu", page_size=16, num_pages=48, max_model_len=256)


def _weight_dtype(model) -> torch.dtype:
    """The dtype the weight matrices are held in: the compute dtype, or bf16 as a bf16 or
    FP8 checkpoint stores them under fp32 compute (FP8 projections are packed uint8 rows
    beside them)."""
    return model.model.embed_tokens.weight.dtype


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory) -> str:
    """glm-tiny written in bf16 (dense and MoE layers, indexers, an MTP layer)."""
    path = tmp_path_factory.mktemp("glm-tiny-bf16")
    return str(write_tiny_model(path, "glm-tiny", 5, torch.bfloat16, mtp="random"))


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory) -> str:
    """glm-tiny with its layers' projections (the MTP layer's too) as FP8 blocks."""
    path = tmp_path_factory.mktemp("glm-tiny-fp8")
    return str(write_tiny_model(path, "glm-tiny", 5, mtp="random", weights="fp8"))


@pytest.fixture(scope="module", params=["bf16", "fp8"])
def checkpoint(request) -> str:
    return request.getfixturevalue(f"{request.param}_model")


@pytest.fixture(scope="module")
def models(checkpoint):
    """The checkpoint loaded as stored (bf16 / packed FP8 matrices) and widened at load."""
    stored, config, _ = load_model(checkpoint, as_stored=True, draft_layers=1)
    wide, _, _ = load_model(checkpoint, draft_layers=1)
    return stored, wide, config


def _inputs(model, config, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, config.hidden_size, generator=g)
    cos, sin = model.rotary(torch.randint(0, 4000, (batch,), generator=g), torch.float32)
    out = torch.randn(batch, config.num_attention_heads * config.v_head_dim, generator=g)
    q_lora = torch.randn(batch, config.q_lora_rank, generator=g)
    return x, cos, sin, out, q_lora


def test_as_stored_keeps_the_matrices_bf16_and_computes_in_fp32(bf16_model):
    stored, _, _ = load_model(bf16_model, as_stored=True, draft_layers=1)
    wide, _, _ = load_model(bf16_model, draft_layers=1)
    assert (stored.dtype, _weight_dtype(stored)) == (torch.float32, torch.bfloat16)
    assert (wide.dtype, _weight_dtype(wide)) == (torch.float32, torch.float32)
    layer = stored.model.layers[-1]  # the MTP layer: MoE, an indexer, eh_proj
    for p in (
        layer.self_attn.kv_b_proj.weight,
        layer.mlp.experts.gate_up_proj,
        layer.mlp.experts.down_proj,
        layer.self_attn.indexer.wq_b.weight,
        layer.eh_proj.weight,
        stored.lm_head.weight,
    ):
        assert p.dtype == torch.bfloat16
    for p in (layer.input_layernorm.weight, layer.mlp.gate.weight):
        assert p.dtype == torch.float32
    assert layer.self_attn.indexer.weights_proj.weight.dtype == torch.float32
    assert stored.model.embed_tokens(torch.tensor([1, 2])).dtype == torch.float32


def test_as_stored_keeps_fp8_blocks_packed_and_widens_them_as_the_loader(models, fp8_model):
    """The FP8 checkpoint's projections stay packed e4m3 (with their scales), the rest as
    stored (bf16 embeddings, head and eh_proj; fp32 norms, router and weights_proj); every
    weight, widened where an op reads it, equals the fp32 load's, in under 30% of the bytes."""
    stored, _, _ = load_model(fp8_model, as_stored=True, draft_layers=1)
    wide, _, _ = load_model(fp8_model, draft_layers=1)
    layer = stored.model.layers[-1]  # the MTP layer: MoE, an indexer, eh_proj
    attn = layer.self_attn
    for p in (
        attn.q_a_proj.weight,
        attn.kv_a_proj_with_mqa.weight,
        attn.kv_b_proj.weight,
        attn.o_proj.weight,
        attn.indexer.wq_b.weight,
        attn.indexer.wk.weight,
        layer.mlp.experts.gate_up_proj,
        layer.mlp.experts.down_proj,
        layer.mlp.shared_experts.up_proj.weight,
    ):
        assert p.dtype == torch.uint8
    for p in (layer.eh_proj.weight, stored.lm_head.weight, stored.model.embed_tokens.weight):
        assert p.dtype == torch.bfloat16
    for p in (
        layer.input_layernorm.weight,
        layer.mlp.gate.weight,
        attn.indexer.weights_proj.weight,
    ):
        assert p.dtype == torch.float32
    fp32 = dict(wide.named_parameters())
    for name, p in stored.named_parameters():
        assert torch.equal(widened(p, fp32[name]), fp32[name]), name

    def nbytes(model) -> int:
        return sum(p.numel() * p.element_size() for p in model.parameters())

    assert nbytes(stored) < 0.3 * nbytes(wide)


def test_packed_rows_carry_the_block_scales_of_any_slice(fp8_model):
    """Packing a slice that starts mid-block (rows 100..299 of 300, a head's rows of kv_b;
    an expert's intermediate range) gives, widened, exactly the loader's dequantisation of
    that slice; K not a multiple of 128 included."""
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(300, 260, generator=g) * 40).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(3, 3, generator=g) + 0.01
    config = ModelConfig.from_hf(fp8_model)
    for rows in (slice(0, 300), slice(100, 300), slice(130, 131)):
        index = (rows, slice(None))
        part = weight[index]
        packed = _read_packed(part, scale_inv, index)
        assert packed.shape == (part.shape[0], 260 + 3 * 4)
        assert torch.equal(unpack_fp8(packed), _read_dequant(part, scale_inv, index, config))
    with pytest.raises(ValueError, match="scales"):
        pack_fp8(weight, torch.ones(300, 2))


@pytest.mark.parametrize("parallel", ["tp2-ep2", "dp-attention"])
def test_sharded_reads_keep_each_ranks_slices_as_stored(checkpoint, parallel):
    """Each rank's slices of the checkpoint (TP heads and vocab rows, EP experts) are read
    as stored: the fp32 load's, widened; an fp32 checkpoint stays fp32."""
    from dsakv.config.parallel import ParallelConfig
    from dsakv.distributed import ParallelState

    pc = {
        "tp2-ep2": ParallelConfig(tp=2, ep=2, timeout_s=60),
        "dp-attention": ParallelConfig(tp=2, dp_attention=True, timeout_s=60),
    }[parallel]
    for rank in range(2):
        state = ParallelState(pc, rank)
        stored, _, _ = load_model(checkpoint, as_stored=True, parallel=state)
        wide = dict(load_model(checkpoint, parallel=state)[0].named_parameters())
        assert _weight_dtype(stored) == torch.bfloat16
        for name, p in stored.named_parameters():
            assert torch.equal(widened(p, wide[name]), wide[name]), (rank, name)
    fp32, _, _ = load_model(default_model_dir("glm-tiny"), as_stored=True)
    assert _weight_dtype(fp32) == torch.float32


@native
def test_native_blocks_read_stored_weights_as_their_fp32_widening(models, checkpoint):
    """Every layer's native blocks (dense and MoE FFN, the MTP layer), the indexer's key
    and (rotated) query, the LM head and decode attention's W_uv: bit-equal with the
    matrices as stored (bf16, packed FP8) and widened to fp32 at load, at batch 1, 3
    (tails of the token tiles) and 6."""
    stored, wide, config = models
    pool = DSAKVPool(CacheLayout.for_model(checkpoint, kv_cache_dtype="fp32"), 4)
    with torch.inference_mode():
        for batch in (1, 3, 6):
            x, cos, sin, out, q_lora = _inputs(stored, config, batch, seed=batch)
            for a, b in zip(stored.model.layers, wide.model.layers, strict=True):
                (inp_a, ffn_a), (inp_b, ffn_b) = a.native_blocks(), b.native_blocks()
                for u, v in zip(inp_a(x, cos, sin), inp_b(x, cos, sin), strict=True):
                    assert torch.equal(u, v)
                assert torch.equal(ffn_a(x, out), ffn_b(x, out))
                if hasattr(a.self_attn, "indexer"):
                    ia = a.self_attn.indexer.native_inputs()
                    ib = b.self_attn.indexer.native_inputs()
                    assert torch.equal(ia.key(x, cos, sin), ib.key(x, cos, sin))
                    for rotate in (True, False):
                        got = ia.query(x, q_lora, cos, sin, rotate)
                        want = ib.query(x, q_lora, cos, sin, rotate)
                        assert all(torch.equal(u, v) for u, v in zip(got, want, strict=True))
                _check_w_uv(a.self_attn, b.self_attn, pool, batch)
            head = cpu_native.linear(x, stored.lm_head.weight)
            assert torch.equal(head, cpu_native.linear(x, wide.lm_head.weight))


def _check_w_uv(attn_a, attn_b, pool, batch: int) -> None:
    """`mla_decode` through the stored W_uv equals it through the fp32 one."""
    w_a, w_b = attn_a._w_kvb()[1], attn_b._w_kvb()[1]
    assert (w_a.dtype, w_b.dtype) == (attn_a.kv_b_proj.weight.dtype, torch.float32)
    assert w_a.dtype != torch.float32
    g = torch.Generator().manual_seed(batch)
    data = pool.latent_data(0)
    data.copy_(torch.randn(data.shape, generator=g))
    heads, lora = attn_a.n_heads, attn_a.kv_lora
    q_nope = torch.randn(batch, heads, lora, generator=g)
    q_rope = torch.randn(batch, heads, attn_a.rope_dim, generator=g)
    slots = torch.randint(0, data.shape[0], (batch, 20), generator=g)
    valid = torch.rand(batch, 20, generator=g) < 0.8
    args = (q_nope, q_rope, data, slots, valid, 0.1, "fp32")
    got = cpu_native.mla_decode(*args, w_uv=w_a)
    assert torch.equal(got, cpu_native.mla_decode(*args, w_uv=w_b))


def _generate(model: str, prompts, **kw):
    out = LLM(model, **{**KW, **kw}).generate(prompts, GREEDY)
    return [(o.token_ids, o.outputs[0].logprobs) for o in out]


@native
@pytest.mark.parametrize("deterministic", [None, False], ids=["deterministic", "batched"])
def test_auto_dtype_generates_the_float32_models_tokens_and_logprobs(checkpoint, deterministic):
    """Through the engine: `dtype="auto"` (bf16 / packed FP8 matrices, fp32 compute) gives
    the greedy tokens and logprobs of `dtype="float32"` bit for bit, on the default
    per-token path and on the batched one (eager torch ops over steps of more than 64
    tokens, the native blocks for short steps); prompts past index_topk (sparse selection)."""
    prompts = [[5 + i % 200 for i in range(n)] for n in (90, 40, 7)]
    kw = dict(enable_deterministic_inference=deterministic)
    llm = LLM(checkpoint, **KW, **kw)
    model = llm.engine.runner.model
    assert (model.dtype, _weight_dtype(model)) == (torch.float32, torch.bfloat16)
    assert model.model.layers[1].self_attn.q_b_proj.weight.dtype != torch.float32
    assert llm.engine.deterministic == (deterministic is None)
    got = [(o.token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, GREEDY)]
    assert got == _generate(checkpoint, prompts, dtype="float32", **kw)


@native
def test_auto_dtype_holds_glm_bench_short_in_half_the_bytes():
    """The bench checkpoint (bf16, as released; its MTP layer left out, as no step here
    drafts: written in seconds, not fitted): its matrices stay bf16 under `auto`, about half
    the fp32 engine's weight bytes, with the same tokens and logprobs."""
    path = str(default_model_dir("glm-bench-short", weights="bf16"))
    prompts = [list(range(3, 131))]

    def weight_bytes(llm: LLM) -> int:
        model = llm.engine.runner.model
        return sum(p.numel() * p.element_size() for p in model.parameters())

    auto, wide = LLM(path, **KW), LLM(path, **KW, dtype="float32")
    assert 0.5 <= weight_bytes(auto) / weight_bytes(wide) < 0.52
    got, want = auto.generate(prompts, GREEDY), wide.generate(prompts, GREEDY)
    assert [(o.token_ids, flat_logprobs(o.outputs[0].logprobs, o.token_ids)) for o in got] == [
        (o.token_ids, flat_logprobs(o.outputs[0].logprobs, o.token_ids)) for o in want
    ]


def _fp8_pair(
    g: torch.Generator, *shape: int, big: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random packed FP8-block matrix `[..., K]` and its fp32 widening."""
    values = (torch.randn(*shape, generator=g) * 30).to(torch.float8_e4m3fn)
    scales = (torch.rand(*shape[:-1], -(-shape[-1] // 128), generator=g) + 0.01) * big
    packed = pack_fp8(values, scales)
    return packed, unpack_fp8(packed)


@native
def test_native_fp8_blocks_at_ragged_widths_match_their_widening():
    """Widths that are not multiples of the kernels' 16 lanes or of the 128-value blocks
    (the scalar tails; a row's second block starting mid-tile) through the LM-head GEMV and
    an MoE FFN (experts read a row at a time, widened in registers): bit-equal with the
    fp32 widening."""
    g = torch.Generator().manual_seed(0)
    hidden, inter, experts, attn_dim = 136, 40, 4, 200
    x = torch.randn(5, 260, generator=g)
    for big in (1.0, 1e3):  # (scales past 2^8 take the kernels' other widening)
        w, wide = _fp8_pair(g, 70, 260, big=big)
        assert torch.equal(cpu_native.linear(x, w), cpu_native.linear(x, wide))
    pairs = {
        "o_proj": _fp8_pair(g, hidden, attn_dim),
        "gate": _fp8_pair(g, inter, hidden),
        "up": _fp8_pair(g, inter, hidden),
        "down": _fp8_pair(g, hidden, inter),
        "gate_up": _fp8_pair(g, experts, 2 * inter, hidden, big=1e3),
        "edown": _fp8_pair(g, experts, hidden, inter),
    }
    router, bias, norm = (
        torch.randn(experts, hidden, generator=g),
        torch.zeros(experts),
        torch.ones(hidden),
    )

    def ffn(i: int) -> cpu_native.Ffn:
        p = {k: v[i] for k, v in pairs.items()}
        moe = (router, bias, p["gate_up"], p["edown"], 2, 1, 1, True, 1.0, 0)
        return cpu_native.Ffn(p["o_proj"], norm, 1e-6, (p["gate"], p["up"], p["down"]), moe)

    h, out = torch.randn(3, hidden, generator=g), torch.randn(3, attn_dim, generator=g)
    assert torch.equal(ffn(0)(h, out), ffn(1)(h, out))


@pytest.fixture(scope="module", params=["fp8-64", "e5m2", "bf16-scaled"])
def unpackable_model(request, tmp_path_factory) -> str:
    """glm-tiny (bf16) with block-scaled projections `pack_fp8` cannot hold: e4m3 in 64×64
    blocks, e5m2 or bf16 weights beside 128×128 `weight_scale_inv`s."""
    path = write_tiny_model(
        tmp_path_factory.mktemp(f"glm-tiny-{request.param}"),
        "glm-tiny",
        5,
        mtp="none",
        weights="bf16",
    )
    quantize_fp8_blocks(path, block=64 if request.param == "fp8-64" else 128)
    if request.param != "fp8-64":
        as_ = torch.float8_e5m2 if request.param == "e5m2" else torch.bfloat16
        file = path / "model.safetensors"
        tensors = load_file(file)
        for name, t in tensors.items():
            if t.dtype == torch.float8_e4m3fn:
                tensors[name] = t.float().to(as_)
        save_file(tensors, file, metadata={"format": "pt"})
    return str(path)


def test_block_scaled_weights_it_cannot_pack_are_held_fp32(unpackable_model):
    """They are dequantised at load into fp32, as `dtype="float32"` holds them, while the
    unscaled matrices stay bf16: 64×64 blocks were held bf16 (rounded: other logits), e5m2
    and bf16 weights were packed, then refused at the read, after allocating."""
    stored, _, _ = load_model(unpackable_model, as_stored=True)
    wide = dict(load_model(unpackable_model)[0].named_parameters())
    attn = stored.model.layers[1].self_attn
    assert _weight_dtype(stored) == torch.bfloat16
    assert attn.q_b_proj.weight.dtype == attn.kv_b_proj.weight.dtype == torch.float32
    for name, p in stored.named_parameters():
        assert torch.equal(widened(p, wide[name]), wide[name]), name


def test_auto_dtype_loads_them_for_the_float32_models_tokens_and_logprobs(unpackable_model):
    prompts = [[5 + i % 200 for i in range(n)] for n in (40, 7)]
    got = _generate(unpackable_model, prompts)
    assert got == _generate(unpackable_model, prompts, dtype="float32")
