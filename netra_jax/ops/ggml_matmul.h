// The CPU matmul over GGML blocks (ggml_blocks.h) with float32 activations, and what its int8-activation path
// (ggml_matmul_q8.h) shares with it: the problem, the chunks' prefetch. y[M, N] = x[M, K] @ W^T, W [N, K] given as
// the raw bytes of a GGUF tensor of ne [K, N]: w uint8 [N, row_bytes], row n holding K / QK consecutive blocks.
//
// - The weight rows are split into chunks of whole row tiles, claimed from an atomic counter by the calling thread
//   and XLA's intra-op pool (a helper starting late finds less or nothing left: cpu_ggml_matmul.cc). Software
//   prefetch runs ahead of the de-quantization (a core's misses in flight bound its share of the bandwidth).
// - One row of x: the chunk's weight rows are one sequential stream of steps; a step's vectors are de-quantized
//   into registers and go straight into 4 accumulators with x from cache (summed at each row's end); the next
//   step's scales are converted before this step's blocks, so that their latency overlaps.
// - More rows: a tile of TN weight rows walks K step by step; the step is de-quantized into an L1 buffer [TN, 256]
//   once, then register tiles of up to TM rows of x take its products (TM x vectors and one weight vector in
//   registers next to TM x TN accumulators). With one register tile (M <= TM) the accumulators stay in registers
//   over the whole K; with more, each tile's accumulators are kept between steps in a small buffer of partial
//   vectors, and x is read from a copy laid out step by step. Lanes are summed once at the end. The next tile's
//   bytes are prefetched over the current tile's steps.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "ggml_blocks.h"

namespace netra::ggml {

constexpr int TN = 6;                 // weight rows per tile with several rows of x
constexpr int TM = VW == 16 ? 4 : 2;  // rows of x per register tile: TM x vectors, TM * TN accumulators and a weight
                                      // (32 registers with AVX-512; 16 with AVX2: 2, 12 and 1)
constexpr int64_t KS = 256;           // values per de-quantization step with several rows of x
constexpr int ROW_UNIT = 8;           // weight rows per chunk unit with one row of x
constexpr int LINE_BYTES = 64;

struct Q8Rows;

struct Problem {
  const float* x;    // [M, K]
  const uint8_t* w;  // [N, row_bytes]
  float* y;          // [M, N]
  int64_t M, K, N, row_bytes;
  const float* xs;   // more than TM rows: x step by step, [K / KS][M][KS]
  const Q8Rows* q8;  // int8 activations: x quantized, else null
};

// ---------------------------------------------------------------- one row of x

// The blocks of one weight row against x, into 4 accumulators: vector i of block number `parity` (0 or 1, blocks
// alternate when a block has fewer than 4 vectors) goes to acc[(parity * vectors per block + i) % 4].
template <typename T, int PARITY>
inline void row_block(const uint8_t* b, const float* s, const float* x, vf (&acc)[4]) {
  constexpr int VPB = T::QK / VW;
  T::block(b, s, [&](int i, vf v) { acc[(PARITY * VPB + i / VW) % 4] += load(x + i) * v; });
}

// The blocks [0, nb) of a step (nb <= GROUP) from b, their scales in s: f(block, its scales, parity, block number).
template <typename T, typename F>
inline void for_blocks(const uint8_t* b, int nb, const float* s, F&& f) {
  if constexpr (T::GROUP == 1) {
    f(b, s, std::integral_constant<int, 0>{}, 0);
  } else {
    int i = 0;
    for (; i + 2 <= nb; i += 2) {
      f(b + i * T::BYTES, s + i, std::integral_constant<int, 0>{}, i);
      f(b + (i + 1) * T::BYTES, s + i + 1, std::integral_constant<int, 1>{}, i + 1);
    }
    if (i < nb) f(b + i * T::BYTES, s + i, std::integral_constant<int, 0>{}, i);
  }
}

// Prefetches (into L2) w's bytes [at, at + bytes) below `limit`: the weights are read ahead of their
// de-quantization instead of while it waits (a core's misses in flight bound its share of the bandwidth).
inline void prefetch(const Problem& p, int64_t at, int64_t bytes, int64_t limit) {
  for (int64_t i = at; i < at + bytes && i < limit; i += LINE_BYTES) __builtin_prefetch(p.w + i, 0, 2);
}

// bytes ahead of the de-quantization (Q4_0 from memory at one row, 2-core EPYC: 2048 ahead 20 GB/s, 6144 24-27)
constexpr int64_t PREFETCH = 6144;

// Spreads the prefetch of the next weight tile (rows [n + TN, n + 2 TN), consecutive bytes) over the current tile's
// `steps` steps: the part for step `step`.
inline void prefetch_next_tile(const Problem& p, int64_t n, int64_t step, int64_t steps, int64_t limit) {
  const int64_t part = (TN * p.row_bytes / steps + LINE_BYTES) / LINE_BYTES * LINE_BYTES;
  prefetch(p, (n + TN) * p.row_bytes + step * part, part, limit);
}

// y[0, n0:n1]: the weight rows, consecutive in memory, one sequential stream of steps; the scales of the next step
// are computed before this step's blocks (their loads and conversions are not waited for).
template <typename T>
void one_row(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t blocks = p.K / T::QK, limit = n1 * p.row_bytes;
  const uint8_t* b = p.w + n0 * p.row_bytes;
  alignas(64) float s[2][SCALES];
  int cur = 0, nb = static_cast<int>(std::min<int64_t>(T::GROUP, blocks));
  T::scales(b, nb, s[cur]);
  vf acc[4] = {};
  for (int64_t n = n0, g = 0;;) {  // step: row n, blocks [g, g + nb)
    const uint8_t* b_next = b + nb * T::BYTES;  // the next row's blocks follow the last step's
    int64_t n_next = n, g_next = g + nb;
    if (g_next == blocks) n_next++, g_next = 0;
    const int nb_next = static_cast<int>(std::min<int64_t>(T::GROUP, blocks - g_next));
    if (n_next < n1) T::scales(b_next, nb_next, s[cur ^ 1]);
    in_memory(s);
    prefetch(p, b - p.w + PREFETCH, nb * T::BYTES, limit);
    const float* x = p.x + g * T::QK;
    for_blocks<T>(b, nb, s[cur], [&](const uint8_t* bi, const float* si, auto parity, int i) {
      row_block<T, decltype(parity)::value>(bi, si, x + i * T::QK, acc);
    });
    if (g_next == 0) {
      p.y[n] = hsum((acc[0] + acc[1]) + (acc[2] + acc[3]));
      for (vf& a : acc) a = vf{};
    }
    if (n_next == n1) break;
    b = b_next, n = n_next, g = g_next, nb = nb_next, cur ^= 1;
  }
}

// ---------------------------------------------------------------- several rows of x

// Weight rows [n, n + tn), values [k0, k0 + kc) (one step) -> buf[j * KS + k - k0].
template <typename T>
inline void dequant_step(const Problem& p, int64_t n, int tn, int64_t k0, int64_t kc, float* buf) {
  const int nb = static_cast<int>(kc / T::QK);
  for (int j = 0; j < tn; ++j) {
    const uint8_t* b = p.w + (n + j) * p.row_bytes + k0 / T::QK * T::BYTES;
    float* out = buf + j * KS;
    alignas(64) float s[SCALES];
    T::scales(b, nb, s);
    in_memory(s);
    for_blocks<T>(b, nb, s, [out](const uint8_t* bi, const float* si, auto, int i) {
      float* o = out + i * T::QK;
      T::block(bi, si, [o](int v, vf w) { store(o + v, w); });
    });
  }
}

// acc[m][j] += x[m, 0 : kc] * buf[j, 0 : kc] lane by lane (x at row m0 and the step's first column; kc a multiple of
// VW).
template <int R>
inline void multiply(const float* buf, const float* x, int64_t ldx, int64_t kc, vf (&acc)[R][TN]) {
  for (int64_t k = 0; k < kc; k += VW) {
    vf xv[R];
    for (int m = 0; m < R; ++m) xv[m] = load(x + m * ldx + k);
    for (int j = 0; j < TN; ++j) {
      const vf wv = load(buf + j * KS + k);
      for (int m = 0; m < R; ++m) acc[m][j] += xv[m] * wv;
    }
  }
}

template <int R>
inline void store_sums(const Problem& p, int64_t m0, int64_t n, int tn, const vf (&acc)[R][TN]) {
  for (int m = 0; m < R; ++m) {
    for (int j = 0; j < tn; ++j) p.y[(m0 + m) * p.N + n + j] = hsum(acc[m][j]);
  }
}

// All M = R <= TM rows of y[:, n0:n1] (n0 a multiple of TN): one register tile, its accumulators kept over K.
template <typename T, int R>
void one_tile(const Problem& p, int64_t n0, int64_t n1) {
  alignas(64) float buf[TN * KS];
  std::memset(buf, 0, sizeof(buf));  // a partial last tile's rows past n1 are read, their sums dropped
  const int64_t steps = (p.K + KS - 1) / KS, limit = n1 * p.row_bytes;
  for (int64_t n = n0; n < n1; n += TN) {
    const int tn = static_cast<int>(std::min<int64_t>(TN, n1 - n));
    vf acc[R][TN] = {};
    for (int64_t k = 0; k < p.K; k += KS) {
      const int64_t kc = std::min<int64_t>(KS, p.K - k);
      prefetch_next_tile(p, n, k / KS, steps, limit);
      dequant_step<T>(p, n, tn, k, kc, buf);
      multiply<R>(buf, p.x + k, p.K, kc, acc);
    }
    store_sums<R>(p, 0, n, tn, acc);
  }
}

// Register tile of R rows from m0 over one step, its accumulators carried in part [R][TN] between steps.
template <int R>
inline void tile_step(const Problem& p, const float* buf, int64_t m0, int64_t k, int64_t kc, vf* part, bool last,
                      int64_t n, int tn) {
  vf acc[R][TN];
  for (int m = 0; m < R; ++m) {
    for (int j = 0; j < TN; ++j) acc[m][j] = k == 0 ? vf{} : part[m * TN + j];
  }
  multiply<R>(buf, p.xs + (k / KS * p.M + m0) * KS, KS, kc, acc);
  if (last) {
    store_sums<R>(p, m0, n, tn, acc);
  } else {
    for (int m = 0; m < R; ++m) {
      for (int j = 0; j < TN; ++j) part[m * TN + j] = acc[m][j];
    }
  }
}

// More than TM rows: register tiles of near-equal heights (at most TM) over each step's buffer. Their x is read
// from a copy step by step (the rows' columns of a step 1 KB apart): in x itself a step's rows lie K * 4 bytes apart,
// for K a multiple of 1024 all in the same L1 sets, and the step's x is evicted while it is read for each tile.
template <typename T>
void many_tiles(const Problem& p, int64_t n0, int64_t n1) {
  alignas(64) float buf[TN * KS];
  std::memset(buf, 0, sizeof(buf));
  std::unique_ptr<vf[]> part(new vf[p.M * TN]);
  const int64_t tiles = (p.M + TM - 1) / TM, steps = (p.K + KS - 1) / KS, limit = n1 * p.row_bytes;
  for (int64_t n = n0; n < n1; n += TN) {
    const int tn = static_cast<int>(std::min<int64_t>(TN, n1 - n));
    for (int64_t k = 0; k < p.K; k += KS) {
      const int64_t kc = std::min<int64_t>(KS, p.K - k);
      const bool last = k + kc == p.K;
      prefetch_next_tile(p, n, k / KS, steps, limit);
      dequant_step<T>(p, n, tn, k, kc, buf);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t m0 = t * p.M / tiles, rows = (t + 1) * p.M / tiles - m0;
        vf* tp = part.get() + m0 * TN;
        switch (rows) {
#define NETRA_ROWS(R)                                                    \
  case R:                                                                \
    if constexpr (R <= TM) tile_step<R>(p, buf, m0, k, kc, tp, last, n, tn); \
    break;
          NETRA_ROWS(1)
          NETRA_ROWS(2)
          NETRA_ROWS(3)
          NETRA_ROWS(4)
#undef NETRA_ROWS
        }
      }
    }
  }
}

// x [M, K] step by step, [K / KS][M][KS], for more than TM rows (else null).
inline std::unique_ptr<vf[]> x_by_steps(const Problem& p) {
  if (p.M <= TM) return nullptr;
  const int64_t steps = (p.K + KS - 1) / KS;
  std::unique_ptr<vf[]> xs(new vf[steps * p.M * KS / VW]);
  float* out = reinterpret_cast<float*>(xs.get());
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t kc = std::min<int64_t>(KS, p.K - s * KS);
    for (int64_t m = 0; m < p.M; ++m) {
      std::memcpy(out + (s * p.M + m) * KS, p.x + m * p.K + s * KS, sizeof(float) * kc);
    }
  }
  return xs;
}

// A kernel's share of a problem: the weight rows [n0, n1)
typedef void (*ChunkFn)(const Problem&, int64_t, int64_t);

// The float32-activation kernel for M rows of x (null: the type has none)
template <typename T>
ChunkFn chunk_fn(int64_t M) {
  static_assert(TM <= 4 && KS % T::QK == 0);
  if constexpr (INTERLEAVED<T>) {
    return nullptr;  // int8 activations only
  } else {
    if (M == 1) return one_row<T>;
    switch (M) {
#define NETRA_ROWS(R) \
  case R:             \
    if constexpr (R <= TM) return one_tile<T, R>; \
    break;
      NETRA_ROWS(2)
      NETRA_ROWS(3)
      NETRA_ROWS(4)
#undef NETRA_ROWS
    }
    return many_tiles<T>;
  }
}

}  // namespace netra::ggml
