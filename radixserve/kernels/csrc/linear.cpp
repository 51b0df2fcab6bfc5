// The CPU matmul: y = x W^T + b from a weight packed in blocks of 16 outputs (cpu_kernels.h).
//
// Why not oneDNN: a decode step multiplies one to a few rows by every weight, so the step is bound by
// reading the weights. oneDNN reads the embedded model's small matrices (1.3-7 MB) at 14-25 GB/s on
// the reference machine, whose large copies run at 25-45; this kernel streams each thread's share of
// the packed weight in order, one 64-byte line (fp32) per input column, and reads them at 27-32. On
// many rows (prefill) it is register-tiled (AVX-512: 6 rows x 32 outputs, 12 accumulators) and runs
// at oneDNN's speed (docs/cpu.md).
//
// GGUF weights (ggml_formats.h) run either way their header says: decoded to fp32 in registers and
// multiplied as fp32 weights are, or (int8 activations, llama.cpp's way) with each row's inputs
// rounded to 8 bits per block of 32 and integer dot products, four quants per 32-bit lane at a time
// (AVX-512 VNNI's vpdpbusd: 64 multiply-adds per instruction, against 16 for an fp32 FMA; AVX2's
// vpmaddubsw and vpmaddwd: 32 in two).
//
// Invariant: every output element is one fp32 chain of multiply-adds (fused where the CPU can) over
// the input columns in ascending order, then + bias, rounded once to the output dtype (int8
// activations: one chain of exact integer sums per sub-block, each scaled and added in fp32 in
// ascending order). Tiling changes which elements are computed together, never an element's order of
// operations, so a row's result is the same whatever the row count (one sequence alone, sixteen
// decoding, a 512-token prefill chunk).

#include "cpu_kernels.h"
#include "ggml_formats.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace radixserve {
namespace {

using at::Tensor;

// A tile's accumulators (rows x blocks x kParts vectors), its weights and a broadcast input fit the
// vector registers: AVX-512 6 x 2 x 1 (12 of 32), AVX2 6 x 1 x 2 (12 of 16), NEON 6 x 1 x 4 (24 of
// 32), SSE 3 x 1 x 4 (12 of 16)
constexpr int kTileBlocks = kParts == 1 ? 2 : 1;
constexpr int64_t kTileRows = kParts == 4 && kVectorRegisters == 16 ? 3 : 6;
static_assert(kTileRows >= 1 && kTileRows <= 6, "tile_rows dispatches 1 .. 6 rows");
constexpr int64_t kChunkRows = 48;  // rows whose inputs stay in cache while a thread walks its tiles

// out[r][b * 16 + j] = bias + sum over k ascending of x[r][k] * w_b[k][j], for Rows rows and Blocks blocks
template <int Rows, int Blocks, typename W>
void tile(const W* w, int64_t block_stride, const float* x, int64_t in, const float* bias, float* out,
          int64_t out_stride) {
  Lanes acc[Rows][Blocks] = {};
  for (int64_t k = 0; k < in; ++k) {
    Lanes column[Blocks];
    for (int b = 0; b < Blocks; ++b) column[b] = load_lanes(w + b * block_stride + k * kLanes);
    for (int r = 0; r < Rows; ++r) {
      const float value = x[r * in + k];
      for (int b = 0; b < Blocks; ++b) acc[r][b] = fused_multiply_add(value, column[b], acc[r][b]);
    }
  }
  for (int r = 0; r < Rows; ++r) {
    for (int b = 0; b < Blocks; ++b) {
      store_lanes(out + r * out_stride + b * kLanes, bias ? acc[r][b] + load_lanes(bias + b * kLanes) : acc[r][b]);
    }
  }
}

template <int Blocks, typename W>
void tile_rows(int64_t rows, const W* w, int64_t block_stride, const float* x, int64_t in, const float* bias,
               float* out, int64_t out_stride) {
  switch (rows) {  // at most kTileRows
    case 1: return tile<1, Blocks>(w, block_stride, x, in, bias, out, out_stride);
    case 2: return tile<2, Blocks>(w, block_stride, x, in, bias, out, out_stride);
    case 3: return tile<3, Blocks>(w, block_stride, x, in, bias, out, out_stride);
    case 4: return tile<4, Blocks>(w, block_stride, x, in, bias, out, out_stride);
    case 5: return tile<5, Blocks>(w, block_stride, x, in, bias, out, out_stride);
    default: return tile<kTileRows, Blocks>(w, block_stride, x, in, bias, out, out_stride);
  }
}

// Threads split the tiles (kTileBlocks blocks each), so each streams a contiguous share of the
// weight; rows go in chunks whose inputs stay in cache while the thread walks its tiles.
template <typename W>
void multiply(const W* w, int64_t blocks, const float* x, int64_t rows, int64_t in, const float* bias, float* out) {
  const int64_t block_stride = in * kLanes, out_stride = blocks * kLanes;
  const int64_t tiles = (blocks + kTileBlocks - 1) / kTileBlocks;
  at::parallel_for(0, tiles, 1, [&](int64_t first, int64_t end) {
    for (int64_t chunk = 0; chunk < rows; chunk += kChunkRows) {
      const int64_t chunk_end = std::min(rows, chunk + kChunkRows);
      for (int64_t t = first; t < end; ++t) {
        const int64_t block = t * kTileBlocks;
        const bool whole = block + kTileBlocks <= blocks;  // else the last, odd block alone
        const W* tile_w = w + block * block_stride;
        const float* tile_bias = bias ? bias + block * kLanes : nullptr;
        for (int64_t r = chunk; r < chunk_end; r += kTileRows) {
          const int64_t n = std::min(kTileRows, chunk_end - r);
          float* tile_out = out + r * out_stride + block * kLanes;
          if (whole) {
            tile_rows<kTileBlocks>(n, tile_w, block_stride, x + r * in, in, tile_bias, tile_out, out_stride);
          } else {
            tile_rows<1>(n, tile_w, block_stride, x + r * in, in, tile_bias, tile_out, out_stride);
          }
        }
      }
    }
  });
}

// A packed GGUF weight (ggml_quants.py writes it): one uint8 buffer, int64 words first: a header
// {kQuantizedMagic, blocks, in, activations}, then {byte offset, format} per block of 16 outputs,
// then the blocks' tiles (ggml_formats.h). Blocks may differ in format: a fused projection packs its
// parts as the file ships them (a Q4_K_M file's q and k in Q4_K, v in Q6_K). `activations` says how
// the inputs meet the weights: kFloatActivations (fp32 multiply-adds over the decoded weights) or
// kInt8Activations (each row quantized to 8 bits per block of 32 and integer dot products, as
// llama.cpp computes).
constexpr int64_t kQuantizedMagic = 0x31515352;  // "RSQ1"
constexpr int64_t kHeaderWords = 4;
constexpr int64_t kFloatActivations = 0, kInt8Activations = 1;

struct QuantizedWeight {
  const uint8_t* base;
  const int64_t* table;  // {offset, format} per block
  int64_t blocks, in;
  bool int8_activations;
};

// The weight's header and table, every block checked to lie within the buffer in a known format
// whose group divides the inputs: a damaged buffer is refused here, never read out of bounds
QuantizedWeight read_quantized(const Tensor& packed) {
  TORCH_CHECK(packed.dim() == 1 && packed.is_contiguous() && packed.device().is_cpu(),
              "a packed GGUF weight is a contiguous 1-D uint8 CPU tensor (ggml_quants.pack_ggml)");
  const int64_t size = packed.numel();
  TORCH_CHECK(size >= kHeaderWords * 8, "packed GGUF weight: too short for its header");
  const auto* base = packed.const_data_ptr<uint8_t>();
  int64_t header[kHeaderWords];
  std::memcpy(header, base, sizeof header);
  TORCH_CHECK(header[0] == kQuantizedMagic, "packed GGUF weight: bad magic (not written by pack_ggml)");
  const int64_t blocks = header[1], in = header[2], activations = header[3];
  TORCH_CHECK(blocks > 0 && in > 0 && (kHeaderWords + 2 * blocks) * 8 <= size &&
                  (activations == kFloatActivations || activations == kInt8Activations),
              "packed GGUF weight: bad header");
  const auto* table = reinterpret_cast<const int64_t*>(base) + kHeaderWords;
  // a weight is read on every step: a format is looked up once per run of blocks in it
  int64_t format = -1, block_bytes = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (table[2 * b + 1] != format) {
      int64_t group = 0, tile_bytes = 0;
      TORCH_CHECK(ggml::describe(table[2 * b + 1], group, tile_bytes), "packed GGUF weight: block ", b,
                  " has unknown format ", table[2 * b + 1]);
      TORCH_CHECK(in % group == 0, "packed GGUF weight: ", in, " inputs are not whole groups of ", group);
      format = table[2 * b + 1], block_bytes = in / group * tile_bytes;
    }
    const int64_t offset = table[2 * b];
    TORCH_CHECK(offset >= (kHeaderWords + 2 * blocks) * 8 && offset <= size - block_bytes,
                "packed GGUF weight: block ", b, " lies outside the buffer");
  }
  return {base, table, blocks, in, activations == kInt8Activations};
}

// The rows' inputs as the int8 path reads them (llama.cpp's 8-bit activations): each row's inputs in
// blocks of 32 (every format's group is a multiple), block i of row r scaled by
//   d = fp16(max |x| / 127),  q = round-half-even(x * (127 / max |x|))
// (q all zero where 127 / max |x| is not finite; d NaN where an input is not finite), with q's sums
// per 16 inputs. A row's quants depend on that row alone.
struct Int8Rows {
  std::vector<int8_t> q;       // [rows, in]
  std::vector<float> d;        // [rows, in / 32]
  std::vector<int32_t> sums;   // [rows, in / 16]
  int64_t in = 0;

  int32_t word(int64_t row, int64_t k) const {  // inputs k .. k + 3 of a row, one per byte
    int32_t w;
    std::memcpy(&w, q.data() + row * in + k, sizeof w);
    return w;
  }
};

// One block of 32 inputs, finite and not all zero, the scalar loop's arithmetic a vector at a time:
// the largest magnitude (a maximum is exact in any order), the products by 127 / max rounded to the
// nearest integer, ties to even (the rounding mode std::nearbyint uses); false, with nothing
// written, for a block the scalar loop must take (a NaN or infinity, all zeros, 127 / max not finite).
inline bool quantize_block_vectors(const float* from, int8_t* to, float& scale) {
#if defined(__AVX2__)
  const __m256 magnitude_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 infinity = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 values[4], most = _mm256_setzero_ps(), finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  for (int v = 0; v < 4; ++v) {
    values[v] = _mm256_loadu_ps(from + 8 * v);
    const __m256 magnitude = _mm256_and_ps(values[v], magnitude_mask);
    finite = _mm256_and_ps(finite, _mm256_cmp_ps(magnitude, infinity, _CMP_LT_OQ));  // false for NaN too
    most = _mm256_max_ps(most, magnitude);
  }
  if (_mm256_movemask_ps(finite) != 0xff) return false;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, most);
  float largest = 0.f;
  for (const float lane : lanes) largest = std::max(largest, lane);
  const float inverse = 127.f / largest;
  if (!(largest > 0.f) || !std::isfinite(inverse)) return false;
  scale = static_cast<float>(c10::Half(largest / 127.f));
  alignas(32) int32_t quants[32];
  for (int v = 0; v < 4; ++v) {
    const __m256i rounded = _mm256_cvtps_epi32(_mm256_mul_ps(values[v], _mm256_set1_ps(inverse)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(quants + 8 * v), rounded);
  }
  for (int i = 0; i < 32; ++i) to[i] = static_cast<int8_t>(quants[i]);
  return true;
#else
  (void)from, (void)to, (void)scale;
  return false;
#endif
}

Int8Rows quantize_rows(const float* x, int64_t rows, int64_t in) {
  Int8Rows a;
  a.in = in;
  a.q.resize(rows * in);
  a.d.resize(rows * in / 32);
  a.sums.resize(rows * in / 16);
  at::parallel_for(0, rows * in / 32, 64, [&](int64_t first, int64_t end) {
    for (int64_t block = first; block < end; ++block) {
      const float* from = x + block * 32;
      int8_t* to = a.q.data() + block * 32;
      if (!quantize_block_vectors(from, to, a.d[block])) {
        float most = 0.f;
        bool finite = true;
        for (int64_t i = 0; i < 32; ++i) {
          most = std::max(most, std::fabs(from[i]));
          finite = finite && std::isfinite(from[i]);
        }
        // a NaN or infinite input makes its block's scale NaN, so it reaches the outputs as the fp32
        // path would carry it; a block too small for 127 / max to be finite scales to fp16 zero anyway
        const float inverse = 127.f / most;
        const bool zero = !finite || !(most > 0.f) || !std::isfinite(inverse);
        a.d[block] = finite ? static_cast<float>(c10::Half(most / 127.f)) : std::numeric_limits<float>::quiet_NaN();
        for (int64_t i = 0; i < 32; ++i) to[i] = zero ? 0 : static_cast<int8_t>(std::nearbyint(from[i] * inverse));
      }
      for (int half = 0; half < 2; ++half) {
        int32_t sum = 0;
        for (int64_t i = 0; i < 16; ++i) sum += to[half * 16 + i];
        a.sums[block * 2 + half] = sum;
      }
    }
  });
  return a;
}

#if defined(__AVX2__) && !defined(__AVX512F__) && !defined(__AVXVNNI__)
constexpr bool kBytePairs = true;  // dot4 multiplies bytes into 16-bit pairs (AVX2 without VNNI)
#else
constexpr bool kBytePairs = false;
#endif
// vpmaddubsw adds two byte products into int16, saturating: exact while both fit, that is for quants
// up to 128 (2 * 128 * 127 < 2^15). Larger ones (Q8_0's, 0 .. 255) are counted centred, as q - 128
// (its magnitude, at most 128, times the input carrying its sign), and the half's epilogue takes
// kCentring off the format's offset: the same exact integer in the end
template <int Largest>
constexpr int kCentring = kBytePairs && Largest > 128 ? 128 : 0;

// acc + the dot products of 16 outputs' four unsigned quants less kCentring (one per byte of each lane,
// at most Largest) with four signed 8-bit inputs (one per byte of `inputs`, each within +-127), exact
// in int32
template <int Largest>
inline NativeInt dot4(NativeInt acc, NativeInt quads, int32_t inputs) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  return bits_as<NativeInt>(
      _mm512_dpbusd_epi32(bits_as<__m512i>(acc), bits_as<__m512i>(quads), _mm512_set1_epi32(inputs)));
#elif defined(__AVX__) && defined(__AVXVNNI__)
  return bits_as<NativeInt>(
      _mm256_dpbusd_avx_epi32(bits_as<__m256i>(acc), bits_as<__m256i>(quads), _mm256_set1_epi32(inputs)));
#elif defined(__AVX2__) && !defined(__AVX512F__)
  static_assert(kBytePairs);
  const __m256i x = _mm256_set1_epi32(inputs);
  __m256i q = bits_as<__m256i>(quads), signed_inputs = x;
  if constexpr (kCentring<Largest> != 0) {
    const __m256i centred = _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80)));
    q = _mm256_sign_epi8(centred, centred);
    signed_inputs = _mm256_sign_epi8(x, centred);
  }
  const __m256i pairs = _mm256_maddubs_epi16(q, signed_inputs);
  return acc + bits_as<NativeInt>(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#else
  for (int i = 0; i < 4; ++i) {
    acc += ((quads >> (8 * i)) & 255) * static_cast<int32_t>(static_cast<int8_t>(inputs >> (8 * i)));
  }
  return acc;
#endif
}

// What a tile reads of its rows: the fp32 inputs, and their int8 form where the weight takes int8
struct Inputs {
  const float* x;  // [rows, in]
  const Int8Rows* int8;
  int64_t in;
};

// How far ahead of an int8 tile's reads its weights are requested (bytes). From memory, the
// hardware's prefetchers alone held the embedded model's layer matmuls (Q4_1, one row) to 8-10 GB/s on
// the AVX2 VM, where a plain read by two threads ran at 13-17 GB/s. 1,280 bytes ahead (four Q4_1
// groups; two to six did alike), with one block per int8 tile (quantized_tiles): the layer matmuls 19%
// faster, the batch-1 decode step 18% (docs/quantized.md, the 2026-12-02 section). The fp32-activation
// tiles take no prefetch: their multiply-adds bind them at 5-6 GB/s, and it changed nothing there.
constexpr int64_t kWeightPrefetchBytes = 1280;

// Requests the weight bytes kWeightPrefetchBytes past segment s of group g of a block: as many as one
// segment reads, so that the requests advance with the reads. Past the block's end they reach the next
// block, the one the thread reads next (a weight's blocks lie in order); a prefetch never faults.
template <typename F>
inline void prefetch_ahead(const uint8_t* block, int64_t g, int64_t s) {
  constexpr int64_t kSegmentBytes = F::kTileBytes * 32 / F::kGroup;
  const uint8_t* from = block + g * F::kTileBytes + s * kSegmentBytes + kWeightPrefetchBytes;
  for (int64_t line = 0; line < kSegmentBytes; line += 64) __builtin_prefetch(from + line, 0, 3);
}

// out[r][b * 16 + j] = bias + sum over k ascending of x[r][k] * w_b[k][j] for Rows rows (from `row`)
// and Blocks blocks of one format, the weights decoded column by column in registers: Rows <=
// kTileRows (decode, verification). Blocks > 1 gives a row several independent chains of
// multiply-adds, so one row is not held to one multiply-add per latency.
template <int Rows, int Blocks, typename F>
void float_tile(const uint8_t* const* block, int64_t groups, const Inputs& inputs, int64_t row, const float* bias,
                float* out, int64_t out_stride) {
  const int64_t in = inputs.in;
  const float* x = inputs.x + row * in;
  Lanes acc[Rows][Blocks] = {};
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t s = 0; s < F::kGroup / 32; ++s) {
      typename F::Segment segment[Blocks];
      for (int b = 0; b < Blocks; ++b) segment[b] = F::segment(block[b] + g * F::kTileBytes, s);
      const float* segment_x = x + g * F::kGroup + s * 32;
      for (int64_t j = 0; j < 32; ++j) {
        Lanes w[Blocks];
        for (int b = 0; b < Blocks; ++b) w[b] = F::column(segment[b], j);
        for (int r = 0; r < Rows; ++r) {
          const float value = segment_x[r * in + j];
          for (int b = 0; b < Blocks; ++b) acc[r][b] = fused_multiply_add(value, w[b], acc[r][b]);
        }
      }
    }
  }
  for (int r = 0; r < Rows; ++r) {
    for (int b = 0; b < Blocks; ++b) {
      store_lanes(out + r * out_stride + b * kLanes,
                  bias ? acc[r][b] + load_lanes(bias + b * kLanes) : acc[r][b]);
    }
  }
}

// The int8 path's tile: one block of 16 outputs for Rows rows (from `row`). For each segment (half)
// of 32 (16) inputs, an exact integer count c = sum of quant * q over it, then, in fp32, each a
// separate multiply and add (no fusing):
//   acc = acc + (scale * d) * (c - kOffset * sum q)       [per half]
//   acc = acc + minimum * (d * sum q)                      [kHasMinimum: Q4_1 and the K types]
// over the segments in ascending order, then + bias. d * sum q is exact (11 + 12 significant bits).
// One block per tile: a thread's tiles then read its share of the weight as one stream that
// prefetch_ahead stays ahead of (two blocks side by side were two streams a block apart, the second
// unrequested at each tile's start).
template <int Rows, typename F>
void int8_tile(const uint8_t* block, int64_t groups, const Inputs& inputs, int64_t row, const float* bias,
               float* out, int64_t out_stride) {
  const Int8Rows& a = *inputs.int8;
  const int64_t in = inputs.in;
  constexpr int64_t kQuadsPerHalf = 8 / F::kHalves;
  Lanes acc[Rows] = {};
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t s = 0; s < F::kGroup / 32; ++s) {
      prefetch_ahead<F>(block, g, s);
      const typename F::Segment segment = F::segment(block + g * F::kTileBytes, s);
      const int64_t start = g * F::kGroup + s * 32;
      for (int half = 0; half < F::kHalves; ++half) {
        NativeInt count[Rows][kParts] = {};
        for (int64_t u = half * kQuadsPerHalf; u < (half + 1) * kQuadsPerHalf; ++u) {
          NativeInt quads[kParts];
          F::quad(segment, u, quads);
          for (int r = 0; r < Rows; ++r) {
            const int32_t word = a.word(row + r, start + 4 * u);
            for (int p = 0; p < kParts; ++p) count[r][p] = dot4<F::kLargestQuant>(count[r][p], quads[p], word);
          }
        }
        for (int r = 0; r < Rows; ++r) {
          const int64_t sixteens = (row + r) * (in / 16) + start / 16;
          const int32_t sum = F::kHalves == 2 ? a.sums[sixteens + half] : a.sums[sixteens] + a.sums[sixteens + 1];
          const float d = a.d[(row + r) * (in / 32) + start / 32];
          const int32_t offset = (F::kOffset - kCentring<F::kLargestQuant>) * sum;  // dot4 counted less kCentring
          acc[r] = acc[r] + ggml::multiply(ggml::multiply(F::scale(segment, half), broadcast(d)),
                                           ggml::as_lanes(count[r], offset));
          if constexpr (F::kHasMinimum) {
            acc[r] = acc[r] + ggml::multiply(F::minimum(segment), broadcast(d * static_cast<float>(sum)));
          }
        }
      }
    }
  }
  for (int r = 0; r < Rows; ++r) store_lanes(out + r * out_stride, bias ? acc[r] + load_lanes(bias) : acc[r]);
}

// Blocks per register tile: accumulators, weights and a broadcast input within the vector registers
constexpr int kQuantizedBlocks = kVectorRegisters == 32 ? 4 : 2;
static_assert(kTileBlocks <= kQuantizedBlocks, "many rows take up to kTileBlocks blocks of one format");
constexpr int64_t kInt8TileRows = 4;  // rows per int8 tile: 2 x 4 counts and 2 x 4 sums in registers

template <bool Int8, int Rows, int Blocks, typename F>
void quantized_tiles(const uint8_t* const* block, int64_t groups, const Inputs& inputs, int64_t row,
                     const float* bias, float* out, int64_t out_stride) {
  // fp32 tiles: more rows, fewer blocks per tile, so that the accumulators stay within the registers.
  // int8 tiles: one block each (int8_tile says why).
  constexpr int kPerTile = Int8 ? 1 : Rows <= 2 || Blocks == 1 ? Blocks : Blocks / 2;
  for (int b = 0; b < Blocks; b += kPerTile) {
    const float* tile_bias = bias ? bias + b * kLanes : nullptr;
    if constexpr (Int8) {
      int8_tile<Rows, F>(block[b], groups, inputs, row, tile_bias, out + b * kLanes, out_stride);
    } else {
      float_tile<Rows, kPerTile, F>(block + b, groups, inputs, row, tile_bias, out + b * kLanes, out_stride);
    }
  }
}

template <bool Int8, int Blocks, typename F>
void quantized_tile_rows(int64_t rows, const uint8_t* const* block, int64_t groups, const Inputs& inputs,
                         int64_t row, const float* bias, float* out, int64_t out_stride) {
  switch (rows) {  // at most kTileRows (kInt8TileRows for int8)
    case 1: return quantized_tiles<Int8, 1, Blocks, F>(block, groups, inputs, row, bias, out, out_stride);
    case 2: return quantized_tiles<Int8, 2, Blocks, F>(block, groups, inputs, row, bias, out, out_stride);
    case 3: return quantized_tiles<Int8, 3, Blocks, F>(block, groups, inputs, row, bias, out, out_stride);
    case 4: return quantized_tiles<Int8, 4, Blocks, F>(block, groups, inputs, row, bias, out, out_stride);
    default: break;
  }
  if constexpr (!Int8) {
    if (rows == 5) return quantized_tiles<Int8, 5, Blocks, F>(block, groups, inputs, row, bias, out, out_stride);
    return quantized_tiles<Int8, kTileRows, Blocks, F>(block, groups, inputs, row, bias, out, out_stride);
  } else {
    TORCH_CHECK(false, "int8 tiles take at most ", kInt8TileRows, " rows, got ", rows);
  }
}

// Rows r .. r + n of blocks `blocks` (count of one format) in register tiles
template <bool Int8, typename F>
void register_tiles(int64_t n, const uint8_t* const* blocks, int64_t count, int64_t groups, const Inputs& inputs,
                    int64_t row, const float* bias, float* out, int64_t out_stride) {
  if (count == kQuantizedBlocks) {
    quantized_tile_rows<Int8, kQuantizedBlocks, F>(n, blocks, groups, inputs, row, bias, out, out_stride);
    return;
  }
  for (int64_t i = 0; i < count; ++i) {
    quantized_tile_rows<Int8, 1, F>(n, blocks + i, groups, inputs, row, bias ? bias + i * kLanes : nullptr,
                                    out + i * kLanes, out_stride);
  }
}

// One block's weights as pack_linear lays out an fp32 block: [in][16]
template <typename F>
void dequantize_block(const uint8_t* block, int64_t groups, float* to) {
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t s = 0; s < F::kGroup / 32; ++s) {
      const typename F::Segment segment = F::segment(block + g * F::kTileBytes, s);
      float* segment_to = to + (g * F::kGroup + s * 32) * kLanes;
      for (int64_t j = 0; j < 32; ++j) store_lanes(segment_to + j * kLanes, F::column(segment, j));
    }
  }
}

// Threads split the blocks, each streaming a contiguous share of the weight.
// - int8 activations: the rows are quantized once, then every chunk of rows runs in register tiles of
//   kInt8TileRows, the block's quants decoded per tile (a mask or two per 64 weights).
// - fp32 activations: a chunk of rows that fits one register tile decodes the weights in registers;
//   more rows decode each block once per chunk into a buffer that the fp32 tiles (kTileBlocks blocks
//   wide) then read, so prefill pays the decoding once per 48 rows. Either way an output is the fp32
//   kernel's chain over the same weights: the same bits as `linear` over the dequantized weight
//   packed by pack_linear.
// Either way a row's result does not depend on the row count.
void multiply_quantized(const QuantizedWeight& w, const float* x, int64_t rows, const float* bias, float* out) {
  const int64_t in = w.in, out_stride = w.blocks * kLanes;
  std::optional<Int8Rows> int8;
  if (w.int8_activations) int8 = quantize_rows(x, rows, in);
  const Inputs inputs{x, int8 ? &*int8 : nullptr, in};
  at::parallel_for(0, w.blocks, 1, [&](int64_t first, int64_t end) {
    std::vector<float> decoded;
    for (int64_t chunk = 0; chunk < rows; chunk += kChunkRows) {
      const int64_t chunk_rows = std::min(rows, chunk + kChunkRows) - chunk;
      for (int64_t b = first; b < end;) {
        const int64_t format = w.table[2 * b + 1];
        const bool buffered = !int8 && chunk_rows > kTileRows;
        // blocks of one format, side by side in one register tile where the range holds them
        // (decoded into a buffer for many rows: as many blocks as the fp32 tiles take)
        const int64_t most = buffered ? kTileBlocks : kQuantizedBlocks;
        int64_t count = 1;
        while (count < most && b + count < end && w.table[2 * (b + count) + 1] == format) ++count;
        const uint8_t* blocks[kQuantizedBlocks];
        for (int64_t i = 0; i < count; ++i) blocks[i] = w.base + w.table[2 * (b + i)];
        const float* tile_bias = bias ? bias + b * kLanes : nullptr;
        float* tile_out = out + chunk * out_stride + b * kLanes;
        ggml::with_format(format, [&](auto decoder) {
          using F = decltype(decoder);
          const int64_t groups = in / F::kGroup;
          if (int8) {
            for (int64_t r = 0; r < chunk_rows; r += kInt8TileRows) {
              register_tiles<true, F>(std::min(kInt8TileRows, chunk_rows - r), blocks, count, groups, inputs,
                                      chunk + r, tile_bias, tile_out + r * out_stride, out_stride);
            }
            return;
          }
          if (!buffered) {
            register_tiles<false, F>(chunk_rows, blocks, count, groups, inputs, chunk, tile_bias, tile_out,
                                     out_stride);
            return;
          }
          decoded.resize(kTileBlocks * in * kLanes);
          for (int64_t i = 0; i < count; ++i) dequantize_block<F>(blocks[i], groups, decoded.data() + i * in * kLanes);
          for (int64_t r = 0; r < chunk_rows; r += kTileRows) {
            const int64_t n = std::min(kTileRows, chunk_rows - r);
            if (count == kTileBlocks) {
              tile_rows<kTileBlocks>(n, decoded.data(), in * kLanes, x + (chunk + r) * in, in, tile_bias,
                                     tile_out + r * out_stride, out_stride);
            } else {
              tile_rows<1>(n, decoded.data(), in * kLanes, x + (chunk + r) * in, in, tile_bias, tile_out + r * out_stride,
                           out_stride);
            }
          }
        });
        b += count;
      }
    }
  });
}

}  // namespace

Tensor pack_linear(const Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu(), "pack_linear: the weight must be [out, in], on CPU");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "pack_linear: fp32 or bf16 weights, got ", weight.scalar_type());
  const int64_t out = weight.size(0), in = weight.size(1), blocks = (out + kLanes - 1) / kLanes;
  Tensor padded = at::zeros({blocks * kLanes, in}, weight.options());
  padded.narrow(0, 0, out).copy_(weight);
  return padded.view({blocks, kLanes, in}).transpose(1, 2).contiguous();
}

Tensor linear(const Tensor& x, const Tensor& packed, const std::optional<Tensor>& bias, int64_t out_features) {
  const bool quantized = packed.scalar_type() == at::kByte;
  std::optional<QuantizedWeight> gguf;
  int64_t in = 0, blocks = 0;
  if (quantized) {
    gguf = read_quantized(packed);
    in = gguf->in, blocks = gguf->blocks;
  } else {
    TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kLanes && packed.is_contiguous() &&
                    (packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16),
                "linear: a contiguous fp32 or bf16 weight packed by pack_linear [blocks, in, 16], or a uint8 "
                "GGUF weight packed by pack_ggml; got ", packed.scalar_type(), " ", packed.sizes());
    in = packed.size(1), blocks = packed.size(0);
  }
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in, "linear: x [rows, in] with in = ", in, ", got ", x.sizes());
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && (!bias || bias->device().is_cpu()),
              "linear: CPU tensors");
  const int64_t rows = x.size(0), width = blocks * kLanes;
  TORCH_CHECK(0 < out_features && out_features <= width && out_features > width - kLanes,
              "linear: ", out_features, " outputs do not match ", blocks, " packed blocks");
  const Tensor inputs = x.to(at::kFloat).contiguous();
  std::optional<Tensor> biases;
  if (bias) {
    TORCH_CHECK(bias->numel() == out_features, "linear: a bias of ", out_features, " values");
    if (bias->scalar_type() == at::kFloat && bias->is_contiguous() && width == out_features) {
      biases = *bias;  // the tiles read whole blocks of 16: this one has them all
    } else {
      biases = at::zeros({width}, x.options().dtype(at::kFloat));
      biases->narrow(0, 0, out_features).copy_(*bias);
    }
  }
  const bool direct = x.scalar_type() == at::kFloat && width == out_features;
  Tensor out = at::empty({rows, width}, x.options().dtype(at::kFloat));
  if (rows > 0) {
    const float* b = biases ? biases->const_data_ptr<float>() : nullptr;
    const float* inputs_data = inputs.const_data_ptr<float>();
    if (quantized) {
      multiply_quantized(*gguf, inputs_data, rows, b, out.mutable_data_ptr<float>());
    } else if (packed.scalar_type() == at::kFloat) {
      multiply(packed.const_data_ptr<float>(), blocks, inputs_data, rows, in, b, out.mutable_data_ptr<float>());
    } else {
      multiply(reinterpret_cast<const uint16_t*>(packed.const_data_ptr<at::BFloat16>()), blocks, inputs_data, rows,
               in, b, out.mutable_data_ptr<float>());
    }
  }
  return direct ? out : out.narrow(1, 0, out_features).to(x.scalar_type()).contiguous();
}

Tensor ggml_rows(const Tensor& packed, const Tensor& rows) {
  const QuantizedWeight w = read_quantized(packed);
  TORCH_CHECK(rows.dim() == 1 && rows.device().is_cpu(), "ggml_rows: a 1-D CPU tensor of row indices");
  const Tensor ids = rows.to(at::kLong).contiguous();
  const int64_t n = ids.numel(), in = w.in;
  const int64_t* id = ids.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(0 <= id[i] && id[i] < w.blocks * kLanes, "ggml_rows: row ", id[i], " is outside the weight");
  }
  Tensor out = at::empty({n, in}, rows.options().dtype(at::kFloat));
  float* to = out.mutable_data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t first, int64_t end) {
    std::vector<float> decoded(in * kLanes);
    int64_t held = -1;  // the block `decoded` holds: consecutive rows of one block decode it once
    for (int64_t i = first; i < end; ++i) {
      const int64_t b = id[i] / kLanes, lane = id[i] % kLanes;
      if (b != held) {
        ggml::with_format(w.table[2 * b + 1], [&](auto format) {
          using F = decltype(format);
          dequantize_block<F>(w.base + w.table[2 * b], in / F::kGroup, decoded.data());
        });
        held = b;
      }
      for (int64_t k = 0; k < in; ++k) to[i * in + k] = decoded[k * kLanes + lane];
    }
  });
  return out;
}

}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("pack_linear(Tensor weight) -> Tensor", radixserve::pack_linear);
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor", radixserve::linear);
  m.def("ggml_rows(Tensor packed, Tensor rows) -> Tensor", radixserve::ggml_rows);
}
