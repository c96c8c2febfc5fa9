// The merge of split work tiles (KeySplit, hopper_common.cuh): after a Hopper body's kernel has
// left each part's rows in the workspace (out normalized by the part's own sum, fp32, and the
// part's lse), merge_kernel combines them per query row in part order:
//   L = ln sum_p exp(lse_p),   out = sum_p exp(lse_p - L) out_p   (rounded to T),   lse = L
// (a part without keys, lse_p = -inf, weighs 0; a row none of whose parts has keys: out 0, lse
// -inf). A warp a row, lane c channels kPerLane c..: the workspace's rows are read once, in
// 128-byte lines.
#pragma once

#include <math.h>
#include <stdint.h>

#include "../device/launch.cuh"
#include "attention_params.cuh"
#include "flash_mma.cuh"  // round_pair
#include "hopper_common.cuh"

namespace ltx {
namespace split_merge {

constexpr int kThreads = 256;

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    merge_kernel(const KeySplit split, const HeadRows<T> out, float* lse, int64_t q_len,
                 int64_t heads, int64_t split_rows) {
  constexpr int kBlockM = hopper::CtaShape::kBlockM, kPerLane = kHeadDim / 32;
  wait_for_prior_grids();  // (the parts' rows are the kernel before's)
  allow_dependent_grids();
  const int64_t warp = (int64_t{blockIdx.x} * kThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= split_rows) return;
  const int64_t tile = split.whole + warp / kBlockM, q_tiles = (q_len + kBlockM - 1) / kBlockM;
  const int64_t query = tile % q_tiles * kBlockM + warp % kBlockM, h = tile / q_tiles % heads,
                b = tile / q_tiles / heads;
  if (query >= q_len) return;
  // part p's row: (split tile * parts + p) * kBlockM + row
  const int64_t first = warp / kBlockM * split.parts * kBlockM + warp % kBlockM;
  float top = -INFINITY;
  for (int part = 0; part < split.parts; ++part)
    top = fmaxf(top, split.lse[first + int64_t{part} * kBlockM]);
  float acc[kPerLane] = {}, total = 0.f;
  for (int part = 0; part < split.parts; ++part) {
    const int64_t row = first + int64_t{part} * kBlockM;
    const float part_lse = split.lse[row];
    const float weight = part_lse == -INFINITY ? 0.f : expf(part_lse - top);
    total += weight;
    const float* const values = split.partials + row * kHeadDim + lane * kPerLane;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) acc[i] = fmaf(weight, values[i], acc[i]);
  }
  const float inv = total > 0.f ? 1.f / total : 0.f;
  uint32_t pairs[kPerLane / 2];
#pragma unroll
  for (int i = 0; i < kPerLane / 2; ++i)
    pairs[i] = flash_mma::round_pair<T>(acc[2 * i] * inv, acc[2 * i + 1] * inv);
  uint32_t* const row_out = reinterpret_cast<uint32_t*>(out.row(b, query, h) + lane * kPerLane);
#pragma unroll
  for (int i = 0; i < kPerLane / 2; ++i) row_out[i] = pairs[i];
  if (lse != nullptr && lane == 0)
    lse[(b * heads + h) * q_len + query] = total > 0.f ? top + logf(total) : -INFINITY;
}

// Runs merge_kernel over the split tiles' rows of a call whose body kernel was just launched on
// `stream` with `split` (parts > 1) over `tiles` work tiles.
template <typename T, int kHeadDim>
int run(const KeySplit& split, const HeadRows<T>& out, float* lse, int64_t q_len, int64_t heads,
        int64_t tiles, cudaStream_t stream) {
  const int64_t rows = (tiles - split.whole) * hopper::CtaShape::kBlockM;
  const int64_t blocks = ceil_div(rows * 32, kThreads);
  return launch(merge_kernel<T, kHeadDim>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0,
                stream, split, out, lse, q_len, heads, rows);
}

}  // namespace split_merge
}  // namespace ltx
