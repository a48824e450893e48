"""Tool calls and reasoning through a real server (the `openai` client on 127.0.0.1), on the
GLM and DeepSeek-V3.2 tiny models: forced calls are well formed even from random weights,
streamed deltas reassemble into the non-streamed call, reasoning is split, bad input is a
400 and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from dsakv.cli import main as cli_main
from dsakv.engine import EngineConfig
from dsakv.engine.chat_format import render_chat
from dsakv.models.tiny import write_tiny_model

from .serving import TIMEOUT, serving
from .test_server import ENGINE_ARGS

PRESETS = {"glm": "glm-tiny", "deepseek": "deepseek-tiny"}
MODEL_TYPES = {"glm": "glm_moe_dsa", "deepseek": "deepseek_v32"}
# GLM thinks unless told not to; DeepSeek-V3.2 only when told to.
NO_THINKING = {"glm": {"enable_thinking": False}, "deepseek": {}}
THINKING = {"glm": {}, "deepseek": {"thinking": True}}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
FLAGS = {
    "type": "function",
    "function": {
        "name": "set_flags",
        "parameters": {
            "type": "object",
            "properties": {
                "on": {"type": "boolean"},
                "level": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["on", "level"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, FLAGS]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=sorted(PRESETS))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def served(family, tmp_path_factory):
    """(client, base_url, model dir) of a server on `family`'s tiny model."""
    path = write_tiny_model(tmp_path_factory.mktemp(family) / family, PRESETS[family], seed=0)
    config = EngineConfig(model=str(path), **{**ENGINE_ARGS, "num_pages": 256})
    with serving(config) as (base, _):
        client = openai.OpenAI(
            base_url=f"{base}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0
        )
        yield client, base, path


def _chat(client, family: str, **kw):
    kw.setdefault("messages", USER)
    kw.setdefault("tools", TOOLS)
    kw.setdefault("max_tokens", 400)
    kw.setdefault("temperature", 0)
    extra = {"chat_template_kwargs": kw.pop("template_kwargs", NO_THINKING[family])}
    extra.update(kw.pop("extra_body", {}))
    return client.chat.completions.create(
        model=client.models.list().data[0].id, extra_body=extra, **kw
    )


def _valid_calls(calls) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, checked against its tool's schema."""
    out = []
    for c in calls:
        assert c.type == "function" and c.id
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        out.append((c.function.name, args))
    return out


def _reassemble(chunks) -> dict:
    """Fold streamed chunks into (reasoning, content, calls, finish_reason)."""
    reasoning, content, calls, finish = "", "", {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert slot["id"] is None, "id sent twice"
                slot["id"] = tc.id
            if tc.function and tc.function.name:
                assert slot["name"] is None, "name sent twice"
                slot["name"] = tc.function.name
            slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = ch.choices[0].finish_reason or finish
    ordered = [calls[i] for i in sorted(calls)]
    return {"reasoning": reasoning, "content": content, "calls": ordered, "finish": finish}


# --- forced calls -----------------------------------------------------------------------------


def test_required_tool_call_is_valid_and_streams_the_same(served, family):
    client = served[0]
    r = _chat(client, family, tool_choice="required", parallel_tool_calls=False)
    choice = r.choices[0]
    calls = _valid_calls(choice.message.tool_calls)
    assert len(calls) == 1 and choice.finish_reason == "tool_calls"
    assert not choice.message.content  # nothing but the call

    chunks = list(
        _chat(client, family, tool_choice="required", parallel_tool_calls=False, stream=True)
    )
    s = _reassemble(chunks)
    assert [(c["name"], json.loads(c["arguments"])) for c in s["calls"]] == calls
    assert [c["arguments"] for c in s["calls"]] == [
        c.function.arguments for c in choice.message.tool_calls
    ]
    assert s["content"] == (choice.message.content or "") and s["finish"] == "tool_calls"
    assert all(c["id"] and c["id"].startswith("call_") for c in s["calls"])


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_cut_by_max_tokens_keeps_its_arguments_so_far(served, family, choice):
    """A forced call cut by max_tokens halfway reported `arguments` "{}" (what the model had
    written of them dropped): now, as OpenAI, the arguments as far as they were written,
    unclosed, with finish_reason "length"; the streamed deltas add up to the same."""
    client = served[0]
    if choice == "named":
        choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = _chat(client, family, tool_choice=choice, parallel_tool_calls=False)
    (call,) = whole.choices[0].message.tool_calls
    half = whole.usage.completion_tokens // 2  # (inside the arguments, both families)
    r = _chat(client, family, tool_choice=choice, parallel_tool_calls=False, max_tokens=half)
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.content
    (cut,) = r.choices[0].message.tool_calls
    args = cut.function.arguments
    assert cut.function.name == call.function.name and cut.id.startswith("call_")
    assert call.function.arguments.startswith(args) and len(args) > len('{"')
    assert args != call.function.arguments and not args.endswith("}")
    kw = dict(tool_choice=choice, parallel_tool_calls=False, max_tokens=half, stream=True)
    s = _reassemble(_chat(client, family, **kw))
    assert s["finish"] == "length" and not s["content"]
    assert [(c["name"], c["arguments"]) for c in s["calls"]] == [(cut.function.name, args)]


_D = "｜DSML｜"
# Two calls in each family's markup (forced with a regex of the literal text below).
TWO_CALLS = {
    "glm": "".join(
        f"<tool_call>get_weather<arg_key>city</arg_key><arg_value>{city}</arg_value>"
        f"<arg_key>days</arg_key><arg_value>{days}</arg_value></tool_call>"
        for city, days in (("Paris", 1), ("Rome", 2))
    ),
    "deepseek": f"<{_D}function_calls>"
    + "".join(
        f'<{_D}invoke name="get_weather"><{_D}parameter name="city" string="true">{city}'
        f'</{_D}parameter><{_D}parameter name="days" string="false">{days}</{_D}parameter>'
        f"</{_D}invoke>"
        for city, days in (("Paris", 1), ("Rome", 2))
    )
    + f"</{_D}function_calls>",
}


def _literal(text: str) -> str:
    """A regex matching exactly `text`."""
    return "".join("\\" + c if c in "\\.^$*+?()[]{}|" else c for c in text)


def test_parallel_tool_calls_false_keeps_the_first_call(served, family):
    """A model calling two tools under tool_choice "auto" with parallel_tool_calls false gets
    the first call only, as vLLM filters them (streamed: only index 0's deltas); true keeps
    both."""
    client = served[0]
    two = TWO_CALLS[family]
    kw = dict(extra_body={"regex": _literal(two)}, max_tokens=len(two.encode()) + 8)
    first = [("get_weather", {"city": "Paris", "days": 1})]
    r = _chat(client, family, **kw)
    assert _valid_calls(r.choices[0].message.tool_calls) == first + [
        ("get_weather", {"city": "Rome", "days": 2})
    ]
    r = _chat(client, family, parallel_tool_calls=False, **kw)
    choice = r.choices[0]
    assert _valid_calls(choice.message.tool_calls) == first
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    chunks = list(_chat(client, family, parallel_tool_calls=False, stream=True, **kw))
    indices = {tc.index for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []}
    s = _reassemble(chunks)
    assert indices == {0} and s["finish"] == "tool_calls" and not s["content"]
    assert [(c["name"], json.loads(c["arguments"])) for c in s["calls"]] == first


def test_a_call_cut_inside_its_trigger_shows_no_markup(served, family):
    """Under "auto", max_tokens cutting the output inside the tool-call trigger left that
    markup (`<tool_c`) as content, streamed or not; a cut call's markup is dropped."""
    client = served[0]
    two = TWO_CALLS[family]
    trigger = two[: two.index(">") + 1]
    n = len(trigger.encode()) - 2  # (a byte-level tokenizer: a token a byte)
    kw = dict(extra_body={"regex": _literal(two)}, max_tokens=n)
    r = _chat(client, family, **kw)
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.content
    s = _reassemble(list(_chat(client, family, stream=True, **kw)))
    assert s["finish"] == "length" and not s["content"] and not s["calls"]


def test_a_call_cut_by_repetition_detection_is_cut_as_by_max_tokens(served, family):
    """vLLM's repetition stop cuts the output short as max_tokens does: a call's trigger
    cut there is no content either (it was shown as text). Both families' triggers hold a
    doubled byte ("too", "calls"): a one-token pattern seen twice ends them inside it."""
    client = served[0]
    twice = {"max_pattern_size": 1, "min_pattern_size": 1, "min_count": 2}
    body = {"regex": _literal(TWO_CALLS[family]), "repetition_detection": twice}
    r = _chat(client, family, extra_body=body)
    assert r.choices[0].finish_reason == "repetition", r
    assert not r.choices[0].message.content and not r.choices[0].message.tool_calls
    s = _reassemble(list(_chat(client, family, stream=True, extra_body=body)))
    assert s["finish"] == "repetition" and not s["content"] and not s["calls"]


def test_named_tool_call_picks_that_tool(served, family):
    """The named call, and OpenAI's and vLLM's finish_reason for it: "stop", not the
    "tool_calls" of "auto" and "required", streamed or not."""
    client = served[0]
    named = {"type": "function", "function": {"name": "set_flags"}}
    r = _chat(client, family, tool_choice=named, temperature=1.0, seed=2)
    calls = _valid_calls(r.choices[0].message.tool_calls)
    assert [name for name, _ in calls] == ["set_flags"]
    assert r.choices[0].finish_reason == "stop"
    chunks = list(_chat(client, family, tool_choice=named, temperature=1.0, seed=2, stream=True))
    s = _reassemble(chunks)
    assert [(c["name"], json.loads(c["arguments"])) for c in s["calls"]] == calls
    assert s["finish"] == "stop"


def test_tool_choice_none_and_auto_leave_plain_text_alone(served, family):
    client = served[0]
    r = _chat(client, family, tool_choice="none", max_tokens=12, extra_body={"ignore_eos": True})
    msg = r.choices[0].message
    assert msg.tool_calls is None and r.choices[0].finish_reason == "length"
    assert len(msg.content) > 0
    r = _chat(client, family, max_tokens=12, extra_body={"ignore_eos": True})  # auto
    assert r.choices[0].message.tool_calls is None
    # `tools: []` with "auto" means no tools (vLLM takes it; a 400 before)
    base = served[1]
    body = {"messages": USER, "max_tokens": 4, "tools": [], "tool_choice": "auto"}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"].get("tool_calls") is None


def test_tool_history_is_rendered(served, family):
    client, _, path = served
    history = USER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = _chat(client, family, messages=history, max_tokens=2, tool_choice="none")
    tok = AutoTokenizer.from_pretrained(path)
    rendered = render_chat(
        tok,
        [
            *USER,
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}
                ],
            },
            {"role": "tool", "content": "sunny, 21 C"},
        ],
        MODEL_TYPES[family],
        tools=TOOLS,
        **NO_THINKING[family],
    )
    assert "sunny, 21 C" in rendered and "Oslo" in rendered
    assert r.usage.prompt_tokens == len(tok(rendered, add_special_tokens=False)["input_ids"])


# --- reasoning --------------------------------------------------------------------------------


CLOSER = 263  # the tiny tokenizer's `<|reserved_1|>`, made the text "abc</think>" by `closing`


@pytest.fixture(scope="module")
def closing(family, tmp_path_factory):
    """A client of a server on `family`'s tiny model with one token that is the text
    "abc</think>": a logit_bias on it makes even the random model reason, then close the
    block (no grammar can force that on the chat route: every one starts after the
    reasoning)."""
    path = write_tiny_model(tmp_path_factory.mktemp(family) / family, PRESETS[family], seed=0)
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    (token,) = [t for t in tokenizer["added_tokens"] if t["id"] == CLOSER]
    token.update(content="abc</think>", special=False)
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = EngineConfig(model=str(path), **{**ENGINE_ARGS, "num_pages": 256})
    with serving(config) as (base, _):
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_is_split(closing, family, stream):
    """The model reasons "abc", closes the block, then answers under a structural tag (which
    starts after the reasoning, as SGLang's ReasonerGrammarBackend and vLLM's reasoning
    parsers start it); the split must follow the prompt, which opened the reasoning block
    (GLM-5 and DeepSeek-V3.2 with thinking: the prompt ends with `<think>`)."""
    tag = {"type": "regex", "pattern": "[a-z]{2,4}"}
    tag = json.dumps({"type": "structural_tag", "format": tag})
    kw = dict(
        tools=None,
        template_kwargs=THINKING[family],
        logit_bias={str(CLOSER): 100},
        extra_body={"structured_outputs": {"structural_tag": tag}},
        stream=stream,
    )
    r = _chat(closing, family, **kw)
    if stream:
        s = _reassemble(list(r))
        reasoning, content = s["reasoning"], s["content"]
    else:
        reasoning = r.choices[0].message.reasoning_content
        content = r.choices[0].message.content
    assert reasoning == "abc", (reasoning, content)
    assert content.isalpha() and 2 <= len(content) <= 4, (reasoning, content)
    # vLLM's include_reasoning: false leaves the reasoning out, the answer as it was
    kw["extra_body"] = {**kw["extra_body"], "include_reasoning": False}
    r = _chat(closing, family, **kw)
    if stream:
        s = _reassemble(list(r))
        assert (s["reasoning"], s["content"]) == ("", content)
    else:
        assert r.choices[0].message.content == content
        assert getattr(r.choices[0].message, "reasoning_content", None) is None
    # Without thinking the same text is all content (the prompt closes the block).
    if not stream:
        r = _chat(closing, family, tools=None, extra_body={"regex": "[a-z]{3,6}"})
        assert r.choices[0].message.content.isalpha()
        assert getattr(r.choices[0].message, "reasoning_content", None) is None


@pytest.mark.parametrize("stream", [False, True])
def test_sglangs_separate_and_stream_reasoning(closing, family, stream):
    """SGLang's separate_reasoning: false leaves the reasoning, its closing tag too, in the
    content; stream_reasoning: false streams it in one piece once it is over."""
    tag = json.dumps({"type": "structural_tag", "format": {"type": "regex", "pattern": "[a-z]{3}"}})
    kw = dict(
        tools=None,
        template_kwargs=THINKING[family],
        logit_bias={str(CLOSER): 100},
        stream=stream,
    )
    extra = {"structured_outputs": {"structural_tag": tag}, "separate_reasoning": False}
    r = _chat(closing, family, extra_body=extra, **kw)
    if stream:
        s = _reassemble(list(r))
        reasoning, content = s["reasoning"], s["content"]
    else:
        reasoning = getattr(r.choices[0].message, "reasoning_content", None)
        content = r.choices[0].message.content
    assert not reasoning and content.startswith("abc</think>"), (reasoning, content)
    assert len(content) == len("abc</think>") + 3 and content[-3:].isalpha(), content
    if stream:
        extra = {"structured_outputs": {"structural_tag": tag}, "stream_reasoning": False}
        chunks = list(_chat(closing, family, extra_body=extra, **kw))
        parts = [
            x.choices[0].delta.reasoning_content
            for x in chunks
            if x.choices and getattr(x.choices[0].delta, "reasoning_content", None)
        ]
        assert parts == ["abc"], parts
        assert _reassemble(chunks)["content"] == content[-3:]


def test_reasoning_effort_none_turns_thinking_off(closing, family):
    """vLLM's reasoning_effort "none": thinking off (the prompt closes the block, so no
    reasoning), unless chat_template_kwargs say otherwise."""
    kw = dict(tools=None, logit_bias={str(CLOSER): 100}, max_tokens=3)
    on = _chat(closing, family, template_kwargs=THINKING[family], **kw).choices[0].message
    assert on.reasoning_content == "abc"
    extra = {"reasoning_effort": "none"}
    off = _chat(closing, family, template_kwargs={}, extra_body=extra, **kw).choices[0].message
    assert getattr(off, "reasoning_content", None) is None, off
    kept = _chat(closing, family, template_kwargs=THINKING[family] or {"enable_thinking": True},
                 extra_body=extra, **kw).choices[0].message  # fmt: skip
    assert kept.reasoning_content == "abc"


def test_forced_call_after_reasoning_closes_it_once(closing, family):
    """A forcing tool_choice's structural tag holds the reasoning itself: the chat route
    must not put a second reasoning block before it (one `</think>`, then the call, no
    "abc</think>" left in the content)."""
    r = _chat(
        closing,
        family,
        tool_choice="required",
        parallel_tool_calls=False,
        template_kwargs=THINKING[family],
        logit_bias={str(CLOSER): 100},
    )
    m = r.choices[0].message
    assert m.reasoning_content == "abc" and not m.content, (m.reasoning_content, m.content)
    assert [name for name, _ in _valid_calls(m.tool_calls)] in (["get_weather"], ["set_flags"])


# --- bad input --------------------------------------------------------------------------------

_NO_NAME = {"type": "function", "function": {"parameters": {"type": "object"}}}
_NOT_OBJECT = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
_LIST_PARAMS = {"type": "function", "function": {"name": "f", "parameters": [1, 2]}}
_UNIQUE = {
    "type": "function",
    "function": {
        "name": "tags",
        "parameters": {
            "type": "object",
            "properties": {"t": {"type": "array", "uniqueItems": True}},
        },
    },
}
_BAD_TOOLS = [
    ({"tools": [_NO_NAME]}, "tools"),
    ({"tools": [_UNIQUE], "tool_choice": "required"}, "tools"),  # would not be enforced
    ({"tools": [_NOT_OBJECT]}, "tools"),
    ({"tools": [_LIST_PARAMS]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "retrieval", "function": WEATHER["function"]}]}, "tools"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    (
        {
            "messages": USER
            + [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": "not json"},
                        }
                    ],
                }
            ]
        },
        "messages",
    ),
]


def test_bad_tools_get_openai_400_and_server_keeps_serving(served, family):
    client, base, _ = served
    for extra, param in _BAD_TOOLS:
        body = {"messages": USER, "max_tokens": 4, **extra}
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "invalid_request_error" and err["param"] == param, (extra, err)
    r = _chat(client, family, tool_choice={"type": "function", "function": {"name": "set_flags"}})
    assert _valid_calls(r.choices[0].message.tool_calls)


def test_unknown_parser_names_are_one_line_cli_errors(capsys):
    for flag in ("--tool-call-parser", "--reasoning-parser"):
        with pytest.raises(SystemExit) as e:
            cli_main(["serve", "glm-tiny", flag, "bogus"])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and "bogus" in err[0]
