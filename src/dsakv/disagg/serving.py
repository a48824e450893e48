"""Prefill and decode servers: `AsyncEngine`s whose `generate_n` takes part in the handshake.

The OpenAI handlers (`dsakv.server.handlers`) are unchanged: they call `generate_n` and read the
stream it returns. On a prefill server that stream ends after the first token, once the
KV is in the decode server's pages; on a decode server it starts with the prefill side's
first token and goes on decoding. Each prompt's handoff (its bootstrap room: `dsakv
router`'s headers or SGLang's body fields) reaches `generate_n` through `handoff`.

vLLM's protocol (`kv_transfer_params`) runs the same two halves one after the other: the
prefill server answers once the prompt ran, its KV held for a pickup (`_hold_for_pickup`),
and writes it when the decode server's registration comes; the decode server registers as
for SGLang's, marked `pickup`, and runs the last prompt token itself, so that the first
token is chosen under its request's sampling params (vLLM's proxy drops min_tokens from the
prefill leg), as vLLM's decode server does.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from fastapi import FastAPI
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dsakv.engine import Engine, EngineConfig, Request, SamplingParams
from dsakv.engine import disagg as ops
from dsakv.engine.dp import DPEngine
from dsakv.errors import DsakvError
from dsakv.metrics import PREFIX
from dsakv.procs import Listener
from dsakv.server.protocol import APIError
from dsakv.server.rows import routed_base64, routed_base64_chars, routed_from_base64
from dsakv.server.runner import (
    AsyncEngine,
    Bridge,
    EngineThread,
    RequestStream,
    Update,
    _ended,
    _update,
)

from .bootstrap import BootstrapError, BootstrapServer, Refusal, describe, drop_kv, request_kv
from .config import DisaggConfig
from .handoff import (
    KVTransferParams,
    install,
    kv_transfer,
    kv_transfer_reply,
    next_target,
)
from .transfer import (
    TransferError,
    TransferStats,
    prompt_pages,
    register_pool,
    register_rank_pool,
    write_held,
)

log = logging.getLogger(__name__)

_RESERVE_POLL_S = 0.05


def _describe(engine: Engine) -> dict[str, Any]:
    return describe(engine.layout, engine.model_config, engine.model_identity, engine.compute)


def _checks(n: int, params: SamplingParams) -> None:
    """What neither protocol hands off."""
    if n != 1:
        raise APIError(400, "n > 1 is not supported with prefill/decode disaggregation", param="n")
    if params.prompt_logprobs is not None:
        raise APIError(
            400,
            "scoring the prompt (echo with logprobs, max_tokens 0, or SGLang's "
            "logprob_start_len) is not supported with disaggregation",
        )
    if params.return_hidden_states:  # (routed experts cross: `_prompt_routed`)
        raise APIError(
            400,
            "return_hidden_states is not supported with prefill/decode disaggregation: the "
            "prompt's rows are the prefill server's, which hands the decode server its KV and "
            "routed experts alone",
            param="return_hidden_states",
        )


def _prompt_routed(
    engine: Engine, reply: dict[str, Any], prompt_len: int, params: SamplingParams
) -> torch.Tensor | None:
    """The prompt's routed experts the prefill server sent with its first token (SGLang's
    R3 under PD: its router splices them in; here they cross with the hand-off), as the
    decode request keeps rows (`Capture.write`): int32 `[prompt_len - start, layers,
    top_k]`; None where not asked for. Missing or misshapen: a 502 (the decode server
    would report zeros for the prompt)."""
    if not params.return_routed_experts:
        return None
    n = prompt_len - params.routed_experts_start_len
    try:
        rows = routed_from_base64(reply.get("routed_experts"), engine.model_config.routed_shape(n))
    except (TypeError, ValueError) as e:  # (None: a prefill server that sends none)
        raise APIError(
            502,
            f"the prefill server sent no usable routed experts for the prompt's {n} "
            f"positions ({e}); is it an older dsakv?",
            type="server_error",
        ) from None
    return torch.from_numpy(rows.copy())


class _DisaggEngine(AsyncEngine):
    role = ""

    def __init__(
        self,
        engine: Engine,
        config: DisaggConfig,
        server_host: str,
        thread: EngineThread | None = None,
        layout: dict[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.layout = layout or _describe(engine)
        host = config.host_for(server_host)
        self.transfer = register_pool(engine, host)
        # Each rank's pool, by `Request.dp_rank`: under DP attention each rank's requests'
        # KV is in its own pool, which it registers and (a prefill server's) writes from.
        self.pools = [(self.transfer.session, self.transfer.describe())]
        if isinstance(engine, DPEngine):
            self.pools += engine.on_ranks(register_rank_pool, host)
        # Prefill: what it sent (counted by the transfer); decode: what it received.
        self.stats: TransferStats = self.transfer.stats
        super().__init__(engine, thread)  # starts the step loop
        self.pending = 0  # requests between handshake and KV (prefill: held pages)
        self._tasks: set[asyncio.Task] = set()

    def _spawn(self, coro: Any) -> None:
        """Run `coro` on the current loop, keeping a reference until it is done."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def attach(self, app: FastAPI) -> None:
        """Handoff middleware (on a prefill server: an error answer refuses the request's
        rooms; on a decode server: drops a vLLM hold not yet picked up), transfer metrics
        and `GET /disagg/info` on the server's app."""
        refuse = self.bootstrap.refuse if self.role == "prefill" else None
        drop = self._drop_hold if self.role == "decode" else None
        install(app, refuse, drop)
        app.state.metrics.registry.register(_TransferCollector(app.state.model_name, self))

        @app.get("/disagg/info")
        async def info() -> dict[str, Any]:
            return {
                "mode": self.role,
                "bootstrap_port": self.config.bootstrap_port if self.role == "prefill" else None,
                "session": self.transfer.session,
                "bytes_per_token": self.engine.layout.bytes_per_token,
                "fingerprint": self.engine.layout.fingerprint(),
                "compute": self.engine.compute,
                "pending": self.pending,
                "open_rooms": self.bootstrap.open_rooms if self.role == "prefill" else None,
                "transfer": self.stats.snapshot(),
                "integrity": await self._integrity(),
            }

    def weights_updated(self) -> None:
        """The handshake describes the weights served now: a peer on the old checkpoint is
        refused, one on the new is taken."""
        self.layout = _describe(self.engine)
        if self.role == "prefill":
            self.bootstrap.layout = self.layout

    def server_info(self) -> dict[str, Any]:
        port = self.config.bootstrap_port
        return {"disaggregation_mode": self.role, "disaggregation_bootstrap_port": port}

    async def _integrity(self) -> str:
        """`ok` when no page is held by anything but the prefix cache (idle, leak-free)."""

        def check(e: Engine) -> str:
            if e.has_unfinished() or self.pending:
                return "busy"
            try:
                e.check_integrity()
            except AssertionError as err:
                return f"leak: {err}"
            return "ok"

        return await self.call(check)

    def shutdown(self, timeout: float = 10.0) -> None:
        super().shutdown(timeout)
        self.transfer.close()


class PrefillAsyncEngine(_DisaggEngine):
    """Runs each prompt with max_tokens 1 and keeps its pages. SGLang's protocol: writes
    them into the pages of the decode server registered for its room, answers it (first
    token), then answers the client and lets the pages go. vLLM's: answers the client
    first (where the KV waits: `reply_extras`), then keeps the pages until a decode
    server's pickup, writes them into its pages, and lets them go."""

    role = "prefill"

    def __init__(
        self,
        engine: Engine,
        config: DisaggConfig,
        server_host: str,
        thread: EngineThread | None = None,
    ) -> None:
        layout = _describe(engine)
        self.bootstrap = BootstrapServer(
            server_host, config.bootstrap_port, layout, config.timeout_s
        )
        try:
            super().__init__(engine, config, server_host, thread, layout)
        except BaseException:
            self.bootstrap.close()
            raise
        self._writer = ThreadPoolExecutor(4, thread_name_prefix="dsakv-kv-write")
        # Where a decode server reaches the bootstrap (vLLM's remote_host): the server's
        # address, or this machine's where it listens on all of them
        wildcard = server_host in ("", "0.0.0.0", "::")
        self.bootstrap_host = config.host_for(server_host) if wildcard else server_host

    def before_weight_update(self) -> None:
        """The KV held for vLLM's pickups is the old weights' (and its pages keep the update
        off): let it go; a later pickup hears why (410). SGLang's holds last only through
        their write, to a decode server already registered: the update waits for them."""
        why = Refusal.gone(
            "the KV held for this room was let go: the prefill server's weights were updated "
            "(/update_weights_from_disk) before a decode request took it"
        )
        if n := self.bootstrap.let_go_holds(why):
            log.info("weight update: let %d held KV go", n)

    def forgo(self, n: int) -> None:
        """(The decode server waiting for the room hears so now, as `claim` tells it; a
        vLLM request has drawn no room yet.)"""
        if kv_transfer(self.role) is None:
            room = next_target(self.role).room
            self.bootstrap.refuse(room, "the prefill request was cancelled", 499)

    def reply_extras(self) -> dict[str, Any]:
        """vLLM's P/D: the answer's `kv_transfer_params`, where its prompt's KV waits."""
        return kv_transfer_reply()

    async def generate_n(
        self, prompt: str | list[int], params: SamplingParams, n: int
    ) -> list[RequestStream]:
        kv = kv_transfer(self.role)
        if kv is not None:
            return await self._hold_for_pickup(prompt, params, n, kv)
        target = next_target(self.role)
        _checks(n, params)
        if target.port not in (None, self.config.bootstrap_port):
            # Fail now: the decode server is knocking elsewhere, nobody would register.
            raise APIError(
                400,
                f"bootstrap port {target.port} is not this prefill server's "
                f"({self.config.bootstrap_port}): check the router's --prefill URL PORT",
                param="bootstrap_port",
            )
        # A prompt the engine refuses is the client's 400 now; claimed first, it waited out
        # the room's timeout for a decode server that had refused it too. (The decode server
        # waiting for the room hears the 400: `BootstrapMiddleware` refuses the room.)
        try:
            ids = await self.call(lambda e: e.prompt_ids(prompt, params.truncate_prompt_tokens))
            reg = await self.bootstrap.claim(target.room)
        except BootstrapError as e:
            self.stats.fail()
            raise APIError(502, str(e), type="server_error") from None
        except asyncio.CancelledError:  # aborted, or its client left, before the room came
            # (as `claim` does): the decode server waiting for the room hears so now and
            # gives its reserved pages back, not after the timeout
            self.bootstrap.refuse(target.room, "the prefill request was cancelled", 499)
            raise
        loop = asyncio.get_running_loop()
        shadow, public = RequestStream(loop), RequestStream(loop)
        try:
            if (
                params.truncate_prompt_tokens == -1
                and ids[-len(reg.prompt_ids) :] == reg.prompt_ids
            ):
                ids = reg.prompt_ids  # "as many as fit": the decode server's context may be less
            if ids != reg.prompt_ids:
                raise APIError(
                    502,
                    "the prefill and decode servers tokenized the prompt differently "
                    "(different tokenizers or chat templates?)",
                    type="server_error",
                )
            req = await self._queue_held(ids, params, reg.lora, shadow, public)
        except asyncio.CancelledError:  # the client (the router) left: not a failure here
            reg.fail("the prefill server's client hung up")
            raise
        except BaseException as e:
            reg.fail(getattr(e, "message", None) or f"prefill server: {e}")
            self.stats.fail()
            raise
        self.pending += 1
        self._spawn(self._ship(req, reg, shadow, public))
        return [public]

    async def _hold_for_pickup(
        self, prompt: str | list[int], params: SamplingParams, n: int, kv: KVTransferParams
    ) -> list[RequestStream]:
        """vLLM's prefill: run the prompt with max_tokens 1 in a room drawn here, answer
        (`kv.reply`: where its KV waits), and keep its pages for the decode server's pickup
        (`_keep_for_pickup`)."""
        _checks(n, params)
        room = self.bootstrap.hold()
        loop = asyncio.get_running_loop()
        shadow, public = RequestStream(loop), RequestStream(loop)
        try:
            ids = await self.call(lambda e: e.prompt_ids(prompt, params.truncate_prompt_tokens))
            req = await self._queue_held(ids, params, None, shadow, public, check_lora=False)
        except BaseException:
            self._refuse_hold(room, "the prefill request failed")
            raise
        self.pending += 1
        self._spawn(self._keep_for_pickup(req, room, kv, shadow, public))
        return [public]

    async def _queue_held(
        self,
        ids: list[int],
        params: SamplingParams,
        lora: str | None,
        shadow: RequestStream,
        public: RequestStream,
        check_lora: bool = True,
    ) -> Request:
        """Queue the prompt for its first token alone (max_tokens 1), its pages held past
        its finish (`_add_held`); a handler cancelled meanwhile undoes it."""
        one = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        add = functools.partial(self._add_held, ids, one, lora, shadow, public, check_lora)
        return await self.call(add, undo=functools.partial(self._drop_held, shadow))

    def _refuse_hold(self, room: int, message: str) -> None:
        """No KV will be held in `room` (its prefill failed or was aborted): a pickup hears
        why (410)."""
        why = Refusal.gone(message)
        self.bootstrap.refuse(room, why.message, why.status, why.param)

    def _add_held(
        self,
        ids: list[int],
        params: SamplingParams,
        lora: str | None,
        shadow: RequestStream,
        public: RequestStream,
        check_lora: bool,  # (positional: `self.call` passes `engine` last)
        engine: Engine,
    ) -> Request:
        """Engine thread: queue the prompt with its pages held past its finish. The engine
        feeds `shadow`; the final update goes on to `public` after the write (`_ship`), or,
        for a pickup, before any write (`_keep_for_pickup`: the client hears where the KV
        waits). `lora`: the digest of the decode server's adapter for it, which must be that
        of the weights the request holds here (the decode server caches the KV under it:
        `Request.cache_key`), compared once it holds them: an evicted adapter is read
        again by `add_request`, and its files may have changed (`check_lora` False: not
        compared here, but at the pickup, `_keep_for_pickup`)."""
        req = engine.add_request(ids, params)
        if check_lora and req.lora is not None and req.lora.digest != lora:
            engine.abort(req.rid)  # (before any step: nothing ran, nothing is streamed)
            raise APIError(
                502,
                f"the prefill and decode servers serve LoRA adapter {req.lora.name!r} from "
                "different weights: load the same adapter on both",
                type="server_error",
            )
        req.metrics.arrival_time = public.arrival  # (`RequestStream.arrival`)
        ops.hold(engine, req)
        for s in (shadow, public):
            s.rid, s.request, s.prompt_tokens = req.rid, req, len(ids)
        self._streams[req.rid] = shadow
        return req

    def _drop_held(self, shadow: RequestStream, engine: Engine, req: Request) -> None:
        """Engine thread: undo `_add_held` for a handler cancelled meanwhile (nothing will
        ship the pages): abort the request, or free its pages if it has finished."""
        if req.finished:
            ops.release_held(engine, req)
        else:
            self._abort(shadow, "abort")

    def _abort(self, stream: RequestStream, reason: str) -> None:
        """An abort of the handler's stream also ends `_ship`'s wait on the engine's."""
        shadow = self._streams.get(stream.rid) if stream.rid is not None else None
        super()._abort(stream, reason)
        if shadow is not None and shadow is not stream:
            shadow._push(_ended(shadow, reason))

    async def _ship(
        self, req: Request, reg: Any, shadow: RequestStream, public: RequestStream
    ) -> None:
        u = await shadow.get()
        while not u.finished:
            u = await shadow.get()
        try:
            # The request failed here (its own fault, a 400, or the model's, a 500):
            # nothing was sent, so no transfer failed
            if u.error is not None:
                reg.fail(u.error, u.error_status)
                public._push(u)
                return
            if u.finish_reason == "abort":  # its client (the router) left
                reg.fail("the prefill request was aborted: its client left", 499)
                public._push(u)
                return
            await self._write(req, reg, u)
            public._push(u)
        except Exception as e:
            self.stats.fail()
            message = f"KV transfer for room {reg.room} failed: {e}"
            log.warning("%s", message)
            reg.fail(message)
            public._push(
                Update(
                    [],
                    "",
                    None,
                    None,
                    finished=True,
                    finish_reason="error",
                    cached_tokens=req.metrics.prefix_hit_tokens,
                    prompt_tokens=len(req.prompt_ids),
                    completion_tokens=len(req.output_ids),
                    error=message,
                )
            )
        finally:
            await self._release(req)

    async def _release(self, req: Request) -> None:
        """Let a held request's pages go: its KV was written, or never will be."""
        try:
            with contextlib.suppress(RuntimeError):  # a stopped engine has nothing to free
                await self.call(lambda e: ops.release_held(e, req))
        finally:
            self.pending -= 1  # (after: pages held until then are not a leak)

    async def _write(self, req: Request, reg: Any, u: Update) -> None:
        """Write the prompt's KV into the pages `reg` reserved, then answer it with the
        first token (`u`, the request's last update); raises where it could not."""
        n = len(req.prompt_ids)
        if req.num_computed < n:
            raise RuntimeError("the prompt does not fit in the prefill server's KV pool")
        if reg.gone.is_set():
            raise RuntimeError("the decode server hung up before the KV was sent")
        loop = asyncio.get_running_loop()
        if req.dp_rank:  # (its pages are another rank's: it writes them while it steps)
            args = (req.rid, write_held, req.rid, reg.session, reg.buffers, reg.pages)
            # (on the engine thread: its loop steps while the call runs, which brings back
            # the outcome with a report)
            written = await self.call(lambda e: e.on_rank_later(req.dp_rank, *args))
            nbytes, seconds = await asyncio.wrap_future(written)
            self.stats.add(nbytes, n, seconds)  # (rank 0's transfer counts its own)
        else:
            src = prompt_pages(req, self.engine.pool.page_size)
            write = functools.partial(
                self.transfer.write, reg.session, reg.buffers, src, reg.pages, n
            )
            nbytes, seconds = await loop.run_in_executor(self._writer, write)
        routed = u.routed_experts  # (the prompt's rows from routed_experts_start_len)
        prompt_rows = {} if routed is None else {"routed_experts": routed_base64(routed)}
        reg.done(
            first_token=u.token_ids[0],
            logprob=u.logprobs[0] if u.logprobs else None,
            top_logprobs=u.top_logprobs[0] if u.top_logprobs else None,
            token_ids_logprobs=u.token_ids_logprobs[0] if u.token_ids_logprobs else None,
            **prompt_rows,  # (not a byte where not asked for)
            bytes=nbytes,
            tokens=n,
            seconds=seconds,
            cached_tokens=req.metrics.prefix_hit_tokens,  # the client's cached_tokens
        )

    def _kept_at(self, req: Request, room: int) -> dict[str, Any]:
        """The prefill answer's `kv_transfer_params`: vLLM's NixlConnector's fields (its
        remote_request_id: the room), where a decode server finds `req`'s KV."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.bootstrap.engine_id,
            "remote_request_id": str(room),
            "remote_block_ids": prompt_pages(req, self.engine.pool.page_size),
            "remote_host": self.bootstrap_host,
            "remote_port": self.config.bootstrap_port,
            "tp_size": self.engine.parallel.tp_size,
        }

    async def _keep_for_pickup(
        self,
        req: Request,
        room: int,
        kv: KVTransferParams,
        shadow: RequestStream,
        public: RequestStream,
    ) -> None:
        """Answer the client once the prompt ran (with `kv.reply`), then keep its pages
        until a decode server's pickup of `room` (the KV written as for SGLang's protocol)
        or `--disaggregation-timeout`; then let them go."""
        u = await shadow.get()
        while not u.finished:
            u = await shadow.get()
        reg = None
        try:
            if u.error is None and u.finish_reason != "abort":
                kv.reply = self._kept_at(req, room)
                lora = req.lora.digest if req.lora is not None else None
                self.bootstrap.expect(room, req.prompt_ids, lora)  # (before anyone knows it)
            public._push(u)
            if kv.reply is None:  # it failed, or its client left: nobody will come for it
                self._refuse_hold(room, u.error or "the prefill request was aborted")
                return
            timeout = self.config.timeout_s
            expired = Refusal.gone(
                f"the KV held for room {room} expired: no decode request took it within "
                f"{timeout:g} s (the prefill server's --disaggregation-timeout)"
            )
            try:
                reg = await self.bootstrap.claim(room, timeout, expired)
            except BootstrapError as e:
                log.info("KV held for room %d let go: %s", room, e)
                return
            await self._write(req, reg, u)  # (its prompt and adapter checked: `expect`)
        except Exception as e:
            self.stats.fail()
            message = f"KV transfer for room {room} failed: {e}"
            log.warning("%s", message)
            if reg is not None:
                reg.fail(message)
        finally:
            await self._release(req)

    def shutdown(self, timeout: float = 10.0) -> None:
        self.bootstrap.close()
        super().shutdown(timeout)
        self._writer.shutdown(wait=False, cancel_futures=True)


class DecodeAsyncEngine(_DisaggEngine):
    """Reserves pages, has the prefill server write the prompt's KV into them, then decodes
    from the prefill server's first token. Reserved pages go back when the prefill server
    fails, hangs up or stays silent for `timeout_s`; for a `generate_n` cancelled meanwhile
    (an abort, a client gone), at once, or once the prefill server answers if it was asked
    for the KV (it may be writing into them)."""

    role = "decode"

    def __init__(
        self,
        engine: Engine,
        config: DisaggConfig,
        server_host: str,
        thread: EngineThread | None = None,
    ) -> None:
        super().__init__(engine, config, server_host, thread)
        self.stats = TransferStats()

    def forgo(self, n: int) -> None:
        if kv_transfer(self.role) is None:  # (a vLLM hold: dropped with the 499, `attach`)
            next_target(self.role)  # (the prefill server's copy is aborted by the router)

    async def generate_n(
        self, prompt: str | list[int], params: SamplingParams, n: int
    ) -> list[RequestStream]:
        kv = kv_transfer(self.role)  # vLLM's: the KV a prefill server holds (`pickup`)
        target = kv.target if kv is not None else next_target(self.role)
        _checks(n, params)
        if not target.host:
            raise APIError(
                400,
                "a decode server needs the prefill server's bootstrap host "
                "(X-Dsakv-Bootstrap-Host, or bootstrap_host)",
            )
        port = target.port or self.config.bootstrap_port  # SGLang's default when not given
        stream = RequestStream(asyncio.get_running_loop())  # (its `arrival`: now)
        ids = await self.call(lambda e: e.prompt_ids(prompt, params.truncate_prompt_tokens))
        self.pending += 1
        try:
            req = await self._reserve(ids, params)
            registration = {
                "room": target.room,
                "layout": self.layout,
                "session": self.pools[req.dp_rank][0],
                "buffers": self.pools[req.dp_rank][1],
                "pages": req.pages,
                "prompt_ids": ids,
                "lora": None if req.lora is None else req.lora.digest,  # (checked there)
                "timeout": self.config.timeout_s,  # the prefill side keeps well inside it
            }
            if kv is not None:
                registration.update(pickup=True, engine_id=kv.engine_id)
                kv.registered = True  # (from here the prefill server hears how it ends)
            extra_bytes = 0
            if params.return_routed_experts:  # (the prompt's rows come with the answer)
                extra_bytes = routed_base64_chars(self.engine.model_config.routed_shape(len(ids)))
            handshake = asyncio.ensure_future(
                request_kv(target.host, port, registration, self.config.timeout_s, extra_bytes)
            )
            try:
                reply = await asyncio.shield(handshake)
            except asyncio.CancelledError:
                # The prefill side may be writing into the pages: free them once it answers.
                handshake.add_done_callback(lambda t: self._drop_soon(req, t))
                raise
            except BootstrapError as e:
                await self.call(lambda eng: ops.drop(eng, req))
                if e.status < 500:  # the request failed on the prefill server by itself
                    raise APIError(e.status, str(e), param=e.param, code=e.code) from None
                self.stats.fail()  # (a status the prefill server answered, e.g. its 503)
                raise APIError(e.status, str(e), type="server_error") from None
            self.stats.add(int(reply["bytes"]), int(reply["tokens"]), float(reply["seconds"]))
            try:
                rows = _prompt_routed(self.engine, reply, len(ids), params)
            except APIError:
                self.stats.fail()
                await self.call(lambda eng: ops.drop(eng, req))
                raise
            start = functools.partial(self._start, req, reply, rows, stream, kv is not None)
            await self.call(start, undo=lambda e, _: self._abort(stream, "abort"))
        finally:
            self.pending -= 1  # (after the start: a reservation is not a leak until then)
        return [stream]

    async def _reserve(self, ids: list[int], params: SamplingParams) -> Request:
        """Pages for the prompt and the first decode token, waiting (up to the timeout)
        while the pool is full or `--max-running-requests` requests run or wait for KV."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.timeout_s
        while True:
            req = await self.call(
                lambda e: ops.reserve(e, ids, params),
                undo=lambda e, r: r is not None and ops.drop(e, r),
            )
            if req is not None:
                return req
            if loop.time() > deadline:
                raise APIError(
                    503,
                    f"the decode server had no room for {len(ids)} tokens within "
                    f"{self.config.timeout_s:g} s (its KV pool is full, or "
                    "--max-running-requests requests run)",
                    type="server_error",
                )
            await asyncio.sleep(_RESERVE_POLL_S)

    def _drop_hold(self, kv: KVTransferParams, message: str) -> None:
        """The decode request for `kv`'s hold failed before its pickup (refused, no room
        within the timeout, its client gone): the prefill server lets the KV go now, as
        vLLM's decode side frees the remote blocks, not after its timeout."""
        target = kv.target
        if target is None or not target.host:
            return

        async def drop() -> None:
            port = target.port or self.config.bootstrap_port
            try:
                await drop_kv(target.host, port, target.room, kv.engine_id, message)
            except BootstrapError as e:
                log.info("could not drop the KV held for room %d: %s", target.room, e)

        self._spawn(drop())

    def _drop_soon(self, req: Request, handshake: asyncio.Future) -> None:
        """Give a reserved request's pages back once the handshake of a handler that was
        cancelled ends; its outcome is read (the client left: nobody else will)."""
        if not handshake.cancelled():
            handshake.exception()
        self._spawn(self.call(lambda e: ops.drop(e, req)))

    def _start(
        self,
        req: Request,
        reply: dict[str, Any],
        routed: torch.Tensor | None,
        stream: RequestStream,
        pickup: bool,
        engine: Engine,
    ):
        """Engine thread: decode from the prefill server's first token (and the prompt's
        `routed` experts); the stream gets it. A
        `pickup` (vLLM's) runs the last prompt token here: its first token comes from this
        server's next step, under this request's sampling params."""
        logprob, top = reply.get("logprob"), reply.get("top_logprobs")
        if not pickup and req.params.logprobs is not None and logprob is not None:
            req.logprobs.append(float(logprob))
            req.top_logprobs.append([(int(t), float(x)) for t, x in top or []])
            req.ranks.append(None)  # (the prefill server's; no route reports it)
            by_id = reply.get("token_ids_logprobs")
            if req.params.token_ids_logprob is not None and by_id is not None:
                req.token_ids_logprobs.append([float(x) for x in by_id])
        req.metrics.arrival_time = stream.arrival  # (the prefill server's time included)
        # What the client's usage reports as cached is what the prefill server's prefix
        # cache served (SGLang's decode side takes it from the prefill side's metadata); this
        # server's `dsakv_prefix_hit_tokens_total` stays its own cache's.
        req.metrics.prefix_hit_tokens = int(reply.get("cached_tokens") or 0)
        ops.start_decoding(engine, req, None if pickup else int(reply["first_token"]), routed)
        stream.rid, stream.request, stream.prompt_tokens = req.rid, req, len(req.prompt_ids)
        if pickup:  # (its first update comes with the step that picks its first token)
            self._streams[req.rid] = stream
            return
        stream._push(_update(engine, stream, req))
        if req.finished:
            stream.request = None
        else:
            self._streams[req.rid] = stream


def make_async_engine(
    engine: Engine, config: DisaggConfig, server_host: str, thread: EngineThread | None = None
) -> _DisaggEngine:
    """The prefill or decode server's bridge; setup failures are one `DsakvError`.
    `thread`: the `EngineThread` that built `engine`, to step it too."""
    cls = PrefillAsyncEngine if config.mode == "prefill" else DecodeAsyncEngine
    try:
        return cls(engine, config, server_host, thread)
    except (TransferError, BootstrapError) as e:
        raise DsakvError(str(e)) from None


def bridge_for(
    config: DisaggConfig,
    engine_config: EngineConfig,
    server_host: str,
    reserved: Listener | None = None,
) -> Bridge:
    """`make_server`'s `bridge` for a prefill or decode server; what such a server cannot
    serve fails here, before the engine loads. `reserved`: the prefill server's bootstrap
    port, held (listening) while the engine loads and let go just before the bootstrap
    server binds it, so nothing else takes it meanwhile."""
    config.check_engine(engine_config)

    def bridge(engine: Engine, thread: EngineThread) -> _DisaggEngine:
        if reserved is not None:
            reserved.close()
        return make_async_engine(engine, config, server_host, thread)

    return bridge


class _TransferCollector(Collector):
    """`dsakv_kv_transfer_*`: KV the prefill server sent / the decode server received."""

    def __init__(self, model_name: str, owner: _DisaggEngine) -> None:
        self.model_name, self.owner = model_name, owner

    def collect(self) -> Iterator[Metric]:
        labels, values = ["model_name", "role"], [self.model_name, self.owner.role]
        snap = self.owner.stats.snapshot()
        docs = {
            "bytes": "KV bytes written to (prefill) / into (decode) the peer's pages",
            "tokens": "Prompt tokens whose KV was transferred",
            "requests": "Requests whose KV was transferred",
            "seconds": "Time spent in KV writes",
            "failures": "Requests whose handshake or KV transfer failed",
        }
        for key, doc in docs.items():
            m = CounterMetricFamily(PREFIX + f"kv_transfer_{key}", doc, labels=labels)
            m.add_metric(values, float(snap[key]))
            yield m
        m = GaugeMetricFamily(
            PREFIX + "kv_transfer_pending",
            "Requests between handshake and KV (prefill: pages held for the write or a pickup)",
            labels=labels,
        )
        m.add_metric(values, float(self.owner.pending))
        yield m
