// The selective scan of Mamba2 layers (Nemotron-H, Granite 4, Falcon-H1) on CPU, for every item of a
// step in one call: `radixserve::mamba2_scan` (model/mamba2.py).
//
// Why C++: the scan is a recurrence over a [head_dim, state_size] state per head. torch runs a
// prefill as the chunked (state-space dual) form, a dozen operators per chunk and layer that took
// about a fifth of a Granite 4 prefill (docs/bench/hybrid.md); here each (item, head) is one task
// that keeps its state in cache and passes over it once per token:
//   S[p, n] <- exp(decay) S[p, n] + (dt x[p]) B[n];   y[p] = sum_n S[p, n] C[n]
//
// Layouts (fp32, contiguous): x [T, H, P]; dt and decay (dt * A, the log of the step's decay) [T, H];
// B and C [T, G, N], group g shared by heads g * H/G .. (g + 1) * H/G - 1; states [S, H, P, N],
// updated in place at each item's slot; out [T, H, P] (without the D skip). Item b owns tokens
// cu[b] .. cu[b] + query_lens[b] and starts from zeros when fresh[b], else from its slot.
//
// Invariant: a token's result depends only on its own item's tokens and state, in the order the
// recurrence states: each (item, head) is computed by one thread in token order, each output a
// fixed-order sum over the state dimension, so it is the same whatever the other items of the call,
// the thread count, and however a prompt was split into chunks.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_kernels.h"

#include <cmath>
#include <cstring>
#include <vector>

namespace radixserve {
namespace {

using at::Tensor;

// One head's tokens: the state's rows in lanes of 16 (a scalar tail past the last whole lane), each
// element updated as fma(decay, S, input * B) and the output a lane-wise fma chain over the state
// dimension summed in `sum_lanes`' fixed order.
void one_head(float* state, const float* x, const float* dt, const float* decay, const float* b, const float* c,
              float* out, int64_t tokens, int64_t heads, int64_t groups, int64_t p_dim, int64_t n_dim) {
  const int64_t whole = n_dim / kLanes * kLanes;
  for (int64_t t = 0; t < tokens; ++t) {
    const float g = std::exp(decay[t * heads]);
    const float step = dt[t * heads];
    const float* xt = x + t * heads * p_dim;
    const float* bt = b + t * groups * n_dim;
    const float* ct = c + t * groups * n_dim;
    float* ot = out + t * heads * p_dim;
    for (int64_t p = 0; p < p_dim; ++p) {
      float* row = state + p * n_dim;
      const float input = step * xt[p];
      Lanes acc = zero_lanes();
      for (int64_t n = 0; n < whole; n += kLanes) {
        const Lanes updated = fused_multiply_add(g, load_lanes(row + n),
                                                 fused_multiply_add(input, load_lanes(bt + n), zero_lanes()));
        store_lanes(row + n, updated);
        acc = fused_multiply_add(updated, load_lanes(ct + n), acc);
      }
      float sum = sum_lanes(acc);
      for (int64_t n = whole; n < n_dim; ++n) {
        row[n] = std::fma(g, row[n], input * bt[n]);
        sum = std::fma(row[n], ct[n], sum);
      }
      ot[p] = sum;
    }
  }
}

}  // namespace

void mamba2_scan(const Tensor& x, const Tensor& dt, const Tensor& decay, const Tensor& b, const Tensor& c,
                 Tensor& states, at::IntArrayRef slots, at::IntArrayRef query_lens, at::IntArrayRef fresh,
                 Tensor& out) {
  check_fp32_contiguous("mamba2_scan", {&x, &dt, &decay, &b, &c, &states, &out});
  const int64_t heads = x.size(1), p_dim = x.size(2), groups = b.size(1), n_dim = b.size(2);
  TORCH_CHECK(groups > 0 && heads % groups == 0 && c.sizes() == b.sizes() && b.size(0) == x.size(0),
              "mamba2_scan: B and C [T, groups, state_size], groups dividing the heads");
  TORCH_CHECK(states.dim() == 4 && states.size(1) == heads && states.size(2) == p_dim && states.size(3) == n_dim,
              "mamba2_scan: states must be [slots, heads, head_dim, state_size]");
  const std::vector<int64_t> first = item_starts("mamba2_scan", slots, query_lens, fresh, states.size(0), x.size(0));
  const float *xp = x.const_data_ptr<float>(), *dtp = dt.const_data_ptr<float>(), *gp = decay.const_data_ptr<float>();
  const float *bp = b.const_data_ptr<float>(), *cp = c.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t per_group = heads / groups;
  for_each_item_head(first, slots, fresh, heads, states.data_ptr<float>(), p_dim * n_dim,
                     [&](int64_t i, int64_t h, int64_t t0, float* s) {
                       const int64_t g = h / per_group;
                       one_head(s, xp + (t0 * heads + h) * p_dim, dtp + t0 * heads + h, gp + t0 * heads + h,
                                bp + (t0 * groups + g) * n_dim, cp + (t0 * groups + g) * n_dim,
                                op + (t0 * heads + h) * p_dim, query_lens[i], heads, groups, p_dim, n_dim);
                     });
}

}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("mamba2_scan(Tensor x, Tensor dt, Tensor decay, Tensor b, Tensor c, Tensor(a!) states, int[] slots, "
        "int[] query_lens, int[] fresh, Tensor(b!) out) -> ()",
        radixserve::mamba2_scan);
}
