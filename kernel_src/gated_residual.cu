// Gated residual add (CUDA): out = round_T(x + R(y * gate)), or round_T(x + y) without a gate
// (see ltx_gated_residual_cuda in ltx_kernels.h).
#include "device_utils.cuh"

namespace ltx {
namespace {

constexpr int kSlots = 4;           // packs per operand a thread has in flight per column chunk
constexpr int kBlockThreads = 256;  // most threads of a block (and of a row)
constexpr int kMinBlockThreads = 64;

template <typename T, typename Tg>
struct GatedResidualArgs {
  RowPtr<T> out;
  RowPtr<const T> x, y;
  RowPtr<const Tg> gate;  // null: no gate
  RowChunks shape;
  bool upcast;  // keep y * gate in fp32 (R is the identity)
};

// Row-chunked gated residual (RowChunkTeam): thread t of a row's team handles packs t, t + tpr,
// ... of each column chunk (kVec elements each; kVec = 1 is the scalar path for unaligned rows):
// it issues all its loads first, then computes and stores. Row offsets are computed once per row.
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
  const RowChunkTeam<kSlots, kVec> team(a.shape);
  const bool has_gate = a.gate.data != nullptr;

  wait_for_prior_grids();
  allow_dependent_grids();
  for (int64_t row = team.first_row(); row < a.shape.rows; row += team.row_step) {
    const T* x_row = a.x.row(row);
    const T* y_row = a.y.row(row);
    const Tg* gate_row = has_gate ? a.gate.row(row) : nullptr;
    T* out_row = a.out.row(row);
    for (int64_t chunk = blockIdx.y; chunk < a.shape.chunks; chunk += gridDim.y) {
      const ChunkSlots<kVec> c = team.slots(chunk);
      Pack<T, kVec> xs[kSlots], ys[kSlots];
      Pack<Tg, kVec> gs[kSlots];
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        if (c.holds(s)) {
          xs[s].load(x_row + c.col(s));
          ys[s].load(y_row + c.col(s));
          if (!kLateGate<T, Tg> && has_gate) gs[s].load(gate_row + c.col(s));
        }
      }
      // One copy of the arithmetic per case: no gate, gate, gate with an fp32 product (upcast,
      // which only matters with a gate).
      auto compute_and_store = [&](auto gated, auto upcast) {
        constexpr bool kHasGate = decltype(gated)::value, kUpcast = decltype(upcast)::value;
#pragma unroll
        for (int s = 0; s < kSlots; ++s) {
          if (c.holds(s)) {
            if constexpr (kHasGate && kLateGate<T, Tg>) gs[s].load(gate_row + c.col(s));
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
            o.store_global(out_row + c.col(s));
          }
        }
      };
      if (!has_gate)
        compute_and_store(std::false_type{}, std::false_type{});
      else
        with_flags({a.upcast}, [&](auto upcast) { compute_and_store(std::true_type{}, upcast); });
    }
  }
}

template <typename T, typename Tg, int kVec>
int launch_gated_residual(GatedResidualArgs<T, Tg> a, int64_t rows, int hidden,
                          cudaStream_t stream) {
  const RowChunkGrid g =
      row_chunk_grid(rows, hidden / kVec, kSlots, kBlockThreads, kMinBlockThreads);
  a.shape = g.shape;
  return launch(gated_residual_kernel<T, Tg, kVec>, g.grid, g.block, 0, stream, a);
}

template <typename T, typename Tg>
int gated_residual_typed(const ltx_rows_t& out, const ltx_rows_t& x, const ltx_rows_t& y,
                         const ltx_rows_t& gate, int hidden, bool upcast, cudaStream_t stream) {
  const bool has_gate = gate.data != nullptr;
  GatedResidualArgs<T, Tg> a{};
  a.out = RowPtr<T>::of(out);
  a.x = RowPtr<const T>::of(x);
  a.y = RowPtr<const T>::of(y);
  a.gate = RowPtr<const Tg>::of(gate);
  a.upcast = upcast;
  constexpr int kVec = 16 / sizeof(T);
  const bool vectorizable =
      hidden % kVec == 0 && ltx_rows_aligned(&out, sizeof(T), 16) &&
      ltx_rows_aligned(&x, sizeof(T), 16) && ltx_rows_aligned(&y, sizeof(T), 16) &&
      (!has_gate || ltx_rows_aligned(&gate, sizeof(Tg), pack_alignment<Tg, kVec>()));
  if (vectorizable) return launch_gated_residual<T, Tg, kVec>(a, ltx_num_rows(&x), hidden, stream);
  return launch_gated_residual<T, Tg, 1>(a, ltx_num_rows(&x), hidden, stream);
}

}  // namespace
}  // namespace ltx

extern "C" int ltx_gated_residual_cuda(ltx_rows_t out, ltx_rows_t x, ltx_rows_t y, ltx_rows_t gate,
                                       int64_t hidden, int upcast, ltx_stream_t stream) {
  using namespace ltx;
  const int status =
      launcher_status(ltx_check_gated_residual(&out, &x, &y, &gate, hidden, upcast), hidden);
  if (status != LTX_OK || ltx_num_rows(&x) == 0 || hidden == 0) return status;
  // The gate is T, or fp32 when the product is kept in fp32 (upcast).
  const bool gate_fp32 = gate.data != nullptr && gate.dtype != x.dtype;
  const auto stream_ = reinterpret_cast<cudaStream_t>(stream);
  return dispatch_float(x.dtype, [&](auto x_tag) {
    using T = typename decltype(x_tag)::type;
    if (gate_fp32)
      return gated_residual_typed<T, float>(out, x, y, gate, static_cast<int>(hidden), upcast,
                                            stream_);
    return gated_residual_typed<T, T>(out, x, y, gate, static_cast<int>(hidden), upcast, stream_);
  });
}
