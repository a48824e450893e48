"""The request log: SGLang's `--log-requests` (its `--log-requests-level`) and vLLM's
`--enable-log-requests` / `--enable-log-outputs` / `--max-log-len`, as lines on the logger
"dsakv.requests" (INFO): one when a generation call reaches the engine (its client-visible
id, route and, as configured, sampling params and prompts), one when it ends (finish
reasons, token counts, e2e latency and, as configured, output texts).

The server's calls in flight (`submit.InFlight`) are the hook: every generation route
opens one with its id and closes it however it ends, and each output it took is read
through `submit.SubmitMixin` (`Output.add`); a server without the log checks once per call
and once per output (`InFlight.tap`), nothing per token."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dsakv.errors import DsakvError

from .http_config import route_path

if TYPE_CHECKING:
    from dsakv.engine import SamplingParams

    from .runner import RequestStream, Update

log = logging.getLogger("dsakv.requests")

SGLANG_LEVEL_2_LEN = 2048  # SGLang's level 2: each prompt or output kept to this many


@dataclass(frozen=True)
class RequestLogConfig:
    """What the log says of each call; `on` False: nothing at all (the default, vLLM's
    and SGLang's). `max_len`: characters of a text, ids of a token list, kept (None:
    whole)."""

    on: bool = False
    params: bool = False  # the sampling params (SGLang's level 1; vLLM's)
    prompts: bool = False  # the prompts as given, text or token ids (SGLang's level 2)
    outputs: bool = False  # the output texts (SGLang's level 2; vLLM's --enable-log-outputs)
    max_len: int | None = None
    # What /configure_logging starts from (`configured`), kept while the log is off: SGLang's
    # level (vLLM's flags: 1) and the --max-log-len given
    level: int = 2
    max_log_len: int | None = None

    @classmethod
    def from_flags(
        cls,
        log_requests: bool = False,
        log_requests_level: int = 2,
        enable_log_requests: bool = False,
        enable_log_outputs: bool = False,
        max_log_len: int | None = None,
        disable_log_requests: bool = False,
    ) -> RequestLogConfig:
        """The config SGLang's and vLLM's flags ask for. SGLang's level alone logs nothing
        (its verbosity, not a switch), nor do vLLM's `--enable-log-outputs` and
        `--max-log-len` alone (they refine `--enable-log-requests`); vLLM's prompts are its
        DEBUG lines, so only SGLang's level 2 and 3 log them. `--max-log-len` caps every
        prompt and output logged, SGLang's level 2 at 2048 where it is not given."""
        if log_requests_level not in range(4):
            raise DsakvError(f"--log-requests-level must be 0, 1, 2 or 3, got {log_requests_level}")
        if max_log_len is not None and max_log_len < 0:
            raise DsakvError(f"--max-log-len must be >= 0, got {max_log_len}")
        on = log_requests or enable_log_requests
        if disable_log_requests and on:
            given = "--log-requests" if log_requests else "--enable-log-requests"
            raise DsakvError(f"--disable-log-requests and {given} disagree: give one")
        if not on:
            return cls(level=log_requests_level, max_log_len=max_log_len)
        level = log_requests_level if log_requests else 1  # (vLLM's INFO line: its params)
        cut = max_log_len
        if cut is None and log_requests and level == 2:
            cut = SGLANG_LEVEL_2_LEN
        return cls(
            on=True,
            params=level >= 1,
            prompts=level >= 2,
            outputs=level >= 2 or enable_log_outputs,
            max_len=cut,
            level=level,
            max_log_len=max_log_len,
        )

    def configured(
        self, log_requests: bool | None = None, level: int | None = None
    ) -> RequestLogConfig:
        """This config as SGLang's /configure_logging changes it: the log turned on or off
        (`log_requests`), or set to SGLang's `level` (as `--log-requests --log-requests-level`
        would, the --max-log-len given kept); None: as it was. A log turned off and on again
        logs as it did (vLLM's flags' output texts too)."""
        on = self.on if log_requests is None else log_requests
        if level is None and (self.on or not on or self.params or self.outputs):
            return dataclasses.replace(self, on=on)
        level = self.level if level is None else level
        return self.from_flags(on, level, max_log_len=self.max_log_len)


class RequestLog:
    """One server's request log (`RequestLogConfig`). Enabled, its logger is set to INFO:
    its lines show under dsakv's own default level (warning), through the root handler
    the command line installs (no handler of its own: no line twice)."""

    def __init__(self, config: RequestLogConfig | None = None) -> None:
        self.config = RequestLogConfig()
        self.configure(config or self.config)

    def configure(self, config: RequestLogConfig) -> None:
        """Log as `config` says from now on (a call already open keeps its entry's)."""
        self.config = config
        if config.on:
            log.setLevel(logging.INFO)

    def open(self, rid: str, route: str, completion: bool = True) -> Entry | None:
        """The entry of a call `rid` on `route` (None when the log is off; `completion`:
        `Entry`'s)."""
        return Entry(self.config, rid, route, completion) if self.config.on else None


@dataclass
class Output:
    """One output's updates as the log needs them: its text only where it is logged, and
    then only what its line shows (the first `cut` characters; None: all), the rest
    counted (a long output costs the log no more than its line)."""

    keep_text: bool
    cut: int | None = None
    parts: list[str] = dataclasses.field(default_factory=list)
    kept: int = 0  # (characters in `parts`)
    dropped: int = 0  # (characters past `cut`)
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, u: Update) -> None:
        if self.keep_text and u.text:
            room = len(u.text) if self.cut is None else min(len(u.text), self.cut - self.kept)
            if room:
                self.parts.append(u.text[:room])
                self.kept += room
            self.dropped += len(u.text) - room
        self.prompt_tokens = max(self.prompt_tokens, u.prompt_tokens)
        self.completion_tokens, self.cached_tokens = u.completion_tokens, u.cached_tokens
        if u.error is not None:
            self.finish_reason, self.error = "error", u.error
        elif u.finished:
            self.finish_reason = u.finish_reason

    def text(self) -> str:
        """Its text as logged (`_clip`'s)."""
        return _shown("".join(self.parts), self.dropped)


class Entry:
    """One generation call's lines: `received` once its prompts reach the engine, `ended`
    when it closes (nothing if it never reached it: refused while it was checked). An
    output never read to its end (its client left, another one failed) ended aborted."""

    def __init__(
        self, config: RequestLogConfig, rid: str, route: str, completion: bool = True
    ) -> None:
        self.config, self.rid, self.route = config, rid, route
        self.began = time.perf_counter()
        self.n, self.said, self.due = 1, False, 0  # (`due`: the outputs it asked for)
        self.outputs: dict[RequestStream, Output] = {}
        self.failure: tuple[str, str | None] | None = None  # (finish reason, error)
        # Whether the outputs' tokens are completion tokens: a /v1/score item's one token is
        # not (its usage counts none, as SGLang's), so the line says what the usage says.
        self.completion = completion

    def received(
        self,
        prompts: Sequence[str | list[int]],
        params: Sequence[SamplingParams],
        n: int,
        beam: bool = False,
    ) -> None:
        if self.said:
            return
        self.said, self.n, self.due = True, n, len(prompts) * n
        c = self.config
        fields = [f"route={self.route}"]
        if len(prompts) > 1:
            fields.append(f"prompts={len(prompts)}")
        fields.append(f"{'beam_width' if beam else 'n'}={n}")
        if c.params:
            shown = [_params(p, c.max_len) for p in params]
            fields.append(f"params={shown[0] if len(set(shown)) == 1 else _list(shown)}")
        if c.prompts:
            clipped = [_clip(p, c.max_len) for p in prompts]
            fields.append(f"prompt={clipped[0] if len(clipped) == 1 else _list(clipped)}")
        log.info("Received request %s: %s", self.rid, ", ".join(fields))

    def tap(self, stream: RequestStream) -> Output:
        """The record of one output the engine took (in output order)."""
        out = self.outputs[stream] = Output(self.config.outputs, self.config.max_len)
        out.prompt_tokens = stream.prompt_tokens
        return out

    def failed(self, error: BaseException) -> None:
        """The call failed before its outputs were all taken: a client gone (499, or this
        handler cancelled) is an abort, anything else (a refused prompt) an error."""
        if isinstance(error, asyncio.CancelledError) or getattr(error, "status", None) == 499:
            self.failure = ("abort", None)
        else:
            self.failure = ("error", getattr(error, "message", None) or str(error))

    def ended(self) -> None:
        if not self.said:
            return
        c, outs = self.config, list(self.outputs.values())
        reasons = [o.finish_reason or "abort" for o in outs]
        errors = [o.error for o in outs]
        if self.failure is not None and len(outs) < self.due:  # (the rest: how it failed)
            reasons.append(self.failure[0])
            errors.append(self.failure[1])
        firsts = outs[:: self.n]  # (each prompt once: its choices share it)
        fields = [
            f"route={self.route}",
            f"finish_reason={reasons[0] if len(reasons) == 1 else _list(reasons)}",
            f"prompt_tokens={sum(o.prompt_tokens for o in firsts)}",
            f"completion_tokens={sum(o.completion_tokens for o in outs) if self.completion else 0}",
            f"cached_tokens={sum(o.cached_tokens for o in firsts)}",
            f"e2e_latency={time.perf_counter() - self.began:.3f}s",
        ]
        if any(errors):
            shown = [_clip(e or "", c.max_len) for e in errors]
            fields.append(f"error={shown[0] if len(shown) == 1 else _list(shown)}")
        if c.outputs and outs:
            texts = [o.text() for o in outs]
            fields.append(f"output={texts[0] if len(texts) == 1 else _list(texts)}")
        log.info("Finished request %s: %s", self.rid, ", ".join(fields))


def route_of(raw: Any) -> str:
    """The path a request came in on (a background response's detached one names its
    route too: `responses._Detached`)."""
    scope = getattr(raw, "scope", None)
    return route_path(scope) if scope else "?"  # (under --root-path, the route's own)


def _clip(value: Any, n: int | None) -> str:
    """`value` as logged: a text's first `n` characters, a list's first `n` items (a
    prompt's token ids; vLLM's --max-log-len), and how many more there were."""
    if isinstance(value, str):
        return _shown(value, 0) if n is None else _shown(value[:n], max(len(value) - n, 0))
    if isinstance(value, (list, tuple)):
        kept = value if n is None else value[:n]
        more = f"...(+{len(value) - len(kept)} more)" if len(kept) < len(value) else ""
        return f"[{', '.join(_clip(x, n) for x in kept)}]{more}"
    return repr(value)


def _shown(text: str, more: int) -> str:
    """A text's kept part as logged, and how many characters more it had."""
    return f"{text!r}...(+{more} chars)" if more else repr(text)


def _params(p: SamplingParams, n: int | None) -> str:
    """The sampling params a request set: those off their defaults (a text or list in
    them, a stop string or a grammar, kept as `_clip` keeps prompts)."""
    set_ = []
    for f in dataclasses.fields(p):
        value = getattr(p, f.name)
        if f.default is dataclasses.MISSING or value != f.default:
            set_.append(f"{f.name}={_clip(value, n)}")
    return f"SamplingParams({', '.join(set_)})"


def _list(items: Sequence[str]) -> str:
    return f"[{', '.join(items)}]"
