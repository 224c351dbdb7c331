// The few-row matmul's core, shared by the FFI matmul (cpu_matmul.cc) and the fused decode layer
// (cpu_decode_layer.cc): y[:, n0:n1] = x [M, K] @ w [K, N] for a range of columns, w float32, bfloat16, int8 or fp8
// e4m3.
//
// Every output is summed over k in order, one fused multiply-add at a time, whichever of the two walks runs (the
// register tiles for many rows, the row stream for few), so a row's result does not depend on how many rows share
// the call (batch-invariant) or on how the columns are split between threads.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace netra::rows {

#if defined(__AVX512F__)
constexpr int VW = 16;  // floats per vector register
constexpr int MT = 8;   // rows per tile: MT * NV accumulators plus NV weight vectors fit 32 registers
constexpr int NV = 3;
#elif defined(__AVX__)
constexpr int VW = 8;
constexpr int MT = 4;  // 16 registers: 12 accumulators, 3 weight vectors, a broadcast
constexpr int NV = 3;
#else
constexpr int VW = 4;
constexpr int MT = 4;
constexpr int NV = 2;
#endif
constexpr int KB = 32;           // rows of w per block (the prefetch distance)
constexpr int LINE_BYTES = 64;  // a cache line
typedef float vf __attribute__((vector_size(VW * sizeof(float))));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// VW int8 weights widened to float (sign-extend, convert: two instructions; GCC 12 scalarizes the generic
// __builtin_convertvector of int8 vectors, which made the kernel compute-bound at a third of the float kernel's speed).
inline vf load(const int8_t* p) {
  vf out;
#if defined(__AVX512F__)
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&out, &v, sizeof(out));
#elif defined(__AVX2__)
  const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&out, &v, sizeof(out));
#else
  for (int i = 0; i < VW; ++i) out[i] = static_cast<float>(p[i]);
#endif
  return out;
}

// float8 e4m3fn (sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities, S.1111.111 is NaN), as stored.
struct E4M3 {
  uint8_t bits;
};

// bfloat16, as stored: the high half of a float32's bits.
struct BF16 {
  uint16_t bits;
};

inline float to_float(float w) { return w; }
inline float to_float(int8_t w) { return static_cast<float>(w); }
inline float to_float(E4M3 w) {
  const int e = (w.bits >> 3) & 15, m = w.bits & 7;
  const float v = e == 0 ? std::ldexp(m / 8.0f, -6) : std::ldexp(1.0f + m / 8.0f, e - 7);
  return w.bits & 0x80 ? -v : v;
}
inline float to_float(BF16 w) {
  const uint32_t bits = static_cast<uint32_t>(w.bits) << 16;
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// VW e4m3 weights widened to float. Sign-extended to 16 bits and shifted left by 7, a byte's sign lands in bits 15
// and 14 and its exponent and mantissa in bits 13-7: masking bit 14 leaves the float16 whose value is the e4m3
// value / 2^8 (bias 15 against 7; subnormals map to subnormals), which the conversion widens exactly; then x 2^8.
// The NaN pattern reads as 480 (quantized weights hold none). Five instructions a vector against int8's two, still
// as fast as int8 at one row (memory-bound: 16.6 against 17.2 GB/s on a 2-core AVX-512 Xeon).
inline vf load(const E4M3* p) {
  vf out;
#if defined(__AVX512F__)
  const __m256i s = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(s, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
  const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
  std::memcpy(&out, &v, sizeof(out));
#elif defined(__AVX2__) && defined(__F16C__)
  const __m128i s = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_and_si128(_mm_slli_epi16(s, 7), _mm_set1_epi16(static_cast<int16_t>(0xBF80)));
  const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
  std::memcpy(&out, &v, sizeof(out));
#else
  for (int i = 0; i < VW; ++i) out[i] = to_float(p[i]);
#endif
  return out;
}

// VW bfloat16 weights widened to float (exact): each one's 16 bits moved to the top of a 32-bit lane.
inline vf load(const BF16* p) {
  vf out;
#if defined(__AVX512F__)
  const __m512i v = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  std::memcpy(&out, &v, sizeof(out));
#elif defined(__AVX2__)
  const __m256i v = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  std::memcpy(&out, &v, sizeof(out));
#else
  for (int i = 0; i < VW; ++i) out[i] = to_float(p[i]);
#endif
  return out;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

// acc + x * w, one rounding. Written as the instruction, not as `acc += x * w`: the kernels are built with
// reassociation allowed (for the attention's loops), under which the compiler may regroup a chain of sums, and
// every walk here must add its products in k's order to give the same bits.
inline vf madd(vf x, vf w, vf acc) {
#if defined(__AVX512F__)
  __m512 a, b, c;
  std::memcpy(&a, &x, sizeof(a)), std::memcpy(&b, &w, sizeof(b)), std::memcpy(&c, &acc, sizeof(c));
  const __m512 r = _mm512_fmadd_ps(a, b, c);
#elif defined(__AVX__) && defined(__FMA__)
  __m256 a, b, c;
  std::memcpy(&a, &x, sizeof(a)), std::memcpy(&b, &w, sizeof(b)), std::memcpy(&c, &acc, sizeof(c));
  const __m256 r = _mm256_fmadd_ps(a, b, c);
#else
  vf r;
  for (int i = 0; i < VW; ++i) r[i] = std::fma(x[i], w[i], acc[i]);
#endif
  vf out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
}

template <typename W>
struct Problem {
  const float* x;  // [M, K], rows ldx apart
  const W* w;      // [K, N]
  float* y;        // [M, N]
  int64_t M, K, N;
  int64_t ldx = 0;  // x's row stride (0: K); a K segment of a wider x keeps the full stride

  int64_t x_stride() const { return ldx ? ldx : K; }

  // rows [k0, k1) of the sum: x's columns and w's rows there, into y
  Problem segment(int64_t k0, int64_t k1, float* out) const {
    return Problem{x + k0, w + k0 * N, out, M, k1 - k0, N, x_stride()};
  }
};

// Spreads the prefetch of block rows [row0, row0 + rows) x columns [n0, n1) over `steps` calls of `next()`.
template <typename W>
class Prefetcher {
 public:
  static constexpr int64_t LINE = LINE_BYTES / sizeof(W);  // weights per cache line

  Prefetcher(const Problem<W>& p, int64_t row0, int64_t rows, int64_t n0, int64_t n1, int64_t steps)
      : p_(p), row0_(row0), n0_(n0), per_row_((n1 - n0 + LINE - 1) / LINE) {
    total_ = rows * per_row_;
    per_step_ = steps > 0 ? (total_ + steps - 1) / steps : total_;
  }

  void next() {
    for (int64_t i = 0; i < per_step_ && line_ < total_; ++i, ++line_) {
      const int64_t r = line_ / per_row_, c = line_ % per_row_;
      __builtin_prefetch(p_.w + (row0_ + r) * p_.N + n0_ + c * LINE, 0, 2);
    }
  }

 private:
  const Problem<W>& p_;
  int64_t row0_, n0_, per_row_, total_ = 0, per_step_ = 0, line_ = 0;
};

// Rows [m0, m0 + mt) of y[:, n : n + nv * VW] over w's rows [k0, k0 + kb): accumulate (or start at k0 == 0).
template <int TM, int TN, typename W>
void tile(const Problem<W>& p, int64_t m0, int64_t n, int64_t k0, int64_t kb, Prefetcher<W>* pf) {
  vf acc[TM][TN];
  for (int m = 0; m < TM; ++m) {
    for (int j = 0; j < TN; ++j) {
      acc[m][j] = k0 == 0 ? vf{} : load(p.y + (m0 + m) * p.N + n + j * VW);
    }
  }
  const float* xr = p.x + m0 * p.x_stride() + k0;
  const W* wr = p.w + k0 * p.N + n;
  for (int64_t k = 0; k < kb; ++k, wr += p.N) {
    if (pf) pf->next();
    vf wv[TN];
    for (int j = 0; j < TN; ++j) wv[j] = load(wr + j * VW);
    for (int m = 0; m < TM; ++m) {
      const vf xb = vf{} + xr[m * p.x_stride() + k];
      for (int j = 0; j < TN; ++j) acc[m][j] = madd(xb, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < TM; ++m) {
    for (int j = 0; j < TN; ++j) store(p.y + (m0 + m) * p.N + n + j * VW, acc[m][j]);
  }
}

// One row tile of any height up to MT (the compiler needs it static).
template <int TN, typename W>
void tile_rows(const Problem<W>& p, int64_t m0, int64_t mt, int64_t n, int64_t k0, int64_t kb, Prefetcher<W>* pf) {
  switch (mt) {
#define NETRA_ROWS(R) \
  case R:             \
    if constexpr (R <= MT) tile<R, TN, W>(p, m0, n, k0, kb, pf); \
    break;
    NETRA_ROWS(1)
    NETRA_ROWS(2)
    NETRA_ROWS(3)
    NETRA_ROWS(4)
    NETRA_ROWS(5)
    NETRA_ROWS(6)
    NETRA_ROWS(7)
    NETRA_ROWS(8)
#undef NETRA_ROWS
  }
}

// Columns [n0, n1) that fill no whole vector: plain loops (fewer than VW of them, at the end of a range).
template <typename W>
void tail_columns(const Problem<W>& p, int64_t n0, int64_t n1, int64_t k0, int64_t kb) {
  for (int64_t m = 0; m < p.M; ++m) {
    for (int64_t n = n0; n < n1; ++n) {
      float a = k0 == 0 ? 0.0f : p.y[m * p.N + n];
      for (int64_t k = k0; k < k0 + kb; ++k) a = std::fma(p.x[m * p.x_stride() + k], to_float(p.w[k * p.N + n]), a);
      p.y[m * p.N + n] = a;
    }
  }
}

// y[:, n0:n1] for all rows in register tiles (MT rows x NV vectors), KB rows of w at a time: each block's weights
// are read once for all row tiles. Ranges starting on a multiple of the panel width fill whole panels.
template <typename W>
void chunk(const Problem<W>& p, int64_t n0, int64_t n1) {
  constexpr int64_t NB = NV * VW;
  const int64_t vec_end = n0 + (n1 - n0) / VW * VW;
  const int64_t panel_end = n0 + (vec_end - n0) / NB * NB;
  for (int64_t k0 = 0; k0 < p.K; k0 += KB) {
    const int64_t kb = std::min<int64_t>(KB, p.K - k0);
    const int64_t next_rows = std::min<int64_t>(KB, p.K - k0 - kb);
    const int64_t steps = ((panel_end - n0) / NB + (vec_end - panel_end) / VW) * kb;
    Prefetcher<W> pf(p, k0 + kb, next_rows, n0, n1, steps);
    for (int64_t n = n0; n < panel_end; n += NB) {
      for (int64_t m0 = 0; m0 < p.M; m0 += MT) {
        tile_rows<NV>(p, m0, std::min<int64_t>(MT, p.M - m0), n, k0, kb, m0 == 0 ? &pf : nullptr);
      }
    }
    for (int64_t n = panel_end; n < vec_end; n += VW) {
      for (int64_t m0 = 0; m0 < p.M; m0 += MT) {
        tile_rows<1>(p, m0, std::min<int64_t>(MT, p.M - m0), n, k0, kb, m0 == 0 ? &pf : nullptr);
      }
    }
    if (vec_end < n1) tail_columns(p, vec_end, n1, k0, kb);
  }
}

// The row stream: y[:, n0:n1] for a few rows, walking w's rows in order, STREAM_K of them at a time, over a run of
// at most STREAM_RUN_BYTES of each row (contiguous in memory, so the hardware prefetchers follow it; a panel's short
// strided runs defeat them at one row: 27 against 21 GB/s on a 2-core AVX-512 Xeon). Longer rows are walked run by
// run: y's run stays in L1 and the prefetch, 16 rows ahead, stays within L2 (a float32 lm_head of 49152 columns,
// each core walking whole 96 KiB halves of rows: 20.6 GB/s; 16 KiB runs: 28.6).
constexpr int STREAM_K = 4;
constexpr int64_t STREAM_AHEAD = 16;  // rows of w prefetched ahead of the walk
constexpr int64_t STREAM_ROWS_MAX = 4;  // beyond, the register tiles reuse each weight vector across more rows
constexpr int64_t STREAM_RUN_BYTES = 16384;  // of each row of w per walk over the rows

// One run of columns [n0, n1) of the row stream (see `stream`).
template <typename W>
void stream_run(const Problem<W>& p, int64_t n0, int64_t n1) {
  constexpr int64_t LINE = LINE_BYTES / sizeof(W);  // weights per cache line
  const int64_t vec_end = n0 + (n1 - n0) / VW * VW;
  for (int64_t m = 0; m < p.M; ++m) {
    for (int64_t n = n0; n < vec_end; n += VW) store(p.y + m * p.N + n, vf{});
  }
  int64_t k = 0;
  for (; k + STREAM_K <= p.K; k += STREAM_K) {
    const W* w0 = p.w + k * p.N;
    const W* ahead = p.w + std::min(k + STREAM_AHEAD, p.K - STREAM_K) * p.N;
    for (int64_t n = n0; n < vec_end; n += VW) {
      vf wv[STREAM_K];
      for (int j = 0; j < STREAM_K; ++j) wv[j] = load(w0 + j * p.N + n);
      if ((n - n0) % LINE == 0) {
        for (int j = 0; j < STREAM_K; ++j) __builtin_prefetch(ahead + j * p.N + n, 0, 2);
      }
      for (int64_t m = 0; m < p.M; ++m) {
        const float* xr = p.x + m * p.x_stride() + k;
        vf acc = load(p.y + m * p.N + n);
        for (int j = 0; j < STREAM_K; ++j) acc = madd(vf{} + xr[j], wv[j], acc);
        store(p.y + m * p.N + n, acc);
      }
    }
  }
  for (; k < p.K; ++k) {
    const W* wr = p.w + k * p.N;
    for (int64_t n = n0; n < vec_end; n += VW) {
      const vf wv = load(wr + n);
      for (int64_t m = 0; m < p.M; ++m) {
        vf acc = load(p.y + m * p.N + n);
        acc = madd(vf{} + p.x[m * p.x_stride() + k], wv, acc);
        store(p.y + m * p.N + n, acc);
      }
    }
  }
  if (vec_end < n1) tail_columns(p, vec_end, n1, 0, p.K);
}

// The row stream over columns [n0, n1), run by run; every output is still summed over k in order.
template <typename W>
void stream(const Problem<W>& p, int64_t n0, int64_t n1) {
  constexpr int64_t RUN = STREAM_RUN_BYTES / sizeof(W) / VW * VW;  // columns per run, whole vectors
  for (int64_t n = n0; n < n1; n += RUN) stream_run(p, n, std::min(n1, n + RUN));
}

// y[:, n0:n1] = x @ w[:, n0:n1]: the row stream for up to STREAM_ROWS_MAX rows, else the register tiles.
template <typename W>
void columns(const Problem<W>& p, int64_t n0, int64_t n1) {
  if (p.M <= STREAM_ROWS_MAX) {
    stream(p, n0, n1);
  } else {
    chunk(p, n0, n1);
  }
}

}  // namespace netra::rows
