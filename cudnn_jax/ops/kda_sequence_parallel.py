"""Sequence parallelism for ``cudnn_jax.kda`` and ``cudnn_jax.gdn``: the tokens sharded
along one mesh axis, each device running the recurrence over its own span of them.

For fixed q, k, g and beta the delta rule is linear in (state, values) together: token t
maps the state by ``S <- (I - beta_t k_t k_t^T) diag(e^{g_t}) S + beta_t k_t v_t^T``. So a
span of tokens maps the state entering it to the state leaving it affinely, per sequence
and value head::

    S_out = M S_in + B,    M [K,K] (the product of the tokens' matrices),  B [K,V]

and both come from the op itself: run over the span with K zero value columns appended and
the initial state ``[0 | I]``, its final state is ``[B | M]``. Each device therefore

1. runs the op over its span from a zero entering state, values widened: ``(M, B)``;
2. combines the spans' maps in device order (``ENTERING``: every map gathered along the
   sequence axis and folded on each device, or a log-depth scan of ``ppermute`` steps):
   the state entering its span;
3. runs the op over its span again from that state: its outputs and final states are the
   unsharded call's.

Steps 1 and 3 are two shard_maps, manual over the sequence axis only (the batch rows and
heads stay sharded as the compiler placed them on the other axes); the gathered combine
runs between them, outside, so that only the sequence axis is gathered.

Both runs are the op's own engines (``xla``, ``triton``) with their custom VJPs, so
gradients need nothing more (JAX transposes the collectives). The cost per device is two
passes over ``T / D`` tokens, the first with ``V + K`` value columns.

Packed sequences (``cu_seqlens``, B = 1): each device's span holds the pieces of the
sequences that meet it, laid out as local packed sequences (and the gaps between them as
sequences whose outputs are dropped). A piece that starts a sequence starts from its
initial state; only the piece of the sequence running into the span from before it starts
from the entering state, and a sequence that starts inside a span cuts the span's map there:
what leaves the span is the state of the sequence running out of it, which depends on the
entering state only when that is the same sequence (otherwise its ``M`` is 0). The final
state of a sequence comes from the device where it ends.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from cudnn_jax._metadata import served_sequences
from cudnn_jax.ops.sdpa_context_parallel import _current, _mesh_with, _spec, _without

# How the spans' maps are combined: "gather" (one all-gather of every device's map, each
# device folding the maps before its own: D - 1 small matmuls) or "log_depth" (log2 D
# rounds of collective permutes, each composing two maps). Measured on the 8-device CPU
# mesh (bench/NOTES.md, the GPT-style model's training step): the single all-gather is as
# fast or faster at these sizes.
ENTERING = "gather"

_HIGHEST = jax.lax.Precision.HIGHEST


def _apply(maps, state):
  """``M S + B`` for ``maps = (M [..., K, K], B [..., K, V])`` and ``state [..., K, V]``."""
  m, b = maps
  return jnp.einsum("...ij,...jv->...iv", m, state, precision=_HIGHEST) + b


def _compose(first, then):
  """The map ``then . first`` (``first`` applied first)."""
  return jnp.einsum("...ij,...jk->...ik", then[0], first[0], precision=_HIGHEST), _apply(
      then, first[1])


def _entering_gather(maps, start):
  """Every span's entering state ``[D, ...]`` from every span's map ``[D, ...]`` (stacked
  along the sequence axis), folded from ``start`` (the state entering the first span).

  Runs outside the shard_map, where every mesh axis is the compiler's: the constraint
  gathers the maps along the sequence axis only, each device keeping its own batch rows
  and heads. (An ``all_gather`` inside a shard_map that is manual over the sequence axis
  alone first replicates its operand over the other axes: on a data x tensor x sequence
  mesh it moved the maps of every batch row and head; bench/NOTES.md.)"""
  free = (P.UNCONSTRAINED,) * (maps[0].ndim - 1)
  every = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, P(None, *free)), maps)
  step = lambda state, m: (_apply(m, state), state)
  return jax.lax.scan(step, start, every)[1]


def _entering_log_depth(maps, start, axis, size):
  """The state entering this device's span by a log-depth inclusive scan (Hillis-Steele)
  inside the shard_map: after the round of ``shift``, device d holds the maps of devices
  ``d - 2 shift + 1 .. d`` composed; then each span's leaving state moves one device on."""
  index = jax.lax.axis_index(axis)
  shift = 1
  while shift < size:
    earlier = jax.lax.ppermute(maps, axis, [(j, j + shift) for j in range(size - shift)])
    composed = _compose(earlier, maps)
    maps = jax.tree.map(lambda c, m: jnp.where(index >= shift, c, m), composed, maps)
    shift *= 2
  leaving = _apply(maps, start)
  entering = jax.lax.ppermute(leaving, axis, [(j, j + 1) for j in range(size - 1)])
  return jnp.where(index == 0, start, entering)


def _widened(v, k_dim):
  """``[v | 0]``: K zero value columns appended (their final state is the span's M)."""
  return jnp.concatenate([v, jnp.zeros(v.shape[:-1] + (k_dim,), v.dtype)], -1)


def _identity_like(state, k_dim):
  """``[0 | I]`` per sequence and value head, for states ``[N, HV, K, V]``."""
  eye = jnp.broadcast_to(jnp.eye(k_dim, dtype=jnp.float32), state.shape[:2] + (k_dim, k_dim))
  return jnp.concatenate([jnp.zeros_like(state), eye], -1)


def _split(widened, v_dim):
  """``[B | M]`` -> ``(M, B)``."""
  return widened[..., v_dim:], widened[..., :v_dim]


class _Pieces:
  """The packed sequences of ``cu_seqlens`` cut to the span ``[start, start + span)`` of
  ``rows`` packed rows, as ``2N`` local sequences: before each sequence i the gap since
  the previous one (2i), then its piece (2i + 1)."""

  def __init__(self, cu_seqlens, rows, start, span):
    starts, lengths = served_sequences(cu_seqlens, rows)
    # Served sequences are ordered and disjoint; the running maximum puts the empty ones
    # at the end of the sequence before them, so the bounds never decrease.
    bounds = jax.lax.cummax(jnp.stack([starts, starts + lengths], -1).reshape(-1))
    local = jnp.clip(bounds - start, 0, span).astype(jnp.int32)
    self.cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), local])  # [2N+1]
    # A row is in a sequence when an odd number of bounds lie at or before it.
    rows_here = jnp.arange(span, dtype=jnp.int32)
    self.inside = jnp.sum(local[None, :] <= rows_here[:, None], -1) % 2 == 1  # [span]
    first, last = bounds[0::2], bounds[1::2]
    self.carried = first < start  # [N]: continues from before the span
    self.ends = (lengths > 0) & (last > start) & (last <= start + span)
    self.runs_out = (first < start + span) & (last > start + span)  # into the next span
    self.empty = lengths == 0

  def initial(self, entering, own):
    """Local initial states ``[2N, ...]``: a piece continuing from before the span starts
    from ``entering [1, ...]``, one that starts its sequence from ``own [N, ...]``; gaps
    from zeros."""
    pieces = jnp.where(self.carried[:, None, None, None], entering, own)
    gaps = jnp.zeros_like(pieces)
    return jnp.stack([gaps, pieces], 1).reshape((-1,) + own.shape[1:])

  def leaving(self, finals):
    """The state of the sequence running into the next span ``[1, ...]`` (zeros if none),
    from the local final states ``[2N, ...]``."""
    return jnp.sum(jnp.where(self.runs_out[:, None, None, None], finals[1::2], 0.0), 0,
                   keepdims=True)


def _start(q, v, initial_state, cu_seqlens):
  """The state entering the first span (``[N, HV, K, V]``; packed: ``[1, ...]``, zeros),
  and the sequences' own initial states ``[N, HV, K, V]`` float32."""
  hv, k_dim, v_dim = v.shape[2], q.shape[3], v.shape[3]
  n = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
  own = (jnp.zeros((n, hv, k_dim, v_dim), jnp.float32) if initial_state is None
         else initial_state.astype(jnp.float32))
  return (own if cu_seqlens is None else jnp.zeros((1,) + own.shape[1:], jnp.float32)), own


def _span(q, k, v, g, beta, initial_state, a_log, dt_bias, cu_seqlens, *, op, axis, size, rows,
          options):
  """(run, own, pieces, index) of one device's span: ``run(v, initial, cu)`` is the op over
  the span's tokens; ``pieces`` the span's packed pieces (None without cu_seqlens)."""
  del size
  index, span = jax.lax.axis_index(axis), q.shape[1]
  gates = dict(a_log=a_log, dt_bias=dt_bias)
  run = lambda v_, init, cu: op(q, k, v_, g, beta, initial_state=init, cu_seqlens=cu,
                                output_final_state=True, **gates, **dict(options))
  own = _start(q, v, initial_state, cu_seqlens)[1]
  pieces = None if cu_seqlens is None else _Pieces(cu_seqlens, rows, index * span, span)
  return run, own, pieces, index


def _local_maps(*arrays, log_depth, **kw):
  """Step 1 on one device: its span's map ``(M, B)``, each ``[1, ...]`` (stacked along the
  sequence axis outside); with ``log_depth`` instead the state entering the span ``[1, ...]``
  (the maps combined here, by collective permutes)."""
  q, v, initial_state, cu_seqlens = arrays[0], arrays[2], arrays[5], arrays[8]
  run, own, pieces, _ = _span(*arrays, **kw)
  k_dim, v_dim = q.shape[3], v.shape[3]
  start = _start(q, v, initial_state, cu_seqlens)[0]
  if pieces is None:  # every batch row runs through every span
    _, widened = run(_widened(v, k_dim), _identity_like(own, k_dim), None)
  else:
    wide_own = jnp.concatenate([own, jnp.zeros(own.shape[:3] + (k_dim,), jnp.float32)], -1)
    _, widened = run(_widened(v, k_dim),
                     pieces.initial(_identity_like(start, k_dim), wide_own), pieces.cu)
    widened = pieces.leaving(widened)
  maps = _split(widened, v_dim)
  if log_depth:
    return _entering_log_depth(maps, start, kw["axis"], kw["size"])[None]
  return jax.tree.map(lambda x: x[None], maps)


def _local_outputs(*arrays, **kw):
  """Step 3 on one device: ``(o [B, span, HV, V], finals [1, N, HV, K, V])`` from the
  state entering its span (the last of ``arrays``, ``[1, ...]``), where ``finals`` holds
  the final states of the sequences that end in the span (zeros elsewhere)."""
  *arrays, entering = arrays
  run, own, pieces, index = _span(*arrays, **kw)
  entering, size = entering[0], kw["size"]
  if pieces is None:
    o, final = run(arrays[2], entering, None)
    return o, jnp.where(index == size - 1, final, 0.0)[None]
  o, finals = run(arrays[2], pieces.initial(entering, own), pieces.cu)
  o = jnp.where(pieces.inside[None, :, None, None], o, jnp.zeros((), o.dtype))
  mine = jnp.where(pieces.ends[:, None, None, None], finals[1::2], 0.0)
  mine += jnp.where(pieces.empty[:, None, None, None] & (index == 0), own, 0.0)
  return o, mine[None]


def sequence_parallel(op, q, k, v, g, beta, *, axis, initial_state, a_log, dt_bias,
                      cu_seqlens, options):
  """``(o, final_state)`` of ``op`` (``cudnn_jax.kda`` or ``gdn``) over the token shards
  of q, k, v, g, beta along mesh ``axis``; ``options`` (static keyword arguments: scale,
  the preprocessing flags, chunk_size, implementation) pass through to each device's
  calls. ``T`` must divide into the devices along ``axis``."""
  mesh = _mesh_with(axis, q, argument="sequence_parallel_axis")
  size = mesh.shape[axis]
  if q.shape[1] % size:
    raise ValueError(f"sequence_parallel_axis: the sequence ({q.shape[1]}) must divide "
                     f"into {size} shards along {axis!r}")
  with _current(mesh):
    return _sequence_parallel(q, k, v, g, beta, initial_state, a_log, dt_bias, cu_seqlens,
                              op=op, mesh=mesh, axis=axis, options=options)


# Under jit even when called eagerly, as sdpa's context parallelism: shard_map over some of
# a mesh's axes has no eager form.
@functools.partial(jax.jit, static_argnames=("op", "mesh", "axis", "options"))
def _sequence_parallel(q, k, v, g, beta, initial_state, a_log, dt_bias, cu_seqlens, *, op,
                       mesh, axis, options):
  size = mesh.shape[axis]
  kw = dict(op=op, axis=axis, size=size, rows=q.shape[1], options=options)
  log_depth = ENTERING == "log_depth"
  tokens, stacked = P(None, axis), P(axis)
  arrays = (q, k, v, g, beta, initial_state, a_log, dt_bias, cu_seqlens)
  in_specs = (tokens,) * 5 + (P(),) * 4

  def run(mesh, *arrays):
    # check_vma=False: the engines' custom_vjps do not track which values vary across
    # devices; unchecked, the cotangents of replicated inputs (initial_state, a_log,
    # dt_bias) are summed over the devices, which is their gradient.
    shard_map = functools.partial(jax.shard_map, mesh=mesh, axis_names={axis},
                                  check_vma=False)
    maps = shard_map(functools.partial(_local_maps, log_depth=log_depth, **kw),
                     in_specs=in_specs, out_specs=stacked)(*arrays)
    entering = maps if log_depth else _entering_gather(
        maps, _start(arrays[0], arrays[2], arrays[5], arrays[8])[0])
    o, finals = shard_map(functools.partial(_local_outputs, **kw),
                          in_specs=in_specs + (stacked,),
                          out_specs=(tokens, stacked))(*arrays, entering)
    return o, jnp.sum(finals, 0)

  if jax.sharding.AxisType.Explicit not in mesh.axis_types:
    return run(mesh, *arrays)
  # Explicit axes: the shard_map runs on automatic ones (as in sdpa_context_parallel); o
  # keeps v's batch and head sharding (and the tokens', where the sequence axis is one of
  # them), the final states their heads' (and the batch's).
  batch, _, heads = (_without(d, axis) for d in _spec(v, 4)[:3])
  final_spec = P(None if cu_seqlens is not None else batch, heads)
  explicit = dict(zip(mesh.axis_names, mesh.axis_types))[axis] == jax.sharding.AxisType.Explicit
  on_auto_axes = jax.sharding.auto_axes(
      lambda *a: run(jax.sharding.get_abstract_mesh(), *a),
      out_sharding=(P(batch, axis if explicit else None, heads), final_spec))
  return on_auto_axes(*arrays)
