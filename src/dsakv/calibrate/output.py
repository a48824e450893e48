"""What `dsakv calibrate-pattern` hands back: a text report, a config directory, a chart."""

from __future__ import annotations

import json
from pathlib import Path

from dsakv.config import LayerPlan
from dsakv.errors import DsakvError

from .search import CalibrationResult

# Config keys that also describe a pattern; `indexer_types` alone must decide it.
_PATTERN_KEYS = ("index_topk_pattern", "index_topk_freq", "index_skip_topk_offset", "cli_factor")


def check_config_dir(model_dir: str | Path, out_dir: str | Path) -> tuple[Path, Path]:
    """Fail before a long search, not after it, when `out_dir` cannot take the config."""
    src, out = Path(model_dir).resolve(), Path(out_dir)
    if out.resolve() == src:
        raise DsakvError(f"--write-config {out_dir} is the model directory itself")
    if out.exists() and not out.is_dir():
        raise DsakvError(f"--write-config {out_dir} exists and is not a directory")
    if out.is_dir():
        other = [p.name for p in out.iterdir() if p.name != "config.json" and not p.is_symlink()]
        if other:
            raise DsakvError(f"--write-config {out_dir} is not empty (holds {other[0]})")
        if (out / "config.json").is_symlink():  # e.g. a Hugging Face snapshot: writing
            raise DsakvError(  # through the link would rewrite another model's config
                f"--write-config {out_dir} holds a linked config.json, not one an earlier "
                "--write-config wrote"
            )
    return src, out


def write_config(model_dir: str | Path, out_dir: str | Path, plan: LayerPlan) -> Path:
    """Write `out_dir/config.json`: the model's config with `indexer_types` from `plan` (the
    other pattern keys removed), and symlink every other file of the model directory
    (weights, tokenizer) into `out_dir`, so both transformers and dsakv load it as a model.

    `out_dir` must be new or empty, or hold only a config.json and symlinks (an earlier run).
    """
    src, out = check_config_dir(model_dir, out_dir)
    raw = json.loads((src / "config.json").read_text())
    for key in _PATTERN_KEYS:
        raw.pop(key, None)
    raw["indexer_types"] = list(plan.indexer_types)
    out.mkdir(parents=True, exist_ok=True)
    for entry in sorted(src.iterdir()):
        if entry.name == "config.json" or entry.name.startswith("."):
            continue
        link = out / entry.name
        if link.is_symlink():
            link.unlink()
        link.symlink_to(entry.resolve())
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out


def report_text(r: CalibrationResult) -> str:
    """History table and the chosen pattern, for people."""
    p = r.pricing
    lines = [
        f"reference: {r.reference.num_full_layers} of {r.reference.num_layers} layers run "
        f"their indexer ({r.reference.pattern})",
    ]
    if r.no_indexer_layers:
        lines.append(
            "layers without indexer weights in the checkpoint stay shared: "
            + ", ".join(map(str, r.no_indexer_layers))
        )
    lines += [
        f"data: {r.num_sequences} sequences, {r.num_tokens:,} tokens; "
        f"budget: {r.target_full_layers} full layer(s)",
        f"pricing: latent {p.kv_cache_dtype}, index-K {p.index_k_dtype}, page {p.page_size}, "
        f"{p.draft_layers} draft layer(s), KV budget {p.kv_budget_gib:g} GiB",
        "",
        f"{'full':>4}  {'shared':>6}  {'KL':>11}  {'min overlap':>11}  {'bytes/token':>11}  "
        f"{'max_total_num_tokens':>20}  pattern",
    ]
    for s in r.history:
        shared = "-" if s.shared_layer is None else str(s.shared_layer)
        lines.append(
            f"{s.num_full_layers:>4}  {shared:>6}  {s.kl:>11.4e}  {min(s.overlap):>11.4f}  "
            f"{s.bytes_per_token:>11,}  {s.max_total_num_tokens:>20,}  {s.pattern}"
        )
    f = r.final
    lines += [
        "",
        f"index_topk_pattern: {r.plan.pattern}",
        f"indexer_types: {json.dumps(list(r.plan.indexer_types))}",
        f"kl: {f.kl:.6e}",
        f"bytes_per_token: {f.bytes_per_token:,}",
        f"max_total_num_tokens: {f.max_total_num_tokens:,}",
    ]
    return "\n".join(lines)


def write_plot(r: CalibrationResult, path: str | Path) -> Path:
    """KL and bytes per token against the number of full layers, one point per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    full = [s.num_full_layers for s in r.history]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(full, [s.kl for s in r.history], "o-", color="tab:red")
    ax.set_xlabel("full layers (run their indexer)")
    ax.set_ylabel("mean KL(reference || pattern)", color="tab:red")
    ax.invert_xaxis()
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2 = ax.twinx()
    ax2.plot(full, [s.bytes_per_token for s in r.history], "s--", color="tab:blue")
    ax2.set_ylabel("KV bytes per token", color="tab:blue")
    ax.set_title(f"IndexCache greedy search ({r.num_tokens:,} calibration tokens)")
    fig.tight_layout()
    path = Path(path)
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise DsakvError(f"cannot write the plot to {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return path
