"""The prefill/decode handshake: JSON lines over TCP on the prefill server's bootstrap port.

The router gives both servers the same `room` (a random id) and the decode server the
prefill server's bootstrap address. The decode server reserves pages, connects and sends
one line: its layout description (checked here before any byte moves), its Mooncake
session, its pool buffers, the pages and the prompt's token ids. The prefill server's
request handler `claim`s the room, runs the prompt, writes the KV and sets the result;
meanwhile this side sends `{"type": "wait"}` at once and every few seconds, so the decode
server can tell a slow prefill from a dead one (no line for `timeout` seconds: it gives up
and frees its pages) or from a port that is no bootstrap's (no first line within
`_ANSWER_S`). The last line is `{"type": "done", "first_token", ...}` (with `cached_tokens`:
the prompt tokens the prefill server's prefix cache served, the client's usage; and the
prompt's `routed_experts` where the request asked for them) or an error.

vLLM's protocol (`handoff.KVTransferParams`) turns it around: the prefill request comes
first, and its room is drawn here and `hold`: the prompt's KV stays in the prefill
server's pages until a decode server's registration marked `pickup` comes for it (the
prefill server's answer named the room), or the timeout. A pickup finds its room held or
hears at once why not: gone (taken, expired, let go: 410) or unknown here (404). One for
another prompt or adapter, or from another layout, is refused and the hold stays for the
right one. A decode server whose request failed before its pickup sends `drop_kv` (vLLM's
decode side frees the remote blocks), and a weight update lets every hold go (`let_go`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from dsakv.config import ModelConfig
from dsakv.memory import CacheLayout

from .config import KV_PARAM
from .transfer import PeerBuffer

log = logging.getLogger(__name__)

_MAX_LINE = 64 << 20  # a registration carries the prompt's ids and the page list
# A bootstrap server answers a registration at once (`_wait`'s first line): a peer silent
# this long after one is no bootstrap server (a wrong port: an HTTP one), and the decode
# side says so now, not after its timeout. (vLLM's NIXL handshake waits 5 s on its peer.)
_ANSWER_S = 5.0


class BootstrapError(RuntimeError):
    """The handshake failed: layouts differ, the peer is gone, or nobody answered in time.
    `status` 400: the request itself failed on the prefill server (its client's fault);
    `param`: the request field its answer named, `code` its OpenAI code (a prompt past the
    prefill server's context: context_length_exceeded, which clients read to compact)."""

    def __init__(
        self, message: str, status: int = 502, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


@dataclass(frozen=True)
class Refusal:
    """Why a room's request failed, as the decode side hears it (an error line, which
    `request_kv` raises as the `BootstrapError` of the same fields)."""

    message: str
    status: int = 502
    param: str | None = None
    code: str | None = None

    @classmethod
    def gone(cls, message: str) -> Refusal:
        """A pickup's hold that was here and is no more (taken, expired, let go)."""
        return cls(message, 410, KV_PARAM)

    @classmethod
    def unknown(cls, message: str) -> Refusal:
        """A pickup for a hold this server never had (or forgot)."""
        return cls(message, 404, KV_PARAM)

    def reply(self) -> dict[str, Any]:
        """Its line to the decode side."""
        return {"type": "error", **dataclasses.asdict(self)}


# --- what must match ---------------------------------------------------------------------------


def describe(
    layout: CacheLayout, config: ModelConfig, checkpoint: str, compute: str
) -> dict[str, Any]:
    """Everything that must be equal on both sides for the pages to mean the same thing:
    the cache layout (LayerPlan pattern, draft layers, dims, dtypes, page size, elision),
    the model's config and its weights (`checkpoint`: `config.checkpoint.model_identity`; two seeds
    of one architecture paired silently, each side's KV garbage to the other), and how the
    KV is computed (`compute`: `Engine.compute`, what L3 keys on too: an fp32 prefill
    server's pages under a bf16 decode server gave tokens neither server gives alone)."""
    d: dict[str, Any] = {
        f.name: getattr(layout, f.name) for f in dataclasses.fields(layout) if f.name != "plan"
    }
    d["plan_pattern"] = layout.plan.pattern
    d["num_draft_layers"] = layout.plan.num_draft_layers
    d["fingerprint"] = layout.fingerprint()
    d["model"] = dataclasses.asdict(config)
    d["checkpoint"] = checkpoint
    d["compute"] = compute
    return json.loads(json.dumps(d, default=str))  # as it will arrive from the peer


def differences(mine: dict[str, Any], theirs: dict[str, Any], me: str, peer: str) -> list[str]:
    """`key: me X, peer Y` for every field that differs (model fields as `model.key`)."""
    out = []
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key)
        if key == "model" and isinstance(a, dict) and isinstance(b, dict):
            out += [f"model.{d}" for d in differences(a, b, me, peer)]
        elif key != "fingerprint" and a != b:
            out.append(f"{key}: {me} {a!r}, {peer} {b!r}{_hint(key, a, b)}")
    if not out and mine.get("fingerprint") != theirs.get("fingerprint"):
        out.append("layout fingerprint differs")
    return out


def _hint(key: str, a: Any, b: Any) -> str:
    """How to make two servers that differ only in the per-token path compute alike (on a
    CPU one rank takes it by default, several ranks do not; over ranks its bits are those
    of one split of the sums)."""
    if key != "compute" or not all(isinstance(v, str) for v in (a, b)):
        return ""
    (*how_a, path_a), (*how_b, path_b) = (v.split("|", 3)[:3] for v in (a, b))
    if how_a != how_b:
        return ""
    if path_a != path_b:
        return (
            " (start both with --disable-deterministic-inference, or both with "
            "--enable-deterministic-inference where it runs)"
        )
    return (
        " (the per-token path's bits are those of one split of its sums over ranks: give "
        "both the same --tp, --ep and --dp-attention, or start both with "
        "--disable-deterministic-inference)"
    )


def mismatch_message(diffs: list[str]) -> str:
    return "prefill and decode servers have different KV layouts: " + "; ".join(diffs)


# --- prefill side ------------------------------------------------------------------------------


@dataclass(eq=False)
class Registration:
    """One decode server's request for a room's KV. `finish` (any thread) answers it."""

    room: int
    session: str
    buffers: list[PeerBuffer]
    pages: list[int]
    prompt_ids: list[int]
    layout: dict[str, Any] = field(default_factory=dict)  # the decode side's (`describe`)
    lora: str | None = None  # the digest of the decode side's LoRA adapter for it, if any
    result: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    gone: threading.Event = field(default_factory=threading.Event)  # decode side hung up

    def done(self, **info: Any) -> None:
        self._set({"type": "done", **info})

    def fail(
        self, message: str, status: int = 502, param: str | None = None, code: str | None = None
    ) -> None:
        self.refused(Refusal(message, status, param, code))

    def refused(self, refusal: Refusal) -> None:
        self._set(refusal.reply())

    def _set(self, reply: dict[str, Any]) -> None:
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            self.result.set_result(reply)


@dataclass(eq=False)
class _Room:
    registered: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    claimed: bool = False
    refused: Refusal | None = None  # the prefill server's
    held: bool = False  # (`BootstrapServer.hold`: pickups only)
    # A hold's prompt and adapter digest (`expect`): a pickup for others is refused
    prompt_ids: list[int] | None = None
    lora: str | None = None


# A registration line's reception (`BootstrapServer._register`, `_pickup`): its room's slot
# (None: not this line's to forget), the registration taken, or why it is refused, and
# whether the slot stays `timeout` seconds for later lines to hear why.
_Admitted = tuple[_Room | None, Registration | None, Refusal | None, bool]


class BootstrapServer:
    """The prefill server's end: accepts registrations on its own thread and event loop."""

    def __init__(self, host: str, port: int, layout: dict[str, Any], timeout: float) -> None:
        self.host, self.port, self.layout, self.timeout = host, port, layout, timeout
        # vLLM's remote_engine_id: a pickup names whose hold it comes for (a room of a
        # server since restarted on this port is no room of this one)
        self.engine_id = str(uuid.uuid4())
        self._rooms: dict[int, _Room] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        started: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name="dsakv-bootstrap", daemon=True
        )
        self._thread.start()
        started.result()  # raises if the port could not be bound

    @property
    def open_rooms(self) -> int:
        """Rooms claimed, registered or held and not yet done with (a claim left waiting
        shows); not refused ones, kept a while only to answer a late registration."""
        with self._lock:
            return sum(slot.refused is None for slot in self._rooms.values())

    # --- used by the prefill server's request handlers (any event loop) -------------------

    def hold(self) -> int:
        """A new room for a request whose KV waits here for a decode server's pickup (vLLM's
        protocol): registrations not marked `pickup` are refused it. `claim` it once the KV
        is there; `refuse` it if none will be."""
        with self._lock:
            room = secrets.randbits(63)
            while room in self._rooms:
                room = secrets.randbits(63)
            self._rooms[room] = _Room(held=True)
        return room

    def expect(self, room: int, prompt_ids: list[int], lora: str | None) -> None:
        """The held `room`'s prompt and LoRA adapter digest, which a pickup must name: one
        that does not is refused, the hold kept for the right one."""
        with self._lock:
            slot = self._rooms.get(room)
            if slot is not None and slot.held:
                slot.prompt_ids, slot.lora = list(prompt_ids), lora

    def let_go(self, room: int, why: Refusal) -> bool:
        """End `room`'s hold that no pickup has registered for: its `claim` raises at once
        (the KV goes), and later pickups hear `why` for `timeout` seconds. False where no
        such hold is (taken, refused, never held)."""
        with self._lock:
            slot = self._rooms.get(room)
            if slot is None or not slot.held or slot.refused is not None:
                return False
            if slot.registered.done():  # a pickup came first: it hears the outcome
                return False
            slot.refused, slot.claimed = why, True
            slot.registered.set_exception(BootstrapError(why.message, why.status, why.param))
        self._forget_later(room, slot)
        return True

    def let_go_holds(self, why: Refusal) -> int:
        """`let_go` every hold no pickup has registered for (a weight update: their KV is
        the old weights'); how many."""
        with self._lock:
            rooms = [r for r, slot in self._rooms.items() if slot.held]
        return sum(self.let_go(room, why) for room in rooms)

    async def claim(
        self, room: int, timeout: float | None = None, expired: Refusal | None = None
    ) -> Registration:
        """The decode server's registration for `room`, once it arrives; raises
        `BootstrapError` after `timeout` or when its layout was refused. Cancelled (an abort,
        its client gone) or timed out, it refuses the room: the decode server, registered or
        still to come, hears so (timed out: `expired`, where given) and gives its reserved
        pages back."""
        slot = self._room(room)
        try:
            reg = await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(slot.registered)), timeout or self.timeout
            )
        except (asyncio.TimeoutError, TimeoutError):
            message = (
                f"no decode server registered room {room} within {timeout or self.timeout:g} s"
            )
            late = expired or Refusal(f"the prefill server gave up: {message}", 502)
            self.refuse(room, late.message, late.status, late.param)  # (a late one hears)
            raise BootstrapError(message) from None
        except BootstrapError:
            if slot.refused is None:  # (a hold let go: later pickups hear why)
                self._forget(room, slot)
            raise
        except asyncio.CancelledError:
            self.refuse(room, "the prefill request was cancelled", 499)
            raise
        slot.claimed = True
        # A layout that changed since the room registered (new weights: `weights_updated`)
        diffs = differences(self.layout, reg.layout, "prefill", "decode")
        if diffs:
            error = mismatch_message(diffs)
            reg.fail(error)
            raise BootstrapError(error)
        return reg

    def refuse(
        self,
        room: int,
        message: str,
        status: int,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        """The prefill server refused `room`'s request (the client's error, e.g. a prompt
        longer than its context): the decode server waiting for the room hears why now, or
        when it registers, instead of waiting out the timeout. A room already claimed (its
        registration hears the request's outcome) or refused is left as it is."""
        slot = self._room(room)
        with self._lock:
            if slot.claimed or slot.refused is not None:
                return
            slot.refused = refusal = Refusal(message, status, param, code)
        if slot.registered.done() and slot.registered.exception() is None:
            slot.registered.result().refused(refusal)
        self._forget_later(room, slot)

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    # --- the server thread ----------------------------------------------------------------

    def _run(self, started: concurrent.futures.Future) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._serve, self.host, self.port, limit=_MAX_LINE)
            )
        except OSError as e:
            started.set_exception(
                BootstrapError(f"cannot listen on bootstrap port {self.host}:{self.port}: {e}")
            )
            return
        started.set_result(None)
        try:
            self._loop.run_forever()
        finally:
            self._server.close()
            self._loop.close()

    def _room(self, room: int) -> _Room:
        with self._lock:
            return self._rooms.setdefault(room, _Room())

    def _forget(self, room: int, slot: _Room) -> None:
        with self._lock:
            if self._rooms.get(room) is slot:
                del self._rooms[room]

    def _forget_later(self, room: int, slot: _Room) -> None:
        """`_forget` after `timeout` seconds (any thread): a late registration hears why
        meanwhile."""
        self._loop.call_soon_threadsafe(
            self._loop.call_later, self.timeout, self._forget, room, slot
        )

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        room, slot, keep, reg = None, None, False, None
        try:
            line = await asyncio.wait_for(reader.readline(), self.timeout)
            msg = json.loads(line)
            room = int(msg["room"])
            if msg.get("type") == "drop":
                await _send(writer, self._drop(room, msg.get("engine_id"), str(msg["message"])))
                return
            if msg.get("pickup"):
                slot, reg, refused, keep = self._pickup(room, msg)
            else:
                slot = self._room(room)  # (forgotten below, a garbled line's too)
                slot, reg, refused, keep = self._register(room, msg, slot)
            if refused is not None:
                await _send(writer, refused.reply())
                return
            if slot.refused is not None:  # refused while this registration was being read
                reg.refused(slot.refused)
            # Well inside the decode side's patience, which it tells us.
            keepalive = max(0.05, min(float(msg.get("timeout", self.timeout)) / 4, 5.0))
            await self._wait(reg, slot, reader, writer, keepalive)
        except (OSError, ValueError, KeyError, TypeError, asyncio.TimeoutError) as e:
            log.warning("bootstrap connection failed: %s", e)
            with contextlib.suppress(OSError):
                await _send(writer, Refusal(f"bad registration: {e}").reply())
        finally:
            if slot is not None and keep:
                self._forget_later(room, slot)
            elif slot is not None and slot.held and slot.claimed:
                self._gone(room, slot, _after(room, reg))  # (a second pickup hears it was)
            elif slot is not None:
                self._forget(room, slot)
            writer.close()

    def _register(self, room: int, msg: dict[str, Any], slot: _Room) -> _Admitted:
        """SGLang's registration for `room` (`slot`), unless refused (a room held for a
        pickup is not its to forget; one whose layout is refused stays until the prefill
        request for it hears why)."""
        if slot.refused is not None:
            return slot, None, slot.refused, False
        if slot.held:
            return None, None, Refusal(f"room {room} is held for a pickup"), False
        error = self._mismatch(room, msg)
        if error is not None:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                slot.registered.set_exception(BootstrapError(error))
            return slot, None, Refusal(error), True
        reg = _registration(room, msg)
        if not _registered(slot, reg):  # it belongs to the first registration
            return None, None, Refusal(f"room {room} is taken"), False
        return slot, reg, None, False

    def _pickup(self, room: int, msg: dict[str, Any]) -> _Admitted:
        """vLLM's pickup of `room`'s hold, unless refused. Refused alone (another layout,
        prompt or adapter, or a second pickup), the hold stays for the right one; a gone
        hold's slot is kept, so the next pickup hears why too."""
        slot, unknown = self._held(room, msg.get("engine_id"))
        if unknown is not None:
            return None, None, unknown, False
        if slot.refused is not None:
            return slot, None, slot.refused, True
        error = self._mismatch(room, msg)
        if error is not None:
            return None, None, Refusal(error), False
        reg = _registration(room, msg)
        wrong = _wrong_pickup(room, slot, reg)
        if wrong is not None:
            return None, None, wrong, False
        if not _registered(slot, reg):  # taken first, or let go meanwhile
            return None, None, slot.refused or _taken(room), False
        return slot, reg, None, False

    def _mismatch(self, room: int, msg: dict[str, Any]) -> str | None:
        """Why a registration's layout (`describe`) cannot take this server's KV, if so."""
        diffs = differences(self.layout, msg["layout"], "prefill", "decode")
        if not diffs:
            return None
        error = mismatch_message(diffs)
        log.warning("room %d refused: %s", room, error)
        return error

    def _held(self, room: int, engine_id: Any) -> tuple[_Room | None, Refusal | None]:
        """A pickup's room, or why it has none: another server's (404), or no hold here."""
        if engine_id is not None and engine_id != self.engine_id:
            return None, Refusal.unknown(
                f"kv_transfer_params.remote_engine_id {engine_id!r} is not this prefill "
                f"server's ({self.engine_id}): was it restarted, or is this another one?"
            )
        with self._lock:
            slot = self._rooms.get(room)
        if slot is None or not (slot.held or slot.refused is not None):
            return None, Refusal.unknown(
                f"no KV is held for room {room} (kv_transfer_params.remote_request_id) on "
                f"this prefill server: never prefilled here, or gone more than "
                f"{self.timeout:g} s ago"
            )
        return slot, None

    def _drop(self, room: int, engine_id: Any, message: str) -> dict[str, Any]:
        """A decode server's `drop_kv`: its request for the hold failed before its pickup
        (vLLM's decode side frees the remote blocks), so the KV goes now."""
        slot, unknown = self._held(room, engine_id)
        if unknown is not None:
            return unknown.reply()
        why = Refusal.gone(
            f"the KV held for room {room} was let go: the decode request for it failed ({message})"
        )
        return {"type": "dropped" if self.let_go(room, why) else "gone"}

    def _gone(self, room: int, slot: _Room, why: Refusal) -> None:
        """`slot`'s hold is over: later pickups hear `why` for `timeout` seconds."""
        gone = _Room(claimed=True, refused=why, held=True)
        with self._lock:
            if self._rooms.get(room) is not slot:
                return
            self._rooms[room] = gone
        self._forget_later(room, gone)

    async def _wait(
        self,
        reg: Registration,
        slot: _Room,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        keepalive: float,
    ) -> None:
        """Keep the decode side posted until the room's result is set; notice if it hangs
        up (the prefill handler then ships nothing) or if nobody claims the room."""
        result = asyncio.wrap_future(reg.result)
        hangup = asyncio.ensure_future(reader.read(1))  # b"" at EOF
        deadline = time.monotonic() + self.timeout
        try:
            await _send(writer, {"type": "wait"})  # at once: heard by a bootstrap (`_ANSWER_S`)
            while True:
                await asyncio.wait(
                    {result, hangup}, timeout=keepalive, return_when=asyncio.FIRST_COMPLETED
                )
                if result.done():
                    await _send(writer, result.result())
                    return
                if hangup.done():
                    reg.gone.set()
                    reg.fail("the decode server hung up")
                    return
                if not slot.claimed and time.monotonic() > deadline:
                    reg.fail(
                        f"the prefill server got no request for room {reg.room} within "
                        f"{self.timeout:g} s"
                    )
                    await _send(writer, reg.result.result())
                    return
                await _send(writer, {"type": "wait"})
        except OSError:
            reg.gone.set()
            reg.fail("the decode server hung up")
        finally:
            hangup.cancel()


def _taken(room: int) -> Refusal:
    return Refusal.gone(f"the KV held for room {room} is gone: a decode request already took it")


def _after(room: int, reg: Registration | None) -> Refusal:
    """What later pickups of a hold `reg` took hear: taken, or why that pickup failed
    (its transfer, its decode server hung up) and the KV went with it."""
    reply = reg.result.result() if reg is not None and reg.result.done() else None
    if reply is None or reply.get("type") == "done":
        return _taken(room)
    return Refusal.gone(
        f"the KV held for room {room} is gone: the decode request that took it failed "
        f"({reply.get('message')})"
    )


def _registration(room: int, msg: dict[str, Any]) -> Registration:
    """A registration line's fields; raises where one is missing or malformed."""
    return Registration(
        room,
        str(msg["session"]),
        [PeerBuffer.from_json(b) for b in msg["buffers"]],
        [int(p) for p in msg["pages"]],
        [int(t) for t in msg["prompt_ids"]],
        msg["layout"],
        msg.get("lora"),
    )


def _registered(slot: _Room, reg: Registration) -> bool:
    """`reg` is `slot`'s registration, unless one came first (or the hold was let go)."""
    try:
        slot.registered.set_result(reg)
    except concurrent.futures.InvalidStateError:
        return False
    return True


def _wrong_pickup(room: int, slot: _Room, reg: Registration) -> Refusal | None:
    """Why a pickup is not for `slot`'s hold (`BootstrapServer.expect`), if it is not."""
    if slot.prompt_ids is None:
        return None
    if reg.prompt_ids != slot.prompt_ids:
        message = f"the decode request's prompt is not the one prefilled for room {room}"
        return Refusal(message, 400, KV_PARAM)
    if reg.lora != slot.lora:
        return Refusal(
            f"the decode request's LoRA adapter is not the one room {room} was prefilled "
            "with (or the servers load it from different weights)",
            400,
            "model",
        )
    return None


async def _send(writer: asyncio.StreamWriter, msg: dict[str, Any]) -> None:
    writer.write(json.dumps(msg).encode() + b"\n")
    await writer.drain()


# --- decode side -------------------------------------------------------------------------------


def _raised(line: dict[str, Any]) -> BootstrapError:
    """An error line (`Refusal.reply`) as the `BootstrapError` of the same fields."""
    param, code, status = line.get("param"), line.get("code"), line.get("status")
    return BootstrapError(
        str(line.get("message", line)),
        status if type(status) is int else 502,
        param if isinstance(param, str) else None,
        code if isinstance(code, str) else None,
    )


async def drop_kv(host: str, port: int, room: int, engine_id: str | None, message: str) -> str:
    """Tell a prefill server that the decode request for its hold of `room` failed before
    its pickup (`message`: why), so it lets the KV go now, not after its timeout; its answer
    (`dropped`, or `gone`: nothing was held). Raises `BootstrapError`."""
    line = {"type": "drop", "room": room, "engine_id": engine_id, "message": message}
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
        try:
            await _send(writer, line)
            reply = json.loads(await asyncio.wait_for(reader.readline(), 10))
        finally:
            writer.close()
    except (OSError, ValueError, asyncio.TimeoutError) as e:
        raise BootstrapError(f"cannot tell {host}:{port} to drop room {room}: {e!r}") from None
    if not isinstance(reply, dict):
        raise BootstrapError(f"{host}:{port} answered a drop of room {room} with {reply!r}")
    if reply.get("type") == "error":
        raise _raised(reply)
    return str(reply.get("type"))


async def request_kv(
    host: str, port: int, registration: dict[str, Any], timeout: float, extra_bytes: int = 0
) -> dict[str, Any]:
    """Register with a prefill server and wait until it has written the KV; returns its
    `done` reply (`first_token`, `bytes`, `seconds`, `cached_tokens`, and `routed_experts`
    where asked for: `extra_bytes` more bytes for them). Raises `BootstrapError` on a refusal, a
    hang-up, or `timeout` seconds without a word (`_ANSWER_S` before the first: the
    registration went to no bootstrap server; the KV itself may take the whole `timeout`)."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, limit=_MAX_LINE + extra_bytes), timeout
        )
    except (OSError, asyncio.TimeoutError) as e:
        raise BootstrapError(
            f"cannot reach the prefill server's bootstrap {host}:{port}: {e}"
        ) from None
    try:
        await _send(writer, registration)
        wait, hint = min(timeout, _ANSWER_S), ": is that its bootstrap port? (one answers at once)"
        while True:
            try:
                line = await asyncio.wait_for(reader.readline(), wait)
            except (asyncio.TimeoutError, TimeoutError):
                raise BootstrapError(
                    f"no word from the prefill server {host}:{port} for {wait:g} s{hint}"
                ) from None
            wait, hint = timeout, ""
            if not line:
                raise BootstrapError(
                    f"the prefill server {host}:{port} closed the connection before the KV "
                    "arrived (did it die?)"
                )
            msg = json.loads(line)
            if msg.get("type") == "wait":
                continue
            if msg.get("type") == "done":
                int(msg["bytes"]), int(msg["tokens"]), float(msg["seconds"])  # (read after)
                # The prefill side's prefix-cache hit (an older prefill server sends none: 0)
                hit = int(msg.get("cached_tokens") or 0)
                msg["cached_tokens"] = max(0, min(hit, int(msg["tokens"])))
                return msg
            raise _raised(msg)
    except OSError as e:
        raise BootstrapError(f"lost the prefill server {host}:{port}: {e}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # (garbled: the caller frees)
        raise BootstrapError(f"the prefill server {host}:{port} answered garbage: {e!r}") from None
    finally:
        writer.close()
