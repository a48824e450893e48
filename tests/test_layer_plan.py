import logging

import pytest
from transformers import GlmMoeDsaConfig

from dsakv.config import LayerPlan, ModelConfig, preset
from dsakv.errors import ConfigError

from .conftest import small_glm_config


def _hf_types(n: int, **kw) -> list[str]:
    return list(GlmMoeDsaConfig(num_hidden_layers=n, **kw).indexer_types)


def test_glm52_plan():
    plan = LayerPlan.from_config(ModelConfig.resolve("glm-5.2"))
    assert plan.full_layers[:5] == (0, 1, 2, 6, 10) and plan.full_layers[-1] == 74
    assert (plan.num_full_layers, plan.num_shared_layers) == (21, 57)
    assert plan.pattern.startswith("FFFSSSFSSSF") and len(plan.pattern) == 78
    assert plan.topk_source(5) == 2 and plan.topk_source(6) == 6 and plan.topk_source(77) == 74


@pytest.mark.parametrize("freq", range(1, 9))
def test_freq_offset_matches_transformers(freq):
    for offset in range(1, 6):
        for n in range(8, 81):
            if _hf_types(n, index_topk_freq=freq, index_skip_topk_offset=offset)[0] != "full":
                continue  # transformers accepts plans with a shared layer 0; dsakv rejects them
            cfg = ModelConfig.from_hf(
                small_glm_config(n, index_topk_freq=freq, index_skip_topk_offset=offset)
            )
            expected = _hf_types(n, index_topk_freq=freq, index_skip_topk_offset=offset)
            assert list(LayerPlan.from_config(cfg).indexer_types) == expected, (freq, offset, n)
            # The same plan given as a user override.
            over = LayerPlan.from_config(
                ModelConfig.from_hf(small_glm_config(n)),
                index_topk_freq=freq,
                index_skip_topk_offset=offset,
            )
            assert list(over.indexer_types) == expected


@pytest.mark.parametrize("pattern", ["FFFFFFFF", "FSSSFSSS", "FFSFSSFS", "FSFSFSFSFS"])
def test_explicit_pattern_matches_transformers(pattern):
    n = len(pattern)
    cfg = ModelConfig.from_hf(small_glm_config(n, index_topk_pattern=pattern))
    assert list(LayerPlan.from_config(cfg).indexer_types) == _hf_types(
        n, index_topk_pattern=pattern
    )
    types = _hf_types(n, index_topk_pattern=pattern)
    cfg2 = ModelConfig.from_hf(small_glm_config(n, indexer_types=types))
    assert LayerPlan.from_config(cfg2).pattern == pattern


def test_source_priority():
    # indexer_types beats pattern and freq; a user override beats everything.
    cfg = ModelConfig.from_hf(
        small_glm_config(8, indexer_types=["full"] * 8, index_topk_pattern="FSSSFSSS", cli_factor=2)
    )
    assert LayerPlan.from_config(cfg).pattern == "F" * 8
    assert LayerPlan.from_config(cfg, index_topk_pattern="FFSSFFSS").pattern == "FFSSFFSS"
    assert LayerPlan.from_config(cfg, no_index_share=True).pattern == "F" * 8
    cfg = ModelConfig.from_hf(small_glm_config(8, index_topk_pattern="FSSSFSSS", cli_factor=2))
    assert LayerPlan.from_config(cfg).pattern == "FSSSFSSS"
    cfg = ModelConfig.from_hf(small_glm_config(8, cli_factor=3, index_topk_freq=2))
    assert LayerPlan.from_config(cfg).pattern == "FSSFSSFS"
    cfg = ModelConfig.from_hf(small_glm_config(8))
    assert LayerPlan.from_config(cfg).pattern == "F" * 8
    assert (
        LayerPlan.from_config(ModelConfig.resolve("glm-5.2"), no_index_share=True).num_shared_layers
        == 0
    )


def test_draft_layers_always_full():
    plan = LayerPlan.from_config(ModelConfig.resolve("glm-5.2"), draft_layers=2)
    assert plan.num_total_layers == 80
    assert plan.runs_indexer(78) and plan.owns_index_k(79) and plan.index_k_layers[-2:] == (78, 79)
    assert not plan.runs_indexer(77)
    with pytest.raises(IndexError):
        plan.runs_indexer(80)


@pytest.mark.parametrize("layer", [-1, -80, 80])
def test_a_layer_out_of_range_is_refused_not_wrapped(layer):
    plan = LayerPlan.from_config(ModelConfig.resolve("glm-5.2"), draft_layers=2)
    for query in (plan.runs_indexer, plan.owns_index_k, plan.topk_source):
        with pytest.raises(IndexError, match=rf"layer {layer} out of range 0\.\.79"):
            query(layer)


def test_from_config_takes_what_model_config_resolve_takes():
    want = LayerPlan.from_config(ModelConfig.resolve("glm-5.2"))
    assert LayerPlan.from_config("glm-5.2") == want
    assert LayerPlan.from_config(preset("glm-5.2")) == want
    with pytest.raises(TypeError, match="a ModelConfig, a preset name, a path or a config dict"):
        LayerPlan.from_config(78)


def test_disagreeing_indexer_types_warns(caplog):
    types = ["full"] * 8
    cfg = ModelConfig.from_hf(small_glm_config(8, indexer_types=types, index_topk_freq=2))
    with caplog.at_level(logging.WARNING):
        plan = LayerPlan.from_config(cfg)
    assert plan.pattern == "F" * 8
    assert "first at layer 2" in caplog.text


@pytest.mark.parametrize(
    ("kw", "override", "message"),
    [
        ({"index_topk_pattern": "SFFFFFFF"}, {}, "layer 0 is shared"),
        ({"indexer_types": ["full"] * 7}, {}, "indexer_types has 7 entries"),
        ({"index_topk_pattern": "FFF"}, {}, "index_topk_pattern has 3 characters"),
        ({"index_topk_pattern": "FFXFFFFF"}, {}, "'X' at layer 2"),
        ({"indexer_types": ["full", "dense"] + ["full"] * 6}, {}, r"indexer_types\[1\]"),
        ({"index_topk_freq": 0}, {}, "index_topk_freq must be"),
        ({"index_skip_topk_offset": 0}, {}, "index_skip_topk_offset must be"),
        ({"cli_factor": 0}, {}, "cli_factor must be"),
        ({}, {"index_topk_freq": 0}, "index_topk_freq must be"),
        ({}, {"index_topk_pattern": "SSSSSSSS"}, "layer 0 is shared"),
        ({}, {"index_topk_pattern": "FF", "no_index_share": True}, "choose one"),
        ({}, {"draft_layers": -1}, "draft_layers"),
    ],
)
def test_invalid_plans(kw, override, message):
    cfg = ModelConfig.from_hf(small_glm_config(8, **kw))
    with pytest.raises(ConfigError, match=message):
        LayerPlan.from_config(cfg, **override)


def test_preset_plans():
    assert LayerPlan.from_config(ModelConfig.resolve("glm-5")).num_shared_layers == 0
    assert LayerPlan.from_config(ModelConfig.resolve("deepseek-v3.2")).num_full_layers == 61
    assert len(preset("glm-5.2")["indexer_types"]) == 78
