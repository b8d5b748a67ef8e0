"""Scaled dot-product attention: ``cudnn_jax.sdpa``.

A drop-in for ``jax.nn.dot_product_attention`` (same leading arguments, same results) with
more masks, soft-capping, sinks, packed sequences, dropout and the log-sum-exp.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cudnn_jax import _checks, _metadata, engines
from cudnn_jax.ops import sdpa_context_parallel
from cudnn_jax.engines import UnsupportedError


class SdpaInputs(NamedTuple):
  """The array arguments, 4-D and validated; absent ones are None."""
  query: jax.Array
  key: jax.Array
  value: jax.Array
  bias: jax.Array | None = None  # rank 4, broadcastable to [B,N,T,S]
  mask: jax.Array | None = None  # rank 4 bool, broadcastable to [B,N,T,S]
  query_seq_lengths: jax.Array | None = None
  key_value_seq_lengths: jax.Array | None = None
  q_segment_ids: jax.Array | None = None
  kv_segment_ids: jax.Array | None = None
  sinks: jax.Array | None = None
  dropout_rng: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class SdpaCall:
  """Everything static about one call: what engines decide on."""
  b: int
  t: int
  s: int
  n: int
  k: int
  h: int
  hv: int
  dtype: str
  scale: float
  is_causal: bool = False
  bottom_right: bool = False
  window: tuple | None = None  # (left, right), None = unbounded side
  bias_shape: tuple | None = None
  mask_shape: tuple | None = None
  has_q_lengths: bool = False
  has_kv_lengths: bool = False
  has_segments: bool = False
  logits_soft_cap: float | None = None
  has_sinks: bool = False
  dropout_rate: float = 0.0
  return_lse: bool = False
  unbatched: bool = False
  context_parallel: tuple | None = None  # (mesh axis, strategy, devices along it)


def _window(local_window_size):
  if local_window_size is None:
    return None
  if isinstance(local_window_size, (int,)) and not isinstance(local_window_size, bool):
    w = _checks.static_int("local_window_size", local_window_size, minimum=0)
    return (w, w)
  try:
    left, right = local_window_size
  except (TypeError, ValueError):
    raise TypeError("local_window_size: expected None, an int or a (left, right) pair, "
                    f"got {local_window_size!r}") from None
  return tuple(None if x is None else _checks.static_int("local_window_size", x, minimum=0)
               for x in (left, right))


def checked_qkv(query, key, value, dtypes):
  """``(query [B,T,N,H], key [B,S,K,H], value [B,S,K,Hv], unbatched)``: the arrays of one
  dtype among ``dtypes``, rank 4 (an unbatched rank-3 call gets B = 1), shapes consistent."""
  qs = _checks.shape_of("query", query, (3, 4))
  unbatched = len(qs) == 3
  ks = _checks.shape_of("key", key, len(qs))
  vs = _checks.shape_of("value", value, len(qs))
  for name, x in (("query", query), ("key", key), ("value", value)):
    _checks.float_dtype(name, x, dtypes)
  if not (query.dtype == key.dtype == value.dtype):
    raise TypeError("query, key, value: expected one dtype, got "
                    f"{query.dtype}, {key.dtype}, {value.dtype}")
  if unbatched:
    query, key, value = query[None], key[None], value[None]
  b, _, n, h = query.shape
  _, s, k, _ = value.shape
  if key.shape[0] != b or value.shape[0] != b:
    raise ValueError(f"key, value: batch must be {b} (query's), got shapes {ks} and {vs}")
  if key.shape[1:3] != (s, k):
    raise ValueError(f"key: expected [B,S,K,H] matching value's S={s}, K={k}, got {ks}")
  if key.shape[3] != h:
    raise ValueError(f"key: head dim must equal query's H={h}, got shape {ks}")
  if k < 1 or n % k:
    raise ValueError(f"query/key: query heads N={n} must be a multiple of kv heads K={k} "
                     "(K >= 1)")
  if h < 1:
    raise ValueError(f"query: head dim H must be >= 1 (the logits' scale is 1/sqrt(H)), got "
                     f"shape {qs}")
  return query, key, value, unbatched


def checked_lengths(name, x, b, size, unbatched):
  """Valid lengths ``[B]`` int32 clamped to ``[0, size]`` (SPEC section 8), or None."""
  if x is None:
    return None
  _checks.shape_of(name, x, 1 if not unbatched else (0, 1))
  _checks.int_dtype(name, x)
  x = x.reshape(-1)
  _checks.expect_shape(name, x, (b,))
  return _metadata.clamp_lengths(x, size)


def checked_scales(scale, h, causal_alignment, logits_soft_cap):
  """``(scale, logits_soft_cap)`` as floats (scale 1/sqrt(H) by default, the cap None when
  absent); causal_alignment one of its two names."""
  scale = 1.0 / math.sqrt(h) if scale is None else _checks.real_scalar("scale", scale)
  _checks.one_of("causal_alignment", causal_alignment, ("top_left", "bottom_right"))
  if logits_soft_cap is not None:
    if not isinstance(logits_soft_cap, (int, float)) or not logits_soft_cap > 0:
      raise ValueError(f"logits_soft_cap: expected a positive float, got {logits_soft_cap!r}")
    logits_soft_cap = float(logits_soft_cap)
  return float(scale), logits_soft_cap


def prepare(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
            query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
            implementation=None, return_residual=False, causal_alignment="top_left",
            logits_soft_cap=None, sinks=None, q_segment_ids=None, kv_segment_ids=None,
            dropout_rate=0.0, dropout_rng=None, return_lse=False, context_parallel_axis=None,
            context_parallel_strategy="all_gather"):
  """Validates the user's arguments into (SdpaCall, SdpaInputs).

  ``return_lse`` of the call is set when either statistic is asked for: jax.nn's residual
  is the lse, transposed and cast."""
  del implementation
  query, key, value, unbatched = checked_qkv(query, key, value, _checks.XLA_FLOAT_DTYPES)
  b, t, n, h = query.shape
  _, s, k, hv = value.shape

  full = (b, n, t, s)
  view = full[1:] if unbatched else full

  def as4d(name, x):
    if unbatched and x.ndim == 4:  # as in jax.nn, a rank-4 [1,N,T,S]-broadcastable form
      _checks.broadcastable(name, x, full)
      return x
    _checks.broadcastable(name, x, view)
    x = x.reshape((1,) * (len(view) - x.ndim) + tuple(x.shape))
    return x[None] if unbatched else x

  if bias is not None:
    _checks.shape_of("bias", bias)
    _checks.float_dtype("bias", bias, _checks.XLA_FLOAT_DTYPES)
    bias = as4d("bias", bias)
  if mask is not None:
    _checks.shape_of("mask", mask)
    _checks.bool_dtype("mask", mask)
    mask = as4d("mask", mask)

  query_seq_lengths = checked_lengths("query_seq_lengths", query_seq_lengths, b, t, unbatched)
  key_value_seq_lengths = checked_lengths("key_value_seq_lengths", key_value_seq_lengths, b, s,
                                          unbatched)

  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("q_segment_ids, kv_segment_ids: give both or neither")
  if q_segment_ids is not None:
    for name, x, length in (("q_segment_ids", q_segment_ids, t),
                            ("kv_segment_ids", kv_segment_ids, s)):
      _checks.int_dtype(name, x)
      _checks.expect_shape(name, x, (length,) if unbatched else (b, length))
    q_segment_ids = q_segment_ids.reshape(b, t).astype(jnp.int32)
    kv_segment_ids = kv_segment_ids.reshape(b, s).astype(jnp.int32)

  if sinks is not None:
    _checks.shape_of("sinks", sinks)
    _checks.float_dtype("sinks", sinks, (jnp.float32,))
    _checks.expect_shape("sinks", sinks, (n,))

  scale, logits_soft_cap = checked_scales(scale, h, causal_alignment, logits_soft_cap)
  if not isinstance(dropout_rate, (int, float)) or not 0.0 <= dropout_rate < 1.0:
    raise ValueError(f"dropout_rate: expected a float in [0, 1), got {dropout_rate!r}")
  if dropout_rate > 0 and dropout_rng is None:
    raise ValueError("dropout_rng: required when dropout_rate > 0")
  if dropout_rate > 0:
    _checks.prng_key("dropout_rng", dropout_rng)
  _checks.one_of("context_parallel_strategy", context_parallel_strategy, ("all_gather", "ring"))
  if context_parallel_axis is not None:
    unserved = [name for name, x in (
        ("bias", bias), ("mask", mask), ("query_seq_lengths", query_seq_lengths),
        ("key_value_seq_lengths", key_value_seq_lengths), ("q_segment_ids", q_segment_ids),
        ("dropout_rate", dropout_rate or None)) if x is not None]
    if unserved or causal_alignment != "top_left":
      raise UnsupportedError("context_parallel_axis: not together with "
                             + ", ".join(unserved or ["causal_alignment='bottom_right'"]))

  call = SdpaCall(
      b=b, t=t, s=s, n=n, k=k, h=h, hv=hv, dtype=jnp.dtype(query.dtype).name,
      scale=scale, is_causal=_checks.flag("is_causal", is_causal),
      bottom_right=causal_alignment == "bottom_right", window=_window(local_window_size),
      bias_shape=None if bias is None else tuple(bias.shape),
      mask_shape=None if mask is None else tuple(mask.shape),
      has_q_lengths=query_seq_lengths is not None,
      has_kv_lengths=key_value_seq_lengths is not None,
      has_segments=q_segment_ids is not None, logits_soft_cap=logits_soft_cap,
      has_sinks=sinks is not None, dropout_rate=float(dropout_rate),
      return_lse=(_checks.flag("return_lse", return_lse)
                  | _checks.flag("return_residual", return_residual)),
      unbatched=unbatched,
      context_parallel=None if context_parallel_axis is None else (
          context_parallel_axis, context_parallel_strategy,
          sdpa_context_parallel.mesh_size(context_parallel_axis, query)))
  inputs = SdpaInputs(*_checks.arrays(query, key, value, bias, mask, query_seq_lengths,
                                      key_value_seq_lengths, q_segment_ids, kv_segment_ids,
                                      sinks),
                      dropout_rng if dropout_rate > 0 else None)
  return call, inputs


def sdpa(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
         query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
         implementation=None, return_residual=False, causal_alignment="top_left",
         logits_soft_cap=None, sinks=None, q_segment_ids=None, kv_segment_ids=None,
         dropout_rate=0.0, dropout_rng=None, return_lse=False, context_parallel_axis=None,
         context_parallel_strategy="all_gather"):
  """Scaled dot-product attention.

  ``query [B,T,N,H]``, ``key [B,S,K,H]``, ``value [B,S,K,Hv]`` (or unbatched ``[T,N,H]``
  ...), ``N % K == 0``: query head n reads kv head ``n // (N // K)``. Logits
  ``scale * q.k`` (scale defaults to ``1/sqrt(H)``), plus ``bias`` (broadcast to
  ``[B,N,T,S]``), then soft-capped ``c * tanh(s / c)``; ``scale`` is any real scalar
  (Python, NumPy, or a concrete JAX one). Masks combine with AND and exclude
  logits: ``mask`` (True keeps), ``is_causal`` (``u <= t``, or ``u <= t + S_b - T_b`` with
  ``causal_alignment="bottom_right"``), ``local_window_size`` ``(left, right)`` or ``w``
  (keep ``t - left <= u <= t + right``, shifted alike), valid lengths ``query_seq_lengths``
  / ``key_value_seq_lengths`` ``[B]``, and packed-sequence ``q_segment_ids [B,T]`` /
  ``kv_segment_ids [B,S]`` (keep equal ids). ``sinks [N]`` joins each row's softmax
  denominator. A row with no kept key, or past its valid length, outputs 0 (lse -inf, or
  the sink logit); jax.nn's xla path gives such a row the mean of the values instead (the
  one difference from it). Masked logits are excluded by selection, never filled with
  -inf, so ``jax.debug_infs(True)`` stays quiet. ``dropout_rate`` drops probabilities
  (inverted), keyed by ``dropout_rng``.

  dtypes: bfloat16, float16, float32; float64 too (as jax.nn under x64) on the xla engine,
  computed in float32 as jax.nn does (the GPU engines decline it).

  Returns ``out [B,T,N,Hv]`` in the input dtype; with ``return_residual=True``
  ``(out, residual)``, jax.nn's residual: the lse ``[B,T,N]`` in the input dtype, without
  gradient; with ``return_lse=True`` ``(out, lse)``, ``lse [B,N,T]`` float32 (natural log
  of the softmax denominator, differentiable); with both ``(out, residual, lse)``.

  ``context_parallel_axis``: the name of a mesh axis (of ``jax.set_mesh``'s mesh, or the
  inputs' explicit sharding) along which query, key and value are sharded by sequence;
  ``context_parallel_strategy`` "all_gather" (each device gathers key and value) or "ring"
  (key/value shards pass around the devices, partial results merged by log-sum-exp).
  Self-attention only (one sequence length), causal (top-left) or not, a left window when
  causal, soft cap and sinks; not with bias, mask, lengths, segment ids or dropout. Works
  under jit and called eagerly; out (and lse) come back sharded along the axis by
  sequence, keeping the query's batch and head sharding. ``explain`` describes the
  strategy and judges the engines on each device's call.

  ``implementation``: None (fastest engine that serves the call, falling back to "xla"),
  "cudnn", "xla", or a sequence tried in order; a named engine that cannot serve the call
  raises ``cudnn_jax.UnsupportedError`` with the reason. ``cudnn_jax.explain("sdpa", ...)``
  tells which engine would run.
  """
  call, inputs = prepare(
      query, key, value, bias, mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, return_residual=return_residual,
      causal_alignment=causal_alignment,
      logits_soft_cap=logits_soft_cap, sinks=sinks, q_segment_ids=q_segment_ids,
      kv_segment_ids=kv_segment_ids, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
      return_lse=return_lse, context_parallel_axis=context_parallel_axis,
      context_parallel_strategy=context_parallel_strategy)
  for name, x, size in (("query_seq_lengths", query_seq_lengths, call.t),
                        ("key_value_seq_lengths", key_value_seq_lengths, call.s)):
    if x is not None:
      _metadata.check_lengths(name, x, size)
  if context_parallel_axis is not None:
    result = sdpa_context_parallel.sdpa_context_parallel(
        sdpa, query, key, value, axis=context_parallel_axis,
        strategy=context_parallel_strategy, is_causal=call.is_causal, window=call.window,
        sinks=sinks, return_lse=call.return_lse, scale=call.scale,
        logits_soft_cap=call.logits_soft_cap, implementation=implementation)
    out, lse = result if call.return_lse else (result, None)
  else:
    out, lse = engines.dispatch("sdpa", implementation, call, inputs)
    if call.unbatched:
      out = out[0]
      lse = None if lse is None else lse[0]
  results = (out,)
  if return_residual:  # jax.nn's: [..., T, N] in the input dtype, no gradient
    results += (jax.lax.stop_gradient(jnp.swapaxes(lse, -1, -2).astype(out.dtype)),)
  if return_lse:
    results += (lse,)
  return results if len(results) > 1 else out


# Above this many logits a call of the xla engine runs block by block (cudnn_jax/xla/sdpa.py:
# memory linear in the sequence lengths) instead of forming them all (reference/sdpa.py).
BLOCKWISE_ABOVE = 1 << 24


@functools.partial(jax.jit, static_argnums=0)
def _run_xla(call: SdpaCall, x: SdpaInputs):
  """One jitted program per call (also when called eagerly), returning the lse only when
  asked for: rows with no kept key have lse -inf, which then never reaches the caller
  (nor ``jax.debug_infs``) unless requested."""
  from cudnn_jax.reference import sdpa as ref  # pylint: disable=g-import-not-at-top
  from cudnn_jax.xla import sdpa as blockwise  # pylint: disable=g-import-not-at-top
  whole = call.b * call.n * call.t * call.s <= BLOCKWISE_ABOVE
  out, lse = (ref.sdpa if whole else blockwise.sdpa)(
      x.query, x.key, x.value, x.bias, x.mask, scale=call.scale, is_causal=call.is_causal,
      bottom_right=call.bottom_right, window=call.window,
      query_seq_lengths=x.query_seq_lengths, key_value_seq_lengths=x.key_value_seq_lengths,
      q_segment_ids=x.q_segment_ids, kv_segment_ids=x.kv_segment_ids,
      logits_soft_cap=call.logits_soft_cap, sinks=x.sinks, dropout_rate=call.dropout_rate,
      dropout_rng=x.dropout_rng)
  return out, (lse if call.return_lse else None)


def _explained(call: SdpaCall):
  """What ``explain`` judges: the call itself, or each device's under context parallelism."""
  if call.context_parallel is None:
    return None, call
  return sdpa_context_parallel.device_call(call)


engines.register_op("sdpa", lambda *a, **kw: prepare(*a, **kw)[0], explained=_explained)
engines.register_engine("sdpa", "xla", supports=lambda call: None, run=_run_xla)


# ---------------------------------------------------------------------------------------
# The cudnn engine.


def cudnn_config(call: SdpaCall, *, has_bias: bool = False, **layout):
  """The handlers' config of ``call``; ``layout``: packed_max_q/kv or paged."""
  from cudnn_jax.primitives import sdpa as prim  # pylint: disable=g-import-not-at-top
  left, right = call.window if call.window is not None else (None, None)
  return prim.SdpaConfig(
      scale=call.scale, causal=call.is_causal, bottom_right=call.bottom_right,
      window_left=-1 if left is None else left, window_right=-1 if right is None else right,
      softcap=call.logits_soft_cap or 0.0, has_bias=has_bias,
      has_padding=call.has_q_lengths or call.has_kv_lengths,
      has_dbias=call.bias_shape is not None, with_lse=call.return_lse,
      has_sinks=call.has_sinks, dropout=call.dropout_rate, **layout)


def cudnn_check(call: SdpaCall, config, backward: bool, pages=0, page=0) -> str | None:
  """None when cuDNN serves ``config`` (forward, or backward: the sinks' gradient needs no
  cuDNN) at ``call``'s shapes, else why not."""
  from cudnn_jax import _extension  # pylint: disable=g-import-not-at-top
  if backward:
    config = dataclasses.replace(config, has_sinks=False, paged=False)
  query = config.check_config(backward=backward, dtype=call.dtype, b=call.b, t=call.t,
                              s=call.s, n=call.n, k=call.k, h=call.h, hv=call.hv,
                              bias_shape=_cudnn_bias_shape(call), pages=pages, page=page)
  return _extension.module().sdpa_check(query) or None


def _cudnn_bias_shape(call: SdpaCall):
  """The [Bb,Nb,T,S] bias cuDNN sees: the user's bias and mask merged, T and S whole."""
  shapes = [x for x in (call.bias_shape, call.mask_shape) if x is not None]
  if not shapes:
    return None
  bb = max(x[0] for x in shapes)
  nb = max(x[1] for x in shapes)
  return (bb, nb, call.t, call.s)


@functools.lru_cache(maxsize=1024)
def _cudnn_check(call: SdpaCall, backward: bool) -> str | None:
  config = cudnn_config(call, has_bias=_cudnn_bias_shape(call) is not None)
  return cudnn_check(call, config, backward)


def cudnn_static_reason(call: SdpaCall) -> str | None:
  """Why the cudnn engine cannot serve ``call`` whatever its layout, or None."""
  from cudnn_jax import _extension  # pylint: disable=g-import-not-at-top
  why = _extension.unavailable_reason()
  if why:
    return why
  if call.dtype not in ("bfloat16", "float16"):
    return f"dtype {call.dtype}: cuDNN SDPA runs bfloat16 and float16 only"
  return None


# Segment ids on cuDNN: each row's runs of equal ids become packed sequences (at most this
# many per row; a row with more, or with an id in two runs, runs on the xla engine).
SEGMENT_RUNS = 64


def _segments_view(call: SdpaCall) -> tuple[SdpaCall | None, str | None]:
  """(the padded call equal to ``call``'s runs as sequences, or None with the reason)."""
  if call.t != call.s:
    return None, "segment ids: served as packed sequences when queries and keys share rows"
  unserved = [name for name, x in (("bias", call.bias_shape), ("mask", call.mask_shape))
              if x is not None] + ["lengths"] * (call.has_q_lengths or call.has_kv_lengths)
  if unserved:
    return None, f"segment ids: not together with {', '.join(unserved)}"
  runs = min(call.t, SEGMENT_RUNS)
  # A run's query and key rows are the same rows: both causal alignments coincide.
  return dataclasses.replace(call, b=call.b * runs, has_segments=False, has_q_lengths=True,
                             has_kv_lengths=True, bottom_right=False), None


def _supports_cudnn(call: SdpaCall) -> str | None:
  if why := cudnn_static_reason(call):
    return why
  if call.has_segments:
    from cudnn_jax.ops import sdpa_varlen  # pylint: disable=g-import-not-at-top
    padded, why = _segments_view(call)
    return why or sdpa_varlen.packed_reason(padded)
  return _cudnn_check(single_row_view(_cudnn_view(call)[0])[0], backward=False)


def segment_runs(q_segment_ids, kv_segment_ids, runs):
  """``(starts, lengths, served)`` of each row's runs of equal ids as packed sequences of
  the rows ``[B*T]``: ``starts``, ``lengths`` ``[B*runs]`` (unused runs empty), ``served``
  whether every row has at most ``runs`` runs, none of whose ids repeats, and the key
  rows share the query rows' ids."""
  b, t = q_segment_ids.shape
  new = jnp.concatenate([jnp.ones((b, 1), bool),
                         q_segment_ids[:, 1:] != q_segment_ids[:, :-1]], axis=1)
  run = jnp.cumsum(new, axis=1) - 1  # [B, T]: the run of each row
  starts = jnp.full((b, runs + 1), t, jnp.int32).at[
      jnp.arange(b)[:, None], jnp.where(new, jnp.minimum(run, runs), runs)].min(
          jnp.arange(t, dtype=jnp.int32)[None, :])[:, :runs]
  lengths = jnp.diff(jnp.concatenate([starts, jnp.full((b, 1), t, jnp.int32)], axis=1))
  ids = jnp.take_along_axis(q_segment_ids, jnp.minimum(starts, t - 1), axis=1)
  used = starts < t
  repeated = (ids[:, :, None] == ids[:, None, :]) & used[:, :, None] & used[:, None, :]
  repeated &= ~jnp.eye(runs, dtype=bool)
  served = (jnp.all(run[:, -1] < runs) & ~jnp.any(repeated)
            & jnp.all(q_segment_ids == kv_segment_ids))
  flat = lambda x: x.reshape(-1)
  return flat(starts + t * jnp.arange(b, dtype=jnp.int32)[:, None]), flat(lengths), served


def _run_segments(call: SdpaCall, x: SdpaInputs):
  """Segments as packed sequences on cuDNN where every row's runs qualify (a branch on
  the device), else the xla engine."""
  from cudnn_jax.ops import sdpa_varlen  # pylint: disable=g-import-not-at-top
  from cudnn_jax.primitives import sdpa as prim  # pylint: disable=g-import-not-at-top
  padded, _ = _segments_view(call)
  b, t, n, _ = x.query.shape
  starts, lengths, served = segment_runs(x.q_segment_ids, x.kv_segment_ids, padded.b // b)
  seed = prim.seed_words(x.dropout_rng) if call.dropout_rate > 0 else (None, None)

  def packed(x):
    rows = lambda a: a.reshape((b * t,) + a.shape[2:])
    out, lse = sdpa_varlen.packed_attention(
        padded, rows(x.query), rows(x.key), rows(x.value), (starts, lengths),
        (starts, lengths), x.sinks, seed)
    out = out.reshape(x.query.shape[:3] + out.shape[-1:])
    return out, None if lse is None else jnp.swapaxes(lse.reshape(n, b, t), 0, 1)

  def whole(x):
    out, lse = _run_xla(call, x)
    return out, lse if call.return_lse else None

  return jax.lax.cond(served, packed, whole, x)


def _cudnn_view(call: SdpaCall):
  """(call cuDNN sees, leading query rows left out).

  Bottom-right causal attention with T > S leaves the first T - S query rows without keys;
  cuDNN refuses max_s_q > max_s_kv there, so those rows are cut off and written as 0.
  Without sequence lengths and with T = S (after the cut) the two alignments coincide, and
  the call goes to cuDNN as top-left, which it also serves together with a bias.
  """
  skip = call.t - call.s
  lengths = call.has_q_lengths or call.has_kv_lengths
  if call.is_causal and call.bottom_right and skip > 0 and not lengths:
    rows = lambda shape: None if shape is None else shape[:2] + (min(shape[2], call.s),) + shape[3:]
    call = dataclasses.replace(call, t=call.s, bias_shape=rows(call.bias_shape),
                               mask_shape=rows(call.mask_shape))
  else:
    skip = 0
  if call.bottom_right and call.t == call.s and not lengths:
    call = dataclasses.replace(call, bottom_right=False)
  return call, skip


def single_row_view(call: SdpaCall) -> tuple[SdpaCall, int | None]:
  """(the call cuDNN sees, the row of it that answers the query) for one query row with
  sinks, which cuDNN serves only with two or more rows: the query goes in twice, and the
  answer is the row whose keys are the single row's, the second under bottom-right
  alignment (query lengths one longer), else the first. Other calls: (call, None)."""
  if not (call.has_sinks and call.t == 1):
    return call, None
  if call.bottom_right and call.s == 1 and not (call.has_q_lengths or call.has_kv_lengths):
    call = dataclasses.replace(call, bottom_right=False)  # one key: the alignments coincide
  return dataclasses.replace(call, t=2), int(call.bottom_right)


def repeat_query(row, query, q_lengths):
  """single_row_view's inputs: ``query [B,1,N,H]`` twice along T, lengths + ``row``."""
  return (jnp.concatenate([query, query], axis=1),
          None if q_lengths is None else q_lengths + row)


def answer_row(row, out, lse):
  """The answering row of ``out [B,2,N,Hv]`` and ``lse [B,N,2]`` (None stays None)."""
  return out[:, row:row + 1], None if lse is None else lse[:, :, row:row + 1]


def _row_valid(call: SdpaCall, x: SdpaInputs):
  """[B,1,T] or [B,N,T] bool: rows that keep at least one key (None when all do).

  cuDNN leaves rows with no kept key ill-defined (a uniform softmax over masked logits);
  SPEC makes them 0 with lse -inf, so the engine selects them out afterwards.
  """
  from cudnn_jax.reference import sdpa as ref  # pylint: disable=g-import-not-at-top
  lengths = call.has_q_lengths or call.has_kv_lengths
  empty_possible = (lengths or call.window is not None or call.mask_shape is not None
                    or (call.is_causal and call.bottom_right and call.t > call.s))
  if not empty_possible:
    return None
  b, t, s = call.b, call.t, call.s
  q_len = x.query_seq_lengths if x.query_seq_lengths is not None else jnp.full((b,), t)
  kv_len = (x.key_value_seq_lengths if x.key_value_seq_lengths is not None
            else jnp.full((b,), s))
  if x.mask is not None:
    keep = ref.band_keep(jnp.arange(t), jnp.arange(s), q_len, kv_len,
                         is_causal=call.is_causal, bottom_right=call.bottom_right,
                         window=call.window) & x.mask
    return jnp.any(keep, axis=-1)
  # Closed form of the same: the kept key range of row t is [lo, hi].
  tt = jnp.arange(t)[None, :]
  tb, sb = q_len[:, None], kv_len[:, None]
  diag = tt + (sb - tb if call.bottom_right else 0)
  hi = sb - 1
  lo = jnp.zeros_like(diag)
  left, right = call.window if call.window is not None else (None, None)
  if call.is_causal:
    hi = jnp.minimum(hi, diag)
  if right is not None:
    hi = jnp.minimum(hi, diag + right)
  if left is not None:
    lo = jnp.maximum(lo, diag - left)
  return ((tt < tb) & (lo <= hi))[:, None, :]


def _run_cudnn(call: SdpaCall, x: SdpaInputs):
  if call.has_segments:
    return _run_segments(call, x)
  call, skip = _cudnn_view(call)
  if skip:
    cut = lambda a: a if a is None or a.shape[2] == 1 else a[:, :, skip:]
    x = x._replace(query=x.query[:, skip:], bias=cut(x.bias), mask=cut(x.mask))
  call, row = single_row_view(call)  # after the cut, which may leave one row
  if row is not None:
    query, q_lengths = repeat_query(row, x.query, x.query_seq_lengths)
    x = x._replace(query=query, query_seq_lengths=q_lengths)
  out, lse = _run_cudnn_rows(call, x)
  if row is not None:
    out, lse = answer_row(row, out, lse)
  if skip:
    out = jnp.pad(out, ((0, 0), (skip, 0), (0, 0), (0, 0)))
    if lse is not None:  # rows without keys: lse -inf, or the sink logit
      lse = jnp.pad(lse, ((0, 0), (0, 0), (skip, 0)), constant_values=-jnp.inf)
      if x.sinks is not None:
        cut_rows = jnp.arange(lse.shape[-1]) < skip
        lse = jnp.where(cut_rows, x.sinks[None, :, None].astype(lse.dtype), lse)
  return out, lse


def _run_cudnn_rows(call: SdpaCall, x: SdpaInputs):
  from cudnn_jax.primitives import sdpa as prim  # pylint: disable=g-import-not-at-top
  bias_shape = _cudnn_bias_shape(call)
  bias = None
  if bias_shape is not None:
    dtype = x.query.dtype
    bias = (jnp.zeros((), dtype) if x.bias is None else x.bias.astype(dtype))
    if x.mask is not None:  # excluded logits: the most negative finite value
      bias = jnp.where(x.mask, bias, jnp.finfo(dtype).min)
    bias = jnp.broadcast_to(bias, bias_shape)
  q_lens = k_lens = None
  if call.has_q_lengths or call.has_kv_lengths:
    q_lens = (x.query_seq_lengths if x.query_seq_lengths is not None
              else jnp.full((call.b,), call.t, jnp.int32))
    k_lens = (x.key_value_seq_lengths if x.key_value_seq_lengths is not None
              else jnp.full((call.b,), call.s, jnp.int32))
  config = cudnn_config(call, has_bias=bias is not None)
  seed = prim.seed_words(x.dropout_rng) if call.dropout_rate > 0 else (None, None)
  out, *lse = prim.attention(config, functools.partial(_cudnn_check, call, True),
                             x.query, x.key, x.value, bias, q_lens, k_lens, sinks=x.sinks,
                             seed=seed[0], offset=seed[1])
  return select_rows(_row_valid(call, x), out, lse[0] if lse else None, x.sinks, q_lens)


def select_rows(valid, out, lse, sinks=None, q_lens=None):
  """``out [B,T,N,Hv]`` and ``lse [B,N,T]`` where ``valid [B,1|N,T]`` (None: all rows),
  else 0 and lse -inf, or the sink logit in a row within ``q_lens`` (cuDNN leaves a row
  with no kept key ill-defined)."""
  if valid is None:
    return out, lse
  out = jnp.where(jnp.swapaxes(valid, 1, 2)[..., None], out, jnp.zeros((), out.dtype))
  if lse is not None:
    empty = jnp.full((), -jnp.inf)
    if sinks is not None:
      t = jnp.arange(lse.shape[-1])[None, None, :]
      within = True if q_lens is None else t < q_lens[:, None, None]
      empty = jnp.where(within, sinks[None, :, None], empty)
    lse = jnp.where(valid, lse, empty)
  return out, lse


engines.register_engine("sdpa", "cudnn", supports=_supports_cudnn, run=_run_cudnn)
