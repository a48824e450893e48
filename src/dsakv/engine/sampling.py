"""`SamplingParams` and the batched sampler. A seeded request's token i is drawn with a
generator seeded from (seed, i) alone (SGLang's `sampling_seed`), so it does not depend on
the batch, on how earlier tokens were drawn (MTP verification) or on which server drew it."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, NoReturn, get_args

import torch

from dsakv.errors import DsakvError, is_int, is_number

# A request's seed: OpenAI's and vLLM's range (torch.long), 2**64 seeds, each sampling
# differently (`token_seed` keys on it mod 2**64: a wider one would alias a smaller one)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")
# Temperatures below this sample greedily (vLLM's bound): dividing logits by less would
# overflow them to inf, and softmax of inf is NaN.
GREEDY_BELOW = 1e-5
# The largest float32: the sampler's float parameters are float32's on the device. The
# others' bounds are well within it (logit_bias 100, penalties 2, repetition_penalty 100).
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
LogprobsMode = Literal["raw", "processed"]
# vLLM's cap on `logprob_token_ids` (its MAX_LOGPROB_TOKEN_IDS)
MAX_LOGPROB_TOKEN_IDS = 128
# The cap on `logprobs` and `prompt_logprobs`, the likeliest tokens given a position
# (vLLM's and OpenAI's)
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class RepetitionDetectionParams:
    """vLLM's: an output ends ("repetition", stop reason "repetition_detected") once its last
    `min_count * n` tokens are one n-token pattern `min_count` times over, for an n in
    `min_pattern_size..max_pattern_size` (0: 1); `max_pattern_size` 0 is off. Only the
    output's tail is read: a step costs at most a scan of the last `max_pattern_size`
    tokens, whatever the output's length."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        sizes = (self.max_pattern_size, self.min_pattern_size, self.min_count)
        if not all(is_int(x) for x in sizes):
            _bad_repetition("its sizes and min_count must be integers")
        if not 0 <= self.min_pattern_size <= self.max_pattern_size:
            _bad_repetition("it needs 0 <= min_pattern_size <= max_pattern_size (both 0: off)")
        if self.max_pattern_size and self.min_count < 2:
            _bad_repetition("min_count must be at least 2 (max_pattern_size 0 turns it off)")

    def repeats(self, ids: list[int]) -> bool:
        """Whether `ids` end in a pattern repeated `min_count` times (vLLM's
        check_sequence_repetition): the pattern lengths n whose first check holds (the last
        token also n tokens back) are found by one C-speed scan, then checked in full."""
        count, end = self.min_count, len(ids) - 1
        shortest = max(self.min_pattern_size, 1)
        longest = min(self.max_pattern_size, len(ids) // count)
        if longest < shortest:
            return False
        last, i = ids[end], end - longest
        while True:
            try:
                i = ids.index(last, i, end - shortest + 1)
            except ValueError:
                return False
            n = end - i
            if all(ids[end - k] == ids[end - k - n * m] for k in range(n) for m in range(1, count)):
                return True
            i += 1


def _bad_repetition(why: str) -> NoReturn:
    raise DsakvError(
        f"invalid sampling params: repetition_detection: {why}", "repetition_detection"
    )


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's offline structured output (`SamplingParams(structured_outputs=...)`): one
    constraint, which becomes the request's `grammar` (`grammar_spec`). `disable_fallback`
    and `disable_any_whitespace` are taken: one grammar engine here, and its JSON grammars
    admit no free whitespace either way."""

    json: str | dict | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False

    def grammar_spec(self) -> tuple[str, str]:
        """The (kind, spec) grammar of its one constraint."""
        asked = [
            *([("json_schema", json_spec(self.json))] if self.json is not None else []),
            *([("regex", self.regex)] if self.regex is not None else []),
            *([choice_grammar(self.choice)] if self.choice is not None else []),
            *([("ebnf", self.grammar)] if self.grammar is not None else []),
            *([("json_object", "")] if self.json_object else []),
            *([("structural_tag", self.structural_tag)] if self.structural_tag is not None else []),
        ]
        if len(asked) != 1:
            raise DsakvError(
                f"invalid sampling params: structured_outputs takes one constraint (json, "
                f"regex, choice, grammar, json_object or structural_tag), got {len(asked)}",
                "structured_outputs",
            )
        return asked[0]


def choice_grammar(choices: Sequence[str]) -> tuple[str, str]:
    """vLLM's `choice` constraint as a grammar: the output is exactly one of `choices`."""
    if (
        isinstance(choices, str)
        or not choices
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise DsakvError(
            "invalid sampling params: choice must be a list of non-empty strings", "choice"
        )
    # EBNF string literals take JSON's escapes: one alternative per choice, exactly.
    return ("ebnf", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))


def json_spec(value: str | dict) -> str:
    """A JSON schema given as text or as a dict, as the text a grammar compiles."""
    return value if isinstance(value, str) else json.dumps(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each request's next token and when to stop; validated on creation."""

    # None: as many as the context leaves (vLLM's; `Engine._init_request` resolves it)
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None  # -1 is None (vLLM's)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids are banned, stop strings unseen, before it
    # OpenAI's penalties on the output's tokens: logit -= frequency * count + presence
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's (and HF's) on the prompt's and the output's tokens: positive logits / r,
    # negative ones * r; on the output's only without `repetition_penalty_prompt` (SGLang's)
    repetition_penalty: float = 1.0
    repetition_penalty_prompt: bool = True
    # (token id, bias) pairs added to the logits; a dict is taken too
    logit_bias: tuple[tuple[int, float], ...] = ()
    # the chosen token's logprob and the top-n (True: 1, vLLM's); by default vLLM's raw
    # logprobs: of the model's logits (grammar-masked), before logit_bias, penalties, bans
    # and temperature
    logprobs: int | None = None
    # "processed": SGLang's (its /generate's, which RL frameworks train against), of the
    # logits after penalties, logit_bias, bans and grammar, over the temperature (1 when
    # greedy); vLLM calls it processed_logprobs. Prompt logprobs stay raw either way.
    logprobs_mode: LogprobsMode = "raw"
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # in the output's text
    # vLLM's: False leaves the output's text (and the logprobs' token texts) out, token ids
    # only (an RL rollout's); stop strings need the text
    detokenize: bool = True
    # vLLM's; taken, and as in vLLM's fast detokenizer it changes nothing (a fast
    # tokenizer's decoder has no such option)
    spaces_between_special_tokens: bool = True
    # (kind, spec): kind in GRAMMAR_KINDS; compiled and checked by `Engine.add_request`
    grammar: tuple[str, str] | None = None
    # vLLM's spelling of it (`StructuredOutputsParams`, or a dict of its fields), which
    # sets `grammar`
    structured_outputs: StructuredOutputsParams | None = None
    prompt_logprobs: int | None = None  # teacher-forced top-n over the prompt (None = off)
    # Score prompt tokens after this position only (SGLang's logprob_start_len): the prefix
    # cache may then serve the positions before it, whose logits nothing needs. 0: all of
    # them, as vLLM's, which skips the cache.
    prompt_logprobs_start: int = 0
    # SGLang's token_ids_logprob: with `logprobs`, each output position's logprobs of exactly
    # these ids (as `logprobs_mode` says), and with `prompt_logprobs` each scored prompt
    # position's (raw, as those). None (or empty): none
    token_ids_logprob: tuple[int, ...] | None = None
    # choices of the prompt (`Engine.add_requests`), sharing its KV pages (vLLM's field)
    n: int = 1
    # vLLM's: only these tokens may be picked (None: any)
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's: words (their token sequences, with and without a leading space) never output
    bad_words: tuple[str, ...] = ()
    # vLLM's: keep only the prompt's last N tokens (-1: as many as the context leaves room)
    truncate_prompt_tokens: int | None = None
    # vLLM's (a prompt's, there; SGLang's extra_key): requests share prefix-cache pages only
    # with requests of the same salt, or none; the host tier's and L3's too
    cache_salt: str | None = None
    # The LoRA adapter this request runs on, by its loaded name (`Engine.load_lora`; vLLM's
    # LoRARequest.lora_name, SGLang's lora_path); None: the base model
    lora_name: str | None = None
    # vLLM's: at most this many tokens inside the reasoning block (`ThinkingBudget`); -1 is
    # None, unlimited
    thinking_token_budget: int | None = None
    # vLLM's and SGLang's request priority, run by the scheduler's priority policy only
    # (`SchedulerConfig.priority_sign`); here so that it travels with the request (through
    # DP attention's ranks and to a PD decode server), as `cache_salt` does. None: not
    # given (vLLM's 0; SGLang's after every other, `Scheduler._priority`)
    priority: int | None = None
    # vLLM's logprob_token_ids: each output position's logprobs of exactly these ids, in the
    # place of its top `logprobs` (the sampled token's own still leads); the gather is
    # `token_ids_logprob`'s, set to them, and `logprobs` unset is their count (vLLM's
    # num_logprobs). None (or empty): the top ones
    logprob_token_ids: tuple[int, ...] | None = None
    # vLLM's: end the output once it repeats itself (`RepetitionDetectionParams`, or a dict
    # of its fields); None or max_pattern_size 0: off
    repetition_detection: RepetitionDetectionParams | None = None
    # SGLang's return_routed_experts and return_hidden_states (refused unless the engine's
    # enable_return_* allows them: `Engine.check_params`): per position the request ran,
    # prompt and output but the last token, the experts its token was routed to in each
    # layer (from position routed_experts_start_len on: the prefix cache may serve those
    # before it) and its last hidden state, final-normed (`Request.routed_experts`,
    # `Request.hidden_states`)
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    return_hidden_states: bool = False
    # SGLang's: this request's tokens reach a server's stream N at a time (None: the
    # server's --stream-interval); offline generation has no stream
    stream_interval: int | None = None

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        object.__setattr__(self, "stop", _as_tuple(stop, "stop", "a string or a list of strings"))
        stop_ids = _as_tuple(self.stop_token_ids, "stop_token_ids", "a list of token ids")
        object.__setattr__(self, "stop_token_ids", tuple(dict.fromkeys(stop_ids)))  # (distinct)
        if isinstance(self.grammar, list):
            object.__setattr__(self, "grammar", tuple(self.grammar))
        if self.structured_outputs is not None:
            self._fold_structured_outputs()
        words = (self.bad_words,) if isinstance(self.bad_words, str) else self.bad_words
        object.__setattr__(self, "bad_words", _as_tuple(words, "bad_words", "a list of strings"))
        if self.allowed_token_ids is not None:
            allowed = _as_tuple(self.allowed_token_ids, "allowed_token_ids", "a list of token ids")
            object.__setattr__(self, "allowed_token_ids", allowed)
        if self.token_ids_logprob is not None:
            ids = _as_tuple(self.token_ids_logprob, "token_ids_logprob", "a list of token ids")
            object.__setattr__(self, "token_ids_logprob", ids or None)
        if self.top_k == 0 and is_int(self.top_k):  # vLLM's "off", as -1
            object.__setattr__(self, "top_k", -1)
        if self.seed == -1 and is_int(self.seed):  # vLLM's "unseeded"
            object.__setattr__(self, "seed", None)
        if self.thinking_token_budget == -1 and is_int(self.thinking_token_budget):
            object.__setattr__(self, "thinking_token_budget", None)
        if self.logprobs is True:  # vLLM's: the sampled token and the likeliest
            object.__setattr__(self, "logprobs", 1)
        if self.logprob_token_ids is not None:
            ids = _as_tuple(self.logprob_token_ids, "logprob_token_ids", "a list of token ids")
            object.__setattr__(self, "logprob_token_ids", ids or None)
            if ids and self.token_ids_logprob is None:
                object.__setattr__(self, "token_ids_logprob", ids)
            if ids and self.logprobs is None:
                object.__setattr__(self, "logprobs", len(ids))
        object.__setattr__(self, "repetition_detection", _repetition(self.repetition_detection))
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = bias.items()
        try:
            object.__setattr__(self, "logit_bias", tuple(sorted((t, b) for t, b in bias or ())))
        except (TypeError, ValueError):
            raise DsakvError(
                "invalid sampling params: logit_bias must map int token ids to biases",
                "logit_bias",
            ) from None
        checks = [
            (
                self.max_tokens is None
                or is_int(self.max_tokens)
                and (
                    self.max_tokens >= 1
                    or self.max_tokens == 0
                    and self.prompt_logprobs is not None
                ),
                "max_tokens must be None or an integer >= 1 (0 only with prompt_logprobs)",
            ),
            (is_int(self.n) and self.n >= 1, "n must be an integer >= 1"),
            (
                self.stream_interval is None
                or is_int(self.stream_interval)
                and self.stream_interval >= 1,
                "stream_interval must be None or an integer >= 1",
            ),
            (  # (past float32's, the sampler's, it is inf: a masked logit over it NaN)
                is_number(self.temperature) and 0 <= self.temperature <= _FLOAT32_MAX,
                f"temperature must be a finite number in [0, {_FLOAT32_MAX:.6g}] (float32's)",
            ),
            (is_number(self.top_p) and 0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (
                is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
                "top_k must be -1 or 0 (off), or >= 1",
            ),
            (is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (
                self.seed is None or (is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX),
                f"seed must be a 64-bit signed integer ({SEED_MIN}..{SEED_MAX})",
            ),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (
                all(is_int(t) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids must be token ids",
            ),
            (
                is_int(self.min_tokens)
                and self.min_tokens >= 0
                and (not is_int(self.max_tokens) or self.min_tokens <= self.max_tokens),
                "min_tokens must be an integer in 0..max_tokens",
            ),
            (
                is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
                "presence_penalty must be in [-2, 2]",
            ),
            (
                is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
                "frequency_penalty must be in [-2, 2]",
            ),
            (  # (a tiny one would divide logits into infinities)
                is_number(self.repetition_penalty) and 0.01 <= self.repetition_penalty <= 100,
                "repetition_penalty must be in [0.01, 100]",
            ),
            (
                all(is_int(t) and t >= 0 for t, _ in self.logit_bias),
                "logit_bias keys must be int token ids >= 0",
            ),
            (
                all(is_number(b) and -100 <= b <= 100 for _, b in self.logit_bias),
                "logit_bias must map token ids to biases in [-100, 100]",
            ),
            (
                len({t for t, _ in self.logit_bias}) == len(self.logit_bias),
                "logit_bias names a token id twice",
            ),
            (
                all(is_int(t) and t >= 0 for t in self.logprob_token_ids or ()),
                "logprob_token_ids must be token ids",
            ),
            (
                len(self.logprob_token_ids or ()) <= MAX_LOGPROB_TOKEN_IDS,
                f"logprob_token_ids takes at most {MAX_LOGPROB_TOKEN_IDS} token ids",
            ),
            (
                not self.logprob_token_ids or self.logprobs == len(self.logprob_token_ids),
                "logprob_token_ids and logprobs disagree: with both given, logprobs must be "
                "their count (vLLM's)",
            ),
            (
                not self.logprob_token_ids or self.token_ids_logprob == self.logprob_token_ids,
                "logprob_token_ids and token_ids_logprob differ: they name one gather",
            ),
            (
                self.logprobs is None
                or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS)
                or self.logprob_token_ids is not None,  # (their count, checked above)
                f"logprobs must be in 0..{MAX_LOGPROBS}",
            ),
            (
                self.logprobs_mode in get_args(LogprobsMode),
                f"logprobs_mode must be one of {', '.join(get_args(LogprobsMode))}, "
                f"got {self.logprobs_mode!r}",
            ),
            (
                self.allowed_token_ids is None
                or (
                    self.allowed_token_ids
                    and all(is_int(t) and t >= 0 for t in self.allowed_token_ids)
                ),
                "allowed_token_ids must be a non-empty list of token ids",
            ),
            (
                all(isinstance(w, str) and w.strip() for w in self.bad_words),
                "bad_words must be strings with more than whitespace",
            ),
            (
                self.truncate_prompt_tokens is None
                or (
                    is_int(self.truncate_prompt_tokens)
                    and (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1)
                ),
                "truncate_prompt_tokens must be -1 or an integer >= 1",
            ),
            (
                self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt),
                "cache_salt must be a non-empty string",
            ),
            (
                self.lora_name is None or (isinstance(self.lora_name, str) and self.lora_name),
                "lora_name must be a non-empty string",
            ),
            (
                self.thinking_token_budget is None
                or (is_int(self.thinking_token_budget) and self.thinking_token_budget >= 0),
                "thinking_token_budget must be an integer >= 0, or -1 (unlimited)",
            ),
            (
                self.priority is None or is_int(self.priority),
                f"priority must be an integer, got {self.priority!r}",
            ),
            (
                self.prompt_logprobs is None
                or (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
                f"prompt_logprobs must be in 0..{MAX_LOGPROBS}",
            ),
            (
                is_int(self.prompt_logprobs_start) and self.prompt_logprobs_start >= 0,
                "prompt_logprobs_start must be an integer >= 0",
            ),
            (
                all(is_int(t) and t >= 0 for t in self.token_ids_logprob or ()),
                "token_ids_logprob must be token ids",
            ),
            (
                self.token_ids_logprob is None or self.logprobs is not None,
                "token_ids_logprob needs logprobs (0: the sampled token's alone)",
            ),
            (
                is_int(self.routed_experts_start_len) and self.routed_experts_start_len >= 0,
                "routed_experts_start_len must be an integer >= 0",
            ),
            (
                not self.routed_experts_start_len or self.return_routed_experts is True,
                "routed_experts_start_len needs return_routed_experts",
            ),
            (
                self.grammar is None
                or (
                    isinstance(self.grammar, tuple)
                    and len(self.grammar) == 2
                    and self.grammar[0] in GRAMMAR_KINDS
                    and isinstance(self.grammar[1], str)
                ),
                f"grammar must be (kind, spec) with kind one of {', '.join(GRAMMAR_KINDS)}",
            ),
            *(
                (
                    isinstance(getattr(self, name), bool),
                    f"{name} must be True or False, got {getattr(self, name)!r}",
                )
                for name in BOOL_FIELDS
            ),
        ]
        for ok, message in checks:  # each message starts with the field it is about
            if not ok:
                raise DsakvError(f"invalid sampling params: {message}", message.split()[0])

    def clone(self) -> SamplingParams:
        """vLLM's deep copy; these params are frozen, so a copy is all it takes."""
        return replace(self)

    def _fold_structured_outputs(self) -> None:
        """`structured_outputs` as `grammar` (a `replace` of params that folded it finds the
        same grammar there)."""
        so = self.structured_outputs
        if isinstance(so, Mapping):
            try:
                so = StructuredOutputsParams(**so)
            except TypeError:
                raise DsakvError(
                    "invalid sampling params: structured_outputs takes json, regex, choice, "
                    "grammar, json_object, structural_tag, disable_fallback and "
                    "disable_any_whitespace",
                    "structured_outputs",
                ) from None
            object.__setattr__(self, "structured_outputs", so)
        if not isinstance(so, StructuredOutputsParams):
            raise DsakvError(
                "invalid sampling params: structured_outputs must be StructuredOutputsParams "
                f"or a dict of its fields, got {so!r}",
                "structured_outputs",
            )
        spec = so.grammar_spec()
        if self.grammar is not None and self.grammar != spec:
            raise DsakvError(
                "invalid sampling params: grammar and structured_outputs both ask for "
                "structured output: give one",
                "structured_outputs",
            )
        object.__setattr__(self, "grammar", spec)

    def choice(self, i: int) -> SamplingParams:
        """Choice `i` of `n`: one completion, seeded `seed + i` (reproducible, yet not n
        copies of one sample), wrapped into the seed range: `token_seed` keys on the seed
        mod 2**64, so the wrap changes no sample."""
        seed = None if self.seed is None else (self.seed + i - SEED_MIN) % 2**64 + SEED_MIN
        return replace(self, n=1, seed=seed)

    @property
    def num_top_logprobs(self) -> int:
        """How many likeliest tokens each output position's logprobs list besides the
        chosen one: `logprobs`, none where `logprob_token_ids` names the tokens instead."""
        return 0 if self.logprob_token_ids else self.logprobs or 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @functools.cached_property
    def stop_token_set(self) -> frozenset[int]:
        """`stop_token_ids` to test each output token against (a million ids, a tuple, cost
        every step of the request a scan)."""
        return frozenset(self.stop_token_ids)

    @functools.cached_property
    def stops_by_last(self) -> dict[str, tuple[str, ...]]:
        """`stop` by last character: only a stop ending in a character just output can have
        just appeared (20,000 stop strings were each searched for every token)."""
        out: dict[str, list[str]] = {}
        for s in self.stop:
            out.setdefault(s[-1], []).append(s)
        return {c: tuple(v) for c, v in out.items()}

    @functools.cached_property
    def longest_stop(self) -> int:
        """The longest stop string's length: a streamed text holds back one less (a max over
        20,000 stop strings was taken for every chunk)."""
        return max(map(len, self.stop), default=0)

    @property
    def masked(self) -> bool:
        """Whether `Engine._restrict` takes tokens away: stops under `min_tokens`, bad
        words, all but `allowed_token_ids`, or all but a forced end of the reasoning."""
        return bool(
            self.min_tokens
            or self.bad_words
            or self.allowed_token_ids is not None
            or self.thinking_token_budget is not None
        )

    @property
    def penalized(self) -> bool:
        """Whether `penalize` changes this request's logits."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )


# Checked to be bools: a truthy string such as "no" would otherwise switch one on.
BOOL_FIELDS = (
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "detokenize",
    "spaces_between_special_tokens",
    "repetition_penalty_prompt",
    "return_routed_experts",
    "return_hidden_states",
)


def _repetition(value: object) -> RepetitionDetectionParams | None:
    """`SamplingParams.repetition_detection` as given (a dict of its fields too), None
    where it is off."""
    if isinstance(value, Mapping):
        try:
            value = RepetitionDetectionParams(**value)
        except TypeError:
            _bad_repetition("it takes max_pattern_size, min_pattern_size and min_count")
    elif value is not None and not isinstance(value, RepetitionDetectionParams):
        _bad_repetition(f"it must be RepetitionDetectionParams or a dict, got {value!r}")
    return value if value is not None and value.max_pattern_size else None


def _as_tuple(value: object, name: str, what: str) -> tuple:
    """`value` (None, or a list of items `SamplingParams` checks next) as a tuple, or a
    `DsakvError` naming the field: `tuple(5)` raised a bare TypeError, and a string or
    dict would be taken apart into characters or keys."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes, bytearray, Mapping)) or not isinstance(value, Iterable):
        raise DsakvError(f"invalid sampling params: {name} must be {what}, got {value!r}", name)
    return tuple(value)


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def token_seed(seed: int, index: int) -> int:
    """The generator seed for output token `index` of a request seeded `seed`: a fixed
    64-bit mix (any int seed, negative or huge, is taken mod 2**64), below 2**63 as
    `manual_seed` wants."""
    return _splitmix64((_splitmix64(seed & _MASK64) + index) & _MASK64) >> 1


def draw(probs: torch.Tensor, seed: int | None, index: int, generator: torch.Generator) -> int:
    """One token from the host distribution `probs`: keyed by (seed, index) when seeded
    (a fresh generator, so nothing else can shift it), else from the shared `generator`."""
    if seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(token_seed(seed, index))
    return int(torch.multinomial(probs, 1, generator=generator))


class Sampler:
    """Samples one token per row: seeded rows by (seed, output index), so a request's tokens
    do not depend on its batch; unseeded rows from one shared generator."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        # the engine's seed (vLLM's): unseeded requests reproduce run to run, given the same
        # requests in the same order
        self.generator = torch.Generator(device="cpu").manual_seed(seed & ((1 << 63) - 1))

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        output_index: Sequence[int],
        finite: torch.Tensor,
    ) -> list[int | None]:
        """Each row's token; `output_index[i]`: which output token row i draws
        (len(output_ids) so far). `finite` (`finite_rows` of the model's raw logits): a row
        it marks False draws nothing and gets None (its probabilities would be NaN).

        A constant number of device→host copies per step, whatever the batch: the greedy
        choices (with `finite`) and the filtered distributions of the sampled rows (drawn
        on the host)."""
        logits = logits.float()
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        probs = None
        if sampled:
            probs = torch.stack([filtered_probs(logits[i], params[i]) for i in sampled]).cpu()
        best = torch.argmax(logits, dim=-1)  # (one copy: the flags ride with it)
        greedy, ok = torch.stack([best, finite.long()]).tolist()
        chosen: list[int | None] = [c if f else None for c, f in zip(greedy, ok)]
        for j, i in enumerate(sampled):
            if chosen[i] is not None:
                chosen[i] = draw(probs[j], params[i].seed, output_index[i], self.generator)
        return chosen


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """Whether each row of the model's raw `logits` is all finite, on their device and not
    copied (the sampler's copy carries it): one sum a row, through which a NaN or an inf
    anywhere shows (finite logits overflow it only at ~1e33 each, no model's). A sum,
    not a min-max: on the CPU over a 155k vocabulary aminmax took 17x as long."""
    return torch.isfinite(logits.sum(-1, dtype=torch.float32))


def gather_logprobs(
    logp: torch.Tensor, tokens: Sequence[int], k: Sequence[int]
) -> list[tuple[float, list[tuple[int, float]], int]]:
    """Row i of the log-softmaxed `logp`: its logprob of `tokens[i]`, its `k[i]` most
    likely (token id, logprob) pairs, and the token's rank (vLLM's: 1 + how many tokens
    are likelier), in two device→host copies whatever the rows."""
    logp = logp[: len(tokens)]
    ids = torch.tensor(tokens, dtype=torch.long, device=logp.device)
    picked = logp.gather(1, ids[:, None])
    ranks = (logp > picked).sum(-1) + 1
    # (float64 holds each float32 logprob and each rank exactly)
    picked, ranks = torch.stack([picked[:, 0].double(), ranks.double()]).tolist()
    n = max(k, default=0)
    top_v, top_i = ([], []) if n == 0 else (t.tolist() for t in logp.topk(n, dim=-1))
    tops = [list(zip(top_i[i][:w], top_v[i][:w])) if w else [] for i, w in enumerate(k)]
    return [(lp, top, int(r)) for lp, top, r in zip(picked, tops, ranks)]


def gather_ids(logp: torch.Tensor, ids: Sequence[Sequence[int] | None]) -> list[list[float] | None]:
    """Row i of the log-softmaxed `logp`: its logprobs of exactly `ids[i]`, in that order
    (SGLang's token_ids_logprob; None where not asked), in one device→host copy."""
    rows = [i for i, x in enumerate(ids) if x]
    out: list[list[float] | None] = [None] * len(ids)
    if not rows:
        return out
    width = max(len(ids[i]) for i in rows)
    idx = [list(ids[i]) + [0] * (width - len(ids[i])) for i in rows]
    picked = logp[torch.tensor(rows, device=logp.device)].gather(
        1, torch.tensor(idx, dtype=torch.long, device=logp.device)
    )
    for i, values in zip(rows, picked.double().tolist()):
        out[i] = values[: len(ids[i])]
    return out


def processed_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """`logprobs_mode="processed"` rows: log_softmax of the logits as penalties, bias, bans
    and grammar left them, over each row's temperature (1 for a greedy row, as SGLang's,
    whose greedy requests run at temperature 1)."""
    t = [1.0 if p.greedy else float(p.temperature) for p in params]
    t = torch.tensor(t, dtype=logits.dtype, device=logits.device)
    return torch.log_softmax(logits / t[:, None], -1)


def filtered_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row of logits as probabilities, in vLLM's order: temperature, min-p (against the
    tempered distribution), then top-k and top-p over what min-p kept."""
    row = row / p.temperature
    if p.min_p > 0:
        probs = torch.softmax(row, dim=-1)
        row = row.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_k > 0 and p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = cum - sorted_p >= p.top_p  # keep the smallest prefix reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
    return probs / probs.sum()


def penalize(
    row: torch.Tensor,
    p: SamplingParams,
    prompt: Sequence[int] | torch.Tensor,
    output: Sequence[int],
    bias: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """In place on one row of logits, in vLLM's (and transformers') order: `p`'s logit
    bias, then the repetition penalty over the prompt's and the output's tokens, then the
    frequency and presence penalties over the output's. `prompt` may be a boolean mask
    over the row's tokens (`Engine._prompt_mask`: a long prompt is not converted anew
    each step, and no step sorts it); `bias` likewise `logit_bias` as (ids, biases) on
    the row's device (`bias_tensors`)."""
    if p.logit_bias:
        ids, values = bias if bias is not None else bias_tensors(p, row.device)
        row[ids] += values.to(row.dtype)
    if p.repetition_penalty != 1.0:
        if isinstance(prompt, torch.Tensor) and prompt.dtype == torch.bool:
            seen = prompt.clone()
        else:
            seen = token_mask(prompt, row.numel(), row.device)
        seen[torch.tensor(output, dtype=torch.long, device=row.device)] = True
        r = p.repetition_penalty
        row.copy_(torch.where(seen, torch.where(row > 0, row / r, row * r), row))
    if output and (p.presence_penalty or p.frequency_penalty):
        ids, counts = torch.tensor(output, device=row.device).unique(return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty


def bias_tensors(p: SamplingParams, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`p.logit_bias` as (token ids, biases) tensors on `device`."""
    ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=device)
    return ids, torch.tensor([b for _, b in p.logit_bias], dtype=torch.float32, device=device)


def token_mask(ids: Sequence[int], size: int, device: torch.device) -> torch.Tensor:
    """A boolean mask of `size` tokens, set at `ids`."""
    mask = torch.zeros(size, dtype=torch.bool, device=device)
    mask[torch.tensor(ids, dtype=torch.long, device=device)] = True
    return mask


def allow(row: torch.Tensor, token_ids: Sequence[int]) -> None:
    """In place: only `token_ids` can be picked, unless none of them could (as `ban`)."""
    others = ~token_mask(token_ids, row.numel(), row.device)
    if bool(torch.isfinite(row.masked_fill(others, -math.inf)).any()):
        row.masked_fill_(others, -math.inf)


def bad_word_ids(tokenizer: Any, words: Sequence[str]) -> list[list[int]]:
    """vLLM's token sequences of `bad_words`: each word without its leading whitespace, and
    with one space before it where that tokenizes to as many tokens, starting differently
    (so " ab" bans "ab" too, as in vLLM)."""
    out: list[list[int]] = []
    for word in words:
        ids = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        out.append(ids)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and len(spaced) == len(ids) and spaced[0] != ids[0]:
            out.append(spaced)
    return [ids for ids in out if ids]


def banned_words_next(sequences: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The tokens that would finish one of the bad words' `sequences` after `output`."""
    return [
        seq[-1]
        for seq in sequences
        if len(seq) == 1 or list(output[len(output) - len(seq) + 1 :]) == list(seq[:-1])
    ]


def ban(row: torch.Tensor, token_ids: Sequence[int]) -> None:
    """In place: `token_ids` can no longer be picked, unless nothing else could (a grammar
    that allows only EOS outranks `min_tokens`)."""
    if not token_ids:
        return
    ids = torch.tensor(token_ids, device=row.device)
    kept = row[ids].clone()
    row[ids] = -math.inf
    if not bool(torch.isfinite(row).any()):
        row[ids] = kept


# The reasoning block's markers: both reasoning parsers' (GLM-4.5/5's, DeepSeek-V3's)
THINK_MARKERS = ("<think>", "</think>")


class ThinkingBudget:
    """vLLM's thinking_token_budget for one request. Tokens after the reasoning block's
    start marker are counted (from the prompt's, where the prompt left a block open: GLM's
    and DeepSeek-V3.2's templates end with `<think>` when thinking); once `budget` of them
    are out, the end marker's tokens are forced one by one. After the block closes nothing
    is forced again. A pure function of the prompt and the output (so an MTP draft row is
    forced as the plain step would be); the committed output is scanned once, a row's
    drafts on a copy of that state."""

    def __init__(
        self, budget: int, start: Sequence[int], end: Sequence[int], prompt: Sequence[int]
    ) -> None:
        self.budget, self.start, self.end = budget, tuple(start), tuple(end)
        self._keep = max(len(self.start), len(self.end))
        opened, closed = _last_index(prompt, self.start), _last_index(prompt, self.end)
        # (phase, tokens in the block, last tokens): phase 0 before the block, 1 in, 2 after
        if opened >= 0 and opened > closed:
            self._state = (1, len(prompt) - opened - len(self.start), ())
        else:
            self._state = (0, 0, ())
        # where forcing starts: a prompt past the budget already is forced at once
        self._cut = max(budget, self._state[1])
        self._seen = 0  # output tokens in `_state`

    def forced(self, output: Sequence[int], committed: int) -> int | None:
        """The token `output` must be followed by (None: any), where its first `committed`
        tokens are the request's output and the rest drafts."""
        if self._seen < committed:
            self._state = self._advance(self._state, output[self._seen : committed])
            self._seen = committed
        phase, count, _ = self._advance(self._state, output[committed:])
        if phase != 1 or count < self._cut:
            return None
        return self.end[(count - self._cut) % len(self.end)]

    def _advance(self, state: tuple, tokens: Sequence[int]) -> tuple:
        phase, count, tail = state
        for t in tokens:
            if phase == 2:
                break
            tail = (*tail, t)[-self._keep :]
            if phase == 1:
                count += 1
                if tail[-len(self.end) :] == self.end:
                    phase = 2
            elif tail[-len(self.start) :] == self.start:
                phase, count = 1, 0
        return phase, count, tail


def _last_index(seq: Sequence[int], marker: Sequence[int]) -> int:
    """Where `marker` last starts in `seq` (-1: nowhere)."""
    n = len(marker)
    for i in range(len(seq) - n, -1, -1):
        if seq[i] == marker[0] and tuple(seq[i : i + n]) == marker:
            return i
    return -1
