// One variant of NVIDIA's fused sm_90 KDA forward kernel, kda_fused, and its launcher
// cudnn_jax_kda_fwd_<flags>_<gqa> (declared in kda_cudnn.h). CMake compiles this file once
// per KDA_FUSED_FLAGS x KDA_FUSED_GQA and names the wheel's kernel source in
// CUDNN_JAX_KDA_FWD_SOURCE; the kernel is renamed per variant so the objects link together.
//
// No <cstdint> in this translation unit: the wheel's source typedefs uint64_t itself.

#if !defined(CUDNN_JAX_KDA_FWD_SOURCE) || !defined(KDA_FUSED_FLAGS) || \
    !defined(KDA_FUSED_GQA) || !defined(KDA_FUSED_SMEM_BYTES)
#error "CMake passes CUDNN_JAX_KDA_FWD_SOURCE, KDA_FUSED_FLAGS, KDA_FUSED_GQA, KDA_FUSED_SMEM_BYTES"
#endif

#define CUDNN_JAX_KDA_PASTE(prefix, flags, gqa) prefix##flags##_##gqa
#define CUDNN_JAX_KDA_VARIANT(prefix, flags, gqa) CUDNN_JAX_KDA_PASTE(prefix, flags, gqa)

#define kda_fused CUDNN_JAX_KDA_VARIANT(cudnn_jax_kda_fused_, KDA_FUSED_FLAGS, KDA_FUSED_GQA)
#include CUDNN_JAX_KDA_FWD_SOURCE

#define CUDNN_JAX_KDA_LAUNCHERS_ONLY
#include "kda_cudnn.h"

// cuda_host.BLOCK: one warpgroup per CTA.
#define CUDNN_JAX_KDA_FWD_BLOCK 128

extern "C" cudaError_t CUDNN_JAX_KDA_VARIANT(cudnn_jax_kda_fwd_, KDA_FUSED_FLAGS,
                                             KDA_FUSED_GQA)(
    const void* q, const void* k, const void* v, const float* g, const float* beta,
    const int* cu, const float* initial_state, void* o, float* final_state, int n, int h,
    int pieces, const float* a_log, const float* dt_bias, float gate_lower_bound,
    float q_scale, int hq, cudaStream_t stream) {
  if (n < 0 || h < 0 || pieces < 1) return cudaErrorInvalidValue;
  if (n == 0 || h == 0) return cudaSuccess;  // nothing to run
  // Per call rather than once: the attribute belongs to the device current now.
  cudaError_t err = cudaFuncSetAttribute(kda_fused, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         KDA_FUSED_SMEM_BYTES);
  if (err != cudaSuccess) return err;
  kda_fused<<<dim3(h, n * pieces), CUDNN_JAX_KDA_FWD_BLOCK, KDA_FUSED_SMEM_BYTES, stream>>>(
      static_cast<const __nv_bfloat16*>(q), static_cast<const __nv_bfloat16*>(k),
      static_cast<const __nv_bfloat16*>(v), g, beta, cu, initial_state,
      static_cast<__nv_bfloat16*>(o), final_state, n, h, pieces, a_log, dt_bias,
      gate_lower_bound, q_scale, hq);
  return cudaGetLastError();
}
