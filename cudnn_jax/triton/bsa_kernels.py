"""Block-sparse flash attention as Pallas kernels compiled by XLA through Triton: the
forward pass and the two backward passes, each program walking a list of blocks that it
reads on the device.

Shapes (cudnn_jax/triton/bsa.py pads the sequences to whole blocks of ``bs`` tokens):
``q [B,T,N,H]``, ``k [B,S,K,H]``, ``v [B,S,K,Hv]``, ``do`` like the output ``[B,T,N,Hv]``;
``blocks [B,N,Nq,L]`` int32, of which the first ``counts [B,N,Nq]`` entries of each query
block are kv blocks it may keep keys of; ``sizes [B,K,Nkv]`` the valid tokens of each kv
block. Query head n reads kv head ``n // group``: the kv blocks are read in place, never
repeated per query head.

Forward, one program per (batch, head, query block m), for each listed kv block c:

    s = scale q k_c^T, -inf where masked (key past the block's size; u > t if causal;
        query rows t >= Sq, the padding)
    mx' = max(mx, rowmax s);  l = l e^{mx - mx'} + rowsum e^{s - mx'};
    acc = acc e^{mx - mx'} + e^{s - mx'} v_c
    out = acc / l,  lse = mx + log l   (0 and -inf for a row that keeps no key)

dq, one program per query block, the same walk (``delta = rowsum(do * out) - dlse``):

    p = e^{s - lse},  ds = p (do v_c^T - delta),  dq += scale ds k_c

dk and dv, one program per (batch, kv head, kv block c): the walk over the (query head,
query block) pairs that list c, every query head of the group included:

    dv_c += p^T do,  dk_c += scale ds^T q

Every sum runs in a fixed order inside one program, with no atomics: the gradients are the
same bits on every run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from cudnn_jax.triton.common import (LN2, LOG2E, dot as _dot, launch, softmax_init,
                                     softmax_step)


def _params(bs, dtype):
  # One warp group per 64 query rows. Two stages overlap the next kv block's loads with the
  # current block's products; float32 tiles, twice as large, keep one so they fit in
  # shared memory.
  stages = 1 if jnp.dtype(dtype) == jnp.float32 else 2
  return pl_triton.CompilerParams(num_warps=4 if bs == 64 else 8, num_stages=stages)


def _launch(kernel, args, *, bs, dtype, **kw):
  """``launch`` with the block size's and dtype's (q, k, v) compiler parameters."""
  return launch(kernel, args, compiler_params=_params(bs, dtype), **kw)


def _rows(m, bs):
  """Token positions of query block m: ``[bs, 1]``."""
  return m * bs + jax.lax.broadcasted_iota(jnp.int32, (bs, 1), 0)


def _kept(t, c, size, *, bs, causal, sq):
  """``[bs, bs]`` bool: which (query row, key) pairs of kv block c count; t ``[bs, 1]`` the
  rows' positions, size the block's valid tokens."""
  j = jax.lax.broadcasted_iota(jnp.int32, (1, bs), 1)
  keep = j < size
  if sq % bs:  # the padding rows of the last query block
    keep &= t < sq
  if causal:
    keep &= c * bs + j <= t
  return keep


def _probs(q, k, t, c, size, lse2, *, bs, scale, causal, sq):
  """``p = e^{scale q k^T - lse}`` on the kept pairs, 0 elsewhere: ``[bs, bs]`` float32;
  ``lse2 = log2(e) lse``."""
  s2 = (scale * LOG2E) * _dot(q, k, tb=True) - lse2[:, None]
  return jnp.where(_kept(t, c, size, bs=bs, causal=causal, sq=sq), jnp.exp2(s2), 0.0)


def _block(ref, b, c, head, bs):
  """Rows ``c*bs ...`` of ``ref [B, S, heads, D]`` at one batch row and head: ``[bs, D]``."""
  return ref[b, pl.ds(pl.multiple_of(c * bs, bs), bs), head, :]


# ---------------------------------------------------------------------------------------
# Forward.


def _forward_kernel(blocks_ref, counts_ref, sizes_ref, q_ref, k_ref, v_ref, o_ref, lse_ref,
                    *, bs, group, scale, causal, sq):
  b, n, m = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  q = q_ref[...]
  t = _rows(m, bs)

  def step(j, carry):
    c = blocks_ref[b, n, m, j]
    k, v = _block(k_ref, b, c, n // group, bs), _block(v_ref, b, c, n // group, bs)
    keep = _kept(t, c, sizes_ref[b, n // group, c], bs=bs, causal=causal, sq=sq)
    return softmax_step(carry, jnp.where(keep, (scale * LOG2E) * _dot(q, k, tb=True),
                                         -jnp.inf), v)

  acc, mx, l = jax.lax.fori_loop(0, counts_ref[b, n, m], step,
                                 softmax_init(bs, o_ref.shape[1]))
  kept = l > 0
  o_ref[...] = (acc / jnp.where(kept, l, 1.0)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(kept, LN2 * (mx + jnp.log2(jnp.where(kept, l, 1.0))), -jnp.inf)


def _token_spec(bs, d, at):
  """Blocks of ``bs`` tokens of one head of ``[B, T, heads, d]``, the block ``at(*ids)``
  gives as (batch, block, head)."""
  return pl.BlockSpec((None, bs, None, d), lambda *ids: (*at(*ids), 0))


@functools.partial(jax.jit, static_argnames=("bs", "scale", "causal", "sq", "interpret"))
def forward(q, k, v, blocks, counts, sizes, *, bs, scale, causal, sq, interpret=False):
  """``(out [B,T,N,Hv]`` in q's dtype, ``lse [B,N,T]`` float32``)``; T and S multiples of
  bs, ``sq <= T`` the real query length."""
  b, t, n, h = q.shape
  kh, hv = k.shape[2], v.shape[3]
  whole = pl.no_block_spec
  by_query_block = lambda b_, n_, m: (b_, m, n_)
  kernel = functools.partial(_forward_kernel, bs=bs, group=n // kh, scale=scale,
                             causal=causal, sq=sq)
  return _launch(
      kernel, (blocks, counts, sizes, q, k, v), grid=(b, n, t // bs),
      in_specs=[whole, whole, whole, _token_spec(bs, h, by_query_block), whole, whole],
      out_specs=[_token_spec(bs, hv, by_query_block),
                 pl.BlockSpec((None, None, bs), lambda b_, n_, m: (b_, n_, m))],
      out_shape=[jax.ShapeDtypeStruct((b, t, n, hv), q.dtype),
                 jax.ShapeDtypeStruct((b, n, t), jnp.float32)],
      bs=bs, dtype=q.dtype, interpret=interpret, name="bsa_forward")


# ---------------------------------------------------------------------------------------
# Backward.


def _dq_kernel(blocks_ref, counts_ref, sizes_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
               delta_ref, dq_ref, *, bs, group, scale, causal, sq):
  b, n, m = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  q, do, lse2, delta = q_ref[...], do_ref[...], LOG2E * lse_ref[...], delta_ref[...]
  t = _rows(m, bs)

  def step(j, dq):
    c = blocks_ref[b, n, m, j]
    k, v = _block(k_ref, b, c, n // group, bs), _block(v_ref, b, c, n // group, bs)
    p = _probs(q, k, t, c, sizes_ref[b, n // group, c], lse2, bs=bs, scale=scale,
               causal=causal, sq=sq)
    ds = p * (_dot(do, v, tb=True) - delta[:, None])
    return dq + _dot(ds.astype(k.dtype), k)

  dq = jax.lax.fori_loop(0, counts_ref[b, n, m], step, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (scale * dq).astype(dq_ref.dtype)


def _dkdv_kernel(pairs_ref, starts_ref, totals_ref, sizes_ref, q_ref, k_ref, v_ref, do_ref,
                 lse_ref, delta_ref, dk_ref, dv_ref, *, bs, nq, scale, causal, sq):
  b, kh, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  k, v = k_ref[...], v_ref[...]
  size, start = sizes_ref[b, kh, c], starts_ref[b, kh, c]

  def step(i, carry):
    dk, dv = carry
    row = pairs_ref[b, start + i]  # n * Nq + m: query head n, query block m
    n, m = row // nq, row % nq
    q, do = _block(q_ref, b, m, n, bs), _block(do_ref, b, m, n, bs)
    rows = pl.ds(pl.multiple_of(m * bs, bs), bs)
    lse, delta = lse_ref[b, n, rows], delta_ref[b, n, rows]
    p = _probs(q, k, _rows(m, bs), c, size, LOG2E * lse, bs=bs, scale=scale, causal=causal,
               sq=sq)
    dv = dv + _dot(p.astype(do.dtype), do, ta=True)
    ds = p * (_dot(do, v, tb=True) - delta[:, None])
    return dk + _dot(ds.astype(q.dtype), q, ta=True), dv

  zeros = lambda ref: jnp.zeros(ref.shape, jnp.float32)
  dk, dv = jax.lax.fori_loop(0, totals_ref[b, kh, c], step, (zeros(dk_ref), zeros(dv_ref)))
  dk_ref[...] = (scale * dk).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


@functools.partial(jax.jit, static_argnames=("bs", "scale", "causal", "sq", "interpret"))
def dq(q, k, v, do, lse, delta, blocks, counts, sizes, *, bs, scale, causal, sq,
       interpret=False):
  """``dq [B,T,N,H]`` in q's dtype; ``lse``, ``delta [B,N,T]`` float32."""
  b, t, n, h = q.shape
  hv = v.shape[3]
  whole = pl.no_block_spec
  by_query_block = lambda b_, n_, m: (b_, m, n_)
  rows = pl.BlockSpec((None, None, bs), lambda b_, n_, m: (b_, n_, m))
  kernel = functools.partial(_dq_kernel, bs=bs, group=n // k.shape[2], scale=scale,
                             causal=causal, sq=sq)
  return _launch(
      kernel, (blocks, counts, sizes, q, k, v, do, lse, delta), grid=(b, n, t // bs),
      in_specs=[whole, whole, whole, _token_spec(bs, h, by_query_block), whole, whole,
                _token_spec(bs, hv, by_query_block), rows, rows],
      out_specs=[_token_spec(bs, h, by_query_block)],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)],
      bs=bs, dtype=q.dtype, interpret=interpret, name="bsa_dq")[0]


@functools.partial(jax.jit, static_argnames=("bs", "scale", "causal", "sq", "interpret"))
def dkdv(q, k, v, do, lse, delta, pairs, starts, totals, sizes, *, bs, scale, causal, sq,
         interpret=False):
  """``(dk [B,S,K,H], dv [B,S,K,Hv])`` in k's dtype. ``pairs [B,E]``: for kv block c of kv
  head kh, the rows ``n*Nq + m`` that list it are ``pairs[b, starts[b,kh,c] : ... +
  totals[b,kh,c]]`` (``starts``, ``totals [B,K,Nkv]``)."""
  b, s, kh, h = k.shape
  hv = v.shape[3]
  whole = pl.no_block_spec
  by_kv_block = lambda b_, kh_, c: (b_, c, kh_)
  kernel = functools.partial(_dkdv_kernel, bs=bs, nq=q.shape[1] // bs, scale=scale,
                             causal=causal, sq=sq)
  return _launch(
      kernel, (pairs, starts, totals, sizes, q, k, v, do, lse, delta), grid=(b, kh, s // bs),
      in_specs=[whole, whole, whole, whole, whole, _token_spec(bs, h, by_kv_block),
                _token_spec(bs, hv, by_kv_block), whole, whole, whole],
      out_specs=[_token_spec(bs, h, by_kv_block), _token_spec(bs, hv, by_kv_block)],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype),
                 jax.ShapeDtypeStruct(v.shape, v.dtype)],
      bs=bs, dtype=q.dtype, interpret=interpret, name="bsa_dkdv")
