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

from cudnn_jax import _checks, _metadata, engines
from cudnn_jax.primitives import core
from cudnn_jax.ops.sdpa import prepare as sdpa_prepare


def gather_pages(cache, page_table, lengths):
  """``cache [P,page,K,D]``, ``page_table [B,max_pages]`` -> ``[B, max_pages*page, K, D]``,
  rows at or past ``lengths [B]`` and rows of page ids outside ``[0, P)`` zeroed (a cache's
  unused rows may hold anything; an invalid id reads no page)."""
  pages, page = cache.shape[:2]
  b, max_pages = page_table.shape
  out_sharding = None
  if core.explicit_mesh([cache]) is not None:
    # Explicit shardings: the rows keep the table's batch and the cache's head sharding.
    table_spec = tuple(jax.typeof(page_table).sharding.spec) + (None,) * 2
    cache_spec = tuple(jax.typeof(cache).sharding.spec) + (None,) * 4
    out_sharding = P(*table_spec[:2], *cache_spec[1:4])
  index = jnp.where(_metadata.in_range(page_table, pages), page_table, pages)
  rows = jnp.asarray(cache).at[index].get(mode="fill", fill_value=0, out_sharding=out_sharding)
  rows = rows.reshape(b, max_pages * page, *cache.shape[2:])
  keep = key_positions(page_table, lengths, pages, page)
  return jnp.where(keep[:, :, None, None], rows, jnp.zeros((), cache.dtype))


def key_positions(page_table, lengths, pages, page):
  """``[B, max_pages*page]`` bool: the cache positions that hold keys, those before
  ``lengths [B]`` on a page id in ``[0, pages)``."""
  valid_page = jnp.repeat(_metadata.in_range(page_table, pages), page, axis=1)
  return valid_page & (jnp.arange(valid_page.shape[1])[None, :] < lengths[:, None])


def _check_caches(query, key_cache, value_cache):
  """Shapes and dtypes, named as the user passed them (before the pages are gathered)."""
  _checks.shape_of("query", query, 4)
  kc = _checks.shape_of("key_cache", key_cache, 4)
  vc = _checks.shape_of("value_cache", value_cache, 4)
  for name, x in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
    _checks.float_dtype(name, x)
  _checks.same_dtype("query, key_cache, value_cache", query, key_cache, value_cache)
  if vc[:3] != kc[:3]:
    raise ValueError("value_cache: expected [P,page,K,Hv] with key_cache's P, page, K "
                     f"{kc[:3]}, got {vc}")
  n, h = query.shape[2:]
  if kc[3] != h:
    raise ValueError(f"key_cache: expected [P,page,K,H] with query's H={h}, got {kc}")
  if kc[2] < 1 or n % kc[2]:
    raise ValueError(f"key_cache: kv heads K={kc[2]} must be >= 1 and divide query's "
                     f"N={n}, got shape {kc}")
  if kc[0] < 1 or kc[1] < 1:
    raise ValueError(f"key_cache: expected P >= 1 pages of page >= 1 rows, got shape {kc}")


def _prepare(query, key_cache, value_cache, page_table, key_value_seq_lengths, *,
             query_seq_lengths=None, scale=None, is_causal=True, local_window_size=None,
             logits_soft_cap=None, sinks=None, return_lse=False, implementation=None):
  """Validates the user's arguments into the gathered call: (SdpaCall, SdpaInputs)."""
  del implementation
  _check_caches(query, key_cache, value_cache)
  _checks.shape_of("page_table", page_table, 2)
  _checks.int_dtype("page_table", page_table)
  b = query.shape[0]
  if page_table.shape[0] != b:
    raise ValueError(f"page_table: expected [B,max_pages] with B={b}, got "
                     f"{tuple(page_table.shape)}")
  _checks.shape_of("key_value_seq_lengths", key_value_seq_lengths, 1)
  _checks.int_dtype("key_value_seq_lengths", key_value_seq_lengths)
  _checks.expect_shape("key_value_seq_lengths", key_value_seq_lengths, (b,))

  pages, page = key_cache.shape[:2]
  kv_lengths = _metadata.clamp_lengths(key_value_seq_lengths, _capacity(page_table, page))
  table = jnp.asarray(page_table).astype(jnp.int32)
  keep = key_positions(table, kv_lengths, pages, page)
  return sdpa_prepare(
      query, gather_pages(key_cache, table, kv_lengths),
      gather_pages(value_cache, table, kv_lengths), mask=keep[:, None, None, :],
      scale=scale, is_causal=is_causal, causal_alignment="bottom_right",
      local_window_size=local_window_size, logits_soft_cap=logits_soft_cap, sinks=sinks,
      return_lse=return_lse, query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=kv_lengths)


def _capacity(page_table, page):
  return page_table.shape[1] * page


def _check(query, key_cache, page_table, key_value_seq_lengths, query_seq_lengths):
  """The metadata checks, under ``checkify`` only: lengths within capacity, and the page
  ids of the pages that hold keys in ``[0, P)``."""
  pages, page = key_cache.shape[:2]
  capacity = _capacity(page_table, page)
  _metadata.check_lengths("key_value_seq_lengths", key_value_seq_lengths, capacity)
  if query_seq_lengths is not None:
    _metadata.check_lengths("query_seq_lengths", query_seq_lengths, query.shape[1])
  lengths = _metadata.clamp_lengths(key_value_seq_lengths, capacity)
  used = jnp.arange(page_table.shape[1])[None, :] * page < lengths[:, None]
  _metadata.check_indices("page_table", page_table, pages, used)


def sdpa_paged(query, key_cache, value_cache, page_table, key_value_seq_lengths, *,
               query_seq_lengths=None, scale=None, is_causal=True, local_window_size=None,
               logits_soft_cap=None, sinks=None, return_lse=False, implementation=None):
  """Attention of new query tokens over a paged KV cache (decode, chunked prefill).

  ``query [B,T,N,H]`` (T=1 for decode), ``key_cache [P,page,K,H]``,
  ``value_cache [P,page,K,Hv]``, ``page_table [B,max_pages]`` int32 (logical page j of
  sequence b is physical page ``page_table[b, j]``), ``key_value_seq_lengths [B]`` int32
  (the sequence's cached tokens, the new ones included), ``query_seq_lengths [B]``
  optional. Causal is
  bottom-right aligned: query row t of sequence b sees keys ``u <= t + S_b - T_b``.
  Otherwise ``sdpa``'s math; returns ``out [B,T,N,Hv]`` and, with ``return_lse=True``,
  ``lse [B,N,T]`` float32.

  Invalid metadata (SPEC section 8): lengths are clamped to ``[0, max_pages * page]`` (and
  ``[0, T]``); a page id outside ``[0, P)`` contributes no keys (its positions are masked,
  never clipped to a valid page, so no sequence reads another's pages). Under
  ``jax.experimental.checkify.checkify`` (user checks) each such entry raises an error
  naming the argument and the entry (page ids only of pages below the length).

  ``implementation`` as for ``sdpa``, whose engines serve the gathered call
  (``cudnn_jax.explain("sdpa_paged", ...)`` names the one that would).
  """
  call, inputs = _prepare(query, key_cache, value_cache, page_table, key_value_seq_lengths,
                          query_seq_lengths=query_seq_lengths, scale=scale,
                          is_causal=is_causal, local_window_size=local_window_size,
                          logits_soft_cap=logits_soft_cap, sinks=sinks, return_lse=return_lse)
  _check(query, key_cache, page_table, key_value_seq_lengths, query_seq_lengths)
  out, lse = engines.dispatch("sdpa_paged", implementation, call, inputs)
  return (out, lse) if return_lse else out


engines.register_op("sdpa_paged", lambda *a, **kw: _prepare(*a, **kw)[0], engines_of="sdpa")
