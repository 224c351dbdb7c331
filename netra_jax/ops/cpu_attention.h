// The per-token paged attention's core, shared by the FFI attention (cpu_attention.cc) and the fused decode layer
// (cpu_decode_layer.cc): the work items of a step's tokens, one item's scores, softmax and values, and the merge of
// a long context's parts.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_matmul.h"

namespace netra::attention {

// The pages' storage formats (the `kv_format` attribute).
enum KvFormat : int64_t { kF32 = 0, kI8 = 1, kE4M3 = 2, kE5M2 = 3, kBF16 = 4 };

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
inline const Fp8Table kE4M3Table(3, 7, false);
inline const Fp8Table kE5M2Table(2, 15, true);

// Element widening per storage format: at(row, d) is element d of a key or value row as float (before its scale).
struct F32Elems {
  using T = float;
  static float at(const T* r, int64_t d) { return r[d]; }
};
struct I8Elems {
  using T = int8_t;
  static float at(const T* r, int64_t d) { return static_cast<float>(r[d]); }
};
struct BF16Elems {  // unscaled, as float32 pages
  using T = netra::rows::BF16;
  static float at(const T* r, int64_t d) { return netra::rows::to_float(r[d]); }
};
template <const Fp8Table& TABLE>
struct Fp8Elems {
  using T = uint8_t;
  static float at(const T* r, int64_t d) { return TABLE.v[r[d]]; }
};

struct Problem {
  const float* q;        // [T, H, D]
  const void* k;         // [num_pages, P, KH, D] float32, bfloat16, int8 or fp8 (kv_format)
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
inline void exp_shifted(float* x, int64_t n, float m) {
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

// Register walks for float32 pages: a KV head's G scaled queries (scores) or G outputs (values) held in vector
// registers across its keys, for D a whole number of vectors and G x D within the register budget. The generic
// loops below keep the outputs in memory and reload each query per key: at 32 decode rows the attention was 44% of a
// SmolLM2 layer, its loads and stores of the outputs half of that.
// the few-row matmul's vectors (VW floats) and their loads and stores
using netra::rows::load;
using netra::rows::store;
using netra::rows::vf;
using netra::rows::VW;
#if defined(__AVX512F__)
constexpr int AREGS = 24;  // vectors of queries or outputs kept in registers (of 32)
#elif defined(__AVX__)
constexpr int AREGS = 10;  // of 16
#else
constexpr int AREGS = 8;
#endif

// Lanes of x and y for one level of `lane_sums`: x holds VW / B keys' partial sums of B lanes each (so does y);
// H = 0 takes the first half of each key's lanes, H = 1 the second, x's keys before y's.
template <int B, int H, int... I>
inline vf pick(vf x, vf y, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(
      x, y, ((I < VW / 2 ? 0 : VW) + ((I % (VW / 2)) / (B / 2)) * B + H * (B / 2) + (I % (VW / 2)) % (B / 2))...);
}

// v[0..B): VW / B keys' partial sums per vector, B lanes each -> v[0] lane i: key i's sum (keys in order). A tree:
// each level adds the two halves of every key's lanes, two vectors into one, log2(VW) levels for VW keys.
template <int B>
inline void lane_sums(vf* v) {
  if constexpr (B > 1) {
    constexpr auto lanes = std::make_integer_sequence<int, VW>{};
    for (int i = 0; i < B / 2; ++i) {
      v[i] = pick<B, 0>(v[2 * i], v[2 * i + 1], lanes) + pick<B, 1>(v[2 * i], v[2 * i + 1], lanes);
    }
    lane_sums<B / 2>(v);
  }
}

template <int G, int DV>
struct RegWalk {
  static constexpr int D = DV * VW;

  // s[g * n + j - lo] = (soft-capped) q_g . k_j for the keys for_keys visits (in order, consecutive); qs: [G, D]
  // scaled queries. Each key's products are summed lane-wise, then VW keys' lanes at once (`lane_sums`): one lane
  // sum per key took more instructions than its products.
  template <typename ForKeys>
  static void scores(const float* qs, ForKeys&& for_keys, const void* pages, float* s, int64_t n, int64_t lo,
                     float soft_cap) {
    vf q[G][DV];
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < DV; ++c) q[g][c] = load(qs + g * D + c * VW);
    }
    vf part[G][VW];  // the block's keys' lane-wise products, per query head
    int64_t nb = 0, first = 0;  // keys in the block, the first one's index in s
    auto flush = [&] {
      for (int g = 0; g < G; ++g) {
        for (int64_t i = nb; i < VW; ++i) part[g][i] = vf{};
        lane_sums<VW>(part[g]);
        float* out = s + g * n + first;
        for (int64_t i = 0; i < nb; ++i) {
          const float a = part[g][0][i];
          out[i] = soft_cap > 0.0f ? soft_cap * std::tanh(a / soft_cap) : a;
        }
      }
    };
    for_keys(pages, nullptr, [&](int64_t j, const float* kr, float) {
      vf k[DV];
      for (int c = 0; c < DV; ++c) k[c] = load(kr + c * VW);
      if (nb == 0) first = j - lo;
      for (int g = 0; g < G; ++g) {
        vf acc = q[g][0] * k[0];
        for (int c = 1; c < DV; ++c) acc += q[g][c] * k[c];
        part[g][nb] = acc;
      }
      if (++nb == VW) flush(), nb = 0;
    });
    if (nb > 0) flush();
  }

  // o [G, D] += probabilities [G, n] @ values, over the keys for_keys visits
  template <typename ForKeys>
  static void values(const float* s, ForKeys&& for_keys, const void* pages, float* o, int64_t n, int64_t lo) {
    vf acc[G][DV];
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < DV; ++c) acc[g][c] = load(o + g * D + c * VW);
    }
    for_keys(pages, nullptr, [&](int64_t j, const float* vr, float) {
      vf v[DV];
      for (int c = 0; c < DV; ++c) v[c] = load(vr + c * VW);
      for (int g = 0; g < G; ++g) {
        const vf w = vf{} + s[g * n + (j - lo)];
        for (int c = 0; c < DV; ++c) acc[g][c] += w * v[c];
      }
    });
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < DV; ++c) store(o + g * D + c * VW, acc[g][c]);
    }
  }
};

template <int G, int DV, typename F>
bool try_walk(int64_t g, int64_t dv, F& f) {
  if constexpr (G * DV <= AREGS) {
    if (g == G && dv == DV) {
      f(RegWalk<G, DV>{});
      return true;
    }
  }
  return false;
}

template <int DV, typename F>
bool try_heads(int64_t g, int64_t dv, F& f) {
  return try_walk<1, DV>(g, dv, f) || try_walk<2, DV>(g, dv, f) || try_walk<3, DV>(g, dv, f) ||
         try_walk<4, DV>(g, dv, f) || try_walk<5, DV>(g, dv, f) || try_walk<6, DV>(g, dv, f) ||
         try_walk<7, DV>(g, dv, f) || try_walk<8, DV>(g, dv, f);
}

// Calls f(RegWalk<G, D / VW>{}) when a register walk takes (G, D); false when none does.
template <typename F>
bool with_reg_walk(int64_t G, int64_t D, F&& f) {
  if (D % VW != 0) return false;
  const int64_t dv = D / VW;
  return try_heads<1>(G, dv, f) || try_heads<2>(G, dv, f) || try_heads<4>(G, dv, f) || try_heads<8>(G, dv, f);
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

  const bool scaled = p.kv_format != kF32 && p.kv_format != kBF16;

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

  // each row of scores s [G, n] -> its softmax (a part: unnormalized, its statistics kept)
  auto softmax = [&](float* s) {
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s + g * n;
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
  };

  // float32 pages whose (G, D) a register walk takes: it does the two passes over the keys
  bool walked = false;
  if constexpr (std::is_same_v<ELEMS, F32Elems>) {
    walked = with_reg_walk(G, D, [&](auto walk) {
      walk.scores(qs.data(), for_keys, p.k, s.data(), n, lo, p.soft_cap);
      softmax(s.data());
      walk.values(s.data(), for_keys, p.v, o, n, lo);
    });
  }
  if (walked) return;

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
  softmax(s.data());
  // out [G, D] = probabilities [G, n] @ values [n, D]
  for_keys(p.v, p.v_scale, [&](int64_t j, const T* vr, float vs) {
    for (int64_t g = 0; g < G; ++g) {
      const float w = s[g * n + (j - lo)] * vs;
      float* og = o + g * D;
      for (int64_t d = 0; d < D; ++d) og[d] += w * ELEMS::at(vr, d);
    }
  });
}


// Storage for `slots` parts' unnormalized outputs [slots, G, D] and statistics m, l [slots, G], and its view.
struct PartialStore {
  std::vector<float> data;
  Partial view{nullptr, nullptr, nullptr};

  PartialStore(int64_t slots, int64_t G, int64_t D) : data(slots * G * (D + 2)) {
    if (slots > 0) view = Partial{data.data(), data.data() + slots * G * D, data.data() + slots * G * (D + 1)};
  }
};

// The items of the listed tokens p.idx[:p.count]: per token and KV head its whole key range, or its parts, one per
// CHUNK of positions it spans (their partial slots numbered in order). splits: (first item, parts) of each split
// (token, KV head). Returns the number of partial slots.
inline int64_t plan(const Problem& p, std::vector<Item>* items, std::vector<std::pair<int64_t, int64_t>>* splits) {
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
        items->push_back({t, kh, lo, hi, -1});
        continue;
      }
      splits->emplace_back(static_cast<int64_t>(items->size()), parts);
      for (int64_t c = lo / CHUNK; c <= hi / CHUNK; ++c) {
        items->push_back({t, kh, std::max(lo, c * CHUNK), std::min(hi, c * CHUNK + CHUNK - 1), slots++});
      }
    }
  }
  return slots;
}

// Item `it` on pages of any format (p.kv_format).
inline void attend_any(const Problem& p, const Item& it, const Partial& partial, std::vector<float>& s) {
  switch (p.kv_format) {
    case kI8:
      attend<I8Elems>(p, it, partial, s);
      break;
    case kE4M3:
      attend<Fp8Elems<kE4M3Table>>(p, it, partial, s);
      break;
    case kE5M2:
      attend<Fp8Elems<kE5M2Table>>(p, it, partial, s);
      break;
    case kBF16:
      attend<BF16Elems>(p, it, partial, s);
      break;
    default:
      attend<F32Elems>(p, it, partial, s);
  }
}

// A split (token, KV head)'s parts (items [w, w + parts), in key order) merged into p.out: every part's output and
// sum rescaled to the largest score among them (and the sink's), summed in order, divided.
inline void combine(const Problem& p, const std::vector<Item>& items, const Partial& partial, int64_t w,
                    int64_t parts) {
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

}  // namespace netra::attention
