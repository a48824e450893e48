"""Pipeline parallelism (`--pp-size`) on CPU ranks (gloo): each stage builds, loads and
caches only its layers, a stage starting on a shared layer receives its source's top-k, and
the outputs are the one-stage engine's, bit for bit (the same computation per layer): the
even split, a custom partition with the host tier and n-gram drafts, three stages, TP x PP,
MTP, weight updates, sleep mode and profiles; each stage sizes its own pool; what pp > 1
refuses is one error line."""

from __future__ import annotations

import os
import random

import pytest
import torch
from safetensors.torch import load_file

from dsakv import LLM, SamplingParams
from dsakv.config.parallel import ParallelConfig
from dsakv.distributed.parallel import ParallelState, agreed
from dsakv.engine import EngineConfig, launch
from dsakv.errors import DsakvError
from dsakv.memory import CacheLayout, plan_capacity
from dsakv.memory.capacity import gpu_kv_budget_bytes, stage_kv_budget_bytes
from dsakv.models import load_model, loader
from dsakv.models.lora import adaptable
from dsakv.models.stages import MissingLayer

from .conftest import cli_error_line, flat_logprobs

GIB = 1 << 30

EXACT = dict(kv_cache_dtype="fp32", index_k_dtype="fp32", device="cpu", page_size=16)
# Chunked prefill (16-token chunks), sampled-token and prompt logprobs (`runner.logits`)
PARAMS = SamplingParams(
    max_tokens=16, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1
)
CACHED = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
ENGINE = dict(EXACT, num_pages=48, chunked_prefill_size=16)
# glm-tiny: indexer_types F F S S F S F S, index_topk 16 (every context here passes it).
PARTITION = (3, 5)  # stage 1 starts on shared layer 3, whose top-k is layer 1's (stage 0)


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(256) for _ in range(rng.randint(8, 60))] for _ in range(n)]


PROMPTS = _prompts(5) + [list(range(40, 100))]
# After PROMPTS: a prefix-cache hit on the last one's first 3 pages
AGAIN = [PROMPTS[-1][:48] + [1, 2, 3]]


def _outputs(llm: LLM, prompts=PROMPTS, params=PARAMS, again=AGAIN) -> list:
    """Each request's tokens, their top-2 logprobs and its prompt logprobs: `prompts`, then
    `again` (once the first are cached; without prompt logprobs, which skip the cache)."""
    outs = llm.generate(prompts, params) + (llm.generate(again, CACHED) if again else [])
    llm.engine.check_integrity()
    return [
        (
            o.outputs[0].token_ids,
            flat_logprobs(o.outputs[0].logprobs, o.outputs[0].token_ids, 2),
            o.prompt_logprobs and flat_logprobs(o.prompt_logprobs, o.prompt_token_ids),
        )
        for o in outs
    ]


def _run(model: str, **kw) -> tuple[list, dict]:
    with LLM(model, **{**ENGINE, **kw}) as llm:
        return _outputs(llm), llm.engine.counters()


@pytest.fixture(scope="module")
def reference(glm_tiny):
    return _run(glm_tiny)


@pytest.fixture(scope="class")
def pp2(glm_tiny):
    """A 2-stage engine (4 + 4 layers) for `TestEvenSplit`, closed after it (one multi-rank
    engine a process)."""
    with LLM(glm_tiny, **ENGINE, pp=2) as llm:
        yield llm


class TestEvenSplit:
    def test_two_stages_equal_one(self, reference, pp2):
        """The even split (4 + 4 layers): same tokens, logprobs and prompt logprobs over
        chunked prefills and a prefix-cache hit."""
        outs, counters = reference
        assert _outputs(pp2) == outs
        hits = pp2.engine.counters()["prefix_hit_tokens"]
        assert hits == counters["prefix_hit_tokens"] > 0

    def test_each_stage_names_its_trace(self, pp2, tmp_path):
        """SGLang's trace names: each rank's TP rank in its stage, then the stage."""
        pp2.start_profile(output_dir=str(tmp_path), with_stack=False)
        pp2.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
        names = [os.path.basename(p).split("-", 1)[1] for p in pp2.stop_profile()]
        assert names == ["TP-0-PP-0.trace.json.gz", "TP-0-PP-1.trace.json.gz"]

    def test_weight_updates_and_sleep_reach_every_stage(self, glm_tiny, reference, pp2):
        """A tensor of stage 1's layer updated and read back by name, sleep mode level 2 (the
        weights discarded) and the checkpoint loaded again: each stage reads its own tensors."""
        name = "model.layers.6.self_attn.kv_b_proj.weight"
        stored = load_file(f"{glm_tiny}/model.safetensors")[name]
        assert pp2.get_weights_by_name(name, 2) == stored[:2].tolist()
        pp2.update_weights_from_tensor([(name, torch.zeros_like(stored))])
        assert pp2.get_weights_by_name(name, 2) == torch.zeros(2, stored.shape[1]).tolist()
        pp2.sleep(level=2)
        pp2.wake_up()
        pp2.update_weights(glm_tiny)
        assert pp2.get_weights_by_name(name, 2) == stored[:2].tolist()
        assert _outputs(pp2) == reference[0]


def test_a_stage_starting_on_a_shared_layer_gets_its_topk(glm_tiny):
    """Partition 3,5: layer 3 (stage 1) reads layer 1's top-k, sent with the hidden rows.
    With a small pool and a host tier (a prefix goes to the host and back, each stage
    replaying rank 0's copies on its own layers) and n-gram drafts (verify rows)."""
    kw = dict(num_pages=10, host_pool_gib=0.01, speculative_algorithm="ngram")
    one, c1 = _run(glm_tiny, **kw)
    two, c2 = _run(glm_tiny, pp=2, pp_layer_partition=PARTITION, **kw)
    assert two == one
    assert c2["retractions_to_host"] > 0 and c2["host_bytes_to_device"] > 0
    assert c2["spec_verify_steps"] == c1["spec_verify_steps"] > 0


def test_a_stage_builds_loads_and_caches_only_its_layers(glm_tiny, monkeypatch, caplog):
    """Stage 1 of partition 3,5 (built without a process group: nothing runs): layers 3..7
    and the MTP layer, no indexer on shared layer 3; the other stage's parts are
    placeholders that say where they run, and are never read (the stage's pool:
    test_pp_memory)."""
    read: list[str] = []
    copy = loader._copy
    monkeypatch.setattr(loader, "_copy", lambda name, *a: (read.append(name), copy(name, *a)))
    stage = ParallelState(ParallelConfig(pp=2, pp_layer_partition=PARTITION), rank=1)
    with caplog.at_level("INFO", logger="dsakv.models.loader"):
        model, config, plan = load_model(glm_tiny, parallel=stage, draft_layers=1)
    assert "tensors to other pipeline stages" in caplog.text  # (layers 0-2, the embedding)
    layers = {int(n.split(".")[2]) for n, _ in model.named_parameters() if ".layers." in n}
    assert layers == {3, 4, 5, 6, 7, 8}
    assert {int(n.split(".")[2]) for n in read if ".layers." in n} == layers
    assert plan.carried_sources(3) == (1,)
    assert not hasattr(model.model.layers[3].self_attn, "indexer")
    assert hasattr(model.model.layers[4].self_attn, "indexer")
    assert isinstance(model.model.layers[2], MissingLayer)
    # LoRA's targets by their checkpoint names (the stage's own layers' numbers)
    assert {int(n.split(".")[2]) for n, _ in adaptable(model)} == set(range(3, 8))
    with pytest.raises(DsakvError, match="model.layers.2 is held by pipeline stage 0"):
        model.model.layers[2](None)


def test_three_stages_forward_a_carried_topk(glm_tiny, reference):
    """Partition 2,1,5 (given as vLLM's keyword and a string): stage 1 is shared layer 2
    alone, reading layer 1's top-k (stage 0) and sending it on to stage 2, whose first
    layer 3 reads it too; the same tokens and logprobs as one stage. The KV bytes per token
    (/metrics' dsakv_kv_bytes_per_token) are the whole model's, as with one stage, not rank
    0's stage's (layers 0-1, both full: nothing saved); /server_info has SGLang's pp_size
    and each stage's layers."""
    with LLM(glm_tiny, **ENGINE, pipeline_parallel_size=3, pp_layer_partition="2,1,5") as llm:
        assert llm.engine.config.pp_layer_partition == (2, 1, 5)
        assert _outputs(llm) == reference[0]
        counters, info = llm.engine.counters(), llm.get_server_info()
    per_token = ("bytes_per_token", "index_k_bytes_per_token_saved")
    assert [counters[k] for k in per_token] == [reference[1][k] for k in per_token]
    assert counters["index_k_bytes_per_token_saved"] > 0
    assert (info["tp_size"], info["pp_size"], info["pp_layer_partition"]) == (1, 3, [2, 1, 5])


def test_a_host_tier_of_no_page_is_one_error_with_stages(glm_tiny):
    """The host tier's GiB that holds no page is refused in the same words with stages as
    without (the least stage's page size)."""
    for pp in (1, 2):
        with pytest.raises(DsakvError, match=r"1e-09 GiB holds no \d+-byte page"):
            LLM(glm_tiny, **ENGINE, pp=pp, host_pool_gib=1e-9)


def test_each_stage_sizes_its_pages_from_its_own_budget(glm_tiny):
    """--mem-fraction-static under pp: each stage's budget is the least of its own ranks',
    its pages that budget over its own layout, the pool the least stage's pages. Stage 0
    (layers 0-2) with 4 GiB free of 10 after its load, stage 1 (3-7 and the MTP layer) 8:
    at 0.9, 3 and 7 GiB; stage 0's 3 GiB limits the pool (25,266 pages), not stage 1
    sized from stage 0's budget (13,066)."""
    whole = CacheLayout.for_model(glm_tiny, draft_layers=1)
    stages = [
        whole.for_stage(r) for r in ParallelConfig(pp=2, pp_layer_partition=(3, 5)).stage_layers(8)
    ]
    mem = [(10 * GIB, 4 * GIB), (10 * GIB, 8 * GIB)]
    budgets = [stage_kv_budget_bytes(0.9, mem, 1, s) for s in (0, 1)]
    assert budgets == [int(10 * GIB * 0.9) - 6 * GIB, int(10 * GIB * 0.9) - 2 * GIB]

    def pages(budget: int, layout: CacheLayout) -> int:
        return plan_capacity(layout, kv_budget_gib=budget / GIB).num_pages

    assert min(pages(b, lay) for b, lay in zip(budgets, stages)) == 25_266
    assert min(pages(gpu_kv_budget_bytes(0.9, mem), lay) for lay in stages) == 13_066
    # Two TP ranks a stage: the least of each stage's own ranks
    four = [(10 * GIB, 5 * GIB), (10 * GIB, 4 * GIB), (10 * GIB, 8 * GIB), (10 * GIB, 7 * GIB)]
    assert [stage_kv_budget_bytes(0.9, four, 2, s) / GIB for s in (0, 1)] == pytest.approx([3, 6])
    with pytest.raises(DsakvError, match="the weights of rank 3 take"):  # (on every rank)
        stage_kv_budget_bytes(0.9, [*four[:3], (10 * GIB, GIB // 2)], 2, 0)


def test_deterministic_stages_hold_the_least_stages_pages(glm_tiny):
    """Under --kv-budget-gib each stage's layout buys its own pages (partition 3,5: stage 1's
    5 layers cost more a page than rank 0's 3) and the pool is the least stage's, not rank
    0's; with --enable-deterministic-inference, the tokens and logprobs of one stage."""
    budget = 0.015
    kw = dict(EXACT, chunked_prefill_size=16, kv_budget_gib=budget)
    kw["enable_deterministic_inference"] = True
    with LLM(glm_tiny, **kw) as llm:
        one = _outputs(llm)
    with LLM(glm_tiny, **kw, pp=2, pp_layer_partition=PARTITION) as llm:
        two, pages = _outputs(llm), llm.engine.allocator.num_pages
        draft = llm.engine.plan.num_draft_layers
    whole = CacheLayout.for_model(glm_tiny, "fp32", "fp32", 16, draft_layers=draft)
    per_stage = [
        plan_capacity(whole.for_stage(r), kv_budget_gib=budget).num_pages
        for r in (range(0, 3), range(3, 8))
    ]
    assert pages == per_stage[1] < per_stage[0]
    assert two == one


def test_what_a_stage_sends_is_what_the_next_reads():
    """A tensor is sent in the dtype its receiver reads (NCCL checks none): cast there; a
    shape the receiver does not read is an error before anything is sent."""
    like = [((2, 3), torch.bfloat16), ((2, 4), torch.int32)]
    x, rows = agreed([torch.ones(2, 3), torch.ones(2, 4, dtype=torch.long)], like)
    assert (x.dtype, rows.dtype) == (torch.bfloat16, torch.int32)
    with pytest.raises(RuntimeError, match="the receiver reads"):
        agreed([torch.ones(3, 3), torch.ones(2, 4)], like)


def test_layer_partition_and_vllm_names_as_keywords(glm_tiny):
    """`LLM(pp_layer_partition="3,5")` as the flag takes it, and vLLM's
    tensor_parallel_size / pipeline_parallel_size as tp / pp; bad ones one error."""
    config = EngineConfig.from_kwargs(
        glm_tiny, tensor_parallel_size=2, pipeline_parallel_size=2, pp_layer_partition="3,5"
    )
    assert (config.tp, config.pp, config.pp_layer_partition) == (2, 2, (3, 5))
    assert EngineConfig.from_kwargs(glm_tiny, pp=2, pp_layer_partition=[3, 5]).parallel.pp == 2
    for bad in ("3,x", 5, "3,0"):
        with pytest.raises(DsakvError, match="pp_layer_partition must be comma-separated"):
            EngineConfig.from_kwargs(glm_tiny, pp=2, pp_layer_partition=bad)
    with pytest.raises(DsakvError, match="pp and pipeline_parallel_size are one setting"):
        EngineConfig.from_kwargs(glm_tiny, pp=2, pipeline_parallel_size=2)


def test_the_ranks_flags_are_said_alike(monkeypatch):
    """The ranks' flags in ParallelConfig's and the launcher's errors: --pp-size only
    where given."""
    with pytest.raises(DsakvError, match=r"^3 ranks \(--tp 3\) are not divisible by --nnodes 2"):
        ParallelConfig(tp=3, nnodes=2)
    with pytest.raises(DsakvError, match=r"6 ranks \(--tp 3 x --pp-size 2\) are not divisible"):
        ParallelConfig(tp=3, pp=2, nnodes=4)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(DsakvError, match="started 3 processes but --tp 2 makes 2 ranks"):
        launch._torchrun_rank(ParallelConfig(tp=2))


def test_tp2_by_pp2_equals_tp2(glm_tiny):
    """4 ranks (2 stages of 2 TP ranks) against the 2 TP ranks: the model's collectives run
    over each stage's TP group; same tokens and logprobs."""
    prompts, params = PROMPTS[:3], SamplingParams(max_tokens=8, temperature=0, logprobs=1)
    outs = {}
    for pp in (1, 2):
        with LLM(glm_tiny, **ENGINE, tp=2, pp=pp) as llm:
            outs[pp] = _outputs(llm, prompts, params, again=None)
    assert outs[2] == outs[1]


def test_mtp_on_the_last_stage_keeps_tokens_and_drafts(glm_tiny, reference):
    """The MTP layer on the last stage (its draft logits sent to rank 0, chained there):
    the greedy tokens are the target's, and the drafts and acceptances one stage makes."""
    mtp = dict(speculative_algorithm="mtp", speculative_num_steps=3)
    one, c1 = _run(glm_tiny, **mtp)
    two, c2 = _run(glm_tiny, pp=2, **mtp)
    assert [t for t, *_ in two] == [t for t, *_ in reference[0]]
    assert two == one
    keys = ("spec_draft_tokens", "spec_accepted_tokens", "spec_verify_steps")
    assert [c2[k] for k in keys] == [c1[k] for k in keys]
    assert c2["spec_accepted_tokens"] > 0


STORED = [random.Random(5).randrange(256) for _ in range(150)]  # 9 full pages of 16


def _stored_run(model: str, store, **kw) -> tuple[list[int], dict]:
    """Greedy tokens of `STORED` and the counters, from an engine over the file store
    `store` (closed after: its write-back pages stored)."""
    l3 = dict(hicache_storage_backend="file", hicache_storage_dir=str(store))
    with LLM(model, **{**ENGINE, **l3, **kw}) as llm:
        tokens = llm.generate([STORED], CACHED)[0].token_ids
        llm.engine.check_integrity()
        return tokens, llm.engine.counters()


def _objects(store) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(store.glob("*/*.kv"))}


def test_a_stored_page_is_the_whole_models_at_any_stage_count(glm_tiny, tmp_path):
    """Under pipeline stages rank 0's L3 tier stores each page as the whole model's bytes
    (every stage sends its layers' part) and writes a page it reads into every stage's pool:
    two stages store the objects one stage stores, byte for byte, and each finds the
    other's pages and gives the tokens it computes itself."""
    one, two = tmp_path / "one", tmp_path / "two"
    cold, _ = _stored_run(glm_tiny, one)
    staged, _ = _stored_run(glm_tiny, two, pp=2, pp_layer_partition="3,5")
    assert staged == cold and _objects(two) == _objects(one) and len(_objects(one)) >= 9
    for store, kw in ((one, dict(pp=2, pp_layer_partition="3,5")), (two, {})):
        warm, c = _stored_run(glm_tiny, store, **kw)
        assert warm == cold and c["l3_hits"] == 9, kw
        assert c["computed_tokens"] == 150 - 9 * 16 + CACHED.max_tokens - 1


def test_hisparse_stages_read_a_stored_page_into_their_host_rows(glm_tiny, tmp_path):
    """Under HiSparse a page read back goes to each stage's host latent rows (and index-K
    to its device pool): two stages find one stage's pages and give its tokens."""
    hisparse = dict(enable_hisparse=True, hisparse_config={"host_to_device_ratio": 4})
    cold, first = _stored_run(glm_tiny, tmp_path, **hisparse)
    warm, c = _stored_run(glm_tiny, tmp_path, pp=2, pp_layer_partition="3,5", **hisparse)
    assert warm == cold and first["l3_pages_written"] >= 9 and c["l3_hits"] == 9
    assert c["hisparse_misses"] > 0


def test_write_back_under_stages_stores_the_host_tiers_pages(glm_tiny, tmp_path):
    """Write-back under two stages: pages on the host tier when the engine closes are read
    from every stage's host pool; one stage then finds the first prompt's pages."""
    prompts = [STORED] + [[random.Random(i).randrange(256) for _ in range(150)] for i in (6, 7)]
    kw = dict(ENGINE, num_pages=16, host_pool_gib=0.05, pp=2)
    l3 = dict(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path))
    with LLM(glm_tiny, **kw, **l3, hicache_write_policy="write_back") as llm:
        for prompt in prompts:  # (one at a time: the first's pages go to the host tier)
            llm.generate([prompt], CACHED)
        assert llm.engine.cache.num_host_pages >= 9
    cold, _ = _stored_run(glm_tiny, tmp_path / "none")
    warm, c = _stored_run(glm_tiny, tmp_path)
    assert warm == cold and c["l3_hits"] == 9


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--enable-torch-compile"], "--enable-torch-compile runs on one rank (its compiled"),
        (["--pp-layer-partition", "3,x"], "must be comma-separated integers >= 1"),
        (
            [
                "--hicache-storage-backend",
                "file",
                "--hicache-storage-dir",
                "/nonexistent/l3",
                "--enable-hisparse",
                "--tp",
                "2",
                "--nnodes",
                "2",
            ],
            "--enable-hisparse under --pp-size and --tp runs on one machine yet (--nnodes 1)",
        ),
        (["--disaggregation-mode", "prefill"], "does not run with --pp-size > 1 yet"),
        (["--pp-layer-partition", "3,4"], "covers 7 layers; the model has 8"),
        (["--pp-layer-partition", "2,2,4"], "must be 2 numbers (one per stage of --pp-size 2)"),
        (["--tp", "2", "--dp-attention"], "--dp-attention with --pp-size > 1 is not supported"),
    ],
)
def test_what_stages_refuse_is_one_error_line(glm_tiny, flags, message, capsys):
    line = cli_error_line(["serve", glm_tiny, "--pp-size", "2", *flags], capsys)
    assert message in line, line
