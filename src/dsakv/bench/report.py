"""The human side of `dsakv bench`: a summary table and PNG charts (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _f(v: Any, fmt: str = ",.2f") -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, int):
        return f"{v:,}"
    return format(v, fmt)


def _row(name: str, *cells: Any, fmt: str = ",.2f") -> str:
    return f"{name:34}" + "".join(f"{_f(c, fmt):>16}" for c in cells)


def summary(r: dict[str, Any]) -> str:
    lines = [
        f"dsakv bench ({'quick' if r['meta']['quick'] else 'default'} sizes, "
        f"{'every section' if r['meta'].get('full') else 'core sections; --full for all'}) — "
        f"{r['meta']['model']}, torch threads {r['meta']['torch_threads']}, "
        f"{r['meta'].get('wall_s', 0):.0f} s"
    ]
    c = r.get("capacity")
    if c:
        g, b = c["glm_5_2"], c["bench_model"]
        lines += [
            "",
            "1. capacity (fp8_e4m3 latent + fp8 index-K)",
            _row("", "dense", "elided", "gain %"),
            _row(
                "GLM-5.2 bytes/token (+1 draft)",
                g["bytes_per_token_dense"],
                g["bytes_per_token"],
                100 * (g["bytes_per_token_dense"] / g["bytes_per_token"] - 1),
            ),
            _row(
                "GLM-5.2 bytes/token (target)",
                g["bytes_per_token_target_dense"],
                g["bytes_per_token_target"],
                100 * (g["bytes_per_token_target_dense"] / g["bytes_per_token_target"] - 1),
            ),
            _row(
                f"GLM-5.2 tokens ({g['kv_budget_gib_dense']}/{g['kv_budget_gib']} GiB)",
                g["max_total_num_tokens_dense"],
                g["max_total_num_tokens"],
                g["token_gain_pct"],
            ),
        ]
        for key, s in g["same_budget"].items():
            lines.append(
                _row(
                    f"GLM-5.2 tokens, same {key.replace('_gib', ' GiB')}",
                    s["max_total_num_tokens_dense"],
                    s["max_total_num_tokens"],
                    s["token_gain_pct"],
                )
            )
        lines += [
            _row(
                "bench model bytes/token",
                b["bytes_per_token_dense"],
                b["bytes_per_token"],
                100 * (b["bytes_per_token_dense"] / b["bytes_per_token"] - 1),
            ),
            _row(
                f"bench model tokens ({b['kv_budget_gib'] * 1024:.1f} MiB)",
                b["max_total_num_tokens_dense"],
                b["max_total_num_tokens"],
                b["token_gain_pct"],
            ),
            f"  GLM-5.2 matches the reference figures: {_f(g['matches_reference'])}",
        ]
    t = r.get("throughput")
    if t:
        e, d, q = t["elided"], t["dense"], t["ratios"]
        lines += [
            "",
            f"2. throughput at a fixed KV budget ({t['kv_budget_gib'] * 1024:.1f} MiB, "
            f"{t['workload']['requests']} requests, greedy)",
            _row("", "dense", "elided", "elided/dense"),
            _row(
                "pool tokens",
                d["pool_tokens"],
                e["pool_tokens"],
                e["pool_tokens"] / d["pool_tokens"],
            ),
            _row(
                "peak running requests",
                d["peak_running_requests"],
                e["peak_running_requests"],
                q["peak_running_requests"],
            ),
            _row("mean decode batch", d["mean_decode_batch"], e["mean_decode_batch"], None),
            _row(
                "output tokens/s",
                d["output_tokens_per_s"],
                e["output_tokens_per_s"],
                q["output_tokens_per_s"],
            ),
            _row(
                "total tokens/s",
                d["total_tokens_per_s"],
                e["total_tokens_per_s"],
                q["total_tokens_per_s"],
            ),
            _row(
                "mean TTFT (s, engine time)", d["mean_ttft_s"], e["mean_ttft_s"], q["mean_ttft_s"]
            ),
            _row("retractions", d["retractions"], e["retractions"], None),
        ]
        fit_e, fit_d = e.get("decode_step_fit"), d.get("decode_step_fit")
        if fit_e and fit_d:
            lines.append(
                f"  decode step ≈ fixed + per-request × batch: dense {fit_d['fixed_s'] * 1e3:.0f} ms"
                f" + {fit_d['per_request_s'] * 1e3:.1f} ms/req, elided {fit_e['fixed_s'] * 1e3:.0f}"
                f" ms + {fit_e['per_request_s'] * 1e3:.1f} ms/req"
            )
        hf, eq = t.get("transformers"), t["equal_pages"]
        if not t.get("dsakv_fp32_cache"):  # not `full`: no transformers baseline
            lines.append(
                _row(
                    "equal pages: elided/dense tok/s",
                    None,
                    None,
                    eq["ratios"]["output_tokens_per_s"],
                )
            )
    if t and t.get("dsakv_fp32_cache"):
        hf, eq = t.get("transformers"), t["equal_pages"]
        lines += [
            "",
            f"   vs transformers ({eq['workload']['requests']} requests at once, "
            f"{eq['workload']['new_tokens']} new tokens each)",
            _row("", "transformers", "dsakv", "dsakv/hf"),
            _row(
                "output tokens/s (fp32 cache)",
                hf and hf["output_tokens_per_s"],
                t["dsakv_fp32_cache"]["output_tokens_per_s"],
                t["vs_transformers_ratio"],
            ),
            _row(
                "total tokens/s (fp32 cache)",
                hf and hf["total_tokens_per_s"],
                t["dsakv_fp32_cache"]["total_tokens_per_s"],
                t["vs_transformers_total_ratio"],
            ),
            _row(
                "output tokens/s (fp8 cache)",
                hf and hf["output_tokens_per_s"],
                eq["elided"]["output_tokens_per_s"],
                t["vs_transformers_ratio_fp8_cache"],
            ),
            _row(
                "peak running requests",
                hf and hf["batch_size"],
                eq["elided"]["peak_running_requests"],
                None,
            ),
            _row(
                "equal pages: elided/dense tok/s", None, None, eq["ratios"]["output_tokens_per_s"]
            ),
        ]
    ic = r.get("indexcache")
    if ic:
        lines += [
            "",
            f"3. IndexCache compute ({ic['num_full_layers']}/{ic['num_layers']} layers run the "
            f"indexer vs all; index_topk {ic['index_topk']}; chunk {ic['chunk']})",
            _row("context", "prefill full s", "prefill shr s", "speedup", fmt=",.3f")
            + f"{'decode speedup':>16}",
        ]
        for k in map(str, ic["context_lengths"]):
            lines.append(
                _row(
                    k,
                    ic["all_full"][k]["prefill_s"],
                    ic["shared"][k]["prefill_s"],
                    ic["prefill_speedup"][k],
                    fmt=",.3f",
                )
                + f"{ic['decode_speedup'][k]:>16.3f}"
            )
    p = r.get("parity")
    if p:
        a = p["fp8_vs_fp32"]
        lines += [
            "",
            "4. parity",
            f"  elided == dense greedy tokens: {_f(p['elided_equals_dense'])} "
            f"({p['elided_vs_dense']['requests']} requests, {p['elided_vs_dense']['tokens']:,} tokens, "
            f"{p['elided_vs_dense']['past_topk_requests']} of them past index_topk "
            f"{p['elided_vs_dense']['index_topk']});"
            f" saturated runs identical: {_f(p['saturated_runs_identical'])}",
        ]
        if a is not None:
            lines.append(
                f"  FP8 vs fp32 cache top-1 agreement: {a['top1_agreement']:.4f} over "
                f"{a['compared']:,} decode predictions ({a['sequences']} × {a['decode_steps']} "
                "steps)"
            )
    m = r.get("memory")
    if m:
        lines += [
            "",
            f"5. KV memory movement ({m['tokens']} tokens, {m['model']})",
            _row("", "dense GB/s", "elided GB/s", "time speedup"),
        ]
        for op in ("move", "backup", "load"):
            lines.append(
                _row(op, m["dense"][op]["gb_per_s"], m["elided"][op]["gb_per_s"], m["speedup"][op])
            )
    sp = r.get("mtp")
    if sp:
        passes = sp["target_passes_per_output_token"]
        tps, alone = sp["output_tokens_per_s"], sp["one_at_a_time"]
        lines += [
            "",
            f"6. speculative decoding, MTP then n-gram lookup ({sp['requests']} requests, "
            f"up to {sp['speculative_num_steps']} drafts per step, "
            f"{_f(sp.get('drafts_per_verify'), '.2f')} per verification)",
            _row("", "no MTP", "MTP", "ratio"),
            _row("output tokens/s", tps["base"], tps["mtp"], sp["output_tokens_per_s_ratio"]),
            _row(
                "  one request at a time",
                alone["output_tokens_per_s"]["base"],
                alone["output_tokens_per_s"]["mtp"],
                alone["output_tokens_per_s_ratio"],
            ),
            _row("target passes per output token", passes["base"], passes["mtp"], None, fmt=".3f"),
            f"  mean acceptance length {_f(sp['mean_acceptance_length'], '.3f')}; draft "
            f"acceptance {_f(sp['draft_acceptance_rate'], '.3f')}; greedy token agreement "
            f"{sp['greedy_token_agreement']:.4f}",
        ]
        ng = sp.get("ngram")
        if ng:
            lines += [
                _row("", "no drafts", "n-gram", "ratio"),
                _row(
                    "output tokens/s",
                    tps["base"],
                    ng["output_tokens_per_s"],
                    ng["output_tokens_per_s_ratio"],
                ),
                _row(
                    "  one request at a time",
                    alone["output_tokens_per_s"]["base"],
                    ng["one_at_a_time_output_tokens_per_s"],
                    ng["one_at_a_time_ratio"],
                ),
                f"  n-gram lookup: mean acceptance length "
                f"{_f(ng['mean_acceptance_length'], '.3f')}; draft acceptance "
                f"{_f(ng['draft_acceptance_rate'], '.3f')}; greedy token agreement "
                f"{ng['greedy_token_agreement']:.4f}",
            ]
    par = r.get("parallel")
    if par:
        n = par["tp"]
        one, many = par["tp1"], par[f"tp{n}"]
        cap = par["capacity"]
        lines += [
            "",
            f"7. ranks ({par['requests']} requests, {par['num_pages_per_rank']} pages per rank)",
            _row("", "tp=1", f"tp={n}", "ratio"),
            _row(
                "output tokens/s",
                one["output_tokens_per_s"],
                many["output_tokens_per_s"],
                par["output_tokens_per_s_ratio"],
            ),
            _row("", "plain TP", "DP attention", "ratio"),
            _row(
                "aggregate peak running",
                cap["plain_tp"]["peak_running_requests"],
                cap["dp_attention"]["peak_running_requests"],
                par["peak_running_ratio"],
            ),
            _row(
                "aggregate pool pages",
                cap["plain_tp"]["pages_total"],
                cap["dp_attention"]["pages_total"],
                None,
            ),
            f"  tp={n} vs tp=1 greedy token agreement: {par['greedy_token_agreement']:.4f}",
        ]
    if r.get("pd"):
        from .pd import summary_lines

        lines += ["", "8. " + summary_lines(r["pd"])[0], *summary_lines(r["pd"])[1:]]
    if r.get("storage"):
        from .storage import summary_lines as storage_lines

        lines += ["", "9. " + storage_lines(r["storage"])[0], *storage_lines(r["storage"])[1:]]
    if r.get("cpu_paths"):
        from .prefill import summary_lines as prefill_lines
        from .serving_rate import summary as serving_summary

        cp = r["cpu_paths"]
        pre = prefill_lines(cp["prefill"])
        lines += ["", "10. CPU paths: `cpu` backend vs today's (`torch`)", "  " + pre[0]]
        lines += ["  " + line for line in pre[1:]]
        for name, d in cp["decode"].items():
            lines += [f"  decode, attention backend {name}:"]
            lines += ["  " + line for line in serving_summary(d).splitlines()]
    tg = r.get("targets")
    if tg:
        lines += ["", "targets"]
        for k, v in tg.items():
            met = "-" if v["met"] is None else ("met" if v["met"] else "MISSED")
            lines.append(f"  {k:28} {_f(v['value'], '.3f'):>10} (target {v['target']}) {met}")
    return "\n".join(lines)


def write_plots(r: dict[str, Any], plot_dir: str) -> list[str]:
    """One PNG per section; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(plot_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[str] = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))

    colors = {"dense": "#9e9e9e", "elided": "#1f77b4"}
    c = r.get("capacity")
    if c:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        g = c["glm_5_2"]
        for ax, (title, d, e, unit) in zip(
            axes,
            [
                (
                    "GLM-5.2 bytes/token (+1 draft)",
                    g["bytes_per_token_dense"],
                    g["bytes_per_token"],
                    "B",
                ),
                (
                    "GLM-5.2 pool tokens (reference budgets)",
                    g["max_total_num_tokens_dense"],
                    g["max_total_num_tokens"],
                    "tokens",
                ),
            ],
        ):
            ax.bar(["dense", "elided"], [d, e], color=[colors["dense"], colors["elided"]])
            ax.set_title(title)
            ax.set_ylabel(unit)
            for i, v in enumerate((d, e)):
                ax.annotate(f"{v:,}", (i, v), ha="center", va="bottom")
        save(fig, "capacity.png")
    t = r.get("throughput")
    if t:
        metrics = [
            ("peak_running_requests", "peak running requests"),
            ("output_tokens_per_s", "output tokens/s"),
            ("total_tokens_per_s", "total tokens/s"),
            ("mean_ttft_s", "mean TTFT (s)"),
        ]
        fig, axes = plt.subplots(1, len(metrics), figsize=(14, 3.6))
        for ax, (key, title) in zip(axes, metrics):
            vals = [t["dense"][key] or 0, t["elided"][key] or 0]
            ax.bar(["dense", "elided"], vals, color=[colors["dense"], colors["elided"]])
            ax.set_title(title)
        fig.suptitle(f"fixed KV budget {t['kv_budget_gib'] * 1024:.1f} MiB")
        save(fig, "throughput.png")
    ic = r.get("indexcache")
    if ic:
        xs = ic["context_lengths"]
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for name, style in (("all_full", "o--"), ("shared", "o-")):
            axes[0].plot(xs, [ic[name][str(x)]["prefill_s"] for x in xs], style, label=name)
        axes[0].set_xlabel("context length")
        axes[0].set_ylabel("prefill time (s)")
        axes[0].legend()
        axes[1].plot(xs, [ic["prefill_speedup"][str(x)] for x in xs], "o-", label="prefill")
        axes[1].plot(xs, [ic["decode_speedup"][str(x)] for x in xs], "s-", label="decode")
        axes[1].axhline(1.0, color="gray", lw=0.5)
        axes[1].set_xlabel("context length")
        axes[1].set_ylabel("speedup vs all-full")
        axes[1].legend()
        save(fig, "indexcache.png")
    m = r.get("memory")
    if m:
        ops = ["move", "backup", "load"]
        fig, ax = plt.subplots(figsize=(6, 4))
        width = 0.38
        for i, name in enumerate(("dense", "elided")):
            ax.bar(
                [j + (i - 0.5) * width for j in range(3)],
                [m[name][op]["tokens_per_s"] for op in ops],
                width,
                label=name,
                color=colors[name],
            )
        ax.set_xticks(range(3), ops)
        ax.set_ylabel("tokens/s")
        ax.legend()
        save(fig, "memory.png")
    return written
