"""Engine: requests, scheduler, prefix cache, sampler, the step loop, the `LLM` API (with
beam search in `beam_search`, scoring in `score`, server info in `info`), and what runs
engines on several ranks (`launch`, DP attention in `dp`)."""

from .beam_search import BeamSearchParams
from .engine import Engine, EngineConfig
from .llm import (
    LLM,
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    Logprob,
    RequestOutput,
)
from .request import Request, Status
from .sampling import RepetitionDetectionParams, SamplingParams

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "Logprob",
    "RepetitionDetectionParams",
    "Request",
    "RequestOutput",
    "SamplingParams",
    "Status",
]
