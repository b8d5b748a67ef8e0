"""The ``xla`` engine for scaled dot-product attention, in plain JAX.

Shapes: query [B,T,N,H], key [B,S,K,H], value [B,S,K,Hv], N % K == 0. Logits and the
softmax are computed in float32 (float64 inputs too, as jax.nn does); masked logits are
excluded (not penalized), and a query row with no kept key outputs 0 with lse = -inf (or
the sink logit when ``sinks`` is given). Exclusion selects, it never fills with -inf: a
row's max is taken over its kept logits and the excluded ones get probability 0 by a
select, so no inf is formed unless a row has no kept key (its lse), and
``jax.debug_infs(True)`` stays quiet on masked calls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cudnn_jax.reference import matmul_precision

_NEG_INF = -jnp.inf
# The row max of a row with no kept logit: finite, so nothing overflows; half the float32
# range, so that differences with it stay finite too.
LOWEST = -0.5 * float(jnp.finfo(jnp.float32).max)


def band_keep(t_idx, u_idx, q_len, kv_len, *, is_causal, bottom_right, window):
  """Causal / local-window / length keep mask, broadcast over [B,1,T,S].

  ``t_idx [T]``, ``u_idx [S]`` positions; ``q_len``, ``kv_len`` [B] int32 valid lengths.
  ``window`` is None or (left, right), either side None for unbounded.
  """
  t = t_idx[None, None, :, None]
  u = u_idx[None, None, None, :]
  tb = q_len[:, None, None, None]
  sb = kv_len[:, None, None, None]
  keep = (t < tb) & (u < sb)
  diag = t + (sb - tb if bottom_right else 0)  # the key position aligned with query t
  if is_causal:
    keep &= u <= diag
  if window is not None:
    left, right = window
    if left is not None:
      keep &= u >= diag - left
    if right is not None:
      keep &= u <= diag + right
  return keep


def scaled_logits(query, key, scale, *, bias=None, logits_soft_cap=None, precision=None):
  """``[B,N,T,S]`` float32: ``scale * q.k`` (each kv head shared by its group of query
  heads), plus ``bias``, soft-capped as ``c * tanh(x / c)``."""
  b, t, n, h = query.shape
  s, k = key.shape[1], key.shape[2]
  logits = jnp.einsum("btkgh,bskh->bkgts", query.reshape(b, t, k, n // k, h), key,
                      precision=precision, preferred_element_type=jnp.float32)
  logits = logits.reshape(b, n, t, s) * jnp.float32(scale)
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  if logits_soft_cap is not None:
    c = jnp.float32(logits_soft_cap)
    logits = c * jnp.tanh(logits / c)
  return logits


def lengths_or_full(b, t, s, query_seq_lengths, key_value_seq_lengths):
  """``(q_len, kv_len)`` [B] int32: the given lengths, T and S where absent."""
  full = lambda n: jnp.full((b,), n, jnp.int32)
  return (full(t) if query_seq_lengths is None else query_seq_lengths.astype(jnp.int32),
          full(s) if key_value_seq_lengths is None else key_value_seq_lengths.astype(jnp.int32))


def sdpa(query, key, value, bias=None, mask=None, *, scale, is_causal=False,
         bottom_right=False, window=None, query_seq_lengths=None,
         key_value_seq_lengths=None, q_segment_ids=None, kv_segment_ids=None,
         logits_soft_cap=None, sinks=None, dropout_rate=0.0, dropout_rng=None):
  """Returns ``(out [B,T,N,Hv], lse [B,N,T] float32)`` for 4-D, validated inputs."""
  b, t, n, h = query.shape
  s, k = key.shape[1], key.shape[2]
  g = n // k
  prec = matmul_precision(query.dtype)

  logits = scaled_logits(query, key, scale, bias=bias, logits_soft_cap=logits_soft_cap,
                         precision=prec)
  q_len, kv_len = lengths_or_full(b, t, s, query_seq_lengths, key_value_seq_lengths)
  keep = band_keep(jnp.arange(t), jnp.arange(s), q_len, kv_len, is_causal=is_causal,
                   bottom_right=bottom_right, window=window)
  if mask is not None:
    keep = keep & mask
  if q_segment_ids is not None:
    keep = keep & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])

  # At least LOWEST: S = 0, no kept key, or kept logits all -inf (from a bias).
  row_max = jnp.maximum(jnp.max(jnp.where(keep, logits, LOWEST), axis=-1, keepdims=True,
                                initial=LOWEST), LOWEST)
  if sinks is not None:
    sink = sinks.astype(jnp.float32)[None, :, None, None]
    row_max = jnp.maximum(row_max, sink)
  # The max only stabilizes exp; it cancels in the result, so keep it out of autodiff.
  row_max = jax.lax.stop_gradient(row_max)
  p = jnp.where(keep, jnp.exp(jnp.where(keep, logits - row_max, 0.0)), 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  if sinks is not None:
    denom = denom + jnp.exp(sink - row_max)
  safe_denom = jnp.where(denom > 0, denom, 1.0)
  row_valid = (jnp.arange(t)[None, None, :, None] < q_len[:, None, None, None]) & (denom > 0)
  lse = jnp.where(row_valid, jnp.log(safe_denom) + row_max, _NEG_INF)[..., 0]
  p = p / safe_denom

  if dropout_rate > 0.0:
    kept = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, p.shape)
    p = jnp.where(kept, p / (1.0 - dropout_rate), 0.0)

  hv = value.shape[-1]
  p = p.reshape(b, k, g, t, s)
  pv_dtype = jnp.float32 if value.dtype == jnp.float32 else value.dtype
  out = jnp.einsum("bkgts,bskd->btkgd", p.astype(pv_dtype), value, precision=prec,
                   preferred_element_type=jnp.float32)
  out = out.reshape(b, t, n, hv).astype(query.dtype)
  return out, lse
