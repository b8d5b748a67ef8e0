"""The ``xla`` engine for block-sparse attention, in plain JAX.

Each query block gathers the key and value blocks it selects and attends only to them, so
the work and memory scale with the selected blocks, not with ``Sq * Skv``. Logits and the
softmax are float32; a row with no kept key outputs 0 with lse = -inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cudnn_jax.reference import matmul_precision


def _blocks(x, num_blocks, block_size):
  """``[B,S,...]`` zero-padded to ``num_blocks * block_size`` rows and split into blocks:
  ``[B, num_blocks, block_size, ...]``."""
  pad = num_blocks * block_size - x.shape[1]
  x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  return x.reshape(x.shape[0], num_blocks, block_size, *x.shape[2:])


def _per_query_head(x, group):
  """``x [B,K,...]`` per kv head -> ``[B,K*group,...]`` per query head (head n reads kv head
  ``n // group``)."""
  b, k = x.shape[:2]
  x = jnp.broadcast_to(x[:, :, None], (b, k, group) + x.shape[2:])
  return x.reshape((b, k * group) + x.shape[3:])


def _select(blocks, idx):
  """``blocks [B,N,Nkv,...]`` at ``idx [B,N,Nq,Kmax]`` -> ``[B,N,Nq,Kmax,...]``: a gather
  batched over B and N (so sharded B and N stay where they are)."""
  b, n, nq, kmax = idx.shape
  flat = jnp.expand_dims(idx.reshape(b, n, nq * kmax), tuple(range(3, blocks.ndim)))
  out = jnp.take_along_axis(blocks, flat, axis=2)
  return out.reshape((b, n, nq, kmax) + blocks.shape[3:])


def bsa(query, key, value, block_index, block_counts, kv_block_sizes, *, block_size, scale,
        is_causal):
  """Returns ``(out [B,Sq,N,Hv], lse [B,N,Sq] float32)``.

  ``block_index [B,N,Nq,Kmax]`` int32 (an entry past the row's count or outside
  ``[0, Nkv)`` selects nothing), ``block_counts [B,N,Nq]`` int32, ``kv_block_sizes
  [B,K,Nkv]`` int32 (valid tokens of each kv block, clamped by the caller); validated shapes.
  Kmax may be 0 (every row outputs 0, lse -inf).
  """
  b, sq, n, h = query.shape
  skv, k, hv = key.shape[1], key.shape[2], value.shape[3]
  g, bs = n // k, block_size
  nq, nkv, kmax = block_index.shape[2], -(-skv // bs), block_index.shape[3]
  prec = matmul_precision(query.dtype)

  # Which (block slot, token) pairs each query block may see, before the causal mask.
  slot = jnp.arange(kmax)
  idx = block_index
  selected = (slot < block_counts[..., None]) & (idx >= 0) & (idx < nkv)
  idx = jnp.where(selected, idx, 0)  # [B,N,Nq,Kmax], in range
  sizes = _select(_per_query_head(kv_block_sizes, g), idx)  # [B,N,Nq,Kmax]
  token = jnp.arange(bs)
  keep = selected[..., None] & (token < sizes[..., None])  # [B,N,Nq,Kmax,bs]
  keep = keep[:, :, :, None]  # [B,N,Nq,1(query row),Kmax,bs]
  if is_causal:
    t = jnp.arange(nq)[:, None] * bs + token[None, :]  # [Nq,bs] query positions
    u = idx[..., None] * bs + token  # [B,N,Nq,Kmax,bs] key positions
    keep = keep & (u[:, :, :, None] <= t[None, None, :, :, None, None])

  # Each query head's kv blocks: [B,N,Nq,Kmax,bs,H].
  per_head = lambda x: _per_query_head(_blocks(x, nkv, bs).transpose(0, 3, 1, 2, 4), g)
  k_sel, v_sel = _select(per_head(key), idx), _select(per_head(value), idx)

  qb = _blocks(query, nq, bs).transpose(0, 3, 1, 2, 4)  # [B,N,Nq,bs,H]
  logits = jnp.einsum("bnmqh,bnmjkh->bnmqjk", qb, k_sel, precision=prec,
                      preferred_element_type=jnp.float32) * jnp.float32(scale)
  logits = jnp.where(keep, logits, -jnp.inf)
  row_max = jnp.max(logits, axis=(-2, -1), keepdims=True, initial=-jnp.inf)  # Kmax may be 0
  row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  p = jnp.exp(logits - row_max)
  denom = jnp.sum(p, axis=(-2, -1), keepdims=True)
  safe = jnp.where(denom > 0, denom, 1.0)
  lse = jnp.where(denom > 0, jnp.log(safe) + row_max, -jnp.inf)[..., 0, 0]  # [B,N,Nq,bs]
  p = p / safe
  pv_dtype = jnp.float32 if value.dtype == jnp.float32 else value.dtype
  out = jnp.einsum("bnmqjk,bnmjkd->bnmqd", p.astype(pv_dtype), v_sel, precision=prec,
                   preferred_element_type=jnp.float32)
  out = out.reshape(b, n, nq * bs, hv)[:, :, :sq].transpose(0, 2, 1, 3).astype(query.dtype)
  return out, lse.reshape(b, n, nq * bs)[:, :, :sq]
