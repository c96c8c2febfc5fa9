// The 8-bit operands of attention (CUDA; ltx_quantize_attention_k_cuda and
// ltx_quantize_attention_v_cuda in ltx_kernels.h), two passes each:
// - a reduction pass (reduce_kernel): per (batch, head) pair and chunk of keys, each channel's sum
//   (K) or NaN-propagating amax (V) over the chunk, written to the workspace [pairs, chunks, dim];
// - a quantizing pass that first combines its pair's chunks (in a fixed order: deterministic):
//   K (quantize_k_kernel): one block per block of 128 keys holds the centered values in registers,
//   reduces their amax and writes the int8 codes ([B, S, H, D], rows of D);
//   V (quantize_v_kernel): one block per tile of 128 keys converts them to e4m3 with each channel's
//   factor, transposes them through shared memory and writes each channel's 128 keys as one
//   coalesced 128-byte row segment of [B, H, D, kv_pad] (keys in ltx_attention_v_column order,
//   pad columns 0).
// Bytes moved: K reads x twice and writes 1 byte per element (5 bytes per bf16 element), V reads x
// twice and writes 1 byte per element (padded); the workspace is a few hundred KB.
#include <algorithm>

#include "../device_utils.cuh"

namespace ltx {
namespace {

constexpr int kReduceThreads = 256;
constexpr int kTileKeys = LTX_ATTENTION_K_BLOCK;  // keys per block of the quantizing passes
constexpr int kVThreads = 256;
constexpr int kKValuesPerThread = 64;  // K: values a thread holds (a block: 2 * head_dim threads)
constexpr int kMaxDim = LTX_ATTENTION_QUANT_CUDA_MAX_HEAD_DIM;
constexpr int kTileWords = kTileKeys / 4;    // 32-bit words of e4m3 codes per channel and tile
constexpr int kTileStride = kTileWords + 1;  // shared-memory row stride (words): fewer conflicts

// x (k or v) as the kernels see it: pair p = b * heads + h, key s.
template <typename T>
struct KeyRows {
  const T* data;
  int64_t stride_b, stride_s, stride_h;
  int64_t kv_len;
  int heads, dim;
  int chunks;         // chunks of keys of the reduction pass per pair
  int64_t chunk_len;  // keys per chunk (the last ones may hold fewer, or none)

  __device__ __forceinline__ const T* row(int64_t pair, int64_t s) const {
    const int64_t b = pair / heads, h = pair - b * heads;
    return data + b * stride_b + s * stride_s + h * stride_h;
  }
};

// The kVec elements at p as fp32 (zeros when !valid): one 16-byte Pack, or one element.
template <int kVec, typename T>
__device__ __forceinline__ void load_values(float (&v)[kVec], const T* p, bool valid) {
  if (!valid) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) v[i] = 0.f;
  } else if constexpr (kVec == 1) {
    v[0] = to_float(__ldg(p));
  } else {
    Pack<T, kVec> pack;
    pack.load(p);
#pragma unroll
    for (int i = 0; i < kVec; ++i) v[i] = pack.get(i);
  }
}

// Reduction pass, block (pair, chunk): thread (r, col) reduces the kVec channels of pack column
// col over keys r, r + rows, ... of the chunk (sum, or NaN-propagating amax of |x|); the rows'
// results are combined in a fixed order and written to workspace[pair, chunk, :].
template <typename T, int kVec, bool kAbsMax>
__global__ void __launch_bounds__(kReduceThreads)
    reduce_kernel(const KeyRows<T> x, float* __restrict__ workspace) {
  __shared__ float partials[kReduceThreads * kVec];
  const int64_t pair = blockIdx.x / x.chunks;
  const int chunk = static_cast<int>(blockIdx.x - pair * x.chunks);
  const int cols = x.dim / kVec, rows = kReduceThreads / cols;
  const int col = threadIdx.x % cols, r = threadIdx.x / cols;
  const int64_t first = chunk * x.chunk_len;
  const int64_t end = min(first + x.chunk_len, x.kv_len);
  auto op = [](float a, float b) { return kAbsMax ? NanMax{}(a, fabsf(b)) : a + b; };
  wait_for_prior_grids();
  allow_dependent_grids();
  if (r < rows) {
    float acc[kVec] = {};
    for (int64_t s = first + r; s < end; s += rows) {
      float v[kVec];
      load_values<kVec>(v, x.row(pair, s) + col * kVec, true);
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[i] = op(acc[i], v[i]);
    }
#pragma unroll
    for (int i = 0; i < kVec; ++i) partials[r * x.dim + col * kVec + i] = acc[i];
  }
  __syncthreads();
  for (int d = threadIdx.x; d < x.dim; d += blockDim.x) {
    float total = partials[d];
    for (int k = 1; k < rows; ++k)
      total = kAbsMax ? NanMax{}(total, partials[k * x.dim + d]) : total + partials[k * x.dim + d];
    workspace[(pair * x.chunks + chunk) * x.dim + d] = total;
  }
}

// K, block (pair, block j of 128 keys): the pair's mean from the workspace's chunk sums, the
// centered values c = x - mean of the block's keys (kSlots packs of kVec per thread, pack item
// it = threadIdx.x + k * blockDim.x: key it / cols, pack column it % cols), their amax over the
// block, then the I8Row codes and the block's scale.
template <typename T, int kVec, int kSlots>
__global__ void __launch_bounds__(2 * LTX_ATTENTION_QUANT_CUDA_MAX_HEAD_DIM)
    quantize_k_kernel(const KeyRows<T> x, const float* __restrict__ workspace,
                      uint8_t* __restrict__ codes, float* __restrict__ scale, int64_t blocks) {
  __shared__ float mean[kMaxDim];
  __shared__ float scratch[32];
  const int64_t pair = blockIdx.x / blocks, j = blockIdx.x - pair * blocks;
  const int cols = x.dim / kVec;
  const int64_t first = j * kTileKeys;
  const int keys = static_cast<int>(min(static_cast<int64_t>(kTileKeys), x.kv_len - first));
  wait_for_prior_grids();
  allow_dependent_grids();
  for (int d = threadIdx.x; d < x.dim; d += blockDim.x) {
    float sum = 0.f;
    for (int c = 0; c < x.chunks; ++c) sum += workspace[(pair * x.chunks + c) * x.dim + d];
    mean[d] = sum / static_cast<float>(x.kv_len);
  }
  __syncthreads();
  float v[kSlots][kVec];
  float amax = 0.f;
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    const int it = threadIdx.x + k * blockDim.x;
    const bool valid = it < keys * cols;
    const int key = valid ? it / cols : 0, col = it - key * cols;
    load_values<kVec>(v[k], x.row(pair, first + key) + col * kVec, valid);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      v[k][i] = valid ? v[k][i] - mean[col * kVec + i] : 0.f;
      amax = NanMax{}(amax, fabsf(v[k][i]));
    }
  }
  const I8Row::Row q = I8Row::of(block_reduce(amax, scratch, NanMax{}));
  if (threadIdx.x == 0) scale[pair * blocks + j] = q.scale;
  const int64_t b = pair / x.heads, h = pair - b * x.heads;
#pragma unroll
  for (int k = 0; k < kSlots; ++k) {
    const int it = threadIdx.x + k * blockDim.x;
    if (it >= keys * cols) continue;
    const int key = it / cols, col = it - key * cols;
    uint32_t words[(kVec + 3) / 4] = {};
#pragma unroll
    for (int i = 0; i < kVec; ++i) words[i / 4] |= to_i8(v[k][i] * q.factor) << (8 * (i % 4));
    store_codes<kVec>(codes + ((b * x.kv_len + first + key) * x.heads + h) * x.dim + col * kVec,
                      words);
  }
}

// V, block (pair, tile of 128 keys): each channel's factor from the workspace's chunk maxima (tile
// 0 writes the scales); thread items (word w of 4 columns, pack column col) convert the 4 keys of
// columns 4w..4w + 3 (ltx_attention_v_key: keys 16 (w / 4) + 2 (w % 4) + {0, 1, 8, 9}) x kVec
// channels to e4m3 and store them as one word per channel into the transposed tile [dim][32
// words]; then each warp writes 128 contiguous bytes of one channel row of codes [pairs, dim,
// kv_pad] (the columns of keys from kv_len on are zeros, nothing past kv_pad is written).
template <typename T, int kVec>
__global__ void __launch_bounds__(kVThreads)
    quantize_v_kernel(const KeyRows<T> x, const float* __restrict__ workspace,
                      uint8_t* __restrict__ codes, float* __restrict__ scale, int64_t tiles,
                      int64_t kv_pad) {
  __shared__ float factor[kMaxDim];
  __shared__ uint32_t tile[kMaxDim * kTileStride];
  const int64_t pair = blockIdx.x / tiles, t = blockIdx.x - pair * tiles;
  const int cols = x.dim / kVec;
  const int64_t first = t * kTileKeys;
  wait_for_prior_grids();
  allow_dependent_grids();
  for (int d = threadIdx.x; d < x.dim; d += blockDim.x) {
    float amax = 0.f;
    for (int c = 0; c < x.chunks; ++c)
      amax = NanMax{}(amax, workspace[(pair * x.chunks + c) * x.dim + d]);
    const E4m3Row::Row q = E4m3Row::of(amax);
    factor[d] = q.factor;
    if (t == 0) scale[pair * x.dim + d] = q.scale;
  }
  __syncthreads();
  for (int it = threadIdx.x; it < kTileWords * cols; it += blockDim.x) {
    const int w = it / cols, col = it - w * cols;
    float v[4][kVec];
    bool valid[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {  // byte k of word w: the key of column 4 w + k
      const int64_t s = first + ltx_attention_v_key(4 * w + k);
      valid[k] = s < x.kv_len;
      load_values<kVec>(v[k], x.row(pair, valid[k] ? s : 0) + col * kVec, valid[k]);
    }
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const float f = factor[col * kVec + i];
      float c[4];  // the keys' scaled values; keys past kv_len 0 (also where the factor is NaN)
#pragma unroll
      for (int k = 0; k < 4; ++k) c[k] = valid[k] ? v[k][i] * f : 0.f;
      tile[(col * kVec + i) * kTileStride + w] =
          to_e4m3x2(c[0], c[1]) | (to_e4m3x2(c[2], c[3]) << 16);
    }
  }
  __syncthreads();
  for (int it = threadIdx.x; it < x.dim * kTileWords; it += blockDim.x) {
    const int d = it / kTileWords, w = it - d * kTileWords;
    const int64_t column = first + 4 * w;
    if (column < kv_pad)
      *reinterpret_cast<uint32_t*>(codes + (pair * x.dim + d) * kv_pad + column) =
          tile[d * kTileStride + w];
  }
}

// The launch of both ops: the reduction pass, then the op's quantizing pass.
template <typename T, int kVec, bool kIsV>
int launch_typed(const KeyRows<T>& x, const ltx_attention_quant_args_t& a, int64_t pairs,
                 cudaStream_t stream) {
  int status = launch(reduce_kernel<T, kVec, kIsV>, dim3(static_cast<unsigned>(pairs * x.chunks)),
                      dim3(kReduceThreads), 0, stream, x, a.workspace);
  if (status != LTX_OK) return status;
  uint8_t* codes = static_cast<uint8_t*>(a.codes);
  if constexpr (kIsV) {
    const int64_t kv_pad = ltx_attention_v_pad(x.kv_len);
    const int64_t tiles = ceil_div(kv_pad, kTileKeys);
    if (pairs * tiles > INT32_MAX) return LTX_ERR_INVALID_ARGUMENT;
    return launch(quantize_v_kernel<T, kVec>, dim3(static_cast<unsigned>(pairs * tiles)),
                  dim3(kVThreads), 0, stream, x, a.workspace, codes, a.scale, tiles, kv_pad);
  } else {
    // 64 values per thread in kSlots packs: a block holds 128 keys in 2 * head_dim threads.
    constexpr int kSlots = kKValuesPerThread / kVec;
    const int64_t blocks = ceil_div(x.kv_len, kTileKeys);
    const int threads = static_cast<int>(ceil_div(kTileKeys * (x.dim / kVec), kSlots * 32) * 32);
    if (pairs * blocks > INT32_MAX) return LTX_ERR_INVALID_ARGUMENT;
    return launch(quantize_k_kernel<T, kVec, kSlots>, dim3(static_cast<unsigned>(pairs * blocks)),
                  dim3(threads), 0, stream, x, a.workspace, codes, a.scale, blocks);
  }
}

template <bool kIsV>
int quantize_attention(const ltx_attention_quant_args_t* args, ltx_check_t check,
                       ltx_stream_t stream) {
  const int status = launcher_status(check, 0);
  if (status != LTX_OK) return status;
  const ltx_attention_quant_args_t& a = *args;
  const int64_t pairs = a.x.size[0] * a.x.size[2];
  if (a.head_dim > kMaxDim || a.x.size[1] > INT32_MAX) return LTX_ERR_INVALID_ARGUMENT;
  if (pairs == 0 || a.x.size[1] == 0 || a.head_dim == 0) return LTX_OK;
  if (pairs * ltx_attention_quant_chunks(pairs, a.x.size[1]) > INT32_MAX)
    return LTX_ERR_INVALID_ARGUMENT;
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  return dispatch_float(a.x.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = 16 / sizeof(T);
    KeyRows<T> x{static_cast<const T*>(a.x.data),
                 a.x.stride[0],
                 a.x.stride[1],
                 a.x.stride[2],
                 a.x.size[1],
                 static_cast<int>(a.x.size[2]),
                 static_cast<int>(a.head_dim),
                 static_cast<int>(ltx_attention_quant_chunks(pairs, a.x.size[1])),
                 0};
    x.chunk_len = ceil_div(x.kv_len, x.chunks);
    if (x.dim % kVec == 0 && ltx_rows_aligned(&a.x, sizeof(T), 16))
      return launch_typed<T, kVec, kIsV>(x, a, pairs, s);
    return launch_typed<T, 1, kIsV>(x, a, pairs, s);
  });
}

}  // namespace
}  // namespace ltx

extern "C" int ltx_quantize_attention_k_cuda(const ltx_attention_quant_args_t* args,
                                             ltx_stream_t stream) {
  return ltx::quantize_attention<false>(args, ltx_check_quantize_attention_k(args), stream);
}

extern "C" int ltx_quantize_attention_v_cuda(const ltx_attention_quant_args_t* args,
                                             ltx_stream_t stream) {
  return ltx::quantize_attention<true>(args, ltx_check_quantize_attention_v(args), stream);
}
