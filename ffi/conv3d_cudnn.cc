// conv3d handlers on cudnn_frontend graphs.
//
// Layout: x, y, dy, dx and the residual stay in XLA's row-major NDHWC buffers and the
// filter in [K][kt][kh][kw][C]; the graphs see them as cuDNN's [N,C,D,H,W] / [K,C,T,R,S]
// through strides, so nothing is transposed. Padding is given per side (pre/post), so
// causal padding is never materialized.
//
//   forward: y = act(conv(x, w) + bias + residual), with sum_k y^2 per pixel on request
//   dgrad:   dx = conv's transpose applied to dy;  wgrad: dw = sum over pixels of x dy

#include "conv3d_cudnn.h"

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/attributes.h"
#include "common/buffers.h"
#include "common/cudnn_runtime.h"
#include "common/errors.h"
#include "common/graph_utils.h"
#include "common/plan_cache.h"

namespace cudnn_jax {
namespace {

using Graph = fe::graph::Graph;
using TensorAttrs = fe::graph::Tensor_attributes;
using Tensor = std::shared_ptr<TensorAttrs>;

// Tensor uids: fixed per role, so one variant-pack layout serves every plan.
enum Uid : int64_t { kX = 1, kW, kBias, kResidual, kY, kSumsq, kDY, kDX, kDW };

const char* op_name(const Conv3dConfig& c) {
  switch (c.pass) {
    case Conv3dPass::kDgrad: return "conv3d_dgrad";
    case Conv3dPass::kWgrad: return "conv3d_wgrad";
    default: return "conv3d_fwd";
  }
}

std::string key_text(bool x) { return x ? "1" : "0"; }
std::string key_text(int32_t x) { return std::to_string(x); }
const std::string& key_text(const std::string& x) { return x; }

std::string cache_key(const Conv3dConfig& c, int device) {
  std::string key = std::string(op_name(c)) + "|dev" + std::to_string(device);
  for (ffi::DataType d : {c.dtype, c.out_dtype, c.residual_dtype}) key += "|" + dtype_name(d);
  for (int64_t d : {c.n, c.t, c.h, c.w, c.c, c.k, c.kt, c.kh, c.kw, c.ot, c.oh, c.ow}) {
    key += "|" + std::to_string(d);
  }
  visit_conv3d_attributes(c, [&](const char*, const auto& value) { key += "|" + key_text(value); });
  return key;
}

std::optional<fe::PointwiseMode_t> activation_mode(const std::string& name) {
  if (name == "silu") return fe::PointwiseMode_t::SWISH_FWD;  // beta 1: x * sigmoid(x)
  if (name == "gelu") return fe::PointwiseMode_t::GELU_FWD;   // erf form
  if (name == "relu") return fe::PointwiseMode_t::RELU_FWD;
  return std::nullopt;
}

// Checks that need no cuDNN: the reason this configuration cannot be served, or "".
std::string config_error(const Conv3dConfig& c) {
  auto half = [](ffi::DataType d) { return d == ffi::DataType::BF16 || d == ffi::DataType::F16; };
  auto io = [&](ffi::DataType d) { return half(d) || d == ffi::DataType::F32; };
  if (!half(c.dtype)) return "dtype: x and w bfloat16 or float16, got " + dtype_name(c.dtype);
  if (!io(c.out_dtype) || (c.has_residual && !io(c.residual_dtype))) {
    return "out_dtype, residual: bfloat16, float16 or float32";
  }
  for (int64_t d : {c.n, c.t, c.h, c.w, c.c, c.k, c.kt, c.kh, c.kw, c.ot, c.oh, c.ow}) {
    if (d <= 0) return "shapes: every extent must be positive";
  }
  for (int32_t p : {c.pad_t_lo, c.pad_t_hi, c.pad_h_lo, c.pad_h_hi, c.pad_w_lo, c.pad_w_hi}) {
    if (p < 0) return "padding: must be >= 0";
  }
  for (int32_t s : {c.stride_t, c.stride_h, c.stride_w, c.dilation_t, c.dilation_h,
                    c.dilation_w}) {
    if (s < 1) return "strides, dilation: must be >= 1";
  }
  auto out_extent = [](int64_t size, int32_t lo, int32_t hi, int64_t k, int32_t s, int32_t d) {
    return (size + lo + hi - d * (k - 1) - 1) / s + 1;
  };
  if (c.ot != out_extent(c.t, c.pad_t_lo, c.pad_t_hi, c.kt, c.stride_t, c.dilation_t) ||
      c.oh != out_extent(c.h, c.pad_h_lo, c.pad_h_hi, c.kh, c.stride_h, c.dilation_h) ||
      c.ow != out_extent(c.w, c.pad_w_lo, c.pad_w_hi, c.kw, c.stride_w, c.dilation_w)) {
    return "shapes: y's spatial dims do not follow from x, the filter, padding, strides and "
           "dilation";
  }
  if (c.activation != "none" && !activation_mode(c.activation)) {
    return "activation: none, silu, gelu or relu, got '" + c.activation + "'";
  }
  return "";
}

// [N,C,D,H,W] over NDHWC memory.
TensorAttrs ndhwc(const char* name, int64_t uid, int64_t n, int64_t c, int64_t d, int64_t h,
                  int64_t w, fe::DataType_t dtype) {
  return TensorAttrs().set_name(name).set_uid(uid).set_data_type(dtype)
      .set_dim({n, c, d, h, w}).set_stride({d * h * w * c, 1, h * w * c, w * c, c});
}

TensorAttrs input_view(const Conv3dConfig& c, const char* name, int64_t uid, fe::DataType_t t) {
  return ndhwc(name, uid, c.n, c.c, c.t, c.h, c.w, t);
}

TensorAttrs output_view(const Conv3dConfig& c, const char* name, int64_t uid,
                        fe::DataType_t t) {
  return ndhwc(name, uid, c.n, c.k, c.ot, c.oh, c.ow, t);
}

// [K,C,T,R,S] over [K][T][R][S][C] memory.
TensorAttrs filter_view(const Conv3dConfig& c, const char* name, int64_t uid, fe::DataType_t t) {
  return TensorAttrs().set_name(name).set_uid(uid).set_data_type(t)
      .set_dim({c.k, c.c, c.kt, c.kh, c.kw})
      .set_stride({c.kt * c.kh * c.kw * c.c, 1, c.kh * c.kw * c.c, c.kw * c.c, c.c});
}

template <typename Attrs>
Attrs geometry(Attrs attrs, const Conv3dConfig& c) {
  attrs.set_pre_padding({c.pad_t_lo, c.pad_h_lo, c.pad_w_lo})
      .set_post_padding({c.pad_t_hi, c.pad_h_hi, c.pad_w_hi})
      .set_stride({c.stride_t, c.stride_h, c.stride_w})
      .set_dilation({c.dilation_t, c.dilation_h, c.dilation_w})
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return attrs;
}

// Outputs written here get exactly the buffer's view (cuDNN would infer the same dims, but
// not necessarily these strides).
void as_output(Tensor& t, const TensorAttrs& view) {
  t->set_output(true).set_uid(view.get_uid()).set_name(view.get_name())
      .set_data_type(view.get_data_type()).set_dim(view.get_dim()).set_stride(view.get_stride());
}

fe::graph::Pointwise_attributes pointwise(const char* name, fe::PointwiseMode_t mode) {
  return fe::graph::Pointwise_attributes().set_name(name).set_mode(mode)
      .set_compute_data_type(fe::DataType_t::FLOAT);
}

void add_forward(Graph& graph, const Conv3dConfig& c, fe::DataType_t io) {
  namespace g = fe::graph;
  Tensor x = graph.tensor(input_view(c, "x", kX, io));
  Tensor w = graph.tensor(filter_view(c, "w", kW, io));
  Tensor y = graph.conv_fprop(x, w, geometry(g::Conv_fprop_attributes().set_name("conv"), c));
  if (c.has_bias) {
    Tensor bias = graph.tensor(TensorAttrs().set_name("bias").set_uid(kBias)
                                   .set_data_type(fe::DataType_t::FLOAT)
                                   .set_dim({1, c.k, 1, 1, 1}).set_stride({c.k, 1, c.k, c.k, c.k}));
    y = graph.pointwise(y, bias, pointwise("add_bias", fe::PointwiseMode_t::ADD));
  }
  if (c.has_residual) {
    Tensor residual = graph.tensor(
        output_view(c, "residual", kResidual, *to_cudnn_dtype(c.residual_dtype)));
    y = graph.pointwise(y, residual, pointwise("add_residual", fe::PointwiseMode_t::ADD));
  }
  if (auto mode = activation_mode(c.activation)) {
    y = graph.pointwise(y, pointwise("activation", *mode));
  }
  if (c.with_sumsq) {
    Tensor square = graph.pointwise(y, y, pointwise("square", fe::PointwiseMode_t::MUL));
    Tensor sumsq = graph.reduction(square, g::Reduction_attributes().set_name("sum_channels")
                                               .set_mode(fe::ReductionMode_t::ADD)
                                               .set_compute_data_type(fe::DataType_t::FLOAT));
    as_output(sumsq, ndhwc("sumsq", kSumsq, c.n, 1, c.ot, c.oh, c.ow, fe::DataType_t::FLOAT));
  }
  as_output(y, output_view(c, "y", kY, *to_cudnn_dtype(c.out_dtype)));
}

void add_dgrad(Graph& graph, const Conv3dConfig& c, fe::DataType_t io) {
  Tensor dy = graph.tensor(output_view(c, "dy", kDY, io));
  Tensor w = graph.tensor(filter_view(c, "w", kW, io));
  Tensor dx = graph.conv_dgrad(
      dy, w, geometry(fe::graph::Conv_dgrad_attributes().set_name("dgrad"), c));
  as_output(dx, input_view(c, "dx", kDX, io));
}

void add_wgrad(Graph& graph, const Conv3dConfig& c, fe::DataType_t io) {
  Tensor dy = graph.tensor(output_view(c, "dy", kDY, io));
  Tensor x = graph.tensor(input_view(c, "x", kX, io));
  Tensor dw = graph.conv_wgrad(
      dy, x, geometry(fe::graph::Conv_wgrad_attributes().set_name("wgrad"), c));
  as_output(dw, filter_view(c, "dw", kDW, io));
}

std::shared_ptr<CachedPlan> build_plan(const Conv3dConfig& c, int device, DeviceHandle& handle) {
  const std::optional<fe::DataType_t> io = to_cudnn_dtype(c.dtype);
  auto add = [&](Graph& graph) {
    switch (c.pass) {
      case Conv3dPass::kForward: add_forward(graph, c, *io); break;
      case Conv3dPass::kDgrad: add_dgrad(graph, c, *io); break;
      case Conv3dPass::kWgrad: add_wgrad(graph, c, *io); break;
    }
  };
  // Sums in float32 and in a fixed order: no plan that reduces in lower precision or
  // whose result depends on the order of atomic adds (a weight gradient could pick one).
  const std::vector<fe::NumericalNote_t> excluded = {
      fe::NumericalNote_t::REDUCED_PRECISION_REDUCTION, fe::NumericalNote_t::NONDETERMINISTIC};
  return build_cached_plan(op_name(c), config_error(c), device, handle, io, add, {}, excluded);
}

// Finds or builds the plan of `requested` on `device`; null with *error set on failure.
// The gradients ignore the forward's tail, so it does not tell their plans apart.
std::shared_ptr<CachedPlan> plan_for(const Conv3dConfig& requested, int device,
                                     DeviceHandle** handle, std::string* error) {
  Conv3dConfig c = requested;
  if (c.pass != Conv3dPass::kForward) {
    c.activation = "none";
    c.has_bias = c.has_residual = c.with_sumsq = false;
    c.out_dtype = c.residual_dtype = c.dtype;
  }
  return find_plan(op_name(c), cache_key(c, device), device, handle,
                   [&](DeviceHandle& h) { return build_plan(c, device, h); }, error);
}

// ---- argument decoding -------------------------------------------------------------

// The handler attributes (every one of CUDNN_JAX_CONV3D_ATTRIBUTES, nothing else) into `c`.
std::string decode_attributes(const ffi::Dictionary& attrs, Conv3dConfig* c) {
  std::string err = unexpected_attribute(attrs, kConv3dAttributeNames);
  visit_conv3d_attributes(*c, [&](const char* name, auto& field) {
    if (err.empty()) err = get_attribute(attrs, name, &field);
  });
  return err;
}

// Shapes of x [N,T,H,W,C] (or of dx) and y [N,T',H',W',K] (or of dy) into `c`.
std::string activation_shapes(const ffi::AnyBuffer& x, const ffi::AnyBuffer& y,
                              Conv3dConfig* c) {
  auto xd = x.dimensions(), yd = y.dimensions();
  if (xd.size() != 5 || yd.size() != 5) return "x and y must be rank 5 (NDHWC)";
  c->n = xd[0], c->t = xd[1], c->h = xd[2], c->w = xd[3], c->c = xd[4];
  c->ot = yd[1], c->oh = yd[2], c->ow = yd[3], c->k = yd[4];
  if (yd[0] != c->n) return "x and y: batch extents differ";
  return "";
}

// The filter's kernel extents into `c`, checking it is [K,kt,kh,kw,C] in `c.dtype`.
std::string filter_shape(const char* name, const ffi::AnyBuffer& w, Conv3dConfig* c) {
  auto wd = w.dimensions();
  if (wd.size() != 5) return std::string(name) + " must be rank 5 [K,kt,kh,kw,C]";
  c->kt = wd[1], c->kh = wd[2], c->kw = wd[3];
  return expect(name, w, c->dtype, {c->k, c->kt, c->kh, c->kw, c->c});
}

PlanLookup lookup_of(const Conv3dConfig& c) {
  return [c](int device, DeviceHandle** handle, std::string* error) {
    return plan_for(c, device, handle, error);
  };
}

ffi::Error run(const Conv3dConfig& c, cudaStream_t stream, ffi::AnyBuffer& workspace,
               std::unordered_map<int64_t, void*>& tensors,
               std::initializer_list<ffi::AnyBuffer*> outputs) {
  std::shared_ptr<CachedPlan> plan;
  DeviceHandle* handle = nullptr;
  if (ffi::Error e = plan_on_stream(op_name(c), stream, lookup_of(c), &plan, &handle);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = prefill(stream, op_name(c), false, outputs); e.failure()) return e;
  return run_plan(*plan, *handle, stream, workspace_of(workspace), tensors, op_name(c));
}

// ---- handlers ----------------------------------------------------------------------

ffi::Error conv3d_fwd(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                      ffi::RemainingArgs rest, ffi::Result<ffi::AnyBuffer> y,
                      ffi::Result<ffi::AnyBuffer> workspace, ffi::RemainingRets rest_rets,
                      ffi::Dictionary attrs) {
  return guarded("conv3d_fwd", [&]() -> ffi::Error {
    Conv3dConfig c;
    if (std::string err = decode_attributes(attrs, &c); !err.empty()) {
      return invalid_argument(stage_message("conv3d_fwd", "attributes", err));
    }
    c.dtype = x.element_type();
    c.out_dtype = y->element_type();
    std::string err = activation_shapes(x, *y, &c);
    if (err.empty()) err = filter_shape("w", w, &c);
    size_t want = (c.has_bias ? 1 : 0) + (c.has_residual ? 1 : 0);
    if (err.empty() && rest.size() != want) {
      err = "expected " + std::to_string(want) + " trailing arguments (bias, residual), got " +
            std::to_string(rest.size());
    }
    std::optional<ffi::AnyBuffer> bias, residual, sumsq;
    size_t next = 0;
    auto take = [&](std::optional<ffi::AnyBuffer>* slot) {
      auto arg = rest.get<ffi::AnyBuffer>(next++);
      if (arg.has_error()) return arg.error().message();
      *slot = *arg;
      return std::string();
    };
    if (err.empty() && c.has_bias && (err = take(&bias)).empty()) {
      err = expect("bias", *bias, ffi::DataType::F32, {c.k});
    }
    if (err.empty() && c.has_residual && (err = take(&residual)).empty()) {
      c.residual_dtype = residual->element_type();
      err = expect("residual", *residual, c.residual_dtype, {c.n, c.ot, c.oh, c.ow, c.k});
    }
    if (err.empty() && rest_rets.size() != (c.with_sumsq ? 1u : 0u)) {
      err = "expected " + std::to_string(c.with_sumsq ? 1 : 0) +
            " trailing results (sumsq), got " + std::to_string(rest_rets.size());
    }
    if (err.empty() && c.with_sumsq) {
      auto ret = rest_rets.get<ffi::AnyBuffer>(0);
      if (ret.has_error()) {
        err = ret.error().message();
      } else {
        sumsq = **ret;
        err = expect("sumsq", *sumsq, ffi::DataType::F32, {c.n, c.ot, c.oh, c.ow});
      }
    }
    if (!err.empty()) return invalid_argument(stage_message("conv3d_fwd", "arguments", err));

    std::unordered_map<int64_t, void*> tensors = {
        {kX, x.untyped_data()}, {kW, w.untyped_data()}, {kY, y->untyped_data()}};
    if (bias) tensors[kBias] = bias->untyped_data();
    if (residual) tensors[kResidual] = residual->untyped_data();
    if (sumsq) tensors[kSumsq] = sumsq->untyped_data();
    return run(c, stream, *workspace, tensors, {&*y, sumsq ? &*sumsq : nullptr});
  });
}

ffi::Error conv3d_dgrad(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer w,
                        ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> workspace,
                        ffi::Dictionary attrs) {
  return guarded("conv3d_dgrad", [&]() -> ffi::Error {
    Conv3dConfig c;
    c.pass = Conv3dPass::kDgrad;
    if (std::string err = decode_attributes(attrs, &c); !err.empty()) {
      return invalid_argument(stage_message("conv3d_dgrad", "attributes", err));
    }
    c.dtype = dy.element_type();
    std::string err = activation_shapes(*dx, dy, &c);
    if (err.empty()) err = filter_shape("w", w, &c);
    if (err.empty()) err = expect("dx", *dx, c.dtype, {c.n, c.t, c.h, c.w, c.c});
    if (!err.empty()) return invalid_argument(stage_message("conv3d_dgrad", "arguments", err));
    std::unordered_map<int64_t, void*> tensors = {
        {kDY, dy.untyped_data()}, {kW, w.untyped_data()}, {kDX, dx->untyped_data()}};
    return run(c, stream, *workspace, tensors, {&*dx});
  });
}

ffi::Error conv3d_wgrad(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer dy,
                        ffi::Result<ffi::AnyBuffer> dw, ffi::Result<ffi::AnyBuffer> workspace,
                        ffi::Dictionary attrs) {
  return guarded("conv3d_wgrad", [&]() -> ffi::Error {
    Conv3dConfig c;
    c.pass = Conv3dPass::kWgrad;
    if (std::string err = decode_attributes(attrs, &c); !err.empty()) {
      return invalid_argument(stage_message("conv3d_wgrad", "attributes", err));
    }
    c.dtype = x.element_type();
    std::string err = activation_shapes(x, dy, &c);
    if (err.empty()) err = expect("dy", dy, c.dtype, {c.n, c.ot, c.oh, c.ow, c.k});
    if (err.empty()) err = filter_shape("dw", *dw, &c);
    if (!err.empty()) return invalid_argument(stage_message("conv3d_wgrad", "arguments", err));
    std::unordered_map<int64_t, void*> tensors = {
        {kX, x.untyped_data()}, {kDY, dy.untyped_data()}, {kDW, dw->untyped_data()}};
    return run(c, stream, *workspace, tensors, {&*dw});
  });
}

}  // namespace

std::string conv3d_check(const Conv3dConfig& config) {
  return plan_check(op_name(config), lookup_of(config));
}

int64_t conv3d_workspace(const Conv3dConfig& config, std::string* error) {
  return plan_workspace_bytes(op_name(config), lookup_of(config), error);
}

}  // namespace cudnn_jax

namespace ffi = xla::ffi;
using Stream = ffi::PlatformStream<cudaStream_t>;

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudnnJaxConv3dFwd, cudnn_jax::conv3d_fwd,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w [K,kt,kh,kw,C]
                                  .RemainingArgs()        // [bias], [residual]
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Ret<ffi::AnyBuffer>()  // workspace (u8)
                                  .RemainingRets()        // [sumsq]
                                  .Attrs(),               // CUDNN_JAX_CONV3D_ATTRIBUTES
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudnnJaxConv3dDgrad, cudnn_jax::conv3d_dgrad,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // w [K,kt,kh,kw,C]
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Ret<ffi::AnyBuffer>()  // workspace (u8)
                                  .Attrs(),               // CUDNN_JAX_CONV3D_ATTRIBUTES
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudnnJaxConv3dWgrad, cudnn_jax::conv3d_wgrad,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Ret<ffi::AnyBuffer>()  // dw [K,kt,kh,kw,C]
                                  .Ret<ffi::AnyBuffer>()  // workspace (u8)
                                  .Attrs(),               // CUDNN_JAX_CONV3D_ATTRIBUTES
                              {ffi::Traits::kCmdBufferCompatible});
