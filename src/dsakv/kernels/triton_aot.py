"""Ahead-of-time compile of every Triton kernel specialisation dsakv launches, for sm_90.

Why: the Triton interpreter (what the CPU tests run) hides compile errors — two `return`s
under a constexpr `if`, a type that differs between branches, a block needing more than
Hopper's 227 KB of shared memory (DESIGN.md §12). This compiles each specialisation with
the installed Triton for `GPUTarget("cuda", 90, 32)` (no GPU needed) and runs the ptxas
of the Triton wheel (`ptxas -v --gpu-name sm_90a`) on the PTX for registers, spills and
shared memory.

How the specialisations are found (no signature is written down here): the real wrappers
(`sparse_mla_decode`, `store_latent_ds_mla`, `index_logits_paged`, ...) are called with
small CPU tensors of the real model shapes while `JITFunction.run` (what `kernel[grid](...)`
calls; autotuned kernels: once per config) records the launch instead of running it. Each
recorded launch goes through Triton's own launcher binder (`create_function_from_signature`
+ `JITFunction._pack_args`, the same code in Triton 3.6 and 3.9), so the signature,
constexprs, attributes and options are what a launch with those arguments compiles:
pointer type by dtype, an int is i32 or i64 by magnitude, an int equal to 1 becomes the
constexpr 1, ints and data pointers divisible by 16 get `tt.divisibility` (CPU tensors are
64-byte aligned, like the blocks of the CUDA caching allocator). Runtime sizes (lengths,
counts) take the sample calls' values: each sample is a shape the engine or the tests
launch, so a size that is or is not a multiple of 16 appears as it does there; other
values of such a size only change alignment hints. Identical specialisations compile once.

Use `dsakv device-check --compile-only [--triton-path DIR]`: it runs this module in a
subprocess with `TRITON_INTERPRET` unset (the tests set it) and DIR first on `sys.path`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsakv.errors import DsakvError

SMEM_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KB)
ARCH = 90


# --- results --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One wrapper call with sample tensors; `run` launches (records) its kernels."""

    label: str
    run: Callable[[], object] = field(compare=False, repr=False)


@dataclass(frozen=True)
class Launch:
    """One kernel specialisation, as Triton's launcher would compile it."""

    kernel: str
    module: str
    case: str  # the first sample call that launched it
    key: str  # identity: function, signature, constexprs, attributes, options
    constexprs: tuple[tuple[str, Any], ...]
    ints: tuple[tuple[str, str], ...]  # int args: (name, "i32:D") — D: divisible by 16
    num_warps: int
    num_stages: int
    fn: Any = field(compare=False, repr=False)
    signature: dict = field(compare=False, repr=False)
    constexpr_paths: dict = field(compare=False, repr=False)
    attrs: dict = field(compare=False, repr=False)
    options: dict = field(compare=False, repr=False)


@dataclass(frozen=True)
class KernelReport:
    """What compiling one specialisation gave (error: why it did not compile)."""

    kernel: str
    case: str
    spec: str
    module: str = ""
    num_warps: int = 0
    num_stages: int = 0
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    shared: int | None = None  # Triton's metadata.shared (dynamic shared memory)
    ptxas_smem: int | None = None  # static shared memory ptxas reports
    wgmma: bool | None = None
    error: str | None = None
    seconds: float = 0.0

    @property
    def smem(self) -> int:
        return (self.shared or 0) + (self.ptxas_smem or 0)

    @property
    def ok(self) -> bool:
        return self.error is None and self.smem <= SMEM_LIMIT


# --- the installed Triton -------------------------------------------------------------------


@dataclass(frozen=True)
class _Api:
    """The Triton pieces used here, found once (a clear error when one is missing)."""

    triton: Any
    JITFunction: Any
    Autotuner: Any
    ASTSource: Any
    GPUTarget: Any
    make_backend: Any
    binder_for: Any  # triton.runtime.jit.create_function_from_signature
    knobs: Any


@functools.cache
def _api() -> _Api:
    interp = os.environ.get("TRITON_INTERPRET", "")
    if interp not in ("", "0"):
        raise DsakvError("TRITON_INTERPRET is set: compile in a process without it")
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, make_backend
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction, create_function_from_signature
    except ImportError as e:
        raise DsakvError(f"--compile-only needs triton with its compiler API ({e})") from None
    if not hasattr(JITFunction, "_pack_args"):
        raise DsakvError(f"triton {triton.__version__} lacks JITFunction._pack_args (want 3.4+)")
    from triton import knobs

    # Triton 3.9 warns that its fp-fusion default will change; the default is what runs.
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
    api = _Api(
        triton, JITFunction, Autotuner, ASTSource, GPUTarget, make_backend,
        create_function_from_signature, knobs,
    )  # fmt: skip
    ptxas_for(api, ARCH)
    return api


def ptxas_for(api: _Api, arch: int) -> Path:
    """The wheel's ptxas Triton itself runs for `arch`: 3.6 `bin/ptxas` (CUDA 12.8); 3.9
    `bin/ptxas-blackwell` (CUDA 13) from sm_90 on, as its PTX 9.x is too new for its
    `bin/ptxas` 12.9. Raises DsakvError when it is missing."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = Path(get_ptxas(arch).path)
    except (ImportError, AttributeError, RuntimeError):
        ptxas = Path(api.triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not os.access(ptxas, os.X_OK):
        raise DsakvError(f"no ptxas in the triton wheel ({ptxas})")
    return ptxas


def gpu_name(arch: int) -> str:
    """ptxas's --gpu-name for Triton's PTX: sm_90a on Hopper (wgmma needs the `a`)."""
    return f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"


def default_target() -> Any:
    return _api().GPUTarget("cuda", ARCH, 32)


# --- recording launches ---------------------------------------------------------------------


def _short(value: Any) -> str:
    return getattr(value, "__name__", None) or str(value)


def _specialise(api: _Api, backend: Any, binders: dict, fn: Any, args: tuple, kwargs: dict,
                case: str) -> Launch:  # fmt: skip
    """The launcher's own specialisation of `fn[grid](*args, **kwargs)` (`JITFunction.run`)."""
    kwargs = dict(kwargs)
    if getattr(fn, "debug", None) or api.knobs.runtime.debug:
        kwargs["debug"] = True
    binder = binders.get(id(fn))
    if binder is None:
        binder = binders[id(fn)] = api.binder_for(fn.signature, fn.params, backend)
    bound, spec, opts = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
    names = [p.name for p in fn.params]
    named = tuple(
        (names[path[0]] if len(path) == 1 else str(path), _short(v))
        for path, v in sorted(constexprs.items())
    )
    ints = tuple(
        (names[i], f"{s[0]}:{s[1] or '-'}")
        for i, s in enumerate(spec)
        if s[0] in ("i32", "i64", "u64") and not fn.params[i].is_constexpr
    )
    opt = dict(options.__dict__)
    key = repr((fn.module, fn.__name__, sorted(signature.items()), sorted(constexprs.items()),
                sorted(attrs.items()), sorted(opt.items())))  # fmt: skip
    return Launch(
        kernel=fn.__name__, module=fn.module, case=case,
        key=hashlib.sha256(key.encode()).hexdigest()[:16], constexprs=named, ints=ints,
        num_warps=opt.get("num_warps", 0), num_stages=opt.get("num_stages", 0), fn=fn,
        signature=signature, constexpr_paths=constexprs, attrs=attrs, options=opt,
    )  # fmt: skip


@contextlib.contextmanager
def _recording(api: _Api, target: Any, sink: list[Launch], label: list[str]) -> Iterator[None]:
    """Launches record into `sink` (labelled `label[0]`) instead of running."""
    backend, binders = api.make_backend(target), {}
    jit_run, tune_run = api.JITFunction.run, api.Autotuner.run

    def run(self, *args, grid, warmup, **kwargs):
        sink.append(_specialise(api, backend, binders, self, args, kwargs, label[0]))

    def tuned(self, *args, **kwargs):  # every config is a specialisation it may launch
        for config in self.configs:
            self.fn.run(*args, **kwargs, **config.all_kwargs())

    api.JITFunction.run, api.Autotuner.run = run, tuned
    try:
        yield
    finally:
        api.JITFunction.run, api.Autotuner.run = jit_run, tune_run


def record(cases: Sequence[Case], target: Any = None) -> tuple[list[Launch], list[KernelReport]]:
    """(unique specialisations in first-launch order, a failed report per case that raised)."""
    api = _api()
    target = target or default_target()
    launches: list[Launch] = []
    errors: list[KernelReport] = []
    label = [""]
    with _recording(api, target, launches, label):
        for case in cases:
            label[0] = case.label
            try:
                case.run()
            except Exception as e:  # a wrapper that cannot even be called: report it
                errors.append(KernelReport(kernel="(wrapper)", case=case.label, spec="",
                                           error=f"{type(e).__name__}: {e}"))  # fmt: skip
    seen: dict[str, Launch] = {}
    for launch in launches:
        seen.setdefault(launch.key, launch)
    return list(seen.values()), errors


# --- compiling ------------------------------------------------------------------------------


def _error_text(e: BaseException) -> str:
    """The innermost cause of a (nested) CompilationError, on one line."""
    msg = f"{type(e).__name__}: {e}"
    while e is not None:
        inner = getattr(e, "error_message", None)
        if inner:
            msg = str(inner)
        elif not type(e).__name__.endswith("CompilationError"):
            msg = f"{type(e).__name__}: {e}"
        e = e.__cause__
    lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
    return " / ".join(lines[-3:])[:400] if lines else "compile failed"


_PTXAS_VERSION: dict[str, str] = {}


def ptxas_version(ptxas: Path) -> str:
    if str(ptxas) not in _PTXAS_VERSION:
        out = subprocess.run([str(ptxas), "--version"], capture_output=True, text=True).stdout
        m = re.search(r"release ([\d.]+)", out)
        _PTXAS_VERSION[str(ptxas)] = m.group(1) if m else "?"
    return _PTXAS_VERSION[str(ptxas)]


def _ptxas_cache(api: _Api) -> Path:
    return Path(api.knobs.cache.dir) / "dsakv-ptxas-v"


def ptxas_usage(ptx: str, arch: int = ARCH) -> dict[str, int]:
    """registers / spill_stores / spill_loads / smem of the PTX's entry, from `ptxas -v`.

    Cached by the PTX's hash (Triton's own cache skips the compile on a rerun; this skips
    the second ptxas). Raises RuntimeError with ptxas's message when it rejects the PTX."""
    api = _api()
    ptxas, gpu = ptxas_for(api, arch), gpu_name(arch)
    key = hashlib.sha256(f"{ptxas}:{ptxas_version(ptxas)}:{gpu}\n{ptx}".encode())
    cached = _ptxas_cache(api) / f"{key.hexdigest()}.json"
    with contextlib.suppress(OSError, ValueError):
        return json.loads(cached.read_text())
    with tempfile.TemporaryDirectory(prefix="dsakv-aot-") as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run(
            [str(ptxas), "-v", f"--gpu-name={gpu}", str(src), "-o", f"{tmp}/k.cubin"],
            capture_output=True, text=True,
        )  # fmt: skip
    log = res.stdout + res.stderr
    if res.returncode != 0:
        raise RuntimeError("ptxas: " + " / ".join(log.strip().splitlines()[-3:]))
    log = log.split("Compiling entry function", 1)[-1]

    def num(pattern: str) -> int:
        return sum(int(x) for x in re.findall(pattern, log))

    usage = {
        "registers": max((int(x) for x in re.findall(r"Used (\d+) registers", log)), default=0),
        "spill_stores": num(r"(\d+) bytes spill stores"),
        "spill_loads": num(r"(\d+) bytes spill loads"),
        "smem": num(r"(\d+) bytes smem"),
    }
    with contextlib.suppress(OSError):
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp_file = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp_file.write_text(json.dumps(usage))
        tmp_file.replace(cached)
    return usage


def _spec_text(launch: Launch) -> str:
    consts = " ".join(f"{k}={v}" for k, v in launch.constexprs)
    ints = " ".join(f"{k}:{v}" for k, v in launch.ints)
    return f"{consts} | {ints}" if ints else consts


def compile_launch(launch: Launch, target: Any = None) -> KernelReport:
    """Compile one specialisation for `target` (default sm_90) and read its resource use."""
    api = _api()
    target = target or default_target()
    base = dict(kernel=launch.kernel, case=launch.case, spec=_spec_text(launch),
                module=launch.module, num_warps=launch.num_warps,
                num_stages=launch.num_stages)  # fmt: skip
    t0 = time.perf_counter()
    try:
        src = api.ASTSource(launch.fn, launch.signature, launch.constexpr_paths, launch.attrs)
        kernel = api.triton.compile(src, target=target, options=launch.options)
        ptx = kernel.asm["ptx"]
        usage = ptxas_usage(ptx, target.arch)
    except Exception as e:
        return KernelReport(**base, error=_error_text(e), seconds=time.perf_counter() - t0)
    return KernelReport(
        **base, registers=usage["registers"], spill_stores=usage["spill_stores"],
        spill_loads=usage["spill_loads"], shared=int(kernel.metadata.shared),
        ptxas_smem=usage["smem"], wgmma="wgmma.mma_async" in ptx,
        seconds=time.perf_counter() - t0,
    )  # fmt: skip


_FORKED: tuple[list[Launch], Any] | None = None  # what forked workers compile


def _compile_nth(i: int) -> KernelReport:
    launches, target = _FORKED
    return compile_launch(launches[i], target)


def compile_launches(launches: Sequence[Launch], target: Any = None,
                     jobs: int | None = None) -> list[KernelReport]:  # fmt: skip
    """Compile each specialisation in forked worker processes, `jobs` at a time (default:
    up to 2 CPUs). A compiler that crashes its process fails that specialisation only."""
    global _FORKED
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool
    from multiprocessing import get_context

    target = target or default_target()
    jobs = max(1, min(jobs or min(2, os.cpu_count() or 1), len(launches)))
    # Likely costliest first (most warps, most constexprs) so no worker finishes alone.
    order = sorted(range(len(launches)),
                   key=lambda i: (-launches[i].num_warps, -len(launches[i].constexprs)))  # fmt: skip
    done: dict[int, KernelReport] = {}
    _FORKED = (list(launches), target)
    try:
        with ProcessPoolExecutor(jobs, mp_context=get_context("fork")) as pool:
            futures = {i: pool.submit(_compile_nth, i) for i in order}
            for i, future in futures.items():
                with contextlib.suppress(BrokenProcessPool):
                    done[i] = future.result()
        for i in order:  # after a crash: the rest one by one, each in its own process
            if i not in done:
                with ProcessPoolExecutor(1, mp_context=get_context("fork")) as pool:
                    try:
                        done[i] = pool.submit(_compile_nth, i).result()
                    except BrokenProcessPool:
                        la = launches[i]
                        done[i] = KernelReport(
                            kernel=la.kernel, case=la.case, spec=_spec_text(la),
                            module=la.module, num_warps=la.num_warps,
                            num_stages=la.num_stages, error="the compiler process died",
                        )  # fmt: skip
    finally:
        _FORKED = None
    return [done[i] for i in range(len(launches))]


def compile_all(target: Any = None, cases: Sequence[Case] | None = None,
                jobs: int | None = None) -> list[KernelReport]:  # fmt: skip
    """Record every specialisation the `cases` (default: `default_cases()`) launch and
    compile each for `target` (default sm_90); wrapper calls that raised come first."""
    launches, errors = record(default_cases() if cases is None else cases, target)
    return errors + compile_launches(launches, target, jobs)


def exit_status(reports: Sequence[KernelReport]) -> int:
    """0 when everything compiled within the shared-memory limit, else 1."""
    return 0 if reports and all(r.ok for r in reports) else 1


def kernel_name(r: KernelReport) -> str:
    """`mla._mla_partial_kernel`: the kernel module (less `triton_`) and the function."""
    mod = r.module.rsplit(".", 1)[-1].removeprefix("triton_")
    return f"{mod}.{r.kernel}" if mod else r.kernel


def format_reports(reports: Sequence[KernelReport], seconds: float | None = None) -> str:
    """One line per specialisation, then a total line."""
    head = (f"{'':4} {'kernel':30} {'regs':>4} {'spill st/ld':>11} {'smem B':>7} "
            f"{'(triton+ptxas)':>14} {'wgmma':5} {'w/s':>4} {'sec':>5}  case | constexprs | ints")  # fmt: skip
    lines = [head]
    for r in reports:
        status, name = "ok" if r.ok else "FAIL", kernel_name(r)
        if r.error is not None:
            lines.append(f"{status:4} {name:30} {r.case} | {r.spec}\n     error: {r.error}")
            continue
        over = f"  over {SMEM_LIMIT} B" if r.smem > SMEM_LIMIT else ""
        lines.append(
            f"{status:4} {name:30} {r.registers:4} {r.spill_stores:>5}/{r.spill_loads:<5} "
            f"{r.smem:7} {f'({r.shared}+{r.ptxas_smem})':>14} {'yes' if r.wgmma else 'no':5} "
            f"{r.num_warps:>2}/{r.num_stages:<1} {r.seconds:5.1f}  {r.case} | {r.spec}{over}"
        )
    done = [r for r in reports if r.error is None]
    failed = [r for r in reports if r.error is not None]
    over = [r for r in done if r.smem > SMEM_LIMIT]
    spills = [r for r in done if (r.spill_stores or 0) + (r.spill_loads or 0)]
    top = max(done, key=lambda r: r.registers or 0, default=None)
    total = (
        f"total: {len(reports)} specialisations, {len(done)} compiled, {len(failed)} failed, "
        f"{len(over)} over {SMEM_LIMIT} B smem, {len(spills)} spill, "
        f"{sum(bool(r.wgmma) for r in done)} use wgmma"
    )
    if top is not None:
        top_smem = max(done, key=lambda r: r.smem)
        total += (f"; max {top.registers} regs ({kernel_name(top)}), max smem {top_smem.smem} B "
                  f"({kernel_name(top_smem)})")  # fmt: skip
    if seconds is not None:
        total += f"; {seconds:.1f} s"
    lines.append(total + (" — OK" if exit_status(reports) == 0 else " — FAILED"))
    return "\n".join(lines)


# --- the sample calls -----------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """The dims that decide which specialisations a model's layers launch."""

    name: str
    heads: int
    index_heads: int
    index_dim: int
    topk: int
    kv_lora: int
    rope: int
    page_sizes: tuple[int, ...]


def model_shapes() -> list[Shape]:
    """GLM-5 (64 heads, 32 index heads) and DeepSeek-V3.2 (128, 64) at page size 64, and
    the tiny presets the tests build models from (4 heads) at page sizes 16 and 64."""
    from dsakv.config import PRESETS
    from dsakv.config.presets import TINY_PRESETS

    seen: dict[tuple, Shape] = {}
    for presets, page_sizes in ((PRESETS, (64,)), (TINY_PRESETS, (16, 64))):
        for name, c in presets.items():
            dims = (c["num_attention_heads"], c["index_n_heads"], c["index_head_dim"],
                    c["index_topk"], c["kv_lora_rank"], c["qk_rope_head_dim"], page_sizes)  # fmt: skip
            old = seen.get(dims)
            seen[dims] = Shape(f"{old.name}/{name}" if old else name, *dims)
    return list(seen.values())


def default_cases(shapes: Sequence[Shape] | None = None) -> list[Case]:
    """Every wrapper the backends and the kernel tests call (stores, sparse MLA, indexer
    logits, HiSparse resolve / copy_rows, the fp8 conversions), for each latent kind, fp32
    and bf16 rows / queries, every MLA mode (decode over slots, extend over top-k positions,
    dense extend) and each of `shapes` (default `model_shapes()`). Slot and context tensors
    are int64 as the engine passes them; decode indices, positions and tables int32."""
    import torch

    from dsakv.config.hisparse import SPARE_TOP_K

    from . import triton_fp8, triton_hisparse, triton_indexer, triton_mla, triton_rows, triton_store

    bf16, f32, i32, i64, u8 = torch.bfloat16, torch.float32, torch.int32, torch.int64, torch.uint8
    cases: list[Case] = []

    def add(label: str, fn: Callable[..., object], *args: Any) -> None:
        cases.append(Case(label, lambda: fn(*args)))

    def latent_cache(kind: str, rows: int, s: Shape) -> torch.Tensor:
        width = s.kv_lora + s.rope
        if kind == "fp8_ds_mla":
            width = s.kv_lora + 4 * -(-s.kv_lora // 128) + 2 * s.rope
        dtype = {"fp32": f32, "bf16": bf16, "fp8_e4m3": u8, "fp8_ds_mla": u8}[kind]
        return torch.zeros(rows, width, dtype=dtype)

    for s in model_shapes() if shapes is None else shapes:
        dim, n, e, length = s.kv_lora + s.rope, 32, 6, s.topk + 45
        for dt in (bf16, f32):
            rows, slots, t = torch.zeros(n, dim, dtype=dt), torch.arange(n), _short_dtype(dt)
            keys = torch.zeros(n, s.index_dim, dtype=dt)
            add(f"store_latent_ds_mla {s.name} rows={t}", triton_store.store_latent_ds_mla,
                rows, latent_cache("fp8_ds_mla", n, s), slots, s.kv_lora, s.rope)  # fmt: skip
            add(f"store_latent_fp8_e4m3 {s.name} rows={t}", triton_store.store_latent_fp8_e4m3,
                rows, latent_cache("fp8_e4m3", n, s), slots)  # fmt: skip
            for kind in ("bf16", "fp32"):
                add(f"store_rows[latent {kind}] {s.name} rows={t}", triton_rows.store_rows,
                    rows, latent_cache(kind, n, s), slots)  # fmt: skip
                add(f"store_rows[index-K {kind}] {s.name} keys={t}", triton_rows.store_rows,
                    keys, torch.zeros(n, s.index_dim, dtype=f32 if kind == "fp32" else bf16),
                    slots)  # fmt: skip
            for ps in s.page_sizes:  # the backend stores fp32 keys; the tests bf16 too
                kp = torch.zeros(4, ps * (s.index_dim + 4 * -(-s.index_dim // 128)), dtype=u8)
                add(f"store_index_k_fp8 {s.name} keys={t} ps={ps}",
                    triton_store.store_index_k_fp8, keys, kp, slots, ps)  # fmt: skip
            # indexer: the backend's queries are bf16, the device tests' fp32 too
            for ps in s.page_sizes:
                kp = torch.zeros(4, ps * (s.index_dim + 4), dtype=u8)
                width = max(s.topk, 4 * ps) // ps * ps
                idx = f"{s.name} Hi={s.index_heads} q={t} ps={ps}"
                for b in (1, 8):
                    add(f"index_logits_paged {idx} B={b} width={width}",
                        triton_indexer.index_logits_paged,
                        torch.zeros(b, s.index_heads, s.index_dim, dtype=dt),
                        torch.zeros(b, s.index_heads), kp,
                        torch.zeros(b, width // ps, dtype=i32), torch.full((b,), width, dtype=i32),
                        ps, width)  # fmt: skip
                add(f"index_logits_extend {idx} E={e} L={length}",
                    triton_indexer.index_logits_extend,
                    torch.zeros(e, s.index_heads, s.index_dim, dtype=dt),
                    torch.zeros(e, s.index_heads), kp, torch.arange(length),
                    torch.arange(length - e, length, dtype=i32), ps)  # fmt: skip
            for kind in triton_mla.LATENT_KINDS:
                cache = latent_cache(kind, 64, s)
                mla = f"{s.name} kind={kind} q={t} H={s.heads}"
                for b in (1, 32):  # the split count (the merge's block) follows the batch
                    add(f"sparse_mla_decode[slots] {mla} B={b} K={s.topk}",
                        triton_mla.sparse_mla_decode, torch.zeros(b, s.heads, dim, dtype=dt),
                        cache, kind, torch.zeros(b, s.topk, dtype=i32), 0.1, s.kv_lora,
                        s.rope)  # fmt: skip
                q, ctx = torch.zeros(e, s.heads, dim, dtype=dt), torch.arange(length)
                q_pos = torch.arange(length - e, length, dtype=i32)
                add(f"sparse_mla_extend[topk] {mla} E={e} L={length} K={s.topk}",
                    triton_mla.sparse_mla_extend, q, cache, kind, ctx, q_pos,
                    torch.zeros(e, s.topk, dtype=i32), 0.1, s.kv_lora, s.rope)  # fmt: skip
                add(f"sparse_mla_extend[dense] {mla} E={e} L={length}",
                    triton_mla.sparse_mla_extend, q, cache, kind, ctx, q_pos, None, 0.1,
                    s.kv_lora, s.rope)  # fmt: skip
        # HiSparse: resolve over the default hot buffer, (1 + SPARE_TOP_K) × top-k (positions
        # int32 as `init_buffers` makes them; the tests' int64 too), copy_rows of latent rows
        buf = (1 + SPARE_TOP_K) * s.topk
        for pd in (i32, i64) if s.topk < 1024 else (i32,):
            add(f"hisparse.resolve {s.name} S={buf} K={s.topk} pos={_short_dtype(pd)}",
                triton_hisparse.resolve, torch.zeros(2, s.topk, dtype=pd),
                torch.zeros(2, dtype=i64), torch.zeros(2, dtype=i32),
                torch.zeros(2, buf, dtype=pd), torch.zeros(2, buf, dtype=i64),
                torch.zeros(2, buf, dtype=i32), 3)  # fmt: skip
        for kind in triton_mla.LATENT_KINDS:
            for layers in ((), (2,)):  # one layer, or a stack of layers in one launch
                rows = latent_cache(kind, 64, s)
                rows = rows.expand(*layers, *rows.shape).contiguous()
                add(f"rows.copy_rows {s.name} kind={kind} layers={layers or 1}",
                    triton_rows.copy_rows, rows, rows.clone(), torch.arange(8),
                    torch.arange(8, dtype=i32))  # fmt: skip
    # the elementwise fp8 / bf16 conversions (tests, triton_bench)
    add("decode_e4m3 n=4096", triton_fp8.decode_e4m3, torch.zeros(4096, dtype=u8))
    add("encode_e4m3 n=4096", triton_fp8.encode_e4m3, torch.zeros(4096))
    add("round_bf16 n=4096", triton_fp8.round_bf16, torch.zeros(4096))
    add("pow2_scale n=4096", triton_fp8.pow2_scale, torch.zeros(4096))
    return cases


def _short_dtype(dtype: Any) -> str:
    return {"bfloat16": "bf16", "float32": "fp32", "int32": "i32", "int64": "i64"}.get(
        str(dtype).removeprefix("torch."), str(dtype)
    )


# --- entry points ---------------------------------------------------------------------------


def header(arch: int = ARCH) -> str:
    api = _api()
    ptxas = ptxas_for(api, arch)
    return (f"triton {api.triton.__version__} ({Path(api.triton.__file__).parent}), "
            f"ptxas {ptxas_version(ptxas)} ({ptxas}), target cuda:{arch} "
            f"(ptxas --gpu-name {gpu_name(arch)}), shared memory limit {SMEM_LIMIT} B")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m dsakv.kernels.triton_aot [--jobs N]` (what `--compile-only` runs)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m dsakv.kernels.triton_aot")
    p.add_argument("--jobs", type=int, default=None, help="parallel compiles (default ≤ 2)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        print(header(), flush=True)
        reports = compile_all(jobs=args.jobs)
    except DsakvError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_reports(reports, time.perf_counter() - t0), flush=True)
    return exit_status(reports)


def run_compile_only(triton_path: str | None = None, jobs: int | None = None) -> int:
    """Run `main` in a clean subprocess: TRITON_INTERPRET unset, no CUDA device visible,
    `triton_path` (a folder holding another `triton`, e.g. .triton-3.6) first on sys.path."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # nothing here may touch a GPU
    if triton_path:
        path = Path(triton_path).resolve()
        if not (path / "triton" / "__init__.py").is_file():
            raise DsakvError(f"--triton-path {triton_path}: no triton package there")
        env["PYTHONPATH"] = os.pathsep.join([str(path), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "dsakv.kernels.triton_aot"]
    if jobs:
        cmd += ["--jobs", str(jobs)]
    return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
