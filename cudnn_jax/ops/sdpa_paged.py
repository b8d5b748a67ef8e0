"""Attention over a paged KV cache: ``cudnn_jax.sdpa_paged``.

Engines:
- "cudnn": cuDNN's attention reading the pages in place through the page table (decode:
  one query row per sequence; more rows take the gathered call below). Page ids
  are not trusted: a call whose used pages include an id outside ``[0, P)`` runs the
  gathered call below instead (a branch on the device), which masks them.
- "triton": our split-KV kernel (cudnn_jax/triton/sdpa_paged.py) for any number of query
  rows per sequence (decode, speculative decoding, chunked prefill; a program takes up to
  128 rows of one kv head): each kv head's pages read in place once for its query group, long caches
  split across programs, an FP8 cache converted in registers; every option of the op.
- "xla": each sequence's pages gathered into contiguous keys and values (positions of
  invalid ids masked), run as one ``sdpa`` call with the sequences' lengths and
  bottom-right causal alignment. The gather reads every page once more than a kernel
  reading pages in place would.
A float8_e4m3fn cache is dequantized (``value * scale``, in the query's dtype) as its
pages are gathered, on the gathering engines.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from cudnn_jax import _checks, _metadata, engines
from cudnn_jax.primitives import core
from cudnn_jax.ops import sdpa as sdpa_ops


@dataclasses.dataclass(frozen=True)
class PagedCall:
  """A paged call: the ``sdpa`` call on the gathered cache it equals, and the caches'
  page count and page size."""
  gathered: sdpa_ops.SdpaCall
  pages: int
  page: int
  fp8: bool = False  # a float8_e4m3fn key or value cache


class PagedInputs(NamedTuple):
  query: jax.Array  # [B, T, N, H]
  key_cache: jax.Array  # [P, page, K, H]
  value_cache: jax.Array  # [P, page, K, Hv]
  page_table: jax.Array  # [B, max_pages] int32
  kv_lengths: jax.Array  # [B] int32, clamped to the capacity
  q_lengths: jax.Array | None = None
  sinks: jax.Array | None = None
  k_scale: jax.Array | None = None  # () float32, with a float8_e4m3fn key cache
  v_scale: jax.Array | None = None


def gather_pages(cache, page_table, lengths, scale=None, dtype=None):
  """``cache [P,page,K,D]``, ``page_table [B,max_pages]`` -> ``[B, max_pages*page, K, D]``,
  rows at or past ``lengths [B]`` and rows of page ids outside ``[0, P)`` zeroed (a cache's
  unused rows may hold anything; an invalid id reads no page). With ``scale`` (an FP8
  cache) the rows are dequantized into ``dtype``: ``row * scale``."""
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
  if scale is not None:
    rows = (rows.astype(jnp.float32) * scale).astype(dtype)
  keep = key_positions(page_table, lengths, pages, page)
  return jnp.where(keep[:, :, None, None], rows, jnp.zeros((), rows.dtype))


def key_positions(page_table, lengths, pages, page):
  """``[B, max_pages*page]`` bool: the cache positions that hold keys, those before
  ``lengths [B]`` on a page id in ``[0, pages)``."""
  valid_page = jnp.repeat(_metadata.in_range(page_table, pages), page, axis=1)
  return valid_page & (jnp.arange(valid_page.shape[1])[None, :] < lengths[:, None])


def _check_caches(query, key_cache, value_cache, k_scale, v_scale):
  """Shapes and dtypes, named as the user passed them (before the pages are gathered);
  the scales of FP8 caches as ``()`` float32 arrays (None for the others)."""
  _checks.shape_of("query", query, 4)
  kc = _checks.shape_of("key_cache", key_cache, 4)
  vc = _checks.shape_of("value_cache", value_cache, 4)
  _checks.float_dtype("query", query)
  scales, unscaled = [], {"query": query}
  for name, cache, scale_name, scale in (("key_cache", key_cache, "k_scale", k_scale),
                                         ("value_cache", value_cache, "v_scale", v_scale)):
    fp8 = jnp.dtype(cache.dtype) == jnp.float8_e4m3fn
    if fp8 and scale is None:
      raise ValueError(f"{scale_name}: required with a float8_e4m3fn {name} (real value = "
                       "stored value * scale)")
    if not fp8 and scale is not None:
      raise ValueError(f"{scale_name}: only for a float8_e4m3fn {name}, got "
                       f"{jnp.dtype(cache.dtype).name}")
    if not fp8:
      _checks.float_dtype(name, cache)
      unscaled[name] = cache
    scales.append(_checks.scale_scalar(scale_name, scale) if fp8 else None)
  _checks.same_dtype(", ".join(unscaled), *unscaled.values())
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
  return scales


def _prepare(query, key_cache, value_cache, page_table, key_value_seq_lengths, *,
             query_seq_lengths=None, scale=None, is_causal=True, local_window_size=None,
             logits_soft_cap=None, sinks=None, return_lse=False, implementation=None,
             k_scale=None, v_scale=None):
  """Validates the user's arguments into (PagedCall, PagedInputs)."""
  del implementation
  k_scale, v_scale = _check_caches(query, key_cache, value_cache, k_scale, v_scale)
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
  query, key_cache, value_cache, page_table, key_value_seq_lengths, sinks = _checks.arrays(
      query, key_cache, value_cache, page_table, key_value_seq_lengths, sinks)
  capacity = _capacity(page_table, page)
  # The call on the gathered (and dequantized) caches, in the query's dtype.
  gathered = lambda cache: jax.ShapeDtypeStruct((b, capacity) + cache.shape[2:], query.dtype)
  lengths = lambda x: None if x is None else jax.ShapeDtypeStruct((b,), jnp.int32)
  call = engines.prepare_abstract(
      lambda *a, **kw: sdpa_ops.prepare(*a, **kw)[0], query, gathered(key_cache),
      gathered(value_cache), mask=jax.ShapeDtypeStruct((b, 1, 1, capacity), jnp.bool_),
      scale=scale, is_causal=is_causal, causal_alignment="bottom_right",
      local_window_size=local_window_size, logits_soft_cap=logits_soft_cap, sinks=sinks,
      return_lse=return_lse, query_seq_lengths=lengths(query_seq_lengths),
      key_value_seq_lengths=lengths(key_value_seq_lengths))
  q_lengths = (None if query_seq_lengths is None
               else _metadata.clamp_lengths(query_seq_lengths, query.shape[1]))
  inputs = PagedInputs(query, key_cache, value_cache, page_table.astype(jnp.int32),
                       _metadata.clamp_lengths(key_value_seq_lengths, capacity), q_lengths,
                       sinks, k_scale, v_scale)
  fp8 = k_scale is not None or v_scale is not None
  return PagedCall(call, pages, page, fp8), inputs


def _capacity(page_table, page):
  return page_table.shape[1] * page


def _check(query, key_cache, page_table, key_value_seq_lengths, query_seq_lengths, scales):
  """The metadata checks, under ``checkify`` only: lengths within capacity, the page ids
  of the pages that hold keys in ``[0, P)``, finite FP8 cache scales."""
  pages, page = key_cache.shape[:2]
  capacity = _capacity(page_table, page)
  _metadata.check_lengths("key_value_seq_lengths", key_value_seq_lengths, capacity)
  if query_seq_lengths is not None:
    _metadata.check_lengths("query_seq_lengths", query_seq_lengths, query.shape[1])
  lengths = _metadata.clamp_lengths(key_value_seq_lengths, capacity)
  used = jnp.arange(page_table.shape[1])[None, :] * page < lengths[:, None]
  _metadata.check_indices("page_table", page_table, pages, used)
  for name, scale in scales:
    if scale is not None:
      scale = jnp.reshape(scale, (1,))
      _metadata.check_entries(name, scale, ~jnp.isfinite(scale), "expected a finite scale")


def sdpa_paged(query, key_cache, value_cache, page_table, key_value_seq_lengths, *,
               query_seq_lengths=None, scale=None, is_causal=True, local_window_size=None,
               logits_soft_cap=None, sinks=None, return_lse=False, implementation=None,
               k_scale=None, v_scale=None):
  """Attention of new query tokens over a paged KV cache (decode, chunked prefill).

  ``query [B,T,N,H]`` (T=1 for decode), ``key_cache [P,page,K,H]``,
  ``value_cache [P,page,K,Hv]``, ``page_table [B,max_pages]`` int32 (logical page j of
  sequence b is physical page ``page_table[b, j]``), ``key_value_seq_lengths [B]`` int32
  (the sequence's cached tokens, the new ones included), ``query_seq_lengths [B]``
  optional. Causal is
  bottom-right aligned: query row t of sequence b sees keys ``u <= t + S_b - T_b``.
  Otherwise ``sdpa``'s math; returns ``out [B,T,N,Hv]`` and, with ``return_lse=True``,
  ``lse [B,N,T]`` float32.

  FP8 cache: ``key_cache`` and/or ``value_cache`` may be ``float8_e4m3fn`` with a float32
  scalar ``k_scale`` / ``v_scale`` (real value = stored value * scale; required with an
  FP8 cache, rejected with any other). The query stays bf16, f16 or f32 and the output
  takes its dtype; the result is attention over the dequantized cache (rounded to the
  query's dtype). The scale is applied as given: 0 makes every key 0 (each row's weights
  uniform over its keys) or every value 0 (an output of 0), a negative scale negates, and
  an inf or NaN scale makes every row that reads that cache NaN (rows with no keys still
  output 0). Under checkify a non-finite scale is an error naming ``k_scale``/``v_scale``.

  Invalid metadata (SPEC section 8): lengths are clamped to ``[0, max_pages * page]`` (and
  ``[0, T]``); a page id outside ``[0, P)`` contributes no keys (its positions are masked,
  never clipped to a valid page, so no sequence reads another's pages). Under
  ``jax.experimental.checkify.checkify`` (user checks) each such entry raises an error
  naming the argument and the entry (page ids only of pages below the length).

  ``implementation`` as for ``sdpa``: "cudnn" reads the pages in place for decode,
  "triton" (opt-in) reads them in place split across programs for any number of query
  rows (decode, speculative decoding, chunked prefill), an FP8 cache converted in
  registers; "xla" gathers them
  (``cudnn_jax.explain("sdpa_paged", ...)`` names the engine and path that would serve a
  call). Decode is not differentiable on the "triton" engine.
  """
  call, inputs = _prepare(query, key_cache, value_cache, page_table, key_value_seq_lengths,
                          query_seq_lengths=query_seq_lengths, scale=scale,
                          is_causal=is_causal, local_window_size=local_window_size,
                          logits_soft_cap=logits_soft_cap, sinks=sinks, return_lse=return_lse,
                          k_scale=k_scale, v_scale=v_scale)
  _check(query, key_cache, page_table, key_value_seq_lengths, query_seq_lengths,
         (("k_scale", inputs.k_scale), ("v_scale", inputs.v_scale)))
  out, lse = engines.dispatch("sdpa_paged", implementation, call, inputs)
  return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------
# Engines.


def _on_sdpa_engine(name):
  """``run`` of the gathered call on ``sdpa``'s engine ``name``."""
  def run(call: PagedCall, x: PagedInputs):
    keep = key_positions(x.page_table, x.kv_lengths, call.pages, call.page)
    gather = lambda cache, scale: gather_pages(cache, x.page_table, x.kv_lengths, scale,
                                               x.query.dtype)
    inputs = sdpa_ops.SdpaInputs(
        x.query, gather(x.key_cache, x.k_scale), gather(x.value_cache, x.v_scale),
        mask=keep[:, None, None, :],
        query_seq_lengths=x.q_lengths, key_value_seq_lengths=x.kv_lengths, sinks=x.sinks)
    return engines.engine("sdpa", name).run(call.gathered, inputs)
  return run


def _in_place_call(call: PagedCall) -> tuple[sdpa_ops.SdpaCall, int | None]:
  """The call cuDNN serves reading pages in place: no mask (lengths bound the keys). One
  query row (decode) sees every key up to its length, causal or not; with sinks it goes
  in twice (``sdpa_ops.single_row_view``: the second element, the answering row)."""
  native = dataclasses.replace(call.gathered, mask_shape=None)
  if native.t == 1 and native.window is None:
    native = dataclasses.replace(native, is_causal=False, bottom_right=False)
  return sdpa_ops.single_row_view(native)


def _in_place_config(call: PagedCall):
  return sdpa_ops.cudnn_config(_in_place_call(call)[0], paged=True)


@functools.lru_cache(maxsize=1024)
def _paged_reason(call: PagedCall) -> str | None:
  """None when cuDNN serves the call reading pages in place, else why not."""
  if call.fp8:
    return ("float8_e4m3fn cache: cuDNN's paged graph reads caches in the query's dtype "
            "(the pages are gathered and dequantized)")
  if call.gathered.t > 1:
    # Seen on an H100 (cuDNN 9.19): 16 query rows over pages whose unused rows held NaN gave
    # NaN rows, where one row does not; the contract lets those rows hold anything.
    return ("T > 1 (chunked prefill): cuDNN's paged graph let NaN in a cache's unused rows "
            "into the output; the pages are gathered instead")
  native, _ = _in_place_call(call)
  return (sdpa_ops.cudnn_static_reason(native)
          or sdpa_ops.cudnn_check(native, _in_place_config(call), False, call.pages, call.page))


def _run_in_place(call: PagedCall, x: PagedInputs):
  from cudnn_jax.primitives import sdpa as prim  # pylint: disable=g-import-not-at-top
  native, row = _in_place_call(call)
  query, q_lengths = x.query, x.q_lengths
  if row is not None:
    query, q_lengths = sdpa_ops.repeat_query(row, query, q_lengths)
  if q_lengths is None:
    q_lengths = jnp.full(x.kv_lengths.shape, native.t, jnp.int32)
  table = jnp.clip(x.page_table, 0, call.pages - 1)  # ids past the lengths are never read
  out, *lse = prim.sdpa_fwd(_in_place_config(call), query, x.key_cache, x.value_cache, None,
                            q_lengths, x.kv_lengths, page_table=table, sinks=x.sinks)
  lengths = sdpa_ops.SdpaInputs(None, None, None, query_seq_lengths=q_lengths,
                                key_value_seq_lengths=x.kv_lengths)
  valid = sdpa_ops._row_valid(native, lengths)  # pylint: disable=protected-access
  out, lse = sdpa_ops.select_rows(valid, out, lse[0] if lse else None, x.sinks, q_lengths)
  return (out, lse) if row is None else sdpa_ops.answer_row(row, out, lse)


def _run_cudnn(call: PagedCall, x: PagedInputs):
  gathered = _on_sdpa_engine("cudnn" if _gathered_reason(call) is None else "xla")
  if _paged_reason(call) is not None:
    return gathered(call, x)
  used = jnp.arange(x.page_table.shape[1])[None, :] * call.page < x.kv_lengths[:, None]
  trusted = jnp.all(_metadata.in_range(x.page_table, call.pages) | ~used)
  return jax.lax.cond(trusted, functools.partial(_run_in_place, call),
                      functools.partial(gathered, call), x)


def _gathered_reason(call: PagedCall) -> str | None:
  return engines.engine("sdpa", "cudnn").supports(call.gathered)


def _supports_cudnn(call: PagedCall) -> str | None:
  in_place = _paged_reason(call)
  if in_place is None:
    return None
  gathered = _gathered_reason(call)
  return None if gathered is None else f"pages in place: {in_place}; gathered: {gathered}"


def _describe_cudnn(call: PagedCall) -> str:
  if _paged_reason(call) is None:
    return ("cuDNN attention reading the pages in place (the gathered call where a used "
            "page id is out of range)")
  return "the pages gathered, on sdpa's cudnn engine"


# "triton": opt-in until its GPU tests (tests/gpu/test_sdpa_varlen_paged_gpu.py) have passed
# on hardware; on CPU its kernel runs in the Pallas interpreter (tests/test_sdpa_paged_triton.py).


def _supports_triton(call: PagedCall, interpret=False) -> str | None:
  if not interpret and (backend := jax.default_backend()) != "gpu":
    return f"default backend is {backend!r}, not 'gpu'"
  from cudnn_jax.triton import sdpa_paged as kernel  # pylint: disable=g-import-not-at-top
  c = call.gathered
  return kernel.supports(c.h, c.hv, c.dtype)


def _on_shard_triton(config, query, key_cache, value_cache, page_table, kv_lengths,
                     q_lengths, sinks, scales):
  """What one device computes: its sequences and heads (on one device, the whole call)."""
  from cudnn_jax.triton import sdpa_paged as kernel  # pylint: disable=g-import-not-at-top
  call, interpret = config
  c = call.gathered
  return kernel.sdpa_paged(
      query, key_cache, value_cache, page_table, kv_lengths, q_lengths,
      sinks if c.has_sinks else None, scales[0], scales[1], scale=c.scale,
      causal=c.is_causal, window=c.window, soft_cap=c.logits_soft_cap,
      cores=getattr(jax.devices()[0], "core_count", 132), interpret=interpret)


# Sequences and heads stay local: on a mesh each device reads only its own pages and heads.
_triton_per_shard = core.per_shard(
    "sdpa_paged_triton", _on_shard_triton,
    "b t n h, p g k h, p g k d, b m, b, b, n, s -> b t n d, b n t", shardable=("b", ("n", "k")))


def _run_triton(call: PagedCall, x: PagedInputs, interpret=False):
  b, t, n = x.query.shape[:3]
  q_lengths = jnp.full((b,), t, jnp.int32) if x.q_lengths is None else x.q_lengths
  sinks = jnp.zeros((n,), jnp.float32) if x.sinks is None else x.sinks.astype(jnp.float32)
  one = jnp.ones((), jnp.float32)
  scales = jnp.stack([one if s is None else s for s in (x.k_scale, x.v_scale)])
  out, lse = _triton_per_shard((call, interpret), x.query, x.key_cache, x.value_cache,
                               x.page_table, x.kv_lengths, q_lengths, sinks, scales)
  return out, (lse if call.gathered.return_lse else None)


engines.register_op("sdpa_paged", lambda *a, **kw: _prepare(*a, **kw)[0])
engines.register_engine("sdpa_paged", "xla", supports=lambda call: None,
                        run=_on_sdpa_engine("xla"))
engines.register_engine("sdpa_paged", "cudnn", supports=_supports_cudnn, run=_run_cudnn,
                        describe=_describe_cudnn)
engines.register_engine(
    "sdpa_paged", "triton", supports=_supports_triton, run=_run_triton, opt_in=True,
    describe=lambda call: "our split-KV Pallas kernel reading the pages in place")
