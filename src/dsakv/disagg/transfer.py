"""KV page writes between two pools over the Mooncake Transfer Engine (DESIGN.md §10).

Both sides register every buffer their pool really has (`DSAKVPool.transfer_descriptors`:
the latent of every layer, index-K only for layers that own it, the draft layer when MTP
is on), so a shared layer's index-K is never sent: the bytes moved per token are the
layout's cell (47,700 for GLM-5.2 fp8/fp8, 55,224 dense). Buffers are page-major, so a
full page of one buffer is one contiguous byte range; a request's last, partial page
moves as whole token rows (`TransferDescriptor.token_rows`).

Mooncake is imported on first use: the rest of dsakv works where it is not installed.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dsakv.memory.pool import DSAKVPool, TransferDescriptor

_MAX_BATCH = 1024  # entries per batch_transfer_sync_write (Mooncake refuses very large ones)


class TransferError(RuntimeError):
    """A KV write failed (the peer died, or refused the addresses)."""


def import_transfer_engine() -> Any:
    """Mooncake's `TransferEngine` class, or an error that says how to install it."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # its INFO lines: every connection
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        hint = ""
        if "libibverbs" in str(e):
            hint = " (its CPU build links libibverbs.so.1: apt-get install libibverbs1)"
        raise TransferError(
            f"prefill/decode disaggregation needs the Mooncake Transfer Engine: pip install "
            f"mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine (CUDA){hint}"
            f": {e}"
        ) from None
    return TransferEngine


@dataclass(frozen=True)
class PeerBuffer:
    """One registered buffer of the peer's pool, as the handshake describes it."""

    layer: int
    component: str
    data_ptr: int
    nbytes: int
    bytes_per_page: int

    @classmethod
    def of(cls, d: TransferDescriptor) -> PeerBuffer:
        return cls(d.layer, d.component, d.data_ptr, d.nbytes, d.bytes_per_page)

    def to_json(self) -> list[Any]:
        return [self.layer, self.component, self.data_ptr, self.nbytes, self.bytes_per_page]

    @classmethod
    def from_json(cls, row: Sequence[Any]) -> PeerBuffer:
        layer, comp, ptr, nbytes, bpp = row
        return cls(int(layer), str(comp), int(ptr), int(nbytes), int(bpp))


def plan_writes(
    local: Sequence[TransferDescriptor],
    peer: Sequence[PeerBuffer],
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
    num_tokens: int,
    page_size: int,
) -> tuple[list[int], list[int], list[int]]:
    """(source addresses, destination addresses, lengths) that copy positions
    `0..num_tokens-1` of every buffer from `src_pages` to `dst_pages` (page i to page i).

    Full pages are whole byte ranges (merged when consecutive on both sides); the last
    page, if partial, moves only its `n` token rows. The two buffer lists must describe
    the same layout (same order, same page sizes): the handshake checked the fingerprint.
    """
    full, rest = divmod(num_tokens, page_size)
    need = full + (1 if rest else 0)
    if len(src_pages) < need or len(dst_pages) < need:
        raise TransferError(
            f"{num_tokens} tokens need {need} pages; got {len(src_pages)} source and "
            f"{len(dst_pages)} destination pages"
        )
    if len(local) != len(peer):
        raise TransferError(f"peer has {len(peer)} KV buffers, this pool {len(local)}")
    srcs: list[int] = []
    dsts: list[int] = []
    lens: list[int] = []
    for d, p in zip(local, peer):
        if (d.layer, d.component, d.bytes_per_page) != (p.layer, p.component, p.bytes_per_page):
            raise TransferError(
                f"buffer mismatch: layer {d.layer} {d.component} ({d.bytes_per_page} B/page) vs "
                f"peer layer {p.layer} {p.component} ({p.bytes_per_page} B/page)"
            )
        bpp = d.bytes_per_page
        first = len(lens)  # never merge across buffers: each is its own registration
        for i in range(full):
            s, t = d.data_ptr + src_pages[i] * bpp, p.data_ptr + dst_pages[i] * bpp
            if len(lens) > first and srcs[-1] + lens[-1] == s and dsts[-1] + lens[-1] == t:
                lens[-1] += bpp  # consecutive on both sides: one range
            else:
                srcs.append(s)
                dsts.append(t)
                lens.append(bpp)
        if rest:
            s, t = d.data_ptr + src_pages[full] * bpp, p.data_ptr + dst_pages[full] * bpp
            for offset, width in d.token_rows:
                srcs.append(s + offset)
                dsts.append(t + offset)
                lens.append(rest * width)
    return srcs, dsts, lens


@dataclass
class TransferStats:
    """Counters for /metrics and the bench; updated from transfer threads."""

    bytes: int = 0
    tokens: int = 0
    requests: int = 0
    seconds: float = 0.0
    failures: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int, tokens: int, seconds: float) -> None:
        with self._lock:
            self.bytes += nbytes
            self.tokens += tokens
            self.requests += 1
            self.seconds += seconds

    def fail(self) -> None:
        with self._lock:
            self.failures += 1

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {
                "bytes": self.bytes,
                "tokens": self.tokens,
                "requests": self.requests,
                "seconds": self.seconds,
                "failures": self.failures,
            }


_engines: dict[tuple[str, str], tuple[Any, str]] = {}
_engines_lock = threading.Lock()


def shared_engine(host: str, protocol: str = "tcp") -> tuple[Any, str]:
    """This process's Mooncake engine for `host` (P2P handshake) and its session name.
    One per process: starting one is cheap, tearing one down takes about a second, and
    pools in one process (tests, the bench) write to each other through it."""
    with _engines_lock:
        if (host, protocol) not in _engines:
            engine = import_transfer_engine()()
            rc = engine.initialize(host, "P2PHANDSHAKE", protocol, "")
            if rc != 0:
                raise TransferError(
                    f"Mooncake initialize({host!r}, P2PHANDSHAKE, {protocol}) = {rc}"
                )
            _engines[host, protocol] = engine, f"{host}:{engine.get_rpc_port()}"
        return _engines[host, protocol]


def _cpu_only_build() -> bool:
    """Whether the installed Mooncake is the build that cannot touch GPU memory."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> bool:
        try:
            version(name)
        except PackageNotFoundError:
            return False
        return True

    return installed("mooncake-transfer-engine-non-cuda") and not installed(
        "mooncake-transfer-engine"
    )


def _unregister(engine: Any, ptrs: list[int]) -> None:
    for ptr in ptrs:
        engine.unregister_memory(ptr)


class KVTransfer:
    """One pool's buffers registered with the Mooncake Transfer Engine (P2P handshake, TCP).

    The decode side only registers (the prefill side writes into its memory; under HiSparse
    its latent buffers are its host rows: `DSAKVPool.attach_host_latent`); the prefill side
    registers too and calls `write`. `session` is what the peer addresses. The
    registrations go when `close` is called or the object is collected.
    """

    def __init__(
        self,
        pool: DSAKVPool,
        host: str = "127.0.0.1",
        protocol: str = "tcp",
    ) -> None:
        if pool.device.type != "cpu" and _cpu_only_build():
            raise TransferError(
                f"the KV pool is on {pool.device} but the installed Mooncake is its CPU build "
                "(mooncake-transfer-engine-non-cuda): pip install mooncake-transfer-engine"
            )
        self.pool = pool
        self.engine, self.session = shared_engine(host, protocol)
        self.buffers = pool.transfer_descriptors()  # (HiSparse: the latent's on the host)
        done: list[int] = []
        self._finalizer = weakref.finalize(self, _unregister, self.engine, done)
        for d in self.buffers:
            rc = self.engine.register_memory(d.data_ptr, d.nbytes)
            if rc != 0:
                self.close()
                raise TransferError(
                    f"Mooncake register_memory of layer {d.layer} {d.component} "
                    f"({d.nbytes} B) = {rc}"
                )
            done.append(d.data_ptr)
        self.stats = TransferStats()

    def describe(self) -> list[list[Any]]:
        """This pool's buffers for the handshake."""
        return [PeerBuffer.of(d).to_json() for d in self.buffers]

    def write(
        self,
        peer_session: str,
        peer_buffers: Sequence[PeerBuffer],
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        num_tokens: int,
    ) -> tuple[int, float]:
        """Write positions `0..num_tokens-1` into the peer's pages; (bytes, seconds).
        Blocking (Mooncake releases the GIL): call it from a worker thread."""
        srcs, dsts, lens = plan_writes(
            self.buffers, peer_buffers, src_pages, dst_pages, num_tokens, self.pool.page_size
        )
        start = time.perf_counter()
        for lo in range(0, len(srcs), _MAX_BATCH):
            hi = lo + _MAX_BATCH
            rc = self.engine.batch_transfer_sync_write(
                peer_session, srcs[lo:hi], dsts[lo:hi], lens[lo:hi]
            )
            if rc != 0:
                raise TransferError(
                    f"KV write to {peer_session} failed (Mooncake returned {rc}): "
                    "the decode server is gone or refused the pages"
                )
        seconds = time.perf_counter() - start
        nbytes = sum(lens)
        self.stats.add(nbytes, num_tokens, seconds)
        return nbytes, seconds

    def close(self) -> None:
        self._finalizer()


def register_pool(engine: Any, host: str) -> KVTransfer:
    """`engine`'s pool registered."""
    return KVTransfer(engine.pool, host)


# Under DP attention each rank's pool holds its own requests' KV, so each rank registers
# its own and writes from it: rank 0 has these run there (`DPEngine.on_ranks`, `on_rank_later`).


def register_rank_pool(engine: Any, kept: dict[str, Any], host: str) -> tuple[str, list]:
    """Register this rank's pool (kept while it runs); its session and buffers."""
    transfer = kept["kv_transfer"] = register_pool(engine, host)
    return transfer.session, transfer.describe()


def write_held(
    engine: Any,
    kept: dict[str, Any],
    rid: int,
    peer_session: str,
    peer_buffers: Sequence[PeerBuffer],
    dst_pages: list[int],
) -> tuple[int, float]:
    """Write the prompt KV of a request held on this rank (`Engine.held_request`) into the
    peer's pages with this rank's registration; (bytes, seconds)."""
    req = engine.held_request(rid)
    src = prompt_pages(req, engine.pool.page_size)
    return kept["kv_transfer"].write(
        peer_session, peer_buffers, src, dst_pages, len(req.prompt_ids)
    )


def prompt_pages(req: Any, page_size: int) -> list[int]:
    """The pages holding `req`'s prompt (its last one partly, maybe)."""
    return req.pages[: -(-len(req.prompt_ids) // page_size)]
