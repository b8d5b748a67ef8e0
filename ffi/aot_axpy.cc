// cudnn_jax_aot_axpy: out = alpha * x + y on float32 vectors, through the ahead-of-time
// compiled CuTe DSL kernel aot_axpy_f32 (kernels/selftest_sm90.py). It exists to prove the
// AOT path on a machine: object linked in, cubin loaded, launched on XLA's stream.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <limits>
#include <string>

#include "aot_kernels_ffi.h"
#include "aot_kernels.h"
#include "common/aot_module.h"
#include "common/buffers.h"
#include "common/errors.h"
#include "xla/ffi/api/ffi.h"

namespace cudnn_jax {
namespace {

ffi::Error aot_axpy(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> y,
                    ffi::ResultBuffer<ffi::F32> out, float alpha) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  if (y.element_count() != x.element_count() || out->element_count() != x.element_count()) {
    return invalid_argument(stage_message("aot_axpy", "arguments", "x, y, out differ in size"));
  }
  if (n > std::numeric_limits<int32_t>::max()) {
    return invalid_argument(stage_message("aot_axpy", "arguments", "more than 2^31-1 elements"));
  }
  if (n == 0) return ffi::Error::Success();
  if (poison_outputs()) {
    ffi::Error e = fill_bytes(stream, "aot_axpy", 0xFF, out->typed_data(), out->size_bytes());
    if (e.failure()) return e;
  }
  auto* module = loaded_module(aot_axpy_f32_Kernel_Module_Load);
  const int32_t len = static_cast<int32_t>(n);
  aot_axpy_f32_Tensor_x_t tx{x.typed_data(), {len}};
  aot_axpy_f32_Tensor_y_t ty{y.typed_data(), {len}};
  aot_axpy_f32_Tensor_out_t tout{out->typed_data(), {len}};
  int32_t err = cute_dsl_aot_axpy_f32_wrapper(module, &tx, &ty, &tout, alpha, stream);
  if (err != 0) {
    return internal_error(stage_message("aot_axpy", "launch",
                                        cudaGetErrorString(static_cast<cudaError_t>(err))));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cudnn_jax

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudnnJaxAotAxpy, cudnn_jax::aot_axpy,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<float>("alpha"));
