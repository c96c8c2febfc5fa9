// Device helpers shared by every CUDA kernel of ltx_kernels, written once:
// fp16/bf16 <-> fp32 conversion, 16-byte vector loads/stores, warp and block reductions,
// row addressing of ltx_rows_t, dtype dispatch and argument checks for the launchers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <type_traits>
#include <utility>

#include "ltx_kernels.h"

namespace ltx {

// ---------------------------------------------------------------------------------------------
// Scalar conversions. Explicit intrinsics: PyTorch builds with -D__CUDA_NO_HALF_OPERATORS__.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// v rounded to T and widened back: models a `.to(T)` of the PyTorch code a kernel replaces.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_float(from_float<T>(v));
}

// ---------------------------------------------------------------------------------------------
// Packs: N consecutive elements moved with the widest aligned accesses (16 bytes at most) and
// kept as raw 32-bit words, so they stay in registers; elements are unpacked with bit operations.
// ---------------------------------------------------------------------------------------------
template <int kBytes> struct RawChunk;
template <> struct RawChunk<16> { using type = uint4; };
template <> struct RawChunk<8> { using type = uint2; };
template <> struct RawChunk<4> { using type = unsigned int; };
template <> struct RawChunk<2> { using type = unsigned short; };

__device__ __forceinline__ void chunk_to_words(uint4 c, uint32_t* w) { w[0] = c.x; w[1] = c.y; w[2] = c.z; w[3] = c.w; }
__device__ __forceinline__ void chunk_to_words(uint2 c, uint32_t* w) { w[0] = c.x; w[1] = c.y; }
__device__ __forceinline__ void chunk_to_words(unsigned int c, uint32_t* w) { w[0] = c; }
__device__ __forceinline__ void chunk_to_words(unsigned short c, uint32_t* w) { w[0] = c; }
template <typename Chunk> __device__ __forceinline__ Chunk words_to_chunk(const uint32_t* w);
template <> __device__ __forceinline__ uint4 words_to_chunk<uint4>(const uint32_t* w) { return make_uint4(w[0], w[1], w[2], w[3]); }
template <> __device__ __forceinline__ uint2 words_to_chunk<uint2>(const uint32_t* w) { return make_uint2(w[0], w[1]); }
template <> __device__ __forceinline__ unsigned int words_to_chunk<unsigned int>(const uint32_t* w) { return w[0]; }
template <> __device__ __forceinline__ unsigned short words_to_chunk<unsigned short>(const uint32_t* w) { return static_cast<unsigned short>(w[0]); }

// 16-bit pattern <-> float for the 2-byte types.
template <typename T> __device__ __forceinline__ float bits_to_float(uint32_t bits);
template <> __device__ __forceinline__ float bits_to_float<__nv_bfloat16>(uint32_t bits) { return __uint_as_float(bits << 16); }
template <> __device__ __forceinline__ float bits_to_float<__half>(uint32_t bits) { return __half2float(__ushort_as_half(static_cast<unsigned short>(bits))); }
template <typename T> __device__ __forceinline__ uint32_t float_to_bits(float f);
template <> __device__ __forceinline__ uint32_t float_to_bits<__nv_bfloat16>(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
template <> __device__ __forceinline__ uint32_t float_to_bits<__half>(float f) { return __half_as_ushort(__float2half_rn(f)); }

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
};

// Bytes a Pack<T, N> needs its address aligned to on the host side.
template <typename T, int N>
constexpr int pack_alignment() {
  return Pack<T, N>::kChunkBytes;
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

// Block-wide copy of n elements of a vector of run-time dtype into shared memory as fp32. The
// caller synchronizes (__syncthreads) before reading dst.
__device__ __forceinline__ void stage_as_float(float* dst, const void* src, ltx_dtype_t dtype,
                                               int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = load_as_float(src, dtype, i);
}

// ---------------------------------------------------------------------------------------------
// Reductions.
// ---------------------------------------------------------------------------------------------
// Sum over aligned groups of `width` lanes (a power of two <= 32); every lane of the warp must
// call it. Each lane gets its group's total.
__device__ __forceinline__ float group_sum(float v, int width) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    if (offset < width) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_sum(float v) { return group_sum(v, 32); }

// Sum over the whole block; every thread gets the total. `scratch` holds >= 32 floats and may be
// reused right after the call returns to all threads.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int num_warps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < num_warps; ++w) total += scratch[w];
  return total;
}

// Sum over the `tpr` consecutive threads that share a row (tpr a power of two <= blockDim.x);
// every thread gets its row's total. Rows wider than a warp go through `partials` (shared memory,
// >= blockDim.x / 32 floats). Every thread of the block must call it; it may be called repeatedly.
__device__ __forceinline__ float row_sum(float v, int tpr, float* partials) {
  v = group_sum(v, tpr < 32 ? tpr : 32);
  if (tpr > 32) {  // the same branch for the whole block
    const int warp = threadIdx.x >> 5, warps_per_row = tpr >> 5;
    __syncthreads();  // earlier readers of partials are done
    if ((threadIdx.x & 31) == 0) partials[warp] = v;
    __syncthreads();
    const int first = warp - warp % warps_per_row;
    v = 0.f;
    for (int w = 0; w < warps_per_row; ++w) v += partials[first + w];
  }
  return v;
}

// ---------------------------------------------------------------------------------------------
// Rows.
// ---------------------------------------------------------------------------------------------
// Element offset of a row's first element (see ltx_rows_t). Evenly spaced rows (one level) need
// no division; otherwise the row index is split with 32-bit divisions when it fits (64-bit
// division is a long emulated sequence on the GPU, on every row's critical path).
struct RowIndex {
  int64_t size1, size2;
  int64_t stride0, stride1, stride2;
  bool flat;        // size[0] == size[1] == 1: offset = row * stride2
  bool index_32bit; // every row index fits in 32 bits

  static RowIndex of(const ltx_rows_t& r) {
    const int64_t rows = r.size[0] * r.size[1] * r.size[2];
    return RowIndex{r.size[1],   r.size[2],   r.stride[0],          r.stride[1],
                    r.stride[2], r.size[0] == 1 && r.size[1] == 1, rows <= UINT32_MAX};
  }
  __device__ __forceinline__ int64_t offset(int64_t row) const {
    if (flat) return row * stride2;
    if (index_32bit) {
      const uint32_t r = static_cast<uint32_t>(row), s2 = static_cast<uint32_t>(size2),
                     s1 = static_cast<uint32_t>(size1);
      const uint32_t q = r / s2, i2 = r - q * s2, i0 = q / s1, i1 = q - i0 * s1;
      return i0 * stride0 + i1 * stride1 + i2 * stride2;
    }
    const int64_t i2 = row % size2;
    row /= size2;
    const int64_t i1 = row % size1;
    const int64_t i0 = row / size1;
    return i0 * stride0 + i1 * stride1 + i2 * stride2;
  }
};

inline int64_t num_rows(const ltx_rows_t& r) { return r.size[0] * r.size[1] * r.size[2]; }

// True when every row start of `r` is aligned to `alignment` bytes.
inline bool rows_aligned(const ltx_rows_t& r, int elem_bytes, int alignment) {
  if (reinterpret_cast<uintptr_t>(r.data) % alignment != 0) return false;
  for (int d = 0; d < LTX_MAX_ROW_DIMS; ++d)
    if (r.size[d] > 1 && (r.stride[d] * elem_bytes) % alignment != 0) return false;
  return true;
}

inline bool valid_rows(const ltx_rows_t& r) {
  for (int d = 0; d < LTX_MAX_ROW_DIMS; ++d)
    if (r.size[d] < 0) return false;
  return r.data != nullptr || num_rows(r) == 0;
}

// ---------------------------------------------------------------------------------------------
// Dtype dispatch: calls fn(TypeTag<T>{}) with the C++ type of an ltx_dtype_t.
// ---------------------------------------------------------------------------------------------
template <typename T>
struct TypeTag {
  using type = T;
};
struct NoWeight {};  // tag of an absent optional tensor
template <typename T>
inline constexpr bool has_weight_v = !std::is_same_v<T, NoWeight>;

template <typename Fn>
int dispatch_float(ltx_dtype_t dtype, Fn&& fn) {
  switch (dtype) {
    case LTX_FLOAT32: return fn(TypeTag<float>{});
    case LTX_FLOAT16: return fn(TypeTag<__half>{});
    case LTX_BFLOAT16: return fn(TypeTag<__nv_bfloat16>{});
  }
  return LTX_ERR_UNSUPPORTED_DTYPE;
}

// As dispatch_float, with TypeTag<NoWeight> when `present` is false.
template <typename Fn>
int dispatch_optional_float(bool present, ltx_dtype_t dtype, Fn&& fn) {
  if (!present) return fn(TypeTag<NoWeight>{});
  return dispatch_float(dtype, fn);
}

// Multiprocessor count of the current device (cached per device; a host-side query, no sync).
inline int sm_count() {
  static int cache[64] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 132;
  if (cache[device] == 0) {
    int count = 0;
    cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
    cache[device] = count > 0 ? count : 132;
  }
  return cache[device];
}

// Launch shape of the row-chunked elementwise kernels (gelu, gated_residual): rows of `packs`
// packs, each owned by tpr = 2^log2_tpr consecutive threads that take `slots` packs apiece per
// column chunk (blockIdx.y strides over chunks). tpr is the fewest threads (a power of two, at most
// max_threads) that cover a row in one chunk; blocks hold several rows, fewer (down to
// min_threads) when there are few rows, so that every SM gets work.
struct RowChunkGrid {
  int log2_tpr;
  int64_t chunks;
  dim3 grid, block;
};

inline RowChunkGrid row_chunk_grid(int64_t rows, int64_t packs, int slots, int max_threads,
                                   int min_threads) {
  RowChunkGrid g{};
  while ((1 << g.log2_tpr) < max_threads && (int64_t{slots} << g.log2_tpr) < packs) ++g.log2_tpr;
  const int tpr = 1 << g.log2_tpr;
  g.chunks = (packs + int64_t{tpr} * slots - 1) / (int64_t{tpr} * slots);
  int threads = std::max(tpr, max_threads);
  min_threads = std::max(tpr, min_threads);
  auto row_blocks = [&](int t) { return (rows + t / tpr - 1) / (t / tpr); };
  while (threads > min_threads && row_blocks(threads) * g.chunks < 2 * sm_count()) threads /= 2;
  g.grid = dim3(static_cast<unsigned>(std::min<int64_t>(row_blocks(threads), INT32_MAX)),
                static_cast<unsigned>(std::min<int64_t>(g.chunks, 65535)));
  g.block = dim3(threads);
  return g;
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

}  // namespace ltx
