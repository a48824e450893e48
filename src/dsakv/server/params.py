"""A request's fields as the engine's `SamplingParams` (and beam search's
`BeamSearchParams`), its grammar compiled off the event loop: the fields the server does
not run refused by name, each 400 naming its field, as `Handlers`' mixin."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

from dsakv.config.model import SAMPLING_FIELDS
from dsakv.engine import SamplingParams
from dsakv.engine.beam_search import BeamSearchParams
from dsakv.engine.grammar import GrammarCache, after_reasoning
from dsakv.engine.sampling import (
    MAX_LOGPROBS,
    SEED_MAX,
    SEED_MIN,
    StructuredOutputsParams,
    choice_grammar,
    json_spec,
)
from dsakv.errors import DsakvError

from .protocol import APIError, GenerationRequest
from .rows import row_params

# Grammar compiles at once, and how long a request waits for its grammar.
GRAMMAR_WORKERS = 2


GRAMMAR_TIMEOUT_S = 60.0


class RequestParamsMixin:
    """`Handlers`' request parsing. Its host holds the engine (`engine`), the reasoning
    parser a thinking budget needs (`chat_parsers`), the grammar compiles' threads and
    lock (`_compiles`, `_grammars_lock`), whether it is a PD server (`disaggregated`) and
    the LoRA adapter a request names (`lora_name`)."""

    def sampling_params(
        self,
        body: GenerationRequest,
        max_tokens: int | None,
        default_max_tokens: int,
        logprobs: int | None,
        logprobs_param: str,
        max_tokens_param: str = "max_tokens",
        min_max_tokens: int = 1,
        generation_config: bool = True,
    ) -> SamplingParams:
        """Sampling params from the request (n is each handler's business: `_n`);
        `generation_config`: whether the model's defaults fill in what it leaves out (not
        on SGLang's /generate)."""
        self._n(body)
        if body.prompt_logprobs is not None and body.stream:  # (vLLM's rule)
            raise APIError(
                400, "prompt_logprobs are not available with stream: true", param="prompt_logprobs"
            )
        try:  # (refused before the prompt is tokenized)
            self.engine.engine.check_priority(body.priority)
        except DsakvError as e:
            raise APIError(400, str(e), param=e.param) from None
        for name in _NOT_RUN:  # (each was accepted and ignored)
            if getattr(body, name, None) not in (None, False):
                raise APIError(400, f"{name} is not supported", param=name)
        if getattr(body, "kv_transfer_params", None) is not None and not self.disaggregated:
            raise APIError(  # (a PD server's middleware reads it: `dsakv.disagg.handoff`)
                400,
                "kv_transfer_params (vLLM's prefill/decode hand-off) needs a prefill or decode "
                "server (--disaggregation-mode prefill / decode); this server has no KV "
                "connector",
                param="kv_transfer_params",
            )
        named_ids = self._logprob_token_ids(body, logprobs, logprobs_param, max_tokens)
        lora_name = self.lora_name(body)
        # SGLang's (stop_regex: a sampling param on /generate, `generate._SAMPLING_NOT_RUN`)
        for name in (*SGLANG_NOT_RUN, "stop_regex"):
            if getattr(body, name, None):
                raise APIError(400, f"{name} is not supported by this server", param=name)
        if getattr(body, "session_params", None):  # (SGLang's OpenAI routes drop it)
            raise APIError(
                400, "session_params is taken by /generate only (SGLang's)", param="session_params"
            )
        budget = body.thinking_token_budget
        if budget is not None and budget >= 0 and self.chat_parsers.reasoning is None:
            raise APIError(  # (vLLM's rule: the budget counts inside the parser's markers)
                400,
                "thinking_token_budget needs a reasoning parser; this server runs none",
                param="thinking_token_budget",
            )
        if body.truncation_side not in (None, "left", "right"):
            raise APIError(
                400,
                f"truncation_side must be 'left' or 'right', got {body.truncation_side!r}",
                param="truncation_side",
            )
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options needs stream: true", param="stream_options")
        if max_tokens is not None and max_tokens < min_max_tokens:
            raise APIError(
                400,
                f"{max_tokens_param} must be at least {min_max_tokens}, got {max_tokens}",
                param=max_tokens_param,
            )
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise APIError(
                400,
                f"{logprobs_param} must be in 0..{MAX_LOGPROBS}, got {logprobs}",
                param=logprobs_param,
            )
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        seed = body.sampling_seed if body.seed is None else body.seed
        if body.sampling_seed not in (None, seed):
            raise APIError(
                400,
                f"seed ({body.seed}) and sampling_seed ({body.sampling_seed}) differ; "
                "they are one setting, give one of them",
                param="sampling_seed",
            )
        if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
            # (SamplingParams' check, here to name the field the request sent)
            name = "seed" if body.seed is not None else "sampling_seed"
            raise APIError(
                400,
                f"{name} must be a 64-bit signed integer ({SEED_MIN}..{SEED_MAX}), got {seed}",
                param=name,
            )
        # What the request leaves out: the model's generation_config.json, else OpenAI's
        # (SamplingParams' own defaults).
        defaults = self.engine.engine.model_config.sampling_defaults
        sampling = dict(defaults if generation_config else {})
        sampling.update((k, v) for k in SAMPLING_FIELDS if (v := getattr(body, k)) is not None)
        most = max_tokens if max_tokens is not None else default_max_tokens
        most = min(most, sampling.pop("max_tokens", most))  # max_new_tokens caps (vLLM's)
        try:
            return SamplingParams(
                max_tokens=most,
                **sampling,
                seed=seed,
                stop=tuple(stop),
                stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=bool(body.ignore_eos),
                include_stop_str_in_output=bool(
                    body.include_stop_str_in_output or body.no_stop_trim
                ),
                skip_special_tokens=body.skip_special_tokens is not False,
                min_tokens=body.min_tokens or 0,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                logit_bias=self._logit_bias(body.logit_bias),
                logprobs=None if named_ids else logprobs,  # (vLLM's: then their count)
                logprob_token_ids=named_ids,
                repetition_detection=(
                    body.repetition_detection and body.repetition_detection.model_dump()
                ),
                grammar=_grammar(body),
                allowed_token_ids=body.allowed_token_ids,
                bad_words=tuple(body.bad_words or ()),
                truncate_prompt_tokens=body.truncate_prompt_tokens,
                cache_salt=request_salt(body.cache_salt, body.extra_key),
                lora_name=lora_name,
                priority=body.priority,
                thinking_token_budget=body.thinking_token_budget,
                **row_params(body, body.return_hidden_states),  # (`sglext`, `last_hidden`)
                prompt_logprobs=(
                    body.prompt_logprobs
                    if body.prompt_logprobs is not None
                    else (0 if max_tokens == 0 else None)
                ),
            )
        except DsakvError as e:
            raise APIError(400, str(e), param=e.param) from None

    def _logprob_token_ids(
        self,
        body: GenerationRequest,
        logprobs: int | None,
        logprobs_param: str,
        max_tokens: int | None,
    ) -> list[int] | None:
        """vLLM's `logprob_token_ids` (None where not asked, or empty: the top ones), refused
        where vLLM refuses it: without logprobs (chat's `logprobs: true`), with beam search,
        or with no output token to score (echo's `max_tokens: 0`). `SamplingParams` and the
        engine check the ids."""
        ids, name = body.logprob_token_ids, "logprob_token_ids"
        if not ids:
            return None
        if body.use_beam_search:
            raise APIError(400, "logprob_token_ids is not supported with beam search", param=name)
        if logprobs is None:
            needs = "logprobs: true" if logprobs_param == "top_logprobs" else "logprobs"
            raise APIError(400, f"logprob_token_ids needs {needs}", param=name)
        if max_tokens == 0:
            raise APIError(
                400, "logprob_token_ids scores output tokens; max_tokens is 0", param=name
            )
        return ids

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float]:
        """OpenAI's logit_bias: token ids (as JSON object keys, so strings) to biases."""
        vocab = self.engine.engine.model_config.vocab_size
        out: dict[int, float] = {}
        for key, value in (bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                token = -1
            if not 0 <= token < vocab or token in out:
                raise APIError(
                    400,
                    f"logit_bias keys must be distinct token ids in 0..{vocab - 1}, got {key!r}",
                    param="logit_bias",
                )
            out[token] = value
        return out

    def _n(self, body: GenerationRequest) -> int:
        return self.check_n(1 if body.n is None else body.n)

    def check_n(self, n: int) -> int:
        """`n`, a request's choices, else the 400: checked before anything is made per
        choice (a /generate n of 2**63 made that many request ids first)."""
        limit = self.engine.engine.max_choices
        if not 1 <= n <= limit:
            raise APIError(400, f"n must be in 1..{limit}, got {n}", param="n")
        return n

    def _beam(self, body: GenerationRequest, params: SamplingParams) -> BeamSearchParams | None:
        """vLLM's `use_beam_search` (None: not asked for): `n` is the beam width, with the
        request's max_tokens, temperature, stops, ignore_eos, include_stop_str_in_output and
        length_penalty. What it does not run is a 400 naming it (vLLM's ignores it): a
        sampling field the request sets (a model's generation_config defaults are not the
        request's), structured output, tools, prompt scoring; and prefill/decode
        disaggregation, whose router pairs each request with a prefill server's."""
        if not body.use_beam_search:
            return None
        if self.disaggregated:
            raise APIError(
                400,
                "use_beam_search is not supported with prefill/decode disaggregation (each "
                "step of the search is a request of its own, which no router paired)",
                param="use_beam_search",
            )
        if getattr(body, "tools", None):
            raise APIError(400, "tools are not supported with use_beam_search", param="tools")
        if params.grammar is not None:
            raise APIError(
                400,
                "structured output is not supported with use_beam_search",
                param=grammar_field(body),
            )
        if params.prompt_logprobs is not None:
            name = "prompt_logprobs" if body.prompt_logprobs is not None else "echo"
            raise APIError(
                400,
                f"{name} (scoring the prompt) is not supported with use_beam_search",
                param=name,
            )
        sent = {k: v for k in SAMPLING_FIELDS if (v := getattr(body, k)) is not None}
        asked, off = SamplingParams(**sent), SamplingParams()
        for name in _NOT_IN_BEAM_SEARCH:
            value = getattr(asked if name in SAMPLING_FIELDS else params, name, None)
            if value != getattr(off, name, None):
                raise APIError(400, f"{name} is not supported with use_beam_search", param=name)
        try:
            return BeamSearchParams(
                beam_width=self._n(body),
                max_tokens=params.max_tokens,
                ignore_eos=params.ignore_eos,
                temperature=params.temperature,
                length_penalty=1.0 if body.length_penalty is None else body.length_penalty,
                include_stop_str_in_output=params.include_stop_str_in_output,
                stop=params.stop,
                stop_token_ids=params.stop_token_ids,
            )
        except DsakvError as e:
            raise APIError(400, str(e), param="n" if e.param == "beam_width" else e.param) from None

    async def ready_grammar(
        self, params: SamplingParams, param: str | None, reasoning: str | None = None
    ) -> SamplingParams:
        """`params` with its grammar compiled, on a worker thread, into the engine's cache,
        where the engine thread then finds it: a schema that takes seconds to compile keeps
        only its own request waiting, not every stream the engine is stepping (vLLM compiles
        off its step loop too). With `reasoning` (`PreparedChat.reasoning`), the grammar
        starts once the output's reasoning block is over. A grammar that does not compile is
        a 400 naming `param`."""
        grammar = params.grammar
        if grammar is None:
            return params

        def build() -> tuple[str, str]:
            g = after_reasoning(grammar, reasoning or "disabled")
            self._grammar_cache().compile(g)
            return g

        compiling = asyncio.get_running_loop().run_in_executor(self._compiles, build)
        try:
            grammar = await asyncio.wait_for(compiling, GRAMMAR_TIMEOUT_S)
        except DsakvError as e:  # GrammarError; or a model without a tokenizer
            raise APIError(400, str(e), param=param) from None
        except asyncio.TimeoutError:  # (SGLang's SGLANG_GRAMMAR_TIMEOUT)
            raise APIError(
                400, f"the grammar did not compile within {GRAMMAR_TIMEOUT_S:g} s", param=param
            ) from None
        return dataclasses.replace(params, grammar=grammar)

    def _grammar_cache(self) -> GrammarCache:
        """The engine's `GrammarCache`: built on first use, by one thread only. The engine
        thread asks for it only for requests with a grammar, which came through here first."""
        with self._grammars_lock:
            return self.engine.engine.grammars


MAX_PROMPTS = 256  # prompts in one /v1/completions request


def prompt_list(prompt: Any) -> list[str | list[int]]:
    """A completions `prompt` as a list: a string, token ids, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if len(prompt) > MAX_PROMPTS:
        raise APIError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    return [p if isinstance(p, str) else list(p) for p in prompt]


# What beam search does not run (`Handlers._beam`): a 400 where a request sets it.
_NOT_IN_BEAM_SEARCH = (
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "min_tokens",
    "bad_words",
    "allowed_token_ids",
    "thinking_token_budget",
    "repetition_detection",
    "return_routed_experts",  # (SGLang's: each beam's rows are no choice's)
    "return_hidden_states",
)


# vLLM's request fields whose feature dsakv does not run: a 400 unless off.
_NOT_RUN = ("prompt_embeds",)


def request_salt(cache_salt: str | None, extra_key: str | None) -> str | None:
    """A request's prefix-cache salt (`SamplingParams.cache_salt`): vLLM's `cache_salt`,
    refused empty (vLLM's words), then SGLang's `extra_key` appended (its OpenAI routes join
    the two; an empty one is none)."""
    if cache_salt == "":
        raise APIError(
            400,
            "Parameter 'cache_salt' must be a non-empty string if provided.",
            param="cache_salt",
        )
    return (cache_salt or "") + (extra_key or "") or None


# SGLang's request fields, on /generate and the OpenAI routes alike, whose feature dsakv
# does not run: a 400 unless unset (null, false, or empty as its clients send them).
SGLANG_NOT_RUN = ("custom_logit_processor",)


# Request fields that ask for structured output, and the grammar kind each gives.
_GRAMMAR_FIELDS = (
    ("regex", "regex"),
    ("guided_regex", "regex"),
    ("ebnf", "ebnf"),
    ("guided_grammar", "ebnf"),
    ("json_schema", "json_schema"),
    ("guided_json", "json_schema"),
)


def _grammar(body: GenerationRequest) -> tuple[str, str] | None:
    """The (kind, spec) grammar a request asks for, from whichever one field it used."""
    found = _grammar_request(body)
    return found[1] if found else None


def grammar_field(body: GenerationRequest) -> str | None:
    """The field the request's grammar came from (None: no grammar)."""
    found = _grammar_request(body)
    return found[0] if found else None


def _grammar_request(body: GenerationRequest) -> tuple[str, tuple[str, str]] | None:
    """(field, (kind, spec)) of the one structured output a request asks for."""
    found: list[tuple[str, tuple[str, str]]] = []
    rf = body.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", ("json_object", "")))
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError(
                    400,
                    "response_format json_schema needs json_schema.schema",
                    param="response_format",
                )
            found.append(("response_format", ("json_schema", json.dumps(rf.json_schema.schema_))))
        elif rf.type == "structural_tag":
            tag = rf.model_dump(
                include={"type", "format", "structures", "triggers", "at_least_one"}
            )
            tag = {k: v for k, v in tag.items() if v is not None}
            found.append(("response_format", ("structural_tag", json.dumps(tag))))
        else:
            raise APIError(
                400,
                "response_format type must be text, json_object, json_schema or "
                f"structural_tag, not {rf.type!r}",
                param="response_format",
            )
    for name, kind in _GRAMMAR_FIELDS:
        value = getattr(body, name)
        if value is not None:
            found.append((name, (kind, json_spec(value))))
    if body.guided_choice is not None:
        found.append(("guided_choice", _choice_grammar(body.guided_choice, "guided_choice")))
    if (so := body.structured_outputs) is not None:
        fields = so.model_dump(by_alias=True, exclude_none=True)
        try:
            found.append(("structured_outputs", StructuredOutputsParams(**fields).grammar_spec()))
        except DsakvError as e:
            why = str(e).removeprefix("invalid sampling params: ")
            raise APIError(400, why, param="structured_outputs") from None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise APIError(
            400, f"ask for one structured output at a time, not {names}", param=found[1][0]
        )
    return found[0] if found else None


def _choice_grammar(choices: list[str], param: str) -> tuple[str, str]:
    """vLLM's `choice`: the output is exactly one of `choices` (`choice_grammar`)."""
    try:
        return choice_grammar(choices)
    except DsakvError:
        raise APIError(400, f"{param} must be a list of non-empty strings", param=param) from None
