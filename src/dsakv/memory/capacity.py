"""Capacity planning: weights per rank, the KV budget, and `max_total_num_tokens`."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from dsakv.config import HiSparseConfig, LayerPlan, ModelConfig
from dsakv.config.layer_plan import builds_embedding
from dsakv.config.presets import QUANTIZED_WEIGHT
from dsakv.errors import ConfigError, is_int, is_number

from .layout import CacheLayout, checked_layers, spans

GIB = 1 << 30
# Bytes per value of each dtype a checkpoint's `dtype` may name (`ModelConfig` checks it).
_DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


class UnpricedWeightsError(ConfigError):
    """A quantization the estimate cannot price: where the weights do not size the budget,
    `dsakv plan` reports them as unknown (a malformed config is a plain ConfigError)."""


@dataclass(frozen=True)
class WeightStorage:
    """How a checkpoint stores its weight matrices, from its `quantization_config`.

    `fp8` (DeepSeek-V3.x / GLM-5 FP8 releases): one byte a value plus an fp32 scale per
    `block` (`weight_block_size`), or one per tensor without it. `nvfp4` (modelopt): half a
    byte a value, an fp8 scale per `group` values and two fp32 per-tensor scales
    (`weight_scale_2`, `input_scale`). Either quantises the matrices `QUANTIZED_WEIGHT`
    names unless `exclude` (the config's exclude / ignore list) matches the module or a
    module above it; modelopt quantises what transformers builds, so never the MTP layers.
    Everything else stays at the checkpoint dtype (`wide` bytes a value).
    """

    wide: int
    scheme: str | None = None  # None, "fp8" or "nvfp4"
    block: tuple[int, int] | None = None  # fp8 scale block; None: one scale per tensor
    group: int = 16  # nvfp4 values per fp8 scale
    exclude: re.Pattern[str] | None = None

    @classmethod
    def of(cls, config: ModelConfig) -> WeightStorage:
        wide = _DTYPE_BYTES[config.dtype]
        q = config.quantization_config
        if not q:
            return cls(wide)
        method, algo = q.get("quant_method"), q.get("quant_algo")
        if method == "fp8":
            block = q.get("weight_block_size")  # (`ModelConfig` checks its shape)
            return cls(wide, "fp8", tuple(block) if block else None, exclude=_exclusions(q))
        if method == "modelopt" and str(algo).upper() == "NVFP4":
            group = q.get("group_size", 16)  # (absent: modelopt's 16; 0 or null is no size)
            if not is_int(group) or group < 1:
                raise ConfigError(
                    "quantization_config.group_size must be an integer >= 1 (NVFP4 values "
                    f"per scale), got {group!r}"
                )
            return cls(wide, "nvfp4", group=group, exclude=_exclusions(q))
        what = f"quant_method {method!r}" + (f", quant_algo {algo!r}" if algo else "")
        raise UnpricedWeightsError(
            f"cannot price weights quantised with {what} (known: fp8, modelopt NVFP4); "
            "give the weights per rank (--weights-gib)"
        )

    def matrix(self, name: str, rows: int, cols: int, draft: bool = False) -> int:
        """Bytes of the whole `rows × cols` weight of module `name` (a draft layer's if
        `draft`), scales included."""
        values = rows * cols
        if (
            self.scheme is None
            or not QUANTIZED_WEIGHT.match(name + ".weight")
            or (self.exclude is not None and self.exclude.fullmatch(name))
            or (draft and self.scheme == "nvfp4")
        ):
            return values * self.wide
        if self.scheme == "nvfp4":
            return rows * -(-cols // 2) + rows * -(-cols // self.group) + 2 * 4
        if self.block is None:
            return values + 4
        bm, bn = self.block
        return values + -(-rows // bm) * -(-cols // bn) * 4


def gain_pct(new: float, old: float) -> float | None:
    """Percent change from `old`, to two decimals; None (no base to compare with) where
    `old` is 0."""
    return round(100.0 * (new - old) / old, 2) if old else None


def _exclusions(q: dict[str, Any]) -> re.Pattern[str] | None:
    """The modules a quantization config leaves unquantised, as one pattern: its names,
    `*` wildcards (modelopt) or `re:` regexes (compressed-tensors), each also matching the
    modules under it."""
    keys = ("exclude_modules", "ignore", "ignored_layers", "modules_to_not_convert")
    key = next((k for k in keys if q.get(k)), None)
    if key is None:
        return None
    names = q[key]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"quantization_config.{key} must be a list of strings, got {names!r}")
    parts = [n[3:] if n.startswith("re:") else re.escape(n).replace(r"\*", ".*") for n in names]
    try:
        return re.compile("(?:" + "|".join(f"(?:{p})" for p in parts) + r")(?:\..*)?")
    except re.error as e:
        raise ConfigError(f"quantization_config.{key} has a bad pattern: {e}") from None


@dataclass(frozen=True)
class WeightEstimate:
    """Weight bytes on one tensor-parallel rank, split so the indexer saving is visible."""

    total_bytes: int
    indexer_bytes: int  # indexers that are built (full layers + draft layers)
    indexer_bytes_saved: int  # indexers that shared layers do not build
    indexer_params_per_layer: int


def _indexer_params(c: ModelConfig) -> int:
    idx = c.index_n_heads * c.index_head_dim
    return (
        c.q_lora_rank * idx
        + c.hidden_size * c.index_head_dim
        + c.hidden_size * c.index_n_heads
        + 2 * c.index_head_dim
    )


def estimate_weight_bytes(
    config: ModelConfig,
    plan: LayerPlan,
    tp: int = 1,
    *,
    ep: int = 1,
    dp_attention: bool = False,
    layers: Sequence[int] | None = None,
) -> WeightEstimate:
    """Per-rank weight bytes from the config shapes, priced as the checkpoint stores them
    (`WeightStorage`) and sharded as the model is (DESIGN.md §8).

    Replicated on every rank: q_a / kv_a projections, norms, the MoE router and the
    indexer. Split over the attention group (`tp` ranks, or 1 under DP attention): q_b,
    kv_b and o_proj by heads, embedding and lm_head by vocab (padded to equal parts).
    Split over all `tp` ranks: the dense MLP, shared experts and routed experts (`ep`
    groups of whole experts, each expert's intermediate size over `tp / ep` ranks; either
    way 1/tp of them). A split matrix's scales split with it. An unknown quantization is
    a `ConfigError`, never priced as if unquantised.

    `layers`: one pipeline stage's (`CacheLayout.held_layers`; None: the whole model). The
    stage holding layer 0 holds the embedding, the one holding the last target layer the
    final norm and lm_head, and also an embedding when the MTP layer is built there (it
    embeds the next token) or embeddings are tied (lm_head is one): `_vocab_matrices`.
    """
    if tp < 1:
        raise ConfigError(f"tp must be >= 1, got {tp}")
    if ep < 1 or tp % ep:
        raise ConfigError(f"ep must divide tp ({tp}), got {ep}")
    c, store = config, WeightStorage.of(config)
    attn_tp = 1 if dp_attention else tp
    h, heads, wide = c.hidden_size, c.num_attention_heads, store.wide

    def layer(i: int) -> tuple[float, int]:
        """Layer `i`'s bytes on this rank without its indexer, and its indexer's."""
        prefix, draft = f"model.layers.{i}.", i >= c.num_hidden_layers

        def m(name: str, rows: int, cols: int) -> int:
            return store.matrix(prefix + name, rows, cols, draft)

        def mlp(name: str, inter: int) -> int:
            up = m(f"{name}.gate_proj", inter, h) + m(f"{name}.up_proj", inter, h)
            return up + m(f"{name}.down_proj", h, inter)

        attn = m("self_attn.q_a_proj", c.q_lora_rank, h) + m(
            "self_attn.kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, h
        )
        attn_split = (
            m("self_attn.q_b_proj", heads * c.qk_head_dim, c.q_lora_rank)
            + m("self_attn.kv_b_proj", heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
            + m("self_attn.o_proj", h, heads * c.v_head_dim)
        )
        norms = (c.q_lora_rank + c.kv_lora_rank + 2 * h) * wide
        if c.is_moe(i):  # (every expert priced as expert 0: no checkpoint sets one apart)
            experts = c.n_routed_experts * mlp("mlp.experts.0", c.moe_intermediate_size)
            shared = mlp("mlp.shared_experts", c.moe_intermediate_size * c.n_shared_experts)
            ffn = (experts + shared) / tp + (h * c.n_routed_experts + c.n_routed_experts) * wide
        else:
            ffn = mlp("mlp", c.intermediate_size) / tp
        # An MTP layer's own head: eh_proj [H, 2H] (replicated), enorm, hnorm, final norm.
        head = m("eh_proj", h, 2 * h) + 3 * h * wide if draft else 0
        indexer = (
            m("self_attn.indexer.wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank)
            + m("self_attn.indexer.wk", c.index_head_dim, h)
            + m("self_attn.indexer.weights_proj", c.index_n_heads, h)
            + 2 * c.index_head_dim * wide  # k_norm weight and bias
        )
        return attn + attn_split / attn_tp + norms + ffn + head, indexer

    held = range(plan.num_total_layers) if layers is None else checked_layers(plan, layers)
    vocab_rows = -(-c.vocab_size // attn_tp)  # this rank's (padded) vocab split
    matrices, last = _vocab_matrices(plan, held, c.tie_word_embeddings)
    total: float = (matrices * vocab_rows * h + last * h) * wide
    built = saved = 0
    for i in held:
        rest, indexer = layer(i)
        total += rest
        if plan.runs_indexer(i):
            built += indexer
        else:
            saved += indexer
    return WeightEstimate(
        total_bytes=int(total + built),
        indexer_bytes=built,
        indexer_bytes_saved=saved,
        indexer_params_per_layer=_indexer_params(c),
    )


def _vocab_matrices(plan: LayerPlan, held: Sequence[int], tied: bool) -> tuple[int, bool]:
    """How many vocab × hidden matrices (embedding, lm_head) a rank holding `held` builds,
    and whether it holds the final norm (the last target layer is here). The whole model:
    2, or 1 when tied; a last stage after the first: lm_head, plus an embedding of its own
    when it is not lm_head itself (tied) and the MTP layer needs one."""
    first, last = 0 in held, plan.num_layers - 1 in held
    draft = any(i >= plan.num_layers for i in held)
    embedding = builds_embedding(first=first, last=last, draft=draft, tied=tied)
    return int(embedding) + int(last and not tied), last


def layout_weight_bytes(
    layout: CacheLayout,
    config: ModelConfig,
    tp: int = 1,
    *,
    ep: int = 1,
    dp_attention: bool = False,
) -> int:
    """Per-rank weight bytes of the engine that holds `layout`: its layers' (a pipeline
    stage's own, `CacheLayout.layers`), and under a dense layout also the indexers shared
    layers skip (the engines that fall back to it build every one)."""
    w = estimate_weight_bytes(
        config, layout.plan, tp, ep=ep, dp_attention=dp_attention, layers=layout.layers
    )
    return w.total_bytes + (0 if layout.elide_index_k else w.indexer_bytes_saved)


@dataclass(frozen=True)
class CapacityPlan:
    """How many KV tokens a budget buys under one layout."""

    layout: CacheLayout
    kv_budget_bytes: int
    weight_bytes: int | None
    max_total_num_tokens: int

    @property
    def num_pages(self) -> int:
        return self.max_total_num_tokens // self.layout.page_size


def kv_budget_bytes(
    layout: CacheLayout,
    *,
    kv_budget_gib: float | None = None,
    gpu_memory_gib: float | None = None,
    mem_fraction_static: float = 0.9,
    weights_gib: float | None = None,
    reserve_gib: float = 0.0,
    config: ModelConfig | None = None,
    tp: int = 1,
    ep: int = 1,
    dp_attention: bool = False,
) -> tuple[int, int | None]:
    """The device KV budget in bytes, and the weight bytes it subtracted (None if explicit).

    The budget is explicit (`kv_budget_gib`) or `gpu_memory × mem_fraction_static −
    weights − reserve`, with weights from `weights_gib` or estimated from `config` over
    the layout's layers (`layout_weight_bytes`: a pipeline stage's are its own).
    """
    _check_gib("kv_budget_gib", kv_budget_gib, positive=True)
    _check_gib("gpu_memory_gib", gpu_memory_gib, positive=True)
    _check_gib("weights_gib", weights_gib)
    _check_gib("reserve_gib", reserve_gib)
    if not (_finite(mem_fraction_static) and 0 < mem_fraction_static <= 1):
        raise ConfigError(f"mem_fraction_static must be in (0, 1], got {mem_fraction_static!r}")
    if kv_budget_gib is not None:
        if gpu_memory_gib is not None or weights_gib is not None or reserve_gib:
            raise ConfigError(
                "kv_budget_gib is the whole KV budget: gpu_memory_gib, weights_gib and "
                "reserve_gib size it instead; give one or the others"
            )
        return int(kv_budget_gib * GIB), None
    if gpu_memory_gib is None:
        raise ConfigError("give a KV budget (kv_budget_gib) or gpu_memory_gib")
    if weights_gib is not None:
        weight_bytes = int(weights_gib * GIB)
    elif config is not None:
        weight_bytes = layout_weight_bytes(layout, config, tp, ep=ep, dp_attention=dp_attention)
    else:
        raise ConfigError("need weights_gib or a model config to estimate the weights")
    used = weight_bytes + int(reserve_gib * GIB)
    what = "weights and reserve" if reserve_gib else "weights"
    budget = static_kv_budget_bytes(int(gpu_memory_gib * GIB), mem_fraction_static, used, what)
    return budget, weight_bytes


def static_kv_budget_bytes(
    total_bytes: int, fraction: float, used_bytes: int, used_by: str = "weights"
) -> int:
    """`total × fraction − used`: the KV pool's share of a GPU under SGLang's
    `--mem-fraction-static`, which keeps `fraction` of the GPU for weights and KV and the
    rest for activations and CUDA graphs. `used` is what is on the device before the pool:
    `dsakv plan`'s weights and reserve, or on a live GPU what the load took
    (`gpu_kv_budget_bytes`). Nothing left is a `ConfigError`."""
    if not (_finite(fraction) and 0 < fraction <= 1):
        raise ConfigError(f"mem_fraction_static must be in (0, 1], got {fraction!r}")
    budget = int(total_bytes * fraction) - used_bytes
    if budget <= 0:
        raise ConfigError(
            f"no memory left for the KV cache: {used_by} take {used_bytes / GIB:.2f} GiB of "
            f"{total_bytes / GIB:.2f} GiB; --mem-fraction-static {fraction} leaves no KV room "
            f"(it keeps {total_bytes * fraction / GIB:.2f} GiB for them and the KV)"
        )
    return budget


def gpu_kv_budget_bytes(fraction: float, mem_info: Sequence[tuple[int, int]]) -> int:
    """The pool every rank holds under `--mem-fraction-static`, from each rank's free GPU
    memory `(before, after)` the load (`torch.cuda.mem_get_info`), as SGLang sizes it:
    `after − before × (1 − fraction)`, the memory free before the load being SGLang's
    total (another process's and the CUDA context's memory are not the engine's to
    keep). The least rank's, as the ranks' pools are one size; a rank with no room
    refuses for all."""
    return min(_rank_kv_budgets(fraction, mem_info))


def stage_kv_budget_bytes(
    fraction: float, mem_info: Sequence[tuple[int, int]], tp: int, stage: int
) -> int:
    """Pipeline stage `stage`'s KV budget under `--mem-fraction-static`: the least of its
    `tp` ranks' (ranks are stage-major) of every rank's `mem_info`. Stages hold different
    weights, so each sizes its pages from its own budget and layout before the engine
    takes the least page count over stages. Every rank's room is checked, so a rank with
    none refuses on every rank alike, naming itself (never a stage waiting on another)."""
    return min(_rank_kv_budgets(fraction, mem_info)[stage * tp : (stage + 1) * tp])


def _rank_kv_budgets(fraction: float, mem_info: Sequence[tuple[int, int]]) -> list[int]:
    """Each rank's KV budget (`gpu_kv_budget_bytes`' formula); the first rank with no room
    refuses, named where there are several."""
    where = len(mem_info) > 1
    return [
        static_kv_budget_bytes(
            before,
            fraction,
            before - after,
            "the weights" + where * f" of rank {r}",
        )
        for r, (before, after) in enumerate(mem_info)
    ]


def _finite(value: Any) -> bool:
    return is_number(value) and math.isfinite(value)


def _check_gib(name: str, value: float | None, positive: bool = False) -> None:
    """A size in GiB is a finite number, > 0 or >= 0 (inf and NaN made nonsense budgets)."""
    if value is None:
        return
    if not (_finite(value) and (value > 0 if positive else value >= 0)):
        raise ConfigError(
            f"{name} must be a finite number {'> 0' if positive else '>= 0'} (GiB), got {value!r}"
        )


NO_PAGE = "the KV budget holds less than one page"


def check_holds_a_page(pages: int, detail: str = "") -> None:
    """A pool of no page admits no request: the engine refuses to build one, and `dsakv
    plan` to plan one (`detail`: which layout and budget)."""
    if pages < 1:
        raise ConfigError(NO_PAGE + detail)


def _page_aligned_tokens(budget: float, cell: int, page: int) -> int:
    return int(budget // cell // page) * page


def plan_capacity(
    layout: CacheLayout,
    *,
    kv_budget_gib: float | None = None,
    gpu_memory_gib: float | None = None,
    mem_fraction_static: float = 0.9,
    weights_gib: float | None = None,
    reserve_gib: float = 0.0,
    config: ModelConfig | None = None,
    tp: int = 1,
    ep: int = 1,
    dp_attention: bool = False,
) -> CapacityPlan:
    """`max_total_num_tokens = floor(budget / cell / page_size) × page_size`.

    The budget is `kv_budget_bytes`'s (explicit, or GPU memory less the layout's weights).
    """
    budget, weight_bytes = kv_budget_bytes(
        layout,
        kv_budget_gib=kv_budget_gib,
        gpu_memory_gib=gpu_memory_gib,
        mem_fraction_static=mem_fraction_static,
        weights_gib=weights_gib,
        reserve_gib=reserve_gib,
        config=config,
        tp=tp,
        ep=ep,
        dp_attention=dp_attention,
    )
    tokens = _page_aligned_tokens(budget, layout.bytes_per_token, layout.page_size)
    return CapacityPlan(layout, budget, weight_bytes, tokens)


TOPK_INDEX_BYTES = 4  # a top-k position is an int32


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage's share of the model and what its KV budget holds.

    `layout` holds the stage's layers only (`CacheLayout.for_stage`), so its bytes per
    token count its own latent and its own full (and draft) layers' index-K. A stage that
    starts on a shared layer receives its source layers' top-k (`carried_sources`) with
    the hidden states: `index_topk` int32 positions per token per source.
    """

    stage: int
    target: range  # its target layers (the draft layers ride on the last stage)
    layout: CacheLayout
    carried_sources: tuple[int, ...]
    carried_topk_bytes_per_token: int
    weight_bytes: int | None  # per rank: what its budget subtracted, else the estimate
    capacity: CapacityPlan  # its budget (its own weights subtracted) and tokens

    @property
    def num_full_layers(self) -> int:
        return sum(self.layout.plan.runs_indexer(i) for i in self.target)

    @property
    def num_shared_layers(self) -> int:
        return len(self.target) - self.num_full_layers

    def as_dict(self) -> dict[str, Any]:
        """The stage as plain numbers (`dsakv plan --json`'s `stages`)."""
        lay = self.layout
        return {
            "stage": self.stage,
            "layers": list(lay.held_layers),
            "num_target_layers": len(self.target),
            "num_full_layers": self.num_full_layers,
            "num_shared_layers": self.num_shared_layers,
            "index_k_layers": list(lay.index_k_layers),
            "bytes_per_token": lay.bytes_per_token,
            "bytes_per_token_elided": replace(lay, elide_index_k=True).bytes_per_token,
            "bytes_per_token_dense": lay.dense().bytes_per_token,
            "carried_sources": list(self.carried_sources),
            "carried_topk_bytes_per_token": self.carried_topk_bytes_per_token,
            "weight_bytes_per_rank": self.weight_bytes,
            "kv_budget_bytes": self.capacity.kv_budget_bytes,
            "max_total_num_tokens": self.capacity.max_total_num_tokens,
        }


@dataclass(frozen=True)
class PipelinePlan:
    """Every stage's plan; one scheduler addresses one slot space across the stages, so
    the engine's pool is the least any stage's budget holds (`limiting`)."""

    stages: tuple[StagePlan, ...]

    @property
    def limiting(self) -> StagePlan:
        """The stage whose budget holds the fewest tokens (the first such)."""
        return min(self.stages, key=lambda s: s.capacity.max_total_num_tokens)

    @property
    def max_total_num_tokens(self) -> int:
        return self.limiting.capacity.max_total_num_tokens

    @property
    def kv_budget_bytes(self) -> int:
        """The limiting stage's budget."""
        return self.limiting.capacity.kv_budget_bytes


def plan_pipeline(
    layout: CacheLayout,
    stages: Sequence[range],
    *,
    index_topk: int,
    config: ModelConfig | None = None,
    tp: int = 1,
    ep: int = 1,
    dp_attention: bool = False,
    **budget: Any,
) -> PipelinePlan:
    """Each stage of `stages` (`ParallelConfig.stage_layers`; one stage of every layer:
    the whole model) planned as `plan_capacity` plans a pool: its own layout
    (`layout.for_stage`) and, with `gpu_memory_gib` and no `weights_gib`, its own weights
    (`layout_weight_bytes` over its layers, from `config`). `budget`: `plan_capacity`'s
    other keywords, per rank (an explicit `weights_gib` is every rank's).
    """
    out = []
    priced = dict(config=config, tp=tp, ep=ep, dp_attention=dp_attention)
    for s, target in enumerate(stages):
        stage = layout.for_stage(target)
        try:
            cap = plan_capacity(stage, **priced, **budget)
        except ConfigError as e:
            if len(stages) == 1:
                raise
            raise ConfigError(  # (which stage: their weights differ)
                f"pipeline stage {s} (layers {spans(stage.held_layers)}): {e}"
            ) from None
        weight_bytes = cap.weight_bytes
        if weight_bytes is None and config is not None:  # (reported, not subtracted)
            weight_bytes = layout_weight_bytes(stage, config, tp, ep=ep, dp_attention=dp_attention)
        carried = layout.plan.carried_sources(target.start)
        topk_bytes = len(carried) * index_topk * TOPK_INDEX_BYTES
        out.append(StagePlan(s, target, stage, carried, topk_bytes, weight_bytes, cap))
    return PipelinePlan(tuple(out))


@dataclass(frozen=True)
class HiSparsePlan:
    """The device/host split of one layout under HiSparse (DESIGN.md §13).

    A device token is one latent slot in the device pool; each one is backed by
    `host_to_device_ratio` (r) logical tokens, whose latent lives on the host and whose
    index-K (on the layers that hold it: full and draft layers when elided, every layer
    when dense) stays on the device, because the indexer scores the whole history.
    Per device token the device pays `L·latent + N·index_k·r`; per logical token that is
    `L·latent/r + N·index_k`, and the host pays `L·latent`. The slot maps (logical →
    device slot, per-request LRU) are small and not counted, like `req_to_token`.

    Every figure is one rank's: each rank holds hot buffers (under TP a replica of rank
    0's, under DP attention its own requests'). What a node's host memory holds (a host
    latent its ranks map together under TP, one a rank under DP attention:
    `rank_host_bytes`) is the caller's to count.
    """

    layout: CacheLayout
    hisparse: HiSparseConfig
    kv_budget_bytes: int
    weight_bytes: int | None
    device_tokens: int  # device latent slots, page-aligned

    @property
    def ratio(self) -> int:
        return self.hisparse.host_to_device_ratio

    @property
    def device_latent_bytes_per_device_token(self) -> int:
        return self.layout.latent_bytes_per_token

    @property
    def device_index_k_bytes_per_device_token(self) -> int:
        return self.layout.index_k_bytes_per_token * self.ratio

    @property
    def device_bytes_per_device_token(self) -> int:
        """`L·latent + N·index_k·r`: one device latent slot and r tokens' index-K."""
        return (
            self.device_latent_bytes_per_device_token + self.device_index_k_bytes_per_device_token
        )

    @property
    def device_bytes_per_logical_token(self) -> float:
        """`L·latent/r + N·index_k` (fractional when r does not divide the latent)."""
        return self.device_bytes_per_device_token / self.ratio

    @property
    def host_bytes_per_token(self) -> int:
        """`L·latent`: every layer's latent for every logical token."""
        return self.layout.latent_bytes_per_token

    @property
    def logical_tokens(self) -> int:
        return self.device_tokens * self.ratio

    @property
    def host_bytes(self) -> int:
        """Host (pinned) memory the logical tokens need."""
        return self.logical_tokens * self.host_bytes_per_token

    @property
    def device_kv_bytes(self) -> int:
        """Device bytes the pool uses (at most the budget)."""
        return self.device_tokens * self.device_bytes_per_device_token

    @property
    def hot_buffer_slots(self) -> int:
        """Device latent slots per request: the buffer plus a reserved slot for each token a
        step computes, rounded up to whole pages, as the engine allocates it."""
        return self.hisparse.buffer_pages(self.layout.page_size) * self.layout.page_size

    @property
    def concurrent_hot_buffers(self) -> int:
        """How many requests' hot buffers the device latent slots hold at once."""
        return self.device_tokens // self.hot_buffer_slots

    @property
    def index_k_share(self) -> float:
        """Index-K's fraction of the device memory (0..1), independent of the budget."""
        return self.device_index_k_bytes_per_device_token / self.device_bytes_per_device_token

    def as_dict(self) -> dict[str, Any]:
        """The split as plain numbers (what `dsakv plan --json` reports)."""
        return {
            "elide_index_k": self.layout.elide_index_k,
            "device_bytes_per_device_token": self.device_bytes_per_device_token,
            "device_bytes_per_logical_token": self.device_bytes_per_logical_token,
            "host_bytes_per_token": self.host_bytes_per_token,
            "kv_budget_bytes": self.kv_budget_bytes,
            "device_tokens": self.device_tokens,
            "logical_tokens": self.logical_tokens,
            "host_bytes": self.host_bytes,
            "hot_buffer_slots": self.hot_buffer_slots,
            "concurrent_hot_buffers": self.concurrent_hot_buffers,
            "index_k_share": self.index_k_share,
        }


def plan_hisparse(layout: CacheLayout, hisparse: HiSparseConfig, **budget: Any) -> HiSparsePlan:
    """Device tokens = `floor(budget / (L·latent + N·index_k·r) / page_size) × page_size`.

    `budget` takes the keywords of `kv_budget_bytes` (one rank's device KV budget: its
    `tp`, `ep` and `dp_attention` price the weights per rank).
    """
    budget_bytes, weight_bytes = kv_budget_bytes(layout, **budget)
    empty = HiSparsePlan(layout, hisparse, budget_bytes, weight_bytes, 0)
    cell = empty.device_bytes_per_device_token
    tokens = _page_aligned_tokens(budget_bytes, cell, layout.page_size)
    return HiSparsePlan(layout, hisparse, budget_bytes, weight_bytes, tokens)


# The host tier's sizes, each with the spellings that set it (SGLang's fold into these)
HOST_GIB_FLAGS = "--host-pool-gib, --swap-space or SGLang's --hicache-size"
HOST_RATIO_FLAGS = "--host-pool-ratio or SGLang's --enable-hierarchical-cache / --hicache-ratio"


def host_tier_flag(gib: float, ratio: float | None) -> str | None:
    """The flag that sizes the host tier, with its spellings (for errors), or None where
    none asks for a tier; both is one ConfigError."""
    if gib > 0 and ratio is not None:
        raise ConfigError("--host-pool-gib and --host-pool-ratio both size the host tier: give one")
    return HOST_GIB_FLAGS if gib > 0 else None if ratio is None else HOST_RATIO_FLAGS


def host_tier_pages(gib: float, ratio: float | None, bytes_per_page: int, pool_pages: int) -> int:
    """The host tier's pages: as many whole `bytes_per_page` pages as `gib` GiB holds
    (`--host-pool-gib`), else `ratio` times the device pool's `pool_pages`
    (`--host-pool-ratio`, SGLang's `--hicache-ratio`: logical pages under HiSparse); 0
    where none asks for a tier. One that holds no page is a ValueError naming its flag."""
    flag = host_tier_flag(gib, ratio)
    if flag is None:
        return 0
    if gib > 0:
        pages, holds = int(gib * GIB // bytes_per_page), f"{gib:.3g} GiB"
        page = f"{bytes_per_page}-byte page"
    else:
        pages, holds, page = (
            int(pool_pages * ratio),
            f"{ratio} times the {pool_pages}-page pool",
            "page",
        )
    if pages < 1:
        raise ValueError(f"the host tier ({flag}): {holds} holds no {page}")
    return pages


def rank_host_bytes(
    layout: CacheLayout, tier_pages: int, logical_pages: int, hisparse: bool, writes_latent: bool
) -> int:
    """One rank's host memory: its host tier of `tier_pages` (index-K only where HiSparse's
    host latent is another rank's to write: `HostTierPlan`) and, under HiSparse, the host
    latent of `logical_pages` it holds and writes (`writes_latent`)."""
    tier = HostTierPlan.for_rank(layout, tier_pages, hisparse, writes_latent)
    if tier.index_k_only or not hisparse:
        return tier.nbytes
    return tier.nbytes + logical_pages * layout.page_size * layout.latent_bytes_per_token


@dataclass(frozen=True)
class HostTierPlan:
    """One rank's host KV tier: pages of the device pool's own cells, so shared layers hold
    no index-K there either (DESIGN.md §7.3), and elision buys host tokens as it buys
    device ones. `index_k_only`: a TP rank's under HiSparse on one machine, where a
    stage's ranks map its TP rank 0's host latent and that rank's tier alone holds latent."""

    layout: CacheLayout
    num_pages: int
    index_k_only: bool = False

    @classmethod
    def for_rank(
        cls, layout: CacheLayout, num_pages: int, hisparse: bool, writes_latent: bool
    ) -> HostTierPlan:
        """A rank's tier: index-K only under HiSparse where another rank writes the host
        latent this one maps (`dsakv.config.hisparse.writes_host_latent`)."""
        return cls(layout, num_pages, hisparse and not writes_latent)

    @property
    def tokens(self) -> int:
        return self.num_pages * self.layout.page_size

    @property
    def bytes_per_token(self) -> int:
        lay = self.layout
        return lay.index_k_bytes_per_token if self.index_k_only else lay.bytes_per_token

    @property
    def nbytes(self) -> int:
        return self.tokens * self.bytes_per_token


def node_sums(rank_bytes: Sequence[int], ranks_per_node: int) -> list[tuple[int, int]]:
    """Each node's host memory of the ranks' `rank_bytes` (ranks numbered node-major,
    `ranks_per_node` a node), and how many of its ranks hold some."""
    nodes = [rank_bytes[i : i + ranks_per_node] for i in range(0, len(rank_bytes), ranks_per_node)]
    return [(sum(node), sum(b > 0 for b in node)) for node in nodes]
