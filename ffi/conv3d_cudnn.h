// 3-D convolution (channels last) on cuDNN graphs: the forward with its pointwise tail, the
// data gradient and the weight gradient (see README.md).
#pragma once

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

// The attributes of the conv3d handlers, declared once as X(name, C++ type, default). All
// three handlers take all of them (the gradients ignore the forward's tail: activation,
// has_bias, has_residual, with_sumsq), and so does the config dict of conv3d_check /
// conv3d_workspace. Conv3dConfig's fields, their decoding, the plan cache key and
// _ffi.handler_attributes() derive from this list.
#define CUDNN_JAX_CONV3D_ATTRIBUTES(X)                                                  \
  X(pad_t_lo, int32_t, 0)  /* zeros before / after each spatial dim of x */            \
  X(pad_t_hi, int32_t, 0)                                                               \
  X(pad_h_lo, int32_t, 0)                                                               \
  X(pad_h_hi, int32_t, 0)                                                               \
  X(pad_w_lo, int32_t, 0)                                                               \
  X(pad_w_hi, int32_t, 0)                                                               \
  X(stride_t, int32_t, 1)                                                               \
  X(stride_h, int32_t, 1)                                                               \
  X(stride_w, int32_t, 1)                                                               \
  X(dilation_t, int32_t, 1)                                                             \
  X(dilation_h, int32_t, 1)                                                             \
  X(dilation_w, int32_t, 1)                                                             \
  X(activation, std::string, "none") /* none, silu, gelu (erf), relu: on the output */  \
  X(has_bias, bool, false)           /* a bias argument [K] float32 follows */          \
  X(has_residual, bool, false)       /* a residual argument shaped like y follows */    \
  X(with_sumsq, bool, false)         /* a result [N,T',H',W'] f32: sum_k y^2 */

namespace cudnn_jax {

enum class Conv3dPass { kForward, kDgrad, kWgrad };

// Everything a cached conv3d plan depends on, apart from the device.
//   forward: x [N,T,H,W,C], w [K,kt,kh,kw,C] -> y [N,T',H',W',K] (out_dtype)
//   dgrad:   dy [N,T',H',W',K], w -> dx [N,T,H,W,C];  wgrad: x, dy -> dw [K,kt,kh,kw,C]
struct Conv3dConfig {
#define CUDNN_JAX_CONV3D_FIELD(name, type, init) type name = init;
  CUDNN_JAX_CONV3D_ATTRIBUTES(CUDNN_JAX_CONV3D_FIELD)
#undef CUDNN_JAX_CONV3D_FIELD
  Conv3dPass pass = Conv3dPass::kForward;
  xla::ffi::DataType dtype = xla::ffi::DataType::BF16;           // x, w, dy, dx, dw
  xla::ffi::DataType out_dtype = xla::ffi::DataType::BF16;       // the forward's y
  xla::ffi::DataType residual_dtype = xla::ffi::DataType::BF16;  // with has_residual
  int64_t n = 0, t = 0, h = 0, w = 0, c = 0;  // x
  int64_t k = 0, kt = 0, kh = 0, kw = 0;      // filter
  int64_t ot = 0, oh = 0, ow = 0;             // y's spatial dims
};

// The attribute names, in the list's order.
inline constexpr const char* kConv3dAttributeNames[] = {
#define CUDNN_JAX_CONV3D_NAME(name, type, init) #name,
    CUDNN_JAX_CONV3D_ATTRIBUTES(CUDNN_JAX_CONV3D_NAME)
#undef CUDNN_JAX_CONV3D_NAME
};

// Calls visit(name, field) for each attribute field of `config`, in the list's order.
template <typename Config, typename Visit>
void visit_conv3d_attributes(Config& config, Visit&& visit) {
#define CUDNN_JAX_CONV3D_VISIT(name, type, init) visit(#name, config.name);
  CUDNN_JAX_CONV3D_ATTRIBUTES(CUDNN_JAX_CONV3D_VISIT)
#undef CUDNN_JAX_CONV3D_VISIT
}

// Builds (or finds) the plan for `config` on the current device: "" when cuDNN can serve
// it, else the reason, naming the stage that failed.
std::string conv3d_check(const Conv3dConfig& config);

// Bytes of the handler's workspace result for `config`; -1 with *error set when cuDNN
// cannot serve it.
int64_t conv3d_workspace(const Conv3dConfig& config, std::string* error);

}  // namespace cudnn_jax

XLA_FFI_DECLARE_HANDLER_SYMBOL(CudnnJaxConv3dFwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CudnnJaxConv3dDgrad);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CudnnJaxConv3dWgrad);
