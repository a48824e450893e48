"""Engine-side steps of prefill/decode disaggregation (`dsakv.disagg`); engine thread only.

Prefill server: a request is `hold`-marked when queued; when it finishes (max_tokens 1: the
prompt's KV plus the first token) the scheduler keeps its pages, the KV is written to the
decode server, then `release_held` lets the pages go (full ones into the prefix cache).

Decode server: `reserve` builds a request and gives it pages for the prompt plus the first
decode token without queueing it; the prefill server writes the prompt's KV there; then
`start_decoding` runs it from its first token, or `drop` gives the pages back.
"""

from __future__ import annotations

import logging
import time

from .engine import Engine
from .request import Request
from .sampling import SamplingParams

log = logging.getLogger(__name__)


def hold(engine: Engine, req: Request) -> None:
    """Keep `req`'s pages when it finishes (until `release_held`); call before it runs."""
    engine.scheduler.held.add(req.rid)


def release_held(engine: Engine, req: Request) -> None:
    engine.scheduler.release_held(req)


def reserve(engine: Engine, prompt_ids: list[int], params: SamplingParams) -> Request | None:
    """A request whose pages cover its prompt and first decode token, not queued; None
    while the pool has no room for it (the caller retries)."""
    req = Request(list(prompt_ids), params)
    engine._init_request(req)  # grammar matcher: the first token came from the prefill side
    if not engine.scheduler.reserve_detached(req, len(prompt_ids) + 1):
        return None
    return req


def drop(engine: Engine, req: Request) -> None:
    """Give back a reserved request's pages (the prefill side failed or went away)."""
    req.finish_reason = "abort"
    engine.scheduler.finish(req)


def start_decoding(engine: Engine, req: Request, first_token: int) -> None:
    """Decode a reserved request whose prompt KV has arrived, from the prefill side's
    first token (it may finish right here: EOS, a stop, max_tokens 1)."""
    req.num_computed = len(req.prompt_ids)  # (with MTP, the draft layer's KV came too)
    engine.requests[req.rid] = req
    engine.stats.prompt_tokens += len(req.prompt_ids)
    engine.scheduler.adopt(req)
    now = time.perf_counter()
    if req.matcher is not None and not req.matcher.accept_token(first_token):
        log.warning("request %d: grammar rejected the prefill token %d", req.rid, first_token)
    engine._append_token(req, first_token, now)
    if not req.finished and req.matcher is not None and req.matcher.is_terminated():
        engine._finish(req, "stop", now)
