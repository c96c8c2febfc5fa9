// (Residual +) RMSNorm/LayerNorm + AdaLN modulation over the last dimension (CUDA), in one pass
// over memory, with the rounding points of the PyTorch code it replaces (see
// ltx_norm_modulate_cuda in ltx_kernels.h); with a quantized out, the row is quantized in the same
// pass (its codes and scale written instead of the T row).
#include "device_utils.cuh"

namespace ltx {
namespace {

// Blocks of at most 256 threads (so up to 255 registers per thread: x, y and the gate of a row
// slice are in registers at once); a row is cached by at most 256 threads, longer rows stream.
constexpr int kMaxThreadsPerRow = 256;
constexpr int kRowBlockThreads = 256;          // block size when several rows share a block
constexpr size_t kMaxStagedBytes = 48 * 1024;  // weight + bias staged in shared memory (fp32)

// Row operands of one launch; Tx: activations (x, y, h, out), Tm: scale, shift and gate.
template <typename Tx, typename Tm>
struct NormModulateArgs {
  RowPtr<Tx> out;           // T out (null with a quantized out)
  QuantOut out_q;           // quantized out: its codes and scales
  RowPtr<Tx> residual_out;  // h; null unless y is given
  RowPtr<const Tx> x;
  RowPtr<const Tx> y;      // null: no residual
  RowPtr<const Tm> gate;   // null: h = x + y
  RowPtr<const Tm> scale;  // null: no scale step
  RowPtr<const Tm> shift;  // null: no shift step
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
__device__ __forceinline__ float round_unless_upcast(float v) {
  if constexpr (kUpcast)
    return v;
  else
    return round_to<Tx>(v);
}

// Per-channel weight/bias element `col`: from the fp32 copy in shared memory or from global.
__device__ __forceinline__ float channel_value(const float* staged, const ltx_vector_t& v,
                                               bool use_staged, int col) {
  return use_staged ? staged[col] : load_as_float(v.data, v.dtype, col);
}

// Row-cached norm + modulation of [rows, hidden] rows: each row is held by a power-of-two
// RowTeam, kSlots packs of kVec elements per thread, so x and y are read once. Load the row (x,
// and y and gate: h is formed and written), issue the loads of scale and shift, reduce the row
// statistics (row_sum), then normalize, scale, shift and store each pack. Q (a format policy,
// device/quant.cuh; NotQuantized for a T out): the packs of n stay in registers for the quantizing
// epilogue (quantize_row_cached).
template <typename Tx, typename Tm, int kVec, int kSlots, bool kUpcast, bool kResidual, typename Q>
__global__ void __launch_bounds__(kMaxThreadsPerRow)
    norm_modulate_cached_kernel(const NormModulateArgs<Tx, Tm> a, const int log2_tpr) {
  constexpr bool kQuant = !std::is_same_v<Q, NotQuantized>;
  extern __shared__ __align__(16) float staged[];  // [hidden] weight, then [hidden] bias
  __shared__ float partials[kMaxThreadsPerRow / 32];
  const RowTeam team = RowTeam::pow2(log2_tpr, a.rows);
  const int n_packs = a.hidden / kVec;
  const int64_t r = team.active ? team.row : 0;
  // Model-dtype fp16/bf16 arithmetic on native pairs (then Tm == Tx).
  constexpr bool kPairs = !kUpcast && sizeof(Tx) == 2 && kVec % 2 == 0;

  wait_for_prior_grids();
  allow_dependent_grids();
  Pack<Tx, kVec> hs[kSlots];
  load_packs(hs, a.x.row(r), team, n_packs);
  if constexpr (kResidual) {
    const Tx* y_row = a.y.row(r);
    const Tm* gate_row = a.gate.row_or_null(r);
    Tx* h_row = a.residual_out.row_or_null(r);
    Pack<Tx, kVec> ys[kSlots];
    load_packs(ys, y_row, team, n_packs);
    team.for_each_pack<kSlots>(n_packs, [&](int s, int p) {
      if (gate_row) {
        Pack<Tm, kVec> g;
        g.load(gate_row + static_cast<int64_t>(p) * kVec);
        if constexpr (kPairs) {  // h = x + y * gate, each step rounded, two at a time
#pragma unroll
          for (int j = 0; j < kVec / 2; ++j)
            hs[s].w[j] = pair_to_word(
                __hadd2_rn(word_to_pair<Tx>(hs[s].w[j]),
                           __hmul2_rn(word_to_pair<Tx>(ys[s].w[j]), word_to_pair<Tx>(g.w[j]))));
        } else {
#pragma unroll
          for (int i = 0; i < kVec; ++i)
            hs[s].set(i, hs[s].get(i) + round_unless_upcast<Tx, kUpcast>(ys[s].get(i) * g.get(i)));
        }
      } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) hs[s].set(i, hs[s].get(i) + ys[s].get(i));
      }
      if (h_row) hs[s].store(h_row + static_cast<int64_t>(p) * kVec);
    });
  }

  // scale and shift do not depend on the row statistics: their loads go out before the reduction.
  const Tm* scale_row = a.scale.row_or_null(r);
  const Tm* shift_row = a.shift.row_or_null(r);
  // (fp16/bf16 ones only: fp32 ones, Wan's, would double the registers; they load in the epilogue.)
  constexpr bool kPrefetchModulation = sizeof(Tm) == 2;
  Pack<Tm, kVec> scales[kSlots], shifts[kSlots];
  if constexpr (kPrefetchModulation) {
    team.for_each_pack<kSlots>(n_packs, [&](int s, int p) {
      if (scale_row) scales[s].load(scale_row + static_cast<int64_t>(p) * kVec);
      if (shift_row) shifts[s].load(shift_row + static_cast<int64_t>(p) * kVec);
    });
  }

  const bool has_weight = a.weight.data != nullptr, has_bias = a.bias.data != nullptr;
  if (a.stage_vectors) {  // overlaps with the loads in flight
    if (has_weight) stage_as_float(staged, a.weight.data, a.weight.dtype, a.hidden);
    if (has_bias) stage_as_float(staged + a.hidden, a.bias.data, a.bias.dtype, a.hidden);
  }

  float sum = 0.f;  // of h (LayerNorm's mean) or of h^2 (RMSNorm)
  team.for_each_pack<kSlots>(n_packs, [&](int s, int) {
    if (a.layer_norm) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) sum += hs[s].get(i);
    } else {
      add_squares(sum, hs[s]);
    }
  });
  sum = row_sum<true>(sum, team, partials);
  float mean = 0.f;
  if (a.layer_norm) {  // two passes over the cached row: mean, then squared deviations
    mean = sum * a.inv_hidden;
    float deviations = 0.f;
    team.for_each_pack<kSlots>(n_packs, [&](int s, int) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float d = hs[s].get(i) - mean;
        deviations += d * d;
      }
    });
    sum = row_sum<true>(deviations, team, partials);
  }
  if (a.stage_vectors) __syncthreads();  // the staged weight/bias are complete
  if (!kQuant && !team.active) return;   // (quantized: every thread joins the amax reduction)
  const float rstd = rsqrtf(sum * a.inv_hidden + a.eps);

  Tx* out_row = kQuant ? nullptr : a.out.row(team.row);
  // A finished pack of n: stored (T out), or kept in hs[s] for the quantization below.
  auto emit = [&](int s, int p, const Pack<Tx, kVec>& o) {
    if constexpr (kQuant)
      hs[s] = o;
    else
      o.store(out_row + p * kVec);
  };
  const float* staged_bias = staged + a.hidden;
  // One copy of the loop per combination of scale and shift. (layer_norm, weight and bias stay
  // uniform run-time branches: hoisting them too, one copy per combination, took the residual
  // kernels from 80 to 96 registers, 3 to 2 blocks per SM, and doubled the code.)
  with_flags({scale_row != nullptr, shift_row != nullptr}, [&](auto with_scale, auto with_shift) {
    constexpr bool kScale = decltype(with_scale)::value, kShift = decltype(with_shift)::value;
    if (kPairs && !has_weight && !has_bias) {  // n = norm(h), rounded; n * (1 + scale) + shift
      [[maybe_unused]] const auto one =
          round_pair<std::conditional_t<kPairs, Tx, __half>>(1.f, 1.f);
      team.for_each_pack<kSlots>(n_packs, [&](int s, int p) {
        Pack<Tx, kVec> o;
        if constexpr (kPairs) {
#pragma unroll
          for (int j = 0; j < kVec / 2; ++j) {
            auto n = round_pair<Tx>((hs[s].get(2 * j) - mean) * rstd,
                                    (hs[s].get(2 * j + 1) - mean) * rstd);
            if constexpr (kScale)
              n = __hmul2_rn(n, __hadd2_rn(one, word_to_pair<Tx>(scales[s].w[j])));
            if constexpr (kShift) n = __hadd2_rn(n, word_to_pair<Tx>(shifts[s].w[j]));
            o.w[j] = pair_to_word(n);
          }
        }
        emit(s, p, o);
      });
      return;
    }
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int p = team.pack(s);
      if (!team.active || p >= n_packs) continue;
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
          n = round_unless_upcast<Tx, kUpcast>(n);
        } else if (has_weight) {  // diffusers RMSNorm: `.to(weight.dtype) * weight`
          n = round_unless_upcast<Tx, kUpcast>(
              round_unless_upcast<Tx, kUpcast>(n) *
              channel_value(staged, a.weight, a.stage_vectors, col + i));
        } else {
          n = round_unless_upcast<Tx, kUpcast>(n);
        }
        if constexpr (kScale)
          n = round_unless_upcast<Tx, kUpcast>(
              n * round_unless_upcast<Tx, kUpcast>(1.f + scales[s].get(i)));
        if constexpr (kShift) n += shifts[s].get(i);
        o.set(i, n);
      }
      emit(s, p, o);
    }
  });

  if constexpr (kQuant) quantize_row_cached<Q, true>(hs, team, n_packs, partials, a.out_q);
}

// Norm + modulation for rows too long to cache in registers: one block per row (grid-stride),
// scalar accesses; h is recomputed from x, y and gate on each pass over the row (bit-identical),
// and written on the first. Q quantized: the streaming epilogue (quantize_row_streaming), its two
// passes (amax, codes) over n recomputed.
template <typename Tx, typename Tm, bool kUpcast, typename Q>
__global__ void __launch_bounds__(kRowBlockThreads)
    norm_modulate_streaming_kernel(const NormModulateArgs<Tx, Tm> a) {
  __shared__ float scratch[32];
  wait_for_prior_grids();
  allow_dependent_grids();
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const Tx* x_row = a.x.row(row);
    const Tx* y_row = a.y.row_or_null(row);
    const Tm* gate_row = a.gate.row_or_null(row);
    Tx* h_row = a.residual_out.row_or_null(row);
    auto h_at = [&](int i) {
      float h = to_float(x_row[i]);
      if (y_row) {
        const float y = to_float(y_row[i]);
        h = round_to<Tx>(
            h + (gate_row ? round_unless_upcast<Tx, kUpcast>(y * to_float(gate_row[i])) : y));
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
    const Tm* scale_row = a.scale.row_or_null(row);
    const Tm* shift_row = a.shift.row_or_null(row);
    auto n_at = [&](int i) {  // element i of out, rounded to T
      float n = (h_at(i) - mean) * rstd;
      if (a.layer_norm) {
        if (a.weight.data) n *= load_as_float(a.weight.data, a.weight.dtype, i);
        if (a.bias.data) n += load_as_float(a.bias.data, a.bias.dtype, i);
        n = round_unless_upcast<Tx, kUpcast>(n);
      } else if (a.weight.data) {
        n = round_unless_upcast<Tx, kUpcast>(round_unless_upcast<Tx, kUpcast>(n) *
                                             load_as_float(a.weight.data, a.weight.dtype, i));
      } else {
        n = round_unless_upcast<Tx, kUpcast>(n);
      }
      if (scale_row)
        n = round_unless_upcast<Tx, kUpcast>(
            n * round_unless_upcast<Tx, kUpcast>(1.f + to_float(scale_row[i])));
      if (shift_row) n += to_float(shift_row[i]);
      return round_to<Tx>(n);
    };
    if constexpr (!std::is_same_v<Q, NotQuantized>) {
      quantize_row_streaming<Q>(row, a.hidden, n_at, scratch, a.out_q);
    } else {
      Tx* out_row = a.out.row(row);
      for (int i = threadIdx.x; i < a.hidden; i += blockDim.x) out_row[i] = from_float<Tx>(n_at(i));
    }
  }
}

template <typename Tx, typename Tm, int kVec, bool kUpcast, bool kResidual, typename Q>
int launch_cached(NormModulateArgs<Tx, Tm> a, cudaStream_t stream) {
  // 4 packs per thread: x (or h), y, gate, scale and shift of them are in registers at once.
  constexpr int kSlots = 4;
  const CachedRowGrid g =
      cached_row_grid(a.rows, a.hidden / kVec, kSlots, kMaxThreadsPerRow, kRowBlockThreads, 64);
  if (!g.fits()) return LTX_ERR_INVALID_ARGUMENT;
  const size_t vector_bytes = static_cast<size_t>(a.hidden) * sizeof(float);
  const size_t staged_bytes = (a.weight.data || a.bias.data) ? 2 * vector_bytes : 0;
  a.stage_vectors = staged_bytes > 0 && staged_bytes <= kMaxStagedBytes;
  return launch(norm_modulate_cached_kernel<Tx, Tm, kVec, kSlots, kUpcast, kResidual, Q>, g.grid(),
                dim3(g.threads), a.stage_vectors ? staged_bytes : 0, stream, a, g.log2_tpr);
}

template <typename Tx, typename Tm, bool kUpcast>
int norm_modulate_typed(const ltx_norm_modulate_args_t& args, cudaStream_t stream) {
  const int hidden = static_cast<int>(args.hidden);
  NormModulateArgs<Tx, Tm> a{};
  const bool quantized = args.quant.format != LTX_QUANT_NONE;
  if (quantized) {
    a.out_q = QuantOut::of(args.out, args.quant);
  } else {
    a.out = RowPtr<Tx>::of(args.out);
  }
  a.x = RowPtr<const Tx>::of(args.x);
  if (args.y.data) {  // (gate and residual_out come with y)
    a.y = RowPtr<const Tx>::of(args.y);
    a.residual_out = RowPtr<Tx>::of(args.residual_out);
    a.gate = RowPtr<const Tm>::of(args.gate);
  }
  a.scale = RowPtr<const Tm>::of(args.scale);
  a.shift = RowPtr<const Tm>::of(args.shift);
  a.weight = args.weight;
  a.bias = args.bias;
  a.layer_norm = args.norm == LTX_NORM_LAYER;
  a.rows = ltx_num_rows(&args.x);
  a.hidden = hidden;
  a.inv_hidden = 1.f / static_cast<float>(hidden);
  a.eps = args.eps;

  constexpr int kVec = 16 / sizeof(Tx);
  // Every row of every operand must start on its Pack's alignment (16 bytes at most).
  auto aligned = [&](const ltx_rows_t& r, int elem_bytes) {
    return !r.data || ltx_rows_aligned(&r, elem_bytes, std::min(16, kVec * elem_bytes));
  };
  const bool out_aligned =
      quantized ? ltx_rows_aligned(&args.out, 1, kVec) : aligned(args.out, sizeof(Tx));
  const bool vectorizable =
      hidden % kVec == 0 && aligned(args.x, sizeof(Tx)) && out_aligned &&
      (!a.y.data || (aligned(args.y, sizeof(Tx)) && aligned(args.residual_out, sizeof(Tx)) &&
                     aligned(args.gate, sizeof(Tm)))) &&
      aligned(args.scale, sizeof(Tm)) && aligned(args.shift, sizeof(Tm));
  constexpr int kMaxCachedPacks = 4 * kMaxThreadsPerRow;  // kSlots packs x 256 threads: rows of
  // up to 8192 bf16 / 4096 fp32 elements (LTX, FLUX, Wan, HunyuanVideo all fit) are cached
  // (A quantized out takes the kernel its T-output form takes: it quantizes the very same values.)
  auto run = [&](auto q_tag) {
    using Q = typename decltype(q_tag)::type;
    return with_flags({a.y.data != nullptr}, [&](auto has_residual) {
      if (vectorizable && hidden / kVec <= kMaxCachedPacks)
        return launch_cached<Tx, Tm, kVec, kUpcast, has_residual, Q>(a, stream);
      if (hidden <= kMaxCachedPacks)
        return launch_cached<Tx, Tm, 1, kUpcast, has_residual, Q>(a, stream);
      return launch_streaming(norm_modulate_streaming_kernel<Tx, Tm, kUpcast, Q>, a.rows,
                              kRowBlockThreads, stream, a);
    });
  };
  return quantized ? dispatch_quant(args.quant.format, run) : run(TypeTag<NotQuantized>{});
}

}  // namespace
}  // namespace ltx

extern "C" int ltx_norm_modulate_cuda(const ltx_norm_modulate_args_t* args, ltx_stream_t stream) {
  using namespace ltx;
  const ltx_check_t check = ltx_check_norm_modulate(args);
  const int status = launcher_status(check, check.status == LTX_OK ? args->hidden : 0);
  if (status != LTX_OK || ltx_num_rows(&args->x) == 0 || args->hidden == 0) return status;
  const ltx_norm_modulate_args_t& a = *args;
  const ltx_dtype_t t = a.x.dtype;
  // The modulation tensors' one dtype (T, or fp32 with upcast).
  const ltx_dtype_t m = a.gate.data    ? a.gate.dtype
                        : a.scale.data ? a.scale.dtype
                        : a.shift.data ? a.shift.dtype
                                       : t;
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  return dispatch_float(t, [&](auto x_tag) {
    using Tx = typename decltype(x_tag)::type;
    if (!a.upcast) return norm_modulate_typed<Tx, Tx, false>(a, s);
    if (m == LTX_FLOAT32 || std::is_same_v<Tx, float>)
      return norm_modulate_typed<Tx, float, true>(a, s);
    return norm_modulate_typed<Tx, Tx, true>(a, s);
  });
}
