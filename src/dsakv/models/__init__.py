"""DSA model execution over the paged KV pool."""

from .dsa import DSAForCausalLM
from .forward_batch import ForwardBatch
from .indexer import Selection
from .loader import load_model
from .tiny import TINY_PRESETS, default_model_dir, write_tiny_model

__all__ = [
    "TINY_PRESETS",
    "DSAForCausalLM",
    "ForwardBatch",
    "Selection",
    "default_model_dir",
    "load_model",
    "write_tiny_model",
]
