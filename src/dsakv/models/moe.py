"""Mixture of experts: sigmoid router with group-limited top-k, routed + shared experts."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from dsakv.config import ModelConfig
from dsakv.distributed.parallel import ParallelState
from dsakv.kernels import TorchBackend
from dsakv.kernels.torch_ops import linear

from .layers import MLP
from .parallel_layers import Shard

if TYPE_CHECKING:
    from .lora import RoutedSlots


class Router(nn.Module):
    """Sigmoid scores; `e_score_correction_bias` only steers the choice, not the weights.

    Kept in fp32 whatever the model dtype (the reference does the same).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e = config.n_routed_experts
        self.weight = nn.Parameter(torch.zeros(e, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(e, dtype=torch.float32))
        self.top_k, self.n_group, self.topk_group = (
            config.num_experts_per_tok,
            config.n_group,
            config.topk_group,
        )
        self.norm_topk_prob = config.norm_topk_prob
        self.scaling = config.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x[T, H]` -> (expert ids `[T, k]`, fp32 weights `[T, k]`)."""
        scores = linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            t, e = choice.shape
            grouped = choice.view(t, self.n_group, e // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            keep = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
            group_mask = torch.zeros_like(group_scores).scatter_(1, keep, 1.0).bool()
            choice = choice.masked_fill(
                ~group_mask.repeat_interleave(e // self.n_group, 1), float("-inf")
            )
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling


class Experts(nn.Module):
    """This rank's routed experts, stacked: `gate_up_proj[E_r, 2I_r, H]` (gate rows first),
    `down_proj[E_r, H, I_r]`.

    Expert parallel: the `ep` groups each hold `n_experts / ep` whole experts
    (`expert_range`); within a group each expert's intermediate size is split over the
    group's `moe_tp` ranks (`inter_range`). The output is a partial sum to all-reduce.

    With LoRA adapters (`lora`: `dsakv.models.lora.RoutedSlots`), the tokens whose adapter
    holds expert weights here run the LoRA-aware loop, the others the backend's op.
    """

    def __init__(self, config: ModelConfig, parallel: ParallelState) -> None:
        super().__init__()
        e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        pc = parallel.config
        experts = Shard.even(0, e, pc.ep, parallel.ep_rank)
        inter = Shard.even(0, i, pc.moe_tp, parallel.moe_tp_rank)
        self.num_experts, self.intermediate, self.hidden_size = e, i, h
        self.expert_range = (experts.start, experts.end)
        self.inter_range = (inter.start, inter.end)
        self.gate_up_proj = nn.Parameter(torch.empty(experts.size, 2 * inter.size, h))
        self.ops = TorchBackend()  # the engine's backend replaces it (`use_backend`)
        self.down_proj = nn.Parameter(torch.empty(experts.size, h, inter.size))
        self.lora: RoutedSlots | None = None  # adapter slots (--enable-lora), else None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This rank's experts that some token chose (a partial sum)."""
        if self.lora is not None:
            return self.lora(self, x, ids, weights)
        return self.base(x, ids, weights)

    def base(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The backend's op: the experts without any adapter."""
        first, last = self.expert_range
        return self.ops.experts(x, ids, weights, self.gate_up_proj, self.down_proj, first, last)


class MoE(nn.Module):
    """Routed experts plus always-on shared experts; returns this rank's partial sum (the
    decoder layer reduces routed + shared in one all-reduce)."""

    def __init__(self, config: ModelConfig, parallel: ParallelState) -> None:
        super().__init__()
        self.gate = Router(config)  # replicated: every rank routes identically
        self.experts = Experts(config, parallel)
        self.shared_experts = MLP(
            config.hidden_size,
            config.moe_intermediate_size * config.n_shared_experts,
            parallel.tp_size,
            parallel.tp_rank,
        )

    def forward(
        self, x: torch.Tensor, routed: torch.Tensor | None = None, own_rows: slice = slice(None)
    ) -> torch.Tensor:
        """`routed`: where a step that records its routing (`DSAForCausalLM.record_routing`)
        keeps the experts its tokens chose, `[T, top_k]`: the `own_rows` of `x`'s (this
        rank's, under DP attention)."""
        ids, weights = self.gate(x)
        if routed is not None:
            routed.copy_(ids[own_rows])
        return self.experts(x, ids, weights) + self.shared_experts(x)
