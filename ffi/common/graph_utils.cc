#include "common/graph_utils.h"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

namespace cudnn_jax {
namespace {

constexpr int kMaxTunedCandidates = 8;
constexpr int kTimedRuns = 3;
// cuDNN wants 256-byte aligned workspaces; XLA aligns buffers less, so the workspace result
// is over-sized by this much and rounded up.
constexpr uintptr_t kWorkspaceAlignment = 256;

bool autotune_enabled() {
  const char* env = std::getenv("CUDNN_JAX_AUTOTUNE");
  return env == nullptr || std::string_view(env) != "0";
}

// Workspace of plan `index`, or -1 when that candidate failed to build.
int64_t plan_workspace(const fe::graph::Graph& graph, int64_t index) {
  int64_t size = 0;
  if (graph.get_workspace_size_plan_at_index(index, size).is_bad()) return -1;
  return size;
}

// One candidate: an execution plan of one of the entry's graphs.
struct Candidate {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t index;
};

// Built candidates of every graph of `plan`, each graph's in heuristic order, at most
// `limit` per graph.
std::vector<Candidate> built_candidates(const CachedPlan& plan, int limit) {
  std::vector<Candidate> out;
  std::vector<std::shared_ptr<fe::graph::Graph>> graphs = {plan.graph};
  graphs.insert(graphs.end(), plan.alternatives.begin(), plan.alternatives.end());
  for (const auto& graph : graphs) {
    int taken = 0;
    int64_t count = graph->get_execution_plan_count();
    for (int64_t i = 0; i < count && taken < limit; ++i) {
      if (plan_workspace(*graph, i) >= 0) out.push_back({graph, i}), ++taken;
    }
  }
  return out;
}

// The candidates the first run chooses among: up to kMaxTunedCandidates per graph when
// autotuning, else the heuristic's first.
std::vector<Candidate> tuning_candidates(const CachedPlan& plan) {
  return built_candidates(plan, autotune_enabled() ? kMaxTunedCandidates : 1);
}

// cuDNN's workspace: `workspace` rounded up to kWorkspaceAlignment; false when fewer than
// `size` bytes remain from there.
bool aligned_workspace(const Workspace& workspace, int64_t size, void** out) {
  *out = nullptr;
  if (size <= 0) return true;
  uintptr_t p = reinterpret_cast<uintptr_t>(workspace.data);
  uintptr_t aligned = (p + kWorkspaceAlignment - 1) & ~(kWorkspaceAlignment - 1);
  if (workspace.data == nullptr ||
      static_cast<int64_t>(aligned - p) + size > workspace.size) {
    return false;
  }
  *out = reinterpret_cast<void*>(aligned);
  return true;
}

ffi::Error workspace_error(std::string_view op, std::string_view stage, int64_t size,
                           const Workspace& workspace) {
  return internal_error(stage_message(
      op, stage, "the workspace result holds " + std::to_string(workspace.size) +
                     " bytes; the plan needs " + std::to_string(size) +
                     " (aligned to " + std::to_string(kWorkspaceAlignment) + ")"));
}

cudaStreamCaptureStatus capture_status(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    cudaGetLastError();
    return cudaStreamCaptureStatusNone;
  }
  return status;
}

// Whether `stream` is recording a CUDA graph (XLA's command buffers): nothing may wait on
// the device then, so no timing.
bool capturing(cudaStream_t stream) {
  return capture_status(stream) != cudaStreamCaptureStatusNone;
}

const char* capture_text(cudaStream_t stream) {
  switch (capture_status(stream)) {
    case cudaStreamCaptureStatusNone: return "not capturing";
    case cudaStreamCaptureStatusActive: return "capturing";
    default: return "capture invalidated";
  }
}

struct Events {
  cudaEvent_t start = nullptr, stop = nullptr;
  ~Events() {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
  }
};

// When `status` says the variant pack lacks a tensor: the uids `graph` binds at execution
// beside those given, so the message names both sides of the mismatch; else "".
std::string variant_pack_text(const fe::graph::Graph& graph, fe::error_t status,
                              const std::unordered_map<int64_t, void*>& tensors) {
  if (status.get_code() != fe::error_code_t::INVALID_VARIANT_PACK) return "";
  auto join = [](std::vector<int64_t> uids) {
    std::sort(uids.begin(), uids.end());
    std::string out;
    for (int64_t uid : uids) out += (out.empty() ? "" : ",") + std::to_string(uid);
    return out;
  };
  std::vector<int64_t> given;
  for (const auto& [uid, ptr] : tensors) given.push_back(uid);
  return " (the graph binds uids [" + join(graph.get_variant_pack_uids_sorted()) +
         "]; given [" + join(given) + "])";
}

// Milliseconds for kTimedRuns executions of plan `index` after one warm-up, or a
// negative value when the plan fails to run (then `why` says why).
float time_plan(const fe::graph::Graph& graph, cudnnHandle_t handle, cudaStream_t stream,
                std::unordered_map<int64_t, void*>& tensors, void* workspace, int64_t index,
                Events& ev, std::string* why) {
  auto run = [&]() {
    fe::error_t status = graph.execute_plan_at_index(handle, tensors, workspace, index);
    if (status.is_bad()) *why = status.get_message() + variant_pack_text(graph, status, tensors);
    return status.is_good();
  };
  auto cuda = [&](cudaError_t e) {
    if (e != cudaSuccess) *why = cudaGetErrorString(e);
    return e == cudaSuccess;
  };
  if (!run() || !cuda(cudaEventRecord(ev.start, stream))) return -1.f;
  for (int i = 0; i < kTimedRuns; ++i) {
    if (!run()) return -1.f;
  }
  if (!cuda(cudaEventRecord(ev.stop, stream)) || !cuda(cudaEventSynchronize(ev.stop))) {
    return -1.f;
  }
  float ms = -1.f;
  if (!cuda(cudaEventElapsedTime(&ms, ev.start, ev.stop))) return -1.f;
  return ms;
}

// The candidates whose workspace fits `workspace`, in order.
std::vector<Candidate> fitting_candidates(const CachedPlan& plan, const Workspace& workspace) {
  std::vector<Candidate> out;
  for (const Candidate& c : tuning_candidates(plan)) {
    void* unused;
    if (aligned_workspace(workspace, plan_workspace(*c.graph, c.index), &unused)) {
      out.push_back(c);
    }
  }
  return out;
}

// Picks plan.plan_index: the fastest timed candidate, or the heuristic's first choice
// (autotuning off). Candidates whose workspace does not fit `workspace` are skipped.
ffi::Error choose_plan(CachedPlan& plan, cudnnHandle_t handle, cudaStream_t stream,
                       const Workspace& workspace, std::unordered_map<int64_t, void*>& tensors,
                       std::string_view op) {
  std::vector<Candidate> candidates = fitting_candidates(plan, workspace);
  if (candidates.empty()) {
    return internal_error(stage_message(op, "autotune", "no built plan fits the workspace"));
  }
  if (!autotune_enabled()) candidates.resize(1);
  auto keep = [&plan](const Candidate& best) {
    plan.graph = best.graph;
    plan.alternatives.clear();  // the losers' plans are not needed any more
    plan.plan_index = best.index;
    plan.workspace_size = plan_workspace(*best.graph, best.index);
    if (best.graph->get_plan_name_at_index(best.index, plan.plan_name).is_bad()) {
      plan.plan_name = "plan #" + std::to_string(best.index);
    }
  };
  if (candidates.size() == 1) {
    keep(candidates[0]);
    return ffi::Error::Success();
  }
  int64_t max_workspace = 0;
  for (const Candidate& c : candidates) {
    max_workspace = std::max(max_workspace, plan_workspace(*c.graph, c.index));
  }
  void* scratch = nullptr;
  aligned_workspace(workspace, max_workspace, &scratch);  // every candidate fits
  Events ev;
  if (cudaEventCreate(&ev.start) != cudaSuccess || cudaEventCreate(&ev.stop) != cudaSuccess) {
    return internal_error(stage_message(op, "autotune", "cudaEventCreate failed"));
  }
  const Candidate* best = nullptr;
  float best_ms = std::numeric_limits<float>::max();
  std::string first_failure;
  for (const Candidate& c : candidates) {
    std::string why;
    float ms = time_plan(*c.graph, handle, stream, tensors, scratch, c.index, ev, &why);
    if (ms < 0.f && first_failure.empty()) first_failure = why;
    if (ms >= 0.f && ms < best_ms) {
      best_ms = ms;
      best = &c;
    }
  }
  // A failed run can leave a sticky error on the stream's context; clear a non-sticky one.
  cudaGetLastError();
  if (best == nullptr) {
    return internal_error(stage_message(
        op, "autotune",
        "no candidate plan executed (" + std::to_string(candidates.size()) +
            " tried; the first failed with: " + first_failure + ")"));
  }
  keep(*best);
  return ffi::Error::Success();
}

}  // namespace

std::optional<fe::DataType_t> to_cudnn_dtype(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::BF16: return fe::DataType_t::BFLOAT16;
    case ffi::DataType::F16: return fe::DataType_t::HALF;
    case ffi::DataType::F32: return fe::DataType_t::FLOAT;
    case ffi::DataType::F64: return fe::DataType_t::DOUBLE;
    case ffi::DataType::S8: return fe::DataType_t::INT8;
    case ffi::DataType::S32: return fe::DataType_t::INT32;
    case ffi::DataType::S64: return fe::DataType_t::INT64;
    case ffi::DataType::U8: return fe::DataType_t::UINT8;
    case ffi::DataType::PRED: return fe::DataType_t::BOOLEAN;
    case ffi::DataType::F8E4M3FN: return fe::DataType_t::FP8_E4M3;
    case ffi::DataType::F8E5M2: return fe::DataType_t::FP8_E5M2;
    default: return std::nullopt;
  }
}

std::string dtype_name(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::PRED: return "bool";
    default: return "dtype#" + std::to_string(static_cast<int>(dtype));
  }
}

std::string build_graph(fe::graph::Graph& graph, cudnnHandle_t handle, std::string_view op,
                        const std::vector<fe::NumericalNote_t>& excluded) {
  if (auto err = graph.validate(); err.is_bad()) return stage_message(op, "validate", err);
  if (auto err = graph.build_operation_graph(handle); err.is_bad()) {
    return stage_message(op, "build_operation_graph", err);
  }
  if (auto err = graph.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
      err.is_bad()) {
    return stage_message(op, "create_execution_plans", err);
  }
  if (!excluded.empty()) graph.deselect_numeric_notes(excluded);
  if (auto err = graph.check_support(handle); err.is_bad()) {
    return stage_message(op, "check_support", err);
  }
  fe::BuildPlanPolicy_t policy =
      autotune_enabled() ? fe::BuildPlanPolicy_t::ALL : fe::BuildPlanPolicy_t::HEURISTICS_CHOICE;
  if (auto err = graph.build_plans(handle, policy); err.is_bad()) {
    return stage_message(op, "build_plans", err);
  }
  return "";
}

std::shared_ptr<CachedPlan> build_cached_plan(
    std::string_view op, const std::string& config_error, int device, DeviceHandle& handle,
    std::optional<fe::DataType_t> io, const AddNodes& add,
    const std::vector<AddNodes>& alternatives,
    const std::vector<fe::NumericalNote_t>& excluded) {
  auto plan = std::make_shared<CachedPlan>();
  try {
    if (!config_error.empty()) {
      plan->error = stage_message(op, "config", config_error);
      return plan;
    }
    std::string err;
    int sm = sm_version(device, &err);
    if (sm < 0) {
      plan->error = stage_message(op, "device", err);
      return plan;
    }
    auto graph = new_graph(*io, sm);
    add(*graph);
    std::lock_guard<std::mutex> lock(handle.mu);
    if (std::string why = build_graph(*graph, handle.handle, op, excluded); !why.empty()) {
      plan->error = why;
      return plan;
    }
    plan->graph = std::move(graph);
    for (const AddNodes& other : alternatives) {
      auto alternative = new_graph(*io, sm);
      other(*alternative);
      if (build_graph(*alternative, handle.handle, op, excluded).empty()) {
        plan->alternatives.push_back(std::move(alternative));
      }
    }
  } catch (const std::exception& e) {
    plan->error = stage_message(op, "build", e.what());
  }
  return plan;
}

int64_t workspace_bound(CachedPlan& plan) {
  std::lock_guard<std::mutex> tune_lock(plan.tune_mu);
  int64_t size = plan.workspace_size;
  if (plan.plan_index < 0) {
    for (const Candidate& c : tuning_candidates(plan)) {
      size = std::max(size, plan_workspace(*c.graph, c.index));
    }
  }
  return size > 0 ? size + static_cast<int64_t>(kWorkspaceAlignment) : 0;
}

ffi::Error run_plan(CachedPlan& plan, DeviceHandle& handle, cudaStream_t stream,
                    const Workspace& workspace, std::unordered_map<int64_t, void*>& tensors,
                    std::string_view op) {
  std::lock_guard<std::mutex> handle_lock(handle.mu);
  if (std::string err = set_handle_stream(handle, stream); !err.empty()) {
    return internal_error(
        stage_message(op, "set_stream", err + " (stream " + capture_text(stream) + ")"));
  }
  const bool recording = capturing(stream);
  Candidate run;
  int64_t size = 0;
  {
    std::lock_guard<std::mutex> tune_lock(plan.tune_mu);
    if (plan.plan_index < 0 && recording) {
      // A CUDA graph is being recorded, so nothing can be timed: this run takes the
      // heuristic's choice and leaves the choice to the first run outside a graph.
      std::vector<Candidate> candidates = fitting_candidates(plan, workspace);
      if (candidates.empty()) {
        return internal_error(stage_message(op, "plan", "no built plan fits the workspace"));
      }
      run = candidates[0];
      size = plan_workspace(*run.graph, run.index);
    } else {
      if (plan.plan_index < 0) {
        if (ffi::Error err = choose_plan(plan, handle.handle, stream, workspace, tensors, op);
            err.failure()) {
          return err;
        }
      }
      run = {plan.graph, plan.plan_index};
      size = plan.workspace_size;
    }
  }

  if (recording) PlanCache::global().count_recorded();
  void* aligned = nullptr;
  if (!aligned_workspace(workspace, size, &aligned)) {
    return workspace_error(op, "workspace", size, workspace);
  }
  if (auto err = run.graph->execute_plan_at_index(handle.handle, tensors, aligned, run.index);
      err.is_bad()) {
    return internal_error(stage_message(
        op, "execute", err.get_message() + variant_pack_text(*run.graph, err, tensors)));
  }
  return ffi::Error::Success();
}

std::shared_ptr<fe::graph::Graph> new_graph(fe::DataType_t io, int sm) {
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(io)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  graph->set_sm_version(sm);
  return graph;
}

std::shared_ptr<CachedPlan> find_plan(
    std::string_view op, const std::string& key, int device, DeviceHandle** handle,
    const std::function<std::shared_ptr<CachedPlan>(DeviceHandle&)>& build, std::string* error) {
  if (const std::string& why = load_cudnn(); !why.empty()) {
    *error = stage_message(op, "load", why);
    return nullptr;
  }
  std::string err;
  *handle = device_handle(device, &err);
  if (*handle == nullptr) {
    *error = stage_message(op, "handle", err);
    return nullptr;
  }
  DeviceHandle& h = **handle;
  auto plan = PlanCache::global().get_or_build(key, [&] { return build(h); });
  if (!plan->graph) {
    *error = plan->error;
    return nullptr;
  }
  return plan;
}

int stream_device(cudaStream_t stream, std::string* error) {
  // While XLA records a CUDA graph, only capture-safe calls may touch the stream; the
  // device XLA runs the call on is then the thread's current one.
  int device = -1;
  if (!capturing(stream) && cudaStreamGetDevice(stream, &device) == cudaSuccess) return device;
  cudaGetLastError();
  return current_device(error);
}

namespace {

std::string dims_text(ffi::Span<const int64_t> dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? "," : "") + std::to_string(dims[i]);
  return out + "]";
}

}  // namespace

std::string expect(const char* name, const ffi::AnyBuffer& buf, ffi::DataType dtype,
                   std::initializer_list<int64_t> dims) {
  if (buf.element_type() != dtype) {
    return std::string(name) + ": expected dtype " + dtype_name(dtype) + ", got " +
           dtype_name(buf.element_type());
  }
  auto got = buf.dimensions();
  bool same = got.size() == dims.size();
  for (size_t i = 0; same && i < dims.size(); ++i) same = got[i] == dims.begin()[i];
  if (!same) {
    std::string want = "[";
    size_t i = 0;
    for (int64_t d : dims) want += (i++ ? "," : "") + std::to_string(d);
    return std::string(name) + ": expected shape " + want + "], got " + dims_text(got);
  }
  return "";
}

namespace {

// The plan on the current device, or null with *error set.
std::shared_ptr<CachedPlan> current_device_plan(std::string_view op, const PlanLookup& lookup,
                                                std::string* error) {
  int device = current_device(error);
  if (device < 0) {
    *error = stage_message(op, "device", *error);
    return nullptr;
  }
  try {
    DeviceHandle* handle = nullptr;
    return lookup(device, &handle, error);
  } catch (const std::exception& e) {
    *error = stage_message(op, "exception", e.what());
    return nullptr;
  }
}

}  // namespace

std::string plan_check(std::string_view op, const PlanLookup& lookup) {
  std::string err;
  return current_device_plan(op, lookup, &err) ? "" : err;
}

int64_t plan_workspace_bytes(std::string_view op, const PlanLookup& lookup, std::string* error) {
  std::shared_ptr<CachedPlan> plan = current_device_plan(op, lookup, error);
  return plan ? workspace_bound(*plan) : -1;
}

ffi::Error plan_on_stream(std::string_view op, cudaStream_t stream, const PlanLookup& lookup,
                          std::shared_ptr<CachedPlan>* plan, DeviceHandle** handle) {
  std::string err;
  int device = stream_device(stream, &err);
  if (device < 0) return internal_error(stage_message(op, "device", err));
  *plan = lookup(device, handle, &err);
  if (!*plan) return ffi::Error(ffi::ErrorCode::kUnimplemented, err);
  return ffi::Error::Success();
}

}  // namespace cudnn_jax
