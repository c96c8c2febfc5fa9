// RMSNorm over the last dimension (CUDA), with diffusers' RMSNorm rounding points
// (see ltx_rmsnorm_cuda in ltx_kernels.h).
#include <algorithm>

#include "device_utils.cuh"

namespace ltx {
namespace {

constexpr int kSlots = 8;              // packs a thread caches in registers (cached kernel)
constexpr int kMaxThreadsPerRow = 1024;
constexpr int kRowBlockThreads = 256;  // block size when several rows share a block
constexpr size_t kMaxStagedWeightBytes = 32 * 1024;  // weights staged in shared memory
constexpr int kRegisterWeightMaxThreads = 256;        // blocks of the weight-in-registers kernel

template <typename Tx, typename Tw, typename To>
struct RmsNormArgs {
  To* out;
  RowIndex out_rows;
  const Tx* x;
  RowIndex x_rows;
  const Tw* weight;  // unused when Tw is NoWeight
  int64_t rows;
  int hidden;
  float inv_hidden;
  float eps;
};

// Output value for the normalized y = float(x) * rsqrt(...), rounded where diffusers rounds.
template <typename Tw>
__device__ __forceinline__ float rms_output(float y, float w) {
  if constexpr (!has_weight_v<Tw>) {
    return y;
  } else if constexpr (std::is_same_v<Tw, float>) {
    return y * w;
  } else {
    return round_to<Tw>(y) * w;  // `.to(weight.dtype) * weight`
  }
}

// Blocks of `threads` threads of kKernel that fit on one SM (cached per kernel and block size).
template <auto kKernel>
int resident_blocks_per_sm(int threads) {
  static int cache[kMaxThreadsPerRow / 32 + 1] = {};
  int& blocks = cache[threads / 32];
  if (blocks == 0 && cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kKernel, threads, 0) !=
                         cudaSuccess) {
    cudaGetLastError();  // clear it; fall back to the bandwidth-bound path
    blocks = -1;
  }
  return blocks;
}

// Row-cached RMSNorm. Each row is owned by tpr = 2^log2_tpr consecutive threads of a block (a
// block holds blockDim.x / tpr rows). Thread t of a row loads packs t, t + tpr, ... (kVec
// elements each, at most kSlots of them) into registers, so x is read from memory exactly once.
// All x loads are issued first. The weight's packs either follow into registers
// (kWeightInRegisters: for grids of one wave, where latency rules), or, while x is in flight, the
// block copies the whole weight into shared memory (`stage_weight`; else it is read from global
// memory after the reduction). The sum of squares is reduced across the row's threads (shuffles,
// then shared memory when the row spans several warps), and the cached packs are scaled and stored.
template <typename Tx, typename Tw, typename To, int kVec, bool kWeightInRegisters>
__global__ void __launch_bounds__(kWeightInRegisters ? kRegisterWeightMaxThreads : kMaxThreadsPerRow)
    rmsnorm_cached_kernel(const RmsNormArgs<Tx, Tw, To> a, const int log2_tpr,
                          const bool stage_weight) {
  constexpr bool kHasWeight = has_weight_v<Tw>;
  extern __shared__ __align__(16) unsigned char staged_weight_bytes[];
  __shared__ float warp_partials[kMaxThreadsPerRow / 32];
  const int tpr = 1 << log2_tpr;
  const int lane_in_row = threadIdx.x & (tpr - 1);
  const int64_t row =
      static_cast<int64_t>(blockIdx.x) * (blockDim.x >> log2_tpr) + (threadIdx.x >> log2_tpr);
  const bool active = row < a.rows;  // inactive threads still join the reductions
  const int n_packs = a.hidden / kVec;
  const Tx* x_row = a.x + (active ? a.x_rows.offset(row) : 0);
  To* out_row = a.out + (active ? a.out_rows.offset(row) : 0);

  wait_for_prior_grids();
  allow_dependent_grids();
  Pack<Tx, kVec> xs[kSlots];
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int p = s * tpr + lane_in_row;
    if (active && p < n_packs) xs[s].load(x_row + static_cast<int64_t>(p) * kVec);
  }

  using RegisterWeight = std::conditional_t<kHasWeight, Tw, float>;
  [[maybe_unused]] Pack<RegisterWeight, kVec> ws[kWeightInRegisters ? kSlots : 1];
  if constexpr (kHasWeight && kWeightInRegisters) {
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int p = s * tpr + lane_in_row;
      if (active && p < n_packs) ws[s].load(a.weight + p * kVec);
    }
  }
  const Tw* weight = nullptr;
  if constexpr (kHasWeight && !kWeightInRegisters) {
    weight = a.weight;
    if (stage_weight) {
      Tw* staged = reinterpret_cast<Tw*>(staged_weight_bytes);
      // Up to 4 packs (64 bytes at most) of weight in flight per thread.
      constexpr int kPackBytes = kVec * sizeof(Tw);
      constexpr int kStageUnroll = kPackBytes >= 64 ? 1 : (kPackBytes >= 16 ? 64 / kPackBytes : 4);
      for (int first = threadIdx.x; first < n_packs; first += kStageUnroll * blockDim.x) {
        Pack<Tw, kVec> w[kStageUnroll];  // loads first, so their latencies overlap
#pragma unroll
        for (int u = 0; u < kStageUnroll; ++u) {
          const int p = first + u * blockDim.x;
          if (p < n_packs) w[u].load(a.weight + p * kVec);
        }
#pragma unroll
        for (int u = 0; u < kStageUnroll; ++u) {
          const int p = first + u * blockDim.x;
          if (p < n_packs) w[u].store(staged + p * kVec);
        }
      }
      weight = staged;
    }
  }

  float sumsq = 0.f;
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int p = s * tpr + lane_in_row;
    if (active && p < n_packs) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) sumsq += xs[s].get(i) * xs[s].get(i);
    }
  }
  sumsq = group_sum(sumsq, tpr < 32 ? tpr : 32);
  if (tpr > 32) {  // same branch for the whole block
    const int warp = threadIdx.x >> 5, warps_per_row = tpr >> 5;
    if ((threadIdx.x & 31) == 0) warp_partials[warp] = sumsq;
    __syncthreads();
    const int first = warp - warp % warps_per_row;
    sumsq = 0.f;
    for (int w = 0; w < warps_per_row; ++w) sumsq += warp_partials[first + w];
  }
  if (kHasWeight && stage_weight) __syncthreads();  // the staged weight is complete
  if (!active) return;
  const float rstd = rsqrtf(sumsq * a.inv_hidden + a.eps);

#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int p = s * tpr + lane_in_row;
    if (p < n_packs) {
      const int col = p * kVec;
      Pack<To, kVec> o;
      if constexpr (kHasWeight && kWeightInRegisters) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) o.set(i, rms_output<Tw>(xs[s].get(i) * rstd, ws[s].get(i)));
      } else if constexpr (kHasWeight) {
        Pack<Tw, kVec> w;
        if (stage_weight)
          w.load_plain(weight + col);
        else
          w.load(weight + col);
#pragma unroll
        for (int i = 0; i < kVec; ++i) o.set(i, rms_output<Tw>(xs[s].get(i) * rstd, w.get(i)));
      } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) o.set(i, rms_output<Tw>(xs[s].get(i) * rstd, 1.f));
      }
      o.store(out_row + col);
    }
  }
}

// Streaming RMSNorm for rows too long to cache in registers: one block per row (grid-stride over
// rows), scalar accesses, two passes over the row (the second mostly hits L1/L2).
template <typename Tx, typename Tw, typename To>
__global__ void __launch_bounds__(kMaxThreadsPerRow)
    rmsnorm_streaming_kernel(const RmsNormArgs<Tx, Tw, To> a) {
  __shared__ float scratch[32];
  wait_for_prior_grids();
  allow_dependent_grids();
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const Tx* x_row = a.x + a.x_rows.offset(row);
    float sumsq = 0.f;
    for (int i = threadIdx.x; i < a.hidden; i += blockDim.x) {
      const float v = to_float(x_row[i]);
      sumsq += v * v;
    }
    sumsq = block_sum(sumsq, scratch);
    const float rstd = rsqrtf(sumsq * a.inv_hidden + a.eps);
    To* out_row = a.out + a.out_rows.offset(row);
    for (int i = threadIdx.x; i < a.hidden; i += blockDim.x) {
      float w = 1.f;
      if constexpr (has_weight_v<Tw>) w = to_float(a.weight[i]);
      out_row[i] = from_float<To>(rms_output<Tw>(to_float(x_row[i]) * rstd, w));
    }
  }
}

template <typename Tx, typename Tw, typename To, int kVec>
int launch_cached(const RmsNormArgs<Tx, Tw, To>& a, cudaStream_t stream) {
  const int n_packs = a.hidden / kVec;
  int log2_tpr = 0;
  while ((kSlots << log2_tpr) < n_packs) ++log2_tpr;
  const int tpr = 1 << log2_tpr;
  // Several rows per block; fewer when there are few rows, so that every SM gets work. With a
  // weight, blocks hold 4 rows: each block stages the whole weight and waits once at a barrier,
  // and 4 rows balance the rows held up there against the number of weight reads (all blocks
  // read the same few L2 lines); of 4, 8 and 16 rows, 4 measured best on H200 (benchmarks/NOTES.md).
  constexpr bool kHasWeight = has_weight_v<Tw>;
  int threads = std::max(tpr, kHasWeight ? kRowBlockThreads / 2 : kRowBlockThreads);
  const int min_threads = std::max(tpr, kHasWeight ? kRowBlockThreads / 2 : 64);
  auto blocks_for = [&](int t) { return (a.rows + t / tpr - 1) / (t / tpr); };
  while (threads > min_threads && blocks_for(threads) < 2 * sm_count()) threads /= 2;
  const int64_t blocks = blocks_for(threads);
  if (blocks > INT32_MAX) return LTX_ERR_INVALID_ARGUMENT;
  size_t staged_bytes = 0;
  if constexpr (kHasWeight) {
    // Few rows (the grid fits in one wave): latency-bound, so load the weight into registers
    // together with x. Otherwise bandwidth-bound: stage it in shared memory (when it fits), which
    // keeps the register count, and so the occupancy, of the weight-less kernel.
    constexpr auto register_kernel = rmsnorm_cached_kernel<Tx, Tw, To, kVec, true>;
    if (threads <= kRegisterWeightMaxThreads &&
        blocks <= static_cast<int64_t>(resident_blocks_per_sm<register_kernel>(threads)) * sm_count())
      return launch(register_kernel, dim3(static_cast<unsigned>(blocks)), dim3(threads), 0, stream,
                    a, log2_tpr, false);
    const size_t weight_bytes = static_cast<size_t>(a.hidden) * sizeof(Tw);
    if (weight_bytes <= kMaxStagedWeightBytes) staged_bytes = weight_bytes;
  }
  return launch(rmsnorm_cached_kernel<Tx, Tw, To, kVec, false>, dim3(static_cast<unsigned>(blocks)),
                dim3(threads), staged_bytes, stream, a, log2_tpr, staged_bytes > 0);
}

template <typename Tx, typename Tw, typename To>
int launch_streaming(const RmsNormArgs<Tx, Tw, To>& a, cudaStream_t stream) {
  const int64_t blocks = std::min<int64_t>(a.rows, int64_t{1} << 20);
  return launch(rmsnorm_streaming_kernel<Tx, Tw, To>, dim3(static_cast<unsigned>(blocks)),
                dim3(kRowBlockThreads), 0, stream, a);
}

template <typename Tx, typename Tw, typename To>
int rmsnorm_typed(const ltx_rows_t& out, const ltx_rows_t& x, const void* weight, int hidden,
                  float eps, cudaStream_t stream) {
  const RmsNormArgs<Tx, Tw, To> a{static_cast<To*>(out.data),
                                  RowIndex::of(out),
                                  static_cast<const Tx*>(x.data),
                                  RowIndex::of(x),
                                  static_cast<const Tw*>(weight),
                                  num_rows(x),
                                  hidden,
                                  1.f / static_cast<float>(hidden),
                                  eps};
  constexpr int kVec = 16 / sizeof(Tx);
  bool vectorizable = hidden % kVec == 0 && rows_aligned(x, sizeof(Tx), 16) &&
                      rows_aligned(out, sizeof(To), pack_alignment<To, kVec>());
  if constexpr (has_weight_v<Tw>)
    vectorizable = vectorizable &&
                   reinterpret_cast<uintptr_t>(weight) % pack_alignment<Tw, kVec>() == 0;
  if (vectorizable && hidden / kVec <= kSlots * kMaxThreadsPerRow)
    return launch_cached<Tx, Tw, To, kVec>(a, stream);
  if (hidden <= kSlots * kMaxThreadsPerRow) return launch_cached<Tx, Tw, To, 1>(a, stream);
  return launch_streaming<Tx, Tw, To>(a, stream);
}

}  // namespace
}  // namespace ltx

extern "C" int ltx_rmsnorm_cuda(ltx_rows_t out, ltx_rows_t x, const void* weight,
                                ltx_dtype_t weight_dtype, int64_t hidden, float eps,
                                ltx_stream_t stream) {
  using namespace ltx;
  if (!valid_rows(out) || !valid_rows(x) || num_rows(out) != num_rows(x) || hidden < 0 ||
      hidden > INT32_MAX || !(eps >= 0.f))
    return LTX_ERR_INVALID_ARGUMENT;
  if (out.dtype != (weight ? weight_dtype : x.dtype)) return LTX_ERR_INVALID_ARGUMENT;
  if (num_rows(x) == 0 || hidden == 0) return LTX_OK;
  if (!x.data || !out.data) return LTX_ERR_INVALID_ARGUMENT;
  return dispatch_float(x.dtype, [&](auto x_tag) {
    return dispatch_optional_float(weight != nullptr, weight_dtype, [&](auto w_tag) {
      using Tx = typename decltype(x_tag)::type;
      using Tw = typename decltype(w_tag)::type;
      using To = std::conditional_t<has_weight_v<Tw>, Tw, Tx>;
      return rmsnorm_typed<Tx, Tw, To>(out, x, weight, static_cast<int>(hidden), eps,
                                       reinterpret_cast<cudaStream_t>(stream));
    });
  });
}
