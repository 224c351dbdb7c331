// Per-token paged attention for CPU, an XLA FFI handler: the reference backend's per-token path (decode rows and
// speculative runs) in C++, built with the few-row matmul (netra_jax/ops/cpu_kernels.py builds and loads both).
//
// Each listed token attends, per KV head, to its sequence's keys [lo, pos] through its block-table row: scores for
// all its query heads in one pass over the keys (each key row read once for the G query heads sharing it), an exact
// softmax over them (with the attention sink in the denominator when given), then one pass over the values. The
// jnp path reads its keys in gathered chunks inside XLA while loops, which at decode sizes costs more in loop and
// gather overhead than in arithmetic. (token, KV head) pairs are claimed one at a time by XLA's intra-op thread pool
// and the calling thread (claimed in fours, one decode token's pairs all went to one thread). Keys that span several
// 1024-position chunks are computed a chunk at a time (so one long-context token keeps every thread busy) and merged
// by the chunks' softmax statistics. A token's result depends on its own position and keys only (its chunks are
// fixed by its positions): the same alone or in any batch.
//
// The pages are float32, bfloat16 (widened in the loops, no scale), or int8 / fp8 (e4m3fn, e5m2) with one float32
// scale per (slot, KV head): each stored element is widened in the dot products' loops (fp8 through a 256-entry
// table) and the row's scale applied to the finished score (q . (s k) = s (q . k)) and to the probability weighting
// its value row.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu_attention.h"
#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace netra::attention;

struct Work {
  Problem p;
  std::vector<Item> items;
  Partial partial{nullptr, nullptr, nullptr};
  std::atomic<int64_t> next{0}, finished{0};

  void run() {
    std::vector<float> scratch;
    const int64_t count = static_cast<int64_t>(items.size());
    for (int64_t w; (w = next.fetch_add(1, std::memory_order_relaxed)) < count;) {  // one at a time: balanced
      attend_any(p, items[w], partial, scratch);
      finished.fetch_add(1, std::memory_order_release);
    }
  }
};

// The pages' element type each kv_format expects, and its name for errors.
ffi::DataType FormatType(int64_t kv_format) {
  switch (kv_format) {
    case kI8:
      return ffi::DataType::S8;
    case kE4M3:
      return ffi::DataType::F8E4M3FN;
    case kE5M2:
      return ffi::DataType::F8E5M2;
    case kBF16:
      return ffi::DataType::BF16;
    default:
      return ffi::DataType::F32;
  }
}

ffi::Error TokenAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> idx,
                          ffi::Buffer<ffi::S32> count, ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::PRED> valid,
                          ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::F32> sinks, ffi::ResultBuffer<ffi::F32> out,
                          float scale, float soft_cap, int64_t window, bool has_sinks, int64_t kv_format) {
  const auto qd = q.dimensions(), kd = k.dimensions(), rd = rows.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || rd.size() != 2 || kd[3] != qd[2] || qd[1] % kd[2] != 0) {
    return ffi::Error::InvalidArgument("netra_token_attention_f32: q [T, H, D], pages [N, P, KH, D], H % KH == 0");
  }
  if (kv_format < kF32 || kv_format > kBF16 || k.element_type() != FormatType(kv_format) ||
      v.element_type() != FormatType(kv_format)) {
    return ffi::Error::InvalidArgument("netra_token_attention_f32: pages' element type does not match kv_format");
  }
  if (kv_format != kF32 && kv_format != kBF16 && (static_cast<int64_t>(k_scale.element_count()) != kd[0] * kd[1] * kd[2] ||
                            static_cast<int64_t>(v_scale.element_count()) != kd[0] * kd[1] * kd[2])) {
    return ffi::Error::InvalidArgument("netra_token_attention_f32: scales must be [N, P, KH] for quantized pages");
  }
  Problem p{q.typed_data(),       k.untyped_data(),  v.untyped_data(),   k_scale.typed_data(),
            v_scale.typed_data(), idx.typed_data(),  pos.typed_data(),   valid.typed_data(),
            rows.typed_data(),    sinks.typed_data(), out->typed_data(), qd[0],
            qd[1],                qd[2],              kd[1],             kd[2],
            rd[1],                kd[0],              0,                 scale,
            soft_cap,             window,             has_sinks,         kv_format};
  p.count = std::clamp<int64_t>(count.typed_data()[0], 0, std::min<int64_t>(p.T, idx.dimensions()[0]));
  std::memset(p.out, 0, sizeof(float) * p.T * p.H * p.D);
  auto work = std::make_shared<Work>();
  work->p = p;
  std::vector<std::pair<int64_t, int64_t>> split;  // (first item, parts) of each split (token, KV head)
  const int64_t slots = plan(p, &work->items, &split);
  const int64_t n_items = static_cast<int64_t>(work->items.size());
  if (n_items == 0) return ffi::Error::Success();
  PartialStore partial(slots, p.H / p.KH, p.D);
  work->partial = partial.view;
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), n_items) - 1;
  netra::run_on_pool(pool, work, helpers, n_items);
  for (const auto& [w, parts] : split) combine(p, work->items, work->partial, w, parts);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(NetraTokenAttentionF32, TokenAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::AnyBuffer>()          // k pages
                                  .Arg<ffi::AnyBuffer>()          // v pages
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k scales
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v scales
                                  .Arg<ffi::Buffer<ffi::S32>>()   // tokens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // count [1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // positions
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // valid
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block-table rows
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sinks
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("window")
                                  .Attr<bool>("has_sinks")
                                  .Attr<int64_t>("kv_format"));
