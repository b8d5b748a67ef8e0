// Helpers for TUs that build cudnn_frontend graphs: dtype mapping, the build sequence
// (validate -> lower -> heuristics -> support check -> plans), and plan execution with
// one-time autotuning on XLA's stream.
#pragma once

#include <cudnn_frontend.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>

#include "common/cudnn_runtime.h"
#include "common/errors.h"
#include "common/plan_cache.h"

namespace cudnn_jax {

namespace fe = cudnn_frontend;

std::optional<fe::DataType_t> to_cudnn_dtype(ffi::DataType dtype);

std::string dtype_name(ffi::DataType dtype);

// Message of a failed frontend call, with the op and stage named.
inline std::string stage_message(std::string_view op, std::string_view stage, fe::error_t err) {
  return stage_message(op, stage, std::string_view(err.get_message()));
}

// Validates `graph`, lowers it to a cuDNN operation graph and builds every candidate
// execution plan (heuristics mode A, then FALLBACK). Returns "" or the failure.
std::string build_graph(fe::graph::Graph& graph, cudnnHandle_t handle, std::string_view op);

// Runs `plan` on `stream` with tensors bound by uid. On the first run of a plan, times up
// to 8 candidate plans and keeps the fastest (unless CUDNN_JAX_AUTOTUNE=0).
// The workspace comes from XLA's scratch allocator.
ffi::Error run_plan(CachedPlan& plan, DeviceHandle& handle, cudaStream_t stream,
                    ffi::ScratchAllocator& scratch, std::unordered_map<int64_t, void*>& tensors,
                    std::string_view op);

}  // namespace cudnn_jax
