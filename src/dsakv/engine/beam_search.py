"""Beam search as vLLM runs it: on top of the engine, one token a step for every live beam.

Each step, every live beam is a request of its own whose prompt is the beam's tokens so far
(one token sampled, with the 2 * beam_width likeliest tokens' logprobs: `step_params`); the
prefix cache holds the pages the beam's earlier steps computed, so a step computes little
more than its last partial page and its new token. A beam's candidates are the token it
sampled and those likeliest ones. A candidate that is an EOS (or one of `stop_token_ids`, or
that completes a `stop` string) is finished; the best `beam_width` of the others by score
(`beam_score`) live on. After `max_tokens` steps, or once no beam lives, the best
`beam_width` of the finished and the live are the result, best first.

`LLM.beam_search` and the server's `use_beam_search` run the steps through their usual
request paths (`BeamSearch.prompts`, then `BeamSearch.advance`): how requests run is theirs,
what the search makes of them is this module's."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dsakv.errors import DsakvError, is_int, is_number

from .detokenizer import TokenTexts
from .engine import Engine, find_stop
from .request import Request, Status
from .sampling import MAX_LOGPROBS, SamplingParams

# Each step asks for 2 * beam_width logprobs, and a request gets at most MAX_LOGPROBS
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's `BeamSearchParams`, checked on creation. `stop` and `stop_token_ids` are
    dsakv's: they end a beam as an EOS does (vLLM's beam search has neither; its server
    takes `stop` and ignores it). The token or stop string that ended a beam stays in its
    output only with `include_stop_str_in_output`."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not (is_int(self.beam_width) and 1 <= self.beam_width <= MAX_BEAM_WIDTH):
            raise DsakvError(
                f"invalid beam search params: beam_width must be an integer in "
                f"1..{MAX_BEAM_WIDTH} (each step scores 2 * beam_width tokens, and logprobs "
                f"are {MAX_LOGPROBS} at most), got {self.beam_width!r}",
                "beam_width",
            )
        if not (is_int(self.max_tokens) and self.max_tokens >= 1):
            raise DsakvError(
                f"invalid beam search params: max_tokens must be an integer >= 1, "
                f"got {self.max_tokens!r}",
                "max_tokens",
            )
        if not (is_number(self.length_penalty) and math.isfinite(self.length_penalty)):
            raise DsakvError(
                "invalid beam search params: length_penalty must be a finite number, "
                f"got {self.length_penalty!r}",
                "length_penalty",
            )
        # The fields SamplingParams has too are checked (and a lone stop string listed) there.
        checked = SamplingParams(
            temperature=self.temperature,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
        )
        object.__setattr__(self, "stop", checked.stop)
        object.__setattr__(self, "stop_token_ids", checked.stop_token_ids)

    def step_params(self, logprobs: int | None = None, **extra: Any) -> SamplingParams:
        """One beam's request in a step: one token at `temperature`, with the logprobs of
        the 2 * beam_width likeliest (of `logprobs` likeliest, where a client asked for
        more); `extra`: other `SamplingParams` fields it carries (cache_salt, priority,
        seed, lora_name). Stops are the search's business, not the request's."""
        most = max(2 * self.beam_width, logprobs or 0)
        return SamplingParams(
            max_tokens=1, temperature=self.temperature, logprobs=most, detokenize=False, **extra
        )


def beam_score(length: int, cum_logprob: float, length_penalty: float) -> float:
    """vLLM's `get_beam_search_score` (transformers' before it): the cumulative logprob over
    the sequence's length to the `length_penalty`, the length counting the prompt's tokens
    and the output's, less an EOS or stop token that ended it."""
    return cum_logprob / length**length_penalty


def step_failed(why: str) -> DsakvError:
    """A step's request came back without its token (`why`): the search cannot go on."""
    return DsakvError(f"a beam search step failed: {why}")


@dataclass(frozen=True)
class Step:
    """A beam's request in a step, as it came back: the token it sampled, that token's
    logprob and rank (None: not known), and the likeliest tokens with their logprobs."""

    token: int
    logprob: float
    rank: int | None
    top: Sequence[tuple[int, float]]

    @classmethod
    def of(cls, req: Request) -> Step:
        if req.error is not None or not req.output_ids or not req.top_logprobs:
            raise step_failed(req.error or f"it ended without a token ({req.finish_reason})")
        return cls(req.output_ids[0], req.logprobs[0], req.ranks[0], req.top_logprobs[0])

    def candidates(self, width: int) -> list[tuple[int, float]]:
        """vLLM's: the sampled token, then the 2 * `width` likeliest, each once."""
        top = [(t, x) for t, x in self.top[: 2 * width] if t != self.token]
        return [(self.token, self.logprob), *top]

    def rank_of(self, token: int) -> int | None:
        if token == self.token:
            return self.rank
        return next(i for i, (t, _) in enumerate(self.top, 1) if t == token)


@dataclass(frozen=True)
class _Beam:
    output: list[int] = field(default_factory=list)
    cum_logprob: float = 0.0
    # each output token's (logprob, rank, its step's likeliest tokens)
    positions: list[tuple[float, int | None, Sequence[tuple[int, float]]]] = field(
        default_factory=list
    )
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    by_token: bool = False  # an EOS or stop token ended it: not counted in its length
    text: str = ""  # its output's text (decoded only where stop strings are looked for)


class BeamSearch:
    """One prompt's search (module docstring). `engine` gives the EOS ids, the context's
    length and the tokenizer; `skip_special_tokens` is the output text's (the server's
    request field)."""

    def __init__(
        self,
        engine: Engine,
        prompt_ids: list[int],
        params: BeamSearchParams,
        skip_special_tokens: bool = True,
    ) -> None:
        # a stop string needs a tokenizer, a stop token the vocabulary (the engine's checks)
        stops = SamplingParams(stop=params.stop, stop_token_ids=params.stop_token_ids)
        engine.check_request(stops)
        self.prompt, self.params = list(prompt_ids), params
        self.eos = frozenset(() if params.ignore_eos else engine.eos_token_ids)
        self.stop_ids = frozenset(params.stop_token_ids)
        # (an output's text is what it adds to the prompt's, as a request's)
        tok, self.skip = engine.tokenizer, skip_special_tokens
        self.texts = None if tok is None else TokenTexts(tok, self.skip, False, self.prompt)
        self._stops = stops.stops_by_last
        # Each step's prompt is shorter than the context (a request's, `Engine.prompt_ids`)
        self.steps_left = min(params.max_tokens, engine.max_model_len - len(self.prompt))
        # A score divides by its length to the length_penalty: a float at every length up
        # to the longest, or the search would fail mid-way (OverflowError, or 0.0 a divisor)
        longest, penalty = len(self.prompt) + self.steps_left, params.length_penalty
        try:
            longest ** abs(penalty)
        except OverflowError:
            raise DsakvError(
                f"invalid beam search params: length_penalty {penalty} is out of range: a "
                f"{longest}-token sequence's score divides by {longest} ** {penalty}, past a "
                "float's range",
                "length_penalty",
            ) from None
        self.live: list[_Beam] = [_Beam()]
        self.finished: list[_Beam] = []

    @property
    def done(self) -> bool:
        return not self.live

    def prompts(self) -> list[list[int]]:
        """This step's requests' prompts: each live beam's tokens."""
        return [self.prompt + b.output for b in self.live]

    def advance(self, steps: Sequence[Step]) -> None:
        """Take this step's requests as they came back, one per live beam (`prompts`'
        order); the beams still going after `max_tokens` tokens end by "length"."""
        width = self.params.beam_width
        grown: list[_Beam] = []
        for beam, step in zip(self.live, steps, strict=True):
            for token, logprob in step.candidates(width):
                child = self._grown(beam, step, token, logprob)
                (grown if child.finish_reason is None else self.finished).append(child)
        grown.sort(key=self.score, reverse=True)  # (stable: ties keep vLLM's order)
        self.live = grown[:width]
        self.steps_left -= 1
        if self.steps_left <= 0:
            self.finished += [replace(b, finish_reason="length") for b in self.live]
            self.live = []

    def _grown(self, beam: _Beam, step: Step, token: int, logprob: float) -> _Beam:
        grown = _Beam(
            beam.output + [token],
            beam.cum_logprob + logprob,
            beam.positions + [(logprob, step.rank_of(token), step.top)],
        )
        if token in self.eos or token in self.stop_ids:
            reason = None if token in self.eos else token  # (the engine's stop_reason)
            return replace(grown, finish_reason="stop", stop_reason=reason, by_token=True)
        if not self._stops:
            return grown
        text = self.texts.text(grown.output)
        hit = find_stop(text, self._stops, len(beam.text.rstrip("\ufffd")))
        if hit is None:
            return replace(grown, text=text)
        cut, stop = hit
        kept = text[: cut + (len(stop) if self.params.include_stop_str_in_output else 0)]
        return replace(grown, finish_reason="stop", stop_reason=stop, text=kept)

    def score(self, beam: _Beam) -> float:
        length = len(self.prompt) + len(beam.output) - beam.by_token
        return beam_score(length, beam.cum_logprob, self.params.length_penalty)

    def results(self, logprobs: int | None = None) -> list[tuple[Request, float]]:
        """Once `done`: the best `beam_width` sequences, best first, each as a finished
        `Request` (read back as any request is: its output, text, finish and stop reasons,
        and with `logprobs` each token's logprob and its step's `logprobs` likeliest), with
        its cumulative logprob, which counts the EOS or stop token that ended it even where
        the output leaves it out (vLLM's)."""
        best = sorted(self.finished, key=self.score, reverse=True)[: self.params.beam_width]
        return [(self._request(b, logprobs), b.cum_logprob) for b in best]

    def _request(self, beam: _Beam, logprobs: int | None) -> Request:
        p = self.params
        end = len(beam.output) - (beam.by_token and not p.include_stop_str_in_output)
        params = SamplingParams(
            max_tokens=p.max_tokens,
            logprobs=logprobs,
            skip_special_tokens=self.skip,
            include_stop_str_in_output=p.include_stop_str_in_output,
        )
        req = Request(list(self.prompt), params, output_ids=beam.output[:end])
        req.status = Status.FINISHED
        req.finish_reason, req.stop_reason = beam.finish_reason, beam.stop_reason
        if logprobs is not None:
            kept = beam.positions[:end]
            req.logprobs = [x for x, _, _ in kept]
            req.ranks = [r for _, r, _ in kept]
            req.top_logprobs = [list(top[:logprobs]) for _, _, top in kept]
        if self.texts is not None:
            cut = beam.finish_reason == "stop" and isinstance(beam.stop_reason, str)
            req.output_text = beam.text if cut else self.texts.text(req.output_ids, end=True)
        return req


def live_prompts(searches: Iterable[BeamSearch]) -> list[list[int]]:
    """One step of several searches: every live beam's prompt, search by search (the
    order `advance_all` reads the step's requests back in)."""
    return [p for s in searches if not s.done for p in s.prompts()]


def advance_all(searches: Iterable[BeamSearch], steps: Iterable[Step]) -> None:
    """`BeamSearch.advance` of each live search with its beams' share of `steps`, the
    step's requests as they came back in `live_prompts`' order."""
    steps = iter(steps)
    for s in [s for s in searches if not s.done]:
        s.advance(list(itertools.islice(steps, len(s.live))))
