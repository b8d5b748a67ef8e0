// NVIDIA's sm_90 KDA backward kernels (k_meta, k_prep, k_scan_t, k_bwd) from the wheel's
// source, which CMake names in CUDNN_JAX_KDA_BWD_SOURCE, with their launcher and workspace
// size; and our kernel that zeroes the rows of tokens no served sequence holds. Declared in
// kda_cudnn.h.
//
// The launcher restates cuda_bwd_host.launch. Its constants are CMake's KDA_BWD_* defines,
// which the wheel's source static_asserts against its own (KDA_BWD_CHECK_CONSTANTS).

#if !defined(CUDNN_JAX_KDA_BWD_SOURCE) || !defined(KDA_BWD_CHECK_CONSTANTS)
#error "CMake passes CUDNN_JAX_KDA_BWD_SOURCE, KDA_BWD_CHECK_CONSTANTS and the KDA_BWD_* constants"
#endif

#include CUDNN_JAX_KDA_BWD_SOURCE

#define CUDNN_JAX_KDA_LAUNCHERS_ONLY
#include "kda_cudnn.h"

namespace cudnn_jax_kda {

constexpr int kBT = KDA_BWD_BT;  // chunk length
constexpr int kDH = KDA_BWD_DH;  // head dim
constexpr int kPrepThreads = KDA_BWD_PNT;
constexpr int kBwdThreads = KDA_BWD_BNT;
constexpr int kSmemPrep = KDA_BWD_SMEM_PREP;
constexpr int kSmemScan = KDA_BWD_SMEM_SCAN;
constexpr int kSmemBwd = KDA_BWD_SMEM_BWD;
// What k_prep and k_scan_t are allowed: one cap above both of their figures.
constexpr int kSmemOptIn = 227000;
constexpr size_t kAlign = 256;

// The workspace arena, in cuda_bwd_host._layout's order: byte offsets of each part.
struct Layout {
  size_t cs_t0, cs_len, seq_c0, seq_nc, gn2, amat, wneg, uu, kg, dvl, vnew, dv2, hst, dhst,
      pmat;
  size_t bytes;  // the whole arena
  int chunk_slots;
};

Layout layout(int t, int h, int n) {
  Layout l;
  const long long raw = (static_cast<long long>(t) + kBT - 1) / kBT + n - 1;
  l.chunk_slots = raw > 0 ? static_cast<int>(raw) : 1;
  const size_t ncs = l.chunk_slots, tokens = t, heads = h, seqs = n;
  size_t off = 0;
  auto take = [&](size_t count, size_t item) {
    const size_t at = off;
    off = (off + count * item + kAlign - 1) & ~(kAlign - 1);
    return at;
  };
  const size_t i32 = sizeof(int), f32 = sizeof(float), half = sizeof(bf16);
  l.cs_t0 = take(ncs, i32);
  l.cs_len = take(ncs, i32);
  l.seq_c0 = take(seqs + 1, i32);
  l.seq_nc = take(seqs + 1, i32);
  l.gn2 = take(ncs * heads * kDH, f32);
  l.amat = take(ncs * heads * kBT * kBT, half);
  l.wneg = take(tokens * heads * kDH, half);
  l.uu = take(tokens * heads * kDH, half);
  l.kg = take(tokens * heads * kDH, half);
  l.dvl = take(tokens * heads * kDH, half);
  l.vnew = take(tokens * heads * kDH, half);
  l.dv2 = take(tokens * heads * kDH, half);
  l.hst = take(ncs * heads * kDH * kDH, half);
  l.dhst = take(ncs * heads * kDH * kDH, half);
  l.pmat = take(ncs * heads * kDH * kDH, half);
  l.bytes = off;
  return l;
}

template <typename Kernel>
cudaError_t allow_smem(Kernel* kernel, int bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

// k_prep, the scan variant and k_bwd for one FULL (every chunk exactly kBT tokens).
template <bool FULL>
cudaError_t launch_chunks(char* ws, const Layout& l, const bf16* d_o, const bf16* q,
                          const bf16* k, const bf16* v, const float* g, const float* beta,
                          const float* initial_state, const float* d_final_state, bf16* dq,
                          bf16* dk, bf16* dv, float* dg, float* dbeta, float* d_initial_state,
                          int t, int h, int n, bool whole, cudaStream_t stream) {
  auto at = [&](size_t offset) { return ws + offset; };
  const int* cs_t0 = reinterpret_cast<const int*>(at(l.cs_t0));
  const int* cs_len = reinterpret_cast<const int*>(at(l.cs_len));
  bf16* amat = reinterpret_cast<bf16*>(at(l.amat));
  bf16* wneg = reinterpret_cast<bf16*>(at(l.wneg));
  bf16* uu = reinterpret_cast<bf16*>(at(l.uu));
  bf16* kg = reinterpret_cast<bf16*>(at(l.kg));
  bf16* dvl = reinterpret_cast<bf16*>(at(l.dvl));
  bf16* vnew = reinterpret_cast<bf16*>(at(l.vnew));
  bf16* dv2 = reinterpret_cast<bf16*>(at(l.dv2));
  bf16* hst = reinterpret_cast<bf16*>(at(l.hst));
  bf16* dhst = reinterpret_cast<bf16*>(at(l.dhst));
  bf16* pmat = reinterpret_cast<bf16*>(at(l.pmat));
  float* gn2 = reinterpret_cast<float*>(at(l.gn2));

  cudaError_t err = allow_smem(k_prep<FULL>, kSmemOptIn);
  if (err != cudaSuccess) return err;
  k_prep<FULL><<<dim3(l.chunk_slots, h), kPrepThreads, kSmemPrep, stream>>>(
      q, k, v, g, beta, d_o, cs_t0, cs_len, amat, wneg, uu, kg, pmat, gn2, dvl, t, h, whole);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;

  // The scan splits the value dim 16 ways at 128 threads for one sequence of 8 heads, 32
  // ways at 256 for any other one sequence; separate sequences take the variant without
  // the whole-sequence shortcuts.
  void (*scan)(const bf16*, const bf16*, const bf16*, const bf16*, const bf16*, const bf16*,
               const float*, const float*, const float*, const int*, const int*, const int*,
               const int*, bf16*, bf16*, bf16*, bf16*, float*, int, int);
  dim3 grid, block;
  if (whole && h == 8) {
    scan = k_scan_t<16, 128, true, FULL>;
    grid = dim3(2 * (kDH / 16), h), block = dim3(128);
  } else if (whole) {
    scan = k_scan_t<32, 256, true, FULL>;
    grid = dim3(2 * (kDH / 32), h), block = dim3(256);
  } else {
    scan = k_scan_t<32, 256, false, false>;
    grid = dim3(2 * (kDH / 32), n * h), block = dim3(256);
  }
  if ((err = allow_smem(scan, kSmemOptIn)) != cudaSuccess) return err;
  scan<<<grid, block, kSmemScan, stream>>>(
      wneg, uu, kg, pmat, dvl, d_o, gn2, initial_state, d_final_state, cs_t0, cs_len,
      reinterpret_cast<const int*>(at(l.seq_c0)), reinterpret_cast<const int*>(at(l.seq_nc)),
      hst, dhst, vnew, dv2, d_initial_state, t, h);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;

  if ((err = allow_smem(k_bwd<FULL>, kSmemBwd)) != cudaSuccess) return err;
  k_bwd<FULL><<<dim3(l.chunk_slots, h), kBwdThreads, kSmemBwd, stream>>>(
      q, k, v, g, beta, d_o, amat, vnew, dv2, hst, dhst, cs_t0, cs_len, dq, dk, dv, dg, dbeta,
      t, h, whole);
  return cudaGetLastError();
}

struct RowSets {
  char* data[CUDNN_JAX_KDA_MAX_ROW_SETS];
  size_t row_bytes[CUDNN_JAX_KDA_MAX_ROW_SETS];
  int count;
};

// Zeroes `bytes` bytes at p with the widest stores its alignment allows.
__device__ void zero_row(char* p, size_t bytes) {
  const size_t align = reinterpret_cast<size_t>(p) | bytes;
  if (align % 16 == 0) {
    for (size_t i = threadIdx.x; i < bytes / 16; i += blockDim.x) {
      reinterpret_cast<uint4*>(p)[i] = make_uint4(0, 0, 0, 0);
    }
  } else if (align % 4 == 0) {
    for (size_t i = threadIdx.x; i < bytes / 4; i += blockDim.x) {
      reinterpret_cast<unsigned*>(p)[i] = 0;
    }
  } else {
    for (size_t i = threadIdx.x; i < bytes; i += blockDim.x) p[i] = 0;
  }
}

// One token per block (grid-stride). Every thread finds the token's sequence itself: the
// last i with cu[i] <= token, which holds it when token < cu[i+1] (i < n).
__global__ void zero_unserved_rows(const int* __restrict__ cu, const int* __restrict__ served,
                                   int n, int t, RowSets rows) {
  for (int token = blockIdx.x; token < t; token += gridDim.x) {
    int lo = 0, hi = n + 1;  // the first i in [0, n] with cu[i] > token, else n + 1
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (cu[mid] <= token) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    const int seq = lo - 1;
    if (seq >= 0 && seq < n && served[seq] != 0) continue;
    for (int i = 0; i < rows.count; ++i) {
      zero_row(rows.data[i] + static_cast<size_t>(token) * rows.row_bytes[i], rows.row_bytes[i]);
    }
  }
}

}  // namespace cudnn_jax_kda

extern "C" size_t cudnn_jax_kda_bwd_workspace(int t, int h, int n) {
  return cudnn_jax_kda::layout(t, h, n).bytes;
}

extern "C" cudaError_t cudnn_jax_kda_bwd(void* workspace, const void* d_o, const void* q,
                                         const void* k, const void* v, const float* g,
                                         const float* beta, const int* cu,
                                         const float* initial_state,
                                         const float* d_final_state, void* dq, void* dk,
                                         void* dv, float* dg, float* dbeta,
                                         float* d_initial_state, int t, int h, int n,
                                         int whole, cudaStream_t stream) {
  using namespace cudnn_jax_kda;
  if (t < 0 || h < 0 || n < 0) return cudaErrorInvalidValue;
  if (h == 0 || n == 0) return cudaSuccess;  // nothing to run
  const Layout l = layout(t, h, n);
  char* ws = static_cast<char*>(workspace);
  if (!whole) {
    k_meta<<<1, 32, 0, stream>>>(cu, n, l.chunk_slots, reinterpret_cast<int*>(ws + l.cs_t0),
                                 reinterpret_cast<int*>(ws + l.cs_len),
                                 reinterpret_cast<int*>(ws + l.seq_c0),
                                 reinterpret_cast<int*>(ws + l.seq_nc));
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  }
  // FULL: one sequence whose length is a multiple of the chunk length, so no chunk has a
  // tail. Not for t == 0, where FULL's fixed chunk length would read past the tokens.
  const bool full = whole && t > 0 && t % kBT == 0;
  auto run = [&](auto launch) {
    return launch(ws, l, static_cast<const bf16*>(d_o), static_cast<const bf16*>(q),
                  static_cast<const bf16*>(k), static_cast<const bf16*>(v), g, beta,
                  initial_state, d_final_state, static_cast<bf16*>(dq), static_cast<bf16*>(dk),
                  static_cast<bf16*>(dv), dg, dbeta, d_initial_state, t, h, n, whole != 0,
                  stream);
  };
  return full ? run(launch_chunks<true>) : run(launch_chunks<false>);
}

extern "C" cudaError_t cudnn_jax_kda_zero_unserved(const int* cu, const int* served, int n,
                                                   int t, void* const* data,
                                                   const size_t* row_bytes, int count,
                                                   cudaStream_t stream) {
  using namespace cudnn_jax_kda;
  if (count < 0 || count > CUDNN_JAX_KDA_MAX_ROW_SETS) return cudaErrorInvalidValue;
  if (t <= 0 || count == 0) return cudaSuccess;
  RowSets rows{};
  rows.count = count;
  for (int i = 0; i < count; ++i) {
    rows.data[i] = static_cast<char*>(data[i]);
    rows.row_bytes[i] = row_bytes[i];
  }
  const int blocks = t < 8192 ? t : 8192;
  zero_unserved_rows<<<blocks, 128, 0, stream>>>(cu, served, n, t, rows);
  return cudaGetLastError();
}
