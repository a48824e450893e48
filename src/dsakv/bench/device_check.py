"""`dsakv device-check`: the one prepared GPU run (scripts/device_check.sh calls it).

One command that fits a single 10-minute device call: eleven stages in order, each in its
own child process with its own deadline (`STAGES`), under one overall budget. After every
stage `OUT/device_check.json` is rewritten and one line is printed (flushed), so a run cut
short still hands back every figure measured so far. A stage past its deadline is killed
(after a traceback dump to the log: `faulthandler` on SIGUSR1), recorded as timed out with
whatever it had saved, and the next stage runs. A stage that crashes the CUDA context
takes only its own process down.

Files under OUT (`$OUT` when `--out` is not given, else ./device-check-out):
`device_check.json` (every figure), `device_check.log` (the children's output) and
`kernel_tests.xml` (pytest's junit report).

Models: the check reads tiny presets from a models folder (`--models DIR`; by default
`.device-models/` in the checkout when it exists, else a cache folder) and generates a
missing one there. `--prepare DIR` generates them beforehand on a CPU, so the device run
carries them (`carry: [".device-models"]`, about 24 MiB) instead of building them there.

`--dry-run` runs every stage's CPU-capable code on the CPU (Triton interpreter, tiny
shapes, `pytest --collect-only`); CUDA-only parts are skipped with a recorded reason.
`make test` runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]  # the checkout (src/dsakv/bench/ -> root)
KERNEL_TESTS = "tests/test_kernels_cuda.py"
JSON_NAME, LOG_NAME, JUNIT_NAME = "device_check.json", "device_check.log", "kernel_tests.xml"
MODELS_DIRNAME = ".device-models"


@dataclass(frozen=True)
class Stage:
    name: str
    deadline: float  # seconds on the GPU (the dry run uses DRY_DEADLINE)
    what: str


# Deadlines sum to 735 s, capped by the 525 s budget (a stage gets what is left of it): one
# device call of 10 minutes, with the machine's start and the children's imports (~5 s
# each) inside the margin. The first H200 run took 166 s for the first eight.
STAGES: tuple[Stage, ...] = (
    Stage("env", 20, "torch, triton, GPU, capability, driver; the models folder"),
    Stage("kernel_launch", 90, "every Triton wrapper once at real-ish shapes (compiles them)"),
    Stage("moe_capture", 40, "one MoE decode step under sync-debug 'error', graph replay == eager"),
    Stage("kernel_tests", 150, f"pytest -m cuda {KERNEL_TESTS}, per-test timeout"),
    Stage("graph_vs_eager", 45, "bf16 greedy tokens, CUDA-graph decode == eager decode"),
    Stage("triton_vs_torch", 45, "fp32, graphs off: greedy agreement, max logprob difference"),
    Stage("decode", 75, "decode tokens/s graph / eager / torch at batch 1 and 32"),
    Stage("kernel_bandwidth", 55, "each kernel's bytes/s against the measured copy bandwidth"),
    Stage("features", 135, "HiSparse, host tier, MTP, PD, seeded sampling, a grammar on the GPU"),
    Stage("lora", 40, "--enable-lora: base-only bit-equal in graphs, an adapter's runs, tok/s"),
    Stage("prefill_profile", 40, "one step prefilling 16 requests under torch.profiler"),
)
BENCH = Stage("bench", 0, "`dsakv bench --quick` (only with --bench, in the time left)")
BUDGET_S = 525.0
DRY_DEADLINE = 600.0  # per stage on a CPU (the interpreter on a loaded machine), no budget
KILL_GRACE_S = 3.0  # after SIGUSR1 (traceback dump), before SIGKILL
MIN_STAGE_S = 5.0  # a stage with less than this left in the budget is skipped

GPU_PRESET, DRY_PRESET = "glm-bench-short", "glm-tiny"  # 16 layers with 13 MoE / 8 with 7
# triton vs torch in fp32: pass bounds (see `_stage_triton_vs_torch` and the README)
MIN_AGREEMENT, DENSE_MAX_LOGPROB_DIFF = 0.9, 1e-3
MIN_STEPS = 32  # fewer compared steps (the dry run's few) cannot bound an agreement
PER_TEST_TIMEOUT_S = 60
STALL_ENV = "DSAKV_DEVICE_CHECK_STALL"  # a stage name: its child hangs (tests of the deadline)


# --- the parent: stages in child processes ------------------------------------------------


def default_out() -> str:
    """`$OUT` (the device machine's returned folder) when set, else ./device-check-out."""
    return os.environ.get("OUT") or "device-check-out"


def default_models_dir(dry_run: bool = False) -> Path:
    """On the GPU `.device-models/` of the checkout when it exists (prepared and carried);
    else, and for the dry run, `$DSAKV_CACHE/device-check` (~/.cache/dsakv/device-check)."""
    carried = ROOT / MODELS_DIRNAME
    if carried.is_dir() and not dry_run:
        return carried
    cache = Path(os.environ.get("DSAKV_CACHE") or Path.home() / ".cache" / "dsakv")
    return cache / "device-check"


def run_device_check(
    out_dir: str | None = None,
    dry_run: bool = False,
    *,
    models: str | None = None,
    stages: Iterable[str] | None = None,
    deadlines: dict[str, float] | None = None,
    budget: float | None = None,
    bench: bool = False,
    on_stage: Callable[[str, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every stage in order, each in a child process under its deadline; the JSON is
    rewritten and one line printed after each. `stages` picks a subset (in STAGES order),
    `deadlines` overrides seconds per stage, `budget` the total (None: BUDGET_S on the GPU,
    unbounded in the dry run). `on_stage(name, result)` runs after each rewrite."""
    out = Path(out_dir or default_out())
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    bench = bench or (stages is not None and BENCH.name in stages)
    plan = list(STAGES + ((BENCH,) if bench else ()))
    if stages is not None:
        wanted = set(stages)
        unknown = wanted - {s.name for s in plan}
        if unknown:
            raise ValueError(f"unknown stage(s) {', '.join(sorted(unknown))}")
        plan = [s for s in plan if s.name in wanted]
    unknown = set(deadlines or {}) - {s.name for s in STAGES + (BENCH,)}
    if unknown:
        raise ValueError(f"deadline for unknown stage(s) {', '.join(sorted(unknown))}")
    if budget is None and not dry_run:
        budget = BUDGET_S
    out.mkdir(parents=True, exist_ok=True)  # (once the arguments are known good)
    models_dir = Path(models) if models else default_models_dir(dry_run)
    t0 = time.time()
    result: dict[str, Any] = {
        "dry_run": dry_run,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "budget_s": budget,
        "models_dir": str(models_dir),
        "stages": {s.name: {"status": "pending"} for s in plan},
        "ok": False,
        "complete": False,
    }
    json_path, log_path = out / JSON_NAME, out / LOG_NAME
    _write_json(json_path, result)
    log_path.write_text("")
    print(f"dsakv device check: {len(plan)} stages, out {out}", flush=True)
    no_cuda = None
    for i, stage in enumerate(plan, 1):
        deadline = (deadlines or {}).get(stage.name)
        if deadline is None:
            deadline = DRY_DEADLINE if dry_run or stage is BENCH else stage.deadline
        left = None if budget is None else budget - (time.time() - t0)
        if no_cuda:
            rec: dict[str, Any] = {"status": "skipped", "ok": False, "reason": no_cuda}
        elif left is not None and left < max(MIN_STAGE_S, 60.0 if stage is BENCH else 0):
            rec = {"status": "skipped", "ok": False, "reason": f"budget spent ({left:.0f} s left)"}
        else:
            if left is not None:
                deadline = min(deadline, left)
            settings = {
                "dry_run": dry_run,
                "out": str(out.resolve()),
                "models": str(models_dir.resolve()),
                "deadline_s": deadline,
            }
            rec = _run_stage(stage.name, settings, deadline, out, log_path)
        result["stages"][stage.name] = rec
        if stage.name == "env" and rec.get("cuda_available") is False and not dry_run:
            no_cuda = "no CUDA device (the env stage found none; --dry-run runs on a CPU)"
        result["wall_s"] = round(time.time() - t0, 1)
        result["ok"] = all(r.get("ok") for r in result["stages"].values())
        result["complete"] = i == len(plan)
        _write_json(json_path, result)
        print(stage_line(i, len(plan), stage.name, rec), flush=True)
        if on_stage is not None:
            on_stage(stage.name, result)
    return result


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically: a run killed mid-write leaves the previous complete file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def _run_stage(
    name: str, settings: dict[str, Any], deadline: float, out: Path, log_path: Path
) -> dict[str, Any]:
    """One stage in a child process (its own session, killed with its children at the
    deadline); its record is what it last saved to its result file."""
    result_file = out / f".stage-{name}.json"
    result_file.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    if settings["dry_run"]:
        env["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    cmd = [sys.executable, "-u", "-m", "dsakv.bench.device_check", "--stage", name,
           "--result", str(result_file), "--settings", json.dumps(settings)]  # fmt: skip
    start = time.time()
    timed_out = False
    with open(log_path, "a") as log:
        log.write(f"\n===== stage {name} (deadline {deadline:.0f} s) =====\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=max(deadline, 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            rc = proc.returncode
    rec = _read_record(result_file)
    result_file.unlink(missing_ok=True)
    for pgid in rec.pop("child_groups", []):  # what the stage started in its own sessions
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    rec["seconds"] = round(time.time() - start, 2)
    if timed_out:
        rec.update(
            status="timed_out",
            ok=False,
            error=f"past its deadline of {deadline:.0f} s (killed; see {LOG_NAME})",
        )
    elif rec.get("deadline_reached"):  # stopped itself short of its deadline
        rec.update(status="timed_out", ok=False)
        rec.setdefault("error", f"reached its deadline of {deadline:.0f} s before it finished")
    elif "ok" not in rec:  # died without a final record: a crash, an abort
        rec.update(status="error", ok=False)
        rec.setdefault("error", f"the stage's process exited {rc} without a result")
        rec["log_tail"] = _tail(log_path, 40)
    else:
        rec["status"] = "ok" if rec["ok"] else "failed"
    return rec


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGUSR1 (the child's faulthandler dumps every thread's stack to the log), then
    SIGKILL to the child's whole process group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGUSR1)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=KILL_GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _read_record(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _tail(path: Path, n: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# --- the child: one stage -----------------------------------------------------------------


class Record(dict):
    """A stage's figures; `save()` rewrites its result file, so what a stage measured
    before it was killed still reaches the JSON."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def save(self) -> None:
        _write_json(self.path, self)


@dataclass
class Ctx:
    dry_run: bool
    out: Path
    models: Path
    deadline_at: float

    @property
    def device(self):
        import torch

        return torch.device("cpu" if self.dry_run else "cuda")

    def left(self) -> float:
        return self.deadline_at - time.time()


def _child_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dsakv.bench.device_check")
    p.add_argument("--stage", required=True, choices=[s.name for s in STAGES + (BENCH,)])
    p.add_argument("--result", required=True)
    p.add_argument("--settings", required=True)
    args = p.parse_args(argv)
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's deadline
    s = json.loads(args.settings)
    ctx = Ctx(s["dry_run"], Path(s["out"]), Path(s["models"]), time.time() + s["deadline_s"])
    rec = Record(Path(args.result))
    rec["status"] = "running"
    rec.save()
    if os.environ.get(STALL_ENV) == args.stage:  # the tests' stand-in for a hung stage
        time.sleep(3600)
    try:
        _STAGE_FNS[args.stage](ctx, rec)
        rec.setdefault("ok", True)
    except Exception as e:  # recorded: the parent reports it and runs the next stage
        rec["ok"] = False
        rec["error"] = f"{type(e).__name__}: {e}"
        rec["traceback"] = traceback.format_exc()[-4000:]
        traceback.print_exc()
    rec.save()
    return 0


def _try(rec: dict[str, Any], key: str, fn: Callable[[], Any]) -> Any:
    """`fn()`, or its error recorded under `rec['errors'][key]` (None returned)."""
    try:
        return fn()
    except Exception as e:
        rec.setdefault("errors", {})[key] = f"{type(e).__name__}: {e}"[:2000]
        traceback.print_exc()
        return None


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- models -------------------------------------------------------------------------------


def prepare_models(models_dir: str | Path, dry_run: bool = False) -> list[dict[str, Any]]:
    """Generate (on any CPU) the models the check uses into `models_dir`, for the device
    run to carry: the GPU preset, plus the dry run's with `dry_run`."""
    presets = [GPU_PRESET] + ([DRY_PRESET] if dry_run else [])
    rows = []
    for preset in presets:
        start = time.perf_counter()
        path, made = ensure_model(Path(models_dir), preset)
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        rows.append({"preset": preset, "path": str(path), "generated": made,
                     "MiB": round(size / 2**20, 1), "seconds": round(time.perf_counter() - start, 1)})  # fmt: skip
    return rows


def ensure_model(models_dir: Path, preset: str, mtp: str = "none") -> tuple[Path, bool]:
    """`models_dir/preset` (config, weights, tokenizer; no MTP layer, or `models_dir/
    preset-mtp` with one distilled from the target: `mtp="fit"`), generated when absent:
    (path, whether it was generated now)."""
    name = preset if mtp == "none" else f"{preset}-mtp"
    path = models_dir / name
    if (path / ".complete").is_file():
        return path, False
    import shutil

    import torch

    from dsakv.models.tiny import write_tiny_model

    models_dir.mkdir(parents=True, exist_ok=True)
    tmp = models_dir / f".{name}.tmp{os.getpid()}"
    dtype = torch.bfloat16 if preset.startswith("glm-bench") else torch.float32
    write_tiny_model(tmp, preset, seed=0, dtype=dtype, mtp=mtp)
    (tmp / ".complete").write_text(json.dumps({"preset": preset, "seed": 0, "mtp": mtp}))
    if path.exists():  # a concurrent writer won, or a broken earlier try
        shutil.rmtree(path if not (path / ".complete").is_file() else tmp, ignore_errors=True)
    if not path.exists():
        tmp.rename(path)
    return path, True


def _model(ctx: Ctx) -> str:
    return str(ensure_model(ctx.models, DRY_PRESET if ctx.dry_run else GPU_PRESET)[0])


def _engine(ctx: Ctx, model: str | None = None, **kw: Any):
    from dsakv.engine import EngineConfig
    from dsakv.engine.engine import Engine

    # The dry run's padded decode scores a whole width bucket (256+ at 512): short there.
    if ctx.dry_run:
        kw = {"max_model_len": 64, "kv_budget_gib": 1 / 16, **kw}
    # At most 32 requests: the graph buckets captured at start-up stop at 32.
    kw = {"max_model_len": 512, "max_running_requests": 32, **kw}
    return Engine(EngineConfig(model=model or _model(ctx), device=str(ctx.device), **kw))


def _close(engine) -> None:
    import torch

    with contextlib.suppress(Exception):
        engine.close()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _decode_graphs(engine):
    """The engine's padded-decode graphs object (None when decode runs unpadded)."""
    return getattr(getattr(engine, "runner", None), "decode_graphs", None)


def _captured(engine) -> list[int] | None:
    """Batch buckets with a captured decode graph ([] without graphs; None: the engine
    does not say)."""
    graphs = _decode_graphs(engine)
    if graphs is None:
        return []
    held = getattr(graphs, "graphs", None)
    return None if held is None else sorted(held)


def _graph_blocker(engine) -> str | None:
    """Why the engine runs decode unpadded (None: padded, captured on CUDA)."""
    return getattr(engine, "decode_graph_blocker", None)


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in lengths]


def _greedy(tokens: int, logprobs: int | None = None):
    from dsakv.engine import SamplingParams

    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)


def _generate(engine, prompts: list[list[int]], tokens: int, logprobs: int | None = None,
              params=None):  # fmt: skip
    """Every prompt run to its end; `params`: one for all, or a list (one each)."""
    params = params or _greedy(tokens, logprobs)
    each = params if isinstance(params, list) else [params] * len(prompts)
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, each)]
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()  # pages, slots and the prefix cache add up
    return reqs


# --- stages -------------------------------------------------------------------------------


def _stage_env(ctx: Ctx, rec: Record) -> None:
    import importlib.metadata as md
    import importlib.util

    import torch

    rec.update(python=platform.python_version(), torch=torch.__version__,
               torch_cuda=torch.version.cuda, device=str(ctx.device))  # fmt: skip
    for pkg in ("triton", "transformers", "pytest"):
        try:
            rec[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            rec[pkg] = None
    rec["pytest_timeout"] = importlib.util.find_spec("pytest_timeout") is not None
    rec["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        rec.update(gpu=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                   memory_gib=round(p.total_memory / 2**30, 1))  # fmt: skip
    rec["driver"] = _nvidia_smi("driver_version")
    rec.save()
    if not ctx.dry_run and not rec["cuda_available"]:
        rec["ok"] = False
        rec["error"] = "torch sees no CUDA device"
        return
    start = time.perf_counter()
    path, made = ensure_model(ctx.models, DRY_PRESET if ctx.dry_run else GPU_PRESET)
    rec["model"] = {"path": str(path), "generated_here": made,
                    "seconds": round(time.perf_counter() - start, 2)}  # fmt: skip
    rec["ok"] = True


def _nvidia_smi(field: str) -> str | None:
    try:
        proc = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=15)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout else None


def _launch_cases(dry: bool, device) -> list[tuple[str, Callable[[], Any]]]:
    """(name, zero-argument launch) for every Triton wrapper, at real-ish shapes (tiny in
    the dry run). Inputs are built lazily inside each launch so one bad case stays alone."""
    import torch

    from dsakv.kernels import triton_fp8, triton_indexer, triton_mla, triton_rows, triton_store
    from dsakv.kernels.triton_bench import KV_LORA, ROPE, _index_pages, _latent_cache

    g = torch.Generator(device=device).manual_seed(0)
    ctx, topk = (256, 32) if dry else (8192, 2048)
    b, heads = (2, 4) if dry else (4, 64)
    e, length = (8, 64) if dry else (64, 4096)
    hi, ps = (2, 64) if dry else (32, 64)
    n = 16 if dry else 4096
    dim = KV_LORA + ROPE

    def decode(kind: str, h: int, q_dtype=torch.bfloat16):
        def run():
            cache = _latent_cache(kind, ctx, device)
            q = torch.randn(b, h, dim, device=device, generator=g).to(q_dtype)
            slots = torch.stack(
                [torch.randperm(ctx, device=device, generator=g)[:topk] for _ in range(b)]
            ).to(torch.int32)
            slots[:, -1] = -1  # one invalid slot per query
            return triton_mla.sparse_mla_decode(q, cache, kind, slots, dim**-0.5, KV_LORA, ROPE)

        return run

    def extend(kind: str, dense: bool):
        def run():
            cache = _latent_cache(kind, length, device)
            q = torch.randn(e, heads, dim, device=device, generator=g).to(torch.bfloat16)
            ctx_slots = torch.randperm(length, device=device, generator=g).to(torch.int32)
            q_pos = torch.arange(length - e, length, device=device, dtype=torch.int32)
            k = min(topk, length - e)
            pos = None if dense else torch.stack(
                [torch.randperm(length - e, device=device, generator=g)[:k] for _ in range(e)]
            ).to(torch.int32)  # fmt: skip
            return triton_mla.sparse_mla_extend(
                q, cache, kind, ctx_slots, q_pos, pos, dim**-0.5, KV_LORA, ROPE
            )

        return run

    def chunks():
        """Three requests' chunks for a varlen launch: (contexts one after another in a
        shuffled slot order, per-query context start and length int32, positions int32)."""
        ctx_lens = [length // 2, length // 8, length // 4]
        news = [e // 2, e // 4, e - e // 2 - e // 4]
        slots = torch.randperm(sum(ctx_lens), device=device, generator=g)
        start, lens, q_pos, at = [], [], [], 0
        for c, m in zip(ctx_lens, news):
            start += [at] * m
            lens += [c] * m
            q_pos += range(c - m, c)
            at += c
        i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
        return slots, i32(start), i32(lens), max(ctx_lens), i32(q_pos)

    def extend_varlen(kind: str):
        def run():
            cache = _latent_cache(kind, length, device)
            slots, start, lens, width, q_pos = chunks()
            q = torch.randn(e, heads, dim, device=device, generator=g).to(torch.bfloat16)
            pos = torch.randint(-1, width, (e, min(topk, width)), device=device, generator=g)
            return triton_mla.sparse_mla_extend_varlen(
                q, cache, kind, slots, start, lens, width, q_pos, pos.to(torch.int32),
                dim**-0.5, KV_LORA, ROPE,
            )  # fmt: skip

        return run

    def logits_extend_varlen():
        slots, start, lens, width, q_pos = chunks()
        kp, _ = _index_pages(length, 1, ps, device)
        q = torch.randn(e, hi, 128, device=device, generator=g).to(torch.bfloat16)
        w = torch.randn(e, hi, device=device, generator=g)
        return triton_indexer.index_logits_extend_varlen(
            q, w, kp, slots, start, lens, width, q_pos, ps
        )

    def paged(h: int):
        def run():
            kp, table = _index_pages(ctx, b, ps, device)
            lens = torch.full((b,), ctx - 5, dtype=torch.int32, device=device)
            q = torch.randn(b, h, 128, device=device, generator=g).to(torch.bfloat16)
            w = torch.randn(b, h, device=device, generator=g)
            return triton_indexer.index_logits_paged(q, w, kp, table, lens, ps, ctx)

        return run

    def logits_extend():
        kp, table = _index_pages(length, 1, ps, device)
        slots = (table[0].long()[:, None] * ps + torch.arange(ps, device=device)).flatten()
        q = torch.randn(e, hi, 128, device=device, generator=g).to(torch.bfloat16)
        w = torch.randn(e, hi, device=device, generator=g)
        q_pos = torch.arange(length - e, length, device=device, dtype=torch.int32)
        return triton_indexer.index_logits_extend(q, w, kp, slots, q_pos, ps)

    def rows(d: int):
        return torch.randn(n, d, device=device, generator=g)

    def dst_slots():
        s = torch.randperm(2 * n, device=device, generator=g)[:n]
        s[0] = -1  # skipped
        return s

    def store_ds():
        cache = torch.zeros(2 * n, 656, dtype=torch.uint8, device=device)
        triton_store.store_latent_ds_mla(rows(dim), cache, dst_slots(), KV_LORA, ROPE)
        return cache

    def store_e4m3():
        cache = torch.zeros(2 * n, dim, dtype=torch.uint8, device=device)
        triton_store.store_latent_fp8_e4m3(rows(dim).to(torch.bfloat16), cache, dst_slots())
        return cache

    def store_ik():
        kp = torch.zeros(2 * n // ps + 1, ps * 132, dtype=torch.uint8, device=device)
        triton_store.store_index_k_fp8(rows(128), kp, dst_slots(), ps)
        return kp

    def store_rows(dtype):
        def run():
            data = torch.zeros(2 * n, dim, dtype=dtype, device=device)
            triton_rows.store_rows(rows(dim), data, dst_slots())
            return data

        return run

    x = lambda: torch.randn(n * 64, device=device, generator=g)
    return [
        ("sparse_mla_decode[fp8_ds_mla,H64]", decode("fp8_ds_mla", heads)),
        # (the interpreter takes ~2 s a decode: the dry run leaves these two out)
        *(
            []
            if dry
            else [
                ("sparse_mla_decode[fp8_ds_mla,H128]", decode("fp8_ds_mla", 2 * heads)),
                (
                    "sparse_mla_decode[fp8_ds_mla,q_fp32]",
                    decode("fp8_ds_mla", heads, torch.float32),
                ),
            ]
        ),  # fmt: skip
        ("sparse_mla_decode[fp8_e4m3]", decode("fp8_e4m3", heads)),
        ("sparse_mla_decode[bf16]", decode("bf16", heads)),
        ("sparse_mla_decode[fp32]", decode("fp32", heads, torch.float32)),
        ("sparse_mla_extend[fp8_ds_mla,topk]", extend("fp8_ds_mla", dense=False)),
        ("sparse_mla_extend[fp8_ds_mla,dense]", extend("fp8_ds_mla", dense=True)),
        ("sparse_mla_extend[bf16,topk]", extend("bf16", dense=False)),
        ("sparse_mla_extend_varlen[fp8_ds_mla,3 requests]", extend_varlen("fp8_ds_mla")),
        ("index_logits_paged[Hi32]" if not dry else "index_logits_paged", paged(hi)),
        *([] if dry else [("index_logits_paged[Hi64]", paged(2 * hi))]),
        ("index_logits_extend", logits_extend),
        ("index_logits_extend_varlen[3 requests]", logits_extend_varlen),
        ("store_latent_ds_mla", store_ds),
        ("store_latent_fp8_e4m3", store_e4m3),
        ("store_index_k_fp8", store_ik),
        ("store_rows[bf16]", store_rows(torch.bfloat16)),
        ("store_rows[fp32]", store_rows(torch.float32)),
        ("encode_e4m3", lambda: triton_fp8.encode_e4m3(x())),
        ("decode_e4m3", lambda: triton_fp8.decode_e4m3(triton_fp8.encode_e4m3(x()))),
        ("round_bf16", lambda: triton_fp8.round_bf16(x())),
        ("pow2_scale", lambda: triton_fp8.pow2_scale(x().abs())),
    ]


def _stage_kernel_launch(ctx: Ctx, rec: Record) -> None:
    """Each Triton wrapper once (first call: compile + run), synchronised, then a second
    timed call; NaN outputs count as errors. Per kernel: ok / error."""
    import torch

    device = ctx.device
    kernels: dict[str, dict[str, Any]] = {}
    rec["kernels"] = kernels
    for name, fn in _launch_cases(ctx.dry_run, device):
        if ctx.left() < 2:
            kernels[name] = {"ok": False, "error": "stage deadline reached before this launch"}
            rec["deadline_reached"] = True
            continue
        row: dict[str, Any] = {}
        try:
            start = time.perf_counter()
            out = fn()
            _sync(device)
            row["first_s"] = round(time.perf_counter() - start, 3)  # with compile
            if not ctx.dry_run:
                start = time.perf_counter()
                out = fn()
                _sync(device)
                row["second_s"] = round(time.perf_counter() - start, 4)  # inputs too
            is_float = isinstance(out, torch.Tensor) and out.is_floating_point()
            if is_float and torch.isnan(out).any():
                raise ValueError("NaN in the output")
            row["ok"] = True
        except Exception as e:
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:1000])
            traceback.print_exc()
        kernels[name] = row
        rec.save()
    failed = [k for k, r in kernels.items() if not r["ok"]]
    rec["launched"], rec["failed"] = len(kernels) - len(failed), failed
    rec["ok"] = not failed


def _stage_moe_capture(ctx: Ctx, rec: Record) -> None:
    """The model's first MoE layer (the engine's backend, bf16 on CUDA) at decode batch
    sizes: eager twice (bit-equal), then on CUDA an eager call under
    `torch.cuda.set_sync_debug_mode("error")`, a CUDA-graph capture with that mode on
    inside the capture, and a replay on new inputs == eager on them, bit for bit."""
    import torch

    dry = ctx.dry_run
    engine = _engine(ctx, attention_backend="triton", **({} if dry else {"dtype": "bfloat16"}))
    try:
        layers = engine.model.model.layers
        idx, moe = next((i, la.mlp) for i, la in enumerate(layers) if hasattr(la.mlp, "experts"))
        rec["layer"] = idx
        rec["experts_op"] = type(moe.experts.ops).__name__
        rec["dtype"] = str(engine.model.dtype)
        if dry:
            rec["capture"] = "skipped: CUDA graphs and sync-debug mode need a CUDA device"
        hidden = engine.model_config.hidden_size
        cases: dict[str, dict[str, Any]] = {}
        rec["batches"] = cases
        for b in (1, 2) if dry else (1, 32):
            row: dict[str, Any] = {}
            cases[f"batch_{b}"] = row
            g = torch.Generator(device=ctx.device).manual_seed(b)
            x, x2 = (torch.randn(b, hidden, device=ctx.device, generator=g).to(engine.model.dtype)
                     for _ in range(2))  # fmt: skip
            with torch.inference_mode():
                ref = moe(x2).clone()
                row["eager_deterministic"] = bool(torch.equal(moe(x2), ref))
                if not dry:
                    _moe_graph(moe, x, x2, ref, row)
            rec.save()
        bad = [k for k, r in cases.items() if not _moe_ok(r, dry)]
        rec["ok"] = not bad
        if bad:
            rec["error"] = f"failed at {', '.join(bad)}: " + "; ".join(
                cases[k].get("error", "not bit-equal") for k in bad
            )
    finally:
        _close(engine)


def _moe_ok(row: dict[str, Any], dry: bool) -> bool:
    checks = ("eager_deterministic",) if dry else (
        "eager_deterministic", "sync_free", "captured", "replay_equals_eager")  # fmt: skip
    return all(row.get(k) is True for k in checks)


@contextlib.contextmanager
def _syncs_raise():
    """Any host sync on the device raises inside the block."""
    import torch

    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _moe_graph(moe, x, x2, ref, row: dict[str, Any]) -> None:
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe(x)  # warm-up off the capture stream (allocator, kernels)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    try:
        with _syncs_raise():
            moe(x)
        row["sync_free"] = True
    except Exception as e:
        row["sync_free"] = False
        row["error"] = f"eager step syncs with the host: {type(e).__name__}: {e}"[:1500]
        return
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph), _syncs_raise():
            static_out = moe(static_x)
        row["captured"] = True
    except Exception as e:
        row["captured"] = False
        row["error"] = f"capture failed: {type(e).__name__}: {e}"[:1500]
        return
    static_x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    row["replay_equals_eager"] = bool(torch.equal(static_out, ref))
    if not row["replay_equals_eager"]:
        row["max_abs_diff"] = float((static_out.float() - ref.float()).abs().max())


def _stage_kernel_tests(ctx: Ctx, rec: Record) -> None:
    """`pytest -m cuda` on the kernel tests (the dry run: collection only), junit XML to
    OUT; a per-test timeout (pytest-timeout when installed, else pytest's own
    `faulthandler_timeout` dump) and the stage's own cut, short of its deadline."""
    import importlib.util

    if not (ROOT / KERNEL_TESTS).is_file():
        raise FileNotFoundError(f"{KERNEL_TESTS} not found under {ROOT} (run from a checkout)")
    junit = ctx.out / JUNIT_NAME
    junit.unlink(missing_ok=True)
    cmd = [sys.executable, "-u", "-m", "pytest", "-m", "cuda", KERNEL_TESTS, "-v", "-v", "-rfE",
           "-p", "no:cacheprovider", f"--junitxml={junit}",
           # the kernel_bandwidth stage times the kernels
           "--deselect", f"{KERNEL_TESTS}::test_bench_runs_on_device"]  # fmt: skip
    if importlib.util.find_spec("pytest_timeout") is not None:  # fails the test, goes on
        cmd += [f"--timeout={PER_TEST_TIMEOUT_S}", "--timeout-method=signal"]
        rec["per_test_timeout"] = f"pytest-timeout {PER_TEST_TIMEOUT_S} s"
    else:  # pytest's own: dumps the stacks of a test past it (the stage's cut ends it)
        cmd += ["-o", f"faulthandler_timeout={PER_TEST_TIMEOUT_S}"]
        rec["per_test_timeout"] = f"faulthandler_timeout {PER_TEST_TIMEOUT_S} s (dump only)"
    if ctx.dry_run:
        cmd.append("--collect-only")
        rec["skip_reason"] = "dry run: collection only (the tests need a CUDA device)"
    rc, lines = _run_streaming(cmd, timeout=max(ctx.left() - 8, 1), rec=rec)
    rec["cut"] = rc is None
    counts = _junit_counts(junit) if junit.is_file() else None
    if counts is None:  # cut before pytest wrote its report: count the -v lines
        counts = _verbose_counts(lines)
    rec.update(counts)
    summary = next((ln for ln in reversed(lines) if re.search(r"\d+ (passed|failed|error|selected|tests? collected)", ln)), "")  # fmt: skip
    rec["summary"] = summary.strip("= ").strip() or (lines[-1] if lines else "")
    rec["failures"] = [ln for ln in lines if ln.startswith(("FAILED ", "ERROR "))][:40]
    rec["junit"] = str(junit) if junit.is_file() else None
    if rec["cut"]:
        rec["ok"] = False
        rec["error"] = f"pytest cut at the stage's deadline after {counts.get('passed', 0)} passed"
    elif rc not in (0, 5) or counts.get("failed") or counts.get("errors"):
        rec["ok"] = False
        rec["error"] = f"pytest -m cuda exited {rc}: {rec['summary']}"
    elif not ctx.dry_run and not counts.get("passed"):
        rec["ok"] = False
        rec["error"] = f"pytest -m cuda ran no test: {rec['summary']}"
    else:
        rec["ok"] = True


def _run_streaming(
    cmd: list[str], timeout: float, rec: Record | None = None
) -> tuple[int | None, list[str]]:
    """Run `cmd` (its own process group), echoing each line to our stdout (the log) and
    keeping them; past `timeout` kill its group: (None, lines so far). The group is saved
    in `rec` (`child_groups`) so the parent kills it too if this stage itself is killed."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True)  # fmt: skip
    if rec is not None:
        rec.setdefault("child_groups", []).append(proc.pid)
        rec.save()
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            lines.append(line.rstrip("\n"))
        sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        rc = None
    reader.join(timeout=5)
    return rc, lines


def _junit_counts(path: Path) -> dict[str, int] | None:
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tot = {
        k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")
    }
    return {"tests": tot["tests"], "failed": tot["failures"], "errors": tot["errors"],
            "skipped": tot["skipped"],
            "passed": tot["tests"] - tot["failures"] - tot["errors"] - tot["skipped"]}  # fmt: skip


def _verbose_counts(lines: list[str]) -> dict[str, int]:
    out = dict.fromkeys(("passed", "failed", "errors", "skipped"), 0)
    for ln in lines:
        m = re.match(r"\S+::\S+ (PASSED|FAILED|ERROR|SKIPPED)", ln)
        if m:
            out[{"PASSED": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped"}[m.group(1)]] += 1  # fmt: skip
    out["tests"] = sum(out.values())
    return out


def _parity_prompts(dry: bool) -> tuple[list[list[int]], list[list[int]], int]:
    """(dense, sparse, new tokens): dense prompts stay within the preset's index_topk (16 /
    256) with their new tokens, so every position is selected; sparse ones run past it, so
    the indexer selects. Lengths unequal within each set."""
    if dry:
        return _prompts([4, 6], seed=3), _prompts([17, 19], seed=4), 2
    dense = _prompts([96 + 16 * i for i in range(8)], seed=3)  # 96..208, + 32 <= 256
    return dense, _prompts([264 + 7 * i for i in range(8)], seed=4), 32


def _stage_graph_vs_eager(ctx: Ctx, rec: Record) -> None:
    """bf16, triton: decode captured in CUDA graphs vs the same padded steps eager. Same
    kernels on the same padded batch: the greedy tokens must be equal."""
    dry = ctx.dry_run
    dense, sparse, new = _parity_prompts(dry)
    prompts = dense[:1] + sparse[:1] if dry else dense + sparse
    rec.update(requests=len(prompts), prompt_lens=[len(p) for p in prompts], new_tokens=new)
    kw = {} if dry else {"dtype": "bfloat16"}
    tokens = {}
    for name, extra in (("graph", {}), ("eager", {"disable_cuda_graph": True})):
        engine = _engine(ctx, attention_backend="triton", **kw, **extra)
        try:
            graphs = _decode_graphs(engine)
            rec[f"{name}_padded"] = graphs is not None
            if graphs is None:
                rec["graph_blocker"] = _graph_blocker(engine)
            tokens[name] = [list(r.output_ids) for r in _generate(engine, prompts, new)]
            if name == "graph":
                rec["graphs_captured"] = _captured(engine)
                rec["capture_s"] = getattr(graphs, "capture_seconds", None)
        finally:
            _close(engine)
        rec.save()
    diff = [(i, j) for i, (a, b) in enumerate(zip(tokens["graph"], tokens["eager"]))
            for j, (x, y) in enumerate(zip(a, b)) if x != y]  # fmt: skip
    rec["equal"] = tokens["graph"] == tokens["eager"]
    rec["differing_positions"] = len(diff)
    rec["first_difference"] = diff[0] if diff else None
    if dry:
        rec["skip_reason"] = "no CUDA graphs on a CPU: both runs are padded eager steps"
    problems = []
    if not rec["equal"]:
        problems.append(f"greedy tokens differ at {len(diff)} positions (first {diff[0]})")
    if not dry and rec["graphs_captured"] is not None and not rec["graphs_captured"]:
        problems.append(f"no decode graph was captured (blocker: {rec.get('graph_blocker')})")
    rec["ok"] = not problems
    if problems:
        rec["error"] = "; ".join(problems)


def _stage_triton_vs_torch(ctx: Ctx, rec: Record) -> None:
    """fp32, graphs off: the Triton backend against the torch reference, which differ in
    numerics (tf32x3 dots, bf16 indexer queries over the fp8 keys, another MoE sum order).
    A near-tie may flip one argmax, after which the request continues from another token:
    agreement counts the steps with the same history (each request up to its first
    difference). Dense prompts select every position in both runs, so their logprobs must
    agree closely; past index_topk a near-tie in the indexer may select another row (on
    glm-tiny: 0.21 nats on one step, 1e-6 without selection), so there only the agreement
    is bounded and the logprob differences are reported."""
    dense, sparse, new = _parity_prompts(ctx.dry_run)
    rec.update(requests={"dense": len(dense), "sparse": len(sparse)}, new_tokens=new,
               bounds={"min_agreement": MIN_AGREEMENT,
                       "dense_max_logprob_diff": DENSE_MAX_LOGPROB_DIFF})  # fmt: skip
    runs = {}
    for name in ("torch", "triton"):
        engine = _engine(ctx, attention_backend=name, dtype="float32", disable_cuda_graph=True)
        try:
            reqs = _generate(engine, dense + sparse, new, logprobs=20)
            runs[name] = [(list(r.output_ids), list(r.top_logprobs)) for r in reqs]
        finally:
            _close(engine)
        rec.save()
    n = len(dense)
    d = rec["dense"] = _agreement(runs["torch"][:n], runs["triton"][:n])
    sp = rec["sparse"] = _agreement(runs["torch"][n:], runs["triton"][n:])
    problems = []
    for k, r in (("dense", d), ("sparse", sp)):
        if r["steps_compared"] < MIN_STEPS:
            r["agreement_bound"] = f"not applied: {r['steps_compared']} steps < {MIN_STEPS}"
        elif r["agreement"] < MIN_AGREEMENT:
            problems.append(f"{k} agreement {r['agreement']:.3f} < {MIN_AGREEMENT}")
    if d["max_logprob_diff"] > DENSE_MAX_LOGPROB_DIFF:
        problems.append(
            f"dense max logprob diff {d['max_logprob_diff']:.3g} > {DENSE_MAX_LOGPROB_DIFF}"
        )
    rec["ok"] = not problems
    if problems:
        rec["error"] = "; ".join(problems)


def _agreement(ref, got) -> dict[str, Any]:
    compared = matched = same_pos = total = 0
    diffs: list[float] = []
    first_div = []
    for (rt, rl), (gt, gl) in zip(ref, got):
        total += len(rt)
        same_pos += sum(a == b for a, b in zip(rt, gt))
        div = next((i for i, (a, b) in enumerate(zip(rt, gt)) if a != b), None)
        first_div.append(div)
        upto = len(rt) if div is None else div + 1
        compared += upto
        matched += upto if div is None else div
        for i in range(min(upto, len(rl), len(gl))):
            a, b = dict(rl[i]), dict(gl[i])
            diffs += [abs(a[t] - b[t]) for t in a.keys() & b.keys()]
    return {
        "agreement": matched / max(compared, 1),
        "steps_compared": compared,
        "positionwise_agreement": same_pos / max(total, 1),
        "first_difference": first_div,
        "max_logprob_diff": max(diffs, default=0.0),
        "mean_logprob_diff": sum(diffs) / max(len(diffs), 1),
    }


def _stage_decode(ctx: Ctx, rec: Record) -> None:
    """Decode tokens/s per variant and batch. Each batch size first runs a few untimed
    steps of the same batch size (which captures its graph bucket), so no capture falls in
    the timed loop; `captured_while_timing` says whether one did anyway. Each variant in
    its own try: one failure keeps the others' figures."""
    dry = ctx.dry_run
    # dry run: the interpreter takes seconds a step; warm-up = the prefill alone
    batches, new, warm = ((1, 2), 2, 1) if dry else ((1, 32), 64, 4)
    variants = {
        "graph": dict(attention_backend="triton"),
        "eager": dict(attention_backend="triton", disable_cuda_graph=True),
        "torch": dict(attention_backend="torch"),
    }
    rates: dict[str, dict[str, float]] = {}
    rec.update(tokens_per_s=rates, new_tokens=new, batches=list(batches), skipped={},
               captured_while_timing={}, prefill_step_s={})  # fmt: skip
    if dry:
        del variants["graph"]
        rec["skipped"]["graph"] = "no CUDA graphs on a CPU"
    for name, kw in variants.items():
        if ctx.left() < 5:
            rec["skipped"][name] = "stage deadline reached"
            continue
        _try(rec, name, lambda n=name, k=kw: _decode_variant(ctx, rec, n, k, batches, new, warm))
        rec.save()
    eager = rates.get("eager", {})
    rec["graph_over_eager"] = {
        b: r / eager[b] for b, r in rates.get("graph", {}).items() if b in eager
    }
    want = {(v, f"batch_{b}") for v in variants for b in batches}
    have = {(v, b) for v, d in rates.items() for b in d}
    problems = [f"{v}: {e}" for v, e in rec.get("errors", {}).items()]
    problems += [
        f"{v} {b} missing" for v, b in sorted(want - have) if v not in rec.get("errors", {})
    ]
    problems += [
        f"{k}: a graph was captured while timing"
        for k, n in rec["captured_while_timing"].items()
        if n
    ]
    rec["ok"] = not problems
    if problems:
        rec["error"] = "; ".join(problems)


def _decode_variant(ctx, rec, name, kw, batches, new, warm) -> None:
    device = ctx.device
    plen = 4 if ctx.dry_run else 16  # the interpreter's prefill: ~0.3 s a token
    engine = _engine(ctx, **kw)
    try:
        if name == "graph":
            graphs = _decode_graphs(engine)
            if graphs is None:
                raise RuntimeError(f"decode runs unpadded, no graphs: {_graph_blocker(engine)}")
            rec["graph_capture_s"] = getattr(graphs, "capture_seconds", None)
        for b in batches:
            _generate(engine, _prompts([plen] * b, seed=100 + b), warm)  # untimed: bucket b
            held = _captured(engine)
            before = None if held is None else len(held)
            prefill, rate = _decode_rate(engine, device, _prompts([plen] * b, seed=200 + b),
                                         _greedy(new))  # fmt: skip
            # one step prefilling b prompts: the extend path runs per request (a lead)
            rec["prefill_step_s"].setdefault(name, {})[f"batch_{b}"] = prefill
            rec["tokens_per_s"].setdefault(name, {})[f"batch_{b}"] = rate
            after = _captured(engine)
            if before is not None and after is not None:
                rec["captured_while_timing"][f"{name}_batch_{b}"] = len(after) - before
            rec.save()
    finally:
        _close(engine)


def _decode_rate(engine, device, prompts: list[list[int]], params) -> tuple[float, float]:
    """(seconds of the step prefilling `prompts`, then decode tokens/s to their end): the
    first step's prefill and first token are not decode."""
    reqs = [engine.add_request(p, params) for p in prompts]
    _sync(device)
    start = time.perf_counter()
    engine.step()
    _sync(device)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    _sync(device)
    decoded = sum(len(r.output_ids) - 1 for r in reqs)
    return prefill, decoded / (time.perf_counter() - start)


def _stage_kernel_bandwidth(ctx: Ctx, rec: Record) -> None:
    """`triton_bench.bench_kernels`: each kernel's bytes/s and its ratio to the measured
    copy bandwidth (a torch clone, read + write)."""
    from dsakv.kernels.triton_bench import bench_kernels

    kw = {} if ctx.dry_run else {"warmup": 2, "iters": 10}
    rows = bench_kernels(ctx.device, dry_run=ctx.dry_run, **kw)
    rec["kernels"] = rows
    copy = next((r for r in rows if r["kernel"].startswith("copy")), None)
    rec["copy_bytes_per_s"] = copy["bytes_per_s"] if copy else None
    rec["ok"] = all(r["bytes_per_s"] > 0 for r in rows)


def _stage_features(ctx: Ctx, rec: Record) -> None:
    """The engine's features on the device, each against the plain engine on the same
    prompts (greedy; agreement as in `triton_vs_torch`, exact equality recorded beside it):
    HiSparse with a hot buffer of index_topk rows (decode steps miss and copy rows from
    pinned host memory), a device pool too small for the batch over a host tier (prefixes
    retracted and evicted to the host come back), that over HiSparse too, MTP drafting 3
    tokens (verify steps), seeded sampling with every logit processor twice (equal tokens,
    finite logprobs); then
    a JSON schema through xgrammar, and `dsakv serve` (streams and a chat completion). PD:
    a prefill engine's KV copied into a decode engine's pool, which decodes from there."""
    checks: dict[str, dict[str, Any]] = {}
    rec["checks"] = checks
    fns = (("hisparse", _feature_hisparse), ("host_tier", _feature_host_tier),
           ("hisparse_host_tier", _feature_hisparse_host_tier),
           ("mtp", _feature_mtp), ("pd", _feature_pd), ("sampling", _feature_sampling),
           ("grammar", _feature_grammar), ("serve", _feature_serve))  # fmt: skip
    _run_rows(ctx, rec, checks, fns, _parity_prompts(ctx.dry_run), margin=10, what="check")


def _run_rows(
    ctx: Ctx,
    rec: Record,
    rows: dict[str, Any],
    fns: Iterable[tuple[str, Callable[..., None]]],
    args: tuple,
    margin: float,
    what: str,
) -> None:
    """Each of `fns` (a name, and `fn(ctx, row, *args)` filling its row) into `rows[name]`
    in its own try, so one failing leaves the others their figures (its row then ok False
    with the error); none started within `margin` s of the stage's deadline. Then the
    stage's roll-up: `rec` ok when every row is, else its error naming the bad ones."""
    names = []
    for name, fn in fns:
        names.append(name)
        row: dict[str, Any] = {}
        rows[name] = row
        if ctx.left() < margin:
            row.update(ok=False, error=f"stage deadline reached before this {what}")
            rec["deadline_reached"] = True
            continue
        start = time.perf_counter()
        try:
            fn(ctx, row, *args)
        except Exception as e:
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:1500])
            traceback.print_exc()
        row["seconds"] = round(time.perf_counter() - start, 2)
        rec.save()
    bad = [k for k in names if not rows[k].get("ok")]
    rec["ok"] = not bad
    if bad:
        rec["error"] = "; ".join(f"{k}: {rows[k].get('error')}" for k in bad)


def _compare(row: dict[str, Any], want, got, problems: list[str]) -> None:
    """Greedy tokens of two runs: exact equality, and the agreement bound when enough
    steps were compared (a near-tie may flip an argmax where batches differ)."""
    a = _agreement([(list(r.output_ids), []) for r in want],
                   [(list(r.output_ids), []) for r in got])  # fmt: skip
    row["equal"] = all(list(x.output_ids) == list(y.output_ids) for x, y in zip(want, got))
    row.update(agreement=a["agreement"], steps_compared=a["steps_compared"],
               first_difference=a["first_difference"])  # fmt: skip
    if a["steps_compared"] >= MIN_STEPS and a["agreement"] < MIN_AGREEMENT:
        problems.append(f"agreement {a['agreement']:.3f} < {MIN_AGREEMENT}")


def _finish(row: dict[str, Any], problems: list[str]) -> None:
    row["ok"] = not problems
    if problems:
        row["error"] = "; ".join(problems)


def _against_plain(ctx: Ctx, row, prompts, new: int, plain: dict[str, Any],
                   feature: dict[str, Any], counters: tuple[str, ...], needed: tuple[str, str],
                   before: tuple[list[list[int]], ...] = ()) -> dict[str, Any]:  # fmt: skip
    """Greedy tokens of `prompts` on a plain engine and on one with `feature` (which first
    runs the prompt lists `before`), compared into `row` with the feature engine's
    `counters`; `needed` is (a counter that must be nonzero, the problem if it is not)."""
    runs = []
    for kw, warm in ((plain, ()), (feature, before)):
        engine = _engine(ctx, **kw)
        try:
            for wave in warm:
                _generate(engine, wave, new)
            runs.append(_generate(engine, prompts, new))
            c = engine.counters()
        finally:
            _close(engine)
    row["counters"] = c = {k: c.get(k) for k in counters}
    problems: list[str] = []
    _compare(row, *runs, problems)
    if not c[needed[0]]:
        problems.append(needed[1])
    _finish(row, problems)
    return c


def _hisparse(ctx: Ctx, row, ratio: int) -> dict[str, Any]:
    """HiSparse's engine flags with a hot buffer of index_topk rows (contexts pass it), the
    config recorded in `row`."""
    from dsakv.config import ModelConfig

    topk = ModelConfig.from_hf(_model(ctx)).index_topk
    row["hisparse_config"] = hs = {"device_buffer_size": topk, "host_to_device_ratio": ratio}
    return {"enable_hisparse": True, "hisparse_config": hs}


def _feature_hisparse(ctx: Ctx, row, dense, sparse, new) -> None:
    _against_plain(ctx, row, sparse, new, {}, _hisparse(ctx, row, ratio=2),
                   ("hisparse_hits", "hisparse_misses", "hisparse_rows_to_device",
                    "hisparse_bytes_to_device", "peak_running_requests"),
                   ("hisparse_misses", "no decode step missed its hot buffer"))  # fmt: skip


def _feature_hisparse_host_tier(ctx: Ctx, row, dense, sparse, new) -> None:
    """The host tier's check over HiSparse: host-tier pages take their latent from its host
    rows, their index-K from the device (ratio 1: the plain check's logical pages)."""
    _feature_host_tier(ctx, row, dense, sparse, new, _hisparse(ctx, row, ratio=1))


def _feature_host_tier(ctx: Ctx, row, dense, sparse, new, over: dict | None = None) -> None:
    """`over`: more engine flags for the tier's engine (`_feature_hisparse_host_tier`)."""
    import random

    rng = random.Random(5)
    page = 16 if ctx.dry_run else 64
    prefixes = [[rng.randrange(3, 250) for _ in range(2 * page)] for _ in range(3)]
    waves = [[p + [rng.randrange(3, 250) for _ in range(rng.randint(3, 20))] for _ in range(2)]
             for p in prefixes]  # fmt: skip
    kw = {"page_size": page} | ({"max_model_len": 64} if ctx.dry_run else {})
    # 8 device pages hold one wave: the second and third evict the first's prefix pages to
    # the host tier, and the first wave's prompts, run again, find them there
    tier = {"num_pages": 8, "kv_budget_gib": None, "host_pool_gib": 0.05, **kw, **(over or {})}
    _against_plain(ctx, row, waves[0], max(new, 8), {"enable_prefix_cache": False, **kw}, tier,
                   ("prefix_hit_tokens", "prefix_pages_demoted", "prefix_pages_promoted",
                    "host_bytes_to_host", "host_bytes_to_device"),
                   ("host_bytes_to_device", "nothing came back from the host tier"),
                   before=tuple(waves))  # fmt: skip


def _feature_mtp(ctx: Ctx, row, dense, sparse, new) -> None:
    start = time.perf_counter()
    model, made = ensure_model(ctx.models, DRY_PRESET if ctx.dry_run else GPU_PRESET, "fit")
    row["model"] = {"path": str(model), "generated_here": made,
                    "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip
    m = {"model": str(model)}
    # (the dry run's 2 new tokens leave no step to draft in)
    c = _against_plain(ctx, row, dense, max(new, 8), m,
                       {**m, "speculative_algorithm": "mtp", "speculative_num_steps": 3},
                       ("spec_draft_tokens", "spec_accepted_tokens", "spec_verify_steps"),
                       ("spec_verify_steps", "no verify step ran"))  # fmt: skip
    row["acceptance"] = c["spec_accepted_tokens"] / max(c["spec_draft_tokens"] or 0, 1)


def _feature_pd(ctx: Ctx, row, dense, sparse, new) -> None:
    """Prefill/decode disaggregation's engine side on the device: a prefill engine runs each
    prompt to its first token and holds its pages, a decode engine reserves pages, the KV is
    copied pool to pool (`copy_tokens`, where the servers move it with the transfer engine)
    and the decode engine decodes from the first token. Tokens equal one engine's."""
    from dsakv.engine import disagg
    from dsakv.memory import copy_tokens

    prompts = dense + sparse
    one = _engine(ctx)
    try:
        want = _generate(one, prompts, new)
    finally:
        _close(one)
    prefill, decode = _engine(ctx), _engine(ctx)
    try:
        got, moved = [], 0
        for p in prompts:
            first = prefill.add_request(p, _greedy(1))
            disagg.hold(prefill, first)  # its pages stay until the KV is written
            while prefill.has_unfinished():
                prefill.step()
            req = disagg.reserve(decode, p, _greedy(new))
            if req is None:
                raise RuntimeError("the decode engine had no room for one prompt")
            n = len(p)
            src = prefill.scheduler.slots(first, n).to(prefill.pool.device)
            dst = decode.scheduler.slots(req, n).to(decode.pool.device)
            moved += copy_tokens(decode.pool, dst, prefill.pool, src)
            disagg.release_held(prefill, first)
            disagg.start_decoding(decode, req, first.output_ids[0])
            got.append(req)
        while decode.has_unfinished():
            decode.step()
        decode.check_integrity()
        prefill.check_integrity()
        row["bytes_moved"] = moved
        row["bytes_per_token"] = decode.pool.layout.bytes_per_token
    finally:
        _close(prefill)
        _close(decode)
    problems: list[str] = []
    _compare(row, want, got, problems)
    _finish(row, problems)


def _feature_sampling(ctx: Ctx, row, dense, sparse, new) -> None:
    import math

    from dsakv.engine import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0.8, top_p=0.9, top_k=40, min_p=0.02,
                            repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3,
                            logit_bias={5: 3.0}, seed=7, logprobs=5, ignore_eos=True)  # fmt: skip
    engine = _engine(ctx, enable_prefix_cache=False)  # (a hit prefills fewer rows: numerics)
    try:
        runs = [_generate(engine, dense[:4], new, params=params) for _ in range(2)]
    finally:
        _close(engine)
    tokens = [[list(r.output_ids) for r in run] for run in runs]
    row["equal"] = tokens[0] == tokens[1]
    finite = all(math.isfinite(lp) for r in runs[0] for step in r.top_logprobs
                 for _, lp in step)  # fmt: skip
    row["logprobs_finite"] = finite
    problems = [] if row["equal"] else ["one seed gave different tokens on a second run"]
    if not finite:
        problems.append("a logprob is not finite")
    _finish(row, problems)


def _feature_grammar(ctx: Ctx, row, dense, sparse, new) -> None:
    """A JSON schema through xgrammar, its bitmask applied to the logits on the device:
    the random model's greedy output is JSON only because of the mask, so it must parse,
    hold the schema and stop when the object closes."""
    from dsakv.engine import SamplingParams

    schema = {"type": "object", "additionalProperties": False, "required": ["name", "ok"],
              "properties": {"name": {"enum": ["alpha", "beta"]}, "ok": {"type": "boolean"}}}  # fmt: skip
    params = SamplingParams(max_tokens=64, temperature=0.0,
                            grammar=("json_schema", json.dumps(schema)))  # fmt: skip
    engine = _engine(ctx)
    try:
        reqs = _generate(engine, dense[:4], new, params=params)
    finally:
        _close(engine)
    row["texts"] = [r.output_text for r in reqs]
    problems = []
    for r in reqs:
        try:
            obj = json.loads(r.output_text)
            valid = set(obj) == {"name", "ok"} and obj["name"] in ("alpha", "beta")
            valid = valid and isinstance(obj["ok"], bool)
        except ValueError:
            valid = False
        if not valid or r.finish_reason != "stop":
            problems.append(f"{r.output_text!r} ({r.finish_reason}) does not hold the schema")
    _finish(row, problems)


def _feature_serve(ctx: Ctx, row, dense, sparse, new) -> None:
    """`dsakv serve` on the device (the engine on its own thread, the HTTP server on the
    event loop): 16 streamed completions at once, greedy, every token's logprob arriving,
    then a chat completion under a JSON schema."""
    import httpx

    from dsakv.bench.serving_rate import SERVED_NAME, ServeProcess

    flags = ["--device", str(ctx.device), "--max-model-len", "64" if ctx.dry_run else "512"]
    server = ServeProcess(_model(ctx), flags, os.cpu_count() or 1, ctx.out / "serve.log")
    try:
        server.wait_ready(max(ctx.left() - 30, 5))
        row["figures"] = server.measure(dense + sparse, new)
        schema = {"type": "object", "required": ["ok"], "additionalProperties": False,
                  "properties": {"ok": {"type": "boolean"}}}  # fmt: skip
        # (thinking off: the schema holds the answer, which a template's open <think> defers)
        body = {"model": SERVED_NAME, "max_tokens": 32, "temperature": 0.0,
                "messages": [{"role": "user", "content": "Say ok."}],
                "chat_template_kwargs": {"enable_thinking": False},
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "ok", "schema": schema}}}  # fmt: skip
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        row["chat_status"] = r.status_code
        text = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text
        row["chat_text"] = text
    finally:
        server.stop()
    problems = []
    try:
        if not isinstance(json.loads(text).get("ok"), bool):
            problems.append(f"chat output {text!r} does not hold the schema")
    except (ValueError, AttributeError):
        problems.append(f"chat answered {row['chat_status']}: {text[:300]!r}")
    _finish(row, problems)


LORA_RANK, LORA_NAME = 8, "check"


def _stage_lora(ctx: Ctx, rec: Record) -> None:
    """--enable-lora on the device, against the engine without it (the same model, bf16 on
    CUDA; prefix caches off, so no run reuses another's KV), with a PEFT adapter written
    here (`_write_adapter`): `base_equal`, base-only requests bit-equal to the engine
    without LoRA, their decode steps replaying graphs captured with the slots inert;
    `adapter_runs`, the adapter changes the tokens and gives the same ones alone and
    batched beside base requests, base-only decode steps make no host sync (adapter steps
    run eager and may: counted); `decode_tps`, decode tokens/s without LoRA, under it
    base-only and with every row on the adapter. Each record in its own try (`_run_rows`)."""
    kw = {"enable_prefix_cache": False} | ({} if ctx.dry_run else {"dtype": "bfloat16"})
    fns = (("base_equal", _lora_base_equal), ("adapter_runs", _lora_adapter_runs),
           ("decode_tps", _lora_decode_tps))  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="dsakv-lora-") as tmp:
        rec["adapter"] = _write_adapter(_model(ctx), Path(tmp) / "adapter")
        rec.save()
        plain, lora = _engine(ctx, **kw), None
        try:
            lora = _engine(ctx, enable_lora=True, max_lora_rank=LORA_RANK, **kw)
            lora.load_lora(LORA_NAME, rec["adapter"]["path"])
            _run_rows(ctx, rec, rec, fns, (plain, lora), margin=5, what="record")
        finally:
            _close(plain)
            if lora is not None:
                _close(lora)


def _write_adapter(model: str, path: Path, seed: int = 0) -> dict[str, Any]:
    """A PEFT adapter for `model` in its save_pretrained form (adapter_config.json and the
    safetensors under PEFT's key names), so the device needs neither transformers nor peft:
    rank LORA_RANK, A and B random and small (seeded), on every layer's attention
    projections, its dense or shared MLP, and a few routed experts' per-expert keys (vLLM's
    format: the other experts zero); shapes read from the checkpoint's own weights."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from dsakv.models.lora import ATTENTION, CONFIG_FILE, PROJECTIONS, WEIGHTS_FILE

    config = json.loads((Path(model) / "config.json").read_text())
    layers = config["num_hidden_layers"]  # (not the MTP layer: the draft runs base weights)
    experts = list(range(0, config.get("n_routed_experts") or 0, 2))[:3]
    names = re.compile(
        rf"^(model\.layers\.(\d+)\.(?:self_attn\.(?:{'|'.join(ATTENTION)})|mlp\.(?:shared_experts\."
        rf"|experts\.(\d+)\.)?(?:{'|'.join(PROJECTIONS)})))\.weight$"
    )
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(model).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in sorted(f.keys()):
                m = names.match(key)
                if m is None or int(m[2]) >= layers or m[3] and int(m[3]) not in experts:
                    continue
                out, inp = f.get_slice(key).get_shape()
                a = torch.randn(LORA_RANK, inp, generator=g) / inp**0.5
                b = 0.1 * torch.randn(out, LORA_RANK, generator=g)
                tensors |= {f"base_model.model.{m[1]}.lora_A.weight": a,
                            f"base_model.model.{m[1]}.lora_B.weight": b}  # fmt: skip
    path.mkdir(parents=True)
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    targets = sorted({k.split(".")[-3] for k in tensors})
    (path / CONFIG_FILE).write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK, "lora_alpha": 2 * LORA_RANK,
        "target_modules": targets, "bias": "none", "base_model_name_or_path": model}))  # fmt: skip
    return {"path": str(path), "rank": LORA_RANK, "modules": len(tensors) // 2,
            "routed_experts": experts, "targets": targets}  # fmt: skip


@contextlib.contextmanager
def _host_syncs(obj, attr: str, cuda: bool):
    """While the block runs, `obj.attr` counts its calls, and on CUDA the host syncs they
    make (sync-debug mode 'warn' inside each call: the step runs on, where `_syncs_raise`
    would end it): yields {"calls", "syncs"} (syncs None off CUDA)."""
    import torch

    found: dict[str, int | None] = {"calls": 0, "syncs": 0 if cuda else None}
    if obj is None:
        yield found
        return
    inner, own = getattr(obj, attr), attr in vars(obj)

    def counted(*args, **kwargs):
        found["calls"] += 1
        if not cuda:
            return inner(*args, **kwargs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return inner(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                found["syncs"] += sum("synchroniz" in str(w.message) for w in caught)

    setattr(obj, attr, counted)
    try:
        yield found
    finally:
        if own:
            setattr(obj, attr, inner)
        else:
            delattr(obj, attr)


def _lora_params(new: int, adapter: bool, logprobs: int | None = None):
    params = _greedy(new, logprobs)
    return replace(params, lora_name=LORA_NAME) if adapter else params


def _lora_new(ctx: Ctx) -> int:
    return max(_parity_prompts(ctx.dry_run)[2], 4)  # (the dry run's 2 leave one decode step)


def _lora_base_equal(ctx: Ctx, row, plain, lora) -> None:
    """The parity prompts, base only, on both engines: tokens and top-5 logprobs equal bit
    for bit; on CUDA the --enable-lora engine's decode steps replay its graphs."""
    dense, sparse, _ = _parity_prompts(ctx.dry_run)
    prompts, new, cuda = dense + sparse, _lora_new(ctx), ctx.device.type == "cuda"
    row.update(requests=len(prompts), new_tokens=new)
    want = _generate(plain, prompts, new, logprobs=5)
    with _host_syncs(_decode_graphs(lora), "run", cuda) as padded:
        got = _generate(lora, prompts, new, logprobs=5)
    a = _agreement([(list(r.output_ids), r.top_logprobs) for r in want],
                   [(list(r.output_ids), r.top_logprobs) for r in got])  # fmt: skip
    row["equal"] = all(list(x.output_ids) == list(y.output_ids) for x, y in zip(want, got))
    row["bit_equal"] = row["equal"] and all(
        x.top_logprobs == y.top_logprobs for x, y in zip(want, got)
    )
    row.update(max_logprob_diff=a["max_logprob_diff"], first_difference=a["first_difference"],
               graph_blocker=_graph_blocker(lora), padded_steps=padded["calls"],
               padded_step_syncs=padded["syncs"])  # fmt: skip
    held = _captured(lora)
    row["graphs_captured"] = None if held is None else len(held)
    problems = [] if row["bit_equal"] else [
        f"not the engine without --enable-lora: tokens equal {row['equal']}, max logprob "
        f"diff {a['max_logprob_diff']:.3g}"]  # fmt: skip
    if not cuda:
        row["skip_reason"] = "no CUDA graphs on a CPU: the graph checks need a CUDA device"
    elif row["graph_blocker"] is not None:
        problems.append(f"decode runs unpadded: {row['graph_blocker']}")
    elif not row["graphs_captured"] or not padded["calls"]:
        problems.append(f"{row['graphs_captured']} graphs captured, {padded['calls']} padded steps")
    _finish(row, problems)


def _lora_adapter_runs(ctx: Ctx, row, plain, lora) -> None:
    """The dense parity prompts on the adapter (alone: an adapter-only batch), then the
    sparse ones base-only (the slot still resident), then both interleaved in one batch:
    the adapter's tokens differ from the base model's, are the same batched as alone, the
    base ones the plain engine's; host syncs counted in the base-only decode steps (none
    allowed) and in the adapter steps (recorded)."""
    dense, sparse, _ = _parity_prompts(ctx.dry_run)
    new, cuda = _lora_new(ctx), ctx.device.type == "cuda"
    topk = lora.model_config.index_topk
    row.update(adapter_requests=len(dense), base_requests=len(sparse), new_tokens=new,
               index_topk=topk,
               note=f"the model's own index_topk {topk}: the adapter's prompts and their new "
                    "tokens stay within it (every position selected), the base ones run past "
                    "it, where a near-tie in the indexer may select another row in an eager "
                    "step than in a graph, so agreement (steps with the same history) is "
                    f"bounded at {MIN_AGREEMENT} over >= {MIN_STEPS} steps, not equality")  # fmt: skip
    on, off = _lora_params(new, True), _lora_params(new, False)
    base = _generate(plain, dense, new)
    with _host_syncs(lora.model, "forward", cuda) as eager:
        alone = _generate(lora, dense, new, params=on)
    with _host_syncs(_decode_graphs(lora), "run", cuda) as padded:
        after = _generate(lora, sparse, new, params=off)
    want = _generate(plain, sparse, new)
    mixed = _generate(lora, [p for ab in zip(dense, sparse) for p in ab], new,
                      params=[on, off] * len(dense))  # fmt: skip
    differ = sum(list(a.output_ids) != list(b.output_ids) for a, b in zip(alone, base))
    row.update(differ_from_base=differ / len(dense), adapter_step_syncs=eager,
               base_step_syncs=padded,
               base_after_adapter_equal=all(list(x.output_ids) == list(y.output_ids)
                                            for x, y in zip(want, after)))  # fmt: skip
    problems: list[str] = []
    if not differ:
        problems.append("the adapter changed no request's tokens")
    if not row["base_after_adapter_equal"]:
        problems.append("base-only requests after the adapter's are not the plain engine's")
    if cuda and (padded["syncs"] or not padded["calls"]):
        problems.append(f"{padded['calls']} padded base-only decode steps, {padded['syncs']} "
                        "host syncs in them")  # fmt: skip
    for key, ref, got in (("batched", alone, mixed[0::2]), ("base_beside", want, mixed[1::2])):
        row[key] = {}
        _compare(row[key], ref, got, problems)
    _finish(row, problems)


def _lora_decode_tps(ctx: Ctx, row, plain, lora) -> None:
    """Decode tokens/s of one batch without LoRA, under --enable-lora base-only and with
    every row on the adapter (eager steps), each after untimed steps at that batch size."""
    batch, new, warm, plen = (2, 4, 2, 4) if ctx.dry_run else (16, 32, 4, 16)
    row.update(batch=batch, new_tokens=new, prompt_len=plen)
    rates, prompts = {}, _prompts([plen] * batch, seed=300)
    row["tokens_per_s"] = rates
    for name, engine, adapter in (("no_lora", plain, False), ("lora_base", lora, False),
                                  ("lora_adapter", lora, True)):  # fmt: skip
        _generate(engine, _prompts([plen] * batch, seed=301), warm,
                  params=_lora_params(warm, adapter))  # fmt: skip
        rates[name] = _decode_rate(engine, ctx.device, prompts, _lora_params(new, adapter))[1]
    row["over_no_lora"] = {k: rates[k] / rates["no_lora"] for k in ("lora_base", "lora_adapter")}
    _finish(row, [f"{k}: no rate" for k, r in rates.items() if not r > 0])


LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def _stage_prefill_profile(ctx: Ctx, rec: Record) -> None:
    """One step prefilling 16 requests (96-313 tokens, the parity prompts) under
    torch.profiler, after the same step once unprofiled: its wall time, how many ops and
    kernel launches it ran, and the 20 ops with the most self host time (count, host and
    device ms). A measurement, not a check: on the first H200 run a bench prefill step cost
    ~120-145 ms per request at 78 layers, whatever the batch (the extend path runs attention
    and the indexer per request)."""
    from torch.profiler import ProfilerActivity, profile

    dense, sparse, _ = _parity_prompts(ctx.dry_run)
    prompts = dense + sparse
    cuda = ctx.device.type == "cuda"
    kw = {"dtype": "bfloat16"} if cuda else {}
    engine = _engine(ctx, enable_prefix_cache=False, chunked_prefill_size=8192, **kw)
    try:
        _generate(engine, prompts, 1)  # compiles and allocates; then the same step again
        reqs = [engine.add_request(p, _greedy(1)) for p in prompts]  # (stepped below)
        _sync(ctx.device)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            start = time.perf_counter()
            engine.step()
            _sync(ctx.device)
            wall = time.perf_counter() - start
        while engine.has_unfinished():
            engine.step()
    finally:
        _close(engine)
    events = prof.key_averages()
    rec.update(requests=len(reqs), tokens=sum(map(len, prompts)), wall_s=wall,
               all_prefilled=all(len(r.output_ids) == 1 for r in reqs),
               ops=sum(e.count for e in events if e.key.startswith("aten::")),
               launches=sum(e.count for e in events if e.key in LAUNCH_EVENTS))  # fmt: skip
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:20]
    rec["top"] = [{"op": e.key, "count": e.count, "self_host_ms": e.self_cpu_time_total / 1e3,
                   "self_device_ms": getattr(e, "self_device_time_total", 0) / 1e3}
                  for e in top]  # fmt: skip
    rec["ok"] = rec["all_prefilled"] and rec["ops"] > 0


def _stage_bench(ctx: Ctx, rec: Record) -> None:
    """`dsakv bench --quick --device cuda`, cut a little before the stage's deadline."""
    path = ctx.out / "bench.json"
    cmd = [sys.executable, "-m", "dsakv.cli", "bench", "--quick", "--device",
           "cpu" if ctx.dry_run else "cuda", "--json", str(path)]  # fmt: skip
    rc, lines = _run_streaming(cmd, timeout=max(ctx.left() - 5, 1), rec=rec)
    if rc != 0:
        raise RuntimeError(f"dsakv bench {'was cut' if rc is None else f'exited {rc}'}: "
                           + "\n".join(lines[-20:]))  # fmt: skip
    data = json.loads(path.read_text())
    rec.update(json=str(path), targets=data.get("targets"), wall_s=data["meta"]["wall_s"])


_STAGE_FNS: dict[str, Callable[[Ctx, Record], None]] = {
    "env": _stage_env,
    "kernel_launch": _stage_kernel_launch,
    "moe_capture": _stage_moe_capture,
    "kernel_tests": _stage_kernel_tests,
    "graph_vs_eager": _stage_graph_vs_eager,
    "triton_vs_torch": _stage_triton_vs_torch,
    "decode": _stage_decode,
    "kernel_bandwidth": _stage_kernel_bandwidth,
    "features": _stage_features,
    "lora": _stage_lora,
    "prefill_profile": _stage_prefill_profile,
    "bench": _stage_bench,
}


# --- reporting ----------------------------------------------------------------------------


def stage_line(i: int, n: int, name: str, rec: dict[str, Any]) -> str:
    """The one line printed after a stage: status, seconds, its headline figures."""
    status = rec.get("status", "?")
    head = f"[{i}/{n}] {name}: {status}" + (f" ({rec['seconds']} s)" if "seconds" in rec else "")
    try:
        detail = _detail(name, rec)
    except Exception as e:  # a malformed partial record must not stop the run
        detail = f"(no summary: {type(e).__name__})"
    if rec.get("error") or rec.get("reason"):
        detail = (detail + "; " if detail else "") + str(
            rec.get("error") or rec["reason"]
        ).splitlines()[0]
    return f"{head}: {detail}" if detail else head


def _detail(name: str, c: dict[str, Any]) -> str:
    if name == "env":
        bits = [f"torch {c.get('torch')}", f"triton {c.get('triton')}"]
        if c.get("gpu"):
            bits += [c["gpu"], f"sm {c.get('capability')}", f"driver {c.get('driver')}"]
        if c.get("model"):
            bits.append("model " + ("generated" if c["model"]["generated_here"] else "prepared"))
        return ", ".join(bits)
    if name == "kernel_launch" and "kernels" in c:
        ks = c["kernels"]
        bad = [k for k, r in ks.items() if not r.get("ok")]
        return f"{len(ks) - len(bad)}/{len(ks)} launched" + (
            f", failed: {', '.join(bad)}" if bad else ""
        )
    if name == "moe_capture" and "batches" in c:
        dry = "capture" in c  # the dry run records why the capture was skipped
        return ", ".join(
            f"{b} {'ok' if _moe_ok(r, dry) else 'FAILED'}" for b, r in c["batches"].items()
        )
    if name == "kernel_tests" and "summary" in c:
        return f"{c['summary']} (passed {c.get('passed')}, failed {c.get('failed')})"
    if name == "graph_vs_eager" and "equal" in c:
        held = c.get("graphs_captured")
        graphs = "unknown" if held is None else len(held)
        return f"tokens equal {c['equal']}, {graphs} decode graphs captured"
    if name == "triton_vs_torch" and "sparse" in c:
        return ", ".join(f"{k}: agreement {c[k]['agreement']:.3f} over {c[k]['steps_compared']} "
                         f"steps, max logprob diff {c[k]['max_logprob_diff']:.1e}"
                         for k in ("dense", "sparse"))  # fmt: skip
    if name == "decode" and c.get("tokens_per_s"):
        rates = ", ".join(
            f"{v} {b}: {r:.1f}" for v, d in c["tokens_per_s"].items() for b, r in d.items()
        )
        speed = ", ".join(f"{b} {x:.2f}x" for b, x in (c.get("graph_over_eager") or {}).items())
        return f"tok/s {rates}" + (f"; graph/eager {speed}" if speed else "")
    if name == "prefill_profile" and "wall_s" in c:
        return (f"{c['requests']} requests, {c['tokens']} tokens in {c['wall_s'] * 1e3:.1f} ms: "
                f"{c['ops']} aten ops, {c['launches']} kernel launches")  # fmt: skip
    if name == "features" and c.get("checks"):
        return ", ".join(_feature_line(k, r) for k, r in c["checks"].items())
    if name == "lora" and "adapter" in c:
        return _lora_line(c)
    if name == "kernel_bandwidth" and c.get("copy_bytes_per_s"):
        return f"copy {c['copy_bytes_per_s'] / 1e9:.0f} GB/s, {len(c['kernels']) - 1} kernel cases"
    return ""


def _lora_line(c: dict[str, Any]) -> str:
    bits = []
    if "bit_equal" in (b := c.get("base_equal", {})):
        bits.append(f"base bit-equal {b['bit_equal']} ({b['graphs_captured']} graphs, "
                    f"{b['padded_steps']} padded steps)")  # fmt: skip
    if "batched" in (a := c.get("adapter_runs", {})):
        bits.append(f"adapter differs {a['differ_from_base']:.2f}, batched agreement "
                    f"{a['batched']['agreement']:.3f}, syncs base {a['base_step_syncs']['syncs']}"
                    f" / adapter {a['adapter_step_syncs']['syncs']}")  # fmt: skip
    if "over_no_lora" in (d := c.get("decode_tps", {})):
        r = d["tokens_per_s"]
        bits.append(f"tok/s at {d['batch']}: no LoRA {r['no_lora']:.1f}, base "
                    f"{d['over_no_lora']['lora_base']:.3g}x, adapter "
                    f"{d['over_no_lora']['lora_adapter']:.3g}x")  # fmt: skip
    return "; ".join(bits)


def _feature_line(name: str, r: dict[str, Any]) -> str:
    if "agreement" in r:
        what = f"agreement {r['agreement']:.3f}, equal {r['equal']}"
    elif "texts" in r:
        what = f"{len(r['texts'])} outputs"
    elif r.get("figures"):
        f = r["figures"]
        what = f"{f.get('requests')} streams, decode {f.get('decode_tokens_per_s') or 0:.0f} tok/s"
    else:
        what = f"equal {r.get('equal')}"
    if "acceptance" in r:
        what += f", acceptance {r['acceptance']:.2f}"
    return f"{name} {'ok' if r.get('ok') else 'FAILED'} ({what})"


def summary(result: dict[str, Any]) -> str:
    """The closing text: every stage's line, then each kernel's bandwidth."""
    env = result["stages"].get("env", {})
    where = "dry run, CPU" if result["dry_run"] else env.get("gpu", "GPU")
    lines = [
        f"dsakv device check ({where}; torch {env.get('torch')}, triton {env.get('triton')}): "
        f"{'OK' if result['ok'] else 'FAILED'} in {result.get('wall_s')} s"
    ]
    n = len(result["stages"])
    for i, (name, rec) in enumerate(result["stages"].items(), 1):
        lines.append(stage_line(i, n, name, rec))
    for r in result["stages"].get("kernel_bandwidth", {}).get("kernels", []):
        shape = ",".join(f"{k}={v}" for k, v in r["shape"].items())
        flops = f", {r['tflops']:.1f} TFLOP/s" if r.get("tflops") else ""
        lines.append(f"    {r['kernel']} [{shape}]: {r['bytes_per_s'] / 1e9:.1f} GB/s "
                     f"({100 * r['copy_ratio']:.0f}% of copy{flops})")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
