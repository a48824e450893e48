"""Tensor-parallel building blocks (DESIGN.md §8): a linear layer holding one slice of its
checkpoint tensor, and the vocab-parallel embedding and lm_head.

A module that holds a slice records it as `shard` (which dim of the checkpoint tensor,
which range), so the loader reads exactly those rows or columns and nothing else. Linear
layers never reduce: the caller does one all-reduce where the math needs it (after o_proj,
after routed + shared experts), not one per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dsakv.distributed.parallel import ParallelState
from dsakv.kernels.torch_ops import linear, widened


@dataclass(frozen=True)
class Shard:
    """Rows (`dim=0`) or columns (`dim=1`) `[start, end)` of a checkpoint tensor whose size
    along `dim` is `full`. `end` may pass `full` (a padded vocab split): those rows stay 0."""

    dim: int
    start: int
    end: int
    full: int

    @property
    def size(self) -> int:
        return self.end - self.start

    @classmethod
    def even(cls, dim: int, full: int, parts: int, index: int, unit: int = 1) -> Shard:
        """Part `index` of `full` split into `parts` equal runs of whole `unit`s (heads)."""
        if full % (parts * unit):
            raise ValueError(f"{full} does not split into {parts} parts of whole {unit}s")
        step = full // parts
        return cls(dim, index * step, (index + 1) * step, full)

    @classmethod
    def padded(cls, dim: int, full: int, parts: int, index: int) -> Shard:
        """Equal parts of `ceil(full / parts)` rows, the last ones padded past `full`."""
        step = -(-full // parts)
        return cls(dim, index * step, (index + 1) * step, full)


class ShardedLinear(nn.Linear):
    """`nn.Linear` (no bias) holding `shard` of the full `[out, in]` weight: `dim=0` is
    column-parallel (a slice of the outputs), `dim=1` row-parallel (a partial sum).
    `lora`: its LoRA adapter slots, each token's delta added to its output
    (`dsakv.models.lora.SlotWeights`); None without --enable-lora."""

    lora: Any = None

    def __init__(self, in_features: int, out_features: int, shard: Shard | None = None) -> None:
        if shard is not None:
            full = out_features if shard.dim == 0 else in_features
            if shard.full != full:
                raise ValueError(f"shard of {shard.full} for a dim of {full}")
            if shard.dim == 0:
                out_features = shard.size
            else:
                in_features = shard.size
        super().__init__(in_features, out_features, bias=False)
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight)
        return y if self.lora is None else self.lora(x, y)


class VocabParallelEmbedding(nn.Module):
    """Each attention rank holds `ceil(vocab / attn_tp)` rows; a token outside them looks up
    zeros, and the all-reduce over the attention group fills in every row.

    `compute_dtype`: the dtype of the rows it returns where the weight is kept narrower (a
    bf16 checkpoint's, under fp32 compute: `store_matrices`); None: the weight's."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelState) -> None:
        super().__init__()
        self.shard = Shard.padded(0, vocab_size, parallel.attn_size, parallel.attn_rank)
        self.weight = nn.Parameter(torch.empty(self.shard.size, hidden_size))
        self.parallel = parallel
        self.compute_dtype: torch.dtype | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.attn_size == 1:  # every row is here (a decode step's ~0.1 ms less)
            return F.embedding(ids, self.weight).to(self.compute_dtype)
        local = ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).to(self.compute_dtype)
        return self.parallel.all_reduce_attn(out.masked_fill(outside[:, None], 0))


class ParallelLMHead(nn.Module):
    """Logits for this attention rank's vocab rows, all-gathered to exactly `vocab_size`
    fp32 columns on every rank of the group (padding columns dropped)."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelState) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.shard = Shard.padded(0, vocab_size, parallel.attn_size, parallel.attn_rank)
        self.weight = nn.Parameter(torch.empty(self.shard.size, hidden_size))
        self.parallel = parallel

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.gather(F.linear(hidden, widened(self.weight, hidden)).float())

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's vocab columns of `logits` -> every column (a concatenation: exact)."""
        return self.parallel.all_gather_attn(logits, dim=-1)[:, : self.vocab_size]
