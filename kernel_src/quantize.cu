// Row quantization (CUDA) of x, or of gelu(x) rounded to T (ltx_quantize_cuda in ltx_kernels.h):
// rows of `hidden` elements in, their codes and scales out (the format's policy, device/quant.cuh).
#include "device_utils.cuh"

namespace ltx {
namespace {

constexpr int kMaxThreadsPerRow = 256;
constexpr int kRowBlockThreads = 256;
constexpr int kSlots = 8;  // packs per thread: rows of up to 16384 bf16 / 8192 fp32 are cached

template <typename T>
struct QuantizeArgs {
  QuantOut out;
  RowPtr<const T> x;
  int64_t rows;
  int hidden;
};

// v = x, or round_T(gelu(x)) as ltx_gelu computes it.
template <typename T, ltx_activation_t kActivation, ltx_gelu_approximate_t kApproximate>
__device__ __forceinline__ float activated(float x) {
  if constexpr (kActivation == LTX_ACTIVATION_GELU)
    return round_to<T>(gelu<kApproximate, T>(x));
  else
    return x;
}

// Row-cached: each row is held by a power-of-two RowTeam, kSlots packs of kVec elements per
// thread, so x is read once: load, activate, then the quantizing epilogue (quantize_row_cached).
template <typename T, typename Q, int kVec, ltx_activation_t kActivation,
          ltx_gelu_approximate_t kApproximate>
__global__ void __launch_bounds__(kMaxThreadsPerRow)
    quantize_cached_kernel(const QuantizeArgs<T> a, const int log2_tpr) {
  __shared__ float partials[kMaxThreadsPerRow / 32];
  const RowTeam team = RowTeam::pow2(log2_tpr, a.rows);
  const int n_packs = a.hidden / kVec;
  wait_for_prior_grids();
  allow_dependent_grids();
  Pack<T, kVec> v[kSlots];
  load_packs(v, a.x.row(team.active ? team.row : 0), team, n_packs);
  if constexpr (kActivation != LTX_ACTIVATION_NONE) {
    team.for_each_pack<kSlots>(n_packs, [&](int s, int) {
#pragma unroll
      for (int i = 0; i < kVec; ++i)
        v[s].set(i, activated<T, kActivation, kApproximate>(v[s].get(i)));
    });
  }
  quantize_row_cached<Q, false>(v, team, n_packs, partials, a.out);
}

// Rows too long to cache, or not vectorizable: one block per row (grid-stride), the streaming
// epilogue (quantize_row_streaming), v recomputed in its second pass.
template <typename T, typename Q, ltx_activation_t kActivation, ltx_gelu_approximate_t kApproximate>
__global__ void __launch_bounds__(kRowBlockThreads)
    quantize_streaming_kernel(const QuantizeArgs<T> a) {
  __shared__ float scratch[32];
  wait_for_prior_grids();
  allow_dependent_grids();
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const T* x_row = a.x.row(row);
    quantize_row_streaming<Q>(
        row, a.hidden,
        [&](int i) { return activated<T, kActivation, kApproximate>(to_float(x_row[i])); }, scratch,
        a.out);
  }
}

template <typename T, typename Q, ltx_activation_t kActivation, ltx_gelu_approximate_t kApproximate>
int quantize_typed(const QuantizeArgs<T>& a, const ltx_rows_t& out, const ltx_rows_t& x,
                   cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vectorizable = a.hidden % kVec == 0 &&
                            ltx_rows_aligned(&x, sizeof(T), kVec * sizeof(T)) &&
                            ltx_rows_aligned(&out, 1, kVec);
  if (!vectorizable || a.hidden / kVec > kSlots * kMaxThreadsPerRow)
    return launch_streaming(quantize_streaming_kernel<T, Q, kActivation, kApproximate>, a.rows,
                            kRowBlockThreads, stream, a);
  const CachedRowGrid g =
      cached_row_grid(a.rows, a.hidden / kVec, kSlots, kMaxThreadsPerRow, kRowBlockThreads, 64);
  if (!g.fits()) return LTX_ERR_INVALID_ARGUMENT;
  return launch(quantize_cached_kernel<T, Q, kVec, kActivation, kApproximate>, g.grid(),
                dim3(g.threads), 0, stream, a, g.log2_tpr);
}

}  // namespace
}  // namespace ltx

extern "C" int ltx_quantize_cuda(ltx_rows_t out, ltx_quant_t quant, ltx_rows_t x, int64_t hidden,
                                 ltx_activation_t activation, ltx_gelu_approximate_t approximate,
                                 ltx_stream_t stream) {
  using namespace ltx;
  const int status = launcher_status(
      ltx_check_quantize(&out, &quant, &x, hidden, activation, approximate), hidden);
  if (status != LTX_OK || ltx_num_rows(&x) == 0 || hidden == 0) return status;
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  return dispatch_float(x.dtype, [&](auto x_tag) {
    using T = typename decltype(x_tag)::type;
    const QuantizeArgs<T> a{QuantOut::of(out, quant), RowPtr<const T>::of(x), ltx_num_rows(&x),
                            static_cast<int>(hidden)};
    return dispatch_quant(quant.format, [&](auto q_tag) {
      using Q = typename decltype(q_tag)::type;
      if (activation == LTX_ACTIVATION_NONE)
        return quantize_typed<T, Q, LTX_ACTIVATION_NONE, LTX_GELU_NONE>(a, out, x, s);
      if (approximate == LTX_GELU_TANH)
        return quantize_typed<T, Q, LTX_ACTIVATION_GELU, LTX_GELU_TANH>(a, out, x, s);
      return quantize_typed<T, Q, LTX_ACTIVATION_GELU, LTX_GELU_NONE>(a, out, x, s);
    });
  });
}
