"""The attention-backend seam: selection, errors, and the Triton backend end to end.

On a CPU the Triton backend runs under the Triton interpreter (`TRITON_INTERPRET=1`), so
these tests check dsakv's own kernels inside the real engine without a GPU: greedy tokens
must equal the torch reference on a config whose index_topk covers the context (every
position selected, so only rounding could differ), and decode steps go through the padded,
graph-capturable batch (`ForwardBatch.padded_decode`) with padding rows that write nowhere.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsakv import LLM, SamplingParams
from dsakv.engine import EngineConfig
from dsakv.errors import DsakvError
from dsakv.kernels import select_backend, torch_ops
from dsakv.memory import CacheLayout
from dsakv.models.tiny import TINY_PRESETS, write_tiny_model

from .conftest import flat_logprobs

ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("glm-tiny"), preset="glm-tiny", seed=0))


def _layout(tiny: str, **kw) -> CacheLayout:
    return CacheLayout.for_model(tiny, **kw)


def test_auto_on_cpu_is_the_cpu_backend_and_torch_stays_the_reference(tiny):
    kw = dict(n_heads=4, index_heads=16, index_topk=16)
    assert select_backend("auto", torch.device("cpu"), _layout(tiny), **kw).name == "cpu"
    ref = select_backend("torch", torch.device("cpu"), _layout(tiny), **kw)
    assert type(ref).__name__ == "TorchBackend"


def test_bad_backend_names_and_unavailable_libraries_are_clear_errors(tiny):
    with pytest.raises(DsakvError, match="attention_backend must be one of"):
        EngineConfig(model=tiny, attention_backend="cudnn")
    # FlashMLA / DeepGEMM are optional extras: asking for them without them says why.
    with pytest.raises(DsakvError, match="flashmla unavailable: .*flash_mla"):
        select_backend(
            "flashmla", torch.device("cpu"), _layout(tiny), n_heads=4, index_heads=16, index_topk=16
        )


def test_cli_rejects_a_bad_backend_in_one_line(tiny):
    proc = subprocess.run(
        [sys.executable, "-m", "dsakv.cli", "generate", tiny, "--prompt", "hi"]
        + ["--attention-backend", "cudnn"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: attention_backend must be one of")
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("ep", [(0, 4), (1, 3)], ids=["all-experts", "expert-range"])
def test_grouped_experts_equal_the_per_expert_loop(ep):
    """The graph-safe MoE (device offsets, grouped GEMMs) sums what the loop sums; choices
    of experts outside this rank's range contribute nothing."""
    g = torch.Generator().manual_seed(0)
    first, last = ep
    x = torch.randn(9, 16, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(9)])
    ids[0] = torch.tensor([0, 3])  # outside experts 1..2
    w = torch.rand(9, 2, generator=g)
    gate_up = torch.randn(last - first, 2 * 8, 16, generator=g)
    down = torch.randn(last - first, 16, 8, generator=g)
    loop = torch_ops.experts_loop(x, ids, w, gate_up, down, first, last)
    grouped = torch_ops.experts_grouped(x, ids, w, gate_up, down, first, last)
    torch.testing.assert_close(grouped, loop, atol=1e-5, rtol=1e-5)
    if ep == (1, 3):  # a token routed only to other ranks' experts gets exactly zero
        assert bool((grouped[0] == 0).all())
    # The CPU backend's one-token path (two GEMVs over the k chosen experts), row by row.
    for t in range(9):
        one = torch_ops.experts_one_token(
            x[t : t + 1], ids[t : t + 1], w[t : t + 1], gate_up, down, first, last
        )
        torch.testing.assert_close(one, loop[t : t + 1], atol=1e-5, rtol=1e-5)
        if ep == (1, 3) and t == 0:
            assert bool((one == 0).all())


def test_compiled_decode_steps_match_eager(tiny):
    """`enable_torch_compile` where the native blocks do not run (here: as without a C++
    compiler): decode steps of one request, and of two to four (a second specialisation),
    run each layer's blocks around attention compiled, the GEMVs as multiply-sums (another
    summation order). Under glm-tiny's index_topk 16 every position is selected, so greedy
    tokens equal eager's and the logprobs agree to fp32 rounding (an fp32 cache: in fp8, a
    row value at a rounding midpoint can flip and move a logprob by 1e-3); batches of more
    than four requests run eager."""
    from dsakv.kernels import cpu_ops
    from dsakv.models.decoder import attention_inputs, residual_ffn

    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=0)
    prompts = [[5, 17, 33, 2, 99], [7, 7, 8, 120, 3, 64, 200], [250, 1, 2, 3, 4, 5, 6, 7, 8]]
    kw = dict(device="cpu", page_size=16, num_pages=24, max_model_len=64, kv_cache_dtype="fp32")
    eager, compiled = LLM(tiny, **kw), LLM(tiny, enable_torch_compile=True, **kw)
    assert compiled.engine.backend.compile and not eager.engine.backend.compile
    eager.engine.backend.native = compiled.engine.backend.native = False
    for batch in (prompts[:1], prompts):
        ref, got = eager.generate(batch, params), compiled.generate(batch, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in ref]
        for a, b in zip(got, ref, strict=True):
            lps = [flat_logprobs(o.outputs[0].logprobs, o.token_ids) for o in (a, b)]
            torch.testing.assert_close(*lps, rtol=0, atol=1e-4)
    compiled.engine.check_integrity()
    for fn in (attention_inputs, residual_ffn):
        assert cpu_ops.compiled(fn).warmup_s > 0  # the compiled blocks ran


triton = pytest.importorskip("triton", reason="the Triton backend needs triton")


def _generate(tiny, prompts, params=GREEDY, **kw):
    llm = LLM(tiny, device="cpu", page_size=16, num_pages=24, max_model_len=64, **kw)
    outs = llm.generate(prompts, params)
    llm.engine.check_integrity()
    return [o.token_ids for o in outs], llm.engine


@pytest.mark.parametrize(
    "dtypes",
    # fp8_e4m3 + fp8 (the CPU default) runs in the device check's dry run below.
    [("fp8_ds_mla", "fp8"), ("fp32", "fp32")],
    ids=lambda d: "+".join(d),
)
def test_triton_backend_greedy_equals_torch(tiny, dtypes):
    """Three requests (decode batch 3 in graph bucket 4: one padding row) and prompts of
    5-9 tokens + 4 new ones: under glm-tiny's index_topk 16, so every position is selected
    and the two backends must produce the same greedy tokens."""
    kv, ik = dtypes
    prompts = [[5, 17, 33, 2, 99], [7, 7, 8, 120, 3, 64, 200], [250, 1, 2, 3, 4, 5, 6, 7, 8]]
    ref, _ = _generate(
        tiny, prompts, kv_cache_dtype=kv, index_k_dtype=ik, attention_backend="torch"
    )
    got, engine = _generate(
        tiny, prompts, kv_cache_dtype=kv, index_k_dtype=ik, attention_backend="triton"
    )
    assert engine.backend.name == "triton" and engine.runner.decode_graphs is not None
    assert got == ref


def test_triton_backend_chunked_and_cached_prefill_equals_torch(tiny):
    """Prefill in steps of 6 tokens, several requests' chunks at once beside decoding
    requests (one varlen launch, each chunk over its own context, the decode rows around
    them), and a prompt extending a cached prefix (its queries start past position 0):
    greedy tokens equal the torch reference's (contexts within index_topk, fp32 caches)."""
    first = [[5, 17, 33, 2, 99, 7, 7, 8], [250, 1, 2], [7, 8, 120, 3, 64, 200, 4]]
    second = [[5, 17, 33, 2, 99, 7, 7, 8, 120, 3, 64, 200]]  # its first 8 tokens cached

    def run(backend: str):
        llm = LLM(tiny, device="cpu", page_size=4, num_pages=32, max_model_len=64,
                  chunked_prefill_size=6, kv_cache_dtype="fp32", index_k_dtype="fp32",
                  attention_backend=backend)  # fmt: skip
        tokens = [o.token_ids for p in (first, second) for o in llm.generate(p, GREEDY)]
        llm.engine.check_integrity()
        return tokens, llm.engine.counters()["prefix_hit_tokens"]

    got, hits = run("triton")
    assert hits >= 8
    assert got == run("torch")[0]


def test_triton_backend_sparse_selection_agrees_with_torch(tiny):
    """Past index_topk (16) the indexer selects; the Triton path scores with bf16 queries
    over the fp8 keys, so agreement is measured, not assumed (measured: 12/12 tokens equal;
    the bound leaves room for a selection flipped by bf16 rounding of a near-tie)."""
    prompts = [list(range(3, 3 + 30)), list(range(40, 40 + 24))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ref, _ = _generate(tiny, prompts, params, attention_backend="torch")
    got, _ = _generate(tiny, prompts, params, attention_backend="triton")
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    assert same / sum(map(len, ref)) >= 0.8, (ref, got)


def test_triton_backend_hisparse_equals_its_roomy_pool(tmp_path):
    """HiSparse through the Triton resolve and row-copy kernels (interpreted on a CPU; four
    layers, two IndexShare groups): a prompt past the 32-slot hot buffer misses, and the
    tokens equal the same backend's without HiSparse (same rows, same order, other slots)."""
    four = {**TINY_PRESETS["glm-tiny"], "num_hidden_layers": 4}
    four["indexer_types"] = ["full", "shared", "full", "shared"]
    model = str(write_tiny_model(tmp_path, four, mtp="none"))
    prompts = [list(range(3, 3 + 36))]  # positions 32.. are not resident: they miss
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    exact = dict(kv_cache_dtype="fp32", index_k_dtype="fp32", attention_backend="triton")
    ref, _ = _generate(model, prompts, params, **exact)
    llm = LLM(model, device="cpu", page_size=16, num_pages=6, enable_hisparse=True,
              hisparse_config={"host_to_device_ratio": 4}, **exact)  # fmt: skip
    got = [o.token_ids for o in llm.generate(prompts, params)]
    llm.engine.check_integrity()
    assert got == ref and llm.engine.counters()["hisparse_misses"] > 0


def test_triton_backend_hisparse_verifies_mtp_drafts(tmp_path):
    """HiSparse under MTP through the Triton kernels (interpreted): a verify's two rows
    resolve the union of their top-k at once, the draft layer its own; past the buffer the
    tokens and the drafts kept equal the same backend's without HiSparse."""
    four = {**TINY_PRESETS["glm-tiny"], "num_hidden_layers": 4}
    four["indexer_types"] = ["full", "shared", "full", "shared"]
    model = str(write_tiny_model(tmp_path, four, mtp="fit"))
    # One token 36 times: the tiny target settles into repeating a token, which the fitted
    # draft predicts (it kept no draft of 3..38, where the drafts kept were equal as 0 = 0)
    prompts = [[63] * 36]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    exact = dict(kv_cache_dtype="fp32", index_k_dtype="fp32", attention_backend="triton",
                 speculative_algorithm="mtp", speculative_num_steps=1)  # fmt: skip
    ref, off = _generate(model, prompts, params, **exact)
    llm = LLM(model, device="cpu", page_size=16, num_pages=6, enable_hisparse=True,
              hisparse_config={"device_buffer_size": 32, "host_to_device_ratio": 4}, **exact)  # fmt: skip
    got = [o.token_ids for o in llm.generate(prompts, params)]
    llm.engine.check_integrity()
    c, want = llm.engine.counters(), off.counters()
    assert got == ref and c["hisparse_misses"] > 0 and c["spec_accepted_tokens"] > 0
    assert (c["spec_draft_tokens"], c["spec_accepted_tokens"]) == (
        want["spec_draft_tokens"],
        want["spec_accepted_tokens"],
    )
