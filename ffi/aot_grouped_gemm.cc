// cudnn_jax_cute_grouped_gemm: grouped GEMM on the ahead-of-time compiled CuTe DSL kernel
// kernels/grouped_gemm_sm90.py (WGMMA + TMA, group sizes read on the device).
//
//   lhs [M,K], rhs [G,K,N] (as stored: N fastest), tile_starts [G+1] int32, row_starts
//   [G+1] int32 (exclusive cumulative sums of ceil(size/128) and of the sizes, clamped to
//   M)  ->  out [M,N], lhs's dtype. Rows past row_starts[G] are left unwritten.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <limits>
#include <string>

#include "aot_kernels.h"
#include "aot_kernels_ffi.h"
#include "common/aot_module.h"
#include "common/buffers.h"
#include "common/errors.h"
#include "common/graph_utils.h"
#include "xla/ffi/api/ffi.h"

namespace cudnn_jax {
namespace {

constexpr const char* kOp = "cute_grouped_gemm";

// The launch shared by the dtype variants; their tensor structs differ only in type.
template <typename Module, typename Lhs, typename Rhs, typename Out, typename Tiles,
          typename Rows>
ffi::Error launch(void (*load)(Module*),
                  int32_t (*wrapper)(Module*, Lhs*, Rhs*, Out*, Tiles*, Rows*, cudaStream_t),
                  cudaStream_t stream, ffi::AnyBuffer& lhs, ffi::AnyBuffer& rhs,
                  ffi::AnyBuffer& tile_starts, ffi::AnyBuffer& row_starts,
                  ffi::AnyBuffer& out, int32_t m, int32_t k, int32_t n, int32_t groups) {
  Lhs a{lhs.untyped_data(), {m, k}, {k, int64_t{m} * k}};
  Rhs b{rhs.untyped_data(), {n, k, groups}, {n, int64_t{k} * n}};
  Out c{out.untyped_data(), {m, n}, {n, int64_t{m} * n}};
  Tiles tiles{tile_starts.untyped_data(), {groups + 1}};
  Rows rows{row_starts.untyped_data(), {groups + 1}};
  int32_t err = wrapper(loaded_module(load), &a, &b, &c, &tiles, &rows, stream);
  if (err != 0) {
    return internal_error(
        stage_message(kOp, "launch", cudaGetErrorString(static_cast<cudaError_t>(err))));
  }
  return ffi::Error::Success();
}

ffi::Error cute_grouped_gemm(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                             ffi::AnyBuffer tile_starts, ffi::AnyBuffer row_starts,
                             ffi::Result<ffi::AnyBuffer> out) {
  auto ld = lhs.dimensions(), rd = rhs.dimensions();
  if (ld.size() != 2 || rd.size() != 3) {
    return invalid_argument(stage_message(kOp, "arguments", "lhs [M,K], rhs [G,K,N]"));
  }
  const int64_t m = ld[0], k = ld[1], groups = rd[0], n = rd[2];
  const ffi::DataType dtype = lhs.element_type();
  std::string err = expect("rhs", rhs, dtype, {groups, k, n});
  if (err.empty()) err = expect("tile_starts", tile_starts, ffi::DataType::S32, {groups + 1});
  if (err.empty()) err = expect("row_starts", row_starts, ffi::DataType::S32, {groups + 1});
  if (err.empty()) err = expect("out", *out, dtype, {m, n});
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (err.empty() && (m > kMax || k > kMax || n > kMax || groups >= kMax)) {
    err = "dimensions past 2^31-1";
  }
  if (err.empty() && (k % 8 || n % 8)) err = "K and N must be multiples of 8 (16-byte rows)";
  if (!err.empty()) return invalid_argument(stage_message(kOp, "arguments", err));
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (poison_outputs()) {
    ffi::Error e = fill_bytes(stream, kOp, 0xFF, out->untyped_data(), out->size_bytes());
    if (e.failure()) return e;
  }
  const auto run = [&](auto wrapper, auto load) {
    return launch(load, wrapper, stream, lhs, rhs, tile_starts, row_starts, *out,
                  static_cast<int32_t>(m), static_cast<int32_t>(k), static_cast<int32_t>(n),
                  static_cast<int32_t>(groups));
  };
  switch (dtype) {
    case ffi::DataType::BF16:
      return run(cute_dsl_grouped_gemm_bf16_wrapper, grouped_gemm_bf16_Kernel_Module_Load);
    case ffi::DataType::F16:
      return run(cute_dsl_grouped_gemm_f16_wrapper, grouped_gemm_f16_Kernel_Module_Load);
    default:
      return invalid_argument(stage_message(kOp, "arguments", "dtype: bf16 or f16 only"));
  }
}

}  // namespace
}  // namespace cudnn_jax

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudnnJaxCuteGroupedGemm, cudnn_jax::cute_grouped_gemm,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()   // lhs
                                  .Arg<xla::ffi::AnyBuffer>()   // rhs
                                  .Arg<xla::ffi::AnyBuffer>()   // tile_starts
                                  .Arg<xla::ffi::AnyBuffer>()   // row_starts
                                  .Ret<xla::ffi::AnyBuffer>());  // out
