"""Host memory every rank of one machine maps (`machine_shared_empty`).

Under TP every rank's HiSparse host latent is a replica of its pipeline stage's TP rank
0's (every rank's, with one stage), so one copy serves them all. That rank creates an
anonymous memory file (`memfd_create`: not a file under /dev/shm, which a container caps at
64 MiB unless told otherwise), the stage's other ranks map it through `/proc/<pid>/fd/<fd>`,
and it closes its descriptor once they all have: the memory goes with the last mapping,
however the processes end, and nothing is left behind to unlink. Each rank checks it runs
on that rank's machine and mapped its file (a torchrun over several machines without
`--nnodes` would otherwise open another file).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from dsakv.errors import DsakvError, one_line

from .parallel import ParallelState

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")  # (one per machine and boot)


def machine_shared_empty(parallel: ParallelState, nbytes: int, name: str) -> torch.Tensor:
    """`nbytes` of uninitialised host memory (uint8) that every rank of a pipeline stage
    maps (every rank, with one stage), all on one machine (`--nnodes 1`): its TP rank 0
    makes it.

    A collective over every rank: each calls it at the same point, a stage's ranks with the
    same size. Its pages are backed when first touched; any rank's failure is raised on
    every rank."""
    fd, made, failed = None, None, None
    if parallel.tp_rank == 0:
        try:
            fd = os.memfd_create(f"dsakv-{name}", os.MFD_CLOEXEC)
            os.ftruncate(fd, max(nbytes, 1))
            st = os.fstat(fd)
            made = (f"/proc/{os.getpid()}/fd/{fd}", _BOOT_ID.read_text(), st.st_dev, st.st_ino)
        except OSError as e:
            failed = f"rank {parallel.rank} cannot make it: {one_line(e)}"
    try:
        made = parallel.all_gather_objects(made)[parallel.rank - parallel.tp_rank]
        t = None
        if made is not None:
            path, boot, dev, ino = made
            try:
                if _BOOT_ID.read_text() != boot:
                    raise OSError(
                        "this rank runs on another machine than its stage's TP rank 0 (--nnodes?)"
                    )
                st = os.stat(path)
                if (st.st_dev, st.st_ino) != (dev, ino):
                    raise OSError(f"{path} is not its stage's TP rank 0's memory file here")
                t = torch.from_file(path, True, max(nbytes, 1), dtype=torch.uint8)
            except (OSError, RuntimeError) as e:
                failed = f"rank {parallel.rank}: {one_line(e)}"
        errors = [e for e in parallel.all_gather_objects(failed) if e is not None]
    finally:
        if fd is not None:  # (every rank has mapped it, or given up)
            os.close(fd)
    if errors:
        raise DsakvError(f"cannot map one {name} for every rank: {'; '.join(errors)}")
    return t[:nbytes]
