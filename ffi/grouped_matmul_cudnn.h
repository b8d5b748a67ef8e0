// Grouped matmul (mixture-of-experts layers) on cuDNN's MoE grouped matmul node.
#pragma once

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace cudnn_jax {

// Everything a cached grouped-matmul plan depends on, apart from the device:
// out[M,N] rows of group g = lhs rows of group g @ rhs[g], rhs stored [G,N,K] (K fastest).
struct GroupedMatmulConfig {
  xla::ffi::DataType dtype = xla::ffi::DataType::BF16;  // lhs, rhs and out
  int64_t m = 0, k = 0, n = 0, groups = 0;
};

// Builds (or finds) the plan for `config` on the current device: "" when cuDNN can serve
// it, else the reason, naming the stage that failed.
std::string grouped_matmul_check(const GroupedMatmulConfig& config);

// Bytes of the handler's workspace result for `config`; -1 with *error set when cuDNN
// cannot serve it.
int64_t grouped_matmul_workspace(const GroupedMatmulConfig& config, std::string* error);

}  // namespace cudnn_jax

XLA_FFI_DECLARE_HANDLER_SYMBOL(CudnnJaxGroupedMatmul);
