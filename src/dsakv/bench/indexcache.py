"""IndexCache compute: the model's sharing pattern vs every layer running its indexer.

Both models run the model forward directly over a `DSAKVPool`, prefilling one long
prompt in chunks (as the engine does with `chunked_prefill_size`). Each chunk is timed
`repeats` times (re-running a chunk rewrites the same KV, so the state is unchanged) and
the median kept; shared and all-full alternate chunk by chunk so noise hits both alike.
`prefill_s` at context L is the sum of the chunk medians up to L; `decode_s` is the
median time of one decode step at context L.
"""

from __future__ import annotations

import time
from statistics import median
from typing import Any

import torch
from tqdm.auto import tqdm

from dsakv.memory import CacheLayout, DSAKVPool
from dsakv.models import DSAForCausalLM, ForwardBatch


def all_full_model(model: DSAForCausalLM) -> DSAForCausalLM:
    """The same weights with an indexer on every layer (the pre-IndexShare baseline).

    Shared layers have no indexer weights in the checkpoint; each gets a copy of the
    indexer its layer takes the top-k from, so compute and memory traffic are real.
    """
    plan = model.plan
    full = DSAForCausalLM(model.config, plan.all_full(), dtype=model.dtype)
    state = model.state_dict()
    missing, unexpected = full.load_state_dict(state, strict=False)
    if unexpected:
        raise RuntimeError(f"unexpected tensors for the all-full model: {unexpected[:4]}")
    target = full.state_dict()
    with torch.no_grad():
        for name in missing:
            if ".indexer." not in name:
                raise RuntimeError(f"all-full model is missing {name}")
            layer = int(name.split(".")[2])
            src = name.replace(f"layers.{layer}.", f"layers.{plan.topk_source(layer)}.", 1)
            target[name].copy_(state[src])
    return full.eval()


def _timed(model: DSAForCausalLM, batch: ForwardBatch, pool: DSAKVPool) -> float:
    t0 = time.perf_counter()
    model(batch, pool)
    return time.perf_counter() - t0


def run_indexcache(
    model: DSAForCausalLM,
    lengths: tuple[int, ...],
    chunk: int = 512,
    repeats: int = 3,
    seed: int = 0,
    page_size: int = 64,
) -> dict[str, Any]:
    """Prefill/decode time at each context length, sharing pattern vs all full."""
    lengths = tuple(sorted(set(lengths)))
    full = all_full_model(model)
    variants = {"shared": model, "all_full": full}
    top = lengths[-1]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, min(256, model.config.vocab_size), (top + 1,), generator=g).tolist()
    slots = torch.arange(top + 1)
    pools = {
        name: DSAKVPool(
            CacheLayout.from_plan(m.config, m.plan, "fp8_e4m3", "fp8", page_size),
            -(-(top + 1) // page_size),
        )
        for name, m in variants.items()
    }
    for name, m in variants.items():  # warm-up on a scratch pool
        scratch = DSAKVPool(pools[name].layout, 2)
        m(ForwardBatch.from_requests([ids[:64]], [slots[:64]]), scratch)

    bounds = sorted({*range(chunk, top, chunk), *lengths})
    cum = dict.fromkeys(variants, 0.0)
    out: dict[str, dict[str, dict[str, float]]] = {name: {} for name in variants}
    start = 0
    for end in tqdm(bounds, desc="indexcache", unit="chunk", leave=False):
        fb = ForwardBatch.from_requests([ids[start:end]], [slots[:end]])
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(repeats):
            for name, m in variants.items():
                times[name].append(_timed(m, fb, pools[name]))
        for name in variants:
            cum[name] += median(times[name])
        if end in lengths:
            db = ForwardBatch.from_requests([[ids[end]]], [slots[: end + 1]])
            dec: dict[str, list[float]] = {name: [] for name in variants}
            for name, m in variants.items():
                m(db, pools[name])  # warm-up at this length
            for _ in range(max(3, repeats)):
                for name, m in variants.items():
                    dec[name].append(_timed(m, db, pools[name]))
            for name in variants:
                out[name][str(end)] = {
                    "prefill_s": cum[name],
                    "last_chunk_s": median(times[name]),
                    "decode_s": median(dec[name]),
                }
        start = end
    keys = [str(n) for n in lengths]
    speed = lambda k, what: out["all_full"][k][what] / out["shared"][k][what]
    return {
        "layer_pattern": model.plan.pattern,
        "num_layers": model.plan.num_layers,
        "num_full_layers": model.plan.num_full_layers,
        "index_topk": model.config.index_topk,
        "context_lengths": list(lengths),
        "chunk": chunk,
        "repeats": repeats,
        "shared": out["shared"],
        "all_full": out["all_full"],
        "prefill_speedup": {k: speed(k, "prefill_s") for k in keys},
        "prefill_chunk_speedup": {k: speed(k, "last_chunk_s") for k in keys},
        "decode_speedup": {k: speed(k, "decode_s") for k in keys},
    }
