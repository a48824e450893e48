"""Chat prompts: OpenAI messages as chat templates read them (`template_message`, as vLLM
reads them) and a conversation rendered as prompt text (`render_chat`): by the chat template,
else, for DeepSeek-V3.2, which ships none, by its `encoding_dsv32` in code, as vLLM and
SGLang render it. Used by `LLM.chat` and the server's chat, /tokenize."""

from __future__ import annotations

import json
import reprlib
from collections.abc import Mapping
from typing import Any

from dsakv.errors import DsakvError, is_list


def template_message(i: int, message: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI message `i` as chat templates expect it, as vLLM reads it: text content parts
    joined by newlines, tool-call arguments (JSON text) as dicts, an earlier turn's reasoning
    under both its names (`reasoning`, vLLM's now, and `reasoning_content`, which templates
    read); other keys as given."""
    if not isinstance(message, Mapping):
        raise DsakvError(f"messages[{i}] must be a message dict, got {message!r}", "messages")
    out = dict(message)
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        if not is_list(content):
            raise DsakvError(
                f"messages[{i}]: content must be a string or a list of content parts, "
                f"got {reprlib.repr(content)}",
                "messages",
            )
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind != "text":
                raise DsakvError(
                    f"messages[{i}]: content part type {kind!r} is not supported", "messages"
                )
            text = part.get("text") or ""
            if not isinstance(text, str):
                raise DsakvError(
                    f"messages[{i}]: a text part's text must be a string, got {reprlib.repr(text)}",
                    "messages",
                )
            texts.append(text)
        content = "\n".join(texts)
    out["content"] = content or ""
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")
    if reasoning is not None:
        out["reasoning"] = out["reasoning_content"] = reasoning
    calls = message.get("tool_calls")
    if calls:
        if not is_list(calls):
            raise DsakvError(
                f"messages[{i}].tool_calls must be a list of tool calls, got {reprlib.repr(calls)}",
                "messages",
            )
        out["tool_calls"] = [_template_call(i, j, c) for j, c in enumerate(calls)]
    return out


def _template_call(i: int, j: int, call: object) -> dict[str, Any]:
    if not isinstance(call, Mapping):
        raise DsakvError(
            f"messages[{i}].tool_calls[{j}] must be a tool call dict, got {reprlib.repr(call)}",
            "messages",
        )
    function = call.get("function") or {}
    if not isinstance(function, Mapping):
        raise DsakvError(
            f"messages[{i}].tool_calls[{j}].function must be a dict with name and arguments, "
            f"got {reprlib.repr(function)}",
            "messages",
        )
    args = function.get("arguments") or "{}"
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            args = None
    if not isinstance(args, dict):
        raise DsakvError(
            f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object", "messages"
        )
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": function.get("name"), "arguments": args},
    }


def has_chat_format(
    tokenizer: Any, model_type: str | None, chat_template: str | None = None
) -> bool:
    """Whether `render_chat` can render a conversation for this model."""
    if tokenizer is None:
        return False
    return bool(chat_template or getattr(tokenizer, "chat_template", None)) or (
        model_type == "deepseek_v32"
    )


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    model_type: str | None,
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    **kwargs: Any,
) -> str:
    """A conversation (`template_message`'s dicts) as prompt text, its BOS included: through
    the chat template (`chat_template`, else the tokenizer's), else, for DeepSeek-V3.2, which
    ships none, its `encoding_dsv32` as vLLM and SGLang render it in code
    (`deepseek_v32_prompt`)."""
    if chat_template or getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **kwargs,
        )
    if model_type != "deepseek_v32":
        raise DsakvError("this model's tokenizer has no chat template", "messages")
    # vLLM's DeepSeek-V3.2 tokenizer: either flag turns thinking on; the generation prompt
    # is part of each user turn, so add_generation_prompt changes nothing.
    thinking = bool(kwargs.get("thinking") or kwargs.get("enable_thinking"))
    prompt = deepseek_v32_prompt(messages, tools, thinking, _deepseek_markers(tokenizer))
    if kwargs.get("continue_final_message") and messages[-1].get("role") == "assistant":
        prompt = prompt.removesuffix(_deepseek_markers(tokenizer)[3])  # left open
    return prompt


_DS_MARKERS = ("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>")
_DS_TINY_MARKERS = ("<|bos|>", "<|user|>", "<|assistant|>", "<|eos|>")  # (the tiny presets')
DSML = "｜DSML｜"  # fullwidth vertical bars (U+FF5C), as DeepSeek-V3.2 spells them
_DS_TOOLS = """## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{D}function_calls>" block like the following as part \
of your reply to the user:
<{D}function_calls>
<{D}invoke name="$FUNCTION_NAME">
<{D}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{D}parameter>
...
</{D}invoke>
<{D}invoke name="$FUNCTION_NAME2">
...
</{D}invoke>
</{D}function_calls>
String and scalar parameters should be specified as is without any escaping or quotes, \
while lists and objects should use JSON format. The "string" attribute should be set to \
"true" for string type parameters and "false" for other types (numbers, booleans, arrays, \
objects).
If the thinking_mode is enabled, then after function results you should strongly consider \
outputting a thinking block. Here is an example:
<{D}function_calls>
...
</{D}function_calls>
<function_results>
...
</function_results>
<think>...thinking about results</think>
Here are the functions available in JSONSchema format:
<functions>
{SCHEMAS}
</functions>
"""


def _deepseek_markers(tokenizer: Any) -> tuple[str, str, str, str]:
    """(BOS, user, assistant, EOS): DeepSeek-V3.2's own where the tokenizer has them, else
    the tiny presets' role tokens."""
    tid = tokenizer.convert_tokens_to_ids(_DS_MARKERS[1])
    if tid is not None and tid != tokenizer.unk_token_id:
        return _DS_MARKERS
    return _DS_TINY_MARKERS


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def deepseek_v32_prompt(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    thinking: bool,
    markers: tuple[str, str, str, str] = _DS_MARKERS,
) -> str:
    """DeepSeek-V3.2's chat format (its `encoding_dsv32.encode_messages`, as vLLM applies
    it): tools as a leading system turn, tool calls in DSML, tool results as
    `<function_results>`, each user turn ending in the generation prompt `<think>` (the last
    one, thinking) or `</think>`; the reasoning of turns before the last user turn
    dropped."""
    bos, user, assistant, eos = markers
    if tools:
        messages = [{"role": "system", "content": "", "tools": tools}, *messages]
    last_user = max((i for i, m in enumerate(messages) if m["role"] in _DS_USERS), default=-1)
    out = [bos]
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content") or ""
        opener = "<think>" if thinking and i == last_user else "</think>"
        if role == "system":
            out.append(content + _ds_tools(m.get("tools")))
        elif role == "developer":
            text = _ds_tools(m.get("tools")) + f"\n\n# The user's message is: {content}"
            out.append(f"{user}{text}{assistant}{opener}")
        elif role == "user":
            out.append(f"{user}{content}{assistant}{opener}")
        elif role == "tool":
            out.append(_ds_tool_result(messages, i, thinking and i >= last_user))
        elif role == "assistant":
            calls = m.get("tool_calls") or []
            text = ""
            if thinking and i > last_user:  # (earlier turns' reasoning is dropped)
                text = (m.get("reasoning") or m.get("reasoning_content") or "") + "</think>"
            text += content
            if calls:
                invokes = "\n".join(_ds_invoke(c) for c in calls)
                text += f"\n\n<{DSML}function_calls>\n{invokes}\n</{DSML}function_calls>"
            out.append(text + eos)
        else:
            raise DsakvError(f"unsupported role {role!r}", "messages")
    return "".join(out)


_DS_USERS = ("user", "developer")


def _ds_tools(tools: list[dict[str, Any]] | None) -> str:
    if not tools:
        return ""
    schemas = "\n".join(_json(t["function"]) for t in tools)
    return "\n\n" + _DS_TOOLS.format(D=DSML, SCHEMAS=schemas)


def _ds_invoke(call: dict[str, Any]) -> str:
    fn = call["function"]
    params = "\n".join(
        f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
        f"{v if isinstance(v, str) else _json(v)}</{DSML}parameter>"
        for k, v in fn["arguments"].items()
    )
    return f'<{DSML}invoke name="{fn["name"]}">\n{params}\n</{DSML}invoke>'


def _ds_tool_result(messages: list[dict[str, Any]], i: int, think: bool) -> str:
    """Tool message `i`: one `<result>` of the `<function_results>` block answering the
    assistant turn before its run of tool messages."""
    start = i
    while start > 0 and messages[start - 1]["role"] == "tool":
        start -= 1
    calls = messages[start - 1].get("tool_calls") if start > 0 else None
    if not calls or messages[start - 1]["role"] != "assistant" or len(calls) <= i - start:
        raise DsakvError(
            f"messages[{i}]: a tool result needs an assistant tool call before it", "messages"
        )
    text = "\n\n<function_results>" if i == start else ""
    text += f"\n<result>{messages[i].get('content') or ''}</result>"
    if i - start + 1 == len(calls):
        text += "\n</function_results>\n\n" + ("<think>" if think else "</think>")
    return text
