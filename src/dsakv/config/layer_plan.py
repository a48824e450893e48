"""`LayerPlan`: the one place that decides which layers run the indexer (DESIGN.md §2).

Model construction, weight loading, the KV pools, KV transfer, the capacity planner and
metrics all read a `LayerPlan`; nothing else re-derives "is this layer shared".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from dsakv.errors import ConfigError, is_int, is_list

from .model import ModelConfig

log = logging.getLogger(__name__)

FULL, SHARED = "full", "shared"
# How often a step runs the draft layers (MTP) unless `speculative_num_steps` says (SGLang's
# default), and the most: what the planner prices and the engine runs
DRAFT_STEPS = 3
MAX_DRAFT_STEPS = 16


PLAN_OVERRIDES = (
    "index_topk_pattern",
    "index_topk_freq",
    "index_skip_topk_offset",
    "no_index_share",
)


def plan_overrides(source: object) -> dict[str, Any]:
    """The `LayerPlan.from_config` overrides that `source` (CLI args, engine config) sets."""
    values = {name: getattr(source, name, None) for name in PLAN_OVERRIDES}
    return {k: v for k, v in values.items() if v is not None and v is not False}


def freq_pattern(num_layers: int, freq: int, offset: int) -> tuple[str, ...]:
    """Indexer types from `index_topk_freq` / `index_skip_topk_offset` (DESIGN.md §2, rule 5)."""
    return tuple(FULL if max(i - offset + 1, 0) % freq == 0 else SHARED for i in range(num_layers))


def _check_positive(name: str, value: int | None) -> None:
    if value is not None and (not is_int(value) or value < 1):
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class LayerPlan:
    """Per-layer indexer mode for the target layers, plus always-full draft layers.

    Layer indices `0..num_layers-1` are target layers; `num_layers..num_total_layers-1`
    are draft (MTP/NextN) layers, which always run their own indexer and own index-K.
    """

    indexer_types: tuple[str, ...]
    num_draft_layers: int = 0
    source: str = "default"

    def __post_init__(self) -> None:
        bad = next((i for i, t in enumerate(self.indexer_types) if t not in (FULL, SHARED)), None)
        if bad is not None:
            raise ConfigError(
                f"indexer_types[{bad}] is {self.indexer_types[bad]!r}; expected 'full' or 'shared'"
            )
        if not self.indexer_types:
            raise ConfigError("layer plan has no layers")
        if self.indexer_types[0] != FULL:
            raise ConfigError(
                f"layer 0 is shared (from {self.source}); the first layer must run the indexer"
            )
        if self.num_draft_layers < 0:
            raise ConfigError(f"draft_layers must be >= 0, got {self.num_draft_layers}")

    @classmethod
    def from_config(
        cls,
        config: ModelConfig | str | Path | dict[str, Any],
        *,
        index_topk_pattern: str | None = None,
        index_topk_freq: int | None = None,
        index_skip_topk_offset: int | None = None,
        no_index_share: bool = False,
        draft_layers: int = 0,
    ) -> LayerPlan:
        """Build the plan: user overrides first, then the checkpoint's own fields.

        `config`: anything `ModelConfig.resolve` takes (a preset name, a path, a dict)."""
        config = ModelConfig.resolve(config)
        n = config.num_hidden_layers
        overrides = [
            index_topk_pattern is not None,
            index_topk_freq is not None or index_skip_topk_offset is not None,
            no_index_share,
        ]
        if sum(overrides) > 1:
            raise ConfigError(
                "choose one of index_topk_pattern, index_topk_freq/offset, no_index_share"
            )
        if index_topk_pattern is not None:
            types = _parse_pattern(index_topk_pattern, n, "index_topk_pattern")
            return cls(types, draft_layers, "index_topk_pattern override")
        if overrides[1]:
            _check_positive("index_topk_freq", index_topk_freq)
            _check_positive("index_skip_topk_offset", index_skip_topk_offset)
            freq = index_topk_freq or config.index_topk_freq or 1
            offset = index_skip_topk_offset or config.index_skip_topk_offset or 2
            return cls(freq_pattern(n, freq, offset), draft_layers, "index_topk_freq override")
        if no_index_share:
            return cls((FULL,) * n, draft_layers, "no_index_share override")

        _check_positive("index_topk_freq", config.index_topk_freq)
        _check_positive("index_skip_topk_offset", config.index_skip_topk_offset)
        _check_positive("cli_factor", config.cli_factor)
        if config.indexer_types is not None:
            types = tuple(config.indexer_types)
            if len(types) != n:
                raise ConfigError(
                    f"indexer_types has {len(types)} entries but num_hidden_layers is {n}"
                )
            plan = cls(types, draft_layers, "config indexer_types")
            if config.index_topk_freq is not None:
                derived = freq_pattern(
                    n, config.index_topk_freq, config.index_skip_topk_offset or 2
                )
                first = next((i for i in range(n) if derived[i] != types[i]), None)
                if first is not None:
                    log.warning(
                        "indexer_types disagrees with index_topk_freq/offset first at layer %d "
                        "(%s vs %s); using indexer_types",
                        first,
                        types[first],
                        derived[first],
                    )
            return plan
        if config.index_topk_pattern is not None:
            types = _parse_pattern(config.index_topk_pattern, n, "index_topk_pattern")
            return cls(types, draft_layers, "config index_topk_pattern")
        if config.cli_factor is not None and config.cli_factor > 1:
            f = config.cli_factor
            types = tuple(SHARED if i % f else FULL for i in range(n))
            return cls(types, draft_layers, "config cli_factor")
        if config.index_topk_freq is not None or config.index_skip_topk_offset is not None:
            freq = config.index_topk_freq or 1
            offset = config.index_skip_topk_offset or 2
            return cls(freq_pattern(n, freq, offset), draft_layers, "config index_topk_freq")
        return cls((FULL,) * n, draft_layers, "default")

    # --- queries -------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        """Target layers (without draft layers)."""
        return len(self.indexer_types)

    @property
    def num_total_layers(self) -> int:
        return self.num_layers + self.num_draft_layers

    def runs_indexer(self, layer: int) -> bool:
        """Whether `layer` builds and runs its own indexer (draft layers always do)."""
        self.check_layer(layer)
        return layer >= self.num_layers or self.indexer_types[layer] == FULL

    def owns_index_k(self, layer: int) -> bool:
        """Whether `layer` needs an index-K cache: exactly the layers that run the indexer."""
        return self.runs_indexer(layer)

    def topk_source(self, layer: int) -> int:
        """The layer whose top-k `layer` uses: itself if full, else the nearest earlier full."""
        self.check_layer(layer)
        return self._topk_sources[layer]

    def carried_sources(self, boundary: int) -> tuple[int, ...]:
        """The full layers before target layer `boundary` whose top-k a target layer from
        `boundary` on reads: what a pipeline stage starting at `boundary` receives with the
        hidden states (a stage that starts with a shared layer needs its source's)."""
        self.check_layer(boundary)
        later = (self._topk_sources[i] for i in range(boundary, self.num_layers))
        return tuple(sorted({src for src in later if src < boundary}))

    def check_layer(self, layer: int) -> None:
        """A negative index would wrap around to a draft layer: refused like one past the end."""
        if not 0 <= layer < self.num_total_layers:
            raise IndexError(f"layer {layer} out of range 0..{self.num_total_layers - 1}")

    @cached_property
    def _topk_sources(self) -> tuple[int, ...]:
        out, last = [], 0
        for i in range(self.num_total_layers):
            if self.runs_indexer(i):
                last = i
            out.append(last)
        return tuple(out)

    @cached_property
    def full_layers(self) -> tuple[int, ...]:
        """Target layers that run the indexer."""
        return tuple(i for i, t in enumerate(self.indexer_types) if t == FULL)

    @cached_property
    def shared_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.indexer_types) if t == SHARED)

    @cached_property
    def index_k_layers(self) -> tuple[int, ...]:
        """Every layer (target and draft) that owns index-K."""
        return self.full_layers + tuple(range(self.num_layers, self.num_total_layers))

    @property
    def num_full_layers(self) -> int:
        return len(self.full_layers)

    @property
    def num_shared_layers(self) -> int:
        return len(self.shared_layers)

    @property
    def pattern(self) -> str:
        """Compact form, e.g. `FFFSSSF…`; draft layers are not included."""
        return "".join("F" if t == FULL else "S" for t in self.indexer_types)

    def all_full(self) -> LayerPlan:
        """The same model with every layer running the indexer (the IndexCache baseline)."""
        return LayerPlan((FULL,) * self.num_layers, self.num_draft_layers, "all full")


def _parse_pattern(pattern: str, num_layers: int, name: str) -> tuple[str, ...]:
    if not isinstance(pattern, str):
        raise ConfigError(f"{name} must be a string of F/S characters")
    bad = next((i for i, c in enumerate(pattern) if c not in "FS"), None)
    if bad is not None:
        raise ConfigError(f"{name} has {pattern[bad]!r} at layer {bad}; only F and S are allowed")
    if len(pattern) != num_layers:
        raise ConfigError(
            f"{name} has {len(pattern)} characters but num_hidden_layers is {num_layers}"
        )
    return tuple(FULL if c == "F" else SHARED for c in pattern)


def check_one_draft_layer(plan: LayerPlan) -> None:
    """dsakv builds one MTP layer and runs it chained for every draft step: a plan with
    more is refused by the model and by `dsakv plan` alike."""
    if plan.num_draft_layers > 1:
        raise ConfigError(
            f"dsakv runs one MTP draft layer (chained); the plan has {plan.num_draft_layers}"
        )


def builds_embedding(*, first: bool, last: bool, draft: bool, tied: bool) -> bool:
    """Whether a pipeline stage (the whole model with one) builds the embedding: the first
    stage embeds the tokens; the last holds one too where lm_head is it (`tied`) or its
    MTP layer (`draft`) embeds the next token. The model (`StageParts`) and the weight
    estimate (`estimate_weight_bytes`) both ask here."""
    return first or (last and (tied or draft))


# What `--pp-layer-partition` / `pp_layer_partition` takes, for its errors
PARTITION_WANT = "comma-separated integers >= 1, one per pipeline stage"


def parse_layer_partition(value: Any) -> tuple[int, ...]:
    """Each pipeline stage's target layers (SGLang's SGLANG_PP_LAYER_PARTITION) from "3,5"
    (the flag's, or an `LLM` keyword's) or a sequence of integers: the CLI's and the
    engine config's one parser. Whether they fit the stages and the model is
    `ParallelConfig`'s to say."""
    try:
        parts = tuple(int(n) for n in value.split(",")) if isinstance(value, str) else None
    except ValueError:
        parts = None
    if parts is None and is_list(value):
        parts = tuple(value)
    if parts is None or not all(is_int(n) and n >= 1 for n in parts):
        raise ConfigError(f"pp_layer_partition must be {PARTITION_WANT}, got {value!r}")
    return parts
