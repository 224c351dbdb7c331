// Few-row matmuls for CPU, XLA FFI handlers: y[M, N] = x[M, K] @ w[K, N] (w row-major, [in, out]) with float32 x
// and y, and w in float32, int8 or float8 e4m3fn (converted to float in registers; the caller applies a quantized
// weight's scales).
// Built on first use with the host's compiler for the host's CPU (netra_jax/ops/cpu_kernels.py builds and loads it).
//
// Why: a decode step multiplies a few rows (one per running sequence) by every weight matrix, so it is a stream of
// the weights through the cores. XLA's CPU dot tiles such a matmul for 4 rows at a time and, at 8 rows, reads the
// weights at half the speed it reads them for one row. Here each weight is read from memory once for all rows:
//
// - The columns are split into chunks, one range of whole column panels per core (XLA's intra-op thread pool plus
//   the calling thread; chunks are claimed from an atomic counter, so a late helper costs nothing).
// - A panel is NV vectors wide. Its accumulators for MT rows stay in registers while it walks KB rows of w; the
//   weights of a panel's KB rows are strided in memory, so while one block of KB rows is computed, the next block's
//   lines (contiguous per row) are prefetched into L2 a few at a time.
// - More than MT rows: the row tiles run inside the block, on weights already in cache.
// - int8 and fp8 weights: the same walk over a quarter of the bytes; each weight vector is widened to float as it is
//   loaded (fp8 through float16: its bits moved into a float16's, converted, scaled by 2^8).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

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

inline float to_float(float w) { return w; }
inline float to_float(int8_t w) { return static_cast<float>(w); }
inline float to_float(E4M3 w) {
  const int e = (w.bits >> 3) & 15, m = w.bits & 7;
  const float v = e == 0 ? std::ldexp(m / 8.0f, -6) : std::ldexp(1.0f + m / 8.0f, e - 7);
  return w.bits & 0x80 ? -v : v;
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

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

template <typename W>
struct Problem {
  const float* x;  // [M, K]
  const W* w;      // [K, N]
  float* y;        // [M, N]
  int64_t M, K, N;
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
  const float* xr = p.x + m0 * p.K + k0;
  const W* wr = p.w + k0 * p.N + n;
  for (int64_t k = 0; k < kb; ++k, wr += p.N) {
    if (pf) pf->next();
    vf wv[TN];
    for (int j = 0; j < TN; ++j) wv[j] = load(wr + j * VW);
    for (int m = 0; m < TM; ++m) {
      const vf xb = vf{} + xr[m * p.K + k];
      for (int j = 0; j < TN; ++j) acc[m][j] += xb * wv[j];
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

// Columns that fill no whole vector: plain loops (N % VW of them, at the end of the last chunk).
template <typename W>
void tail_columns(const Problem<W>& p, int64_t n0, int64_t k0, int64_t kb) {
  for (int64_t m = 0; m < p.M; ++m) {
    for (int64_t n = n0; n < p.N; ++n) {
      float a = k0 == 0 ? 0.0f : p.y[m * p.N + n];
      for (int64_t k = k0; k < k0 + kb; ++k) a += p.x[m * p.K + k] * to_float(p.w[k * p.N + n]);
      p.y[m * p.N + n] = a;
    }
  }
}

// y[:, n0:n1] for all rows: n0 is a multiple of the panel width, n1 too unless it is N.
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
    if (vec_end < n1) tail_columns(p, vec_end, k0, kb);
  }
}

// Chunks claimed by the caller and the helpers; whoever runs out of chunks to claim is done with them.
template <typename W>
struct Work {
  Problem<W> p;
  int64_t chunks, panels_per_chunk;
  std::atomic<int64_t> next{0}, finished{0};

  void run() {
    constexpr int64_t NB = NV * VW;
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      const int64_t n0 = c * panels_per_chunk * NB;
      const int64_t n1 = c == chunks - 1 ? p.N : n0 + panels_per_chunk * NB;
      chunk(p, n0, n1);
      finished.fetch_add(1, std::memory_order_release);
    }
  }
};

template <typename W, typename WBuffer>
ffi::Error SmallMatmul(const char* name, ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, WBuffer& w,
                       ffi::ResultBuffer<ffi::F32>& y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0]) {
    return ffi::Error::InvalidArgument(std::string(name) + " takes x [M, K] and w [K, N]");
  }
  const W* wp = reinterpret_cast<const W*>(w.untyped_data());  // fp8: its bytes as E4M3
  Problem<W> p{x.typed_data(), wp, y->typed_data(), xd[0], xd[1], wd[1]};
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  if (p.K == 0) {
    std::memset(p.y, 0, sizeof(float) * p.M * p.N);
    return ffi::Error::Success();
  }
  constexpr int64_t NB = NV * VW;
  const int64_t panels = std::max<int64_t>(1, p.N / NB);
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  auto work = std::make_shared<Work<W>>();
  work->p = p;
  work->chunks = std::min<int64_t>(panels, threads);
  work->panels_per_chunk = panels / work->chunks;
  netra::run_on_pool(pool, work, work->chunks - 1, work->chunks);
  return ffi::Error::Success();
}

ffi::Error SmallMatmulF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                          ffi::ResultBuffer<ffi::F32> y) {
  return SmallMatmul<float>("netra_small_matmul_f32", pool, x, w, y);
}

ffi::Error SmallMatmulI8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                         ffi::ResultBuffer<ffi::F32> y) {
  return SmallMatmul<int8_t>("netra_small_matmul_i8", pool, x, w, y);
}

ffi::Error SmallMatmulE4M3(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                           ffi::ResultBuffer<ffi::F32> y) {
  if (w.element_type() != ffi::DataType::F8E4M3FN) {  // the FFI has no typed buffer of fp8 elements
    return ffi::Error::InvalidArgument("netra_small_matmul_e4m3 takes float8_e4m3fn weights");
  }
  return SmallMatmul<E4M3>("netra_small_matmul_e4m3", pool, x, w, y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(NetraSmallMatmulF32, SmallMatmulF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(NetraSmallMatmulI8, SmallMatmulI8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(NetraSmallMatmulE4M3, SmallMatmulE4M3,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()  // float8_e4m3fn weights
                                  .Ret<ffi::Buffer<ffi::F32>>());
