// Helpers for TUs that build cudnn_frontend graphs: dtype mapping, the build sequence
// (validate -> lower -> heuristics -> support check -> plans), and plan execution with
// one-time autotuning on XLA's stream, in a workspace XLA owns.
#pragma once

#include <cudnn_frontend.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

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

// An empty graph for `sm` with `io` tensors and float32 intermediates and compute.
std::shared_ptr<fe::graph::Graph> new_graph(fe::DataType_t io, int sm);

// Validates `graph`, lowers it to a cuDNN operation graph and builds every candidate
// execution plan (heuristics mode A, then FALLBACK) except those carrying a numerical note
// of `excluded`. Returns "" or the failure.
std::string build_graph(fe::graph::Graph& graph, cudnnHandle_t handle, std::string_view op,
                        const std::vector<fe::NumericalNote_t>& excluded = {});

// Adds an op's nodes to an empty graph.
using AddNodes = std::function<void(fe::graph::Graph&)>;

// A plan of `op` on `device`, or one that holds why not (the stage named): the config's
// own check (`config_error`, "" when valid), the device's compute capability, then a graph
// of `io` tensors with `add`'s nodes, built under the handle's lock without plans carrying
// an `excluded` note. Each of `alternatives` that builds too is kept for autotuning.
std::shared_ptr<CachedPlan> build_cached_plan(
    std::string_view op, const std::string& config_error, int device, DeviceHandle& handle,
    std::optional<fe::DataType_t> io, const AddNodes& add,
    const std::vector<AddNodes>& alternatives = {},
    const std::vector<fe::NumericalNote_t>& excluded = {});

// cuDNN's workspace: a u8 result of the custom call, sized when the call is lowered, so
// that XLA owns it (and could capture the call into a CUDA graph).
struct Workspace {
  void* data = nullptr;
  int64_t size = 0;
};

inline Workspace workspace_of(ffi::AnyBuffer& buffer) {
  return {buffer.untyped_data(), static_cast<int64_t>(buffer.size_bytes())};
}

// Bytes the workspace result of a call of `plan` needs: the chosen plan's or, before the
// first execution, the largest of the candidates autotuning would time; alignment included.
int64_t workspace_bound(CachedPlan& plan);

// How an op finds (or builds) its cached plan on a device: null with *error set when cuDNN
// cannot serve the configuration.
using PlanLookup = std::function<std::shared_ptr<CachedPlan>(int device, DeviceHandle** handle,
                                                             std::string* error)>;

// An op's support check on the current device: "" or why cuDNN cannot serve (the failing
// stage named). Builds and caches the plan.
std::string plan_check(std::string_view op, const PlanLookup& lookup);

// Bytes of the op's workspace result on the current device; -1 with *error set when cuDNN
// cannot serve the configuration.
int64_t plan_workspace_bytes(std::string_view op, const PlanLookup& lookup, std::string* error);

// A handler call's plan and handle on the device of `stream`. An unsupported configuration
// is the caller's error (engines ask the op's check first): kUnimplemented with the reason.
ffi::Error plan_on_stream(std::string_view op, cudaStream_t stream, const PlanLookup& lookup,
                          std::shared_ptr<CachedPlan>* plan, DeviceHandle** handle);

// Runs `plan` on `stream` with tensors bound by uid. On the first run of a plan, times up
// to 8 candidate plans that fit `workspace` and keeps the fastest (the heuristic's first
// choice with CUDNN_JAX_AUTOTUNE=0). A run recorded into a CUDA graph before that takes the
// heuristic's choice without keeping it.
ffi::Error run_plan(CachedPlan& plan, DeviceHandle& handle, cudaStream_t stream,
                    const Workspace& workspace, std::unordered_map<int64_t, void*>& tensors,
                    std::string_view op);

// The cached plan of `key` on `device`, built by `build` on a miss (cuDNN loaded and the
// device's handle created first); null with *error set when cuDNN cannot serve the key.
std::shared_ptr<CachedPlan> find_plan(
    std::string_view op, const std::string& key, int device, DeviceHandle** handle,
    const std::function<std::shared_ptr<CachedPlan>(DeviceHandle&)>& build, std::string* error);

// The device `stream` belongs to (the current device when CUDA cannot say), or -1.
int stream_device(cudaStream_t stream, std::string* error);

// Checks a buffer's dtype and shape; "" when they match, else what differs.
std::string expect(const char* name, const ffi::AnyBuffer& buf, ffi::DataType dtype,
                   std::initializer_list<int64_t> dims);

}  // namespace cudnn_jax
