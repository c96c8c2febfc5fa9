// Device helpers shared by every CUDA kernel of ltx_kernels, written once: fp16/bf16 <-> fp32
// conversion and native 16-bit pairs, 16-byte vector loads/stores, weight staging, reductions,
// GELU, FP8 row quantization,
// the row-cached kernels' skeleton (row teams, launch shapes, streaming fallback), the row-chunked
// kernels' skeleton, row addressing of ltx_rows_t, compile-time flags and dtype dispatch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <type_traits>
#include <utility>

#include "checks.h"
#include "ltx_kernels.h"
#include "rows.h"

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

// ---------------------------------------------------------------------------------------------
// Packs: N consecutive elements moved with the widest aligned accesses (16 bytes at most) and
// kept as raw 32-bit words, so they stay in registers; elements are unpacked with bit operations.
// ---------------------------------------------------------------------------------------------
template <int kBytes>
struct RawChunk;
template <>
struct RawChunk<16> {
  using type = uint4;
};
template <>
struct RawChunk<8> {
  using type = uint2;
};
template <>
struct RawChunk<4> {
  using type = unsigned int;
};
template <>
struct RawChunk<2> {
  using type = unsigned short;
};

__device__ __forceinline__ void chunk_to_words(uint4 c, uint32_t* w) {
  w[0] = c.x;
  w[1] = c.y;
  w[2] = c.z;
  w[3] = c.w;
}
__device__ __forceinline__ void chunk_to_words(uint2 c, uint32_t* w) {
  w[0] = c.x;
  w[1] = c.y;
}
__device__ __forceinline__ void chunk_to_words(unsigned int c, uint32_t* w) { w[0] = c; }
__device__ __forceinline__ void chunk_to_words(unsigned short c, uint32_t* w) { w[0] = c; }
template <typename Chunk>
__device__ __forceinline__ Chunk words_to_chunk(const uint32_t* w);
template <>
__device__ __forceinline__ uint4 words_to_chunk<uint4>(const uint32_t* w) {
  return make_uint4(w[0], w[1], w[2], w[3]);
}
template <>
__device__ __forceinline__ uint2 words_to_chunk<uint2>(const uint32_t* w) {
  return make_uint2(w[0], w[1]);
}
template <>
__device__ __forceinline__ unsigned int words_to_chunk<unsigned int>(const uint32_t* w) {
  return w[0];
}
template <>
__device__ __forceinline__ unsigned short words_to_chunk<unsigned short>(const uint32_t* w) {
  return static_cast<unsigned short>(w[0]);
}

// 16-bit pattern <-> float for the 2-byte types.
template <typename T>
__device__ __forceinline__ float bits_to_float(uint32_t bits);
template <>
__device__ __forceinline__ float bits_to_float<__nv_bfloat16>(uint32_t bits) {
  return __uint_as_float(bits << 16);
}
template <>
__device__ __forceinline__ float bits_to_float<__half>(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}
template <typename T>
__device__ __forceinline__ uint32_t float_to_bits(float f);
template <>
__device__ __forceinline__ uint32_t float_to_bits<__nv_bfloat16>(float f) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}
template <>
__device__ __forceinline__ uint32_t float_to_bits<__half>(float f) {
  return __half_as_ushort(__float2half_rn(f));
}

template <typename T, int N>
struct Pack {
  static_assert(sizeof(T) == 4 || sizeof(T) == 2, "fp32, fp16 or bf16 elements");
  static constexpr int kBytes = sizeof(T) * N;
  static constexpr int kChunkBytes = kBytes < 16 ? kBytes : 16;
  static constexpr int kChunks = kBytes / kChunkBytes;
  static constexpr int kWordsPerChunk = kChunkBytes < 4 ? 1 : kChunkBytes / 4;
  using Chunk = typename RawChunk<kChunkBytes>::type;
  uint32_t w[kChunks * kWordsPerChunk];

  // Read-only, cached load (ld.global.nc); `src` must be aligned to kChunkBytes.
  __device__ __forceinline__ void load(const T* src) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
      chunk_to_words(__ldg(reinterpret_cast<const Chunk*>(src) + c), w + c * kWordsPerChunk);
  }
  // Plain load (shared or global memory); `src` must be aligned to kChunkBytes.
  __device__ __forceinline__ void load_plain(const T* src) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
      chunk_to_words(reinterpret_cast<const Chunk*>(src)[c], w + c * kWordsPerChunk);
  }
  __device__ __forceinline__ void store(T* dst) const {
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
      reinterpret_cast<Chunk*>(dst)[c] = words_to_chunk<Chunk>(w + c * kWordsPerChunk);
  }
  // Store to global memory only. In some loops nvcc 13.0 splits store()'s 16-byte stores into
  // four 4-byte stores; __stwb (st.global.wb, the default policy) keeps them whole.
  __device__ __forceinline__ void store_global(T* dst) const {
    if constexpr (kChunkBytes == 16) {
#pragma unroll
      for (int c = 0; c < kChunks; ++c)
        __stwb(reinterpret_cast<uint4*>(dst) + c, words_to_chunk<uint4>(w + 4 * c));
    } else {
      store(dst);
    }
  }
  __device__ __forceinline__ float get(int i) const {
    if constexpr (sizeof(T) == 4) {
      return __uint_as_float(w[i]);
    } else {
      const uint32_t word = w[i / 2];
      return bits_to_float<T>((i & 1) ? word >> 16 : word & 0xffffu);
    }
  }
  __device__ __forceinline__ void set(int i, float f) {
    if constexpr (sizeof(T) == 4) {
      w[i] = __float_as_uint(f);
    } else {
      const uint32_t bits = float_to_bits<T>(f);
      w[i / 2] = (i & 1) ? (w[i / 2] & 0xffffu) | (bits << 16) : (w[i / 2] & 0xffff0000u) | bits;
    }
  }
  // Elements i and i + 1 (i even) set to round_T(lo), round_T(hi): 16-bit types convert both
  // with one paired instruction instead of a conversion and a merge per element.
  __device__ __forceinline__ void set_pair(int i, float lo, float hi) {
    if constexpr (sizeof(T) == 4) {
      set(i, lo);
      set(i + 1, hi);
    } else {
      w[i / 2] = pair_to_word(round_pair<T>(lo, hi));
    }
  }
};

// Bytes a Pack<T, N> needs its address aligned to on the host side.
template <typename T, int N>
constexpr int pack_alignment() {
  return Pack<T, N>::kChunkBytes;
}

// Asynchronous copies global -> shared (cp.async, sm_80+): a thread stages rows ahead without
// holding them in registers. copy_pack_async copies one pack of N elements (aligned as
// Pack<T, N>); packs of other than 4, 8 or 16 bytes are copied at once. A thread's copies form a
// group at each copy_async_commit; copy_async_wait(n) returns once at most n of its groups are
// still in flight, and their data is visible to the thread itself (other threads need a barrier).
template <typename T, int N>
__device__ __forceinline__ void copy_pack_async(T* dst_shared, const T* src) {
  constexpr int kBytes = sizeof(T) * N;
  if constexpr (kBytes == 16 || kBytes == 8 || kBytes == 4) {
    const auto dst = static_cast<uint32_t>(__cvta_generic_to_shared(dst_shared));
    if constexpr (kBytes == 16) {  // bypassing L1: each row is read once
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
    } else {
      asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(dst), "l"(src), "n"(kBytes)
                   : "memory");
    }
  } else {
    Pack<T, N> pack;
    pack.load(src);
    pack.store(dst_shared);
  }
}

__device__ __forceinline__ void copy_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// n = 0, 1 or 2 (the instruction takes a constant).
__device__ __forceinline__ void copy_async_wait(int n) {
  if (n <= 0) {
    asm volatile("cp.async.wait_group 0;" ::: "memory");
  } else if (n == 1) {
    asm volatile("cp.async.wait_group 1;" ::: "memory");
  } else {
    asm volatile("cp.async.wait_group 2;" ::: "memory");
  }
}

// Element i of an array whose dtype is only known at run time, as float (for small per-channel
// vectors such as norm weights; activations use Pack with a compile-time type).
__device__ __forceinline__ float load_as_float(const void* base, ltx_dtype_t dtype, int64_t i) {
  switch (dtype) {
    case LTX_FLOAT16: return __half2float(__ldg(static_cast<const __half*>(base) + i));
    case LTX_BFLOAT16: return __bfloat162float(__ldg(static_cast<const __nv_bfloat16*>(base) + i));
    default: return __ldg(static_cast<const float*>(base) + i);
  }
}

// ---------------------------------------------------------------------------------------------
// Weight staging: block-wide copies of a per-channel vector (norm weight, bias) into shared
// memory, issued while the row loads are in flight. The caller synchronizes (__syncthreads)
// before reading dst.
// ---------------------------------------------------------------------------------------------
// n_packs packs of N elements from global src to shared dst, converted to Tdst; each thread has
// kUnroll packs in flight (all loads first, so their latencies overlap).
template <int kUnroll, int N, typename Tdst, typename Tsrc>
__device__ __forceinline__ void stage_packs(Tdst* dst, const Tsrc* src, int n_packs) {
  for (int first = threadIdx.x; first < n_packs; first += kUnroll * blockDim.x) {
    Pack<Tsrc, N> w[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int p = first + u * blockDim.x;
      if (p < n_packs) w[u].load(src + p * N);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int p = first + u * blockDim.x;
      if (p >= n_packs) continue;
      if constexpr (std::is_same_v<Tdst, Tsrc>) {
        w[u].store(dst + p * N);
      } else {
        Pack<Tdst, N> converted;
#pragma unroll
        for (int i = 0; i < N; ++i) converted.set(i, w[u].get(i));
        converted.store(dst + p * N);
      }
    }
  }
}

// n elements of run-time dtype as fp32. `packed` (src 16-byte aligned): 16-byte packs, two per
// thread in flight, then the tail; otherwise element by element.
__device__ __forceinline__ void stage_as_float(float* dst, const void* src, ltx_dtype_t dtype,
                                               int n, bool packed = false) {
  if (!packed) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = load_as_float(src, dtype, i);
    return;
  }
  auto stage = [&](auto type_tag) {
    using Tw = typename decltype(type_tag)::type;
    constexpr int kPerPack = 16 / sizeof(Tw);
    const int n_packs = n / kPerPack;
    stage_packs<2, kPerPack>(dst, static_cast<const Tw*>(src), n_packs);
    for (int i = n_packs * kPerPack + threadIdx.x; i < n; i += blockDim.x)
      dst[i] = to_float(__ldg(static_cast<const Tw*>(src) + i));
  };
  switch (dtype) {
    case LTX_FLOAT16: stage(TypeTag<__half>{}); break;
    case LTX_BFLOAT16: stage(TypeTag<__nv_bfloat16>{}); break;
    default: stage(TypeTag<float>{}); break;
  }
}

// ---------------------------------------------------------------------------------------------
// Reductions.
// ---------------------------------------------------------------------------------------------
// Sum over aligned groups of `width` lanes (a power of two <= 32); every lane of the warp must
// call it. Each lane gets its group's total.
// Combine operations of the reductions: a sum, and a NaN-propagating max (of absolute values,
// for FP8 row scales: a row holding a NaN gets a NaN amax, as torch.amax gives).
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

// ---------------------------------------------------------------------------------------------
// Row-cached kernels (rmsnorm, norm_modulate, qk_norm_rope): each row is owned by a team of tpr
// consecutive threads of a block, and thread `lane` of the team caches the row's packs lane,
// lane + tpr, ... (slot s: pack s * tpr + lane) in registers, so the row is read once: load the
// row, reduce its statistics across the team (row_sum), then the epilogue from registers. Rows
// too long to cache go to a streaming kernel (one block per row, block_sum).
// ---------------------------------------------------------------------------------------------
// Division by a run-time constant d >= 1 of numerators n < 2^31 with a multiply-high, an add and
// a shift (Granlund-Montgomery, as PyTorch's IntDivider); the magic number is found on the host.
struct FastDivider {
  uint32_t divisor, magic, shift;

  static FastDivider of(uint32_t d) {
    uint32_t shift = 0;
    while (shift < 32 && (uint64_t{1} << shift) < d) ++shift;
    const uint64_t magic = ((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1;
    return FastDivider{d, static_cast<uint32_t>(magic), shift};
  }
  __device__ __forceinline__ int div(int n) const {
    const uint32_t u = static_cast<uint32_t>(n);
    return static_cast<int>((__umulhi(u, magic) + u) >> shift);
  }
};

// This thread's place in a row-cached kernel.
struct RowTeam {
  int tpr;      // threads per row: a power of two up to 32, else whole warps
  int lane;     // this thread's index in its row's team
  int64_t row;  // this thread's row
  bool active;  // row < rows; inactive threads still join the block's reductions and barriers

  // Power-of-two teams (tpr = 2^log2_tpr); block b holds rows b * blockDim.x / tpr on.
  __device__ __forceinline__ static RowTeam pow2(int log2_tpr, int64_t rows) {
    RowTeam t;
    t.tpr = 1 << log2_tpr;
    t.lane = threadIdx.x & (t.tpr - 1);
    t.row = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> log2_tpr) + (threadIdx.x >> log2_tpr);
    t.active = t.row < rows;
    return t;
  }
  // Teams of any size (a power of two up to 32, else whole warps); the block holds rows
  // first_row on.
  __device__ __forceinline__ static RowTeam of(const FastDivider& tpr, int64_t first_row,
                                               int64_t rows) {
    RowTeam t;
    t.tpr = static_cast<int>(tpr.divisor);
    const int row_in_block = tpr.div(threadIdx.x);
    t.lane = threadIdx.x - row_in_block * t.tpr;
    t.row = first_row + row_in_block;
    t.active = t.row < rows;
    return t;
  }
  // The pack of the row that slot s holds (when below the row's pack count).
  __device__ __forceinline__ int pack(int s) const { return s * tpr + lane; }
  // Calls fn(s, pack(s)) for each slot s of this thread that holds a pack of a row of n_packs
  // packs (none when inactive). (Long epilogues are plain loops: nvcc schedules them better than
  // a lambda body.)
  template <int kSlots, typename Fn>
  __device__ __forceinline__ void for_each_pack(int n_packs, const Fn& fn) const {
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int p = pack(s);
      if (active && p < n_packs) fn(s, p);
    }
  }
};

// Loads this thread's packs of a row (`row` points at its first element).
template <int kSlots, typename T, int N>
__device__ __forceinline__ void load_packs(Pack<T, N> (&packs)[kSlots], const T* row,
                                           const RowTeam& team, int n_packs) {
  team.for_each_pack<kSlots>(
      n_packs, [&](int s, int p) { packs[s].load(row + static_cast<int64_t>(p) * N); });
}

// sum += the square of each element of a pack, in order (the order of the fp32 rounding steps).
template <typename T, int N>
__device__ __forceinline__ void add_squares(float& sum, const Pack<T, N>& pack) {
#pragma unroll
  for (int i = 0; i < N; ++i) sum += pack.get(i) * pack.get(i);
}

// Sum over the threads of the team; every thread gets its row's total. Rows wider than a warp go
// through `partials` (shared memory, >= blockDim.x / 32 floats). Every thread of the block must
// call it. kBarrierFirst waits until every thread is done reading partials from an earlier call.
template <bool kBarrierFirst, typename Op = Plus>
__device__ __forceinline__ float row_reduce(float v, const RowTeam& team, float* partials,
                                            Op op = {}) {
  v = group_reduce(v, team.tpr < 32 ? team.tpr : 32, op);
  if (team.tpr > 32) {  // the same branch for the whole block
    const int warp = threadIdx.x >> 5, warps_per_row = team.tpr >> 5;
    if constexpr (kBarrierFirst) __syncthreads();
    if ((threadIdx.x & 31) == 0) partials[warp] = v;
    __syncthreads();
    const int first = warp - warp % warps_per_row;  // the row's first warp
    v = partials[first];
    for (int w = 1; w < warps_per_row; ++w) v = op(v, partials[first + w]);
  }
  return v;
}

template <bool kBarrierFirst>
__device__ __forceinline__ float row_sum(float v, const RowTeam& team, float* partials) {
  return row_reduce<kBarrierFirst>(v, team, partials);
}

// Streaming kernels: rsqrt(mean(row^2) + eps) of a row of n elements, read by the whole block.
template <typename T>
__device__ __forceinline__ float block_rstd(const T* row, int n, float inv_n, float eps,
                                            float* scratch) {
  float sumsq = 0.f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = to_float(row[i]);
    sumsq += v * v;
  }
  return rsqrtf(block_sum(sumsq, scratch) * inv_n + eps);
}

// ---------------------------------------------------------------------------------------------
// Activations (gelu.cu, quantize_fp8.cu): GELU in fp32, the same code wherever it is computed.
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

// ---------------------------------------------------------------------------------------------
// Rows.
// ---------------------------------------------------------------------------------------------
// Element offset of a row's first element (see ltx_rows_t). Evenly spaced rows (one level) need
// no division; otherwise the row index is split with multiply-shift divisions (FastDivider) when
// it fits in 31 bits (64-bit division is a long emulated sequence on the GPU, on every row's
// critical path).
struct RowIndex {
  int64_t size1, size2;
  int64_t stride0, stride1, stride2;
  FastDivider div1, div2;  // by size1 and size2 (index_31bit only)
  bool flat;               // size[0] == size[1] == 1: offset = row * stride2
  bool index_31bit;        // every row index fits in 31 bits

  static RowIndex of(const ltx_rows_t& r) {
    const int64_t rows = r.size[0] * r.size[1] * r.size[2];
    const bool small = rows <= INT32_MAX;
    return RowIndex{
        r.size[1],
        r.size[2],
        r.stride[0],
        r.stride[1],
        r.stride[2],
        FastDivider::of(small ? static_cast<uint32_t>(std::max<int64_t>(r.size[1], 1)) : 1),
        FastDivider::of(small ? static_cast<uint32_t>(std::max<int64_t>(r.size[2], 1)) : 1),
        r.size[0] == 1 && r.size[1] == 1,
        small};
  }
  __device__ __forceinline__ int64_t offset(int64_t row) const {
    if (flat) return row * stride2;
    if (index_31bit) {
      const int r = static_cast<int>(row);
      const int q = div2.div(r), i2 = r - q * static_cast<int>(size2);
      const int i0 = div1.div(q), i1 = q - i0 * static_cast<int>(size1);
      return i0 * stride0 + i1 * stride1 + i2 * stride2;
    }
    const int64_t i2 = row % size2;
    row /= size2;
    const int64_t i1 = row % size1;
    const int64_t i0 = row / size1;
    return i0 * stride0 + i1 * stride1 + i2 * stride2;
  }
};

// A row operand as the kernels see it: its data and row addressing; data is null for an absent
// optional operand.
template <typename T>
struct RowPtr {
  T* data;
  RowIndex index;

  static RowPtr of(const ltx_rows_t& r) { return RowPtr{static_cast<T*>(r.data), RowIndex::of(r)}; }
  __device__ __forceinline__ T* row(int64_t r) const { return data + index.offset(r); }
  // Row r of a present operand, null for an absent one.
  __device__ __forceinline__ T* row_or_null(int64_t r) const {
    return data ? data + index.offset(r) : nullptr;
  }
  // Row r where `valid`, else the first element (for inactive threads, which never access it).
  __device__ __forceinline__ T* row_if(bool valid, int64_t r) const {
    return data + (valid ? index.offset(r) : 0);
  }
};

// ---------------------------------------------------------------------------------------------
// Compile-time flags and dtype dispatch. Optional operands are null pointers in a kernel's
// arguments; where a kernel's code depends on one, with_flags turns its presence (and any other
// uniform flag) into a compile-time constant: host side to pick a kernel instance, device side to
// pick a copy of a loop, so that no inner loop branches on it. (norm_modulate's epilogue keeps
// three run-time flags, for its register count; see there.)
// ---------------------------------------------------------------------------------------------
template <int I, int N, typename Fn, typename... Known>
__host__ __device__ __forceinline__ decltype(auto) with_flags_from(const bool (&flags)[N], Fn& fn,
                                                                   Known... known) {
  if constexpr (I == N) {
    return fn(known...);
  } else {
    if (flags[I]) return with_flags_from<I + 1>(flags, fn, known..., std::true_type{});
    return with_flags_from<I + 1>(flags, fn, known..., std::false_type{});
  }
}

// fn(std::bool_constant<flags[0]>{}, std::bool_constant<flags[1]>{}, ...).
template <int N, typename Fn>
__host__ __device__ __forceinline__ decltype(auto) with_flags(const bool (&flags)[N], Fn&& fn) {
  return with_flags_from<0>(flags, fn);
}

// Calls fn(TypeTag<T>{}) with the C++ type of an ltx_dtype_t.
template <typename Fn>
int dispatch_float(ltx_dtype_t dtype, Fn&& fn) {
  switch (dtype) {
    case LTX_FLOAT32: return fn(TypeTag<float>{});
    case LTX_FLOAT16: return fn(TypeTag<__half>{});
    case LTX_BFLOAT16: return fn(TypeTag<__nv_bfloat16>{});
    case LTX_FLOAT64: break;  // the C twins only (ltx_kernels.h)
  }
  return LTX_ERR_UNSUPPORTED_DTYPE;
}

// An attribute of the current device (cached per device; a host-side query, no sync); `fallback`
// (an H100's value) if the query fails.
template <cudaDeviceAttr kAttribute>
int device_attribute(int fallback) {
  static int cache[64] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return fallback;
  if (cache[device] == 0) {
    int value = 0;
    cudaDeviceGetAttribute(&value, kAttribute, device);
    cache[device] = value > 0 ? value : fallback;
  }
  return cache[device];
}

inline int sm_count() { return device_attribute<cudaDevAttrMultiProcessorCount>(132); }

// Blocks of `threads` threads of kKernel that fit on one SM by its registers, threads and static
// shared memory (cached per kernel and block size); -1 if the query fails.
template <auto kKernel>
int resident_blocks_per_sm(int threads) {
  static int cache[1024 / 32 + 1] = {};
  int& blocks = cache[threads / 32];
  if (blocks == 0 &&
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kKernel, threads, 0) != cudaSuccess) {
    cudaGetLastError();  // clear it; the caller falls back
    blocks = -1;
  }
  return blocks;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Launch shapes. Threads per row, as log2, of a kernel with power-of-two row teams: the fewest
// threads, at most max_tpr, that hold a row of `packs` packs at `slots` packs per thread.
inline int log2_threads_per_row(int64_t packs, int slots, int max_tpr) {
  int log2_tpr = 0;
  while ((1 << log2_tpr) < max_tpr && (int64_t{slots} << log2_tpr) < packs) ++log2_tpr;
  return log2_tpr;
}

// Rows per block of a kernel whose rows take tpr threads each: block_threads' worth (at least
// one row), halved down to min_threads' worth while the grid, blocks_for(rows_per_block) blocks,
// would give the SMs fewer than two blocks each (few rows: smaller blocks, so that every SM gets
// work).
template <typename BlocksFor>
int rows_per_block(int tpr, int block_threads, int min_threads, const BlocksFor& blocks_for) {
  int rows = std::max(1, block_threads / tpr);
  const int min_rows = std::max(1, min_threads / tpr);
  while (rows > min_rows && blocks_for(rows) < 2 * sm_count()) rows /= 2;
  return rows;
}

// ---------------------------------------------------------------------------------------------
// Row-chunked elementwise kernels (gelu, gated_residual): rows of `packs` packs, each owned by a
// power-of-two team of tpr threads that take `slots` packs apiece per column chunk; blockIdx.x
// strides over groups of rows (a block holds blockDim.x / tpr rows), blockIdx.y over column
// chunks of tpr * slots packs. Thread t of a row handles packs t, t + tpr, ... of a chunk.
// ---------------------------------------------------------------------------------------------
struct RowChunks {
  int64_t rows;
  int64_t packs;   // packs per row
  int64_t chunks;  // column chunks per row
  int log2_tpr;
};

// tpr is the fewest threads (at most max_threads) that cover a row in one chunk; blocks hold
// max_threads / tpr rows, fewer (down to min_threads' worth) when there are few rows.
struct RowChunkGrid {
  RowChunks shape;
  dim3 grid, block;
};

inline RowChunkGrid row_chunk_grid(int64_t rows, int64_t packs, int slots, int max_threads,
                                   int min_threads) {
  RowChunkGrid g{};
  g.shape.rows = rows;
  g.shape.packs = packs;
  g.shape.log2_tpr = log2_threads_per_row(packs, slots, max_threads);
  const int tpr = 1 << g.shape.log2_tpr;
  g.shape.chunks = ceil_div(packs, int64_t{tpr} * slots);
  const int rows_in_block = rows_per_block(
      tpr, max_threads, min_threads, [&](int r) { return ceil_div(rows, r) * g.shape.chunks; });
  g.grid = dim3(static_cast<unsigned>(std::min<int64_t>(ceil_div(rows, rows_in_block), INT32_MAX)),
                static_cast<unsigned>(std::min<int64_t>(g.shape.chunks, 65535)));
  g.block = dim3(rows_in_block * tpr);
  return g;
}

// This thread's slots in one column chunk of a row: slot s is pack chunk_start + s * tpr + lane.
template <int kVec>
struct ChunkSlots {
  int64_t packs_left;  // packs of the row from the chunk start on
  int64_t col0;        // first element of slot 0
  int tpr, lane;

  __device__ __forceinline__ bool holds(int s) const { return s * tpr + lane < packs_left; }
  __device__ __forceinline__ int64_t col(int s) const {
    return col0 + static_cast<int64_t>(s) * tpr * kVec;
  }
};

// This thread's rows and chunks, visited as
//   for (int64_t row = team.first_row(); row < shape.rows; row += team.row_step)
//     for (int64_t chunk = blockIdx.y; chunk < shape.chunks; chunk += gridDim.y)
//       ... team.slots(chunk) ...
template <int kSlots, int kVec>
struct RowChunkTeam {
  int log2_tpr, tpr, lane, rows_in_block;
  int64_t row_step, chunk_packs, packs;

  __device__ __forceinline__ explicit RowChunkTeam(const RowChunks& shape)
      : log2_tpr(shape.log2_tpr),
        tpr(1 << shape.log2_tpr),
        lane(threadIdx.x & (tpr - 1)),
        rows_in_block(blockDim.x >> shape.log2_tpr),
        row_step(static_cast<int64_t>(gridDim.x) * rows_in_block),
        chunk_packs(static_cast<int64_t>(tpr) * kSlots),
        packs(shape.packs) {}
  __device__ __forceinline__ int64_t first_row() const {
    return static_cast<int64_t>(blockIdx.x) * rows_in_block + (threadIdx.x >> log2_tpr);
  }
  __device__ __forceinline__ ChunkSlots<kVec> slots(int64_t chunk) const {
    const int64_t first = chunk * chunk_packs;  // first pack of the chunk
    return ChunkSlots<kVec>{packs - first, first * kVec + static_cast<int64_t>(lane) * kVec, tpr,
                            lane};
  }
};

// The status a CUDA launcher starts with: its op's argument check (checks.h), then this
// implementation's limit: rows and the sizes within them index with 32-bit ints (longest_size).
inline int launcher_status(const ltx_check_t& check, int64_t longest_size) {
  if (check.status != LTX_OK) return check.status;
  return longest_size > INT32_MAX ? LTX_ERR_INVALID_ARGUMENT : LTX_OK;
}

// The status a launcher returns after its kernel launch.
inline int launch_status() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? LTX_OK : static_cast<int>(err);
}

// ---------------------------------------------------------------------------------------------
// Programmatic dependent launch (PDL, sm_90+). Kernels are launched with programmatic stream
// serialization, so their blocks may become resident while the previous kernel on the stream is
// still finishing. Every kernel therefore calls wait_for_prior_grids() before its first global
// memory access (it returns once the previous grid has completed and its writes are visible) and
// allow_dependent_grids() to let the next kernel start launching early. LTX_KERNELS_PDL=0 turns it
// off (for debugging and A/B timing).
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

bool pdl_enabled();  // defined in launch.cu: LTX_KERNELS_PDL (default on)

// kernel<<<grid, block, smem, stream>>>(args...) with the PDL attribute; returns launch_status().
template <typename... KernelArgs, typename... Args>
int launch(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes,
           cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = pdl_enabled() ? 1 : 0;
  config.attrs = attribute;
  config.numAttrs = 1;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  return err == cudaSuccess ? launch_status() : static_cast<int>(err);
}

// A streaming kernel for `rows` rows: one block of `threads` per row (grid-stride beyond 2^20).
template <typename... KernelArgs, typename... Args>
int launch_streaming(void (*kernel)(KernelArgs...), int64_t rows, int threads, cudaStream_t stream,
                     Args&&... args) {
  const int64_t blocks = std::min<int64_t>(rows, int64_t{1} << 20);
  return launch(kernel, dim3(static_cast<unsigned>(blocks)), dim3(threads), 0, stream,
                std::forward<Args>(args)...);
}

}  // namespace ltx
