"""OpenAI's Batch API on `dsakv serve` (`dsakv.server.batch`), driven by the `openai` client:
files uploaded, listed, read and deleted; a batch validated, run through the server's routes
(each answer the route's own for that body), its output and error files; cancel; a bad file
failing the batch; the upload bound; the API key. (Through `dsakv router`:
`test_router_batches`.)"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from fastapi import FastAPI

from dsakv.procs import free_port
from dsakv.server import batch as batch_module
from dsakv.server import make_server
from dsakv.server.app import _endpoint
from dsakv.server.batch import BatchLine, BatchRunner
from dsakv.server.handlers import Handlers

from .conftest import cli_config
from .serving import (
    TIMEOUT,
    answer_of,
    batch_lines,
    batch_until,
    engine_stops_stepping_at,
    running,
    serving,
)

KEY = "batch-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
FLAGS = ["--kv-cache-dtype", "fp32", "--index-k-dtype", "fp32", "--num-pages", "64"]
FLAGS += ["--page-size", "16", "--device", "cpu", "--max-running-requests", "2"]
GREEDY = {"temperature": 0, "ignore_eos": True}


def _chat(text: str, max_tokens: int = 5) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, **GREEDY}


def _jsonl(lines: list[tuple[str, str, dict]]) -> bytes:
    rows = [{"custom_id": c, "method": "POST", "url": u, "body": b} for c, u, b in lines]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


@pytest.fixture(scope="module")
def served(glm_tiny):
    with serving(cli_config("serve", glm_tiny, *FLAGS), api_key=KEY) as served:
        yield served


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    base, _ = served
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)


def _upload(client: openai.OpenAI, data: bytes, name: str = "batch.jsonl"):
    return client.files.create(file=(name, data), purpose="batch")


def _window_timers(monkeypatch) -> dict[str, SimpleNamespace]:
    """Each batch's window timer (`_at`'s, a day away), by batch id: its `handle`, and
    `fire()`, which ends the window now (on the server's loop, as the timer would), so a
    test waits for no clock."""
    timers: dict[str, SimpleNamespace] = {}
    at = batch_module._at

    def scheduled(when, callback, *args):
        handle = at(when, callback, *args)
        if getattr(callback, "__func__", None) is batch_module.Batches._expire:
            loop = asyncio.get_running_loop()
            fire = lambda: loop.call_soon_threadsafe(callback, *args)  # noqa: E731
            timers[args[0].info["id"]] = SimpleNamespace(handle=handle, fire=fire)
        return handle

    monkeypatch.setattr(batch_module, "_at", scheduled)
    return timers


def _usage_of(out: list[dict]) -> dict:
    """OpenAI's BatchUsage summed over output lines, each answer's usage in its route's
    names (the Responses API's input/output_tokens, chat's and completions'
    prompt/completion_tokens, either's details null or absent where none)."""
    total = {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0},
             "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": 0}  # fmt: skip
    for line in out:
        u = line["response"]["body"]["usage"]
        responses = "input_tokens" in u
        ins, outs = ("input", "output") if responses else ("prompt", "completion")
        total["input_tokens"] += u[f"{ins}_tokens"]
        total["output_tokens"] += u[f"{outs}_tokens"]
        total["total_tokens"] += u["total_tokens"]
        details = u.get(f"{ins}_tokens_details") or {}
        total["input_tokens_details"]["cached_tokens"] += details.get("cached_tokens", 0)
        details = u.get(f"{outs}_tokens_details") or {}
        total["output_tokens_details"]["reasoning_tokens"] += details.get("reasoning_tokens", 0)
    return total


def test_files_then_a_batch_then_its_output(client, served):
    base, _ = served
    lines = [
        ("a", "/v1/chat/completions", _chat("Hi there")),
        ("b", "/v1/chat/completions", _chat("Bye", 3)),
    ]
    data = _jsonl(lines)
    up = _upload(client, data)
    assert (up.object, up.purpose, up.bytes, up.filename) == (
        "file",
        "batch",
        len(data),
        "batch.jsonl",
    )
    assert client.files.retrieve(up.id) == up
    assert up.id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.content(up.id).content == data

    created = client.batches.create(
        input_file_id=up.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "test"},
    )
    assert created.status == "validating" and created.metadata == {"job": "test"}
    done = batch_until(client, created.id, "completed", "failed")
    assert done.status == "completed", done.errors
    assert done.request_counts.model_dump() == {"total": 2, "completed": 2, "failed": 0}
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    assert done.error_file_id is None and done.output_file_id
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    out = batch_lines(client, done.output_file_id)
    assert [x["custom_id"] for x in out] == ["a", "b"]
    assert done.usage.model_dump() == _usage_of(out)
    for line, (_, url, body) in zip(out, lines):
        direct = httpx.post(f"{base}{url}", json=body, headers=AUTH, timeout=TIMEOUT)
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert answer_of(line["response"]["body"]) == answer_of(direct.json())

    assert created.id in [b.id for b in client.batches.list()]
    with pytest.raises(openai.ConflictError):  # (only a batch still running can be)
        client.batches.cancel(created.id)
    deleted = client.files.delete(up.id)
    assert deleted.deleted and deleted.id == up.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(up.id)
    assert client.batches.retrieve(created.id).status == "completed"  # (it read the file)


@pytest.mark.parametrize(
    "url, bodies",
    [
        (
            "/v1/completions",
            [
                {"prompt": ["The cat", "A dog"], "max_tokens": 3, **GREEDY},
                {"prompt": "The cat", "max_tokens": 4, **GREEDY},
            ],
        ),
        (
            "/v1/responses",
            [
                {"input": "Hi there", "max_output_tokens": 16, "temperature": 0},
                {"input": "Hi there", "max_output_tokens": 16, "temperature": 0},
            ],
        ),
    ],
)
def test_a_batchs_usage_sums_its_answers(client, served, url, bodies):
    """The Batch object's `usage` (OpenAI's BatchUsage) is its answers' summed, whatever
    each route names them (it was absent: None)."""
    lines = [(str(i), url, b) for i, b in enumerate(bodies)]
    created = client.batches.create(
        input_file_id=_upload(client, _jsonl(lines)).id, endpoint=url, completion_window="24h"
    )
    assert created.usage.total_tokens == 0
    done = batch_until(client, created.id, "completed", "failed")
    assert done.status == "completed" and done.request_counts.completed == 2, done
    out = batch_lines(client, done.output_file_id)
    usage = done.usage.model_dump()
    assert usage == _usage_of(out)
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    if url == "/v1/completions":  # (against figures of its own: /tokenize's, max_tokens')
        base, _ = served
        prompts = ["The cat", "A dog", "The cat"]
        counts = [
            httpx.post(f"{base}/tokenize", json={"prompt": p}, headers=AUTH, timeout=TIMEOUT)
            for p in prompts
        ]
        assert usage["input_tokens"] == sum(r.json()["count"] for r in counts)
        assert usage["output_tokens"] == 3 + 3 + 4  # (ignore_eos: each its max_tokens)


def test_a_bad_line_goes_to_the_error_file(client):
    lines = [
        ("good", "/v1/chat/completions", _chat("Hello")),
        ("no-messages", "/v1/chat/completions", {"max_tokens": 2}),
    ]
    data = _jsonl(lines) + json.dumps({"custom_id": "get", "method": "GET",
                                       "url": "/v1/chat/completions"}).encode()  # fmt: skip
    created = client.batches.create(
        input_file_id=_upload(client, data).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    done = batch_until(client, created.id, "completed", "failed")
    assert done.status == "completed"
    assert done.request_counts.model_dump() == {"total": 3, "completed": 1, "failed": 2}
    out = batch_lines(client, done.output_file_id)
    assert [x["custom_id"] for x in out] == ["good"]
    assert done.usage.model_dump() == _usage_of(out)  # (the answers' only)
    errors = batch_lines(client, done.error_file_id)
    assert [x["custom_id"] for x in errors] == ["no-messages", "get"]
    assert [x["response"]["status_code"] for x in errors] == [400, 400]
    assert [x["error"]["param"] for x in errors] == ["messages", "method"]


_COMPLETION = ("/v1/completions", {"prompt": "x", "max_tokens": 1})


@pytest.mark.parametrize(
    "data, code, line, param",
    [
        (b"", "empty_file", None, None),
        (b'{"custom_id": "a"}\n{oops\n', "invalid_json_line", 2, None),
        # checks of the file as a whole, as OpenAI's: each was run, its line answered alone
        (
            _jsonl([("a", *_COMPLETION), ("b", "/v1/chat/completions", _chat("x"))]),
            "url_mismatch",
            2,
            "url",
        ),
        (
            b"\n" + _jsonl([("a", *_COMPLETION), ("a", *_COMPLETION)]),
            "duplicate_custom_id",
            3,
            "custom_id",
        ),
        (_jsonl([(c, *_COMPLETION) for c in "abcd"]), "too_many_tasks", None, None),
        # no JSON text (a lone surrogate, NaN), as a request's body is not: the custom_id
        # "\ud800" was run, and its output file could not be written (a 500 on every read
        # of the batches after); the NaN sent as the request's, JSON it is not either
        (
            b'{"custom_id": "\\ud800", "method": "POST", "url": "/v1/completions", '
            b'"body": {"prompt": "x", "max_tokens": 1}}\n',
            "invalid_json_line",
            1,
            None,
        ),
        (
            b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
            b'"body": {"prompt": "x", "max_tokens": 1, "temperature": NaN}}\n',
            "invalid_json_line",
            1,
            None,
        ),
    ],
)
def test_a_bad_file_fails_its_batch(client, monkeypatch, data, code, line, param):
    monkeypatch.setattr(batch_module, "MAX_REQUESTS", 3)  # (not 50,000 lines)
    done = _failed_batch(client, data)
    assert done.request_counts.total == 0
    (error,) = done.errors.data
    assert (error.code, error.line, error.param) == (code, line, param) and error.message


def test_cancel_aborts_the_requests_in_flight(client, served):
    base, async_engine = served
    lines = [(c, "/v1/completions", {"prompt": c, "max_tokens": 200, **GREEDY}) for c in "xy"]
    file_id = _upload(client, _jsonl(lines)).id
    with engine_stops_stepping_at(async_engine, 2):  # (they can only end by an abort)
        created = client.batches.create(
            input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
        )
        deadline = time.monotonic() + TIMEOUT
        while httpx.get(f"{base}/load", timeout=TIMEOUT).json()["server_load"] < 2:
            assert time.monotonic() < deadline, client.batches.retrieve(created.id)
            time.sleep(0.05)
        cancelling = client.batches.cancel(created.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at
        done = batch_until(client, created.id, "cancelled")
    assert done.cancelled_at and done.output_file_id is None
    errors = batch_lines(client, done.error_file_id)
    assert [x["custom_id"] for x in errors] == ["x", "y"]
    assert {x["error"]["code"] for x in errors} == {"batch_cancelled"}
    # (the counts add up to the files: a cancelled line failed, as its error line says)
    assert done.request_counts.model_dump() == {"total": 2, "completed": 0, "failed": 2}
    assert client.batches.cancel(created.id).status == "cancelled"
    assert httpx.get(f"{base}/load", timeout=TIMEOUT).json()["server_load"] == 0


def test_a_batch_keeps_only_what_the_engine_runs_in_flight(client, served):
    """A batch's requests were all submitted at once: a request sent meanwhile queued behind
    the whole file (a 1,500-line batch held one back until 1,479 had ended). Now as many are
    in flight as the engine runs at once (--max-running-requests 2 here): once those two
    hold (the engine stepping them no further), the third is not sent."""
    base, async_engine = served
    lines = [(c, "/v1/completions", {"prompt": c, "max_tokens": 200, **GREEDY}) for c in "xyz"]
    file_id = _upload(client, _jsonl(lines)).id

    def held() -> bool:  # (two in the engine, each stepped as far as it will be)
        def look(engine) -> bool:
            reqs = list(engine.requests.values())
            return len(reqs) == 2 and all(len(r.output_ids) >= 2 for r in reqs)

        load = httpx.get(f"{base}/load", timeout=TIMEOUT).json()["server_load"]
        return load == 2 and asyncio.run(async_engine.call(look))

    with engine_stops_stepping_at(async_engine, 2):
        created = client.batches.create(
            input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
        )
        deadline = time.monotonic() + TIMEOUT
        while not held():
            assert time.monotonic() < deadline, client.batches.retrieve(created.id)
            time.sleep(0.05)
        assert client.batches.retrieve(created.id).request_counts.completed == 0
        client.batches.cancel(created.id)
        done = batch_until(client, created.id, "cancelled")
    errors = batch_lines(client, done.error_file_id)
    assert [x["custom_id"] for x in errors] == ["x", "y", "z"]  # (z never sent: cancelled too)
    assert {x["error"]["code"] for x in errors} == {"batch_cancelled"}
    assert done.request_counts.model_dump() == {"total": 3, "completed": 0, "failed": 3}


def test_what_a_batch_is_refused(client):
    file_id = _upload(client, _jsonl([("a", "/v1/completions", {"prompt": "x"})])).id
    for endpoint, window, param in [
        ("/v1/embeddings", "24h", "endpoint"),
        ("/v1/completions", "1h", "completion_window"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.batches.create(
                input_file_id=file_id, endpoint=endpoint, completion_window=window
            )
        assert e.value.param == param
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h"
        )
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert e.value.param == "purpose"


def test_openais_bounds_on_what_a_batch_and_a_file_are_given(client):
    """`metadata` (16 pairs at most, keys of 64 characters, values of 512, strings), a
    batch's `output_expires_after` and a file's `expires_after` (anchored at `created_at`,
    an hour to 30 days) are 400s as OpenAI's, naming the field (metadata was taken
    whatever its size, the expiries ignored)."""
    file_id = _upload(client, _jsonl([("a", *_COMPLETION)])).id
    bad = [
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"metadata": {"k": 1}}, "metadata"),
        (
            {"output_expires_after": {"anchor": "now", "seconds": 3600}},
            "output_expires_after.anchor",
        ),
        (
            {"output_expires_after": {"anchor": "created_at", "seconds": 60}},
            "output_expires_after.seconds",
        ),
        (
            {"output_expires_after": {"anchor": "created_at", "seconds": 2_592_001}},
            "output_expires_after.seconds",
        ),
        (  # (an integer, as OpenAI types it: only an upload's form fields are strings)
            {"output_expires_after": {"anchor": "created_at", "seconds": "3600"}},
            "output_expires_after.seconds",
        ),
    ]
    for kw, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.batches.create(
                input_file_id=file_id, endpoint="/v1/completions", completion_window="24h", **kw
            )
        assert e.value.param == param, kw
    most = {f"k{i:063}": "v" * 512 for i in range(16)}  # (the bounds themselves are taken)
    assert {len(k) for k in most} == {64}
    created = client.batches.create(
        input_file_id=file_id, endpoint="/v1/completions", completion_window="24h",
        metadata=most, output_expires_after={"anchor": "created_at", "seconds": 2_592_000},
    )  # fmt: skip
    assert created.metadata == most
    done = batch_until(client, created.id, "completed", "failed")
    output = client.files.retrieve(done.output_file_id)
    assert output.expires_at == output.created_at + 2_592_000
    for expires, param in [
        ({"anchor": "last_active_at", "seconds": 3600}, "expires_after.anchor"),
        ({"anchor": "created_at", "seconds": 3599}, "expires_after.seconds"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.files.create(file=("x.jsonl", b"{}\n"), purpose="batch", expires_after=expires)
        assert e.value.param == param


def test_metadata_no_answer_could_quote_is_refused_not_stored(client, served):
    """A lone surrogate is no JSON text: a batch whose metadata holds one is refused as the
    body arrives (it was created, then every GET /v1/batches a 500)."""
    base = served[0]
    file_id = _upload(client, _jsonl([("a", *_COMPLETION)])).id
    raw = (
        b'{"input_file_id": "%s", "endpoint": "/v1/completions", "completion_window": "24h", '
        b'"metadata": {"k": "\\ud800"}}' % file_id.encode()
    )
    headers = {**AUTH, "content-type": "application/json"}
    r = httpx.post(f"{base}/v1/batches", content=raw, headers=headers, timeout=TIMEOUT)
    assert r.status_code == 400 and "lone surrogate" in r.json()["error"]["message"], r.text
    listed = httpx.get(f"{base}/v1/batches", headers=AUTH, timeout=TIMEOUT)
    assert listed.status_code == 200, listed.text


def test_files_expire_as_their_expires_after_says(client, monkeypatch):
    """A file's `expires_after`, and a batch's `output_expires_after` for its output and
    error files, set their `expires_at` (the client's were ignored: None); then the file is
    gone (listed, read, run), whether or not anyone looked at it meanwhile."""
    monkeypatch.setattr(batch_module, "EXPIRES_MIN_S", 1)  # (not an hour's wait)
    second = {"anchor": "created_at", "seconds": 1}
    up = client.files.create(file=("x.jsonl", _jsonl([("a", *_COMPLETION)])), purpose="batch",
                             expires_after=second)  # fmt: skip
    assert up.expires_at == up.created_at + 1
    created = client.batches.create(
        input_file_id=_upload(client, _jsonl([("a", *_COMPLETION)])).id,
        endpoint="/v1/completions", completion_window="24h", output_expires_after=second,
    )  # fmt: skip
    done = batch_until(client, created.id, "completed", "failed")
    kept = _upload(client, b"{}\n")  # (no expires_after: kept until deleted)
    assert kept.expires_at is None and done.output_file_id
    deadline = time.monotonic() + TIMEOUT
    while {up.id, done.output_file_id} & {f.id for f in client.files.list()}:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(openai.NotFoundError):
        client.files.content(up.id)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(done.output_file_id)
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id=up.id, endpoint="/v1/completions", completion_window="24h"
        )
    assert client.files.retrieve(kept.id) == kept
    assert client.batches.retrieve(created.id).status == "completed"  # (the batch stays)


def test_a_batch_unfinished_past_its_window_expires(client, served, monkeypatch):
    """OpenAI's `expired`: a batch still running as its window ends is stopped then, read or
    not (its requests in flight aborted, the rest never sent), its answers so far in its
    output file, their usage its own, and an error line `batch_expired` for each other (it
    ran on until next read: unread, for good). The window's end is its timer's callback,
    fired here at once (the batch's `expires_at` is a day away)."""
    base, async_engine = served
    timers = _window_timers(monkeypatch)
    lines = [("a", "/v1/completions", {"prompt": "a", "max_tokens": 1, **GREEDY})]
    lines += [(c, "/v1/completions", {"prompt": c, "max_tokens": 200, **GREEDY}) for c in "xy"]
    with engine_stops_stepping_at(async_engine, 2):  # (x and y can only end by an abort)
        created = client.batches.create(
            input_file_id=_upload(client, _jsonl(lines)).id,
            endpoint="/v1/completions",
            completion_window="24h",
        )
        assert created.expires_at == created.created_at + 24 * 3600
        deadline = time.monotonic() + TIMEOUT  # (a answered, x and y held in the engine)
        while (
            client.batches.retrieve(created.id).request_counts.completed < 1
            or httpx.get(f"{base}/load", timeout=TIMEOUT).json()["server_load"] < 2
        ):
            assert time.monotonic() < deadline, client.batches.retrieve(created.id)
            time.sleep(0.05)
        timers[created.id].fire()
        done = batch_until(client, created.id, "expired", "completed", "cancelled", "failed")
        assert client.batches.cancel(created.id).status == "expired"  # (too late to cancel)
    assert done.status == "expired" and done.expired_at and done.cancelled_at is None
    out, errors = batch_lines(client, done.output_file_id), batch_lines(client, done.error_file_id)
    assert [x["custom_id"] for x in out] == ["a"]
    assert [x["custom_id"] for x in errors] == ["x", "y"]
    assert {x["error"]["code"] for x in errors} == {"batch_expired"}
    assert done.request_counts.model_dump() == {"total": 3, "completed": 1, "failed": 2}
    assert done.usage.model_dump() == _usage_of(out)
    assert httpx.get(f"{base}/load", timeout=TIMEOUT).json()["server_load"] == 0
    assert timers[created.id].handle.cancelled()  # (its run ended: the timer with it)


@pytest.mark.parametrize("bug", [False, True])
def test_a_batch_failing_validation_fails_and_drops_its_timer(client, monkeypatch, bug):
    """A batch whose validation fails is `failed`, and its window's timer is cancelled:
    that of a bad file's batch (`BatchFileError`) was left to run out (a day, holding the
    batch), and a bug in the checks (any other error) left the batch `validating`. A bug
    fails it as a bug in its run does: `server_error`."""
    timers = _window_timers(monkeypatch)
    data = _jsonl([("a", *_COMPLETION)]) if bug else b""
    if bug:

        def check_batch(lines, endpoint):
            raise RuntimeError("a bug in the checks")

        monkeypatch.setattr(batch_module, "check_batch", check_batch)
    done = _failed_batch(client, data)
    (error,) = done.errors.data
    expected = ("server_error", "a bug in the checks") if bug else ("empty_file", error.message)
    assert (error.code, error.message) == expected
    assert timers[done.id].handle.cancelled()


def _failed_batch(client, data: bytes):
    """The batch of a completions file `data`, once it ended: failed, with no output."""
    created = client.batches.create(
        input_file_id=_upload(client, data).id,
        endpoint="/v1/completions",
        completion_window="24h",
    )
    done = batch_until(client, created.id, "failed", "completed")
    assert done.status == "failed" and done.failed_at and done.output_file_id is None
    return done


def test_a_batch_whose_window_ends_as_its_last_line_does_completes():
    """A window that ends as a batch's last line is answered (its timer firing as the run
    ends) leaves no line unanswered: the batch is `completed`, not `expired` (it was
    `expired`, every line in its output file)."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: dict) -> dict:
        return {"object": "text_completion", "usage": {"prompt_tokens": 1, "total_tokens": 1}}

    class EndsAtTheWindow(BatchRunner):
        async def run(self, *args, **kwargs):
            results = await super().run(*args, **kwargs)
            for batch in store.batches.values():  # (the window ends now)
                store._expire(batch)
            return results

    store = batch_module.Batches(EndsAtTheWindow(app), "m", 2)

    async def ran() -> dict:
        data = _jsonl([("a", *_COMPLETION), ("b", *_COMPLETION)])
        file_id = store.add_file(data, "in.jsonl", "batch")["id"]
        body = batch_module.BatchCreateRequest(
            input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
        )
        info = store.create(body, {})
        await store.batches[info["id"]].task
        return info

    info = asyncio.run(ran())
    assert store.batches[info["id"]].expired  # (its window did end)
    assert info["status"] == "completed" and info["expired_at"] is None
    assert info["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    assert info["output_file_id"] and info["error_file_id"] is None


def test_an_upload_past_the_bound_is_a_413(client, served, monkeypatch):
    base, _ = served
    monkeypatch.setattr(batch_module, "MAX_FILE_BYTES", 1000)
    assert _upload(client, b"x" * 1000).bytes == 1000
    for size in (1001, 200_000):  # (the second refused by its Content-Length)
        with pytest.raises(openai.APIStatusError) as e:
            _upload(client, b"x" * size)
        assert e.value.status_code == 413
        assert e.value.response.json()["error"]["code"] == "file_too_large"

    def chunked():  # (no Content-Length: refused once that much came)
        yield b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--B\r\n'
        yield b'Content-Disposition: form-data; name="file"; filename="x"\r\n\r\n'
        yield from (b"x" * 10_000 for _ in range(10))
        yield b"\r\n--B--\r\n"

    headers = {**AUTH, "Content-Type": "multipart/form-data; boundary=B"}
    r = httpx.post(f"{base}/v1/files", content=chunked(), headers=headers, timeout=TIMEOUT)
    assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large"


def test_uploads_past_the_servers_file_bound_are_a_413(client, monkeypatch):
    """Files are kept in memory until deleted: uploads were bounded one by one only, so a
    server taking uploads (and keeping each batch's output) grew without end."""
    held = sum(f.bytes for f in client.files.list())
    monkeypatch.setattr(batch_module, "MAX_STORED_BYTES", held + 1500)
    first = _upload(client, b"x" * 1000)
    with pytest.raises(openai.APIStatusError) as e:
        _upload(client, b"x" * 1000)
    assert e.value.status_code == 413
    error = e.value.response.json()["error"]
    assert error["code"] == "storage_limit_exceeded" and "DELETE /v1/files" in error["message"]
    client.files.delete(first.id)  # (room again)
    assert _upload(client, b"x" * 1000).bytes == 1000


def test_the_routes_need_the_api_key(client, served):
    base, _ = served
    keyless = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", timeout=TIMEOUT, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        _upload(keyless, b"{}\n")
    with pytest.raises(openai.AuthenticationError):
        keyless.batches.list()
    file_id = _upload(client, b"{}\n").id  # (with it: served)
    for path in (f"/v1/files/{file_id}", f"/v1/files/{file_id}/content", "/v1/batches"):
        assert httpx.get(f"{base}{path}", timeout=TIMEOUT).status_code == 401
        assert httpx.get(f"{base}{path}", headers=AUTH, timeout=TIMEOUT).status_code == 200


def test_a_stopping_server_ends_its_batches_before_the_grammar_threads(glm_tiny, monkeypatch):
    """A batch still running when its server stopped ran on past the app's end (the stop's
    abort reaches the requests in flight, then the batch sent its next lines), and its
    lifespan closed the grammar compile threads under them. Now it cancels the batch
    first (its requests aborted), then closes them."""
    config = cli_config("serve", glm_tiny, *FLAGS)
    server, async_engine = make_server(config, port=free_port(), log_level="warning")
    batches = server.config.app.state.batches
    seen: list[list[bool]] = []  # each batch's run ended, as the threads are closed
    close = Handlers.close

    async def closing(self: Handlers) -> None:
        seen.append([b.task.cancelled() for b in batches.batches.values()])
        await close(self)

    monkeypatch.setattr(Handlers, "close", closing)
    lines = [(c, "/v1/completions", {"prompt": c, "max_tokens": 200, **GREEDY}) for c in "xyz"]
    try:
        with engine_stops_stepping_at(async_engine, 2), running(server) as base:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="-", timeout=TIMEOUT)
            file_id = _upload(client, _jsonl(lines)).id
            client.batches.create(
                input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
            )
            deadline = time.monotonic() + TIMEOUT
            while httpx.get(f"{base}/load", timeout=TIMEOUT).json()["server_load"] < 2:
                assert time.monotonic() < deadline  # (z waits: --max-running-requests 2)
                time.sleep(0.05)
            client.close()
    finally:
        async_engine.shutdown()
        async_engine.close_engine()
    assert seen == [[True]]


def test_metrics_name_each_route_once():
    assert _endpoint("/v1/files/file-1/content") == "/v1/files/{file_id}/content"
    assert _endpoint("/v1/batches/batch_1") == "/v1/batches/{batch_id}"
    assert _endpoint("/v1/batches/batch_1/cancel") == "/v1/batches/{batch_id}/cancel"
    assert _endpoint("/v1/batches/batch_1/other") == "other"


def test_a_bug_in_a_batchs_run_is_raised_not_a_completed_batch():
    """A line's run failing (a bug; here `done`, which counts each line's outcome) stops
    the others and is raised, so that the batch fails as a bug's (`Batches._run`): it was
    swallowed, and the batch completed, the lines it never ran said to be cancelled."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: dict) -> dict:
        if body.get("held"):
            await asyncio.Event().wait()  # (until the run stops it)
        return {"object": "text_completion"}

    def done(i: int, record: dict) -> None:
        raise KeyError(f"a bug, at line {i}")

    bodies = [{}, {"held": True}, {}]
    lines = [BatchLine(str(i), "POST", "/v1/completions", b) for i, b in enumerate(bodies)]
    with pytest.raises(KeyError, match="a bug, at line 0"):
        asyncio.run(BatchRunner(app).run(lines, done=done, window=2))
