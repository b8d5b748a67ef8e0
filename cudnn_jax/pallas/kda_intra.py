"""KDA's intra-chunk stage of the forward pass as one Pallas (Triton) kernel: what
``reference.kda._intra`` computes, one program per chunk of one sequence and value head.

For one chunk of C tokens (q scaled, k and the cumulative log decays G ``[C, K]``, v
``[C, V]``, beta ``[C]``):

    A_ts = sum_k k_t[k] k_s[k] e^{G_t[k] - G_s[k]}  (s < t),  P_ts the same with q_t (s <= t)
    (I + beta A) [w | U] = [beta k e^G | beta v]
    qg = q e^G,   kd = k e^{G_C - G},   dec = e^{G_C}

Tokens t and s of different 16-token sub-blocks are paired through a reference token r
between them, the last token of the sub-block before t's: ``(k_t e^{G_t - G_r}) .
(k_s e^{G_r - G_s})``, both factors at most 1, as tensor-core products. Pairs inside a
sub-block are summed directly, one column s at a time, each ``e^{G_t - G_s}`` formed once
for the k-k and the q-k pair. ``I + beta A`` is inverted by doubling its inverted diagonal
blocks, as the reference does, with every product of that inverse in about float32
accuracy (three bfloat16 products per product).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from cudnn_jax.reference import kda as ref

SUB = 16  # tokens per sub-block
NUM_WARPS = 8
# Products of the inverse: the reference's are float32 (HIGHEST). Three bfloat16 products
# of the split operands keep about 16 bits of each, the rest being far below what the
# bfloat16 inputs carry; float32 inputs get the six-product split.
_SOLVE_PRECISION = {False: jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
                    True: jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6}


def _dot(a, b, precision, transpose_b=False):
  dims = (((1,), (1 if transpose_b else 0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, precision=precision,
                             preferred_element_type=jnp.float32)


def _rows_at(ref_, blk, offset):
  """[C, D]: row t holds ``ref_[SUB * blk(t) + offset]``, a row of t's own sub-block."""
  out = None
  for i in range(ref_.shape[0] // SUB):
    row = ref_[pl.ds(SUB * i + offset, 1), :]
    out = row if out is None else jnp.where(blk == i, row, out)
  return out


def _kernel(q_ref, k_ref, v_ref, g_ref, b_ref,
            w_ref, u_ref, p_ref, qg_ref, kd_ref, dec_ref, *, dt):
  c = k_ref.shape[0]
  exact = jnp.dtype(dt) == jnp.float32
  pair_precision = ref.matmul_precision(dt)
  solve_precision = _SOLVE_PRECISION[exact]
  q, k, G = q_ref[...], k_ref[...], g_ref[...]
  rows = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0)
  cols = jax.lax.broadcasted_iota(jnp.int32, (1, c), 1)
  blk = rows // SUB

  # Pairs across sub-blocks, through r = the last token before t's sub-block. Rows of the
  # first sub-block have no such pairs (their reference is themselves, then masked).
  Gr = jnp.where(blk == 0, G, _rows_at(g_ref, blk - 1, SUB - 1)) if c > SUB else G
  down = jnp.exp(G - Gr)  # e^{G_t - G_r} <= 1
  kl, ql = (k * down).astype(dt), (q * down).astype(dt)
  A = jnp.zeros((c, c), jnp.float32)
  P = jnp.zeros((c, c), jnp.float32)
  for i in range(1, c // SUB):
    gr = g_ref[pl.ds(SUB * i - 1, 1), :]
    # e^{G_r - G_s} <= 1 for the tokens s before sub-block i, 0 for the others.
    kr = (k * jnp.exp(jnp.where(rows < SUB * i, gr - G, -jnp.inf))).astype(dt)
    A = A + jnp.where(blk == i, _dot(kl, kr, pair_precision, transpose_b=True), 0.0)
    P = P + jnp.where(blk == i, _dot(ql, kr, pair_precision, transpose_b=True), 0.0)

  # Pairs inside a sub-block: column j of every sub-block at once.
  def column(j, AP):
    A, P = AP
    s = SUB * blk + j  # [C, 1]: the column row t pairs with
    e = jnp.exp(jnp.where(rows >= s, G - _rows_at(g_ref, blk, j), -jnp.inf))
    ks_e = _rows_at(k_ref, blk, j) * e
    kk = jnp.sum(k * ks_e, axis=1, keepdims=True)
    qk = jnp.sum(q * ks_e, axis=1, keepdims=True)
    at = cols == s
    return (A + jnp.where(at & (rows > s), kk, 0.0), P + jnp.where(at, qk, 0.0))

  A, P = jax.lax.fori_loop(0, SUB, column, (A, P))

  # (I + N)^-1, N = beta A strictly lower: the inverted diagonal blocks of size h give
  # those of size 2h as D - D Y D, Y the lower-left h x h blocks of N's 2h-blocks.
  b = b_ref[...][:, None]
  N = b * A
  D = None
  h = 1
  while h < c:
    lower_left = ((rows // (2 * h) == cols // (2 * h)) & ((rows // h) % 2 == 1)
                  & ((cols // h) % 2 == 0))
    Y = jnp.where(lower_left, N, 0.0)
    if D is None:  # the 1 x 1 blocks: D = I
      D = jnp.where(rows == cols, 1.0, 0.0) - Y
    else:
      D = D - _dot(D, _dot(Y, D, solve_precision), solve_precision)
    h *= 2

  eG = jnp.exp(G)
  w_ref[...] = _dot(D, b * k * eG, solve_precision)
  u_ref[...] = _dot(D, b * v_ref[...], solve_precision)
  p_ref[...] = P
  qg_ref[...] = q * eG
  g_last = g_ref[pl.ds(c - 1, 1), :]
  kd_ref[...] = k * jnp.exp(g_last - G)
  dec_ref[...] = jnp.exp(g_last)


@functools.partial(jax.jit, static_argnames=("dt", "interpret", "num_warps"))
def intra(q, k, v, G, b, dt, *, interpret=False, num_warps=NUM_WARPS):
  """``reference.kda.Intra`` (float32) of chunks ``[..., C, D]``: q, k, G ``[..., C, K]``
  (G per channel), v ``[..., C, V]``, b (beta) ``[..., C, 1]``, all float32; ``dt`` the
  pair products' operand dtype. C and K multiples of 16, C a power of two."""
  lead, (c, kdim), vdim = q.shape[:-2], q.shape[-2:], v.shape[-1]
  flat = [z.reshape(-1, *z.shape[-2:]) for z in (q, k, v, G)] + [b.reshape(-1, c)]
  count = flat[0].shape[0]
  spec = lambda *shape: pl.BlockSpec((None,) + shape, lambda i: (i,) + (0,) * len(shape))
  shapes = [(c, kdim), (c, vdim), (c, c), (c, kdim), (c, kdim), (1, kdim)]
  outs = pl.pallas_call(
      functools.partial(_kernel, dt=dt), grid=(count,),
      in_specs=[spec(c, kdim), spec(c, kdim), spec(c, vdim), spec(c, kdim), spec(c)],
      out_specs=[spec(*shape) for shape in shapes],
      out_shape=[jax.ShapeDtypeStruct((count,) + shape, jnp.float32) for shape in shapes],
      interpret=interpret,
      compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=1))(*flat)
  w, U, P, qg, kd, dec = (o.reshape(*lead, *o.shape[1:]) for o in outs)
  return ref.Intra(w=w, U=U, P=P, qg=qg, kd=kd, dec=dec[..., 0, :])
