// RMSNorm over the last dimension (CUDA), with diffusers' RMSNorm rounding points
// (see ltx_rmsnorm_cuda in ltx_kernels.h).
#include "device_utils.cuh"

namespace ltx {
namespace {

constexpr int kSlots = 8;  // packs a thread caches in registers (cached kernel)
constexpr int kMaxThreadsPerRow = 1024;
constexpr int kRowBlockThreads = 256;                // block size when several rows share a block
constexpr size_t kMaxStagedWeightBytes = 32 * 1024;  // weights staged in shared memory
constexpr int kRegisterWeightMaxThreads = 256;       // blocks of the weight-in-registers kernel

template <typename Tx, typename Tw, typename To>
struct RmsNormArgs {
  RowPtr<To> out;
  RowPtr<const Tx> x;
  const Tw* weight;  // null without a weight
  int64_t rows;
  int hidden;
  float inv_hidden;
  float eps;
};

// Output value for the normalized y = float(x) * rsqrt(...), rounded where diffusers rounds.
template <typename Tw, bool kHasWeight>
__device__ __forceinline__ float rms_output(float y, float w) {
  if constexpr (!kHasWeight) {
    return y;
  } else if constexpr (std::is_same_v<Tw, float>) {
    return y * w;
  } else {
    return round_to<Tw>(y) * w;  // `.to(weight.dtype) * weight`
  }
}

// Row-cached RMSNorm of [rows, hidden] rows: each row is held by a power-of-two RowTeam, kSlots
// packs of kVec elements per thread, so x is read once. Load the row (all x loads first), reduce
// the sum of squares (row_sum), scale by rstd and the weight, store. The weight's packs follow x
// into registers (kWeightInRegisters: grids of one wave, where latency rules), or, while x is in
// flight, the block copies the whole weight into shared memory (`stage_weight`; else it is read
// from global memory after the reduction).
template <typename Tx, typename Tw, typename To, int kVec, bool kHasWeight, bool kWeightInRegisters>
__global__ void __launch_bounds__(kWeightInRegisters ? kRegisterWeightMaxThreads
                                                     : kMaxThreadsPerRow)
    rmsnorm_cached_kernel(const RmsNormArgs<Tx, Tw, To> a, const int log2_tpr,
                          const bool stage_weight) {
  extern __shared__ __align__(16) unsigned char staged_weight_bytes[];
  __shared__ float partials[kMaxThreadsPerRow / 32];
  const RowTeam team = RowTeam::pow2(log2_tpr, a.rows);
  const int n_packs = a.hidden / kVec;
  const Tx* x_row = a.x.row_if(team.active, team.row);
  To* out_row = a.out.row_if(team.active, team.row);

  wait_for_prior_grids();
  allow_dependent_grids();
  Pack<Tx, kVec> xs[kSlots];
  load_packs(xs, x_row, team, n_packs);
  [[maybe_unused]] Pack<Tw, kVec> ws[kWeightInRegisters ? kSlots : 1];
  if constexpr (kWeightInRegisters)
    team.for_each_pack<kSlots>(n_packs, [&](int s, int p) { ws[s].load(a.weight + p * kVec); });
  const Tw* weight = a.weight;
  if constexpr (kHasWeight && !kWeightInRegisters) {
    if (stage_weight) {
      // Up to 4 packs (64 bytes at most) of weight in flight per thread.
      constexpr int kPackBytes = kVec * sizeof(Tw);
      constexpr int kStageUnroll = kPackBytes >= 64 ? 1 : (kPackBytes >= 16 ? 64 / kPackBytes : 4);
      Tw* staged = reinterpret_cast<Tw*>(staged_weight_bytes);
      stage_packs<kStageUnroll, kVec>(staged, a.weight, n_packs);
      weight = staged;
    }
  }

  float sumsq = 0.f;
  team.for_each_pack<kSlots>(n_packs, [&](int s, int) { add_squares(sumsq, xs[s]); });
  sumsq = row_sum<false>(sumsq, team, partials);
  if (kHasWeight && stage_weight) __syncthreads();  // the staged weight is complete
  if (!team.active) return;
  const float rstd = rsqrtf(sumsq * a.inv_hidden + a.eps);

#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int p = team.pack(s);
    if (p >= n_packs) continue;
    const int col = p * kVec;
    Pack<To, kVec> o;
    if constexpr (kWeightInRegisters) {
#pragma unroll
      for (int i = 0; i < kVec; ++i)
        o.set(i, rms_output<Tw, true>(xs[s].get(i) * rstd, ws[s].get(i)));
    } else if constexpr (kHasWeight) {
      Pack<Tw, kVec> w;
      if (stage_weight)
        w.load_plain(weight + col);
      else
        w.load(weight + col);
#pragma unroll
      for (int i = 0; i < kVec; ++i) o.set(i, rms_output<Tw, true>(xs[s].get(i) * rstd, w.get(i)));
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) o.set(i, rms_output<Tw, false>(xs[s].get(i) * rstd, 1.f));
    }
    o.store(out_row + col);
  }
}

// Streaming RMSNorm for rows too long to cache in registers: one block per row (grid-stride over
// rows), scalar accesses, two passes over the row (the second mostly hits L1/L2).
template <typename Tx, typename Tw, typename To, bool kHasWeight>
__global__ void __launch_bounds__(kMaxThreadsPerRow)
    rmsnorm_streaming_kernel(const RmsNormArgs<Tx, Tw, To> a) {
  __shared__ float scratch[32];
  wait_for_prior_grids();
  allow_dependent_grids();
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const Tx* x_row = a.x.row(row);
    const float rstd = block_rstd(x_row, a.hidden, a.inv_hidden, a.eps, scratch);
    To* out_row = a.out.row(row);
    for (int i = threadIdx.x; i < a.hidden; i += blockDim.x) {
      const float w = kHasWeight ? to_float(a.weight[i]) : 1.f;
      out_row[i] = from_float<To>(rms_output<Tw, kHasWeight>(to_float(x_row[i]) * rstd, w));
    }
  }
}

template <typename Tx, typename Tw, typename To, bool kHasWeight, int kVec>
int launch_cached(const RmsNormArgs<Tx, Tw, To>& a, cudaStream_t stream) {
  // Several rows per block; fewer when there are few rows, so that every SM gets work. With a
  // weight, blocks hold 4 rows: each block stages the whole weight and waits once at a barrier,
  // and 4 rows balance the rows held up there against the number of weight reads (all blocks
  // read the same few L2 lines); of 4, 8 and 16 rows, 4 measured best on H200
  // (benchmarks/NOTES.md).
  const int block_threads = kHasWeight ? kRowBlockThreads / 2 : kRowBlockThreads;
  const int min_threads = kHasWeight ? kRowBlockThreads / 2 : 64;
  const CachedRowGrid g = cached_row_grid(a.rows, a.hidden / kVec, kSlots, kMaxThreadsPerRow,
                                          block_threads, min_threads);
  if (!g.fits()) return LTX_ERR_INVALID_ARGUMENT;
  size_t staged_bytes = 0;
  if constexpr (kHasWeight) {
    // Few rows (the grid fits in one wave): latency-bound, so load the weight into registers
    // together with x. Otherwise bandwidth-bound: stage it in shared memory (when it fits), which
    // keeps the register count, and so the occupancy, of the weight-less kernel.
    constexpr auto register_kernel = rmsnorm_cached_kernel<Tx, Tw, To, kVec, true, true>;
    if (g.threads <= kRegisterWeightMaxThreads &&
        g.blocks <=
            static_cast<int64_t>(resident_blocks_per_sm<register_kernel>(g.threads)) * sm_count())
      return launch(register_kernel, g.grid(), dim3(g.threads), 0, stream, a, g.log2_tpr, false);
    const size_t weight_bytes = static_cast<size_t>(a.hidden) * sizeof(Tw);
    if (weight_bytes <= kMaxStagedWeightBytes) staged_bytes = weight_bytes;
  }
  return launch(rmsnorm_cached_kernel<Tx, Tw, To, kVec, kHasWeight, false>, g.grid(),
                dim3(g.threads), staged_bytes, stream, a, g.log2_tpr, staged_bytes > 0);
}

template <typename Tx, typename Tw, typename To, bool kHasWeight>
int rmsnorm_typed(const ltx_rows_t& out, const ltx_rows_t& x, const void* weight, int hidden,
                  float eps, cudaStream_t stream) {
  const RmsNormArgs<Tx, Tw, To> a{RowPtr<To>::of(out),
                                  RowPtr<const Tx>::of(x),
                                  static_cast<const Tw*>(weight),
                                  ltx_num_rows(&x),
                                  hidden,
                                  1.f / static_cast<float>(hidden),
                                  eps};
  constexpr int kVec = 16 / sizeof(Tx);
  const bool vectorizable =
      hidden % kVec == 0 && ltx_rows_aligned(&x, sizeof(Tx), 16) &&
      ltx_rows_aligned(&out, sizeof(To), pack_alignment<To, kVec>()) &&
      (!kHasWeight || reinterpret_cast<uintptr_t>(weight) % pack_alignment<Tw, kVec>() == 0);
  if (vectorizable && hidden / kVec <= kSlots * kMaxThreadsPerRow)
    return launch_cached<Tx, Tw, To, kHasWeight, kVec>(a, stream);
  if (hidden <= kSlots * kMaxThreadsPerRow)
    return launch_cached<Tx, Tw, To, kHasWeight, 1>(a, stream);
  return launch_streaming(rmsnorm_streaming_kernel<Tx, Tw, To, kHasWeight>, a.rows,
                          kRowBlockThreads, stream, a);
}

}  // namespace
}  // namespace ltx

extern "C" int ltx_rmsnorm_cuda(ltx_rows_t out, ltx_rows_t x, const void* weight,
                                ltx_dtype_t weight_dtype, int64_t hidden, float eps,
                                ltx_stream_t stream) {
  using namespace ltx;
  const int status =
      launcher_status(ltx_check_rmsnorm(&out, &x, weight, weight_dtype, hidden, eps), hidden);
  if (status != LTX_OK || ltx_num_rows(&x) == 0 || hidden == 0) return status;
  const cudaStream_t cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  return dispatch_float(x.dtype, [&](auto x_tag) {
    using Tx = typename decltype(x_tag)::type;
    if (!weight)  // Tw stands in as x's type and is never read
      return rmsnorm_typed<Tx, Tx, Tx, false>(out, x, weight, static_cast<int>(hidden), eps,
                                              cuda_stream);
    return dispatch_float(weight_dtype, [&](auto w_tag) {
      using Tw = typename decltype(w_tag)::type;
      return rmsnorm_typed<Tx, Tw, Tw, true>(out, x, weight, static_cast<int>(hidden), eps,
                                             cuda_stream);
    });
  });
}
