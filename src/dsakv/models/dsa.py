"""`DSAForCausalLM`: GLM-5.x (`glm_moe_dsa`) and DeepSeek-V3.2 (`deepseek_v32`) over the pool.

Parameter names mirror the Hugging Face checkpoints (`model.layers.{i}.self_attn.…`), so
the loader maps tensors one to one (routed experts are stacked per layer). Which layers
build an indexer comes from the `LayerPlan` and nowhere else.
"""

from __future__ import annotations

import torch
from torch import nn

from dsakv.config import LayerPlan, ModelConfig
from dsakv.distributed.parallel import ParallelState

from .attention import MLAttention
from .forward_batch import ForwardBatch
from .indexer import StepSelection
from .layers import MLP, RMSNorm
from .moe import MoE
from .parallel_layers import ParallelLMHead, VocabParallelEmbedding
from .rope import Rotary


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

    def forward(self, x, cos, sin, batch, pool, selections) -> torch.Tensor:
        h = self.self_attn(
            self.input_layernorm(x), cos, sin, batch, pool, selections, self.topk_source
        )
        x = x + h
        h, counts = self.parallel.gather_tokens(self.post_attention_layernorm(x))
        return x + self.parallel.scatter_tokens(self.mlp(h), counts)


class DSAModel(nn.Module):
    def __init__(self, config: ModelConfig, plan: LayerPlan, parallel: ParallelState) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
        self.layers = nn.ModuleList(
            DecoderLayer(config, plan, i, parallel) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DSAForCausalLM(nn.Module):
    """The target model (draft/MTP layers are not built). Stateless: all KV lives in the pool.

    With `parallel` it holds only this rank's shards (DESIGN.md §8); `forward` still
    returns the full hidden states and `compute_logits` the full-vocab logits on every
    rank of the attention group. Every rank must call both for every step (an empty
    batch included, under DP attention), since they contain collectives.
    """

    def __init__(
        self,
        config: ModelConfig,
        plan: LayerPlan,
        *,
        parallel: ParallelState | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if plan.num_layers != config.num_hidden_layers:
            raise ValueError(
                f"layer plan has {plan.num_layers} layers, model has {config.num_hidden_layers}"
            )
        self.parallel = parallel or ParallelState.single()
        self.parallel.config.check_model(config)
        self.config, self.plan = config, plan
        self.model = DSAModel(config, plan, self.parallel)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, self.parallel)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(config)
        if dtype is not None or device is not None:
            self.to(device=device, dtype=dtype)
            keep_fp32(self)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def set_attention_mode(self, mode: str) -> None:
        """`absorb` (default: attention on latent rows) or `expand` (per-head K/V first)."""
        if mode not in ("absorb", "expand"):
            raise ValueError(f"attention mode must be 'absorb' or 'expand', got {mode!r}")
        for layer in self.model.layers:
            layer.self_attn.mode = mode

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool) -> torch.Tensor:
        """Runs every layer, writing this step's KV into `pool`; returns normed hidden `[T, H]`."""
        x = self.model.embed_tokens(batch.input_ids)
        cos, sin = self.rotary(batch.positions, x.dtype)
        selections: dict[int, StepSelection] = {}
        for layer in self.model.layers:
            x = layer(x, cos, sin, batch, pool, selections)
        return self.model.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden[N, H]` (e.g. `hidden[batch.last_token_indices()]`) -> fp32 logits `[N, vocab]`."""
        return self.lm_head(hidden)


def keep_fp32(model: nn.Module) -> None:
    """Router weights/bias and indexer weights_proj stay fp32 whatever the model dtype."""
    for name, mod in model.named_modules():
        if name.endswith("mlp.gate") or name.endswith("indexer.weights_proj"):
            mod.float()
