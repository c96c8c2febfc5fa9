// The Hopper (sm_90a) building blocks the attention kernel bodies share (hopper_wgmma.cuh: bf16
// and fp16; hopper_int8.cuh: 8-bit): PTX wrappers for mbarriers, TMA, named barriers, register
// limits, wgmma's fences and shared-memory descriptors, exp2 on the MUFU, the kernel skeleton
// (a CTA's tile, its barriers and K/V tiles, the producer's loop), and the driver's tensor-map
// encoder (looked up at run time).
#pragma once

#include <cuda.h>  // CUtensorMap and its enums only: the encoder is found at run time
#include <cuda_runtime.h>
#include <stdint.h>

#include "../device/launch.cuh"  // sm_count
#include "attention_params.cuh"  // KeySplit

namespace ltx {
namespace hopper {

constexpr int kWarpgroup = 128;  // threads

// A CTA of one producer warpgroup and three consumer warpgroups of 64 query rows each (the wgmma's
// M): its queries, threads and the registers setmaxnreg gives each kind of warpgroup, 128 *
// (producer + 3 * consumer) <= the SM's 64K (160 a consumer, as FlashAttention-3's three-consumer
// kernels). Both bodies take this shape at both head dims (at head_dim 128 three ran 3-16% faster
// than two consumers of 240 registers each on an H100, benchmarks/NOTES.md).
struct CtaShape {
  static constexpr int kConsumers = 3;
  static constexpr int kBlockM = kConsumers * 64;
  static constexpr int kThreads = (1 + kConsumers) * kWarpgroup;
  static constexpr int kProducerRegs = 32;
  static constexpr int kConsumerRegs = 160;
  static_assert(kWarpgroup * (kProducerRegs + kConsumers * kConsumerRegs) <= 65536);
};

// The CTA's mbarriers (static shared memory) in both bodies' pipeline.
template <int kStages>
struct Barriers {
  uint64_t q_full[CtaShape::kConsumers];   // consumer c's Q tile landed (TMA bytes)
  uint64_t q_empty[CtaShape::kConsumers];  // consumer c's last S GEMM is done (one per warp)
  uint64_t k_full[kStages];                // stage's K tile landed (TMA bytes)
  uint64_t v_full[kStages];                // stage's V tile landed (TMA bytes)
  uint64_t k_empty[kStages];  // every consumer's S GEMM read the stage's K tile (one per warp)
  uint64_t v_empty[kStages];  // every consumer's P V GEMM read the stage's V tile (one per warp)
  // A work tile's last V tile past n_b is zeroed (32 arrivals; KeyTiles), zeroings alternating
  // between the two (Ring). One would not do: a consumer releases its Q tile (after its last S
  // GEMM) before it waits on its work tile's zeroing, so the producer could go on and complete
  // the next zeroing first. With two, a barrier's next zeroing comes after the producer's q_empty
  // waits of a work tile with keys in between, which each consumer releases only after the
  // epilogue in which it waited on this barrier.
  uint64_t v_tail[2];
};

// ------------------------------------------------------------------------------------------------
// PTX wrappers: shared addresses are 32-bit (cvta to the shared window).
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
}

// One arrival that also raises the phase's expected transaction bytes (the TMA copies' sizes).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Waits until the barrier's phase of parity `parity` has completed (phases alternate 0, 1, 0...:
// use u of a barrier completes phase u, so its waiters pass parity u & 1).
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, "
        "p; }"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
}

// TMA: the box at coordinates {c0, c1, c2, c3} (innermost first) of a 4-D tensor map into shared
// memory at dst, completing `bar`'s transaction bytes.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap& map, int c0, int c1,
                                            int c2, int c3, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], "
      "[%1, {%2, %3, %4, %5}], [%6];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap& map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&map)) : "memory");
}

// The 16 bytes at shared address `at`: `first`, then three copies of `rest`.
__device__ __forceinline__ void store_shared16(uint32_t at, uint32_t first, uint32_t rest) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %2, %2};" ::"r"(at), "r"(first), "r"(rest)
               : "memory");
}

// Generic-proxy writes to shared memory made visible to the async proxy (TMA, wgmma).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

template <int kRegs>
__device__ __forceinline__ void set_max_registers_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

template <int kRegs>
__device__ __forceinline__ void set_max_registers_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// This thread's warpgroup (threadIdx.x / 128) through a shuffle from lane 0, which ptxas knows to
// be uniform across the warp: a consumer's tile addresses then live in uniform registers, leaving
// vector registers to the softmax (fewer spills; the bodies say where it measured faster).
__device__ __forceinline__ int uniform_warpgroup() {
  return __shfl_sync(~0u, threadIdx.x / kWarpgroup, 0);
}
// Named barriers over `threads` threads: sync waits for them all, arrive only counts.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

// Waits until at most kPending committed wgmma groups of this warpgroup are in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// The accumulator operands of a wgmma wrapper's asm (hopper_wgmma.cuh, hopper_int8.cuh): d[0..N)
// under constraint C, "+r" / "+f" to accumulate into them, "=r" / "=f" for a GEMM's first k-step
// (scale_d = 0: d = A B), which overwrites them, so that they hold nothing live before it.
#define LTX_D8(C, d, i) \
  C(d[i]), C(d[i + 1]), C(d[i + 2]), C(d[i + 3]), C(d[i + 4]), C(d[i + 5]), C(d[i + 6]), C(d[i + 7])
#define LTX_D32(C, d) LTX_D8(C, d, 0), LTX_D8(C, d, 8), LTX_D8(C, d, 16), LTX_D8(C, d, 24)
#define LTX_D64(C, d) \
  LTX_D32(C, d), LTX_D8(C, d, 32), LTX_D8(C, d, 40), LTX_D8(C, d, 48), LTX_D8(C, d, 56)

// Keeps the compiler from moving reads or writes of registers that an in-flight wgmma writes (or
// reads) across the wait: each use after the wait depends on this empty asm's output.
template <int N>
__device__ __forceinline__ void fence_registers(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

template <int N>
__device__ __forceinline__ void fence_registers(int32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

template <int N, int M>
__device__ __forceinline__ void fence_registers(uint32_t (&r)[N][M]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < M; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

// A wgmma shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"), 64 bits:
//   bits  0-13  the matrix's start address >> 4
//   bits 16-29  leading dimension byte offset >> 4 (LBO)
//   bits 32-45  stride dimension byte offset >> 4 (SBO)
//   bits 49-51  base offset: 0, every tile starts at a 1024-byte boundary (the swizzle's period)
//   bits 62-63  swizzle mode: 1 = 128-byte swizzle, 2 = 64-byte swizzle (the patterns TMA writes
//               with CU_TENSOR_MAP_SWIZZLE_128B / _64B)
// With the 128-byte swizzle a "core" block is 8 rows of 128 bytes (1024 bytes). For a K-major
// operand (Q, K: the reduction dim contiguous) a wgmma's 16 reduction elements (32 bytes) lie
// within a row: SBO is the distance between 8-row groups (1024 bytes), LBO is unused (set to 1,
// as CUTLASS does), and the k-th 16-element step starts 32 k bytes further (the hardware applies
// the swizzle to the computed addresses, so the offset is the unswizzled one). For an MN-major
// operand (V, the output dim contiguous: transposed through imm-trans-b = 1) SBO is the distance
// between groups of 8 reduction rows (1024 bytes) and LBO that between 64-element groups of the
// N dimension (the next panel). With the 64-byte swizzle (rows of 64 bytes) a core block is 8
// rows of 64 bytes: SBO 512 for a K-major operand.
enum Swizzle : uint64_t { kSwizzle128B = 1, kSwizzle64B = 2 };

__device__ __forceinline__ uint64_t matrix_descriptor(uint32_t address, uint32_t lbo, uint32_t sbo,
                                                      Swizzle swizzle = kSwizzle128B) {
  return static_cast<uint64_t>((address & 0x3FFFF) >> 4) |
         static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16 |
         static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32 | static_cast<uint64_t>(swizzle) << 62;
}

// The descriptor of the matrix `bytes` (a multiple of 16) past desc's start: one 32-bit add to the
// low word (matrix_descriptor costs four uniform operations a wgmma, on the issue's critical
// path). The advanced address stays inside the CTA's shared memory (< 2^18 bytes), which the
// 14-bit address field holds, so the add changes no other field.
__device__ __forceinline__ uint64_t advance_descriptor(uint64_t desc, uint32_t bytes) {
  const uint32_t low = static_cast<uint32_t>(desc) + (bytes >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | low;
}

// 2^x in one MUFU.EX2 (ex2.approx.ftz: 2 ulp, subnormal results flushed to 0: probabilities below
// 2^-126, far under any bound of the tests; exp2f adds the subnormal fix-ups to each).
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// O (a consumer's D fragment of 64 rows and 2 N >= head_dim columns, N registers: rows g and g + 8
// in o[i] with (i % 4) / 2 = 0, 1) rescaled to the tile's new max, alpha[r] = exp2(m_old - m_new)
// of row r. At head_dim 128 only where some row of the warp has a new max (a vote: x * 1 = x, so
// skipping alpha = 1 leaves O bit for bit; 2-6% faster there on an H100); at 64 always (the vote
// measured a loss of up to 1%).
template <int kHeadDim, int N>
__device__ __forceinline__ void rescale_o(float (&o)[N], const float (&alpha)[2]) {
  static_assert(N >= kHeadDim / 2);
  if (kHeadDim == 64 || __any_sync(~0u, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
    for (int i = 0; i < N; ++i) o[i] *= alpha[(i % 4) / 2];
  }
}

// Lanes t and t ^ kMask swap two of their four registers: the lane with `upper` set sends x[u0]
// and x[u1] and takes its partner's in their place, the other does the same with x[l0], x[l1].
template <int kMask>
__device__ __forceinline__ void swap_pair(uint32_t (&x)[4], bool upper, int u0, int u1, int l0,
                                          int l1) {
  uint32_t s0 = upper ? x[u0] : x[l0], s1 = upper ? x[u1] : x[l1];
  s0 = __shfl_xor_sync(~0u, s0, kMask);
  s1 = __shfl_xor_sync(~0u, s1, kMask);
  if (upper)
    x[u0] = s0, x[u1] = s1;
  else
    x[l0] = s0, x[l1] = s1;
}

// Stores one output row that the 4 threads t of a quad hold, thread t the channels 8 nd + 2t and
// 8 nd + 2t + 1 as pairs[nd] (two T in a register), if `store`. Where the row is 16-byte aligned
// it goes out in 16-byte chunks: a 4 x 4 transpose within the quad (lanes t ^ 2 swap the 2 x 2
// blocks off the diagonal, then lanes t ^ 1 the off-diagonal elements of each block) gives thread
// t the whole chunk of block 4 G + t of each group G of four blocks; otherwise pair by pair.
// Every lane of the warp calls it (the shuffles), each quad with its own row.
template <typename T, int kPairs>
__device__ __forceinline__ void store_quad_row(T* out_row, bool store,
                                               const uint32_t (&pairs)[kPairs], int t) {
  static_assert(kPairs % 4 == 0, "whole groups of four 8-channel blocks");
  const bool aligned = (reinterpret_cast<uintptr_t>(out_row) & 15) == 0;
#pragma unroll
  for (int group = 0; group < kPairs / 4; ++group) {
    uint32_t x[4] = {pairs[4 * group], pairs[4 * group + 1], pairs[4 * group + 2],
                     pairs[4 * group + 3]};
    swap_pair<2>(x, t & 2, 0, 1, 2, 3);
    swap_pair<1>(x, t & 1, 0, 2, 1, 3);
    if (store && aligned)
      *reinterpret_cast<uint4*>(out_row + (4 * group + t) * 8) = make_uint4(x[0], x[1], x[2], x[3]);
  }
  if (store && !aligned) {
#pragma unroll
    for (int nd = 0; nd < kPairs; ++nd)
      *reinterpret_cast<uint32_t*>(out_row + nd * 8 + 2 * t) = pairs[nd];
  }
}

// ------------------------------------------------------------------------------------------------
// The kernel skeleton both bodies share: a persistent CTA's work tiles, its barriers, its K/V
// tiles, the producer's loop and the zeroing of the last V tile's keys past the attended ones.
// ------------------------------------------------------------------------------------------------
// A work tile's query tile (its first row), head and batch element, and which share of its keys:
// part `part` of `parts` (1: all of them; KeySplit), `split` its index among the split tiles.
struct CtaTile {
  int q_first, h, b, part, parts, split;  // (split tiles: fewer than the SMs)
};

// The work of the grid's CTAs: `tiles` work tiles (query tiles vary fastest, then heads, then
// batch elements), those from split.whole on in split.parts parts each (consecutive units), CTA i
// taking units i, i + gridDim.x, ... (a grid of one CTA an SM at most: a CTA's next tile loads
// while its consumers finish the last one, where a CTA a tile paid its start, the loads' first
// latency and the consumers' staggered ends each time, 3-4 tile periods).
template <int kBlockM>
struct WorkTiles {
  int64_t q_tiles, heads, tiles, whole;
  int parts;
  int64_t total;  // units
  __host__ __device__ WorkTiles(int64_t q_len, int64_t heads_, int64_t batch, const KeySplit& split)
      : q_tiles(query_tiles(q_len)),
        heads(heads_),
        tiles(q_tiles * heads_ * batch),
        whole(split.parts > 1 ? split.whole : tiles),
        parts(split.parts > 1 ? split.parts : 1),
        total(whole + (tiles - whole) * parts) {}
  __host__ __device__ static int64_t query_tiles(int64_t q_len) {
    return (q_len + kBlockM - 1) / kBlockM;
  }
  __device__ __forceinline__ CtaTile operator[](int64_t w) const {
    int64_t tile = w;
    int split = -1, part = 0;
    if (w >= whole) {
      split = static_cast<int>((w - whole) / parts);
      part = static_cast<int>((w - whole) % parts);
      tile = whole + split;
    }
    return {static_cast<int>(tile % q_tiles * kBlockM),
            static_cast<int>(tile / q_tiles % heads),
            static_cast<int>(tile / q_tiles / heads),
            part,
            split < 0 ? 1 : parts,
            split};
  }
  // Whether a unit after w of this CTA attends keys (tiles_of(tile): its KeyTiles).
  template <class TilesOf>
  __device__ __forceinline__ bool more_after(int64_t w, TilesOf tiles_of) const {
    for (w += gridDim.x; w < total; w += gridDim.x)
      if (tiles_of((*this)[w]).count > 0) return true;
    return false;
  }
};

// Thread 0 initializes the CTA's barriers (the K/V stages' "empty" barriers take one arrival per
// consumer warp, a consumer's Q "empty" one per warp of it), then every thread waits for it.
template <int kStages>
__device__ __forceinline__ void init_barriers(Barriers<kStages>& bars, int consumers) {
  if (threadIdx.x == 0) {
    for (int c = 0; c < consumers; ++c) {
      mbarrier_init(shared_address(&bars.q_full[c]), 1);
      mbarrier_init(shared_address(&bars.q_empty[c]), 4);
    }
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(shared_address(&bars.k_full[s]), 1);
      mbarrier_init(shared_address(&bars.v_full[s]), 1);
      mbarrier_init(shared_address(&bars.k_empty[s]), consumers * 4);
      mbarrier_init(shared_address(&bars.v_empty[s]), consumers * 4);
    }
    mbarrier_init(shared_address(&bars.v_tail[0]), 32);
    mbarrier_init(shared_address(&bars.v_tail[1]), 32);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    fence_proxy_async_shared();
  }
  __syncthreads();  // the barriers are initialized before anyone uses them
}

// A consumer's timeline, for benchmarks/attention_launcher_timing.cu built with
// -DLTX_ATTENTION_TIMELINE (compiled out otherwise): lane 0 of each consumer warp records
// clock64() at each Probe of K/V tile j < kTimelineTiles of work tile timeline_tile, after the
// registers `live` are written (so that the read is not moved above the work it ends).
enum Probe { kTileTop, kTurnHeld, kPvAdded, kSIssued, kSLanded, kSoftmaxDone, kTileDone, kProbes };
#ifdef LTX_ATTENTION_TIMELINE  // (static: each translation unit that turns it on has its own)
constexpr int kTimelineTiles = 48;
static __device__ long long timeline[CtaShape::kConsumers * 4 * kTimelineTiles * kProbes];
static __device__ long long timeline_tile = -1;
#endif
template <class... Live>
__device__ __forceinline__ void probe(int64_t w, int consumer, int j, Probe e, Live&... live) {
#ifdef LTX_ATTENTION_TIMELINE
  (fence_registers(live), ...);
  const int warp = threadIdx.x / 32 % 4;
  if (threadIdx.x % 32 == 0 && j < kTimelineTiles && w == timeline_tile)
    timeline[((consumer * 4 + warp) * kTimelineTiles + j) * kProbes + e] = clock64();
#endif
}

// A work tile's span, for benchmarks/attention_launcher_timing.cu built with
// -DLTX_ATTENTION_SPANS (compiled out otherwise): for every work tile below kSpanTiles, lane 0 of
// each consumer's first warp records clock64() at each Span (kStart also the SM's id and the
// global timer).
enum Span { kStart, kQLanded, kFirstTileDone, kLoopEnd, kLastPvDone, kStored, kSpans };
#ifdef LTX_ATTENTION_SPANS
constexpr int kSpanTiles = 8192;
constexpr int kSpanWords = 2 + CtaShape::kConsumers * kSpans;
static __device__ long long tile_spans[kSpanTiles * kSpanWords];
static __device__ int spans_on = 0;
#endif
template <class... Live>
__device__ __forceinline__ void span(int64_t w, int consumer, Span e, Live&... live) {
#ifdef LTX_ATTENTION_SPANS
  (fence_registers(live), ...);
  if (threadIdx.x % kWarpgroup == 0 && spans_on && w < kSpanTiles) {
    long long* words = tile_spans + w * kSpanWords;
    words[2 + consumer * kSpans + e] = clock64();
    if (e == kStart && consumer == 0) {
      unsigned sm;
      long long now;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      words[0] = sm;
      words[1] = now;
    }
  }
#endif
}

// The consumers' turns to issue their GEMMs, through named barriers kFirstTurnBarrier.. (one per
// consumer): consumer c issues its GEMMs of a K/V tile after wait(), which completes once consumer
// c - 1 has issued its own of that tile and called pass() (consumer 0: the last consumer's of the
// tile before, or for the CTA's first the last consumer's start()), so one consumer's softmax
// runs beside the others' GEMMs (a ring of CtaShape's three; two would ping-pong). The ring runs
// on across a CTA's work tiles. Each consumer waits as many times as it receives arrivals: the
// last consumer skips its pass of the CTA's last K/V tile (consumer 0 has no next turn), so no
// barrier is left with pending arrivals. A barrier counts the 128 threads that wait on it and the
// 128 of the consumer before, which arrive.
constexpr int kFirstTurnBarrier = 1;  // (named barrier 0 is __syncthreads')

template <int kConsumers>
struct Turns {
  static constexpr int kThreads = 2 * kWarpgroup;
  int mine, next;
  bool last;
  __device__ __forceinline__ explicit Turns(int consumer)
      : mine(kFirstTurnBarrier + consumer),
        next(kFirstTurnBarrier + (consumer + 1) % kConsumers),
        last(consumer == kConsumers - 1) {}
  __device__ __forceinline__ void start() const {
    if (last) named_barrier_arrive(next, kThreads);
  }
  __device__ __forceinline__ void wait() const { named_barrier_sync(mine, kThreads); }
  __device__ __forceinline__ void pass(bool ctas_last_tile) const {
    if (!(last && ctas_last_tile)) named_barrier_arrive(next, kThreads);
  }
};

// The K/V tiles of kBlockN keys a work tile's part attends, for `keys` attended keys of V tiles
// whose data ends at `v_end` (kv_len; the 8-bit body's v8: kv_len rounded up to 16 columns): part
// `part` of `parts` takes tiles [part n / parts, (part + 1) n / parts) of the n = ceil(keys / 128).
struct KeyTiles {
  int first;       // the part's first tile (of all the work tile's)
  int count;       // tiles attended
  int last_valid;  // attended keys of the last tile (kBlockN unless it is the work tile's last)
  int zero_end;    // the last tile's V [last_valid, zero_end) holds data (below v_end) to zero
  __device__ __forceinline__ bool zero_v_tail() const { return count > 0 && last_valid < zero_end; }
};

template <int kBlockN>
__device__ __forceinline__ KeyTiles key_tiles(int keys, int64_t v_end, const CtaTile& tile) {
  const int all = (keys + kBlockN - 1) / kBlockN;
  const int first = tile.part * all / tile.parts, end = (tile.part + 1) * all / tile.parts;
  if (end < all) return {first, end - first, kBlockN, kBlockN};
  const int64_t stop = v_end < int64_t{all} * kBlockN ? v_end : int64_t{all} * kBlockN;
  return {first, end - first, keys - (all - 1) * kBlockN,
          static_cast<int>(stop - (all - 1) * int64_t{kBlockN})};
}

// Where a CTA stands in its pipeline across work tiles; the producer and each consumer keep
// their own, advanced alike after each work tile with keys: K/V tile j of the current work tile
// is the CTA's tile first + j, in stage (first + j) % kStages, its stage's use (first + j) /
// kStages; q_use counts the work tiles with keys before (the Q barriers' phases), tail_use those
// whose last V tile was zeroed (v_tail[tail_use % 2], phase tail_use / 2).
template <int kStages>
struct Ring {
  int first = 0, q_use = 0, tail_use = 0;
  __device__ __forceinline__ int stage(int j) const { return (first + j) % kStages; }
  __device__ __forceinline__ int use(int j) const { return (first + j) / kStages; }
  __device__ __forceinline__ uint32_t parity(int j) const { return use(j) & 1; }
  __device__ __forceinline__ void advance(const KeyTiles& tiles) {
    first += tiles.count;
    ++q_use;
    tail_use += tiles.zero_v_tail();
  }
};

// A consumer's waits and releases on the barriers of its Q tile and of the zeroed V tail.
template <int kStages>
__device__ __forceinline__ void wait_q(Barriers<kStages>& bars, int consumer,
                                       const Ring<kStages>& ring) {
  mbarrier_wait(shared_address(&bars.q_full[consumer]), ring.q_use & 1);
}
template <int kStages>
__device__ __forceinline__ void release_q(Barriers<kStages>& bars, int consumer, int lane) {
  __syncwarp();
  if (lane == 0) mbarrier_arrive(shared_address(&bars.q_empty[consumer]));
}
template <int kStages>
__device__ __forceinline__ void wait_v_tail(Barriers<kStages>& bars, const Ring<kStages>& ring) {
  mbarrier_wait(shared_address(&bars.v_tail[ring.tail_use & 1]), (ring.tail_use >> 1) & 1);
}

// The producer's loop over a work tile (one thread): each consumer's Q tile once that consumer's
// S GEMMs of the work tile before are done (load_q(c, bar), q_bytes), then K and V tile j into
// stage ring.stage(j) (load_k / load_v(stage, j, bar), k_bytes / v_bytes each). A stage's K tile
// is free once every consumer's S GEMM of the tile kStages before is done (early in their
// iteration), its V tile once their P V GEMMs are (one iteration later): separate barriers, so a K
// tile loads while the P V GEMM of the tile kStages before runs.
template <int kStages, class LoadQ, class LoadK, class LoadV>
__device__ __forceinline__ void produce(Barriers<kStages>& bars, const Ring<kStages>& ring,
                                        int tiles, uint32_t q_bytes, uint32_t k_bytes,
                                        uint32_t v_bytes, LoadQ load_q, LoadK load_k,
                                        LoadV load_v) {
  for (int c = 0; c < CtaShape::kConsumers; ++c) {
    const uint32_t q_bar = shared_address(&bars.q_full[c]);
    if (ring.q_use > 0) mbarrier_wait(shared_address(&bars.q_empty[c]), (ring.q_use - 1) & 1);
    mbarrier_arrive_expect_tx(q_bar, q_bytes);
    load_q(c, q_bar);
  }
  for (int j = 0; j < tiles; ++j) {
    const int stage = ring.stage(j), use = ring.use(j);
    const uint32_t k_bar = shared_address(&bars.k_full[stage]);
    const uint32_t v_bar = shared_address(&bars.v_full[stage]);
    if (use > 0) mbarrier_wait(shared_address(&bars.k_empty[stage]), (use - 1) & 1);
    mbarrier_arrive_expect_tx(k_bar, k_bytes);
    load_k(stage, j, k_bar);
    if (use > 0) mbarrier_wait(shared_address(&bars.v_empty[stage]), (use - 1) & 1);
    mbarrier_arrive_expect_tx(v_bar, v_bytes);
    load_v(stage, j, v_bar);
  }
}

// The producer warp's zeroing of a work tile's last V tile's keys past the attended ones, where
// they hold data: once the tile has landed, zero(stage) by the 32 lanes, then a fence so that the
// consumers' wgmma sees the zeros, and one arrival a lane on v_tail[ring.tail_use % 2] (the
// consumers wait for it: wait_v_tail).
template <int kStages, class Zero>
__device__ __forceinline__ void zero_last_v_tile(Barriers<kStages>& bars, const Ring<kStages>& ring,
                                                 const KeyTiles& tiles, Zero zero) {
  if (!tiles.zero_v_tail()) return;
  const int last = tiles.count - 1, stage = ring.stage(last);
  mbarrier_wait(shared_address(&bars.v_full[stage]), ring.parity(last));
  zero(stage);
  fence_proxy_async_shared();
  mbarrier_arrive(shared_address(&bars.v_tail[ring.tail_use & 1]));
}

// The producer warp's loop over the CTA's work tiles (work[w], w = blockIdx.x, + gridDim.x, ...)
// that have keys (tiles_of(tile): a unit's KeyTiles): lane 0 issues each one's loads (produce:
// load_q(tile, c, bar), load_k / load_v(tile, stage, j, bar), j of all the work tile's K/V tiles),
// then the warp zeroes the last V tile's keys past the attended ones where they hold data
// (zero_last_v_tile: zero(tiles, stage)). Its Ring runs on across the work tiles as each
// consumer's does.
template <int kBlockM, int kStages, class TilesOf, class LoadQ, class LoadK, class LoadV,
          class Zero>
__device__ __forceinline__ void produce_work(Barriers<kStages>& bars,
                                             const WorkTiles<kBlockM>& work, TilesOf tiles_of,
                                             int lane, uint32_t q_bytes, uint32_t k_bytes,
                                             uint32_t v_bytes, LoadQ load_q, LoadK load_k,
                                             LoadV load_v, Zero zero) {
  Ring<kStages> ring;
  for (int64_t w = blockIdx.x; w < work.total; w += gridDim.x) {
    const CtaTile tile = work[w];
    const KeyTiles tiles = tiles_of(tile);
    if (tiles.count == 0) continue;
    if (lane == 0)
      produce(
          bars, ring, tiles.count, q_bytes, k_bytes, v_bytes,
          [&](int c, uint32_t bar) { load_q(tile, c, bar); },
          [&](int stage, int j, uint32_t bar) { load_k(tile, stage, tiles.first + j, bar); },
          [&](int stage, int j, uint32_t bar) { load_v(tile, stage, tiles.first + j, bar); });
    __syncwarp();
    zero_last_v_tile(bars, ring, tiles, [&](int stage) { zero(tiles, stage); });
    ring.advance(tiles);
  }
}

// ------------------------------------------------------------------------------------------------
// Split work tiles (KeySplit): where a part's rows go.
// ------------------------------------------------------------------------------------------------
// Row `row` (of the work tile's kBlockM) of a split tile's part: its out row (head_dim fp32) and
// its lse in split's workspace.
template <int kHeadDim>
__device__ __forceinline__ float* partial_row(const KeySplit& split, const CtaTile& tile, int row) {
  return split.partials +
         ((int64_t{tile.split} * tile.parts + tile.part) * CtaShape::kBlockM + row) * kHeadDim;
}
__device__ __forceinline__ float* partial_lse(const KeySplit& split, const CtaTile& tile, int row) {
  return split.lse + (int64_t{tile.split} * tile.parts + tile.part) * CtaShape::kBlockM + row;
}

// Stores one row of a split tile's part that the 4 threads t of a quad hold (values[nd]: channels
// 8 nd + 2t and + 1 of out, fp32) and, from thread 0, its lse.
template <int kHeadDim>
__device__ __forceinline__ void store_partial_row(const KeySplit& split, const CtaTile& tile,
                                                  int row, const float2 (&values)[kHeadDim / 8],
                                                  float lse, int t) {
  float* const out = partial_row<kHeadDim>(split, tile, row);
#pragma unroll
  for (int nd = 0; nd < kHeadDim / 8; ++nd)
    *reinterpret_cast<float2*>(out + nd * 8 + 2 * t) = values[nd];
  if (t == 0) *partial_lse(split, tile, row) = lse;
}

// ------------------------------------------------------------------------------------------------
// Host side.
// ------------------------------------------------------------------------------------------------
// The split of a call's work tiles (KeySplit), each of key_tiles K/V tiles: where the persistent
// grid's last round would keep rem = tiles % SMs of the SMs busy, at most half of them, its tiles
// run in parts = SMs / rem parts (at most kMaxParts, each of at least kMinPartTiles K/V tiles),
// so that the round takes about 1 / parts of a tile's time (FLUX's 1x24x4608 at head_dim 128:
// 576 tiles of 192 queries, 4.36 rounds of 132 SMs; 4.5 instead of 5 in two parts). The parts'
// rows need split_workspace() bytes (KeySplit's partials, then lse).
constexpr int kMaxParts = 4;
constexpr int kMinPartTiles = 2;

inline int split_parts(int64_t tiles, int64_t key_tiles) {
  const int64_t sms = sm_count(), rem = tiles % sms;
  if (rem == 0) return 1;
  int64_t parts = sms / rem;
  if (parts > kMaxParts) parts = kMaxParts;
  if (parts > key_tiles / kMinPartTiles) parts = key_tiles / kMinPartTiles;
  return parts > 1 ? static_cast<int>(parts) : 1;
}

inline int64_t split_rows(int64_t tiles, int parts) {
  return tiles % sm_count() * parts * CtaShape::kBlockM;
}

inline int64_t split_workspace(int64_t tiles, int parts, int head_dim) {
  return parts > 1 ? split_rows(tiles, parts) * (head_dim + 1) * int64_t{sizeof(float)} : 0;
}

// The KeySplit of `parts` over a workspace of split_workspace() bytes.
inline KeySplit key_split(int64_t tiles, int parts, int head_dim, void* workspace) {
  float* const partials = static_cast<float*>(workspace);
  return KeySplit{partials, partials + split_rows(tiles, parts) * head_dim,
                  tiles - tiles % sm_count(), parts};
}

// The persistent grid of a call (WorkTiles): one CTA an SM, fewer where there are fewer units.
template <int kBlockM, class Params>
dim3 persistent_grid(const Params& p) {
  const int64_t units = WorkTiles<kBlockM>(p.q_len, p.heads, p.batch, p.split).total;
  return dim3(static_cast<unsigned>(units < sm_count() ? units : sm_count()));
}

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's cuTensorMapEncodeTiled, looked up once through the runtime (no link to libcuda);
// nullptr when the driver has none.
inline EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    void* entry = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &entry, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();  // clear it: the launcher falls back to flash_mma.cuh
      return EncodeTiled{nullptr};
    }
    return reinterpret_cast<EncodeTiled>(entry);
  }();
  return fn;
}

}  // namespace hopper
}  // namespace ltx
