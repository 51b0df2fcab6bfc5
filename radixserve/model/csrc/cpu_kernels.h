// The CPU kernels of radixserve's C++ extension, shared by the Python layers (as torch.ops.radixserve
// operators) and the compiled step (cpu_step.cpp), so that both compute every token bit for bit alike.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <optional>

// The extension is built with -ffp-contract=off so that cpu_step.cpp's elementwise loops round as
// ATen's do; in the kernels a multiply and its add are meant to fuse (one rounding, half the
// instructions), per function.
#if defined(__clang__)
#define RS_FUSED_MULTIPLY_ADD _Pragma("clang fp contract(fast)")
#define RS_FUSED_MULTIPLY_ADD_FUNCTION
#else
#define RS_FUSED_MULTIPLY_ADD
#define RS_FUSED_MULTIPLY_ADD_FUNCTION __attribute__((optimize("fp-contract=fast")))
#endif

namespace radixserve {

// 16 fp32 lanes: one 64-byte line, which the compiler maps onto the CPU's vectors (AVX-512, AVX2, NEON)
constexpr int64_t kLanes = 16;
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

inline Lanes load_lanes(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline Lanes load_lanes(const uint16_t* bf16) {  // bf16 bits widened to fp32: exact
  typedef uint16_t Narrow __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  typedef uint32_t Wide __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  Narrow narrow;
  std::memcpy(&narrow, bf16, sizeof narrow);
  const Wide wide = __builtin_convertvector(narrow, Wide) << 16;
  Lanes v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

// A weight [out, in] laid out for `linear`: [ceil(out / 16), in, 16] (output blocks of 16, each
// block's 16 weights of one input column side by side; the last block padded with zeros), in the
// weight's dtype (fp32 or bf16).
at::Tensor pack_linear(const at::Tensor& weight);

// x [rows, in] @ W^T + bias -> [rows, out_features] in x's dtype, W packed by `pack_linear`. Every
// output element is one fp32 fused multiply-add chain over the inputs in ascending order, plus the
// bias, rounded once to x's dtype: the same for a row whatever the row count, so a row's result
// never depends on what else ran in its step.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                  int64_t out_features);

// Attention of the short rows (at most `max_query` new tokens) of a step, read in place from the
// paged cache [blocks, block_size, kv_heads, head_dim] through `block_table` [rows, width]: row b's
// new tokens are q's rows from sum(query_lens[:b]) on, the last of its seq_lens[b] tokens, and query
// i of n sees keys 0 .. seq_lens[b] - n + i. Writes those rows of `out` [T, heads, head_dim]; rows
// with more new tokens are left alone. A row's result depends on its own query, keys and values
// only (keys are split into fixed partitions of the row's own length, merged in order).
void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_table, at::IntArrayRef seq_lens, at::IntArrayRef query_lens,
                     double scale, int64_t max_query, const at::Tensor& out);

}  // namespace radixserve
