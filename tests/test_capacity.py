import pytest

from dsakv.config import LayerPlan, ModelConfig
from dsakv.errors import ConfigError
from dsakv.memory import CacheLayout, estimate_weight_bytes, plan_capacity

from .conftest import small_glm_config


@pytest.mark.parametrize(
    ("kv", "ik", "dense", "elided"),
    [
        ("fp8_e4m3", "fp8", 55224, 47700),
        ("fp8_ds_mla", "fp8", 61464, 53940),
        ("bf16", "fp8", 100152, 92628),
        ("fp32", "fp32", 78 * (2304 + 512), 78 * 2304 + 21 * 512),
    ],
)
def test_glm52_cells(kv, ik, dense, elided):
    layout = CacheLayout.for_model("glm-5.2", kv_cache_dtype=kv, index_k_dtype=ik)
    assert layout.bytes_per_token == elided
    assert layout.dense().bytes_per_token == dense
    assert CacheLayout.for_model("glm-5.2", kv, ik, elide_index_k=False).bytes_per_token == dense


def test_draft_layers_counted_in_full():
    layout = CacheLayout.for_model("glm-5.2", draft_layers=1)
    assert (layout.bytes_per_token, layout.dense().bytes_per_token) == (48408, 55932)
    assert layout.has_index_k(78) and not layout.has_index_k(3) and layout.dense().has_index_k(3)


def test_sglang_reference_token_counts():
    layout = CacheLayout.for_model("glm-5.2", draft_layers=1)
    assert plan_capacity(layout.dense(), kv_budget_gib=134.127).max_total_num_tokens == 2574848
    assert plan_capacity(layout, kv_budget_gib=135.376).max_total_num_tokens == 3002752


def test_capacity_formula_and_page_rounding():
    layout = CacheLayout.for_model("glm-5.2", page_size=16)
    cap = plan_capacity(layout, kv_budget_gib=1.0)
    assert cap.max_total_num_tokens % 16 == 0
    assert cap.max_total_num_tokens == (2**30 // 47700 // 16) * 16
    assert cap.num_pages == cap.max_total_num_tokens // 16


def test_gpu_memory_budget_subtracts_weights_and_reserve():
    layout = CacheLayout.for_model("glm-5.2")
    cap = plan_capacity(
        layout, gpu_memory_gib=100, mem_fraction_static=0.8, weights_gib=30, reserve_gib=2
    )
    assert cap.kv_budget_bytes == int((80 - 30 - 2) * 2**30)
    with pytest.raises(ConfigError, match="no memory left"):
        plan_capacity(layout, gpu_memory_gib=10, weights_gib=30)
    with pytest.raises(ConfigError, match="> 0"):
        plan_capacity(layout, kv_budget_gib=0)
    with pytest.raises(ConfigError, match="mem_fraction_static"):
        plan_capacity(layout, gpu_memory_gib=10, mem_fraction_static=1.5, weights_gib=1)


def test_indexer_weights_saved_glm52():
    config = ModelConfig.resolve("glm-5.2")
    plan = LayerPlan.from_config(config)
    est = estimate_weight_bytes(config, plan, tp=4)
    # 57 × (wq_b 4096×2048 + wk 128×6144 + weights_proj 32×6144 + k_norm) × 2 B ≈ 0.995 GiB.
    assert est.indexer_params_per_layer == 4096 * 2048 + 128 * 6144 + 32 * 6144 + 256
    assert est.indexer_bytes_saved == 57 * est.indexer_params_per_layer * 2
    assert abs(est.indexer_bytes_saved / 2**30 - 0.995) < 0.001
    # The indexer is replicated: the saving does not shrink with TP, the rest does.
    est8 = estimate_weight_bytes(config, plan, tp=8)
    assert est8.indexer_bytes_saved == est.indexer_bytes_saved
    assert est8.total_bytes < est.total_bytes
    dense_plan = plan.all_full()
    assert estimate_weight_bytes(config, dense_plan, 4).total_bytes == pytest.approx(
        est.total_bytes + est.indexer_bytes_saved, abs=1
    )


def test_fp8_checkpoint_weights_are_smaller():
    cfg = small_glm_config(4)
    bf16 = ModelConfig.from_hf(cfg)
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    fp8 = ModelConfig.from_hf(cfg)
    plan = LayerPlan.from_config(bf16)
    assert (
        estimate_weight_bytes(fp8, plan).total_bytes < estimate_weight_bytes(bf16, plan).total_bytes
    )


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"kv_cache_dtype": "int4"}, "unknown kv_cache_dtype 'int4'"),
        ({"index_k_dtype": "fp16"}, "unknown index_k_dtype 'fp16'"),
        ({"page_size": 0}, "page_size"),
    ],
)
def test_bad_layout_args(kw, message):
    with pytest.raises(ConfigError, match=message):
        CacheLayout.for_model("glm-5.2", **kw)


def test_fingerprint_tracks_plan_and_dtypes():
    a = CacheLayout.for_model("glm-5.2")
    assert a.fingerprint() == CacheLayout.for_model("glm-5.2").fingerprint()
    assert a.fingerprint() != a.dense().fingerprint()
    assert a.fingerprint() != CacheLayout.for_model("glm-5.2", no_index_share=True).fingerprint()
    assert a.fingerprint() != CacheLayout.for_model("glm-5.2", index_k_dtype="bf16").fingerprint()
