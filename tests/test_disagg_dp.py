"""Prefill and decode servers under `--dp-attention` (DESIGN.md §10, §8): each rank
schedules its own requests over its own pool, and registers that pool with a transfer engine
of its own. A decode server reserves a request on the rank with the most room and the
handshake gives the prefill server that rank's session, buffers and pages
(`DPEngine.reserve_detached`, `Request.dp_rank`); the request starts there
(`DPEngine.start_decoding`). A prefill server's request runs on a rank of its own, which
writes its held pages (`write_held`).

glm-tiny is sparse (index_topk 16). Against one `LLM(tp=2, dp_attention=True)` (whose
prefill is the DP prefill server's, and not the `--tp 2` one's: attention split over the
ranks), prompts of at most 8 tokens and 8 new ones keep every context within index_topk, and
requests run at once (other batches): the tokens are equal and the logprobs within float32
noise. HiSparse's decode server (a 32-token buffer, 60-token
prompts, so decode steps miss and copy rows from the host) is compared bit for bit with the
plain decode server, fed by the same prefill server.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

from .conftest import cli_error_line
from .serving import (
    TIMEOUT,
    ServerProcess,
    routing,
    servers_at_once,
    start_decode,
    start_prefill,
    wait_idle,
)
from .test_disagg_tp import FLAGS, HISPARSE, START_S, TP2, _prompts, tiny  # noqa: F401
from .test_vllm_pd import prefill_first, then_decode

DP2 = [*TP2, "--dp-attention"]
SHORT = {"temperature": 0, "ignore_eos": True, "max_tokens": 8}


@pytest.fixture(scope="module")
def servers(tiny, tmp_path_factory) -> Iterator[SimpleNamespace]:  # noqa: F811
    """Prefill servers at --tp 2 and --tp 2 --dp-attention, and decode servers at --tp 2
    --dp-attention without and with HiSparse; all start at once."""
    root = tmp_path_factory.mktemp("disagg_dp")
    procs: dict[str, ServerProcess] = {}
    with servers_at_once(procs, START_S) as healthy:
        procs["prefill"], _ = start_prefill(root, "prefill", tiny, *FLAGS, *TP2)
        procs["prefill_dp"], _ = start_prefill(root, "prefill_dp", tiny, *FLAGS, *DP2)
        procs["decode"] = start_decode(root, "decode", tiny, *FLAGS, *DP2)
        procs["decode_hs"] = start_decode(root, "decode_hs", tiny, *FLAGS, *DP2, *HISPARSE)
        yield healthy()


@pytest.fixture(scope="module")
def dp_llm(tiny) -> Iterator:  # noqa: F811
    """`LLM(tp=2, dp_attention=True)` with the servers' pool (two requests running at most
    on each rank): the single server the PD pairs are compared with, and the decode side's
    engine ops in-process."""
    from dsakv import LLM

    from .test_hisparse_engine import EXACT

    with LLM(tiny, **EXACT, tp=2, dp_attention=True, num_pages=64, max_running_requests=4) as llm:
        yield llm


def _reference(llm, prompts: list[list[int]]) -> list[tuple]:
    """Each prompt's greedy tokens and logprobs from `llm`, the prompts run at once."""
    from dsakv import SamplingParams

    from .conftest import flat_logprobs

    params = SamplingParams(**SHORT, logprobs=0)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    return [(o.token_ids, flat_logprobs(o.logprobs, o.token_ids)) for o in outs]


def _completions(base: str, prompts: list[list[int]], params: dict) -> list[tuple]:
    """Each prompt's token ids and logprobs, the prompts sent at once."""

    def one(prompt: list[int]) -> tuple:
        body = {"model": "m", "prompt": prompt, "logprobs": 0, "return_token_ids": True}
        r = httpx.post(f"{base}/v1/completions", json={**body, **params}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["token_ids"], choice["logprobs"]["token_logprobs"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _busy_ranks(base: str, stop) -> set[int]:
    """The DP ranks /get_load saw running requests on until `stop()`."""
    seen: set[int] = set()
    while not stop():
        for rank in httpx.get(f"{base}/get_load", timeout=TIMEOUT).json():
            if rank["num_reqs"]:
                seen.add(rank["dp_rank"])
        time.sleep(0.02)
    return seen


def test_pd_into_a_dp_attention_decode_server_runs_on_both_ranks(servers, dp_llm):
    """Requests sent at once are reserved on both ranks (each the one with more room), the
    prefill server writes each into its rank's pool, and the tokens are the single
    server's; the decode server ends idle and leak-free on every rank."""
    prompts = _prompts(1, [5, 8, 6, 7, 8, 4])
    want = _reference(dp_llm, prompts)
    with routing([servers.prefill], [servers.decode]) as base, ThreadPoolExecutor(1) as pool:
        long = {**SHORT, "max_tokens": 48}  # (long enough for /get_load to see both ranks)
        done = threading.Event()
        watch = pool.submit(_busy_ranks, servers.decode, done.is_set)
        got = _completions(base, prompts, SHORT)
        _completions(base, _prompts(2, [8, 8, 8, 8]), long)
        done.set()
        assert watch.result() == {0, 1}
    _assert_close(got, want)
    wait_idle(servers.prefill)
    wait_idle(servers.decode)


def test_a_dp_attention_prefill_server_ships_from_each_ranks_pool(servers, dp_llm):
    """vLLM's protocol: a DP prefill server runs each prompt on a rank of its own and keeps
    its pages there until the pickup (/get_load: both ranks hold some), then that rank
    writes them into the decode server's rank; the tokens are the single server's."""
    prompts = _prompts(4, [5, 8, 6, 7, 8, 4])
    want = _reference(dp_llm, prompts)
    bodies = [{"model": "m", "prompt": p, "logprobs": 0, "return_token_ids": True, **SHORT}
              for p in prompts]  # fmt: skip
    held = [prefill_first(servers.prefill_dp, "/v1/completions", b) for b in bodies]
    load = httpx.get(f"{servers.prefill_dp}/get_load", timeout=TIMEOUT).json()
    assert [rank["num_tokens"] > 0 for rank in load] == [True, True], load
    got = []
    for body, first in zip(bodies, held, strict=True):
        r = then_decode(servers.decode, "/v1/completions", body, first["kv_transfer_params"])
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        got.append((choice["token_ids"], choice["logprobs"]["token_logprobs"]))
    _assert_close(got, want)
    wait_idle(servers.prefill_dp)
    wait_idle(servers.decode)


def _assert_close(got: list[tuple], want: list[tuple]) -> None:
    """The same tokens, logprobs within float32 noise (other batches, other splits)."""
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4


def test_hisparse_dp_attention_decode_server_equals_the_plain_one(servers):
    """Under HiSparse each rank's host latent takes its own requests' latent from the DP
    prefill server: decode steps miss and copy rows in from it, on both ranks (requests sent
    at once), and the tokens and logprobs are the plain DP decode server's, fed by the same
    prefill server: bit for bit one request at a time, within float32 noise at once (other
    batches)."""
    prompts = _prompts(3, [60, 64, 70, 62])
    outs = {}
    for name in ("decode", "decode_hs"):
        # (a salt of its own: no prefix hit on the prefill server changes its KV's bits)
        params = {**SHORT, "max_tokens": 12, "cache_salt": name}
        with routing([servers.prefill_dp], [getattr(servers, name)]) as base:
            outs[name] = [_completions(base, [p], params)[0] for p in prompts[:2]]
            with ThreadPoolExecutor(1) as pool:
                done = threading.Event()
                watch = pool.submit(_busy_ranks, getattr(servers, name), done.is_set)
                outs[name] += _completions(base, prompts[2:], {**params, "max_tokens": 40})
                done.set()
                assert watch.result() == {0, 1}
        wait_idle(getattr(servers, name))
    assert outs["decode_hs"][:2] == outs["decode"][:2]
    _assert_close(outs["decode_hs"][2:], outs["decode"][2:])
    m = httpx.get(f"{servers.decode_hs}/metrics", timeout=TIMEOUT).text
    misses = [ln for ln in m.splitlines() if ln.startswith("dsakv_hisparse_misses_total")]
    assert misses and float(misses[0].split()[-1]) > 0, misses


def test_a_dp_attention_pd_server_on_several_nodes_is_one_error_line(tiny, capsys):  # noqa: F811
    flags = ["--disaggregation-mode", "decode", *DP2, "--nnodes", "2"]
    flags += ["--dist-init-addr", "127.0.0.1:29999", "--device", "cpu"]
    err = cli_error_line(["serve", tiny, *flags], capsys)
    assert "--disaggregation-mode with --dp-attention runs on one machine yet" in err, err


# --- the decode side's engine ops, in-process ------------------------------------------------


@pytest.fixture
def dp_engine(dp_llm):
    return dp_llm.engine


def test_a_reservation_the_roomiest_rank_refuses_goes_to_another(dp_engine):
    """Rank 1 has the most free pages but runs its share of --max-running-requests (two):
    the next reservation is taken by rank 0, not refused until the caller gives up."""
    from dsakv import SamplingParams

    e, params = dp_engine, SamplingParams(max_tokens=4)
    big = e.reserve_detached(list(range(1, 41)), params)
    small = [e.reserve_detached([1, 2, 3], params) for _ in range(2)]
    assert [r.dp_rank for r in (big, *small)] == [0, 1, 1]
    late = e.reserve_detached([4, 5, 6], params)
    assert late is not None and late.dp_rank == 0
    for r in (big, *small, late):
        e.drop_detached(r)
    e.check_integrity()


def test_a_start_that_fails_on_its_rank_gives_its_pages_back(dp_engine):
    """A start that fails (here: routed experts for a request that asked none) drops the
    reservation, on rank 1 (rank 0 hears the error, named by rank) as on rank 0: nothing
    leaks, and both ranks take the next requests."""
    import torch

    from dsakv import SamplingParams
    from dsakv.errors import DsakvError

    e, params = dp_engine, SamplingParams(max_tokens=4)
    reqs = _reserved_on_both(e, params)
    unasked = torch.zeros(3, 1, 1, dtype=torch.int32)
    with pytest.raises(DsakvError, match="rank 1: routed experts came for a request that"):
        e.start_decoding(reqs[1], 7, unasked)
    with pytest.raises(DsakvError, match="^routed experts came for a request that asked"):
        e.start_decoding(reqs[0], 7, unasked)  # (rank 0's own: the same)
    assert [r.finished for r in reqs] == [True, True]
    e.check_integrity()
    again = _reserved_on_both(e, params)
    for r in again:
        e.drop_detached(r)
    e.check_integrity()


def _reserved_on_both(e, params) -> list:
    """A 3-token reservation on rank 0 and one on rank 1 (others made meanwhile dropped)."""
    got: dict[int, object] = {}
    for _ in range(8):
        r = e.reserve_detached([1, 2, 3], params)
        if r.dp_rank in got:
            e.drop_detached(r)
        got.setdefault(r.dp_rank, r)
        if len(got) == 2:
            return [got[0], got[1]]
    raise AssertionError(f"reservations went to ranks {sorted(got)} only")


def test_a_grammar_compiles_on_the_ranks_worker_before_it_reserves(dp_engine):
    """A reservation with a grammar on rank 1 waits (None) while rank 1's worker compiles
    it, instead of every rank waiting for the compile; asked again, it is taken."""
    from dsakv import SamplingParams

    e = dp_engine
    first = e.reserve_detached(list(range(1, 41)), SamplingParams(max_tokens=4))
    assert first.dp_rank == 0  # (a tie: the next, on 1)
    params = SamplingParams(max_tokens=4, grammar=("regex", "[ab]+"))
    answers = [e.reserve_detached([1, 2, 3], params)]
    deadline = time.monotonic() + 60
    while answers[-1] is None and time.monotonic() < deadline:
        time.sleep(0.05)
        answers.append(e.reserve_detached([1, 2, 3], params))
    assert answers[0] is None and answers[-1] is not None and answers[-1].dp_rank == 1
    for r in (first, answers[-1]):
        e.drop_detached(r)
    e.check_integrity()


def _held_here(engine, kept) -> list[int]:
    """(On a rank: `DPEngine.on_ranks`) the requests it keeps pages for, for a PD prefill
    server."""
    return sorted(engine.scheduler.held)


def test_a_held_request_aborted_before_its_rank_ran_it_is_not_held_there(dp_engine):
    """A PD prefill server's request for rank 1, held and aborted before the step that
    brings both: rank 1 keeps nothing held for it (a hold left there kept weight updates
    off that rank for good)."""
    from dsakv import SamplingParams

    e = dp_engine
    first = e.reserve_detached(list(range(1, 41)), SamplingParams(max_tokens=4))
    req = e.add_request([1, 2, 3], SamplingParams(max_tokens=1))
    assert req.dp_rank == 1
    e.hold(req)
    e.abort(req.rid)
    e.step()
    assert e.on_ranks(_held_here) == [[]]
    e.drop_detached(first)
    while e.has_unfinished():
        e.step()
    e.check_integrity()


def test_flush_cache_drops_every_ranks_prefix_cache(dp_llm):
    """Under DP attention each rank holds a prefix cache of its own: `flush_cache` drops
    every rank's (refused, False, while a request waits anywhere or rank 1 holds one's
    pages for a PD prefill server: then no rank's is dropped)."""
    from dsakv import SamplingParams

    e = dp_llm.engine
    prompts = [[(7 * i + j) % 200 + 1 for j in range(24)] for i in range(4)]
    dp_llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    cached = [c["pages_cached"] for c in e.rank_counters()]
    assert all(n > 0 for n in cached), cached  # (both ranks ran some)
    waiting = e.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    assert e.flush_cache() is False
    e.abort(waiting.rid)
    while e.has_unfinished():
        e.step()
    # Rank 1 keeps a finished request's pages for a PD prefill server: rank 1 refuses.
    held = e.add_request([4, 5, 6], SamplingParams(max_tokens=1))
    while held.dp_rank != 1:  # (each add counts on its rank until a step: the next, on 1)
        e.abort(held.rid)
        held = e.add_request([4, 5, 6], SamplingParams(max_tokens=1))
    e.hold(held)
    while e.has_unfinished():
        e.step()
    assert e.flush_cache() is False
    assert e.rank_counters()[0]["pages_cached"] > 0  # (refused by one rank: dropped by none)
    e.release_held(held)
    assert e.flush_cache() is True
    e.step()  # (the other ranks' counters come with a step)
    assert [c["pages_cached"] for c in e.rank_counters()] == [0, 0]
    e.check_integrity()
