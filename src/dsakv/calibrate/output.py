"""What `dsakv calibrate-pattern` hands back: a text report, a config directory, a chart."""

from __future__ import annotations

import json
from pathlib import Path

from dsakv.config import LayerPlan
from dsakv.errors import DsakvError
from dsakv.writable import can_append, can_create_in, write_blocker

from .search import CalibrationResult

# Config keys that also describe a pattern; `indexer_types` alone must decide it.
_PATTERN_KEYS = ("index_topk_pattern", "index_topk_freq", "index_skip_topk_offset", "cli_factor")
# `--plot` formats matplotlib writes with no extra software.
PLOT_FORMATS = (".png", ".pdf", ".svg")


def check_config_dir(model_dir: str | Path, out_dir: str | Path) -> tuple[Path, Path]:
    """Fail before a long search, not after it, when `out_dir` cannot take the config."""
    src, out = Path(model_dir).resolve(), Path(out_dir)
    where = out.resolve()
    if where == src:
        raise DsakvError(f"--write-config {out_dir} is the model directory itself")
    if out.absolute() in Path(model_dir).absolute().parents:  # reached through a link in
        raise DsakvError(  # DIR, which would be removed as an earlier run's link
            f"--write-config {out_dir} holds the model directory {model_dir}"
        )
    if src in where.parents:  # the model's files would include DIR: a link to itself
        raise DsakvError(f"--write-config {out_dir} is inside the model directory {model_dir}")
    if out.is_symlink() and not out.exists():
        raise DsakvError(f"--write-config {out_dir} is a broken link")
    if out.exists() and not out.is_dir():
        raise DsakvError(f"--write-config {out_dir} exists and is not a directory")
    if out.is_dir():
        if (out / "config.json").is_symlink():  # e.g. a Hugging Face snapshot: writing
            raise DsakvError(  # through the link would rewrite another model's config
                f"--write-config {out_dir} holds a linked config.json, not one an earlier "
                "--write-config wrote"
            )
        other = [
            p.name
            for p in out.iterdir()
            if not p.is_symlink() and not (p.name == "config.json" and p.is_file())
        ]
        if other:
            raise DsakvError(f"--write-config {out_dir} is not empty (holds {other[0]})")
        if not can_create_in(out):
            raise DsakvError(f"--write-config {out_dir} cannot be written")
        return src, out
    blocker = write_blocker(out.absolute().parent)
    if blocker is not None and not blocker.is_dir():
        raise DsakvError(f"--write-config {out_dir}: {blocker} is not a directory")
    if blocker is not None:
        raise DsakvError(f"--write-config {out_dir}: cannot create it under {blocker}")
    return src, out


def write_config(model_dir: str | Path, out_dir: str | Path, plan: LayerPlan) -> Path:
    """Write `out_dir/config.json`: the model's config with `indexer_types` from `plan` (the
    other pattern keys removed), and symlink every other file of the model directory
    (weights, tokenizer) into `out_dir`, so both transformers and dsakv load it as a model.

    `out_dir` must be new or empty, or hold only a config.json and symlinks (an earlier run).
    Links not to this model's files are removed: left by a run on another model, they would
    load its weights (e.g. its `model.safetensors.index.json`) under this config.
    """
    src, out = check_config_dir(model_dir, out_dir)
    raw = json.loads((src / "config.json").read_text())
    for key in _PATTERN_KEYS:
        raw.pop(key, None)
    raw["indexer_types"] = list(plan.indexer_types)
    where = out.resolve()
    wanted = {
        entry.name: entry.resolve()
        for entry in sorted(src.iterdir())
        if entry.name != "config.json" and not entry.name.startswith(".")
    }
    # An entry of the model that leads to `out_dir` or above it would link DIR into itself;
    # one that leads into it would point at a link removed below.
    wanted = {
        n: t
        for n, t in wanted.items()
        if t != where and t not in where.parents and where not in t.parents
    }
    out.mkdir(parents=True, exist_ok=True)
    for entry in out.iterdir():
        if entry.is_symlink():  # an earlier run's: check_config_dir let nothing else through
            entry.unlink()
    for name, target in wanted.items():
        (out / name).symlink_to(target)
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


def check_plot_path(path: str | Path) -> Path:
    """The file `write_plot` will write for `path` (matplotlib adds `.png` to a name without
    an extension): refused now, not after a long search, if it cannot be written."""
    given = Path(path)
    out = given if given.suffix else given.with_name(given.name + ".png")
    if out.suffix.lower() not in PLOT_FORMATS:
        raise DsakvError(
            f"--plot {path}: unsupported format {out.suffix} (use {', '.join(PLOT_FORMATS)})"
        )
    for where in (given, out):  # `jdir` would become jdir.png: surely not what was meant
        if where.is_dir():
            raise DsakvError(f"--plot {path}: {where} is a directory; give a file")
    parent = out.absolute().parent
    if not parent.is_dir():
        raise DsakvError(f"--plot {path}: no such directory")
    if not (can_append(out) if out.exists() else can_create_in(parent)):
        raise DsakvError(f"--plot {path}: cannot write {out}")
    return out


def write_plot(r: CalibrationResult, path: str | Path) -> Path:
    """KL and bytes per token against the number of full layers, one point per step;
    returns the file written (see `check_plot_path`)."""
    path = check_plot_path(path)
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
    try:
        fig.savefig(path, dpi=110, format=path.suffix[1:].lower())
    except OSError as e:
        raise DsakvError(f"cannot write the plot to {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return path
