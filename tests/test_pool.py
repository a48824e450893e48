"""DSAKVPool: byte counts, per-dtype round trips, shared-layer errors, moves and copies."""

from __future__ import annotations

import pytest
import torch

from dsakv.config import LayerPlan
from dsakv.errors import ConfigError
from dsakv.memory import (
    CacheLayout,
    DSAKVPool,
    SharedLayerIndexKError,
    allocation_failed,
    copy_tokens,
    page_slots,
)
from dsakv.memory.pool import _PageMajorFp8
from tests.conftest import small_glm_config

PATTERN = "FFSSFS"
DTYPES = [
    ("fp32", "fp32"),
    ("bf16", "bf16"),
    ("fp8_e4m3", "fp8"),
    ("fp8_ds_mla", "fp8"),
    ("fp32", "fp8"),
]


def small_layout(kv="fp32", ik="fp32", page_size=4, elide=True, **kw) -> CacheLayout:
    return CacheLayout.for_model(
        small_glm_config(),
        kv_cache_dtype=kv,
        index_k_dtype=ik,
        page_size=page_size,
        elide_index_k=elide,
        index_topk_pattern=PATTERN,
        **kw,
    )


# --- bytes ---------------------------------------------------------------------------------


def test_glm52_pool_bytes_elided_vs_dense():
    layout = CacheLayout.for_model("glm-5.2")
    pool, dense = DSAKVPool(layout, 2), DSAKVPool(layout.dense(), 2)
    assert pool.nbytes == 2 * 64 * 47700
    assert dense.nbytes == 2 * 64 * 55224
    descs = pool.transfer_descriptors()
    assert sum(d.nbytes for d in descs) == pool.nbytes
    assert sum(d.nbytes for d in dense.transfer_descriptors()) == dense.nbytes
    # one latent per layer, index-K only on the 21 full layers
    assert sum(d.component == "latent" for d in descs) == 78
    assert [d.layer for d in descs if d.component == "index_k"] == list(layout.plan.full_layers)
    assert all(d.bytes_per_page * 2 == d.nbytes for d in descs)
    ik = next(d for d in descs if d.component == "index_k")
    assert ik.bytes_per_page == 64 * 132


@pytest.mark.parametrize("kv,ik", DTYPES)
def test_nbytes_matches_layout(kv, ik):
    for layout in (small_layout(kv, ik), small_layout(kv, ik).dense()):
        pool = DSAKVPool(layout, 3)
        assert pool.nbytes == 3 * layout.page_size * layout.bytes_per_token
        assert pool.num_tokens == 12 and pool.page_size == 4 and pool.num_pages == 3


@pytest.mark.parametrize("kv,ik", DTYPES)
def test_a_partial_scale_block_costs_what_the_layout_says(kv, ik):
    """A latent rank or index-K width that is not a multiple of 128 still gets a scale for
    its last, partial block: the layout counted it, the pool allocated it and the L3 tier's
    raw pages round-trip (the layout's floor once left an fp8_ds_mla page 32 bytes short)."""
    layout = CacheLayout(LayerPlan(("full", "shared")), 192, 64, 64, kv, ik, page_size=4)
    pool = DSAKVPool(layout, 3)
    assert pool.nbytes == 3 * layout.bytes_per_page
    pool.write_latent(0, torch.arange(4), torch.randn(4, 256))
    pool.write_index_k(0, torch.arange(4), torch.randn(4, 64))
    pages = pool.read_pages([0])
    assert pages.shape == (1, layout.bytes_per_page)
    other = DSAKVPool(layout, 3)
    other.write_pages([2], pages)
    assert torch.equal(
        other.gather_latent(0, torch.arange(8, 12)), pool.gather_latent(0, torch.arange(4))
    )


def test_draft_layer_owns_index_k():
    layout = small_layout(draft_layers=1)
    pool = DSAKVPool(layout, 1)
    assert layout.num_layers == 7 and pool.has_index_k(6)
    pool.write_index_k(6, torch.arange(2), torch.ones(2, 128))


# --- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("kv,ik", DTYPES)
def test_round_trip_per_dtype(kv, ik):
    torch.manual_seed(0)
    pool = DSAKVPool(small_layout(kv, ik), 4)
    slots = torch.tensor([13, 0, 5, 7, 2])
    lat, keys = torch.randn(5, 576), torch.randn(5, 128)
    pool.write_latent(1, slots, lat)
    pool.write_index_k(1, slots, keys)
    got_lat, got_k = pool.gather_latent(1, slots), pool.gather_index_k(1, slots)
    ref_k = pool.prepare_index_q(keys)
    tol = {"fp32": 0, "bf16": 2**-8, "fp8_e4m3": 2**-3, "fp8_ds_mla": 2**-3, "fp8": 2**-3}
    lat_tol, k_tol = tol[kv], tol[ik]
    assert torch.allclose(got_lat, lat, rtol=lat_tol, atol=lat_tol * 0.02 + 1e-6)
    assert torch.allclose(got_k, ref_k, rtol=k_tol, atol=k_tol * 0.05 + 1e-6)
    assert got_lat.dtype == torch.float32
    assert pool.gather_latent(1, slots, torch.bfloat16).dtype == torch.bfloat16
    # other layers untouched
    assert pool.gather_latent(0, slots).abs().sum() == 0


def test_ds_mla_rope_kept_in_bf16():
    pool = DSAKVPool(small_layout("fp8_ds_mla", "fp8"), 1)
    x = torch.randn(3, 576)
    pool.write_latent(0, torch.arange(3), x)
    got = pool.gather_latent(0, torch.arange(3))
    assert torch.equal(got[:, 512:], x[:, 512:].bfloat16().float())


def test_prepare_index_q_rotates_only_for_fp8():
    q = torch.randn(3, 2, 128)
    assert DSAKVPool(small_layout("fp32", "fp32"), 1).prepare_index_q(q) is q
    rq = DSAKVPool(small_layout("fp32", "fp8"), 1).prepare_index_q(q)
    assert rq.shape == q.shape and not torch.allclose(rq, q)
    k = torch.randn(5, 128)
    pool = DSAKVPool(small_layout("fp32", "fp8"), 2)
    pool.write_index_k(0, torch.arange(5), k)
    # rotation is orthogonal: rotated q · stored k ≈ q · k
    scores = torch.einsum("thd,sd->ths", rq, pool.gather_index_k(0, torch.arange(5)))
    assert torch.allclose(scores, torch.einsum("thd,sd->ths", q, k), rtol=0.1, atol=1.0)


def test_fp8_index_k_is_page_major():
    """All key bytes of a page come first, then its scales (DeepGEMM-style paging)."""
    layout = small_layout("fp32", "fp8", page_size=4)
    pool = DSAKVPool(layout, 2)
    buf = pool._index_k[0]
    assert isinstance(buf, _PageMajorFp8)
    assert buf.data.shape == (2, 4 * (128 + 4)) and buf.data.dtype == torch.uint8
    k = torch.zeros(1, 128)
    k[0, 0] = 1.0  # rotated: every entry ±1/√128 -> scale 2^ceil(log2(0.0884/448)) = 2^-12
    pool.write_index_k(0, torch.tensor([6]), k)  # page 1, offset 2
    row = buf.data[1]
    assert row[: 2 * 128].eq(0).all() and row[3 * 128 : 4 * 128].eq(0).all()
    assert row[2 * 128 : 3 * 128].ne(0).all()
    scale = row[4 * 128 + 2 * 4 : 4 * 128 + 3 * 4].view(torch.float32)
    assert scale.item() == 2.0**-12
    assert buf.data[0].eq(0).all()


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("layer", [2, 3, 5])
def test_shared_layer_index_k_raises(layer):
    pool = DSAKVPool(small_layout(), 1)
    s = torch.arange(2)
    with pytest.raises(SharedLayerIndexKError, match=rf"layer {layer}.*shared.*elided"):
        pool.gather_index_k(layer, s)
    with pytest.raises(SharedLayerIndexKError, match=rf"layer {layer}"):
        pool.write_index_k(layer, s, torch.zeros(2, 128))
    assert not pool.has_index_k(layer)
    # the dense layout has index-K everywhere
    DSAKVPool(small_layout(elide=False), 1).gather_index_k(layer, s)


def test_out_of_range_slots_and_layers_raise():
    pool = DSAKVPool(small_layout(), 2)  # 8 tokens
    with pytest.raises(IndexError, match="slot 8"):
        pool.gather_latent(0, torch.tensor([0, 8]))
    with pytest.raises(IndexError, match="slot -1"):
        pool.write_latent(0, torch.tensor([-1]), torch.zeros(1, 576))
    with pytest.raises(IndexError, match="layer 6"):
        pool.gather_latent(6, torch.tensor([0]))
    with pytest.raises(IndexError, match="slot 9"):
        pool.move(torch.tensor([0]), torch.tensor([9]))
    with pytest.raises(ValueError, match=r"\[2, 576\]"):
        pool.write_latent(0, torch.tensor([0, 1]), torch.zeros(2, 512))
    with pytest.raises(TypeError):
        pool.gather_latent(0, torch.tensor([0.0]))


@pytest.mark.parametrize("layer", [-1, 6, 200])
def test_a_dense_layout_refuses_a_layer_it_does_not_have(layer):
    for elide in (True, False):
        with pytest.raises(IndexError, match=rf"layer {layer} out of range 0\.\.5"):
            small_layout(elide=elide).has_index_k(layer)


@pytest.mark.parametrize("page", [-1, 2])
def test_a_page_out_of_range_is_refused_and_nothing_written(page):
    pool = DSAKVPool(small_layout(), 2)
    before = pool.read_pages([0, 1])
    row = torch.full((1, pool.layout.bytes_per_page), 7, dtype=torch.uint8)
    with pytest.raises(IndexError, match=rf"page {page} out of range 0\.\.1"):
        pool.write_pages([page], row)
    with pytest.raises(IndexError, match=rf"page {page} out of range 0\.\.1"):
        pool.read_pages([0, page])
    assert torch.equal(pool.read_pages([0, 1]), before)


def test_the_constructor_and_copy_tokens_refuse_bad_arguments():
    layout = small_layout()
    with pytest.raises(TypeError, match="layout must be a CacheLayout.*got str"):
        DSAKVPool("glm-5.2", 2)
    for bad in (2.0, True):
        with pytest.raises(TypeError, match="num_pages must be an int"):
            DSAKVPool(layout, bad)
    with pytest.raises(ValueError, match=r"latent_pages must be in 0\.\.num_pages \(2\)"):
        DSAKVPool(layout, 2, latent_pages=3)
    assert not DSAKVPool(layout, 2, latent_pages=2).split_latent
    pool, s = DSAKVPool(layout, 2), torch.arange(4)
    with pytest.raises(TypeError, match="between DSAKVPools, got str <- DSAKVPool"):
        copy_tokens("pool", s, pool, s)
    with pytest.raises(TypeError, match="got DSAKVPool <- str"):
        copy_tokens(pool, s, "pool", s)


# --- moves and copies ----------------------------------------------------------------------


@pytest.mark.parametrize("kv,ik", [("fp32", "fp32"), ("fp8_ds_mla", "fp8")])
def test_move_is_per_token_and_bit_exact(kv, ik):
    pool = DSAKVPool(small_layout(kv, ik), 4)
    src, dst = torch.tensor([1, 2, 5]), torch.tensor([14, 8, 3])  # straddles pages
    for layer in range(6):
        pool.write_latent(layer, src, torch.randn(3, 576))
        if pool.has_index_k(layer):
            pool.write_index_k(layer, src, torch.randn(3, 128))
    before = _snapshot(pool, src)
    pool.move(dst, src)
    assert _equal(_snapshot(pool, dst), before)
    assert _equal(_snapshot(pool, src), before)  # source intact
    # neighbours of dst on the same page are untouched
    assert pool.gather_latent(0, torch.tensor([12, 13, 15])).abs().sum() == 0


def test_copy_between_pools_is_bit_exact_across_page_counts():
    layout = small_layout("fp8_e4m3", "fp8")
    a, b = DSAKVPool(layout, 2), DSAKVPool(layout, 5)
    src = page_slots([1], 4)[:3]
    for layer in range(6):
        a.write_latent(layer, src, torch.randn(3, 576))
        if a.has_index_k(layer):
            a.write_index_k(layer, src, torch.randn(3, 128))
    stored = a.read_tokens(src)
    assert not any(k.startswith("index_k.2") for k in stored)  # layer 2 shares: no index-K
    assert all(t.device.type == "cpu" for ts in stored.values() for t in ts)
    dst = torch.tensor([17, 4, 11])
    assert copy_tokens(b, dst, a, src) == 3 * layout.bytes_per_token
    assert _equal(_snapshot(b, dst), _snapshot(a, src))


def test_copy_refuses_other_layouts_and_counts():
    layout = small_layout("fp32", "fp8")
    src = DSAKVPool(layout, 1)
    shared_none = CacheLayout.for_model(
        small_glm_config(), kv_cache_dtype="fp32", page_size=4, no_index_share=True
    )
    others = [
        shared_none,
        layout.dense(),
        small_layout("fp32", "bf16"),
        small_layout("fp32", "fp8", page_size=8),
    ]
    for other in others:
        with pytest.raises(ValueError, match="pools of different layouts"):
            copy_tokens(DSAKVPool(other, 1), torch.arange(2), src, torch.arange(2))
    with pytest.raises(ValueError, match="3 destination slots for 2 source slots"):
        copy_tokens(DSAKVPool(layout, 1), torch.arange(3), src, torch.arange(2))


@pytest.mark.parametrize("kv", ["fp32", "fp8_ds_mla"])
def test_a_hisparse_pools_moves_carry_its_host_latent(kv):
    """Under HiSparse a logical token's latent is its host row (`attach_host_latent`), its
    index-K in the pool: token and page moves between it and a dense pool of the layout (the
    host tier's, L3's bytes) carry whole tokens, byte for byte, and the device latent slots
    are never read or written; a rank that does not move the rows copies index-K only."""
    layout = small_layout(kv, "fp8")
    hs = DSAKVPool(layout, 4, latent_pages=2)  # 16 logical slots, 8 device latent slots
    width = hs.latent_data(0).view(torch.uint8).shape[1]
    rows = {i: torch.randint(0, 256, (16, width), dtype=torch.uint8) for i in range(6)}
    device_latent = [hs.latent_data(i).clone() for i in range(6)]
    with pytest.raises(ValueError, match="no host latent is attached"):
        hs.read_tokens(torch.arange(2))
    hs.attach_host_latent(rows)
    src = torch.tensor([13, 2, 7])
    for layer in hs.layout.index_k_layers:
        hs.write_index_k(layer, src, torch.randn(3, 128))
    dense = DSAKVPool(layout, 3)
    dst = torch.tensor([0, 9, 4])
    assert copy_tokens(dense, dst, hs, src) == 3 * layout.bytes_per_token
    got = dense.read_tokens(dst)
    assert _equal(_snapshot(dense, dst), _snapshot(hs, src))
    for layer in range(6):
        assert torch.equal(got[f"latent.{layer}"][0], rows[layer][src])
    # back into other logical slots; pages as L3 stores them, both ways
    back = torch.tensor([1, 5, 15])
    copy_tokens(hs, back, dense, dst)
    assert _equal(_snapshot(hs, back), _snapshot(hs, src))
    page = hs.read_pages([3])
    assert page.shape == (1, layout.bytes_per_page)
    dense.write_pages([2], page)
    hs.write_pages([0], dense.read_pages([2]))
    assert _equal(_snapshot(hs, page_slots([0], 4)), _snapshot(hs, page_slots([3], 4)))
    assert all(torch.equal(hs.latent_data(i), d) for i, d in enumerate(device_latent))
    # writes=False: index-K only (another rank writes the rows)
    hs.attach_host_latent(rows, writes=False)
    before = [r.clone() for r in rows.values()]
    ik = layout.index_k_bytes_per_token
    assert copy_tokens(hs, torch.tensor([3, 6]), dense, dst[:2]) == 2 * ik
    assert all(torch.equal(r, b) for r, b in zip(rows.values(), before, strict=True))
    assert hs.page_bytes(index_k_only=True) == 4 * ik
    with pytest.raises(ValueError, match="moves index-K only"):  # (never a short page)
        hs.read_pages([0])


# --- helpers -------------------------------------------------------------------------------


def _snapshot(pool: DSAKVPool, slots: torch.Tensor) -> list[torch.Tensor]:
    """Raw stored bytes of every buffer at `slots` (what must survive copies exactly)."""
    return [t for ts in pool.read_tokens(slots).values() for t in ts]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for x, y in zip(a, b)
    )


def test_a_pool_too_large_to_allocate_names_its_whole_size():
    """The error named the first buffer that failed (one layer's latent), not the pool."""
    layout = CacheLayout.for_model("glm-5.2", page_size=64)
    pages = 10**8  # about 280 TiB: refused by the allocator at once
    need = pages * 64 * layout.bytes_per_token / 2**30
    with pytest.raises(ConfigError, match=f"cannot allocate {need:.2f} GiB of KV cache"):
        DSAKVPool(layout, pages)


@pytest.mark.parametrize(
    "error, failed",
    [
        (MemoryError(), True),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (
            RuntimeError(
                "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"
            ),
            True,
        ),
        (RuntimeError("CUDA error: out of memory"), True),  # a pinned host buffer
        (RuntimeError("Cannot access accelerator device when none is available."), False),
        (ValueError("out of memory"), False),
    ],
)
def test_allocation_failed_tells_no_memory_from_other_errors(error, failed):
    assert allocation_failed(error) is failed


def test_an_error_other_than_no_memory_is_not_reported_as_one(monkeypatch):
    """Only a failed allocation becomes the "ask for a smaller pool" error; any other
    RuntimeError from the allocation (a device that is not there) stays itself."""
    layout = CacheLayout.for_model("glm-5.2", page_size=64)

    def zeros(*args, **kwargs):
        raise RuntimeError("Cannot access accelerator device when none is available.")

    monkeypatch.setattr(torch, "zeros", zeros)
    with pytest.raises(RuntimeError, match="accelerator device"):
        DSAKVPool(layout, 4)


def test_a_pinned_host_tier_locks_its_own_bytes_and_gives_them_back(monkeypatch):
    """torch's pinned allocator rounds each block up to a power of two, so a GLM-5.2 host
    tier of 100 GiB (per-layer blocks) locked 161 GiB. A pinned pool now registers its own
    pages with CUDA: each buffer's bytes rounded to whole OS pages, no page registered twice
    (CUDA refuses an overlap), all unregistered when the pool goes. CUDA's two calls are
    stood in for by a ledger that refuses what CUDA refuses."""
    import gc

    from dsakv.memory import HostPool

    class Ledger:
        def __init__(self) -> None:
            self.locked: dict[int, int] = {}

        def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
            if ptr % 4096 or size % 4096:
                return 1  # (CUDA would lock the whole pages around it: a neighbour's too)
            if any(p < ptr + size and ptr < p + n for p, n in self.locked.items()):
                return 712  # cudaErrorHostMemoryAlreadyRegistered
            self.locked[ptr] = size
            return 0

        def cudaHostUnregister(self, ptr: int) -> int:
            return 0 if self.locked.pop(ptr, None) is not None else 713

    ledger = Ledger()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: ledger)
    device = DSAKVPool(small_layout("fp8_ds_mla", "fp8"), 4)
    host = HostPool(device, 3, pin_memory=True)
    buffers = [b.data for _, _, b in host.pool._buffers()]
    assert len(ledger.locked) == len(buffers) > 0
    for b in buffers:
        nbytes = b.numel() * b.element_size()
        assert ledger.locked[b.data_ptr()] == -(-nbytes // 4096) * 4096
        assert not b.any()  # zeroed, as an unpinned pool is
    del host, buffers, b
    gc.collect()
    assert ledger.locked == {}
