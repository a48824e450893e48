"""`dsakv bench` L3 section: a long prompt run cold by one engine, then again by a fresh
engine (a restart) that reads its prefix back from L3 storage; elided vs dense index-K.

Reports the time to first token of each (wall clock from the request's arrival, so the
hit includes the lookup, reading and checksumming the objects, and loading them into the
pool), and the bytes stored per token from the engine's counters: the layout's cell,
47,700 elided vs 55,224 dense on GLM-5.2's dims with an FP8 cache. Greedy tokens of the
two runs must agree. The file backend stores in a temporary directory unless one is
given; Mooncake Store runs against a given master or one started here on loopback (the
first engine stays up while the second reads: objects live in its memory segment).
"""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

from dsakv.engine import SamplingParams
from dsakv.memory.storage import start_mooncake_master
from dsakv.procs import free_port, stop_process

from . import throughput as tp


def _storage_kw(backend: str, where: str) -> dict[str, Any]:
    kw: dict[str, Any] = dict(hicache_storage_backend=backend, hicache_write_policy="write_through")
    if backend == "file":
        kw["hicache_storage_dir"] = where
    else:
        kw.update(hicache_mooncake_master=where, hicache_storage_max_gib=1.0)
    return kw


def _ttft(engine: Any, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    req = engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    return req.metrics.ttft, list(req.output_ids)


def _one_layout(
    model: str, prompt: list[int], page_size: int, elide: bool, backend: str, where: str
) -> dict[str, Any]:
    pages = len(prompt) // page_size + 4
    common = dict(num_pages=pages, page_size=page_size, **_storage_kw(backend, where))
    cold_engine = tp.make_engine(model, elide=elide, **common)
    warm_engine = None
    try:
        cold_ttft, cold_tokens = _ttft(cold_engine, prompt, 4)
        cold_engine.l3.drain(120)
        written = cold_engine.counters()
        if backend == "file":  # a real restart: the first engine is gone
            cold_engine.close()
        warm_engine = tp.make_engine(model, elide=elide, **common)
        hit_ttft, hit_tokens = _ttft(warm_engine, prompt, 4)
        read = warm_engine.counters()
    finally:
        cold_engine.close()
        if warm_engine is not None:
            warm_engine.close()
    stored_tokens = written["l3_pages_written"] * page_size
    return {
        "elide_index_k": elide,
        "bytes_per_token": written["bytes_per_token"],
        "l3_bytes_written": written["l3_bytes_written"],
        "l3_pages_written": written["l3_pages_written"],
        "stored_bytes_per_token": written["l3_bytes_written"] / stored_tokens
        if stored_tokens
        else None,
        "l3_hit_tokens": read["l3_hit_tokens"],
        "l3_bytes_read": read["l3_bytes_read"],
        "cold_ttft_s": cold_ttft,
        "l3_hit_ttft_s": hit_ttft,
        "ttft_ratio": hit_ttft / cold_ttft if cold_ttft else None,
        "tokens_equal": cold_tokens == hit_tokens,
    }


def run_storage_bench(
    model: str,
    prompt_len: int = 1024,
    page_size: int = 64,
    seed: int = 0,
    backend: str = "file",
    storage_dir: str | None = None,
    mooncake_master: str | None = None,
) -> dict[str, Any]:
    """Cold vs L3-hit TTFT and stored bytes per token, elided and dense; JSON-able."""
    rng = random.Random(seed + 9)
    prompt = [rng.randrange(256) for _ in range(prompt_len)]
    # A fresh folder (under --hicache-storage-dir when given): another run's pages there
    # would make the cold pass a hit.
    tmp = None
    if backend == "file":
        if storage_dir is not None:
            Path(storage_dir).mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix="dsakv-bench-l3-", dir=storage_dir)
    master = None
    try:
        if backend == "mooncake" and mooncake_master is None:
            mooncake_master = f"127.0.0.1:{free_port()}"
            master = start_mooncake_master(mooncake_master)
        rows = {}
        for name, elide in (("elided", True), ("dense", False)):
            if backend == "file":
                where = str(Path(tmp) / name)
            else:
                where = mooncake_master
            rows[name] = _one_layout(model, prompt, page_size, elide, backend, where)
    finally:
        if master is not None:
            stop_process(master)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    e, d = rows["elided"], rows["dense"]
    return {
        "bench": "storage",
        "model": model,
        "backend": backend,
        "prompt_tokens": prompt_len,
        "page_size": page_size,
        "elided": e,
        "dense": d,
        "stored_bytes_ratio": e["stored_bytes_per_token"] / d["stored_bytes_per_token"]
        if e["stored_bytes_per_token"] and d["stored_bytes_per_token"]
        else None,
    }


def summary_lines(r: dict[str, Any]) -> list[str]:
    """The report's L3 section."""
    e, d = r["elided"], r["dense"]

    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    rows = [
        ("TTFT cold (s)", d["cold_ttft_s"], e["cold_ttft_s"], ".3f"),
        ("TTFT L3 hit, fresh engine (s)", d["l3_hit_ttft_s"], e["l3_hit_ttft_s"], ".3f"),
        ("L3 hit / cold TTFT", d["ttft_ratio"], e["ttft_ratio"], ".3f"),
        ("tokens served from L3", d["l3_hit_tokens"], e["l3_hit_tokens"], ","),
        (
            "bytes stored per token",
            d["stored_bytes_per_token"],
            e["stored_bytes_per_token"],
            ",.0f",
        ),
    ]
    lines = [
        f"L3 prefix storage ({r['backend']}): a {r['prompt_tokens']:,}-token prompt, cold, "
        f"then read back by a fresh engine (page {r['page_size']})",
        f"{'':34}{'dense':>16}{'elided':>16}",
    ]
    lines += [f"{name:34}{f(a, fmt):>16}{f(b, fmt):>16}" for name, a, b, fmt in rows]
    same = e["tokens_equal"] and d["tokens_equal"]
    lines.append(f"  greedy tokens equal cold vs L3 hit: {'yes' if same else 'NO'}")
    return lines
