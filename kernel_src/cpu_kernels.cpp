// The portable C implementations (the *_cpu.c files) and the launchers' argument rules (checks.c)
// compiled as one C++ translation unit, for Hub builds: kernel-builder's CMake project does not
// enable the C language, so it would skip the .c files (build.toml, [kernel.cpu_kernels]). setup.py
// compiles the .c files with the C compiler and does not build this file (it takes the .c and
// .cu files of kernel_src/ only). The C code is valid C++: its math calls take double arguments,
// so C++ overloads pick the same functions, and ltx_kernels.h declares the entry points extern
// "C".
#include "attention/attention_cpu.c"
#include "attention/attention_int8_cpu.c"
#include "attention/attention_quant_cpu.c"
#include "checks.c"
#include "gated_residual_cpu.c"
#include "gelu_cpu.c"
#include "norm_backward_cpu.c"
#include "norm_modulate_cpu.c"
#include "qk_norm_rope_backward_cpu.c"
#include "qk_norm_rope_cpu.c"
#include "quantize_cpu.c"
#include "rmsnorm_cpu.c"
