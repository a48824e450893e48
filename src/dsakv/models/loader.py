"""Stream a safetensors checkpoint into a `DSAForCausalLM` built on the meta device.

The `LayerPlan` decides what to build; the loader then skips (and counts) the tensors the
plan does not need: indexer tensors of shared layers, and draft/MTP layers
(`model.layers.{i}` with i >= num_hidden_layers) unless the plan has a draft layer, which
then loads `model.layers.{N}` as the MTP layer (`mtp.py`). FP8 block-quantised weights
(`*.weight` + `*.weight_scale_inv`) are dequantised on the way in, or, `as_stored`, kept
as packed FP8 rows (`torch_ops.pack_fp8`) that every op widens where it reads them. Routed
experts are
accepted per expert (`mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`, what
checkpoints and `save_pretrained` write) or already stacked (`mlp.experts.gate_up_proj`).

Under tensor / expert parallelism each rank reads only its own slices
(`safe_open(...).get_slice`), never a whole sharded tensor, and skips the experts other
ranks hold; FP8 scales are read for the 128-blocks that cover the slice. Under pipeline
parallelism it reads only its stage's parts (`DSAForCausalLM.holds`).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch import nn
from tqdm import tqdm

from dsakv.config import LayerPlan, ModelConfig
from dsakv.config.checkpoint import (
    checkpoint_files,
    indexer_layers,
    mtp_layer_prefix,
    no_indexer_problem,
    open_checkpoint_file,
)
from dsakv.distributed.parallel import ParallelState
from dsakv.errors import DsakvError
from dsakv.kernels.torch_ops import (
    WEIGHT_BLOCK,
    pack_fp8,
    packed_width,
    unpack_fp8,
    unpacked_width,
)
from dsakv.memory import allocation_failed, huge_page_empty_like

from .dsa import DSAForCausalLM, keep_fp32, store_matrices
from .moe import Experts
from .mtp import VOCAB_COPIES
from .parallel_layers import Shard

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d{1,9})\.")  # (bounded: `int` of its number)
_EXPERT = re.compile(
    r"^(model\.layers\.\d{1,9}\.mlp\.experts)\.(\d{1,9})\.(gate_proj|up_proj|down_proj)\.weight$"
)
_GATE_UP = ("gate_proj", "up_proj")  # the halves of a stacked `experts.gate_up_proj`
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a `--dtype` name ("bfloat16", "bf16", ...) stands for."""
    if name not in _DTYPES:
        raise DsakvError(f"unknown dtype {name!r} (choose from {', '.join(_DTYPES)})")
    return _DTYPES[name]


def load_model(
    path: str | Path,
    plan: LayerPlan | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    as_stored: bool = False,
    parallel: ParallelState | None = None,
    draft_layers: int = 0,
    **plan_overrides: Any,
) -> tuple[DSAForCausalLM, ModelConfig, LayerPlan]:
    """Build the model the plan describes (this rank's shards of it, with `parallel`) and
    fill it from `path`'s safetensors files, reading only this rank's slices.

    `as_stored` with an fp32 `dtype`: the weight matrices stay as the checkpoint stores
    them: bf16 (`store_matrices`, when all the others are bf16: half the memory) and FP8
    blocks (packed with their scales: a quarter), for the same outputs; the model computes
    in fp32 either way.

    `draft_layers=1` (or a plan with one draft layer) also builds and loads the MTP layer
    `model.layers.{N}`, for speculative decoding (`model.forward_draft`).
    """
    path = Path(path)
    config = ModelConfig.from_hf(path)
    if plan is None:
        plan = LayerPlan.from_config(config, draft_layers=draft_layers, **plan_overrides)
    elif plan_overrides:
        raise DsakvError("pass either a LayerPlan or plan overrides, not both")
    elif draft_layers not in (0, plan.num_draft_layers):
        raise DsakvError(
            f"draft_layers={draft_layers} disagrees with the plan's {plan.num_draft_layers}"
        )
    if isinstance(dtype, str):
        dtype = torch_dtype(dtype)
    files = checkpoint_files(path)
    model = _meta_model(path, config, plan, files, dtype, as_stored, parallel)
    _allocate(model, device)
    model.tie_head()
    _Filler(model, config, plan).load(files)
    if model.model.parts.draft:
        kept = model.mtp.drop_duplicate_vocab(model)
        log.info("MTP layer %d loaded; own vocab copies kept: %s", config.num_hidden_layers, kept)
    return model.eval(), config, plan


def _meta_model(
    path: Path,
    config: ModelConfig,
    plan: LayerPlan,
    files: dict[str, Path],
    dtype: torch.dtype,
    as_stored: bool,
    parallel: ParallelState | None,
) -> DSAForCausalLM:
    """The model on the meta device, each weight in the form the load keeps it (`as_stored`:
    bf16 or packed FP8 where the checkpoint stores them so), matched against the
    checkpoint's names, shapes and dtypes (its headers)."""
    draft_vocab = _draft_vocab(path, config, plan, files)
    with torch.device("meta"):
        model = DSAForCausalLM(config, plan, parallel=parallel, draft_vocab=draft_vocab)
    model.to(dtype)
    if as_stored and dtype == torch.float32:
        scaled = {name for name in files if name + "_scale_inv" in files}
        if _matrices_bf16(files, scaled):
            store_matrices(model, torch.bfloat16)
        if scaled:
            packable: set[str] = set()
            if _block_size(config) == (WEIGHT_BLOCK, WEIGHT_BLOCK):
                packable = _e4m3(files, scaled)
            packed = _pack_fp8(model, scaled, packable)
            log.info("%d weight matrices kept as FP8 blocks", packed)
    keep_fp32(model)
    _Filler(model, config, plan).load(files, read=False)
    return model


# Config fields a weight update may change: how the weights are stored (checked weight by
# weight) and the tokens' ids and sampling defaults (the engine takes the new ones); every
# other field shapes the model or its math.
TOKEN_FIELDS = ("bos_token_id", "eos_token_ids", "sampling_defaults")
_UPDATABLE = frozenset({"dtype", "quantization_config", *TOKEN_FIELDS})


@dataclass(frozen=True)
class CheckedUpdate:
    """A checkpoint `check_update` found to fit the served model, as `load_update` reads it."""

    config: ModelConfig
    files: dict[str, Path]
    dropped: set[str]  # the MTP layer's vocab copies, only compared


def check_update(
    model: DSAForCausalLM, path: str | Path, *, dtype: torch.dtype, as_stored: bool
) -> CheckedUpdate:
    """A weight update's checks (`Engine.update_weights_here`), before any weight changes:
    the checkpoint must be the served architecture (config.json) and every tensor it fills
    must have the name, shape and stored form (bf16, packed FP8, fp32) of the weight it
    replaces, so that the model computes what a fresh load of `path` computes. Headers
    only (and the MTP vocab copies the model dropped); on several ranks each checks the
    slices it reads (its experts' files only)."""
    path = Path(path)
    if not path.is_dir():
        raise DsakvError(f"model_path {path} is not a directory")
    config = ModelConfig.from_hf(path)
    _same_architecture(model.config, config, path)
    files = checkpoint_files(path)
    twin = _meta_model(path, config, model.plan, files, dtype, as_stored, model.parallel)
    dropped = _same_forms(model, twin, path)
    _copies_equal(model, config, files, dropped, path)
    return CheckedUpdate(config, files, dropped)


def load_update(model: DSAForCausalLM, checked: CheckedUpdate) -> None:
    """Copy a checked checkpoint into `model`; a read that fails part way leaves the
    weights mixed (`reload_weights` the previous one)."""
    _Filler(model, checked.config, model.plan, ignore=checked.dropped).load(checked.files)


def reload_weights(model: DSAForCausalLM, path: str | Path) -> None:
    """Fill `model` from `path` again (the checkpoint it served), as it was checked once."""
    path = Path(path)
    config = ModelConfig.from_hf(path)
    files = checkpoint_files(path)
    dropped = _mtp_copies(model, files) - set(dict(model.named_parameters()))
    _Filler(model, config, model.plan, ignore=dropped).load(files)


def check_tensors(
    model: DSAForCausalLM, named: list[tuple[str, torch.Tensor]]
) -> list[tuple[str, _Piece, torch.Tensor]]:
    """A weight update from tensors (a trainer's, by checkpoint name: some or all of them)
    checked before any weight changes: each must be a tensor of the model, whole, floating
    point; returns what `load_tensors` copies into this rank's slices. What a load skips is
    skipped (shared layers' indexers, another rank's experts, a draft layer the engine does
    not run), and so are the MTP layer's vocab copies the model shares with the target."""
    filler = _Filler(model, model.config, model.plan)
    shared = _shared_copies(model, filler)
    out, seen = [], set()
    for name, tensor in named:
        if name in seen:
            raise DsakvError(f"tensor {name} is sent twice")
        seen.add(name)
        if name in shared or filler._skip(name):
            continue
        if not tensor.is_floating_point():
            raise DsakvError(f"tensor {name} is {tensor.dtype}, not floating point")
        if tensor.element_size() == 1:  # (its block scales are folded into the weights)
            raise DsakvError(f"tensor {name} is FP8 ({tensor.dtype}): send it dequantized")
        for piece in filler._pieces(name):
            if tuple(tensor.shape) != piece.shape:
                raise DsakvError(
                    f"tensor {name} has shape {tuple(tensor.shape)}, model expects {piece.shape}"
                )
            if piece.dest.dtype == torch.uint8:
                raise DsakvError(
                    f"{name} is served as packed FP8 blocks: update it from a checkpoint "
                    "(/update_weights_from_disk)"
                )
            out.append((name, piece, tensor))
    if filler.unexpected:
        raise DsakvError(
            f"{len(filler.unexpected)} tensor(s) the model does not have: "
            f"{_listing(filler.unexpected)}"
        )
    return out


def load_tensors(checked: list[tuple[str, _Piece, torch.Tensor]]) -> None:
    """Copy what `check_tensors` passed into the model (cast to each weight's dtype)."""
    for name, piece, tensor in checked:
        _copy(name, piece.dest, tensor[piece.index].to(piece.dest.device))


def weight_parts(model: DSAForCausalLM) -> dict[str, set[Any]]:
    """What a full load fills of this rank's parameters: each one's name (the load's targets,
    buffers left out) and its parts (a stacked experts tensor's (expert, projection) pairs,
    `{None}` for a whole tensor), as `check_tensors`' pieces name them."""
    buffers = dict(model.named_buffers())
    filler = _Filler(model, model.config, model.plan)
    return {name: set(parts) for name, parts in filler.need.items() if name not in buffers}


# (checkpoint tensor's shape, [(where in it, fp32 values on the host)]): a rank's share
Held = tuple[tuple[int, ...], list[tuple[tuple[slice, ...], torch.Tensor]]]


def held_rows(model: DSAForCausalLM, name: str, rows: int) -> Held | None:
    """What this rank holds of checkpoint tensor `name` (the names updates take:
    `check_tensors`' pieces read the other way), within its first `rows` rows, in fp32 on
    the host (packed FP8 blocks dequantized); None where it holds none (another rank's
    experts). The tied head and the MTP layer's shared vocab copies read the tensor they
    share; a tensor the load skips is an error saying why."""
    # Another pipeline stage's part: asked by its own name, as the renames below point a
    # shared vocab copy or the tied head at a part an earlier stage may hold too
    if not model.holds(name):
        return None
    filler = _Filler(model, model.config, model.plan)
    if model.num_draft_layers and name in _shared_copies(model, filler):
        target = VOCAB_COPIES[name.split(".", 3)[3].removesuffix(".weight")]
        name = f"{target}.weight"
    if model.config.tie_word_embeddings and name == "lm_head.weight":
        name = "model.embed_tokens.weight"  # (held beside the head: `StageParts`)
    if filler._skip(name):
        if filler.skipped["draft"]:
            raise DsakvError(f"{name} is the MTP layer's, which this engine does not run")
        if filler.skipped["indexer"]:
            raise DsakvError(
                f"{name} is not loaded: its layer shares another's indexer "
                f"(plan {model.plan.pattern})"
            )
        raise DsakvError(f"{name} is not among the served weights")
    pieces = filler._pieces(name)
    if filler.unexpected:
        weight = name.removesuffix("_scale_inv")
        if weight != name and (weight in filler.targets or _EXPERT.match(weight)):
            raise DsakvError(f"{name} is an FP8 block scale: its weight reads back dequantized")
        raise DsakvError(f"the model has no tensor {name} (a checkpoint tensor name)")
    out = []
    for piece in pieces:
        first = piece.index[0]
        start = first.start or 0
        keep = min(piece.shape[0] if first.stop is None else first.stop, rows) - start
        if keep <= 0:
            continue
        values = piece.dest.detach()[:keep]
        values = unpack_fp8(values) if values.dtype == torch.uint8 else values.float()
        out.append(((slice(start, start + keep), *piece.index[1:]), values.cpu()))
    return (pieces[0].shape, out) if pieces else None


def first_rows(shares: list[Held | None], rows: int) -> torch.Tensor:
    """Checkpoint tensor's first `rows` rows, from every rank's `held_rows`."""
    held = [h for h in shares if h is not None]
    shape = held[0][0]
    out = torch.zeros(min(rows, shape[0]), *shape[1:])
    for _, parts in held:
        for index, values in parts:
            out[index] = values
    return out


def _shared_copies(model: DSAForCausalLM, filler: _Filler) -> set[str]:
    """The MTP layer's vocab copies the model does not hold: it reads the target's."""
    n = model.config.num_hidden_layers
    return {f"model.layers.{n}.{p}.weight" for p in VOCAB_COPIES} - set(filler.targets)


def _same_architecture(served: ModelConfig, new: ModelConfig, path: Path) -> None:
    differ = [
        f"{f.name} {getattr(new, f.name)!r} (served: {getattr(served, f.name)!r})"
        for f in fields(ModelConfig)
        if f.name not in _UPDATABLE and getattr(new, f.name) != getattr(served, f.name)
    ]
    if differ:
        raise DsakvError(
            f"checkpoint {path} is another architecture than the served model's: "
            f"{_listing(differ, 4)}"
        )


def _weights(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    tensors = [*model.named_parameters(remove_duplicate=True), *model.named_buffers()]
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors}


def _mtp_copies(model: DSAForCausalLM, files: dict[str, Path]) -> set[str]:
    """The MTP layer's own vocab copies `files` holds (of the layer `model` builds)."""
    if not model.num_draft_layers:
        return set()
    n = model.config.num_hidden_layers
    return {f"model.layers.{n}.{p}.weight" for p in VOCAB_COPIES} & set(files)


def _same_forms(model: DSAForCausalLM, twin: DSAForCausalLM, path: Path) -> set[str]:
    """Refuse unless `twin` (`path` as a load would build it) has `model`'s weights, by name,
    shape and dtype; returns the MTP vocab copies `twin` has that `model` dropped (equal to
    the target's at start), which are then only compared (`_copies_equal`)."""
    served, new = _weights(model), _weights(twin)
    n = model.config.num_hidden_layers
    copies = {f"model.layers.{n}.{p}.weight" for p in VOCAB_COPIES}
    dropped = (set(new) - set(served)) & copies
    differ = []
    for name in sorted(set(served) | (set(new) - dropped)):
        if served.get(name) == new.get(name):
            continue
        here, there = served.get(name), new.get(name)
        differ.append(f"{name}: {_form(there)} there, {_form(here)} served")
    if differ:
        raise DsakvError(
            f"checkpoint {path} does not hold the served model's weights as it stores them "
            f"({_listing(differ, 4)}): a checkpoint stored otherwise (bf16, FP8 blocks, "
            "fp32) or with another MTP layer needs a restart on it"
        )
    return dropped


def _form(form: tuple[tuple[int, ...], torch.dtype] | None) -> str:
    if form is None:
        return "none"
    shape, dtype = form
    return f"{str(dtype).removeprefix('torch.')} {list(shape)}"


def _copies_equal(
    model: DSAForCausalLM,
    config: ModelConfig,
    files: dict[str, Path],
    dropped: set[str],
    path: Path,
) -> None:
    """The MTP layer's vocab copies that `model` dropped (it reads the target's) must equal
    the target's in `files` too: the layer has no tensor left to hold another."""
    handles: dict[Path, Any] = {}
    n = config.num_hidden_layers
    for copy, target in VOCAB_COPIES.items():
        name = f"model.layers.{n}.{copy}.weight"
        if name not in dropped:
            continue
        if target == "lm_head" and config.tie_word_embeddings:
            target = "model.embed_tokens"
        own = _get_slice(handles, files, name)[:]
        if f"{target}.weight" not in files or not torch.equal(
            own, _get_slice(handles, files, f"{target}.weight")[:]
        ):
            raise DsakvError(
                f"checkpoint {path}'s {name} differs from its {target}.weight; the served "
                "MTP layer reads the target's (its own copy equalled it at start): restart "
                "the server on this checkpoint"
            )


def _allocate(model: DSAForCausalLM, device: str | torch.device) -> None:
    """Move the meta-device model to `device` and make its RoPE tables there: too little
    memory is one error with the size asked for."""
    device = torch.device(device)
    tensors = [*model.parameters(), *model.buffers()]
    need = sum(t.numel() * t.element_size() for t in tensors)
    need += 2 * model.rotary.positions * model.rotary.inv_freq.numel() * 4  # fp32 cos, sin
    try:
        if device.type == "cpu":  # (a CPU decode step reads every weight byte)
            _to_empty_on_huge_pages(model)
        else:
            model.to_empty(device=device)
        model.rotary.tables(device)
    except (RuntimeError, MemoryError) as e:
        if not allocation_failed(e):
            raise
        where = "host" if device.type == "cpu" else str(device)
        raise DsakvError(
            f"cannot allocate this model's {need / 2**30:.2f} GiB of weights and RoPE tables "
            f"on the {where}: {str(e).splitlines()[0]}"
        ) from None


def _to_empty_on_huge_pages(model: DSAForCausalLM) -> None:
    """`to_empty` on the CPU (its own `_apply`), the parameters carved from one block of
    huge pages (`huge_page_empty_like`). Apart: the buffers, as sleep mode keeps them when
    it drops the parameters, and the MTP layer's vocab copies, which the load drops where
    they equal the target's (vocab x hidden each: their bytes go back)."""
    apart = set()
    if model.model.parts.draft:  # (this stage holds the MTP layer)
        apart = {id(p) for m in model.mtp.vocab_copies().values() for p in m.parameters()}
    carved = {id(p): p for p in model.parameters() if id(p) not in apart}
    carve = huge_page_empty_like(sum(p.numel() * p.element_size() + 64 for p in carved.values()))
    model._apply(lambda t: carve(t) if id(t) in carved else torch.empty_like(t, device="cpu"))


def _draft_vocab(
    path: Path, config: ModelConfig, plan: LayerPlan, files: dict[str, Path]
) -> tuple[bool, bool]:
    """Whether the MTP layer ships its own embedding and head (loaded, then dropped where
    equal to the target's); one clear error when the plan wants an MTP layer the
    checkpoint lacks."""
    if not plan.num_draft_layers:
        return False, False
    prefix = mtp_layer_prefix(path, config, files)
    return prefix + "embed_tokens.weight" in files, prefix + "shared_head.head.weight" in files


def _get_slice(handles: dict[Path, Any], files: dict[str, Path], name: str) -> Any:
    """Tensor `name`'s lazy slice from its file (opened once, kept in `handles`)."""
    file = files[name]
    if file not in handles:
        handles[file] = open_checkpoint_file(file)
    try:
        return handles[file].get_slice(name)
    except SafetensorError:
        raise DsakvError(
            f"checkpoint file {file} holds no tensor {name} (model.safetensors.index.json "
            "says it does)"
        ) from None


def _matrices_bf16(files: dict[str, Path], scaled: set[str]) -> bool:
    """Whether every weight matrix of the checkpoint is stored as bf16 (read from the file
    headers), the router's and weights_proj (fp32 whatever the model dtype) and the block
    `scaled` ones (`_pack_fp8`'s) aside: then they can stay bf16 bit for bit."""
    handles: dict[Path, Any] = {}
    for name in files:
        if name in scaled or name.endswith(
            ("_scale_inv", "mlp.gate.weight", "weights_proj.weight")
        ):
            continue
        tensor = _get_slice(handles, files, name)
        if len(tensor.get_shape()) > 1 and tensor.get_dtype() != "BF16":
            return False
    return True


def _e4m3(files: dict[str, Path], scaled: set[str]) -> set[str]:
    """The `scaled` weights stored as e4m3 (file headers): the ones `pack_fp8` can hold."""
    handles: dict[Path, Any] = {}
    return {n for n in scaled if _get_slice(handles, files, n).get_dtype() == "F8_E4M3"}


def _pack_fp8(model: DSAForCausalLM, scaled: set[str], packable: set[str]) -> int:
    """Make the (meta) weights the checkpoint stores with block scales (`scaled`) packed
    uint8 rows (`pack_fp8`) where they are e4m3 128×128 blocks (`packable`) and this rank's
    slice starts on a block column: every linear layer's, and a layer's stacked experts
    when all of its experts' are. The others (e5m2, other block sizes, a bf16 weight with
    scales) are dequantised at load into fp32 (bf16 would round them). Returns how many
    matrices were packed."""

    def held(param: nn.Parameter, packed: bool) -> nn.Parameter:
        *rows, k = param.shape
        if not packed:
            return nn.Parameter(torch.empty(*rows, k, dtype=torch.float32, device="meta"), False)
        return nn.Parameter(
            torch.empty(*rows, packed_width(k), dtype=torch.uint8, device="meta"), False
        )

    count = 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and f"{name}.weight" in scaled:
            shard = getattr(mod, "shard", None)
            aligned = shard is None or shard.dim == 0 or shard.start % WEIGHT_BLOCK == 0
            ok = f"{name}.weight" in packable and aligned
            ok = ok and not name.endswith("weights_proj")  # (fp32 by design)
            mod.weight, count = held(mod.weight, ok), count + ok
        elif isinstance(mod, Experts):
            (first, last), (i0, _) = mod.expert_range, mod.inter_range
            parts = ("gate_proj", "up_proj", "down_proj")
            every = {f"{name}.{e}.{p}.weight" for e in range(first, last) for p in parts}
            if every & scaled:
                ok = every <= packable and i0 % WEIGHT_BLOCK == 0
                mod.gate_up_proj = held(mod.gate_up_proj, ok)
                mod.down_proj = held(mod.down_proj, ok)
                count += 2 * ok
    return count


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", … ({len(names) - limit} more)" if len(names) > limit else "")


@dataclass(frozen=True)
class _Piece:
    """One read: `index` of checkpoint tensor `name` (whose full shape must be `shape`)
    lands in `dest`; `parts` are the pieces of the target it fills (experts' are
    (expert, "gate_proj" | "up_proj" | "down_proj"); a whole tensor is one part, None)."""

    target: str
    dest: torch.Tensor
    shape: tuple[int, ...]
    index: tuple[slice, ...]
    parts: tuple[Any, ...] = (None,)


class _Filler:
    """Copies this rank's slices of checkpoint tensors into the model's parameters and
    tracks what is filled. A parameter's slice comes from its module's `shard`; routed
    experts from `Experts.expert_range` / `inter_range` (other ranks' experts are never read)."""

    def __init__(
        self,
        model: DSAForCausalLM,
        config: ModelConfig,
        plan: LayerPlan,
        ignore: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        self.config, self.plan, self.holds = config, plan, model.holds
        self.pp = model.parallel.pp_size
        self.ignore = ignore  # checkpoint tensors not read (`check_update`'s compared copies)
        self.targets: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=True))
        self.targets.update(dict(model.named_buffers()))
        if config.tie_word_embeddings:
            self.targets.pop("lm_head.weight", None)
        self.shards: dict[str, Shard] = {}
        self.experts: dict[str, Experts] = {}
        for mod_name, mod in model.named_modules():
            if isinstance(mod, Experts):
                self.experts[mod_name] = mod
            elif getattr(mod, "shard", None) is not None:
                self.shards[f"{mod_name}.weight"] = mod.shard
        # The parts that fill each target: stacked experts are filled per expert and
        # projection, whether the checkpoint stores them stacked or one by one.
        self.need: dict[str, set[Any]] = {name: {None} for name in self.targets}
        for prefix, mod in self.experts.items():
            mine = range(*mod.expert_range)
            self.need[f"{prefix}.gate_up_proj"] = {(e, p) for e in mine for p in _GATE_UP}
            self.need[f"{prefix}.down_proj"] = {(e, "down_proj") for e in mine}
        self.got: dict[str, set[Any]] = {name: set() for name in self.targets}
        self.unexpected: list[str] = []
        self.skipped: Counter[str] = Counter()

    def load(self, files: dict[str, Path], read: bool = True) -> None:
        """Fill every target from `files`; `read=False` only matches the checkpoint's names
        and shapes (its headers) against the model, which may still be on the meta device:
        a config that disagrees with its checkpoint is refused before anything is
        allocated (a wrong `vocab_size` asked for terabytes before the shapes were seen)."""
        handles: dict[Path, Any] = {}

        def open_slice(name: str):
            return _get_slice(handles, files, name)

        names = sorted(
            (n for n in files if not n.endswith("_scale_inv")), key=lambda n: (str(files[n]), n)
        )
        # (a scale whose weight is absent: its weight is the missing one, or it is stray)
        self.unexpected += [
            n
            for n in files
            if n.endswith("_scale_inv") and n.removesuffix("_scale_inv") not in files
        ]
        for name in tqdm(names, desc="loading", unit="tensor", disable=None if read else True):
            if self._skip(name):
                continue
            for piece in self._pieces(name):
                src = open_slice(name)
                if tuple(src.get_shape()) != piece.shape:
                    raise DsakvError(
                        f"checkpoint tensor {name} has shape {tuple(src.get_shape())}, "
                        f"model expects {piece.shape}"
                    )
                if not read:
                    self._check_dtype(name, src, open_slice, files)
                else:
                    tensor = src[piece.index]
                    scale = name + "_scale_inv"
                    if piece.dest.dtype == torch.uint8:  # packed FP8 blocks (`_pack_fp8`)
                        tensor = _read_packed(tensor, open_slice(scale), piece.index)
                    elif scale in files:
                        tensor = _read_dequant(tensor, open_slice(scale), piece.index, self.config)
                    _copy(name, piece.dest, tensor)
                self.got[piece.target].update(piece.parts)
        handles.clear()
        self._report(read)

    def _check_dtype(
        self, name: str, src: Any, open_slice: Callable[[str], Any], files: dict[str, Path]
    ) -> None:
        """Floating point, and FP8 with its block scales, one per block: integers were cast
        as numbers, an FP8 weight without scales copied as raw e4m3 values, and scales of
        another block size read in part (wrong tokens, no error), or the read failed deep
        in torch."""
        if not src.get_dtype().startswith(("F", "BF")):  # (F64, F32, F16, BF16, F8_*)
            raise DsakvError(
                f"checkpoint tensor {name} is {src.get_dtype()}, not floating point (a "
                "quantization dsakv does not read?)"
            )
        scale = name + "_scale_inv"
        if scale not in files:
            if src.get_dtype().startswith("F8"):
                raise DsakvError(
                    f"checkpoint tensor {name} is FP8 ({src.get_dtype()}) without {scale}"
                )
            return
        shape = tuple(src.get_shape())
        if len(shape) != 2:
            raise DsakvError(f"FP8 block scales are supported on 2-D weights; {name} is {shape}")
        bm, bn = _block_size(self.config)
        want = (-(-shape[0] // bm), -(-shape[1] // bn))
        got = tuple(open_slice(scale).get_shape())
        if got != want:
            raise DsakvError(
                f"checkpoint tensor {scale} has shape {got}; {name} {shape} in {bm}x{bn} blocks "
                f"(config.json's quantization_config.weight_block_size) has {want}"
            )

    def _skip(self, name: str) -> bool:
        m = _LAYER.match(name)
        layer = None if m is None else int(m.group(1))
        if layer is not None and layer >= self.plan.num_total_layers:
            # Draft (MTP) layers follow the target's; one past them is a layer the
            # config left out (a smaller num_hidden_layers ran the first layers alone).
            if layer >= self.config.num_hidden_layers + max(
                1, self.config.num_nextn_predict_layers
            ):
                return False  # (unexpected: no module has its name)
            self.skipped["draft"] += 1
            return True
        tied_head = self.config.tie_word_embeddings and name == "lm_head.weight"
        # A layer, the embedding, norm or head another pipeline stage holds
        if not tied_head and not self.holds(name):
            self.skipped["stage"] += 1
            return True
        if layer is not None and ".indexer." in name and not self.plan.runs_indexer(layer):
            self.skipped["indexer"] += 1
            return True
        return bool(_IGNORED.search(name)) or tied_head or name in self.ignore

    def _pieces(self, name: str) -> list[_Piece]:
        """What to read of `name` for this rank (empty: unexpected, or another rank's)."""
        m = _EXPERT.match(name)
        if m is not None:
            return self._expert_pieces(name, m.group(1), int(m.group(2)), m.group(3))
        prefix, _, leaf = name.rpartition(".")
        if prefix in self.experts and leaf in ("gate_up_proj", "down_proj"):
            return self._stacked_pieces(name, self.experts[prefix], leaf)
        param = self.targets.get(name)
        if param is None:
            self.unexpected.append(name)
            return []
        index = [slice(None)] * param.dim()
        shape = list(param.shape)
        if param.dtype == torch.uint8:  # packed FP8 rows: the checkpoint's row is narrower
            shape[-1] = unpacked_width(shape[-1])
        shard = self.shards.get(name)
        if shard is None:
            return [_Piece(name, param, tuple(shape), tuple(index))]
        shape[shard.dim] = shard.full
        end = min(shard.end, shard.full)
        index[shard.dim] = slice(shard.start, end)
        dest = param
        if end < shard.end:  # rows past the vocab (a padded split) stay zero
            dest = param.narrow(shard.dim, 0, end - shard.start)
            with torch.no_grad():
                param.narrow(shard.dim, end - shard.start, shard.end - end).zero_()
        return [_Piece(name, dest, tuple(shape), tuple(index))]

    def _expert_pieces(self, name: str, prefix: str, e: int, part: str) -> list[_Piece]:
        """`experts.{e}.gate_proj|up_proj|down_proj.weight`: rows (gate, up) or columns
        (down) `inter_range` of expert `e`, if `e` is one of this rank's experts."""
        mod = self.experts.get(prefix)
        if mod is None or e >= mod.num_experts:
            self.unexpected.append(name)
            return []
        first, last = mod.expert_range
        if not first <= e < last:
            self.skipped["experts"] += 1
            return []
        i0, i1 = mod.inter_range
        h, inter, n = self.config.hidden_size, mod.intermediate, i1 - i0
        rows = slice(i0, i1)
        if part == "down_proj":
            dest = mod.down_proj[e - first]
            index = (slice(None), rows)
            return [_Piece(f"{prefix}.down_proj", dest, (h, inter), index, ((e, part),))]
        half = mod.gate_up_proj[e - first]
        dest = half[:n] if part == "gate_proj" else half[n:]
        index = (rows, slice(None))
        return [_Piece(f"{prefix}.gate_up_proj", dest, (inter, h), index, ((e, part),))]

    def _stacked_pieces(self, name: str, mod: Experts, leaf: str) -> list[_Piece]:
        """Already stacked `experts.gate_up_proj[E, 2I, H]` / `experts.down_proj[E, H, I]`:
        this rank's experts, and their gate and up rows (or down columns) `inter_range`."""
        (first, last), (i0, i1) = mod.expert_range, mod.inter_range
        e, h, inter, n = mod.num_experts, self.config.hidden_size, mod.intermediate, i1 - i0
        mine, every = slice(first, last), slice(None)

        def parts(part: str) -> tuple[tuple[int, str], ...]:
            return tuple((x, part) for x in range(first, last))

        if leaf == "down_proj":
            index = (mine, every, slice(i0, i1))
            return [_Piece(name, mod.down_proj, (e, h, inter), index, parts(leaf))]
        shape, dest = (e, 2 * inter, h), mod.gate_up_proj
        gate, up = (mine, slice(i0, i1), every), (mine, slice(inter + i0, inter + i1), every)
        return [
            _Piece(name, dest[:, :n], shape, gate, parts("gate_proj")),
            _Piece(name, dest[:, n:], shape, up, parts("up_proj")),
        ]

    def _report(self, read: bool = True) -> None:
        missing = [
            name if part is None else f"{name.rpartition('.')[0]}.{part[0]}.{part[1]}.weight"
            for name, parts in self.need.items()
            for part in sorted(parts - self.got[name])
        ]
        problems = []
        if missing:
            problems.append(f"{len(missing)} missing tensor(s): {_listing(missing)}")
        no_indexer = indexer_layers(missing)
        if no_indexer:
            problems.append(no_indexer_problem(no_indexer, self.plan.pattern))
        if self.unexpected:
            problems.append(
                f"{len(self.unexpected)} unexpected tensor(s): {_listing(self.unexpected)}"
            )
        if problems:
            raise DsakvError("checkpoint does not match the model: " + "; ".join(problems))
        if not read:
            return
        stages = (
            f", {self.skipped['stage']} tensors to other pipeline stages" if self.pp > 1 else ""
        )
        log.info(
            "filled %d parameters; skipped %d indexer tensors of %d shared layers (plan %s) "
            "and %d draft/MTP tensors; %d expert tensors belong to other ranks%s",
            sum(1 for parts in self.got.values() if parts),
            self.skipped["indexer"],
            self.plan.num_shared_layers,
            self.plan.pattern,
            self.skipped["draft"],
            self.skipped["experts"],
            stages,
        )


def _copy(name: str, dest: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dest.shape) != tuple(src.shape):
        raise DsakvError(
            f"checkpoint tensor {name} slice has shape {tuple(src.shape)}, "
            f"model expects {tuple(dest.shape)}"
        )
    with torch.no_grad():
        dest.copy_(src)


def _read_dequant(
    weight: torch.Tensor, scale_inv: Any, index: tuple[slice, ...], config: ModelConfig
) -> torch.Tensor:
    """Dequantise `weight`, the slice `index` of a 2-D FP8 tensor, reading only the scale
    blocks that cover it (a slice need not start on a block boundary)."""
    if weight.dim() != 2:
        raise DsakvError(f"FP8 block scales are supported on 2-D weights, got {weight.dim()}-D")
    bm, bn = _block_size(config)
    r0, c0 = (s.start or 0 for s in index)
    r1, c1 = r0 + weight.shape[0], c0 + weight.shape[1]
    scale = scale_inv[r0 // bm : -(-r1 // bm), c0 // bn : -(-c1 // bn)]
    return _dequant_fp8(weight, scale, config, r0 % bm, c0 % bn)


def _read_packed(weight: torch.Tensor, scale_inv: Any, index: tuple[slice, ...]) -> torch.Tensor:
    """`weight`, the slice `index` of a 2-D FP8 tensor (128 × 128 blocks, columns from a
    block start: `_pack_fp8` sees to it), packed with each row's block scales."""
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise DsakvError(f"packed FP8 weights come from 2-D e4m3 tensors, got {weight.dtype}")
    r0, c0 = (s.start or 0 for s in index)
    n, k = weight.shape
    first, last = r0 // WEIGHT_BLOCK, (r0 + n - 1) // WEIGHT_BLOCK
    b0 = c0 // WEIGHT_BLOCK
    blocks = scale_inv[first : last + 1, b0 : b0 + -(-k // WEIGHT_BLOCK)].float()
    return pack_fp8(weight, blocks[torch.arange(r0, r0 + n) // WEIGHT_BLOCK - first])


def _block_size(config: ModelConfig) -> tuple[int, int]:
    q = config.quantization_config or {}
    bm, bn = q.get("weight_block_size") or (128, 128)
    return int(bm), int(bn)


def _dequant_fp8(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    config: ModelConfig,
    row_offset: int = 0,
    col_offset: int = 0,
) -> torch.Tensor:
    """Block-wise FP8 weight × its per-block scale (128×128 blocks unless the config says).

    `scale_inv[0, 0]` is the block holding `weight[0, 0]`, which sits at `row_offset`,
    `col_offset` inside that block.
    """
    bm, bn = _block_size(config)
    rows, cols = weight.shape
    s = scale_inv.float().repeat_interleave(bm, 0)[row_offset : row_offset + rows]
    s = s.repeat_interleave(bn, 1)[:, col_offset : col_offset + cols]
    return weight.float() * s
