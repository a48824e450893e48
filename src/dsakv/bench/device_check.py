"""`dsakv device-check`: the one prepared GPU run (scripts/device_check.sh calls it).

What a lent GPU is for, in one pass that fits a few minutes: the CUDA-marked kernel tests,
greedy tokens of the Triton backend against the torch reference (dense config: equal) and
of CUDA-graph decode against eager decode, decode tokens/s with and without graphs, each
kernel's bytes/s against the device's copy bandwidth, and `dsakv bench --quick`. One
summary on stdout, every figure in `OUT/device_check.json`.

`--dry-run` runs the same code on the CPU (Triton interpreter, tiny shapes, no bench) so
the script cannot rot while no GPU is lent; `make test` runs it.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

KERNEL_TESTS = "tests/test_kernels_cuda.py"


def run_device_check(out_dir: str, dry_run: bool = False, bench: bool = True) -> dict[str, Any]:
    """Every check in turn; a failing check is recorded (and fails the run), not fatal."""
    device = torch.device("cpu" if dry_run else "cuda")
    if not dry_run and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device (use --dry-run on a CPU)")
    if dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"env": _env(device), "dry_run": dry_run, "checks": {}}
    checks: list[tuple[str, Any]] = [
        ("cuda_tests", lambda: _cuda_tests(dry_run)),
        ("kernels", lambda: _kernels(device, dry_run)),
        ("backend_parity", lambda: _parity(device, dry_run)),
        ("decode", lambda: _decode(device, dry_run)),
    ]
    if bench and not dry_run:
        checks.append(("bench", lambda: _bench(out)))
    for name, fn in checks:
        start = time.perf_counter()
        try:
            result["checks"][name] = {"ok": True, **fn()}
        except Exception as e:  # recorded: one broken check must not hide the others
            result["checks"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        result["checks"][name]["seconds"] = round(time.perf_counter() - start, 2)
    result["ok"] = all(c["ok"] for c in result["checks"].values())
    (out / "device_check.json").write_text(json.dumps(result, indent=2))
    return result


def _env(device: torch.device) -> dict[str, Any]:
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device)}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    return env


def _cuda_tests(dry_run: bool) -> dict[str, Any]:
    """`pytest -m cuda`: every kernel against the torch reference on real shapes."""
    root = Path(__file__).resolve().parents[3]
    if not (root / KERNEL_TESTS).is_file():
        raise FileNotFoundError(f"{KERNEL_TESTS} not found under {root} (run from a checkout)")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "cuda",
        KERNEL_TESTS,
        "-q",
        "-p",
        "no:cacheprovider",
    ]
    if dry_run:
        cmd.append("--collect-only")
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    tail = proc.stdout.strip().splitlines()[-1:] or [proc.stderr.strip()[-300:]]
    counts = {
        k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|selected)", tail[0])
    }
    if proc.returncode not in (0, 5) or counts.get("failed") or counts.get("error"):
        raise RuntimeError(f"pytest -m cuda: {tail[0]}\n{proc.stdout[-3000:]}")
    if not dry_run and not counts.get("passed"):
        raise RuntimeError(f"pytest -m cuda ran no test: {tail[0]}")
    return {"summary": tail[0], **counts}


def _kernels(device: torch.device, dry_run: bool) -> dict[str, Any]:
    """Each kernel's achieved bytes/s, and its ratio to the measured copy bandwidth."""
    from dsakv.kernels.triton_bench import bench_kernels

    return {"kernels": bench_kernels(device, dry_run=dry_run)}


def _engine(model: str, device: torch.device, **kw: Any):
    from dsakv.engine import EngineConfig
    from dsakv.engine.engine import Engine

    return Engine(EngineConfig(model=model, device=str(device), max_model_len=512, **kw))


def _greedy(engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from dsakv.engine import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [list(r.output_ids) for r in reqs]


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (n, length), generator=g).tolist()


def _model(dry_run: bool) -> str:
    from dsakv.models.tiny import resolve_model_dir

    return resolve_model_dir("glm-tiny" if dry_run else "glm-bench")


def _parity(device: torch.device, dry_run: bool) -> dict[str, Any]:
    """Greedy tokens: triton vs torch, and CUDA-graph vs eager decode (prompts shorter than
    index_topk: every position is selected, so the backends must agree exactly)."""
    model = _model(dry_run)
    n, length, new = (2, 6, 3) if dry_run else (8, 32, 32)
    prompts = _prompts(n, length)
    runs = {
        "torch": dict(attention_backend="torch"),
        "triton": dict(attention_backend="triton"),
        "triton_eager": dict(attention_backend="triton", disable_cuda_graph=True),
    }
    tokens = {
        name: _greedy(_engine(model, device, **kw), prompts, new) for name, kw in runs.items()
    }
    out = {
        "model": Path(model).name,
        "requests": n,
        "new_tokens": new,
        "triton_equals_torch": tokens["triton_eager"] == tokens["torch"],
        "graph_equals_eager": tokens["triton"] == tokens["triton_eager"],
    }
    if not (out["triton_equals_torch"] and out["graph_equals_eager"]):
        raise AssertionError(f"greedy tokens differ: {out}")
    return out


def _decode(device: torch.device, dry_run: bool) -> dict[str, Any]:
    """Decode tokens/s at batch 1 and 32 (dry run: 1 and 2): graphs vs eager, and torch."""
    model = _model(dry_run)
    batches, new = ((1, 2), 2) if dry_run else ((1, 32), 64)
    variants = {
        "graph": dict(attention_backend="triton"),
        "eager": dict(attention_backend="triton", disable_cuda_graph=True),
        "torch": dict(attention_backend="torch"),
    }
    if dry_run:  # no graphs on a CPU: "graph" would be the eager run again
        del variants["graph"]
    from dsakv.engine import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    rates: dict[str, dict[str, float]] = {}
    for name, kw in variants.items():
        engine = _engine(model, device, **kw)
        _greedy(engine, _prompts(max(batches), 16, seed=1), 2)  # warm-up, graph capture
        for b in batches:
            prompts = _prompts(b, 16, seed=2 + b)
            reqs = [engine.add_request(p, params) for p in prompts]
            engine.step()  # the prefill (and first token) is not decode
            _sync(device)
            start = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            _sync(device)
            decoded = sum(len(r.output_ids) - 1 for r in reqs)
            rates.setdefault(name, {})[f"batch_{b}"] = decoded / (time.perf_counter() - start)
    graph = rates.get("graph", {})
    speedup = {b: r / rates["eager"][b] for b, r in graph.items()}
    return {"tokens_per_s": rates, "graph_over_eager": speedup}


def _bench(out: Path) -> dict[str, Any]:
    path = out / "bench.json"
    cmd = [
        sys.executable,
        "-m",
        "dsakv.cli",
        "bench",
        "--quick",
        "--device",
        "cuda",
        "--json",
        str(path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    if proc.returncode != 0:
        raise RuntimeError(f"dsakv bench exited {proc.returncode}: {proc.stderr[-2000:]}")
    data = json.loads(path.read_text())
    return {"json": str(path), "targets": data.get("targets"), "wall_s": data["meta"]["wall_s"]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summary(result: dict[str, Any]) -> str:
    env = result["env"]
    lines = [
        f"dsakv device check ({'dry run, CPU' if result['dry_run'] else env.get('gpu')}; "
        f"torch {env['torch']}, triton {env['triton']}): {'OK' if result['ok'] else 'FAILED'}"
    ]
    for name, c in result["checks"].items():
        head = f"- {name}: {'ok' if c['ok'] else 'FAILED'} ({c['seconds']} s)"
        if not c["ok"]:
            lines.append(f"{head}: {c['error'].splitlines()[0]}")
            continue
        if name == "cuda_tests":
            head += f": {c['summary']}"
        elif name == "backend_parity":
            head += f": triton == torch {c['triton_equals_torch']}, graph == eager {c['graph_equals_eager']}"
        elif name == "decode":
            rates = ", ".join(
                f"{v} {b}: {r:.1f}" for v, d in c["tokens_per_s"].items() for b, r in d.items()
            )
            speed = ", ".join(f"{b} {x:.2f}x" for b, x in c["graph_over_eager"].items())
            head += f": tok/s {rates}; graph/eager {speed}"
        lines.append(head)
        if name == "kernels":
            for r in c["kernels"]:
                shape = ",".join(f"{k}={v}" for k, v in r["shape"].items())
                lines.append(
                    f"    {r['kernel']} [{shape}]: {r['bytes_per_s'] / 1e9:.1f} GB/s "
                    f"({100 * r['copy_ratio']:.0f}% of copy)"
                )
    return "\n".join(lines)
