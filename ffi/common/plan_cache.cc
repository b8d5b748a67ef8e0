#include "common/plan_cache.h"

#include <cstdlib>

namespace cudnn_jax {

PlanCache& PlanCache::global() {
  static PlanCache& cache = *[] {
    size_t capacity = 512;
    if (const char* env = std::getenv("CUDNN_JAX_PLAN_CACHE_SIZE")) {
      long value = std::strtol(env, nullptr, 10);
      if (value > 0) capacity = static_cast<size_t>(value);
    }
    // Never destroyed: plans own cuDNN objects that must not be freed after cuDNN unloads.
    return new PlanCache(capacity);
  }();
  return cache;
}

std::shared_ptr<CachedPlan> PlanCache::lookup_locked(const std::string& key) {
  auto it = index_.find(key);
  if (it == index_.end()) return nullptr;
  lru_.splice(lru_.begin(), lru_, it->second);
  return it->second->second;
}

std::shared_ptr<CachedPlan> PlanCache::get_or_build(
    const std::string& key, const std::function<std::shared_ptr<CachedPlan>()>& build) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto found = lookup_locked(key)) {
      ++hits_;
      return found;
    }
    ++misses_;
  }
  std::shared_ptr<CachedPlan> built = build();
  std::lock_guard<std::mutex> lock(mu_);
  if (auto found = lookup_locked(key)) return found;
  lru_.emplace_front(key, built);
  index_[key] = lru_.begin();
  while (lru_.size() > capacity_) {
    // Callers hold shared_ptrs, so an entry evicted mid-execution stays alive until done.
    index_.erase(lru_.back().first);
    lru_.pop_back();
    ++evictions_;
  }
  return built;
}

PlanCacheInfo PlanCache::info() const {
  std::lock_guard<std::mutex> lock(mu_);
  PlanCacheInfo out{static_cast<int64_t>(lru_.size()), static_cast<int64_t>(capacity_), hits_,
                    misses_, evictions_, recorded_.load(), {}};
  for (const auto& [key, plan] : lru_) {
    std::lock_guard<std::mutex> tune_lock(plan->tune_mu);
    out.plans.emplace_back(key, plan->plan_name);
  }
  return out;
}

}  // namespace cudnn_jax
