"""The DSA lightning indexer: scores every visible position and keeps the top-k.

Built only on layers where `plan.runs_indexer(i)`; shared layers reuse a `Selection`
list produced here, in the same forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from dsakv.config import ModelConfig
from dsakv.kernels import TorchBackend, cpu_native
from dsakv.kernels.backend import Block

from .forward_batch import ForwardBatch
from .lora import LoraSlots, adapter_slots, adapting
from .parallel_layers import ShardedLinear
from .rope import rope_half, rope_interleaved


@dataclass(frozen=True)
class Selection:
    """One request's top-k for this step: `positions[e, k]` into its context, `valid[e, k]`.

    A row whose query sees fewer than k positions has invalid (future) entries; attention
    masks them. `None` in place of a Selection means "every visible position" (the request's
    context is no longer than index_topk), so attention runs densely with a causal mask.
    """

    positions: torch.Tensor
    valid: torch.Tensor
    # Decode only: the pool slots of `positions` (`[B, k]`), gathered once per step and
    # read by every layer that shares this selection.
    slots: torch.Tensor | None = None


@dataclass(frozen=True)
class StepSelection:
    """One layer's top-k for a whole step: a `Selection` (or None) per multi-token request,
    and one batched `Selection` over the decode requests' padded contexts (`decode_ctx`),
    None only when the step has no decode request. `extends`: every multi-token chunk's
    rows as one `Selection`, in the step's order, when each chunk was selected (`per_req`
    holds views of it)."""

    batch: ForwardBatch
    per_req: list[Selection | None]
    decode: Selection | None
    extends: Selection | None = None

    @cached_property
    def varlen_positions(self) -> torch.Tensor | None:
        """The multi-token chunks' selected positions `[E, k]` int32, −1 where not valid,
        in the step's order, as one varlen attention launch reads them; a dense chunk's
        (None) are 0..k−1, which cover its context while that is no longer than k. None when
        every chunk is dense. Made once per step, for the full layer and the shared layers
        reusing its selection."""
        if self.extends is not None:
            return torch.where(self.extends.valid, self.extends.positions, -1).to(torch.int32)
        reqs = self.batch.extend_reqs
        picked = [self.per_req[r] for r in reqs]
        k = max((sel.positions.shape[1] for sel in picked if sel is not None), default=0)
        if k == 0:
            return None
        device = next(sel.positions.device for sel in picked if sel is not None)
        every = torch.arange(k, dtype=torch.int32, device=device)
        parts = []
        for sel, r in zip(picked, reqs):
            if sel is None:
                parts.append(every.expand(self.batch.extend_lens[r], k))
                continue
            p = torch.where(sel.valid, sel.positions, -1).to(torch.int32)
            parts.append(F.pad(p, (0, k - p.shape[1]), value=-1) if p.shape[1] < k else p)
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class Indexer(nn.Module):
    """q_I = W_qb^I q_lora, k_I = LayerNorm(W_k^I x), w = W_w x / √heads, score Σ_h w_h ReLU(q·k)/√d."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_dim, self.topk = config.qk_rope_head_dim, config.index_topk
        self.rope = rope_interleaved if config.indexer_rope_interleave else rope_half
        self.wq_b = ShardedLinear(config.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = ShardedLinear(config.hidden_size, self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        # Kept in fp32 whatever the model dtype (as the reference does: `keep_fp32`).
        self.weights_proj = ShardedLinear(config.hidden_size, self.n_heads).float()
        self.scale = self.head_dim**-0.5
        self.ops = TorchBackend()  # the engine's backend replaces it (`use_backend`)
        self._native: cpu_native.IndexerInputs | None | bool = False
        self._lora: LoraSlots | None = None  # the adapter slots it holds (`adapting`)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rope_dim
        return torch.cat([self.rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def native_inputs(self) -> cpu_native.IndexerInputs | None:
        """`index_key` / `index_query` as `cpu_native` calls over this module's weights, made
        on first use (after loading); None unless it computes in fp32 on the CPU. Made
        beside LoRA slots too: only a step running adapter deltas here runs them eager."""
        if self._native is False:
            self._native, self._lora = None, adapter_slots(self)
            if cpu_native.fits(self):
                self._native = cpu_native.IndexerInputs(
                    self.wq_b.weight,
                    self.wk.weight,
                    self.k_norm.weight,
                    self.k_norm.bias,
                    self.weights_proj.weight,
                    heads=self.n_heads,
                    rope=self.rope_dim,
                    interleave=self.rope is rope_interleaved,
                    eps=self.k_norm.eps,
                )
        return self._native

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
        k = self.ops.block(INDEX_KEY, batch, self, x, cos, sin)  # [T, D]
        self.ops.store_index_k(pool, layer, batch.out_slots, k)
        scoring = scored(batch, self.topk)
        if scoring is None:
            return step_selection(layer, batch, None)
        q, w = self.ops.block(INDEX_QUERY, batch, self, x, q_lora, cos, sin, pool)
        long, decodes = scoring
        chosen = None
        if long:  # (shorter chunks attend every visible position)
            chosen = self.ops.index_topk_extends(
                pool, layer, q, w, batch, long, self.scale, self.topk
            )
        decode = None
        if decodes:
            table, lens = batch.decode_ctx  # [B, W], [B]
            rows = batch.decode_tokens
            decode = self.ops.index_topk_decode(
                pool, layer, q[rows], w[rows], table, lens, self.scale, self.topk
            )
        return step_selection(layer, batch, scoring, chosen, decode)


def scored(batch: ForwardBatch, topk: int) -> tuple[list[int], bool] | None:
    """What a step's indexer scores, worked out once per step and layer: None where every
    query sees at most `topk` positions (all are selected), else the multi-token chunks
    whose context passes `topk` and whether the decode requests' padded contexts (wider
    than `topk`) are."""
    if all(s <= topk for s in batch.seq_lens):
        return None
    long = [r for r in batch.extend_reqs if batch.seq_lens[r] > topk]
    return long, bool(batch.decode_reqs) and batch.decode_ctx[0].shape[1] > topk


def step_selection(
    layer: int,
    batch: ForwardBatch,
    scoring: tuple[list[int], bool] | None,
    chosen: torch.Tensor | None = None,
    decode: torch.Tensor | None = None,
) -> StepSelection:
    """The step's `StepSelection` from the positions scored (`scoring`: `scored`'s):
    `chosen` `[E, k]`, the rows of its chunks in order (None where none is), `decode`
    `[B, k]` where it scores the decode contexts. The indexer and a pipeline stage
    receiving another stage's selection (`stages.from_wire`) both build it here, so the
    two are the same."""
    per_req: list[Selection | None] = [None] * batch.num_reqs
    if scoring is None:
        return StepSelection(batch, per_req, _on_device(layer, batch, _every_position(batch)))
    long, _ = scoring
    extends = None
    if long:
        # A query sees the positions up to its own: one comparison when every chunk was
        # selected (their rows in order), else one per chunk, against `batch.positions`
        if long == batch.extend_reqs:
            rows = batch.extend_rows
            qpos = batch.positions if rows is None else batch.positions[rows]
            extends = Selection(chosen, chosen <= qpos[:, None])
        at = 0
        for r in long:
            e, start = batch.extend_lens[r], batch.extend_starts[r]
            positions = chosen[at : at + e]
            valid = (
                extends.valid[at : at + e]
                if extends is not None
                else positions <= batch.positions[start : start + e, None]
            )
            per_req[r], at = Selection(positions, valid), at + e
    sel = None
    if decode is not None:
        table, lens = batch.decode_ctx
        sel = Selection(decode, decode < lens[:, None], table.gather(1, decode))
    elif batch.decode_reqs:
        sel = _every_position(batch)
    return StepSelection(batch, per_req, _on_device(layer, batch, sel), extends)


def _on_device(layer: int, batch: ForwardBatch, sel: Selection | None) -> Selection | None:
    """Under HiSparse, the decode selection's slots are device latent slots: the hot buffers
    resolve it (once for this layer and every shared layer reusing it), where this rank's
    pipeline stage holds one of those layers (else it only passes the top-k on)."""
    if sel is None or batch.hot is None or not batch.hot.resolves(layer):
        return sel
    slots = batch.hot.resolve(layer, sel.positions, sel.valid, batch.decode_ctx[0])
    return Selection(sel.positions, sel.valid, slots)


def _every_position(batch: ForwardBatch) -> Selection | None:
    """The decode requests' whole contexts (no scoring): every padded position, masked to
    each request's length."""
    if not batch.decode_reqs:
        return None
    positions, valid = batch.decode_visible
    return Selection(positions, valid, batch.decode_ctx[0])


def index_key(indexer: Indexer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The step's index keys `[T, D]`: RoPE(LayerNorm(wk · x)), before the store's rotation."""
    return indexer._rope(indexer.k_norm(indexer.wk(x)), cos, sin)


def index_query(indexer: Indexer, x, q_lora, cos, sin, pool):
    """The step's queries `[T, H, D]` (fp32, rotated as the pool's keys) and head weights
    `[T, H]` (fp32, times H^-1/2)."""
    t = x.shape[0]
    q = indexer.wq_b(q_lora).view(t, indexer.n_heads, indexer.head_dim)
    q = pool.prepare_index_q(indexer._rope(q, cos[:, None], sin[:, None])).float()
    wp = indexer.weights_proj
    return q, wp(x.to(wp.weight.dtype)).float() * indexer.n_heads**-0.5


def _native_key(indexer: Indexer, x, cos, sin):
    """`index_key` as the indexer's native call; eager in a step with adapter rows here,
    whatever the backend's mode (`decoder._native_inputs`)."""
    native = indexer.native_inputs()
    if native is None:
        return NotImplemented
    if adapting(indexer._lora):
        return index_key(indexer, x, cos, sin)
    return native.key(x, cos, sin)


def _native_query(indexer: Indexer, x, q_lora, cos, sin, pool):
    """`index_query` as the indexer's native call; eager in a step with adapter rows here
    (`_native_key`)."""
    native = indexer.native_inputs()
    if native is None:
        return NotImplemented
    if adapting(indexer._lora):
        return index_query(indexer, x, q_lora, cos, sin, pool)
    return native.query(x, q_lora, cos, sin, pool.rotates_index_q)


# Not compiled: measured no faster than eager (the key), and the query reads the pool.
INDEX_KEY = Block(index_key, _native_key, compile=False)
INDEX_QUERY = Block(index_query, _native_query, compile=False)
