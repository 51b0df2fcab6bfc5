// Attention of decodes and verifications on CPU, read in place from the paged KV cache (cpu_kernels.h).
//
// Why: gathering a step's keys and values into a contiguous copy and running SDPA over it reads the
// cache, writes the copy and reads it again, and SDPA's flash kernel spends more on its per-call
// setup than on one query's arithmetic. Here each task reads its keys and values once, where they
// lie: at batch 16 x 512 tokens the gather and SDPA took 35 ms of an 84 ms step (docs/cpu.md).
//
// How: a task is one row, one kv head and one partition of kPartition keys. It scores the keys
// against every query of the row and every q head sharing the kv head (pass 1), takes the softmax's
// exponentials against the partition's own maximum, and sums the values they weigh (pass 2). The
// partitions of a row are then merged in order. Which keys form a partition depends on nothing but
// their positions, so a row's result never depends on the other rows of the step or on the thread
// count. Threads claim the tasks dearest first (for_each_dearest_first): a prompt chunk's tasks cost
// tens of times a decode's.
//
// Attention variants, per call (a layer's): a sliding window (query at position p sees keys
// p - window < j <= p) makes the row's tasks start at the partition holding its first query's
// first key, so a decode costs the window, not the context; a partition's pass scores only the keys
// some query of the pass sees. Logit softcapping (s <- softcap * tanh(s / softcap)) applies to each
// score before the softmax. Attention sinks (one logit per q head) add e^(sink - m) to the merged
// denominator, m the maximum over the row's partitions and the sink, with no value weighed.

#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace radixserve {
namespace {

using at::Tensor;

constexpr int64_t kPartition = 256;  // keys per task
constexpr int64_t kPrefetchAhead = 16;  // keys: a row's lines are requested this many keys before they are read
struct Layout {  // where a step's rows, queries and cache lie, and the layer's attention variant
  const float* q;  // [T, heads, head_dim] as fp32
  int64_t heads, group, head_dim;
  const int32_t* table;
  int64_t table_stride, block_size;
  int64_t block_stride, token_stride, head_stride;  // of the caches, in elements
  int64_t window;      // keys a query sees, itself included; 0: every earlier key
  float softcap;       // 0: none
  const float* sinks;  // [heads] as fp32, or null
};

struct Task {
  int64_t row, kv_head, first_key, last_key;  // keys [first_key, last_key)
  int64_t first_token, queries, length;       // the row's q rows, how many, its total tokens
};

// Query heads scored together, sharing each key's and value's loads: up to 4. With 32 vector
// registers their queries take at most half of them. With 16 (AVX2) a head_dim of 64 would allow one
// head per pass, and a kv head's keys and values were then read once per q head: the passes after the
// first find them in L2 but no longer overlap the stream from memory. Queries and sums spilled to L1
// cost less, so 16 registers' worth per head is allowed there (docs/quantized.md, the AVX2 section).
template <int V>
constexpr int kHeadsTogether =
    std::max(1, std::min(4, (kVectorRegisters == 16 ? 2 * kVectorRegisters : kVectorRegisters / 2) / (V * kParts)));

// How many query heads a task's passes take together: as few passes as kHeadsTogether allows, split
// evenly, so that no pass scores a head only to drop it (a kv head shared by 3 q heads: one pass of 3,
// not a pass of 4 with one repeated)
template <int V>
int heads_per_pass(int64_t query_heads) {
  const int64_t passes = (query_heads + kHeadsTogether<V> - 1) / kHeadsTogether<V>;
  return static_cast<int>((query_heads + passes - 1) / passes);
}

// Asks for the cache row at `row` (dim values) to be brought in: a head's rows lie a token stride apart,
// a gap the hardware's prefetchers do not bridge far enough ahead of the loop.
// Locality 3 brings the row into every cache level, 2 into L2 and below (for a read later than the next).
template <int64_t Bytes, int Locality = 3>
inline void prefetch_row(const void* row) {
  for (int64_t line = 0; line < Bytes; line += 64) __builtin_prefetch(static_cast<const char*>(row) + line, 0, Locality);
}

// The largest of `count` scores, as a loop of std::max from -inf finds it (a NaN is passed over), a
// vector at a time: a scalar maximum is a chain of dependent compares, as slow per key as a key's dot
// products. Which order finds a maximum changes nothing but the sign of a zero maximum, and
// e^(s - m) is the same for m = +0 and m = -0.
inline float largest(const float* scores, int64_t count) {
  Native most = broadcast_native(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + kNativeFloats <= count; j += kNativeFloats) {
    Native chunk;
    std::memcpy(&chunk, scores + j, sizeof chunk);
    most = most < chunk ? chunk : most;
  }
  float maximum = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < kNativeFloats; ++i) maximum = std::max(maximum, most[i]);
  for (; j < count; ++j) maximum = std::max(maximum, scores[j]);
  return maximum;
}

// One task: for each query i and q head of the kv head, the partition's maximum score, the sum of
// its exponentials and the values they weigh, into `partial` [queries * group][V * 16 + 2]. A query
// head's figures are the same whichever heads share its pass, and whichever key the task starts at
// (a row's first task starts at the row's first key in its window): a key it does not see weighs
// exactly 0, and its exponentials are summed from its own first key on.
template <int V, int N, typename T>
void attend_partition(const Layout& at, const Task& task, const T* k_cache, const T* v_cache, double scale,
                      float* partial) {
  constexpr int64_t dim = V * kLanes;
  const int64_t keys = task.last_key - task.first_key;
  thread_local std::vector<const T*> key_rows, value_rows;
  thread_local std::vector<float> score_rows;
  key_rows.resize(keys);
  value_rows.resize(keys);
  score_rows.resize(N * keys);
  const T** key_at = key_rows.data();
  const T** value_at = value_rows.data();
  for (int64_t j = 0, slot = task.first_key % at.block_size; j < keys;) {  // a block at a time
    const int64_t block = at.table[task.row * at.table_stride + (task.first_key + j) / at.block_size];
    for (; slot < at.block_size && j < keys; ++slot, ++j) {
      const int64_t offset = block * at.block_stride + slot * at.token_stride + task.kv_head * at.head_stride;
      key_at[j] = k_cache + offset;
      value_at[j] = v_cache + offset;
    }
    slot = 0;
  }
  const int64_t query_heads = task.queries * at.group;
  for (int64_t first = 0; first < query_heads; first += N) {
    Lanes query[N][V];
    int64_t from[N], seen[N];  // the keys [from, seen) of the task that query head n sees
    int64_t least = keys, most = 0;
    for (int n = 0; n < N; ++n) {  // past the last query head, repeat it (its results are dropped)
      const int64_t index = std::min(first + n, query_heads - 1), i = index / at.group;
      const int64_t head = task.kv_head * at.group + index % at.group;
      // query i sits at position length - queries + i and sees keys up to it (and in its window)
      const int64_t position = task.length - task.queries + i;
      seen[n] = std::clamp(position + 1 - task.first_key, int64_t{0}, keys);
      from[n] = at.window > 0 ? std::clamp(position + 1 - at.window - task.first_key, int64_t{0}, seen[n]) : 0;
      if (from[n] < seen[n]) {
        least = std::min(least, from[n]);
        most = std::max(most, seen[n]);
      }
      for (int c = 0; c < V; ++c) {
        query[n][c] = load_lanes(at.q + ((task.first_token + i) * at.heads + head) * at.head_dim + c * kLanes);
      }
    }
    least = std::min(least, most);
    auto dot = [&](int n, const Lanes (&key)[V]) {
      Lanes sum = fused_multiply_add(query[n][0], key[0], zero_lanes());
      for (int c = 1; c < V; ++c) sum = fused_multiply_add(query[n][c], key[c], sum);
      return sum;
    };
    int64_t j = least;
    for (; j + 4 <= most; j += 4) {  // four keys' sums at once: the same sums, fewer shuffles
      Lanes dots[N][4];
      for (int u = 0; u < 4; ++u) {
        if (j + u + kPrefetchAhead < most) {
          prefetch_row<dim * sizeof(T)>(key_at[j + u + kPrefetchAhead]);
          // the pass over the values reads them next: in L2 by then, its own prefetch finds them near
          prefetch_row<dim * sizeof(T), 2>(value_at[j + u + kPrefetchAhead]);
        }
        Lanes key[V];
        for (int c = 0; c < V; ++c) key[c] = load_lanes(key_at[j + u] + c * kLanes);
        for (int n = 0; n < N; ++n) dots[n][u] = dot(n, key);
      }
      for (int n = 0; n < N; ++n) {
        float sums[4];
        sum_lanes_of_four(dots[n], sums);
        for (int u = 0; u < 4; ++u) score_rows[n * keys + j + u] = sums[u] * static_cast<float>(scale);
      }
    }
    for (; j < most; ++j) {
      Lanes key[V];
      for (int c = 0; c < V; ++c) key[c] = load_lanes(key_at[j] + c * kLanes);
      for (int n = 0; n < N; ++n) score_rows[n * keys + j] = sum_lanes(dot(n, key)) * static_cast<float>(scale);
    }
    if (at.softcap > 0) {
      for (int n = 0; n < N; ++n) {
        float* scores = score_rows.data() + n * keys;
        for (int64_t j = from[n]; j < seen[n]; ++j) scores[j] = at.softcap * std::tanh(scores[j] / at.softcap);
      }
    }
    float maximum[N], total[N];
    for (int n = 0; n < N; ++n) {
      float* scores = score_rows.data() + n * keys;
      maximum[n] = largest(scores + from[n], seen[n] - from[n]);
      Lanes sum = {};
      for (int64_t j = from[n]; j < seen[n]; j += kLanes) {
        const int64_t count = std::min(kLanes, seen[n] - j);
        Lanes chunk = broadcast(-std::numeric_limits<float>::infinity());
        // whole vectors as loads and stores: a copy of a count known only at run time is a string move
        if (count == kLanes) {
          chunk = load_lanes(scores + j);
        } else {
          std::memcpy(&chunk, scores + j, count * sizeof(float));
        }
        chunk = exp_lanes(chunk - maximum[n]);
        if (count == kLanes) {
          store_lanes(scores + j, chunk);
        } else {
          std::memcpy(scores + j, &chunk, count * sizeof(float));
        }
        sum = sum + chunk;
      }
      total[n] = sum_lanes(sum);
      if (from[n] < seen[n]) {
        std::fill(scores + least, scores + from[n], 0.0f);
        std::fill(scores + seen[n], scores + most, 0.0f);
      } else {
        std::fill(scores + least, scores + most, 0.0f);
      }
    }
    Lanes acc[N][V] = {};
    for (int64_t j = least; j < most; ++j) {
      if (j + kPrefetchAhead < most) prefetch_row<dim * sizeof(T)>(value_at[j + kPrefetchAhead]);
      Lanes value[V];
      for (int c = 0; c < V; ++c) value[c] = load_lanes(value_at[j] + c * kLanes);
      for (int n = 0; n < N; ++n) {
        const float weight = score_rows[n * keys + j];
        for (int c = 0; c < V; ++c) acc[n][c] = fused_multiply_add(weight, value[c], acc[n][c]);
      }
    }
    for (int n = 0; n < N && first + n < query_heads; ++n) {
      float* out = partial + (first + n) * (dim + 2);
      for (int c = 0; c < V; ++c) store_lanes(out + c * kLanes, acc[n][c]);
      out[dim] = maximum[n];  // -inf where the query sees none of these keys
      out[dim + 1] = total[n];
    }
  }
}

// merge each (row, kv head)'s partitions, tasks first_task[u] .. first_task[u + 1], in order, and
// the head's sink where there are sinks
template <typename Out>
void merge(const Layout& at, const std::vector<Task>& tasks, const std::vector<int64_t>& first_task,
           const std::vector<int64_t>& offsets, const float* partials, int64_t dim, Out* out) {
  const int64_t units = static_cast<int64_t>(first_task.size()) - 1;
  std::vector<int64_t> costs(units);  // query heads times partitions
  for (int64_t u = 0; u < units; ++u) {
    costs[u] = tasks[first_task[u]].queries * at.group * (first_task[u + 1] - first_task[u]);
  }
  for_each_dearest_first(costs, [&](int64_t u) {
    thread_local std::vector<float> merged;
    merged.resize(dim);
    const Task& first = tasks[first_task[u]];
    for (int64_t q = 0; q < first.queries * at.group; ++q) {
      const int64_t token = first.first_token + q / at.group, head = first.kv_head * at.group + q % at.group;
      float maximum = -std::numeric_limits<float>::infinity();
      for (int64_t t = first_task[u]; t < first_task[u + 1]; ++t) {
        maximum = std::max(maximum, partials[offsets[t] + q * (dim + 2) + dim]);
      }
      if (at.sinks != nullptr) maximum = std::max(maximum, at.sinks[head]);
      std::fill(merged.begin(), merged.end(), 0.0f);
      float total = 0.0f;
      for (int64_t t = first_task[u]; t < first_task[u + 1]; ++t) {
        const float* part = partials + offsets[t] + q * (dim + 2);
        if (part[dim] == -std::numeric_limits<float>::infinity()) continue;  // no key seen here
        const float weight = std::exp(part[dim] - maximum);
        total += weight * part[dim + 1];
        for (int64_t d = 0; d < dim; ++d) merged[d] += weight * part[d];
      }
      if (at.sinks != nullptr) total += std::exp(at.sinks[head] - maximum);  // weighs no value
      Out* to = out + (token * at.heads + head) * dim;
      for (int64_t d = 0; d < dim; ++d) to[d] = static_cast<Out>(merged[d] / total);
    }
  });
}

template <int V, typename T>
void attend(const Layout& at, const std::vector<Task>& tasks, const std::vector<int64_t>& first_task,
            const T* k_cache, const T* v_cache, double scale, const Tensor& out) {
  constexpr int64_t dim = V * kLanes;
  // each task's partials [its queries * group][dim + 2], one after another (every value is written)
  std::vector<int64_t> offsets(tasks.size() + 1, 0);
  for (size_t t = 0; t < tasks.size(); ++t) offsets[t + 1] = offsets[t] + tasks[t].queries * at.group * (dim + 2);
  const Tensor partials = at::empty({offsets.back()}, out.options().dtype(at::kFloat));
  float* scratch = partials.mutable_data_ptr<float>();
  // cost: query heads times keys, plus a task's setup (its key pointers, its passes' partials)
  std::vector<int64_t> costs(tasks.size());
  for (size_t t = 0; t < tasks.size(); ++t) {
    costs[t] = (tasks[t].queries * at.group + 4) * (tasks[t].last_key - tasks[t].first_key);
  }
  for_each_dearest_first(costs, [&](int64_t t) {
    float* partial = scratch + offsets[t];
    switch (heads_per_pass<V>(tasks[t].queries * at.group)) {
      case 1: attend_partition<V, 1>(at, tasks[t], k_cache, v_cache, scale, partial); break;
      case 2: attend_partition<V, std::min(2, kHeadsTogether<V>)>(at, tasks[t], k_cache, v_cache, scale, partial); break;
      case 3: attend_partition<V, std::min(3, kHeadsTogether<V>)>(at, tasks[t], k_cache, v_cache, scale, partial); break;
      default: attend_partition<V, kHeadsTogether<V>>(at, tasks[t], k_cache, v_cache, scale, partial);
    }
  });
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "paged_attention_merge", [&] {
    merge(at, tasks, first_task, offsets, scratch, dim, out.mutable_data_ptr<scalar_t>());
  });
}

template <typename T>
void dispatch_dim(const Layout& at, const std::vector<Task>& tasks, const std::vector<int64_t>& first_task,
                  const T* k_cache, const T* v_cache, double scale, const Tensor& out) {
  switch (at.head_dim / kLanes) {
    case 1: return attend<1>(at, tasks, first_task, k_cache, v_cache, scale, out);
    case 2: return attend<2>(at, tasks, first_task, k_cache, v_cache, scale, out);
    case 3: return attend<3>(at, tasks, first_task, k_cache, v_cache, scale, out);
    case 4: return attend<4>(at, tasks, first_task, k_cache, v_cache, scale, out);
    case 5: return attend<5>(at, tasks, first_task, k_cache, v_cache, scale, out);
    case 6: return attend<6>(at, tasks, first_task, k_cache, v_cache, scale, out);
    case 7: return attend<7>(at, tasks, first_task, k_cache, v_cache, scale, out);
    case 8: return attend<8>(at, tasks, first_task, k_cache, v_cache, scale, out);
    case 16: return attend<16>(at, tasks, first_task, k_cache, v_cache, scale, out);
    case 32: return attend<32>(at, tasks, first_task, k_cache, v_cache, scale, out);  // Gemma 4's global layers
    default: TORCH_CHECK(false, "paged_attention: head_dim ", at.head_dim, " is not 16-128, 256 or 512");
  }
}

}  // namespace

void paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& block_table,
                     at::IntArrayRef seq_lens, at::IntArrayRef query_lens, double scale, int64_t max_query,
                     const Tensor& out, int64_t window, const std::optional<Tensor>& sinks, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.strides() == v_cache.strides() && k_cache.stride(3) == 1,
              "paged_attention: q [T, heads, dim] and caches [blocks, block_size, kv_heads, dim] alike");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16 ||
                   k_cache.scalar_type() == at::kHalf),
              "paged_attention: an fp32, bf16 or fp16 cache");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous(), "paged_attention: out like q, contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.stride(1) == 1,
              "paged_attention: an int32 block table [rows, width]");
  TORCH_CHECK(static_cast<int64_t>(seq_lens.size()) == block_table.size(0) && seq_lens.size() == query_lens.size(),
              "paged_attention: one length and one query count per row");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  block_table.device().is_cpu() && out.device().is_cpu(),
              "paged_attention: CPU tensors");
  const int64_t heads = q.size(1), kv_heads = k_cache.size(2), head_dim = q.size(2);
  TORCH_CHECK(kv_heads > 0 && k_cache.size(1) > 0 && k_cache.size(3) == head_dim && heads % kv_heads == 0 &&
                  head_dim % kLanes == 0,
              "paged_attention: head_dim a multiple of 16, heads a multiple of kv_heads, blocks of at least one token");
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_attention: window and softcap are 0 (none) or positive");
  TORCH_CHECK(!sinks || (sinks->dim() == 1 && sinks->size(0) == heads && sinks->device().is_cpu() &&
                         at::isFloatingType(sinks->scalar_type())),
              "paged_attention: sinks are one float per q head, on the CPU");
  const Tensor queries = q.to(at::kFloat).contiguous();
  const Tensor table = block_table.contiguous();
  const Tensor sink_logits = sinks ? sinks->to(at::kFloat).contiguous() : Tensor();
  const Layout layout{queries.const_data_ptr<float>(), heads, heads / kv_heads, head_dim,
                      table.const_data_ptr<int32_t>(), table.stride(0), k_cache.size(1),
                      k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                      window, static_cast<float>(softcap),
                      sinks ? sink_logits.const_data_ptr<float>() : nullptr};
  std::vector<Task> tasks;
  std::vector<int64_t> first_task;
  int64_t token = 0;
  for (size_t b = 0; b < seq_lens.size(); ++b) {
    const int64_t length = seq_lens[b], queries_of_row = query_lens[b];
    TORCH_CHECK(0 < queries_of_row && queries_of_row <= length, "paged_attention: row ", b, " has ",
                queries_of_row, " new of ", length, " tokens");
    const int64_t row_blocks = (length + layout.block_size - 1) / layout.block_size;
    TORCH_CHECK(row_blocks <= table.size(1), "paged_attention: row ", b, "'s blocks exceed the table");
    for (int64_t i = 0; i < row_blocks; ++i) {
      const int64_t block = layout.table[b * layout.table_stride + i];
      TORCH_CHECK(0 <= block && block < k_cache.size(0), "paged_attention: row ", b, " names block ", block, " of ",
                  k_cache.size(0));
    }
    if (queries_of_row <= max_query) {
      // the first key the row's first query sees: partitions wholly before it are never read
      const int64_t first_seen = window > 0 ? std::max<int64_t>(0, length - queries_of_row + 1 - window) : 0;
      for (int64_t kv_head = 0; kv_head < kv_heads; ++kv_head) {
        first_task.push_back(static_cast<int64_t>(tasks.size()));
        for (int64_t key = first_seen / kPartition * kPartition; key < length; key += kPartition) {
          tasks.push_back({static_cast<int64_t>(b), kv_head, std::max(key, first_seen),
                           std::min(length, key + kPartition), token, queries_of_row, length});
        }
      }
    }
    token += queries_of_row;
  }
  TORCH_CHECK(token == q.size(0), "paged_attention: the rows' new tokens are not q's ", q.size(0));
  first_task.push_back(static_cast<int64_t>(tasks.size()));
  if (tasks.empty()) return;
  if (k_cache.scalar_type() == at::kFloat) {
    dispatch_dim(layout, tasks, first_task, k_cache.const_data_ptr<float>(), v_cache.const_data_ptr<float>(),
                 scale, out);
  } else if (k_cache.scalar_type() == at::kHalf) {
    dispatch_dim(layout, tasks, first_task, k_cache.const_data_ptr<at::Half>(), v_cache.const_data_ptr<at::Half>(),
                 scale, out);
  } else {
    dispatch_dim(layout, tasks, first_task, reinterpret_cast<const uint16_t*>(k_cache.const_data_ptr<at::BFloat16>()),
                 reinterpret_cast<const uint16_t*>(v_cache.const_data_ptr<at::BFloat16>()), scale, out);
  }
}

}  // namespace radixserve

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, int[] seq_lens, "
        "int[] query_lens, float scale, int max_query, Tensor(a!) out, int window=0, Tensor? sinks=None, "
        "float softcap=0.0) -> ()",
        radixserve::paged_attention);
}
