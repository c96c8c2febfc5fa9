// Rowwise FP8 quantization (CUDA) of x, or of gelu(x) rounded to T (ltx_quantize_fp8_cuda in
// ltx_kernels.h): rows of `hidden` elements in, e4m3 rows and one fp32 scale per row out.
#include "device_utils.cuh"

namespace ltx {
namespace {

constexpr int kMaxThreadsPerRow = 256;
constexpr int kRowBlockThreads = 256;
constexpr int kSlots = 8;  // packs per thread: rows of up to 16384 bf16 / 8192 fp32 are cached

template <typename T>
struct QuantizeArgs {
  RowPtr<uint8_t> out;
  float* out_scale;
  RowPtr<const T> x;
  int64_t rows;
  int hidden;
};

// v = x, or round_T(gelu(x)) as ltx_gelu computes it.
template <typename T, ltx_activation_t kActivation>
__device__ __forceinline__ float activated(float x) {
  if constexpr (kActivation == LTX_ACTIVATION_GELU_TANH)
    return round_to<T>(gelu<LTX_GELU_TANH, T>(x));
  else if constexpr (kActivation == LTX_ACTIVATION_GELU)
    return round_to<T>(gelu<LTX_GELU_NONE, T>(x));
  else
    return x;
}

// Row-cached: each row is held by a power-of-two RowTeam, kSlots packs of kVec elements per
// thread, so x is read once: load, activate, the row's amax (row_reduce), then the e4m3 stores.
template <typename T, int kVec, ltx_activation_t kActivation>
__global__ void __launch_bounds__(kMaxThreadsPerRow)
    quantize_fp8_cached_kernel(const QuantizeArgs<T> a, const int log2_tpr) {
  __shared__ float partials[kMaxThreadsPerRow / 32];
  const RowTeam team = RowTeam::pow2(log2_tpr, a.rows);
  const int n_packs = a.hidden / kVec;
  wait_for_prior_grids();
  allow_dependent_grids();
  Pack<T, kVec> v[kSlots];
  load_packs(v, a.x.row(team.active ? team.row : 0), team, n_packs);
  float amax = 0.f;
  team.for_each_pack<kSlots>(n_packs, [&](int s, int) {
    if constexpr (kActivation != LTX_ACTIVATION_NONE) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) v[s].set(i, activated<T, kActivation>(v[s].get(i)));
    }
    amax = pack_amax(amax, v[s]);
  });
  amax = row_reduce<false>(amax, team, partials, NanMax{});
  if (!team.active) return;
  const Fp8Row fp8 = Fp8Row::of(amax);
  if (team.lane == 0) a.out_scale[team.row] = fp8.scale;
  uint8_t* q_row = a.out.row(team.row);
  team.for_each_pack<kSlots>(n_packs, [&](int s, int p) {
    store_fp8(q_row + static_cast<int64_t>(p) * kVec, v[s], fp8.factor);
  });
}

// Rows too long to cache, or not vectorizable: one block per row (grid-stride), two passes (the
// amax, then the e4m3 values), v recomputed in the second.
template <typename T, ltx_activation_t kActivation>
__global__ void __launch_bounds__(kRowBlockThreads)
    quantize_fp8_streaming_kernel(const QuantizeArgs<T> a) {
  __shared__ float scratch[32];
  wait_for_prior_grids();
  allow_dependent_grids();
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const T* x_row = a.x.row(row);
    float amax = 0.f;
    for (int i = threadIdx.x; i < a.hidden; i += blockDim.x)
      amax = NanMax{}(amax, fabsf(activated<T, kActivation>(to_float(x_row[i]))));
    const Fp8Row fp8 = Fp8Row::of(block_reduce(amax, scratch, NanMax{}));
    if (threadIdx.x == 0) a.out_scale[row] = fp8.scale;
    uint8_t* q_row = a.out.row(row);
    for (int i = threadIdx.x; i < a.hidden; i += blockDim.x)
      q_row[i] =
          static_cast<uint8_t>(to_e4m3(activated<T, kActivation>(to_float(x_row[i])) * fp8.factor));
  }
}

template <typename T, ltx_activation_t kActivation>
int quantize_fp8_typed(const QuantizeArgs<T>& a, const ltx_rows_t& out, const ltx_rows_t& x,
                       cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vectorizable = a.hidden % kVec == 0 &&
                            ltx_rows_aligned(&x, sizeof(T), kVec * sizeof(T)) &&
                            ltx_rows_aligned(&out, 1, kVec);
  if (!vectorizable || a.hidden / kVec > kSlots * kMaxThreadsPerRow)
    return launch_streaming(quantize_fp8_streaming_kernel<T, kActivation>, a.rows, kRowBlockThreads,
                            stream, a);
  const CachedRowGrid g =
      cached_row_grid(a.rows, a.hidden / kVec, kSlots, kMaxThreadsPerRow, kRowBlockThreads, 64);
  if (!g.fits()) return LTX_ERR_INVALID_ARGUMENT;
  return launch(quantize_fp8_cached_kernel<T, kVec, kActivation>, g.grid(), dim3(g.threads), 0,
                stream, a, g.log2_tpr);
}

}  // namespace
}  // namespace ltx

extern "C" int ltx_quantize_fp8_cuda(ltx_rows_t out, float* out_scale, ltx_rows_t x, int64_t hidden,
                                     ltx_activation_t activation, ltx_stream_t stream) {
  using namespace ltx;
  const int status =
      launcher_status(ltx_check_quantize_fp8(&out, out_scale, &x, hidden, activation), hidden);
  if (status != LTX_OK || ltx_num_rows(&x) == 0 || hidden == 0) return status;
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  return dispatch_float(x.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const QuantizeArgs<T> a{RowPtr<uint8_t>::of(out), out_scale, RowPtr<const T>::of(x),
                            ltx_num_rows(&x), static_cast<int>(hidden)};
    switch (activation) {
      case LTX_ACTIVATION_GELU: return quantize_fp8_typed<T, LTX_ACTIVATION_GELU>(a, out, x, s);
      case LTX_ACTIVATION_GELU_TANH:
        return quantize_fp8_typed<T, LTX_ACTIVATION_GELU_TANH>(a, out, x, s);
      default: return quantize_fp8_typed<T, LTX_ACTIVATION_NONE>(a, out, x, s);
    }
  });
}
