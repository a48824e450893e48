"""HiSparse at a fixed device KV budget: off, on with dense index-K, on elided (DESIGN.md §13).

Three engines take one seeded long-prompt workload and are stepped alternately (as
`throughput.run_interleaved`). "off" is today's pool (every token's latent and index-K
on the device); the HiSparse engines keep every token's latent in host memory, a hot
buffer per decoding request on the device, and index-K of every logical token on the
device, on every layer (dense) or on the full layers only (elided). On a CPU the
"host -> device" copy is a copy within RAM: the row and byte counts are what a GPU would
move over PCIe, the seconds are not.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dsakv.config import HiSparseConfig, ModelConfig
from dsakv.memory import CacheLayout, plan_capacity, plan_hisparse
from dsakv.memory.capacity import GIB
from dsakv.models.tiny import resolve_model_dir

from . import throughput as tp


@dataclass(frozen=True)
class HiSparseSizes:
    requests: int = 24
    prompt_lens: tuple[int, int] = (448, 576)
    output_lens: tuple[int, int] = (32, 48)
    page_size: int = 16
    # The budget: what the HiSparse-off pool needs for this many mean-sized requests.
    off_requests: float = 4.0
    kv_cache_dtype: str = "fp8_e4m3"
    seed: int = 0


DEFAULT = HiSparseSizes()
QUICK = HiSparseSizes(requests=12, output_lens=(4, 8), off_requests=2.0)
DEFAULT_CONFIG = {"host_to_device_ratio": 4}


def run_hisparse_bench(
    model: str | None = None,
    hisparse_config: str | dict | None = None,
    *,
    quick: bool = False,
    sizes: HiSparseSizes | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Running requests, output tok/s, miss rate and host -> device bytes per output token
    for off / on-dense / on-elided at one device budget, with the planner's prediction."""
    sizes = sizes or (QUICK if quick else DEFAULT)
    HiSparseConfig.read(hisparse_config)  # a typo fails before the model is written
    path = resolve_model_dir(model, "glm-hisparse")
    config = ModelConfig.from_hf(path)
    hs = HiSparseConfig.parse(hisparse_config or DEFAULT_CONFIG, config)
    ps = sizes.page_size
    work = tp.Workload.make(
        sizes.requests, sizes.prompt_lens, sizes.output_lens, sizes.seed, vocab=256
    )
    layouts = {
        elide: CacheLayout.for_model(path, sizes.kv_cache_dtype, "fp8", ps, elide)
        for elide in (True, False)
    }
    off_tokens = sizes.off_requests * (work.mean_total_tokens + ps / 2)
    budget_gib = off_tokens * layouts[True].bytes_per_token / GIB
    plans = {
        "on_dense": plan_hisparse(layouts[False], hs, kv_budget_gib=budget_gib),
        "on_elided": plan_hisparse(layouts[True], hs, kv_budget_gib=budget_gib),
    }
    common = dict(page_size=ps, seed=sizes.seed, device=device)
    common["kv_cache_dtype"] = sizes.kv_cache_dtype
    engines = {
        "off": tp.make_engine(
            path,
            elide=True,
            num_pages=plan_capacity(layouts[True], kv_budget_gib=budget_gib).num_pages,
            **common,
        )
    }
    for name, plan in plans.items():
        engines[name] = tp.make_engine(
            path,
            elide=plan.layout.elide_index_k,
            num_pages=plan.device_tokens // ps,
            enable_hisparse=True,
            hisparse_config=hs.to_dict(),
            **common,
        )
    before = {name: e.counters() for name, e in engines.items()}
    runs = tp.run_interleaved(engines, work, desc="hisparse")
    out: dict[str, Any] = {
        "model": path,
        "sizes": asdict(sizes),
        "hisparse_config": hs.to_dict(),
        "kv_budget_bytes": int(budget_gib * GIB),
        "workload": {
            "requests": work.num_requests,
            "prompt_tokens": sum(map(len, work.prompts)),
            "output_tokens": sum(work.max_tokens),
        },
        "copy_note": "on a CPU host -> device is a copy within RAM",
        "planner": {name: plan.as_dict() for name, plan in plans.items()},
    }
    for name, e in engines.items():
        r = tp.strip_private(runs[name])
        c, b = e.counters(), before[name]
        d = {k: c[k] - b[k] for k in c if k.startswith("hisparse_") and "total" not in k}
        looked = d["hisparse_hits"] + d["hisparse_misses"]
        r.update(
            device_latent_tokens=e.pool.num_latent_tokens,
            logical_tokens=e.pool.num_tokens,
            device_kv_bytes=e.pool.nbytes,
            hits=d["hisparse_hits"],
            misses=d["hisparse_misses"],
            miss_rate=d["hisparse_misses"] / looked if looked else 0.0,
            rows_to_device=d["hisparse_rows_to_device"],
            bytes_to_device_per_output_token=d["hisparse_bytes_to_device"]
            / max(1, r["output_tokens"]),
        )
        out[name] = r
    out["outputs_equal_off"] = {
        name: runs[name]["_outputs"] == runs["off"]["_outputs"] for name in plans
    }
    out["ratios"] = {
        "running_on_elided_vs_off": tp.ratio(
            out["on_elided"]["peak_running_requests"], out["off"]["peak_running_requests"]
        ),
        "running_on_elided_vs_on_dense": tp.ratio(
            out["on_elided"]["peak_running_requests"], out["on_dense"]["peak_running_requests"]
        ),
        "planner_device_tokens_elided_vs_dense": tp.ratio(
            plans["on_elided"].device_tokens, plans["on_dense"].device_tokens
        ),
        "output_tps_on_elided_vs_off": tp.ratio(
            out["on_elided"]["output_tokens_per_s"], out["off"]["output_tokens_per_s"]
        ),
    }
    return out


def summary_lines(r: dict[str, Any]) -> list[str]:
    h = r["hisparse_config"]
    lines = [
        f"HiSparse at a {r['kv_budget_bytes'] / 2**20:.1f} MiB device budget ({r['model']}; "
        f"top_k {h['top_k']}, buffer {h['device_buffer_size']}, ratio "
        f"{h['host_to_device_ratio']}; {r['workload']['requests']} requests, "
        f"{r['workload']['prompt_tokens']} prompt tokens)",
        f"{'':10} {'device slots':>12} {'logical':>8} {'peak run':>8} {'decode batch':>12} "
        f"{'out tok/s':>9} {'miss rate':>9} {'H2D B/out tok':>13}",
    ]
    for name in ("off", "on_dense", "on_elided"):
        x = r[name]
        lines.append(
            f"{name:10} {x['device_latent_tokens']:>12,} {x['logical_tokens']:>8,} "
            f"{x['peak_running_requests']:>8} {x['mean_decode_batch']:>12.1f} "
            f"{x['output_tokens_per_s']:>9.1f} "
            f"{x['miss_rate']:>9.3f} {x['bytes_to_device_per_output_token']:>13,.0f}"
        )
    q = r["ratios"]
    lines.append(
        f"running: elided/off {q['running_on_elided_vs_off']:.2f}×, elided/dense "
        f"{q['running_on_elided_vs_on_dense']:.2f}× (planner's device tokens "
        f"{q['planner_device_tokens_elided_vs_dense']:.2f}×); greedy outputs equal to off: "
        + ", ".join(f"{k} {v}" for k, v in r["outputs_equal_off"].items())
    )
    lines.append(f"({r['copy_note']})")
    return lines
