// The decoder layer's elementwise operations on CPU: residual add + RMSNorm, and SiLU-and-mul of the
// packed gate/up projection (cpu_kernels.h declares them).
//
// Why here: the compiled step (cpu_step.cpp) and the Python layers (model/ops.py CpuKernelOps) must
// round alike, so that a token's result does not depend on which path its step took. Both call
// these loops, so the step needs no ATen reduction or activation (it called ATen's sum and SiLU ~90
// times per batch-1 step to match the Python path).
//
// Invariant: a row's result depends on that row alone: the sum of squares runs in one fixed order
// (16 lanes of fused multiply-adds over the row, the lanes then summed by sum_lanes), whatever the
// row count or the thread count, and every other step is one rounding per element in the tensor's
// dtype, in the order the HF models write them (the sum rounded to the dtype; the normed value
// rounded to the dtype before the weight multiplies it; SiLU rounded to the dtype before the
// product).

#include "cpu_kernels.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace radixserve {
namespace {

using at::Tensor;

constexpr int64_t kElementsPerTask = 16384;  // a parallel task's share: decode rows run inline

template <typename T>
void load_floats(const T* from, int64_t count, float (&to)[kLanes]) {
  for (int64_t i = 0; i < kLanes; ++i) to[i] = i < count ? static_cast<float>(from[i]) : 0.0f;
}

// sum[i] = x[i] + residual[i] in T (x where there is none), then each row normed into out
template <typename T>
void add_rms_norm_rows(const T* x, const T* residual, const T* weight, T* sum, T* out, int64_t rows, int64_t dim,
                       float eps) {
  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(1, dim));
  at::parallel_for(0, rows, grain, [&](int64_t first, int64_t end) {
    for (int64_t r = first; r < end; ++r) {
      const T* row_x = x + r * dim;
      T* row_sum = sum + r * dim;
      if (residual != nullptr) {
        const T* row_residual = residual + r * dim;
        for (int64_t d = 0; d < dim; ++d) row_sum[d] = row_x[d] + row_residual[d];
      }
      const T* values = residual != nullptr ? row_sum : row_x;
      Lanes squares = zero_lanes();
      for (int64_t d = 0; d < dim; d += kLanes) {
        float chunk[kLanes];
        load_floats(values + d, dim - d, chunk);
        const Lanes lanes = load_lanes(chunk);
        squares = fused_multiply_add(lanes, lanes, squares);
      }
      const float inverse_rms = 1.0f / std::sqrt(sum_lanes(squares) / static_cast<float>(dim) + eps);
      T* row_out = out + r * dim;
      for (int64_t d = 0; d < dim; ++d) {
        const T normed = static_cast<T>(static_cast<float>(values[d]) * inverse_rms);
        row_out[d] = weight[d] * normed;
      }
    }
  });
}

// silu(g) = g / (1 + e^-g), from e = e^-|g| <= 1 either way (g e / (1 + e) below zero), so that no
// exponential overflows; 0 where g is below e^x's range, and NaN at -inf, as torch's SiLU gives it
inline Lanes silu_lanes(const Lanes& g) {
  Lanes out;
  for (int p = 0; p < kParts; ++p) {
    const Native value = g.part[p];
    const NativeInt negative = value < 0.0f;
    const Native magnitude = bits_as<Native>(bits_as<NativeInt>(value) & ~bits_as<NativeInt>(broadcast_native(-0.0f)));
    const Native e = exp_native(-magnitude);
    const Native one = broadcast_native(1.0f);
    const Native positive_form = value / (one + e), negative_form = value * e / (one + e);
    const NativeInt vanished = (value < kMinExponent) & (value > -std::numeric_limits<float>::infinity());
    const Native chosen = bits_as<Native>((negative & bits_as<NativeInt>(negative_form)) |
                                          (~negative & bits_as<NativeInt>(positive_form)));
    out.part[p] = bits_as<Native>(bits_as<NativeInt>(chosen) & ~vanished);
  }
  return out;
}

template <typename T>
void silu_and_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t n) {
  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(1, n));
  at::parallel_for(0, rows, grain, [&](int64_t first, int64_t end) {
    for (int64_t r = first; r < end; ++r) {
      const T* gate = gate_up + r * 2 * n;
      const T* up = gate + n;
      T* to = out + r * n;
      for (int64_t i = 0; i < n; i += kLanes) {
        const int64_t count = std::min(kLanes, n - i);
        float values[kLanes], activated[kLanes];
        load_floats(gate + i, count, values);
        store_lanes(activated, silu_lanes(load_lanes(values)));
        for (int64_t j = 0; j < count; ++j) to[i + j] = static_cast<T>(activated[j]) * up[i + j];
      }
    }
  });
}

}  // namespace

NormedRows add_rms_norm(const Tensor& x, const std::optional<Tensor>& residual, const Tensor& weight, double eps) {
  const int64_t dim = x.size(-1);
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && (!residual || residual->device().is_cpu()),
              "add_rms_norm: CPU tensors");
  TORCH_CHECK(weight.dim() == 1 && weight.numel() == dim && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: a weight of ", dim, " values in x's dtype");
  TORCH_CHECK(!residual || (residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type()),
              "add_rms_norm: a residual like x");
  const Tensor input = x.contiguous(), scale = weight.contiguous();
  const Tensor previous = residual ? residual->contiguous() : Tensor();
  const Tensor sum = residual ? at::empty_like(input) : input;
  Tensor out = at::empty_like(input);
  const int64_t rows = dim == 0 ? 0 : input.numel() / dim;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_rows(input.const_data_ptr<scalar_t>(), residual ? previous.const_data_ptr<scalar_t>() : nullptr,
                      scale.const_data_ptr<scalar_t>(), residual ? sum.mutable_data_ptr<scalar_t>() : nullptr,
                      out.mutable_data_ptr<scalar_t>(), rows, dim, static_cast<float>(eps));
  });
  return {out, sum};
}

Tensor silu_and_mul(const Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "silu_and_mul: a CPU tensor whose last dimension is gate and up side by side");
  const Tensor input = gate_up.contiguous();
  const int64_t n = input.size(-1) / 2;
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = n;
  Tensor out = at::empty(shape, input.options());
  const int64_t rows = n == 0 ? 0 : input.numel() / (2 * n);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows(input.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), rows, n);
  });
  return out;
}

}  // namespace radixserve

namespace {

std::tuple<at::Tensor, at::Tensor> add_rms_norm_op(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                   const at::Tensor& weight, double eps) {
  radixserve::NormedRows normed = radixserve::add_rms_norm(x, residual, weight, eps);
  return {normed.out, normed.residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)", add_rms_norm_op);
  m.def("silu_and_mul(Tensor gate_up) -> Tensor", radixserve::silu_and_mul);
}
