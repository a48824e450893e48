"""One model across ranks: the parallel layout, its groups and collectives, and rank 0's
channel to the others (`leader`). What starts the ranks and DP attention sit above, in
`dsakv.engine` (`launch`, `dp`): they build engines."""

from .parallel import ParallelState

__all__ = ["ParallelState"]
