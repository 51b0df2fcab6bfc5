// The CPU decode step's layers in one call: `radixserve::short_step` runs every decoder layer of a
// step whose rows are all short (decodes and verifications of drafts) and returns the final-normed
// hidden states.
//
// Why: on CPU a batch-1 step of the 135M model is ~120 matmuls and ~900 small ops. Issued from
// Python each small op costs several microseconds of interpreter and binding time, far more than
// its arithmetic; issued from here it costs the dispatcher's fraction of that.
//
// Invariant: its result equals the Python path's bit for bit (model/decoder.py, model/ops.py
// CpuKernelOps, model/rope.py, model/attention.py, kernels/cpu_linear.py). The matmuls, attention,
// the norm and SiLU-and-mul are the kernels that path calls too (cpu_kernels.h: BlockedLinear's,
// the torch backend's in-place attention, CpuKernelOps' add_rms_norm and silu_and_mul); the cache
// writes and rotary are loops doing its arithmetic with its rounding (below), built with
// -ffp-contract=off so that no multiply and add fuse into one rounding. A change to one is a change
// to both; tests/model/test_cpu_compiled_step.py compares them with torch.equal in fp32 and bf16.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "cpu_kernels.h"

#include <cstring>
#include <limits>
#include <optional>

namespace {

using at::Tensor;
using radixserve::linear;

constexpr int64_t kPerLayer = 6;  // weights per layer, in `CpuStep.weights` order
constexpr int64_t kBiasesPerLayer = 4;

template <typename T>
void rotate_rows(const T* x, int64_t token_stride, int64_t tokens, int64_t heads, int64_t dim, const T* cos,
                 const T* signed_sin, T* out) {
  const int64_t half = dim / 2;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const T* row = x + t * token_stride + h * dim;
      T* to = out + (t * heads + h) * dim;
      for (int64_t d = 0; d < dim; ++d) {
        const T straight = row[d] * cos[t * dim + d];
        const T rolled = row[d < half ? d + half : d - half] * signed_sin[t * dim + d];
        to[d] = straight + rolled;
      }
    }
  }
}

// rope.apply_rotary: x * cos + roll(x, D/2) * signed_sin, for x [T, H, D] with contiguous heads
Tensor rotate(const Tensor& x, const Tensor& cos, const Tensor& signed_sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == dim && cos.is_contiguous() && signed_sin.is_contiguous(),
              "rotate: heads must be contiguous rows, cos and sin contiguous [T, 1, D]");
  Tensor out = at::empty({tokens, heads, dim}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotate", [&] {
    rotate_rows(x.const_data_ptr<scalar_t>(), x.stride(0), tokens, heads, dim, cos.const_data_ptr<scalar_t>(),
                signed_sin.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>());
  });
  return out;
}

struct ShortRows {  // the step's rows: every one short (CpuStep checks)
  Tensor slot_mapping, block_table;
  at::IntArrayRef seq_lens, query_lens;
};

struct Variant {  // a layer's attention as the Python layers pass it: scale, window (0: none), sinks, softcap (0: none)
  double scale;
  int64_t window;
  std::optional<Tensor> sinks;
  double softcap;
};

// fp32 values rounded to fp16 as ATen's .to(kHalf) rounds them (to nearest, ties to even)
void to_half(const float* from, int64_t count, c10::Half* to) {
  int64_t i = 0;
#if defined(__AVX__) && defined(__F16C__)
  for (; i + 8 <= count; i += 8) {
    const __m128i half = _mm256_cvtps_ph(_mm256_loadu_ps(from + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(to + i), half);
  }
#endif
  for (; i < count; ++i) to[i] = c10::Half(from[i]);
}

// cache's token slots[t] = rows[t] ([T, kv_heads, head_dim]): index_copy_'s result of the rows in the
// cache's dtype, written as one copy (or one fp32 -> fp16 rounding) per token where each token's heads
// are one contiguous run; ATen's index_copy_ otherwise
void store_rows(const Tensor& rows, const Tensor& cache, const Tensor& slots) {
  const int64_t kv_heads = cache.size(2), head_dim = cache.size(3), width = kv_heads * head_dim;
  const bool same = rows.scalar_type() == cache.scalar_type();
  const bool halved = rows.scalar_type() == at::kFloat && cache.scalar_type() == at::kHalf;
  const bool direct = (same || halved) && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                      cache.is_contiguous() && rows.stride(2) == 1 && rows.stride(1) == head_dim;
  if (!direct) {
    cache.view({-1, kv_heads, head_dim}).index_copy_(0, slots, rows.to(cache.scalar_type()));
    return;
  }
  const int64_t tokens = rows.size(0), cache_slots = cache.size(0) * cache.size(1);
  TORCH_CHECK(slots.numel() == tokens && rows.size(1) == kv_heads && rows.size(2) == head_dim,
              "short_step: one slot per token of [tokens, kv_heads, head_dim] rows");
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(0 <= slot[t] && slot[t] < cache_slots, "short_step: slot ", slot[t], " is outside the cache");
  }
  if (halved) {
    const float* from = rows.const_data_ptr<float>();
    auto* to = static_cast<c10::Half*>(cache.mutable_data_ptr());
    for (int64_t t = 0; t < tokens; ++t) to_half(from + t * rows.stride(0), width, to + slot[t] * width);
    return;
  }
  const int64_t bytes = width * rows.element_size();
  const auto* from = static_cast<const char*>(rows.const_data_ptr());
  auto* to = static_cast<char*>(cache.mutable_data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    std::memcpy(to + slot[t] * bytes, from + t * rows.stride(0) * rows.element_size(), bytes);
  }
}

// TorchAttentionBackend.forward over a cache it reads in place: store the step's keys and values,
// then radixserve::paged_attention over every row
Tensor attend(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& k_cache, const Tensor& v_cache,
              const ShortRows& s, const Variant& variant) {
  store_rows(k, k_cache, s.slot_mapping);
  store_rows(v, v_cache, s.slot_mapping);
  Tensor out = at::empty_like(q);
  radixserve::paged_attention(q, k_cache, v_cache, s.block_table, s.seq_lens, s.query_lens, variant.scale,
                              std::numeric_limits<int64_t>::max(), out, variant.window, variant.sinks,
                              variant.softcap);
  return out;
}

// shape: num_heads, num_kv_heads, head_dim, intermediate size; scales, windows, sinks, softcaps: each
// layer's attention (radixserve::paged_attention's arguments)
Tensor short_step(const Tensor& input_ids, const Tensor& embed, const Tensor& cos, const Tensor& signed_sin,
                  at::TensorList weights, const c10::List<std::optional<Tensor>>& biases, const Tensor& final_norm,
                  at::TensorList k_caches, at::TensorList v_caches, const Tensor& slot_mapping,
                  const Tensor& block_table, at::IntArrayRef seq_lens, at::IntArrayRef query_lens,
                  at::IntArrayRef shape, double eps, at::ArrayRef<double> scales, at::IntArrayRef windows,
                  const c10::List<std::optional<Tensor>>& sinks, at::ArrayRef<double> softcaps) {
  TORCH_CHECK(shape.size() == 4, "short_step: shape is num_heads, num_kv_heads, head_dim, intermediate size");
  TORCH_CHECK(input_ids.device().is_cpu() && embed.device().is_cpu(), "short_step: CPU tensors");
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kPerLayer * layers &&
                  static_cast<int64_t>(biases.size()) == kBiasesPerLayer * layers &&
                  static_cast<int64_t>(v_caches.size()) == layers,
              "short_step: weights, biases and caches do not match the layer count");
  TORCH_CHECK(static_cast<int64_t>(scales.size()) == layers && static_cast<int64_t>(windows.size()) == layers &&
                  static_cast<int64_t>(sinks.size()) == layers && static_cast<int64_t>(softcaps.size()) == layers,
              "short_step: one scale, window, sinks and softcap per layer");
  const int64_t heads = shape[0], kv_heads = shape[1], head_dim = shape[2], intermediate = shape[3];
  const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim, hidden = final_norm.numel();
  const ShortRows rows{slot_mapping, block_table, seq_lens, query_lens};

  // a GGUF model's embedding is packed (uint8) like its projections: looked up row by row
  Tensor x = embed.scalar_type() == at::kByte ? radixserve::ggml_rows(embed, input_ids.reshape(-1))
                                              : at::embedding(embed, input_ids);
  const int64_t tokens_in_step = x.size(0);
  std::optional<Tensor> residual;
  auto norm = [&](const Tensor& h, const Tensor& weight) {
    radixserve::NormedRows normed = radixserve::add_rms_norm(h, residual, weight, eps);
    residual = normed.residual;
    return normed.out;
  };
  for (int64_t l = 0; l < layers; ++l) {
    const Tensor* w = weights.data() + kPerLayer * l;
    auto bias = [&](int64_t i) { return biases.get(kBiasesPerLayer * l + i); };
    Tensor h = norm(x, w[0]);
    auto qkv = linear(h, w[1], bias(0), q_size + 2 * kv_size).split_with_sizes({q_size, kv_size, kv_size}, -1);
    Tensor q = rotate(qkv[0].reshape({tokens_in_step, heads, head_dim}), cos, signed_sin);
    Tensor k = rotate(qkv[1].reshape({tokens_in_step, kv_heads, head_dim}), cos, signed_sin);
    Tensor v = qkv[2].reshape({tokens_in_step, kv_heads, head_dim});  // stored as it lies
    Tensor attended = attend(q, k, v, k_caches[l], v_caches[l], rows, {scales[l], windows[l], sinks.get(l), softcaps[l]});
    h = linear(attended.reshape({tokens_in_step, q_size}), w[2], bias(1), hidden);
    h = norm(h, w[3]);
    x = linear(radixserve::silu_and_mul(linear(h, w[4], bias(2), 2 * intermediate)), w[5], bias(3), hidden);
  }
  return norm(x, final_norm);
}

}  // namespace

TORCH_LIBRARY(radixserve, m) {
  m.def("short_step(Tensor input_ids, Tensor embed, Tensor cos, Tensor signed_sin, Tensor[] weights, "
        "Tensor?[] biases, Tensor final_norm, Tensor[] k_caches, Tensor[] v_caches, Tensor slot_mapping, "
        "Tensor block_table, int[] seq_lens, int[] query_lens, int[] shape, float eps, float[] scales, int[] windows, "
        "Tensor?[] sinks, float[] softcaps) -> Tensor",
        short_step);
}
