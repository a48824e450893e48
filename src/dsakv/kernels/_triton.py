"""Optional Triton import for the kernel modules.

Triton is a dev/GPU extra, not a core dependency: the kernel modules must import (and
their docstrings stay readable) on a machine without it, and fail with ImportError only
when a kernel is actually launched.
"""

from typing import Any, NoReturn

import torch

_MISSING = "dsakv's Triton kernels need `triton` (pip install 'dsakv[dev]' or triton>=3.2)"

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAVE_TRITON = False

    class _Unavailable:
        """Stands in for a `@triton.jit` function: any launch raises ImportError."""

        def __init__(self, name: str) -> None:
            self.__name__ = name

        def __getitem__(self, grid: Any) -> NoReturn:
            raise ImportError(_MISSING)

        def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
            raise ImportError(_MISSING)

    class _NoTriton:
        """`triton` / `triton.language` placeholder: annotations resolve, launches raise."""

        def __getattr__(self, name: str) -> "_NoTriton":
            return self

        def jit(self, fn: Any = None, **kwargs: Any) -> Any:
            if fn is None:
                return lambda f: _Unavailable(f.__name__)
            return _Unavailable(fn.__name__)

    triton = _NoTriton()  # type: ignore[assignment]
    tl = _NoTriton()  # type: ignore[assignment]


def require_triton() -> None:
    """Raise ImportError now (at the wrapper) rather than deep inside a launch."""
    if not HAVE_TRITON:
        raise ImportError(_MISSING)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int, floor: int = 1) -> int:
    """Smallest power of two ≥ max(n, floor): Triton block shapes must be powers of two."""
    n = max(n, floor)
    return 1 << (n - 1).bit_length()


def interpreting(kernel: Any) -> bool:
    """Whether `kernel` was built for the Triton interpreter (TRITON_INTERPRET=1 at import),
    which has no bf16 dot (it multiplies the raw bits): the kernels then dot the same bf16
    values held in fp32."""
    return type(kernel).__name__ == "InterpretedFunction"


def one_context(n: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ctx_start, ctx_len)` `[n]` int32 for a varlen launch whose n queries all read one
    context of `length` positions (one request's chunk)."""
    start = torch.zeros(n, dtype=torch.int32, device=device)
    return start, torch.full((n,), length, dtype=torch.int32, device=device)


__all__ = [
    "HAVE_TRITON",
    "cdiv",
    "interpreting",
    "next_pow2",
    "one_context",
    "require_triton",
    "tl",
    "triton",
]
