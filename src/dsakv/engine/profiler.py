"""Profiles: torch.profiler on every rank's engine thread (SGLang's /start_profile and
/stop_profile), as `Engine`'s mixin."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsakv.errors import DsakvError, is_int

from .ranks import gather_outcome, said

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileSpec:
    """What /start_profile asked for, as every rank runs it (`Engine.start_profile_here`);
    `profile_id` names every rank's trace alike."""

    output_dir: str
    num_steps: int | None
    activities: tuple[str, ...]
    with_stack: bool
    record_shapes: bool
    profile_id: str


@dataclass
class _Profiling:
    spec: ProfileSpec
    torch: Any  # the running `torch.profiler.profile`
    steps: int = 0


# This mixin's calls that every rank runs (`Engine.every_rank_call`)
PROFILE_CALLS = ("start_profile_here", "stop_profile_here")


class ProfilerMixin:
    """`Engine`'s profiles. Its host holds `profiler` (set to None by `Engine.__init__`),
    calls `_profiled_step` after each step and `_drop_profile` as it closes, and runs calls
    on every rank (`_on_every_rank`, `parallel`, `device`)."""

    profiler: _Profiling | None  # the running profile, on every rank (None: none runs)

    def start_profile(
        self,
        output_dir: str | None = None,
        num_steps: int | None = None,
        activities: Iterable[str] | None = None,
        with_stack: bool | None = None,
        record_shapes: bool | None = None,
    ) -> None:
        """SGLang's /start_profile: torch.profiler on every rank's engine thread (CPU ops,
        and CUDA kernels on a GPU; SGLang's defaults: both, with stacks, no shapes) until
        `stop_profile`, or by itself after `num_steps` engine steps. Each rank writes its
        Chrome trace, `{output_dir}/{id}-TP-{tp_rank}.trace.json.gz` (`-DP-{tp_rank}` added
        under DP attention, `-PP-{stage}` under pipeline stages: SGLang's), output_dir by
        default $DSAKV_TORCH_PROFILER_DIR, else $SGLANG_TORCH_PROFILER_DIR, else /tmp."""
        if self.profiler is not None:
            raise DsakvError("a profile is running already (stop it first: /stop_profile)")
        if isinstance(activities, str):  # (one activity named alone)
            activities = [activities]
        activities = ("CPU", "GPU") if activities is None else tuple(activities)
        if not activities or not set(activities) <= {"CPU", "GPU"}:
            raise DsakvError(f"activities must be some of CPU, GPU, got {list(activities)}")
        if num_steps is not None and (not is_int(num_steps) or num_steps < 1):
            raise DsakvError(f"num_steps must be a positive integer, got {num_steps!r}")
        env = os.environ.get
        output_dir = (
            output_dir
            or env("DSAKV_TORCH_PROFILER_DIR")
            or env("SGLANG_TORCH_PROFILER_DIR")
            or "/tmp"
        )
        stack = True if with_stack is None else bool(with_stack)
        spec = ProfileSpec(
            output_dir, num_steps, activities, stack, bool(record_shapes), str(time.time())
        )
        outcome = self._on_every_rank("start_profile_here", spec)
        if outcome is not None:
            raise DsakvError(outcome)
        log.info("profiling: traces go to %s (profile %s)", output_dir, spec.profile_id)

    def stop_profile(self) -> list[str]:
        """SGLang's /stop_profile: every rank stops and writes its trace; their paths. A rank
        that cannot write (its directory gone since the start, a full disk) is the server's
        fault, not the request's: an OSError (the server's 500)."""
        if self.profiler is None:
            raise DsakvError("no profile is running (start one: /start_profile)")
        outcome = self._on_every_rank("stop_profile_here")
        if isinstance(outcome, str):
            raise OSError(f"the profile was not saved: {outcome}")
        return outcome

    def start_profile_here(self, spec: ProfileSpec) -> str | None:
        """This rank starts its profiler; None where every rank did, else each one's error
        (and none runs)."""
        from torch.profiler import ProfilerActivity, profile

        why = None
        try:
            Path(spec.output_dir).mkdir(parents=True, exist_ok=True)
            tempfile.NamedTemporaryFile(dir=spec.output_dir).close()  # (writable: not at stop)
            kinds = [ProfilerActivity.CPU] if "CPU" in spec.activities else []
            if "GPU" in spec.activities and self.device.type == "cuda":
                kinds.append(ProfilerActivity.CUDA)
            if not kinds:
                raise DsakvError("activities GPU alone: this engine runs on no GPU")
            prof = profile(
                activities=kinds, with_stack=spec.with_stack, record_shapes=spec.record_shapes
            )
            prof.start()
            self.profiler = _Profiling(spec, prof)
        except Exception as e:  # noqa: BLE001 - every rank hears it
            why = said(e)
        outcome = gather_outcome(self.parallel, None, why)
        if not isinstance(outcome, str):
            return None
        self._drop_profile()
        return outcome

    def _trace_ranks(self) -> str:
        """This rank in its trace's name, as SGLang names it: its TP rank, then its DP rank
        (its TP rank under DP attention) and its pipeline stage where there are several."""
        p = self.parallel
        dp = f"-DP-{p.tp_rank}" if p.config.dp_attention else ""
        pp = f"-PP-{p.stage}" if p.pp_size > 1 else ""
        return f"TP-{p.tp_rank}{dp}{pp}"

    def stop_profile_here(self) -> list[str] | str:
        """This rank stops its profiler and writes its trace: every rank's path (or each
        one's error)."""
        running, self.profiler = self.profiler, None
        path, why = None, None
        try:
            if running is None:
                raise DsakvError("no profile is running")
            running.torch.stop()
            spec = running.spec
            path = os.path.join(
                spec.output_dir, f"{spec.profile_id}-{self._trace_ranks()}.trace.json.gz"
            )
            running.torch.export_chrome_trace(path)
        except Exception as e:  # noqa: BLE001 - every rank hears it
            why = said(e)
        paths = gather_outcome(self.parallel, path, why)
        if isinstance(paths, str):
            return paths
        if self.parallel.is_driver:
            log.info("profile saved: %s", ", ".join(paths))
        return paths

    def _profiled_step(self) -> None:
        """A step under the profiler: the profile's last (`num_steps`) stops it, on every
        rank (under DP attention they step together, each stopping its own)."""
        running = self.profiler
        assert running is not None
        running.steps += 1
        if running.spec.num_steps is None or running.steps < running.spec.num_steps:
            return
        if self.parallel.world_size > 1 and self.parallel.config.dp_attention:
            outcome = self.stop_profile_here()
        else:
            outcome = self._on_every_rank("stop_profile_here")
        if isinstance(outcome, str):  # (no caller to tell)
            log.warning("the profile was not saved: %s", outcome)

    def _drop_profile(self) -> None:
        running, self.profiler = self.profiler, None
        if running is not None:
            running.torch.stop()
