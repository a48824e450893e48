"""`dsakv bench --tp N`: the engine across ranks.

(a) Output tokens/s at tp=N against tp=1 on one workload, both engines stepped alternately
    in this process (rank 0 of the tp=N engine lives here; its other ranks wait in their
    processes while the tp=1 engine steps), so machine noise hits both alike.
(b) Aggregate peak running requests under DP attention against plain TP at the same
    per-rank KV pool: plain TP replicates the latent on every rank, DP attention gives
    each rank its own requests, so its aggregate capacity grows with the ranks.
"""

from __future__ import annotations

import time
from typing import Any

from dsakv.engine import EngineConfig
from dsakv.engine.launch import create_engine

from . import throughput as tp


def run_parallel_bench(
    model: str, tp_size: int, work: tp.Workload, num_pages: int, page_size: int, seed: int = 0
) -> dict[str, Any]:
    common = dict(model=model, num_pages=num_pages, page_size=page_size, device="cpu", seed=seed)
    one = tp.make_engine(elide=True, **common)
    many = tp.make_engine(elide=True, tp=tp_size, **common)
    try:
        runs = tp.run_interleaved({"tp1": one, f"tp{tp_size}": many}, work, desc="tp")
    finally:
        many.close()
    a, b = runs["tp1"], runs[f"tp{tp_size}"]
    out: dict[str, Any] = {
        "tp": tp_size,
        "num_pages_per_rank": num_pages,
        "requests": work.num_requests,
        "tp1": tp.strip_private(a),
        f"tp{tp_size}": tp.strip_private(b),
        "output_tokens_per_s_ratio": tp.ratio(b["output_tokens_per_s"], a["output_tokens_per_s"]),
        # On a bf16 model with sparse top-k, TP's other reduction order can flip a token.
        "greedy_token_agreement": tp.token_agreement(a["_outputs"], b["_outputs"]),
    }
    # (b) A workload larger than N pools' worth, so KV capacity bounds concurrency.
    cap = {}
    for name, dp in (("plain_tp", False), ("dp_attention", True)):
        config = EngineConfig(
            **common,
            kv_cache_dtype="fp8_e4m3",
            index_k_dtype="fp8",
            tp=tp_size,
            dp_attention=dp,
        )
        engine = create_engine(config)
        try:
            cap[name] = _saturate(engine, work)
        finally:
            engine.close()
    out["capacity"] = cap
    out["peak_running_ratio"] = tp.ratio(
        cap["dp_attention"]["peak_running_requests"], cap["plain_tp"]["peak_running_requests"]
    )
    return out


def _saturate(engine: Any, work: tp.Workload) -> dict[str, Any]:
    for i, prompt in enumerate(work.prompts):
        engine.add_request(prompt, work.params(i))
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    seconds = time.perf_counter() - t0
    c = engine.counters()
    return {
        "pages_total": c["pages_total"],
        "peak_running_requests": c["peak_running_requests"],
        "output_tokens": c["output_tokens"],
        "seconds": seconds,
        "output_tokens_per_s": c["output_tokens"] / seconds,
    }
