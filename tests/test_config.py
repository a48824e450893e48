import json

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
    assert ds.rope_theta == 10000.0 and ds.is_fp8_block_quantized


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
