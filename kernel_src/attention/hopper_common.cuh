// The Hopper (sm_90a) building blocks the attention kernel bodies share (hopper_wgmma.cuh: bf16
// and fp16; hopper_int8.cuh: 8-bit): PTX wrappers for mbarriers, TMA, named barriers, register
// limits, wgmma's fences and shared-memory descriptors, exp2 on the MUFU, the kernel skeleton
// (a CTA's tile, its barriers and K/V tiles, the producer's loop), and the driver's tensor-map
// encoder (looked up at run time).
#pragma once

#include <cuda.h>  // CUtensorMap and its enums only: the encoder is found at run time
#include <cuda_runtime.h>
#include <stdint.h>

namespace ltx {
namespace hopper {

constexpr int kWarpgroup = 128;  // threads

// The CTA's mbarriers (static shared memory) in both bodies' pipeline.
template <int kStages>
struct Barriers {
  uint64_t q;                 // the Q tiles landed (TMA bytes)
  uint64_t k_full[kStages];   // stage's K tile landed (TMA bytes)
  uint64_t v_full[kStages];   // stage's V tile landed (TMA bytes)
  uint64_t k_empty[kStages];  // every consumer's S GEMM read the stage's K tile (one per warp)
  uint64_t v_empty[kStages];  // every consumer's P V GEMM read the stage's V tile (one per warp)
  uint64_t v_tail;            // the last V tile's data past n_b is zeroed (32 arrivals; KeyTiles)
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

// O (a consumer's [64 x head_dim] D fragment: rows g and g + 8 in o[i] with (i % 4) / 2 = 0, 1)
// rescaled to the tile's new max, alpha[r] = exp2(m_old - m_new) of row r. At head_dim 128 only
// where some row of the warp has a new max (a vote: x * 1 = x, so skipping alpha = 1 leaves O bit
// for bit; 2-6% faster there on an H100); at 64 always (the vote measured a loss of up to 1%).
template <int kHeadDim>
__device__ __forceinline__ void rescale_o(float (&o)[kHeadDim / 2], const float (&alpha)[2]) {
  if (kHeadDim == 64 || __any_sync(~0u, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
    for (int i = 0; i < kHeadDim / 2; ++i) o[i] *= alpha[(i % 4) / 2];
  }
}

// ------------------------------------------------------------------------------------------------
// The kernel skeleton both bodies share: which tile a CTA attends, its barriers, its K/V tiles,
// the producer's loop and the zeroing of the last V tile's keys past the attended ones.
// ------------------------------------------------------------------------------------------------
// A CTA's query tile (its first row), head and batch element: query tiles vary fastest.
struct CtaTile {
  int q_first, h, b;
};

template <int kBlockM>
__device__ __forceinline__ CtaTile cta_tile(int64_t q_len, int64_t heads) {
  const int64_t q_tiles = (q_len + kBlockM - 1) / kBlockM;
  const int64_t cta = blockIdx.x;
  return {static_cast<int>(cta % q_tiles * kBlockM), static_cast<int>(cta / q_tiles % heads),
          static_cast<int>(cta / q_tiles / heads)};
}

// Thread 0 initializes the CTA's barriers (the K/V stages' "empty" barriers take one arrival per
// consumer warp), then every thread waits for it.
template <int kStages>
__device__ __forceinline__ void init_barriers(Barriers<kStages>& bars, int consumers) {
  if (threadIdx.x == 0) {
    mbarrier_init(shared_address(&bars.q), 1);
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(shared_address(&bars.k_full[s]), 1);
      mbarrier_init(shared_address(&bars.v_full[s]), 1);
      mbarrier_init(shared_address(&bars.k_empty[s]), consumers * 4);
      mbarrier_init(shared_address(&bars.v_empty[s]), consumers * 4);
    }
    mbarrier_init(shared_address(&bars.v_tail), 32);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    fence_proxy_async_shared();
  }
  __syncthreads();  // the barriers are initialized before anyone uses them
}

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

// A consumer's timeline, for benchmarks/attention_launcher_timing.cu built with
// -DLTX_ATTENTION_TIMELINE (compiled out otherwise): lane 0 of each consumer warp of the CTA
// timeline_cta records clock64() at each Probe of K/V tile j < kTimelineTiles, after the
// registers `live` are written (so that the read is not moved above the work it ends).
enum Probe { kTileTop, kTurnHeld, kPvAdded, kSIssued, kSLanded, kSoftmaxDone, kTileDone, kProbes };
#ifdef LTX_ATTENTION_TIMELINE  // (static: each translation unit that turns it on has its own)
constexpr int kTimelineTiles = 48;
static __device__ long long timeline[CtaShape::kConsumers * 4 * kTimelineTiles * kProbes];
static __device__ int timeline_cta = -1;
#endif
template <class... Live>
__device__ __forceinline__ void probe(int consumer, int j, Probe e, Live&... live) {
#ifdef LTX_ATTENTION_TIMELINE
  (fence_registers(live), ...);
  const int warp = threadIdx.x / 32 % 4;
  if (threadIdx.x % 32 == 0 && j < kTimelineTiles && static_cast<int>(blockIdx.x) == timeline_cta)
    timeline[((consumer * 4 + warp) * kTimelineTiles + j) * kProbes + e] = clock64();
#endif
}

// A CTA's span, for benchmarks/attention_launcher_timing.cu built with -DLTX_ATTENTION_SPANS
// (compiled out otherwise): for every CTA below kSpanCtas, thread 0 records clock64() and the
// global timer on entry and the SM's id, lane 0 of each consumer's first warp clock64() at each
// ConsumerSpan and the global timer once its outputs are stored.
enum ConsumerSpan { kQLanded, kFirstTileDone, kLoopEnd, kLastPvDone, kStored, kConsumerSpans };
#ifdef LTX_ATTENTION_SPANS
constexpr int kSpanCtas = 8192;
constexpr int kSpanWords = 3 + CtaShape::kConsumers * (kConsumerSpans + 1);
static __device__ long long cta_spans[kSpanCtas * kSpanWords];
static __device__ int spans_on = 0;
__device__ __forceinline__ long long global_timer() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#endif
__device__ __forceinline__ void span_entry() {
#ifdef LTX_ATTENTION_SPANS
  if (threadIdx.x == 0 && spans_on && blockIdx.x < kSpanCtas) {
    long long* w = cta_spans + blockIdx.x * kSpanWords;
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    w[0] = clock64();
    w[1] = global_timer();
    w[2] = sm;
  }
#endif
}
template <class... Live>
__device__ __forceinline__ void span(int consumer, ConsumerSpan e, Live&... live) {
#ifdef LTX_ATTENTION_SPANS
  (fence_registers(live), ...);
  if (threadIdx.x % kWarpgroup == 0 && spans_on && blockIdx.x < kSpanCtas) {
    long long* w = cta_spans + blockIdx.x * kSpanWords + 3 + consumer * (kConsumerSpans + 1);
    w[e] = clock64();
    if (e == kStored) w[kConsumerSpans] = global_timer();
  }
#endif
}

// The consumers' turns to issue their GEMMs, through named barriers kFirstTurnBarrier.. (one per
// consumer): consumer c issues its GEMMs of tile j after wait(), which completes once consumer
// c - 1 has issued its own of tile j and called pass() (consumer 0: the last consumer's of tile
// j - 1, or for tile 0 the last consumer's start()), so one consumer's softmax runs beside the
// others' GEMMs (a ring of CtaShape's three; two would ping-pong). Each consumer waits `tiles`
// times and receives as many arrivals: the last consumer skips its pass of the last tile (consumer
// 0 has no next turn), so no barrier is left with pending arrivals. A barrier counts the 128
// threads that wait on it and the 128 of the consumer before, which arrive.
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
  __device__ __forceinline__ void pass(int j, int tiles) const {
    if (!(last && j == tiles - 1)) named_barrier_arrive(next, kThreads);
  }
};

// The K/V tiles of kBlockN keys a CTA attends, for `keys` attended keys of V tiles whose data
// ends at `v_end` (kv_len; the 8-bit body's v8: kv_len rounded up to 16 columns).
struct KeyTiles {
  int count;       // tiles attended
  int last_valid;  // attended keys of the last tile
  int zero_end;    // the last tile's V [last_valid, zero_end) holds data (below v_end) to zero
  __device__ __forceinline__ bool zero_v_tail() const { return count > 0 && last_valid < zero_end; }
};

template <int kBlockN>
__device__ __forceinline__ KeyTiles key_tiles(int keys, int64_t v_end) {
  const int count = (keys + kBlockN - 1) / kBlockN;
  const int64_t end = v_end < int64_t{count} * kBlockN ? v_end : int64_t{count} * kBlockN;
  return {count, keys - (count - 1) * kBlockN,
          static_cast<int>(end - (count - 1) * int64_t{kBlockN})};
}

// The producer's loop (one thread): the Q tiles (load_q(bar), q_bytes), then K and V tile j into
// stage j % kStages (load_k / load_v(stage, j, bar), k_bytes / v_bytes each). A stage's K tile
// j - kStages is free once every consumer's S GEMM of it is done (early in their iteration
// j - kStages), its V tile once their P V GEMMs are (one iteration later): separate barriers, so
// K tile j loads while the P V GEMM of tile j - kStages runs.
template <int kStages, class LoadQ, class LoadK, class LoadV>
__device__ __forceinline__ void produce(Barriers<kStages>& bars, int tiles, uint32_t q_bytes,
                                        uint32_t k_bytes, uint32_t v_bytes, LoadQ load_q,
                                        LoadK load_k, LoadV load_v) {
  const uint32_t q_bar = shared_address(&bars.q);
  mbarrier_arrive_expect_tx(q_bar, q_bytes);
  load_q(q_bar);
  for (int j = 0; j < tiles; ++j) {
    const int stage = j % kStages, use = j / kStages;
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

// The producer warp's zeroing of the last V tile's keys past the attended ones, where they hold
// data: once the tile has landed, zero(stage) by the 32 lanes, then a fence so that the consumers'
// wgmma sees the zeros, and one arrival a lane on v_tail (the consumers wait for it).
template <int kStages, class Zero>
__device__ __forceinline__ void zero_last_v_tile(Barriers<kStages>& bars, const KeyTiles& tiles,
                                                 Zero zero) {
  if (!tiles.zero_v_tail()) return;
  const int last = tiles.count - 1, stage = last % kStages;
  mbarrier_wait(shared_address(&bars.v_full[stage]), (last / kStages) & 1);
  zero(stage);
  fence_proxy_async_shared();
  mbarrier_arrive(shared_address(&bars.v_tail));
}

// ------------------------------------------------------------------------------------------------
// Host side.
// ------------------------------------------------------------------------------------------------
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
