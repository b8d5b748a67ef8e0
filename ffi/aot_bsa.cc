// cudnn_jax_bsa_fwd / cudnn_jax_bsa_bwd: block-sparse attention on NVIDIA's sm_90 kernels
// from the nvidia-cudnn-frontend wheel, compiled ahead of time by kernels/bsa_sm90.py
// (which documents their contracts).
//
// Forward, bs = block_size (64 or 128), G = N/K, NQB = ceil(Sq/bs), NKB = ceil(Skv/bs):
//   q [B,Sq,N,D], k, v [B,Skv,K,D] (bf16 or f16), block_index [B,N,NQB,C] int32,
//   counts [B,N,NQB] int32, kv_sizes [B,K,NKB] int32  ->  out [B,Sq,N,D] (q's dtype),
//   lse [B,N,Sq] float32.
// Backward (bf16, K = N, D = 128):
//   dout, q, k, v, out [..], lse, block_index, counts, kv_sizes [B,NKB] int32  ->  dq, dk,
//   dv, workspace [W] u8 (W = bsa_bwd_workspace_bytes(B, N, Sq, Skv, C, bs)).
// Attributes: block_size, scale (finite, > 0), mask (read kv_sizes; without it every listed
// block is full: Skv % 128 == 0 for bs 128, and bs 64 cuts the last block at Skv).
// The kernels trust their metadata: every entry of a row below its count in [0, NKB) and
// counts in [0, C], kv_sizes within [0, min(bs, Skv - i*bs)], as the engine
// (cudnn_jax/primitives/bsa.py) makes them before the call. Every dimension is >= 1, and bs
// 64 needs Sq % 64 == 0 (the engine pads the query).

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "aot_kernels.h"
#include "aot_kernels_ffi.h"
#include "common/aot_module.h"
#include "common/buffers.h"
#include "common/errors.h"
#include "common/graph_utils.h"
#include "kernel_constants.h"
#include "xla/ffi/api/ffi.h"

#ifdef CUDNN_JAX_AOT_BSA_SM90  // kernels/aot.py built kernels/bsa_sm90.py

namespace cudnn_jax {
namespace {

namespace kernel = kernel_constants::bsa;

constexpr int64_t kMaxGrid = 65535;  // a launch grid's y and z extents
constexpr int64_t kMaxInt = std::numeric_limits<int32_t>::max();

template <typename T, typename = void>
struct HasStrides : std::false_type {};
template <typename T>
struct HasStrides<T, std::void_t<decltype(std::declval<T>().dynamic_strides)>>
    : std::true_type {};

// A kernel argument struct (kernels/bsa_sm90.py: data, the dynamic shapes, the dynamic
// strides) viewing a row-major array of `dims`: its first shapes (a static trailing head
// dim is left out by the struct) and the row-major strides of all but the last dim.
template <typename T>
T view(const void* data, std::initializer_list<int64_t> dims) {
  T t{};
  t.data = const_cast<void*>(data);
  const std::vector<int64_t> d(dims);
  for (size_t i = 0; i < std::size(t.dynamic_shapes); ++i) {
    t.dynamic_shapes[i] = static_cast<int32_t>(d[i]);
  }
  if constexpr (HasStrides<T>::value) {
    for (size_t i = 0; i < std::size(t.dynamic_strides); ++i) {
      int64_t stride = 1;
      for (size_t j = i + 1; j < d.size(); ++j) stride *= d[j];
      t.dynamic_strides[i] = stride;
    }
  }
  return t;
}

ffi::Error launched(const char* op, int32_t err) {
  if (err == 0) return ffi::Error::Success();
  return internal_error(
      stage_message(op, "launch", cudaGetErrorString(static_cast<cudaError_t>(err))));
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

const char* dtype_name(ffi::DataType dtype) {
  return dtype == ffi::DataType::BF16 ? "bf16" : dtype == ffi::DataType::F16 ? "f16" : nullptr;
}

template <typename Variant>
const Variant* find(const Variant* begin, const Variant* end, const std::string& name) {
  for (const Variant* v = begin; v != end; ++v) {
    if (name == v->name) return v;
  }
  return nullptr;
}

// ---------------------------------------------------------------------------------------
// Forward.

struct FwdCall {
  cudaStream_t stream;
  const void *q, *k, *v, *index, *counts, *sizes;
  void *out, *lse;
  int64_t b, sq, skv, n, kh, d, nqb, nkb, c;
  float scale;
};

struct FwdVariant {
  const char* name;  // bsa_fwd<bs>_<dtype>_d<D>_g<G>_mask<0|1>
  int32_t (*run)(const FwdCall&);
};

template <typename Module, typename Q, typename K, typename V, typename O, typename L,
          typename I, typename C, typename S>
int32_t launch_fwd(int32_t (*wrapper)(Module*, Q*, K*, V*, O*, L*, I*, C*, S*, float,
                                      cudaStream_t),
                   void (*load)(Module*), const FwdCall& c) {
  Q q = view<Q>(c.q, {c.b, c.sq, c.n, c.d});
  K k = view<K>(c.k, {c.b, c.skv, c.kh, c.d});
  V v = view<V>(c.v, {c.b, c.skv, c.kh, c.d});
  O out = view<O>(c.out, {c.b, c.sq, c.n, c.d});
  L lse = view<L>(c.lse, {c.b, c.n, c.sq});
  I index = view<I>(c.index, {c.b, c.n, c.nqb, c.c});
  C counts = view<C>(c.counts, {c.b, c.n, c.nqb});
  S sizes = view<S>(c.sizes, {c.b, c.kh, c.nkb});
  return wrapper(loaded_module(load), &q, &k, &v, &out, &lse, &index, &counts, &sizes,
                 c.scale, c.stream);
}

#define CUDNN_JAX_BSA_FWD_VARIANT(prefix) \
  {#prefix, [](const FwdCall& c) { return launch_fwd(cute_dsl_##prefix##_wrapper, \
                                                     prefix##_Kernel_Module_Load, c); }},
constexpr FwdVariant kFwdVariants[] = {CUDNN_JAX_AOT_BSA_SM90_FWD(CUDNN_JAX_BSA_FWD_VARIANT)};
#undef CUDNN_JAX_BSA_FWD_VARIANT

// "" when the scale is one the kernels take (every variant assumes a positive one).
std::string scale_error(float scale) {
  return std::isfinite(scale) && scale > 0 ? "" : "scale must be finite and > 0";
}

ffi::Error bsa_fwd(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::AnyBuffer block_index, ffi::AnyBuffer counts, ffi::AnyBuffer kv_sizes,
                   ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                   int32_t block_size, float scale, bool mask) {
  constexpr const char* kOp = "bsa_fwd";
  return guarded(kOp, [&]() -> ffi::Error {
    auto qd = q.dimensions(), kd = k.dimensions(), id = block_index.dimensions();
    if (qd.size() != 4 || kd.size() != 4 || id.size() != 4) {
      return invalid_argument(stage_message(
          kOp, "arguments", "q [B,Sq,N,D], k [B,Skv,K,D], block_index [B,N,NQB,C]"));
    }
    const int64_t b = qd[0], sq = qd[1], n = qd[2], d = qd[3], skv = kd[1], kh = kd[2];
    const int64_t bs = block_size, nqb = ceil_div(sq, bs), nkb = ceil_div(skv, bs), c = id[3];
    const ffi::DataType dtype = q.element_type();
    std::string err = scale_error(scale);
    if (err.empty() && dtype_name(dtype) == nullptr) err = "dtype: bf16 or f16 only";
    if (err.empty() && (bs != 64 && bs != 128)) err = "block_size: 64 or 128";
    if (err.empty() && (kh < 1 || n % kh)) err = "K must divide N";
    if (err.empty()) err = expect("k", k, dtype, {b, skv, kh, d});
    if (err.empty()) err = expect("v", v, dtype, {b, skv, kh, d});
    if (err.empty()) err = expect("block_index", block_index, ffi::DataType::S32, {b, n, nqb, c});
    if (err.empty()) err = expect("counts", counts, ffi::DataType::S32, {b, n, nqb});
    if (err.empty()) err = expect("kv_sizes", kv_sizes, ffi::DataType::S32, {b, kh, nkb});
    if (err.empty()) err = expect("out", *out, dtype, {b, sq, n, d});
    if (err.empty()) err = expect("lse", *lse, ffi::DataType::F32, {b, n, sq});
    if (err.empty() && (b < 1 || sq < 1 || skv < 1 || n < 1 || c < 1)) {
      err = "every dimension must be >= 1";
    }
    if (err.empty() && (bs == 64 ? sq % kernel::fwd64_sq_multiple != 0 : !mask && skv % bs)) {
      err = bs == 64 ? "block_size 64 needs Sq % 64 == 0"
                     : "block_size 128 without mask needs Skv % 128 == 0";
    }
    if (err.empty() && (sq > kMaxInt || skv > kMaxInt || n * b > kMaxGrid)) {
      err = "grid: N*B must be <= 65535 and the lengths below 2^31";
    }
    const FwdVariant* variant = nullptr;
    if (err.empty()) {
      const std::string name = "bsa_fwd" + std::to_string(bs) + "_" + dtype_name(dtype) + "_d" +
                               std::to_string(d) + "_g" + std::to_string(n / kh) + "_mask" +
                               (mask ? "1" : "0");
      variant = find(std::begin(kFwdVariants), std::end(kFwdVariants), name);
      if (variant == nullptr) err = "no kernel variant " + name;
    }
    if (!err.empty()) return invalid_argument(stage_message(kOp, "arguments", err));
    if (poison_outputs()) {
      ffi::Error e = fill_bytes(stream, kOp, 0xFF, {&*out, &*lse});
      if (e.failure()) return e;
    }
    return launched(kOp, variant->run(FwdCall{
                             stream, q.untyped_data(), k.untyped_data(), v.untyped_data(),
                             block_index.untyped_data(), counts.untyped_data(),
                             kv_sizes.untyped_data(), out->untyped_data(), lse->untyped_data(),
                             b, sq, skv, n, kh, d, nqb, nkb, c, scale}));
  });
}

// ---------------------------------------------------------------------------------------
// Backward: the K-to-Q CSR of the block lists, then the chain of kernels.

// The backward's buffers, one after another in its workspace result, each 256-byte aligned.
struct BwdLayout {
  int64_t groups, edges, scratch, scratch_zeroed, accumulators, accumulators_zeroed;
  int64_t offsets_at, edges_at, scratch_at, accumulators_at, bytes;
  int32_t bucket, tiles;
  bool direct;
};

int64_t aligned(int64_t bytes) { return (bytes + 255) / 256 * 256; }

// `tiles` 0 when C exceeds the widest K-to-Q builder.
BwdLayout bwd_layout(int64_t b, int64_t n, int64_t sq, int64_t skv, int64_t c, int64_t bs) {
  BwdLayout l{};
  const int64_t nqb = ceil_div(sq, bs), nkb = ceil_div(skv, bs);
  l.bucket = static_cast<int32_t>(bs == 128 ? kernel::bwd_bucket_blk128 : kernel::bwd_bucket_blk64);
  for (const char* t : kernel::k2q_edge_tiles) {
    if (l.tiles == 0 && kernel::k2q_edge_tile * std::stoll(t) >= c) l.tiles = std::stoi(t);
  }
  l.groups = ceil_div(nqb, l.bucket);
  l.edges = std::max<int64_t>(1, nqb * c);
  // Scratch: edge counts (zeroed first), cursors [B,N,G,NKB], local offsets [..,NKB+1],
  // group totals [B,N,G].
  l.scratch_zeroed = b * n * l.groups * nkb;
  l.scratch = b * n * l.groups * (3 * nkb + 2);
  // Float32 accumulators, field-major over B*N: dPsum and lse*log2(e) [Sqr], dQ [Sqr,128],
  // then dK and dV [Skr,128] unless the main kernel stores them itself (direct: block 128
  // with one CSR group), zeroed first.
  const int64_t sqr = nqb * bs, skr = nkb * bs, dim = kernel::bwd_head_dim;
  l.direct = bs == 128 && l.groups == 1;
  l.accumulators_zeroed = l.direct ? 0 : b * n * 2 * dim * skr;
  l.accumulators = b * n * (2 + dim) * sqr + l.accumulators_zeroed;
  l.offsets_at = 0;
  l.edges_at = l.offsets_at + aligned(4 * b * n * l.groups * (nkb + 1));
  l.scratch_at = l.edges_at + aligned(4 * b * n * l.edges);
  l.accumulators_at = l.scratch_at + aligned(4 * l.scratch);
  l.bytes = l.accumulators_at + aligned(4 * l.accumulators);
  return l;
}

struct BwdCall {
  cudaStream_t stream;
  const void *dout, *q, *k, *v, *out, *lse, *index, *counts, *sizes;
  void *dq, *dk, *dv;
  char* workspace;
  BwdLayout layout;
  int64_t b, sq, skv, n, nqb, nkb, c;
  float scale;
};

struct K2QVariant {
  const char* name;  // bsa_k2q_b<bucket>_t<tiles>
  int32_t (*run)(const BwdCall&);
};

template <typename Module, typename I, typename C, typename O, typename E, typename S>
int32_t launch_k2q(int32_t (*wrapper)(Module*, I*, C*, O*, E*, S*, cudaStream_t),
                   void (*load)(Module*), const BwdCall& c) {
  const BwdLayout& l = c.layout;
  I index = view<I>(c.index, {c.b, c.n, c.nqb, c.c});
  C counts = view<C>(c.counts, {c.b, c.n, c.nqb});
  O offsets = view<O>(c.workspace + l.offsets_at, {c.b, c.n, l.groups, c.nkb + 1});
  E edges = view<E>(c.workspace + l.edges_at, {c.b, c.n, l.edges});
  S scratch = view<S>(c.workspace + l.scratch_at, {l.scratch});
  return wrapper(loaded_module(load), &index, &counts, &offsets, &edges, &scratch, c.stream);
}

#define CUDNN_JAX_BSA_K2Q_VARIANT(prefix) \
  {#prefix, [](const BwdCall& c) { return launch_k2q(cute_dsl_##prefix##_wrapper, \
                                                     prefix##_Kernel_Module_Load, c); }},
constexpr K2QVariant kK2QVariants[] = {CUDNN_JAX_AOT_BSA_SM90_K2Q(CUDNN_JAX_BSA_K2Q_VARIANT)};
#undef CUDNN_JAX_BSA_K2Q_VARIANT

struct BwdVariant {
  const char* name;  // bsa_bwd128_<dtype>_d128_direct<0|1>_mask<0|1>, bsa_bwd64_<..>_mask<..>
  int32_t (*run)(const BwdCall&);
};

template <typename Module, typename DO, typename Q, typename K, typename V, typename O,
          typename L, typename DQ, typename DK, typename DV, typename Off, typename E,
          typename S, typename W>
int32_t launch_bwd(int32_t (*wrapper)(Module*, DO*, Q*, K*, V*, O*, L*, DQ*, DK*, DV*, Off*, E*,
                                      S*, W*, float, cudaStream_t),
                   void (*load)(Module*), const BwdCall& c) {
  const BwdLayout& l = c.layout;
  const int64_t d = kernel::bwd_head_dim;
  DO dout = view<DO>(c.dout, {c.b, c.sq, c.n, d});
  Q q = view<Q>(c.q, {c.b, c.sq, c.n, d});
  K k = view<K>(c.k, {c.b, c.skv, c.n, d});
  V v = view<V>(c.v, {c.b, c.skv, c.n, d});
  O out = view<O>(c.out, {c.b, c.sq, c.n, d});
  L lse = view<L>(c.lse, {c.b, c.n, c.sq});
  DQ dq = view<DQ>(c.dq, {c.b, c.sq, c.n, d});
  DK dk = view<DK>(c.dk, {c.b, c.skv, c.n, d});
  DV dv = view<DV>(c.dv, {c.b, c.skv, c.n, d});
  Off offsets = view<Off>(c.workspace + l.offsets_at, {c.b, c.n, l.groups, c.nkb + 1});
  E edges = view<E>(c.workspace + l.edges_at, {c.b, c.n, l.edges});
  S sizes = view<S>(c.sizes, {c.b, c.nkb});
  W accumulators = view<W>(c.workspace + l.accumulators_at, {l.accumulators});
  return wrapper(loaded_module(load), &dout, &q, &k, &v, &out, &lse, &dq, &dk, &dv, &offsets,
                 &edges, &sizes, &accumulators, c.scale, c.stream);
}

#define CUDNN_JAX_BSA_BWD_VARIANT(prefix) \
  {#prefix, [](const BwdCall& c) { return launch_bwd(cute_dsl_##prefix##_wrapper, \
                                                     prefix##_Kernel_Module_Load, c); }},
constexpr BwdVariant kBwdVariants[] = {CUDNN_JAX_AOT_BSA_SM90_BWD(CUDNN_JAX_BSA_BWD_VARIANT)};
#undef CUDNN_JAX_BSA_BWD_VARIANT

ffi::Error bsa_bwd(cudaStream_t stream, ffi::AnyBuffer dout, ffi::AnyBuffer q, ffi::AnyBuffer k,
                   ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer lse,
                   ffi::AnyBuffer block_index, ffi::AnyBuffer counts, ffi::AnyBuffer kv_sizes,
                   ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                   ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> workspace,
                   int32_t block_size, float scale, bool mask) {
  constexpr const char* kOp = "bsa_bwd";
  return guarded(kOp, [&]() -> ffi::Error {
    auto qd = q.dimensions(), kd = k.dimensions(), id = block_index.dimensions();
    if (qd.size() != 4 || kd.size() != 4 || id.size() != 4) {
      return invalid_argument(stage_message(
          kOp, "arguments", "q [B,Sq,N,D], k [B,Skv,N,D], block_index [B,N,NQB,C]"));
    }
    const int64_t b = qd[0], sq = qd[1], n = qd[2], d = qd[3], skv = kd[1];
    const int64_t bs = block_size, nqb = ceil_div(sq, bs), nkb = ceil_div(skv, bs), c = id[3];
    const ffi::DataType dtype = q.element_type();
    std::string err = scale_error(scale);
    if (err.empty() && dtype != ffi::DataType::BF16) err = "dtype: bf16 only";
    if (err.empty() && (bs != 64 && bs != 128)) err = "block_size: 64 or 128";
    if (err.empty() && d != kernel::bwd_head_dim) err = "head dim: 128 only";
    if (err.empty()) err = expect("dout", dout, dtype, {b, sq, n, d});
    if (err.empty()) err = expect("out", out, dtype, {b, sq, n, d});
    if (err.empty()) err = expect("k", k, dtype, {b, skv, n, d});
    if (err.empty()) err = expect("v", v, dtype, {b, skv, n, d});
    if (err.empty()) err = expect("lse", lse, ffi::DataType::F32, {b, n, sq});
    if (err.empty()) err = expect("block_index", block_index, ffi::DataType::S32, {b, n, nqb, c});
    if (err.empty()) err = expect("counts", counts, ffi::DataType::S32, {b, n, nqb});
    if (err.empty()) err = expect("kv_sizes", kv_sizes, ffi::DataType::S32, {b, nkb});
    if (err.empty()) err = expect("dq", *dq, dtype, {b, sq, n, d});
    if (err.empty()) err = expect("dk", *dk, dtype, {b, skv, n, d});
    if (err.empty()) err = expect("dv", *dv, dtype, {b, skv, n, d});
    if (err.empty() && (b < 1 || sq < 1 || skv < 1 || n < 1 || c < 1)) {
      err = "every dimension must be >= 1";
    }
    if (err.empty() && bs == 64 && sq % kernel::fwd64_sq_multiple) {
      err = "block_size 64 needs Sq % 64 == 0";
    }
    if (err.empty() && bs == 128 && !mask && skv % bs) {
      err = "block_size 128 without mask needs Skv % 128 == 0";
    }
    const BwdLayout layout = bwd_layout(b, n, sq, skv, c, bs);
    if (err.empty() && layout.tiles == 0) {
      err = "block_index width C must be <= " + std::to_string(kernel::max_index_width);
    }
    if (err.empty() && (n * layout.groups > kMaxGrid || b > kMaxGrid || sq > kMaxInt ||
                        skv > kMaxInt)) {
      err = "grid: N*ceil(NQB/bucket) and B must be <= 65535";
    }
    if (err.empty() &&
        static_cast<int64_t>(workspace->size_bytes()) < layout.bytes) {
      err = "workspace: " + std::to_string(workspace->size_bytes()) + " bytes, needs " +
            std::to_string(layout.bytes);
    }
    const K2QVariant* k2q = nullptr;
    const BwdVariant* main = nullptr;
    if (err.empty()) {
      const std::string k2q_name = "bsa_k2q_b" + std::to_string(layout.bucket) + "_t" +
                                   std::to_string(layout.tiles);
      std::string main_name = "bsa_bwd" + std::to_string(bs) + "_bf16_d128";
      if (bs == 128) main_name += layout.direct ? "_direct1" : "_direct0";
      main_name += mask ? "_mask1" : "_mask0";
      k2q = find(std::begin(kK2QVariants), std::end(kK2QVariants), k2q_name);
      main = find(std::begin(kBwdVariants), std::end(kBwdVariants), main_name);
      if (k2q == nullptr || main == nullptr) {
        err = "no kernel variant " + (k2q == nullptr ? k2q_name : main_name);
      }
    }
    if (!err.empty()) return invalid_argument(stage_message(kOp, "arguments", err));
    if (poison_outputs()) {
      ffi::Error e = fill_bytes(stream, kOp, 0xFF, {&*dq, &*dk, &*dv, &*workspace});
      if (e.failure()) return e;
    }
    char* ws = static_cast<char*>(workspace->untyped_data());
    ffi::Error e = fill_bytes(stream, kOp, 0, ws + layout.scratch_at, 4 * layout.scratch_zeroed);
    if (e.failure()) return e;
    const BwdCall call{stream, dout.untyped_data(), q.untyped_data(), k.untyped_data(),
                       v.untyped_data(), out.untyped_data(), lse.untyped_data(),
                       block_index.untyped_data(), counts.untyped_data(),
                       kv_sizes.untyped_data(), dq->untyped_data(), dk->untyped_data(),
                       dv->untyped_data(), ws, layout, b, sq, skv, n, nqb, nkb, c, scale};
    if (ffi::Error k2q_error = launched(kOp, k2q->run(call)); k2q_error.failure()) {
      return k2q_error;
    }
    if (layout.accumulators_zeroed > 0) {
      const int64_t at = 4 * (layout.accumulators - layout.accumulators_zeroed);
      e = fill_bytes(stream, kOp, 0, ws + layout.accumulators_at + at,
                     4 * layout.accumulators_zeroed);
      if (e.failure()) return e;
    }
    return launched(kOp, main->run(call));
  });
}

}  // namespace
}  // namespace cudnn_jax

int64_t cudnn_jax_bsa_bwd_workspace_bytes(int64_t b, int64_t n, int64_t sq, int64_t skv,
                                          int64_t c, int64_t block_size) {
  return cudnn_jax::bwd_layout(b, n, sq, skv, c, block_size).bytes;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudnnJaxBsaFwd, cudnn_jax::bsa_fwd,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()   // q
                                  .Arg<xla::ffi::AnyBuffer>()   // k
                                  .Arg<xla::ffi::AnyBuffer>()   // v
                                  .Arg<xla::ffi::AnyBuffer>()   // block_index
                                  .Arg<xla::ffi::AnyBuffer>()   // counts
                                  .Arg<xla::ffi::AnyBuffer>()   // kv_sizes
                                  .Ret<xla::ffi::AnyBuffer>()   // out
                                  .Ret<xla::ffi::AnyBuffer>()   // lse
                                  .Attr<int32_t>("block_size")
                                  .Attr<float>("scale")
                                  .Attr<bool>("mask"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudnnJaxBsaBwd, cudnn_jax::bsa_bwd,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()   // dout
                                  .Arg<xla::ffi::AnyBuffer>()   // q
                                  .Arg<xla::ffi::AnyBuffer>()   // k
                                  .Arg<xla::ffi::AnyBuffer>()   // v
                                  .Arg<xla::ffi::AnyBuffer>()   // out
                                  .Arg<xla::ffi::AnyBuffer>()   // lse
                                  .Arg<xla::ffi::AnyBuffer>()   // block_index
                                  .Arg<xla::ffi::AnyBuffer>()   // counts
                                  .Arg<xla::ffi::AnyBuffer>()   // kv_sizes
                                  .Ret<xla::ffi::AnyBuffer>()   // dq
                                  .Ret<xla::ffi::AnyBuffer>()   // dk
                                  .Ret<xla::ffi::AnyBuffer>()   // dv
                                  .Ret<xla::ffi::AnyBuffer>()   // workspace
                                  .Attr<int32_t>("block_size")
                                  .Attr<float>("scale")
                                  .Attr<bool>("mask"));

#endif  // CUDNN_JAX_AOT_BSA_SM90
