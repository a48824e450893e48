"""`LLM`: offline batch generation, the way vLLM and SGLang users expect it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from dsakv.errors import DsakvError

from .engine import EngineConfig
from .launch import create_engine
from .request import Request
from .sampling import SamplingParams


@dataclass(frozen=True)
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    metrics: dict[str, float | int | None]
    # With `SamplingParams(prompt_logprobs=k)`: teacher-forced logprob of each prompt token
    # (None for the first) and its top-k alternatives, as vLLM returns them.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    error: str | None = None  # why it failed alone (finish_reason "error")

    @classmethod
    def from_request(cls, req: Request) -> RequestOutput:
        m = req.metrics
        return cls(
            prompt_token_ids=list(req.prompt_ids),
            token_ids=list(req.output_ids),
            text=req.output_text,
            finish_reason=req.finish_reason or "",
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            top_logprobs=list(req.top_logprobs) if req.params.logprobs is not None else None,
            metrics={
                "ttft_s": m.ttft,
                "latency_s": m.latency,
                "prefix_hit_tokens": m.prefix_hit_tokens,
                "retractions": m.retractions,
                "spec_draft_tokens": m.draft_tokens,
                "spec_accepted_tokens": m.accepted_tokens,
                "prompt_tokens": len(req.prompt_ids),
                "output_tokens": len(req.output_ids),
            },
            prompt_logprobs=_copy(req.prompt_logprobs),
            prompt_top_logprobs=_copy(req.prompt_top_logprobs),
            error=req.error,
        )


class LLM:
    """`LLM(model_path, **engine_args).generate(prompts, params)`."""

    def __init__(self, model: str | EngineConfig, **engine_args: Any) -> None:
        if isinstance(model, EngineConfig):
            config = dataclasses.replace(model, **engine_args) if engine_args else model
        else:
            config = EngineConfig.from_kwargs(model, **engine_args)
        self.engine = create_engine(config)

    def close(self) -> None:
        """Stop the other ranks (with `tp > 1`); the object is unusable afterwards."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Complete every prompt (text or token ids); outputs come back in input order."""
        prompts = _as_prompt_list(prompts)
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        reqs = []
        try:
            for p, sp in zip(prompts, plist):
                reqs.append(self.engine.add_request(p, sp))
        except BaseException:  # a bad prompt further on: none of this call's requests stay
            for r in reqs:
                self.engine.abort(r.rid)
            raise
        bar = tqdm(total=len(reqs), desc="generate", disable=not use_tqdm)
        while self.engine.has_unfinished():
            done = sum(1 for r in self.engine.step() if r.finished)
            bar.update(done)
        bar.close()
        return [RequestOutput.from_request(r) for r in reqs]


def _copy(xs: list | None) -> list | None:
    return None if xs is None else list(xs)


def _as_prompt_list(prompts: Any) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    out = []
    for p in prompts:
        if not isinstance(p, str) and not (
            isinstance(p, Sequence) and all(isinstance(t, int) for t in p)
        ):
            raise DsakvError(f"a prompt is a string or a list of token ids, got {p!r}")
        out.append(p if isinstance(p, str) else list(p))
    return out
