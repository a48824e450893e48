"""Engine: requests, scheduler, prefix cache, sampler, the step loop, the `LLM` API, and
what runs engines on several ranks (`launch`, DP attention in `dp`)."""

from .engine import Engine, EngineConfig
from .llm import LLM, CompletionOutput, Logprob, RequestOutput
from .request import Request, Status
from .sampling import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "Logprob",
    "Request",
    "RequestOutput",
    "SamplingParams",
    "Status",
]
