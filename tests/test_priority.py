"""Priority scheduling: vLLM's `--scheduling-policy priority` (lower `priority` values first)
and SGLang's `--enable-priority-scheduling` (higher first unless
`--schedule-low-priority-values-first`). The waiting queue runs by priority, then arrival;
a request that cannot be admitted retracts running ones of lower priority, which resume
(from the host tier or recomputed) with the tokens they would have had alone. index_topk
covers every context here, so a recompute gives the same numbers."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from dsakv import LLM, SamplingParams
from dsakv.cli import build_parser, engine_config_from_args, main
from dsakv.engine import EngineConfig
from dsakv.errors import DsakvError
from dsakv.models.tiny import TINY_PRESETS, write_tiny_model

from .serving import TIMEOUT, engine_thread_held, serving

ARGS = dict(device="cpu", page_size=16, kv_cache_dtype="fp32", index_k_dtype="fp32")
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def _prompts(n: int, length: int = 60, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(length)] for _ in range(n)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    preset = copy.deepcopy(TINY_PRESETS["glm-tiny"])
    preset["index_topk"] = 4096
    return str(write_tiny_model(tmp_path_factory.mktemp("prio") / "tiny", preset=preset, seed=1))


@pytest.fixture(scope="module")
def alone(tiny) -> tuple[list[list[int]], list[list[int]]]:
    """Three prompts and each one's greedy tokens, run alone in a roomy pool."""
    prompts = _prompts(3)
    with LLM(tiny, **ARGS, num_pages=64) as llm:
        tokens = [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in prompts]
    return prompts, tokens


def _finish_order(llm: LLM, priorities: list[int], **kw) -> list[int]:
    """The indexes of requests queued at once with `priorities`, in the order they end."""
    e = llm.engine
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    reqs = [
        e.add_requests(p, dataclasses.replace(params, priority=x))[0]
        for p, x in zip(_prompts(len(priorities), length=20), priorities)
    ]
    index = {r.rid: i for i, r in enumerate(reqs)}
    order = []
    while e.has_unfinished():
        order += [index[r.rid] for r in e.step() if r.finished]
    return order


PRIORITIES = [3, 1, 2, 0, 1]
LOW_FIRST = [3, 1, 4, 2, 0]  # by value, ties (1, 1) by arrival


@pytest.mark.parametrize(
    "policy, order",
    [
        (dict(scheduling_policy="priority"), LOW_FIRST),
        (dict(enable_priority_scheduling=True), [0, 2, 1, 4, 3]),  # SGLang's: higher first
        (
            dict(enable_priority_scheduling=True, schedule_low_priority_values_first=True),
            LOW_FIRST,
        ),
        (dict(), [0, 1, 2, 3, 4]),  # fcfs: arrival order, priorities 0
    ],
    ids=["vllm", "sglang", "sglang-low-first", "fcfs"],
)
def test_waiting_requests_run_by_priority_then_arrival(tiny, policy, order):
    """One request runs at a time, so the order they end is the order they were admitted."""
    with LLM(tiny, **ARGS, num_pages=32, max_running_requests=1, **policy) as llm:
        priorities = PRIORITIES if policy else [0] * len(PRIORITIES)
        assert _finish_order(llm, priorities) == order
        llm.engine.check_integrity()


SGLANG = dict(enable_priority_scheduling=True)  # higher first; preemption threshold 10


@pytest.mark.parametrize(
    "policy, order",
    [
        (dict(scheduling_policy="priority"), [1, 0, 3, 2]),  # vLLM's: none given is 0
        (SGLANG, [2, 1, 0, 3]),  # SGLang's: none given goes last
        (dict(SGLANG, schedule_low_priority_values_first=True), [1, 2, 0, 3]),
    ],
    ids=["vllm", "sglang", "sglang-low-first"],
)
def test_a_request_without_priority(tiny, policy, order):
    with LLM(tiny, **ARGS, num_pages=32, max_running_requests=1, **policy) as llm:
        assert _finish_order(llm, [None, -5, 3, None]) == order


@pytest.mark.parametrize(
    "variant",
    [
        dict(),
        dict(host_pool_gib=0.05),
        dict(chunked_prefill_size=16),
        dict(speculative_algorithm="mtp"),
        dict(enable_prefix_cache=False),
    ],
    ids=["recompute", "host", "chunked", "mtp", "no-prefix-cache"],
)
def test_sglangs_priority_retracts_a_running_lower_one(tiny, alone, variant):
    """Two low-priority requests fill the pool; a high-priority one arriving then cannot be
    admitted, so a low one is retracted for it (the newest), resumes after it and still ends
    with the tokens it has alone. An arrival within SGLang's threshold (10) only waits."""
    prompts, expected = alone
    for high, preempts in ((20, True), (10, False)):
        llm = LLM(tiny, **ARGS, num_pages=12, **SGLANG, **variant)
        e = llm.engine
        low = [e.add_requests(p, dataclasses.replace(GREEDY, priority=0))[0] for p in prompts[:2]]
        while not all(r.output_ids for r in low):  # (both decoding)
            e.step()
        assert len(e.scheduler.running) == 2 and not e.scheduler.waiting
        h = e.add_requests(prompts[2], dataclasses.replace(GREEDY, priority=high))[0]
        e.step()
        assert (h in e.scheduler.running) is preempts
        assert (low[1] in e.scheduler.waiting) is preempts  # the newest went first
        assert low[0].metrics.retractions == 0
        ended = []
        while e.has_unfinished():
            ended += [r for r in e.step() if r.finished]
        assert [r.output_ids for r in (*low, h)] == expected
        assert h.metrics.retractions == 0
        c = e.counters()
        if preempts:  # (else a low one may still be retracted as they grow)
            assert ended[0] is h and c["retractions"] > 0
            if "host_pool_gib" in variant:
                assert c["retractions_to_host"] > 0
        e.check_integrity()
        llm.close()


def test_sglangs_priority_retracts_only_what_lets_the_request_in(tiny, alone):
    """A request that would not fit even with every lower one retracted retracts none
    (SGLang's preempt_to_schedule); it waits for the higher one running."""
    prompts, expected = alone
    big = _prompts(1, 100, seed=7)[0]
    with LLM(tiny, **ARGS, num_pages=12, **SGLANG) as llm:
        e = llm.engine
        top = e.add_requests(big, dataclasses.replace(GREEDY, priority=100))[0]
        low = e.add_requests(prompts[0][:20], dataclasses.replace(GREEDY, priority=0))[0]
        while not (top.output_ids and low.output_ids):
            e.step()
        mid = e.add_requests(prompts[2], dataclasses.replace(GREEDY, priority=50))[0]
        e.step()
        assert low in e.scheduler.running and mid in e.scheduler.waiting
        assert e.counters()["retractions"] == 0
        while e.has_unfinished():
            e.step()
        assert mid.output_ids == expected[2]
        e.check_integrity()


def test_sglangs_priority_counts_no_room_in_the_pages_a_shared_prefix_pins(tiny):
    """The high one's prompt starts with the low one's three cached pages. Retracting the
    low one frees those for the high one to lock, no room for its own two: counted as room,
    the low one was retracted and the high one still did not fit (a recompute for nothing).
    It waits for the top one instead."""
    shared, other = _prompts(1, 48, seed=3)[0], _prompts(1, 100, seed=4)[0]
    with LLM(tiny, **ARGS, num_pages=11, **SGLANG) as llm:
        e = llm.engine
        top = e.add_requests(other, dataclasses.replace(GREEDY, max_tokens=8, priority=100))[0]
        low = e.add_requests([*shared, 1], dataclasses.replace(GREEDY, max_tokens=8, priority=0))[0]
        while not (top.output_ids and low.output_ids):
            e.step()
        assert low.num_cached_pages == 3 and e.allocator.num_free_pages == 0
        high = dataclasses.replace(GREEDY, max_tokens=8, priority=20)
        h = e.add_requests([*shared, *[2] * 20], high)[0]
        e.step()
        assert low in e.scheduler.running and h in e.scheduler.waiting
        while e.has_unfinished():
            e.step()
        assert e.counters()["retractions"] == 0 and len(h.output_ids) == 8
        e.check_integrity()


def test_vllms_priority_retracts_lower_ones_only_when_they_cannot_grow(tiny, alone):
    """vLLM's: a waiting request retracts nothing to be admitted, but running ones of lower
    priority keep no room for their growth from it, so it is admitted once its own pages
    are free; they are retracted (the lowest, newest first) when they run out."""
    prompts, expected = alone
    long = dataclasses.replace(GREEDY, max_tokens=100, priority=5)
    with LLM(tiny, **ARGS, num_pages=16, scheduling_policy="priority") as llm:
        e = llm.engine
        low = [e.add_requests(p, long)[0] for p in prompts[:2]]
        while not all(r.output_ids for r in low):
            e.step()
        h = e.add_requests(prompts[2], dataclasses.replace(GREEDY, priority=0))[0]
        e.step()
        assert h in e.scheduler.running and e.counters()["retractions"] == 0
        while e.has_unfinished():
            e.step()
        assert [r.output_ids[:40] for r in low] == expected[:2] and h.output_ids == expected[2]
        assert e.counters()["retractions"] > 0 and h.metrics.retractions == 0
        e.check_integrity()


def test_vllms_priority_waits_for_a_running_slot(tiny, alone):
    """At max_running_requests a higher-priority request waits for a slot, as in vLLM; it
    is admitted before the lower ones queued earlier."""
    prompts, _ = alone
    with LLM(
        tiny, **ARGS, num_pages=64, max_running_requests=1, scheduling_policy="priority"
    ) as llm:
        e = llm.engine
        first = e.add_requests(prompts[0], dataclasses.replace(GREEDY, priority=5))[0]
        e.step()
        e.add_requests(prompts[1], dataclasses.replace(GREEDY, priority=5))
        h = e.add_requests(prompts[2], dataclasses.replace(GREEDY, priority=0))[0]
        e.step()
        assert e.scheduler.running == [first] and e.counters()["retractions"] == 0
        while not first.finished:
            e.step()
        e.step()
        assert e.scheduler.running == [h]


def test_a_budget_short_step_retracts_nothing_under_hisparse(tmp_path):
    """Under HiSparse a prompt cannot start on a one-token budget (`_step_tokens`): that is
    no reason to retract a lower-priority request, which left the step idle and ended the
    high one as if it could never fit."""
    model = str(write_tiny_model(tmp_path / "tiny", preset="glm-tiny", seed=0))
    rng = random.Random(0)
    low_prompt, high_prompt = ([rng.randrange(1, 250) for _ in range(k)] for k in (50, 40))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    budget = 60 * 8 * (8 * 2304 + 4 * 512) / 2**30  # (test_hisparse_engine's 60 pages)
    for policy in (
        dict(scheduling_policy="priority"),
        dict(SGLANG, schedule_low_priority_values_first=True),
    ):
        config = dict(ARGS, page_size=8, kv_budget_gib=budget, chunked_prefill_size=17)
        hisparse = dict(enable_hisparse=True, hisparse_config={"host_to_device_ratio": 2})
        with LLM(model, **config, **hisparse, **policy) as llm:
            e = llm.engine
            low = e.add_requests(low_prompt, dataclasses.replace(params, priority=30))[0]
            e.step()
            e.step()  # (34 of its 50 tokens: the next chunk leaves one token of budget)
            high = e.add_requests(high_prompt, dataclasses.replace(params, priority=0))[0]
            e.step()
            assert high.finish_reason is None and e.counters()["retractions"] == 0
            while e.has_unfinished():
                e.step()
            assert len(high.output_ids) == len(low.output_ids) == 8
            e.check_integrity()


def test_generate_takes_vllms_priority_list(tiny, alone):
    prompts, expected = alone
    with LLM(tiny, **ARGS, num_pages=64, scheduling_policy="priority") as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, priority=[2, 0, 1])
        assert [o.token_ids for o in outs] == expected  # (in input order)
        with pytest.raises(DsakvError, match="one integer per prompt"):
            llm.generate(prompts, GREEDY, use_tqdm=False, priority=[1])
        with pytest.raises(DsakvError, match="priority must be an integer"):
            llm.generate(prompts[:1], GREEDY, use_tqdm=False, priority=["high"])
    with LLM(tiny, **ARGS, num_pages=64) as fcfs:  # vLLM's refusal
        with pytest.raises(DsakvError, match="Got priority 1 but priority scheduling is not"):
            fcfs.generate(prompts[:1], GREEDY, use_tqdm=False, priority=[1])
        (out,) = fcfs.generate(prompts[:1], GREEDY, use_tqdm=False, priority=[0])
        assert out.token_ids == expected[0]
        assert not fcfs.engine.has_unfinished()


@pytest.mark.parametrize(
    "flags, sign, threshold",
    [
        ([], 0, None),
        (["--scheduling-policy", "fcfs"], 0, None),
        (["--scheduling-policy", "priority"], 1, None),
        (["--enable-priority-scheduling"], -1, 10),
        (["--enable-priority-scheduling", "--schedule-low-priority-values-first"], 1, 10),
        (
            ["--enable-priority-scheduling", "--priority-scheduling-preemption-threshold", "0"],
            -1,
            0,
        ),
    ],
)
def test_vllm_and_sglang_flags(tiny, flags, sign, threshold):
    config = engine_config_from_args(build_parser().parse_args(["serve", tiny, *flags]))
    assert (config.priority_sign, config.preemption_threshold) == (sign, threshold)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--scheduling-policy", "priority", "--enable-priority-scheduling"], "give one"),
        (["--scheduling-policy", "fcfs", "--enable-priority-scheduling"], "contradict"),
        (["--schedule-low-priority-values-first"], "needs --enable-priority-scheduling"),
        (
            ["--scheduling-policy", "priority", "--schedule-low-priority-values-first"],
            "needs --enable-priority-scheduling",
        ),
        (
            ["--scheduling-policy", "priority", "--priority-scheduling-preemption-threshold", "3"],
            "needs --enable-priority-scheduling",
        ),
    ],
)
def test_flags_that_disagree_exit_2(tiny, flags, message, capsys):
    assert main(["generate", tiny, "--prompt", "x", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    with pytest.raises(DsakvError, match="fcfs or priority"):
        EngineConfig(model=tiny, scheduling_policy="lifo")
    with pytest.raises(DsakvError, match="must be an integer >= 0"):  # (or equals preempt)
        EngineConfig(
            model=tiny, enable_priority_scheduling=True, priority_scheduling_preemption_threshold=-1
        )


def _pages_owned_once(e) -> None:
    """Every device page is free, a prefix-cache node's (a stale one's while a request locks
    it) or one running request's own: exactly one of them; a waiting request holds none."""
    sch = e.scheduler
    owners = list(e.allocator._free) + [n.page for n in e.cache._nodes() if n.page is not None]
    held = [*sch.running, *sch.parked.values()]
    owners += [p for r in held for p in r.pages[r.num_cached_pages :]]
    stale = {id(n): n.page for r in held for n in r.prefix_nodes if n.stale and n.page is not None}
    owners += stale.values()
    assert sorted(owners) == list(range(e.allocator.num_pages))
    assert not any(r.pages for r in sch.waiting)


@pytest.mark.parametrize(
    "policy",
    [
        dict(SGLANG, priority_scheduling_preemption_threshold=0, host_pool_gib=0.02),
        dict(scheduling_policy="priority", speculative_algorithm="mtp", max_running_requests=3),
        dict(scheduling_policy="lpm", host_pool_gib=0.02),
    ],
    ids=["sglang-host", "vllm-mtp", "lpm-host"],
)
def test_random_workloads_leave_every_page_owned_once(tiny, policy):
    """Arrivals with shared prefixes, random priorities (none given too), n > 1, chunked
    prompts, aborts and steps in a pool that retracts often: after each, every page has one
    owner; at the end every request ran to its max_tokens or was aborted, and the pool is
    as it started (free or evictable)."""
    prio = "lpm" not in policy.values()
    for seed in range(3):
        rng = random.Random(seed)
        prefixes = [_prompts(1, 16 * k, seed=10 + k)[0] for k in (1, 2, 3)] + [[]]
        with LLM(tiny, **ARGS, num_pages=14, chunked_prefill_size=24, **policy) as llm:
            e, reqs = llm.engine, []
            for _ in range(40):
                action = rng.choice(["add", "add", "step", "step", "step", "abort"])
                if action == "add":
                    prompt = rng.choice(prefixes) + _prompts(1, rng.randint(1, 40), seed)[0]
                    params = SamplingParams(
                        max_tokens=rng.randint(1, 30),
                        temperature=rng.choice([0, 1.0]),
                        ignore_eos=True,
                        n=rng.choice([1, 1, 2, 3]),
                        priority=rng.choice([None, -20, 0, 3, 15, 40]) if prio else None,
                    )
                    reqs += e.add_requests(prompt, params)
                elif action == "step":
                    e.step()
                elif reqs:
                    e.abort(rng.choice(reqs).rid)
                _pages_owned_once(e)
            while e.has_unfinished():
                e.step()
                _pages_owned_once(e)
            e.check_integrity()
            assert e.allocator.num_free_pages + e.cache.num_evictable_pages == 14
            for r in reqs:
                assert r.finish_reason == "abort" or len(r.output_ids) == r.params.max_tokens


# --- over HTTP ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tiny):
    config = EngineConfig(model=tiny, **ARGS, num_pages=96, max_running_requests=2, **SGLANG)
    with serving(config) as served:
        yield served


def _in_engine(async_engine) -> int:
    async def count() -> int:
        c = await asyncio.wait_for(async_engine.call(lambda e: e.counters()), TIMEOUT)
        return int(c["running_requests"] + c["waiting_requests"])

    return asyncio.run(count())


def test_a_high_priority_request_overtakes_a_flood(served):
    """Sent after eight requests already queued (two run at a time), it ends before most of
    them: it takes a running one's place at once (SGLang's priority preemption)."""
    base, async_engine = served
    flood, ended = 8, []
    lock = threading.Lock()

    def complete(name: str, priority: int, seed: int) -> None:
        body = {"prompt": _prompts(1, 20, seed)[0], "max_tokens": 600}
        body |= {"temperature": 0, "ignore_eos": True, "priority": priority}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        with lock:
            ended.append(name)

    with ThreadPoolExecutor(flood + 1) as pool:
        done = [pool.submit(complete, f"flood{i}", 0, i) for i in range(flood)]
        while _in_engine(async_engine) + len(ended) < flood:
            assert not any(f.done() and f.exception() for f in done)
            time.sleep(0.01)
        # (no step until its add is queued: it comes while two of the flood are starting,
        # however slowly this thread gets to send it)
        with engine_thread_held(async_engine):
            done.append(pool.submit(complete, "high", 20, flood))
            deadline = time.monotonic() + TIMEOUT
            while async_engine._commands.qsize() == 0:
                assert time.monotonic() < deadline, "its add never came"
                time.sleep(0.01)
        for f in done:
            f.result()
    assert ended.index("high") < flood // 2, ended


ROUTES = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
]


def test_every_route_takes_priority(served):
    base = served[0]
    for path, body in ROUTES:
        r = httpx.post(f"{base}{path}", json={**body, "priority": 7}, timeout=TIMEOUT)
        assert r.status_code == 200, (path, r.text)
        r = httpx.post(f"{base}{path}", json={**body, "priority": "7"}, timeout=TIMEOUT)
        assert r.status_code == 400, (path, r.text)


def test_fcfs_refuses_priority_on_every_route(tiny):
    with serving(EngineConfig(model=tiny, **ARGS, num_pages=32)) as (base, _):
        for path, body in ROUTES:
            r = httpx.post(f"{base}{path}", json={**body, "priority": 3}, timeout=TIMEOUT)
            assert r.status_code == 400, (path, r.text)
            error = r.json()["error"]
            assert error["message"] == "Got priority 3 but priority scheduling is not enabled"
            assert error["param"] == "priority"
            r = httpx.post(f"{base}{path}", json={**body, "priority": 0}, timeout=TIMEOUT)
            assert r.status_code == 200, (path, r.text)
