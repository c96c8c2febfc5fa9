// Device helpers (kernel_src/device/): FP8 row quantization (e4m3 rows with one fp32 scale each).
#pragma once

#include <cuda_fp8.h>

#include "../ltx_kernels.h"
#include "pack.cuh"
#include "reduce.cuh"

namespace ltx {

// ---------------------------------------------------------------------------------------------
// FP8 row quantization (ltx_kernels.h, "FP8 outputs"): a row's values v (already rounded to the
// op's T), their amax (NaN-propagating), a = max(amax, LTX_FP8_MIN_AMAX), e4m3(v * (448 / a))
// rounded to nearest even and saturating (two elements per conversion), scale = a / 448.
// ---------------------------------------------------------------------------------------------
struct Fp8Row {
  float factor;  // 448 / a: multiplies the values
  float scale;   // a / 448: stored for the GEMM

  __device__ __forceinline__ static Fp8Row of(float amax) {
    const float a = amax > LTX_FP8_MIN_AMAX || amax != amax ? amax : LTX_FP8_MIN_AMAX;
    return Fp8Row{LTX_FP8_MAX / a, a / LTX_FP8_MAX};
  }
};

// amax = NanMax(amax, |element|) over a pack.
template <typename T, int N>
__device__ __forceinline__ float pack_amax(float amax, const Pack<T, N>& pack) {
#pragma unroll
  for (int i = 0; i < N; ++i) amax = NanMax{}(amax, fabsf(pack.get(i)));
  return amax;
}

__device__ __forceinline__ uint32_t to_e4m3(float v) {
  return static_cast<uint32_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// (e4m3(lo), e4m3(hi)) in the low and the high byte, one conversion instruction.
__device__ __forceinline__ uint32_t to_e4m3x2(float lo, float hi) {
  return static_cast<uint32_t>(
      __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}

// The N elements of a pack times `factor`, stored as N e4m3 bytes at dst (aligned to N bytes, up
// to 8).
template <typename T, int N>
__device__ __forceinline__ void store_fp8(uint8_t* dst, const Pack<T, N>& pack, float factor) {
  static_assert(N == 1 || N == 2 || N == 4 || N == 8, "1 to 8 elements per pack");
  uint32_t words[(N + 3) / 4] = {};
  if constexpr (N == 1) {
    words[0] = to_e4m3(pack.get(0) * factor);
  } else {
#pragma unroll
    for (int i = 0; i < N; i += 2)
      words[i / 4] |= to_e4m3x2(pack.get(i) * factor, pack.get(i + 1) * factor) << (8 * (i % 4));
  }
  if constexpr (N == 8)
    *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
  else if constexpr (N == 4)
    *reinterpret_cast<uint32_t*>(dst) = words[0];
  else if constexpr (N == 2)
    *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(words[0]);
  else
    *dst = static_cast<uint8_t>(words[0]);
}

}  // namespace ltx
