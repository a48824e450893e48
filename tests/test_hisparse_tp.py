"""HiSparse across ranks (DESIGN.md §13, §8): under `--tp N` (and `--ep`) every rank holds a
replica of the hot buffers, rank 0's admissions and releases replayed on the others; under
`--dp-attention` each rank schedules its own requests over hot buffers of its own.

glm-tiny is sparse (index_topk 16); with host_to_device_ratio 8 its buffer is 32 tokens, so
prompts of 60-120 tokens miss and copy rows from the host. fp32 caches and the same pool with
and without HiSparse (the same admissions, so the same batches) make outputs bit-equal: TP's
torch path is not batch-invariant, so only runs of the same schedule are compared exactly.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
from collections.abc import Callable, Iterator

import httpx
import pytest
import torch

from dsakv import LLM, SamplingParams
from dsakv.memory import CacheLayout

from .conftest import assert_integrity_catches, cli_error_line, flat_logprobs
from .serving import TIMEOUT, ServerProcess, scrape_metrics
from .test_hisparse_engine import EXACT, HS, _prompts

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
NUM_PAGES = 256  # both with and without HiSparse: every request runs at once
PARALLEL = {
    "tp2": dict(tp=2),
    "tp2-ep2": dict(tp=2, ep=2),
    "dp-attention": dict(tp=2, dp_attention=True),
    # (drafts: every rank runs a verify's tokens as decode rows over its replica, and
    # steps the MTP layer's hot buffers too; n-gram's verify rows are MTP's, one rank tests
    # them)
    "tp2-mtp": dict(tp=2, speculative_algorithm="mtp"),
    "dp-attention-mtp": dict(tp=2, dp_attention=True, speculative_algorithm="mtp"),
}


PROMPTS = _prompts(6)
ALONE = _prompts(2, seed=1)  # (not in PROMPTS: no prefix hit changes their schedule)
# ... but this one's first 48 tokens (6 pages) hit ALONE[0]'s: under HiSparse their latent
# comes in from each rank's host rows (rank 1's copy made when it replays the admission)
ALONE.append(ALONE[0][:48] + _prompts(1, seed=2, lo=30, hi=30)[0])


def _host_latent_maps() -> dict[int, set[str]]:
    """Each rank process's (this one's and its spawned ranks') mappings of the node-shared
    host latent, by the memory file's inode (`/proc/<pid>/maps`)."""
    gc.collect()  # (an engine closed before: its mapping goes with it)
    pids = [os.getpid()] + [p.pid for p in multiprocessing.active_children()]
    maps = {}
    for pid in pids:
        with open(f"/proc/{pid}/maps") as f:
            lines = [ln.split() for ln in f if "memfd:dsakv-hisparse-host-latent" in ln]
        maps[pid] = {ln[4] for ln in lines}  # (address, perms, offset, dev, inode, path)
    return maps


def _outputs(outs) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and their logprobs."""
    return [
        (o.outputs[0].token_ids, flat_logprobs(o.outputs[0].logprobs, o.outputs[0].token_ids))
        for o in outs
    ]


@pytest.fixture(scope="module")
def generated(glm_tiny) -> Callable[[str, bool], dict]:
    """`generated(parallel, hisparse)`: one LLM's outputs of PROMPTS in one batch (under
    tp2, of each of ALONE by itself after), its counters and, under DP attention, each
    rank's; each run once."""
    done: dict[tuple[str, bool], dict] = {}

    def run(parallel: str, hisparse: bool) -> dict:
        if (parallel, hisparse) not in done:
            kw = dict(enable_hisparse=True, hisparse_config=HS) if hisparse else {}
            with LLM(glm_tiny, **EXACT, num_pages=NUM_PAGES, **PARALLEL[parallel], **kw) as llm:
                e = llm.engine
                batch = _outputs(llm.generate(PROMPTS, GREEDY))
                singles = ALONE if parallel == "tp2" else []  # (for the server's test)
                alone = [_outputs(llm.generate([p], GREEDY))[0] for p in singles]
                e.check_integrity()
                ranks = e.rank_counters() if "dp_attention" in PARALLEL[parallel] else None
                done[parallel, hisparse] = dict(
                    batch=batch,
                    alone=alone,
                    counters=e.counters(),
                    ranks=ranks,
                    maps=_host_latent_maps(),
                )
        return done[parallel, hisparse]

    return run


@pytest.mark.parametrize("parallel", list(PARALLEL))
def test_greedy_tokens_and_logprobs_equal_without_hisparse(generated, parallel):
    """The same pool with and without HiSparse admits alike, so the batches are the same:
    tokens and logprobs are bit-equal while decode steps miss their hot buffers and copy
    rows in from the host, on every rank's replica (TP) or every rank's own (DP)."""
    on, off = generated(parallel, True), generated(parallel, False)
    if "speculative_algorithm" in PARALLEL[parallel]:
        # A verify's tokens run as decode rows under HiSparse, as one extend without (the
        # eager torch ops of two ranks sum them in another order): the tokens are equal,
        # the logprobs within rounding (measured: at most 1.4e-6 apart)
        assert [t for t, _ in on["batch"]] == [t for t, _ in off["batch"]]
        for (_, a), (_, b) in zip(on["batch"], off["batch"]):
            assert a == pytest.approx(b, abs=1e-5)
        assert 0 < on["counters"]["spec_accepted_tokens"] < on["counters"]["spec_draft_tokens"]
    else:
        assert on["batch"] == off["batch"]
    assert on["alone"] == off["alone"]
    c = on["counters"]
    assert c["hisparse_misses"] > 0 and c["hisparse_rows_to_device"] > c["hisparse_misses"]
    assert off["counters"]["hisparse_misses"] == 0
    if "dp_attention" in PARALLEL[parallel]:  # (counters sum the ranks; each missed alone)
        assert [r["hisparse_misses"] > 0 for r in on["ranks"]] == [True, True]
        assert sum(r["hisparse_misses"] for r in on["ranks"]) == c["hisparse_misses"]
        assert c["hisparse_host_tokens_total"] == 2 * NUM_PAGES * 8 * HS["host_to_device_ratio"]


@pytest.mark.parametrize("parallel", list(PARALLEL))
def test_a_nodes_tp_ranks_map_one_host_latent(generated, parallel):
    """Under TP every rank's host latent is a replica, so the node's two ranks map one
    memory file (rank 1 writes none of it: the tokens above equal only if it reads rank 0's
    rows); under DP attention each rank holds its own requests', privately."""
    maps = generated(parallel, True)["maps"]
    assert len(maps) == 2, maps  # (this process, rank 0, and rank 1)
    inodes = list(maps.values())
    if "dp_attention" in PARALLEL[parallel]:
        assert inodes == [set(), set()]
    else:
        assert len(inodes[0]) == 1 and inodes[0] == inodes[1], maps
    assert [*generated(parallel, False)["maps"].values()] == [set(), set()]


def _bump_clock(e):
    e.hot._clock += 1

    def undo() -> None:
        e.hot._clock -= 1

    return undo


def _move_a_buffer_entry(e):
    """A buffer position only rank 0 holds (the local checks do not read positions)."""
    old = e.hot.buf_pos[0, 0, 0].item()
    e.hot.buf_pos[0, 0, 0] = old + 7

    def undo() -> None:
        e.hot.buf_pos[0, 0, 0] = old

    return undo


@pytest.fixture(scope="class")
def small(glm_tiny) -> Iterator[LLM]:
    """tp=2 over 96 device latent slots (12 pages) backing 192 logical tokens, for
    `TestSmallPool`, closed after it (one multi-rank engine a process)."""
    cfg = {"host_to_device_ratio": 2}
    with LLM(
        glm_tiny, **EXACT, tp=2, num_pages=12, enable_hisparse=True, hisparse_config=cfg
    ) as llm:
        yield llm


class TestSmallPool:
    def test_replicas_agree_every_step_through_retraction_prefix_hits_and_abort(self, small):
        """Admissions with a prefix hit (latent brought in from the host), a retraction and an
        abort mid-decode are journaled on rank 0 and replayed on rank 1: `check_integrity`
        compares both replicas after every step, and every slot comes back at the end."""
        e = small.engine
        shared = _prompts(1, seed=5, lo=32, hi=32)[0]
        tails = _prompts(2, seed=6, lo=8, hi=8)
        other = _prompts(1, seed=7, lo=40, hi=40)[0]
        params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
        victim = e.add_request(_prompts(1, seed=9, lo=40, hi=40)[0], params)
        reqs = [e.add_request(p, params) for p in (shared + tails[0], other, shared + tails[1])]
        before = e.counters()
        steps = 0
        while e.has_unfinished():
            e.step()
            e.check_integrity()
            if len(victim.output_ids) == 3 and not victim.finished:
                e.abort(victim.rid)
            steps += 1
            assert steps < 400
        e.check_integrity()
        c = e.counters()
        assert victim.finish_reason == "abort"
        assert [len(r.output_ids) for r in reqs] == [60, 60, 60]
        assert c["retractions"] - before["retractions"] > 0
        assert c["prefix_hit_tokens"] - before["prefix_hit_tokens"] >= len(shared)
        assert c["hisparse_misses"] - before["hisparse_misses"] > 0
        assert c["hisparse_hot_buffers"] == c["hisparse_device_tokens_used"] == 0

    @pytest.mark.parametrize("corrupt", [_bump_clock, _move_a_buffer_entry], ids=["clock", "pos"])
    def test_check_integrity_names_the_rank_whose_replica_differs(self, small, corrupt):
        """The replica comparison, the oracle of the test above: rank 0's replica changed alone
        is found by it (not by rank 0's own checks), naming rank 1; undone, it passes."""
        e = small.engine
        small.generate([_prompts(1, seed=8, lo=40, hi=40)[0]], GREEDY)
        e.hot.check(idle=True)  # (rank 0's own checks pass on the corrupted replica below)
        undo = corrupt(e)
        e.hot.check(idle=True)
        undo()
        assert_integrity_catches(e, corrupt, "rank 1's HiSparse replica differs from rank 0's")


@pytest.mark.parametrize("dp_attention", [False, True])
def test_a_host_latent_of_3_4_of_memory_fits_a_tp2_node_once(glm_tiny, capsys, dp_attention):
    """The engine counts the host latents on the node before anything is allocated: under
    --tp 2 the ranks map one, so a host latent of 3/4 of the machine's memory passes (the
    error is the next check's, a pool too small for a buffer); under --dp-attention each
    rank holds its own, and the same is one error line about the host."""
    from dsakv.memory.pool import memory_bytes

    per_page = 8 * CacheLayout.for_model(glm_tiny, "fp32", "fp32", 8).latent_bytes_per_token
    ratio = 3 * memory_bytes(torch.device("cpu")) // 4 // per_page
    flags = ["--kv-cache-dtype", "fp32", "--page-size", "8", "--num-pages", "1", "--tp", "2"]
    flags += ["--enable-hisparse", "--hisparse-config", f'{{"host_to_device_ratio": {ratio}}}']
    flags += ["--dp-attention"] * dp_attention
    err = cli_error_line(["generate", glm_tiny, "--prompt", "x", "--device", "cpu", *flags], capsys)
    if dp_attention:
        assert "of HiSparse host latent (2 ranks' on a node) on the host" in err, err
    else:
        assert "holds less than one hot buffer" in err, err


def test_serve_tp2_with_hisparse_equals_offline_and_reports_misses(glm_tiny, generated, tmp_path):
    """`dsakv serve --tp 2 --enable-hisparse`: completions past the buffer give the tokens
    of `LLM(tp=2)` with the same flags (each request alone, as the offline one ran), and
    /metrics counts the hot-buffer misses."""
    from openai import OpenAI

    want = generated("tp2", True)["alone"]
    flags = ["--tp", "2", "--enable-hisparse", "--hisparse-config", '{"host_to_device_ratio": 8}']
    flags += ["--kv-cache-dtype", "fp32", "--index-k-dtype", "fp32", "--page-size", "8"]
    flags += ["--num-pages", str(NUM_PAGES), "--device", "cpu"]
    server = ServerProcess(tmp_path, "tp2", glm_tiny, *flags)
    try:
        server.wait_healthy(120)  # (two ranks start slower than TIMEOUT allows)
        client = OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=TIMEOUT, max_retries=0)
        extra = {"ignore_eos": True, "return_token_ids": True}
        got = []
        for prompt in ALONE:
            r = client.completions.create(model="m", prompt=prompt, max_tokens=16,
                                          temperature=0, logprobs=0, extra_body=extra)  # fmt: skip
            got.append((r.choices[0].token_ids, r.choices[0].logprobs.token_logprobs))
        assert got == want  # (tokens and logprobs: the same schedule, the same sums)
        m = scrape_metrics(server.url)
        assert m["dsakv_hisparse_misses_total"] > 0 and m["dsakv_hisparse_hot_buffers"] == 0
        info = httpx.get(f"{server.url}/get_server_info", timeout=TIMEOUT).json()
        assert info["enable_hisparse"] and info["hisparse_config"]["device_buffer_size"] == 32
    finally:
        server.stop()  # (its rank 1 dies with it: parent-death signal)


def test_an_admission_that_found_no_pages_is_not_journaled(glm_tiny):
    """Rank 0 journals an admission only once it ran: one its device latent pool could not
    hold (the scheduler catches `OutOfPages` and waits) is not replayed on the other ranks,
    whose replicas would take pages rank 0 never took."""
    from dsakv.engine import Engine, EngineConfig, Request
    from dsakv.memory.allocator import OutOfPages

    e = Engine(EngineConfig(model=glm_tiny, **EXACT, num_pages=16, enable_hisparse=True,
                            hisparse_config=HS))  # fmt: skip
    e.hot.journal = []  # (as rank 0's under --tp)
    e.hot.allocator.alloc(e.hot.allocator.num_free_pages)
    with pytest.raises(OutOfPages):
        e.hot.admit(Request(list(range(1, 40)), GREEDY), torch.empty(0, dtype=torch.long))
    assert e.hot.journal == []
