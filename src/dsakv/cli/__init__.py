# This docstring is `dsakv --help`'s description: README.md describes the package.
"""dsakv, an inference engine for DeepSeek Sparse Attention models (GLM-5.x, DeepSeek-V3.2),
whose shared-indexer layers keep no index-K cache."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import errno
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from dsakv.errors import DsakvError
from dsakv.procs import interrupts_deferred

from . import bench, calibrate, device_check, disagg, plan, run_batch, serve
from .args import Parser, engine_config_from_args, fold_model_option, log_level

__all__ = ["build_parser", "engine_config_from_args", "main", "run"]

_COMMANDS: list[Callable[[Any], None]] = [
    plan.add_commands,
    serve.add_commands,
    run_batch.add_commands,
    disagg.add_commands,
    bench.add_commands,
    calibrate.add_commands,
    device_check.add_commands,
]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="dsakv", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.set_defaults(loads_torch=True)  # (a command that never does says so)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)  # (loads no torch: --help, a bad flag at once)
        if args.loads_torch:
            with interrupts_deferred():
                # torch's own imports swallow a Ctrl-C or leave numpy half-loaded ("cannot
                # load module more than once"): here a Ctrl-C waits for them to finish.
                import torch  # noqa: F401
        fold_model_option(args)
        logging.basicConfig(level=log_level(args), format="%(levelname)s %(name)s: %(message)s")
        code = args.func(args) or 0
        sys.stdout.flush()  # (a reader gone shows here, not at exit)
        return code
    except BrokenPipeError:
        if not _stdout_gone():
            raise
        # The reader went away (`dsakv plan … | head -1`): stop quietly, as other CLIs do, and
        # leave the exit status a process that SIGPIPE ended has (128 + 13).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the exit flush)
        return 141
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # A full disk (`dsakv plan … > /dev/full`, a model written there): one line and
        # status 1, as other CLIs say it (not 2: nothing the user gave was wrong).
        print(f"error: cannot write the output: {e.strerror}", file=sys.stderr)
        with contextlib.suppress(OSError):  # (a stdout without a file descriptor)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the exit flush)
        return 1
    except DsakvError as e:
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)  # 2: bad input; a rank that died says 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        from dsakv.distributed.parallel import is_dist_error

        if not is_dist_error(e):
            raise
        print(f"error: a rank failed: {e}".splitlines()[0], file=sys.stderr)
        return 1


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (any other broken pipe is a
    failure to report)."""
    import select

    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll(), or no real stdout
        return False


def _closed_std_streams_to_devnull() -> None:
    """A standard stream closed when the process started (`dsakv plan >&-`) becomes
    /dev/null, as if redirected there. Python left it None, so the first flush was a
    traceback; and its descriptor was the next one any open took, so what a rank or a C
    library writes to it would have landed in that file (a model's, the batch output)."""
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        if getattr(sys, name) is not None:
            continue
        try:
            os.fstat(fd)
            continue  # (taken since by a file of the process's: not ours to replace)
        except OSError:
            pass
        null = os.open(os.devnull, os.O_RDWR)  # (the lowest free descriptor: `fd` itself)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))  # noqa: SIM115


def run() -> NoReturn:
    """The `dsakv` command: `main`, then exit. Where a thread of ours is still running at
    the end (an engine load that a Ctrl-C cut short goes on inside torch), the interpreter's
    own exit would abort the process ("terminate called without an active exception",
    SIGABRT) as it stops that thread in C++ code: end it here instead, once the atexit
    hooks have run."""
    _closed_std_streams_to_devnull()
    try:
        code = main()
    except SystemExit as e:  # (argparse's: --help, a bad flag)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    sys.stdout.flush()
    sys.stderr.flush()
    if any(t.daemon and t.name.startswith("dsakv-") for t in threading.enumerate()):
        atexit._run_exitfuncs()
        os._exit(code)
    sys.exit(code)
