// Backward of (residual +) RMSNorm/LayerNorm + AdaLN modulation, of rmsnorm and of gated_residual
// (CUDA): the gradients of ltx_norm_backward_cuda (ltx_kernels.h) in fp32, one pass over memory.
#include "device_utils.cuh"

namespace ltx {
namespace {

// A block is one row's team of up to kMaxThreads threads, each holding 1, 2 or 4 packs of the row
// (16 elements for the scalar path).
constexpr int kMaxThreads = 512;
// (One pack per thread: registers capped at 64. More packs: no cap, as capped wide rows spilled.)
constexpr int kNumSums = 5;
enum SumIndex { kScaleSum, kShiftSum, kGateSum, kWeightSum, kBiasSum };
// The streaming operands, each row read once, staged up to kMaxStages rows ahead in shared memory.
constexpr int kNumStreams = 4;
enum StreamIndex { kHStream, kDoutStream, kYStream, kDhOutStream };
constexpr int kMaxStages = 3;
constexpr int kScratchFloats = 2 * 32;  // block_sums of two values

// Operands of one launch; Tx: activations and their gradients, Tm: gate and scale (and dgate,
// dscale).
template <typename Tx, typename Tm>
struct NormBackwardArgs {
  RowPtr<const Tx> h, y, dout, dh_out;
  RowPtr<const Tm> gate, scale;
  RowPtr<Tx> dx, dy;
  RowPtr<Tm> dscale, dgate;  // per-row gradients
  ltx_vector_t weight, bias;
  float* sums[kNumSums];   // [chunks, hidden] partial sums (SumIndex order); null: not computed
  int sum_slot[kNumSums];  // row of each sum in the block's shared-memory accumulators
  int num_sums;
  int stream_slot[kNumStreams];  // row of each present streaming operand in a stage, else -1
  int num_streams;
  int stages;  // rows staged ahead (1 to kMaxStages); 0: operands read from global memory
  bool layer_norm;
  int64_t chunks_per_group, group_rows;
  int chunk_rows;
  int hidden;
  float inv_hidden, eps;
};

// Row r of streaming operand k (null where absent).
template <typename Tx, typename Tm>
__device__ __forceinline__ const Tx* stream_row(const NormBackwardArgs<Tx, Tm>& a, int k,
                                                int64_t r) {
  switch (k) {
    case kHStream: return a.h.row_or_null(r);
    case kDoutStream: return a.dout.row_or_null(r);
    case kYStream: return a.y.row_or_null(r);
    default: return a.dh_out.row_or_null(r);
  }
}

// dn * weight at a pack of elements col.. of a row: dn = dout (1 + scale) (dout without scale),
// weight staged as fp32 in shared memory (null: 1).
template <typename Tx, typename Tm, int kVec>
__device__ __forceinline__ void dn_times_weight(float (&out)[kVec], const Pack<Tx, kVec>& dout,
                                                const Tm* scale_row, const float* weight, int col) {
  if (scale_row) {
    Pack<Tm, kVec> scale;
    scale.load(scale_row + col);
#pragma unroll
    for (int i = 0; i < kVec; ++i) out[i] = dout.get(i) * (1.f + scale.get(i));
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i) out[i] = dout.get(i);
  }
  if (weight) {
    Pack<float, kVec> w;
    w.load_plain(weight + col);
#pragma unroll
    for (int i = 0; i < kVec; ++i) out[i] *= w.get(i);
  }
}

// Chunk-per-block backward: the block is one row's team and walks the rows of chunk blockIdx.x
// (ltx_kernels.h), thread t owning packs s * blockDim.x + t (kSlots packs of kVec elements) of
// each row. The streaming operands (h, dout, y, dh_out) of the next `stages` rows are in flight
// into shared memory while a row is computed (cp.async; each thread copies and reads only its own
// packs, so no barrier). Per row: the statistics of h and mean(dn w yhat) (LayerNorm: and
// mean(dn w)) as block sums, then per element dh, the stores of dx, dy and the per-row
// dscale/dgate, and the shared operands' terms added to the block's fp32 accumulators in shared
// memory. Shared memory: the weight and the bias staged as fp32 ([hidden] each, when present),
// the accumulators ([num_sums][hidden]), the stages ([stages][num_streams][hidden] Tx). Each
// optional term is one uniform branch around its own unrolled loop. The chunk's sums are written
// once at its end. kNorm false is gated_residual's backward: dh = dh_out, no statistics.
template <typename Tx, typename Tm, int kVec, int kSlots, bool kNorm>
__global__ void __launch_bounds__(kMaxThreads, kSlots == 1 ? 2 : 1)
    norm_backward_kernel(const NormBackwardArgs<Tx, Tm> a) {
  extern __shared__ __align__(16) float shared[];
  __shared__ float scratch[kScratchFloats];
  const int64_t chunk = blockIdx.x;
  const int64_t group = chunk / a.chunks_per_group;
  const int64_t first_row =
      group * a.group_rows + (chunk - group * a.chunks_per_group) * a.chunk_rows;
  const int64_t end_row = min(first_row + a.chunk_rows, (group + 1) * a.group_rows);
  const int n_packs = a.hidden / kVec;
  float* const weight = a.weight.data ? shared : nullptr;
  float* const bias = a.bias.data ? shared + (weight ? a.hidden : 0) : nullptr;
  float* const sums = shared + ((weight ? a.hidden : 0) + (bias ? a.hidden : 0));
  Tx* const staged = reinterpret_cast<Tx*>(sums + a.num_sums * a.hidden);
  const int64_t stage_elements = static_cast<int64_t>(a.num_streams) * a.hidden;

  wait_for_prior_grids();
  allow_dependent_grids();
  // This thread's packs of row r, streaming operands, into stage `stage`: one copy group (empty
  // past the chunk's end).
  auto stage_row = [&](int64_t r, int stage) {
    if (r < end_row) {
#pragma unroll
      for (int k = 0; k < kNumStreams; ++k) {
        if (a.stream_slot[k] < 0) continue;
        const Tx* const src = stream_row(a, k, r);
        Tx* const dst = staged + stage * stage_elements + a.stream_slot[k] * a.hidden;
#pragma unroll
        for (int s = 0; s < kSlots; ++s) {
          const int p = s * blockDim.x + threadIdx.x;
          if (p < n_packs) copy_pack_async<Tx, kVec>(dst + p * kVec, src + p * kVec);
        }
      }
    }
    copy_async_commit();
  };
  for (int stage = 0; stage < a.stages; ++stage) stage_row(first_row + stage, stage);
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int p = s * blockDim.x + threadIdx.x;
    if (p >= n_packs) continue;
    // (Loaded here only: nvcc may hoist a guarded read-only load out of the row loop unguarded.)
    if (weight) {
#pragma unroll
      for (int i = 0; i < kVec; ++i)
        weight[p * kVec + i] = load_as_float(a.weight.data, a.weight.dtype, p * kVec + i);
    }
    if (bias) {
#pragma unroll
      for (int i = 0; i < kVec; ++i)
        bias[p * kVec + i] = load_as_float(a.bias.data, a.bias.dtype, p * kVec + i);
    }
    for (int k = 0; k < a.num_sums; ++k) {
      Pack<float, kVec> zero;
#pragma unroll
      for (int i = 0; i < kVec; ++i) zero.set(i, 0.f);
      zero.store(sums + k * a.hidden + p * kVec);
    }
  }
  // Added to in place: the running sum of one term at this thread's elements.
  auto add_to_sum = [&](SumIndex k, int col, const float(&term)[kVec]) {
    float* const acc = sums + a.sum_slot[k] * a.hidden + col;
    Pack<float, kVec> v;
    v.load_plain(acc);
#pragma unroll
    for (int i = 0; i < kVec; ++i) v.set(i, v.get(i) + term[i]);
    v.store(acc);
  };

  int stage = 0;  // row r's stage
  for (int64_t r = first_row; r < end_row; ++r) {
    // Row r's streaming operands: its stage once this thread's copies have landed.
    const Tx* rows[kNumStreams];
    if (a.stages) {
      copy_async_wait(a.stages - 1);
#pragma unroll
      for (int k = 0; k < kNumStreams; ++k) {
        rows[k] = a.stream_slot[k] < 0
                      ? nullptr
                      : staged + stage * stage_elements + a.stream_slot[k] * a.hidden;
      }
    } else {
#pragma unroll
      for (int k = 0; k < kNumStreams; ++k) rows[k] = stream_row(a, k, r);
    }
    Pack<Tx, kVec> h[kSlots], dout[kSlots];
    if constexpr (kNorm) {
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int p = s * blockDim.x + threadIdx.x;
        if (p >= n_packs) continue;
        h[s].load_plain(rows[kHStream] + p * kVec);
        dout[s].load_plain(rows[kDoutStream] + p * kVec);
      }
    }
    const Tm* scale_row = kNorm ? a.scale.row_or_null(r) : nullptr;
    float mean = 0.f, rstd = 0.f, dot = 0.f, total = 0.f;
    if constexpr (kNorm) {
      // The row's statistics as block sums: every thread takes part, with packs or without.
      float sum = 0.f;  // of h (LayerNorm's mean) or of h^2 (RMSNorm)
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        if (s * blockDim.x + threadIdx.x >= n_packs) continue;
        if (a.layer_norm) {
#pragma unroll
          for (int i = 0; i < kVec; ++i) sum += h[s].get(i);
        } else {
          add_squares(sum, h[s]);
        }
      }
      sum = block_sum(sum, scratch);
      if (a.layer_norm) {
        mean = sum * a.inv_hidden;
        float deviations = 0.f;
#pragma unroll
        for (int s = 0; s < kSlots; ++s) {
          if (s * blockDim.x + threadIdx.x >= n_packs) continue;
#pragma unroll
          for (int i = 0; i < kVec; ++i) {
            const float d = h[s].get(i) - mean;
            deviations += d * d;
          }
        }
        sum = block_sum(deviations, scratch);
      }
      rstd = rsqrtf(sum * a.inv_hidden + a.eps);
      float sums2[2] = {0.f, 0.f};  // of dn w yhat and of dn w
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int p = s * blockDim.x + threadIdx.x;
        if (p >= n_packs) continue;
        float dnw[kVec];
        dn_times_weight(dnw, dout[s], scale_row, weight, p * kVec);
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          sums2[0] += dnw[i] * ((h[s].get(i) - mean) * rstd);
          sums2[1] += dnw[i];
        }
      }
      if (a.layer_norm) {
        block_sums(sums2, scratch);
      } else {
        sums2[0] = block_sum(sums2[0], scratch);
      }
      dot = sums2[0] * a.inv_hidden;
      total = a.layer_norm ? sums2[1] * a.inv_hidden : 0.f;
    }

    const Tm* gate_row = a.gate.row_or_null(r);
    Tx* dx_row = a.dx.row_or_null(r);
    Tx* dy_row = a.dy.row_or_null(r);
    Tm* dscale_row = a.dscale.row_or_null(r);
    Tm* dgate_row = a.dgate.row_or_null(r);
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int p = s * blockDim.x + threadIdx.x;
      if (p >= n_packs) continue;
      const int col = p * kVec;
      float dh[kVec];
      if (rows[kDhOutStream]) {
        Pack<Tx, kVec> dh_out;
        dh_out.load_plain(rows[kDhOutStream] + col);
#pragma unroll
        for (int i = 0; i < kVec; ++i) dh[i] = dh_out.get(i);
      } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) dh[i] = 0.f;
      }
      if constexpr (kNorm) {
        float dnw[kVec], yhat[kVec], term[kVec];
        dn_times_weight(dnw, dout[s], scale_row, weight, col);
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          yhat[i] = (h[s].get(i) - mean) * rstd;
          dh[i] += rstd * (dnw[i] - total - yhat[i] * dot);
        }
        if (a.sums[kScaleSum] || dscale_row) {  // dscale = g n, n = yhat w (+ bias)
#pragma unroll
          for (int i = 0; i < kVec; ++i) term[i] = yhat[i];
          if (weight) {
#pragma unroll
            for (int i = 0; i < kVec; ++i) term[i] *= weight[col + i];
          }
          if (bias) {
#pragma unroll
            for (int i = 0; i < kVec; ++i) term[i] += bias[col + i];
          }
#pragma unroll
          for (int i = 0; i < kVec; ++i) term[i] *= dout[s].get(i);
          if (a.sums[kScaleSum]) add_to_sum(kScaleSum, col, term);
          if (dscale_row) {
            Pack<Tm, kVec> out;
#pragma unroll
            for (int i = 0; i < kVec; ++i) out.set(i, term[i]);
            out.store_global(dscale_row + col);
          }
        }
        if (a.sums[kShiftSum]) {
#pragma unroll
          for (int i = 0; i < kVec; ++i) term[i] = dout[s].get(i);
          add_to_sum(kShiftSum, col, term);
        }
        if (a.sums[kWeightSum] || a.sums[kBiasSum]) {  // dn (without the weight)
          float dn[kVec];
          dn_times_weight(dn, dout[s], scale_row, nullptr, col);
          if (a.sums[kWeightSum]) {
#pragma unroll
            for (int i = 0; i < kVec; ++i) term[i] = dn[i] * yhat[i];
            add_to_sum(kWeightSum, col, term);
          }
          if (a.sums[kBiasSum]) add_to_sum(kBiasSum, col, dn);
        }
      }
      if (dx_row) {
        Pack<Tx, kVec> out;
#pragma unroll
        for (int i = 0; i < kVec; ++i) out.set(i, dh[i]);
        out.store_global(dx_row + col);
      }
      if (dy_row) {
        Pack<Tx, kVec> out;
        if (gate_row) {
          Pack<Tm, kVec> gates;
          gates.load(gate_row + col);
#pragma unroll
          for (int i = 0; i < kVec; ++i) out.set(i, dh[i] * gates.get(i));
        } else {
#pragma unroll
          for (int i = 0; i < kVec; ++i) out.set(i, dh[i]);
        }
        out.store_global(dy_row + col);
      }
      if (rows[kYStream]) {  // dgate = dh y
        Pack<Tx, kVec> y;
        y.load_plain(rows[kYStream] + col);
        float dgate[kVec];
#pragma unroll
        for (int i = 0; i < kVec; ++i) dgate[i] = dh[i] * y.get(i);
        if (a.sums[kGateSum]) add_to_sum(kGateSum, col, dgate);
        if (dgate_row) {
          Pack<Tm, kVec> out;
#pragma unroll
          for (int i = 0; i < kVec; ++i) out.set(i, dgate[i]);
          out.store_global(dgate_row + col);
        }
      }
    }
    if (a.stages) {  // this thread is done with the stage: refill it with row r + stages
      stage_row(r + a.stages, stage);
      stage = stage + 1 == a.stages ? 0 : stage + 1;
    }
  }

  // The chunk's sums: each thread copies its own accumulator elements.
  for (int k = 0; k < kNumSums; ++k) {
    if (!a.sums[k]) continue;
    const float* src = sums + a.sum_slot[k] * a.hidden;
    float* dst = a.sums[k] + chunk * a.hidden;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int p = s * blockDim.x + threadIdx.x;
      if (p >= n_packs) continue;
      Pack<float, kVec> v;
      v.load_plain(src + p * kVec);
      v.store_global(dst + p * kVec);
    }
  }
}

template <typename Tx, typename Tm, int kVec, int kSlots, bool kNorm>
int launch_backward(NormBackwardArgs<Tx, Tm> a, int64_t chunks, cudaStream_t stream) {
  // The block: one row's packs at kSlots per thread, in whole warps.
  const int64_t threads = ceil_div(ceil_div(a.hidden / kVec, kSlots), 32) * 32;
  if (threads > kMaxThreads) return LTX_ERR_INVALID_ARGUMENT;  // too long
  if (chunks > INT32_MAX) return LTX_ERR_INVALID_ARGUMENT;
  // Shared memory: weight, bias and accumulators (fp32 rows), then the stages: as many (up to
  // kMaxStages) as leave room for the blocks an SM holds by their registers, else one if it fits
  // a block, else none.
  constexpr auto kernel = norm_backward_kernel<Tx, Tm, kVec, kSlots, kNorm>;
  const int blocks_per_sm = std::max(1, resident_blocks_per_sm<kernel>(static_cast<int>(threads)));
  const size_t fixed_bytes =
      static_cast<size_t>((a.weight.data != nullptr) + (a.bias.data != nullptr) + a.num_sums) *
      a.hidden * sizeof(float);
  const size_t stage_bytes = static_cast<size_t>(a.num_streams) * a.hidden * sizeof(Tx);
  const size_t static_bytes = kScratchFloats * sizeof(float) + 1024;  // the system's 1 KB too
  const int per_sm = device_attribute<cudaDevAttrMaxSharedMemoryPerMultiprocessor>(228 * 1024);
  const int per_block = device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(227 * 1024);
  const size_t budget = static_cast<size_t>(per_sm / blocks_per_sm);
  a.stages = 0;
  while (a.stages < kMaxStages &&
         fixed_bytes + (a.stages + 1) * stage_bytes + static_bytes <= budget)
    ++a.stages;
  if (a.stages == 0 && fixed_bytes + stage_bytes + static_bytes <= static_cast<size_t>(per_block))
    a.stages = 1;
  const size_t shared_bytes = fixed_bytes + a.stages * stage_bytes;
  // Above 48 KB of shared memory per block (the static scratch included) needs opting in.
  if (shared_bytes + kScratchFloats * sizeof(float) > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes));
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  return launch(kernel, dim3(static_cast<unsigned>(chunks)), dim3(static_cast<unsigned>(threads)),
                shared_bytes, stream, a);
}

template <typename Tx, typename Tm>
int norm_backward_typed(const ltx_norm_backward_args_t& args, int64_t rows, cudaStream_t stream) {
  NormBackwardArgs<Tx, Tm> a{};
  a.h = RowPtr<const Tx>::of(args.h);
  a.y = RowPtr<const Tx>::of(args.y);
  a.dout = RowPtr<const Tx>::of(args.dout);
  a.dh_out = RowPtr<const Tx>::of(args.dh_out);
  a.gate = RowPtr<const Tm>::of(args.gate);
  a.scale = RowPtr<const Tm>::of(args.scale);
  a.dx = RowPtr<Tx>::of(args.dx);
  a.dy = RowPtr<Tx>::of(args.dy);
  a.dscale = RowPtr<Tm>::of(args.dscale);
  a.dgate = RowPtr<Tm>::of(args.dgate);
  a.weight = args.weight;
  a.bias = args.bias;
  void* const sums[kNumSums] = {args.dscale_sum, args.dshift_sum, args.dgate_sum, args.dweight_sum,
                                args.dbias_sum};
  for (int k = 0; k < kNumSums; ++k) {
    a.sums[k] = static_cast<float*>(sums[k]);
    a.sum_slot[k] = sums[k] ? a.num_sums++ : -1;
  }
  const void* const streams[kNumStreams] = {args.dout.data ? args.h.data : nullptr, args.dout.data,
                                            args.y.data, args.dh_out.data};
  for (int k = 0; k < kNumStreams; ++k) a.stream_slot[k] = streams[k] ? a.num_streams++ : -1;
  a.layer_norm = args.norm == LTX_NORM_LAYER;
  // Without sums the chunks only schedule rows: chunks of the length a summing launch would take.
  const int64_t group_rows = a.num_sums ? args.group_rows : rows;
  const int64_t chunk_rows =
      a.num_sums ? args.chunk_rows : ltx_norm_backward_chunk_rows(rows, group_rows);
  a.group_rows = group_rows;
  a.chunk_rows = static_cast<int>(std::min<int64_t>(chunk_rows, group_rows));
  a.chunks_per_group = ceil_div(group_rows, a.chunk_rows);
  const int64_t chunks = ltx_norm_backward_chunks(rows, group_rows, a.chunk_rows);
  a.hidden = static_cast<int>(args.hidden);
  a.inv_hidden = 1.f / static_cast<float>(args.hidden);
  a.eps = args.eps;

  constexpr int kVec = 16 / sizeof(Tx);
  auto aligned = [&](const ltx_rows_t& r, int elem_bytes) {
    return !r.data || ltx_rows_aligned(&r, elem_bytes, std::min(16, kVec * elem_bytes));
  };
  bool vectorizable = a.hidden % kVec == 0;
  for (const ltx_rows_t* r : {&args.h, &args.y, &args.dout, &args.dh_out, &args.dx, &args.dy})
    vectorizable = vectorizable && aligned(*r, sizeof(Tx));
  for (const ltx_rows_t* r : {&args.gate, &args.scale, &args.dscale, &args.dgate})
    vectorizable = vectorizable && aligned(*r, sizeof(Tm));
  for (void* sum : sums) vectorizable = vectorizable && reinterpret_cast<uintptr_t>(sum) % 16 == 0;
  // Packs per thread: 1 for rows of up to 128 packs, 2 up to 256, else 4. Fewer threads per row
  // spread the row's fixed work (block sums, addressing, branches) over more elements: on an
  // H100, 2 packs of 128 threads took 0.78-0.95x the time of 1 of 256 at 2048 bf16 columns,
  // 4 packs of 64 threads 1.1-1.3x; 4 of 160 threads 0.85-0.93x the time of 2 of 320 at 5120.
  const int64_t n_packs = vectorizable ? a.hidden / kVec : a.hidden;
  return with_flags({args.dout.data != nullptr}, [&](auto norm) {
    constexpr bool kNorm = decltype(norm)::value;
    if (!vectorizable) return launch_backward<Tx, Tm, 1, 16, kNorm>(a, chunks, stream);
    if (n_packs <= 128) return launch_backward<Tx, Tm, kVec, 1, kNorm>(a, chunks, stream);
    if (n_packs <= 256) return launch_backward<Tx, Tm, kVec, 2, kNorm>(a, chunks, stream);
    return launch_backward<Tx, Tm, kVec, 4, kNorm>(a, chunks, stream);
  });
}

}  // namespace
}  // namespace ltx

extern "C" int ltx_norm_backward_cuda(const ltx_norm_backward_args_t* args, ltx_stream_t stream) {
  using namespace ltx;
  const ltx_check_t check = ltx_check_norm_backward(args);
  if (check.status != LTX_OK) return check.status;
  const ltx_norm_backward_args_t& a = *args;
  const ltx_rows_t& ref = a.dout.data ? a.h : a.dh_out;
  const int64_t rows = ltx_num_rows(&ref);
  if (rows == 0 || a.hidden == 0) return LTX_OK;
  if (a.hidden > LTX_NORM_BACKWARD_MAX_HIDDEN || rows > INT32_MAX) return LTX_ERR_INVALID_ARGUMENT;
  const ltx_dtype_t t = ref.dtype;
  const ltx_dtype_t m = a.gate.data ? a.gate.dtype : a.scale.data ? a.scale.dtype : t;
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  return dispatch_float(t, [&](auto x_tag) {
    using Tx = typename decltype(x_tag)::type;
    if (m == LTX_FLOAT32 || std::is_same_v<Tx, float>)
      return norm_backward_typed<Tx, float>(a, rows, s);
    return norm_backward_typed<Tx, Tx>(a, rows, s);
  });
}
