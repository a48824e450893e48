"""A request's way through the engine and back: prompts checked and handed to the engine
(`n` choices each, or beam search), every output named for /abort_request while in flight
(`InFlight`), and read back whole (`Result`) or as server-sent events, aborted however the
client leaves; as `Handlers`' mixin."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from dsakv.engine import SamplingParams
from dsakv.engine.beam_search import (
    BeamSearch,
    BeamSearchParams,
    Step,
    advance_all,
    live_prompts,
    step_failed,
)
from dsakv.engine.engine import RankDied
from dsakv.engine.grammar import GrammarError
from dsakv.engine.sleep import EngineAsleep
from dsakv.errors import DsakvError, PromptTooLong

from .protocol import SHUTTING_DOWN, APIError, client_left
from .request_log import Entry, Output, RequestLog, route_of
from .runner import AsyncEngine, RequestStream, Update, aborted_waiting, finished_stream


@dataclass
class Result:
    """A finished request's updates folded together (non-streaming responses)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    top_texts: list[list[str]] = field(default_factory=list)
    token_ids_logprobs: list[list[float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    abort_asked: str | None = None  # (`Update.abort_asked`)
    first: Update | None = None  # carries the prompt (and its logprobs when scored)
    routed_experts: np.ndarray | None = None  # (`Update.routed_experts`: the last update's)
    hidden_states: np.ndarray | None = None

    def add(self, u: Update) -> None:
        self.first = self.first or u
        self.text += u.text
        self.token_ids += u.token_ids
        self.logprobs += u.logprobs or []
        self.top_logprobs += u.top_logprobs or []
        self.texts += u.texts or []
        self.top_texts += u.top_texts or []
        self.token_ids_logprobs += u.token_ids_logprobs or []
        self.finish_reason, self.stop_reason = u.finish_reason, u.stop_reason
        self.prompt_tokens, self.completion_tokens = u.prompt_tokens, u.completion_tokens
        self.cached_tokens = u.cached_tokens
        self.abort_asked = u.abort_asked
        if u.routed_experts is not None:
            self.routed_experts = u.routed_experts
        if u.hidden_states is not None:
            self.hidden_states = u.hidden_states

    def as_update(self) -> Update:
        f = self.first
        return Update(
            self.token_ids,
            self.text,
            self.logprobs,
            self.top_logprobs,
            texts=self.texts,
            top_texts=self.top_texts,
            prompt_token_ids=f.prompt_token_ids if f else None,
            prompt_logprobs=f.prompt_logprobs if f else None,
            prompt_top_logprobs=f.prompt_top_logprobs if f else None,
            prompt_ranks=f.prompt_ranks if f else None,
            prompt_texts=f.prompt_texts if f else None,
            prompt_top_texts=f.prompt_top_texts if f else None,
            token_ids_logprobs=self.token_ids_logprobs,
            prompt_token_ids_logprobs=f.prompt_token_ids_logprobs if f else None,
        )


@dataclass(eq=False)
class Call:
    """One generation call's outputs as /abort_request finds them: each output's names (a
    /generate output's `meta_info.id` and the rid its prompt was given; none on /v1), the
    streams the engine took for them so far (in output order), the outputs an abort
    reached before the engine took them, the engine's `generate_n` taking the next
    `waiting_n` outputs while it runs, its request log entry (None: not logged), and what
    runs once it closes (a session's node ending: `sessions`). `shown`: the id its client
    sees (its spans': `tracing`)."""

    names: list[frozenset[str]]
    shown: str | None = None
    streams: list[RequestStream] = field(default_factory=list)
    early: set[int] = field(default_factory=set)
    waiting: asyncio.Future | None = None
    waiting_n: int = 0
    log: Entry | None = None
    on_close: list[Callable[[], None]] = field(default_factory=list)


class InFlight:
    """The generation calls in flight, for SGLang's /abort_request: a call is opened before
    its prompts are tokenized or its grammar compiled, and closed when its answer ends, so
    an abort also reaches an output the engine has not taken yet. An engine still taking it
    (its `generate_n` waiting: a decode server's for room or for the prefill server's KV, a
    busy engine thread) is cancelled and the output ends at once as aborted while waiting
    (`Handlers._submit_n`), as SGLang's abort empties its queues; one still tokenizing or
    its grammar compiling ends so before its `generate_n` starts. (One of a prompt's
    several samples, which the engine takes together, is aborted as the engine takes it.)
    A name is one call's at a time (SGLang refuses a duplicate rid in flight), so an abort
    never reaches another client's request.

    Every generation call opens here and closes here however it ends, so the request log
    (`log`) hooks in here too: a call opened with the id its client sees (`shown`) is
    logged, and each output the engine takes for it is read through a record (`tap`); what
    it logs is the log's config as the call opens (SGLang's /configure_logging swaps it:
    `RequestLog.configure`)."""

    def __init__(self, engine: AsyncEngine, log: RequestLog | None = None) -> None:
        self.engine = engine
        self._calls: set[Call] = set()
        self._named: dict[str, Call] = {}
        self._idle = asyncio.Event()  # set while no call is in flight
        self._idle.set()
        self.log = log or RequestLog()
        self._taps: dict[RequestStream, Output] = {}  # (logged calls' outputs only)

    def open(
        self,
        names: Iterable[Iterable[str]],
        param: str = "rid",
        shown: str | None = None,
        raw: Request | None = None,
        completion: bool = True,
    ) -> Call:
        """A call for outputs named `names` (outputs of one prompt share its rid); a name
        already in flight is a 400, as SGLang's (`param`: the field that named it).
        `shown`: the id its client sees (a response's, a /generate output's), and `raw`
        the request it came in, for the request log (none: not logged), which counts its
        outputs' tokens as completion tokens unless `completion` is false (`Entry`)."""
        call = Call([frozenset(x) for x in names], shown=shown)
        taken = set().union(*call.names)
        for name in sorted(taken):
            if name in self._named:
                raise APIError(400, f"Duplicate request ID detected: {name}", param=param)
        self._calls.add(call)
        self._named.update(dict.fromkeys(taken, call))
        self._idle.clear()
        if shown is not None:
            call.log = self.log.open(shown, route_of(raw), completion)
        return call

    def close(self, call: Call | None) -> None:
        if call is None or call not in self._calls:
            return
        self._calls.discard(call)
        for name in set().union(*call.names):
            del self._named[name]
        if not self._calls:
            self._idle.set()
        if call.log is not None:
            for s in call.streams:
                self._taps.pop(s, None)
            call.log.ended()
        for then in call.on_close:
            then()

    def tap(self, stream: RequestStream) -> Output | None:
        """The request log's record of `stream`, fed each update its handler reads (None:
        not logged)."""
        return self._taps.get(stream) if self._taps else None

    @property
    def count(self) -> int:
        """Calls in flight (vLLM's /load)."""
        return len(self._calls)

    async def drained(self) -> None:
        """Until no call is in flight."""
        while self._calls:
            await self._idle.wait()

    def waiting(self, call: Call, submit: asyncio.Future, n: int) -> None:
        """`submit`, the engine's `generate_n`, takes `call`'s next `n` outputs: an abort of
        them all cancels it (at once, if it came earlier)."""
        call.waiting, call.waiting_n = submit, n
        self._cancel_waiting(call)

    def aborted(self, call: Call | None, n: int) -> bool:
        """Whether an abort reached each of `call`'s next `n` outputs before they were taken."""
        if call is None:
            return False
        start = len(call.streams)
        return all(i in call.early for i in range(start, start + n))

    def took(self, call: Call, streams: list[RequestStream]) -> None:
        """The engine took `call`'s next outputs; those already aborted are aborted now."""
        call.waiting = None
        start = len(call.streams)
        call.streams += streams
        if call.log is not None:
            for s in streams:
                self._taps[s] = call.log.tap(s)
        for i in range(start, len(call.streams)):
            if i in call.early:
                self.engine.abort(call.streams[i], asked=True)

    def abort(self, rid: str) -> None:
        """Abort every output named `rid`; none: nothing happens (SGLang's)."""
        call = self._named.get(rid)
        if call is not None:
            self._abort(call, lambda names: rid in names)

    def abort_all(self) -> None:
        for call in self._calls:
            self._abort(call, lambda names: True)

    def _abort(self, call: Call, match: Callable[[frozenset[str]], bool]) -> None:
        for i, names in enumerate(call.names):
            if not match(names):
                continue
            if i < len(call.streams):
                self.engine.abort(call.streams[i], asked=True)
            else:
                call.early.add(i)
        self._cancel_waiting(call)

    def _cancel_waiting(self, call: Call) -> None:
        if call.waiting is not None and self.aborted(call, call.waiting_n):  # (None: taken)
            call.waiting.cancel()


class SubmitMixin:
    """`Handlers`' submission. Its host holds the engine (`engine`), the calls in flight
    (`in_flight`), the latency histograms (`metrics`), the spans (`tracer`; None: not
    traced) and whether it is a PD server (`disaggregated`)."""

    async def _submit_n(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        n: int,
        raw: Request,
        prompt_param: str = "prompt",
        max_tokens_param: str | None = None,
        special: bool = True,
        call: Call | None = None,
    ) -> list[RequestStream]:
        """`n` choices of one prompt (they share its KV pages); a rejected prompt or grammar
        is a 400, and so is one that leaves too little room in the context for the
        `max_tokens` the client gave (in the field `max_tokens_param`; vLLM's check: the
        engine would cut the output short at the context). A client that leaves before the
        engine takes them cancels them: a prefill server waits here for its decode server,
        which never comes for a request the decode server refused (the router hangs up).
        So does an abort of them all (`call`'s, `InFlight`): they then end at once, aborted
        while waiting. The prompt is tokenized here, off the engine thread (a 5 MB one held
        every stream five seconds there)."""
        prompt = await self._fitting(prompt, params, max_tokens_param, prompt_param, special)
        started = False

        async def generate_n() -> list[RequestStream]:
            nonlocal started
            started = True
            return await self.engine.generate_n(prompt, params, n)

        submit = asyncio.ensure_future(generate_n())
        if call is not None:
            self.in_flight.waiting(call, submit, n)  # (aborted while it tokenized: cancelled)
        watcher = asyncio.create_task(_when_left(raw, submit.cancel))
        try:
            return await submit
        except asyncio.CancelledError:
            if not started:  # the engine never saw it
                with contextlib.suppress(APIError):
                    self.engine.forgo(n)
            if self.in_flight.aborted(call, n) and not _cancelling():
                return [aborted_waiting(len(prompt)) for _ in range(n)]
            if not watcher.done():
                raise  # this handler was cancelled, not the client gone
            raise APIError(499, "the client closed the request") from None
        except (DsakvError, RuntimeError) as e:
            raise refusal(e, prompt_param) from None
        finally:
            watcher.cancel()

    async def _fitting(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        param: str | None,
        prompt_param: str,
        special: bool = True,
    ) -> list[int]:
        """`prompt`'s token ids (truncated as `params` says), if `params.max_tokens` more
        fit in the context after them where the client gave it (in field `param`); else
        vLLM's 400. Tokenized off the event loop (a long prompt takes a while)."""
        e, max_tokens = self.engine.engine, params.max_tokens
        try:
            keep = params.truncate_prompt_tokens
            ids = await asyncio.to_thread(e.prompt_ids, prompt, keep, special)
        except DsakvError as err:
            raise refusal(err, prompt_param) from None
        if param is not None and len(ids) + max_tokens > e.max_model_len:
            no_room = PromptTooLong(
                f"This model's maximum context length is {e.max_model_len} tokens. However, "
                f"you requested {len(ids) + max_tokens} tokens ({len(ids)} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages "
                "or completion.",
                len(ids),
                e.max_model_len,
                max_tokens,
                param,
            )
            raise refusal(no_room, param)
        return ids

    async def _first_tokens(
        self, prompt: str | list[int], params: SamplingParams, special: bool = True
    ) -> str | list[int]:
        """vLLM's truncation_side "right": the prompt's first `truncate_prompt_tokens` token
        ids, where it has more (else the prompt as given, as "left" leaves it). A text is
        tokenized whole, as a left-truncated one (`Engine.prompt_ids`), then cut: a cut of
        its characters first could tokenize otherwise (BPE merges across the cut). -1 ("as
        many as fit") is refused under PD, where each server would cut at its own context
        (the left cut's suffix check, `PrefillAsyncEngine.generate_n`, has no prefix one)."""
        e, keep = self.engine.engine, params.truncate_prompt_tokens
        if keep is None:
            return prompt
        if keep == -1 and self.disaggregated:
            raise APIError(
                400,
                "truncate_prompt_tokens -1 with truncation_side right is not supported with "
                "prefill/decode disaggregation",
                param="truncate_prompt_tokens",
            )
        keep = keep if keep > 0 else e.max_model_len - 1
        try:
            if isinstance(prompt, str):
                ids = await asyncio.to_thread(e.encode, prompt, special)
            else:
                ids = list(prompt)
        except DsakvError as err:
            raise APIError(400, str(err), param=err.param or "prompt") from None
        return ids[:keep] if len(ids) > keep else prompt

    async def submit_all(
        self,
        prompts: list[str | list[int]],
        params: Sequence[SamplingParams],
        n: int,
        raw: Request,
        max_tokens_params: Sequence[str | None],
        prompt_param: str = "prompt",
        special: bool = True,
        call: Call | None = None,
    ) -> list[RequestStream]:
        """Every prompt's `n` choices, in order, each prompt with its own params (and the
        field its client's max_tokens came in: `_submit_n`); if one is rejected, the others
        are aborted (and `call` closed: `InFlight`, which learns of each prompt's choices
        as the engine takes them). Each choice the engine took is traced (`tracer`), and
        so is a prompt it did not take."""
        streams: list[RequestStream] = []
        traced = self.tracer.call(raw.headers, call) if self.tracer is not None else None
        try:
            with _logged(call, prompts, params, n):
                for prompt, p, given in zip(prompts, params, max_tokens_params, strict=True):
                    try:
                        taken = await self._submit_n(
                            prompt, p, n, raw, prompt_param, given, special, call
                        )
                    except APIError as e:
                        if traced is not None:
                            traced.refused(p, n, e)
                        raise
                    if traced is not None:
                        traced.took(taken, p, n)
                    streams += taken
                    if call is not None:
                        self.in_flight.took(call, taken)
        except BaseException:
            for s in streams:
                self.engine.abort(s)
            if traced is not None:
                traced.dropped(streams)
            self.in_flight.close(call)
            raise
        return streams

    async def _submit_beams(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams,
        beam: BeamSearchParams,
        raw: Request,
        given: str | None,
        prompt_param: str = "prompt",
        special: bool = True,
        call: Call | None = None,
    ) -> list[RequestStream]:
        """`use_beam_search`'s outputs: each prompt's best `beam_width` sequences, best
        first, as finished streams, read back as any request's (`finished_stream`). The
        search runs (`_beam_steps`) as `_submit_n`'s engine call waits: a client that leaves
        cancels it, and so does an abort of all its outputs, which then end as aborted while
        waiting. Prompts are checked (and tokenized) as `_submit_n`'s."""
        with _logged(call, prompts, [params], beam.beam_width, beam=True):
            return await self._beams(prompts, params, beam, raw, given, prompt_param, special, call)

    async def _beams(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams,
        beam: BeamSearchParams,
        raw: Request,
        given: str | None,
        prompt_param: str,
        special: bool,
        call: Call | None,
    ) -> list[RequestStream]:
        """`_submit_beams`' search (its failures are the request log's)."""
        e = self.engine.engine
        ids = [await self._fitting(p, params, given, prompt_param, special) for p in prompts]
        try:
            searches = [BeamSearch(e, x, beam, params.skip_special_tokens) for x in ids]
        except DsakvError as err:
            raise APIError(400, str(err), param=err.param) from None
        extra = dict(
            cache_salt=params.cache_salt,
            priority=params.priority,
            seed=params.seed,
            lora_name=params.lora_name,
        )
        step = beam.step_params(params.logprobs, **extra)
        n = len(ids) * beam.beam_width
        search = asyncio.ensure_future(self._beam_steps(searches, step, raw))
        if call is not None:
            self.in_flight.waiting(call, search, n)
        watcher = asyncio.create_task(_when_left(raw, search.cancel))
        try:
            ended = await search
        except asyncio.CancelledError:
            if not self.in_flight.aborted(call, n) or _cancelling():
                if not watcher.done():
                    raise  # this handler was cancelled, not the client gone
                raise APIError(499, "the client closed the request") from None
            ended = False  # (aborted while waiting)
        finally:
            watcher.cancel()
        if ended:
            got = (req for s in searches for req, _ in s.results(params.logprobs))
            streams = [finished_stream(e, req) for req in got]
        else:  # (or a step aborted: the search ends as an abort of all its outputs)
            streams = [aborted_waiting(len(x)) for x in ids for _ in range(beam.beam_width)]
        if call is not None:
            self.in_flight.took(call, streams)
        return streams

    async def _beam_steps(
        self, searches: list[BeamSearch], step: SamplingParams, raw: Request
    ) -> bool:
        """Run `searches` to their end, a step at a time: one request per live beam of each,
        all handed to the engine at once (so that one engine step runs them) and read back
        whole (`advance_all`). False: a step's request was aborted (as /abort_request
        aborts: its output so far, here none), which ends the search; one that ended
        otherwise without its token fails it, as the offline call's (`Step.of`)."""
        while prompts := live_prompts(searches):
            submits = (self.engine.generate_n(p, step, 1) for p in prompts)
            taken = await asyncio.gather(*submits, return_exceptions=True)
            streams = [x[0] for x in taken if isinstance(x, list)]
            failed = next((x for x in taken if isinstance(x, BaseException)), None)
            if failed is not None:
                for stream in streams:
                    self.engine.abort(stream)
                if isinstance(failed, (DsakvError, RuntimeError)):
                    raise refusal(failed, None) from None
                raise failed
            results = await self.collect_all(streams, raw)
            if cut := next((r for r in results if not r.token_ids), None):
                if cut.finish_reason == "abort":
                    return False
                why = f"it ended without a token ({cut.finish_reason})"
                raise refusal(step_failed(why), None)
            advance_all(
                searches,
                (Step(r.token_ids[0], r.logprobs[0], None, r.top_logprobs[0]) for r in results),
            )
        return True

    async def merged_updates(
        self, streams: list[RequestStream]
    ) -> AsyncIterator[tuple[int, Update]]:
        """(choice index, update) from all streams as they arrive, until all finished."""
        if len(streams) == 1:
            async for u in self._updates(streams[0]):
                yield 0, u
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for u in self._updates(stream):
                    await merged.put((i, u, None))
            except APIError as e:
                await merged.put((i, None, e))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            left = len(streams)
            while left:
                i, u, error = await merged.get()
                if error is not None:
                    raise error
                yield i, u
                left -= u.finished
        finally:
            _spread_failure(streams)
            for t in tasks:
                t.cancel()

    async def collect_all(
        self,
        streams: list[RequestStream],
        raw: Request,
        call: Call | None = None,
        into: list[Result] | None = None,
    ) -> list[Result]:
        """`_collect` for every stream at once (into `into`'s results, which others read as
        they fill: a session's); the first failure aborts the rest. `call` is closed at the
        end."""
        into = into or [Result() for _ in streams]
        if len(streams) == 1:
            try:
                return [await self._collect(streams[0], raw, into[0])]
            finally:
                self.in_flight.close(call)
        tasks = [asyncio.ensure_future(self._collect(s, raw, r)) for s, r in zip(streams, into)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            self.in_flight.close(call)
            _spread_failure(streams)
            for s in streams:
                self.engine.abort(s)  # (a finished one: nothing to do)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for t in tasks:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()
        return [t.result() for t in tasks]

    async def _updates(self, stream: RequestStream) -> AsyncIterator[Update]:
        """A request's updates up to and including the finishing one; errors raise."""
        metered = stream.metered  # (a beam search's sequence is none of the metrics')
        finished, times = False, self.metrics.request()
        seen = self.in_flight.tap(stream)
        span = self.tracer.span(stream) if self.tracer is not None else None
        try:
            while True:
                u = await stream.get()
                if metered:
                    times.observe(u)
                if seen is not None:
                    seen.add(u)
                if span is not None:
                    span.observe(u)
                finished = u.finished
                if u.error is not None:
                    stream.call_failed = True
                    raise _update_error(u)
                yield u
                if u.finished:
                    return
        finally:
            if not finished and metered:  # the client left (aborted), or another choice failed
                self.metrics.success.labels("error" if stream.call_failed else "abort").inc()
            if span is not None:
                span.end()

    async def _collect(self, stream: RequestStream, raw: Request, result: Result) -> Result:
        """Wait for the whole output (into `result`), aborting if the client goes away
        meanwhile."""

        # (an abort ends the stream with finish_reason "abort")
        watcher = asyncio.create_task(_when_left(raw, lambda: self.engine.abort(stream)))
        try:
            async with contextlib.aclosing(self._updates(stream)) as updates:
                async for u in updates:  # (closed here, not when collected: its count now)
                    result.add(u)
        finally:
            left = watcher.done() and not watcher.cancelled()
            watcher.cancel()
            self.engine.abort(stream)  # a no-op when it already finished
        if result.finish_reason == "abort":
            if left:  # nobody hears this answer; it is counted as the client's doing
                raise APIError(499, "the client closed the request")
            if result.abort_asked is None:  # (asked: the output so far, as SGLang answers)
                raise APIError(503, SHUTTING_DOWN, type="server_error")
        return result

    def stream_response(
        self,
        events: AsyncIterator[str],
        stream: RequestStream | list[RequestStream],
        call: Call | None = None,
        headers: dict[str, str] | None = None,
    ) -> Response:
        """The SSE response; its engine requests are aborted and `call` closed however it
        ends, its building (`headers` not sendable) included."""
        streams = stream if isinstance(stream, list) else [stream]

        async def sse() -> AsyncIterator[str]:
            try:
                async for chunk in events:
                    yield chunk
            except APIError as e:
                yield sse_event(e.body())
            yield "data: [DONE]\n\n"

        return AbortingStream(sse(), self.closer(call, streams), headers)

    def closer(self, call: Call | None, streams: list[RequestStream]) -> Callable[[], None]:
        """What ends a streamed answer however it ends: `call` closed, its engine requests
        aborted (a finished one: nothing to do)."""

        def close() -> None:
            self.in_flight.close(call)
            for s in streams:
                self.engine.abort(s)

        return close


class AbortingStream(StreamingResponse):
    """An SSE response that aborts its engine request however it ends (disconnect
    included), or fails to be built."""

    def __init__(
        self,
        content: AsyncIterator[str],
        on_close: Callable[[], None],
        headers: dict[str, str] | None = None,
    ) -> None:
        self._on_close = on_close
        try:
            super().__init__(
                content,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", **(headers or {})},
            )
        except BaseException:
            on_close()
            raise

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _cancelling() -> bool:
    """Whether this task itself is being cancelled (its handler, not what it awaited);
    Python 3.10 has no `Task.cancelling`, and there only the awaited task was."""
    me = asyncio.current_task()
    cancelling = getattr(me, "cancelling", None)
    return bool(cancelling and cancelling())


@contextlib.contextmanager
def _logged(
    call: Call | None,
    prompts: Sequence[str | list[int]],
    params: Sequence[SamplingParams],
    n: int,
    beam: bool = False,
) -> Iterator[None]:
    """The request log's Received line for `call`'s submission, and its failure when it
    fails (noted before `InFlight.close` writes the call's end)."""
    log = call.log if call is not None else None
    if log is not None:
        log.received(prompts, params, n, beam)
    try:
        yield
    except BaseException as e:
        if log is not None:
            log.failed(e)
        raise


async def _when_left(raw: Request, then: Callable[[], Any]) -> None:
    """Call `then` once the client has hung up (run as a task; cancel it when done)."""
    await client_left(raw)
    then()


# Line breaks to `str.splitlines` that JSON leaves raw in a string: clients that split a
# stream with it (httpx's `iter_lines`, requests' with decode_unicode) cut an event there.
_SPLITLINES_BREAKS = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"})


def sse_event(obj: dict[str, Any], kind: str | None = None) -> str:
    """One server-sent event of `obj` (JSON), named `kind` where its API names its events
    (the Responses and Messages APIs': their SDKs read the name)."""
    named = f"event: {kind}\n" if kind is not None else ""
    data = json.dumps(obj, ensure_ascii=False).translate(_SPLITLINES_BREAKS)
    return f"{named}data: {data}\n\n"


def _spread_failure(streams: list[RequestStream]) -> None:
    """One choice of a call failed: each other one cut short ends in its error (`_updates`)."""
    if any(s.call_failed for s in streams):
        for s in streams:
            s.call_failed = True


def _update_error(u: Update) -> APIError:
    if u.error_status < 500:
        return APIError(u.error_status, u.error)
    return APIError(u.error_status, u.error, type="server_error")


def refusal(e: DsakvError | RuntimeError, param: str | None) -> APIError:
    """The HTTP error for the engine's refusal of a request: its grammar (compiled by
    `ready_grammar`: only if evicted since) or its fields a 400 (`param` where the error
    names none; a prompt too long carries its counts, `PromptTooLong`, and OpenAI's code,
    which clients read to trim or compact a conversation); asleep (sleep mode: it takes
    requests again later) or stopped a 503; another rank dead a 500, as a failed step's."""
    if isinstance(e, GrammarError):
        return APIError(400, str(e))
    if isinstance(e, RankDied):  # (a PD decode request's KV shared with the other ranks)
        return APIError(500, f"engine error: {e}", type="server_error")
    if isinstance(e, EngineAsleep) or not isinstance(e, DsakvError):
        return APIError(503, str(e), type="server_error")
    too_long = e if isinstance(e, PromptTooLong) else None
    code = "context_length_exceeded" if too_long is not None else None
    return APIError(400, str(e), param=e.param or param, code=code, too_long=too_long)
