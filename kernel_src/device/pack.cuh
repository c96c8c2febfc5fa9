// Device helpers (kernel_src/device/): Packs (N consecutive elements moved with the widest aligned
// accesses and kept in registers), asynchronous global -> shared copies, run-time-dtype loads and
// the staging of per-channel vectors (norm weight, bias) into shared memory.
#pragma once

#include <type_traits>

#include "../ltx_kernels.h"
#include "convert.cuh"

namespace ltx {

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

}  // namespace ltx
