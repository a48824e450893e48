"""Model shapes as Hugging Face-style config dicts: the public ones (DESIGN.md §5), and the
tiny ones the tests and benchmarks build (`dsakv.models.tiny` writes them)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any


def _types(pattern: str) -> list[str]:
    """`indexer_types` from letters: F full, S shared."""
    return [{"F": "full", "S": "shared"}[c] for c in pattern]


_GLM52_PATTERN = "FFF" + "SSSF" * 18 + "SSS"

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
    "indexer_types": _types(_GLM52_PATTERN),
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


# The tiny models: a byte-level vocabulary and the real models' shapes scaled down.
BYTE_VOCAB = 256
SPECIAL_TOKENS = (
    "<|bos|>",
    "<|eos|>",
    "<|pad|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",  # GLM's tool-result role
    "<|reserved_1|>",
)
VOCAB_SIZE = BYTE_VOCAB + len(SPECIAL_TOKENS)  # 264
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258


_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
    "tie_word_embeddings": False,
    "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-5,
    "routed_scaling_factor": 2.5,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
}

# The two tiny models' common body.
_TINY = {
    **_COMMON,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "index_n_heads": 16,
    "index_head_dim": 128,
    "index_topk": 16,
}

_GLM_TINY = {
    **_TINY,
    "model_type": "glm_moe_dsa",
    "num_hidden_layers": 8,
    "n_group": 1,
    "topk_group": 1,
    "indexer_types": ["full", "full", "shared", "shared", "full", "shared", "full", "shared"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "initializer_range": 0.1,
}

# GLM-5.2's 78-layer sharing pattern and per-token cache bytes, with a small body.
_GLM_BENCH = {
    **_COMMON,
    "model_type": "glm_moe_dsa",
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 78,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 3,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 256,
    "index_topk_freq": 4,
    "index_skip_topk_offset": 3,
    "indexer_types": _types(_GLM52_PATTERN),  # freq 4, offset 3
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "initializer_range": 0.05,
}

_GLM_BENCH_SHORT = {
    **_GLM_BENCH,
    "num_hidden_layers": 16,
    "indexer_types": _types("FFF" + "SSSF" * 3 + "S"),
}

# glm-bench-short with a top-64 indexer: prompts several times a HiSparse hot buffer
# (2 × top_k) long stay cheap to prefill on a CPU (`dsakv bench --enable-hisparse`).
_GLM_HISPARSE = {**_GLM_BENCH_SHORT, "index_topk": 64}

_DEEPSEEK_TINY = {
    **_TINY,
    "model_type": "deepseek_v32",
    "num_hidden_layers": 4,
    "n_group": 4,
    "topk_group": 2,
    "max_position_embeddings": 2560,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 64,  # 64 × factor 40 = max_position_embeddings
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "initializer_range": 0.1,
}

TINY_PRESETS: dict[str, dict[str, Any]] = {
    "glm-tiny": _GLM_TINY,
    "glm-bench": _GLM_BENCH,
    "glm-bench-short": _GLM_BENCH_SHORT,
    "glm-hisparse": _GLM_HISPARSE,
    "deepseek-tiny": _DEEPSEEK_TINY,
}


def preset(name: str) -> dict:
    """A fresh copy of a preset's config dict."""
    return copy.deepcopy(PRESETS[name])


def is_model_dir(name: str | Path) -> bool:
    """Whether `name` is a model directory here (it holds a config.json). A MODEL argument
    that is one means that directory for every command, even where a preset has its name:
    the user named a folder they have, as transformers' `from_pretrained` and vLLM prefer a
    local folder to a hub name."""
    return (Path(name) / "config.json").is_file()


# The weight matrices the quantised releases of these models quantise (the FP8 block ones
# of DeepSeek-V3.x and GLM-5, modelopt NVFP4), by checkpoint name: each layer's
# projections (attention, the indexer's wq_b / wk, MLP, shared and routed experts), not
# the router, the indexer's weights_proj, eh_proj, embeddings or heads (engines build
# those unquantised).
QUANTIZED_WEIGHT = re.compile(
    r"^model\.layers\.\d+\.(?!.*(?:weights_proj|eh_proj|shared_head))"
    r".*\.(?:\w+_proj|kv_a_proj_with_mqa|wq_b|wk)\.weight$"
)
