// FP8 scaled dot-product attention on cuDNN's fused FP8 flash-attention graphs
// (cudnn_frontend Graph::sdpa_fp8 / sdpa_fp8_backward; see README.md).
#pragma once

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

// The attributes of the FP8 SDPA handlers, declared once as X(name, C++ type, default).
// Both handlers take all of them, and so does the config dict of sdpa_fp8_check /
// sdpa_fp8_workspace. SdpaFp8Config's fields, the decoding of both, the plan cache key and
// _ffi.handler_attributes() derive from this list (Python: primitives/sdpa_fp8.py's
// Fp8Config fields marked as attributes).
#define CUDNN_JAX_SDPA_FP8_ATTRIBUTES(X)                                                \
  X(scale, float, 1.f)          /* logit scale */                                      \
  X(causal, bool, false)        /* keep u <= t (shifted under bottom_right) */         \
  X(bottom_right, bool, false)  /* align the diagonal bottom-right */                  \
  X(window_left, int32_t, -1)   /* keep u >= t - window_left; -1: unbounded */         \
  X(window_right, int32_t, -1)  /* keep u <= t + window_right; -1: unbounded */        \
  X(has_padding, bool, false)   /* q_lens, kv_lens arguments follow the scales */

namespace cudnn_jax {

// Everything a cached FP8 SDPA plan depends on, apart from the device. q, k, v are e4m3;
// the forward's out is `out_dtype`; the backward reads o as e4m3 and dout as e5m2 and
// writes bf16 gradients.
struct SdpaFp8Config {
#define CUDNN_JAX_SDPA_FP8_FIELD(name, type, init) type name = init;
  CUDNN_JAX_SDPA_FP8_ATTRIBUTES(CUDNN_JAX_SDPA_FP8_FIELD)
#undef CUDNN_JAX_SDPA_FP8_FIELD
  bool backward = false;
  xla::ffi::DataType out_dtype = xla::ffi::DataType::F8E4M3FN;
  int64_t b = 0, t = 0, s = 0, n = 0, k = 0, h = 0, hv = 0;
};

// The attribute names, in the list's order.
inline constexpr const char* kSdpaFp8AttributeNames[] = {
#define CUDNN_JAX_SDPA_FP8_NAME(name, type, init) #name,
    CUDNN_JAX_SDPA_FP8_ATTRIBUTES(CUDNN_JAX_SDPA_FP8_NAME)
#undef CUDNN_JAX_SDPA_FP8_NAME
};

// Calls visit(name, field) for each attribute field of `config`, in the list's order.
template <typename Config, typename Visit>
void visit_sdpa_fp8_attributes(Config& config, Visit&& visit) {
#define CUDNN_JAX_SDPA_FP8_VISIT(name, type, init) visit(#name, config.name);
  CUDNN_JAX_SDPA_FP8_ATTRIBUTES(CUDNN_JAX_SDPA_FP8_VISIT)
#undef CUDNN_JAX_SDPA_FP8_VISIT
}

// The out dtype named as NumPy does ("float8_e4m3fn", "bfloat16", "float16", "float32");
// false for any other name.
bool sdpa_fp8_out_dtype(const std::string& name, xla::ffi::DataType* dtype);

// Builds (or finds) the plan for `config` on the current device. Returns "" when cuDNN can
// serve it, else the reason, naming the stage that failed.
std::string sdpa_fp8_check(const SdpaFp8Config& config);

// Bytes of the handlers' workspace result for `config` (the plan's workspace and a small
// scratch for the amax values the op does not return); -1 with *error set when cuDNN
// cannot serve it.
int64_t sdpa_fp8_workspace(const SdpaFp8Config& config, std::string* error);

}  // namespace cudnn_jax

XLA_FFI_DECLARE_HANDLER_SYMBOL(CudnnJaxSdpaFp8Fwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CudnnJaxSdpaFp8Bwd);
