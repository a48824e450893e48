"""Benchmarks behind `dsakv bench`: capacity, throughput, IndexCache compute, parity, memory."""

from __future__ import annotations

from typing import Any

__all__ = ["BenchSizes", "run_bench"]


def __getattr__(name: str) -> Any:
    # Lazy: `import dsakv.bench.memory` stays light and the CLI imports torch only when run.
    if name in __all__:
        from . import run

        return getattr(run, name)
    raise AttributeError(name)
