"""Whether an output path can be written, found out by trying, so a command refuses it before
minutes of work rather than losing that work to a traceback at the end.

Permission bits (`os.access`) cannot tell: root passes every check, and a read-only mount or
a pseudo-filesystem such as /proc refuses writes whatever the bits say."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path


def nearest_existing(path: Path) -> Path:
    """`path`, or its closest ancestor that is there. A broken link counts as there: creating
    through it fails, so it is the place to report."""
    while not (path.exists() or path.is_symlink()) and path != path.parent:
        path = path.parent
    return path


def can_create_in(folder: Path) -> bool:
    """A new file can be made in `folder` now: one is created and removed again."""
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".dsakv-probe-"):
            return True
    except OSError:
        return False


def can_append(file: Path) -> bool:
    """The existing `file` opens for writing, without truncating it (append) and without
    waiting on a FIFO that nobody reads yet (non-blocking: ENXIO, writable once one does)."""
    try:
        os.close(os.open(file, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
    except OSError as e:
        return e.errno == errno.ENXIO
    return True


def write_blocker(folder: Path) -> Path | None:
    """None when `folder` is, or can be made with its missing parents, a directory that takes
    new files; else the existing path in the way: a file, a broken link, or a directory
    nothing can be created in."""
    where = nearest_existing(folder)
    return None if where.is_dir() and can_create_in(where) else where
