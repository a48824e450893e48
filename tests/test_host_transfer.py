"""HostPool and KV movement: bytes, bit-exact round trips, and a property-based machine that
drives allocate / write / move / backup / load / export / import / free against a plain
Python model of what every slot should hold."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dsakv.memory import (
    CacheLayout,
    DSAKVPool,
    HostPool,
    OutOfPages,
    PageAllocator,
    SharedLayerIndexKError,
    copy_tokens,
    dequantize_e4m3_blockwise,
    hadamard_rotate,
    page_slots,
    quantize_e4m3_blockwise,
)
from dsakv.memory.capacity import host_tier_pages
from tests.conftest import small_glm_config

PATTERN = "FFSSFS"
PS = 4


def small_layout(kv: str, ik: str) -> CacheLayout:
    return CacheLayout.for_model(
        small_glm_config(),
        kv_cache_dtype=kv,
        index_k_dtype=ik,
        page_size=PS,
        index_topk_pattern=PATTERN,
    )


def fill(pool: DSAKVPool, slots: torch.Tensor, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in range(pool.layout.num_layers):
        pool.write_latent(layer, slots, torch.randn(len(slots), 576, generator=g))
        if pool.has_index_k(layer):
            pool.write_index_k(layer, slots, torch.randn(len(slots), 128, generator=g))


def raw(pool: DSAKVPool, slots: torch.Tensor) -> list[torch.Tensor]:
    return [t.view(torch.uint8) for ts in pool.read_tokens(slots).values() for t in ts]


# --- deterministic -------------------------------------------------------------------------


def test_glm52_host_bytes_elided_vs_dense():
    layout = CacheLayout.for_model("glm-5.2")
    host = HostPool(DSAKVPool(layout, 1), 2)
    dense = HostPool(DSAKVPool(layout.dense(), 1), 2)
    assert host.nbytes == 2 * 64 * 47700 and dense.nbytes == 2 * 64 * 55224
    assert host.pool.device.type == "cpu" and not host.pool.pin_memory


def test_host_pages_and_a_bad_device_pool():
    dev = DSAKVPool(small_layout("fp32", "fp8"), 4)
    bpp = dev.layout.bytes_per_page
    assert host_tier_pages(3 * bpp / 2**30, None, bpp, 4) == 3
    assert host_tier_pages(0, 2.5, bpp, 4) == 10 and host_tier_pages(0, None, bpp, 4) == 0
    with pytest.raises(ValueError, match=f"hicache-size\\): 1e-09 GiB holds no {bpp}-byte page"):
        host_tier_pages(1e-9, None, bpp, 4)
    with pytest.raises(TypeError, match="backs a DSAKVPool, got CacheLayout"):
        HostPool(dev.layout, 2)


@pytest.mark.parametrize("kv,ik", [("fp32", "fp32"), ("fp8_e4m3", "fp8"), ("fp8_ds_mla", "bf16")])
def test_backup_load_round_trip_bit_exact(kv, ik):
    dev = DSAKVPool(small_layout(kv, ik), 4)
    host = HostPool(dev, 3)
    src = torch.tensor([1, 2, 3, 9, 10])  # 5 tokens over two device pages
    fill(dev, src, seed=1)
    hs = host.backup(src)
    assert len(hs) == 5 and host.num_free_pages == 1  # ceil(5 / 4) host pages
    assert host.bytes_copied == {"d2h": 5 * dev.layout.bytes_per_token, "h2d": 0}
    dst = torch.tensor([15, 4, 5, 6, 0])
    host.load(hs, dst)
    assert all(torch.equal(a, b) for a, b in zip(raw(dev, dst), raw(dev, src)))
    assert host.bytes_copied["h2d"] == 5 * dev.layout.bytes_per_token
    with pytest.raises(OutOfPages):
        host.backup(torch.arange(8))  # needs 2 pages, 1 free
    assert host.num_free_pages == 1
    host.free(hs)
    assert host.num_free_pages == 3
    host.allocator.check()


def test_host_tier_is_elided_too():
    dev = DSAKVPool(small_layout("fp32", "fp8"), 2)
    host = HostPool(dev, 2)
    with pytest.raises(SharedLayerIndexKError, match="layer 3"):
        host.pool.gather_index_k(3, torch.arange(2))
    comps = [(d.layer, d.component) for d in host.pool.transfer_descriptors()]
    assert [layer for layer, c in comps if c == "index_k"] == [0, 1, 4]


def test_under_hisparse_the_tier_moves_the_host_rows_or_index_k_only():
    """A HiSparse pool's tier carries each token's latent from and to its host rows; the tier
    of a TP rank whose host rows rank 0 writes (`writes=False`) holds and moves index-K
    only."""
    layout = small_layout("fp8_ds_mla", "fp8")
    dev = DSAKVPool(layout, 4, latent_pages=2)
    width = dev.latent_data(0).view(torch.uint8).shape[1]
    rows = {i: torch.randint(0, 256, (16, width), dtype=torch.uint8) for i in range(6)}
    dev.attach_host_latent(rows)
    src = torch.tensor([5, 6, 12])
    for layer in layout.index_k_layers:
        dev.write_index_k(layer, src, torch.randn(3, 128))
    host = HostPool(dev, 2)
    assert host.nbytes == 2 * PS * layout.bytes_per_token
    on_host = host.backup(src)
    before = raw(dev, src)
    for r in rows.values():
        r[src] = 0
    host.load(on_host, src)
    assert all(torch.equal(a, b) for a, b in zip(raw(dev, src), before))
    dev.attach_host_latent(rows, writes=False)
    ik = HostPool(dev, 2, index_k_only=True)
    assert ik.nbytes == 2 * PS * layout.index_k_bytes_per_token
    ik.backup(src)
    assert ik.bytes_copied["d2h"] == 3 * layout.index_k_bytes_per_token
    with pytest.raises(ValueError, match="moves index-K only"):
        ik.pool.read_tokens(torch.arange(2))


def test_copy_between_layouts_refused():
    dev = DSAKVPool(small_layout("fp32", "fp8"), 2)
    other = DSAKVPool(small_layout("fp32", "fp8").dense(), 2)
    host = HostPool(other, 2)
    host.device_pool = dev  # wiring bug: the tier must not silently mix layouts
    with pytest.raises(ValueError, match="different layouts"):
        host.backup(torch.arange(2))
    assert host.num_free_pages == 2  # failed backup allocated nothing


# --- property-based ------------------------------------------------------------------------


def expected(layout: CacheLayout, component: str, x: torch.Tensor) -> torch.Tensor:
    """What a gather must return for stored input `x` (written independently of the pool)."""
    dtype = layout.kv_cache_dtype if component == "latent" else layout.index_k_dtype
    if dtype == "fp32":
        return x
    if dtype == "bf16":
        return x.bfloat16().float()
    if dtype == "fp8_e4m3":
        return x.to(torch.float8_e4m3fn).float()
    if dtype == "fp8_ds_mla":
        nope = dequantize_e4m3_blockwise(*quantize_e4m3_blockwise(x[:, :512]))
        return torch.cat([nope, x[:, 512:].bfloat16().float()], 1)
    return dequantize_e4m3_blockwise(*quantize_e4m3_blockwise(hadamard_rotate(x)))  # fp8 index-K


class KVMachine(RuleBasedStateMachine):
    """Device pool + host tier + a peer pool (different page count); model = slot -> token."""

    layout: CacheLayout

    def __init__(self) -> None:
        super().__init__()
        self.dev = DSAKVPool(self.layout, 6)
        self.host = HostPool(self.dev, 4)
        self.peer = DSAKVPool(self.layout, 3)
        self.dev_alloc = PageAllocator(6, PS)
        self.peer_alloc = PageAllocator(3, PS)
        # live sequences: (pages, slots); model: (where, slot) -> token id
        self.seqs: dict[str, list[tuple[list[int], torch.Tensor]]] = {
            "dev": [],
            "host": [],
            "peer": [],
        }
        self.model: dict[tuple[str, int], int] = {}
        self.tokens: list[dict[tuple[str, int], torch.Tensor]] = []
        self.counter = 0

    # -- helpers

    def _pool(self, where: str) -> DSAKVPool:
        return {"dev": self.dev, "host": self.host.pool, "peer": self.peer}[where]

    def _alloc(self, where: str, n: int) -> tuple[list[int], torch.Tensor] | None:
        alloc = {"dev": self.dev_alloc, "peer": self.peer_alloc}[where]
        need = -(-n // PS)
        if need > alloc.num_free_pages:
            with pytest.raises(OutOfPages):
                alloc.alloc(need)
            return None
        pages = alloc.alloc(need)
        return pages, page_slots(pages, PS)[:n]

    def _copy_model(self, dst: str, dst_slots, src: str, src_slots) -> None:
        for d, s in zip(dst_slots.tolist(), src_slots.tolist()):
            self.model[(dst, d)] = self.model[(src, s)]

    def _pick(self, data, where: str) -> int:
        return data.draw(st.integers(0, len(self.seqs[where]) - 1))

    def _new_tokens(self, n: int) -> list[int]:
        ids = []
        g = torch.Generator().manual_seed(self.counter)
        self.counter += 1
        for _ in range(n):
            tok = {}
            for layer in range(self.layout.num_layers):
                tok[("latent", layer)] = torch.randn(1, 576, generator=g) * 3
                if self.layout.has_index_k(layer):
                    tok[("index_k", layer)] = torch.randn(1, 128, generator=g)
            self.tokens.append(tok)
            ids.append(len(self.tokens) - 1)
        return ids

    def _write(self, slots: torch.Tensor) -> None:
        ids = self._new_tokens(len(slots))
        for comp, layer in self.tokens[ids[0]]:
            x = torch.cat([self.tokens[i][(comp, layer)] for i in ids])
            write = self.dev.write_latent if comp == "latent" else self.dev.write_index_k
            write(layer, slots, x)
        for s, i in zip(slots.tolist(), ids):
            self.model[("dev", s)] = i

    # -- rules

    @rule(n=st.integers(1, 9))
    def allocate_and_write(self, n):
        got = self._alloc("dev", n)
        if got is not None:
            self._write(got[1])
            self.seqs["dev"].append(got)

    @precondition(lambda self: self.seqs["dev"])
    @rule(data=st.data())
    def overwrite_some(self, data):
        _, slots = self.seqs["dev"][self._pick(data, "dev")]
        idx = data.draw(st.lists(st.integers(0, len(slots) - 1), min_size=1, unique=True))
        self._write(slots[idx])

    @precondition(lambda self: self.seqs["dev"])
    @rule(data=st.data())
    def move(self, data):
        _, src = self.seqs["dev"][self._pick(data, "dev")]
        got = self._alloc("dev", len(src))
        if got is not None:
            self.dev.move(got[1], src)
            self._copy_model("dev", got[1], "dev", src)
            self.seqs["dev"].append(got)

    @precondition(lambda self: self.seqs["dev"])
    @rule(data=st.data())
    def move_within(self, data):
        """In-place permutation of a sequence's own slots (overlapping src and dst)."""
        _, slots = self.seqs["dev"][self._pick(data, "dev")]
        perm = data.draw(st.permutations(range(len(slots))))
        src = slots[list(perm)]
        before = {int(s): self.model[("dev", int(s))] for s in src}
        self.dev.move(slots, src)
        for d, s in zip(slots.tolist(), src.tolist()):
            self.model[("dev", d)] = before[s]

    @precondition(lambda self: self.seqs["dev"])
    @rule(data=st.data())
    def backup(self, data):
        _, src = self.seqs["dev"][self._pick(data, "dev")]
        free_before = self.host.num_free_pages
        d2h = self.host.bytes_copied["d2h"]
        if -(-len(src) // PS) > free_before:
            with pytest.raises(OutOfPages):
                self.host.backup(src)
            assert self.host.num_free_pages == free_before
            return
        hs = self.host.backup(src)
        assert self.host.bytes_copied["d2h"] - d2h == len(src) * self.layout.bytes_per_token
        self._copy_model("host", hs, "dev", src)
        self.seqs["host"].append((sorted({int(s) // PS for s in hs}), hs))

    @precondition(lambda self: self.seqs["host"])
    @rule(data=st.data())
    def load(self, data):
        _, hs = self.seqs["host"][self._pick(data, "host")]
        got = self._alloc("dev", len(hs))
        if got is not None:
            self.host.load(hs, got[1])
            self._copy_model("dev", got[1], "host", hs)
            self.seqs["dev"].append(got)

    @precondition(lambda self: self.seqs["dev"])
    @rule(data=st.data())
    def export_import(self, data):
        _, src = self.seqs["dev"][self._pick(data, "dev")]
        got = self._alloc("peer", len(src))
        if got is not None:
            copy_tokens(self.peer, got[1], self.dev, src)
            self._copy_model("peer", got[1], "dev", src)
            self.seqs["peer"].append(got)

    @precondition(lambda self: any(self.seqs.values()))
    @rule(data=st.data())
    def free(self, data):
        where = data.draw(st.sampled_from([w for w, s in self.seqs.items() if s]))
        pages, slots = self.seqs[where].pop(self._pick(data, where))
        if where == "host":
            self.host.free(slots)
        else:
            {"dev": self.dev_alloc, "peer": self.peer_alloc}[where].free(pages)
        for s in slots.tolist():
            del self.model[(where, s)]

    # -- invariants

    @invariant()
    def allocators_consistent(self):
        for where, alloc in (
            ("dev", self.dev_alloc),
            ("host", self.host.allocator),
            ("peer", self.peer_alloc),
        ):
            alloc.check()
            assert alloc.num_used_pages == sum(len(p) for p, _ in self.seqs[where])

    @invariant()
    def contents_match_model(self):
        for where, seqs in self.seqs.items():
            pool = self._pool(where)
            for _, slots in seqs:
                ids = [self.model[(where, s)] for s in slots.tolist()]
                for layer in range(self.layout.num_layers):
                    want = torch.cat([self.tokens[i][("latent", layer)] for i in ids])
                    got = pool.gather_latent(layer, slots)
                    assert torch.equal(got, expected(self.layout, "latent", want)), (where, layer)
                    if not self.layout.has_index_k(layer):
                        with pytest.raises(SharedLayerIndexKError):
                            pool.gather_index_k(layer, slots)
                        continue
                    want = torch.cat([self.tokens[i][("index_k", layer)] for i in ids])
                    got = pool.gather_index_k(layer, slots)
                    assert torch.equal(got, expected(self.layout, "index_k", want)), (where, layer)


def _machine(kv: str, ik: str) -> type[KVMachine]:
    cls = type(f"KVMachine_{kv}_{ik}", (KVMachine,), {"layout": small_layout(kv, ik)})
    cls.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
    return cls


TestKVFp32 = _machine("fp32", "fp32").TestCase
TestKVFp8 = _machine("fp8_e4m3", "fp8").TestCase
TestKVDsMla = _machine("fp8_ds_mla", "bf16").TestCase


def test_memory_bench_quick_is_json_and_elided_moves_fewer_bytes():
    import json

    from dsakv.bench.memory import run_memory_bench

    r = json.loads(json.dumps(run_memory_bench(quick=True, tokens=64, device="cpu")))
    assert r["elided"]["bytes_per_token"] == 47700 and r["dense"]["bytes_per_token"] == 55224
    assert r["elided"]["bytes_per_copy"] == 64 * 47700
    assert r["bytes_saved_per_copy"] == 64 * (55224 - 47700)
    for op in ("move", "backup", "load"):
        assert r["elided"][op]["gb_per_s"] > 0 and r["elided"][op]["tokens_per_s"] > 0
