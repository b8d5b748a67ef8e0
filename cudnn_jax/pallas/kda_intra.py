"""KDA's intra-chunk stage as one Pallas (Triton) kernel per chunk and head.

For one chunk of C = 64 tokens with per-channel cumulative log decay ``G [C, K]``:

    A_ts = beta_t sum_k k_t k_s e^{G_t - G_s}   (s < t)       L = I + A
    P_ts = sum_k q_t k_s e^{G_t - G_s}           (s <= t)
    w = L^-1 (beta k e^G),   U = L^-1 (beta v)

the quantities of ``reference.kda._intra`` that need pair sums or the inverse; the
elementwise rest stays in XLA. The chunk is cut into four 16-token sub-blocks. Sub-block i
meets an earlier sub-block j through the first token r of i, ``(x_t e^{G_t - G_r}) .
(k_s e^{G_r - G_s})``, both exponents <= 0 (G is non-increasing); the 16 x 16 diagonal
blocks are summed pair by pair. L^-1 inverts the diagonal blocks by substitution and builds
the rest block by block: ``X_ij = -X_ii sum_{j <= m < i} L_im X_mj``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

SUB = 16  # sub-block tokens (the smallest tensor-core dot)
# A program keeps about sixteen [16, 128] float32 blocks live (k, G, beta k e^G, beta v per
# sub-block): eight warps hold them in about 128 registers a thread.
NUM_WARPS = 8
_HIGHEST = jax.lax.Precision.HIGHEST


def _dot(x, y, trans_b=False):
  """float32 product (exact float32 operands)."""
  if trans_b:
    y = y.T
  return jnp.dot(x, y, precision=_HIGHEST, preferred_element_type=jnp.float32)


def _rows(ref, i):
  """Sub-block i of a [C, D] ref as float32 [SUB, D]."""
  return ref[pl.ds(i * SUB, SUB), :].astype(jnp.float32)


def _diagonal_pairs(x, y_ref, g_ref, i, inclusive):
  """``M_ts = sum_k x_t y_s e^{G_t - G_s}`` within sub-block i (s < t, or s <= t)."""
  g = _rows(g_ref, i)
  t = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
  s_col = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
  row = jax.lax.broadcasted_iota(jnp.int32, (SUB, 1), 0)
  m = jnp.zeros((SUB, SUB), jnp.float32)
  for s in range(SUB):
    y_s = y_ref[pl.ds(i * SUB + s, 1), :].astype(jnp.float32)  # [1, K]
    g_s = g_ref[pl.ds(i * SUB + s, 1), :].astype(jnp.float32)
    keep = (row >= s) if inclusive else (row > s)  # [SUB, 1]
    decay = jnp.exp(jnp.where(keep, g - g_s, 0.0))  # masked first: no overflow above
    col = jnp.sum(x * y_s * decay, axis=1, keepdims=True)  # [SUB, 1]
    m = jnp.where((s_col == s) & ((t >= s) if inclusive else (t > s)), col, m)
  return m


def _unit_lower_inverse_block(l):
  """Inverse of a unit lower-triangular [SUB, SUB] block by forward substitution."""
  r_idx = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
  c_idx = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
  x = (r_idx == c_idx).astype(jnp.float32)
  for r in range(1, SUB):
    l_row = jnp.sum(jnp.where((r_idx == r) & (c_idx < r), l, 0.0), axis=0)  # [SUB] over c
    contrib = jnp.sum(l_row[:, None] * x, axis=0)  # sum_c L_rc X_c,: (rows c < r final)
    x = jnp.where(r_idx == r, x - contrib[None, :], x)
  return x


def _kernel(q_ref, k_ref, v_ref, g_ref, b_ref, w_ref, u_ref, p_ref):
  n = k_ref.shape[0] // SUB
  ks = [_rows(k_ref, i) for i in range(n)]
  gs = [_rows(g_ref, i) for i in range(n)]
  bs = [b_ref[pl.ds(i * SUB, SUB), :].astype(jnp.float32) for i in range(n)]  # [SUB, 1]

  # Pair sums, block by block: A (k-k, strict) and P (q-k, inclusive).
  a = [[None] * n for _ in range(n)]
  p = [[None] * n for _ in range(n)]
  for i in range(n):
    qi = _rows(q_ref, i)
    ref = g_ref[pl.ds(i * SUB, 1), :].astype(jnp.float32)  # the first token of sub-block i
    ki_r, qi_r = ks[i] * jnp.exp(gs[i] - ref), qi * jnp.exp(gs[i] - ref)
    for j in range(i):
      kj_r = ks[j] * jnp.exp(ref - gs[j])
      a[i][j] = bs[i] * _dot(ki_r, kj_r, trans_b=True)
      p[i][j] = _dot(qi_r, kj_r, trans_b=True)
    a[i][i] = bs[i] * _diagonal_pairs(ks[i], k_ref, g_ref, i, inclusive=False)
    p[i][i] = _diagonal_pairs(qi, k_ref, g_ref, i, inclusive=True)

  # X = L^-1 with L = I + A, by blocks.
  eye = (jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
         == jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)).astype(jnp.float32)
  x = [[None] * n for _ in range(n)]
  for i in range(n):
    x[i][i] = _unit_lower_inverse_block(eye + a[i][i])
  for d in range(1, n):
    for i in range(d, n):
      j = i - d
      acc = sum(_dot(a[i][m], x[m][j]) for m in range(j, i))
      x[i][j] = -_dot(x[i][i], acc)

  # w = X (beta k e^G), U = X (beta v); P as computed (zero above the diagonal).
  bk = [bs[j] * ks[j] * jnp.exp(gs[j]) for j in range(n)]
  bv = [bs[j] * _rows(v_ref, j) for j in range(n)]
  zero = jnp.zeros((SUB, SUB), jnp.float32)
  for i in range(n):
    w_ref[pl.ds(i * SUB, SUB), :] = sum(_dot(x[i][j], bk[j]) for j in range(i + 1))
    u_ref[pl.ds(i * SUB, SUB), :] = sum(_dot(x[i][j], bv[j]) for j in range(i + 1))
    for j in range(n):
      p_ref[pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)] = p[i][j] if j <= i else zero


@functools.partial(jax.jit, static_argnames=("interpret",))
def intra(q, k, v, G, beta, *, interpret=False):
  """``(w [..., C, K], U [..., C, V], P [..., C, C])`` float32, for chunks ``[..., C, D]``:
  q (scaled), k [..., C, K]; v [..., C, V]; G [..., C, K] the within-chunk cumulative log
  decay; beta [..., C, 1]. C must be a multiple of 16."""
  *lead, c, kd = k.shape
  vd = v.shape[-1]
  if c % SUB:
    raise ValueError(f"chunk size {c} is not a multiple of {SUB}")
  flat = lambda x: x.reshape((-1,) + x.shape[-2:])
  args = [flat(x) for x in (q, k, v, G, beta)]
  n = args[0].shape[0]
  spec = lambda d: pl.BlockSpec((None, c, d), lambda i: (i, 0, 0))
  out_shape = [jax.ShapeDtypeStruct((n, c, d), jnp.float32) for d in (kd, vd, c)]
  w, u, p = pl.pallas_call(
      _kernel, out_shape=out_shape, grid=(n,),
      in_specs=[spec(kd), spec(kd), spec(vd), spec(kd), spec(1)],
      out_specs=[spec(kd), spec(vd), spec(c)], interpret=interpret,
      compiler_params=pl_triton.CompilerParams(num_warps=NUM_WARPS))(*args)
  return tuple(o.reshape(*lead, c, o.shape[-1]) for o in (w, u, p))
