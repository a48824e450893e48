"""Tool-call and reasoning parsers on text: every format variant, typed arguments, malformed
and cut-off markup, streaming under arbitrary chunk splits; the forcing grammars (xgrammar
structural tags) driven by random logits; the tiny models' chat templates."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsakv.config.presets import EOS_ID, VOCAB_SIZE
from dsakv.engine.chat_format import render_chat
from dsakv.errors import DsakvError
from dsakv.models.tiny import write_tokenizer
from dsakv.server.chat import ChatParsers, PreparedChat
from dsakv.server.parsers import (
    TOOL_FORMATS,
    ChatOutputParser,
    ReasoningParser,
    ToolCallParser,
    reasoning_parser,
    resolve_parsers,
    tool_call_structural_tag,
)

D = "｜DSML｜"
SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "zip": {"type": "string"},
            "opts": {"type": "object"},
            "tags": {"type": "array"},
            "metric": {"type": "boolean"},
        },
    },
    "ping": {"type": "object", "properties": {}},
}


def _parse(
    parser: str, text: str, forced: bool = False, cut: bool = False
) -> tuple[str, list[tuple[str, dict]]]:
    p = ToolCallParser(TOOL_FORMATS[parser], SCHEMAS, forced)
    p.feed(text, final=True, cut=cut)
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in p.calls]
    return p.content, calls


GLM47 = (
    "Let me check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
    "<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>zip</arg_key>"
    '<arg_value>75001</arg_value><arg_key>opts</arg_key><arg_value>{"u": [1, null]}'
    "</arg_value><arg_key>metric</arg_key><arg_value>true</arg_value></tool_call>"
)
GLM45 = (
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>\n"
    "<tool_call>ping\n</tool_call>"
)
DSML = (
    f'Checking.\n\n<{D}function_calls>\n<{D}invoke name="get_weather">\n'
    f'<{D}parameter name="city" string="true"> Paris </{D}parameter>\n'
    f'<{D}parameter name="days" string="false">3</{D}parameter>\n'
    f'<{D}parameter name="tags" string="false">["a", "b"]</{D}parameter>\n'
    f'</{D}invoke>\n<{D}invoke name="ping">\n</{D}invoke>\n</{D}function_calls>'
)
DSML_JSON = (
    f'<{D}function_calls>\n<{D}invoke name="get_weather">\n'
    f'{{"city": "Rome", "days": 1}}\n</{D}invoke>\n</{D}function_calls> done'
)
# DeepSeek-V3.1's markup (DeepSeek-V3.2-Exp's chat template's): JSON arguments per call
CALLS, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
V31_ARGS = (
    '{"city": "東京 \\u00e9", "days": 3, "opts": {"u": [1, null, {"k": "\\"v\\""}]}, '
    '"zip": "75001", "metric": false}'
)
V31 = (
    f"Let me look.\n\n{CALLS}{CALL}get_weather{SEP}{V31_ARGS}{CALL_END}"
    f"{CALL}ping{SEP}{{}}{CALL_END}{CALLS_END}"
)
V31_ONE = f'{CALLS}{CALL}get_weather{SEP}{{"city":"Paris","days":2}}{CALL_END}{CALLS_END}'


def test_glm47_typed_arguments():
    content, calls = _parse("glm47", GLM47)
    assert content == "Let me check."
    assert calls == [
        (
            "get_weather",
            {"city": "Paris", "days": 3, "zip": "75001", "opts": {"u": [1, None]}, "metric": True},
        )
    ]


def test_glm45_newline_variant_and_multiple_calls():
    content, calls = _parse("glm45", GLM45)
    assert calls == [("get_weather", {"city": "New York", "days": 2}), ("ping", {})]
    assert content == ""  # whitespace leading into a call is layout, not content
    assert _parse("glm47", GLM45) == (content, calls)  # one parser reads both


def test_glm_unknown_tool_and_unparsable_values():
    _, calls = _parse(
        "glm47",
        "<tool_call>other<arg_key>n</arg_key><arg_value>4.5</arg_value>"
        "<arg_key>s</arg_key><arg_value>not json</arg_value></tool_call>",
    )
    assert calls == [("other", {"n": 4.5, "s": "not json"})]


def test_dsml_parameters_and_json_body():
    content, calls = _parse("deepseekv32", DSML)
    assert content == "Checking."
    assert calls == [
        ("get_weather", {"city": " Paris ", "days": 3, "tags": ["a", "b"]}),
        ("ping", {}),
    ]
    content, calls = _parse("deepseekv32", DSML_JSON)
    assert calls == [("get_weather", {"city": "Rome", "days": 1})] and content == " done"


def test_deepseekv31_json_arguments():
    """DeepSeek-V3.1's calls: the text before them is content, each call's JSON object is
    its arguments (nested values, escapes and unicode read as JSON), written out as JSON."""
    content, calls = _parse("deepseekv31", V31)
    assert content == "Let me look."
    assert calls == [("get_weather", json.loads(V31_ARGS)), ("ping", {})]
    assert calls[0][1]["city"] == "東京 é" and calls[0][1]["opts"]["u"][2] == {"k": '"v"'}
    p = ToolCallParser(TOOL_FORMATS["deepseekv31"], SCHEMAS)
    p.feed(V31_ONE + " done", final=True)
    assert p.content == " done"
    assert [c["function"] for c in p.calls] == [
        {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}
    ]
    # a string parameter written as a JSON number is read as written (JSON, not text)
    assert _parse("deepseekv31", f'{CALLS}{CALL}ping{SEP}{{"zip": 75001}}{CALL_END}')[1] == [
        ("ping", {"zip": 75001})
    ]


def test_deepseekv31_python_literals_do_not_end_the_call():
    """`True`, `False` and `None` in DeepSeek-V3.1 arguments (outside strings) are values, as
    vLLM passes them on, written as JSON's: streamed or not, the members after them stay."""
    args = '{"metric": True, "opts": {"u": [False, null, None]}, "city": "None True", "days": 2}'
    text = f"{CALLS}{CALL}get_weather{SEP}{args}{CALL_END}{CALLS_END}"
    want = {"metric": True, "opts": {"u": [False, None, None]}, "city": "None True", "days": 2}
    assert _parse("deepseekv31", text) == ("", [("get_weather", want)])
    _, _, _, calls = _stream(_chat_parser("deepseekv31", "x</think>"), text, list(range(len(text))))
    assert [json.loads(c["arguments"]) for c in calls] == [want]


def test_glm_string_arguments_keep_their_whitespace():
    """A string is taken as written (code keeps its indent and last newline), as vLLM and
    SGLang read it; a typed value's layout is not data. Under a forcing grammar, whose GLM
    markup allows layout whitespace around any value, the value is read as it reads it."""
    text = (
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>    return x\n</arg_value>"
        "<arg_key>days</arg_key><arg_value> 3\n</arg_value></tool_call>"
    )
    assert _parse("glm47", text)[1] == [("get_weather", {"city": "    return x\n", "days": 3})]
    assert _parse("glm47", text, forced=True)[1] == [
        ("get_weather", {"city": "return x", "days": 3})
    ]


def test_python_literal_values_and_dsml_strings_follow_the_schema():
    """vLLM's parity: GLM values that are Python literals (`True`, `None`, a dict written
    with quotes) parse for a typed parameter; DSML's string="false" on a string parameter
    stays text."""
    _, calls = _parse(
        "glm47",
        "<tool_call>get_weather<arg_key>metric</arg_key><arg_value>True</arg_value>"
        "<arg_key>opts</arg_key><arg_value>{'k': None}</arg_value>"
        "<arg_key>tags</arg_key><arg_value>{1, 2}</arg_value>"
        "<arg_key>city</arg_key><arg_value>None</arg_value></tool_call>",
    )
    assert calls == [
        ("get_weather", {"metric": True, "opts": {"k": None}, "tags": "{1, 2}", "city": "None"})
    ]
    _, calls = _parse(
        "deepseekv32",
        f'<{D}function_calls>\n<{D}invoke name="get_weather">\n'
        f'<{D}parameter name="zip" string="false">75001</{D}parameter>\n'
        f'<{D}parameter name="days" string="false">2</{D}parameter>\n'
        f"</{D}invoke>\n</{D}function_calls>",
    )
    assert calls == [("get_weather", {"zip": "75001", "days": 2})]


UNCLOSED = [
    (
        "glm47",
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</tool_call>"
        "<tool_call>ping</tool_call>Done.",
    ),
    (
        "deepseekv32",
        f'<{D}function_calls>\n<{D}invoke name="get_weather">\n'
        f'<{D}parameter name="city" string="true">Oslo</{D}invoke>\n'
        f'<{D}invoke name="ping">\n</{D}invoke>\n</{D}function_calls>Done.',
    ),
    (
        "deepseekv31",
        f'{CALLS}{CALL}get_weather{SEP}{{"city": "Oslo"}}{CALL}ping{SEP}{{}}{CALL_END}'
        f"{CALLS_END}Done.",
    ),
]


@pytest.mark.parametrize(("parser", "text"), UNCLOSED)
def test_a_value_without_its_close_tag_ends_at_the_call(parser, text):
    """A missing </arg_value> (or DSML </parameter>) ends the value at its call's close tag,
    as vLLM reads it (a DeepSeek-V3.1 call missing its end tag ends at the next call): later
    calls and text are not swallowed into it."""
    assert _parse(parser, text) == ("Done.", [("get_weather", {"city": "Oslo"}), ("ping", {})])


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        ("glm47", "plain <b>text</b> only", "plain <b>text</b> only", []),
        # a trigger prefix at the end of a response that stopped by itself is text
        ("glm47", "a <tool_ca", "a <tool_ca", []),
        ("glm47", "x<tool_call>", "x<tool_call>", []),
        ("glm47", "x<tool_call>bad name<x>", "x<tool_call>bad name<x>", []),
        # a missing <arg_value> ends the call there
        (
            "glm47",
            "<tool_call>ping<arg_key>a</arg_key>oops</tool_call>after",
            "<arg_key>a</arg_key>oops</tool_call>after",
            [("ping", {})],
        ),
        ("deepseekv32", f"<{D}function_calls>hello", f"<{D}function_calls>hello", []),
        ("deepseekv32", f"<{D}function_ca", f"<{D}function_ca", []),
        ("deepseekv31", f"{CALLS}hello", f"{CALLS}hello", []),
        ("deepseekv31", "a <｜tool▁calls▁be", "a <｜tool▁calls▁be", []),
        # arguments that are not a JSON object end the call at its end tag: not content
        (
            "deepseekv31",
            f"{CALLS}{CALL}ping{SEP}not json{CALL_END}{CALLS_END}after",
            "after",
            [("ping", {})],
        ),
        (
            "deepseekv31",
            f'{CALLS}{CALL}ping{SEP}{{"a": 1, "b": undefined}}{CALL_END}{CALLS_END}',
            "",
            [("ping", {"a": 1})],
        ),
    ],
)
def test_malformed_text_never_raises_and_stays_content(parser, text, content, calls):
    assert _parse(parser, text) == (content, calls)


@pytest.mark.parametrize("how", ["cut", "forced"])
@pytest.mark.parametrize(
    ("parser", "text", "content"),
    [
        ("glm47", "a <tool_ca", "a"),
        ("glm47", "a\n<", "a"),
        ("glm47", "x<tool_call>", "x"),
        ("deepseekv32", f"ok\n\n<{D}function_ca", "ok"),
        ("deepseekv32", f"ok\n\n<{D}function_calls>\n", "ok"),
        ("deepseekv31", "ok\n\n<｜tool▁calls▁beg", "ok"),
        ("deepseekv31", f"ok\n\n{CALLS}\n", "ok"),
        ("glm47", "a < b", "a < b"),  # not at the end: text
    ],
)
def test_a_trigger_cut_off_or_under_a_forcing_grammar_is_dropped(parser, text, content, how):
    """When max_tokens cut the response, or a grammar forced calls, a trigger (or its start)
    at the end is a call cut off: its markup is not content. (A response that stopped
    there by itself keeps it, above.)"""
    assert _parse(parser, text, **{how: True}) == (content, [])


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        (
            "glm47",
            "<tool_call>ping<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>b",
            "",
            [("ping", {"a": 1})],
        ),
        (
            "glm47",
            "Sure.<tool_call>ping<arg_key>a</arg_key><arg_value>Par",
            "Sure.",
            [("ping", {})],
        ),
        (
            "deepseekv32",
            f'<{D}function_calls><{D}invoke name="ping">{{broken</{D}invoke>',
            "",
            [("ping", {})],
        ),
        # cut before the call opened (after its name, before any argument): no call yet
        ("glm47", "Sure.<tool_call>get_weather\n<", "Sure.", []),
        ("glm47", "<tool_call>get_wea", "", []),
        ("deepseekv32", f'<{D}function_calls><{D}invoke name="pi', "", []),
        (
            "deepseekv31",
            f'Sure.\n{CALLS}{CALL}ping{SEP}{{"a": 1, "b": {{"c": [2',
            "Sure.",
            [("ping", {"a": 1})],
        ),
        ("deepseekv31", f"{CALLS}{CALL}ping{SEP}{{", "", [("ping", {})]),
        ("deepseekv31", f"Sure.{CALLS}{CALL}get_wea", "Sure.", []),
    ],
)
def test_a_call_cut_off_keeps_its_complete_arguments_and_drops_its_markup(
    parser, text, content, calls
):
    """A response that ends inside an open call without max_tokens cutting it (a stop
    string, say) reports the call with the arguments completed, closed; the partial markup
    is not content (a client would show it to the user). Cut by max_tokens: below."""
    assert _parse(parser, text) == (content, calls)


def _cut(parser: str, text: str, forced: bool = False) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments text) of each call, the text cut by max_tokens."""
    p = ToolCallParser(TOOL_FORMATS[parser], SCHEMAS, forced)
    p.feed(text, final=True, cut=True)
    return p.content, [(c["function"]["name"], c["function"]["arguments"]) for c in p.calls]


_GLM_ARG = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
_DSML_CALL = f'<{D}function_calls>\n<{D}invoke name="get_weather">\n'
_DSML_ARG = _DSML_CALL + f'<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
_V31_CALL = f"{CALLS}{CALL}get_weather{SEP}"


@pytest.mark.parametrize("forced", [False, True])
@pytest.mark.parametrize(
    ("parser", "text", "arguments"),
    [
        ("glm47", "<tool_call>get_weather<arg_key>", '{"'),
        ("glm47", "<tool_call>get_weather<arg_key>ci", '{"ci'),
        ("glm47", "<tool_call>get_weather<arg_key>city</arg_", '{"city'),
        ("glm47", "<tool_call>get_weather<arg_key>city</arg_key><arg_val", '{"city"'),
        ("glm47", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>", '{"city": "'),
        ("glm47", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Pa", '{"city": "Pa'),
        ("glm47", _GLM_ARG + "</tool_ca", '{"city": "Paris"'),
        ("glm47", _GLM_ARG + "<arg_key>days</arg_key><arg_value>1", '{"city": "Paris", "days": 1'),
        ("glm47", _GLM_ARG + "<arg_key>opts</arg_key><arg_value>{\"u\": [1", '{"city": "Paris", "opts": {"u": [1'),
        ("glm47", _GLM_ARG + "<arg_key>metric</arg_key><arg_value>tr", '{"city": "Paris", "metric": tr'),
        ("glm47", _GLM_ARG + "<arg_key>zip</arg_key><arg_value>7500</arg_va", '{"city": "Paris", "zip": "7500'),
        ("glm47", _GLM_ARG + "</tool_call>", '{"city": "Paris"}'),  # cut just after it
        ("glm47", "<tool_call>ping<arg_key>note</arg_key><arg_value>a \"b", '{"note": "a \\"b'),
        ("deepseekv32", _DSML_CALL, ""),
        ("deepseekv32", _DSML_CALL + f'<{D}parameter name="ci', '{"ci'),
        ("deepseekv32", _DSML_CALL + f'<{D}parameter name="city" str', '{"city"'),
        ("deepseekv32", _DSML_CALL + f'<{D}parameter name="city" string="true">Pa', '{"city": "Pa'),
        ("deepseekv32", _DSML_ARG + f'<{D}parameter name="days" string="false">1', '{"city": "Paris", "days": 1'),
        ("deepseekv32", _DSML_ARG + f"</{D}inv", '{"city": "Paris"'),
        ("deepseekv32", _DSML_CALL + '{"city": "Ro', '{"city": "Ro'),
        ("deepseekv32", _DSML_CALL + f'{{"city":"Rome"}}\n</{D}inv', '{"city": "Rome"}'),
        ("glm47", "<tool_call>ping<arg_key>opts</arg_key><arg_value>\"a\\u00e9\\", '{"opts": "a\u00e9'),
        ("deepseekv31", _V31_CALL, ""),
        ("deepseekv31", _V31_CALL + "{", ""),
        ("deepseekv31", _V31_CALL + '{"ci', '{"ci'),
        ("deepseekv31", _V31_CALL + '{"ci\\u00e', '{"ci'),
        ("deepseekv31", _V31_CALL + '{ "city" ', '{"city"'),
        ("deepseekv31", _V31_CALL + '{"city":', '{"city": '),
        ("deepseekv31", _V31_CALL + '{"city": "Pa', '{"city": "Pa'),
        ("deepseekv31", _V31_CALL + '{"city": "\\u6771\\u4eac \\"P\\u00', '{"city": "東京 \\"P'),
        ("deepseekv31", _V31_CALL + '{"city": "\\ud83d\\ude', '{"city": "'),  # (half an emoji)
        ("deepseekv31", _V31_CALL + '{"city":"Paris","days":1', '{"city": "Paris", "days": 1'),
        ("deepseekv31", _V31_CALL + '{"city": "Paris", "opts": {"u": [1', '{"city": "Paris", "opts": {"u": [1'),
        ("deepseekv31", _V31_CALL + '{"city": "Paris", "metric": tr', '{"city": "Paris", "metric": tr'),
        ("deepseekv31", _V31_CALL + '{"city": "Paris"}<｜tool▁call▁e', '{"city": "Paris"}'),
        ("deepseekv31", _V31_CALL + "{ }", "{}"),
        ("deepseekv31", _V31_CALL + '{"city": "Paris"}' + CALL_END, '{"city": "Paris"}'),
    ],
)  # fmt: skip
def test_a_call_cut_by_max_tokens_keeps_the_arguments_written(parser, text, arguments, forced):
    """max_tokens cutting a call reported it with the arguments completed before the cut,
    "{}" when the first was being written: now, as OpenAI, the arguments as far as the
    model wrote them (unclosed JSON), the argument being written included."""
    name = "ping" if "ping" in text else "get_weather"
    assert _cut(parser, text, forced) == ("", [(name, arguments)])


def _stream(make, text: str, cuts: list[int], cut: bool = False):
    """Feed `text` in pieces split at `cuts`; reassemble content and tool-call deltas."""
    p = make()
    bounds = [0, *sorted(set(cuts)), len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    reasoning, content, calls = "", "", {}
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        d = p.feed(piece, final=last, cut=cut and last)
        reasoning += d.reasoning
        content += d.content
        assert len({c["index"] for c in d.tool_calls}) == len(d.tool_calls)
        for c in d.tool_calls:
            slot = calls.setdefault(c["index"], {"name": None, "id": None, "arguments": ""})
            fn = c["function"]
            if "name" in fn:
                assert slot["name"] is None
                slot.update(name=fn["name"], id=c["id"])
            slot["arguments"] += fn["arguments"]
    return p, reasoning, content, [calls[i] for i in sorted(calls)]


def _chat_parser(parser: str, prompt: str):
    def make():
        rp = reasoning_parser("glm45" if parser.startswith("glm") else "deepseek-v3", prompt)
        return ChatOutputParser(rp, ToolCallParser(TOOL_FORMATS[parser], SCHEMAS))

    return make


_STREAM_CASES = [
    ("glm47", "<|assistant|>", GLM47),
    ("glm47", "<|assistant|>", "<think>hmm <tool_ a</think>" + GLM45),
    ("glm47", "<|assistant|>", " <think>plan<tool_call>ping</tool_call>tail"),
    ("glm47", "<|assistant|>", "x<tool_call>ping<arg_key>a</arg_key>oops</tool_call>y<tool_c"),
    ("deepseekv32", "<|assistant|><think>", "why</thi</think>" + DSML),
    ("deepseekv32", "<|assistant|></think>", DSML_JSON + f"<{D}function_calls>\n<{D}inv"),
    ("glm47", "<|assistant|></think>", UNCLOSED[0][1] + "\n<tool_ca"),
    ("deepseekv32", "<|assistant|></think>", UNCLOSED[1][1] + f"\n\n<{D}func"),
    ("glm47", "<|assistant|></think>", GLM47[:-70]),  # (cut: inside a value)
    ("deepseekv32", "<|assistant|></think>", DSML[:-120]),
    ("deepseekv32", "<|assistant|></think>", DSML_JSON[:-40]),
    ("deepseekv31", "<|assistant|><think>", "why</thi</think>" + V31),
    ("deepseekv31", "<|assistant|></think>", V31_ONE + f"\n\n{CALLS}{CALL}pi"),
    ("deepseekv31", "<|assistant|></think>", UNCLOSED[2][1] + "\n<｜tool▁ca"),
    ("deepseekv31", "<|assistant|></think>", V31[: V31.index('"zip"') + 9]),  # (cut: a value)
]


@settings(max_examples=80, deadline=None)
@given(case=st.sampled_from(_STREAM_CASES), cut=st.booleans(), data=st.data())
def test_streaming_any_split_reassembles_to_the_whole(case, cut, data):
    parser, prompt, text = case
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    whole, r1, c1, calls1 = _stream(_chat_parser(parser, prompt), text, [], cut)
    p, r2, c2, calls2 = _stream(_chat_parser(parser, prompt), text, cuts, cut)
    assert (r2, c2) == (r1, c1) == (whole.reasoning or "", whole.content)
    assert [(c["name"], c["arguments"]) for c in calls2] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls
    ]
    assert [c["id"] for c in calls2] == [c["id"] for c in p.tool_calls]
    for c in calls2[:-1] if cut else calls2:
        json.loads(c["arguments"])  # complete JSON (a call cut by max_tokens is not)


def test_streaming_holds_back_partial_tags():
    p = ChatOutputParser(
        ReasoningParser(True, ("<tool_call>",)), ToolCallParser(TOOL_FORMATS["glm47"], SCHEMAS)
    )
    d = p.feed("think </th")
    assert (d.reasoning, d.content) == ("think ", "")
    d = p.feed("ink>Hi <tool")
    assert (d.reasoning, d.content, d.tool_calls) == ("", "Hi", [])
    d = p.feed("_call>ping<arg_key>")
    assert d.content == "" and d.tool_calls[0]["function"] == {"name": "ping", "arguments": ""}
    assert d.tool_calls[0]["type"] == "function" and d.tool_calls[0]["id"].startswith("call_")
    d = p.feed("a</arg_key><arg_value>1</arg_value>")
    assert d.tool_calls == [{"index": 0, "function": {"arguments": '{"a": 1'}}]
    d = p.feed("</tool_call>", final=True)
    assert d.tool_calls == [{"index": 0, "function": {"arguments": "}"}}]
    assert p.reasoning == "think " and p.content == "Hi"


@pytest.mark.parametrize(
    ("name", "prompt", "text", "reasoning", "content"),
    [
        ("glm45", "<|assistant|>", "<think>a</think>b", "a", "b"),
        ("glm45", "<|assistant|>", "\n<think>a</think>\nb", "a", "\nb"),
        ("glm45", "<|assistant|>", "no thinking", None, "no thinking"),
        ("glm45", "<|assistant|><think>", "a<tool_call>x", "a", "<tool_call>x"),
        ("glm45", "<|assistant|><think>", "cut off", "cut off", ""),
        ("deepseek-v3", "<|assistant|><think>", "a<tool_call>x</think>b", "a<tool_call>x", "b"),
        ("deepseek-v3", "<|assistant|></think>", "just </think> text", None, "just </think> text"),
    ],
)
def test_reasoning_split(name, prompt, text, reasoning, content):
    p = ChatOutputParser(reasoning_parser(name, prompt))
    p.feed(text, final=True)
    assert (p.reasoning, p.content) == (reasoning, content)


def test_a_forcing_grammar_makes_the_chat_parser_forced():
    """The server's parser for a forced tool_choice drops a trigger cut off at the end (it
    can only be a call cut off); under "auto" a response may end in one as text."""
    for grammar, content in ((("structural_tag", "{}"), "Hi"), (None, "Hi <tool_c")):
        prep = PreparedChat(
            "<|assistant|></think>", grammar, SCHEMAS, ChatParsers("glm47", "glm45")
        )
        p = prep.output_parser()
        p.feed("Hi <tool_c", final=True)
        assert p.content == content


def test_parser_names():
    assert resolve_parsers("glm_moe_dsa", "auto", None) == ("glm47", "glm45")
    assert resolve_parsers("deepseek_v32", None, "auto") == ("deepseekv32", "deepseek-v3")
    assert resolve_parsers("deepseek_v32", "none", "glm45") == (None, "glm45")
    assert resolve_parsers("llama", "auto", "auto") == (None, None)
    assert resolve_parsers("deepseek_v32", "deepseekv31", None)[0] == "deepseekv31"
    # vLLM's names (its DeepSeek-V3.2 launch command's), each for its own kind of parser
    assert resolve_parsers("glm_moe_dsa", "deepseek_v32", "deepseek_v3") == (
        "deepseekv32",
        "deepseek-v3",
    )
    assert resolve_parsers("glm_moe_dsa", "deepseek_v31", None)[0] == "deepseekv31"
    for bad in (("x", None), (None, "y"), ("deepseek_v3", None), (None, "deepseek_v32")):
        with pytest.raises(DsakvError, match="unknown"):
            resolve_parsers("glm_moe_dsa", *bad)


# --- forcing grammars --------------------------------------------------------------------------

_GRAMMAR_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "enum": ["Paris", "Rome"]},
                    "nights": {"type": "integer", "minimum": 1, "maximum": 9},
                    "pets": {"type": "boolean"},
                    "note": {"type": "string", "maxLength": 6},
                },
                "required": ["city", "nights"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "ping",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


_GRAMMAR_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in _GRAMMAR_TOOLS}
_GRAMMAR_PROMPT = "<|assistant|></think>"


def _forced_outputs(tokenizer, parser: str, choice: str) -> list[str]:
    """The texts four seeds' random logits spell under the structural tag forcing `choice`
    ("required" or "named": book), one call each."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB_SIZE)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    tool_choice = (
        choice if choice == "required" else {"type": "function", "function": {"name": "book"}}
    )
    spec = tool_call_structural_tag(
        parser, _GRAMMAR_TOOLS, tool_choice, _GRAMMAR_PROMPT, True, False
    )
    compiled = compiler.compile_structural_tag(spec)
    mask = xgr.allocate_token_bitmask(1, VOCAB_SIZE)
    texts = []
    for seed in range(4):
        matcher = xgr.GrammarMatcher(compiled)
        g = torch.Generator().manual_seed(seed)
        ids: list[int] = []
        while not matcher.is_terminated():
            assert len(ids) < 2000, "grammar did not finish"
            logits = torch.randn(1, VOCAB_SIZE, generator=g)
            matcher.fill_next_token_bitmask(mask)
            xgr.apply_token_bitmask_inplace(logits, mask)
            t = int(torch.argmax(logits))
            assert matcher.accept_token(t)
            ids.append(t)
        assert ids[-1] == EOS_ID
        texts.append(tokenizer.decode(ids, skip_special_tokens=True))
    return texts


def _forced_parser(parser: str) -> ChatOutputParser:
    return ChatOutputParser(
        reasoning_parser("glm45" if parser == "glm47" else "deepseek-v3", _GRAMMAR_PROMPT),
        ToolCallParser(TOOL_FORMATS[parser], _GRAMMAR_SCHEMAS, forced=True),
    )


@pytest.mark.parametrize("parser", ["glm47", "deepseekv32", "deepseekv31"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forcing_grammar_yields_schema_valid_calls(tokenizer, parser, choice):
    """Random logits under the structural tag's mask always spell a call our parser reads,
    with arguments valid for the schema."""
    for text in _forced_outputs(tokenizer, parser, choice):
        p = _forced_parser(parser)
        p.feed(text, final=True)
        assert len(p.tool_calls) == 1 and p.content == "" and p.reasoning is None
        fn = p.tool_calls[0]["function"]
        assert choice == "required" or fn["name"] == "book"
        jsonschema.validate(json.loads(fn["arguments"]), _GRAMMAR_SCHEMAS[fn["name"]])


@pytest.mark.parametrize("parser", ["glm47", "deepseekv32", "deepseekv31"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_cut_anywhere_keeps_what_was_written(tokenizer, parser, choice):
    """A forced call cut by max_tokens at any point: its arguments so far are where the
    whole call's are then (a prefix of them: no longer "{}" whatever was written), no
    markup is content (a cut in the lead-in before the trigger may leave its whitespace),
    and streamed deltas add up to the same."""
    for text in _forced_outputs(tokenizer, parser, choice):
        whole = _forced_parser(parser)
        whole.feed(text, final=True)
        (call,) = whole.tool_calls
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        longest = 0
        for n in range(len(text) + 1):
            cut = _forced_parser(parser)
            cut.feed(text[:n], final=True, cut=True)
            assert not cut.content.strip() and len(cut.tool_calls) <= 1, text[:n]
            if cut.tool_calls:
                fn = cut.tool_calls[0]["function"]
                assert fn["name"] == name and arguments.startswith(fn["arguments"]), text[:n]
                assert len(fn["arguments"]) >= longest  # (never loses what it showed)
                longest = len(fn["arguments"])
            _, _, content, calls = _stream(lambda: _forced_parser(parser), text[:n], [n // 2], True)
            assert content == cut.content and [(c["name"], c["arguments"]) for c in calls] == [
                (c["function"]["name"], c["function"]["arguments"]) for c in cut.tool_calls
            ]
        assert longest == len(arguments)


def test_forcing_grammar_reasoning_modes(tokenizer):
    """Reasoning left open by the prompt must close before the call; a closed (or absent)
    block cannot be reopened; with reasoning on and nothing in the prompt, either works."""
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(
        xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB_SIZE), max_threads=1
    )
    call = "<tool_call>book<arg_key>city</arg_key><arg_value>Rome</arg_value>" + (
        "<arg_key>nights</arg_key><arg_value>2</arg_value></tool_call>"
    )

    def accepts(prompt: str, reasoning: bool, text: str) -> bool:
        spec = tool_call_structural_tag("glm47", _GRAMMAR_TOOLS, "required", prompt, reasoning)
        return xgr.GrammarMatcher(compiler.compile_structural_tag(spec)).accept_string(text)

    assert accepts("x<think>", True, "hmm</think>" + call)
    assert not accepts("x<think>", True, call)
    assert accepts("x</think>", True, call) and not accepts("x</think>", True, "<think>")
    assert accepts("x", True, "<think>a</think>" + call) and accepts("x", True, call)
    assert accepts("x", False, call) and not accepts("x", False, "<think>")
    # after the calls, only more calls (back to back) or the end: no free text
    assert accepts("x", False, call + call) and not accepts("x", False, call + " and then")
    _, calls = _parse("glm47", call)
    assert calls == [("book", {"city": "Rome", "nights": 2})]
    with pytest.raises(DsakvError):
        named = {"type": "function", "function": {"name": "nope"}}
        tool_call_structural_tag("glm47", _GRAMMAR_TOOLS, named, "", False)


def test_deepseekv31_forcing_grammar_is_the_markup_the_parser_reads(tokenizer):
    """xgrammar's deepseek_v3_1 tag writes the calls our parser reads: "required" a block of
    calls back to back and nothing after it (so no `_calls_only` rewrite is needed), a named
    tool_choice one call of that tool."""
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(
        xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB_SIZE), max_threads=1
    )
    book = f'{CALL}book{SEP}{{"city": "Rome", "nights": 2}}{CALL_END}'
    ping = f"{CALL}ping{SEP}{{}}{CALL_END}"
    named = {"type": "function", "function": {"name": "book"}}

    def accepts(choice, text: str, parallel: bool = True) -> bool:
        spec = tool_call_structural_tag(
            "deepseekv31", _GRAMMAR_TOOLS, choice, "x</think>", True, parallel
        )
        return xgr.GrammarMatcher(compiler.compile_structural_tag(spec)).accept_string(text)

    whole = CALLS + book + ping + CALLS_END
    assert accepts("required", whole) and accepts(named, CALLS + book + CALLS_END)
    assert _parse("deepseekv31", whole) == (
        "",
        [("book", {"city": "Rome", "nights": 2}), ("ping", {})],
    )
    assert not accepts("required", whole + " and then") and not accepts("required", "Sure")
    assert not accepts("required", book)  # (the block's begin first)
    assert not accepts(named, CALLS + ping) and not accepts(named, CALLS + book + ping)
    assert not accepts("required", CALLS + book + ping, parallel=False)
    assert not accepts("required", CALLS + f'{CALL}book{SEP}{{"city": "Oslo"')  # (the schema)


_V31_TEMPLATE = (  # (DeepSeek-V3.2-Exp's template's tool-call turns, shortened)
    "{% for m in messages %}{% if m.role == 'user' %}<|user|>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<|assistant|></think>{% if m.tool_calls %}"
    "<｜tool▁calls▁begin｜>{% for t in m.tool_calls %}<｜tool▁call▁begin｜>"
    "{{ t.function.name }}<｜tool▁sep｜>{{ t.function.arguments | tojson }}"
    "<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜>{% endif %}<|eos|>"
    "{% elif m.role == 'tool' %}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>"
    "{% endif %}{% endfor %}"
)


def test_deepseek_v32_with_a_v31_style_template_reads_v31_calls(tmp_path):
    """DeepSeek-V3.2-Exp ships a chat template writing DeepSeek-V3.1's tool-call markup
    (SGLang serves it with its deepseekv31 parser): under "auto" that template picks the
    deepseekv31 parser; DeepSeek-V3.2 (no template: DSML in code) keeps deepseekv32, and a
    parser named explicitly wins."""
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path, "deepseek_v32")
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert ChatParsers.for_model("deepseek_v32", chat_template=_V31_TEMPLATE) == ChatParsers(
        "deepseekv31", "deepseek-v3"
    )
    assert ChatParsers.for_model("deepseek_v32", chat_template=tok.chat_template).tool == (
        "deepseekv32"
    )
    assert resolve_parsers("deepseek_v32", "deepseekv32", None, _V31_TEMPLATE)[0] == "deepseekv32"
    assert resolve_parsers("glm_moe_dsa", "auto", None, _V31_TEMPLATE)[0] == "glm47"
    call = {"function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call, call]},
        {"role": "tool", "content": "sunny"},
    ]
    text = render_chat(tok, messages, "deepseek_v32", chat_template=_V31_TEMPLATE)
    turn = text.split("<|assistant|></think>")[1]
    assert _parse("deepseekv31", turn)[1] == [("get_weather", {"city": "Oslo", "days": 2})] * 2


def test_a_server_picks_the_parser_its_chat_template_writes():
    """`dsakv serve` resolves "auto" with the template it serves (the tokenizer's, or
    --chat-template's): deepseekv31 for a V3.1-style one, deepseekv32 for DSML in code."""
    from dsakv.engine import EngineConfig
    from dsakv.models.tiny import default_model_dir
    from dsakv.procs import free_port
    from dsakv.server import make_server

    config = EngineConfig(model=str(default_model_dir("deepseek-tiny", weights="fp8")), num_pages=8)
    for template, tool in ((_V31_TEMPLATE, "deepseekv31"), (None, "deepseekv32")):
        server, async_engine = make_server(config, port=free_port(), chat_template=template)
        try:
            assert server.config.app.state.chat_parsers.tool == tool
        finally:
            async_engine.shutdown()
            async_engine.close_engine()


# --- tiny chat templates ----------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
def test_tiny_templates_render_tools_results_and_thinking(tmp_path, model_type):
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path, model_type)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    call = {"function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "need data",
            "tool_calls": [call],
        },
        {"role": "tool", "content": "sunny"},
    ]
    tools = [
        {
            "type": "function",
            "function": {"name": "get_weather", "parameters": SCHEMAS["get_weather"]},
        }
    ]

    def render(**kw):  # (GLM's template; DeepSeek-V3.2's encoding, in code)
        return render_chat(tok, messages, model_type, tools=tools, **kw)

    text = render()
    assert '"name": "get_weather"' in text and "Be brief." in text
    if model_type == "glm_moe_dsa":
        fmt = "glm47"
        assert "<think>need data</think>" in text  # (thinks by default, as GLM-5)
        assert "<|observation|><tool_response>sunny</tool_response>" in text
        assert text.endswith("<|assistant|><think>")
        assert render(enable_thinking=False).endswith("<|assistant|></think>")
    else:
        fmt = "deepseekv32"
        assert "need data" not in text  # (chat mode drops the reasoning)
        assert text.endswith(
            "\n\n<function_results>\n<result>sunny</result>\n</function_results>\n\n</think>"
        )
        text = render(thinking=True)
        assert "need data</think>" in text and text.endswith("</function_results>\n\n<think>")
    # The history's call is written in the model's own markup: our parser reads it back.
    turn = text.split("need data</think>")[1]
    assert _parse(fmt, turn)[1] == [("get_weather", {"city": "Oslo", "days": 2})]
