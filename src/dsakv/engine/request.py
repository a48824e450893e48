"""`Request`: one generation's tokens, pages, state and metrics."""

from __future__ import annotations

import enum
import functools
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .lora import LoraRef
from .prefix_cache import CacheKey, LoraNamespace, root_hash
from .sampling import SamplingParams, ThinkingBudget

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"  # queued, or retracted and waiting to resume
    RUNNING = "running"  # holds pages; prefilling or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Choices:
    """The `n` choices of one request, as the metrics count them (vLLM's `ParentRequest`:
    its n and the most tokens a choice generated, observed once all have ended)."""

    n: int
    ended_choices: int = 0
    most_tokens: int = 0

    def ended(self, tokens: int) -> bool:
        """One choice ended with `tokens` generated; True for the last of them."""
        self.ended_choices += 1
        self.most_tokens = max(self.most_tokens, tokens)
        return self.ended_choices == self.n


def link_choices(reqs: list[Request]) -> list[Request]:
    """`reqs`, one request's choices, sharing one `Choices` (a lone one needs none)."""
    if len(reqs) > 1:
        choices = Choices(len(reqs))
        for r in reqs:
            r.metrics.choices = choices
    return reqs


@dataclass
class RequestMetrics:
    arrival_time: float = field(default_factory=time.perf_counter)
    scheduled_time: float | None = None  # its first admission (vLLM's scheduled_ts)
    first_token_time: float | None = None
    finish_time: float | None = None
    prefix_hit_tokens: int = 0
    retractions: int = 0
    draft_tokens: int = 0  # drafts the target checked (MTP or n-gram)
    accepted_tokens: int = 0  # ... and kept
    # Summed over the steps it ran in, with `collect_detailed_traces` only (its span's
    # time_in_scheduler, time_in_model_execute and time_in_model_forward: `Engine._step`)
    scheduler_time: float = 0.0
    execute_time: float = 0.0
    forward_time: float = 0.0
    choices: Choices | None = None  # its request's n choices, where n > 1 (`link_choices`)

    def scheduled(self) -> None:
        """Stamp its first admission; a retracted request's later ones keep it."""
        if self.scheduled_time is None:
            self.scheduled_time = time.perf_counter()

    @property
    def queued(self) -> float | None:
        return _took(self.arrival_time, self.scheduled_time)

    @property
    def ttft(self) -> float | None:
        return _took(self.arrival_time, self.first_token_time)

    @property
    def latency(self) -> float | None:
        return _took(self.arrival_time, self.finish_time)

    # vLLM's phases of a finished request (its finish stamp is its last token's): queued,
    # then prefill to the first token, decode to the last; inference is both
    @property
    def prefill(self) -> float | None:
        return _took(self.scheduled_time, self.first_token_time)

    @property
    def decode(self) -> float | None:
        return _took(self.first_token_time, self.finish_time)

    @property
    def inference(self) -> float | None:
        return _took(self.scheduled_time, self.finish_time)


def _took(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


@dataclass
class DraftLength:
    """How many drafts a request proposes next, adapted to how many the target keeps
    (`Drafter.adapt`). `k` 0: none, for `wait` more decode steps, then one draft as a
    probe; `backoff` is the wait after the next probe that fails. `seen` is its metrics'
    `(draft_tokens, accepted_tokens)` when `k` was last set, `proposed` how many drafts it
    was handed then. `owed`: the target's h rows of positions `owed_from`.. whose draft KV
    a wait put off (`MTPDrafter.settle` writes it)."""

    k: int
    wait: int = 0
    backoff: int = 1
    seen: tuple[int, int] = (0, 0)
    proposed: int = 0
    owed_from: int = 0
    owed: list[torch.Tensor] = field(default_factory=list)


@dataclass(eq=False)
class Capture:
    """The rows a request asked to get back, one per position it ran (SGLang's
    return_routed_experts and return_hidden_states): `routed[p - start]` the experts
    position p's token was routed to in each layer, `hidden[p - start]` its final-normed
    hidden state, on the host, by position from `start` (the first one asked for: a
    multi-turn rollout's last turn may start deep in its context, whose rows no one reads).
    A position run again (recomputed after a retraction; an MTP draft's, rejected, then run
    as the next step's token) is written over, so each position below the request's last
    holds what its own token gave. Positions `start` to `filled` - 1 are known: the prefix
    cache may serve a request the positions before the later of the two
    (`Scheduler._hit_pages`)."""

    start: int
    routed: torch.Tensor | None = None  # [positions from start, layers, top_k] int32
    hidden: torch.Tensor | None = None  # [positions from start, hidden]
    filled: int = 0

    def write(self, pos: int, routed: torch.Tensor | None, hidden: torch.Tensor | None) -> None:
        """Rows for positions `pos`.. (host tensors, one row each); those before `start`
        are dropped."""
        n = (routed if routed is not None else hidden).shape[0]
        skip, at = min(n, max(0, self.start - pos)), max(0, pos - self.start)
        for name, rows in (("routed", routed), ("hidden", hidden)):
            if rows is not None:
                kept = _room(getattr(self, name), at + n - skip, rows)
                kept[at : at + n - skip] = rows[skip:]
                setattr(self, name, kept)
        self.filled = max(self.filled, pos + n)  # (`pos` is never past what is known)

    def take(self, other: Capture, end: int) -> None:
        """`other`'s rows of positions before `end` (a fork's prompt, from the request that
        ran it, whose `start` is this one's)."""
        end = min(end, other.filled)
        for name in ("routed", "hidden"):
            rows = getattr(other, name)
            if rows is not None:
                setattr(self, name, rows[: max(0, end - self.start)].clone())
        self.filled = max(end, 0)

    def rows(self, end: int, routed_start: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The routed experts of positions `routed_start`..`end` - 1 (int32
        `[n, layers, top_k]`) and the hidden states of positions 0..`end` - 1 (float32
        `[n, hidden]`; kept only with `start` 0), of those it kept (else None), known
        positions only."""
        end = min(end, self.filled)
        routed = hidden = None
        first, last = routed_start - self.start, max(end, routed_start) - self.start
        if self.routed is not None:
            routed = self.routed[first:last].numpy().copy()
        if self.hidden is not None:
            hidden = self.hidden[: max(0, end - self.start)].float().numpy().copy()
        return routed, hidden


def _room(rows: torch.Tensor | None, n: int, like: torch.Tensor) -> torch.Tensor:
    """`rows` with room for `n` positions (doubling), new ones zero."""
    if rows is not None and rows.shape[0] >= n:
        return rows
    grown = like.new_zeros(max(n, 2 * (0 if rows is None else rows.shape[0]), 64), *like.shape[1:])
    if rows is not None:
        grown[: rows.shape[0]] = rows
    return grown


@dataclass(eq=False)
class Request:
    """A prompt being completed.

    `pages` are device pages covering positions `0..num_computed-1` (plus room for the next
    step); the first `num_cached_pages` of them belong to the prefix cache and are locked
    through `prefix_nodes`. `host_slots` holds the KV while the request is retracted to the
    host tier. `matcher` is its xgrammar matcher under structured output. `forks` are the other
    choices of an `n > 1` request, queued once this one's prompt KV is cached.
    `prompt_logprobs[p]` is the teacher-forced log-probability of prompt token p (None for
    p = 0, and through `params.prompt_logprobs_start`), `prompt_ranks[p]` its rank among the
    vocabulary (1 = likeliest), scored while `score_prompt` is set (see
    `Engine._score_prompts`).
    """

    prompt_ids: list[int]
    params: SamplingParams
    rid: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0  # positions whose KV is in the pool
    kv_epoch: int = 0  # the weights its first KV was computed with (`PrefixCache.epoch`)
    prefix_nodes: list = field(default_factory=list)
    host_slots: torch.Tensor | None = None
    finish_reason: str | None = None
    # vLLM's: the stop string or `stop_token_ids` token that ended it (None: anything else)
    stop_reason: str | int | None = None
    output_text: str = ""
    detokenizer: Any = None  # decodes output_ids as they come (`Engine._decode_output`)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)  # each output token's, with logprobs
    # each output token's logprobs of `params.token_ids_logprob` (`gather_ids`)
    token_ids_logprobs: list[list[float]] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    matcher: Any = None
    forks: list[Request] = field(default_factory=list)
    score_prompt: bool = False
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_ranks: list[int | None] | None = None
    prompt_token_ids_logprobs: list[list[float] | None] | None = None  # (as prompt_ranks)
    draft_ids: list[int] = field(default_factory=list)  # drafts to verify next step
    draft_len: DraftLength | None = None  # its adaptive draft length (set on first use)
    bad_words_ids: list[list[int]] = field(default_factory=list)  # (`bad_word_ids`)
    prompt_mask: torch.Tensor | None = field(default=None, repr=False)  # (`_prompt_mask`)
    bias: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)  # (`_bias`)
    thinking: ThinkingBudget | None = field(default=None, repr=False)  # (`_restrict`)
    stop_floor: int = 0  # a stop string counts only where it ends past this text offset
    error: str | None = None  # why it failed, where it alone did (finish_reason "error")
    # The model's output failed it, not its parameters (a NaN: the server's fault, a 500;
    # its KV may hold the NaN, `kv_kept`)
    model_fault: bool = False
    # SGLang's return_routed_experts / return_hidden_states: the rows kept as it runs, then
    # once it ends those of its positions but the last (`Capture.rows`: routed experts
    # `[n, layers, top_k]` int32 from `routed_experts_start_len`, hidden states
    # `[n, hidden]` float32 from position 0), None where not asked
    capture: Capture | None = None
    routed_experts: np.ndarray | None = None
    hidden_states: np.ndarray | None = None
    # Its LoRA adapter (`params.lora_name` as loaded when it came in: `Engine._init_request`)
    lora: LoraRef | None = None
    # The rank it runs on under DP attention (rank 0's mirror of another rank's: `DPEngine`)
    dp_rank: int = 0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids(self, start: int, stop: int) -> list[int]:
        """`all_ids[start:stop]` without joining the whole sequence (a decode step's one
        token of a long output)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p : stop - p]
        return self.all_ids[start:stop]

    @property
    def cache_key(self) -> CacheKey:
        """The prefix-cache tree its pages join, on the device, the host tier and L3 (the one
        place it is made): its `cache_salt`, and on a LoRA adapter that adapter's identity
        too (its name and the digest of its files: KV computed with other weights never
        matches)."""
        salt, lora = self.params.cache_salt, self.lora
        return salt if lora is None else LoraNamespace(salt, lora.name, lora.digest, lora.id)

    @functools.cached_property
    def cache_root(self) -> bytes:
        """The hash its pages' chain starts from (`root_hash` of its `cache_key`): the
        parent of its first page, for L3's keys."""
        return root_hash(self.cache_key)

    @property
    def seq_len(self) -> int:
        """Tokens whose KV the request will need: prompt plus outputs so far."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_cached_pages(self) -> int:
        return len(self.prefix_nodes)

    @property
    def in_prefill(self) -> bool:
        """Still computing KV for known tokens (the prompt, or everything after a recompute)."""
        return self.num_computed < self.seq_len - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def kv_kept(self) -> bool:
        """Whether its KV may outlive it (the prefix cache) as it ends: not an aborted
        request's, nor one the model failed (its KV may hold the NaN: `model_fault`)."""
        return self.finish_reason != "abort" and not self.model_fault
