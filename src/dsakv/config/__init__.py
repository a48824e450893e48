"""Model configuration and the layer plan."""

from .hisparse import HiSparseConfig
from .kv_events import KVEventsConfig
from .layer_plan import FULL, SHARED, LayerPlan, plan_overrides
from .model import ModelConfig
from .presets import PRESETS, preset

__all__ = [
    "FULL",
    "SHARED",
    "PRESETS",
    "HiSparseConfig",
    "KVEventsConfig",
    "LayerPlan",
    "ModelConfig",
    "plan_overrides",
    "preset",
]
