"""OpenAI's Batch workflow over an app's own routes: a JSONL file of requests (`{"custom_id",
"method", "url", "body"}` a line) run all at once, so that the engine batches them, each line
sent to the route its `url` names as a client's request (`BatchRunner`: in-process, over
ASGI), answered in vLLM's `run-batch` output lines (`{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}`, in input order). `dsakv run-batch` runs a
file offline through a server's app; a server, and `dsakv router` (whose routes relay each
line to a prefill and a decode server), keep uploaded files and run batches of them in their
event loop (`add_batch_routes`: `/v1/files` and `/v1/batches`, as OpenAI's client drives
them), as many of a batch's requests at once as the engine runs (the router: as its decode
servers run together), so that the requests of other clients do not wait for the whole
batch.

Files are kept in memory until deleted, their `expires_at` or the server stops: a batch's
input is read whole to be validated and its output written whole at its end, so a temp dir
would hold the same bytes twice and leave them behind a killed server; an upload past
`MAX_FILE_BYTES` (OpenAI's batch input limit) is refused as it arrives (413), and one past
`MAX_STORED_BYTES` in all (413: delete files, or give them an `expires_after`, to make
room)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict
from starlette.datastructures import UploadFile

from dsakv.errors import DsakvError, load_json

from .auth import key_headers
from .protocol import APIError, check_metadata, error_body, list_page, new_id

log = logging.getLogger(__name__)

# The routes a batch line may name (vLLM's run-batch takes chat and /score, OpenAI's Batch
# API chat, completions and responses); every one answers whole JSON.
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/score")
MAX_FILE_BYTES = 200 * 2**20  # one upload (OpenAI's limit on a batch's input file)
# All the files a server keeps (in memory, until deleted or expired): an upload past it is
# refused; a batch's output and error files are written whatever it holds (and count).
MAX_STORED_BYTES = 10 * MAX_FILE_BYTES
_FORM_SLACK = 64 * 2**10  # the multipart framing and the form's other fields
COMPLETION_WINDOW = "24h"  # (the only one OpenAI takes)
_WINDOW_S = 24 * 3600
MAX_REQUESTS = 50_000  # a batch file's requests at most (OpenAI's)
# A file's `expires_after` (and a batch's `output_expires_after`): seconds, as OpenAI takes them
EXPIRES_MIN_S = 3600
EXPIRES_MAX_S = 30 * 24 * 3600
_MODEL_ASK_S = 10.0  # a batch's wait for its model (`BatchRunner.model`), as the router's asks
# A batch's requests in flight at most (`BatchRunner.run`), or how to learn it as it starts
# (the router asks its decode servers then: they may come and go).
Window = int | Callable[[], Awaitable[int]]


class BatchFileError(DsakvError):
    """A batch file that cannot be run at all (not UTF-8, a line not a JSON object, one
    without its custom_id; on a server, `check_batch`'s): `dsakv run-batch` exits 2, a
    server's batch fails with it (OpenAI's `errors`: `code`, the 1-based `line` and the
    `param` where it names one)."""

    def __init__(
        self, message: str, code: str, line: int | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.code, self.line, self.param = code, line, param

    def as_error(self) -> dict[str, Any]:
        return {"code": self.code, "message": str(self), "param": self.param, "line": self.line}


@dataclass(frozen=True)
class BatchLine:
    """One request of a batch file, as given: only `custom_id` is checked here (the rest is
    the request's own error line: `BatchRunner.run_line`)."""

    custom_id: str
    method: Any
    url: Any
    body: Any
    number: int = 0  # its line in the file (1-based), which a server batch's `errors` name


def parse_batch(data: bytes | str) -> list[BatchLine]:
    """A batch file's requests (blank lines skipped, as vLLM's); `BatchFileError` where the
    file itself is bad. Lines end at "\\n" only: a JSON string may hold U+2028."""
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BatchFileError(f"the file is not UTF-8 text ({e})", "invalid_file") from None
    lines = []
    for number, text in enumerate(data.split("\n"), 1):
        if not text.strip():
            continue
        try:
            obj = load_json(text, f"line {number} is not JSON", strict=True)  # (a request)
        except DsakvError as e:
            raise BatchFileError(str(e), "invalid_json_line", number) from None
        if not isinstance(obj, dict):
            raise BatchFileError(f"line {number} is not a JSON object", "invalid_json_line", number)
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str):
            got = "none" if custom_id is None else f"{custom_id!r}"
            message = f"line {number}: custom_id must be a string, got {got}"
            raise BatchFileError(message, "missing_custom_id", number)
        lines.append(
            BatchLine(custom_id, obj.get("method"), obj.get("url"), obj.get("body"), number)
        )
    return lines


def check_batch(lines: Sequence[BatchLine], endpoint: str) -> None:
    """The checks of a server batch's file as a whole, as OpenAI's, which fail the batch
    (`BatchFileError`) rather than a line: some requests, `MAX_REQUESTS` at most, each to
    the batch's `endpoint`, each `custom_id` once (its output lines are found by it). (The
    codes `too_many_tasks` and `url_mismatch` are this server's: OpenAI's are not known here.)"""
    if not lines:
        raise BatchFileError("the input file holds no requests", "empty_file")
    if len(lines) > MAX_REQUESTS:
        message = f"the input file holds {len(lines)} requests, {MAX_REQUESTS} at most"
        raise BatchFileError(message, "too_many_tasks")
    seen: set[str] = set()
    for line in lines:
        if line.url != endpoint:
            message = (
                f"line {line.number}: url {line.url!r} is not the batch's endpoint {endpoint!r}"
            )
            raise BatchFileError(message, "url_mismatch", line.number, "url")
        if line.custom_id in seen:
            message = (
                f"line {line.number}: custom_id {line.custom_id!r} is a duplicate (each must "
                "be unique in a batch)"
            )
            raise BatchFileError(message, "duplicate_custom_id", line.number, "custom_id")
        seen.add(line.custom_id)


def read_batch_file(path: str) -> list[BatchLine]:
    """`parse_batch` of the file at `path` (`dsakv run-batch -i`), a DsakvError naming it."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise DsakvError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        return parse_batch(data)
    except BatchFileError as e:
        raise DsakvError(f"{path}: {e}") from None


def succeeded(record: dict[str, Any]) -> bool:
    """Whether an output line is a request's answer (OpenAI's output file) rather than an
    error (its error file)."""
    return record["error"] is None


class BatchRunner:
    """Runs batch lines as requests to `app`'s routes (`BATCH_URLS`): each handed to the app
    as its server hands it a client's request (ASGI, in-process), through its middleware,
    routing and validation, so that its answer is the one that route gives a client (its
    400s, a 404 for a model not served, a 401 without the batch's creator's key, `headers`),
    whatever the route does with it: a server's runs it, the router's relays it to a prefill
    and a decode server."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self._urls: tuple[str, ...] | None = None

    async def run(
        self,
        lines: Sequence[BatchLine],
        done: Callable[[int, dict[str, Any]], None] | None = None,
        stop: asyncio.Event | None = None,
        window: int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> list[dict[str, Any] | None]:
        """Every line's output line, in input order, all submitted at once, or `window` at a
        time in input order (a server's batch: requests sent meanwhile then queue behind
        those, not the whole file); `done(i, line)` as each ends. `stop` set: the lines
        still running are aborted, and theirs and the entries of those not begun left None
        (set already: none begins). `headers`: the API key each line is sent with
        (`key_headers`). A line's run failing (a bug: `done` raising) stops the others and
        is raised."""
        results: list[dict[str, Any] | None] = [None] * len(lines)
        if stop is not None and stop.is_set():
            return results
        queued = iter(enumerate(lines))

        async def next_lines() -> None:
            for i, line in queued:  # (shared: each line taken by one)
                results[i] = await self.run_line(line, headers)
                if done is not None:
                    done(i, results[i])

        n = len(lines) if window is None else min(window, len(lines))
        tasks = [asyncio.create_task(next_lines()) for _ in range(n)]
        waits: list[asyncio.Future] = [asyncio.gather(*tasks)] if tasks else []
        if stop is not None:
            waits.append(asyncio.ensure_future(stop.wait()))
        try:
            if waits:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in [*tasks, *waits]:
                w.cancel()  # (a stop, or this run cancelled: the handlers abort their requests)
            ended = await asyncio.gather(*tasks, *waits, return_exceptions=True)
        for e in ended:
            if isinstance(e, Exception):  # (not a CancelledError: the stop's)
                raise e
        return results

    async def run_line(
        self, line: BatchLine, headers: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        """One line's output line: the route's answer, or why the line is not sent."""
        try:
            self._check(line)
        except APIError as e:
            return _output_line(line.custom_id, e.status, e.body())
        status, answer, request_id = await self._call(
            "POST", line.url, json.dumps(line.body).encode(), headers or {}
        )
        return _output_line(line.custom_id, status, answer, request_id)

    async def model(self, headers: Mapping[str, str]) -> str | None:
        """The model the app's /v1/models names (a router's: its servers'), asked as a
        client asks it; None where it answers none within `_MODEL_ASK_S` (a server that
        took the connection and hangs would hold the batch)."""
        asked = self._call("GET", "/v1/models", b"", headers)
        try:
            status, answer, _ = await asyncio.wait_for(asked, _MODEL_ASK_S)
        except asyncio.TimeoutError:
            return None
        try:
            return str(answer["data"][0]["id"]) if status == 200 else None
        except (KeyError, IndexError, TypeError):
            return None

    def _check(self, line: BatchLine) -> None:
        """The APIError for a line that is no batch request: a POST to a route this app
        serves (on a server's batch, its endpoint: `check_batch`), answered whole (as
        vLLM's: a true `stream` or Responses API `background` is refused; any other value
        is the route's to validate)."""
        if line.method != "POST":
            raise APIError(400, f"method must be POST, got {line.method!r}", param="method")
        if not isinstance(line.url, str) or line.url not in self.urls():
            supported = ", ".join(self.urls())
            raise APIError(400, f"url {line.url!r} is not one of {supported}", param="url")
        for name in ("stream", "background"):
            if isinstance(line.body, dict) and line.body.get(name) is True:
                raise APIError(400, f"{name} is not supported in a batch", param=name)

    def urls(self) -> tuple[str, ...]:
        """The batch urls (`BATCH_URLS`) the app has a POST route for."""
        if self._urls is None:
            served = {
                r.path for r in self.app.routes if isinstance(r, APIRoute) and "POST" in r.methods
            }
            self._urls = tuple(url for url in BATCH_URLS if url in served)
        return self._urls

    async def _call(
        self, method: str, url: str, data: bytes, headers: Mapping[str, str]
    ) -> tuple[int, Any, str]:
        """The app's answer to `data` sent to `url` (status, JSON body, x-request-id), as an
        ASGI server hands it a request (httpx's ASGITransport does the same at twice the
        cost a line: its client's own machinery). Its client never hangs up: `receive` tells
        a disconnect only once the answer is whole (a stop cancels the request instead,
        which aborts it)."""
        sent = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
        sent += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": url,
            "raw_path": url.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": sent,
            "client": None,
            "server": None,
        }
        request = [{"type": "http.request", "body": data, "more_body": False}]
        answered = asyncio.Event()
        start: dict[str, Any] = {}
        parts: list[bytes] = []

        async def receive() -> dict[str, Any]:
            if request:
                return request.pop()
            await answered.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                parts.append(message.get("body", b""))
                if not message.get("more_body", False):
                    answered.set()

        try:
            await self.app(scope, receive, send)
        except Exception:  # (answered first by the app's last handler, as a 500)
            log.exception("a batch request failed")
        status = start.get("status", 500)
        try:
            answer = json.loads(b"".join(parts))
        except ValueError:  # (a bare 500)
            answer = error_body(f"the route answered {status} without a JSON body", "server_error")
        request_id = dict(start.get("headers", ())).get(b"x-request-id", b"").decode("latin-1")
        return status, answer, request_id


def _output_line(
    custom_id: str, status: int, body: Any, request_id: str | None = None
) -> dict[str, Any]:
    """vLLM's run-batch output line for a route's answer: the body on a 200, else the
    error (OpenAI's error object) with the status."""
    ok = status == 200
    return {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": {
            "status_code": status,
            "request_id": request_id or new_id(),
            "body": body if ok else None,
        },
        "error": None if ok else (body.get("error", body) if isinstance(body, dict) else body),
    }


def _unfinished_line(custom_id: str, expired: bool) -> dict[str, Any]:
    """The error line of a request its batch's cancel, or its window's end, cut short
    (OpenAI's error file lists every request without an answer)."""
    if expired:
        message = "the batch's completion window ended before this request finished"
        code = "batch_expired"
    else:
        message, code = "the batch was cancelled before this request finished", "batch_cancelled"
    error = error_body(message, "server_error", code=code)["error"]
    return {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": None,
        "error": error,
    }


def _add_usage(total: dict[str, Any], usage: Any) -> None:
    """A line's answer's `usage` added to its batch's (OpenAI's BatchUsage): the Responses
    API's names its counts as the batch's do, chat's and completions' `prompt_tokens`,
    `completion_tokens` and their `*_details` (either details may be null or absent)."""
    if not isinstance(usage, dict):
        return

    def count(*path: str) -> int:
        x: Any = usage
        for key in path:
            x = x.get(key) if isinstance(x, dict) else None
        return x if isinstance(x, int) else 0

    inputs = count("input_tokens") + count("prompt_tokens")
    outputs = count("output_tokens") + count("completion_tokens")
    total["input_tokens"] += inputs
    total["output_tokens"] += outputs
    total["total_tokens"] += count("total_tokens") or inputs + outputs
    cached = count("input_tokens_details", "cached_tokens")
    cached += count("prompt_tokens_details", "cached_tokens")
    total["input_tokens_details"]["cached_tokens"] += cached
    reasoning = count("output_tokens_details", "reasoning_tokens")
    reasoning += count("completion_tokens_details", "reasoning_tokens")
    total["output_tokens_details"]["reasoning_tokens"] += reasoning


def _at(when: int, callback: Callable[..., Any], *args: Any) -> asyncio.TimerHandle:
    """`callback(*args)` on the running loop at the Unix time `when`: what expires (a file,
    a batch's window) goes then, whether or not anyone looks at it."""
    return asyncio.get_running_loop().call_later(max(0.0, when - time.time()), callback, *args)


def _expires_in(value: Any, param: str) -> int:
    """The seconds of an `expires_after` (`{"anchor": "created_at", "seconds": N}`, N an
    integer, as OpenAI takes it), or its 400."""
    anchor = value.get("anchor") if isinstance(value, dict) else None
    if anchor != "created_at":
        message = f"{param}.anchor must be 'created_at', got {anchor!r}"
        raise APIError(400, message, param=f"{param}.anchor")
    seconds, low, high = value.get("seconds"), EXPIRES_MIN_S, EXPIRES_MAX_S
    if type(seconds) is not int or not low <= seconds <= high:
        message = f"{param}.seconds must be an integer from {low} to {high}, got {seconds!r}"
        raise APIError(400, message, param=f"{param}.seconds")
    return seconds


# --- the server's /v1/files and /v1/batches ----------------------------------------------------


@dataclass
class _File:
    info: dict[str, Any]  # OpenAI's File object
    data: bytes


@dataclass(eq=False)
class _Batch:
    info: dict[str, Any]  # OpenAI's Batch object, as it goes
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    # Its run, held here: the event loop keeps only a weak reference to a task, so one held
    # by nobody may be collected mid-run; and what a server's stop cancels (`Batches.stop`)
    task: asyncio.Task | None = None
    expired: bool = False  # (stopped by its window's end, not a cancel)
    output_expires_in: int | None = None  # its output and error files' `expires_at`, after them


class BatchCreateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None


class Batches:
    """The files uploaded and the batches run of them (`add_batch_routes`), in memory. What
    expires goes at its time (`_at`): a file at its `expires_at` is deleted, a batch
    unfinished at the end of its window is stopped, then `expired` (`_expire`)."""

    def __init__(self, runner: BatchRunner, model_name: str | None, window: Window) -> None:
        self.runner = runner
        self.model_name = model_name  # (None: each batch asks the app as it starts: `_learn`)
        self.window = window  # a batch's requests in flight at most (`BatchRunner.run`)
        self.files: dict[str, _File] = {}
        self.batches: dict[str, _Batch] = {}

    def add_file(
        self, data: bytes, filename: str, purpose: str, expires_in: int | None = None
    ) -> dict[str, Any]:
        file_id = new_id("file-")
        created = int(time.time())
        info = {
            "id": file_id,
            "object": "file",
            "bytes": len(data),
            "created_at": created,
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "expires_at": None if expires_in is None else created + expires_in,
            "status_details": None,
        }
        self.files[file_id] = _File(info, data)
        if expires_in is not None:
            _at(info["expires_at"], self.files.pop, file_id, None)
        return info

    def file(self, file_id: str) -> _File:
        if file_id not in self.files:
            raise APIError(404, f"No such File object: {file_id}", param="file_id")
        return self.files[file_id]

    def batch(self, batch_id: str) -> _Batch:
        if batch_id not in self.batches:
            raise APIError(404, f"No batch found with id {batch_id!r}", param="batch_id")
        return self.batches[batch_id]

    def create(self, body: BatchCreateRequest, headers: Mapping[str, str]) -> dict[str, Any]:
        """A batch of `body.input_file_id`'s requests, validated and run from here on (its
        `status`: validating, in_progress, finalizing, then completed, failed, cancelled or
        expired), each sent with its creator's API key (`headers`: `key_headers`; held by
        its run only)."""
        if body.endpoint not in self.runner.urls():
            supported = ", ".join(self.runner.urls())
            message = f"endpoint {body.endpoint!r} is not supported; batches run {supported}"
            raise APIError(400, message, param="endpoint")
        if body.completion_window != COMPLETION_WINDOW:
            message = f"completion_window must be {COMPLETION_WINDOW!r}"
            raise APIError(400, message, param="completion_window")
        check_metadata(body.metadata)
        expires_in = None
        if body.output_expires_after is not None:
            expires_in = _expires_in(body.output_expires_after, "output_expires_after")
        if body.input_file_id not in self.files:
            message = f"No such File object: {body.input_file_id}"
            raise APIError(404, message, param="input_file_id")
        source = self.files[body.input_file_id]
        if source.info["purpose"] != "batch":
            message = (
                f"file {body.input_file_id} has purpose {source.info['purpose']!r}, not 'batch'"
            )
            raise APIError(400, message, param="input_file_id")
        now = int(time.time())
        info = {
            "id": new_id("batch_"),
            "object": "batch",
            "endpoint": body.endpoint,
            "errors": None,
            "input_file_id": body.input_file_id,
            "completion_window": body.completion_window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + _WINDOW_S,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "usage": {
                "input_tokens": 0,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": 0,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": 0,
            },
            "metadata": body.metadata,
            "model": self.model_name,
        }
        batch = _Batch(info, output_expires_in=expires_in)
        self.batches[info["id"]] = batch
        batch.task = asyncio.create_task(self._run(batch, source.data, headers))
        return info

    async def stop(self) -> None:
        """End the batches still running, their server or router stopping (its lifespan):
        their requests are cancelled, and aborted, before the app closes what they use."""
        running = [t for b in self.batches.values() if (t := b.task) is not None and not t.done()]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    def cancel(self, batch_id: str) -> dict[str, Any]:
        """OpenAI's cancel: `cancelling` while the requests in flight are aborted, then
        `cancelled`, with the answers that came first (and an error line for each other).
        A batch its window's end stopped ends `expired` all the same."""
        batch = self.batch(batch_id)
        status = batch.info["status"]
        if batch.expired:  # (stopped already: it ends `expired`)
            return batch.info
        if status in ("validating", "in_progress"):
            batch.info.update(status="cancelling", cancelling_at=int(time.time()))
            batch.stop.set()
        elif status not in ("cancelling", "cancelled"):
            message = f"batch {batch_id} is {status}: only a validating or in_progress one can be cancelled"
            raise APIError(409, message)
        return batch.info

    async def _run(self, batch: _Batch, data: bytes, headers: Mapping[str, str]) -> None:
        info = batch.info

        def validated() -> list[BatchLine]:
            lines = parse_batch(data)
            check_batch(lines, info["endpoint"])
            return lines

        expiry = _at(info["expires_at"], self._expire, batch)
        try:
            lines = await asyncio.to_thread(validated)
            await self._run_lines(batch, lines, headers)
        except BatchFileError as e:
            _failed(info, e.as_error())
        except Exception as e:  # (a bug, validating or running: it fails, the server goes on)
            log.exception("batch %s failed", info["id"])
            _failed(info, {"code": "server_error", "message": str(e), "param": None, "line": None})
        finally:
            expiry.cancel()

    def _expire(self, batch: _Batch) -> None:
        """A batch's window ended: one still running (not finalizing, not cancelled) is
        stopped, and `_run_lines` ends it `expired` (OpenAI's: the answers so far in its
        output file, an error line `batch_expired` for each other)."""
        if batch.info["status"] in ("validating", "in_progress") and not batch.stop.is_set():
            batch.expired = True
            batch.stop.set()

    async def _learn(self, batch: _Batch, headers: Mapping[str, str]) -> int:
        """What a batch learns as it starts, which a cancel does not wait for: how many of
        its lines are in flight at once (0 on a cancel: none is sent), which a router asks
        its decode servers, and its `model` where the app does not know it (a router's own
        /v1/models, which a server answers)."""
        info = batch.info

        async def window() -> int:
            return self.window if isinstance(self.window, int) else await self.window()

        async def model() -> str | None:
            return info["model"] or await self.runner.model(headers)

        async def both() -> int:
            n, info["model"] = await asyncio.gather(window(), model())
            return n

        asked = asyncio.ensure_future(both())
        stopped = asyncio.ensure_future(batch.stop.wait())
        try:
            await asyncio.wait({asked, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not asked.done():
                asked.cancel()
        return asked.result() if asked.done() and not asked.cancelled() else 0

    async def _run_lines(
        self, batch: _Batch, lines: list[BatchLine], headers: Mapping[str, str]
    ) -> None:
        info, counts = batch.info, batch.info["request_counts"]
        counts["total"] = len(lines)
        if not batch.stop.is_set():
            info.update(status="in_progress", in_progress_at=int(time.time()))

        def done(_: int, record: dict[str, Any]) -> None:
            if succeeded(record):
                counts["completed"] += 1
                body = record["response"]["body"]
                _add_usage(info["usage"], body.get("usage") if isinstance(body, dict) else None)
            else:
                counts["failed"] += 1

        window = await self._learn(batch, headers)
        results = await self.runner.run(lines, done, batch.stop, window, headers)
        # (a window that ended as the last line did leaves nothing unanswered: completed)
        expired = batch.expired and None in results
        cancelled = batch.stop.is_set() and not batch.expired
        if not (expired or cancelled):
            info.update(status="finalizing", finalizing_at=int(time.time()))
        records = [r or _unfinished_line(x.custom_id, expired) for r, x in zip(results, lines)]
        # (a line the stop cut short failed: the counts add up to the output and error files)
        counts["failed"] += results.count(None)
        for kind, key in (("output", "output_file_id"), ("error", "error_file_id")):
            chosen = [r for r in records if succeeded(r) == (kind == "output")]
            if chosen:
                data = await asyncio.to_thread(_jsonl, chosen)
                name = f"{info['id']}_{kind}.jsonl"
                info[key] = self.add_file(data, name, "batch_output", batch.output_expires_in)["id"]
        if expired:
            info.update(status="expired", expired_at=int(time.time()))
        elif cancelled:
            info.update(status="cancelled", cancelled_at=int(time.time()))
        else:
            info.update(status="completed", completed_at=int(time.time()))


def _failed(info: dict[str, Any], error: dict[str, Any]) -> None:
    """A batch failed by `error` (OpenAI's BatchError: code, message, param, line)."""
    info.update(
        status="failed", failed_at=int(time.time()), errors={"object": "list", "data": [error]}
    )


def _jsonl(records: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()


def _page(items: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    """OpenAI's cursor page of `items` (the openai client follows `after` = the last id)."""
    start = 0
    if after is not None:
        ids = [x["id"] for x in items]
        if after not in ids:
            raise APIError(400, f"after: no such object {after!r}", param="after")
        start = ids.index(after) + 1
    return list_page(items[start : start + limit], start + limit < len(items))


async def _upload(raw: Request) -> tuple[bytes, str, Any, dict[str, Any] | None]:
    """The multipart form's file (its bytes and name), purpose and `expires_after` (the
    openai client's `expires_after[anchor]` and `expires_after[seconds]` fields; None
    without them); past `MAX_FILE_BYTES` a 413 as soon as the body says so (its
    Content-Length) or has sent that much."""
    too_large = APIError(
        413, f"the file is larger than {MAX_FILE_BYTES} bytes", param="file", code="file_too_large"
    )
    length = raw.headers.get("content-length", "")
    if length.isdecimal() and int(length) > MAX_FILE_BYTES + _FORM_SLACK:
        raise too_large
    seen = 0

    async def bounded() -> dict[str, Any]:
        nonlocal seen
        message = await raw.receive()
        seen += len(message.get("body", b""))
        if seen > MAX_FILE_BYTES + _FORM_SLACK:
            raise too_large
        return message

    async with Request(raw.scope, bounded).form(max_files=1) as form:
        file, purpose = form.get("file"), form.get("purpose")
        if not isinstance(file, UploadFile):
            raise APIError(400, "file: a multipart file part is required", param="file")
        data = await file.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise too_large
        expires = {k: form.get(f"expires_after[{k}]") for k in ("anchor", "seconds")}
        seconds = expires["seconds"]  # (a form's fields are strings)
        if isinstance(seconds, str) and seconds.isdecimal():
            expires["seconds"] = int(seconds)
        given = any(v is not None for v in expires.values())
        return data, file.filename or "upload.jsonl", purpose, expires if given else None


def add_batch_routes(
    app: FastAPI, window: Window, model_name: str | None = None, disaggregated: bool = False
) -> None:
    """OpenAI's `/v1/files` (upload with purpose "batch", list, retrieve, `/content`,
    delete) and `/v1/batches` (create, retrieve, cancel, list), behind the API key as every
    /v1 route, on a server's app or the router's (their errors answered as a server's:
    `add_error_handlers`). `window`: how many of a batch's requests are in flight at most,
    or how to learn it as the batch starts (`Batches`); `model_name`: the batches' `model`
    (None: learned from the app's /v1/models as each starts, as a router's is);
    `disaggregated`: a prefill or decode server's app, which runs none (a 501). Call it once
    the batch urls' routes are on `app`."""
    store = Batches(BatchRunner(app), model_name, window)
    app.state.batches = store

    async def upload(raw: Request) -> Response:
        data, filename, purpose, expires = await _upload(raw)
        if purpose != "batch":
            message = f"purpose must be 'batch' (the only files run here), got {purpose!r}"
            raise APIError(400, message, param="purpose")
        expires_in = None if expires is None else _expires_in(expires, "expires_after")
        held = sum(f.info["bytes"] for f in store.files.values())
        if held + len(data) > MAX_STORED_BYTES:
            message = (
                f"{held} bytes of files are held here, {MAX_STORED_BYTES} at most: delete "
                "some (DELETE /v1/files/{file_id}) to upload this one"
            )
            raise APIError(413, message, param="file", code="storage_limit_exceeded")
        return JSONResponse(store.add_file(data, filename, purpose, expires_in))

    async def list_files(
        purpose: str | None = None,
        after: str | None = None,
        limit: int = Query(10_000, ge=1, le=10_000),
        order: Literal["asc", "desc"] = "desc",
    ) -> Response:
        files = [
            f.info for f in store.files.values() if purpose is None or f.info["purpose"] == purpose
        ]
        return JSONResponse(_page(files[::-1] if order == "desc" else files, after, limit))

    async def get_file(file_id: str) -> Response:
        return JSONResponse(store.file(file_id).info)

    async def delete_file(file_id: str) -> Response:
        store.file(file_id)
        del store.files[file_id]
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    async def content(file_id: str) -> Response:
        return Response(store.file(file_id).data, media_type="application/octet-stream")

    async def create(body: BatchCreateRequest, raw: Request) -> Response:
        if disaggregated:  # (each request needs a peer: the router pairs them)
            message = (
                "a prefill or decode server runs no batches: run them through `dsakv router` "
                "in front of it, on a server without --disaggregation-mode, or offline with "
                "`dsakv run-batch`"
            )
            raise APIError(501, message, type="server_error", code="not_implemented")
        return JSONResponse(store.create(body, key_headers(raw.headers)))

    async def list_batches(
        after: str | None = None, limit: int = Query(20, ge=1, le=100)
    ) -> Response:
        batches = [b.info for b in store.batches.values()][::-1]  # (newest first, as OpenAI's)
        return JSONResponse(_page(batches, after, limit))

    async def get_batch(batch_id: str) -> Response:
        return JSONResponse(store.batch(batch_id).info)

    async def cancel(batch_id: str) -> Response:
        return JSONResponse(store.cancel(batch_id))

    for path, endpoint, method in (
        ("/v1/files", upload, "POST"),
        ("/v1/files", list_files, "GET"),
        ("/v1/files/{file_id}", get_file, "GET"),
        ("/v1/files/{file_id}", delete_file, "DELETE"),
        ("/v1/files/{file_id}/content", content, "GET"),
        ("/v1/batches", create, "POST"),
        ("/v1/batches", list_batches, "GET"),
        ("/v1/batches/{batch_id}", get_batch, "GET"),
        ("/v1/batches/{batch_id}/cancel", cancel, "POST"),
    ):
        app.add_api_route(path, endpoint, methods=[method])
