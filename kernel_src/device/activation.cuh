// Device helpers (kernel_src/device/): GELU in fp32 (erf and tanh forms), the same code wherever it
// is computed (gelu.cu, quantize.cu).
#pragma once

#include <cuda_runtime.h>

#include "../ltx_kernels.h"

namespace ltx {

// ---------------------------------------------------------------------------------------------
// Activations (gelu.cu, quantize.cu): GELU in fp32, the same code wherever it is computed.
// ---------------------------------------------------------------------------------------------
// GELU, tanh form: 0.5 x (1 + tanh(u)) = x / (1 + e^(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3),
// which has no cancellation for x < 0 (unlike 1 + tanh(u)); with e = e^(-|2u|) <= 1 nothing
// overflows: x / (1 + e) for x >= 0, x e / (1 + e) for x < 0. kFast (16-bit outputs): __expf and
// an approximate reciprocal, about 2^-17 relative error, far below the output rounding and cheap
// enough to keep the kernel memory-bound; otherwise expf and an IEEE division.
template <bool kFast>
__device__ __forceinline__ float gelu_tanh(float x) {
  const float two_u = 1.5957691216057308f * fmaf(0.044715f * x, x * x, x);
  if constexpr (kFast) {
    const float e = __expf(-fabsf(two_u));
    float reciprocal;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(reciprocal) : "f"(1.f + e));
    return (x >= 0.f ? x : x * e) * reciprocal;
  } else {
    const float e = expf(-fabsf(two_u));
    return (x >= 0.f ? x : x * e) / (1.f + e);
  }
}

// GELU, erf form: 0.5 x (1 + erf(x / sqrt(2))). kFast (16-bit outputs): erff, as PyTorch and
// Inductor compute it (1 + erf cancels below x = -4, where the result is below 1e-4 |x|);
// otherwise x Phi(x) with normcdff, accurate in the negative tail but about twice the work.
template <bool kFast>
__device__ __forceinline__ float gelu_erf(float x) {
  if constexpr (kFast)
    return 0.5f * x * (1.f + erff(x * 0.70710678118654752f));
  else
    return x * normcdff(x);
}

template <ltx_gelu_approximate_t kApproximate, typename T>
__device__ __forceinline__ float gelu(float x) {
  if constexpr (kApproximate == LTX_GELU_TANH)
    return gelu_tanh<sizeof(T) == 2>(x);
  else
    return gelu_erf<sizeof(T) == 2>(x);
}

}  // namespace ltx
