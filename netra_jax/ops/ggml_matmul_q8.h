// The CPU matmul over GGML blocks (ggml_blocks.h) with int8 activations, llama.cpp's arithmetic and the engine's
// default for GGUF files: x's rows quantized once per call, integer dot products against the blocks' bytes.
//
// Types: the 32-value types, Q4_K / Q5_K as steps of 8 sub-blocks of 32 with their own scales and mins, Q6_K as
// steps of 8 blocks of 32 whose 16-value int8 scales multiply the dot products' int32 lanes. x's rows are quantized
// to blocks of 32 int8 values and a scale (d = max|x| / 127 over the 32 values, as llama.cpp's Q8_0 blocks; over the
// 256 of a block against the K-quants, as its Q8_K); a weight block's values are read as unsigned bytes and
// multiplied with integer dot products (AVX-512 VNNI dpbusd on two blocks a vector; AVX-VNNI, maddubs or scalar in
// the other builds); a block's int32 sums become float once, times d_w d_x, and the blocks' offsets (-8 d, the min
// m, ...) times d_x sum(q) are summed apart.
// - Up to 4 rows of x (16 against Q6_K: FEW_ROWS): each weight row is read once for tiles of up to 4 rows, two
//   blocks a dpbusd (with AVX-512 VBMI, the 4- and 5-bit types in groups of 4 blocks put in place by byte permutes,
//   their scales repeated over their lanes by another: see "groups of blocks" below; the K-quants' dot products times
//   their sub-blocks' integer scales summed over the whole block in int32, one conversion a block where the float
//   scales of each pair of sub-blocks took three instructions and a stored-and-reloaded scale array: 1.5x the Q4_K
//   rows a second).
// - More rows (and prefill chunks past the float path's 128): the rows of x in the lanes, a tile of 8 weight rows
//   unpacked into bytes and scales once, then every 4 bytes of a weight row broadcast against 16 rows' 4 bytes per
//   dpbusd (64 multiply-adds an instruction, a block's sums converted once per weight row and group of rows).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "ggml_matmul.h"

namespace netra::ggml {

// Round to the nearest integer, ties to even (the default rounding mode), lane by lane.
inline vi nearest(vf v) {
#if defined(__AVX512F__)
  return bits_as<vi>(_mm512_cvtps_epi32(bits_as<__m512>(v)));
#elif defined(__AVX2__)
  return bits_as<vi>(_mm256_cvtps_epi32(bits_as<__m256>(v)));
#else
  vi r;
  for (int i = 0; i < VW; ++i) r[i] = static_cast<int32_t>(__builtin_nearbyintf(v[i]));
  return r;
#endif
}

// Row m of x quantized to blocks of 32 int8 values per call: x[m, 32 b + j] ~ d[m, b] q[m, b, j] with d = max|x| /
// 127 over the block (over its 8 blocks' 256 values for the K-quants, INT_BLOCKS: d repeated) and q rounded to
// nearest (|x - d q| <= d / 2); s[m, b] = d sum_j q[m, b, j] (sum[m, b] the integer sum). Rows padded to bp blocks
// (a multiple of 8) with zero blocks.
// With more than FEW_ROWS rows, the same blocks also with the rows in the lanes: VW rows a group (the rows past M
// zero), group r's block b a run of 32 / BPL vectors, vector t holding bytes [BPL t, BPL (t + 1)) of each row's block.
struct Q8Rows {
  std::unique_ptr<int8_t[]> q;  // [M, bp, 32]
  std::unique_ptr<float[]> d;   // [M, bp]
  std::unique_ptr<float[]> s;   // [M, bp]
  std::unique_ptr<int32_t[]> sum;  // [M, bp] sum_j q[m, b, j] (the interleaved kernels' offsets)
  std::unique_ptr<int32_t[]> sum8;  // [M, bp, 4] the sums of each 8 values of a block (Q6_KX16's centering)
  int64_t bp = 0;
  std::unique_ptr<int8_t[]> lanes_q;  // [groups, bp, 32 / BPL, VW, BPL]
  std::unique_ptr<float[]> lanes_d;   // [groups, bp, VW]
  std::unique_ptr<float[]> lanes_s;   // [groups, bp, VW]
  int64_t groups = 0;
  // At most Q8_TM rows of a 4- or 5-bit type with AVX-512 VBMI and VNNI: the blocks in the weights' groups (Group),
  // per row and group its two vectors of q, and per int32 lane of the group's dot products its block's d, d times
  // the lane's sum of q, and -center times that sum.
  std::unique_ptr<int8_t[]> group_q;   // [M, n_groups, 2, 64]
  std::unique_ptr<float[]> group_d;    // [M, n_groups, 16]
  std::unique_ptr<float[]> group_s;    // [M, n_groups, 16]
  std::unique_ptr<int32_t[]> group_c;  // [M, n_groups, 16]
  int64_t n_groups = 0;
  // SUB16 types (6-bit values centered at 32): per row and vector of PB blocks, -32 times each dot product lane's sum
  // of q, the dot products' starting value (up to FEW_ROWS); with the rows in the lanes, d times the sum of q over
  // each half of a block
  std::unique_ptr<vi[]> c32;         // [M, bp / PB]
  std::unique_ptr<float[]> lanes_h;  // [groups, bp, 2, VW]
};

constexpr int Q8_TM = 4;  // rows of x sharing a weight row's byte vectors

// Rows of x read weight row by weight row, in tiles of at most Q8_TM; more take the rows-in-lanes layout. Measured
// (2-core EPYC, K 2048 x N 8192): the lanes are faster from 8 rows for the 32-value types and Q4_K (Q4_K 8 rows 22.8
// against 26.8 ms in tiles), Q6_K's scaled halves in the lanes are slower up to 16 rows (8 rows 64 against 29.5 ms,
// 16 rows 67 against 65 ms).
// (INTERLEAVED types: every number of rows in their own kernel, no rows-in-lanes copy)
template <typename T>
constexpr int64_t FEW_ROWS = INTERLEAVED<T> ? INT64_MAX : SUB16<T> ? 16 : Q8_TM;

inline void put_rows_in_lanes(Q8Rows& r, int64_t M) {
  r.groups = (M + VW - 1) / VW;
  r.lanes_q.reset(new int8_t[r.groups * r.bp * 32 * VW]());
  r.lanes_d.reset(new float[r.groups * r.bp * VW]());
  r.lanes_s.reset(new float[r.groups * r.bp * VW]());
  for (int64_t m = 0; m < M; ++m) {
    const int64_t group = m / VW, lane = m % VW;
    for (int64_t b = 0; b < r.bp; ++b) {
      const int64_t at = (group * r.bp + b) * VW + lane;
      r.lanes_d[at] = r.d[m * r.bp + b];
      r.lanes_s[at] = r.s[m * r.bp + b];
      for (int t = 0; t < 32 / BPL; ++t) {
        std::memcpy(r.lanes_q.get() + (((group * r.bp + b) * (32 / BPL) + t) * VW + lane) * BPL,
                    r.q.get() + (m * r.bp + b) * 32 + t * BPL, BPL);
      }
    }
  }
}

template <typename T>
void put_rows_in_groups(Q8Rows& r, int64_t M);

template <typename T>
Q8Rows quantize_rows(const float* x, int64_t M, int64_t K) {
  Q8Rows r;
  const int64_t blocks = K / 32;
  r.bp = (blocks + 7) / 8 * 8;
  r.q.reset(new int8_t[M * r.bp * 32]());
  r.d.reset(new float[M * r.bp]());
  r.s.reset(new float[M * r.bp]());
  r.sum.reset(new int32_t[M * r.bp]());
  if constexpr (std::is_same_v<T, Q6_KX16>) r.sum8.reset(new int32_t[M * r.bp * 4]());
  for (int64_t m = 0; m < M; ++m) {
    float* amax = r.d.get() + m * r.bp;  // max|x| of each block of 32, then of its block of 256 (INT_BLOCKS)
    for (int64_t b = 0; b < blocks; ++b) {
      vf a = {};
      for (int i = 0; i < 32; i += VW) {
        const vf v = load(x + m * K + b * 32 + i);
        a = a > v ? a : v;
        a = a > -v ? a : -v;
      }
      amax[b] = 0.0f;
      for (int i = 0; i < VW; ++i) amax[b] = std::max(amax[b], a[i]);
    }
    if constexpr (INT_BLOCKS<T>) {
      for (int64_t b = 0; b < blocks; b += 8) {
        const float a = *std::max_element(amax + b, amax + b + 8);
        std::fill(amax + b, amax + b + 8, a);
      }
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + m * K + b * 32;
      const float a = amax[b], d = a / 127.0f, inverse = a > 0.0f ? 127.0f / a : 0.0f;
      vi sum = {};
      int8_t* qb = r.q.get() + (m * r.bp + b) * 32;
      for (int i = 0; i < 32; i += VW) {
        const vi q = nearest(load(xb + i) * inverse);  // [VW] in [-127, 127]
        sum += q;
        for (int j = 0; j < VW; ++j) qb[i + j] = static_cast<int8_t>(q[j]);
      }
      int32_t total = 0;
      for (int i = 0; i < VW; ++i) total += sum[i];
      r.d[m * r.bp + b] = d;
      r.s[m * r.bp + b] = d * static_cast<float>(total);
      r.sum[m * r.bp + b] = total;
      if constexpr (std::is_same_v<T, Q6_KX16>) {
        for (int e = 0; e < 4; ++e) {
          int32_t part = 0;
          for (int j = 0; j < 8; ++j) part += qb[8 * e + j];
          r.sum8[(m * r.bp + b) * 4 + e] = part;
        }
      }
    }
  }
  if constexpr (IN_K4_ORDER<T>) {  // each step's blocks in K4_ORDER, as the weights' values are read
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t g = 0; g < blocks; g += 8) {
        const int64_t at = m * r.bp + g;
        int8_t q[8 * 32];
        float d[8], sums[8];
        std::memcpy(q, r.q.get() + at * 32, sizeof(q));
        std::memcpy(d, r.d.get() + at, sizeof(d));
        std::memcpy(sums, r.s.get() + at, sizeof(sums));
        for (int j = 0; j < 8; ++j) {
          std::memcpy(r.q.get() + (at + j) * 32, q + K4_ORDER[j] * 32, 32);
          r.d[at + j] = d[K4_ORDER[j]], r.s[at + j] = sums[K4_ORDER[j]];
        }
      }
    }
  }
  if (M > FEW_ROWS<T>) {
    put_rows_in_lanes(r, M);
    if constexpr (SUB16<T>) {
      r.lanes_h.reset(new float[r.groups * r.bp * 2 * VW]());
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t b = 0; b < r.bp; ++b) {
          const int8_t* q = r.q.get() + (m * r.bp + b) * 32;
          for (int h = 0; h < 2; ++h) {
            int32_t sum = 0;
            for (int l = 0; l < 16; ++l) sum += q[16 * h + l];
            r.lanes_h[(((m / VW) * r.bp + b) * 2 + h) * VW + m % VW] = r.d[m * r.bp + b] * static_cast<float>(sum);
          }
        }
      }
    }
  } else if constexpr (SUB16<T>) {
    const vb ones = vb{} + static_cast<uint8_t>(1);
    r.c32.reset(new vi[M * r.bp / PB]);
    for (int64_t v = 0; v < M * r.bp / PB; ++v) r.c32[v] = dot<1>(ones, r.q.get() + v * 32 * PB) * -32;
  } else {
    put_rows_in_groups<T>(r, M);
  }
  return r;
}

// ---------------------------------------------------------------- int8 activations, few rows: groups of blocks

// With AVX-512 VBMI and VNNI the 4- and 5-bit types' weight rows are read in groups of 4 blocks whose bytes one
// two-source byte permute (vpermt2b over the group's first 128 bytes) puts in place: two vectors, the low and the
// high 16 values of each block, 16 bytes a block, so that a block's products land in 4 int32 lanes of each. A
// second permute gathers the group's fp16 scales (and mins), each repeated over its block's 4 lanes: a group costs
// one conversion and one FMA per row of x, where the steps below take a gather per 8 blocks and a lane shuffle, a
// conversion and an FMA per 2 blocks (1.5x the weight rows a second with weights in cache). x is laid out once per
// call to match, the blocks' offsets folded in: -center sum(q) as the dot products' starting value (Q4_0, Q5_0),
// or d_x times each lane's sum of q, against the mins repeated over their lanes (Q4_1, Q5_1). Q8_0 keeps the
// steps: its 4 blocks are 136 bytes, past one permute's reach.
#if defined(NETRA_Q8_AVX512) && defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
#define NETRA_Q8_GROUPS 1
#endif

template <typename T>
constexpr bool GROUPED = T::QK == 32 && (T::U_BITS == 4 || T::U_BITS == 5);

struct Group {
  static constexpr int BLOCKS = 4;  // blocks per group
  static constexpr int LPB = 4;     // int32 lanes per block
  // Byte t of vector v (0: low, 1: high values) holds value v * 16 + t % 16 of the group's block t / 16.
  static constexpr int value(int v, int t) { return v * 16 + t % 16; }
};

// The permutes' byte indices into a group's first 128 bytes: values (the qs byte holding value j and j + 16 of
// each block, for both vectors) and scales (fp16 d in the low 32 bytes, the min m, where the type has one, in the
// high 32, each repeated LPB times).
template <typename T>
struct GroupIndex {
  int8_t values[64], scales[64];
  constexpr GroupIndex() : values{}, scales{} {
    for (int t = 0; t < 64; ++t) {
      values[t] = static_cast<int8_t>(t / 16 * T::BYTES + T::QS_AT + t % 16);
      const int half = t / 2, field = half < 16 || T::M_AT < 0 ? 0 : T::M_AT;
      scales[t] = static_cast<int8_t>(half % 16 / Group::LPB * T::BYTES + field + t % 2);
    }
  }
};

template <typename T>
constexpr GroupIndex<T> GROUP_INDEX{};

template <typename T>
void put_rows_in_groups(Q8Rows& r, int64_t M) {
#if defined(NETRA_Q8_GROUPS)
  if constexpr (GROUPED<T>) {
    using G = Group;
    static_assert(3 * T::BYTES + T::QS_AT + 16 <= 128);  // one permute's reach
    r.n_groups = r.bp / G::BLOCKS;  // bp: a multiple of 8 blocks, zeros past the row's
    const int64_t cells = M * r.n_groups;
    r.group_q.reset(new int8_t[cells * 128]);
    r.group_d.reset(new float[cells * 16]);
    r.group_s.reset(new float[cells * 16]);
    r.group_c.reset(new int32_t[cells * 16]);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t g = 0; g < r.n_groups; ++g) {
        const int64_t cell = m * r.n_groups + g, first = m * r.bp + g * G::BLOCKS;
        int32_t sums[16] = {};
        for (int v = 0; v < 2; ++v) {
          for (int t = 0; t < 64; ++t) {
            const int8_t q = r.q[(first + t / 16) * 32 + G::value(v, t)];
            r.group_q[(cell * 2 + v) * 64 + t] = q;
            sums[t / 4] += q;
          }
        }
        for (int l = 0; l < 16; ++l) {
          const float d = r.d[first + l / G::LPB];
          r.group_d[cell * 16 + l] = d;
          r.group_s[cell * 16 + l] = d * static_cast<float>(sums[l]);
          r.group_c[cell * 16 + l] = -T::CENTER * sums[l];
        }
      }
    }
  }
#else
  (void)r, (void)M;
#endif
}

#if defined(NETRA_Q8_GROUPS)
// The weight values of the group at b (its first 128 bytes z0, z1) as unsigned bytes in x's layout (Group): u[0]
// the low 16 values of each block, u[1] the high 16.
template <typename T>
inline void group_values(const uint8_t* b, __m512i z0, __m512i z1, __m512i index, __m512i (&u)[2]) {
  const __m512i v = _mm512_permutex2var_epi8(z0, index, z1);
  const __m512i low4 = _mm512_set1_epi8(15);
  u[0] = _mm512_and_si512(v, low4);
  u[1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  if constexpr (T::QH_AT >= 0) {  // fifth bits: value j's is bit j of the block's 32-bit qh
    uint64_t lo = 0, hi = 0;
    for (int i = 0; i < 4; ++i) {
      const uint32_t h = u32(b + i * T::BYTES + T::QH_AT);
      lo |= static_cast<uint64_t>(h & 0xFFFF) << (16 * i);
      hi |= static_cast<uint64_t>(h >> 16) << (16 * i);
    }
    const __m512i sixteen = _mm512_set1_epi8(16);
    u[0] = _mm512_mask_add_epi8(u[0], _cvtu64_mask64(lo), u[0], sixteen);
    u[1] = _mm512_mask_add_epi8(u[1], _cvtu64_mask64(hi), u[1], sixteen);
  }
}

// y[:, n0:n1] for the R rows of x, weight row by weight row, group by group: per group one pair of byte vectors
// of weights shared by the R rows' integer dot products, the scales repeated over their lanes times each row's d_x.
template <typename T, int R>
void q8_group_rows(const Problem& p, int64_t n0, int64_t n1) {
  using G = Group;
  const int64_t blocks = p.K / 32, whole = blocks / G::BLOCKS, ng = p.q8->n_groups;
  const uint8_t* end = p.w + p.N * p.row_bytes;
  const int8_t* xq = p.q8->group_q.get();
  const float* xd = p.q8->group_d.get();
  const float* xs = p.q8->group_s.get();
  const int32_t* xc = p.q8->group_c.get();
  const __m512i value_index = _mm512_loadu_si512(GROUP_INDEX<T>.values);
  const __m512i scale_index = _mm512_loadu_si512(GROUP_INDEX<T>.scales);
  alignas(64) uint8_t copy[128];  // a group whose 128 bytes pass the weights' end, or a partial last group, padded
  const auto copied = [&](const uint8_t* b, int64_t bytes) {
    std::memset(copy, 0, sizeof(copy));
    std::memcpy(copy, b, static_cast<size_t>(bytes));
    return static_cast<const uint8_t*>(copy);
  };
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * p.row_bytes;
    __m512 acc[R][2], mins[R];
    for (int m = 0; m < R; ++m) acc[m][0] = acc[m][1] = mins[m] = _mm512_setzero_ps();
    // group g at b, the lanes of its blocks `valid` (zero scales past them), into accumulator PARITY
    const auto group = [&](const uint8_t* b, int64_t g, __mmask16 valid, auto parity) {
      const __m512i z0 = _mm512_loadu_si512(b), z1 = _mm512_loadu_si512(b + 64);
      const __m512i sv = _mm512_permutex2var_epi8(z0, scale_index, z1);
      const __m512 dw = _mm512_maskz_cvtph_ps(valid, _mm512_castsi512_si256(sv));
      __m512i u[2];
      group_values<T>(b, z0, z1, value_index, u);
      for (int m = 0; m < R; ++m) {
        const int64_t cell = m * ng + g;
        __m512i sums = T::CENTER != 0 ? _mm512_loadu_si512(xc + cell * 16) : _mm512_setzero_si512();
        sums = _mm512_dpbusd_epi32(sums, u[0], _mm512_loadu_si512(xq + cell * 128));
        sums = _mm512_dpbusd_epi32(sums, u[1], _mm512_loadu_si512(xq + cell * 128 + 64));
        const __m512 c = _mm512_mul_ps(dw, _mm512_loadu_ps(xd + cell * 16));
        acc[m][parity] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), c, acc[m][parity]);
        if constexpr (T::M_AT >= 0) {
          const __m512 mw = _mm512_maskz_cvtph_ps(valid, _mm512_extracti64x4_epi64(sv, 1));
          mins[m] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(xs + cell * 16), mins[m]);
        }
      }
    };
    const auto whole_group = [&](int64_t g, auto parity) {
      const uint8_t* b = row + g * G::BLOCKS * T::BYTES;
      __builtin_prefetch(b + PREFETCH, 0, 2);  // a group's bytes (68-96) span at most two lines ahead
      __builtin_prefetch(b + PREFETCH + LINE_BYTES, 0, 2);
      group(b + 128 <= end ? b : copied(b, end - b), g, static_cast<__mmask16>(0xFFFF), parity);
    };
    int64_t g = 0;
    for (; g + 2 <= whole; g += 2) {
      whole_group(g, std::integral_constant<int, 0>{});
      whole_group(g + 1, std::integral_constant<int, 1>{});
    }
    if (g < whole) whole_group(g++, std::integral_constant<int, 0>{});
    if (const int64_t rest = blocks - whole * G::BLOCKS; rest > 0) {
      const uint8_t* b = copied(row + whole * G::BLOCKS * T::BYTES, rest * T::BYTES);
      group(b, g, static_cast<__mmask16>((1u << (rest * G::LPB)) - 1), std::integral_constant<int, 1>{});
    }
    for (int m = 0; m < R; ++m) {
      const __m512 total = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), mins[m]);
      p.y[m * p.N + n] = _mm512_reduce_add_ps(total);
    }
  }
}

template <typename T>
void q8_groups(const Problem& p, int64_t n0, int64_t n1) {
  switch (p.M) {
    case 1:
      return q8_group_rows<T, 1>(p, n0, n1);
    case 2:
      return q8_group_rows<T, 2>(p, n0, n1);
    case 3:
      return q8_group_rows<T, 3>(p, n0, n1);
    default:
      return q8_group_rows<T, 4>(p, n0, n1);
  }
}
#endif

// y[m0 : m0 + R, n] from weight row n and the quantized rows: per step of 8 blocks the weight scales times each
// row's activation scales (one float per block, spread over the block's lanes), and the offsets' products summed
// apart; per PB blocks one byte vector of weights, shared by the R rows' integer dot products. The K-quants
// (INT_BLOCKS, x's d one per 256 values) sum a block's dot products times their sub-blocks' integer scales in int32
// and convert once per block.
template <typename T, int R>
inline void q8_tile(const Problem& p, int64_t n, int64_t m0, int64_t limit) {
  const int64_t blocks = p.K / 32, bp = p.q8->bp;
  const uint8_t* row = p.w + n * p.row_bytes;
  vf acc[R][2] = {};
  v8 offsets[R] = {};
  for (int64_t g = 0; g < blocks; g += 8) {
    const int nb = static_cast<int>(std::min<int64_t>(8, blocks - g));
    const uint8_t* b = row + g / 8 * T::STEP_BYTES;
    if (m0 == 0) prefetch(p, b - p.w + PREFETCH, nb * T::STEP_BYTES / 8, limit);
    if constexpr (INT_BLOCKS<T>) {  // one block of 8 sub-blocks a step
      const Ints16 ints = T::ints(b);
      vi sums[R] = {};
#pragma GCC unroll 8
      for (int i = 0; i < 8; i += PB) {  // unrolled: the lanes' scale indices are constants
        const vb u = T::values(b, i, 8);
        const vi scales = T::lane_scales(ints, i);
        for (int m = 0; m < R; ++m) {
          const int64_t at = (m0 + m) * bp + g + i;
          const int8_t* q = p.q8->q.get() + at * 32;
          // SUB16: sum (u - 32) q per lane, exact in int32
          const vi dots = SUB16<T> ? dot<T::U_BITS>(u, q, p.q8->c32[at / PB]) : dot<T::U_BITS>(u, q);
          sums[m] = scaled_sum<SUB16<T>>(sums[m], dots, scales);  // Q6_K's scales are signed
        }
      }
      const float dw = T::d(b);
      for (int m = 0; m < R; ++m) {
        const int64_t at = (m0 + m) * bp + g;
        acc[m][0] += __builtin_convertvector(sums[m], vf) * (dw * p.q8->d[at]);
      }
      if constexpr (!SUB16<T>) {
        const v8 mins = T::mins(b, ints);
        for (int m = 0; m < R; ++m) offsets[m] += mins * load8(p.q8->s.get() + (m0 + m) * bp + g);
      }
      continue;
    }
    alignas(64) float s[SCALES];  // [d_w x 8, offset_w x 8], zeros past nb
    T::qscales(b, nb, s);
    v8 c[R];  // d_w d_x per block
    for (int m = 0; m < R; ++m) {
      const int64_t at = (m0 + m) * bp + g;
      c[m] = load8(s) * load8(p.q8->d.get() + at);
      offsets[m] += load8(s + 8) * load8(p.q8->s.get() + at);
    }
    // a whole step unrolled (the accumulators' indices known: they stay in registers), a last partial one not
    const auto blocks_of_step = [&](auto whole) {
      constexpr bool WHOLE = decltype(whole)::value;
      for (int i = 0; i < (WHOLE ? 8 : nb); i += PB) {
        const vb u = T::values(b, i, nb);  // a missing second block: weight 0 in c
        for (int m = 0; m < R; ++m) {
          const int64_t at = (m0 + m) * bp + g + i;
          const vi dots = dot<T::U_BITS>(u, p.q8->q.get() + at * 32);
          acc[m][WHOLE ? (i / PB) & 1 : 0] += __builtin_convertvector(dots, vf) * per_block(c[m], i);
        }
      }
    };
    if (nb == 8) {
      blocks_of_step(std::true_type{});
    } else {
      blocks_of_step(std::false_type{});
    }
  }
  for (int m = 0; m < R; ++m) {
    float o = 0.0f;
    for (int i = 0; i < 8; ++i) o += offsets[m][i];
    p.y[(m0 + m) * p.N + n] = hsum(acc[m][0] + acc[m][1]) + o;
  }
}

// f(std::integral_constant<int, R>{}, m0) for the rows of x in tiles [m0, m0 + R) of near-equal heights R (at most
// Q8_TM): the register tiles of the kernels that read a weight row (or group of rows) once for all rows of x
template <typename F>
inline void for_row_tiles(int64_t M, F&& f) {
  static_assert(Q8_TM == 4);
  const int64_t tiles = (M + Q8_TM - 1) / Q8_TM;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t m0 = t * M / tiles, rows = (t + 1) * M / tiles - m0;
    switch (rows) {
      case 1:
        f(std::integral_constant<int, 1>{}, m0);
        break;
      case 2:
        f(std::integral_constant<int, 2>{}, m0);
        break;
      case 3:
        f(std::integral_constant<int, 3>{}, m0);
        break;
      case 4:
        f(std::integral_constant<int, 4>{}, m0);
        break;
    }
  }
}

// y[:, n0:n1] with int8 activations: each weight row in turn, the rows of x in register tiles (`for_row_tiles`); the
// weight row stays in L1 over the tiles.
template <typename T>
void q8_rows(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t limit = n1 * p.row_bytes;
  for (int64_t n = n0; n < n1; ++n) {
    for_row_tiles(p.M, [&](auto rows, int64_t m0) { q8_tile<T, decltype(rows)::value>(p, n, m0, limit); });
  }
}

// weight rows per tile with the rows of x in the lanes: each row's int32 sums are a chain of dependent dot products
// (latency 5), so 8 chains keep AVX-512's dpbusd busy (16 + 2 registers); AVX2 has 16 registers
constexpr int TNQ = VW == 16 ? 8 : 4;

// y[:, n0:n1] with int8 activations and more than FEW_ROWS rows, the rows of x in the lanes: a tile of TNQ weight rows
// is unpacked whole (bytes u and the blocks' scales and offsets into buffers), then for each group of VW rows of x and
// each block, every 4 (BPL) bytes of a weight row broadcast to all lanes are multiplied by the group's bytes in one
// integer dot product (dpbusd: lanes = rows, summing 4 products each); a block's int32 sums become float once, times
// d_w d_x, plus offset_w d_x sum(q).
template <typename T>
void q8_lanes(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t blocks = p.K / 32, bp = p.q8->bp;
  std::unique_ptr<vb[]> ubuf(new vb[TNQ * bp * 32 / sizeof(vb)]);
  uint8_t* u = reinterpret_cast<uint8_t*>(ubuf.get());  // [TNQ, bp, 32]
  std::unique_ptr<float[]> dw(new float[TNQ * bp]), ow(new float[TNQ * bp]);
  std::unique_ptr<int32_t[]> sub_scales(SUB16<T> ? new int32_t[TNQ * bp * 2] : nullptr);  // [TNQ, bp, 2]
  for (int64_t n = n0; n < n1; n += TNQ) {
    const int tn = static_cast<int>(std::min<int64_t>(TNQ, n1 - n));
    for (int j = 0; j < TNQ; ++j) {
      const uint8_t* row = p.w + (n + std::min(j, tn - 1)) * p.row_bytes;  // a partial tile repeats its last row
      for (int64_t g = 0; g < blocks; g += 8) {
        const int nb = static_cast<int>(std::min<int64_t>(8, blocks - g));
        const uint8_t* b = row + g / 8 * T::STEP_BYTES;
        alignas(64) float s[SCALES];
        T::qscales(b, nb, s);
        std::memcpy(dw.get() + j * bp + g, s, sizeof(float) * 8);  // whole steps (bp a multiple of 8)
        std::memcpy(ow.get() + j * bp + g, s + 8, sizeof(float) * 8);
        if constexpr (SUB16<T>) {  // the int8 scales of the step's 16 halves of blocks
          for (int i = 0; i < 16; ++i) sub_scales[(j * bp + g) * 2 + i] = T::sub_scale(b, i);
        }
        for (int i = 0; i < nb; i += PB) {
          const vb v = T::values(b, i, nb);  // bp > g + i + 1: room for a pair
          std::memcpy(u + (j * bp + g + i) * 32, &v, sizeof(v));
        }
      }
    }
    for (int64_t r = 0; r < p.q8->groups; ++r) {
      vf acc[TNQ] = {};
      for (int64_t b = 0; b < blocks; ++b) {
        const int8_t* q = p.q8->lanes_q.get() + (r * bp + b) * 32 * VW;
        const vf dx = load(p.q8->lanes_d.get() + (r * bp + b) * VW), sx = load(p.q8->lanes_s.get() + (r * bp + b) * VW);
        if constexpr (SUB16<T>) {  // each half's sums times its scale (exact in int32), the centering from x's sums
          vi lo[TNQ] = {}, hi[TNQ] = {};
          for (int t = 0; t < 32 / BPL; ++t) {
            for (int j = 0; j < TNQ; ++j) {
              vi& sums = t < 16 / BPL ? lo[j] : hi[j];
              sums = dot<T::U_BITS>(broadcast(u + (j * bp + b) * 32 + t * BPL), q + t * VW * BPL, sums);
            }
          }
          const float* h = p.q8->lanes_h.get() + (r * bp + b) * 2 * VW;
          const vf h_lo = load(h), h_hi = load(h + VW);
          for (int j = 0; j < TNQ; ++j) {
            const int32_t s_lo = sub_scales[(j * bp + b) * 2], s_hi = sub_scales[(j * bp + b) * 2 + 1];
            const vf scaled = __builtin_convertvector(lo[j] * s_lo + hi[j] * s_hi, vf);
            const vf center = h_lo * static_cast<float>(s_lo) + h_hi * static_cast<float>(s_hi);
            acc[j] += (scaled * dx - center * 32.0f) * dw[j * bp + b];
          }
          continue;
        }
        vi sums[TNQ] = {};
        for (int t = 0; t < 32 / BPL; ++t) {
          for (int j = 0; j < TNQ; ++j) {
            sums[j] = dot<T::U_BITS>(broadcast(u + (j * bp + b) * 32 + t * BPL), q + t * VW * BPL, sums[j]);
          }
        }
        for (int j = 0; j < TNQ; ++j) {
          acc[j] += __builtin_convertvector(sums[j], vf) * (dx * dw[j * bp + b]) + sx * ow[j * bp + b];
        }
      }
      for (int j = 0; j < tn; ++j) {
        for (int l = 0; l < VW && r * VW + l < p.M; ++l) p.y[(r * VW + l) * p.N + n + j] = acc[j][l];
      }
    }
  }
}

}  // namespace netra::ggml
