"""`dsakv device-check --compile-only`: every Triton kernel specialisation compiles for sm_90.

The interpreter the other kernel tests run on hides compile errors (DESIGN.md §12); this
compiles for the real target with the installed Triton and with Triton 3.6.0 (the H200
image's, in `.triton-3.6/`, put there by `make install`). Everything runs in subprocesses
without TRITON_INTERPRET (other test modules set it in this process). Cold, each version
compiles ~110 specialisations in ~1.5-2 min on 2 idle cores; Triton's cache (and the module's
ptxas cache beside it) makes a rerun take seconds.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "src" / "dsakv" / "kernels"
TRITON_36 = ROOT / ".triton-3.6"
OLD_STORE = ROOT / "tests" / "data" / "triton_store_4f57181.py"  # git show 4f57181:...
LATENT_KINDS = ("fp32", "bf16", "fp8_e4m3", "fp8_ds_mla")
TIMEOUT = 1200  # a cold compile of everything on a busy 2-core machine


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(extra)
    return env


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dsakv.cli", "device-check", "--compile-only", *args],
        capture_output=True, text=True, env=_env(**env), timeout=TIMEOUT, cwd=ROOT,
    )  # fmt: skip


def _script(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, env=_env(), timeout=TIMEOUT, cwd=ROOT,
    )  # fmt: skip


def _is_jit(dec: ast.expr) -> bool:
    target = dec.func if isinstance(dec, ast.Call) else dec
    return isinstance(target, ast.Attribute) and target.attr == "jit"


def kernel_functions() -> set[str]:
    """`mla._mla_partial_kernel` for each @triton.jit function of the kernel modules that no
    jit function calls: the ones a wrapper launches (helpers inline into them)."""
    jit: dict[tuple[str, str], ast.FunctionDef] = {}
    for path in sorted(KERNELS.glob("triton_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(map(_is_jit, node.decorator_list)):
                jit[path.stem.removeprefix("triton_"), node.name] = node
    called = {
        n.func.id
        for fn in jit.values()
        for n in ast.walk(fn)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    }
    return {f"{mod}.{name}" for mod, name in jit if name not in called}


@pytest.fixture(scope="module", params=["installed", "3.6"])
def listing(request) -> tuple[str, subprocess.CompletedProcess]:
    if request.param == "installed":
        # TRITON_INTERPRET=1 as the test suite has it: the check must clear it itself
        return request.param, _cli(TRITON_INTERPRET="1")
    if not (TRITON_36 / "triton" / "__init__.py").is_file():
        pytest.skip(f"{TRITON_36} missing: `make install` puts triton 3.6.0 there")
    return request.param, _cli("--triton-path", str(TRITON_36), TRITON_INTERPRET="1")


def test_scan_finds_the_kernels():
    found = kernel_functions()
    assert {"mla._mla_combine_kernel", "store._ds_mla_kernel", "rows._copy_rows_kernel"} <= found
    assert {"indexer._paged_logits_kernel", "fp8._decode_e4m3_kernel"} <= found
    assert not {"fp8.e4m3_to_f32", "store._load_rows", "indexer._score_keys"} & found  # helpers


def test_compile_only_compiles_every_kernel(listing):
    which, res = listing
    out = res.stdout
    assert res.returncode == 0, out[-4000:] + res.stderr[-4000:]
    head, *lines = out.strip().splitlines()
    if which == "3.6":
        assert head.startswith("triton 3.6.0 ") and str(TRITON_36) in head
    assert "ptxas" in head and "cuda:90" in head
    assert lines[-1].startswith("total: ") and lines[-1].endswith("OK")
    rows = [ln.split() for ln in lines[1:-1]]
    assert rows and all(r[0] == "ok" for r in rows), out[-4000:]
    kernels = {r[1] for r in rows}
    missing = kernel_functions() - kernels
    assert not missing, f"kernels no sample call launches: {sorted(missing)}"
    mla = [ln for ln in lines if " sparse_mla_" in ln]
    for kind in LATENT_KINDS:
        for q in ("bf16", "fp32"):
            for mode in ("decode[slots]", "extend[topk]", "extend[dense]"):
                assert any(f"_{mode} " in ln and f"kind={kind} q={q} " in ln for ln in mla), (
                    kind, q, mode,
                )  # fmt: skip
    for dt in ("bf16", "fp32"):
        assert any(f"store_rows[latent {dt}]" in ln for ln in lines)
        assert any(re.search(rf"store_latent_ds_mla .* rows={dt}", ln) for ln in lines)
        assert any("index_logits_paged " in ln and f"q={dt} " in ln for ln in lines)


def test_bad_triton_is_one_error_line(tmp_path):
    res = _cli("--triton-path", str(tmp_path))  # no triton there
    assert res.returncode == 2 and res.stderr.startswith("error: --triton-path")
    fake = tmp_path / "triton"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('not a real triton')\n")
    res = _cli("--triton-path", str(tmp_path))
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.strip().splitlines() == [
        "error: --compile-only needs triton with its compiler API (not a real triton)"
    ]


def test_catches_two_returns_under_a_constexpr_if():
    """The store module before 53668be (kept in tests/data, cut to its latent store):
    `_load_rows` returned under `if X_BF16:` and again after it. The interpreter ran it;
    the compiler rejects the bf16-rows specialisation."""
    assert "        return bf16_to_f32(" in OLD_STORE.read_text()
    res = _script(f"""
        import importlib.util, sys, time, torch
        from dsakv.kernels import triton_aot as aot
        spec = importlib.util.spec_from_file_location("dsakv.kernels._old_store", {str(OLD_STORE)!r})
        old = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = old
        spec.loader.exec_module(old)
        rows = {{dt: torch.zeros(16, 576, dtype=dt) for dt in (torch.bfloat16, torch.float32)}}
        cases = [aot.Case(f"old store_latent_ds_mla {{dt}}", lambda r=r: old.store_latent_ds_mla(
            r, torch.zeros(16, 656, dtype=torch.uint8), torch.arange(16), 512, 64))
            for dt, r in rows.items()]
        reports = aot.compile_all(cases=cases)
        print(aot.format_reports(reports))
        sys.exit(aot.exit_status(reports))
    """)
    assert res.returncode == 1, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    bf16 = [ln for ln in lines if "torch.bfloat16" in ln]
    fp32 = [ln for ln in lines if "torch.float32" in ln]
    assert bf16[0].startswith("FAIL _old_store._ds_mla_kernel"), res.stdout
    assert fp32[0].startswith("ok   _old_store._ds_mla_kernel"), res.stdout
    assert "error:" in lines[lines.index(bf16[0]) + 1]
    assert lines[-1].endswith("FAILED")


BIG_DOT = '''
import torch
import triton
import triton.language as tl


@triton.jit
def _big_dot_kernel(a, b, c, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    m = tl.arange(0, BM)
    n = tl.arange(0, BN)
    k = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        x = tl.load(a + m[:, None] * K + (k0 + k)[None, :])
        y = tl.load(b + (k0 + k)[:, None] * BN + n[None, :])
        acc = tl.dot(x, y, acc)
    tl.store(c + m[:, None] * BN + n[None, :], acc)


def big_dot():
    """8 pipeline stages of 64x128 and 128x64 fp16 tiles: 8 x 32 KB of shared memory."""
    a = torch.zeros(64, 2048, dtype=torch.float16)
    b = torch.zeros(2048, 64, dtype=torch.float16)
    _big_dot_kernel[(1,)](a, b, torch.zeros(64, 64), 2048, BM=64, BN=64, BK=128, num_stages=8)
'''


def test_over_the_shared_memory_limit_fails(tmp_path):
    (tmp_path / "aot_big_dot.py").write_text(BIG_DOT)
    res = _script(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import aot_big_dot
        from dsakv.kernels import triton_aot as aot
        (launch,), errors = aot.record([aot.Case("big dot", aot_big_dot.big_dot)])
        report = aot.compile_launch(launch)
        print(aot.format_reports([report]))
        assert not errors and report.error is None and report.wgmma, report
        assert report.smem > aot.SMEM_LIMIT and not report.ok, report
        sys.exit(aot.exit_status([report]))
    """)
    assert res.returncode == 1, res.stdout + res.stderr
    row = res.stdout.splitlines()[1]
    assert row.startswith("FAIL aot_big_dot._big_dot_kernel") and "over 232448 B" in row


TUNED = """
import torch
import triton
import triton.language as tl


@triton.autotune(configs=[triton.Config({"BLOCK": 64}, num_warps=2),
                          triton.Config({"BLOCK": 128}, num_warps=4)], key=["n"])
@triton.jit
def _tuned_kernel(x, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x + offs, 1.0, mask=offs < n)


def tuned(n):
    _tuned_kernel[(1,)](torch.zeros(n), n)
"""


def test_records_each_autotune_config_and_int_specialisation(tmp_path):
    """Recording only (no compile): an autotuned kernel yields one launch per config; ints
    specialise as the launcher does (== 1 a constexpr, divisible by 16 marked D)."""
    (tmp_path / "aot_tuned.py").write_text(TUNED)
    res = _script(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import aot_tuned
        from dsakv.kernels import triton_aot as aot
        cases = [aot.Case(f"n={{n}}", lambda n=n: aot_tuned.tuned(n)) for n in (1, 32, 33, 48)]
        launches, errors = aot.record(cases)
        assert not errors, errors
        for la in launches:
            print(la.case, la.num_warps, dict(la.constexprs), dict(la.ints))
    """)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.splitlines() == [
        "n=1 2 {'n': '1', 'BLOCK': '64'} {}",
        "n=1 4 {'n': '1', 'BLOCK': '128'} {}",
        "n=32 2 {'BLOCK': '64'} {'n': 'i32:D'}",
        "n=32 4 {'BLOCK': '128'} {'n': 'i32:D'}",
        "n=33 2 {'BLOCK': '64'} {'n': 'i32:-'}",
        "n=33 4 {'BLOCK': '128'} {'n': 'i32:-'}",
    ]  # n=48 is n=32's specialisation: deduplicated


def test_a_compiler_crash_fails_only_its_specialisation():
    res = _script("""
        import os, sys, torch
        from dsakv.kernels import triton_aot as aot, triton_fp8
        cases = [aot.Case("decode", lambda: triton_fp8.decode_e4m3(torch.zeros(64, dtype=torch.uint8))),
                 aot.Case("encode", lambda: triton_fp8.encode_e4m3(torch.zeros(64)))]
        launches, _ = aot.record(cases)
        real = aot.compile_launch
        def crashing(launch, target=None):  # a compiler segfault, as the worker sees it
            if launch.case == "decode":
                os._exit(139)
            return real(launch, target)
        aot.compile_launch = crashing
        reports = aot.compile_launches(launches)
        print(aot.format_reports(reports))
        sys.exit(aot.exit_status(reports))
    """)
    assert res.returncode == 1, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[1].startswith("FAIL fp8._decode_e4m3_kernel")
    assert lines[2] == "     error: the compiler process died"
    assert lines[3].startswith("ok   fp8._encode_e4m3_kernel")
