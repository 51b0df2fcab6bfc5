// The routed experts of a mixture-of-experts layer on CPU, in one call: `radixserve::moe_experts`
// (kernels/moe.py: `PackedExperts`, `routed_experts`).
//
// Why one call: a decode step routes each token to k of E experts, so a step of 16 tokens runs
// ~30 experts of a few rows each. Issued from Python that is ~10 operators per expert; here it is
// three parallel passes whatever the count: (1) every routed expert's gate and up projections with
// the activation applied as each tile finishes, (2) every routed expert's down projection times the
// routing weight, (3) each token's sum over its k experts. A pass splits the experts' weight tiles
// between the threads, so each thread streams its contiguous share of the routed experts' weights
// (the bytes a decode step is bound by) and no expert's weights are read by two threads.
//
// Layouts (built by moe.py `pack_experts`): gate_up [E, Ip/16, H, 32], tile j holding, for each
// input column, gate outputs 16j..16j+15 then up outputs 16j..16j+15; down [E, Hp/32, Ip, 32],
// tile b holding outputs 32b..32b+31; fp32 or bf16. Ip is the intermediate size and Hp the hidden
// size rounded up to 16 and 32; padded weights and biases are zero, so padded activations are zero
// (every supported activation maps gate = up = 0 to 0). An ungated expert (relu2: relu(up)^2,
// Nemotron-H) has no gate rows: its gate_up tile j holds up outputs 32j..32j+31, as a down tile does,
// and Ip is rounded up to 32.
//
// Invariant: every value of a token's result is computed by the same operations in the same order
// whatever the other tokens of the call and the thread count: each projection output is one fp32
// chain of multiply-adds over its inputs in ascending order, then + bias; the activation is scalar
// fp32 arithmetic per element; the down output is (chain + bias) * weight; the token's sum adds its
// k experts in k order, in fp32, rounded once to x's dtype. So a token's result is the same alone,
// in a decode batch or in a prefill chunk (batch invariance, bit for bit).

#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace radixserve {
namespace {

using at::Tensor;

constexpr int64_t kTileWidth = 2 * kLanes;  // outputs of one weight tile: two 16-lane halves
// rows per register tile: 2 halves x kParts vectors per row, plus the two weight halves and a
// broadcast input in the registers (AVX-512: 6 rows, 12 accumulators; AVX2 and NEON: 2; SSE: 1)
constexpr int64_t kTileRows =
    std::clamp<int64_t>((kVectorRegisters - 2 * kParts - 1) / (2 * kParts), 1, 6);
constexpr int64_t kChunkRows = 48;  // rows whose inputs stay in cache while a thread walks its tiles
// A tile of up to this many row passes costs about what streaming its weights costs (the passes after
// the first read the weights from cache); threads are given equal shares of that cost.
constexpr int64_t kStreamedPasses = 4;

enum Activation : int64_t { kSilu = 0, kGeluTanh = 1, kClampedSwiglu = 2, kRelu2 = 3 };  // moe.py ACTIVATION_CODES

struct ActivationParams {
  int64_t kind;
  float alpha;
  float limit;
};

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// gate and up (fp32, bias added) -> the gated activation. gelu_tanh's 0.5 g (1 + tanh(z)) is written
// g * sigmoid(2z), the same function without the cancellation of 1 + tanh near z = -inf.
inline float activate(float gate, float up, const ActivationParams& p) {
  switch (p.kind) {
    case kSilu:
      return gate * sigmoid(gate) * up;
    case kGeluTanh: {
      const float z = 0.7978845608028654f * (gate + 0.044715f * gate * gate * gate);
      return gate * sigmoid(2.0f * z) * up;
    }
    default: {
      const float g = std::min(gate, p.limit);
      const float u = std::min(std::max(up, -p.limit), p.limit);
      return g * sigmoid(p.alpha * g) * (u + 1.0f);
    }
  }
}

// A weight tile's 16 values as fp32: bf16 bits widened exactly. On AVX-512 one widening load per 16
// values: GCC compiles the header's portable form there as two 8-value halves and a shuffle, whose
// extra instructions leave fewer of the stream's loads in flight.
inline Lanes load_weights(const float* w) { return load_lanes(w); }

inline Lanes load_weights(const uint16_t* w) {
#if defined(__AVX512F__)
  Lanes v;
  v.part[0] = bits_as<Native>(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w))), 16));
  return v;
#else
  return load_lanes(w);
#endif
}

// For a weight tile [in, 32] and Rows rows of `in` inputs: epilogue(r, low, high) with low/high[l] =
// the sum over k ascending of x[r][k] * w[k][l] / w[k][16 + l]. Inlined into each epilogue's caller:
// otherwise GCC keeps an accumulator in memory, a store and a load on each step's dependency chain.
template <int Rows, typename W, typename Epilogue>
__attribute__((always_inline)) inline void tile(const W* w, const float* x, int64_t in, const Epilogue& epilogue) {
  Lanes acc[Rows][2] = {};
  for (int64_t k = 0; k < in; ++k) {
    const Lanes low = load_weights(w + k * kTileWidth), high = load_weights(w + k * kTileWidth + kLanes);
    for (int r = 0; r < Rows; ++r) {
      const float value = x[r * in + k];
      acc[r][0] = fused_multiply_add(value, low, acc[r][0]);
      acc[r][1] = fused_multiply_add(value, high, acc[r][1]);
    }
  }
  for (int r = 0; r < Rows; ++r) epilogue(r, acc[r][0], acc[r][1]);
}

// One gate/up tile j for Rows rows: act[r][16j + l] = activation(gate + bias, up + bias)
template <int Rows, typename W>
void gate_up_tile(const W* w, const float* x, int64_t in, const float* bias, float* act, int64_t act_stride,
                  const ActivationParams& params) {
  tile<Rows>(w, x, in, [&](int r, const Lanes& gate_sum, const Lanes& up_sum) {
    float gate[kLanes], up[kLanes];
    store_lanes(gate, bias ? gate_sum + load_lanes(bias) : gate_sum);
    store_lanes(up, bias ? up_sum + load_lanes(bias + kLanes) : up_sum);
    for (int64_t l = 0; l < kLanes; ++l) act[r * act_stride + l] = activate(gate[l], up[l], params);
  });
}

// One ungated up tile j for Rows rows: act[r][32j + l] = relu(up + bias)^2
template <int Rows, typename W>
void up_tile(const W* w, const float* x, int64_t in, const float* bias, float* act, int64_t act_stride) {
  tile<Rows>(w, x, in, [&](int r, const Lanes& low_sum, const Lanes& high_sum) {
    float up[kTileWidth];
    store_lanes(up, bias ? low_sum + load_lanes(bias) : low_sum);
    store_lanes(up + kLanes, bias ? high_sum + load_lanes(bias + kLanes) : high_sum);
    for (int64_t l = 0; l < kTileWidth; ++l) {
      const float relu = std::max(up[l], 0.0f);
      act[r * act_stride + l] = relu * relu;
    }
  });
}

// One down tile b for Rows rows: out_rows[r][32b + l] = (sum + bias) * weights[r]
template <int Rows, typename W>
void down_tile(const W* w, const float* x, int64_t in, const float* bias, float* const* out_rows,
               const float* weights) {
  tile<Rows>(w, x, in, [&](int r, const Lanes& low_sum, const Lanes& high_sum) {
    const Native scale = broadcast_native(weights[r]);
    Lanes low = bias ? low_sum + load_lanes(bias) : low_sum;
    Lanes high = bias ? high_sum + load_lanes(bias + kLanes) : high_sum;
    for (int p = 0; p < kParts; ++p) {
      low.part[p] *= scale;
      high.part[p] *= scale;
    }
    store_lanes(out_rows[r], low);
    store_lanes(out_rows[r] + kLanes, high);
  });
}

// tile.template operator()<Rows>() for 1 <= rows <= kTileRows
template <typename Tile>
void by_rows(int64_t rows, const Tile& tile) {
  constexpr auto at_most = [](int64_t n) { return static_cast<int>(std::min(n, kTileRows)); };
  switch (rows) {
    case 1: return tile.template operator()<1>();
    case 2: return tile.template operator()<at_most(2)>();
    case 3: return tile.template operator()<at_most(3)>();
    case 4: return tile.template operator()<at_most(4)>();
    case 5: return tile.template operator()<at_most(5)>();
    default: return tile.template operator()<at_most(6)>();
  }
}

// The routed experts' (expert, tile) pairs split between the threads: thread i takes items
// [bounds[i], bounds[i + 1]) of the expert-major, tile-minor order, in shares of equal cost.
struct Work {
  std::vector<int64_t> experts;  // the routed experts, ascending
  std::vector<int64_t> bounds;
};

Work split_work(const std::vector<int64_t>& counts, int64_t tiles) {
  Work work;
  std::vector<int64_t> cost;  // per routed expert, of each of its tiles
  int64_t total = 0;
  for (int64_t e = 0; e < static_cast<int64_t>(counts.size()); ++e) {
    if (!counts[e]) continue;
    work.experts.push_back(e);
    cost.push_back(std::max<int64_t>(kStreamedPasses, (counts[e] + kTileRows - 1) / kTileRows));
    total += cost.back() * tiles;
  }
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(),
                                                                 static_cast<int64_t>(work.experts.size()) * tiles));
  work.bounds.assign(threads + 1, static_cast<int64_t>(work.experts.size()) * tiles);
  work.bounds[0] = 0;
  int64_t item = 0, spent = 0;
  for (int64_t i = 1; i < threads; ++i) {
    const int64_t target = total * i / threads;
    while (item < static_cast<int64_t>(work.experts.size()) * tiles && spent + cost[item / tiles] <= target) {
      spent += cost[item / tiles];
      ++item;
    }
    work.bounds[i] = item;
  }
  return work;
}

// Runs visit(expert index into work.experts, first tile, end tile, first row, end row) over each
// thread's share, expert by expert, in chunks of rows that stay in cache while the tiles stream.
template <typename Visit>
void for_each_share(const Work& work, int64_t tiles, const std::vector<int64_t>& counts, const Visit& visit) {
  const int64_t threads = static_cast<int64_t>(work.bounds.size()) - 1;
  at::parallel_for(0, threads, 1, [&](int64_t first_share, int64_t end_share) {
    for (int64_t share = first_share; share < end_share; ++share) {
      for (int64_t item = work.bounds[share]; item < work.bounds[share + 1];) {
        const int64_t slot = item / tiles, first_tile = item % tiles;
        const int64_t end_tile = std::min(tiles, first_tile + work.bounds[share + 1] - item);
        const int64_t rows = counts[work.experts[slot]];
        for (int64_t chunk = 0; chunk < rows; chunk += kChunkRows) {
          visit(slot, first_tile, end_tile, chunk, std::min(rows, chunk + kChunkRows));
        }
        item += end_tile - first_tile;
      }
    }
  });
}

template <typename W>
void run_experts(const Tensor& xs, const std::vector<int64_t>& counts, const std::vector<int64_t>& offsets,
                 const int64_t* sorted_pairs, const float* pair_weights, const W* gate_up, const float* gate_up_bias,
                 const W* down, const float* down_bias, const ActivationParams& params, int64_t hidden,
                 int64_t inter_tiles, int64_t hidden_tiles, Tensor& act, Tensor& pair_out) {
  const bool gated = params.kind != kRelu2;
  const int64_t tile_outputs = gated ? kLanes : kTileWidth;  // a gate/up tile's activations
  const int64_t inter = inter_tiles * tile_outputs, padded_hidden = hidden_tiles * kTileWidth;
  const float* x = xs.const_data_ptr<float>();
  float* a = act.mutable_data_ptr<float>();
  float* out = pair_out.mutable_data_ptr<float>();
  const int64_t gate_up_tile_size = hidden * kTileWidth, down_tile_size = inter * kTileWidth;

  const Work first = split_work(counts, inter_tiles);
  for_each_share(first, inter_tiles, counts, [&](int64_t slot, int64_t t0, int64_t t1, int64_t r0, int64_t r1) {
    const int64_t e = first.experts[slot];
    for (int64_t t = t0; t < t1; ++t) {
      const W* w = gate_up + (e * inter_tiles + t) * gate_up_tile_size;
      const float* b = gate_up_bias ? gate_up_bias + (e * inter_tiles + t) * kTileWidth : nullptr;
      for (int64_t r = r0; r < r1; r += kTileRows) {
        const int64_t row = offsets[e] + r;
        float* act_rows = a + row * inter + t * tile_outputs;
        by_rows(std::min(kTileRows, r1 - r), [&]<int Rows>() {
          if (gated) {
            gate_up_tile<Rows>(w, x + row * hidden, hidden, b, act_rows, inter, params);
          } else {
            up_tile<Rows>(w, x + row * hidden, hidden, b, act_rows, inter);
          }
        });
      }
    }
  });

  const Work second = split_work(counts, hidden_tiles);
  for_each_share(second, hidden_tiles, counts, [&](int64_t slot, int64_t t0, int64_t t1, int64_t r0, int64_t r1) {
    const int64_t e = second.experts[slot];
    for (int64_t t = t0; t < t1; ++t) {
      const W* w = down + (e * hidden_tiles + t) * down_tile_size;
      const float* b = down_bias ? down_bias + e * padded_hidden + t * kTileWidth : nullptr;
      for (int64_t r = r0; r < r1; r += kTileRows) {
        const int64_t row = offsets[e] + r, n = std::min(kTileRows, r1 - r);
        float* rows_out[kTileRows];
        float weights[kTileRows];
        for (int64_t i = 0; i < n; ++i) {
          rows_out[i] = out + sorted_pairs[row + i] * padded_hidden + t * kTileWidth;
          weights[i] = pair_weights[sorted_pairs[row + i]];
        }
        by_rows(n, [&]<int Rows>() { down_tile<Rows>(w, a + row * inter, inter, b, rows_out, weights); });
      }
    }
  });
}

template <typename T>
void sum_pairs(const float* pair_out, int64_t tokens, int64_t k, int64_t hidden, int64_t padded_hidden, T* out) {
  at::parallel_for(0, tokens, 1, [&](int64_t first, int64_t end) {
    std::vector<float> sum(hidden);
    for (int64_t t = first; t < end; ++t) {
      const float* pairs = pair_out + t * k * padded_hidden;
      std::copy(pairs, pairs + hidden, sum.begin());
      for (int64_t j = 1; j < k; ++j) {  // in k order
        for (int64_t h = 0; h < hidden; ++h) sum[h] += pairs[j * padded_hidden + h];
      }
      for (int64_t h = 0; h < hidden; ++h) out[t * hidden + h] = static_cast<T>(sum[h]);
    }
  });
}

}  // namespace

Tensor moe_experts(const Tensor& x, const Tensor& topk_ids, const Tensor& topk_weights, const Tensor& gate_up,
                   const std::optional<Tensor>& gate_up_bias, const Tensor& down,
                   const std::optional<Tensor>& down_bias, int64_t activation, double alpha, double limit) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "moe_experts: x must be a CPU fp32 or bf16 [tokens, hidden] tensor, got ", x.sizes(), " ",
              x.scalar_type());
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == tokens && topk_ids.scalar_type() == at::kLong &&
                  topk_ids.device().is_cpu(),
              "moe_experts: topk_ids must be CPU int64 [", tokens, ", k], got ", topk_ids.sizes(), " ",
              topk_ids.scalar_type());
  const int64_t k = topk_ids.size(1), pairs = tokens * k;
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() && topk_weights.scalar_type() == at::kFloat &&
                  topk_weights.device().is_cpu(),
              "moe_experts: topk_weights must be CPU fp32 ", topk_ids.sizes(), ", got ", topk_weights.sizes(), " ",
              topk_weights.scalar_type());
  TORCH_CHECK(gate_up.dim() == 4 && gate_up.size(2) == hidden && gate_up.size(3) == kTileWidth &&
                  gate_up.is_contiguous() && gate_up.device().is_cpu() &&
                  (gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16),
              "moe_experts: gate_up must be contiguous fp32 or bf16 [experts, inter / 16, ", hidden, ", ",
              kTileWidth, "] (moe.py pack_experts), got ", gate_up.sizes());
  TORCH_CHECK(activation >= kSilu && activation <= kRelu2, "moe_experts: unknown activation ", activation);
  const int64_t experts = gate_up.size(0), inter_tiles = gate_up.size(1);
  const int64_t inter = inter_tiles * (activation == kRelu2 ? kTileWidth : kLanes);
  TORCH_CHECK(down.dim() == 4 && down.size(0) == experts && down.size(2) == inter && down.size(3) == kTileWidth &&
                  down.size(1) * kTileWidth >= hidden && down.size(1) * kTileWidth < hidden + kTileWidth &&
                  down.is_contiguous() && down.scalar_type() == gate_up.scalar_type(),
              "moe_experts: down must be contiguous [", experts, ", hidden / 32, ", inter, ", ", kTileWidth,
              "] in gate_up's dtype, got ", down.sizes());
  const int64_t hidden_tiles = down.size(1), padded_hidden = hidden_tiles * kTileWidth;
  if (gate_up_bias) {
    TORCH_CHECK(gate_up_bias->sizes() == at::IntArrayRef({experts, inter_tiles, kTileWidth}) &&
                    gate_up_bias->scalar_type() == at::kFloat && gate_up_bias->is_contiguous(),
                "moe_experts: gate_up_bias must be contiguous fp32 [", experts, ", ", inter_tiles, ", ", kTileWidth,
                "]");
  }
  if (down_bias) {
    TORCH_CHECK(down_bias->sizes() == at::IntArrayRef({experts, padded_hidden}) &&
                    down_bias->scalar_type() == at::kFloat && down_bias->is_contiguous(),
                "moe_experts: down_bias must be contiguous fp32 [", experts, ", ", padded_hidden, "]");
  }

  Tensor out = at::empty({tokens, hidden}, x.options());
  if (pairs == 0) return out;
  // pairs t * k + j grouped by expert (a counting sort: ascending pair order within an expert)
  const Tensor ids = topk_ids.contiguous();
  const int64_t* id = ids.const_data_ptr<int64_t>();
  std::vector<int64_t> counts(experts, 0), offsets(experts, 0), sorted(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < experts, "moe_experts: expert id ", id[p], " outside [0, ", experts, ")");
    ++counts[id[p]];
  }
  for (int64_t e = 1; e < experts; ++e) offsets[e] = offsets[e - 1] + counts[e - 1];
  {
    std::vector<int64_t> next(offsets);
    for (int64_t p = 0; p < pairs; ++p) sorted[next[id[p]]++] = p;
  }
  // the routed rows, in that order, as fp32
  const Tensor inputs = x.to(at::kFloat).contiguous();
  Tensor xs = at::empty({pairs, hidden}, x.options().dtype(at::kFloat));
  {
    const float* from = inputs.const_data_ptr<float>();
    float* to = xs.mutable_data_ptr<float>();
    at::parallel_for(0, pairs, 16, [&](int64_t first, int64_t end) {
      for (int64_t s = first; s < end; ++s) std::copy_n(from + sorted[s] / k * hidden, hidden, to + s * hidden);
    });
  }
  const Tensor weights = topk_weights.contiguous();
  Tensor act = at::empty({pairs, inter}, xs.options());
  Tensor pair_out = at::empty({pairs, padded_hidden}, xs.options());
  const ActivationParams params{activation, static_cast<float>(alpha), static_cast<float>(limit)};
  const float* gub = gate_up_bias ? gate_up_bias->const_data_ptr<float>() : nullptr;
  const float* db = down_bias ? down_bias->const_data_ptr<float>() : nullptr;
  if (gate_up.scalar_type() == at::kFloat) {
    run_experts(xs, counts, offsets, sorted.data(), weights.const_data_ptr<float>(), gate_up.const_data_ptr<float>(),
                gub, down.const_data_ptr<float>(), db, params, hidden, inter_tiles, hidden_tiles, act, pair_out);
  } else {
    run_experts(xs, counts, offsets, sorted.data(), weights.const_data_ptr<float>(),
                reinterpret_cast<const uint16_t*>(gate_up.const_data_ptr<at::BFloat16>()), gub,
                reinterpret_cast<const uint16_t*>(down.const_data_ptr<at::BFloat16>()), db, params, hidden,
                inter_tiles, hidden_tiles, act, pair_out);
  }
  if (x.scalar_type() == at::kFloat) {
    sum_pairs(pair_out.const_data_ptr<float>(), tokens, k, hidden, padded_hidden, out.mutable_data_ptr<float>());
  } else {
    sum_pairs(pair_out.const_data_ptr<float>(), tokens, k, hidden, padded_hidden,
              out.mutable_data_ptr<at::BFloat16>());
  }
  return out;
}

}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor gate_up, Tensor? gate_up_bias, "
        "Tensor down, Tensor? down_bias, int activation, float alpha, float limit) -> Tensor",
        radixserve::moe_experts);
}
