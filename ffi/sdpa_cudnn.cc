// SDPA forward/backward handlers on cudnn_frontend's fused attention graph.
//
// Layout: q/k/v/out stay in XLA's row-major BSHD buffers; the graph sees them as
// [B, heads, seq, dim] through strides, so no transposes are needed. Stats (the
// log-sum-exp) is [B, N, T, 1] float32, which is the lse buffer [B, N, T].

#include "sdpa_cudnn.h"

#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/attributes.h"
#include "common/buffers.h"
#include "common/cudnn_runtime.h"
#include "common/errors.h"
#include "common/graph_utils.h"
#include "common/plan_cache.h"

namespace cudnn_jax {
namespace {

using Graph = fe::graph::Graph;
using TensorAttrs = fe::graph::Tensor_attributes;
using Tensor = std::shared_ptr<TensorAttrs>;

// Tensor uids: fixed per role, so one variant-pack layout serves every plan.
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kBias, kSeqLenQ, kSeqLenKv, kDO, kDQ, kDK, kDV, kDBias,
  kQOffsets, kKOffsets, kVOffsets, kOOffsets, kPageTableK, kPageTableV, kSinks, kSeed, kOffset,
};

const char* op_name(const SdpaConfig& c) { return c.backward ? "sdpa_bwd" : "sdpa_fwd"; }

// An attribute's value in a cache key (a float by its bits).
std::string key_text(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return std::to_string(bits);
}
std::string key_text(bool x) { return x ? "1" : "0"; }
std::string key_text(int32_t x) { return std::to_string(x); }

std::string cache_key(const SdpaConfig& c, int device) {
  std::string key = std::string(op_name(c)) + "|dev" + std::to_string(device) + "|" +
                    dtype_name(c.dtype);
  for (int64_t d : {c.b, c.t, c.s, c.n, c.k, c.h, c.hv, c.bias_b, c.bias_n, c.pages, c.page}) {
    key += "|" + std::to_string(d);
  }
  visit_sdpa_attributes(c, [&](const char*, const auto& value) { key += "|" + key_text(value); });
  return key;
}

// Checks that need no cuDNN: the reason this configuration cannot be served, or "".
std::string config_error(const SdpaConfig& c) {
  if (c.dtype != ffi::DataType::BF16 && c.dtype != ffi::DataType::F16) {
    return "dtype: cuDNN SDPA takes bfloat16 or float16, got " + dtype_name(c.dtype);
  }
  if (c.b <= 0 || c.t <= 0 || c.s <= 0 || c.n <= 0 || c.k <= 0 || c.h <= 0 || c.hv <= 0) {
    return "shapes: every extent must be positive";
  }
  if (c.n % c.k != 0) return "heads: query heads must be a multiple of key/value heads";
  if (c.has_bias && (c.bias_b != 1 && c.bias_b != c.b)) return "bias: batch extent must be 1 or B";
  if (c.has_bias && (c.bias_n != 1 && c.bias_n != c.n)) return "bias: head extent must be 1 or N";
  if (c.has_dbias && !c.has_bias) return "dbias: needs a bias";
  if (c.window_left < -1 || c.window_right < -1) return "window: bounds are >= 0, or -1";
  if (c.softcap < 0.f) return "logits_soft_cap: must be positive";
  if (c.softcap > 0.f && c.has_bias) {
    return "logits_soft_cap: not supported together with a bias by the cuDNN SDPA graph "
           "(its score modifier runs before the bias is added)";
  }
  if (c.softcap > 0.f && c.has_padding) {
    return "logits_soft_cap: not supported together with sequence lengths by the cuDNN SDPA "
           "graph";
  }
  if ((c.packed_max_q > 0) != (c.packed_max_kv > 0)) {
    return "packed rows: query and key/value rows are packed together";
  }
  if ((c.packed() || c.paged) && !c.has_padding) {
    return "packed rows and paged caches need the sequence lengths";
  }
  if (c.packed() && c.paged) return "packed rows and paged caches: not together";
  if (c.paged && (c.pages <= 0 || c.page <= 0 || c.s % c.page != 0)) {
    return "paged caches: the key length must be whole pages";
  }
  if (c.dropout < 0.f || c.dropout >= 1.f) return "dropout: a probability in [0, 1)";
  if (c.backward && (c.paged || c.has_sinks)) {
    return "backward: paged caches and sinks are forward-only here (the gradient of the "
           "sinks follows from lse)";
  }
  return "";
}

// Diagonal band of the mask, in cuDNN's terms. With row t, column u (both shifted by
// S_b - T_b under bottom-right alignment), cuDNN keeps
//   u <= t + right_bound        and        u > t - left_bound.
// Our attributes keep t - window_left <= u <= t + window_right, so
//   right_bound = window_right (0 under causal),  left_bound = window_left + 1.
struct Band {
  std::optional<int64_t> left, right;
  fe::DiagonalAlignment_t alignment = fe::DiagonalAlignment_t::TOP_LEFT;
  bool any() const { return left.has_value() || right.has_value(); }
};

Band band_of(const SdpaConfig& c) {
  Band band;
  if (c.causal) {
    band.right = 0;  // causal with window_right >= 0 is still u <= t
  } else if (c.window_right >= 0) {
    band.right = c.window_right;
  }
  if (c.window_left >= 0) band.left = int64_t{c.window_left} + 1;
  band.alignment =
      c.bottom_right ? fe::DiagonalAlignment_t::BOTTOM_RIGHT : fe::DiagonalAlignment_t::TOP_LEFT;
  return band;
}

template <typename Attrs>
void set_band(Attrs& attrs, const Band& band) {
  if (!band.any()) return;
  attrs.set_diagonal_alignment(band.alignment);
  if (band.right) attrs.set_diagonal_band_right_bound(static_cast<int>(*band.right));
  if (band.left) attrs.set_diagonal_band_left_bound(static_cast<int>(*band.left));
}

// Logit soft-capping as a score modifier: s -> c * tanh(s / c), then the band mask (the
// frontend refuses its own masks next to a score modifier, so the modifier applies it).
// The backward modifier multiplies dS by 1 - tanh^2; masked entries already have dS = 0.
struct SoftcapMods {
  using Mod = std::function<Tensor(std::shared_ptr<Graph>, Tensor)>;
  Mod forward, backward;
};

SoftcapMods softcap_mods(const SdpaConfig& c) {
  auto softcap = std::make_shared<fe::graph::attn::score_modifiers::Softcap>();
  const float cap = c.softcap;
  const Band band = band_of(c);
  const int64_t t = c.t, s = c.s;
  SoftcapMods mods;
  mods.forward = [softcap, cap, band, t, s](std::shared_ptr<Graph> graph, Tensor score) {
    Tensor out = softcap->forward(graph, score, std::make_shared<TensorAttrs>(cap));
    if (band.any()) {
      out = fe::graph::attn::score_modifiers::sliding_window_mask(
          graph, out, band.alignment, band.left, band.right, t, s, nullptr, nullptr, nullptr,
          nullptr);
    }
    return out;
  };
  mods.backward = [softcap, cap](std::shared_ptr<Graph> graph, Tensor dscore) {
    return softcap->backward(graph, dscore, std::make_shared<TensorAttrs>(cap));
  };
  return mods;
}

// The int32 per-sequence operands: lengths [B,1,1,1], row offsets [B+1,1,1,1], page
// tables [B,1,max_pages,1].
Tensor int32_tensor(Graph& graph, const char* name, int64_t uid, int64_t rows, int64_t cols = 1) {
  return graph.tensor(TensorAttrs()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim({rows, 1, cols, 1})
                          .set_stride({cols, cols, 1, 1})
                          .set_data_type(fe::DataType_t::INT32));
}

// Masks, padding and score modifiers shared by the forward and backward attributes.
template <typename Attrs>
void set_masking(Attrs& attrs, const SdpaConfig& c, Graph& graph) {
  if (c.has_padding) {
    attrs.set_padding_mask(true)
        .set_seq_len_q(int32_tensor(graph, "seq_len_q", kSeqLenQ, c.b))
        .set_seq_len_kv(int32_tensor(graph, "seq_len_kv", kSeqLenKv, c.b));
  }
  if (c.dropout > 0.f) {  // Philox, keyed by the seed and offset operands
    auto scalar = [&](const char* name, int64_t uid) {
      return graph.tensor(TensorAttrs().set_name(name).set_uid(uid).set_dim({1, 1, 1, 1})
                              .set_stride({1, 1, 1, 1}).set_data_type(fe::DataType_t::INT64));
    };
    attrs.set_dropout(c.dropout, scalar("seed", kSeed), scalar("offset", kOffset));
  }
  if (c.softcap > 0.f) {
    SoftcapMods mods = softcap_mods(c);
    attrs.set_score_mod(mods.forward);
    if constexpr (std::is_same_v<Attrs, fe::graph::SDPA_backward_attributes>) {
      attrs.set_score_mod_bprop(mods.backward);
    }
  } else {
    set_band(attrs, band_of(c));
  }
}

// A [B, heads, seq, dim] view of a row-major [B, seq, heads, dim] buffer.
TensorAttrs bshd(const char* name, int64_t uid, int64_t b, int64_t heads, int64_t seq,
                 int64_t dim) {
  return TensorAttrs()
      .set_name(name)
      .set_uid(uid)
      .set_dim({b, heads, seq, dim})
      .set_stride({seq * heads * dim, dim, heads * dim, 1});
}

// A [P, heads, page, dim] view of a row-major [P, page, heads, dim] paged cache.
TensorAttrs cache_view(const char* name, int64_t uid, const SdpaConfig& c, int64_t dim) {
  return TensorAttrs()
      .set_name(name)
      .set_uid(uid)
      .set_dim({c.pages, c.k, c.page, dim})
      .set_stride({c.page * c.k * dim, dim, c.k * dim, 1});
}

// The ragged offsets of packed rows (element offsets of each sequence's first row), one per
// buffer layout; null for a dense layout.
struct Offsets {
  Tensor q, k, v, o;
};

Offsets packed_offsets(Graph& graph, const SdpaConfig& c) {
  if (!c.packed()) return {};
  return {int32_tensor(graph, "q_offsets", kQOffsets, c.b + 1),
          int32_tensor(graph, "k_offsets", kKOffsets, c.b + 1),
          int32_tensor(graph, "v_offsets", kVOffsets, c.b + 1),
          int32_tensor(graph, "o_offsets", kOOffsets, c.b + 1)};
}

// `t` in the layout `view`, packed by `offsets` when given.
Tensor rows(Tensor t, const TensorAttrs& view, const Tensor& offsets) {
  t->set_dim(view.get_dim()).set_stride(view.get_stride());
  if (offsets) t->set_ragged_offset(offsets);
  return t;
}

Tensor input_rows(Graph& graph, TensorAttrs view, const Tensor& offsets) {
  Tensor t = graph.tensor(view);
  if (offsets) t->set_ragged_offset(offsets);
  return t;
}

std::vector<int64_t> bias_dims(const SdpaConfig& c) { return {c.bias_b, c.bias_n, c.t, c.s}; }
std::vector<int64_t> bias_strides(const SdpaConfig& c) {
  return {c.bias_n * c.t * c.s, c.t * c.s, c.s, 1};
}

Tensor add_bias(Graph& graph, const SdpaConfig& c) {
  return graph.tensor(
      TensorAttrs().set_name("bias").set_uid(kBias).set_dim(bias_dims(c)).set_stride(
          bias_strides(c)));
}

void add_forward(Graph& graph, const SdpaConfig& c, fe::AttentionImplementation_t impl) {
  Offsets offsets = packed_offsets(graph, c);
  Tensor q = input_rows(graph, bshd("q", kQ, c.b, c.n, c.t, c.h), offsets.q);
  Tensor k, v;
  fe::graph::SDPA_attributes attrs;
  if (c.paged) {
    k = graph.tensor(cache_view("k_cache", kK, c, c.h));
    v = graph.tensor(cache_view("v_cache", kV, c, c.hv));
    const int64_t max_pages = c.s / c.page;
    attrs.set_paged_attention_k_table(int32_tensor(graph, "page_table_k", kPageTableK, c.b, max_pages))
        .set_paged_attention_v_table(int32_tensor(graph, "page_table_v", kPageTableV, c.b, max_pages))
        .set_paged_attention_max_seq_len_kv(static_cast<int>(c.s));
  } else {
    k = input_rows(graph, bshd("k", kK, c.b, c.k, c.s, c.h), offsets.k);
    v = input_rows(graph, bshd("v", kV, c.b, c.k, c.s, c.hv), offsets.v);
  }
  attrs.set_name("sdpa_fwd")
      .set_generate_stats(c.with_lse)
      .set_attn_scale(c.scale)
      .set_implementation(impl);
  if (c.has_bias) attrs.set_bias(add_bias(graph, c));
  if (c.has_sinks) {
    attrs.set_sink_token(graph.tensor(TensorAttrs()
                                          .set_name("sinks")
                                          .set_uid(kSinks)
                                          .set_dim({1, c.n, 1, 1})
                                          .set_stride({c.n, 1, 1, 1})
                                          .set_data_type(fe::DataType_t::FLOAT)));
  }
  set_masking(attrs, c, graph);

  auto [o, stats] = graph.sdpa(q, k, v, std::move(attrs));
  rows(o, bshd("o", kO, c.b, c.n, c.t, c.hv), offsets.o)->set_output(true).set_uid(kO);
  if (!c.with_lse) return;
  stats->set_output(true)
      .set_uid(kStats)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim({c.b, c.n, c.t, 1})
      .set_stride({c.n * c.t, c.t, 1, 1});
}

void add_backward(Graph& graph, const SdpaConfig& c) {
  Offsets offsets = packed_offsets(graph, c);
  Tensor q = input_rows(graph, bshd("q", kQ, c.b, c.n, c.t, c.h), offsets.q);
  Tensor k = input_rows(graph, bshd("k", kK, c.b, c.k, c.s, c.h), offsets.k);
  Tensor v = input_rows(graph, bshd("v", kV, c.b, c.k, c.s, c.hv), offsets.v);
  Tensor o = input_rows(graph, bshd("o", kO, c.b, c.n, c.t, c.hv), offsets.o);
  Tensor d_o = input_rows(graph, bshd("do", kDO, c.b, c.n, c.t, c.hv), offsets.o);
  Tensor stats = graph.tensor(TensorAttrs()
                                  .set_name("stats")
                                  .set_uid(kStats)
                                  .set_dim({c.b, c.n, c.t, 1})
                                  .set_stride({c.n * c.t, c.t, 1, 1})
                                  .set_data_type(fe::DataType_t::FLOAT));

  fe::graph::SDPA_backward_attributes attrs;
  attrs.set_name("sdpa_bwd").set_attn_scale(c.scale);
  if (c.has_bias) attrs.set_bias(add_bias(graph, c));
  if (c.has_dbias) {
    Tensor dbias = graph.tensor(TensorAttrs()
                                    .set_name("dbias")
                                    .set_uid(kDBias)
                                    .set_dim(bias_dims(c))
                                    .set_stride(bias_strides(c)));
    dbias->set_output(true);
    attrs.set_dbias(dbias);
  }
  set_masking(attrs, c, graph);

  auto [dq, dk, dv] = graph.sdpa_backward(q, k, v, o, d_o, stats, std::move(attrs));
  rows(dq, bshd("dq", kDQ, c.b, c.n, c.t, c.h), offsets.q)->set_output(true).set_uid(kDQ);
  rows(dk, bshd("dk", kDK, c.b, c.k, c.s, c.h), offsets.k)->set_output(true).set_uid(kDK);
  rows(dv, bshd("dv", kDV, c.b, c.k, c.s, c.hv), offsets.v)->set_output(true).set_uid(kDV);
}

std::shared_ptr<CachedPlan> build_plan(const SdpaConfig& c, int device, DeviceHandle& handle) {
  if (c.backward) {
    return build_cached_plan(op_name(c), config_error(c), device, handle,
                             to_cudnn_dtype(c.dtype), [&](Graph& g) { add_backward(g, c); });
  }
  // The composite implementation serves every configuration (the unified one needs
  // cuDNN >= 9.21 for band masks); without masks or modifiers the unified one is built
  // too, and autotuning keeps the faster.
  auto with = [&c](fe::AttentionImplementation_t implementation) -> AddNodes {
    return [&c, implementation](Graph& g) { add_forward(g, c, implementation); };
  };
  std::vector<AddNodes> alternatives;
  if (!band_of(c).any() && c.softcap == 0.f) {
    alternatives.push_back(with(fe::AttentionImplementation_t::UNIFIED));
  }
  return build_cached_plan(op_name(c), config_error(c), device, handle, to_cudnn_dtype(c.dtype),
                           with(fe::AttentionImplementation_t::COMPOSITE), alternatives);
}

// Finds or builds the plan of `requested` on `device`; on failure returns null with *error
// set. The forward ignores has_dbias and the backward with_lse (it always reads lse), so
// neither tells that direction's plans apart.
std::shared_ptr<CachedPlan> plan_for(const SdpaConfig& requested, int device,
                                     DeviceHandle** handle, std::string* error) {
  SdpaConfig c = requested;
  if (c.backward) {
    c.with_lse = true;
  } else {
    c.has_dbias = false;
  }
  return find_plan(op_name(c), cache_key(c, device), device, handle,
                   [&](DeviceHandle& h) { return build_plan(c, device, h); }, error);
}

// ---- argument decoding -------------------------------------------------------------

struct Optionals {
  std::optional<ffi::AnyBuffer> bias, q_lens, kv_lens, page_table, sinks, seed, offset;
  std::optional<ffi::AnyBuffer> offsets[4];  // packed rows: q, k, v, o
};

// Reads the trailing arguments the attributes announce, in order: bias; q_lens, kv_lens;
// the four row offsets of packed rows; the page table; the sinks; the dropout seed and
// offset.
std::string decode_optionals(const ffi::RemainingArgs& rest, const SdpaConfig& c,
                             Optionals* out) {
  std::vector<std::optional<ffi::AnyBuffer>*> slots;
  if (c.has_bias) slots.push_back(&out->bias);
  if (c.has_padding) slots.insert(slots.end(), {&out->q_lens, &out->kv_lens});
  if (c.packed()) {
    for (auto& offsets : out->offsets) slots.push_back(&offsets);
  }
  if (c.paged) slots.push_back(&out->page_table);
  if (c.has_sinks) slots.push_back(&out->sinks);
  if (c.dropout > 0.f) slots.insert(slots.end(), {&out->seed, &out->offset});
  if (rest.size() != slots.size()) {
    return "expected " + std::to_string(slots.size()) +
           " trailing arguments (bias, lengths, offsets, page table, sinks, dropout), got " +
           std::to_string(rest.size());
  }
  for (size_t i = 0; i < slots.size(); ++i) {
    auto buf = rest.get<ffi::AnyBuffer>(i);
    if (buf.has_error()) return buf.error().message();
    *slots[i] = *buf;
  }
  return "";
}

// The extents of a buffer holding `seq` rows of `heads` x `dim` per batch: [B, seq, heads,
// dim], or [rows, heads, dim] when packed.
std::vector<int64_t> row_dims(bool packed, int64_t rows, int64_t b, int64_t seq, int64_t heads,
                              int64_t dim) {
  if (packed) return {rows, heads, dim};
  return {b, seq, heads, dim};
}

std::string expect_dims(const char* name, const ffi::AnyBuffer& buf, ffi::DataType dtype,
                        const std::vector<int64_t>& dims) {
  auto got = buf.dimensions();
  if (buf.element_type() != dtype || std::vector<int64_t>(got.begin(), got.end()) != dims) {
    std::string want;
    for (int64_t d : dims) want += (want.empty() ? "" : ",") + std::to_string(d);
    return std::string(name) + ": expected " + dtype_name(dtype) + " [" + want + "]";
  }
  return "";
}

std::vector<int64_t> q_like(const SdpaConfig& c, int64_t dim) {
  return row_dims(c.packed(), c.rows_q, c.b, c.t, c.n, dim);
}
std::vector<int64_t> kv_like(const SdpaConfig& c, int64_t dim) {
  return row_dims(c.packed(), c.rows_kv, c.b, c.s, c.k, dim);
}

// Fills the shape fields of `c` from q, k, v and the trailing arguments: q [B,T,N,H],
// k [B,S,K,H], v [B,S,K,Hv]; packed: q [Tq,N,H], k [Tk,K,H], v [Tk,K,Hv] with B from the
// lengths and T, S the packed maxima; paged: k [P,page,K,H], v [P,page,K,Hv] caches.
std::string shapes_from(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                        const Optionals& opt, SdpaConfig* c) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const size_t rank = c->packed() ? 3 : 4;
  if (qd.size() != rank || kd.size() != rank || vd.size() != rank) {
    return c->packed() ? "q, k, v must be rank 3 (packed rows THD)"
                       : "q, k, v must be rank 4 (BTNH, BSKH, BSKH, or paged caches)";
  }
  c->dtype = q.element_type();
  c->n = qd[rank - 2], c->h = qd[rank - 1], c->k = kd[rank - 2], c->hv = vd[rank - 1];
  if (c->packed()) {
    if (!opt.q_lens) return "packed rows need the lengths";
    c->b = opt.q_lens->dimensions()[0];
    c->rows_q = qd[0], c->rows_kv = kd[0];
    c->t = c->packed_max_q, c->s = c->packed_max_kv;
  } else {
    c->b = qd[0], c->t = qd[1];
    c->s = kd[1];
  }
  if (c->paged) {
    if (!opt.page_table || opt.page_table->dimensions().size() != 2) {
      return "page_table must be rank 2 [B,max_pages]";
    }
    c->pages = kd[0], c->page = kd[1];
    c->s = c->page * opt.page_table->dimensions()[1];
  }
  std::string err;
  auto check = [&](const char* name, const ffi::AnyBuffer& buf, ffi::DataType dtype,
                   const std::vector<int64_t>& dims) {
    if (err.empty()) err = expect_dims(name, buf, dtype, dims);
  };
  if (c->paged) {
    check("k", k, c->dtype, {c->pages, c->page, c->k, c->h});
    check("v", v, c->dtype, {c->pages, c->page, c->k, c->hv});
    check("page_table", *opt.page_table, ffi::DataType::S32, {c->b, c->s / c->page});
  } else {
    check("k", k, c->dtype, kv_like(*c, c->h));
    check("v", v, c->dtype, kv_like(*c, c->hv));
  }
  if (opt.bias) {
    auto bd = opt.bias->dimensions();
    if (bd.size() != 4) return "bias must be rank 4 [Bb,Nb,T,S]";
    c->bias_b = bd[0], c->bias_n = bd[1];
    check("bias", *opt.bias, c->dtype, {c->bias_b, c->bias_n, c->t, c->s});
  }
  if (opt.q_lens) {
    check("q_lens", *opt.q_lens, ffi::DataType::S32, {c->b});
    check("kv_lens", *opt.kv_lens, ffi::DataType::S32, {c->b});
  }
  for (const auto& offsets : opt.offsets) {
    if (offsets) check("offsets", *offsets, ffi::DataType::S32, {c->b + 1});
  }
  if (opt.sinks) check("sinks", *opt.sinks, ffi::DataType::F32, {c->n});
  // One int64 each, passed as two int32 words (JAX has no int64 without x64).
  if (opt.seed) check("seed", *opt.seed, ffi::DataType::S32, {2});
  if (opt.offset) check("offset", *opt.offset, ffi::DataType::S32, {2});
  return err;
}

// The one optional result `name` after the fixed ones, present exactly when `wanted`.
std::string trailing_result(ffi::RemainingRets& rets, bool wanted, const char* name,
                            std::optional<ffi::AnyBuffer>* out) {
  if (rets.size() != (wanted ? 1u : 0u)) {
    return "expected " + std::to_string(wanted ? 1 : 0) + " trailing results (" + name +
           "), got " + std::to_string(rets.size());
  }
  if (!wanted) return "";
  auto ret = rets.get<ffi::AnyBuffer>(0);
  if (ret.has_error()) return ret.error().message();
  *out = **ret;
  return "";
}

void bind_optionals(const Optionals& opt, std::unordered_map<int64_t, void*>& tensors) {
  if (opt.bias) tensors[kBias] = opt.bias->untyped_data();
  if (opt.q_lens) {
    tensors[kSeqLenQ] = opt.q_lens->untyped_data();
    tensors[kSeqLenKv] = opt.kv_lens->untyped_data();
  }
  const int64_t offset_uids[] = {kQOffsets, kKOffsets, kVOffsets, kOOffsets};
  for (int i = 0; i < 4; ++i) {
    if (opt.offsets[i]) tensors[offset_uids[i]] = opt.offsets[i]->untyped_data();
  }
  if (opt.page_table) {  // one table serves keys and values
    tensors[kPageTableK] = tensors[kPageTableV] = opt.page_table->untyped_data();
  }
  if (opt.sinks) tensors[kSinks] = opt.sinks->untyped_data();
  if (opt.seed) tensors[kSeed] = opt.seed->untyped_data();
  if (opt.offset) tensors[kOffset] = opt.offset->untyped_data();
}

PlanLookup lookup_of(const SdpaConfig& c) {
  return [c](int device, DeviceHandle** handle, std::string* error) {
    return plan_for(c, device, handle, error);
  };
}

// ---- handlers ----------------------------------------------------------------------

// The handler attributes (every one of CUDNN_JAX_SDPA_ATTRIBUTES, nothing else) into `c`;
// "" or what is wrong with them.
std::string decode_attributes(const ffi::Dictionary& attrs, SdpaConfig* c) {
  std::string err = unexpected_attribute(attrs, kSdpaAttributeNames);
  if (err.empty()) {
    err = decode_sdpa_attributes(
        [&](const char* name, auto* field) { return get_attribute(attrs, name, field); }, c);
  }
  return err;
}

ffi::Error sdpa_fwd(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    ffi::RemainingArgs rest, ffi::Result<ffi::AnyBuffer> out,
                    ffi::Result<ffi::AnyBuffer> workspace, ffi::RemainingRets rest_rets,
                    ffi::Dictionary attrs) {
  return guarded("sdpa_fwd", [&]() -> ffi::Error {
    SdpaConfig c;
    if (std::string err = decode_attributes(attrs, &c); !err.empty()) {
      return invalid_argument(stage_message("sdpa_fwd", "attributes", err));
    }

    Optionals opt;
    std::optional<ffi::AnyBuffer> lse;
    std::string err = decode_optionals(rest, c, &opt);
    if (err.empty()) err = shapes_from(q, k, v, opt, &c);
    if (err.empty()) err = expect_dims("out", *out, c.dtype, q_like(c, c.hv));
    if (err.empty()) err = trailing_result(rest_rets, c.with_lse, "lse", &lse);
    if (err.empty() && lse) err = expect("lse", *lse, ffi::DataType::F32, {c.b, c.n, c.t});
    if (!err.empty()) return invalid_argument(stage_message("sdpa_fwd", "arguments", err));

    std::shared_ptr<CachedPlan> plan;
    DeviceHandle* handle = nullptr;
    if (ffi::Error e = plan_on_stream(op_name(c), stream, lookup_of(c), &plan, &handle);
        e.failure()) {
      return e;
    }

    std::unordered_map<int64_t, void*> tensors = {
        {kQ, q.untyped_data()}, {kK, k.untyped_data()}, {kV, v.untyped_data()},
        {kO, out->untyped_data()},
    };
    if (lse) tensors[kStats] = lse->untyped_data();
    bind_optionals(opt, tensors);
    // Rows past the valid lengths are not written by cuDNN.
    if (ffi::Error e = prefill(stream, "sdpa_fwd", c.has_padding, {&*out}); e.failure()) {
      return e;
    }
    if (lse) {
      if (ffi::Error e = prefill(stream, "sdpa_fwd", false, {&*lse}); e.failure()) return e;
    }
    return run_plan(*plan, *handle, stream, workspace_of(*workspace), tensors, "sdpa_fwd");
  });
}

ffi::Error sdpa_bwd(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    ffi::AnyBuffer out, ffi::AnyBuffer dout, ffi::AnyBuffer lse,
                    ffi::RemainingArgs rest, ffi::Result<ffi::AnyBuffer> dq,
                    ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                    ffi::Result<ffi::AnyBuffer> workspace, ffi::RemainingRets rest_rets,
                    ffi::Dictionary attrs) {
  return guarded("sdpa_bwd", [&]() -> ffi::Error {
    SdpaConfig c;
    c.backward = true;
    if (std::string err = decode_attributes(attrs, &c); !err.empty()) {
      return invalid_argument(stage_message("sdpa_bwd", "attributes", err));
    }

    Optionals opt;
    std::optional<ffi::AnyBuffer> dbias;
    std::string err = decode_optionals(rest, c, &opt);
    if (err.empty()) err = shapes_from(q, k, v, opt, &c);
    if (err.empty()) err = expect_dims("out", out, c.dtype, q_like(c, c.hv));
    if (err.empty()) err = expect_dims("dout", dout, c.dtype, q_like(c, c.hv));
    if (err.empty()) err = expect("lse", lse, ffi::DataType::F32, {c.b, c.n, c.t});
    if (err.empty()) err = expect_dims("dq", *dq, c.dtype, q_like(c, c.h));
    if (err.empty()) err = expect_dims("dk", *dk, c.dtype, kv_like(c, c.h));
    if (err.empty()) err = expect_dims("dv", *dv, c.dtype, kv_like(c, c.hv));
    if (err.empty()) err = trailing_result(rest_rets, c.has_dbias, "dbias", &dbias);
    if (err.empty() && dbias) {
      err = expect("dbias", *dbias, c.dtype, {c.bias_b, c.bias_n, c.t, c.s});
    }
    if (!err.empty()) return invalid_argument(stage_message("sdpa_bwd", "arguments", err));

    std::shared_ptr<CachedPlan> plan;
    DeviceHandle* handle = nullptr;
    if (ffi::Error e = plan_on_stream(op_name(c), stream, lookup_of(c), &plan, &handle);
        e.failure()) {
      return e;
    }

    std::unordered_map<int64_t, void*> tensors = {
        {kQ, q.untyped_data()},     {kK, k.untyped_data()},     {kV, v.untyped_data()},
        {kO, out.untyped_data()},   {kDO, dout.untyped_data()}, {kStats, lse.untyped_data()},
        {kDQ, dq->untyped_data()},  {kDK, dk->untyped_data()},  {kDV, dv->untyped_data()},
    };
    bind_optionals(opt, tensors);
    if (dbias) tensors[kDBias] = dbias->untyped_data();
    ffi::Error e = prefill(stream, "sdpa_bwd", c.has_padding,
                           {&*dq, &*dk, &*dv, dbias ? &*dbias : nullptr});
    if (e.failure()) return e;
    return run_plan(*plan, *handle, stream, workspace_of(*workspace), tensors, "sdpa_bwd");
  });
}

}  // namespace

std::string sdpa_check(const SdpaConfig& config) {
  return plan_check(op_name(config), lookup_of(config));
}

int64_t sdpa_workspace(const SdpaConfig& config, std::string* error) {
  return plan_workspace_bytes(op_name(config), lookup_of(config), error);
}

}  // namespace cudnn_jax

namespace ffi = xla::ffi;
using Stream = ffi::PlatformStream<cudaStream_t>;

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudnnJaxSdpaFwd, cudnn_jax::sdpa_fwd,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .RemainingArgs()        // [bias], [q_lens, kv_lens]
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<ffi::AnyBuffer>()  // workspace (u8)
                                  .RemainingRets()        // [lse]
                                  .Attrs(),               // CUDNN_JAX_SDPA_ATTRIBUTES
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudnnJaxSdpaBwd, cudnn_jax::sdpa_bwd,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // v
                                  .Arg<ffi::AnyBuffer>()  // out
                                  .Arg<ffi::AnyBuffer>()  // dout
                                  .Arg<ffi::AnyBuffer>()  // lse
                                  .RemainingArgs()        // [bias], [q_lens, kv_lens]
                                  .Ret<ffi::AnyBuffer>()  // dq
                                  .Ret<ffi::AnyBuffer>()  // dk
                                  .Ret<ffi::AnyBuffer>()  // dv
                                  .Ret<ffi::AnyBuffer>()  // workspace (u8)
                                  .RemainingRets()        // [dbias]
                                  .Attrs(),               // CUDNN_JAX_SDPA_ATTRIBUTES
                              {ffi::Traits::kCmdBufferCompatible});
