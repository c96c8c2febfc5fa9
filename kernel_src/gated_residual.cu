// Gated residual add (CUDA): out = round_T(x + R(y * gate)), or round_T(x + y) without a gate
// (see ltx_gated_residual_cuda in ltx_kernels.h).
#include <algorithm>

#include "device_utils.cuh"

namespace ltx {
namespace {

constexpr int kSlots = 4;           // packs per operand a thread has in flight per column chunk
constexpr int kBlockThreads = 256;  // most threads of a block (and of a row)
constexpr int kMinBlockThreads = 64;


template <typename T, typename Tg>
struct GatedResidualArgs {
  T* out;
  RowIndex out_rows;
  const T* x;
  RowIndex x_rows;
  const T* y;
  RowIndex y_rows;
  const Tg* gate;  // nullptr: no gate
  RowIndex gate_rows;
  int64_t rows;
  int64_t packs;   // packs of kVec elements per row
  int64_t chunks;  // column chunks per row, of tpr * kSlots packs each
  int log2_tpr;    // a row is owned by tpr = 2^log2_tpr consecutive threads
  bool upcast;     // keep y * gate in fp32 (R is the identity)
};

// Rows of `hidden` contiguous elements, each owned by tpr = 2^log2_tpr consecutive threads of a
// block (a block holds blockDim.x / tpr rows; blockIdx.x strides over groups of rows, blockIdx.y
// over column chunks of tpr * kSlots packs). Thread t of a row handles packs t, t + tpr, ... of a
// chunk (kVec elements each; kVec = 1 is the scalar path for unaligned rows): it issues all its
// loads first, then computes and stores. Row offsets are computed once per row.
// An fp32 gate with 16-bit x (kLateGate) doubles the gate's registers; it is then loaded per pack
// just before use instead (the gate is usually a row broadcast to many rows, so an L1/L2 hit),
// which keeps 64 registers and 4 blocks per SM: on H200 the Wan shape [1, 32760, 5120] went from
// 76% to 100% of the copy bandwidth, while the loads issued up front (80 registers, 3 blocks per
// SM) suit the bf16 gate of LTX ([2, 2688, 2048]: 88% up front, 73% late).
template <typename T, typename Tg>
inline constexpr bool kLateGate = sizeof(Tg) > sizeof(T);

template <typename T, typename Tg, int kVec>
__global__ void __launch_bounds__(kBlockThreads, kLateGate<T, Tg> ? 4 : 3)
    gated_residual_kernel(const GatedResidualArgs<T, Tg> a) {
  const int tpr = 1 << a.log2_tpr;
  const int lane_in_row = threadIdx.x & (tpr - 1);
  const int rows_per_block = blockDim.x >> a.log2_tpr;
  const int64_t row_step = static_cast<int64_t>(gridDim.x) * rows_per_block;
  const int64_t chunk_packs = static_cast<int64_t>(tpr) * kSlots;
  const bool has_gate = a.gate != nullptr;

  wait_for_prior_grids();
  allow_dependent_grids();
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * rows_per_block + (threadIdx.x >> a.log2_tpr);
       row < a.rows; row += row_step) {
    const T* x_row = a.x + a.x_rows.offset(row);
    const T* y_row = a.y + a.y_rows.offset(row);
    const Tg* gate_row = has_gate ? a.gate + a.gate_rows.offset(row) : nullptr;
    T* out_row = a.out + a.out_rows.offset(row);
    for (int64_t chunk = blockIdx.y; chunk < a.chunks; chunk += gridDim.y) {
      const int64_t first = chunk * chunk_packs;  // first pack of the chunk
      const int64_t packs_left = a.packs - first;
      const int64_t col0 = first * kVec + static_cast<int64_t>(lane_in_row) * kVec;
      Pack<T, kVec> xs[kSlots], ys[kSlots];
      Pack<Tg, kVec> gs[kSlots];
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        if (s * tpr + lane_in_row < packs_left) {
          const int64_t col = col0 + static_cast<int64_t>(s) * tpr * kVec;
          xs[s].load(x_row + col);
          ys[s].load(y_row + col);
          if (!kLateGate<T, Tg> && has_gate) gs[s].load(gate_row + col);
        }
      }
      // One copy of the arithmetic per combination of the uniform flags.
      auto compute_and_store = [&](auto has_gate_tag, auto upcast_tag) {
        constexpr bool kHasGate = decltype(has_gate_tag)::value;
        constexpr bool kUpcast = decltype(upcast_tag)::value;
#pragma unroll
        for (int s = 0; s < kSlots; ++s) {
          if (s * tpr + lane_in_row < packs_left) {
            const int64_t col = col0 + static_cast<int64_t>(s) * tpr * kVec;
            if constexpr (kHasGate && kLateGate<T, Tg>) gs[s].load(gate_row + col);
            Pack<T, kVec> o;
#pragma unroll
            for (int i = 0; i < kVec; ++i) {
              const float x = xs[s].get(i), y = ys[s].get(i);
              float sum;
              if constexpr (!kHasGate)
                sum = x + y;
              else if constexpr (kUpcast)
                sum = fmaf(y, gs[s].get(i), x);  // the product is not rounded
              else  // R(y * gate); __fmul_rn keeps the product out of an fma for T = fp32
                sum = x + round_to<T>(__fmul_rn(y, gs[s].get(i)));
              o.set(i, sum);  // set() rounds to T
            }
            o.store_global(out_row + col);
          }
        }
      };
      if (!has_gate)
        compute_and_store(std::false_type{}, std::false_type{});
      else if (a.upcast)
        compute_and_store(std::true_type{}, std::true_type{});
      else
        compute_and_store(std::true_type{}, std::false_type{});
    }
  }
}

template <typename T, typename Tg, int kVec>
int launch_gated_residual(GatedResidualArgs<T, Tg> a, int hidden, cudaStream_t stream) {
  a.packs = hidden / kVec;
  const RowChunkGrid g = row_chunk_grid(a.rows, a.packs, kSlots, kBlockThreads, kMinBlockThreads);
  a.log2_tpr = g.log2_tpr;
  a.chunks = g.chunks;
  return launch(gated_residual_kernel<T, Tg, kVec>, g.grid, g.block, 0, stream, a);
}

template <typename T, typename Tg>
int gated_residual_typed(const ltx_rows_t& out, const ltx_rows_t& x, const ltx_rows_t& y,
                         const ltx_rows_t& gate, int hidden, bool upcast, cudaStream_t stream) {
  const bool has_gate = gate.data != nullptr;
  const GatedResidualArgs<T, Tg> a{static_cast<T*>(out.data),
                                   RowIndex::of(out),
                                   static_cast<const T*>(x.data),
                                   RowIndex::of(x),
                                   static_cast<const T*>(y.data),
                                   RowIndex::of(y),
                                   static_cast<const Tg*>(gate.data),
                                   has_gate ? RowIndex::of(gate) : RowIndex::of(x),
                                   num_rows(x),
                                   0,
                                   0,
                                   0,
                                   upcast};
  constexpr int kVec = 16 / sizeof(T);
  const bool vectorizable = hidden % kVec == 0 && rows_aligned(out, sizeof(T), 16) &&
                            rows_aligned(x, sizeof(T), 16) && rows_aligned(y, sizeof(T), 16) &&
                            (!has_gate || rows_aligned(gate, sizeof(Tg), pack_alignment<Tg, kVec>()));
  if (vectorizable) return launch_gated_residual<T, Tg, kVec>(a, hidden, stream);
  return launch_gated_residual<T, Tg, 1>(a, hidden, stream);
}

bool is_float_dtype(ltx_dtype_t dtype) {
  return dtype == LTX_FLOAT32 || dtype == LTX_FLOAT16 || dtype == LTX_BFLOAT16;
}

}  // namespace
}  // namespace ltx

extern "C" int ltx_gated_residual_cuda(ltx_rows_t out, ltx_rows_t x, ltx_rows_t y,
                                       ltx_rows_t gate, int64_t hidden, int upcast,
                                       ltx_stream_t stream) {
  using namespace ltx;
  const bool has_gate = gate.data != nullptr;
  if (!valid_rows(out) || !valid_rows(x) || !valid_rows(y) || num_rows(out) != num_rows(x) ||
      num_rows(y) != num_rows(x) || hidden < 0 || hidden > INT32_MAX ||
      (upcast != 0 && upcast != 1))
    return LTX_ERR_INVALID_ARGUMENT;
  if (has_gate && (!valid_rows(gate) || num_rows(gate) != num_rows(x)))
    return LTX_ERR_INVALID_ARGUMENT;
  if (!is_float_dtype(x.dtype) || (has_gate && !is_float_dtype(gate.dtype)))
    return LTX_ERR_UNSUPPORTED_DTYPE;
  if (out.dtype != x.dtype || y.dtype != x.dtype) return LTX_ERR_INVALID_ARGUMENT;
  // The gate is T, or fp32 when the product is kept in fp32 (upcast).
  const bool gate_fp32 = has_gate && gate.dtype != x.dtype;
  if (gate_fp32 && (!upcast || gate.dtype != LTX_FLOAT32)) return LTX_ERR_INVALID_ARGUMENT;
  if (num_rows(x) == 0 || hidden == 0) return LTX_OK;
  const auto stream_ = reinterpret_cast<cudaStream_t>(stream);
  return dispatch_float(x.dtype, [&](auto x_tag) {
    using T = typename decltype(x_tag)::type;
    if (gate_fp32)
      return gated_residual_typed<T, float>(out, x, y, gate, static_cast<int>(hidden), upcast,
                                            stream_);
    return gated_residual_typed<T, T>(out, x, y, gate, static_cast<int>(hidden), upcast,
                                      stream_);
  });
}
