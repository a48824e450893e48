"""SGLang's per-token rows of a request (return_routed_experts, return_hidden_states): how
a request asks for them, and routed experts' wire form, base64 of int32 `[tokens, layers,
top_k]` (`meta_info.routed_experts`, `sglext`, and the prefill server's hand-off to the
decode server)."""

from __future__ import annotations

import base64
import math
from typing import Any

import numpy as np


def row_params(body: Any, hidden: Any) -> dict[str, Any]:
    """The `SamplingParams` fields that ask for the rows: `body`'s (a /v1 route's or
    /generate's) return_routed_experts from routed_experts_start_len, and hidden states
    where `hidden` (its return_hidden_states, or /generate's for one prompt) says. The
    engine refuses them where its flags do not allow them."""
    return dict(
        return_routed_experts=bool(body.return_routed_experts),
        routed_experts_start_len=body.routed_experts_start_len or 0,
        return_hidden_states=bool(hidden),
    )


def routed_base64(routed: np.ndarray) -> str:
    """Routed experts `[tokens, layers, top_k]` as SGLang sends them."""
    return base64.b64encode(np.ascontiguousarray(routed, dtype=np.int32).tobytes()).decode()


def routed_from_base64(text: Any, shape: tuple[int, int, int]) -> np.ndarray:
    """`routed_base64`'s inverse, refused (ValueError, TypeError) unless of `shape`."""
    return np.frombuffer(base64.b64decode(text, validate=True), np.int32).reshape(shape)


def routed_base64_chars(shape: tuple[int, int, int]) -> int:
    """How long `routed_base64` of `shape` is (a reader's bound)."""
    return 4 * -(-4 * math.prod(shape) // 3)
