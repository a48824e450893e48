"""Capacity planning: weights per rank, the KV budget, and `max_total_num_tokens`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsakv.config import HiSparseConfig, LayerPlan, ModelConfig
from dsakv.errors import ConfigError

from .layout import CacheLayout

GIB = 1 << 30
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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
) -> WeightEstimate:
    """Per-rank weight bytes from the config shapes, sharded as the model is (DESIGN.md §8).

    Replicated on every rank: q_a / kv_a projections, norms, the MoE router and the
    indexer. Split over the attention group (`tp` ranks, or 1 under DP attention): q_b,
    kv_b and o_proj by heads, embedding and lm_head by vocab (padded to equal parts).
    Split over all `tp` ranks: the dense MLP, shared experts and routed experts (`ep`
    groups of whole experts, each expert's intermediate size over `tp / ep` ranks; either
    way 1/tp of them). Linear layers count in the checkpoint dtype, or at one byte plus
    an fp32 scale per 128×128 block when fp8 block-quantised; the rest in the checkpoint
    dtype (16-bit for real checkpoints).
    """
    if tp < 1:
        raise ConfigError(f"tp must be >= 1, got {tp}")
    if ep < 1 or tp % ep:
        raise ConfigError(f"ep must divide tp ({tp}), got {ep}")
    c = config
    attn_tp = 1 if dp_attention else tp
    wide = _DTYPE_BYTES.get(c.dtype.replace("torch.", ""), 2)
    linear = 1 + 4 / (128 * 128) if c.is_fp8_block_quantized else wide
    h, heads = c.hidden_size, c.num_attention_heads
    attn_replicated = h * c.q_lora_rank + h * (c.kv_lora_rank + c.qk_rope_head_dim)
    attn_sharded = (
        c.q_lora_rank * heads * c.qk_head_dim
        + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
        + heads * c.v_head_dim * h
    )
    dense_mlp = 3 * h * c.intermediate_size
    moe = 3 * h * c.moe_intermediate_size * (c.n_routed_experts + c.n_shared_experts)
    router = h * c.n_routed_experts + c.n_routed_experts
    norms = c.q_lora_rank + c.kv_lora_rank + 2 * h

    n_dense = min(c.first_k_dense_replace, c.num_hidden_layers)
    n_layers = plan.num_total_layers
    n_moe = n_layers - n_dense
    ffn = n_dense * dense_mlp + n_moe * moe
    vocab_rows = -(-c.vocab_size // attn_tp)  # this rank's (padded) vocab split
    embed = (1 if c.tie_word_embeddings else 2) * vocab_rows * h
    idx_params = _indexer_params(c)
    n_indexers = len(plan.index_k_layers)
    total = (
        n_layers * attn_replicated * linear
        + n_layers * attn_sharded * linear / attn_tp
        + ffn * linear / tp
        + embed * wide
        + (n_layers * norms + n_moe * router + h) * wide
        + n_indexers * idx_params * wide
        # Each MTP layer's own head: eh_proj [H, 2H] (replicated), enorm, hnorm, final norm.
        + plan.num_draft_layers * (2 * h * h * linear + 3 * h * wide)
    )
    return WeightEstimate(
        total_bytes=int(total),
        indexer_bytes=n_indexers * idx_params * wide,
        indexer_bytes_saved=plan.num_shared_layers * idx_params * wide,
        indexer_params_per_layer=idx_params,
    )


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
) -> tuple[int, int | None]:
    """The device KV budget in bytes, and the weight bytes it subtracted (None if explicit).

    The budget is explicit (`kv_budget_gib`) or `gpu_memory × mem_fraction_static −
    weights − reserve`, with weights from `weights_gib` or estimated from `config`.
    """
    weight_bytes = None
    if kv_budget_gib is not None:
        budget = kv_budget_gib * GIB
        if budget <= 0:
            raise ConfigError(f"kv budget must be > 0 GiB, got {kv_budget_gib}")
    elif gpu_memory_gib is not None:
        if gpu_memory_gib <= 0:
            raise ConfigError(f"gpu memory must be > 0 GiB, got {gpu_memory_gib}")
        if not 0 < mem_fraction_static <= 1:
            raise ConfigError(f"mem_fraction_static must be in (0, 1], got {mem_fraction_static}")
        if weights_gib is not None:
            if weights_gib < 0:
                raise ConfigError(f"weights must be >= 0 GiB, got {weights_gib}")
            weight_bytes = int(weights_gib * GIB)
        elif config is not None:
            weight_bytes = estimate_weight_bytes(config, layout.plan, tp).total_bytes
        else:
            raise ConfigError("need weights_gib or a model config to estimate the weights")
        budget = gpu_memory_gib * mem_fraction_static * GIB - weight_bytes - reserve_gib * GIB
        if budget <= 0:
            raise ConfigError(
                f"no memory left for the KV cache: {gpu_memory_gib} GiB × {mem_fraction_static} "
                f"− weights {weight_bytes / GIB:.2f} GiB − reserve {reserve_gib} GiB ≤ 0"
            )
    else:
        raise ConfigError("give a KV budget (kv_budget_gib) or gpu_memory_gib")
    return int(budget), weight_bytes


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
) -> CapacityPlan:
    """`max_total_num_tokens = floor(budget / cell / page_size) × page_size`.

    The budget is explicit (`kv_budget_gib`) or `gpu_memory × mem_fraction_static −
    weights − reserve`, with weights from `weights_gib` or estimated from `config`.
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
    )
    tokens = _page_aligned_tokens(budget, layout.bytes_per_token, layout.page_size)
    return CapacityPlan(layout, budget, weight_bytes, tokens)


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
        """Device latent slots per request: the buffer plus one page (its newest token)."""
        return self.hisparse.device_buffer_size + self.layout.page_size

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

    `budget` takes the keywords of `kv_budget_bytes` (the device KV budget).
    """
    budget_bytes, weight_bytes = kv_budget_bytes(layout, **budget)
    empty = HiSparsePlan(layout, hisparse, budget_bytes, weight_bytes, 0)
    cell = empty.device_bytes_per_device_token
    tokens = _page_aligned_tokens(budget_bytes, cell, layout.page_size)
    return HiSparsePlan(layout, hisparse, budget_bytes, weight_bytes, tokens)
