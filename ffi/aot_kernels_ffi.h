// FFI handlers around ahead-of-time compiled CuTe DSL kernels (built only when
// CUDNN_JAX_HAVE_AOT_KERNELS: kernels/aot.py ran, or CUDNN_JAX_KERNELS_DIR was given).
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace cudnn_jax {

// The one attribute of cudnn_jax_cute_grouped_gemm: the epilogue's name, one of
// kernel_constants::grouped_gemm::epilogues.
inline constexpr char kCuteGroupedGemmEpilogue[] = "epilogue";
// The attributes of cudnn_jax_bsa_fwd and cudnn_jax_bsa_bwd.
inline constexpr const char* kBsaAttributeNames[] = {"block_size", "scale", "mask"};

}  // namespace cudnn_jax

XLA_FFI_DECLARE_HANDLER_SYMBOL(CudnnJaxCuteGroupedGemm);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CudnnJaxCuteGroupedWgrad);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CudnnJaxBsaFwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CudnnJaxBsaBwd);

// Bytes of cudnn_jax_bsa_bwd's workspace result (ffi/aot_bsa.cc).
int64_t cudnn_jax_bsa_bwd_workspace_bytes(int64_t b, int64_t n, int64_t sq, int64_t skv,
                                          int64_t c, int64_t block_size);
