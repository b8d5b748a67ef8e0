"""``sdpa``'s xla engine for long sequences: attention block by block, in plain JAX.

The math of ``cudnn_jax.reference.sdpa`` without its ``[B,N,T,S]`` logits: query blocks
are mapped over, and within each the key/value blocks are scanned with an online softmax
(the running row max and denominator rescale the running output). The custom VJP keeps
only the output and lse, and recomputes each block's probabilities from them (the flash
attention backward), so memory grows linearly in T and S. Dropout draws one mask per
(query block, key block) from ``fold_in`` of the key: deterministic for a key, and
different from the reference's mask.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cudnn_jax.reference import matmul_precision
from cudnn_jax.reference import sdpa as ref

BLOCK_Q = 512  # query rows per block
BLOCK_K = 512  # key rows per block


class _Options(NamedTuple):
  """The static arguments, hashable."""
  scale: float
  is_causal: bool
  bottom_right: bool
  window: tuple | None
  softcap: float | None
  dropout_rate: float
  t: int  # unpadded extents
  s: int


class _Arrays(NamedTuple):
  """The array arguments, padded to whole blocks; absent ones None."""
  q: jax.Array  # [B, Tp, N, H]
  k: jax.Array  # [B, Sp, K, H]
  v: jax.Array  # [B, Sp, K, Hv]
  bias: jax.Array | None  # [Bb, Nb, Tp | 1, Sp | 1]
  mask: jax.Array | None
  q_len: jax.Array  # [B] int32
  kv_len: jax.Array
  q_seg: jax.Array | None  # [B, Tp]
  kv_seg: jax.Array | None  # [B, Sp]
  sinks: jax.Array | None  # [N] float32
  rng: jax.Array | None


def _pad(x, axis, size):
  if x is None or x.shape[axis] in (1, size):
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


def _block(x, axis, index, size):
  """Block ``index`` of ``size`` along ``axis`` (a broadcast dim of 1 as it is)."""
  if x is None or x.shape[axis] == 1:
    return x
  return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis)


def _sizes(o: _Options):
  bq, bk = min(BLOCK_Q, o.t), min(BLOCK_K, o.s)
  return bq, bk, -(-o.t // bq), -(-o.s // bk)


def _logits(o: _Options, q, k, bias):
  """``[B, N, bq, bk]`` float32 logits of a query block and a key block."""
  b, bq, n, h = q.shape
  kh = k.shape[2]
  s = jnp.einsum("btkgh,bskh->bkgts", q.reshape(b, bq, kh, n // kh, h), k,
                 precision=matmul_precision(q.dtype), preferred_element_type=jnp.float32)
  s = s.reshape(b, n, bq, k.shape[1]) * jnp.float32(o.scale)
  if bias is not None:
    s = s + bias.astype(jnp.float32)
  if o.softcap is not None:
    s = o.softcap * jnp.tanh(s / o.softcap)
  return s


def _keep(o: _Options, x: _Arrays, i, j, bq, bk):
  """``[B, 1|N, bq, bk]`` bool: the kept logits of block (i, j)."""
  t_idx, u_idx = i * bq + jnp.arange(bq), j * bk + jnp.arange(bk)
  keep = ref.band_keep(t_idx, u_idx, x.q_len, x.kv_len, is_causal=o.is_causal,
                       bottom_right=o.bottom_right, window=o.window)
  if x.mask is not None:
    keep = keep & _block(_block(x.mask, 2, i, bq), 3, j, bk)
  if x.q_seg is not None:
    q_seg, kv_seg = _block(x.q_seg, 1, i, bq), _block(x.kv_seg, 1, j, bk)
    keep = keep & (q_seg[:, None, :, None] == kv_seg[:, None, None, :])
  return keep


def _dropped(o: _Options, x: _Arrays, i, j, p):
  """``p`` with inverted dropout, its mask drawn for block (i, j)."""
  if not o.dropout_rate:
    return p
  key = jax.random.fold_in(jax.random.fold_in(x.rng, i), j)
  kept = jax.random.bernoulli(key, 1.0 - o.dropout_rate, p.shape)
  return jnp.where(kept, p / (1.0 - o.dropout_rate), 0.0)


def _pv(p, v):
  """``p [B, N, bq, bk] @ v [B, bk, K, Hv] -> [B, bq, N, Hv]`` float32."""
  b, n, bq, bk = p.shape
  kh, hv = v.shape[2], v.shape[3]
  dtype = jnp.float32 if v.dtype == jnp.float32 else v.dtype
  out = jnp.einsum("bkgts,bskd->btkgd", p.reshape(b, kh, n // kh, bq, bk).astype(dtype), v,
                   precision=matmul_precision(v.dtype), preferred_element_type=jnp.float32)
  return out.reshape(b, bq, n, hv)


def _forward(o: _Options, x: _Arrays):
  """``(out [B, Tp, N, Hv] float32, lse [B, N, Tp])``."""
  bq, bk, nq, nk = _sizes(o)
  b, _, n, _ = x.q.shape
  hv = x.v.shape[3]

  def query_block(i):
    q = _block(x.q, 1, i, bq)

    def key_block(carry, j):
      m, l, acc = carry
      s = _logits(o, q, _block(x.k, 1, j, bk), _block(_block(x.bias, 2, i, bq), 3, j, bk))
      keep = _keep(o, x, i, j, bq, bk)
      # Excluded logits are selected out, never filled with -inf (see reference/sdpa.py).
      m_new = jnp.maximum(m, jnp.max(jnp.where(keep, s, ref.LOWEST), axis=-1))
      alpha = jnp.exp(m - m_new)
      p = jnp.where(keep, jnp.exp(jnp.where(keep, s - m_new[..., None], 0.0)), 0.0)
      l = l * alpha + jnp.sum(p, axis=-1)
      p = _dropped(o, x, i, j, p)
      acc = acc * jnp.swapaxes(alpha, 1, 2)[..., None] + _pv(p, _block(x.v, 1, j, bk))
      return (m_new, l, acc), None

    # A sink joins every row from the start: the running max at it, its term exp(0).
    if x.sinks is not None:
      m0 = jnp.broadcast_to(x.sinks.astype(jnp.float32)[None, :, None], (b, n, bq))
      l0 = jnp.ones((b, n, bq), jnp.float32)
    else:
      m0, l0 = jnp.full((b, n, bq), ref.LOWEST), jnp.zeros((b, n, bq), jnp.float32)
    acc0 = jnp.zeros((b, bq, n, hv), jnp.float32)
    (m, l, acc), _ = jax.lax.scan(key_block, (m0, l0, acc0), jnp.arange(nk))
    rows = (i * bq + jnp.arange(bq))[None, None, :] < x.q_len[:, None, None]
    valid = rows & (l > 0)
    safe_l = jnp.where(l > 0, l, 1.0)
    lse = jnp.where(valid, jnp.log(safe_l) + m, -jnp.inf)
    out = acc / jnp.swapaxes(safe_l, 1, 2)[..., None]
    return jnp.where(jnp.swapaxes(valid, 1, 2)[..., None], out, 0.0), lse

  out, lse = jax.lax.map(query_block, jnp.arange(nq))  # [nq, B, bq, N, Hv], [nq, B, N, bq]
  out = jnp.moveaxis(out, 0, 1).reshape(b, nq * bq, n, hv)
  lse = jnp.moveaxis(lse, 0, 2).reshape(b, n, nq * bq)
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(o: _Options, x: _Arrays):
  return _forward(o, x)


def _attention_fwd(o, x):
  out, lse = _forward(o, x)
  return (out, lse), (x, out, lse)


def _attention_bwd(o, res, cts):
  x, out, lse = res
  dout, dlse = cts
  bq, bk, nq, nk = _sizes(o)
  # D = rowsum(dout * out); with lse's cotangent, dS = P * (dP - D + dlse).
  delta = jnp.swapaxes(jnp.sum(dout * out, axis=-1), 1, 2) - dlse  # [B, N, Tp]
  delta = jnp.where(jnp.isfinite(lse), delta, 0.0)
  zeros = lambda a: None if a is None else jnp.zeros(a.shape, jnp.float32)

  def query_block(carry, i):
    dk, dv, dbias = carry
    q, do = _block(x.q, 1, i, bq), _block(dout, 1, i, bq)
    lse_i, delta_i = _block(lse, 2, i, bq), _block(delta, 2, i, bq)

    def key_block(dq, j):
      k, v = _block(x.k, 1, j, bk), _block(x.v, 1, j, bk)
      bias = _block(_block(x.bias, 2, i, bq), 3, j, bk)
      f32 = lambda a: None if a is None else a.astype(jnp.float32)
      s, pull = jax.vjp(lambda q, k, bias: _logits(o, q, k, bias), f32(q), f32(k), f32(bias))
      keep = _keep(o, x, i, j, bq, bk)
      shifted = s - jnp.where(jnp.isfinite(lse_i), lse_i, 0.0)[..., None]
      p = jnp.where(keep, jnp.exp(jnp.where(keep, shifted, 0.0)), 0.0)
      dv_j = _pv_transposed(_dropped(o, x, i, j, p), do, v.shape[2])
      dp = _dropped(o, x, i, j, _dp(do, v))
      dq_j, dk_j, dbias_j = pull(p * (dp - delta_i[..., None]))
      return dq + dq_j, (dk_j, dv_j, dbias_j)

    dq, (dk_blocks, dv_blocks, dbias_blocks) = jax.lax.scan(
        key_block, jnp.zeros(q.shape, jnp.float32), jnp.arange(nk))
    dk = dk + _unblocked(dk_blocks)
    dv = dv + _unblocked(dv_blocks)
    if dbias is not None:
      dbias = _add_bias_blocks(dbias, dbias_blocks, i, bq, bk)
    return (dk, dv, dbias), dq

  (dk, dv, dbias), dq = jax.lax.scan(query_block, (zeros(x.k), zeros(x.v), zeros(x.bias)),
                                     jnp.arange(nq))
  dq = jnp.moveaxis(dq, 0, 1).reshape(x.q.shape)
  dsinks = None
  if x.sinks is not None:  # a sink's probability in row t: exp(sink - lse_t)
    finite = jnp.isfinite(lse)
    p_sink = jnp.where(finite, jnp.exp(jnp.where(finite, x.sinks[None, :, None] - lse, 0.0)),
                       0.0)
    dsinks = -jnp.sum(p_sink * delta, axis=(0, 2))
  cast = lambda g, a: None if a is None else g.astype(a.dtype)
  return (x._replace(q=cast(dq, x.q), k=cast(dk, x.k), v=cast(dv, x.v),
                     bias=cast(dbias, x.bias), mask=None, q_len=None, kv_len=None, q_seg=None,
                     kv_seg=None, sinks=cast(dsinks, x.sinks), rng=None),)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _dp(do, v):
  """``dout [B, bq, N, Hv] . v [B, bk, K, Hv] -> [B, N, bq, bk]`` float32."""
  b, bq, n, hv = do.shape
  kh = v.shape[2]
  dp = jnp.einsum("btkgd,bskd->bkgts", do.reshape(b, bq, kh, n // kh, hv), v.astype(jnp.float32),
                  precision=jax.lax.Precision.HIGHEST)
  return dp.reshape(b, n, bq, v.shape[1])


def _pv_transposed(p, do, kh):
  """``p [B, N, bq, bk]^T @ dout [B, bq, N, Hv] -> [B, bk, K, Hv]`` (summed over groups)."""
  b, n, bq, bk = p.shape
  hv = do.shape[-1]
  return jnp.einsum("bkgts,btkgd->bskd", p.reshape(b, kh, n // kh, bq, bk),
                    do.reshape(b, bq, kh, n // kh, hv), precision=jax.lax.Precision.HIGHEST)


def _unblocked(blocks):
  """``[nk, B, bk, ...]`` -> ``[B, nk * bk, ...]``."""
  return jnp.moveaxis(blocks, 0, 1).reshape((blocks.shape[1], -1) + blocks.shape[3:])


def _add_bias_blocks(dbias, blocks, i, bq, bk):
  """``dbias`` plus query block i's bias gradients ``blocks [nk, Bb, Nb, bq|1, bk|1]``."""
  rows = dbias.shape[2] > 1
  if dbias.shape[3] > 1:
    blocks = jnp.moveaxis(blocks, 0, 3).reshape(blocks.shape[1:4] + (-1,))
  else:
    blocks = jnp.sum(blocks, axis=0)
  start = (0, 0, i * bq if rows else 0, 0)
  return jax.lax.dynamic_update_slice(
      dbias, jax.lax.dynamic_slice(dbias, start, blocks.shape) + blocks, start)


def sdpa(query, key, value, bias=None, mask=None, *, scale, is_causal=False,
         bottom_right=False, window=None, query_seq_lengths=None,
         key_value_seq_lengths=None, q_segment_ids=None, kv_segment_ids=None,
         logits_soft_cap=None, sinks=None, dropout_rate=0.0, dropout_rng=None):
  """``reference.sdpa``'s arguments and results, ``(out [B,T,N,Hv], lse [B,N,T])``,
  computed block by block."""
  b, t, _, _ = query.shape
  s = key.shape[1]
  o = _Options(float(scale), is_causal, bottom_right, window, logits_soft_cap,
               float(dropout_rate), t, s)
  bq, bk, nq, nk = _sizes(o)
  tp, sp = nq * bq, nk * bk
  lengths = lambda x, size: (jnp.full((b,), size, jnp.int32) if x is None
                             else x.astype(jnp.int32))
  x = _Arrays(
      q=_pad(query, 1, tp), k=_pad(key, 1, sp), v=_pad(value, 1, sp),
      bias=_pad(_pad(bias, 2, tp), 3, sp), mask=_pad(_pad(mask, 2, tp), 3, sp),
      q_len=lengths(query_seq_lengths, t), kv_len=lengths(key_value_seq_lengths, s),
      q_seg=_pad(q_segment_ids, 1, tp), kv_seg=_pad(kv_segment_ids, 1, sp),
      sinks=None if sinks is None else sinks.astype(jnp.float32),
      rng=dropout_rng if dropout_rate else None)
  out, lse = _attention(o, x)
  return out[:, :t].astype(query.dtype), lse[:, :, :t]
