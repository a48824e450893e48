"""MLA over the paged latent cache, with DSA sparse attention.

The pool stores one latent row per token: RMSNorm'd kv_lora ‖ rope key. Attention runs
on those rows directly with W_kvb absorbed into the query and the output ("absorb"), or
expands them to per-head keys/values first ("expand"); both give the same numbers.
Sparse rows gather only the selected latent rows, chunked over queries, so the work per
query scales with index_topk, not with context length.
"""

from __future__ import annotations

import torch
from torch import nn

from dsakv.config import ModelConfig
from dsakv.distributed.parallel import ParallelState

from .forward_batch import ForwardBatch
from .indexer import Indexer, Selection, StepSelection
from .layers import RMSNorm
from .parallel_layers import Shard, ShardedLinear
from .rope import rope_interleaved, softmax_scale

# Elements of one gathered [chunk, k, dim] or [chunk, heads, k] block.
ATTN_CHUNK_ELEMS = 1 << 24
# Score the whole context (then mask) while heads × context ≤ this × index_topk; measured
# break-even on CPU with 4 heads and top-256 is at 4-6K context.
SCORE_ALL_RATIO = 64


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
        self.mode = "absorb"
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
        t = x.shape[0]
        q_lora = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_lora).view(t, self.n_heads, self.nope + self.rope_dim)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        q_rope = rope_interleaved(q_rope, cos[:, None], sin[:, None])
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope_dim], dim=-1)
        row = torch.cat([self.kv_a_layernorm(latent), rope_interleaved(k_rope, cos, sin)], dim=-1)
        pool.write_latent(self.layer, batch.out_slots, row)

        if topk_source == self.layer:  # a full layer (built with an indexer)
            selections[self.layer] = self.indexer(self.layer, x, q_lora, cos, sin, batch, pool)
        sels = selections[topk_source]

        w_kvb = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_lora)
        w_uk, w_uv = w_kvb[:, : self.nope], w_kvb[:, self.nope :]
        attend = self._absorbed if self.mode == "absorb" else self._expanded
        if self.mode == "absorb":
            q_nope = torch.einsum("thd,hdc->thc", q_nope, w_uk)  # query in latent space
        out = torch.empty(t, self.n_heads, self.v_dim, dtype=x.dtype, device=x.device)
        if batch.decode_reqs:
            rows = batch.decode_tokens
            out[rows] = self._decode(
                q_nope[rows], q_rope[rows], batch, pool, sels.decode, w_uk, w_uv
            )
        for r in batch.extend_reqs:
            a, e, prefix = batch.extend_starts[r], batch.extend_lens[r], batch.prefix_lens[r]
            slots, sel = batch.req_slots[r], sels.per_req[r]
            qn, qr = q_nope[a : a + e], q_rope[a : a + e]
            if sel is None:
                ctx = pool.gather_latent(self.layer, slots, x.dtype)  # [L, kv_lora+rope]
                out[a : a + e] = attend(qn, qr, ctx, prefix, None, w_uk, w_uv)
                continue
            # Queries at positions < k see at most k positions, all selected: run them densely.
            early = min(max(sel.positions.shape[1] - prefix, 0), e)
            if early:
                ctx = pool.gather_latent(self.layer, slots[: prefix + early], x.dtype)
                out[a : a + early] = attend(qn[:early], qr[:early], ctx, prefix, None, w_uk, w_uv)
            if early == e:
                continue
            sel = Selection(sel.positions[early:], sel.valid[early:])
            if sel.positions.numel() < slots.shape[0]:
                # Few queries (decode): read only the selected rows from the pool.
                slots = slots[sel.positions.flatten()]
                local = torch.arange(slots.shape[0], device=slots.device)
                sel = Selection(local.view_as(sel.positions), sel.valid)
            ctx = pool.gather_latent(self.layer, slots, x.dtype)  # [L or e*k, kv_lora+rope]
            out[a + early : a + e] = attend(
                qn[early:], qr[early:], ctx, prefix + early, sel, w_uk, w_uv
            )
        out = self.o_proj(out.view(t, self.n_heads * self.v_dim))  # a partial sum over heads
        return self.parallel.all_reduce_attn(out)

    def _decode(self, q_nope, q_rope, batch: ForwardBatch, pool, sel, w_uk, w_uv) -> torch.Tensor:
        """All decode requests at once: each reads only its selected latent rows (≤ index_topk)."""
        table, lens = batch.decode_ctx  # [B, W], [B]
        if sel is None:
            positions = torch.arange(table.shape[1], device=table.device).expand_as(table)
            sel = Selection(positions, positions < lens[:, None])
        b, k = sel.positions.shape
        ctx = pool.gather_latent(self.layer, table.gather(1, sel.positions).flatten(), q_nope.dtype)
        ctx = ctx.view(b, k, -1)  # [B, k, kv_lora+rope]
        mask = sel.valid[:, None, :]
        if self.mode == "absorb":  # q_nope is already in latent space
            scores = torch.matmul(torch.cat([q_nope, q_rope], dim=-1), ctx.transpose(1, 2))
            o_lat = self._softmax_av(scores, mask, ctx[..., : self.kv_lora])  # [B, H, kv_lora]
            return torch.einsum("bhc,hvc->bhv", o_lat, w_uv)
        lat, k_rope = ctx[..., : self.kv_lora], ctx[..., self.kv_lora :]
        k_nope = torch.einsum("bkc,hdc->bhkd", lat, w_uk)
        v = torch.einsum("bkc,hvc->bhkv", lat, w_uv)
        scores = torch.einsum("bhd,bhkd->bhk", q_nope, k_nope) + torch.einsum(
            "bhr,bkr->bhk", q_rope, k_rope
        )
        probs = self._softmax_av(scores[:, :, None, :], mask[:, :, None, :], v)
        return probs.squeeze(-2)

    # --- attention over one request's context -----------------------------------------------

    def _chunks(self, e: int, k: int, width: int):
        step = max(1, ATTN_CHUNK_ELEMS // (k * max(width, self.n_heads)))
        return ((a, min(e, a + step)) for a in range(0, e, step))

    def _softmax_av(
        self, scores: torch.Tensor, mask: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """Masked softmax in fp32, then `probs @ values` in the values' dtype."""
        probs = (
            (scores * self.scale).masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32)
        )
        return _bmm(probs.to(values.dtype), values)

    def _gather(self, ctx: torch.Tensor, sel: Selection | None, a: int, b: int, prefix: int):
        """Rows (per query or shared) and the visibility mask for queries a..b-1."""
        if sel is None:  # dense causal: every query sees the (shared) context prefix
            kpos = torch.arange(ctx.shape[0], device=ctx.device)
            qpos = torch.arange(prefix + a, prefix + b, device=ctx.device)
            return ctx[None], (kpos[None, :] <= qpos[:, None])[:, None, :]
        idx = sel.positions[a:b]
        if self._score_all(ctx.shape[0], idx.shape[1]):
            mask = torch.zeros(b - a, ctx.shape[0], dtype=torch.bool, device=ctx.device)
            return ctx[None], mask.scatter_(1, idx, sel.valid[a:b])[:, None, :]
        rows = ctx.index_select(0, idx.flatten()).view(*idx.shape, *ctx.shape[1:])
        return rows, sel.valid[a:b, None, :]

    def _score_all(self, ctx_len: int, k: int) -> bool:
        """Score the whole context and mask to the selection, or gather the selected rows?
        One large matmul beats copying k rows per query while heads × context stays small
        against k (few heads, as in the tiny models); the gather wins for many heads."""
        return self.n_heads * ctx_len <= SCORE_ALL_RATIO * k

    def _absorbed(self, q_lat, q_rope, ctx, prefix, sel, w_uk, w_uv) -> torch.Tensor:
        """Scores on latent rows: [q·W_uk ‖ q_rope] · [latent ‖ k_rope]; output through W_uv."""
        q = torch.cat([q_lat, q_rope], dim=-1)  # [e, H, kv_lora+rope]
        e, width = q.shape[0], ctx.shape[1]
        k = ctx.shape[0] if sel is None else sel.positions.shape[1]
        if sel is None or self._score_all(ctx.shape[0], k):
            k, width = ctx.shape[0], self.n_heads  # blocks are [c, H, L] scores
        outs = []
        for a, b in self._chunks(e, k, width):
            rows, mask = self._gather(ctx, sel, a, b, prefix)  # [c|1, k|L, W], [c, 1, k|L]
            scores = _bmm(q[a:b], rows.transpose(-1, -2))  # [c, H, k|L]
            outs.append(self._softmax_av(scores, mask, rows[..., : self.kv_lora]))
        o_lat = torch.cat(outs)  # [e, H, kv_lora]
        return torch.einsum("thc,hvc->thv", o_lat, w_uv)

    def _expanded(self, q_nope, q_rope, ctx, prefix, sel, w_uk, w_uv) -> torch.Tensor:
        """Expand the context to per-head keys/values with W_kvb, then attend normally."""
        lat, k_rope = ctx[:, : self.kv_lora], ctx[:, self.kv_lora :]
        k_nope = torch.einsum("lc,hdc->lhd", lat, w_uk)
        v = torch.einsum("lc,hvc->lhv", lat, w_uv)
        kv = torch.cat([k_nope, k_rope[:, None].expand(-1, self.n_heads, -1), v], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)  # [e, H, nope+rope]
        e, dk = q.shape[0], self.nope + self.rope_dim
        k = ctx.shape[0] if sel is None else sel.positions.shape[1]
        outs = []
        for a, b in self._chunks(e, k, self.n_heads * (1 if sel is None else kv.shape[-1])):
            rows, mask = self._gather(kv, sel, a, b, prefix)  # [c|1, k, H, dk+v]
            keys = rows[..., :dk].movedim(-2, -3)  # [c|1, H, k, dk]
            vals = rows[..., dk:].movedim(-2, -3)
            scores = torch.matmul(q[a:b, :, None, :], keys.transpose(-1, -2)).squeeze(
                -2
            )  # [c, H, k]
            out = self._softmax_av(scores[:, :, None, :], mask[:, :, None, :], vals)
            outs.append(out.squeeze(-2))
        return torch.cat(outs)


def _bmm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`x[c, H, m] @ y[c|1, m, n]`; a context shared by every query (`y[1]`) becomes one
    large GEMM instead of c small ones that each re-read it."""
    if y.dim() == 3 and y.shape[0] == 1 and x.dim() == 3:
        c, h, m = x.shape
        return (x.reshape(c * h, m) @ y[0]).view(c, h, -1)
    return torch.matmul(x, y)
