"""dsakv's Triton kernels on a CUDA device at real model shapes (H200-sized: ~2 min).

GLM-5.x / DeepSeek-V3.2 shapes: 64 and 128 q-heads over kv_lora 512 + rope 64 latents,
32 and 64 index heads of dim 128, top-k 2048, contexts 4K-128K, page size 64. References
are computed on the same device in fp64 from the pool's own dequantised gathers. Also:
two runs are bit-identical, CUDA-graph capture and replay with new inputs works (no host
syncs inside the wrappers), and the stores are byte-equal to the pool's writes on both
the GPU and the CPU.

Kernel modules are imported inside the tests: importing them at collection time on a
CPU-only machine would build non-interpreted kernels before test_triton_kernels.py can
switch the Triton interpreter on.
"""

from __future__ import annotations

import types

import pytest
import torch

from dsakv.kernels import topk_by_position
from dsakv.memory import CacheLayout, DSAKVPool, page_slots
from dsakv.memory.fp8 import hadamard_rotate
from tests.conftest import small_glm_config

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"
KV_LORA, ROPE, DIM, INDEX_DIM = 512, 64, 576, 128
TOPK = 2048
PS = 64
SM_SCALE = DIM**-0.5
CTXS = (4096, 131072)  # decode contexts; the paged logits also run 32K
LOGIT_CTXS = (4096, 32768, 131072)
DENSE_CTX = 131072
EXTEND = dict(e=64, length=8192, dense_e=32, dense_length=4096, heads=64)
LOGITS_EXTEND = dict(e=128, length=16384, heads=32)
# Max abs error on O(1) outputs: fp32 q -> IEEE fp32 dots; bf16 q -> bf16 dots (wgmma),
# exact q·k products, probabilities rounded to bf16 (≤ 2^-8 relative) before P@V: the
# error is ≤ 2^-8 Σ_j w_j |v_j − out| per element, ~1e-4 expected at top-2048 rows.
TOL = {torch.float32: 2e-4, torch.bfloat16: 4e-3}


def _k() -> types.SimpleNamespace:
    pytest.importorskip("triton")
    from dsakv.kernels import triton_indexer, triton_mla, triton_store

    return types.SimpleNamespace(
        decode=triton_mla.sparse_mla_decode,
        extend=triton_mla.sparse_mla_extend,
        paged=triton_indexer.index_logits_paged,
        logits_extend=triton_indexer.index_logits_extend,
        block_table=triton_indexer.block_table_from_slots,
        store_ds=triton_store.store_latent_ds_mla,
        store_e4m3=triton_store.store_latent_fp8_e4m3,
        store_ik=triton_store.store_index_k_fp8,
    )


def _pool(kind: str, tokens: int, device: str | None = None) -> DSAKVPool:
    layout = CacheLayout.for_model(
        small_glm_config(num_layers=1), kv_cache_dtype=kind, index_k_dtype="fp8", page_size=PS
    )
    return DSAKVPool(layout, -(-tokens // PS), device=device or DEV)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _fill_latent(pool: DSAKVPool, seed: int) -> None:
    g = _gen(seed)
    step = 1 << 16
    for a in range(0, pool.num_tokens, step):
        n = min(step, pool.num_tokens - a)
        rows = torch.randn(n, DIM, device=DEV, generator=g)
        pool.write_latent(0, torch.arange(a, a + n, device=DEV), rows)


def _fill_index(pool: DSAKVPool, seed: int) -> None:
    g = _gen(seed)
    step = 1 << 16
    for a in range(0, pool.num_tokens, step):
        n = min(step, pool.num_tokens - a)
        keys = torch.randn(n, INDEX_DIM, device=DEV, generator=g)
        pool.write_index_k(0, torch.arange(a, a + n, device=DEV), keys)


def _request_slots(pool: DSAKVPool, batch: int, ctx: int, seed: int) -> torch.Tensor:
    """[batch, ctx] slots: each request owns ctx/PS whole pages, shuffled over the pool."""
    pages = torch.randperm(pool.num_pages, device=DEV, generator=_gen(seed))
    per = ctx // PS
    return torch.stack([page_slots(pages[i * per : (i + 1) * per], PS) for i in range(batch)])


def _reference_attention(q: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """fp64 softmax(q·row·scale over valid rows) @ row[:kv_lora]; q [N,H,DIM], rows [N,K,DIM]."""
    s = torch.einsum("nhd,nkd->nhk", q.double(), rows.double()) * SM_SCALE
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("nhk,nkd->nhd", p, rows[..., :KV_LORA].double())


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.dtype == torch.float32 and out.shape == ref.shape
    return (out.double() - ref).abs().max().item()


# --- sparse MLA decode --------------------------------------------------------------------------


@pytest.mark.parametrize("ctx", CTXS)
@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize("kind", ["fp8_ds_mla", "bf16", "fp8_e4m3"])
def test_decode_topk_real_shapes(kind, heads, ctx):
    """B=4 queries, top-2048 selected slots out of each request's context; one request
    shorter than top-k (−1 padded), one with a −1 tail; fp32 and bf16 q; two runs equal."""
    k = _k()
    batch = 4
    pool = _pool(kind, batch * ctx)
    _fill_latent(pool, seed=1)
    req = _request_slots(pool, batch, ctx, seed=2)
    g = _gen(3)
    pos = torch.stack([torch.randperm(ctx, device=DEV, generator=g)[:TOPK] for _ in range(batch)])
    slots = req.gather(1, pos)
    slots[1, TOPK // 2 :] = -1  # a request with fewer visible positions than top-k
    slots[2, -(TOPK // 27) :] = -1
    slots = slots.to(torch.int32)
    rows = pool.gather_latent(0, slots.clamp(min=0).flatten().long()).view(batch, TOPK, DIM)
    cache = pool.latent_data(0)
    for qdtype in (torch.float32, torch.bfloat16):
        q = torch.randn(batch, heads, DIM, device=DEV, generator=g).to(qdtype)
        ref = _reference_attention(q.float(), rows, slots >= 0)
        out = k.decode(q, cache, kind, slots, SM_SCALE, KV_LORA, ROPE)
        assert _err(out, ref) < TOL[qdtype], (qdtype, _err(out, ref))
        assert torch.equal(out, k.decode(q, cache, kind, slots, SM_SCALE, KV_LORA, ROPE))


@pytest.mark.parametrize("heads", [64, 128])
def test_decode_dense_128k(heads):
    """Every slot of a 128K context through the same kernel (the bandwidth-bound case)."""
    k = _k()
    pool = _pool("fp8_ds_mla", DENSE_CTX)
    _fill_latent(pool, seed=4)
    slots = _request_slots(pool, 1, DENSE_CTX, seed=5).to(torch.int32)
    q = torch.randn(1, heads, DIM, device=DEV, generator=_gen(6)).to(torch.bfloat16)
    out = k.decode(q, pool.latent_data(0), "fp8_ds_mla", slots, SM_SCALE, KV_LORA, ROPE)
    rows = pool.gather_latent(0, slots.flatten().long()).view(1, DENSE_CTX, DIM)
    ref = _reference_attention(q.float(), rows, torch.ones_like(slots, dtype=torch.bool))
    assert _err(out, ref) < TOL[torch.bfloat16]


# --- sparse MLA extend --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fp8_ds_mla", "bf16"])
def test_extend_real_shapes(kind):
    """64 queries at the tail of an 8K context with top-2048 positions (some in the future:
    masked), and 32 queries dense-causal over 4K; 64 heads; bf16 q."""
    k = _k()
    e, length = EXTEND["e"], EXTEND["length"]
    pool = _pool(kind, length)
    _fill_latent(pool, seed=7)
    ctx = _request_slots(pool, 1, length, seed=8)[0]
    g = _gen(9)
    q_pos = torch.arange(length - e, length, device=DEV, dtype=torch.int32)
    topk = torch.stack([torch.randperm(length, device=DEV, generator=g)[:TOPK] for _ in range(e)])
    topk = topk.to(torch.int32)
    topk[0, :5] = -1
    q = torch.randn(e, EXTEND["heads"], DIM, device=DEV, generator=g).to(torch.bfloat16)
    cache = pool.latent_data(0)
    ctx_rows = pool.gather_latent(0, ctx)
    out = k.extend(q, cache, kind, ctx, q_pos, topk, SM_SCALE, KV_LORA, ROPE)
    valid = (topk >= 0) & (topk <= q_pos[:, None])
    ref = _reference_attention(q.float(), ctx_rows[topk.clamp(min=0).long()], valid)
    assert _err(out, ref) < TOL[torch.bfloat16]
    assert torch.equal(out, k.extend(q, cache, kind, ctx, q_pos, topk, SM_SCALE, KV_LORA, ROPE))

    de, dl = EXTEND["dense_e"], EXTEND["dense_length"]
    q_pos = torch.arange(dl - de, dl, device=DEV, dtype=torch.int32)
    out = k.extend(q[:de], cache, kind, ctx[:dl], q_pos, None, SM_SCALE, KV_LORA, ROPE)
    causal = torch.arange(dl, device=DEV)[None, :] <= q_pos[:, None]
    ref = _reference_attention(q[:de].float(), ctx_rows[:dl].expand(de, -1, -1), causal)
    assert _err(out, ref) < TOL[torch.bfloat16]


# --- indexer logits -----------------------------------------------------------------------------


def _reference_logits(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Σ_h w_h ReLU(q_h·k) in fp64; q [N, Hi, D], w [N, Hi], keys [N|1, L, D] -> [N, L]."""
    s = torch.relu(torch.matmul(q.double(), keys.double().transpose(-1, -2)))
    return (w.double()[:, :, None] * s).sum(1)


def _assert_topk_consistent(got: torch.Tensor, ref: torch.Tensor, k: int, tol: float) -> None:
    """`topk_by_position` on the kernel's logits may differ from the reference's only
    among positions whose reference score is within `tol` of the k-th best."""
    a, b = topk_by_position(got, k), topk_by_position(ref.float(), k)
    kth = ref.sort(dim=-1, descending=True).values[:, k - 1]
    for r in range(ref.shape[0]):
        sa, sb = set(a[r].tolist()), set(b[r].tolist())
        diff = torch.tensor(sorted(sa ^ sb), dtype=torch.long, device=ref.device)
        if diff.numel():
            assert (ref[r, diff] - kth[r]).abs().max().item() <= tol, f"row {r}"


@pytest.mark.parametrize("ctx", LOGIT_CTXS)
@pytest.mark.parametrize("heads", [32, 64])
def test_index_logits_paged_real_shapes(heads, ctx):
    """B=4 requests (full, ctx−1, about half, one token) in shuffled pages, bf16 q (and
    fp32 once), fixed width = max_pages·64: −inf past each length; top-2048 agrees."""
    k = _k()
    batch = 4
    pool = _pool("fp8_ds_mla", batch * ctx)
    _fill_index(pool, seed=10)
    req = _request_slots(pool, batch, ctx, seed=11)
    table = k.block_table(req, PS)
    lens = torch.tensor([ctx, ctx - 1, ctx // 2 + 7, 1], dtype=torch.int32, device=DEV)
    g = _gen(12)
    q32 = pool.prepare_index_q(torch.randn(batch, heads, INDEX_DIM, device=DEV, generator=g))
    w = torch.randn(batch, heads, device=DEV, generator=g) * heads**-0.5 * INDEX_DIM**-0.5
    kpages = pool.index_k_data(0)
    keys = pool.gather_index_k(0, req.flatten()).view(batch, ctx, INDEX_DIM)
    for q in (q32.to(torch.bfloat16), q32) if ctx == LOGIT_CTXS[0] else (q32.to(torch.bfloat16),):
        out = k.paged(q, w, kpages, table, lens, PS, ctx)
        ref = _reference_logits(q.float(), w, keys)
        pos = torch.arange(ctx, device=DEV)
        ref = ref.masked_fill(pos[None, :] >= lens[:, None].long(), float("-inf"))
        fin = torch.isfinite(ref)
        assert torch.equal(fin, torch.isfinite(out))
        tol = 1e-4 * ref[fin].abs().max().item()
        assert (out[fin].double() - ref[fin]).abs().max().item() < tol
        _assert_topk_consistent(out, ref, TOPK, 2 * tol)
        assert torch.equal(out, k.paged(q, w, kpages, table, lens, PS, ctx))


def test_index_logits_extend_real_shape():
    """A 16K-context prefill chunk: 128 queries at the tail, 32 heads, bf16 q."""
    k = _k()
    e, length, heads = LOGITS_EXTEND["e"], LOGITS_EXTEND["length"], LOGITS_EXTEND["heads"]
    pool = _pool("fp8_ds_mla", length)
    _fill_index(pool, seed=13)
    ctx = _request_slots(pool, 1, length, seed=14)[0]
    g = _gen(15)
    q = pool.prepare_index_q(torch.randn(e, heads, INDEX_DIM, device=DEV, generator=g))
    q = q.to(torch.bfloat16)
    w = torch.randn(e, heads, device=DEV, generator=g) * heads**-0.5 * INDEX_DIM**-0.5
    q_pos = torch.arange(length - e, length, device=DEV, dtype=torch.int32)
    out = k.logits_extend(q, w, pool.index_k_data(0), ctx, q_pos, PS)
    keys = pool.gather_index_k(0, ctx)
    ref = torch.cat(
        [
            _reference_logits(q[a : a + 32].float(), w[a : a + 32], keys[None])
            for a in range(0, e, 32)
        ]
    )
    ref = ref.masked_fill(torch.arange(length, device=DEV)[None, :] > q_pos[:, None], float("-inf"))
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(out))
    tol = 1e-4 * ref[fin].abs().max().item()
    assert (out[fin].double() - ref[fin]).abs().max().item() < tol
    _assert_topk_consistent(out, ref, TOPK, 2 * tol)
    assert torch.equal(out, k.logits_extend(q, w, pool.index_k_data(0), ctx, q_pos, PS))


# --- stores -------------------------------------------------------------------------------------


def _store_rows(n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.logspace(-8, 3, n)[:, None]
    x[0], x[1] = 0.0, -0.0
    x[2] = torch.exp2(torch.randint(-20, 9, (d,), generator=g).float())
    x[3] = 448.0
    x[3, ::2] = -447.99
    x[4, ::128] = torch.nextafter(torch.tensor(14.0), torch.tensor(15.0))
    x[4, 1::128] = 1.0
    x[5] *= 1e-38
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stores_byte_equal_to_gpu_and_cpu_pools(dtype):
    """8192 rows into a 16K-token pool: kernel bytes == GPU pool writes == CPU pool writes."""
    k = _k()
    n, tokens = 8192, 16384
    slots = torch.randperm(tokens, generator=torch.Generator().manual_seed(16))[:n]
    rows = _store_rows(n, DIM, seed=17).to(dtype)
    keys = _store_rows(n, INDEX_DIM, seed=18).to(dtype)
    s, r = slots.to(DEV), rows.to(DEV)
    for kind in ("fp8_ds_mla", "fp8_e4m3"):
        cpu, gpu, ker = _pool(kind, tokens, "cpu"), _pool(kind, tokens), _pool(kind, tokens)
        for p in (cpu, gpu):
            p.write_latent(0, slots.to(p.device), rows.to(p.device))
        if kind == "fp8_ds_mla":
            k.store_ds(r, ker._latent[0].data, s, KV_LORA, ROPE)
        else:
            k.store_e4m3(r, ker._latent[0].data, s)
        latent = [p._latent[0].data.view(torch.uint8).cpu() for p in (ker, gpu, cpu)]
        assert torch.equal(latent[0], latent[1]) and torch.equal(latent[0], latent[2])
    # Index-K: the pool rotates on its own device (CPU and GPU matmuls may round the
    # rotation differently), so the kernel gets each pool's own rotated keys.
    for device in (DEV, "cpu"):
        pool, ker = _pool("fp8_ds_mla", tokens, device), _pool("fp8_ds_mla", tokens)
        pool.write_index_k(0, slots.to(device), keys.to(device))
        rotated = hadamard_rotate(keys.to(device).float()).to(DEV)
        k.store_ik(rotated, ker.index_k_data(0), s, PS)
        assert torch.equal(ker.index_k_data(0).cpu(), pool.index_k_data(0).cpu())


# --- graph safety -------------------------------------------------------------------------------


def test_no_host_sync_and_cuda_graph_replay():
    """Decode, paged logits and the latent store run under sync-debug 'error' mode, are
    captured in one CUDA graph, and replays with new slots / lengths / q in the same
    buffers match eager calls."""
    k = _k()
    batch, heads, ctx, ih = 4, 64, 8192, 32
    pool = _pool("fp8_ds_mla", batch * ctx + 256)
    _fill_latent(pool, seed=19)
    _fill_index(pool, seed=20)
    req = _request_slots(pool, batch, ctx, seed=21)
    cache, kpages = pool.latent_data(0), pool.index_k_data(0)
    g = _gen(22)

    def inputs():
        pos = torch.stack(
            [torch.randperm(ctx, device=DEV, generator=g)[:TOPK] for _ in range(batch)]
        )
        slots = req.gather(1, pos).to(torch.int32)
        lens = torch.randint(1, ctx + 1, (batch,), device=DEV, generator=g, dtype=torch.int32)
        q = torch.randn(batch, heads, DIM, device=DEV, generator=g).to(torch.bfloat16)
        qi = torch.randn(batch, ih, INDEX_DIM, device=DEV, generator=g).to(torch.bfloat16)
        w = torch.randn(batch, ih, device=DEV, generator=g)
        rows = torch.randn(batch, DIM, device=DEV, generator=g)
        new_slots = torch.arange(batch * ctx, batch * ctx + batch, device=DEV)
        return [slots, lens, q, qi, w, rows, new_slots]

    table = k.block_table(req, PS)

    def step(slots, lens, q, qi, w, rows, new_slots):
        k.store_ds(rows, cache, new_slots, KV_LORA, ROPE)
        att = k.decode(q, cache, "fp8_ds_mla", slots, SM_SCALE, KV_LORA, ROPE)
        logits = k.paged(qi, w, kpages, table, lens, PS, ctx)
        return att, logits

    static = inputs()
    step(*static)  # compile outside capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(*static)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_att, out_logits = step(*static)
    for _ in range(2):
        fresh = inputs()
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        att, logits = step(*fresh)
        torch.cuda.synchronize()
        assert torch.equal(out_att, att) and torch.equal(out_logits, logits)


def test_bench_runs_on_device():
    from dsakv.kernels.triton_bench import bench_kernels, format_results

    results = bench_kernels("cuda", warmup=1, iters=3)
    print("\n" + format_results(results))
    decode = [r for r in results if r["kernel"].startswith("dense_mla_decode")]
    assert decode and all(r["copy_ratio"] > 0.01 for r in decode)


def test_hisparse_resolve_and_copy_real_shapes_and_graph_replay():
    """GLM-5's HiSparse sizes (top_k 2048, buffer 4096, 656-byte fp8_ds_mla rows from pinned
    host memory over UVA): the Triton resolve equals the torch reference on the same device,
    state included, and resolve + copy capture in a CUDA graph and replay on new top-k."""
    pytest.importorskip("triton")
    from dsakv.kernels import hisparse_ops as ref
    from dsakv.kernels import triton_hisparse as tri
    from dsakv.kernels.triton_rows import copy_rows

    b, s, k, ctx, width = 32, 4096, TOPK, 16384, 656
    g = torch.Generator(device=DEV).manual_seed(0)
    lens = torch.randint(s, ctx, (b,), device=DEV, generator=g)
    buf_slot = torch.randperm(b * (s + 1), device=DEV, generator=g).view(b, s + 1)
    reserved, buf_slot = buf_slot[:, s].contiguous(), buf_slot[:, :s].contiguous()
    states = {name: ref.init_buffers(lens, s) for name in ("torch", "triton")}
    host = torch.randint(0, 256, (b * ctx, width), dtype=torch.uint8).pin_memory()
    dev = {name: torch.zeros(b * (s + 1), width, dtype=torch.uint8, device=DEV) for name in states}

    def topk() -> torch.Tensor:
        scores = torch.rand(b, ctx, device=DEV, generator=g)
        scores = scores.masked_fill(torch.arange(ctx, device=DEV) >= lens[:, None], -1)
        pos = scores.topk(k, dim=1).indices
        return torch.where(scores.gather(1, pos) >= 0, pos, -1)

    def step(fn, copy, name, t, i):
        bp, st = states[name]
        slots, mpos, mslot = fn(t, lens - 1, reserved, bp, st, buf_slot, i)
        base = torch.arange(b, device=DEV)[:, None] * ctx  # request r's rows in `host`
        src = torch.where(mpos >= 0, base + mpos.clamp(min=0), -1).reshape(-1)
        copy(host, dev[name], src, mslot.reshape(-1))
        return slots, mpos, mslot

    for i in range(1, 4):  # the step as a device scalar, as a captured step passes it
        t, i = topk(), torch.tensor(i, device=DEV)
        want = step(ref.resolve, ref.copy_rows, "torch", t, i)
        got = step(tri.resolve, copy_rows, "triton", t, i)
        for w, x in zip(want, got):
            assert torch.equal(w, x)
        assert all(torch.equal(a, c) for a, c in zip(states["torch"], states["triton"]))
        assert torch.equal(dev["torch"], dev["triton"])

    static, ten = topk(), torch.tensor(10, device=DEV)  # (no host copy inside a capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(tri.resolve, copy_rows, "triton", static, ten)
    for _ in range(2):
        t = topk()
        static.copy_(t)
        graph.replay()
        want = step(ref.resolve, ref.copy_rows, "torch", t, 10)
        torch.cuda.synchronize()
        for w, x in zip(want, out):
            assert torch.equal(w, x)
        assert torch.equal(dev["torch"], dev["triton"])
