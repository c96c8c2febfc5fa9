// The ltx_kernels op library: one schema per op, with CPU and CUDA implementations that check
// their arguments, allocate the outputs, and call the C launchers on the current stream.
#include "torch_binding.h"

#include <atomic>

#include <ATen/Parallel.h>

#if defined(CUDA_KERNEL)
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

#include "binding_utils.h"
#include "registration.h"

// kernel-builder gives the op namespace the (versioned) extension name; the setuptools build
// names it `ltx_kernels`.
#ifndef LTX_OPS_NAMESPACE
#define LTX_OPS_NAMESPACE TORCH_EXTENSION_NAME
#endif

namespace ltx_binding {

std::string launcher_error(int status) {
  switch (status) {
    case LTX_ERR_INVALID_ARGUMENT: return "invalid argument (LTX_ERR_INVALID_ARGUMENT)";
    case LTX_ERR_UNSUPPORTED_DTYPE: return "unsupported dtype (LTX_ERR_UNSUPPORTED_DTYPE)";
  }
#if defined(CUDA_KERNEL)
  if (status > 0) return cudaGetErrorString(static_cast<cudaError_t>(status));
#endif
  return "status " + std::to_string(status);
}

// Runs fn(row_begin, row_end) -> status over [0, rows) on the intra-op thread pool.
template <typename Fn>
int parallel_rows(int64_t rows, int64_t hidden, const Fn& fn) {
  std::atomic<int> status{LTX_OK};
  at::parallel_for(0, rows, cpu_grain(hidden), [&](int64_t begin, int64_t end) {
    const int s = fn(begin, end);
    if (s != LTX_OK) status.store(s);
  });
  return status.load();
}

}  // namespace ltx_binding

using namespace ltx_binding;

// ------------------------------------------------------------------------------------------------
// rmsnorm
// ------------------------------------------------------------------------------------------------
static constexpr const char* kRmsNorm = "ltx_kernels.rmsnorm";

// Checks and output allocation shared by both backends. The output is contiguous, of x's shape,
// and of weight's dtype when there is a weight (x's otherwise), as diffusers' RMSNorm returns.
static at::Tensor rmsnorm_prepare(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                  double eps) {
  check_activation(kRmsNorm, "x", x);
  if (weight) check_channel_vector(kRmsNorm, "weight", *weight, x.size(-1), x);
  check_eps(kRmsNorm, eps);
  return at::empty(x.sizes(), x.options().dtype(weight ? weight->scalar_type() : x.scalar_type()));
}

at::Tensor rmsnorm_cpu(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  at::Tensor out = rmsnorm_prepare(x, weight, eps);
  if (out.numel() == 0) return out;
  const ltx_rows_t out_rows = rows_of(kRmsNorm, "out", out), x_rows = rows_of(kRmsNorm, "x", x);
  const int64_t hidden = x.size(-1);
  check_status(kRmsNorm, parallel_rows(out.numel() / hidden, hidden, [&](int64_t b, int64_t e) {
                 return ltx_rmsnorm_cpu(out_rows, x_rows, optional_data(weight),
                                        optional_dtype(weight), hidden, static_cast<float>(eps),
                                        b, e);
               }));
  return out;
}

#if defined(CUDA_KERNEL)
at::Tensor rmsnorm_cuda(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  at::Tensor out = rmsnorm_prepare(x, weight, eps);
  if (out.numel() == 0) return out;
  const c10::cuda::OptionalCUDAGuard device_guard(x.device());
  check_status(kRmsNorm,
               ltx_rmsnorm_cuda(rows_of(kRmsNorm, "out", out), rows_of(kRmsNorm, "x", x),
                                optional_data(weight), optional_dtype(weight), x.size(-1),
                                static_cast<float>(eps), at::cuda::getCurrentCUDAStream().stream()));
  return out;
}
#endif

// ------------------------------------------------------------------------------------------------
// Registration
// ------------------------------------------------------------------------------------------------
TORCH_LIBRARY_EXPAND(LTX_OPS_NAMESPACE, ops) {
  // y = x * rsqrt(mean(x^2, -1) + eps) [* weight], rounded as diffusers' RMSNorm; out dtype is
  // weight's (x's without weight).
  ops.def("rmsnorm(Tensor x, Tensor? weight=None, float eps=1e-06) -> Tensor");
  ops.impl("rmsnorm", c10::kCPU, &rmsnorm_cpu);
#if defined(CUDA_KERNEL)
  ops.impl("rmsnorm", c10::kCUDA, &rmsnorm_cuda);
#endif
}

REGISTER_EXTENSION(TORCH_EXTENSION_NAME)
