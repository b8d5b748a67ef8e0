// cuDNN at run time: the shared library (loaded once per process, preferring the copy
// JAX already loaded) and one cudnnHandle_t per CUDA device.
#pragma once

#include <cuda_runtime_api.h>
#include <cudnn.h>

#include <mutex>
#include <string>

namespace cudnn_jax {

// Loads libcudnn and points cudnn_frontend at it. Idempotent and thread-safe.
// Returns "" on success, else why it failed (the same message on every later call).
const std::string& load_cudnn();

// Version of the loaded libcudnn (e.g. 91900), 0 when it cannot be loaded.
int cudnn_runtime_version();

// The calling thread's current CUDA device, or -1 with *error set.
int current_device(std::string* error);

// Compute capability as major*10+minor (90 for H100/H200), or -1 with *error set.
int sm_version(int device, std::string* error);

// A cuDNN handle bound to one device. Hold `mu` while setting the stream and using it:
// a handle must not be used by two threads at once.
struct DeviceHandle {
  cudnnHandle_t handle = nullptr;
  std::mutex mu;
};

// The handle of `device`, created on first use; nullptr with *error set on failure.
DeviceHandle* device_handle(int device, std::string* error);

// cudnnSetStream through the dynamically loaded library; "" on success.
std::string set_handle_stream(DeviceHandle& h, cudaStream_t stream);

}  // namespace cudnn_jax
