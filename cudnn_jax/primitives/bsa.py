"""JAX primitives for block-sparse attention's xla engine: forward and backward, each a
batch- and head-local computation.

``bsa_fwd_p(q, k, v, block_index, block_counts, kv_block_sizes) -> (out, lse)`` and
``bsa_bwd_p(same..., d_out, d_lse) -> (dq, dk, dv)`` lower to the plain JAX of
``cudnn_jax.reference.bsa``. As primitives they get a batching rule (a vmapped axis folds
into the batch) and, on a device mesh, a partitioning rule: batch- and head-sharded inputs
compute locally, where XLA's partitioner would gather the kv blocks across devices.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend import core as jex_core
from jax.interpreters import batching, mlir
from jax._src import dispatch as jax_dispatch  # pylint: disable=g-bad-import-order

from cudnn_jax.primitives import _common


@dataclasses.dataclass(frozen=True)
class BsaConfig:
  block_size: int
  scale: float
  is_causal: bool


def reference(config, q, k, v, index, counts, sizes):
  from cudnn_jax.reference import bsa as ref  # pylint: disable=g-import-not-at-top
  return ref.bsa(q, k, v, index, counts, sizes, block_size=config.block_size,
                 scale=config.scale, is_causal=config.is_causal)


def _fwd_impl(config, *args):
  return tuple(reference(config, *args))


def _bwd_impl(config, q, k, v, index, counts, sizes, d_out, d_lse):
  _, pull = jax.vjp(lambda q, k, v: reference(config, q, k, v, index, counts, sizes), q, k, v)
  return pull((d_out, d_lse))


# ---------------------------------------------------------------------------------------
# Partitioning: batch (dim 0) and heads (query dim 2, kv dim 2) stay sharded.


def _local_shardings(mesh, arg_shapes):
  """(token-major sharding, per-row sharding, the six operands' shardings)."""
  batch, heads = _common.batch_and_head_axes(mesh, arg_shapes[0].sharding,
                                             arg_shapes[0].shape, arg_shapes[1].shape)
  tokens = _common.named(mesh, batch, (), heads, ())
  rows = _common.named(mesh, batch, heads, ())
  per_block = _common.named(mesh, batch, heads, (), ())
  return tokens, rows, [tokens, tokens, tokens, per_block, rows, rows]


def _fwd_partition(config, mesh, arg_shapes, result_shape):
  del result_shape
  tokens, rows, operands = _local_shardings(mesh, arg_shapes)
  return mesh, functools.partial(_fwd_impl, config), (tokens, rows), tuple(operands)


def _bwd_partition(config, mesh, arg_shapes, result_shape):
  del result_shape
  tokens, rows, operands = _local_shardings(mesh, arg_shapes)
  return (mesh, functools.partial(_bwd_impl, config), (tokens,) * 3,
          tuple(operands + [tokens, rows]))


# q, k, v, block_index, block_counts, kv_block_sizes; only b, n and k may stay sharded.
_OPERANDS = "b t n h, b s k h, b s k d, b n m j, b n m, b k l"
_WHOLE = ("t", "s", "h", "d", "m", "j", "l")


def _fwd_rule(config, mesh, arg_types, result_types):
  del config, mesh, arg_types, result_types
  return _common.sharding_rule(f"{_OPERANDS} -> b t n d, b n t", _WHOLE)


def _bwd_rule(config, mesh, arg_types, result_types):
  del config, mesh, arg_types, result_types
  return _common.sharding_rule(
      f"{_OPERANDS}, b t n d, b n t -> b t n h, b s k h, b s k d", _WHOLE)


def _register(prim, impl, partition, rule):
  partitioned = custom_partitioning(impl, static_argnums=(0,))
  partitioned.def_partition(partition=partition, sharding_rule=rule)

  def lowering(ctx, *args, config):
    devices = getattr(ctx.module_context.axis_context, "device_assignment", ())
    fn = impl if devices is None or len(devices) == 1 else partitioned
    return mlir.lower_fun(lambda *a: fn(config, *a), multiple_results=True)(ctx, *args)

  prim.multiple_results = True
  prim.def_impl(functools.partial(jax_dispatch.apply_primitive, prim))
  jax_dispatch.prim_requires_devices_during_lowering.add(prim)  # for custom_partitioning
  mlir.register_lowering(prim, lowering)


bsa_fwd_p = jex_core.Primitive("cudnn_jax_bsa_fwd")
bsa_bwd_p = jex_core.Primitive("cudnn_jax_bsa_bwd")
_register(bsa_fwd_p, _fwd_impl, _fwd_partition, _fwd_rule)
_register(bsa_bwd_p, _bwd_impl, _bwd_partition, _bwd_rule)


@bsa_fwd_p.def_abstract_eval
def _fwd_abstract(q, k, v, index, counts, sizes, *, config):
  del k, index, counts, sizes, config
  b, t, n, _ = q.shape
  return (jax.core.ShapedArray((b, t, n, v.shape[3]), q.dtype),
          jax.core.ShapedArray((b, n, t), jnp.float32))


@bsa_bwd_p.def_abstract_eval
def _bwd_abstract(q, k, v, *rest, config):
  del rest, config
  return tuple(jax.core.ShapedArray(x.shape, x.dtype) for x in (q, k, v))


def _batch(prim, args, dims, *, config):
  """A vmapped axis folds into the batch: every operand has the batch first."""
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  res = prim.bind(*(_common.fold(x, d, size) for x, d in zip(args, dims)), config=config)
  return tuple(_common.unfold(x, size) for x in res), (0,) * len(res)


batching.primitive_batchers[bsa_fwd_p] = functools.partial(_batch, bsa_fwd_p)
batching.primitive_batchers[bsa_bwd_p] = functools.partial(_batch, bsa_bwd_p)


# ---------------------------------------------------------------------------------------
# Differentiation: the backward primitive recomputes the forward from the inputs.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def bsa(config, q, k, v, index, counts, sizes):
  """``(out [B,Sq,N,Hv], lse [B,N,Sq])``; differentiable in q, k, v."""
  return tuple(bsa_fwd_p.bind(q, k, v, index, counts, sizes, config=config))


def _bsa_fwd(config, q, k, v, index, counts, sizes):
  return bsa(config, q, k, v, index, counts, sizes), (q, k, v, index, counts, sizes)


def _bsa_bwd(config, saved, cotangents):
  d_out, d_lse = cotangents
  dq, dk, dv = bsa_bwd_p.bind(*saved, d_out, d_lse, config=config)
  ints = [jnp.zeros(x.shape, jax.dtypes.float0) for x in saved[3:]]
  return (dq, dk, dv, *ints)


bsa.defvjp(_bsa_fwd, _bsa_bwd)
