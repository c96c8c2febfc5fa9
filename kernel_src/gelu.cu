// GELU and GEGLU (CUDA), forward and backward, computed in fp32 with the rounding points of
// ltx_gelu_cuda and ltx_gelu_backward_cuda (ltx_kernels.h).
#include "device_utils.cuh"

namespace ltx {
namespace {

constexpr int kSlots = 4;           // packs a thread has in flight per column chunk
constexpr int kBlockThreads = 256;  // most threads of a block (and of a row)
constexpr int kMinBlockThreads = 64;

// gelu'(x), tanh form: gelu(x) = x s(t) with s the logistic function and t = 2u, so
// gelu'(x) = s(t) + x s(t) s(-t) dt/dx, dt/dx = 2 sqrt(2/pi) (1 + 3 * 0.044715 x^2); s(t) and
// s(-t) come from e = e^(-|t|) <= 1 (no cancellation, no overflow). kFast as in gelu_tanh.
template <bool kFast>
__device__ __forceinline__ float gelu_tanh_slope(float x) {
  const float x2 = x * x;
  const float two_u = 1.5957691216057308f * fmaf(0.044715f * x, x2, x);
  float e, reciprocal;
  if constexpr (kFast) {
    e = __expf(-fabsf(two_u));
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(reciprocal) : "f"(1.f + e));
  } else {
    e = expf(-fabsf(two_u));
    reciprocal = 1.f / (1.f + e);
  }
  const float s_pos = two_u >= 0.f ? reciprocal : e * reciprocal;  // s(t)
  const float s_neg = two_u >= 0.f ? e * reciprocal : reciprocal;  // s(-t)
  const float dt_dx = 1.5957691216057308f * fmaf(0.134145f, x2, 1.f);
  return fmaf(x * s_pos * s_neg, dt_dx, s_pos);
}

// gelu'(x), erf form: Phi(x) + x phi(x). kFast as in gelu_erf.
template <bool kFast>
__device__ __forceinline__ float gelu_erf_slope(float x) {
  if constexpr (kFast)
    return fmaf(x * 0.3989422804014327f, __expf(-0.5f * x * x),
                0.5f * (1.f + erff(x * 0.70710678118654752f)));
  else
    return fmaf(x * 0.3989422804014327f, expf(-0.5f * x * x), normcdff(x));
}

template <ltx_gelu_approximate_t kApproximate, typename T>
__device__ __forceinline__ float gelu_slope(float x) {
  if constexpr (kApproximate == LTX_GELU_TANH)
    return gelu_tanh_slope<sizeof(T) == 2>(x);
  else
    return gelu_erf_slope<sizeof(T) == 2>(x);
}

template <typename T>
struct GeluArgs {
  RowPtr<T> out;         // forward: out, rows of `hidden`; backward: dx, rows of x's length
  RowPtr<const T> x;     // rows of `hidden`, 2 * hidden when gated ([h | g])
  RowPtr<const T> dout;  // backward: the output gradient, rows of `hidden`
  int64_t hidden;        // output row length
  RowChunks shape;
  bool gated;  // GEGLU
};

// Row-chunked GELU or its backward (RowChunkTeam) over rows of `hidden` output elements: thread t
// of a row's team handles packs t, t + tpr, ... of each column chunk (kVec elements each; kVec = 1
// is the scalar path for unaligned rows): it issues all its loads first (the gelu input g and,
// gated, the matching packs h of the row's first half; backward, dout), then computes and stores:
//   forward:  out = round_T(gelu(g)), gated round_T(h * round_T(gelu(g)))
//   backward: dx = round_T(dout * gelu'(g)); gated dx[:hidden] = round_T(dout * round_T(gelu(g))),
//             dx[hidden:] = round_T(gelu'(g) * round_T(dout * h))
// Row offsets are computed once per row.
template <typename T, int kVec, ltx_gelu_approximate_t kApproximate, bool kBackward>
__global__ void __launch_bounds__(kBlockThreads) gelu_kernel(const GeluArgs<T> a) {
  const RowChunkTeam<kSlots, kVec> team(a.shape);

  wait_for_prior_grids();
  allow_dependent_grids();
  for (int64_t row = team.first_row(); row < a.shape.rows; row += team.row_step) {
    const T* x_row = a.x.row(row);                          // first half of a gated row
    const T* gelu_in = a.gated ? x_row + a.hidden : x_row;  // input of gelu
    const T* dout_row = kBackward ? a.dout.row(row) : nullptr;
    T* out_row = a.out.row(row);
    for (int64_t chunk = blockIdx.y; chunk < a.shape.chunks; chunk += gridDim.y) {
      const ChunkSlots<kVec> c = team.slots(chunk);
      Pack<T, kVec> gs[kSlots], hs[kSlots], ds[kBackward ? kSlots : 1];
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        if (c.holds(s)) {
          gs[s].load(gelu_in + c.col(s));
          if (a.gated) hs[s].load(x_row + c.col(s));
          if constexpr (kBackward) ds[s].load(dout_row + c.col(s));
        }
      }
      // One copy of the arithmetic per value of the uniform flag.
      with_flags({a.gated}, [&](auto gated) {
#pragma unroll
        for (int s = 0; s < kSlots; ++s) {
          if (!c.holds(s)) continue;
          Pack<T, kVec> o, o_gate;  // set() rounds to T
#pragma unroll
          for (int i = 0; i < kVec; ++i) {
            const float g = gs[s].get(i);
            if constexpr (!kBackward) {
              float v = gelu<kApproximate, T>(g);
              if constexpr (decltype(gated)::value) v = hs[s].get(i) * round_to<T>(v);
              o.set(i, v);
            } else if constexpr (decltype(gated)::value) {
              const float d = ds[s].get(i);
              o.set(i, d * round_to<T>(gelu<kApproximate, T>(g)));
              o_gate.set(i, gelu_slope<kApproximate, T>(g) * round_to<T>(d * hs[s].get(i)));
            } else {
              o.set(i, ds[s].get(i) * gelu_slope<kApproximate, T>(g));
            }
          }
          o.store_global(out_row + c.col(s));
          if constexpr (kBackward && decltype(gated)::value)
            o_gate.store_global(out_row + a.hidden + c.col(s));
        }
      });
    }
  }
}

template <typename T, int kVec, ltx_gelu_approximate_t kApproximate, bool kBackward>
int launch_gelu(GeluArgs<T> a, int64_t rows, cudaStream_t stream) {
  const RowChunkGrid g =
      row_chunk_grid(rows, a.hidden / kVec, kSlots, kBlockThreads, kMinBlockThreads);
  a.shape = g.shape;
  return launch(gelu_kernel<T, kVec, kApproximate, kBackward>, g.grid, g.block, 0, stream, a);
}

// The forward (dout absent) or the backward: the 16-byte path when every row operand allows it.
template <typename T, ltx_gelu_approximate_t kApproximate>
int gelu_typed(const ltx_rows_t& out, const ltx_rows_t& x, const ltx_rows_t* dout, int64_t hidden,
               bool gated, cudaStream_t stream) {
  const GeluArgs<T> a{RowPtr<T>::of(out),
                      RowPtr<const T>::of(x),
                      dout ? RowPtr<const T>::of(*dout) : RowPtr<const T>{},
                      hidden,
                      {},
                      gated};
  constexpr int kVec = 16 / sizeof(T);
  // hidden % kVec == 0 also aligns the second half of a gated row.
  const bool vector = hidden % kVec == 0 && ltx_rows_aligned(&out, sizeof(T), 16) &&
                      ltx_rows_aligned(&x, sizeof(T), 16) &&
                      (!dout || ltx_rows_aligned(dout, sizeof(T), 16));
  const int64_t rows = ltx_num_rows(&x);
  return with_flags({vector, dout != nullptr}, [&](auto vector_path, auto backward) {
    constexpr int kVecUsed = decltype(vector_path)::value ? kVec : 1;
    return launch_gelu<T, kVecUsed, kApproximate, decltype(backward)::value>(a, rows, stream);
  });
}

// Both launchers: T from x's dtype, the approximation as a template argument.
int run_gelu(const ltx_rows_t& out, const ltx_rows_t& x, const ltx_rows_t* dout, int64_t hidden,
             ltx_gelu_approximate_t approximate, int gated, ltx_stream_t stream) {
  const auto stream_ = reinterpret_cast<cudaStream_t>(stream);
  return dispatch_float(x.dtype, [&](auto x_tag) {
    using T = typename decltype(x_tag)::type;
    if (approximate == LTX_GELU_TANH)
      return gelu_typed<T, LTX_GELU_TANH>(out, x, dout, hidden, gated != 0, stream_);
    return gelu_typed<T, LTX_GELU_NONE>(out, x, dout, hidden, gated != 0, stream_);
  });
}

}  // namespace
}  // namespace ltx

extern "C" int ltx_gelu_cuda(ltx_rows_t out, ltx_rows_t x, int64_t hidden,
                             ltx_gelu_approximate_t approximate, int gated, ltx_stream_t stream) {
  using namespace ltx;
  const int status = launcher_status(ltx_check_gelu(&out, &x, hidden, approximate, gated), hidden);
  if (status != LTX_OK || ltx_num_rows(&x) == 0 || hidden == 0) return status;
  return run_gelu(out, x, nullptr, hidden, approximate, gated, stream);
}

extern "C" int ltx_gelu_backward_cuda(ltx_rows_t dx, ltx_rows_t dout, ltx_rows_t x, int64_t hidden,
                                      ltx_gelu_approximate_t approximate, int gated,
                                      ltx_stream_t stream) {
  using namespace ltx;
  const int status =
      launcher_status(ltx_check_gelu_backward(&dx, &dout, &x, hidden, approximate, gated), hidden);
  if (status != LTX_OK || ltx_num_rows(&x) == 0 || hidden == 0) return status;
  return run_gelu(dx, x, &dout, hidden, approximate, gated, stream);
}
