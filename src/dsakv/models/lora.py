"""LoRA adapters (PEFT's `save_pretrained` format) served per request over one base model.

Why this shape. Every adaptable `ShardedLinear` of a target decoder layer holds `max_loras`
slots (`SlotWeights`): A `[S·R, in]` and B·scaling `[out, S·R]`, slot s in rows (columns)
s·R .. s·R + r, zero where an adapter has no weights or a smaller rank. A step computes
`x · A_allᵀ` for every slot at once, keeps each token's own slot's columns (a mask built
once per step: a base token keeps none, so its delta is exactly 0 and its output that of
the base layer), and expands through `B_all`: two small GEMMs per layer whatever the mix
of adapters in the batch, each token's delta its own, the same code on CPU and CUDA
(vLLM's punica kernels gather each token's slot; the mask stands in for that gather).
The weights stay untouched, so base requests run beside LoRA ones and an adapter is
loaded or dropped without a weight update. Only the modules --lora-target-modules names
(default all: `target_suffixes`) hold slots, the others no memory and no per-step work; an
adapter adapting another is refused.

The routed experts have slots too (`RoutedSlots`): per expert of this rank, gate, up and
down each A `[E_r, S·R, in]` and B·scaling `[E_r, out, S·R]` (gate and up apart, so an
adapter whose experts' gate and up have distinct A's needs no rank 2r). The tokens whose
slot holds expert weights run the experts one GEMM pair per chosen expert plus the masked
low-rank terms (`RoutedSlots.experts`); the others (base tokens, adapters without expert
weights) the backend's op, their numerics (batch invariant on CUDA) and a step of them
alone its speed unchanged. Two adapter formats are read: vLLM's / transformers 4's
per-expert modules (`mlp.experts.{e}.gate_proj` ...: any subset, the rest zero), and PEFT's
`target_parameters` on the fused `mlp.experts.gate_up_proj` `[E, 2I, H]` and `down_proj`
`[E, H, I]` (`ParamWrapper`: lora_A `[r·E, in]` rows expert-major, lora_B `[out, r·E]`
columns rank-major; the gate and up slots take the same A_e and B_e's gate / up rows).

Adapters are read and checked here (`read_adapter`: one `DsakvError` naming the problem),
each rank reading its own slices of A (row-parallel layers: its input columns) or B
(column-parallel: its output rows), so a partial delta is reduced with the base output.
kv_b_proj is never run as a linear: MLA absorbs W_uk into the latent query (`absorb_q`)
and applies W_uv to the latent output, so its slots (`LatentSlots`) add the delta on both
sides: `q_nope·B_k·A` to the latent query, `(o_lat·Aᵀ)·B_vᵀ` to the output. A shared
layer's indexer keys are skipped (dsakv builds no indexer there: elision holds for
adapters too), and so are the MTP layer's (the draft runs base weights; verification
keeps outputs exact). Which adapter sits in which slot is the engine's decision
(`dsakv.engine.lora`); `LoraSlots` fills the slots a step's table names from the host
copies this rank holds.

Under --tp that split leaves the other half whole on every rank: a column-parallel layer's
A, a row-parallel one's B, the routed experts' gate / up A `[E_r, S·R, H]` and down B
`[E_r, H, S·R]` above all. --fully-sharded-loras (vLLM's, after S-LoRA: `RankSplit`) splits
those too, over the ranks that split the base weight (every rank for attention and the
MLPs, an expert group's moe_tp ranks for its experts): a column-parallel layer holds R / n
of each slot's A rows and all-gathers its shrink `[T, S·R / n]` before B; a row-parallel
one holds out / n of B's rows, reduces its partial shrink `[T, S·R]` and adds only its
rows to the output its caller reduces anyway. One small collective per adapted layer (per
MoE layer: one for gate and up together, one for down). The replicated layers (q_a_proj,
kv_a_proj_with_mqa, the indexer's) stay whole, as vLLM's replicated LoRA layers, and so
does kv_b_proj's A (MLA multiplies it by this rank's heads' latents only).
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dsakv.distributed.parallel import ParallelState
from dsakv.errors import DsakvError, is_int, is_number, load_json
from dsakv.kernels.torch_ops import expert_groups, per_head, widened

from .moe import Experts, MoE
from .parallel_layers import ShardedLinear

log = logging.getLogger(__name__)

# The MLPs' projections: the dense MLP's, the shared experts' and the routed experts' (their
# slots' names: `model.layers.{i}.mlp.experts.{p}`); and PEFT's fused params in the order it
# nests their `ParamWrapper`s: a module's parameters in registration order (transformers'
# experts register gate_up_proj first), each wrapping the last, so with both targeted
# gate_up_proj's keys are the inner `experts.base_layer.*`.
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
FUSED = ("gate_up_proj", "down_proj")
ATTENTION = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
INDEXER = ("wq_b", "wk", "weights_proj")
# What a decoder layer's adapter may target, by the module's name inside the layer.
TARGETS = frozenset(
    [f"self_attn.{m}" for m in ATTENTION]
    + [f"self_attn.indexer.{m}" for m in INDEXER]
    + [f"mlp.{m}" for m in PROJECTIONS]
    + [f"mlp.shared_experts.{m}" for m in PROJECTIONS]
)
# --lora-target-modules' names (SGLang's): the module-name suffixes PEFT's target_modules
# (and its per-expert keys) use, a name covering every module so named; gate_up_proj (the
# fused experts' param) gate and up, `all` every one
TARGET_MODULES = (*ATTENTION, *INDEXER, *PROJECTIONS)
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(.+)\.lora_([AB])\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d{1,9})\.(.+)$")  # (bounded: `int` of its number)
# A routed experts' key: per expert (`experts.3.up_proj`) or fused (`experts`, nested under
# `base_layer`s)
_EXPERTS = re.compile(
    r"^mlp\.experts(?:\.(\d{1,9})\.(gate_proj|up_proj|down_proj)|((?:\.base_layer)*))$"
)
# A target_parameters entry PEFT matches to an experts' fused param: a dotted suffix of
# `model.layers.{i}.mlp.experts.{gate_up_proj|down_proj}`
_FUSED_TARGET = re.compile(
    r"^(?:(?:(?:(?:(?:model\.)?layers\.)?\d+\.)?mlp\.)?experts\.)?(?:gate_up_proj|down_proj)$"
)


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """One adapter as this rank holds it: per adapted module (its name in the model), this
    rank's slices of A `[r, in]` and B·scaling `[out, r]`, on the host in the slot dtype.
    `digest`: of its files, what the prefix cache tells its KV apart by."""

    path: str
    digest: str
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_adapter(path: str, model: nn.Module, max_rank: int) -> LoraAdapter:
    """The PEFT adapter at `path` checked against `model` (this rank's `DSAForCausalLM`):
    its config (LORA, no DoRA, bias, modules_to_save or fan_in_fan_out; ranks up to
    `max_rank`), every tensor's module (one its slots' --lora-target-modules names), shape
    and values (finite); a `DsakvError` naming the problem."""
    folder = Path(path)

    def refuse(why: str) -> DsakvError:
        return DsakvError(f"LoRA adapter {path}: {why}")

    if not folder.is_dir():
        raise refuse("not a directory (a PEFT adapter folder is needed)")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise refuse(f"no {name} (dsakv reads PEFT's save_pretrained safetensors format)")
    # Read once: the digest (what the prefix cache tells its KV apart by: alpha scales as
    # the weights do) is of the very bytes that are parsed.
    try:
        raw = {name: (folder / name).read_bytes() for name in (CONFIG_FILE, WEIGHTS_FILE)}
    except OSError as e:
        raise refuse(f"cannot be read ({e})") from None
    digest = hashlib.sha256(raw[CONFIG_FILE] + raw[WEIGHTS_FILE]).hexdigest()[:32]
    try:  # (`load_json`: too deep a nesting, too long a number are its one error too)
        config = load_json(raw[CONFIG_FILE], f"{CONFIG_FILE} is not valid JSON")
    except DsakvError as e:
        raise refuse(str(e)) from None
    if not isinstance(config, dict):
        raise refuse(f"{CONFIG_FILE} is not a JSON object")
    scaling = _check_config(config, max_rank, refuse)
    targets = _fused_targets(config, refuse)
    try:
        from safetensors.torch import load

        tensors = load(raw[WEIGHTS_FILE])
    except Exception as e:  # noqa: BLE001 - a garbled file, in any of its ways
        raise refuse(f"{WEIGHTS_FILE} cannot be read ({type(e).__name__}: {e})") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name = key.removeprefix(_PREFIX)
        m = _KEY.match(name)
        if m is None:
            raise refuse(f"tensor {key}: {_unsupported_tensor(key)}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise refuse(f"tensor {key} holds NaN or inf")
        pairs.setdefault(m.group(1), {})[m.group(2)] = t
    weights = {}
    routed: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, ab in sorted(pairs.items()):
        m = _LAYER.match(name)
        if m is not None and _EXPERTS.match(m.group(2)):
            routed.setdefault(int(m.group(1)), {})[m.group(2)] = _pair(name, ab, refuse)
            continue
        linear = _target(model, name, refuse)
        if linear is None:
            continue  # a shared layer's indexer, the MTP layer's
        a, b = _pair(name, ab, refuse)
        r = _rank(name, a, b, full_shape(linear), max_rank, refuse)
        weights[name] = own_slices(linear, a, b * scaling(name, r), slot_dtype(model, name))
    for layer, keys in sorted(routed.items()):
        weights.update(_routed_weights(model, layer, keys, targets, scaling, max_rank, refuse))
    _check_targeted(weights, model, refuse)
    if (slots := getattr(model, "lora", None)) is not None:  # (--fully-sharded-loras' parts)
        weights = {name: slots.own(name, a, b) for name, (a, b) in weights.items()}
    return LoraAdapter(str(path), digest, weights)


def _check_targeted(weights: dict, model: nn.Module, refuse) -> None:
    """Every module the adapter adapts holds slots: --lora-target-modules names it."""
    slots = getattr(model, "lora", None)
    targets = frozenset(TARGET_MODULES) if slots is None else slots.targets
    outside = [name for name in sorted(weights) if name.rsplit(".", 1)[1] not in targets]
    if outside:
        needs = sorted({name.rsplit(".", 1)[1] for name in outside})
        raise refuse(
            f"{outside[0]}: not among --lora-target-modules ({', '.join(sorted(targets))}): "
            f"this adapter needs {', '.join(needs)} there too (or all)"
        )


def _pair(name: str, ab: dict[str, torch.Tensor], refuse) -> tuple[torch.Tensor, torch.Tensor]:
    if set(ab) != {"A", "B"}:
        raise refuse(f"{name} has lora_{'A' if 'A' in ab else 'B'} without its pair")
    return ab["A"], ab["B"]


def _rank(
    name: str,
    a: torch.Tensor,
    b: torch.Tensor,
    shape: tuple[int, int],
    max_rank: int,
    refuse,
    experts: int = 1,
) -> int:
    """The rank of `name`'s lora_A and lora_B, checked against its base weight `shape`
    `[out, in]`; `experts` > 1: PEFT's fused form, A `[r·E, in]` and B `[out, r·E]`."""
    out, inp = shape
    rows = a.shape[0] if a.dim() == 2 else 0  # (a 0-dim tensor has no shape[0])
    if rows == 0 or rows % experts or b.dim() != 2 or a.shape[1] != inp or b.shape != (out, rows):
        r, base = "r", f"[{out}, {inp}]"
        if experts > 1:
            r, base = f"r·{experts}", f"[{experts}, {out}, {inp}] ({experts} experts)"
        raise refuse(
            f"{name}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit its base "
            f"weight {base} (need [{r}, {inp}] and [{out}, {r}]: another base model?)"
        )
    r = rows // experts
    if r > max_rank:
        raise refuse(f"{name} has rank {r}, more than --max-lora-rank {max_rank}")
    return r


def _routed_weights(
    model: nn.Module,
    layer: int,
    keys: dict[str, tuple[torch.Tensor, torch.Tensor]],
    targets: Sequence[str],
    scaling,
    max_rank: int,
    refuse,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Layer `layer`'s routed-expert adapter keys (`keys`: by their name after
    `model.layers.{layer}.`, either format) as its gate, up and down slots' weights: this
    rank's experts' A `[E_r, r, in]` and B·scaling `[E_r, out, r]` (zero where the adapter
    has none), sliced as its base weights are; `{}` on the MTP layer."""
    prefix = f"model.layers.{layer}.mlp.experts"
    if layer >= model.plan.num_layers:
        return {}  # the MTP layer: the draft runs base weights
    if layer not in model.model.parts.layers:
        return {}  # another pipeline stage's layer: that stage reads its weights
    mlp = model.model.layers[layer].mlp  # (by its number: a stage holds some layers)
    if not isinstance(mlp, MoE):
        raise refuse(f"{prefix}: layer {layer} has no routed experts (a dense MLP)")
    experts, per_expert, nested = mlp.experts, {}, {}
    for sub, ab in keys.items():
        m = _EXPERTS.match(sub)
        if m.group(2) is None:
            nested[m.group(3).count(".")] = ab  # (how many base_layers deep)
        elif int(m.group(1)) >= experts.num_experts:
            raise refuse(
                f"{prefix}.{m.group(1)}: no expert {m.group(1)} (layer {layer} has experts "
                f"0..{experts.num_experts - 1}: another base model?)"
            )
        else:
            per_expert.setdefault(m.group(2), {})[int(m.group(1))] = ab
    if per_expert and nested:
        raise refuse(f"{prefix}: both per-expert keys and target_parameters' fused keys")
    args = (prefix, experts, scaling, max_rank, refuse)
    stacked = _per_expert(per_expert, *args) if per_expert else _fused(nested, targets, *args)
    (i0, i1), weights = experts.inter_range, {}
    for proj, (a, b) in stacked.items():
        if proj == "down_proj":  # (row-parallel: this rank's intermediate columns of A)
            a = a[..., i0:i1]
        else:
            b = b[:, i0:i1]
        weights[f"{prefix}.{proj}"] = _own_copy(a, model.dtype), _own_copy(b, model.dtype)
    return weights


def _per_expert(by_proj: dict, prefix: str, experts: Experts, scaling, max_rank: int, refuse):
    """vLLM's per-expert keys (`by_proj[proj][e]`: A `[r, in]`, B `[out, r]`) stacked over
    this rank's experts at their largest rank, zero where an expert has none."""
    (first, last), stacked = experts.expert_range, {}
    inter, h = experts.intermediate, experts.hidden_size
    for proj, by_expert in by_proj.items():
        out, inp = (h, inter) if proj == "down_proj" else (inter, h)
        ranks = {
            x: _rank(f"{prefix}.{x}.{proj}", a, b, (out, inp), max_rank, refuse)
            for x, (a, b) in by_expert.items()
        }
        r = max(ranks.values())
        a_all, b_all = torch.zeros(last - first, r, inp), torch.zeros(last - first, out, r)
        for x, (a, b) in by_expert.items():
            if first <= x < last:
                a_all[x - first, : ranks[x]] = a
                b_all[x - first, :, : ranks[x]] = b * scaling(f"{prefix}.{x}.{proj}", ranks[x])
        stacked[proj] = a_all, b_all
    return stacked


def _fused(
    nested: dict, targets: Sequence[str], prefix: str, experts: Experts, scaling, max_rank, refuse
):
    """PEFT's fused keys (`nested[depth]`: `base_layer`s deep) as gate, up and down stacks
    over this rank's experts. Which key is which param: the order PEFT nests their wrappers
    in (`FUSED`), over the params target_parameters names on this layer, as PEFT matches."""
    params = [p for p in FUSED if any(_suffix(f"{prefix}.{p}", t) for t in targets)]
    if sorted(nested) != list(range(len(params))):
        names = [f"{prefix}{'.base_layer' * d}" for d in sorted(nested)]
        raise refuse(
            f"{prefix}: lora weights under {names} do not match target_parameters' "
            f"{params or 'no fused param'} of this layer (one level per param, as PEFT nests them)"
        )
    e, (first, last), stacked = experts.num_experts, experts.expert_range, {}
    inter, h = experts.intermediate, experts.hidden_size
    for depth, (a, b) in nested.items():
        param = params[len(params) - 1 - depth]
        out, inp = (h, inter) if param == "down_proj" else (2 * inter, h)
        name = f"{prefix}.{param}"
        r = _rank(name, a, b, (out, inp), max_rank, refuse, experts=e)
        a_e = a.reshape(e, r, inp)[first:last]  # (rows expert-major)
        b_e = b.reshape(out, r, e).permute(2, 0, 1)[first:last] * scaling(name, r)  # (rank-major)
        if param == "down_proj":
            stacked["down_proj"] = a_e, b_e
        else:  # (gate rows first, as in the base weight)
            stacked["gate_proj"], stacked["up_proj"] = (a_e, b_e[:, :inter]), (a_e, b_e[:, inter:])
    return stacked


def _suffix(key: str, target: str) -> bool:
    """Whether PEFT's target_parameters entry `target` names parameter `key`."""
    return key == target or key.endswith(f".{target}")


def _fused_targets(config: dict, refuse) -> list[str]:
    """The config's target_parameters: the routed experts' fused params only."""
    targets = config.get("target_parameters") or []
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise refuse("target_parameters must be a list of parameter names")
    for t in targets:
        if not _FUSED_TARGET.match(t):
            raise refuse(
                f"target_parameters {t!r}: only the routed experts' fused "
                "mlp.experts.gate_up_proj and mlp.experts.down_proj can be adapted"
            )
    return targets


def _check_config(config: dict, max_rank: int, refuse) -> Any:
    """What dsakv serves of PEFT's LoraConfig; returns `scaling(module, r)`."""
    if config.get("peft_type") != "LORA":
        raise refuse(f"peft_type is {config.get('peft_type')!r}, not LORA")
    refused = (
        (config.get("use_dora"), "use_dora (DoRA) is not supported"),
        (config.get("bias", "none") != "none", f"bias {config.get('bias')!r} is not supported"),
        (config.get("lora_bias"), "lora_bias is not supported"),
        (config.get("modules_to_save"), "modules_to_save is not supported (full module copies)"),
        (config.get("fan_in_fan_out"), "fan_in_fan_out is not supported"),
        (config.get("alora_invocation_tokens"), "activated LoRA (aLoRA) is not supported"),
        (config.get("use_bdlora"), "block-diagonal LoRA (use_bdlora) is not supported"),
        (config.get("arrow_config"), "Arrow routing (arrow_config) is not supported"),
        (config.get("layer_replication"), "layer_replication is not supported"),
    )
    for bad, why in refused:
        if bad:
            raise refuse(why)
    r, alpha = config.get("r"), config.get("lora_alpha", 8)
    ranks = config.get("rank_pattern") or {}
    alphas = config.get("alpha_pattern") or {}
    if not isinstance(ranks, dict) or not isinstance(alphas, dict):
        raise refuse("rank_pattern and alpha_pattern must be objects")
    for v in (r, *ranks.values()):  # (each tensor's rank is checked against max_rank:
        if not is_int(v) or v < 1:  # a pattern that matches no module sizes nothing)
            raise refuse(f"rank {v!r} is not an integer >= 1")
    for v in (alpha, *alphas.values()):
        if not (is_number(v) and abs(v) < 1e300):  # (the config read as Python's: NaN too)
            raise refuse(f"lora_alpha {v!r} is not a finite number")
    for key in (*ranks, *alphas):
        try:
            _regex(key)
        except re.error as e:
            raise refuse(f"rank_pattern / alpha_pattern key {key!r}: not a regex ({e})") from None
    rslora = bool(config.get("use_rslora"))

    def scaling(module: str, rank: int) -> float:
        key = _pattern(alphas, module)
        a = alpha if key is None else alphas[key]
        return a / math.sqrt(rank) if rslora else a / rank

    return scaling


def _pattern(patterns: dict, module: str) -> str | None:
    """PEFT's `get_pattern_key`: the first pattern the module's name ends with."""
    return next((p for p in patterns if _regex(p).match(module)), None)


def _regex(pattern: str) -> re.Pattern:
    """A rank_pattern / alpha_pattern key as PEFT matches it (a module's name ending in it)."""
    return re.compile(rf"(.*\.)?({pattern})$")


def _unsupported_tensor(key: str) -> str:
    if "lora_magnitude_vector" in key:
        return "DoRA (use_dora) is not supported"
    if ".bias" in key:
        return "a LoRA bias is not supported"
    if "modules_to_save" in key:
        return "modules_to_save is not supported"
    if "lora_embedding" in key:
        return "embed_tokens is not supported"
    return "not a LoRA A/B weight"


def _target(model: nn.Module, name: str, refuse) -> ShardedLinear | None:
    """The module an adapter's `name` adapts in `model`; None where dsakv skips it (a shared
    layer's indexer, the MTP layer)."""
    m = _LAYER.match(name)
    if m is None:
        what = "embed_tokens / lm_head" if re.search(r"embed|lm_head", name) else "this module"
        raise refuse(f"{name}: {what} cannot be adapted (decoder layers' projections only)")
    layer, sub = int(m.group(1)), m.group(2)
    if sub not in TARGETS:
        known = ", ".join([*sorted(TARGETS), "mlp.experts.{e}.{gate,up,down}_proj"])
        raise refuse(f"{name}: not a module dsakv can adapt ({known})")
    plan = model.plan  # (the one place that decides which layers run an indexer)
    if layer >= plan.num_layers:
        return None  # the MTP layer: the draft runs base weights
    if layer not in model.model.parts.layers:
        return None  # another pipeline stage's layer: that stage reads its weights
    if sub.startswith("self_attn.indexer.") and not plan.runs_indexer(layer):
        return None  # a shared layer: no indexer here, for adapters either
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise refuse(f"{name}: the base model has no such module") from None


def full_shape(linear: ShardedLinear) -> tuple[int, int]:
    """The checkpoint's `[out, in]` of a layer that may hold a slice of it."""
    out, inp, s = linear.out_features, linear.in_features, linear.shard
    if s is not None:
        out, inp = (s.full, inp) if s.dim == 0 else (out, s.full)
    return out, inp


def own_slices(
    linear: ShardedLinear, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's A and B as its base weight is sliced: B's rows (column-parallel), A's
    columns (row-parallel: its partial delta is reduced with the base output)."""
    s = linear.shard
    if s is not None and s.dim == 0:
        b = b[s.start : s.end]
    elif s is not None:
        a = a[:, s.start : s.end]
    return _own_copy(a, dtype), _own_copy(b, dtype)


def _own_copy(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` as a rank holds it: in `dtype`, contiguous, in storage of its own (a view of a
    slice would keep the whole tensor in host memory)."""
    t = t.to(dtype).contiguous()
    return t.clone() if t.untyped_storage().nbytes() > t.nbytes else t


def slot_dtype(model: nn.Module, name: str) -> torch.dtype:
    """The dtype layer `name`'s input comes in: the model's compute dtype, fp32 for the
    indexer's weights_proj (kept fp32, as the reference keeps it)."""
    return torch.float32 if name.endswith("weights_proj") else model.dtype


@dataclass(frozen=True)
class RankSplit:
    """--fully-sharded-loras: a layer's slots split over the `parts` ranks that split its base
    weight (this rank the `index`-th, `parallel.all_gather_run`'s run). `rank_rows`
    (column-parallel): each holds R / parts of every slot's A rows, the shrinks gathered;
    else (row-parallel) out / parts of B's rows, the partial shrinks summed first."""

    parallel: ParallelState
    parts: int
    index: int
    rank_rows: bool

    def gather(self, z: torch.Tensor, slots: int) -> torch.Tensor:
        """Every rank's shrink `[..., S·R / parts]` as every slot's R columns `[..., S·R]`
        (slot s: rank 0's R / parts columns of it, then rank 1's, ...)."""
        *lead, width = z.shape
        every = self.parallel.all_gather_run(z, self.parts)  # [parts, ..., S·R / parts]
        every = every.view(self.parts, *lead, slots, width // slots).movedim(0, -2)
        return every.reshape(*lead, width * self.parts)

    def reduce(self, z: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's partial shrink `z` (an all-reduce where the run is every
        rank)."""
        if self.parts == self.parallel.tp_size:
            return self.parallel.all_reduce(z)
        return self.parallel.all_gather_run(z, self.parts).sum(0)


class SlotWeights:
    """One layer's `max_loras` slots of A `[S·R, in]` and B·scaling `[out, S·R]`; the step's
    token mask (`LoraSlots.mask`) picks each token's slot (module docstring). `shape`: the
    base weight's `(out, in)`, or `(E_r, out, in)` for routed experts (`RoutedSlots`: A
    `[E_r, S·R, in]`, B `[E_r, out, S·R]`). `shard` (--fully-sharded-loras): A
    `[S·R / n, in]` (`rank`: R / n rows per slot) or B `[out / n, S·R]`."""

    def __init__(
        self,
        slots: LoraSlots,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        shard: RankSplit | None = None,
    ) -> None:
        *lead, out, inp = shape
        self.shard, self.rank = shard, slots.max_rank  # (`rank`: A's rows per slot here)
        if shard is not None and shard.rank_rows:
            self.rank //= shard.parts
        elif shard is not None:
            out //= shard.parts
        self.a = torch.zeros(*lead, slots.max_loras * self.rank, inp, dtype=dtype, device=device)
        self.b = torch.zeros(
            *lead, out, slots.max_loras * slots.max_rank, dtype=dtype, device=device
        )
        self.slots = slots
        self.filled = [False] * slots.max_loras  # whether each slot holds weights here

    def active(self) -> bool:
        """Whether a slot this step's tokens use holds weights here (else their delta is 0)."""
        return any(self.filled[s] for s in self.slots.used)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mask = self.slots.mask
        if mask is None or not self.active():  # (no delta to add in this step)
            return y
        if mask.shape[0] != x.shape[0]:
            raise ValueError(f"LoRA mask has {mask.shape[0]} rows for {x.shape[0]} tokens")
        z, shard = F.linear(x, self.a.to(x.dtype)), self.shard
        if shard is not None and shard.rank_rows:
            z = shard.gather(z, self.slots.max_loras)
        z = torch.where(mask, z, 0)
        if shard is None or shard.rank_rows:
            return y + F.linear(z, self.b.to(x.dtype))
        # (y: this step's own output, a partial sum the layer's caller reduces: this rank's
        # rows of the delta are added to it, the others' by their ranks)
        n = self.b.shape[-2]
        y.narrow(-1, shard.index * n, n).add_(F.linear(shard.reduce(z), self.b.to(x.dtype)))
        return y

    def own(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An adapter's A `[..., r, in]` and B `[..., out, r]` (as the base weight's split
        leaves them) as this rank's slots hold them: under `shard` its R / n rows of A
        (the rank padded to R with zeros) or its out / n rows of B."""
        shard = self.shard
        if shard is None:
            return a, b
        if shard.rank_rows:
            whole = a.new_zeros(*a.shape[:-2], self.slots.max_rank, a.shape[-1])
            whole[..., : a.shape[-2], :] = a
            r0 = shard.index * self.rank
            return _own_copy(whole[..., r0 : r0 + self.rank, :], a.dtype), b
        n = self.b.shape[-2]
        return a, _own_copy(b[..., shard.index * n : (shard.index + 1) * n, :], b.dtype)

    def fill(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Slot `slot` holds `weights` (None: zeros)."""
        r0, c0 = slot * self.rank, slot * self.slots.max_rank  # (A's rows, B's columns)
        self.a[..., r0 : r0 + self.rank, :].zero_()
        self.b[..., c0 : c0 + self.slots.max_rank].zero_()
        self.filled[slot] = weights is not None
        if weights is not None:
            a, b = weights
            self.a[..., r0 : r0 + a.shape[-2], :].copy_(a)
            self.b[..., c0 : c0 + b.shape[-1]].copy_(b)


class LatentSlots(SlotWeights):
    """kv_b_proj's slots. MLA never runs kv_b as a linear (W_uk is absorbed into the query,
    W_uv applied to the latent output `o_lat`), so its delta `B·A` (B's rows per head:
    B_k `[nope, S·R]`, then B_v `[v, S·R]`) is added on both sides: `query` adds
    `(q_nope·B_k)·A` to the latent query; `w_uv` hands the backend W_uv with every slot's
    A as extra rows of each head, so its own W_uv product also returns `z = o_lat·Aᵀ` (no
    kernel changes), and `output` adds `z·B_vᵀ`. Each token keeps its own slot's columns
    (the step mask): a base token's delta is exactly 0 and its W_uv rows are W_uv's."""

    def __init__(
        self, linear: ShardedLinear, slots: LoraSlots, dtype: torch.dtype, heads: int, nope: int
    ) -> None:
        shape = (linear.out_features, linear.in_features)
        super().__init__(slots, shape, dtype, linear.weight.device)
        self.heads, self.nope = heads, nope

    def _mask(self) -> torch.Tensor | None:
        """The step's token mask `[T, 1, S·R]`; None when no adapter of the step's tokens
        holds kv_b weights (nothing to add)."""
        mask = self.slots.mask
        return None if mask is None or not self.active() else mask[:, None]

    def _b(self, x: torch.Tensor) -> torch.Tensor:
        return self.b.to(x.dtype).view(self.heads, -1, self.b.shape[1])

    def query(self, q_nope: torch.Tensor, q_lat: torch.Tensor) -> torch.Tensor:
        """The latent query `[T, H, kv_lora]` of W_uk + B_k·A."""
        mask = self._mask()
        if mask is None:
            return q_lat
        b_k = self._b(q_nope)[:, : self.nope]  # [H, nope, S·R]
        z = torch.bmm(q_nope.transpose(0, 1), b_k).transpose(0, 1)  # [T, H, S·R]
        return q_lat + torch.where(mask, z, 0) @ self.a.to(q_lat.dtype)

    def w_uv(self, w_uv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """W_uv `[H, v, kv_lora]` (as stored), or with every slot's A below each head's
        rows `[H, v + S·R, kv_lora]` in `dtype` while `output` has a delta to add."""
        if self._mask() is None:
            return w_uv
        a = self.a.to(dtype).expand(w_uv.shape[0], *self.a.shape)
        return torch.cat([widened(w_uv, a), a], dim=1)

    def output(self, out: torch.Tensor, v: int) -> torch.Tensor:
        """The per-head output `[T, H, v]` from the backend's `[T, H, v (+ S·R)]`."""
        mask = self._mask()
        if mask is None or out.shape[-1] == v:
            return out
        b_v = self._b(out)[:, self.nope :]  # [H, v, S·R]
        return out[..., :v] + per_head(torch.where(mask, out[..., v:], 0), b_v)


class RoutedSlots:
    """A MoE layer's routed experts' slots: gate, up and down, those of `projections`
    (`SlotWeights` with this rank's experts leading; None: not targeted, no delta), and the
    expert loop that adds their masked deltas."""

    def __init__(
        self,
        experts: Experts,
        slots: LoraSlots,
        dtype: torch.dtype,
        projections: Collection[str],
    ) -> None:
        # (sizes from the experts' own, not their weights' shapes: FP8 weights kept packed
        # have rows of their packed width)
        (first, last), (i0, i1) = experts.expert_range, experts.inter_range
        e, h, n = last - first, experts.hidden_size, i1 - i0
        device = experts.down_proj.device
        parts, index = experts.intermediate // n, i0 // n  # (the expert group's moe_tp ranks)

        def held(proj: str, shape: tuple[int, ...], column: bool) -> SlotWeights | None:
            if proj not in projections:
                return None
            shard = slots.rank_split(parts, index, column)
            return SlotWeights(slots, shape, dtype, device, shard)

        self.gate, self.up = held("gate_proj", (e, n, h), True), held("up_proj", (e, n, h), True)
        self.down = held("down_proj", (e, h, n), False)
        self.slots = slots

    def projections(self) -> dict[str, SlotWeights]:
        """The targeted projections' slots, by name."""
        held = zip(PROJECTIONS, (self.gate, self.up, self.down), strict=True)
        return {proj: s for proj, s in held if s is not None}

    def __call__(
        self, experts: Experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """`experts`' output for the step: the tokens whose adapter holds expert weights here
        through the LoRA-aware loop, the others (base tokens, adapters without expert
        weights) through the backend's op, so their output is the base layer's (and a step
        with none of the former runs the op alone, its numerics and speed unchanged)."""
        filled = zip(*(s.filled for s in self.projections().values()), strict=True)
        split = self.slots.split([any(f) for f in filled])
        if split is None:
            return experts.base(x, ids, weights)
        if self.slots.mask.shape[0] != x.shape[0]:
            raise ValueError(
                f"LoRA mask has {self.slots.mask.shape[0]} rows for {x.shape[0]} tokens"
            )
        adapted, base, mask = split
        args = (experts.gate_up_proj, experts.down_proj, experts.expert_range[0])
        if base.shape[0] == 0:
            return self.experts(x, ids, weights, *args, mask)
        out = torch.empty_like(x)
        out[adapted] = self.experts(x[adapted], ids[adapted], weights[adapted], *args, mask)
        out[base] = experts.base(x[base], ids[base], weights[base])
        return out

    def experts(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        first: int,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """`torch_ops.experts_loop`'s sum with each token's own slot's low-rank terms on gate
        and up (before the activation) and on down (`mask`: the tokens' rows of the step
        mask). Under moe_tp, down's A holds this rank's intermediate columns: a partial
        delta, reduced with the base output. (`widened` unpacks FP8 weights kept packed.)
        Sharded (--fully-sharded-loras): gate's and up's shrinks of every (token, expert) pair
        are gathered first, in one collective; down's partial ones are summed after the
        loop, in one, and each rank adds its rows of down's delta."""
        last = first + gate_up.shape[0]
        out = torch.zeros_like(x)
        groups = list(expert_groups(ids, weights, first, last))
        pairs = ids.numel()  # (rows of the pair buffers: the same on every rank)
        shrunk = self._gathered(x, groups, first, pairs)
        down_shard = self.down is not None and self.down.shard is not None
        down_z = x.new_zeros(pairs, self.down.b.shape[-1]) if down_shard else None

        def delta(
            s: SlotWeights | None,
            i: int,
            z: torch.Tensor,
            m: torch.Tensor,
            rows: slice,
            gathered: torch.Tensor | None = None,  # (its shrink, gathered: `_gathered`)
        ) -> torch.Tensor | int:
            if s is None:  # (not targeted)
                return 0
            zr = F.linear(z, s.a[i].to(z.dtype)) if gathered is None else gathered[rows]
            return F.linear(torch.where(m, zr, 0), s.b[i].to(z.dtype))

        at = 0  # (this expert's rows of the pair buffers)
        for e, tok, we in groups:
            i, xs, m, rows = e - first, x[tok], mask[tok], slice(at, at + tok.shape[0])
            gate, up = F.linear(xs, widened(gate_up[i], x)).chunk(2, dim=-1)
            gate = gate + delta(self.gate, i, xs, m, rows, shrunk.get(self.gate))
            up = up + delta(self.up, i, xs, m, rows, shrunk.get(self.up))
            act = F.silu(gate) * up
            y = F.linear(act, widened(down[i], x))
            if down_z is None:
                y = y + delta(self.down, i, act, m, rows)
            else:
                down_z[rows] = torch.where(m, F.linear(act, self.down.a[i].to(x.dtype)), 0)
            out.index_add_(0, tok, (y * we[:, None]).to(out.dtype))
            at = rows.stop
        if down_z is not None:
            down_z, n = self.down.shard.reduce(down_z), self.down.b.shape[-2]
            own = out.narrow(-1, self.down.shard.index * n, n)  # (this rank's rows of H)
            at = 0
            for e, tok, we in groups:
                rows = slice(at, at + tok.shape[0])
                y = F.linear(down_z[rows], self.down.b[e - first].to(x.dtype))
                own.index_add_(0, tok, (y * we[:, None]).to(out.dtype))
                at = rows.stop
        return out

    def _gathered(
        self, x: torch.Tensor, groups: list, first: int, pairs: int
    ) -> dict[SlotWeights, torch.Tensor]:
        """Sharded gate and up (--fully-sharded-loras): their shrinks `[pairs, S·R]` of every
        (token, expert) pair, in `groups`' order, all-gathered in one collective, by their
        slots; `{}` unsharded."""
        held = [s for s in (self.gate, self.up) if s is not None and s.shard is not None]
        if not held:
            return {}
        z = x.new_zeros(len(held), pairs, held[0].a.shape[-2])
        at = 0
        for e, tok, _ in groups:
            xs = x[tok]
            for j, s in enumerate(held):
                z[j, at : at + tok.shape[0]] = F.linear(xs, s.a[e - first].to(x.dtype))
            at += tok.shape[0]
        z = held[0].shard.gather(z, self.slots.max_loras)
        return {s: z[j] for j, s in enumerate(held)}


class LoraSlots:
    """A model's adapter slots (`SlotWeights` on every adaptable layer of its target layers
    that `targets`, --lora-target-modules, names: the others hold none, and an adapter
    adapting them is refused) and the adapters this rank holds, by the engine's id:
    `prepare` fills the slots a step names and builds its token mask. `fully_sharded`
    (--fully-sharded-loras): the slots split over the ranks as `RankSplit` says."""

    def __init__(
        self,
        model: nn.Module,
        max_loras: int,
        max_rank: int,
        targets: Sequence[str] = ("all",),
        fully_sharded: bool = False,
    ) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.targets = target_suffixes(targets)
        self.parallel: ParallelState = model.parallel
        self.fully_sharded = fully_sharded and self.parallel.tp_size > 1
        if self.fully_sharded:
            check_fully_sharded(max_rank, self.parallel.tp_size, model.config.hidden_size)
        self.adapters: dict[int, LoraAdapter] = {}
        self.resident = [0] * max_loras  # adapter id per slot (0: empty)
        self.mask: torch.Tensor | None = None
        self.used: frozenset[int] = frozenset()  # the slots the step's tokens use
        self._token_slots: torch.Tensor | None = None  # each token's slot (-1: base), host
        self._splits: dict[tuple[bool, ...], tuple[torch.Tensor, ...]] = {}  # this step's `split`s
        self.layers: dict[str, SlotWeights] = {}
        self.device = model.device
        self._cols = torch.arange(max_loras * max_rank, device=self.device) // max_rank  # slot
        for name, linear in adaptable(model):
            if name.rsplit(".", 1)[1] not in self.targets:
                continue
            dtype = slot_dtype(model, name)
            if name.endswith("kv_b_proj"):
                attn = model.get_submodule(name.removesuffix(".kv_b_proj"))
                holder = LatentSlots(linear, self, dtype, attn.n_heads, attn.nope)
            else:
                shape, shard = (linear.out_features, linear.in_features), None
                if (base := linear.shard) is not None:  # (replicated layers stay whole)
                    parts, index = base.full // base.size, base.start // base.size
                    shard = self.rank_split(parts, index, column=base.dim == 0)
                holder = SlotWeights(self, shape, dtype, linear.weight.device, shard)
            linear.lora = self.layers[name] = holder
        routed_targets = self.targets.intersection(PROJECTIONS)
        for i, layer in held_layers(model):  # (not the MTP layer's)
            if isinstance(layer.mlp, MoE) and routed_targets:
                experts = layer.mlp.experts
                routed = experts.lora = RoutedSlots(experts, self, model.dtype, routed_targets)
                for proj, holder in routed.projections().items():
                    self.layers[f"model.layers.{i}.mlp.experts.{proj}"] = holder
        log.info(
            "LoRA slots: %.2f MiB on this rank (%d × rank %d%s)",
            self.nbytes / 2**20, max_loras, max_rank,
            f", fully sharded over {self.parallel.tp_size} ranks" if self.fully_sharded else "",
        )  # fmt: skip

    @property
    def nbytes(self) -> int:
        """The bytes of every slot this rank holds."""
        return sum(t.nbytes for t in self.tensors())

    def rank_split(self, parts: int, index: int, column: bool) -> RankSplit | None:
        """A layer's `RankSplit` over `parts` ranks under --fully-sharded-loras (None: its
        slots stay whole)."""
        if not self.fully_sharded or parts == 1:
            return None
        return RankSplit(self.parallel, parts, index, column)

    def own(self, name: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `name`'s A and B of an adapter as this rank's slots hold them
        (`SlotWeights.own`); a layer without slots: as they are (`read_adapter` refuses it)."""
        holder = self.layers.get(name)
        return (a, b) if holder is None else holder.own(a, b)

    def prepare(self, step: tuple[Sequence[int], Sequence[int]] | None, lens: Sequence[int]):
        """Before a forward: `step` = (the adapter id in each slot, each request's slot,
        -1 for the base model), `lens` each request's tokens; None: no LoRA request."""
        self._splits = {}
        if step is None or all(s < 0 for s in step[1]):
            self.mask, self.used, self._token_slots = None, frozenset(), None
            return
        table, slots = step
        for s, lora_id in enumerate(table):
            if self.resident[s] != lora_id:
                adapter = self.adapters.get(lora_id)
                for name, layer in self.layers.items():
                    layer.fill(s, adapter.weights.get(name) if adapter is not None else None)
                self.resident[s] = lora_id if adapter is not None else 0
        self.used = frozenset(s for s in slots if s >= 0)
        self._token_slots = torch.tensor(slots).repeat_interleave(torch.tensor(lens))
        per_token = self._token_slots.to(self.device)
        self.mask = self._cols[None] == per_token[:, None]

    def split(
        self, holds: Sequence[bool]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The step's tokens whose slot `holds` weights (a layer's, per slot) apart from the
        others: (their rows, the other rows, their rows of the mask), on the device; None
        when no token's slot holds any. Found on the host, where the slots are known, and
        copied without waiting on the device (no sync); once per step for each `holds`."""
        if not any(holds[s] for s in self.used):
            return None
        key = tuple(holds)
        if key not in self._splits:
            adapted = torch.tensor([*key, False])[self._token_slots]  # (slot -1: the False)
            rows, other = (
                r.nonzero().flatten().to(self.device, non_blocking=True)
                for r in (adapted, ~adapted)
            )
            self._splits[key] = rows, other, self.mask[rows]
        return self._splits[key]

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every slot's A and B (what sleep mode stashes beside the model's buffers)."""
        for layer in self.layers.values():
            yield from (layer.a, layer.b)

    def drop(self, lora_id: int) -> None:
        """Forget an adapter (unloaded, no request left on it); its slot is refilled when
        another adapter takes it."""
        self.adapters.pop(lora_id, None)


def check_fully_sharded(max_rank: int, tp: int, hidden_size: int | None = None) -> None:
    """--fully-sharded-loras' refusal: each slot's R (vLLM asserts the same) and, with the
    model, the hidden size (row-parallel B's output rows) must divide over --tp's ranks
    (their moe_tp runs then too)."""
    if max_rank % tp:
        raise DsakvError(
            f"--fully-sharded-loras splits each adapter slot's rank over the ranks: "
            f"--max-lora-rank {max_rank} is not divisible by --tp {tp}"
        )
    if hidden_size is not None and hidden_size % tp:
        raise DsakvError(
            f"--fully-sharded-loras splits o_proj's and down_proj's B rows over the ranks: "
            f"the hidden size {hidden_size} is not divisible by --tp {tp}"
        )


def target_suffixes(modules: Sequence[str]) -> frozenset[str]:
    """The module-name suffixes (`TARGET_MODULES`) --lora-target-modules `modules` covers; a
    `DsakvError` naming one dsakv cannot adapt, with the valid names."""
    covers = {m: (m,) for m in TARGET_MODULES}
    covers |= {"gate_up_proj": PROJECTIONS[:2], "all": TARGET_MODULES}
    out: set[str] = set()
    for m in modules:
        if m not in covers:
            raise DsakvError(
                f"--lora-target-modules {m!r} is not a module dsakv can adapt (valid: "
                f"{', '.join(covers)})"
            )
        out.update(covers[m])
    if not out:
        raise DsakvError("--lora-target-modules needs at least one module (or all)")
    return frozenset(out)


def adaptable(model: nn.Module) -> Iterator[tuple[str, ShardedLinear]]:
    """Every layer an adapter may target in `model`'s target layers, by checkpoint name."""
    for i, layer in held_layers(model):
        for sub, mod in layer.named_modules():
            if sub in TARGETS and isinstance(mod, ShardedLinear):
                yield f"model.layers.{i}.{sub}", mod


def held_layers(model: nn.Module) -> Iterator[tuple[int, nn.Module]]:
    """The target layers this rank's pipeline stage holds, each with its number in the
    model (`model.layers.{i}`): all of them with one stage."""
    return zip(model.model.parts.layers, model.target_layers)


def adapter_slots(module: nn.Module) -> LoraSlots | None:
    """The `LoraSlots` whose slots `module` holds some of (None: it holds none); its `used`
    says whether a step's tokens run adapter deltas through them."""
    held = (m.lora for m in module.modules() if getattr(m, "lora", None) is not None)
    return next((h.slots for h in held), None)


def adapting(slots: LoraSlots | None) -> bool:
    """Whether this step's tokens run adapter deltas through a module's `slots`
    (`adapter_slots`; None: it holds none): its native forms, which have no slots, then give
    way to its eager ones; a step of base rows alone runs native, as without --enable-lora."""
    return slots is not None and bool(slots.used)
