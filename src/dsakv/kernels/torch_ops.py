"""The torch reference for every hot op: MLA attention over the paged latent, the
indexer's scores and its deterministic top-k.

Generic PyTorch that runs wherever torch does. It gathers rows from the pool (dequantised
into the compute dtype) and runs a few large matmuls per layer; the Triton and library
backends must match it (kernel tests compare against these functions).

Attention runs on latent rows with W_kvb absorbed into the query and the output (the
Hugging Face reference expands rows to per-head keys and values instead; the parity tests
compare the two). Sparse rows gather only the selected latent rows, chunked over queries, so the
work per query scales with index_topk, not with context length.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

# Elements of one gathered [chunk, k, dim] or [chunk, heads, k] block.
ATTN_CHUNK_ELEMS = 1 << 24
# Score the whole context (then mask) while heads × context ≤ this × index_topk; measured
# break-even on CPU with 4 heads and top-256 is at 4-6K context.
SCORE_ALL_RATIO = 64
# Elements of one [chunk, heads, context] indexer score block; bounds peak memory on long
# prefills.
SCORE_CHUNK_ELEMS = 1 << 24


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


# --- indexer ---------------------------------------------------------------------------------


def index_logits(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, scale: float):
    """`Σ_h w_h · ReLU(q_h · k_s · scale)`: `q[c, H, D]`, `w[c, H]`, `keys[c|·, L, D]` or
    `[L, D]` -> `[c, L]` fp32."""
    kt = keys.transpose(-1, -2)
    scores = F.relu(torch.matmul(q, kt) * scale)  # [c, H, L]
    return torch.matmul(w[:, None, :], scores).squeeze(1)


def index_topk_decode(q, w, keys, lens, scale: float, topk: int) -> torch.Tensor:
    """Decode top-k over padded contexts: `keys[B, W, D]`, `lens[B]` -> positions `[B, k]`."""
    idx = index_logits(q, w, keys, scale)  # [B, W]
    kpos = torch.arange(keys.shape[1], device=idx.device)
    idx = idx.masked_fill(kpos[None, :] >= lens[:, None], float("-inf"))
    return topk_by_position(idx, topk)


def index_topk_extend(q, w, keys, prefix: int, scale: float, topk: int) -> torch.Tensor:
    """Top-k over visible positions for queries at positions prefix..prefix+e-1 of one
    request: `q[e, H, D]`, `keys[L, D]` -> positions `[e, k]`, chunked over queries."""
    e, ctx, heads = q.shape[0], keys.shape[0], q.shape[1]
    qpos = torch.arange(prefix, prefix + e, device=q.device)
    kpos = torch.arange(ctx, device=q.device)
    chunk = max(1, SCORE_CHUNK_ELEMS // (heads * ctx))
    sel = []
    for a in range(0, e, chunk):
        b = min(e, a + chunk)
        idx = index_logits(q[a:b], w[a:b], keys, scale)  # [c, L]
        idx = idx.masked_fill(kpos[None, :] > qpos[a:b, None], float("-inf"))
        sel.append(topk_by_position(idx, topk))
    return torch.cat(sel)


# --- MLA -------------------------------------------------------------------------------------


class MLAMath:
    """Attention of one layer's queries over latent rows, in torch.

    `q_nope[·, H, nope]` and `q_rope[·, H, rope]` come straight from q_b_proj (+RoPE);
    `w_uk[H, nope, kv_lora]`, `w_uv[H, v, kv_lora]` are this rank's slices of kv_b_proj.
    Every entry point returns the per-head output `[·, H, v]` (before o_proj).
    """

    def __init__(self, n_heads: int, kv_lora: int, scale: float) -> None:
        self.n_heads, self.kv_lora, self.scale = n_heads, kv_lora, scale

    def absorb_q(self, q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
        """The query in latent space (`q_nope · W_uk`). Done once for the whole step, so a
        token's numbers never depend on its batch."""
        return torch.bmm(q_nope.transpose(0, 1), widened(w_uk, q_nope)).transpose(0, 1)

    # --- decode: every decode request at once ------------------------------------------------

    def decode(self, q_nope, q_rope, ctx, valid, w_uk, w_uv) -> torch.Tensor:
        """`ctx[B, k, kv_lora+rope]` gathered rows, `valid[B, k]` -> `[B, H, v]`; `q_nope`
        is already in latent space (`absorb_q`)."""
        q = torch.cat([q_nope, q_rope], dim=-1)
        scores = torch.matmul(q, ctx.transpose(1, 2))
        o_lat = self._softmax_av(scores, valid[:, None, :], ctx[..., : self.kv_lora])
        return per_head(o_lat, w_uv)  # o_lat: [B, H, kv_lora]

    # --- extend: one request's chunk ---------------------------------------------------------

    def extend(self, q_nope, q_rope, gather, slots, prefix, positions, valid, w_uk, w_uv):
        """Queries at positions prefix..prefix+e-1 of one request.

        `gather(slots) -> rows` reads latent rows from the pool; `slots[L]` are the
        request's; `positions[e, k]`/`valid[e, k]` its selection, or None (every visible
        position, causal). `q_nope` is already in latent space.
        """
        e = q_nope.shape[0]
        if positions is None:
            return self._absorbed(q_nope, q_rope, gather(slots), prefix, None, None, w_uk, w_uv)
        # Queries at positions < k see at most k positions, all selected: run them densely.
        early = min(max(positions.shape[1] - prefix, 0), e)
        outs = []
        if early:
            ctx = gather(slots[: prefix + early])
            outs.append(
                self._absorbed(q_nope[:early], q_rope[:early], ctx, prefix, None, None, w_uk, w_uv)
            )
        if early < e:
            positions, valid = positions[early:], valid[early:]
            if positions.numel() < slots.shape[0]:
                # Few queries (decode-like): read only the selected rows from the pool.
                slots = slots[positions.flatten()]
                positions = torch.arange(slots.shape[0], device=slots.device).view_as(positions)
            ctx = gather(slots)  # [L or e*k, kv_lora+rope]
            outs.append(
                self._absorbed(
                    q_nope[early:],
                    q_rope[early:],
                    ctx,
                    prefix + early,
                    positions,
                    valid,
                    w_uk,
                    w_uv,
                )
            )
        return outs[0] if len(outs) == 1 else torch.cat(outs)

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

    def _gather(self, ctx, positions, valid, a: int, b: int, prefix: int):
        """Rows (per query or shared) and the visibility mask for queries a..b-1."""
        if positions is None:  # dense causal: every query sees the (shared) context prefix
            kpos = torch.arange(ctx.shape[0], device=ctx.device)
            qpos = torch.arange(prefix + a, prefix + b, device=ctx.device)
            return ctx[None], (kpos[None, :] <= qpos[:, None])[:, None, :]
        idx = positions[a:b]
        if self._score_all(ctx.shape[0], idx.shape[1]):
            mask = torch.zeros(b - a, ctx.shape[0], dtype=torch.bool, device=ctx.device)
            return ctx[None], mask.scatter_(1, idx, valid[a:b])[:, None, :]
        rows = ctx.index_select(0, idx.flatten()).view(*idx.shape, *ctx.shape[1:])
        return rows, valid[a:b, None, :]

    def _score_all(self, ctx_len: int, k: int) -> bool:
        """Score the whole context and mask to the selection, or gather the selected rows?
        One large matmul beats copying k rows per query while heads × context stays small
        against k (few heads, as in the tiny models); the gather wins for many heads."""
        return self.n_heads * ctx_len <= SCORE_ALL_RATIO * k

    def _absorbed(self, q_lat, q_rope, ctx, prefix, positions, valid, w_uk, w_uv):
        """Scores on latent rows: [q·W_uk ‖ q_rope] · [latent ‖ k_rope]; output through W_uv."""
        q = torch.cat([q_lat, q_rope], dim=-1)  # [e, H, kv_lora+rope]
        e, width = q.shape[0], ctx.shape[1]
        k = ctx.shape[0] if positions is None else positions.shape[1]
        if positions is None or self._score_all(ctx.shape[0], k):
            k, width = ctx.shape[0], self.n_heads  # blocks are [c, H, L] scores
        outs = []
        for a, b in self._chunks(e, k, width):
            rows, mask = self._gather(ctx, positions, valid, a, b, prefix)
            scores = _bmm(q[a:b], rows.transpose(-1, -2))  # [c, H, k|L]
            outs.append(self._softmax_av(scores, mask, rows[..., : self.kv_lora]))
        o_lat = torch.cat(outs)  # [e, H, kv_lora]
        return torch.einsum("thc,hvc->thv", o_lat, widened(w_uv, o_lat))


# Rows up to which a linear inside a compiled block is a multiply-sum (see `linear`).
GEMV_ROWS = 4


def widened(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Weight `w` in the dtype `x` computes in: a matrix kept as the checkpoint stores it
    (bf16, or packed FP8 blocks) while the model computes in fp32 is widened at the op,
    exactly as the loader would have widened it, so the op gives what it gives with fp32
    weights."""
    if w.dtype == torch.uint8:
        return unpack_fp8(w).to(x.dtype)
    return w if w.dtype == x.dtype else w.to(x.dtype)


# FP8-block weights kept as the checkpoint stores them (e4m3 values, one fp32 scale per
# 128 × 128 block): a packed row is its K e4m3 bytes, then the fp32 scales of its 128-column
# blocks, so any slice of rows (a head's W_uk, one expert) carries its own scales. The native
# kernels read the same layout (`Mat` kind FP8_BLOCK).
WEIGHT_BLOCK = 128


def packed_width(k: int) -> int:
    """Bytes of a packed row of `k` values."""
    return k + 4 * -(-k // WEIGHT_BLOCK)


def unpacked_width(p: int) -> int:
    """The `k` whose packed rows are `p` bytes (`p = 132·nb - r` for k = 128·nb - r)."""
    return p - 4 * -(-p // (WEIGHT_BLOCK + 4))


def pack_fp8(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`weight[..., K]` (float8_e4m3fn) and each row's block scales `[..., ceil(K / 128)]`
    -> packed rows `[..., packed_width(K)]` (uint8)."""
    k = weight.shape[-1]
    if scales.shape != (*weight.shape[:-1], -(-k // WEIGHT_BLOCK)):
        raise ValueError(f"{tuple(scales.shape)} scales for an fp8 weight {tuple(weight.shape)}")
    body = weight.contiguous().view(torch.uint8)
    tail = scales.to(torch.float32).contiguous().view(torch.uint8)
    return torch.cat([body, tail], dim=-1)


def unpack_fp8(packed: torch.Tensor) -> torch.Tensor:
    """Packed rows -> fp32 `[..., K]`: each value times its block's scale in fp32, the one
    rounding the loader's dequantisation does."""
    k = unpacked_width(packed.shape[-1])
    values = packed[..., :k].contiguous().view(torch.float8_e4m3fn).float()
    scales = packed[..., k:].contiguous().view(torch.float32)
    return values * scales.repeat_interleave(WEIGHT_BLOCK, dim=-1)[..., :k]


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, w)` (no bias). Inside a compiled block with at most `GEMV_ROWS` rows (a
    decode step) it is a multiply-sum instead: inductor fuses it with the ops around it
    and streams `w` once over every thread (an extern GEMV call runs on one)."""
    w = widened(w, x)
    if torch.compiler.is_compiling() and x.dim() == 2 and x.shape[0] <= GEMV_ROWS:
        return (x[:, None, :] * w).sum(-1)
    return F.linear(x, w)


def per_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`x[T, H, c] · w[H, v, c]ᵀ` -> `[T, H, v]` (einsum "thc,hvc->thv" as one bmm, without
    einsum's per-call planning: it runs on every layer of every step); a multiply-sum
    inside a compiled block, as `linear`."""
    w = widened(w, x)
    if torch.compiler.is_compiling() and x.shape[0] <= GEMV_ROWS:
        return (x[:, :, None, :] * w).sum(-1)
    return torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)


def _bmm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`x[c, H, m] @ y[c|1, m, n]`; a context shared by every query (`y[1]`) becomes one
    large GEMM instead of c small ones that each re-read it."""
    if y.dim() == 3 and y.shape[0] == 1 and x.dim() == 3:
        c, h, m = x.shape
        return (x.reshape(c * h, m) @ y[0]).view(c, h, -1)
    return torch.matmul(x, y)


# --- MoE -------------------------------------------------------------------------------------


def experts_loop(x, ids, weights, gate_up, down, first: int, last: int) -> torch.Tensor:
    """Routed experts `first..last-1` (this rank's), one GEMM pair per expert that some token
    chose, outputs added in expert order. `gate_up[E_r, 2I, H]` (gate rows first),
    `down[E_r, H, I]`. Reads the expert counts on the host (a sync)."""
    out = torch.zeros_like(x)
    for e, tok, we in expert_groups(ids, weights, first, last):
        gate, up = F.linear(x[tok], widened(gate_up[e - first], x)).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, widened(down[e - first], x)) * we[:, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def expert_groups(
    ids: torch.Tensor, weights: torch.Tensor, first: int, last: int
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, the tokens that chose it, their weights) for each of experts `first..last-1`
    some token chose, in expert order (`experts_loop`'s, and any loop that adds to an
    expert's GEMMs). Reads the expert counts on the host (a sync)."""
    k = ids.shape[1]
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=last).tolist()
    tokens, w = order // k, weights.flatten()[order]
    start = sum(counts[:first])
    for e in range(first, last):
        n = counts[e]
        if n:
            yield e, tokens[start : start + n], w[start : start + n]
            start += n


def experts_one_token(x, ids, weights, gate_up, down, first: int, last: int) -> torch.Tensor:
    """The same sum as `experts_loop` for one token (one request's decode step) in two
    GEMVs: the k chosen experts' gate/up rows stacked, then their down columns side by
    side against the weighted activations; no sort, no loop, no host sync. (Batched GEMVs
    would be slower: small `bmm`s cost several times a `mv` on CPU.)"""
    local = ids[0] - first
    mine = (local >= 0) & (local < last - first)  # choices of other ranks' experts weigh 0
    idx = local.clamp(0, last - first - 1)
    gate_up = widened(gate_up.index_select(0, idx), x)
    gate, up = torch.matmul(gate_up, x[0]).chunk(2, dim=-1)  # [k, I]
    w = torch.where(mine, weights[0], 0).to(x.dtype)
    act = (F.silu(gate) * up * w[:, None]).flatten()  # [k·I]
    cols = widened(down.index_select(0, idx), x).transpose(0, 1).reshape(down.shape[1], -1)
    return torch.matmul(cols, act)[None]


def experts_grouped(x, ids, weights, gate_up, down, first: int, last: int) -> torch.Tensor:
    """The same sum as `experts_loop` as two grouped GEMMs over tokens sorted by expert,
    with the group offsets kept on the device (`searchsorted` over the sorted choices;
    `bincount` would sync with the host on CUDA), so a CUDA graph can hold it where
    `torch._grouped_mm` itself is sync-free (bf16 on sm90 / sm100: `grouped_mm_capturable`).
    Choices of other ranks' experts sort last and get zero weight. Each token's k outputs
    are added in choice order, one add at a time: no atomics (`index_add_` with a token
    repeated k times adds in a different order each run on CUDA), and the same order
    whatever the batch."""
    t, k = ids.shape
    gate_up, down = widened(gate_up, x), widened(down, x)
    n_local = last - first
    local = ids.flatten() - first
    key = torch.where((local >= 0) & (local < n_local), local, n_local)
    order = key.argsort(stable=True)
    sorted_key = key[order]
    ends = torch.arange(1, n_local + 1, device=key.device, dtype=key.dtype)
    offs = torch.searchsorted(sorted_key, ends).to(torch.int32)
    h = torch._grouped_mm(x[order // k], gate_up.transpose(1, 2), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offs)
    y = torch.where(
        (sorted_key < n_local)[:, None], y * weights.flatten()[order][:, None].to(y.dtype), 0
    )
    per_choice = torch.empty_like(y).index_copy_(0, order, y).view(t, k, -1)  # unique rows
    out = per_choice[:, 0]
    for j in range(1, k):
        out = out + per_choice[:, j]
    return out.to(x.dtype)


def grouped_mm_capturable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `torch._grouped_mm` runs without a host sync: bf16 on sm90 / sm100 (other
    dtypes and GPUs take a fallback that reads the offsets on the host); on a CPU nothing
    is captured, so nothing to sync with."""
    if device.type != "cuda":
        return True
    return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)
