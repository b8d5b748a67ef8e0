"""Attention over packed (THD) sequences: ``cudnn_jax.sdpa_varlen``.

The packed rows are gathered into a batch of ``max_seqlen`` rows per sequence and run as
one ``sdpa`` call with per-sequence lengths, so every engine of ``sdpa`` serves
``sdpa_varlen`` where it serves that padded call; the outputs are gathered back into the
packed layout. The cost is that of the padded batch: ``n * max_seqlen_q * max_seqlen_kv``
logits rather than the sum over sequences.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cudnn_jax import _checks, engines
from cudnn_jax.ops.sdpa import prepare as sdpa_prepare


def segment_rows(cu_seqlens, total, max_len):
  """(starts [n], lengths [n]) of the sequences ``cu_seqlens [n+1]`` describes in ``total``
  packed rows, each at most ``max_len`` long, clipped so that no index leaves the rows."""
  cu = jnp.clip(cu_seqlens.astype(jnp.int32), 0, total)
  starts = cu[:-1]
  lengths = jnp.clip(cu[1:] - starts, 0, max_len)
  return starts, lengths


def pad_rows(x, starts, lengths, max_len):
  """Packed ``x [T, ...]`` -> ``[n, max_len, ...]``: row ``(i, t)`` is ``x[starts[i] + t]``
  for ``t < lengths[i]``, else 0."""
  t = jnp.arange(max_len, dtype=jnp.int32)
  valid = t[None, :] < lengths[:, None]
  index = jnp.where(valid, starts[:, None] + t[None, :], 0)
  rows = jnp.take(x, jnp.clip(index, 0, max(x.shape[0] - 1, 0)), axis=0)
  valid = valid.reshape(valid.shape + (1,) * (x.ndim - 1))
  return jnp.where(valid, rows, jnp.zeros((), x.dtype))


def packed_rows(cu_seqlens, lengths, total):
  """(sequence [T], position [T], valid [T]) of each packed row: which padded row holds it.
  Rows past ``cu_seqlens[-1]``, and rows of a sequence past its (clipped) length, are not
  valid."""
  n = lengths.shape[0]
  p = jnp.arange(total, dtype=jnp.int32)
  cu = jnp.clip(cu_seqlens.astype(jnp.int32), 0, total)
  seq = jnp.clip(jnp.searchsorted(cu[1:], p, side="right").astype(jnp.int32), 0, n - 1)
  pos = p - cu[seq]
  valid = (p < cu[-1]) & (pos >= 0) & (pos < lengths[seq])
  return seq, jnp.where(valid, pos, 0), valid


def _prepare(query, key, value, cu_seqlens_q, cu_seqlens_kv, *, max_seqlen_q, max_seqlen_kv,
             scale=None, is_causal=False, causal_alignment="top_left", local_window_size=None,
             logits_soft_cap=None, sinks=None, return_lse=False, implementation=None):
  """Validates the user's arguments into the padded call: (SdpaCall, SdpaInputs)."""
  del implementation
  _checks.shape_of("query", query, 3)
  _checks.shape_of("key", key, 3)
  _checks.shape_of("value", value, 3)
  for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv)):
    _checks.shape_of(name, cu, 1)
    _checks.int_dtype(name, cu)
    if cu.shape[0] < 2:
      raise ValueError(f"{name}: expected [n+1] prefix sums with n >= 1, got {tuple(cu.shape)}")
  if cu_seqlens_q.shape != cu_seqlens_kv.shape:
    raise ValueError("cu_seqlens_q, cu_seqlens_kv: expected one sequence count, got shapes "
                     f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_kv.shape)}")
  max_q = _checks.static_int("max_seqlen_q", max_seqlen_q, minimum=1)
  max_kv = _checks.static_int("max_seqlen_kv", max_seqlen_kv, minimum=1)
  if key.shape[0] != value.shape[0]:
    raise ValueError(f"key, value: expected one token count, got shapes {tuple(key.shape)} "
                     f"and {tuple(value.shape)}")

  q_starts, q_lengths = segment_rows(cu_seqlens_q, query.shape[0], max_q)
  kv_starts, kv_lengths = segment_rows(cu_seqlens_kv, key.shape[0], max_kv)
  return sdpa_prepare(
      pad_rows(query, q_starts, q_lengths, max_q), pad_rows(key, kv_starts, kv_lengths, max_kv),
      pad_rows(value, kv_starts, kv_lengths, max_kv), scale=scale, is_causal=is_causal,
      causal_alignment=causal_alignment, local_window_size=local_window_size,
      logits_soft_cap=logits_soft_cap, sinks=sinks, return_lse=return_lse,
      query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths)


def sdpa_varlen(query, key, value, cu_seqlens_q, cu_seqlens_kv, *, max_seqlen_q, max_seqlen_kv,
                scale=None, is_causal=False, causal_alignment="top_left",
                local_window_size=None, logits_soft_cap=None, sinks=None, return_lse=False,
                implementation=None):
  """Attention over packed sequences.

  ``query [Tq,N,H]``, ``key [Tk,K,H]``, ``value [Tk,K,Hv]``; ``cu_seqlens_q`` and
  ``cu_seqlens_kv`` ``[n+1]`` int32 prefix sums: sequence i owns query rows
  ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and key/value rows ``cu_seqlens_kv[i]:...``.
  ``max_seqlen_q`` / ``max_seqlen_kv`` are static upper bounds of the lengths. Each sequence
  gets ``sdpa``'s math on its own rows (causal and window positions count within the
  sequence; ``causal_alignment="bottom_right"`` aligns the ends of its query and key rows).

  Returns ``out [Tq,N,Hv]`` (rows past ``cu_seqlens_q[-1]`` are 0) and, with
  ``return_lse=True``, ``lse [N,Tq]`` float32 (-inf on those rows). Rows of a sequence
  longer than its ``max_seqlen`` bound are treated like rows past the end; indices never
  leave the arrays. Differentiable in query, key, value and sinks.

  ``implementation`` as for ``sdpa``: the engines of ``sdpa`` serve the padded batch
  (``cudnn_jax.explain("sdpa_varlen", ...)`` names the one that would).
  """
  call, inputs = _prepare(query, key, value, cu_seqlens_q, cu_seqlens_kv,
                          max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv, scale=scale,
                          is_causal=is_causal, causal_alignment=causal_alignment,
                          local_window_size=local_window_size,
                          logits_soft_cap=logits_soft_cap, sinks=sinks, return_lse=return_lse)
  out, lse = engines.dispatch("sdpa_varlen", implementation, call, inputs)
  seq, pos, valid = packed_rows(cu_seqlens_q, inputs.query_seq_lengths, query.shape[0])
  out = jnp.where(valid[:, None, None], out[seq, pos], jnp.zeros((), out.dtype))
  if not return_lse:
    return out
  lse = jnp.where(valid[None, :], lse[seq, :, pos].T, -jnp.inf)
  return out, lse


engines.register_op("sdpa_varlen", lambda *a, **kw: _prepare(*a, **kw)[0], engines_of="sdpa")
