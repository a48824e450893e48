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
from .indexer import Indexer, StepSelection
from .layers import RMSNorm
from .parallel_layers import Shard, ShardedLinear
from .rope import rope_interleaved, softmax_scale


class MLAttention(nn.Module):
    """Multi-head latent attention; owns an `Indexer` only when its layer runs one.

    Three steps, which `DecoderLayer` calls: `project` (pure tensor math, compiled for
    small decode steps by the cpu backend), `attend` (the pool, the indexer, the backend's
    attention) and `output` (o_proj).

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
        self.q_a_proj = ShardedLinear(c.hidden_size, c.q_lora_rank)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank)
        self.q_b_proj = ShardedLinear(
            c.q_lora_rank, heads * qk, Shard.even(0, heads * qk, parts, index, qk)
        )
        self.kv_a_proj_with_mqa = ShardedLinear(c.hidden_size, c.kv_lora_rank + self.rope_dim)
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
        self._kvb_views: tuple = (None, 0, None)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The step's projections, per token: the query in latent space (`absorb_q`) and
        its rotated rope part, `q_lora` (the indexer's input) and the latent row to store.
        Pure tensor math (`ops.block` may compile it)."""
        t, h = x.shape[0], self.n_heads
        q_lora = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_lora).view(t, h, self.nope + self.rope_dim)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope_dim], dim=-1)
        # q's heads and the shared rope key rotate as one [T, H+1, rope] tensor (one RoPE).
        both = torch.cat([q_rope, k_rope[:, None]], dim=1)
        rot = rope_interleaved(both, cos[:, None], sin[:, None])
        row = torch.cat([self.kv_a_layernorm(latent), rot[:, h]], dim=-1)
        q_lat = self.math.absorb_q(q_nope, self._w_kvb()[0])
        if self.kv_b_proj.lora is not None:  # (kv_b's LoRA slots: `LatentSlots`)
            q_lat = self.kv_b_proj.lora.query(q_nope, q_lat)
        return q_lat, rot[:, :h], q_lora, row

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """Per-head outputs `[T, H, v]` through o_proj: a partial sum over heads, reduced."""
        if self.kv_b_proj.lora is not None:  # (`attend`'s extra columns: kv_b's LoRA delta)
            out = self.kv_b_proj.lora.output(out, self.v_dim)
        t = out.shape[0]
        return self.parallel.all_reduce_attn(self.o_proj(out.reshape(t, self.n_heads * self.v_dim)))

    def _w_kvb(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_uk `[H, nope, kv_lora]`, W_uv `[H, v, kv_lora]`): views of kv_b_proj, made
        again only when its weight's storage changes (they are read on every step)."""
        weight = self.kv_b_proj.weight
        of, ptr, views = self._kvb_views
        if of is not weight or ptr != weight.data_ptr():
            w = weight.view(self.n_heads, self.nope + self.v_dim, -1)  # (packed FP8 rows: wider)
            views = (w[:, : self.nope], w[:, self.nope :])
            self._kvb_views = (weight, weight.data_ptr(), views)
        return views

    def attend(
        self,
        x: torch.Tensor,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        q_lora: torch.Tensor,
        row: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        pool,
        selections: dict[int, StepSelection],
        topk_source: int,
    ) -> torch.Tensor:
        """Stores the step's latent rows, selects (full layers) and attends: `[T, H, v]`
        (`[T, H, v + S·R]` in a step running kv_b adapters: `LatentSlots.w_uv`)."""
        t, ops, h = x.shape[0], self.ops, self.n_heads
        ops.store_latent(pool, self.layer, batch.latent_out_slots, row)
        if topk_source == self.layer:  # a full layer (built with an indexer)
            selections[self.layer] = self.indexer(self.layer, x, q_lora, cos, sin, batch, pool)
        sels = selections[topk_source]
        w_uk, w_uv = self._w_kvb()
        if self.kv_b_proj.lora is not None:  # (W_uv with every slot's A rows, in a step
            w_uv = self.kv_b_proj.lora.w_uv(w_uv, x.dtype)  # running kv_b adapters)
        if batch.is_decode_only and batch.decode_reqs:  # no scatter into a step-wide output
            sel = sels.decode
            return ops.mla_decode(
                self.math, pool, self.layer, q_nope, q_rope, sel.slots, sel.valid, w_uk, w_uv
            )
        if not batch.extend_reqs:  # an empty step (a DP-attention rank with no request)
            return torch.empty(t, h, w_uv.shape[1], dtype=x.dtype, device=x.device)
        ext = ops.mla_extends(self.math, pool, self.layer, q_nope, q_rope, batch, sels, w_uk, w_uv)
        if not batch.decode_reqs:
            return ext
        rows, sel = batch.decode_tokens, sels.decode
        out = torch.empty(t, h, w_uv.shape[1], dtype=x.dtype, device=x.device)
        out[rows] = ops.mla_decode(
            self.math,
            pool,
            self.layer,
            q_nope[rows],
            q_rope[rows],
            sel.slots,
            sel.valid,
            w_uk,
            w_uv,
        )
        out[batch.extend_rows] = ext
        return out
