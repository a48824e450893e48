"""Engine: requests, scheduler, prefix cache, sampler, the step loop (`engine`, its
arguments in `config`; sleep mode, weight updates, profiles and the expert distribution,
its mixins, in `sleep`, `weight_update`, `profiler`, `expert_distribution`, their outcomes
read alike in `ranks`), the `LLM` API (with beam search in `beam_search`, scoring in
`score`, server info in `info`), and what runs engines on several ranks (`launch`, DP
attention in `dp`)."""

from .beam_search import BeamSearchParams
from .config import EngineConfig
from .engine import Engine
from .llm import (
    LLM,
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    Logprob,
    RequestOutput,
)
from .lora import LoRARequest
from .request import Request, Status
from .sampling import RepetitionDetectionParams, SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "LoRARequest",
    "Logprob",
    "RepetitionDetectionParams",
    "Request",
    "RequestOutput",
    "SamplingParams",
    "Status",
    "StructuredOutputsParams",
]
