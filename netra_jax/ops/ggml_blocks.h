// GGML's block formats (llama.cpp's quantized weights) in vector registers, for the CPU matmul over them
// (ggml_matmul.h, ggml_matmul_q8.h): each type's values de-quantized to float vectors, or read as bytes for int8 dot
// products. Block layouts as in ggml-common.h (fp16 fields little-endian IEEE half), gguf.quants' de-quantization
// their reference.
//
// - De-quantizing: a block's bytes are widened to int32 lanes (one instruction per vector), nibbles and high bits
//   put together with integer vector ops (AVX-512: the fifth bits of Q5 types as lane masks), converted to float and
//   scaled with one FMA per vector: q * d + offset, offset the block's (or sub-block's) min, or -8 d, -16 d, -32 d
//   for the centered types (exact: the FMA rounds once, like the reference's (q - 8) * d).
// - Scales: those of a step (256 values: 8 blocks of 32, or one K-quant block) are converted together into a small
//   float array (a gather of the fp16 fields and one vector conversion; the K-quants' packed 6-bit scales and mins
//   unpacked as one vector), which each vector then broadcasts from memory: a broadcast load where converting and
//   broadcasting per block took 3-4 instructions on the shuffle port, the de-quantization's bottleneck.
// - As bytes (int8 activations): a block's values as unsigned bytes (nibbles, fifth bits added, 6-bit values, or
//   Q8_0's bytes + 128), two blocks a 64-byte vector with AVX-512; the K-quants' integer sub-block scales and mins.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace netra::ggml {

#if defined(__AVX512F__)
constexpr int VW = 16;  // floats per vector register
#elif defined(__AVX2__)
constexpr int VW = 8;
#else
constexpr int VW = 4;
#endif

typedef float vf __attribute__((vector_size(VW * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VW * sizeof(int32_t))));
typedef uint32_t vu __attribute__((vector_size(VW * sizeof(uint32_t))));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

inline float hsum(vf v) {
#if defined(__AVX512F__)
  __m512 r;
  std::memcpy(&r, &v, sizeof(r));
  return _mm512_reduce_add_ps(r);
#else
  float s = 0.0f;
  for (int i = 0; i < VW; ++i) s += v[i];
  return s;
#endif
}

// VW bytes widened to int32 lanes, sign-extended (SIGNED) or zero-extended (one instruction each with AVX2 /
// AVX-512: GCC 12 scalarizes the generic __builtin_convertvector of 8-bit vectors).
template <bool SIGNED>
inline vi widen(const uint8_t* p) {
  vi out;
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m512i v = SIGNED ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  std::memcpy(&out, &v, sizeof(out));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m256i v = SIGNED ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
  std::memcpy(&out, &v, sizeof(out));
#else
  for (int i = 0; i < VW; ++i) out[i] = SIGNED ? static_cast<int32_t>(static_cast<int8_t>(p[i])) : p[i];
#endif
  return out;
}

inline vi widen_u8(const uint8_t* p) { return widen<false>(p); }
inline vi widen_i8(const uint8_t* p) { return widen<true>(p); }

// q with bit 4 set in the lanes l whose bit l of `bits` is set.
inline vi with_bit4(vi q, uint32_t bits) {
#if defined(__AVX512F__)
  __m512i v;
  std::memcpy(&v, &q, sizeof(v));
  v = _mm512_mask_or_epi32(v, static_cast<__mmask16>(bits), v, _mm512_set1_epi32(16));
  std::memcpy(&q, &v, sizeof(q));
  return q;
#else
  vu lane;
  for (int i = 0; i < VW; ++i) lane[i] = i;
  return q | (vi)((((vu{} + bits) >> lane) & 1) << 4);
#endif
}

// The bytes qh[0, VW), whose bit s becomes bit 4 of q's lanes.
struct HighBits {
#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512F__)
  __m128i v;
  explicit HighBits(const uint8_t* qh) : v(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qh))) {}
  vi add(vi q, int s) const {
    return with_bit4(q, _mm_test_epi8_mask(v, _mm_set1_epi8(static_cast<char>(1 << s))));
  }
#else
  vi h;
  explicit HighBits(const uint8_t* qh) : h(widen_u8(qh)) {}
  vi add(vi q, int s) const { return q | (((h >> s) & 1) << 4); }
#endif
};

// A little-endian IEEE half at p, as float.
inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 31, mant = h & 1023;
  uint32_t bits;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float
    const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
    std::memcpy(&bits, &v, sizeof(bits));
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

inline uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Block formats: QK values in BYTES bytes, GROUP blocks (256 values) a step. scales(b, nb, s) writes the scales and
// offsets of the nb <= GROUP blocks from b into s (float, the whole step's at once: fp16 conversions and products
// as vectors, the blocks then broadcast theirs from memory); block(b, s, emit) calls emit(i, v) for each vector v of
// the block's values [i, i + VW), with s at the block's own scales (s + i for block i of a step of 32-value blocks).

inline vf splat(const float* p) { return vf{} + *p; }

// Makes the compiler assume that v changed in memory: what it wrote there is read back from memory, not kept in
// registers (broadcasts from memory take a load port; from a register lane they take a shuffle).
template <typename V>
inline void in_memory(V& v) {
  __asm__("" : "+m"(v));
}

// q * scale + offset (contracted to one FMA)
inline vf affine(vi q, vf scale, vf offset) { return __builtin_convertvector(q, vf) * scale + offset; }

// The fp16 fields at byte AT of nb <= 8 consecutive blocks of BYTES bytes -> out[0, 8) (zeros past nb): one gather
// of the blocks' 32-bit words at AT (inside each block), their low halves converted together.
template <int BYTES, int AT>
inline void block_halves(const uint8_t* b, int nb, float* out) {
#if defined(__AVX2__) && defined(__F16C__)
  const __m256i at = _mm256_setr_epi32(AT, AT + BYTES, AT + 2 * BYTES, AT + 3 * BYTES, AT + 4 * BYTES,
                                       AT + 5 * BYTES, AT + 6 * BYTES, AT + 7 * BYTES);
  const int* base = reinterpret_cast<const int*>(b);
#if defined(__AVX512VL__)
  const __m256i v = nb == 8 ? _mm256_i32gather_epi32(base, at, 1)
                            : _mm256_mmask_i32gather_epi32(_mm256_setzero_si256(), (1 << nb) - 1, at, base, 1);
  const __m128i h = _mm256_cvtepi32_epi16(v);
#else
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i v = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), base, at,
                                                _mm256_cmpgt_epi32(_mm256_set1_epi32(nb), lanes), 1);
  const __m256i packed = _mm256_packus_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0xffff)), _mm256_setzero_si256());
  const __m128i h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
#endif
  _mm256_storeu_ps(out, _mm256_cvtph_ps(h));
#else
  for (int i = 0; i < 8; ++i) out[i] = i < nb ? half(b + i * BYTES + AT) : 0.0f;
#endif
}

// 32-value blocks with one scale d (half at byte 0): s[i] = d of block i, s[8 + i] = its offset: `center` * d, or
// with a min m (half at byte 2), m.
template <int BYTES>
inline void scales_32(const uint8_t* b, int nb, float* s, bool has_min, float center) {
  block_halves<BYTES, 0>(b, nb, s);
  if (has_min) {
    block_halves<BYTES, 2>(b, nb, s + 8);
  } else {
    for (int i = 0; i < 8; ++i) s[8 + i] = center * s[i];
  }
}

// ---------------------------------------------------------------- block values as bytes (int8 activations)

// With int8 activations a 32-value block's weights are read as unsigned bytes u in [0, 2^U_BITS): w = (u + center)
// d, or u d + m, so that a block's product is d_w d_x sum(u q) + offset_w d_x sum(q) (q the activations' int8
// values, offset_w = center d or m). PB blocks' bytes make one byte vector (two with AVX-512: 64 bytes, one
// dpbusd), the int32 sums of a block's values lie in LPB consecutive lanes of a vi.
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define NETRA_Q8_AVX512 1
constexpr int PB = 2;
#else
constexpr int PB = 1;
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
#define NETRA_Q8_AVX2 1
#endif
constexpr int LPB = VW / PB;       // int32 lanes per block
constexpr int BPL = 32 * PB / VW;  // bytes per int32 lane
typedef uint8_t vb __attribute__((vector_size(32 * PB)));

template <typename A, typename B>
inline A bits_as(const B& b) {
  static_assert(sizeof(A) == sizeof(B));
  A a;
  std::memcpy(&a, &b, sizeof(a));
  return a;
}

// The BPL bytes at p in every lane.
inline vb broadcast(const uint8_t* p) {
#if defined(NETRA_Q8_AVX512)
  return bits_as<vb>(_mm512_set1_epi32(static_cast<int>(u32(p))));
#elif defined(NETRA_Q8_AVX2)
  return bits_as<vb>(_mm256_set1_epi32(static_cast<int>(u32(p))));
#else
  vb u;
  for (int i = 0; i < static_cast<int>(sizeof(vb)); ++i) u[i] = p[i % BPL];
  return u;
#endif
}

// The 4-bit values of blocks whose 16 bytes qs hold value j in the low nibble of qs[j] and value j + 16 in the high
// one (Q4_0, Q4_1, and the low bits of Q5_0, Q5_1), from the blocks at qs0 (and qs1 with two blocks a vector).
inline vb nibbles(const uint8_t* qs0, const uint8_t* qs1) {
#if defined(NETRA_Q8_AVX512)
  // 128-bit lanes [qs0, qs0, qs1, qs1], the odd ones shifted down by 4
  const __m256i a = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs0)));
  const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs1)));
  __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
  v = _mm512_mask_srli_epi16(v, 0xFF00FF00u, v, 4);
  return bits_as<vb>(_mm512_and_si512(v, _mm512_set1_epi8(15)));
#elif defined(NETRA_Q8_AVX2)
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs0));
  return bits_as<vb>(_mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(15)));
#else
  vb u;
  for (int p = 0; p < PB; ++p) {
    const uint8_t* qs = p == 0 ? qs0 : qs1;
    for (int j = 0; j < 16; ++j) u[32 * p + j] = qs[j] & 15, u[32 * p + 16 + j] = qs[j] >> 4;
  }
  return u;
#endif
}

// u with bit 4 set in byte j of block p where bit j of h[p] is set (Q5 types' fifth bits).
inline vb with_fifth_bits(vb u, uint32_t h0, uint32_t h1) {
#if defined(NETRA_Q8_AVX512)
  const __mmask64 k = _cvtu64_mask64(h0 | static_cast<uint64_t>(h1) << 32);
  return bits_as<vb>(_mm512_or_si512(bits_as<__m512i>(u), _mm512_maskz_mov_epi8(k, _mm512_set1_epi8(16))));
#elif defined(NETRA_Q8_AVX2)
  // byte j gets byte j / 8 of h, keeps bit j % 8 of it, and becomes 16 where that bit is set
  const __m256i which = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                         3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(h0)), which);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
  return bits_as<vb>(_mm256_or_si256(bits_as<__m256i>(u), _mm256_and_si256(set, _mm256_set1_epi8(16))));
#else
  for (int p = 0; p < PB; ++p) {
    const uint32_t h = p == 0 ? h0 : h1;
    for (int j = 0; j < 32; ++j) u[32 * p + j] |= ((h >> j) & 1) << 4;
  }
  return u;
#endif
}

// The K-quants' sub-blocks i (and i + 1 with two a vector: i even then) of a 256-value block as bytes: chunk c =
// i / 2 of qs (32 bytes) holds sub-block 2c in its low nibbles and 2c + 1 in its high ones; FIVE (Q5_K) adds bit j of
// qh[l] as the fifth bit of value l of sub-block j.
template <bool FIVE>
inline vb k4_values(const uint8_t* qh, const uint8_t* qs, int i) {
#if defined(NETRA_Q8_AVX512)
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 16 * i));  // chunk i / 2
  const __m256i low = _mm256_set1_epi8(15);
  __m256i lo = _mm256_and_si256(q, low), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
  if constexpr (FIVE) {  // bit j of each qh byte, moved to bit 4 (16-bit shifts: a byte's bits 0 and 4 stay its own)
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh)), bit4 = _mm256_set1_epi8(16);
    const __m256i h_lo = _mm256_srl_epi16(h, _mm_cvtsi32_si128(i));
    const __m256i h_hi = _mm256_srl_epi16(h, _mm_cvtsi32_si128(i + 1));
    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(h_lo, 4), bit4));
    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(h_hi, 4), bit4));
  }
  return bits_as<vb>(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
#else
  vb u;
  const uint8_t* c = qs + 32 * (i / 2);
  for (int p = 0; p < PB; ++p) {
    const int j = i + p;  // the sub-block
    for (int l = 0; l < 32; ++l) {
      const int five = FIVE ? ((qh[l] >> j) & 1) << 4 : 0;
      u[32 * p + l] = static_cast<uint8_t>(((j & 1) ? c[l] >> 4 : c[l] & 15) | five);
    }
  }
  return u;
#endif
}

// Blocks i and i + 1 (the second: block i again past the step's nb blocks, where its weight in the scales is 0) of
// a step of 32-value blocks of BYTES bytes.
template <int BYTES>
inline std::pair<const uint8_t*, const uint8_t*> block_pair(const uint8_t* step, int i, int nb) {
  const uint8_t* b0 = step + i * BYTES;
  return {b0, i + 1 < nb ? b0 + BYTES : b0};
}

// Signed bytes (Q8_0's qs) as unsigned ones, u = q + 128.
inline vb biased_bytes(const uint8_t* q0, const uint8_t* q1) {
#if defined(NETRA_Q8_AVX512)
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q0));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q1));
  const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
  return bits_as<vb>(_mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80))));
#else
  vb u;
  std::memcpy(&u, q0, 32);
  return u ^ static_cast<uint8_t>(0x80);
#endif
}

// acc + lane sums of u * q (u unsigned bytes below 2^U_BITS, q the int8 activations at q, as many bytes): lane l
// sums the BPL bytes from BPL l, so that with PB blocks of weights lanes [LPB p, LPB (p + 1)) sum block p's products.
// Exact in int32 (at most 32 * 255 * 127 a block).
template <int U_BITS>
inline vi dot(vb u, const int8_t* q, vi acc = vi{}) {
#if defined(NETRA_Q8_AVX512)
  const __m512i a = bits_as<__m512i>(u), b = _mm512_loadu_si512(q);
#if defined(__AVX512VNNI__)
  return bits_as<vi>(_mm512_dpbusd_epi32(bits_as<__m512i>(acc), a, b));
#else
  // maddubs saturates its pair sums at 2^15: below 2^7 u is safe; full bytes as (u - 128) q + 128 q, signs moved
  // onto q (|u - 128| <= 128, |q| <= 127)
  const __m512i ones = _mm512_set1_epi16(1);
  if constexpr (U_BITS <= 7) return acc + bits_as<vi>(_mm512_madd_epi16(_mm512_maddubs_epi16(a, b), ones));
  const __m512i w = _mm512_xor_si512(a, _mm512_set1_epi8(static_cast<char>(0x80)));
  const __m512i bs = _mm512_mask_sub_epi8(b, _mm512_movepi8_mask(w), _mm512_setzero_si512(), b);
  const __m512i wq = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), bs), ones);
  const __m512i cq = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_set1_epi8(static_cast<char>(0x80)), b), ones);
  return acc + bits_as<vi>(_mm512_add_epi32(wq, cq));
#endif
#elif defined(NETRA_Q8_AVX2)
  const __m256i a = bits_as<__m256i>(u), b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
#if defined(__AVXVNNI__)
  return bits_as<vi>(_mm256_dpbusd_avx_epi32(bits_as<__m256i>(acc), a, b));
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (U_BITS <= 7) return acc + bits_as<vi>(_mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones));
  const __m256i w = _mm256_xor_si256(a, _mm256_set1_epi8(static_cast<char>(0x80)));
  const __m256i wq = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(b, w)), ones);
  const __m256i cq = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(static_cast<char>(0x80)), b), ones);
  return acc + bits_as<vi>(_mm256_add_epi32(wq, cq));
#endif
#else
  for (int l = 0; l < VW; ++l) {
    for (int j = l * BPL; j < (l + 1) * BPL; ++j) acc[l] += static_cast<int32_t>(u[j]) * q[j];
  }
  return acc;
#endif
}

typedef float v8 __attribute__((vector_size(8 * sizeof(float))));  // one step's 8 blocks, a float each

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Lanes [c[i] x LPB, c[i + 1] x LPB, ...]: the per-block floats of blocks i, i + 1, ... (i + PB <= 8) spread over
// their lanes, from a register (read from memory just after their store, c + i would straddle two stores, and a
// load that does waits for both to retire instead of having their data forwarded).
inline vf per_block(v8 c, int i) {
#if defined(NETRA_Q8_AVX512)
  const __m512i which = _mm512_add_epi32(_mm512_set1_epi32(i), _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1,
                                                                                 1, 1, 1, 1, 1));
  return bits_as<vf>(_mm512_permutexvar_ps(which, _mm512_castps256_ps512(bits_as<__m256>(c))));
#else
  vf r;
  for (int l = 0; l < VW; ++l) r[l] = c[i + l / LPB];
  return r;
#endif
}

struct Q4_0 {  // half d; qs[16]: y[j] = (lo(qs[j]) - 8) d, y[j + 16] = (hi(qs[j]) - 8) d
  static constexpr int QK = 32, BYTES = 18, GROUP = 8, STEP_BYTES = 8 * BYTES;
  static constexpr int QS_AT = 2, QH_AT = -1, M_AT = -1, CENTER = 8;  // byte offsets of the fields (-1: none)
  static void scales(const uint8_t* b, int nb, float* s) { scales_32<BYTES>(b, nb, s, M_AT >= 0, -CENTER); }
  static constexpr int U_BITS = 4;  // int8 activations: u the nibbles, offset -8 d (the scales' second half)
  static void qscales(const uint8_t* b, int nb, float* s) { scales(b, nb, s); }
  static vb values(const uint8_t* step, int i, int nb) {
    const auto [b0, b1] = block_pair<BYTES>(step, i, nb);
    return nibbles(b0 + QS_AT, b1 + QS_AT);
  }
  template <typename E>
  static void block(const uint8_t* b, const float* s, E&& emit) {
    const vf d = splat(s), o = splat(s + 8);
    for (int i = 0; i < 16; i += VW) {
      const vi q = widen_u8(b + 2 + i);
      emit(i, affine(q & 15, d, o));
      emit(16 + i, affine(q >> 4, d, o));
    }
  }
};

struct Q4_1 {  // half d, m; qs[16]: lo(qs[j]) d + m, hi(qs[j]) d + m
  static constexpr int QK = 32, BYTES = 20, GROUP = 8, STEP_BYTES = 8 * BYTES;
  static constexpr int QS_AT = 4, QH_AT = -1, M_AT = 2, CENTER = 0;
  static void scales(const uint8_t* b, int nb, float* s) { scales_32<BYTES>(b, nb, s, M_AT >= 0, -CENTER); }
  static constexpr int U_BITS = 4;  // offset m
  static void qscales(const uint8_t* b, int nb, float* s) { scales(b, nb, s); }
  static vb values(const uint8_t* step, int i, int nb) {
    const auto [b0, b1] = block_pair<BYTES>(step, i, nb);
    return nibbles(b0 + QS_AT, b1 + QS_AT);
  }
  template <typename E>
  static void block(const uint8_t* b, const float* s, E&& emit) {
    const vf d = splat(s), m = splat(s + 8);
    for (int i = 0; i < 16; i += VW) {
      const vi q = widen_u8(b + 4 + i);
      emit(i, affine(q & 15, d, m));
      emit(16 + i, affine(q >> 4, d, m));
    }
  }
};

struct Q5_0 {  // half d; qh[4] (h, 32 bits); qs[16]: ((nibble | fifth bit << 4) - 16) d, y[j]'s fifth bit h bit j
  static constexpr int QK = 32, BYTES = 22, GROUP = 8, STEP_BYTES = 8 * BYTES;
  static constexpr int QS_AT = 6, QH_AT = 2, M_AT = -1, CENTER = 16;
  static void scales(const uint8_t* b, int nb, float* s) { scales_32<BYTES>(b, nb, s, M_AT >= 0, -CENTER); }
  static constexpr int U_BITS = 5;  // offset -16 d
  static void qscales(const uint8_t* b, int nb, float* s) { scales(b, nb, s); }
  static vb values(const uint8_t* step, int i, int nb) {
    const auto [b0, b1] = block_pair<BYTES>(step, i, nb);
    return with_fifth_bits(nibbles(b0 + QS_AT, b1 + QS_AT), u32(b0 + QH_AT), u32(b1 + QH_AT));
  }
  template <typename E>
  static void block(const uint8_t* b, const float* s, E&& emit) {
    const vf d = splat(s), o = splat(s + 8);
    const uint32_t h = u32(b + 2);
    for (int i = 0; i < 16; i += VW) {
      const vi q = widen_u8(b + 6 + i);
      emit(i, affine(with_bit4(q & 15, h >> i), d, o));
      emit(16 + i, affine(with_bit4(q >> 4, h >> (16 + i)), d, o));
    }
  }
};

struct Q5_1 {  // half d, m; qh[4]; qs[16]: q d + m
  static constexpr int QK = 32, BYTES = 24, GROUP = 8, STEP_BYTES = 8 * BYTES;
  static constexpr int QS_AT = 8, QH_AT = 4, M_AT = 2, CENTER = 0;
  static void scales(const uint8_t* b, int nb, float* s) { scales_32<BYTES>(b, nb, s, M_AT >= 0, -CENTER); }
  static constexpr int U_BITS = 5;  // offset m
  static void qscales(const uint8_t* b, int nb, float* s) { scales(b, nb, s); }
  static vb values(const uint8_t* step, int i, int nb) {
    const auto [b0, b1] = block_pair<BYTES>(step, i, nb);
    return with_fifth_bits(nibbles(b0 + QS_AT, b1 + QS_AT), u32(b0 + QH_AT), u32(b1 + QH_AT));
  }
  template <typename E>
  static void block(const uint8_t* b, const float* s, E&& emit) {
    const vf d = splat(s), m = splat(s + 8);
    const uint32_t h = u32(b + 4);
    for (int i = 0; i < 16; i += VW) {
      const vi q = widen_u8(b + 8 + i);
      emit(i, affine(with_bit4(q & 15, h >> i), d, m));
      emit(16 + i, affine(with_bit4(q >> 4, h >> (16 + i)), d, m));
    }
  }
};

struct Q8_0 {  // half d; int8 qs[32]: qs[j] d
  static constexpr int QK = 32, BYTES = 34, GROUP = 8, STEP_BYTES = 8 * BYTES;
  static void scales(const uint8_t* b, int nb, float* s) { block_halves<BYTES, 0>(b, nb, s); }
  static constexpr int U_BITS = 8;  // u = qs + 128, offset -128 d
  static constexpr int QS_AT = 2, QH_AT = -1, M_AT = -1, CENTER = 128;
  static void qscales(const uint8_t* b, int nb, float* s) { scales_32<BYTES>(b, nb, s, M_AT >= 0, -CENTER); }
  static vb values(const uint8_t* step, int i, int nb) {
    const auto [b0, b1] = block_pair<BYTES>(step, i, nb);
    return biased_bytes(b0 + QS_AT, b1 + QS_AT);
  }
  template <typename E>
  static void block(const uint8_t* b, const float* s, E&& emit) {
    const vf d = splat(s);
    for (int i = 0; i < 32; i += VW) emit(i, __builtin_convertvector(widen_i8(b + 2 + i), vf) * d);
  }
};

// A K-quant block's 16 small integers as int32: Q4_K / Q5_K's 8 scales then 8 mins, Q6_K's 16 scales.
#if defined(__AVX512F__)
using Ints16 = vi;
#else
struct Ints16 {
  int32_t v[16];
  int32_t operator[](int i) const { return v[i]; }
};
#endif

// Q4_K / Q5_K's 6-bit scales sc_j and mins m_j of the 8 sub-blocks j, packed in the 12 bytes from b + 4:
// sc_j = q[j] & 63, sc_4+j = (q[j + 8] & 15) | (q[j] >> 6) << 4, m_j = q[j + 4] & 63,
// m_4+j = (q[j + 8] >> 4) | (q[j + 4] >> 6) << 4 (q = b + 4)
inline Ints16 k4_ints(const uint8_t* b) {
#if defined(__AVX512F__)
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4)));  // 12-15 unused
  const __m512i lo = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11), q);
  const __m512i hi = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7), q);
  const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4);
  const __m512i low_mask = _mm512_setr_epi32(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15);
  const __m512i high_mask = _mm512_setr_epi32(0, 0, 0, 0, 48, 48, 48, 48, 0, 0, 0, 0, 48, 48, 48, 48);
  return bits_as<vi>(_mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi32(lo, shift), low_mask),
                                     _mm512_and_si512(_mm512_srli_epi32(hi, 2), high_mask)));
#else
  const uint8_t* q = b + 4;
  Ints16 v;
  for (int j = 0; j < 4; ++j) {
    v.v[j] = q[j] & 63;
    v.v[8 + j] = q[j + 4] & 63;
    v.v[4 + j] = (q[j + 8] & 15) | ((q[j] >> 6) << 4);
    v.v[12 + j] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
  }
  return v;
#endif
}

// Q4_K / Q5_K: s[j] = d * sc_j, s[8 + j] = -dmin * m_j for the 8 sub-blocks j.
inline void scales_k4(const uint8_t* b, float* s) {
  const Ints16 v = k4_ints(b);
#if defined(__AVX512F__) && defined(__F16C__)
  // [d x 8, -dmin x 8]
  const __m128 d_dmin = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(u32(b))));
  const __m512 scale = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                             _mm512_castps128_ps512(d_dmin));
  const __m512 sign = _mm512_setr_ps(1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1);
  _mm512_storeu_ps(s, _mm512_mul_ps(_mm512_cvtepi32_ps(bits_as<__m512i>(v)), _mm512_mul_ps(scale, sign)));
#else
  const float d = half(b), dmin = -half(b + 2);
  for (int i = 0; i < 16; ++i) s[i] = static_cast<float>(v[i]) * (i < 8 ? d : dmin);
#endif
}

// Q4_K / Q5_K's 256 values: chunk c (64 values) is sub-blocks 2c (the low nibbles of qs[32c, 32c + 32)) and 2c + 1
// (the high nibbles), each d * sc * q - dmin * m; FIVE adds bits 2c and 2c + 1 of qh[l] as the fifth bits.
template <bool FIVE, typename E>
inline void block_k4(const uint8_t* qh, const uint8_t* qs, const float* s, E&& emit) {
  for (int c = 0; c < 4; ++c) {
    const vf d1 = splat(s + 2 * c), o1 = splat(s + 8 + 2 * c);
    const vf d2 = splat(s + 2 * c + 1), o2 = splat(s + 9 + 2 * c);
    for (int l = 0; l < 32; l += VW) {
      const vi q = widen_u8(qs + 32 * c + l);
      vi lo = q & 15, hi = q >> 4;
      if constexpr (FIVE) {
        const HighBits h(qh + l);
        lo = h.add(lo, 2 * c);
        hi = h.add(hi, 2 * c + 1);
      }
      emit(64 * c + l, affine(lo, d1, o1));
      emit(64 * c + 32 + l, affine(hi, d2, o2));
    }
  }
}

// With two blocks a byte vector (AVX-512) the int8 path reads a Q4_K block's 8 sub-blocks in the order K4_ORDER: the
// low nibbles of qs[0, 64) are sub-blocks 0 and 2 side by side, its high nibbles 1 and 3, and likewise in qs[64, 128),
// so that a pair of sub-blocks is one load and one or two byte ops (four loads, shifts and inserts in the natural
// order). The activations' blocks (quantize_rows) and the scales (qscales) are put in the same order.
constexpr int K4_ORDER[8] = {0, 2, 1, 3, 4, 6, 5, 7};  // its own inverse

// Whole blocks with int8 activations (the K-quants, see q8_tile): the values' int32 dot products are multiplied by
// their sub-block's integer scale lane by lane and summed over the block, exactly; then one conversion to float.

// s[index[l]] in lane l
inline vi lanes_of(const Ints16& s, vi index) {
#if defined(__AVX512F__)
  return bits_as<vi>(_mm512_permutexvar_epi32(bits_as<__m512i>(index), bits_as<__m512i>(s)));
#else
  vi r;
  for (int l = 0; l < VW; ++l) r[l] = s[index[l]];
  return r;
#endif
}

// acc + dots * scales lane by lane, for dot products and scales that fit in int16 (a lane of dpbusd sums 4 products
// of at most 32 x 127; the scales 6 or 8 bits): with AVX-512 one multiply-add of the lanes' low halves (VNNI
// vpdpwssd; negative scales' high halves zeroed).
template <bool SIGNED>
inline vi scaled_sum(vi acc, vi dots, vi scales) {
#if defined(NETRA_Q8_AVX512)
  __m512i s = bits_as<__m512i>(scales);
  if constexpr (SIGNED) s = _mm512_and_si512(s, _mm512_set1_epi32(0xFFFF));
#if defined(__AVX512VNNI__)
  return bits_as<vi>(_mm512_dpwssd_epi32(bits_as<__m512i>(acc), bits_as<__m512i>(dots), s));
#else
  return acc + bits_as<vi>(_mm512_madd_epi16(bits_as<__m512i>(dots), s));
#endif
#else
  return acc + dots * scales;
#endif
}

// Q4_K / Q5_K: the scales sc_j of the sub-blocks i, i + 1, ... (ORDERED: in K4_ORDER) over their dot products' lanes
template <bool ORDERED>
inline vi k4_lane_scales(const Ints16& s, int i) {
  vi index;
  for (int l = 0; l < VW; ++l) index[l] = ORDERED ? K4_ORDER[i + l / LPB] : i + l / LPB;
  return lanes_of(s, index);
}

// Q4_K / Q5_K: -dmin m_j of the 8 sub-blocks (ORDERED: in K4_ORDER, as x's blocks)
template <bool ORDERED>
inline v8 k4_mins(const uint8_t* b, const Ints16& s) {
  const float dmin = -half(b + 2);
#if defined(__AVX512F__)
  vi index = {};  // the mins in the low 8 lanes
  for (int j = 0; j < 8; ++j) index[j] = 8 + (ORDERED ? K4_ORDER[j] : j);
  const __m256i m = _mm512_castsi512_si256(bits_as<__m512i>(lanes_of(s, index)));
  return bits_as<v8>(_mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(dmin)));
#else
  v8 m;
  for (int j = 0; j < 8; ++j) m[j] = static_cast<float>(s[8 + (ORDERED ? K4_ORDER[j] : j)]) * dmin;
  return m;
#endif
}

struct Q4_K {  // half d, dmin; scales[12]; qs[128]
  static constexpr int QK = 256, BYTES = 144, GROUP = 1, STEP_BYTES = BYTES;
  static void scales(const uint8_t* b, int, float* s) { scales_k4(b, s); }
  // int8 activations: a block is a step of 8 sub-blocks of 32, u the nibbles, offset -dmin m_j
  static constexpr int U_BITS = 4;
  static constexpr bool REORDERED = PB == 2;  // sub-blocks in K4_ORDER
  static void qscales(const uint8_t* b, int nb, float* s) {
    scales(b, nb, s);
#if defined(NETRA_Q8_AVX512)
    const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
    _mm512_storeu_ps(s, _mm512_permutexvar_ps(order, _mm512_loadu_ps(s)));
#endif
  }
  static Ints16 ints(const uint8_t* b) { return k4_ints(b); }
  static float d(const uint8_t* b) { return half(b); }
  static vi lane_scales(const Ints16& s, int i) { return k4_lane_scales<REORDERED>(s, i); }
  static v8 mins(const uint8_t* b, const Ints16& s) { return k4_mins<REORDERED>(b, s); }
  static vb values(const uint8_t* step, int i, int) {
#if defined(NETRA_Q8_AVX512)
    const __m512i a = _mm512_loadu_si512(step + 16 + 64 * (i / 4));  // sub-blocks K4_ORDER[i], K4_ORDER[i + 1]
    return bits_as<vb>(_mm512_and_si512(i & 2 ? _mm512_srli_epi16(a, 4) : a, _mm512_set1_epi8(15)));
#else
    return k4_values<false>(nullptr, step + 16, i);
#endif
  }
  template <typename E>
  static void block(const uint8_t* b, const float* s, E&& emit) {
    block_k4<false>(nullptr, b + 16, s, emit);
  }
};

struct Q5_K {  // half d, dmin; scales[12]; qh[32]; qs[128]
  static constexpr int QK = 256, BYTES = 176, GROUP = 1, STEP_BYTES = BYTES;
  static void scales(const uint8_t* b, int, float* s) { scales_k4(b, s); }
  static constexpr int U_BITS = 5;  // as Q4_K, the fifth bits from qh
  static void qscales(const uint8_t* b, int nb, float* s) { scales(b, nb, s); }
  static Ints16 ints(const uint8_t* b) { return k4_ints(b); }
  static float d(const uint8_t* b) { return half(b); }
  static vi lane_scales(const Ints16& s, int i) { return k4_lane_scales<false>(s, i); }
  static v8 mins(const uint8_t* b, const Ints16& s) { return k4_mins<false>(b, s); }
  static vb values(const uint8_t* step, int i, int) { return k4_values<true>(step + 16, step + 48, i); }
  template <typename E>
  static void block(const uint8_t* b, const float* s, E&& emit) {
    block_k4<true>(b + 16, b + 48, s, emit);
  }
};

struct Q6_K {  // ql[128]; qh[64]; int8 scales[16]; half d. Two halves of 128 values, 16 values per scale.
  static constexpr int QK = 256, BYTES = 210, GROUP = 1, STEP_BYTES = BYTES;
  // int8 activations: a block is a step of 8 blocks of 32, u the 6-bit values; the centering (-32) starts each dot
  // product (Q8Rows::c32) and the 16-value scales multiply its int32 lanes (lane_scales), d_w = d for every block
  static constexpr int U_BITS = 6;
  static void qscales(const uint8_t* b, int, float* s) {
    const float d = half(b + 208);
    for (int i = 0; i < 8; ++i) s[i] = d, s[8 + i] = 0.0f;
  }
  // Blocks i and i + 1 (i even) of the 256 values as bytes: value 128 h + 32 k + l (block 4 h + k) is the low
  // (k < 2) or high nibble of ql[64 h + 32 (k & 1) + l] with bits 2k, 2k + 1 of qh[32 h + l] above it.
  static vb values(const uint8_t* step, int i, int) {
#if defined(NETRA_Q8_AVX512)
    const int h = i / 4, k = i % 4;  // k: 0 or 2, the pair's blocks share their ql bytes' nibble and qh bytes
    const __m512i a = _mm512_loadu_si512(step + 64 * h), low4 = _mm512_set1_epi8(15);
    const __m512i lo = _mm512_and_si512(k == 0 ? a : _mm512_srli_epi16(a, 4), low4);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step + 128 + 32 * h));
    const __m256i h0 = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k));
    const __m256i h1 = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k + 2));
    const __m512i hi = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1), _mm512_set1_epi8(3));
    return bits_as<vb>(_mm512_or_si512(lo, _mm512_slli_epi16(hi, 4)));
#elif defined(NETRA_Q8_AVX2)
    const int h = i / 4, k = i % 4;
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step + 64 * h + 32 * (k & 1)));
    const __m256i low4 = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(k < 2 ? a : _mm256_srli_epi16(a, 4), low4);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step + 128 + 32 * h));
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k)), _mm256_set1_epi8(3));
    return bits_as<vb>(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)));
#else
    vb u;
    for (int p = 0; p < PB; ++p) {
      const int j = i + p, h = j / 4, k = j % 4;
      const uint8_t* ql = step + 64 * h + 32 * (k & 1);
      const uint8_t* qh = step + 128 + 32 * h;
      for (int l = 0; l < 32; ++l) {
        u[32 * p + l] = static_cast<uint8_t>((k < 2 ? ql[l] & 15 : ql[l] >> 4) | (((qh[l] >> (2 * k)) & 3) << 4));
      }
    }
    return u;
#endif
  }
  // The int8 scale of values [16 j, 16 j + 16)
  static int32_t sub_scale(const uint8_t* step, int j) { return static_cast<int8_t>(step[192 + j]); }
  // The 16 int8 scales, and the block's d
  static Ints16 ints(const uint8_t* b) {
#if defined(__AVX512F__)
    return bits_as<vi>(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))));
#else
    Ints16 s;
    for (int j = 0; j < 16; ++j) s.v[j] = sub_scale(b, j);
    return s;
#endif
  }
  static float d(const uint8_t* b) { return half(b + 208); }
  // The scales of blocks i, i + 1, ... over the dot products' lanes: lane l sums values 32 i + BPL l onwards, scale
  // (32 i + BPL l) / 16
  static vi lane_scales(const Ints16& s, int i) {
    vi index;
    for (int l = 0; l < VW; ++l) index[l] = 2 * i + l * BPL / 16;
    return lanes_of(s, index);
  }
  // s[i] = d * scales[i], s[16 + i] = -32 s[i]
  static void scales(const uint8_t* b, int, float* s) {
    const float d = half(b + 208);
    for (int i = 0; i < 16; i += VW) {
      const vf v = __builtin_convertvector(widen_i8(b + 192 + i), vf) * d;
      store(s + i, v);
      store(s + 16 + i, v * -32.0f);
    }
  }
  template <typename E>
  static void block(const uint8_t* b, const float* s, E&& emit) {
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = b + 64 * h;
      const uint8_t* qh = b + 128 + 32 * h;
      for (int l = 0; l < 32; l += VW) {  // VW divides 16: one scale per vector
        const float* sc = s + 8 * h + l / 16;
        const vi a = widen_u8(ql + l), c = widen_u8(ql + 32 + l), hb = widen_u8(qh + l);
        // 6-bit values: nibble | two bits of qh[l] << 4 (bits 0-1, 2-3, 4-5, 6-7), centered by -32
        emit(128 * h + l, affine((a & 15) | ((hb << 4) & 48), splat(sc), splat(sc + 16)));
        emit(128 * h + 32 + l, affine((c & 15) | ((hb << 2) & 48), splat(sc + 2), splat(sc + 18)));
        emit(128 * h + 64 + l, affine((a >> 4) | (hb & 48), splat(sc + 4), splat(sc + 20)));
        emit(128 * h + 96 + l, affine((c >> 4) | ((hb >> 2) & 48), splat(sc + 6), splat(sc + 22)));
      }
    }
  }
};

// Q4_K with its weight rows interleaved by 16 (this runtime's layout, not a GGUF type; made at load from Q4_K rows by
// netra_jax/ops/ggml_blocks.py `interleave_rows`): the same bytes, 16 consecutive rows' blocks b side by side so that
// one vector holds a piece of every row. Group g (rows 16 g .. 16 g + 15) is nb = K / 256 blocks of 2304 bytes:
//   [0, 32) the 16 rows' d, [32, 64) their dmin (halves, row order);
//   [64, 256) their 12 packed scale bytes, byte i of row r at 64 + 16 i + r;
//   [256, 2304) the values: for sub-block j, half h, pair p (64 bytes at 256 + 64 (4 j + 2 h + p)), int32 lane r holds
//   row r's values 32 j + 16 h + 8 p + t (t < 4) in the low nibbles of its 4 bytes, and values + 4 in the high ones.
// With int8 activations (ggml_interleaved.h) a dot product multiplies 4 values of each of the 16 rows by the same 4
// bytes of x (broadcast): no shuffles, the scales of 16 rows unpacked together, one vector of results per group.
struct Q4_KX16 {
  static constexpr int QK = 256, BYTES = 144, GROUP = 1, STEP_BYTES = BYTES, U_BITS = 4;
  static constexpr int ROWS = 16, GROUP_BYTES = ROWS * BYTES;
  static constexpr int D_AT = 0, DMIN_AT = 32, SCALES_AT = 64, VALUES_AT = 256;
};

// Q6_K interleaved by 16 the same way (Q6_K_X16, `interleave_rows` too): per group of 16 rows and block, 3360 bytes:
//   [0, 32) the 16 rows' d (halves);
//   [32, 288) their int8 scales, scale s (values 16 s .. 16 s + 15) of row r at 32 + 16 s + r;
//   [288, 3360) the values, 192 bytes per sub-block s (16 values) in order (one stream for the prefetchers): for pair
//   p, 64 bytes at 288 + 192 s + 64 p whose lane r holds the low 4 bits of row r's values 16 s + 8 p + t (t < 4) in
//   its low nibbles and of values + 4 in its high ones; then 64 bytes whose lane r byte t holds the high 2 bits of
//   row r's values 16 s + 4 f + t at bits 2 f (f < 4).
struct Q6_KX16 {
  static constexpr int QK = 256, BYTES = 210, GROUP = 1, STEP_BYTES = BYTES, U_BITS = 6;
  static constexpr int ROWS = 16, GROUP_BYTES = ROWS * BYTES;
  static constexpr int D_AT = 0, SCALES_AT = 32, VALUES_AT = 288, SUB_BYTES = 192;
};

constexpr int SCALES = 32;  // floats of a step's scales, any format

// Types whose int8 path scales 16-value halves of a block (Q6_K): lane_scales and a centered starting value
template <typename T>
constexpr bool SUB16 = std::is_same_v<T, Q6_K>;

// Types whose int8 activations have one d per 256 values (llama.cpp's Q8_K), their few-row products summed over a
// whole block in int32 (q8_tile)
template <typename T>
constexpr bool INT_BLOCKS = T::QK == 256;

// Types whose int8 path reads a step's blocks in K4_ORDER
// Types whose weight rows are interleaved (Q4_KX16, Q6_KX16): their own kernels for any number of rows of x
template <typename T>
constexpr bool INTERLEAVED = std::is_same_v<T, Q4_KX16> || std::is_same_v<T, Q6_KX16>;

template <typename T>
constexpr bool IN_K4_ORDER = false;
template <>
constexpr bool IN_K4_ORDER<Q4_K> = Q4_K::REORDERED;

}  // namespace netra::ggml
