// The CPU kernels of radixserve's C++ extension, shared by the Python layers (as torch.ops.radixserve
// operators) and the compiled step (cpu_step.cpp), so that both compute every token bit for bit alike.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <unordered_set>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace radixserve {

// 16 fp32 lanes: the kernels' unit (a packed weight block's 16 outputs, a slice of a head). It is
// held as the CPU's own vectors (one AVX-512 register, two AVX ones, four SSE or NEON ones), since
// compilers lower a 64-byte vector type poorly on narrower machines (AVX2: through memory, 30x slower).
#if defined(__AVX512F__)
constexpr int64_t kNativeFloats = 16;
#elif defined(__AVX__)
constexpr int64_t kNativeFloats = 8;
#else
constexpr int64_t kNativeFloats = 4;
#endif
#if defined(__AVX512F__) || defined(__aarch64__)
constexpr int kVectorRegisters = 32;
#else
constexpr int kVectorRegisters = 16;
#endif
constexpr int64_t kLanes = 16;
constexpr int kParts = static_cast<int>(kLanes / kNativeFloats);

typedef float Native __attribute__((vector_size(kNativeFloats * sizeof(float))));
typedef int32_t NativeInt __attribute__((vector_size(kNativeFloats * sizeof(int32_t))));
typedef uint32_t NativeBits __attribute__((vector_size(kNativeFloats * sizeof(uint32_t))));

template <typename To, typename From>
inline To bits_as(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "bits_as: the same size");
  To to;
  std::memcpy(&to, &from, sizeof to);
  return to;
}

// a * b + c in one rounding where the CPU has a fused multiply-add; the extension is built with
// -ffp-contract=off (cpu_step.cpp's elementwise loops round as ATen's do), so the kernels say so
inline Native fused_multiply_add(Native a, Native b, Native c) {
#if defined(__AVX512F__)
  return bits_as<Native>(_mm512_fmadd_ps(bits_as<__m512>(a), bits_as<__m512>(b), bits_as<__m512>(c)));
#elif defined(__AVX__) && defined(__FMA__)
  return bits_as<Native>(_mm256_fmadd_ps(bits_as<__m256>(a), bits_as<__m256>(b), bits_as<__m256>(c)));
#elif defined(__aarch64__)
  return bits_as<Native>(vfmaq_f32(bits_as<float32x4_t>(c), bits_as<float32x4_t>(a), bits_as<float32x4_t>(b)));
#else
  return a * b + c;
#endif
}

struct Lanes {
  Native part[kParts];
};

inline Lanes zero_lanes() { return Lanes{}; }

inline Native broadcast_native(float value) {
#if defined(__AVX512F__)
  return bits_as<Native>(_mm512_set1_ps(value));
#elif defined(__AVX__)
  return bits_as<Native>(_mm256_set1_ps(value));
#elif defined(__aarch64__)
  return bits_as<Native>(vdupq_n_f32(value));
#else
  Native out;
  for (int64_t i = 0; i < kNativeFloats; ++i) out[i] = value;
  return out;
#endif
}

inline Lanes broadcast(float value) {
  Lanes out;
  for (int p = 0; p < kParts; ++p) out.part[p] = broadcast_native(value);
  return out;
}

inline Lanes operator+(Lanes a, const Lanes& b) {
  for (int p = 0; p < kParts; ++p) a.part[p] += b.part[p];
  return a;
}

inline Lanes operator-(Lanes a, float b) {
  const Native scalar = broadcast_native(b);
  for (int p = 0; p < kParts; ++p) a.part[p] -= scalar;
  return a;
}

inline Lanes fused_multiply_add(const Lanes& a, const Lanes& b, Lanes c) {
  for (int p = 0; p < kParts; ++p) c.part[p] = fused_multiply_add(a.part[p], b.part[p], c.part[p]);
  return c;
}

inline Lanes fused_multiply_add(float a, const Lanes& b, Lanes c) {
  const Native scalar = broadcast_native(a);
  for (int p = 0; p < kParts; ++p) c.part[p] = fused_multiply_add(scalar, b.part[p], c.part[p]);
  return c;
}

inline Lanes load_lanes(const float* from) {
  Lanes v;
  for (int p = 0; p < kParts; ++p) std::memcpy(&v.part[p], from + p * kNativeFloats, sizeof(Native));
  return v;
}

inline Lanes load_lanes(const uint16_t* bf16) {  // bf16 bits widened to fp32: exact
  typedef uint16_t Narrow __attribute__((vector_size(kNativeFloats * sizeof(uint16_t))));
  Lanes v;
  for (int p = 0; p < kParts; ++p) {
    Narrow narrow;
    std::memcpy(&narrow, bf16 + p * kNativeFloats, sizeof narrow);
    v.part[p] = bits_as<Native>(__builtin_convertvector(narrow, NativeBits) << 16);
  }
  return v;
}

inline Lanes load_lanes(const c10::Half* from) {  // fp16 widened to fp32: exact
  Lanes v;
#if defined(__AVX512F__)
  v.part[0] = bits_as<Native>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(from))));
#elif defined(__AVX__) && defined(__F16C__)
  for (int p = 0; p < kParts; ++p) {
    v.part[p] = bits_as<Native>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from + p * 8))));
  }
#else
  float values[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) values[i] = static_cast<float>(from[i]);
  v = load_lanes(values);
#endif
  return v;
}

inline void store_lanes(float* to, const Lanes& v) {
  for (int p = 0; p < kParts; ++p) std::memcpy(to + p * kNativeFloats, &v.part[p], sizeof(Native));
}

constexpr float kMinExponent = -87.0f;  // e^x below this is taken as 0 (fp32's normal range ends at e^-87.3)

// e^x for x <= 0 (attention's scores less their maximum, SiLU's -|x|): x = n ln 2 + r with
// |r| <= ln 2 / 2, e^r by its Taylor polynomial to r^7 (relative error below 1e-7), 2^n put into the
// exponent bits; e^x below e^kMinExponent, e^-inf included, is 0, and e^NaN is NaN.
inline Native exp_native(Native x) {
  const NativeInt kept = (x >= kMinExponent) | (x != x);  // NaN is kept: a NaN score poisons its row, as in SDPA
  const NativeInt floor_bits = bits_as<NativeInt>(broadcast_native(kMinExponent));
  x = bits_as<Native>((bits_as<NativeInt>(x) & kept) | (floor_bits & ~kept));
  const Native round = broadcast_native(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const Native n = fused_multiply_add(x, broadcast_native(1.44269504f), round) - round;
  const Native r = fused_multiply_add(n, broadcast_native(2.12194440e-4f),
                                      fused_multiply_add(n, broadcast_native(-0.693359375f), x));
  Native p = broadcast_native(1.0f / 5040);
  for (const float coefficient : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) {
    p = fused_multiply_add(p, r, broadcast_native(coefficient));
  }
  const NativeInt power = (__builtin_convertvector(n, NativeInt) + 127) << 23;
  return bits_as<Native>(bits_as<NativeInt>(p * bits_as<Native>(power)) & kept);
}

inline Lanes exp_lanes(Lanes x) {
  for (int p = 0; p < kParts; ++p) x.part[p] = exp_native(x.part[p]);
  return x;
}

// For a recurrent layer's kernel (delta_rule.cpp, mamba2_scan.cpp): its tensors are fp32 and contiguous.
inline void check_fp32_contiguous(const char* name, std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), name, ": fp32 contiguous tensors");
  }
}

// For a recurrent layer's kernel: the first token of each item of a
// step, and last the step's token count, once checked that every item has one slot of `num_slots`, no
// slot serves two items, there is one length and one fresh flag per item, and the lengths add up to
// `tokens`; `name` opens every error.
inline std::vector<int64_t> item_starts(const char* name, at::IntArrayRef slots, at::IntArrayRef query_lens,
                                        at::IntArrayRef fresh, int64_t num_slots, int64_t tokens) {
  const int64_t items = static_cast<int64_t>(slots.size());
  TORCH_CHECK(static_cast<int64_t>(query_lens.size()) == items && static_cast<int64_t>(fresh.size()) == items,
              name, ": one slot, length and fresh flag per item");
  std::vector<int64_t> first(items + 1, 0);
  std::unordered_set<int64_t> seen;
  for (int64_t i = 0; i < items; ++i) {
    TORCH_CHECK(slots[i] >= 0 && slots[i] < num_slots, name, ": slot ", slots[i], " out of range");
    TORCH_CHECK(seen.insert(slots[i]).second, name, ": slot ", slots[i], " belongs to two items");
    first[i + 1] = first[i] + query_lens[i];
  }
  TORCH_CHECK(first[items] == tokens, name, ": the items' tokens are not the step's ", tokens);
  return first;
}

// Runs run(i) for every i < costs.size(), in parallel: the threads claim items one at a time, dearest
// first. Why: at::parallel_for gives each thread an equal count of contiguous items, and a step's
// attention mixes tasks whose costs differ 40-fold (a prompt chunk's queries beside decodes' one): a
// prompt of 38 tokens beside seven decodes ran with one thread doing all of the prompt's tasks. Which
// thread runs an item changes nothing it computes (each writes its own output).
template <typename Run>
void for_each_dearest_first(const std::vector<int64_t>& costs, const Run& run) {
  const int64_t items = static_cast<int64_t>(costs.size());
  std::vector<int64_t> order(items);
  for (int64_t i = 0; i < items; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return costs[a] > costs[b]; });
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), items);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t claimed = next.fetch_add(1); claimed < items; claimed = next.fetch_add(1)) run(order[claimed]);
  });
}

// For a recurrent layer's kernel: task(item, head, its first token, its state) for every (item, head) of a
// step, in parallel, one thread each, the items with the most tokens first (a prompt chunk beside
// decodes); the state is the item's slot's `state_size` floats of the head in `states` [slots, heads,
// state_size], zeroed first for a fresh item.
template <typename Task>
void for_each_item_head(const std::vector<int64_t>& first, at::IntArrayRef slots, at::IntArrayRef fresh,
                        int64_t heads, float* states, int64_t state_size, const Task& task) {
  const int64_t items = static_cast<int64_t>(slots.size());
  std::vector<int64_t> tokens(items * heads);
  for (int64_t index = 0; index < items * heads; ++index) tokens[index] = first[index / heads + 1] - first[index / heads];
  for_each_dearest_first(tokens, [&](int64_t index) {
    const int64_t i = index / heads, h = index % heads;
    float* state = states + (slots[i] * heads + h) * state_size;
    if (fresh[i]) std::memset(state, 0, sizeof(float) * state_size);
    task(i, h, first[i], state);
  });
}

// the lanes' sum in a fixed order: the parts, then four-lane pieces, then the last four as a tree
inline float sum_lanes(const Lanes& v) {
  Native whole = v.part[0];
  for (int p = 1; p < kParts; ++p) whole += v.part[p];
  typedef float Four __attribute__((vector_size(4 * sizeof(float))));
  Four four = {};
  for (int64_t i = 0; i < kNativeFloats; i += 4) {
    Four piece;
    std::memcpy(&piece, reinterpret_cast<const float*>(&whole) + i, sizeof piece);
    four += piece;
  }
  return (four[0] + four[1]) + (four[2] + four[3]);
}

// sum_lanes of four vectors, each sum's additions exactly sum_lanes's: on AVX-512 the four are
// transposed by 128-bit pieces so that one vector add does a step of all four sums
inline void sum_lanes_of_four(const Lanes (&v)[4], float (&sums)[4]) {
#if defined(__AVX512F__)
  const __m512 v0 = bits_as<__m512>(v[0].part[0]), v1 = bits_as<__m512>(v[1].part[0]);
  const __m512 v2 = bits_as<__m512>(v[2].part[0]), v3 = bits_as<__m512>(v[3].part[0]);
  // pieces[i] holds piece i (lanes 4i..4i+3) of v0, v1, v2 and v3
  const __m512 low01 = _mm512_shuffle_f32x4(v0, v1, 0x44), high01 = _mm512_shuffle_f32x4(v0, v1, 0xEE);
  const __m512 low23 = _mm512_shuffle_f32x4(v2, v3, 0x44), high23 = _mm512_shuffle_f32x4(v2, v3, 0xEE);
  const __m512 pieces[4] = {_mm512_shuffle_f32x4(low01, low23, 0x88), _mm512_shuffle_f32x4(low01, low23, 0xDD),
                            _mm512_shuffle_f32x4(high01, high23, 0x88), _mm512_shuffle_f32x4(high01, high23, 0xDD)};
  __m512 four = _mm512_setzero_ps();
  for (const __m512& piece : pieces) four = _mm512_add_ps(four, piece);
  const __m512 pairs = _mm512_add_ps(four, _mm512_permute_ps(four, 0xB1));    // four[0] + four[1], four[2] + four[3]
  const __m512 whole = _mm512_add_ps(pairs, _mm512_permute_ps(pairs, 0x4E));  // their sum, in lane 0 of each piece
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, whole);
  for (int u = 0; u < 4; ++u) sums[u] = lanes[4 * u];
#else
  for (int u = 0; u < 4; ++u) sums[u] = sum_lanes(v[u]);
#endif
}

// The layer's elementwise operations, which the Python layers (model/ops.py CpuKernelOps) and the
// compiled step (cpu_step.cpp) share so that both round alike (elementwise.cpp):
// (x + residual) and weight * ((x + residual) / sqrt(mean((x + residual)^2) + eps)) over the last
// dimension, x alone where there is no residual; each row's sum of squares in one fixed order.
struct NormedRows {
  at::Tensor out, residual;
};
NormedRows add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
                        double eps);
// silu(gate) * up for gate_up [..., 2 * n] = (gate, up): [..., n] in gate_up's dtype
at::Tensor silu_and_mul(const at::Tensor& gate_up);

// A weight [out, in] laid out for `linear`: [ceil(out / 16), in, 16] (output blocks of 16, each
// block's 16 weights of one input column side by side; the last block padded with zeros), in the
// weight's dtype (fp32 or bf16).
at::Tensor pack_linear(const at::Tensor& weight);

// x [rows, in] @ W^T + bias -> [rows, out_features] in x's dtype, W packed by `pack_linear` (fp32,
// bf16) or by ggml_quants.pack_ggml (uint8: GGUF blocks decoded in registers, ggml_formats.h). Every
// output element is one fp32 chain of multiply-adds (fused where the CPU can) over the inputs in
// ascending order, plus the bias, rounded once to x's dtype; a GGUF weight packed for int8
// activations instead sums exact integer dot products of the row's 8-bit inputs per sub-block, then
// one fp32 multiply and add per sub-block (linear.cpp). Either way a row's result is the same
// whatever the row count, so it never depends on what else ran in its step.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                  int64_t out_features);

// Rows `rows` of a weight packed by pack_ggml, dequantized: fp32 [len(rows), in] (a quantized
// embedding's lookups; the whole matrix for tests)
at::Tensor ggml_rows(const at::Tensor& packed, const at::Tensor& rows);

// Attention of the short rows (at most `max_query` new tokens) of a step, read in place from the
// paged cache [blocks, block_size, kv_heads, head_dim] through `block_table` [rows, width]: row b's
// new tokens are q's rows from sum(query_lens[:b]) on, the last of its seq_lens[b] tokens, and query
// i of n sees keys 0 .. seq_lens[b] - n + i (with a `window` > 0, only the last `window` of them).
// Scores are scale * q.k, then softcap * tanh(score / softcap) where softcap > 0; `sinks` (one
// logit per q head) add e^sink to each softmax's denominator. Writes those rows of `out` [T, heads,
// head_dim]; rows with more new tokens are left alone. A row's result depends on its own query, keys
// and values only (keys are split into fixed partitions of their positions, merged in order), and
// keys outside every window of a row are never read.
void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_table, at::IntArrayRef seq_lens, at::IntArrayRef query_lens,
                     double scale, int64_t max_query, const at::Tensor& out, int64_t window,
                     const std::optional<at::Tensor>& sinks, double softcap);

}  // namespace radixserve
