"""Running one model across ranks: the parallel layout and the multi-process runtime."""

from .parallel import ParallelConfig, ParallelState, shard_range

__all__ = ["ParallelConfig", "ParallelState", "shard_range"]
