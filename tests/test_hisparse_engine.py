"""HiSparse in the engine (DESIGN.md §13): every token's latent on the host, a hot buffer
per decoding request on the device, index-K of every logical token on the device (elided).

glm-tiny is sparse (index_topk 16, four IndexShare groups over 8 layers); with
`device_buffer_size` 32 and prompts of 60-120 tokens every request runs past its buffer,
so decode steps miss and copy rows from the host. fp32 caches make the comparisons exact
across schedules (as in test_engine): the attention reads the same rows in the same
order, from device slots instead of pool slots.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch

from dsakv.engine import Engine, EngineConfig, Request, SamplingParams
from dsakv.engine import disagg as ops
from dsakv.engine.hisparse import _Hot
from dsakv.errors import DsakvError
from dsakv.memory.allocator import page_slots
from dsakv.models.tiny import write_tiny_model

from .conftest import assert_integrity_catches, cli_error_line

EXACT = dict(kv_cache_dtype="fp32", index_k_dtype="fp32", device="cpu", page_size=8)
HS = {"host_to_device_ratio": 8}  # top_k 16 (index_topk), buffer 32
NGRAM = dict(speculative_algorithm="ngram")  # 3 drafts: a verify computes 4 tokens
HS_VERIFY = {"device_buffer_size": 64, "host_to_device_ratio": 4}  # 4 × top_k, the least
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("glm-tiny"), preset="glm-tiny", seed=0))


def _prompts(n: int, seed: int = 0, lo: int = 60, hi: int = 120) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 250) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _engine(model: str, **kw) -> Engine:
    return Engine(EngineConfig(model=model, **{**EXACT, **kw}))


def _run(engine: Engine, prompts, params=GREEDY, check_every_step: bool = True):
    reqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
        if check_every_step:
            engine.check_integrity()
    engine.check_integrity()
    return [r.output_ids for r in reqs]


@pytest.fixture(scope="module")
def reference(tiny):
    """A pool that holds every request at once, no HiSparse."""
    prompts = _prompts(8)
    return prompts, _run(_engine(tiny, num_pages=256), prompts, check_every_step=False)


BUDGET_GIB = 60 * 8 * (8 * 2304 + 4 * 512) / 2**30  # 60 pages of the elided fp32 cell


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_greedy_equals_roomy_pool_with_misses_and_more_running(tiny, reference, backend):
    prompts, want = reference
    off = _engine(tiny, kv_budget_gib=BUDGET_GIB, attention_backend=backend)
    on = _engine(
        tiny,
        kv_budget_gib=BUDGET_GIB,
        attention_backend=backend,
        enable_hisparse=True,
        hisparse_config={"host_to_device_ratio": 2},
    )
    assert on.pool.num_latent_tokens < off.pool.num_tokens < on.pool.num_tokens
    assert on.pool.nbytes <= BUDGET_GIB * 2**30
    assert _run(on, prompts) == want
    assert _run(off, prompts, check_every_step=False) == want
    c = on.counters()
    assert c["hisparse_misses"] > 0 and c["hisparse_hits"] > 0
    assert c["hisparse_rows_to_device"] >= c["hisparse_misses"]
    assert c["peak_running_requests"] > off.counters()["peak_running_requests"]
    assert c["hisparse_device_tokens_used"] == 0 and c["hisparse_hot_buffers"] == 0
    assert c["hisparse_host_tokens_total"] == on.pool.num_tokens
    assert c["hisparse_host_tokens_used"] == c["pages_cached"] * 8  # idle: the prefix cache


def test_dense_index_k_and_fp8_caches(tiny, reference):
    """The dense layout under HiSparse gives the same tokens; the default fp8 caches agree
    with a roomy fp8 pool (the e4m3 rows are copied as stored bytes)."""
    prompts, want = reference
    dense = _engine(
        tiny, num_pages=20, elide_index_k=False, enable_hisparse=True, hisparse_config=HS
    )
    assert _run(dense, prompts) == want
    fp8 = dict(kv_cache_dtype="fp8_e4m3", index_k_dtype="fp8")
    roomy = _run(_engine(tiny, num_pages=256, **fp8), prompts, check_every_step=False)
    got = _run(
        _engine(tiny, num_pages=20, enable_hisparse=True, hisparse_config=HS, **fp8), prompts
    )
    agree = sum(a == b for a, b in zip(got, roomy))
    assert agree >= 7, f"{agree} of 8 requests agree with the roomy fp8 pool"


def test_chunked_prefill_mixed_with_decode(tiny, reference):
    """Prefill chunks share steps with decoding requests, and a budget left at one token
    (67 = 3 × 17 + 16) waits for the next step: under HiSparse a one-token step is a decode
    step, never a prefill chunk."""
    prompts, want = reference
    on = _engine(tiny, num_pages=20, chunked_prefill_size=17, enable_hisparse=True,
                 hisparse_config=HS)  # fmt: skip
    assert _run(on, prompts) == want
    pair = [_prompts(1, seed=11, lo=67, hi=67)[0], _prompts(1, seed=12, lo=70, hi=70)[0]]
    roomy = _run(_engine(tiny, num_pages=64, chunked_prefill_size=17), pair)
    assert _run(on, pair) == roomy


def test_prefix_cache_hits_load_latent_from_the_host(tiny):
    shared = _prompts(1, seed=5, lo=80, hi=80)[0]
    prompts = [shared + tail for tail in _prompts(3, seed=6, lo=3, hi=9)]
    cold = _run(_engine(tiny, num_pages=256, enable_prefix_cache=False), prompts)
    on = _engine(tiny, num_pages=20, enable_hisparse=True, hisparse_config=HS)
    _run(on, [shared + [1, 2, 3]])
    before = on.counters()
    assert _run(on, prompts) == cold
    c = on.counters()
    assert c["prefix_hit_tokens"] - before["prefix_hit_tokens"] >= 3 * 80
    assert c["hisparse_rows_to_device"] - before["hisparse_rows_to_device"] >= 3 * 80 * 8


def _leak_latent_page(e: Engine):
    pages = e.hot.allocator.alloc(1)
    return lambda: e.hot.allocator.free(pages)


def _leak_state_row(e: Engine):
    row = e.hot._free_rows.pop()
    return lambda: e.hot._free_rows.append(row)


def _keep_a_finished_requests_buffer(e: Engine):
    e.hot._reqs[10**6] = _Hot(e.hot.allocator.alloc(1))

    def undo() -> None:
        e.hot.allocator.free(e.hot._reqs.pop(10**6).pages)

    return undo


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (_leak_latent_page, "requests hold 0 latent pages, 1 used"),
        (_leak_state_row, "state rows leaked"),
        (_keep_a_finished_requests_buffer, "idle engine still holds hot buffers"),
    ],
    ids=["latent-page", "state-row", "idle-buffer"],
)
def test_check_integrity_fails_on_each_hot_buffer_leak(tiny, corrupt, message):
    """The HiSparse half of `Engine.check_integrity`, the oracle of the tests here: it must
    raise on each leak it claims to catch, and pass again once it is undone."""
    e = _engine(tiny, num_pages=20, enable_hisparse=True, hisparse_config=HS)
    _run(e, _prompts(1, seed=4, lo=40, hi=40), check_every_step=False)
    assert_integrity_catches(e, corrupt, message)


def test_retraction_abort_and_host_pages_as_the_limit(tiny, reference):
    """host_to_device_ratio 1: the logical (host) pages run out before the device slots;
    requests are retracted and recomputed, and every page, slot and state row comes back."""
    prompts, want = reference
    on = _engine(tiny, num_pages=36, enable_hisparse=True, hisparse_config={"host_to_device_ratio": 1},
                 enable_prefix_cache=False)  # fmt: skip
    assert _run(on, prompts) == want
    assert on.counters()["retractions"] > 0
    hb = on.hot
    r = on.add_request(prompts[0], GREEDY)
    while len(r.output_ids) < 4:
        on.step()
    assert on.counters()["hisparse_hot_buffers"] == 1
    on.abort(r.rid)
    on.check_integrity()
    assert hb.allocator.num_used_pages == 0 and len(hb._free_rows) == hb.buf_slot.shape[0]
    assert bool((hb.buf_pos == -1).all())


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_a_request_retracted_past_the_device_pool_decodes_its_outputs_again(tiny, prefix_cache):
    """80 device latent slots, 160 logical ones: two 20-token prompts decoding 100 tokens
    each outgrow the logical pool, and the one retracted has a context past the device pool,
    which no prefill could hold again. It was cut short ("length" at 61 of 100 tokens); its
    prompt is prefilled now and its outputs decoded again, one token a step as before."""
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(20)] for i in range(2)]
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    want = _run(_engine(tiny, num_pages=256), prompts, params, check_every_step=False)
    on = _engine(tiny, num_pages=10, enable_hisparse=True, enable_prefix_cache=prefix_cache,
                 hisparse_config={"host_to_device_ratio": 2})  # fmt: skip
    assert on.pool.num_latent_tokens == 80
    assert _run(on, prompts, params) == want
    assert on.counters()["retractions"] == 1


def _short_run(engine: Engine, prompt, tamper=None) -> list[int]:
    """One request; `tamper(engine, req)` right after its prompt is prefilled."""
    req = engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()
    if tamper is not None:
        tamper(engine, req)
    while engine.has_unfinished():
        engine.step()
    return req.output_ids


def test_resident_rows_come_from_the_device_missed_rows_from_the_host(tiny):
    """A request no longer than its buffer: overwriting its host rows changes nothing and it
    never copies a row in; corrupting its device rows does change its tokens. A longer one
    reads the host: corrupting the host changes its tokens."""
    short = _prompts(1, seed=9, lo=20, hi=20)[0]  # 20 + 8 <= 32
    want = _short_run(_engine(tiny, num_pages=64), short)

    def host_garbage(engine, req):
        for h in engine.hot.host.values():
            h.copy_(torch.randint(0, 256, h.shape, dtype=torch.uint8))

    on = _engine(tiny, num_pages=20, enable_hisparse=True, hisparse_config=HS)
    assert _short_run(on, short, host_garbage) == want
    assert on.counters()["hisparse_misses"] == 0 and on.counters()["hisparse_rows_to_device"] == 0

    def device_garbage(engine, req):
        pages = engine.hot._reqs[req.rid].pages
        slots = torch.tensor([p * 8 + i for p in pages for i in range(8)])[:20]
        for layer in range(engine.layout.num_layers):
            rows = engine.pool.latent_data(layer)
            rows[slots] = torch.randn(20, rows.shape[1]) * 10

    on = _engine(tiny, num_pages=20, enable_hisparse=True, hisparse_config=HS)
    assert _short_run(on, short, device_garbage) != want

    long = _prompts(1, seed=10, lo=100, hi=100)[0]
    want = _short_run(_engine(tiny, num_pages=64), long)
    on = _engine(tiny, num_pages=20, enable_hisparse=True, hisparse_config=HS)
    assert _short_run(on, long) == want and on.counters()["hisparse_misses"] > 0
    on = _engine(tiny, num_pages=20, enable_hisparse=True, hisparse_config=HS)
    assert _short_run(on, long, host_garbage) != want


@contextmanager
def _pd(
    prefill: Engine, decode: Engine
) -> Iterator[Callable[[list[int], SamplingParams], Request]]:
    """`start(prompt, params)`: `prefill` (no HiSparse) runs the prompt and writes its KV over
    Mooncake into a reservation on HiSparse `decode` (latent into its host rows, index-K,
    full layers only, into its device pool), which then decodes from the first token; None
    where `decode` reserves nothing now."""
    from dsakv.disagg.transfer import KVTransfer, PeerBuffer

    src = KVTransfer(prefill.pool)
    dst = KVTransfer(decode.pool)
    peer = [PeerBuffer.of(d) for d in dst.buffers]
    assert len(peer) == decode.layout.num_layers + len(decode.layout.index_k_layers)

    def start(prompt: list[int], params: SamplingParams) -> Request | None:
        req = ops.reserve(decode, prompt, params)
        if req is None:  # (the decode side has no room now)
            return None
        assert len(decode.hot._reqs[req.rid].pages) == decode.hot.buffer_pages
        first = prefill.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        ops.hold(prefill, first)
        while prefill.has_unfinished():
            prefill.step()
        nbytes, _ = src.write(dst.session, peer, first.pages, req.pages, len(prompt))
        assert nbytes == len(prompt) * decode.layout.bytes_per_token
        ops.release_held(prefill, first)
        ops.start_decoding(decode, req, first.output_ids[0])
        return req

    try:
        yield start
    finally:
        src.close()
        dst.close()


def _pd_run(prefill: Engine, decode: Engine, prompts, params, each_step=None) -> list[Request]:
    """Each prompt through `_pd` in turn, decoded to the end (`each_step(decode)` after
    every step): the decode engine's requests."""
    reqs = []
    with _pd(prefill, decode) as start:
        for p in prompts:
            reqs.append(start(p, params))
            while decode.has_unfinished():
                decode.step()
                if each_step is not None:
                    each_step(decode)
    decode.check_integrity()
    return reqs


def test_pd_decode_receives_latent_into_its_host_memory(tiny, reference):
    """A HiSparse decode engine whose device latent pool (96 tokens) holds fewer than some
    prompts (up to 120) gives the colocated tokens: only its hot buffer is on the device."""
    prompts, want = reference
    prefill = _engine(tiny, num_pages=64)
    decode = _engine(tiny, num_pages=12, enable_hisparse=True, hisparse_config=HS)
    assert max(map(len, prompts)) > decode.pool.num_latent_tokens
    assert [r.output_ids for r in _pd_run(prefill, decode, prompts, GREEDY)] == want
    assert decode.counters()["hisparse_misses"] > 0


@pytest.mark.parametrize("prompt_len, max_tokens", [(85, 40), (60, 70)])
def test_a_retracted_pd_request_is_recomputed_or_cut_short_at_once(tiny, prompt_len, max_tokens):
    """80 device latent slots, 240 logical ones: two PD requests outgrow the logical pool and
    the newer is retracted. With a 60-token prompt it is recomputed (its prompt prefilled on
    the device, its outputs decoded again). An 85-token prompt no device prefill holds: it
    ends at once, "length" with its tokens so far (it waited, blocking the queue, for a step
    with nothing else running or parked, which a busy server may never have); the other
    one runs on."""
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(prompt_len)] for i in range(2)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    want = _run(_engine(tiny, num_pages=256), prompts, params, check_every_step=False)
    prefill = _engine(tiny, num_pages=64)
    decode = _engine(tiny, num_pages=10, enable_hisparse=True,
                     hisparse_config={"host_to_device_ratio": 3})  # fmt: skip
    assert decode.pool.num_latent_tokens == 80 and decode.pool.num_tokens == 240
    with _pd(prefill, decode) as start:
        older, newer = [start(p, params) for p in prompts]
    while not decode.counters()["retractions"]:
        decode.step()
        decode.check_integrity()
    if prompt_len > 80:
        assert newer.finish_reason == "length" and not older.finished
        assert 0 < len(newer.output_ids) < max_tokens
        assert newer.output_ids == want[1][: len(newer.output_ids)]
    while decode.has_unfinished():
        decode.step()
    decode.check_integrity()
    assert older.output_ids == want[0]
    if prompt_len <= 80:
        assert newer.output_ids == want[1]
    assert decode.counters()["retractions"] == 1


@pytest.mark.parametrize("lens, max_tokens", [((60, 85), 60), ((40, 110), 100)])
def test_a_pd_request_the_device_cannot_prefill_is_retracted_last(tiny, lens, max_tokens):
    """The same pools; the newer request's prompt (85, 110 tokens) no device prefill holds,
    the older's (60, 40) does. The older one is retracted (and recomputed) instead of the
    newer being cut short: both finish with every token. With 40 and 110 the newer needed
    its page after the step's batch had taken the older: the step ran the retracted one
    ("unknown request", every request in flight failed)."""
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate(lens)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    want = _run(_engine(tiny, num_pages=256), prompts, params, check_every_step=False)
    prefill = _engine(tiny, num_pages=64)
    decode = _engine(tiny, num_pages=10, enable_hisparse=True,
                     hisparse_config={"host_to_device_ratio": 3})  # fmt: skip
    with _pd(prefill, decode) as start:
        older, newer = [start(p, params) for p in prompts]
    while decode.has_unfinished():
        decode.step()
        decode.check_integrity()
    assert decode.counters()["retractions"] == 1 and older.metrics.retractions == 1
    assert [older.output_ids, newer.output_ids] == want


def test_the_retracted_come_back_before_new_reservations(tiny):
    """A retracted PD request whose prompt the device holds is prefilled again, which needs
    more device pages than one hot buffer; new PD reservations took every buffer freed, and
    it waited for good (3,000 steps, 200 newer requests served). They now wait for it."""
    prefill = _engine(tiny, num_pages=256)
    decode = _engine(tiny, num_pages=10, enable_hisparse=True,
                     hisparse_config={"host_to_device_ratio": 3})  # fmt: skip
    long = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    steps = 0
    with _pd(prefill, decode) as start:
        start([(3 * j) % 250 + 1 for j in range(20)], long)
        retracted = start([(5 * j) % 250 + 1 for j in range(75)], long)
        while not retracted.finished:
            start([(7 * j + steps) % 250 + 1 for j in range(20)], short)  # a steady stream
            decode.step()
            steps += 1
            assert steps < 1000, (retracted.status, len(retracted.output_ids))
    assert retracted.metrics.retractions > 0 and len(retracted.output_ids) == 120
    decode.check_integrity()


@pytest.mark.parametrize(
    "hisparse, num_pages, prompt_len, max_tokens", [(False, 20, 30, 60), (True, 16, 40, 90)]
)
def test_reservations_take_what_the_retracted_leave(
    tiny, hisparse, num_pages, prompt_len, max_tokens
):
    """While a retracted request waits, a PD decode server took no reservation at all (a
    new request could wait out the disaggregation timeout behind it). As SGLang's, it now
    takes what is left beyond the pages (and, under HiSparse, device latent) the waiting one
    needs to come back: reservations held and never started still let it resume and finish
    with its tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(prompt_len)] for i in range(2)]
    want = _run(_engine(tiny, num_pages=64), prompts, params, check_every_step=False)
    kw = dict(enable_hisparse=True, hisparse_config={"host_to_device_ratio": 2}) if hisparse else {}
    e = _engine(tiny, num_pages=num_pages, **kw)
    reqs = [e.add_request(p, params) for p in prompts]
    held, steps, waited = [], 0, False
    while e.has_unfinished():
        if e.scheduler.waiting and e.counters()["retractions"]:
            waited = True
            r = e.reserve_detached([5, 6, 7, 8, 9], GREEDY)  # (one page, never started)
            if r is not None:
                held.append(r)
        e.step()
        steps += 1
        assert steps < 500, "the retracted request never came back"
    assert waited and held, "no reservation was taken while the retracted request waited"
    assert [r.output_ids for r in reqs] == want
    for r in held:
        ops.drop(e, r)
    e.check_integrity()


# --- speculative decoding (n-gram drafts): a verify's tokens against the hot buffer --------


def _looping(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase (what prompt lookup drafts from), 50-130 tokens: longer
    than `test_ngram_speculative`'s, past the hot buffer."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        phrase = [rng.randrange(1, 250) for _ in range(rng.randint(5, 14))]
        tail = [rng.randrange(1, 250) for _ in range(rng.randint(0, 30))]
        out.append(phrase * rng.randint(4, 8) + tail if i % 3 else tail + phrase * 3)
    return out


LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
# HiSparse with drafts, as each speculative test runs it (the retraction: host pages as the
# limit, recomputed)
VERIFY_VARIANTS = {
    "cpu": dict(),
    "torch": dict(attention_backend="torch"),
    "chunked": dict(chunked_prefill_size=16, max_running_requests=3),
    "retract": dict(
        hisparse_config={**HS_VERIFY, "host_to_device_ratio": 1}, enable_prefix_cache=False
    ),
    # (the retracted go to a host tier and come back decoding: `test_hisparse_tiers`)
    "retract-to-host": dict(
        hisparse_config={**HS_VERIFY, "host_to_device_ratio": 1},
        enable_prefix_cache=False,
        host_pool_ratio=2,
    ),
}


@pytest.fixture(scope="module")
def looping(tiny):
    """Plain decode (no drafts, no HiSparse) in a pool that holds every request at once."""
    prompts = _looping(8)
    return prompts, _run(_engine(tiny, num_pages=256), prompts, LONG, check_every_step=False)


@pytest.mark.parametrize("variant", list(VERIFY_VARIANTS.values()), ids=list(VERIFY_VARIANTS))
def test_ngram_drafts_verify_against_the_hot_buffer(tiny, looping, variant):
    """A verify's 4 tokens run as decode rows, the union of their top-k resolved at once
    (a buffer of 4 × top_k holds it), each new token in an entry or reserved slot of its
    own: past the buffer, with misses, the greedy tokens are plain decode's."""
    prompts, want = looping
    kw = dict(num_pages=40, enable_hisparse=True, hisparse_config=HS_VERIFY, **NGRAM)
    on = _engine(tiny, **{**kw, **variant})
    assert on.hot.buffer_pages == 9  # 64 entries and 4 reserved slots
    assert _run(on, prompts, LONG) == want
    c = on.counters()
    assert 0 < c["spec_accepted_tokens"] < c["spec_draft_tokens"]  # (kept and refused)
    assert c["hisparse_misses"] > 0 and c["hisparse_hot_buffers"] == 0
    if "enable_prefix_cache" in variant:  # (logical pages as the limit: recomputed)
        assert c["retractions"] > 0
    if "host_pool_ratio" in variant:
        assert c["retractions_to_host"] > 0


def test_ngram_seeded_samples_are_plain_decodes(tiny, looping):
    """Seeded samples are the ones plain decode draws, drafts verified past the buffer."""
    prompts, _ = looping
    seeded = [replace(LONG, temperature=0.8, seed=i) for i in range(len(prompts))]
    plain = _engine(tiny, num_pages=256)
    want = [_run(plain, [p], s, check_every_step=False)[0] for p, s in zip(prompts, seeded)]
    on = _engine(tiny, num_pages=40, enable_hisparse=True, hisparse_config=HS_VERIFY, **NGRAM)
    got = [_run(on, [p], s)[0] for p, s in zip(prompts, seeded)]
    assert got == want
    assert on.counters()["spec_accepted_tokens"] > 0


def test_ngram_pd_decode_server(tiny, looping):
    """A PD decode server with HiSparse verifies drafts from its first decode step on (its
    buffer loaded from the host)."""
    prompts, want = looping
    prefill = _engine(tiny, num_pages=64)
    decode = _engine(tiny, num_pages=12, enable_hisparse=True, hisparse_config=HS_VERIFY, **NGRAM)
    assert [r.output_ids for r in _pd_run(prefill, decode, prompts, LONG)] == want
    c = decode.counters()
    assert c["spec_accepted_tokens"] > 0 and c["hisparse_misses"] > 0


# --- MTP: the draft layer's latent in the hot buffers and on the host too -----------------

MTP = dict(speculative_algorithm="mtp")  # 3 drafts


def _entries_hold_their_rows(e: Engine) -> int:
    """Every hot-buffer entry holding a computed position holds that position's rows in
    each layer of its group: the host's, byte for byte (the draft group's included, whose
    chain steps read rows the catch-up rewrites). Returns how many entries it compared."""
    hb, seen = e.hot, 0
    for req in e.requests.values():
        hot = hb._reqs.get(req.rid)
        if hot is None or hot.row < 0:
            continue
        logical = e.scheduler.slots(req, req.num_computed)
        for g, layers in enumerate(hb.groups.values()):
            pos = hb.buf_pos[g, hot.row].long()
            held = ((pos >= 0) & (pos < req.num_computed)).nonzero().flatten()
            slots, rows = hb.buf_slot[hot.row, held].long(), logical[pos[held]]
            for i in layers:
                assert torch.equal(hb.device_rows[i][slots], hb.host[i][rows]), (req.rid, i)
            seen += held.numel()
    return seen


def _mtp_run(engine: Engine, prompts) -> tuple[list, tuple[int, int]]:
    """Each request's tokens and logprobs, and how many drafts were made and kept; under
    HiSparse, the buffers hold their rows after every step."""
    params = replace(LONG, logprobs=0)
    reqs, compared = [engine.add_request(p, params) for p in prompts], 0
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        if engine.hot is not None:
            compared += _entries_hold_their_rows(engine)
    assert compared > 0 or engine.hot is None
    c = engine.counters()
    return [(r.output_ids, r.logprobs) for r in reqs], (
        c["spec_draft_tokens"],
        c["spec_accepted_tokens"],
    )


@pytest.fixture(scope="module")
def mtp_reference(glm_tiny):
    """MTP (glm-tiny's fitted draft layer) without HiSparse, every request at once, per
    attention backend (each sums in its own order)."""
    prompts, done = _prompts(8, seed=4), {}

    def run(backend: str = "auto"):
        if backend not in done:
            e = _engine(glm_tiny, num_pages=256, attention_backend=backend, **MTP)
            done[backend] = _mtp_run(e, prompts)
        return prompts, *done[backend]

    return run


@pytest.mark.parametrize("variant", list(VERIFY_VARIANTS.values()), ids=list(VERIFY_VARIANTS))
def test_mtp_drafts_from_the_draft_layers_hot_buffer(glm_tiny, mtp_reference, variant):
    """The draft layer is one more full layer of the hot buffers (its own group): its
    catch-ups and chain steps are steps of their own there, their rows written to the host
    after them. Past the buffer, with misses, tokens and logprobs are MTP's without
    HiSparse, and so are the drafts (made and kept alike: the draft layer read its rows)."""
    prompts, want, drafts = mtp_reference(variant.get("attention_backend", "auto"))
    kw = dict(num_pages=40, enable_hisparse=True, hisparse_config=HS_VERIFY, **MTP)
    on = _engine(glm_tiny, **{**kw, **variant})
    assert on.hot.groups[8] == [8]  # (the draft layer: index num_hidden_layers)
    got, made_kept = _mtp_run(on, prompts)
    if "attention_backend" in variant:  # (eager torch ops sum a batch of another size in
        assert [t for t, _ in got] == [t for t, _ in want]  # another order: measured
        for (_, a), (_, b) in zip(got, want):  # 1.4e-6 apart, as plain decode's are)
            assert a == pytest.approx(b, abs=1e-5)
    else:
        assert got == want
    c = on.counters()
    assert c["hisparse_misses"] > 0 and c["hisparse_hot_buffers"] == 0
    if "enable_prefix_cache" in variant:  # (recomputed, or back from the host: drafted again)
        assert c["retractions"] > 0 and c["spec_accepted_tokens"] > 0
        if "host_pool_ratio" in variant:
            assert c["retractions_to_host"] > 0
    else:
        assert made_kept == drafts


def test_mtp_a_finished_requests_last_step_reaches_the_host(glm_tiny):
    """A finished request's pages join the prefix cache with their draft KV: the catch-up
    over its last step runs before its hot buffer goes, so the host holds the draft
    layer's rows of every cached position, byte for byte the pool's without HiSparse."""
    prompt = _prompts(1, seed=3, lo=57, hi=57)[0]  # 57 + 39 computed = 12 full pages
    off = _engine(glm_tiny, num_pages=64, **MTP)
    on = _engine(glm_tiny, num_pages=40, enable_hisparse=True, hisparse_config=HS_VERIFY, **MTP)
    outs = [_run(e, [prompt], LONG)[0] for e in (off, on)]
    assert outs[0] == outs[1]
    tokens = prompt + outs[0][:-1]

    def slots(e: Engine) -> torch.Tensor:
        pages = [n.page for n in e.scheduler.cache.match(tokens, len(tokens) // 8)]
        assert len(pages) == 12
        return page_slots(pages, 8)

    pool = off.pool.latent_data(8).view(torch.uint8)
    assert torch.equal(on.hot.host[8][slots(on)], pool[slots(off)])


def test_mtp_pd_decode_server(glm_tiny, mtp_reference):
    """A PD decode server with HiSparse and MTP: the prefill server's draft KV arrives with
    the rest (the draft layer's latent in host rows), and the decode side drafts as the
    colocated engine does."""
    prompts, want, _ = mtp_reference()
    prefill = _engine(glm_tiny, num_pages=64, **MTP)
    decode = _engine(glm_tiny, num_pages=12, enable_hisparse=True, hisparse_config=HS_VERIFY, **MTP)
    params = replace(LONG, logprobs=0)
    # (every entry's rows, the draft layer's from the host too, after every step)
    reqs = _pd_run(prefill, decode, prompts, params, _entries_hold_their_rows)
    assert [r.output_ids for r in reqs] == [t for t, _ in want]
    c = decode.counters()
    assert c["spec_accepted_tokens"] > 0 and c["hisparse_misses"] > 0
    # One that ends on its first token ends outside a step: its hot buffer goes at once
    # (no catch-up follows to release it), the prefix cache keeping its pages
    with _pd(prefill, decode) as start:
        req = start(prompts[0], replace(params, max_tokens=1))
    assert req.finished and not decode.has_unfinished()
    decode.check_integrity()


def test_bad_settings_are_one_clear_error(tiny):
    with pytest.raises(DsakvError, match="needs --enable-hisparse"):
        EngineConfig(model=tiny, hisparse_config={"top_k": 16})
    with pytest.raises(DsakvError, match="chunked-prefill-size 1"):  # (every prompt dropped)
        EngineConfig(model=tiny, enable_hisparse=True, chunked_prefill_size=1)
    for cfg, msg in (
        ('{"device_buffer_size": 8}', "device_buffer_size must be >= 16"),
        ('{"top_k": 8}', "must be this model's index_topk"),
        ("{nope", "not valid JSON"),
        ('{"ratio": 2}', "unknown key"),
        # The kernels' sort keys pack entry ids in 16 bits (was: a traceback at decode).
        ('{"device_buffer_size": 65537}', "device_buffer_size must be <= 65536"),
    ):
        with pytest.raises(DsakvError, match=msg):
            _engine(tiny, num_pages=8, enable_hisparse=True, hisparse_config=cfg)
    # A verify's 1 + 3 tokens resolve their top-k at once: the buffer holds 4 × top_k
    with pytest.raises(DsakvError, match=r"must be >= 64 \(4 tokens a step × top_k 16\)"):
        _engine(
            tiny,
            num_pages=16,
            enable_hisparse=True,
            hisparse_config={**HS, "device_buffer_size": 32},
            **NGRAM,
        )
    with pytest.raises(DsakvError, match="less than one hot buffer"):  # refused every prompt
        _engine(tiny, num_pages=4, enable_hisparse=True, hisparse_config=HS)  # 32 slots
    on = _engine(tiny, num_pages=5, enable_hisparse=True, hisparse_config=HS)  # 40 slots
    with pytest.raises(DsakvError, match="latent pool holds 40 tokens: at most 39 fit"):
        on.add_request(list(range(1, 41)), GREEDY)  # (the message said 40 would)
    on.add_request(list(range(1, 40)), GREEDY)


def test_truncating_to_what_fits_keeps_what_the_device_holds(tiny):
    """`truncate_prompt_tokens=-1` keeps as many tokens as leave one for the output: under
    HiSparse, of the device's latent pool, not of the context (which it refused)."""
    engine = _engine(tiny, num_pages=5, enable_hisparse=True, hisparse_config=HS)  # 40 slots
    prompt = list(range(1, 101))
    with pytest.raises(DsakvError, match="at most 39 fit"):
        engine.add_request(prompt, SamplingParams(max_tokens=3, truncate_prompt_tokens=60))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    req = engine.add_request(prompt, replace(params, truncate_prompt_tokens=-1))
    assert req.prompt_ids == prompt[-39:]
    kept = engine.add_request(prompt[-39:], params)
    _run(engine, [])
    assert req.output_ids == kept.output_ids and len(req.output_ids) == 3


@pytest.mark.parametrize("buffer", [31, 40])  # page 16 divides 31 + 1 only, neither 40 nor 41
def test_plan_counts_the_hot_buffers_the_engine_runs(tiny, buffer, capsys):
    """`dsakv plan` counted a hot buffer as buffer + one page (47 and 56 slots here); the
    engine takes the buffer + one slot in whole pages (32 and 48), so more run at once."""
    from dsakv.cli import main

    cfg = {"device_buffer_size": buffer, "host_to_device_ratio": 2}
    budget = 12 * 16 * (8 * 2304 + 4 * 512 * 2) / 2**30  # 12 pages of 16 device tokens
    flags = ["--page-size", "16", "--kv-cache-dtype", "fp32", "--index-k-dtype", "fp32"]
    args = [*flags, "--kv-budget-gib", repr(budget), "--enable-hisparse"]
    assert main(["plan", tiny, *args, "--hisparse-config", json.dumps(cfg), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["hisparse"]["elided"]
    engine = _engine(
        tiny, page_size=16, kv_budget_gib=budget, enable_hisparse=True, hisparse_config=cfg
    )
    hot = engine.hot
    assert plan["device_tokens"] == engine.pool.num_latent_tokens == 12 * 16
    assert plan["hot_buffer_slots"] == hot.buffer_pages * 16 == {31: 32, 40: 48}[buffer]
    assert plan["concurrent_hot_buffers"] == hot.buf_slot.shape[0] == {31: 6, 40: 4}[buffer]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for p in _prompts(8, lo=8, hi=12):
        engine.add_request(p, params)
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.counters()["hisparse_hot_buffers"])
    assert peak == plan["concurrent_hot_buffers"]


def test_plan_with_draft_layers_is_the_engines_mtp_split(tiny, capsys):
    """`dsakv plan --draft-layers 1` counts the draft layer's latent (host and hot buffers)
    and index-K, and reserved slots for a verify of 3 drafts (the engine's default chain),
    as the engine under MTP splits the same budget."""
    from dsakv.cli import main

    cfg = {"device_buffer_size": 64, "host_to_device_ratio": 2}
    budget = 12 * 16 * (9 * 2304 + 5 * 512 * 2) / 2**30
    flags = ["--page-size", "16", "--kv-cache-dtype", "fp32", "--index-k-dtype", "fp32"]
    args = [*flags, "--kv-budget-gib", repr(budget), "--enable-hisparse", "--draft-layers", "1"]
    assert main(["plan", tiny, *args, "--hisparse-config", json.dumps(cfg), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["hisparse"]["elided"]
    on = _engine(tiny, page_size=16, kv_budget_gib=budget, enable_hisparse=True,
                 hisparse_config=cfg, **MTP)  # fmt: skip
    assert plan["hot_buffer_slots"] == on.hot.buffer_pages * 16 == 80  # (64 + 4, in pages)
    assert plan["concurrent_hot_buffers"] == on.hot.buf_slot.shape[0]
    assert plan["device_tokens"] == on.pool.num_latent_tokens
    assert plan["logical_tokens"] == on.pool.num_tokens
    assert plan["host_bytes"] == on.hot.host_nbytes == on.pool.num_tokens * 9 * 2304


def test_cli_flags(tiny):
    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "dsakv.cli", "generate", tiny, "--num-pages", "8",
             "--device", "cpu", "--max-tokens", "3", *args, "--prompt", "hello"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    bad = cli("--enable-hisparse", "--hisparse-config", '{"host_to_device_ratio": 0}')
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert bad.stderr.startswith("error: hisparse-config host_to_device_ratio must be >= 1")
    ok = cli("--enable-hisparse", "--hisparse-config", '{"host_to_device_ratio": 4}')
    assert ok.returncode == 0, ok.stderr
    assert "3 tokens" in ok.stdout


def test_a_host_latent_past_the_machine_is_one_line_before_the_weights(tiny, tmp_path, capsys):
    """HiSparse's host latent (every layer's latent of every logical token) past the
    machine's memory was torch's traceback once the weights had loaded; it is one line
    naming what sizes it, before they load: a checkpoint without weights gets that line."""
    from dsakv.memory.pool import memory_bytes

    bare = tmp_path / "no-weights"
    shutil.copytree(tiny, bare, ignore=shutil.ignore_patterns("*.safetensors"))
    # One 64-token device latent page backing twice the machine's memory in host latent
    # (fp32: 8 layers × 2304 B a token); the device pool (fp8 index-K of those tokens) fits.
    ratio = 2 * memory_bytes(torch.device("cpu")) // (64 * 8 * 2304) + 1
    flags = ["--kv-cache-dtype", "fp32", "--num-pages", "1", "--enable-hisparse"]
    flags += ["--hisparse-config", json.dumps({"host_to_device_ratio": ratio})]
    for model in (tiny, str(bare)):
        err = cli_error_line(["generate", model, "--prompt", "x", *flags], capsys)
        assert "GiB of HiSparse host latent on the host, which has" in err, err
        assert "--num-pages" in err and "host_to_device_ratio in --hisparse-config" in err


def test_bench_section_off_dense_elided_side_by_side(tiny):
    from dsakv.bench.hisparse import HiSparseSizes, run_hisparse_bench, summary_lines

    sizes = HiSparseSizes(requests=8, prompt_lens=(60, 90), output_lens=(4, 8), page_size=8,
                          off_requests=3.0, kv_cache_dtype="fp32")  # fmt: skip
    r = run_hisparse_bench(tiny, {"host_to_device_ratio": 8}, sizes=sizes)
    assert r["outputs_equal_off"] == {"on_dense": True, "on_elided": True}
    off, dense, elided = r["off"], r["on_dense"], r["on_elided"]
    assert elided["device_latent_tokens"] > dense["device_latent_tokens"]
    assert elided["peak_running_requests"] >= dense["peak_running_requests"]
    assert elided["peak_running_requests"] > off["peak_running_requests"]
    assert 0 < elided["miss_rate"] < 1 and elided["bytes_to_device_per_output_token"] > 0
    assert off["misses"] == 0 and off["logical_tokens"] == off["device_latent_tokens"]
    for x in (off, dense, elided):
        assert x["device_kv_bytes"] <= r["kv_budget_bytes"]
    lines = summary_lines(r)
    assert lines[2].startswith("off") and "on a CPU" in lines[-1]
