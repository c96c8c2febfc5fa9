// (Residual +) RMSNorm/LayerNorm + AdaLN modulation over the last dimension (CUDA), in one pass
// over memory, with the rounding points of the PyTorch code it replaces (see
// ltx_norm_modulate_cuda in ltx_kernels.h).
#include <algorithm>
#include <cstring>

#include "device_utils.cuh"

namespace ltx {
namespace {

// Blocks of at most 256 threads (so up to 255 registers per thread: x, y and the gate of a row
// slice are in registers at once); a row is cached by at most 256 threads, longer rows stream.
constexpr int kMaxThreadsPerRow = 256;
constexpr int kRowBlockThreads = 256;              // block size when several rows share a block
constexpr size_t kMaxStagedBytes = 48 * 1024;       // weight + bias staged in shared memory (fp32)

// Row operands of one launch; Tx: activations (x, y, h, out), Tm: scale, shift and gate.
template <typename Tx, typename Tm>
struct NormModulateArgs {
  Tx* out;
  RowIndex out_rows;
  Tx* residual_out;  // h; null unless y is given
  RowIndex residual_out_rows;
  const Tx* x;
  RowIndex x_rows;
  const Tx* y;  // null: no residual
  RowIndex y_rows;
  const Tm* gate;  // null: h = x + y
  RowIndex gate_rows;
  const Tm* scale;  // null: no scale step
  RowIndex scale_rows;
  const Tm* shift;  // null: no shift step
  RowIndex shift_rows;
  ltx_vector_t weight, bias;
  bool layer_norm;
  bool stage_vectors;  // weight/bias copied to shared memory as fp32 (else read from global)
  int64_t rows;
  int hidden;
  float inv_hidden;
  float eps;
};

// R(v) of ltx_kernels.h: rounds to Tx unless the op computes in fp32 (upcast).
template <typename Tx, bool kUpcast>
__device__ __forceinline__ float step(float v) {
  if constexpr (kUpcast) return v;
  else return round_to<Tx>(v);
}

// Native pairs of 16-bit values (one 32-bit word of a Pack: element 2j in the low half). A
// product or sum of two fp16/bf16 values rounded once by the pair instructions equals PyTorch's
// fp32 operation followed by a rounding (the fp32 result is exact, or too far from a tie to
// round differently), so the model-dtype steps of the modulation run two elements per
// instruction. The _rn forms keep the compiler from contracting a product and a sum into one
// fma (which would drop a rounding).
template <typename T> struct PairOf;
template <> struct PairOf<__nv_bfloat16> { using type = __nv_bfloat162; };
template <> struct PairOf<__half> { using type = __half2; };
template <typename T> using pair_t = typename PairOf<T>::type;

template <typename T>
__device__ __forceinline__ pair_t<T> word_to_pair(uint32_t word) {
  pair_t<T> pair;
  memcpy(&pair, &word, sizeof word);
  return pair;
}
template <typename P>
__device__ __forceinline__ uint32_t pair_to_word(P pair) {
  uint32_t word;
  memcpy(&word, &pair, sizeof word);
  return word;
}
template <typename T> __device__ __forceinline__ pair_t<T> round_pair(float lo, float hi);
template <> __device__ __forceinline__ __nv_bfloat162 round_pair<__nv_bfloat16>(float lo, float hi) {
  return __floats2bfloat162_rn(lo, hi);
}
template <> __device__ __forceinline__ __half2 round_pair<__half>(float lo, float hi) {
  return __floats2half2_rn(lo, hi);
}

// Calls fn(bool_constant<a>, bool_constant<b>): hoists two uniform flags out of inner loops.
template <typename Fn>
__device__ __forceinline__ void with_flags(bool a, bool b, Fn&& fn) {
  using T = std::true_type;
  using F = std::false_type;
  if (a) {
    if (b) fn(T{}, T{}); else fn(T{}, F{});
  } else {
    if (b) fn(F{}, T{}); else fn(F{}, F{});
  }
}

// Per-channel weight/bias element `col`: from the fp32 copy in shared memory or from global.
__device__ __forceinline__ float channel_value(const float* staged, const ltx_vector_t& v,
                                               bool use_staged, int col) {
  return use_staged ? staged[col] : load_as_float(v.data, v.dtype, col);
}

// Row-cached norm + modulation. Each row is owned by tpr = 2^log2_tpr consecutive threads (a block
// holds blockDim.x / tpr rows); thread t of a row owns packs t, t + tpr, ... (kVec elements, at
// most kSlots), so x and y are read once: all loads of x (and y, gate) are issued first, h is
// formed and written, the loads of scale and shift are issued, the row statistics are reduced
// (shuffles, then shared memory when a row spans warps), and each pack is normalized, scaled,
// shifted and stored.
template <typename Tx, typename Tm, int kVec, int kSlots, bool kUpcast, bool kResidual>
__global__ void __launch_bounds__(kMaxThreadsPerRow)
    norm_modulate_cached_kernel(const NormModulateArgs<Tx, Tm> a, const int log2_tpr) {
  extern __shared__ __align__(16) float staged[];  // [hidden] weight, then [hidden] bias
  __shared__ float partials[kMaxThreadsPerRow / 32];
  const int tpr = 1 << log2_tpr;
  const int lane_in_row = threadIdx.x & (tpr - 1);
  const int64_t row =
      static_cast<int64_t>(blockIdx.x) * (blockDim.x >> log2_tpr) + (threadIdx.x >> log2_tpr);
  const bool active = row < a.rows;  // inactive threads still join the reductions
  const int n_packs = a.hidden / kVec;
  const int64_t r = active ? row : 0;
  // Model-dtype fp16/bf16 arithmetic on native pairs (then Tm == Tx).
  constexpr bool kPairs = !kUpcast && sizeof(Tx) == 2 && kVec % 2 == 0;

  wait_for_prior_grids();
  allow_dependent_grids();
  Pack<Tx, kVec> hs[kSlots];
  {
    const Tx* x_row = a.x + a.x_rows.offset(r);
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int p = s * tpr + lane_in_row;
      if (active && p < n_packs) hs[s].load(x_row + static_cast<int64_t>(p) * kVec);
    }
  }
  if constexpr (kResidual) {
    const Tx* y_row = a.y + a.y_rows.offset(r);
    const Tm* gate_row = a.gate ? a.gate + a.gate_rows.offset(r) : nullptr;
    Tx* h_row = a.residual_out ? a.residual_out + a.residual_out_rows.offset(r) : nullptr;
    Pack<Tx, kVec> ys[kSlots];
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int p = s * tpr + lane_in_row;
      if (active && p < n_packs) ys[s].load(y_row + static_cast<int64_t>(p) * kVec);
    }
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int p = s * tpr + lane_in_row;
      if (active && p < n_packs) {
        if (gate_row) {
          Pack<Tm, kVec> g;
          g.load(gate_row + static_cast<int64_t>(p) * kVec);
          if constexpr (kPairs) {  // h = x + y * gate, each step rounded, two at a time
#pragma unroll
            for (int j = 0; j < kVec / 2; ++j)
              hs[s].w[j] = pair_to_word(__hadd2_rn(word_to_pair<Tx>(hs[s].w[j]),
                                                __hmul2_rn(word_to_pair<Tx>(ys[s].w[j]),
                                                        word_to_pair<Tx>(g.w[j]))));
          } else {
#pragma unroll
            for (int i = 0; i < kVec; ++i)
              hs[s].set(i, hs[s].get(i) + step<Tx, kUpcast>(ys[s].get(i) * g.get(i)));
          }
        } else {
#pragma unroll
          for (int i = 0; i < kVec; ++i) hs[s].set(i, hs[s].get(i) + ys[s].get(i));
        }
        if (h_row) hs[s].store(h_row + static_cast<int64_t>(p) * kVec);
      }
    }
  }

  // scale and shift do not depend on the row statistics: their loads go out before the reduction.
  const Tm* scale_row = a.scale ? a.scale + a.scale_rows.offset(r) : nullptr;
  const Tm* shift_row = a.shift ? a.shift + a.shift_rows.offset(r) : nullptr;
  // (fp16/bf16 ones only: fp32 ones, Wan's, would double the registers; they load in the epilogue.)
  constexpr bool kPrefetchModulation = sizeof(Tm) == 2;
  Pack<Tm, kVec> scales[kSlots], shifts[kSlots];
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int p = s * tpr + lane_in_row;
    if (kPrefetchModulation && active && p < n_packs) {
      if (scale_row) scales[s].load(scale_row + static_cast<int64_t>(p) * kVec);
      if (shift_row) shifts[s].load(shift_row + static_cast<int64_t>(p) * kVec);
    }
  }

  const bool has_weight = a.weight.data != nullptr, has_bias = a.bias.data != nullptr;
  if (a.stage_vectors) {  // overlaps with the loads in flight
    if (has_weight) stage_as_float(staged, a.weight.data, a.weight.dtype, a.hidden);
    if (has_bias) stage_as_float(staged + a.hidden, a.bias.data, a.bias.dtype, a.hidden);
  }

  float sum = 0.f;  // of h (LayerNorm's mean) or of h^2 (RMSNorm)
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int p = s * tpr + lane_in_row;
    if (active && p < n_packs) {
      if (a.layer_norm) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) sum += hs[s].get(i);
      } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) sum += hs[s].get(i) * hs[s].get(i);
      }
    }
  }
  sum = row_sum(sum, tpr, partials);
  float mean = 0.f;
  if (a.layer_norm) {  // two passes over the cached row: mean, then squared deviations
    mean = sum * a.inv_hidden;
    float deviations = 0.f;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int p = s * tpr + lane_in_row;
      if (active && p < n_packs) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          const float d = hs[s].get(i) - mean;
          deviations += d * d;
        }
      }
    }
    sum = row_sum(deviations, tpr, partials);
  }
  if (a.stage_vectors) __syncthreads();  // the staged weight/bias are complete
  if (!active) return;
  const float rstd = rsqrtf(sum * a.inv_hidden + a.eps);

  Tx* out_row = a.out + a.out_rows.offset(row);
  const float* staged_bias = staged + a.hidden;
  // One copy of the loop per combination of the uniform flags (no per-element branches).
  with_flags(scale_row != nullptr, shift_row != nullptr, [&](auto with_scale, auto with_shift) {
    constexpr bool kScale = decltype(with_scale)::value, kShift = decltype(with_shift)::value;
    if (kPairs && !has_weight && !has_bias) {  // n = norm(h), rounded; n * (1 + scale) + shift
      [[maybe_unused]] const auto one = round_pair<std::conditional_t<kPairs, Tx, __half>>(1.f, 1.f);
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int p = s * tpr + lane_in_row;
        if (p < n_packs) {
          Pack<Tx, kVec> o;
          if constexpr (kPairs) {
#pragma unroll
            for (int j = 0; j < kVec / 2; ++j) {
              auto n = round_pair<Tx>((hs[s].get(2 * j) - mean) * rstd,
                                      (hs[s].get(2 * j + 1) - mean) * rstd);
              if constexpr (kScale) n = __hmul2_rn(n, __hadd2_rn(one, word_to_pair<Tx>(scales[s].w[j])));
              if constexpr (kShift) n = __hadd2_rn(n, word_to_pair<Tx>(shifts[s].w[j]));
              o.w[j] = pair_to_word(n);
            }
          }
          o.store(out_row + p * kVec);
        }
      }
      return;
    }
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int p = s * tpr + lane_in_row;
      if (p < n_packs) {
        const int col = p * kVec;
        if constexpr (!kPrefetchModulation) {
          if constexpr (kScale) scales[s].load(scale_row + col);
          if constexpr (kShift) shifts[s].load(shift_row + col);
        }
        Pack<Tx, kVec> o;
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          float n = (hs[s].get(i) - mean) * rstd;
          if (a.layer_norm) {  // F.layer_norm: affine in fp32, one rounding
            if (has_weight) n *= channel_value(staged, a.weight, a.stage_vectors, col + i);
            if (has_bias) n += channel_value(staged_bias, a.bias, a.stage_vectors, col + i);
            n = step<Tx, kUpcast>(n);
          } else if (has_weight) {  // diffusers RMSNorm: `.to(weight.dtype) * weight`
            n = step<Tx, kUpcast>(step<Tx, kUpcast>(n) *
                                  channel_value(staged, a.weight, a.stage_vectors, col + i));
          } else {
            n = step<Tx, kUpcast>(n);
          }
          if constexpr (kScale) n = step<Tx, kUpcast>(n * step<Tx, kUpcast>(1.f + scales[s].get(i)));
          if constexpr (kShift) n += shifts[s].get(i);
          o.set(i, n);
        }
        o.store(out_row + col);
      }
    }
  });
}

// Norm + modulation for rows too long to cache in registers: one block per row (grid-stride),
// scalar accesses; h is recomputed from x, y and gate on each pass over the row (bit-identical),
// and written on the first.
template <typename Tx, typename Tm, bool kUpcast>
__global__ void __launch_bounds__(kRowBlockThreads)
    norm_modulate_streaming_kernel(const NormModulateArgs<Tx, Tm> a) {
  __shared__ float scratch[32];
  wait_for_prior_grids();
  allow_dependent_grids();
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const Tx* x_row = a.x + a.x_rows.offset(row);
    const Tx* y_row = a.y ? a.y + a.y_rows.offset(row) : nullptr;
    const Tm* gate_row = a.gate ? a.gate + a.gate_rows.offset(row) : nullptr;
    Tx* h_row = a.residual_out ? a.residual_out + a.residual_out_rows.offset(row) : nullptr;
    auto h_at = [&](int i) {
      float h = to_float(x_row[i]);
      if (y_row) {
        const float y = to_float(y_row[i]);
        h = round_to<Tx>(h + (gate_row ? step<Tx, kUpcast>(y * to_float(gate_row[i])) : y));
      }
      return h;
    };
    float sum = 0.f;
    for (int i = threadIdx.x; i < a.hidden; i += blockDim.x) {
      const float h = h_at(i);
      if (h_row) h_row[i] = from_float<Tx>(h);
      sum += a.layer_norm ? h : h * h;
    }
    sum = block_sum(sum, scratch);
    float mean = 0.f;
    if (a.layer_norm) {
      mean = sum * a.inv_hidden;
      float deviations = 0.f;
      for (int i = threadIdx.x; i < a.hidden; i += blockDim.x) {
        const float d = h_at(i) - mean;
        deviations += d * d;
      }
      sum = block_sum(deviations, scratch);
    }
    const float rstd = rsqrtf(sum * a.inv_hidden + a.eps);
    const Tm* scale_row = a.scale ? a.scale + a.scale_rows.offset(row) : nullptr;
    const Tm* shift_row = a.shift ? a.shift + a.shift_rows.offset(row) : nullptr;
    Tx* out_row = a.out + a.out_rows.offset(row);
    for (int i = threadIdx.x; i < a.hidden; i += blockDim.x) {
      float n = (h_at(i) - mean) * rstd;
      if (a.layer_norm) {
        if (a.weight.data) n *= load_as_float(a.weight.data, a.weight.dtype, i);
        if (a.bias.data) n += load_as_float(a.bias.data, a.bias.dtype, i);
        n = step<Tx, kUpcast>(n);
      } else if (a.weight.data) {
        n = step<Tx, kUpcast>(step<Tx, kUpcast>(n) * load_as_float(a.weight.data, a.weight.dtype, i));
      } else {
        n = step<Tx, kUpcast>(n);
      }
      if (scale_row) n = step<Tx, kUpcast>(n * step<Tx, kUpcast>(1.f + to_float(scale_row[i])));
      if (shift_row) n += to_float(shift_row[i]);
      out_row[i] = from_float<Tx>(n);
    }
  }
}

template <typename Tx, typename Tm, int kVec, bool kUpcast, bool kResidual>
int launch_cached(NormModulateArgs<Tx, Tm> a, cudaStream_t stream) {
  // 4 packs per thread: x (or h), y, gate, scale and shift of them are in registers at once.
  constexpr int kSlots = 4;
  const int n_packs = a.hidden / kVec;
  int log2_tpr = 0;
  while ((kSlots << log2_tpr) < n_packs) ++log2_tpr;
  const int tpr = 1 << log2_tpr;
  // Several rows per block; fewer when there are few rows, so that every SM gets work.
  int threads = std::max(tpr, kRowBlockThreads);
  const int min_threads = std::max(tpr, 64);
  auto blocks_for = [&](int t) { return (a.rows + t / tpr - 1) / (t / tpr); };
  while (threads > min_threads && blocks_for(threads) < 2 * sm_count()) threads /= 2;
  const int64_t blocks = blocks_for(threads);
  if (blocks > INT32_MAX) return LTX_ERR_INVALID_ARGUMENT;
  const size_t vector_bytes = static_cast<size_t>(a.hidden) * sizeof(float);
  const size_t staged_bytes = (a.weight.data || a.bias.data) ? 2 * vector_bytes : 0;
  a.stage_vectors = staged_bytes > 0 && staged_bytes <= kMaxStagedBytes;
  return launch(norm_modulate_cached_kernel<Tx, Tm, kVec, kSlots, kUpcast, kResidual>,
                dim3(static_cast<unsigned>(blocks)), dim3(threads),
                a.stage_vectors ? staged_bytes : 0, stream, a, log2_tpr);
}

template <typename Tx, typename Tm, bool kUpcast>
int norm_modulate_typed(const ltx_norm_modulate_args_t& args, cudaStream_t stream) {
  const int hidden = static_cast<int>(args.hidden);
  NormModulateArgs<Tx, Tm> a{};
  a.out = static_cast<Tx*>(args.out.data);
  a.out_rows = RowIndex::of(args.out);
  a.x = static_cast<const Tx*>(args.x.data);
  a.x_rows = RowIndex::of(args.x);
  if (args.y.data) {
    a.y = static_cast<const Tx*>(args.y.data);
    a.y_rows = RowIndex::of(args.y);
    a.residual_out = static_cast<Tx*>(args.residual_out.data);
    if (a.residual_out) a.residual_out_rows = RowIndex::of(args.residual_out);
    a.gate = static_cast<const Tm*>(args.gate.data);
    if (a.gate) a.gate_rows = RowIndex::of(args.gate);
  }
  a.scale = static_cast<const Tm*>(args.scale.data);
  if (a.scale) a.scale_rows = RowIndex::of(args.scale);
  a.shift = static_cast<const Tm*>(args.shift.data);
  if (a.shift) a.shift_rows = RowIndex::of(args.shift);
  a.weight = args.weight;
  a.bias = args.bias;
  a.layer_norm = args.norm == LTX_NORM_LAYER;
  a.rows = num_rows(args.x);
  a.hidden = hidden;
  a.inv_hidden = 1.f / static_cast<float>(hidden);
  a.eps = args.eps;

  constexpr int kVec = 16 / sizeof(Tx);
  // Every row of every operand must start on its Pack's alignment (16 bytes at most).
  auto aligned = [&](const ltx_rows_t& r, int elem_bytes) {
    return !r.data || rows_aligned(r, elem_bytes, std::min(16, kVec * elem_bytes));
  };
  const bool vectorizable = hidden % kVec == 0 && aligned(args.x, sizeof(Tx)) &&
                            aligned(args.out, sizeof(Tx)) &&
                            (!a.y || (aligned(args.y, sizeof(Tx)) &&
                                      aligned(args.residual_out, sizeof(Tx)) &&
                                      aligned(args.gate, sizeof(Tm)))) &&
                            aligned(args.scale, sizeof(Tm)) && aligned(args.shift, sizeof(Tm));
  const bool residual = a.y != nullptr;
  constexpr int kMaxCachedPacks = 4 * kMaxThreadsPerRow;  // kSlots packs x 256 threads: rows of
  // up to 8192 bf16 / 4096 fp32 elements (LTX, FLUX, Wan, HunyuanVideo all fit) are cached
  if (vectorizable && hidden / kVec <= kMaxCachedPacks)
    return residual ? launch_cached<Tx, Tm, kVec, kUpcast, true>(a, stream)
                    : launch_cached<Tx, Tm, kVec, kUpcast, false>(a, stream);
  if (hidden <= kMaxCachedPacks)
    return residual ? launch_cached<Tx, Tm, 1, kUpcast, true>(a, stream)
                    : launch_cached<Tx, Tm, 1, kUpcast, false>(a, stream);
  const int64_t blocks = std::min<int64_t>(a.rows, int64_t{1} << 20);
  return launch(norm_modulate_streaming_kernel<Tx, Tm, kUpcast>, dim3(static_cast<unsigned>(blocks)),
                dim3(kRowBlockThreads), 0, stream, a);
}

// An optional row operand is absent (data NULL) or describes `rows` rows.
bool absent_or_rows(const ltx_rows_t& r, int64_t rows) {
  return !r.data || (valid_rows(r) && num_rows(r) == rows);
}

}  // namespace
}  // namespace ltx

extern "C" int ltx_norm_modulate_cuda(const ltx_norm_modulate_args_t* args, ltx_stream_t stream) {
  using namespace ltx;
  if (!args) return LTX_ERR_INVALID_ARGUMENT;
  const ltx_norm_modulate_args_t& a = *args;
  const int64_t rows = num_rows(a.x);
  if (!valid_rows(a.x) || !valid_rows(a.out) || num_rows(a.out) != rows || a.hidden < 0 ||
      a.hidden > INT32_MAX || !(a.eps >= 0.f) ||
      (a.norm != LTX_NORM_RMS && a.norm != LTX_NORM_LAYER))
    return LTX_ERR_INVALID_ARGUMENT;
  const ltx_rows_t* optional_rows[] = {&a.y, &a.gate, &a.scale, &a.shift, &a.residual_out};
  for (const ltx_rows_t* r : optional_rows)
    if (!absent_or_rows(*r, rows)) return LTX_ERR_INVALID_ARGUMENT;
  if ((a.gate.data || a.residual_out.data) && !a.y.data) return LTX_ERR_INVALID_ARGUMENT;
  if (a.bias.data && a.norm != LTX_NORM_LAYER) return LTX_ERR_INVALID_ARGUMENT;
  // Dtypes: activations T; modulation tensors one dtype (T, or fp32 with upcast); weight and
  // bias T (or fp32 with upcast).
  const ltx_dtype_t t = a.x.dtype;
  if (a.out.dtype != t || (a.y.data && a.y.dtype != t) ||
      (a.residual_out.data && a.residual_out.dtype != t))
    return LTX_ERR_INVALID_ARGUMENT;
  const ltx_rows_t* modulation[] = {&a.gate, &a.scale, &a.shift};
  ltx_dtype_t m = t;
  bool have_m = false;
  for (const ltx_rows_t* r : modulation) {
    if (!r->data) continue;
    if (have_m && r->dtype != m) return LTX_ERR_INVALID_ARGUMENT;
    m = r->dtype;
    have_m = true;
  }
  const ltx_vector_t* vectors[] = {&a.weight, &a.bias};
  for (const ltx_vector_t* v : vectors)
    if (v->data && v->dtype != t && !(a.upcast && v->dtype == LTX_FLOAT32))
      return LTX_ERR_UNSUPPORTED_DTYPE;
  if (m != t && !(a.upcast && m == LTX_FLOAT32)) return LTX_ERR_UNSUPPORTED_DTYPE;
  if (rows == 0 || a.hidden == 0) return LTX_OK;
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  return dispatch_float(t, [&](auto x_tag) {
    using Tx = typename decltype(x_tag)::type;
    if (!a.upcast) return norm_modulate_typed<Tx, Tx, false>(a, s);
    if (m == LTX_FLOAT32 || std::is_same_v<Tx, float>)
      return norm_modulate_typed<Tx, float, true>(a, s);
    return norm_modulate_typed<Tx, Tx, true>(a, s);
  });
}
