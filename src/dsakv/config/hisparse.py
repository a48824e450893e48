"""`HiSparseConfig`: SGLang's `--hisparse-config` (DESIGN.md §13), parsed and checked.

HiSparse keeps every token's latent KV in (pinned) host memory and, per request, a hot
buffer of `device_buffer_size` latent slots per layer on the device. Index-K stays on the
device for every logical token; dsakv keeps it elided on shared layers.

`host_to_device_ratio` is an integer, as in SGLang: the host holds `r` logical tokens per
device latent slot, so logical tokens = device tokens × r stays a whole (page-aligned)
number. A float such as 2.5 is rejected rather than rounded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from dsakv.errors import ConfigError, is_int, load_object

if TYPE_CHECKING:
    from .parallel import ParallelConfig

HISPARSE_KEYS = ("top_k", "device_buffer_size", "host_to_device_ratio")
DEFAULT_HOST_TO_DEVICE_RATIO = 2
# The default buffer holds one top_k more than a step can select: 2 × top_k without
# speculative decoding (SGLang's: at exactly top_k the LRU thrashes at its boundary).
SPARE_TOP_K = 1
# The resolve kernels' sort keys pack a buffer entry's id in 16 bits; kernels/hisparse_ops.py
# (whose checks the Triton resolve runs too) imports this bound as its MAX_BUFFER.
MAX_DEVICE_BUFFER_SIZE = 1 << 16


def _check_int(name: str, value: Any, minimum: int, hint: str = "") -> int:
    if not is_int(value):
        raise ConfigError(f"hisparse-config {name} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"hisparse-config {name} must be >= {minimum}{hint}, got {value}")
    return value


def model_index_topk(model_config: Any) -> int:
    """The model's `index_topk` (a `ModelConfig` or a raw config dict); ConfigError if none.

    A model with an indexer always has one indexer layer: `LayerPlan` requires layer 0 to
    run it, so `index_topk` (and the indexer shapes) is all there is to check.
    """
    get = (
        model_config.get
        if isinstance(model_config, Mapping)
        else (lambda k, d=None: getattr(model_config, k, d))
    )
    topk, heads, dim = get("index_topk"), get("index_n_heads"), get("index_head_dim")
    if not all(is_int(v) and v > 0 for v in (topk, heads, dim)):
        raise ConfigError(
            "--enable-hisparse needs a DSA model with an indexer (index_topk, index_n_heads "
            f"and index_head_dim > 0); this model has index_topk={topk!r}"
        )
    return topk


@dataclass(frozen=True)
class HiSparseConfig:
    """Hot-buffer size and host:device ratio for HiSparse, with SGLang's key names.

    `step_tokens` is not one of them: the most tokens a decoding request computes in one
    step, 1 + its drafts under speculative decoding. Each has a reserved slot past the
    buffer, and the union of their top-k must fit the buffer at once (one attention launch
    reads it): device_buffer_size >= step_tokens × top_k."""

    top_k: int
    device_buffer_size: int
    host_to_device_ratio: int = DEFAULT_HOST_TO_DEVICE_RATIO
    step_tokens: int = 1

    def __post_init__(self) -> None:
        _check_int("top_k", self.top_k, 1)
        if not is_int(self.step_tokens) or self.step_tokens < 1:
            raise ConfigError(
                f"HiSparse step_tokens must be an integer >= 1, got {self.step_tokens!r}"
            )
        t = self.step_tokens
        least = t * self.top_k
        why = f" ({t} tokens a step × top_k {self.top_k})" if t > 1 else f" (top_k {self.top_k})"
        _check_int("device_buffer_size", self.device_buffer_size, least, why)
        if self.device_buffer_size > MAX_DEVICE_BUFFER_SIZE:
            raise ConfigError(
                f"hisparse-config device_buffer_size must be <= {MAX_DEVICE_BUFFER_SIZE} (the "
                f"HiSparse kernels pack a buffer entry's id in 16 bits), got {self.device_buffer_size}"
            )
        _check_int("host_to_device_ratio", self.host_to_device_ratio, 1)

    @classmethod
    def parse(
        cls, source: str | Mapping[str, Any] | None, model_config: Any, drafts: int = 0
    ) -> HiSparseConfig:
        """Read `--hisparse-config` (JSON text, a dict or None) and apply the defaults.

        `drafts`: the most a step verifies (speculative decoding), so step_tokens is
        1 + drafts. top_k defaults to the model's `index_topk`, device_buffer_size to
        (step_tokens + SPARE_TOP_K) × top_k (2 × top_k without drafts) and
        host_to_device_ratio to 2.
        Raises one ConfigError per problem: invalid JSON, not an object, unknown keys,
        non-integer or out-of-range values, a top_k other than the model's (the hot buffer
        must hold what one indexer step selects), or a model without an indexer.
        """
        raw = cls.read(source)
        index_topk = model_index_topk(model_config)
        top_k = _check_int("top_k", raw.get("top_k", index_topk), 1)
        if top_k != index_topk:
            raise ConfigError(
                f"hisparse-config top_k {top_k} must be this model's index_topk ({index_topk}): "
                "the indexer selects index_topk positions per step"
            )
        step_tokens = 1 + drafts
        default = (step_tokens + SPARE_TOP_K) * top_k
        buffer = raw.get("device_buffer_size", default)
        ratio = raw.get("host_to_device_ratio", DEFAULT_HOST_TO_DEVICE_RATIO)
        return cls(top_k, buffer, ratio, step_tokens)

    @staticmethod
    def read(source: str | Mapping[str, Any] | None) -> Mapping[str, Any]:
        """The keys `--hisparse-config` gives: what can be checked without the model (a
        bench checks it before it writes one)."""
        if isinstance(source, str):
            source = source.strip() or "{}"
        return load_object({} if source is None else source, HISPARSE_KEYS, "--hisparse-config")

    @property
    def buffer_slots(self) -> int:
        """Device latent slots one hot buffer holds: its entries, then one reserved slot per
        token a step computes."""
        return self.device_buffer_size + self.step_tokens

    def buffer_pages(self, page_size: int) -> int:
        """Pages one hot buffer takes (`buffer_slots`)."""
        return -(-self.buffer_slots // page_size)

    def check_pool(self, latent_pages: int, page_size: int) -> None:
        """A device latent pool of `latent_pages` pages holds one hot buffer, or no request
        could ever be admitted."""
        s, pages = self.device_buffer_size, self.buffer_pages(page_size)
        if pages > latent_pages:
            raise ConfigError(
                f"HiSparse: the device latent pool ({latent_pages * page_size} tokens) holds less "
                f"than one hot buffer (device_buffer_size {s} + {self.step_tokens} reserved, "
                f"{pages} pages): give the pool more pages or the buffer fewer slots"
            )

    def to_dict(self) -> dict[str, int]:
        """SGLang's keys."""
        return {k: v for k, v in asdict(self).items() if k in HISPARSE_KEYS}


def shares_host_latent(parallel: ParallelConfig) -> bool:
    """Whether a pipeline stage's TP ranks map one host latent (`machine_shared_empty`):
    under TP (and EP) on one machine, where every rank's latent is a replica of its stage's
    TP rank 0's. Across machines, or under DP attention (each rank's own requests'), each
    rank holds its own, as every rank does under SGLang's per-rank host pools."""
    return parallel.tp > 1 and parallel.nnodes == 1 and not parallel.dp_attention


def writes_host_latent(parallel: ParallelConfig, tp_rank: int) -> bool:
    """Whether the rank of TP rank `tp_rank` in its stage holds and writes a host latent:
    one of its own, or as its stage's TP rank 0 the one that stage's ranks map
    (`shares_host_latent`; the others' host tiers then hold index-K only)."""
    return not shares_host_latent(parallel) or tp_rank == 0
