// Per-token paged attention for CPU, an XLA FFI handler: the reference backend's per-token path (decode rows and
// speculative runs) in C++, built with the few-row matmul (netra_jax/ops/cpu_kernels.py builds and loads both).
//
// Each listed token attends, per KV head, to its sequence's keys [lo, pos] through its block-table row: scores for
// all its query heads in one pass over the keys (each key row read once for the G query heads sharing it), an exact
// softmax over them (with the attention sink in the denominator when given), then one pass over the values. The
// jnp path reads its keys in gathered chunks inside XLA while loops, which at decode sizes costs more in loop and
// gather overhead than in arithmetic. (token, KV head) pairs are spread over XLA's intra-op thread pool and the
// calling thread. A token's result depends on its own position and keys only: the same alone or in any batch.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Problem {
  const float* q;        // [T, H, D]
  const float* k;        // [num_pages, P, KH, D]
  const float* v;        // [num_pages, P, KH, D]
  const int32_t* idx;    // [T] tokens to compute, the first `count` of them
  const int32_t* pos;    // [T] each token's absolute position
  const bool* valid;     // [T] real (non-padding) token
  const int32_t* rows;   // [T, max_pages] each token's block-table row
  const float* sinks;    // [H] sink logits (read when has_sinks)
  float* out;            // [T, H, D]
  int64_t T, H, D, P, KH, max_pages, num_pages, count;
  float scale, soft_cap;  // soft_cap 0: none
  int64_t window;         // 0: none
  bool has_sinks;
};

// x[i] = exp(x[i] - m) for x[i] - m <= 0, in a loop the compiler vectorizes: Cephes' expf (2^n times a degree-6
// polynomial of the remainder), within 2 ulp; arguments below -87 give 0 (as expf does, up to denormals).
void exp_shifted(float* x, int64_t n, float m) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::max(x[i] - m, -87.0f);
    const float fn = __builtin_floorf(v * 1.44269504088896341f + 0.5f);
    const float r = v - fn * 0.693359375f + fn * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(fn) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    x[i] = v <= -87.0f ? 0.0f : p * scale;
  }
}

// Attention of token t's query heads of KV head kh. s: scratch of at least G * (pos + 1) floats.
void attend(const Problem& p, int64_t t, int64_t kh, std::vector<float>& s) {
  const int64_t G = p.H / p.KH, D = p.D;
  float* o = p.out + (t * p.H + kh * G) * D;  // [G, D]
  const int64_t pos = p.pos[t];
  if (!p.valid[t] || pos < 0) return;  // zeros, written before
  const int64_t lo = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
  const int64_t n = pos + 1 - lo;
  if (static_cast<int64_t>(s.size()) < G * n) s.resize(G * n);
  std::vector<float> qs(G * D);  // scaled queries [G, D]
  const float* q = p.q + (t * p.H + kh * G) * D;
  for (int64_t i = 0; i < G * D; ++i) qs[i] = q[i] * p.scale;
  const int32_t* row = p.rows + t * p.max_pages;
  const int64_t stride = p.KH * D;  // between consecutive keys of a page

  // calls f(j, key or value row of key j) for j = lo .. pos in order, a page at a time
  auto for_keys = [&](const float* pages, auto&& f) {
    for (int64_t first = lo - lo % p.P; first <= pos; first += p.P) {
      const int64_t page = std::clamp<int64_t>(row[first / p.P], 0, p.num_pages - 1);
      const float* base = pages + page * p.P * stride + kh * D;
      const int64_t j0 = std::max(first, lo), j1 = std::min(first + p.P - 1, pos);
      for (int64_t j = j0; j <= j1; ++j) f(j, base + (j - first) * stride);
    }
  };

  // scores [G, n]
  for_keys(p.k, [&](int64_t j, const float* kr) {
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qs.data() + g * D;
      float acc = 0.0f;
      for (int64_t d = 0; d < D; ++d) acc += qg[d] * kr[d];
      if (p.soft_cap > 0.0f) acc = p.soft_cap * std::tanh(acc / p.soft_cap);
      s[g * n + (j - lo)] = acc;
    }
  });
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s.data() + g * n;
    float m = *std::max_element(sg, sg + n);
    const float sink = p.has_sinks ? p.sinks[kh * G + g] : 0.0f;
    if (p.has_sinks) m = std::max(m, sink);
    float l = p.has_sinks ? std::exp(sink - m) : 0.0f;
    exp_shifted(sg, n, m);
    for (int64_t j = 0; j < n; ++j) l += sg[j];
    const float inv = 1.0f / l;
    for (int64_t j = 0; j < n; ++j) sg[j] *= inv;
  }
  // out [G, D] = probabilities [G, n] @ values [n, D]
  for_keys(p.v, [&](int64_t j, const float* vr) {
    for (int64_t g = 0; g < G; ++g) {
      const float w = s[g * n + (j - lo)];
      float* og = o + g * D;
      for (int64_t d = 0; d < D; ++d) og[d] += w * vr[d];
    }
  });
}

struct Work {
  Problem p;
  int64_t items;  // count * KH
  std::atomic<int64_t> next{0}, finished{0};

  void run() {
    std::vector<float> scratch;
    constexpr int64_t BATCH = 4;  // items claimed at once
    for (int64_t i; (i = next.fetch_add(BATCH, std::memory_order_relaxed)) < items;) {
      const int64_t end = std::min(items, i + BATCH);
      for (int64_t w = i; w < end; ++w) {
        const int64_t t = p.idx[w / p.KH];
        if (t >= 0 && t < p.T) attend(p, t, w % p.KH, scratch);
      }
      finished.fetch_add(end - i, std::memory_order_release);
    }
  }
};

ffi::Error TokenAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                          ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> idx, ffi::Buffer<ffi::S32> count,
                          ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::PRED> valid, ffi::Buffer<ffi::S32> rows,
                          ffi::Buffer<ffi::F32> sinks, ffi::ResultBuffer<ffi::F32> out, float scale, float soft_cap,
                          int64_t window, bool has_sinks) {
  const auto qd = q.dimensions(), kd = k.dimensions(), rd = rows.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || rd.size() != 2 || kd[3] != qd[2] || qd[1] % kd[2] != 0) {
    return ffi::Error::InvalidArgument("netra_token_attention_f32: q [T, H, D], pages [N, P, KH, D], H % KH == 0");
  }
  Problem p{q.typed_data(), k.typed_data(), v.typed_data(), idx.typed_data(), pos.typed_data(),
            valid.typed_data(), rows.typed_data(), sinks.typed_data(), out->typed_data(),
            qd[0], qd[1], qd[2], kd[1], kd[2], rd[1], kd[0], 0, scale, soft_cap, window, has_sinks};
  p.count = std::clamp<int64_t>(count.typed_data()[0], 0, std::min<int64_t>(p.T, idx.dimensions()[0]));
  std::memset(p.out, 0, sizeof(float) * p.T * p.H * p.D);
  auto work = std::make_shared<Work>();
  work->p = p;
  work->items = p.count * p.KH;
  if (work->items == 0) return ffi::Error::Success();
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), (work->items + 3) / 4) - 1;
  netra::run_on_pool(pool, work, helpers, work->items);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(NetraTokenAttentionF32, TokenAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k pages
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v pages
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
                                  .Attr<bool>("has_sinks"));
