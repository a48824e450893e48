"""`DecoderLayer`: one pre-norm MLA + FFN block, as the target and the MTP layer use it."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dsakv.config import LayerPlan, ModelConfig
from dsakv.distributed.parallel import ParallelState
from dsakv.kernels import cpu_native
from dsakv.kernels.backend import Block

from .attention import MLAttention
from .layers import MLP, RMSNorm
from .lora import LoraSlots, adapter_slots, adapting
from .moe import MoE


class DecoderLayer(nn.Module):
    """Pre-norm MLA block then pre-norm FFN (dense for the first layers, MoE after).

    The FFN is split over every rank and reduced once (routed + shared together); under DP
    attention it first gathers every rank's tokens and hands each rank its rows back, so
    a rank with an empty batch still joins both collectives.
    """

    def __init__(
        self, config: ModelConfig, plan: LayerPlan, layer: int, parallel: ParallelState
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.topk_source = plan.topk_source(layer)
        self.self_attn = MLAttention(config, layer, plan.runs_indexer(layer), parallel)
        self.mlp: nn.Module = (
            MoE(config, parallel)
            if config.is_moe(layer)
            else MLP(
                config.hidden_size, config.intermediate_size, parallel.tp_size, parallel.tp_rank
            )
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._native: tuple[cpu_native.MlaInputs, cpu_native.Ffn] | None | bool = False
        self._lora: LoraSlots | None = None  # the adapter slots it holds (`adapting`)
        # Where a step that records its routing keeps this MoE layer's (an int32
        # `[T, top_k]` view: `DSAForCausalLM.record_routing`); None: not recorded
        self.routed: torch.Tensor | None = None

    def forward(self, x, cos, sin, batch, pool, selections, topk_source=None) -> torch.Tensor:
        """`topk_source`: another plan's source for this layer (pattern calibration runs
        candidate plans over all-full weights); by default the plan the model was built with.

        The pure-tensor blocks before and after attention (norms, projections, RoPE, FFN)
        run through `ops.block`: the cpu backend runs those of a step of a few tokens as
        one native call each (`native_blocks`)."""
        source = self.topk_source if topk_source is None else topk_source
        attn = self.self_attn
        h, q_nope, q_rope, q_lora, row = attn.ops.block(ATTENTION_INPUTS, batch, self, x, cos, sin)
        out = attn.attend(h, q_nope, q_rope, q_lora, row, cos, sin, batch, pool, selections, source)
        return attn.ops.block(RESIDUAL_FFN, batch, self, x, out)

    def native_blocks(self) -> tuple[cpu_native.MlaInputs, cpu_native.Ffn] | None:
        """This layer's two blocks as `cpu_native` calls over its own weights (this rank's
        parts under --tp and --ep), made on first use (after loading); None where they do
        not apply: a model computing in bf16 (its blocks round where the reference does).
        Made beside LoRA slots too: only a step running adapter deltas here runs the blocks
        eager."""
        if self._native is False:
            self._native, self._lora = _native_blocks(self), adapter_slots(self)
        return self._native


def in_turn(layers: Sequence[DecoderLayer], x, cos, sin, batch, pool, selections=None):
    """`layers` one after another (each layer's blocks through the backend); a shared layer
    reads the selection of the full layer before it. `selections`: those of full layers
    before `layers` (a pipeline stage's, received with its input), filled as they run."""
    selections = {} if selections is None else selections
    for layer in layers:
        x = layer(x, cos, sin, batch, pool, selections)
    return x


def layer_loop(
    layers: Sequence[DecoderLayer], pool, parts: cpu_native.StepParts
) -> cpu_native.LayerLoop | None:
    """A step over `layers` as one native call over `pool` (`cpu_native.LayerLoop`), with
    what it reads around them (`parts`); None where some layer has no native form (weights
    the blocks cannot read, a layer split over ranks)."""
    first = layers[0].self_attn
    if not hasattr(first, "indexer") or not cpu_native.available():
        return None
    descs, full = [], None
    for layer in layers:
        attn, blocks = layer.self_attn, layer.native_blocks()
        indexer = getattr(attn, "indexer", None)
        native = indexer and indexer.native_inputs()
        if blocks is None or (indexer and native is None):
            return None
        full = attn.layer if indexer else full
        if layer.topk_source != full:  # the loop reuses the last full layer's selection
            return None
        descs.append((attn.layer, *blocks, native, attn._w_kvb()[1]))
    return cpu_native.LayerLoop(
        descs,
        pool,
        parts,
        topk=first.indexer.topk,
        index_scale=first.indexer.scale,
        mla_scale=first.scale,
        low=getattr(first.ops, "index_dtype", None) == torch.bfloat16,
    )


def attention_inputs(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The normed input and `MLAttention.project`'s outputs."""
    h = layer.input_layernorm(x)
    return (h, *layer.self_attn.project(h, cos, sin))


def residual_ffn(layer: DecoderLayer, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """o_proj and the residual, then the pre-norm FFN and its residual."""
    x = x + layer.self_attn.output(out)
    h, counts = layer.parallel.gather_tokens(layer.post_attention_layernorm(x))
    if layer.routed is None:
        y = layer.mlp(h)
    else:  # (recording its routing: this rank's tokens')
        y = layer.mlp(h, layer.routed, layer.parallel.own_rows(counts))
    return x + layer.parallel.scatter_tokens(y, counts)


def _native_blocks(layer: DecoderLayer) -> tuple[cpu_native.MlaInputs, cpu_native.Ffn] | None:
    attn, mlp = layer.self_attn, layer.mlp
    if not cpu_native.fits(layer):
        return None
    inputs = cpu_native.MlaInputs(
        layer.input_layernorm.weight,
        attn.q_a_proj.weight,
        attn.q_a_layernorm.weight,
        attn.q_b_proj.weight,
        attn.kv_a_proj_with_mqa.weight,
        attn.kv_a_layernorm.weight,
        attn.kv_b_proj.weight,
        heads=attn.n_heads,
        nope=attn.nope,
        rope=attn.rope_dim,
        v=attn.v_dim,
        eps=(layer.input_layernorm.eps, attn.q_a_layernorm.eps, attn.kv_a_layernorm.eps),
    )
    moe = None
    if isinstance(mlp, MoE):
        g = mlp.gate
        moe = (
            g.weight,
            g.e_score_correction_bias,
            mlp.experts.gate_up_proj,
            mlp.experts.down_proj,
            g.top_k,
            g.n_group,
            g.topk_group,
            g.norm_topk_prob,
            g.scaling,
            mlp.experts.expert_range[0],
        )
        mlp = mlp.shared_experts
    ffn = cpu_native.Ffn(
        attn.o_proj.weight,
        layer.post_attention_layernorm.weight,
        layer.post_attention_layernorm.eps,
        (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight),
        moe,
    )
    return inputs, ffn


def _native_inputs(layer: DecoderLayer, x, cos, sin):
    """`attention_inputs` as the layer's native call. A step with adapter rows here runs
    the eager block instead, whatever the backend's mode (its per-token mode has no eager
    fallback of its own): the base rows beside them run batched, as the adapter rows do."""
    blocks = layer.native_blocks()
    if blocks is None:
        return NotImplemented
    if adapting(layer._lora):
        return attention_inputs(layer, x, cos, sin)
    return blocks[0](x, cos, sin)


def _native_ffn(layer: DecoderLayer, x, out):
    """`residual_ffn` as the layer's native call; eager in a step with adapter rows here
    (`_native_inputs`)."""
    blocks = layer.native_blocks()
    if blocks is None:
        return NotImplemented
    if adapting(layer._lora):
        return residual_ffn(layer, x, out)
    ffn, attn = blocks[1], out.flatten(1)  # (an idle DP rank has 0 rows)
    if layer.parallel.tp_size == 1:
        return ffn(x, attn, layer.routed)
    return _split_ffn(layer, ffn, x, attn)


def _split_ffn(layer: DecoderLayer, ffn: cpu_native.Ffn, x, attn) -> torch.Tensor:
    """`residual_ffn` over ranks, natively: each sum in rank order (`sum_in_rank_order`), so
    with every rank on this path a token's bits depend on neither its batch nor, under DP
    attention, the other ranks'. DP attention gathers the normed rows, as `residual_ffn`
    does: outside the deterministic mode, ranks whose batches differ in size may take the
    two paths in one step."""
    p = layer.parallel
    o = ffn.o_proj(attn)
    x = x + (p.sum_in_rank_order(o) if p.attn_size > 1 else o)
    rows, counts = p.gather_tokens(ffn.norm(x))
    own, mine = p.own_rows(counts), layer.routed
    routed = mine  # (recording the routing under DP attention: every row's, then its own)
    if mine is not None and own != slice(None):
        routed = mine.new_empty(len(rows), mine.shape[1])
    y = p.sum_in_rank_order(ffn.part(rows, routed))[own]
    if routed is not mine:
        mine.copy_(routed[own])
    return x + y


def norm_rows(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return norm(x)


def _native_norm_rows(norm: RMSNorm, x: torch.Tensor):
    if not cpu_native.fits(norm) or x.dtype != torch.float32 or not x.is_cpu:
        return NotImplemented
    return cpu_native.rms_norm(x, norm.weight, norm.eps)


# An RMSNorm over a step's rows outside the layers (the final norm, the MTP layer's output
# norm), each row on its own when native.
NORM = Block(norm_rows, _native_norm_rows)
ATTENTION_INPUTS = Block(attention_inputs, _native_inputs)
RESIDUAL_FFN = Block(residual_ffn, _native_ffn)
