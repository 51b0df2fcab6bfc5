// The CPU decode step's layers in one call: `radixserve::short_step` runs every decoder layer of a
// step whose rows are all short (decodes and verifications of drafts) and returns the final-normed
// hidden states.
//
// Why: on CPU a batch-1 step of the 135M model is ~120 GEMVs and ~900 small ops. Issued from
// Python each small op costs several microseconds of interpreter and binding time, far more than
// its arithmetic; issued from here it costs the dispatcher's fraction of that.
//
// Invariant: its result equals the Python path's bit for bit (model/llama.py, model/ops.py TorchOps,
// model/rope.py, model/attention.py's short rows, model/cpu_linear.py). The matmuls, attention,
// reductions and transcendentals are the very ATen operators that path calls, with the same
// arguments; the residual add, the norm's scaling and rotary are loops doing its elementwise
// arithmetic with its rounding (below). A change to one is a change to both;
// tests/test_cpu_compiled_step.py compares them with torch.equal in fp32 and bf16.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

namespace {

using at::Tensor;

constexpr int64_t kMinRows = 4;       // cpu_linear.MIN_ROWS: fewer rows are padded to this many
constexpr int64_t kPerLayer = 6;      // weights per layer, in `CpuStep.layer_weights` order
constexpr int64_t kBiasesPerLayer = 4;

// mkldnn::_linear_pointwise on a weight cpu_linear.PackedLinear packed, rows padded as it pads them
Tensor packed_linear(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias, const Tensor& pad) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, c10::string_view,
                        c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  static const c10::List<std::optional<at::Scalar>> no_scalars;
  const int64_t rows = x.size(0);
  if (rows > 0 && rows < kMinRows) {
    pad.narrow(0, 0, rows).copy_(x);
    return op.call(pad, weight, bias, "none", no_scalars, "").narrow(0, 0, rows);
  }
  return op.call(x, weight, bias, "none", no_scalars, "");
}

// The elementwise steps are written out below: each is one IEEE operation per element, rounded to
// the tensor's dtype after each, as ATen's elementwise kernels round (bf16: computed in float, then
// rounded to nearest even, which is what c10::BFloat16's operators do). The build passes
// -ffp-contract=off so that no multiply and add are fused into one rounding. Reductions (the norm's
// mean) and transcendentals (rsqrt, SiLU's exp) stay ATen's: their order of summation and their
// approximations are its own.

template <typename T>
void add_and_square(const T* x, const T* residual, T* sum, float* squares, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    sum[i] = x[i] + residual[i];
    const float value = static_cast<float>(sum[i]);
    squares[i] = value * value;
  }
}

template <typename T>
void scale_rows(const T* x, const float* inverse_rms, const T* weight, T* out, int64_t rows, int64_t dim) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < dim; ++d) {
      const T normed = static_cast<T>(static_cast<float>(x[r * dim + d]) * inverse_rms[r]);
      out[r * dim + d] = weight[d] * normed;
    }
  }
}

// TorchOps.add_rms_norm (ops.rms_norm): the new residual (x + residual; x at the first layer) and
// weight * (r * rsqrt(mean(r^2) + eps)) with r in float
struct Normed {
  Tensor out, residual;
};
Normed add_rms_norm(const Tensor& x, const std::optional<Tensor>& residual, const Tensor& weight, double eps) {
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  const Tensor input = x.contiguous();
  const Tensor sum = residual ? at::empty_like(input) : input;
  Tensor squares = at::empty({rows, dim}, x.options().dtype(at::kFloat));
  if (residual) {
    const Tensor previous = residual->contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_and_square", [&] {
      add_and_square(input.const_data_ptr<scalar_t>(), previous.const_data_ptr<scalar_t>(),
                     sum.mutable_data_ptr<scalar_t>(), squares.mutable_data_ptr<float>(), rows * dim);
    });
  } else {
    squares.copy_(sum.view({rows, dim}).to(at::kFloat)).mul_(squares);  // pow(2) is x * x
  }
  const Tensor inverse_rms = at::rsqrt(squares.mean(-1, /*keepdim=*/true) + eps).contiguous();
  Tensor out = at::empty_like(sum);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "scale_rows", [&] {
    scale_rows(sum.const_data_ptr<scalar_t>(), inverse_rms.const_data_ptr<float>(),
               weight.contiguous().const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), rows, dim);
  });
  return {out, sum};
}

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

struct ShortRows {  // attention._ShortPlan and the step's gather buffers
  Tensor slot_mapping, blocks, mask, real, targets, k_buffer, v_buffer;
  std::optional<Tensor> tokens;
  int64_t rows, width, max_len;
};

// TorchAttentionBackend.forward when every row is short: store, gather whole blocks, one SDPA call
Tensor attend(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& k_cache, const Tensor& v_cache,
              const ShortRows& s, double scale) {
  const int64_t kv_heads = k_cache.size(2), head_dim = k_cache.size(3);
  k_cache.view({-1, kv_heads, head_dim}).index_copy_(0, s.slot_mapping, k.to(k_cache.scalar_type()));
  v_cache.view({-1, kv_heads, head_dim}).index_copy_(0, s.slot_mapping, v.to(v_cache.scalar_type()));
  auto gather = [&](const Tensor& cache, const Tensor& buffer) {
    Tensor rows = at::index_select_out(const_cast<Tensor&>(buffer), cache, 0, s.blocks);
    return rows.view({s.rows, -1, kv_heads, head_dim}).narrow(1, 0, s.max_len).to(q.scalar_type());
  };
  Tensor keys = gather(k_cache, s.k_buffer), vals = gather(v_cache, s.v_buffer);
  Tensor qs = s.tokens ? q.index_select(0, *s.tokens) : q;
  qs = qs.view({s.rows, s.width, q.size(1), q.size(2)}).transpose(1, 2);
  Tensor o = at::scaled_dot_product_attention(qs, keys.transpose(1, 2), vals.transpose(1, 2), s.mask, 0.0,
                                              /*is_causal=*/false, scale, /*enable_gqa=*/true)
                 .transpose(1, 2)
                 .reshape({s.rows * s.width, q.size(1), q.size(2)});
  if (!s.tokens) return o;  // already q's rows in order (the reshape of the transposed output copies)
  Tensor out = at::empty_like(q);
  out.index_copy_(0, s.targets, o.index_select(0, s.real));
  return out;
}

// shape: num_heads, num_kv_heads, head_dim, rows, width, max_len
Tensor short_step(const Tensor& input_ids, const Tensor& embed, const Tensor& cos, const Tensor& signed_sin,
                  at::TensorList weights, const c10::List<std::optional<Tensor>>& biases, const Tensor& final_norm,
                  at::TensorList k_caches, at::TensorList v_caches, const Tensor& slot_mapping, const Tensor& blocks,
                  const Tensor& mask, const std::optional<Tensor>& tokens, const Tensor& real, const Tensor& targets,
                  const Tensor& k_buffer, const Tensor& v_buffer, at::TensorList pads, at::IntArrayRef shape,
                  double eps, double scale) {
  TORCH_CHECK(shape.size() == 6, "short_step: shape is num_heads, num_kv_heads, head_dim, rows, width, max_len");
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kPerLayer * layers &&
                  static_cast<int64_t>(biases.size()) == kBiasesPerLayer * layers &&
                  static_cast<int64_t>(v_caches.size()) == layers && pads.size() == 3,
              "short_step: weights, biases, caches and pads do not match the layer count");
  const int64_t heads = shape[0], kv_heads = shape[1], head_dim = shape[2];
  const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  const ShortRows rows{slot_mapping, blocks, mask, real, targets, k_buffer, v_buffer, tokens,
                       shape[3], shape[4], shape[5]};
  const Tensor &pad_hidden = pads[0], &pad_attention = pads[1], &pad_mlp = pads[2];

  Tensor x = at::embedding(embed, input_ids);
  const int64_t tokens_in_step = x.size(0);
  std::optional<Tensor> residual;
  auto norm = [&](const Tensor& h, const Tensor& weight) {
    Normed normed = add_rms_norm(h, residual, weight, eps);
    residual = normed.residual;
    return normed.out;
  };
  for (int64_t l = 0; l < layers; ++l) {
    const Tensor* w = weights.data() + kPerLayer * l;
    auto bias = [&](int64_t i) { return biases.get(kBiasesPerLayer * l + i); };
    Tensor h = norm(x, w[0]);
    auto qkv = packed_linear(h, w[1], bias(0), pad_hidden).split_with_sizes({q_size, kv_size, kv_size}, -1);
    Tensor q = rotate(qkv[0].reshape({tokens_in_step, heads, head_dim}), cos, signed_sin);
    Tensor k = rotate(qkv[1].reshape({tokens_in_step, kv_heads, head_dim}), cos, signed_sin);
    Tensor v = qkv[2].reshape({tokens_in_step, kv_heads, head_dim}).contiguous();
    Tensor attended = attend(q, k, v, k_caches[l], v_caches[l], rows, scale);
    h = packed_linear(attended.reshape({tokens_in_step, q_size}), w[2], bias(1), pad_attention);
    h = norm(h, w[3]);
    auto gate_up = packed_linear(h, w[4], bias(2), pad_hidden).chunk(2, -1);
    x = packed_linear(at::silu(gate_up[0]) * gate_up[1], w[5], bias(3), pad_mlp);
  }
  return norm(x, final_norm);
}

}  // namespace

TORCH_LIBRARY(radixserve, m) {
  m.def("short_step(Tensor input_ids, Tensor embed, Tensor cos, Tensor signed_sin, Tensor[] weights, "
        "Tensor?[] biases, Tensor final_norm, Tensor[] k_caches, Tensor[] v_caches, Tensor slot_mapping, "
        "Tensor blocks, Tensor mask, Tensor? tokens, Tensor real, Tensor targets, Tensor k_buffer, "
        "Tensor v_buffer, Tensor[] pads, int[] shape, float eps, float scale) -> Tensor",
        short_step);
}
