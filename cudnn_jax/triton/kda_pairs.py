"""KDA's pair sums within 16-token sub-blocks, forward and backward, as Pallas (Triton)
kernels: ``reference.kda.leaf_pairs`` and ``leaf_pairs_grads``.

For x, y, G ``[..., n, K]`` (n tokens of one sub-block, G non-increasing along them):

    M_ts  = sum_k x_t[k] y_s[k] e^{G_t[k] - G_s[k]}   (s < t; 0 elsewhere)
    dx_t  = sum_s dM_ts y_s e^{G_t - G_s},   dy_s = sum_t dM_ts x_t e^{G_t - G_s}

One program per sub-block walks its n columns s, forming ``e^{G_t - G_s}`` for all t at
once (exponents <= 0 where kept, so exact in float32 and never overflowing), where the
XLA form needs two more levels of tiny [4, K] and [1, K] products.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

# Warps per program, forward and backward: the fastest on an H200 at K = 128 (forward
# 0.85 ms against 1.0-1.5 with 1, 2 or 4 warps; backward 0.94 against 1.1-1.9), where
# giving a program several sub-blocks was no faster.
FWD_WARPS, BWD_WARPS = 8, 2


def _decays(g_ref, G, rows, s):
  """``e^{G_t - G_s}`` for the rows t > s, 0 for the others: [n, K]."""
  return jnp.exp(jnp.where(rows > s, G - g_ref[pl.ds(s, 1), :], -jnp.inf))


def _fwd_kernel(x_ref, y_ref, g_ref, m_ref):
  n = x_ref.shape[0]
  x, G = x_ref[...].astype(jnp.float32), g_ref[...]
  rows = jax.lax.broadcasted_iota(jnp.int32, (n, 1), 0)
  cols = jax.lax.broadcasted_iota(jnp.int32, (1, n), 1)

  def column(s, M):
    ys = y_ref[pl.ds(s, 1), :].astype(jnp.float32)
    m = jnp.sum(x * ys * _decays(g_ref, G, rows, s), axis=1, keepdims=True)  # [n, 1]
    return M + jnp.where(cols == s, m, 0.0)

  m_ref[...] = jax.lax.fori_loop(0, n, column, jnp.zeros((n, n), jnp.float32))


def _bwd_kernel(dm_ref, x_ref, y_ref, g_ref, dx_ref, dy_ref):
  n = x_ref.shape[0]
  x, G = x_ref[...].astype(jnp.float32), g_ref[...]
  rows = jax.lax.broadcasted_iota(jnp.int32, (n, 1), 0)

  def column(s, carry):
    dx, dy = carry
    w = dm_ref[:, pl.ds(s, 1)] * _decays(g_ref, G, rows, s)  # dM_ts e^{G_t - G_s}: [n, K]
    dx = dx + w * y_ref[pl.ds(s, 1), :].astype(jnp.float32)
    dy = dy + jnp.where(rows == s, jnp.sum(w * x, axis=0, keepdims=True), 0.0)
    return dx, dy

  zeros = jnp.zeros(x.shape, jnp.float32)
  dx_ref[...], dy_ref[...] = jax.lax.fori_loop(0, n, column, (zeros, zeros))


def _call(kernel, operands, out_shapes, interpret, num_warps):
  """``kernel`` over the sub-blocks of ``operands`` ([..., n, *]), one program each."""
  lead = operands[0].shape[:-2]
  flat = [z.reshape(-1, *z.shape[-2:]) for z in operands]
  spec = lambda shape: pl.BlockSpec((None,) + shape, lambda i: (i, 0, 0))
  outs = pl.pallas_call(
      kernel, grid=(flat[0].shape[0],),
      in_specs=[spec(z.shape[1:]) for z in flat],
      out_specs=[spec(shape) for shape in out_shapes],
      out_shape=[jax.ShapeDtypeStruct((flat[0].shape[0],) + shape, jnp.float32)
                 for shape in out_shapes],
      interpret=interpret,
      compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=1))(*flat)
  return [o.reshape(*lead, *o.shape[1:]) for o in outs]


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps"))
def pairs(x, y, G, *, interpret=False, num_warps=FWD_WARPS):
  """``M [..., n, n]`` float32 (products in float32)."""
  n = G.shape[-2]
  return _call(_fwd_kernel, (x, y, G), [(n, n)], interpret, num_warps)[0]


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps"))
def pairs_bwd(dM, x, y, G, *, interpret=False, num_warps=BWD_WARPS):
  """``(dx, dy)`` [..., n, K] float32 (G's gradient follows: ``x dx - y dy``)."""
  return tuple(_call(_bwd_kernel, (dM, x, y, G), [x.shape[-2:]] * 2, interpret, num_warps))
