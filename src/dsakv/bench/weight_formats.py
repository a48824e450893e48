"""Weights as the checkpoint stores them: decode and prefill tok/s of one model held three
ways on a CPU: widened to fp32 at load (`--dtype float32`), its bf16 checkpoint as stored
(`--dtype auto`), and its FP8-block checkpoint as stored (`init-tiny --weights fp8`, the
layers' projections e4m3 with 128 × 128 block scales; `--dtype auto`).

All engines are built once; each round times every workload on each engine in turn, so
machine noise lands on all of them; the first round warms every shape up and is not timed;
medians are reported. Also checked: `auto` gives `float32`'s tokens and logprobs, bit for
bit, on each checkpoint (the FP8 one against its own fp32 widening: quantising changes the
model, so it is not compared with the bf16 one).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from dsakv.engine import Engine, EngineConfig
from dsakv.models.tiny import default_model_dir

from .determinism import measure_rate


@dataclass(frozen=True)
class WeightFormatSizes:
    prompt_len: int = 128
    decode_tokens: int = 64  # tokens after the first, per request
    batch: int = 32
    rounds: int = 3
    seed: int = 0


DEFAULT = WeightFormatSizes()
QUICK = WeightFormatSizes(decode_tokens=16, batch=8, rounds=1)
# engine name -> (checkpoint weights, --dtype)
ENGINES = {
    "fp32": ("bf16", "float32"),
    "bf16": ("bf16", "auto"),
    "fp8": ("fp8", "auto"),
    "fp8_widened": ("fp8", "float32"),
}


def run_weight_formats_bench(
    preset: str = "glm-bench", *, quick: bool = False, sizes: WeightFormatSizes | None = None
) -> dict[str, Any]:
    sizes = sizes or (QUICK if quick else DEFAULT)
    paths = {w: str(default_model_dir(preset, weights=w)) for w in ("bf16", "fp8")}
    engines = {name: _engine(paths[w], dtype, sizes) for name, (w, dtype) in ENGINES.items()}
    rng = random.Random(sizes.seed)
    work = {
        f"decode_{n}": ([_prompt(rng, sizes.prompt_len) for _ in range(n)], sizes.decode_tokens)
        for n in (1, sizes.batch)
    }
    work["prefill_1"] = ([_prompt(rng, sizes.prompt_len)], 0)
    rates: dict[str, dict[str, list[float]]] = {w: {e: [] for e in engines} for w in work}
    same = {"bf16": True, "fp8": True}
    for r in range(sizes.rounds + 1):  # round 0 warms every shape up, untimed
        for w, (prompts, extra) in work.items():
            outs = {}
            for name, engine in engines.items():
                rate, outs[name] = measure_rate(engine, prompts, extra)
                if r:
                    rates[w][name].append(rate)
            same["bf16"] &= outs["bf16"] == outs["fp32"]
            same["fp8"] &= outs["fp8"] == outs["fp8_widened"]
    out: dict[str, Any] = {
        "models": paths,
        "sizes": asdict(sizes),
        "weight_mib": {
            name: sum(p.numel() * p.element_size() for p in e.runner.model.parameters()) / 2**20
            for name, e in engines.items()
        },
        "tokens_per_s": {},
        "auto_equals_float32": same,
    }
    for w in work:
        med = {e: statistics.median(rates[w][e]) for e in engines}
        out["tokens_per_s"][w] = {**med, "runs": rates[w]}
    return out


def summary_lines(r: dict[str, Any]) -> list[str]:
    names = list(ENGINES)
    lines = [
        f"weights as stored ({r['models']['bf16']} and its fp8 twin), tok/s, medians of "
        f"{r['sizes']['rounds']} alternating round(s)",
        f"{'workload':<12}" + "".join(f"{n:>13}" for n in names) + f"{'bf16/fp32':>11}"
        f"{'fp8/bf16':>10}",
        f"{'weight MiB':<12}" + "".join(f"{r['weight_mib'][n]:>13.1f}" for n in names),
    ]
    for w, t in r["tokens_per_s"].items():
        lines.append(
            f"{w:<12}"
            + "".join(f"{t[n]:>13.1f}" for n in names)
            + f"{t['bf16'] / t['fp32']:>11.2f}{t['fp8'] / t['bf16']:>10.2f}"
        )
    same = r["auto_equals_float32"]
    lines.append(
        f"auto == float32 tokens and logprobs: bf16 checkpoint {same['bf16']}, "
        f"fp8 checkpoint {same['fp8']}"
    )
    return lines


def _engine(path: str, dtype: str, sizes: WeightFormatSizes) -> Engine:
    pages = sizes.batch * (-(-(sizes.prompt_len + sizes.decode_tokens + 2) // 64)) + 4
    return Engine(
        EngineConfig(
            model=path,
            device="cpu",
            dtype=dtype,
            num_pages=pages,
            seed=sizes.seed,
            enable_prefix_cache=False,  # every round computes its prompts
        )
    )


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(n)]
