"""`dsakv device-check`: the GPU run's script on the CPU (`--dry-run`), its stage
watchdog, and the helpers that turn raw outputs into figures.

The dry run is the only way the script is exercised while no GPU is lent: every stage runs
its CPU-capable code (Triton interpreter, tiny shapes), CUDA-only parts are skipped with a
recorded reason. ~2.5 min on 2 cores, most of it the interpreter's engine steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dsakv.bench import device_check as dc

ROOT = Path(__file__).resolve().parents[1]


def test_device_check_dry_run(tmp_path):
    """`scripts/device_check.sh --dry-run`, end to end: output under $OUT (no --out),
    every stage ok in order, one line per stage, the figures each stage promises."""
    out = tmp_path / "check"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out)}
    proc = subprocess.run(
        [str(ROOT / "scripts/device_check.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / dc.JSON_NAME).read_text())
    names = [s.name for s in dc.STAGES]
    assert result["ok"] and result["dry_run"] and result["complete"]
    assert list(result["stages"]) == names
    assert {r["status"] for r in result["stages"].values()} == {"ok"}
    lines = proc.stdout.splitlines()
    for i, name in enumerate(names, 1):  # the per-stage line, printed as each finished
        assert any(ln.startswith(f"[{i}/{len(names)}] {name}: ok") for ln in lines), name
    assert "dsakv device check (dry run" in proc.stdout
    st = result["stages"]
    assert st["env"]["torch"] and st["env"]["cuda_available"] is False
    assert len(st["kernel_launch"]["kernels"]) >= 12 and not st["kernel_launch"]["failed"]
    assert all(r["eager_deterministic"] for r in st["moe_capture"]["batches"].values())
    assert "skipped" in st["moe_capture"]["capture"]
    assert "collection only" in st["kernel_tests"]["skip_reason"]
    assert st["graph_vs_eager"]["equal"]
    dense = st["triton_vs_torch"]["dense"]
    assert dense["max_logprob_diff"] <= dc.DENSE_MAX_LOGPROB_DIFF
    rates = st["decode"]["tokens_per_s"]
    assert set(rates) == {"eager", "torch"} and "graph" in st["decode"]["skipped"]
    assert all(r > 0 for d in rates.values() for r in d.values())
    assert all(r["bytes_per_s"] > 0 for r in st["kernel_bandwidth"]["kernels"])
    checks = st["features"]["checks"]
    assert all(c["ok"] for c in checks.values()), checks
    assert all(c["equal"] for k, c in checks.items() if k not in ("grammar", "serve"))
    assert len(checks["grammar"]["texts"]) == 2
    assert checks["serve"]["figures"]["requests"] == 4 and checks["serve"]["chat_status"] == 200
    profiled = st["prefill_profile"]
    assert profiled["all_prefilled"] and profiled["requests"] == 4 and profiled["ops"] > 0
    assert checks["hisparse"]["counters"]["hisparse_misses"] > 0
    assert checks["host_tier"]["counters"]["host_bytes_to_device"] > 0
    assert checks["hisparse_host_tier"]["counters"]["host_bytes_to_device"] > 0
    assert checks["mtp"]["counters"]["spec_verify_steps"] > 0
    lora = st["lora"]  # its adapter read by the engine, every record ok
    assert lora["adapter"]["modules"] > 0 and lora["adapter"]["routed_experts"]
    base = lora["base_equal"]
    assert base["bit_equal"] and base["max_logprob_diff"] == 0.0 and "CUDA" in base["skip_reason"]
    runs = lora["adapter_runs"]
    assert runs["differ_from_base"] > 0 and runs["base_after_adapter_equal"]
    assert runs["adapter_step_syncs"]["calls"] > 0
    # (the stage bounds agreement over >= MIN_STEPS steps only: the dry run compares fewer)
    batched = runs["batched"]
    assert batched["steps_compared"] > 0 and batched["agreement"] >= dc.MIN_AGREEMENT
    lora_rates = lora["decode_tps"]["tokens_per_s"]
    assert set(lora_rates) == {"no_lora", "lora_base", "lora_adapter"}
    assert all(r > 0 for r in lora_rates.values())
    dense, sparse, _ = dc._parity_prompts(True)  # every prompt token's KV, all its layers
    assert checks["pd"]["bytes_moved"] == checks["pd"]["bytes_per_token"] * sum(
        map(len, dense + sparse)
    )
    assert (out / dc.LOG_NAME).stat().st_size > 0
    assert not list(out.glob(".stage-*"))  # stage scratch files cleaned up


def test_device_check_deadline_and_rewrites(tmp_path, capsys, monkeypatch):
    """A stage past its deadline is killed (stack dumped to the log) and recorded as timed
    out; the next stage still runs; the JSON on disk is rewritten after every stage. The
    stage is made to hang (`STALL_ENV`), so the parent's kill is what ends it."""
    monkeypatch.setenv(dc.STALL_ENV, "kernel_launch")
    on_disk = []

    def on_stage(name, result):
        saved = json.loads((tmp_path / dc.JSON_NAME).read_text())
        assert saved == json.loads(json.dumps(result, default=str))
        on_disk.append((name, {k: v["status"] for k, v in saved["stages"].items()}))

    stages = ["env", "kernel_launch", "kernel_tests"]
    result = dc.run_device_check(
        str(tmp_path),
        dry_run=True,
        stages=stages,
        deadlines={"kernel_launch": 3.0},
        on_stage=on_stage,
    )
    assert [n for n, _ in on_disk] == stages
    assert on_disk[0][1] == {
        "env": "ok",
        "kernel_launch": "pending",
        "kernel_tests": "pending",
    }
    assert on_disk[1][1]["kernel_launch"] == "timed_out"
    assert on_disk[1][1]["kernel_tests"] == "pending"
    assert on_disk[2][1]["kernel_tests"] == "ok"
    cut = result["stages"]["kernel_launch"]
    assert not cut["ok"] and cut["error"].startswith("past its deadline of 3 s (killed")
    assert 3.0 <= cut["seconds"] < 600  # the kill ended it: the stalled stage sleeps an hour
    assert not result["ok"] and result["complete"]
    out = capsys.readouterr().out
    assert "[2/3] kernel_launch: timed_out" in out and "[3/3] kernel_tests: ok" in out
    log = (tmp_path / dc.LOG_NAME).read_text()
    assert "most recent call first" in log.split("stage kernel_launch")[1]


def test_agreement_counts_steps_with_the_same_history():
    """After a flipped argmax the two requests diverge; later steps are not compared."""
    ref = [([1, 2, 3, 4], [[(1, -1.0)], [(2, -1.0)], [(3, -1.0)], [(4, -1.0)]]),
           ([5, 6], [[(5, -0.5)], [(6, -0.5)]])]  # fmt: skip
    got = [([1, 2, 9, 9], [[(1, -1.0)], [(2, -1.25)], [(3, -1.0), (9, -0.9)], [(9, -1.0)]]),
           ([5, 6], [[(5, -0.5)], [(6, -0.5)]])]  # fmt: skip
    a = dc._agreement(ref, got)
    assert a["steps_compared"] == 3 + 2  # the first request up to and with its flip
    assert a["agreement"] == 4 / 5 and a["positionwise_agreement"] == 4 / 6
    assert a["first_difference"] == [2, None]
    assert a["max_logprob_diff"] == 0.25


def test_pytest_counts_from_junit_and_verbose_lines(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite tests="5" failures="1" errors="0" skipped="1"/></testsuites>'
    )
    assert dc._junit_counts(xml) == {
        "tests": 5,
        "failed": 1,
        "errors": 0,
        "skipped": 1,
        "passed": 3,
    }
    lines = ["tests/t.py::test_a[x] PASSED  [ 50%]", "tests/t.py::test_b FAILED [100%]", "noise"]
    assert dc._verbose_counts(lines) == {
        "passed": 1,
        "failed": 1,
        "errors": 0,
        "skipped": 0,
        "tests": 2,
    }


def test_only_wheels_this_interpreter_imports_are_unpacked(tmp_path):
    """`make wheelhouse` fetches the GPU image's CPython 3.12 wheels: on another interpreter
    their compiled parts shadowed the working ones and broke the dry run. A wheel none of
    whose tags this interpreter supports is left out and named."""
    import zipfile

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name, module in (("purepkg-1.0-py3-none-any.whl", "purepkg"),
                         ("native-1.0-cp27-cp27mu-manylinux1_x86_64.whl", "native")):  # fmt: skip
        with zipfile.ZipFile(wheels / name, "w") as z:
            z.writestr(f"{module}/__init__.py", "")
    site = tmp_path / "site"
    site.mkdir()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/unpack_wheels.py"), str(site),
         *map(str, sorted(wheels.iterdir()))],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in site.iterdir()) == ["purepkg"]
    assert "native-1.0-cp27-cp27mu-manylinux1_x86_64.whl is not for this interpreter" in proc.stderr
