"""`cache_salt` (vLLM's; SGLang's `extra_key`): requests share prefix-cache pages only with
requests of the same salt, or of none, in every tier (device, host, L3), and a salted
request's output is the unsalted one's. index_topk covers every context here, so a cached
prefix gives the tokens a cold prefill gives."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dsakv import LLM, SamplingParams
from dsakv.engine import EngineConfig
from dsakv.engine.prefix_cache import ROOT_HASH, PrefixCache, chain_hashes, root_hash
from dsakv.errors import DsakvError
from dsakv.memory import PageAllocator
from dsakv.models.tiny import TINY_PRESETS, write_tiny_model
from dsakv.server import make_server

from .serving import TIMEOUT, port_taken, running

PS = 16
ARGS = dict(device="cpu", page_size=PS, num_pages=64, kv_cache_dtype="fp32", index_k_dtype="fp32")
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT = [random.Random(0).randrange(0, 256) for _ in range(150)]  # 9 full pages + 6 tokens
HIT = (len(PROMPT) - 1) // PS * PS  # what a full match serves (the last page is computed)
PORTS = range(19000, 19100)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    preset = copy.deepcopy(TINY_PRESETS["glm-tiny"])
    preset["index_topk"] = 4096
    return str(write_tiny_model(tmp_path_factory.mktemp("salt") / "tiny", preset=preset, seed=1))


@pytest.fixture(scope="module")
def llm(tiny) -> Iterator[LLM]:
    llm = LLM(tiny, **ARGS)
    yield llm
    llm.close()


def _run(llm: LLM, prompt, params=GREEDY) -> tuple[list[int], int]:
    """(greedy tokens, cached prompt tokens) of one prompt."""
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def _salted(salt: str | None, prompt=PROMPT) -> dict:
    return {"prompt_token_ids": prompt} if salt is None else {
        "prompt_token_ids": prompt, "cache_salt": salt}  # fmt: skip


# --- the tree ------------------------------------------------------------------------------------


def test_each_salt_has_its_own_tree_and_hash_chain():
    cache = PrefixCache(PageAllocator(16, 4))
    tokens = list(range(13))
    plain = cache.insert(tokens, cache.alloc(3))
    a = root_hash("a")
    assert root_hash(None) == ROOT_HASH and len({ROOT_HASH, a, root_hash("b")}) == 3
    assert cache.match(tokens, 3, "a") == [] and cache.match(tokens, 3, "b") == []
    salted = cache.insert(tokens, cache.alloc(3), salt="a")
    assert not {id(n) for n in salted} & {id(n) for n in plain}  # no page shared
    assert [n.hash for n in salted] == chain_hashes(tokens, 4, 0, 3, a)  # L3's keys
    assert not {n.hash for n in salted} & {n.hash for n in plain}
    assert cache.match(tokens, 3, "a") == salted and cache.match(tokens, 3) == plain
    assert cache.num_device_pages == 6 and cache.num_evictable_pages == 6
    cache.evict(6)  # a salt's last page gone, its root goes too
    assert set(cache.roots) == {None} and cache.allocator.num_free_pages == 16


# --- the engine ----------------------------------------------------------------------------------


def test_another_salt_shares_nothing_and_outputs_the_same(llm):
    llm.engine.flush_cache()
    cold, hit = _run(llm, _salted(None))
    assert hit == 0
    assert _run(llm, _salted(None)) == (cold, HIT)  # (the cache works)
    assert _run(llm, _salted("alice")) == (cold, 0)  # unsalted pages: not alice's
    assert _run(llm, _salted("alice")) == (cold, HIT)  # her own
    assert _run(llm, _salted("bob")) == (cold, 0)
    assert _run(llm, _salted("bob")) == (cold, HIT)
    llm.engine.flush_cache()
    assert _run(llm, _salted("alice")) == (cold, 0)
    assert _run(llm, _salted(None)) == (cold, 0)  # alice's pages: not the unsalted's
    llm.engine.check_integrity()


def test_salt_in_params_and_n_choices_share_the_salted_prompt(llm):
    """The forks of an `n > 1` request find its prompt in its salt's tree."""
    llm.engine.flush_cache()
    _run(llm, _salted(None))
    before = llm.engine.counters()["prefix_hit_tokens"]
    params = SamplingParams(max_tokens=4, temperature=0.8, seed=3, n=3, cache_salt="carol")
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert len(out.outputs) == 3 and out.num_cached_tokens == 0
    assert llm.engine.counters()["prefix_hit_tokens"] - before == 2 * HIT  # the forks' hits
    llm.engine.check_integrity()


@pytest.mark.parametrize("salt", ["", 5, b"x"])
def test_a_bad_salt_is_refused(llm, salt):
    with pytest.raises(DsakvError, match="cache_salt"):
        llm.generate([{"prompt_token_ids": [1, 2, 3], "cache_salt": salt}], GREEDY)
    with pytest.raises(DsakvError, match="cache_salt"):
        SamplingParams(cache_salt=salt)


def test_the_host_tier_keeps_salts_apart(tiny, llm):
    """12 device pages (the prompt needs 10) and a host tier of 4: an unrelated prompt
    demotes a salted prompt's pages to the host, from which only its salt promotes them."""
    page_bytes = llm.engine.counters()["bytes_per_token"] * PS
    host = LLM(tiny, **dict(ARGS, num_pages=12, host_pool_gib=4.5 * page_bytes / 2**30))
    try:
        cache = host.engine.cache
        cold = None
        for seed, salt in enumerate(["alice", None, "bob"], start=1):
            host.engine.flush_cache()
            tokens, _ = _run(host, _salted("alice"))
            cold = cold or tokens
            _run(host, [random.Random(seed).randrange(0, 256) for _ in range(150)])
            kept = cache.match(PROMPT, HIT // PS, "alice")
            assert any(n.page is None for n in kept)  # (some on the host)
            promoted = cache.promoted_pages
            tokens, hit = _run(host, _salted(salt))
            assert tokens == cold
            if salt == "alice":
                assert hit == len(kept) * PS and cache.promoted_pages > promoted
            else:
                assert hit == 0 and cache.promoted_pages == promoted
            host.engine.check_integrity()
    finally:
        host.close()


def test_l3_keys_carry_the_salt(tiny, tmp_path):
    """A prefix stored under one salt is found after a restart by that salt only."""
    store = dict(ARGS, hicache_storage_backend="file", hicache_storage_dir=str(tmp_path))
    pages = (len(PROMPT) - 1) // PS

    def restarted(salt: str | None) -> tuple[list[int], dict]:
        fresh = LLM(tiny, **store)
        try:
            tokens, _ = _run(fresh, _salted(salt))
            assert fresh.engine.l3.drain(TIMEOUT)
            return tokens, fresh.engine.counters()
        finally:
            fresh.close()

    cold, c = restarted("alice")
    assert c["l3_hits"] == 0 and c["l3_pages_written"] == pages
    for salt in (None, "bob"):
        tokens, c = restarted(salt)
        assert tokens == cold and c["l3_hits"] == 0 and c["prefix_hit_tokens"] == 0
    tokens, c = restarted("alice")
    assert tokens == cold and c["l3_hits"] == pages and c["prefix_hit_tokens"] == HIT
    assert len(list(Path(tmp_path).glob("*/*.kv"))) == 3 * pages  # three chains stored


def test_prefill_and_decode_sides_cache_under_the_salt(tiny, llm):
    """PD (`dsakv.disagg`, whose router sends both servers the request's body, salt and
    all): the prefill side's pages, shipped to the decode side, join each one's prefix
    cache in the salt's tree only."""
    from dsakv.engine import Engine
    from dsakv.engine import disagg as ops

    llm.engine.flush_cache()
    alone, _ = _run(llm, _salted(None))
    params = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0, ignore_eos=True,
                            cache_salt="alice")  # fmt: skip
    prefill, decode = Engine(EngineConfig(tiny, **ARGS)), Engine(EngineConfig(tiny, **ARGS))
    try:
        first = prefill.add_request(PROMPT, dataclasses.replace(params, max_tokens=1))
        ops.hold(prefill, first)
        while prefill.has_unfinished():
            prefill.step()
        req = ops.reserve(decode, PROMPT, params)
        pages = -(-len(PROMPT) // PS)
        decode.pool.write_pages(req.pages[:pages], prefill.pool.read_pages(first.pages[:pages]))
        ops.release_held(prefill, first)
        ops.start_decoding(decode, req, first.output_ids[0])
        while decode.has_unfinished():
            decode.step()
        assert req.output_ids == alone
        for engine in (prefill, decode):
            assert len(engine.cache.match(PROMPT, HIT // PS, "alice")) == HIT // PS
            assert engine.cache.match(PROMPT, HIT // PS) == []
            engine.check_integrity()
    finally:
        prefill.close()
        decode.close()


def test_mtp_pins_the_salted_pages_it_catches_up_over(tmp_path, monkeypatch):
    """MTP's catch-up over a finishing request's last full pages locks them in the prefix
    cache (`MTPDrafter._pin`): its salt's, not the unsalted tree's."""
    from dsakv.engine.speculative import MTPDrafter

    preset = {**TINY_PRESETS["glm-tiny"], "index_topk": 1024}
    model = str(write_tiny_model(tmp_path / "mtp", preset, mtp="random"))
    pinned: list = []
    pin = MTPDrafter._pin

    def spy(self, req, start):
        nodes = pin(self, req, start)
        pinned.extend((req.params.cache_salt, n) for n in nodes)
        return nodes

    monkeypatch.setattr(MTPDrafter, "_pin", spy)
    # (each one's last step computes position 95, the last of a page: + 20 - 1 = 96)
    prompts = [[random.Random(s).randrange(0, 256) for _ in range(77)] for s in (1, 2)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    mtp = LLM(model, **ARGS, speculative_algorithm="mtp", speculative_num_steps=3)
    try:
        salted = [_salted("alice", p) for p in prompts]
        outs = [o.token_ids for o in mtp.generate(salted, params, use_tqdm=False)]
        assert pinned and all(salt == "alice" for salt, _ in pinned)
        for _, node in pinned:
            while node.parent is not None:
                node = node.parent
            assert node.hash == root_hash("alice")
        mtp.engine.check_integrity()
        mtp.engine.flush_cache()
        assert [o.token_ids for o in mtp.generate(prompts, params, use_tqdm=False)] == outs
    finally:
        mtp.close()


# --- the server ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base(tiny) -> Iterator[str]:
    port = next(p for p in PORTS if not port_taken(p))
    server, engine = make_server(EngineConfig(model=tiny, **ARGS), port=port, log_level="warning")
    try:
        with running(server) as url:
            yield url
    finally:
        engine.shutdown()
        engine.close_engine()


def _cached(base: str, path: str, body: dict) -> tuple[list[int] | str, int]:
    r = httpx.post(base + path, json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    out = r.json()
    if path == "/generate":
        return out["output_ids"], out["meta_info"]["cached_tokens"]
    if path == "/v1/responses":
        return out["output"][-1]["content"][0]["text"], out["usage"]["input_tokens_details"][
            "cached_tokens"]  # fmt: skip
    choice = out["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    return text, out["usage"]["prompt_tokens_details"]["cached_tokens"]


_TEXT = "Salted prefixes are private: " + "the same words again and again, " * 3
_BODIES = {
    "/v1/completions": {"prompt": _TEXT, "max_tokens": 4, "temperature": 0},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": _TEXT}], "max_tokens": 4, "temperature": 0},
    "/v1/responses": {"input": _TEXT, "max_output_tokens": 4, "temperature": 0, "store": False},
    "/generate": {"text": _TEXT, "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
}  # fmt: skip


@contextlib.contextmanager
def _flushed(base: str) -> Iterator[None]:
    assert httpx.post(f"{base}/flush_cache", timeout=TIMEOUT).status_code == 200
    yield


@pytest.mark.parametrize("path", list(_BODIES))
def test_the_routes_keep_salts_apart(base, path):
    key = "extra_key" if path == "/generate" else "cache_salt"  # (SGLang's, vLLM's)
    body = _BODIES[path]
    with _flushed(base):
        cold, hit = _cached(base, path, body)
        assert hit == 0
        warm, hit = _cached(base, path, body)
        assert warm == cold and hit > 0
        full = hit
        assert _cached(base, path, {**body, key: "alice"}) == (cold, 0)
        assert _cached(base, path, {**body, key: "alice"}) == (cold, full)
        assert _cached(base, path, {**body, key: "bob"}) == (cold, 0)
        assert _cached(base, path, body) == (cold, full)


def test_sglang_joins_cache_salt_and_extra_key(base):
    body = _BODIES["/v1/completions"]
    with _flushed(base):
        cold, _ = _cached(base, "/v1/completions", {**body, "cache_salt": "ab"})
        both = {**body, "cache_salt": "a", "extra_key": "b"}
        assert _cached(base, "/v1/completions", both)[1] > 0  # (SGLang's: "a" + "b")
        generate = {**_BODIES["/generate"], "cache_salt": "a", "extra_key": "b"}
        assert _cached(base, "/generate", generate)[1] > 0


@pytest.mark.parametrize("path", list(_BODIES))
@pytest.mark.parametrize("salt", ["", 5, ["a"]])
def test_a_bad_salt_is_a_400(base, path, salt):
    if path == "/generate" and salt == ["a"]:
        salt = ["a", "b"]  # (a list there is one per prompt: two for one prompt)
    r = httpx.post(base + path, json={**_BODIES[path], "cache_salt": salt}, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in ("cache_salt", "sampling_params.cache_salt"), r.text
