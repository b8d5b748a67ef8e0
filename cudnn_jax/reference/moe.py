"""The ``xla`` engine for the mixture-of-experts MLP, in plain JAX.

Dropless routing: each of the T*k (token, choice) pairs becomes one row. Rows are sorted by
expert (stable, so tokens keep their order within an expert), the up projection and the
down projection are grouped GEMMs over those rows, and the combine un-sorts the rows and
sums each token's k rows weighted by ``expert_weights``. Pairs whose expert index is out of
range sort after every expert: the grouped GEMMs leave them 0, and their weight is dropped.
"""

from __future__ import annotations

import jax.numpy as jnp

from cudnn_jax.reference import gemm as ref_gemm
from cudnn_jax.reference import matmul_precision


def route(expert_indices, num_experts):
  """Sorts the (token, choice) pairs by expert.

  ``expert_indices [T, k]`` -> ``(order [T*k], group_sizes [E] int32, valid [T, k])``:
  ``order`` lists flat pair indices ``t*k + j`` by expert, out-of-range pairs last;
  ``valid`` marks pairs with an expert in ``[0, E)``.
  """
  valid = (expert_indices >= 0) & (expert_indices < num_experts)
  key = jnp.where(valid, expert_indices, num_experts).reshape(-1)
  order = jnp.argsort(key, stable=True)
  group_sizes = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
  return order, group_sizes, valid


def combine(out_rows, order, valid, expert_weights):
  """``y_t = sum_j expert_weights[t,j] * out_rows[pair (t, j)]`` float32 ``[T, D]``: the
  rows ``out_rows [T*k, D]`` in ``route``'s order, un-sorted and weighted."""
  t, k = valid.shape
  per_choice = out_rows[ref_gemm.inverse_permutation(order)].reshape(t, k, -1)  # token order
  # Masking the weights (not only the rows) keeps a non-finite weight of a dropped pair
  # out of the sum.
  weights = jnp.where(valid, expert_weights.astype(jnp.float32), 0.0)
  return jnp.einsum("tkd,tk->td", per_choice, weights, precision=matmul_precision(jnp.float32))


def moe_mlp(x, expert_indices, expert_weights, w_up, w_down, *, glu, activation):
  """``y_t = sum_j w[t,j] * (epilogue(x_t @ w_up[e]) @ w_down[e])``, ``e = idx[t,j]``.

  ``x [T, D]``, ``expert_indices [T, k]``, ``expert_weights [T, k]``, ``w_up [E, D, C]``,
  ``w_down [E, F, D]``; returns ``[T, D]`` in x's dtype. The hidden activations are
  rounded to x's dtype between the two GEMMs, as a fused kernel stores them; the down
  projection and the combine stay in float32.
  """
  order, group_sizes, valid = route(expert_indices, w_up.shape[0])
  rows = x[order // expert_indices.shape[1]]  # [T*k, D], sorted by expert
  hidden = ref_gemm.grouped_gemm(rows, w_up, group_sizes, activation=activation, glu=glu)
  out_rows = ref_gemm.grouped_gemm(hidden.astype(x.dtype), w_down, group_sizes)
  return combine(out_rows, order, valid, expert_weights).astype(x.dtype)
