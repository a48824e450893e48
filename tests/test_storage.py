"""The L3 storage tier: prefix KV on disk and on Mooncake Store that outlives the engine.

Every engine test compares greedy tokens with a cold run and reads the `l3_*` counters;
every engine ends with the idle integrity check (free + cached pages == total, host pages
in use == the cache's). No timing is asserted (the machine is shared; the bench reports
TTFT cold vs L3 hit).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors import safe_open

from dsakv import LLM, SamplingParams
from dsakv.cli import main
from dsakv.config.checkpoint import model_identity
from dsakv.engine import Engine, EngineConfig
from dsakv.engine.prefix_cache import ROOT_HASH, PrefixCache, chain_hashes
from dsakv.errors import DsakvError
from dsakv.memory import CacheLayout, DSAKVPool, PageAllocator
from dsakv.memory.storage import (
    HEADER,
    CorruptObject,
    FileStorage,
    StorageConfig,
    decode_object,
    encode_object,
    start_mooncake_master,
)
from dsakv.models.tiny import write_tiny_model
from dsakv.procs import stop_process

from .conftest import synchronous_l3
from .serving import TIMEOUT, free_port

PS = 16
ARGS = dict(device="cpu", page_size=PS, num_pages=64)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPT = [random.Random(0).randrange(0, 256) for _ in range(150)]  # 9 full pages + 6 tokens
PAGES = (len(PROMPT) - 1) // PS


def _file(store: Path, **kw) -> dict:
    return dict(ARGS, hicache_storage_backend="file", hicache_storage_dir=str(store), **kw)


def _objects(store: Path) -> list[Path]:
    return sorted(store.glob("*/*.kv"))


def _run(
    model: str, prompts, params=GREEDY, synchronous: bool = False, **kw
) -> tuple[list[list[int]], dict]:
    """Greedy tokens and the counters of a fresh engine (closed after: stores flushed);
    `synchronous`: its L3 lookups end before the step goes on (`synchronous_l3`)."""
    llm = LLM(model, **kw)
    if synchronous:
        synchronous_l3(llm.engine.l3)
    try:
        outs = llm.generate(prompts, params)
        llm.engine.check_integrity()
        if llm.engine.l3 is not None:
            assert llm.engine.l3.drain(TIMEOUT)
        return [o.token_ids for o in outs], llm.engine.counters()
    finally:
        llm.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("l3") / "tiny", preset="glm-tiny"))


@pytest.fixture(scope="module")
def stored(tiny, tmp_path_factory) -> tuple[Path, list[int], dict]:
    """A store written by one engine (write-through): (dir, its greedy tokens, counters)."""
    store = tmp_path_factory.mktemp("store")
    (tokens,), c = _run(tiny, [PROMPT], **_file(store))
    return store, tokens, c


def _copy(stored, tmp_path: Path) -> Path:
    shutil.copytree(stored[0], tmp_path / "store")
    return tmp_path / "store"


# --- format and backends ------------------------------------------------------------------------


def test_object_round_trip_and_every_fault_is_caught():
    ns, ph, payload = b"n" * 16, b"p" * 16, bytes(range(256)) * 4
    blob = encode_object(ns, ph, payload)
    assert len(blob) == HEADER.size + len(payload) == 64 + 1024
    assert bytes(decode_object(blob, ns, ph, len(payload))) == payload
    flipped = bytearray(blob)
    flipped[-7] ^= 1
    faults = {
        "checksum": bytes(flipped),
        "payload of": blob[:-1],
        "shorter": blob[:10],
        "another layout": encode_object(b"m" * 16, ph, payload),
        "magic": b"X" + blob[1:],
    }
    for what, bad in faults.items():
        with pytest.raises(CorruptObject, match=what):
            decode_object(bad, ns, ph, len(payload))
    with pytest.raises(CorruptObject, match="another layout or page"):
        decode_object(blob, ns, b"q" * 16, len(payload))
    with pytest.raises(CorruptObject, match="the layout's page is"):
        decode_object(blob, ns, ph, 512)


def test_file_storage_lru_cap_survives_restart(tmp_path):
    fs = FileStorage(tmp_path, max_bytes=250)
    assert fs.put("a" * 8, b"1" * 100) and fs.put("b" * 8, b"2" * 100)
    assert fs.get("a" * 8) == b"1" * 100  # a is now the most recently used
    time.sleep(0.01)
    assert fs.put("c" * 8, b"3" * 100)  # evicts b, the least recently used
    assert fs.evicted == 1 and not fs.exists("b" * 8) and fs.get("b" * 8) is None
    assert fs.total_bytes == 200
    assert not fs.put("d" * 8, b"4" * 300)  # larger than the cap: refused, nothing evicted
    assert fs.exists("a" * 8) and fs.exists("c" * 8)
    again = FileStorage(tmp_path, max_bytes=250)  # a restart rebuilds the index from disk
    assert again.total_bytes == 200
    assert again.put("e" * 8, b"5" * 100) and again.evicted == 1
    assert again.exists("c" * 8) != again.exists("a" * 8)
    fs.delete("c" * 8)
    assert fs.get("c" * 8) is None


def test_a_rescan_keeps_the_order_of_equal_mtimes(tmp_path):
    """The kernel stamps files from a coarse clock, so a read's touch often ties the write
    just before it; the rescan (every RESCAN_S, as on a slow machine) broke ties by key
    and evicted the object just read."""
    fs = FileStorage(tmp_path, max_bytes=250)
    fs.RESCAN_S = 0.0  # every eviction rescans
    assert fs.put("a" * 8, b"1" * 100) and fs.put("b" * 8, b"2" * 100)
    assert fs.get("a" * 8) == b"1" * 100  # a is now the most recently used
    ns = fs._path("a" * 8).stat().st_mtime_ns
    os.utime(fs._path("b" * 8), ns=(ns, ns))  # the tie
    assert fs.put("c" * 8, b"3" * 100)
    assert fs.exists("a" * 8) and not fs.exists("b" * 8)


def test_engines_sharing_a_file_store_share_its_cap(tmp_path):
    """Each engine's store counted only its own objects: two engines on one directory with
    a 250-byte cap filled it to 400 bytes."""
    one, two = FileStorage(tmp_path, max_bytes=250), FileStorage(tmp_path, max_bytes=250)
    one.RESCAN_S = two.RESCAN_S = 0.0  # (what the others wrote shows at once)
    for i, store in enumerate((one, two, one, two)):
        time.sleep(0.01)  # (an LRU order the files' modification times can tell)
        assert store.put(f"{i:08x}", bytes(100))
    on_disk = sum(f.stat().st_size for f in tmp_path.glob("*/*.kv"))
    assert on_disk <= 250, on_disk
    assert two.exists(f"{3:08x}") and not one.exists(f"{0:08x}")  # the oldest went


def _on_disk(root: Path) -> int:
    return sum(f.stat().st_size for f in root.glob("*/*.kv"))


def _ledger(root: Path) -> int:
    return int((root / FileStorage.LEDGER).read_text())


OBJ, CAP = 1000, 10_000  # room for 10 objects


def _writer(i: int, root: str, waves: int, bar) -> None:
    """Writes 12 objects a wave, 4 of them the keys every writer puts (the same bytes)."""
    store = FileStorage(root, max_bytes=CAP)
    for w in range(waves):
        bar.wait(30)
        for j in range(12):
            key = f"{w:04x}{j:04x}" if j < 4 else f"{i:02x}{w:04x}{j:04x}"
            assert store.put(key, bytes([j]) * OBJ)
        bar.wait(30)
        bar.wait(30)  # (the parent measures)


def test_writers_in_several_processes_hold_the_shared_cap(tmp_path):
    """Each process counted its own objects and rescanned at most once a second: three
    writing in bursts filled a 10-object cap with 30. Now a shared ledger holds the cap,
    and objects two writers both put count once (the directory stays full, not less)."""
    ctx, writers, waves = mp.get_context("fork"), 3, 3
    bar = ctx.Barrier(writers + 1)
    procs = [
        ctx.Process(target=_writer, args=(i, str(tmp_path), waves, bar)) for i in range(writers)
    ]
    for p in procs:
        p.start()
    try:
        for _ in range(waves):
            bar.wait(30)
            bar.wait(30)
            assert _on_disk(tmp_path) == CAP  # at most the cap, and all of it used
            assert _ledger(tmp_path) == CAP
            bar.wait(30)
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            p.kill()
            p.join()
    assert _on_disk(tmp_path) == _ledger(tmp_path) == CAP
    assert not list(tmp_path.rglob("*.tmp"))


def _dies_mid_write(root: str) -> None:
    os.replace = lambda *_: os._exit(3)  # (killed after it wrote, before the rename)
    FileStorage(root, max_bytes=5 * OBJ).put("dead" * 4, bytes(OBJ))


def test_a_writer_dying_mid_write_leaves_no_file_and_no_drift(tmp_path):
    """Its temporary file stayed for good, uncounted; now its reservation (counted in the
    ledger) is dropped, with the file, by the next put that makes room."""
    store = FileStorage(tmp_path, max_bytes=5 * OBJ)
    store.RESCAN_S = 0.0  # (the sweep for dead writers: at most every RESCAN_S)
    for i in range(5):
        assert store.put(f"{i:08x}", bytes(OBJ))
    proc = mp.get_context("fork").Process(target=_dies_mid_write, args=(str(tmp_path),))
    proc.start()
    proc.join(30)
    assert proc.exitcode == 3
    assert len(list(tmp_path.rglob("*.tmp"))) == 1  # (what it left)
    for i in range(5, 10):
        assert store.put(f"{i:08x}", bytes(OBJ))
    assert not list(tmp_path.rglob("*.tmp"))
    assert _on_disk(tmp_path) == _ledger(tmp_path) == 5 * OBJ  # the whole cap, no drift
    assert all(store.exists(f"{i:08x}") for i in range(5, 10))


def test_an_object_another_process_read_is_not_the_next_evicted(tmp_path):
    """A process evicts from its own LRU order; a hit in another process (the file's newer
    mtime) keeps the object, as the once-a-second rescan did only a second later."""
    one = FileStorage(tmp_path, max_bytes=3 * OBJ)
    for i in range(3):
        assert one.put(f"{i:08x}", bytes(OBJ))
    two = FileStorage(tmp_path, max_bytes=3 * OBJ)
    assert two.get(f"{0:08x}") == bytes(OBJ)  # 0 is now the most recently used
    assert one.put(f"{3:08x}", bytes(OBJ))
    assert one.exists(f"{0:08x}") and not one.exists(f"{1:08x}")
    assert _on_disk(tmp_path) == 3 * OBJ


def test_objects_deleted_from_outside_free_their_room(tmp_path, monkeypatch):
    """The ledger counted objects a cleaner (or an operator) deleted for good: the store
    held half its cap from then on. A put that must make room rescans (at most every
    `RESCAN_S`, here every time), which re-derives the ledger from the disk."""
    monkeypatch.setattr(FileStorage, "RESCAN_S", 0.0)
    store = FileStorage(tmp_path, max_bytes=10 * OBJ)
    for i in range(10):
        assert store.put(f"{i:08x}", bytes(OBJ))
    for i in range(5):
        store._path(f"{i:08x}").unlink()
    for i in range(10, 15):
        assert store.put(f"{i:08x}", bytes(OBJ))
    assert _on_disk(tmp_path) == 10 * OBJ  # (was 5 objects: the cap shrunk by what went)
    assert int((tmp_path / FileStorage.LEDGER).read_text()) == 10 * OBJ


def test_eviction_is_least_recently_used_across_processes(tmp_path, monkeypatch):
    """A process evicted from its own index only: its hottest object went while another
    process's never-read ones stayed. The rescan before evicting orders every process's
    objects by their last use."""
    monkeypatch.setattr(FileStorage, "RESCAN_S", 0.0)
    mine, other = FileStorage(tmp_path, max_bytes=3 * OBJ), FileStorage(tmp_path, max_bytes=3 * OBJ)
    for key in ("b0", "b1"):
        assert other.put(f"{key:0>8}", bytes(OBJ))
        time.sleep(0.01)
    assert mine.put(f"{'a0':0>8}", bytes(OBJ))
    time.sleep(0.01)
    mine.touch(f"{'a0':0>8}")  # (a hit)
    assert mine.put(f"{'a1':0>8}", bytes(OBJ))
    assert [mine.exists(f"{k:0>8}") for k in ("b0", "b1", "a0", "a1")] == [False, True, True, True]


def test_pool_page_bytes_are_the_elided_layout():
    layout = CacheLayout.for_model("glm-5.2", page_size=4, draft_layers=1)
    pool = DSAKVPool(layout, 3)
    g = torch.Generator().manual_seed(0)
    for v in pool._page_views():
        v.copy_(torch.randint(0, 256, v.shape, dtype=torch.uint8, generator=g))
    rows = pool.read_pages([2, 0])
    assert rows.shape == (2, 4 * 48_408)  # latent everywhere, index-K on 21 + 1 layers only
    other = DSAKVPool(layout, 3)
    other.write_pages([0, 1], rows)
    for a, b in zip(pool.read_pages([2, 0]), other.read_pages([0, 1])):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="uint8"):
        DSAKVPool(layout.dense(), 1).write_pages([0], rows[:1])


def test_prefix_cache_nodes_carry_the_page_hash_chain():
    cache = PrefixCache(PageAllocator(8, 4))
    tokens = list(range(13))
    path = cache.insert(tokens, cache.alloc(3))
    assert [n.hash for n in path] == chain_hashes(tokens, 4, 0, 3, ROOT_HASH)
    assert chain_hashes(tokens, 4, 1, 3, path[0].hash) == [n.hash for n in path[1:]]
    other = cache.insert([0, 1, 2, 3, 9, 9, 9, 9], cache.alloc(2))
    assert other[0] is path[0] and other[1].hash != path[1].hash  # same page, other history


# --- restart -----------------------------------------------------------------------------------


def test_restart_reads_the_prefix_from_l3(tiny, stored):
    store, cold, first = stored
    layout_bytes = first["bytes_per_token"]
    assert first["l3_pages_written"] == PAGES and first["l3_hits"] == 0
    assert first["l3_bytes_written"] == PAGES * PS * layout_bytes  # exactly the layout's bytes
    files = _objects(store)
    assert len(files) == PAGES
    assert {f.stat().st_size for f in files} == {HEADER.size + PS * layout_bytes}
    (warm,), c = _run(tiny, [PROMPT], **_file(store))
    assert warm == cold
    assert c["l3_hits"] == PAGES and c["l3_hit_tokens"] == PAGES * PS
    assert c["l3_bytes_read"] == PAGES * PS * layout_bytes and c["l3_misses"] == 0
    assert c["prefix_hit_tokens"] == PAGES * PS
    # Only the partial last page and the decode steps ran through the model.
    assert c["computed_tokens"] == len(PROMPT) - PAGES * PS + GREEDY.max_tokens - 1
    assert c["l3_pages_written"] == 0  # every page it cached was known to be stored


def test_a_prefix_the_cache_lost_while_queued_is_read_from_l3(tiny, stored, tmp_path):
    """A request found its prompt in the prefix cache when it arrived, and the cache lost
    those pages before its turn (evicted for the requests ahead of it): L3, which holds
    them, is asked again from what the cache still holds (it computed the whole prompt)."""
    llm = LLM(tiny, **_file(_copy(stored, tmp_path)))
    try:
        e = llm.engine
        llm.generate([PROMPT], GREEDY)  # (its pages in the prefix cache)
        req = e.add_request(PROMPT, GREEDY)
        assert e.l3.starts_at(req.rid) == PAGES  # (nothing for L3 to look up)
        e.cache.reset()  # (as eviction under pressure does, before its turn)
        before = e.counters()
        while e.has_unfinished():
            e.step()
        c = e.counters()
        assert req.output_ids == stored[1]
        assert req.metrics.prefix_hit_tokens == PAGES * PS
        assert c["l3_hits"] - before["l3_hits"] == PAGES
        assert c["computed_tokens"] - before["computed_tokens"] == len(PROMPT) - PAGES * PS + 7
        e.check_integrity()
    finally:
        llm.close()


def test_mtp_draft_layer_travels_and_tokens_match(tiny, tmp_path):
    mtp = dict(speculative_algorithm="mtp", speculative_num_steps=2)
    (cold,), first = _run(tiny, [PROMPT], **_file(tmp_path, **mtp))
    assert first["l3_bytes_written"] == first["l3_pages_written"] * PS * first["bytes_per_token"]
    (warm,), c = _run(tiny, [PROMPT], **_file(tmp_path, **mtp))
    assert warm == cold and c["l3_hits"] == PAGES
    # A server without the draft layer has another layout: it finds nothing.
    (_,), plain = _run(tiny, [PROMPT], **_file(tmp_path))
    assert plain["l3_hits"] == 0 and plain["l3_misses"] == 1


@pytest.mark.parametrize(
    "change",
    [
        dict(kv_cache_dtype="fp32"),
        dict(index_k_dtype="bf16"),
        dict(page_size=8),
        dict(index_topk_pattern="FFSSFSSS"),
        dict(elide_index_k=False),
        # Another compute path holds other bits: a hit would break bit-exact reuse.
        dict(enable_deterministic_inference=False),
        dict(attention_backend="torch"),
    ],
    ids=["kv-dtype", "index-k-dtype", "page-size", "pattern", "dense", "batched", "torch"],
)
def test_another_layout_finds_no_hits(tiny, stored, tmp_path, change):
    store = _copy(stored, tmp_path)
    (_,), c = _run(tiny, [PROMPT], **{**_file(store), **change})
    assert c["l3_hits"] == 0 and c["l3_misses"] == 1 and c["l3_corrupt_objects"] == 0
    assert c["l3_pages_written"] > 0  # it stores its own pages beside the others
    assert len(_objects(store)) == PAGES + c["l3_pages_written"]


def test_another_checkpoint_finds_no_hits(stored, tmp_path):
    other = str(write_tiny_model(tmp_path / "seed1", preset="glm-tiny", seed=1))
    (_,), c = _run(other, [PROMPT], **_file(_copy(stored, tmp_path)))
    assert c["l3_hits"] == 0 and c["l3_misses"] == 1


def test_a_checkpoint_patched_mid_file_finds_no_hits(tiny, stored, tmp_path):
    """One weight byte changed far from a shard's ends (a patched tensor)."""
    patched = tmp_path / "patched"
    shutil.copytree(tiny, patched)
    (shard,) = patched.glob("*.safetensors")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(data)
    (_,), c = _run(str(patched), [PROMPT], **_file(_copy(stored, tmp_path)))
    assert c["l3_hits"] == 0 and c["l3_misses"] == 1


def _in_subfolder(model: str, dest: Path) -> str:
    """`model` with its weights in `dest/weights/`, named by a safetensors index."""
    dest.mkdir()
    for f in Path(model).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dest / f.name)
    (dest / "weights").mkdir()
    shutil.copy(Path(model) / "model.safetensors", dest / "weights" / "model.safetensors")
    with safe_open(dest / "weights" / "model.safetensors", "pt") as f:
        names = list(f.keys())
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, "weights/model.safetensors")}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(dest)


def test_a_checkpoint_with_its_shards_in_a_subfolder_finds_no_other_checkpoints_hits(
    tiny, tmp_path
):
    """The identity digested the top-level shards only: two seeds whose index puts the
    weights in `weights/` had one identity, and one loaded the other's pages."""
    seed0 = _in_subfolder(tiny, tmp_path / "s0")
    seed1 = _in_subfolder(
        str(write_tiny_model(tmp_path / "seed1", preset="glm-tiny", seed=1)), tmp_path / "s1"
    )
    assert model_identity(seed0) != model_identity(seed1)
    (_,), c = _run(seed0, [PROMPT], **_file(tmp_path / "store"))
    assert c["l3_pages_written"] == PAGES
    (_,), c = _run(seed1, [PROMPT], **_file(tmp_path / "store"))
    assert c["l3_hits"] == 0 and c["l3_misses"] == 1


# --- write-back and the host tier ----------------------------------------------------------------


def _others(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(150)] for _ in range(n)]


@pytest.mark.parametrize("host", [0.0, 4.5], ids=["no-host", "host"])
def test_write_back_stores_pages_leaving_the_cache(tiny, stored, tmp_path, host):
    """12 device pages (a prompt needs 10): unrelated prompts evict the first one's pages,
    to the host tier when there is one (4 pages), and from there (or straight from the
    device without one) to L3; the prompt comes back from all three tiers."""
    _, cold, _ = stored
    page_bytes = stored[2]["bytes_per_token"] * PS
    kw = _file(tmp_path, num_pages=12, hicache_write_policy="write_back")
    if host:
        kw["host_pool_gib"] = host * page_bytes / 2**30
    llm = LLM(tiny, **kw)
    try:
        engine = llm.engine
        assert llm.generate([PROMPT], GREEDY)[0].token_ids == cold
        assert engine.l3.drain(TIMEOUT) and engine.counters()["l3_pages_written"] == 0
        for other in _others(2, seed=1):
            llm.generate([other], GREEDY)
        engine.check_integrity()
        assert engine.l3.drain(TIMEOUT)
        c = engine.counters()
        assert c["l3_pages_written"] >= PAGES  # every page of the first prompt left
        if host:
            assert engine.cache.demoted_pages > 0 and c["host_pages_used"] == 4
        assert llm.generate([PROMPT], GREEDY)[0].token_ids == cold
        c = engine.counters()
        assert c["l3_hits"] > 0 and c["l3_corrupt_objects"] == 0
        assert c["l3_hits"] * PS <= c["prefix_hit_tokens"]
        engine.check_integrity()
    finally:
        llm.close()


def test_close_stores_what_the_cache_still_holds(tiny, stored, tmp_path):
    llm = LLM(tiny, **_file(tmp_path, hicache_write_policy="write_back"))
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == stored[1]
    assert llm.engine.l3.drain(TIMEOUT) and llm.engine.counters()["l3_pages_written"] == 0
    llm.close()  # write-back: what the cache holds is written now
    assert llm.engine.counters()["l3_pages_written"] == PAGES == len(_objects(tmp_path))


def test_a_prefix_kept_hot_on_the_device_outlives_the_stores_cap(tiny, tmp_path):
    """A store that holds 6 pages; a 4-page prompt, four other prompts after it (their
    writes drop its objects), then the prompt again (a device hit: the store never sees
    it) and close. The store had dropped it for good: close skipped it as stored, and a
    restart found nothing. Now close writes the cache coldest first and the prompt, the
    hottest, is what the next engine finds."""
    rng = random.Random(1)
    hot, *others = [[rng.randrange(0, 256) for _ in range(4 * PS + 1)] for _ in range(5)]
    llm = LLM(tiny, **_file(tmp_path / "probe"))
    cap = 6 * llm.engine.l3.page_bytes * 1.01 / 2**30  # (plus each object's small header)
    llm.close()
    params = SamplingParams(max_tokens=1, temperature=0)
    first = LLM(tiny, **_file(tmp_path / "store", hicache_storage_max_gib=cap))
    for prompt in (hot, *others, hot):
        first.generate(prompt, params)
        assert first.engine.l3.drain(TIMEOUT)
    assert first.engine.counters()["l3_objects_evicted"] >= 4
    first.close()
    assert len(_objects(tmp_path / "store")) <= 6
    _, c = _run(tiny, [hot], params, **_file(tmp_path / "store", hicache_storage_max_gib=cap))
    assert (c["l3_hits"], c["l3_misses"]) == (4, 0)


def test_close_writes_again_what_another_engine_dropped(tiny, tmp_path):
    """Two engines share a capped store; objects one wrote, the other's writes may drop.
    The first still took them as stored: close skipped them, and a restart found none."""
    store = tmp_path / "store"
    llm = LLM(tiny, **_file(store, hicache_storage_max_gib=1.0))
    llm.generate([PROMPT], GREEDY)
    assert llm.engine.l3.drain(TIMEOUT) and len(_objects(store)) == PAGES
    for path in _objects(store):  # (as the other engine's evictions would)
        path.unlink()
    llm.close()
    assert len(_objects(store)) == PAGES
    _, c = _run(tiny, [PROMPT], **_file(store, hicache_storage_max_gib=1.0))
    assert c["l3_hits"] == PAGES


def test_retraction_and_prefix_sharing_keep_integrity(tiny, stored, tmp_path):
    """A batch that overflows a small pool (retractions) over a warm store: same tokens."""
    prompts = [PROMPT[: 40 + 20 * i] + [i] for i in range(5)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ref, _ = _run(tiny, prompts, params, device="cpu", page_size=PS, num_pages=64)
    store = _copy(stored, tmp_path)
    tokens, c = _run(tiny, prompts, params, synchronous=True, **_file(store, num_pages=12))
    assert tokens == ref
    assert c["retractions"] > 0 and c["l3_hits"] > 0


# --- faults ------------------------------------------------------------------------------------


def test_corrupt_and_truncated_objects_are_misses(tiny, stored, tmp_path):
    store = _copy(stored, tmp_path)
    cold = stored[1]
    by_page = _pages_in_order(tiny, store)
    data = bytearray(by_page[3].read_bytes())
    data[HEADER.size + 1000] ^= 0x40  # one bit of page 3's payload
    by_page[3].write_bytes(bytes(data))
    (warm,), c = _run(tiny, [PROMPT], **_file(store))
    assert warm == cold
    assert c["l3_hits"] == 3 and c["l3_corrupt_objects"] == 1 and c["l3_misses"] == 1
    assert not by_page[3].exists() or by_page[3].read_bytes() != bytes(data)  # deleted (rewritten)
    # Truncated: the first page is cut short; nothing after it can be used.
    by_page[0].write_bytes(by_page[0].read_bytes()[:-100])
    (warm,), c = _run(tiny, [PROMPT], **_file(store))
    assert warm == cold and c["l3_hits"] == 0 and c["l3_corrupt_objects"] == 1


def _pages_in_order(model: str, store: Path) -> list[Path]:
    """The store's objects of PROMPT, page 0 first (the key names the page hash)."""
    hashes = chain_hashes(PROMPT, PS, 0, PAGES, ROOT_HASH)
    files = {f.name.split("-")[1].split(".")[0]: f for f in _objects(store)}
    return [files[h.hex()] for h in hashes]


def test_full_store_keeps_serving(tiny, stored, tmp_path):
    page_bytes = stored[2]["bytes_per_token"] * PS + HEADER.size
    # A cap below one object: every write is refused, serving goes on.
    (tokens,), c = _run(tiny, [PROMPT], **_file(tmp_path / "a", hicache_storage_max_gib=1e-6))
    assert tokens == stored[1]
    assert c["l3_write_failures"] == PAGES and c["l3_pages_written"] == 0
    assert _objects(tmp_path / "a") == []
    # A cap of three objects: the least recently used are evicted, the store stays capped.
    cap = 3 * page_bytes / 2**30
    (tokens,), c = _run(tiny, [PROMPT], **_file(tmp_path / "b", hicache_storage_max_gib=cap))
    assert tokens == stored[1]
    assert c["l3_pages_written"] == PAGES and c["l3_objects_evicted"] == PAGES - 3
    assert len(_objects(tmp_path / "b")) == 3


def _run_stored(llm: LLM, stored) -> dict:
    """`PROMPT`'s greedy run, checked against the stored one, and the counters once every
    write it queued is done."""
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == stored[1]
    assert llm.engine.l3.drain(TIMEOUT)
    return llm.engine.counters()


@pytest.mark.parametrize("store_fault", ["unwritable", "refusing"])
def test_a_store_failing_every_page_warns_once(tiny, stored, tmp_path, caplog, store_fault):
    """An unwritable directory logged a warning per page, and a store refusing writes (here
    a cap below one page; a full Mooncake Store alike) warned per put: now one warning every
    30 s either way, and serving goes on."""
    store = tmp_path / "store"
    cap = dict(hicache_storage_max_gib=1e-6) if store_fault == "refusing" else {}
    llm = LLM(tiny, **_file(store, **cap))
    try:
        if store_fault == "unwritable":
            shutil.rmtree(store)
            store.write_bytes(b"")  # (a file where the directory was: every write fails)
        c = _run_stored(llm, stored)
        assert c["l3_write_failures"] == PAGES and c["l3_pages_written"] == 0
    finally:
        llm.close()
    warnings = [r.message for r in caplog.records if r.levelname == "WARNING" and "L3" in r.message]
    assert len(warnings) == 1, warnings
    assert ("refused" in warnings[0]) == (store_fault == "refusing"), warnings


def test_a_store_directory_removed_mid_run_is_made_again(tiny, stored, tmp_path):
    """Writes made the page's subdirectory only, not the root: one removal of the store
    (a tmp cleaner) refused every write for the rest of the run."""
    store = tmp_path / "store"
    llm = LLM(tiny, **_file(store))
    try:
        shutil.rmtree(store)
        c = _run_stored(llm, stored)
        assert c["l3_pages_written"] == PAGES and c["l3_write_failures"] == 0
    finally:
        llm.close()
    assert len(_objects(store)) == PAGES


def test_a_prefetch_timeout_past_what_a_wait_takes_serves(tiny, stored, tmp_path):
    """`Event.wait` takes at most `threading.TIMEOUT_MAX` (~9.2e9 s): a longer timeout was an
    OverflowError on an idle engine's first lookup. Infinity is refused up front."""
    with pytest.raises(DsakvError, match="prefetch-timeout must be a finite number"):
        StorageConfig("file", str(tmp_path), prefetch_timeout_s=float("inf"))
    (tokens,), c = _run(
        tiny, [PROMPT], **_file(_copy(stored, tmp_path), hicache_storage_prefetch_timeout=1e11)
    )
    assert tokens == stored[1] and c["l3_hits"] == PAGES


class _SlowStorage:
    """Wraps a backend; every `get` takes `delay` seconds."""

    def __init__(self, inner, delay: float) -> None:
        self.inner, self.delay, self.evicted = inner, delay, 0

    def get(self, key):
        time.sleep(self.delay)
        return self.inner.get(key)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_slow_store_shortens_the_hit_and_never_stalls_the_batch(tiny, stored, tmp_path):
    store = _copy(stored, tmp_path)
    llm = LLM(tiny, **_file(store, hicache_storage_prefetch_timeout=1.0))
    try:
        engine = llm.engine
        engine.l3.backend = _SlowStorage(engine.l3.backend, delay=0.3)
        busy = engine.add_request([7] * 20, SamplingParams(max_tokens=200, ignore_eos=True))
        engine.step()  # `busy` runs (its own lookup ends at once: nothing stored)
        req = engine.add_request(PROMPT, GREEDY)
        start, steps = time.monotonic(), 0
        while req.status.value == "waiting":
            engine.step()
            steps += 1
        waited = time.monotonic() - start
        assert steps > 1 and len(busy.output_ids) > 1  # the batch kept stepping meanwhile
        assert waited < 1.0 + 0.5 + 5.0  # bounded: the deadline plus one step (generous)
        while engine.has_unfinished():
            engine.step()
        c = engine.counters()
        assert c["l3_prefetch_timeouts"] == 1 and 0 <= c["l3_hits"] < PAGES
        assert req.output_ids == stored[1]
        engine.check_integrity()
    finally:
        llm.close()


def test_store_down_means_misses_and_serving_goes_on(tiny, stored, caplog):
    port = free_port()  # nothing listens there
    kw = dict(ARGS, hicache_storage_backend="mooncake", hicache_mooncake_master=f"127.0.0.1:{port}")
    start = time.monotonic()
    (tokens,), c = _run(tiny, [PROMPT], **kw)
    assert time.monotonic() - start < 20
    assert tokens == stored[1]
    assert c["l3_errors"] > 0 and c["l3_hits"] == 0 and c["l3_pages_written"] == 0
    assert c["l3_write_failures"] > 0
    assert any("L3 storage unavailable" in r.message for r in caplog.records)


# --- Mooncake Store ----------------------------------------------------------------------------


def test_mooncake_store_shares_pages_between_engines(tiny, stored):
    """Engine A starts a local master and writes its pages; engine B (another store client)
    finds them. A closes last: it owns the master."""
    master = f"127.0.0.1:{free_port()}"
    kw = dict(ARGS, hicache_storage_backend="mooncake", hicache_mooncake_master=master)
    kw["hicache_storage_max_gib"] = 1 / 16  # each engine lends the store 64 MiB
    a = LLM(tiny, **kw, hicache_mooncake_start_master=True)
    try:
        assert a.generate([PROMPT], GREEDY)[0].token_ids == stored[1]
        assert a.engine.l3.drain(TIMEOUT)
        ca = a.engine.counters()
        assert ca["l3_pages_written"] == PAGES and ca["l3_errors"] == 0
        (tokens,), cb = _run(tiny, [PROMPT], **kw)
        assert tokens == stored[1]
        assert cb["l3_hits"] == PAGES and cb["l3_corrupt_objects"] == 0 and cb["l3_errors"] == 0
    finally:
        proc = a.engine.l3.master
        a.close()
    assert proc.poll() is not None  # the master went with the engine that started it


def test_start_master_refuses_a_port_in_use():
    port = free_port()
    proc = start_mooncake_master(f"127.0.0.1:{port}")
    try:
        with pytest.raises(Exception, match="already in use"):
            start_mooncake_master(f"127.0.0.1:{port}")
    finally:
        stop_process(proc)


# --- GLM-5.2 bytes ------------------------------------------------------------------------------


def test_glm52_bytes_per_stored_token_elided_vs_dense(tmp_path):
    """The glm-bench preset has GLM-5.2's per-token cache dims: 47,700 B elided, 55,224 dense
    (fp8 / fp8), read from the counters of what was written."""
    from dsakv.models.tiny import default_model_dir

    model = str(default_model_dir("glm-bench", weights="bf16"))  # (no MTP layer: no fit)
    prompt = PROMPT[:40]  # two full pages
    per_token = {}
    for name, elide in (("elided", True), ("dense", False)):
        (_,), c = _run(model, [prompt], **_file(tmp_path / name, elide_index_k=elide))
        assert c["l3_pages_written"] == 2
        per_token[name] = c["l3_bytes_written"] / (c["l3_pages_written"] * PS)
    assert per_token == {"elided": 47_700, "dense": 55_224}


# --- command line and server -------------------------------------------------------------------


def test_a_pd_decode_request_ending_at_its_first_token_is_stored_at_once(tiny, stored, tmp_path):
    """A decode server's request whose first token (from the prefill server) ends it joins
    the prefix cache between steps (`engine.disagg.start_decoding`): L3 stores its pages
    then, not at some later step a quiet server may never take."""
    from dsakv.engine import disagg as ops

    one = dict(max_tokens=1, temperature=0, ignore_eos=True)
    prefill, decode = LLM(tiny, **ARGS), LLM(tiny, **_file(tmp_path))
    try:
        # (the prompt's KV as a prefill server sends it: its pages' bytes, into the reserved)
        (first,) = prefill.generate([PROMPT], SamplingParams(**one))
        nodes = prefill.engine.cache.match(PROMPT, PAGES)
        req = ops.reserve(decode.engine, PROMPT, SamplingParams(**one))
        kv = prefill.engine.pool.read_pages([n.page for n in nodes])
        decode.engine.pool.write_pages(req.pages[:PAGES], kv)
        ops.start_decoding(decode.engine, req, first.token_ids[0])
        assert req.finished and decode.engine.stats.steps == 0
        assert decode.engine.l3.drain(TIMEOUT)
        assert decode.engine.counters()["l3_pages_written"] == PAGES
        decode.engine.check_integrity()
    finally:
        prefill.close()
        decode.close()
    # (and they are the pages one engine stores: a restart reads them and decodes on)
    (warm,), c = _run(tiny, [PROMPT], **_file(tmp_path))
    assert warm == stored[1] and c["l3_hits"] == PAGES


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--hicache-storage-backend", "file"], "needs --hicache-storage-dir"),
        (["--hicache-storage-dir", "x"], "needs --hicache-storage-backend"),
        (["--hicache-storage-backend", "mooncake"], "needs --hicache-mooncake-master"),
        (["--hicache-storage-backend", "file", "--hicache-storage-dir", "x",
          "--hicache-mooncake-master", "127.0.0.1:1"], "need --hicache-storage-backend mooncake"),
        (["--hicache-storage-backend", "mooncake", "--hicache-mooncake-master", "h:x"],
         "HOST:PORT"),
        (["--hicache-storage-backend", "mooncake", "--hicache-mooncake-master", "10.0.0.1:5",
          "--hicache-mooncake-start-master"], "127.0.0.1:PORT"),
        (["--hicache-storage-backend", "file", "--hicache-storage-dir", "x",
          "--no-prefix-cache"], "prefix cache"),
        (["--hicache-storage-backend", "file", "--hicache-storage-dir", "x",
          "--hicache-storage-max-gib", "0"], "must be a number in (0, "),
        (["--hicache-storage-backend", "nfs"], "invalid choice"),
        (["--hicache-storage-backend", "file", "--hicache-storage-dir", "x",
          "--hicache-storage-prefetch-timeout", "inf"], "must be a number in [0, "),
        (["--hicache-storage-backend", "file", "--hicache-storage-dir", "x",
          "--hicache-storage-prefetch-timeout", "1e300"], "must be a number in [0, "),
    ],
)  # fmt: skip
def test_bad_flag_combinations_are_one_error_line(tiny, extra, message, capsys):
    with pytest.raises(SystemExit) as exc:
        sys.exit(main(["generate", tiny, "--prompt", "x", *extra]))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def _metrics(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=TIMEOUT).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


class _Server:
    """A real `dsakv serve` process on a loopback port."""

    def __init__(self, model: str, store: Path, log: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "dsakv.cli", "serve", model, "--port", str(self.port),
               "--device", "cpu", "--page-size", str(PS), "--num-pages", "64",
               "--hicache-storage-backend", "file", "--hicache-storage-dir", str(store)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)

    def complete(self) -> dict:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        r = httpx.post(f"{self.base}/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self) -> None:
        """SIGTERM, as `kill` or a container stop: the engine still closes."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(TIMEOUT)


def test_dsakv_serve_restart_reads_l3(tiny, tmp_path):
    store = tmp_path / "store"
    first = _Server(tiny, store, tmp_path / "first.log")
    try:
        cold = first.complete()
        m = _metrics(first.base)
        assert m["dsakv_l3_hits_total"] == 0
    finally:
        first.stop()
    assert first.proc.returncode == 128 + signal.SIGTERM, first.log.read_text()[-2000:]
    assert len(_objects(store)) == PAGES
    second = _Server(tiny, store, tmp_path / "second.log")
    try:
        warm = second.complete()
        m = _metrics(second.base)
    finally:
        second.stop()
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert m["dsakv_l3_hits_total"] == PAGES and m["dsakv_l3_hit_tokens_total"] == PAGES * PS
    assert m["dsakv_l3_bytes_read_total"] == m["dsakv_kv_bytes_per_token"] * PAGES * PS
    for name in ("misses", "bytes_written", "objects_evicted", "corrupt_objects"):
        assert f"dsakv_l3_{name}_total" in m


def test_close_ends_the_l3_threads(tiny, tmp_path):
    def l3_threads() -> int:
        return sum(t.name.startswith("dsakv-l3-") for t in threading.enumerate())

    before = l3_threads()
    llm = LLM(tiny, **_file(tmp_path))
    assert l3_threads() == before + 2
    llm.close()
    assert l3_threads() == before


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(hicache_storage_prefetch_timeout="2"), "--hicache-storage-prefetch-timeout must be"),
        (dict(hicache_storage_max_gib="1"), "--hicache-storage-max-gib must be a finite number"),
        (dict(hicache_storage_max_gib=float("inf")), "--hicache-storage-max-gib must be"),
        (dict(hicache_storage_dir=5), "--hicache-storage-dir must be a directory path, got 5"),
        (
            dict(hicache_storage_backend="mooncake", hicache_storage_dir=None,
                 hicache_mooncake_master=5),
            "--hicache-mooncake-master must be HOST:PORT, got 5",
        ),
    ],
)  # fmt: skip
def test_storage_args_of_the_wrong_type_name_their_flag(tiny, tmp_path, kw, message):
    """One DsakvError from the config, before any weight loads (a TypeError from comparing
    "2" with 0, and a directory of 5 failed only after the load)."""
    with pytest.raises(DsakvError, match=message):
        EngineConfig(**{**_file(tmp_path), "model": tiny, **kw})


@pytest.mark.parametrize("backend", ["file", "mooncake"])
def test_a_start_failing_after_the_tier_leaves_nothing_running(tiny, tmp_path, backend):
    """A start that fails once the L3 tier is made (here CUDA-graph capture, as it may run
    out of memory) stops its threads and the master it started: they outlived the failed
    `LLM(...)`, and a retry could not start its master (the port was in use)."""

    def l3_threads() -> int:
        return sum(t.name.startswith("dsakv-l3-") for t in threading.enumerate())

    def capture_fails(self):
        raise RuntimeError("CUDA out of memory")

    kw = _file(tmp_path)
    if backend == "mooncake":
        kw = dict(ARGS, hicache_storage_backend="mooncake", hicache_storage_max_gib=1 / 16)
        kw.update(hicache_mooncake_master=f"127.0.0.1:{free_port()}")
        kw.update(hicache_mooncake_start_master=True)
    before = l3_threads()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(Engine, "_decode_graphs", capture_fails)
        with pytest.raises(RuntimeError, match="CUDA out of memory"):
            LLM(tiny, **kw)
    assert l3_threads() == before
    llm = LLM(tiny, **kw)  # the same master address: free again
    assert l3_threads() == before + 2
    llm.close()
