"""Engine-side steps of prefill/decode disaggregation (`dsakv.disagg`); engine thread only.

Prefill server: a request is `hold`-marked when queued; when it finishes (max_tokens 1: the
prompt's KV plus the first token) the scheduler keeps its pages, the KV is written to the
decode server, then `release_held` lets the pages go (full ones into the prefix cache).

Decode server: `reserve` builds a request and gives it pages for the prompt plus the first
decode token without queueing it; the prefill server writes the prompt's KV there; then
`start_decoding` runs it from its first token, or `drop` gives the pages back.

These run between steps, and a server may not step again soon: what they change in the
prefix cache goes out at once: to L3, and as KV cache events (`Engine.cache_changed`).
"""

from __future__ import annotations

import torch

from .engine import Engine
from .request import Request
from .sampling import SamplingParams


def hold(engine: Engine, req: Request) -> None:
    """`Engine.hold`: keep `req`'s pages when it finishes (until `release_held`); call
    before it runs."""
    engine.hold(req)


def release_held(engine: Engine, req: Request) -> None:
    engine.release_held(req)
    engine.cache_changed()  # (its pages joined the cache between steps)


def reserve(engine: Engine, prompt_ids: list[int], params: SamplingParams) -> Request | None:
    """`Engine.reserve_detached`: None while the pool has no room (the caller retries)."""
    req = engine.reserve_detached(prompt_ids, params)
    engine.cache_changed()  # (cached pages it evicted)
    return req


def drop(engine: Engine, req: Request) -> None:
    """`Engine.drop_detached`: give back a reserved request's pages and LoRA adapter (the
    prefill side failed or went away)."""
    engine.drop_detached(req)


def start_decoding(
    engine: Engine, req: Request, first_token: int | None, routed: torch.Tensor | None = None
) -> None:
    """`Engine.start_decoding`: run a reserved request whose prompt KV has arrived (None: its
    last prompt token runs here, and picks the first token)."""
    engine.start_decoding(req, first_token, routed)
    engine.cache_changed()  # (a first token that ends it: its pages joined the cache)
