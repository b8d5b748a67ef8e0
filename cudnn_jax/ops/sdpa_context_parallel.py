"""Context parallelism for ``cudnn_jax.sdpa``: query, key and value sharded along their
sequence over one mesh axis, each device computing the attention of its query rows.

``"all_gather"``: each device gathers the whole key and value and attends its query rows
to them (causal: to the keys up to its last row, through bottom-right alignment).
``"ring"``: the key/value shards travel around the ring of devices; each device attends
its rows to one shard per step and merges the partial results by their log-sum-exp, so no
device holds more than one foreign shard at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from cudnn_jax.engines import UnsupportedError


def _mesh_with(axis, query, argument="context_parallel_axis"):
  """The mesh that ``axis`` (the value of ``argument``) names: the one query is sharded on
  (explicitly, or as a concrete array), else ``jax.set_mesh``'s."""
  candidates = [jax.typeof(query).sharding.mesh, jax.sharding.get_abstract_mesh()]
  sharding = getattr(query, "sharding", None)  # a concrete array: its devices
  if not isinstance(query, jax.core.Tracer) and isinstance(sharding, jax.sharding.NamedSharding):
    candidates.insert(0, sharding.mesh)
  for mesh in candidates:
    if not mesh.empty and axis in mesh.axis_names:
      return mesh
  raise ValueError(f"{argument}: {axis!r} is not an axis of the current mesh "
                   "(set one with jax.set_mesh, or shard the inputs explicitly)")


def mesh_size(axis, query):
  """The number of devices along mesh ``axis`` (see ``_mesh_with``)."""
  return _mesh_with(axis, query).shape[axis]


def device_call(call):
  """(what runs where, the call each device's engines serve) for ``call``, an ``SdpaCall``
  of the whole sequence with ``call.context_parallel = (axis, strategy, devices)``: what
  ``explain`` reports. Each device's call is the one ``_context_parallel`` makes:
  all_gather: its rows against every key, causal through bottom-right alignment over the
  keys up to its last row; ring: its rows against one key/value shard a step, causal
  through a mask."""
  axis, strategy, size = call.context_parallel
  rows = call.t // size
  head = (f"sdpa: context parallel along mesh axis {axis!r} ({size} devices), strategy "
          f"{strategy!r}: each device holds {rows} of the {call.t} query, key and value rows")
  if strategy == "ring":
    head += (f", attends them to one key/value shard per step ({size} steps, the shards "
             "passed on by collective permutes) and merges the results by log-sum-exp")
    local = dataclasses.replace(call, t=rows, s=rows, is_causal=False, window=None,
                                mask_shape=(1, 1, rows, rows) if call.is_causal else None)
  else:
    head += ", gathers key and value whole along the axis and attends its rows to them"
    left = call.window[0] if call.window is not None else None
    local = dataclasses.replace(call, t=rows, bottom_right=call.is_causal,
                                has_kv_lengths=call.is_causal,
                                window=None if left is None else (left, 0))
  return head, dataclasses.replace(local, return_lse=True, has_sinks=False,
                                   context_parallel=None)


def _merge(out, lse, part_out, part_lse):
  """Two partial softmax results over disjoint keys as one (lse -inf: no key)."""
  total = jnp.logaddexp(lse, part_lse)
  finite = jnp.isfinite(total)
  safe = jnp.where(finite, total, 0.0)
  weight = lambda l: jnp.where(finite & jnp.isfinite(l), jnp.exp(l - safe), 0.0)
  to_rows = lambda w: jnp.swapaxes(w, 1, 2)[..., None]  # [B,N,T] -> [B,T,N,1]
  return out * to_rows(weight(lse)) + part_out * to_rows(weight(part_lse)), total


def _ring(q, k, v, *, axis, size, is_causal, left, attend):
  """(out float32, lse) of this device's query rows over every device's keys: one key/value
  shard per step, passed on to the next device after it."""
  index = jax.lax.axis_index(axis)
  t = q.shape[1]
  rows = jnp.arange(t)[:, None]
  cols = jnp.arange(t)[None, :]
  out = jnp.zeros(q.shape[:3] + (v.shape[3],), jnp.float32)
  lse = jnp.full((q.shape[0], q.shape[2], t), -jnp.inf, jnp.float32)
  for step in range(size):
    source = (index - step) % size  # the shard k and v came from
    mask = None
    if is_causal:
      t_global, u_global = index * t + rows, source * t + cols
      keep = u_global <= t_global
      if left is not None:
        keep &= u_global >= t_global - left
      mask = keep[None, None]
    part_out, part_lse = attend(q, k, v, mask=mask)
    out, lse = _merge(out, lse, part_out.astype(jnp.float32), part_lse)
    if step + 1 < size:
      ring = [(j, (j + 1) % size) for j in range(size)]
      k, v = jax.lax.ppermute(k, axis, ring), jax.lax.ppermute(v, axis, ring)
  return out, lse


def sdpa_context_parallel(sdpa, query, key, value, *, axis, strategy, is_causal, window,
                          sinks, return_lse, **kwargs):
  """``sdpa`` (the op) over sequence shards along mesh ``axis``; ``kwargs`` (scale,
  soft cap, implementation) pass through to each device's call."""
  if query.ndim != 4 or key.shape[1] != query.shape[1]:
    raise UnsupportedError("context_parallel_axis: batched self-attention only (query and "
                           f"key of one sequence length), got query {tuple(query.shape)} "
                           f"and key {tuple(key.shape)}")
  left, right = window if window is not None else (None, None)
  if window is not None and not is_causal:
    raise UnsupportedError("context_parallel_axis: a local window needs is_causal=True")
  mesh = _mesh_with(axis, query)
  size = mesh.shape[axis]
  if query.shape[1] % size:
    raise ValueError(f"context_parallel_axis: the sequence ({query.shape[1]}) must divide "
                     f"into {size} shards along {axis!r}")
  del right  # causal: keys past the query row are excluded anyway

  options = (("scale", kwargs["scale"]), ("logits_soft_cap", kwargs["logits_soft_cap"]),
             ("implementation", _hashable(kwargs["implementation"])))
  with _current(mesh):
    out, lse = _context_parallel(query, key, value, sinks, sdpa=sdpa, mesh=mesh, axis=axis,
                                 strategy=strategy, is_causal=is_causal, left=left,
                                 options=options)
  return (out, lse) if return_lse else out


def _current(mesh):
  """``mesh`` as the current mesh where none is set (the inputs' explicit sharding named
  it): shard_map and the resharding of explicit axes look there."""
  if not jax.sharding.get_abstract_mesh().empty:
    return contextlib.nullcontext()
  if isinstance(mesh, jax.sharding.Mesh):
    return jax.set_mesh(mesh)
  return jax.sharding.use_abstract_mesh(mesh)


def _hashable(implementation):
  if implementation is None or isinstance(implementation, str):
    return implementation
  return tuple(implementation)


# Under jit even when called eagerly: shard_map over some of a mesh's axes (the others
# stay automatic) has no eager form, and one compiled program serves every call of a shape.
@functools.partial(jax.jit, static_argnames=("sdpa", "mesh", "axis", "strategy", "is_causal",
                                             "left", "options"))
def _context_parallel(query, key, value, sinks, *, sdpa, mesh, axis, strategy, is_causal,
                      left, options):
  """(out, lse) of ``sdpa`` over the sequence shards of query, key and value along
  ``axis``; ``options`` (scale, soft cap, implementation) pass through to each device's
  call."""
  size = mesh.shape[axis]

  def attend(q, k, v, **extra):
    return sdpa(q, k, v, return_lse=True, **dict(options), **extra)

  def local(q, k, v, *maybe_sinks):
    if strategy == "ring":
      out, lse = _ring(q, k, v, axis=axis, size=size, is_causal=is_causal, left=left,
                       attend=attend)
    else:
      k = jax.lax.all_gather(k, axis, axis=1, tiled=True)
      v = jax.lax.all_gather(v, axis, axis=1, tiled=True)
      extra = {}
      if is_causal:  # the keys up to this shard's last row, aligned to its end
        visible = (jax.lax.axis_index(axis) + 1) * q.shape[1]
        extra = dict(is_causal=True, causal_alignment="bottom_right",
                     key_value_seq_lengths=jnp.full((q.shape[0],), visible, jnp.int32),
                     local_window_size=None if left is None else (left, 0))
      out, lse = attend(q, k, v, **extra)
    for sinks in maybe_sinks:  # the sink joins each row's denominator once
      sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None], lse.shape)
      out, lse = _merge(out.astype(jnp.float32), lse, jnp.zeros_like(out, jnp.float32), sink)
    return out.astype(q.dtype), lse

  tokens, rows = P(None, axis), P(None, None, axis)
  arrays = (query, key, value) + (() if sinks is None else (sinks,))
  in_specs = (tokens,) * 3 + (P(),) * (len(arrays) - 3)

  def run(mesh, *arrays):
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=(tokens, rows),
                         axis_names={axis}, check_vma=False)(*arrays)

  if jax.sharding.AxisType.Explicit not in mesh.axis_types:
    return run(mesh, *arrays)
  # Explicit axes: the shard_map runs on automatic ones (only there does JAX transpose its
  # gathers, and the move of unsharded inputs onto the sequence shards). out and lse keep
  # query's batch and head sharding and are sequence sharded along ``axis``.
  # An automatic ``axis`` beside explicit ones is not named in the results' types.
  batch, heads = (_without(d, axis) for d in _spec(query, 4)[::2])
  explicit = dict(zip(mesh.axis_names, mesh.axis_types))[axis] == jax.sharding.AxisType.Explicit
  sequence = axis if explicit else None
  on_auto_axes = jax.sharding.auto_axes(
      lambda *a: run(jax.sharding.get_abstract_mesh(), *a),
      out_sharding=(P(batch, sequence, heads), P(batch, heads, sequence)))
  return on_auto_axes(*arrays)


def _spec(x, ndim):
  spec = tuple(jax.typeof(x).sharding.spec)
  return spec + (None,) * (ndim - len(spec))


def _without(entry, axis):
  """A PartitionSpec entry without mesh axis ``axis``."""
  names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
  names = tuple(n for n in names if n != axis)
  return None if not names else names[0] if len(names) == 1 else names

