// FP8 SDPA forward/backward handlers on cudnn_frontend's FP8 fused attention graphs.
//
// Layout: q/k/v/out stay in XLA's row-major BSHD buffers, seen by the graph as
// [B, heads, seq, dim] through strides. Stats (the log-sum-exp) is [B, N, T, 1] float32, the
// lse buffer [B, N, T]. Every scale and descale is a float32 scalar operand, a [1,1,1,1]
// tensor of the graph. The forward's amax result is [B, N]: cuDNN writes the call's amax
// into its first entry, which is then copied into the others, so that each batch and head
// shard of a partitioned call holds its own shard's amax. The amax values the op does not
// return (of the probabilities, of the gradients) go to a scratch at the end of the
// workspace result.

#include "sdpa_fp8_cudnn.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
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
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kSeqLenQ, kSeqLenKv, kDO, kDQ, kDK, kDV,
  kAmaxO, kAmaxS, kAmaxDQ, kAmaxDK, kAmaxDV, kAmaxDP,
  // The scale operands, in the handlers' argument order (forward, then backward).
  kDescaleQ, kDescaleK, kDescaleV, kDescaleS, kScaleS, kScaleO,
  kDescaleO, kDescaleDO, kDescaleDP, kScaleDQ, kScaleDK, kScaleDV, kScaleDP,
};

// The scale operands of each handler, in argument order (see README.md).
constexpr Uid kFwdScales[] = {kDescaleQ, kDescaleK, kDescaleV, kDescaleS, kScaleS, kScaleO};
constexpr Uid kBwdScales[] = {kDescaleQ, kDescaleK, kDescaleV, kDescaleO, kDescaleDO, kDescaleS,
                              kDescaleDP, kScaleS, kScaleDQ, kScaleDK, kScaleDV, kScaleDP};
constexpr size_t kFwdScaleCount = std::size(kFwdScales);
constexpr size_t kBwdScaleCount = std::size(kBwdScales);

// The scratch at the end of the workspace result: one 16-byte slot per unreturned amax.
constexpr int64_t kScratchBytes = 256;
constexpr int64_t kScratchSlot = 16;

const char* op_name(const SdpaFp8Config& c) {
  return c.backward ? "sdpa_fp8_bwd" : "sdpa_fp8_fwd";
}

std::string fp8_dtype_name(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    case ffi::DataType::F8E5M2: return "float8_e5m2";
    default: return dtype_name(dtype);
  }
}

std::string key_text(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return std::to_string(bits);
}
std::string key_text(bool x) { return x ? "1" : "0"; }
std::string key_text(int32_t x) { return std::to_string(x); }

std::string cache_key(const SdpaFp8Config& c, int device) {
  std::string key = std::string(op_name(c)) + "|dev" + std::to_string(device) + "|" +
                    fp8_dtype_name(c.out_dtype);
  for (int64_t d : {c.b, c.t, c.s, c.n, c.k, c.h, c.hv}) key += "|" + std::to_string(d);
  visit_sdpa_fp8_attributes(c, [&](const char*, const auto& v) { key += "|" + key_text(v); });
  return key;
}

// Checks that need no cuDNN: the reason this configuration cannot be served, or "".
std::string config_error(const SdpaFp8Config& c) {
  if (!to_cudnn_dtype(c.out_dtype)) return "out dtype: not a cuDNN type";
  if (c.b <= 0 || c.t <= 0 || c.s <= 0 || c.n <= 0 || c.k <= 0 || c.h <= 0 || c.hv <= 0) {
    return "shapes: every extent must be positive";
  }
  if (c.n % c.k != 0) return "heads: query heads must be a multiple of key/value heads";
  if (c.window_left < -1 || c.window_right < -1) return "window: bounds are >= 0, or -1";
  return "";
}

// The diagonal band in cuDNN's terms (as in sdpa_cudnn.cc): cuDNN keeps
// u <= t + right_bound and u > t - left_bound, so right = window_right (0 under causal)
// and left = window_left + 1.
template <typename Attrs>
void set_band(Attrs& attrs, const SdpaFp8Config& c) {
  std::optional<int64_t> right, left;
  if (c.causal) {
    right = 0;
  } else if (c.window_right >= 0) {
    right = c.window_right;
  }
  if (c.window_left >= 0) left = int64_t{c.window_left} + 1;
  if (!right && !left) return;
  attrs.set_diagonal_alignment(c.bottom_right ? fe::DiagonalAlignment_t::BOTTOM_RIGHT
                                              : fe::DiagonalAlignment_t::TOP_LEFT);
  if (right) attrs.set_diagonal_band_right_bound(static_cast<int>(*right));
  if (left) attrs.set_diagonal_band_left_bound(static_cast<int>(*left));
}

template <typename Attrs>
void set_masking(Attrs& attrs, const SdpaFp8Config& c, Graph& graph) {
  if (c.has_padding) {
    auto seq_len = [&](const char* name, int64_t uid) {
      return graph.tensor(TensorAttrs()
                              .set_name(name)
                              .set_uid(uid)
                              .set_dim({c.b, 1, 1, 1})
                              .set_stride({1, 1, 1, 1})
                              .set_data_type(fe::DataType_t::INT32));
    };
    attrs.set_padding_mask(true)
        .set_seq_len_q(seq_len("seq_len_q", kSeqLenQ))
        .set_seq_len_kv(seq_len("seq_len_kv", kSeqLenKv));
  }
  set_band(attrs, c);
}

// A [B, heads, seq, dim] view of a row-major [B, seq, heads, dim] buffer.
TensorAttrs bshd(const char* name, int64_t uid, int64_t b, int64_t heads, int64_t seq,
                 int64_t dim, fe::DataType_t dtype) {
  return TensorAttrs()
      .set_name(name)
      .set_uid(uid)
      .set_dim({b, heads, seq, dim})
      .set_stride({seq * heads * dim, dim, heads * dim, 1})
      .set_data_type(dtype);
}

// A float32 [1,1,1,1] tensor: a scale operand, or an amax output.
TensorAttrs scalar(const char* name, int64_t uid) {
  return TensorAttrs()
      .set_name(name)
      .set_uid(uid)
      .set_dim({1, 1, 1, 1})
      .set_stride({1, 1, 1, 1})
      .set_data_type(fe::DataType_t::FLOAT);
}

void mark_scalar(Tensor& t, const char* name, int64_t uid) {
  t->set_output(true).set_name(name).set_uid(uid).set_dim({1, 1, 1, 1}).set_stride(
      {1, 1, 1, 1}).set_data_type(fe::DataType_t::FLOAT);
}

void like(Tensor& t, const TensorAttrs& view) {
  t->set_output(true)
      .set_uid(view.get_uid())
      .set_dim(view.get_dim())
      .set_stride(view.get_stride())
      .set_data_type(view.get_data_type());
}

Tensor stats_tensor(Graph& graph, const SdpaFp8Config& c) {
  return graph.tensor(TensorAttrs()
                          .set_name("stats")
                          .set_uid(kStats)
                          .set_dim({c.b, c.n, c.t, 1})
                          .set_stride({c.n * c.t, c.t, 1, 1})
                          .set_data_type(fe::DataType_t::FLOAT));
}

void add_forward(Graph& graph, const SdpaFp8Config& c) {
  const auto e4m3 = fe::DataType_t::FP8_E4M3;
  Tensor q = graph.tensor(bshd("q", kQ, c.b, c.n, c.t, c.h, e4m3));
  Tensor k = graph.tensor(bshd("k", kK, c.b, c.k, c.s, c.h, e4m3));
  Tensor v = graph.tensor(bshd("v", kV, c.b, c.k, c.s, c.hv, e4m3));
  auto in = [&](const char* name, Uid uid) { return graph.tensor(scalar(name, uid)); };

  fe::graph::SDPA_fp8_attributes attrs;
  attrs.set_name("sdpa_fp8_fwd").set_generate_stats(true).set_attn_scale(c.scale);
  set_masking(attrs, c, graph);
  auto [o, stats, amax_s, amax_o] =
      graph.sdpa_fp8(q, k, v, in("descale_q", kDescaleQ), in("descale_k", kDescaleK),
                     in("descale_v", kDescaleV), in("descale_s", kDescaleS),
                     in("scale_s", kScaleS), in("scale_o", kScaleO), std::move(attrs));
  like(o, bshd("o", kO, c.b, c.n, c.t, c.hv, *to_cudnn_dtype(c.out_dtype)));
  stats->set_output(true)
      .set_uid(kStats)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim({c.b, c.n, c.t, 1})
      .set_stride({c.n * c.t, c.t, 1, 1});
  mark_scalar(amax_s, "amax_s", kAmaxS);
  mark_scalar(amax_o, "amax_o", kAmaxO);
}

void add_backward(Graph& graph, const SdpaFp8Config& c) {
  const auto e4m3 = fe::DataType_t::FP8_E4M3;
  const auto bf16 = fe::DataType_t::BFLOAT16;
  Tensor q = graph.tensor(bshd("q", kQ, c.b, c.n, c.t, c.h, e4m3));
  Tensor k = graph.tensor(bshd("k", kK, c.b, c.k, c.s, c.h, e4m3));
  Tensor v = graph.tensor(bshd("v", kV, c.b, c.k, c.s, c.hv, e4m3));
  Tensor o = graph.tensor(bshd("o", kO, c.b, c.n, c.t, c.hv, e4m3));
  Tensor d_o = graph.tensor(bshd("do", kDO, c.b, c.n, c.t, c.hv, fe::DataType_t::FP8_E5M2));
  auto in = [&](const char* name, Uid uid) { return graph.tensor(scalar(name, uid)); };

  fe::graph::SDPA_fp8_backward_attributes attrs;
  attrs.set_name("sdpa_fp8_bwd").set_attn_scale(c.scale);
  set_masking(attrs, c, graph);
  auto [dq, dk, dv, amax_dq, amax_dk, amax_dv, amax_dp] = graph.sdpa_fp8_backward(
      q, k, v, o, d_o, stats_tensor(graph, c), in("descale_q", kDescaleQ),
      in("descale_k", kDescaleK), in("descale_v", kDescaleV), in("descale_o", kDescaleO),
      in("descale_do", kDescaleDO), in("descale_s", kDescaleS), in("descale_dp", kDescaleDP),
      in("scale_s", kScaleS), in("scale_dq", kScaleDQ), in("scale_dk", kScaleDK),
      in("scale_dv", kScaleDV), in("scale_dp", kScaleDP), std::move(attrs));
  like(dq, bshd("dq", kDQ, c.b, c.n, c.t, c.h, bf16));
  like(dk, bshd("dk", kDK, c.b, c.k, c.s, c.h, bf16));
  like(dv, bshd("dv", kDV, c.b, c.k, c.s, c.hv, bf16));
  mark_scalar(amax_dq, "amax_dq", kAmaxDQ);
  mark_scalar(amax_dk, "amax_dk", kAmaxDK);
  mark_scalar(amax_dv, "amax_dv", kAmaxDV);
  mark_scalar(amax_dp, "amax_dp", kAmaxDP);
}

std::shared_ptr<CachedPlan> build_plan(const SdpaFp8Config& c, int device,
                                       DeviceHandle& handle) {
  auto add = [&](Graph& graph) {
    if (c.backward) {
      add_backward(graph, c);
    } else {
      add_forward(graph, c);
    }
  };
  return build_cached_plan(op_name(c), config_error(c), device, handle,
                           fe::DataType_t::FP8_E4M3, add);
}

// The backward's plan does not depend on the forward's out dtype (it reads o as e4m3).
std::shared_ptr<CachedPlan> plan_for(const SdpaFp8Config& requested, int device,
                                     DeviceHandle** handle, std::string* error) {
  SdpaFp8Config c = requested;
  if (c.backward) c.out_dtype = ffi::DataType::F8E4M3FN;
  return find_plan(op_name(c), cache_key(c, device), device, handle,
                   [&](DeviceHandle& h) { return build_plan(c, device, h); }, error);
}

// ---- argument decoding -------------------------------------------------------------

// The scale operands (`count` f32 scalars) and then q_lens, kv_lens when `has_padding`.
std::string decode_rest(const ffi::RemainingArgs& rest, size_t count, bool has_padding,
                        std::vector<ffi::AnyBuffer>* scales,
                        std::optional<ffi::AnyBuffer>* q_lens,
                        std::optional<ffi::AnyBuffer>* kv_lens) {
  size_t want = count + (has_padding ? 2 : 0);
  if (rest.size() != want) {
    return "expected " + std::to_string(want) + " arguments after the tensors (scales, " +
           "lengths), got " + std::to_string(rest.size());
  }
  for (size_t i = 0; i < want; ++i) {
    auto buf = rest.get<ffi::AnyBuffer>(i);
    if (buf.has_error()) return buf.error().message();
    if (i < count) {
      if (buf->element_type() != ffi::DataType::F32 || buf->element_count() != 1) {
        return "scale operand " + std::to_string(i) + ": expected one float32";
      }
      scales->push_back(*buf);
    } else {
      (i == count ? *q_lens : *kv_lens) = *buf;
    }
  }
  return "";
}

std::string shapes_from(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                        SdpaFp8Config* c) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return "q, k, v must be rank 4 (BTNH, BSKH, BSKH)";
  }
  c->b = qd[0], c->t = qd[1], c->n = qd[2], c->h = qd[3];
  c->s = kd[1], c->k = kd[2], c->hv = vd[3];
  const auto e4m3 = ffi::DataType::F8E4M3FN;
  if (q.element_type() != e4m3) return "q: expected float8_e4m3fn";
  std::string err;
  if (!(err = expect("k", k, e4m3, {c->b, c->s, c->k, c->h})).empty()) return err;
  return expect("v", v, e4m3, {c->b, c->s, c->k, c->hv});
}

std::string check_lengths(const SdpaFp8Config& c, const std::optional<ffi::AnyBuffer>& q_lens,
                          const std::optional<ffi::AnyBuffer>& kv_lens) {
  if (!q_lens) return "";
  std::string err = expect("q_lens", *q_lens, ffi::DataType::S32, {c.b});
  return err.empty() ? expect("kv_lens", *kv_lens, ffi::DataType::S32, {c.b}) : err;
}

std::string decode_attributes(const ffi::Dictionary& attrs, SdpaFp8Config* c) {
  std::string err = unexpected_attribute(attrs, kSdpaFp8AttributeNames);
  visit_sdpa_fp8_attributes(*c, [&](const char* name, auto& field) {
    if (err.empty()) err = get_attribute(attrs, name, &field);
  });
  return err;
}

// What both handlers decode from their arguments.
struct Call {
  SdpaFp8Config c;
  std::vector<ffi::AnyBuffer> scales;
  std::optional<ffi::AnyBuffer> q_lens, kv_lens;
};

// Decodes the attributes, the `scale_count` scale operands (then the lengths) after the
// tensors, and the shapes of q, k, v into `call`; "" or the failing stage's message.
std::string decode_call(const char* op, const ffi::Dictionary& attrs,
                        const ffi::RemainingArgs& rest, size_t scale_count,
                        const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                        const ffi::AnyBuffer& v, Call* call) {
  SdpaFp8Config& c = call->c;
  if (std::string err = decode_attributes(attrs, &c); !err.empty()) {
    return stage_message(op, "attributes", err);
  }
  std::string err =
      decode_rest(rest, scale_count, c.has_padding, &call->scales, &call->q_lens, &call->kv_lens);
  if (err.empty()) err = shapes_from(q, k, v, &c);
  if (err.empty()) err = check_lengths(c, call->q_lens, call->kv_lens);
  return err.empty() ? "" : stage_message(op, "arguments", err);
}

// The scale operands (by `uids`, in order) and the lengths of `call` bound into `tensors`.
void bind_operands(std::unordered_map<int64_t, void*>& tensors, const Uid* uids, const Call& call) {
  for (size_t i = 0; i < call.scales.size(); ++i) {
    tensors[uids[i]] = call.scales[i].untyped_data();
  }
  if (call.q_lens) {
    tensors[kSeqLenQ] = call.q_lens->untyped_data();
    tensors[kSeqLenKv] = call.kv_lens->untyped_data();
  }
}

// The plan and handle of `c` on the device of `stream`; the plan's part of the workspace
// result, and `slots` 16-byte aligned scratch slots (zeroed) from its end, for the amax
// outputs nobody reads.
ffi::Error plan_and_scratch(const SdpaFp8Config& c, cudaStream_t stream, ffi::AnyBuffer& buffer,
                            int slots, std::shared_ptr<CachedPlan>* plan, DeviceHandle** handle,
                            Workspace* plan_part, std::vector<void*>* scratch) {
  const char* op = op_name(c);
  std::string err;
  int device = stream_device(stream, &err);
  if (device < 0) return internal_error(stage_message(op, "device", err));
  *plan = plan_for(c, device, handle, &err);
  if (!*plan) return ffi::Error(ffi::ErrorCode::kUnimplemented, err);
  Workspace whole = workspace_of(buffer);
  if (whole.size < kScratchBytes) {
    return internal_error(stage_message(op, "workspace", "the result is smaller than its scratch"));
  }
  *plan_part = {whole.data, whole.size - kScratchBytes};
  uintptr_t start = reinterpret_cast<uintptr_t>(whole.data) + whole.size - kScratchBytes;
  start = (start + kScratchSlot - 1) & ~uintptr_t(kScratchSlot - 1);
  for (int i = 0; i < slots; ++i) {
    scratch->push_back(reinterpret_cast<void*>(start + i * kScratchSlot));
  }
  return fill_bytes(stream, op, 0, reinterpret_cast<void*>(start), slots * kScratchSlot);
}

// Copies amax[0] into every other entry of `amax` (float32), doubling the filled prefix
// with each asynchronous device-to-device copy.
ffi::Error broadcast_first(cudaStream_t stream, const char* op, ffi::AnyBuffer& amax) {
  auto* data = static_cast<char*>(amax.untyped_data());
  const size_t total = amax.size_bytes();
  for (size_t filled = sizeof(float); filled < total; filled *= 2) {
    size_t bytes = std::min(filled, total - filled);
    cudaError_t e = cudaMemcpyAsync(data + filled, data, bytes, cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return internal_error(stage_message(op, "amax", cudaGetErrorString(e)));
  }
  return ffi::Error::Success();
}

// ---- handlers ----------------------------------------------------------------------

ffi::Error sdpa_fp8_fwd(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::RemainingArgs rest, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> amax,
                        ffi::Result<ffi::AnyBuffer> workspace, ffi::Dictionary attrs) {
  const char* op = "sdpa_fp8_fwd";
  return guarded(op, [&]() -> ffi::Error {
    Call call;
    if (std::string err = decode_call(op, attrs, rest, kFwdScaleCount, q, k, v, &call);
        !err.empty()) {
      return invalid_argument(err);
    }
    SdpaFp8Config& c = call.c;
    c.out_dtype = out->element_type();
    std::string err = expect("out", *out, c.out_dtype, {c.b, c.t, c.n, c.hv});
    if (err.empty()) err = expect("lse", *lse, ffi::DataType::F32, {c.b, c.n, c.t});
    if (err.empty()) err = expect("amax", *amax, ffi::DataType::F32, {c.b, c.n});
    if (!err.empty()) return invalid_argument(stage_message(op, "arguments", err));

    std::shared_ptr<CachedPlan> plan;
    DeviceHandle* handle = nullptr;
    Workspace plan_part;
    std::vector<void*> scratch;
    if (ffi::Error e = plan_and_scratch(c, stream, *workspace, 1, &plan, &handle, &plan_part,
                                        &scratch);
        e.failure()) {
      return e;
    }
    std::unordered_map<int64_t, void*> tensors = {
        {kQ, q.untyped_data()},     {kK, k.untyped_data()},       {kV, v.untyped_data()},
        {kO, out->untyped_data()},  {kStats, lse->untyped_data()},
        {kAmaxO, amax->untyped_data()}, {kAmaxS, scratch[0]},
    };
    bind_operands(tensors, kFwdScales, call);
    // Rows past the valid lengths are not written by cuDNN; amax starts from 0.
    if (ffi::Error e = prefill(stream, op, c.has_padding, {&*out}); e.failure()) return e;
    if (ffi::Error e = prefill(stream, op, false, {&*lse}); e.failure()) return e;
    if (ffi::Error e = fill_bytes(stream, op, 0, {&*amax}); e.failure()) return e;
    if (ffi::Error e = run_plan(*plan, *handle, stream, plan_part, tensors, op); e.failure()) {
      return e;
    }
    return broadcast_first(stream, op, *amax);
  });
}

ffi::Error sdpa_fp8_bwd(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer o, ffi::AnyBuffer dout, ffi::AnyBuffer lse,
                        ffi::RemainingArgs rest, ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                        ffi::Result<ffi::AnyBuffer> workspace, ffi::Dictionary attrs) {
  const char* op = "sdpa_fp8_bwd";
  return guarded(op, [&]() -> ffi::Error {
    Call call;
    call.c.backward = true;
    if (std::string err = decode_call(op, attrs, rest, kBwdScaleCount, q, k, v, &call);
        !err.empty()) {
      return invalid_argument(err);
    }
    const SdpaFp8Config& c = call.c;
    const auto bf16 = ffi::DataType::BF16;
    std::string err = expect("o", o, ffi::DataType::F8E4M3FN, {c.b, c.t, c.n, c.hv});
    if (err.empty()) err = expect("dout", dout, ffi::DataType::F8E5M2, {c.b, c.t, c.n, c.hv});
    if (err.empty()) err = expect("lse", lse, ffi::DataType::F32, {c.b, c.n, c.t});
    if (err.empty()) err = expect("dq", *dq, bf16, {c.b, c.t, c.n, c.h});
    if (err.empty()) err = expect("dk", *dk, bf16, {c.b, c.s, c.k, c.h});
    if (err.empty()) err = expect("dv", *dv, bf16, {c.b, c.s, c.k, c.hv});
    if (!err.empty()) return invalid_argument(stage_message(op, "arguments", err));

    std::shared_ptr<CachedPlan> plan;
    DeviceHandle* handle = nullptr;
    Workspace plan_part;
    std::vector<void*> scratch;
    if (ffi::Error e = plan_and_scratch(c, stream, *workspace, 4, &plan, &handle, &plan_part,
                                        &scratch);
        e.failure()) {
      return e;
    }
    std::unordered_map<int64_t, void*> tensors = {
        {kQ, q.untyped_data()},       {kK, k.untyped_data()},      {kV, v.untyped_data()},
        {kO, o.untyped_data()},       {kDO, dout.untyped_data()},  {kStats, lse.untyped_data()},
        {kDQ, dq->untyped_data()},    {kDK, dk->untyped_data()},   {kDV, dv->untyped_data()},
        {kAmaxDQ, scratch[0]},        {kAmaxDK, scratch[1]},       {kAmaxDV, scratch[2]},
        {kAmaxDP, scratch[3]},
    };
    bind_operands(tensors, kBwdScales, call);
    if (ffi::Error e = prefill(stream, op, c.has_padding, {&*dq, &*dk, &*dv}); e.failure()) {
      return e;
    }
    return run_plan(*plan, *handle, stream, plan_part, tensors, op);
  });
}

std::shared_ptr<CachedPlan> checked_plan(const SdpaFp8Config& config, std::string* error) {
  int device = current_device(error);
  if (device < 0) {
    *error = stage_message(op_name(config), "device", *error);
    return nullptr;
  }
  try {
    DeviceHandle* handle = nullptr;
    return plan_for(config, device, &handle, error);
  } catch (const std::exception& e) {
    *error = stage_message(op_name(config), "exception", e.what());
    return nullptr;
  }
}

}  // namespace

bool sdpa_fp8_out_dtype(const std::string& name, ffi::DataType* dtype) {
  const std::pair<const char*, ffi::DataType> known[] = {
      {"float8_e4m3fn", ffi::DataType::F8E4M3FN}, {"bfloat16", ffi::DataType::BF16},
      {"float16", ffi::DataType::F16}, {"float32", ffi::DataType::F32}};
  for (const auto& [n, d] : known) {
    if (name == n) {
      *dtype = d;
      return true;
    }
  }
  return false;
}

std::string sdpa_fp8_check(const SdpaFp8Config& config) {
  std::string err;
  return checked_plan(config, &err) ? "" : err;
}

int64_t sdpa_fp8_workspace(const SdpaFp8Config& config, std::string* error) {
  std::shared_ptr<CachedPlan> plan = checked_plan(config, error);
  return plan ? workspace_bound(*plan) + kScratchBytes : -1;
}

}  // namespace cudnn_jax

namespace ffi = xla::ffi;
using Stream = ffi::PlatformStream<cudaStream_t>;

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudnnJaxSdpaFp8Fwd, cudnn_jax::sdpa_fp8_fwd,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()  // q (e4m3)
                                  .Arg<ffi::AnyBuffer>()  // k (e4m3)
                                  .Arg<ffi::AnyBuffer>()  // v (e4m3)
                                  .RemainingArgs()        // 6 scales, [q_lens, kv_lens]
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::AnyBuffer>()  // lse
                                  .Ret<ffi::AnyBuffer>()  // amax [B, N]
                                  .Ret<ffi::AnyBuffer>()  // workspace (u8)
                                  .Attrs(),               // CUDNN_JAX_SDPA_FP8_ATTRIBUTES
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudnnJaxSdpaFp8Bwd, cudnn_jax::sdpa_fp8_bwd,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()  // q (e4m3)
                                  .Arg<ffi::AnyBuffer>()  // k (e4m3)
                                  .Arg<ffi::AnyBuffer>()  // v (e4m3)
                                  .Arg<ffi::AnyBuffer>()  // o (e4m3)
                                  .Arg<ffi::AnyBuffer>()  // dout (e5m2)
                                  .Arg<ffi::AnyBuffer>()  // lse
                                  .RemainingArgs()        // 12 scales, [q_lens, kv_lens]
                                  .Ret<ffi::AnyBuffer>()  // dq (bf16)
                                  .Ret<ffi::AnyBuffer>()  // dk (bf16)
                                  .Ret<ffi::AnyBuffer>()  // dv (bf16)
                                  .Ret<ffi::AnyBuffer>()  // workspace (u8)
                                  .Attrs(),               // CUDNN_JAX_SDPA_FP8_ATTRIBUTES
                              {ffi::Traits::kCmdBufferCompatible});
