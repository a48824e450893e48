"""KV memory: cache layout and bytes, capacity planning, page allocator, pools.

The layout, the planner and storage import no torch: the CLI's parser and `dsakv plan`
read them, and answer in 0.2 s, not 2-3. The allocator, the pools and the fp8 helpers
(torch's) load on first use of a name below."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
from .layout import INDEX_K_DTYPES, LATENT_DTYPES, CacheLayout, LayerNotHeldError

if TYPE_CHECKING:
    from .allocator import OutOfPages, PageAllocator, PageError, ReqToTokenTable, page_slots
    from .fp8 import dequantize_e4m3_blockwise, hadamard_rotate, quantize_e4m3_blockwise
    from .host import HostPool
    from .pool import (
        DSAKVPool,
        SharedLayerIndexKError,
        TransferDescriptor,
        allocation_failed,
        copy_tokens,
        huge_page_empty_like,
    )

_TORCH_NAMES = {  # (the names of the TYPE_CHECKING imports above, by module)
    "allocator": ("OutOfPages", "PageAllocator", "PageError", "ReqToTokenTable", "page_slots"),
    "fp8": ("dequantize_e4m3_blockwise", "hadamard_rotate", "quantize_e4m3_blockwise"),
    "host": ("HostPool",),
    "pool": (
        "DSAKVPool",
        "SharedLayerIndexKError",
        "TransferDescriptor",
        "allocation_failed",
        "copy_tokens",
        "huge_page_empty_like",
    ),
}
_MODULE_OF = {name: module for module, names in _TORCH_NAMES.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # (found once: the next access is a plain attribute)
    return value


def __dir__() -> list[str]:  # (what `dir`, and so tab completion, lists: the lazy names too)
    return sorted({*globals(), *__all__})


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
