"""`CacheLayout`: bytes per token per layer per component, derived from the `LayerPlan`."""

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from dsakv.config import LayerPlan, ModelConfig
from dsakv.errors import ConfigError, is_int

FP8_BLOCK = 128  # fp8 values per fp32 scale (`fp8`'s quantisation: here, torch-free)


def scale_blocks(d: int) -> int:
    """fp32 scales for `d` values: one per `FP8_BLOCK`, a partial last block included."""
    return -(-d // FP8_BLOCK)


LATENT_DTYPES = ("fp8_e4m3", "fp8_ds_mla", "bf16", "fp32")
DEFAULT_LATENT_DTYPE = "fp8_e4m3"  # (what vLLM's and SGLang's "auto" spells here)
INDEX_K_DTYPES = ("fp8", "bf16", "fp32")


class LayerNotHeldError(IndexError):
    """A layer of the model that this cache does not hold: another pipeline stage's."""


def spans(layers: tuple[int, ...]) -> str:
    """Layers as compact ranges: (0, 1, 2, 5, 78) -> "0-2, 5, 78"."""
    out, start = [], 0
    for k in range(1, len(layers) + 1):
        if k == len(layers) or layers[k] != layers[k - 1] + 1:
            a, b = layers[start], layers[k - 1]
            out.append(f"{a}" if a == b else f"{a}-{b}")
            start = k
    return ", ".join(out)


def checked_layers(plan: LayerPlan, layers: Any) -> tuple[int, ...]:
    """The layers one pipeline stage holds, as a tuple: increasing, none twice, each a
    layer of `plan` (target or draft), at least one; anything else is one ConfigError."""
    total = plan.num_total_layers
    try:
        held = tuple(layers)
    except TypeError:
        held = ()
    if (
        not held
        or not all(is_int(i) and 0 <= i < total for i in held)
        or any(a >= b for a, b in zip(held, held[1:]))
    ):
        raise ConfigError(
            f"a stage's layers must be increasing, unique layers in 0..{total - 1} (the "
            f"plan's target and draft layers), at least one; got {layers!r}"
        )
    return held


def latent_bytes(dtype: str, kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes one token's MLA latent (kv_lora ‖ rope-key) takes in one layer."""
    dims = kv_lora_rank + rope_dim
    if dtype == "fp8_e4m3":
        return dims
    if dtype == "fp8_ds_mla":  # fp8 nope + fp32 scale per 128 + bf16 rope
        return kv_lora_rank + 4 * scale_blocks(kv_lora_rank) + 2 * rope_dim
    if dtype == "bf16":
        return 2 * dims
    if dtype == "fp32":
        return 4 * dims
    raise ConfigError(f"unknown kv_cache_dtype {dtype!r} (choose from {', '.join(LATENT_DTYPES)})")


def index_k_bytes(dtype: str, index_head_dim: int) -> int:
    """Bytes one token's index key takes in one layer."""
    if dtype == "fp8":  # e4m3 values + one fp32 scale per 128 values
        return index_head_dim + 4 * scale_blocks(index_head_dim)
    if dtype == "bf16":
        return 2 * index_head_dim
    if dtype == "fp32":
        return 4 * index_head_dim
    raise ConfigError(f"unknown index_k_dtype {dtype!r} (choose from {', '.join(INDEX_K_DTYPES)})")


@dataclass(frozen=True)
class CacheLayout:
    """What one token costs in the KV cache, per layer and per component.

    With `elide_index_k` only layers that own index-K in the plan (full and draft layers)
    pay for it; without it every layer does (the dense layout other engines fall back to).
    `layers`: the layers this cache holds (a pipeline stage's, `for_stage`); None: all.
    """

    plan: LayerPlan
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int
    kv_cache_dtype: str = "fp8_e4m3"
    index_k_dtype: str = "fp8"
    page_size: int = 64
    elide_index_k: bool = True
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        latent_bytes(self.kv_cache_dtype, self.kv_lora_rank, self.qk_rope_head_dim)
        index_k_bytes(self.index_k_dtype, self.index_head_dim)
        d = self.index_head_dim
        if self.index_k_dtype == "fp8" and (d < 1 or d & (d - 1)):
            raise ConfigError(
                f"fp8 index-K needs a power-of-two index_head_dim (its Hadamard rotation), "
                f"got {d}: use --index-k-dtype bf16 or fp32"
            )
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ConfigError(f"page_size must be an integer >= 1, got {self.page_size!r}")
        if self.layers is not None:
            object.__setattr__(self, "layers", checked_layers(self.plan, self.layers))

    @classmethod
    def for_model(
        cls,
        model: str | Path | dict[str, Any] | ModelConfig,
        kv_cache_dtype: str = "fp8_e4m3",
        index_k_dtype: str = "fp8",
        page_size: int = 64,
        elide_index_k: bool = True,
        draft_layers: int = 0,
        **plan_overrides: Any,
    ) -> CacheLayout:
        """Layout for a preset name, a path, a dict or a `ModelConfig`."""
        config = ModelConfig.resolve(model)
        plan = LayerPlan.from_config(config, draft_layers=draft_layers, **plan_overrides)
        return cls.from_plan(config, plan, kv_cache_dtype, index_k_dtype, page_size, elide_index_k)

    @classmethod
    def from_plan(
        cls,
        config: ModelConfig,
        plan: LayerPlan,
        kv_cache_dtype: str = "fp8_e4m3",
        index_k_dtype: str = "fp8",
        page_size: int = 64,
        elide_index_k: bool = True,
    ) -> CacheLayout:
        return cls(
            plan,
            config.kv_lora_rank,
            config.qk_rope_head_dim,
            config.index_head_dim,
            kv_cache_dtype,
            index_k_dtype,
            page_size,
            elide_index_k,
        )

    # --- per layer -------------------------------------------------------------------------

    def for_stage(self, target: range) -> CacheLayout:
        """The layout of a pipeline stage running the target layers `target`: those, and
        the draft layers on the last stage (the one that ends the target layers). One stage
        holding every layer is the whole layout (`layers` None: the same fingerprint)."""
        if target == range(self.plan.num_layers):
            return replace(self, layers=None)
        held = tuple(target)
        if target.stop == self.plan.num_layers:
            held += tuple(range(self.plan.num_layers, self.plan.num_total_layers))
        return replace(self, layers=held)

    @property
    def held_layers(self) -> tuple[int, ...]:
        """The layers this cache holds (target plus draft; a stage's under `--pp-size`)."""
        return tuple(range(self.plan.num_total_layers)) if self.layers is None else self.layers

    @property
    def num_layers(self) -> int:
        """Layers with a KV cache here: target plus draft (a stage's own)."""
        return len(self.held_layers)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def has_index_k(self, layer: int) -> bool:
        """Whether the pools give `layer` index-K storage (the plan decides when elided); a
        layer this cache does not hold is an error (`check_held`), never False."""
        layer = self.check_held(layer)
        return self.plan.owns_index_k(layer) or not self.elide_index_k

    def check_held(self, layer: int) -> int:
        """`layer` as an int (a numpy integer or 0-d tensor taken, as list indexing takes
        them), refused if this cache holds no storage for it: past the plan's layers an
        IndexError, another pipeline stage's a `LayerNotHeldError` naming this one's."""
        layer = operator.index(layer)
        self.plan.check_layer(layer)
        if self.layers is not None and layer not in self._held_set:
            raise LayerNotHeldError(
                f"layer {layer} is on another pipeline stage: this stage's cache holds "
                f"layers {spans(self.layers)} only"
            )
        return layer

    @cached_property
    def _held_set(self) -> frozenset[int]:
        return frozenset(self.held_layers)

    @property
    def index_k_layers(self) -> tuple[int, ...]:
        """Layers with index-K storage here, in order."""
        if self.elide_index_k:
            return tuple(i for i in self.held_layers if self.plan.owns_index_k(i))
        return self.held_layers

    @property
    def latent_bytes_per_layer(self) -> int:
        return latent_bytes(self.kv_cache_dtype, self.kv_lora_rank, self.qk_rope_head_dim)

    @property
    def index_k_bytes_per_layer(self) -> int:
        return index_k_bytes(self.index_k_dtype, self.index_head_dim)

    # --- per token -------------------------------------------------------------------------

    @property
    def latent_bytes_per_token(self) -> int:
        return self.num_layers * self.latent_bytes_per_layer

    @property
    def index_k_bytes_per_token(self) -> int:
        return len(self.index_k_layers) * self.index_k_bytes_per_layer

    @property
    def bytes_per_token(self) -> int:
        """The cell: what one token costs across every layer and component."""
        return self.latent_bytes_per_token + self.index_k_bytes_per_token

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    def dense(self) -> CacheLayout:
        """The same layout with index-K on every layer."""
        return replace(self, elide_index_k=False)

    def fingerprint(self) -> str:
        """Identifies everything that decides buffer shapes; KV transfer checks it."""
        key = "|".join(
            map(
                str,
                (
                    self.plan.pattern,
                    self.plan.num_draft_layers,
                    self.kv_lora_rank,
                    self.qk_rope_head_dim,
                    self.index_head_dim,
                    self.kv_cache_dtype,
                    self.index_k_dtype,
                    self.page_size,
                    self.elide_index_k,
                    *((self.layers,) if self.layers is not None else ()),
                ),
            )
        )
        return hashlib.sha256(key.encode()).hexdigest()[:16]
