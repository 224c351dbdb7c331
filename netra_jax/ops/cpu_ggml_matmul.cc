// Matmuls of few rows (and prefill chunks) against weights kept in llama.cpp's GGML block formats, XLA FFI handler
// for CPU:
// y[M, N] = x[M, K] @ W^T with float32 x and y, and W [N, K] given as the raw bytes of a GGUF tensor of ne [K, N]:
// w uint8 [N, row_bytes], row n holding K / QK consecutive blocks (row_bytes = K / QK * BLOCK_BYTES). Types (the
// `qtype` attribute, GGML's type numbers): Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14; block
// layouts as in ggml-common.h (fp16 fields little-endian IEEE half), gguf.quants' de-quantization their reference.
// Built with the other CPU kernels (netra_jax/ops/cpu_kernels.py) for the host's CPU.
//
// Why: a decode step streams every weight matrix through the cores once for a few rows, so its time is the weights'
// bytes over the memory bandwidth. Kept in their 4.5-8.5 bits per weight, the weights are 4-7x fewer bytes than
// float32; each block is de-quantized in registers where it is used, never written out whole.
//
// - De-quantizing: a block's bytes are widened to int32 lanes (one instruction per vector), nibbles and high bits
//   put together with integer vector ops (AVX-512: the fifth bits of Q5 types as lane masks), converted to float and
//   scaled with one FMA per vector: q * d + offset, offset the block's (or sub-block's) min, or -8 d, -16 d, -32 d
//   for the centered types (exact: the FMA rounds once, like the reference's (q - 8) * d).
// - Scales: those of a step (256 values: 8 blocks of 32, or one K-quant block) are converted together into a small
//   float array (a gather of the fp16 fields and one vector conversion; the K-quants' packed 6-bit scales and mins
//   unpacked as one vector), which each vector then broadcasts from memory: a broadcast load where converting and
//   broadcasting per block took 3-4 instructions on the shuffle port, the de-quantization's bottleneck.
// - The weight rows are split into chunks of whole row tiles, claimed from an atomic counter by the calling thread
//   and XLA's intra-op pool (a helper starting late finds less or nothing left). Software prefetch runs ahead of the
//   de-quantization (a core's misses in flight bound its share of the bandwidth).
// - One row of x: the chunk's weight rows are one sequential stream of steps; a step's vectors are de-quantized
//   into registers and go straight into 4 accumulators with x from cache (summed at each row's end); the next
//   step's scales are converted before this step's blocks, so that their latency overlaps.
// - More rows: a tile of TN weight rows walks K step by step; the step is de-quantized into an L1 buffer [TN, 256]
//   once, then register tiles of up to TM rows of x take its products (TM x vectors and one weight vector in
//   registers next to TM x TN accumulators). With one register tile (M <= TM) the accumulators stay in registers
//   over the whole K; with more, each tile's accumulators are kept between steps in a small buffer of partial
//   vectors, and x is read from a copy laid out step by step. Lanes are summed once at the end. The next tile's
//   bytes are prefetched over the current tile's steps.
// - int8 activations (attribute int8_x = 1, the engine's default; the 32-value types, Q4_K / Q5_K as steps of 8 sub-
//   blocks of 32 with their own scales and mins, Q6_K as steps of 8 blocks of 32 whose 16-value int8 scales multiply
//   the dot products' int32 lanes): x's rows are quantized once per call to blocks of 32 int8 values and a scale (d =
//   max|x| / 127 over the 32 values, as llama.cpp's Q8_0 blocks; over the 256 of a block against the K-quants, as its
//   Q8_K), a weight block's values are read as unsigned bytes (nibbles, fifth bits added, 6-bit values, or Q8_0's bytes
//   + 128) and multiplied with integer dot products (AVX-512 VNNI dpbusd on two blocks a vector; AVX-VNNI, maddubs or
//   scalar in the other builds); a block's int32 sums become float once, times d_w d_x, and the blocks' offsets (-8 d,
//   the min m, ...) times d_x sum(q) are summed apart. Up to 4 rows of x (16 against Q6_K: FEW_ROWS): each weight row
//   is read once for tiles of up to 4 rows, two blocks a dpbusd (with AVX-512 VBMI, the 4- and 5-bit types in groups of
//   4 blocks put in place by byte permutes, their scales repeated over their lanes by another: see "groups of blocks"
//   below; the K-quants' dot products times their sub-blocks' integer scales summed over the whole block in int32, one
//   conversion a block where the float scales of each pair of sub-blocks took three instructions and a stored-and-
//   reloaded scale array: 1.5x the Q4_K rows a second).
//   More rows (and prefill chunks past the float path's 128): the rows of x in the lanes, a tile of 8 weight rows
//   unpacked into bytes and scales once, then every 4 bytes of a weight row broadcast against 16 rows' 4 bytes per
//   dpbusd (64 multiply-adds an instruction, a block's sums converted once per weight row and group of rows).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int VW = 16;  // floats per vector register
constexpr int TN = 6;   // weight rows per tile with several rows of x
constexpr int TM = 4;   // rows of x per register tile: TM x vectors, TM * TN accumulators and a weight (32 registers)
#elif defined(__AVX2__)
constexpr int VW = 8;
constexpr int TN = 6;  // 16 registers: 2 x vectors, 12 accumulators, a weight
constexpr int TM = 2;
#else
constexpr int VW = 4;
constexpr int TN = 6;
constexpr int TM = 2;
#endif
constexpr int64_t KS = 256;  // values per de-quantization step with several rows of x
constexpr int ROW_UNIT = 8;  // weight rows per chunk unit with one row of x
constexpr int LINE_BYTES = 64;
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

constexpr int SCALES = 32;  // floats of a step's scales, any format

// Types whose int8 path scales 16-value halves of a block (Q6_K): lane_scales and a centered starting value
template <typename T>
constexpr bool SUB16 = std::is_same_v<T, Q6_K>;

// Types whose int8 activations have one d per 256 values (llama.cpp's Q8_K), their few-row products summed over a
// whole block in int32 (q8_tile)
template <typename T>
constexpr bool INT_BLOCKS = T::QK == 256;

// Types whose int8 path reads a step's blocks in K4_ORDER
template <typename T>
constexpr bool IN_K4_ORDER = false;
template <>
constexpr bool IN_K4_ORDER<Q4_K> = Q4_K::REORDERED;

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
std::unique_ptr<vf[]> x_by_steps(const Problem& p) {
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

// ---------------------------------------------------------------- int8 activations

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
// nearest (|x - d q| <= d / 2); s[m, b] = d sum_j q[m, b, j]. Rows padded to bp blocks (a multiple of 8) with zero
// blocks.
// With more than FEW_ROWS rows, the same blocks also with the rows in the lanes: VW rows a group (the rows past M
// zero), group r's block b a run of 32 / BPL vectors, vector t holding bytes [BPL t, BPL (t + 1)) of each row's block.
struct Q8Rows {
  std::unique_ptr<int8_t[]> q;  // [M, bp, 32]
  std::unique_ptr<float[]> d;   // [M, bp]
  std::unique_ptr<float[]> s;   // [M, bp]
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
template <typename T>
constexpr int64_t FEW_ROWS = SUB16<T> ? 16 : Q8_TM;

void put_rows_in_lanes(Q8Rows& r, int64_t M) {
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

// y[:, n0:n1] with int8 activations: each weight row in turn, the rows of x in tiles of near-equal heights (at most
// Q8_TM); the weight row stays in L1 over the tiles.
template <typename T>
void q8_rows(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t tiles = (p.M + Q8_TM - 1) / Q8_TM, limit = n1 * p.row_bytes;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t m0 = t * p.M / tiles, rows = (t + 1) * p.M / tiles - m0;
      switch (rows) {
        case 1:
          q8_tile<T, 1>(p, n, m0, limit);
          break;
        case 2:
          q8_tile<T, 2>(p, n, m0, limit);
          break;
        case 3:
          q8_tile<T, 3>(p, n, m0, limit);
          break;
        case 4:
          q8_tile<T, 4>(p, n, m0, limit);
          break;
      }
    }
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

typedef void (*ChunkFn)(const Problem&, int64_t, int64_t);

template <typename T>
ChunkFn q8_fn(int64_t M) {
#if defined(NETRA_Q8_GROUPS)
  if constexpr (GROUPED<T>) return M <= FEW_ROWS<T> ? q8_groups<T> : q8_lanes<T>;
#endif
  if constexpr (T::U_BITS > 0) return M <= FEW_ROWS<T> ? q8_rows<T> : q8_lanes<T>;
  return nullptr;
}

template <typename T>
ChunkFn chunk_fn(int64_t M) {
  static_assert(TM <= 4 && KS % T::QK == 0);
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

struct Format {
  int32_t ggml_type;
  const char* name;
  int64_t qk, bytes;
  ChunkFn (*chunk)(int64_t M);
  ChunkFn (*q8)(int64_t M);  // int8 activations (null: the type has no such path)
  int64_t q8_few;            // rows the int8 path reads weight row by weight row (FEW_ROWS)
  Q8Rows (*quantize)(const float* x, int64_t M, int64_t K);  // x for the int8-activation path
};

template <typename T>
constexpr Format format(int32_t ggml_type, const char* name) {
  return {ggml_type, name, T::QK, T::BYTES, chunk_fn<T>, q8_fn<T>, FEW_ROWS<T>, quantize_rows<T>};
}

constexpr Format FORMATS[] = {
    format<Q4_0>(2, "Q4_0"), format<Q4_1>(3, "Q4_1"), format<Q5_0>(6, "Q5_0"), format<Q5_1>(7, "Q5_1"),
    format<Q8_0>(8, "Q8_0"), format<Q4_K>(12, "Q4_K"), format<Q5_K>(13, "Q5_K"), format<Q6_K>(14, "Q6_K"),
};

// Chunks of whole units of weight rows, claimed by the caller and the helpers. Each thread works from its own copy
// of the problem (the kernels read its fields in their loops); the counters, written by every thread, have cache
// lines of their own.
struct Work {
  Problem p;
  ChunkFn fn;
  int64_t units, unit, chunks;
  alignas(64) std::atomic<int64_t> next{0};
  alignas(64) std::atomic<int64_t> finished{0};

  void run() {
    const Problem mine = p;
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      const int64_t n0 = c * units / chunks * unit;
      const int64_t n1 = std::min(mine.N, (c + 1) * units / chunks * unit);
      fn(mine, n0, n1);
      finished.fetch_add(1, std::memory_order_release);
    }
  }
};

constexpr int64_t CHUNKS_PER_THREAD = 4;  // a helper that starts late leaves the others less to wait for

ffi::Error GgmlMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                      ffi::ResultBuffer<ffi::F32> y, int32_t qtype, int32_t int8_x) {
  const Format* f = nullptr;
  for (const Format& g : FORMATS) {
    if (g.ggml_type == qtype) f = &g;
  }
  if (f == nullptr) {
    return ffi::Error::InvalidArgument("netra_ggml_matmul_f32: GGML type " + std::to_string(qtype) +
                                       " is not one of Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12), "
                                       "Q5_K (13), Q6_K (14)");
  }
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  const std::string format = std::string(" (") + f->name + ": " + std::to_string(f->qk) + " values in " +
                             std::to_string(f->bytes) + " bytes per block)";
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2) {
    return ffi::Error::InvalidArgument("netra_ggml_matmul_f32 takes x [M, K], w [N, row_bytes], y [M, N]" + format);
  }
  if (wd[1] % f->bytes != 0 || wd[1] / f->bytes * f->qk != xd[1]) {
    return ffi::Error::InvalidArgument("netra_ggml_matmul_f32: w's rows of " + std::to_string(wd[1]) +
                                       " bytes are not K = " + std::to_string(xd[1]) + " values" + format);
  }
  if (yd[0] != xd[0] || yd[1] != wd[0]) {
    return ffi::Error::InvalidArgument("netra_ggml_matmul_f32: y is not [M, N] = [" + std::to_string(xd[0]) + ", " +
                                       std::to_string(wd[0]) + "]");
  }
  if (int8_x != 0 && f->q8(1) == nullptr) {
    return ffi::Error::InvalidArgument(std::string("netra_ggml_matmul_f32: ") + f->name +
                                       " has no int8-activation path (int8_x = 1)");
  }
  Problem p{x.typed_data(), w.typed_data(), y->typed_data(), xd[0], xd[1], wd[0], wd[1], nullptr, nullptr};
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  if (p.K == 0) {
    std::memset(p.y, 0, sizeof(float) * p.M * p.N);
    return ffi::Error::Success();
  }
  std::unique_ptr<vf[]> xs;
  Q8Rows q8;
  if (int8_x != 0) {
    q8 = f->quantize(p.x, p.M, p.K);
    p.q8 = &q8;
  } else {
    xs = x_by_steps(p);
    p.xs = reinterpret_cast<const float*>(xs.get());
  }
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  auto work = std::make_shared<Work>();
  work->p = p;
  work->fn = int8_x != 0 ? f->q8(p.M) : f->chunk(p.M);
  work->unit = int8_x != 0 ? (p.M <= f->q8_few ? ROW_UNIT : TNQ) : p.M == 1 ? ROW_UNIT : TN;
  work->units = (p.N + work->unit - 1) / work->unit;
  work->chunks = std::min(work->units, threads * CHUNKS_PER_THREAD);
  netra::run_on_pool(pool, work, std::min(threads, work->chunks) - 1, work->chunks);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(NetraGgmlMatmulF32, GgmlMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("qtype")
                                  .Attr<int32_t>("int8_x"));
