"""The L3 storage tier's backends and object format: prefix KV that outlives the process.

One object per full page. Its payload is exactly the layout's bytes for that page
(`DSAKVPool.read_pages`: the latent of every layer, index-K only on layers that own it,
the draft layer's when MTP is on) and nothing for shared layers, so GLM-5.2 with an FP8
cache stores 47,700 bytes per token where engines that turn elision off for their storage
tier store 55,224. A 64-byte header goes first:

    magic "DSAKVL3\\x01" | namespace (16 B) | page hash (16 B) | payload bytes (u64 LE) |
    SHA-256 of the payload, first 16 B

The key is `<namespace hex>-<page hash hex>`: the namespace digests the cache layout's
fingerprint (layer plan, dtypes, page size, elision, draft layers), the model's identity
and the compute dtype, so a server with another plan, dtype or checkpoint never even asks
for incompatible bytes; the page hash is the prefix cache's hash chain over the page's
tokens from the start of the sequence. A read checks every header field and the checksum:
anything off is a corrupt object (deleted, counted, a miss), never bytes in the pool.

Backends are small (`get/put/exists/delete`): a directory with an LRU size cap
(`FileStorage`) and Mooncake Store (`MooncakeStorage`, the `mooncake.store` client of the
`mooncake-transfer-engine-non-cuda` wheel, which also ships `mooncake_master`).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import math
import os
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsakv.errors import DsakvError, is_number
from dsakv.procs import die_with_parent, free_port, split_address, stop_process
from dsakv.writable import can_create_in

from .layout import CacheLayout

log = logging.getLogger(__name__)

MAGIC = b"DSAKVL3\x01"
HEADER = struct.Struct("<8s16s16sQ16s")  # magic, namespace, page hash, payload size, checksum
BACKENDS = ("file", "mooncake")
WRITE_POLICIES = ("write_through", "write_back")


class StorageError(RuntimeError):
    """The store is unreachable or refused an operation (callers turn it into a miss)."""


class CorruptObject(ValueError):
    """A stored object that is truncated, mislabelled or fails its checksum."""


# --- object format ---------------------------------------------------------------------------


def checksum(payload: bytes | memoryview) -> bytes:
    return hashlib.sha256(payload).digest()[:16]


def encode_object(namespace: bytes, page_hash: bytes, payload: bytes | memoryview) -> bytes:
    """Header + payload, ready to store."""
    header = HEADER.pack(MAGIC, namespace, page_hash, len(payload), checksum(payload))
    return header + bytes(payload)


def decode_object(
    blob: bytes | bytearray, namespace: bytes, page_hash: bytes, payload_size: int
) -> memoryview:
    """The payload of a stored object, or `CorruptObject` saying what is wrong with it."""
    if len(blob) < HEADER.size:
        raise CorruptObject(f"{len(blob)} bytes, shorter than the {HEADER.size}-byte header")
    magic, ns, ph, size, digest = HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise CorruptObject("bad magic")
    if ns != namespace or ph != page_hash:
        raise CorruptObject("header names another layout or page")
    if size != payload_size or len(blob) != HEADER.size + size:
        raise CorruptObject(
            f"payload of {len(blob) - HEADER.size} bytes (header says {size}), "
            f"the layout's page is {payload_size}"
        )
    payload = memoryview(blob)[HEADER.size :]
    if checksum(payload) != digest:
        raise CorruptObject("checksum mismatch")
    return payload


def object_key(namespace: bytes, page_hash: bytes) -> str:
    return f"{namespace.hex()}-{page_hash.hex()}"


def page_hash_of(key: str, namespace: bytes) -> bytes | None:
    """The page hash of `namespace`'s object `key` (None: another namespace's object)."""
    prefix = f"{namespace.hex()}-"
    return bytes.fromhex(key[len(prefix) :]) if key.startswith(prefix) else None


def storage_namespace(layout: CacheLayout, model_id: str, compute: str) -> bytes:
    """What must match for stored pages to be readable: layout, checkpoint, and how the KV
    was computed (`compute`: dtype, kernel backend, deterministic or batched path), as a
    page computed another way holds other bits and would break bit-exact reuse."""
    key = f"{layout.fingerprint()}|{model_id}|{compute}".encode()
    return hashlib.sha256(key).digest()[:16]


# --- configuration ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StorageConfig:
    """The `--hicache-*` flags (SGLang's names where it has them), validated together.

    `max_gib` caps a `file` directory (least recently used objects go first) and is the
    memory a `mooncake` engine contributes to the store (its mounted segment).
    """

    backend: str
    dir: str | None = None
    max_gib: float | None = None
    mooncake_master: str | None = None
    start_master: bool = False
    write_policy: str = "write_through"
    prefetch_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise DsakvError(
                f"--hicache-storage-backend must be one of {', '.join(BACKENDS)}, "
                f"got {self.backend!r}"
            )
        if self.write_policy not in WRITE_POLICIES:
            raise DsakvError(
                f"--hicache-write-policy must be one of {', '.join(WRITE_POLICIES)}, "
                f"got {self.write_policy!r}"
            )
        # Types first: a "1" from a caller's config compared to a number raised TypeError.
        cap = self.max_gib
        if cap is not None and not (is_number(cap) and 0 < cap < math.inf):
            raise DsakvError(f"--hicache-storage-max-gib must be a finite number > 0, got {cap!r}")
        timeout = self.prefetch_timeout_s
        if not (is_number(timeout) and 0 <= timeout < math.inf):
            raise DsakvError(
                f"--hicache-storage-prefetch-timeout must be a finite number >= 0, got {timeout!r}"
            )
        if self.dir is not None and not isinstance(self.dir, (str, os.PathLike)):
            raise DsakvError(f"--hicache-storage-dir must be a directory path, got {self.dir!r}")
        if self.backend == "file":
            if not self.dir:
                raise DsakvError("--hicache-storage-backend file needs --hicache-storage-dir DIR")
            if self.mooncake_master or self.start_master:
                raise DsakvError(
                    "--hicache-mooncake-master / --hicache-mooncake-start-master need "
                    "--hicache-storage-backend mooncake"
                )
        else:
            if self.dir:
                raise DsakvError("--hicache-storage-dir is for --hicache-storage-backend file")
            if not self.mooncake_master:
                raise DsakvError(
                    "--hicache-storage-backend mooncake needs --hicache-mooncake-master HOST:PORT"
                )
            host, port = split_address(self.mooncake_master, "--hicache-mooncake-master")
            if self.start_master and host not in ("127.0.0.1", "localhost"):
                raise DsakvError(
                    "--hicache-mooncake-start-master starts a master for this machine only: "
                    f"--hicache-mooncake-master must be 127.0.0.1:PORT, got {self.mooncake_master}"
                )

    @property
    def max_bytes(self) -> int | None:
        return None if self.max_gib is None else int(self.max_gib * 2**30)


# --- backends --------------------------------------------------------------------------------


class StorageBackend:
    """What the L3 tier needs from a store. Called from the tier's worker threads only;
    `get` returns None for a missing object, `put` False when the store refuses it (full,
    too large); an unreachable store, or one that fails a write (a full or read-only
    disk), raises `StorageError`."""

    evicted = 0  # objects the backend dropped to make room (where it can tell)
    evicts_by_use = False  # whether `touch` decides what it drops first

    def get(self, key: str) -> bytes | None:
        raise NotImplementedError

    def take_evicted(self) -> list[str]:
        """The keys it dropped to make room since the last call (where it can tell)."""
        return []

    def touch(self, key: str) -> None:
        """Mark a stored object as recently used (where the store evicts by use)."""

    def put(self, key: str, data: bytes) -> bool:
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class FileStorage(StorageBackend):
    """One file per object under `root` (`<root>/<last 2 hex>/<key>.kv`), written to a
    temporary name and renamed, so a reader never sees half an object. With `max_bytes`,
    the least recently used objects (whole files, any namespace) are deleted to make room;
    the order survives restarts through file modification times (touched on each hit).

    Several processes may share a directory and its cap. The directory's total lives in a
    ledger (`<root>/.ledger`), changed under its `flock` by every put and delete: a put
    reserves its bytes before it writes (a temporary file in `<root>/.writing/`, locked while
    its writer lives), so the cap holds across processes; reads take no lock. A put that
    must make room rescans the directory first (at most every `RESCAN_S`): the index then
    holds every process's objects in LRU order, the ledger is re-derived from the disk (what
    a crash or a hand-deleted file left wrong), and a dead writer's reservation (its file no
    longer locked) is dropped. Between rescans an object another process used since the
    last one is kept (its mtime is newer)."""

    SUFFIX = ".kv"
    LEDGER = ".ledger"
    TMP = ".writing"
    RESCAN_S = 1.0

    def __init__(self, root: str | Path, max_bytes: int | None = None) -> None:
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DsakvError(f"--hicache-storage-dir {root}: {e.strerror or e}") from None
        if not can_create_in(self.root):
            raise DsakvError(f"--hicache-storage-dir {root}: not writable")
        self.max_bytes = max_bytes
        self.evicted = 0
        self._evicted_keys: list[str] = []
        self._lock = threading.Lock()
        self._index: OrderedDict[str, tuple[int, int]] = OrderedDict()  # key -> (size, mtime)
        self._ledger_fd: int | None = None
        self._scanned = time.monotonic()
        if max_bytes is None:
            self._scan()
            return
        try:
            with self._lock, self._shared(rescan=True):  # (repairs the ledger's drift)
                pass
        except OSError as e:
            raise DsakvError(f"--hicache-storage-dir {root}: {e.strerror or e}") from None

    def _scan(self) -> None:
        """The index and total from the directory's files, least recently used first. Equal
        mtimes are common (the kernel stamps files from a coarse clock: a read's touch can
        tie the write just before it), so ties keep this process's own order, which is
        exact; others' objects go first among them."""
        rank = {key: i for i, key in enumerate(self._index)}
        found = []
        for f in self.root.glob(f"*/*{self.SUFFIX}"):
            with contextlib.suppress(OSError):
                st, key = f.stat(), f.name[: -len(self.SUFFIX)]
                found.append((st.st_mtime_ns, rank.get(key, -1), key, st.st_size))
        self._index = OrderedDict((key, (size, ns)) for ns, _, key, size in sorted(found))
        self.total_bytes = sum(size for size, _ in self._index.values())

    def _path(self, key: str) -> Path:
        return self.root / key[-2:] / f"{key}{self.SUFFIX}"

    # --- the shared ledger (a cap only; both locks held) ------------------------------------

    def _lock_ledger(self) -> int:
        """The ledger's descriptor, `flock`ed; a ledger removed (with the directory, by a
        tmp cleaner) is made again, as the other processes lock the one at the path."""
        path = self.root / self.LEDGER
        while True:
            if self._ledger_fd is None:
                self.root.mkdir(parents=True, exist_ok=True)
                self._ledger_fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            fd = self._ledger_fd
            fcntl.flock(fd, fcntl.LOCK_EX)
            with contextlib.suppress(FileNotFoundError):
                st, held = os.stat(path), os.fstat(fd)
                if (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino):
                    return fd
            self._ledger_fd = None
            os.close(fd)

    @contextlib.contextmanager
    def _shared(self, rescan: bool = False) -> Iterator[None]:
        """Inside, `total_bytes` is the directory's total, written back on the way out."""
        fd = self._lock_ledger()
        try:
            if not rescan:
                try:
                    self.total_bytes = int(os.pread(fd, self._LEDGER_BYTES, 0))
                except ValueError:  # a new ledger (or one a crash cut short)
                    rescan = True
            if rescan:
                self._rescan()
            try:
                yield
            finally:
                self._save(fd)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    _LEDGER_BYTES = 21

    def _save(self, fd: int | None = None) -> None:
        self.total_bytes = max(self.total_bytes, 0)
        os.pwrite(self._ledger_fd if fd is None else fd, b"%20d\n" % self.total_bytes, 0)

    def _rescan(self) -> None:
        """The index and the ledger from the directory: its objects and live reservations."""
        reserved = self._sweep()
        self._scan()
        self.total_bytes += reserved
        self._scanned = time.monotonic()

    def _sweep(self) -> int:
        """Drop dead writers' reservations (their temporary files, no longer locked) from
        the directory and the total; the bytes that live writers hold."""
        tmp, live = self.root / self.TMP, 0
        try:
            names = os.listdir(tmp)
        except OSError:
            return 0
        for name in names:
            try:
                fd = os.open(tmp / name, os.O_RDONLY)
            except OSError:
                continue
            try:
                size = os.fstat(fd).st_size
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    live += size
                    continue
                with contextlib.suppress(OSError):
                    os.unlink(tmp / name)
                    self.total_bytes -= size
            finally:
                os.close(fd)
        return live

    def _make_room(self, size: int) -> bool:
        """Delete least recently used objects until `size` more bytes fit; False when they
        cannot (the others' writes in flight fill the cap)."""
        cap = self.max_bytes
        assert cap is not None
        rescanned, spared = False, set()
        if self.total_bytes + size > cap and time.monotonic() - self._scanned >= self.RESCAN_S:
            self._rescan()  # (every process's objects, in LRU order; repairs the ledger)
            rescanned = True
        while self.total_bytes + size > cap:
            if not self._index:
                if rescanned:
                    return False
                self._rescan()
                rescanned = True
                continue
            key, (_, ns) = self._index.popitem(last=False)
            path = self._path(key)
            try:
                st = path.stat()
            except FileNotFoundError:  # another process dropped it
                self._evicted_keys.append(key)
                continue
            except OSError:
                continue
            head = next(iter(self._index.values()), (0, st.st_mtime_ns))[1]
            if st.st_mtime_ns > max(ns, head) and key not in spared:
                # Another process used it since, later than the next one's use (ties keep
                # this process's order, as a rescan does): it stays, most recent.
                spared.add(key)
                self._index[key] = (st.st_size, st.st_mtime_ns)
                continue
            try:
                path.unlink()
            except FileNotFoundError:
                self._evicted_keys.append(key)
                continue
            except OSError:
                continue
            self.total_bytes -= st.st_size
            self.evicted += 1
            self._evicted_keys.append(key)
        return True

    # --- the backend --------------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as e:
            raise StorageError(f"read {path}: {e}") from None
        self.touch(key)
        return data

    @property
    def evicts_by_use(self) -> bool:  # (with a cap; without one nothing is dropped)
        return self.max_bytes is not None

    def touch(self, key: str) -> None:
        now = time.time_ns()  # (what the index records: a later, larger mtime is another's use)
        with self._lock:
            if key in self._index:
                self._index[key] = (self._index.pop(key)[0], now)
        with contextlib.suppress(OSError):
            os.utime(self._path(key), ns=(now, now))  # also for the next process's LRU order

    def put(self, key: str, data: bytes) -> bool:
        size = len(data)
        if self.max_bytes is None:
            self._write(key, data)
            with self._lock:
                self.total_bytes += size - self._index.pop(key, (0, 0))[0]
                self._index[key] = (size, 0)
            return True
        if size > self.max_bytes:
            return False
        path = self._path(key)
        tmp = self.root / self.TMP / f"{key}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        fd = None
        try:
            with self._lock, self._shared():
                if not self._make_room(size):
                    return False
                self.total_bytes += size  # the reservation, saved before its file exists
                self._save()
                try:
                    tmp.parent.mkdir(parents=True, exist_ok=True)
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
                    fcntl.flock(fd, fcntl.LOCK_EX)  # (held while this writer lives)
                    os.ftruncate(fd, size)  # (what a rescan counts as reserved)
                except OSError:
                    self.total_bytes -= size
                    if fd is not None:
                        os.close(fd)
                        fd = None
                        with contextlib.suppress(OSError):
                            tmp.unlink()
                    raise
            with open(fd, "wb", closefd=False) as f:
                f.write(data)
            ns = os.fstat(fd).st_mtime_ns
            with self._lock, self._shared():
                path.parent.mkdir(parents=True, exist_ok=True)
                try:
                    old = path.stat().st_size  # (another process put the same key)
                except FileNotFoundError:
                    old = 0
                os.replace(tmp, path)
                self.total_bytes -= old
                self._index.pop(key, None)
                self._index[key] = (size, ns)
            return True
        except OSError as e:
            if fd is not None:
                self._unreserve(tmp, size)
            raise StorageError(f"cannot write {path}: {e.strerror or e}") from None
        finally:
            if fd is not None:
                os.close(fd)

    def _unreserve(self, tmp: Path, size: int) -> None:
        with contextlib.suppress(OSError), self._lock, self._shared():
            if tmp.exists():
                tmp.unlink()
                self.total_bytes -= size

    def _write(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # (the root too, if removed)
            with tmp.open("wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            # (a full or read-only disk: the tier logs it at most every 30 s, not per page)
            raise StorageError(f"cannot write {path}: {e.strerror or e}") from None

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def delete(self, key: str) -> None:
        path = self._path(key)
        if self.max_bytes is None:
            with contextlib.suppress(OSError):
                path.unlink()
            self._forget(key)
            return
        with contextlib.suppress(OSError), self._lock, self._shared():
            self._index.pop(key, None)
            size = path.stat().st_size
            path.unlink()
            self.total_bytes -= size  # (only what this process unlinked)

    def _forget(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, (0, 0))[0]
            if self.max_bytes is None:  # (with a cap, whoever deleted it counted it)
                self.total_bytes -= size

    def take_evicted(self) -> list[str]:
        with self._lock:
            keys, self._evicted_keys = self._evicted_keys, []
        return keys

    def close(self) -> None:
        with self._lock:
            fd, self._ledger_fd = self._ledger_fd, None
        if fd is not None:
            os.close(fd)


class MooncakeStorage(StorageBackend):
    """Mooncake Store over TCP: objects live in the memory segments that the store's
    clients (each engine: `segment_bytes`) mount, placed by the master; any client reads
    any object. Connects on first use; an unreachable master (a TCP probe fails first, as
    the client's own setup retries for about 90 s) is a `StorageError`, retried after
    `retry_s`. The master evicts objects when segments fill; this client cannot count them.
    """

    def __init__(
        self,
        master: str,
        segment_bytes: int = 1 << 30,
        local_hostname: str = "127.0.0.1",
        retry_s: float = 10.0,
    ) -> None:
        self.master = master
        self.host, self.port = split_address(master, "--hicache-mooncake-master")
        self.segment_bytes = segment_bytes
        self.local_hostname = local_hostname
        self.retry_s = retry_s
        self._store: Any = None
        self._retry_at = 0.0
        self._lock = threading.Lock()

    def _client(self) -> Any:
        with self._lock:
            if self._store is not None:
                return self._store
            if time.monotonic() < self._retry_at:
                raise StorageError(f"Mooncake master {self.master} unreachable (retrying later)")
            self._retry_at = time.monotonic() + self.retry_s
            if not port_open(self.host, self.port, 1.0):
                raise StorageError(f"Mooncake master {self.master} unreachable")
            try:
                from mooncake.store import MooncakeDistributedStore
            except ImportError as e:
                raise StorageError(
                    f"Mooncake Store needs mooncake-transfer-engine-non-cuda: {e}"
                ) from None
            store = MooncakeDistributedStore()
            rc = store.setup(
                self.local_hostname,
                "P2PHANDSHAKE",
                self.segment_bytes,
                64 << 20,  # the client's transfer buffer
                "tcp",
                "",
                self.master,
            )
            if rc != 0:
                raise StorageError(f"Mooncake Store setup against {self.master} returned {rc}")
            self._store = store
            return store

    def get(self, key: str) -> bytes | None:
        data = self._client().get(key)
        return data or None  # b"" is a miss (our objects are never empty)

    def put(self, key: str, data: bytes) -> bool:
        rc = self._client().put(key, data)
        if rc != 0:  # (the tier warns of refusals at most every 30 s)
            log.debug("L3 Mooncake Store: put of %d bytes returned %d", len(data), rc)
        return rc == 0

    def exists(self, key: str) -> bool:
        rc = self._client().is_exist(key)
        if rc < 0:
            raise StorageError(f"Mooncake Store is_exist returned {rc}")
        return rc == 1

    def delete(self, key: str) -> None:
        self._client().remove(key)  # refused while the object's lease runs: best effort

    def close(self) -> None:
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            store.close()


def port_open(host: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def make_backend(config: StorageConfig) -> StorageBackend:
    if config.backend == "file":
        return FileStorage(config.dir, config.max_bytes)
    return MooncakeStorage(config.mooncake_master, config.max_bytes or 1 << 30)


# --- a local Mooncake master -----------------------------------------------------------------


def mooncake_master_binary() -> str:
    """The `mooncake_master` executable the Mooncake wheel ships (inside the package)."""
    try:
        import mooncake
    except ImportError as e:
        raise DsakvError(
            f"--hicache-mooncake-start-master needs mooncake-transfer-engine-non-cuda: {e}"
        ) from None
    exe = Path(mooncake.__file__).parent / "mooncake_master"
    if exe.is_file() and os.access(exe, os.X_OK):
        return str(exe)
    found = shutil.which("mooncake_master")
    if found is None:
        raise DsakvError(
            "mooncake_master not found (pip install mooncake-transfer-engine-non-cuda)"
        )
    return found


def start_mooncake_master(address: str, timeout_s: float = 20.0) -> subprocess.Popen:
    """Start `mooncake_master` for this machine: RPC on `address` (127.0.0.1:PORT), its
    metrics port on a free loopback port; returns once it accepts connections. The process
    dies with this one (Linux parent-death signal); stop it with `stop_process`."""
    host, port = split_address(address, "--hicache-mooncake-master")
    if port_open(host, port, 0.5):
        raise DsakvError(f"cannot start a Mooncake master: {address} is already in use")
    cmd = [
        mooncake_master_binary(),
        f"--rpc_port={port}",
        f"--rpc_address={host}",
        f"--metrics_port={free_port()}",
        "--metrics_host=127.0.0.1",
        "--enable_metric_reporting=false",
    ]
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=functools.partial(die_with_parent, signal.SIGTERM),
    )
    deadline = time.monotonic() + timeout_s
    while not port_open(host, port, 0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc)
            raise DsakvError(f"mooncake_master did not start on {address}")
        time.sleep(0.05)
    return proc
