"""The ``xla`` engines for gemm and grouped_gemm, in plain JAX.

Products accumulate in float32 (float32 inputs at ``precision=HIGHEST``, no TF32); the
epilogue (``cudnn_jax.epilogue``) runs on the float32 accumulator. These functions return
that float32 result; the callers cast it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cudnn_jax import epilogue
from cudnn_jax.reference import matmul_precision


def gemm(a, b, bias=None, *, activation=None, glu=None):
  """``epilogue(a @ b + bias)`` in float32: ``a [..., M, K]``, ``b [K, C]`` -> ``[..., M, N]``."""
  h = jnp.matmul(a, b, precision=matmul_precision(a.dtype), preferred_element_type=jnp.float32)
  return epilogue.apply(h, bias, activation=activation, glu=glu)


def group_ids(group_sizes, rows):
  """``[rows]`` int32: the group of each row, G for rows past ``sum(group_sizes)``."""
  ends = jnp.cumsum(group_sizes)
  return jnp.searchsorted(ends, jnp.arange(rows, dtype=ends.dtype), side="right").astype(
      jnp.int32)


def inverse_permutation(order):
  return jnp.zeros_like(order).at[order].set(
      jnp.arange(order.shape[0], dtype=order.dtype), unique_indices=True)


# The grouped product is lax.ragged_dot, wrapped for two reasons. ragged_dot's batching
# rule handles only operands that are all batched along axis 0 (jax 0.11), so each
# primitive below gets a custom_vmap rule; custom_vmap blocks reverse mode, so the
# product gets a custom_vjp whose backward pass is made of the same wrapped primitives.


def _ragged_dot(lhs, rhs, group_sizes):
  """``out[i] = lhs[i] @ rhs[g(i)]``, float32 ``[M, N]``; 0 past the last group."""
  return jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=matmul_precision(lhs.dtype),
                            preferred_element_type=jnp.float32)


_OUTER_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])


def _ragged_outer(lhs, ct, group_sizes):
  """``out[g] = lhs[rows of g].T @ ct[rows of g]``, float32 ``[G, K, N]``."""
  return jax.lax.ragged_dot_general(lhs, ct, group_sizes, _OUTER_DIMS,
                                    precision=matmul_precision(lhs.dtype),
                                    preferred_element_type=jnp.float32)


def _batched(axis_size, in_batched, *args):
  return [x if b else jnp.broadcast_to(x, (axis_size, *x.shape))
          for x, b in zip(args, in_batched)]


_ragged_dot_vmappable = jax.custom_batching.custom_vmap(_ragged_dot)
_ragged_outer_vmappable = jax.custom_batching.custom_vmap(_ragged_outer)


@_ragged_dot_vmappable.def_vmap
def _ragged_dot_vmap(axis_size, in_batched, lhs, rhs, group_sizes):
  lhs, group_sizes = _batched(axis_size, in_batched[::2], lhs, group_sizes)
  if in_batched[1]:
    return jax.vmap(_ragged_dot)(lhs, rhs, group_sizes), True
  # Shared weights: one ragged_dot over all B*M rows, regrouped by group across the batch,
  # rather than B copies of rhs.
  b, m, k = lhs.shape
  gid = jax.vmap(group_ids, (0, None))(group_sizes, m).reshape(-1)
  order = jnp.argsort(gid, stable=True)
  sizes = jnp.bincount(gid, length=rhs.shape[0] + 1)[:-1].astype(jnp.int32)
  out = _ragged_dot_vmappable(lhs.reshape(b * m, k)[order], rhs, sizes)
  return out[inverse_permutation(order)].reshape(b, m, -1), True


@_ragged_outer_vmappable.def_vmap
def _ragged_outer_vmap(axis_size, in_batched, lhs, ct, group_sizes):
  return jax.vmap(_ragged_outer)(*_batched(axis_size, in_batched, lhs, ct, group_sizes)), True


def grouped_outer(lhs, ct, group_sizes):
  """``out[g] = lhs[rows of g].T @ ct[rows of g]``, float32 ``[G, K, N]``; vmappable."""
  return _ragged_outer_vmappable(lhs, ct, group_sizes)


@jax.custom_vjp
def grouped_product(lhs, rhs, group_sizes):
  """``lhs [M, K]`` sorted by group times ``rhs [G, K, N]``: float32 ``[M, N]``, 0 past
  ``sum(group_sizes)``; vmappable over any operands and differentiable in lhs and rhs."""
  return _ragged_dot_vmappable(lhs, rhs, group_sizes)


def _grouped_product_fwd(lhs, rhs, group_sizes):
  return grouped_product(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _grouped_product_bwd(res, ct):
  lhs, rhs, group_sizes = res
  ct = ct.astype(lhs.dtype)  # as a fused kernel reads it: input precision, float32 sums
  d_lhs = _ragged_dot_vmappable(ct, jnp.swapaxes(rhs, 1, 2), group_sizes)
  d_rhs = grouped_outer(lhs, ct, group_sizes)
  return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype), None


grouped_product.defvjp(_grouped_product_fwd, _grouped_product_bwd)


def clamped_sizes(group_sizes, rows):
  """``group_sizes [..., G]`` as served: negative sizes count as 0, and the groups end at
  ``rows``."""
  ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0), axis=-1), rows)
  return jnp.diff(ends, axis=-1, prepend=0).astype(jnp.int32)


def grouped_epilogue(h, group_sizes, bias=None, *, activation=None, glu=None):
  """``epilogue(h[i] + bias[g])`` for the rows ``i`` of each group ``g``, float32; rows
  past the groups are 0. ``h [M, C]``, ``group_sizes [G]``, ``bias [G, C]``."""
  if bias is None and activation is None and glu is None:
    return h.astype(jnp.float32)
  groups = group_sizes.shape[0]
  gid = group_ids(group_sizes, h.shape[0])
  row_bias = None
  if bias is not None:
    # Gathered in float32, so its gradient (a sum over each group's rows) adds in float32.
    row_bias = bias.astype(jnp.float32)[jnp.minimum(gid, groups - 1)]
  y = epilogue.apply(h, row_bias, activation=activation, glu=glu)
  return jnp.where((gid < groups)[:, None], y, 0.0)


def grouped_gemm(lhs, rhs, group_sizes, bias=None, *, activation=None, glu=None):
  """Row ``i`` of group ``g``: ``epilogue(lhs[i] @ rhs[g] + bias[g])``, float32 ``[M, N]``.

  ``lhs [M, K]`` sorted by group, ``rhs [G, K, C]``, ``group_sizes [G]`` int32 (see
  ``clamped_sizes``), ``bias [G, C]``. Rows past the groups are exactly 0.
  """
  group_sizes = clamped_sizes(group_sizes, lhs.shape[0])
  h = grouped_product(lhs, rhs, group_sizes)
  return grouped_epilogue(h, group_sizes, bias, activation=activation, glu=glu)


def finish(y, out_dtype, return_amax):
  """``(y cast to out_dtype, max|y| float32 or None)``."""
  amax = jnp.max(jnp.abs(y), initial=0.0).astype(jnp.float32) if return_amax else None
  return y.astype(out_dtype), amax
