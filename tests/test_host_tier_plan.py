"""The host KV tier in the capacity plan (`dsakv plan --host-pool-gib / --host-pool-ratio`)
and the engine's check of a node's host memory, tiers and HiSparse host latents together.

The tier's cells are the device pool's, so shared layers hold no index-K there either: a
tier of a given size holds as many more tokens with elision as a device budget does. The
plan sizes the tier as the engine does; the tests hold one to the other on a tiny model.
"""

from __future__ import annotations

import json

import pytest

from dsakv.cli import main
from dsakv.engine import Engine, EngineConfig
from dsakv.errors import ConfigError
from dsakv.memory import CacheLayout

from .conftest import cli_error_line

GIB = 1 << 30
FP32 = ["--kv-cache-dtype", "fp32", "--index-k-dtype", "fp32", "--page-size", "8"]


def _plan(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_tier_of_a_size_holds_more_elided_tokens(capsys):
    """GLM-5.2's host tier of 100 GiB holds 100 GiB of 47,700-byte cells elided, of
    55,224-byte ones dense: the device pool's per-token saving, on the host."""
    r = _plan(capsys, "glm-5.2", "--host-pool-gib", "100")["host_tier"]
    page = 64
    for layout, cell in (("dense", 55_224), ("elided", 47_700)):
        t = r[layout]
        assert t["bytes_per_token"] == cell
        assert t["num_pages"] == 100 * GIB // (cell * page)
        assert t["tokens"] == t["num_pages"] * page
        assert 100 * GIB - cell * page < t["bytes_per_rank"] <= 100 * GIB
        assert t["host_memory_bytes_per_node"] == t["bytes_per_rank"]
    assert r["elided"]["tokens"] / r["dense"]["tokens"] > 1.15


def test_sglang_flags_size_the_planned_tier(capsys):
    """SGLang's `--enable-hierarchical-cache` is a tier of twice the pool's pages, its
    `--hicache-size G` G × 10⁹ bytes per rank; either size without the switch is ignored."""
    base = ["glm-5.2", "--kv-budget-gib", "10"]
    r = _plan(capsys, *base, "--enable-hierarchical-cache")
    pool = r["max_total_num_tokens"] // r["page_size"]
    assert r["host_tier"]["host_pool_ratio"] == 2.0
    assert r["host_tier"]["elided"]["num_pages"] == 2 * pool
    r = _plan(capsys, *base, "--enable-hierarchical-cache", "--hicache-size", "100")
    assert r["host_tier"]["host_pool_gib"] == pytest.approx(100e9 / GIB)
    assert "host_tier" not in _plan(capsys, *base, "--hicache-ratio", "4")


@pytest.mark.parametrize(
    "flags, ranks",
    [(["--tp", "8"], 8), (["--tp", "8", "--nnodes", "2"], 4), (["--tp", "8", "--dp-attention"], 8)],
)
def test_host_memory_per_node_is_its_ranks_tiers(flags, ranks, capsys):
    """Every rank holds a tier of its own (a replica under TP): a node's host memory is
    its ranks' tiers."""
    r = _plan(capsys, "glm-5.2", "--host-pool-gib", "10", *flags)["host_tier"]["elided"]
    assert r["index_k_only_bytes_per_rank"] is None
    assert r["host_memory_bytes_per_node"] == ranks * r["bytes_per_rank"]


@pytest.mark.parametrize("dp_attention", [False, True])
def test_hisparse_tiers_and_host_latents_per_node(dp_attention, capsys):
    """Under HiSparse with TP on one machine the ranks map rank 0's host latent and only
    rank 0's tier holds latent (the others' index-K only); under DP attention each rank
    holds a tier and a host latent of its own. The tier's pages are logical pages."""
    flags = ["glm-5.2", "--tp", "8", "--enable-hisparse", "--host-pool-ratio", "1.5"]
    r = _plan(capsys, *flags, *["--dp-attention"] * dp_attention)
    for layout in ("dense", "elided"):
        t, latent = r["host_tier"][layout], r["hisparse"][layout]
        assert t["tokens"] == int(latent["logical_tokens"] // 64 * 1.5) * 64
        full = t["tokens"] * t["bytes_per_token"]
        assert t["bytes_per_rank"] == full
        if dp_attention:
            assert t["index_k_only_bytes_per_rank"] is None
            assert t["host_memory_bytes_per_node"] == 8 * (full + latent["host_bytes"])
        else:
            index_k = t["tokens"] * (t["bytes_per_token"] - latent["host_bytes_per_token"])
            assert t["index_k_only_bytes_per_rank"] == index_k
            want = full + 7 * index_k + latent["host_bytes"]
            assert t["host_memory_bytes_per_node"] == want
    # (index-K a token: on full layers only when elided, 2,772 bytes vs 10,296)
    index_k = [r["host_tier"][k]["bytes_per_token"] - r["hisparse"][k]["host_bytes_per_token"]
               for k in ("dense", "elided")]  # fmt: skip
    assert index_k == [10_296, 2_772]


def test_pipeline_stages_size_the_tier_by_the_largest_page(capsys):
    """Under --pp-size every rank's tier has the same pages (rank 0's journal moves pages
    every stage holds), as many as the largest page of any stage fits in the size asked;
    each stage's tier holds its own cells."""
    r = _plan(capsys, "glm-5.2", "--tp", "2", "--pp-size", "4", "--host-pool-gib", "10")
    t = r["host_tier"]["elided"]
    per_page = [s["bytes_per_token"] * 64 for s in r["stages"]]
    assert t["num_pages"] == 10 * GIB // max(per_page)
    assert t["stages_bytes_per_rank"] == [t["num_pages"] * b for b in per_page]
    assert t["host_memory_bytes_per_node"] == 2 * sum(t["stages_bytes_per_rank"])


@pytest.mark.parametrize(
    "args, words",
    [
        (["--host-pool-gib", "1", "--host-pool-ratio", "2"], "both size the host tier"),
        (["--host-pool-gib", "1e-9"], "the host tier (--host-pool-gib, --swap-space or"),
        (["--host-pool-ratio", "1e-9"], "--hicache-ratio): 1e-09 times the 35172-page pool"),
        (["--swap-space", "1e-9"], "SGLang's --hicache-size): 1e-09 GiB holds no"),
        (["--host-pool-gib", "0.00307", "--no-elide-index-k"], "holds no 3534336-byte page"),
        (["--enable-hierarchical-cache", "--host-pool-ratio", "2"], "both size the host KV"),
    ],
)
def test_bad_tier_sizes_are_one_error_line(args, words, capsys):
    err = cli_error_line(["plan", "glm-5.2", *args], capsys)
    assert words in err, err


def test_a_size_that_holds_only_an_elided_page_plans_an_empty_dense_tier(capsys):
    """0.00307 GiB holds one 3,052,800-byte elided page and no 3,534,336-byte dense one:
    the engine builds the elided tier, so the plan does; the dense column is empty."""
    r = _plan(capsys, "glm-5.2", "--host-pool-gib", "0.00307")["host_tier"]
    assert (r["elided"]["num_pages"], r["dense"]["num_pages"]) == (1, 0)
    assert main(["plan", "glm-5.2", "--host-pool-gib", "0.00307"]) == 0
    assert "n/a" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, kw",
    [
        (["--host-pool-gib", "0.01"], dict(host_pool_gib=0.01)),
        (["--host-pool-ratio", "1.5"], dict(host_pool_ratio=1.5)),
        (
            ["--host-pool-ratio", "2", "--enable-hisparse", "--no-elide-index-k"],
            dict(host_pool_ratio=2, enable_hisparse=True, elide_index_k=False),
        ),
    ],
    ids=["gib", "ratio", "hisparse-dense"],
)
def test_the_plan_is_the_tier_the_engine_builds(glm_tiny, flags, kw, capsys):
    """`dsakv plan DIR` gives the pages and bytes of the tier the engine builds from the
    same flags (the plan of the layout asked for: elided, or dense)."""
    budget = 0.002
    r = _plan(capsys, glm_tiny, *FP32, "--kv-budget-gib", str(budget), *flags)
    t = r["host_tier"]["dense" if "--no-elide-index-k" in flags else "elided"]
    config = dict(kv_cache_dtype="fp32", index_k_dtype="fp32", page_size=8, device="cpu")
    e = Engine(EngineConfig(model=glm_tiny, **config, kv_budget_gib=budget, **kw))
    try:
        assert (e.host.num_pages, e.host.nbytes) == (t["num_pages"], t["bytes_per_rank"])
        latent = e.hot.host_nbytes if e.hot is not None else 0
        assert e.host.nbytes + latent == t["host_memory_bytes_per_node"]
    finally:
        e.close()


def test_the_engine_refuses_a_tier_and_host_latent_that_fit_only_apart(glm_tiny, monkeypatch):
    """Each alone fits the machine's memory; together they do not: one error before
    either is allocated, naming both, the flag that sized the tier and what else to ask."""
    import dsakv.memory.pool as pool

    layout = CacheLayout.for_model(glm_tiny, "fp32", "fp32", 8)
    latent = 40 * 8 * layout.latent_bytes_per_token  # 20 device pages × ratio 2
    tier = 40 * 8 * layout.bytes_per_token
    monkeypatch.setattr(pool, "memory_bytes", lambda device: max(latent, tier) + 1)
    config = dict(kv_cache_dtype="fp32", index_k_dtype="fp32", page_size=8, device="cpu")
    with pytest.raises(ConfigError) as e:
        hs = dict(enable_hisparse=True, hisparse_config={"host_to_device_ratio": 2})
        Engine(EngineConfig(model=glm_tiny, **config, num_pages=20, **hs, host_pool_ratio=1))
    msg = str(e.value)
    assert f"cannot allocate {(latent + tier) / GIB:.2f} GiB of host KV tier and HiSparse" in msg
    assert "ask for a smaller host tier (--host-pool-ratio" in msg
    assert ", or fewer logical tokens (a smaller pool" in msg


def test_every_rank_refuses_from_each_nodes_own_memory(glm_tiny, monkeypatch):
    """A rank whose machine has room still refuses where another node's has none (the
    ranks gather each one's bytes and memory): no rank goes on to wait for the others."""
    from dsakv.config.parallel import ParallelConfig
    from dsakv.distributed import ParallelState

    layout = CacheLayout.for_model(glm_tiny, "fp32", "fp32", 8)
    tier = 40 * 8 * layout.bytes_per_token
    small = [(tier, tier * 100), (tier, tier // 2)]  # (node 0 roomy, node 1 not)
    monkeypatch.setattr(ParallelState, "all_gather_objects", lambda self, obj: small)
    monkeypatch.setattr(ParallelConfig, "ranks_per_node", property(lambda self: 1))
    config = dict(kv_cache_dtype="fp32", index_k_dtype="fp32", page_size=8, device="cpu")
    with pytest.raises(ConfigError, match=r"GiB of host KV tier on the host, which has"):
        Engine(EngineConfig(model=glm_tiny, **config, num_pages=20, host_pool_ratio=2))


@pytest.mark.parametrize(
    "kw, what, ask",
    [
        (dict(host_pool_ratio=2), "host KV tier", "a smaller host tier (--host-pool-ratio"),
        (
            dict(enable_hisparse=True, hisparse_config={"host_to_device_ratio": 2}),
            "HiSparse host latent",
            "fewer logical tokens",
        ),
    ],
    ids=["tier", "host-latent"],
)
def test_a_node_counts_every_ranks_host_memory_before_the_weights_load(
    glm_tiny, monkeypatch, kw, what, ask
):
    """Each rank holds a tier (or a HiSparse host latent, under DP attention or across
    machines) of its own: what fits once but not twice on a node is refused, naming the
    ranks, before the weights load. (One process stands for the two ranks of a node: each
    rank's bytes gathered, two ranks a node.)"""
    import dsakv.memory.pool as pool
    from dsakv.config.parallel import ParallelConfig
    from dsakv.distributed import ParallelState
    from dsakv.models import loader

    layout = CacheLayout.for_model(glm_tiny, "fp32", "fp32", 8)
    per_rank = (
        40 * 8 * (layout.bytes_per_token if "tier" in what else layout.latent_bytes_per_token)
    )
    monkeypatch.setattr(pool, "memory_bytes", lambda device: per_rank * 3 // 2)
    monkeypatch.setattr(ParallelState, "all_gather_objects", lambda self, obj: [obj, obj])
    monkeypatch.setattr(ParallelConfig, "ranks_per_node", property(lambda self: 2))
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    config = dict(kv_cache_dtype="fp32", index_k_dtype="fp32", page_size=8, device="cpu")
    with pytest.raises(ConfigError) as e:
        Engine(EngineConfig(model=glm_tiny, **config, num_pages=20, **kw))
    msg = str(e.value)
    assert f"cannot allocate {2 * per_rank / GIB:.2f} GiB of {what} (2 ranks' on a node)" in msg
    assert f"ask for {ask}" in msg
