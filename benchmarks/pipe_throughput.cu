// Issue rates of the per-score instructions of the attention softmax on this GPU: how many results
// a clock an SM delivers for ex2, the int32 -> fp32 conversion (the 8-bit body's scores) and the
// pair-packing conversions (P to bf16 or e4m3), alone and mixed with ex2. Two instructions on one
// pipe add their times when mixed; on separate pipes the mix runs at the slower one's rate.
// One CTA of 1024 threads a SM, 8 independent dependency chains a thread; cycles from clock64().
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/pipe_throughput \
//     benchmarks/pipe_throughput.cu && /tmp/pipe_throughput
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

constexpr int kIterations = 2048, kChains = 8, kThreads = 1024;

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float i2f(float x) {  // (x's bits as an int32)
  float y;
  asm volatile("cvt.rn.f32.s32 %0, %1;" : "=f"(y) : "r"(__float_as_int(x)));
  return y;
}
// The packed pair's low half as a float in [0.5, 1) (to chain the next instruction on it).
__device__ __forceinline__ float e4m3_pair(float a, float b) {
  uint32_t r;
  asm volatile("{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, %1, %2; cvt.u32.u16 %0, t; }"
               : "=r"(r)
               : "f"(a), "f"(b));
  return __uint_as_float(r | 0x3f000000u);
}
__device__ __forceinline__ float bf16_pair(float a, float b) {
  uint32_t r;
  asm volatile("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(a), "f"(b));
  return __uint_as_float((r & 0xffffu) | 0x3f000000u);
}

// ex2 of a half pair (ex2.approx.f16x2), x's bits as the pair; the result as a float in [0.5, 1).
__device__ __forceinline__ float ex2_half_pair(float x) {
  uint32_t r;
  asm volatile("ex2.approx.f16x2 %0, %1;" : "=r"(r) : "r"(__float_as_uint(x) & 0x3bff3bffu));
  return __uint_as_float((r & 0xffffu) | 0x3f000000u);
}
// A half pair (as bits) to two e4m3 codes (cvt.rn.satfinite.e4m3x2.f16x2).
__device__ __forceinline__ float e4m3_from_half_pair(float x) {
  uint32_t r;
  asm volatile("{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f16x2 t, %1; cvt.u32.u16 %0, t; }"
               : "=r"(r)
               : "r"(__float_as_uint(x)));
  return __uint_as_float(r | 0x3f000000u);
}

enum Probe {
  kEx2,
  kI2f,
  kE4m3Pair,
  kBf16Pair,
  kFfma,
  kEx2E4m3,
  kEx2Bf16,
  kEx2I2f,
  kEx2HalfPair,
  kE4m3FromHalfPair,
  kProbes
};
const char* const kNames[kProbes] = {"ex2.approx.ftz.f32",
                                     "cvt.rn.f32.s32",
                                     "cvt.rn.satfinite.e4m3x2.f32",
                                     "cvt.rn.bf16x2.f32",
                                     "fma.rn.f32",
                                     "ex2 + 1/2 e4m3x2 (per ex2)",
                                     "ex2 + 1/2 bf16x2 (per ex2)",
                                     "ex2 + cvt.f32.s32 (per ex2)",
                                     "ex2.approx.f16x2 (pairs)",
                                     "cvt.rn.satfinite.e4m3x2.f16x2"};

template <Probe kProbe>
__global__ void probe(float* out, long long* cycles) {
  float v[kChains];
  for (int c = 0; c < kChains; ++c) v[c] = threadIdx.x * 1e-3f + c;
  __syncthreads();
  const long long start = clock64();
  for (int it = 0; it < kIterations; ++it) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      if (kProbe == kEx2) v[c] = ex2(v[c]);
      if (kProbe == kI2f) v[c] = i2f(v[c]);
      if (kProbe == kE4m3Pair) v[c] = e4m3_pair(v[c], v[c]);
      if (kProbe == kBf16Pair) v[c] = bf16_pair(v[c], v[c]);
      if (kProbe == kFfma) v[c] = fmaf(v[c], 1.0001f, 0.5f);
      if (kProbe == kEx2E4m3) v[c] = c % 2 ? e4m3_pair(ex2(v[c]), v[c - 1]) : ex2(v[c]);
      if (kProbe == kEx2Bf16) v[c] = c % 2 ? bf16_pair(ex2(v[c]), v[c - 1]) : ex2(v[c]);
      if (kProbe == kEx2I2f) v[c] = ex2(i2f(v[c]));
      if (kProbe == kEx2HalfPair) v[c] = ex2_half_pair(v[c]);
      if (kProbe == kE4m3FromHalfPair) v[c] = e4m3_from_half_pair(v[c]);
    }
  }
  __syncthreads();
  const long long end = clock64();
  float sum = 0.f;
  for (int c = 0; c < kChains; ++c) sum += v[c];
  out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
  if (threadIdx.x == 0) cycles[blockIdx.x] = end - start;
}

template <Probe kProbe>
void report(int sms, float* out, long long* cycles) {
  for (int warmup = 0; warmup < 2; ++warmup) probe<kProbe><<<sms, kThreads>>>(out, cycles);
  cudaDeviceSynchronize();
  long long host[1024];
  cudaMemcpy(host, cycles, sms * sizeof(long long), cudaMemcpyDeviceToHost);
  double mean = 0;
  for (int i = 0; i < sms; ++i) mean += static_cast<double>(host[i]) / sms;
  printf("%-30s %7.2f a clock per SM\n", kNames[kProbe],
         double{kThreads} * kChains * kIterations / mean);
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  if (sms <= 0 || sms > 1024) return 1;
  float* out;
  long long* cycles;
  cudaMalloc(&out, sizeof(float) * sms * kThreads);
  cudaMalloc(&cycles, sizeof(long long) * sms);
  report<kEx2>(sms, out, cycles);
  report<kI2f>(sms, out, cycles);
  report<kE4m3Pair>(sms, out, cycles);
  report<kBf16Pair>(sms, out, cycles);
  report<kFfma>(sms, out, cycles);
  report<kEx2E4m3>(sms, out, cycles);
  report<kEx2Bf16>(sms, out, cycles);
  report<kEx2I2f>(sms, out, cycles);
  report<kEx2HalfPair>(sms, out, cycles);
  report<kE4m3FromHalfPair>(sms, out, cycles);
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}
