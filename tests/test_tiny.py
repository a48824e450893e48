"""Tiny random presets: determinism, real-format files, tokenizer, GLM-5.2-equal cache bytes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from dsakv.config import LayerPlan, ModelConfig
from dsakv.config.presets import BOS_ID, EOS_ID
from dsakv.memory import CacheLayout
from dsakv.models import TINY_PRESETS, default_model_dir, load_model, write_tiny_model
from dsakv.models.tiny import hf_config

from .model_driver import greedy, make_pool


def _config(name: str) -> ModelConfig:
    return ModelConfig.from_hf(hf_config(name).to_dict())


@pytest.fixture(scope="module")
def seed0_tiny(tmp_path_factory):
    """glm-tiny written afresh with seed 0 (conftest's `glm_tiny` is the cached, MTP-fitted
    one: these tests check what `write_tiny_model` itself writes)."""
    return write_tiny_model(tmp_path_factory.mktemp("a"), "glm-tiny", seed=0)


def test_same_seed_same_weights_other_seed_differs(seed0_tiny, tmp_path):
    again = write_tiny_model(tmp_path / "b", "glm-tiny", seed=0)
    other = write_tiny_model(tmp_path / "c", "glm-tiny", seed=1)
    a, b, c = (load_file(p / "model.safetensors") for p in (seed0_tiny, again, other))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    # Real checkpoint format: per-expert tensors, indexer tensors on full layers only.
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in a
    assert "model.layers.0.self_attn.indexer.wq_b.weight" in a
    assert not any(k.startswith("model.layers.2.self_attn.indexer") for k in a)


def test_tokenizer_is_byte_level_with_chat_template(seed0_tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(seed0_tiny)
    text = "héllo, wörld ✓"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode())
    assert tok.decode(ids) == text
    assert (tok.bos_token_id, tok.eos_token_id) == (BOS_ID, EOS_ID)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    ids = chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat
    assert ids[0] == BOS_ID and tok.decode(ids[1:]).endswith("hi<|assistant|><think>")
    assert max(ids) < _config("glm-tiny").vocab_size


def test_tiny_models_run(seed0_tiny):
    model, config, plan = load_model(seed0_tiny)
    assert plan.num_full_layers >= 2 and plan.num_shared_layers >= 2
    tokens, logits = greedy(model, make_pool(config, plan), list(b"the quick brown fox"), 8)
    assert len(tokens) == 8 and torch.isfinite(logits).all()
    assert config.index_topk < 19  # the prompt already exercises sparsity


def test_bench_presets_match_glm52_cache_bytes():
    glm52 = CacheLayout.for_model("glm-5.2")
    bench = _config("glm-bench")
    plan = LayerPlan.from_config(bench)
    assert plan.indexer_types == glm52.plan.indexer_types
    assert (plan.num_full_layers, plan.num_shared_layers) == (21, 57)
    layout = CacheLayout.from_plan(bench, plan)
    assert layout.bytes_per_token == glm52.bytes_per_token == 47_700
    assert layout.dense().bytes_per_token == 55_224
    short = _config("glm-bench-short")
    short_plan = LayerPlan.from_config(short)
    assert short_plan.indexer_types == glm52.plan.indexer_types[:16]
    assert CacheLayout.from_plan(short, short_plan).index_k_bytes_per_layer == 132
    assert short.hidden_size == bench.hidden_size and short.index_topk == bench.index_topk


def test_deepseek_tiny_is_v32_with_yarn():
    cfg = _config("deepseek-tiny")
    assert cfg.model_type == "deepseek_v32" and not cfg.indexer_rope_interleave
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.n_group > 1
    assert set(TINY_PRESETS) >= {"glm-tiny", "glm-bench", "glm-bench-short", "deepseek-tiny"}


def test_default_model_dir_generates_once(tmp_path, monkeypatch):
    """(A named weight format: no MTP layer to fit, so the cache is written in seconds.)"""
    monkeypatch.setenv("DSAKV_CACHE", str(tmp_path))
    path = default_model_dir("glm-tiny", weights="fp32")
    assert path == tmp_path / "glm-tiny-fp32-chat2-seed0" and (path / "model.safetensors").is_file()
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir("glm-tiny", weights="fp32") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_unwritable_model_folders_are_one_error(tmp_path, monkeypatch):
    """A DsakvError (one CLI line) before seconds of generation, not an OSError traceback
    from the first write: a folder under a file, a $DSAKV_CACHE that is a file."""
    from dsakv.errors import DsakvError

    afile = tmp_path / "afile"
    afile.write_text("mine")
    with pytest.raises(DsakvError, match=f"{afile} is not a directory"):
        write_tiny_model(afile / "sub", "glm-tiny", mtp="none")
    monkeypatch.setenv("DSAKV_CACHE", str(afile))
    with pytest.raises(DsakvError, match=r"tiny-model cache .*afile is not a directory"):
        default_model_dir("glm-tiny", weights="fp32")
    assert afile.read_text() == "mine"
