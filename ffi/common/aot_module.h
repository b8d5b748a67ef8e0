// Loading the cubins of an ahead-of-time compiled CuTe DSL kernel (kernels/aot.py).
#pragma once

#include <mutex>

namespace cudnn_jax {

// The kernel module of one variant, loaded onto every device on first use. XLA does not
// capture these handlers into CUDA graphs (they declare no command-buffer trait), so the
// load never runs inside a capture.
template <typename Module>
Module* loaded_module(void (*load)(Module*)) {
  static Module module;
  static std::once_flag once;
  std::call_once(once, [&] { load(&module); });
  return &module;
}

}  // namespace cudnn_jax
