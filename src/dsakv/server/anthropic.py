"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), what coding
agents such as Claude Code speak, as vLLM serves it: over the chat path. A request becomes
the chat completion request of the same conversation (its system text a system turn,
`tool_use` blocks the assistant turn's tool calls, `tool_result` blocks tool turns,
`thinking` the chat template's thinking switch), run by `Handlers.start_chat` exactly as
/v1/chat/completions runs it; the chat parser's reasoning, text and tool calls come back as
`thinking`, `text` and `tool_use` blocks, whole or as Anthropic's stream events. Its errors
are in Anthropic's shape (`protocol.error_for`)."""

from __future__ import annotations

import asyncio
import base64
import copy
import hashlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, ValidationError
from pydantic_core import from_json

from .handlers import ChatRun, Handlers
from .openai_format import CUT_SHORT, finish_reason
from .parsers import ChatDelta
from .protocol import (
    SHUTTING_DOWN,
    APIError,
    ChatCompletionRequest,
    FunctionDefinition,
    StrictModel,
    TokenizeRequest,
    Tool,
    anthropic_error_body,
    new_id,
)
from .submit import AbortingStream, Result, sse_event

# A request's roles as chat's: Claude Code sends `system` turns among the messages (folded
# into the system text, as vLLM does) and, lately, `ctx` and `msg` ones (vLLM's: user turns)
_ROLES = {
    "user": "user",
    "assistant": "assistant",
    "system": "system",
    "ctx": "user",
    "msg": "user",
}
# The system block Claude Code starts with: a header holding a hash of the request, which
# would make every prompt's first tokens new to the prefix cache (dropped, as vLLM does)
_BILLING_HEADER = "x-anthropic-billing-header"
# chat's names for a request's fields, in the Messages API's words (errors name those)
_FIELDS = {
    "stop": "stop_sequences",
    "thinking_token_budget": "thinking.budget_tokens",
    "response_format": "output_config.format",
}
# Blocks a tool_result may hold that this server's models cannot read (Claude Code's Read of
# a screenshot or a PDF), and the note each is in the tool turn: a 400 would end the agent's
# loop, and every later turn's too, as the block stays in the conversation
_UNREAD = {
    kind: {"type": "text", "text": f"[{kind} not shown: this model reads text only]"}
    for kind in ("image", "document")
}


class AnthropicTool(StrictModel):
    # (chat's characters; Anthropic's length: Claude Code's MCP tools, `mcp__<server>__<tool>`,
    # run past chat's 64)
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # (required: `_tool`; server tools have none)
    type: str | None = None  # "custom"; Anthropic's server tools (web search, ...) are refused
    # Tool search's: left out of the prompt until a `tool_reference` loads it (`chat_request`)
    defer_loading: bool | None = None


class AnthropicToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AnthropicThinking(StrictModel):
    # (every kind but "disabled" turns the template's thinking on; `display` is not run)
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None


class AnthropicOutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class AnthropicOutputConfig(StrictModel):
    # (to the template, as chat's reasoning_effort gives it)
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: AnthropicOutputFormat | None = None


class AnthropicMessage(StrictModel):
    role: str  # (checked where read: `_ROLES`)
    content: str | list[dict[str, Any]]  # blocks are checked where read (their shapes are many)


class CountTokensRequest(StrictModel):
    """`/v1/messages/count_tokens`' body: what renders the prompt."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None
    output_config: AnthropicOutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra (wins over `thinking`)


class MessagesRequest(CountTokensRequest):
    """`/v1/messages`' body (`metadata` and fields not run, such as `service_tier`, are
    accepted and ignored, as vLLM's)."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    stream: bool | None = False


def add_anthropic_routes(app: FastAPI, api: Handlers) -> None:
    """POST /v1/messages and /v1/messages/count_tokens."""

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, raw: Request) -> Response:
        return await _create(api, body, raw)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        """The prompt's tokens: the rendered conversation's, as /tokenize counts them."""
        chat = chat_request(body, api.chat_parsers.reasoning is not None)
        fields = ("model", "messages", "tools", "chat_template_kwargs")
        fields += ("add_generation_prompt", "continue_final_message")
        counted = TokenizeRequest(**{k: getattr(chat, k) for k in fields})
        return {"input_tokens": (await asyncio.to_thread(api.tokenize, counted))["count"]}


async def _create(api: Handlers, body: MessagesRequest, raw: Request) -> Response:
    api.check_model(body.model)
    chat = chat_request(body, api.chat_parsers.reasoning is not None)
    mid = new_id("msg_", 24)
    named = raw.headers.get("x-request-id") or None  # (/abort_request's name, as chat's)
    try:
        run = await api.start_chat(chat, raw, named, mid)
    except APIError as e:
        raise _in_our_words(e) from None
    headers = {"request-id": mid}  # (Anthropic's; its clients show it)
    if body.stream:
        close = api.closer(run.call, run.streams)
        return AbortingStream(_events(api, run, mid), close, headers)
    (r,) = await api.collect_all(run.streams, raw, run.call)
    if r.finish_reason == "abort":
        if r.abort_asked is not None:  # (stopped on purpose: not for the SDK to run again)
            headers["x-should-retry"] = "false"
        return JSONResponse(_aborted(r), 503, headers)
    parser, blocks = run.prep.output_parser(), _Blocks()
    blocks.feed(parser.feed(r.text, final=True, cut=r.finish_reason in CUT_SHORT))
    blocks.finish()
    usage = _usage(r.prompt_tokens, r.cached_tokens, r.completion_tokens)
    message = _message(api.served_name(run.params), mid, blocks.blocks, usage)
    message.update(_stop(r.finish_reason, r.stop_reason, blocks.calls))
    return JSONResponse(message, headers=headers)


async def _events(api: Handlers, run: ChatRun, mid: str) -> AsyncIterator[str]:
    """The message as Anthropic's stream events: `message_start` (no content yet; its usage
    the prompt's, as Anthropic's, so sent once the prompt is in: the engine's first update,
    which says what the prefix cache held), `ping`, each content block's
    `content_block_start`, deltas and `content_block_stop`, then `message_delta` (the
    stop reason, and the usage in full: the SDK takes its counts over message_start's) and
    `message_stop`; a failure ends it with an `error` event, and so does an abort."""
    parser, blocks, totals = run.prep.output_parser(), _Blocks(), Result()
    try:
        async for _, u in api.merged_updates(run.streams):
            if totals.first is None:
                usage = _usage(u.prompt_tokens, u.cached_tokens, 0)
                model = api.served_name(run.params)
                yield _sse("message_start", message=_message(model, mid, [], usage))
                yield _sse("ping")
            totals.add(u)
            d = parser.feed(u.text, final=u.finished, cut=finish_reason(u) in CUT_SHORT)
            for kind, fields in blocks.feed(d):
                yield _sse(kind, **fields)
    except APIError as e:
        yield _sse("error", error=anthropic_error_body(e.status, e.message)["error"])
        return
    if totals.finish_reason == "abort":
        yield _sse("error", error=_aborted(totals)["error"])
        return
    for kind, fields in blocks.finish():
        yield _sse(kind, **fields)
    usage = _usage(totals.prompt_tokens, totals.cached_tokens, totals.completion_tokens)
    stop = _stop(totals.finish_reason, totals.stop_reason, blocks.calls)
    yield _sse("message_delta", delta=stop, usage=usage)
    yield _sse("message_stop")


def _aborted(r: Result) -> dict[str, Any]:
    """The error body (a 503's) of a turn aborted before it ended (SGLang's /abort_request,
    a pause or weight update that aborts, the server stopping): Anthropic has no
    stop_reason for it (`end_turn` would tell an agent the model was done, where chat says
    "abort"), and its API fails a turn it cannot finish: an overloaded error. Unstreamed,
    one asked for says not to retry it (Anthropic's `x-should-retry: false`: the SDK
    retries a 5xx, running it again)."""
    message = SHUTTING_DOWN if r.abort_asked is None else "request aborted (abort_request)"
    return anthropic_error_body(503, message)


def _sse(kind: str, **fields: Any) -> str:
    return sse_event({"type": kind, **fields}, kind)


def _message(model: str, mid: str, content: list, usage: dict[str, int]) -> dict[str, Any]:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }


def _usage(prompt: int, cached: int, output: int) -> dict[str, int]:
    """Anthropic's usage: `input_tokens` are the prompt's tokens the prefix cache did not
    hold, `cache_read_input_tokens` those it did (their sum the prompt's, as Anthropic
    counts them); nothing is written to a cache on request."""
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output,
    }


def _stop(reason: str | None, matched: str | int | None, calls: bool) -> dict[str, Any]:
    """Anthropic's stop_reason (and stop_sequence) for how the output ended: `max_tokens`
    when cut (a tool call too), `tool_use` when it called tools (forced or not),
    `stop_sequence` at one of the request's stop strings, else `end_turn`."""
    if reason in CUT_SHORT:
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if calls:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if reason == "stop" and isinstance(matched, str):  # (an int: a stop token, EOS's)
        return {"stop_reason": "stop_sequence", "stop_sequence": matched}
    return {"stop_reason": "end_turn", "stop_sequence": None}


class _Blocks:
    """A message's content blocks, built from a chat parser's deltas (reasoning: `thinking`,
    text: `text`, tool calls: `tool_use`), and the stream events each delta makes: a block
    starts, takes its deltas (a tool call's arguments as `input_json_delta`s), and stops
    when the next one starts or the message ends, which parses each call's `input`."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._open: int | None = None
        self._calls: dict[int, int] = {}  # tool call index -> its block's
        self._args: dict[int, str] = {}  # a tool_use block's arguments (JSON text) so far

    @property
    def calls(self) -> bool:
        return bool(self._calls)

    def feed(self, d: ChatDelta) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        for kind, part in d.parts(set(self._calls)):
            if kind == "call":
                self._call(part, out)
            else:
                self._text("thinking" if kind == "reasoning" else "text", part, out)
        return out

    def finish(self) -> list[tuple[str, dict[str, Any]]]:
        for at, args in self._args.items():
            self.blocks[at]["input"] = _input(args)
        return self._stop()

    def _start(self, block: dict[str, Any], out: list) -> int:
        out += self._stop()
        self.blocks.append(block)
        self._open = len(self.blocks) - 1
        out.append(("content_block_start", {"index": self._open, "content_block": dict(block)}))
        return self._open

    def _stop(self) -> list[tuple[str, dict[str, Any]]]:
        """The open block's end: a thinking block is signed first (Anthropic's
        `signature_delta`, the last before its stop)."""
        at, self._open = self._open, None
        if at is None:
            return []
        out: list[tuple[str, dict[str, Any]]] = []
        block = self.blocks[at]
        if block["type"] == "thinking":
            block["signature"] = _signature(block["thinking"])
            delta = {"type": "signature_delta", "signature": block["signature"]}
            out.append(("content_block_delta", {"index": at, "delta": delta}))
        return [*out, ("content_block_stop", {"index": at})]

    def _text(self, kind: str, text: str, out: list) -> None:
        at = self._open
        if at is None or self.blocks[at]["type"] != kind:
            extra = {"signature": ""} if kind == "thinking" else {}  # (signed when it stops)
            at = self._start({"type": kind, kind: "", **extra}, out)
        self.blocks[at][kind] += text
        out.append(
            ("content_block_delta", {"index": at, "delta": {"type": f"{kind}_delta", kind: text}})
        )

    def _call(self, call: dict[str, Any], out: list) -> None:
        if "id" in call:  # a call starts
            block = {
                "type": "tool_use",
                "id": "toolu_" + call["id"].removeprefix("call_"),
                "name": call["function"]["name"],
                "input": {},
            }
            self._calls[call["index"]] = at = self._start(copy.deepcopy(block), out)
            self._args[at] = ""
        at = self._calls[call["index"]]
        fragment = call["function"].get("arguments") or ""
        if fragment:
            self._args[at] += fragment
            delta = {"type": "input_json_delta", "partial_json": fragment}
            out.append(("content_block_delta", {"index": at, "delta": delta}))


def _signature(thinking: str) -> str:
    """A thinking block's signature, which its clients keep and send back with the block
    (Anthropic's proves the text its model's, and it refuses a block sent back without
    one): opaque, and the same for the same text, so a turn streamed is the turn
    unstreamed. A block sent back is taken whatever it carries (this one, Anthropic's,
    none): nothing here rests on the text being ours."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def _input(args: str) -> dict[str, Any]:
    """A call's arguments as its `input` object ({} where there are none), read as the SDK
    reads the streamed `input_json_delta`s, so both say the same where max_tokens cut them
    off: the JSON written so far, but a string or a literal left unfinished."""
    try:
        value = from_json(args, allow_partial=True) if args else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


# --- the request as a chat request ------------------------------------------------------------


def chat_request(body: CountTokensRequest, reasoning: bool) -> ChatCompletionRequest:
    """The chat request that runs `body` (`reasoning`: the server has a reasoning parser,
    which `thinking.budget_tokens` needs). The conversation's system text comes first (but
    Claude Code's billing header); a last assistant turn is continued (Anthropic's prefill:
    the reply goes on from it).

    A deferred tool joins the tools the template lists once loaded (as SGLang does for a
    template that has no deferred tools of its own; a template listing them first: the
    prefix cache misses from there once): one the conversation's tool search loaded (its
    tool results' `tool_reference` blocks name it), as Anthropic's own loads them, one an
    earlier turn called (a client that trims old tool results may have dropped the
    reference that loaded it), and the one `tool_choice` forces (the model must write a
    call to it, so must see it: the request names a tool it gave, not one missing)."""
    system: list[dict[str, str]] = _texts(body.system, "system") if body.system else []
    messages: list[dict[str, Any]] = []
    loaded: set[str] = set()  # (the deferred tools in the prompt, as the messages are read)
    for i, m in enumerate(body.messages):
        at = f"messages[{i}]"
        role = _ROLES.get(m.role)
        if role is None:
            accepted = ", ".join(_ROLES)
            raise APIError(
                400, f"{at}.role must be one of {accepted}; got {m.role!r}", param="messages"
            )
        if role == "system":
            system += _texts(m.content, f"{at}.content")
        elif role == "assistant":
            messages.append(turn := _assistant_turn(m.content, at))
            loaded.update(c["function"]["name"] for c in turn.get("tool_calls", ()))
        else:
            messages += _user_turns(m.content, at, loaded)
    system = [p for p in system if not p["text"].startswith(_BILLING_HEADER)]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    kwargs = dict(body.chat_template_kwargs or {})
    thinking = body.thinking
    if thinking is not None and not {"enable_thinking", "thinking"} & kwargs.keys():
        on = thinking.type != "disabled"  # (GLM's templates read one, DeepSeek-V3.2's the other)
        kwargs.update(enable_thinking=on, thinking=on)
    if body.output_config is not None and body.output_config.effort is not None:
        kwargs.setdefault("reasoning_effort", body.output_config.effort)
    choice, config = body.tool_choice, body.output_config
    if choice is not None and choice.type == "tool" and choice.name:
        loaded.add(choice.name)
    given = body.tools or []
    tools = [_tool(t, k) for k, t in enumerate(given)]
    tools = [c for c, t in zip(tools, given) if not t.defer_loading or t.name in loaded]
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "tool_choice": _tool_choice(choice),
        "parallel_tool_calls": not (choice and choice.disable_parallel_tool_use),
        "chat_template_kwargs": kwargs or None,
    }
    if messages and messages[-1]["role"] == "assistant":
        chat.update(add_generation_prompt=False, continue_final_message=True)
    if isinstance(body, MessagesRequest):
        chat.update(
            max_tokens=body.max_tokens,
            stop=body.stop_sequences,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stream=bool(body.stream),
        )
        if config is not None and config.format is not None:
            schema = {"name": "output", "schema": config.format.schema_}
            chat["response_format"] = {"type": "json_schema", "json_schema": schema}
        on = thinking is not None and thinking.type == "enabled"
        if on and reasoning:  # (else the template thinks unbounded, as it would anyway)
            chat["thinking_token_budget"] = thinking.budget_tokens
    try:
        request = ChatCompletionRequest.model_validate(
            {k: v for k, v in chat.items() if v is not None}
        )
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(_FIELDS.get(str(x), str(x)) for x in first["loc"])
        raise APIError(400, f"{loc}: {first['msg']}", param=str(first["loc"][0])) from None
    request.tools = tools or None  # (checked as Anthropic's: `AnthropicTool`)
    return request


def _user_turns(
    content: str | list[dict[str, Any]], at: str, loaded: set[str]
) -> list[dict[str, Any]]:
    """A user message as chat turns: its `tool_result` blocks tool turns, its text a user
    turn, in their order (the tools their `tool_reference`s load added to `loaded`)."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    turns: list[dict[str, Any]] = []
    parts: list[dict[str, str]] = []
    for j, block in enumerate(content):
        where = f"{at}.content[{j}]"
        if block.get("type") != "tool_result":
            parts += _texts([block], f"{at}.content", j)
            continue
        if parts:
            turns.append({"role": "user", "content": parts})
            parts = []
        result = block.get("content")
        # (`is_error` is taken as vLLM takes it: the content says what failed)
        if isinstance(result, str):
            text: str | list[dict[str, str]] = result
        else:
            text = _result_texts(result, f"{where}.content", loaded)
        call_id = _string(block, "tool_use_id", where)
        turns.append({"role": "tool", "tool_call_id": call_id, "content": text})
    if parts or not turns:
        turns.append({"role": "user", "content": parts})
    return turns


def _assistant_turn(content: str | list[dict[str, Any]], at: str) -> dict[str, Any]:
    """An assistant message as a chat turn: its text, its `thinking` as the turn's
    reasoning and its `tool_use` blocks as tool calls (`redacted_thinking`: nothing to
    read)."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    parts: list[dict[str, str]] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        where, kind = f"{at}.content[{j}]", block.get("type")
        if kind == "thinking":
            thoughts.append(_string(block, "thinking", where))
        elif kind == "tool_use":
            given = block.get("input", {})
            if not isinstance(given, dict):
                raise APIError(400, f"{where}.input must be an object", param="messages")
            function = {"name": _string(block, "name", where), "arguments": json.dumps(given)}
            calls.append({"id": _string(block, "id", where), "function": function})
        elif kind != "redacted_thinking":
            parts += _texts([block], f"{at}.content", j)
    turn: dict[str, Any] = {"role": "assistant", "content": parts or None}
    if thoughts:
        turn["reasoning_content"] = "".join(thoughts)
    if calls:
        turn["tool_calls"] = calls
    return turn


def _texts(content: Any, at: str, first: int = 0) -> list[dict[str, str]]:
    """Text blocks (a string: one) as chat's text parts, which the template joins by
    newlines: an empty one left out, as vLLM leaves it (a newline more is not what was
    sent); any other block is a 400 (an image: this server's models read text only)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise APIError(400, f"{at} must be a string or a list of blocks", param="messages")
    parts = []
    for j, block in enumerate(content, first):
        where = f"{at}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "image":
            raise APIError(
                400,
                f"{where}: image blocks are not supported (this server's model reads text only)",
                param="messages",
            )
        if kind != "text":
            raise APIError(
                400, f"{where}: content block type {kind!r} is not supported", param="messages"
            )
        text = _string(block, "text", where)
        if text:
            parts.append({"type": "text", "text": text})
    return parts


def _result_texts(content: Any, at: str, loaded: set[str]) -> list[dict[str, str]]:
    """A tool_result's blocks as text parts: one the model cannot read as its note
    (`_UNREAD`), a `tool_reference` (tool search's: the tool it names is loaded, added to
    `loaded`) as a note naming it, as SGLang writes one for a template that has no tool
    references of its own."""
    if isinstance(content, list):
        content = [_result_block(b, f"{at}[{j}]", loaded) for j, b in enumerate(content)]
    return _texts(content or [], at)


def _result_block(block: Any, where: str, loaded: set[str]) -> Any:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "tool_reference":
        name = _string(block, "tool_name", where)
        loaded.add(name)
        return {"type": "text", "text": f"[tool reference: {name}]"}
    return _UNREAD.get(str(kind), block)


def _string(block: dict[str, Any], key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{key} must be a string", param="messages")
    return value


def _tool(tool: AnthropicTool, k: int) -> Tool:
    """The chat tool of `tool`, built as it is (chat's checks would refuse a name past 64
    characters)."""
    if tool.type not in (None, "custom"):
        raise APIError(
            400,
            f"tools[{k}]: type {tool.type!r} is not supported (Anthropic's server tools run "
            "on its own servers; custom tools only)",
            param="tools",
        )
    if tool.input_schema is None:
        raise APIError(400, f"tools[{k}].input_schema: Field required", param="tools")
    function = FunctionDefinition.model_construct(
        name=tool.name, description=tool.description, parameters=tool.input_schema
    )
    return Tool.model_construct(type="function", function=function)


def _tool_choice(choice: AnthropicToolChoice | None) -> Any:
    if choice is None:
        return None
    if choice.type != "tool":
        return {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if not choice.name:
        raise APIError(400, "tool_choice.name is required when type is 'tool'", param="tool_choice")
    return {"type": "function", "function": {"name": choice.name}}


def _in_our_words(e: APIError) -> APIError:
    """Chat's error for the request, in the Messages API's words: its fields' names, and a
    prompt that does not fit as Anthropic says it (what clients such as Claude Code read to
    compact the conversation, or to ask for fewer tokens)."""
    message, too_long = e.message, e.too_long
    if too_long is not None and not too_long.max_tokens:
        message = f"prompt is too long: {too_long.tokens} tokens > {too_long.limit} maximum"
    elif too_long is not None:
        asked = f"{too_long.tokens} + {too_long.max_tokens} > {too_long.limit}"
        message = (
            f"input length and `max_tokens` exceed context limit: {asked}, "
            "decrease input length or `max_tokens` and try again"
        )
    elif e.param in _FIELDS:
        message = re.sub(rf"\b{e.param}\b", _FIELDS[e.param], message)
    return APIError(e.status, message, e.type, _FIELDS.get(e.param or "", e.param), e.code)
