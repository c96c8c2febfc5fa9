// Device helpers (kernel_src/device/): the row skeletons. Row addressing of ltx_rows_t (RowIndex,
// RowPtr), the row-cached kernels' teams (RowTeam, row_reduce, the streaming fallback's
// block_rstd) and the row-chunked elementwise kernels' grid (RowChunks).
#pragma once

#include <stdint.h>

#include <algorithm>

#include "../ltx_kernels.h"
#include "../rows.h"
#include "launch.cuh"
#include "pack.cuh"
#include "reduce.cuh"

namespace ltx {

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

}  // namespace ltx
