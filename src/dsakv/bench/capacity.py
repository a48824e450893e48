"""Capacity of index-K elision: bytes per token and pool tokens, elided vs dense.

Pure arithmetic over `CacheLayout` and `plan_capacity` (no model is built), so the
GLM-5.2 figures here must equal DESIGN.md §3's reference numbers exactly.
"""

from __future__ import annotations

from typing import Any

from dsakv.config import LayerPlan, ModelConfig
from dsakv.memory import CacheLayout, estimate_weight_bytes, plan_capacity
from dsakv.memory.capacity import GIB, gain_pct

# SGLang #30531 on GLM-5.2-NVFP4 (TP4, 4×GB300, EAGLE with 1 draft layer): the KV budgets
# implied by its token counts, dense index-K before and elided after (DESIGN.md §3).
GLM52_BUDGET_DENSE_GIB = 134.127
GLM52_BUDGET_ELIDED_GIB = 135.376
GLM52_REFERENCE = {
    "bytes_per_token": 48_408,
    "bytes_per_token_dense": 55_932,
    "bytes_per_token_target": 47_700,
    "bytes_per_token_target_dense": 55_224,
    "max_total_num_tokens": 3_002_752,
    "max_total_num_tokens_dense": 2_574_848,
}


def _layout_row(layout: CacheLayout) -> dict[str, Any]:
    dense = layout.dense()
    return {
        "kv_cache_dtype": layout.kv_cache_dtype,
        "index_k_dtype": layout.index_k_dtype,
        "bytes_per_token": layout.bytes_per_token,
        "bytes_per_token_dense": dense.bytes_per_token,
        "token_gain_pct_same_budget": gain_pct(dense.bytes_per_token, layout.bytes_per_token),
    }


def glm52_capacity() -> dict[str, Any]:
    """GLM-5.2 (fp8 / fp8, 1 draft layer) at the reference budgets and at equal budgets."""
    config = ModelConfig.resolve("glm-5.2")
    plan = LayerPlan.from_config(config, draft_layers=1)
    elided = CacheLayout.from_plan(config, plan, "fp8_e4m3", "fp8", 64)
    dense = elided.dense()
    target = CacheLayout.from_plan(config, LayerPlan.from_config(config), "fp8_e4m3", "fp8", 64)
    cap_e = plan_capacity(elided, kv_budget_gib=GLM52_BUDGET_ELIDED_GIB)
    cap_d = plan_capacity(dense, kv_budget_gib=GLM52_BUDGET_DENSE_GIB)
    same_d = plan_capacity(dense, kv_budget_gib=GLM52_BUDGET_ELIDED_GIB)
    same_e = plan_capacity(elided, kv_budget_gib=GLM52_BUDGET_DENSE_GIB)
    weights = estimate_weight_bytes(config, plan, tp=4)
    others = {
        dt: _layout_row(CacheLayout.from_plan(config, LayerPlan.from_config(config), dt, "fp8"))
        for dt in ("fp8_e4m3", "fp8_ds_mla", "bf16")
    }
    out = {
        "model": "glm-5.2",
        "num_layers": plan.num_layers,
        "num_draft_layers": plan.num_draft_layers,
        "num_full_layers": plan.num_full_layers,
        "num_shared_layers": plan.num_shared_layers,
        "kv_cache_dtype": elided.kv_cache_dtype,
        "index_k_dtype": elided.index_k_dtype,
        "page_size": elided.page_size,
        "bytes_per_token": elided.bytes_per_token,
        "bytes_per_token_dense": dense.bytes_per_token,
        "bytes_per_token_target": target.bytes_per_token,
        "bytes_per_token_target_dense": target.dense().bytes_per_token,
        "kv_budget_gib": GLM52_BUDGET_ELIDED_GIB,
        "kv_budget_gib_dense": GLM52_BUDGET_DENSE_GIB,
        "max_total_num_tokens": cap_e.max_total_num_tokens,
        "max_total_num_tokens_dense": cap_d.max_total_num_tokens,
        "token_gain_pct": gain_pct(cap_e.max_total_num_tokens, cap_d.max_total_num_tokens),
        "same_budget": {
            f"{GLM52_BUDGET_ELIDED_GIB}_gib": {
                "max_total_num_tokens": cap_e.max_total_num_tokens,
                "max_total_num_tokens_dense": same_d.max_total_num_tokens,
                "token_gain_pct": gain_pct(cap_e.max_total_num_tokens, same_d.max_total_num_tokens),
            },
            f"{GLM52_BUDGET_DENSE_GIB}_gib": {
                "max_total_num_tokens": same_e.max_total_num_tokens,
                "max_total_num_tokens_dense": cap_d.max_total_num_tokens,
                "token_gain_pct": gain_pct(same_e.max_total_num_tokens, cap_d.max_total_num_tokens),
            },
        },
        "indexer_weight_bytes_saved_per_rank": weights.indexer_bytes_saved,
        "layouts_target_only": others,
    }
    out["matches_reference"] = all(out[k] == v for k, v in GLM52_REFERENCE.items())
    return out


def model_capacity(
    config: ModelConfig, plan: LayerPlan, kv_budget_bytes: int, page_size: int
) -> dict[str, Any]:
    """The bench model (fp8 / fp8) at the throughput section's KV budget."""
    elided = CacheLayout.from_plan(config, plan, "fp8_e4m3", "fp8", page_size)
    dense = elided.dense()
    gib = kv_budget_bytes / GIB
    cap_e = plan_capacity(elided, kv_budget_gib=gib)
    cap_d = plan_capacity(dense, kv_budget_gib=gib)
    return {
        "num_layers": plan.num_layers,
        "num_full_layers": plan.num_full_layers,
        "num_shared_layers": plan.num_shared_layers,
        "layer_pattern": plan.pattern,
        "kv_cache_dtype": elided.kv_cache_dtype,
        "index_k_dtype": elided.index_k_dtype,
        "page_size": page_size,
        "bytes_per_token": elided.bytes_per_token,
        "bytes_per_token_dense": dense.bytes_per_token,
        "kv_budget_bytes": kv_budget_bytes,
        "kv_budget_gib": gib,
        "max_total_num_tokens": cap_e.max_total_num_tokens,
        "max_total_num_tokens_dense": cap_d.max_total_num_tokens,
        "num_pages": cap_e.num_pages,
        "num_pages_dense": cap_d.num_pages,
        "token_gain_pct": gain_pct(cap_e.max_total_num_tokens, cap_d.max_total_num_tokens),
    }
