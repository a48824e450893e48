"""The cpu backend's native kernels (`dsakv.kernels.cpu_native`) against the torch paths
they replace: decode attention agrees with the reference to fp32 rounding and does not
depend on its batch or thread count; stores write the very bytes the pool's own encoding
writes; a missing compiler leaves the torch ops in place."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dsakv import LLM, SamplingParams
from dsakv.kernels import cpu_native, torch_ops
from dsakv.memory import CacheLayout, DSAKVPool
from dsakv.memory.fp8 import FP8_DTYPE
from dsakv.models.tiny import write_tiny_model

from .conftest import flat_logprobs

native = pytest.mark.skipif(
    not cpu_native.available(), reason="no C++ compiler: the cpu backend runs its torch ops"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("glm-tiny"), preset="glm-tiny", seed=0))


def _one_and_two_threads():
    """Runs the loop body at one torch thread, then at two; restores the count."""
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            yield n
    finally:
        torch.set_num_threads(threads)


def _layout(tiny: str, **kw) -> CacheLayout:
    return CacheLayout.for_model(tiny, **kw)


# --- decode attention ------------------------------------------------------------------------


def _decode_case(tiny, kind: str, batch: int, seed: int = 0, width: int = 24):
    """A pool of random latent rows and a sparse decode batch over it (positions in any
    order, some invalid), with the torch reference's output."""
    from dsakv.kernels import MLAMath, TorchBackend
    from dsakv.memory import DSAKVPool

    g = torch.Generator().manual_seed(seed)
    lay = _layout(tiny, kv_cache_dtype=kind, page_size=16)
    pool = DSAKVPool(lay, 8)
    lora, rope, heads = lay.kv_lora_rank, lay.qk_rope_head_dim, 4
    pool.write_latent(1, torch.arange(128), torch.randn(128, lora + rope, generator=g))
    math = MLAMath(heads, lora, 0.1)
    q_nope = torch.randn(batch, heads, lora, generator=g)
    q_rope = torch.randn(batch, heads, rope, generator=g)
    slots = torch.randint(0, 128, (batch, width), generator=g)
    valid = torch.rand(batch, width, generator=g) < 0.8
    valid[:, 0] = True
    w_kvb = torch.randn(heads, 16, lora, generator=g) * 0.05
    args = (math, pool, 1, q_nope, q_rope, slots, valid, w_kvb[:, :8], w_kvb[:, 8:])
    return args, TorchBackend().mla_decode(*args)


@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_ds_mla", "bf16", "fp32"])
def test_cpu_decode_reads_the_stored_bytes_as_the_pool_decodes_them(tiny, kind):
    """The torch fallback of the CPU backend's decode attention (rows widened straight
    from the pool's bytes) is the reference's arithmetic: bit-equal outputs."""
    from dsakv.kernels import cpu_ops

    for batch in (1, 3):
        (math, pool, layer, q_nope, q_rope, slots, valid, _, w_uv), ref = _decode_case(
            tiny, kind, batch
        )
        lay = pool.layout
        got = cpu_ops.decode_attention(
            torch.cat([q_nope, q_rope], dim=-1),
            pool.latent_data(layer),
            slots,
            valid,
            w_uv,
            math.scale,
            kind,
            lay.kv_lora_rank,
            lay.qk_rope_head_dim,
        )
        assert torch.equal(got, ref)


def _decode_fp64(math, pool, layer, q_nope, q_rope, slots, valid, w_uk, w_uv):
    """`MLAMath.decode`'s absorbed attention in fp64 over the stored rows."""
    b, k = slots.shape
    rows = pool.gather_latent(layer, slots.flatten(), torch.float32).double().view(b, k, -1)
    scores = torch.bmm(torch.cat([q_nope, q_rope], -1).double(), rows.transpose(1, 2))
    probs = (scores * math.scale).masked_fill(~valid[:, None, :], float("-inf")).softmax(-1)
    o_lat = torch.bmm(probs, rows[..., : math.kv_lora])
    return torch.einsum("bhc,hvc->bhv", o_lat, w_uv.double())


@native
@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_ds_mla", "bf16", "fp32"])
def test_native_decode_matches_the_reference_and_ignores_its_batch(tiny, kind):
    """The native kernel (stored rows read in place, runs of rows merged, an online softmax
    over blocks of 64 rows) is as close to an fp64 evaluation as the reference is, for
    every row encoding; a request's output is bit-equal alone or in a batch, at one
    thread or two."""
    from dsakv.kernels.backend import CpuBackend

    for batch in (1, 5):  # 150 rows: two runs, three blocks of the online softmax
        args, ref = _decode_case(tiny, kind, batch, seed=batch, width=150)
        backend = CpuBackend(args[1].layout)
        assert backend.native
        got = backend.mla_decode(*args)
        exact = _decode_fp64(*args)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=4e-6)  # both ~1e-6 from fp64
        err, ref_err = (got.double() - exact).abs().max(), (ref.double() - exact).abs().max()
        assert err <= 1.5 * ref_err + 1e-7, (err, ref_err)
    math, pool, layer, q_nope, q_rope, slots, valid, _, w_uv = args
    data, scale = pool.latent_data(layer), math.scale
    for w in (None, w_uv):  # the latent outputs, and their values through W_uv
        whole = cpu_native.mla_decode(q_nope, q_rope, data, slots, valid, scale, kind, w)
        for _ in _one_and_two_threads():
            for r in range(batch):
                alone = (q_nope[r : r + 1], q_rope[r : r + 1], data, slots[r : r + 1])
                one = cpu_native.mla_decode(*alone, valid[r : r + 1], scale, kind, w)
                assert torch.equal(one[0], whole[r])


@native
def test_native_decode_rejects_slots_outside_the_pool(tiny):
    """A valid slot past the latent buffer is an error, never a read of other memory."""
    (math, pool, layer, q_nope, q_rope, slots, valid, _, _), _ = _decode_case(tiny, "fp8_ds_mla", 2)
    data = pool.latent_data(layer)
    slots = slots.clone()
    slots[1, 0] = data.shape[0]  # valid[:, 0] is always True
    with pytest.raises(IndexError, match="outside the latent buffer"):
        cpu_native.mla_decode(q_nope, q_rope, data, slots, valid, math.scale, "fp8_ds_mla")


@native
def test_native_kernels_widen_every_e4m3_byte_as_torch_does():
    """Every e4m3 byte widens to torch's value (stored latent rows in `mla_decode`, packed
    FP8 weights in `linear`) whatever the FPU's flush-to-zero / denormals-are-zero mode
    (`torch.set_flush_denormal`): the subnormals 2^-9 .. 7 · 2^-9 are fp32 normals, never
    read as 0, and not after the mode is off again either (in a fresh process: the kernels
    build a table on first use). Each byte is in a kernel's vector body and its scalar
    tail; compared bit for bit after `+ 0.0` (a sum of products from +0 turns -0 into +0)."""
    code = """
import torch
from dsakv.kernels import cpu_native, torch_ops
from dsakv.memory.fp8 import FP8_DTYPE

every = torch.arange(256)
finite = every[(every & 0x7F) != 0x7F]
sub = ((finite & 0x7F) < 8) & ((finite & 0x7F) > 0)  # 0x01..0x07, 0x81..0x87
rows = [finite, torch.cat([finite[~sub], finite[sub]])]  # subnormals early, then last
rows = torch.stack([*rows, torch.full_like(finite, 0x7F), torch.full_like(finite, 0xFF)])
rows = rows.to(torch.uint8)
want = rows[:2].view(FP8_DTYPE).float() + 0.0
k, heads, rope = rows.shape[1], 2, 16
for on in (True, False):
    assert torch.set_flush_denormal(on) or not on
    # One valid row a request (its softmax weight exactly 1): the output is the row.
    data = torch.cat([rows, torch.zeros(4, rope, dtype=torch.uint8)], 1)
    q = torch.zeros(4, heads, k), torch.zeros(4, heads, rope)
    slots, valid = torch.arange(4)[:, None], torch.ones(4, 1, dtype=torch.bool)
    out = cpu_native.mla_decode(*q, data, slots, valid, 0.1, "fp8_e4m3")
    assert torch.equal(out[:2], want[:, None].expand(2, heads, k)), ("mla_decode", on)
    assert out[2:].isnan().all()
    # One-hot inputs: output t of weight row r is the row's value t (scale 1).
    packed = torch_ops.pack_fp8(rows.view(FP8_DTYPE), torch.ones(4, -(-k // 128)))
    out = cpu_native.linear(torch.eye(k), packed)
    assert torch.equal(out[:, :2].T, want), ("linear", on)
    assert out[:, 2:].isnan().all()
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


# --- stores ----------------------------------------------------------------------------------


def _hard_values(width: int) -> torch.Tensor:
    """Rows of fp32 values where an fp8 encoding can go wrong: every e4m3 value, the
    midpoints between neighbours (ties round to even) and one ulp either side of them,
    the subnormal range, saturation (±448 and beyond, ±inf), signed zeros, and a random
    spread over 15 decades."""
    table = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    vals = table[~table.isnan()].unique()  # sorted
    mids = (vals[1:] + vals[:-1]) / 2
    up = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    down = torch.nextafter(mids, torch.full_like(mids, -float("inf")))
    g = torch.Generator().manual_seed(0)
    spread = torch.randn(4096, generator=g) * 10 ** torch.empty(4096).uniform_(-12, 3, generator=g)
    extra = torch.tensor(
        [0.0, -0.0, 448.0, -448.0, 464.0, 470.0, 1e6, float("inf"), -float("inf"), 2.0**-10, 1e-45]
    )
    x = torch.cat([vals, -vals, mids, -mids, up, down, extra, spread])
    x = torch.cat([x, torch.zeros(-x.numel() % width)])
    return x.view(-1, width)


@native
@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_ds_mla"])
def test_native_latent_store_writes_the_pools_bytes(tiny, kind):
    """Byte-equal to `DSAKVPool.write_latent` on values that stress the rounding, blocks of
    mixed magnitude (fp8_ds_mla scales) and an all-zero row."""
    lay = _layout(tiny, kv_cache_dtype=kind, page_size=16)
    lora, rope = lay.kv_lora_rank, lay.qk_rope_head_dim
    x = _hard_values(lora + rope)
    x = torch.cat([x, torch.zeros(1, lora + rope)])
    n = x.shape[0]
    ref, got = DSAKVPool(lay, -(-2 * n // 16)), DSAKVPool(lay, -(-2 * n // 16))
    slots = torch.randperm(2 * n, generator=torch.Generator().manual_seed(1))[:n]
    ref.write_latent(1, slots, x)
    cpu_native.store_latent(x, got.latent_data(1), slots, kind, lora, rope)
    a, b = (p.latent_data(1).view(torch.uint8) for p in (ref, got))
    assert torch.equal(a, b)


@native
def test_native_index_k_store_writes_the_pools_bytes(tiny):
    """fp8 index-K (rotated, one power-of-two scale per 128 values, page-major) byte-equal
    to `DSAKVPool.write_index_k`, for keys from 1e-12 to 1e3 in magnitude."""
    lay = _layout(tiny, index_k_dtype="fp8", page_size=16)
    layer, d = lay.index_k_layers[0], lay.index_head_dim
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(48, d, generator=g) * torch.logspace(-12, 3, 48)[:, None]
    keys[0] = 0
    slots = torch.randperm(64, generator=g)[:48]
    ref, got = DSAKVPool(lay, 4), DSAKVPool(lay, 4)
    ref.write_index_k(layer, slots, keys)
    cpu_native.store_index_k_fp8(ref.prepare_index_q(keys), got.index_k_data(layer), slots, 16)
    assert torch.equal(ref.index_k_data(layer), got.index_k_data(layer))


@native
def test_native_stores_reject_bad_slots_and_shapes_writing_nothing(tiny):
    lay = _layout(tiny, page_size=16)
    pool = DSAKVPool(lay, 2)
    d = lay.kv_lora_rank + lay.qk_rope_head_dim
    before = pool.latent_data(1).clone()
    args = ("fp8_e4m3", lay.kv_lora_rank, lay.qk_rope_head_dim)
    with pytest.raises(IndexError, match="out of range"):
        cpu_native.store_latent(torch.ones(2, d), pool.latent_data(1), torch.tensor([0, 32]), *args)
    with pytest.raises(ValueError, match="rows must be"):
        cpu_native.store_latent(
            torch.ones(2, d - 1), pool.latent_data(1), torch.tensor([0, 1]), *args
        )
    assert torch.equal(pool.latent_data(1).view(torch.uint8), before.view(torch.uint8))


# --- decode indexer --------------------------------------------------------------------------


def _index_case(tiny, batch: int, width: int, seed: int = 0):
    """A pool of random fp8 index keys (page size 16, slots scattered) and decode queries
    over padded tables of `width` slots, shorter lengths for some requests."""
    g = torch.Generator().manual_seed(seed)
    lay = _layout(tiny, index_k_dtype="fp8", page_size=16)
    pool = DSAKVPool(lay, 16)
    layer = next(i for i in range(lay.num_layers) if lay.has_index_k(i))
    d, heads = lay.index_head_dim, 8
    pool.write_index_k(layer, torch.arange(256), torch.randn(256, d, generator=g))
    q = pool.prepare_index_q(torch.randn(batch, heads, d, generator=g))
    w = torch.randn(batch, heads, generator=g)
    table = torch.stack([torch.randperm(256, generator=g)[:width] for _ in range(batch)])
    lens = torch.randint(width // 2, width + 1, (batch,), generator=g)
    lens[0] = width
    return pool, layer, q, w, table, lens


def _torch_index_scores(pool, layer, q, w, table, lens, scale, low):
    """The scores `cpu_ops.index_topk_decode` (bf16) / `torch_ops.index_topk_decode` (fp32)
    rank, over keys gathered out of the pool."""
    b, width = table.shape
    dtype = torch.bfloat16 if low else torch.float32
    keys = pool.gather_index_k(layer, table.flatten(), dtype).view(b, width, -1)
    if low:
        logits = torch.bmm(q.to(dtype), keys.transpose(1, 2)).relu_().float()
        scores = torch.bmm((w * scale)[:, None, :], logits).squeeze(1)
    else:
        scores = torch_ops.index_logits(q, w, keys, scale)
    kpos = torch.arange(width)
    return scores.masked_fill(kpos[None, :] >= lens[:, None], float("-inf"))


@native
@pytest.mark.parametrize("low", [True, False], ids=["bf16", "fp32"])
def test_native_index_decode_matches_the_torch_scores_and_ignores_its_batch(tiny, low):
    """Scores over the stored fp8 keys read in place agree with the torch path's (gathered
    keys, batched GEMMs) to its rounding and pick the same top-k; -inf past each length;
    a request's scores are bit-equal alone or in a batch, at one thread or two."""
    pool, layer, q, w, table, lens = _index_case(tiny, 4, 150)
    scale, data, ps = 128**-0.5, pool.index_k_data(layer), pool.page_size
    got = cpu_native.index_decode(q, w, data, ps, table, lens, scale, low)
    want = _torch_index_scores(pool, layer, q, w, table, lens, scale, low)
    assert torch.equal(got.isinf(), want.isinf())
    finite = want.isfinite()
    # bf16: a logit whose fp32 sums (two summation orders) straddle a bf16 rounding point
    # moves by one bf16 ulp; fp32: plain rounding.
    tol = dict(rtol=1e-2, atol=1e-3) if low else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[finite], want[finite], **tol)
    if low:
        close = torch.isclose(got[finite], want[finite], rtol=1e-5, atol=1e-6)
        assert close.float().mean() > 0.99
    topk = 32
    assert torch.equal(
        cpu_native.topk_by_position(got, topk).sort().values,
        torch_ops.topk_by_position(want, topk).sort().values,
    )
    for _ in _one_and_two_threads():
        for r in range(4):
            alone = (q[r : r + 1], w[r : r + 1], data, ps, table[r : r + 1], lens[r : r + 1])
            assert torch.equal(cpu_native.index_decode(*alone, scale, low)[0], got[r])


@native
def test_native_topk_by_position_is_the_torch_one():
    """The same positions in the same order as `torch_ops.topk_by_position`, on rows full
    of ties (ReLU zeros, repeated values, ±0.0), -inf padding and NaN."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(-3, 4, (6, 300), generator=g).float().relu() * 0.25
    scores[1] = torch.randn(300, generator=g)
    scores[2, ::2] = -0.0
    scores[3, 100:] = float("-inf")
    scores[4, 7] = float("nan")
    for k in (1, 64, 256, 300):
        assert torch.equal(
            cpu_native.topk_by_position(scores, k), torch_ops.topk_by_position(scores, k)
        )
    with pytest.raises(ValueError, match="top-301"):
        cpu_native.topk_by_position(scores, 301)


@native
def test_native_index_decode_rejects_keys_outside_the_pool(tiny):
    """A slot within a request's length but past the buffer is an error, never a read;
    slots past the length are never read."""
    pool, layer, q, w, table, lens = _index_case(tiny, 2, 40)
    data, ps = pool.index_k_data(layer), pool.page_size
    table[1, lens[1] :] = 10**9  # padding: not read
    cpu_native.index_decode(q, w, data, ps, table, lens, 0.1, True)
    table[0, 3] = pool.num_pages * ps
    with pytest.raises(IndexError, match="outside the index-K buffer"):
        cpu_native.index_decode(q, w, data, ps, table, lens, 0.1, True)


# --- decode blocks ---------------------------------------------------------------------------


def _blocks_case(path: str, batch: int, seed: int):
    """The fp32 model at `path`, and for a decode step of `batch` tokens: inputs, RoPE
    tables at scattered positions, and attention outputs."""
    from dsakv.models.loader import load_model

    model, config, _ = load_model(path, draft_layers=1)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, config.hidden_size, generator=g)
    positions = torch.randint(0, config.max_position_embeddings, (batch,), generator=g)
    cos, sin = model.rotary(positions, torch.float32)
    heads, v = config.num_attention_heads, config.v_head_dim
    out = torch.randn(batch, heads, v, generator=g)
    return model, (x, cos, sin, out)


@native
@pytest.mark.parametrize("preset", ["glm-tiny", "deepseek-tiny"])
def test_native_blocks_match_the_torch_blocks_and_ignore_their_batch(preset, tmp_path):
    """Every layer's two blocks (dense and MoE FFNs, the MTP layer; DeepSeek's grouped
    router and YaRN RoPE; the indexers' projections, GLM's interleaved and DeepSeek's
    half-split RoPE) as native calls agree with the torch blocks to fp32 rounding; a
    token's outputs are bit-equal alone or in a batch, at one thread or two."""
    from dsakv.models.decoder import attention_inputs, residual_ffn

    path = str(write_tiny_model(tmp_path / preset, preset=preset, seed=3))
    model, (x, cos, sin, out) = _blocks_case(path, 5, seed=1)
    with torch.inference_mode():
        for layer in model.model.layers:
            inputs, ffn = layer.native_blocks()
            got, want = inputs(x, cos, sin), attention_inputs(layer, x, cos, sin)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b.reshape(a.shape), rtol=1e-5, atol=1e-5)
            indexer = getattr(layer.self_attn, "indexer", None)
            if indexer is not None:  # its projections: the key, the (un)rotated query
                _check_indexer_inputs(path, indexer, x, got[3], cos, sin)
            got_ffn = ffn(x, out.reshape(5, -1))
            torch.testing.assert_close(got_ffn, residual_ffn(layer, x, out), rtol=1e-5, atol=1e-5)
            for _ in _one_and_two_threads():
                for r in range(5):
                    one = inputs(x[r : r + 1], cos[r : r + 1], sin[r : r + 1])
                    assert all(torch.equal(a[0], b[r]) for a, b in zip(one, got))
                    one = ffn(x[r : r + 1], out[r : r + 1].reshape(1, -1))
                    assert torch.equal(one[0], got_ffn[r])


def _check_indexer_inputs(
    path: str, indexer, h, q_lora, cos, sin, kinds: tuple[str, ...] = ("fp8", "fp32")
) -> None:
    """The indexer's native key and query (rotated for an fp8 pool, plain otherwise) against
    `index_key` / `index_query`; a token's outputs bit-equal alone or in the batch."""
    from dsakv.models.indexer import index_key, index_query

    native = indexer.native_inputs()
    key = native.key(h, cos, sin)
    torch.testing.assert_close(key, index_key(indexer, h, cos, sin), rtol=1e-5, atol=1e-5)
    assert torch.equal(native.key(h[2:3], cos[2:3], sin[2:3])[0], key[2])
    for kind in kinds:
        pool = DSAKVPool(CacheLayout.for_model(path, index_k_dtype=kind), 1)
        got = native.query(h, q_lora, cos, sin, pool.rotates_index_q)
        want = index_query(indexer, h, q_lora, cos, sin, pool)
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
        one = native.query(h[2:3], q_lora[2:3], cos[2:3], sin[2:3], pool.rotates_index_q)
        assert all(torch.equal(x[0], y[2]) for x, y in zip(one, got))


@native
def test_an_index_head_of_no_power_of_two_runs_with_bf16_or_fp32_index_k(tmp_path):
    """A 96-value index head has no Hadamard matrix: the native key and plain query are
    still the torch ones, and bf16 / fp32 index-K generate past index_topk on the cpu and
    torch backends; fp8 index-K (which rotates) is one error, before the weights load."""
    from dsakv.errors import ConfigError
    from dsakv.models.loader import load_model
    from dsakv.models.tiny import TINY_PRESETS

    config = {**TINY_PRESETS["glm-tiny"], "index_head_dim": 96}
    path = str(write_tiny_model(tmp_path / "idx96", config, mtp="none"))
    model, _, _ = load_model(path)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, model.config.hidden_size, generator=g)
    cos, sin = model.rotary(torch.tensor([0, 3, 9, 40, 2]), torch.float32)
    with torch.inference_mode():
        layer = model.model.layers[0]
        q_lora = layer.native_blocks()[0](x, cos, sin)[3]
        _check_indexer_inputs(path, layer.self_attn.indexer, x, q_lora, cos, sin, ("bf16", "fp32"))
    bare = tmp_path / "config-only"  # no weights: the layout is refused before loading them
    bare.mkdir()
    (bare / "config.json").write_text((tmp_path / "idx96" / "config.json").read_text())
    with pytest.raises(ConfigError, match="power-of-two index_head_dim .* got 96"):
        LLM(str(bare), device="cpu", num_pages=8)  # fp8 index-K by default
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = list(range(3, 3 + 2 * config["index_topk"]))  # the indexer selects
    for kind in ("bf16", "fp32"):
        for backend in ("cpu", "torch"):
            llm = LLM(path, device="cpu", index_k_dtype=kind, attention_backend=backend)
            assert len(llm.generate([prompt], params)[0].token_ids) == 4


@native
@pytest.mark.parametrize("rope", [64, 7, 0])
def test_native_indexer_refuses_a_rope_part_its_head_cannot_hold(rope):
    """The kernels rope pairs of the head's first values: a rope part wider than the head
    (it overran the buffers: heap corruption), odd or empty is a ValueError."""
    hidden, q_lora, heads, dim = 16, 8, 2, 32
    wq_b, wk = torch.zeros(heads * dim, q_lora), torch.zeros(dim, hidden)
    norm = (torch.ones(dim), torch.zeros(dim))
    with pytest.raises(ValueError, match=f"an even rope part of 2..32 values, got {rope}"):
        cpu_native.IndexerInputs(
            wq_b, wk, *norm, torch.zeros(heads, hidden),
            heads=heads, rope=rope, interleave=True, eps=1e-6,
        )  # fmt: skip


@native
def test_native_blocks_run_the_steps_and_keep_the_greedy_tokens(tiny):
    """Through the engine: steps of a few tokens (decode, these short prefills) run every
    layer's native blocks, and greedy tokens and logprobs match the torch blocks' (fp32
    cache, index_topk covering the context, so only rounding differs)."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    prompts = [[5, 17, 33, 2, 99], [7, 7, 8, 120, 3, 64, 200], [250, 1, 2, 3, 4, 5, 6, 7, 8]]
    kw = dict(device="cpu", page_size=16, num_pages=24, max_model_len=64, kv_cache_dtype="fp32")
    fast, ref = LLM(tiny, **kw), LLM(tiny, **kw)
    ref.engine.backend.native = False  # as without a compiler: every op in torch
    for batch in (prompts[:1], prompts):
        got, want = fast.generate(batch, params), ref.generate(batch, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for a, b in zip(got, want, strict=True):
            lps = [flat_logprobs(o.outputs[0].logprobs, o.token_ids) for o in (a, b)]
            torch.testing.assert_close(*lps, rtol=0, atol=1e-5)
    model = fast.engine.runner.model
    assert all(layer.native_blocks() is not None for layer in model.model.layers)
    assert all(layer._native is False for layer in ref.engine.runner.model.model.layers)
    fast.engine.check_integrity()


@native
def test_native_blocks_take_only_fp32_weights(tmp_path, tiny):
    """A bfloat16 model has no native blocks (its torch blocks round where the reference
    does) and still decodes; a weight of the wrong dtype or shape is a clear error."""
    llm = LLM(tiny, device="cpu", dtype="bfloat16", page_size=16, num_pages=24, max_model_len=64)
    out = llm.generate([[5, 17, 33]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    assert all(layer.native_blocks() is None for layer in llm.engine.runner.model.model.layers)
    model, _ = _blocks_case(tiny, 1, seed=0)
    layer = model.model.layers[0]
    attn = layer.self_attn

    def inputs(kv_b: torch.Tensor) -> cpu_native.MlaInputs:
        return cpu_native.MlaInputs(
            layer.input_layernorm.weight,
            attn.q_a_proj.weight,
            attn.q_a_layernorm.weight,
            attn.q_b_proj.weight,
            attn.kv_a_proj_with_mqa.weight,
            attn.kv_a_layernorm.weight,
            kv_b,
            heads=attn.n_heads,
            nope=attn.nope,
            rope=attn.rope_dim,
            v=attn.v_dim,
            eps=(1e-6,) * 3,
        )

    inputs(attn.kv_b_proj.weight)
    with pytest.raises(ValueError, match="contiguous CPU weights"):
        inputs(attn.kv_b_proj.weight.half())
    with pytest.raises(ValueError, match="expected"):
        inputs(attn.kv_b_proj.weight[:-1])


# --- build -----------------------------------------------------------------------------------


def test_without_a_compiler_the_cpu_backend_keeps_its_torch_ops(tiny, tmp_path):
    """No C++ compiler (and nothing built before): one warning, the torch ops, and the same
    greedy tokens (index_topk covers the context, so only rounding could differ)."""
    code = f"""
import logging, sys
from dsakv import LLM, SamplingParams
logging.basicConfig(level=logging.WARNING)
llm = LLM({tiny!r}, device="cpu", page_size=16, num_pages=24, max_model_len=64)
assert not llm.engine.backend.native, "native kernels built without a compiler"
out = llm.generate([[5, 17, 33, 2, 99]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
print(out[0].token_ids)
"""
    env = {**os.environ, "CXX": "no-such-compiler", "DSAKV_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("native CPU kernels unavailable") == 1
    llm = LLM(tiny, device="cpu", page_size=16, num_pages=24, max_model_len=64)
    want = llm.generate(
        [[5, 17, 33, 2, 99]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    )
    assert done.stdout.strip() == str(want[0].token_ids)
    assert llm.engine.backend.native == cpu_native.available()


_DAMAGED_CACHE = """
import logging, os, shutil, sys
from pathlib import Path
import torch
from dsakv.kernels import cpu_native

tmp, good = Path(sys.argv[1]), sys.argv[2]
said = []
class Said(logging.Handler):
    def emit(self, record):
        said.append(record.getMessage())
logging.getLogger("dsakv.kernels.cpu_native").addHandler(Said())

def path(cache):
    os.environ["DSAKV_CACHE"] = str(cache)
    return cpu_native.library_path()

def builds():
    return (tmp / "builds").read_text().count("built") if (tmp / "builds").exists() else 0

def load(cache, copies=good):
    # The kernels from `cache`, as a new process loads them: (built?, how many builds, warnings).
    path(cache)
    (tmp / "source").write_text(copies)
    before, n = builds(), len(said)
    cpu_native._library.cache_clear()
    ok = cpu_native.available()
    if ok:
        x, w = torch.randn(3, 64), torch.rand(64) + 0.5
        want = torch.nn.functional.rms_norm(x, (64,), w, 1e-5)
        torch.testing.assert_close(cpu_native.rms_norm(x, w, 1e-5), want)
    return ok, builds() - before, " | ".join(said[n:])

(tmp / "bad.so").write_bytes(b"\\x7fELF not a library")
lib = path(tmp / "a")
ok, n, msg = load(tmp / "a", str(tmp / "bad.so"))  # built, does not load: the torch ops
assert not ok and n == 1 and f"{lib}, just built, does not load" in msg, msg
ok, n, msg = load(tmp / "a")  # cached whole, as built, but does not load
assert ok and n == 1 and f"{lib}: does not load" in msg and "rebuilding" in msg, msg
ok, n, msg = load(tmp / "a")  # whole and loads: no build, no warning
assert ok and n == 0 and not msg, msg
shutil.copytree(tmp / "a", tmp / "b")  # (a path dlopen has not seen)
lib = path(tmp / "b")
lib.write_bytes(lib.read_bytes()[:1000])  # truncated after its build
ok, n, msg = load(tmp / "b")
assert ok and n == 1 and f"{lib}: 1000 bytes" in msg, msg
assert lib.read_bytes() == Path(good).read_bytes()
lib = path(tmp / "c")
lib.parent.mkdir(parents=True)
lib.write_bytes(b"")  # empty, and nothing beside it
ok, n, msg = load(tmp / "c")
assert ok and n == 1 and str(lib) in msg, msg
print("ok")
"""


@native
def test_a_damaged_cached_library_is_rebuilt_not_loaded(tmp_path):
    """A cached library that is truncated (dlopen would map it and the process die of
    SIGBUS, no message), empty, or whole but not loadable is rebuilt once, with a warning
    naming it, and the kernels run; a whole one is loaded as it is. `$CXX` is a stand-in
    that copies a file where the compiler writes (this process's library, or one that
    does not load): a real build takes tens of seconds."""
    cxx = tmp_path / "cxx"
    cxx.write_text(
        f'#!/bin/sh\nwhile [ "$1" != -o ]; do shift; done\ncp "$(cat {tmp_path}/source)" "$2"\n'
        f"echo built >> {tmp_path}/builds\n"
    )
    cxx.chmod(0o755)
    good = cpu_native._library()._name
    done = subprocess.run(
        [sys.executable, "-c", _DAMAGED_CACHE, str(tmp_path), good],
        env={**os.environ, "CXX": str(cxx)},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", (
        done.returncode,
        done.stderr[-2000:],
    )


# --- what `--enable-deterministic-inference` rests on --------------------------------------


@native
@pytest.mark.parametrize("n, k", [(64, 128), (37, 83)], ids=["aligned", "ragged"])
def test_native_linear_rows_do_not_depend_on_their_batch(n, k):
    """The LM head's (and every block's) tiled GEMV: as close to fp64 as torch's GEMM, and a
    row's outputs are bit-equal alone, in any batch (tiles of 4 tokens, a remainder one at a
    time), at one thread or two."""
    g = torch.Generator().manual_seed(n)
    weight, x = torch.randn(n, k, generator=g), torch.randn(13, k, generator=g)
    whole = cpu_native.linear(x, weight)
    exact = x.double() @ weight.double().T
    assert (whole.double() - exact).abs().max() <= 2 * (x @ weight.T - exact).abs().max() + 1e-6
    for _ in _one_and_two_threads():
        for rows in ([5], [0, 5, 9], list(range(7)), [12, 3, 5, 1, 0]):
            assert torch.equal(cpu_native.linear(x[rows], weight), whole[rows])


@native
def test_native_rms_norm_is_torch_rms_norm_per_row():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(9, 128, generator=g), torch.rand(128, generator=g) + 0.5
    whole = cpu_native.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(whole, torch.nn.functional.rms_norm(x, (128,), w, 1e-5))
    for r in range(9):
        assert torch.equal(cpu_native.rms_norm(x[r : r + 1], w, 1e-5)[0], whole[r])


@native
@pytest.mark.parametrize("kind", ["fp8_ds_mla", "bf16"])
def test_native_decode_rows_sharing_a_context_equal_each_row_alone(tiny, kind):
    """An MTP verification's rows of one request read one context, each a position longer
    than the last: the kernel widens those rows once for all of them (a tile), and each
    output is the one it gets alone. Another request's rows (other slots) and padding that
    names real rows are mixed in, and ten rows of one request span two tiles."""
    args, _ = _decode_case(tiny, kind, 1, width=150)
    math, pool, layer, _, _, _, _, _, w_uv = args
    data, scale = pool.latent_data(layer), math.scale
    g = torch.Generator().manual_seed(7)
    lora, rope = pool.layout.kv_lora_rank, pool.layout.qk_rope_head_dim
    ctx = [torch.randperm(128, generator=g) for _ in range(2)]
    rows, lens = [], []
    shape = [(0, 120), (0, 121), (0, 122), (1, 90), (1, 91), *((0, 100 + i) for i in range(10))]
    for r, n in shape:  # (request, context length): three verify rows, two, then ten
        row = torch.full((150,), -1, dtype=torch.long)  # padding no pool row has
        row[:n] = torch.cat([ctx[r], ctx[r]])[:n]
        rows.append(row)
        lens.append(n)
    rows[2][122:] = 5  # padding naming a real row (invalid: never read)
    slots = torch.stack(rows)
    valid = torch.arange(150)[None, :] < torch.tensor(lens)[:, None]
    b = slots.shape[0]
    q_nope = torch.randn(b, 4, lora, generator=g)
    q_rope = torch.randn(b, 4, rope, generator=g)
    for w in (None, w_uv):
        for _ in _one_and_two_threads():
            whole = cpu_native.mla_decode(q_nope, q_rope, data, slots, valid, scale, kind, w)
            for r in range(b):
                one = cpu_native.mla_decode(
                    q_nope[r : r + 1], q_rope[r : r + 1], data, slots[r : r + 1],
                    valid[r : r + 1], scale, kind, w,
                )  # fmt: skip
                assert torch.equal(one[0], whole[r]), r


@native
def test_native_decode_ignores_padding_after_the_valid_rows(tiny):
    """Runs start every 128 rows from the first: a request whose valid rows come first gets
    the same output however far its batch pads the selection (a prefill token and the same
    token in decode read one selection at different widths)."""
    args, _ = _decode_case(tiny, "fp8_e4m3", 3, width=200)
    math, pool, layer, q_nope, q_rope, slots, valid, _, w_uv = args
    valid = torch.arange(200)[None, :] < torch.tensor([[200], [131], [40]])
    data = pool.latent_data(layer)
    got = cpu_native.mla_decode(q_nope, q_rope, data, slots, valid, 0.1, "fp8_e4m3", w_uv)
    for width in (300, 517):
        pad = width - 200
        wide_slots = torch.cat([slots, slots[:, :1].expand(-1, pad)], dim=1)
        wide_valid = torch.cat([valid, torch.zeros(3, pad, dtype=torch.bool)], dim=1)
        wide = cpu_native.mla_decode(
            q_nope, q_rope, data, wide_slots, wide_valid, 0.1, "fp8_e4m3", w_uv
        )
        assert torch.equal(wide, got)
    for r, n in enumerate((200, 131, 40)):  # and exactly as wide as its valid rows
        one = cpu_native.mla_decode(
            q_nope[r : r + 1], q_rope[r : r + 1], data, slots[r : r + 1, :n],
            valid[r : r + 1, :n], 0.1, "fp8_e4m3", w_uv,
        )  # fmt: skip
        assert torch.equal(one[0], got[r])


@native
@pytest.mark.parametrize("low", [True, False], ids=["bf16", "fp32"])
def test_native_index_decode_one_shared_table_and_row_keys(tiny, low):
    """A prefill chunk's queries read one context table (`table[W]`): the scores each query
    gets with its own copy of it. bf16 / fp32 index-K rows score as the torch path does."""
    pool, layer, q, w, table, lens = _index_case(tiny, 4, 150)
    scale, data, ps = 128**-0.5, pool.index_k_data(layer), pool.page_size
    shared = cpu_native.index_decode(q, w, data, ps, table[0], lens, scale, low)
    own = cpu_native.index_decode(q, w, data, ps, table[0].expand(4, -1), lens, scale, low)
    assert torch.equal(shared, own)
    for dtype in ("bf16", "fp32"):
        lay = _layout(tiny, index_k_dtype=dtype, page_size=16)
        rows = DSAKVPool(lay, 16)
        keys = torch.randn(256, lay.index_head_dim, generator=torch.Generator().manual_seed(2))
        rows.write_index_k(layer, torch.arange(256), keys)
        got = cpu_native.index_decode(
            q, w, rows.index_k_data(layer), 16, table, lens, scale, low and dtype == "bf16"
        )
        want = _torch_index_scores(rows, layer, q, w, table, lens, scale, low and dtype == "bf16")
        assert torch.equal(got.isinf(), want.isinf())
        tol = dict(rtol=1e-2, atol=1e-3) if low and dtype == "bf16" else {}
        torch.testing.assert_close(got[want.isfinite()], want[want.isfinite()], **tol)


@native
@pytest.mark.parametrize("tokens", [1, 7, 48])
def test_native_moe_ffn_gives_each_token_its_bits_alone_whoever_shares_its_experts(tokens):
    """`dsakv_ffn` runs each expert over every token that chose it at once (48 tokens over
    3 experts: a few dozen a side, past the 8 from which rows are read side by side). A
    token's output is bit-equal alone, in the batch and in the batch reversed (so other
    tokens share its experts), at one thread or two, and its bf16 matrices give the bits
    of their fp32 widening; all agree with `residual_ffn`'s torch math to fp32 rounding."""
    g = torch.Generator().manual_seed(11)
    hidden, inter, attn_dim, e, i = 40, 24, 33, 3, 20
    low = [
        (torch.randn(s, generator=g) * 0.2).bfloat16()
        for s in [(hidden, attn_dim), (inter, hidden), (inter, hidden), (hidden, inter),
                  (e, 2 * i, hidden), (e, hidden, i)]
    ]  # fmt: skip
    router, bias = torch.randn(e, hidden, generator=g), 0.1 * torch.randn(e, generator=g)
    post = 1 + 0.1 * torch.randn(hidden, generator=g)
    x, attn = torch.randn(tokens, hidden, generator=g), torch.randn(tokens, attn_dim, generator=g)
    outs = []
    for ms in (low, [m.float() for m in low]):
        o, gate, up, down, gate_up, edown = ms
        ffn = cpu_native.Ffn(
            o, post, 1e-6, (gate, up, down), (router, bias, gate_up, edown, 2, 1, 1, True, 2.5, 0)
        )
        for _ in _one_and_two_threads():
            whole = ffn(x, attn)
            assert torch.equal(ffn(x.flip(0), attn.flip(0)).flip(0), whole)
            for r in {0, tokens // 2, tokens - 1}:
                assert torch.equal(ffn(x[r : r + 1], attn[r : r + 1])[0], whole[r])
        x1 = x + ffn.o_proj(attn)  # (the calls a layer split over ranks makes, on one)
        assert torch.equal(x1 + ffn.part(ffn.norm(x1)), whole)
        outs.append(whole)
    assert torch.equal(outs[0], outs[1])
    # Split over two ranks as --tp splits it (o_proj by columns, every expert's and the
    # MLP's intermediate rows), and as --ep 2 does (whole experts: 0 and 1, then 2): the
    # parts sum to the whole.
    o, gate, up, down, gate_up, edown = low
    for ep in (False, True):
        parts, x1 = [], x.clone()
        for a, b, c in ((0, 16, 0), (16, attn_dim, 1)):
            r, ri, held = (
                slice(12 * c, 12 * c + 12),
                slice(10 * c, 10 * c + 10),
                slice(2 * c, 2 + c),
            )
            experts = (gate_up[held], edown[held], held.start)
            if not ep:
                gu = torch.cat([gate_up[:, ri], gate_up[:, i + ri.start : i + ri.stop]], dim=1)
                experts = (gu, edown[:, :, ri].contiguous(), 0)
            moe = (router, bias, *experts[:2], 2, 1, 1, True, 2.5, experts[2])
            mlp = (gate[r], up[r], down[:, r].contiguous())
            part = cpu_native.Ffn(o[:, a:b].contiguous(), post, 1e-6, mlp, moe)
            x1 += part.o_proj(attn[:, a:b])
            parts.append(part)
        h = parts[0].norm(x1)
        torch.testing.assert_close(x1 + parts[0].part(h) + parts[1].part(h), outs[0])
    # The torch math: o_proj and the residual, post-norm, sigmoid top-2 routing
    # (normalised, scaled), SiLU experts plus the shared MLP.
    o, gate, up, down, gate_up, edown = (m.float() for m in low)
    x1 = x + attn @ o.T
    h = x1 * torch.rsqrt(x1.pow(2).mean(-1, keepdim=True) + 1e-6) * post
    score = torch.sigmoid(h @ router.T)
    ids = torch.topk(score + bias, 2, dim=-1).indices
    w = score.gather(1, ids)
    w = w / w.sum(-1, keepdim=True) * 2.5
    want = x1 + (torch.nn.functional.silu(h @ gate.T) * (h @ up.T)) @ down.T
    for t in range(tokens):
        for j in range(2):
            gu = gate_up[ids[t, j]] @ h[t]
            act = torch.nn.functional.silu(gu[:i]) * gu[i:]
            want[t] += w[t, j] * (edown[ids[t, j]] @ act)
    torch.testing.assert_close(outs[0], want, rtol=1e-5, atol=1e-5)


@native
def test_native_blocks_read_bf16_matrices_as_their_fp32_widening_at_ragged_sizes():
    """Sizes off every vector width (the scalar tails of the dots, the token tiles and the
    absorbed query's 64-column blocks): each block with its matrices bf16 gives the bits it
    gives with the same matrices widened to fp32, alone and in a batch of 13 (past the 8
    from which bf16 rows are read four side by side, fp32 ones one at a time), and a
    token's outputs are the same alone as in that batch."""
    g = torch.Generator().manual_seed(7)

    def mats(*shapes):  # bf16 matrices, and the same values in fp32
        low = [(torch.randn(s, generator=g) * 0.2).bfloat16() for s in shapes]
        return low, [m.float() for m in low]

    def vec(n: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(n, generator=g)

    hidden, q_lora, heads, nope, rope, v, kv_lora, inter, e, i = 37, 23, 3, 19, 8, 11, 70, 21, 5, 13
    norms = (vec(hidden), vec(q_lora), vec(kv_lora))
    x = torch.randn(13, hidden, generator=g)
    cos, sin = torch.randn(13, rope // 2, generator=g), torch.randn(13, rope // 2, generator=g)
    attn = torch.randn(13, heads * v, generator=g)
    q = torch.randn(13, q_lora, generator=g)
    router, bias = torch.randn(e, hidden, generator=g), torch.randn(e, generator=g)
    post = vec(hidden)
    k_norm, weights_proj = (vec(64), vec(64) - 1), torch.randn(4, hidden, generator=g)
    shapes = [
        (q_lora, hidden),
        (heads * (nope + rope), q_lora),
        (kv_lora + rope, hidden),
        (heads * (nope + v), kv_lora),
        (hidden, heads * v),
        (inter, hidden),
        (inter, hidden),
        (hidden, inter),
        (e, 2 * i, hidden),
        (e, hidden, i),
        (4 * 64, q_lora),
        (64, hidden),
    ]
    outs = []
    for ms in mats(*shapes):
        q_a, q_b, kv_a, kv_b, o, gate, up, down, gate_up, edown, wq_b, wk = ms
        inputs = cpu_native.MlaInputs(
            norms[0], q_a, norms[1], q_b, kv_a, norms[2], kv_b,
            heads=heads, nope=nope, rope=rope, v=v, eps=(1e-6,) * 3,
        )  # fmt: skip
        moe = (router, bias, gate_up, edown, 2, 1, 1, True, 2.5, 0)
        ffn = cpu_native.Ffn(o, post, 1e-6, (gate, up, down), moe)
        index = cpu_native.IndexerInputs(
            wq_b, wk, *k_norm, weights_proj, heads=4, rope=rope, interleave=True, eps=1e-6,
        )  # fmt: skip
        out = [*inputs(x, cos, sin), ffn(x, attn), cpu_native.linear(x, kv_a)]
        out += [index.key(x, cos, sin)]
        out += [*index.query(x, q, cos, sin, True)]
        for r in (0, 8, 12):
            one = [*inputs(x[r : r + 1], cos[r : r + 1], sin[r : r + 1])]
            one += [ffn(x[r : r + 1], attn[r : r + 1]), cpu_native.linear(x[r : r + 1], kv_a)]
            assert all(torch.equal(a[0], b[r]) for a, b in zip(one, out))
            out += one
        outs.append(out)
    for n, (a, b) in enumerate(zip(*outs, strict=True)):
        assert torch.equal(a, b), n
