// FFI handlers around ahead-of-time compiled CuTe DSL kernels (built only when
// CUDNN_JAX_HAVE_AOT_KERNELS: kernels/aot.py ran, or CUDNN_JAX_KERNELS_DIR was given).
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(CudnnJaxAotAxpy);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CudnnJaxCuteGroupedGemm);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CudnnJaxCuteGroupedWgrad);
