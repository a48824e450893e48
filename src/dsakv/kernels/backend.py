"""Attention backends: the one place that decides which code runs each hot op.

The model asks its backend for five ops per layer (store a latent row, store an index key,
sparse MLA decode, sparse MLA extend, indexer top-k) and never branches on the device.

- `torch`: the reference (`torch_ops`), on any device; gathers rows out of the pool.
- `cpu`: the reference's math shaped for a CPU (`cpu_ops`): blocked bf16 indexer scores
  with ReLU fused, sparse extend attention over small gathered blocks; `auto` on a CPU.
- `triton`: dsakv's own Triton kernels reading the pool's bytes in place (fp8 decoded in
  registers, no fp32 copy of the context); graph-safe (no host syncs). Every prefill chunk
  of a step goes in one varlen launch per layer (attention, and the indexer on full
  layers), as flash-attention's varlen and DeepGEMM's ragged MQA logits take them. On CPU
  it runs under the Triton interpreter, which is how the tests check it.
- `flashmla`: FlashMLA sparse decode and DeepGEMM paged indexer logits when both import
  (`pip install dsakv[gpu]`); every other op as `triton`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any, NamedTuple

import torch

from dsakv.errors import DsakvError
from dsakv.memory.fp8 import FP8_DTYPE, hadamard_matrix

from . import cpu_native, cpu_ops, hisparse_ops, torch_ops
from .torch_ops import MLAMath, per_head, widened

# Rows of query chunks for the Triton extend indexer: bounds the [chunk, L] logits block.
LOGITS_CHUNK_ELEMS = 1 << 26
# Steps of at most this many tokens run the layers' native blocks (`Block.native`):
# on glm-bench, 2 threads, both blocks of a layer took 154 / 169 / 381 / 1065 µs at 1 / 4 /
# 16 / 64 tokens against eager torch's 548 / 921 / 924 / 1575, and 2252 against 1685 at
# 128 (past some width, a GEMM's blocking beats streaming each weight row once).
NATIVE_ROWS = 64


class Block(NamedTuple):
    """A block of a layer's tensor math (norms, projections, RoPE; o_proj, the FFN; the
    indexer's projections). `eager`: torch ops, which every backend can run. `native`: the
    same math as `cpu_native` calls for a step of a few tokens; it returns
    NotImplemented where the layer has no native form. `compile`: whether `torch.compile`
    may trace `eager` (pure tensor math only)."""

    eager: Callable[..., Any]
    native: Callable[..., Any] | None = None
    compile: bool = True


class TorchBackend:
    """The torch reference: every op through `DSAKVPool.gather_*` and `torch_ops`."""

    name = "torch"

    def graph_blocker(self, dtype: torch.dtype, device: torch.device, moe: bool) -> str | None:
        """Why a padded decode step of a `dtype` model on `device` cannot be captured in a
        CUDA graph (None: it can; the engine then runs decode padded, captured on CUDA)."""
        return "the torch ops read lengths and expert counts on the host"

    def describe(self) -> dict[str, str]:
        return dict.fromkeys(("stores", "mla_decode", "mla_extend", "index_logits", "moe"), "torch")

    # --- model blocks -----------------------------------------------------------------------

    def block(self, block: Block, batch, *args):
        """A layer's `block` over `args`, in step `batch` (a `ForwardBatch`, or the row
        count of a block outside the layers: the final norm's, the LM head's)."""
        return block.eager(*args)

    # --- stores ---------------------------------------------------------------------------

    def store_latent(self, pool, layer: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        pool.write_latent(layer, slots, rows)

    def store_index_k(self, pool, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        pool.write_index_k(layer, slots, keys)

    # --- MLA --------------------------------------------------------------------------------

    def mla_decode(self, math: MLAMath, pool, layer, q_nope, q_rope, slots, valid, w_uk, w_uv):
        """Every decode request at once: `slots[B, k]` the rows each reads, `valid[B, k]`."""
        b, k = slots.shape
        ctx = pool.gather_latent(layer, slots.flatten(), q_nope.dtype).view(b, k, -1)
        return math.decode(q_nope, q_rope, ctx, valid, w_uk, w_uv)

    def mla_extend(
        self,
        math: MLAMath,
        pool,
        layer,
        q_nope,
        q_rope,
        slots,
        prefix,
        positions,
        valid,
        w_uk,
        w_uv,
    ):
        """One request's chunk: `slots[L]` its context, `positions`/`valid` its selection."""

        def gather(s: torch.Tensor) -> torch.Tensor:
            return pool.gather_latent(layer, s, q_nope.dtype)

        return math.extend(q_nope, q_rope, gather, slots, prefix, positions, valid, w_uk, w_uv)

    def mla_extends(self, math: MLAMath, pool, layer, q_nope, q_rope, batch, sels, w_uk, w_uv):
        """Every multi-token chunk of the step: `[E, H, v]` for `batch.extend_rows`;
        `sels.per_req[r]` is request r's selection (None: dense causal), `sels` the layer's
        `StepSelection`. A request at a time here."""
        outs = []
        for r in batch.extend_reqs:
            a, e, sel = batch.extend_starts[r], batch.extend_lens[r], sels.per_req[r]
            outs.append(
                self.mla_extend(
                    math,
                    pool,
                    layer,
                    q_nope[a : a + e],
                    q_rope[a : a + e],
                    batch.latent_req_slots[r],
                    batch.prefix_lens[r],
                    None if sel is None else sel.positions,
                    None if sel is None else sel.valid,
                    w_uk,
                    w_uv,
                )
            )
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    # --- MoE --------------------------------------------------------------------------------

    def experts(self, x, ids, weights, gate_up, down, first: int, last: int) -> torch.Tensor:
        """Routed experts' partial sum for `x[T, H]` routed to `ids[T, k]` with `weights`."""
        return torch_ops.experts_loop(x, ids, weights, gate_up, down, first, last)

    # --- indexer ----------------------------------------------------------------------------

    def index_topk_decode(self, pool, layer, q, w, table, lens, scale: float, topk: int):
        """Top-k positions `[B, k]` of decode queries over their padded contexts `table`."""
        b, width = table.shape
        keys = pool.gather_index_k(layer, table.flatten()).float().view(b, width, -1)
        return torch_ops.index_topk_decode(q, w, keys, lens, scale, topk)

    def index_topk_extend(self, pool, layer, q, w, slots, prefix: int, scale: float, topk: int):
        """Top-k positions `[e, k]` of one request's chunk over its context `slots`."""
        keys = pool.gather_index_k(layer, slots).float()
        return torch_ops.index_topk_extend(q, w, keys, prefix, scale, topk)

    def index_topk_extends(self, pool, layer, q, w, batch, reqs, scale: float, topk: int):
        """Top-k positions `[E, k]` of the chunks of `reqs` (multi-token requests, in batch
        order, each with a context longer than k), their rows one after another. A request
        at a time here."""
        out = []
        for r in reqs:
            a, e = batch.extend_starts[r], batch.extend_lens[r]
            slots, prefix = batch.req_slots[r], batch.prefix_lens[r]
            out.append(self.index_topk_extend(pool, layer, q[a : a + e], w[a : a + e],
                                              slots, prefix, scale, topk))  # fmt: skip
        return out[0] if len(out) == 1 else torch.cat(out)

    # --- HiSparse hot buffers (DESIGN.md §13) ------------------------------------------------

    def hot_resolve(self, topk, newest, reserved_slot, buf_pos, stamp, buf_slot, step):
        """Top-k positions `[B, K]` -> device latent slots and the miss list; updates the
        buffers' positions and recency in place (`hisparse_ops.resolve`)."""
        return hisparse_ops.resolve(topk, newest, reserved_slot, buf_pos, stamp, buf_slot, step)

    def hot_copy(self, hosts, devs, src, dst) -> None:
        """`devs[l][dst[i]] = hosts[l][src[i]]` for every layer l of a group (−1: nothing)."""
        hisparse_ops.copy_rows_layers(hosts, devs, src, dst)


class CpuBackend(TorchBackend):
    """The torch ops shaped for a CPU (`cpu_ops`), where a decode token is bound by the
    number of ops and prefill by memory traffic. Native kernels (`cpu_native`): the blocks
    around attention of a step of a few tokens (one call each), decode attention and
    indexer scores over the stored bytes, the fp8 stores; without a C++ compiler, rows widened straight from the stored bytes
    and a one-token MoE in two GEMVs. Indexer scores in cache-sized blocks with ReLU fused
    and bf16 GEMMs over fp8 / bf16 index-K (fp32 over fp32 keys); sparse extend attention
    over gathered rows in small blocks. Everything else is the reference.

    `compile=True`: decode steps of at most `GEMV_ROWS` requests run the blocks the native
    kernels do not (no compiler, weights other than fp32) through `torch.compile`.

    `deterministic=True` (`--enable-deterministic-inference`): every token of every step,
    prefill chunks and MTP verify rows included, runs the per-token native path a decode
    token runs: the blocks, the indexer's scores over the stored keys, top-k in position
    order and attention over the stored rows. Each of those reduces a token's values in one
    order whatever the step holds, so a request's outputs do not depend on its batch, its
    chunking, where its KV was computed or the thread count."""

    name = "cpu"

    def __init__(self, layout, compile: bool = False, deterministic: bool = False) -> None:
        self.index_dtype = cpu_ops.index_compute_dtype(layout.index_k_dtype)
        self.compile = compile
        self.native = cpu_native.available()
        self._deterministic = deterministic
        if deterministic and not self.native:
            raise DsakvError(
                "--enable-deterministic-inference runs on dsakv's native CPU kernels, which "
                "did not build (a C++ compiler with OpenMP is needed: set $CXX)"
            )
        # Eager inside a compiled block: the loop reads expert counts on the host, which
        # dynamo would trace as constants (a recompilation per routing pattern). (Importing
        # dynamo only when compiling: it breaks the Triton interpreter's patching.)
        loop = torch_ops.experts_loop
        self._experts_loop = torch.compiler.disable(loop) if compile else loop

    @property
    def deterministic(self) -> bool:
        """The per-token path runs on the native kernels (and only while they do)."""
        return self._deterministic and self.native

    def describe(self) -> dict[str, str]:
        low = self.index_dtype == torch.bfloat16
        blocks = "eager"
        if self.compile:
            blocks = f"torch.compile up to {torch_ops.GEMV_ROWS} requests"
        if self.native:
            blocks = f"native up to {NATIVE_ROWS} tokens a step (fp32 compute), else " + blocks
        if self.deterministic:
            return {
                **super().describe(),
                "mode": "deterministic: every token on the native per-token path",
                "blocks": "native (fp32 compute), every step",
                "stores": "native (fp8 rows), torch (bf16 / fp32 rows)",
                "mla_decode": "native mla_decode (stored rows read in place)",
                "mla_extend": "native mla_decode per token (stored rows read in place)",
                "index_logits": "native per-token scores over the stored keys",
                "moe": "native, per token",
            }
        return {
            **super().describe(),
            "blocks": blocks,
            "stores": "native (fp8 rows), torch (bf16 / fp32 rows)" if self.native else "torch",
            "mla_decode": "native mla_decode (stored rows read in place)"
            if self.native
            else "cpu decode_attention (rows widened from the stored bytes)",
            "mla_extend": "cpu sparse gather blocks (fp32)",
            "index_logits": "cpu blocked, fused ReLU ("
            + ("bf16 GEMM, fp32 head sum)" if low else "fp32)"),
            "moe": "torch (one token: two GEMVs over its k experts; else a GEMM pair per expert)",
        }

    # --- model blocks -----------------------------------------------------------------------

    def block(self, block, batch, *args):
        # Native blocks are per-token math: any step of a few tokens (decode, MTP verify
        # rows, a short extend) runs them; every step does when deterministic.
        rows = batch if isinstance(batch, int) else batch.num_tokens
        if self.native and block.native and (self.deterministic or rows <= NATIVE_ROWS):
            out = block.native(*args)
            if out is not NotImplemented:
                return out
            if self.deterministic:
                raise DsakvError(
                    f"--enable-deterministic-inference: {block.eager.__name__} has no native "
                    "form here (it needs fp32 compute)"
                )
        if isinstance(batch, int):
            return block.eager(*args)
        small_decode = batch.is_decode_only and self._small(batch.num_tokens)
        if self.compile and block.compile and small_decode:
            return cpu_ops.compiled(block.eager)(*args)
        return block.eager(*args)

    def _small(self, rows: int) -> bool:
        """Compiled code runs decode steps of at most `GEMV_ROWS` requests: there its GEMVs
        stream the weights in fused loops. Larger batches run the same extern GEMMs either
        way."""
        return rows <= torch_ops.GEMV_ROWS

    # --- stores ---------------------------------------------------------------------------

    def store_latent(self, pool, layer, slots, rows) -> None:
        lay = pool.layout
        if not self.native or lay.kv_cache_dtype not in cpu_native.STORED_KINDS:
            return super().store_latent(pool, layer, slots, rows)
        cpu_native.store_latent(
            rows,
            pool.latent_data(layer),
            slots,
            lay.kv_cache_dtype,
            lay.kv_lora_rank,
            lay.qk_rope_head_dim,
        )

    def store_index_k(self, pool, layer, slots, keys) -> None:
        if not self.native or pool.layout.index_k_dtype != "fp8":
            return super().store_index_k(pool, layer, slots, keys)
        # The pool's rotation as a native GEMV: the layer loop rotates with the same one.
        rotated = cpu_native.linear(keys.float(), _hadamard(keys.shape[-1]))
        cpu_native.store_index_k_fp8(rotated, pool.index_k_data(layer), slots, pool.page_size)

    # --- MLA --------------------------------------------------------------------------------

    def mla_decode(self, math, pool, layer, q_nope, q_rope, slots, valid, w_uk, w_uv):
        lay = pool.layout
        data, kind = pool.latent_data(layer), lay.kv_cache_dtype
        if not self.native:
            q = torch.cat([q_nope, q_rope], dim=-1)
            args = (kind, lay.kv_lora_rank, lay.qk_rope_head_dim)
            return cpu_ops.decode_attention(q, data, slots, valid, w_uv, math.scale, *args)
        # W_uv inside the kernel (under fp32 compute, whatever it is stored as): no GEMM after it
        in_kernel = q_nope.dtype == torch.float32
        out = cpu_native.mla_decode(
            q_nope.float(),
            q_rope.float(),
            data,
            slots,
            valid,
            math.scale,
            kind,
            w_uv if in_kernel else None,
        )
        return out if in_kernel else per_head(out.to(q_nope.dtype), w_uv)

    def mla_extend(
        self, math, pool, layer, q_nope, q_rope, slots, prefix, positions, valid, w_uk, w_uv
    ):
        if self.deterministic:  # each query as a decode token over its own selection
            if positions is None:  # every visible position, in order: one shared list
                e = q_nope.shape[0]
                valid = torch.arange(slots.shape[0]) <= torch.arange(prefix, prefix + e)[:, None]
                rows = slots
            else:
                rows = slots[positions]
            return self.mla_decode(math, pool, layer, q_nope, q_rope, rows, valid, w_uk, w_uv)

        def gather(s: torch.Tensor) -> torch.Tensor:
            return pool.gather_latent(layer, s, q_nope.dtype)

        return cpu_ops.mla_extend(
            math, q_nope, q_rope, gather, slots, prefix, positions, valid, w_uk, w_uv
        )

    # --- MoE --------------------------------------------------------------------------------

    def experts(self, x, ids, weights, gate_up, down, first: int, last: int) -> torch.Tensor:
        if x.shape[0] == 1:
            return torch_ops.experts_one_token(x, ids, weights, gate_up, down, first, last)
        return self._experts_loop(x, ids, weights, gate_up, down, first, last)

    # --- indexer ----------------------------------------------------------------------------

    def index_topk_decode(self, pool, layer, q, w, table, lens, scale, topk):
        if self.native and (self.deterministic or pool.layout.index_k_dtype == "fp8"):
            low = self.index_dtype == torch.bfloat16
            data = pool.index_k_data(layer)
            scores = cpu_native.index_decode(q, w, data, pool.page_size, table, lens, scale, low)
            return self._order(cpu_native.topk_by_position(scores, topk))
        b, width = table.shape
        keys = pool.gather_index_k(layer, table.flatten(), self.index_dtype).view(b, width, -1)
        return cpu_ops.index_topk_decode(q, w, keys, lens, scale, topk)

    def index_topk_extend(self, pool, layer, q, w, slots, prefix, scale, topk):
        if self.deterministic:  # each query scored as a decode token over its context
            low, data = self.index_dtype == torch.bfloat16, pool.index_k_data(layer)
            e, rows = q.shape[0], max(1, (1 << 22) // slots.shape[0])  # bounds [rows, ctx]
            lens = torch.arange(prefix + 1, prefix + e + 1)
            out = []
            for a in range(0, e, rows):
                b = min(e, a + rows)
                scores = cpu_native.index_decode(
                    q[a:b], w[a:b], data, pool.page_size, slots, lens[a:b], scale, low
                )
                out.append(cpu_native.topk_by_position(scores, topk))
            return self._order(torch.cat(out))
        keys = pool.gather_index_k(layer, slots, self.index_dtype)
        return cpu_ops.index_topk_extend(q, w, keys, prefix, scale, topk)

    def _order(self, positions: torch.Tensor) -> torch.Tensor:
        """Deterministic: a selection in position order, so attention sums a token's rows in
        one order however it was selected (a short context's top-k is then exactly its
        every-position list, padded)."""
        return positions.sort(dim=1).values if self.deterministic else positions


@cache
def _hadamard(dim: int) -> torch.Tensor:
    return hadamard_matrix(dim, torch.device("cpu"), torch.float32)


class TritonBackend(TorchBackend):
    """dsakv's Triton kernels over the pool's own bytes; torch where no kernel applies
    (fp32/bf16 index-K)."""

    name = "triton"

    def __init__(self, layout) -> None:
        from . import triton_indexer, triton_mla, triton_rows, triton_store  # needs triton

        self._mla, self._indexer, self._store = triton_mla, triton_indexer, triton_store
        self._rows = triton_rows
        self.kind = layout.kv_cache_dtype
        self.fp8_index = layout.index_k_dtype == "fp8"

    def describe(self) -> dict[str, str]:
        return {
            "stores": f"triton latent ({self.kind}), index-K",
            "mla_decode": f"triton sparse_mla_decode ({self.kind})",
            "moe": "torch._grouped_mm (device offsets)",
            "mla_extend": f"triton sparse_mla_extend ({self.kind})",
            "index_logits": "triton index_logits_paged/extend (fp8)"
            if self.fp8_index
            else "torch (index-K not fp8)",
        }

    def hot_resolve(self, topk, newest, reserved_slot, buf_pos, stamp, buf_slot, step):
        from . import triton_hisparse

        return triton_hisparse.resolve(topk, newest, reserved_slot, buf_pos, stamp, buf_slot, step)

    def hot_copy(self, hosts, devs, src, dst) -> None:
        self._rows.copy_rows_layers(hosts, devs, src, dst)

    def graph_blocker(self, dtype, device, moe) -> str | None:
        # The kernels read lengths, slots and -1 padding on the device, and so do the torch
        # fallbacks here (no host bounds check); the MoE is the one op that may sync.
        if moe and not torch_ops.grouped_mm_capturable(dtype, device):
            return f"torch._grouped_mm reads its offsets on the host for {dtype} on this GPU"
        return None

    def experts(self, x, ids, weights, gate_up, down, first, last):
        return torch_ops.experts_grouped(x, ids, weights, gate_up, down, first, last)

    # --- stores ---------------------------------------------------------------------------

    def store_latent(self, pool, layer, slots, rows) -> None:
        data = pool.latent_data(layer)
        if self.kind == "fp8_ds_mla":
            lay = pool.layout
            self._store.store_latent_ds_mla(
                rows, data, slots, lay.kv_lora_rank, lay.qk_rope_head_dim
            )
        elif self.kind == "fp8_e4m3":
            self._store.store_latent_fp8_e4m3(rows, data.view(torch.uint8), slots)
        else:  # bf16 / fp32 rows are stored as they are
            self._rows.store_rows(rows, data, slots)

    def store_index_k(self, pool, layer, slots, keys) -> None:
        if not self.fp8_index:  # bf16 / fp32 keys are stored as they are
            return self._rows.store_rows(keys, pool.index_k_data(layer), slots)
        rotated = pool.prepare_index_q(keys.float())  # the same rotation the pool applies
        self._store.store_index_k_fp8(rotated, pool.index_k_data(layer), slots, pool.page_size)

    # --- MLA --------------------------------------------------------------------------------

    def _cache(self, pool, layer) -> torch.Tensor:
        data = pool.latent_data(layer)
        return data.view(torch.uint8) if data.dtype == FP8_DTYPE else data

    def mla_decode(self, math, pool, layer, q_nope, q_rope, slots, valid, w_uk, w_uv):
        q = torch.cat([q_nope, q_rope], dim=-1)
        idx = slots.masked_fill(~valid, -1).to(torch.int32)
        o_lat = self._mla.sparse_mla_decode(
            q, self._cache(pool, layer), self.kind, idx, math.scale, math.kv_lora, q_rope.shape[-1]
        )
        return torch.einsum("bhc,hvc->bhv", o_lat.to(q.dtype), widened(w_uv, q))

    def mla_extend(
        self, math, pool, layer, q_nope, q_rope, slots, prefix, positions, valid, w_uk, w_uv
    ):
        q = torch.cat([q_nope, q_rope], dim=-1)
        e = q.shape[0]
        q_pos = torch.arange(prefix, prefix + e, device=q.device, dtype=torch.int32)
        topk = None if positions is None else positions.masked_fill(~valid, -1).to(torch.int32)
        o_lat = self._mla.sparse_mla_extend(
            q,
            self._cache(pool, layer),
            self.kind,
            slots,
            q_pos,
            topk,
            math.scale,
            math.kv_lora,
            q_rope.shape[-1],
        )
        return torch.einsum("thc,hvc->thv", o_lat.to(q.dtype), widened(w_uv, q))

    def mla_extends(self, math, pool, layer, q_nope, q_rope, batch, sels, w_uk, w_uv):
        # One launch for every chunk of the step. Beside selected chunks a dense one attends
        # positions 0..k-1 (its context is no longer than index_topk; the kernel masks the
        # future), so a step of long and short prompts is still one launch.
        reqs, ext, rows = batch.extend_reqs, batch.extend_ctx, batch.extend_rows
        topk = sels.varlen_positions
        k = 0 if topk is None else topk.shape[1]
        if k and any(sels.per_req[r] is None and batch.seq_lens[r] > k for r in reqs):
            return super().mla_extends(math, pool, layer, q_nope, q_rope, batch, sels, w_uk, w_uv)
        q = torch.cat([q_nope, q_rope], dim=-1)
        if rows is not None:
            q = q[rows]
        o_lat = self._mla.sparse_mla_extend_varlen(
            q,
            self._cache(pool, layer),
            self.kind,
            ext.latent_slots,
            ext.start,
            ext.lens,
            ext.max_len,
            ext.positions,
            topk,
            math.scale,
            math.kv_lora,
            q_rope.shape[-1],
        )
        return torch.einsum("thc,hvc->thv", o_lat.to(q.dtype), widened(w_uv, q))

    # --- indexer ----------------------------------------------------------------------------

    def index_topk_decode(self, pool, layer, q, w, table, lens, scale, topk):
        if not self.fp8_index:  # bf16 / fp32 rows as stored: a device gather, no host check
            b, width = table.shape
            rows = pool.index_k_data(layer).index_select(0, table.flatten())
            keys = rows.float().view(b, width, -1)
            return torch_ops.index_topk_decode(q, w, keys, lens, scale, topk)
        ps = pool.page_size
        logits = self._indexer.index_logits_paged(
            _low_precision(q),
            (w * scale).float(),
            pool.index_k_data(layer),
            self._indexer.block_table_from_slots(table, ps),
            lens.to(torch.int32),
            ps,
            table.shape[1],
        )
        return torch_ops.topk_by_position(logits, topk)

    def index_topk_extend(self, pool, layer, q, w, slots, prefix, scale, topk):
        if not self.fp8_index:
            return super().index_topk_extend(pool, layer, q, w, slots, prefix, scale, topk)
        from ._triton import one_context  # (triton is imported once a Triton backend is made)

        e, length = q.shape[0], slots.shape[0]
        start, lens = one_context(e, length, q.device)
        q_pos = torch.arange(prefix, prefix + e, device=q.device, dtype=torch.int32)
        return self._extend_topk(pool, layer, q, w, slots, start, lens, length, q_pos, scale, topk)

    def index_topk_extends(self, pool, layer, q, w, batch, reqs, scale, topk):
        # One launch for every chunk of the step (a step whose short chunks need no
        # scoring goes a request at a time over its long ones).
        if not self.fp8_index or reqs != batch.extend_reqs:
            return super().index_topk_extends(pool, layer, q, w, batch, reqs, scale, topk)
        ext, rows = batch.extend_ctx, batch.extend_rows
        if rows is not None:
            q, w = q[rows], w[rows]
        return self._extend_topk(pool, layer, q, w, ext.slots, ext.start, ext.lens,
                                 ext.max_len, ext.positions, scale, topk)  # fmt: skip

    def _extend_topk(self, pool, layer, q, w, slots, start, lens, width, q_pos, scale, topk):
        """`index_logits_extend_varlen` then top-k, in runs of rows whose logits stay
        under LOGITS_CHUNK_ELEMS."""
        q, w = _low_precision(q), (w * scale).float()
        # (runs of a multiple of 16 rows: every slice of the tables stays 16-byte aligned)
        chunk = max(16, LOGITS_CHUNK_ELEMS // max(width, 1) // 16 * 16)
        kpages = pool.index_k_data(layer)
        out = []
        for a in range(0, q.shape[0], chunk):
            b = a + chunk
            logits = self._indexer.index_logits_extend_varlen(
                q[a:b], w[a:b], kpages, slots, start[a:b], lens[a:b], width, q_pos[a:b],
                pool.page_size,
            )  # fmt: skip
            out.append(torch_ops.topk_by_position(logits, topk))
        return out[0] if len(out) == 1 else torch.cat(out)


def _low_precision(q: torch.Tensor) -> torch.Tensor:
    """Indexer queries in bf16 (the keys are fp8: fp32 queries would only cost bytes)."""
    return q.to(torch.bfloat16)
