// Entry points of the ltx_kernels ops (torch side): argument checks, device guard, current
// stream, then the C launchers of kernel_src/ltx_kernels.h.
#pragma once

#include <optional>

#include <torch/library.h>

at::Tensor rmsnorm_cpu(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps);
at::Tensor rmsnorm_cuda(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps);
