"""Prefill time, sparse vs dense attention, new (`cpu`) vs old (`torch`) backend, side by side.

One long random prompt is prefilled in chunks (as the engine does with
`chunked_prefill_size`) straight through the model over a `DSAKVPool`, by four variants:

- sparse: the model as shipped (each query attends to its index_topk selected positions);
- dense: the same weights with every indexer's top-k set above the context, so
  `Indexer.forward` skips scoring and every layer attends every visible position (what
  the model computes without DSA: no indexer runs; index keys are still stored);

each on the `cpu` backend (`kernels/cpu_ops.py`) and on the `torch` reference. Each
variant has its own pool (sparse and dense write different KV). Every chunk is run by
every variant in turn, the order rotating chunk by chunk so machine noise hits all alike,
`repeats` times each (re-running a chunk rewrites the same KV) and the median kept;
`prefill_s` at context L is the sum of the chunk medians up to L. The last chunk's
hidden states of the two backends are compared (top-1 of the logits), as a check that
the fast path computes the same model.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from statistics import median
from typing import Any

import torch
from tqdm.auto import tqdm

from dsakv.kernels import select_backend
from dsakv.memory import CacheLayout, DSAKVPool
from dsakv.models import DSAForCausalLM, ForwardBatch
from dsakv.models.indexer import Indexer
from dsakv.models.tiny import resolve_model_dir

MODES = ("sparse", "dense")


@contextmanager
def _index_topk(model: DSAForCausalLM, topk: int):
    """Every indexer of `model` keeps `topk` positions while inside (restored after)."""
    indexers = [m for m in model.modules() if isinstance(m, Indexer)]
    saved = [m.topk for m in indexers]
    for m in indexers:
        m.topk = topk
    try:
        yield
    finally:
        for m, k in zip(indexers, saved):
            m.topk = k


def run_prefill_sparse_vs_dense(
    model: str | None = None,
    lengths: tuple[int, ...] = (1024, 4096, 8192),
    chunk: int = 512,
    repeats: int = 1,
    seed: int = 0,
    page_size: int = 64,
    backends: tuple[str, ...] = ("cpu", "torch"),
    kv_cache_dtype: str = "fp8_e4m3",
    index_k_dtype: str = "fp8",
    threads: int | None = 1,
) -> dict[str, Any]:
    """Prefill seconds at each context length for every (backend, sparse|dense) variant.

    `model`: a model directory or tiny preset (default the embedded `glm-bench-short`).
    `threads` pins torch's intra-op threads while it runs (1: stable timings on shared
    cores; None leaves them)."""
    from dsakv.models.loader import load_model

    path = resolve_model_dir(model, "glm-bench-short")
    net, config, plan = load_model(path, dtype=torch.float32)
    lengths = tuple(sorted(set(lengths)))
    top = lengths[-1]
    saved_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        layout = CacheLayout.from_plan(config, plan, kv_cache_dtype, index_k_dtype, page_size)
        ops = {
            b: select_backend(
                b,
                torch.device("cpu"),
                layout,
                n_heads=config.num_attention_heads,
                index_heads=config.index_n_heads,
                index_topk=config.index_topk,
            )
            for b in backends
        }
        variants = [(b, m) for b in backends for m in MODES]
        topk = {"sparse": config.index_topk, "dense": top + 1}
        pages = -(-(top + 1) // page_size)
        pools = {v: DSAKVPool(layout, pages) for v in variants}
        g = torch.Generator().manual_seed(seed)
        vocab = min(256, config.vocab_size)
        ids = torch.randint(0, vocab, (top,), generator=g).tolist()
        slots = torch.arange(top)

        def run(v: tuple[str, str], batch: ForwardBatch, pool: DSAKVPool) -> tuple[float, Any]:
            net.use_backend(ops[v[0]])
            with _index_topk(net, topk[v[1]]):
                t0 = time.perf_counter()
                hidden = net(batch, pool)
                return time.perf_counter() - t0, hidden

        first = min(chunk, top)
        warm = ForwardBatch.from_requests([ids[:first]], [slots[:first]])
        for v in variants:  # warm-up on a scratch pool
            run(v, warm, DSAKVPool(layout, -(-first // page_size)))

        bounds = sorted({*range(chunk, top, chunk), *lengths})
        cum = dict.fromkeys(variants, 0.0)
        out: dict[tuple[str, str], dict[str, dict[str, float]]] = {v: {} for v in variants}
        hidden: dict[tuple[str, str], torch.Tensor] = {}
        start = 0
        for i, end in enumerate(tqdm(bounds, desc="prefill sparse vs dense", leave=False)):
            batch = ForwardBatch.from_requests([ids[start:end]], [slots[:end]])
            order = variants[i % len(variants) :] + variants[: i % len(variants)]
            times: dict[tuple[str, str], list[float]] = {v: [] for v in variants}
            for _ in range(repeats):
                for v in order:
                    dt, hidden[v] = run(v, batch, pools[v])
                    times[v].append(dt)
            for v in variants:
                cum[v] += median(times[v])
                if end in lengths:
                    out[v][str(end)] = {"prefill_s": cum[v], "last_chunk_s": median(times[v])}
            start = end
        net.use_backend(ops[backends[0]])
        with torch.inference_mode():
            top1 = {v: net.compute_logits(h).argmax(-1) for v, h in hidden.items()}
    finally:
        torch.set_num_threads(saved_threads)

    keys = [str(n) for n in lengths]
    result: dict[str, Any] = {
        "model": path,
        "num_layers": plan.num_layers,
        "num_indexer_layers": plan.num_full_layers,
        "index_topk": config.index_topk,
        "context_lengths": list(lengths),
        "chunk": chunk,
        "repeats": repeats,
        "threads": threads or torch.get_num_threads(),
        "backends": list(backends),
        "cache": f"{kv_cache_dtype} latent, {index_k_dtype} index-K",
        "prefill_s": {
            b: {m: {k: out[(b, m)][k]["prefill_s"] for k in keys} for m in MODES} for b in backends
        },
        "last_chunk_s": {
            b: {m: {k: out[(b, m)][k]["last_chunk_s"] for k in keys} for m in MODES}
            for b in backends
        },
    }
    p = result["prefill_s"]
    result["dense_over_sparse"] = {
        b: {k: p[b]["dense"][k] / p[b]["sparse"][k] for k in keys} for b in backends
    }
    if len(backends) > 1:
        new, old = backends[0], backends[1]
        result["old_over_new"] = {m: {k: p[old][m][k] / p[new][m][k] for k in keys} for m in MODES}
        result["last_chunk_top1_agreement"] = {
            m: float((top1[(new, m)] == top1[(old, m)]).float().mean()) for m in MODES
        }
    return result


def summary_lines(r: dict[str, Any]) -> list[str]:
    """A table: prefill seconds per variant at each context length, and the ratios."""
    p, keys = r["prefill_s"], [str(n) for n in r["context_lengths"]]
    cols = [(b, m) for b in r["backends"] for m in MODES]
    lines = [
        f"prefill, sparse vs dense attention ({r['num_layers']} layers, {r['num_indexer_layers']} "
        f"with an indexer, index_topk {r['index_topk']}, chunk {r['chunk']}, {r['threads']} "
        f"thread(s), {r['cache']}; seconds)",
        f"{'context':>8}"
        + "".join(f"{b + ' ' + m:>14}" for b, m in cols)
        + "".join(f"{b + ' d/s':>12}" for b in r["backends"]),
    ]
    for k in keys:
        lines.append(
            f"{k:>8}"
            + "".join(f"{p[b][m][k]:>14.2f}" for b, m in cols)
            + "".join(f"{r['dense_over_sparse'][b][k]:>12.2f}" for b in r["backends"])
        )
    if "old_over_new" in r:
        new, old = r["backends"][:2]
        s, d = r["old_over_new"]["sparse"], r["old_over_new"]["dense"]
        lines.append(
            f"  {old}/{new} time, sparse: "
            + ", ".join(f"{k} {s[k]:.2f}x" for k in keys)
            + "; dense: "
            + ", ".join(f"{k} {d[k]:.2f}x" for k in keys)
        )
        a = r["last_chunk_top1_agreement"]
        lines.append(
            f"  last chunk's top-1 {new} vs {old}: sparse {a['sparse']:.4f}, dense {a['dense']:.4f}"
        )
    return lines
