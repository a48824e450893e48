"""Continuous batching: which requests run this step, with how many tokens each.

Every step runs each running request's next chunk (one token when decoding) and admits
waiting requests under the prefill token budget. Pages are reserved before a request
runs; when they run out mid-decode the newest requests are retracted, to the host tier
when it has room (their KV comes back bit-exact), else to be recomputed later. Under
priority scheduling the waiting queue is ordered by priority and the lowest-priority
requests are retracted first, under SGLang's also to let in a waiting request of higher
priority; under SGLang's lpm it is ordered by how much of each prompt the prefix cache
holds.
"""

from __future__ import annotations

import bisect
import sys
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dsakv.memory.allocator import OutOfPages, PageAllocator, ReqToTokenTable, page_slots
from dsakv.memory.host import HostPool

from .lora import LoraRegistry
from .prefix_cache import Node, PrefixCache
from .request import Request, Status


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int
    chunked_prefill_size: int = 512  # prefill tokens per step, across requests
    max_running_requests: int = 256
    enable_prefix_cache: bool = True
    # Share of each request's remaining max_tokens reserved at admission; it decays while
    # decoding goes well and jumps back after a retraction (SGLang's new_token_ratio).
    init_new_token_ratio: float = 0.5
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.002
    # Which waiting request goes first: 0, the first to come (FCFS); 1, the lowest
    # `params.priority` (vLLM's --scheduling-policy priority); -1, the highest (SGLang's
    # --enable-priority-scheduling); ties by arrival. A running request short of pages
    # retracts the lowest-priority one (`_victim`).
    priority_sign: int = 0
    # How a waiting request gets past running ones of lower priority. None, vLLM's: they
    # keep no headroom from it (vLLM admits a request once its own pages are free), and are
    # retracted when they cannot grow; a request without a priority has 0. An int, SGLang's
    # --priority-scheduling-preemption-threshold: it retracts those whose priority is worse
    # than its own by more than this, if that lets it in (`_preempt_for`); a request without
    # a priority goes after every other.
    preemption_threshold: int | None = None
    # SGLang's lpm: the waiting requests with the most prompt pages cached go first
    # (`_longest_prefix_first`).
    longest_prefix_first: bool = False


# Past this many waiting requests lpm is first come first served (as SGLang's): it matches
# every waiting prompt against the cache each step.
LPM_MAX_WAITING = 128
# What an admission returns when it retracted running requests to let the request in: it is
# tried again (`Scheduler._admit`).
_RETRY = -1


@dataclass
class SchedulerStats:
    prefix_hit_tokens: int = 0  # every tier's: device, host, L3
    # vLLM's split of them: its prefix cache is the device's; the host tier and L3 are its
    # KV connector's, asked about what the device lacks (`Scheduler._admit_fresh`)
    device_hit_tokens: int = 0
    external_query_tokens: int = 0
    retractions: int = 0
    retractions_to_host: int = 0
    peak_running: int = 0


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        allocator: PageAllocator,
        cache: PrefixCache,
        host: HostPool | None,
        l3: Any = None,
        hot: Any = None,
        lora: LoraRegistry | None = None,
    ) -> None:
        self.config = config
        self.allocator = allocator
        self.cache = cache
        self.host = host
        self.l3 = l3  # the storage tier (`dsakv.engine.l3.L3Cache`), or None
        self.hot = hot  # HiSparse device latent slots (`dsakv.engine.hisparse`), or None
        # LoRA adapters' slots (`dsakv.engine.lora`): a request runs once its adapter has one
        self.lora = lora
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order; the newest is retracted first
        self.req_to_token = ReqToTokenTable()  # rid -> token slot of each position
        self.stats = SchedulerStats()
        self.new_token_ratio = config.init_new_token_ratio
        self.held: set[int] = set()  # rids whose pages outlive their finish (`release_held`)
        # Requests holding pages outside the queues, which come back without a step: a
        # prefill server's finished ones until shipped, a decode server's reservations.
        self.parked: dict[int, Request] = {}
        # A decode server's requests whose KV came (parked still) and whose LoRA adapter
        # waits for a slot (`adopt`): they run before any waiting request is admitted.
        self.adopted: deque[Request] = deque()

    # --- public ---------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        self._enqueue(req)
        self._prefetch(req)

    def _rank(self, req: Request) -> tuple[int, int]:
        """Its place under priority scheduling, the lowest first: priority, then arrival
        (rids are numbered as requests come)."""
        return self._priority(req), req.rid

    def _priority(self, req: Request) -> int:
        """Its priority, the lowest value first (`priority_sign` applied); one not given is
        vLLM's 0, or under SGLang's priority scheduling after every other (SGLang's)."""
        p = req.params.priority
        if p is None:
            return 0 if self.config.preemption_threshold is None else sys.maxsize
        return self.config.priority_sign * p

    def _enqueue(self, req: Request, retracted: bool = False) -> None:
        """Queue `req` by its rank under priority scheduling; else last, or first when
        `retracted` (it was admitted before any other waiting one)."""
        if self.config.priority_sign:
            self.waiting.insert(bisect.bisect(self.waiting, self._rank(req), key=self._rank), req)
        elif retracted:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def _prefetch(self, req: Request) -> None:
        """Start looking up the request's prompt pages beyond the prefix cache in L3."""
        if self.l3 is None or not self.config.enable_prefix_cache:
            return
        max_pages = self._hit_pages(req, req.seq_len)
        nodes = self.cache.match(req.all_ids, max_pages, req.cache_key)
        parent = nodes[-1].hash if nodes else req.cache_root
        self.l3.prefetch(req.rid, req.all_ids, len(nodes), parent, max_pages)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.adopted)

    def schedule(self) -> list[tuple[Request, int]]:
        """This step's batch: (request, number of new tokens) pairs."""
        batch: list[tuple[Request, int]] = []
        budget = self.config.chunked_prefill_size
        retractions = self.stats.retractions
        for req in list(self.adopted):  # (each takes a slot: asked one at a time)
            if self.lora.can_run(req.lora):
                self.adopted.remove(req)
                self._run_adopted(req)
        for req in list(self.running):
            if req.status is not Status.RUNNING:
                continue  # retracted earlier in this loop
            n = self._step_tokens(req, req.num_computed, budget)
            if n > 0 and self._make_room(req, req.num_computed + n):
                batch.append((req, n))
                if req.seq_len - req.num_computed > 1:
                    budget -= n
        if self.stats.retractions > retractions:
            # (under HiSparse the victim may be older than the request that needed room,
            # and already in the batch)
            batch = [(r, n) for r, n in batch if r.status is Status.RUNNING]
            c = self.config
            self.new_token_ratio = min(1.0, max(2 * self.new_token_ratio, c.init_new_token_ratio))
        else:
            self.new_token_ratio = max(
                self.config.min_new_token_ratio,
                self.new_token_ratio - self.config.new_token_ratio_decay,
            )
            self._admit(batch, budget)
        self.stats.peak_running = max(self.stats.peak_running, len(self.running))
        return batch

    def _step_tokens(self, req: Request, start: int, budget: int) -> int:
        """How many of `req`'s tokens from position `start` run this step (0: none yet).
        HiSparse prefills only what the device latent pool holds (`HotBuffers.prefill_end`)
        and runs the rest one token a step, as decode steps; a one-token chunk would be a
        decode step too early, so it waits for more budget."""
        remaining = req.seq_len - start
        n = 1 if remaining == 1 else min(remaining, budget)
        if self.hot is not None:
            left = self.hot.prefill_end(req) - start
            n = 1 if left <= 1 else min(n, left)
            if n == 1 < left:
                return 0
        return n

    def _make_room(self, req: Request, tokens: int) -> bool:
        """Pages for `tokens` positions of `req`, retracting others (`_victim`) until they
        are free; False when `req` itself went."""
        while not self.reserve(req, tokens):
            victim = self._victim()
            self.retract(victim)
            if victim is req:
                return False
        return True

    def _victim(self) -> Request:
        """The running request to retract first (`_retract_order`)."""
        return self._retract_order()[0]

    def _retract_order(self) -> list[Request]:
        """Running requests, the first to retract first: the newest, or under priority
        scheduling the lowest priority (the newest of those, vLLM's). Under HiSparse one
        whose prompt the device latent pool cannot hold (a PD decode server's) is cut short
        if retracted where no host tier takes it, so it goes only when no other can."""
        if self.config.priority_sign:
            order = sorted(self.running, key=self._rank, reverse=True)
        else:
            order = self.running[::-1]
        if self.hot is not None:
            order.sort(key=lambda r: not self.hot.fits(len(r.prompt_ids)))  # (stable)
        return order

    def _preemptible(self, req: Request) -> list[Request]:
        """The running requests waiting `req` may retract to be admitted, the first to go
        first: under SGLang's priority scheduling those whose priority is worse than its own
        by more than `preemption_threshold` and that can come back (none under vLLM's)."""
        if self.config.preemption_threshold is None or not self.config.priority_sign:
            return []
        mine = self._priority(req)
        return [
            r
            for r in self._retract_order()
            if self._priority(r) - mine > self.config.preemption_threshold
            and (self.hot is None or self.hot.fits(len(r.prompt_ids)))
        ]

    def _preempt_for(self, req: Request, pages: int, hit: Sequence[Node] = ()) -> bool:
        """Retract the fewest of the running requests `req` may preempt (`_preemptible`) that
        let it in (`_fits`), or none when all of them would not (SGLang's preempt_to_schedule:
        a retraction that does not let it in only costs a recompute); whether any went."""
        victims = self._preemptible(req)
        if not victims or not self._fits(req, pages, victims, hit):
            return False
        k = next(k for k in range(1, len(victims) + 1) if self._fits(req, pages, victims[:k], hit))
        for victim in victims[:k]:
            self.retract(victim)
        return True

    def _fits(
        self, req: Request, pages: int, without: Sequence[Request] = (), hit: Sequence[Node] = ()
    ) -> bool:
        """Whether waiting `req` can be admitted with `pages` pages beside the cached `hit` it
        locks: a running slot, the pages beyond the headroom running requests keep
        (`_future_pages`), and under HiSparse its device latent; as if the running requests
        `without` were retracted. Under vLLM's priority scheduling those of lower priority
        than `req` keep none from it."""
        gone = {r.rid for r in without}
        kept = [r for r in self.running if r.rid not in gone]
        if len(kept) >= self.config.max_running_requests:
            return False
        vllm = self.config.priority_sign and self.config.preemption_threshold is None
        mine = self._priority(req)
        headroom = sum(
            self._future_pages(r, len(r.pages))
            for r in kept
            if not (vllm and self._priority(r) > mine)
        )
        if pages + headroom > self._room(without, hit):
            return False
        if self.hot is None:
            return True
        return self.hot.can_admit(req, freed=sum(self.hot.held_pages(r) for r in without))

    def _room(self, without: Sequence[Request], hit: Sequence[Node]) -> int:
        """`available_pages` once the running requests `without` are retracted (their own
        pages, and the cached ones no other request locks), less those of `hit`: the request
        admitted locks them, no room for its own pages (counted as room, a retraction for it
        could let nothing in)."""
        locks = Counter(id(n) for r in without for n in r.prefix_nodes)
        nodes = {id(n): n for r in without for n in r.prefix_nodes}

        def unlocked(n: Node) -> bool:  # (on the device, evictable or freed once they go)
            return n.page is not None and n.lock_ref == locks[id(n)]

        own = sum(len(r.pages) - r.num_cached_pages for r in without)
        freed = sum(map(unlocked, nodes.values())) - sum(map(unlocked, hit))
        return self.available_pages() + own + freed

    def finish(self, req: Request) -> None:
        """Release a finished or aborted request's pages; its full pages join the cache."""
        if req.rid in self.held and req.finish_reason != "abort":
            self._unqueue(req)  # a prefill server ships the pages first, then `release_held`
            self.parked[req.rid] = req
            return
        self.held.discard(req.rid)
        self.parked.pop(req.rid, None)
        self._unqueue(req)
        if self.l3 is not None:
            self.l3.cancel(req.rid)
        if self.hot is not None:
            self.hot.free(req)
        if req.host_slots is not None:
            self.host.free(req.host_slots)
            req.host_slots = None
        keep = 0
        if self._caches(req) and req.pages and req.kv_kept:
            tokens, salt = req.all_ids[: req.num_computed], req.cache_key
            path = self.cache.insert(tokens, req.pages, req.num_cached_pages, salt)
            keep = len(path)
        private = req.pages[max(keep, req.num_cached_pages) :]
        self.cache.unlock(req.prefix_nodes)
        if req.model_fault:  # the pages it put in the tree (past its first hit)
            self.cache.discard(
                req.prefix_nodes[req.metrics.prefix_hit_tokens // self.config.page_size :]
            )
        if private:
            self.allocator.free(private)
        self._drop_pages(req)
        req.status = Status.FINISHED

    # --- prefill/decode disaggregation (dsakv.disagg) -------------------------------------

    def release_held(self, req: Request) -> None:
        """`finish` a request held in `held` now that its pages have been shipped."""
        self.held.discard(req.rid)
        self.finish(req)

    def reserve_detached(self, req: Request, tokens: int) -> bool:
        """Pages for the first `tokens` positions of a request that is not queued (a decode
        server's: a prefill server writes its prompt KV), if running requests keep their
        headroom and `max_running_requests` is not reached (counting those reserved, which
        `adopt` runs without asking, and the retracted, which come back). The retracted come
        back first, as SGLang's: a reservation takes only what is left beyond the pages (and
        HiSparse's device latent) each waiting one needs to resume (new reservations took
        every hot buffer freed, and a prompt to prefill again under HiSparse waited for
        good). `adopt` runs it, `finish` (abort) gives the pages back."""
        admitted = len(self.running) + len(self.parked) + len(self.waiting)
        if admitted >= self.config.max_running_requests:
            return False
        owed = sum(self._future_pages(r, 0) for r in self.waiting)
        if self._pages_for(tokens) + self._headroom() + owed > self.available_pages():
            return False
        if self.hot is not None and not self.hot.can_admit(req, True, self.waiting):
            return False
        if not self.reserve(req, tokens):
            return False
        req.kv_epoch = self.cache.epoch
        if self.hot is not None:
            self.hot.admit_detached(req)  # the latent arrives in host memory
        self.parked[req.rid] = req
        return True

    def adopt(self, req: Request) -> None:
        """Run a request whose first `num_computed` positions' KV is already in its pages;
        one whose LoRA adapter finds no slot keeps its pages parked and waits in `adopted`
        (as a waiting request on it would, in `_admit`) until `schedule` finds it one."""
        if self.lora is not None and not self.lora.can_run(req.lora):
            self.adopted.append(req)
        else:
            self._run_adopted(req)

    def _run_adopted(self, req: Request) -> None:
        self.parked.pop(req.rid, None)
        req.status = Status.RUNNING
        req.metrics.scheduled()
        self.running.append(req)
        if self.lora is not None:
            self.lora.start(req.lora)
        self.stats.peak_running = max(self.stats.peak_running, len(self.running))

    def _unqueue(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
            if self.lora is not None:
                self.lora.stop(req.lora)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.adopted:
            self.adopted.remove(req)
        req.status = Status.FINISHED

    def cache_prefix(self, req: Request) -> None:
        """Share a running request's computed full pages through the prefix cache now, so
        requests arriving while it still decodes can hit them. The request keeps using the
        tree's pages (locked); where another request already cached the same tokens, its own
        duplicate page is freed and it switches to the cached one."""
        if not self._caches(req):
            return
        ids, salt = req.all_ids[: req.num_computed], req.cache_key
        path = self.cache.insert(ids, req.pages, req.num_cached_pages, salt)
        if len(path) <= req.num_cached_pages:
            return
        self.cache.lock(path[req.num_cached_pages :])
        req.prefix_nodes = path
        pages = [n.page for n in path] + req.pages[len(path) :]
        self.req_to_token.release(req.rid)
        req.pages = []
        self._add_pages(req, pages)

    def _caches(self, req: Request) -> bool:
        """Whether `req`'s pages may join the prefix cache: not where weights updated since
        its KV was first computed (paused through the update: that KV is the old weights',
        or mixed), which then serves that request alone."""
        return self.config.enable_prefix_cache and req.kv_epoch == self.cache.epoch

    def retract(self, req: Request) -> None:
        """Give up a running request's pages; it resumes later from the host or by recompute."""
        self.running.remove(req)
        if self.lora is not None:
            self.lora.stop(req.lora)
        self.stats.retractions += 1
        req.metrics.retractions += 1
        n = req.num_computed
        if self.host is not None and n > 0:
            slots = self.slots(req, n)
            # A running request's KV outranks the coldest cached prefixes on the host.
            self.cache.free_host_pages(-(-n // self.config.page_size))
            try:
                req.host_slots = self.host.backup(slots)
                self.stats.retractions_to_host += 1
            except OutOfPages:
                pass
        if self.hot is not None:
            self.hot.free(req)
        self.cache.unlock(req.prefix_nodes)
        if req.pages[req.num_cached_pages :]:
            self.allocator.free(req.pages[req.num_cached_pages :])
        self._drop_pages(req)
        req.num_computed = 0
        req.status = Status.WAITING
        self._enqueue(req, retracted=True)
        if req.host_slots is None:
            self._prefetch(req)

    def retract_all(self) -> None:
        """Retract every running request, the newest first, so that the oldest (under
        priority scheduling: the first by rank) heads the waiting queue again."""
        for req in reversed(list(self.running)):
            self.retract(req)

    def slots(self, req: Request, n: int):
        """Token slots of the request's first `n` positions."""
        return self.req_to_token.get(req.rid, n)

    def reserve(self, req: Request, tokens: int) -> bool:
        """Extend `req.pages` to cover `tokens` positions, evicting cached pages but never
        retracting; False when no pages can be found (speculative decoding's extra
        positions are optional, so it asks here rather than through `_make_room`)."""
        need = self._pages_for(tokens) - len(req.pages)
        if need <= 0:
            return True
        try:
            self._add_pages(req, self.cache.alloc(need))
            return True
        except OutOfPages:
            return False

    def available_pages(self) -> int:
        """Pages admission can count on: free ones plus cached ones no request has locked."""
        return self.allocator.num_free_pages + self.cache.num_evictable_pages

    # --- internals ------------------------------------------------------------------------

    def _add_pages(self, req: Request, pages: list[int]) -> None:
        req.pages.extend(pages)
        self.req_to_token.extend(req.rid, page_slots(pages, self.config.page_size))

    def _drop_pages(self, req: Request) -> None:
        """Forget the request's pages (the caller has freed or handed them over)."""
        req.pages, req.prefix_nodes = [], []
        if req.rid in self.req_to_token:
            self.req_to_token.release(req.rid)

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.config.page_size)

    def _admit(self, batch: list[tuple[Request, int]], budget: int) -> None:
        """Admit waiting requests in queue order while the budget lasts. One whose LoRA
        adapter finds no slot (every slot held by running requests' adapters) keeps its
        place and is skipped, as vLLM's scheduler skips it: the base model's requests and
        those on resident adapters behind it go on."""
        if self.config.longest_prefix_first:
            self._longest_prefix_first()
        i = 0
        while i < len(self.waiting) and budget > 0:
            req = self.waiting[i]
            full = len(self.running) >= self.config.max_running_requests
            if full and not self._preemptible(req):
                return
            if self.lora is not None and not self.lora.can_run(req.lora):
                i += 1
                continue
            if self.l3 is not None:
                start = self.l3.starts_at(req.rid)
                lost = start and len(self.cache.match(req.all_ids, start, req.cache_key)) < start
                if lost and req.host_slots is None:
                    self._prefetch(req)  # the cache lost pages since: L3 may still hold them
                if not self.l3.ready(req.rid, idle=not self.running):
                    return  # its L3 lookup is still running; running requests step on
            if req.host_slots is not None:
                n = self._admit_from_host(req, budget)
            else:
                n = self._admit_fresh(req, budget)
            if n == _RETRY:  # (a retracted prefill chunk gives its budget back)
                budget += sum(k for r, k in batch if r.status is not Status.RUNNING and k > 1)
                batch[:] = [(r, k) for r, k in batch if r.status is Status.RUNNING]
                i = 0  # (the retracted were queued ahead; a slot may have freed)
                continue
            if n == 0:
                return
            del self.waiting[i]
            req.status = Status.RUNNING
            req.metrics.scheduled()
            self.running.append(req)
            if self.lora is not None:
                self.lora.start(req.lora)
            batch.append((req, n))
            budget -= n

    def _longest_prefix_first(self) -> None:
        """Order the waiting queue by cached prompt pages, most first, ties in queue order:
        a request whose prefix the cache holds runs before its pages are evicted, and costs
        the step least (SGLang's lpm). A request retracted to the host tier holds all of its
        KV there."""
        if not self.config.enable_prefix_cache or not 1 < len(self.waiting) <= LPM_MAX_WAITING:
            return
        ps = self.config.page_size

        def cached(req: Request) -> int:
            if req.host_slots is not None:
                return req.host_slots.numel() // ps
            hit = self._hit_pages(req, req.seq_len)
            return len(self.cache.match(req.all_ids, hit, req.cache_key))

        order = sorted(self.waiting, key=lambda r: -cached(r))
        self.waiting.clear()
        self.waiting.extend(order)

    def _future_pages(self, req: Request, held: int) -> int:
        """Pages `req` is expected to need beyond the `held` it has: the rest of its known
        tokens plus `new_token_ratio` of the output it may still generate."""
        remaining = req.params.max_tokens - len(req.output_ids)
        expected = req.seq_len + int(self.new_token_ratio * remaining + 0.999)
        return max(0, self._pages_for(expected) - held)

    def _headroom(self) -> int:
        """Pages kept free at admission so running requests can keep decoding."""
        return sum(self._future_pages(r, len(r.pages)) for r in self.running)

    def _hit_pages(self, req: Request, end: int) -> int:
        """How many pages of `req`'s first `end` positions the prefix cache and L3 may serve:
        never the last one's (the step computes it), and while its prompt is scored none
        from `prompt_logprobs_start` on, whose rows give the scores (SGLang's cap at
        logprob_start_len); while it keeps rows by position (`Request.capture`), none of the
        positions it still lacks from its `routed_experts_start_len` on (SGLang serves them
        and reads their routing from a table it keeps per KV slot: no cap there)."""
        if req.score_prompt:
            end = min(end, req.params.prompt_logprobs_start + 1)
        if req.capture is not None:
            end = min(end, max(req.capture.start, req.capture.filled) + 1)
        return (end - 1) // self.config.page_size

    def _admit_fresh(self, req: Request, budget: int) -> int:
        """Admit `req` with its prefix-cache and L3 hits: the tokens it runs this step, 0 when
        it cannot start now, or `_RETRY` when running requests were retracted to let it in
        (`_preempt_for`; a retraction to the host tier may drop host pages it matched)."""
        nodes: list = []
        # at most what the step computes in one go (HiSparse: a hit's latent goes on the device)
        end = req.seq_len if self.hot is None else self.hot.prefill_end(req)
        max_pages = self._hit_pages(req, end)
        if self.config.enable_prefix_cache:
            nodes = self.cache.match(req.all_ids, max_pages, req.cache_key)
        stored = self.l3.pages_for(req.rid, len(nodes)) if self.l3 is not None else []
        stored = stored[: max(0, max_pages - len(nodes))]
        hit = (len(nodes) + len(stored)) * self.config.page_size
        n = self._step_tokens(req, hit, budget)
        if n == 0:
            return 0
        own = max(self._pages_for(hit + n), self._future_pages(req, 0)) - len(nodes)
        on_host = sum(1 for x in nodes if x.page is None)  # (a path's tail: leaves go first)
        pages = own + on_host
        if not self._fits(req, pages, hit=nodes):
            return _RETRY if self._preempt_for(req, pages, nodes) else 0
        self.cache.lock(nodes)
        try:
            self.cache.promote(nodes)
            self._add_pages(req, [x.page for x in nodes])
            req.prefix_nodes = nodes
            req.num_computed = hit
            req.kv_epoch = self.cache.epoch
            if not self.reserve(req, hit + n):
                raise OutOfPages("admission")
            if self.l3 is not None:  # L3 pages are the request's own, as if computed
                self.l3.admitted(req.rid, stored, req.pages[len(nodes) : len(nodes) + len(stored)])
            if self.hot is not None:
                self.hot.admit(req, self.slots(req, hit))
        except OutOfPages:
            self.cache.unlock(nodes)
            if req.pages[len(nodes) :]:
                self.allocator.free(req.pages[len(nodes) :])
            self._drop_pages(req)
            req.num_computed = 0
            return 0
        if not req.metrics.retractions:
            # SGLang's cached_tokens: the first admission's hit only, never past the prompt
            # (a re-admission finds the request's own pages; `prompt_tokens` counts it once)
            hit = min(hit, len(req.prompt_ids))
            req.metrics.prefix_hit_tokens = hit
            self.stats.prefix_hit_tokens += hit
            # vLLM's: the device's hit, and with a tier (its connector) the prompt past it
            device = min(hit, (len(nodes) - on_host) * self.config.page_size)
            self.stats.device_hit_tokens += device
            if self.host is not None or self.l3 is not None:
                self.stats.external_query_tokens += len(req.prompt_ids) - device
        return n

    def _admit_from_host(self, req: Request, budget: int) -> int:
        """Resume a request retracted to the host tier: load its KV back, then continue (what
        `_admit_fresh` returns). Under HiSparse its latent goes to the host rows: past what a
        prefill holds it takes a hot buffer only, loaded from there at its next step (a PD
        decode request's way), else what it computed is a prefix hit of its own."""
        hit = req.host_slots.numel()
        n = self._step_tokens(req, hit, budget)
        if n == 0:  # (HiSparse: a prefill chunk of one token waits)
            return 0
        own = max(self._pages_for(hit + n), self._future_pages(req, 0))
        if not self._fits(req, own):
            return _RETRY if self._preempt_for(req, own) else 0
        if not self.reserve(req, hit + n):
            return 0
        slots = self.slots(req, hit)
        self.host.load(req.host_slots, slots)
        if self.hot is not None:
            self.hot.admit_from_host(req, slots)
        self.host.free(req.host_slots)
        req.host_slots, req.num_computed = None, hit
        return n
