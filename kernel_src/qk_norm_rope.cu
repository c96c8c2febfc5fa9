// RMSNorm and/or rotary embedding of up to two tensors (q and k) in one launch (CUDA), with the
// rounding points of torch.nn.RMSNorm and diffusers' apply_rotary_emb (see ltx_qk_norm_rope_cuda
// in ltx_kernels.h); with a quant format, tensor 0's output quantized per head in the same pass
// (format policy Q of device/quant.cuh; NotQuantized: every output has dtype T).
#include <algorithm>
#include <type_traits>

#include "device_utils.cuh"

namespace ltx {
namespace {

// Cached kernel. Measured on H200 (bf16, [2,8064,2048], [1,32760,5120]): 4 packs per thread with
// the natural register count (~93, no cap) beat 8 packs, and caps of 80 registers (spills or
// lost Wan speed); 128-thread blocks beat 256 (more resident blocks around the row barriers).
constexpr int kMaxThreadsPerRow = 512;
constexpr int kRowBlockThreads = 128;     // block size aimed at when several rows share a block
constexpr int kMinRowsToStageWeight = 4;  // fewer rows per block: weight read from L1 instead
constexpr size_t kMaxStagedWeightBytes = 32 * 1024;  // fp32 weight staged in shared memory
constexpr int kStreamingThreads = 256;               // block size of the streaming kernel

// Packs a thread of the cached kernel holds: 16-byte packs (vector path) or element pairs read
// one element at a time (scalar path, for unaligned rows and odd sizes).
template <bool kPackAccess>
constexpr int slots_per_thread() {
  return kPackAccess ? 4 : 8;
}

// One tensor (q or k) as the kernels see it. Row r of x, out, cos and sin starts at the
// RowIndex offset of r; head h of a row uses cos/sin elements from h * head_stride on.
template <typename T, typename Tc>
struct RopeTensor {
  RowPtr<T> out;
  RowPtr<const T> x;
  RowPtr<const Tc> cos;  // null: no rotation
  RowPtr<const Tc> sin;
  int64_t cos_head_stride, sin_head_stride;
  const void* weight;  // norm weight [row_len] of dtype weight_dtype; nullptr: none (or no norm)
  ltx_dtype_t weight_dtype;
  bool weight_vectorized;  // weight 16-byte aligned: staged with Pack loads
  int64_t rows;
  int64_t blocks;  // blocks of the cached kernel that hold this tensor's rows
};

template <typename T, typename Tc>
struct QkNormRopeArgs {
  RopeTensor<T, Tc> t[2];
  int num_tensors;
  int heads, head_dim, half_dim, row_len;  // row_len = heads * head_dim
  bool rot_half;  // halves with rot_dim == head_dim / 2: both halves use cos[i], sin[i]
  bool normalize;
  bool interleaved;
  bool stage_weight;  // cached kernel: weights go through shared memory (dynamic, row_len floats)
  bool shared_table_col;  // cached kernel, pack layout: all slots of a thread use the same cos/sin
                          // columns (head strides 0 and tpr * kVec a multiple of head_dim)
  // Cached kernel geometry (set by launch_cached): threads per row, packs per head (pack layout)
  // and pack pairs per head (pair layout) as dividers, rows per block, packs per row.
  FastDivider tpr, packs_per_head, pairs_per_head;
  int rows_per_block;
  int n_packs;
  float inv_row_len;
  float eps;
  QuantOut quant;  // Q != NotQuantized: tensor 0's codes and scales ([rows * heads], per head)
};

// Element-wise moves of a Pack for the scalar path (any alignment), or 16-byte Pack accesses.
template <bool kPackAccess, typename T, int N>
__device__ __forceinline__ void load_elements(Pack<T, N>& p, const T* src) {
  if constexpr (kPackAccess) {
    p.load(src);
  } else {
#pragma unroll
    for (int w = 0; w < static_cast<int>(sizeof(p.w) / 4); ++w) p.w[w] = 0u;
#pragma unroll
    for (int i = 0; i < N; ++i) p.set(i, to_float(__ldg(src + i)));  // exact: the value is a T
  }
}

template <bool kPackAccess, typename T, int N>
__device__ __forceinline__ void store_elements(const Pack<T, N>& p, T* dst) {
  if constexpr (kPackAccess) {
    p.store(dst);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = from_float<T>(p.get(i));
  }
}

// One rotary pair in fp32: (v0, v1) <- (v0*c0 - v1*s0, v1*c1 + v0*s1), each product and the sum
// rounded to fp32 as PyTorch's `v * cos + rotated * sin` does (no FMA contraction).
__device__ __forceinline__ void rotate_pair(float& v0, float& v1, float c0, float s0, float c1,
                                            float s1) {
  const float o0 = __fadd_rn(__fmul_rn(v0, c0), __fmul_rn(-v1, s0));
  const float o1 = __fadd_rn(__fmul_rn(v1, c1), __fmul_rn(v0, s1));
  v0 = o0;
  v1 = o1;
}

// Rotate-halves of two packs: element i of `first` (offset d + i of a head) pairs with element i
// of `second` (offset d + i + half), with the cos/sin packs of each half.
template <typename T, typename Tc, int N>
__device__ __forceinline__ void rotate_halves(Pack<T, N>& first, Pack<T, N>& second,
                                              const Pack<Tc, N>& cos0, const Pack<Tc, N>& sin0,
                                              const Pack<Tc, N>& cos1, const Pack<Tc, N>& sin1) {
#pragma unroll
  for (int i = 0; i < N; i += 2) {
    float a0 = first.get(i), b0 = second.get(i), a1 = first.get(i + 1), b1 = second.get(i + 1);
    rotate_pair(a0, b0, cos0.get(i), sin0.get(i), cos1.get(i), sin1.get(i));
    rotate_pair(a1, b1, cos0.get(i + 1), sin0.get(i + 1), cos1.get(i + 1), sin1.get(i + 1));
    first.set_pair(i, a0, a1);
    second.set_pair(i, b0, b1);
  }
}

// Interleaved rotation of one pack: pairs (2i, 2i+1) with the cos/sin packs of the same columns.
template <typename T, typename Tc, int N>
__device__ __forceinline__ void rotate_pack(Pack<T, N>& v, const Pack<Tc, N>& c,
                                            const Pack<Tc, N>& s) {
#pragma unroll
  for (int i = 0; i < N; i += 2) {
    float v0 = v.get(i), v1 = v.get(i + 1);
    rotate_pair(v0, v1, c.get(i), s.get(i), c.get(i + 1), s.get(i + 1));
    v.set_pair(i, v0, v1);
  }
}

// The tensor (0: q, 1: k) and row block of this block of the cached kernel. q and k blocks
// alternate while both have rows left, so the q and k rows that share cos/sin rows run at the
// same time and the second read of those rows hits L2; the tensor with more blocks finishes alone.
template <typename T, typename Tc>
__device__ __forceinline__ void block_work(const QkNormRopeArgs<T, Tc>& a, int& tensor,
                                           int64_t& row_block) {
  const int64_t b = blockIdx.x;
  const int64_t blocks0 = a.t[0].blocks, blocks1 = a.num_tensors > 1 ? a.t[1].blocks : 0;
  const int64_t paired = blocks0 < blocks1 ? blocks0 : blocks1;
  if (b < 2 * paired) {
    tensor = static_cast<int>(b & 1);
    row_block = b >> 1;
  } else {
    tensor = blocks0 > blocks1 ? 0 : 1;
    row_block = b - paired;
  }
}

// Slots whose cos/sin packs a thread holds at once: all of them when they are small, else a batch
// of 2 (fp32 tables with 2-byte activations), so that the tables do not double the registers.
template <typename T, typename Tc, int kVec, int kSlots>
constexpr int table_batch() {
  constexpr int words_per_slot = 2 * kVec * static_cast<int>(sizeof(Tc)) / 4;
  return words_per_slot * kSlots <= 32 ? kSlots : 2;
}

// Where the slots of a thread of the cached kernel sit in its row. Items are packs (pack layout)
// or pack pairs (pair layout: slots 2m and 2m + 1); item m of the thread is item j = m * tpr +
// lane of the row, in head j / items_per_head (heads are only needed to rotate, where head_dim,
// resp. half_dim, is a multiple of kVec).
template <int kVec>
struct SlotMap {
  int tpr, lane;
  int item_shift;  // 1 in the pair layout, 0 in the pack layout
  FastDivider items_per_head;
  int half_dim, head_dim;
  unsigned valid_mask;  // bit s: slot s holds a pack of an active row

  __device__ __forceinline__ int item(int s) const { return (s >> item_shift) * tpr + lane; }
  __device__ __forceinline__ int head(int j) const { return items_per_head.div(j); }
  // Column of slot s's first element in its head (second half of a pair: + half_dim).
  __device__ __forceinline__ int col(int s, int j, int head) const {
    return (j - head * static_cast<int>(items_per_head.divisor)) * kVec +
           ((s & item_shift) ? half_dim : 0);
  }
  // First element of slot s's pack in the row.
  __device__ __forceinline__ int elem(int s) const {
    const int j = item(s);
    if (!item_shift) return j * kVec;  // (head_dim need not divide into packs without rotation)
    const int h = head(j);
    return h * head_dim + col(s, j, h);
  }
  __device__ __forceinline__ bool valid(int s) const { return ((valid_mask >> s) & 1u) != 0; }
};

// Where the norm weight of slot s's kVec elements is read: none (ones), packs of Tw (the fp32 copy
// staged in shared memory, or the weight in global memory), or element by element.
struct NoNormWeight {
  template <int kVec>
  __device__ __forceinline__ void operator()(const SlotMap<kVec>&, int, float (&w)[kVec]) const {
#pragma unroll
    for (int i = 0; i < kVec; ++i) w[i] = 1.f;
  }
};
// (kShared: the fp32 copy in shared memory, read with plain loads; else read-only global loads.)
template <typename Tw, bool kShared = false>
struct PackedNormWeight {
  const Tw* weight;
  template <int kVec>
  __device__ __forceinline__ void operator()(const SlotMap<kVec>& slots, int s,
                                             float (&w)[kVec]) const {
    Pack<Tw, kVec> wp;
    if constexpr (kShared)
      wp.load_plain(weight + slots.elem(s));
    else
      wp.load(weight + slots.elem(s));
#pragma unroll
    for (int i = 0; i < kVec; ++i) w[i] = wp.get(i);
  }
};
struct ScalarNormWeight {
  const void* weight;
  ltx_dtype_t dtype;
  template <int kVec>
  __device__ __forceinline__ void operator()(const SlotMap<kVec>& slots, int s,
                                             float (&w)[kVec]) const {
#pragma unroll
    for (int i = 0; i < kVec; ++i) w[i] = load_as_float(weight, dtype, slots.elem(s) + i);
  }
};

// v = round_T(x * rstd * weight) for each valid slot, in place.
template <int kSlots, typename T, int kVec, typename WeightOf>
__device__ __forceinline__ void normalize_slots(Pack<T, kVec> (&xs)[kSlots],
                                                const SlotMap<kVec>& slots, float rstd,
                                                const WeightOf& weight_of) {
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    if (!slots.valid(s)) continue;
    float w[kVec];
    weight_of(slots, s, w);
#pragma unroll
    for (int i = 0; i < kVec; i += 2)
      xs[s].set_pair(i, xs[s].get(i) * rstd * w[i], xs[s].get(i + 1) * rstd * w[i + 1]);
  }
}

// The cached kernel's quantizing epilogue (tensor 0, format policy Q): each head's amax over the
// row's slots (values already rounded to T) gathered in shared memory (row_amax, zeroed before a
// barrier), then the row's per-head scales and the codes of every slot. Every thread of the block
// must call it.
template <typename Q, int kSlots, typename T, int kVec>
__device__ __forceinline__ void quantize_heads(const Pack<T, kVec> (&xs)[kSlots],
                                               const SlotMap<kVec>& slots, const RowTeam& team,
                                               int heads, uint32_t* row_amax, const QuantOut& out) {
  __syncthreads();  // row_amax is zeroed
#pragma unroll
  for (int s = 0; s < kSlots; ++s)
    if (slots.valid(s))
      atomicMax(row_amax + slots.head(slots.item(s)), __float_as_uint(pack_amax(0.f, xs[s])));
  __syncthreads();
  if (!team.active) return;
  for (int h = team.lane; h < heads; h += team.tpr)
    out.scale[team.row * heads + h] = Q::of(__uint_as_float(row_amax[h])).scale;
  uint8_t* codes = out.codes.row(team.row);
#pragma unroll
  for (int s = 0; s < kSlots; ++s)
    if (slots.valid(s))
      Q::store(codes + slots.elem(s), xs[s],
               Q::of(__uint_as_float(row_amax[slots.head(slots.item(s))])).factor);
}

// Row-cached norm + rotation of q and k rows. Each row is held by a RowTeam of tpr threads (a
// power of two up to 32, else whole warps, so 5120-wide rows take 160 threads with every slot
// used; a block holds rows of one tensor only), kSlots packs of kVec elements per thread, so x is
// read once:
// - pack layout (interleaved rotation, or no rotation): slot s holds pack s * tpr + lane of the
//   row; rotary pairs (2i, 2i+1) lie inside a pack (kVec even, head_dim % kVec == 0).
// - pair layout (rotate-halves): slots 2m and 2m+1 hold the packs at offsets d and d + half of
//   one head, pack pair j = m * tpr + lane of the row (half % kVec == 0); element i of the
//   first pack pairs with element i of the second.
// Load the row, then the cos/sin packs (type Tc) of the first batch of slots (table_batch), then,
// when normalizing with a weight and the block holds several rows, stage the weight in shared
// memory as fp32 (otherwise each thread reads its weight packs after the reduction, mostly L1
// hits). Reduce the sum of squares (row_sum); normalize the cached packs (rounded to T), rotate
// them in fp32 (rounded to T) and store them batch by batch, loading the cos/sin packs of each
// later batch when it comes; tensor 0 of a quantized launch is stored by quantize_heads instead
// (heads of whole packs: head_dim % kVec == 0). When every slot of a thread has the same cos/sin
// columns (shared_table_col: tables shared by all heads, Wan), they are loaded once. kPackAccess =
// false moves elements one at a time (any alignment; kVec = 2).
template <typename T, typename Tc, int kVec, bool kPackAccess, typename Q>
__global__ void __launch_bounds__(kMaxThreadsPerRow)
    qk_norm_rope_cached_kernel(const __grid_constant__ QkNormRopeArgs<T, Tc> a) {
  constexpr int kSlots = slots_per_thread<kPackAccess>();
  constexpr int kBatch = table_batch<T, Tc, kVec, kSlots>();
  static_assert(kVec % 2 == 0 && kBatch % 2 == 0 && kSlots % kBatch == 0,
                "pairs inside packs, pack pairs inside batches");
  extern __shared__ __align__(16) float staged_weight[];
  __shared__ float partials[kMaxThreadsPerRow / 32];

  int tensor;
  int64_t row_block;
  block_work(a, tensor, row_block);
  const RopeTensor<T, Tc>& t = a.t[tensor];
  const RowTeam team = RowTeam::of(a.tpr, row_block * a.rows_per_block, t.rows);
  const bool rotate = t.cos.data != nullptr;
  const bool pair_layout = rotate && !a.interleaved;
  const bool has_weight = a.normalize && t.weight != nullptr;
  const bool staged = has_weight && a.stage_weight;  // same for the whole block
  const bool shared_col = rotate && !pair_layout && a.shared_table_col;
  const bool quantized = !std::is_same_v<Q, NotQuantized> && tensor == 0;  // same for the block
  // quantized: each row's head amaxes (fp32 bits, NaN above every number), after the weight
  uint32_t* head_amax =
      reinterpret_cast<uint32_t*>(staged_weight + (a.stage_weight ? a.row_len : 0));

  SlotMap<kVec> slots{team.tpr,
                      team.lane,
                      pair_layout ? 1 : 0,
                      pair_layout ? a.pairs_per_head : a.packs_per_head,
                      a.half_dim,
                      a.head_dim,
                      0u};
  const int n_items = a.n_packs >> slots.item_shift;
#pragma unroll
  for (int s = 0; s < kSlots; ++s)
    if (team.active && slots.item(s) < n_items) slots.valid_mask |= 1u << s;

  const T* x_row = t.x.row_if(team.active, team.row);
  const Tc* cos_row = rotate && team.active ? t.cos.row(team.row) : nullptr;
  const Tc* sin_row = rotate && team.active ? t.sin.row(team.row) : nullptr;

  // cos/sin packs of slots first .. first + kBatch - 1 (at rot_dim == head_dim / 2 the second
  // half of a pair reuses the first half's values and loads nothing; with shared columns slot 0's
  // packs serve every slot).
  const int second_table_col = a.rot_half ? 0 : a.half_dim;
  Pack<Tc, kVec> cs[kBatch], ss[kBatch];
  auto load_tables = [&](int first) {
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int s = first + b;
      if (slots.valid(s) && !(pair_layout && a.rot_half && (b & 1)) && !(shared_col && b > 0)) {
        const int j = slots.item(s);
        const int head = slots.head(j);
        const int col =
            slots.col(s, j, head) - ((s & slots.item_shift) ? a.half_dim - second_table_col : 0);
        load_elements<kPackAccess>(cs[b],
                                   cos_row + static_cast<int64_t>(head) * t.cos_head_stride + col);
        load_elements<kPackAccess>(ss[b],
                                   sin_row + static_cast<int64_t>(head) * t.sin_head_stride + col);
      }
    }
  };

  wait_for_prior_grids();
  allow_dependent_grids();
  if (quantized)
    for (int i = threadIdx.x; i < a.rows_per_block * a.heads; i += blockDim.x) head_amax[i] = 0u;
  Pack<T, kVec> xs[kSlots];
#pragma unroll
  for (int s = 0; s < kSlots; ++s)
    if (slots.valid(s)) load_elements<kPackAccess>(xs[s], x_row + slots.elem(s));
  if (rotate) load_tables(0);
  if (staged)
    stage_as_float(staged_weight, t.weight, t.weight_dtype, a.row_len, t.weight_vectorized);

  float rstd = 1.f;
  if (a.normalize) {  // same branch for the whole grid
    float sumsq = 0.f;
#pragma unroll
    for (int s = 0; s < kSlots; ++s)
      if (slots.valid(s)) add_squares(sumsq, xs[s]);
    rstd = rsqrtf(row_sum<false>(sumsq, team, partials) * a.inv_row_len + a.eps);
  }
  if (staged) __syncthreads();             // the staged weight is complete
  if (!team.active && !quantized) return;  // (inactive threads join the head amax barriers)
  T* out_row = quantized ? nullptr : t.out.row_if(team.active, team.row);  // (quantized: codes)

  // v = round_T(x * rstd * weight), in place; one loop per weight source.
  if (a.normalize) {
    if (!has_weight)
      normalize_slots(xs, slots, rstd, NoNormWeight{});
    else if (staged)
      normalize_slots(xs, slots, rstd, PackedNormWeight<float, true>{staged_weight});
    else if (t.weight_vectorized && t.weight_dtype != LTX_FLOAT32)  // weight dtype T
      normalize_slots(xs, slots, rstd, PackedNormWeight<T>{static_cast<const T*>(t.weight)});
    else if (t.weight_vectorized)
      normalize_slots(xs, slots, rstd,
                      PackedNormWeight<float>{static_cast<const float*>(t.weight)});
    else
      normalize_slots(xs, slots, rstd, ScalarNormWeight{t.weight, t.weight_dtype});
  }

  // out = round_T(rotated v), batch by batch.
#pragma unroll
  for (int first = 0; first < kSlots; first += kBatch) {
    if (shared_col) {
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
        if (slots.valid(first + b)) rotate_pack(xs[first + b], cs[0], ss[0]);
    } else if (rotate) {
      if (first > 0) load_tables(first);
      if (pair_layout) {
#pragma unroll
        for (int b = 0; b < kBatch; b += 2) {
          if (!slots.valid(first + b)) continue;
          if (a.rot_half)  // second-half cos/sin: the first half's at rot_dim == head_dim / 2
            rotate_halves(xs[first + b], xs[first + b + 1], cs[b], ss[b], cs[b], ss[b]);
          else
            rotate_halves(xs[first + b], xs[first + b + 1], cs[b], ss[b], cs[b + 1], ss[b + 1]);
        }
      } else {
#pragma unroll
        for (int b = 0; b < kBatch; ++b)
          if (slots.valid(first + b)) rotate_pack(xs[first + b], cs[b], ss[b]);
      }
    }
    if (quantized) continue;
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
      if (slots.valid(first + b))
        store_elements<kPackAccess>(xs[first + b], out_row + slots.elem(first + b));
  }
  if constexpr (!std::is_same_v<Q, NotQuantized>) {
    if (quantized)
      quantize_heads<Q>(xs, slots, team, a.heads, head_amax + a.tpr.div(threadIdx.x) * a.heads,
                        a.quant);
  }
}

// Streaming norm + rotation for rows the cached kernel cannot take (too long, or sizes it does
// not divide): one block per row (grid-stride over the q rows, then the k rows), scalar accesses,
// two passes over the row when normalizing (the second mostly hits L1/L2). Threads take rotary
// pairs (2i, 2i+1) or (i, i + half) of a head, or single elements without rotation.
template <typename T, typename Tc, typename Q>
__global__ void __launch_bounds__(kStreamingThreads)
    qk_norm_rope_streaming_kernel(const __grid_constant__ QkNormRopeArgs<T, Tc> a) {
  __shared__ float scratch[32];
  wait_for_prior_grids();
  allow_dependent_grids();
  const int64_t rows0 = a.t[0].rows;
  const int64_t total_rows = rows0 + (a.num_tensors > 1 ? a.t[1].rows : 0);
  for (int64_t r = blockIdx.x; r < total_rows; r += gridDim.x) {
    const int tensor = r < rows0 ? 0 : 1;
    const int64_t row = tensor == 0 ? r : r - rows0;
    const RopeTensor<T, Tc>& t = a.t[tensor];
    const T* x_row = t.x.row(row);
    const bool has_weight = a.normalize && t.weight != nullptr;
    float rstd = 1.f;
    if (a.normalize) rstd = block_rstd(x_row, a.row_len, a.inv_row_len, a.eps, scratch);
    // v of element e: x, or round_T(x * rstd * weight).
    auto value = [&](int e) {
      const float v = to_float(x_row[e]);
      if (!a.normalize) return v;
      const float w = has_weight ? load_as_float(t.weight, t.weight_dtype, e) : 1.f;
      return round_to<T>(v * rstd * w);
    };
    const Tc* cos_row = t.cos.row_or_null(row);
    const Tc* sin_row = t.sin.row_or_null(row);
    // Rotary pair `pair` of the row: its elements e0, e1 and their rotated values (fp32).
    auto rotated_pair = [&](int pair, int& e0, int& e1, float& v0, float& v1) {
      int col0, col1, head;
      if (a.interleaved) {
        e0 = 2 * pair;
        e1 = e0 + 1;
        head = e0 / a.head_dim;
        col0 = e0 - head * a.head_dim;
        col1 = col0 + 1;
      } else {
        head = pair / a.half_dim;
        col0 = pair - head * a.half_dim;
        e0 = head * a.head_dim + col0;
        e1 = e0 + a.half_dim;
        col1 = a.rot_half ? col0 : col0 + a.half_dim;
      }
      const int64_t cos_base = static_cast<int64_t>(head) * t.cos_head_stride;
      const int64_t sin_base = static_cast<int64_t>(head) * t.sin_head_stride;
      v0 = value(e0);
      v1 = value(e1);
      rotate_pair(v0, v1, to_float(cos_row[cos_base + col0]), to_float(sin_row[sin_base + col0]),
                  to_float(cos_row[cos_base + col1]), to_float(sin_row[sin_base + col1]));
    };
    if constexpr (!std::is_same_v<Q, NotQuantized>) {
      if (tensor == 0) {  // each head quantized (its values rounded to T, computed twice)
        for (int h = 0; h < a.heads; ++h) {
          auto head_value = [&](int i) {
            const int e = h * a.head_dim + i;
            if (cos_row == nullptr) return value(e);
            int e0, e1;
            float v0, v1;
            const int pair = a.interleaved ? e / 2 : h * a.half_dim + i % a.half_dim;
            rotated_pair(pair, e0, e1, v0, v1);
            return round_to<T>(e == e0 ? v0 : v1);
          };
          quantize_group_streaming<Q>(a.head_dim, head_value, scratch,
                                      a.quant.codes.row(row) + h * a.head_dim,
                                      a.quant.scale + row * a.heads + h);
        }
        continue;
      }
    }
    T* out_row = t.out.row(row);
    if (cos_row == nullptr) {
      for (int e = threadIdx.x; e < a.row_len; e += blockDim.x)
        out_row[e] = from_float<T>(value(e));
      continue;
    }
    const int n_pairs = a.row_len / 2;
    for (int pair = threadIdx.x; pair < n_pairs; pair += blockDim.x) {
      int e0, e1;
      float v0, v1;
      rotated_pair(pair, e0, e1, v0, v1);
      out_row[e0] = from_float<T>(v0);
      out_row[e1] = from_float<T>(v1);
    }
  }
}

// Launches the cached kernel: threads per row, rows per block, q/k block counts, weight staging.
template <typename T, typename Tc, int kVec, bool kPackAccess, typename Q>
int launch_cached(QkNormRopeArgs<T, Tc> a, cudaStream_t stream) {
  constexpr int kSlots = slots_per_thread<kPackAccess>();
  const int n_packs = a.row_len / kVec;
  // Threads per row: enough for kSlots packs each; a power of two within a warp (aligned groups
  // for the shuffles), else whole warps, so that rows of e.g. 640 packs use 160 threads fully.
  const int needed = (n_packs + kSlots - 1) / kSlots;
  int tpr = 1;
  while (tpr < needed && tpr < 32) tpr *= 2;
  if (needed > 32) tpr = (needed + 31) / 32 * 32;
  const int64_t rows1 = a.num_tensors > 1 ? a.t[1].rows : 0;
  // Several rows per block; fewer when there are few rows, so that every SM gets work.
  const int rows_in_block = rows_per_block(tpr, kRowBlockThreads, 64, [&](int r) {
    return ceil_div(a.t[0].rows, r) + ceil_div(rows1, r);
  });
  a.tpr = FastDivider::of(tpr);
  a.rows_per_block = rows_in_block;
  a.n_packs = n_packs;
  a.packs_per_head = FastDivider::of(std::max(1, a.head_dim / kVec));
  a.pairs_per_head = FastDivider::of(std::max(1, a.half_dim / kVec));
  a.t[0].blocks = ceil_div(a.t[0].rows, rows_in_block);
  a.t[1].blocks = a.num_tensors > 1 ? ceil_div(rows1, rows_in_block) : 0;
  const int64_t blocks = a.t[0].blocks + a.t[1].blocks;
  if (blocks > INT32_MAX) return LTX_ERR_INVALID_ARGUMENT;
  const bool any_weight =
      a.normalize && (a.t[0].weight != nullptr || (a.num_tensors > 1 && a.t[1].weight != nullptr));
  const size_t weight_bytes = static_cast<size_t>(a.row_len) * sizeof(float);
  a.stage_weight =
      any_weight && weight_bytes <= kMaxStagedWeightBytes && rows_in_block >= kMinRowsToStageWeight;
  bool shared_col = a.interleaved && (tpr * kVec) % a.head_dim == 0;
  for (int i = 0; i < a.num_tensors; ++i)
    shared_col = shared_col && (a.t[i].cos.data == nullptr ||
                                (a.t[i].cos_head_stride == 0 && a.t[i].sin_head_stride == 0));
  a.shared_table_col = shared_col;
  const size_t amax_bytes =
      std::is_same_v<Q, NotQuantized> ? 0 : sizeof(uint32_t) * rows_in_block * a.heads;
  return launch(qk_norm_rope_cached_kernel<T, Tc, kVec, kPackAccess, Q>,
                dim3(static_cast<unsigned>(blocks)), dim3(rows_in_block * tpr),
                (a.stage_weight ? weight_bytes : 0) + amax_bytes, stream, a);
}

// True when every row start and every head's table start of `r` is aligned to `alignment` bytes.
inline bool table_rows_aligned(const ltx_rows_t& r, int64_t head_stride, int heads, int elem_bytes,
                               int alignment) {
  return ltx_rows_aligned(&r, elem_bytes, alignment) &&
         (heads <= 1 || (head_stride * elem_bytes) % alignment == 0);
}

// Fills the kernel parameters and picks the kernel: vector cached, scalar cached or streaming.
template <typename T, typename Tc, typename Q>
int qk_norm_rope_typed(const ltx_qk_norm_rope_args_t& args, cudaStream_t stream) {
  QkNormRopeArgs<T, Tc> a{};
  a.num_tensors = args.num_tensors;
  a.heads = static_cast<int>(args.heads);
  a.head_dim = static_cast<int>(args.head_dim);
  a.half_dim = a.head_dim / 2;
  a.row_len = a.heads * a.head_dim;
  a.rot_half = !args.interleaved && args.rot_dim != args.head_dim;
  a.normalize = args.normalize != 0;
  a.interleaved = args.interleaved != 0;
  a.inv_row_len = 1.f / static_cast<float>(a.row_len);
  a.eps = args.eps;

  constexpr int kVec = 16 / sizeof(T);
  constexpr bool kQuantized = !std::is_same_v<Q, NotQuantized>;
  // (quantized: packs of whole heads, and codes of whole packs)
  bool vector_ok = a.row_len % kVec == 0 && (!kQuantized || a.head_dim % kVec == 0);
  bool scalar_ok = a.row_len % 2 == 0 && (!kQuantized || a.head_dim % 2 == 0);
  for (int i = 0; i < args.num_tensors; ++i) {
    const ltx_rope_tensor_t& src = args.tensors[i];
    RopeTensor<T, Tc>& dst = a.t[i];
    const bool codes = kQuantized && i == 0;
    if (codes)
      a.quant = QuantOut{RowPtr<uint8_t>::of(src.out), args.quant.scale};
    else
      dst.out = RowPtr<T>::of(src.out);
    dst.x = RowPtr<const T>::of(src.x);
    dst.rows = ltx_num_rows(&src.x);
    vector_ok =
        vector_ok && ltx_rows_aligned(&src.x, sizeof(T), 16) &&
        (codes ? ltx_rows_aligned(&src.out, 1, kVec) : ltx_rows_aligned(&src.out, sizeof(T), 16));
    scalar_ok = scalar_ok && (!codes || ltx_rows_aligned(&src.out, 1, 2));
    if (src.cos.data != nullptr) {
      dst.cos = RowPtr<const Tc>::of(src.cos);
      dst.sin = RowPtr<const Tc>::of(src.sin);
      dst.cos_head_stride = src.cos_head_stride;
      dst.sin_head_stride = src.sin_head_stride;
      constexpr int kTableAlign = pack_alignment<Tc, kVec>();
      vector_ok =
          vector_ok &&
          table_rows_aligned(src.cos, src.cos_head_stride, a.heads, sizeof(Tc), kTableAlign) &&
          table_rows_aligned(src.sin, src.sin_head_stride, a.heads, sizeof(Tc), kTableAlign);
      if (a.interleaved) {
        vector_ok = vector_ok && a.head_dim % kVec == 0;  // packs never straddle heads
      } else {
        vector_ok = vector_ok && a.half_dim % kVec == 0;  // packs never straddle halves
        scalar_ok = scalar_ok && a.half_dim % 2 == 0;
      }
    }
    if (a.normalize && src.weight.data != nullptr) {
      dst.weight = src.weight.data;
      dst.weight_dtype = src.weight.dtype;
      dst.weight_vectorized = reinterpret_cast<uintptr_t>(src.weight.data) % 16 == 0;
    }
  }
  if (vector_ok && a.row_len / kVec <= slots_per_thread<true>() * kMaxThreadsPerRow)
    return launch_cached<T, Tc, kVec, true, Q>(a, stream);
  if (scalar_ok && a.row_len / 2 <= slots_per_thread<false>() * kMaxThreadsPerRow)
    return launch_cached<T, Tc, 2, false, Q>(a, stream);
  return launch_streaming(qk_norm_rope_streaming_kernel<T, Tc, Q>,
                          a.t[0].rows + (a.num_tensors > 1 ? a.t[1].rows : 0), kStreamingThreads,
                          stream, a);
}

}  // namespace
}  // namespace ltx

extern "C" int ltx_qk_norm_rope_cuda(const ltx_qk_norm_rope_args_t* args, ltx_stream_t stream) {
  using namespace ltx;
  const ltx_check_t check = ltx_check_qk_norm_rope(args);
  const int64_t longest =
      check.status == LTX_OK ? std::max({args->heads, args->head_dim, args->heads * args->head_dim})
                             : 0;
  const int status = launcher_status(check, longest);
  if (status != LTX_OK) return status;
  const ltx_qk_norm_rope_args_t& a = *args;
  bool any_rows = false, fp32_tables = false;
  for (int i = 0; i < a.num_tensors; ++i) {
    any_rows = any_rows || ltx_num_rows(&a.tensors[i].x) > 0;
    fp32_tables = fp32_tables || (a.tensors[i].cos.data && a.tensors[i].cos.dtype == LTX_FLOAT32);
  }
  if (!any_rows || a.heads == 0 || a.head_dim == 0) return LTX_OK;
  const cudaStream_t cuda_stream = reinterpret_cast<cudaStream_t>(stream);
  return dispatch_float(a.tensors[0].x.dtype, [&](auto x_tag) {
    using T = typename decltype(x_tag)::type;
    auto typed = [&](auto q_tag) {
      using Q = typename decltype(q_tag)::type;
      if (fp32_tables) return qk_norm_rope_typed<T, float, Q>(a, cuda_stream);
      return qk_norm_rope_typed<T, T, Q>(a, cuda_stream);
    };
    if (a.quant.format == LTX_QUANT_NONE) return typed(TypeTag<NotQuantized>{});
    return dispatch_quant(a.quant.format, typed);
  });
}
