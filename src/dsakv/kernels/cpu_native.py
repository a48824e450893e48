"""dsakv's native CPU kernels (`csrc/cpu_kernels.cpp`): built on first use, called with ctypes.

Why native: a CPU decode step is bound by how many times each stored row is touched, and
torch can only widen the gathered rows into an fp32 copy and hand that to two GEMMs (at 32
requests that copy is 10 MB a layer, written once and read twice). `mla_decode` reads the
stored bytes in place, widens 64 rows at a time into a block that stays in cache, and
runs the scores, an online softmax and the weighted sum over it.

The source is plain C++ over raw pointers (no torch headers): `$CXX` (default `c++`)
builds it in about a second with `-O3 -march=native -fopenmp` into
`$DSAKV_CACHE/kernels` (default `~/.cache/dsakv/kernels`), keyed by the source, the
compiler and this CPU's flags, with its size and sha256 beside it: a cached library that
differs (a truncated or empty file) or does not load is rebuilt once, never loaded. OpenMP
resolves to the libgomp torch has loaded, so the kernels use torch's threads. Without a
compiler `available()` is False and the cpu backend keeps its torch ops (one warning).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from functools import cache, cached_property
from pathlib import Path
from typing import NamedTuple

import torch

from dsakv.memory.layout import scale_blocks

from .torch_ops import unpacked_width

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
# Latent row encodings the kernel reads (the pool's `kv_cache_dtype`).
KINDS = {"fp32": 0, "bf16": 1, "fp8_e4m3": 2, "fp8_ds_mla": 3, "fp8_block": 4}
# Latent encodings `store_latent` writes (bf16 / fp32 rows are stored as they are).
STORED_KINDS = ("fp8_e4m3", "fp8_ds_mla")
_MAX_SCALE_BLOCKS = 64  # fp32 scales per row the kernels hold on the stack (8192 values)

_lock = threading.Lock()


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def library_path() -> Path:
    """Where the build for this source, `$CXX`, the flags and this CPU is cached."""
    cxx = os.environ.get("CXX") or "c++"
    key = hashlib.sha256(
        b"\0".join(
            [SOURCE.read_bytes(), cxx.encode(), " ".join(FLAGS).encode(), _cpu_flags().encode()]
        )
    )
    root = Path(os.environ.get("DSAKV_CACHE") or Path.home() / ".cache" / "dsakv") / "kernels"
    return root / f"cpu_kernels-{key.hexdigest()[:16]}.so"


def _digest_path(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256")


def _digest(data: bytes) -> str:
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}"


def _damage(lib: Path) -> str | None:
    """Why the cached `lib` cannot be trusted (None: it is the file its build wrote).
    Checked before dlopen, which maps a truncated library and then dies of SIGBUS (no
    message) where the loader reads past its end."""
    try:
        want = _digest_path(lib).read_text().strip()
    except OSError:
        return f"no {_digest_path(lib).name} (an interrupted build, or an older dsakv's)"
    try:
        data = lib.read_bytes()
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if _digest(data) != want:
        return f"{len(data)} bytes, not the {want.split()[0]} bytes its build wrote, or corrupt"
    return None


def _install(path: Path, dest: Path) -> None:
    """Renames `path` to `dest` once its bytes are on disk: concurrent builders each install
    a whole file, and a crash leaves the old file or the new one, never a part of one."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(path, dest)


def _compile(cxx: str, lib: Path) -> None:
    """Builds the source into `lib`, its size and sha256 installed beside it first: a
    library is never there without them, and never loaded without them."""
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = Path(tmp) / lib.name
        cmd = [cxx, *FLAGS, str(SOURCE), "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise OSError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        digest = Path(tmp) / _digest_path(lib).name
        digest.write_text(f"{_digest(out.read_bytes())}\n")
        _install(digest, _digest_path(lib))
        _install(out, lib)


def _load(cxx: str) -> ctypes.CDLL:
    """The cached library if it is whole and loads, else built (again) once: a damaged
    cache costs one build, never a crash or a permanent fallback to the torch ops."""
    if shutil.which(cxx) is None:
        raise OSError(f"no C++ compiler ({cxx!r} is not on PATH)")
    lib = library_path()
    if lib.exists():
        damage = _damage(lib)
        if damage is None:
            try:
                return ctypes.CDLL(str(lib))
            except OSError as e:
                damage = f"does not load ({e})"
        log.warning("cached native CPU kernels %s: %s; rebuilding them", lib, damage)
    _compile(cxx, lib)
    try:
        return ctypes.CDLL(str(lib))
    except OSError as e:
        raise OSError(f"{lib}, just built, does not load: {e}") from e


def _build() -> ctypes.CDLL:
    dll = _load(os.environ.get("CXX") or "c++")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in ("dsakv_store_latent", "dsakv_store_index_k_fp8"):
        getattr(dll, name).restype = i64
    dll.dsakv_store_latent.argtypes = [ptr, i64, i64, i64, ctypes.c_int, ptr, i64, i64, ptr]
    dll.dsakv_store_index_k_fp8.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr]
    dll.dsakv_mla_decode.restype = i64
    dll.dsakv_mla_decode.argtypes = [
        *(ptr, ptr, i64, i64, ptr, i64, i64, ctypes.c_int, ptr, i64, ptr),
        *(i64, i64, i64, i64, i64, ctypes.c_float, ptr, i64, i64, ptr, ctypes.c_int),
    ]
    dll.dsakv_index_decode.restype = i64
    dll.dsakv_index_decode.argtypes = [
        *(ptr, ptr, i64, i64, i64, ptr, i64, i64, ctypes.c_int, ptr, i64, i64, ptr),
        *(ctypes.c_float, ctypes.c_int, ptr),
    ]
    dll.dsakv_rms_norm.restype = dll.dsakv_linear.restype = None
    dll.dsakv_rms_norm.argtypes = [ptr, ptr, i64, i64, ctypes.c_float, ptr]
    dll.dsakv_linear.argtypes = [ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    dll.dsakv_topk_by_position.restype = None
    dll.dsakv_topk_by_position.argtypes = [ptr, i64, i64, i64, ptr]
    dll.dsakv_index_key.restype = dll.dsakv_index_query.restype = None
    dll.dsakv_index_key.argtypes = [ptr, i64, ptr, ptr, ptr, ptr]
    dll.dsakv_index_query.argtypes = [ptr, i64, *(ptr,) * 6]
    dll.dsakv_mla_inputs.restype = None
    dll.dsakv_mla_inputs.argtypes = [ptr, i64, *(ptr,) * 8]
    dll.dsakv_ffn.restype = None
    dll.dsakv_ffn.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64]
    dll.dsakv_forward_step.restype = dll.dsakv_draft_chain.restype = i64
    dll.dsakv_forward_step.argtypes = [ptr, i64, *(ptr,) * 7, i64, ptr]
    dll.dsakv_draft_chain.argtypes = [ptr, i64, *(ptr,) * 5, i64, ptr, ptr, i64, ptr, i64, ptr]
    return dll


@cache
def _library() -> ctypes.CDLL | None:
    with _lock:
        try:
            return _build()
        except OSError as e:
            log.warning("dsakv native CPU kernels unavailable, using torch ops: %s", e)
            return None


def available() -> bool:
    """Whether the native kernels built (or were built before) and loaded."""
    return _library() is not None


def _on_cpu(*tensors: torch.Tensor) -> None:
    for t in tensors:  # (a plain loop: these checks run several times a layer)
        if not t.is_cpu:
            raise ValueError("dsakv's native CPU kernels take CPU tensors only")


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype`, contiguous (without `to`'s call cost when it already is)."""
    if t.dtype != dtype:
        t = t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()


def _rows_and_slots(x: torch.Tensor, width: int, slots: torch.Tensor):
    """fp32 contiguous `x[n, width]` and int64 `slots[n]`, as the pool's writes check them."""
    _on_cpu(x, slots)
    s = _as(slots, torch.int64)
    if x.dim() != 2 or x.shape != (s.numel(), width) or s.dim() != 1:
        raise ValueError(
            f"rows must be [{s.numel()}, {width}] for {s.numel()} slots, got {tuple(x.shape)}"
        )
    return _as(x, torch.float32), s


def _scale_blocks(width: int) -> int:
    """Scales per row of `width` fp8 values (one per `FP8_BLOCK`), within the kernels' limit."""
    nb = scale_blocks(width)
    if nb > _MAX_SCALE_BLOCKS:
        raise ValueError(
            f"{width} fp8 values a row exceed the native kernels' {_MAX_SCALE_BLOCKS} scales"
        )
    return nb


def _raise_bad(bad: int, rows: int) -> None:
    if bad:
        raise IndexError(f"{bad} slots out of range 0..{rows - 1} (nothing written)")


def store_latent(
    rows: torch.Tensor, data: torch.Tensor, slots: torch.Tensor, kind: str, lora: int, rope: int
) -> None:
    """The pool's `write_latent` for e4m3 / fp8_ds_mla rows (byte-equal for finite values),
    into a layer's latent buffer `data` as stored."""
    _on_cpu(data)
    if kind not in STORED_KINDS or not data.is_contiguous():
        raise ValueError(f"store_latent: kind {kind!r} or a strided buffer")
    _scale_blocks(lora)
    x, s = _rows_and_slots(rows, lora + rope, slots)
    bad = _library().dsakv_store_latent(
        x.data_ptr(),
        s.numel(),
        lora,
        rope,
        KINDS[kind],
        data.data_ptr(),
        data.shape[0],
        data.shape[-1] * data.element_size(),
        s.data_ptr(),
    )
    _raise_bad(bad, data.shape[0])


def store_index_k_fp8(
    rotated: torch.Tensor, data: torch.Tensor, slots: torch.Tensor, page_size: int
) -> None:
    """The pool's fp8 `write_index_k` after its rotation: `rotated[n, d]` (already through
    `prepare_index_q`) into the page-major buffer `data[pages, page_size · (d + 4·d/128)]`."""
    d = rotated.shape[-1]
    if (
        data.dtype != torch.uint8
        or not data.is_contiguous()
        or data.shape[1] != page_size * (d + 4 * _scale_blocks(d))
    ):
        raise ValueError("store_index_k_fp8: not a page-major fp8 index-K buffer")
    x, s = _rows_and_slots(rotated, d, slots)
    bad = _library().dsakv_store_index_k_fp8(
        x.data_ptr(), s.numel(), d, data.data_ptr(), data.shape[0], page_size, s.data_ptr()
    )
    _raise_bad(bad, data.shape[0] * page_size)


def mla_decode(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    data: torch.Tensor,
    slots: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    kind: str,
    w_uv: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed sparse MLA decode over the pool's stored rows: latent queries
    `q_nope[B, H, lora]` and `q_rope[B, H, rope]` (fp32), `data[slots, row]` a layer's
    latent buffer as stored, `slots[B, k]` the rows each request reads (or `[k]`, one list
    every query reads: a prefill chunk's context, each block of rows widened once for
    several queries), `valid[B, k]` -> the latent outputs `[B, H, lora]`, or with
    `w_uv[H, v, lora]` (a view of kv_b's rows, as `_matrix` takes them) their values
    `[B, H, v]`.

    `cpu_ops.decode_attention`'s math (softmax over the valid rows, then their weighted
    sum) in another summation order: outputs agree to fp32 rounding, and a request's output
    is the same whatever batch it is in and whatever the thread count."""
    lib = _library()
    assert lib is not None, "check available() first"
    b, heads, lora = q_nope.shape
    rope = q_rope.shape[-1]
    _on_cpu(q_nope, q_rope, data, slots, valid)
    if kind not in KINDS or q_nope.dtype != torch.float32 or q_rope.dtype != torch.float32:
        raise ValueError(f"mla_decode: kind {kind!r}, queries {q_nope.dtype} / {q_rope.dtype}")
    if q_rope.shape[:2] != (b, heads) or q_rope.stride(-1) != 1:
        raise ValueError(
            f"mla_decode: q_rope {tuple(q_rope.shape)} for q_nope {tuple(q_nope.shape)}"
        )
    if kind == "fp8_ds_mla":
        _scale_blocks(lora)
    q_nope = q_nope.contiguous()
    slots, valid = _as(slots, torch.int64), _as(valid, torch.bool)
    shared = slots.dim() == 1
    if (
        not data.is_contiguous()
        or valid.shape != (b, slots.shape[-1])
        or (not shared and slots.shape != valid.shape)
    ):
        raise ValueError("mla_decode: strided latent buffer or mismatched slots / valid")
    v, uv = 0, (None, 0, 0)
    if w_uv is not None:
        v = w_uv.shape[1]
        uv = _heads_rows(w_uv, heads, v, lora)
    out = torch.empty(b, heads, v or lora, dtype=torch.float32, device=q_nope.device)
    bad = lib.dsakv_mla_decode(
        q_nope.data_ptr(),
        q_rope.data_ptr(),
        q_rope.stride(0),
        q_rope.stride(1),
        data.data_ptr(),
        data.shape[0],
        data.shape[-1] * data.element_size(),
        KINDS[kind],
        slots.data_ptr(),
        0 if shared else slots.shape[1],
        valid.data_ptr(),
        b,
        slots.shape[-1],
        heads,
        lora,
        rope,
        scale,
        uv[0],
        uv[1],
        v,
        out.data_ptr(),
        uv[2],
    )
    if bad:
        raise IndexError(
            f"mla_decode: {bad} valid slots outside the latent buffer's {data.shape[0]} rows"
        )
    return out


def index_decode(
    q: torch.Tensor,
    w: torch.Tensor,
    data: torch.Tensor,
    page_size: int,
    table: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    low: bool,
) -> torch.Tensor:
    """Indexer scores `[B, W]` over a layer's index-K buffer `data` as stored (keys read in
    place): the page-major fp8 buffer (uint8), or bf16 / fp32 rows. `q[B, H, D]` (rotated as
    the stored keys), `w[B, H]`, key slots `table[B, W]` (or `[W]`, one table every query
    reads: a prefill chunk's context), `lens[B]`; -inf past each query's length.

    `low`: `cpu_ops.index_topk_decode`'s bf16 arithmetic (q and each head's logit rounded
    to bf16, fp32 sums, `scale` on the weights); else the reference's fp32 ops (`scale` on
    the logits). Another summation order than torch's GEMMs: scores agree to fp32
    rounding, and do not depend on the batch, the table's width or the thread count."""
    _on_cpu(q, w, data, table, lens)
    b, heads, d = q.shape
    nb = _scale_blocks(d)
    if data.dtype == torch.uint8:
        kind, pages, ps = KINDS["fp8_e4m3"], data.shape[0], page_size
        if not data.is_contiguous() or data.shape[1] != page_size * (d + 4 * nb):
            raise ValueError("index_decode: not a page-major fp8 index-K buffer")
    elif data.dtype in (torch.bfloat16, torch.float32) and data.shape[-1] == d:
        kind = KINDS["bf16" if data.dtype == torch.bfloat16 else "fp32"]
        pages, ps = data.shape[0], 1  # one key a row
        if not data.is_contiguous():
            raise ValueError("index_decode: a strided index-K buffer")
    else:
        raise ValueError(f"index_decode: index-K {data.dtype} {tuple(data.shape)} for dim {d}")
    shared = table.dim() == 1
    width = table.shape[-1]
    if (
        w.shape != (b, heads)
        or table.dim() not in (1, 2)
        or (not shared and table.shape[0] != b)
        or lens.shape != (b,)
    ):
        raise ValueError(
            f"index_decode: q {tuple(q.shape)}, w {tuple(w.shape)}, table "
            f"{tuple(table.shape)}, lens {tuple(lens.shape)}"
        )
    q, w = _as(q, torch.float32), _as(w, torch.float32)
    table, lens = _as(table, torch.int64), _as(lens, torch.int64)
    out = torch.empty(b, width, dtype=torch.float32)
    bad = _library().dsakv_index_decode(
        q.data_ptr(),
        w.data_ptr(),
        b,
        heads,
        d,
        data.data_ptr(),
        pages,
        ps,
        kind,
        table.data_ptr(),
        0 if shared else width,
        width,
        lens.data_ptr(),
        scale,
        int(low),
        out.data_ptr(),
    )
    if bad:
        raise IndexError(f"index_decode: {bad} key slots outside the index-K buffer")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`F.rms_norm` of fp32 rows `x[B, n]`, each row on its own (the final norm)."""
    x = _activations(x, weight.numel())
    out = torch.empty_like(x)
    _library().dsakv_rms_norm(
        x.data_ptr(), _weight(weight, x.shape[1]), x.shape[0], x.shape[1], eps, out.data_ptr()
    )
    return out


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x[B, K] @ weight[N, K]ᵀ` in fp32 (`weight` as `_matrix` takes it), each output
    reduced as the native blocks reduce theirs (the LM head): a row's outputs do not depend
    on the rows beside it."""
    n, k = matrix_shape(weight)
    x = _activations(x, k)
    out = torch.empty(x.shape[0], n)
    w = _matrix(weight, n, k)
    _library().dsakv_linear(w.p, n, k, x.data_ptr(), x.shape[0], out.data_ptr(), w.kind)
    return out


def topk_by_position(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`torch_ops.topk_by_position` of fp32 `scores[B, W]` (the same positions in the same
    order), without its int64 key tensors: at one decode request those ops cost more than
    the scoring."""
    _on_cpu(scores)
    if scores.dim() != 2 or not 0 < k <= scores.shape[1] or scores.shape[1] >= 2**31:
        raise ValueError(f"topk_by_position: top-{k} of {tuple(scores.shape)}")
    scores = _as(scores, torch.float32)
    out = torch.empty(scores.shape[0], k, dtype=torch.int64)
    _library().dsakv_topk_by_position(
        scores.data_ptr(), scores.shape[0], scores.shape[1], k, out.data_ptr()
    )
    return out


# --- one-token decode blocks -------------------------------------------------------------

_f32, _i64, _ptr = ctypes.c_float, ctypes.c_int64, ctypes.c_void_p
# Weight matrices the blocks read in place (`Mat::kind`): bf16 widened in registers, packed
# FP8 blocks (uint8, `torch_ops.pack_fp8`) a few rows at a time; both exact.
_MATRIX_KINDS = {
    torch.float32: KINDS["fp32"],
    torch.bfloat16: KINDS["bf16"],
    torch.uint8: KINDS["fp8_block"],
}


class _Mat(ctypes.Structure):
    _fields_ = [("p", _ptr), ("kind", _i64)]


class _MlaInputsWeights(ctypes.Structure):
    _fields_ = [
        *((n, _ptr) for n in ("in_norm", "q_a_norm", "kv_norm")),
        *((n, _Mat) for n in ("q_a", "q_b", "kv_a", "w_uk")),
        *((n, _i64) for n in ("hidden", "q_lora", "heads", "nope", "rope", "kv_lora", "uk_rows")),
        *((n, _f32) for n in ("eps_in", "eps_q", "eps_kv")),
    ]


class _IndexerWeights(ctypes.Structure):
    _fields_ = [
        *((n, _Mat) for n in ("wq_b", "wk")),
        *((n, _ptr) for n in ("k_norm_w", "k_norm_b", "weights_proj", "hadamard")),
        *((n, _i64) for n in ("hidden", "q_lora", "heads", "dim", "rope", "interleave")),
        *((n, _f32) for n in ("eps", "w_scale")),
    ]


class _FfnWeights(ctypes.Structure):
    _fields_ = [
        ("o_proj", _Mat),
        ("post_norm", _ptr),
        *((n, _i64) for n in ("hidden", "attn_dim")),
        ("eps", _f32),
        *((n, _ptr) for n in ("router", "router_bias")),
        *((n, _i64) for n in ("n_experts", "top_k", "n_group", "topk_group", "norm_topk")),
        ("scaling", _f32),
        *((n, _Mat) for n in ("gate_up", "down")),
        ("inter", _i64),
        *((n, _Mat) for n in ("mlp_gate", "mlp_up", "mlp_down")),
        *((n, _i64) for n in ("mlp_inter", "first_expert", "held_experts")),
    ]


def fits(module: torch.nn.Module) -> bool:
    """Whether the native blocks can read `module`'s weights in place: on the CPU, the
    matrices fp32, bf16 or packed FP8 blocks (as stored), the vectors (norms, biases) fp32,
    as they are exactly when the model computes in fp32."""
    return all(
        p.is_cpu and (p.dtype == torch.float32 or (p.dim() > 1 and p.dtype in _MATRIX_KINDS))
        for p in module.parameters()
    )


def matrix_shape(t: torch.Tensor) -> tuple[int, ...]:
    """A weight matrix's shape in values (packed FP8 rows hold their scales too)."""
    if t.dtype != torch.uint8:
        return tuple(t.shape)
    return (*t.shape[:-1], unpacked_width(t.shape[-1]))


def _matrix(t: torch.Tensor, *shape: int) -> _Mat:
    """A contiguous CPU weight matrix of `shape` (in values), fp32, bf16 or packed FP8
    blocks, as the kernels read it."""
    if t.device.type != "cpu" or t.dtype not in _MATRIX_KINDS or not t.is_contiguous():
        raise ValueError(
            "native blocks take contiguous CPU weights (fp32, bf16 or packed fp8 matrices), "
            f"got {t.dtype} {t.device}"
        )
    if matrix_shape(t) != shape:
        raise ValueError(f"native blocks: weight {matrix_shape(t)}, expected {shape}")
    return _Mat(t.data_ptr(), _MATRIX_KINDS[t.dtype])


def _heads_rows(w: torch.Tensor, heads: int, rows: int, width: int) -> tuple[int, int, int]:
    """`w[heads, rows, width]`, each head a run of whole matrix rows (W_uv: a view of
    kv_b's): (address, rows from one head to the next, kind)."""
    _on_cpu(w)
    row = w.stride(1)
    ok = w.dtype in _MATRIX_KINDS and matrix_shape(w) == (heads, rows, width)
    if not ok or w.stride(2) != 1 or row != w.shape[2] or w.stride(0) % row:
        raise ValueError(f"native blocks: per-head weight {tuple(w.shape)} {w.dtype}")
    return w.data_ptr(), w.stride(0) // row, _MATRIX_KINDS[w.dtype]


def _weight(t: torch.Tensor, *shape: int) -> int:
    """The address of an fp32 contiguous CPU weight of `shape` (a norm, a bias, the router)."""
    if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError(
            f"native blocks take fp32 contiguous CPU weights, got {t.dtype} {t.device}"
        )
    if tuple(t.shape) != shape:
        raise ValueError(f"native blocks: weight {tuple(t.shape)}, expected {shape}")
    return t.data_ptr()


def _activations(x: torch.Tensor, width: int) -> torch.Tensor:
    _on_cpu(x)
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"native blocks: input {tuple(x.shape)} {x.dtype}, expected [B, {width}]")
    return x.contiguous()


class MlaInputs:
    """`attention_inputs` of a decode step in one call (`dsakv_mla_inputs`): the input
    norm, q_a / kv_a, their norms, q_b, RoPE and the absorbed query, each weight read once
    for every token. Holds the weights it reads (the module's own tensors, not copies).

    `kv_b[H · (nope + v), kv_lora]`: its first `nope` rows of each head are W_uk."""

    def __init__(
        self,
        in_norm,
        q_a,
        q_a_norm,
        q_b,
        kv_a,
        kv_norm,
        kv_b,
        *,
        heads: int,
        nope: int,
        rope: int,
        v: int,
        eps: tuple[float, float, float],
    ) -> None:
        hidden, q_lora, kv_lora = in_norm.numel(), q_a_norm.numel(), kv_norm.numel()
        self.dims = (hidden, q_lora, heads, nope, rope, kv_lora)
        self._keep = (in_norm, q_a, q_a_norm, q_b, kv_a, kv_norm, kv_b)
        self._w = _MlaInputsWeights(
            _weight(in_norm, hidden),
            _weight(q_a_norm, q_lora),
            _weight(kv_norm, kv_lora),
            _matrix(q_a, q_lora, hidden),
            _matrix(q_b, heads * (nope + rope), q_lora),
            _matrix(kv_a, kv_lora + rope, hidden),
            _matrix(kv_b, heads * (nope + v), kv_lora),
            hidden,
            q_lora,
            heads,
            nope,
            rope,
            kv_lora,
            nope + v,
            *eps,
        )

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """`x[B, hidden]`, `cos` / `sin` `[B, rope / 2]` -> (h, q_lat `[B, H, kv_lora]`,
        q_rope `[B, H, rope]`, q_lora, row `[B, kv_lora + rope]`), as `attention_inputs`."""
        hidden, q_lora, heads, _, rope, kv_lora = self.dims
        x = _activations(x, hidden)
        b = x.shape[0]
        cos, sin = _activations(cos, rope // 2), _activations(sin, rope // 2)
        if cos.shape[0] != b or sin.shape[0] != b:
            raise ValueError("native blocks: one cos / sin row per token")
        h = torch.empty(b, hidden)
        q_lat = torch.empty(b, heads, kv_lora)
        q_rope = torch.empty(b, heads, rope)
        ql = torch.empty(b, q_lora)
        row = torch.empty(b, kv_lora + rope)
        _library().dsakv_mla_inputs(
            ctypes.byref(self._w),
            b,
            x.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            h.data_ptr(),
            q_lat.data_ptr(),
            q_rope.data_ptr(),
            ql.data_ptr(),
            row.data_ptr(),
        )
        return h, q_lat, q_rope, ql, row


class Ffn:
    """`residual_ffn` of a decode step in one call (`dsakv_ffn`): o_proj and the residual,
    the post-attention norm, then a dense MLP, or the router, the chosen experts and the
    shared experts; each weight read once for every token.

    `mlp`: (gate `[Is, hidden]`, up, down `[hidden, Is]`), the dense MLP or the shared
    experts. `moe`: (router `[E, hidden]`, bias `[E]`, gate_up `[E_r, 2I, hidden]`, down
    `[E_r, hidden, I]`, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor,
    first): the `E_r` experts held are `first ..` (all of them, or a rank's under --ep: a
    token's choices outside them add nothing here).

    A layer split over ranks (this rank's o_proj columns, its slice of every expert and of
    the MLP) runs `o_proj`, then, after the sum, the residual and the norm, `part`."""

    def __init__(self, o_proj, post_norm, eps: float, mlp: tuple, moe: tuple | None = None):
        hidden, attn_dim = matrix_shape(o_proj)
        gate, up, down = mlp
        inter = gate.shape[0]
        mlp_ptrs = (
            _matrix(gate, inter, hidden),
            _matrix(up, inter, hidden),
            _matrix(down, hidden, inter),
        )
        routed: tuple = (None, None, 0, 0, 0, 0, 0, 0.0, _Mat(), _Mat(), 0)
        held: tuple[int, int] = (0, 0)
        if moe is not None:
            router, bias, gate_up, edown, top_k, n_group, topk_group, norm, scaling, first = moe
            e, i = router.shape[0], matrix_shape(edown)[-1]
            if not 1 <= top_k <= e or (n_group > 1 and (e % n_group or topk_group > n_group)):
                raise ValueError(f"native blocks: top-{top_k} of {e} experts in {n_group} groups")
            held = (first, gate_up.shape[0])
            if not 0 <= first <= e - held[1]:
                raise ValueError(f"native blocks: experts {first}.. ({held[1]}) of {e}")
            routed = (
                _weight(router, e, hidden),
                _weight(bias, e),
                e,
                top_k,
                n_group,
                topk_group,
                int(norm),
                scaling,
                _matrix(gate_up, held[1], 2 * i, hidden),
                _matrix(edown, held[1], hidden, i),
                i,
            )
        self.hidden, self.attn_dim, self.eps = hidden, attn_dim, eps
        self._o_proj, self._post_norm = o_proj, post_norm
        self._keep = (mlp, moe)
        self._w = _FfnWeights(
            _matrix(o_proj, hidden, attn_dim),
            _weight(post_norm, hidden),
            hidden,
            attn_dim,
            eps,
            *routed,
            *mlp_ptrs,
            inter,
            *held,
        )

    def __call__(
        self, x: torch.Tensor, attn: torch.Tensor, routed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`x[B, hidden]` (the layer's input), `attn[B, attn_dim]` (the heads' outputs) ->
        the layer's output `[B, hidden]`. `routed`: an int32 `[B, top_k]` view (rows may be
        strided, columns contiguous) that gets each token's chosen experts (an MoE layer)."""
        attn = _activations(attn, self.attn_dim)
        if attn.shape[0] != x.shape[0]:
            raise ValueError("native blocks: one attention output per token")
        return self._run(x, attn, routed)

    def o_proj(self, attn: torch.Tensor) -> torch.Tensor:
        """`attn[B, attn_dim]` through o_proj (this rank's heads: a part of the sum)."""
        return linear(attn, self._o_proj)

    def part(self, h: torch.Tensor, routed: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's part of the FFN of the normed rows `h[B, hidden]`, without the
        residual: the ranks' parts sum to the rest of the layer's output (`routed` as in
        `__call__`)."""
        return self._run(h, None, routed)

    def norm(self, x1: torch.Tensor) -> torch.Tensor:
        """The post-attention norm of `x1[B, hidden]`, as the whole call norms it."""
        return rms_norm(x1, self._post_norm, self.eps)

    def _run(
        self, x: torch.Tensor, attn: torch.Tensor | None, routed: torch.Tensor | None
    ) -> torch.Tensor:
        x = _activations(x, self.hidden)
        routed_ld = 0
        if routed is not None:
            _on_cpu(routed)
            k = self._w.top_k
            ok = routed.dtype == torch.int32 and routed.shape == (x.shape[0], k)
            if not self._w.router or not ok or (k > 1 and routed.stride(1) != 1):
                raise ValueError("native blocks: routed must be int32 [B, top_k] of an MoE layer")
            routed_ld = routed.stride(0)
        out = torch.empty_like(x)
        _library().dsakv_ffn(
            ctypes.byref(self._w),
            x.shape[0],
            x.data_ptr(),
            None if attn is None else attn.data_ptr(),
            out.data_ptr(),
            None if routed is None else routed.data_ptr(),
            routed_ld,
        )
        return out


class IndexerInputs:
    """The indexer's projections for a decode step, over its own weights: `key` (wk,
    LayerNorm, RoPE: the key to store) and `query` (wq_b, RoPE, the rotation the fp8 keys
    are stored with; weights_proj), each one call reading each weight once for every
    token."""

    def __init__(
        self,
        wq_b,
        wk,
        k_norm_w,
        k_norm_b,
        weights_proj,
        *,
        heads: int,
        rope: int,
        interleave: bool,
        eps: float,
    ) -> None:
        dim, hidden = matrix_shape(wk)
        q_lora = matrix_shape(wq_b)[1]
        if rope % 2 or not 0 < rope <= dim:  # the kernels rope pairs of the head's first values
            raise ValueError(f"native blocks: an even rope part of 2..{dim} values, got {rope}")
        self.dims = (hidden, q_lora, heads, dim, rope)
        self._keep = (wq_b, wk, k_norm_w, k_norm_b, weights_proj)
        self._fields = (
            _matrix(wq_b, heads * dim, q_lora),
            _matrix(wk, dim, hidden),
            _weight(k_norm_w, dim),
            _weight(k_norm_b, dim),
            _weight(weights_proj, heads, hidden),
        )
        self._tail = (hidden, q_lora, heads, dim, rope, int(interleave), eps, heads**-0.5)
        self._plain = _IndexerWeights(*self._fields, None, *self._tail)

    @cached_property
    def _rotated(self) -> _IndexerWeights:
        """The query weights with the fp8 keys' Hadamard rotation, made on first use: only
        fp8 index-K rotates, and only a power-of-two head has the matrix."""
        from dsakv.memory.fp8 import hadamard_matrix

        dim = self.dims[3]
        self._hadamard = hadamard_matrix(dim, torch.device("cpu"), torch.float32)
        return _IndexerWeights(*self._fields, _weight(self._hadamard, dim, dim), *self._tail)

    def _tables(self, b: int, cos: torch.Tensor, sin: torch.Tensor):
        rope = self.dims[4]
        cos, sin = _activations(cos, rope // 2), _activations(sin, rope // 2)
        if cos.shape[0] != b or sin.shape[0] != b:
            raise ValueError("native blocks: one cos / sin row per token")
        return cos, sin

    def key(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`h[B, hidden]` -> the keys `[B, dim]` to store (not rotated: the store rotates)."""
        h = _activations(h, self.dims[0])
        cos, sin = self._tables(h.shape[0], cos, sin)
        k = torch.empty(h.shape[0], self.dims[3])
        _library().dsakv_index_key(
            ctypes.byref(self._plain),
            h.shape[0],
            h.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            k.data_ptr(),
        )
        return k

    def query(self, h, q_lora, cos, sin, rotate: bool):
        """`h[B, hidden]`, `q_lora[B, q_lora]` -> (queries `[B, heads, dim]`, rotated when
        `rotate`, and head weights `[B, heads]` times heads^-1/2)."""
        hidden, ql, heads, dim, _ = self.dims
        h, q_lora = _activations(h, hidden), _activations(q_lora, ql)
        b = h.shape[0]
        if q_lora.shape[0] != b:
            raise ValueError("native blocks: one q_lora row per token")
        cos, sin = self._tables(b, cos, sin)
        q, w = torch.empty(b, heads, dim), torch.empty(b, heads)
        _library().dsakv_index_query(
            ctypes.byref(self._rotated if rotate else self._plain),
            b,
            h.data_ptr(),
            q_lora.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            q.data_ptr(),
            w.data_ptr(),
        )
        return q, w


# --- a step's layers in one call ---------------------------------------------------------


class _LayerDesc(ctypes.Structure):
    _fields_ = [
        *((n, _ptr) for n in ("inputs", "ffn", "key", "query", "w_uv")),
        *((n, _i64) for n in ("w_uv_sh", "w_uv_kind")),
        ("latent", _ptr),
        *((n, _i64) for n in ("latent_rows", "latent_row_bytes", "latent_kind")),
        ("index_k", _ptr),
        *((n, _i64) for n in ("index_pages", "index_page_size", "index_kind")),
    ]


class _StepDesc(ctypes.Structure):
    _fields_ = [
        *((n, _i64) for n in ("T", "W", "topk")),
        *((n, _ptr) for n in ("cos", "sin", "out_slots", "table", "lens")),
        *((n, _f32) for n in ("index_scale", "mla_scale")),
        ("low", _i64),
        ("routed", _ptr),
        *((n, _i64) for n in ("routed_ld", "routed_layer_ld")),
    ]


class _StepIO(ctypes.Structure):
    _fields_ = [
        ("embed", _Mat),
        ("vocab", _i64),
        *((n, _ptr) for n in ("cos", "sin")),
        ("positions", _i64),
        *((n, _ptr) for n in ("enorm", "hnorm")),
        ("eh_proj", _Mat),
        *((n, _f32) for n in ("e_eps", "h_eps")),
        ("norm", _ptr),
        ("norm_eps", _f32),
        ("head", _Mat),
        ("head_rows", _i64),
    ]


class StepParts(NamedTuple):
    """What a step reads around its layers: the embedding `[vocab, hidden]`, RoPE's cos and
    sin tables `[positions, rope / 2]` (fp32), the output norm (weight, eps), the MTP
    layer's NextN input (enorm, hnorm, eh_proj, their eps) and the LM head (the MTP
    layer's: its drafts are its argmax; None: no logits, no `drafts`)."""

    embed: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]
    norm: tuple[torch.Tensor, float]
    nextn: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float] | None = None
    head: torch.Tensor | None = None


class LayerLoop:
    """A step of a run of layers (the target's, or the MTP layer) in one call
    (`dsakv_forward_step`): the embedding (and the NextN input), the layers, the output
    norm; for steps whose tokens each attend over their own selection: decode tokens, MTP
    verify and draft rows. Per layer it makes the extern calls the per-layer path makes
    (the blocks, the stores, the indexer's scores, top-k in position order, attention over
    the stored rows), so the tokens are the same bits; what it saves is the Python between
    them (about a third of a one-request decode step on a 78-layer model), and Python run
    on caches the layers just filled with weights (a torch op right after them costs 3-8×
    what it costs warm). The step's logits come out of the same call, and `drafts` chains
    the MTP layer's drafts in it.

    `layers`: per layer (its index in `pool`, MlaInputs, Ffn, IndexerInputs or None on a
    shared layer, W_uv `[H, v, kv_lora]` with contiguous rows); the first one is full."""

    def __init__(
        self,
        layers: list[tuple[int, MlaInputs, Ffn, IndexerInputs | None, torch.Tensor]],
        pool,
        parts: StepParts,
        *,
        topk: int,
        index_scale: float,
        mla_scale: float,
        low: bool,
    ) -> None:
        lay = pool.layout
        kind = KINDS[lay.kv_cache_dtype]
        index_kind = {"fp8": KINDS["fp8_e4m3"], "bf16": KINDS["bf16"], "fp32": KINDS["fp32"]}
        self._keep = (layers, pool, parts)
        self._layers = (_LayerDesc * len(layers))()
        for i, (layer, inputs, ffn, indexer, w_uv) in enumerate(layers):
            heads, lora = inputs.dims[2], inputs.dims[-1]
            latent = pool.latent_data(layer)
            d = self._layers[i]
            d.inputs, d.ffn = ctypes.addressof(inputs._w), ctypes.addressof(ffn._w)
            d.w_uv, d.w_uv_sh, d.w_uv_kind = _heads_rows(w_uv, heads, w_uv.shape[1], lora)
            d.latent, d.latent_rows = latent.data_ptr(), latent.shape[0]
            d.latent_row_bytes, d.latent_kind = latent.shape[-1] * latent.element_size(), kind
            if indexer is None:
                continue
            rotated = pool.rotates_index_q
            d.key = ctypes.addressof(indexer._plain)
            d.query = ctypes.addressof(indexer._rotated if rotated else indexer._plain)
            keys = pool.index_k_data(layer)
            d.index_k, d.index_kind = keys.data_ptr(), index_kind[lay.index_k_dtype]
            fp8 = lay.index_k_dtype == "fp8"
            d.index_pages = keys.shape[0]
            d.index_page_size = pool.page_size if fp8 else 1
        self._step = (topk, index_scale, mla_scale, int(low))
        moe = [ffn._w.top_k for _, _, ffn, _, _ in layers if ffn._w.router]
        self._top_k = max(moe, default=0)  # (what `routed` holds a row of, per layer)
        self.hidden = hidden = layers[0][1].dims[0]
        self._io = io = _StepIO()
        vocab = matrix_shape(parts.embed)[0]
        io.embed, io.vocab = _matrix(parts.embed, vocab, hidden), vocab
        cos, sin = parts.rope
        half = layers[0][1].dims[4] // 2
        io.cos, io.sin = _weight(cos, cos.shape[0], half), _weight(sin, cos.shape[0], half)
        io.positions = cos.shape[0]
        io.norm, io.norm_eps = _weight(parts.norm[0], hidden), parts.norm[1]
        if parts.nextn is not None:
            enorm, hnorm, eh_proj, io.e_eps, io.h_eps = parts.nextn
            io.enorm, io.hnorm = _weight(enorm, hidden), _weight(hnorm, hidden)
            io.eh_proj = _matrix(eh_proj, hidden, 2 * hidden)
        if parts.head is not None:
            io.head_rows = matrix_shape(parts.head)[0]
            io.head = _matrix(parts.head, io.head_rows, hidden)

    @property
    def has_head(self) -> bool:
        """Whether the loop computes logits (`rows`, `drafts`)."""
        return bool(self._io.head_rows)

    def _desc(self, ids, positions, out_slots, table, lens, hidden, routed=None):
        """The step's tensors as the call reads them (kept alive by the caller over the
        call: they hold the addresses) and the call's step arguments."""
        ids, positions, out_slots, table, lens = (
            _as(a, torch.int64) for a in (ids, positions, out_slots, table, lens)
        )
        t = ids.shape[0]
        if positions.shape != (t,) or table.shape[0] != t or lens.shape != (t,):
            raise ValueError("layer loop: one position, table row and length per token")
        if out_slots.shape != (t,):
            raise ValueError("layer loop: one out slot per token")
        if (hidden is None) != (self._io.enorm is None):
            raise ValueError("layer loop: h rows go with the NextN input (the MTP layer)")
        if hidden is not None:
            hidden = _activations(hidden, self.hidden)
            if hidden.shape[0] != t:
                raise ValueError("layer loop: one h row per token")
        strides = (0, 0)
        if routed is not None:
            _on_cpu(routed)
            k, shape = self._top_k, (t, len(self._layers), self._top_k)
            ok = k and routed.dtype == torch.int32 and routed.shape == shape
            if not ok or (k > 1 and routed.stride(2) != 1):
                raise ValueError(f"layer loop: routed must be int32 {list(shape)}, an MoE loop's")
            strides = (routed.stride(0), routed.stride(1))
        topk, index_scale, mla_scale, low = self._step
        step = _StepDesc(
            t,
            table.shape[1],
            topk,
            None,
            None,
            out_slots.data_ptr(),
            table.data_ptr(),
            lens.data_ptr(),
            index_scale,
            mla_scale,
            low,
            None if routed is None else routed.data_ptr(),
            *strides,
        )
        keep = (ids, positions, out_slots, table, lens, hidden, routed)
        args = (ctypes.byref(step), ids.data_ptr(), positions.data_ptr())
        return keep, (*args, None if hidden is None else hidden.data_ptr())

    def __call__(self, ids, positions, out_slots, table, lens, hidden=None, rows=None, routed=None):
        """Token t (`ids[t]` at `positions[t]`; with the NextN input, h row `hidden[t]`)
        attends over its context's slots `table[t, :lens[t]]` (`[T, W]`), its KV goes to
        `out_slots[t]` -> the normed output `[T, hidden]`; with `rows` (the loop has a
        head), also the fp32 logits of those rows of it `[len(rows), vocab]`. `routed`: an
        int32 `[T, layers, top_k]` (`record_routing`'s: the loop's layers in order, top-k
        columns contiguous) that gets each MoE layer's choices, as the per-layer `Ffn`
        writes them (a step recording its routing); a dense layer's rows are left as they
        are."""
        keep, args = self._desc(ids, positions, out_slots, table, lens, hidden, routed)
        out = torch.empty(len(ids), self.hidden)
        logits = None
        if rows is not None:
            if not self.has_head:
                raise ValueError("layer loop: logits need a head")
            rows = _as(rows, torch.int64)
            logits = torch.empty(rows.shape[0], self._io.head_rows)
        bad = _library().dsakv_forward_step(
            self._layers,
            len(self._layers),
            ctypes.byref(self._io),
            *args,
            out.data_ptr(),
            None if rows is None else rows.data_ptr(),
            0 if rows is None else rows.shape[0],
            None if logits is None else logits.data_ptr(),
        )
        if bad:
            raise IndexError(f"layer loop: {bad} ids, positions, rows or slots out of range")
        return out if rows is None else (out, logits)

    def drafts(self, ids, positions, out_slots, table, lens, hidden, rows, want, chain):
        """The MTP layer's catch-up step (as `__call__`), then each request's drafts in a
        chain, as many as `want[r]`: the head's argmax of its row `rows[r]` of the step's
        output, then of its own output over its last draft, at the positions after (their
        slots `chain[r]`, `[n, W]`) -> drafts `[n, max(want)]`, -1 past a request's want."""
        keep, args = self._desc(ids, positions, out_slots, table, lens, hidden)
        rows, want, chain = (_as(a, torch.int64) for a in (rows, want, chain))
        n = rows.shape[0]
        if want.shape != (n,) or chain.shape[0] != n:
            raise ValueError("draft chain: one row, want and chain per request")
        k = int(want.max()) if n else 0
        out = torch.full((n, k), -1, dtype=torch.int64)
        bad = _library().dsakv_draft_chain(
            self._layers,
            len(self._layers),
            ctypes.byref(self._io),
            *args,
            n,
            rows.data_ptr(),
            want.data_ptr(),
            k,
            chain.data_ptr(),
            chain.shape[1],
            out.data_ptr(),
        )
        if bad:
            raise IndexError(f"draft chain: {bad} ids, positions, slots or chains out of range")
        return out
