"""Chat requests in and out: messages and `tools` through the chat template into a prompt,
`tool_choice` into a grammar, and generated text back into OpenAI messages and deltas with
`reasoning_content` and `tool_calls`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from dsakv.engine.chat_format import render_chat, template_message
from dsakv.engine.grammar import unenforced_keyword
from dsakv.errors import DsakvError

from .parsers import (
    TOOL_FORMATS,
    ChatDelta,
    ChatOutputParser,
    ToolCallParser,
    reasoning_mode,
    reasoning_parser,
    resolve_parsers,
    tool_call_structural_tag,
)
from .protocol import APIError, ChatCompletionRequest, ChatMessage

# Template arguments the server sets itself; chat_template_kwargs may not override them.
_RESERVED_KWARGS = (
    "messages",
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "conversation",
)
# vLLM's reasoning_effort values; "none" turns thinking off (`prepare_chat`)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def load_chat_template(value: str) -> str:
    """vLLM's `--chat-template`: a file holding a Jinja chat template, or the template
    itself; parsed here (as transformers compiles it), so a typo fails before the model
    loads, not at the first chat request."""
    path = Path(value)
    if path.is_file():
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise DsakvError(f"{value}: {e}") from None
    elif any(c in value for c in "{}\n"):
        text = value
    else:
        raise DsakvError(f"{value}: no such file (nor a Jinja template)")
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols])
    try:
        env.parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise DsakvError(f"line {e.lineno}: {e.message}") from None
    return text


@dataclass(frozen=True)
class ChatParsers:
    """The server's tool-call and reasoning parsers (None: that feature is off)."""

    tool: str | None = None
    reasoning: str | None = None

    @classmethod
    def for_model(
        cls,
        model_type: str,
        tool: str | None = "auto",
        reasoning: str | None = "auto",
        chat_template: str | None = None,
    ) -> ChatParsers:
        """Parsers by name ("auto": the model type's own, or the markup its `chat_template`
        writes: `resolve_parsers`; "none": off); unknown names raise `DsakvError`."""
        return cls(*resolve_parsers(model_type, tool, reasoning, chat_template))

    @classmethod
    def for_engine(
        cls, engine: Any, tool: str | None = "auto", reasoning: str | None = "auto"
    ) -> ChatParsers:
        """`for_model` for what `engine` serves: its model type and its tokenizer's chat
        template (`--chat-template`'s where given)."""
        template = engine.tokenizer.chat_template if engine.tokenizer is not None else None
        return cls.for_model(engine.model_config.model_type, tool, reasoning, template)


@dataclass(frozen=True)
class PreparedChat:
    """A chat request made ready for the engine, and how to read its output back."""

    prompt: str
    grammar: tuple[str, str] | None  # set when tool_choice forces a call
    tool_schemas: dict[str, Any] | None  # name -> parameters; None: no tool-call parsing
    parsers: ChatParsers
    parallel_tool_calls: bool = True  # False: only the first call is returned
    # Where the output starts for structured output (`dsakv.engine.grammar.after_reasoning`):
    # "enabled", inside a reasoning block the prompt opened; "auto", where the model may open
    # one; "disabled", in the content (no reasoning parser, or the prompt closed the block),
    # or where `grammar` (a forced call's) already lets the reasoning finish first.
    reasoning: str = "disabled"
    named_tool: bool = False  # tool_choice names the function (`finish_reason`)
    separate_reasoning: bool = True  # SGLang's: False leaves the reasoning in the content

    def output_parser(self) -> ChatOutputParser:
        """A fresh parser for one choice's output."""
        tools = None
        if self.tool_schemas is not None and self.parsers.tool is not None:
            tools = ToolCallParser(
                TOOL_FORMATS[self.parsers.tool], self.tool_schemas, self.grammar is not None
            )
        reasoning = self.parsers.reasoning if self.separate_reasoning else None
        return ChatOutputParser(
            reasoning_parser(reasoning, self.prompt), tools, self.parallel_tool_calls
        )

    def finish_reason(self, parser: ChatOutputParser, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" when the model stopped after calling tools under "auto" or
        "required"; under a named tool_choice OpenAI and vLLM keep "stop"."""
        if reason == "stop" and parser.tool_calls and not self.named_tool:
            return "tool_calls"
        return reason


def prepare_chat(
    body: ChatCompletionRequest,
    tokenizer: Any,
    parsers: ChatParsers,
    model_type: str | None = None,
) -> PreparedChat:
    """Render the prompt (tools included: `render_chat`) and build the forcing grammar; bad
    input is a 400."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    schemas: dict[str, Any] = {}
    for i, t in enumerate(tools):
        fn = t["function"]
        params = fn.get("parameters")
        if params is not None and params.get("type", "object") != "object":
            raise APIError(
                400,
                f"tools[{i}].function.parameters must be a JSON Schema of type object",
                param="tools",
            )
        if fn["name"] in schemas:
            raise APIError(400, f"tool {fn['name']!r} is defined twice", param="tools")
        schemas[fn["name"]] = params or {}
    choice = _tool_choice(body, schemas, parsers)

    if body.chat_template is not None:  # (it was ignored, silently)
        raise APIError(
            400,
            "a request's own chat_template is not run (a Jinja template is code; vLLM too "
            "refuses it unless trusted): the server's is set with --chat-template",
            param="chat_template",
        )
    kwargs = dict(body.chat_template_kwargs or {})
    for key in _RESERVED_KWARGS:
        if key in kwargs:
            raise APIError(
                400, f"chat_template_kwargs may not set {key!r}", param="chat_template_kwargs"
            )
    effort = body.reasoning_effort
    if effort is not None and effort not in REASONING_EFFORTS:
        raise APIError(
            400,
            f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
            param="reasoning_effort",
        )
    if effort == "none" and not {"enable_thinking", "thinking"} & kwargs.keys():
        kwargs["enable_thinking"] = False  # (vLLM's; the template's own kwargs win)
    for key in ("reasoning_effort", "documents"):  # vLLM's: the template reads them
        if getattr(body, key) is not None:
            kwargs[key] = getattr(body, key)
    if body.continue_final_message:
        if body.add_generation_prompt is not False:
            raise APIError(
                400,
                "continue_final_message needs add_generation_prompt: false",
                param="continue_final_message",
            )
        if body.messages[-1].role != "assistant":
            raise APIError(
                400,
                "continue_final_message needs an assistant message last",
                param="continue_final_message",
            )
        kwargs["continue_final_message"] = True
    try:
        prompt = render_chat(
            tokenizer,
            [_template_message(i, m) for i, m in enumerate(body.messages)],
            model_type,
            tools=tools or None,
            add_generation_prompt=body.add_generation_prompt is not False,
            **kwargs,
        )
    except APIError:
        raise
    except Exception as e:  # jinja raise_exception: bad roles / order
        raise APIError(400, f"chat template failed: {e}", param="messages") from None

    grammar = None
    if choice == "required" or isinstance(choice, dict):
        assert parsers.tool is not None  # _tool_choice checked
        forced = [choice["function"]["name"]] if isinstance(choice, dict) else list(schemas)
        for name in forced:
            if (hit := unenforced_keyword(schemas[name])) is not None:
                raise APIError(
                    400, f"tool {name!r}: parameters' {hit} cannot be enforced", param="tools"
                )
        try:
            spec = tool_call_structural_tag(
                parsers.tool,
                tools,
                choice,
                prompt,
                reasoning=parsers.reasoning is not None,
                parallel_tool_calls=body.parallel_tool_calls is not False,
            )
        except DsakvError as e:
            raise APIError(400, str(e), param="tools") from None
        grammar = ("structural_tag", spec)
    parse_tools = choice != "none" and bool(schemas) and parsers.tool is not None
    return PreparedChat(
        prompt,
        grammar,
        schemas if parse_tools else None,
        parsers,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        reasoning=(
            reasoning_mode(prompt, True)
            if parsers.reasoning is not None and grammar is None
            else "disabled"
        ),
        named_tool=isinstance(choice, dict),
        separate_reasoning=body.separate_reasoning is not False,
    )


def _tool_choice(
    body: ChatCompletionRequest, schemas: dict[str, Any], parsers: ChatParsers
) -> str | dict[str, Any]:
    """The effective tool_choice: "none", "auto", "required" or {"type": "function", ...}."""
    choice: Any = body.tool_choice
    if choice is None:
        return "auto" if schemas else "none"
    if not isinstance(choice, str):
        choice = choice.model_dump()
    if choice == "none":
        return choice
    if not schemas:
        if choice == "auto":  # `tools: []` with "auto", as vLLM takes it: no tools
            return "none"
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if isinstance(choice, dict) and choice["function"]["name"] not in schemas:
        name = choice["function"]["name"]
        raise APIError(
            400, f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
        )
    if parsers.tool is None and choice != "auto":
        raise APIError(
            400,
            "this server has no tool-call parser (start it with --tool-call-parser)",
            param="tool_choice",
        )
    return choice


def _template_message(i: int, m: ChatMessage) -> dict[str, Any]:
    """One message as chat templates expect it (`template_message`, `LLM.chat`'s too)."""
    try:
        return template_message(i, m.model_dump(exclude_none=True))
    except DsakvError as e:
        raise APIError(400, str(e), param="messages") from None


# --- output -----------------------------------------------------------------------------------


def reply_role(body: ChatCompletionRequest, response_role: str) -> str:
    """vLLM's `get_chat_request_role`: `response_role` (its --response-role), or under
    add_generation_prompt false the last message's role (the reply goes on with that
    message)."""
    if body.add_generation_prompt is not False or not body.messages:
        return response_role
    return body.messages[-1].role


def echo_content(body: ChatCompletionRequest, role: str) -> str:
    """vLLM's chat `echo`: the last message's text, which each reply starts with, when it is
    in the reply's role (`role`: `reply_role`'s); else nothing."""
    last = body.messages[-1] if body.echo and body.messages else None
    if last is None or last.role != role:
        return ""
    content = _template_message(len(body.messages) - 1, last).get("content")
    return content if isinstance(content, str) else ""


def chat_message(parser: ChatOutputParser, reasoning: bool = True) -> dict[str, Any]:
    """The assistant message of a finished (fully fed) parser (its reasoning left out
    unless `reasoning`: vLLM's include_reasoning)."""
    calls = parser.tool_calls
    msg: dict[str, Any] = {
        "role": "assistant",
        "content": parser.content or (None if calls else ""),
    }
    if parser.reasoning is not None and reasoning:
        msg["reasoning_content"] = parser.reasoning
    if calls:
        msg["tool_calls"] = calls
    return msg


def chat_delta(d: ChatDelta, reasoning: bool = True) -> dict[str, Any]:
    """A streamed `delta` object for what one step settled (as `chat_message`)."""
    delta: dict[str, Any] = {}
    if d.reasoning and reasoning:
        delta["reasoning_content"] = d.reasoning
    if d.content:
        delta["content"] = d.content
    if d.tool_calls:
        delta["tool_calls"] = d.tool_calls
    return delta
