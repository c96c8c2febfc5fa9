// Attention kernel body, FlashAttention-2 style on mma.sync tensor cores: the correct, simple body
// that the Hopper pipeline (wgmma, TMA, mbarriers) replaces; attention.cu, the checks and the C
// twin stay. It computes ltx_attention_cuda's formula (ltx_kernels.h):
// - One CTA of 4 warps per (tile of 64 queries, head, batch element); warp w owns rows 16w..16w+15
//   of the tile. The Q tile and, double-buffered through cp.async, the K and V tiles of 64 keys sit
//   in shared memory as rows of head_dim elements (padded by 8); rows past q_len or past the batch
//   element's n_b keys are zeros (V's must be: 0 * NaN would be NaN).
// - Per key tile: S = Q K^T on mma.sync.m16n8k16 (T operands, fp32 accumulators), scaled by
//   scale * log2(e) and masked to -inf past n_b; online softmax in base 2: per row the running max
//   m and sum l, O rescaled by exp2(m_old - m_new); P = exp2(S - m) (l sums it in fp32), rounded
//   to T, is the A operand of O += P V: the S accumulators are laid out as the A fragments.
// - out = O / l rounded to T; lse = m ln 2 + ln l. No keys (n_b = 0): out 0, lse -inf.
// Every thread holds two rows of its warp's 16 (g and g + 8, g = lane / 4), split over the quad of
// 4 lanes sharing g. Fragments are read from shared memory with 32- and 16-bit loads at the
// indices of the PTX ISA's m16n8k16 fragment layouts (no ldmatrix): simple to check, not fast.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

#include "../device/launch.cuh"
#include "../device/pack.cuh"
#include "../device/reduce.cuh"
#include "attention_params.cuh"

namespace ltx {
namespace flash_mma {

constexpr int kBlockM = 64;  // queries per CTA
constexpr int kBlockN = 64;  // keys per tile
constexpr int kThreads = 128;
constexpr int kPad = 8;  // elements padding each shared row: rows stay 16-byte aligned

template <int kHeadDim>
__host__ __device__ constexpr int row_stride() {
  return kHeadDim + kPad;
}

// Shared memory of a CTA: the Q tile, then two buffers of the K tile and two of the V tile.
template <typename T, int kHeadDim>
constexpr size_t smem_bytes() {
  return size_t{kBlockM + 4 * kBlockN} * row_stride<kHeadDim>() * sizeof(T);
}

// d += a b for one m16n8k16 tile: a 16x16 row-major (4 registers of two T), b 16x8 column-major
// (2 registers), d 16x8 fp32, in the PTX ISA's fragment layouts (g = lane / 4, t = lane % 4):
//   a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1], a[2] = A[g][2t+8, 2t+9], a[3] = A[g+8][2t+8,
//   2t+9] b[0] = B[2t, 2t+1][g], b[1] = B[2t+8, 2t+9][g] d[0], d[1] = D[g][2t, 2t+1], d[2], d[3] =
//   D[g+8][2t, 2t+1]
// (the lower index in the low half of a register).
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]);

template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                            const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                     const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Two fp32 values rounded to T as one fragment register (lo in the low half).
template <typename T>
__device__ __forceinline__ uint32_t round_pair(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t round_pair<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  return reinterpret_cast<const uint32_t&>(pair);
}

template <>
__device__ __forceinline__ uint32_t round_pair<__half>(float lo, float hi) {
  const __half2 pair = __floats2half2_rn(lo, hi);
  return reinterpret_cast<const uint32_t&>(pair);
}

// Elements p[0] and p[1] (p even-aligned) as one register; elements lo and hi as one register.
template <typename T>
__device__ __forceinline__ uint32_t load_pair(const T* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

template <typename T>
__device__ __forceinline__ uint32_t join_pair(T lo, T hi) {
  return static_cast<uint32_t>(reinterpret_cast<const uint16_t&>(lo)) |
         static_cast<uint32_t>(reinterpret_cast<const uint16_t&>(hi)) << 16;
}

// Starts copying rows [first, first + kRows) of head h of batch element b into a shared tile (row
// r at tile + r * row_stride); rows at or past `end` are zero-filled instead.
template <typename T, int kHeadDim, int kRows>
__device__ __forceinline__ void load_tile(T* tile, const HeadRows<const T>& src, int64_t b,
                                          int64_t h, int64_t first, int64_t end) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kChunksPerRow = kHeadDim / kVec;
  for (int c = threadIdx.x; c < kRows * kChunksPerRow; c += kThreads) {
    const int r = c / kChunksPerRow, col = c % kChunksPerRow * kVec;
    T* dst = tile + r * row_stride<kHeadDim>() + col;
    if (first + r < end)
      copy_pack_async<T, kVec>(dst, src.row(b, first + r, h) + col);
    else
      *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
  }
}

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kThreads) attention_kernel(const AttentionParams<T> p) {
  constexpr int kRs = row_stride<kHeadDim>();
  constexpr int kQkSteps = kHeadDim / 16;  // k-steps of S = Q K^T (16 dims each)
  constexpr int kSBlocks = kBlockN / 8;    // n-blocks of S (8 keys each)
  constexpr int kPvSteps = kBlockN / 16;   // k-steps of O += P V (16 keys each)
  constexpr int kOBlocks = kHeadDim / 8;   // n-blocks of O (8 dims each)
  constexpr float kLn2 = 0.693147180559945309f;
  extern __shared__ __align__(16) unsigned char smem[];
  T* const q_tile = reinterpret_cast<T*>(smem);
  T* const k_tiles = q_tile + kBlockM * kRs;       // [2][kBlockN][kRs]
  T* const v_tiles = k_tiles + 2 * kBlockN * kRs;  // [2][kBlockN][kRs]

  // This CTA's query tile, head and batch element (tiles vary fastest: the CTAs of a head, which
  // read the same K and V, run together).
  const int64_t q_tiles = (p.q_len + kBlockM - 1) / kBlockM;
  const int64_t cta = blockIdx.x;
  const int64_t q_first = cta % q_tiles * kBlockM;
  const int64_t h = cta / q_tiles % p.heads;
  const int64_t b = cta / q_tiles / p.heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int row0 = warp * 16 + g;  // this thread's rows of the tile: row0 and row0 + 8

  wait_for_prior_grids();
  allow_dependent_grids();
  const int64_t keys = p.attended_keys(b);
  const int64_t kv_tiles = (keys + kBlockN - 1) / kBlockN;

  float o[kOBlocks][4];
#pragma unroll
  for (int nd = 0; nd < kOBlocks; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};  // running max of each row's base-2 scores
  float l[2] = {0.f, 0.f};              // this thread's part of each row's running sum

  if (kv_tiles > 0) {
    load_tile<T, kHeadDim, kBlockM>(q_tile, p.q, b, h, q_first, p.q_len);
    load_tile<T, kHeadDim, kBlockN>(k_tiles, p.k, b, h, 0, keys);
    load_tile<T, kHeadDim, kBlockN>(v_tiles, p.v, b, h, 0, keys);
    copy_async_commit();
  }
  for (int64_t tile = 0; tile < kv_tiles; ++tile) {
    const int buffer = static_cast<int>(tile & 1);
    if (tile + 1 < kv_tiles) {  // prefetch the next tile into the other buffer
      const int next = buffer ^ 1;
      load_tile<T, kHeadDim, kBlockN>(k_tiles + next * kBlockN * kRs, p.k, b, h,
                                      (tile + 1) * kBlockN, keys);
      load_tile<T, kHeadDim, kBlockN>(v_tiles + next * kBlockN * kRs, p.v, b, h,
                                      (tile + 1) * kBlockN, keys);
      copy_async_commit();
      copy_async_wait(1);  // this tile's group (and Q's) has landed
    } else {
      copy_async_wait(0);
    }
    __syncthreads();
    const T* const k_tile = k_tiles + buffer * kBlockN * kRs;
    const T* const v_tile = v_tiles + buffer * kBlockN * kRs;

    // S = Q K^T: the warp's 16 rows against the tile's 64 keys (B[d][n] = K[n][d]).
    float s[kSBlocks][4];
#pragma unroll
    for (int nb = 0; nb < kSBlocks; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kQkSteps; ++kk) {
      const T* const q0 = q_tile + row0 * kRs + kk * 16 + 2 * t;
      const T* const q8 = q0 + 8 * kRs;
      const uint32_t a[4] = {load_pair(q0), load_pair(q8), load_pair(q0 + 8), load_pair(q8 + 8)};
#pragma unroll
      for (int nb = 0; nb < kSBlocks; ++nb) {
        const T* const k0 = k_tile + (nb * 8 + g) * kRs + kk * 16 + 2 * t;
        const uint32_t bk[2] = {load_pair(k0), load_pair(k0 + 8)};
        mma_m16n8k16<T>(s[nb], a, bk);
      }
    }

    // Base-2 scores, keys past n_b masked; each row's new max over its quad.
    const int64_t first_key = tile * kBlockN;
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nb = 0; nb < kSBlocks; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t key = first_key + nb * 8 + 2 * t + (e & 1);
        s[nb][e] = key < keys ? s[nb][e] * p.scale_log2 : -INFINITY;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], s[nb][e]);
      }
    }
    float base[2];  // the max the probabilities are taken against (0 while a row has no key)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float m_new = fmaxf(m[i], group_reduce(tile_max[i], 4, NanMax{}));
      base[i] = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = exp2f(m[i] - base[i]);  // rescales what was summed against m_old
      m[i] = m_new;
      l[i] *= alpha;
#pragma unroll
      for (int nd = 0; nd < kOBlocks; ++nd) {
        o[nd][2 * i] *= alpha;
        o[nd][2 * i + 1] *= alpha;
      }
    }

    // P = exp2(S - m), summed into l, rounded to T into the A fragments of O += P V: n-blocks
    // 2kb and 2kb + 1 of S are k-step kb's columns 0-7 and 8-15.
    uint32_t pa[kPvSteps][4];
#pragma unroll
    for (int nb = 0; nb < kSBlocks; ++nb) {
      float pr[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        pr[e] = exp2f(s[nb][e] - base[e / 2]);
        l[e / 2] += pr[e];
      }
      pa[nb / 2][(nb % 2) * 2] = round_pair<T>(pr[0], pr[1]);      // row g
      pa[nb / 2][(nb % 2) * 2 + 1] = round_pair<T>(pr[2], pr[3]);  // row g + 8
    }

    // O += P V (B[j][d] = V[j][d]: two keys of one column per register).
#pragma unroll
    for (int kb = 0; kb < kPvSteps; ++kb) {
#pragma unroll
      for (int nd = 0; nd < kOBlocks; ++nd) {
        const T* const v0 = v_tile + (kb * 16 + 2 * t) * kRs + nd * 8 + g;
        const uint32_t bv[2] = {join_pair(v0[0], v0[kRs]), join_pair(v0[8 * kRs], v0[9 * kRs])};
        mma_m16n8k16<T>(o[nd], pa[kb], bv);
      }
    }
    __syncthreads();  // every warp is done with this buffer before a prefetch overwrites it
  }

  // out = O / l, lse = m ln 2 + ln l (natural log); a row without keys: 0 and -inf.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float sum = group_reduce(l[i], 4);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const int64_t query = q_first + row0 + 8 * i;
    if (query >= p.q_len) continue;
    T* const out_row = p.out.row(b, query, h);
#pragma unroll
    for (int nd = 0; nd < kOBlocks; ++nd)
      *reinterpret_cast<uint32_t*>(out_row + nd * 8 + 2 * t) =
          round_pair<T>(o[nd][2 * i] * inv, o[nd][2 * i + 1] * inv);
    if (p.lse != nullptr && t == 0)
      p.lse[(b * p.heads + h) * p.q_len + query] = sum > 0.f ? m[i] * kLn2 + logf(sum) : -INFINITY;
  }
}

// Runs the kernel over every (query tile, head, batch element): LTX_ERR_INVALID_ARGUMENT when
// they exceed a grid's INT32_MAX blocks.
template <typename T, int kHeadDim>
int run(const AttentionParams<T>& p, cudaStream_t stream) {
  constexpr size_t kSmem = smem_bytes<T, kHeadDim>();
  const int64_t ctas = ceil_div(p.q_len, kBlockM) * p.heads * p.batch;
  if (ctas > INT32_MAX) return LTX_ERR_INVALID_ARGUMENT;
  const cudaError_t err =
      cudaFuncSetAttribute(attention_kernel<T, kHeadDim>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem));
  if (err != cudaSuccess) return static_cast<int>(err);
  return launch(attention_kernel<T, kHeadDim>, dim3(static_cast<unsigned>(ctas)), dim3(kThreads),
                kSmem, stream, p);
}

}  // namespace flash_mma
}  // namespace ltx
