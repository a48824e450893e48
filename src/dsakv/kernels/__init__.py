"""Kernels below the model: one backend choice decides which code runs each hot op.

`select_backend("auto" | "torch" | "cpu" | "triton" | "flashmla", ...)` is called once per
engine; the model gets the chosen object and calls its ops (`backend.py`). The torch
reference is `torch_ops`; its CPU-shaped variant `cpu_ops`; dsakv's Triton kernels are
`triton_*`; the optional library path `flashmla`.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from dsakv.errors import DsakvError

from .backend import CpuBackend, TorchBackend, TritonBackend
from .torch_ops import MLAMath, topk_by_position

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "cpu", "triton", "flashmla")

__all__ = [
    "BACKENDS",
    "CpuBackend",
    "MLAMath",
    "TorchBackend",
    "select_backend",
    "topk_by_position",
]


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def select_backend(
    name: str,
    device: torch.device,
    layout,
    *,
    n_heads: int,
    index_heads: int,
    index_topk: int,
    compile: bool = False,
    deterministic: bool = False,
) -> TorchBackend:
    """The backend for this engine, with one log line saying which code runs each op.

    `auto`: `flashmla` when the library kernels import, the GPU is sm90+ and the shapes fit;
    else `triton` on CUDA; `cpu` on a CPU (`compile`: its small decode steps through
    `torch.compile`); else `torch`. `triton` on a CPU runs under the Triton interpreter
    (slow: what the tests use to check the kernels without a GPU).

    `deterministic`: the cpu backend's per-token path for every step; no other backend has
    one yet, so any other choice is refused with what it lacks.
    """
    if name not in BACKENDS:
        raise DsakvError(f"attention backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    from . import flashmla

    why = ""
    if name == "auto":
        ok, why = flashmla.probe() if device.type == "cuda" else (False, "not on CUDA")
        if ok:
            ok, why = flashmla.fits(layout, n_heads, index_heads, index_topk)
        if ok:
            name = "flashmla"
        elif device.type == "cuda" and triton_available():
            name = "triton"
        else:
            name = "cpu" if device.type == "cpu" else "torch"
    if deterministic and name != "cpu":
        raise DsakvError(
            "--enable-deterministic-inference runs on the cpu backend only (on a CPU, "
            f"--attention-backend auto or cpu), not {name} on {device.type}: the "
            + (
                "torch reference's GEMMs and attention change their reduction order with the batch"
                if name == "torch"
                else "CUDA path has no batch-invariant matmul, fixed-split attention and "
                "deterministic MoE sum yet"
            )
        )
    if name in ("triton", "flashmla") and not triton_available():
        raise DsakvError(f"attention backend {name} needs triton (pip install triton)")
    if name == "flashmla":
        ok, why = flashmla.probe()
        if ok:
            ok, why = flashmla.fits(layout, n_heads, index_heads, index_topk)
        if not ok:
            raise DsakvError(f"attention backend flashmla unavailable: {why}")
        backend: TorchBackend = flashmla.FlashMLABackend(layout)
    elif name == "triton":
        if device.type != "cuda":
            # Must be set before the kernel modules are imported (triton.jit reads it).
            os.environ["TRITON_INTERPRET"] = "1"
        backend = TritonBackend(layout)
    elif name == "cpu":
        if device.type != "cpu":
            raise DsakvError(f"attention backend cpu runs on the CPU, not {device.type}")
        backend = CpuBackend(layout, compile=compile, deterministic=deterministic)
    else:
        backend = TorchBackend()
    ops = "; ".join(f"{op}: {how}" for op, how in backend.describe().items())
    log.info("attention backend %s (%s)%s", backend.name, ops, f" [library: {why}]" if why else "")
    return backend
