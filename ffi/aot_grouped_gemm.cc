// cudnn_jax_cute_grouped_gemm: grouped GEMM with a fused epilogue on the ahead-of-time
// compiled CuTe DSL kernel kernels/grouped_gemm_sm90.py (WGMMA + TMA, group sizes read on
// the device).
//
//   lhs [M,K], rhs [G,K,C] (as stored: C fastest), bias [G,C] float32, tile_starts [G+1]
//   int32, row_starts [G+1] int32 (exclusive cumulative sums of ceil(size/tile_m) and of
//   the sizes, clamped to M)  ->  out [M,N], lhs's dtype; C = N, or 2N for a GLU.
//   Attribute epilogue: "none", an activation or a GLU (the kernel's EPILOGUES).
// Rows past row_starts[G] are set to zero by the kernel. The kernel's constants (tile_m,
// the tile widths, max_groups, the epilogue names) come from kernel_constants.h, which the
// build generates from kernels/grouped_gemm_sm90.py.
//
// cudnn_jax_cute_grouped_wgrad: its weight gradient on kernels/grouped_wgrad_sm90.py.
//   lhs [M,K], ct [M,N] (lhs's dtype), row_starts [G+1] int32  ->  out [G,K,N] float32,
//   out[g] = lhs[rows of g]^T ct[rows of g] (0 for an empty group).

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <limits>
#include <string>
#include <string_view>

#include "aot_kernels.h"
#include "aot_kernels_ffi.h"
#include "common/aot_module.h"
#include "common/buffers.h"
#include "common/errors.h"
#include "common/graph_utils.h"
#include "kernel_constants.h"
#include "xla/ffi/api/ffi.h"

namespace cudnn_jax {
namespace {

namespace kernel = kernel_constants::grouped_gemm;

constexpr const char* kOp = "cute_grouped_gemm";

struct Call {
  cudaStream_t stream;
  ffi::AnyBuffer lhs, rhs, bias, tile_starts, row_starts;
  ffi::Result<ffi::AnyBuffer> out;
  int32_t m, k, n, columns, groups;
  int32_t ctas;  // persistent CTAs
};

// Persistent CTAs: one per SM of the current device, fewer when even the largest split
// has fewer tiles; -1 with *error set when CUDA cannot say how many SMs there are.
int32_t persistent_ctas(int64_t m, int64_t n, int64_t groups, bool glu, std::string* error) {
  const int64_t tile_n = glu ? kernel::glu_tile_n : kernel::tile_n;
  const int64_t tiles =
      ((m + kernel::tile_m - 1) / kernel::tile_m + groups) * ((n + tile_n - 1) / tile_n);
  int device = 0, sms = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status == cudaSuccess) {
    status = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  }
  if (status != cudaSuccess) {
    *error = cudaGetErrorString(status);
    return -1;
  }
  return static_cast<int32_t>(std::max<int64_t>(1, std::min<int64_t>(tiles, sms)));
}

// The launch shared by every variant; their tensor structs differ only in name.
template <typename Module, typename Lhs, typename Rhs, typename Bias, typename Out,
          typename Tiles, typename Rows>
ffi::Error launch(int32_t (*wrapper)(Module*, Lhs*, Rhs*, Bias*, Out*, Tiles*, Rows*, int32_t,
                                     cudaStream_t),
                  void (*load)(Module*), const Call& c) {
  const int32_t m = c.m, k = c.k, n = c.n, cols = c.columns, groups = c.groups;
  Lhs a{c.lhs.untyped_data(), {m, k}, {k, int64_t{m} * k}};
  Rhs b{c.rhs.untyped_data(), {cols, k, groups}, {cols, int64_t{k} * cols}};
  Bias bias{c.bias.untyped_data(), {cols, groups}, {cols}};
  Out out{c.out->untyped_data(), {m, n}, {n, int64_t{m} * n}};
  Tiles tiles{c.tile_starts.untyped_data(), {groups + 1}};
  Rows rows{c.row_starts.untyped_data(), {groups + 1}};
  int32_t err = wrapper(loaded_module(load), &a, &b, &bias, &out, &tiles, &rows, c.ctas,
                        c.stream);
  if (err != 0) {
    return internal_error(
        stage_message(kOp, "launch", cudaGetErrorString(static_cast<cudaError_t>(err))));
  }
  return ffi::Error::Success();
}

struct Variant {
  const char* name;  // grouped_gemm_<dtype>_<epilogue>
  ffi::Error (*run)(const Call&);
};

#define CUDNN_JAX_GROUPED_GEMM_VARIANT(prefix)                                           \
  {#prefix, [](const Call& c) {                                                          \
     return launch(cute_dsl_##prefix##_wrapper, prefix##_Kernel_Module_Load, c);         \
   }},
constexpr Variant kVariants[] = {CUDNN_JAX_AOT_GROUPED_GEMM_SM90(CUDNN_JAX_GROUPED_GEMM_VARIANT)};
#undef CUDNN_JAX_GROUPED_GEMM_VARIANT

const Variant* find_variant(const std::string& name) {
  for (const Variant& v : kVariants) {
    if (name == v.name) return &v;
  }
  return nullptr;
}

bool is_glu(std::string_view epilogue) {
  return std::any_of(std::begin(kernel::glu_epilogues), std::end(kernel::glu_epilogues),
                     [&](const char* glu) { return epilogue == glu; });
}

ffi::Error cute_grouped_gemm(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                             ffi::AnyBuffer bias, ffi::AnyBuffer tile_starts,
                             ffi::AnyBuffer row_starts, ffi::Result<ffi::AnyBuffer> out,
                             std::string_view epilogue) {
  return guarded(kOp, [&]() -> ffi::Error {
    auto ld = lhs.dimensions(), rd = rhs.dimensions();
    if (ld.size() != 2 || rd.size() != 3) {
      return invalid_argument(stage_message(kOp, "arguments", "lhs [M,K], rhs [G,K,C]"));
    }
    const int64_t m = ld[0], k = ld[1], groups = rd[0], columns = rd[2];
    const int64_t n = is_glu(epilogue) ? columns / 2 : columns;
    const ffi::DataType dtype = lhs.element_type();
    const char* dtype_name = dtype == ffi::DataType::BF16  ? "bf16"
                             : dtype == ffi::DataType::F16 ? "f16"
                                                           : nullptr;
    const Variant* variant = nullptr;
    std::string err;
    if (dtype_name == nullptr) {
      err = "dtype: bf16 or f16 only";
    } else if (!(variant = find_variant(std::string("grouped_gemm_") + dtype_name + "_" +
                                        std::string(epilogue)))) {
      err = "epilogue: no kernel variant for " + std::string(epilogue);
    }
    if (err.empty()) err = expect("rhs", rhs, dtype, {groups, k, columns});
    if (err.empty()) err = expect("bias", bias, ffi::DataType::F32, {groups, columns});
    if (err.empty()) err = expect("tile_starts", tile_starts, ffi::DataType::S32, {groups + 1});
    if (err.empty()) err = expect("row_starts", row_starts, ffi::DataType::S32, {groups + 1});
    if (err.empty()) err = expect("out", *out, dtype, {m, n});
    constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
    if (err.empty() && (m > kMax || k > kMax || columns > kMax)) err = "dimensions past 2^31-1";
    if (err.empty() && groups > kernel::max_groups) {
      err = "groups: the kernel takes at most " + std::to_string(kernel::max_groups) + ", got " +
            std::to_string(groups);
    }
    if (err.empty() && (k % 8 || n % 8)) err = "K and N must be multiples of 8 (16-byte rows)";
    if (!err.empty()) return invalid_argument(stage_message(kOp, "arguments", err));
    if (m == 0 || n == 0) return ffi::Error::Success();
    const int32_t ctas = persistent_ctas(m, n, groups, is_glu(epilogue), &err);
    if (ctas < 0) return internal_error(stage_message(kOp, "device", err));
    if (poison_outputs()) {
      ffi::Error e = fill_bytes(stream, kOp, 0xFF, out->untyped_data(), out->size_bytes());
      if (e.failure()) return e;
    }
    return variant->run(Call{stream, lhs, rhs, bias, tile_starts, row_starts, out,
                             static_cast<int32_t>(m), static_cast<int32_t>(k),
                             static_cast<int32_t>(n), static_cast<int32_t>(columns),
                             static_cast<int32_t>(groups), ctas});
  });
}

// The weight gradient.

template <typename Module, typename Lhs, typename Ct, typename Out, typename Rows>
ffi::Error launch_wgrad(int32_t (*wrapper)(Module*, Lhs*, Ct*, Out*, Rows*, cudaStream_t),
                        void (*load)(Module*), cudaStream_t stream, ffi::AnyBuffer& lhs,
                        ffi::AnyBuffer& ct, ffi::AnyBuffer& row_starts, ffi::AnyBuffer& out,
                        int32_t m, int32_t k, int32_t n, int32_t groups) {
  Lhs a{lhs.untyped_data(), {k, m}, {k, int64_t{m} * k}};
  Ct b{ct.untyped_data(), {n, m}, {n, int64_t{m} * n}};
  Out c{out.untyped_data(), {k, n, groups}, {n, int64_t{k} * n}};
  Rows rows{row_starts.untyped_data(), {groups + 1}};
  int32_t err = wrapper(loaded_module(load), &a, &b, &c, &rows, stream);
  if (err != 0) {
    return internal_error(stage_message("cute_grouped_wgrad", "launch",
                                        cudaGetErrorString(static_cast<cudaError_t>(err))));
  }
  return ffi::Error::Success();
}

ffi::Error cute_grouped_wgrad(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer ct,
                              ffi::AnyBuffer row_starts, ffi::Result<ffi::AnyBuffer> out) {
  constexpr const char* kWgrad = "cute_grouped_wgrad";
  return guarded(kWgrad, [&]() -> ffi::Error {
    auto ld = lhs.dimensions(), cd = ct.dimensions(), od = out->dimensions();
    if (ld.size() != 2 || cd.size() != 2 || od.size() != 3) {
      return invalid_argument(
          stage_message(kWgrad, "arguments", "lhs [M,K], ct [M,N], out [G,K,N]"));
    }
    const int64_t m = ld[0], k = ld[1], n = cd[1], groups = od[0];
    const ffi::DataType dtype = lhs.element_type();
    std::string err = expect("ct", ct, dtype, {m, n});
    if (err.empty()) err = expect("row_starts", row_starts, ffi::DataType::S32, {groups + 1});
    if (err.empty()) err = expect("out", *out, ffi::DataType::F32, {groups, k, n});
    constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
    if (err.empty() && (m > kMax || k > kMax || n > kMax || groups >= kMax)) {
      err = "dimensions past 2^31-1";
    }
    if (err.empty() && (k % 8 || n % 8)) err = "K and N must be multiples of 8 (16-byte rows)";
    if (!err.empty()) return invalid_argument(stage_message(kWgrad, "arguments", err));
    if (groups == 0 || k == 0 || n == 0) return ffi::Error::Success();
    if (poison_outputs()) {
      ffi::Error e = fill_bytes(stream, kWgrad, 0xFF, out->untyped_data(), out->size_bytes());
      if (e.failure()) return e;
    }
    const auto run = [&](auto wrapper, auto load) {
      return launch_wgrad(wrapper, load, stream, lhs, ct, row_starts, *out,
                          static_cast<int32_t>(m), static_cast<int32_t>(k),
                          static_cast<int32_t>(n), static_cast<int32_t>(groups));
    };
    switch (dtype) {
      case ffi::DataType::BF16:
        return run(cute_dsl_grouped_wgrad_bf16_wrapper, grouped_wgrad_bf16_Kernel_Module_Load);
      case ffi::DataType::F16:
        return run(cute_dsl_grouped_wgrad_f16_wrapper, grouped_wgrad_f16_Kernel_Module_Load);
      default:
        return invalid_argument(stage_message(kWgrad, "arguments", "dtype: bf16 or f16 only"));
    }
  });
}

}  // namespace
}  // namespace cudnn_jax

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudnnJaxCuteGroupedGemm, cudnn_jax::cute_grouped_gemm,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()   // lhs
                                  .Arg<xla::ffi::AnyBuffer>()   // rhs
                                  .Arg<xla::ffi::AnyBuffer>()   // bias
                                  .Arg<xla::ffi::AnyBuffer>()   // tile_starts
                                  .Arg<xla::ffi::AnyBuffer>()   // row_starts
                                  .Ret<xla::ffi::AnyBuffer>()   // out
                                  .Attr<std::string_view>(cudnn_jax::kCuteGroupedGemmEpilogue));

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudnnJaxCuteGroupedWgrad, cudnn_jax::cute_grouped_wgrad,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()   // lhs
                                  .Arg<xla::ffi::AnyBuffer>()   // ct
                                  .Arg<xla::ffi::AnyBuffer>()   // row_starts
                                  .Ret<xla::ffi::AnyBuffer>());  // out
