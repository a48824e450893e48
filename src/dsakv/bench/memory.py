"""KV movement throughput, elided vs dense index-K, on the GLM-5.2 layout.

Moves, host backups and host loads copy every existing buffer token by token; elision
shrinks the bytes per token (55,224 -> 47,700 with fp8), so the same token count moves
fewer bytes. Both layouts run side by side in one process so the numbers compare.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from dsakv.memory import CacheLayout, DSAKVPool, HostPool


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Best of `repeats` wall times (after one warm-up), in seconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _rate(tokens: int, nbytes: int, seconds: float) -> dict[str, float]:
    return {
        "seconds": seconds,
        "gb_per_s": nbytes / seconds / 1e9,
        "tokens_per_s": tokens / seconds,
    }


def _bench_layout(
    layout: CacheLayout, tokens: int, device: torch.device, repeats: int
) -> dict[str, Any]:
    pages = -(-tokens // layout.page_size)
    dev = DSAKVPool(layout, 2 * pages, device)
    host = HostPool(dev, pages)
    g = torch.Generator().manual_seed(0)
    src = torch.arange(tokens)
    # scattered destinations: per-token copies, not whole pages
    dst = (pages * layout.page_size + torch.randperm(pages * layout.page_size, generator=g))[
        :tokens
    ]
    for layer in range(layout.num_layers):
        dev.write_latent(layer, src, torch.randn(tokens, layout.latent_dim, generator=g))
        if dev.has_index_k(layer):
            dev.write_index_k(layer, src, torch.randn(tokens, layout.index_head_dim, generator=g))
    nbytes = tokens * layout.bytes_per_token

    move = _time(lambda: dev.move(dst, src), device, repeats)
    backup = _time(lambda: host.free(host.backup(src)), device, repeats)
    host_slots = host.backup(src)
    load = _time(lambda: host.load(host_slots, dst), device, repeats)
    return {
        "elide_index_k": layout.elide_index_k,
        "bytes_per_token": layout.bytes_per_token,
        "index_k_layers": len(layout.index_k_layers),
        "device_pool_bytes": dev.nbytes,
        "host_pool_bytes": host.nbytes,
        "bytes_per_copy": nbytes,
        "move": _rate(tokens, nbytes, move),
        "backup": _rate(tokens, nbytes, backup),
        "load": _rate(tokens, nbytes, load),
        "host_bytes_copied": host.bytes_copied,
    }


def run_memory_bench(
    quick: bool = False,
    tokens: int | None = None,
    device: str | None = None,
    model: str = "glm-5.2",
) -> dict[str, Any]:
    """Move / backup / load throughput for the elided and dense layouts; JSON-able."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tokens = tokens or (256 if quick else 1024)
    repeats = 2 if quick else 3
    layout = CacheLayout.for_model(model)
    # Thousands of small gathers: intra-op threads add sync cost and stall badly when the
    # cores are shared, so time the copies single-threaded (what a copy stream does anyway).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        elided = _bench_layout(layout, tokens, dev, repeats)
        dense = _bench_layout(layout.dense(), tokens, dev, repeats)
    finally:
        torch.set_num_threads(threads)
    return {
        "bench": "memory",
        "model": model,
        "device": str(dev),
        "torch_threads": 1,
        "kv_cache_dtype": layout.kv_cache_dtype,
        "index_k_dtype": layout.index_k_dtype,
        "page_size": layout.page_size,
        "tokens": tokens,
        "layer_pattern": layout.plan.pattern,
        "elided": elided,
        "dense": dense,
        "bytes_saved_per_copy": dense["bytes_per_copy"] - elided["bytes_per_copy"],
        "bytes_ratio": elided["bytes_per_token"] / dense["bytes_per_token"],
        "speedup": {
            op: dense[op]["seconds"] / elided[op]["seconds"] for op in ("move", "backup", "load")
        },
    }


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run_memory_bench(quick="--quick" in sys.argv), indent=2))
