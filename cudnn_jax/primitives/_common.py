"""Pieces every FFI-backed primitive shares: batching folds, partition specs, and the
workspace result of the cuDNN handlers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P


def workspace_result(size):
  """The u8 result a cuDNN handler runs its plan in: ``size`` bytes (at least one), sized
  by the extension's ``*_workspace`` query when the call is lowered."""
  return jax.ShapeDtypeStruct((max(size, 1),), jnp.uint8)


def move_to_front(x, bdim, size):
  """x with its vmapped axis first; an unbatched x is broadcast to ``size`` copies."""
  if bdim is None:
    return jnp.broadcast_to(x, (size,) + x.shape)
  return jnp.moveaxis(x, bdim, 0)


def fold(x, bdim, size):
  """Folds the vmapped axis into the leading (batch) axis: [V,B,...] -> [V*B,...]."""
  x = move_to_front(x, bdim, size)
  return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def unfold(x, size):
  return x.reshape((size, x.shape[0] // size) + x.shape[1:])


def spec_axes(sharding, dim):
  """The mesh axes (a tuple, maybe empty) that shard dimension ``dim``."""
  if not isinstance(sharding, NamedSharding) or dim >= len(sharding.spec):
    return ()
  entry = sharding.spec[dim]
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def axes_size(mesh, axes):
  size = 1
  for a in axes:
    size *= mesh.shape[a]
  return size


def named(mesh, *entries):
  entries = [None if not e else (e[0] if len(e) == 1 else e) for e in entries]
  return NamedSharding(mesh, P(*entries))


def with_shape(x, dtype=None):
  return jax.ShapeDtypeStruct(x.shape, dtype or x.dtype)


def sharding_rule(rule, replicated):
  """A Shardy rule for custom_partitioning: the einsum-like ``rule`` and the factors that
  need replication, listed in the order they first appear in it (Shardy wants them sorted
  that way)."""
  order = []
  for factor in rule.replace(",", " ").replace("->", " ").split():
    if factor not in order:
      order.append(factor)
  return rule, dict(need_replication_factors=tuple(f for f in order if f in replicated))


def batch_and_head_axes(mesh, q_sharding, q_shape, k_shape):
  """The mesh axes that shard the query's batch (dim 0) and heads (dim 2), each kept only
  where it divides the sizes evenly (the heads: both the query's and the kv heads, dim 2
  of ``k_shape``); ``()`` where the dimension stays whole."""
  batch, heads = spec_axes(q_sharding, 0), spec_axes(q_sharding, 2)
  if batch and q_shape[0] % axes_size(mesh, batch):
    batch = ()
  if heads and (q_shape[2] % axes_size(mesh, heads) or k_shape[2] % axes_size(mesh, heads)):
    heads = ()
  return batch, heads
