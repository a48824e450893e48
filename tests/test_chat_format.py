"""Chat prompts in the real models' formats: DeepSeek-V3.2, which ships no chat template, by
its `encoding_dsv32` (as vLLM and SGLang render it in code) on every chat path (server chat,
/tokenize, `LLM.chat`); GLM-5's template's layout in the tiny GLM preset; an earlier turn's
reasoning under vLLM's current name, `reasoning`. The expected texts are the reference
renderings, the real special tokens mapped onto the tiny presets' role tokens."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from dsakv.config.presets import BOS_ID
from dsakv.engine import LLM, EngineConfig, SamplingParams
from dsakv.models.tiny import write_tiny_model, write_tokenizer
from dsakv.server.chat import ChatParsers, prepare_chat
from dsakv.server.protocol import ChatCompletionRequest

from .serving import TIMEOUT, serving
from .test_server import ENGINE_ARGS

ARGS = {**ENGINE_ARGS, "num_pages": 256}  # (the tools block is ~1900 bytes: tokens)

_D = "｜DSML｜"
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
CALLS = [
    {
        "id": f"c{i}",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(args)},
    }
    for i, args in enumerate([{"city": "Oslo", "days": 2}, {"city": "Rome", "days": [1]}])
]
HI = {"role": "user", "content": "hi"}
SYSTEM = {"role": "system", "content": "Be brief."}

# DeepSeek-V3.2's tools block (encoding_dsv32's TOOLS_SYSTEM_TEMPLATE for TOOL).
DS_TOOLS = (
    "\n\n## Tools\nYou have access to a set of tools you can use to answer the user's question."
    f'\nYou can invoke functions by writing a "<{_D}function_calls>" block like the following '
    f"as part of your reply to the user:\n<{_D}function_calls>\n<{_D}invoke "
    f'name="$FUNCTION_NAME">\n<{_D}parameter name="$PARAMETER_NAME" string="true|false">'
    f"$PARAMETER_VALUE</{_D}parameter>\n...\n</{_D}invoke>\n<{_D}invoke "
    f'name="$FUNCTION_NAME2">\n...\n</{_D}invoke>\n</{_D}function_calls>\nString and scalar '
    "parameters should be specified as is without any escaping or quotes, while lists and "
    'objects should use JSON format. The "string" attribute should be set to "true" for '
    'string type parameters and "false" for other types (numbers, booleans, arrays, '
    "objects).\nIf the thinking_mode is enabled, then after function results you should "
    "strongly consider outputting a thinking block. Here is an example:\n"
    f"<{_D}function_calls>\n...\n</{_D}function_calls>\n<function_results>\n...\n"
    "</function_results>\n<think>...thinking about results</think>\nHere are the functions "
    "available in JSONSchema format:\n<functions>\n"
    '{"name": "get_weather", "description": "Weather", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}\n</functions>\n'
)
DS_CALLS = (
    f'\n\n<{_D}function_calls>\n<{_D}invoke name="get_weather">\n<{_D}parameter name="city" '
    f'string="true">Oslo</{_D}parameter>\n<{_D}parameter name="days" string="false">2'
    f'</{_D}parameter>\n</{_D}invoke>\n<{_D}invoke name="get_weather">\n<{_D}parameter '
    f'name="city" string="true">Rome</{_D}parameter>\n<{_D}parameter name="days" '
    f'string="false">[1]</{_D}parameter>\n</{_D}invoke>\n</{_D}function_calls>'
)
# name: (messages, tools, chat_template_kwargs, encoding_dsv32's prompt as vLLM applies it)
DEEPSEEK = {
    "single": ([HI], None, {}, "<|bos|><|user|>hi<|assistant|></think>"),
    "system": ([SYSTEM, HI], None, {}, "<|bos|>Be brief.<|user|>hi<|assistant|></think>"),
    "thinking": ([HI], None, {"thinking": True}, "<|bos|><|user|>hi<|assistant|><think>"),
    "enable_thinking": (
        [HI],
        None,
        {"enable_thinking": True},
        "<|bos|><|user|>hi<|assistant|><think>",
    ),
    "tools": (
        [SYSTEM, HI],
        [TOOL],
        {},
        f"<|bos|>{DS_TOOLS}Be brief.<|user|>hi<|assistant|></think>",
    ),
    "tool_history": (
        [
            HI,
            {"role": "assistant", "content": "", "reasoning": "need data", "tool_calls": CALLS},
            {"role": "tool", "tool_call_id": "c0", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        ],
        [TOOL],
        {"thinking": True},
        f"<|bos|>{DS_TOOLS}<|user|>hi<|assistant|><think>need data</think>{DS_CALLS}<|eos|>"
        "\n\n<function_results>\n<result>sunny</result>\n<result>rain</result>\n"
        "</function_results>\n\n<think>",
    ),
    "multi_turn": (
        [HI, {"role": "assistant", "content": "hello", "reasoning_content": "greet"}]
        + [{"role": "user", "content": "bye"}],
        None,
        {"thinking": True},
        "<|bos|><|user|>hi<|assistant|></think>hello<|eos|><|user|>bye<|assistant|><think>",
    ),
}


def _request(messages, tools, kwargs) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=messages, tools=tools, chat_template_kwargs=kwargs)


@pytest.fixture(scope="module")
def deepseek_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds-tok")
    write_tokenizer(path, "deepseek_v32")
    return AutoTokenizer.from_pretrained(path)


def test_the_tiny_deepseek_tokenizer_is_deepseek_v32s_shape(deepseek_tokenizer):
    """No chat template (DeepSeek-V3.2 ships none), a BOS added to a text, as its does."""
    assert not deepseek_tokenizer.chat_template
    assert deepseek_tokenizer("hi")["input_ids"] == [BOS_ID, *b"hi"]


@pytest.mark.parametrize("name", sorted(DEEPSEEK))
def test_deepseek_v32_chat_is_its_encoding(deepseek_tokenizer, name):
    messages, tools, kwargs, want = DEEPSEEK[name]
    parsers = ChatParsers.for_model("deepseek_v32")
    prep = prepare_chat(
        _request(messages, tools, kwargs), deepseek_tokenizer, parsers, "deepseek_v32"
    )
    assert prep.prompt == want
    # the reasoning parser starts where the prompt left it: inside a block it opened
    assert prep.reasoning == ("enabled" if want.endswith("<think>") else "disabled")


@pytest.fixture(scope="module")
def deepseek_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("ds") / "m", "deepseek-tiny", mtp="none")


def test_deepseek_v32_without_a_template_chats_offline_and_over_http(deepseek_model):
    """A template-less DeepSeek-V3.2 refused chat (server, /tokenize, `LLM.chat`); each
    runs the encoding's ids now, its BOS once, streamed or not."""
    tok = AutoTokenizer.from_pretrained(deepseek_model)
    greedy = SamplingParams(max_tokens=1, temperature=0)
    cases = [DEEPSEEK[n] for n in ("tool_history", "multi_turn", "single")]
    wants = [tok(c[3], add_special_tokens=False)["input_ids"] for c in cases]
    assert all(w.count(BOS_ID) == 1 for w in wants)
    with LLM(str(deepseek_model), **ARGS) as llm:
        for (messages, tools, kwargs, text), want in zip(cases, wants):
            out = llm.chat(messages, greedy, tools=tools, chat_template_kwargs=kwargs)[0]
            assert (out.prompt, out.prompt_token_ids) == (text, want)
    with serving(EngineConfig(model=str(deepseek_model), **ARGS)) as (base, _):
        for (messages, tools, kwargs, _text), want in zip(cases, wants):
            body = {"messages": messages, "tools": tools, "chat_template_kwargs": kwargs}
            r = httpx.post(f"{base}/tokenize", json=body, timeout=TIMEOUT)
            assert r.status_code == 200, r.text
            assert r.json()["tokens"] == want
            body |= {"max_tokens": 1, "return_token_ids": True}
            r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=TIMEOUT)
            assert r.status_code == 200, r.text
            assert r.json()["prompt_token_ids"] == want
            assert r.json()["usage"]["prompt_tokens"] == len(want)
            with httpx.stream(
                "POST",
                f"{base}/v1/chat/completions",
                json={**body, "stream": True},
                timeout=TIMEOUT,
            ) as s:
                first = next(json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {"))
            assert first["prompt_token_ids"] == want


# GLM-5's chat_template.jinja renderings (its [gMASK]<sop> as the tiny BOS).
_Q = [{"role": "user", "content": "q1"}]
_TURN = {"role": "assistant", "content": " a1 \n", "reasoning_content": " r1 "}
GLM = {
    "thinking": (_Q, {}, "<|bos|><|user|>q1<|assistant|><think>"),
    "no_thinking": (_Q, {"enable_thinking": False}, "<|bos|><|user|>q1<|assistant|></think>"),
    "cleared_before_last_user": (
        [*_Q, _TURN, {"role": "user", "content": "q2"}],
        {},
        "<|bos|><|user|>q1<|assistant|></think>a1<|user|>q2<|assistant|><think>",
    ),
    "kept_after_last_user": (
        [*_Q, _TURN],
        {"enable_thinking": False},
        "<|bos|><|user|>q1<|assistant|><think>r1</think>a1<|assistant|></think>",
    ),
    "clear_thinking_false": (
        [*_Q, _TURN, {"role": "user", "content": "q2"}],
        {"clear_thinking": False},
        "<|bos|><|user|>q1<|assistant|><think>r1</think>a1<|user|>q2<|assistant|><think>",
    ),
    "reasoning_in_content": (
        [*_Q, {"role": "assistant", "content": "<think>\nr0\n</think>\nans"}],
        {},
        "<|bos|><|user|>q1<|assistant|><think>r0</think>ans<|assistant|><think>",
    ),
    "tool_loop": (
        [
            *_Q,
            {"role": "assistant", "content": "", "reasoning": "need data", "tool_calls": CALLS},
            {"role": "tool", "tool_call_id": "c0", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        ],
        {},
        "<|bos|><|user|>q1<|assistant|><think>need data</think><tool_call>get_weather"
        "<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key><arg_value>2"
        "</arg_value></tool_call><tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome"
        "</arg_value><arg_key>days</arg_key><arg_value>[1]</arg_value></tool_call>"
        "<|observation|><tool_response>sunny</tool_response><tool_response>rain"
        "</tool_response><|assistant|><think>",
    ),
}


@pytest.fixture(scope="module")
def glm_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm-tok")
    write_tokenizer(path, "glm_moe_dsa")
    return AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("name", sorted(GLM))
def test_the_tiny_glm_template_renders_glm5s_layout(glm_tokenizer, name):
    messages, kwargs, want = GLM[name]
    parsers = ChatParsers.for_model("glm_moe_dsa")
    prep = prepare_chat(_request(messages, None, kwargs), glm_tokenizer, parsers, "glm_moe_dsa")
    assert prep.prompt == want
    assert prep.reasoning == ("enabled" if want.endswith("<think>") else "disabled")


@pytest.mark.parametrize("key", ["reasoning", "reasoning_content"])
def test_an_earlier_turns_reasoning_is_read_by_either_name(glm_tokenizer, key):
    """vLLM's current `reasoning` was dropped: the tool loop lost the turn's `<think>`."""
    messages = [
        *_Q,
        {"role": "assistant", "content": "", key: "need data", "tool_calls": CALLS[:1]},
        {"role": "tool", "tool_call_id": "c0", "content": "sunny"},
    ]
    prep = prepare_chat(_request(messages, None, {}), glm_tokenizer, ChatParsers())
    assert "<|assistant|><think>need data</think><tool_call>" in prep.prompt
