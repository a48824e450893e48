"""Throughput at a fixed KV budget, elided vs dense index-K, plus a transformers baseline.

Two engines (elided and dense) take the same seeded workload at once and are stepped
alternately in one process, so machine noise (other jobs on shared cores) hits both
alike. Each engine's clock is the time spent inside its own `step()` calls ("busy
time"): throughput is tokens / busy time, and TTFT is the busy time until a request's
first token (every request arrives at t = 0, an offline saturating load).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from statistics import mean
from typing import Any

import torch
from tqdm.auto import tqdm

from dsakv.engine import Engine, EngineConfig, SamplingParams
from dsakv.engine.launch import create_engine


@dataclass(frozen=True)
class Workload:
    """Seeded prompts (token ids) with per-request output lengths; greedy, ignore_eos."""

    prompts: list[list[int]]
    max_tokens: list[int]

    @classmethod
    def make(
        cls,
        n: int,
        prompt_lens: tuple[int, int],
        output_lens: tuple[int, int],
        seed: int = 0,
        vocab: int = 256,
    ) -> Workload:
        rng = random.Random(seed)
        prompts = [
            [rng.randrange(vocab) for _ in range(rng.randint(*prompt_lens))] for _ in range(n)
        ]
        return cls(prompts, [rng.randint(*output_lens) for _ in range(n)])

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def mean_total_tokens(self) -> float:
        return mean(len(p) + t for p, t in zip(self.prompts, self.max_tokens))

    def params(self, i: int) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens[i], temperature=0.0, ignore_eos=True)


def make_engine(model: str, *, elide: bool, num_pages: int, page_size: int, **kw: Any) -> Engine:
    """By default the mission's layout, fp8_e4m3 latent + fp8 index-K, elided or dense."""
    config = EngineConfig(
        model=model,
        kv_cache_dtype=kw.pop("kv_cache_dtype", "fp8_e4m3"),
        index_k_dtype=kw.pop("index_k_dtype", "fp8"),
        elide_index_k=elide,
        num_pages=num_pages,
        page_size=page_size,
        device=kw.pop("device", "cpu"),
        **kw,
    )
    engine = create_engine(config)
    # Warm-up (one-time allocations, first-call overheads) before anything is timed.
    engine.add_request(list(range(1, 9)), SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    return engine


def run_interleaved(
    engines: dict[str, Engine], work: Workload, desc: str = "throughput"
) -> dict[str, dict[str, Any]]:
    """Give every engine the whole workload, then step them alternately until all finish."""
    before = {name: e.counters() for name, e in engines.items()}
    reqs = {
        name: [e.add_request(p, work.params(i)) for i, p in enumerate(work.prompts)]
        for name, e in engines.items()
    }
    busy = dict.fromkeys(engines, 0.0)
    ttft: dict[str, dict[int, float]] = {name: {} for name in engines}
    steps: dict[str, list[tuple[int, int, float]]] = {name: [] for name in engines}
    total = work.num_requests * len(engines)
    with tqdm(total=total, desc=desc, unit="req", leave=False) as bar:
        while any(e.has_unfinished() for e in engines.values()):
            for name, e in engines.items():
                if not e.has_unfinished():
                    continue
                computed = e.stats.computed_tokens
                t0 = time.perf_counter()
                out = e.step()
                dt = time.perf_counter() - t0
                busy[name] += dt
                steps[name].append((len(out), e.stats.computed_tokens - computed, dt))
                for r in out:
                    if len(r.output_ids) == 1:
                        ttft[name][r.rid] = busy[name]
                bar.update(sum(1 for r in out if r.finished))
    results = {}
    for name, e in engines.items():
        c, b = e.counters(), before[name]
        out_tokens = c["output_tokens"] - b["output_tokens"]
        prompt_tokens = c["prompt_tokens"] - b["prompt_tokens"]
        decode = [(n, dt) for n, computed, dt in steps[name] if n and computed == n]
        results[name] = {
            "num_pages": c["pages_total"],
            "pool_tokens": c["pages_total"] * e.config.page_size,
            "bytes_per_token": c["bytes_per_token"],
            "pool_bytes": e.pool.nbytes,
            "peak_running_requests": c["peak_running_requests"],
            "mean_decode_batch": mean(n for n, _ in decode) if decode else 0.0,
            "requests": work.num_requests,
            "prompt_tokens": prompt_tokens,
            "output_tokens": out_tokens,
            "computed_tokens": c["computed_tokens"] - b["computed_tokens"],
            "retractions": c["retractions"] - b["retractions"],
            "steps": len(steps[name]),
            "busy_s": busy[name],
            "output_tokens_per_s": out_tokens / busy[name],
            "total_tokens_per_s": (out_tokens + prompt_tokens) / busy[name],
            "mean_ttft_s": mean(ttft[name].values()) if ttft[name] else None,
            "decode_step_fit": fit_step_cost(decode),
            "_outputs": [list(r.output_ids) for r in reqs[name]],
        }
    return results


def fit_step_cost(points: list[tuple[int, float]]) -> dict[str, float] | None:
    """Least-squares `step_s = fixed_s + per_request_s × batch` over decode-only steps.

    When `per_request_s × batch` dwarfs `fixed_s`, tokens/s barely depends on how many
    requests run at once, so more concurrency (what elision buys) buys little speed.
    """
    if len(points) < 3 or len({n for n, _ in points}) < 2:
        return None
    xs, ys = [float(n) for n, _ in points], [dt for _, dt in points]
    mx, my = mean(xs), mean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    return {"fixed_s": my - b * mx, "per_request_s": b, "num_steps": len(points)}


def transformers_generate(
    model: str, prompts: list[list[int]], new_tokens: int, pad_id: int, threads: int | None = None
) -> dict[str, Any]:
    """transformers' `generate` on the same checkpoint (fp32, CPU), one left-padded batch."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    kw = dict(do_sample=False, pad_token_id=pad_id)

    def gen(n: int, rows: slice) -> torch.Tensor:
        return hf.generate(
            input_ids=ids[rows], attention_mask=mask[rows], max_new_tokens=n, min_new_tokens=n, **kw
        )

    with torch.inference_mode():
        gen(2, slice(0, 1))  # warm-up
        t0 = time.perf_counter()
        out = gen(new_tokens, slice(None))
        seconds = time.perf_counter() - t0
    generated = (out.shape[1] - width) * len(prompts)
    return {
        "batch_size": len(prompts),
        "padded_prompt_len": width,
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens": generated,
        "seconds": seconds,
        "output_tokens_per_s": generated / seconds,
        "total_tokens_per_s": (generated + sum(len(p) for p in prompts)) / seconds,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def compare(elided: dict[str, Any], dense: dict[str, Any]) -> dict[str, float | None]:
    keys = ("peak_running_requests", "output_tokens_per_s", "total_tokens_per_s", "mean_ttft_s")
    return {k: ratio(elided[k], dense[k]) for k in keys}


def strip_private(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if not k.startswith("_")}


def token_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of aligned greedy tokens that agree between two runs of one workload."""
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / max(1, len(pairs))
