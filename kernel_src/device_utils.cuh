// Device helpers shared by every CUDA kernel of ltx_kernels, written once, one topic per header of
// kernel_src/device/; this umbrella includes them all (a kernel may include only the ones it uses):
//   convert.cuh     fp16/bf16 <-> fp32 conversions, rounding to a dtype, native 16-bit pairs
//   pack.cuh        16-byte vector loads/stores (Pack), async copies, weight staging
//   reduce.cuh      sums and maxima over lane groups, warps and blocks
//   rows.cuh        row addressing of ltx_rows_t, the row-cached and row-chunked kernels' skeletons
//   activation.cuh  GELU
//   quant.cuh       row quantization: format policies and the one epilogue
//   launch.cuh      compile-time flags, dtype dispatch, launch shapes, the (PDL) launch
#pragma once

#include "device/activation.cuh"
#include "device/convert.cuh"
#include "device/launch.cuh"
#include "device/pack.cuh"
#include "device/quant.cuh"
#include "device/reduce.cuh"
#include "device/rows.cuh"
