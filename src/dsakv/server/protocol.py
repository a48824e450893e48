"""OpenAI request schemas and the error body. Strict types: a wrongly typed field is a 400,
never a silent coercion; unknown fields are ignored (clients send many we do not use)."""

from __future__ import annotations

import asyncio
import re
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from starlette.requests import Request

from dsakv.errors import PromptTooLong

# Responses kept for previous_response_id and GET, the least recently used dropped first (a
# background response still running is never dropped; a router keeps as many per decode
# server). vLLM keeps every one, for ever.
RESPONSES_KEPT = 4096
_RECEIVE_AGAIN_S = 0.5  # how long `client_left` waits before asking the server again


class APIError(Exception):
    """An error the client caused (or a server error), rendered in OpenAI's shape.
    `too_long`: the engine's refusal of a prompt too long, whose counts other APIs word
    their own way (Anthropic's: `anthropic`)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        too_long: PromptTooLong | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )
        self.too_long = too_long

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Anthropic's Messages API routes (`dsakv.server.anthropic`): their errors are in its shape
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
_ANTHROPIC_ERRORS = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """An error in Anthropic's shape, its type told by the HTTP `status` as Anthropic's are
    (what its clients read: an overloaded server is worth retrying, a 400 is not)."""
    kind = _ANTHROPIC_ERRORS.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_for(path: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """An error (`body`: OpenAI's shape) as the clients of route `path` read errors:
    Anthropic's shape on its routes (`ANTHROPIC_PATHS`), else as it is."""
    if path in ANTHROPIC_PATHS:
        return anthropic_error_body(status, body["error"]["message"])
    return body


# What an HTTP header value may be (RFC 9110's field-value), in ASCII: a client's request id
# must be one, as it comes back in the X-Request-Id header
HEADER_SAFE = re.compile(r"[\x21-\x7e]+(?:[ \t]+[\x21-\x7e]+)*")

# The longest id a client may give a request (vLLM's request_id, SGLang's rid) or name a
# response by (previous_response_id); vLLM and SGLang take any. Ample for a UUID (36) or
# OpenAI's ids (under 64), and far below what an id goes into: the X-Request-Id header of
# its answer (h11, httpx's and uvicorn's, reads 16 KiB of headers at most: a longer id
# made an answer no client could read) and a URL (/v1/responses/{id}: 64 KiB in httpx).
MAX_ID_CHARS = 512
ClientId = Annotated[str, StringConstraints(max_length=MAX_ID_CHARS)]


# What an aborted request says where nobody asked for the abort (the server stopping): one
# wording for every API's error
SHUTTING_DOWN = "request aborted (server shutting down)"


def new_id(prefix: str = "", length: int = 32) -> str:
    """A fresh random id: `prefix` (its separator included: ids are client-visible, each
    API's own shape, "resp_...", "file-...") then `length` hex digits."""
    return prefix + uuid.uuid4().hex[:length]


def list_page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's cursor page of objects (the openai client asks on `after` its last id)."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


# OpenAI's bounds on an object's `metadata` (a batch's, a response's): pairs, and each key's
# and value's characters
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


def check_metadata(metadata: dict[str, str] | None) -> None:
    """The 400 for `metadata` past OpenAI's bounds (its pairs' types are the body model's)."""
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        message = f"metadata has {len(metadata)} pairs, {MAX_METADATA_PAIRS} at most"
        raise APIError(400, message, param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            message = (
                f"metadata key {key[:16]!r}... is {len(key)} characters, "
                f"{MAX_METADATA_KEY_CHARS} at most"
            )
            raise APIError(400, message, param="metadata")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            message = (
                f"metadata[{key!r}] is {len(value)} characters, {MAX_METADATA_VALUE_CHARS} at most"
            )
            raise APIError(400, message, param="metadata")


class StrictModel(BaseModel):
    """A request body's schema: a wrongly typed field is a 400, an unknown one ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(StrictModel):
    include_usage: bool | None = False
    # vLLM's: with include_usage, every chunk also carries its choice's usage so far
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(StrictModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its guided_* fields' successor): one constraint."""

    model_config = ConfigDict(strict=True, extra="forbid")  # (options not run: refused)
    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool | None = None  # (one grammar engine here: nothing to fall back on)
    disable_any_whitespace: bool | None = None  # (its JSON grammars admit none either way)


class RepetitionDetection(StrictModel):
    """vLLM's `repetition_detection` (`RepetitionDetectionParams`, which checks it)."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0


class ResponseFormat(StrictModel):
    """OpenAI's `response_format`: `text`, `json_object` or `json_schema` (checked later), or
    vLLM's and SGLang's `structural_tag` (xgrammar's `format`, or the legacy `structures` and
    `triggers`)."""

    type: str
    json_schema: JsonSchemaFormat | None = None
    format: Any = None
    structures: list[Any] | None = None
    triggers: list[Any] | None = None
    at_least_one: bool | None = None


class ServingExtras(StrictModel):
    """vLLM's and SGLang's request fields beyond sampling, as completions and chat read
    them; a response takes the same ones (`responses._chat_request` hands them to chat)."""

    # vLLM's prefix-cache isolation (a non-empty string), and SGLang's, which appends its
    # extra_key to it (`params.request_salt`)
    cache_salt: str | None = None
    extra_key: str | None = None
    thinking_token_budget: int | None = None  # vLLM's (`SamplingParams`)
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs' tokens as "token_id:N"
    priority: int | None = None  # under priority scheduling only (`Engine.check_priority`)
    # vLLM's P/D hand-off: a prefill or decode server's (`dsakv.disagg.handoff`), refused
    # elsewhere (`Handlers.sampling_params`)
    kv_transfer_params: dict[str, Any] | None = None
    # SGLang's, not run here: a 400 unless unset (null, false or empty: sgl.gen sends
    # stop_regex: []); any shape, so the refusal names the field
    stop_regex: Any = None
    custom_logit_processor: Any = None
    session_params: Any = None
    # SGLang's: the LoRA adapter, by its name (`Handlers.lora_name`; any shape, so that a
    # list, /generate's, is a 400 naming it)
    lora_path: Any = None


class GenerationRequest(ServingExtras):
    """Fields shared by completions and chat completions (plus vLLM-style extras)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extras (vLLM / SGLang names)
    top_k: int | None = None
    min_p: float | None = None
    sampling_seed: int | None = None  # SGLang's name for `seed` (see `Handlers.sampling_params`)
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = 0
    repetition_penalty: float | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's score, rank and top-k
    # structured output: OpenAI's response_format, SGLang's regex / ebnf / json_schema and
    # vLLM's guided_json / guided_regex / guided_grammar; at most one of them
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's, since it dropped guided_*
    # vLLM's token constraints and prompt truncation (`SamplingParams`)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    no_stop_trim: bool | None = None  # SGLang's include_stop_str_in_output
    return_token_ids: bool | None = None  # vLLM's: the prompt's and each choice's ids too
    truncation_side: str | None = None  # vLLM's: "left" keeps the last tokens, "right" the first
    # vLLM's beam search (`Handlers._beam`): `n` is its width
    use_beam_search: bool | None = None
    length_penalty: float | None = None  # (its score's; None: vLLM's 1.0)
    logprob_token_ids: list[int] | None = None  # vLLM's (`Handlers._logprob_token_ids`)
    repetition_detection: RepetitionDetection | None = None  # vLLM's
    request_id: ClientId | None = None  # vLLM's: the response's id (after "cmpl-" / "chatcmpl-")
    # refused unless off (`Handlers.sampling_params`): what it asks for is not run here
    prompt_embeds: Any = None
    # SGLang's (its server flags allow them, as /generate's): the routed experts of each
    # token (from routed_experts_start_len) in the response's `sglext`, and each choice's
    # last hidden state (`Handlers.sampling_params`)
    return_routed_experts: bool | None = False
    routed_experts_start_len: int | None = 0
    return_hidden_states: bool | None = False


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: a text prompt gets its tokenizer's (a BOS)


class ContentPart(StrictModel):
    type: str
    text: str | None = None


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call it answers
    # an assistant turn's earlier reasoning, by vLLM's name now or its former one
    reasoning: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of type object
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    add_special_tokens: bool = False  # vLLM's: the template holds its own (a BOS)
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. enable_thinking / thinking
    chat_template: str | None = None  # vLLM's; refused: the server's is --chat-template
    # vLLM's: to the template (reasoning_effort, documents); reasoning_content left out
    reasoning_effort: str | None = None
    documents: list[dict[str, Any]] | None = None
    include_reasoning: bool | None = True
    # SGLang's: false leaves the reasoning in `content`; stream_reasoning false sends it in
    # one piece once it is over
    separate_reasoning: bool | None = True
    stream_reasoning: bool | None = True
    echo: bool | None = None  # vLLM's: the last message prepended (`echo_content`)
    # vLLM's: continue the last (assistant) message instead of opening a new one
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False


class TokenizeRequest(StrictModel):
    """vLLM's /tokenize: a `prompt` (as /v1/completions sees it) or chat `messages`."""

    model: str | None = None
    prompt: str | None = None
    # None: as the generation endpoints tokenize (a prompt with them, messages without)
    add_special_tokens: bool | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # with `messages`: rendered as chat renders them
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


class ResponsesTextFormat(StrictModel):
    """`text.format`: `text`, `json_object` or `json_schema` (its schema inline)."""

    type: str
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponsesText(StrictModel):
    format: ResponsesTextFormat | None = None
    verbosity: str | None = None


class ResponsesReasoning(StrictModel):
    effort: str | None = None  # (to the chat template, as chat's reasoning_effort)
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(ServingExtras):
    """OpenAI's Responses API request (`dsakv.server.responses`), with vLLM's extras;
    `input` items are checked where they are read (their shapes are many)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: ClientId | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    text: ResponsesText | None = None
    reasoning: ResponsesReasoning | None = None
    stream: bool | None = False
    store: bool | None = True
    background: bool | None = False
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    include: list[str] | None = None
    top_logprobs: int | None = None
    user: str | None = None
    # accepted and echoed, nothing to run (as vLLM)
    max_tool_calls: int | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # refused unless left off: what they ask for is not run here (SGLang's last two: on
    # completions and chat only)
    prompt: Any = None
    conversation: Any = None
    return_hidden_states: Any = None
    return_routed_experts: Any = None
    # vLLM's extras (and `ServingExtras`, to chat)
    request_id: ClientId | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


async def client_left(raw: Request) -> None:
    """Return once the client has hung up. The body is read already, so the next ASGI message
    is the disconnect: waiting for it (as vLLM's `listen_for_disconnect` does) sees a hang-up
    at once, where a poll let a short request run to its end after its client had gone. Each
    wait is bounded: a client that pipelined its next request paused uvicorn's reading,
    which only a fresh `receive` resumes (else its hang-up went unseen)."""
    while True:
        try:
            message = await asyncio.wait_for(raw.receive(), _RECEIVE_AGAIN_S)
        except asyncio.TimeoutError:
            continue
        if message["type"] == "http.disconnect":
            return


def invocation_path(body: dict[str, Any]) -> str:
    """The route vLLM's /invocations (SageMaker's one route) passes `body` to, by its shape:
    chat for `messages`, else completions for a `prompt` (vLLM tries them in that order);
    neither: vLLM's 400. Told by the field alone, so a malformed request gets that route's
    own 400 naming the field (vLLM's tries the next shape, then answers this one)."""
    for key, path in (("messages", "/v1/chat/completions"), ("prompt", "/v1/completions")):
        if body.get(key) is not None:
            return path
    expected = "['ChatCompletionRequest', 'CompletionRequest']"
    raise APIError(400, f"Cannot find suitable handler for request. Expected one of: {expected}")
