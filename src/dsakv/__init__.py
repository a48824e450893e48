"""dsakv: DeepSeek Sparse Attention inference with layer-aware index-K elision."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "BeamSearchParams",
    "LoRARequest",
    "Logprob",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # Lazy so `dsakv plan` and `import dsakv.config` stay light.
    if name in __all__ and name != "__version__":
        from dsakv import engine

        return getattr(engine, name)
    raise AttributeError(name)
