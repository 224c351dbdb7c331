// How the C++ CPU kernels use several cores: a job runs on the calling thread and on helpers from XLA's intra-op
// thread pool; the job hands out its own pieces, so a helper that starts late finds none left and returns.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace netra {

// job->run() claims and does pieces until none are left, counting each in job->finished; returns once all `total`
// pieces are finished (the calling thread spins for the last ones: they are short).
template <typename Job>
void run_on_pool(xla::ffi::ThreadPool& pool, const std::shared_ptr<Job>& job, int64_t helpers, int64_t total) {
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->run(); });
  job->run();
  while (job->finished.load(std::memory_order_acquire) < total) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
}

}  // namespace netra
