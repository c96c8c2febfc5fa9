// The attention kernels' view of ltx_attention_args_t and ltx_attention_int8_args_t
// (ltx_kernels.h): what the launcher (attention.cu) hands to a kernel body. A kernel body reads
// the operands and key_lengths and writes out and lse through these; the launcher, its checks and
// the C twins do not depend on how the body computes.
#pragma once

#include <stdint.h>

#include "../ltx_kernels.h"

namespace ltx {

// Rows of head_dim elements of a [batch, len, heads, head_dim] tensor at any element strides (an
// ltx_rows_t with sizes {batch, len, heads}); 64-bit offsets.
template <typename T>
struct HeadRows {
  T* data;
  int64_t batch_stride, seq_stride, head_stride;

  static HeadRows of(const ltx_rows_t& r) {
    return HeadRows{static_cast<T*>(r.data), r.stride[0], r.stride[1], r.stride[2]};
  }
  __device__ __forceinline__ T* row(int64_t b, int64_t s, int64_t h) const {
    return data + b * batch_stride + s * seq_stride + h * head_stride;
  }
};

// The keys batch element b attends: key_lengths[b] (int32, or int64 when key_lengths_int64)
// clamped to [0, kv_len]; every key without lengths (nullptr).
__device__ __forceinline__ int64_t attended_keys(const void* key_lengths, bool key_lengths_int64,
                                                 int64_t kv_len, int64_t b) {
  if (key_lengths == nullptr) return kv_len;
  const int64_t n = key_lengths_int64 ? static_cast<const int64_t*>(key_lengths)[b]
                                      : static_cast<const int32_t*>(key_lengths)[b];
  return n < 0 ? 0 : n > kv_len ? kv_len : n;
}

// The split of the persistent grid's last round of work tiles along their keys (the launcher's
// plan: hopper_common.cuh, split_parts): work tiles from `whole` on run in `parts` parts, each
// over its share of the K/V tiles, on as many CTAs; each part writes its rows' normalized out
// (fp32) and lse to `partials` and `lse` (partial_row), and a kernel after merges them
// (split_merge.cuh). parts = 1: no tile is split.
struct KeySplit {
  float* partials;  // [split tiles][parts][kBlockM rows][head_dim]
  float* lse;       // [split tiles][parts][kBlockM rows]
  int64_t whole;
  int parts;
};

template <typename T>
struct AttentionParams {
  HeadRows<T> out;
  HeadRows<const T> q, k, v;
  float* lse;               // [batch, heads, q_len] contiguous; nullptr: not written
  const void* key_lengths;  // [batch] int32 or int64 (key_lengths_int64); nullptr: every key
  bool key_lengths_int64;
  int64_t batch, heads, q_len, kv_len;
  float scale_log2;  // scale * log2(e): scores in base 2, so that softmax runs on exp2
  KeySplit split;

  __device__ __forceinline__ int64_t attended_keys(int64_t b) const {
    return ltx::attended_keys(key_lengths, key_lengths_int64, kv_len, b);
  }
};

// The 8-bit kernel's view of ltx_attention_int8_args_t (ltx_kernels.h): int8 q and k rows of
// head_dim, e4m3 v rows of keys ({batch, heads, head_dim}: row(b, h, d); key j at column
// ltx_attention_v_column(j)), the fp32 scales.
template <typename T>
struct AttentionInt8Params {
  HeadRows<T> out;
  HeadRows<const int8_t> q, k;
  HeadRows<const uint8_t> v;  // float8_e4m3 codes
  const float* q_scale;       // [batch, q_len, heads]
  const float* k_scale;       // [batch, heads, key_blocks]
  const float* v_scale;       // [batch, heads, head_dim]
  float* lse;                 // [batch, heads, q_len] contiguous; nullptr: not written
  const void* key_lengths;    // as AttentionParams'
  bool key_lengths_int64;
  int64_t batch, heads, q_len, kv_len, key_blocks;
  int64_t v_columns;  // kv_len rounded up to 16: v8's columns of keys (ltx_attention_v_column;
                      // its rows may be longer: kv_pad)
  float scale_log2;
  KeySplit split;

  __device__ __forceinline__ int64_t attended_keys(int64_t b) const {
    return ltx::attended_keys(key_lengths, key_lengths_int64, kv_len, b);
  }
};

}  // namespace ltx
