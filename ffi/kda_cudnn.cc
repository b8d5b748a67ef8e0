// cudnn_jax_kda_fwd / cudnn_jax_kda_bwd: Kimi Delta Attention over packed sequences on
// NVIDIA's sm_90 kernels from the nvidia-cudnn-frontend wheel (kda_sm90_fwd.cu,
// kda_sm90_bwd.cu), head dim 128.
//
// Forward, HQ query/key heads and HV value heads (HQ divides HV):
//   q, k [T,HQ,128] bf16, v [T,HV,128] bf16, g [T,HV,128] f32, beta [T,HV] f32,
//   cu [N+1] int32, served [N] int32, initial_state [N,HV,128,128] f32, a_log [HV] f32,
//   dt_bias [HV,128] f32  ->  o [T,HV,128] bf16, final_state [N,HV,128,128] f32.
// Backward, H heads:
//   do, q, k, v [T,H,128] bf16, g [T,H,128] f32, beta [T,H] f32, cu [N+1] int32,
//   served [N] int32, initial_state, d_final_state [N,H,128,128] f32  ->  dq, dk, dv
//   [T,H,128] bf16, dg [T,H,128] f32, dbeta [T,H] f32, d_initial_state [N,H,128,128] f32,
//   workspace [W] u8 (W >= kda_bwd_workspace(T, H, N)).
// Sequence i holds tokens [cu[i], cu[i+1]); cu is non-decreasing within [0, T] (not
// checked: that would need a host sync). Rows of tokens outside every sequence are left
// unwritten, unless zero_unserved zeroes them together with those of sequences whose
// served[i] is 0.

#include "kda_cudnn.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "common/attributes.h"
#include "common/buffers.h"
#include "common/errors.h"
#include "common/graph_utils.h"

namespace cudnn_jax {
namespace {

constexpr int64_t kDim = 128;        // head dim of q, k, v (the kernels' only one)
constexpr int64_t kFwdChunk = 16;    // cuda_host.CHUNK
constexpr int64_t kMaxGridY = 65535;
constexpr int64_t kMaxInt = std::numeric_limits<int32_t>::max();

using FwdLauncher = cudaError_t (*)(const void*, const void*, const void*, const float*,
                                    const float*, const int*, const float*, void*, float*, int,
                                    int, int, const float*, const float*, float, float, int,
                                    cudaStream_t);

struct FwdVariant {
  int flags, gqa;
  FwdLauncher launch;
};

#define CUDNN_JAX_KDA_FWD_ENTRY(flags, gqa) {flags, gqa, cudnn_jax_kda_fwd_##flags##_##gqa},
constexpr FwdVariant kFwdVariants[] = {CUDNN_JAX_KDA_FWD_VARIANTS(CUDNN_JAX_KDA_FWD_ENTRY)};
#undef CUDNN_JAX_KDA_FWD_ENTRY

FwdLauncher find_fwd(int flags, bool gqa) {
  for (const FwdVariant& v : kFwdVariants) {
    if (v.flags == flags && v.gqa == (gqa ? 1 : 0)) return v.launch;
  }
  return nullptr;
}

#define CUDNN_JAX_KDA_GET(name, type, init) \
  if (err.empty()) err = get_attribute(attrs, #name, &c->name);

std::string decode_attributes(const ffi::Dictionary& attrs, KdaFwdConfig* c) {
  std::string err = unexpected_attribute(attrs, kKdaFwdAttributeNames);
  CUDNN_JAX_KDA_FWD_ATTRIBUTES(CUDNN_JAX_KDA_GET)
  return err;
}

std::string decode_attributes(const ffi::Dictionary& attrs, KdaBwdConfig* c) {
  std::string err = unexpected_attribute(attrs, kKdaBwdAttributeNames);
  CUDNN_JAX_KDA_BWD_ATTRIBUTES(CUDNN_JAX_KDA_GET)
  return err;
}

#undef CUDNN_JAX_KDA_GET

// The current device's SM count, after checking it is the kernels' compute capability 9.0;
// an error (kUnimplemented for another device) otherwise.
ffi::Error hopper_sms(const char* op, int* sms) {
  int device = 0, major = 0, minor = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status == cudaSuccess) {
    status = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  }
  if (status == cudaSuccess) {
    status = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  }
  if (status == cudaSuccess) {
    status = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device);
  }
  if (status != cudaSuccess) {
    return internal_error(stage_message(op, "device", cudaGetErrorString(status)));
  }
  if (major != 9 || minor != 0) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      stage_message(op, "device",
                                    "the sm_90a KDA kernels need compute capability 9.0, got " +
                                        std::to_string(major) + "." + std::to_string(minor)));
  }
  return ffi::Error::Success();
}

// cuda_host.pieces_per_sequence: split each sequence so that N*H*P nears `target_ctas`,
// never into more pieces than it has chunks.
int64_t pieces_per_sequence(int64_t t, int64_t n, int64_t h, int64_t target_ctas) {
  const int64_t approx = ((t + n - 1) / n + kFwdChunk - 1) / kFwdChunk;
  int64_t p = target_ctas / std::max<int64_t>(n * h, 1);
  if (p < 1) p = 1;
  if (p > approx) p = approx >= 1 ? approx : 1;
  return p;
}

ffi::Error launch_error(const char* op, const char* stage, cudaError_t err) {
  return internal_error(stage_message(op, stage, cudaGetErrorString(err)));
}

// Zeroes the given rows ([T, ...] buffers) of every token no served sequence holds.
ffi::Error zero_unserved(const char* op, cudaStream_t stream, const ffi::AnyBuffer& cu,
                         const ffi::AnyBuffer& served, int64_t n, int64_t t,
                         std::initializer_list<ffi::AnyBuffer*> rows) {
  void* data[CUDNN_JAX_KDA_MAX_ROW_SETS];
  size_t row_bytes[CUDNN_JAX_KDA_MAX_ROW_SETS];
  int count = 0;
  for (ffi::AnyBuffer* buf : rows) {
    if (t == 0 || buf->size_bytes() == 0) continue;
    data[count] = buf->untyped_data();
    row_bytes[count++] = buf->size_bytes() / static_cast<size_t>(t);
  }
  if (count == 0) return ffi::Error::Success();
  cudaError_t err = cudnn_jax_kda_zero_unserved(
      static_cast<const int*>(cu.untyped_data()), static_cast<const int*>(served.untyped_data()),
      static_cast<int>(n), static_cast<int>(t), data, row_bytes, count, stream);
  if (err != cudaSuccess) return launch_error(op, "zero_unserved", err);
  return ffi::Error::Success();
}

ffi::Error kda_fwd(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::AnyBuffer g, ffi::AnyBuffer beta, ffi::AnyBuffer cu,
                   ffi::AnyBuffer served, ffi::AnyBuffer initial_state, ffi::AnyBuffer a_log,
                   ffi::AnyBuffer dt_bias, ffi::Result<ffi::AnyBuffer> o,
                   ffi::Result<ffi::AnyBuffer> final_state, ffi::Dictionary attrs) {
  constexpr const char* kOp = "kda_fwd";
  return guarded(kOp, [&]() -> ffi::Error {
    KdaFwdConfig c;
    if (std::string err = decode_attributes(attrs, &c); !err.empty()) {
      return invalid_argument(stage_message(kOp, "attributes", err));
    }
    if (c.flags < 0 || c.flags > 7) {
      return invalid_argument(stage_message(
          kOp, "attributes", "flags: 0..7 (1 l2norm, 2 safe gate, 4 beta sigmoid), got " +
                                 std::to_string(c.flags)));
    }
    auto qd = q.dimensions(), vd = v.dimensions(), cd = cu.dimensions();
    if (qd.size() != 3 || vd.size() != 3 || cd.size() != 1 || cd[0] < 1) {
      return invalid_argument(
          stage_message(kOp, "arguments", "q [T,HQ,128], v [T,HV,128], cu [N+1]"));
    }
    const int64_t t = qd[0], hq = qd[1], hv = vd[1], n = cd[0] - 1;
    const auto bf16 = ffi::DataType::BF16, f32 = ffi::DataType::F32, s32 = ffi::DataType::S32;
    std::string err = expect("q", q, bf16, {t, hq, kDim});
    if (err.empty()) err = expect("k", k, bf16, {t, hq, kDim});
    if (err.empty()) err = expect("v", v, bf16, {t, hv, kDim});
    if (err.empty()) err = expect("g", g, f32, {t, hv, kDim});
    if (err.empty()) err = expect("beta", beta, f32, {t, hv});
    if (err.empty()) err = expect("cu", cu, s32, {n + 1});
    if (err.empty()) err = expect("served", served, s32, {n});
    if (err.empty()) err = expect("initial_state", initial_state, f32, {n, hv, kDim, kDim});
    if (err.empty()) err = expect("a_log", a_log, f32, {hv});
    if (err.empty()) err = expect("dt_bias", dt_bias, f32, {hv, kDim});
    if (err.empty()) err = expect("o", *o, bf16, {t, hv, kDim});
    if (err.empty()) err = expect("final_state", *final_state, f32, {n, hv, kDim, kDim});
    if (err.empty() && (hq < 1 || hv % hq != 0)) {
      err = "q/k heads (" + std::to_string(hq) + ") must divide v heads (" +
            std::to_string(hv) + ")";
    }
    if (err.empty() && (t > kMaxInt || hv > kMaxInt)) err = "T or HV past 2^31-1";
    if (err.empty() && n > kMaxGridY) {
      err = "N: at most " + std::to_string(kMaxGridY) + " sequences, got " + std::to_string(n);
    }
    if (!err.empty()) return invalid_argument(stage_message(kOp, "arguments", err));

    int sms = 0;
    if (ffi::Error e = hopper_sms(kOp, &sms); e.failure()) return e;
    if (ffi::Error e = prefill(stream, kOp, false, {&*o, &*final_state}); e.failure()) return e;
    if (n > 0 && hv > 0) {
      int64_t pieces = c.segmented ? pieces_per_sequence(t, n, hv, 2 * int64_t{sms}) : 1;
      pieces = std::min(pieces, kMaxGridY / n);
      FwdLauncher launch = find_fwd(c.flags, hv != hq);
      if (launch == nullptr) {
        return internal_error(stage_message(kOp, "launch", "no compiled kernel variant"));
      }
      cudaError_t status = launch(
          q.untyped_data(), k.untyped_data(), v.untyped_data(),
          static_cast<const float*>(g.untyped_data()),
          static_cast<const float*>(beta.untyped_data()),
          static_cast<const int*>(cu.untyped_data()),
          static_cast<const float*>(initial_state.untyped_data()), o->untyped_data(),
          static_cast<float*>(final_state->untyped_data()), static_cast<int>(n),
          static_cast<int>(hv), static_cast<int>(pieces),
          static_cast<const float*>(a_log.untyped_data()),
          static_cast<const float*>(dt_bias.untyped_data()), c.gate_lower_bound, c.q_scale,
          static_cast<int>(hq), stream);
      if (status != cudaSuccess) return launch_error(kOp, "launch", status);
    }
    if (c.zero_unserved) return zero_unserved(kOp, stream, cu, served, n, t, {&*o});
    return ffi::Error::Success();
  });
}

ffi::Error kda_bwd(cudaStream_t stream, ffi::AnyBuffer d_o, ffi::AnyBuffer q, ffi::AnyBuffer k,
                   ffi::AnyBuffer v, ffi::AnyBuffer g, ffi::AnyBuffer beta, ffi::AnyBuffer cu,
                   ffi::AnyBuffer served, ffi::AnyBuffer initial_state,
                   ffi::AnyBuffer d_final_state, ffi::Result<ffi::AnyBuffer> dq,
                   ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                   ffi::Result<ffi::AnyBuffer> dg, ffi::Result<ffi::AnyBuffer> dbeta,
                   ffi::Result<ffi::AnyBuffer> d_initial_state,
                   ffi::Result<ffi::AnyBuffer> workspace, ffi::Dictionary attrs) {
  constexpr const char* kOp = "kda_bwd";
  return guarded(kOp, [&]() -> ffi::Error {
    KdaBwdConfig c;
    if (std::string err = decode_attributes(attrs, &c); !err.empty()) {
      return invalid_argument(stage_message(kOp, "attributes", err));
    }
    auto dd = d_o.dimensions(), cd = cu.dimensions(), wd = workspace->dimensions();
    if (dd.size() != 3 || cd.size() != 1 || cd[0] < 1) {
      return invalid_argument(stage_message(kOp, "arguments", "do [T,H,128], cu [N+1]"));
    }
    const int64_t t = dd[0], h = dd[1], n = cd[0] - 1;
    const auto bf16 = ffi::DataType::BF16, f32 = ffi::DataType::F32, s32 = ffi::DataType::S32;
    std::string err = expect("do", d_o, bf16, {t, h, kDim});
    if (err.empty()) err = expect("q", q, bf16, {t, h, kDim});
    if (err.empty()) err = expect("k", k, bf16, {t, h, kDim});
    if (err.empty()) err = expect("v", v, bf16, {t, h, kDim});
    if (err.empty()) err = expect("g", g, f32, {t, h, kDim});
    if (err.empty()) err = expect("beta", beta, f32, {t, h});
    if (err.empty()) err = expect("cu", cu, s32, {n + 1});
    if (err.empty()) err = expect("served", served, s32, {n});
    if (err.empty()) err = expect("initial_state", initial_state, f32, {n, h, kDim, kDim});
    if (err.empty()) err = expect("d_final_state", d_final_state, f32, {n, h, kDim, kDim});
    if (err.empty()) err = expect("dq", *dq, bf16, {t, h, kDim});
    if (err.empty()) err = expect("dk", *dk, bf16, {t, h, kDim});
    if (err.empty()) err = expect("dv", *dv, bf16, {t, h, kDim});
    if (err.empty()) err = expect("dg", *dg, f32, {t, h, kDim});
    if (err.empty()) err = expect("dbeta", *dbeta, f32, {t, h});
    if (err.empty()) err = expect("d_initial_state", *d_initial_state, f32, {n, h, kDim, kDim});
    if (err.empty() && (workspace->element_type() != ffi::DataType::U8 || wd.size() != 1)) {
      err = "workspace: expected a rank-1 uint8 buffer";
    }
    if (err.empty() && c.whole && n != 1) {
      err = "whole: one sequence of all T tokens, got N = " + std::to_string(n);
    }
    if (err.empty() && (t > kMaxInt || h > kMaxGridY || n * h > kMaxGridY)) {
      err = "T past 2^31-1, or H or N*H past " + std::to_string(kMaxGridY);
    }
    if (!err.empty()) return invalid_argument(stage_message(kOp, "arguments", err));
    const size_t need = cudnn_jax_kda_bwd_workspace(static_cast<int>(t), static_cast<int>(h),
                                                    static_cast<int>(n));
    if (workspace->size_bytes() < need) {
      return invalid_argument(stage_message(
          kOp, "arguments",
          "workspace: " + std::to_string(workspace->size_bytes()) + " bytes, needs " +
              std::to_string(need) + " (kda_bwd_workspace(T, H, N))"));
    }

    int sms = 0;
    if (ffi::Error e = hopper_sms(kOp, &sms); e.failure()) return e;
    if (ffi::Error e = prefill(stream, kOp, false,
                               {&*dq, &*dk, &*dv, &*dg, &*dbeta, &*d_initial_state});
        e.failure()) {
      return e;
    }
    cudaError_t status = cudnn_jax_kda_bwd(
        workspace->untyped_data(), d_o.untyped_data(), q.untyped_data(), k.untyped_data(),
        v.untyped_data(), static_cast<const float*>(g.untyped_data()),
        static_cast<const float*>(beta.untyped_data()), static_cast<const int*>(cu.untyped_data()),
        static_cast<const float*>(initial_state.untyped_data()),
        static_cast<const float*>(d_final_state.untyped_data()), dq->untyped_data(),
        dk->untyped_data(), dv->untyped_data(), static_cast<float*>(dg->untyped_data()),
        static_cast<float*>(dbeta->untyped_data()),
        static_cast<float*>(d_initial_state->untyped_data()), static_cast<int>(t),
        static_cast<int>(h), static_cast<int>(n), c.whole ? 1 : 0, stream);
    if (status != cudaSuccess) return launch_error(kOp, "launch", status);
    if (c.zero_unserved) {
      return zero_unserved(kOp, stream, cu, served, n, t, {&*dq, &*dk, &*dv, &*dg, &*dbeta});
    }
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace cudnn_jax

namespace ffi = xla::ffi;
using Stream = ffi::PlatformStream<cudaStream_t>;

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudnnJaxKdaFwd, cudnn_jax::kda_fwd,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()  // q [T,HQ,128] bf16
                                  .Arg<ffi::AnyBuffer>()  // k [T,HQ,128] bf16
                                  .Arg<ffi::AnyBuffer>()  // v [T,HV,128] bf16
                                  .Arg<ffi::AnyBuffer>()  // g [T,HV,128] f32
                                  .Arg<ffi::AnyBuffer>()  // beta [T,HV] f32
                                  .Arg<ffi::AnyBuffer>()  // cu [N+1] int32
                                  .Arg<ffi::AnyBuffer>()  // served [N] int32
                                  .Arg<ffi::AnyBuffer>()  // initial_state [N,HV,128,128] f32
                                  .Arg<ffi::AnyBuffer>()  // a_log [HV] f32
                                  .Arg<ffi::AnyBuffer>()  // dt_bias [HV,128] f32
                                  .Ret<ffi::AnyBuffer>()  // o [T,HV,128] bf16
                                  .Ret<ffi::AnyBuffer>()  // final_state [N,HV,128,128] f32
                                  .Attrs(),               // CUDNN_JAX_KDA_FWD_ATTRIBUTES
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudnnJaxKdaBwd, cudnn_jax::kda_bwd,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()  // do [T,H,128] bf16
                                  .Arg<ffi::AnyBuffer>()  // q [T,H,128] bf16
                                  .Arg<ffi::AnyBuffer>()  // k [T,H,128] bf16
                                  .Arg<ffi::AnyBuffer>()  // v [T,H,128] bf16
                                  .Arg<ffi::AnyBuffer>()  // g [T,H,128] f32
                                  .Arg<ffi::AnyBuffer>()  // beta [T,H] f32
                                  .Arg<ffi::AnyBuffer>()  // cu [N+1] int32
                                  .Arg<ffi::AnyBuffer>()  // served [N] int32
                                  .Arg<ffi::AnyBuffer>()  // initial_state [N,H,128,128] f32
                                  .Arg<ffi::AnyBuffer>()  // d_final_state [N,H,128,128] f32
                                  .Ret<ffi::AnyBuffer>()  // dq [T,H,128] bf16
                                  .Ret<ffi::AnyBuffer>()  // dk [T,H,128] bf16
                                  .Ret<ffi::AnyBuffer>()  // dv [T,H,128] bf16
                                  .Ret<ffi::AnyBuffer>()  // dg [T,H,128] f32
                                  .Ret<ffi::AnyBuffer>()  // dbeta [T,H] f32
                                  .Ret<ffi::AnyBuffer>()  // d_initial_state [N,H,128,128] f32
                                  .Ret<ffi::AnyBuffer>()  // workspace [W] u8
                                  .Attrs(),               // CUDNN_JAX_KDA_BWD_ATTRIBUTES
                              {ffi::Traits::kCmdBufferCompatible});
