// Few-row matmuls for CPU, XLA FFI handlers: y[M, N] = x[M, K] @ w[K, N] (w row-major, [in, out]) with float32 x
// and y, and w in float32, bfloat16, int8 or float8 e4m3fn (converted to float in registers; the caller applies a
// quantized weight's scales). The kernel itself is in cpu_matmul.h (shared with the fused decode layer).
// Built on first use with the host's compiler for the host's CPU (netra_jax/ops/cpu_kernels.py builds and loads it).
//
// Why: a decode step multiplies a few rows (one per running sequence) by every weight matrix, so it is a stream of
// the weights through the cores. XLA's CPU dot tiles such a matmul for 4 rows at a time and, at 8 rows, reads the
// weights at half the speed it reads them for one row. Here each weight is read from memory once for all rows:
//
// - The columns are split into chunks, one range of whole column panels per core (XLA's intra-op thread pool plus
//   the calling thread; chunks are claimed from an atomic counter, so a late helper costs nothing).
// - Up to 4 rows: the chunk's columns are walked a few rows of w at a time, each row's run contiguous in memory.
// - More rows: a panel is NV vectors wide. Its accumulators for MT rows stay in registers while it walks KB rows of
//   w; the weights of a panel's KB rows are strided in memory, so while one block of KB rows is computed, the next
//   block's lines (contiguous per row) are prefetched into L2 a few at a time. The row tiles run inside the block,
//   on weights already in cache.
// - int8 and fp8 weights: the same walk over a quarter of the bytes; each weight vector is widened to float as it is
//   loaded (fp8 through float16: its bits moved into a float16's, converted, scaled by 2^8).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "cpu_matmul.h"
#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using netra::rows::BF16;
using netra::rows::E4M3;
using netra::rows::NV;
using netra::rows::Problem;
using netra::rows::VW;

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
      netra::rows::columns(p, n0, n1);
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

ffi::Error SmallMatmulBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                           ffi::ResultBuffer<ffi::F32> y) {
  if (w.element_type() != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("netra_small_matmul_bf16 takes bfloat16 weights");
  }
  return SmallMatmul<BF16>("netra_small_matmul_bf16", pool, x, w, y);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(NetraSmallMatmulBF16, SmallMatmulBF16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()  // bfloat16 weights
                                  .Ret<ffi::Buffer<ffi::F32>>());
