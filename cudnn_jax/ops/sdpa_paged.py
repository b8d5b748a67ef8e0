"""Attention over a paged KV cache: ``cudnn_jax.sdpa_paged``.

Each sequence's pages are gathered into contiguous keys and values and the call runs as
one ``sdpa`` call with the sequences' lengths and bottom-right causal alignment, so every
engine of ``sdpa`` serves ``sdpa_paged`` where it serves that call. The gather reads every
page of the table once more than a kernel reading pages in place would.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from cudnn_jax import _checks, engines
from cudnn_jax.primitives import core
from cudnn_jax.ops.sdpa import prepare as sdpa_prepare


def gather_pages(cache, page_table, lengths):
  """``cache [P,page,K,D]``, ``page_table [B,max_pages]`` -> ``[B, max_pages*page, K, D]``,
  rows at or past ``lengths [B]`` zeroed (a cache's unused rows may hold anything). Page
  ids are clipped into the cache."""
  pages, page = cache.shape[:2]
  b, max_pages = page_table.shape
  index = jnp.clip(page_table, 0, pages - 1)
  out_sharding = None
  if core.explicit_mesh([cache]) is not None:
    # Explicit shardings: the rows keep the table's batch and the cache's head sharding.
    table_spec = tuple(jax.typeof(page_table).sharding.spec) + (None,) * 2
    cache_spec = tuple(jax.typeof(cache).sharding.spec) + (None,) * 4
    out_sharding = P(*table_spec[:2], *cache_spec[1:4])
  rows = jnp.asarray(cache).at[index].get(out_sharding=out_sharding)
  rows = rows.reshape(b, max_pages * page, *cache.shape[2:])
  keep = jnp.arange(max_pages * page)[None, :] < lengths[:, None]
  return jnp.where(keep[:, :, None, None], rows, jnp.zeros((), cache.dtype))


def _prepare(query, key_cache, value_cache, page_table, key_value_seq_lengths, *,
             query_seq_lengths=None, scale=None, is_causal=True, local_window_size=None,
             logits_soft_cap=None, sinks=None, return_lse=False, implementation=None):
  """Validates the user's arguments into the gathered call: (SdpaCall, SdpaInputs)."""
  del implementation
  _checks.shape_of("query", query, 4)
  kc = _checks.shape_of("key_cache", key_cache, 4)
  vc = _checks.shape_of("value_cache", value_cache, 4)
  _checks.shape_of("page_table", page_table, 2)
  _checks.int_dtype("page_table", page_table)
  if vc[:3] != kc[:3]:
    raise ValueError("value_cache: expected [P,page,K,Hv] with key_cache's P, page, K "
                     f"{kc[:3]}, got {vc}")
  b = query.shape[0]
  if page_table.shape[0] != b:
    raise ValueError(f"page_table: expected [B,max_pages] with B={b}, got "
                     f"{tuple(page_table.shape)}")
  _checks.shape_of("key_value_seq_lengths", key_value_seq_lengths, 1)
  _checks.int_dtype("key_value_seq_lengths", key_value_seq_lengths)
  _checks.expect_shape("key_value_seq_lengths", key_value_seq_lengths, (b,))

  capacity = page_table.shape[1] * kc[1]
  kv_lengths = jnp.clip(key_value_seq_lengths.astype(jnp.int32), 0, capacity)
  table = page_table.astype(jnp.int32)
  return sdpa_prepare(
      query, gather_pages(key_cache, table, kv_lengths),
      gather_pages(value_cache, table, kv_lengths), scale=scale, is_causal=is_causal,
      causal_alignment="bottom_right", local_window_size=local_window_size,
      logits_soft_cap=logits_soft_cap, sinks=sinks, return_lse=return_lse,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=kv_lengths)


def sdpa_paged(query, key_cache, value_cache, page_table, key_value_seq_lengths, *,
               query_seq_lengths=None, scale=None, is_causal=True, local_window_size=None,
               logits_soft_cap=None, sinks=None, return_lse=False, implementation=None):
  """Attention of new query tokens over a paged KV cache (decode, chunked prefill).

  ``query [B,T,N,H]`` (T=1 for decode), ``key_cache [P,page,K,H]``,
  ``value_cache [P,page,K,Hv]``, ``page_table [B,max_pages]`` int32 (logical page j of
  sequence b is physical page ``page_table[b, j]``; ids outside ``[0, P)`` are clipped),
  ``key_value_seq_lengths [B]`` int32 (the sequence's cached tokens, the new ones included;
  clipped to ``max_pages * page``), ``query_seq_lengths [B]`` optional. Causal is
  bottom-right aligned: query row t of sequence b sees keys ``u <= t + S_b - T_b``.
  Otherwise ``sdpa``'s math; returns ``out [B,T,N,Hv]`` and, with ``return_lse=True``,
  ``lse [B,N,T]`` float32.

  ``implementation`` as for ``sdpa``, whose engines serve the gathered call
  (``cudnn_jax.explain("sdpa_paged", ...)`` names the one that would).
  """
  call, inputs = _prepare(query, key_cache, value_cache, page_table, key_value_seq_lengths,
                          query_seq_lengths=query_seq_lengths, scale=scale,
                          is_causal=is_causal, local_window_size=local_window_size,
                          logits_soft_cap=logits_soft_cap, sinks=sinks, return_lse=return_lse)
  out, lse = engines.dispatch("sdpa_paged", implementation, call, inputs)
  return (out, lse) if return_lse else out


engines.register_op("sdpa_paged", lambda *a, **kw: _prepare(*a, **kw)[0], engines_of="sdpa")
