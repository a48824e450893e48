"""A checkpoint folder: which file holds each tensor (what the loader reads) and the
checkpoint's fingerprint over exactly those files (what L3 pages and a PD pair key on)."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

from dsakv.errors import DsakvError, load_json

if TYPE_CHECKING:
    from .model import ModelConfig


class NoCheckpoint(DsakvError):
    """A folder without safetensors files: a config-only one, which `dsakv plan` plans from
    (one it cannot read is a plain `DsakvError`, for plan as for the engine)."""


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Tensor name -> file, from `model.safetensors.index.json` or the single file: what the
    loader reads, and so what `model_identity` digests."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        message = f"{index} is not a safetensors index"
        try:
            text = index.read_text()
        except ValueError as e:  # (not UTF-8)
            raise DsakvError(f"{message}: {type(e).__name__}: {e}") from None
        raw = load_json(text, message)  # (nested too deeply: a RecursionError traceback)
        try:
            return {name: path / file for name, file in raw["weight_map"].items()}
        except (KeyError, TypeError, AttributeError) as e:
            raise DsakvError(f"{message}: {type(e).__name__}: {e}") from None
    single = path / "model.safetensors"
    files = [single] if single.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise NoCheckpoint(f"no safetensors checkpoint in {path}")
    out = {}
    for file in files:
        with open_checkpoint_file(file, "numpy") as f:  # (names only: `dsakv plan` loads no torch)
            out.update(dict.fromkeys(f.keys(), file))
    return out


# (A layer number of at most 9 digits: `int` refuses a tensor name's 5,000-digit one.)
_INDEXER = re.compile(r"model\.layers\.(\d{1,9})\.self_attn\.indexer\.")


def indexer_layers(names: Iterable[str]) -> set[int]:
    """The layers whose indexer weights are among the tensor `names`."""
    return {int(m[1]) for name in names if (m := _INDEXER.match(name))}


def no_indexer_problem(layers: Iterable[int], pattern: str) -> str:
    """Why a layer plan cannot run on a checkpoint without these layers' indexer weights
    (a plan override or a calibrated pattern, usually), and the fix."""
    return (
        f"layer(s) {', '.join(map(str, sorted(layers)))} run their indexer in the layer plan "
        f"{pattern} but the checkpoint holds none for them: make them shared "
        "(--index-topk-pattern)"
    )


def mtp_layer_prefix(path: Path, config: ModelConfig, names: Iterable[str]) -> str:
    """The MTP layer's tensor prefix (`model.layers.{N}.`); a checkpoint with none of its
    tensors is one clear error, which the loader and `dsakv plan` give for a plan with a
    draft layer."""
    n = config.num_hidden_layers
    prefix = f"model.layers.{n}."
    if not any(name.startswith(prefix) for name in names):
        raise DsakvError(
            f"checkpoint {path} has no MTP layer (model.layers.{n}.*; config.json sets "
            f"num_nextn_predict_layers {config.num_nextn_predict_layers}); "
            "speculative decoding needs one"
        )
    return prefix


def open_checkpoint_file(file: Path, framework: str = "pt") -> Any:
    """`safe_open(file)`; a missing, unreadable or corrupt file is one error naming it."""
    try:
        return safe_open(file, framework)
    except (SafetensorError, OSError) as e:
        raise DsakvError(f"cannot read checkpoint file {file}: {e}") from None


# Shards up to this size are hashed whole; a larger one by 64 blocks of 64 KiB spread over
# it (4 MiB read per shard: a 700 GB checkpoint's fingerprint reads 0.6 GB, not 700).
_WHOLE_SHARD = 256 << 20
_SAMPLES, _BLOCK = 64, 1 << 16


def model_identity(model_dir: str | Path) -> str:
    """A fingerprint of a checkpoint: its config.json, its safetensors index and, per file
    the loader reads (`checkpoint_files`: a subfolder's too), its path, size and bytes (all
    of them up to 256 MiB; else the first and last 64 KiB and 64 blocks spread evenly
    between), so two checkpoints with one architecture but other weights (another seed, a
    fine-tune, one tensor patched) differ."""
    path = Path(model_dir)
    h = hashlib.sha256()
    if path.is_file():
        path = path.parent
    for meta in (path / "config.json", path / "model.safetensors.index.json"):
        if meta.is_file():
            h.update(meta.read_bytes())
    for shard in sorted(set(checkpoint_files(path).values())):
        size = shard.stat().st_size
        h.update(f"{os.path.relpath(shard, path)}:{size}".encode())
        with shard.open("rb") as f:
            if size <= _WHOLE_SHARD:
                h.update(f.read())
                continue
            for i in range(_SAMPLES + 1):
                f.seek((size - _BLOCK) * i // _SAMPLES)
                h.update(f.read(_BLOCK))
    return h.hexdigest()[:32]
