// dsakv's native CPU kernels (built on first use by `dsakv.kernels.cpu_native`).
//
// Plain C ABI over raw pointers, loaded with ctypes: no torch headers, so a build takes
// about a second. OpenMP links against the libgomp.so.1 torch has already loaded, so the
// kernels share torch's threads and its thread count.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include <immintrin.h>
#include <omp.h>

namespace {

// Latent row encodings, as `dsakv.memory` stores them (`kind` below), and FP8_BLOCK, the
// packed rows of a block-quantised weight matrix (`Mat`).
enum Kind : int { FP32 = 0, BF16 = 1, E4M3 = 2, DS_MLA = 3, FP8_BLOCK = 4 };

constexpr int64_t kRowsPerBlock = 64;   // rows widened at once (stay in L1/L2)
constexpr int64_t kHeadsPerUnit = 16;   // most heads that share one widening of the rows
constexpr int64_t kScaleBlock = 128;    // fp8_ds_mla: values per fp32 scale

inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

// An e4m3fn byte's fp32 bits, built in integer arithmetic as c10's conversion does, so
// no fp32 subnormal is ever formed and the FPU's flush-to-zero / denormals-are-zero mode
// (`torch.set_flush_denormal`) cannot read a value as 0: a normal value's exponent rebiased
// by 127 - 7; a subnormal one (m · 2^-9, m = 1..7) normalised, its leading bit p into the
// exponent; 0x7f / 0xff NaN. Branch-free (vectorises).
inline uint32_t e4m3_bits(uint32_t b) {
  const uint32_t mag = b & 0x7f, m = b & 7;
  const uint32_t p = (m >= 2) + (m >= 4);
  const uint32_t sub = m ? ((118 + p) << 23) | ((m << (23 - p)) & 0x7fffff) : 0;
  uint32_t r = mag >= 8 ? (mag << 20) + (120u << 23) : sub;
  r = mag == 0x7f ? 0x7fc00000u : r;
  return r | (b & 0x80) << 24;
}

// e4m3fn bytes times `scale` to fp32: each value exact, so the product rounds once.
inline void widen_e4m3_scalar(const uint8_t* src, float* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bits_to_float(e4m3_bits(src[i])) * scale;
}

#if defined(__AVX512VBMI__)
// e4m3 magnitudes 0..127 as bf16 (exact: 3 mantissa bits), high and low bytes; and the
// byte order that makes the in-lane byte interleave below come out in value order.
struct E4m3Tables {
  __m512i hi0, hi1, lo0, lo1, order;
  E4m3Tables() {
    alignas(64) uint8_t hi[128], lo[128], ord[64];
    for (int m = 0; m < 128; ++m) {
      const uint8_t b = uint8_t(m);
      float f;
      widen_e4m3_scalar(&b, &f, 1, 1.0f);
      uint32_t u;
      std::memcpy(&u, &f, sizeof u);
      hi[m] = uint8_t(u >> 24), lo[m] = uint8_t(u >> 16);
    }
    for (int l = 0; l < 4; ++l)  // lane l: unpacklo takes bytes 16l..16l+7, unpackhi the rest
      for (int j = 0; j < 8; ++j) ord[16 * l + j] = 8 * l + j, ord[16 * l + 8 + j] = 32 + 8 * l + j;
    hi0 = _mm512_load_si512(hi), hi1 = _mm512_load_si512(hi + 64);
    lo0 = _mm512_load_si512(lo), lo1 = _mm512_load_si512(lo + 64);
    order = _mm512_load_si512(ord);
  }
};
#endif

// e4m3fn bytes times `scale` to fp32 (the values `widen_e4m3_scalar` gives): with
// AVX512-VBMI, 64 bytes at a time through a 128-entry bf16 table in registers (the
// arithmetic form, vectorised by the compiler, ran at a quarter of the speed).
inline void widen_e4m3(const uint8_t* src, float* dst, int64_t n, float scale) {
  int64_t i = 0;
#if defined(__AVX512VBMI__)
  static const E4m3Tables t;
  const __m512i m7f = _mm512_set1_epi8(0x7f), m80 = _mm512_set1_epi8(char(0x80));
  const __m512 sc = _mm512_set1_ps(scale);
  for (; i + 64 <= n; i += 64) {
    const __m512i b = _mm512_permutexvar_epi8(t.order, _mm512_loadu_si512(src + i));
    const __m512i mag = _mm512_and_si512(b, m7f);
    const __m512i lo = _mm512_permutex2var_epi8(t.lo0, mag, t.lo1);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, mag, t.hi1), b,
                                                 m80, 0xf8);  // hi | (b & 0x80): the sign
    const __m512i w[2] = {_mm512_unpacklo_epi8(lo, hi), _mm512_unpackhi_epi8(lo, hi)};
    for (int h = 0; h < 4; ++h) {
      const __m256i q = h % 2 ? _mm512_extracti64x4_epi64(w[h / 2], 1) : _mm512_castsi512_si256(w[h / 2]);
      const __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(q), 16));
      _mm512_storeu_ps(dst + i + 16 * h, scale == 1.0f ? f : _mm512_mul_ps(f, sc));
    }
  }
#endif
  widen_e4m3_scalar(src + i, dst + i, n - i, scale);
}

inline void widen_bf16(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bits_to_float(uint32_t(src[i]) << 16);
}

// One stored row -> fp32 [lora + rope].
inline void widen_row(const uint8_t* row, int kind, int64_t lora, int64_t rope, float* out) {
  const int64_t d = lora + rope;
  switch (kind) {
    case FP32:
      std::memcpy(out, row, d * sizeof(float));
      break;
    case BF16:
      widen_bf16(reinterpret_cast<const uint16_t*>(row), out, d);
      break;
    case E4M3:
      widen_e4m3(row, out, d, 1.0f);
      break;
    default: {  // DS_MLA: lora e4m3 bytes, one fp32 scale per 128, then rope bf16 values
      const int64_t nb = (lora + kScaleBlock - 1) / kScaleBlock;
      float scales[64];
      std::memcpy(scales, row + lora, nb * sizeof(float));
      for (int64_t k = 0; k < nb; ++k) {
        const int64_t a = k * kScaleBlock, n = std::min(kScaleBlock, lora - a);
        widen_e4m3(row + a, out + a, n, scales[k]);
      }
      widen_bf16(reinterpret_cast<const uint16_t*>(row + lora + 4 * nb), out + lora, rope);
    }
  }
}

inline uint32_t float_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// fp32 -> e4m3fn byte as the pool encodes (`clamp(-448, 448)`, then torch's cast): round to
// nearest even, ±inf saturate to ±448, NaN -> 0x7f with its sign.
inline uint8_t e4m3_from_float(float f) {
  const uint32_t u = float_bits(f);
  const uint8_t sign = (u >> 24) & 0x80;
  const uint32_t mag = u & 0x7fffffff;
  if (mag > 0x7f800000) return sign | 0x7f;
  const float a = std::min(bits_to_float(mag), 448.0f);
  if (a >= 0x1p-6f) {  // normal: round the mantissa to 3 bits, rebias the exponent by 120
    uint32_t b = float_bits(a);
    b += 0x7ffff + ((b >> 20) & 1);
    return sign | uint8_t((b >> 20) - (120 << 3));
  }
  return sign | uint8_t(std::nearbyint(a * 512.0f));  // subnormal: m · 2^-9, m in 0..8
}

// fp32 -> bf16 bits, round to nearest even (finite values as torch's cast).
inline uint16_t bf16_from_float(float f) {
  const uint32_t u = float_bits(f);
  if (std::isnan(f)) return 0x7fc0;
  return uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

// fp32 rounded to the nearest bf16 (ties to even), as an fp32: torch's `.to(bfloat16)`.
inline float round_bf16(float f) {
  if (std::isnan(f)) return f;
  const uint32_t u = float_bits(f);
  return bits_to_float((u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000u);
}

// `dsakv.memory.fp8.pow2_block_scale`: 2^k, k = e - 9 + (m > 0.875) for amax = m · 2^e
// (frexp), 1 where amax is not > 0; k >= -149.
inline float pow2_block_scale(float amax) {
  int e = 0;
  const float m = std::frexp(amax, &e);
  int k = amax > 0 ? e - 9 + (m > 0.875f) : 0;
  k = std::max(k, -149);
  if (k >= -126) return bits_to_float(uint32_t(k + 127) << 23);
  return bits_to_float(uint32_t(1) << (k + 149));
}

// `quantize_e4m3_blockwise` of one row: e4m3 bytes `q[d]`, one fp32 scale per 128 values.
inline void quantize_row(const float* x, int64_t d, uint8_t* q, float* scales) {
  for (int64_t a = 0, k = 0; a < d; a += kScaleBlock, ++k) {
    const int64_t n = std::min(kScaleBlock, d - a);
    float amax = 0.0f;
    bool nan = false;
    for (int64_t i = 0; i < n; ++i) {
      nan |= std::isnan(x[a + i]);
      amax = std::max(amax, std::fabs(x[a + i]));
    }
    const float s = pow2_block_scale(nan ? NAN : amax);  // torch's amax propagates NaN
    scales[k] = s;
    for (int64_t i = 0; i < n; ++i) q[a + i] = e4m3_from_float(x[a + i] / s);
  }
}

// Slots outside [0, n_rows): the store writes nothing and returns their count.
inline int64_t count_bad(const int64_t* slots, int64_t n, int64_t n_rows) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad += slots[i] < 0 || slots[i] >= n_rows;
  return bad;
}



// --- one-token decode blocks ------------------------------------------------------------
//
// A decode step of a few tokens is bound by reading each layer's weights once, not by
// arithmetic: the blocks below stream every weight matrix once for all B tokens, each
// phase of a block split over the threads by output rows, with no copy between phases.
// A matrix is fp32, bf16 or FP8 blocks as the checkpoint stores it (`Mat`): bf16 is read in
// place and widened in registers (exact), FP8 blocks widened a few rows at a time into
// cache; every sum in fp32 in the same order, so a matrix gives the bits its fp32 widening
// at load gives, for half (a quarter) of the bytes read.

typedef float v16 __attribute__((vector_size(64)));  // one AVX-512 register (two AVX2)
typedef uint16_t bf16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// 16 bf16 values widened to fp32: each one's bits shifted into the top half (one
// zero-extending load and a shift; GCC splits the generic vector conversion in four).
inline v16 load16(const uint16_t* p) {
#if defined(__AVX512F__)
  const __m512i w = _mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  v16 v;
  std::memcpy(&v, &w, sizeof v);
  return v;
#else
  bf16x16 h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<v16>(__builtin_convertvector(h, u32x16) << 16);
#endif
}

inline float widen(float f) { return f; }
inline float widen(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

// s + a · b rounded once where the CPU has FMA, as the compiler contracts it for fp32
// operands: the scalar tails say so explicitly, so a widened bf16 operand (which it does
// not contract) sums exactly as its fp32 widening does.
inline float madd(float a, float b, float s) {
#ifdef __FMA__
  return std::fma(a, b, s);
#else
  return s + a * b;
#endif
}

// A weight matrix (row-major rows of K values): fp32 or bf16 (`kind` FP32 / BF16), or
// FP8_BLOCK: each row its K e4m3 bytes, then the fp32 scales of its 128-value blocks
// (`torch_ops.pack_fp8`), so a slice of rows carries its own scales.
struct Mat {
  const void* p;
  int64_t kind;
};

inline int64_t fp8_row_bytes(int64_t K) { return K + 4 * ((K + kScaleBlock - 1) / kScaleBlock); }

// The scale of value k of a packed FP8_BLOCK row of K values.
inline float fp8_scale(const uint8_t* row, int64_t K, int64_t k) {
  float s;
  std::memcpy(&s, row + K + 4 * (k / kScaleBlock), sizeof s);
  return s;
}

inline v16 load16_e4m3(const uint8_t* p, float scale);
inline void store16(float* p, v16 v);

// A packed FP8_BLOCK row -> its K fp32 values (each value × its block's scale).
inline void widen_fp8_row(const uint8_t* row, int64_t K, float* out) {
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) store16(out + k, load16_e4m3(row + k, fp8_scale(row, K, k)));
  for (; k < K; ++k) widen_e4m3(row + k, out + k, 1, fp8_scale(row, K, k));
}

// f(rows [r0, r0 + n) of m, typed as stored): one switch, then a kernel templated on the
// element type. fp32 and bf16 rows are read in place; FP8_BLOCK rows are widened first into
// this thread's buffer (a few rows at a time, so they stay in cache), each value times its
// scale in fp32: the bits the loader's dequantisation gives, from a quarter of the bytes.
template <class F>
inline void visit(Mat m, int64_t r0, int64_t n, int64_t K, F&& f) {
  if (m.kind == BF16) return f(static_cast<const uint16_t*>(m.p) + r0 * K);
  if (m.kind == FP32) return f(static_cast<const float*>(m.p) + r0 * K);
  thread_local std::vector<float> rows;
  if (rows.size() < size_t(n * K)) rows.resize(n * K);
  const int64_t rb = fp8_row_bytes(K);
  for (int64_t i = 0; i < n; ++i)
    widen_fp8_row(static_cast<const uint8_t*>(m.p) + (r0 + i) * rb, K, rows.data() + i * K);
  f(static_cast<const float*>(rows.data()));
}

inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

// The 16 lanes summed as a tree (halves added, then their halves, ...): four dependent adds
// instead of sixteen, in one fixed order every kernel shares.
inline float hsum(v16 v) {
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// a · b: one 16-lane FMA chain, the lanes summed (`hsum`), then the tail; exactly what
// `dots_of` computes for each of its rows, so a row's value never depends on its grouping.
template <class T>
inline float dot(const T* a, const float* b, int64_t n) {
  v16 acc = {};
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) acc += load16(a + k) * load16(b + k);
  float s = hsum(acc);
  for (; k < n; ++k) s = madd(widen(a[k]), b[k], s);
  return s;
}

typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

// 16 bytes zero-extended to 32-bit lanes (GCC scalarises the generic vector conversion).
inline u32x16 widen_bytes(const uint8_t* p) {
  const __m128i* src = reinterpret_cast<const __m128i*>(p);
  u32x16 r;
#if defined(__AVX512F__)
  const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(src));
  std::memcpy(&r, &w, sizeof r);
#elif defined(__AVX2__)
  const __m128i b = _mm_loadu_si128(src);
  const __m256i lo = _mm256_cvtepu8_epi32(b), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
  std::memcpy(&r, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<char*>(&r) + sizeof lo, &hi, sizeof hi);
#else
  u8x16 b;
  std::memcpy(&b, p, sizeof b);
  r = __builtin_convertvector(b, u32x16);
#endif
  return r;
}

// 16 e4m3 bytes times their block's scale, in registers: the values `widen_e4m3` writes
// (`e4m3_bits` lane by lane: integer ops only, whatever the FPU's denormal mode).
inline v16 load16_e4m3(const uint8_t* p, float scale) {
  const u32x16 u = widen_bytes(p);
  const u32x16 mag = u & 0x7f, m = u & 7;
  const u32x16 lead = -reinterpret_cast<u32x16>(m >= 2) - reinterpret_cast<u32x16>(m >= 4);
  const u32x16 sub = ((118 + lead) << 23) | ((m << (23 - lead)) & 0x7fffff);
  u32x16 r = reinterpret_cast<u32x16>(m != 0) & sub;  // (comparisons: lanes of 0 / ~0)
  r = reinterpret_cast<u32x16>(mag >= 8) ? (mag << 20) + (120u << 23) : r;
  r = reinterpret_cast<u32x16>(mag == 0x7f) ? u32x16{} + 0x7fc00000u : r;
  return reinterpret_cast<v16>(r | (u & 0x80) << 24) * scale;
}

// The weight GEMVs' one summation order, for a row of K weights times an input x: 16-lane
// FMA chains over the row's 16-value blocks (block i into chain i mod C, C = `chains(K)`),
// the chains added in order, the lanes summed (`hsum`), then the tail value by value.
// `row_dots` computes it for R rows (`load(i, k)`: row i's 16 weights from k widened to
// fp32; `at(i, k)`: one) times TB inputs x + t · ldx -> y[t · ldy + i]; R and TB only
// share loaded vectors between outputs, so an output depends on its row and its token
// alone (batch-invariant), and not on how the weights are stored. Several chains keep a
// long row (W_uv's 512) from waiting on one chain's latency.
constexpr int chains(int64_t K) { return K >= 512 ? 4 : K >= 256 ? 2 : 1; }

template <int TB, int R, int C, class Load, class At>
inline void row_dots(Load load, At at, int64_t K, const float* x, int64_t ldx, float* y,
                     int64_t ldy) {
  v16 acc[TB][R][C] = {};
  auto step = [&](int c, int64_t k) {
    v16 w[R];
    for (int i = 0; i < R; ++i) w[i] = load(i, k);
    for (int t = 0; t < TB; ++t) {
      const v16 xv = load16(x + t * ldx + k);
      for (int i = 0; i < R; ++i) acc[t][i][c] += w[i] * xv;
    }
  };
  int64_t k = 0;
  for (; k + 16 * C <= K; k += 16 * C)
    for (int c = 0; c < C; ++c) step(c, k + 16 * c);
  for (int c = 0; k + 16 <= K; k += 16, ++c) step(c, k);  // the last blocks, fewer than C
  for (int t = 0; t < TB; ++t)
    for (int i = 0; i < R; ++i) {
      v16 a = acc[t][i][0];
      for (int c = 1; c < C; ++c) a += acc[t][i][c];
      float s = hsum(a);
      for (int64_t j = k; j < K; ++j) s = madd(at(i, j), x[t * ldx + j], s);
      y[t * ldy + i] = s;
    }
}

// `row_dots` with C = chains(K); R · C <= 4 (16 accumulators at TB = 4).
template <int TB, int R, class Load, class At>
inline void dots(Load load, At at, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy) {
  const int c = chains(K);
  if constexpr (R == 1)
    if (c == 4) return row_dots<TB, 1, 4>(load, at, K, x, ldx, y, ldy);
  if constexpr (R <= 2)
    if (c == 2) return row_dots<TB, R, 2>(load, at, K, x, ldx, y, ldy);
  row_dots<TB, R, 1>(load, at, K, x, ldx, y, ldy);
}

// Rows w, w + K, ... (R of them, fp32 or bf16 read in place) times TB inputs.
template <int TB, int R, class T>
inline void tile(const T* w, int64_t K, const float* x, int64_t ldx, float* y, int64_t ldy) {
  dots<TB, R>([w, K](int i, int64_t k) { return load16(w + i * K + k); },
              [w, K](int i, int64_t k) { return widen(w[i * K + k]); }, K, x, ldx, y, ldy);
}

// Dots of N (<= 4) rows a, a + lda, ... with b (n values each): N independent FMA chains,
// each summed as `dot` sums one row.
template <int N>
inline void dots_of(const float* a, int64_t lda, const float* b, int64_t n, float* out) {
  v16 acc[N] = {};
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const v16 bv = load16(b + k);
    for (int i = 0; i < N; ++i) acc[i] += load16(a + i * lda + k) * bv;
  }
  for (int i = 0; i < N; ++i) {
    float s = hsum(acc[i]);
    for (int64_t j = k; j < n; ++j) s = madd(a[i * lda + j], b[j], s);
    out[i] = s;
  }
}

// `dots_of` for m (<= 4) rows.
inline void dots_upto4(const float* a, int64_t lda, const float* b, int64_t n, int64_t m,
                       float* out) {
  switch (m) {
    case 4: return dots_of<4>(a, lda, b, n, out);
    case 3: return dots_of<3>(a, lda, b, n, out);
    case 2: return dots_of<2>(a, lda, b, n, out);
    default: return dots_of<1>(a, lda, b, n, out);
  }
}

// For each of `nh` (<= 4) heads: acc[h][c] += Σ_i p[h][i] · rows[i][c] over c < n, the rows
// added one after another in order (one FMA each). 32 columns of every head at a time stay
// in registers over all m rows (eight independent chains), so a row's values are loaded
// once for all the heads and the sums are stored once. A head's sums depend neither on nh
// nor on m.
// Columns [c, c + 16 · S) of every head, held in registers over all m rows.
template <int NH, int S>
inline void axpy_strip(const float* const* rows, const float* const* p, int64_t m, int64_t c,
                       float* const* acc) {
  v16 a[NH][S];
  for (int h = 0; h < NH; ++h)
    for (int s = 0; s < S; ++s) a[h][s] = load16(acc[h] + c + 16 * s);
  for (int64_t i = 0; i < m; ++i) {
    v16 x[S];
    for (int s = 0; s < S; ++s) x[s] = load16(rows[i] + c + 16 * s);
    for (int h = 0; h < NH; ++h) {
      const float pi = p[h][i];
      for (int s = 0; s < S; ++s) a[h][s] += pi * x[s];
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int s = 0; s < S; ++s) store16(acc[h] + c + 16 * s, a[h][s]);
}

template <int NH>
inline void axpy_rows_of(const float* const* rows, const float* const* p, int64_t m, int64_t n,
                         float* const* acc) {
  int64_t c = 0;
  for (; c + 32 <= n; c += 32) axpy_strip<NH, 2>(rows, p, m, c, acc);
  if (c + 16 <= n) axpy_strip<NH, 1>(rows, p, m, c, acc), c += 16;
  for (; c < n; ++c)
    for (int h = 0; h < NH; ++h) {
      float a = acc[h][c];
      for (int64_t i = 0; i < m; ++i) a = madd(p[h][i], rows[i][c], a);
      acc[h][c] = a;
    }
}

inline void axpy_rows(const float* const* rows, const float* const* p, int64_t nh, int64_t m,
                      int64_t n, float* const* acc) {
  switch (nh) {
    case 4: return axpy_rows_of<4>(rows, p, m, n, acc);
    case 3: return axpy_rows_of<3>(rows, p, m, n, acc);
    case 2: return axpy_rows_of<2>(rows, p, m, n, acc);
    default: return axpy_rows_of<1>(rows, p, m, n, acc);
  }
}

#ifdef __AVX512F__
constexpr int kTileTokens = 4;
#else
constexpr int kTileTokens = 2;
#endif

// y[b · ldy + n] = W[n] · x[b] for rows n in [n0, n1) of W[N, K] (row-major) and B
// inputs x[b] = x + b · ldx: `kTileTokens` tokens at a time over the rows (the rows stay
// in cache while the next tokens pass), the last tokens one at a time. A few tokens read
// one row at a time, front to back: with four rows read side by side the hardware
// prefetchers lost the stream and an fp32 GEMV from memory ran at half the bandwidth. With
// `side_by_side` (a batch of 8 or more over bf16 rows, or over rows already widened into
// cache) the GEMV is bound by arithmetic instead, and each input vector serves up to four
// rows (+9% decode at 32 requests on bf16; -6% on fp32 rows streamed from memory). An
// output's value depends on its row and its token alone.
template <class T>
inline void gemv(const T* W, int64_t K, const float* x, int64_t ldx, int64_t B, float* y,
                 int64_t ldy, int64_t n0, int64_t n1, bool side_by_side = false) {
  const int rows = side_by_side && B >= 2 * kTileTokens ? 4 / chains(K) : 1;
  int64_t b = 0;
  for (; b + kTileTokens <= B; b += kTileTokens) {
    const float* xb = x + b * ldx;
    float* yb = y + b * ldy;
    int64_t n = n0;
    if (rows == 4)
      for (; n + 4 <= n1; n += 4) tile<kTileTokens, 4>(W + n * K, K, xb, ldx, yb + n, ldy);
    if (rows == 2)
      for (; n + 2 <= n1; n += 2) tile<kTileTokens, 2>(W + n * K, K, xb, ldx, yb + n, ldy);
    for (; n < n1; ++n) tile<kTileTokens, 1>(W + n * K, K, xb, ldx, yb + n, ldy);
  }
  for (; b < B; ++b)
    for (int64_t n = n0; n < n1; ++n) tile<1, 1>(W + n * K, K, x + b * ldx, ldx, y + b * ldy + n, ldy);
}

// y = W x for every input, W[N, K], split over the team (inside a parallel region):
// blocks of 16 rows, static schedule, then a barrier unless `wait` is false (the next
// phase reads none of y: two independent GEMVs share one barrier).
inline void gemv_team(Mat W, int64_t K, const float* x, int64_t ldx, int64_t B, float* y,
                      int64_t ldy, int64_t N, bool wait = true) {
  const int64_t blocks = (N + 15) / 16;
#pragma omp for schedule(static) nowait
  for (int64_t i = 0; i < blocks; ++i) {
    const int64_t r0 = i * 16, n = std::min<int64_t>(16, N - r0);
    visit(W, r0, n, K, [&](auto w) { gemv(w, K, x, ldx, B, y + r0, ldy, 0, n, W.kind != FP32); });
  }
  if (wait) {
#pragma omp barrier
  }
}

inline Mat fp32(const float* p) { return {p, FP32}; }

// torch's F.rms_norm in fp32: x · rsqrt(mean(x²) + eps) · w.
inline void rms_norm(const float* x, const float* w, int64_t n, float eps, float* y) {
  float ss = dot(x, x, n);
  const float r = 1.0f / std::sqrt(ss / float(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * r * w[i];
}

// `rope_interleaved`: pairs (x[2i], x[2i+1]) rotated by (cos[i], sin[i]), written as
// (rotated evens ‖ rotated odds).
inline void rope_interleaved(const float* x, const float* cos, const float* sin, int64_t rope,
                             float* y) {
  const int64_t half = rope / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[2 * i], b = x[2 * i + 1];
    y[i] = a * cos[i] - b * sin[i];
    y[half + i] = b * cos[i] + a * sin[i];
  }
}

// `rope_half`: pairs (x[i], x[half + i]), written in place of x's first `rope` values.
inline void rope_half(const float* x, const float* cos, const float* sin, int64_t rope,
                      float* y) {
  const int64_t half = rope / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[half + i];
    y[i] = a * cos[i] - b * sin[i];
    y[half + i] = b * cos[i] + a * sin[i];
  }
}

// The indexer's weights (row-major as the modules hold them; the vectors and weights_proj
// fp32). `hadamard` ([dim, dim], symmetric) rotates the queries as the fp8 keys are stored;
// null: no rotation.
struct IndexerWeights {
  Mat wq_b, wk;
  const float *k_norm_w, *k_norm_b, *weights_proj, *hadamard;
  int64_t hidden, q_lora, heads, dim, rope, interleave;
  float eps, w_scale;
};

inline void rope_part(const IndexerWeights& w, const float* x, const float* cos,
                      const float* sin, float* y) {
  if (w.interleave)
    rope_interleaved(x, cos, sin, w.rope, y);
  else
    rope_half(x, cos, sin, w.rope, y);
}

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

// A scratch buffer of the calling thread (engines in threads of one process each get their
// own), shared with the team the call forks.
inline float* scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// The weights of `MLAttention.project` (with the input norm before it), row-major as the
// modules hold them (the norms fp32); `w_uk`'s rows h · uk_head_rows on are head h's
// [nope, kv_lora] block.
struct MlaInputsWeights {
  const float *in_norm, *q_a_norm, *kv_norm;
  Mat q_a, q_b, kv_a, w_uk;
  int64_t hidden, q_lora, heads, nope, rope, kv_lora, uk_head_rows;
  float eps_in, eps_q, eps_kv;
};

// The weights after attention: o_proj, the post-attention norm, then either a dense MLP
// (router null) or the router, the stacked routed experts and the shared experts (`mlp_*`).
// The norm and the router fp32, the matrices as the modules hold them.
struct FfnWeights {
  Mat o_proj;
  const float* post_norm;
  int64_t hidden, attn_dim;
  float eps;
  const float *router, *router_bias;
  int64_t n_experts, top_k, n_group, topk_group, norm_topk;
  float scaling;
  Mat gate_up, down;  // [E, 2I, hidden] (gate rows first), [E, hidden, I]
  int64_t inter;
  Mat mlp_gate, mlp_up, mlp_down;  // [Is, hidden], [Is, hidden], [hidden, Is]
  int64_t mlp_inter;
  int64_t first_expert;  // gate_up / down hold experts first_expert .. (--ep: a rank's)
  int64_t held_experts;  // (a token's choices outside them add nothing here)
};

// `Router.forward` for one token: sigmoid scores, the group-limited choice by score + bias,
// top-k (ties to the lower expert), weights from the scores, normalised, scaled.
inline void route(const FfnWeights& w, const float* logits, int64_t* ids, float* weights) {
  const int64_t E = w.n_experts;
  std::vector<float> score(E), choice(E);
  for (int64_t e = 0; e < E; ++e) {
    score[e] = 1.0f / (1.0f + std::exp(-logits[e]));
    choice[e] = score[e] + w.router_bias[e];
  }
  if (w.n_group > 1) {
    const int64_t per = E / w.n_group;
    std::vector<float> gs(w.n_group);
    for (int64_t g = 0; g < w.n_group; ++g) {
      float a = -INFINITY, b = -INFINITY;  // the group's two largest
      for (int64_t e = g * per; e < (g + 1) * per; ++e) {
        const float c = choice[e];
        if (c > a) b = a, a = c;
        else if (c > b) b = c;
      }
      gs[g] = a + b;
    }
    std::vector<bool> keep(w.n_group, false);
    for (int64_t t = 0; t < w.topk_group; ++t) {
      int64_t best = -1;
      for (int64_t g = 0; g < w.n_group; ++g)
        if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g;
      keep[best] = true;
    }
    for (int64_t e = 0; e < E; ++e)
      if (!keep[e / per]) choice[e] = -INFINITY;
  }
  std::vector<bool> taken(E, false);
  float sum = 0.0f;
  for (int64_t t = 0; t < w.top_k; ++t) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e)
      if (!taken[e] && (best < 0 || choice[e] > choice[best])) best = e;
    taken[best] = true;
    ids[t] = best;
    weights[t] = score[best];
    sum += score[best];
  }
  for (int64_t t = 0; t < w.top_k; ++t)
    weights[t] = (w.norm_topk ? weights[t] / (sum + 1e-20f) : weights[t]) * w.scaling;
}

// The absorbed query of one head for nb tokens: o[t · ldo + c] = Σ_d q[t · ldq + d] ·
// uk[d · KL + c], d = 0 .. nope-1 in order (one FMA chain per output from 0). The head's
// W_uk rows are read once, each front to back, the sums held in o (in cache): reading
// 64-column strips of every row instead (sums in registers) left the prefetchers behind.
// An output's chain is the same whatever nb is: batch-invariant.
constexpr int64_t kUkTokens = 4;

template <int NB, class T>
inline void absorb(const T* uk, int64_t nope, int64_t KL, const float* q, int64_t ldq, float* o,
                   int64_t ldo) {
  for (int t = 0; t < NB; ++t) std::fill(o + t * ldo, o + t * ldo + KL, 0.0f);
  for (int64_t d = 0; d < nope; ++d) {
    const T* wr = uk + d * KL;
    float qd[NB];
    for (int t = 0; t < NB; ++t) qd[t] = q[t * ldq + d];
    int64_t c = 0;
    for (; c + 16 <= KL; c += 16) {
      const v16 w = load16(wr + c);
      for (int t = 0; t < NB; ++t) {
        v16 a = load16(o + t * ldo + c);
        a += qd[t] * w;
        store16(o + t * ldo + c, a);
      }
    }
    for (; c < KL; ++c)
      for (int t = 0; t < NB; ++t) o[t * ldo + c] = madd(qd[t], widen(wr[c]), o[t * ldo + c]);
  }
}

constexpr int64_t kQueriesPerTile = 8;  // most queries sharing one widening of the rows

// `dsakv_mla_decode`'s tiles: runs of consecutive queries (at most kQueriesPerTile) that
// read the same stored row wherever two of them read position j, so each block of rows
// is widened once for all of them: a prefill chunk's queries (lds 0: one shared slot
// list), an MTP verification's rows of one request over a dense selection. first[i] is
// tile i's first query (then B); with per-query lists (lds > 0), merged[i · K + j] the
// slot tile i reads at position j (-1 where none of its queries does). A query reads
// exactly its own rows in its own order either way: the tiling changes no bits. At most
// `cap` queries a tile.
inline int64_t query_tiles(const int64_t* slots, int64_t lds, const bool* valid, int64_t B,
                           int64_t K, int64_t cap, std::vector<int64_t>& first,
                           std::vector<int64_t>& merged) {
  first.clear();
  if (!lds) {
    for (int64_t b = 0; b < B; b += cap) first.push_back(b);
    first.push_back(B);
    return int64_t(first.size()) - 1;
  }
  merged.assign(B * K, -1);
  int64_t* m = merged.data();
  for (int64_t b = 0, size = 0; b < B; ++b) {
    const int64_t* sl = slots + b * lds;
    const bool* ok = valid + b * K;
    bool fits = size > 0 && size < cap;
    for (int64_t j = 0; fits && j < K; ++j) fits = !ok[j] || m[j] < 0 || m[j] == sl[j];
    if (!fits) {  // a new tile from b
      if (size) m += K;
      first.push_back(b), size = 0;
    }
    for (int64_t j = 0; j < K; ++j)
      if (ok[j]) m[j] = sl[j];
    ++size;
  }
  first.push_back(B);
  return int64_t(first.size()) - 1;
}

}  // namespace

extern "C" {

// Absorbed sparse MLA decode, every request of the step at once, reading the stored rows
// in place (no fp32 copy of the gathered context):
//   queries q_nope[B, H, lora] (contiguous) and q_rope[B, H, rope] (strides rope_sb,
//   rope_sh), rows `data + slots[b · lds + j] * row_bytes` of encoding `kind` (lds 0: every
//   query reads one slot list, a prefill chunk's context), valid[B, K] ->
//   o[b, h] = softmax_j(scale · q_h · row_j) · row_j[:lora]; then, with w_uv (rows of
//   `lora` values, `v` of them per head, heads `w_sh` rows apart; `w_uv_kind` as `Mat`),
//   out[B, H, v] = W_uv[h] · o[b, h], else out[B, H, lora] = o. (`w_uv_kind` last and
//   defaulted: callers with an fp32 W_uv pass nothing.)
// The K rows split into runs of 128 from the first (flash decoding): work units are
// (tile of queries; run; group of <= 16 heads, fewer when there are fewer units than
// threads), each an online softmax per query over its run in blocks of 64 rows; a tile
// (`query_tiles`) widens each block of rows once for up to 8 queries, fewer when that
// leaves too few units to balance the threads; then each (request, head) merges its runs
// in order and applies W_uv. Runs and blocks start at fixed offsets and invalid rows
// change no sum, so a request whose valid rows come first gets the same output whatever
// K its batch was padded to, whatever the batch and whatever the thread count.
// Returns the number of valid slots outside [0, n_rows) (skipped; the caller raises).
int64_t dsakv_mla_decode(const float* q_nope, const float* q_rope, int64_t rope_sb,
                         int64_t rope_sh, const uint8_t* data, int64_t n_rows,
                         int64_t row_bytes, int kind, const int64_t* slots, int64_t lds,
                         const bool* valid, int64_t B, int64_t K, int64_t H, int64_t lora,
                         int64_t rope, float scale, const void* w_uv, int64_t w_sh, int64_t v,
                         float* out, int w_uv_kind = FP32) {
  constexpr int64_t kRowsPerRun = 2 * kRowsPerBlock;
  const int64_t d = lora + rope;
  const int64_t runs = std::max<int64_t>(1, (K + kRowsPerRun - 1) / kRowsPerRun);
  const int64_t threads = omp_get_max_threads();
  std::vector<int64_t> first, merged;
  int64_t tiles = query_tiles(slots, lds, valid, B, K, kQueriesPerTile, first, merged);
  // Smaller tiles where there are too few units for the threads to share evenly (runs of
  // unequal length, or fewer tiles than threads): an MTP verification of 4 rows over 176
  // (runs of 128 and 48 rows) as two tiles of two took a quarter less time on 2 threads
  // than as one tile.
  if (threads > 1 && tiles * runs < 2 * threads && (runs > 1 || tiles < threads)) {
    const int64_t cap = std::clamp<int64_t>(B * runs / (2 * threads), 1, kQueriesPerTile);
    tiles = query_tiles(slots, lds, valid, B, K, cap, first, merged);
  }
  const int64_t* tile_slots = lds ? merged.data() : slots;
  const int64_t tile_ld = lds ? K : 0;
  const int64_t want =
      std::min(H, std::max<int64_t>(1, (threads + tiles * runs - 1) / (tiles * runs)));
  const int64_t per_unit = std::min(kHeadsPerUnit, (H + want - 1) / want);
  const int64_t groups = (H + per_unit - 1) / per_unit;
  const int64_t width = w_uv ? v : lora;
  const int64_t part = lora + 2;  // a run's state per head: unnormalised sum, max, total
  float* parts = scratch(B * H * runs * part);
  int64_t bad = 0;
#pragma omp parallel reduction(+ : bad)
  {
    thread_local std::vector<float> rows_buf;  // (not zeroed: only widened rows are read)
    if (rows_buf.size() < size_t(kRowsPerBlock * d)) rows_buf.resize(kRowsPerBlock * d);
    float* rows = rows_buf.data();
    uint8_t oks[kQueriesPerTile * kRowsPerBlock];
    float sc[4][kRowsPerBlock];
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < tiles * runs * groups; ++unit) {
      const int64_t tile = unit / (runs * groups), r = unit / groups % runs;
      const int64_t b0 = first[tile], nq = first[tile + 1] - b0;
      const int64_t h0 = (unit % groups) * per_unit, nh = std::min(per_unit, H - h0);
      for (int64_t t = 0; t < nq; ++t)
        for (int64_t h = 0; h < nh; ++h) {  // each head's state: acc[lora], then m, l
          float* st = parts + (((b0 + t) * H + h0 + h) * runs + r) * part;
          std::fill(st, st + lora, 0.0f);
          st[lora] = -INFINITY, st[lora + 1] = 0.0f;
        }
      const int64_t end = std::min(K, (r + 1) * kRowsPerRun);
      for (int64_t j0 = r * kRowsPerRun; j0 < end; j0 += kRowsPerBlock) {
        const int64_t n = std::min(kRowsPerBlock, end - j0);
        bool any[kRowsPerBlock] = {};
        for (int64_t t = 0; t < nq; ++t) {
          const int64_t* sl = slots + (b0 + t) * lds + j0;
          uint8_t* ok = &oks[t * kRowsPerBlock];
          for (int64_t j = 0; j < n; ++j) {
            ok[j] = valid[(b0 + t) * K + j0 + j];
            if (ok[j] && (sl[j] < 0 || sl[j] >= n_rows)) ok[j] = false, ++bad;
            any[j] |= ok[j];
          }
        }
        const int64_t* sl = tile_slots + tile * tile_ld + j0;
        for (int64_t j = 0; j < n; ++j)
          if (any[j]) widen_row(data + sl[j] * row_bytes, kind, lora, rope, &rows[j * d]);
        for (int64_t t = 0; t < nq; ++t) {  // each query exactly as if it were alone
          const int64_t b = b0 + t;
          const uint8_t* ok = &oks[t * kRowsPerBlock];
          const float* lat[kRowsPerBlock];  // its valid rows in order, and their rope parts
          const float* pe[kRowsPerBlock];
          int64_t nv = 0;
          for (int64_t j = 0; j < n; ++j)
            if (ok[j]) lat[nv] = &rows[j * d], pe[nv] = lat[nv] + lora, ++nv;
          if (!nv) continue;  // nothing valid in this block
          for (int64_t h1 = 0; h1 < nh; h1 += 4) {  // four heads share each row's loads
            const int64_t hn = std::min<int64_t>(4, nh - h1), h = h0 + h1;
            const float* qn = q_nope + (b * H + h) * lora;
            const float* qr = q_rope + b * rope_sb + h * rope_sh;
            for (int64_t i = 0; i < nv; ++i) {
              float dn[4], dr[4];
              dots_upto4(qn, lora, lat[i], lora, hn, dn);
              dots_upto4(qr, rope_sh, pe[i], rope, hn, dr);
              for (int64_t k = 0; k < hn; ++k) sc[k][i] = (dn[k] + dr[k]) * scale;
            }
            float* acc[4];
            const float* ps[4];
            for (int64_t k = 0; k < hn; ++k) {
              float* ah = parts + ((b * H + h + k) * runs + r) * part;
              float &m = ah[lora], &l = ah[lora + 1];
              float top = m;
              for (int64_t i = 0; i < nv; ++i) top = std::max(top, sc[k][i]);
              if (top != m) {
                const float c = std::exp(m - top);
                l *= c;
                for (int64_t i = 0; i < lora; ++i) ah[i] *= c;
                m = top;
              }
              for (int64_t i = 0; i < nv; ++i) {
                sc[k][i] = std::exp(sc[k][i] - top);
                l += sc[k][i];
              }
              acc[k] = ah, ps[k] = sc[k];
            }
            axpy_rows(lat, ps, hn, nv, lora, acc);
          }
        }
      }
    }
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; ++bh) {  // merge the runs in order, then W_uv
      float* o = parts + bh * runs * part;  // run 0's state becomes the merged one
      float& m = o[lora];
      float& l = o[lora + 1];
      for (int64_t r = 1; r < runs; ++r) {
        const float* p = o + r * part;
        const float top = std::max(m, p[lora]);
        if (top == -INFINITY) continue;
        const float a = std::exp(m - top), c = std::exp(p[lora] - top);
        for (int64_t i = 0; i < lora; ++i) o[i] = o[i] * a + p[i] * c;
        l = l * a + p[lora + 1] * c, m = top;
      }
      const float inv = 1.0f / l;  // no valid row: 1/0 -> inf·0 = NaN, as softmax
      for (int64_t i = 0; i < lora; ++i) o[i] *= inv;
      if (!w_uv) std::memcpy(out + bh * width, o, lora * sizeof(float));
    }
    if (w_uv) {  // out[b, h] = W_uv[h] · o[b, h]: each head's rows stream once per 16 queries
      const int64_t qt = (B + 15) / 16;
#pragma omp for schedule(static)
      for (int64_t u = 0; u < H * qt; ++u) {
        const int64_t h = u / qt, b0 = (u % qt) * 16, nb = std::min<int64_t>(16, B - b0);
        visit({w_uv, w_uv_kind}, h * w_sh, v, lora, [&](auto w) {
          gemv(w, lora, parts + (b0 * H + h) * runs * part, H * runs * part, nb,
               out + (b0 * H + h) * width, H * width, 0, v, w_uv_kind != FP32);
        });
      }
    }
  }
  return bad;
}

// Latent rows x[n, lora + rope] fp32 into token-major rows `data + slot · row_bytes`:
// e4m3 (kind E4M3) or fp8_ds_mla (DS_MLA); byte-equal to the pool's own encoding.
int64_t dsakv_store_latent(const float* x, int64_t n, int64_t lora, int64_t rope, int kind,
                           uint8_t* data, int64_t n_rows, int64_t row_bytes,
                           const int64_t* slots) {
  if (int64_t bad = count_bad(slots, n, n_rows)) return bad;
  const int64_t d = lora + rope, nb = (lora + kScaleBlock - 1) / kScaleBlock;
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x + i * d;
    uint8_t* row = data + slots[i] * row_bytes;
    if (kind == E4M3) {
      for (int64_t c = 0; c < d; ++c) row[c] = e4m3_from_float(xi[c]);
      continue;
    }
    float scales[64];
    quantize_row(xi, lora, row, scales);
    std::memcpy(row + lora, scales, nb * sizeof(float));
    uint16_t* r = reinterpret_cast<uint16_t*>(row + lora + 4 * nb);
    for (int64_t c = 0; c < rope; ++c) {
      const uint16_t h = bf16_from_float(xi[lora + c]);
      std::memcpy(r + c, &h, sizeof h);
    }
  }
  return 0;
}

// Rotated index keys x[n, d] fp32 into the page-major fp8 index-K buffer: page p holds its
// `page_size` keys' e4m3 bytes, then their fp32 scales (one per 128 values).
int64_t dsakv_store_index_k_fp8(const float* x, int64_t n, int64_t d, uint8_t* data,
                                int64_t n_pages, int64_t page_size, const int64_t* slots) {
  if (int64_t bad = count_bad(slots, n, n_pages * page_size)) return bad;
  const int64_t nb = (d + kScaleBlock - 1) / kScaleBlock;
  const int64_t page_bytes = page_size * (d + 4 * nb);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t page = slots[i] / page_size, off = slots[i] % page_size;
    uint8_t* base = data + page * page_bytes;
    float scales[64];
    quantize_row(x + i * d, d, base + off * d, scales);
    std::memcpy(base + page_size * d + off * 4 * nb, scales, nb * sizeof(float));
  }
  return 0;
}

// `attention_inputs` for B decode tokens x[B, hidden] (cos / sin [B, rope / 2]):
//   h = input_norm(x); q_lora = q_a_norm(q_a · h); q = q_b · q_lora (per head nope ‖ rope);
//   row = kv_a_norm(latent) ‖ rope(k_rope) for [latent ‖ k_rope] = kv_a · h;
//   q_lat[b, h] = q_nope[b, h] · W_uk[h]; q_rope = rope(q's rope part).
// Outputs h[B, hidden], q_lat[B, H, kv_lora], q_rope[B, H, rope], q_lora[B, q_lora],
// row[B, kv_lora + rope], all fp32 contiguous.
void dsakv_mla_inputs(const MlaInputsWeights* wp, int64_t B, const float* x, const float* cos,
                      const float* sin, float* h, float* q_lat, float* q_rope, float* q_lora,
                      float* row) {
  const MlaInputsWeights& w = *wp;
  const int64_t D = w.hidden, QL = w.q_lora, H = w.heads, KL = w.kv_lora, R = w.rope;
  const int64_t qk = w.nope + R, kv = KL + R, half = R / 2;
  float* kvb = scratch(B * (kv + H * qk));  // kv_a outputs, then q_b outputs
  float* qb = kvb + B * kv;
  const int64_t tiles = (B + kUkTokens - 1) / kUkTokens;
#pragma omp parallel
  {
#pragma omp single
    for (int64_t b = 0; b < B; ++b) rms_norm(x + b * D, w.in_norm, D, w.eps_in, h + b * D);
    gemv_team(w.q_a, D, h, D, B, q_lora, QL, QL, false);  // (the barriers order the phases)
    gemv_team(w.kv_a, D, h, D, B, kvb, kv, kv);
#pragma omp for schedule(static)
    for (int64_t u = 0; u < 2 * B; ++u) {  // (token, query or latent side)
      const int64_t b = u / 2;
      if (u % 2 == 0) {
        rms_norm(q_lora + b * QL, w.q_a_norm, QL, w.eps_q, q_lora + b * QL);
      } else {
        rms_norm(kvb + b * kv, w.kv_norm, KL, w.eps_kv, row + b * kv);
        rope_interleaved(kvb + b * kv + KL, cos + b * half, sin + b * half, R, row + b * kv + KL);
      }
    }
    gemv_team(w.q_b, QL, q_lora, QL, B, qb, H * qk, H * qk);
#pragma omp for schedule(static)
    for (int64_t u = 0; u < H * tiles; ++u) {  // (head, tokens): head hd's W_uk rows
      const int64_t hd = u / tiles, b0 = (u % tiles) * kUkTokens;
      const int64_t nb = std::min(kUkTokens, B - b0);
      for (int64_t b = b0; b < b0 + nb; ++b)
        rope_interleaved(qb + (b * H + hd) * qk + w.nope, cos + b * half, sin + b * half, R,
                         q_rope + (b * H + hd) * R);
      const float* qt = qb + (b0 * H + hd) * qk;
      float* ot = q_lat + (b0 * H + hd) * KL;
      visit(w.w_uk, hd * w.uk_head_rows, w.nope, KL, [&](auto uk) {
        if (nb == kUkTokens) return absorb<kUkTokens>(uk, w.nope, KL, qt, H * qk, ot, H * KL);
        for (int64_t t = 0; t < nb; ++t)
          absorb<1>(uk, w.nope, KL, qt + t * H * qk, H * qk, ot + t * H * KL, H * KL);
      });
    }
  }
}

// `residual_ffn` for B tokens: x1 = x + o_proj · attn[B, attn_dim]; h = post_norm(x1);
// out = x1 + (Σ routed experts + shared experts)(h), or x1 + MLP(h) for a dense layer.
// Each expert runs over the tokens that chose it at once, so a prefill chunk's tokens share
// its rows' loads as a dense layer's do; every output is summed in `gemv`'s one order for
// its row and token, so a token's bits do not depend on who else chose its experts.
// routed (null: not asked): token b's chosen experts at routed[b · routed_ld ..], in the
// order chosen (a step recording its routing: SGLang's return_routed_experts).
// attn null (a layer split over ranks: the caller sums o_proj's parts, adds the residual
// and norms): x is the normed rows (every rank's under DP attention), and out is this
// rank's part of their FFN alone, to be summed and added to the residual there.
void dsakv_ffn(const FfnWeights* wp, int64_t B, const float* x, const float* attn, float* out,
               int32_t* routed, int64_t routed_ld) {
  const FfnWeights& w = *wp;
  const int64_t D = w.hidden, I = w.inter, Is = w.mlp_inter;
  const int64_t k = w.router ? w.top_k : 0, E = w.router ? w.n_experts : 0;
  const int64_t P = B * k;  // (token, choice) pairs, grouped by expert below
  float* x1 = scratch(B * (2 * D + E + k + Is) + P * (D + I) + 1);
  float* hn = x1 + B * D;
  float* logits = hn + B * D;
  float* gates = logits + B * E;
  float* act_s = gates + B * k;  // the MLP's (shared experts') activations [B, Is]
  float* xin = act_s + B * Is;   // each pair's normed token, expert by expert [P, D]
  float* act = xin + P * D;      // each pair's expert activations [P, I]
  std::vector<int64_t> ids(P), start(E + 1, 0), pair_of(P), gate_of(P), used;
  const int64_t iblocks = (I + 15) / 16, sblocks = (Is + 15) / 16, nblocks = (D + 15) / 16;
#pragma omp parallel
  {
    if (attn) gemv_team(w.o_proj, w.attn_dim, attn, w.attn_dim, B, x1, D, D);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; ++b) {  // a token's residual, norm and routing on one thread
      if (attn) {
        for (int64_t n = 0; n < D; ++n) x1[b * D + n] += x[b * D + n];
        rms_norm(x1 + b * D, w.post_norm, D, w.eps, hn + b * D);
      } else {
        std::memcpy(hn + b * D, x + b * D, D * sizeof(float));
      }
      if (!w.router) continue;
      gemv(w.router, D, hn + b * D, D, 1, logits + b * E, E, 0, E);
      route(w, logits + b * E, &ids[b * k], gates + b * k);
      if (routed)
        for (int64_t j = 0; j < k; ++j) routed[b * routed_ld + j] = int32_t(ids[b * k + j]);
    }
    // Each expert's tokens side by side (a prefill chunk's hundred tokens share each row's
    // loads), in token order; pair_of[b · k + j]: where token b's j-th choice went.
    if (k) {
#pragma omp single
      {
        const int64_t lo = w.first_expert, hi = lo + w.held_experts;
        auto held = [&](int64_t e) { return e >= lo && e < hi; };
        for (int64_t i = 0; i < P; ++i) start[ids[i] + 1] += held(ids[i]);
        for (int64_t e = 0; e < E; ++e) {
          if (start[e + 1]) used.push_back(e);
          start[e + 1] += start[e];
        }
        std::vector<int64_t> next(start.begin(), start.end() - 1);
        for (int64_t i = 0; i < P; ++i) {
          pair_of[i] = -1;
          if (!held(ids[i])) continue;
          const int64_t p = next[ids[i]]++;
          pair_of[i] = p, gate_of[p] = i;
          std::memcpy(xin + p * D, hn + (i / k) * D, D * sizeof(float));
        }
      }
    }
    // Gate and up rows, 16 of each a unit: a chosen expert's over its tokens (weighted by
    // the router), then the MLP's over every token; silu(gate) · up in the unit.
    const int64_t routed_units = int64_t(used.size()) * iblocks;
#pragma omp for schedule(static)
    for (int64_t u = 0; u < routed_units + sblocks; ++u) {
      const bool routed = u < routed_units;
      const int64_t e = routed ? used[u / iblocks] : 0;
      const int64_t p0 = routed ? start[e] : 0, n = routed ? start[e + 1] - p0 : B;
      const int64_t r0 = (routed ? u % iblocks : u - routed_units) * 16;
      const int64_t rows = std::min<int64_t>(16, (routed ? I : Is) - r0);
      const float* xs = routed ? xin + p0 * D : hn;
      thread_local std::vector<float> gu;
      if (gu.size() < size_t(2 * n * 16)) gu.resize(2 * n * 16);
      float *g = gu.data(), *up = g + n * 16;
      const Mat mg = routed ? w.gate_up : w.mlp_gate, mu = routed ? w.gate_up : w.mlp_up;
      const int64_t he = e - w.first_expert;  // (its place among the held experts)
      const int64_t rg = routed ? he * 2 * I + r0 : r0, ru = routed ? he * 2 * I + I + r0 : r0;
      visit(mg, rg, rows, D, [&](auto m) { gemv(m, D, xs, D, n, g, 16, 0, rows, mg.kind != FP32); });
      visit(mu, ru, rows, D, [&](auto m) { gemv(m, D, xs, D, n, up, 16, 0, rows, mu.kind != FP32); });
      for (int64_t t = 0; t < n; ++t)
        for (int64_t r = 0; r < rows; ++r) {
          const float a = silu(g[t * 16 + r]) * up[t * 16 + r];
          if (routed)
            act[(p0 + t) * I + r0 + r] = a * gates[gate_of[p0 + t]];
          else
            act_s[t * Is + r0 + r] = a;
        }
    }
    // Down, 16 output rows a unit: each expert's over its tokens, the MLP's over every
    // token, then each token's sum in its choices' order.
#pragma omp for schedule(static)
    for (int64_t u = 0; u < nblocks; ++u) {
      const int64_t n0 = u * 16, rows = std::min<int64_t>(16, D - n0);
      thread_local std::vector<float> dn;
      if (dn.size() < size_t((P + B) * 16)) dn.resize((P + B) * 16);
      float* sh = dn.data() + P * 16;
      for (const int64_t e : used) {
        const int64_t p0 = start[e], n = start[e + 1] - p0;
        visit(w.down, (e - w.first_expert) * D + n0, rows, I, [&](auto m) {
          gemv(m, I, act + p0 * I, I, n, dn.data() + p0 * 16, 16, 0, rows, w.down.kind != FP32);
        });
      }
      visit(w.mlp_down, n0, rows, Is, [&](auto m) {
        gemv(m, Is, act_s, Is, B, sh, 16, 0, rows, w.mlp_down.kind != FP32);
      });
      for (int64_t b = 0; b < B; ++b)
        for (int64_t r = 0; r < rows; ++r) {
          float routed = 0.0f;
          for (int64_t j = 0; j < k; ++j)
            if (pair_of[b * k + j] >= 0) routed += dn[pair_of[b * k + j] * 16 + r];
          const float y = routed + sh[b * 16 + r];
          out[b * D + n0 + r] = attn ? x1[b * D + n0 + r] + y : y;
        }
    }
  }
}

// Indexer scores of B queries over stored keys read in place:
//   out[b, s] = Σ_h w[b, h] · ReLU(q[b, h] · k_s) for positions s < lens[b] of query b
//   (key slot table[b · ldt + s]; ldt 0: every query reads one table), -inf past lens[b].
// Keys: `key_kind` E4M3 is the page-major fp8 index-K buffer (page p holds its
// `page_size` keys' e4m3 bytes, then their fp32 scales); BF16 / FP32 are rows of D values
// (page_size 1). `low` (the bf16 path of `cpu_ops.index_topk_decode`): q rounded to bf16,
// each logit rounded to bf16 after its fp32 sum, the weights scaled by `scale`; else
// (fp32): the logits scaled, nothing rounded. Heads are summed in order, each position on
// its own, so a score depends neither on the batch, nor on the table's width, nor on the
// thread count: a prefill token scores its keys exactly as the same token in decode.
// Returns the number of slots (below lens) outside the buffer: skipped (-inf), the caller
// raises.
int64_t dsakv_index_decode(const float* q, const float* w, int64_t B, int64_t H, int64_t D,
                           const uint8_t* data, int64_t n_pages, int64_t page_size,
                           int key_kind, const int64_t* table, int64_t ldt, int64_t W,
                           const int64_t* lens, float scale, int low, float* out) {
  constexpr int64_t kKeys = 64;  // keys widened at once
  const int64_t nb = (D + kScaleBlock - 1) / kScaleBlock;
  const int64_t page_bytes = page_size * (D + 4 * nb), n_slots = n_pages * page_size;
  const int64_t chunks = (W + kKeys - 1) / kKeys;
  std::vector<float> qs(B * H * D), ws(B * H);
  for (int64_t i = 0; i < B * H * D; ++i) qs[i] = low ? round_bf16(q[i]) : q[i];
  for (int64_t i = 0; i < B * H; ++i) ws[i] = low ? w[i] * scale : w[i];
  int64_t bad = 0;
#pragma omp parallel reduction(+ : bad)
  {
    std::vector<float> keys(kKeys * D);
#pragma omp for schedule(static)
    for (int64_t u = 0; u < B * chunks; ++u) {
      const int64_t b = u / chunks, s0 = (u % chunks) * kKeys, n = std::min(kKeys, W - s0);
      float* o = out + b * W + s0;
      bool ok[kKeys];
      for (int64_t j = 0; j < n; ++j) {
        const int64_t slot = table[b * ldt + s0 + j];
        ok[j] = s0 + j < lens[b];
        if (ok[j] && (slot < 0 || slot >= n_slots)) ok[j] = false, ++bad;
        o[j] = ok[j] ? 0.0f : -INFINITY;
        if (!ok[j]) continue;
        if (key_kind == FP32) {
          std::memcpy(&keys[j * D], data + slot * D * 4, D * sizeof(float));
          continue;
        }
        if (key_kind == BF16) {
          widen_bf16(reinterpret_cast<const uint16_t*>(data + slot * D * 2), &keys[j * D], D);
          continue;
        }
        const uint8_t* page = data + (slot / page_size) * page_bytes;
        const int64_t off = slot % page_size;
        const float* sc = reinterpret_cast<const float*>(page + page_size * D) + off * nb;
        for (int64_t k = 0; k < nb; ++k) {
          const int64_t a = k * kScaleBlock, m = std::min(kScaleBlock, D - a);
          float scale_k;
          std::memcpy(&scale_k, sc + k, sizeof scale_k);
          widen_e4m3(page + off * D + a, &keys[j * D + a], m, scale_k);
        }
      }
      const float* qb = &qs[b * H * D];
      const float* wb = &ws[b * H];
      for (int64_t j = 0; j < n; ++j) {
        if (!ok[j]) continue;
        const float* k = &keys[j * D];
        float acc = 0.0f;
        for (int64_t h = 0; h < H; h += 4) {  // four heads' dots: four FMA chains
          float logit[4];
          const int64_t m = std::min<int64_t>(4, H - h);
          dots_upto4(qb + h * D, D, k, D, m, logit);
          for (int64_t i = 0; i < m; ++i) {
            const float l = low ? round_bf16(logit[i]) : logit[i] * scale;
            acc += wb[h + i] * std::max(l, 0.0f);
          }
        }
        o[j] = acc;
      }
    }
  }
  return bad;
}

// `index_key` for B decode tokens: k[B, dim] = RoPE(LayerNorm(wk · h)) on its first `rope`
// values (unrotated: the store rotates).
void dsakv_index_key(const IndexerWeights* wp, int64_t B, const float* h, const float* cos,
                     const float* sin, float* k) {
  const IndexerWeights& w = *wp;
  const int64_t D = w.dim, half = w.rope / 2;
  float* raw = scratch(B * D);
#pragma omp parallel
  {
    gemv_team(w.wk, w.hidden, h, w.hidden, B, raw, D, D);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      float* r = raw + b * D;
      float mean = 0.0f, var = 0.0f;
      for (int64_t i = 0; i < D; ++i) mean += r[i];
      mean /= float(D);
      for (int64_t i = 0; i < D; ++i) var += (r[i] - mean) * (r[i] - mean);
      const float rstd = 1.0f / std::sqrt(var / float(D) + w.eps);
      for (int64_t i = 0; i < D; ++i) r[i] = (r[i] - mean) * rstd * w.k_norm_w[i] + w.k_norm_b[i];
      rope_part(w, r, cos + b * half, sin + b * half, k + b * D);
      std::memcpy(k + b * D + w.rope, r + w.rope, (D - w.rope) * sizeof(float));
    }
  }
}

// `index_query` for B decode tokens: q[B, heads, dim] = rotate(RoPE(wq_b · q_lora)) and
// w[B, heads] = (weights_proj · h) · w_scale.
void dsakv_index_query(const IndexerWeights* wp, int64_t B, const float* h, const float* q_lora,
                       const float* cos, const float* sin, float* q, float* wout) {
  const IndexerWeights& w = *wp;
  const int64_t D = w.dim, H = w.heads, half = w.rope / 2;
  float* raw = scratch(2 * B * H * D);
  float* roped = raw + B * H * D;
#pragma omp parallel
  {
    gemv_team(w.wq_b, w.q_lora, q_lora, w.q_lora, B, raw, H * D, H * D, false);
    gemv_team(fp32(w.weights_proj), w.hidden, h, w.hidden, B, wout, H, H);
#pragma omp for schedule(static)
    for (int64_t u = 0; u < B * H; ++u) {
      const int64_t b = u / H;
      float* dst = w.hadamard ? roped + u * D : q + u * D;
      rope_part(w, raw + u * D, cos + b * half, sin + b * half, dst);
      std::memcpy(dst + w.rope, raw + u * D + w.rope, (D - w.rope) * sizeof(float));
      if (w.hadamard) gemv(w.hadamard, D, dst, D, 1, q + u * D, D, 0, D);
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < B * H; ++i) wout[i] *= w.w_scale;
  }
}

// y[b] = x[b] · rsqrt(mean(x[b]²) + eps) · w for B rows of n (the final norm), each row
// on its own.
void dsakv_rms_norm(const float* x, const float* w, int64_t B, int64_t n, float eps, float* y) {
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < B; ++b) rms_norm(x + b * n, w, n, eps, y + b * n);
}

// y[B, N] = x[B, K] · W[N, K]ᵀ (the LM head; W of `kind` as `Mat`), each output
// reduced as `gemv` reduces it: a token's logits do not depend on the rows beside it or on
// the thread count.
void dsakv_linear(const void* W, int64_t N, int64_t K, const float* x, int64_t B, float* y,
                  int kind = FP32) {
#pragma omp parallel
  gemv_team({W, kind}, K, x, K, B, y, N, N);
}

// `torch_ops.topk_by_position`: for each row of scores[B, W], the positions of the k
// largest, ties to the lower position, in descending order of (score, -position): each
// pair is one unique int64 key (the score's bits as an order-preserving int32 above the
// reversed position), so the order is exactly torch's `topk` over those keys.
void dsakv_topk_by_position(const float* scores, int64_t B, int64_t W, int64_t k,
                            int64_t* out) {
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int64_t> keys(W);
    for (int64_t s = 0; s < W; ++s) {
      int32_t bits;
      const float v = scores[b * W + s] + 0.0f;  // -0.0 as +0.0
      std::memcpy(&bits, &v, sizeof bits);
      const int32_t ordered = bits < 0 ? bits ^ 0x7fffffff : bits;
      keys[s] = int64_t(uint64_t(int64_t(ordered)) << 32) | (W - 1 - s);
    }
    std::partial_sort(keys.begin(), keys.begin() + k, keys.end(), std::greater<int64_t>());
    for (int64_t i = 0; i < k; ++i) out[b * k + i] = W - 1 - (keys[i] & 0xffffffff);
  }
}

}  // extern "C"

// --- a step's layers in one call ----------------------------------------------------------

namespace {

// One target layer as the layer loop reads it: its blocks' weights (the structs the Python
// blocks hold), W_uv, and its pool buffers. `key` null: a shared layer, which attends over
// the selection of the last full layer before it.
struct LayerDesc {
  const MlaInputsWeights* inputs;
  const FfnWeights* ffn;
  const IndexerWeights *key, *query;  // unrotated (the key), rotated as the stored keys
  const void* w_uv;
  int64_t w_uv_sh, w_uv_kind;  // rows between heads; as `Mat`
  uint8_t* latent;
  int64_t latent_rows, latent_row_bytes, latent_kind;
  uint8_t* index_k;
  int64_t index_pages, index_page_size, index_kind;  // E4M3 page-major, or BF16 / FP32 rows
};

// The step: T tokens, token t at position lens[t] - 1 of its request, its context's slots
// table[t · W ...] (positions past lens[t] padding), its KV written to out_slots[t]. The
// first layer is a full one. routed (null: not asked): where MoE layer l writes token t's
// chosen experts, routed[t · routed_ld + l · routed_layer_ld ..] (`dsakv_ffn`'s rows; a
// dense layer's are left as they are).
struct StepDesc {
  int64_t T, W, topk;
  const float *cos, *sin;  // [T, rope / 2]
  const int64_t *out_slots, *table, *lens;
  float index_scale, mla_scale;
  int64_t low;  // bf16 indexer arithmetic (`dsakv_index_decode`'s `low`)
  int32_t* routed;
  int64_t routed_ld, routed_layer_ld;
};

// What a step reads around its layers: the embedding, RoPE's cos / sin tables (a row per
// position), the MTP layer's NextN input (`enorm` null: none), the output norm, and the LM
// head of the step's logits and the draft chain's argmax (`head_rows` 0: none).
struct StepIO {
  Mat embed;
  int64_t vocab;
  const float *cos, *sin;  // [positions, rope / 2]
  int64_t positions;
  const float *enorm, *hnorm;  // x = eh_proj(cat(enorm(x), hnorm(h)))
  Mat eh_proj;
  float e_eps, h_eps;
  const float* norm;
  float norm_eps;
  Mat head;
  int64_t head_rows;
};

// Rows x[n, d] into token-major fp32 / bf16 rows `data + slot · row_bytes`, as the pool
// writes them (`x.to(dtype)`); returns the number of slots outside [0, rows).
inline int64_t store_rows(const float* x, int64_t n, int64_t d, int kind, uint8_t* data,
                          int64_t rows, int64_t row_bytes, const int64_t* slots) {
  if (int64_t bad = count_bad(slots, n, rows)) return bad;
  for (int64_t i = 0; i < n; ++i) {
    uint8_t* row = data + slots[i] * row_bytes;
    if (kind == FP32) {
      std::memcpy(row, x + i * d, d * sizeof(float));
      continue;
    }
    for (int64_t c = 0; c < d; ++c) {
      const uint16_t h = bf16_from_float(x[i * d + c]);
      std::memcpy(row + 2 * c, &h, sizeof h);
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// A run of layers (the target's, or the MTP layer) for a step whose tokens each attend
// over their own selection (decode tokens, MTP verify and draft rows), in one call: per layer the input blocks, the latent store, on a
// full layer the index key and its store, then (when some context is longer than top-k)
// the indexer's scores over the stored keys, top-k in position order; then attention over
// the selected stored rows and the FFN (an MoE layer's routing written where `s` asks for
// it). Each is the extern call the per-layer Python path makes for the same tokens, in the
// same order, so both give the same bits; the loop only drops the Python between them.
// x[T, hidden] is the embedded input, replaced by the last layer's output. Returns the
// number of out-of-range slots met (the caller raises).
int64_t dsakv_forward_layers(const LayerDesc* layers, int64_t n_layers, const StepDesc* sp,
                             float* x) {
  const StepDesc& s = *sp;
  const MlaInputsWeights& w0 = *layers[0].inputs;
  const int64_t T = s.T, D = w0.hidden, H = w0.heads, KL = w0.kv_lora, R = w0.rope;
  const int64_t v = layers[0].ffn->attn_dim / H;
  const int64_t K = std::min(s.W, s.topk);  // the selection's width
  int64_t ID = 0, IH = 0;                    // the indexer's head dim and heads
  for (int64_t l = 0; l < n_layers; ++l)
    if (layers[l].key) ID = layers[l].key->dim, IH = layers[l].key->heads;
  std::vector<float> h(T * D), q_lat(T * H * KL), q_rope(T * H * R), q_lora(T * w0.q_lora);
  std::vector<float> row(T * (KL + R)), attn(T * H * v), out(T * D);
  std::vector<float> key(T * ID), rotated(T * ID), iq(T * IH * ID), iw(T * IH);
  std::vector<float> scores(s.W > s.topk ? T * s.W : 0);
  std::vector<int64_t> pos(T * K), sel(T * K);
  std::vector<uint8_t> valid(T * K);  // (bool-sized: `dsakv_mla_decode` reads bool)
  int64_t bad = 0;
  for (int64_t l = 0; l < n_layers; ++l) {
    const LayerDesc& L = layers[l];
    dsakv_mla_inputs(L.inputs, T, x, s.cos, s.sin, h.data(), q_lat.data(), q_rope.data(),
                     q_lora.data(), row.data());
    if (L.latent_kind == E4M3 || L.latent_kind == DS_MLA)
      bad += dsakv_store_latent(row.data(), T, KL, R, int(L.latent_kind), L.latent,
                                L.latent_rows, L.latent_row_bytes, s.out_slots);
    else
      bad += store_rows(row.data(), T, KL + R, int(L.latent_kind), L.latent, L.latent_rows,
                        L.latent_row_bytes, s.out_slots);
    if (L.key) {
      dsakv_index_key(L.key, T, h.data(), s.cos, s.sin, key.data());
      if (L.index_kind == E4M3) {  // rotated as the pool's fp8 keys are
        dsakv_linear(L.query->hadamard, ID, ID, key.data(), T, rotated.data());
        bad += dsakv_store_index_k_fp8(rotated.data(), T, ID, L.index_k, L.index_pages,
                                       L.index_page_size, s.out_slots);
      } else {
        bad += store_rows(key.data(), T, ID, int(L.index_kind), L.index_k,
                          L.index_pages * L.index_page_size, ID * (L.index_kind == FP32 ? 4 : 2),
                          s.out_slots);
      }
      if (s.W > s.topk) {  // scores over each token's stored keys, then top-k
        dsakv_index_query(L.query, T, h.data(), q_lora.data(), s.cos, s.sin, iq.data(),
                          iw.data());
        bad += dsakv_index_decode(iq.data(), iw.data(), T, IH, ID, L.index_k, L.index_pages,
                                  L.index_page_size, int(L.index_kind), s.table, s.W, s.W,
                                  s.lens, s.index_scale, int(s.low), scores.data());
        dsakv_topk_by_position(scores.data(), T, s.W, K, pos.data());
      } else {  // every position is selected
        for (int64_t t = 0; t < T; ++t)
          for (int64_t j = 0; j < K; ++j) pos[t * K + j] = j;
      }
      for (int64_t t = 0; t < T; ++t) {  // in position order: the rows' one summation order
        int64_t* p = &pos[t * K];
        std::sort(p, p + K);
        for (int64_t j = 0; j < K; ++j) {
          valid[t * K + j] = p[j] < s.lens[t];
          sel[t * K + j] = s.table[t * s.W + p[j]];
        }
      }
    }
    bad += dsakv_mla_decode(q_lat.data(), q_rope.data(), H * R, R, L.latent, L.latent_rows,
                            L.latent_row_bytes, int(L.latent_kind), sel.data(), K,
                            reinterpret_cast<const bool*>(valid.data()), T, K, H, KL, R,
                            s.mla_scale, L.w_uv, L.w_uv_sh, v, attn.data(), int(L.w_uv_kind));
    int32_t* routed = s.routed && L.ffn->router ? s.routed + l * s.routed_layer_ld : nullptr;
    dsakv_ffn(L.ffn, T, x, attn.data(), out.data(), routed, s.routed_ld);
    std::memcpy(x, out.data(), T * D * sizeof(float));
  }
  return bad;
}

// A step of the model (or of the MTP layer, whose h rows are `hidden[T, hidden]`): token t
// is ids[t] at positions[t]; the embedded rows (NextN input first where there is one) run
// the layers (`s` as `dsakv_forward_layers` takes it, its cos / sin gathered here), and
// out[T, hidden] is their output normed; then logits[n, head_rows] of its rows rows[i]
// (n 0: none). Each part is the extern call the Python blocks make (`dsakv_rms_norm`,
// `dsakv_linear`), so both give the same bits. Returns the number of ids, positions, rows
// and slots out of range (nothing is stored when an id, a position or a row is).
int64_t dsakv_forward_step(const LayerDesc* layers, int64_t n_layers, const StepIO* io,
                           const StepDesc* sp, const int64_t* ids, const int64_t* positions,
                           const float* hidden, float* out, const int64_t* rows, int64_t n,
                           float* logits) {
  StepDesc s = *sp;
  const int64_t T = s.T, D = layers[0].inputs->hidden, half = layers[0].inputs->rope / 2;
  int64_t bad = 0;
  for (int64_t t = 0; t < T; ++t)
    bad += (ids[t] < 0 || ids[t] >= io->vocab) + (positions[t] < 0 || positions[t] >= io->positions);
  for (int64_t i = 0; i < n; ++i) bad += rows[i] < 0 || rows[i] >= T;
  if (bad) return bad;
  std::vector<float> x(T * D), cos(T * half), sin(T * half);
  for (int64_t t = 0; t < T; ++t) {
    visit(io->embed, ids[t], 1, D, [&](auto w) {
      for (int64_t k = 0; k < D; ++k) x[t * D + k] = widen(w[k]);
    });
    std::memcpy(&cos[t * half], io->cos + positions[t] * half, half * sizeof(float));
    std::memcpy(&sin[t * half], io->sin + positions[t] * half, half * sizeof(float));
  }
  if (io->enorm) {
    std::vector<float> both(T * 2 * D);
    for (int64_t t = 0; t < T; ++t) {
      rms_norm(&x[t * D], io->enorm, D, io->e_eps, &both[t * 2 * D]);
      rms_norm(hidden + t * D, io->hnorm, D, io->h_eps, &both[t * 2 * D + D]);
    }
    dsakv_linear(io->eh_proj.p, D, 2 * D, both.data(), T, x.data(), int(io->eh_proj.kind));
  }
  s.cos = cos.data(), s.sin = sin.data();
  bad += dsakv_forward_layers(layers, n_layers, &s, x.data());
  dsakv_rms_norm(x.data(), io->norm, T, D, io->norm_eps, out);
  if (n) {
    std::vector<float> picked(n * D);
    for (int64_t i = 0; i < n; ++i) std::memcpy(&picked[i * D], out + rows[i] * D, D * sizeof(float));
    dsakv_linear(io->head.p, io->head_rows, D, picked.data(), n, logits, int(io->head.kind));
  }
  return bad;
}

// MTP drafts in one call (the MTP layer's loop, `io` with its head): the catch-up step
// `sp` (as `dsakv_forward_step`), then for each of n requests, up to want[r] drafts, each
// the head's argmax (torch's: the first maximum, a NaN before all) of its latest row: the
// catch-up's row rows[r], then its own output as it chains, token drafts[r, j - 1] at
// the position after its catch-up's last plus j - 1 (slots chain[r, :W], lengths up to
// W). Round j runs the requests that want more than j drafts, as the Python chain does.
// drafts[n, K] gets -1 past a request's want. Returns what `dsakv_forward_step` counts.
int64_t dsakv_draft_chain(const LayerDesc* layers, int64_t n_layers, const StepIO* io,
                          const StepDesc* sp, const int64_t* ids, const int64_t* positions,
                          const float* hidden, int64_t n, const int64_t* rows,
                          const int64_t* want, int64_t K, const int64_t* chain, int64_t W,
                          int64_t* drafts) {
  const int64_t D = layers[0].inputs->hidden, V = io->head_rows;
  int64_t bad = 0;
  for (int64_t r = 0; r < n; ++r)  // (the caller sizes chain for every want)
    bad += rows[r] < 0 || rows[r] >= sp->T || want[r] > K ||
           (want[r] > 1 && positions[rows[r]] + want[r] > W);
  if (bad) return bad;
  std::vector<float> out(sp->T * D), h(n * D), x(n * D), logits(n * V);
  bad = dsakv_forward_step(layers, n_layers, io, sp, ids, positions, hidden, out.data(),
                           nullptr, 0, nullptr);
  if (bad) return bad;
  for (int64_t r = 0; r < n; ++r) std::memcpy(&h[r * D], &out[rows[r] * D], D * sizeof(float));
  std::fill(drafts, drafts + n * K, int64_t(-1));
  std::vector<int64_t> live, tok(n), pos(n), outs(n), lens(n), table(n * W);
  for (int64_t j = 0; j < K; ++j) {
    live.clear();
    for (int64_t r = 0; r < n; ++r)
      if (want[r] > j) live.push_back(r);
    const int64_t m = int64_t(live.size());
    if (!m) break;
    for (int64_t q = 0; q < m; ++q) std::memcpy(&x[q * D], &h[live[q] * D], D * sizeof(float));
    if (j) {  // the chain: each live request's last draft after its own output
      for (int64_t q = 0; q < m; ++q) {
        const int64_t r = live[q];
        tok[q] = drafts[r * K + j - 1];
        pos[q] = positions[rows[r]] + j;
        lens[q] = pos[q] + 1;
        outs[q] = chain[r * W + pos[q]];
        std::memcpy(&table[q * W], chain + r * W, W * sizeof(int64_t));
      }
      StepDesc s = *sp;
      s.T = m, s.W = W, s.out_slots = outs.data(), s.table = table.data(), s.lens = lens.data();
      s.routed = nullptr;  // (a chain round records no routing)
      std::vector<float> y(m * D);
      bad = dsakv_forward_step(layers, n_layers, io, &s, tok.data(), pos.data(), x.data(),
                               y.data(), nullptr, 0, nullptr);
      if (bad) return bad;
      for (int64_t q = 0; q < m; ++q) std::memcpy(&h[live[q] * D], &y[q * D], D * sizeof(float));
      std::memcpy(x.data(), y.data(), m * D * sizeof(float));
    }
    dsakv_linear(io->head.p, V, D, x.data(), m, logits.data(), int(io->head.kind));
    for (int64_t q = 0; q < m; ++q) {
      const float* l = &logits[q * V];
      int64_t best = 0;
      for (int64_t v = 1; v < V && !std::isnan(l[best]); ++v)
        if (std::isnan(l[v]) || l[v] > l[best]) best = v;
      drafts[live[q] * K + j] = best;
    }
  }
  return 0;
}

}  // extern "C"
