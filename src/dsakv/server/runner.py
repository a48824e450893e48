"""`AsyncEngine`: the bridge between asyncio HTTP handlers and the (single-threaded) `Engine`.

One background thread owns the engine: it drains a thread-safe command queue (add, abort,
call), runs `engine.step()` while there is work, and pushes each request's new tokens to the
handler's asyncio queue with `loop.call_soon_threadsafe`. Every client's requests end up in
the same engine batch; nothing else ever touches the engine, so it needs no locks.

That thread should also be the one that built the engine (`EngineThread`, as `make_server`
does): on the CPU, torch's ops run in OpenMP (libgomp) teams, one team per OS thread that
ever ran a parallel op. Building the engine on the main thread and stepping it on another
left two teams, more OpenMP threads than cores on a 2-core machine, and libgomp then stops
spin-waiting between parallel regions: its workers sleep in the kernel after every op (two
context switches per op, thousands per decode step), which halved the server's decode rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Any, TypeVar

import numpy as np

from dsakv.engine import Engine, Request, SamplingParams, Status
from dsakv.engine.detokenizer import TokenTexts, output_logprob_texts, prompt_logprob_texts
from dsakv.engine.request import RequestMetrics
from dsakv.errors import DsakvError
from dsakv.metrics import LoraRequests

from .watchdog import StepWatchdog

log = logging.getLogger(__name__)

T = TypeVar("T")
STALL_WAIT_S = 0.005  # the engine thread's poll while nothing can run but pages are parked
SNAPSHOT_WAIT_S = 1.0  # how long a scrape waits for fresh counters before taking the last ones


class EngineThread:
    """The one OS thread that builds an engine (`call`), runs its step loop (`submit`) and
    closes it (`call` again), until `close`.

    Why not any thread: each OS thread that runs a torch CPU op in parallel gets an OpenMP
    team of its own, and once libgomp manages more threads than there are cores it stops
    spin-waiting, so every later parallel op pays a sleep and a wake-up. One thread for all
    of it keeps the process at one team, as in-process `LLM` use has (module docstring).
    Staying alive until the engine is closed also keeps the rank processes it spawned
    (`--tp`) alive: their parent-death signal follows the thread that started them.
    """

    def __init__(self, name: str = "dsakv-engine") -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._work, name=name, daemon=True)
        self.thread.start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on this thread and return its result; whatever it raises is raised here
        (a `SystemExit` too: a non-zero rank's `create_engine` exits once rank 0 stops)."""
        done: Future[T] = Future()

        def job() -> None:
            try:
                done.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                done.set_exception(e)

        self._jobs.put(job)
        return done.result()

    def submit(self, fn: Callable[[], None]) -> None:
        """Run `fn` (the step loop) after the queued jobs, without waiting for it."""
        self._jobs.put(fn)

    def close(self) -> None:
        """End the thread once the queued jobs ran; idempotent."""
        self._jobs.put(None)


@dataclass(frozen=True)
class Update:
    """What one engine step produced for one request (a snapshot; safe to read anywhere)."""

    token_ids: list[int]
    text: str  # new text since the previous update (held back while it may still change)
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    # Keywords only from here: a field added later cannot shift a caller's arguments.
    _: KW_ONLY
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # (`Request.stop_reason`)
    cached_tokens: int = 0  # prompt tokens the prefix cache held (SGLang's cached_tokens)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None
    # each step's gap since the request's previous tokens (vLLM's inter-token latency, one
    # per step however many tokens it brings), those held back by stream_interval included
    token_gaps_s: tuple[float, ...] = ()
    error: str | None = None  # the engine failed on this request
    error_status: int = 500  # 400 where the request itself was at fault (`Request.error`)
    # An abort a client asked for (SGLang's /abort_request): the request's `Status` then,
    # "waiting" or "running" (None: not asked; its client left, or the server stops)
    abort_asked: str | None = None
    # With logprobs: each token's text and each alternative's (`TokenTexts`)
    texts: list[str] | None = None
    top_texts: list[list[str]] | None = None
    # With `SamplingParams.token_ids_logprob`: each token's logprobs of those ids
    token_ids_logprobs: list[list[float]] | None = None
    # In a request's first update only: its prompt, and with prompt_logprobs their scores
    # (and texts, as above).
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_ranks: list[int | None] | None = None
    prompt_texts: list[str] | None = None
    prompt_top_texts: list[list[str]] | None = None
    prompt_token_ids_logprobs: list[list[float] | None] | None = None
    # In a request's last update only, where it asked for them (SGLang's
    # return_routed_experts / return_hidden_states): `Request.routed_experts`,
    # `Request.hidden_states`
    routed_experts: np.ndarray | None = None
    hidden_states: np.ndarray | None = None
    # In a request's last update only: its times as the engine took them (final once it
    # ended; its span's: `dsakv.server.tracing`, its metrics': `dsakv.metrics`), where the
    # engine ran it, and its max_tokens (as the context cut it: vLLM's max_tokens_param)
    times: RequestMetrics | None = None
    max_tokens: int | None = None


@dataclass(eq=False)
class RequestStream:
    """The handler's end of one request: `await stream.get()` until an update is `finished`."""

    loop: asyncio.AbstractEventLoop
    # When the request reached the server: its TTFT and latency count the wait for the
    # engine thread too (a long step), as vLLM's count from the API server's arrival.
    arrival: float = field(default_factory=time.perf_counter)
    prompt_tokens: int = 0
    rid: int | None = None  # engine request id, known once accepted
    queue: asyncio.Queue[Update] = field(default_factory=asyncio.Queue)
    accepted: asyncio.Future = field(init=False)
    # Engine-thread-only state: how many tokens / characters were handed out already.
    sent_tokens: int = 0
    sent_chars: int = 0
    sent_prompt: bool = False
    last_token_at: float | None = None  # when its latest tokens came (a step's end)
    held_gaps: list[float | None] = field(default_factory=list)  # steps held back (`_held_back`)
    request: Request | None = None
    texts: TokenTexts | None = None  # with logprobs, where the engine kept none (`_update`)
    abort_asked: bool = False  # `abort(asked=True)`: its last update says so
    # A choice of its call failed (an error update): this one, if cut short for it, ended
    # in that error (the metrics' finished_reason "error", as offline), not an abort
    call_failed: bool = False
    # False for a `finished_stream`'s: no request of the engine's, so none of the metrics'
    # (vLLM's count a beam search's step requests, not the sequences it answers with)
    metered: bool = True

    def __post_init__(self) -> None:
        self.accepted = self.loop.create_future()
        # The choices of one call are refused alike and the caller reads one refusal: the
        # others are read here, or asyncio logs each as an exception never retrieved.
        self.accepted.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def get(self) -> Update:
        return await self.queue.get()

    # Called on the engine thread.
    def _push(self, update: Update) -> bool:
        """Hand an update to the handler's loop; False if that loop is gone (nobody listens)."""
        return _post(self.loop, self.queue.put_nowait, update)

    def _resolve(self, error: BaseException | None) -> bool:
        def done() -> None:
            if self.accepted.done():
                return
            if error is None:
                self.accepted.set_result(self.rid)
            else:
                self.accepted.set_exception(error)

        return _post(self.loop, done)


class AsyncEngine:
    """Owns the engine thread. `generate()` submits; `abort()` cancels; `call()` runs a
    function on the engine thread (integrity checks) and awaits its result; `counters()`
    reads the engine's counters without waiting out a long step.
    `thread`: the `EngineThread` that built `engine`, to step and close it there too (else a
    thread of its own steps it, and ends with the step loop)."""

    def __init__(self, engine: Engine, thread: EngineThread | None = None) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[int, RequestStream] = {}
        self._stop = threading.Event()
        self._seq = itertools.count()
        self.error: BaseException | None = None  # set if the engine thread itself died
        self._finished = threading.Event()  # the step loop returned
        # The engine's counters as the engine thread last read them (`counters`), and the
        # read asked of it that scrapes wait on (one at a time, whichever loop asks).
        self.snapshot: dict[str, float] | None = None
        self.lora_snapshot: LoraRequests | None = None  # (the requests on each adapter)
        self._counting: Future[None] | None = None
        self._counting_lock = threading.Lock()
        self._owner = thread or EngineThread()
        self._owns_thread = thread is None
        self._watchdog = StepWatchdog(_watchdog_timeout(engine.config))
        self._stream_interval = engine.config.stream_interval
        self._owner.submit(self._run)
        if self._owns_thread:
            self._owner.close()

    # --- handler side (any thread / event loop) ---------------------------------------------

    @property
    def alive(self) -> bool:
        return not self._finished.is_set() and not self._stop.is_set()

    async def generate(self, prompt: str | list[int], params: SamplingParams) -> RequestStream:
        """Submit a request; returns its stream once the engine accepted it.

        Raises `DsakvError` (a client error) when the engine rejects the prompt.
        """
        return (await self.generate_n(prompt, params, 1))[0]

    async def generate_n(
        self, prompt: str | list[int], params: SamplingParams, n: int
    ) -> list[RequestStream]:
        """Submit `n` choices of one prompt (`Engine.add_requests`: they share its KV pages);
        one stream per choice, all accepted or all rejected."""
        if not self.alive:
            raise RuntimeError("the engine is not running")
        loop = asyncio.get_running_loop()
        streams = [RequestStream(loop) for _ in range(n)]
        self._commands.put(("add", (streams, prompt, params)))
        try:
            for s in streams:
                await s.accepted
        except asyncio.CancelledError:
            for s in streams:
                self.abort(s)  # queued after the add, so the engine thread sees both
            raise
        return streams

    def forgo(self, n: int) -> None:
        """The next prompt's `n` outputs were cancelled (an abort, or the client gone) before
        `generate_n` ran for it: the engine never sees them (a prefill/decode engine gives the prompt's bootstrap
        room up, or the next prompt would take it)."""

    def weights_updated(self) -> None:
        """The engine serves new weights (/update_weights_from_disk): what was derived from
        the old ones outside it is derived again (a PD server's handshake description)."""

    def before_weight_update(self) -> None:
        """A weight update waits for the engine to be idle: what this bridge keeps outside
        requests goes now (a PD prefill server's KV held for vLLM's pickups)."""

    def reply_extras(self) -> dict[str, Any]:
        """Top-level fields this bridge adds to the current request's non-streamed answer
        (a PD prefill server's `kv_transfer_params`: where vLLM's decode server finds the KV)."""
        return {}

    async def probe(self) -> None:
        """One greedy token of a one-token prompt, run by the engine thread (SGLang's
        `/health_generate`): proves the engine still steps, not only that its thread lives.
        Calls this class's `generate_n`, so a prefill/decode server needs no peer for it."""
        params = SamplingParams(max_tokens=1, temperature=0.0)
        (stream,) = await AsyncEngine.generate_n(self, [0], params, 1)
        try:
            u = await stream.get()
            while not u.finished:
                u = await stream.get()
        finally:
            self.abort(stream)  # a no-op once finished; frees it if we were cancelled
        if u.error is not None or u.finish_reason == "abort":
            raise RuntimeError(u.error or "the probe request was aborted")

    def server_info(self) -> dict[str, Any]:
        """What this bridge adds to `/server_info` (SGLang's field names)."""
        return {"disaggregation_mode": "null"}

    def attach(self, app: Any) -> None:
        """Routes and middleware this bridge adds to the server's app (none here)."""

    def abort(self, stream: RequestStream, asked: bool = False) -> None:
        """Cancel a request (client went away); idempotent, safe from any thread. `asked`:
        a client asked for it (/abort_request), so its answer is the output so far, not an
        error."""
        if asked:
            stream.abort_asked = True  # (read on the engine thread after the command)
        self._commands.put(("abort", stream))

    async def call(
        self, fn: Callable[[Engine], Any], undo: Callable[[Engine, Any], Any] | None = None
    ) -> Any:
        """Run `fn(engine)` between steps on the engine thread and return its result.
        `fn` runs even if the caller is cancelled meanwhile (a handler whose client left);
        `undo(engine, result)` then runs after it there, to give back what it took."""
        if not self.alive:
            raise RuntimeError("the engine is not running")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._commands.put(("call", (fn, loop, fut, undo)))
        try:
            return await fut
        except asyncio.CancelledError:  # after `fn` answered (else `_call` undoes it)
            if undo is not None and fut.done() and not fut.cancelled() and not fut.exception():
                self._undo(undo, fut.result(), loop)
            raise

    def _undo(self, undo: Callable[[Engine, Any], Any], result: Any, loop) -> None:
        """Run `undo(engine, result)` on the engine thread for a cancelled `call`."""
        job = (lambda engine: undo(engine, result), loop, loop.create_future(), None)
        self._commands.put(("call", job))

    async def counters(self, wait: float = SNAPSHOT_WAIT_S) -> dict[str, float] | None:
        """The engine's counters, read on the engine thread between steps; while it is
        busy past `wait` (one long step), the last ones it read: a scrape neither fails
        nor hangs on the engine. The read it asked for still lands, for the next one."""
        if self.alive:
            with self._counting_lock:
                read = self._counting
                if read is None or read.done():
                    read = self._counting = Future()
                    self._commands.put(("counters", read))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(read)), wait)
        return self.snapshot

    async def pause(self, retract: bool = False) -> None:
        """SGLang's /pause_generation in place: the engine thread takes no step until
        `resume`, while adds, aborts, calls (a weight update, a scrape) still run between;
        the requests keep their KV. `retract`: the running ones give it back first and wait
        (`Engine.retract_all`), to compute it again once resumed."""

        def pause(engine: Engine) -> None:
            if retract:
                engine.retract_all()
            engine.paused = True

        await self.call(pause)

    async def resume(self) -> None:
        """SGLang's /continue_generation: the engine steps again."""

        def resume(engine: Engine) -> None:
            engine.paused = False

        await self.call(resume)

    def abort_all(self) -> None:
        self._commands.put(("abort_all", None))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight and stop the engine thread."""
        if self._stop.is_set():
            return
        self._commands.put(("abort_all", None))
        self._commands.put(("stop", None))
        self._finished.wait(timeout)
        self._stop.set()

    def close_engine(self) -> None:
        """After `shutdown`: close the engine (other ranks, L3 tier) on the thread that built
        it once its step loop has stopped, then end that thread."""
        if self._owns_thread or not self._finished.is_set():
            self.engine.close()  # no thread to hand it to (or the loop is stuck in a step)
            return
        try:
            self._owner.call(self.engine.close)
        finally:
            self._owner.close()

    # --- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._read_counters(None)  # (a scrape during the first step finds these)
            stalled = False
            while True:
                # Block when idle; otherwise take whatever arrived since the last step, or
                # wait a little for it when the queue is stalled on PD's parked pages (they
                # come back through a command: a handoff's end), instead of spinning.
                # Paused (`pause`), or asleep (memory released): as idle, whatever waits.
                idle = self._held() or not self.engine.has_unfinished()
                if not self._drain(idle or stalled, None if idle else STALL_WAIT_S):
                    return
                # (asked again: the commands just applied may have paused it or released
                # the memory a step would read)
                if self.engine.has_unfinished() and not self._held():
                    s = self.engine.scheduler
                    stalled = not self._step() and not s.running and bool(s.parked)
        except BaseException as e:  # pragma: no cover - a bug in the bridge itself
            log.exception("engine thread died")
            self.error = e
            self._fail_all(f"engine thread died: {e}")
            self._stop.set()
        finally:
            self._watchdog.close()
            self._finished.set()

    def _held(self) -> bool:
        """Whether the engine takes no step now: paused, or asleep (`Engine.asleep`)."""
        return self.engine.paused or self.engine.asleep

    def _drain(self, block: bool, timeout: float | None = None) -> bool:
        """Apply queued commands (waiting up to `timeout` for the first when `block`);
        False when asked to stop."""
        while True:
            try:
                kind, arg = self._commands.get(block=block, timeout=timeout)
            except queue.Empty:
                return True
            block = False
            if kind == "add":
                self._add(*arg)
            elif kind == "abort":
                self._abort(arg, "abort")
            elif kind == "abort_all":
                for stream in list(self._streams.values()):
                    self._abort(stream, "abort")
            elif kind == "call":
                self._call(*arg)
            elif kind == "counters":
                self._read_counters(arg)
            elif kind == "stop":
                return False

    def _read_counters(self, done: Future[None] | None) -> None:
        try:
            self.snapshot = self.engine.counters()
            self.lora_snapshot = self.engine.lora_requests()
        except Exception:  # pragma: no cover - the last snapshot stays
            log.exception("reading the engine counters failed")
        if done is not None and not done.done():
            done.set_result(None)

    def _add(
        self, streams: list[RequestStream], prompt: str | list[int], params: SamplingParams
    ) -> None:
        try:
            reqs = self.engine.add_requests(prompt, replace(params, n=len(streams)))
        except Exception as e:
            if not isinstance(e, DsakvError):
                log.exception("add_request failed")
            for stream in streams:
                stream._resolve(e)
            return
        for stream, req in zip(streams, reqs):  # (the forks too)
            req.metrics.arrival_time = stream.arrival
            stream.rid, stream.request = req.rid, req
            stream.prompt_tokens = len(req.prompt_ids)
            self._streams[req.rid] = stream
        for stream in streams:
            if not stream._resolve(None):
                self._abort(stream, "abort")

    def _abort(self, stream: RequestStream, reason: str) -> None:
        if stream.rid is None or self._streams.pop(stream.rid, None) is None:
            return  # never accepted, or already finished
        req = stream.request
        status = req.status if req is not None else Status.WAITING  # (before the abort)
        if req is not None and len(req.output_ids) > stream.sent_tokens and stream.sent_prompt:
            stream._push(_update(self.engine, stream, req))  # (held back: `stream_interval`)
        self.engine.abort(stream.rid)
        stream._push(_ended(stream, reason, status=status))
        stream.request = None

    def _call(
        self,
        fn: Callable[[Engine], Any],
        loop: asyncio.AbstractEventLoop,
        fut: asyncio.Future,
        undo: Callable[[Engine, Any], Any] | None,
    ) -> None:
        try:
            result, error = fn(self.engine), None
        except BaseException as e:
            result, error = None, e

        def done() -> None:
            if fut.done():  # the caller was cancelled: `fn` ran for nobody
                if undo is not None and error is None:
                    self._undo(undo, result, loop)
                return
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)

        _post(loop, done)

    def _step(self) -> bool:
        """One engine step and its tokens to their streams; False when no request got one."""
        try:
            with self._watchdog.step():
                reqs = self.engine.step()
        except Exception as e:
            # Keep serving: fail the requests in flight, free their pages, go on.
            log.exception("engine step failed; aborting %d requests", len(self._streams))
            self._fail_all(f"engine error: {e}")
            return True
        for req in reqs:
            stream = self._streams.get(req.rid)
            if stream is None:
                continue
            if self._held_back(stream, req):
                stream.held_gaps.append(_token_gap(stream))
                continue
            try:
                update = _update(self.engine, stream, req)
            except Exception as e:  # (its texts, say): this request fails, not the thread
                log.exception("update of request %d failed; aborting it", req.rid)
                self._streams.pop(req.rid, None)
                if not req.finished:
                    self.engine.abort(req.rid)
                stream._push(_ended(stream, "error", f"engine error: {e}"))
                stream.request = None
                continue
            if not stream._push(update):
                self._abort(stream, "abort")  # its event loop closed under it
            elif req.finished:
                self._streams.pop(req.rid, None)
                stream.request = None
        return bool(reqs)

    def _held_back(self, stream: RequestStream, req: Request) -> bool:
        """Whether `req`'s new tokens wait for more (its `stream_interval`, else the
        server's): not its first, which sets the time to first token, nor its last."""
        interval = req.params.stream_interval or self._stream_interval
        new = len(req.output_ids) - stream.sent_tokens
        return not req.finished and stream.sent_prompt and new < interval

    def _fail_all(self, message: str) -> None:
        for rid, stream in list(self._streams.items()):
            try:
                self.engine.abort(rid)
            except Exception:  # pragma: no cover
                log.exception("abort of %d failed", rid)
            stream._push(_ended(stream, "error", message))
            stream.request = None
        self._streams.clear()


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> bool:
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:  # the loop was closed (its server stopped)
        return False


def aborted_waiting(prompt_tokens: int) -> RequestStream:
    """The stream of an output an abort reached before the engine took it (its
    `generate_n` cancelled): it ends at once, as one the engine aborted in its waiting
    queue."""
    stream = RequestStream(asyncio.get_running_loop(), prompt_tokens=prompt_tokens)
    stream.abort_asked = True
    stream._push(_ended(stream, "abort", status=Status.WAITING))
    return stream


def finished_stream(engine: Engine, req: Request) -> RequestStream:
    """The stream of a request that is over and ran as no request of the engine's (a beam
    search's sequence, whose steps were requests of their own): its whole output in one
    update, read back as any request's."""
    loop = asyncio.get_running_loop()
    stream = RequestStream(loop, prompt_tokens=len(req.prompt_ids), metered=False)
    stream._push(_update(engine, stream, req))
    return stream


def _ended(
    stream: RequestStream, reason: str, error: str | None = None, status: Status | None = None
) -> Update:
    """The last update of a request ended here (aborted, or failed with `error`): no new
    tokens; its usage so far, as vLLM reports an aborted request's. `status`: the request's
    when it was aborted."""
    req = stream.request
    asked = stream.abort_asked and reason == "abort" and error is None
    text = ""
    if asked and req is not None:  # its client reads the output as it stands: the text too
        text = req.output_text[stream.sent_chars :].rstrip("\ufffd")  # (held back: `_update`)
    return Update(
        [],
        text,
        None,
        None,
        finished=True,
        finish_reason=reason,
        cached_tokens=req.metrics.prefix_hit_tokens if req is not None else 0,
        prompt_tokens=stream.prompt_tokens,
        completion_tokens=len(req.output_ids) if req is not None else 0,
        error=error,
        abort_asked=(status or Status.RUNNING).value if asked else None,
        times=req.metrics if req is not None else None,
        max_tokens=req.params.max_tokens if req is not None else None,
    )


def _update(engine: Engine, stream: RequestStream, req: Request) -> Update:
    """The tokens and text a request gained since its last update (engine thread)."""
    start, end = stream.sent_tokens, len(req.output_ids)
    stream.sent_tokens = end
    text = req.output_text
    if not req.finished:
        text = text[: _stable_len(text, req.params.longest_stop)]
    delta = text[stream.sent_chars :]
    stream.sent_chars = max(stream.sent_chars, len(text))
    want = req.params.logprobs is not None
    ids = req.output_ids[start:end]
    first = not stream.sent_prompt
    stream.sent_prompt = True
    scored = first and req.prompt_logprobs is not None
    by_id = want and req.params.token_ids_logprob is not None
    tok, skip = engine.tokenizer, req.params.skip_special_tokens
    texts = top_texts = prompt_texts = prompt_top_texts = None
    if want and tok is not None:
        # The engine's decoder kept each token's text; a DP mirror's decoded on its rank.
        kept = req.detokenizer
        if kept is None or kept.texts is None:
            kept = stream.texts = stream.texts or TokenTexts(tok, skip, prompt=req.prompt_ids)
        texts, top_texts = output_logprob_texts(tok, req, kept, start, end)
    if scored and tok is not None:
        prompt_texts, prompt_top_texts = prompt_logprob_texts(tok, req)
    m = req.metrics
    gaps, stream.held_gaps = stream.held_gaps, []
    if ids:
        gaps.append(_token_gap(stream))
    return Update(
        error=req.error,
        error_status=500 if req.model_fault else 400,
        token_ids=ids,
        text=delta,
        logprobs=req.logprobs[start:end] if want else None,
        top_logprobs=req.top_logprobs[start:end] if want else None,
        finished=req.finished,
        finish_reason=req.finish_reason,
        stop_reason=req.stop_reason,
        cached_tokens=m.prefix_hit_tokens,
        prompt_tokens=len(req.prompt_ids),
        completion_tokens=end,
        ttft_s=m.ttft,
        latency_s=m.latency,
        token_gaps_s=tuple(g for g in gaps if g is not None),
        texts=texts,
        top_texts=top_texts,
        prompt_token_ids=list(req.prompt_ids) if first else None,
        prompt_logprobs=list(req.prompt_logprobs) if scored else None,
        prompt_top_logprobs=list(req.prompt_top_logprobs) if scored else None,
        prompt_ranks=list(req.prompt_ranks) if scored else None,
        prompt_texts=prompt_texts,
        prompt_top_texts=prompt_top_texts,
        token_ids_logprobs=req.token_ids_logprobs[start:end] if by_id else None,
        prompt_token_ids_logprobs=(
            list(req.prompt_token_ids_logprobs)
            if scored and req.prompt_token_ids_logprobs is not None
            else None
        ),
        routed_experts=req.routed_experts,  # (None until it ends)
        hidden_states=req.hidden_states,
        times=m if req.finished else None,
        max_tokens=req.params.max_tokens if req.finished else None,
    )


def _watchdog_timeout(config: Any) -> float | None:
    """--watchdog-timeout, plus the L3 prefetch timeout where a storage tier is on: an idle
    engine's step waits up to that long for a request's stored pages by design
    (`L3Cache.ready`), and a slow store is not a stuck engine."""
    storage = config.storage
    if config.watchdog_timeout is None or storage is None:
        return config.watchdog_timeout
    return config.watchdog_timeout + storage.prefetch_timeout_s


def _token_gap(stream: RequestStream) -> float | None:
    """The time since the request's previous tokens came (None before its first), now that
    a step brought more: vLLM's inter-token latency, one per step."""
    now = time.perf_counter()
    gap = None if stream.last_token_at is None else now - stream.last_token_at
    stream.last_token_at = now
    return gap


def _stable_len(text: str, longest_stop: int) -> int:
    """How much of an unfinished output can be streamed without being taken back later: not a
    trailing partial UTF-8 character (decoded as U+FFFD), nor a tail that could still grow into
    a stop string (the engine cuts the text there)."""
    n = max(len(text) - max(longest_stop - 1, 0), 0)
    while n > 0 and text[n - 1] == "\ufffd":
        n -= 1
    return n


# What the server's app talks to, made from the engine and the thread that built it: a plain
# `AsyncEngine`, or a prefill or decode server's (`dsakv.disagg.serving.bridge_for`).
Bridge = Callable[[Engine, EngineThread], AsyncEngine]
