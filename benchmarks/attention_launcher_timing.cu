// Timing of the attention C launchers without torch: ltx_attention_int8_cuda (default) or, with
// BF16=1 in the environment, ltx_attention_cuda in bf16, at benchmark_attention.py's six cases and
// two odd shapes, on operands from a fixed hash (the same in every build). Each case: one call,
// then 30 timed calls (CUDA events around each, L2 flushed by a 256 MiB memset before each), the
// median and TF/s (4 B H S^2 D flops), with the launcher's workspace (LTX_KERNELS_ATTENTION_SPLIT
// =off in the environment: none, no work tile split). Built from a kernel_src tree of its own, so
// that two builds of the kernels (a change and main) compare on one GPU in one job, each in its own
// process:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I SRC -o /tmp/timing_SRC \
//     benchmarks/attention_launcher_timing.cu SRC/attention/attention.cu SRC/launch.cu \
//     SRC/checks.c -lcuda
//   /tmp/timing_main DIR       (writes each case's bf16 output to DIR/CASE.bin)
//   /tmp/timing_change - DIR   (compares each output with DIR's: relative L2, max |diff|, and the
//                               share of elements not bit-identical)
// Built with -DLTX_ATTENTION_TIMELINE (the launcher's source then compiled into this file: drop
// SRC/attention/attention.cu from the command), each 8-bit case is run once more with the
// consumers' probes on (hopper_common.cuh: probe) in work tile 3/4 of the grid's (a later one of
// its CTA where there are several), and prints, per consumer warp, when each probe fires after
// its tile's top (clocks, the mean over the tiles past the first three: zeros below five tiles),
// and the tiles' period. At head_dim 64 "S issued" comes before "PV added" (both GEMMs issue
// before the P V wait). The probes change the machine code (more spills): compare timelines with
// timelines only. Built with -DLTX_ATTENTION_SPANS instead (the same way), each case (both
// bodies) is run once more with every work tile's span recorded (hopper_common.cuh: span) and
// prints their means (print_spans).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "ltx_kernels.h"
#if defined(LTX_ATTENTION_TIMELINE) || defined(LTX_ATTENTION_SPANS)
#include "attention/attention.cu"
#endif

namespace {

__device__ uint32_t hash(uint64_t i, uint32_t seed) {
  uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
  x ^= x >> 15;
  x *= 2246822519u;
  x ^= x >> 13;
  x *= 3266489917u;
  return x ^ (x >> 16);
}

// kind 0: int8 codes in [-127, 127]; 1: finite e4m3 codes of magnitude <= 240; 2: bf16 in
// [-1.7, 1.7).
__global__ void fill(void* data, int64_t n, uint32_t seed, int kind) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint32_t x = hash(i, seed);
    if (kind == 0) {
      static_cast<int8_t*>(data)[i] = static_cast<int8_t>(static_cast<int>(x % 255) - 127);
    } else if (kind == 1) {
      const uint8_t code = static_cast<uint8_t>(x % 0x78);
      static_cast<uint8_t*>(data)[i] = (x & 0x100) ? (code | 0x80) : code;
    } else {
      const float f = ((x & 0xffff) / 32768.f - 1.f) * 1.7f;
      static_cast<uint16_t*>(data)[i] = static_cast<uint16_t>(__float_as_uint(f) >> 16);
    }
  }
}

__global__ void fill_value(float* data, int64_t n, float value) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    data[i] = value;
}

void* device_alloc(int64_t bytes) {
  void* p = nullptr;
  if (cudaMalloc(&p, static_cast<size_t>(bytes)) != cudaSuccess) {
    fprintf(stderr, "cudaMalloc of %lld bytes failed\n", static_cast<long long>(bytes));
    exit(1);
  }
  return p;
}

double bf16_value(uint16_t bits) {
  const uint32_t u = uint32_t{bits} << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

struct Case {
  const char* name;
  int64_t batch, heads, len, head_dim;
};

#ifdef LTX_ATTENTION_TIMELINE
// Runs call() once with the probes on in work tile 3/4 of `tiles` and prints the 8-bit body's
// timeline.
template <class Call>
void print_timeline(Call call, int64_t tiles_total, int64_t kv_tiles) {
  using namespace ltx::hopper;
  const long long tile = tiles_total * 3 / 4, off = -1;
  cudaMemcpyToSymbol(timeline_tile, &tile, sizeof tile);
  call();
  cudaDeviceSynchronize();
  cudaMemcpyToSymbol(timeline_tile, &off, sizeof off);
  std::vector<long long> t(sizeof(timeline) / sizeof(long long));
  cudaMemcpyFromSymbol(t.data(), timeline, t.size() * sizeof(long long));
  const int tiles = static_cast<int>(std::min<int64_t>(kv_tiles, kTimelineTiles));
  auto at = [&](int c, int w, int j, int e) {
    return t[((c * 4 + w) * kTimelineTiles + j) * kProbes + e];
  };
  const char* names[kProbes] = {"top",      "turn held",    "PV added", "S issued",
                                "S landed", "softmax done", "tile done"};
  printf("  timeline of work tile %lld, clocks after a tile's top (mean of tiles 3..%d):", tile,
         tiles - 2);
  for (int e = 1; e < kProbes; ++e) printf(" | %s", names[e]);
  printf(" | period\n");
  for (int c = 0; c < ltx::hopper::CtaShape::kConsumers; ++c)
    for (int w = 0; w < 4; ++w) {
      double sum[kProbes + 1] = {0};
      int n = 0;
      for (int j = 3; j < tiles - 1; ++j, ++n) {
        for (int e = 1; e < kProbes; ++e) sum[e] += at(c, w, j, e) - at(c, w, j, kTileTop);
        sum[kProbes] += at(c, w, j + 1, kTileTop) - at(c, w, j, kTileTop);
      }
      printf("    consumer %d warp %d:", c, w);
      for (int e = 1; e <= kProbes; ++e) printf(" %6.0f", n > 0 ? sum[e] / n : 0.0);
      printf("\n");
    }
}
#endif

#ifdef LTX_ATTENTION_SPANS
// Runs call() once with every work tile's span recorded and prints means over the work tiles past
// each SM's first (clocks of the SM): consumer 0's wait for its Q tile, its first K/V tile, the
// period of a K/V tile, its last tile to the last consumer's stores, and the cycle of a work tile
// (consumer 0's start to its start of the next on the SM) beyond its K/V tiles' periods.
template <class Call>
void print_spans(Call call, int64_t tiles, int64_t kv_tiles) {
  using namespace ltx::hopper;
  const int on = 1, off = 0;
  cudaMemcpyToSymbol(spans_on, &on, sizeof on);
  call();
  cudaDeviceSynchronize();
  cudaMemcpyToSymbol(spans_on, &off, sizeof off);
  std::vector<long long> words(kSpanTiles * kSpanWords);
  cudaMemcpyFromSymbol(words.data(), tile_spans, words.size() * sizeof(long long));
  const int n = static_cast<int>(std::min<int64_t>(tiles, kSpanTiles));
  constexpr int kC = CtaShape::kConsumers;
  auto at = [&](int w, int c, int e) { return words[size_t(w) * kSpanWords + 2 + c * kSpans + e]; };
  auto stored = [&](int w) {
    long long e = 0;
    for (int c = 0; c < kC; ++c) e = std::max(e, at(w, c, kStored));
    return e;
  };
  std::vector<std::vector<int>> by_sm(1024);
  for (int w = 0; w < n; ++w) by_sm[words[size_t(w) * kSpanWords] & 1023].push_back(w);
  double q = 0, first = 0, period = 0, tail = 0, stagger = 0, pv = 0, extra = 0;
  int counted = 0, cycles = 0;
  for (auto& list : by_sm) {
    std::sort(list.begin(), list.end(),
              [&](int a, int b) { return at(a, 0, kStart) < at(b, 0, kStart); });
    for (size_t k = 1; k < list.size(); ++k) {
      const int w = list[k];
      const double tile_period =
          kv_tiles > 1 ? double(at(w, 0, kLoopEnd) - at(w, 0, kFirstTileDone)) / (kv_tiles - 1) : 0;
      q += at(w, 0, kQLanded) - at(w, 0, kStart);
      first += at(w, 0, kFirstTileDone) - at(w, 0, kQLanded);
      period += tile_period;
      tail += stored(w) - at(w, 0, kLoopEnd);
      stagger += at(w, kC - 1, kLoopEnd) - at(w, 0, kLoopEnd);
      pv += at(w, kC - 1, kLastPvDone) - at(w, kC - 1, kLoopEnd);
      ++counted;
      if (k + 1 < list.size()) {
        extra += at(list[k + 1], 0, kStart) - at(w, 0, kStart) - kv_tiles * tile_period;
        ++cycles;
      }
    }
  }
  if (counted == 0) return;
  q /= counted, first /= counted, period /= counted, tail /= counted, stagger /= counted;
  pv /= counted, extra /= std::max(cycles, 1);
  printf(
      "  spans (clocks, %d work tiles past each SM's first): Q wait %.0f | first tile %.0f | "
      "period %.0f | loop end->stored %.0f (last consumer's loop end +%.0f, its last P V "
      "+%.0f) | a work tile's cycle beyond its tiles' periods %.0f = %.2f periods\n",
      counted, q, first, period, tail, stagger, pv, extra, extra / period);
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const char* dump = argc > 1 && strcmp(argv[1], "-") != 0 ? argv[1] : nullptr;
  const char* reference = argc > 2 ? argv[2] : nullptr;
  const bool bf16 = getenv("BF16") != nullptr;
  constexpr int kReps = 30;
  const Case cases[] = {
      {"2x32x2688_hd64", 2, 32, 2688, 64},     {"2x32x8064_hd64", 2, 32, 8064, 64},
      {"1x24x4608_hd128", 1, 24, 4608, 128},   {"2x32x6144_hd128", 2, 32, 6144, 128},
      {"1x40x32760_hd128", 1, 40, 32760, 128}, {"1x16x49290_hd128", 1, 16, 49290, 128},
      {"1x3x1000_hd128", 1, 3, 1000, 128},     {"2x5x333_hd64", 2, 5, 333, 64}};
  const size_t flush_bytes = size_t{256} << 20;
  void* flush = device_alloc(flush_bytes);
  for (const Case& c : cases) {
    const int64_t B = c.batch, H = c.heads, S = c.len, D = c.head_dim, n = B * S * H * D;
    const int64_t pad = ltx_attention_v_pad(S), key_blocks = (S + 127) / 128;
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    // q_scale = k_scale: scores of standard deviation about 2 (int8 codes uniform in +-127)
    const float qk_scale = std::sqrt(3.3e-5f * (D == 64 ? 2.f : 1.f) / static_cast<float>(scale));
    const int64_t strides[3] = {S * H * D, H * D, D};
    std::vector<void*> owned;
    auto alloc = [&](int64_t bytes) { return owned.emplace_back(device_alloc(bytes)); };
    void* out = alloc(n * 2);
    ltx_attention_int8_args_t a8;
    ltx_attention_args_t a16;
    memset(&a8, 0, sizeof a8);
    memset(&a16, 0, sizeof a16);
    if (bf16) {
      void *q = alloc(n * 2), *k = alloc(n * 2), *v = alloc(n * 2);
      fill<<<1024, 256>>>(q, n, 11, 2);
      fill<<<1024, 256>>>(k, n, 12, 2);
      fill<<<1024, 256>>>(v, n, 13, 2);
      a16.out = {out, LTX_BFLOAT16, {B, S, H}, {strides[0], strides[1], strides[2]}};
      a16.q = {q, LTX_BFLOAT16, {B, S, H}, {strides[0], strides[1], strides[2]}};
      a16.k = {k, LTX_BFLOAT16, {B, S, H}, {strides[0], strides[1], strides[2]}};
      a16.v = {v, LTX_BFLOAT16, {B, S, H}, {strides[0], strides[1], strides[2]}};
      a16.head_dim = D;
      a16.scale = scale;
    } else {
      void *q8 = alloc(n), *k8 = alloc(n), *v8 = alloc(B * H * D * pad);
      float* q_scale = static_cast<float*>(alloc(B * S * H * 4));
      float* k_scale = static_cast<float*>(alloc(B * H * key_blocks * 4));
      float* v_scale = static_cast<float*>(alloc(B * H * D * 4));
      fill<<<1024, 256>>>(q8, n, 1, 0);
      fill<<<1024, 256>>>(k8, n, 2, 0);
      fill<<<1024, 256>>>(v8, B * H * D * pad, 3, 1);
      fill_value<<<256, 256>>>(q_scale, B * S * H, qk_scale);
      fill_value<<<256, 256>>>(k_scale, B * H * key_blocks, qk_scale);
      fill_value<<<256, 256>>>(v_scale, B * H * D, 1.f / 448.f);
      a8.out = {out, LTX_BFLOAT16, {B, S, H}, {strides[0], strides[1], strides[2]}};
      a8.q8 = {q8, LTX_INT8, {B, S, H}, {strides[0], strides[1], strides[2]}};
      a8.k8 = {k8, LTX_INT8, {B, S, H}, {strides[0], strides[1], strides[2]}};
      a8.v8 = {v8, LTX_FLOAT8_E4M3, {B, H, D}, {H * D * pad, D * pad, pad}};
      a8.q_scale = q_scale;
      a8.k_scale = k_scale;
      a8.v_scale = v_scale;
      a8.head_dim = D;
      a8.kv_pad = pad;
      a8.scale = scale;
    }
    // the launcher's workspace (its split of the last round's work tiles; none with
    // LTX_KERNELS_ATTENTION_SPLIT=off)
    const int64_t workspace =
        bf16 ? ltx_attention_cuda_workspace(&a16) : ltx_attention_int8_cuda_workspace(&a8);
    if (workspace > 0) {
      a16.workspace = a8.workspace = alloc(workspace);
      a16.workspace_bytes = a8.workspace_bytes = workspace;
    }
    auto call = [&] {
      return bf16 ? ltx_attention_cuda(&a16, 0) : ltx_attention_int8_cuda(&a8, 0);
    };
    const int status = call();
    const cudaError_t err = cudaDeviceSynchronize();
    if (status != LTX_OK || err != cudaSuccess) {
      printf("%s: status %d, %s\n", c.name, status, cudaGetErrorString(err));
      return 1;
    }
    cudaEvent_t start, stop;
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
    std::vector<float> ms;
    for (int r = 0; r < kReps; ++r) {
      cudaMemsetAsync(flush, r, flush_bytes, 0);
      cudaEventRecord(start, 0);
      call();
      cudaEventRecord(stop, 0);
      cudaEventSynchronize(stop);
      float t = 0.f;
      cudaEventElapsedTime(&t, start, stop);
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    const double median = ms[kReps / 2];
    printf("%-18s %8.3f ms %7.1f TF/s", c.name, median, 4.0 * B * H * S * S * D / median / 1e9);
    std::vector<uint16_t> host(n);
    cudaMemcpy(host.data(), out, n * 2, cudaMemcpyDeviceToHost);
    char path[512];
    if (dump != nullptr) {
      snprintf(path, sizeof path, "%s/%s.bin", dump, c.name);
      FILE* f = fopen(path, "wb");
      if (f != nullptr) fwrite(host.data(), 2, host.size(), f), fclose(f);
    }
    if (reference != nullptr) {
      snprintf(path, sizeof path, "%s/%s.bin", reference, c.name);
      std::vector<uint16_t> ref(n);
      FILE* f = fopen(path, "rb");
      const size_t got = f != nullptr ? fread(ref.data(), 2, ref.size(), f) : 0;
      if (f != nullptr) fclose(f);
      double diff2 = 0, ref2 = 0, max_diff = 0;
      int64_t differ = 0;
      for (size_t i = 0; i < got; ++i) {
        const double x = bf16_value(host[i]), y = bf16_value(ref[i]);
        diff2 += (x - y) * (x - y);
        ref2 += y * y;
        max_diff = std::max(max_diff, std::fabs(x - y));
        differ += host[i] != ref[i];
      }
      if (got != host.size())
        printf("  (no reference)");
      else
        printf("  vs reference: rel L2 %.2e, max |diff| %.2e, %.3f%% not identical",
               std::sqrt(diff2 / std::max(ref2, 1e-30)), max_diff, 100.0 * differ / got);
    }
    printf("\n");
#ifdef LTX_ATTENTION_TIMELINE
    if (!bf16) print_timeline(call, (S + 191) / 192 * H * B, (S + 127) / 128);
#endif
#ifdef LTX_ATTENTION_SPANS
    print_spans(call, (S + 191) / 192 * H * B, (S + 127) / 128);
#endif
    fflush(stdout);
    for (void* p : owned) cudaFree(p);
  }
  return 0;
}
