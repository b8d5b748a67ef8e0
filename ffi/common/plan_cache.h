// Process-wide, bounded LRU cache of built cuDNN graphs ("plans"), shared by every op.
// Keys are strings that name the device, the op, dtypes, shapes and attributes.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <vector>
#include <unordered_map>
#include <utility>

namespace cudnn_frontend::graph {
class Graph;
}  // namespace cudnn_frontend::graph

namespace cudnn_jax {

struct CachedPlan {
  // The built graph, or null when cuDNN cannot serve the key; then `error` says why.
  // Unsupported keys are cached too, so repeated support checks stay cheap.
  std::shared_ptr<cudnn_frontend::graph::Graph> graph;
  std::string error;
  // Other graphs of the same computation (another cuDNN implementation of the op).
  // Autotuning times their plans too and moves the winner into `graph`.
  std::vector<std::shared_ptr<cudnn_frontend::graph::Graph>> alternatives;

  // Chosen execution plan; -1 until the first execution picks one (autotuning). Its name
  // (cuDNN's engine and knobs) is for diagnostics. Guarded by tune_mu.
  std::mutex tune_mu;
  int64_t plan_index = -1;
  int64_t workspace_size = 0;
  std::string plan_name;
};

struct PlanCacheInfo {
  int64_t size, capacity, hits, misses, evictions;
  int64_t recorded;  // plan runs written into a CUDA graph being captured (command buffers)
  // (key, chosen plan's name) of each entry, most recently used first; the name is empty
  // before the entry's first execution or when cuDNN cannot serve the key.
  std::vector<std::pair<std::string, std::string>> plans;
};

class PlanCache {
 public:
  // The process-wide instance. Capacity: env CUDNN_JAX_PLAN_CACHE_SIZE, default 512.
  static PlanCache& global();

  explicit PlanCache(size_t capacity) : capacity_(capacity == 0 ? 1 : capacity) {}

  // The entry for `key`, building it with `build` on a miss. The build runs outside the
  // cache lock; if two threads race on one key, the first one stored wins.
  std::shared_ptr<CachedPlan> get_or_build(const std::string& key,
                                           const std::function<std::shared_ptr<CachedPlan>()>& build);

  PlanCacheInfo info() const;

  void count_recorded() { recorded_.fetch_add(1, std::memory_order_relaxed); }

 private:
  using Lru = std::list<std::pair<std::string, std::shared_ptr<CachedPlan>>>;

  std::shared_ptr<CachedPlan> lookup_locked(const std::string& key);

  mutable std::mutex mu_;
  size_t capacity_;
  Lru lru_;  // most recently used first
  std::unordered_map<std::string, Lru::iterator> index_;
  int64_t hits_ = 0, misses_ = 0, evictions_ = 0;
  std::atomic<int64_t> recorded_{0};
};

}  // namespace cudnn_jax
