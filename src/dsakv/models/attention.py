"""MLA over the paged latent cache, with DSA sparse attention.

The pool stores one latent row per token: RMSNorm'd kv_lora ‖ rope key. This module
computes the projections and decides what each query attends to (its layer's or its
source layer's top-k); the attention itself is an op of the engine's backend
(`dsakv.kernels`): the torch reference, dsakv's Triton kernels or FlashMLA.
"""

from __future__ import annotations

import torch
from torch import nn

from dsakv.config import ModelConfig
from dsakv.distributed.parallel import ParallelState
from dsakv.kernels import MLAMath, TorchBackend

from .forward_batch import ForwardBatch
from .indexer import Indexer, Selection, StepSelection
from .layers import RMSNorm
from .parallel_layers import Shard, ShardedLinear
from .rope import rope_interleaved, softmax_scale


class MLAttention(nn.Module):
    """Multi-head latent attention; owns an `Indexer` only when its layer runs one.

    Split by heads over the attention group: q_b_proj and kv_b_proj hold this rank's
    `H / attn_tp` heads, o_proj their columns (a partial sum, all-reduced once). q_a,
    kv_a, their norms and the indexer are replicated, so every rank writes the same
    full latent row and index key to its own pool.
    """

    def __init__(
        self, config: ModelConfig, layer: int, has_indexer: bool, parallel: ParallelState
    ) -> None:
        super().__init__()
        c = config
        self.layer = layer
        self.parallel = parallel
        parts, index = parallel.attn_size, parallel.attn_rank
        heads = c.num_attention_heads
        self.n_heads = heads // parts  # this rank's heads
        self.nope, self.rope_dim, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.kv_lora = c.kv_lora_rank
        self.scale = softmax_scale(c)
        self.math = MLAMath(self.n_heads, self.kv_lora, self.scale)
        self.ops = TorchBackend()  # the engine's backend replaces it (`use_backend`)
        qk, kv = c.qk_head_dim, self.nope + self.v_dim
        self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank)
        self.q_b_proj = ShardedLinear(
            c.q_lora_rank, heads * qk, Shard.even(0, heads * qk, parts, index, qk)
        )
        self.kv_a_proj_with_mqa = nn.Linear(
            c.hidden_size, c.kv_lora_rank + self.rope_dim, bias=False
        )
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank)
        self.kv_b_proj = ShardedLinear(
            c.kv_lora_rank, heads * kv, Shard.even(0, heads * kv, parts, index, kv)
        )
        v = self.v_dim
        self.o_proj = ShardedLinear(
            heads * v, c.hidden_size, Shard.even(1, heads * v, parts, index, v)
        )
        if has_indexer:
            self.indexer = Indexer(c)

    @property
    def mode(self) -> str:
        """`absorb` (attention on latent rows) or `expand` (per-head K/V; torch only)."""
        return self.math.mode

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        pool,
        selections: dict[int, StepSelection],
        topk_source: int,
    ) -> torch.Tensor:
        t, ops = x.shape[0], self.ops
        q_lora = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_lora).view(t, self.n_heads, self.nope + self.rope_dim)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        q_rope = rope_interleaved(q_rope, cos[:, None], sin[:, None])
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope_dim], dim=-1)
        row = torch.cat([self.kv_a_layernorm(latent), rope_interleaved(k_rope, cos, sin)], dim=-1)
        ops.store_latent(pool, self.layer, batch.out_slots, row)

        if topk_source == self.layer:  # a full layer (built with an indexer)
            selections[self.layer] = self.indexer(self.layer, x, q_lora, cos, sin, batch, pool)
        sels = selections[topk_source]

        w_kvb = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_lora)
        w_uk, w_uv = w_kvb[:, : self.nope], w_kvb[:, self.nope :]
        q_nope = self.math.absorb_q(q_nope, w_uk)  # once for the step, all tokens
        out = torch.empty(t, self.n_heads, self.v_dim, dtype=x.dtype, device=x.device)
        if batch.decode_reqs:
            rows = batch.decode_tokens
            table, lens = batch.decode_ctx  # [B, W], [B]
            sel = sels.decode
            if sel is None:  # every visible position
                positions = torch.arange(table.shape[1], device=table.device).expand_as(table)
                sel = Selection(positions, positions < lens[:, None])
            slots = table.gather(1, sel.positions)
            out[rows] = ops.mla_decode(
                self.math,
                pool,
                self.layer,
                q_nope[rows],
                q_rope[rows],
                slots,
                sel.valid,
                w_uk,
                w_uv,
            )
        for r in batch.extend_reqs:
            a, e, prefix = batch.extend_starts[r], batch.extend_lens[r], batch.prefix_lens[r]
            sel = sels.per_req[r]
            positions, valid = (None, None) if sel is None else (sel.positions, sel.valid)
            out[a : a + e] = ops.mla_extend(
                self.math,
                pool,
                self.layer,
                q_nope[a : a + e],
                q_rope[a : a + e],
                batch.req_slots[r],
                prefix,
                positions,
                valid,
                w_uk,
                w_uv,
            )
        out = self.o_proj(out.view(t, self.n_heads * self.v_dim))  # a partial sum over heads
        return self.parallel.all_reduce_attn(out)
