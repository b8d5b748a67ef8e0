"""Flax (linen) layers on cudnn_jax ops.

``dot_product_attention`` has flax's ``attention_fn`` signature, so
``flax.linen.MultiHeadDotProductAttention(..., attention_fn=dot_product_attention)`` runs
on ``cudnn_jax.sdpa`` unchanged. ``MultiHeadAttention``, ``KimiDeltaAttention``,
``MoEMLP`` and ``CausalConv3dBlock`` are whole layers; every one takes ``implementation`` (passed to the op).
``cudnn_jax.flax_modules.nnx`` has the same layers for ``flax.nnx``. Needs ``flax``
(``pip install cudnn-jax[flax]``).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import cudnn_jax


def _flat_batch(x, batch, tail):
  """x broadcast to ``batch + x.shape[-tail:]`` with the batch dims folded into one."""
  x = jnp.broadcast_to(x, batch + x.shape[x.ndim - tail:])
  return x.reshape((-1,) + x.shape[len(batch):])


def fused_attention(query, key, value, bias=None, mask=None, *, dropout_rng=None,
                    dropout_rate=0.0, deterministic=False, is_causal=False, module=None,
                    **unsupported):
  """The math behind linen's and nnx's ``attention_fn`` here, on promoted inputs:
  ``query [batch..., T, N, H]``, ``key [batch..., S, K, H]``, ``value [batch..., S, K, Hv]``;
  ``bias`` and ``mask`` (nonzero keeps) broadcast to ``[batch..., N, T, S]``.

  ``unsupported``: arguments that would change the math and that a fused kernel cannot
  honour; any that is set raises ``cudnn_jax.UnsupportedError`` saying why.
  """
  if module is not None:
    raise cudnn_jax.UnsupportedError(
        "module: sowing the attention weights is not supported: the fused attention never "
        "forms them; use flax's own dot_product_attention to inspect them")
  for name, value_ in unsupported.items():
    if value_ is not None:
      raise cudnn_jax.UnsupportedError(
          f"{name}: custom einsums (e.g. quantized ones) cannot run inside the fused "
          "attention; use flax's own dot_product_attention with them")
  if mask is not None:
    mask = jnp.asarray(mask).astype(jnp.bool_)  # flax masks may be 0/1 floats
  rate = 0.0 if deterministic else float(dropout_rate)
  kwargs = dict(dropout_rate=rate, dropout_rng=dropout_rng if rate > 0 else None,
                is_causal=bool(is_causal))
  if query.ndim <= 4:
    return cudnn_jax.sdpa(query, key, value, bias, mask, **kwargs)
  batch = query.shape[:-3]
  q, k, v = (_flat_batch(x, batch, 3) for x in (query, key, value))
  bias, mask = (None if x is None else _flat_batch(x, batch, 3) for x in (bias, mask))
  out = cudnn_jax.sdpa(q, k, v, bias, mask, **kwargs)
  return out.reshape(batch + out.shape[1:])


def dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                          dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                          precision=None, module=None, force_fp32_for_softmax=False,
                          einsum_dot_general=None, qk_attn_weights_einsum=None,
                          attn_weights_value_einsum=None, is_causal=False):
  """flax.linen's ``attention_fn`` on ``cudnn_jax.sdpa``: ``query [batch..., T, N, H]``,
  ``key [batch..., S, K, H]``, ``value [batch..., S, K, Hv]``; ``bias`` and ``mask``
  (nonzero keeps) broadcast to ``[batch..., N, T, S]``. Returns ``[batch..., T, N, Hv]``.

  As in flax, query, key and value are promoted to one dtype (``dtype`` when given; float64
  included). Differences, each on purpose:
  - the softmax is always computed in float32, so ``force_fp32_for_softmax`` is accepted
    and changes nothing; ``precision`` is not needed: float32 products are exact float32
    (``Precision.HIGHEST``), narrower inputs accumulate in float32;
  - ``einsum_dot_general``, ``qk_attn_weights_einsum`` and ``attn_weights_value_einsum``
    (custom, e.g. quantized, einsums) and ``module`` (sowing the attention weights) raise
    ``cudnn_jax.UnsupportedError``: the fused attention never forms the weights;
  - dropout (when not ``deterministic``) is sdpa's, with a mask per batch element and head
    whatever ``broadcast_dropout`` says;
  - a query row whose keys are all masked outputs 0 (flax: the mean of the values).
  ``is_causal`` (not in linen's signature) adds sdpa's causal mask.
  """
  del broadcast_dropout, precision, force_fp32_for_softmax
  query, key, value = nn.dtypes.promote_dtype(query, key, value, dtype=dtype)
  return fused_attention(query, key, value, bias, mask, dropout_rng=dropout_rng,
                         dropout_rate=dropout_rate, deterministic=deterministic,
                         is_causal=is_causal, module=module,
                         einsum_dot_general=einsum_dot_general,
                         qk_attn_weights_einsum=qk_attn_weights_einsum,
                         attn_weights_value_einsum=attn_weights_value_einsum)


# The layers' math on projected arrays, shared by the linen classes below and ``nnx``.


def self_attention(q, k, v, *, segment_ids, is_causal, local_window_size, implementation,
                   **context_parallel):
  """``q [..., T, N, H]``, ``k``/``v [..., T, K, H]``, ``segment_ids [..., T]`` or None;
  ``context_parallel``: sdpa's ``context_parallel_axis`` and ``_strategy``, if given."""
  batch = q.shape[:-3]
  q, k, v = (x.reshape((-1,) + x.shape[len(batch):]) for x in (q, k, v))
  seg = None if segment_ids is None else segment_ids.reshape(-1, segment_ids.shape[-1])
  out = cudnn_jax.sdpa(q, k, v, is_causal=is_causal, local_window_size=local_window_size,
                       q_segment_ids=seg, kv_segment_ids=seg, implementation=implementation,
                       **context_parallel)
  return out.reshape(batch + out.shape[1:])


def paged_cache(batch, max_length, kv_heads, head_dim, dtype, page_size):
  """An empty paged KV cache for ``batch`` sequences of up to ``max_length`` tokens:
  ``key_pages``/``value_pages [P, page_size, kv_heads, head_dim]``, ``page_table [batch,
  pages per sequence]`` (sequence b owns pages ``b*pages ... (b+1)*pages - 1`` to start
  with; any table over the same pages works) and ``lengths [batch]`` (tokens cached)."""
  pages = -(-max_length // page_size)
  shape = (batch * pages, page_size, kv_heads, head_dim)
  return dict(key_pages=jnp.zeros(shape, dtype), value_pages=jnp.zeros(shape, dtype),
              page_table=jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages),
              lengths=jnp.zeros((batch,), jnp.int32))


FP8_CACHE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def cache_dtype_of(cache_dtype, compute_dtype):
  """The dtype a paged cache stores: ``cache_dtype`` (None: the compute dtype, or
  float8_e4m3fn with per-layer scales)."""
  if cache_dtype is None:
    return jnp.dtype(compute_dtype)
  if jnp.dtype(cache_dtype) not in (jnp.dtype(FP8_CACHE), jnp.dtype(compute_dtype)):
    raise ValueError(f"cache_dtype: expected None or float8_e4m3fn, got {cache_dtype!r}")
  return jnp.dtype(cache_dtype)


def cached_attention(cache, q, k, v, *, is_causal, local_window_size, implementation,
                     k_scale=1.0, v_scale=1.0):
  """Appends ``k``/``v [B, T, K, H]`` to each sequence of ``cache`` (at its length) and
  attends ``q [B, T, N, H]`` over everything cached, with ``cudnn_jax.sdpa_paged`` (causal
  bottom-right aligned). Returns ``(out [B, T, N, H], updated cache)``; tokens past the
  cache's capacity are not stored. An FP8 cache stores ``x / scale`` (saturated at the
  format's largest value) and is read back as ``stored * scale``."""
  table, lengths = cache["page_table"], cache["lengths"]
  pages, page = cache["key_pages"].shape[:2]
  capacity = table.shape[1] * page
  position = lengths[:, None] + jnp.arange(k.shape[1], dtype=jnp.int32)  # [B, T]
  physical = jnp.take_along_axis(table, jnp.minimum(position // page, table.shape[1] - 1),
                                 axis=1)
  physical = jnp.where(position < capacity, physical, pages)  # past the end: dropped
  fp8 = cache["key_pages"].dtype == jnp.dtype(FP8_CACHE)
  scales = dict(k_scale=jnp.float32(k_scale), v_scale=jnp.float32(v_scale)) if fp8 else {}

  def store(pages_, x, scale):
    if fp8:
      x = jnp.clip(x.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX)
    return pages_.at[physical, position % page].set(x.astype(pages_.dtype), mode="drop")

  cache = dict(cache, key_pages=store(cache["key_pages"], k, k_scale),
               value_pages=store(cache["value_pages"], v, v_scale),
               lengths=jnp.minimum(lengths + k.shape[1], capacity))
  out = cudnn_jax.sdpa_paged(q, cache["key_pages"], cache["value_pages"], table,
                             cache["lengths"], is_causal=is_causal,
                             local_window_size=local_window_size,
                             implementation=implementation, **scales)
  return out, cache


def kimi_delta(q, k, v, g, beta, a_log, dt_bias, state, implementation,
               sequence_parallel_axis=None):
  """The KDA layer's recurrence: gate in the kernel, beta sigmoid, q/k l2-normalized."""
  return cudnn_jax.kda(q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32),
                       initial_state=state, output_final_state=True,
                       use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, a_log=a_log,
                       dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True,
                       sequence_parallel_axis=sequence_parallel_axis,
                       implementation=implementation)


def a_log_init(key, shape, dtype=jnp.float32):
  """log of decay rates drawn uniformly from [1, 16]."""
  return jnp.log(jax.random.uniform(key, shape, dtype, minval=1.0, maxval=16.0))


def mixture(tokens, logits, w_up, w_down, *, top_k, glu, activation, implementation):
  """Top-k routing (softmax over the chosen logits) and ``moe_mlp``: ``tokens [T, D]``."""
  top_logits, experts = jax.lax.top_k(logits, top_k)
  weights = jax.nn.softmax(top_logits, axis=-1).astype(tokens.dtype)
  return cudnn_jax.moe_mlp(tokens, experts.astype(jnp.int32), weights,
                           w_up.astype(tokens.dtype), w_down.astype(tokens.dtype), glu=glu,
                           activation=activation, implementation=implementation)


EXPERT_INIT = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
CONV_INIT = nn.initializers.lecun_normal(in_axis=(0, 1, 2, 3), out_axis=-1)


def causal_block(x, w1, b1, scale1, w2, b2, w_skip, *, norm, implementation):
  """The VAE residual block: ``h = silu(norm(conv(x, w1) + b1) * scale1)``, then
  ``conv(h, w2) + b2 + skip(x)`` (skip: x, or a 1x1x1 conv to the block's width); every
  conv causal in time."""
  conv = lambda x, w, **kw: cudnn_jax.conv3d(x, w, padding="CAUSAL",
                                             implementation=implementation, **kw)
  h = conv(x, w1, bias=b1, norm=norm, norm_scale=scale1 if norm else None,
           num_groups=min(32, w1.shape[-1]), activation="silu")
  skip = x if w_skip is None else conv(x, w_skip)
  return conv(h, w2, bias=b2, residual=skip.astype(h.dtype))


class MultiHeadAttention(nn.Module):
  """Self-attention: ``x [..., T, features] -> [..., T, features]``.

  Query heads ``num_heads``, key/value heads ``num_kv_heads`` (default: num_heads; fewer
  is GQA/MQA), each ``head_dim`` wide; ``segment_ids [..., T]`` keeps attention inside
  packed sequences.

  Decoding: ``decode=True`` keeps a paged KV cache (``paged_cache``, pages of
  ``page_size`` tokens) in the "cache" collection. The first such call, made when
  initializing the collection with ``x [B, max_length, features]``, sizes the cache and
  attends within x; each later call appends its ``x [B, T, features]`` tokens (one for
  decoding, more for a chunk of a prompt) and attends over everything cached
  (``cudnn_jax.sdpa_paged``; causal, when the layer is, aligned to the newest token).
  ``cache_dtype`` (None: the compute dtype) may be ``jnp.float8_e4m3fn``: the cache stores
  ``k / k_scale`` and ``v / v_scale`` (static per-layer scales, 1.0 unless calibrated) and
  attention reads it back as ``stored * scale``, half the bytes of a bf16 cache.

  ``context_parallel_axis`` (and ``context_parallel_strategy``): sdpa's context
  parallelism, the sequence sharded along that mesh axis (not with segment_ids).
  """
  num_heads: int
  head_dim: int
  num_kv_heads: int | None = None
  is_causal: bool = False
  local_window_size: Any = None
  dtype: Any = None
  implementation: Any = None
  page_size: int = 64
  cache_dtype: Any = None
  k_scale: float = 1.0
  v_scale: float = 1.0
  context_parallel_axis: str | None = None
  context_parallel_strategy: str = "all_gather"

  @nn.compact
  def __call__(self, x, *, segment_ids=None, decode=False):
    kv_heads = self.num_kv_heads or self.num_heads
    dense = lambda heads, name: nn.DenseGeneral((heads, self.head_dim), dtype=self.dtype,
                                                name=name)
    q, k, v = dense(self.num_heads, "query")(x), dense(kv_heads, "key")(x), dense(
        kv_heads, "value")(x)
    options = dict(is_causal=self.is_causal, local_window_size=self.local_window_size,
                   implementation=self.implementation)
    if decode and self.has_variable("cache", "lengths"):
      if segment_ids is not None or x.ndim != 3:
        raise ValueError("decode: expected x [B, T, features] and no segment_ids, got x "
                         f"{tuple(x.shape)}")
      names = ("key_pages", "value_pages", "page_table", "lengths")
      cache = {n: self.variable("cache", n) for n in names}
      out, updated = cached_attention({n: c.value for n, c in cache.items()}, q, k, v,
                                      k_scale=self.k_scale, v_scale=self.v_scale, **options)
      for n, c in cache.items():
        c.value = updated[n]
    else:
      if decode:  # first call: size the cache by x
        empty = paged_cache(x.shape[0], x.shape[1], kv_heads, self.head_dim,
                            cache_dtype_of(self.cache_dtype, k.dtype), self.page_size)
        for n, value in empty.items():
          self.variable("cache", n, lambda value=value: value)
      parallel = {} if self.context_parallel_axis is None else dict(
          context_parallel_axis=self.context_parallel_axis,
          context_parallel_strategy=self.context_parallel_strategy)
      out = self_attention(q, k, v, segment_ids=segment_ids, **options, **parallel)
    return nn.DenseGeneral(x.shape[-1], axis=(-2, -1), dtype=self.dtype, name="out")(out)


class KimiDeltaAttention(nn.Module):
  """Kimi Delta Attention layer: ``x [B, T, features] -> (y [B, T, features], state)``.

  Projections to q, k (``num_heads`` x ``head_dim``) and v (``num_v_heads`` x
  ``head_dim``); a per-channel gate computed in the kernel (``-exp(a_log) *
  softplus(g + dt_bias)``), beta through a sigmoid, q/k l2-normalized; then a per-head RMS
  norm of the output times a sigmoid output gate, and the output projection. ``state``
  (float32 ``[B, num_v_heads, head_dim, head_dim]``) continues a sequence, e.g. decoding.
  ``sequence_parallel_axis``: kda's, the sequence sharded along that mesh axis.
  """
  num_heads: int
  head_dim: int
  num_v_heads: int | None = None
  dtype: Any = None
  implementation: Any = None
  sequence_parallel_axis: str | None = None

  @nn.compact
  def __call__(self, x, state=None):
    b, t, features = x.shape
    hv, d = self.num_v_heads or self.num_heads, self.head_dim
    dense = lambda width, name, **kw: nn.Dense(width, dtype=self.dtype, name=name, **kw)
    heads = lambda y, n: y.reshape(b, t, n, -1)
    q = heads(dense(self.num_heads * d, "q_proj", use_bias=False)(x), self.num_heads)
    k = heads(dense(self.num_heads * d, "k_proj", use_bias=False)(x), self.num_heads)
    v = heads(dense(hv * d, "v_proj", use_bias=False)(x), hv)
    g = heads(dense(hv * d, "g_proj", use_bias=False)(x), hv)
    beta = dense(hv, "b_proj", use_bias=False)(x)
    a_log = self.param("a_log", a_log_init, (hv,))
    dt_bias = self.param("dt_bias", nn.initializers.zeros, (hv * d,))
    o, state = kimi_delta(q, k, v, g, beta, a_log, dt_bias, state, self.implementation,
                          self.sequence_parallel_axis)
    o = nn.RMSNorm(dtype=self.dtype, name="o_norm")(o)
    gate = heads(dense(hv * d, "o_gate", use_bias=False)(x), hv)
    o = (o * jax.nn.sigmoid(gate)).reshape(b, t, hv * d)
    return dense(features, "o_proj", use_bias=False)(o), state


class CausalConv3dBlock(nn.Module):
  """Video VAE residual block on ``cudnn_jax.conv3d``: ``x [N, T, H, W, C] -> [N, T, H, W,
  features]`` (two causal convolutions, the first with ``norm`` and SiLU fused, the second
  with the skip connection fused; a 1x1x1 convolution projects the skip when C !=
  features). With norm="group" the groups are min(32, features)."""
  features: int
  kernel_size: tuple = (3, 3, 3)
  norm: str | None = "rms"
  dtype: Any = None
  implementation: Any = None

  @nn.compact
  def __call__(self, x):
    if self.dtype is not None:
      x = x.astype(self.dtype)
    c, f = x.shape[-1], self.features
    param = lambda name, init, shape: self.param(name, init, shape).astype(x.dtype)
    w1 = param("conv1", CONV_INIT, (*self.kernel_size, c, f))
    w2 = param("conv2", CONV_INIT, (*self.kernel_size, f, f))
    b1, b2 = param("bias1", nn.initializers.zeros, (f,)), param("bias2", nn.initializers.zeros,
                                                               (f,))
    scale1 = param("norm_scale", nn.initializers.ones, (f,)) if self.norm else None
    w_skip = param("skip", CONV_INIT, (1, 1, 1, c, f)) if c != f else None
    return causal_block(x, w1, b1, scale1, w2, b2, w_skip, norm=self.norm,
                        implementation=self.implementation)


class MoEMLP(nn.Module):
  """Mixture-of-experts MLP: ``x [..., features] -> [..., features]``.

  A bias-free router picks ``top_k`` of ``num_experts`` per token (softmax over the chosen
  logits), each expert is ``glu`` (or ``activation`` with glu=None) with ``hidden_dim``
  units, on ``cudnn_jax.moe_mlp``.
  """
  num_experts: int
  top_k: int
  hidden_dim: int
  glu: str | None = "swiglu"
  activation: str | None = None
  dtype: Any = None
  implementation: Any = None

  @nn.compact
  def __call__(self, x):
    shape, d = x.shape, x.shape[-1]
    tokens = x.reshape(-1, d)
    if self.dtype is not None:
      tokens = tokens.astype(self.dtype)
    logits = nn.Dense(self.num_experts, use_bias=False, dtype=jnp.float32, name="router")(
        tokens)
    up_cols = self.hidden_dim * (2 if self.glu else 1)
    w_up = self.param("w_up", EXPERT_INIT, (self.num_experts, d, up_cols))
    w_down = self.param("w_down", EXPERT_INIT, (self.num_experts, self.hidden_dim, d))
    y = mixture(tokens, logits, w_up, w_down, top_k=self.top_k, glu=self.glu,
                activation=self.activation, implementation=self.implementation)
    return y.reshape(shape[:-1] + (d,))
