"""Model configuration and the layer plan."""

from .layer_plan import FULL, SHARED, LayerPlan
from .model import ModelConfig
from .presets import PRESETS, preset

__all__ = ["FULL", "SHARED", "PRESETS", "LayerPlan", "ModelConfig", "preset"]
