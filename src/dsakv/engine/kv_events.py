"""KV cache events for KV-aware routers (NVIDIA Dynamo, llm-d): vLLM's and SGLang's
`--kv-events-config` publisher, on their wire.

What. The prefix cache (`PrefixCache.events`) records, as it goes, each page it adopts on
the device (`BlockStored`, medium "GPU"), each page that leaves the device for good
(`BlockRemoved`, "GPU"), the host tier's moves (a demotion: removed from "GPU", stored on
"CPU"; a promotion the reverse; a host copy dropped: removed from "CPU") and a flush or a
weight update (`AllBlocksCleared`). Pages that never join the tree (the prefix cache off,
a partial last page, a request whose KV predates a weight update) are never announced, nor
is a page already cached (its duplicate is freed). "GPU" names the engine's KV pool on a
CPU run too: consumers read the medium as the tier (vLLM's main pool is "GPU", its offload
tier "CPU"), and two tiers both called "CPU" could not be told apart.

A page's hash is its chain hash (`prefix_cache.page_hash`, over every token from the start
of its sequence and the request's `cache_salt`) as a signed 64-bit int, its first 8 bytes
big-endian: SGLang's conversion of its own SHA-256 chain, and an int64 every msgpack
decoder takes. It is the same on every rank, server and restart for the same tokens and
salt, so a router sees one prefix as one block wherever it is cached. A batch's parent
hash is that of the page before its first (None for a tree's first page). Routers hash
the tokens themselves (Dynamo, llm-d): a salted tree's first page carries its salt in
`extra_keys` as vLLM's does (`[(salt,), None, ...]`, one entry a page), and the pages
after it inherit it through their parents; without it a router would take a salted prefix
for the unsalted one. A LoRA adapter's pages carry its `lora_id` and `lora_name`, and as
vLLM's the name in every page's `extra_keys` (`(name, salt)` on a salted tree's first).

Wire (vLLM's and SGLang's): msgspec msgpack, `KVEventBatch` = [ts, events, dp_rank] with
each event a tagged array (`["BlockStored", hashes, parent, token_ids, block_size,
lora_id, medium]`, then `lora_name, extra_keys` where a salt is told; `["BlockRemoved",
hashes, medium]`, `["AllBlocksCleared"]`): the layout of SGLang and of vLLM before its
#42892 (2026-06), which made each event a tagged map (Dynamo and llm-d read both; older
decoders, SGLang's clients among them, arrays only). A run of chained pages
stored together is one `BlockStored`. The PUB socket sends [topic, 8-byte big-endian
sequence number, payload] once per engine step that changed the cache; the ROUTER replay
socket answers a start sequence number (8 bytes) with each buffered [topic, seq, payload]
from there, then [b"", -1 as 8 bytes, b""]: vLLM's since its #45177 (v0.26), which
llm-d's replay client needs (the topic names the pod).

How. The step loop only appends tuples and `publish` queues a step's list; one thread
builds the structs, encodes, sends and serves replays. A full queue (`max_queue_size`
batches behind) makes the step wait for room, as vLLM's publisher does: a batch dropped
there would leave no sequence gap for a subscriber to replay, its view of the cache wrong
for good. A thread that died (it never should) drops what comes after, with an error
logged: the engine serves on. `close` sends what is queued and lets the PUB socket linger
(up to its timeout) until subscribers still reading have taken it. zmq and msgspec are
imported only here, only when events are on.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from types import SimpleNamespace
from typing import Any

from dsakv.config.kv_events import KVEventsConfig
from dsakv.errors import ConfigError, one_line

log = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"  # the engine's KV pool (a tier's name: on a CPU run too)
MEDIUM_CPU = "CPU"  # the host tier
# What the prefix cache records (cheap on the step loop): (STORED, medium, hash, parent
# hash or None, the page's tokens, its tree's salt where it is the tree's first page else
# None[, its LoRA adapter's (id, name) in an adapter's tree]), (REMOVED, medium, hash),
# (CLEARED,)
STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # a replay's last frame
_WARN_EVERY_S = 10.0
# How long a publisher may take to start (it binds at once): a backstop, should its thread
# hang before it tells `__init__` how it went.
_START_TIMEOUT_S = 60.0


def block_hash(chain_hash: bytes) -> int:
    """A page's chain hash as the event's 64-bit block hash (module docstring)."""
    return int.from_bytes(chain_hash[:8], "big", signed=True)


@functools.cache
def wire() -> SimpleNamespace:
    """vLLM's msgspec structs, built on first use (msgspec is imported only then; built
    with `defstruct`, as this module's annotations are strings no local class resolves)."""
    import msgspec

    opts = dict(array_like=True, omit_defaults=True, gc=False)
    event = msgspec.defstruct("KVCacheEvent", [], tag=True, **opts)
    stored = msgspec.defstruct(
        "BlockStored",
        [
            ("block_hashes", list[int]),
            ("parent_block_hash", int | None),
            ("token_ids", list[int]),
            ("block_size", int),
            ("lora_id", int | None),
            ("medium", str | None),
            ("lora_name", str | None, None),
            ("extra_keys", list[tuple[str, ...] | None] | None, None),
        ],
        bases=(event,),
    )
    removed = msgspec.defstruct(
        "BlockRemoved", [("block_hashes", list[int]), ("medium", str | None)], bases=(event,)
    )
    cleared = msgspec.defstruct("AllBlocksCleared", [], bases=(event,))
    batch = msgspec.defstruct(
        "KVEventBatch",
        [
            ("ts", float),
            ("events", list[stored | removed | cleared]),
            ("data_parallel_rank", int | None, None),
        ],
        **opts,
    )
    return SimpleNamespace(
        BlockStored=stored, BlockRemoved=removed, AllBlocksCleared=cleared, KVEventBatch=batch
    )


def to_events(records: list[tuple], block_size: int) -> list[Any]:
    """The prefix cache's records as vLLM's events: runs of chained pages stored on one
    medium as one `BlockStored` (a salted tree's first page starts one, its salt in
    `extra_keys`), runs of removals from one medium as one `BlockRemoved`."""
    w, out = wire(), []
    last: Any = None
    prev = None  # the last stored page's hash
    for rec in records:
        kind = rec[0]
        if kind == STORED:
            _, medium, h, parent, key, salt, *lora = rec
            lora_id, name = lora[0] if lora else (None, None)
            keys = None if name is None else (name,)  # (a page's own, vLLM's lora key)
            if isinstance(last, w.BlockStored) and last.medium == medium and parent == prev:
                last.block_hashes.append(block_hash(h))
                last.token_ids.extend(key)
                if last.extra_keys is not None:
                    last.extra_keys.append(keys)
            else:
                first = None if parent is None else block_hash(parent)
                if salt is not None:
                    keys = (*(keys or ()), salt)
                extra = None if keys is None else [keys]
                last = w.BlockStored(
                    [block_hash(h)], first, list(key), block_size, lora_id, medium, name, extra
                )
                out.append(last)
            prev = h
        elif kind == REMOVED:
            _, medium, h = rec
            if isinstance(last, w.BlockRemoved) and last.medium == medium:
                last.block_hashes.append(block_hash(h))
            else:
                last = w.BlockRemoved([block_hash(h)], medium)
                out.append(last)
        else:
            last = w.AllBlocksCleared()
            out.append(last)
    return out


class KVEventPublisher:
    """One scheduler's publisher: a PUB socket, an optional ROUTER replay socket, and the
    thread that owns both (sockets are not thread-safe: created, used and closed there)."""

    def __init__(self, config: KVEventsConfig, dp_rank: int, block_size: int) -> None:
        self.config = config
        self.dp_rank, self.block_size = dp_rank, block_size
        self.endpoint, self.replay_endpoint = config.endpoints(dp_rank)
        self.waited = 0  # times a full queue made the engine wait
        self._queue: queue.Queue[tuple[float, list[tuple]] | None] = queue.Queue(
            config.max_queue_size
        )
        self._warned = 0.0
        self._closed = False
        self._deadline = 0.0  # (`close`'s: until when the last batches may still leave)
        self.died: str | None = None  # what ended the thread, if not `close` (never should)
        self.dropped = 0  # batches lost to that
        bound: Future[None] = Future()
        self._thread = threading.Thread(
            target=self._run, args=(bound,), name=f"dsakv-kv-events-{dp_rank}", daemon=True
        )
        self._thread.start()
        try:  # (a port in use: the engine fails now, in one line)
            bound.result(timeout=_START_TIMEOUT_S)
        except FutureTimeout:  # (a backstop, not a hang)
            self.close(0)  # (should it bind after all: it stops at once)
            message = f"the publisher on {self.endpoint} did not start in {_START_TIMEOUT_S:.0f} s"
            raise ConfigError(f"--kv-events-config: {message}") from None
        log.info("KV cache events on %s (replay: %s)", self.endpoint, self.replay_endpoint)

    def publish(self, records: list[tuple]) -> None:
        """Queue one step's records for the thread; waits while the queue is full. With the
        thread dead the batch is dropped, an error logged: a router's view is stale from
        here on, but the engine serves on (failing its steps would not mend the view)."""
        if not self._thread.is_alive():
            self._lost()
            return
        item = (time.time(), records)
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.waited += 1
            now = time.monotonic()
            if now - self._warned >= _WARN_EVERY_S:
                self._warned = now
                log.warning(
                    "KV events queue full (max_queue_size %d, %d time(s) so far): the engine "
                    "waits for the publisher",
                    self.config.max_queue_size,
                    self.waited,
                )
            while self._thread.is_alive():  # (closed, nothing would drain it)
                try:
                    self._queue.put(item, timeout=0.5)
                    return
                except queue.Full:
                    pass
            self._lost()

    def _lost(self) -> None:
        if self._closed:
            return  # (a step after `close`: nobody listens for this engine any more)
        self.dropped += 1
        now = time.monotonic()
        if self.dropped == 1 or now - self._warned >= _WARN_EVERY_S:
            self._warned = now
            log.error(
                "KV cache events are no longer published (%d batch(es) dropped): the "
                "publisher's thread died (%s); KV-aware routers' view of this cache is stale",
                self.dropped,
                self.died,
            )

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then stop the thread and close the sockets; idempotent.
        Subscribers still reading get every batch published (ZMQ's linger: a socket closed
        at once drops what its subscribers have not taken yet), within `timeout_s` in all:
        a subscriber that stopped reading holds a closing engine no longer."""
        if self._closed:
            return
        self._closed = True
        self._deadline = time.monotonic() + timeout_s
        if not self._thread.is_alive():
            return
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:  # (the thread is stuck: it is a daemon)
            log.warning("KV events publisher did not drain in %.0f s", timeout_s)
            return
        self._thread.join(max(0.0, self._deadline - time.monotonic()))

    def _run(self, bound: Future[None]) -> None:
        zmq: Any = None
        ctx = None
        sockets: list[Any] = []
        linger_ms = 0
        try:
            where = "pyzmq and msgspec"  # (what a failure names)
            try:  # whatever fails resolves `bound`, which `__init__` waits on
                import msgspec
                import zmq

                where = "a ZMQ context"
                ctx = zmq.Context()  # (its own, for `close` to wait on: `term` below)
                where = "buffer_steps"
                buffer: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer_steps)
                where = "topic"
                topic = self.config.topic.encode()
                where = self.endpoint
                pub = ctx.socket(zmq.PUB)
                sockets.append(pub)
                pub.set_hwm(self.config.hwm)
                if _binds(self.endpoint):
                    pub.bind(self.endpoint)
                else:
                    pub.connect(self.endpoint)
                replay = None
                if self.replay_endpoint is not None:
                    where = self.replay_endpoint
                    replay = ctx.socket(zmq.ROUTER)
                    sockets.append(replay)
                    replay.bind(self.replay_endpoint)
            except BaseException as e:  # noqa: BLE001 - one line for `__init__` to raise
                why = one_line(e, zmq is None or not isinstance(e, zmq.ZMQError))
                bound.set_exception(ConfigError(f"--kv-events-config: {where}: {why}"))
                return
            bound.set_result(None)
            encode = msgspec.msgpack.Encoder().encode
            seq = 0
            while True:
                if replay is not None and replay.poll(0):
                    try:
                        self._replay(replay, buffer, topic)
                    except Exception:  # noqa: BLE001 - one client's replay, not the publisher
                        log.exception("serving a KV events replay failed")
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item is None:  # (`close`: what is sent may linger until its deadline)
                    linger_ms = max(0, int((self._deadline - time.monotonic()) * 1000))
                    return
                try:
                    ts, records = item
                    batch = wire().KVEventBatch(
                        ts, to_events(records, self.block_size), self.dp_rank
                    )
                    payload = encode(batch)
                    pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                except Exception:  # noqa: BLE001 - one batch lost, not the publisher
                    log.exception("publishing KV events failed")
                    continue
                buffer.append((seq, payload))
                seq += 1
        except BaseException as e:  # noqa: BLE001 - `publish` says so; the engine goes on
            self.died = one_line(e)
            log.exception("the KV events publisher's thread died")
        finally:
            for s in sockets:
                s.close(linger=linger_ms)
            if ctx is not None:
                ctx.term()  # (waits until the subscribers have taken the rest, or the linger ends)

    @staticmethod
    def _replay(replay: Any, buffer: deque[tuple[int, bytes]], topic: bytes) -> None:
        """One replay request (vLLM's: [identity, b"", start seq]): every buffered batch
        from that sequence number on as it was published (topic, seq, payload), then the
        end marker (an empty topic)."""
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignored a malformed KV events replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in buffer:
            if seq >= first:
                replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", END_SEQ, b""))


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard (`*`), an address with `::` (IPv6's wildcard, or any
    IPv6 address so written), an ipc:// or inproc:// one; connect to any other (a
    subscriber that binds)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
