"""The MTP ("NextN") draft layer: checkpoint layer `model.layers.{N}`, N = num_hidden_layers
(DESIGN.md §9).

An ordinary decoder layer (always full: it runs its own indexer and owns index-K at layer
N of the pool) wrapped by the NextN input and output:

    x  = eh_proj(cat([enorm(embed(next_token)), hnorm(h)]))   # embedding first
    x  = decoder_layer(x)
    h' = shared_head.norm(x)    # draft logits = lm_head(h'); h' is the next chain step's h

It uses the target's embedding and lm_head unless the checkpoint ships its own copies
(`model.layers.N.embed_tokens`, `model.layers.N.shared_head.head`) that differ, and is
sharded exactly like the target's layers (vocab-parallel copies, TP attention, EP/TP FFN;
`eh_proj` and the norms replicated, as SGLang does).
"""

from __future__ import annotations

import torch
from torch import nn

from dsakv.config import LayerPlan, ModelConfig
from dsakv.distributed.parallel import ParallelState
from dsakv.kernels import cpu_native
from dsakv.kernels.backend import Block

from .decoder import NORM, DecoderLayer, in_turn
from .forward_batch import ForwardBatch
from .layers import RMSNorm
from .parallel_layers import ParallelLMHead, ShardedLinear, VocabParallelEmbedding

# The vocab copies an MTP layer may carry: attribute path -> the target's counterpart.
VOCAB_COPIES = {"embed_tokens": "model.embed_tokens", "shared_head.head": "lm_head"}


class SharedHead(nn.Module):
    """`shared_head.norm`, plus `shared_head.head` when the checkpoint's own head is kept."""

    def __init__(self, config: ModelConfig, parallel: ParallelState, own_head: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if own_head:
            self.head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel)


class MTPLayer(DecoderLayer):
    """`model.layers.{N}`: the decoder layer's modules plus enorm, hnorm, eh_proj and
    shared_head (and `embed_tokens` when its own copy is kept), under checkpoint names."""

    def __init__(
        self,
        config: ModelConfig,
        plan: LayerPlan,
        layer: int,
        parallel: ParallelState,
        *,
        own_embed: bool = False,
        own_head: bool = False,
    ) -> None:
        super().__init__(config, plan, layer, parallel)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = ShardedLinear(2 * h, h)
        self.shared_head = SharedHead(config, parallel, own_head)
        if own_embed:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h, parallel)
        self._native_io: bool | None = None

    def draft(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        pool,
    ) -> torch.Tensor:
        """`embeds[T, H]` of the next tokens and `hidden[T, H]` -> normed output `[T, H]`.
        The NextN input and the output norm run through the backend's blocks like the
        decoder layer's own (native for a step of a few tokens on the cpu backend, every
        step under the deterministic mode)."""
        ops = self.self_attn.ops
        x = ops.block(NEXTN_INPUT, batch, self, embeds, hidden)
        x = in_turn((self,), x, cos, sin, batch, pool)
        return ops.block(NORM, batch, self.shared_head.norm, x)

    def native_io(self) -> bool:
        """Whether the NextN input and the output norm have native forms: their weights
        readable in place (`cpu_native.fits`), whole on this rank; decided on first use
        (after loading)."""
        if self._native_io is None:
            parts = (self.enorm, self.hnorm, self.eh_proj, self.shared_head.norm)
            self._native_io = (
                cpu_native.available()
                and self.eh_proj.shard is None
                and all(cpu_native.fits(m) for m in parts)
            )
        return self._native_io

    def vocab_copies(self) -> dict[str, nn.Module]:
        """The vocab modules this layer holds its own copy of (`VOCAB_COPIES`' keys)."""
        held = {path: getattr(*self._parent(path), None) for path in VOCAB_COPIES}
        return {path: own for path, own in held.items() if own is not None}

    def drop_duplicate_vocab(self, target: nn.Module) -> list[str]:
        """Delete the vocab copies equal to `target`'s (this rank's shard), so the target's
        are used; returns the copies kept (they differ)."""
        kept = []
        for path, own in self.vocab_copies().items():
            if torch.equal(own.weight, target.get_submodule(VOCAB_COPIES[path]).weight):
                delattr(*self._parent(path))
            else:
                kept.append(path)
        return kept

    def _parent(self, path: str) -> tuple[nn.Module, str]:
        """The module holding `path`'s last part, and that part's name."""
        parent_path, _, leaf = path.rpartition(".")
        return (self.get_submodule(parent_path) if parent_path else self), leaf


def nextn_input(layer: MTPLayer, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """`eh_proj(cat([enorm(embeds), hnorm(hidden)]))`."""
    x = torch.cat([layer.enorm(embeds), layer.hnorm(hidden.to(embeds.dtype))], dim=-1)
    return layer.eh_proj(x)


def _native_nextn_input(layer: MTPLayer, embeds: torch.Tensor, hidden: torch.Tensor):
    if not _native_rows(layer, embeds, hidden):
        return NotImplemented
    e, h = layer.enorm, layer.hnorm
    x = torch.cat(
        [
            cpu_native.rms_norm(embeds, e.weight, e.eps),
            cpu_native.rms_norm(hidden, h.weight, h.eps),
        ],
        dim=-1,
    )
    return cpu_native.linear(x, layer.eh_proj.weight)


def _native_rows(layer: MTPLayer, *xs: torch.Tensor) -> bool:
    return all(_fp32(x) for x in xs) and layer.native_io()


def _fp32(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.is_cpu


# The NextN input, each row on its own when native.
NEXTN_INPUT = Block(nextn_input, _native_nextn_input)
