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

from cudnn_jax import _checks, _metadata, engines
from cudnn_jax.ops.sdpa import prepare as sdpa_prepare


def pad_rows(x, index):
  """Packed ``x [T, ...]`` -> ``[n, max_len, ...]`` by ``_metadata.packed_slots``'s
  ``index [n, max_len]``: row ``(i, t)`` is ``x[index[i, t]]``, 0 where out of range."""
  return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


def unpad_rows(y, index, total, fill=0):
  """The inverse of ``pad_rows``: ``y [n, max_len, ...]`` -> ``[total, ...]``, rows no slot
  holds set to ``fill``."""
  slot, owned = _metadata.row_slots(index, total)
  rows = y.reshape((-1,) + y.shape[2:])[slot]
  owned = owned.reshape(owned.shape + (1,) * (rows.ndim - 1))
  return jnp.where(owned, rows, jnp.asarray(fill, y.dtype))


def _sequences(cu_seqlens, total, max_len):
  """(index [n, max_len], lengths [n]) of the served sequences, cut at ``max_len``."""
  starts, lengths = _metadata.served_sequences(cu_seqlens, total)
  index, _ = _metadata.packed_slots(starts, lengths, max_len, total)
  return index, jnp.minimum(lengths, max_len)


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

  q_index, q_lengths = _sequences(cu_seqlens_q, query.shape[0], max_q)
  kv_index, kv_lengths = _sequences(cu_seqlens_kv, key.shape[0], max_kv)
  call, inputs = sdpa_prepare(
      pad_rows(query, q_index), pad_rows(key, kv_index), pad_rows(value, kv_index),
      scale=scale, is_causal=is_causal,
      causal_alignment=causal_alignment, local_window_size=local_window_size,
      logits_soft_cap=logits_soft_cap, sinks=sinks, return_lse=return_lse,
      query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths)
  return call, inputs, q_index


def _check(query, key, cu_seqlens_q, cu_seqlens_kv, max_q, max_kv):
  """The metadata checks, under ``checkify`` only."""
  _metadata.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, query.shape[0], max_q,
                             "max_seqlen_q")
  _metadata.check_cu_seqlens("cu_seqlens_kv", cu_seqlens_kv, key.shape[0], max_kv,
                             "max_seqlen_kv")


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

  Returns ``out [Tq,N,Hv]`` and, with ``return_lse=True``, ``lse [N,Tq]`` float32.

  Invalid offsets (SPEC section 8): sequence i is served only when
  ``0 <= cu[i] <= cu[i+1] <= rows`` and ``cu[i]`` is at least every earlier entry, any
  other is empty; a sequence longer than ``max_seqlen_*`` is cut to its first
  ``max_seqlen_*`` rows. Rows no served sequence owns (past ``cu_seqlens_q[-1]``, past a
  cut, of an empty sequence) output 0 with lse -inf; nothing is read out of bounds or from
  another sequence. Under ``jax.experimental.checkify.checkify`` (user checks) each such
  offset raises an error naming the argument and the entry. Differentiable in query, key,
  value and sinks.

  ``implementation`` as for ``sdpa``: the engines of ``sdpa`` serve the padded batch
  (``cudnn_jax.explain("sdpa_varlen", ...)`` names the one that would).
  """
  call, inputs, q_index = _prepare(
      query, key, value, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q=max_seqlen_q,
      max_seqlen_kv=max_seqlen_kv, scale=scale, is_causal=is_causal,
      causal_alignment=causal_alignment, local_window_size=local_window_size,
      logits_soft_cap=logits_soft_cap, sinks=sinks, return_lse=return_lse)
  _check(query, key, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv)
  out, lse = engines.dispatch("sdpa_varlen", implementation, call, inputs)
  out = unpad_rows(out, q_index, query.shape[0])
  if not return_lse:
    return out
  return out, unpad_rows(jnp.swapaxes(lse, 1, 2), q_index, query.shape[0], -jnp.inf).T


engines.register_op("sdpa_varlen", lambda *a, **kw: _prepare(*a, **kw)[0], engines_of="sdpa")
