"""No host sync inside a padded decode step (what a CUDA graph captures), proved on a CPU.

`host_sync.no_host_sync` fails on any call that hands a tensor value to the host or whose
output shape depends on values; first it is shown to catch each of them, then the whole
padded decode step of MoE models (router, grouped experts, indexer, sparse attention, the
stores) runs under it on the Triton backend (interpreter), past index_topk so the sparse
selection is exercised.
"""

from __future__ import annotations

import pytest
import torch

from dsakv import LLM, SamplingParams
from dsakv.engine.cuda_graph import width_buckets
from dsakv.kernels import torch_ops
from dsakv.models.tiny import write_tiny_model

from .host_sync import HostSync, guarding, no_host_sync

x = torch.arange(12.0).view(3, 4)
flags = torch.tensor([True, False, True])


def _bincount_offsets(key: torch.Tensor) -> torch.Tensor:
    """How `experts_grouped` found its group offsets before (a host sync on CUDA)."""
    return torch.bincount(key, minlength=4)[:3].cumsum(0)


@pytest.mark.parametrize(
    "sync",
    [
        lambda: x.sum().item(),
        lambda: x[0].tolist(),
        lambda: x.cpu(),
        lambda: x.numpy(),
        lambda: 1 if x.max() > 3 else 0,  # a Python branch on a value
        lambda: int(x.argmax()),
        lambda: float(x.mean()),
        lambda: x[flags],  # boolean mask indexing
        lambda: x.nonzero(),
        lambda: torch.where(x > 3),  # one-argument where is nonzero inside
        lambda: torch.unique(x),
        lambda: x.masked_select(x > 3),
        lambda: x.repeat_interleave(torch.tensor([1, 2, 0]), dim=0),
        lambda: range(10)[torch.tensor(2)],
        lambda: _bincount_offsets(torch.tensor([0, 2, 2, 3])),
    ],
    ids=[
        "item",
        "tolist",
        "cpu",
        "numpy",
        "branch",
        "int",
        "float",
        "bool-index",
        "nonzero",
        "where-1-arg",
        "unique",
        "masked_select",
        "repeat_interleave",
        "index",
        "bincount",
    ],
)
def test_the_guard_catches_every_kind_of_host_sync(sync):
    with pytest.raises(HostSync), no_host_sync():
        sync()


def test_the_guard_lets_device_only_work_through():
    with no_host_sync() as guard:
        y = torch.where(x > 3, x * 2, 0).masked_fill(flags[:, None], -1)
        order = y.flatten().argsort(stable=True)
        ends = torch.searchsorted(y.flatten()[order], torch.arange(3.0))
        z = y[torch.tensor([0, 2])].index_copy(0, torch.tensor([1, 0]), y[:2]) + ends.sum()
    assert guard.calls > 5 and z.shape == (2, 4)


def test_grouped_experts_have_no_host_sync():
    """The MoE of a captured step: group offsets by `searchsorted` on the device, each
    token's k outputs added in choice order (no atomics); the same sum as the loop."""
    g = torch.Generator().manual_seed(0)
    t, k, e, h, i = 7, 4, 6, 16, 8
    xs = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    gate_up, down = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    with no_host_sync():
        out = torch_ops.experts_grouped(xs, ids, w, gate_up, down, 0, e)
    torch.testing.assert_close(out, torch_ops.experts_loop(xs, ids, w, gate_up, down, 0, e))


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset,caches",
    [
        ("glm-tiny", {}),
        ("deepseek-tiny", {}),
        ("glm-tiny", dict(kv_cache_dtype="fp32", index_k_dtype="fp32")),
    ],
    ids=["glm-tiny", "deepseek-tiny", "glm-tiny-fp32-caches"],
)
def test_a_padded_decode_step_has_no_host_sync(tmp_path, preset, caches):
    """The step the engine captures on CUDA, every layer of an MoE model (and the torch
    indexer fallback of fp32 index-K): the guard wraps the model inside `DecodeGraphs`, so
    only what a graph would hold is checked (the step's buffers are filled on the host
    before it, outside the graph)."""
    model = str(write_tiny_model(tmp_path / preset, preset=preset, seed=0))
    llm = LLM(
        model, device="cpu", attention_backend="triton", page_size=16, max_model_len=96, **caches
    )
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None, "the triton backend runs decode padded"
    # Prompts past index_topk (16): the indexer selects, the padded table is wider still.
    prompts = [list(range(3, 3 + n)) for n in (20, 33)]
    with guarding(graphs) as guards:
        out = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert all(len(o.token_ids) == 3 for o in out)
    assert len(guards) >= 2 and all(g.calls > 100 for g in guards)


def test_width_buckets_are_page_aligned_powers_of_four_below_max_len():
    assert width_buckets(64, 16) == [64]
    assert width_buckets(1024, 16) == [256, 1024]
    assert width_buckets(1000, 16) == [1008]
    assert width_buckets(131072, 64) == [512, 2048, 8192, 32768, 131072]
    assert all(w % 64 == 0 for w in width_buckets(100_000, 64))


@pytest.mark.slow
def test_a_step_sized_by_its_context_computes_what_the_full_width_does(tmp_path):
    """A 20-token request decodes in the 256-wide bucket, not the 1024 of max_model_len;
    the extra columns are masked, so the hidden states are the same bits."""
    model = str(write_tiny_model(tmp_path / "m", preset="glm-tiny", seed=0))
    llm = LLM(model, device="cpu", attention_backend="triton", page_size=16, max_model_len=1024)
    graphs = llm.engine.runner.decode_graphs
    assert graphs.widths == [256, 1024]
    llm.generate([list(range(3, 23))], SamplingParams(max_tokens=1, temperature=0))
    slots = [torch.arange(21, dtype=torch.long)]  # pages 0-1 of a fresh pool: 20 + 1 new
    narrow = graphs.run([[7]], slots)
    widths, graphs.widths = graphs.widths, [1024]
    full = graphs.run([[7]], slots)
    graphs.widths = widths
    assert torch.equal(narrow, full)
