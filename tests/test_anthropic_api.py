"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through a real server
under --api-key and the `anthropic` client (which sends the key as x-api-key), on the GLM
tiny model: each message is the chat completion of the same conversation (greedy, token for
token), its reasoning a thinking block and its tool calls tool_use blocks with parsed input;
tool results continue the conversation as chat's tool turns; streamed events come in
Anthropic's order and add up (through the SDK's own accumulator) to the message; the
prompt's tokens are counted as chat renders it; bad requests are Anthropic's errors; and
`dsakv router` relays it over a prefill/decode pair."""

from __future__ import annotations

import ast
import contextlib
import json
import logging
import pickle
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from datetime import datetime

import anthropic
import httpx
import jsonschema
import openai
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dsakv.engine import EngineConfig
from dsakv.errors import PromptTooLong
from dsakv.models.tiny import write_tiny_model
from dsakv.procs import free_port
from dsakv.server.anthropic import _in_our_words
from dsakv.server.request_log import RequestLogConfig
from dsakv.server.runner import AsyncEngine
from dsakv.server.submit import refusal

from .serving import TIMEOUT, engine_stops_stepping_at, routing, running, serving, serving_disagg
from .test_generate_api import _check_clean, _wait_live
from .test_server import ENGINE_ARGS
from .test_server_tools import SCHEMAS, TOOLS

KEY = "sekrit"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
QUIET = {"type": "disabled"}  # GLM thinks unless told not to
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
# The tools as Anthropic's: name, description, input_schema
CLAUDE_TOOLS = [
    {
        "name": t["function"]["name"],
        **({"description": t["function"]["description"]} if "description" in t["function"] else {}),
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> tuple[str, AsyncEngine]:
    """A server on the GLM tiny model, under --api-key, logging each prompt as rendered
    (`_rendered`): its base URL and engine."""
    path = write_tiny_model(tmp_path_factory.mktemp("glm") / "glm", "glm-tiny", seed=0)
    config = EngineConfig(model=str(path), **{**ENGINE_ARGS, "num_pages": 256})
    shown = RequestLogConfig(on=True, prompts=True)
    with serving(config, api_key=KEY, request_log=shown) as server:
        yield server


@pytest.fixture(scope="module")
def served(server) -> str:
    return server[0]


def _claude(base: str, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key=key, timeout=TIMEOUT, max_retries=0)


@pytest.fixture(scope="module")
def claude(served) -> anthropic.Anthropic:
    return _claude(served)


@pytest.fixture(scope="module")
def gpt(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served}/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)


@pytest.fixture(scope="module")
def model(gpt) -> str:
    return gpt.models.list().data[0].id


def _message(claude, model, **kw):
    """Greedy (the SDK no longer takes `temperature`: the server still does)."""
    kw.setdefault("messages", USER)
    kw.setdefault("max_tokens", 12)
    kw["extra_body"] = {"temperature": 0, **kw.get("extra_body", {})}
    return claude.messages.create(model=model, **kw)


def _chat(gpt, model, **kw):
    kw.setdefault("messages", USER)
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return gpt.chat.completions.create(model=model, **kw)


def _blocks(m) -> list[dict]:
    return [b.model_dump(exclude_none=True) for b in m.content]


def _prompt_tokens(m) -> int:
    return m.usage.input_tokens + m.usage.cache_read_input_tokens


_STOPS = {"length": "max_tokens", "stop": "end_turn", "tool_calls": "tool_use"}


def _same(m, c) -> None:
    """Message `m` says what chat completion `c` says: its reasoning, text and tool calls,
    how it stopped and its tokens."""
    choice = c.choices[0]
    want = []
    reasoning = getattr(choice.message, "reasoning_content", None)
    if reasoning:
        want.append({"type": "thinking", "thinking": reasoning})
    if choice.message.content:
        want.append({"type": "text", "text": choice.message.content})
    for call in choice.message.tool_calls or []:
        want.append(
            {
                "type": "tool_use",
                "id": "toolu_" + call.id.removeprefix("call_"),
                "name": call.function.name,
                "input": json.loads(call.function.arguments),
            }
        )
    got = _blocks(m)
    for block in got:  # (ids are each answer's own; a signature is opaque)
        if block["type"] == "tool_use":
            assert block.pop("id").startswith("toolu_")
        if block["type"] == "thinking":
            assert block.pop("signature")
    for block in want:
        block.pop("id", None)
    assert got == want
    matched = getattr(choice, "stop_reason", None)  # (vLLM's: the stop string it met)
    if choice.finish_reason == "stop" and isinstance(matched, str):
        assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", matched)
    else:
        assert (m.stop_reason, m.stop_sequence) == (_STOPS[choice.finish_reason], None)
    assert m.usage.output_tokens == c.usage.completion_tokens
    assert _prompt_tokens(m) == c.usage.prompt_tokens


def _aborted_while_running(server, model, stream: bool) -> anthropic.APIStatusError:
    """A message aborted by SGLang's /abort_request (its x-request-id) as it runs: the
    error the SDK raised for it."""
    base, async_engine = server
    claude = _claude(base)
    kw = dict(
        model=model,
        messages=USER,
        max_tokens=300,
        thinking=QUIET,
        extra_headers={"x-request-id": "cut"},
        extra_body={"temperature": 0},
    )

    def ask():
        if not stream:
            return claude.messages.create(**kw)
        with claude.messages.stream(**kw) as s:
            return s.get_final_message()

    with ThreadPoolExecutor(1) as pool, engine_stops_stepping_at(async_engine, 2):
        asked = pool.submit(ask)
        _wait_live(async_engine, 1, 2)
        r = httpx.post(
            f"{base}/abort_request", json={"rid": "cut"}, headers=_bearer(), timeout=TIMEOUT
        )
        assert r.status_code == 200, r.text
        with pytest.raises(anthropic.APIStatusError) as e:
            asked.result(TIMEOUT)
    _check_clean(async_engine)
    return e.value


def _bearer() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize("stream", [False, True])
def test_an_aborted_message_is_an_error_not_an_end_turn(server, model, stream):
    """A message /abort_request cut short did not end its turn: no stop_reason says so
    (chat's finish_reason "abort" has no Anthropic twin), so it is Anthropic's overloaded
    error: a 503 unstreamed, an `error` event streamed. Asked for, it is not the SDK's to
    retry (its default retries a 503: the message would run again, to its end)."""
    e = _aborted_while_running(server, model, stream)
    error = {"type": "overloaded_error", "message": "request aborted (abort_request)"}
    assert e.body == {"type": "error", "error": error}
    assert e.status_code == (200 if stream else 503)  # (streamed: the event's)
    if not stream:
        assert e.response.headers["x-should-retry"] == "false"


# --- messages as chat completions -------------------------------------------------------------


def test_a_message_is_the_chat_completion_of_the_same_conversation(claude, gpt, model):
    m = _message(claude, model, system="You are terse.", thinking=QUIET)
    system = [{"role": "system", "content": "You are terse."}]
    c = _chat(gpt, model, messages=system + USER, extra_body=NO_THINKING)
    assert c.choices[0].message.content and c.choices[0].finish_reason == "length"
    _same(m, c)
    assert (m.type, m.role, m.model) == ("message", "assistant", model)
    assert m.id.startswith("msg_") and m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.cache_creation_input_tokens == 0
    # The same prompt again: the prefix cache holds it, which usage tells apart
    again = _message(claude, model, system="You are terse.", thinking=QUIET)
    assert again.content == m.content and again.usage.cache_read_input_tokens > 0
    assert _prompt_tokens(again) == _prompt_tokens(m)


def test_system_blocks_and_system_turns_are_the_system_turn(claude, gpt, model):
    """A system given as text blocks, and Claude Code's `system` turns among the messages,
    are one system turn first (its parts joined by newlines, as chat joins text parts);
    Claude Code's billing header block, a hash of each request, is left out (else no
    prompt would find its prefix cached)."""
    billing = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=1f2e;"}
    blocks = [billing, {"type": "text", "text": "You are terse."}]
    blocks.append({"type": "text", "text": "Be kind."})
    turns = [{"role": "system", "content": "Be kind."}, *USER]
    c = _chat(
        gpt,
        model,
        messages=[{"role": "system", "content": "You are terse.\nBe kind."}, *USER],
        extra_body=NO_THINKING,
    )
    _same(_message(claude, model, system=blocks, thinking=QUIET), c)
    _same(_message(claude, model, system="You are terse.", messages=turns, thinking=QUIET), c)


def test_max_tokens_and_stop_sequences_say_how_the_message_stopped(claude, gpt, model):
    whole = _chat(gpt, model, max_tokens=16, extra_body=NO_THINKING).choices[0].message.content
    stop = whole[len(whole) // 2 :][:2]
    c = _chat(gpt, model, max_tokens=16, stop=[stop], extra_body=NO_THINKING)
    assert c.choices[0].finish_reason == "stop" and c.choices[0].message.content != whole
    m = _message(claude, model, max_tokens=16, stop_sequences=["\x00never", stop], thinking=QUIET)
    _same(m, c)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    cut = _message(claude, model, max_tokens=3, thinking=QUIET)
    assert (cut.stop_reason, cut.usage.output_tokens) == ("max_tokens", 3)


def test_thinking_on_and_off_switch_the_templates_reasoning(claude, gpt, model):
    """GLM's template thinks unless told not to: `thinking` enabled (its budget_tokens as
    vLLM's thinking_token_budget: the reasoning is closed after them), left out (the
    template's default) and disabled each equal chat's same switch."""
    on = {"enable_thinking": True, "thinking": True}
    kw = dict(max_tokens=20)
    m = _message(claude, model, thinking={"type": "enabled", "budget_tokens": 5}, **kw)
    c = _chat(gpt, model, extra_body={"chat_template_kwargs": on, "thinking_token_budget": 5}, **kw)
    _same(m, c)
    assert [b.type for b in m.content] == ["thinking", "text"]
    default = _message(claude, model, **kw)
    _same(default, _chat(gpt, model, **kw))
    assert [b.type for b in default.content] == ["thinking"]  # (the random model never stops)
    off = _message(claude, model, thinking=QUIET, **kw)
    _same(off, _chat(gpt, model, extra_body=NO_THINKING, **kw))
    assert [b.type for b in off.content] == ["text"]


# --- tools ------------------------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["any", "tool"])
def test_a_forced_tool_choice_is_a_tool_use_block_with_valid_input(claude, gpt, model, choice):
    """tool_choice `any` (one call: disable_parallel_tool_use) and `tool` by name force a
    call, as chat's `required` and named tool_choice do: its arguments, as `input`."""
    tool_choice = {"type": "tool", "name": "set_flags"}
    if choice == "any":
        tool_choice = {"type": "any", "disable_parallel_tool_use": True}
    m = _message(
        claude, model, tools=CLAUDE_TOOLS, tool_choice=tool_choice, max_tokens=200, thinking=QUIET
    )
    (block,) = m.content
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    jsonschema.validate(block.input, SCHEMAS[block.name])
    assert m.stop_reason == "tool_use"
    if choice == "tool":
        assert block.name == "set_flags"
    forced = (
        "required" if choice == "any" else {"type": "function", "function": {"name": "set_flags"}}
    )
    c = _chat(
        gpt,
        model,
        tools=TOOLS,
        tool_choice=forced,
        parallel_tool_calls=False,
        max_tokens=200,
        extra_body=NO_THINKING,
    )
    assert _blocks(m)[0]["input"] == json.loads(
        c.choices[0].message.tool_calls[0].function.arguments
    )


def test_a_deferred_tool_that_tool_choice_forces_is_loaded(claude, model):
    """tool_choice naming a deferred tool (tool search's, no tool_reference loaded it yet)
    loads it, as the model must write a call to it: the message and the count are those of
    the same tools undeferred (it was a 400 saying the tool was not in `tools`)."""
    deferred = [CLAUDE_TOOLS[0], {**CLAUDE_TOOLS[1], "defer_loading": True}]
    kw = dict(tool_choice={"type": "tool", "name": "set_flags"}, thinking=QUIET)
    counted = [
        claude.messages.count_tokens(model=model, messages=USER, tools=tools, **kw).input_tokens
        for tools in (deferred, CLAUDE_TOOLS)
    ]
    assert counted[0] == counted[1]
    got, want = (
        _blocks(_message(claude, model, tools=tools, max_tokens=200, **kw))
        for tools in (deferred, CLAUDE_TOOLS)
    )
    for block in got + want:  # (ids are each answer's own)
        assert block.pop("id").startswith("toolu_")
    assert got == want and got[0]["name"] == "set_flags"


def test_a_deferred_tool_an_earlier_turn_called_stays_loaded(claude, model):
    """A deferred tool an earlier turn called stays in the prompt though no tool_reference
    names it any more (a client trimming old tool results drops the one that loaded it):
    the count is that of the same tools undeferred."""
    deferred = [CLAUDE_TOOLS[0], {**CLAUDE_TOOLS[1], "defer_loading": True}]
    call = {"type": "tool_use", "id": "toolu_1", "name": "set_flags", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}
    messages = [*USER, {"role": "assistant", "content": [call]}]
    messages.append({"role": "user", "content": [result]})
    counted = [
        claude.messages.count_tokens(model=model, messages=messages, tools=tools).input_tokens
        for tools in (deferred, CLAUDE_TOOLS)
    ]
    assert counted[0] == counted[1]


def test_the_anthropic_sdk_lists_and_retrieves_the_models(claude, gpt, model):
    """/v1/models carries Anthropic's fields beside OpenAI's: the Anthropic SDK's
    models.list and retrieve read the served names (their type and display name were
    None), and OpenAI's SDK reads the same cards."""
    page = claude.models.list()
    assert [m.id for m in page.data] == [m.id for m in gpt.models.list().data]
    assert (page.first_id, page.last_id, page.has_more) == (model, page.data[-1].id, False)
    got = claude.models.retrieve(model)
    assert (got.id, got.type, got.display_name) == (model, "model", model)
    card = gpt.models.retrieve(model).model_dump()  # (one card: both clocks the same)
    assert datetime.fromisoformat(card["created_at"]).timestamp() == card["created"]


def test_output_config_format_constrains_the_text_to_its_schema(claude, model):
    schema = SCHEMAS["set_flags"]
    config = {"format": {"type": "json_schema", "schema": schema}, "effort": "high"}
    m = _message(claude, model, output_config=config, max_tokens=200, thinking=QUIET)
    (block,) = m.content
    jsonschema.validate(json.loads(block.text), schema)
    assert m.stop_reason == "end_turn"


def test_tool_choice_none_leaves_the_tools_uncalled(claude, gpt, model):
    kw = dict(max_tokens=16)
    m = _message(
        claude, model, tools=CLAUDE_TOOLS, tool_choice={"type": "none"}, thinking=QUIET, **kw
    )
    _same(m, _chat(gpt, model, tools=TOOLS, tool_choice="none", extra_body=NO_THINKING, **kw))


def test_a_tool_result_continues_the_conversation_as_a_tool_turn(claude, gpt, model):
    """The round trip: the message's tool_use block sent back as the assistant turn, the
    tool_result (text blocks, is_error too) as the tool turn, equals chat's conversation of
    the same tool call and tool message; count_tokens counts the same prompt."""
    forced = {"type": "tool", "name": "get_weather"}
    first = _message(
        claude, model, tools=CLAUDE_TOOLS, tool_choice=forced, max_tokens=200, thinking=QUIET
    )
    (call,) = first.content
    result = {
        "type": "tool_result",
        "tool_use_id": call.id,
        "content": [{"type": "text", "text": "Sunny, 21 C"}],
        "is_error": False,
    }
    conversation = [
        *USER,
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [result, {"type": "text", "text": "And tomorrow?"}]},
    ]
    m = _message(claude, model, messages=conversation, tools=CLAUDE_TOOLS, thinking=QUIET)
    chat_call = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": json.dumps(call.input)},
    }
    turns = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    c = _chat(gpt, model, messages=turns, tools=TOOLS, extra_body=NO_THINKING)
    _same(m, c)
    counted = claude.messages.count_tokens(
        model=model, messages=conversation, tools=CLAUDE_TOOLS, thinking=QUIET
    )
    assert counted.input_tokens == c.usage.prompt_tokens


def test_long_mcp_tool_names_are_taken(claude, model):
    """Claude Code names an MCP server's tools `mcp__<server>__<tool>`, past chat's 64
    characters: Anthropic takes up to 128 (vLLM any), so a request holding one is run, and
    the model can call it; only a name past 128 is a 400. (Every Claude Code request with
    such a tool was a 400.)"""
    name = "mcp__claude-in-chrome__" + "read_page_accessibility_tree_" * 3
    assert 64 < len(name) <= 128
    tools = [*CLAUDE_TOOLS, {"name": name, "input_schema": SCHEMAS["set_flags"]}]
    forced = {"type": "tool", "name": name}
    m = _message(claude, model, tools=tools, tool_choice=forced, max_tokens=300, thinking=QUIET)
    (block,) = m.content
    assert (block.type, block.name, m.stop_reason) == ("tool_use", name, "tool_use")
    jsonschema.validate(block.input, SCHEMAS["set_flags"])
    assert claude.messages.count_tokens(model=model, messages=USER, tools=tools).input_tokens
    with pytest.raises(anthropic.BadRequestError) as e:
        _message(claude, model, tools=[{"name": "t" * 129, "input_schema": {"type": "object"}}])
    assert "tools" in _error(e.value, 400, "invalid_request_error")


def test_an_image_in_a_tool_result_is_a_note_not_an_error(claude, model):
    """An image or a PDF a tool returned (Claude Code's Read of a screenshot) is a note in
    the tool turn saying the model cannot see it, where a 400 ended the agent's loop (and
    every later turn's: the block stays in the conversation); an image the user sends is
    still the 400 (`test_bad_requests_are_anthropics_errors`)."""
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
    }
    pdf = {
        "type": "document",
        "source": {"type": "base64", "media_type": "application/pdf", "data": "AA=="},
    }
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
    text = {"type": "text", "text": "the forecast:"}

    def conversation(*shown) -> list[dict]:
        result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [text, *shown]}
        return [
            *USER,
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [result]},
        ]

    kw = dict(tools=CLAUDE_TOOLS, thinking=QUIET)
    m = _message(claude, model, messages=conversation(image, pdf), max_tokens=2, **kw)
    assert m.stop_reason == "max_tokens"
    counts = [
        claude.messages.count_tokens(model=model, messages=conversation(*shown), **kw).input_tokens
        for shown in ((), (image,), (image, pdf))
    ]
    assert counts[0] < counts[1] < counts[2]  # (each block's note)
    assert _prompt_tokens(m) == counts[2]


# --- streaming --------------------------------------------------------------------------------


def _in_order(events) -> None:
    """Anthropic's event grammar: message_start, then blocks (each started, given deltas of
    its own kind, a thinking block's last its signature, stopped; indices 0, 1, ...),
    message_delta, message_stop; pings anywhere."""
    kinds = [e.type for e in events if e.type != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    open_block, next_index, last = None, 0, None
    deltas = {"text": "text_delta", "thinking": "thinking_delta", "tool_use": "input_json_delta"}
    for e in events[1:-2]:
        if e.type == "content_block_start":
            assert open_block is None and e.index == next_index
            open_block, next_index = e.content_block.type, next_index + 1
        elif e.type == "content_block_delta":
            assert open_block is not None and e.index == next_index - 1
            assert last != "signature_delta"
            last = e.delta.type
            assert last == deltas[open_block] or (open_block, last) == (
                "thinking",
                "signature_delta",
            )
        elif e.type == "content_block_stop":
            assert open_block is not None and e.index == next_index - 1
            assert (open_block == "thinking") == (last == "signature_delta")
            open_block, last = None, None
        else:
            assert e.type == "ping", e.type
    assert open_block is None


@pytest.mark.parametrize("case", ["thinking", "tool", "stop"])
def test_streamed_events_add_up_to_the_message(claude, model, case):
    kw = {
        "thinking": dict(thinking={"type": "enabled", "budget_tokens": 5}, max_tokens=20),
        "tool": dict(
            tools=CLAUDE_TOOLS, tool_choice={"type": "any"}, max_tokens=200, thinking=QUIET
        ),
        "stop": dict(max_tokens=16, thinking=QUIET),
    }[case]
    whole = _message(claude, model, **kw)
    if case == "stop":  # (a stop sequence in the middle of the text)
        text = whole.content[0].text
        kw["stop_sequences"] = [text[len(text) // 2 :][:2]]
        whole = _message(claude, model, **kw)
        assert whole.stop_reason == "stop_sequence"
    events = list(_message(claude, model, stream=True, **kw))
    _in_order(events)
    assert events[0].message.id.startswith("msg_") and events[0].message.content == []
    greedy = {"extra_body": {"temperature": 0}}
    with claude.messages.stream(model=model, messages=USER, **greedy, **kw) as stream:
        streamed = stream.get_final_message()
    assert streamed.id.startswith("msg_") and streamed.id != whole.id
    assert _blocks(streamed) == _blocks(whole) or case == "tool"
    if case == "tool":  # (each call's id is its own)
        assert [(b.type, b.name, b.input) for b in streamed.content] == [
            (b.type, b.name, b.input) for b in whole.content
        ]
    assert (streamed.stop_reason, streamed.stop_sequence) == (
        whole.stop_reason,
        whole.stop_sequence,
    )
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert _prompt_tokens(streamed) == _prompt_tokens(whole)
    assert events[-2].usage.output_tokens == whole.usage.output_tokens


def test_a_tool_call_cut_by_max_tokens_has_the_same_input_streamed_or_not(claude, model):
    """max_tokens cutting a call's arguments short: the message's `input` is what the SDK
    makes of the streamed `input_json_delta`s (the JSON written so far, as Claude Code sees
    it), not {} where the streamed message held the arguments so far."""
    forced = {"type": "tool", "name": "get_weather"}
    kw = dict(tools=CLAUDE_TOOLS, tool_choice=forced, thinking=QUIET)
    whole = _message(claude, model, max_tokens=300, **kw)
    cut = whole.usage.output_tokens - 10  # (in the arguments, their object not yet closed)
    m = _message(claude, model, max_tokens=cut, **kw)
    events = list(_message(claude, model, max_tokens=cut, stream=True, **kw))
    written = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    with pytest.raises(ValueError):
        json.loads(written)  # (cut short indeed)
    greedy = {"extra_body": {"temperature": 0}}
    with claude.messages.stream(model=model, messages=USER, max_tokens=cut, **greedy, **kw) as s:
        streamed = s.get_final_message()
    assert m.stop_reason == streamed.stop_reason == "max_tokens"
    (block,) = m.content
    assert block.input == streamed.content[0].input != {}
    assert block.input.items() <= whole.content[0].input.items()


# --- a Claude Code conversation ---------------------------------------------------------------

CACHED = {"type": "ephemeral"}
# What Claude Code sends on every turn (the SDK's `betas`: the anthropic-beta header, and
# /v1/messages?beta=true): its billing header, identity and prompt as cached system blocks,
# its tools (the last marked for caching, one deferred for tool search), its user id,
# context management, and thinking on
CLAUDE_CODE = dict(
    betas=[
        "claude-code-20250219",
        "interleaved-thinking-2025-05-14",
        "context-management-2025-06-27",
    ],
    system=[
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.37; cch=fa690;"},
        {"type": "text", "text": "You are Claude Code.", "cache_control": CACHED},
        {"type": "text", "text": "Use the tools.", "cache_control": CACHED},
    ],
    tools=[
        {**CLAUDE_TOOLS[0], "input_schema": {**SCHEMAS["get_weather"], "$schema": "draft-07"}},
        {**CLAUDE_TOOLS[1], "defer_loading": True, "cache_control": CACHED},
    ],
    metadata={"user_id": "user_1_account__session_2"},
    context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    thinking={"type": "enabled", "budget_tokens": 5},
)
REMINDER = "<system-reminder>today is Monday</system-reminder>"


def _rendered(caplog, mid: str) -> str:
    """The prompt message `mid` ran, as the server rendered it (its request log's line)."""
    (line,) = [
        r.getMessage()
        for r in caplog.records
        if r.name == "dsakv.requests" and r.getMessage().startswith(f"Received request {mid}:")
    ]
    return ast.literal_eval(line.split(", prompt=", 1)[1])


def _claude_code_turn(claude, model, stream: bool, messages: list, **kw):
    """One turn as Claude Code asks for it (greedy): the message, and streamed, its
    events in Anthropic's order, their usage the message's, its thinking signed."""
    kw = dict(model=model, messages=messages, **CLAUDE_CODE, **kw)
    counted = claude.beta.messages.count_tokens(
        **{k: v for k, v in kw.items() if k not in ("max_tokens", "metadata")}
    ).input_tokens
    greedy = {"extra_body": {"temperature": 0}}
    if not stream:
        m = claude.beta.messages.create(**kw, **greedy)
    else:
        with claude.beta.messages.stream(**kw, **greedy) as s:
            raw = {"message_start", "ping", "message_delta", "message_stop"}
            raw |= {"content_block_start", "content_block_delta", "content_block_stop"}
            events = [e for e in s if e.type in raw]
            m = s.get_final_message()
        _in_order(events)
        start, delta = events[0].message.usage, events[-2].usage
        # message_start's usage is the prompt's as the message's is (the prefix cache's
        # share known), message_delta's the totals
        assert (start.input_tokens, start.cache_read_input_tokens) == (
            m.usage.input_tokens,
            m.usage.cache_read_input_tokens,
        )
        assert (delta.output_tokens, delta.input_tokens) == (
            m.usage.output_tokens,
            m.usage.input_tokens,
        )
        signed = [
            getattr(e.delta, "signature", None) for e in events if e.type == "content_block_delta"
        ]
        signed = [x for x in signed if x is not None]
        assert signed == [b.signature for b in m.content if b.type == "thinking"]
    assert m.id.startswith("msg_") and (m.type, m.role, m.model) == ("message", "assistant", model)
    assert _prompt_tokens(m) == counted and m.usage.cache_creation_input_tokens == 0
    for block in m.content:
        if block.type == "thinking":
            assert block.signature and isinstance(block.signature, str)
    return m


@pytest.mark.parametrize("stream", [False, True])
def test_a_claude_code_conversation_round_trips(claude, model, caplog, stream):
    """A Claude Code session's turns, as it sends them: a call made while thinking, its
    blocks sent back whole (the thinking's signature too) with the tool's result (a
    tool_reference among it, which loads the deferred tool), each turn's prompt holding
    what was sent (an empty text block adding nothing), its usage adding up to the
    count_tokens of the same request."""
    caplog.set_level(logging.INFO, logger="dsakv.requests")
    question = {"type": "text", "text": "What is the weather in Paris?", "cache_control": CACHED}
    user = {
        "role": "user",
        "content": [{"type": "text", "text": REMINDER}, {"type": "text", "text": ""}, question],
    }
    forced = {"type": "tool", "name": "get_weather"}  # (the random model calls nothing else)
    first = _claude_code_turn(claude, model, stream, [user], tool_choice=forced, max_tokens=300)
    thought, call = first.content
    assert (thought.type, call.type, first.stop_reason) == ("thinking", "tool_use", "tool_use")
    jsonschema.validate(call.input, SCHEMAS["get_weather"])
    prompt = _rendered(caplog, first.id)
    assert "You are Claude Code.\nUse the tools." in prompt and "billing" not in prompt
    assert f"<|user|>{REMINDER}\nWhat is the weather in Paris?<|assistant|><think>" in prompt
    assert '"get_weather"' in prompt and "set_flags" not in prompt  # (deferred: not loaded)

    result = [
        {"type": "text", "text": "Sunny, 21 C", "cache_control": CACHED},
        {"type": "tool_reference", "tool_name": "set_flags"},
    ]
    turns = [
        user,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}],
        },
    ]
    second = _claude_code_turn(claude, model, stream, turns, max_tokens=8)
    assert second.stop_reason == "max_tokens" and second.usage.cache_read_input_tokens > 0
    prompt = _rendered(caplog, second.id)
    assert '"set_flags"' in prompt  # (loaded by the tool_reference)
    args = "".join(
        f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in call.input.items()
    )
    said = f"<think>{thought.thinking.strip()}</think><tool_call>get_weather{args}</tool_call>"
    assert said in prompt  # (the thinking sent back, after the last user turn: kept)
    tool_turn = "<|observation|><tool_response>Sunny, 21 C\n[tool reference: set_flags]"
    assert f"{tool_turn}</tool_response><|assistant|><think>" in prompt


# --- counting, errors, the key ----------------------------------------------------------------


def test_count_tokens_is_the_prompts_token_count(claude, gpt, model):
    system = "You are terse."
    counted = claude.messages.count_tokens(
        model=model, system=system, messages=USER, tools=CLAUDE_TOOLS, thinking=QUIET
    )
    c = _chat(
        gpt,
        model,
        messages=[{"role": "system", "content": system}, *USER],
        tools=TOOLS,
        max_tokens=1,
        extra_body=NO_THINKING,
    )
    assert counted.input_tokens == c.usage.prompt_tokens
    thinking = claude.messages.count_tokens(model=model, system=system, messages=USER)
    assert thinking.input_tokens != counted.input_tokens  # (no tools: fewer)


def _error(e: anthropic.APIStatusError, status: int, kind: str) -> str:
    assert e.status_code == status
    assert e.body["type"] == "error" and e.body["error"]["type"] == kind
    assert set(e.body["error"]) == {"type", "message"}
    return e.body["error"]["message"]


def test_bad_requests_are_anthropics_errors(claude, served, model):
    r = httpx.post(
        f"{served}/v1/messages",
        json={"model": model, "messages": USER},
        headers={"x-api-key": KEY},
        timeout=TIMEOUT,
    )
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        _message(claude, model, messages=[{"role": "tool", "content": "hi"}])
    # (it says what it takes: Claude Code's system, ctx and msg turns too)
    assert "role must be one of user, assistant, system, ctx, msg" in _error(
        e.value, 400, "invalid_request_error"
    )
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
    }
    with pytest.raises(anthropic.BadRequestError) as e:
        _message(claude, model, messages=[{"role": "user", "content": [image]}])
    assert "image" in _error(e.value, 400, "invalid_request_error")
    with pytest.raises(anthropic.NotFoundError) as e:
        _message(claude, "claude-nonesuch")
    assert "claude-nonesuch" in _error(e.value, 404, "not_found_error")
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.count_tokens(model="claude-nonesuch", messages=USER)
    _error(e.value, 404, "not_found_error")
    with pytest.raises(anthropic.BadRequestError) as e:  # (Claude Code reads these words)
        _message(claude, model, max_tokens=10**7)
    assert "exceed context limit" in _error(e.value, 400, "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError) as e:
        _message(claude, model, messages=[{"role": "user", "content": "hi " * 100_000}])
    assert _error(e.value, 400, "invalid_request_error").startswith("prompt is too long: ")
    assert httpx.get(f"{served}/health", timeout=TIMEOUT).status_code == 200


def test_a_prompt_past_hisparses_latent_pool_is_too_long_in_anthropics_words():
    """The engine's refusals of a prompt too long carry their counts (`PromptTooLong`),
    which the Messages API words as Anthropic does; HiSparse's (the device's latent pool
    holds fewer tokens than the context) was left in the server's words, which Claude Code
    does not read as a prompt to compact."""
    message = (
        "prompt has 50 tokens; under HiSparse a prompt is prefilled on the device, whose "
        "latent pool holds 40 tokens: at most 39 fit (one kept for the output)"
    )
    error = _in_our_words(refusal(PromptTooLong(message, 50, 39), "messages"))
    assert (error.status, error.message) == (400, "prompt is too long: 50 tokens > 39 maximum")
    # Copied or pickled (as an error crossing threads or processes may be), counts and all.
    again = pickle.loads(pickle.dumps(PromptTooLong(message, 50, 39, 7, "prompt")))
    assert (str(again), again.tokens, again.limit, again.max_tokens, again.param) == (
        message,
        50,
        39,
        7,
        "prompt",
    )


def test_the_api_key_is_taken_as_x_api_key(served, model):
    with pytest.raises(anthropic.AuthenticationError) as e:
        _message(_claude(served, "wrong"), model)
    _error(e.value, 401, "authentication_error")
    bearer = httpx.post(
        f"{served}/v1/messages/count_tokens",
        json={"model": model, "messages": USER},
        headers={"authorization": f"Bearer {KEY}"},
        timeout=TIMEOUT,
    )
    assert bearer.status_code == 200 and bearer.json()["input_tokens"] > 0


# --- through the router -----------------------------------------------------------------------


@contextlib.contextmanager
def _keyed_pd(prefill: EngineConfig, decode: EngineConfig):
    """A prefill and a decode server and the router, all under --api-key: yields the
    router's URL, an Anthropic and an OpenAI client of it, and the served model."""
    with ExitStack() as stack:
        p_url, _ = stack.enter_context(serving_disagg(prefill, "prefill", api_key=KEY))
        d_url, _ = stack.enter_context(serving_disagg(decode, "decode", api_key=KEY))
        router = stack.enter_context(routing([p_url], [d_url], api_key=KEY))
        gpt = openai.OpenAI(base_url=f"{router}/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)
        yield router, _claude(router), gpt, gpt.models.list().data[0].id


def test_the_router_relays_messages_over_a_prefill_decode_pair(tmp_path_factory):
    """/v1/messages through `dsakv router` (its key, and the servers', as x-api-key) is the
    chat completion the router gives for the same conversation, streamed or not;
    count_tokens is a decode server's answer; an admin call every server hears takes the
    key as x-api-key too (it was not relayed: the servers' 401)."""
    path = str(write_tiny_model(tmp_path_factory.mktemp("pd") / "m", "glm-tiny"))
    conf = EngineConfig(path, **{**ENGINE_ARGS, "num_pages": 128})
    with _keyed_pd(conf, conf) as (router, claude, gpt, model):
        m = _message(claude, model, thinking=QUIET)
        _same(m, _chat(gpt, model, extra_body=NO_THINKING))
        greedy = {"extra_body": {"temperature": 0}}
        with claude.messages.stream(
            model=model, messages=USER, max_tokens=12, thinking=QUIET, **greedy
        ) as stream:
            assert _blocks(stream.get_final_message()) == _blocks(m)
        counted = claude.messages.count_tokens(model=model, messages=USER, thinking=QUIET)
        assert counted.input_tokens == _prompt_tokens(m)
        with pytest.raises(anthropic.AuthenticationError) as e:
            _message(_claude(router, "wrong"), model)
        _error(e.value, 401, "authentication_error")
        flushed = httpx.post(f"{router}/flush_cache", headers={"x-api-key": KEY}, timeout=TIMEOUT)
        assert flushed.status_code == 200, flushed.text


def test_a_prompt_too_long_for_the_prefill_server_alone_is_refused_as_one_server_words_it(
    tmp_path_factory,
):
    """Under PD a prompt past the prefill server's context (not the decode server's) is the
    client's 400 as a single server words it: Anthropic's "prompt is too long" for the
    Messages API (Claude Code compacts on it), OpenAI's context_length_exceeded code for
    chat (the decode server's answer had dropped the prefill server's code)."""
    path = str(write_tiny_model(tmp_path_factory.mktemp("pd_short") / "m", "glm-tiny"))
    conf = EngineConfig(path, **{**ENGINE_ARGS, "num_pages": 128})
    short = EngineConfig(path, **{**ENGINE_ARGS, "num_pages": 128, "max_model_len": 64})
    long = [{"role": "user", "content": "word " * 30}]
    with _keyed_pd(short, conf) as (_, claude, gpt, model):
        for stream in (False, True):
            with pytest.raises(anthropic.BadRequestError) as e:
                _message(claude, model, messages=long, max_tokens=4, stream=stream)
            said = _error(e.value, 400, "invalid_request_error")
            assert said.startswith("prompt is too long: ") and said.endswith(" > 63 maximum")
            with pytest.raises(openai.BadRequestError) as e:
                _chat(gpt, model, messages=long, max_tokens=4, stream=stream)
            assert e.value.code == "context_length_exceeded", e.value.body


def _dying_server() -> FastAPI:
    """A stand-in prefill or decode server whose streamed message ends mid-body after its
    first event, as a decode server killed mid-stream does."""
    app = FastAPI()

    @app.get("/disagg/info")
    async def info() -> dict:
        return {"mode": "prefill", "bootstrap_port": free_port()}

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        if not (await request.json()).get("stream"):
            return JSONResponse({})  # (the prefill server's copy)
        message = {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "m",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 0},
        }
        start = {"type": "message_start", "message": message}

        async def events():
            yield f"event: message_start\ndata: {json.dumps(start)}\n\n"
            raise RuntimeError("killed")  # (uvicorn drops the connection mid-body)

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_a_decode_server_lost_mid_stream_is_an_anthropic_error_event():
    """The router's error for a decode server lost mid-stream is Anthropic's `error` event
    on /v1/messages, which the SDK raises; OpenAI's chunk (no event name) was skipped by the
    SDK, and the cut message taken as whole (no stop_reason, no error)."""
    with ExitStack() as stack:
        urls = [
            stack.enter_context(
                running(
                    uvicorn.Server(
                        uvicorn.Config(_dying_server(), port=free_port(), log_level="critical")
                    )
                )
            )
            for _ in range(2)
        ]
        router = stack.enter_context(routing(urls[:1], urls[1:]))
        claude = _claude(router)
        with (
            pytest.raises(anthropic.APIStatusError, match="lost the decode server") as e,
            claude.messages.stream(model="m", messages=USER, max_tokens=8) as stream,
        ):
            stream.get_final_message()
        assert e.value.body["error"]["type"] == "api_error"
