"""`ModelConfig`: a Hugging Face `config.json` normalised to what the engine needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dsakv.errors import ConfigError

from .presets import PRESETS, preset

# model_type -> whether the indexer's RoPE is interleaved (GLM) or half-split (DeepSeek-V3.2).
_SUPPORTED = {"glm_moe_dsa": True, "deepseek_v32": False}
_ARCHITECTURES = {"GlmMoeDsaForCausalLM": "glm_moe_dsa", "DeepseekV32ForCausalLM": "deepseek_v32"}

_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)


@dataclass(frozen=True)
class ModelConfig:
    """Every shape and option the engine reads; built only through `from_hf` / `resolve`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope_parameters: dict[str, Any] = field(default_factory=dict, hash=False)
    indexer_rope_interleave: bool = True
    num_nextn_predict_layers: int = 0
    dtype: str = "bfloat16"
    quantization_config: dict[str, Any] | None = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Raw layer-plan sources, read only by `LayerPlan.from_config`.
    indexer_types: tuple[str, ...] | None = None
    index_topk_pattern: str | None = None
    cli_factor: int | None = None
    index_topk_freq: int | None = None
    index_skip_topk_offset: int | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters.get("rope_theta", 10000.0))

    @property
    def has_moe(self) -> bool:
        """Whether any layer is an MoE layer (layers from `first_k_dense_replace` on)."""
        return self.first_k_dense_replace < self.num_hidden_layers

    @property
    def is_fp8_block_quantized(self) -> bool:
        q = self.quantization_config or {}
        return q.get("quant_method") == "fp8" and bool(q.get("weight_block_size"))

    @classmethod
    def from_hf(cls, source: str | Path | dict[str, Any]) -> ModelConfig:
        """Normalise a model directory, a `config.json` path, or a config dict."""
        if isinstance(source, dict):
            raw = source
        else:
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise ConfigError(f"no model config at {path}")
            try:
                raw = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError("model config must be a JSON object")
        return cls._from_dict(raw)

    @classmethod
    def resolve(cls, model: str | Path | dict[str, Any] | ModelConfig) -> ModelConfig:
        """Accept a `ModelConfig`, a preset name (`glm-5.2`), a path, or a dict."""
        if isinstance(model, ModelConfig):
            return model
        if isinstance(model, str) and model in PRESETS:
            return cls.from_hf(preset(model))
        if isinstance(model, str) and not Path(model).exists():
            raise ConfigError(
                f"unknown model {model!r}: not a preset ({', '.join(PRESETS)}) nor an existing path"
            )
        return cls.from_hf(model)

    @classmethod
    def _from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in _SUPPORTED:
            model_type = next(
                (_ARCHITECTURES[a] for a in raw.get("architectures") or [] if a in _ARCHITECTURES),
                model_type,
            )
        if model_type not in _SUPPORTED:
            raise ConfigError(
                f"unsupported model_type {raw.get('model_type')!r} "
                f"(supported: {', '.join(_SUPPORTED)})"
            )
        missing = [k for k in _REQUIRED if raw.get(k) is None]
        if missing:
            raise ConfigError(f"model config is missing required field(s): {', '.join(missing)}")
        known = {f.name for f in fields(cls)}
        kw: dict[str, Any] = {k: raw[k] for k in known if k in raw and raw[k] is not None}
        kw["model_type"] = model_type
        kw.setdefault("intermediate_size", raw["moe_intermediate_size"])
        kw["indexer_rope_interleave"] = _SUPPORTED[model_type]
        kw["rope_parameters"] = _rope_parameters(raw)
        kw["dtype"] = str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16")
        eos = raw.get("eos_token_id")
        kw["eos_token_ids"] = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if raw.get("indexer_types") is not None:
            kw["indexer_types"] = tuple(raw["indexer_types"])
        for name in _REQUIRED + ("intermediate_size", "num_nextn_predict_layers"):
            if not isinstance(kw.get(name, 0), int) or isinstance(kw.get(name), bool):
                raise ConfigError(f"model config field {name} must be an integer, got {kw[name]!r}")
            if name in _REQUIRED and kw[name] <= 0:
                raise ConfigError(f"model config field {name} must be positive, got {kw[name]}")
        return cls(**kw)


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """Merge transformers-5 `rope_parameters` and legacy `rope_theta` + `rope_scaling`."""
    params: dict[str, Any] = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    for k, v in scaling.items():
        params.setdefault("rope_type" if k == "type" else k, v)
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    params.setdefault("rope_type", "default")
    if params["rope_type"] not in ("default", "yarn"):
        raise ConfigError(f"unsupported rope type {params['rope_type']!r} (default, yarn)")
    if params["rope_type"] == "yarn":
        params.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings"))
    return params
