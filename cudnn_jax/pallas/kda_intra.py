"""KDA's intra-chunk stage (per-channel gates) as one Pallas (Triton) kernel.

One program per (chunk, sequence, value head) forms what the state recurrence needs of the
chunk (``reference.kda.Intra``): with ``G`` the within-chunk cumulative log decay,

    A_ts = sum_k k_t k_s e^{G_t - G_s}  (s < t),    P_ts = sum_k q_t k_s e^{G_t - G_s}  (s <= t)
    [w | U] = (I + diag(beta) A)^-1 [beta k e^G | beta v]

plus ``q e^G``, ``k e^{G_C - G}`` and ``e^{G_C}``. The chunk is cut into sub-blocks of 16
tokens. A pair of tokens in different sub-blocks meets through the first token r of the
later one, ``(x_t e^{G_t - G_r}) . (y_s e^{G_r - G_s})`` (both exponents <= 0: no overflow),
one tensor-core product per pair of sub-blocks, operands in the inputs' dtype. Pairs inside
a sub-block take their exact decays, one column a loop step. The unit lower-triangular
system's inverse T is built block by block in float32 (16 x 16 blocks only, so few
registers), each diagonal block as ``(I + N)^-1 = (I - N)(I + N^2)(I + N^4)(I + N^8)`` (N
strictly lower, so N^16 = 0), then applied to the right-hand sides re-read from memory.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from cudnn_jax.reference import kda as ref

SUB = 16  # tokens of a sub-block: Triton's smallest dot
NUM_WARPS = 8


def _kernel(q_ref, k_ref, v_ref, G_ref, beta_ref,
            w_ref, u_ref, p_ref, qg_ref, kd_ref, dec_ref, *, dt):
  i, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  c = q_ref.shape[3]
  f32 = jnp.float32
  exact = functools.partial(jnp.dot, precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=f32)

  # The right-hand sides in float32 at the products' precision (TF32 for narrower inputs).
  solve = functools.partial(jnp.dot, precision=ref.matmul_precision(dt),
                            preferred_element_type=f32)

  def mixed(x, y):  # tensor-core product in the inputs' dtype, float32 accumulation
    return jnp.dot(x.astype(dt), y.astype(dt), precision=ref.matmul_precision(dt),
                   preferred_element_type=f32)

  def rows(ref_, start, n=SUB):
    return ref_[i, b, h, pl.ds(start, n), :]

  def put(ref_, a, value, col=None):
    at = (i, b, h, pl.ds(a * SUB, SUB))
    ref_[at + ((slice(None),) if col is None else (pl.ds(col * SUB, SUB),))] = value

  row = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
  eye = (row == col).astype(f32)
  zero = jnp.zeros((SUB, SUB), f32)
  G_end = rows(G_ref, c - 1, 1)  # [1, K]
  dec_ref[i, b, h, :] = jnp.exp(G_ref[i, b, h, c - 1, :])

  T = {}  # 16 x 16 blocks (a, j), j <= a, of T = (I + diag(beta) A)^-1
  for a in range(c // SUB):
    q, k, G, beta = (rows(r, a * SUB) for r in (q_ref, k_ref, G_ref, beta_ref))
    put(qg_ref, a, q * jnp.exp(G))
    put(kd_ref, a, k * jnp.exp(G_end - G))

    def column(s, carry, a=a, q=q, k=k, G=G):
      A, P = carry
      ks, Gs = rows(k_ref, a * SUB + s, 1), rows(G_ref, a * SUB + s, 1)
      e = jnp.exp(jnp.minimum(G - Gs, 0.0))  # rows t < s are masked out below
      kk = jnp.sum(k * ks * e, axis=1, keepdims=True)
      qk = jnp.sum(q * ks * e, axis=1, keepdims=True)
      A = jnp.where((col == s) & (row > s), kk, A)
      P = jnp.where((col == s) & (row >= s), qk, P)
      return A, P

    A, P = jax.lax.fori_loop(0, SUB, column, (zero, zero))
    put(p_ref, a, P, a)
    for j in range(a + 1, c // SUB):
      put(p_ref, a, zero, j)

    N = beta * A  # strictly lower
    inverse, power = eye - N, N
    for _ in range(SUB.bit_length() - 2):  # N^2, N^4, N^8
      power = exact(power, power)
      inverse = exact(inverse, eye + power)
    T[a, a] = inverse

    # Earlier sub-blocks j: L_aj = beta A_aj, and T_aj = -T_aa sum_{j <= m < a} L_am T_mj.
    G_r = rows(G_ref, a * SUB, 1)
    q_r, k_r = q * jnp.exp(G - G_r), k * jnp.exp(G - G_r)
    L = {}
    for m in range(a):
      k_m = rows(k_ref, m * SUB) * jnp.exp(G_r - rows(G_ref, m * SUB))
      put(p_ref, a, mixed(q_r, k_m.T), m)
      L[m] = beta * mixed(k_r, k_m.T)
    for j in range(a):
      T[a, j] = -exact(inverse, sum(exact(L[m], T[m, j]) for m in range(j, a)))

    # [w | U] rows of sub-block a: sum_j T_aj [beta k e^G | beta v]_j, inputs re-read.
    w = u = 0.0
    for j in range(a + 1):
      beta_j = rows(beta_ref, j * SUB)
      r_w = beta_j * rows(k_ref, j * SUB) * jnp.exp(rows(G_ref, j * SUB))
      w = w + solve(T[a, j], r_w)
      u = u + solve(T[a, j], beta_j * rows(v_ref, j * SUB))
    put(w_ref, a, w)
    put(u_ref, a, u)


@functools.partial(jax.jit, static_argnames=("dt", "interpret"))
def intra(q, k, v, G, beta, dt, *, interpret=False):
  """``reference.kda.Intra`` of every chunk, float32.

  q (scaled), k, G [NC,B,HV,C,K] float32 (G per channel); v [NC,B,HV,C,V]; beta
  [NC,B,HV,C,1]; ``dt`` the dtype of the cross-sub-block products' operands. C a multiple
  of 16; K, V powers of two from 16."""
  nc, b, hv, c, kdim = q.shape
  if c % SUB or G.shape != q.shape:
    raise ValueError(f"chunk of {c} tokens or gate shape {G.shape}: per-channel gates on "
                     f"chunks of a multiple of {SUB} tokens only")
  f32 = lambda *shape: jax.ShapeDtypeStruct((nc, b, hv) + shape, jnp.float32)
  vdim = v.shape[-1]
  w, U, P, qg, kd, dec = pl.pallas_call(
      functools.partial(_kernel, dt=jnp.dtype(dt)), grid=(nc, b, hv),
      out_shape=[f32(c, kdim), f32(c, vdim), f32(c, c), f32(c, kdim), f32(c, kdim),
                 f32(kdim)],
      in_specs=[pl.no_block_spec] * 5, out_specs=[pl.no_block_spec] * 6,
      interpret=interpret,
      compiler_params=pl_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=1))(
          q, k, v, G, beta)
  return ref.Intra(w=w, U=U, P=P, qg=qg, kd=kd, dec=dec)
