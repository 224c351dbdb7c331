// Q4_K and Q6_K rows interleaved by 16 (Q4_KX16, Q6_KX16: their bytes in ggml_blocks.h): the int8-activation kernels
// that read 16 weight rows with each dot product, and the loader's re-lay of rows into these layouts.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "ggml_matmul_q8.h"

namespace netra::ggml {

// ---------------------------------------------------------------- int8 activations, rows interleaved by 16
//
// Q4_KX16 and Q6_KX16 (ggml_blocks.h): per group of 16 weight rows and block, each 64-byte vector of values is two
// dot products (its low and its high nibbles) of all 16 rows against 4 bytes of x broadcast; the products of a few
// values (in int16) times the 16 rows' scales of their sub-block in one vpdpwssd; one conversion per block. Per value
// of a row that is 1/16 of the row-by-row kernel's shuffles and scale work. K 2048 x N 8192, one row of x (2-core
// EPYC, GB/s of weights, this against q8_rows), Q4_K: from cache one core 39.7 against 17.5, two 72.7 against 31.5;
// from memory one core 21.8 against 13.3, two 29.5 against 22.4; Q6_K from memory one core 21.8 against 15.0, two
// 27.9 against 21.5. Any number of rows of x, in register tiles of up to Q8_TM (the group's bytes, 2304 or 3360 per
// block, stay in L1 / L2 over the tiles). No software prefetch: each group is read in order, and the hardware's
// prefetchers alone read faster (Q4_K one core 21.8 GB/s; 16-20 with 4.5-18 KB ahead); Q6_KX16 keeps each sub-block's
// low and high bits together for that (in two regions of a block: 13.7 GB/s).
#if defined(NETRA_Q8_AVX512) && defined(__AVX512VNNI__)
#define NETRA_X16 1

// The 16 rows' scales and mins of sub-block j of a Q4_KX16 block, as bytes (row order); from the 12 packed bytes
// B[i] (16 rows each): sc_j = B[j] & 63, m_j = B[j + 4] & 63 (j < 4); sc_j = (B[j + 4] & 15) | (B[j - 4] >> 6) << 4,
// m_j = (B[j + 4] >> 4) | (B[j] >> 6) << 4 (j >= 4)
inline std::pair<__m128i, __m128i> x16_scales(const uint8_t* block, int j) {
  const auto B = [&](int i) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + Q4_KX16::SCALES_AT + 16 * i));
  };
  const __m128i low6 = _mm_set1_epi8(63), low4 = _mm_set1_epi8(15), low2 = _mm_set1_epi8(3);
  if (j < 4) return {_mm_and_si128(B(j), low6), _mm_and_si128(B(j + 4), low6)};
  const __m128i tail = B(j + 4);
  const __m128i sc_high = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(B(j - 4), 6), low2), 4);
  const __m128i m_high = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(B(j), 6), low2), 4);
  return {_mm_or_si128(_mm_and_si128(tail, low4), sc_high),
          _mm_or_si128(_mm_and_si128(_mm_srli_epi16(tail, 4), low4), m_high)};
}

// The 4 bytes of x at q in every lane
inline __m512i x_bytes(const int8_t* q) {
  return _mm512_set1_epi32(static_cast<int32_t>(u32(reinterpret_cast<const uint8_t*>(q))));
}

// y[m0 : m0 + R, 16 g : 16 g + 16] from group g of Q4_KX16 weights and R quantized rows of x: a half sub-block's 4
// products (16 values, at most 16 * 15 * 127 in a lane: int16) times the rows' scales, the rows' mins times x's sums
// of the sub-block in another vpdpwssd
template <int R>
inline void q4_k_x16_tile(const Problem& p, int64_t g, int64_t m0) {
  using X = Q4_KX16;
  const int64_t blocks = p.K / X::QK, bp = p.q8->bp;
  const uint8_t* group = p.w + g * X::ROWS * p.row_bytes;
  const __m512i low4 = _mm512_set1_epi8(15);
  __m512 acc[R], offsets[R];
  for (int m = 0; m < R; ++m) acc[m] = offsets[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = group + b * X::GROUP_BYTES;
    __m512i sums[R], mins[R];
    for (int m = 0; m < R; ++m) sums[m] = mins[m] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const auto [sc, mn] = x16_scales(block, j);
      const __m512i scales = _mm512_cvtepu8_epi32(sc);
      for (int h = 0; h < 2; ++h) {
        __m512i dots[R];
        for (int m = 0; m < R; ++m) dots[m] = _mm512_setzero_si512();
        for (int pair = 0; pair < 2; ++pair) {
          const __m512i v = _mm512_loadu_si512(block + X::VALUES_AT + 64 * (4 * j + 2 * h + pair));
          const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
          for (int m = 0; m < R; ++m) {
            const int8_t* q = p.q8->q.get() + ((m0 + m) * bp + 8 * b + j) * 32 + 16 * h + 8 * pair;
            dots[m] = _mm512_dpbusd_epi32(dots[m], lo, x_bytes(q));
            dots[m] = _mm512_dpbusd_epi32(dots[m], hi, x_bytes(q + 4));
          }
        }
        for (int m = 0; m < R; ++m) sums[m] = _mm512_dpwssd_epi32(sums[m], dots[m], scales);  // exact: int16 dots
      }
      const __m512i m_j = _mm512_cvtepu8_epi32(mn);
      for (int m = 0; m < R; ++m) {
        const int32_t qsum = p.q8->sum[(m0 + m) * bp + 8 * b + j];  // |qsum| <= 32 * 127: int16
        mins[m] = _mm512_dpwssd_epi32(mins[m], m_j, _mm512_set1_epi32(qsum));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + X::D_AT)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + X::DMIN_AT)));
    for (int m = 0; m < R; ++m) {
      const __m512 dx = _mm512_set1_ps(p.q8->d[(m0 + m) * bp + 8 * b]);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[m]), _mm512_mul_ps(d, dx), acc[m]);
      offsets[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mins[m]), _mm512_mul_ps(dmin, dx), offsets[m]);
    }
  }
  for (int m = 0; m < R; ++m) _mm512_storeu_ps(p.y + (m0 + m) * p.N + X::ROWS * g, _mm512_sub_ps(acc[m], offsets[m]));
}

// y[m0 : m0 + R, 16 g : 16 g + 16] from group g of Q6_KX16 weights: per sub-block of 16 values and pair of its
// halves, the 6-bit values put together from their low and high bits (byte ops) and two dot products of the 16 rows
// against 4 bytes of x each, started at -32 times x's sum over those 8 values: sum (u - 32) q within int16 (8 * 32 *
// 127), times the 16 rows' signed scales in one vpdpwssd (their high halves zeroed).
template <int R>
inline void q6_k_x16_tile(const Problem& p, int64_t g, int64_t m0) {
  using X = Q6_KX16;
  const int64_t blocks = p.K / X::QK, bp = p.q8->bp;
  const uint8_t* group = p.w + g * X::ROWS * p.row_bytes;
  const __m512i low4 = _mm512_set1_epi8(15), bits45 = _mm512_set1_epi8(0x30), low16 = _mm512_set1_epi32(0xFFFF);
  __m512 acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = group + b * X::GROUP_BYTES;
    __m512i sums[R];
    for (int m = 0; m < R; ++m) sums[m] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int sb = 0; sb < 16; ++sb) {
      const __m512i scales = _mm512_and_si512(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + X::SCALES_AT + 16 * sb))),
          low16);
      const uint8_t* sub = block + X::VALUES_AT + X::SUB_BYTES * sb;
      const __m512i high = _mm512_loadu_si512(sub + 128);
      for (int pair = 0; pair < 2; ++pair) {
        const __m512i v = _mm512_loadu_si512(sub + 64 * pair);
        // values 8 pair + t: high bits at 4 pair (into bits 4-5); values 8 pair + 4 + t: at 4 pair + 2
        const __m512i h0 = pair == 0 ? _mm512_slli_epi16(high, 4) : high;
        const __m512i h1 = pair == 0 ? _mm512_slli_epi16(high, 2) : _mm512_srli_epi16(high, 2);
        const __m512i u0 = _mm512_or_si512(_mm512_and_si512(v, low4), _mm512_and_si512(h0, bits45));
        const __m512i u1 =
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), _mm512_and_si512(h1, bits45));
        for (int m = 0; m < R; ++m) {
          const int64_t at = (m0 + m) * bp + 8 * b + sb / 2;  // x's block of 32 holding the sub-block
          const int8_t* q = p.q8->q.get() + at * 32 + 16 * (sb % 2) + 8 * pair;
          __m512i dots = _mm512_set1_epi32(-32 * p.q8->sum8[at * 4 + 2 * (sb % 2) + pair]);
          dots = _mm512_dpbusd_epi32(dots, u0, x_bytes(q));
          dots = _mm512_dpbusd_epi32(dots, u1, x_bytes(q + 4));
          sums[m] = _mm512_dpwssd_epi32(sums[m], dots, scales);
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + X::D_AT)));
    for (int m = 0; m < R; ++m) {
      const __m512 dx = _mm512_set1_ps(p.q8->d[(m0 + m) * bp + 8 * b]);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[m]), _mm512_mul_ps(d, dx), acc[m]);
    }
  }
  for (int m = 0; m < R; ++m) _mm512_storeu_ps(p.y + (m0 + m) * p.N + X::ROWS * g, acc[m]);
}

// y[:, n0:n1] (whole groups of 16 weight rows of interleaved type T): each group in turn, the rows of x in register
// tiles (`for_row_tiles`)
template <typename T>
void x16_rows(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t g = n0 / T::ROWS; g < n1 / T::ROWS; ++g) {
    for_row_tiles(p.M, [&](auto rows, int64_t m0) {
      constexpr int R = decltype(rows)::value;
      if constexpr (std::is_same_v<T, Q4_KX16>) {
        q4_k_x16_tile<R>(p, g, m0);
      } else {
        q6_k_x16_tile<R>(p, g, m0);
      }
    });
  }
}
#endif

// Rows of the interleaved weights' groups a build reads (0: none, their layouts are not made for it)
constexpr int INTERLEAVED_ROWS =
#if defined(NETRA_X16)
    Q4_KX16::ROWS;
#else
    0;
#endif

// dst = the rows src [rows, row_bytes] of GGML type `ggml_type` (Q4_K 12, Q6_K 14) in their interleaved layout
// (ggml_blocks.h; netra_jax/ops/ggml_blocks.py `interleave_rows` is the reference): the loader's re-lay at memory speed
// where the jnp one holds int32 copies of the values. Returns 0, or -1 for another type or rows not in groups of 16.
inline int32_t interleave_rows(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t row_bytes,
                               int32_t ggml_type) {
  const bool q4 = ggml_type == 12, q6 = ggml_type == 14;
  const int64_t bytes = q4 ? Q4_KX16::BYTES : Q6_KX16::BYTES, R = Q4_KX16::ROWS;
  if ((!q4 && !q6) || rows % R != 0 || row_bytes % bytes != 0) return -1;
  const int64_t nb = row_bytes / bytes;
  for (int64_t g = 0; g < rows / R; ++g) {
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* out = dst + (g * nb + b) * R * bytes;
      for (int64_t r = 0; r < R; ++r) {
        const uint8_t* blk = src + (g * R + r) * row_bytes + b * bytes;
        uint8_t v[256];  // the block's unsigned values in order
        if (q4) {
          std::memcpy(out + Q4_KX16::D_AT + 2 * r, blk, 2);
          std::memcpy(out + Q4_KX16::DMIN_AT + 2 * r, blk + 2, 2);
          for (int i = 0; i < 12; ++i) out[Q4_KX16::SCALES_AT + 16 * i + r] = blk[4 + i];
          for (int c = 0; c < 4; ++c) {
            for (int l = 0; l < 32; ++l) {
              v[64 * c + l] = blk[16 + 32 * c + l] & 15;
              v[64 * c + 32 + l] = blk[16 + 32 * c + l] >> 4;
            }
          }
          for (int q = 0; q < 32; ++q) {  // q = 4 j + 2 h + p: values 8 q + t and 8 q + 4 + t
            for (int t = 0; t < 4; ++t) {
              out[Q4_KX16::VALUES_AT + 64 * q + 4 * r + t] = v[8 * q + t] | v[8 * q + 4 + t] << 4;
            }
          }
        } else {
          std::memcpy(out + Q6_KX16::D_AT + 2 * r, blk + 208, 2);
          for (int s = 0; s < 16; ++s) out[Q6_KX16::SCALES_AT + 16 * s + r] = blk[192 + s];
          for (int n = 0; n < 2; ++n) {  // value 128 n + 32 k + l
            for (int k = 0; k < 4; ++k) {
              for (int l = 0; l < 32; ++l) {
                const uint8_t low = blk[64 * n + 32 * (k & 1) + l];
                v[128 * n + 32 * k + l] = (k < 2 ? low & 15 : low >> 4) | ((blk[128 + 32 * n + l] >> (2 * k)) & 3) << 4;
              }
            }
          }
          for (int s = 0; s < 16; ++s) {
            uint8_t* sub = out + Q6_KX16::VALUES_AT + Q6_KX16::SUB_BYTES * s;
            for (int t = 0; t < 4; ++t) {
              for (int p = 0; p < 2; ++p) {
                sub[64 * p + 4 * r + t] = (v[16 * s + 8 * p + t] & 15) | (v[16 * s + 8 * p + 4 + t] & 15) << 4;
              }
              uint8_t high = 0;
              for (int f = 0; f < 4; ++f) high |= (v[16 * s + 4 * f + t] >> 4) << (2 * f);
              sub[128 + 4 * r + t] = high;
            }
          }
        }
      }
    }
  }
  return 0;
}

}  // namespace netra::ggml
