#include "common/cudnn_runtime.h"

#include <dlfcn.h>

#include <cstdlib>
#include <map>
#include <memory>

// cudnn_frontend is built with NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING: it resolves every
// cuDNN symbol through this handle, which must be set before its first cuDNN call.
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace cudnn_jax {
namespace {

constexpr const char* kCudnnLib = "libcudnn.so.9";

std::string open_cudnn() {
  // The frontend also dlopens cudart and would prefer .so.12 when both majors are present;
  // JAX's CUDA 13 plugin loads .so.13. A user's explicit setting wins (overwrite = 0).
  setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", "libcudart.so.13", 0);
  // Reuse the libcudnn JAX already loaded, so the process has a single cuDNN.
  void* lib = dlopen(kCudnnLib, RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) lib = dlopen(kCudnnLib, RTLD_NOW);
  if (lib == nullptr) {
    const char* why = dlerror();
    return std::string("cannot load ") + kCudnnLib + ": " + (why ? why : "unknown error");
  }
  cudnn_frontend::cudnn_dlhandle = lib;
  return "";
}

template <typename Fn>
Fn* symbol(const char* name) {
  if (!load_cudnn().empty()) return nullptr;
  return reinterpret_cast<Fn*>(dlsym(cudnn_frontend::cudnn_dlhandle, name));
}

std::string cudnn_status_text(cudnnStatus_t status) {
  static auto* get_error_string = symbol<decltype(cudnnGetErrorString)>("cudnnGetErrorString");
  if (get_error_string != nullptr) return get_error_string(status);
  return "cudnnStatus_t " + std::to_string(static_cast<int>(status));
}

std::string cuda_text(cudaError_t err) { return cudaGetErrorString(err); }

}  // namespace

const std::string& load_cudnn() {
  static const std::string error = open_cudnn();
  return error;
}

int cudnn_runtime_version() {
  static auto* get_version = symbol<decltype(cudnnGetVersion)>("cudnnGetVersion");
  return get_version ? static_cast<int>(get_version()) : 0;
}

int current_device(std::string* error) {
  int device = -1;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) {
    *error = "cudaGetDevice: " + cuda_text(err);
    return -1;
  }
  return device;
}

int sm_version(int device, std::string* error) {
  int major = 0, minor = 0;
  cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  }
  if (err != cudaSuccess) {
    *error = "cudaDeviceGetAttribute: " + cuda_text(err);
    return -1;
  }
  return major * 10 + minor;
}

DeviceHandle* device_handle(int device, std::string* error) {
  // Handles live for the whole process: XLA may call in until exit, and destroying a
  // handle during static destruction races with the CUDA runtime's own teardown.
  static std::mutex mu;
  static auto& handles = *new std::map<int, std::unique_ptr<DeviceHandle>>;
  if (const std::string& why = load_cudnn(); !why.empty()) {
    *error = why;
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = handles[device];
  if (slot) return slot.get();

  static auto* create = symbol<decltype(cudnnCreate)>("cudnnCreate");
  if (create == nullptr) {
    *error = "cudnnCreate not found in " + std::string(kCudnnLib);
    return nullptr;
  }
  int previous = -1;
  cudaGetDevice(&previous);
  if (previous != device) cudaSetDevice(device);
  auto h = std::make_unique<DeviceHandle>();
  cudnnStatus_t status = create(&h->handle);
  if (previous != device && previous >= 0) cudaSetDevice(previous);
  if (status != CUDNN_STATUS_SUCCESS) {
    *error = "cudnnCreate: " + cudnn_status_text(status);
    return nullptr;
  }
  slot = std::move(h);
  return slot.get();
}

std::string set_handle_stream(DeviceHandle& h, cudaStream_t stream) {
  static auto* set_stream = symbol<decltype(cudnnSetStream)>("cudnnSetStream");
  if (set_stream == nullptr) return "cudnnSetStream not found in " + std::string(kCudnnLib);
  cudnnStatus_t status = set_stream(h.handle, stream);
  if (status != CUDNN_STATUS_SUCCESS) return "cudnnSetStream: " + cudnn_status_text(status);
  return "";
}

}  // namespace cudnn_jax
