// One decoder layer for a decode-sized step on CPU, an XLA FFI handler: x [T, hidden] -> x after the layer, this
// step's keys and values written into the layer's float32 pages (aliased in place), for T up to a few dozen tokens.
//
// Why: at decode sizes a layer is about ten small programs in XLA (norms, the projections, RoPE, the KV write,
// attention, the activation, residuals), each a dispatch and a wake-up of the thread pool, and XLA's dot reads
// SmolLM2's one-row weights at 20 of the 30 GB/s two cores can read. Here the layer is one call: the calling thread
// and helpers from XLA's intra-op pool go through its phases together, claiming pieces of each from a counter and
// waiting (spinning) only where a phase needs the whole output of the one before:
//
//   qkv: the attention norm of x (each thread its own copy), then x @ wqkv per K segment (see `segment`);
//   qkv post: per group of heads, the segments' sum + bias, the q/k norm, RoPE (cos and sin given per token), the
//     keys' and values' write into their page slots;
//   attention: per (token, KV head) and 1024-position part, as cpu_attention.h computes it (every token per token:
//     keys of this step's earlier tokens are already written); combine: the parts of long contexts merged;
//   o, o post: attention @ wo per K segment; per token, the sum + bias (Gemma's sandwich norm) added to x;
//   mlp, mlp post: the MLP norm of x (each thread its own copy), gate and up per K segment; act(gate) * up;
//   down, down post: @ w_down per K segment; per token, the sum (sandwich norm) added to x.
//
// LoRA adapters (optional, `LoRA` below): the tokens with an adapter are grouped into runs by slot; each matmul phase
// also shrinks every run's inputs through its slot's A (one piece per run), and the deltas (the shrinks through B)
// are added where the jnp layer adds them, to the projection's output before anything reads it: in qkv post and mlp
// post by their columns, for o and down in phases of their own (o lora, down lora: column ranges into a delta that
// o post and down post add). A slot's factors are read once per step, and a token's sums run in a fixed order over
// its own row: its delta does not depend on its neighbours' adapters.
//
// The matmuls are cpu_matmul.h's (each output summed over k in order within a segment, the two segments added:
// batch-invariant); the attention is the FFI attention's code. The jnp layer in models/transformer.py is the
// reference.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cpu_attention.h"
#include "cpu_matmul.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

namespace att = netra::attention;
using netra::rows::columns;
using netra::rows::load;
using netra::rows::madd;
using netra::rows::store;
using netra::rows::vf;
using netra::rows::VW;
using RowsProblem = netra::rows::Problem<float>;

enum Act : int64_t { kSilu = 0, kGeluTanh = 1 };

enum Phase {
  kQkv,
  kQkvPost,
  kAttend,
  kCombine,
  kO,
  kOLora,
  kOPost,
  kMlp,
  kMlpPost,
  kDown,
  kDownLora,
  kDownPost,
  kPhases
};

// A matmul's sum over k in two fixed segments, each summed in order by one piece, then added (first + second): at
// one row each piece streams a contiguous half of the weight (the columns split instead, every weight row is two
// short runs the prefetchers follow less well: 27 against 30 GB/s for SmolLM2's layers on a 2-core AVX-512 Xeon).
// The segments depend on K alone, so a row's result does not depend on the rows or threads around it.
constexpr int SEGMENTS = 2;

inline int64_t segment_count(int64_t K) { return K >= 64 ? SEGMENTS : 1; }

inline std::pair<int64_t, int64_t> segment(int64_t K, int64_t s) {
  if (segment_count(K) == 1) return {0, K};
  const int64_t mid = K / 2 / 32 * 32;
  return s == 0 ? std::pair<int64_t, int64_t>{0, mid} : std::pair<int64_t, int64_t>{mid, K};
}

// The step's tokens with an adapter, grouped by slot: tokens [begin, end) of the sorted list use slot `slot`.
struct SlotRun {
  int32_t slot;
  int64_t begin, end;
};

// One group of projections sharing an input (q/k/v, o, gate/up, down) and its adapter slots: a [in, S, R],
// b [S, R, out] (R: the group's padded rank), the scale folded into b; xa [T, R] each adapter token's shrink. S == 0:
// none. Both halves go by run: a slot's factors are read once for all of its tokens, and each token's sums run
// over k (shrink) and r (expand) in order, whoever its neighbours are.
struct LoRA {
  const float *a = nullptr, *b = nullptr;
  int64_t S = 0, R = 0, in = 0, out = 0;
  float* xa = nullptr;

  bool on() const { return S > 0 && R > 0; }

  // xa[t] = x[t] @ a[:, slot] for the run's tokens t (x: rows of ld floats): TB tokens by one vector of ranks at a
  // time held in registers over k (the last, partial vector of ranks one rank at a time); each token's sums run over
  // k in order, whatever block it is in
  void shrink(const float* x, int64_t ld, const int32_t* tokens, const SlotRun& run) const {
    for (int64_t i = run.begin; i < run.end; i += TB) {
      const int64_t nt = std::min<int64_t>(TB, run.end - i);
      const float* xr[TB];
      for (int64_t j = 0; j < TB; ++j) xr[j] = x + tokens[i + std::min(j, nt - 1)] * ld;  // a short block repeats
      const float* col = a + run.slot * R;  // a[k, slot, r] = col[k * S * R + r]
      int64_t r0 = 0;
      for (; r0 + VW <= R; r0 += VW) {
        vf acc[TB] = {};
        for (int64_t k = 0; k < in; ++k) {
          const vf w = load(col + k * S * R + r0);
          for (int64_t j = 0; j < TB; ++j) acc[j] = madd(vf{} + xr[j][k], w, acc[j]);
        }
        for (int64_t j = 0; j < nt; ++j) store(xa + tokens[i + j] * R + r0, acc[j]);
      }
      for (; r0 < R; ++r0) {
        for (int64_t j = 0; j < nt; ++j) {
          float acc = 0.0f;
          for (int64_t k = 0; k < in; ++k) acc += xr[j][k] * col[k * S * R + r0];
          xa[tokens[i + j] * R + r0] = acc;
        }
      }
    }
  }

  // y[t][c - c0] += xa[t] @ b[slot][:, c] for the run's tokens t and the output columns [c0, c1) (y: rows of ld):
  // TB tokens by one vector of columns at a time held in registers over r (the last, partial vector one column at a
  // time)
  void expand(const int32_t* tokens, const SlotRun& run, int64_t c0, int64_t c1, float* y, int64_t ld) const {
    const float* bs = b + run.slot * R * out;  // [R, out]
    for (int64_t i = run.begin; i < run.end; i += TB) {
      const int64_t nt = std::min<int64_t>(TB, run.end - i);
      const float* xr[TB];
      for (int64_t j = 0; j < TB; ++j) xr[j] = xa + tokens[i + std::min(j, nt - 1)] * R;
      int64_t n = c0;
      for (; n + VW <= c1; n += VW) {
        vf acc[TB] = {};
        for (int64_t r = 0; r < R; ++r) {
          const vf w = load(bs + r * out + n);
          for (int64_t j = 0; j < TB; ++j) acc[j] = madd(vf{} + xr[j][r], w, acc[j]);
        }
        for (int64_t j = 0; j < nt; ++j) {
          float* yt = y + tokens[i + j] * ld + (n - c0);
          store(yt, load(yt) + acc[j]);
        }
      }
      for (; n < c1; ++n) {
        for (int64_t j = 0; j < nt; ++j) {
          float acc = 0.0f;
          for (int64_t r = 0; r < R; ++r) acc += xr[j][r] * bs[r * out + n];
          y[tokens[i + j] * ld + (n - c0)] += acc;
        }
      }
    }
  }

  static constexpr int64_t TB = 4;  // tokens per register block
};

enum Group { kLoraQkv, kLoraO, kLoraGateUp, kLoraDown, kGroups };

struct Layer {
  // shapes
  int64_t T, hidden, H, KH, D, I, num_pages, P, max_pages, half;
  int64_t nqkv() const { return (H + 2 * KH) * D; }
  // inputs
  const float *x, *attn_norm, *wqkv, *bqkv, *q_norm, *k_norm, *cos, *sin, *sinks, *wo, *bo, *post_attn_norm,
      *mlp_norm, *w_gate_up, *w_down, *post_mlp_norm;
  const int32_t *slots, *pos, *rows;
  const int32_t* lora_slots;  // [T] each token's adapter slot (-1: none); with `lora` all off, unread
  const bool* valid;
  LoRA lora[kGroups];
  const int32_t* lora_tokens;  // the tokens with an adapter, sorted by slot (stable)
  const SlotRun* runs;         // of lora_tokens, one run per slot used
  int64_t num_runs;
  bool has_lora() const { return num_runs > 0; }
  // outputs
  float *out, *k_pages, *v_pages;
  // attributes
  float eps;
  bool qk_norm, sandwich;
  int64_t act;
  // scratch, each matmul's output per K segment: qkv [2][T, nqkv], gu [2][T, 2I], o [2][T, hidden] (o, then down);
  // q [T, H, D], attn [T, H, D], mid [T, hidden], a [T, I], delta [T, hidden] the o or down LoRA delta
  float *qkv[SEGMENTS], *gu[SEGMENTS], *o[SEGMENTS], *q, *attn, *mid, *a, *delta;
};

// y[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w for `n` rows of `dim`, as the jnp rms_norm computes it
void rms_norm_rows(const float* x, const float* w, float* y, int64_t n, int64_t dim, float eps) {
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = x + r * dim;
    float ss = 0.0f;
    for (int64_t d = 0; d < dim; ++d) ss += xr[d] * xr[d];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
    for (int64_t d = 0; d < dim; ++d) y[r * dim + d] = xr[d] * inv * w[d];
  }
}

// Pieces of a range of `n` columns: `pieces` ranges of whole vectors, the last one ending at n.
std::pair<int64_t, int64_t> piece_columns(int64_t n, int64_t pieces, int64_t i) {
  const int64_t vectors = (n + VW - 1) / VW, per = (vectors + pieces - 1) / pieces;
  return {std::min(n, i * per * VW), std::min(n, (i + 1) * per * VW)};
}

// the matmul's sum: its segments' partial outputs added in order
inline float total(float* const* parts, int64_t nseg, int64_t e) {
  return nseg == 1 ? parts[0][e] : parts[0][e] + parts[1][e];
}

struct Job {
  Layer L;
  att::Problem ap;  // the attention over q / attn and the pages
  std::vector<att::Item> items;
  std::vector<std::pair<int64_t, int64_t>> splits;
  att::Partial partial{nullptr, nullptr, nullptr};
  int64_t col_pieces = 1;  // column ranges per matmul (times its K segments: its pieces)
  int64_t head_group = 1;  // heads per qkv post piece
  int64_t pieces[kPhases] = {};
  int64_t shrinks[kPhases] = {};  // of a matmul phase's pieces, the last ones: one LoRA shrink per slot run
  std::vector<int32_t> lora_tokens;
  std::vector<SlotRun> runs;
  std::atomic<int64_t> claimed[kPhases], done[kPhases];

  Job() {
    for (int ph = 0; ph < kPhases; ++ph) claimed[ph] = 0, done[ph] = 0;
  }

  // Every phase in order: claim pieces until none is left, then wait for the others' pieces of it.
  void run() {
    std::vector<float> normed, scores;  // this thread's normed rows, attention scratch
    bool attn_normed = false, mlp_normed = false;
    for (int ph = 0; ph < kPhases; ++ph) {
      for (int64_t i; (i = claimed[ph].fetch_add(1, std::memory_order_relaxed)) < pieces[ph];) {
        const int64_t run = i - (pieces[ph] - shrinks[ph]);  // >= 0: the LoRA shrink of slot run `run`
        switch (ph) {
          case kQkv:
            if (!attn_normed) norm_into(normed, L.x, L.attn_norm), attn_normed = true;
            if (run >= 0) {
              L.lora[kLoraQkv].shrink(normed.data(), L.hidden, L.lora_tokens, L.runs[run]);
            } else {
              matmul_piece(normed.data(), L.wqkv, L.hidden, L.nqkv(), L.qkv, i);
            }
            break;
          case kQkvPost:
            qkv_post(i);
            break;
          case kAttend:
            att::attend_any(ap, items[i], partial, scores);
            break;
          case kCombine:
            att::combine(ap, items, partial, splits[i].first, splits[i].second);
            break;
          case kO:
            if (run >= 0) {
              L.lora[kLoraO].shrink(L.attn, L.H * L.D, L.lora_tokens, L.runs[run]);
            } else {
              matmul_piece(L.attn, L.wo, L.H * L.D, L.hidden, L.o, i);
            }
            break;
          case kOLora:
            lora_delta(L.lora[kLoraO], i, pieces[kOLora]);
            break;
          case kOPost:
            residual_row(L.x, L.bo, L.post_attn_norm, L.H * L.D, L.lora[kLoraO], L.mid, i);
            break;
          case kMlp:
            if (!mlp_normed) norm_into(normed, L.mid, L.mlp_norm), mlp_normed = true;
            if (run >= 0) {
              L.lora[kLoraGateUp].shrink(normed.data(), L.hidden, L.lora_tokens, L.runs[run]);
            } else {
              matmul_piece(normed.data(), L.w_gate_up, L.hidden, 2 * L.I, L.gu, i);
            }
            break;
          case kMlpPost:
            mlp_post(i);
            break;
          case kDown:
            if (run >= 0) {
              L.lora[kLoraDown].shrink(L.a, L.I, L.lora_tokens, L.runs[run]);
            } else {
              matmul_piece(L.a, L.w_down, L.I, L.hidden, L.o, i);
            }
            break;
          case kDownLora:
            lora_delta(L.lora[kLoraDown], i, pieces[kDownLora]);
            break;
          case kDownPost:
            residual_row(L.mid, nullptr, L.post_mlp_norm, L.I, L.lora[kLoraDown], L.out, i);
            break;
        }
        done[ph].fetch_add(1, std::memory_order_release);
      }
      while (done[ph].load(std::memory_order_acquire) < pieces[ph]) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      }
    }
  }

  void norm_into(std::vector<float>& h, const float* x, const float* w) const {
    h.resize(L.T * L.hidden);
    rms_norm_rows(x, w, h.data(), L.T, L.hidden, L.eps);
  }

  // Piece i of x [T, K] @ w [K, N]: a column range and one K segment, into that segment's output.
  void matmul_piece(const float* x, const float* w, int64_t K, int64_t N, float* const* out, int64_t i) const {
    const int64_t nseg = segment_count(K), s = i % nseg;
    const auto [n0, n1] = piece_columns(N, col_pieces, i / nseg);
    const auto [k0, k1] = segment(K, s);
    columns(RowsProblem{x, w, nullptr, L.T, K, N}.segment(k0, k1, out[s]), n0, n1);
  }

  // The adapter tokens' LoRA delta of a block's output columns [c0, c1) into delta (o and down): piece i of n
  void lora_delta(const LoRA& lora, int64_t i, int64_t n) const {
    const auto [c0, c1] = piece_columns(L.hidden, n, i);
    for (int64_t k = 0; k < L.num_runs; ++k) {
      const SlotRun& run = L.runs[k];
      for (int64_t j = run.begin; j < run.end; ++j) {
        std::fill(L.delta + L.lora_tokens[j] * L.hidden + c0, L.delta + L.lora_tokens[j] * L.hidden + c1, 0.0f);
      }
      lora.expand(L.lora_tokens, run, c0, c1, L.delta + c0, L.hidden);
    }
  }

  // heads [h0, h1) of q, k and v (in that order along wqkv's columns): bias and LoRA delta, q/k norm, RoPE, the KV
  // write
  void qkv_post(int64_t i) {
    const int64_t nh = L.H + 2 * L.KH, N = L.nqkv(), D = L.D, nseg = segment_count(L.hidden);
    const int64_t h0 = i * head_group, h1 = std::min(nh, h0 + head_group);
    const int64_t slots_total = L.num_pages * L.P;
    float* r = L.qkv[0];  // the sum goes into the first segment's output
    for (int64_t t = 0; t < L.T; ++t) {
      for (int64_t c = h0 * D; c < h1 * D; ++c) r[t * N + c] = total(L.qkv, nseg, t * N + c) + L.bqkv[c];
    }
    if (L.lora[kLoraQkv].on()) {
      for (int64_t k = 0; k < L.num_runs; ++k) {
        L.lora[kLoraQkv].expand(L.lora_tokens, L.runs[k], h0 * D, h1 * D, r + h0 * D, N);
      }
    }
    for (int64_t t = 0; t < L.T; ++t) {
      for (int64_t head = h0; head < h1; ++head) {
        float* v = r + t * N + head * D;
        const bool is_q = head < L.H, is_k = !is_q && head < L.H + L.KH;
        if (is_q || is_k) {
          if (L.qk_norm) rms_norm_rows(v, is_q ? L.q_norm : L.k_norm, v, 1, D, L.eps);
          const float* c = L.cos + t * L.half;
          const float* s = L.sin + t * L.half;
          for (int64_t d = 0; d < L.half; ++d) {
            const float x1 = v[d], x2 = v[d + L.half];
            v[d] = x1 * c[d] - x2 * s[d];
            v[d + L.half] = x2 * c[d] + x1 * s[d];
          }
        }
        if (is_q) {
          std::memcpy(L.q + (t * L.H + head) * D, v, sizeof(float) * D);
          std::memset(L.attn + (t * L.H + head) * D, 0, sizeof(float) * D);
          continue;
        }
        const int64_t slot = L.slots[t];
        if (slot < 0 || slot >= slots_total) continue;  // padding: dropped
        const int64_t kh = is_k ? head - L.H : head - L.H - L.KH;
        float* pages = is_k ? L.k_pages : L.v_pages;
        std::memcpy(pages + (slot * L.KH + kh) * D, v, sizeof(float) * D);
      }
    }
  }

  // out[t] = x[t] + h, h the block's output (the matmul over K, + bias, + the token's LoRA delta), Gemma's sandwich
  // norm applied to h first
  void residual_row(const float* x, const float* bias, const float* norm, int64_t K, const LoRA& lora, float* out,
                    int64_t t) const {
    const int64_t nseg = segment_count(K), row = t * L.hidden;
    float* h = L.o[0] + row;  // the sum goes into the first segment's output
    for (int64_t n = 0; n < L.hidden; ++n) h[n] = total(L.o, nseg, row + n) + (bias ? bias[n] : 0.0f);
    if (lora.on() && L.lora_slots[t] >= 0 && L.lora_slots[t] < lora.S) {  // the delta its lora_delta piece made
      for (int64_t n = 0; n < L.hidden; ++n) h[n] += L.delta[row + n];
    }
    if (L.sandwich) rms_norm_rows(h, norm, h, 1, L.hidden, L.eps);
    for (int64_t n = 0; n < L.hidden; ++n) out[row + n] = x[row + n] + h[n];
  }

  // act(gate) * up over a range of the intermediate columns
  void mlp_post(int64_t i) {
    const int64_t nseg = segment_count(L.hidden);
    const auto [n0, n1] = piece_columns(L.I, pieces[kMlpPost], i);
    const LoRA& lora = L.lora[kLoraGateUp];
    const int64_t w = n1 - n0;
    std::vector<float> dg, du;  // [T, w] each token's LoRA delta of gate and of up (zeros without an adapter)
    if (lora.on()) {
      dg.assign(L.T * w, 0.0f), du.assign(L.T * w, 0.0f);
      for (int64_t k = 0; k < L.num_runs; ++k) {
        lora.expand(L.lora_tokens, L.runs[k], n0, n1, dg.data(), w);
        lora.expand(L.lora_tokens, L.runs[k], L.I + n0, L.I + n1, du.data(), w);
      }
    }
    for (int64_t t = 0; t < L.T; ++t) {
      const int64_t row = t * 2 * L.I;
      float* a = L.a + t * L.I;
      for (int64_t n = n0; n < n1; ++n) {
        float g = total(L.gu, nseg, row + n), up = total(L.gu, nseg, row + L.I + n);
        if (lora.on()) g += dg[t * w + n - n0], up += du[t * w + n - n0];
        float act;
        if (L.act == kSilu) {
          act = g * (1.0f / (1.0f + std::exp(-g)));
        } else {
          act = g * (0.5f * (1.0f + std::tanh(0.7978845608028654f * (g + 0.044715f * (g * g * g)))));
        }
        a[n] = act * up;
      }
    }
  }
};

ffi::Error DecodeLayer(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> attn_norm,
                       ffi::Buffer<ffi::F32> wqkv, ffi::Buffer<ffi::F32> bqkv, ffi::Buffer<ffi::F32> q_norm,
                       ffi::Buffer<ffi::F32> k_norm, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                       ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> slots,
                       ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::PRED> valid, ffi::Buffer<ffi::S32> rows,
                       ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::F32> wo, ffi::Buffer<ffi::F32> bo,
                       ffi::Buffer<ffi::F32> post_attn_norm, ffi::Buffer<ffi::F32> mlp_norm,
                       ffi::Buffer<ffi::F32> w_gate_up, ffi::Buffer<ffi::F32> w_down,
                       ffi::Buffer<ffi::F32> post_mlp_norm, ffi::Buffer<ffi::S32> lora_slots,
                       ffi::Buffer<ffi::F32> qkv_a, ffi::Buffer<ffi::F32> qkv_b, ffi::Buffer<ffi::F32> o_a,
                       ffi::Buffer<ffi::F32> o_b, ffi::Buffer<ffi::F32> gate_up_a, ffi::Buffer<ffi::F32> gate_up_b,
                       ffi::Buffer<ffi::F32> down_a, ffi::Buffer<ffi::F32> down_b, ffi::ResultBuffer<ffi::F32> out,
                       ffi::ResultBuffer<ffi::F32> k_out, ffi::ResultBuffer<ffi::F32> v_out, float eps, float scale,
                       float soft_cap, int64_t window, bool has_sinks, int64_t act, bool qk_norm, bool sandwich,
                       int64_t rotary_dim) {
  const auto xd = x.dimensions(), kd = k_pages.dimensions(), rd = rows.dimensions(), gd = w_gate_up.dimensions();
  const auto od = wo.dimensions();
  if (xd.size() != 2 || kd.size() != 4 || rd.size() != 2 || gd.size() != 3 || od.size() != 2 || gd[1] != 2) {
    return ffi::Error::InvalidArgument(
        "netra_decode_layer_f32: x [T, hidden], pages [N, P, KH, D], rows [T, pages], w_gate_up [hidden, 2, I]");
  }
  Layer L{};
  L.T = xd[0], L.hidden = xd[1], L.num_pages = kd[0], L.P = kd[1], L.KH = kd[2], L.D = kd[3], L.max_pages = rd[1];
  L.H = od[0] / L.D, L.I = gd[2], L.half = rotary_dim / 2;
  if (L.H * L.D != od[0] || L.H % L.KH != 0 || wqkv.dimensions()[1] != L.nqkv() || rotary_dim > L.D ||
      rotary_dim % 2 != 0 || cos.dimensions()[1] != L.half) {
    return ffi::Error::InvalidArgument("netra_decode_layer_f32: head shapes of wqkv, wo, the pages and RoPE disagree");
  }
  // the adapter groups: (a [in, S, R], b [S, R, out]) each, S == 0 for a group without adapters
  const ffi::Buffer<ffi::F32>* factors[kGroups][2] = {
      {&qkv_a, &qkv_b}, {&o_a, &o_b}, {&gate_up_a, &gate_up_b}, {&down_a, &down_b}};
  const int64_t fan_in[kGroups] = {L.hidden, L.H * L.D, L.hidden, L.I};
  const int64_t fan_out[kGroups] = {L.nqkv(), L.hidden, 2 * L.I, L.hidden};
  for (int g = 0; g < kGroups; ++g) {
    const auto ad = factors[g][0]->dimensions(), bd = factors[g][1]->dimensions();
    if (ad.size() != 3 || bd.size() != 3) {
      return ffi::Error::InvalidArgument("netra_decode_layer_f32: LoRA factors a [in, S, R], b [S, R, out]");
    }
    LoRA& lora = L.lora[g];
    lora.S = ad[1], lora.R = ad[2], lora.in = fan_in[g], lora.out = fan_out[g];
    if (!lora.on()) continue;
    if (ad[0] != lora.in || bd[0] != lora.S || bd[1] != lora.R || bd[2] != lora.out ||
        lora_slots.dimensions().size() != 1 || lora_slots.dimensions()[0] != L.T) {
      return ffi::Error::InvalidArgument(
          "netra_decode_layer_f32: a LoRA group's factors do not fit its projection, or lora_slots is not [T]");
    }
    lora.a = factors[g][0]->typed_data(), lora.b = factors[g][1]->typed_data();
  }
  if (L.T == 0) return ffi::Error::Success();
  L.lora_slots = lora_slots.typed_data();
  L.x = x.typed_data(), L.attn_norm = attn_norm.typed_data(), L.wqkv = wqkv.typed_data();
  L.bqkv = bqkv.typed_data(), L.q_norm = q_norm.typed_data(), L.k_norm = k_norm.typed_data();
  L.cos = cos.typed_data(), L.sin = sin.typed_data(), L.sinks = sinks.typed_data(), L.wo = wo.typed_data();
  L.bo = bo.typed_data(), L.post_attn_norm = post_attn_norm.typed_data(), L.mlp_norm = mlp_norm.typed_data();
  L.w_gate_up = w_gate_up.typed_data(), L.w_down = w_down.typed_data();
  L.post_mlp_norm = post_mlp_norm.typed_data();
  L.slots = slots.typed_data(), L.pos = pos.typed_data(), L.rows = rows.typed_data(), L.valid = valid.typed_data();
  L.out = out->typed_data(), L.k_pages = k_out->typed_data(), L.v_pages = v_out->typed_data();
  L.eps = eps, L.qk_norm = qk_norm, L.sandwich = sandwich, L.act = act;
  if (L.k_pages != k_pages.typed_data()) {  // not aliased: start from the given pages
    std::memcpy(L.k_pages, k_pages.typed_data(), k_pages.size_bytes());
  }
  if (L.v_pages != v_pages.typed_data()) std::memcpy(L.v_pages, v_pages.typed_data(), v_pages.size_bytes());

  const int64_t T = L.T, QD = L.H * L.D;
  const int64_t per_segment = T * (L.nqkv() + 2 * L.I + L.hidden);
  auto job = std::make_shared<Job>();
  int64_t lora_rank = 0;  // the groups' ranks, summed: each token's shrinks side by side
  for (const LoRA& lora : L.lora) lora_rank += lora.on() ? lora.R : 0;
  if (lora_rank > 0) {  // the adapter tokens sorted by slot, in runs
    int32_t max_slot = -1;
    for (const LoRA& lora : L.lora) max_slot = std::max<int32_t>(max_slot, static_cast<int32_t>(lora.S) - 1);
    for (int32_t s = 0; s <= max_slot; ++s) {
      const int64_t begin = static_cast<int64_t>(job->lora_tokens.size());
      for (int64_t t = 0; t < T; ++t) {
        if (L.lora_slots[t] == s) job->lora_tokens.push_back(static_cast<int32_t>(t));
      }
      const int64_t end = static_cast<int64_t>(job->lora_tokens.size());
      if (end > begin) job->runs.push_back(SlotRun{s, begin, end});
    }
  }
  L.lora_tokens = job->lora_tokens.data(), L.runs = job->runs.data();
  L.num_runs = static_cast<int64_t>(job->runs.size());
  const int64_t lora_scratch = L.has_lora() ? T * (lora_rank + L.hidden) : 0;
  std::unique_ptr<float[]> scratch(new float[SEGMENTS * per_segment + T * (2 * QD + L.hidden + L.I) + lora_scratch]);
  float* next = scratch.get();  // no initial values: every piece writes before it reads
  for (int s = 0; s < SEGMENTS; ++s) {
    L.qkv[s] = next, L.gu[s] = next + T * L.nqkv(), L.o[s] = L.gu[s] + T * 2 * L.I;
    next += per_segment;
  }
  L.q = next, L.attn = L.q + T * QD, L.mid = L.attn + T * QD, L.a = L.mid + T * L.hidden;
  next = L.a + T * L.I;
  if (L.has_lora()) {
    L.delta = next, next += T * L.hidden;
    for (LoRA& lora : L.lora) {
      if (lora.on()) lora.xa = next, next += T * lora.R;
    }
  }
  job->L = L;
  std::vector<int32_t> all_tokens(T);
  for (int64_t t = 0; t < T; ++t) all_tokens[t] = static_cast<int32_t>(t);
  job->ap = att::Problem{L.q,     L.k_pages,   L.v_pages,   nullptr, nullptr, all_tokens.data(),
                         L.pos,   L.valid,     L.rows,      L.sinks, L.attn,  T,
                         L.H,     L.D,         L.P,         L.KH,    L.max_pages,
                         L.num_pages, T,       scale,       soft_cap, window, has_sinks, att::kF32};
  const int64_t slots_needed = att::plan(job->ap, &job->items, &job->splits);
  att::PartialStore partial(slots_needed, L.H / L.KH, L.D);
  job->partial = partial.view;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // a matmul's pieces: its K segments times column ranges, about one piece per thread (longer runs stream faster)
  job->col_pieces = std::max<int64_t>(1, (threads + SEGMENTS - 1) / SEGMENTS);
  const int64_t heads = L.H + 2 * L.KH;
  job->head_group = (heads + 2 * threads - 1) / (2 * threads);
  job->pieces[kQkv] = job->col_pieces * segment_count(L.hidden);
  job->pieces[kQkvPost] = (heads + job->head_group - 1) / job->head_group;
  job->pieces[kAttend] = static_cast<int64_t>(job->items.size());
  job->pieces[kCombine] = static_cast<int64_t>(job->splits.size());
  job->pieces[kO] = job->col_pieces * segment_count(QD);
  job->pieces[kOPost] = T;
  job->pieces[kMlp] = job->col_pieces * segment_count(L.hidden);
  job->pieces[kMlpPost] = std::min(threads, (L.I + VW - 1) / VW);
  job->pieces[kDown] = job->col_pieces * segment_count(L.I);
  job->pieces[kDownPost] = T;
  // LoRA: a shrink per slot run at the end of each matmul phase, the o and down deltas by column ranges
  const std::pair<Phase, Group> shrinking[] = {{kQkv, kLoraQkv}, {kO, kLoraO}, {kMlp, kLoraGateUp}, {kDown, kLoraDown}};
  for (const auto& [phase, group] : shrinking) {
    job->shrinks[phase] = L.lora[group].on() ? L.num_runs : 0;
    job->pieces[phase] += job->shrinks[phase];
  }
  const int64_t delta_pieces = std::min(threads, (L.hidden + VW - 1) / VW);
  job->pieces[kOLora] = L.lora[kLoraO].on() && L.has_lora() ? delta_pieces : 0;
  job->pieces[kDownLora] = L.lora[kLoraDown].on() && L.has_lora() ? delta_pieces : 0;
  for (int64_t i = 0; i + 1 < threads; ++i) pool.Schedule([job] { job->run(); });
  job->run();  // returns once every phase is done; a helper still in its loop finds nothing left to claim
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(NetraDecodeLayerF32, DecodeLayer,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [T, hidden]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // attn_norm [hidden]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // wqkv [hidden, (H + 2 KH) D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // bqkv [(H + 2 KH) D] (zeros: none)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q_norm [D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_norm [D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // cos [T, rotary_dim / 2]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sin [T, rotary_dim / 2]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k pages [N, P, KH, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v pages
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slot of each token [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // position of each token [T]
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // real token [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block-table rows [T, max_pages]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sinks [H]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // wo [H D, hidden]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // bo [hidden] (zeros: none)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // post_attn_norm [hidden]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // mlp_norm [hidden]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w_gate_up [hidden, 2, I]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w_down [I, hidden]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // post_mlp_norm [hidden]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // LoRA slot of each token [T] (-1: none)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // LoRA q/k/v a [hidden, S, R] (S = 0: none)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // LoRA q/k/v b [S, R, (H + 2 KH) D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // LoRA o a [H D, S, R]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // LoRA o b [S, R, hidden]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // LoRA gate/up a [hidden, S, R]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // LoRA gate/up b [S, R, 2 I]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // LoRA down a [I, S, R]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // LoRA down b [S, R, hidden]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // x out [T, hidden]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // k pages (aliased to the input)
                                  .Ret<ffi::Buffer<ffi::F32>>()   // v pages (aliased to the input)
                                  .Attr<float>("eps")
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("window")
                                  .Attr<bool>("has_sinks")
                                  .Attr<int64_t>("act")
                                  .Attr<bool>("qk_norm")
                                  .Attr<bool>("sandwich")
                                  .Attr<int64_t>("rotary_dim"));
