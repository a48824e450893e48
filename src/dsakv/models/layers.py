"""Small building blocks: RMSNorm and the gated (SwiGLU) MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .parallel_layers import Shard, ShardedLinear


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, weight applied in the input dtype (as the reference does)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused op, bit-equal to the lines below in fp32 (not in bf16: the reference
            # rounds before the weight multiply).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class MLP(nn.Module):
    """`down(silu(gate(x)) * up(x))`: the dense layers' FFN and the shared experts.

    Split over `parts` ranks by intermediate size (gate/up by rows, down by columns), so
    this rank's output is a partial sum: the caller all-reduces it.
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, parts: int = 1, index: int = 0
    ) -> None:
        super().__init__()
        rows = Shard.even(0, intermediate_size, parts, index)
        cols = Shard.even(1, intermediate_size, parts, index)
        self.gate_proj = ShardedLinear(hidden_size, intermediate_size, rows)
        self.up_proj = ShardedLinear(hidden_size, intermediate_size, rows)
        self.down_proj = ShardedLinear(intermediate_size, hidden_size, cols)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
