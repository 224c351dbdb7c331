// Matmuls of few rows (and prefill chunks) against weights kept in llama.cpp's GGML block formats, XLA FFI handler
// for CPU: y[M, N] = x[M, K] @ W^T with float32 x and y, and W [N, K] given as the raw bytes of a GGUF tensor of
// ne [K, N] (w uint8 [N, row_bytes]). Types (the `qtype` attribute, GGML's type numbers): Q4_0 2, Q4_1 3, Q5_0 6,
// Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14, and this runtime's rows of Q4_K / Q6_K interleaved by 16, Q4_K_X16 1012,
// Q6_K_X16 1014. Built with the other CPU kernels (netra_jax/ops/cpu_kernels.py) for the host's CPU.
//
// Why: a decode step streams every weight matrix through the cores once for a few rows, so its time is the weights'
// bytes over the memory bandwidth. Kept in their 4.5-8.5 bits per weight, the weights are 4-7x fewer bytes than
// float32; each block is de-quantized in registers where it is used, never written out whole.
//
// Here: the types' table (each type's kernels for a number of rows), the split of the weight rows over the threads,
// the FFI binding, and the loader's entry to the re-lay into the interleaved layouts (NetraGgmlInterleave). The
// formats in registers are ggml_blocks.h's; the kernels ggml_matmul.h's (float32 activations, attribute int8_x = 0),
// ggml_matmul_q8.h's (int8 activations, int8_x = 1, the engine's default) and ggml_interleaved.h's (int8 activations
// against Q4_K / Q6_K rows interleaved by 16).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "cpu_pool.h"
#include "ggml_interleaved.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace netra::ggml;

// The int8-activation kernel for M rows of x (null: the type has no such path)
template <typename T>
ChunkFn q8_fn(int64_t M) {
  if constexpr (INTERLEAVED<T>) {
#if defined(NETRA_X16)
    return x16_rows<T>;
#else
    return nullptr;
#endif
  } else {
#if defined(NETRA_Q8_GROUPS)
    if constexpr (GROUPED<T>) return M <= FEW_ROWS<T> ? q8_groups<T> : q8_lanes<T>;
#endif
    if constexpr (T::U_BITS > 0) return M <= FEW_ROWS<T> ? q8_rows<T> : q8_lanes<T>;
    return nullptr;
  }
}

struct Format {
  int32_t ggml_type;
  const char* name;
  int64_t qk, bytes;
  ChunkFn (*chunk)(int64_t M);
  ChunkFn (*q8)(int64_t M);  // int8 activations (null: the type has no such path)
  int64_t q8_few;            // rows the int8 path reads weight row by weight row (FEW_ROWS)
  Q8Rows (*quantize)(const float* x, int64_t M, int64_t K);  // x for the int8-activation path
  int64_t interleaved;       // weight rows whose blocks lie side by side (the chunks' unit), 0: row by row
};

template <typename T>
constexpr int64_t interleaved_rows() {
  if constexpr (INTERLEAVED<T>) {
    return T::ROWS;
  } else {
    return 0;
  }
}

template <typename T>
constexpr Format format(int32_t ggml_type, const char* name) {
  return {ggml_type,   name,          T::QK, T::BYTES, chunk_fn<T>, q8_fn<T>, FEW_ROWS<T>, quantize_rows<T>,
          interleaved_rows<T>()};
}

// GGML's type numbers; Q4_K_X16 (1012) and Q6_K_X16 (1014) are this runtime's layouts of Q4_K and Q6_K rows
// (ggml_blocks.h), not GGUF types
constexpr Format FORMATS[] = {
    format<Q4_0>(2, "Q4_0"),  format<Q4_1>(3, "Q4_1"),  format<Q5_0>(6, "Q5_0"),
    format<Q5_1>(7, "Q5_1"),  format<Q8_0>(8, "Q8_0"),  format<Q4_K>(12, "Q4_K"),
    format<Q5_K>(13, "Q5_K"), format<Q6_K>(14, "Q6_K"), format<Q4_KX16>(1012, "Q4_K_X16"),
    format<Q6_KX16>(1014, "Q6_K_X16"),
};

// Chunks of whole units of weight rows, claimed by the caller and the helpers. Each thread works from its own copy
// of the problem (the kernels read its fields in their loops); the counters, written by every thread, have cache
// lines of their own.
struct Work {
  Problem p;
  ChunkFn fn;
  int64_t units, unit, chunks;
  alignas(64) std::atomic<int64_t> next{0};
  alignas(64) std::atomic<int64_t> finished{0};

  void run() {
    const Problem mine = p;
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      const int64_t n0 = c * units / chunks * unit;
      const int64_t n1 = std::min(mine.N, (c + 1) * units / chunks * unit);
      fn(mine, n0, n1);
      finished.fetch_add(1, std::memory_order_release);
    }
  }
};

constexpr int64_t CHUNKS_PER_THREAD = 4;  // a helper that starts late leaves the others less to wait for

ffi::Error GgmlMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                      ffi::ResultBuffer<ffi::F32> y, int32_t qtype, int32_t int8_x) {
  const Format* f = nullptr;
  for (const Format& g : FORMATS) {
    if (g.ggml_type == qtype) f = &g;
  }
  if (f == nullptr) {
    return ffi::Error::InvalidArgument("netra_ggml_matmul_f32: GGML type " + std::to_string(qtype) +
                                       " is not one of Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12), "
                                       "Q5_K (13), Q6_K (14), Q4_K_X16 (1012), Q6_K_X16 (1014)");
  }
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  const std::string format = std::string(" (") + f->name + ": " + std::to_string(f->qk) + " values in " +
                             std::to_string(f->bytes) + " bytes per block)";
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2) {
    return ffi::Error::InvalidArgument("netra_ggml_matmul_f32 takes x [M, K], w [N, row_bytes], y [M, N]" + format);
  }
  if (wd[1] % f->bytes != 0 || wd[1] / f->bytes * f->qk != xd[1]) {
    return ffi::Error::InvalidArgument("netra_ggml_matmul_f32: w's rows of " + std::to_string(wd[1]) +
                                       " bytes are not K = " + std::to_string(xd[1]) + " values" + format);
  }
  if (yd[0] != xd[0] || yd[1] != wd[0]) {
    return ffi::Error::InvalidArgument("netra_ggml_matmul_f32: y is not [M, N] = [" + std::to_string(xd[0]) + ", " +
                                       std::to_string(wd[0]) + "]");
  }
  if (int8_x != 0 && f->q8(1) == nullptr) {
    return ffi::Error::InvalidArgument(std::string("netra_ggml_matmul_f32: ") + f->name +
                                       " has no int8-activation path in this build (int8_x = 1)");
  }
  if (int8_x == 0 && f->chunk(1) == nullptr) {
    return ffi::Error::InvalidArgument(std::string("netra_ggml_matmul_f32: ") + f->name +
                                       " has no float32-activation path (int8_x = 0)");
  }
  if (f->interleaved != 0 && wd[0] % f->interleaved != 0) {
    return ffi::Error::InvalidArgument(std::string("netra_ggml_matmul_f32: ") + f->name + " weights hold groups of " +
                                       std::to_string(f->interleaved) + " rows, w has " + std::to_string(wd[0]));
  }
  Problem p{x.typed_data(), w.typed_data(), y->typed_data(), xd[0], xd[1], wd[0], wd[1], nullptr, nullptr};
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  if (p.K == 0) {
    std::memset(p.y, 0, sizeof(float) * p.M * p.N);
    return ffi::Error::Success();
  }
  std::unique_ptr<vf[]> xs;
  Q8Rows q8;
  if (int8_x != 0) {
    q8 = f->quantize(p.x, p.M, p.K);
    p.q8 = &q8;
  } else {
    xs = x_by_steps(p);
    p.xs = reinterpret_cast<const float*>(xs.get());
  }
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  auto work = std::make_shared<Work>();
  work->p = p;
  work->fn = int8_x != 0 ? f->q8(p.M) : f->chunk(p.M);
  work->unit = f->interleaved != 0 ? f->interleaved
               : int8_x != 0       ? (p.M <= f->q8_few ? ROW_UNIT : TNQ)
               : p.M == 1          ? ROW_UNIT
                                   : TN;
  work->units = (p.N + work->unit - 1) / work->unit;
  work->chunks = std::min(work->units, threads * CHUNKS_PER_THREAD);
  netra::run_on_pool(pool, work, std::min(threads, work->chunks) - 1, work->chunks);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(NetraGgmlMatmulF32, GgmlMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("qtype")
                                  .Attr<int32_t>("int8_x"));

// Rows of the interleaved layouts' groups when this build reads them (AVX-512 VNNI), else 0: the loader makes them
// only then
extern "C" int32_t NetraGgmlInterleavedRows() { return INTERLEAVED_ROWS; }

// The loader's re-lay into the interleaved layouts (`interleave_rows` in ggml_interleaved.h): 0, or -1 for another
// type or rows not in groups of 16
extern "C" int32_t NetraGgmlInterleave(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t row_bytes,
                                       int32_t ggml_type) {
  return interleave_rows(src, dst, rows, row_bytes, ggml_type);
}
