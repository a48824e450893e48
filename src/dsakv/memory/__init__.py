"""KV memory: cache layout and bytes, capacity planning, page allocator, pools."""

from .allocator import OutOfPages, PageAllocator, PageError, ReqToTokenTable, page_slots
from .capacity import (
    CapacityPlan,
    HiSparsePlan,
    PipelinePlan,
    StagePlan,
    estimate_weight_bytes,
    kv_budget_bytes,
    plan_capacity,
    plan_hisparse,
    plan_pipeline,
)
from .fp8 import dequantize_e4m3_blockwise, hadamard_rotate, quantize_e4m3_blockwise
from .host import HostPool
from .layout import INDEX_K_DTYPES, LATENT_DTYPES, CacheLayout, LayerNotHeldError
from .pool import (
    DSAKVPool,
    SharedLayerIndexKError,
    TransferDescriptor,
    allocation_failed,
    copy_tokens,
    huge_page_empty_like,
)

__all__ = [
    "allocation_failed",
    "INDEX_K_DTYPES",
    "LATENT_DTYPES",
    "CacheLayout",
    "CapacityPlan",
    "DSAKVPool",
    "HiSparsePlan",
    "HostPool",
    "LayerNotHeldError",
    "OutOfPages",
    "PageAllocator",
    "PageError",
    "PipelinePlan",
    "ReqToTokenTable",
    "SharedLayerIndexKError",
    "StagePlan",
    "TransferDescriptor",
    "copy_tokens",
    "huge_page_empty_like",
    "dequantize_e4m3_blockwise",
    "estimate_weight_bytes",
    "hadamard_rotate",
    "kv_budget_bytes",
    "page_slots",
    "plan_capacity",
    "plan_hisparse",
    "plan_pipeline",
    "quantize_e4m3_blockwise",
]
