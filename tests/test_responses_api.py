"""OpenAI's Responses API (/v1/responses) through a real server and the `openai` client, on
the GLM tiny model: each response equals the chat completion of the same conversation
(greedy, token for token), streamed events reassemble (through the SDK's own stream helper,
which checks their order and ids) into the non-streamed response, previous_response_id and
function_call_output items continue a conversation as chat messages would, stored responses
are retrieved, deleted and cancelled, and bad requests are one clear 4xx."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from pydantic_core import from_json
from transformers import AutoTokenizer

from dsakv.engine import EngineConfig
from dsakv.engine.sampling import SamplingParams
from dsakv.models.tiny import write_tiny_model
from dsakv.server import responses
from dsakv.server.chat import ChatParsers, PreparedChat
from dsakv.server.handlers import ChatRun
from dsakv.server.parsers import ChatDelta
from dsakv.server.protocol import APIError
from dsakv.server.responses import (
    ResponseStore,
    _EventLog,
    _Output,
    _Reader,
    _reasoning_tokens,
    _Stored,
    input_messages,
)
from dsakv.server.runner import Update

from .serving import TIMEOUT, engine_stops_stepping_at, serving
from .test_server import ENGINE_ARGS
from .test_server_tools import SCHEMAS, TOOLS
from .test_update_weights import _until

QUIET = {"chat_template_kwargs": {"enable_thinking": False}}  # GLM answers without reasoning
WEATHER = {  # the Responses API's flat function tool
    "type": "function",
    **{k: TOOLS[0]["function"][k] for k in ("name", "description", "parameters")},
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(client, base URL, async engine, model dir) of a server on the GLM tiny model."""
    path = write_tiny_model(tmp_path_factory.mktemp("glm") / "glm", "glm-tiny", seed=0)
    config = EngineConfig(model=str(path), **{**ENGINE_ARGS, "num_pages": 256})
    with serving(config) as (base, async_engine):
        client = openai.OpenAI(
            base_url=f"{base}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0
        )
        yield client, base, async_engine, path


@pytest.fixture(scope="module")
def client(served):
    return served[0]


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _respond(client, model, **kw):
    kw.setdefault("max_output_tokens", 24)
    kw.setdefault("temperature", 0)
    return client.responses.create(model=model, **kw)


def _stopped_in_the_background(client, model, async_engine):
    """A background response whose engine stopped stepping at its 5th token (under
    `engine_stops_stepping_at(async_engine, 5)`), once it got there."""
    r = _respond(client, model, input="Go on.", background=True, max_output_tokens=100)
    requests = async_engine.engine.requests
    _until(lambda: any(len(x.output_ids) >= 5 for x in requests.values()), "5 tokens out")
    return r


def _chat(client, model, messages, max_tokens=24, **kw):
    return client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, **kw
    )


def _items(response) -> list[str]:
    return [item.type for item in response.output]


def test_text_equals_chat(client, model):
    r = _respond(client, model, input="Tell me a story.", extra_body=QUIET)
    c = _chat(client, model, [{"role": "user", "content": "Tell me a story."}], extra_body=QUIET)
    choice = c.choices[0]
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model
    assert _items(r) == ["message"] and r.output_text == choice.message.content
    assert r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens
    assert r.usage.total_tokens == c.usage.total_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    if choice.finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.output[0].status == "incomplete"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    assert r.max_output_tokens == 24 and r.temperature == 0


def test_instructions_and_items_equal_chat_messages(client, model):
    """instructions are a system turn, developer is system, content parts are joined."""
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
    ]
    r = _respond(client, model, input=items, instructions="You are terse.", extra_body=QUIET)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert (
        r.output_text == _chat(client, model, messages, extra_body=QUIET).choices[0].message.content
    )
    assert r.instructions == "You are terse."


def test_reasoning_item(client, model):
    """GLM thinks by default: the output opens with a reasoning item holding what chat
    returns as reasoning_content (here all of it: random weights never close the block)."""
    r = _respond(client, model, input="Why?")
    c = _chat(client, model, [{"role": "user", "content": "Why?"}])
    assert r.output[0].type == "reasoning" and r.output[0].summary == []
    assert r.output[0].content[0].text == c.choices[0].message.reasoning_content
    assert r.output_text == (c.choices[0].message.content or "")
    reasoning = r.usage.output_tokens_details.reasoning_tokens
    assert 0 < reasoning <= r.usage.output_tokens


def test_reasoning_tokens_count_up_to_the_end_of_reasoning(served):
    """The reasoning's token count stops at the token that closed the block."""
    tokenizer = AutoTokenizer.from_pretrained(served[3])
    prep = PreparedChat("<|assistant|><think>", None, None, ChatParsers(None, "glm45"))
    ids = tokenizer.encode("abc</think>xyz", add_special_tokens=False)
    assert _reasoning_tokens(prep, tokenizer, ids) == len(
        tokenizer.encode("abc</think>", add_special_tokens=False)
    )
    closed = PreparedChat("<|assistant|></think>", None, None, ChatParsers(None, "glm45"))
    assert _reasoning_tokens(closed, tokenizer, ids) == 0
    assert _reasoning_tokens(prep, tokenizer, ids[:5]) == 5  # cut off while reasoning


def test_forced_function_call(client, model):
    r = _respond(
        client,
        model,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=200,
        extra_body=QUIET,
    )
    c = _chat(
        client,
        model,
        [{"role": "user", "content": "Weather in Paris?"}],
        max_tokens=200,
        tools=[TOOLS[0]],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body=QUIET,
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].status == "completed"
    assert calls[0].id.startswith("fc_") and calls[0].call_id
    args = json.loads(calls[0].arguments)
    jsonschema.validate(args, SCHEMAS["get_weather"])
    assert args == json.loads(c.choices[0].message.tool_calls[0].function.arguments)


def test_function_call_output_continues_as_chat(client, model):
    """A function_call and its output (given as items, or by previous_response_id) are the
    assistant's tool call and the tool's turn."""
    first = _respond(
        client,
        model,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        extra_body=QUIET,
    )
    assert first.status == "completed"
    call = next(item for item in first.output if item.type == "function_call")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    by_id = _respond(
        client,
        model,
        input=[result],
        previous_response_id=first.id,
        tools=[WEATHER],
        extra_body=QUIET,
    )
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        result,
    ]
    by_items = _respond(client, model, input=items, tools=[WEATHER], extra_body=QUIET)
    tool_call = {
        "id": call.call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"},
    ]
    c = _chat(client, model, messages, tools=[TOOLS[0]], extra_body=QUIET)
    assert by_id.output_text == by_items.output_text == (c.choices[0].message.content or "")
    assert by_id.usage.input_tokens == by_items.usage.input_tokens == c.usage.prompt_tokens
    assert by_id.previous_response_id == first.id


def test_previous_response_id_drops_its_instructions(client, model):
    first = _respond(client, model, input="One.", instructions="Count.", extra_body=QUIET)
    second = _respond(client, model, input="Two.", previous_response_id=first.id, extra_body=QUIET)
    messages = [
        {"role": "user", "content": "One."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Two."},
    ]
    c = _chat(client, model, messages, extra_body=QUIET)
    assert second.output_text == c.choices[0].message.content
    assert second.usage.input_tokens == c.usage.prompt_tokens


def test_stream_reassembles_into_the_response(client, model):
    """The SDK's stream helper (which checks the events' order, indexes and ids) ends on
    the same response as a non-streamed call; the raw events count up from 0 and their
    deltas add up to each item."""
    kw = dict(input="Why?", max_output_tokens=30)
    whole = _respond(client, model, **kw)
    with client.responses.stream(model=model, temperature=0, **kw) as stream:
        events = list(stream)
    final = events[-1].response  # (`get_final_response` wants response.completed)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[-1].type == f"response.{whole.status}"  # completed or incomplete
    assert final.id == events[0].response.id and final.status == whole.status
    assert (
        _items(final) == _items(whole) == ["reasoning"] + (["message"] if whole.output_text else [])
    )
    assert final.output[0].content[0].text == whole.output[0].content[0].text
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == whole.output[0].content[0].text
    assert final.output_text == whole.output_text
    assert final.usage.model_dump() == whole.usage.model_dump()
    got = client.responses.retrieve(final.id)
    assert got.status == final.status and got.output_text == final.output_text


def test_streamed_function_call(client, model):
    kw = dict(
        input="Weather in Rome?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        extra_body=QUIET,
    )
    whole = _respond(client, model, **kw)
    with client.responses.stream(model=model, temperature=0, **kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert whole.status == "completed"
    call = next(item for item in final.output if item.type == "function_call")
    expected = next(item for item in whole.output if item.type == "function_call")
    assert (call.name, call.arguments) == (expected.name, expected.arguments)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments]


def test_structured_output(client, model):
    class City(BaseModel):
        name: Literal["Paris", "Rome", "Oslo"]
        days: int = Field(ge=1, le=7)

    r = client.responses.parse(
        model=model,
        input="A city and a number of days.",
        text_format=City,
        max_output_tokens=300,
        temperature=0,
        extra_body=QUIET,
    )
    assert r.status == "completed" and isinstance(r.output_parsed, City)


def test_store_retrieve_delete(client, model):
    r = _respond(client, model, input="Hi", extra_body=QUIET)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve(r.id)
    unstored = _respond(client, model, input="Hi", store=False, extra_body=QUIET)
    assert unstored.output_text == r.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id|not found"):
        _respond(client, model, input="Hi", previous_response_id=unstored.id)


def test_background_runs_to_the_end(client, model):
    r = _respond(client, model, input="Tell me a story.", background=True, extra_body=QUIET)
    assert r.background and r.status == "queued"  # (vLLM's; in_progress once it runs)
    deadline = time.monotonic() + TIMEOUT
    while r.status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
        r = client.responses.retrieve(r.id)
    expected = _respond(client, model, input="Tell me a story.", extra_body=QUIET)
    assert r.status == expected.status and r.output_text == expected.output_text
    with pytest.raises(openai.BadRequestError, match="Cannot cancel"):
        client.responses.cancel(r.id)
    with pytest.raises(openai.BadRequestError, match="synchronous"):
        client.responses.cancel(expected.id)


def test_cancel_a_background_response(served, model):
    client, _, async_engine, _ = served
    with engine_stops_stepping_at(async_engine, 5):
        r = _stopped_in_the_background(client, model, async_engine)
        cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled" and cancelled.usage.output_tokens == 5
    assert cancelled.output[0].type == "reasoning" and cancelled.output[0].status == "incomplete"
    assert client.responses.retrieve(r.id).status == "cancelled"
    assert not async_engine.engine.requests  # its pages given back


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"model": "other", "input": "x"}, 404, "does not exist"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input[0].type"),
        ({"input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, "input_image"),
        ({"input": [{"type": "function_call", "name": "f"}]}, 400, "call_id"),
        ({"input": "x", "tools": [{"type": "custom"}]}, 400, "name"),
        ({"input": "x", "background": True, "store": False}, 400, "store"),
        ({"input": "x", "prompt": {"id": "p"}}, 400, "prompt"),
        (
            {"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 21},
            400,
            "top_logprobs",
        ),
        ({"input": "x", "previous_response_id": "resp_x"}, 404, "not found"),
        ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text.format"),
        ({"input": "x", "tool_choice": {"type": "mcp"}}, 400, "tool_choice"),
        ({"input": 3}, 400, "input"),
        ({"input": "x", "stop_regex": ["a"]}, 400, "stop_regex"),
        ({"input": "x", "kv_transfer_params": {}}, 400, "kv_transfer_params"),
        ({"input": "x", "priority": 5}, 400, "priority"),
        ({"input": "x", "thinking_token_budget": -5}, 400, "thinking_token_budget"),
        ({"input": "x", "return_tokens_as_token_ids": "yes"}, 400, "return_tokens_as_token_ids"),
        # OpenAI's bounds on metadata, as a batch's (they were taken whatever their size)
        ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, 400, "17 pairs"),
        ({"input": "x", "metadata": {"k" * 65: "v"}}, 400, "65 characters"),
        ({"input": "x", "metadata": {"k": "v" * 513}}, 400, "513 characters"),
        # ids of 512 characters at most (they come back in headers and URLs)
        ({"input": "x", "request_id": "r" * 513}, 400, "request_id"),
        ({"input": "x", "previous_response_id": "r" * 513}, 400, "previous_response_id"),
    ],
)
def test_bad_requests(served, body, status, words):
    base = served[1]
    r = httpx.post(f"{base}/v1/responses", json=body, timeout=TIMEOUT)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"]
    if status == 400:
        assert error["type"] == "invalid_request_error"


def test_unknown_ids(served):
    base = served[1]
    for method, path in (("GET", ""), ("DELETE", ""), ("POST", "/cancel")):
        r = httpx.request(method, f"{base}/v1/responses/resp_missing{path}", timeout=TIMEOUT)
        assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"


@pytest.mark.parametrize(
    "raw",
    [
        b'{"input": "x", "max_output_tokens": 1, "request_id": "resp_lone", "user": "\\ud800"}',
        b'{"input": "x", "max_output_tokens": 1, "request_id": "resp_lone", '
        b'"tools": [{"type": "function", "name": "f", "parameters": {"x": NaN}}]}',
    ],
)
def test_what_no_answer_could_quote_is_refused_not_stored(served, raw):
    """A lone surrogate or NaN is no JSON text: refused as the body arrives. Taken, the
    response ran to its end before its 500, and was stored: every GET of it a 500 too."""
    base = served[1]
    r = httpx.post(f"{base}/v1/responses", content=raw, timeout=TIMEOUT,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], r.text
    assert httpx.get(f"{base}/v1/responses/resp_lone", timeout=TIMEOUT).status_code == 404


# --- the review's cases: ids, event order, continuations, truncation, the store -------------


def test_a_request_id_in_flight_is_refused(served, model):
    """A second request naming a request_id the first still runs under is a 400 (the first
    one is stored only once it ends)."""
    client, base, async_engine, _ = served
    body = {"input": "Go on.", "request_id": "resp_mine", "max_output_tokens": 50}
    with ThreadPoolExecutor(1) as pool, engine_stops_stepping_at(async_engine, 3):
        first = pool.submit(httpx.post, f"{base}/v1/responses", json=body, timeout=TIMEOUT)
        _until(lambda: async_engine.engine.requests, "the request runs")
        second = httpx.post(f"{base}/v1/responses", json=body, timeout=TIMEOUT)
        assert second.status_code == 400 and "exists already" in second.json()["error"]["message"]
    assert first.result().status_code == 200 and first.result().json()["id"] == "resp_mine"
    client.responses.delete("resp_mine")


def test_chats_request_fields_reach_the_response(served, model):
    """What chat takes of vLLM's and SGLang's fields a response takes alike (they were
    dropped): SGLang's extra_key salts the prefix cache, thinking_token_budget cuts the
    reasoning where chat's does, return_tokens_as_token_ids names the logprobs' tokens."""
    client, base, _, _ = served
    long = "Tell me about the weather in every city you know of, one by one. " * 3
    cached = []
    for key in ("k1", "k1", "k2"):
        r = _respond(client, model, input=long, max_output_tokens=2, extra_body={"extra_key": key})
        cached.append(r.usage.input_tokens_details.cached_tokens)
    assert cached[0] == cached[2] == 0 < cached[1]
    budget = {"thinking_token_budget": 3}
    messages = [{"role": "user", "content": "Think."}]
    chat = _chat(client, model, messages, max_tokens=30, extra_body=budget)
    r = _respond(client, model, input="Think.", max_output_tokens=30, extra_body=budget)
    thought = chat.choices[0].message.model_extra["reasoning_content"]
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text == thought
    r = _respond(
        client,
        model,
        input="Hi.",
        max_output_tokens=4,
        include=["message.output_text.logprobs"],
        extra_body={**QUIET, "return_tokens_as_token_ids": True},
    )
    tokens = [lp.token for lp in r.output[-1].content[0].logprobs]
    assert tokens and all(t.startswith("token_id:") for t in tokens)


def test_abort_request_reaches_a_response(served, model):
    """SGLang's /abort_request with a response's id ends it (it ran on to its end)."""
    _, base, async_engine, _ = served
    body = {"input": "Go on.", "request_id": "resp_abort", "max_output_tokens": 200}
    with ThreadPoolExecutor(1) as pool, engine_stops_stepping_at(async_engine, 3):
        running = pool.submit(httpx.post, f"{base}/v1/responses", json=body, timeout=TIMEOUT)
        _until(lambda: async_engine.engine.requests, "the request runs")
        r = httpx.post(f"{base}/abort_request", json={"rid": "resp_abort"}, timeout=TIMEOUT)
        assert r.status_code == 200
        answer = running.result()
    assert answer.status_code == 200 and answer.json()["usage"]["output_tokens"] <= 3
    httpx.delete(f"{base}/v1/responses/resp_abort", timeout=TIMEOUT)


def test_a_call_closes_before_the_text_after_it():
    """One update holding a call's close and the text after it: the call's last fragment
    comes before its item is done, the text's item after."""
    out = _Output()
    start = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f"}}
    out.feed(ChatDelta(tool_calls=[{**start, "function": {"name": "f", "arguments": '{"a": 1'}}]))
    events = out.feed(
        ChatDelta(content="after", tool_calls=[{"index": 0, "function": {"arguments": "}"}}])
    )
    kinds = [kind for kind, _ in events]
    assert (
        kinds.index("response.function_call_arguments.delta")
        < kinds.index("response.output_item.done")
        < kinds.index("response.output_item.added")
    )
    done = next(f for kind, f in events if kind == "response.output_item.done")
    assert done["item"]["arguments"] == '{"a": 1}' and done["item"]["status"] == "completed"


def test_unfinished_turns_are_continued_as_one():
    """A reasoning item opens the assistant turn its message (or call, or more reasoning)
    joins; a turn cut off goes on in the next assistant item; a call cut off is left out,
    its turn going on."""
    reasoning = {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Hm"}]}
    cut = {
        "type": "message",
        "role": "assistant",
        "status": "incomplete",
        "content": [{"type": "output_text", "text": "Once"}],
    }
    rest = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": " upon"}],
    }
    call = {
        "type": "function_call",
        "call_id": "c",
        "name": "f",
        "arguments": '{"x"',
        "status": "incomplete",
    }
    user = {"role": "user", "content": "Tell."}
    got = input_messages([user, reasoning, reasoning, cut, rest, call])
    assert got == [
        {"role": "user", "content": "Tell."},
        {
            "role": "assistant",
            "content": "Once upon",
            "reasoning_content": "HmHm",
            "_unfinished": True,  # (its call was cut off)
        },
    ]
    assert input_messages([user, reasoning, rest, user])[1:] == [
        {"role": "assistant", "content": " upon", "reasoning_content": "Hm", "_unfinished": False},
        {"role": "user", "content": "Tell."},
    ]
    assert input_messages([user, call]) == [
        {"role": "user", "content": "Tell."},
        {"role": "assistant", "content": "", "_unfinished": True},
    ]
    done = {**call, "arguments": "{}", "status": "completed"}
    turns = input_messages([user, done, call])  # (a turn that made calls is not continued)
    assert turns[-1]["tool_calls"][0]["function"]["arguments"] == "{}"
    assert not turns[-1].get("_unfinished")
    thinking = input_messages([user, {**reasoning, "status": "incomplete"}])
    assert thinking[-1] == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Hm",
        "_unfinished": True,
    }


def test_continuing_an_incomplete_response(client, model):
    """`input: []` after a response cut off writes on in the same turn (chat's
    continue_final_message), and so does the one after that: one assistant turn."""
    first = _respond(client, model, input="Tell me a story.", max_output_tokens=6, extra_body=QUIET)
    assert first.status == "incomplete"
    second = _respond(client, model, input=[], previous_response_id=first.id, max_output_tokens=6)
    third = _respond(client, model, input=[], previous_response_id=second.id, max_output_tokens=6)
    so_far = first.output_text + second.output_text
    messages = [
        {"role": "user", "content": "Tell me a story."},
        {"role": "assistant", "content": so_far},
    ]
    c = _chat(
        client,
        model,
        messages,
        max_tokens=6,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert third.output_text == c.choices[0].message.content
    assert third.usage.input_tokens == c.usage.prompt_tokens


def test_truncation_auto_leaves_room_for_the_output(served, client, model):
    async_engine = served[2]
    long = "word " * (2 * async_engine.engine.max_model_len)
    with pytest.raises(openai.BadRequestError, match="at most"):
        _respond(client, model, input=long, max_output_tokens=8)
    r = _respond(client, model, input=long, max_output_tokens=8, truncation="auto")
    assert r.usage.input_tokens + 8 == async_engine.engine.max_model_len
    assert r.usage.output_tokens == 8 or r.status == "completed"


def test_the_store_keeps_what_runs_and_what_it_just_took():
    store = ResponseStore(capacity=2)
    running = [_Stored({"id": i}, [], run=object()) for i in range(3)]  # (`run`: still going)
    for i, s in enumerate(running):
        store.put(f"r{i}", s)
    store.put("done", _Stored({"id": "done"}, []))
    for name in ("r0", "r1", "r2", "done"):
        store.get(name)  # none dropped: three run, one was just put
    for s in running:
        s.run = None
    store.put("next", _Stored({"id": "next"}, []))
    with pytest.raises(APIError):
        store.get("r0")  # the least recently used that no longer runs


def test_deepseek_reasoning_and_calls_round_trip(tmp_path):
    """DeepSeek-V3.2 (its chat encoded in code, DSML calls): the forced call's arguments
    equal chat's, and its output fed back (by previous_response_id, with the call's result)
    is chat's conversation of the same turns, then with thinking on. (Random weights never
    close a reasoning block before a forced call: thinking is off for the call.)"""
    path = write_tiny_model(tmp_path / "ds", "deepseek-tiny", seed=0)
    config = EngineConfig(model=str(path), **{**ENGINE_ARGS, "num_pages": 256})
    thinking: dict = {}
    with serving(config) as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=TIMEOUT, max_retries=0)
        model = client.models.list().data[0].id
        kw = dict(tool_choice="required", parallel_tool_calls=False, max_output_tokens=300)
        first = _respond(
            client, model, input="Weather?", tools=[WEATHER], extra_body=thinking, **kw
        )
        c = _chat(
            client, model, [{"role": "user", "content": "Weather?"}], max_tokens=300,
            tools=[TOOLS[0]], tool_choice="required", parallel_tool_calls=False,
            extra_body=thinking,
        )  # fmt: skip
        message = c.choices[0].message
        call = next(item for item in first.output if item.type == "function_call")
        assert call.arguments == message.tool_calls[0].function.arguments
        reasoning = [item for item in first.output if item.type == "reasoning"]
        got = reasoning[0].content[0].text if reasoning else None
        assert got == getattr(message, "reasoning_content", None)
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}
        thinking = {"chat_template_kwargs": {"thinking": True}}
        second = _respond(
            client, model, input=[result], previous_response_id=first.id, tools=[WEATHER],
            extra_body=thinking,
        )  # fmt: skip
        turn = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}
            ],
            **({"reasoning_content": got} if got is not None else {}),
        }  # fmt: skip
        messages = [
            {"role": "user", "content": "Weather?"},
            turn,
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny"},
        ]
        c2 = _chat(client, model, messages, tools=[TOOLS[0]], extra_body=thinking)
        assert second.usage.input_tokens == c2.usage.prompt_tokens
        assert second.output_text == (c2.choices[0].message.content or "")
        assert second.output[0].content[0].text == c2.choices[0].message.reasoning_content


# --- include: message.output_text.logprobs; streaming a background response ----------------

LOGPROBS = {"include": ["message.output_text.logprobs"], "top_logprobs": 2}


def test_text_logprobs_equal_chat(client, model):
    """The message's logprobs are chat's for its tokens (no reasoning here: all of them but
    the end token, which writes no text), their texts the message's; streamed, the deltas
    carry the same, token by token."""
    kw = dict(input="Tell me a story.", extra_body=QUIET, **LOGPROBS)
    r = _respond(client, model, **kw)
    c = _chat(
        client,
        model,
        [{"role": "user", "content": "Tell me a story."}],
        logprobs=True,
        top_logprobs=2,
        extra_body=QUIET,
    )
    got = [x.model_dump() for x in r.output[0].content[0].logprobs]
    want = [x.model_dump() for x in c.choices[0].logprobs.content]
    assert r.output_text and got and got == want[: len(got)] and len(want) - len(got) <= 1
    assert "".join(x["token"] for x in got) == r.output_text
    assert all(len(x["top_logprobs"]) == 2 for x in got)
    with client.responses.stream(model=model, temperature=0, max_output_tokens=24, **kw) as s:
        events = list(s)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [x.model_dump(exclude_none=True) for e in deltas for x in e.logprobs] == got
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [x.model_dump() for x in done.logprobs] == got
    assert [x.model_dump() for x in events[-1].response.output[0].content[0].logprobs] == got


def _update(texts: list[str], first: int) -> Update:
    """An update of one token per text, each token's logprob minus its place in the output."""
    return Update(
        list(range(len(texts))),
        "".join(texts),
        [-float(first + i) for i in range(len(texts))],
        [[] for _ in texts],
        texts=texts,
        top_texts=[[] for _ in texts],
    )


def _text_logprobs(
    prep: PreparedChat, tokens: list[str], per_update: int, cut: bool = False
) -> list[float]:
    run = ChatRun(prep, [], None, SamplingParams(logprobs=0))
    reader, output = _Reader(run), _Output()
    for i in range(0, len(tokens), per_update):
        u = _update(tokens[i : i + per_update], i)
        last = i + per_update >= len(tokens)
        for d, logprobs in reader.feed(u, u.text, last, cut and last):
            output.feed(d, logprobs)
    output.finish("completed")
    parts = [i["content"][0] for i in output.items if i["type"] == "message"]
    return [x["logprob"] for part in parts for x in part["logprobs"]]


@pytest.mark.parametrize("per_update", [1, 3, 100])
def test_text_logprobs_are_its_own_tokens(per_update):
    """Reasoning's tokens and a tool call's markup keep their logprobs; held-back text
    (whitespace, a `<` that may open a tag) gets its tokens once settled; a token holding
    the end of reasoning and text is the text's; however many tokens an update holds."""
    prep = PreparedChat("<|assistant|><think>", None, {"f": {}}, ChatParsers("glm47", "glm45"))
    tokens = ["Let", " me", "</think>", "\n", "Hi", " <", " b", "\n"]
    tokens += ["<tool_call>", "f", "</tool_call>", "ok.</think>x", "!"]
    lp = _text_logprobs(prep, tokens, per_update)
    assert lp == [-3.0, -4.0, -5.0, -6.0, -11.0, -12.0]
    straddling = ["Hm", "m.</think>Yes", ", it", "."]
    assert _text_logprobs(prep, straddling, per_update) == [-1.0, -2.0, -3.0]
    # text the parser still holds back (a `<` that may open a tool call) is not matched
    assert _text_logprobs(prep, list("ok</think>yes<<no"), per_update) == [
        -10.0, -11.0, -12.0, -13.0, -14.0, -15.0, -16.0,
    ]  # fmt: skip
    assert _text_logprobs(prep, ["a</think>a", "b"], per_update) == [-0.0, -1.0]
    answer = PreparedChat("<|assistant|></think>", None, {"f": {}}, prep.parsers)
    for tokens in (["Hi", "<", "<", "x", "!"], list("x<<<y"), ["<", "<", "EOF"]):
        assert _text_logprobs(answer, tokens, per_update) == [-float(i) for i in range(len(tokens))]
    # cut off by max_output_tokens: the `<` that may open a call is dropped, its token too
    assert _text_logprobs(answer, ["a", "<", "<"], per_update, cut=True) == [-0.0, -1.0]
    opens = PreparedChat("<|assistant|>", None, {"f": {}}, prep.parsers)  # (its own <think>)
    assert _text_logprobs(opens, [" <think>a</think>a", "b"], per_update) == [-0.0, -1.0]


def test_a_reader_that_falls_behind_the_kept_events_ends_with_an_error(monkeypatch):
    """A stream reader that stalls goes on from the next event while it is kept, however
    many older ones were dropped meanwhile; once that one is dropped too, its stream ends
    with OpenAI's `error` event instead of skipping ahead."""
    monkeypatch.setattr(responses, "EVENTS_KEPT", 4)

    async def read() -> tuple[list[str], list[str]]:
        log = _EventLog()
        for i in range(3):
            log.add(f"e{i}")
        kept, dropped = log.replay(-1), log.replay(-1)
        first = [await anext(kept), await anext(dropped)]
        for i in range(3, 5):
            log.add(f"e{i}")  # (e0 dropped: e1, the next `kept` reads, is not)
        got = [first[0]] + [await anext(kept)]
        log.add("e5")  # (e1 dropped: `dropped` needs it)
        log.add(None)
        return got + [e async for e in kept], [first[1]] + [e async for e in dropped]

    kept, dropped = asyncio.run(read())
    assert kept == ["e0", "e1", "e2", "e3", "e4", "e5"]
    assert dropped[0] == "e0" and len(dropped) == 2
    kind, data = dropped[1].split("\n")[:2]
    error = openai.types.responses.ResponseErrorEvent.model_validate_json(data[len("data: ") :])
    assert kind == "event: error" and error.sequence_number == 1 and "no longer" in error.message


def test_a_background_response_streams_and_replays(client, model):
    """background + stream answers its events live (created: queued); GET ?stream=true
    replays them, from the one after starting_after, however often."""
    kw = dict(input="Why?", max_output_tokens=30, temperature=0)
    events = list(client.responses.create(model=model, background=True, stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "queued" and events[0].response.background
    assert events[1].response.status == "in_progress"
    assert events[-1].type in ("response.completed", "response.incomplete")
    rid = events[0].response.id
    whole = _respond(client, model, **kw)
    assert events[-1].response.output_text == whole.output_text
    assert client.responses.retrieve(rid).model_dump() == events[-1].response.model_dump()
    dumped = [e.model_dump() for e in events]
    again = client.responses.retrieve(rid, stream=True)
    assert [e.model_dump() for e in again] == dumped
    tail = client.responses.retrieve(rid, stream=True, starting_after=5)
    assert [e.model_dump() for e in tail] == dumped[6:]
    with pytest.raises(openai.BadRequestError, match=r"starting_after must be .* -1"):
        client.responses.retrieve(rid, stream=True, starting_after=-5)


def test_attach_to_a_running_background_response(served, model):
    """A client attaching while it runs gets the events so far, then each as it comes, to
    the end; cancelled, its stream ends with the cancelled response."""
    client, _, async_engine, _ = served
    with engine_stops_stepping_at(async_engine, 5):
        r = _stopped_in_the_background(client, model, async_engine)
        with ThreadPoolExecutor(1) as pool:
            attached = pool.submit(lambda: list(client.responses.retrieve(r.id, stream=True)))
            time.sleep(0.2)
            assert not attached.done()  # (live: waits for what comes)
            client.responses.cancel(r.id)
            events = attached.result(timeout=TIMEOUT)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.completed"  # (OpenAI's events have no .cancelled)
    assert events[-1].response.status == "cancelled"
    assert events[-1].response.usage.output_tokens == 5


def test_only_a_background_response_streams_again(served, client, model):
    base = served[1]
    r = _respond(client, model, input="Hi", extra_body=QUIET)
    got = httpx.get(f"{base}/v1/responses/{r.id}", params={"stream": "true"}, timeout=TIMEOUT)
    assert got.status_code == 400 and "background" in got.json()["error"]["message"]


def test_input_items_are_the_conversation_a_response_was_made_from(served, model):
    """OpenAI's input_items: a response's input items, each with an id (text as a user
    message of one input_text part); a continuation's are the conversation (the earlier
    responses' input and output items, their ids kept, then its own), newest first
    unless asc, in pages (after, before, limit)."""
    client, base = served[0], served[1]
    first = _respond(client, model, input="Hi", instructions="Be brief.")
    own = [
        {"role": "user", "content": "More?"},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be"}]},
    ]
    second = _respond(client, model, input=own, previous_response_id=first.id, extra_body=QUIET)
    alone = client.responses.input_items.list(first.id).data
    assert [(i.type, i.role, i.content[0].type, i.content[0].text) for i in alone] == [
        ("message", "user", "input_text", "Hi")
    ]
    items = client.responses.input_items.list(second.id, order="asc", limit=100).data
    ids = [i.id for i in items]
    assert ids[0] == alone[0].id and ids[1:-2] == [o.id for o in first.output]
    assert [i.content[0].text for i in items[-2:]] == ["More?", "Be"]
    assert items[-2].content[0].type == "input_text" and len(set(ids)) == len(ids)
    desc = client.responses.input_items.list(second.id)  # (desc: OpenAI's default)
    assert [i.id for i in desc.data] == ids[::-1]
    assert [i.id for i in client.responses.input_items.list(second.id, limit=2)] == ids[::-1]
    url = f"{base}/v1/responses/{second.id}/input_items"
    page = httpx.get(url, params={"limit": 2, "after": ids[-1]}, timeout=TIMEOUT).json()
    assert page["object"] == "list" and [i["id"] for i in page["data"]] == ids[-2:-4:-1]
    assert (page["first_id"], page["last_id"], page["has_more"]) == (ids[-2], ids[-3], True)
    asc = {"order": "asc", "before": ids[-1], "limit": 2}
    page = httpx.get(url, params=asc, timeout=TIMEOUT).json()
    assert [i["id"] for i in page["data"]] == ids[-3:-1] and page["has_more"] == (len(ids) > 3)
    for params, param in (({"limit": 0}, "limit"), ({"after": "msg_x"}, "after")):
        r = httpx.get(url, params=params, timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    r = httpx.get(f"{base}/v1/responses/resp_missing/input_items", timeout=TIMEOUT)
    assert r.status_code == 404


# Conversations whose turns go on across a response's end: the first response's input (its
# output one message, completed), then the continuation's input and arguments.
_ONE_OF = {
    "format": {"type": "json_schema", "name": "x", "schema": {"type": "string", "enum": ["a"]}}
}
_CALL = [
    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "42"},
]
_THOUGHT = {
    "type": "reasoning",
    "summary": [],
    "content": [{"type": "reasoning_text", "text": "hm"}],
}
ACROSS = {
    # a completed message, then a call: the call joins the message's turn
    "call after a message": ("hi", _CALL, {"tools": [WEATHER]}),
    # input ending with a reasoning item: the output's message joins the turn it opened
    "message after reasoning": ([{"role": "user", "content": "q"}, _THOUGHT], "next", {}),
}


def _as_list(items) -> list:
    return [{"role": "user", "content": items}] if isinstance(items, str) else items


@pytest.mark.parametrize("case", ACROSS)
def test_previous_response_id_equals_sending_its_items(client, model, case):
    """previous_response_id reads the conversation's items as one input: the prompt (and
    so the output) of the same items sent again, turns joined across a response's end."""
    first_input, then, then_kw = ACROSS[case]
    first = _respond(client, model, input=first_input, text=_ONE_OF, extra_body=QUIET)
    assert first.status == "completed" and _items(first)[-1] == "message"
    by_id = _respond(
        client, model, input=then, previous_response_id=first.id, extra_body=QUIET, **then_kw
    )
    sent = [*_as_list(first_input), *(o.model_dump() for o in first.output)]
    by_items = _respond(client, model, input=sent + _as_list(then), extra_body=QUIET, **then_kw)
    assert by_id.usage.input_tokens == by_items.usage.input_tokens
    assert by_id.output_text == by_items.output_text


def test_an_item_id_given_twice_is_refused(client, model, served):
    """OpenAI's 400 for an id twice in the conversation (an earlier response's output sent
    again with previous_response_id, or twice in one input), and for an id not a string:
    input_items pages by id."""
    base = served[1]
    first = _respond(client, model, input="Hi", max_output_tokens=2)
    again = [o.model_dump() for o in first.output] + [{"role": "user", "content": "More"}]
    user = {"type": "message", "role": "user", "content": "Hi", "id": "msg_1"}
    for body in (
        {"input": again, "previous_response_id": first.id},
        {"input": [user, {**user, "content": "Ho"}]},
    ):
        r = httpx.post(
            f"{base}/v1/responses", json={**body, "max_output_tokens": 2}, timeout=TIMEOUT
        )
        assert r.status_code == 400, r.text[:200]
        error = r.json()["error"]
        dup = again[0]["id"] if "previous_response_id" in body else "msg_1"
        assert error["message"] == (
            f"Duplicate item found with id {dup}. Remove duplicate items from your input and "
            "try again."
        )
        assert error["param"] == "input"
    for bad in (None, 3):
        body = {"input": [{**user, "id": bad}], "max_output_tokens": 2}
        r = httpx.post(f"{base}/v1/responses", json=body, timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text[:200]


# --- Codex CLI and the Agents SDK: stateless conversations (store: false) -------------------

SHELL = {  # Codex's shell tool (codex-rs: a function tool, strict false)
    "type": "function",
    "name": "shell",
    "description": "Runs a shell command and returns its output.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "array", "items": {"type": "string"}}},
        "required": ["command"],
        "additionalProperties": False,
    },
}
APPLY_PATCH = {  # Codex's freeform apply_patch: a custom tool with a Lark grammar
    "type": "custom",
    "name": "apply_patch",
    "description": "Edits files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch"'},
}
# what Codex sends besides `input` (codex-rs `ResponsesApiRequest`): web_search and
# local_shell are tools OpenAI runs, shown to no model here
CODEX = dict(
    instructions="You are Codex, a coding agent.",
    tools=[SHELL, APPLY_PATCH, {"type": "web_search"}, {"type": "local_shell"}],
    tool_choice="auto",
    parallel_tool_calls=False,
    reasoning={"effort": "medium", "summary": "auto"},
    store=False,
    include=["reasoning.encrypted_content"],
    prompt_cache_key="conversation-1",
    text={"verbosity": "low"},
    max_output_tokens=12,
    temperature=0,
)
# the same tools as chat's (what `_chat_tools` shows the model)
CHAT_TOOLS = [
    {"type": "function", "function": {k: v for k, v in SHELL.items() if k != "type"}},
    {
        "type": "function",
        "function": {
            "name": "apply_patch",
            "description": "Edits files.",
            "parameters": {
                "type": "object",
                "properties": {
                    "input": {
                        "type": "string",
                        "description": 'lark grammar:\nstart: "*** Begin Patch"',
                    }
                },
                "required": ["input"],
            },
        },
    },
]


def _codex_item(item) -> dict:
    """An output item as Codex sends it back (codex-rs `ResponseItem`: no id or status)."""
    if item.type == "reasoning":
        content = [{"type": "reasoning_text", "text": c.text} for c in item.content or []]
        return {"type": "reasoning", "summary": [], "content": content, "encrypted_content": None}
    assert item.type == "message"
    content = [{"type": "output_text", "text": c.text} for c in item.content]
    return {"type": "message", "role": "assistant", "content": content}


def _streamed_and_whole(client, model, items):
    """One Codex turn, streamed (its events checked: numbering, order, ids, indexes; they
    add up to the response) and not; both the same response."""
    events = list(client.responses.create(model=model, input=items, stream=True, **CODEX))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    final = events[-1].response
    ids: list[str] = []  # the items' ids, by output_index, as they were added
    texts: dict[str, str] = {}
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            assert e.output_index == len(ids)
            ids.append(e.item.id)
        elif e.type == "response.output_item.done":
            assert e.item.id == ids[e.output_index] == final.output[e.output_index].id
            assert e.item.model_dump() == final.output[e.output_index].model_dump()
        else:
            assert e.item_id == ids[e.output_index] and e.output_index == len(ids) - 1
            if hasattr(e, "content_index"):
                assert e.content_index == 0
            if e.type.endswith(".delta"):
                texts[e.item_id] = texts.get(e.item_id, "") + e.delta
    assert ids == [o.id for o in final.output]
    for o in final.output:
        assert texts.get(o.id, "") == "".join(c.text for c in o.content or [])
    whole = client.responses.create(model=model, input=items, **CODEX)
    assert [_codex_item(o) for o in whole.output] == [_codex_item(o) for o in final.output]
    for r in (final, whole):
        u = r.usage
        assert u.total_tokens == u.input_tokens + u.output_tokens
        assert 0 <= u.input_tokens_details.cached_tokens <= u.input_tokens
        assert 0 < u.output_tokens_details.reasoning_tokens <= u.output_tokens
        assert r.store is False and r.parallel_tool_calls is False
        assert r.text.verbosity == "low" and r.prompt_cache_key == "conversation-1"
        assert [t.type for t in r.tools] == ["function", "custom", "web_search", "local_shell"]
        with pytest.raises(openai.NotFoundError):  # (store: false)
            client.responses.retrieve(r.id)
    # the same prompt again: in the prefix cache (but for its last page's tokens)
    assert whole.usage.input_tokens_details.cached_tokens > 0
    final.usage.input_tokens_details.cached_tokens = whole.usage.input_tokens_details.cached_tokens
    assert whole.usage.model_dump() == final.usage.model_dump()
    return whole


def _as_chat(client, model, base, messages, response) -> str:
    """The prompt of chat `messages` (with Codex's tools as chat's): that of `response`
    (its token count, and greedy, its reasoning), as text."""
    c = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=CHAT_TOOLS,
        tool_choice="auto",
        parallel_tool_calls=False,
        reasoning_effort="medium",
        max_tokens=12,
        temperature=0,
    )
    assert c.usage.prompt_tokens == response.usage.input_tokens
    assert response.output[0].content[0].text == c.choices[0].message.reasoning_content
    body = {"messages": messages, "tools": CHAT_TOOLS}
    tokens = httpx.post(f"{base}/tokenize", json=body, timeout=TIMEOUT).json()["tokens"]
    assert len(tokens) == response.usage.input_tokens
    body = {"tokens": tokens}
    return httpx.post(f"{base}/detokenize", json=body, timeout=TIMEOUT).json()["prompt"]


def test_a_codex_conversation_replays_statelessly(served, model):
    """Codex's turns (store: false, the whole history each time: its reasoning items sent
    back, function and custom tool calls and their outputs, web_search and local_shell
    tools, include, prompt_cache_key, verbosity), streamed and not: each response is the
    chat completion of the conversation so far, its events consistent."""
    client, base = served[0], served[1]

    def text(role, words):
        kind = "output_text" if role == "assistant" else "input_text"
        return {"type": "message", "role": role, "content": [{"type": kind, "text": words}]}

    start = [
        text("developer", "Sandbox: workspace-write."),
        text("user", "<environment_context>cwd=/repo</environment_context>"),
        text("user", "List the files, then fix setup.py."),
    ]
    messages = [
        {"role": "system", "content": CODEX["instructions"]},
        {"role": "system", "content": "Sandbox: workspace-write."},
        {"role": "user", "content": "<environment_context>cwd=/repo</environment_context>"},
        {"role": "user", "content": "List the files, then fix setup.py."},
    ]
    first = _streamed_and_whole(client, model, start)
    assert first.output[0].type == "reasoning"  # (GLM thinks, here past 12 tokens)
    _as_chat(client, model, base, messages, first)

    # the model called shell, then apply_patch (another server's reasoning first, its
    # encrypted_content unreadable here): Codex sends it all back with the outputs
    patch = "*** Begin Patch\n*** Update File: setup.py\n*** End Patch"
    history = [
        *start,
        *(_codex_item(o) for o in first.output),
        {
            "type": "function_call",
            "name": "shell",
            "arguments": '{"command":["ls"]}',
            "call_id": "c1",
        },
        {"type": "function_call_output", "call_id": "c1", "output": "README.md\nsetup.py"},
        {
            "type": "reasoning",
            "summary": [{"type": "summary_text", "text": "Patch setup.py."}],
            "encrypted_content": "gAAAAB-opaque",
        },
        {"type": "custom_tool_call", "name": "apply_patch", "input": patch, "call_id": "c2"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "Done!"},
    ]
    second = _streamed_and_whole(client, model, history)
    thought = first.output[0].content[0].text
    messages += [
        {
            "role": "assistant",
            "content": first.output[1].content[0].text if len(first.output) > 1 else None,
            "reasoning_content": thought,
            "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "shell", "arguments": '{"command":["ls"]}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "README.md\nsetup.py"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Patch setup.py.",
            "tool_calls": [
                {"id": "c2", "type": "function",
                 "function": {"name": "apply_patch", "arguments": json.dumps({"input": patch})}}
            ],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "Done!"},
    ]  # fmt: skip
    prompt = _as_chat(client, model, base, messages, second)
    for sent in ("README.md\nsetup.py", "*** Update File: setup.py", "Done!", "Patch setup.py."):
        assert sent in prompt
    assert thought.strip() in prompt and "gAAAAB" not in prompt  # (this turn's reasoning)


def test_a_custom_tool_call_is_its_own_item():
    """A call of a custom tool is a custom_tool_call, its input the call's one argument
    (no arguments deltas); as input it is that call again."""
    out = _Output(responses._tools([APPLY_PATCH]).calls)
    start = {"index": 0, "id": "c1", "type": "function", "function": {"name": "apply_patch"}}
    events = out.feed(
        ChatDelta(tool_calls=[{**start, "function": {"name": "apply_patch", "arguments": '{"in'}}])
    )
    more = ChatDelta(tool_calls=[{"index": 0, "function": {"arguments": 'put": "a\\nb"}'}}])
    events += out.feed(more)
    out.finish("completed")
    events += out.events
    assert [kind for kind, _ in events] == [
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
    ]
    added, delta, done, item_done = (fields for _, fields in events)
    assert added["item"]["type"] == "custom_tool_call" and added["item"]["input"] == ""
    assert added["item"]["id"].startswith("ctc_") and added["item"]["call_id"] == "c1"
    assert delta["delta"] == done["input"] == "a\nb" == out.items[0]["input"]
    assert delta["item_id"] == done["item_id"] == out.items[0]["id"]
    assert item_done["item"] == out.items[0] and "arguments" not in out.items[0]
    assert responses._custom_input('{"x": 1}') == '{"x": 1}'  # (not its one string: as is)
    assert responses._custom_input('{"input": "a\\u00') == "a"  # (cut off: as far as it reads)
    assert responses._custom_input('{"inp') == ""
    assert responses._custom_input('{"x": 1', final=False) == ""  # (it may yet be the string)
    call = {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "a\nb"}
    result = {"type": "custom_tool_call_output", "call_id": "c1", "output": "ok"}
    assert input_messages([{"role": "user", "content": "Go"}, call, result])[1:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "apply_patch", "arguments": '{"input": "a\\nb"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]


def test_a_custom_tool_calls_input_streams_as_it_is_written():
    """A custom call's input streams as its string is written, OpenAI's
    `response.custom_tool_call_input.delta`s, which make the final input (it came whole in
    one delta as the call ended: the arguments are JSON, read as far as written)."""
    out = _Output(responses._tools([APPLY_PATCH]).calls)
    start = {"index": 0, "id": "c1", "type": "function", "function": {"name": "apply_patch"}}
    fragments = ['{"input": "*** Begin', " Patch\\n*** Up", "date File: a.py\\u00", "e9", '"}']
    first = {**start, "function": {"name": "apply_patch", "arguments": fragments[0]}}
    fed = [out.feed(ChatDelta(tool_calls=[first]))]
    for fragment in fragments[1:]:
        more = {"index": 0, "function": {"arguments": fragment}}
        fed.append(out.feed(ChatDelta(tool_calls=[more])))
    out.finish("completed")
    deltas = [[f["delta"] for k, f in events if k.endswith("input.delta")] for events in fed]
    assert deltas == [["*** Begin"], [" Patch\n*** Up"], ["date File: a.py"], ["\u00e9"], []]
    final = out.items[0]["input"]
    assert final == "*** Begin Patch\n*** Update File: a.py\u00e9" == "".join(sum(deltas, []))
    assert [k for k, _ in out.events] == [
        "response.custom_tool_call_input.done",
        "response.output_item.done",
    ]
    assert out.events[0][1]["input"] == final


def test_a_forced_custom_tool_call(client, model):
    """tool_choice naming a custom tool forces its call: a custom_tool_call, streamed as
    the SDK's stream helper reads it, the same as not streamed. (Random weights never end
    its string: it is cut off, its input the string written so far, not the JSON of the
    function it was shown as.)"""
    kw = dict(
        input="Fix setup.py.",
        tools=[APPLY_PATCH],
        tool_choice={"type": "custom", "name": "apply_patch"},
        max_output_tokens=80,
        extra_body=QUIET,
    )
    whole = _respond(client, model, **kw)
    chat = _chat(
        client,
        model,
        [{"role": "user", "content": "Fix setup.py."}],
        max_tokens=80,
        tools=CHAT_TOOLS[1:],
        tool_choice={"type": "function", "function": {"name": "apply_patch"}},
        extra_body=QUIET,
    )
    arguments = chat.choices[0].message.tool_calls[0].function.arguments
    assert arguments.startswith('{"input": "') and not arguments.endswith("}")  # (cut off)
    assert whole.output[0].input == from_json(arguments, allow_partial="trailing-strings")["input"]
    with client.responses.stream(model=model, temperature=0, **kw) as stream:
        events = list(stream)
    final = events[-1].response
    assert _items(whole) == _items(final) == ["custom_tool_call"]
    call = final.output[0]
    assert call.name == "apply_patch" and call.status == "incomplete" == final.status
    assert call.input == whole.output[0].input and call.id.startswith("ctc_")
    done = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert [(e.input, e.item_id) for e in done] == [(call.input, call.id)]
    assert not [e for e in events if e.type.startswith("response.function_call")]


def test_a_namespace_tool_is_its_functions(client, model):
    """A namespace tool (Codex's MCP servers and collaboration tools) is its function and
    custom tools, shown to the model as `<namespace>__<name>` (vLLM's names); a call is
    the tool's name and its namespace, and sent back it reads as it was written."""
    lookup = {"type": "function", "name": "lookup", "parameters": WEATHER["parameters"]}
    crm = {"type": "namespace", "name": "crm", "description": "The CRM.", "tools": [lookup]}
    flat = {"type": "function", "function": {**lookup, "name": "crm__lookup"}}
    del flat["function"]["type"]
    ask = [{"role": "user", "content": "Who?"}]
    forced = {"type": "function", "name": "crm__lookup"}
    kw = dict(tool_choice=forced, max_output_tokens=60, extra_body=QUIET)
    r = _respond(client, model, input=ask, tools=[crm], **kw)
    forced = {"type": "function", "function": {"name": "crm__lookup"}}
    c = _chat(client, model, ask, 60, tools=[flat], tool_choice=forced, extra_body=QUIET)
    assert r.usage.input_tokens == c.usage.prompt_tokens
    call, chat_call = r.output[0], c.choices[0].message.tool_calls[0]
    assert (call.type, call.name, call.namespace) == ("function_call", "lookup", "crm")
    assert call.arguments == chat_call.function.arguments

    arguments = '{"city": "Oslo", "days": 2}'
    sent = {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": arguments}
    result = {"type": "function_call_output", "call_id": "c1", "output": "Ada"}
    back = [*ask, {**sent, "namespace": "crm"}, result]
    r = _respond(client, model, input=back, tools=[crm], max_output_tokens=1, extra_body=QUIET)
    fn = {"name": "crm__lookup", "arguments": arguments}
    messages = [
        *ask,
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": fn}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Ada"},
    ]
    c = _chat(client, model, messages, max_tokens=1, tools=[flat], extra_body=QUIET)
    assert r.usage.input_tokens == c.usage.prompt_tokens
