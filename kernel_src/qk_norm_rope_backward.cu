// Backward of the RMSNorm and/or rotary embedding of q/k rows (CUDA): the gradients of
// ltx_qk_norm_rope_backward_cuda (ltx_kernels.h) in fp32, one pass over memory.
#include <algorithm>

#include "device_utils.cuh"

namespace ltx {
namespace {

constexpr int kPairs = 8;  // element pairs of a row per thread (kSlots slots of kP pairs)
constexpr int kMaxThreadsPerRow = LTX_QK_NORM_ROPE_BACKWARD_MAX_ROW / (2 * kPairs);  // 512
constexpr int kBlockThreads = 256;  // block size when several chunks share a block

// One tensor (q or k): rows of x, grad and dx, their cos/sin rows (head h of a row uses the
// elements from h * head_stride on), norm weight and weight-gradient sums.
template <typename T, typename Tc>
struct RopeBackwardTensor {
  RowPtr<T> dx;
  RowPtr<const T> x, grad;
  RowPtr<const Tc> cos, sin;
  int64_t cos_head_stride, sin_head_stride;
  ltx_vector_t weight;  // data null: none
  float* dweight_sum;   // [chunks, row_len]; null: not computed
  int64_t rows, chunks;
};

template <typename T, typename Tc>
struct QkNormRopeBackwardArgs {
  RopeBackwardTensor<T, Tc> t[2];
  FastDivider pairs_per_head;  // half_dim (rotation), or the whole row (none)
  int head_dim, half_dim, row_len, n_pairs, chunk_rows;
  bool interleaved, rot_half;
  float inv_row_len, eps;
};

// Where pair p of a row sits: its elements lo and hi and, with a rotation, its head and the
// table columns of each element (the pairs the forward rotated together: (2i, 2i+1) or
// (i, i + half) of a head; without rotation, elements (2p, 2p+1)).
struct PairPlace {
  int lo, hi, head, col_lo, col_hi;
};

template <bool kRotate, typename T, typename Tc>
__device__ __forceinline__ PairPlace pair_place(const QkNormRopeBackwardArgs<T, Tc>& a, int p) {
  if constexpr (!kRotate) return PairPlace{2 * p, 2 * p + 1, 0, 0, 0};
  const int head = a.pairs_per_head.div(p), i = p - head * a.half_dim;
  if (a.interleaved) return PairPlace{2 * p, 2 * p + 1, head, 2 * i, 2 * i + 1};
  const int lo = head * a.head_dim + i;
  return PairPlace{lo, lo + a.half_dim, head, i, a.rot_half ? i : i + a.half_dim};
}

// A slot: kP consecutive pairs of one head, from the pair at `at` on. Adjacent pairs ((2i, 2i+1),
// or no rotation) are one pack of 2 kP elements from at.lo; halves are kP elements from at.lo and
// kP from at.hi. kP = 1 in the element-wise path (any alignment; has_hi false: hi is past an odd
// row's end).
template <int kP, bool kAdjacent, typename T>
__device__ __forceinline__ void load_slot(const T* row, int lo, int hi, bool has_hi,
                                          float (&v_lo)[kP], float (&v_hi)[kP]) {
  if constexpr (kAdjacent) {
    Pack<T, 2 * kP> p;
    p.load(row + lo);
#pragma unroll
    for (int q = 0; q < kP; ++q) {
      v_lo[q] = p.get(2 * q);
      v_hi[q] = p.get(2 * q + 1);
    }
  } else if constexpr (kP > 1) {
    Pack<T, kP> p_lo, p_hi;
    p_lo.load(row + lo);
    p_hi.load(row + hi);
#pragma unroll
    for (int q = 0; q < kP; ++q) {
      v_lo[q] = p_lo.get(q);
      v_hi[q] = p_hi.get(q);
    }
  } else {
    v_lo[0] = to_float(__ldg(row + lo));
    v_hi[0] = has_hi ? to_float(__ldg(row + hi)) : 0.f;
  }
}

template <int kP, bool kAdjacent, typename T>
__device__ __forceinline__ void store_slot(T* row, int lo, int hi, bool has_hi,
                                           const float (&v_lo)[kP], const float (&v_hi)[kP]) {
  if constexpr (kAdjacent) {
    Pack<T, 2 * kP> p;
#pragma unroll
    for (int q = 0; q < kP; ++q) p.set_pair(2 * q, v_lo[q], v_hi[q]);
    p.store_global(row + lo);
  } else if constexpr (kP > 1) {
    Pack<T, kP> p_lo, p_hi;
#pragma unroll
    for (int q = 0; q < kP; ++q) {
      p_lo.set(q, v_lo[q]);
      p_hi.set(q, v_hi[q]);
    }
    p_lo.store_global(row + lo);
    p_hi.store_global(row + hi);
  } else {
    row[lo] = from_float<T>(v_lo[0]);
    if (has_hi) row[hi] = from_float<T>(v_hi[0]);
  }
}

// Chunk-per-team backward: a power-of-two team of tpr threads walks the rows of one chunk
// (chunks of q's rows, then of k's), thread `lane` holding slots s * tpr + lane (kSlots slots of
// kP pairs: 16-byte accesses in the vector path) of each row in registers. Per row: load grad
// (and cos/sin) and turn it into g = R^T grad in fp32; without the norm store dx = g. With it,
// load x and reduce sum(x^2) and sum(g w x) over the team (row_sum), then
// dx = rstd * (g w - x * rstd^2 * mean(g w x)), and add g * x * rstd to the thread's
// weight-gradient accumulators (registers: a thread keeps its columns across the chunk), written
// once at the chunk's end. The weight is read once per chunk.
template <typename T, typename Tc, int kP, bool kAdjacent, bool kRotate, bool kNormalize>
__global__ void __launch_bounds__(kMaxThreadsPerRow)
    qk_norm_rope_backward_kernel(const __grid_constant__ QkNormRopeBackwardArgs<T, Tc> a,
                                 const int log2_tpr) {
  constexpr int kSlots = kPairs / kP;
  __shared__ float partials[kMaxThreadsPerRow / 32];
  RowTeam team;
  team.tpr = 1 << log2_tpr;
  team.lane = threadIdx.x & (team.tpr - 1);
  int64_t chunk =
      static_cast<int64_t>(blockIdx.x) * (blockDim.x >> log2_tpr) + (threadIdx.x >> log2_tpr);
  const int tensor = chunk < a.t[0].chunks ? 0 : 1;
  if (tensor == 1) chunk -= a.t[0].chunks;
  const RopeBackwardTensor<T, Tc>& t = a.t[tensor];
  const bool chunk_active = chunk < t.chunks;
  const int64_t first_row = chunk * a.chunk_rows;
  const int64_t end_row = min(first_row + a.chunk_rows, t.rows);
  const int n_slots = a.n_pairs / kP;
  auto holds = [&](int s) { return team.pack(s) < n_slots; };
  // Where slot s's first pair sits.
  auto slot_place = [&](int s) { return pair_place<kRotate>(a, team.pack(s) * kP); };

  wait_for_prior_grids();
  allow_dependent_grids();
  float w_lo[kSlots][kP], w_hi[kSlots][kP], dw_lo[kSlots][kP], dw_hi[kSlots][kP];
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const PairPlace at = slot_place(s);
    const bool weighted = kNormalize && chunk_active && holds(s) && t.weight.data;
#pragma unroll
    for (int q = 0; q < kP; ++q) {
      const int step = kAdjacent ? 2 * q : q;  // element offset of pair q from the slot's first
      w_lo[s][q] = weighted ? load_as_float(t.weight.data, t.weight.dtype, at.lo + step) : 1.f;
      w_hi[s][q] = weighted && at.hi + step < a.row_len
                       ? load_as_float(t.weight.data, t.weight.dtype, at.hi + step)
                       : 1.f;
      dw_lo[s][q] = dw_hi[s][q] = 0.f;
    }
  }

  for (int i_row = 0; i_row < a.chunk_rows; ++i_row) {
    const int64_t row = first_row + i_row;
    team.active = chunk_active && row < end_row;
    const int64_t r = team.active ? row : 0;
    const T* grad_row = t.grad.row_if(team.active, r);
    const T* x_row = kNormalize ? t.x.row_if(team.active, r) : nullptr;
    // (kRotate: some tensor is rotated; this one when it has tables)
    const bool rotated = kRotate && team.active && t.cos.data;
    const Tc* cos_row = rotated ? t.cos.row(r) : nullptr;
    const Tc* sin_row = rotated ? t.sin.row(r) : nullptr;
    float g_lo[kSlots][kP], g_hi[kSlots][kP], x_lo[kSlots][kP], x_hi[kSlots][kP];
    float sumsq = 0.f, dot = 0.f;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
#pragma unroll
      for (int q = 0; q < kP; ++q) g_lo[s][q] = g_hi[s][q] = x_lo[s][q] = x_hi[s][q] = 0.f;
      if (!team.active || !holds(s)) continue;
      const PairPlace at = slot_place(s);
      const bool has_hi = at.hi < a.row_len;
      float d_lo[kP], d_hi[kP];
      load_slot<kP, kAdjacent>(grad_row, at.lo, at.hi, has_hi, d_lo, d_hi);
      if constexpr (kNormalize)
        load_slot<kP, kAdjacent>(x_row, at.lo, at.hi, has_hi, x_lo[s], x_hi[s]);
      if (rotated) {
        float c_lo[kP], c_hi[kP], s_lo[kP], s_hi[kP];
        load_slot<kP, kAdjacent>(cos_row + at.head * t.cos_head_stride, at.col_lo, at.col_hi, true,
                                 c_lo, c_hi);
        load_slot<kP, kAdjacent>(sin_row + at.head * t.sin_head_stride, at.col_lo, at.col_hi, true,
                                 s_lo, s_hi);
#pragma unroll
        for (int q = 0; q < kP; ++q) {
          g_lo[s][q] = d_lo[q] * c_lo[q] + d_hi[q] * s_hi[q];
          g_hi[s][q] = d_hi[q] * c_hi[q] - d_lo[q] * s_lo[q];
        }
      } else {
#pragma unroll
        for (int q = 0; q < kP; ++q) {
          g_lo[s][q] = d_lo[q];
          g_hi[s][q] = d_hi[q];
        }
      }
      if constexpr (kNormalize) {
#pragma unroll
        for (int q = 0; q < kP; ++q) {
          sumsq += x_lo[s][q] * x_lo[s][q] + x_hi[s][q] * x_hi[s][q];
          dot += g_lo[s][q] * w_lo[s][q] * x_lo[s][q] + g_hi[s][q] * w_hi[s][q] * x_hi[s][q];
        }
      }
    }
    float rstd = 1.f, k = 0.f;  // dx = rstd * (g w - x k)
    if constexpr (kNormalize) {
      // Every thread of the block takes part (row_sum synchronizes the block when a row spans
      // several warps), active or not.
      sumsq = row_sum<true>(sumsq, team, partials);
      dot = row_sum<true>(dot, team, partials);
      rstd = rsqrtf(sumsq * a.inv_row_len + a.eps);
      k = rstd * rstd * dot * a.inv_row_len;
    }
    if (!team.active) continue;
    T* dx_row = t.dx.row(r);
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      if (!holds(s)) continue;
      const PairPlace at = slot_place(s);
      float dx_lo[kP], dx_hi[kP];
#pragma unroll
      for (int q = 0; q < kP; ++q) {
        dx_lo[q] = g_lo[s][q];
        dx_hi[q] = g_hi[s][q];
        if constexpr (kNormalize) {
          dx_lo[q] = rstd * (g_lo[s][q] * w_lo[s][q] - x_lo[s][q] * k);
          dx_hi[q] = rstd * (g_hi[s][q] * w_hi[s][q] - x_hi[s][q] * k);
          dw_lo[s][q] += g_lo[s][q] * x_lo[s][q] * rstd;
          dw_hi[s][q] += g_hi[s][q] * x_hi[s][q] * rstd;
        }
      }
      store_slot<kP, kAdjacent>(dx_row, at.lo, at.hi, at.hi < a.row_len, dx_lo, dx_hi);
    }
  }

  if (!kNormalize || !chunk_active || !t.dweight_sum) return;
  float* sum_row = t.dweight_sum + chunk * a.row_len;
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    if (!holds(s)) continue;
    const PairPlace at = slot_place(s);
#pragma unroll
    for (int q = 0; q < kP; ++q) {
      const int step = kAdjacent ? 2 * q : q;
      sum_row[at.lo + step] = dw_lo[s][q];
      if (at.hi + step < a.row_len) sum_row[at.hi + step] = dw_hi[s][q];
    }
  }
}

template <typename T, typename Tc, int kP, bool kAdjacent, bool kRotate, bool kNormalize>
int launch_backward(const QkNormRopeBackwardArgs<T, Tc>& a, cudaStream_t stream) {
  constexpr int kSlots = kPairs / kP;
  const int n_slots = a.n_pairs / kP;
  // Every block full (min_threads = kBlockThreads): rows here are chunks of rows.
  const CachedRowGrid g = cached_row_grid(a.t[0].chunks + a.t[1].chunks, n_slots, kSlots,
                                          kMaxThreadsPerRow, kBlockThreads, kBlockThreads);
  if ((int64_t{kSlots} << g.log2_tpr) < n_slots) return LTX_ERR_INVALID_ARGUMENT;  // too long
  if (!g.fits()) return LTX_ERR_INVALID_ARGUMENT;
  return launch(qk_norm_rope_backward_kernel<T, Tc, kP, kAdjacent, kRotate, kNormalize>, g.grid(),
                dim3(g.threads), 0, stream, a, g.log2_tpr);
}

// True when every row start of r (and, for tables, every head's start) is aligned to `alignment`
// bytes.
inline bool rows_aligned(const ltx_rows_t& r, int64_t head_stride, int64_t heads, int elem_bytes,
                         int alignment) {
  return !r.data || (ltx_rows_aligned(&r, elem_bytes, alignment) &&
                     (heads <= 1 || (head_stride * elem_bytes) % alignment == 0));
}

template <typename T, typename Tc>
int backward_typed(const ltx_qk_norm_rope_backward_args_t& args, cudaStream_t stream) {
  const ltx_qk_norm_rope_args_t& f = args.forward;
  QkNormRopeBackwardArgs<T, Tc> a{};
  a.head_dim = static_cast<int>(f.head_dim);
  a.half_dim = a.head_dim / 2;
  a.row_len = static_cast<int>(f.heads * f.head_dim);
  a.n_pairs = (a.row_len + 1) / 2;
  a.chunk_rows = static_cast<int>(args.chunk_rows);
  a.interleaved = f.interleaved != 0;
  a.rot_half = !f.interleaved && f.rot_dim != f.head_dim;
  a.inv_row_len = 1.f / static_cast<float>(a.row_len);
  a.eps = f.eps;
  bool rotate = false;
  for (int i = 0; i < f.num_tensors; ++i) rotate = rotate || f.tensors[i].cos.data != nullptr;
  a.pairs_per_head = FastDivider::of(static_cast<uint32_t>(rotate ? a.half_dim : a.n_pairs));
  // The vector path: slots of kP pairs in one head (whole rows of slots without rotation), every
  // row and table start aligned to its packs (2 kP elements for adjacent pairs, kP for halves).
  constexpr int kP = 8 / sizeof(T);  // 16-byte packs of adjacent pairs
  const bool adjacent = !rotate || a.interleaved;
  bool vector_ok = rotate ? a.half_dim % kP == 0 : a.row_len % (2 * kP) == 0;
  const int act_align = adjacent ? pack_alignment<T, 2 * kP>() : pack_alignment<T, kP>();
  const int table_align = adjacent ? pack_alignment<Tc, 2 * kP>() : pack_alignment<Tc, kP>();
  for (int i = 0; i < f.num_tensors; ++i) {
    const ltx_rope_tensor_t& src = f.tensors[i];
    RopeBackwardTensor<T, Tc>& dst = a.t[i];
    dst.dx = RowPtr<T>::of(src.out);
    dst.x = RowPtr<const T>::of(src.x);
    dst.grad = RowPtr<const T>::of(args.grad[i]);
    dst.cos = RowPtr<const Tc>::of(src.cos);
    dst.sin = RowPtr<const Tc>::of(src.sin);
    dst.cos_head_stride = src.cos_head_stride;
    dst.sin_head_stride = src.sin_head_stride;
    dst.weight = src.weight;
    dst.dweight_sum = static_cast<float*>(args.dweight_sum[i]);
    dst.rows = ltx_num_rows(&src.x);
    dst.chunks = ltx_qk_norm_rope_backward_chunks(dst.rows, args.chunk_rows);
    vector_ok = vector_ok && rows_aligned(src.out, 0, 1, sizeof(T), act_align) &&
                rows_aligned(args.grad[i], 0, 1, sizeof(T), act_align) &&
                (!f.normalize || rows_aligned(src.x, 0, 1, sizeof(T), act_align)) &&
                rows_aligned(src.cos, src.cos_head_stride, f.heads, sizeof(Tc), table_align) &&
                rows_aligned(src.sin, src.sin_head_stride, f.heads, sizeof(Tc), table_align);
  }
  return with_flags({rotate, f.normalize != 0}, [&](auto rot, auto norm) {
    constexpr bool kRotate = decltype(rot)::value, kNormalize = decltype(norm)::value;
    if (!vector_ok) return launch_backward<T, Tc, 1, false, kRotate, kNormalize>(a, stream);
    if (adjacent) return launch_backward<T, Tc, kP, true, kRotate, kNormalize>(a, stream);
    return launch_backward<T, Tc, kP, false, kRotate, kNormalize>(a, stream);
  });
}

}  // namespace
}  // namespace ltx

extern "C" int ltx_qk_norm_rope_backward_cuda(const ltx_qk_norm_rope_backward_args_t* args,
                                              ltx_stream_t stream) {
  using namespace ltx;
  const ltx_check_t check = ltx_check_qk_norm_rope_backward(args);
  if (check.status != LTX_OK) return check.status;
  const ltx_qk_norm_rope_args_t& f = args->forward;
  if (f.tensors[0].x.dtype == LTX_FLOAT64) return LTX_ERR_UNSUPPORTED_DTYPE;  // the C twin only
  const int64_t row_len = f.heads * f.head_dim;
  int64_t rows = 0;
  for (int i = 0; i < f.num_tensors; ++i) rows += ltx_num_rows(&f.tensors[i].x);
  if (rows == 0 || row_len == 0) return LTX_OK;
  if (row_len > LTX_QK_NORM_ROPE_BACKWARD_MAX_ROW || rows > INT32_MAX ||
      args->chunk_rows > INT32_MAX)
    return LTX_ERR_INVALID_ARGUMENT;
  bool fp32_tables = false;
  for (int i = 0; i < f.num_tensors; ++i)
    fp32_tables = fp32_tables || (f.tensors[i].cos.data && f.tensors[i].cos.dtype == LTX_FLOAT32);
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  return dispatch_float(f.tensors[0].x.dtype, [&](auto x_tag) {
    using T = typename decltype(x_tag)::type;
    if (fp32_tables) return backward_typed<T, float>(*args, s);
    return backward_typed<T, T>(*args, s);
  });
}
