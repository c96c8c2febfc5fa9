// Op-library registration macros, the same as the registration.h that kernel-builder generates
// (templates/torch/registration.h) but under our own name, which kernel-builder never writes:
// TORCH_LIBRARY_EXPAND expands a macro namespace name, and REGISTER_EXTENSION gives the module an
// (empty) Python init so that importing it loads the library and runs its registrations.
#pragma once

#include <Python.h>

#define _LTX_CONCAT(A, B) A##B
#define CONCAT(A, B) _LTX_CONCAT(A, B)
#define _LTX_STRINGIFY(A) #A
#define STRINGIFY(A) _LTX_STRINGIFY(A)

// The op namespace: kernel-builder gives it the (versioned) extension name; the setuptools build
// names it `ltx_kernels`.
#ifndef LTX_OPS_NAMESPACE
#define LTX_OPS_NAMESPACE TORCH_EXTENSION_NAME
#endif

// Expand NAME before handing it to TORCH_LIBRARY / TORCH_LIBRARY_IMPL.
#define TORCH_LIBRARY_EXPAND(NAME, MODULE) TORCH_LIBRARY(NAME, MODULE)
#define TORCH_LIBRARY_IMPL_EXPAND(NAME, DEVICE, MODULE) TORCH_LIBRARY_IMPL(NAME, DEVICE, MODULE)

#define REGISTER_EXTENSION(NAME)                                                            \
  PyMODINIT_FUNC CONCAT(PyInit_, NAME)() {                                                  \
    static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, STRINGIFY(NAME), nullptr, 0, \
                                        nullptr};                                           \
    return PyModule_Create(&module);                                                        \
  }
