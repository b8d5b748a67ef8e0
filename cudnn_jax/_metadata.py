"""Value-dependent metadata (lengths, offsets, page ids, indices, group sizes): the result
every op defines for invalid entries, and the checks it runs on request.

Metadata lives on the device, so it cannot be validated at trace time. Each helper below
pairs a pure function that turns any metadata into what is served (the engines then never
read or write outside their buffers, nor another sequence's data) with a check under
``jax.experimental.checkify``: inside ``checkify.checkify`` (user checks enabled) an
invalid entry raises an error naming the argument and the offending entry; outside it the
check is ``checkify.debug_check``, which emits nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import checkify

_INT32_MIN = jnp.iinfo(jnp.int32).min


def _first(bad):
  """Index of the first True entry of ``bad`` (any shape, flattened: C order)."""
  return jnp.argmax(bad.reshape(-1))


def check_entries(name, x, bad, why):
  """Under checkify: fails when any entry of ``bad`` (``x``'s shape) is True, naming
  ``name``, the first offending entry's index and value, and ``why``."""
  from cudnn_jax.primitives import core  # pylint: disable=g-import-not-at-top
  if not bad.size or core.exporting():  # jax.export cannot serialize a check's effect
    return
  x, bad = jnp.asarray(x), jnp.asarray(bad)
  mesh = core.explicit_mesh([x, bad])
  if mesh is not None:  # flattened whole: replicated first
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    whole = lambda a: jax.sharding.reshard(a, replicated)
    x, bad = whole(x), whole(bad)
  flat = x.reshape(-1)
  i = _first(bad)
  index = jnp.unravel_index(i, bad.shape) if bad.ndim > 1 else (i,)
  where = ", ".join(["{}"] * len(index))
  try:
    checkify.debug_check(~jnp.any(bad), f"{name}[{where}] = {{}}: {why}", *index, flat[i])
  except Exception as e:  # pylint: disable=broad-except
    # debug_check's vmap rule sorts the batch of predicates, which JAX refuses on a batch
    # sharded along explicit mesh axes: there the check is left out (the result is
    # defined all the same).
    if type(e).__name__ != "ShardingTypeError":
      raise


# ---------------------------------------------------------------------------------------
# Lengths: clamped to [0, capacity].


def clamp_lengths(x, capacity):
  """``x`` int32, clamped to ``[0, capacity]``."""
  return jnp.clip(jnp.asarray(x).astype(jnp.int32), 0, capacity)


def check_lengths(name, x, capacity):
  x = jnp.asarray(x)
  check_entries(name, x, (x < 0) | (x > capacity), f"expected a length in [0, {capacity}]")


# ---------------------------------------------------------------------------------------
# cu_seqlens: the sequences that are served.


def served_sequences(cu_seqlens, rows):
  """``(starts [n], lengths [n])`` int32 of the sequences ``cu_seqlens [n+1]`` describes in
  ``rows`` packed rows.

  Sequence i is served when ``0 <= cu[i] <= cu[i+1] <= rows`` and ``cu[i]`` is at least
  every earlier entry; any other is empty (length 0, start clipped into ``[0, rows]``).
  Served sequences never overlap: an earlier one ends at an entry before ``cu[i]``.
  """
  cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
  start, end = cu[:-1], cu[1:]
  earlier = jnp.concatenate([jnp.full((1,), _INT32_MIN, jnp.int32),
                             jax.lax.cummax(cu)[:-2]])  # max(cu[:i])
  served = (start >= 0) & (start <= end) & (end <= rows) & (start >= earlier)
  return (jnp.where(served, start, jnp.clip(start, 0, rows)),
          jnp.where(served, end - start, 0))


def check_cu_seqlens(name, cu_seqlens, rows, max_seqlen=None, max_name="max_seqlen"):
  """Under checkify: every sequence of ``cu_seqlens`` served (see ``served_sequences``)
  and, with ``max_seqlen``, none longer than it."""
  cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
  first = jnp.arange(cu.shape[0]) == 0
  check_entries(name, cu, first & (cu < 0), "expected the first offset >= 0")
  below = jnp.concatenate([jnp.zeros((1,), bool), cu[1:] < jax.lax.cummax(cu)[:-1]])
  check_entries(name, cu, below, "expected offsets that never decrease (it is below an "
                "earlier entry)")
  check_entries(name, cu, cu > rows, f"expected offsets <= {rows} (the packed rows)")
  if max_seqlen is not None:
    longer = jnp.concatenate([jnp.zeros((1,), bool), cu[1:] - cu[:-1] > max_seqlen])
    check_entries(name, cu, longer,
                  f"the sequence ending here is longer than {max_name}={max_seqlen}")


def packed_slots(starts, lengths, width, rows):
  """Where the packed rows go in a padded ``[n, width]`` layout.

  Returns ``(index [n, width], valid [n, width])``: padded slot ``(i, t)`` holds packed row
  ``index[i, t] = starts[i] + t`` when ``valid`` (``t < min(lengths[i], width)``), and
  ``index = rows`` (out of range) otherwise, so that a scatter with ``mode="drop"`` writes
  only valid slots.
  """
  t = jnp.arange(width, dtype=jnp.int32)
  valid = t[None, :] < jnp.minimum(lengths, width)[:, None]
  return jnp.where(valid, starts[:, None] + t[None, :], rows), valid


def row_slots(index, rows):
  """The inverse of a padded layout: ``index`` (any shape: the packed row each padded slot
  holds, ``rows`` where none, as ``packed_slots`` gives) -> ``(slot [rows], owned [rows])``,
  the flat padded slot that holds each packed row (0 where none) and whether one does.
  Served sequences never overlap, so no row has two slots."""
  flat = index.reshape(-1)
  slot = jnp.zeros((rows,), jnp.int32).at[flat].set(
      jnp.arange(flat.shape[0], dtype=jnp.int32), mode="drop")
  return slot, jnp.zeros((rows,), bool).at[flat].set(True, mode="drop")


# ---------------------------------------------------------------------------------------
# Indices into a buffer (page ids, expert indices): outside [0, size) selects nothing.


def in_range(x, size):
  return (x >= 0) & (x < size)


def check_indices(name, x, size, used=None):
  """Under checkify: every entry of ``x`` (those where ``used``, when given) in
  ``[0, size)``."""
  x = jnp.asarray(x)
  bad = ~in_range(x, size)
  if used is not None:
    bad &= used
  check_entries(name, x, bad, f"expected an index in [0, {size})")


def check_nonnegative(name, x, why="expected >= 0 (a negative entry counts as 0)"):
  x = jnp.asarray(x)
  check_entries(name, x, x < 0, why)


def check_group_sizes(name, group_sizes, rows):
  """Under checkify: no negative size, and the groups end within ``rows``."""
  sizes = jnp.asarray(group_sizes)
  check_nonnegative(name, sizes)
  ends = jnp.cumsum(jnp.maximum(sizes, 0), axis=-1)
  check_entries(name, sizes, ends > rows,
                f"the groups so far hold more than the {rows} rows (the rest are cut)")
