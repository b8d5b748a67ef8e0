// Filling XLA-owned result buffers on XLA's stream (asynchronous, no host sync).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <initializer_list>

#include "common/errors.h"

namespace cudnn_jax {

// CUDNN_JAX_POISON_OUTPUTS=1 fills every result with 0xFF bytes (NaN in every float type)
// before a plan runs, so a test sees any element a kernel leaves unwritten.
inline bool poison_outputs() {
  static const bool enabled = [] {
    const char* env = std::getenv("CUDNN_JAX_POISON_OUTPUTS");
    return env != nullptr && env[0] != '\0' && env[0] != '0';
  }();
  return enabled;
}

// Sets `bytes` bytes at `data` to `value`; `op` names the caller in errors.
inline ffi::Error fill_bytes(cudaStream_t stream, const char* op, int value, void* data,
                             size_t bytes) {
  if (cudaError_t err = cudaMemsetAsync(data, value, bytes, stream); err != cudaSuccess) {
    return internal_error(stage_message(op, "fill", cudaGetErrorString(err)));
  }
  return ffi::Error::Success();
}

// Sets every byte of `outputs` (null entries skipped) to `value`.
inline ffi::Error fill_bytes(cudaStream_t stream, const char* op, int value,
                             std::initializer_list<ffi::AnyBuffer*> outputs) {
  for (ffi::AnyBuffer* buf : outputs) {
    if (buf == nullptr) continue;
    ffi::Error e = fill_bytes(stream, op, value, buf->untyped_data(), buf->size_bytes());
    if (e.failure()) return e;
  }
  return ffi::Error::Success();
}

// Results a plan writes only in part start from zero (`zero_rest`); the others are poisoned
// when CUDNN_JAX_POISON_OUTPUTS is set.
inline ffi::Error prefill(cudaStream_t stream, const char* op, bool zero_rest,
                          std::initializer_list<ffi::AnyBuffer*> outputs) {
  if (zero_rest) return fill_bytes(stream, op, 0, outputs);
  if (poison_outputs()) return fill_bytes(stream, op, 0xFF, outputs);
  return ffi::Error::Success();
}

}  // namespace cudnn_jax
