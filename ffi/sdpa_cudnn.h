// Scaled dot-product attention on cuDNN's fused flash-attention graph (see README.md).
#pragma once

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

// The attributes of the SDPA handlers, declared once as X(name, C++ type, default). Both
// handlers take all of them (the forward ignores has_dbias; the backward ignores with_lse,
// it always reads lse), and so does the config dict of sdpa_check / sdpa_workspace.
// SdpaConfig's fields, the decoding of both, the plan cache key and
// _ffi.handler_attributes() derive from this list.
#define CUDNN_JAX_SDPA_ATTRIBUTES(X)                                                    \
  X(scale, float, 1.f)          /* logit scale */                                      \
  X(causal, bool, false)        /* keep u <= t (shifted under bottom_right) */         \
  X(bottom_right, bool, false)  /* align the diagonal bottom-right */                  \
  X(window_left, int32_t, -1)   /* keep u >= t - window_left; -1: unbounded */         \
  X(window_right, int32_t, -1)  /* keep u <= t + window_right; -1: unbounded */        \
  X(softcap, float, 0.f)        /* s = c * tanh(s / c) when c > 0; 0: off */           \
  X(has_bias, bool, false)      /* a bias argument follows */                          \
  X(has_padding, bool, false)   /* q_lens, kv_lens arguments follow */                 \
  X(has_dbias, bool, false)     /* backward: a dbias result follows */                 \
  X(with_lse, bool, true)       /* forward: an lse result follows (else no stats) */   \
  X(packed_max_q, int32_t, 0)   /* > 0: q/out rows packed [Tq,N,H], offsets follow */  \
  X(packed_max_kv, int32_t, 0)  /* > 0: k/v rows packed [Tk,K,H] */                    \
  X(paged, bool, false)         /* forward: k/v caches [P,page,K,H], a page table */   \
  X(has_sinks, bool, false)     /* forward: a sinks argument [N] float32 follows */   \
  X(dropout, float, 0.f)        /* > 0: drop probabilities; seed, offset follow */

namespace cudnn_jax {

// Everything a cached SDPA plan depends on, apart from the device.
struct SdpaConfig {
#define CUDNN_JAX_SDPA_FIELD(name, type, init) type name = init;
  CUDNN_JAX_SDPA_ATTRIBUTES(CUDNN_JAX_SDPA_FIELD)
#undef CUDNN_JAX_SDPA_FIELD
  bool backward = false;
  xla::ffi::DataType dtype = xla::ffi::DataType::BF16;
  int64_t b = 0, t = 0, s = 0, n = 0, k = 0, h = 0, hv = 0;
  int64_t bias_b = 0, bias_n = 0;  // 0 when there is no bias
  int64_t pages = 0, page = 0;      // paged: the caches' page count and page size
  int64_t rows_q = 0, rows_kv = 0;  // packed: the buffers' rows (not part of a plan)
  bool packed() const { return packed_max_q > 0; }
};

// The attribute names, in the list's order.
inline constexpr const char* kSdpaAttributeNames[] = {
#define CUDNN_JAX_SDPA_NAME(name, type, init) #name,
    CUDNN_JAX_SDPA_ATTRIBUTES(CUDNN_JAX_SDPA_NAME)
#undef CUDNN_JAX_SDPA_NAME
};

// Calls visit(name, field) for each attribute field of `config`, in the list's order.
template <typename Config, typename Visit>
void visit_sdpa_attributes(Config& config, Visit&& visit) {
#define CUDNN_JAX_SDPA_VISIT(name, type, init) visit(#name, config.name);
  CUDNN_JAX_SDPA_ATTRIBUTES(CUDNN_JAX_SDPA_VISIT)
#undef CUDNN_JAX_SDPA_VISIT
}

// Reads every attribute into `config` with get(name, &field), which returns "" or what is
// wrong with that attribute; returns the first such error, or "".
template <typename Get>
std::string decode_sdpa_attributes(Get&& get, SdpaConfig* config) {
  std::string err;
  visit_sdpa_attributes(*config, [&](const char* name, auto& field) {
    if (err.empty()) err = get(name, &field);
  });
  return err;
}

// Builds (or finds) the plan for `config` on the current device. Returns "" when cuDNN can
// serve it, else the reason, naming the stage that failed.
std::string sdpa_check(const SdpaConfig& config);

// Bytes of the handlers' workspace result for `config`; -1 with *error set when cuDNN
// cannot serve it.
int64_t sdpa_workspace(const SdpaConfig& config, std::string* error);

}  // namespace cudnn_jax

XLA_FFI_DECLARE_HANDLER_SYMBOL(CudnnJaxSdpaFwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CudnnJaxSdpaBwd);
