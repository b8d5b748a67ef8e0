"""Attention over packed (THD) sequences: ``cudnn_jax.sdpa_varlen``.

Engines:
- "cudnn": cuDNN's attention over the packed rows in place (ragged offsets): no padding is
  materialized and the work is each sequence's own. Where cuDNN cannot serve that, the
  padded batch below on ``sdpa``'s cudnn engine.
- "xla": the packed rows gathered into a batch of ``max_seqlen`` rows per sequence, run as
  one ``sdpa`` call with per-sequence lengths (its xla engine), gathered back. That costs
  ``n * max_seqlen_q * max_seqlen_kv`` logits rather than the sum over sequences.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cudnn_jax import _checks, _metadata, engines
from cudnn_jax.ops import sdpa as sdpa_ops


@dataclasses.dataclass(frozen=True)
class VarlenCall:
  """A packed call: the padded ``sdpa`` call it equals (B sequences of ``max_seqlen``
  rows, with lengths) and the packed row counts."""
  padded: sdpa_ops.SdpaCall
  rows_q: int
  rows_kv: int


class VarlenInputs(NamedTuple):
  query: jax.Array  # [Tq, N, H]
  key: jax.Array  # [Tk, K, H]
  value: jax.Array  # [Tk, K, Hv]
  cu_seqlens_q: jax.Array  # [n+1]
  cu_seqlens_kv: jax.Array
  sinks: jax.Array | None = None


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
  """(starts [n], lengths [n]) of the served sequences, cut at ``max_len``."""
  starts, lengths = _metadata.served_sequences(cu_seqlens, total)
  return starts, jnp.minimum(lengths, max_len)


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

  query, key, value, cu_seqlens_q, cu_seqlens_kv, sinks = _checks.arrays(
      query, key, value, cu_seqlens_q, cu_seqlens_kv, sinks)
  n = cu_seqlens_q.shape[0] - 1
  padded = engines.prepare_abstract(
      lambda *a, **kw: sdpa_ops.prepare(*a, **kw)[0],
      jax.ShapeDtypeStruct((n, max_q) + query.shape[1:], query.dtype),
      jax.ShapeDtypeStruct((n, max_kv) + key.shape[1:], key.dtype),
      jax.ShapeDtypeStruct((n, max_kv) + value.shape[1:], value.dtype),
      scale=scale, is_causal=is_causal, causal_alignment=causal_alignment,
      local_window_size=local_window_size, logits_soft_cap=logits_soft_cap, sinks=sinks,
      return_lse=return_lse, query_seq_lengths=jax.ShapeDtypeStruct((n,), jnp.int32),
      key_value_seq_lengths=jax.ShapeDtypeStruct((n,), jnp.int32))
  call = VarlenCall(padded, rows_q=query.shape[0], rows_kv=key.shape[0])
  return call, VarlenInputs(query, key, value, cu_seqlens_q, cu_seqlens_kv, sinks)


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

  ``implementation`` as for ``sdpa``: "cudnn" runs cuDNN's attention over the packed rows
  in place, "xla" the padded batch (``cudnn_jax.explain("sdpa_varlen", ...)`` names the
  engine and the path that would serve a call).
  """
  call, inputs = _prepare(
      query, key, value, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q=max_seqlen_q,
      max_seqlen_kv=max_seqlen_kv, scale=scale, is_causal=is_causal,
      causal_alignment=causal_alignment, local_window_size=local_window_size,
      logits_soft_cap=logits_soft_cap, sinks=sinks, return_lse=return_lse)
  _check(query, key, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv)
  out, lse = engines.dispatch("sdpa_varlen", implementation, call, inputs)
  return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------
# Engines.


def _lengths(call: VarlenCall, x: VarlenInputs):
  """(starts, lengths) of the served query and key/value sequences."""
  return (_sequences(x.cu_seqlens_q, call.rows_q, call.padded.t),
          _sequences(x.cu_seqlens_kv, call.rows_kv, call.padded.s))


def _on_sdpa_engine(name):
  """``run`` of the padded batch on ``sdpa``'s engine ``name``."""
  def run(call: VarlenCall, x: VarlenInputs):
    (q_starts, q_lengths), (kv_starts, kv_lengths) = _lengths(call, x)
    q_index = _metadata.packed_slots(q_starts, q_lengths, call.padded.t, call.rows_q)[0]
    kv_index = _metadata.packed_slots(kv_starts, kv_lengths, call.padded.s, call.rows_kv)[0]
    padded = sdpa_ops.SdpaInputs(
        pad_rows(x.query, q_index), pad_rows(x.key, kv_index), pad_rows(x.value, kv_index),
        query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths, sinks=x.sinks)
    out, lse = engines.engine("sdpa", name).run(call.padded, padded)
    out = unpad_rows(out, q_index, call.rows_q)
    if lse is not None:
      lse = unpad_rows(jnp.swapaxes(lse, 1, 2), q_index, call.rows_q, -jnp.inf).T
    return out, lse
  return run


def packed_config(padded: sdpa_ops.SdpaCall):
  """The handlers' config for ``padded``'s sequences as packed rows."""
  return sdpa_ops.cudnn_config(padded, packed_max_q=padded.t, packed_max_kv=padded.s)


@functools.lru_cache(maxsize=1024)
def packed_reason(padded: sdpa_ops.SdpaCall, backward: bool = False) -> str | None:
  """None when cuDNN serves ``padded``'s sequences as packed rows in place, else why not
  (of the call cuDNN sees: one query row with sinks goes in twice, as in packed_attention)."""
  view = sdpa_ops.single_row_view(padded)[0]
  return (sdpa_ops.cudnn_static_reason(view)
          or sdpa_ops.cudnn_check(view, packed_config(view), backward))


def _packed_reason(call: VarlenCall, backward: bool = False) -> str | None:
  return packed_reason(call.padded, backward)


def packed_attention(padded: sdpa_ops.SdpaCall, query, key, value, q_sequences, kv_sequences,
                     sinks=None, seed=(None, None), backward_ok=None):
  """``(out [Tq,N,Hv], lse [N,Tq] or None)`` of cuDNN's attention over packed rows in
  place: sequence i owns query rows ``q_starts[i] : + q_lengths[i]`` (``q_sequences``) and
  key/value rows likewise; ``padded`` the equal padded call. Rows no sequence owns, and
  rows that keep no key, are 0 (lse -inf, or the sink)."""
  from cudnn_jax.primitives import sdpa as prim  # pylint: disable=g-import-not-at-top
  (q_starts, q_lengths), (kv_starts, kv_lengths) = q_sequences, kv_sequences
  backward_ok = backward_ok or functools.partial(packed_reason, padded, True)
  view, row = sdpa_ops.single_row_view(padded)
  if row is not None:
    # Sequences of at most one query row, with sinks (cuDNN serves sinks with two or more
    # rows): every row goes in twice, the sequences' rows doubled, and the answering row of
    # each pair is kept (sdpa_ops.single_row_view says which).
    out, lse = packed_attention(view, jnp.repeat(query, 2, axis=0), key, value,
                                (2 * q_starts, q_lengths * (1 + row)), kv_sequences, sinks,
                                seed, backward_ok)
    return out[row::2], None if lse is None else lse[:, row::2]
  rows_q, rows_kv = query.shape[0], key.shape[0]
  first_rows = lambda starts, rows: jnp.append(starts, rows).astype(jnp.int32)  # [n+1]
  out, *lse = prim.attention(
      packed_config(padded), backward_ok, query, key, value, None, q_lengths, kv_lengths,
      first_rows(q_starts, rows_q), first_rows(kv_starts, rows_kv), sinks, *seed)
  # Rows of a sequence that keep no key, in the padded layout, then packed.
  q_index = _metadata.packed_slots(q_starts, q_lengths, padded.t, rows_q)[0]
  lengths = sdpa_ops.SdpaInputs(None, None, None, query_seq_lengths=q_lengths,
                                key_value_seq_lengths=kv_lengths)
  valid = sdpa_ops._row_valid(padded, lengths)  # pylint: disable=protected-access
  lse = lse[0] if lse else None
  if valid is not None:
    valid = unpad_rows(jnp.swapaxes(valid, 1, 2), q_index, rows_q, False)  # [Tq, 1|N]
    out = jnp.where(valid[..., None], out, jnp.zeros((), out.dtype))
  if lse is not None:
    lse = unpad_rows(jnp.swapaxes(lse, 1, 2), q_index, rows_q, -jnp.inf)  # [Tq, N]
    if valid is not None:  # a sequence's row without keys: the sink; other rows -inf
      empty = -jnp.inf if sinks is None else jnp.where(
          _metadata.row_slots(q_index, rows_q)[1][:, None], sinks[None, :], -jnp.inf)
      lse = jnp.where(valid, lse, empty)
    lse = lse.T
  return out, lse


def _run_packed(call: VarlenCall, x: VarlenInputs):
  # The module's _packed_reason, looked up when called (tests stand in for cuDNN's).
  return packed_attention(call.padded, x.query, x.key, x.value, *_lengths(call, x), x.sinks,
                          backward_ok=functools.partial(_packed_reason, call, True))


def _supports_cudnn(call: VarlenCall) -> str | None:
  packed = _packed_reason(call)
  if packed is None:
    return None
  padded = engines.engine("sdpa", "cudnn").supports(call.padded)
  return None if padded is None else f"packed rows: {packed}; padded: {padded}"


def _run_cudnn(call: VarlenCall, x: VarlenInputs):
  if _packed_reason(call) is None:
    return _run_packed(call, x)
  return _on_sdpa_engine("cudnn")(call, x)


def _describe_cudnn(call: VarlenCall) -> str:
  if _packed_reason(call) is None:
    return "cuDNN attention over the packed rows in place (ragged offsets)"
  return "the sequences padded to max_seqlen, on sdpa's cudnn engine"


engines.register_op("sdpa_varlen", lambda *a, **kw: _prepare(*a, **kw)[0])
engines.register_engine("sdpa_varlen", "xla", supports=lambda call: None,
                        run=_on_sdpa_engine("xla"))
engines.register_engine("sdpa_varlen", "cudnn", supports=_supports_cudnn, run=_run_cudnn,
                        describe=_describe_cudnn)
