"""`dsakv run-batch` (vLLM's run-batch, `dsakv.server.batch`): a file of OpenAI batch requests
run offline, each answer what `dsakv serve` gives for the same body (greedy: the same
tokens), each bad line an error line of its own in its place, a bad file or flag one error
line and exit 2 before the model loads."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from dsakv.cli import main

from .conftest import cli_config, cli_error_line
from .serving import TIMEOUT, answer_of, serving

FLAGS = ["--kv-cache-dtype", "fp32", "--index-k-dtype", "fp32", "--num-pages", "64"]
FLAGS += ["--page-size", "16", "--device", "cpu"]
GREEDY = {"temperature": 0, "ignore_eos": True}
GOOD = {  # custom_id: (url, body)
    "chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6, **GREEDY},
    ),
    "two-prompts": (
        "/v1/completions",
        {"prompt": ["The cat", "A dog ran"], "max_tokens": 5, "logprobs": 2, **GREEDY},
    ),
    "score": ("/v1/score", {"query": "Q: ", "items": ["yes", "no"], "label_token_ids": [5, 9]}),
    "json": (
        "/v1/completions",
        {"prompt": "{", "max_tokens": 6, "response_format": {"type": "json_object"}, **GREEDY},
    ),
    "responses": ("/v1/responses", {"input": "Hi", "max_output_tokens": 6, "temperature": 0}),
}
BAD = {  # custom_id: (line, status, the error's param)
    "embeddings": ({"method": "POST", "url": "/v1/embeddings", "body": {}}, 400, "url"),
    "get": ({"method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}}, 400, "method"),
    "no-messages": ({"method": "POST", "url": "/v1/chat/completions", "body": {}}, 400, "messages"),
    "too-long": (
        {"method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 5000}},
        400,
        "max_tokens",
    ),
    "other-model": (
        {"method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "model": "nope"}},
        404,
        "model",
    ),
    "streamed": (
        {"method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "stream": True}},
        400,
        "stream",
    ),
    "background": (
        {"method": "POST", "url": "/v1/responses", "body": {"input": "x", "background": True}},
        400,
        "background",
    ),
}
ORDER = ["chat", "embeddings", "two-prompts", "get", "no-messages", "score", "too-long"]
ORDER += ["other-model", "streamed", "json", "responses", "background"]


def _line(custom_id: str) -> dict:
    if custom_id in GOOD:
        url, body = GOOD[custom_id]
        return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}
    return {"custom_id": custom_id, **BAD[custom_id][0]}


def _compiling() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("dsakv-grammar")}


@pytest.fixture(scope="module")
def run(glm_tiny, tmp_path_factory) -> tuple[list[dict], set[threading.Thread]]:
    """The output lines of `ORDER`'s lines run by `dsakv run-batch` (blank lines between),
    over an output file an earlier run left, and the grammar compile threads it left."""
    folder = tmp_path_factory.mktemp("run_batch")
    source, out = folder / "in.jsonl", folder / "out.jsonl"
    source.write_text("\n\n".join(json.dumps(_line(x)) for x in ORDER) + "\n")
    out.write_text("".join(json.dumps(_line("chat")) + "\n" for _ in range(20)))
    before = _compiling()
    assert main(["run-batch", glm_tiny, "-i", str(source), "-o", str(out), *FLAGS]) == 0
    return [json.loads(x) for x in out.read_text().splitlines()], _compiling() - before


@pytest.fixture(scope="module")
def ran(run) -> list[dict]:
    return run[0]


@pytest.fixture(scope="module")
def served(glm_tiny):
    with serving(cli_config("serve", glm_tiny, *FLAGS)) as served:
        yield served


def test_each_answer_is_the_servers_for_the_same_body(ran, served):
    base, _ = served
    assert [x["custom_id"] for x in ran] == ORDER
    for line in ran:
        if line["custom_id"] not in GOOD:
            continue
        url, body = GOOD[line["custom_id"]]
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["id"].startswith("batch_req_") and line["response"]["request_id"]
        direct = httpx.post(f"{base}{url}", json=body, timeout=TIMEOUT)
        assert direct.status_code == 200, direct.text
        assert answer_of(line["response"]["body"]) == answer_of(direct.json())
    chat = ran[0]["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] == 6
    assert chat["id"] == f"chatcmpl-{ran[0]['response']['request_id']}"
    assert len(ran[2]["response"]["body"]["choices"]) == 2  # (both prompts of one line)


def test_a_bad_line_is_its_own_error_line(ran, served):
    base, _ = served
    for line in ran:
        if line["custom_id"] not in BAD:
            continue
        _, status, param = BAD[line["custom_id"]]
        assert line["response"]["status_code"] == status, line
        assert line["response"]["body"] is None
        assert line["error"]["param"] == param and line["error"]["message"], line
    # a route's own refusal reads as the server's answer to it
    too_long = next(x for x in ran if x["custom_id"] == "too-long")
    direct = httpx.post(f"{base}/v1/completions", json=BAD["too-long"][0]["body"], timeout=TIMEOUT)
    assert direct.status_code == 400 and too_long["error"] == direct.json()["error"]


@pytest.mark.parametrize(
    "text, said",
    [
        (None, "cannot read"),
        ('{"custom_id": "a"}\nnot json\n', "line 2 is not JSON"),
        ('{"custom_id": "a"}\n[1, 2]\n', "line 2 is not a JSON object"),
        ('{"url": "/v1/completions", "body": {}}\n', "line 1: custom_id must be a string"),
        (b"\xff\xfe", "not UTF-8"),
    ],
)
def test_a_bad_file_is_one_error_line_and_exit_2(tmp_path: Path, capsys, text, said):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    if isinstance(text, str):
        source.write_text(text)
    elif text is not None:
        source.write_bytes(text)
    error = cli_error_line(["run-batch", "-i", str(source), "-o", str(out), *FLAGS], capsys)
    assert said in error and str(source) in error
    assert not out.exists()  # (refused before anything was written)


def test_the_run_leaves_no_grammar_compile_thread(run):
    """The app's lifespan never ran (the server is never started), so the grammar compile
    threads its json line used outlived the run, as a stopped server's did."""
    assert not run[1]


def test_a_run_that_fails_keeps_the_output_it_would_replace(glm_tiny, tmp_path, capsys):
    """The output file was emptied as the run began: a run failing after (an engine that
    cannot load, a Ctrl-C) lost the answers an earlier run had written there."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps(_line("chat")) + "\n")
    out.write_text('{"earlier": "answers"}\n')
    argv = ["run-batch", glm_tiny, "-i", str(source), "-o", str(out), *FLAGS]
    error = cli_error_line([*argv, "--num-pages", str(2**40)], capsys)  # (a pool past the host)
    assert "cannot allocate" in error
    assert out.read_text() == '{"earlier": "answers"}\n'
    # Nor does it leave a file where none was (it created an empty one), or a temporary.
    fresh = tmp_path / "fresh.jsonl"
    argv[argv.index(str(out))] = str(fresh)
    cli_error_line([*argv, "--num-pages", str(2**40)], capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


def test_bad_flags_and_an_unwritable_output_exit_2(tmp_path: Path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps(_line("chat")) + "\n")
    error = cli_error_line(["run-batch", "-o", str(tmp_path / "out.jsonl"), *FLAGS], capsys)
    assert "-i/--input-file" in error
    missing = tmp_path / "no" / "out.jsonl"
    error = cli_error_line(["run-batch", "-i", str(source), "-o", str(missing), *FLAGS], capsys)
    assert error.startswith(f"error: cannot write {missing}")
