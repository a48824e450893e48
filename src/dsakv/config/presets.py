"""Public model shapes (DESIGN.md §5) as Hugging Face-style config dicts."""

from __future__ import annotations

import copy

_GLM5 = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 78,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 192,
    "v_head_dim": 256,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "first_k_dense_replace": 3,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 2048,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 202752,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "num_nextn_predict_layers": 1,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
}

_GLM52 = {
    **_GLM5,
    "index_topk_freq": 4,
    "index_skip_topk_offset": 3,
    # As the checkpoint ships it: layers 0-2 full, then every 4th (what freq 4 / offset 3 give).
    "indexer_types": [{"F": "full", "S": "shared"}[c] for c in "FFF" + "SSSF" * 18 + "SSS"],
}

_DSV32 = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "first_k_dense_replace": 3,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 163840,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "num_nextn_predict_layers": 1,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
    "bos_token_id": 0,
    "eos_token_id": 1,
}

PRESETS: dict[str, dict] = {"glm-5": _GLM5, "glm-5.2": _GLM52, "deepseek-v3.2": _DSV32}


def preset(name: str) -> dict:
    """A fresh copy of a preset's config dict."""
    return copy.deepcopy(PRESETS[name])
