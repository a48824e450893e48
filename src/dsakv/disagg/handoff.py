"""How a request names its prefill/decode handoff: the bootstrap room both servers share, and
where the prefill server's bootstrap listens (the decode server connects there).

Two routers, one concept. `dsakv router` sends `X-Dsakv-Bootstrap-{Room,Host,Port}` headers
and forwards the client's body untouched; SGLang's router (`sglang-router`) puts
`bootstrap_room`, `bootstrap_host` and `bootstrap_port` into the JSON body, as lists (one
entry per prompt) when the request has several prompts. A small ASGI middleware turns
either into `BootstrapTarget`s for the request; the prefill and decode engines take one per
prompt with `next_target()`. Headers win when both are present (only a router sets them).

vLLM's P/D protocol is sequential instead: its proxy sends the request to a prefill server
with `kv_transfer_params.do_remote_decode`, then to a decode server with the prefill
server's answer's `kv_transfer_params` (`do_remote_prefill` and where the KV waits). The
same middleware reads that field (`KVTransferParams`; the engines take it with
`kv_transfer()`), and the prefill server's answer carries its own (`kv_transfer_reply()`).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.middleware import Middleware

from dsakv.errors import is_int
from dsakv.server.http_config import route_path
from dsakv.server.protocol import APIError

from .config import HOST_HEADER, KV_PARAM, PORT_HEADER, ROOM_HEADER

# The generation endpoints whose JSON body may carry SGLang's bootstrap fields.
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate", "/v1/score")
# Those taking vLLM's `kv_transfer_params` (as vLLM's); the others' bodies are read to
# refuse it, rather than run the request without its hand-off.
KV_TRANSFER_PATHS = ("/v1/completions", "/v1/chat/completions")
_BODY_PATHS = (*GENERATE_PATHS, "/v1/responses")
_MAX_ROOM = 2**64 - 1  # SGLang's routers draw rooms below 2**63; any u64 is accepted


@dataclass(frozen=True)
class BootstrapTarget:
    """One prompt's handoff: its room, and the prefill server's bootstrap address (`port`
    None: the decode server's own `--disaggregation-bootstrap-port`, as in SGLang)."""

    room: int
    host: str = ""
    port: int | None = None


@dataclass
class KVTransferParams:
    """A request's vLLM `kv_transfer_params`. `remote_decode` (a prefill server's request):
    prefill, keep the KV for a decode server and answer with `reply`, where it waits (set by
    the prefill engine). Else (a decode server's): take the KV held at `target` (its room:
    the answer's `remote_request_id`) by the prefill server `engine_id` names."""

    remote_decode: bool
    target: BootstrapTarget | None = None
    engine_id: str | None = None
    reply: dict[str, Any] | None = None
    taken: bool = False  # (one prompt's: `kv_transfer`)
    # (a decode server's: its pickup went out; a failure before then drops the hold)
    registered: bool = False


@dataclass
class _Targets:
    """A request's targets, handed out in prompt order (vLLM's hand-off: `kv`). `error`:
    why its hand-off fields are wrong, answered after the API key check (a keyless request
    is a 401 whatever its body: `install`), or raised where the engine reads them."""

    targets: list[BootstrapTarget]
    used: int = 0
    kv: KVTransferParams | None = None
    error: APIError | None = None

    def next(self) -> BootstrapTarget | None:
        if self.used >= len(self.targets):
            return None
        self.used += 1
        return self.targets[self.used - 1]


_current: contextvars.ContextVar[_Targets | None] = contextvars.ContextVar(
    "dsakv_bootstrap_targets", default=None
)


def next_target(role: str) -> BootstrapTarget:
    """The current request's next prompt's target; a 400 when it names no (more) rooms."""
    targets = _checked()
    target = targets.next() if targets is not None else None
    if target is not None:
        return target
    if targets is None:
        raise APIError(
            400,
            f"this is a {role} server (--disaggregation-mode {role}): send requests through "
            "`dsakv router` or SGLang's router (sglang-router --pd-disaggregation)",
        )
    raise APIError(
        400,
        f"the request has more prompts than bootstrap rooms ({len(targets.targets)}): "
        "one bootstrap_room per prompt",
        param="bootstrap_room",
    )


def kv_transfer(role: str) -> KVTransferParams | None:
    """The current request's vLLM `kv_transfer_params` (None: SGLang's protocol), for its
    one prompt; a 400 when it asks the other role's side, or for a second prompt."""
    targets = _checked()
    kv = targets.kv if targets is not None else None
    if kv is None:
        return None
    side = "prefill" if kv.remote_decode else "decode"
    if role != side:
        flag = "do_remote_decode" if kv.remote_decode else "do_remote_prefill"
        raise APIError(
            400,
            f"kv_transfer_params.{flag} is for a {side} server; this is a {role} server "
            f"(--disaggregation-mode {role})",
            param=KV_PARAM,
        )
    if kv.taken:
        raise APIError(400, "kv_transfer_params hands off one prompt; send one", param=KV_PARAM)
    kv.taken = True
    return kv


def _checked() -> _Targets | None:
    """The current request's targets; its hand-off fields' 400 where they were wrong."""
    targets = _current.get()
    if targets is not None and targets.error is not None:
        raise targets.error
    return targets


def kv_transfer_reply() -> dict[str, Any]:
    """The answer's top-level `kv_transfer_params` (vLLM's) where the request's prefill
    left its KV held for a decode server; else nothing (`{}`, to splice in)."""
    targets = _current.get()
    kv = targets.kv if targets is not None else None
    return {KV_PARAM: kv.reply} if kv is not None and kv.reply is not None else {}


# --- parsing -----------------------------------------------------------------------------------


def from_headers(headers: dict[str, str]) -> list[BootstrapTarget] | None:
    """`dsakv router`'s headers (lower-case names) as targets, one per room (a list of
    prompts: rooms comma-separated, in prompt order); None without a room."""
    if ROOM_HEADER not in headers:
        return None
    try:
        rooms = [int(r) for r in headers[ROOM_HEADER].split(",")]
        port = int(headers[PORT_HEADER]) if headers.get(PORT_HEADER) else None
    except ValueError:
        raise APIError(400, "bad X-Dsakv-Bootstrap-* headers: room and port are integers") from None
    host = headers.get(HOST_HEADER) or None
    return [_target(room, host, port, "X-Dsakv-Bootstrap-") for room in rooms]


def from_body(body: Any) -> list[BootstrapTarget] | None:
    """SGLang's `bootstrap_room` / `bootstrap_host` / `bootstrap_port` body fields as
    targets (scalars: one; lists: one per prompt); None when the body names no room."""
    if not isinstance(body, dict) or body.get("bootstrap_room") is None:
        return None
    room, host, port = (body.get(f"bootstrap_{k}") for k in ("room", "host", "port"))
    if not isinstance(room, list):
        for name, value in (("host", host), ("port", port)):
            if isinstance(value, list):
                raise APIError(
                    400,
                    f"bootstrap_{name} is a list but bootstrap_room is not",
                    param=f"bootstrap_{name}",
                )
        return [_target(room, host, port)]
    if not room:
        raise APIError(400, "bootstrap_room is an empty list", param="bootstrap_room")
    hosts = host if isinstance(host, list) else [host] * len(room)
    ports = port if isinstance(port, list) else [port] * len(room)
    if not len(hosts) == len(ports) == len(room):
        raise APIError(
            400,
            "bootstrap_room, bootstrap_host and bootstrap_port lists differ in length",
            param="bootstrap_room",
        )
    return [_target(r, h, p) for r, h, p in zip(room, hosts, ports)]


def from_kv_transfer_params(body: Any, path: str) -> KVTransferParams | None:
    """vLLM's `kv_transfer_params`, checked; None without it, or with neither side asked
    for (vLLM's no-op). The decode side needs the prefill server's answer's remote_host,
    remote_port, remote_engine_id and remote_request_id (its room); its remote_block_ids
    and tp_size are checked where given (`_check_blocks_and_tp`)."""
    if not isinstance(body, dict) or body.get(KV_PARAM) is None:
        return None
    if path not in KV_TRANSFER_PATHS:
        raise APIError(
            400, f"kv_transfer_params is taken by {' and '.join(KV_TRANSFER_PATHS)}", param=KV_PARAM
        )
    kv = body[KV_PARAM]
    if not isinstance(kv, dict):
        raise APIError(400, f"kv_transfer_params must be an object, got {kv!r}", param=KV_PARAM)
    decode, prefill = kv.get("do_remote_decode"), kv.get("do_remote_prefill")
    if any(flag not in (None, True, False) for flag in (decode, prefill)):
        raise APIError(400, "kv_transfer_params.do_remote_* must be booleans", param=KV_PARAM)
    if decode and prefill:
        raise APIError(
            400,
            "kv_transfer_params asks for both do_remote_decode and do_remote_prefill",
            param=KV_PARAM,
        )
    prompts = body.get("prompt")  # (several: texts or token id lists, not one's ids)
    several = isinstance(prompts, list) and any(isinstance(p, (str, list)) for p in prompts)
    if (decode or prefill) and several and len(prompts) > 1:
        raise APIError(400, "kv_transfer_params hands off one prompt; send one", param=KV_PARAM)
    if decode:
        if body.get("stream"):
            raise APIError(
                400,
                "kv_transfer_params.do_remote_decode answers with where the KV waits, in "
                "one JSON response: send stream: false",
                param="stream",
            )
        return KVTransferParams(remote_decode=True)
    if not prefill:
        return None
    fields = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
    missing = [f for f in fields if kv.get(f) is None]
    if missing:
        raise APIError(
            400,
            f"kv_transfer_params.do_remote_prefill needs {', '.join(missing)} (the prefill "
            "server's answer's kv_transfer_params)",
            param=KV_PARAM,
        )
    engine_id, room = kv["remote_engine_id"], kv["remote_request_id"]
    if not isinstance(engine_id, str):
        raise APIError(400, "kv_transfer_params.remote_engine_id must be a string", param=KV_PARAM)
    if isinstance(room, str) and room.isascii() and room.isdigit():  # (vLLM's ids: strings)
        room = int(room)
    host, port = kv["remote_host"], kv["remote_port"]
    target = _target(room, host, port, f"{KV_PARAM}.remote_", "request_id", param=KV_PARAM)
    _check_blocks_and_tp(kv.get("remote_block_ids"), kv.get("tp_size"))
    return KVTransferParams(remote_decode=False, target=target, engine_id=engine_id)


def _check_blocks_and_tp(block_ids: Any, tp_size: Any) -> None:
    """The prefill answer's `remote_block_ids` and `tp_size` as vLLM's decode side takes
    them (either may be absent: vLLM reads no blocks without ids, and its older answers
    carry no tp_size); a wrong type is a 400. Any prefill tp_size pairs with any decode
    server's: every TP rank holds the whole latent (MLA), so rank 0's pool has it all. The
    ids' values are not checked: the room finds the hold and its prompt is checked
    (`bootstrap._wrong_pickup`), and the prefill server writes the pages it holds (vLLM's
    decode server reads the blocks named)."""
    if block_ids is not None and (
        not isinstance(block_ids, list) or not all(is_int(b) and b >= 0 for b in block_ids)
    ):
        raise APIError(
            400,
            f"{KV_PARAM}.remote_block_ids must be a list of block ids (integers >= 0) or null, "
            f"got {block_ids!r}",
            param=KV_PARAM,
        )
    if tp_size is not None and (not is_int(tp_size) or tp_size < 1):
        raise APIError(
            400, f"{KV_PARAM}.tp_size must be an integer >= 1, got {tp_size!r}", param=KV_PARAM
        )


def _target(
    room: Any,
    host: Any,
    port: Any,
    prefix: str = "bootstrap_",
    room_name: str = "room",
    param: str | None = None,
) -> BootstrapTarget:
    """One checked target; a wrong type or range is a 400 naming the field (`param`: the
    field it names for all three, else each its own)."""
    if not is_int(room) or not 0 <= room <= _MAX_ROOM:
        raise APIError(
            400,
            f"{prefix}{room_name} must be an integer in 0..2**64-1, got {room!r}",
            param=param or f"{prefix}{room_name}",
        )
    if host is not None and (not isinstance(host, str) or not host):
        raise APIError(
            400,
            f"{prefix}host must be a host name or address, got {host!r}",
            param=param or f"{prefix}host",
        )
    if port is not None and (not is_int(port) or not 0 < port < 65536):
        raise APIError(
            400,
            f"{prefix}port must be an integer in 1..65535 or null, got {port!r}",
            param=param or f"{prefix}port",
        )
    if host and host.startswith("[") and host.endswith("]"):
        host = host[1:-1]  # SGLang's routers bracket IPv6 addresses
    return BootstrapTarget(room, host or "", port)


# --- the middleware ----------------------------------------------------------------------------


def install(
    app: FastAPI,
    refuse: Callable[..., None] | None = None,
    drop: Callable[[KVTransferParams, str], None] | None = None,
) -> None:
    """`BootstrapMiddleware` outside the app's other middleware (it hears every answer, the
    API key's 401 too), and its 400 for bad hand-off fields answered inside them (after
    the key check: a keyless request is a 401 whatever its body; before the route reads
    the body)."""
    app.add_middleware(BootstrapMiddleware, refuse=refuse, drop=drop)
    app.user_middleware.append(Middleware(_KeptError))  # (the innermost)


class BootstrapMiddleware:
    """ASGI middleware: the request's bootstrap targets (headers, else body fields), or its
    vLLM `kv_transfer_params`, into the context `next_target()` and `kv_transfer()` read;
    bad ones are a 400 before anything runs (`install`: after the API key check; else where
    those read them). The body is read only for POSTs to the generation endpoints (and
    /v1/responses, to refuse kv_transfer_params there), parsed only where it can name those
    fields, and replayed to the app unchanged.

    `refuse` (a prefill server's `BootstrapServer.refuse`): called for each of the request's
    rooms when the server answers it with an error, whoever answered (the API key check, an
    unknown model, a validation error, the engine): the decode server waiting for a room
    hears that status and message at once, instead of waiting out its timeout for a claim
    that never comes. A room the request claimed has heard its outcome: `refuse` skips it.
    `drop` (a decode server's): called with a vLLM pickup's `KVTransferParams` and why, when
    the server answers it with an error before its pickup went out, so that the prefill
    server lets the KV go now."""

    def __init__(
        self,
        app: Any,
        refuse: Callable[..., None] | None = None,
        drop: Callable[[KVTransferParams, str], None] | None = None,
    ) -> None:
        self.app, self.refuse, self.drop = app, refuse, drop

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        h = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        targets, kv, error = None, None, None
        try:
            targets = from_headers(h)
            path = route_path(scope)
            if scope["method"] == "POST" and path in _BODY_PATHS:
                raw, receive = await _buffer_body(receive)
                sglang = targets is None and path in GENERATE_PATHS
                if _may_name(raw, sglang):
                    body = _json_or_none(raw)
                    if sglang:
                        targets = from_body(body)
                    kv = from_kv_transfer_params(body, path)
                if kv is not None and targets:
                    raise APIError(
                        400,
                        "the request names both bootstrap rooms (SGLang's P/D protocol) and "
                        "kv_transfer_params (vLLM's): one protocol per request",
                        param=KV_PARAM,
                    )
        except APIError as e:
            targets, kv, error = None, None, e
        state = _Targets(targets or [], kv=kv, error=error) if targets or kv or error else None
        token = _current.set(state)
        on_error = self._on_error(targets, kv)
        if on_error is not None:
            send = _Refusing(send, on_error)
        try:
            await self.app(scope, receive, send)
        except BaseException as e:
            if isinstance(send, _Refusing):
                why = f"the server failed: {e!r}"
                if isinstance(e, asyncio.CancelledError):  # (e.g. the server shutting down)
                    why = "the request was cancelled on the server"
                send.failed(why, 500)
            raise
        finally:
            _current.reset(token)

    def _on_error(
        self, targets: list[BootstrapTarget] | None, kv: KVTransferParams | None
    ) -> Callable[..., None] | None:
        """What an error answer to the request tells its peer: the prefill server refuses
        its rooms; the decode server drops a vLLM hold it has not picked up."""
        refuse, drop = self.refuse, self.drop
        if targets and refuse is not None:
            rooms = [t.room for t in targets]

            def refuse_rooms(*why: Any) -> None:
                for room in rooms:
                    refuse(room, *why)

            return refuse_rooms
        if kv is not None and not kv.remote_decode and drop is not None:

            def drop_hold(message: str, status: int, *_: Any) -> None:
                if not kv.registered:
                    drop(kv, f"HTTP {status}: {message}")

            return drop_hold
        return None


class _KeptError:
    """The innermost layer: the 400 `BootstrapMiddleware` kept for the request's hand-off
    fields, instead of the route."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        targets = _current.get() if scope["type"] == "http" else None
        if targets is not None and targets.error is not None:
            e = targets.error
            await JSONResponse(e.body(), status_code=e.status)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class _Refusing:
    """`send`, telling the request's peer (`tell`: a `Refusal`'s fields) when its response is
    an error: once the error body is whole (its message), before the body's end goes out."""

    def __init__(self, send: Callable, tell: Callable[..., None]) -> None:
        self.send, self.tell = send, tell
        self.status: int | None = None
        self.body: list[bytes] = []
        self.done = False

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body" and not self._ok():
            self.body.append(message.get("body", b""))
            if not message.get("more_body", False):
                self.failed(*_error(b"".join(self.body), self.status))
        await self.send(message)

    def failed(
        self, message: str, status: int, param: str | None = None, code: str | None = None
    ) -> None:
        """Tell the peer (`BootstrapServer.refuse`'s arguments, a `Refusal`'s fields), once."""
        if self.done:
            return
        self.done = True
        self.tell(message, status, param, code)

    def _ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def _error(raw: bytes, status: int | None) -> tuple[str, int, str | None, str | None]:
    """An error response as `_Refusing.failed` takes it: its message (OpenAI's
    `error.message`, FastAPI's `detail`, else the status), status, the request field it
    names and its code (OpenAI's `error.param` and `error.code`: the decode server answers
    with them as the prefill server did). (A `Refusal`'s fields: that class stays in
    `bootstrap`, whose imports the router, which imports this module, does without.)"""
    body = _json_or_none(raw)
    if isinstance(body, dict):
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else error
        message = message or body.get("message") or body.get("detail")
        named = error if isinstance(error, dict) else {}
        param, code = named.get("param"), named.get("code")
        if isinstance(message, str) and message:
            param, code = (x if isinstance(x, str) else None for x in (param, code))
            return message, status or 500, param, code
    return f"the prefill server answered HTTP {status}", status or 500, None, None


async def _buffer_body(receive: Callable) -> tuple[bytes, Callable]:
    """The whole request body, and a `receive` that replays what was read, then goes on."""
    messages, chunks = [], []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":  # the client went away
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break

    async def replay() -> dict:
        return messages.pop(0) if messages else await receive()

    return b"".join(chunks), replay


def _may_name(raw: bytes, sglang: bool) -> bool:
    """Whether a body can hold `kv_transfer_params` (or, `sglang`, `bootstrap_room`): parsed
    only then (a 50 MB image's isn't). A key may be written with escapes (`\\u006b...`)."""
    keys = (b"kv_transfer_params", b"bootstrap_room") if sglang else (b"kv_transfer_params",)
    return b"\\u" in raw or any(k in raw for k in keys)


def _json_or_none(raw: bytes) -> Any:
    """The parsed body; None when it is not JSON, or nested past the interpreter's limit
    (the app answers either with its own 400: `StrictJSONRoute`)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None
