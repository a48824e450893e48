"""The DSA lightning indexer: scores every visible position and keeps the top-k.

Built only on layers where `plan.runs_indexer(i)`; shared layers reuse a `Selection`
list produced here, in the same forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsakv.config import ModelConfig

from .forward_batch import ForwardBatch
from .rope import rope_half, rope_interleaved

# Elements of one [chunk, heads, context] score block; bounds peak memory on long prefills.
SCORE_CHUNK_ELEMS = 1 << 24


@dataclass(frozen=True)
class Selection:
    """One request's top-k for this step: `positions[e, k]` into its context, `valid[e, k]`.

    A row whose query sees fewer than k positions has invalid (future) entries; attention
    masks them. `None` in place of a Selection means "every visible position" (the request's
    context is no longer than index_topk), so attention runs densely with a causal mask.
    """

    positions: torch.Tensor
    valid: torch.Tensor


@dataclass(frozen=True)
class StepSelection:
    """One layer's top-k for a whole step: a `Selection` (or None) per multi-token request,
    and one batched `Selection` over the decode requests' padded contexts (`decode_ctx`);
    `decode=None` means every decode query attends to its whole context."""

    per_req: list[Selection | None]
    decode: Selection | None


class Indexer(nn.Module):
    """q_I = W_qb^I q_lora, k_I = LayerNorm(W_k^I x), w = W_w x / √heads, score Σ_h w_h ReLU(q·k)/√d."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_dim, self.topk = config.qk_rope_head_dim, config.index_topk
        self.rope = rope_interleaved if config.indexer_rope_interleave else rope_half
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        # Kept in fp32 whatever the model dtype (as the reference does).
        self.weights_proj = nn.Linear(
            config.hidden_size, self.n_heads, bias=False, dtype=torch.float32
        )
        self.scale = self.head_dim**-0.5

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rope_dim
        return torch.cat([self.rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def forward(
        self,
        layer: int,
        x: torch.Tensor,
        q_lora: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        pool,
    ) -> StepSelection:
        """Writes this step's index keys, then selects top-k per query token."""
        t = x.shape[0]
        k = self._rope(self.k_norm(self.wk(x)), cos, sin)  # [T, D]
        pool.write_index_k(layer, batch.out_slots, k)
        per_req: list[Selection | None] = [None] * batch.num_reqs
        if all(s <= self.topk for s in batch.seq_lens):
            return StepSelection(per_req, None)  # everything visible is selected: skip scoring
        q = self.wq_b(q_lora).view(t, self.n_heads, self.head_dim)
        q = pool.prepare_index_q(self._rope(q, cos[:, None], sin[:, None])).float()
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads**-0.5
        for r in batch.extend_reqs:
            if batch.seq_lens[r] <= self.topk:
                continue
            start, ext = batch.extend_starts[r], batch.extend_lens[r]
            keys = pool.gather_index_k(layer, batch.req_slots[r]).float()  # [L, D]
            per_req[r] = self._select(
                q[start : start + ext], w[start : start + ext], keys, batch.prefix_lens[r]
            )
        return StepSelection(per_req, self._select_decode(layer, q, w, batch, pool))

    def _select_decode(self, layer, q, w, batch: ForwardBatch, pool) -> Selection | None:
        """Top-k for every decode request at once, over their padded contexts."""
        if not batch.decode_reqs:
            return None
        table, lens = batch.decode_ctx  # [B, W], [B]
        b, width = table.shape
        if width <= self.topk:
            return None
        keys = pool.gather_index_k(layer, table.flatten()).float().view(b, width, -1)
        rows = batch.decode_tokens
        scores = F.relu(torch.matmul(q[rows], keys.transpose(1, 2)) * self.scale)  # [B, H, W]
        idx = torch.matmul(w[rows, None, :], scores).squeeze(1)  # [B, W]
        kpos = torch.arange(width, device=idx.device)
        idx = idx.masked_fill(kpos[None, :] >= lens[:, None], float("-inf"))
        positions = topk_by_position(idx, self.topk)
        return Selection(positions, positions < lens[:, None])

    def _select(
        self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, prefix: int
    ) -> Selection:
        """Top-k over visible positions for queries at positions prefix..prefix+e-1."""
        e, ctx = q.shape[0], keys.shape[0]
        qpos = torch.arange(prefix, prefix + e, device=q.device)
        kpos = torch.arange(ctx, device=q.device)
        chunk = max(1, SCORE_CHUNK_ELEMS // (self.n_heads * ctx))
        sel = []
        kt = keys.t()
        for a in range(0, e, chunk):
            b = min(e, a + chunk)
            scores = F.relu(torch.matmul(q[a:b], kt) * self.scale)  # [c, H, L]
            idx = torch.matmul(w[a:b, None, :], scores).squeeze(1)  # [c, L]
            idx = idx.masked_fill(kpos[None, :] > qpos[a:b, None], float("-inf"))
            sel.append(topk_by_position(idx, self.topk))
        positions = torch.cat(sel)
        return Selection(positions, positions <= qpos[:, None])


def topk_by_position(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the `k` largest fp32 `scores` along the last dim, ties going to the lower
    position (DESIGN.md §7.8), so a row's selection never depends on its padded width or
    on the rows batched with it. ReLU makes exact-zero scores common, and `topk` alone
    picks among tied values by memory layout.

    Every (score, position) pair becomes one unique int64 key: the score's bits mapped to
    an order-preserving int32 in the high half, the reversed position in the low half.
    One `topk` over the keys costs what a plain `topk` does (no full sort).
    """
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0 folds -0.0 into +0.0
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    width = scores.shape[-1]
    rev = torch.arange(width - 1, -1, -1, dtype=torch.int64, device=scores.device)
    return ((ordered << 32) | rev).topk(k, dim=-1).indices
