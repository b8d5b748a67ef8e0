// cudnn_jax_grouped_matmul: the rows of each group times that group's weights, on cuDNN's
// MoE grouped matmul node (mode NONE: rows already sorted by group).
//
//   lhs [M,K], rhs [G,N,K] (K fastest: the layout the node reads on sm_90),
//   offsets [G] int32 (first row of each group, non-decreasing)  ->  out [M,N].
//
// Rows past the last group's end are not defined here; the Python engine zeroes them.

#include "grouped_matmul_cudnn.h"

#include <memory>
#include <string>
#include <unordered_map>

#include "common/buffers.h"
#include "common/cudnn_runtime.h"
#include "common/errors.h"
#include "common/graph_utils.h"
#include "common/plan_cache.h"

namespace cudnn_jax {
namespace {

constexpr const char* kOp = "grouped_matmul";
enum Uid : int64_t { kLhs = 1, kRhs, kOffsets, kOut };

std::string cache_key(const GroupedMatmulConfig& c, int device) {
  return "grouped_matmul|" + std::to_string(device) + "|" + dtype_name(c.dtype) + "|" +
         std::to_string(c.m) + "," + std::to_string(c.k) + "," + std::to_string(c.n) + "," +
         std::to_string(c.groups);
}

std::string config_error(const GroupedMatmulConfig& c) {
  const bool half = c.dtype == ffi::DataType::BF16 || c.dtype == ffi::DataType::F16;
  if (!half || !to_cudnn_dtype(c.dtype)) {
    return "dtype " + dtype_name(c.dtype) + ": bfloat16 and float16 only";
  }
  if (c.m <= 0 || c.k <= 0 || c.n <= 0 || c.groups <= 0) return "empty problem";
  return "";
}

void add_grouped_matmul(fe::graph::Graph& graph, const GroupedMatmulConfig& c,
                        fe::DataType_t io) {
  namespace g = fe::graph;
  auto lhs = graph.tensor(g::Tensor_attributes().set_name("lhs").set_uid(kLhs)
                              .set_dim({1, c.m, c.k}).set_stride({c.m * c.k, c.k, 1})
                              .set_data_type(io));
  // Logical [G,K,N] over memory [G][N][K].
  auto rhs = graph.tensor(g::Tensor_attributes().set_name("rhs").set_uid(kRhs)
                              .set_dim({c.groups, c.k, c.n}).set_stride({c.n * c.k, 1, c.k})
                              .set_data_type(io));
  auto offsets = graph.tensor(g::Tensor_attributes().set_name("offsets").set_uid(kOffsets)
                                  .set_dim({c.groups, 1, 1}).set_stride({1, 1, 1})
                                  .set_data_type(fe::DataType_t::INT32));
  auto attrs = g::Moe_grouped_matmul_attributes()
                   .set_name("grouped_matmul")
                   .set_mode(fe::MoeGroupedMatmulMode_t::NONE)
                   .set_compute_data_type(fe::DataType_t::FLOAT);
  auto out = graph.moe_grouped_matmul(lhs, rhs, offsets, nullptr, nullptr, attrs);
  out->set_output(true).set_uid(kOut).set_data_type(io)
      .set_dim({1, c.m, c.n}).set_stride({c.m * c.n, c.n, 1});
}

std::shared_ptr<CachedPlan> build_plan(const GroupedMatmulConfig& c, int device,
                                       DeviceHandle& handle) {
  const std::optional<fe::DataType_t> io = to_cudnn_dtype(c.dtype);
  return build_cached_plan(kOp, config_error(c), device, handle, io,
                           [&](fe::graph::Graph& graph) { add_grouped_matmul(graph, c, *io); });
}

PlanLookup lookup_of(const GroupedMatmulConfig& c) {
  return [c](int device, DeviceHandle** handle, std::string* error) {
    return find_plan(kOp, cache_key(c, device), device, handle,
                     [&](DeviceHandle& h) { return build_plan(c, device, h); }, error);
  };
}

ffi::Error grouped_matmul(cudaStream_t stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                          ffi::AnyBuffer offsets, ffi::Result<ffi::AnyBuffer> out,
                          ffi::Result<ffi::AnyBuffer> workspace) {
  return guarded(kOp, [&]() -> ffi::Error {
    GroupedMatmulConfig c;
    c.dtype = lhs.element_type();
    auto ld = lhs.dimensions(), rd = rhs.dimensions();
    if (ld.size() != 2 || rd.size() != 3) {
      return invalid_argument(stage_message(kOp, "arguments", "lhs [M,K], rhs [G,N,K]"));
    }
    c.m = ld[0], c.k = ld[1], c.groups = rd[0], c.n = rd[1];
    std::string err = expect("rhs", rhs, c.dtype, {c.groups, c.n, c.k});
    if (err.empty()) err = expect("offsets", offsets, ffi::DataType::S32, {c.groups});
    if (err.empty()) err = expect("out", *out, c.dtype, {c.m, c.n});
    if (!err.empty()) return invalid_argument(stage_message(kOp, "arguments", err));

    std::shared_ptr<CachedPlan> plan;
    DeviceHandle* handle = nullptr;
    if (ffi::Error e = plan_on_stream(kOp, stream, lookup_of(c), &plan, &handle); e.failure()) {
      return e;
    }
    if (ffi::Error e = prefill(stream, kOp, false, {&*out}); e.failure()) return e;
    std::unordered_map<int64_t, void*> tensors = {
        {kLhs, lhs.untyped_data()},
        {kRhs, rhs.untyped_data()},
        {kOffsets, offsets.untyped_data()},
        {kOut, out->untyped_data()},
    };
    return run_plan(*plan, *handle, stream, workspace_of(*workspace), tensors, kOp);
  });
}

}  // namespace

std::string grouped_matmul_check(const GroupedMatmulConfig& config) {
  return plan_check(kOp, lookup_of(config));
}

int64_t grouped_matmul_workspace(const GroupedMatmulConfig& config, std::string* error) {
  return plan_workspace_bytes(kOp, lookup_of(config), error);
}

}  // namespace cudnn_jax

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudnnJaxGroupedMatmul, cudnn_jax::grouped_matmul,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()   // lhs
                                  .Arg<xla::ffi::AnyBuffer>()   // rhs
                                  .Arg<xla::ffi::AnyBuffer>()   // offsets
                                  .Ret<xla::ffi::AnyBuffer>()   // out
                                  .Ret<xla::ffi::AnyBuffer>(),  // workspace (u8)
                              {xla::ffi::Traits::kCmdBufferCompatible});
