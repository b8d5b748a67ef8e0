// FFI handlers around ahead-of-time compiled CuTe DSL kernels (built only when
// CUDNN_JAX_HAVE_AOT_KERNELS: kernels/aot.py ran, or CUDNN_JAX_KERNELS_DIR was given).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace cudnn_jax {

// The one attribute of cudnn_jax_cute_grouped_gemm: the epilogue's name, one of
// kernel_constants::grouped_gemm::epilogues.
inline constexpr char kCuteGroupedGemmEpilogue[] = "epilogue";

}  // namespace cudnn_jax

XLA_FFI_DECLARE_HANDLER_SYMBOL(CudnnJaxCuteGroupedGemm);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CudnnJaxCuteGroupedWgrad);
