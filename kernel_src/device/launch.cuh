// Device helpers (kernel_src/device/), host side of a launch: compile-time flags, dtype dispatch,
// device attributes, launch shapes, launcher status, and the launch itself with programmatic
// dependent launch (PDL).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <algorithm>
#include <type_traits>
#include <utility>

#include "../checks.h"
#include "../ltx_kernels.h"
#include "convert.cuh"

namespace ltx {

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

// The launch shape of a row-cached kernel with power-of-two row teams (rmsnorm, norm_modulate,
// quantize, qk_norm_rope_backward): rows of `packs` packs, each held by tpr = 2^log2_tpr threads
// (log2_threads_per_row), blocks of rows_per_block rows. fits() is false when the grid would
// exceed INT32_MAX blocks (the launcher returns LTX_ERR_INVALID_ARGUMENT).
struct CachedRowGrid {
  int log2_tpr;
  int threads;     // per block
  int64_t blocks;  // ceil(rows / rows per block)

  bool fits() const { return blocks <= INT32_MAX; }
  dim3 grid() const { return dim3(static_cast<unsigned>(blocks)); }
};

inline CachedRowGrid cached_row_grid(int64_t rows, int64_t packs, int slots, int max_tpr,
                                     int block_threads, int min_threads) {
  const int log2_tpr = log2_threads_per_row(packs, slots, max_tpr);
  const int tpr = 1 << log2_tpr;
  auto blocks_for = [&](int rows_in_block) { return ceil_div(rows, rows_in_block); };
  const int rows_in_block = rows_per_block(tpr, block_threads, min_threads, blocks_for);
  return CachedRowGrid{log2_tpr, rows_in_block * tpr, blocks_for(rows_in_block)};
}

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
