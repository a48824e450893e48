"""Data-parallel attention: one scheduler and one KV pool per rank, MoE across all of them.

Every rank runs its own `Engine` over its own requests, so the aggregate KV capacity is
world × one rank's. Rank 0 is the front door: it numbers each request, sends it to the
rank with the most free KV pages, and each step broadcasts the new requests and aborts,
lets every rank step (a rank with nothing to run still joins the FFN collectives with an
empty batch), and gathers what every rank produced. To the server and `LLM` it looks like
one `Engine`: requests that run elsewhere are mirrored in local `Request` objects.

Between steps rank 0 may have one rank (or every other rank) run an op at once and answer
(`DPEngine._on_rank`): a PD decode server's reservations, starts and drops on the rank with
room, a PD prefill server's releases from the rank a request ran on, and the registration
of every rank's pool; or start one on a thread of that rank (`on_rank_later`: a PD prefill
server's KV write), whose outcome comes back with a later report.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from dsakv.distributed.leader import Leader
from dsakv.errors import DsakvError

from .engine import Engine
from .ranks import by_rank, said
from .request import Request, Status, link_choices
from .sampling import SamplingParams

log = logging.getLogger(__name__)

# A reservation's answer while its grammar compiles on the rank (`_Reporter._reserve`)
_COMPILING = "compiling"
# How often an idle rank 0 asks for the outcome of calls running on other ranks (`_poll`)
_POLL_S = 0.002
# Request fields that grow as it decodes, and the ones that are replaced.
_GROWING = ("output_ids", "logprobs", "top_logprobs", "ranks", "token_ids_logprobs")
_REPLACED = (
    "output_text",
    "finish_reason",
    "stop_reason",
    "error",
    "model_fault",  # (the server's 500, not the request's 400)
    "num_computed",
    "prompt_logprobs",
    "prompt_top_logprobs",
    "prompt_ranks",
    "prompt_token_ids_logprobs",
    "routed_experts",  # (None until the request ends)
    "hidden_states",
)
# Per-request counts and summed step times (`RequestMetrics`) a rank reports as they stand
_COUNTS = ("prefix_hit_tokens", "retractions", "draft_tokens", "accepted_tokens")
_COUNTS += ("scheduler_time", "execute_time", "forward_time")


@dataclass
class RankReport:
    """What one rank tells rank 0 after a step."""

    free_pages: int
    waiting_tokens: int
    counters: dict[str, float]
    updates: list[dict[str, Any]] = field(default_factory=list)
    # `DPEngine.on_rank_later` calls that ended since: (key, ("ok", result) or ("error", why))
    done: list[tuple[int, tuple[str, Any]]] = field(default_factory=list)


class _Reporter:
    """Turns a rank's stepped requests into deltas (only what is new since last time), and
    queues the requests rank 0 sends it.

    A request with a grammar waits (`pending`) while a worker thread compiles it into the
    engine's cache, as rank 0's server compiles off its loop: a schema that takes seconds
    would otherwise hold this rank's loop, and with it every rank's step (they step in
    lockstep); the others are queued meanwhile, as vLLM's scheduler skips a request whose
    grammar is still compiling. A request's times count from when its step message came
    (rank 0 adds the time before it sent it: `DPEngine._mirror`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.sent: dict[int, dict[str, int]] = {}
        self.pending: dict[int, tuple[Future | None, list[int], SamplingParams, float]] = {}
        self.failed: list[Request] = []  # refused here: reported with the next step's
        self._compiler: ThreadPoolExecutor | None = None
        self.detached: dict[int, Request] = {}  # reserved here for a PD decode server
        self.compiling: dict[tuple[str, str], Future] = {}  # their grammars, by grammar
        self.kept: dict[str, Any] = {}  # what `_call`'s functions keep while this rank runs
        self._background: ThreadPoolExecutor | None = None
        self._running: dict[int, Future] = {}  # `_call_later`'s, by key

    def apply(self, msg: tuple) -> None:
        _, adds, aborts, holds = msg
        me, now = self.engine.parallel.rank, time.perf_counter()
        self.engine.scheduler.held.update(rid for rank, rid in holds if rank == me)
        for rank, rid, ids, params in adds:
            if rank == me:
                self.pending[rid] = (self._compile(params), ids, params, now)
        for rank, rid in aborts:
            if rank != me:
                continue
            self.engine.scheduler.held.discard(rid)  # (a PD prefill server's, maybe unrun)
            if self.pending.pop(rid, None) is None:
                self.engine.abort(rid)
                self.sent.pop(rid, None)
        self._admit()

    def _compile(self, params: SamplingParams) -> Future | None:
        if params.grammar is None:
            return None
        grammars = self.engine.grammars  # (built here, on this thread: the worker compiles)
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(1, thread_name_prefix="dsakv-grammar")
        return self._compiler.submit(grammars.compile, params.grammar)

    def _admit(self) -> None:
        """Queue the pending requests whose grammar is ready (or that have none), in order.
        Rank 0 checked each (`Engine.check_request`); one that still fails here ends alone,
        with its error, rather than ending this rank and with it every rank."""
        for rid, (compiling, ids, params, came) in list(self.pending.items()):
            if compiling is not None and not compiling.done():
                continue
            del self.pending[rid]
            try:
                req = self.engine.add_request(ids, params, rid=rid)
            except Exception as e:  # noqa: BLE001 - this request's failure, not the rank's
                req = Request(ids, params, rid=rid)
                req.finish_reason, req.status = "error", Status.FINISHED
                req.error = f"rank {self.engine.parallel.rank} refused the request: {e}"
                req.metrics.finish_time = time.perf_counter()
                log.warning("request %d: %s", rid, req.error)
                self.failed.append(req)
            req.metrics.arrival_time = came

    def close(self) -> None:
        for pool in (self._compiler, self._background):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        for obj in self.kept.values():
            obj.close()

    # --- between steps, one rank's part (`DPEngine._on_rank`) -----------------------------

    def on_rank(self, msg: tuple) -> list[Any] | None:
        """Run `msg`'s op if it names this rank (None: every rank but 0) and gather each
        rank's ("ok", result, load) or ("error", why, load) on rank 0 (`load`: its
        `RankReport` after the op, with no updates: pages it took or gave, whatever step
        comes next); a failed op fails alone, not this rank (and with it every rank)."""
        _, rank, op, args = msg
        me, out = self.engine.parallel.rank, None
        if rank == me or (rank is None and me != 0):
            try:
                out = ("ok", getattr(self, f"_{op}")(*args))
            except Exception as e:  # noqa: BLE001 - this op's failure, not the rank's
                out = ("error", said(e))
            self.engine.cache_changed()  # (pages it took from or gave to the cache)
            out += (self.load(done=True),)
        return self.engine.parallel.gather_objects(out)

    def _reserve(self, rid: int, ids: list[int], params: SamplingParams) -> list[int] | str | None:
        """Its pages, None (no room), or `_COMPILING`: its grammar compiles on this rank's
        worker first, as an add's does (rank 0 compiled its own copy), not here while every
        rank waits (rank 0 asks again)."""
        grammar = params.grammar
        for g in [g for g, f in self.compiling.items() if f.done() and g != grammar]:
            del self.compiling[g]  # (their reservations gone: compiled into the cache)
        if grammar is not None and not self.engine.grammars.compiled(grammar):
            compiling = self.compiling.get(grammar)
            if compiling is None:
                self.compiling[grammar] = self._compile(params)
            if compiling is None or not compiling.done():
                return _COMPILING  # (the first ask always: a quick compile ends in `submit`)
            del self.compiling[grammar]  # (compiled; or its error is `reserve_detached`'s)
        req = self.engine.reserve_detached(ids, params, rid=rid)
        if req is None:
            return None
        self.detached[rid] = req
        return list(req.pages)

    def _drop(self, rid: int) -> None:
        self.engine.drop_detached(self.detached.pop(rid))

    def _start(
        self,
        rid: int,
        first_token: int | None,
        routed: torch.Tensor | None,
        grown: dict[str, list],
        waited: float,
        prefix_hit_tokens: int,
    ) -> dict[str, Any]:
        """Start a request reserved here, with what rank 0's mirror got from the prefill
        server (the first token's logprobs, its time so far); its update, at once."""
        req = self.detached.pop(rid)
        for name, values in grown.items():
            getattr(req, name).extend(values)
        req.metrics.arrival_time = time.perf_counter() - waited
        req.metrics.prefix_hit_tokens = prefix_hit_tokens
        self.engine.start_decoding(req, first_token, routed)  # (dropped there if it fails)
        return self._update(req)

    def _poll(self) -> None:
        """Nothing: its load, with the `_call_later` calls that ended, comes with the answer."""

    def _release(self, rid: int) -> None:
        """A prefill server's request held here: its pages go (it may never have run)."""
        self.engine.unhold(rid)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(engine, kept, *args)`: a function of a package above this one (a PD server's
        pool registration), with this rank's engine and `kept`."""
        return fn(self.engine, self.kept, *args)

    def _call_later(self, key: int, fn: Callable[..., Any], *args: Any) -> None:
        """`_call` on a thread of this rank's, while it steps (a PD prefill server's KV
        write): its outcome comes with a later report (`RankReport.done`)."""
        if self._background is None:
            self._background = ThreadPoolExecutor(4, thread_name_prefix="dsakv-rank-call")
        self._running[key] = self._background.submit(fn, self.engine, self.kept, *args)

    def _done(self) -> list[tuple[int, tuple[str, Any]]]:
        """The `_call_later` calls that ended since, each once."""
        out = []
        for key, fut in list(self._running.items()):
            if fut.done():
                del self._running[key]
                e = fut.exception()
                out.append((key, ("ok", fut.result()) if e is None else ("error", said(e))))
        return out

    def report(self, stepped: list[Request]) -> RankReport:
        stepped, self.failed = self.failed + stepped, []
        report = self.load(done=True)
        report.updates = [self._update(req) for req in stepped]
        return report

    def load(self, done: bool = False) -> RankReport:
        """This rank's load; `done`: with the `_call_later` calls that ended (for rank 0,
        which reads them: a report, an op's answer)."""
        e = self.engine
        counters = e.counters()  # (a request whose grammar compiles waits here, not queued)
        counters["waiting_requests"] += len(self.pending)
        counters["waiting_tokens"] += sum(len(ids) for _, ids, _, _ in self.pending.values())
        waiting = int(counters["waiting_tokens"])
        ended = self._done() if done else []
        return RankReport(e.scheduler.available_pages(), waiting, counters, done=ended)

    def _update(self, req: Request) -> dict[str, Any]:
        """What is new in `req` since its last update."""
        sent = self.sent.setdefault(req.rid, {})
        up: dict[str, Any] = {"rid": req.rid}
        for name in _GROWING:
            values = getattr(req, name)
            up[name] = values[sent.get(name, 0) :]
            sent[name] = len(values)
        for name in _REPLACED:
            up[name] = getattr(req, name)
        m = req.metrics
        up["ttft_s"], up["latency_s"], up["queued_s"] = m.ttft, m.latency, m.queued
        up.update((name, getattr(m, name)) for name in _COUNTS)
        if req.finished:
            self.sent.pop(req.rid, None)
            if req.rid in self.engine.scheduler.parked:  # (a PD prefill server ships them)
                up["pages"] = list(req.pages)
        return up


def serve_dp_peer(engine: Engine) -> None:
    """A rank other than 0 under DP attention: step with rank 0 until it says stop."""
    reporter = _Reporter(engine)
    try:
        while True:
            msg = engine.parallel.broadcast_object()
            if msg[0] == "stop":
                return
            if msg[0] == "every_rank":
                engine.every_rank_call(*msg[1:])
                continue
            if msg[0] == "on_rank":
                reporter.on_rank(msg)
                continue
            if msg[0] != "step":
                continue  # heartbeat
            reporter.apply(msg)
            engine.parallel.gather_objects(reporter.report(engine.step()))
    finally:
        reporter.close()


class DPEngine:
    """Rank 0's view of every rank's engine; duck-types `Engine` for the server and LLM."""

    def __init__(self, local: Engine) -> None:
        self.local = local
        self.parallel = local.parallel
        self.leader = Leader(local.parallel)
        self._reporter = _Reporter(local)
        self._remote: dict[int, tuple[int, Request]] = {}  # rid -> (rank, mirror)
        self._sent: dict[int, float] = {}  # rid -> when the step that carried it was sent
        self._adds: list[tuple[int, int, list[int], SamplingParams]] = []
        self._aborts: list[tuple[int, int]] = []
        self._holds: list[tuple[int, int]] = []
        self._later: dict[tuple[int, int], Future] = {}  # (rank, key): `on_rank_later`'s
        world = self.parallel.world_size
        first = self._reporter.report([])
        self._reports: list[RankReport] = [first] * world
        self._assigned_tokens = [0] * world  # sent since the ranks last reported
        self.peak_running = 0
        # Each rank's counters as `counters` last read them (on the engine thread), replaced
        # whole: /get_load reads them after a read, as /metrics reads the sum
        self.rank_snapshot: list[dict[str, float]] = [r.counters for r in self._reports]

    def __getattr__(self, name: str) -> Any:
        # tokenizer, model_config, config, max_model_len, eos_token_ids, encode, ...
        return getattr(self.local, name)

    @property
    def paused(self) -> bool:
        """`Engine.paused` (the server's /pause_generation), set on every rank: each one's
        `_busy` and `flush_cache` read it of the requests it schedules."""
        return self.local.paused

    @paused.setter
    def paused(self, paused: bool) -> None:
        self._on_every_rank("set_paused", paused)

    # --- requests ------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams) -> Request:
        self.local.check_awake()  # (every rank sleeps and wakes with rank 0)
        ids = self.local.prompt_ids(prompt, params.truncate_prompt_tokens)
        rank = self._by_room()[0]
        if rank == 0:
            req = self.local.add_request(ids, params)
        else:
            self._check_remote(params, ids)
            req = Request(ids, params, dp_rank=rank)
            req.status = Status.RUNNING
            self._remote[req.rid] = (rank, req)
            self._adds.append((rank, req.rid, ids, params))
        self._assigned_tokens[rank] += len(ids)
        return req

    def add_requests(self, prompt: str | list[int], params: SamplingParams) -> list[Request]:
        """`params.n` choices, each routed on its own (seed + i, as `Engine.add_requests`
        does); they share prompt pages only when they land on the same rank."""
        n = params.n
        if n > self.max_choices:
            raise DsakvError(f"n must be in 1..{self.max_choices}, got {n!r}")
        return link_choices([self.add_request(prompt, params.choice(i)) for i in range(n)])

    def _by_room(self) -> list[int]:
        """The ranks, the most free KV pages first once their queued prompts are counted."""
        page = self.local.config.page_size

        def room(rank: int) -> int:
            r = self._reports[rank]
            queued = r.waiting_tokens + self._assigned_tokens[rank]
            return r.free_pages - -(-queued // page)

        return sorted(range(self.parallel.world_size), key=lambda r: (-room(r), r))

    def _check_remote(self, params: SamplingParams, ids: list[int]) -> None:
        """What rank 0 checks of a request another rank runs: the client's 400 here and
        now, with its `param`, not a peer's error."""
        self.local.check_request(params)
        self.local.check_routed_start(params, len(ids))

    def abort(self, rid: int) -> None:
        if rid not in self._remote:
            self.local.abort(rid)
            return
        rank, mirror = self._remote.pop(rid)
        self._sent.pop(rid, None)
        if not mirror.finished:
            mirror.finish_reason, mirror.status = "abort", Status.FINISHED
            self._aborts.append((rank, rid))

    def has_unfinished(self) -> bool:
        # (queued adds and aborts too: an idle server steps only while this holds, and the
        # step is what delivers them; an abort left queued held its request's pages)
        # (and calls still running on a rank: their outcome comes with a step's reports)
        busy = self._remote or self._adds or self._aborts or self._later
        return self.local.has_unfinished() or bool(busy)

    def _busy(self) -> bool:
        """`Engine._busy` of every rank, as rank 0 sees it: a request on any rank, queued
        adds and aborts included, unless `paused`; or calls still running on a rank (a PD
        prefill server's KV write). Each rank checks its own held pages (`update_weights_here`,
        `gathered_flush`). While paused, queued adds and aborts wait for the step after
        /continue_generation: an add holds nothing on its rank yet (it runs on the new
        weights), an abort's request is one of the paused ones until then."""
        if self._later:  # (their outcomes come with a step, and none runs while paused)
            self._collect_ended()
        return (not self.paused and self.has_unfinished()) or bool(self._later)

    def flush_cache(self) -> bool:
        """`Engine.flush_cache` on every rank (each holds a prefix cache of its own), with
        nothing running, waiting or held on any rank, or while `paused` nothing running
        (after a pause "retract"); False, no rank's dropped, where one rank had something."""
        if self._busy():
            return False
        return self._on_every_rank("gathered_flush")

    def retract_all(self) -> None:
        """`Engine.retract_all` on every rank (SGLang's pause "retract"): each gives back
        the pages of the requests it schedules, which compute their KV again (or reload it
        from the rank's host tier) once stepping resumes."""
        self._on_every_rank("retract_all")

    # Engine's, each on every rank through this class's `_on_every_rank` (the rest of what
    # they read is rank 0's engine's, or this class's: `_busy`, `paused`)
    update_weights = Engine.update_weights
    refuse_update = Engine.refuse_update
    join_weight_group = Engine.join_weight_group
    leave_weight_group = Engine.leave_weight_group
    get_weights_by_name = Engine.get_weights_by_name
    start_profile = Engine.start_profile
    stop_profile = Engine.stop_profile
    start_expert_distribution_record = Engine.start_expert_distribution_record
    stop_expert_distribution_record = Engine.stop_expert_distribution_record
    dump_expert_distribution_record = Engine.dump_expert_distribution_record
    refuse_if_released = Engine.refuse_if_released
    release_memory_occupation = Engine.release_memory_occupation
    resume_memory_occupation = Engine.resume_memory_occupation
    sleep = Engine.sleep
    wake_up = Engine.wake_up

    def _on_every_rank(self, method: str, *args: Any) -> Any:
        with self.leader.lock, self.local.rank_failures():
            self.leader.send(("every_rank", method, *args))
            return self.local.every_rank_call(method, *args)

    # --- a PD decode server's requests (`dsakv.engine.disagg`), on every rank ---------------

    def reserve_detached(self, prompt_ids: list[int], params: SamplingParams) -> Request | None:
        """`Engine.reserve_detached` on the rank with the most room that takes it (the most
        free pages may still be at its share of --max-running-requests); the prefill server
        writes into that rank's pool (`Request.dp_rank` says which: `on_ranks` registered
        each). None while no rank takes it, or its grammar compiles on the rank (the caller
        retries)."""
        self.local.check_awake()
        ids = list(prompt_ids)
        self._check_remote(params, ids)
        for rank in self._by_room():
            if rank == 0:
                req = self.local.reserve_detached(ids, params)
                self._refresh_local()
                if req is not None:
                    return req
                continue
            req = Request(ids, params, dp_rank=rank)
            pages = self._on_rank(rank, "reserve", req.rid, ids, params)[rank]
            if pages == _COMPILING:
                return None
            if pages is not None:
                req.pages = pages
                return req
        return None

    def _refresh_local(self) -> None:
        """Rank 0's load now, as another rank's comes back with each op (`_by_room`)."""
        self._reports[0] = self._reporter.load()

    def hold(self, req: Request) -> None:
        """`Engine.hold` where `req` runs (another rank's: with the step that adds it)."""
        if req.dp_rank == 0:
            self.local.hold(req)
        else:
            self._holds.append((req.dp_rank, req.rid))

    def release_held(self, req: Request) -> None:
        if req.dp_rank == 0:
            self.local.release_held(req)
        else:
            self._on_rank(req.dp_rank, "release", req.rid)

    def drop_detached(self, req: Request) -> None:
        if req.dp_rank == 0:
            self.local.drop_detached(req)
            self._refresh_local()
            return
        req.finish_reason, req.status = "abort", Status.FINISHED
        self._on_rank(req.dp_rank, "drop", req.rid)

    def start_decoding(
        self, req: Request, first_token: int | None, routed: torch.Tensor | None = None
    ) -> None:
        """`Engine.start_decoding` where `req` was reserved: another rank's gets what the
        mirror got from the prefill server (moved there: its updates bring them back), and
        its first update is mirrored at once."""
        if req.dp_rank == 0:
            self.local.start_decoding(req, first_token, routed)
            return
        grown = {}
        for name in _GROWING:
            values = getattr(req, name)
            grown[name] = values[:]
            values.clear()
        m = req.metrics
        waited = time.perf_counter() - m.arrival_time
        args = (req.rid, first_token, routed, grown, waited, m.prefix_hit_tokens)
        try:
            up = self._on_rank(req.dp_rank, "start", *args)[req.dp_rank]
        except DsakvError:  # (dropped there: it has ended, as one that fails here has)
            for name, values in grown.items():
                getattr(req, name).extend(values)
            req.finish_reason, req.status = "abort", Status.FINISHED
            raise
        req.status = Status.RUNNING
        self._remote[req.rid] = (req.dp_rank, req)
        self._sent[req.rid] = m.arrival_time  # (the rank's times count from the arrival)
        self._mirror(up)

    def on_ranks(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """`fn(engine, kept, *args)` on every rank but 0, between steps: `fn` picklable (a
        module's function), given that rank's `Engine` and a dict for what must last while
        the rank runs (its registered pool); their results in rank order from rank 1."""
        return self._on_rank(None, "call", fn, *args)[1:]

    def on_rank_later(self, rank: int, key: int, fn: Callable[..., Any], *args: Any) -> Future:
        """`on_ranks`' `fn` on a thread of rank `rank` (not 0) while the ranks step; the
        future gets its result (or a `DsakvError`) with a later report. `key`: unique among
        that rank's calls still running (a request's rid)."""
        if rank == 0:
            raise ValueError("on_rank_later runs on another rank (rank 0 runs its own)")
        fut: Future = Future()
        self._later[rank, key] = fut
        try:
            self._on_rank(rank, "call_later", key, fn, *args)
        except BaseException:
            del self._later[rank, key]
            raise
        return fut

    def _ended(self, rank: int, report: RankReport) -> None:
        """Settle the futures of `rank`'s calls that `report` says ended."""
        for key, (kind, value) in report.done:
            fut = self._later.pop((rank, key))
            if kind == "ok":
                fut.set_result(value)
            else:
                fut.set_exception(DsakvError(value))

    def _on_rank(self, rank: int | None, op: str, *args: Any) -> list[Any]:
        """Every rank's result of `_Reporter.on_rank` (None where it did not run); an op
        that failed raises here."""
        with self.leader.lock, self.local.rank_failures():
            msg = ("on_rank", rank, op, args)
            self.leader.send(msg)
            outcomes = self._reporter.on_rank(msg)
        for r, out in enumerate(outcomes):
            if out is not None:  # (its load now: /metrics and `_by_room` read it)
                self._reports[r] = out[2]
                self._ended(r, out[2])
        outcomes = [("ok", None) if out is None else out[:2] for out in outcomes]
        whys = [why if kind == "error" else None for kind, why in outcomes]
        if any(whys):
            raise DsakvError(by_rank(whys))
        return [result for _, result in outcomes]

    # --- the step ------------------------------------------------------------------------------

    def step(self) -> list[Request]:
        busy = self._remote or self._adds or self._aborts or self.local.has_unfinished()
        if self._later and not busy:  # (only calls on ranks: no rank has a batch to run)
            return self._poll()
        with self.leader.lock, self.local.rank_failures():
            msg = ("step", self._adds, self._aborts, self._holds)
            self._adds, self._aborts, self._holds = [], [], []
            sent = time.perf_counter()
            self._sent.update((rid, sent) for _, rid, _, _ in msg[1] if rid in self._remote)
            self.leader.send(msg)
            self._reporter.apply(msg)
            out = self.local.step()
            reports = self.parallel.gather_objects(self._reporter.report(out))
        self._reports = reports
        for r, report in enumerate(reports):
            self._ended(r, report)
        self._assigned_tokens = [0] * self.parallel.world_size
        self.peak_running = max(
            self.peak_running, sum(int(r.counters["running_requests"]) for r in reports)
        )
        for report in reports[1:]:
            for up in report.updates:
                mirror = self._mirror(up)
                if mirror is not None:
                    out.append(mirror)
        return out

    def _poll(self) -> list[Request]:
        """Ask the ranks whose `on_rank_later` calls run for their outcomes, a little later,
        instead of a step that every rank joins with an empty batch (a model forward)."""
        time.sleep(_POLL_S)
        self._collect_ended()
        return []

    def _collect_ended(self) -> None:
        """Settle the futures of the `on_rank_later` calls that ended on their ranks."""
        self._on_rank(None, "poll")

    def _mirror(self, up: dict[str, Any]) -> Request | None:
        entry = self._remote.get(up["rid"])
        if entry is None:
            return None  # aborted here meanwhile
        mirror = entry[1]
        for name in _GROWING:
            getattr(mirror, name).extend(up[name])
        for name in _REPLACED:
            setattr(mirror, name, up[name])
        m = mirror.metrics
        sent = self._sent.get(up["rid"], m.arrival_time)  # (the peer's times count from it)
        if up["ttft_s"] is not None:
            m.first_token_time = sent + up["ttft_s"]
        if up["latency_s"] is not None:
            m.finish_time = sent + up["latency_s"]
        if up["queued_s"] is not None:
            m.scheduled_time = sent + up["queued_s"]
        for name in _COUNTS:
            setattr(m, name, up[name])
        if "pages" in up:  # (held for a PD prefill server: what it ships)
            mirror.pages = up["pages"]
        if mirror.finish_reason is not None:
            mirror.status = Status.FINISHED
            del self._remote[up["rid"]]
            self._sent.pop(up["rid"], None)
        return mirror

    # --- introspection -------------------------------------------------------------------------

    def counters(self) -> dict[str, float]:
        """Every rank's counters (`rank_counters`) summed; per-token sizes as they are, and
        the steps and their time rank 0's: the ranks step together, so the server's steps
        are each rank's (summed, they read the rank count times too many)."""
        ranks = self.rank_counters()
        self.rank_snapshot = ranks
        mine = ranks[0]
        total: dict[str, float] = dict(mine)
        for c in ranks[1:]:
            for k, v in c.items():
                total[k] = total.get(k, 0) + v
        for k in ("bytes_per_token", "index_k_bytes_per_token_saved", "steps", "step_time_s"):
            total[k] = mine[k]
        total["peak_running_requests"] = self.peak_running
        total["dp_ranks"] = self.parallel.world_size
        return total

    def lora_requests(self) -> None:
        """None: LoRA adapters do not run under DP attention (`EngineConfig` refuses them;
        the other ranks report counters only)."""
        return None

    def rank_counters(self) -> list[dict[str, float]]:
        """Each rank's counters: rank 0's as they stand, the others' as of the last step (an
        abort here frees its request with no step after it), with the requests routed to
        them since and not yet sent counted as waiting there."""
        ranks = [self.local.counters()] + [dict(r.counters) for r in self._reports[1:]]
        for rank, rid, ids, _ in self._adds:
            if rid in self._remote:  # (not aborted meanwhile)
                ranks[rank]["waiting_requests"] += 1
                ranks[rank]["waiting_tokens"] += len(ids)
        return ranks

    def check_integrity(self) -> None:
        """Every rank checks its own pool, prefix cache and hot buffers (each schedules its
        own requests); any rank's failure, named by rank."""
        outcome = self._on_every_rank("gathered_integrity")
        if isinstance(outcome, str):
            raise AssertionError(outcome)

    def close(self) -> None:
        """Stop the other ranks and release the group; completes after a rank died too."""
        try:
            self.leader.stop()
        finally:
            self._reporter.close()
            self.local.close()
