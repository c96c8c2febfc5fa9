// Device helpers (kernel_src/device/): fp16/bf16 <-> fp32 scalar conversions, rounding to a dtype
// and native 16-bit pairs; TypeTag, the dtype tag of dispatch_float.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

namespace ltx {

template <typename T>
struct TypeTag {
  using type = T;
};

// ---------------------------------------------------------------------------------------------
// Scalar conversions. Explicit intrinsics: PyTorch builds with -D__CUDA_NO_HALF_OPERATORS__.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// v rounded to T and widened back: models a `.to(T)` of the PyTorch code a kernel replaces.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_float(from_float<T>(v));
}

// Native pairs of 16-bit values (one 32-bit word of a Pack: element 2j in the low half). A
// product or sum of two fp16/bf16 values rounded once by the pair instructions equals PyTorch's
// fp32 operation followed by a rounding (the fp32 result is exact, or too far from a tie to
// round differently), so model-dtype steps can run two elements per instruction. Use the _rn
// forms (__hmul2_rn, __hadd2_rn): they keep the compiler from contracting a product and a sum
// into one fma (which would drop a rounding).
template <typename T>
struct PairOf;
template <>
struct PairOf<__nv_bfloat16> {
  using type = __nv_bfloat162;
};
template <>
struct PairOf<__half> {
  using type = __half2;
};
template <typename T>
using pair_t = typename PairOf<T>::type;

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
// (round_T(lo), round_T(hi)) with one paired conversion.
template <typename T>
__device__ __forceinline__ pair_t<T> round_pair(float lo, float hi);
template <>
__device__ __forceinline__ __nv_bfloat162 round_pair<__nv_bfloat16>(float lo, float hi) {
  return __floats2bfloat162_rn(lo, hi);
}
template <>
__device__ __forceinline__ __half2 round_pair<__half>(float lo, float hi) {
  return __floats2half2_rn(lo, hi);
}

}  // namespace ltx
