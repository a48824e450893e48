"""Model configuration and the layer plan."""

from .layer_plan import FULL, SHARED, LayerPlan, plan_overrides
from .model import ModelConfig
from .presets import PRESETS, preset

__all__ = ["FULL", "SHARED", "PRESETS", "LayerPlan", "ModelConfig", "plan_overrides", "preset"]
