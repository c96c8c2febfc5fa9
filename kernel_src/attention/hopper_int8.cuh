// 8-bit attention kernel body for Hopper (sm_90a): ltx_attention_int8_cuda's formula
// (ltx_kernels.h) in the pipeline of hopper_wgmma.cuh (read its file comment first): persistent
// CTAs over work tiles, a TMA producer warpgroup filling a ring of K/V stages, three consumer
// warpgroups of 64 query rows each (Shape) taking turns to issue their GEMMs, online softmax in
// exp2.
// What differs (SageAttention2's scheme, see ../shared/research/fp8-and-attention.md):
// - S = Q8 K8^T with wgmma s32.s8.s8 (exact integer scores), converted to fp32 and scaled in the
//   softmax's FMA by factor = q_scale[row] * k_scale[tile] * scale * log2(e): one factor per row
//   per tile (a K/V tile is the 128 keys of one k_scale). An unmasked tile's row max comes from
//   the integer scores (max, or min for a negative factor) times the factor.
// - P is computed times 448 (exp2(x - m + log2 448): e4m3's largest value, so probabilities down
//   to 2^-9 / 448 keep a code) and rounded to e4m3. l is the row sum of the rounded P, computed
//   by the tensor cores: a V tile carries a row of ones after its channels (kSumRows), so
//   out = P8 V / P8 1 is a convex combination of V's rows up to the tensor cores' accumulation
//   (and lse the log of the same sum) and the softmax adds nothing up (64 FADDs less a tile a
//   thread: 8-bit +5-6% at head_dim 64, +1% at 128 on an H100). The 448 cancels in O / l. A
//   thread's S accumulators hold keys {2t, 2t+1, 2t+8, 2t+9} of each 16 and its 8-bit A fragment
//   wants columns {4t..4t+3} of P: v8 stores each group of 16 keys in that order
//   (ltx_attention_v_column), so the columns are the thread's own keys and quantize_probabilities
//   only converts (no shuffles).
// - O_tile = P8 V8 with wgmma f32.e4m3.e4m3 (B = V^T: v8 is stored transposed, keys contiguous,
//   the K-major layout fp8 wgmma requires) into a fresh accumulator (scale_d = 0), added to the
//   fp32 O in registers once per tile: Hopper's FP8 tensor-core accumulation is narrower than
//   fp32, so it never sums more than one tile (128 keys). In its turn a consumer issues the P V
//   GEMM of tile j - 1 and the S GEMM of tile j (at head_dim 64 one m64n72 GEMM: 64 channels and
//   the sum rows). At head_dim 128 the P V GEMM runs in two blocks of 64 channels (the second
//   with the sum rows' m64n8 GEMM beside it), each waited for and added into O before the S GEMM
//   issues: O_tile holds 32 registers and is dead, with P, once S is live, so O, S and the rest
//   about fit a consumer's 160 registers (three consumers; ptxas keeps a few scalars and two of O's
//   elements in local memory, 88 bytes of spill stores). At head_dim 64 (O: 32 registers) O_tile,
//   P and S fit at once: both GEMMs issue back to back and O_tile is added while the S GEMM runs
//   (6-8% faster than serial on an H100, with uniform_warpgroup keeping it nearly free of spills:
//   12 bytes since O holds l's columns and a split tile's rows may go to the workspace; without
//   it, no faster). The softmax overlaps the other consumers' GEMMs.
// - O is rescaled to a tile's max only where some row of the warp has a new max, at head_dim 128
//   (rescale_o in hopper_common.cuh).
// - out = O v_scale / l per channel (16-byte chunks: store_quad_row); lse = m ln 2 + ln(l / 448).
// Shared-memory tiles (1024-byte aligned): Q and K tiles are rows of head_dim int8 (128 bytes in
// the 128-byte swizzle at head_dim 128, 64 bytes in the 64-byte swizzle at 64); a V tile is
// head_dim rows of 128 keys (128 bytes, 128-byte swizzle), followed by its 8 sum rows (written once
// at the CTA's start; TMA fills the head_dim rows only). The columns of the last tile's keys from
// n_b up to v_columns (kv_len rounded up to 16) are zeroed in shared memory by the producer before
// use (ltx_attention_v_column); the V map spans kv_len rounded up to 16 columns (a group's keys
// below kv_len may lie at columns past it), the K map kv_len keys: past them, TMA's zero fill.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

#include "../device/launch.cuh"
#include "../device/reduce.cuh"
#include "../ltx_kernels.h"
#include "attention_params.cuh"
#include "flash_mma.cuh"  // round_pair
#include "hopper_common.cuh"

namespace ltx {
namespace hopper_int8 {

using namespace hopper;  // the shared PTX wrappers and the tensor-map encoder

constexpr int kConsumerRows = 64;                      // query rows per consumer (wgmma's M)
constexpr int kBlockN = LTX_ATTENTION_INT8_KEY_BLOCK;  // keys per K/V tile: one k_scale each
constexpr int kAtomBytes = 1024;     // the tiles' alignment (the 128-byte swizzle's period)
constexpr int kVRowBytes = kBlockN;  // a V tile row: 128 keys of one channel

// A CTA's consumers: three, 160 registers each (at head_dim 128 fewer than O, a whole tile's
// O_tile, P and S at once: the P V GEMM runs in blocks of kPvChannels channels, each waited for
// and added into O before the next and before the S GEMM issues, and the GEMMs' first k-steps
// only write their accumulators, so neither O_tile nor S holds registers outside its GEMM).
using Shape = CtaShape;
constexpr int kPvChannels = 64;  // channels of a P V GEMM block (O_tile: 32 registers)
// The rows a V tile carries after its channels: a row of ones (e4m3 1.0), then seven of zeros
// (wgmma's N steps by 8), so that O's column head_dim is P's row sum l (file comment).
constexpr int kSumRows = 8;
template <int kHeadDim>
constexpr int kOColumns = kHeadDim + kSumRows;  // O's columns: the channels, then the sum rows'
constexpr uint32_t kE4m3Ones = 0x38383838u;     // four e4m3 1.0
constexpr float kLog2PScale = 8.80735492205760410745f;  // log2(448): P is computed times 448
constexpr float kLnPScale = 6.10479323241498348998f;    // ln(448)
constexpr float kLn2 = 0.693147180559945309f;
static_assert(kBlockN == 128, "a V tile row is one 128-byte swizzled row");

// Shared memory of a CTA (byte offsets from a 1024-byte aligned base): each consumer's Q tile,
// then kStages K tiles, then kStages V tiles.
template <int kHeadDim>
struct Smem {
  static constexpr int kConsumers = Shape::kConsumers;
  static constexpr int kStages = 4;
  static constexpr int kQBytes = kConsumerRows * kHeadDim;  // one consumer's Q tile
  static constexpr int kKBytes = kBlockN * kHeadDim;        // a K tile: 128 rows of head_dim
  static constexpr int kVBytes = kOColumns<kHeadDim> * kVRowBytes;  // a V tile (+ sum rows)
  static constexpr int kVLoadBytes = kHeadDim * kVRowBytes;  // its head_dim rows: what TMA writes
  static constexpr int kBytes = kConsumers * kQBytes + kStages * (kKBytes + kVBytes);
  // Q and K rows are head_dim bytes: the swizzle of that width, 8 rows per core block (SBO).
  static constexpr Swizzle kQkSwizzle = kHeadDim == 128 ? kSwizzle128B : kSwizzle64B;
  static constexpr uint32_t kQkCoreBytes = 8 * kHeadDim;
  __host__ __device__ static constexpr uint32_t q(int consumer) { return consumer * kQBytes; }
  __host__ __device__ static constexpr uint32_t k(int stage) {
    return kConsumers * kQBytes + stage * kKBytes;
  }
  __host__ __device__ static constexpr uint32_t v(int stage) {
    return k(kStages) + stage * kVBytes;
  }
  static_assert(kQBytes % kAtomBytes == 0 && kKBytes % kAtomBytes == 0 &&
                kVBytes % kAtomBytes == 0);
};

// The tensor maps of q8, k8 and v8 (kernel parameters: __grid_constant__, read by TMA in place).
struct TensorMaps {
  CUtensorMap q, k, v;
};

// S (+)= Q8 K8^T for one consumer: s32 accumulators (the D fragment layout of wgmma_ss in
// hopper_wgmma.cuh), int8 operands from shared memory, both K-major (m64n128k32; kAccumulate
// false: d = A B).
template <bool kAccumulate>
__device__ __forceinline__ void wgmma_s8_ss(int32_t (&d)[64], uint64_t a, uint64_t b) {
#define LTX_WGMMA_S8                                                                  \
  "{ .reg .pred p; setp.ne.b32 p, %66, 0;"                                            \
  "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 "                                \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "           \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "  \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "  \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
  "%64, %65, p; }"
  if constexpr (kAccumulate)
    asm volatile(LTX_WGMMA_S8 : LTX_D64("+r", d) : "l"(a), "l"(b), "r"(1));
  else
    asm volatile(LTX_WGMMA_S8 : LTX_D64("=r", d) : "l"(a), "l"(b), "r"(0));
#undef LTX_WGMMA_S8
}

// d (+)= P V for one consumer: fp32 accumulators, e4m3 operands, A (P) from registers (a: this
// thread's fragment of 64 rows x 32 keys: a[0] = A[g][4t..4t+3], a[1] = A[g+8][4t..4t+3], a[2] =
// A[g][16+4t..16+4t+3], a[3] = A[g+8][16+4t..16+4t+3], lowest key in the lowest byte), B (V^T)
// from shared memory K-major (keys contiguous; fp8 wgmma takes no transpose) (m64nNk32;
// kAccumulate false: d = A B).
template <int N, bool kAccumulate>
__device__ __forceinline__ void wgmma_e4m3_rs(float (&d)[N / 2], const uint32_t (&a)[4],
                                              uint64_t b) {
  static_assert(N == 8 || N == 64 || N == 72 || N == 128);
#define LTX_WGMMA_E4M3_64                                                             \
  "{ .reg .pred p; setp.ne.b32 p, %37, 0;"                                            \
  "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "                             \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "           \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, " \
  "{%32, %33, %34, %35}, %36, p, 1, 1; }"
#define LTX_WGMMA_E4M3_128                                                            \
  "{ .reg .pred p; setp.ne.b32 p, %69, 0;"                                            \
  "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "                            \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "           \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "  \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "  \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
  "{%64, %65, %66, %67}, %68, p, 1, 1; }"
#define LTX_WGMMA_E4M3_72                                                            \
  "{ .reg .pred p; setp.ne.b32 p, %41, 0;"                                           \
  "wgmma.mma_async.sync.aligned.m64n72k32.f32.e4m3.e4m3 "                            \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "          \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35}, "                                                            \
  "{%36, %37, %38, %39}, %40, p, 1, 1; }"
#define LTX_WGMMA_E4M3_8                                                   \
  "{ .reg .pred p; setp.ne.b32 p, %9, 0;"                                  \
  "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, " \
  "{%4, %5, %6, %7}, %8, p, 1, 1; }"
#define LTX_D4(C, d) C(d[0]), C(d[1]), C(d[2]), C(d[3])
#define LTX_D36(C, d) LTX_D32(C, d), C(d[32]), C(d[33]), C(d[34]), C(d[35])
#define LTX_E4M3_A "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b)
  if constexpr (N == 8 && kAccumulate)
    asm volatile(LTX_WGMMA_E4M3_8 : LTX_D4("+f", d) : LTX_E4M3_A, "r"(1));
  else if constexpr (N == 8)
    asm volatile(LTX_WGMMA_E4M3_8 : LTX_D4("=f", d) : LTX_E4M3_A, "r"(0));
  else if constexpr (N == 72 && kAccumulate)
    asm volatile(LTX_WGMMA_E4M3_72 : LTX_D36("+f", d) : LTX_E4M3_A, "r"(1));
  else if constexpr (N == 72)
    asm volatile(LTX_WGMMA_E4M3_72 : LTX_D36("=f", d) : LTX_E4M3_A, "r"(0));
  else if constexpr (N == 64 && kAccumulate)
    asm volatile(LTX_WGMMA_E4M3_64 : LTX_D32("+f", d) : LTX_E4M3_A, "r"(1));
  else if constexpr (N == 64)
    asm volatile(LTX_WGMMA_E4M3_64 : LTX_D32("=f", d) : LTX_E4M3_A, "r"(0));
  else if constexpr (kAccumulate)
    asm volatile(LTX_WGMMA_E4M3_128 : LTX_D64("+f", d) : LTX_E4M3_A, "r"(1));
  else
    asm volatile(LTX_WGMMA_E4M3_128 : LTX_D64("=f", d) : LTX_E4M3_A, "r"(0));
#undef LTX_E4M3_A
#undef LTX_WGMMA_E4M3_128
#undef LTX_WGMMA_E4M3_64
#undef LTX_WGMMA_E4M3_72
#undef LTX_WGMMA_E4M3_8
#undef LTX_D36
#undef LTX_D4
}

// The descriptor of a Q or K tile (rows of head_dim int8, K-major, see matrix_descriptor).
template <int kHeadDim>
__device__ __forceinline__ uint64_t qk_descriptor(uint32_t tile) {
  return matrix_descriptor(tile, 16, Smem<kHeadDim>::kQkCoreBytes, Smem<kHeadDim>::kQkSwizzle);
}

// S = Q8 K8^T for one consumer: its 64 query rows against the 128 keys of a K tile, head_dim / 32
// steps of 32 bytes within the rows (the unswizzled offset: see matrix_descriptor).
template <int kHeadDim>
__device__ __forceinline__ void gemm_qk(int32_t (&s)[kBlockN / 2], uint32_t q_tile,
                                        uint32_t k_tile) {
  const uint64_t q = qk_descriptor<kHeadDim>(q_tile), k = qk_descriptor<kHeadDim>(k_tile);
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 32; ++kk) {
    const uint64_t a = advance_descriptor(q, 32 * kk);
    const uint64_t b = advance_descriptor(k, 32 * kk);
    if (kk == 0)
      wgmma_s8_ss<false>(s, a, b);
    else
      wgmma_s8_ss<true>(s, a, b);
  }
}

// The descriptor of a V tile (head_dim rows of 128 keys, K-major: 8-row groups 1024 bytes apart,
// SBO).
__device__ __forceinline__ uint64_t v_descriptor(uint32_t tile) {
  return matrix_descriptor(tile, 16, 8 * kVRowBytes);
}

// O_tile = P V for one consumer and N of O's columns: P [64 x 128 keys] from registers (p[kk]:
// keys 32 kk..32 kk + 31), V^T [N rows x 128 keys] from the V tile's row of the block's first
// column (v_rows), step kk at byte 32 kk of each row. The first step overwrites o_tile
// (scale_d = 0).
template <int N>
__device__ __forceinline__ void gemm_pv(float (&o_tile)[N / 2],
                                        const uint32_t (&p)[kBlockN / 32][4], uint32_t v_rows) {
  const uint64_t v = v_descriptor(v_rows);
#pragma unroll
  for (int kk = 0; kk < kBlockN / 32; ++kk) {
    const uint64_t b = advance_descriptor(v, 32 * kk);
    if (kk == 0)
      wgmma_e4m3_rs<N, false>(o_tile, p[kk], b);
    else
      wgmma_e4m3_rs<N, true>(o_tile, p[kk], b);
  }
}

// O += P V of one tile for one consumer (the V tile landed; in the loop its turn to issue GEMMs
// held, after it the last tile's without one), o's D fragment of kOColumns columns: at head_dim 64
// one m64n72 GEMM (the channels and the sum rows); at 128 blocks of kPvChannels channels (block c
// at o[c / 2..]), each waited for and added into O, the last with the sum rows' m64n8 GEMM beside
// it (o[kHeadDim / 2..]). P's registers are free after it.
template <int kHeadDim>
__device__ __forceinline__ void accumulate_pv(float (&o)[kOColumns<kHeadDim> / 2],
                                              const uint32_t (&p)[kBlockN / 32][4],
                                              uint32_t v_tile) {
  constexpr int kBlock = kHeadDim == 64 ? kOColumns<kHeadDim> : kPvChannels;
  constexpr bool kSumApart = kBlock == kPvChannels;  // the sum rows in a GEMM of their own
#pragma unroll
  for (int c = 0; c < kHeadDim; c += kBlock) {
    const bool with_sum = kSumApart && c + kBlock == kHeadDim;
    float o_tile[kBlock / 2], l_tile[kSumRows / 2];  // (written by each GEMM's first k-step)
    wgmma_fence();
    gemm_pv<kBlock>(o_tile, p, v_tile + c * kVRowBytes);
    if (with_sum) gemm_pv<kSumRows>(l_tile, p, v_tile + kHeadDim * kVRowBytes);
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(o_tile);
#pragma unroll
    for (int i = 0; i < kBlock / 2; ++i) o[c / 2 + i] += o_tile[i];
    if (with_sum) {
      fence_registers(l_tile);
#pragma unroll
      for (int i = 0; i < kSumRows / 2; ++i) o[kHeadDim / 2 + i] += l_tile[i];
    }
  }
}

// Online softmax over one tile's integer scores s = q8.k8 (this thread's part of rows g and g + 8,
// see wgmma_ss in hopper_wgmma.cuh), factor[r] = q_scale * k_scale * scale * log2(e) of row r:
// each row's new base-2 max m, alpha = exp2(m_old - m_new), s = 448 exp2(s factor - m_new) in
// place (as fp32 bits); the row sums come from the P V GEMM (kSumRows). An unmasked tile takes
// the max from the integer scores (the min for a negative factor), so each score costs one
// conversion, one FMA and one EX2; the last tile (kMask) scales first and sets keys at or past
// `valid` to -inf. A row whose max is still -inf takes its probabilities against 0.
template <bool kMask>
__device__ __forceinline__ void softmax_tile(int32_t (&s)[kBlockN / 2], float (&m)[2],
                                             float (&alpha)[2], const float (&factor)[2], int valid,
                                             int t) {
  float tile_max[2] = {-INFINITY, -INFINITY};
  if (kMask) {
#pragma unroll
    for (int i = 0; i < kBlockN / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = static_cast<float>(s[4 * i + e]) * factor[e / 2];
        if (8 * i + 2 * t + (e & 1) >= valid) x = -INFINITY;
        s[4 * i + e] = __float_as_int(x);
        tile_max[e / 2] = fmaxf(tile_max[e / 2], x);
      }
    }
  } else {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      int32_t extreme = s[2 * r];
      if (factor[r] >= 0.f) {
#pragma unroll
        for (int i = 0; i < kBlockN / 8; ++i)
          extreme = max(extreme, max(s[4 * i + 2 * r], s[4 * i + 2 * r + 1]));
      } else {
#pragma unroll
        for (int i = 0; i < kBlockN / 8; ++i)
          extreme = min(extreme, min(s[4 * i + 2 * r], s[4 * i + 2 * r + 1]));
      }
      tile_max[r] = static_cast<float>(extreme) * factor[r];
    }
  }
  float base[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float m_new = fmaxf(m[r], group_reduce(tile_max[r], 4, NanMax{}));
    const float m_base = m_new == -INFINITY ? 0.f : m_new;
    alpha[r] = exp2_ftz(m[r] - m_base);
    m[r] = m_new;
    base[r] = m_base - kLog2PScale;
  }
#pragma unroll
  for (int i = 0; i < kBlockN / 2; ++i) {
    const int r = (i % 4) / 2;
    const float x = kMask ? __int_as_float(s[i]) : static_cast<float>(s[i]);
    const float p = exp2_ftz(fmaf(x, kMask ? 1.f : factor[r], -base[r]));
    s[i] = __float_as_int(p);
  }
}

// Four floats as e4m3 codes in one register, k0 in the lowest byte (rounded to nearest, saturated
// to 448).
__device__ __forceinline__ uint32_t e4m3x4(float k0, float k1, float k2, float k3) {
  uint32_t r;
  asm("{ .reg .b16 lo, hi;"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;"
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;"
      "mov.b32 %0, {lo, hi}; }"
      : "=r"(r)
      : "f"(k0), "f"(k1), "f"(k2), "f"(k3));
  return r;
}

// The probabilities (times 448, fp32 bits in s) as e4m3 A fragments of O_tile = P V: per 32-key
// step kk and row g + 8 r, group 2kk's keys {2t, 2t+1, 8+2t, 9+2t} (S's column blocks 4kk and
// 4kk + 1) are P's columns 32 kk + 4t.. in v8's order (ltx_attention_v_column), group 2kk + 1's
// (blocks 4kk + 2, 4kk + 3) its columns 32 kk + 16 + 4t...
__device__ __forceinline__ void quantize_probabilities(uint32_t (&p)[kBlockN / 32][4],
                                                       const int32_t (&s)[kBlockN / 2]) {
  auto prob = [&](int block, int r, int u) { return __int_as_float(s[4 * block + 2 * r + u]); };
#pragma unroll
  for (int kk = 0; kk < kBlockN / 32; ++kk) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int block = 4 * kk + 2 * half;
        p[kk][2 * half + r] = e4m3x4(prob(block, r, 0), prob(block, r, 1), prob(block + 1, r, 0),
                                     prob(block + 1, r, 1));
      }
    }
  }
}

// Zeroes the columns of keys [valid, 128) of a V tile (head_dim rows of 128 columns, 128-byte
// swizzle: 16-byte chunk c of row r at chunk c ^ (r % 8)), by the 32 lanes of a warp. A chunk is
// a group of 16 keys; its byte j holds key ltx_attention_v_key(j) of the group.
template <int kHeadDim>
__device__ __forceinline__ void zero_v_keys(uint32_t v_tile, int valid, int lane) {
  const int first_chunk = valid / 16, chunks = kVRowBytes / 16 - first_chunk;
  for (int c = lane; c < kHeadDim * chunks; c += 32) {
    const int row = c / chunks, chunk = first_chunk + c % chunks;
    const uint32_t at = v_tile + row * kVRowBytes + ((chunk ^ (row % 8)) * 16);
    uint32_t w[4];
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                 : "r"(at)
                 : "memory");
    const int keys = valid - 16 * chunk;  // keys of the group to keep
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t keep = 0;
#pragma unroll
      for (int byte = 0; byte < 4; ++byte)
        if (ltx_attention_v_key(4 * i + byte) < keys) keep |= 0xffu << (8 * byte);
      w[i] &= keep;
    }
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(at), "r"(w[0]), "r"(w[1]),
                 "r"(w[2]), "r"(w[3])
                 : "memory");
  }
}

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(Shape::kThreads, 1)
    attention_int8_kernel(const __grid_constant__ TensorMaps maps, const AttentionInt8Params<T> p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = Smem<kHeadDim>;
  using S = Shape;
  constexpr int kConsumers = S::kConsumers;
  constexpr int kStages = L::kStages;
  __shared__ Barriers<kStages> bars;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // The tiles' base, rounded up to 1024 bytes (the launch asks for 1024 bytes more).
  const uint32_t smem = (shared_address(smem_raw) + kAtomBytes - 1) / kAtomBytes * kAtomBytes;

  const WorkTiles<S::kBlockM> work(p.q_len, p.heads, p.batch, p.split);
  // (uniform_warpgroup at head_dim 64: no spills, against 64 bytes without it; at 128 it measured
  // 2-4% slower, more spills)
  const int warpgroup = kHeadDim == 64 ? uniform_warpgroup() : threadIdx.x / kWarpgroup;
  const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  {  // each stage's sum rows: ones, then zeros
    constexpr int kChunks = kSumRows * kVRowBytes / 16;
    for (int i = threadIdx.x; i < kStages * kChunks; i += blockDim.x) {
      const int stage = i / kChunks, chunk = i % kChunks;
      const uint32_t word = chunk < kVRowBytes / 16 ? kE4m3Ones : 0u;
      store_shared16(smem + L::v(stage) + kHeadDim * kVRowBytes + chunk * 16, word, word);
    }
    fence_proxy_async_shared();  // (the GEMMs read them through the async proxy)
  }
  init_barriers(bars, kConsumers);

  wait_for_prior_grids();
  allow_dependent_grids();
  // A work tile's K/V tiles (the V tiles' data ends at column v_columns: the last tile zeroes up
  // to it).
  auto keys = [&](int b) { return static_cast<int>(p.attended_keys(b)); };
  auto key_tiles_of = [&](const CtaTile& tile) {
    return key_tiles<kBlockN>(keys(tile.b), p.v_columns, tile);
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
        bars, work, key_tiles_of, lane, L::kQBytes, L::kKBytes, L::kVLoadBytes,
        [&](const CtaTile& tile, int c, uint32_t bar) {
          tma_load_4d(smem + L::q(c), maps.q, 0, tile.h, tile.q_first + c * kConsumerRows, tile.b,
                      bar);
        },
        [&](const CtaTile& tile, int stage, int j, uint32_t bar) {
          tma_load_4d(smem + L::k(stage), maps.k, 0, tile.h, j * kBlockN, tile.b, bar);
        },
        [&](const CtaTile& tile, int stage, int j, uint32_t bar) {
          tma_load_4d(smem + L::v(stage), maps.v, j * kBlockN, 0, tile.h, tile.b, bar);
        },
        [&](const KeyTiles& tiles, int stage) {  // its columns of keys [last_valid, 128): zeros
          zero_v_keys<kHeadDim>(smem + L::v(stage), tiles.last_valid, lane);
        });
    return;
  }

  // A consumer: rows 16 warp + g and 16 warp + g + 8 of its 64 (see wgmma_ss) of each work tile.
  set_max_registers_inc<S::kConsumerRegs>();
  const int consumer = warpgroup - 1;
  const int g = lane / 4, t = lane % 4;
  const uint32_t q_tile = smem + L::q(consumer);
  // The consumers take turns issuing their GEMMs (hopper_common.cuh: Turns).
  const Turns<kConsumers> turns(consumer);
  Ring<kStages> ring;
  for (int64_t w = blockIdx.x; w < work.total; w += gridDim.x) {
    const CtaTile tile = work[w];
    const KeyTiles tiles = key_tiles_of(tile);
    const int kv_tiles = tiles.count, last_valid = tiles.last_valid, h = tile.h, b = tile.b;
    const int row0 = tile.q_first + consumer * kConsumerRows + warp * 16 + g;
    span(w, consumer, kStart);
    float o[kOColumns<kHeadDim> / 2];  // (l x 448 of row g + 8 r: o[kHeadDim / 2 + 2 r], t = 0)
#pragma unroll
    for (int i = 0; i < kOColumns<kHeadDim> / 2; ++i) o[i] = 0.f;
    float m[2] = {-INFINITY, -INFINITY};  // running max of each row's base-2 scores

    if (kv_tiles > 0) {
      // whether this work tile's last K/V tile is the CTA's last turn
      const bool ctas_last = !work.more_after(w, key_tiles_of);
      // q_scale * scale * log2(e) of rows g and g + 8 (0 past q_len); q_scale alone until tile 0's
      // S GEMM has landed, so that the loads' latency passes under it
      float q_factor[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t query = row0 + 8 * r;
        q_factor[r] = query < p.q_len ? p.q_scale[(b * p.q_len + query) * p.heads + h] : 0.f;
      }
      const float* const k_scale =
          p.k_scale + (int64_t{b} * p.heads + h) * p.key_blocks + tiles.first;
      int32_t s[kBlockN / 2];        // (written by each S GEMM's first k-step)
      uint32_t pa[kBlockN / 32][4];  // P of the tile whose P V GEMM is next
      float alpha[2], factor[2];
      if (ring.q_use == 0) turns.start();
      wait_q(bars, consumer, ring);
      span(w, consumer, kQLanded);

      // Tile 0: S only (no P V yet).
      float k_factor = k_scale[0];
      mbarrier_wait(shared_address(&bars.k_full[ring.stage(0)]), ring.parity(0));
      turns.wait();
      wgmma_fence();
      gemm_qk<kHeadDim>(s, q_tile, smem + L::k(ring.stage(0)));
      wgmma_commit();
      turns.pass(ctas_last && kv_tiles == 1);
      wgmma_wait<0>();
      fence_registers(s);
      if (kv_tiles == 1) release_q(bars, consumer, lane);  // the work tile's S GEMMs are done
      __syncwarp();
      if (lane == 0) mbarrier_arrive(shared_address(&bars.k_empty[ring.stage(0)]));  // K read
      q_factor[0] *= p.scale_log2;
      q_factor[1] *= p.scale_log2;
      factor[0] = q_factor[0] * k_factor;
      factor[1] = q_factor[1] * k_factor;
      if (kv_tiles == 1 && last_valid < kBlockN)
        softmax_tile<true>(s, m, alpha, factor, last_valid, t);
      else
        softmax_tile<false>(s, m, alpha, factor, kBlockN, t);
      quantize_probabilities(pa, s);
      span(w, consumer, kFirstTileDone, pa);

      for (int j = 1; j < kv_tiles; ++j) {
        const int stage = ring.stage(j), prev = ring.stage(j - 1);
        k_factor = k_scale[j];  // (read while the GEMMs run)
        probe(w, consumer, j, kTileTop);
        mbarrier_wait(shared_address(&bars.k_full[stage]), ring.parity(j));
        mbarrier_wait(shared_address(&bars.v_full[prev]), ring.parity(j - 1));
        const uint32_t v_prev = smem + L::v(prev), k_tile = smem + L::k(stage);
        auto release_v =
            [&] {  // once the P V GEMM of tile j - 1 is done: P and its V tile are free
              fence_registers(pa);
              __syncwarp();
              if (lane == 0) mbarrier_arrive(shared_address(&bars.v_empty[prev]));
            };
        const bool last_turn = ctas_last && j == kv_tiles - 1;
        turns.wait();
        probe(w, consumer, j, kTurnHeld);
        if constexpr (kHeadDim == kPvChannels) {
          // The P V GEMM of tile j - 1 and the S GEMM of tile j back to back (O_tile, P and S fit
          // beside O at head_dim 64): O_tile is added into O while the S GEMM runs.
          float o_tile[kOColumns<kHeadDim> / 2];
          wgmma_fence();
          gemm_pv<kOColumns<kHeadDim>>(o_tile, pa, v_prev);
          wgmma_commit();
          gemm_qk<kHeadDim>(s, q_tile, k_tile);
          wgmma_commit();
          turns.pass(last_turn);
          probe(w, consumer, j, kSIssued);
          wgmma_wait<1>();  // (groups complete in order: the P V GEMM)
          fence_registers(o_tile);
          release_v();
#pragma unroll
          for (int i = 0; i < kOColumns<kHeadDim> / 2; ++i) o[i] += o_tile[i];
          probe(w, consumer, j, kPvAdded, o);
        } else {
          accumulate_pv<kHeadDim>(o, pa, v_prev);  // O += P V of tile j - 1
          release_v();
          probe(w, consumer, j, kPvAdded, o);
          wgmma_fence();
          gemm_qk<kHeadDim>(s, q_tile, k_tile);  // S of tile j
          wgmma_commit();
          turns.pass(last_turn);
          probe(w, consumer, j, kSIssued);
        }
        wgmma_wait<0>();
        fence_registers(s);
        probe(w, consumer, j, kSLanded);
        if (j == kv_tiles - 1) release_q(bars, consumer, lane);  // the work tile's S GEMMs are done
        __syncwarp();
        if (lane == 0) mbarrier_arrive(shared_address(&bars.k_empty[stage]));  // K tile j is read
        factor[0] = q_factor[0] * k_factor;
        factor[1] = q_factor[1] * k_factor;
        if (j == kv_tiles - 1 && last_valid < kBlockN)
          softmax_tile<true>(s, m, alpha, factor, last_valid, t);
        else
          softmax_tile<false>(s, m, alpha, factor, kBlockN, t);
        probe(w, consumer, j, kSoftmaxDone, s);
        rescale_o<kHeadDim>(o, alpha);  // to m of tile j (l with it)
        quantize_probabilities(pa, s);
        probe(w, consumer, j, kTileDone, pa);
      }

      // O += P V of the last tile (its V keys past n_b zeroed first where they hold data).
      span(w, consumer, kLoopEnd, pa);
      const int stage = ring.stage(kv_tiles - 1);
      mbarrier_wait(shared_address(&bars.v_full[stage]), ring.parity(kv_tiles - 1));
      if (tiles.zero_v_tail()) wait_v_tail(bars, ring);
      accumulate_pv<kHeadDim>(o, pa, smem + L::v(stage));
      fence_registers(pa);
      __syncwarp();
      if (lane == 0) mbarrier_arrive(shared_address(&bars.v_empty[stage]));  // for the next tile
      ring.advance(tiles);
    }
    span(w, consumer, kLastPvDone, o);

    // out = O v_scale / l, lse = m ln 2 + ln(l / 448) (natural log); a row without keys: 0, -inf.
    // A part of a split work tile leaves them in fp32 to the merge (split_merge.cuh).
    // (v_scale is read into registers first: out may alias it for all the compiler knows, so a
    // load between the stores would wait for the store before it, one L2 round trip each, 4-6 us a
    // CTA)
    const float* const v_scale = p.v_scale + (int64_t{b} * p.heads + h) * kHeadDim;
    float v_factor[kHeadDim / 4];  // channels nd * 8 + 2t and + 1
#pragma unroll
    for (int nd = 0; nd < kHeadDim / 8; ++nd) {
      v_factor[2 * nd] = v_scale[nd * 8 + 2 * t];
      v_factor[2 * nd + 1] = v_scale[nd * 8 + 2 * t + 1];
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // (O's sum columns: lane t holds column head_dim + 2t, zero but for t = 0)
      const float sum = group_reduce(o[kHeadDim / 2 + 2 * r], 4);
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      const int64_t query = row0 + 8 * r;
      if (tile.parts > 1) {
        float2 values[kHeadDim / 8];
#pragma unroll
        for (int nd = 0; nd < kHeadDim / 8; ++nd)
          values[nd] = make_float2(o[4 * nd + 2 * r] * inv * v_factor[2 * nd],
                                   o[4 * nd + 2 * r + 1] * inv * v_factor[2 * nd + 1]);
        store_partial_row<kHeadDim>(p.split, tile, row0 + 8 * r - tile.q_first, values,
                                    sum > 0.f ? m[r] * kLn2 + logf(sum) - kLnPScale : -INFINITY, t);
        continue;
      }
      uint32_t pairs[kHeadDim / 8];
#pragma unroll
      for (int nd = 0; nd < kHeadDim / 8; ++nd)
        pairs[nd] = flash_mma::round_pair<T>(o[4 * nd + 2 * r] * inv * v_factor[2 * nd],
                                             o[4 * nd + 2 * r + 1] * inv * v_factor[2 * nd + 1]);
      store_quad_row(p.out.row(b, query < p.q_len ? query : 0, h), query < p.q_len, pairs, t);
      if (query >= p.q_len) continue;
      if (p.lse != nullptr && t == 0)
        p.lse[(b * p.heads + h) * p.q_len + query] =
            sum > 0.f ? m[r] * kLn2 + logf(sum) - kLnPScale : -INFINITY;
    }
    span(w, consumer, kStored);
  }
#else
  __trap();  // built without sm_90a machine code: the launcher never runs this body there
#endif
}

// ------------------------------------------------------------------------------------------------
// Host side: the tensor maps and the launch.
// ------------------------------------------------------------------------------------------------
// A 4-D tensor map of 8-bit codes, dims innermost first at the given byte strides of dims 1-3,
// boxes of `box` elements, the given swizzle; rows past a dim's size are zero-filled. A dim of
// size 1 takes its inner neighbour's extent as its stride (never applied; the encoder wants
// multiples of 16). False when the encoder refuses it.
inline bool encode_codes(CUtensorMap* map, const void* data, const int64_t (&dims)[4],
                         const int64_t (&strides)[3], const cuuint32_t (&box)[4],
                         CUtensorMapSwizzle swizzle) {
  const EncodeTiled encode = encode_tiled();
  if (encode == nullptr) return false;
  cuuint64_t sizes[4], bytes[3];
  for (int d = 0; d < 4; ++d) sizes[d] = static_cast<cuuint64_t>(dims[d]);
  for (int d = 0; d < 3; ++d)
    bytes[d] = static_cast<cuuint64_t>(dims[d + 1] > 1 ? strides[d] : (dims[0] + 15) / 16 * 16);
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, const_cast<void*>(data), sizes, bytes, box,
                element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Whether this body takes the call: a compute capability 9.x device (9.0, the sm_90a machine
// code's, is the only one), sizes within int32 (TMA's coordinates) and operands the tensor-map
// encoder takes; then the maps (left zeroed without keys: the kernel reads none through them, its
// producer only prefetches them).
template <typename T, int kHeadDim>
bool takes(const AttentionInt8Params<T>& p, TensorMaps* maps) {
  if (device_attribute<cudaDevAttrComputeCapabilityMajor>(9) != 9) return false;  // (9.0 only)
  if (p.q_len + Shape::kBlockM > INT32_MAX || p.v_columns + kBlockN > INT32_MAX ||
      p.heads > INT32_MAX || p.batch > INT32_MAX)
    return false;
  if (p.kv_len == 0) return true;
  const CUtensorMapSwizzle qk_swizzle =
      kHeadDim == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
  const cuuint32_t q_box[4] = {kHeadDim, 1, kConsumerRows, 1};
  const cuuint32_t k_box[4] = {kHeadDim, 1, kBlockN, 1};
  const cuuint32_t v_box[4] = {kBlockN, kHeadDim, 1, 1};
  // q8, k8: {head_dim, heads, len, batch}; v8: {kv_len rounded up to 16 columns, head_dim, heads,
  // batch}
  return encode_codes(&maps->q, p.q.data, {kHeadDim, p.heads, p.q_len, p.batch},
                      {p.q.head_stride, p.q.seq_stride, p.q.batch_stride}, q_box, qk_swizzle) &&
         encode_codes(&maps->k, p.k.data, {kHeadDim, p.heads, p.kv_len, p.batch},
                      {p.k.head_stride, p.k.seq_stride, p.k.batch_stride}, k_box, qk_swizzle) &&
         encode_codes(&maps->v, p.v.data, {p.v_columns, kHeadDim, p.heads, p.batch},
                      {p.v.head_stride, p.v.seq_stride, p.v.batch_stride}, v_box,
                      CU_TENSOR_MAP_SWIZZLE_128B);
}

// Runs the kernel's persistent CTAs over every (query tile, head, batch element) with the maps
// from takes().
template <typename T, int kHeadDim>
int run(const AttentionInt8Params<T>& p, const TensorMaps& maps, cudaStream_t stream) {
  constexpr size_t kSmem = Smem<kHeadDim>::kBytes + kAtomBytes;  // (+ the alignment slack)
  const cudaError_t err =
      cudaFuncSetAttribute(attention_int8_kernel<T, kHeadDim>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem));
  if (err != cudaSuccess) return static_cast<int>(err);
  return launch(attention_int8_kernel<T, kHeadDim>, persistent_grid<Shape::kBlockM>(p),
                dim3(Shape::kThreads), kSmem, stream, maps, p);
}

}  // namespace hopper_int8
}  // namespace ltx
