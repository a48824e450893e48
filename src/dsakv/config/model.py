"""`ModelConfig`: a Hugging Face `config.json` normalised to what the engine needs."""

from __future__ import annotations

import math
import types
from dataclasses import dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from dsakv.errors import ConfigError, is_int, is_number, load_json

from .presets import PRESETS, is_model_dir, preset

# model_type -> whether the indexer's RoPE is interleaved (GLM) or half-split (DeepSeek-V3.2).
_SUPPORTED = {"glm_moe_dsa": True, "deepseek_v32": False}
# What a config.json that leaves these out means: transformers' `GlmMoeDsaConfig` /
# `DeepseekV32Config` defaults, as vLLM and SGLang read them through those classes (dsakv's
# own, 1.0 for routed_scaling_factor among them, changed the numbers without a word).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "glm_moe_dsa": {
        "intermediate_size": 12288,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 3,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 202752,
    },
    "deepseek_v32": {
        "intermediate_size": 18432,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 3,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 163840,
    },
}
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
# Smallest value of each integer field (the required ones must be positive).
_MINIMUM = {
    **dict.fromkeys(_REQUIRED, 1),
    "intermediate_size": 1,
    "max_position_embeddings": 1,
    "n_group": 1,
    "topk_group": 1,
    "n_shared_experts": 0,
    "first_k_dense_replace": 0,
    "num_nextn_predict_layers": 0,
}
# Largest value of the fields that size a per-layer or per-expert Python structure (the
# layer plan's tuples, the loader's weight names): far above any real model (GLM-5.2 has
# 78 layers and 256 experts), low enough that a typo'd config.json (1e9 layers) is one
# error line, not minutes of building tuples until memory runs out.
_MAXIMUM = {"num_hidden_layers": 4096, "num_nextn_predict_layers": 4096, "n_routed_experts": 65536}
_POSITIVE_FLOATS = ("rms_norm_eps", "routed_scaling_factor")
# torch dtype names a checkpoint's `dtype` / `torch_dtype` may carry.
_DTYPES = ("bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2")
# `rope_parameters` / `rope_scaling` entries that must be numbers (the first three > 0).
_ROPE_NUMBERS = (
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "attention_factor",
    "mscale",
    "mscale_all_dim",
    "beta_fast",
    "beta_slow",
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
    # defaulted per model type by `_DEFAULTS` (transformers' defaults), not here
    intermediate_size: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    first_k_dense_replace: int
    rms_norm_eps: float
    max_position_embeddings: int
    n_shared_experts: int = 1
    norm_topk_prob: bool = True
    rope_parameters: dict[str, Any] = field(default_factory=dict, hash=False)
    indexer_rope_interleave: bool = True
    num_nextn_predict_layers: int = 0
    dtype: str = "bfloat16"
    quantization_config: dict[str, Any] | None = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # generation_config.json's SAMPLING_FIELDS: what requests leave out
    sampling_defaults: dict[str, float] = field(default_factory=dict, hash=False)
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

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer`'s FFN is MoE (else one dense MLP): DeepSeek-V3's rule, every
        layer from `first_k_dense_replace` on, an MTP layer (numbered after the target's)
        alike."""
        return layer >= self.first_k_dense_replace

    @property
    def moe_layers(self) -> range:
        """The target's MoE layers (`is_moe`'s among them): those whose routing is recorded."""
        return range(self.first_k_dense_replace, self.num_hidden_layers)

    @property
    def has_moe(self) -> bool:
        """Whether any target layer is an MoE layer."""
        return bool(self.moe_layers)

    def routed_shape(self, tokens: int) -> tuple[int, int, int]:
        """`tokens` tokens' routed experts (SGLang's return_routed_experts): `[tokens,
        layers, top_k]`, a dense layer's rows 0."""
        return (tokens, self.num_hidden_layers, self.num_experts_per_tok)

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
                text = path.read_text()
            except UnicodeDecodeError:
                raise ConfigError(f"{path} is not valid JSON (not UTF-8 text)") from None
            except OSError as e:
                raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
            raw = load_json(text, f"{path} is not valid JSON", ConfigError)
        if not isinstance(raw, dict):
            raise ConfigError("model config must be a JSON object")
        if not isinstance(source, dict):
            raw = _with_generation_config(raw, path.parent / "generation_config.json")
        return cls._from_dict(raw)

    @classmethod
    def resolve(cls, model: str | Path | dict[str, Any] | ModelConfig) -> ModelConfig:
        """Accept a `ModelConfig`, a preset name (`glm-5.2`), a path, or a dict; a model
        directory wins over a preset of its name (`presets.is_model_dir`)."""
        if isinstance(model, ModelConfig):
            return model
        if not isinstance(model, (str, Path, dict)):
            raise TypeError(
                "model must be a ModelConfig, a preset name, a path or a config dict, "
                f"got {type(model).__name__}"
            )
        if isinstance(model, str) and model in PRESETS and not is_model_dir(model):
            return cls.from_hf(preset(model))
        if isinstance(model, str) and not Path(model).exists():
            raise ConfigError(
                f"unknown model {model!r}: not a preset ({', '.join(PRESETS)}) nor an existing path"
            )
        return cls.from_hf(model)

    @classmethod
    def _from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type, architectures = raw.get("model_type"), raw.get("architectures")
        if model_type is not None and not isinstance(model_type, str):  # (looked up below)
            raise ConfigError(f"model config field model_type must be a string, got {model_type!r}")
        if architectures is not None and not (
            isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)
        ):
            raise ConfigError(
                f"model config field architectures must be a list of strings, got {architectures!r}"
            )
        if model_type not in _SUPPORTED:
            model_type = next(
                (_ARCHITECTURES[a] for a in architectures or [] if a in _ARCHITECTURES),
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
        kw: dict[str, Any] = dict(_DEFAULTS[model_type])
        kw.update((k, raw[k]) for k in known if k in raw and raw[k] is not None)
        kw["model_type"] = model_type
        kw["indexer_rope_interleave"] = _SUPPORTED[model_type]
        dtype = raw.get("dtype")
        dtype = raw.get("torch_dtype") if dtype is None else dtype  # ("" is refused, not bf16)
        kw["dtype"] = "bfloat16" if dtype is None else dtype
        eos = raw.get("eos_token_id")
        kw["eos_token_ids"] = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if isinstance(kw.get("indexer_types"), list):
            kw["indexer_types"] = tuple(kw["indexer_types"])
        _check(kw, raw)
        kw["rope_parameters"] = _rope_parameters(raw)
        return cls(**kw)


# generation_config.json's sampling fields a request (or `LLM.generate` without params)
# that leaves them out takes, as vLLM's and SGLang's servers do by default; its
# max_new_tokens is `sampling_defaults["max_tokens"]`.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_overrides(value: str | dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's --override-generation-config (JSON text or a dict) checked: `SAMPLING_FIELDS`
    and max_new_tokens, each a number (max_new_tokens an integer >= 1) or null (which drops
    the model's); vLLM reads no other key, so another is an error, not a silent no-op.
    Errors say what is wrong, for the caller to name the flag or field."""
    if value is None:
        return {}
    gen = load_json(value, "not JSON", ConfigError) if isinstance(value, str) else value
    if not isinstance(gen, dict):
        raise ConfigError(f"must be a JSON object, got {gen!r:.80}")
    known = (*SAMPLING_FIELDS, "max_new_tokens")
    if stray := [k for k in gen if k not in known]:
        raise ConfigError(
            f"{', '.join(map(repr, stray))}: not a sampling default vLLM reads (it takes "
            f"{', '.join(known)})"
        )
    for k, v in gen.items():
        whole = type(v) is int and v >= 1
        if v is not None and not (whole if k == "max_new_tokens" else is_number(v)):
            want = "an integer >= 1" if k == "max_new_tokens" else "a number"
            raise ConfigError(f"{k} must be {want} or null, got {v!r}")
    return gen


def served_sampling_defaults(
    defaults: dict[str, Any], source: str = "auto", overrides: str | dict[str, Any] | None = None
) -> dict[str, Any]:
    """What requests leave out, as vLLM's `get_diff_sampling_param`: generation_config.json's
    `defaults` (none under `source` "vllm", its --generation-config), `overrides` over them
    (`generation_overrides`; a null drops the model's), max_new_tokens as `max_tokens`."""
    out = dict(defaults) if source != "vllm" else {}
    for k, v in generation_overrides(overrides).items():
        k = "max_tokens" if k == "max_new_tokens" else k
        out.pop(k, None)
        if v is not None:
            out[k] = v
    return out


def _with_generation_config(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """`raw` with generation_config.json's end-of-sequence ids added to its own (GLM and
    DeepSeek releases list their end-of-turn ids there) and its sampling defaults, both as
    vLLM and SGLang read them."""
    if not path.is_file():
        return raw
    try:
        text = path.read_text()
    except (ValueError, OSError) as e:  # (not UTF-8, unreadable)
        raise ConfigError(f"{path} is not a JSON object: {e}") from None
    gen = load_json(text, f"{path} is not a JSON object", ConfigError)
    if not isinstance(gen, dict):
        raise ConfigError(f"{path} is not a JSON object: {gen!r:.80}")
    eos = gen.get("eos_token_id")
    defaults = {k: gen[k] for k in SAMPLING_FIELDS if gen.get(k) is not None}
    if not all(is_number(v) for v in defaults.values()):
        raise ConfigError(f"{path}: {', '.join(defaults)} must be numbers, got {defaults}")
    if (most := gen.get("max_new_tokens")) is not None:  # vLLM's default and cap
        if type(most) is not int or most < 1:
            raise ConfigError(f"{path}: max_new_tokens must be an integer >= 1, got {most!r}")
        defaults["max_tokens"] = most
    raw = {**raw, "sampling_defaults": defaults}
    if eos is None:
        return raw
    ids = eos if isinstance(eos, list) else [eos]
    if not all(type(i) is int and i >= 0 for i in ids):
        raise ConfigError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
    own = raw.get("eos_token_id")
    own = own if isinstance(own, list) else [] if own is None else [own]
    return {**raw, "eos_token_id": [*own, *(i for i in ids if i not in own)]}


# Fields not named as in config.json: (its name, what it must be there).
_RAW = {"eos_token_ids": ("eos_token_id", "an integer or a list of integers")}


@cache
def _field_types() -> dict[str, Any]:
    return get_type_hints(ModelConfig)


def _describe(hint: Any) -> str:
    """`hint` in JSON terms: "an integer", "a list of strings or null"."""
    args = get_args(hint)
    if get_origin(hint) in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if get_origin(hint) is tuple:
        return f"a list of {_describe(args[0]).split(' ', 1)[1]}s"
    names = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}
    return names.get(hint) or {dict: "a JSON object", type(None): "null"}[get_origin(hint) or hint]


def _matches(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a `ModelConfig` field type (no bool passes as a number)."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if origin is tuple:
        return isinstance(value, tuple) and all(_matches(v, args[0]) for v in value)
    if hint in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, (int, float) if hint is float else origin or hint)


def _check(kw: dict[str, Any], raw: dict[str, Any]) -> None:
    """Every field's type (from the dataclass annotations), then the ranges the model needs."""
    for name, hint in _field_types().items():
        if name in kw and not _matches(kw[name], hint):
            key, what = _RAW.get(name, (name, _describe(hint)))
            value = raw.get(key, kw[name])
            raise ConfigError(f"model config field {key} must be {what}, got {value!r}")
    for name, low in _MINIMUM.items():
        if kw.get(name, low) < low:
            what = "positive" if low == 1 else f">= {low}"
            raise ConfigError(f"model config field {name} must be {what}, got {kw[name]}")
    for name, high in _MAXIMUM.items():
        if kw.get(name, 0) > high:
            raise ConfigError(f"model config field {name} must be <= {high}, got {kw[name]}")
    for name in _POSITIVE_FLOATS:
        if not 0 < kw.get(name, 1.0) < math.inf:  # (JSON's 1e400 parses as inf)
            raise ConfigError(
                f"model config field {name} must be positive and finite, got {kw[name]}"
            )
    if kw["dtype"] not in _DTYPES:
        raise ConfigError(
            f"model config field dtype must be one of {', '.join(_DTYPES)}, got {kw['dtype']!r}"
        )
    rope, index = kw["qk_rope_head_dim"], kw["index_head_dim"]
    if rope % 2:
        raise ConfigError(
            f"model config field qk_rope_head_dim must be even (RoPE rotates pairs), got {rope}"
        )
    if index < rope:  # the indexer ropes the first qk_rope_head_dim values of its head
        raise ConfigError(
            f"model config field index_head_dim ({index}) must be >= qk_rope_head_dim ({rope})"
        )
    e, k = kw["n_routed_experts"], kw["num_experts_per_tok"]
    groups, kept = kw.get("n_group", 1), kw.get("topk_group", 1)
    if k > e:
        raise ConfigError(
            f"model config field num_experts_per_tok ({k}) exceeds n_routed_experts ({e})"
        )
    if groups > 1 and (e % groups or e // groups < 2):
        raise ConfigError(
            f"model config field n_group ({groups}) must split n_routed_experts ({e}) "
            "into equal groups of at least 2 experts"
        )
    if groups > 1 and not kept <= groups:
        raise ConfigError(f"model config field topk_group ({kept}) exceeds n_group ({groups})")
    if groups > 1 and k > kept * (e // groups):
        raise ConfigError(
            f"model config field num_experts_per_tok ({k}) exceeds the {kept * (e // groups)} "
            f"experts of topk_group ({kept}) groups"
        )
    block = (kw.get("quantization_config") or {}).get("weight_block_size")
    if block is not None and not (
        isinstance(block, list) and len(block) == 2 and all(is_int(b) and b > 0 for b in block)
    ):
        raise ConfigError(
            "model config field quantization_config.weight_block_size must be two positive "
            f"integers, got {block!r}"
        )


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """Transformers-5 `rope_parameters` or legacy `rope_theta` + `rope_scaling`, read as
    transformers reads them: a `rope_scaling` (added to extend the context, as model cards
    say) replaces `rope_parameters` whole, its `rope_theta` included, the way transformers,
    and vLLM through it, apply it."""
    if not isinstance(raw.get("rope_scaling") or {}, dict):
        raise ConfigError(
            f"model config field rope_scaling must be a JSON object, got {raw['rope_scaling']!r}"
        )
    params: dict[str, Any] = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    if "type" in params:  # (legacy name; rope_type wins where both are given)
        params.setdefault("rope_type", params.pop("type"))
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    params.setdefault("rope_type", "default")
    if params["rope_type"] not in ("default", "yarn"):
        raise ConfigError(f"unsupported rope type {params['rope_type']!r} (default, yarn)")
    if params["rope_type"] == "yarn":
        params.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings"))
        if params.get("factor") is None:  # (as transformers refuses it)
            raise ConfigError("model config field rope_parameters.factor is required by yarn")
    for name in _ROPE_NUMBERS:
        value = params.get(name)
        if value is None:
            continue
        positive = name in _ROPE_NUMBERS[:3]
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (positive and not value > 0)
        ):
            raise ConfigError(
                f"model config field rope_parameters.{name} must be a "
                f"{'positive ' if positive else ''}number, got {value!r}"
            )
    return params
