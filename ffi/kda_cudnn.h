// Kimi Delta Attention (KDA) on sm_90: NVIDIA's fused forward and backward CUDA kernels,
// compiled from the sources of the nvidia-cudnn-frontend wheel (see README.md). Built only
// when CMake found those sources with the pinned hashes (CUDNN_JAX_HAVE_KDA_SM90).
//
// The kernel translation units (kda_sm90_*.cu) include this header with
// CUDNN_JAX_KDA_LAUNCHERS_ONLY defined: they see the launchers alone, in plain C types,
// because the wheel's sources declare their own fixed-width integer types.
#pragma once

#include <cuda_runtime_api.h>
#include <stddef.h>

// The forward's compiled variants, X(flags, gqa): flags 1 l2-normalises q and k, 2 applies
// the lower-bound ("safe") gate, 4 a sigmoid to beta; gqa 1 when v has more heads than q/k.
#define CUDNN_JAX_KDA_FWD_VARIANTS(X)                                                 \
  X(0, 0) X(0, 1) X(1, 0) X(1, 1) X(2, 0) X(2, 1) X(3, 0) X(3, 1) X(4, 0) X(4, 1)      \
  X(5, 0) X(5, 1) X(6, 0) X(6, 1) X(7, 0) X(7, 1)

// One kda_fused launch on `stream`, grid (h, n * pieces), as cuda_host.launch does it: q, k
// [T,hq,128] bf16; v [T,h,128] bf16; g [T,h,128], beta [T,h] f32; cu [n+1] int32;
// initial_state, final_state [n,h,128,128] f32; o [T,h,128] bf16; a_log [h], dt_bias
// [h,128] f32 (read with flag 2 only). Returns the launch's error.
#define CUDNN_JAX_KDA_FWD_DECLARE(flags, gqa)                                           \
  cudaError_t cudnn_jax_kda_fwd_##flags##_##gqa(                                        \
      const void* q, const void* k, const void* v, const float* g, const float* beta,   \
      const int* cu, const float* initial_state, void* o, float* final_state, int n,    \
      int h, int pieces, const float* a_log, const float* dt_bias,                      \
      float gate_lower_bound, float q_scale, int hq, cudaStream_t stream);

extern "C" {

CUDNN_JAX_KDA_FWD_VARIANTS(CUDNN_JAX_KDA_FWD_DECLARE)

// Bytes of the backward's workspace for t tokens, h heads and n sequences (the kernels'
// scratch arena, every part 256-byte aligned).
size_t cudnn_jax_kda_bwd_workspace(int t, int h, int n);

// The backward (k_meta unless `whole`, k_prep, k_scan_t, k_bwd) on `stream`, as
// cuda_bwd_host.launch does it. `whole`: one sequence of all t tokens (n == 1, cu unread).
// Tensors as in the forward with h heads; dq, dk, dv bf16; dg, dbeta, d_initial_state f32;
// `workspace` holds cudnn_jax_kda_bwd_workspace(t, h, n) bytes.
cudaError_t cudnn_jax_kda_bwd(void* workspace, const void* d_o, const void* q, const void* k,
                              const void* v, const float* g, const float* beta, const int* cu,
                              const float* initial_state, const float* d_final_state,
                              void* dq, void* dk, void* dv, float* dg, float* dbeta,
                              float* d_initial_state, int t, int h, int n, int whole,
                              cudaStream_t stream);

// The most row sets cudnn_jax_kda_zero_unserved takes.
#define CUDNN_JAX_KDA_MAX_ROW_SETS 5

// Zeroes row `token` (row_bytes[i] bytes at data[i] + token * row_bytes[i], for each of the
// `count` row sets) of every token in [0, t) that no served sequence holds: no i with
// cu[i] <= token < cu[i+1] and served[i] != 0. cu [n+1] int32 is non-decreasing.
cudaError_t cudnn_jax_kda_zero_unserved(const int* cu, const int* served, int n, int t,
                                        void* const* data, const size_t* row_bytes, int count,
                                        cudaStream_t stream);

}  // extern "C"

#ifndef CUDNN_JAX_KDA_LAUNCHERS_ONLY

#include <cstdint>

#include "xla/ffi/api/ffi.h"

// The attributes of the handlers, declared once as X(name, C++ type, default); a handler
// takes every one of its list and no other.
#define CUDNN_JAX_KDA_FWD_ATTRIBUTES(X)                                                  \
  X(flags, int32_t, 0)               /* 0..7: 1 l2norm q/k, 2 safe gate, 4 beta sigmoid */ \
  X(segmented, bool, false)          /* split each sequence into pieces across CTAs */    \
  X(gate_lower_bound, float, -5.f)   /* the safe gate's lower bound (flag 2) */           \
  X(q_scale, float, 0.08838834764831845f) /* query scale, 1/sqrt(128) by default */       \
  X(zero_unserved, bool, false)      /* zero o's rows of tokens no served sequence holds */

#define CUDNN_JAX_KDA_BWD_ATTRIBUTES(X)                                                  \
  X(whole, bool, false)          /* one sequence of all T tokens (N == 1, cu unread) */   \
  X(zero_unserved, bool, false)  /* zero dq, dk, dv, dg, dbeta rows of unserved tokens */

namespace cudnn_jax {

struct KdaFwdConfig {
#define CUDNN_JAX_KDA_FIELD(name, type, init) type name = init;
  CUDNN_JAX_KDA_FWD_ATTRIBUTES(CUDNN_JAX_KDA_FIELD)
};
struct KdaBwdConfig {
  CUDNN_JAX_KDA_BWD_ATTRIBUTES(CUDNN_JAX_KDA_FIELD)
#undef CUDNN_JAX_KDA_FIELD
};

#define CUDNN_JAX_KDA_NAME(name, type, init) #name,
inline constexpr const char* kKdaFwdAttributeNames[] = {
    CUDNN_JAX_KDA_FWD_ATTRIBUTES(CUDNN_JAX_KDA_NAME)};
inline constexpr const char* kKdaBwdAttributeNames[] = {
    CUDNN_JAX_KDA_BWD_ATTRIBUTES(CUDNN_JAX_KDA_NAME)};
#undef CUDNN_JAX_KDA_NAME

}  // namespace cudnn_jax

XLA_FFI_DECLARE_HANDLER_SYMBOL(CudnnJaxKdaFwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CudnnJaxKdaBwd);

#endif  // CUDNN_JAX_KDA_LAUNCHERS_ONLY
