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
// The pages are float32, or int8 / fp8 (e4m3fn, e5m2) with one float32 scale per (slot, KV head): each stored
// element is widened in the dot products' loops (fp8 through a 256-entry table) and the row's scale applied to the
// finished score (q . (s k) = s (q . k)) and to the probability weighting its value row.
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

// The pages' storage formats (the `kv_format` attribute).
enum KvFormat : int64_t { kF32 = 0, kI8 = 1, kE4M3 = 2, kE5M2 = 3 };

// float value of every fp8 bit pattern: e4m3fn (bias 7, no infinities, S.1111.111 NaN) or e5m2 (bias 15, IEEE-like)
struct Fp8Table {
  float v[256];
  Fp8Table(int mant_bits, int bias, bool ieee_top) {
    const int exp_max = (1 << (7 - mant_bits)) - 1;
    for (int b = 0; b < 256; ++b) {
      const int sign = b >> 7, e = (b >> mant_bits) & exp_max, m = b & ((1 << mant_bits) - 1);
      const float frac = static_cast<float>(m) / static_cast<float>(1 << mant_bits);
      float x;
      if (e == 0) {
        x = std::ldexp(frac, 1 - bias);  // subnormal
      } else if (e == exp_max && (ieee_top || m == (1 << mant_bits) - 1)) {
        x = (ieee_top && m == 0) ? INFINITY : NAN;
      } else {
        x = std::ldexp(1.0f + frac, e - bias);
      }
      v[b] = sign ? -x : x;
    }
  }
};
const Fp8Table kE4M3Table(3, 7, false);
const Fp8Table kE5M2Table(2, 15, true);

// Element widening per storage format: at(row, d) is element d of a key or value row as float (before its scale).
struct F32Elems {
  using T = float;
  static float at(const T* r, int64_t d) { return r[d]; }
};
struct I8Elems {
  using T = int8_t;
  static float at(const T* r, int64_t d) { return static_cast<float>(r[d]); }
};
template <const Fp8Table& TABLE>
struct Fp8Elems {
  using T = uint8_t;
  static float at(const T* r, int64_t d) { return TABLE.v[r[d]]; }
};

struct Problem {
  const float* q;        // [T, H, D]
  const void* k;         // [num_pages, P, KH, D] float32, int8 or fp8 (kv_format)
  const void* v;         // [num_pages, P, KH, D]
  const float* k_scale;  // [num_pages, P, KH] (quantized formats only)
  const float* v_scale;  // [num_pages, P, KH]
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
  int64_t kv_format;  // KvFormat
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

// A token's keys are computed in parts when they span more than one CHUNK of absolute positions: the parts are those
// chunks, so how a token is computed depends on its own positions alone, never on the batch around it.
constexpr int64_t CHUNK = 1024;

// One work item: token t's attention for KV head kh over keys [a, b]; slot >= 0: a part, whose softmax statistics
// and unnormalized output go to the partial buffers' slot, < 0: the whole range, finished into the output.
struct Item {
  int64_t t, kh, a, b, slot;
};

// The parts' statistics and unnormalized outputs: o [slots, G, D], m and l [slots, G].
struct Partial {
  float* o;
  float* m;
  float* l;
};

// The keys token t sees: [lo, pos] (window or not); an empty range (hi < lo) for padding.
inline void key_range(const Problem& p, int64_t t, int64_t* lo, int64_t* hi) {
  const int64_t pos = p.pos[t];
  *hi = p.valid[t] && pos >= 0 ? pos : -1;
  *lo = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
}

// Item `it` of the attention of token it.t's query heads of KV head it.kh, pages stored as ELEMS says: the whole
// range finished into p.out, or a part's softmax statistics (m: its largest score, l: the sum of exp(score - m)) and
// unnormalized output sum(exp(score - m) v) into `partial`, for `combine` to merge. s: scratch, grown as needed.
template <typename ELEMS>
void attend(const Problem& p, const Item& it, const Partial& partial, std::vector<float>& s) {
  using T = typename ELEMS::T;
  const int64_t G = p.H / p.KH, D = p.D, t = it.t, kh = it.kh;
  const int64_t lo = it.a, pos = it.b;
  float* o = p.out + (t * p.H + kh * G) * D;  // [G, D]
  float* m_out = nullptr;
  float* l_out = nullptr;
  if (it.slot >= 0) {
    o = partial.o + it.slot * G * D;
    m_out = partial.m + it.slot * G;
    l_out = partial.l + it.slot * G;
  }
  const int64_t n = pos + 1 - lo;  // >= 1: items cover non-empty ranges
  if (static_cast<int64_t>(s.size()) < G * n) s.resize(G * n);
  std::vector<float> qs(G * D);  // scaled queries [G, D]
  const float* q = p.q + (t * p.H + kh * G) * D;
  for (int64_t i = 0; i < G * D; ++i) qs[i] = q[i] * p.scale;
  const int32_t* row = p.rows + t * p.max_pages;
  const int64_t stride = p.KH * D;  // between consecutive keys of a page

  const bool scaled = p.kv_format != kF32;

  // calls f(j, key or value row of key j, its scale) for j = lo .. pos in order, a page at a time
  auto for_keys = [&](const void* pages, const float* scales, auto&& f) {
    for (int64_t first = lo - lo % p.P; first <= pos; first += p.P) {
      const int64_t page = std::clamp<int64_t>(row[first / p.P], 0, p.num_pages - 1);
      const T* base = static_cast<const T*>(pages) + page * p.P * stride + kh * D;
      const int64_t j0 = std::max(first, lo), j1 = std::min(first + p.P - 1, pos);
      for (int64_t j = j0; j <= j1; ++j) {
        const float sc = scaled ? scales[(page * p.P + (j - first)) * p.KH + kh] : 1.0f;
        f(j, base + (j - first) * stride, sc);
      }
    }
  };

  // scores [G, n]
  for_keys(p.k, p.k_scale, [&](int64_t j, const T* kr, float ks) {
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qs.data() + g * D;
      float acc = 0.0f;
      for (int64_t d = 0; d < D; ++d) acc += qg[d] * ELEMS::at(kr, d);
      if (scaled) acc *= ks;
      if (p.soft_cap > 0.0f) acc = p.soft_cap * std::tanh(acc / p.soft_cap);
      s[g * n + (j - lo)] = acc;
    }
  });
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s.data() + g * n;
    float m = *std::max_element(sg, sg + n);
    const bool sink_here = p.has_sinks && m_out == nullptr;  // a part leaves the sink to `combine`
    const float sink = sink_here ? p.sinks[kh * G + g] : 0.0f;
    if (sink_here) m = std::max(m, sink);
    float l = sink_here ? std::exp(sink - m) : 0.0f;
    exp_shifted(sg, n, m);
    for (int64_t j = 0; j < n; ++j) l += sg[j];
    if (m_out != nullptr) {  // a part: unnormalized, its statistics kept
      m_out[g] = m;
      l_out[g] = l;
      continue;
    }
    const float inv = 1.0f / l;
    for (int64_t j = 0; j < n; ++j) sg[j] *= inv;
  }
  // out [G, D] = probabilities [G, n] @ values [n, D]
  for_keys(p.v, p.v_scale, [&](int64_t j, const T* vr, float vs) {
    for (int64_t g = 0; g < G; ++g) {
      const float w = s[g * n + (j - lo)] * vs;
      float* og = o + g * D;
      for (int64_t d = 0; d < D; ++d) og[d] += w * ELEMS::at(vr, d);
    }
  });
}

struct Work {
  Problem p;
  std::vector<Item> items;
  Partial partial{nullptr, nullptr, nullptr};
  std::atomic<int64_t> next{0}, finished{0};

  void run() {
    std::vector<float> scratch;
    const int64_t count = static_cast<int64_t>(items.size());
    for (int64_t w; (w = next.fetch_add(1, std::memory_order_relaxed)) < count;) {  // one at a time: balanced
      switch (p.kv_format) {
        case kI8:
          attend<I8Elems>(p, items[w], partial, scratch);
          break;
        case kE4M3:
          attend<Fp8Elems<kE4M3Table>>(p, items[w], partial, scratch);
          break;
        case kE5M2:
          attend<Fp8Elems<kE5M2Table>>(p, items[w], partial, scratch);
          break;
        default:
          attend<F32Elems>(p, items[w], partial, scratch);
      }
      finished.fetch_add(1, std::memory_order_release);
    }
  }

  // Each split (token, KV head)'s parts (items [w, w + parts), in key order) merged into p.out: every part's output
  // and sum rescaled to the largest score among them (and the sink's), summed in order, divided.
  void combine(int64_t w, int64_t parts) const {
    const int64_t G = p.H / p.KH, D = p.D, t = items[w].t, kh = items[w].kh, first = items[w].slot;
    for (int64_t g = 0; g < G; ++g) {
      const float sink = p.has_sinks ? p.sinks[kh * G + g] : -INFINITY;
      float top = sink;
      for (int64_t part = 0; part < parts; ++part) top = std::max(top, partial.m[(first + part) * G + g]);
      float l = p.has_sinks ? std::exp(sink - top) : 0.0f;
      float* o = p.out + (t * p.H + kh * G + g) * D;
      for (int64_t part = 0; part < parts; ++part) {
        const int64_t slot = first + part;
        const float scale = std::exp(partial.m[slot * G + g] - top);
        l += scale * partial.l[slot * G + g];
        const float* po = partial.o + (slot * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += scale * po[d];
      }
      const float inv = 1.0f / l;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
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
  if (kv_format < kF32 || kv_format > kE5M2 || k.element_type() != FormatType(kv_format) ||
      v.element_type() != FormatType(kv_format)) {
    return ffi::Error::InvalidArgument("netra_token_attention_f32: pages' element type does not match kv_format");
  }
  if (kv_format != kF32 && (static_cast<int64_t>(k_scale.element_count()) != kd[0] * kd[1] * kd[2] ||
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
  // the items: per listed token and KV head its whole key range, or its parts, one per CHUNK of positions it spans
  std::vector<std::pair<int64_t, int64_t>> split;  // (first item, parts) of each split (token, KV head)
  int64_t slots = 0;
  for (int64_t i = 0; i < p.count; ++i) {
    const int64_t t = p.idx[i];
    if (t < 0 || t >= p.T) continue;
    int64_t lo, hi;
    key_range(p, t, &lo, &hi);
    if (hi < lo) continue;  // padding: zeros
    const int64_t parts = hi / CHUNK - lo / CHUNK + 1;
    for (int64_t kh = 0; kh < p.KH; ++kh) {
      if (parts == 1) {
        work->items.push_back({t, kh, lo, hi, -1});
        continue;
      }
      split.emplace_back(static_cast<int64_t>(work->items.size()), parts);
      for (int64_t c = lo / CHUNK; c <= hi / CHUNK; ++c) {
        work->items.push_back({t, kh, std::max(lo, c * CHUNK), std::min(hi, c * CHUNK + CHUNK - 1), slots++});
      }
    }
  }
  const int64_t n_items = static_cast<int64_t>(work->items.size());
  if (n_items == 0) return ffi::Error::Success();
  std::vector<float> partial_o, partial_ml;
  if (slots > 0) {
    const int64_t G = p.H / p.KH;
    partial_o.resize(slots * G * p.D);
    partial_ml.resize(2 * slots * G);
    work->partial = Partial{partial_o.data(), partial_ml.data(), partial_ml.data() + slots * G};
  }
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), n_items) - 1;
  netra::run_on_pool(pool, work, helpers, n_items);
  for (const auto& [w, parts] : split) work->combine(w, parts);
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
