// Scaled dot-product attention on cuDNN's fused flash-attention graph (see README.md).
#pragma once

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace cudnn_jax {

// Everything a cached SDPA plan depends on, apart from the device.
struct SdpaConfig {
  bool backward = false;
  xla::ffi::DataType dtype = xla::ffi::DataType::BF16;
  int64_t b = 0, t = 0, s = 0, n = 0, k = 0, h = 0, hv = 0;
  int64_t bias_b = 0, bias_n = 0;  // 0 when there is no bias
  float scale = 1.f;
  bool causal = false;
  bool bottom_right = false;
  int32_t window_left = -1;
  int32_t window_right = -1;
  float softcap = 0.f;
  bool has_bias = false;
  bool has_padding = false;
  bool has_dbias = false;
  bool with_lse = true;  // forward: write the stats; without them cuDNN runs inference
};

// Builds (or finds) the plan for `config` on the current device. Returns "" when cuDNN can
// serve it, else the reason, naming the stage that failed.
std::string sdpa_check(const SdpaConfig& config);

// Bytes of the handlers' workspace result for `config`; -1 with *error set when cuDNN
// cannot serve it.
int64_t sdpa_workspace(const SdpaConfig& config, std::string* error);

}  // namespace cudnn_jax

XLA_FFI_DECLARE_HANDLER_SYMBOL(CudnnJaxSdpaFwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CudnnJaxSdpaBwd);
