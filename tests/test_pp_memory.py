"""Pipeline parallelism's memory side: a stage's pools hold its own layers only (latent of
each, index-K of its full and draft layers), a layer of another stage is refused in words,
the host tier mirrors a stage, and `dsakv plan --pp-size` plans each stage's pool."""

from __future__ import annotations

import copy
import json
import re

import numpy as np
import pytest
import torch

from dsakv.cli import main
from dsakv.config import HiSparseConfig, LayerPlan, ModelConfig
from dsakv.config.parallel import ParallelConfig
from dsakv.config.presets import TINY_PRESETS
from dsakv.errors import ConfigError
from dsakv.memory import (
    CacheLayout,
    DSAKVPool,
    HostPool,
    LayerNotHeldError,
    copy_tokens,
    estimate_weight_bytes,
    plan_capacity,
    plan_hisparse,
)
from dsakv.memory.capacity import GIB, plan_pipeline
from tests.conftest import small_glm_config

GLM_TINY = TINY_PRESETS["glm-tiny"]  # 8 layers, FFSSFSFS
# (model, pp, partition): even splits and a lopsided one
SPLITS = [
    (GLM_TINY, 2, None),
    (GLM_TINY, 3, None),
    (GLM_TINY, 3, (1, 2, 5)),
    ("glm-5.2", 2, None),
    ("glm-5.2", 4, None),
    ("glm-5.2", 4, (10, 30, 30, 8)),
]


def _stages(model, pp, partition, draft_layers=1, **kw):
    """The whole layout and each stage's (its pool's) layout."""
    whole = CacheLayout.for_model(copy.deepcopy(model), draft_layers=draft_layers, **kw)
    ranges = ParallelConfig(pp=pp, pp_layer_partition=partition).stage_layers(whole.plan.num_layers)
    return whole, ranges, [whole.for_stage(r) for r in ranges]


@pytest.mark.parametrize(("model", "pp", "partition"), SPLITS)
def test_stage_pools_hold_exactly_their_layers(model, pp, partition):
    whole, ranges, layouts = _stages(model, pp, partition)
    one = DSAKVPool(whole, 1)
    pools = [DSAKVPool(lay, 1) for lay in layouts]
    plan = whole.plan
    for r, pool in zip(ranges, pools, strict=True):
        descs = pool.transfer_descriptors()
        draft = [plan.num_layers] if r.stop == plan.num_layers else []  # MTP on the last
        assert [d.layer for d in descs if d.component == "latent"] == [*r, *draft]
        owning = [i for i in [*r, *draft] if plan.owns_index_k(i)]
        assert [d.layer for d in descs if d.component == "index_k"] == owning
        assert pool.nbytes == pool.page_size * pool.layout.bytes_per_token
    # Split over the stages, not copied: every byte of the one-stage pool, once.
    for comp in ("latent", "index_k"):
        total = sum(
            d.nbytes for p in pools for d in p.transfer_descriptors() if d.component == comp
        )
        assert total == sum(d.nbytes for d in one.transfer_descriptors() if d.component == comp)
    assert sum(lay.bytes_per_token for lay in layouts) == whole.bytes_per_token


def test_a_layer_of_another_stage_is_refused_in_words():
    _, _, (first, last) = _stages(GLM_TINY, 2, None)
    pool = DSAKVPool(last, 1)  # layers 4-7 and the MTP layer 8
    s = torch.arange(3)
    said = r"layer 1 is on another pipeline stage: this stage's cache holds layers 4-8 only"
    with pytest.raises(LayerNotHeldError, match=said):
        pool.write_latent(1, s, torch.zeros(3, 576))
    with pytest.raises(LayerNotHeldError, match=said):
        pool.gather_latent(1, s)
    with pytest.raises(LayerNotHeldError, match=said):
        pool.gather_index_k(1, s)  # (a full layer: its index-K is on the other stage)
    with pytest.raises(LayerNotHeldError, match=said):
        pool.write_index_k(1, s, torch.zeros(3, 128))
    with pytest.raises(LayerNotHeldError, match=said):
        pool.latent_data(1)
    for where in (pool, last):
        with pytest.raises(LayerNotHeldError, match=said):
            where.has_index_k(1)
    with pytest.raises(LayerNotHeldError, match="layer 8 .* holds layers 0-3 only"):
        first.has_index_k(8)
    with pytest.raises(IndexError, match=r"layer 9 out of range 0\.\.8"):
        pool.gather_latent(9, s)
    # the held layers work by their global index
    pool.write_latent(8, s, torch.ones(3, 576))
    assert pool.has_index_k(8) and not pool.has_index_k(5)
    assert pool.gather_latent(8, s).eq(1).all()


@pytest.mark.parametrize("stage", [None, 1])
def test_a_layer_given_as_a_numpy_int_or_0d_tensor_is_taken(stage):
    """As list indexing took them before pools keyed buffers by layer."""
    whole, _, layouts = _stages(GLM_TINY, 2, None)
    layout = whole if stage is None else layouts[stage]
    pool, s = DSAKVPool(layout, 1), torch.arange(3)
    for layer in (torch.tensor(5), np.int64(5)):
        pool.write_latent(layer, s, torch.full((3, 576), 2.0))
        assert pool.gather_latent(layer, s).eq(2).all()
        assert pool.latent_data(layer) is pool.latent_data(5)
        assert not pool.has_index_k(layer) and not layout.has_index_k(layer)
    pool.write_index_k(torch.tensor(4), s, torch.ones(3, 128))  # (a full layer)
    assert pool.gather_index_k(np.int64(4), s).shape == (3, 128)


def test_a_stage_pool_round_trips_its_pages():
    _, _, (_, last) = _stages(GLM_TINY, 2, None, page_size=4)
    pool, other = DSAKVPool(last, 4), DSAKVPool(last, 4)
    g = torch.Generator().manual_seed(1)
    slots = torch.arange(4, 12)  # pages 1 and 2
    for layer in last.held_layers:
        pool.write_latent(layer, slots, torch.randn(8, 576, generator=g))
        if pool.has_index_k(layer):
            pool.write_index_k(layer, slots, torch.randn(8, 128, generator=g))
    data = pool.read_pages([1, 2])
    assert data.shape == (2, 4 * last.bytes_per_token)  # this stage's bytes per page only
    other.write_pages([3, 0], data)
    moved = torch.cat([torch.arange(12, 16), torch.arange(4)])
    for layer in last.held_layers:
        assert torch.equal(other.latent_data(layer)[moved], pool.latent_data(layer)[slots])
    assert torch.equal(other.read_pages([3, 0]), data)
    with pytest.raises(ValueError, match="page bytes must be uint8"):
        other.write_pages([0], DSAKVPool(_stages(GLM_TINY, 2, None, page_size=4)[2][0], 1)
                          .read_pages([0]))  # fmt: skip


@pytest.mark.parametrize("layers", [(), (3, 2), (2, 2), (0, 9), (-1, 0), "ab"])
def test_a_layout_refuses_bad_layers(layers):
    whole = CacheLayout.for_model(copy.deepcopy(GLM_TINY), draft_layers=1)
    with pytest.raises(ConfigError, match=r"increasing, unique layers in 0\.\.8"):
        CacheLayout(**{**whole.__dict__, "layers": layers})


def test_a_stage_moves_its_own_tokens_and_copies_to_no_other_stage():
    _, _, (first, last) = _stages(GLM_TINY, 2, (4, 4), draft_layers=0)
    a, b = DSAKVPool(first, 1), DSAKVPool(last, 1)
    b.write_latent(6, torch.arange(2), torch.ones(2, 576))
    b.move(torch.tensor([5, 6]), torch.arange(2))
    assert b.gather_latent(6, torch.tensor([5, 6])).eq(1).all()
    with pytest.raises(ValueError, match="different layouts"):
        copy_tokens(a, torch.arange(2), b, torch.arange(2))


def test_the_host_tier_mirrors_a_stage_and_replays_its_journal():
    _, _, layouts = _stages(GLM_TINY, 2, None, kv_cache_dtype="fp8_ds_mla", page_size=4)
    devs = [DSAKVPool(lay, 4) for lay in layouts]
    hosts = [HostPool(d, 2) for d in devs]
    for lay, host in zip(layouts, hosts, strict=True):
        assert host.nbytes == 2 * 4 * lay.bytes_per_token
        assert [d.layer for d in host.pool.transfer_descriptors()] == [
            d.layer for d in host.device_pool.transfer_descriptors()
        ]
    g = torch.Generator().manual_seed(0)
    src, dst = torch.arange(5), torch.arange(8, 13)
    for dev in devs:
        for layer in dev.layout.held_layers:
            dev.write_latent(layer, src, torch.randn(5, 576, generator=g))
            if dev.has_index_k(layer):
                dev.write_index_k(layer, src, torch.randn(5, 128, generator=g))
    before = [d.read_tokens(src) for d in devs]
    hosts[0].journal = []
    slots = hosts[0].backup(src)
    hosts[0].load(slots, dst)
    hosts[1].replay(hosts[0].take_journal())  # stage 1 repeats stage 0's copies
    for dev, want in zip(devs, before, strict=True):
        got = dev.read_tokens(dst)
        assert got.keys() == want.keys()
        assert {k.split(".")[1] for k in got} == {str(i) for i in dev.layout.held_layers}
        for key, parts in want.items():
            for a, b in zip(got[key], parts, strict=True):
                assert torch.equal(a, b), key


# --- weights ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "draft", "duplicated"),
    [
        ("glm-5.2", 0, False),  # lm_head on the last stage, the embedding on the first
        ("glm-5.2", 1, True),  # the MTP layer embeds the next token: the last has its own
        (small_glm_config(8, tie_word_embeddings=True), 0, True),  # lm_head is an embedding
        (small_glm_config(8, tie_word_embeddings=True), 1, True),  # (one serves both)
    ],
)
def test_stage_weights_sum_to_the_model(model, draft, duplicated):
    config = ModelConfig.resolve(copy.deepcopy(model))
    plan = LayerPlan.from_config(config, draft_layers=draft)
    layout = CacheLayout.from_plan(config, plan)
    whole = estimate_weight_bytes(config, plan, 2)
    stages = ParallelConfig(pp=4).stage_layers(plan.num_layers)
    parts = [
        estimate_weight_bytes(config, plan, 2, layers=layout.for_stage(r).held_layers)
        for r in stages
    ]
    embedding = -(-config.vocab_size // 2) * config.hidden_size * 2  # (bf16, vocab over TP)
    assert sum(p.total_bytes for p in parts) == whole.total_bytes + duplicated * embedding
    assert sum(p.indexer_bytes_saved for p in parts) == whole.indexer_bytes_saved
    assert len({p.total_bytes for p in parts}) > 1  # (each stage its own)


def test_the_least_stage_limits_the_pool():
    config = ModelConfig.resolve("glm-5.2")
    whole = CacheLayout.for_model(config)
    stages = ParallelConfig(tp=8, pp=4).stage_layers(78)
    pipe = plan_pipeline(whole, stages, index_topk=2048, config=config, tp=8, gpu_memory_gib=141)
    tokens = [s.capacity.max_total_num_tokens for s in pipe.stages]
    assert pipe.max_total_num_tokens == min(tokens) and len(set(tokens)) > 1
    assert pipe.limiting.capacity.max_total_num_tokens == min(tokens)
    for s in pipe.stages:  # each budget is the GPU's share less its own stage's weights
        w = estimate_weight_bytes(config, whole.plan, 8, layers=s.layout.held_layers)
        assert s.capacity.weight_bytes == w.total_bytes
        assert s.capacity.kv_budget_bytes == int(141 * 2**30 * 0.9) - s.capacity.weight_bytes
    with pytest.raises(ConfigError, match=r"pipeline stage 2 \(layers 39-77\): no memory"):
        plan_pipeline(
            whole, (range(20), range(20, 39), range(39, 78)), index_topk=2048, config=config,
            tp=8, gpu_memory_gib=60,
        )  # fmt: skip


def test_a_stage_layout_budget_subtracts_its_own_weights():
    """plan_capacity / plan_hisparse given a stage's layout price that stage's layers, not
    the whole model (175.65 GiB a rank at TP 8: no room on 141 GiB)."""
    config = ModelConfig.resolve("glm-5.2")
    first = CacheLayout.for_model(config).for_stage(range(19))
    kw = dict(gpu_memory_gib=141, config=config, tp=8)
    cap = plan_capacity(first, **kw)
    w = estimate_weight_bytes(config, first.plan, 8, layers=range(19))
    assert cap.weight_bytes == w.total_bytes and 37.9 * GIB < w.total_bytes < 38 * GIB
    assert cap.kv_budget_bytes == int(141 * GIB * 0.9) - w.total_bytes
    dense = plan_capacity(first.dense(), **kw)  # (builds the indexers shared layers skip)
    assert dense.weight_bytes == w.total_bytes + w.indexer_bytes_saved
    split = plan_hisparse(first, HiSparseConfig.parse(None, config), **kw)
    assert split.weight_bytes == w.total_bytes


# --- dsakv plan --pp-size --------------------------------------------------------------------


def _plan(capsys, *args):
    assert main(["plan", *args]) == 0
    return capsys.readouterr().out


def test_plan_per_stage_numbers_match_the_layouts(capsys):
    r = json.loads(_plan(capsys, "glm-5.2", "--tp", "8", "--pp-size", "4", "--json"))
    whole, ranges, layouts = _stages("glm-5.2", 4, None, draft_layers=0)
    assert r["pp_layer_partition"] == [19, 20, 20, 19] and len(r["stages"]) == 4
    # GLM-5.2 by hand: 576 B latent a layer, 132 B index-K a full (elided) / every (dense)
    # layer; stage 0 holds 19 layers, 7 full: 19 × 576 + 7 × 132 = 11,868.
    assert [s["bytes_per_token_elided"] for s in r["stages"]] == [11868, 12180, 12180, 11472]
    assert [s["bytes_per_token_dense"] for s in r["stages"]] == [13452, 14160, 14160, 13452]
    assert r["stages"][0]["max_total_num_tokens_elided"] == 9_047_360  # (100 GiB / 11,868)
    # Top level: the limiting stage's per-token figures (stage 1's), the model's apart
    assert (r["bytes_per_token"], r["bytes_per_token_dense"]) == (12180, 14160)
    assert (r["latent_bytes_per_token"], r["index_k_bytes_per_token"]) == (20 * 576, 5 * 132)
    assert r["max_total_num_tokens"] == 100 * GIB // 12180 // 64 * 64
    assert (r["model_bytes_per_token"], r["model_bytes_per_token_dense"]) == (47700, 55224)
    assert r["model_latent_bytes_per_token"] == 78 * 576
    assert r["model_indexer_weight_bytes_saved"] == 1_068_397_056  # (every shared layer's)
    assert r["indexer_weight_bytes_saved"] == 1_068_397_056 * 15 // 57  # (stage 1's 15)
    for s, rng, lay in zip(r["stages"], ranges, layouts, strict=True):
        assert s["layers"] == list(rng)
        assert s["index_k_layers"] == list(lay.index_k_layers)
        assert s["num_full_layers"] == sum(whole.plan.runs_indexer(i) for i in rng)
        assert s["bytes_per_token_elided"] == lay.bytes_per_token
        assert s["bytes_per_token_dense"] == lay.dense().bytes_per_token
        n = len(whole.plan.carried_sources(rng.start)) if rng.start else 0
        assert s["carried_topk_bytes_per_token"] == n * 2048 * 4
        assert s["max_total_num_tokens_elided"] == 100 * 2**30 // lay.bytes_per_token // 64 * 64
    assert [s["carried_sources"] for s in r["stages"]] == [[], [18], [38], [58]]
    least = min(r["stages"], key=lambda s: s["max_total_num_tokens"])
    assert r["limiting_stage"] == least["stage"] == 1
    assert r["max_total_num_tokens"] == least["max_total_num_tokens"]
    table = _plan(capsys, "glm-5.2", "--tp", "8", "-pp", "4")
    assert "12,180" in table and "14,160" in table and "limiting stage: 1" in table


def test_plan_pp_1_is_unchanged(capsys):
    plain = _plan(capsys, "glm-5.2", "--tp", "8", "--json")
    assert _plan(capsys, "glm-5.2", "--tp", "8", "--pipeline-parallel-size", "1", "--json") == plain
    r = json.loads(plain)
    assert not [k for k in r if k.startswith("model_b") or k in ("stages", "pp")]
    # The numbers before pipeline parallelism (the whole model on every rank)
    assert (r["bytes_per_token"], r["bytes_per_token_dense"]) == (47700, 55224)
    assert (r["max_total_num_tokens"], r["max_total_num_tokens_dense"]) == (2_251_008, 1_944_320)
    assert r["weight_bytes_per_rank"] == 188_597_815_296
    assert r["indexer_weight_bytes_saved"] == 1_068_397_056
    r = json.loads(_plan(capsys, "glm-5.2", "--tp", "8", "--gpu-memory-gib", "400", "--json"))
    assert (r["kv_budget_bytes"], r["weight_bytes_per_rank"]) == (197_949_241_344, 188_597_815_296)
    assert (r["max_total_num_tokens"], r["max_total_num_tokens_dense"]) == (4_149_824, 3_565_120)
    assert _plan(capsys, "glm-5.2", "--pp-layer-partition", "78") == _plan(capsys, "glm-5.2")


@pytest.mark.parametrize(
    ("args", "cell"),
    [
        (["--pp-size", "78"], "151,658,432"),  # (100 GiB over 708 B: ≥ 100M tokens a stage)
        (["--pp-size", "4", "--draft-layers", "1", "--kv-budget-gib", "2000"], "59-77 +78"),
    ],
)
def test_plan_stage_table_columns_stay_apart(capsys, args, cell):
    lines = _plan(capsys, "glm-5.2", *args).splitlines()
    table = lines[lines.index("") + 1 : lines.index("", lines.index("") + 1)]
    for line in table:  # every cell of 12 columns two spaces from the next
        assert len(re.split(r"\s{2,}", line.strip())) == 12, line
    assert cell in table[-1]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--pp-layer-partition", "39,39"], "39,39 gives 2 stages: give --pp-size 2 too"),
        (["--pp-size", "4", "--pp-layer-partition", "20,20,20"], "must be 4 numbers"),
        (["--pp-size", "2", "--pp-layer-partition", "40,40"], "covers 80 layers"),
        (["--pp-size", "2", "--pp-layer-partition", "0,78"], "integers >= 1"),
        (["--pp-size", "79"], "more than the model's 78 layers"),
    ],
)
def test_plan_refuses_a_bad_partition_in_one_line(capsys, args, said):
    try:
        rc = main(["plan", "glm-5.2", *args])
    except SystemExit as e:  # (argparse's own refusals)
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and said in err
    assert err.startswith("error: ") and err.count("\n") == 1
