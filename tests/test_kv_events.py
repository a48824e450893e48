"""KV cache events (vLLM's and SGLang's --kv-events-config) read as a KV-aware router reads
them: a real ZMQ SUB socket, vLLM's replay protocol (its #45177 layout) and a msgspec decoder
over the tagged-array structs vLLM's example subscriber declared before its #42892
(examples/online_serving/kv_events_subscriber.py), so these tests check the wire, not
dsakv's classes. The subscriber keeps a view of each worker's pages (hash -> media, and each
page's cache_salt as Dynamo's router recovers it: from `extra_keys`, else the parent's) from
the events alone; after each scenario it must equal the prefix cache's own state."""

import json
import logging
import random
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import replace

import httpx
import msgspec
import pytest
import zmq

from dsakv import LLM, SamplingParams
from dsakv.cli.disagg import _decode_kv_events
from dsakv.config.kv_events import KVEventsConfig
from dsakv.disagg.launch import wait_healthy
from dsakv.engine.kv_events import STORED, KVEventPublisher
from dsakv.engine.prefix_cache import root_hash
from dsakv.errors import ConfigError, DsakvError
from dsakv.procs import free_port

from .conftest import cli_config, cli_error_line
from .serving import TIMEOUT, ServerProcess, port_taken

# --- vLLM's types, as its example subscriber declares them ----------------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[tuple | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
CTX = zmq.Context.instance()
PS = 16
GREEDY = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 250) for _ in range(n)]


def _pair_of_free_ports() -> int:
    """A port p with p and p + 1 free (a DP rank's endpoint is the port plus its rank)."""
    while True:
        p = free_port()
        if p < 65535 and not port_taken(p + 1):
            return p


def replay(port: int, start: int, topic: bytes = b"") -> list[tuple[int, bytes]]:
    """vLLM's replay protocol from a DEALER (a REQ socket takes one reply only): the start
    sequence number as 8 bytes; (topic, seq, payload) frames back, as published, until an
    empty topic, seq -1 and no payload."""
    dealer = CTX.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(TIMEOUT * 1000), "no replay answer"
            empty, got, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert got == payload == b""
                return out
            assert got == topic
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)


class Subscriber:
    """A router's view of one worker: live batches in sequence order, and the pages they say
    the worker holds. A gap is filled from the replay socket, as vLLM's example does, and so
    is a quiet second (a SUB socket connecting misses what is published meanwhile)."""

    def __init__(self, port: int, replay_port: int, topic: bytes = b"") -> None:
        self.sub = CTX.socket(zmq.SUB)
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.replay_port, self.topic = replay_port, topic
        self.raw: list[bytes] = []  # payloads by sequence number
        self.replayed = self.live = 0
        self.batches: list[KVEventBatch] = []
        self.view: dict[int, set[str]] = {}  # hash -> media
        self.salts: dict[int, str | None] = {}  # hash -> its tree's cache_salt

    def close(self) -> None:
        self.sub.close(linger=0)

    def take(self, done, what: str) -> list:
        """Events until `done(events so far)`; each batch applied to `view` first."""
        events: list = []
        deadline = time.monotonic() + TIMEOUT
        while not done(events):
            assert time.monotonic() < deadline, f"no {what}: got {events}"
            if not self.sub.poll(1000):
                events += self._catch_up(None)
                continue
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == self.topic and len(seq_bytes) == 8
            seq = int.from_bytes(seq_bytes, "big")
            events += self._catch_up(seq)
            if seq < len(self.raw):  # (replayed meanwhile)
                assert payload == self.raw[seq]
                continue
            assert seq == len(self.raw)
            self.live += 1
            events += self._apply(payload)
        return events

    def _catch_up(self, upto: int | None) -> list:
        """The batches before `upto` (None: all there are) not seen yet, from the replay."""
        if upto is not None and upto <= len(self.raw):
            return []
        events = []
        for seq, payload in replay(self.replay_port, len(self.raw), self.topic):
            if upto is None or seq < upto:
                assert seq == len(self.raw)
                self.replayed += 1
                events += self._apply(payload)
        return events

    def _apply(self, payload: bytes) -> list:
        self.raw.append(payload)
        batch = DECODER.decode(payload)
        self.batches.append(batch)
        for e in batch.events:
            if isinstance(e, BlockStored):
                parent = e.parent_block_hash
                assert parent is None or parent in self.view, f"{parent}: a parent not held"
                salt = None if parent is None else self.salts[parent]
                keys = e.extra_keys or [None] * len(e.block_hashes)
                assert len(keys) == len(e.block_hashes)
                for h, k in zip(e.block_hashes, keys):
                    assert e.medium not in self.view.get(h, ()), f"{h} stored twice"
                    salt = k[0] if k else salt  # (Dynamo's: a page's own, else its parent's)
                    assert self.salts.setdefault(h, salt) == salt
                    self.view.setdefault(h, set()).add(e.medium)
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    assert e.medium in self.view.get(h, ()), f"{h} removed, never stored"
                    self.view[h].discard(e.medium)
                    if not self.view[h]:
                        del self.view[h], self.salts[h]
            else:
                self.view.clear()
                self.salts.clear()
        return batch.events


def stored(events: list, medium: str = "GPU") -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored) and e.medium == medium]


def removed(events: list, medium: str) -> list[int]:
    return [h for e in events if isinstance(e, BlockRemoved) and e.medium == medium
            for h in e.block_hashes]  # fmt: skip


def pages_of(events: list[BlockStored]) -> int:
    return sum(len(e.block_hashes) for e in events)


def cache_state(llm: LLM) -> tuple[dict[int, set[str]], dict[int, str | None]]:
    """What the prefix cache holds: each node's hash as the events name it, where, and the
    salt of its tree (by its root's hash: one of the salts these tests send)."""
    by_root = {root_hash(salt): salt for salt in (None, "s", "t")}
    media, salts = {}, {}
    for n in llm.engine.cache._nodes():
        h = int.from_bytes(n.hash[:8], "big", signed=True)
        held = (("GPU", n.page is not None), ("CPU", n.host_slots is not None))
        media[h] = {medium for medium, here in held if here}
        root = n
        while root.parent is not None:
            root = root.parent
        salts[h] = by_root[root.hash]
    return media, salts


def settled(sub: Subscriber, llm: LLM) -> None:
    """The subscriber's view comes to be the idle engine's cache (the batches of its last
    steps may still be on their way)."""
    sub.take(lambda ev: (sub.view, sub.salts) == cache_state(llm), "the cache's own state")


# --- in process: LLM(kv_events_config=...) --------------------------------------------------


@pytest.fixture(scope="module")
def ports() -> tuple[int, int]:
    return free_port(), free_port()


@pytest.fixture(scope="module")
def sub(ports) -> Iterator[Subscriber]:
    s = Subscriber(*ports)  # (before the engine binds; what connecting misses, it replays)
    yield s
    s.close()


@pytest.fixture(scope="module")
def llm(glm_tiny, ports, sub) -> Iterator[LLM]:
    pub, rep = ports
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://*:{rep}"}  # fmt: skip
    # 24 device pages and a 12-page host tier: a few prompts evict, demote and drop
    llm = LLM(glm_tiny, device="cpu", page_size=PS, num_pages=24, host_pool_ratio=0.5,
              kv_events_config=json.dumps(config))  # fmt: skip
    yield llm
    llm.close()


def _run(llm: LLM, prompt: list[int], salt: str | None = None) -> None:
    p = {"prompt_token_ids": prompt} if salt is None else {
        "prompt_token_ids": prompt, "cache_salt": salt}  # fmt: skip
    llm.generate([p], GREEDY, use_tqdm=False)


def test_stored_pages_chain(llm, sub):
    """A prompt's full pages are stored on the device as one hash chain over its tokens; a
    prompt sharing its first two pages stores only the rest, linked to the second; a page
    already cached is never announced again; a salted prompt is another chain."""
    a = _prompt(1, 70)  # 4 full pages
    _run(llm, a)
    got = stored(sub.take(lambda ev: pages_of(stored(ev)) >= 4, "A's pages"))
    assert pages_of(got) == 4
    assert all(e.block_size == PS and e.lora_id is None for e in got)
    assert [t for e in got for t in e.token_ids] == a[:64]
    hashes = [h for e in got for h in e.block_hashes]
    assert len(set(hashes)) == 4
    assert got[0].parent_block_hash is None  # (the tree's first page)
    for before, e in zip(got, got[1:]):
        assert e.parent_block_hash == before.block_hashes[-1]
    assert sub.batches[-1].data_parallel_rank == 0

    b = a[:32] + _prompt(2, 40)  # A's first two pages, then two of its own
    _run(llm, b)
    got = stored(sub.take(lambda ev: pages_of(stored(ev)) >= 2, "B's pages"))
    assert pages_of(got) == 2 and got[0].parent_block_hash == hashes[1]
    assert [t for e in got for t in e.token_ids] == b[32:64]
    assert not set(hashes) & {h for e in got for h in e.block_hashes}

    _run(llm, a)  # all cached: nothing stored (the view refuses a page stored twice)
    _run(llm, a, salt="s")
    salted = stored(sub.take(lambda ev: pages_of(stored(ev)) >= 4, "the salted pages"))
    assert pages_of(salted) == 4 and [t for e in salted for t in e.token_ids] == a[:64]
    assert salted[0].parent_block_hash is None
    assert not set(hashes) & {h for e in salted for h in e.block_hashes}
    # (the salt on the tree's first page, as vLLM's: a router hashing tokens tells the two
    # trees apart; the unsalted one tells none)
    assert salted[0].extra_keys == [("s",)] + [None] * (len(salted[0].block_hashes) - 1)
    assert all(e.extra_keys is None for e in got + salted[1:])
    assert {sub.salts[h] for h in hashes} == {None}
    settled(sub, llm)


def test_eviction_and_host_tier(llm, sub):
    """Evicted pages leave the device ("GPU" removed) for the host tier ("CPU" stored, its
    chain parent kept); a hit brings them back (the reverse); a full host tier drops its
    oldest copies ("CPU" removed). The subscriber's view stays the cache's."""
    assert llm.reset_prefix_cache()
    sub.take(lambda ev: any(isinstance(e, AllBlocksCleared) for e in ev), "the clear")
    a = _prompt(3, 70)
    _run(llm, a)
    ev = sub.take(lambda ev: pages_of(stored(ev)) >= 4, "A's pages")
    a_hashes = [h for e in stored(ev) for h in e.block_hashes]
    _run(llm, a[:48], salt="t")  # (a salted tree's pages move too, its salt kept)
    sub.take(lambda ev: pages_of(stored(ev)) >= 3, "the salted pages")
    _run(llm, _prompt(4, 330))  # 21 pages of 24: some of A's go to the host
    ev = sub.take(lambda ev: removed(ev, "GPU"), "an eviction")
    demoted = [h for h in removed(ev, "GPU") if h in a_hashes]
    assert demoted
    on_host = [e for e in stored(ev, "CPU") if e.block_hashes[0] in demoted]
    assert {h for e in on_host for h in e.block_hashes} == set(demoted)
    for e in on_host:  # (the chain kept: its parent is the page before, on the device)
        i = a_hashes.index(e.block_hashes[0])
        assert e.parent_block_hash == (a_hashes[i - 1] if i else None)
    settled(sub, llm)

    _run(llm, a)  # a hit: the host copies come back to the device
    sub.take(lambda ev: set(demoted) <= set(removed(ev, "CPU")), "A's promotion")
    assert all("GPU" in sub.view[h] for h in a_hashes)
    _run(llm, a[:48], salt="t")
    settled(sub, llm)
    for seed in (5, 6, 7):  # the host tier overflows
        _run(llm, _prompt(seed, 330))
    ev = sub.take(lambda ev: removed(ev, "CPU"), "a host copy dropped")
    settled(sub, llm)


def test_flush_and_weight_update_clear(llm, sub, glm_tiny):
    """/flush_cache (reset), a weight update and releasing the KV cache (sleep) each say
    AllBlocksCleared, alone: not each page's removal."""
    _run(llm, _prompt(8, 40))
    sub.take(lambda ev: stored(ev), "pages")
    assert llm.reset_prefix_cache()
    sub.take(lambda ev: any(isinstance(e, AllBlocksCleared) for e in ev), "the flush")
    assert sub.batches[-1].events == [AllBlocksCleared()]
    assert (sub.view, sub.salts) == cache_state(llm) == ({}, {})

    _run(llm, _prompt(9, 40))
    sub.take(lambda ev: stored(ev), "pages")
    llm.update_weights(glm_tiny)
    sub.take(lambda ev: any(isinstance(e, AllBlocksCleared) for e in ev), "the update's clear")
    assert sub.batches[-1].events == [AllBlocksCleared()]
    assert (sub.view, sub.salts) == cache_state(llm) == ({}, {})

    _run(llm, _prompt(14, 40))
    sub.take(lambda ev: stored(ev), "pages")
    llm.release_memory_occupation(["kv_cache"])
    sub.take(lambda ev: any(isinstance(e, AllBlocksCleared) for e in ev), "the release's clear")
    assert sub.batches[-1].events == [AllBlocksCleared()]
    assert (sub.view, sub.salts) == cache_state(llm) == ({}, {})
    llm.resume_memory_occupation(["kv_cache"])


def test_pd_sides_publish(llm, sub):
    """A PD decode server's request that the prefill server's first token ends joins the
    cache without a step (`start_decoding`): its pages go out at once, as the server may
    not step again. A prefill server's request held for the hand-off shares its prompt's
    pages from its prefill on; its release changes what the view holds in step with them."""
    from dsakv.engine import disagg as ops

    prompt = _prompt(13, 40)
    req = ops.reserve(llm.engine, prompt, SamplingParams(max_tokens=1))
    ops.start_decoding(llm.engine, req, 5)  # (its KV never written: only its pages count)
    assert req.finished and not llm.engine.has_unfinished()
    got = stored(sub.take(lambda ev: stored(ev), "the decode side's pages"))
    assert [t for e in got for t in e.token_ids] == prompt[:32]
    settled(sub, llm)

    prompt = _prompt(15, 50)
    first = llm.engine.add_request(prompt, SamplingParams(max_tokens=1))
    ops.hold(llm.engine, first)
    while llm.engine.has_unfinished():
        llm.engine.step()
    got = stored(sub.take(lambda ev: stored(ev), "the prefill side's pages"))
    assert [t for e in got for t in e.token_ids] == prompt[:48]
    settled(sub, llm)
    ops.release_held(llm.engine, first)
    settled(sub, llm)


def test_replay_returns_missed_batches(llm, sub, ports):
    """A subscriber that joins late gets the batches it missed from the replay socket, the
    same bytes that were published; a replay from sequence n returns n onwards."""
    _run(llm, _prompt(10, 40))
    sub.take(lambda ev: stored(ev), "pages")
    late = Subscriber(*ports)
    try:
        late.take(lambda ev: len(late.raw) >= len(sub.raw), "the missed batches")
        assert late.replayed >= 1
        for seed in range(11, 31):  # (until its subscription has reached the publisher)
            _run(llm, _prompt(seed, 40))
            sub.take(lambda ev: stored(ev), "pages")
            late.take(lambda ev: len(late.raw) >= len(sub.raw), "the next batch")
            if late.live:
                break
        assert late.live >= 1
        assert late.raw == sub.raw and (late.view, late.salts) == (sub.view, sub.salts)
    finally:
        late.close()
    n = len(sub.raw)
    assert [s for s, _ in replay(ports[1], n - 2)] == [n - 2, n - 1]
    assert replay(ports[1], n) == []


class _Stall(tuple):
    """A record the publisher's thread stops at (reading its kind) until `go` is set; then
    an AllBlocksCleared."""

    go: threading.Event

    def __getitem__(self, i):
        assert self.go.wait(TIMEOUT)
        return "AllBlocksCleared"


def test_full_queue_waits_and_loses_nothing(glm_tiny):
    """With the publisher's thread behind and its queue full (max_queue_size 1), a step waits
    for room, as vLLM's does: a batch dropped there would leave no sequence gap to replay,
    and a router's view would miss those pages for good."""
    ports = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{ports[0]}",
              "replay_endpoint": f"tcp://*:{ports[1]}", "max_queue_size": 1}  # fmt: skip
    sub = Subscriber(*ports)
    llm = LLM(glm_tiny, device="cpu", page_size=PS, num_pages=24, kv_events_config=config)
    publisher, go = llm.engine.kv_events, threading.Event()
    _Stall.go = go
    try:
        publisher.publish([_Stall()])  # (the cache is empty: its clear changes nothing)

        def release() -> None:  # once a step waits for room (bounded)
            deadline = time.monotonic() + TIMEOUT
            while not publisher.waited and not go.is_set() and time.monotonic() < deadline:
                time.sleep(0.01)
            go.set()

        releaser = threading.Thread(target=release)
        releaser.start()
        for seed in (20, 21, 22):  # a batch of stored pages each
            _run(llm, _prompt(seed, 40))
        go.set()
        releaser.join()
        assert publisher.waited >= 1
        settled(sub, llm)
        assert len(sub.view) == 6
    finally:
        go.set()  # (whatever failed: the thread goes on, the engine closes)
        llm.close()
        sub.close()


# --- the publisher alone: its thread's edges --------------------------------------------------


def _stored_pages(first: int, n: int, tokens: int = PS) -> list[tuple]:
    """`n` pages' records as the prefix cache writes them, each `tokens` long, page i's
    hash i (`block_hash`: its first 8 bytes)."""
    key = tuple(range(1000, 1000 + tokens))  # (2-3 bytes a token on the wire)
    return [
        (STORED, "GPU", i.to_bytes(8, "big") * 2, None, key, None) for i in range(first, first + n)
    ]


def _start(config: KVEventsConfig) -> KVEventPublisher:
    """A publisher, started on a thread of the test's: a start that hangs fails the test."""
    started: Future[KVEventPublisher] = Future()

    def start() -> None:
        try:
            started.set_result(KVEventPublisher(config, 0, PS))
        except BaseException as e:  # noqa: BLE001 - the test's to raise
            started.set_exception(e)

    threading.Thread(target=start, daemon=True).start()
    return started.result(TIMEOUT)


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("topic", "\udc80", "topic: UnicodeEncodeError"),
        ("endpoint", "tcp://\udc80:5557", "tcp://\udc80:5557: UnicodeEncodeError"),
    ],
)
def test_a_publisher_that_cannot_start_fails_at_once(key, value, says):
    """Whatever fails in the publisher thread's setup is one error from its start: not a
    start that waits forever (a value pyzmq refuses with other than a ZMQError), nor a
    publisher that said it was up with its thread dead (nothing published, ever)."""
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{free_port()}")
    with pytest.raises(ConfigError) as e:
        _start(replace(config, **{key: value}))
    assert str(e.value).startswith("--kv-events-config: ") and says in str(e.value)


@pytest.mark.parametrize("module", ["zmq", "msgspec"])
def test_a_publisher_whose_libraries_fail_to_import_fails_at_once(module, monkeypatch):
    """pyzmq or msgspec failing to import (a broken install) is one error from the start,
    as any other failure of the thread's setup (it came before the setup's `try`: the
    thread died, and the engine's start waited for it forever)."""
    monkeypatch.setitem(sys.modules, module, None)  # (`import` fails: ModuleNotFoundError)
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{free_port()}")
    with pytest.raises(ConfigError, match=f"^--kv-events-config: pyzmq and msgspec: .*{module}"):
        _start(config)


class _Fatal(BaseException):
    """What no `except Exception` catches."""


class _Kills(tuple):
    """A record that kills the publisher's thread as it reads its kind."""

    def __getitem__(self, i):
        raise _Fatal("a bug")


def test_a_dead_publisher_drops_loudly_and_the_engine_goes_on(caplog):
    """A publisher thread that died (it never should) costs the engine no step: each batch
    after is counted as dropped and said in an error, never queued for nobody, nor waited
    on with the queue full (max_queue_size 1)."""
    port = free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}",
                            max_queue_size=1)  # fmt: skip
    publisher = _start(config)
    try:
        with caplog.at_level(logging.ERROR, logger="dsakv.engine.kv_events"):
            publisher.publish([_Kills()])
            publisher._thread.join(TIMEOUT)
            assert not publisher._thread.is_alive()
            for first in (0, 1, 2):
                publisher.publish(_stored_pages(first, 1))
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert any("no longer published (1 batch(es) dropped)" in m and "_Fatal: a bug" in m
                   for m in errors), errors  # fmt: skip
        assert publisher.dropped == 3 and publisher.died == "_Fatal: a bug"
    finally:
        publisher.close()


def test_close_lets_a_slow_subscriber_take_the_last_batches():
    """Every batch published before `close` reaches a subscriber still reading though it
    had not taken them when the engine closed (ZMQ's linger: a socket closed without one
    drops what is still queued for a subscriber, most of these batches)."""
    port = free_port()
    publisher = _start(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}"))
    sub = CTX.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 1)  # (a router slow to read: the batches wait on the publisher)
    sub.setsockopt(zmq.RCVBUF, 4096)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    closer = threading.Thread(target=publisher.close, kwargs={"timeout_s": TIMEOUT})
    try:
        published = 0
        deadline = time.monotonic() + TIMEOUT
        while not sub.poll(100):  # (a probe a time until the subscription has arrived)
            assert time.monotonic() < deadline, "the subscription never arrived"
            publisher.publish(_stored_pages(published, 1))
            published += 1
        first = int.from_bytes(sub.recv_multipart()[1], "big")
        for _ in range(100):  # ~6 MB, past what the sockets' buffers hold
            publisher.publish(_stored_pages(published, 64, 512))
            published += 1
        closer.start()
        time.sleep(0.5)  # (reading from here on: a close without linger has dropped the rest)
        seqs = [first]
        while seqs[-1] < published - 1 and sub.poll(5000):
            seqs.append(int.from_bytes(sub.recv_multipart()[1], "big"))
        assert seqs == list(range(first, published)), f"{len(seqs)} of {published - first}"
    finally:
        if not closer.is_alive():
            publisher.close()
        closer.join()
        sub.close(linger=0)


# --- the configuration ------------------------------------------------------------------------


def test_config_spellings(glm_tiny):
    """vLLM's JSON and SGLang's turn events on; vLLM's off switch keeps them off; data
    parallel ranks and serve-pd's decode server publish on the ports after."""

    def events(text: str):
        return cli_config("serve", glm_tiny, "--kv-events-config", text).kv_events

    on = events('{"enable_kv_cache_events": true}')
    assert (on.publisher, on.endpoint, on.topic, on.buffer_steps) == (
        "zmq",
        "tcp://*:5557",
        "",
        10_000,
    )
    assert events('{"publisher": "zmq", "topic": "kv"}').topic == "kv"  # SGLang's
    assert events('{"enable_kv_cache_events": false, "publisher": "zmq"}') is None
    assert events("{}") is None
    c = KVEventsConfig.parse({"enable_kv_cache_events": True, "replay_endpoint": "tcp://*:6000"})
    assert c.endpoints(2) == ("tcp://*:5559", "tcp://*:6002")
    assert KVEventsConfig(endpoint="ipc:///tmp/kv").endpoints(1)[0] == "ipc:///tmp/kv_dp1"
    pd = cli_config("serve-pd", glm_tiny, "--tp", "2", "--dp-attention",
                    "--kv-events-config", '{"enable_kv_cache_events": true}')  # fmt: skip
    flag, text = _decode_kv_events(pd)
    assert flag == "--kv-events-config" and json.loads(text)["endpoint"] == "tcp://*:5559"


@pytest.mark.parametrize(
    "text, says",
    [
        ("{bad", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"enable_kv_cache_events": true, "port": 1}', "unknown key(s) port"),
        ('{"publisher": "kafka"}', "publisher must be null or zmq"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be true or false"),
        ('{"hwm": -1}', "hwm must be an integer >= 0"),
        ('{"max_queue_size": 0}', "max_queue_size must be an integer >= 1"),
        ('{"endpoint": "http://x:1"}', "endpoint must be a tcp://"),
        ('{"replay_endpoint": "tcp://*:99999"}', "replay_endpoint must end in a port"),
    ],
)
def test_bad_config_exits_2(glm_tiny, capsys, text, says):
    error = cli_error_line(["serve", glm_tiny, "--kv-events-config", text], capsys)
    assert "--kv-events-config" in error and says in error
    with pytest.raises(DsakvError, match="kv_events_config: "):
        LLM(glm_tiny, device="cpu", kv_events_config=text)


@pytest.mark.parametrize(
    "key, value", [("hwm", 2**31), ("buffer_steps", 2**63), ("max_queue_size", 2**63)]
)
def test_integers_past_what_the_publisher_takes(key, value):
    """ZMQ takes the high-water mark as a C int, a deque its length as a C ssize_t: past
    them the publisher's thread failed (a start that never ended, or a publisher that
    never published). Refused, in one line; the largest taken publish."""
    with pytest.raises(ConfigError, match=rf"{key} must be an integer >= \d+ and <= \d+, got"):
        KVEventsConfig.parse({"enable_kv_cache_events": True, key: value})
    port, rep = free_port(), free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}",
                            replay_endpoint=f"tcp://*:{rep}", **{key: value - 1})  # fmt: skip
    publisher, sub = _start(config), Subscriber(port, rep)
    try:
        publisher.publish(_stored_pages(0, 2))
        assert pages_of(stored(sub.take(lambda ev: stored(ev), "the pages"))) == 2
    finally:
        publisher.close()
        sub.close()


def test_refused_combinations(glm_tiny, capsys):
    """Events publish the prefix cache: not without it; ports two DP ranks would share."""
    on = '{"enable_kv_cache_events": true}'
    port = str(free_port())
    error = cli_error_line(["serve", glm_tiny, "--port", port, "--no-prefix-cache",
                            "--kv-events-config", on], capsys)  # fmt: skip
    assert "needs the prefix cache" in error
    clash = '{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5558"}'
    error = cli_error_line(["serve", glm_tiny, "--port", port, "--tp", "2", "--dp-attention",
                            "--kv-events-config", clash], capsys)  # fmt: skip
    assert "tcp://*:5558 would be bound twice" in error


# --- `dsakv serve` with two DP ranks ------------------------------------------------------------


@pytest.fixture(scope="module")
def served(glm_tiny, tmp_path_factory) -> Iterator[tuple[ServerProcess, list[Subscriber]]]:
    pub, rep = _pair_of_free_ports(), _pair_of_free_ports()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://*:{rep}", "topic": "kv@dsakv"}  # fmt: skip
    subs = [Subscriber(pub + r, rep + r, b"kv@dsakv") for r in (0, 1)]
    server = ServerProcess(tmp_path_factory.mktemp("kv_events"), "serve", glm_tiny,
                           "--device", "cpu", "--page-size", str(PS), "--num-pages", "64",
                           "--tp", "2", "--dp-attention", "--kv-events-config", json.dumps(config))  # fmt: skip
    try:
        wait_healthy([server.url], [server.proc], 180)
        yield server, subs
    finally:
        server.stop()
        for s in subs:
            s.close()


def test_serve_publishes_per_dp_rank(served):
    """Each DP rank of `dsakv serve` publishes its own pages on its own port with its rank;
    the same prompt's pages have the same hashes on both."""
    server, subs = served
    prompt = _prompt(12, 40)  # 2 full pages
    body = {"model": "m", "prompt": prompt, "max_tokens": 2, "n": 2, "temperature": 1.0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=TIMEOUT)  # (a choice a rank)
    assert r.status_code == 200, r.text
    seen = []
    for rank, sub in enumerate(subs):
        got = stored(sub.take(lambda ev: pages_of(stored(ev)) >= 2, f"rank {rank}'s pages"))
        assert [t for e in got for t in e.token_ids] == prompt[:32]
        assert {b.data_parallel_rank for b in sub.batches} == {rank}
        seen.append([h for e in got for h in e.block_hashes])
    assert seen[0] == seen[1]
