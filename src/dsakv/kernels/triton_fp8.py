"""Bit-exact e4m3 / bf16 conversions as `@triton.jit` helpers, shared by every dsakv kernel.

Why bit arithmetic instead of `tl.float8e4nv` casts: the Triton interpreter (numpy) has no
fp8 or usable bf16 arithmetic, so the same code must run on CPU under `TRITON_INTERPRET=1`
and on any CUDA device. Everything here works on raw bits loaded as uint8 / int16 / int32
and is exact: decode reproduces `torch.float8_e4m3fn` / `torch.bfloat16` casts bit for bit,
encode reproduces torch's saturating round-to-nearest-even casts on clamped inputs, and the
power-of-two scale rule is the one `dsakv.memory.fp8.quantize_e4m3_blockwise` defines.

Formats (OCP e4m3fn): sign, 4-bit exponent (bias 7), 3-bit mantissa; exponent field 0 is
subnormal (m · 2^-9); 0x7F / 0xFF are NaN; no infinities; largest finite value 448.

The small elementwise wrappers at the bottom exist for tests and for callers that want the
conversions on a tensor; the hot kernels inline the jit helpers.
"""

import torch

from ._triton import cdiv, require_triton, tl, triton

# --- jit helpers (inlined into the kernels that call them) ------------------------------------


@triton.jit
def e4m3_to_f32(b):
    """e4m3fn bit patterns (any integer tensor holding 0..255) -> fp32, exactly."""
    b = b.to(tl.int32) & 0xFF
    e = (b >> 3) & 0xF
    m = b & 0x7
    # Normal: exponent e-7 re-biased to fp32 (e + 120), mantissa in the top 3 bits.
    normal = (((b & 0x7F) << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # m * 2^-9, exact
    mag = tl.where(e == 0, sub, normal)
    mag = tl.where((b & 0x7F) == 0x7F, float("nan"), mag)
    return tl.where(b >= 0x80, -mag, mag)


@triton.jit
def bf16_to_f32(h):
    """bf16 bit patterns (loaded as int16 / uint16) -> fp32: widen and shift left by 16."""
    return ((h.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_bits(x):
    """fp32 -> bf16 bits (int32 in 0..0xFFFF) by round-to-nearest-even, as torch casts
    finite values (NaN payloads are not preserved)."""
    u = x.to(tl.int32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return r & 0xFFFF


@triton.jit
def pow2_exponent(amax):
    """k with 2^k the fp32 block scale for a block whose max |value| is `amax` (fp32 ≥ 0).

    k = ceil(log2(amax / 448)) computed exactly from amax's bits: amax = 1.f · 2^E is
    ≤ 448 · 2^k = 1.75 · 2^(k+8) iff k ≥ E - 8 (+1 when 1.f > 1.75). Equal to the rule on
    the rounded quotient fl(amax/448) (its exponent field, +1 unless its mantissa is zero)
    wherever that quotient is a normal fp32. k = 0 for amax == 0; k ≥ -149 (the smallest
    fp32 power of two). Subnormal amax is normalised through an exact int -> float cast.
    """
    ab = amax.to(tl.int32, bitcast=True)
    is_sub = ((ab >> 23) & 0xFF) == 0
    f = tl.where(is_sub, (ab & 0x7FFFFF).to(tl.float32), amax)
    fb = f.to(tl.int32, bitcast=True)
    k = ((fb >> 23) & 0xFF) - 135 - tl.where(is_sub, 149, 0)
    k = k + tl.where((fb & 0x7FFFFF) > 0x600000, 1, 0)
    k = tl.maximum(k, -149)
    return tl.where(amax == 0.0, 0, k)


@triton.jit
def exp2_int(k):
    """2^k as fp32, exactly, for integer k in [-149, 127] (subnormal below -126)."""
    normal = ((tl.maximum(k, -126) + 127) << 23).to(tl.float32, bitcast=True)
    sub = (1 << tl.minimum(tl.maximum(k + 149, 0), 22)).to(tl.float32, bitcast=True)
    return tl.where(k >= -126, normal, sub)


@triton.jit
def mul_exp2(x, k):
    """x · 2^k exactly for k in [-150, 150]: two multiplies by normal powers of two, so no
    step overflows (2^149 is not an fp32) or rounds (a subnormal only ever grows)."""
    a = k >> 1  # floor(k / 2) on both the interpreter and the GPU
    return x * exp2_int(a) * exp2_int(k - a)


@triton.jit
def f32_to_e4m3(x):
    """fp32 -> e4m3fn bits (int32 in 0..255): clamp to ±448, then round to nearest even,
    with e4m3 subnormals (step 2^-9). Keeps the sign of zero, like torch's cast."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    u = x.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    e = a >> 23
    m = a & 0x7FFFFF
    # Normal e4m3 (|x| ≥ 2^-6, fp32 exponent field ≥ 121): keep 3 mantissa bits, RNE on 20.
    base = ((e - 120) << 3) + (m >> 20)
    rem = m & 0xFFFFF
    up = (rem > 0x80000) | ((rem == 0x80000) & ((base & 1) == 1))
    normal = base + up.to(tl.int32)  # a carry out of the mantissa bumps the exponent
    # Subnormal e4m3: n = RNE(|x| · 2^9) = RNE(full >> (141 - e)); every fp32 subnormal -> 0.
    full = tl.where(e > 0, m | 0x800000, m)
    sh = tl.minimum(141 - e, 25)
    q = full >> sh
    srem = full & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    sup = (srem > half) | ((srem == half) & ((q & 1) == 1))
    sub = q + sup.to(tl.int32)  # n == 8 is 0x08, the smallest normal: still right
    return sign | tl.where(e >= 121, normal, sub)


# --- elementwise wrappers (tests, small conversions) -------------------------------------------

_BLOCK = 1024


@triton.jit
def _decode_e4m3_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, e4m3_to_f32(tl.load(src + offs, mask=mask, other=0)), mask=mask)


@triton.jit
def _encode_e4m3_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src + offs, mask=mask, other=0.0)
    tl.store(dst + offs, f32_to_e4m3(x).to(tl.uint8), mask=mask)


@triton.jit
def _bf16_round_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src + offs, mask=mask, other=0.0)
    tl.store(dst + offs, f32_to_bf16_bits(x).to(tl.int16), mask=mask)


@triton.jit
def _pow2_scale_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    amax = tl.abs(tl.load(src + offs, mask=mask, other=0.0))
    tl.store(dst + offs, exp2_int(pow2_exponent(amax)), mask=mask)


def _launch_elementwise(kernel, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    require_triton()
    n = src.numel()
    if n:
        kernel[(cdiv(n, _BLOCK),)](src, dst, n, BLOCK=_BLOCK)
    return dst


def decode_e4m3(bits: torch.Tensor) -> torch.Tensor:
    """e4m3fn bytes (uint8 or float8_e4m3fn, any shape) -> fp32 via the kernel decoder."""
    src = bits.contiguous().view(torch.uint8)
    return _launch_elementwise(
        _decode_e4m3_kernel, src, torch.empty(src.shape, dtype=torch.float32, device=src.device)
    )


def encode_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 values -> e4m3fn bytes (uint8): saturating (±448) round-to-nearest-even."""
    src = x.contiguous().float()
    return _launch_elementwise(
        _encode_e4m3_kernel, src, torch.empty(src.shape, dtype=torch.uint8, device=src.device)
    )


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 values -> bf16 tensor, rounded by the kernel's bit rule (RNE)."""
    src = x.contiguous().float()
    out = torch.empty(src.shape, dtype=torch.int16, device=src.device)
    return _launch_elementwise(_bf16_round_kernel, src, out).view(torch.bfloat16)


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 block scale 2^ceil(log2(|amax|/448)) (1.0 for 0) per element, by the kernel's rule."""
    src = amax.contiguous().float()
    return _launch_elementwise(_pow2_scale_kernel, src, torch.empty_like(src))


__all__ = [
    "bf16_to_f32",
    "decode_e4m3",
    "e4m3_to_f32",
    "encode_e4m3",
    "exp2_int",
    "f32_to_bf16_bits",
    "f32_to_e4m3",
    "mul_exp2",
    "pow2_exponent",
    "pow2_scale",
    "round_bf16",
]
