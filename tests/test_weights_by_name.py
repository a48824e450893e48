"""SGLang's /get_weights_by_name (`LLM.get_weights_by_name`): what a trainer reads back after
an update is what it sent, the first rows of the checkpoint-shaped tensor in fp32, over one
rank and over `--tp 2 --ep 2` (each rank's slices and experts put together); FP8 blocks
come back dequantized; a name the model does not have is a 400 (a `DsakvError`)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from safetensors.torch import load_file

from dsakv.distributed.weight_sync import TensorUpdate
from dsakv.engine import LLM, EngineConfig
from dsakv.errors import DsakvError

from .serving import TIMEOUT, serving
from .test_update_weights import ENGINE_ARGS, _model

# Split by rows and by columns under --tp, rank 1's expert under --ep 2 (its projections'
# halves), a norm every rank holds whole, the vocabulary's two.
NAMES = [
    "model.layers.0.self_attn.q_b_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.1.mlp.experts.7.gate_proj.weight",
    "model.layers.1.mlp.experts.7.up_proj.weight",
    "model.layers.1.mlp.experts.7.down_proj.weight",
    "model.layers.1.input_layernorm.weight",
    "model.embed_tokens.weight",
    "lm_head.weight",
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("by_name")
    return {seed: _model(root, "glm-tiny", seed) for seed in (0, 1)}


def _read(llm_or_engine, name: str, rows: int = 100) -> torch.Tensor:
    return torch.tensor(llm_or_engine.get_weights_by_name(name, rows))


@pytest.mark.parametrize("layout", [{}, dict(tp=2, ep=2)], ids=["tp1", "tp2-ep2"])
def test_reads_back_what_a_tensor_update_sent(models, layout):
    old = load_file(models[0] / "model.safetensors")
    new = load_file(models[1] / "model.safetensors")
    with LLM(str(models[0]), **ENGINE_ARGS, **layout) as llm:
        for name in NAMES:
            assert torch.equal(_read(llm, name, 5), old[name][:5]), name
        llm.update_weights_from_tensor([(name, new[name]) for name in NAMES])
        for name in NAMES:  # (SGLang's default: 100 rows, here more than some have)
            assert torch.equal(_read(llm, name), new[name][:100]), name
        assert _read(llm, NAMES[0], 0).numel() == 0
        with pytest.raises(DsakvError, match="^the model has no tensor model.layers.0.nope.weight"):
            llm.get_weights_by_name("model.layers.0.nope.weight")
        with pytest.raises(DsakvError, match="shares another's indexer"):  # (plan FFSSFSFS)
            llm.get_weights_by_name("model.layers.2.self_attn.indexer.wk.weight")
        with pytest.raises(DsakvError, match="truncate_size must be an integer >= 0"):
            llm.get_weights_by_name(NAMES[0], -1)


def test_fp8_blocks_come_back_dequantized(tmp_path):
    """A CPU engine keeps FP8-block weights packed (`as_stored`): they read back as the
    checkpoint's e4m3 values times their block scales."""
    path = _model(tmp_path, "glm-tiny", 0, weights="fp8")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.self_attn.q_b_proj.weight"
    w, scale = tensors[name], tensors[name + "_scale_inv"]
    n, k = w.shape
    want = w.float() * scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    with LLM(str(path), **ENGINE_ARGS) as llm:
        assert llm.engine.model.get_parameter(name).dtype == torch.uint8  # (packed)
        assert torch.equal(_read(llm, name), want[:100])
        with pytest.raises(DsakvError, match="an FP8 block scale"):
            llm.get_weights_by_name(name + "_scale_inv")


def test_http_route(models):
    """GET and POST, SGLang's body; after an update the route answers the new values; an
    unknown name is a 400 in SGLang's error shape."""
    old = load_file(models[0] / "model.safetensors")
    new = load_file(models[1] / "model.safetensors")
    name = "model.layers.0.self_attn.q_a_proj.weight"
    with serving(EngineConfig(model=str(models[0]), **ENGINE_ARGS)) as (base, async_engine):
        url = f"{base}/get_weights_by_name"
        r = httpx.post(url, json={"name": name, "truncate_size": 3}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        assert torch.equal(torch.tensor(r.json()), old[name][:3])
        update = TensorUpdate(((name, new[name]),), flush_cache=True)
        call = async_engine.call(lambda e: e.update_weights(update))  # (a trainer in process)
        assert asyncio.run(asyncio.wait_for(call, TIMEOUT))
        r = httpx.request("GET", url, json={"name": name}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        assert torch.equal(torch.tensor(r.json()), new[name][:100])
        r = httpx.post(url, json={"name": "nope"}, timeout=TIMEOUT)
        assert r.status_code == 400
        assert r.json()["error"]["message"].startswith("the model has no tensor nope")
