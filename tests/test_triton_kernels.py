"""dsakv's Triton kernels against torch references built from a real `DSAKVPool`.

Without CUDA the kernels run under the Triton interpreter (numpy, dots in fp32); with CUDA
the same tests run on the GPU, with the bounds stated per test. Sparse MLA with bf16
queries over bf16-exact rows rounds P to bf16 on both (the interpreter emulates it by
bits), and is checked against the per-element bound that rounding implies. Shapes stay
tiny but use the real cache dims (kv_lora 512 + rope 64, index head dim 128) so every
layout offset is the real one.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from dsakv.kernels import topk_by_position  # noqa: E402
from dsakv.kernels._triton import interpreting  # noqa: E402
from dsakv.kernels.backend import TorchBackend, TritonBackend  # noqa: E402
from dsakv.kernels.torch_ops import MLAMath  # noqa: E402
from dsakv.kernels.triton_bench import bench_kernels  # noqa: E402
from dsakv.kernels.triton_fp8 import decode_e4m3, encode_e4m3, pow2_scale, round_bf16  # noqa: E402
from dsakv.kernels.triton_indexer import (  # noqa: E402
    block_table_from_slots,
    index_logits_extend,
    index_logits_extend_varlen,
    index_logits_paged,
)
from dsakv.kernels.triton_mla import (  # noqa: E402
    sparse_mla_decode,
    sparse_mla_extend,
    sparse_mla_extend_varlen,
)
from dsakv.kernels.triton_store import (  # noqa: E402
    store_index_k_fp8,
    store_latent_ds_mla,
    store_latent_fp8_e4m3,
)
from dsakv.memory import CacheLayout, DSAKVPool, page_slots  # noqa: E402
from dsakv.memory.fp8 import hadamard_rotate, pow2_block_scale  # noqa: E402
from dsakv.models import ForwardBatch, Selection  # noqa: E402
from dsakv.models.indexer import StepSelection  # noqa: E402
from tests.conftest import small_glm_config  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")
KV_LORA, ROPE, DIM = 512, 64, 576
KINDS = ["fp32", "bf16", "fp8_e4m3", "fp8_ds_mla"]
SM_SCALE = DIM**-0.5
# Max abs error of attention outputs (values are O(1) rows) on the fp32 paths (fp32 q, or
# fp32 rows): IEEE fp32 dots on the interpreter and the GPU alike. bf16 q over bf16-exact
# rows is held to `_p_rounding_bound` instead.
ATTN_TOL = 1e-5


def make_pool(kind: str = "fp32", page_size: int = 16, pages: int = 8) -> DSAKVPool:
    layout = CacheLayout.for_model(
        small_glm_config(), kv_cache_dtype=kind, index_k_dtype="fp8", page_size=page_size
    )
    return DSAKVPool(layout, pages, device=DEVICE)


def latent_data(pool: DSAKVPool, layer: int = 0) -> torch.Tensor:
    return pool.latent_data(layer)  # the stored buffer, as FlashMLA-style kernels see it


def index_data(pool: DSAKVPool, layer: int = 0) -> torch.Tensor:
    return pool.index_k_data(layer)


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def to_dev(*xs: torch.Tensor):
    return tuple(x.to(DEVICE) for x in xs)


# --- bit-level conversions ----------------------------------------------------------------------


def test_e4m3_decoder_is_exact_on_all_256_bytes():
    b = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    ref = b.view(torch.float8_e4m3fn).float()
    got = decode_e4m3(b)
    nan = ref.isnan()
    assert nan.sum() == 2 and torch.equal(nan, got.isnan())  # 0x7F, 0xFF
    assert torch.equal(ref[~nan].view(torch.int32), got[~nan].view(torch.int32))  # -0.0 too


def _e4m3_sweep() -> torch.Tensor:
    """Every finite e4m3 value, every midpoint between neighbours (ties), ±1 ulp around the
    midpoints, subnormals, ±0, saturating values and random magnitudes over 1e-12..1e3."""
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = vals[~vals.isnan()].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    rand = torch.randn(4000, generator=gen(1)) * torch.logspace(-12, 3, 4000)
    edge = torch.tensor([0.0, -0.0, 448.0, -448.0, 449.0, 464.0, 470.0, -1e6, 2.0**-9, 2.0**-10])
    return torch.cat(
        [vals, mids, torch.nextafter(mids, up), torch.nextafter(mids, down), rand, edge, -rand]
    )


def test_e4m3_encoder_matches_torch_saturating_cast():
    x = _e4m3_sweep()
    ref = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(encode_e4m3(x.to(DEVICE)).cpu(), ref)


def test_bf16_rounding_matches_torch():
    x = torch.cat([_e4m3_sweep(), torch.randn(4000, generator=gen(2)) * 1e30])
    x = torch.cat([x, (x.view(torch.int32) | 0x8000).view(torch.float32)])  # exact bf16 ties
    got = round_bf16(x.to(DEVICE)).cpu()
    assert torch.equal(got.view(torch.int16), x.bfloat16().view(torch.int16))


def test_pow2_scale_kernel_matches_cpu_rule():
    """The kernel's exponent-bit rule equals `fp8.pow2_block_scale` everywhere, including
    the amax/448 = 2^k·(1+2^-23) case fp32 log2 gets wrong and fp32-subnormal amax."""
    just_above = torch.nextafter(torch.tensor(14.0), torch.tensor(15.0))
    amax = torch.cat(
        [
            torch.tensor([0.0, 448.0, 224.0, 1.0, 3e38, 1e-45, 1e-40, 2.0**-130, 7.0 * 2**-20]),
            just_above.view(1),
            torch.exp2(torch.empty(20000).uniform_(-149, 127, generator=gen(3))),
            torch.arange(1 << 12, dtype=torch.int32).mul(2048).add(0x40000000).view(torch.float32),
        ]
    )
    got = pow2_scale(amax.to(DEVICE)).cpu()
    assert torch.equal(got, pow2_block_scale(amax))
    assert got[9].item() == 2**-4  # not log2's 2^-5


# --- stores: byte-equal to the pool's own writes ------------------------------------------------


def _edge_rows(n: int, d: int, seed: int) -> torch.Tensor:
    """Random rows over 11 decades plus the awkward ones: zeros, ±0.0, exact powers of two,
    values at/near ±448, a block whose amax/448 sits just above a power of two, fp32
    subnormals, e4m3-subnormal-sized values beside a large one, negatives."""
    g = gen(seed)
    x = torch.randn(n, d, generator=g) * torch.logspace(-8, 3, n)[:, None]
    x[0] = 0.0
    x[1] = -0.0
    x[1, ::7] = 0.0
    x[2] = torch.exp2(torch.randint(-20, 9, (d,), generator=g).float())
    x[2, ::2] *= -1
    x[3] = 448.0
    x[3, ::3], x[3, 1::3] = -447.9, 447.99
    x[4] = torch.randn(d, generator=g) * 1e-3
    x[4, ::128] = 448 * 2.0**-12 * (1 + 2.0**-23)
    x[5] = torch.rand(d, generator=g) * 14.0
    x[5, ::128] = torch.nextafter(torch.tensor(14.0), torch.tensor(15.0))
    x[6] = torch.randn(d, generator=g) * 1e-39
    x[7] = torch.randn(d, generator=g) * 2.0**-12
    x[7, ::64] = 300.0  # neighbours land in e4m3 subnormals
    x[8] = -x[8].abs()
    return x


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["fp8_ds_mla", "fp8_e4m3"])
def test_latent_store_is_byte_identical_to_pool(kind, dtype, page_size):
    ref, got = make_pool(kind, page_size, 4), make_pool(kind, page_size, 4)
    n = 20  # not a multiple of the kernel's 16 rows per program
    slots = torch.randperm(ref.num_tokens, generator=gen(4))[:n]
    rows = _edge_rows(n, DIM, seed=5).to(dtype)
    ref.write_latent(0, slots[1:], rows[1:])
    skip = slots.clone()
    skip[0] = -1  # skipped: its slot keeps its zero bytes, as in `ref`
    rows_d, skip_d = to_dev(rows, skip.int())
    if kind == "fp8_ds_mla":
        store_latent_ds_mla(rows_d, latent_data(got), skip_d, KV_LORA, ROPE)
    else:
        store_latent_fp8_e4m3(rows_d, latent_data(got), skip_d)
    a, b = (latent_data(p).view(torch.uint8).cpu() for p in (ref, got))
    assert torch.equal(a, b), f"{(a != b).sum()} bytes differ"


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_index_k_store_is_byte_identical_to_pool(dtype, page_size):
    ref, got = make_pool("fp32", page_size, 4), make_pool("fp32", page_size, 4)
    n = 37
    slots = torch.randperm(ref.num_tokens, generator=gen(6))[:n]
    keys = _edge_rows(n, 128, seed=7).to(dtype)
    ref.write_index_k(0, slots[:-1], keys[:-1])  # the pool rotates, then quantises
    skip = slots.clone()
    skip[-1] = -1
    rotated = hadamard_rotate(keys.float())
    k_d, s_d = to_dev(rotated, skip)
    store_index_k_fp8(k_d, index_data(got), s_d, page_size)
    assert torch.equal(index_data(ref).cpu(), index_data(got).cpu())
    # Unrotated edge rows straight through the scale rule (no rotation smoothing them out).
    q, s = _quantize_reference(keys.float())
    keys_d, slots_d = to_dev(keys, slots)
    store_index_k_fp8(keys_d, index_data(got), slots_d, page_size)
    keys_part, scale_part = (p.cpu() for p in got._index_k[0].parts)
    page, off = slots // page_size, slots % page_size
    assert torch.equal(keys_part[page, off], q)
    assert torch.equal(scale_part[page, off], s.view(torch.uint8))


def _quantize_reference(x: torch.Tensor):
    from dsakv.memory.fp8 import quantize_e4m3_blockwise

    return quantize_e4m3_blockwise(x)


# --- sparse MLA decode / extend -----------------------------------------------------------------


def _filled_pool(kind: str, page_size: int = 16, pages: int = 8, seed: int = 0):
    pool = make_pool(kind, page_size, pages)
    rows = torch.randn(pool.num_tokens, DIM, generator=gen(seed))
    rows[:, KV_LORA:] *= 2.0
    pool.write_latent(0, torch.arange(pool.num_tokens), rows.to(DEVICE))
    return pool


def _reference_attention(q, rows, valid):
    """softmax(q·row·scale over valid rows) @ row[:kv_lora] in fp64; rows: [N, K, DIM]."""
    s = torch.einsum("nhd,nkd->nhk", q.double(), rows.double()) * SM_SCALE
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # a query with nothing valid -> zeros
    return torch.einsum("nhk,nkd->nhd", p, rows[..., :KV_LORA].double())


def _max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.dtype == torch.float32 and out.shape == ref.shape
    return (out.double().cpu() - ref.cpu()).abs().max().item()


def _p_rounding_bound(q, rows, valid, ref):
    """Per-element error bound of the bf16 path, whose one rounding is P: each weight
    p_j = 2^(s_j − m) goes to bf16 (8-bit significand, round to nearest: |δ_j| ≤ u = 2^-8)
    and l sums the rounded weights, so out = Σ_j w_j(1+δ_j) v_j / Σ_j w_j(1+δ_j), i.e.
    out − ref = Σ_j w_j δ_j (v_j − ref) / (1 + Σ_j w_j δ_j), and
    |out − ref| ≤ u/(1−u) · Σ_j w_j |v_j − ref|. QK itself is exact (bf16 × bf16 products,
    fp32 sums); 1.01× and 1e-5 cover fp32 accumulation and exp2."""
    s = torch.einsum("nhd,nkd->nhk", q.double(), rows.double()) * SM_SCALE
    w = torch.softmax(s.masked_fill(~valid[:, None, :], float("-inf")), -1).nan_to_num(0.0)
    v = rows[..., :KV_LORA].double()
    spread = (v[:, None, :, :] - ref[:, :, None, :]).abs()  # [N, H, K, D]
    return 2.0**-8 * torch.einsum("nhk,nhkd->nhd", w, spread) * 1.01 + 1e-5


def _assert_attention_close(out, q, rows, valid, ref, bf16_path: bool) -> None:
    assert out.dtype == torch.float32 and out.shape == ref.shape
    err = (out.double().cpu() - ref.cpu()).abs()
    if not bf16_path:
        assert err.max().item() < ATTN_TOL, err.max().item()
        return
    bound = _p_rounding_bound(q.float().cpu(), rows.cpu(), valid.cpu(), ref.cpu())
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error exceeds the P-rounding bound by {worst:.3f}x"


@pytest.mark.parametrize(
    "kind,heads,qdtype",
    [(k, h, torch.float32) for k in KINDS for h in (4, 16)]
    + [("fp8_ds_mla", 20, torch.bfloat16), ("bf16", 4, torch.bfloat16)],
)
def test_sparse_mla_decode_matches_torch(kind, heads, qdtype):
    """K = 37 (not a multiple of the 16-row block), −1 padding at the end of one row and
    scattered in another, one query with no valid slot at all; 1, 3 and default splits."""
    pool = _filled_pool(kind)
    b, k = 4, 37
    g = gen(10)
    slots = torch.randint(0, pool.num_tokens, (b, k), generator=g, dtype=torch.int32)
    slots[0, 29:] = -1
    slots[1, ::5] = -1
    slots[2] = -1
    q = (torch.randn(b, heads, DIM, generator=g)).to(qdtype)
    rows = pool.gather_latent(0, slots.clamp(min=0).flatten().long().to(DEVICE)).view(b, k, DIM)
    ref = _reference_attention(q.float(), rows.cpu(), slots >= 0)
    cache = latent_data(pool)
    bf16_path = qdtype == torch.bfloat16 and kind != "fp32"
    for splits in (1, 3, None):
        out = sparse_mla_decode(
            q.to(DEVICE), cache, kind, slots.to(DEVICE), SM_SCALE, KV_LORA, ROPE, splits
        )
        _assert_attention_close(out, q, rows, slots >= 0, ref, bf16_path)
        assert out[2].abs().max().item() == 0.0


def test_sparse_mla_decode_k_smaller_than_block_and_many_splits():
    pool = _filled_pool("fp8_ds_mla", page_size=64, pages=2)
    g = gen(11)
    slots = torch.randint(0, pool.num_tokens, (2, 5), generator=g, dtype=torch.int32)
    q = torch.randn(2, 4, DIM, generator=g)
    rows = pool.gather_latent(0, slots.flatten().long().to(DEVICE)).view(2, 5, DIM)
    ref = _reference_attention(q, rows.cpu(), slots >= 0)
    # 4 splits of a 5-row selection: three splits see nothing and must not poison the merge
    out = sparse_mla_decode(
        *to_dev(q), latent_data(pool), "fp8_ds_mla", slots.to(DEVICE), SM_SCALE, KV_LORA, ROPE, 4
    )
    assert _max_err(out, ref) < ATTN_TOL


@pytest.mark.parametrize("kind,heads", [(k, 4) for k in KINDS] + [("fp8_ds_mla", 16)])
def test_sparse_mla_extend_matches_torch(kind, heads):
    """One request: context of 45 positions spread over shuffled slots; queries at the
    first, middle and last positions; dense causal, then a top-k with −1 and future
    positions (masked by q_pos), and a query whose whole selection is invalid."""
    pool = _filled_pool(kind, seed=1)
    g = gen(12)
    length = 45
    ctx = torch.randperm(pool.num_tokens, generator=g)[:length]
    q_pos = torch.tensor([0, 1, 17, 30, 43, 44], dtype=torch.int32)
    e = q_pos.numel()
    q = torch.randn(e, heads, DIM, generator=g)
    ctx_rows = pool.gather_latent(0, ctx.to(DEVICE)).cpu()
    cache = latent_data(pool)
    # dense causal
    kpos = torch.arange(length)
    ref = _reference_attention(q, ctx_rows.expand(e, -1, -1), kpos[None, :] <= q_pos[:, None])
    out = sparse_mla_extend(q.to(DEVICE), cache, kind, ctx.int().to(DEVICE), q_pos.to(DEVICE),
                            None, SM_SCALE, KV_LORA, ROPE)  # fmt: skip
    assert _max_err(out, ref) < ATTN_TOL
    # top-k positions
    topk = torch.randint(-1, length, (e, 19), generator=g, dtype=torch.int32)
    topk[3] = -1
    topk[5, :3] = torch.tensor([44, 44, 0])  # duplicates attend twice, as in the gather path
    valid = (topk >= 0) & (topk <= q_pos[:, None])
    ref = _reference_attention(q, ctx_rows[topk.clamp(min=0).long()], valid)
    out = sparse_mla_extend(q.to(DEVICE), cache, kind, ctx.to(DEVICE), q_pos.to(DEVICE),
                            topk.to(DEVICE), SM_SCALE, KV_LORA, ROPE)  # fmt: skip
    assert _max_err(out, ref) < ATTN_TOL
    assert out[3].abs().max().item() == 0.0


@pytest.mark.parametrize("kind", ["fp32", "fp8_ds_mla"])
def test_sparse_mla_extend_varlen_reads_each_query_s_own_context(kind):
    """Three requests' chunks in one launch, their contexts (45, 9 and 20 positions over
    shuffled slots) one after another: each query attends only its own request's context,
    as the reference over that context computes, dense causal and with top-k positions
    (−1, future and past-its-context positions masked)."""
    pool = _filled_pool(kind, seed=4)
    g = gen(13)
    ctx_lens, q_lists = [45, 9, 20], [[0, 17, 44], [3, 4, 5, 6, 7, 8], [19]]
    perm = torch.randperm(pool.num_tokens, generator=g)
    ctxs = [perm[sum(ctx_lens[:i]) : sum(ctx_lens[: i + 1])] for i in range(3)]
    q_pos = torch.tensor([p for qs in q_lists for p in qs], dtype=torch.int32)
    owner = torch.tensor([i for i, qs in enumerate(q_lists) for _ in qs])
    start = torch.tensor([0, 45, 54])[owner].int()
    lens = torch.tensor(ctx_lens)[owner].int()
    e, heads = q_pos.numel(), 4
    q = torch.randn(e, heads, DIM, generator=g)
    flat = torch.cat(ctxs)
    rows = [pool.gather_latent(0, c.to(DEVICE)).cpu() for c in ctxs]
    width = max(ctx_lens)
    padded = torch.stack([torch.cat([r, r[:1].expand(width - r.shape[0], -1)]) for r in rows])
    args = (pool.latent_data(0), kind, flat.to(DEVICE), *to_dev(start, lens), width)
    tail = (SM_SCALE, KV_LORA, ROPE)
    kpos = torch.arange(width)
    dense = (kpos[None, :] <= q_pos[:, None]) & (kpos[None, :] < lens[:, None])
    out = sparse_mla_extend_varlen(q.to(DEVICE), *args, q_pos.to(DEVICE), None, *tail)
    assert _max_err(out, _reference_attention(q, padded[owner], dense)) < ATTN_TOL
    topk = torch.randint(-1, width, (e, 12), generator=g, dtype=torch.int32)
    topk[1, :2] = torch.tensor([17, 44])  # its own position, and one in its future
    topk[4, :2] = torch.tensor([3, 30])  # request 1: position 30 is past its 9
    valid = (topk >= 0) & (topk <= q_pos[:, None]) & (topk < lens[:, None])
    picked = padded[owner][torch.arange(e)[:, None], topk.clamp(min=0).long()]
    out = sparse_mla_extend_varlen(q.to(DEVICE), *args, q_pos.to(DEVICE), topk.to(DEVICE), *tail)
    assert _max_err(out, _reference_attention(q, picked, valid)) < ATTN_TOL
    # one request alone through either entry point: the same numbers
    one = sparse_mla_extend(q[:3].to(DEVICE), pool.latent_data(0), kind, ctxs[0].to(DEVICE),
                            q_pos[:3].to(DEVICE), None, *tail)  # fmt: skip
    assert (
        _max_err(one, _reference_attention(q[:3], padded[:1].expand(3, -1, -1), dense[:3]))
        < ATTN_TOL
    )


@pytest.mark.parametrize("dense_ctx", [6, 12], ids=["one-launch", "dense-past-k"])
def test_triton_backend_attends_every_chunk_of_a_step_as_torch_does(dense_ctx):
    """A step of a decode token, a dense chunk and two selected chunks (k = 8): the Triton
    backend's one varlen launch (the dense chunk attends positions 0..k−1 beside the
    selected ones) computes what the torch backend's request-at-a-time loop does. With the
    dense chunk's context past k (12) it cannot share the launch and goes a request at a
    time; the same numbers."""
    pool, g, heads, k = _filled_pool("fp32", seed=5), gen(14), 4, 8
    ctx_lens, new = [7, dense_ctx, 30, 20], [1, 4, 6, 20]  # request 0 decodes
    perm = torch.randperm(pool.num_tokens, generator=g).to(DEVICE)
    slots = [perm[sum(ctx_lens[:i]) : sum(ctx_lens[: i + 1])] for i in range(4)]
    batch = ForwardBatch.from_requests([[1] * n for n in new], slots, device=DEVICE)
    t = batch.num_tokens
    q_nope, q_rope = (
        torch.randn(t, heads, KV_LORA, generator=g),
        torch.randn(t, heads, ROPE, generator=g),
    )
    w_uv = torch.randn(heads, 16, KV_LORA, generator=g) * 0.1
    sels: list[Selection | None] = [None, None]
    for ctx, n in zip(ctx_lens[2:], new[2:]):
        qpos = torch.arange(ctx - n, ctx)
        scores = torch.rand(n, ctx, generator=g)  # as the indexer scores: the future is out
        scores[torch.arange(ctx)[None, :] > qpos[:, None]] = float("-inf")
        positions = topk_by_position(scores, k)  # (a query seeing < k positions: future ones)
        sels.append(Selection(positions.to(DEVICE), (positions <= qpos[:, None]).to(DEVICE)))
    math = MLAMath(heads, KV_LORA, SM_SCALE)
    step = StepSelection(batch, sels, None)
    args = (math, pool, 0, *to_dev(q_nope, q_rope), batch, step, None, w_uv.to(DEVICE))
    triton, alone = TritonBackend(pool.layout), []
    one = triton.mla_extend
    triton.mla_extend = lambda *a: alone.append(1) or one(*a)  # a request at a time
    got = triton.mla_extends(*args)
    ref = TorchBackend().mla_extends(*args)
    assert len(alone) == (0 if dense_ctx <= k else 3)
    assert got.shape == (sum(new[1:]), heads, 16)
    assert (got.cpu() - ref.cpu()).abs().max().item() < 1e-4


def test_mla_launch_config_puts_all_heads_of_a_query_in_one_program():
    """bf16 q over bf16-exact rows: 64 heads (GLM-5) in one program, 128 (DSV3.2) in two;
    the bf16 dot on a GPU, its fp32 emulation on the interpreter; fp32 keeps IEEE dots."""
    from dsakv.kernels import triton_mla as tm

    for kind in ("bf16", "fp8_e4m3", "fp8_ds_mla"):
        for heads, want in ((4, 16), (20, 32), (64, 64), (128, 64)):
            const, opts = tm._launch_config(kind, True, heads, KV_LORA, ROPE)
            assert const["BLOCK_H"] == want and const["DOT"] == tm._DOT_BF16
            assert opts["num_warps"] == 8
        const, _ = tm._launch_config(kind, True, 64, KV_LORA, ROPE, interpret=True)
        assert const["DOT"] == tm._DOT_BF16_EMU and const["BLOCK_H"] == 64
        const, _ = tm._launch_config(kind, False, 64, KV_LORA, ROPE)
        assert const["DOT"] == tm._DOT_F32 and const["PREC"] == "ieee"
    const, _ = tm._launch_config("fp32", True, 64, KV_LORA, ROPE)  # fp32 rows: not bf16-exact
    assert const["DOT"] == tm._DOT_F32
    assert interpreting(tm._mla_partial_kernel) == INTERPRET


def test_indexer_dots_bf16_queries_in_bf16_on_a_gpu():
    """bf16 queries over e4m3 keys: a bf16 dot on a GPU (exact products, fp32 sums), the same
    values dotted in fp32 on the interpreter (which multiplies bf16 bits); fp32 q: tf32x3."""
    from dsakv.kernels import triton_indexer as ti

    kpages = torch.zeros(2, 16 * (128 + 4), dtype=torch.uint8)
    w = torch.ones(1, 4)
    for dtype, want in ((torch.bfloat16, not INTERPRET), (torch.float32, False)):
        _, _, _, meta = ti._prepare(torch.zeros(1, 4, 128, dtype=dtype), w, kpages, 16)
        assert meta["Q_BF16"] == (dtype == torch.bfloat16) and meta["BF16_DOT"] == want


@pytest.mark.parametrize("kind", KINDS)
def test_sparse_mla_decode_64_heads_in_one_program(kind):
    """GLM-5's 64 heads in one program: bf16 q (the bf16 dot, P rounded once) within the
    P-rounding bound, fp32 q (IEEE dots) within 1e-5; K = 45 with a −1 tail and holes,
    and a query with no valid slot."""
    pool = _filled_pool(kind, seed=2)
    b, k, heads = 3, 45, 64
    g = gen(13)
    slots = torch.randint(0, pool.num_tokens, (b, k), generator=g, dtype=torch.int32)
    slots[0, 40:] = -1
    slots[0, ::7] = -1
    slots[2] = -1
    rows = pool.gather_latent(0, slots.clamp(min=0).flatten().long().to(DEVICE)).view(b, k, DIM)
    q32 = torch.randn(b, heads, DIM, generator=g)
    for q in (q32.bfloat16(), q32):
        ref = _reference_attention(q.float(), rows.cpu(), slots >= 0)
        out = sparse_mla_decode(
            q.to(DEVICE), latent_data(pool), kind, slots.to(DEVICE), SM_SCALE, KV_LORA, ROPE
        )
        bf16_path = q.dtype == torch.bfloat16 and kind != "fp32"
        _assert_attention_close(out, q, rows, slots >= 0, ref, bf16_path)
        assert out[2].abs().max().item() == 0.0


def test_sparse_mla_decode_128_heads_two_head_blocks():
    """DeepSeek-V3.2's 128 heads: two 64-head programs per query, each equal bit for bit
    to the 64-head call on its half (same splits), and within the P-rounding bound."""
    pool = _filled_pool("fp8_ds_mla", seed=3)
    g = gen(14)
    b, k = 1, 40
    slots = torch.randint(0, pool.num_tokens, (b, k), generator=g, dtype=torch.int32)
    slots[0, 33:] = -1
    q = torch.randn(b, 128, DIM, generator=g).bfloat16()
    rows = pool.gather_latent(0, slots.clamp(min=0).flatten().long().to(DEVICE)).view(b, k, DIM)
    ref = _reference_attention(q.float(), rows.cpu(), slots >= 0)
    cache, sl = latent_data(pool), slots.to(DEVICE)
    out = sparse_mla_decode(q.to(DEVICE), cache, "fp8_ds_mla", sl, SM_SCALE, KV_LORA, ROPE, 2)
    _assert_attention_close(out, q, rows, slots >= 0, ref, bf16_path=True)
    for half in (slice(0, 64), slice(64, 128)):
        part = sparse_mla_decode(
            q[:, half].contiguous().to(DEVICE), cache, "fp8_ds_mla", sl, SM_SCALE, KV_LORA,
            ROPE, 2,
        )  # fmt: skip
        assert torch.equal(part, out[:, half])


@pytest.mark.parametrize("kind", ["bf16", "fp8_ds_mla"])
def test_sparse_mla_extend_64_heads_bf16_q(kind):
    """Extend with 64 bf16 heads per program: dense causal and top-k positions (−1, future
    positions, a query with nothing valid) within the P-rounding bound."""
    pool = _filled_pool(kind, seed=4)
    g = gen(15)
    length = 40
    ctx = torch.randperm(pool.num_tokens, generator=g)[:length]
    q_pos = torch.tensor([0, 21, 39], dtype=torch.int32)
    e = q_pos.numel()
    q = torch.randn(e, 64, DIM, generator=g).bfloat16()
    ctx_rows = pool.gather_latent(0, ctx.to(DEVICE)).cpu()
    cache = latent_data(pool)
    causal = torch.arange(length)[None, :] <= q_pos[:, None]
    dense_rows = ctx_rows.expand(e, -1, -1)
    ref = _reference_attention(q.float(), dense_rows, causal)
    out = sparse_mla_extend(q.to(DEVICE), cache, kind, ctx.to(DEVICE), q_pos.to(DEVICE),
                            None, SM_SCALE, KV_LORA, ROPE)  # fmt: skip
    _assert_attention_close(out, q, dense_rows, causal, ref, bf16_path=True)
    topk = torch.randint(-1, length, (e, 11), generator=g, dtype=torch.int32)
    topk[1] = -1
    valid = (topk >= 0) & (topk <= q_pos[:, None])
    sel_rows = ctx_rows[topk.clamp(min=0).long()]
    ref = _reference_attention(q.float(), sel_rows, valid)
    out = sparse_mla_extend(q.to(DEVICE), cache, kind, ctx.to(DEVICE), q_pos.to(DEVICE),
                            topk.to(DEVICE), SM_SCALE, KV_LORA, ROPE)  # fmt: skip
    _assert_attention_close(out, q, sel_rows, valid, ref, bf16_path=True)
    assert out[1].abs().max().item() == 0.0


# --- indexer logits -----------------------------------------------------------------------------


def _index_pool(page_size: int, pages: int, seed: int) -> DSAKVPool:
    pool = make_pool("fp32", page_size, pages)
    keys = torch.randn(pool.num_tokens, 128, generator=gen(seed))
    pool.write_index_k(0, torch.arange(pool.num_tokens).to(DEVICE), keys.to(DEVICE))
    return pool


def _reference_logits(q, w, keys):
    """Σ_h w_h ReLU(q_h·k) in fp64: q [Hi, D], w [Hi], keys [L, D] -> [L]."""
    return (w.double()[:, None] * torch.relu(q.double() @ keys.double().T)).sum(0)


def _assert_same_topk(got: torch.Tensor, ref: torch.Tensor, k: int, tol: float) -> None:
    """Same `topk_by_position` selection, provided the reference separates the k-th from
    the (k+1)-th score by more than the tolerance (exact ties go by position in both)."""
    ref32 = ref.float()
    srt = ref32.sort(descending=True).values
    gap = (srt[:, k - 1] - srt[:, k]).abs()
    tied = srt[:, k - 1] == srt[:, k]
    assert ((gap > 2 * tol) | tied).all(), "test input has a near-tie at the top-k boundary"
    a = topk_by_position(got.cpu(), k)
    b = topk_by_position(ref32.cpu(), k)
    assert [set(r.tolist()) for r in a] == [set(r.tolist()) for r in b]


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize(
    "heads,qdtype", [(2, torch.float32), (16, torch.float32), (8, torch.bfloat16)]
)
def test_index_logits_paged_matches_torch(page_size, heads, qdtype):
    """Three requests on shuffled pages (a full one, one token, a partial last page), a
    padded block table and a logits width past every length: columns ≥ len are −inf."""
    pages = 12
    pool = _index_pool(page_size, pages, seed=20)
    g = gen(21)
    perm = torch.randperm(pages, generator=g)
    owned = [perm[:4], perm[4:5], perm[5:10]]
    max_pages = 6
    table = torch.full((3, max_pages), -1, dtype=torch.int64)  # −1: never read (past lens)
    for i, p in enumerate(owned):
        table[i, : p.numel()] = p
    lens = torch.tensor([4 * page_size, 1, 4 * page_size + 5], dtype=torch.int32)
    width = max_pages * page_size + 3
    q = pool.prepare_index_q(torch.randn(3, heads, 128, generator=g).to(DEVICE)).to(qdtype)
    w = torch.randn(3, heads, generator=g) * heads**-0.5
    out = index_logits_paged(
        q, w.to(DEVICE), index_data(pool), *to_dev(table.int(), lens), page_size, width
    )
    assert out.shape == (3, width) and out.dtype == torch.float32
    out = out.cpu()
    ref = torch.full((3, width), float("-inf"), dtype=torch.float64)
    for b in range(3):
        slots = page_slots(owned[b], page_size)[: lens[b]]
        keys = pool.gather_index_k(0, slots.to(DEVICE)).cpu()
        ref[b, : lens[b]] = _reference_logits(q[b].float().cpu(), w[b], keys)
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(out)) and (out[~finite] == float("-inf")).all()
    tol = 5e-5 if INTERPRET or qdtype == torch.bfloat16 else 2e-4  # logits are O(10)
    assert (out[finite].double() - ref[finite]).abs().max().item() < tol
    _assert_same_topk(out[[0, 2]], ref[[0, 2]], 40, tol)


def test_block_table_from_page_aligned_slots():
    slots = torch.stack(
        [page_slots(torch.tensor([3, 0, 5]), 16), page_slots(torch.tensor([1, 2, 4]), 16)]
    )
    assert block_table_from_slots(slots, 16).tolist() == [[3, 0, 5], [1, 2, 4]]
    assert block_table_from_slots(slots, 16).dtype == torch.int32


@pytest.mark.parametrize(
    "page_size,heads,qdtype", [(16, 4, torch.float32), (64, 16, torch.bfloat16)]
)
def test_index_logits_extend_matches_torch(page_size, heads, qdtype):
    pages = 6
    pool = _index_pool(page_size, pages, seed=30)
    g = gen(31)
    length = 4 * page_size + 9
    ctx = page_slots(torch.randperm(pages, generator=g)[:5], page_size)[:length]
    q_pos = torch.tensor([0, 5, page_size, length - 2, length - 1], dtype=torch.int32)
    e = q_pos.numel()
    q = pool.prepare_index_q(torch.randn(e, heads, 128, generator=g).to(DEVICE)).to(qdtype)
    w = torch.randn(e, heads, generator=g) * heads**-0.5
    out = index_logits_extend(
        q, w.to(DEVICE), index_data(pool), *to_dev(ctx, q_pos), page_size
    ).cpu()
    keys = pool.gather_index_k(0, ctx.to(DEVICE)).cpu()
    ref = torch.stack([_reference_logits(q[i].float().cpu(), w[i], keys) for i in range(e)])
    ref = ref.masked_fill(torch.arange(length)[None, :] > q_pos[:, None], float("-inf"))
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(out))
    tol = 5e-5 if INTERPRET or qdtype == torch.bfloat16 else 2e-4
    assert (out[finite].double() - ref[finite]).abs().max().item() < tol
    _assert_same_topk(out[3:], ref[3:], 24, tol)


def test_index_logits_extend_varlen_equals_each_request_alone():
    """Two requests' chunks (contexts of 41 and 23 positions, pages shuffled) in one launch:
    each query's logits are bit for bit its request's alone, and −inf past its context."""
    page_size, pages, heads = 16, 6, 4
    pool = _index_pool(page_size, pages, seed=32)
    g = gen(33)
    order = page_slots(torch.randperm(pages, generator=g), page_size)
    ctxs = [order[:41], order[48:71]]
    q_lists = [[0, 20, 39, 40], [5, 22]]
    q_pos = torch.tensor([p for qs in q_lists for p in qs], dtype=torch.int32)
    owner = torch.tensor([i for i, qs in enumerate(q_lists) for _ in qs])
    e = q_pos.numel()
    q = pool.prepare_index_q(torch.randn(e, heads, 128, generator=g).to(DEVICE))
    w = (torch.randn(e, heads, generator=g) * heads**-0.5).to(DEVICE)
    start, lens = torch.tensor([0, 41])[owner].int(), torch.tensor([41, 23])[owner].int()
    got = index_logits_extend_varlen(
        q, w, index_data(pool), torch.cat(ctxs).to(DEVICE), *to_dev(start, lens), 41,
        q_pos.to(DEVICE), page_size,
    ).cpu()  # fmt: skip
    assert got.shape == (e, 41)
    at = 0
    for ctx, qs in zip(ctxs, q_lists):
        rows = slice(at, at + len(qs))
        alone = index_logits_extend(
            q[rows], w[rows], index_data(pool), ctx.to(DEVICE), q_pos[rows].to(DEVICE), page_size
        ).cpu()
        assert torch.equal(got[rows, : ctx.numel()], alone)
        assert torch.isneginf(got[rows, ctx.numel() :]).all()
        at += len(qs)


def test_triton_backend_selects_every_long_chunk_of_a_step_as_alone():
    """A decode token beside two chunks past index_topk (k = 8): the Triton backend's one
    varlen launch picks, row for row, the positions each chunk picks alone."""
    page_size, pages, heads, k = 16, 6, 4, 8
    pool, g = _index_pool(page_size, pages, seed=34), gen(35)
    order = page_slots(torch.randperm(pages, generator=g), page_size).to(DEVICE)
    batch = ForwardBatch.from_requests(
        [[1], [1] * 5, [1] * 23], [order[:9], order[16:57], order[64:87]], device=DEVICE
    )
    q = torch.randn(batch.num_tokens, heads, 128, generator=g).to(DEVICE)
    w = (torch.randn(batch.num_tokens, heads, generator=g) * heads**-0.5).to(DEVICE)
    triton = TritonBackend(pool.layout)
    got = triton.index_topk_extends(pool, 0, q, w, batch, [1, 2], 0.5, k)
    alone = [
        triton.index_topk_extend(
            pool, 0, q[a : a + n], w[a : a + n], batch.req_slots[r], batch.prefix_lens[r], 0.5, k
        )  # fmt: skip
        for r, a, n in [(1, 1, 5), (2, 6, 23)]
    ]
    assert torch.equal(got, torch.cat(alone))


# --- harness and packaging ----------------------------------------------------------------------


def test_bench_dry_run():
    results = bench_kernels(DEVICE, dry_run=True, warmup=0, iters=1)
    names = {r["kernel"] for r in results}
    assert {"sparse_mla_decode[fp8_ds_mla]", "dense_mla_decode[fp8_ds_mla]", "index_logits_paged",
            "store_index_k_fp8"} <= names  # fmt: skip
    for r in results:
        assert r["time_ms"] > 0 and r["bytes"] > 0 and r["copy_ratio"] > 0


def test_kernel_modules_import_without_triton():
    """Triton is a dev/GPU extra: the modules import without it and fail only when used."""
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "import torch\n"
        "from dsakv.kernels import triton_mla, triton_indexer, triton_store, triton_fp8\n"
        "try:\n"
        "    triton_mla.sparse_mla_decode(torch.zeros(1, 1, 576), torch.zeros(1, 576), 'fp32',\n"
        "        torch.zeros(1, 1, dtype=torch.int32), 1.0, 512, 64)\n"
        "except ImportError as e:\n"
        "    print('ImportError', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("ImportError")
