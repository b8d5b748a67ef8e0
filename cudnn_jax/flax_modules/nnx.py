"""The layers of ``cudnn_jax.flax_modules`` for ``flax.nnx``: same math, same parameter
names; nnx modules are built eagerly, so each takes the input width and ``rngs``."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from cudnn_jax.flax_modules import (CONV_INIT, EXPERT_INIT, a_log_init, cache_dtype_of,
                                    cached_attention, causal_block, fused_attention,
                                    kimi_delta, mixture, paged_cache, self_attention)

__all__ = ["dot_product_attention", "MultiHeadAttention", "KimiDeltaAttention", "MoEMLP",
           "CausalConv3dBlock"]


def dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                          dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                          precision=None, module=None, promote_dtype=dtypes.promote_dtype,
                          is_causal=False):
  """flax.nnx's ``attention_fn`` on ``cudnn_jax.sdpa``, for
  ``nnx.MultiHeadAttention(..., attention_fn=dot_product_attention)``: nnx's signature,
  shapes and masks (see the linen ``cudnn_jax.flax_modules.dot_product_attention`` for the
  differences). ``promote_dtype`` promotes query, key and value as nnx does (``dtype``
  when given); ``is_causal`` is sdpa's causal mask (top-left, as nnx's); ``module`` (sowing
  the attention weights) raises ``cudnn_jax.UnsupportedError``.
  """
  del broadcast_dropout, precision
  query, key, value = promote_dtype((query, key, value), dtype=dtype)
  return fused_attention(query, key, value, bias, mask, dropout_rng=dropout_rng,
                         dropout_rate=dropout_rate, deterministic=deterministic,
                         is_causal=is_causal, module=module)


class MultiHeadAttention(nnx.Module):
  """Self-attention ``x [..., T, in_features] -> [..., T, in_features]`` (see the linen
  ``MultiHeadAttention``). For decoding, ``init_cache`` creates the paged KV cache that
  ``decode=True`` calls append to (``cache_dtype``, ``k_scale``, ``v_scale`` as there)."""

  def __init__(self, in_features: int, num_heads: int, head_dim: int,
               num_kv_heads: int | None = None, is_causal: bool = False,
               local_window_size: Any = None, dtype: Any = None, implementation: Any = None,
               cache_dtype: Any = None, k_scale: float = 1.0, v_scale: float = 1.0,
               *, rngs: nnx.Rngs):
    kv_heads = num_kv_heads or num_heads
    heads = lambda n: nnx.LinearGeneral(in_features, (n, head_dim), dtype=dtype, rngs=rngs)
    self.query, self.key, self.value = heads(num_heads), heads(kv_heads), heads(kv_heads)
    self.out = nnx.LinearGeneral((num_heads, head_dim), in_features, axis=(-2, -1),
                                 dtype=dtype, rngs=rngs)
    self.is_causal, self.local_window_size = is_causal, local_window_size
    self.implementation = implementation
    self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, dtype
    self.cache_dtype, self.k_scale, self.v_scale = cache_dtype, k_scale, v_scale
    self.cache = nnx.data(None)  # an nnx.Cache once init_cache has run

  def init_cache(self, batch: int, max_length: int, *, page_size: int = 64):
    """An empty paged KV cache for ``batch`` sequences of up to ``max_length`` tokens."""
    empty = paged_cache(batch, max_length, self.kv_heads, self.head_dim,
                        cache_dtype_of(self.cache_dtype, self.dtype or jnp.float32), page_size)
    self.cache = nnx.Cache(empty)

  def __call__(self, x, *, segment_ids=None, decode=False):
    q, k, v = self.query(x), self.key(x), self.value(x)
    options = dict(is_causal=self.is_causal, local_window_size=self.local_window_size,
                   implementation=self.implementation)
    if not decode:
      return self.out(self_attention(q, k, v, segment_ids=segment_ids, **options))
    if self.cache is None:
      raise ValueError("decode: call init_cache(batch, max_length) first")
    if segment_ids is not None or x.ndim != 3:
      raise ValueError("decode: expected x [B, T, features] and no segment_ids, got x "
                       f"{tuple(x.shape)}")
    out, updated = cached_attention(self.cache.get_value(), q, k, v, k_scale=self.k_scale,
                                    v_scale=self.v_scale, **options)
    self.cache.set_value(updated)
    return self.out(out)


class KimiDeltaAttention(nnx.Module):
  """Kimi Delta Attention ``x [B, T, in_features] -> (y, state)`` (see the linen
  ``KimiDeltaAttention``)."""

  def __init__(self, in_features: int, num_heads: int, head_dim: int,
               num_v_heads: int | None = None, dtype: Any = None, implementation: Any = None,
               *, rngs: nnx.Rngs):
    hv = num_v_heads or num_heads
    linear = lambda width, n_in=in_features: nnx.Linear(n_in, width, use_bias=False,
                                                        dtype=dtype, rngs=rngs)
    self.q_proj, self.k_proj = linear(num_heads * head_dim), linear(num_heads * head_dim)
    self.v_proj, self.g_proj = linear(hv * head_dim), linear(hv * head_dim)
    self.b_proj, self.o_gate = linear(hv), linear(hv * head_dim)
    self.o_proj = linear(in_features, hv * head_dim)
    self.o_norm = nnx.RMSNorm(head_dim, dtype=dtype, rngs=rngs)
    self.a_log = nnx.Param(a_log_init(rngs.params(), (hv,)))
    self.dt_bias = nnx.Param(jnp.zeros((hv * head_dim,)))
    self.num_heads, self.num_v_heads = num_heads, hv
    self.implementation = implementation

  def __call__(self, x, state=None):
    b, t, _ = x.shape
    heads = lambda y, n: y.reshape(b, t, n, -1)
    h, hv = self.num_heads, self.num_v_heads
    o, state = kimi_delta(heads(self.q_proj(x), h), heads(self.k_proj(x), h),
                          heads(self.v_proj(x), hv), heads(self.g_proj(x), hv),
                          self.b_proj(x), self.a_log[...], self.dt_bias[...], state,
                          self.implementation)
    o = self.o_norm(o) * nnx.sigmoid(heads(self.o_gate(x), hv))
    return self.o_proj(o.reshape(b, t, -1)), state


class MoEMLP(nnx.Module):
  """Mixture-of-experts MLP ``x [..., in_features] -> [..., in_features]`` (see the linen
  ``MoEMLP``)."""

  def __init__(self, in_features: int, num_experts: int, top_k: int, hidden_dim: int,
               glu: str | None = "swiglu", activation: str | None = None, dtype: Any = None,
               implementation: Any = None, *, rngs: nnx.Rngs):
    self.router = nnx.Linear(in_features, num_experts, use_bias=False, rngs=rngs)
    up_cols = hidden_dim * (2 if glu else 1)
    self.w_up = nnx.Param(EXPERT_INIT(rngs.params(), (num_experts, in_features, up_cols)))
    self.w_down = nnx.Param(EXPERT_INIT(rngs.params(), (num_experts, hidden_dim, in_features)))
    self.top_k, self.glu, self.activation = top_k, glu, activation
    self.dtype, self.implementation = dtype, implementation

  def __call__(self, x):
    tokens = x.reshape(-1, x.shape[-1])
    if self.dtype is not None:
      tokens = tokens.astype(self.dtype)
    logits = self.router(tokens.astype(jnp.float32))
    y = mixture(tokens, logits, self.w_up[...], self.w_down[...], top_k=self.top_k,
                glu=self.glu, activation=self.activation, implementation=self.implementation)
    return y.reshape(x.shape)


class CausalConv3dBlock(nnx.Module):
  """Video VAE residual block ``x [N, T, H, W, in_features] -> [..., features]`` (see the
  linen ``CausalConv3dBlock``)."""

  def __init__(self, in_features: int, features: int, kernel_size=(3, 3, 3),
               norm: str | None = "rms", dtype: Any = None, implementation: Any = None,
               *, rngs: nnx.Rngs):
    c, f = in_features, features
    self.conv1 = nnx.Param(CONV_INIT(rngs.params(), (*kernel_size, c, f)))
    self.conv2 = nnx.Param(CONV_INIT(rngs.params(), (*kernel_size, f, f)))
    self.bias1, self.bias2 = nnx.Param(jnp.zeros((f,))), nnx.Param(jnp.zeros((f,)))
    self.norm_scale = nnx.Param(jnp.ones((f,))) if norm else None
    self.skip = nnx.Param(CONV_INIT(rngs.params(), (1, 1, 1, c, f))) if c != f else None
    self.norm, self.dtype, self.implementation = norm, dtype, implementation

  def __call__(self, x):
    if self.dtype is not None:
      x = x.astype(self.dtype)
    value = lambda p: None if p is None else p[...].astype(x.dtype)
    return causal_block(x, value(self.conv1), value(self.bias1), value(self.norm_scale),
                        value(self.conv2), value(self.bias2), value(self.skip), norm=self.norm,
                        implementation=self.implementation)
