"""KDA's intra-chunk stage as Pallas (Triton) kernels: the forward pass's stage, what
``reference.kda.intra`` computes, one program per chunk of one sequence and value head.

For one chunk of C tokens (q scaled, k and the cumulative log decays G ``[C, K]``, v
``[C, V]``, beta ``[C]``):

    A_ts = sum_k k_t[k] k_s[k] e^{G_t[k] - G_s[k]}  (s < t),  P_ts the same with q_t (s <= t)
    (I + beta A) [w | U] = [beta k e^G | beta v]
    qg = q e^G,   kd = k e^{G_C - G},   dec = e^{G_C}

Tokens t and s of different 16-token sub-blocks are paired through a reference token r
between them, the last token of the sub-block before t's: ``(k_t e^{G_t - G_r}) .
(k_s e^{G_r - G_s})``, both factors at most 1, as tensor-core products. Pairs inside a
sub-block take the same products (r the token before the sub-block; G_r = 0 for the
first) when the factor ``e^{G_r - G_s}``, now above 1, is at most ``e^span_limit`` for
every such pair of the BK columns at hand: the gates decay by at most ``span_limit`` over
a sub-block and the token before it, so that no factor leaves float32's or bfloat16's
range. Otherwise, they are summed directly, one column s at a time, each ``e^{G_t -
G_s}`` formed once for the k-k and the q-k pair (1.2 of the kernel's 2.6 ms at B=8 T=4096
H=16 K=V=128 on an H200; pairing them level by level as the reference does, as
tensor-core products, took 3.6 ms in all).
``I + beta A`` is inverted by doubling its inverted diagonal blocks, as the reference
does, with every product of that inverse in about float32 accuracy (three bfloat16
products per product). Every step reads BK columns of K (or V) at a time, so that its
operands stay in registers.

Below it, ``pairs`` and ``pairs_bwd``: the pair sums within sub-blocks that the backward
pass's hierarchy takes when the gates decay too fast for one product per sub-block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from cudnn_jax.reference import kda as ref

SUB = ref.SUB  # tokens per sub-block
BK = 32  # columns of K (and V) per step: [C, BK] float32 operands stay in registers
NUM_WARPS = 4  # fastest on an H200 at K = V = 128 (bench/kda.py --intra)
# Largest decay (natural log) over a sub-block and the token before it for which pairs
# inside sub-blocks are tensor-core products (see reference.kda).
SPAN_LIMIT = ref.SPAN_LIMIT
# Products of the inverse: the reference's are float32 (HIGHEST). Three bfloat16 products
# of the split operands keep about 16 bits of each, the rest being far below what the
# bfloat16 inputs carry; float32 inputs get the six-product split.
_SOLVE_PRECISION = {False: jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
                    True: jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6}


def _dot(a, b, precision, transpose_b=False):
  dims = (((1,), (1 if transpose_b else 0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, precision=precision,
                             preferred_element_type=jnp.float32)


def _rows_at(ref_, cs, blk, offset):
  """[C, len(cs)]: row t holds ``ref_[SUB * blk(t) + offset, cs]`` (blk [C, 1])."""
  out = None
  for i in range(ref_.shape[0] // SUB):
    row = ref_[pl.ds(SUB * i + offset, 1), cs]
    out = row if out is None else jnp.where(blk == i, row, out)
  return out


def _by_blocks(n, bk, body, init=None):
  """``body(cs, carry)`` over the column blocks ``cs`` (bk wide) of n columns, in order."""
  return jax.lax.fori_loop(
      0, n // bk, lambda i, x: body(pl.ds(pl.multiple_of(i * bk, bk), bk), x), init)


def _iota(c):
  rows = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0)
  return rows, jax.lax.broadcasted_iota(jnp.int32, (1, c), 1), rows // SUB


def _pair_sums(q_ref, k_ref, g_ref, cs, dt, span_limit, sums):
  """``sums`` plus the pair sums over the columns ``cs`` of K: ``(A, P, Ad, Pd)``, A and P
  ``[C, C]``, Ad and Pd ``[C, SUB]`` the pairs inside sub-blocks when summed directly
  (column j: the pair of token t with token j of its sub-block). A and P hold entries
  above their diagonals (A: on it too) that the caller masks out."""
  A, P, Ad, Pd = sums
  c = k_ref.shape[0]
  q, k, G = q_ref[:, cs], k_ref[:, cs], g_ref[:, cs]
  rows, _, blk = _iota(c)
  precision = ref.matmul_precision(dt)
  # G_r, r the token before each sub-block (G = 0 before the chunk), and whether every
  # pair inside a sub-block is a product of factors within e^span_limit.
  before = [jnp.zeros((1, G.shape[1]), jnp.float32)]
  before += [g_ref[pl.ds(SUB * i - 1, 1), cs] for i in range(1, c // SUB)]
  inside = False
  if span_limit is not None:
    span = functools.reduce(jnp.maximum, [
        jnp.max(gr - g_ref[pl.ds(SUB * i + SUB - 1, 1), cs]) for i, gr in enumerate(before)])
    inside = span <= span_limit

  # Through r (factors <= 1 for s before the sub-block; up to e^span_limit inside it).
  down = jnp.exp(G - jnp.where(blk == 0, 0.0, _rows_at(g_ref, cs, blk - 1, SUB - 1)))
  for i, gr in enumerate(before):
    # e^{G_r - G_s} for the tokens s paired through r, 0 for the others.
    paired = (rows < SUB * i) | (inside & (rows < SUB * (i + 1)))
    kr = (k * jnp.exp(jnp.where(paired, gr - G, -jnp.inf))).astype(dt)
    scaled = jnp.where(blk == i, down, 0.0)  # the rows of sub-block i
    A = A + _dot((k * scaled).astype(dt), kr, precision, transpose_b=True)
    P = P + _dot((q * scaled).astype(dt), kr, precision, transpose_b=True)

  # Otherwise summed directly: column j of every sub-block at once, one e^{G_t - G_s} for
  # the k-k and the q-k pair.
  j_cols = jax.lax.broadcasted_iota(jnp.int32, (1, SUB), 1)

  def column(j, inner):
    s = SUB * blk + j  # [C, 1]: the token row t pairs with
    e = jnp.exp(jnp.where(rows >= s, G - _rows_at(g_ref, cs, blk, j), -jnp.inf))
    ks_e = _rows_at(k_ref, cs, blk, j) * e
    at = j_cols == j
    kk = jnp.where(at & (rows > s), jnp.sum(k * ks_e, axis=1, keepdims=True), 0.0)
    return inner[0] + kk, inner[1] + jnp.where(at, jnp.sum(q * ks_e, axis=1, keepdims=True), 0.0)

  columns = lambda inner: jax.lax.fori_loop(0, SUB, column, inner)
  if span_limit is None:
    return A, P, *columns((Ad, Pd))
  return A, P, *jax.lax.cond(inside, lambda inner: inner, columns, (Ad, Pd))


def _column(Md, j):
  """Column j of ``Md [C, SUB]``: [C, 1]."""
  j_cols = jax.lax.broadcasted_iota(jnp.int32, (1, SUB), 1)
  return jnp.sum(jnp.where(j_cols == j, Md, 0.0), axis=1, keepdims=True)


def _on_diagonal_blocks(M, Md):
  """M plus ``Md [C, SUB]`` laid out on the diagonal sub-blocks: ``M[t, SUB blk(t) + j]
  += Md[t, j]``."""
  _, cols, blk = _iota(M.shape[0])
  for j in range(SUB):
    M = M + jnp.where(cols == SUB * blk + j, _column(Md, j), 0.0)
  return M


def _unit_lower_inverse(N, precision):
  """``(I + N)^-1`` for N ``[C, C]`` strictly lower: the inverted diagonal blocks of size h
  give those of size 2h as ``D - D Y D``, Y the lower-left h x h blocks of N's 2h-blocks."""
  c = N.shape[0]
  rows, cols, _ = _iota(c)
  D = None
  h = 1
  while h < c:
    lower_left = ((rows // (2 * h) == cols // (2 * h)) & ((rows // h) % 2 == 1)
                  & ((cols // h) % 2 == 0))
    Y = jnp.where(lower_left, N, 0.0)
    if D is None:  # the 1 x 1 blocks: D = I
      D = jnp.where(rows == cols, 1.0, 0.0) - Y
    else:
      D = D - _dot(D, _dot(Y, D, precision), precision)
    h *= 2
  return D


def _kernel(q_ref, k_ref, v_ref, g_ref, b_ref,
            w_ref, u_ref, p_ref, qg_ref, kd_ref, dec_ref, *, dt, bk, span_limit):
  c, kdim = k_ref.shape
  solve_precision = _SOLVE_PRECISION[jnp.dtype(dt) == jnp.float32]
  blocks = functools.partial(_by_blocks, bk=bk)

  square, inner = jnp.zeros((c, c), jnp.float32), jnp.zeros((c, SUB), jnp.float32)
  pair_sums = lambda cs, sums: _pair_sums(q_ref, k_ref, g_ref, cs, dt, span_limit, sums)
  A, P, Ad, Pd = blocks(kdim, body=pair_sums, init=(square, square, inner, inner))
  rows, cols, _ = _iota(c)
  A = jnp.where(rows > cols, _on_diagonal_blocks(A, Ad), 0.0)
  P = jnp.where(rows >= cols, _on_diagonal_blocks(P, Pd), 0.0)
  p_ref[...] = P
  b = b_ref[...][:, None]
  D = _unit_lower_inverse(b * A, solve_precision)

  def per_k_block(cs, _):
    G, k = g_ref[:, cs], k_ref[:, cs]
    eG = jnp.exp(G)
    g_last = g_ref[pl.ds(c - 1, 1), cs]
    w_ref[:, cs] = _dot(D, b * k * eG, solve_precision)
    qg_ref[:, cs] = q_ref[:, cs] * eG
    kd_ref[:, cs] = k * jnp.exp(g_last - G)
    dec_ref[:, cs] = jnp.exp(g_last)

  def per_v_block(cs, _):
    u_ref[:, cs] = _dot(D, b * v_ref[:, cs], solve_precision)

  blocks(kdim, body=per_k_block)
  blocks(v_ref.shape[1], body=per_v_block)


def _per_chunk(kernel, operands, out_shapes, *, dt, bk, interpret, num_warps):
  """``kernel`` (dt and bk bound) over the chunks of ``operands`` ``[..., C, *]`` (the
  leading axes those of the first), one program each; float32 outputs ``[n, *shape]``."""
  kdim, vdim = operands[0].shape[-1], operands[2].shape[-1]  # q, k, v, ...
  bk = min(bk, kdim, vdim)
  if kdim % bk or vdim % bk:
    raise ValueError(f"K={kdim} and V={vdim} must be multiples of bk={bk}")
  lead = operands[0].ndim - 2
  flat = [z.reshape(-1, *z.shape[lead:]) for z in operands]
  count = flat[0].shape[0]
  spec = lambda shape: pl.BlockSpec((None,) + shape, lambda i: (i,) + (0,) * len(shape))
  return pl.pallas_call(
      functools.partial(kernel, dt=dt, bk=bk), grid=(count,),
      in_specs=[spec(z.shape[1:]) for z in flat],
      out_specs=[spec(shape) for shape in out_shapes],
      out_shape=[jax.ShapeDtypeStruct((count,) + shape, jnp.float32) for shape in out_shapes],
      interpret=interpret,
      compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=1))(*flat)


@functools.partial(jax.jit, static_argnames=("dt", "interpret", "num_warps", "bk", "span_limit"))
def intra(q, k, v, G, b, dt, *, interpret=False, num_warps=NUM_WARPS, bk=BK,
          span_limit=SPAN_LIMIT):
  """``reference.kda.Intra`` (float32) of chunks ``[..., C, D]``: q, k, G ``[..., C, K]``
  (G per channel), v ``[..., C, V]``, b (beta) ``[..., C, 1]``, all float32; ``dt`` the
  pair products' operand dtype. C a power of two, K and V multiples of ``bk`` (at most
  BK), C and ``bk`` at least 16. ``span_limit``: see the module's docstring (None: pairs
  inside sub-blocks always summed directly)."""
  lead, (c, kdim), vdim = q.shape[:-2], q.shape[-2:], v.shape[-1]
  shapes = [(c, kdim), (c, vdim), (c, c), (c, kdim), (c, kdim), (1, kdim)]
  kernel = functools.partial(_kernel, span_limit=span_limit)
  outs = _per_chunk(kernel, (q, k, v, G, b[..., 0]), shapes, dt=dt, bk=bk,
                    interpret=interpret, num_warps=num_warps)
  w, U, P, qg, kd, dec = (o.reshape(*lead, *o.shape[1:]) for o in outs)
  return ref.Intra(w=w, U=U, P=P, qg=qg, kd=kd, dec=dec[..., 0, :])


# ---------------------------------------------------------------------------------------
# The pair sums within 16-token sub-blocks, forward and backward, for the backward pass's
# hierarchy (``reference.kda.leaf_pairs`` and ``leaf_pairs_grads``) when the gates decay
# too fast for one product per sub-block.
#
# For x, y, G ``[..., n, K]`` (n tokens of one sub-block, G non-increasing along them):
#
#     M_ts  = sum_k x_t[k] y_s[k] e^{G_t[k] - G_s[k]}   (s < t; 0 elsewhere)
#     dx_t  = sum_s dM_ts y_s e^{G_t - G_s},   dy_s = sum_t dM_ts x_t e^{G_t - G_s}
#
# One program per sub-block walks its n columns s, forming ``e^{G_t - G_s}`` for all t at
# once (exponents <= 0 where kept, so exact in float32 and never overflowing), where the
# XLA form needs two more levels of tiny [4, K] and [1, K] products.

# Warps per program, forward and backward: the fastest on an H200 at K = 128 (forward
# 0.85 ms against 1.0-1.5 with 1, 2 or 4 warps; backward 0.94 against 1.1-1.9), where
# giving a program several sub-blocks was no faster.
PAIRS_WARPS, PAIRS_BWD_WARPS = 8, 2


def _decays(g_ref, G, rows, s):
  """``e^{G_t - G_s}`` for the rows t > s, 0 for the others: [n, K]."""
  return jnp.exp(jnp.where(rows > s, G - g_ref[pl.ds(s, 1), :], -jnp.inf))


def _pairs_kernel(x_ref, y_ref, g_ref, m_ref):
  n = x_ref.shape[0]
  x, G = x_ref[...].astype(jnp.float32), g_ref[...]
  rows = jax.lax.broadcasted_iota(jnp.int32, (n, 1), 0)
  cols = jax.lax.broadcasted_iota(jnp.int32, (1, n), 1)

  def column(s, M):
    ys = y_ref[pl.ds(s, 1), :].astype(jnp.float32)
    m = jnp.sum(x * ys * _decays(g_ref, G, rows, s), axis=1, keepdims=True)  # [n, 1]
    return M + jnp.where(cols == s, m, 0.0)

  m_ref[...] = jax.lax.fori_loop(0, n, column, jnp.zeros((n, n), jnp.float32))


def _pairs_bwd_kernel(dm_ref, x_ref, y_ref, g_ref, dx_ref, dy_ref):
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


def _per_sub_block(kernel, operands, out_shapes, interpret, num_warps):
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
def pairs(x, y, G, *, interpret=False, num_warps=PAIRS_WARPS):
  """``M [..., n, n]`` float32 (products in float32)."""
  n = G.shape[-2]
  return _per_sub_block(_pairs_kernel, (x, y, G), [(n, n)], interpret, num_warps)[0]


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps"))
def pairs_bwd(dM, x, y, G, *, interpret=False, num_warps=PAIRS_BWD_WARPS):
  """``(dx, dy)`` [..., n, K] float32 (G's gradient follows: ``x dx - y dy``)."""
  return tuple(_per_sub_block(_pairs_bwd_kernel, (dM, x, y, G), [x.shape[-2:]] * 2, interpret, num_warps))
