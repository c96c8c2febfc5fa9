// Backward of (residual +) RMSNorm/LayerNorm + AdaLN modulation, of rmsnorm and of gated_residual
// (CUDA): the gradients of ltx_norm_backward_cuda (ltx_kernels.h) in fp32, one pass over memory.
#include "device_utils.cuh"

namespace ltx {
namespace {

constexpr int kRowSlice = 16;  // elements of a row per thread: kSlots packs of kVec
constexpr int kMaxThreadsPerRow = LTX_NORM_BACKWARD_MAX_HIDDEN / kRowSlice;  // 512
constexpr int kBlockThreads = 256;             // block size when several chunks share a block
constexpr size_t kMaxSharedBytes = 96 * 1024;  // the sum accumulators of a block's teams
constexpr int kNumSums = 5;
enum SumIndex { kScaleSum, kShiftSum, kGateSum, kWeightSum, kBiasSum };

// Operands of one launch; Tx: activations and their gradients, Tm: gate and scale (and dgate,
// dscale).
template <typename Tx, typename Tm>
struct NormBackwardArgs {
  RowPtr<const Tx> h, y, dout, dh_out;
  RowPtr<const Tm> gate, scale;
  RowPtr<Tx> dx, dy;
  RowPtr<Tm> dscale, dgate;  // per-row gradients
  ltx_vector_t weight, bias;
  float* sums[kNumSums];   // [chunks, hidden] partial sums (SumIndex order); null: not computed
  int sum_slot[kNumSums];  // row of each sum in its team's shared-memory accumulators
  int num_sums;
  bool layer_norm;
  int64_t chunks, chunks_per_group, group_rows;
  int chunk_rows;
  int hidden;
  float inv_hidden, eps;
};

// Chunk-per-team backward: a power-of-two team of tpr threads walks the rows of one chunk
// (ltx_kernels.h), thread `lane` holding packs s * tpr + lane (kSlots of kVec elements) of each row
// in registers. Per row: load h, dout and scale; reduce the statistics of h and mean(dn w yhat)
// (LayerNorm: and mean(dn w)) over the team (row_sum); then per element compute dh and store dx,
// dy and the per-row dscale/dgate, and add the shared operands' terms to the team's fp32
// accumulators in shared memory ([num_sums][hidden] per team; each thread only touches its own
// elements, so no barrier). The chunk's sums are written once at its end. kNorm false is
// gated_residual's backward: dh = dh_out, no statistics.
template <typename Tx, typename Tm, int kVec, bool kNorm>
__global__ void __launch_bounds__(kMaxThreadsPerRow)
    norm_backward_kernel(const NormBackwardArgs<Tx, Tm> a, const int log2_tpr) {
  constexpr int kSlots = kRowSlice / kVec;
  extern __shared__ __align__(16) float accumulators[];  // [teams][num_sums][hidden]
  __shared__ float partials[kMaxThreadsPerRow / 32];
  RowTeam team;
  team.tpr = 1 << log2_tpr;
  team.lane = threadIdx.x & (team.tpr - 1);
  const int team_in_block = threadIdx.x >> log2_tpr;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> log2_tpr) + team_in_block;
  const bool chunk_active = chunk < a.chunks;
  const int64_t group = chunk / a.chunks_per_group;
  const int64_t first_row =
      group * a.group_rows + (chunk - group * a.chunks_per_group) * a.chunk_rows;
  const int64_t end_row = min(first_row + a.chunk_rows, (group + 1) * a.group_rows);
  const int n_packs = a.hidden / kVec;
  float* const acc = accumulators + static_cast<size_t>(team_in_block) * a.num_sums * a.hidden;
  auto accumulator = [&](SumIndex k) {
    return a.sums[k] ? acc + a.sum_slot[k] * a.hidden : nullptr;
  };
  float* const scale_acc = accumulator(kScaleSum);
  float* const shift_acc = accumulator(kShiftSum);
  float* const gate_acc = accumulator(kGateSum);
  float* const weight_acc = accumulator(kWeightSum);
  float* const bias_acc = accumulator(kBiasSum);

  wait_for_prior_grids();
  allow_dependent_grids();
  team.active = chunk_active;
  team.row = first_row;
  float weights[kSlots][kVec];  // this thread's weight elements (1 without a weight)
  team.for_each_pack<kSlots>(n_packs, [&](int s, int p) {
#pragma unroll
    for (int i = 0; i < kVec; ++i)
      weights[s][i] =
          a.weight.data ? load_as_float(a.weight.data, a.weight.dtype, p * kVec + i) : 1.f;
    for (int k = 0; k < a.num_sums; ++k) {
      Pack<float, kVec> zero;
#pragma unroll
      for (int i = 0; i < kVec; ++i) zero.set(i, 0.f);
      zero.store(acc + k * a.hidden + p * kVec);
    }
  });

  for (int i_row = 0; i_row < a.chunk_rows; ++i_row) {
    team.row = first_row + i_row;
    team.active = chunk_active && team.row < end_row;
    const int64_t r = team.active ? team.row : 0;
    const Tm* scale_row = a.scale.row_or_null(r);
    Pack<Tx, kVec> hs[kSlots], gs[kSlots];
    Pack<Tm, kVec> scales[kSlots];
    float mean = 0.f, rstd = 0.f, dot = 0.f, total = 0.f;
    if constexpr (kNorm) {
      // Every thread of the block takes part in the reductions (row_sum synchronizes the block
      // when a row spans several warps), active or not.
      load_packs(hs, a.h.row(r), team, n_packs);
      load_packs(gs, a.dout.row(r), team, n_packs);
      if (scale_row) load_packs(scales, scale_row, team, n_packs);
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
      if (a.layer_norm) {
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
      rstd = rsqrtf(sum * a.inv_hidden + a.eps);
      team.for_each_pack<kSlots>(n_packs, [&](int s, int) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          const float factor = scale_row ? 1.f + scales[s].get(i) : 1.f;
          const float dyw = gs[s].get(i) * factor * weights[s][i];
          dot += dyw * ((hs[s].get(i) - mean) * rstd);
          total += dyw;
        }
      });
      dot = row_sum<true>(dot, team, partials) * a.inv_hidden;
      total = a.layer_norm ? row_sum<true>(total, team, partials) * a.inv_hidden : 0.f;
    }
    if (!team.active) continue;

    const Tx* y_row = a.y.row_or_null(r);
    const Tm* gate_row = a.gate.row_or_null(r);
    const Tx* dh_row = a.dh_out.row_or_null(r);
    Tx* dx_row = a.dx.row_or_null(r);
    Tx* dy_row = a.dy.row_or_null(r);
    Tm* dscale_row = a.dscale.row_or_null(r);
    Tm* dgate_row = a.dgate.row_or_null(r);
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int p = team.pack(s);
      if (p >= n_packs) continue;
      const int col = p * kVec;
      Pack<Tx, kVec> ys, dhs;
      Pack<Tm, kVec> gates;
      if (y_row) ys.load(y_row + col);
      if (gate_row) gates.load(gate_row + col);
      if (dh_row) dhs.load(dh_row + col);
      float dh[kVec];
#pragma unroll
      for (int i = 0; i < kVec; ++i) dh[i] = dh_row ? dhs.get(i) : 0.f;
      if constexpr (kNorm) {
        Pack<float, kVec> scale_sum, shift_sum, weight_sum, bias_sum;
        if (scale_acc) scale_sum.load_plain(scale_acc + col);
        if (shift_acc) shift_sum.load_plain(shift_acc + col);
        if (weight_acc) weight_sum.load_plain(weight_acc + col);
        if (bias_acc) bias_sum.load_plain(bias_acc + col);
        Pack<Tm, kVec> dscale;
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          const float g = gs[s].get(i), yhat = (hs[s].get(i) - mean) * rstd;
          const float dn = g * (scale_row ? 1.f + scales[s].get(i) : 1.f);
          dh[i] += rstd * (dn * weights[s][i] - total - yhat * dot);
          if (scale_acc || dscale_row) {
            float n = yhat * weights[s][i];
            if (a.bias.data) n += load_as_float(a.bias.data, a.bias.dtype, col + i);
            if (scale_acc) scale_sum.set(i, scale_sum.get(i) + g * n);
            dscale.set(i, g * n);
          }
          if (shift_acc) shift_sum.set(i, shift_sum.get(i) + g);
          if (weight_acc) weight_sum.set(i, weight_sum.get(i) + dn * yhat);
          if (bias_acc) bias_sum.set(i, bias_sum.get(i) + dn);
        }
        if (scale_acc) scale_sum.store(scale_acc + col);
        if (shift_acc) shift_sum.store(shift_acc + col);
        if (weight_acc) weight_sum.store(weight_acc + col);
        if (bias_acc) bias_sum.store(bias_acc + col);
        if (dscale_row) dscale.store_global(dscale_row + col);
      }
      Pack<Tx, kVec> dxs, dys;
      Pack<Tm, kVec> dgates;
      Pack<float, kVec> gate_sum;
      if (gate_acc) gate_sum.load_plain(gate_acc + col);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        dxs.set(i, dh[i]);
        dys.set(i, gate_row ? dh[i] * gates.get(i) : dh[i]);
        if (y_row) {
          const float dgate = dh[i] * ys.get(i);
          dgates.set(i, dgate);
          if (gate_acc) gate_sum.set(i, gate_sum.get(i) + dgate);
        }
      }
      if (gate_acc) gate_sum.store(gate_acc + col);
      if (dx_row) dxs.store_global(dx_row + col);
      if (dy_row) dys.store_global(dy_row + col);
      if (dgate_row) dgates.store_global(dgate_row + col);
    }
  }

  // The chunk's sums: each thread copies its own accumulator elements.
  if (!chunk_active) return;
  team.active = true;  // (the last row of a short chunk left it false)
  for (int k = 0; k < kNumSums; ++k) {
    if (!a.sums[k]) continue;
    const float* src = acc + a.sum_slot[k] * a.hidden;
    float* dst = a.sums[k] + chunk * a.hidden;
    team.for_each_pack<kSlots>(n_packs, [&](int, int p) {
      Pack<float, kVec> v;
      v.load_plain(src + p * kVec);
      v.store_global(dst + p * kVec);
    });
  }
}

template <typename Tx, typename Tm, int kVec, bool kNorm>
int launch_backward(NormBackwardArgs<Tx, Tm> a, cudaStream_t stream) {
  constexpr int kSlots = kRowSlice / kVec;
  const int log2_tpr = log2_threads_per_row(a.hidden / kVec, kSlots, kMaxThreadsPerRow);
  const int tpr = 1 << log2_tpr;
  if (int64_t{tpr} * kSlots * kVec < a.hidden) return LTX_ERR_INVALID_ARGUMENT;  // too long
  const size_t team_bytes = static_cast<size_t>(a.num_sums) * a.hidden * sizeof(float);
  // Several chunks per block; fewer when there are few chunks, so that every SM gets work.
  int teams = std::max(1, kBlockThreads / tpr);
  while (teams > 1 &&
         (ceil_div(a.chunks, teams) < 2 * sm_count() || teams * team_bytes > kMaxSharedBytes))
    teams /= 2;
  const size_t shared_bytes = teams * team_bytes;
  const auto kernel = norm_backward_kernel<Tx, Tm, kVec, kNorm>;
  // Above 48 KB of shared memory per block (the static row_sum partials included) needs opting in.
  if (shared_bytes + sizeof(float) * (kMaxThreadsPerRow / 32) > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes));
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  const int64_t blocks = ceil_div(a.chunks, teams);
  if (blocks > INT32_MAX) return LTX_ERR_INVALID_ARGUMENT;
  return launch(kernel, dim3(static_cast<unsigned>(blocks)), dim3(teams * tpr), shared_bytes,
                stream, a, log2_tpr);
}

template <typename Tx, typename Tm>
int norm_backward_typed(const ltx_norm_backward_args_t& args, int64_t rows, cudaStream_t stream) {
  NormBackwardArgs<Tx, Tm> a{};
  a.h = RowPtr<const Tx>::of(args.h);
  a.y = RowPtr<const Tx>::of(args.y);
  a.dout = RowPtr<const Tx>::of(args.dout);
  a.dh_out = RowPtr<const Tx>::of(args.dh_out);
  a.gate = RowPtr<const Tm>::of(args.gate);
  a.scale = RowPtr<const Tm>::of(args.scale);
  a.dx = RowPtr<Tx>::of(args.dx);
  a.dy = RowPtr<Tx>::of(args.dy);
  a.dscale = RowPtr<Tm>::of(args.dscale);
  a.dgate = RowPtr<Tm>::of(args.dgate);
  a.weight = args.weight;
  a.bias = args.bias;
  void* const sums[kNumSums] = {args.dscale_sum, args.dshift_sum, args.dgate_sum, args.dweight_sum,
                                args.dbias_sum};
  for (int k = 0; k < kNumSums; ++k) {
    a.sums[k] = static_cast<float*>(sums[k]);
    a.sum_slot[k] = sums[k] ? a.num_sums++ : -1;
  }
  a.layer_norm = args.norm == LTX_NORM_LAYER;
  a.group_rows = args.group_rows;
  a.chunk_rows = static_cast<int>(std::min<int64_t>(args.chunk_rows, args.group_rows));
  a.chunks_per_group = ceil_div(args.group_rows, a.chunk_rows);
  a.chunks = ltx_norm_backward_chunks(rows, args.group_rows, args.chunk_rows);
  a.hidden = static_cast<int>(args.hidden);
  a.inv_hidden = 1.f / static_cast<float>(args.hidden);
  a.eps = args.eps;

  constexpr int kVec = 16 / sizeof(Tx);
  auto aligned = [&](const ltx_rows_t& r, int elem_bytes) {
    return !r.data || ltx_rows_aligned(&r, elem_bytes, std::min(16, kVec * elem_bytes));
  };
  bool vectorizable = a.hidden % kVec == 0;
  for (const ltx_rows_t* r : {&args.h, &args.y, &args.dout, &args.dh_out, &args.dx, &args.dy})
    vectorizable = vectorizable && aligned(*r, sizeof(Tx));
  for (const ltx_rows_t* r : {&args.gate, &args.scale, &args.dscale, &args.dgate})
    vectorizable = vectorizable && aligned(*r, sizeof(Tm));
  for (void* sum : sums) vectorizable = vectorizable && reinterpret_cast<uintptr_t>(sum) % 16 == 0;
  return with_flags({vectorizable, args.dout.data != nullptr}, [&](auto vector_path, auto norm) {
    constexpr int kVecUsed = decltype(vector_path)::value ? kVec : 1;
    return launch_backward<Tx, Tm, kVecUsed, decltype(norm)::value>(a, stream);
  });
}

}  // namespace
}  // namespace ltx

extern "C" int ltx_norm_backward_cuda(const ltx_norm_backward_args_t* args, ltx_stream_t stream) {
  using namespace ltx;
  const ltx_check_t check = ltx_check_norm_backward(args);
  if (check.status != LTX_OK) return check.status;
  const ltx_norm_backward_args_t& a = *args;
  const ltx_rows_t& ref = a.dout.data ? a.h : a.dh_out;
  const int64_t rows = ltx_num_rows(&ref);
  if (rows == 0 || a.hidden == 0) return LTX_OK;
  if (a.hidden > LTX_NORM_BACKWARD_MAX_HIDDEN || rows > INT32_MAX) return LTX_ERR_INVALID_ARGUMENT;
  const ltx_dtype_t t = ref.dtype;
  const ltx_dtype_t m = a.gate.data ? a.gate.dtype : a.scale.data ? a.scale.dtype : t;
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  return dispatch_float(t, [&](auto x_tag) {
    using Tx = typename decltype(x_tag)::type;
    if (m == LTX_FLOAT32 || std::is_same_v<Tx, float>)
      return norm_backward_typed<Tx, float>(a, rows, s);
    return norm_backward_typed<Tx, Tx>(a, rows, s);
  });
}
