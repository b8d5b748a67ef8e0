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
accuracy (three bfloat16 products per product). Every step reads BK columns of K (or V)
at a time, so that its operands stay in registers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from cudnn_jax.reference import kda as ref

SUB = 16  # tokens per sub-block
BK = 32  # columns of K (and V) per step: [C, BK] float32 operands stay in registers
NUM_WARPS = 4  # fastest on an H200 at K = V = 128 (bench/kda.py --intra)
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
  """[C, len(cs)]: row t holds ``ref_[SUB * blk(t) + offset, cs]``."""
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


def _pair_sums(q_ref, k_ref, g_ref, cs, dt, sums):
  """``sums`` plus the pair sums over the columns ``cs`` of K: ``(A, P, Ad, Pd)``, A and P
  ``[C, C]`` the pairs of different sub-blocks, Ad and Pd ``[C, SUB]`` those inside them
  (column j: the pair of token t with token j of its sub-block). P and Pd None: k-k only."""
  A, P, Ad, Pd = sums
  with_q = P is not None
  c = k_ref.shape[0]
  q, k, G = q_ref[:, cs], k_ref[:, cs], g_ref[:, cs]
  rows, _, blk = _iota(c)
  precision = ref.matmul_precision(dt)

  # Different sub-blocks, through r = the last token before t's sub-block (factors <= 1).
  down = jnp.exp(G - _rows_at(g_ref, cs, blk - 1, SUB - 1))  # e^{G_t - G_r}; t >= SUB
  for i in range(1, c // SUB):
    gr = g_ref[pl.ds(SUB * i - 1, 1), cs]
    # e^{G_r - G_s} for the tokens s before sub-block i, 0 for the others.
    kr = (k * jnp.exp(jnp.where(rows < SUB * i, gr - G, -jnp.inf))).astype(dt)
    scaled = jnp.where(blk == i, down, 0.0)  # the rows of sub-block i
    A = A + _dot((k * scaled).astype(dt), kr, precision, transpose_b=True)
    if with_q:
      P = P + _dot((q * scaled).astype(dt), kr, precision, transpose_b=True)

  # Inside a sub-block, summed directly: column j of every sub-block at once, one
  # e^{G_t - G_s} for the k-k and the q-k pair.
  j_cols = jax.lax.broadcasted_iota(jnp.int32, (1, SUB), 1)

  def column(j, inner):
    s = SUB * blk + j  # [C, 1]: the token row t pairs with
    e = jnp.exp(jnp.where(rows >= s, G - _rows_at(g_ref, cs, blk, j), -jnp.inf))
    ks_e = _rows_at(k_ref, cs, blk, j) * e
    at = j_cols == j
    kk = jnp.where(at & (rows > s), jnp.sum(k * ks_e, axis=1, keepdims=True), 0.0)
    if not with_q:
      return inner[0] + kk, None
    return inner[0] + kk, inner[1] + jnp.where(at, jnp.sum(q * ks_e, axis=1, keepdims=True), 0.0)

  Ad, Pd = jax.lax.fori_loop(0, SUB, column, (Ad, Pd))
  return A, P, Ad, Pd


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


def _diagonal_blocks(M):
  """``Md [C, SUB]``, ``Md[t, j] = M[t, SUB blk(t) + j]``: M's diagonal sub-blocks."""
  _, cols, blk = _iota(M.shape[0])
  j_cols = jax.lax.broadcasted_iota(jnp.int32, (1, SUB), 1)
  Md = jnp.zeros((M.shape[0], SUB), jnp.float32)
  for j in range(SUB):
    column = jnp.sum(jnp.where(cols == SUB * blk + j, M, 0.0), axis=1, keepdims=True)
    Md = Md + jnp.where(j_cols == j, column, 0.0)
  return Md


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
            w_ref, u_ref, p_ref, qg_ref, kd_ref, dec_ref, *, dt, bk):
  c, kdim = k_ref.shape
  solve_precision = _SOLVE_PRECISION[jnp.dtype(dt) == jnp.float32]
  blocks = functools.partial(_by_blocks, bk=bk)

  square, inner = jnp.zeros((c, c), jnp.float32), jnp.zeros((c, SUB), jnp.float32)
  pair_sums = lambda cs, sums: _pair_sums(q_ref, k_ref, g_ref, cs, dt, sums)
  A, P, Ad, Pd = blocks(kdim, body=pair_sums, init=(square, square, inner, inner))
  A, P = _on_diagonal_blocks(A, Ad), _on_diagonal_blocks(P, Pd)
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


@functools.partial(jax.jit, static_argnames=("dt", "interpret", "num_warps", "bk"))
def intra(q, k, v, G, b, dt, *, interpret=False, num_warps=NUM_WARPS, bk=BK):
  """``reference.kda.Intra`` (float32) of chunks ``[..., C, D]``: q, k, G ``[..., C, K]``
  (G per channel), v ``[..., C, V]``, b (beta) ``[..., C, 1]``, all float32; ``dt`` the
  pair products' operand dtype. C a power of two, K and V multiples of ``bk`` (at most
  BK), C and ``bk`` at least 16."""
  lead, (c, kdim), vdim = q.shape[:-2], q.shape[-2:], v.shape[-1]
  shapes = [(c, kdim), (c, vdim), (c, c), (c, kdim), (c, kdim), (1, kdim)]
  outs = _per_chunk(_kernel, (q, k, v, G, b[..., 0]), shapes, dt=dt, bk=bk,
                    interpret=interpret, num_warps=num_warps)
  w, U, P, qg, kd, dec = (o.reshape(*lead, *o.shape[1:]) for o in outs)
  return ref.Intra(w=w, U=U, P=P, qg=qg, kd=kd, dec=dec[..., 0, :])


# ---------------------------------------------------------------------------------------
# The backward pass of the stage. With D = (I + N)^-1, N = beta A, R1 = beta k e^G, R2 =
# beta v (so w = D R1, U = D R2):
#   dR1 = D^T dw, dR2 = D^T dU, dN = -strict_lower(dR1 w^T + dR2 U^T), dA = beta dN,
# and a pair matrix M_ts = sum x_t y_s e^{G_t - G_s} with cotangent W gives
#   dx_t = sum_s W_ts y_s e^{G_t - G_s} ("rows"), dy_s = sum_t W_ts x_t e^{G_t - G_s}
#   ("cols"), dG = x dx - y dy.


def _pair_grads(y, G, y_ref, g_ref, cs, pairs, dt):
  """("rows", "cols") over the columns ``cs`` of K for each ``(x, x_ref, W, Wd, Wtd)`` of
  ``pairs``: the pair matrix of x and the shared y, its cotangent ``W [C, C]`` (lower
  triangular), the diagonal sub-blocks of W and of W^T (``_diagonal_blocks``). The decay
  factors are formed once for all pairs."""
  c = G.shape[0]
  rows, cols, blk = _iota(c)
  precision = ref.matmul_precision(dt)
  down = jnp.exp(G - _rows_at(g_ref, cs, blk - 1, SUB - 1))  # e^{G_t - G_r}; t >= SUB
  zeros = jnp.zeros(G.shape, jnp.float32)
  grads = [(zeros, zeros)] * len(pairs)
  for i in range(1, c // SUB):
    gr = g_ref[pl.ds(SUB * i - 1, 1), cs]
    up = jnp.exp(jnp.where(rows < SUB * i, gr - G, -jnp.inf))  # e^{G_r - G_s}, s < SUB i
    y_up = (y * up).astype(dt)
    down_i = jnp.where(blk == i, down, 0.0)
    for n, (x, _, W, _, _) in enumerate(pairs):
      Wi = jnp.where((blk == i) & (cols < SUB * i), W, 0.0).astype(dt)
      x_down = (x * down_i).astype(dt)
      W_x = jax.lax.dot_general(Wi, x_down, (((0,), (0,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32)  # Wi^T (x down)
      grads[n] = (grads[n][0] + down_i * _dot(Wi, y_up, precision), grads[n][1] + up * W_x)

  # Inside sub-blocks: token t with s = SUB blk(t) + j (t >= s) for "rows", and token s
  # with t = SUB blk(s) + j (t >= s) for "cols".
  def column(j, grads):
    pos = SUB * blk + j
    Gj = _rows_at(g_ref, cs, blk, j)
    y_after = _rows_at(y_ref, cs, blk, j) * jnp.exp(jnp.where(rows >= pos, G - Gj, -jnp.inf))
    before = jnp.exp(jnp.where(rows <= pos, Gj - G, -jnp.inf))  # e^{G_pos - G_s}
    return [(dx + _column(Wd, j) * y_after,
             dy + _column(Wtd, j) * _rows_at(x_ref, cs, blk, j) * before)
            for (dx, dy), (_, x_ref, _, Wd, Wtd) in zip(grads, pairs)]

  return jax.lax.fori_loop(0, SUB, column, grads)


def _bwd_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, dw_ref, du_ref, dp_ref, dqg_ref, dkd_ref,
                ddec_ref, dq_ref, dk_ref, dv_ref, dg_ref, db_ref, *, dt, bk):
  c, kdim = k_ref.shape
  rows, cols, _ = _iota(c)
  solve_precision = _SOLVE_PRECISION[jnp.dtype(dt) == jnp.float32]
  dot_t = lambda a, b: jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())),
                                           precision=solve_precision,
                                           preferred_element_type=jnp.float32)  # a^T b
  blocks = functools.partial(_by_blocks, bk=bk)
  b = b_ref[...][:, None]

  # The forward's A and inverse, recomputed.
  square, inner = jnp.zeros((c, c), jnp.float32), jnp.zeros((c, SUB), jnp.float32)
  pair_sums = lambda cs, sums: _pair_sums(q_ref, k_ref, g_ref, cs, dt, sums)
  A, _, Ad, _ = blocks(kdim, body=pair_sums, init=(square, None, inner, None))
  A = _on_diagonal_blocks(A, Ad)
  D = _unit_lower_inverse(b * A, solve_precision)

  # dR1 w^T + dR2 U^T, over K and V; dv and beta's share from R2 on the way.
  def k_outer(cs, S):
    R1 = b * k_ref[:, cs] * jnp.exp(g_ref[:, cs])
    dR1 = dot_t(D, dw_ref[:, cs])
    return S + _dot(dR1, _dot(D, R1, solve_precision), solve_precision, transpose_b=True)

  def v_outer(cs, carry):
    S, db = carry
    v = v_ref[:, cs]
    dR2 = dot_t(D, du_ref[:, cs])
    dv_ref[:, cs] = b * dR2
    U = _dot(D, b * v, solve_precision)
    return (S + _dot(dR2, U, solve_precision, transpose_b=True),
            db + jnp.sum(v * dR2, axis=1, keepdims=True))

  S = blocks(kdim, body=k_outer, init=square)
  S, db = blocks(v_ref.shape[1], body=v_outer, init=(S, jnp.zeros((c, 1), jnp.float32)))
  dN = jnp.where(rows > cols, -S, 0.0)
  db = db + jnp.sum(dN * A, axis=1, keepdims=True)
  WA = b * dN
  WP = jnp.where(rows >= cols, dp_ref[...], 0.0)
  WAd, WAtd = _diagonal_blocks(WA), _diagonal_blocks(WA.T)
  WPd, WPtd = _diagonal_blocks(WP), _diagonal_blocks(WP.T)

  def per_k_block(cs, db):
    q, k, G = q_ref[:, cs], k_ref[:, cs], g_ref[:, cs]
    eG = jnp.exp(G)
    g_last = g_ref[pl.ds(c - 1, 1), cs]
    decay = jnp.exp(g_last - G)  # e^{G_C - G}
    dR1 = dot_t(D, dw_ref[:, cs])
    dqg, dkd = dqg_ref[:, cs], dkd_ref[:, cs]
    (rows_a, cols_a), (rows_p, cols_p) = _pair_grads(
        k, G, k_ref, g_ref, cs, [(k, k_ref, WA, WAd, WAtd), (q, q_ref, WP, WPd, WPtd)], dt)
    dq_ref[:, cs] = eG * dqg + rows_p
    dk_ref[:, cs] = b * eG * dR1 + decay * dkd + rows_a + cols_a + cols_p
    kd_dkd = k * decay * dkd
    last = jnp.sum(kd_dkd, axis=0, keepdims=True) + jnp.exp(g_last) * ddec_ref[:, cs]
    dg_ref[:, cs] = (b * k * eG * dR1 + q * eG * dqg - kd_dkd + k * (rows_a - cols_a)
                     + q * rows_p - k * cols_p + jnp.where(rows == c - 1, last, 0.0))
    return db + jnp.sum(k * eG * dR1, axis=1, keepdims=True)

  db_ref[...] = blocks(kdim, body=per_k_block, init=db)[:, 0]


@functools.partial(jax.jit, static_argnames=("dt", "interpret", "num_warps", "bk"))
def intra_bwd(q, k, v, G, b, d, dt, *, interpret=False, num_warps=NUM_WARPS, bk=BK):
  """The VJP of ``intra``: ``(dq, dk, dv, dG, db)`` (float32, shaped like q, k, v, G, b) for
  the cotangent ``d`` (a ``reference.kda.Intra``; P's upper triangle is ignored)."""
  (c, kdim), vdim = q.shape[-2:], v.shape[-1]
  out_shapes = [(c, kdim), (c, kdim), (c, vdim), (c, kdim), (c,)]
  outs = _per_chunk(_bwd_kernel, (q, k, v, G, b[..., 0], d.w, d.U, d.P, d.qg, d.kd,
                                  d.dec[..., None, :]),
                    out_shapes, dt=dt, bk=bk, interpret=interpret, num_warps=num_warps)
  dq, dk, dv, dG, db = outs
  return (dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), dG.reshape(G.shape),
          db.reshape(b.shape))
