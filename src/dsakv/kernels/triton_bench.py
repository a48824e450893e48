"""Time dsakv's Triton kernels on real shapes and compare them with the device's copy speed.

Each result reports the bytes the kernel must move (reads; reads + writes for stores),
the median time, the achieved bytes/s and its ratio to a measured copy bandwidth (a torch
clone of a 1 GiB tensor: bytes read + written / time), so "0.6" means the kernel streams
its cache at 60% of what a plain copy reaches. Decode at 128K context reads only the 2048
selected rows per query; a "dense" decode over all 128K slots runs through the same kernel
so the long-context bandwidth figure is meaningful.

`bench_kernels(device)` on CUDA uses CUDA events (warm-up, median of N). With
`dry_run=True` (the default off CUDA) it runs tiny shapes for a couple of iterations with
CPU timers, e.g. under `TRITON_INTERPRET=1`, to check that the harness itself works.
Run `python -m dsakv.kernels.triton_bench` on a GPU machine for the table.
"""

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from .triton_fp8 import encode_e4m3
from .triton_indexer import index_logits_extend, index_logits_paged
from .triton_mla import sparse_mla_decode, sparse_mla_extend
from .triton_store import store_index_k_fp8, store_latent_ds_mla, store_latent_fp8_e4m3

KV_LORA, ROPE, INDEX_DIM, TOPK = 512, 64, 128, 2048
_ROW_BYTES = {"fp8_ds_mla": 656, "fp8_e4m3": 576, "bf16": 1152, "fp32": 2304}


def _timer(device: torch.device, dry_run: bool, warmup: int, iters: int):
    def run(fn: Callable[..., Any], *args: Any) -> float:
        """Median seconds of `fn(*args)` after warm-up."""
        for _ in range(warmup):
            fn(*args)
        times = []
        for _ in range(iters):
            if dry_run or device.type != "cuda":
                t0 = time.perf_counter()
                fn(*args)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
            else:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn(*args)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    return run


def _latent_cache(kind: str, slots: int, device: torch.device) -> torch.Tensor:
    """A latent buffer of `slots` rows in `kind`'s layout holding random (finite) rows."""
    rows = torch.randn(slots, KV_LORA + ROPE, device=device)
    idx = torch.arange(slots, device=device)
    if kind == "fp8_ds_mla":
        cache = torch.zeros(slots, _ROW_BYTES[kind], dtype=torch.uint8, device=device)
        store_latent_ds_mla(rows, cache, idx, KV_LORA, ROPE)
        return cache
    if kind == "fp8_e4m3":
        return encode_e4m3(rows).view(slots, -1)
    return rows.to(torch.bfloat16 if kind == "bf16" else torch.float32)


def _index_pages(ctx: int, batch: int, ps: int, device: torch.device):
    """fp8 index-K pages for `batch` requests of `ctx` tokens, pages shuffled."""
    pages = batch * (ctx // ps)
    kp = torch.zeros(pages, ps * (INDEX_DIM + 4), dtype=torch.uint8, device=device)
    keys = torch.randn(pages * ps, INDEX_DIM, device=device)
    store_index_k_fp8(keys, kp, torch.arange(pages * ps, device=device), ps)
    table = torch.randperm(pages, device=device).view(batch, -1).to(torch.int32)
    return kp, table


def copy_bandwidth(device: torch.device, nbytes: int, timer) -> tuple[float, float]:
    """(bytes/s, seconds) of a device clone of `nbytes`, counting read + write."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    seconds = timer(x.clone)
    return 2 * nbytes / seconds, seconds


def _row(
    name: str,
    shape: dict[str, Any],
    seconds: float,
    nbytes: int,
    copy_bw: float,
    flops: float = 0.0,
):
    out = {
        "kernel": name,
        "shape": shape,
        "time_ms": seconds * 1e3,
        "bytes": nbytes,
        "bytes_per_s": nbytes / seconds,
        "copy_ratio": nbytes / seconds / copy_bw,
    }
    if flops:
        out["tflops"] = flops / seconds / 1e12
    return out


def bench_kernels(
    device: str | torch.device = "cuda",
    dry_run: bool | None = None,
    warmup: int | None = None,
    iters: int | None = None,
) -> list[dict[str, Any]]:
    """Time every kernel; one dict per case (see module doc). `dry_run` (default: not CUDA)
    shrinks shapes and iterations so the harness runs under the Triton interpreter."""
    device = torch.device(device)
    dry = device.type != "cuda" if dry_run is None else dry_run
    timer = _timer(device, dry, warmup if warmup is not None else (0 if dry else 3),
                   iters if iters is not None else (2 if dry else 20))  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(0)
    copy_bytes = (1 << 20) if dry else (1 << 30)
    copy_bw, copy_t = copy_bandwidth(device, copy_bytes, timer)
    results = [
        _row("copy (torch clone)", {"MiB": copy_bytes >> 20}, copy_t, 2 * copy_bytes, copy_bw)
    ]

    # --- sparse MLA decode: top-k rows out of a long context, and dense over all of it ----
    ctx = 256 if dry else 131072
    topk = 32 if dry else TOPK
    cases = [(2, 4, "fp8_ds_mla")] if dry else [
        (b, h, kind) for kind in ("fp8_ds_mla", "bf16") for b, h in ((16, 64), (16, 128))
    ]  # fmt: skip
    for batch, heads, kind in cases:
        cache = _latent_cache(kind, ctx * (1 if dry else 4), device)
        q = torch.randn(batch, heads, KV_LORA + ROPE, device=device, generator=gen).to(
            torch.bfloat16
        )
        slots = torch.stack(
            [
                torch.randperm(cache.shape[0], device=device, generator=gen)[:topk]
                for _ in range(batch)
            ]
        ).to(torch.int32)
        t = timer(sparse_mla_decode, q, cache, kind, slots, 0.04, KV_LORA, ROPE)
        nbytes = batch * topk * _ROW_BYTES[kind] + q.numel() * q.element_size()
        flops = 4.0 * batch * heads * topk * (KV_LORA + ROPE)
        results.append(
            _row(
                f"sparse_mla_decode[{kind}]",
                {"B": batch, "H": heads, "K": topk, "ctx": ctx},
                t,
                nbytes,
                copy_bw,
                flops,
            )
        )
    dense_cases = (
        [(1, 4, "fp8_ds_mla")]
        if dry
        else [(2, 64, "fp8_ds_mla"), (2, 128, "fp8_ds_mla"), (2, 64, "bf16")]
    )
    for batch, heads, kind in dense_cases:
        cache = _latent_cache(kind, batch * ctx, device)
        q = torch.randn(batch, heads, KV_LORA + ROPE, device=device, generator=gen).to(
            torch.bfloat16
        )
        slots = torch.arange(batch * ctx, device=device, dtype=torch.int32).view(batch, ctx)
        t = timer(sparse_mla_decode, q, cache, kind, slots, 0.04, KV_LORA, ROPE)
        nbytes = batch * ctx * _ROW_BYTES[kind] + q.numel() * q.element_size()
        flops = 4.0 * batch * heads * ctx * (KV_LORA + ROPE)
        results.append(
            _row(
                f"dense_mla_decode[{kind}]",
                {"B": batch, "H": heads, "K": ctx, "ctx": ctx},
                t,
                nbytes,
                copy_bw,
                flops,
            )
        )

    # --- sparse MLA extend (prefill chunk, top-k per query) ---------------------------------
    e, length, heads = (8, 64, 4) if dry else (256, 8192, 64)
    cache = _latent_cache("fp8_ds_mla", length, device)
    q = torch.randn(e, heads, KV_LORA + ROPE, device=device, generator=gen).to(torch.bfloat16)
    ctx_slots = torch.randperm(length, device=device, generator=gen).to(torch.int32)
    q_pos = torch.arange(length - e, length, device=device, dtype=torch.int32)
    k = min(topk, length)
    topk_pos = torch.stack(
        [torch.randperm(length - e, device=device, generator=gen)[:k] for _ in range(e)]
    ).to(torch.int32)
    t = timer(
        sparse_mla_extend, q, cache, "fp8_ds_mla", ctx_slots, q_pos, topk_pos, 0.04, KV_LORA, ROPE
    )
    results.append(_row("sparse_mla_extend[fp8_ds_mla]", {"E": e, "H": heads, "K": k, "L": length}, t,
                        e * k * 656, copy_bw, 4.0 * e * heads * k * (KV_LORA + ROPE)))  # fmt: skip

    # --- indexer logits, paged decode at 4K..128K, and one prefill chunk -------------------
    ps = 64
    ctxs = (128, 256) if dry else (4096, 16384, 65536, 131072)
    index_heads = (2,) if dry else (32, 64)
    batch = 2 if dry else 16
    for c in ctxs:
        kp, table = _index_pages(c, batch, ps, device)
        lens = torch.full((batch,), c, dtype=torch.int32, device=device)
        for hi in index_heads:
            qi = torch.randn(batch, hi, INDEX_DIM, device=device, generator=gen).to(torch.bfloat16)
            w = torch.randn(batch, hi, device=device, generator=gen)
            t = timer(index_logits_paged, qi, w, kp, table, lens, ps, c)
            nbytes = batch * c * (INDEX_DIM + 4) + qi.numel() * 2 + w.numel() * 4
            results.append(_row("index_logits_paged", {"B": batch, "Hi": hi, "ctx": c}, t, nbytes, copy_bw,
                                2.0 * batch * hi * c * INDEX_DIM))  # fmt: skip
    e, length, hi = (8, 128, 2) if dry else (512, 16384, 32)
    kp, table = _index_pages(length, 1, ps, device)
    ctx_slots = ((table[0].long()[:, None] * ps) + torch.arange(ps, device=device)).flatten()
    qi = torch.randn(e, hi, INDEX_DIM, device=device, generator=gen).to(torch.bfloat16)
    w = torch.randn(e, hi, device=device, generator=gen)
    q_pos = torch.arange(length - e, length, device=device, dtype=torch.int32)
    t = timer(index_logits_extend, qi, w, kp, ctx_slots, q_pos, ps)
    # keys read once, queries and weights, and the [E, L] fp32 logits it writes
    nbytes = length * (INDEX_DIM + 4) + qi.numel() * 2 + w.numel() * 4 + e * length * 4
    results.append(_row("index_logits_extend", {"E": e, "Hi": hi, "L": length}, t, nbytes,
                        copy_bw, 2.0 * e * hi * length * INDEX_DIM))  # fmt: skip

    # --- stores -------------------------------------------------------------------------------
    n = 16 if dry else 8192
    rows = torch.randn(n, KV_LORA + ROPE, device=device, generator=gen)
    dst_slots = torch.randperm(n * 2, device=device, generator=gen)[:n]
    ds = torch.zeros(n * 2, 656, dtype=torch.uint8, device=device)
    t = timer(store_latent_ds_mla, rows, ds, dst_slots, KV_LORA, ROPE)
    results.append(_row("store_latent_ds_mla", {"N": n}, t, n * (576 * 4 + 656), copy_bw))
    plain = torch.zeros(n * 2, 576, dtype=torch.uint8, device=device)
    t = timer(store_latent_fp8_e4m3, rows, plain, dst_slots)
    results.append(_row("store_latent_fp8_e4m3", {"N": n}, t, n * (576 * 4 + 576), copy_bw))
    keys = torch.randn(n, INDEX_DIM, device=device, generator=gen)
    kp = torch.zeros(n * 2 // ps + 1, ps * (INDEX_DIM + 4), dtype=torch.uint8, device=device)
    t = timer(store_index_k_fp8, keys, kp, dst_slots, ps)
    results.append(
        _row("store_index_k_fp8", {"N": n, "ps": ps}, t, n * (INDEX_DIM * 4 + 132), copy_bw)
    )
    return results


def format_results(results: list[dict[str, Any]]) -> str:
    """A plain-text table of `bench_kernels` output."""
    lines = [f"{'kernel':32} {'shape':44} {'ms':>9} {'GB/s':>9} {'copy':>6} {'TFLOP/s':>8}"]
    for r in results:
        shape = " ".join(f"{k}={v}" for k, v in r["shape"].items())
        tf = f"{r['tflops']:8.1f}" if "tflops" in r else " " * 8
        lines.append(
            f"{r['kernel']:32} {shape:44} {r['time_ms']:9.3f} {r['bytes_per_s'] / 1e9:9.1f} "
            f"{r['copy_ratio']:6.2f} {tf}"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - GPU machines
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print(format_results(bench_kernels(dev)))
