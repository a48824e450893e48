"""`no_host_sync()`: fail on anything in a block that would make a CUDA device wait for the
host, proved on a CPU.

A CUDA graph records device work only: a step that reads a tensor value on the host
(`.item()`, `.tolist()`, `.cpu()`, a Python `if` on a tensor), or runs an op whose output
shape depends on values (`nonzero`, `bincount`, boolean indexing, `unique`), fails to
capture or silently bakes one step's values in. On a CPU those calls cost nothing and raise
nothing, so this guard watches for them at two levels:

- Python (`TorchFunctionMode`): the tensor methods that hand a value to the host;
- the dispatcher (`TorchDispatchMode`): the aten ops that do so internally (a composite op
  calling `nonzero`, `item` behind a `bool()`), whoever called them.

Triton kernel launches are opaque: under the interpreter a launch copies its arguments
through numpy, which is the kernel's business, not the step's; the guard pauses for the
launch alone (what the launch's Python wrapper does before it is still checked).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class HostSync(AssertionError):
    """A host sync inside a block that must have none."""


_METHODS = {
    torch.Tensor.item: "Tensor.item",
    torch.Tensor.tolist: "Tensor.tolist",
    torch.Tensor.cpu: "Tensor.cpu",
    torch.Tensor.numpy: "Tensor.numpy",
    torch.Tensor.__bool__: "a Python branch on a tensor (bool)",
    torch.Tensor.__int__: "int(tensor)",
    torch.Tensor.__float__: "float(tensor)",
    torch.Tensor.__index__: "a tensor used as a Python index",
    torch.Tensor.nonzero: "Tensor.nonzero",
    torch.nonzero: "torch.nonzero",
    torch.argwhere: "torch.argwhere",
    torch.bincount: "torch.bincount",
    torch.Tensor.bincount: "Tensor.bincount",
    torch.unique: "torch.unique",
    torch.Tensor.unique: "Tensor.unique",
    torch.masked_select: "torch.masked_select",
    torch.Tensor.masked_select: "Tensor.masked_select",
}

_ATEN = {
    aten._local_scalar_dense.default: "a tensor value read on the host (item / bool / int)",
    aten.nonzero.default: "aten.nonzero (output shape from values)",
    aten.bincount.default: "aten.bincount (syncs on CUDA)",
    aten.masked_select.default: "aten.masked_select (output shape from values)",
    aten._unique2.default: "aten.unique (output shape from values)",
    aten.unique_consecutive.default: "aten.unique_consecutive (output shape from values)",
    aten.repeat_interleave.Tensor: "repeat_interleave by a tensor (output shape from values)",
}


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class _Guard(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.paused = False
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            self.calls += 1
            what = _METHODS.get(func)
            indexing = func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__)
            if what is None and indexing and len(args) > 1 and _bool_index(args[1]):
                what = "boolean-mask indexing (output shape from values)"
            if what is not None:
                raise HostSync(f"host sync in a captured step: {what}")
        return func(*args, **kwargs)


class _AtenGuard(TorchDispatchMode):
    def __init__(self, guard: _Guard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.guard.paused:
            what = _ATEN.get(func)
            if what is None and func is aten.index.Tensor and _bool_index(tuple(args[1])):
                what = "aten.index with a boolean mask (output shape from values)"
            if what is not None:
                raise HostSync(f"host sync in a captured step: {what}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _opaque_triton_launches(guard: _Guard) -> Iterator[None]:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # no Triton: nothing to pause for
        yield
        return
    run = InterpretedFunction.run

    def paused_run(self, *args, **kwargs):
        guard.paused = True
        try:
            return run(self, *args, **kwargs)
        finally:
            guard.paused = False

    InterpretedFunction.run = paused_run
    try:
        yield
    finally:
        InterpretedFunction.run = run


@contextlib.contextmanager
def no_host_sync() -> Iterator[_Guard]:
    """Raise `HostSync` at the first host sync inside the block; yields the guard, whose
    `calls` counts the torch calls it checked (a test can assert the block did run)."""
    guard = _Guard()
    with _opaque_triton_launches(guard), guard, _AtenGuard(guard):
        yield guard


@contextlib.contextmanager
def guarding(graphs) -> Iterator[list[_Guard]]:
    """Every run of `graphs.model` (a `DecodeGraphs`' padded step: what a CUDA graph would
    hold, its buffers filled on the host before it) inside `no_host_sync` while the block
    runs; yields the guards, one per run, so a test can count the runs it checked."""
    inner, guards = graphs.model, []

    def guarded(*args, **kwargs):
        with no_host_sync() as guard:
            guards.append(guard)
            return inner(*args, **kwargs)

    graphs.model = guarded
    try:
        yield guards
    finally:
        graphs.model = inner
