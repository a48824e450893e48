import json
import re

import pytest

from dsakv.config import ModelConfig, preset
from dsakv.errors import ConfigError


def test_presets_carry_public_shapes():
    glm = ModelConfig.resolve("glm-5.2")
    assert (glm.num_hidden_layers, glm.hidden_size, glm.num_attention_heads) == (78, 6144, 64)
    assert (glm.q_lora_rank, glm.kv_lora_rank, glm.qk_rope_head_dim) == (2048, 512, 64)
    assert (glm.qk_nope_head_dim, glm.v_head_dim, glm.vocab_size) == (192, 256, 154880)
    assert (glm.index_n_heads, glm.index_head_dim, glm.index_topk) == (32, 128, 2048)
    assert glm.indexer_rope_interleave and glm.num_nextn_predict_layers == 1
    ds = ModelConfig.resolve("deepseek-v3.2")
    assert (ds.num_hidden_layers, ds.hidden_size, ds.num_attention_heads) == (61, 7168, 128)
    assert (ds.n_group, ds.topk_group, ds.index_n_heads) == (8, 4, 64)
    assert not ds.indexer_rope_interleave
    assert ds.rope_parameters["rope_type"] == "yarn" and ds.rope_parameters["factor"] == 40
    assert ds.rope_theta == 10000.0
    assert ds.quantization_config["weight_block_size"] == [128, 128]


def test_from_hf_accepts_dir_file_and_dict(tmp_path):
    raw = preset("glm-5")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    a = ModelConfig.from_hf(tmp_path)
    b = ModelConfig.from_hf(tmp_path / "config.json")
    c = ModelConfig.from_hf(raw)
    assert a == b == c
    assert ModelConfig.resolve(str(tmp_path)) == a


def test_architecture_name_identifies_model_type():
    raw = preset("deepseek-v3.2")
    raw["model_type"] = "something_custom"
    assert ModelConfig.from_hf(raw).model_type == "deepseek_v32"


def test_legacy_and_v5_rope_fields_agree():
    legacy = preset("glm-5")
    legacy.pop("rope_parameters")
    legacy["rope_theta"] = 1e6
    assert (
        ModelConfig.from_hf(legacy).rope_parameters == ModelConfig.resolve("glm-5").rope_parameters
    )


def test_unsupported_model_type_is_named():
    raw = preset("glm-5")
    raw["model_type"] = "llama"
    raw["architectures"] = ["LlamaForCausalLM"]
    with pytest.raises(ConfigError, match="unsupported model_type 'llama'"):
        ModelConfig.from_hf(raw)


@pytest.mark.parametrize("field", ["kv_lora_rank", "index_topk", "num_hidden_layers"])
def test_missing_required_field_is_named(field):
    raw = preset("glm-5")
    del raw[field]
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf(raw)


def test_bad_field_value_and_bad_json(tmp_path):
    raw = preset("glm-5")
    raw["hidden_size"] = "big"
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_hf(raw)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_hf(tmp_path)
    with pytest.raises(ConfigError, match="no model config"):
        ModelConfig.from_hf(tmp_path / "missing")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"indexer_types": 5}, "indexer_types must be a list of strings or null, got 5"),
        ({"indexer_types": ["full", 1]}, "indexer_types must be a list of strings"),
        ({"rope_scaling": [1, 2]}, r"rope_scaling must be a JSON object, got \[1, 2\]"),
        ({"rope_parameters": "x"}, "rope_parameters must be a JSON object, got 'x'"),
        ({"rope_parameters": {"rope_theta": "x"}}, "rope_parameters.rope_theta must be a positive"),
        ({"quantization_config": "fp8"}, "quantization_config must be a JSON object or null"),
        ({"quantization_config": [1]}, "quantization_config must be a JSON object or null"),
        (
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}},
            "quantization_config.weight_block_size must be two positive integers",
        ),
        ({"first_k_dense_replace": "1"}, "first_k_dense_replace must be an integer, got '1'"),
        ({"first_k_dense_replace": -1}, "first_k_dense_replace must be >= 0, got -1"),
        ({"hidden_size": True}, "hidden_size must be an integer, got True"),
        ({"max_position_embeddings": "x"}, "max_position_embeddings must be an integer"),
        ({"max_position_embeddings": 0}, "max_position_embeddings must be positive"),
        ({"rms_norm_eps": "x"}, "rms_norm_eps must be a number, got 'x'"),
        ({"rms_norm_eps": 0}, "rms_norm_eps must be positive"),
        ({"eos_token_id": "x"}, "eos_token_id must be an integer or a list of integers"),
        ({"eos_token_id": [1, "x"]}, "eos_token_id must be an integer or a list of integers"),
        ({"bos_token_id": "x"}, "bos_token_id must be an integer or null"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob must be a boolean"),
        ({"dtype": "garbage"}, "dtype must be one of bfloat16, .*, got 'garbage'"),
        ({"torch_dtype": 5}, "dtype must be a string, got 5"),
        ({"num_experts_per_tok": 1000}, r"num_experts_per_tok \(1000\) exceeds n_routed_experts"),
        ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers must be >= 0, got -1"),
        ({"n_group": 0}, "n_group must be positive, got 0"),
        ({"n_group": 3}, r"n_group \(3\) must split n_routed_experts \(256\)"),
        ({"n_group": 8, "topk_group": 9}, r"topk_group \(9\) exceeds n_group \(8\)"),
        ({"n_group": 128, "num_experts_per_tok": 4}, r"num_experts_per_tok \(4\) exceeds the 2"),
        ({"routed_scaling_factor": "x"}, "routed_scaling_factor must be a number, got 'x'"),
        ({"routed_scaling_factor": 0}, "routed_scaling_factor must be positive"),
        ({"rms_norm_eps": 1e400}, "rms_norm_eps must be positive and finite, got inf"),
        ({"index_head_dim": 32}, r"index_head_dim \(32\) must be >= qk_rope_head_dim \(64\)"),
        ({"qk_rope_head_dim": 63}, "qk_rope_head_dim must be even .*, got 63"),
        ({"num_hidden_layers": 10**9}, "num_hidden_layers must be <= 4096, got 1000000000"),
        ({"num_nextn_predict_layers": 10**9}, "num_nextn_predict_layers must be <= 4096"),
        ({"n_routed_experts": 10**9}, "n_routed_experts must be <= 65536"),
    ],
)
def test_bad_field_type_or_range_is_named(edit, message):
    raw = {**preset("glm-5"), **edit}
    with pytest.raises(ConfigError, match=message) as e:
        ModelConfig.from_hf(raw)
    assert str(e.value).startswith("model config field ") and "\n" not in str(e.value)


def test_resolve_names_what_it_takes():
    with pytest.raises(TypeError, match="a ModelConfig, a preset name, a path or a config dict"):
        ModelConfig.resolve(["glm-5"])


def test_valid_field_variants_are_kept():
    raw = preset("glm-5")
    edit = {"routed_scaling_factor": 2, "eos_token_id": [1, 2], "rope_scaling": None}
    config = ModelConfig.from_hf({**raw, **edit, "quantization_config": None})
    assert config.routed_scaling_factor == 2 and config.eos_token_ids == (1, 2)
    assert config.quantization_config is None
    assert ModelConfig.from_hf({**raw, "eos_token_id": 7}).eos_token_ids == (7,)


def test_binary_file_as_config_is_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\xb8\x00\x00\x00garbage")
    with pytest.raises(ConfigError, match="model.safetensors is not valid JSON"):
        ModelConfig.from_hf(tmp_path / "model.safetensors")


_OPTIONAL = (
    "intermediate_size",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "first_k_dense_replace",
    "rms_norm_eps",
    "max_position_embeddings",
)


@pytest.mark.parametrize("name", ["glm-5.2", "deepseek-v3.2"])
def test_fields_a_config_leaves_out_mean_what_transformers_says(name):
    """A config.json without them reads as transformers' config class reads it (vLLM's and
    SGLang's reading): dsakv took routed_scaling_factor 1.0 (transformers 2.5), GLM's
    rms_norm_eps 1e-6 (1e-5), DeepSeek's n_group 1 (8), first_k_dense_replace 0 (3), a
    4,096-token context: other numbers, no error."""
    import transformers

    raw = {k: v for k, v in preset(name).items() if k not in _OPTIONAL}
    ours = ModelConfig.from_hf(raw)
    theirs = transformers.AutoConfig.for_model(**raw)
    assert {k: getattr(ours, k) for k in _OPTIONAL} == {k: getattr(theirs, k) for k in _OPTIONAL}


@pytest.mark.parametrize(
    "fields",
    [
        {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}},
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_theta": 5e5},
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 7e5}},
        {"rope_scaling": {}},
    ],
    ids=["legacy-type", "top-level-theta", "own-theta", "empty"],
)
def test_rope_scaling_beside_rope_parameters_reads_as_transformers_reads_it(fields):
    """A transformers-5 config.json (`rope_parameters`) with a `rope_scaling` added, as model
    cards say to extend the context: transformers (and vLLM through it) apply it in place of
    `rope_parameters`, dsakv kept the default RoPE (other logits, no error)."""
    import transformers

    raw = {**preset("glm-5"), "rope_scaling": None, "rope_theta": None, **fields}
    raw = {k: v for k, v in raw.items() if v is not None}
    assert raw["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}
    theirs = dict(transformers.AutoConfig.for_model(**json.loads(json.dumps(raw))).rope_parameters)
    theirs.pop("type", None)  # (kept beside rope_type, unread)
    assert ModelConfig.from_hf(raw).rope_parameters == theirs


def test_yarn_without_its_factor_is_one_error():
    raw = preset("deepseek-v3.2")
    raw["rope_scaling"] = {k: v for k, v in raw["rope_scaling"].items() if k != "factor"}
    with pytest.raises(ConfigError, match="rope_parameters.factor is required by yarn"):
        ModelConfig.from_hf(raw)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"model_type": ["glm_moe_dsa"]}, "model_type must be a string, got ['glm_moe_dsa']"),
        ({"model_type": {"a": 1}}, "model_type must be a string"),
        ({"model_type": None, "architectures": [["GlmMoeDsaForCausalLM"]]}, "architectures must"),
        ({"model_type": None, "architectures": 5}, "architectures must be a list of strings"),
        ({"model_type": None, "architectures": "GlmMoeDsaForCausalLM"}, "architectures must"),
    ],
)
def test_model_type_and_architectures_must_be_strings(edit, message):
    """Both are looked up in dicts: a list was a TypeError (unhashable), not a ConfigError."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig.from_hf({**preset("glm-5"), **edit})


def test_null_model_type_and_architectures_are_left_out():
    raw = {**preset("glm-5"), "architectures": None}
    assert ModelConfig.from_hf(raw).model_type == "glm_moe_dsa"
    raw = {**preset("glm-5"), "model_type": None, "architectures": ["GlmMoeDsaForCausalLM"]}
    assert ModelConfig.from_hf(raw).model_type == "glm_moe_dsa"


@pytest.mark.parametrize(
    ("dtype", "message"),
    [("", "dtype must be one of"), (0, "dtype must be a string"), ({}, "dtype must be a string")],
)
def test_an_empty_dtype_is_not_bfloat16(dtype, message):
    """ "dtype": "" / 0 / {} became bfloat16 without a word (`or` took them for absent)."""
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf({**preset("glm-5"), "dtype": dtype})
    # Absent or null: torch_dtype, then bfloat16.
    raw = {**preset("glm-5"), "dtype": None, "torch_dtype": "float16"}
    assert ModelConfig.from_hf(raw).dtype == "float16"
    raw = {k: v for k, v in preset("glm-5").items() if k not in ("dtype", "torch_dtype")}
    assert ModelConfig.from_hf(raw).dtype == "bfloat16"
