// Attention kernel body for Hopper (sm_90a): the FlashAttention-3 structure in plain CUDA C and
// inline PTX, behind the same launcher and AttentionParams as flash_mma.cuh (which stays the body
// for what this one does not take: see attention.cu). It computes ltx_attention_cuda's formula
// (ltx_kernels.h) with the algorithm of flash_mma.cuh (online softmax in base 2, P rounded to T):
// - Persistent CTAs, one an SM, each looping over work tiles (a tile of queries, head, batch
//   element: hopper_common.cuh's WorkTiles): a producer warpgroup and three consumer warpgroups of
//   64 query rows each (192 queries: Shape). Warpgroup 0 is the producer: it gives up registers
//   (setmaxnreg) and one thread issues TMA copies (cp.async.bulk.tensor) of each consumer's Q tile
//   (once that consumer's S GEMMs of the work tile before are done) and of K and V tiles of 128
//   keys into a ring of kStages shared-memory stages that runs on across work tiles (Ring), each
//   completing an mbarrier by its byte count (expect-tx); the consumers release a stage's K tile
//   when their S GEMM of it is done and its V tile after the P V GEMM, so the next K tile loads
//   during the P V GEMM of the tile before (one release per stage made K wait for it, a bubble per
//   tile at kStages = 2), and the next work tile's first tiles load while they finish the last
//   one. The consumers' registers are raised with setmaxnreg.
// - Per key tile a consumer computes S = Q K^T with wgmma (both operands in shared memory), the
//   online softmax on S in registers, and O += P V with wgmma, P (rounded to T) in registers as
//   the A operand: the fp32 accumulator layout of S is the A-fragment layout of P. At head_dim 64
//   the S GEMM of tile j and the P V GEMM of tile j - 1 are issued together, so the softmax of
//   tile j overlaps the P V GEMM; at 128 (O, S and P at once would not fit 160 registers) the
//   P V GEMM is waited for before the S GEMM issues (kSerialGemms). The consumers take turns
//   issuing (Turns: named barriers in a ring), so one's softmax overlaps the others' GEMMs.
// - O is rescaled to a tile's max only where some row of the warp has a new max, at head_dim 128
//   (rescale_o in hopper_common.cuh).
// - l: at head_dim 64 the P V GEMM's (m64n72: a ones panel gives O a column of P's row sums, so
//   out is a convex combination of V's rows with the same rounded P), at 128 the softmax's sum of
//   the unrounded P (kOColumns).
// - Keys past the batch element's n_b: the K/V tiles stop at ceil(n_b / 128); in the last tile
//   the scores of keys >= n_b are -inf, and V's rows in [n_b, kv_len) are zeroed in shared memory
//   by the producer before use (0 * NaN would be NaN; rows past kv_len are TMA's zero fill).
// - out = O / l rounded to T, stored in 16-byte chunks (store_quad_row); lse = m ln 2 + ln l. No
//   keys (n_b = 0): out 0, lse -inf.
// Shared-memory tiles (all 1024-byte aligned): a tile of R rows of head_dim elements is head_dim /
// 64 "panels", each R rows of 128 bytes (64 elements) in the 128-byte swizzle (16-byte chunk c of
// row r stored at chunk c ^ (r % 8)): what TMA writes with CU_TENSOR_MAP_SWIZZLE_128B and a box
// of 64 elements, and what wgmma reads with the descriptors' swizzle mode 1.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums only: the encoder is found at run time
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

#include "../device/launch.cuh"
#include "../device/reduce.cuh"
#include "attention_params.cuh"
#include "flash_mma.cuh"  // round_pair
#include "hopper_common.cuh"

namespace ltx {
namespace hopper_wgmma {

using namespace hopper;  // the shared PTX wrappers and the tensor-map encoder

constexpr int kConsumerRows = 64;  // query rows per consumer (wgmma's M)
constexpr int kBlockN = 128;       // keys per K/V tile (the S GEMM's N)
constexpr int kPanelElems = 64;    // elements of one 128-byte swizzled row
constexpr int kRowBytes = 128;     // bytes of a panel row
constexpr int kAtomBytes = 1024;   // 8 rows of 128 bytes: the 128-byte swizzle's period

// A CTA's consumers: three (192 queries). Two left the tensor cores idle half the time at head_dim
// 64 (ncu, 2x32x8064 on an H100: tensor pipe 43%, issue slots 45%, 2.2 warps a scheduler, stalls
// mostly on fixed-latency dependencies); at 128 three (with kSerialGemms) ran 2x32x6144 to
// 1x40x32760 10-14% faster than two on an H100.
using Shape = CtaShape;

// O's columns: at head_dim 64 the channels and 8 more, whose first is P's row sum l, from the P V
// GEMM over the ones panel (gemm_pv: column 64 of every key row 1, the rest 0): the softmax adds
// nothing up (64 FADDs less a tile a thread, +3% on an H100). At 128 the softmax sums (not tried
// there: O's 4 more registers, and an N = 136 GEMM reading a panel past each stage's V tile).
template <int kHeadDim>
constexpr bool kSumsInGemm = kHeadDim == 64;
template <int kHeadDim>
constexpr int kOColumns = kHeadDim + (kSumsInGemm<kHeadDim> ? 8 : 0);

// Shared memory of a CTA (byte offsets from a 1024-byte aligned base): each consumer's Q tile,
// then kStages K tiles, then kStages V tiles, then at head_dim 64 the ones panel (one K/V panel).
template <int kHeadDim>
struct Smem {
  static constexpr int kConsumers = Shape::kConsumers;
  static constexpr int kPanels = kHeadDim / kPanelElems;
  static constexpr int kStages = kHeadDim == 64 ? 4 : 2;
  static constexpr int kQPanelBytes = kConsumerRows * kRowBytes;
  static constexpr int kKvPanelBytes = kBlockN * kRowBytes;
  static constexpr int kQBytes = kPanels * kQPanelBytes;    // one consumer's Q tile
  static constexpr int kKvBytes = kPanels * kKvPanelBytes;  // one K or V tile
  static constexpr int kOnesBytes = kSumsInGemm<kHeadDim> ? kKvPanelBytes : 0;  // ones panel
  static constexpr int kBytes = kConsumers * kQBytes + 2 * kStages * kKvBytes + kOnesBytes;
  __host__ __device__ static constexpr uint32_t q(int consumer) { return consumer * kQBytes; }
  __host__ __device__ static constexpr uint32_t k(int stage) {
    return kConsumers * kQBytes + stage * kKvBytes;
  }
  __host__ __device__ static constexpr uint32_t v(int stage) {
    return k(kStages) + stage * kKvBytes;
  }
  __host__ __device__ static constexpr uint32_t ones() { return v(kStages); }
  static_assert(kQPanelBytes % kAtomBytes == 0 && kKvPanelBytes % kAtomBytes == 0);
};

// d (+)= A B on the tensor cores of a warpgroup, fp32 accumulators, T operands (m64nNk16; scale_d
// = 0: d = A B). wgmma_ss: A and B from shared memory (descriptors), both K-major. wgmma_rs: A
// from registers (a: this thread's fragment), B from shared memory MN-major (transposed).
// Accumulator layout (PTX ISA, "wgmma .m64nNk16 D fragment"): warp w of the warpgroup holds rows
// 16w..16w+15; with g = lane / 4, t = lane % 4, d[4i + e] is row 16w + g + 8 (e / 2), column 8i +
// 2t + (e % 2). A-fragment layout: a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1], a[2] =
// A[g][2t+8, 2t+9], a[3] = A[g+8][2t+8, 2t+9] (rows of the warp's 16; lower column in the low
// half).
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t a, uint64_t b, int scale_d);

template <typename T, int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b,
                                         int scale_d);

template <>
__device__ __forceinline__ void wgmma_ss<__nv_bfloat16, 128>(float (&d)[64], uint64_t a, uint64_t b,
                                                             int scale_d) {
  asm volatile(
      "{ .reg .pred p; setp.ne.b32 p, %66, 0;"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0; }"
      : LTX_D64("+f", d)
      : "l"(a), "l"(b), "r"(scale_d));
}

template <>
__device__ __forceinline__ void wgmma_rs<__nv_bfloat16, 64>(float (&d)[32], const uint32_t (&a)[4],
                                                            uint64_t b, int scale_d) {
  asm volatile(
      "{ .reg .pred p; setp.ne.b32 p, %37, 0;"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 1; }"
      : LTX_D32("+f", d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
}

// m64n72 (head_dim 64 and the ones panel's columns: kOColumns), the two types' instructions.
#define LTX_WGMMA_RS_72(TYPE)                                                       \
  asm volatile(                                                                     \
      "{ .reg .pred p; setp.ne.b32 p, %41, 0;"                                      \
      "wgmma.mma_async.sync.aligned.m64n72k16.f32." TYPE "." TYPE                   \
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "    \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, " \
      "%31, %32, %33, %34, %35}, {%36, %37, %38, %39}, %40, p, 1, 1, 1; }"          \
      : LTX_D32("+f", d), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35])        \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d))
template <>
__device__ __forceinline__ void wgmma_rs<__nv_bfloat16, 72>(float (&d)[36], const uint32_t (&a)[4],
                                                            uint64_t b, int scale_d) {
  LTX_WGMMA_RS_72("bf16");
}
template <>
__device__ __forceinline__ void wgmma_rs<__half, 72>(float (&d)[36], const uint32_t (&a)[4],
                                                     uint64_t b, int scale_d) {
  LTX_WGMMA_RS_72("f16");
}
#undef LTX_WGMMA_RS_72

template <>
__device__ __forceinline__ void wgmma_rs<__nv_bfloat16, 128>(float (&d)[64], const uint32_t (&a)[4],
                                                             uint64_t b, int scale_d) {
  asm volatile(
      "{ .reg .pred p; setp.ne.b32 p, %69, 0;"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1; }"
      : LTX_D64("+f", d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
}

template <>
__device__ __forceinline__ void wgmma_ss<__half, 128>(float (&d)[64], uint64_t a, uint64_t b,
                                                      int scale_d) {
  asm volatile(
      "{ .reg .pred p; setp.ne.b32 p, %66, 0;"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0; }"
      : LTX_D64("+f", d)
      : "l"(a), "l"(b), "r"(scale_d));
}

template <>
__device__ __forceinline__ void wgmma_rs<__half, 64>(float (&d)[32], const uint32_t (&a)[4],
                                                     uint64_t b, int scale_d) {
  asm volatile(
      "{ .reg .pred p; setp.ne.b32 p, %37, 0;"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 1; }"
      : LTX_D32("+f", d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
}

template <>
__device__ __forceinline__ void wgmma_rs<__half, 128>(float (&d)[64], const uint32_t (&a)[4],
                                                      uint64_t b, int scale_d) {
  asm volatile(
      "{ .reg .pred p; setp.ne.b32 p, %69, 0;"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1; }"
      : LTX_D64("+f", d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
}

// The tensor maps of q, k and v (kernel parameters: __grid_constant__, read by TMA in place).
struct TensorMaps {
  CUtensorMap q, k, v;
};

// S = Q K^T for one consumer: its 64 query rows against the 128 keys of a K tile, head_dim / 16
// steps; step kk reads elements 16 kk.. of each row: panel kk / 4, byte 32 (kk % 4) of its rows.
template <typename T, int kHeadDim>
__device__ __forceinline__ void gemm_qk(float (&s)[kBlockN / 2], uint32_t q_tile, uint32_t k_tile) {
  using L = Smem<kHeadDim>;
  const uint64_t q = matrix_descriptor(q_tile, 16, kAtomBytes);
  const uint64_t k = matrix_descriptor(k_tile, 16, kAtomBytes);
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    const uint32_t offset = (kk % 4) * 32;
    const uint64_t a = advance_descriptor(q, kk / 4 * L::kQPanelBytes + offset);
    const uint64_t b = advance_descriptor(k, kk / 4 * L::kKvPanelBytes + offset);
    wgmma_ss<T, kBlockN>(s, a, b, kk > 0);
  }
}

// O += P V for one consumer: P [64 x 128 keys] from registers (p[kb]: keys 16 kb..16 kb + 15), V
// [128 keys x head_dim] MN-major: step kb starts at key row 16 kb (byte 2048 kb of each panel),
// 8-key groups 1024 bytes apart (SBO), 64-column groups a panel apart (LBO).
// At head_dim 64 too (m64n72): its columns 64-71, the second 64-column group, come from the ones
// panel (LBO: from this stage's V tile to it), so O's column 64 is P's row sum l.
template <typename T, int kHeadDim>
__device__ __forceinline__ void gemm_pv(float (&o)[kOColumns<kHeadDim> / 2],
                                        const uint32_t (&p)[kBlockN / 16][4], uint32_t v_tile,
                                        uint32_t ones) {
  using L = Smem<kHeadDim>;
  const uint64_t v = matrix_descriptor(
      v_tile, kSumsInGemm<kHeadDim> ? ones - v_tile : L::kKvPanelBytes, kAtomBytes);
#pragma unroll
  for (int kb = 0; kb < kBlockN / 16; ++kb) {
    const uint64_t b = advance_descriptor(v, kb * 16 * kRowBytes);
    wgmma_rs<T, kOColumns<kHeadDim>>(o, p[kb], b, 1);
  }
}

// Online softmax over one tile's raw scores s = q.k (this thread's part of rows g and g + 8, see
// wgmma_ss): each row's new base-2 max m over its quad of 4 lanes, alpha = exp2(m_old - m_new)
// (what O and l are rescaled by), s = exp2(s scale_log2 - m_new) in place, and with kSum l = alpha
// l + this thread's part of the row sum (without, the P V GEMM sums: kOColumns). A tile without
// masked keys takes the max of the raw scores (of their negations for a negative scale) and scales
// it once per row, so each score costs one FMA and one EX2; the last tile (kMask) scales first and
// sets keys at or past `valid` to -inf. As flash_mma.cuh: a row whose max is still -inf takes its
// probabilities against 0.
template <bool kMask, bool kSum>
__device__ __forceinline__ void softmax_tile(float (&s)[kBlockN / 2], float (&m)[2], float (&l)[2],
                                             float (&alpha)[2], float scale_log2, int valid,
                                             int t) {
  float tile_max[2] = {-INFINITY, -INFINITY}, factor = scale_log2;
  if (kMask) {
#pragma unroll
    for (int i = 0; i < kBlockN / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[4 * i + e] * scale_log2;
        if (8 * i + 2 * t + (e & 1) >= valid) x = -INFINITY;
        s[4 * i + e] = x;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], x);
      }
    }
    factor = 1.f;
  } else if (scale_log2 >= 0.f) {
#pragma unroll
    for (int i = 0; i < kBlockN / 2; ++i)
      tile_max[(i % 4) / 2] = fmaxf(tile_max[(i % 4) / 2], s[i]);
  } else {
#pragma unroll
    for (int i = 0; i < kBlockN / 2; ++i)
      tile_max[(i % 4) / 2] = fmaxf(tile_max[(i % 4) / 2], -s[i]);
  }
  const float max_factor = kMask ? 1.f : fabsf(scale_log2);
  float base[2], sum[2] = {0.f, 0.f};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float m_new = fmaxf(m[r], group_reduce(tile_max[r], 4, NanMax{}) * max_factor);
    base[r] = m_new == -INFINITY ? 0.f : m_new;
    alpha[r] = exp2_ftz(m[r] - base[r]);
    m[r] = m_new;
  }
#pragma unroll
  for (int i = 0; i < kBlockN / 2; ++i) {
    s[i] = exp2_ftz(fmaf(s[i], factor, -base[(i % 4) / 2]));
    if (kSum) sum[(i % 4) / 2] += s[i];
  }
  if (kSum) {
    l[0] = alpha[0] * l[0] + sum[0];
    l[1] = alpha[1] * l[1] + sum[1];
  }
}

// P rounded to T as the A fragments of O += P V: S's column blocks 2 kb and 2 kb + 1 (8 keys each)
// are k-step kb's columns 0-7 and 8-15 (the layouts of wgmma_ss and wgmma_rs).
template <typename T>
__device__ __forceinline__ void round_probabilities(uint32_t (&p)[kBlockN / 16][4],
                                                    const float (&s)[kBlockN / 2]) {
#pragma unroll
  for (int nb = 0; nb < kBlockN / 8; ++nb) {
    p[nb / 2][(nb % 2) * 2] = flash_mma::round_pair<T>(s[4 * nb], s[4 * nb + 1]);          // row g
    p[nb / 2][(nb % 2) * 2 + 1] = flash_mma::round_pair<T>(s[4 * nb + 2], s[4 * nb + 3]);  // g + 8
  }
}

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(Shape::kThreads, 1)
    attention_kernel(const __grid_constant__ TensorMaps maps, const AttentionParams<T> p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = Smem<kHeadDim>;
  using S = Shape;
  constexpr int kConsumers = S::kConsumers;
  constexpr int kStages = L::kStages;
  constexpr bool kSerialGemms = kHeadDim == 128;  // (see the file comment)
  constexpr uint32_t kTileBytes = L::kKvBytes;    // TMA bytes of one K or V tile
  constexpr float kLn2 = 0.693147180559945309f;
  __shared__ Barriers<kStages> bars;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // The tiles' base, rounded up to 1024 bytes (the launch asks for 1024 bytes more).
  const uint32_t smem = (shared_address(smem_raw) + kAtomBytes - 1) / kAtomBytes * kAtomBytes;

  const WorkTiles<S::kBlockM> work(p.q_len, p.heads, p.batch, p.split);
  const int warpgroup = uniform_warpgroup();  // (no spills at either head_dim: 3-5% faster)
  const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  if constexpr (kSumsInGemm<kHeadDim>) {
    // The ones panel: key row r's (128 bytes, 128-byte swizzle) chunk 0, stored at chunk r % 8,
    // holds T 1 in its first element; every other element 0.
    const uint32_t one = std::is_same<T, __half>::value ? 0x3C00u : 0x3F80u;
    for (int i = threadIdx.x; i < L::kOnesBytes / 16; i += blockDim.x)
      store_shared16(smem + L::ones() + i * 16, i % 8 == i / 8 % 8 ? one : 0u, 0u);
    fence_proxy_async_shared();  // (the GEMMs read it through the async proxy)
  }
  init_barriers(bars, kConsumers);

  wait_for_prior_grids();
  allow_dependent_grids();
  auto keys = [&](int b) { return static_cast<int>(p.attended_keys(b)); };
  auto key_tiles_of = [&](const CtaTile& tile) {
    return key_tiles<kBlockN>(keys(tile.b), p.kv_len, tile);
  };
  if (warpgroup == 0) {  // the producer
    set_max_registers_dec<S::kProducerRegs>();
    if (warp != 0) return;
    if (lane == 0) {
      prefetch_tensor_map(maps.q);
      prefetch_tensor_map(maps.k);
      prefetch_tensor_map(maps.v);
    }
    produce_work(
        bars, work, key_tiles_of, lane, L::kQBytes, kTileBytes, kTileBytes,
        [&](const CtaTile& tile, int c, uint32_t bar) {
          for (int panel = 0; panel < L::kPanels; ++panel)
            tma_load_4d(smem + L::q(c) + panel * L::kQPanelBytes, maps.q, panel * kPanelElems,
                        tile.h, tile.q_first + c * kConsumerRows, tile.b, bar);
        },
        [&](const CtaTile& tile, int stage, int j, uint32_t bar) {
          for (int panel = 0; panel < L::kPanels; ++panel)
            tma_load_4d(smem + L::k(stage) + panel * L::kKvPanelBytes, maps.k, panel * kPanelElems,
                        tile.h, j * kBlockN, tile.b, bar);
        },
        [&](const CtaTile& tile, int stage, int j, uint32_t bar) {
          for (int panel = 0; panel < L::kPanels; ++panel)
            tma_load_4d(smem + L::v(stage) + panel * L::kKvPanelBytes, maps.v, panel * kPanelElems,
                        tile.h, j * kBlockN, tile.b, bar);
        },
        // its rows [last_valid, zero_end): zeros (whole 128-byte rows of every panel: the swizzle
        // permutes chunks within a row only)
        [&](const KeyTiles& tiles, int stage) {
          const int chunks_per_row = kRowBytes / 16, rows = tiles.zero_end - tiles.last_valid;
          for (int c = lane; c < L::kPanels * rows * chunks_per_row; c += 32) {
            const int panel = c / (rows * chunks_per_row), rest = c % (rows * chunks_per_row);
            store_shared16(smem + L::v(stage) + panel * L::kKvPanelBytes +
                               (tiles.last_valid + rest / chunks_per_row) * kRowBytes +
                               rest % chunks_per_row * 16,
                           0u, 0u);
          }
        });
    return;
  }

  // A consumer: rows 16 warp + g and 16 warp + g + 8 of its 64 (see wgmma_ss) of each work tile.
  set_max_registers_inc<S::kConsumerRegs>();
  const int consumer = warpgroup - 1;
  const int g = lane / 4, t = lane % 4;
  const uint32_t q_tile = smem + L::q(consumer);
  // The consumers take turns issuing their GEMMs (hopper_common.cuh: Turns), so one's softmax
  // runs beside the others' GEMMs.
  const Turns<kConsumers> turns(consumer);
  Ring<kStages> ring;
  for (int64_t w = blockIdx.x; w < work.total; w += gridDim.x) {
    const CtaTile tile = work[w];
    const KeyTiles tiles = key_tiles_of(tile);
    const int kv_tiles = tiles.count, last_valid = tiles.last_valid, h = tile.h, b = tile.b;
    const int row0 = tile.q_first + consumer * kConsumerRows + warp * 16 + g;
    span(w, consumer, kStart);
    float o[kOColumns<kHeadDim> / 2];
#pragma unroll
    for (int i = 0; i < kOColumns<kHeadDim> / 2; ++i) o[i] = 0.f;
    float m[2] = {-INFINITY, -INFINITY};  // running max of each row's base-2 scores
    float l[2] = {0.f, 0.f};  // at head_dim 128 this thread's part of each row's running sum

    if (kv_tiles > 0) {
      // whether this work tile's last K/V tile is the CTA's last turn
      const bool ctas_last = !work.more_after(w, key_tiles_of);
      float s[kBlockN / 2];
#pragma unroll
      for (int i = 0; i < kBlockN / 2; ++i) s[i] = 0.f;
      uint32_t pr[kBlockN / 16][4];  // P of the tile whose P V GEMM is next
      float alpha[2];
      if (ring.q_use == 0) turns.start();
      wait_q(bars, consumer, ring);
      span(w, consumer, kQLanded);

      // Tile 0: S only (no P V yet).
      mbarrier_wait(shared_address(&bars.k_full[ring.stage(0)]), ring.parity(0));
      turns.wait();
      wgmma_fence();
      gemm_qk<T, kHeadDim>(s, q_tile, smem + L::k(ring.stage(0)));
      wgmma_commit();
      turns.pass(ctas_last && kv_tiles == 1);
      wgmma_wait<0>();
      fence_registers(s);
      if (kv_tiles == 1) release_q(bars, consumer, lane);  // the work tile's S GEMMs are done
      __syncwarp();
      if (lane == 0) mbarrier_arrive(shared_address(&bars.k_empty[ring.stage(0)]));  // K read
      if (kv_tiles == 1 && last_valid < kBlockN)
        softmax_tile<true, !kSumsInGemm<kHeadDim>>(s, m, l, alpha, p.scale_log2, last_valid, t);
      else
        softmax_tile<false, !kSumsInGemm<kHeadDim>>(s, m, l, alpha, p.scale_log2, kBlockN, t);
      round_probabilities<T>(pr, s);
      span(w, consumer, kFirstTileDone, pr);

      for (int j = 1; j < kv_tiles; ++j) {
        const int stage = ring.stage(j), prev = ring.stage(j - 1);
        mbarrier_wait(shared_address(&bars.k_full[stage]), ring.parity(j));
        mbarrier_wait(shared_address(&bars.v_full[prev]), ring.parity(j - 1));
        // Once the P V GEMM is done: O, pr and V tile j - 1's stage are free.
        auto release_v = [&] {
          fence_registers(o);
          fence_registers(pr);
          __syncwarp();
          if (lane == 0) mbarrier_arrive(shared_address(&bars.v_empty[prev]));
        };
        turns.wait();
        wgmma_fence();
        if constexpr (kSerialGemms) {
          gemm_pv<T, kHeadDim>(o, pr, smem + L::v(prev),
                               smem + L::ones());  // O += P V of tile j - 1
          wgmma_commit();
          wgmma_wait<0>();
          release_v();
          wgmma_fence();
          gemm_qk<T, kHeadDim>(s, q_tile, smem + L::k(stage));  // S of tile j
          wgmma_commit();
        } else {
          gemm_qk<T, kHeadDim>(s, q_tile, smem + L::k(stage));  // S of tile j
          wgmma_commit();
          gemm_pv<T, kHeadDim>(o, pr, smem + L::v(prev),
                               smem + L::ones());  // O += P V of tile j - 1
          wgmma_commit();
        }
        turns.pass(ctas_last && j == kv_tiles - 1);
        wgmma_wait<kSerialGemms ? 0 : 1>();  // S has landed (K tile j is read)
        fence_registers(s);
        if (j == kv_tiles - 1) release_q(bars, consumer, lane);  // the work tile's S GEMMs are done
        __syncwarp();
        if (lane == 0) mbarrier_arrive(shared_address(&bars.k_empty[stage]));
        if (j == kv_tiles - 1 && last_valid < kBlockN)
          softmax_tile<true, !kSumsInGemm<kHeadDim>>(s, m, l, alpha, p.scale_log2, last_valid, t);
        else
          softmax_tile<false, !kSumsInGemm<kHeadDim>>(s, m, l, alpha, p.scale_log2, kBlockN, t);
        if constexpr (!kSerialGemms) {
          wgmma_wait<0>();  // the P V GEMM (it ran beside the softmax)
          release_v();
        }
        rescale_o<kHeadDim>(o, alpha);
        round_probabilities<T>(pr, s);
      }

      // O += P V of the last tile (its V rows past n_b zeroed first where they hold data).
      span(w, consumer, kLoopEnd, pr);
      const int stage = ring.stage(kv_tiles - 1);
      mbarrier_wait(shared_address(&bars.v_full[stage]), ring.parity(kv_tiles - 1));
      if (tiles.zero_v_tail()) wait_v_tail(bars, ring);
      wgmma_fence();
      gemm_pv<T, kHeadDim>(o, pr, smem + L::v(stage), smem + L::ones());
      wgmma_commit();
      wgmma_wait<0>();
      fence_registers(o);
      fence_registers(pr);
      __syncwarp();
      if (lane == 0) mbarrier_arrive(shared_address(&bars.v_empty[stage]));  // for the next tile
      ring.advance(tiles);
    }
    span(w, consumer, kLastPvDone, o);

    // out = O / l, lse = m ln 2 + ln l (natural log); a row without keys: 0 and -inf. A part of a
    // split work tile leaves them in fp32 to the merge (split_merge.cuh).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // (O's column 64 at head_dim 64: lane t holds column 64 + 2t, zero but for t = 0)
      const float sum = group_reduce(kSumsInGemm<kHeadDim> ? o[kHeadDim / 2 + 2 * r] : l[r], 4);
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      const int64_t query = row0 + 8 * r;
      if (tile.parts > 1) {
        float2 values[kHeadDim / 8];
#pragma unroll
        for (int nd = 0; nd < kHeadDim / 8; ++nd)
          values[nd] = make_float2(o[4 * nd + 2 * r] * inv, o[4 * nd + 2 * r + 1] * inv);
        store_partial_row<kHeadDim>(p.split, tile, row0 + 8 * r - tile.q_first, values,
                                    sum > 0.f ? m[r] * kLn2 + logf(sum) : -INFINITY, t);
        continue;
      }
      uint32_t pairs[kHeadDim / 8];
#pragma unroll
      for (int nd = 0; nd < kHeadDim / 8; ++nd)
        pairs[nd] = flash_mma::round_pair<T>(o[4 * nd + 2 * r] * inv, o[4 * nd + 2 * r + 1] * inv);
      store_quad_row(p.out.row(b, query < p.q_len ? query : 0, h), query < p.q_len, pairs, t);
      if (query >= p.q_len) continue;
      if (p.lse != nullptr && t == 0)
        p.lse[(b * p.heads + h) * p.q_len + query] =
            sum > 0.f ? m[r] * kLn2 + logf(sum) : -INFINITY;
    }
    span(w, consumer, kStored);
  }
#else
  __trap();  // built without sm_90a machine code: the launcher never picks this body there
#endif
}

// ------------------------------------------------------------------------------------------------
// Host side: the tensor maps and the launch.
// ------------------------------------------------------------------------------------------------
// A [batch, len, heads, head_dim] operand as a 4-D tensor map, dims innermost first {head_dim,
// heads, len, batch} at its own byte strides (any order: a sequence-major view is fine), boxes of
// {64, 1, box_rows, 1}: box_rows rows of one head, 64 elements (128 bytes, the 128-byte swizzle's
// width) of each; rows past len are zero-filled. A dim of size 1 takes the row's bytes as its
// stride (its stride is never applied, and the encoder wants multiples of 16). False when the
// encoder refuses it (the launcher falls back).
template <typename T>
bool encode_operand(CUtensorMap* map, const HeadRows<const T>& rows, int64_t batch, int64_t len,
                    int64_t heads, int head_dim, int box_rows) {
  const EncodeTiled encode = encode_tiled();
  if (encode == nullptr) return false;
  const int64_t row_bytes = head_dim * int64_t{sizeof(T)};
  auto stride = [&](int64_t size, int64_t elements) {
    return static_cast<cuuint64_t>(size > 1 ? elements * int64_t{sizeof(T)} : row_bytes);
  };
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(len), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {stride(heads, rows.head_stride), stride(len, rows.seq_stride),
                                 stride(batch, rows.batch_stride)};
  const cuuint32_t box[4] = {kPanelElems, 1, static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUtensorMapDataType dtype = std::is_same<T, __half>::value
                                        ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                        : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  return encode(map, dtype, 4, const_cast<T*>(rows.data), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Whether this body takes the call: a compute capability 9.x device (9.0, the sm_90a machine
// code's, is the only one), sizes within int32 (TMA's coordinates) and operands the tensor-map
// encoder takes; then the maps.
template <typename T, int kHeadDim>
bool takes(const AttentionParams<T>& p, TensorMaps* maps) {
  if (device_attribute<cudaDevAttrComputeCapabilityMajor>(9) != 9) return false;  // (9.0 only)
  if (p.kv_len == 0 || p.q_len + Shape::kBlockM > INT32_MAX || p.kv_len + kBlockN > INT32_MAX ||
      p.heads > INT32_MAX || p.batch > INT32_MAX)
    return false;
  return encode_operand<T>(&maps->q, p.q, p.batch, p.q_len, p.heads, kHeadDim, kConsumerRows) &&
         encode_operand<T>(&maps->k, p.k, p.batch, p.kv_len, p.heads, kHeadDim, kBlockN) &&
         encode_operand<T>(&maps->v, p.v, p.batch, p.kv_len, p.heads, kHeadDim, kBlockN);
}

// Runs the kernel's persistent CTAs over every (query tile, head, batch element) with the maps
// from takes().
template <typename T, int kHeadDim>
int run(const AttentionParams<T>& p, const TensorMaps& maps, cudaStream_t stream) {
  constexpr size_t kSmem = Smem<kHeadDim>::kBytes + kAtomBytes;  // (+ the alignment slack)
  const cudaError_t err =
      cudaFuncSetAttribute(attention_kernel<T, kHeadDim>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem));
  if (err != cudaSuccess) return static_cast<int>(err);
  return launch(attention_kernel<T, kHeadDim>, persistent_grid<Shape::kBlockM>(p),
                dim3(Shape::kThreads), kSmem, stream, maps, p);
}

}  // namespace hopper_wgmma
}  // namespace ltx
