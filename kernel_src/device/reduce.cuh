// Device helpers (kernel_src/device/): sums and NaN-propagating maxima over lane groups, warps and
// whole blocks.
#pragma once

#include <cuda_runtime.h>

namespace ltx {

// ---------------------------------------------------------------------------------------------
// Reductions.
// ---------------------------------------------------------------------------------------------
// Sum over aligned groups of `width` lanes (a power of two <= 32); every lane of the warp must
// call it. Each lane gets its group's total.
// Combine operations of the reductions: a sum, and a NaN-propagating max (of absolute values,
// for row quantization scales: a row holding a NaN gets a NaN amax, as torch.amax gives).
struct Plus {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct NanMax {
  __device__ __forceinline__ float operator()(float a, float b) const {
    return (a > b || a != a) ? a : b;
  }
};

template <typename Op = Plus>
__device__ __forceinline__ float group_reduce(float v, int width, Op op = {}) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    if (offset < width) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

__device__ __forceinline__ float group_sum(float v, int width) { return group_reduce(v, width); }

__device__ __forceinline__ float warp_sum(float v) { return group_sum(v, 32); }

// Sum over the whole block; every thread gets the total. `scratch` holds >= 32 floats and may be
// reused right after the call returns to all threads.
template <typename Op = Plus>
__device__ __forceinline__ float block_reduce(float v, float* scratch, Op op = {}) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int num_warps = (blockDim.x + 31) >> 5;
  v = group_reduce(v, 32, op);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = scratch[0];
  for (int w = 1; w < num_warps; ++w) total = op(total, scratch[w]);
  return total;
}

__device__ __forceinline__ float block_sum(float v, float* scratch) {
  return block_reduce(v, scratch);
}

// Sums of N values over the whole block at once (one pair of barriers); every thread gets the
// totals in v. `scratch` holds >= 32 * N floats and may be reused right after the call returns to
// all threads.
template <int N>
__device__ __forceinline__ void block_sums(float (&v)[N], float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int num_warps = (blockDim.x + 31) >> 5;
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = group_reduce(v[j], 32);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < N; ++j) scratch[j * 32 + warp] = v[j];
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < N; ++j) {
    float total = scratch[j * 32];
    for (int w = 1; w < num_warps; ++w) total += scratch[j * 32 + w];
    v[j] = total;
  }
}

}  // namespace ltx
