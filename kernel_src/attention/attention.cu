// Attention (CUDA): the launcher of ltx_attention_cuda (see ltx_kernels.h for what it computes).
// It runs the op's argument rules (ltx_check_attention), then this implementation's limits (T
// float16 or bfloat16, head_dim 64 or 128, rows at 16-byte boundaries), fills AttentionParams and
// runs a kernel body on the given stream: hopper_wgmma.cuh (wgmma, TMA, warp specialization) where
// it takes the call (a compute capability 9.0 device, operands a TMA tensor map takes), else
// flash_mma.cuh (mma.sync, any CUDA device). LTX_KERNELS_ATTENTION_KERNEL, read at each call (tests
// and benchmarks switch it), picks one for testing: "mma" always flash_mma.cuh, "wgmma" always
// hopper_wgmma.cuh (a call it does not take fails with LTX_ERR_INVALID_ARGUMENT instead of falling
// back); unset or "auto", the choice above. ltx_attention_int8_cuda runs hopper_int8.cuh, the one
// body of the 8-bit op (compute capability 9.0 only). With the call's workspace
// (ltx_attention_*_workspace), a Hopper body runs the persistent grid's last round of work tiles
// split along their keys where that round would leave most SMs idle (hopper_common.cuh:
// split_parts), and split_merge.cuh's kernel merges the parts after it.
#include <stdlib.h>
#include <string.h>

#include "../device/launch.cuh"
#include "../rows.h"
#include "attention_params.cuh"
#include "flash_mma.cuh"
#include "hopper_int8.cuh"
#include "hopper_wgmma.cuh"
#include "split_merge.cuh"

namespace ltx {
namespace {

constexpr double kLog2e = 1.44269504088896340736;

enum class Body { kAuto, kMma, kWgmma };

Body requested_body() {
  const char* env = getenv("LTX_KERNELS_ATTENTION_KERNEL");
  if (env == nullptr) return Body::kAuto;
  if (strcmp(env, "mma") == 0) return Body::kMma;
  if (strcmp(env, "wgmma") == 0) return Body::kWgmma;
  return Body::kAuto;
}

// Whether LTX_KERNELS_ATTENTION_SPLIT, read at each call, lets the launchers split work tiles
// along their keys (hopper_common.cuh: split_parts): "off" never (tests and benchmarks switch it).
bool split_allowed() {
  const char* env = getenv("LTX_KERNELS_ATTENTION_SPLIT");
  return env == nullptr || strcmp(env, "off") != 0;
}

// How a call's work tiles split (hopper_common.cuh: split_parts): the parts (1: none) and the
// workspace bytes of the parts' rows.
struct Split {
  int64_t tiles;
  int parts;
  int64_t bytes;
};

Split split_of(int64_t batch, int64_t q_len, int64_t heads, int64_t kv_len, int64_t head_dim) {
  const int64_t tiles =
      hopper::WorkTiles<hopper::CtaShape::kBlockM>::query_tiles(q_len) * heads * batch;
  const int parts =
      split_allowed() ? hopper::split_parts(tiles, ceil_div(kv_len, hopper_wgmma::kBlockN)) : 1;
  return {tiles, parts, hopper::split_workspace(tiles, parts, static_cast<int>(head_dim))};
}

// The workspace bytes of a call of q's and k's sizes (ltx_attention_*_workspace).
int64_t split_workspace(const ltx_rows_t& q, const ltx_rows_t& k, int64_t head_dim) {
  return split_of(q.size[0], q.size[1], q.size[2], k.size[1], head_dim).bytes;
}

// Runs a Hopper body (run(p)) with p.split over the call's workspace (none where it is smaller
// than the split needs or not 8-byte aligned: the parts' rows go out as float2), then the merge
// of the split tiles' parts.
template <typename T, int kHeadDim, class Params, class Run>
int run_split(Params& p, void* workspace, int64_t bytes, cudaStream_t stream, Run run) {
  const Split s = split_of(p.batch, p.q_len, p.heads, p.kv_len, kHeadDim);
  const bool usable = workspace != nullptr && bytes >= s.bytes &&
                      reinterpret_cast<uintptr_t>(workspace) % alignof(float2) == 0;
  p.split = s.bytes > 0 && usable ? hopper::key_split(s.tiles, s.parts, kHeadDim, workspace)
                                  : KeySplit{nullptr, nullptr, 0, 1};
  const int status = run(p);
  if (status != LTX_OK || p.split.parts == 1) return status;
  return split_merge::run<T, kHeadDim>(p.split, p.out, p.lse, p.q_len, p.heads, s.tiles, stream);
}

template <typename T, int kHeadDim>
int attention_typed(const ltx_attention_args_t& a, cudaStream_t stream) {
  AttentionParams<T> p;
  p.out = HeadRows<T>::of(a.out);
  p.q = HeadRows<const T>::of(a.q);
  p.k = HeadRows<const T>::of(a.k);
  p.v = HeadRows<const T>::of(a.v);
  p.lse = static_cast<float*>(a.lse);
  p.key_lengths = a.key_lengths.data;
  p.key_lengths_int64 = a.key_lengths.dtype == LTX_INT64;
  p.batch = a.q.size[0];
  p.q_len = a.q.size[1];
  p.heads = a.q.size[2];
  p.kv_len = a.k.size[1];
  p.scale_log2 = static_cast<float>(a.scale * kLog2e);
  const Body body = requested_body();
  if (body != Body::kMma) {
    hopper_wgmma::TensorMaps maps;
    if (hopper_wgmma::takes<T, kHeadDim>(p, &maps))
      return run_split<T, kHeadDim>(p, a.workspace, a.workspace_bytes, stream, [&](auto& q) {
        return hopper_wgmma::run<T, kHeadDim>(q, maps, stream);
      });
    if (body == Body::kWgmma) return LTX_ERR_INVALID_ARGUMENT;
  }
  return flash_mma::run<T, kHeadDim>(p, stream);
}

template <typename T, int kHeadDim>
int attention_int8_typed(const ltx_attention_int8_args_t& a, cudaStream_t stream) {
  AttentionInt8Params<T> p;
  p.out = HeadRows<T>::of(a.out);
  p.q = HeadRows<const int8_t>::of(a.q8);
  p.k = HeadRows<const int8_t>::of(a.k8);
  p.v = HeadRows<const uint8_t>::of(a.v8);
  p.q_scale = a.q_scale;
  p.k_scale = a.k_scale;
  p.v_scale = a.v_scale;
  p.lse = static_cast<float*>(a.lse);
  p.key_lengths = a.key_lengths.data;
  p.key_lengths_int64 = a.key_lengths.dtype == LTX_INT64;
  p.batch = a.q8.size[0];
  p.q_len = a.q8.size[1];
  p.heads = a.q8.size[2];
  p.kv_len = a.k8.size[1];
  p.key_blocks = ceil_div(p.kv_len, LTX_ATTENTION_INT8_KEY_BLOCK);
  p.v_columns = ltx_attention_v_pad(p.kv_len);
  p.scale_log2 = static_cast<float>(a.scale * kLog2e);
  hopper_int8::TensorMaps maps{};
  if (!hopper_int8::takes<T, kHeadDim>(p, &maps)) return LTX_ERR_INVALID_ARGUMENT;
  return run_split<T, kHeadDim>(p, a.workspace, a.workspace_bytes, stream, [&](auto& q) {
    return hopper_int8::run<T, kHeadDim>(q, maps, stream);
  });
}

}  // namespace
}  // namespace ltx

extern "C" int ltx_attention_cuda(const ltx_attention_args_t* args, ltx_stream_t stream) {
  using namespace ltx;
  const ltx_check_t check = ltx_check_attention(args);
  if (check.status != LTX_OK) return check.status;
  const ltx_attention_args_t& a = *args;
  if (!ltx_attention_cuda_takes_dtype(a.q.dtype)) return LTX_ERR_UNSUPPORTED_DTYPE;
  if (!ltx_attention_cuda_takes_head_dim(a.head_dim)) return LTX_ERR_INVALID_ARGUMENT;
  const ltx_rows_t* const operands[4] = {&a.out, &a.q, &a.k, &a.v};
  for (const ltx_rows_t* r : operands)  // (an empty operand's data is never read)
    if (ltx_num_rows(r) > 0 && !ltx_rows_aligned(r, 2, 16)) return LTX_ERR_INVALID_ARGUMENT;
  if (ltx_num_rows(&a.q) == 0) return LTX_OK;
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (a.q.dtype == LTX_BFLOAT16)
    return a.head_dim == 64 ? attention_typed<__nv_bfloat16, 64>(a, s)
                            : attention_typed<__nv_bfloat16, 128>(a, s);
  return a.head_dim == 64 ? attention_typed<__half, 64>(a, s) : attention_typed<__half, 128>(a, s);
}

extern "C" int ltx_attention_int8_cuda(const ltx_attention_int8_args_t* args, ltx_stream_t stream) {
  using namespace ltx;
  const ltx_check_t check = ltx_check_attention_int8(args);
  if (check.status != LTX_OK) return check.status;
  const ltx_attention_int8_args_t& a = *args;
  if (!ltx_attention_cuda_takes_dtype(a.out.dtype)) return LTX_ERR_UNSUPPORTED_DTYPE;
  if (!ltx_attention_cuda_takes_head_dim(a.head_dim)) return LTX_ERR_INVALID_ARGUMENT;
  const ltx_rows_t* const operands[4] = {&a.out, &a.q8, &a.k8, &a.v8};
  const int elem_bytes[4] = {2, 1, 1, 1};
  const int64_t row_len[4] = {a.head_dim, a.head_dim, a.head_dim, a.kv_pad};
  for (int i = 0; i < 4; ++i)  // (an empty operand's data is never read: v8 of no keys too)
    if (ltx_num_rows(operands[i]) * row_len[i] > 0 &&
        !ltx_rows_aligned(operands[i], elem_bytes[i], 16))
      return LTX_ERR_INVALID_ARGUMENT;
  if (ltx_num_rows(&a.q8) == 0) return LTX_OK;
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (a.out.dtype == LTX_BFLOAT16)
    return a.head_dim == 64 ? attention_int8_typed<__nv_bfloat16, 64>(a, s)
                            : attention_int8_typed<__nv_bfloat16, 128>(a, s);
  return a.head_dim == 64 ? attention_int8_typed<__half, 64>(a, s)
                          : attention_int8_typed<__half, 128>(a, s);
}

// (0 where no Hopper body would run the call: another GPU, or the mma body asked for)
extern "C" int64_t ltx_attention_cuda_workspace(const ltx_attention_args_t* args) {
  using namespace ltx;
  if (ltx_check_attention(args).status != LTX_OK ||
      !ltx_attention_cuda_takes_head_dim(args->head_dim) ||
      !ltx_attention_cuda_takes_dtype(args->q.dtype) || requested_body() == Body::kMma ||
      device_attribute<cudaDevAttrComputeCapabilityMajor>(9) != 9)
    return 0;
  return split_workspace(args->q, args->k, args->head_dim);
}

extern "C" int64_t ltx_attention_int8_cuda_workspace(const ltx_attention_int8_args_t* args) {
  using namespace ltx;
  if (ltx_check_attention_int8(args).status != LTX_OK ||
      !ltx_attention_cuda_takes_head_dim(args->head_dim) ||
      !ltx_attention_cuda_takes_dtype(args->out.dtype) ||
      device_attribute<cudaDevAttrComputeCapabilityMajor>(9) != 9)
    return 0;
  return split_workspace(args->q8, args->k8, args->head_dim);
}
