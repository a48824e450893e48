"""What deterministic inference costs: prefill and decode tok/s at 1 and 32 requests (and
one prompt long enough for a sparse selection), the mode off and on, on one model with the
default caches (fp8 latent, fp8 index-K), on one rank or `tp` (each engine's rank 0 here,
its other ranks in their processes). Both engines are built once; each round times every
workload on each engine in turn (off, on, off, on, ...) so machine noise lands on both;
medians are reported.

A first round warms every shape up and is not timed. Also checked each round: with the
mode on, the first request of the 32-request batch got
exactly the tokens and logprobs it gets alone.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from dsakv.engine import Engine, EngineConfig, SamplingParams
from dsakv.engine.launch import create_engine
from dsakv.models.tiny import resolve_model_dir


@dataclass(frozen=True)
class DeterminismSizes:
    prompt_len: int = 128  # prefill: 1 and `batch` prompts of this length
    long_prompt_len: int = 1024  # and one past glm-bench's index_topk (256): sparse
    decode_prompt_len: int = 16
    decode_tokens: int = 32  # decode: tokens after the first, per request
    batch: int = 32
    rounds: int = 3
    chunked_prefill_size: int = 512
    seed: int = 0


DEFAULT = DeterminismSizes()
QUICK = DeterminismSizes(decode_tokens=8, rounds=1)
MODES = {"off": False, "on": True}


def run_determinism_bench(
    model: str | None = None,
    *,
    quick: bool = False,
    sizes: DeterminismSizes | None = None,
    tp: int = 1,
) -> dict[str, Any]:
    """tok/s per (workload, mode), the on/off ratios, and whether the batched request matched
    its solo run in every round (mode on). Under `tp` > 1 the modes run one after the other
    (a process holds one multi-rank engine at a time), so noise is not shared."""
    sizes = sizes or (QUICK if quick else DEFAULT)
    path = resolve_model_dir(model, "glm-bench")
    rng = random.Random(sizes.seed)
    work = {
        f"prefill_{n}": ([_prompt(rng, sizes.prompt_len) for _ in range(n)], 0)
        for n in (1, sizes.batch)
    }
    work["prefill_1_long"] = ([_prompt(rng, sizes.long_prompt_len)], 0)
    work |= {
        f"decode_{n}": (
            [_prompt(rng, sizes.decode_prompt_len) for _ in range(n)],
            sizes.decode_tokens,
        )
        for n in (1, sizes.batch)
    }
    rates: dict[str, dict[str, list[float]]] = {w: {m: [] for m in MODES} for w in work}
    matched: list[bool] = []
    for modes in [list(MODES)] if tp == 1 else [[m] for m in MODES]:
        engines: dict[str, Engine] = {}
        try:
            for name in modes:
                engines[name] = _engine(path, MODES[name], sizes, tp)
            matched += _time(engines, work, rates, sizes)
        finally:
            for engine in engines.values():
                engine.close()
    out: dict[str, Any] = {"model": path, "tp": tp, "sizes": asdict(sizes), "tokens_per_s": {}}
    for w in work:
        med = {m: statistics.median(rates[w][m]) for m in MODES}
        out["tokens_per_s"][w] = {**med, "on_vs_off": med["on"] / med["off"], "runs": rates[w]}
    out["batched_equals_alone_on"] = all(matched)
    out["within_10_percent"] = all(r["on_vs_off"] >= 0.9 for r in out["tokens_per_s"].values())
    return out


def _time(engines: dict[str, Engine], work: dict, rates: dict, sizes: DeterminismSizes):
    """Every workload on each engine in turn, round after round, into `rates`; whether the
    mode-on engine's batched request matched its solo run, each round."""
    matched = []
    for r in range(sizes.rounds + 1):  # round 0 warms every shape up, untimed
        for w, (prompts, extra) in work.items():
            for name, engine in engines.items():
                rate, outs = measure_rate(engine, prompts, extra)
                if r:
                    rates[w][name].append(rate)
                if name == "on" and w == f"decode_{sizes.batch}":
                    alone = measure_rate(engine, prompts[:1], extra)[1]
                    matched.append(alone[0] == outs[0])
    return matched


def _engine(path: str, on: bool, sizes: DeterminismSizes, tp: int) -> Engine:
    return create_engine(
        EngineConfig(
            model=path,
            device="cpu",
            tp=tp,
            enable_deterministic_inference=on,
            chunked_prefill_size=sizes.chunked_prefill_size,
            num_pages=sizes.batch * (-(-(sizes.prompt_len + sizes.decode_tokens + 2) // 64))
            + sizes.long_prompt_len // 64
            + 4,
            seed=sizes.seed,
            enable_prefix_cache=False,  # every round computes its prompts
        )
    )


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(n)]


def measure_rate(engine: Engine, prompts: list[list[int]], extra: int):
    """Prefill (`extra` 0): prompt tokens per second until every first token. Decode: the
    `extra` tokens after each first token, per second after the last first token."""
    params = SamplingParams(max_tokens=extra + 1, temperature=0.0, ignore_eos=True, logprobs=1)
    reqs = [engine.add_request(p, params) for p in prompts]
    start = time.perf_counter()
    while any(not r.output_ids for r in reqs):
        engine.step()
    first = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    end = time.perf_counter()
    outs = [(r.output_ids, r.logprobs) for r in reqs]
    if extra == 0:
        return sum(map(len, prompts)) / (first - start), outs
    return len(prompts) * extra / (end - first), outs


def summary_lines(r: dict[str, Any]) -> list[str]:
    lines = [
        f"deterministic inference: off vs on ({r['model']}, --tp {r['tp']}, fp8 caches), medians of "
        f"{r['sizes']['rounds']} round(s), "
        + ("the modes alternating" if r["tp"] == 1 else "one mode after the other"),
        f"{'workload':<14}{'off tok/s':>12}{'on tok/s':>12}{'on/off':>9}",
    ]
    for w, t in r["tokens_per_s"].items():
        lines.append(f"{w:<14}{t['off']:>12.1f}{t['on']:>12.1f}{t['on_vs_off']:>9.3f}")
    lines.append(
        f"batched request == alone (on): {r['batched_equals_alone_on']}; "
        f"every workload within 10%: {r['within_10_percent']}"
    )
    return lines
