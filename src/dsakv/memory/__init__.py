"""KV memory: cache layout and bytes, capacity planning, page allocator, pools."""

from .capacity import CapacityPlan, estimate_weight_bytes, plan_capacity
from .layout import INDEX_K_DTYPES, LATENT_DTYPES, CacheLayout

__all__ = [
    "INDEX_K_DTYPES",
    "LATENT_DTYPES",
    "CacheLayout",
    "CapacityPlan",
    "estimate_weight_bytes",
    "plan_capacity",
]
