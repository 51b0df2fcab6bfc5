// The gated delta rule of Gated DeltaNet layers (Qwen3.5) on CPU, for every item of a step in one
// call: `radixserve::gated_delta_rule` (model/delta_net.py).
//
// Why C++: the rule is a recurrence, token after token, over a [key_dim, value_dim] state per head.
// In torch each token is ~6 operators per layer; here each (item, head) is one task that keeps its
// state in cache and makes two passes over it per token: (1) decay the state and read what it
// holds for the token's key, (2) write the correction and read the output for its query.
//
// Layouts: q, k [T, H, dk] and v [T, H, dv] (fp32, q already L2-normed and scaled, k L2-normed, key
// heads repeated over the value heads); beta and decay [T, H]; states [S, H, dk, dv] fp32, updated in
// place at each item's slot; out [T, H, dv]. Item b owns tokens cu[b] .. cu[b] + query_lens[b] and
// starts from zeros when fresh[b], else from its slot.
//
// Invariant: a token's result depends only on its own item's tokens and state: each (item, head) is
// computed by one thread in token order, each output a fixed-order sum over the key dimension, so
// it is the same whatever the other items of the call and the thread count.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_kernels.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace radixserve {
namespace {

using at::Tensor;

void one_head(float* state, const float* q, const float* k, const float* v, const float* beta, const float* decay,
              float* out, int64_t tokens, int64_t heads, int64_t dk, int64_t dv) {
  std::vector<float> read(dv), update(dv);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* qt = q + t * heads * dk;
    const float* kt = k + t * heads * dk;
    const float* vt = v + t * heads * dv;
    float* ot = out + t * heads * dv;
    const float g = decay[t * heads];
    const float b = beta[t * heads];
    std::fill(read.begin(), read.end(), 0.0f);
    for (int64_t i = 0; i < dk; ++i) {
      float* row = state + i * dv;
      const float ki = kt[i];
      for (int64_t j = 0; j < dv; ++j) {
        row[j] *= g;
        read[j] += row[j] * ki;
      }
    }
    for (int64_t j = 0; j < dv; ++j) update[j] = (vt[j] - read[j]) * b;
    std::fill(ot, ot + dv, 0.0f);
    for (int64_t i = 0; i < dk; ++i) {
      float* row = state + i * dv;
      const float ki = kt[i];
      const float qi = qt[i];
      for (int64_t j = 0; j < dv; ++j) {
        row[j] += ki * update[j];
        ot[j] += row[j] * qi;
      }
    }
  }
}

}  // namespace

void gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta, const Tensor& decay,
                      Tensor& states, at::IntArrayRef slots, at::IntArrayRef query_lens, at::IntArrayRef fresh,
                      Tensor& out) {
  check_fp32_contiguous("gated_delta_rule", {&q, &k, &v, &beta, &decay, &states, &out});
  const int64_t heads = v.size(1), dk = q.size(2), dv = v.size(2);
  TORCH_CHECK(states.dim() == 4 && states.size(1) == heads && states.size(2) == dk && states.size(3) == dv,
              "gated_delta_rule: states must be [slots, heads, key_dim, value_dim]");
  const std::vector<int64_t> first = item_starts("gated_delta_rule", slots, query_lens, fresh, states.size(0), q.size(0));
  const float *qp = q.const_data_ptr<float>(), *kp = k.const_data_ptr<float>(), *vp = v.const_data_ptr<float>();
  const float *bp = beta.const_data_ptr<float>(), *gp = decay.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_each_item_head(first, slots, fresh, heads, states.data_ptr<float>(), dk * dv,
                     [&](int64_t b, int64_t h, int64_t t0, float* s) {
                       one_head(s, qp + (t0 * heads + h) * dk, kp + (t0 * heads + h) * dk, vp + (t0 * heads + h) * dv,
                                bp + t0 * heads + h, gp + t0 * heads + h, op + (t0 * heads + h) * dv, query_lens[b],
                                heads, dk, dv);
                     });
}

}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor beta, Tensor decay, Tensor(a!) states, int[] slots, "
        "int[] query_lens, int[] fresh, Tensor(b!) out) -> ()",
        radixserve::gated_delta_rule);
}
