// llama.cpp's weight formats (GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4) as the CPU matmul reads them:
// each format's tile layout and the decoder that turns a tile back into weights, one input column
// (16 outputs' weights, one Lanes) at a time.
//
// A packed weight is a block of 16 outputs at a time (like pack_linear's fp32 blocks), each block a
// run of tiles, one per group of the format's inputs (32, or a 256-input super-block for the K types).
// A tile holds the 16 outputs' GGUF blocks for that group interleaved; the scales come first, as
// [field column][16 outputs] bytes, the quants after, as quads: [column / 4][16 outputs][column % 4],
// so one 64-byte load holds four adjacent columns of all 16 outputs, each output's four bytes one
// 32-bit lane. The fp32 path takes a column out of a quad (a shift and a mask per lane); the int8
// path multiplies a quad's four bytes by four 8-bit inputs per lane at once (`dot4`). The quants keep
// the bit order of the GGUF block (ggml_quants.py writes them; the byte offsets are listed per format
// below, in columns).
//
// Invariant: `column` produces the weights gguf.quants.dequantize produces, bit for bit. Every product
// of a scale and a quant is exact in fp32 (an fp16 scale has 11 significant bits; a 6-bit sub-scale
// and a 4- or 5-bit quant, or an 8-bit quant, add at most 11 more), so where the reference multiplies
// and then adds (rounding once, since the product is exact) a fused multiply-add rounds identically.
// Q6_K's second product (an 8-bit sub-scale, then a 6-bit quant) can round, and is rounded as the
// reference rounds it, as a separate multiply. MXFP4's products (a power of two times a value of
// at most 4 significant bits) are exact.
#pragma once

#include "cpu_kernels.h"

#include <c10/util/Half.h>

namespace radixserve {
namespace ggml {

// GGUF's type codes (gguf.GGMLQuantizationType), as a packed weight names each block's format
enum Format : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kMXFP4 = 39
};

inline Native to_native(NativeInt v) { return __builtin_convertvector(v, Native); }

// 16 bytes, one per output (a [column][16] scale field), widened to int32 lanes (sign-extended
// where Signed). Written with the CPU's widening loads: compilers lower __builtin_convertvector of a
// byte vector to one scalar insert per byte (10x slower here)
template <bool Signed>
inline void load_bytes(const uint8_t* from, NativeInt (&out)[kParts]) {
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from));
  out[0] = bits_as<NativeInt>(Signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
#elif defined(__AVX2__)
  for (int p = 0; p < kParts; ++p) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(from + p * 8));
    out[p] = bits_as<NativeInt>(Signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
  }
#else
  for (int p = 0; p < kParts; ++p) {
    for (int64_t i = 0; i < kNativeFloats; ++i) {
      const uint8_t byte = from[p * kNativeFloats + i];
      out[p][i] = Signed ? static_cast<int32_t>(static_cast<int8_t>(byte)) : static_cast<int32_t>(byte);
    }
  }
#endif
}

// Quad u of a quant field: 16 outputs' four bytes (columns 4u .. 4u + 3), one output per 32-bit lane
inline void load_quad(const uint8_t* field, int64_t u, NativeInt (&out)[kParts]) {
  // through a local: a memcpy straight into `out` is lowered as a copy in memory, which GCC tuned for
  // AMD Zen does in 16-byte halves that the 32-byte read after it must wait for (on Zen 3 the one-row
  // int8 tile took 5.6x its time)
  for (int p = 0; p < kParts; ++p) {
    NativeInt quads;
    std::memcpy(&quads, field + u * 64 + p * kNativeFloats * 4, sizeof quads);
    out[p] = quads;
  }
}

// Column j of a quant field, one byte per output widened to int32 lanes (sign-extended where Signed)
template <bool Signed>
inline void load_column(const uint8_t* field, int64_t j, NativeInt (&out)[kParts]) {
  load_quad(field, j / 4, out);
  const int up = static_cast<int>(24 - 8 * (j % 4));
  for (int p = 0; p < kParts; ++p) {
    out[p] = Signed ? (out[p] << up) >> 24 : bits_as<NativeInt>(bits_as<NativeBits>(out[p] << up) >> 24);
  }
}

// 16 fp16 values (exactly widened) from a block's bytes
inline Lanes halves(const uint8_t* from) { return load_lanes(reinterpret_cast<const c10::Half*>(from)); }

inline Lanes multiply(const Lanes& a, const Lanes& b) {
  Lanes out;
  for (int p = 0; p < kParts; ++p) out.part[p] = a.part[p] * b.part[p];
  return out;
}

inline Lanes negate(const Lanes& a) {
  Lanes out;
  for (int p = 0; p < kParts; ++p) out.part[p] = -a.part[p];
  return out;
}

// The fp32 path's quants of column j: the low or high nibbles of a quant field's column, and a fifth
// or sixth bit from another field's column (shifted right by `shift`, masked by `mask`, moved up by 4)
template <bool High>
inline void nibbles(const uint8_t* field, int64_t j, NativeInt (&out)[kParts]) {
  load_column<false>(field, j, out);
  for (int p = 0; p < kParts; ++p) out[p] = High ? out[p] >> 4 : out[p] & 15;
}

inline void add_high_bits(const uint8_t* field, int64_t j, int shift, int mask, NativeInt (&q)[kParts]) {
  NativeInt bits[kParts];
  load_column<false>(field, j, bits);
  for (int p = 0; p < kParts; ++p) q[p] |= ((bits[p] >> shift) & mask) << 4;
}

// The int8 path's quads: four unsigned quants per lane, one per byte. `quad_nibbles` takes the low
// or high nibble of each byte; `add_quad_high_bits` ORs in bits (byte >> shift) & mask, moved up by 4
constexpr int32_t kEveryByte = 0x01010101;

template <bool High>
inline void quad_nibbles(const uint8_t* field, int64_t u, NativeInt (&q)[kParts]) {
  load_quad(field, u, q);
  for (int p = 0; p < kParts; ++p) {
    q[p] = (High ? bits_as<NativeInt>(bits_as<NativeBits>(q[p]) >> 4) : q[p]) & (15 * kEveryByte);
  }
}

inline void add_quad_high_bits(const uint8_t* field, int64_t u, int shift, int mask, NativeInt (&q)[kParts]) {
  NativeInt bits[kParts];
  load_quad(field, u, bits);
  for (int p = 0; p < kParts; ++p) {
    q[p] |= (bits_as<NativeInt>(bits_as<NativeBits>(bits[p]) >> shift) & (mask * kEveryByte)) << 4;
  }
}

// Q4_0's, Q4_1's, Q5_0's and Q5_1's quants: column j (0..31) and quad u (0..7, inputs 4u .. 4u + 3) of a
// 16-column qs field holding inputs 0..15 in the low nibbles and 16..31 in the high ones
inline void split_nibbles(const uint8_t* qs, int64_t j, NativeInt (&q)[kParts]) {
  if (j < 16) nibbles<false>(qs, j, q); else nibbles<true>(qs, j - 16, q);
}

inline void split_nibble_quad(const uint8_t* qs, int64_t u, NativeInt (&q)[kParts]) {
  if (u < 4) quad_nibbles<false>(qs, u, q); else quad_nibbles<true>(qs, u - 4, q);
}

inline Lanes as_lanes(const NativeInt (&q)[kParts], int offset = 0) {
  Lanes v;
  for (int p = 0; p < kParts; ++p) v.part[p] = to_native(q[p] - offset);
  return v;
}

// 16 bytes, one per output, as fp32 lanes (sign-extended where Signed)
template <bool Signed>
inline Lanes byte_lanes(const uint8_t* from) {
  NativeInt ints[kParts];
  load_bytes<Signed>(from, ints);
  return as_lanes(ints);
}

// Each format decodes a tile a segment of 32 inputs at a time: `segment` reads the segment's scales
// (and where its quants lie). The fp32 path's `column` decodes its column j (0..31): the 16 outputs'
// weights of input group_start + 32 * s + j. The int8 path's `quad` gives inputs 4u .. 4u + 3's
// unsigned quants (u = 0..7) and the segment's weights are
//   w = scale(s, half) * (quant - kOffset) + minimum(s)
// with `half` the 16-input half for Q6_K's two sub-scales (kHalves = 2), else 0, and the minimum
// zero where kHasMinimum is false; a quant is at most kLargestQuant (without VNNI, `dot4` multiplies
// bytes into 16-bit sums, which quants above 128 would overflow). Kernels interleave several blocks'
// segments, so a format is plain data and inline functions, not a loop of its own.

// Q4_0: 32 inputs; d fp16[16] @0, qs[16 columns][16] @32 (column j: input j in the low nibble, j + 16
// in the high one). w = d * (q - 8)
struct Q4_0 {
  static constexpr int64_t kGroup = 32, kTileBytes = 32 + 256;
  static constexpr int kOffset = 8, kHalves = 1;
  static constexpr int kLargestQuant = 15;
  static constexpr bool kHasMinimum = false;
  struct Segment {
    Lanes d;
    const uint8_t* qs;
  };
  static Segment segment(const uint8_t* tile, int64_t) { return {halves(tile), tile + 32}; }
  static Lanes column(const Segment& s, int64_t j) {
    NativeInt q[kParts];
    split_nibbles(s.qs, j, q);
    return multiply(s.d, as_lanes(q, 8));
  }
  static void quad(const Segment& s, int64_t u, NativeInt (&q)[kParts]) {
    split_nibble_quad(s.qs, u, q);
  }
  static const Lanes& scale(const Segment& s, int) { return s.d; }
  static Lanes minimum(const Segment&) { return zero_lanes(); }
};

// Q4_1: 32 inputs; d fp16[16] @0, m fp16[16] @32, qs[16][16] @64 as Q4_0's. w = d * q + m
struct Q4_1 {
  static constexpr int64_t kGroup = 32, kTileBytes = 64 + 256;
  static constexpr int kOffset = 0, kHalves = 1;
  static constexpr int kLargestQuant = 15;
  static constexpr bool kHasMinimum = true;
  struct Segment {
    Lanes d, m;
    const uint8_t* qs;
  };
  static Segment segment(const uint8_t* tile, int64_t) { return {halves(tile), halves(tile + 32), tile + 64}; }
  static Lanes column(const Segment& s, int64_t j) {
    NativeInt q[kParts];
    split_nibbles(s.qs, j, q);
    return fused_multiply_add(s.d, as_lanes(q), s.m);
  }
  static void quad(const Segment& s, int64_t u, NativeInt (&q)[kParts]) { split_nibble_quad(s.qs, u, q); }
  static const Lanes& scale(const Segment& s, int) { return s.d; }
  static Lanes minimum(const Segment& s) { return s.m; }
};

// Q5_0 and Q5_1 add a fifth bit to Q4_0's and Q4_1's nibbles: each output's 32 fifth bits, bit j for
// input j, are one 32-bit lane of a quad. The fp32 path takes bit j of a column; the int8 path spreads
// the four bits of quad u (inputs 4u .. 4u + 3) to bit 4 of each byte: a multiply by 0x00204081 moves
// bit i of a nibble to bit 8i (the other products land off the byte boundaries the mask keeps)
inline void add_fifth_bit(const NativeInt (&qh)[kParts], int64_t j, NativeInt (&q)[kParts]) {
  for (int p = 0; p < kParts; ++p) q[p] |= ((qh[p] >> static_cast<int>(j)) & 1) << 4;
}

inline void add_quad_fifth_bits(const NativeInt (&qh)[kParts], int64_t u, NativeInt (&q)[kParts]) {
  for (int p = 0; p < kParts; ++p) {
    const NativeInt four = (qh[p] >> static_cast<int>(4 * u)) & 15;
    q[p] |= ((four * 0x00204081) & kEveryByte) << 4;
  }
}

// Q5_0: 32 inputs; d fp16[16] @0, qh (fifth bits) [1 quad][16] @32, qs[16][16] @96 as Q4_0's.
// w = d * ((q | fifth << 4) - 16)
struct Q5_0 {
  static constexpr int64_t kGroup = 32, kTileBytes = 32 + 64 + 256;
  static constexpr int kOffset = 16, kHalves = 1;
  static constexpr int kLargestQuant = 31;
  static constexpr bool kHasMinimum = false;
  struct Segment {
    Lanes d;
    NativeInt qh[kParts];
    const uint8_t* qs;
  };
  static Segment segment(const uint8_t* tile, int64_t) {
    Segment s{halves(tile), {}, tile + 96};
    load_quad(tile + 32, 0, s.qh);
    return s;
  }
  static Lanes column(const Segment& s, int64_t j) {
    NativeInt q[kParts];
    split_nibbles(s.qs, j, q);
    add_fifth_bit(s.qh, j, q);
    return multiply(s.d, as_lanes(q, 16));
  }
  static void quad(const Segment& s, int64_t u, NativeInt (&q)[kParts]) {
    split_nibble_quad(s.qs, u, q);
    add_quad_fifth_bits(s.qh, u, q);
  }
  static const Lanes& scale(const Segment& s, int) { return s.d; }
  static Lanes minimum(const Segment&) { return zero_lanes(); }
};

// Q5_1: 32 inputs; d fp16[16] @0, m fp16[16] @32, qh [1 quad][16] @64, qs[16][16] @128. w = d * q + m
struct Q5_1 {
  static constexpr int64_t kGroup = 32, kTileBytes = 64 + 64 + 256;
  static constexpr int kOffset = 0, kHalves = 1;
  static constexpr int kLargestQuant = 31;
  static constexpr bool kHasMinimum = true;
  struct Segment {
    Lanes d, m;
    NativeInt qh[kParts];
    const uint8_t* qs;
  };
  static Segment segment(const uint8_t* tile, int64_t) {
    Segment s{halves(tile), halves(tile + 32), {}, tile + 128};
    load_quad(tile + 64, 0, s.qh);
    return s;
  }
  static Lanes column(const Segment& s, int64_t j) {
    NativeInt q[kParts];
    split_nibbles(s.qs, j, q);
    add_fifth_bit(s.qh, j, q);
    return fused_multiply_add(s.d, as_lanes(q), s.m);
  }
  static void quad(const Segment& s, int64_t u, NativeInt (&q)[kParts]) {
    split_nibble_quad(s.qs, u, q);
    add_quad_fifth_bits(s.qh, u, q);
  }
  static const Lanes& scale(const Segment& s, int) { return s.d; }
  static Lanes minimum(const Segment& s) { return s.m; }
};

// Q8_0: 32 inputs; d fp16[16] @0, q int8[32 columns][16] @32. w = q * d (the int8 path reads q + 128,
// the sign bit flipped, as an unsigned quant)
struct Q8_0 {
  static constexpr int64_t kGroup = 32, kTileBytes = 32 + 512;
  static constexpr int kOffset = 128, kHalves = 1;
  static constexpr int kLargestQuant = 255;
  static constexpr bool kHasMinimum = false;
  struct Segment {
    Lanes d;
    const uint8_t* qs;
  };
  static Segment segment(const uint8_t* tile, int64_t) { return {halves(tile), tile + 32}; }
  static Lanes column(const Segment& s, int64_t j) {
    NativeInt q[kParts];
    load_column<true>(s.qs, j, q);
    return multiply(as_lanes(q), s.d);
  }
  static void quad(const Segment& s, int64_t u, NativeInt (&q)[kParts]) {
    load_quad(s.qs, u, q);
    for (int p = 0; p < kParts; ++p) q[p] ^= 0x80 * kEveryByte;
  }
  static const Lanes& scale(const Segment& s, int) { return s.d; }
  static Lanes minimum(const Segment&) { return zero_lanes(); }
};

// Q4_K: 256 inputs in 8 sub-blocks (segments) of 32; d fp16[16] @0, dmin fp16[16] @32, scale
// u8[8][16] @64, min u8[8][16] @192 (the 6-bit values GGUF packs in 12 bytes, unpacked), qs[128
// columns][16] @320: column c * 32 + l holds input c * 64 + l in its low nibble and c * 64 + 32 + l
// in its high one. w = (d * scale) * q - dmin * min
struct Q4_K {
  static constexpr int64_t kGroup = 256, kTileBytes = 320 + 128 * 16;
  static constexpr int kOffset = 0, kHalves = 1;
  static constexpr int kLargestQuant = 15;
  static constexpr bool kHasMinimum = true;
  struct Segment {
    Lanes scale, negative_min;
    const uint8_t* qs;  // the segment's 32 columns (a multiple of 4 columns: whole quads)
    bool high;
  };
  static Segment k_segment(const uint8_t* tile, int64_t s, const uint8_t* qs) {
    return {multiply(halves(tile), byte_lanes<false>(tile + 64 + s * 16)),
            negate(multiply(halves(tile + 32), byte_lanes<false>(tile + 192 + s * 16))), qs + (s / 2) * 32 * 16,
            s % 2 == 1};
  }
  static Segment segment(const uint8_t* tile, int64_t s) { return k_segment(tile, s, tile + 320); }
  static void quants(const Segment& s, int64_t j, NativeInt (&q)[kParts]) {
    if (s.high) nibbles<true>(s.qs, j, q); else nibbles<false>(s.qs, j, q);
  }
  static Lanes column(const Segment& s, int64_t j) {
    NativeInt q[kParts];
    quants(s, j, q);
    return fused_multiply_add(s.scale, as_lanes(q), s.negative_min);
  }
  static void quad(const Segment& s, int64_t u, NativeInt (&q)[kParts]) {
    if (s.high) quad_nibbles<true>(s.qs, u, q); else quad_nibbles<false>(s.qs, u, q);
  }
  static const Lanes& scale(const Segment& s, int) { return s.scale; }
  static Lanes minimum(const Segment& s) { return s.negative_min; }
};

// Q5_K: Q4_K's layout with qh[32 columns][16] @320 (bit s of column j is input 32 * s + j's fifth
// bit) and qs @832
struct Q5_K {
  static constexpr int64_t kGroup = 256, kTileBytes = 320 + 32 * 16 + 128 * 16;
  static constexpr int kOffset = 0, kHalves = 1;
  static constexpr int kLargestQuant = 31;
  static constexpr bool kHasMinimum = true;
  struct Segment {
    Q4_K::Segment low;
    const uint8_t* qh;
    int shift;
  };
  static Segment segment(const uint8_t* tile, int64_t s) {
    return {Q4_K::k_segment(tile, s, tile + 832), tile + 320, static_cast<int>(s)};
  }
  static Lanes column(const Segment& s, int64_t j) {
    NativeInt q[kParts];
    Q4_K::quants(s.low, j, q);
    add_high_bits(s.qh, j, s.shift, 1, q);
    return fused_multiply_add(s.low.scale, as_lanes(q), s.low.negative_min);
  }
  static void quad(const Segment& s, int64_t u, NativeInt (&q)[kParts]) {
    Q4_K::quad(s.low, u, q);
    add_quad_high_bits(s.qh, u, s.shift, 1, q);
  }
  static const Lanes& scale(const Segment& s, int) { return s.low.scale; }
  static Lanes minimum(const Segment& s) { return s.low.negative_min; }
};

// Q6_K: 256 inputs in 16 sub-blocks of 16 (a segment holds two); d fp16[16] @0, scale int8[16][16]
// @32, qh[64 columns][16] @288 (column c * 32 + l, bits 2t..2t+1: input c * 128 + t * 32 + l's two
// high bits), ql[128 columns][16] @1312 (column c * 64 + l: input c * 128 + l in the low nibble,
// c * 128 + 64 + l in the high one). w = (d * scale) * (q - 32), two roundings as the reference has
// them
struct Q6_K {
  static constexpr int64_t kGroup = 256, kTileBytes = 32 + 256 + 64 * 16 + 128 * 16;
  static constexpr int kOffset = 32, kHalves = 2;
  static constexpr int kLargestQuant = 63;
  static constexpr bool kHasMinimum = false;
  struct Segment {
    Lanes scale[2];
    const uint8_t *ql, *qh;
    bool high;
    int shift;
  };
  static Segment segment(const uint8_t* tile, int64_t s) {
    const int64_t c = s / 4, t = s % 4;
    const Lanes d = halves(tile);
    const uint8_t* scales = tile + 32 + 2 * s * 16;
    return {{multiply(d, byte_lanes<true>(scales)), multiply(d, byte_lanes<true>(scales + 16))},
            tile + 1312 + (c * 64 + (t % 2) * 32) * 16, tile + 288 + c * 32 * 16, t >= 2, static_cast<int>(2 * t)};
  }
  static Lanes column(const Segment& s, int64_t j) {
    NativeInt q[kParts];
    if (s.high) nibbles<true>(s.ql, j, q); else nibbles<false>(s.ql, j, q);
    add_high_bits(s.qh, j, s.shift, 3, q);
    return multiply(s.scale[j / 16], as_lanes(q, 32));
  }
  static void quad(const Segment& s, int64_t u, NativeInt (&q)[kParts]) {
    if (s.high) quad_nibbles<true>(s.ql, u, q); else quad_nibbles<false>(s.ql, u, q);
    add_quad_high_bits(s.qh, u, s.shift, 3, q);
  }
  static const Lanes& scale(const Segment& s, int half) { return s.scale[half]; }
  static Lanes minimum(const Segment&) { return zero_lanes(); }
};

// MXFP4's 4-bit E2M1 codes as unsigned quants, doubled and offset by 12 (values -12 .. 12 become 0 .. 24),
// for every byte of a lane at once. With byte shuffles (AVX-512 BW, AVX2) a code indexes a 16-byte table;
// elsewhere it is computed: the codes are at most 15, so each byte's arithmetic stays in its byte. A code
// is s e1 e0 m; its doubled magnitude for k = code & 7 is 0 1 2 3 4 6 8 12, that is
// k + (k >= 4 ? k - 4 : 0) + (k == 7 ? 2 : 0)
#if defined(__AVX512BW__) || (defined(__AVX2__) && !defined(__AVX512F__))
inline __m128i e2m1_table() { return _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0); }
#endif

inline NativeInt e2m1_quants(NativeInt codes) {
#if defined(__AVX512BW__)
  return bits_as<NativeInt>(_mm512_shuffle_epi8(_mm512_broadcast_i32x4(e2m1_table()), bits_as<__m512i>(codes)));
#elif defined(__AVX2__) && !defined(__AVX512F__)
  return bits_as<NativeInt>(_mm256_shuffle_epi8(_mm256_broadcastsi128_si256(e2m1_table()), bits_as<__m256i>(codes)));
#else
  const NativeInt k = codes & (7 * kEveryByte);
  const NativeInt four = (k >> 2) & kEveryByte;                   // 1 where k >= 4
  const NativeInt seven = four & (k >> 1) & k & kEveryByte;       // 1 where k == 7
  const NativeInt magnitude = k + ((four * 0xFF) & k & (3 * kEveryByte)) + (seven << 1);
  const NativeInt negative = ((codes >> 3) & kEveryByte) * 0xFF;  // 0xFF where the sign bit is set
  return ((12 * kEveryByte + magnitude) & ~negative) | ((12 * kEveryByte - magnitude) & negative);
#endif
}

// MXFP4 (gpt-oss's experts): 32 inputs; e (E8M0 exponent) u8[16] @0, qs[16][16] @16 as Q4_0's.
// w = 2^(e - 128) * value(code), value the doubled E2M1 value of the 4-bit code (ggml's
// e8m0_to_fp32_half: exponents 0 and 1 give the subnormals 2^-128 and 2^-127)
struct MXFP4 {
  static constexpr int64_t kGroup = 32, kTileBytes = 16 + 256;
  static constexpr int kOffset = 12, kHalves = 1;
  static constexpr int kLargestQuant = 24;
  static constexpr bool kHasMinimum = false;
  struct Segment {
    Lanes d;
    const uint8_t* qs;
  };
  static Segment segment(const uint8_t* tile, int64_t) {
    NativeInt e[kParts];
    load_bytes<false>(tile, e);
    Lanes d;
    const NativeInt smallest = NativeInt{} + 0x00200000;  // 2^-128's bits, a subnormal
    for (int p = 0; p < kParts; ++p) {
      const NativeInt normal = e[p] >= 2;  // all ones where 2^(e - 128) is a normal float, exponent field e - 1
      d.part[p] = bits_as<Native>((((e[p] - 1) << 23) & normal) | ((smallest << (e[p] & 1)) & ~normal));
    }
    return {d, tile + 16};
  }
  static Lanes column(const Segment& s, int64_t j) {
    NativeInt q[kParts];
    split_nibbles(s.qs, j, q);
    for (int p = 0; p < kParts; ++p) q[p] = e2m1_quants(q[p]) & 0xFF;  // (one code per lane: its low byte)
    return multiply(s.d, as_lanes(q, 12));
  }
  static void quad(const Segment& s, int64_t u, NativeInt (&q)[kParts]) {
    split_nibble_quad(s.qs, u, q);
    for (int p = 0; p < kParts; ++p) q[p] = e2m1_quants(q[p]);
  }
  static const Lanes& scale(const Segment& s, int) { return s.d; }
  static Lanes minimum(const Segment&) { return zero_lanes(); }
};

// The tile size and group of a format code; false for a code this file does not know
inline bool describe(int64_t format, int64_t& group, int64_t& tile_bytes) {
  switch (format) {
    case kQ4_0: group = Q4_0::kGroup; tile_bytes = Q4_0::kTileBytes; return true;
    case kQ4_1: group = Q4_1::kGroup; tile_bytes = Q4_1::kTileBytes; return true;
    case kQ5_0: group = Q5_0::kGroup; tile_bytes = Q5_0::kTileBytes; return true;
    case kQ5_1: group = Q5_1::kGroup; tile_bytes = Q5_1::kTileBytes; return true;
    case kQ8_0: group = Q8_0::kGroup; tile_bytes = Q8_0::kTileBytes; return true;
    case kQ4_K: group = Q4_K::kGroup; tile_bytes = Q4_K::kTileBytes; return true;
    case kQ5_K: group = Q5_K::kGroup; tile_bytes = Q5_K::kTileBytes; return true;
    case kQ6_K: group = Q6_K::kGroup; tile_bytes = Q6_K::kTileBytes; return true;
    case kMXFP4: group = MXFP4::kGroup; tile_bytes = MXFP4::kTileBytes; return true;
    default: return false;
  }
}

// Calls f(Format{}) with the decoder of `format` (checked by `describe` first)
template <typename F>
inline void with_format(int64_t format, F&& f) {
  switch (format) {
    case kQ4_0: return f(Q4_0{});
    case kQ4_1: return f(Q4_1{});
    case kQ5_0: return f(Q5_0{});
    case kQ5_1: return f(Q5_1{});
    case kQ8_0: return f(Q8_0{});
    case kQ4_K: return f(Q4_K{});
    case kQ5_K: return f(Q5_K{});
    case kMXFP4: return f(MXFP4{});
    default: return f(Q6_K{});
  }
}

}  // namespace ggml
}  // namespace radixserve
