"""The `cpu` backend's ops: the torch reference's math, shaped for a CPU's caches and its
bf16 units.

What differs from `torch_ops` (which stays the reference, behind the `torch` backend):

- Indexer scores. `Σ_h w_h · ReLU(q_h · k_s)` runs in blocks of `INDEX_QUERY_BLOCK`
  queries × `INDEX_KEY_BLOCK` keys (a [16 × 32 heads, 1024] bf16 logits block is 1 MiB),
  so the [queries × heads × context] fp32 block of the reference is never materialised;
  ReLU runs in place on the cache-resident block and the head sum is one small fp32
  batched GEMM per block. (oneDNN's fused ReLU post-op, `mkldnn._linear_pointwise`, saves
  about 6% of the GEMM here: not worth a private op.)
  Over fp8 (or bf16) index-K the GEMM runs in bf16 (measured on AVX512-BF16: about 2× the
  fp32 GEMM, 1.5× the whole indexer): the keys are e4m3 × a power-of-two scale, so bf16
  holds them exactly; the queries are rounded to bf16, as the Triton backend does
  (`backend._low_precision`); products accumulate in fp32 and each head's logit is
  rounded once to bf16 (the one rounding the Triton path does not have, of the same size
  as the query's); the weights (× 1/√d) and the head sum stay fp32. Over fp32 index-K
  (or without native bf16) the blocks run the reference's fp32 ops in the reference's
  order: the same positions.
  Top-k stays `topk_by_position`, per block of `INDEX_TOPK_ROWS` queries, over the keys
  the block's last query can see. Decode scores with the same arithmetic, so a token's
  selection does not depend on whether it was decoded or re-prefilled.
- Sparse extend attention. Each query's selected latent rows are gathered for a few
  queries at a time (`SPARSE_ROWS_ELEMS` values, a few MiB, stay in cache between the
  gather and the two batched GEMMs that read them), in fp32 as the reference. The
  reference gathers ~64 MiB blocks, or scores the whole context and masks (dense cost)
  while `heads × context ≤ 64 × index_topk` (4K context at 4 heads, top-256); here that
  break-even is measured at 12 (`SCORE_ALL_RATIO`).

- Decode attention: the native kernel (`cpu_native.mla_decode`) reads the pool's stored
  rows in place. Without a C++ compiler, `decode_attention` here widens them straight
  from the stored bytes (e4m3 and bf16 widen exactly) with one flat gather:
  `MLAMath.decode`'s arithmetic, bit for bit.
- Layer blocks: a step of at most `backend.NATIVE_ROWS` tokens runs each layer's blocks
  around attention as one native call each (`cpu_native.MlaInputs` / `Ffn`).
- `--enable-torch-compile` (`compile=True`), where the native blocks do not run (no C++
  compiler, weights other than fp32): a decode step of at most `GEMV_ROWS`
  requests runs each layer's pure-tensor blocks around attention (`CpuBackend.block`:
  norms, projections, RoPE, the absorbed query; o_proj, the FFN) through
  `torch.compile`, one compilation per kind of layer serving all 78. Inside them
  `torch_ops.linear` / `per_head` are multiply-sums that inductor fuses with their
  neighbours (another summation order than eager: outputs agree to fp32 rounding).
  What remains per layer is the weights' bytes (fp32, about 2 MB a layer at ~10 GB/s on
  one core) and the dynamo guards of each compiled call. Larger batches run eager: there
  the GEMMs are the same extern calls either way. Off by default: each process compiles
  for 10 s (inductor's on-disk cache warm) to 45 s (cold) on its first small decode steps.

The indexer blocks split independent dot products: a query's scores, hence its selection, do not
depend on how the prefill was chunked or which queries share a block
(tests/test_cpu_backend.py checks it).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from functools import cache

import torch

from dsakv.memory.fp8 import e4m3_to_float
from dsakv.memory.layout import FP8_BLOCK, scale_blocks

from . import torch_ops
from .torch_ops import MLAMath, per_head, topk_by_position, widened

log = logging.getLogger(__name__)

# Queries (× heads rows) and keys per indexer GEMM block.
INDEX_QUERY_BLOCK = 16
INDEX_KEY_BLOCK = 1024
# Queries per top-k call: bounds the fp32 [rows, context] score block (2 MiB at 8K).
INDEX_TOPK_ROWS = 64
# Gathered latent values per sparse attention block ([queries, k, kv_lora + rope]).
SPARSE_ROWS_ELEMS = 1 << 20
# Below heads × context = this × index_topk, scoring the whole context and masking (the
# reference) beats gathering: measured break-even 12-16 with 4 heads and top-256 in fp32
# (the reference's SCORE_ALL_RATIO, 64, is for its own large gather blocks).
SCORE_ALL_RATIO = 12
# Logits per decode indexer block ([requests, heads, padded context], bf16).
DECODE_LOGITS_ELEMS = 1 << 22


@cache
def bf16_gemm_native() -> bool:
    """Whether oneDNN runs bf16 GEMMs natively here (AVX512-BF16 / AMX): without it a bf16
    GEMM is emulated and slower than fp32, so the indexer stays in fp32."""
    try:
        return bool(
            torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )
    except (AttributeError, RuntimeError):
        return False


def index_compute_dtype(index_k_dtype: str) -> torch.dtype:
    """bf16 when the stored keys are exact in bf16 (fp8, bf16) and bf16 GEMMs are native."""
    return (
        torch.bfloat16 if index_k_dtype in ("fp8", "bf16") and bf16_gemm_native() else torch.float32
    )


# --- indexer ---------------------------------------------------------------------------------


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, scale: float):
    """`Σ_h w_h · ReLU(q_h · k_s · scale)`: `q[c, H, D]`, `w[c, H]` fp32, `keys[L, D]` bf16
    or fp32 (the compute dtype) -> `[c, L]` fp32, in query × key blocks.

    bf16 keys: q rounded to bf16, logits rounded to bf16 after an fp32 accumulation, ReLU
    fused, `(w · scale) @ logits` in fp32. fp32 keys: `w @ ReLU(q·k · scale)`, the
    reference's `index_logits` op for op.
    """
    c, heads, dim = q.shape
    ctx = keys.shape[0]
    out = torch.empty(c, ctx, dtype=torch.float32, device=q.device)
    low = keys.dtype == torch.bfloat16
    qc = q.to(keys.dtype)
    wc = (w * scale).float() if low else w.float()
    for a in range(0, c, INDEX_QUERY_BLOCK):
        b = min(c, a + INDEX_QUERY_BLOCK)
        q2d = qc[a:b].reshape((b - a) * heads, dim)
        wa = wc[a:b, None, :]  # [n, 1, H]
        for s in range(0, ctx, INDEX_KEY_BLOCK):
            t = min(ctx, s + INDEX_KEY_BLOCK)
            if low:
                logits = torch.mm(q2d, keys[s:t].t()).relu_().float()
            else:
                logits = torch.mm(q2d, keys[s:t].t()).mul_(scale).relu_()
            out[a:b, s:t] = torch.bmm(wa, logits.view(b - a, heads, t - s)).squeeze(1)
    return out


def index_topk_extend(q, w, keys, prefix: int, scale: float, topk: int) -> torch.Tensor:
    """`torch_ops.index_topk_extend` in blocks: queries at positions prefix..prefix+e-1,
    `keys[L, D]` in the compute dtype -> positions `[e, topk]` (L >= topk).

    Each block of queries scores only the keys its last query can see (at least `topk`
    of them); `topk_by_position` does not depend on that width, so the positions are the
    same as over the whole context."""
    e, ctx = q.shape[0], keys.shape[0]
    qpos = torch.arange(prefix, prefix + e, device=q.device)
    kpos = torch.arange(ctx, device=q.device)
    out = torch.empty(e, topk, dtype=torch.long, device=q.device)
    for a in range(0, e, INDEX_TOPK_ROWS):
        b = min(e, a + INDEX_TOPK_ROWS)
        width = min(ctx, max(prefix + b, topk))
        scores = index_scores(q[a:b], w[a:b], keys[:width], scale)
        scores.masked_fill_(kpos[None, :width] > qpos[a:b, None], float("-inf"))
        out[a:b] = topk_by_position(scores, topk)
    return out


def index_topk_decode(q, w, keys, lens, scale: float, topk: int) -> torch.Tensor:
    """Decode top-k over padded contexts `keys[B, W, D]` (compute dtype), `lens[B]` ->
    positions `[B, topk]`, with `index_scores`' arithmetic, so a token's selection is the
    same whether it was decoded or prefilled (a retracted request recomputes by prefill).
    Batched GEMMs over blocks of requests bound the [requests, heads, W] logits block."""
    if keys.dtype != torch.bfloat16:
        return torch_ops.index_topk_decode(q, w, keys, lens, scale, topk)
    b, width = keys.shape[:2]
    heads = q.shape[1]
    qc, wc = q.to(torch.bfloat16), (w * scale).float()[:, None, :]
    scores = torch.empty(b, width, dtype=torch.float32, device=q.device)
    step = max(1, DECODE_LOGITS_ELEMS // (heads * width))
    for a in range(0, b, step):
        z = min(b, a + step)
        logits = torch.bmm(qc[a:z], keys[a:z].transpose(1, 2)).relu_()  # [n, H, W] bf16
        scores[a:z] = torch.bmm(wc[a:z], logits.float()).squeeze(1)
    kpos = torch.arange(width, device=q.device)
    scores.masked_fill_(kpos[None, :] >= lens[:, None], float("-inf"))
    return topk_by_position(scores, topk)


# --- sparse MLA extend -----------------------------------------------------------------------


def mla_extend(math: MLAMath, q_nope, q_rope, gather, slots, prefix, positions, valid, w_uk, w_uv):
    """`MLAMath.extend` with the sparse part in small gathered blocks (`sparse_absorbed`).

    Dense requests (no selection), short contexts (`SCORE_ALL_RATIO`) and
    queries that see at most index_topk positions (`early`: all of them are selected) run
    the reference."""
    short = (
        positions is not None
        and math.n_heads * slots.shape[0] <= SCORE_ALL_RATIO * positions.shape[1]
    )
    if positions is None or short:
        return math.extend(q_nope, q_rope, gather, slots, prefix, positions, valid, w_uk, w_uv)
    e = q_nope.shape[0]
    early = min(max(positions.shape[1] - prefix, 0), e)
    outs = []
    if early:
        outs.append(
            math.extend(
                q_nope[:early],
                q_rope[:early],
                gather,
                slots[: prefix + early],
                prefix,
                None,
                None,
                w_uk,
                w_uv,
            )
        )
    if early < e:
        positions, valid = positions[early:], valid[early:]
        if positions.numel() < slots.shape[0]:
            # Few queries (decode-like): read only the selected rows from the pool.
            slots = slots[positions.flatten()]
            positions = torch.arange(slots.shape[0], device=slots.device).view_as(positions)
        o_lat = sparse_absorbed(
            math, q_nope[early:], q_rope[early:], gather(slots), positions, valid
        )
        outs.append(torch.einsum("thc,hvc->thv", o_lat, widened(w_uv, o_lat)))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def sparse_absorbed(math: MLAMath, q_lat, q_rope, ctx, positions, valid) -> torch.Tensor:
    """Latent output `[e, H, kv_lora]` of queries attending to their selected rows of
    `ctx[L, kv_lora + rope]`: `positions[e, k]`, `valid[e, k]`. The reference's gather
    path (`MLAMath._absorbed`), a few queries per block."""
    q = torch.cat([q_lat, q_rope], dim=-1)  # [e, H, kv_lora + rope]
    e, k = positions.shape
    width = ctx.shape[1]
    out = torch.empty(e, math.n_heads, math.kv_lora, dtype=ctx.dtype, device=ctx.device)
    step = max(1, SPARSE_ROWS_ELEMS // (k * width))
    for a in range(0, e, step):
        b = min(e, a + step)
        rows = ctx.index_select(0, positions[a:b].flatten()).view(b - a, k, width)
        scores = torch.bmm(q[a:b], rows.transpose(1, 2))  # [n, H, k]
        out[a:b] = math._softmax_av(scores, valid[a:b, None, :], rows[..., : math.kv_lora])
    return out


# --- decode attention ------------------------------------------------------------------------


def latent_rows(
    data: torch.Tensor, slots: torch.Tensor, kind: str, lora: int, rope: int
) -> torch.Tensor:
    """fp32 rows `[*slots.shape, lora + rope]` of the latent buffer `data` (as the pool
    stores it: e4m3 / bf16 / fp32 rows, or uint8 `fp8_ds_mla` rows). One flat
    `index_select` (several times faster on CPU than indexing with a 2-D slot table)."""
    flat = slots.reshape(-1)

    def rows(d: torch.Tensor) -> torch.Tensor:
        return d.index_select(0, flat).view(*slots.shape, d.shape[-1])

    if kind == "fp8_e4m3":
        return e4m3_to_float(rows(data.view(torch.uint8)))
    if kind == "fp8_ds_mla":
        raw = rows(data)
        nb = scale_blocks(lora)
        scales = raw[..., lora : lora + 4 * nb].contiguous().view(torch.float32)
        scales = scales.repeat_interleave(FP8_BLOCK, dim=-1)[..., :lora]
        nope = e4m3_to_float(raw[..., :lora]) * scales
        k_rope = raw[..., lora + 4 * nb :].contiguous().view(torch.bfloat16).float()
        return torch.cat([nope, k_rope], dim=-1)
    return rows(data).float()


def decode_attention(
    q: torch.Tensor,
    data: torch.Tensor,
    slots: torch.Tensor,
    valid: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    kind: str,
    lora: int,
    rope: int,
) -> torch.Tensor:
    """Absorbed MLA for every decode request at once: `q[B, H, lora + rope]` (the latent
    query ‖ its rope part), `slots[B, k]` the rows each reads, `valid[B, k]` -> `[B, H, v]`."""
    ctx = latent_rows(data, slots, kind, lora, rope).to(q.dtype)
    scores = torch.bmm(q, ctx.transpose(1, 2))
    probs = (
        (scores * scale)
        .masked_fill(~valid[:, None, :], float("-inf"))
        .softmax(-1, dtype=torch.float32)
    )
    o_lat = torch.bmm(probs.to(ctx.dtype), ctx[..., :lora])
    return per_head(o_lat, w_uv)


class Compiled:
    """`torch.compile(fn)` made once per process, with its warm-up timed.

    Shapes are dynamic (the batch varies), so one compilation serves every batch; a batch
    of one is specialised once more (with static shapes, whose guards cost half as much
    per call), and so is each kind of module passed in (a layer with a dense MLP, one with
    MoE). `warmup_s` is the time the first calls of each specialisation spent compiling
    (inductor caches the code on disk, so a second process mostly re-traces).
    """

    def __init__(self, fn) -> None:
        self.fn = fn
        self.warmup_s = 0.0
        self._compiled: dict[bool, object] = {}
        self._seen: set[tuple] = set()
        self._lock = threading.Lock()
        _ALL.append(self)

    def __call__(self, *args):
        key = tuple(_specialisation(a) for a in args)
        static = all(a.shape[0] == 1 for a in args if isinstance(a, torch.Tensor))
        if key in self._seen:
            return self._compiled[static](*args)
        with self._lock:  # engines in threads of one process share the compiled code
            if static not in self._compiled:
                from torch import _dynamo

                # Every engine of the process (other cache dtypes, model dtypes) adds one.
                _dynamo.config.cache_size_limit = max(_dynamo.config.cache_size_limit, 64)
                self._compiled[static] = torch.compile(self.fn, dynamic=not static)
            t0 = time.perf_counter()
            out = self._compiled[static](*args)
            spent = time.perf_counter() - t0
            self.warmup_s += spent
            self._seen.add(key)
        log.info("torch.compile warm-up of %s: %.1f s", self.fn.__name__, spent)
        return out


def _specialisation(a) -> object:
    """What a compiled function specialises on: a tensor's first dim being 1 and its dtype,
    a module's kind (its children's types), any other argument's value."""
    if isinstance(a, torch.Tensor):
        return a.shape[0] == 1, a.dtype
    if isinstance(a, torch.nn.Module):
        kind = _MODULE_KINDS.get(a)
        if kind is None:
            kind = _MODULE_KINDS[a] = type(a), tuple(type(m) for m in a.children())
        return kind
    return a


_MODULE_KINDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


_ALL: list[Compiled] = []


def compile_warmup_s() -> float:
    """Seconds this process has spent compiling (every `Compiled`'s first calls)."""
    return sum(c.warmup_s for c in _ALL)


@cache
def compiled(fn) -> Compiled:
    """The process's one `Compiled` of `fn` (a model block, `backend.CpuBackend.block`)."""
    return Compiled(fn)
