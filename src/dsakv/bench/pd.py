"""`dsakv bench --pd`: prefill -> decode KV transfer over the Mooncake Transfer Engine,
elided vs dense index-K, on the GLM-5.2 layout (47,700 vs 55,224 bytes per token).

Two pools in this process, each registered with its own Mooncake engine (P2P handshake,
TCP on loopback): the same `KVTransfer.write` a prefill server uses ships one request's
pages into scattered decode pages, as a busy decode pool hands them out. The counters give
bytes per transferred request and per token; the time is the best of a few writes. The
written bytes are checked against the source.
"""

from __future__ import annotations

import ctypes
import random
from typing import Any

import torch

from dsakv.disagg.transfer import KVTransfer, PeerBuffer
from dsakv.memory import CacheLayout, DSAKVPool, page_slots


def _fill(pool: DSAKVPool, seed: int) -> None:
    """Random bytes in every buffer, through the pointers Mooncake registers (what the
    bytes decode to does not matter here, only that each one arrives)."""
    g = torch.Generator().manual_seed(seed)
    for d in pool.transfer_descriptors():
        noise = torch.randint(0, 256, (d.nbytes,), dtype=torch.uint8, generator=g)
        ctypes.memmove(d.data_ptr, noise.data_ptr(), d.nbytes)


def _bench_layout(layout: CacheLayout, lengths: tuple[int, ...], repeats: int, seed: int):
    ps = layout.page_size
    pages = -(-max(lengths) // ps)
    src_pool, dst_pool = DSAKVPool(layout, pages), DSAKVPool(layout, 2 * pages)
    _fill(src_pool, seed)
    src, dst = KVTransfer(src_pool), KVTransfer(dst_pool)
    try:
        peer = [PeerBuffer.of(d) for d in dst.buffers]
        rows = []
        for n in lengths:
            need = -(-n // ps)
            src_pages = list(range(need))
            dst_pages = random.Random(seed + n).sample(range(2 * pages), need)
            best, nbytes = float("inf"), 0
            for _ in range(repeats):
                nbytes, seconds = src.write(dst.session, peer, src_pages, dst_pages, n)
                best = min(best, seconds)
            got = dst_pool.read_tokens(page_slots(dst_pages, ps)[:n])
            want = src_pool.read_tokens(page_slots(src_pages, ps)[:n])
            exact = all(
                torch.equal(a, b) for k in want for a, b in zip(got[k], want[k], strict=True)
            )
            rows.append(
                {
                    "prompt_tokens": n,
                    "bytes_per_request": nbytes,
                    "bytes_per_token": nbytes / n,
                    "seconds_per_request": best,
                    "mib_per_s": nbytes / best / 2**20,
                    "bit_exact": exact,
                }
            )
        stats = src.stats.snapshot()
        return {
            "elide_index_k": layout.elide_index_k,
            "bytes_per_token": layout.bytes_per_token,
            "buffers": len(src.buffers),
            "counters": stats,
            "counter_bytes_per_token": stats["bytes"] / stats["tokens"],
            "requests": rows,
        }
    finally:
        src.close()
        dst.close()


def run_pd_bench(
    quick: bool = False,
    model: str = "glm-5.2",
    seed: int = 0,
    page_size: int = 64,
    lengths: tuple[int, ...] | None = None,
    repeats: int | None = None,
) -> dict[str, Any]:
    """Bytes and time per transferred request (prompt `lengths`) for both layouts, side by
    side; JSON-able."""
    lengths = lengths or ((256, 1024) if quick else (256, 1024, 4096))
    repeats = repeats or (2 if quick else 3)
    layout = CacheLayout.for_model(model, page_size=page_size)
    elided = _bench_layout(layout, lengths, repeats, seed)
    dense = _bench_layout(layout.dense(), lengths, repeats, seed)
    return {
        "bench": "pd",
        "model": model,
        "transport": "mooncake tcp (loopback)",
        "kv_cache_dtype": layout.kv_cache_dtype,
        "index_k_dtype": layout.index_k_dtype,
        "page_size": page_size,
        "elided": elided,
        "dense": dense,
        "bytes_ratio": elided["bytes_per_token"] / dense["bytes_per_token"],
        "time_ratio": [
            e["seconds_per_request"] / d["seconds_per_request"]
            for e, d in zip(elided["requests"], dense["requests"], strict=True)
        ],
    }


def summary_lines(r: dict[str, Any]) -> list[str]:
    """The report's PD section."""
    e, d = r["elided"], r["dense"]
    lines = [
        f"PD transfer: prefill -> decode over {r['transport']}, {r['model']} "
        f"({r['kv_cache_dtype']} / {r['index_k_dtype']}, page {r['page_size']}); "
        f"counters: {d['counter_bytes_per_token']:,.0f} vs {e['counter_bytes_per_token']:,.0f} "
        "B/token",
        f"{'prompt tokens':>14}{'dense MB':>11}{'elided MB':>11}{'dense ms':>11}"
        f"{'elided ms':>11}{'dense MiB/s':>13}{'elided MiB/s':>14}",
    ]
    for a, b in zip(d["requests"], e["requests"], strict=True):
        lines.append(
            f"{a['prompt_tokens']:>14,}{a['bytes_per_request'] / 1e6:>11.2f}"
            f"{b['bytes_per_request'] / 1e6:>11.2f}{a['seconds_per_request'] * 1e3:>11.1f}"
            f"{b['seconds_per_request'] * 1e3:>11.1f}{a['mib_per_s']:>13,.0f}"
            f"{b['mib_per_s']:>14,.0f}"
        )
    return lines


if __name__ == "__main__":
    import json
    import sys

    result = run_pd_bench(quick="--quick" in sys.argv)
    print("\n".join(summary_lines(result)))
    print(json.dumps(result, indent=2))
