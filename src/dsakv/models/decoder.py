"""`DecoderLayer`: one pre-norm MLA + FFN block, as the target and the MTP layer use it."""

from __future__ import annotations

import torch
from torch import nn

from dsakv.config import LayerPlan, ModelConfig
from dsakv.distributed.parallel import ParallelState

from .attention import MLAttention
from .layers import MLP, RMSNorm
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
            MLP(config.hidden_size, config.intermediate_size, parallel.world_size, parallel.rank)
            if layer < config.first_k_dense_replace
            else MoE(config, parallel)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, batch, pool, selections, topk_source=None) -> torch.Tensor:
        """`topk_source`: another plan's source for this layer (pattern calibration runs
        candidate plans over all-full weights); by default the plan the model was built with.

        The pure-tensor blocks before and after attention (norms, projections, RoPE, FFN)
        run through `ops.block`, which the cpu backend compiles for small decode steps."""
        source = self.topk_source if topk_source is None else topk_source
        attn = self.self_attn
        h, q_nope, q_rope, q_lora, row = attn.ops.block(attention_inputs, batch, self, x, cos, sin)
        out = attn.attend(h, q_nope, q_rope, q_lora, row, cos, sin, batch, pool, selections, source)
        return attn.ops.block(residual_ffn, batch, self, x, out)


def attention_inputs(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The normed input and `MLAttention.project`'s outputs."""
    h = layer.input_layernorm(x)
    return (h, *layer.self_attn.project(h, cos, sin))


def residual_ffn(layer: DecoderLayer, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """o_proj and the residual, then the pre-norm FFN and its residual."""
    x = x + layer.self_attn.output(out)
    h, counts = layer.parallel.gather_tokens(layer.post_attention_layernorm(x))
    return x + layer.parallel.scatter_tokens(layer.mlp(h), counts)
