"""Stream a safetensors checkpoint into a `DSAForCausalLM` built on the meta device.

The `LayerPlan` decides what to build; the loader then skips (and counts) the tensors the
plan does not need: indexer tensors of shared layers, and draft/MTP layers
(`model.layers.{i}` with i >= num_hidden_layers). FP8 block-quantised weights
(`*.weight` + `*.weight_scale_inv`) are dequantised on the way in. Routed experts are
accepted per expert (`mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`, what
checkpoints and `save_pretrained` write) or already stacked (`mlp.experts.gate_up_proj`).
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from dsakv.config import LayerPlan, ModelConfig
from dsakv.errors import DsakvError

from .dsa import DSAForCausalLM, keep_fp32

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def load_model(
    path: str | Path,
    plan: LayerPlan | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    **plan_overrides: Any,
) -> tuple[DSAForCausalLM, ModelConfig, LayerPlan]:
    """Build the model the plan describes and fill it from `path`'s safetensors files."""
    path = Path(path)
    config = ModelConfig.from_hf(path)
    if plan is None:
        plan = LayerPlan.from_config(config, **plan_overrides)
    elif plan_overrides:
        raise DsakvError("pass either a LayerPlan or plan overrides, not both")
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise DsakvError(f"unknown dtype {dtype!r} (choose from {', '.join(_DTYPES)})")
        dtype = _DTYPES[dtype]
    with torch.device("meta"):
        model = DSAForCausalLM(config, plan)
    model.to(dtype)
    keep_fp32(model)
    model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _Filler(model, config, plan).load(_checkpoint_files(path))
    return model.eval(), config, plan


def _checkpoint_files(path: Path) -> dict[str, Path]:
    """Tensor name -> file, from `model.safetensors.index.json` or the single file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if single.is_file():
        with safe_open(single, "pt") as f:
            return dict.fromkeys(f.keys(), single)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DsakvError(f"no safetensors checkpoint in {path}")
    out = {}
    for file in files:
        with safe_open(file, "pt") as f:
            out.update(dict.fromkeys(f.keys(), file))
    return out


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", … ({len(names) - limit} more)" if len(names) > limit else "")


class _Filler:
    """Copies checkpoint tensors into the model's parameters and tracks what is filled."""

    def __init__(self, model: DSAForCausalLM, config: ModelConfig, plan: LayerPlan) -> None:
        self.config, self.plan = config, plan
        self.targets: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=True))
        self.targets.update(dict(model.named_buffers()))
        if config.tie_word_embeddings:
            self.targets.pop("lm_head.weight", None)
        experts = config.n_routed_experts
        # How many pieces fill each target: stacked experts fill per expert (and per half).
        self.need = {
            n: 2 * experts
            if n.endswith("experts.gate_up_proj")
            else experts
            if n.endswith("experts.down_proj")
            else 1
            for n in self.targets
        }
        self.got: Counter[str] = Counter()
        self.unexpected: list[str] = []
        self.skipped: Counter[str] = Counter()

    def load(self, files: dict[str, Path]) -> None:
        names = [n for n in files if not n.endswith("_scale_inv")]
        handles: dict[Path, Any] = {}

        def read(name: str) -> torch.Tensor:
            file = files[name]
            if file not in handles:
                handles[file] = safe_open(file, "pt")
            return handles[file].get_tensor(name)

        for name in tqdm(
            sorted(names, key=lambda n: (str(files[n]), n)),
            desc="loading",
            unit="tensor",
            disable=None,
        ):
            if self._skip(name):
                continue
            tensor = read(name)
            scale = name + "_scale_inv"
            if scale in files:
                tensor = _dequant_fp8(tensor, read(scale), self.config)
            self._put(name, tensor)
        handles.clear()
        self._report()

    def _skip(self, name: str) -> bool:
        m = _LAYER.match(name)
        if m is not None:
            layer = int(m.group(1))
            if layer >= self.config.num_hidden_layers:
                self.skipped["draft"] += 1
                return True
            if ".indexer." in name and not self.plan.runs_indexer(layer):
                self.skipped["indexer"] += 1
                return True
        tied_head = self.config.tie_word_embeddings and name == "lm_head.weight"
        return bool(_IGNORED.search(name)) or tied_head

    def _put(self, name: str, tensor: torch.Tensor) -> None:
        m = _EXPERT.match(name)
        if m is not None:
            prefix, e, part = m.group(1), int(m.group(2)), m.group(3)
            target = f"{prefix}.{'down_proj' if part == 'down_proj' else 'gate_up_proj'}"
            param = self.targets.get(target)
            if param is None or e >= param.shape[0]:
                self.unexpected.append(name)
                return
            i = self.config.moe_intermediate_size
            dest = {"gate_proj": param[e, :i], "up_proj": param[e, i:], "down_proj": param[e]}[part]
            self._copy(name, dest, tensor)
            self.got[target] += 1
            return
        param = self.targets.get(name)
        if param is None:
            self.unexpected.append(name)
            return
        self._copy(name, param, tensor)
        self.got[name] += self.need[name]

    @staticmethod
    def _copy(name: str, dest: torch.Tensor, src: torch.Tensor) -> None:
        if tuple(dest.shape) != tuple(src.shape):
            raise DsakvError(
                f"checkpoint tensor {name} has shape {tuple(src.shape)}, model expects {tuple(dest.shape)}"
            )
        with torch.no_grad():
            dest.copy_(src)

    def _report(self) -> None:
        missing = [n for n, k in self.need.items() if self.got[n] < k]
        problems = []
        if missing:
            problems.append(f"{len(missing)} missing tensor(s): {_listing(missing)}")
        if self.unexpected:
            problems.append(
                f"{len(self.unexpected)} unexpected tensor(s): {_listing(self.unexpected)}"
            )
        if problems:
            raise DsakvError("checkpoint does not match the model: " + "; ".join(problems))
        log.info(
            "loaded %d tensors; skipped %d indexer tensors of %d shared layers (plan %s) "
            "and %d draft/MTP tensors",
            sum(self.got.values()),
            self.skipped["indexer"],
            self.plan.num_shared_layers,
            self.plan.pattern,
            self.skipped["draft"],
        )


def _dequant_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, config: ModelConfig
) -> torch.Tensor:
    """Block-wise FP8 weight × its per-block scale (128×128 blocks unless the config says)."""
    q = config.quantization_config or {}
    bm, bn = q.get("weight_block_size") or (128, 128)
    rows, cols = weight.shape
    s = scale_inv.float().repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :cols]
    return weight.float() * s
