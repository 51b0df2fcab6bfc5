// The CPU matmul: y = x W^T + b from a weight packed in blocks of 16 outputs (cpu_kernels.h).
//
// Why not oneDNN: a decode step multiplies one to a few rows by every weight, so the step is bound by
// reading the weights. oneDNN reads the embedded model's small matrices (1.3-7 MB) at 14-25 GB/s on
// the reference machine, whose large copies run at 25-45; this kernel streams each thread's share of
// the packed weight in order, one 64-byte line (fp32) per input column, and reads them at 27-32. On
// many rows (prefill) it is register-tiled (AVX-512: 6 rows x 32 outputs, 12 accumulators) and runs
// at oneDNN's speed (docs/cpu.md).
//
// Invariant: every output element is one fp32 chain of multiply-adds (fused where the CPU can) over
// the input columns in ascending order, then + bias, rounded once to the output dtype. Tiling changes
// which elements are computed together, never an element's order of operations, so a row's result
// is the same whatever the row count (one sequence alone, sixteen decoding, a 512-token prefill chunk).

#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

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
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == kLanes && x.size(1) == packed.size(1),
              "linear: x [rows, in] and a weight packed by pack_linear [blocks, in, 16], got ", x.sizes(), " and ",
              packed.sizes());
  TORCH_CHECK(packed.is_contiguous() && (packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16),
              "linear: a contiguous fp32 or bf16 packed weight");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && (!bias || bias->device().is_cpu()),
              "linear: CPU tensors");
  const int64_t rows = x.size(0), in = x.size(1), blocks = packed.size(0), width = blocks * kLanes;
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
    if (packed.scalar_type() == at::kFloat) {
      multiply(packed.const_data_ptr<float>(), blocks, inputs.const_data_ptr<float>(), rows, in, b,
               out.mutable_data_ptr<float>());
    } else {
      multiply(reinterpret_cast<const uint16_t*>(packed.const_data_ptr<at::BFloat16>()), blocks,
               inputs.const_data_ptr<float>(), rows, in, b, out.mutable_data_ptr<float>());
    }
  }
  return direct ? out : out.narrow(1, 0, out_features).to(x.scalar_type()).contiguous();
}

}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("pack_linear(Tensor weight) -> Tensor", radixserve::pack_linear);
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor", radixserve::linear);
}
