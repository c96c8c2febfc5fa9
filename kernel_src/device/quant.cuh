// Device helpers (kernel_src/device/): row quantization (ltx_kernels.h, "Quantized outputs"), the
// one epilogue every producer of quantized rows runs, with a policy per format.
//
// A format policy Q gives, for a row's amax, the factor its values are multiplied by and the scale
// stored (Q::of), and the codes of one value (Q::code) and of a pack (Q::store): E4m3Row and
// I8Row. Per-block scales would be one more whose epilogue reduces the amax over a group's lanes
// instead of the row's team.
#pragma once

#include <cuda_fp8.h>
#include <stdint.h>

#include "../ltx_kernels.h"
#include "convert.cuh"
#include "pack.cuh"
#include "reduce.cuh"
#include "rows.cuh"

namespace ltx {

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

// The LTX_QUANT_I8_ROW code of v (already multiplied by the factor): rint, ties to even, clamped
// to +-127 (cvt.rni gives 0 for NaN and saturates infinities; the C twin's ltx_float_to_i8).
__device__ __forceinline__ uint32_t to_i8(float v) {
  const int r = max(-127, min(127, __float2int_rn(v)));
  return static_cast<uint32_t>(r) & 0xffu;
}

// N codes (N <= 8) stored at dst, aligned to N bytes: words[i / 4] holds code i in byte i % 4.
template <int N>
__device__ __forceinline__ void store_codes(uint8_t* dst, const uint32_t (&words)[(N + 3) / 4]) {
  static_assert(N == 1 || N == 2 || N == 4 || N == 8, "1 to 8 codes");
  if constexpr (N == 8)
    *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
  else if constexpr (N == 4)
    *reinterpret_cast<uint32_t*>(dst) = words[0];
  else if constexpr (N == 2)
    *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(words[0]);
  else
    *dst = static_cast<uint8_t>(words[0]);
}

// LTX_QUANT_E4M3_ROW: e4m3 codes rounded to nearest even and saturating (two elements per
// conversion), one fp32 scale per row (ltx_e4m3_row_factor).
struct E4m3Row {
  struct Row {
    float factor;  // 448 / a: multiplies the values
    float scale;   // a / 448: stored for the GEMM
  };

  __device__ __forceinline__ static Row of(float amax) {
    Row row;
    row.factor = ltx_e4m3_row_factor(amax, &row.scale);
    return row;
  }
  __device__ __forceinline__ static uint8_t code(float v) {
    return static_cast<uint8_t>(to_e4m3(v));
  }
  // The N elements of a pack times `factor`, stored as N codes at dst (aligned to N bytes, up to
  // 8).
  template <typename T, int N>
  __device__ __forceinline__ static void store(uint8_t* dst, const Pack<T, N>& pack, float factor) {
    static_assert(N == 1 || N == 2 || N == 4 || N == 8, "1 to 8 elements per pack");
    uint32_t words[(N + 3) / 4] = {};
    if constexpr (N == 1) {
      words[0] = to_e4m3(pack.get(0) * factor);
    } else {
#pragma unroll
      for (int i = 0; i < N; i += 2)
        words[i / 4] |= to_e4m3x2(pack.get(i) * factor, pack.get(i + 1) * factor) << (8 * (i % 4));
    }
    store_codes<N>(dst, words);
  }
};

// LTX_QUANT_I8_ROW: int8 codes (to_i8), one fp32 scale per row (ltx_i8_row_factor).
struct I8Row {
  struct Row {
    float factor;  // 127 / a
    float scale;   // a / 127
  };

  __device__ __forceinline__ static Row of(float amax) {
    Row row;
    row.factor = ltx_i8_row_factor(amax, &row.scale);
    return row;
  }
  __device__ __forceinline__ static uint8_t code(float v) { return static_cast<uint8_t>(to_i8(v)); }
  template <typename T, int N>
  __device__ __forceinline__ static void store(uint8_t* dst, const Pack<T, N>& pack, float factor) {
    uint32_t words[(N + 3) / 4] = {};
#pragma unroll
    for (int i = 0; i < N; ++i) words[i / 4] |= to_i8(pack.get(i) * factor) << (8 * (i % 4));
    store_codes<N>(dst, words);
  }
};

// The policy of an output that is not quantized (rows of T).
struct NotQuantized {};

// Calls fn(TypeTag<Q>{}) with the policy of a quantized format.
template <typename Fn>
int dispatch_quant(ltx_quant_format_t format, Fn&& fn) {
  switch (format) {
    case LTX_QUANT_E4M3_ROW: return fn(TypeTag<E4m3Row>{});
    case LTX_QUANT_I8_ROW: return fn(TypeTag<I8Row>{});
    case LTX_QUANT_NONE: break;
  }
  return LTX_ERR_INVALID_ARGUMENT;
}

// A quantized output as the kernels see it: its rows of one-byte codes, and the scales.
struct QuantOut {
  RowPtr<uint8_t> codes;
  float* scale;

  static QuantOut of(const ltx_rows_t& out, const ltx_quant_t& quant) {
    return QuantOut{RowPtr<uint8_t>::of(out), quant.scale};
  }
};

// The epilogue of a row-cached kernel: this thread's packs of the row (values already rounded to
// T, kSlots packs of kVec elements), the row's amax over the team (row_reduce; kBarrierFirst as
// there), then lane 0 writes the row's scale and every thread the codes of its packs. Every thread
// of the block must call it.
template <typename Q, bool kBarrierFirst, int kSlots, typename T, int kVec>
__device__ __forceinline__ void quantize_row_cached(const Pack<T, kVec> (&packs)[kSlots],
                                                    const RowTeam& team, int n_packs,
                                                    float* partials, const QuantOut& out) {
  float amax = 0.f;
  team.for_each_pack<kSlots>(n_packs, [&](int s, int) { amax = pack_amax(amax, packs[s]); });
  amax = row_reduce<kBarrierFirst>(amax, team, partials, NanMax{});
  if (!team.active) return;
  const typename Q::Row q = Q::of(amax);
  if (team.lane == 0) out.scale[team.row] = q.scale;
  uint8_t* codes = out.codes.row(team.row);
  team.for_each_pack<kSlots>(n_packs, [&](int s, int p) {
    Q::store(codes + static_cast<int64_t>(p) * kVec, packs[s], q.factor);
  });
}

// The epilogue of a streaming kernel (the whole block on one group of n values, a row or a head):
// value_at(i), element i rounded to T, is computed twice (the group's amax, then its codes), its
// scale written to *scale and its codes from `codes` on. Every thread of the block must call it.
template <typename Q, typename ValueAt>
__device__ __forceinline__ void quantize_group_streaming(int n, const ValueAt& value_at,
                                                         float* scratch, uint8_t* codes,
                                                         float* scale) {
  float amax = 0.f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) amax = NanMax{}(amax, fabsf(value_at(i)));
  const typename Q::Row q = Q::of(block_reduce(amax, scratch, NanMax{}));
  if (threadIdx.x == 0) *scale = q.scale;
  for (int i = threadIdx.x; i < n; i += blockDim.x) codes[i] = Q::code(value_at(i) * q.factor);
}

// quantize_group_streaming over row `row` of a quantized output.
template <typename Q, typename ValueAt>
__device__ __forceinline__ void quantize_row_streaming(int64_t row, int n, const ValueAt& value_at,
                                                       float* scratch, const QuantOut& out) {
  quantize_group_streaming<Q>(n, value_at, scratch, out.codes.row(row), out.scale + row);
}

}  // namespace ltx
