"""Host memory the ranks of one node map together (`node_shared_empty`).

Under TP every rank's HiSparse host latent is a replica of rank 0's, so one copy per node
serves them all. The node's first rank creates an anonymous memory file (`memfd_create`:
not a file under /dev/shm, which a container caps at 64 MiB unless told otherwise), every
rank of the node maps it through `/proc/<pid>/fd/<fd>`, and the creator closes its
descriptor once they all have: the memory goes with the last mapping, however the
processes end, and nothing is left behind to unlink.
"""

from __future__ import annotations

import os

import torch

from dsakv.errors import DsakvError

from .parallel import ParallelState


def node_leader(parallel: ParallelState) -> int:
    """The first rank on this rank's node (ranks are numbered node-major)."""
    return parallel.rank - parallel.rank % parallel.config.ranks_per_node


def node_shared_empty(parallel: ParallelState, nbytes: int, name: str) -> torch.Tensor:
    """`nbytes` of uninitialised host memory (uint8) that every rank on this node maps.

    A collective over every rank: each calls it at the same point with the same size. A
    page is backed when first written (the memory file is sparse); one rank's failure to
    map is raised on every rank."""
    leader, fd, path = node_leader(parallel), None, None
    if parallel.rank == leader:
        fd = os.memfd_create(f"dsakv-{name}", os.MFD_CLOEXEC)
        os.ftruncate(fd, max(nbytes, 1))
        path = f"/proc/{os.getpid()}/fd/{fd}"
    try:
        paths = parallel.all_gather_objects(path)
        try:
            t, failed = (
                torch.from_file(paths[leader], True, max(nbytes, 1), dtype=torch.uint8),
                None,
            )
        except (OSError, RuntimeError) as e:  # (a /proc this rank may not read, say)
            t, failed = None, f"rank {parallel.rank}: {str(e).splitlines()[0]}"
        errors = [e for e in parallel.all_gather_objects(failed) if e is not None]
    finally:
        if fd is not None:  # (every rank has mapped it, or given up)
            os.close(fd)
    if errors:
        raise DsakvError(f"cannot map the node's shared {name}: {'; '.join(errors)}")
    return t[:nbytes]
