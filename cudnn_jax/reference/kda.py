"""The ``xla`` engine for Kimi Delta Attention and Gated DeltaNet: the chunked WY form.

Per sequence and value head the state ``S [K,V]`` (float32) follows
``S <- diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T q_t``.

Chunked form. Tokens are cut into chunks of C; ``G`` is the within-chunk cumulative sum of
``g`` (so ``exp(G_t - G_s)`` decays token s's write up to token t). With ``S0`` the state
entering a chunk and ``u_t = beta_t (v_t - S'_t^T k_t)`` (``S'_t`` the decayed state seen by
token t), the chunk's writes solve a unit lower-triangular system ``(I + A) u = beta (v -
(k e^G) S0)`` with ``A_ts = beta_t sum_k k_t k_s e^{G_t - G_s}`` (s < t). Writing
``T = (I + A)^-1``, ``w = T (beta k e^G)``, ``U = T (beta v)`` gives ``u = U - w S0`` and

    o     = (q e^G) S0 + P u,      P_ts = sum_k q_t k_s e^{G_t - G_s}  (s <= t)
    S_out = diag(e^{G_C}) S0 + (k e^{G_C - G})^T u.

Everything but the two state lines runs in parallel over chunks; the state recurrence is a
``lax.scan`` of matmuls.

Pair sums ``sum_k x_t y_s e^{G_t - G_s}`` (per-channel G) are matmuls over a hierarchy of
sub-blocks (64 -> 16 -> 4 -> 1 tokens): sub-block I meets the earlier tokens of its block
through ``(x_t e^{G_t - G_r}) . (y_s e^{G_r - G_s})`` with r the token just before I, so
s <= r < t and, G being non-increasing, both exponents are <= 0 (no overflow; an underflow
only drops a vanishing term). Each level is one [h, K] x [K, a] product per sub-block, and
its gradients are the same products transposed; the leaves are the diagonal t = s.
While the gates decay by at most SPAN_LIMIT over any 16-token sub-block, one product per
sub-block through the token before it pairs all of its tokens instead
(``by_span`` picks, with ``lax.cond``).

The custom VJP keeps the inputs and the chunk-entry states; the backward pass recomputes
the intra-chunk quantities, runs the state gradient backwards through the chunks, and
then forms every input gradient in parallel over chunks. Matmuls parallel over chunks take
bf16 operands for bf16 inputs, except the backward's intra stage (float32: it carries the
gates' gradient); every product accumulates in float32.

Packed sequences (``cu_seqlens``) are laid out so each sequence starts on a chunk
boundary (zero padding: g = 0, beta = 0, k = 0 leave the state unchanged); the scan resets
the state at each sequence's first chunk and records it after its last.

Every stage is a plain function of arrays (``gated_tokens``, ``to_chunks``, ``intra``,
``state_scan``, ``outputs``, and backwards ``state_scan_bwd``, ``output_grads``), so that
an engine with kernels for some stages (cudnn_jax/triton/kda.py) composes its chunked pass
from the others.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cudnn_jax._metadata import row_slots, served_sequences
from cudnn_jax.reference import matmul_precision


# ---------------------------------------------------------------------------------------
# Preprocessing (plain JAX; autodiff differentiates it).


def l2norm(x):
  """``x / sqrt(sum x^2 + 1e-6)`` over the last axis."""
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def gate(g, a_log, dt_bias, lower_bound):
  """Raw gate ``g [..., HV, Kg]`` -> log decay; ``a_log [HV]``, ``dt_bias [HV, Kg]`` or None.

  ``-exp(a_log) * softplus(g + dt_bias)``, or with ``lower_bound`` lb
  ``lb * sigmoid(exp(a_log) * (g + dt_bias))`` (no ``exp(a_log)`` factor when a_log is None).
  """
  if dt_bias is not None:
    g = g + dt_bias
  a = None if a_log is None else jnp.exp(a_log)[:, None]
  if lower_bound is None:
    return -a * jax.nn.softplus(g)
  return lower_bound * jax.nn.sigmoid(g if a is None else a * g)


# ---------------------------------------------------------------------------------------
# Intra-chunk quantities. Arrays are [..., C, D]: one chunk of one head per leading index;
# G [..., C, Kg] with Kg = K (per-channel gate) or 1 (scalar gate).


def _mm(x, y, dt):
  """``x @ y`` with operands in ``dt`` (the inputs' dtype) and float32 accumulation."""
  return jnp.matmul(x.astype(dt), y.astype(dt), precision=matmul_precision(dt),
                    preferred_element_type=jnp.float32)


def _causal(c, strict):
  return jnp.tril(jnp.ones((c, c), bool), -1 if strict else 0)


def _levels(c):
  """(block, sub-block) sizes of the reference-point hierarchy, e.g. 64/16, 16/4, 4/1."""
  out = []
  while c > 1:
    out.append((c, c // 4 if c % 4 == 0 else c // 2))
    c = out[-1][1]
  return out


def leaf_size(c):
  """Tokens in a sub-block of the hierarchy's first level (16 at C = 64, 8 at C = 32)."""
  return _levels(c)[0][1]


def blocks(z, n):
  """[..., C, D] -> [..., C/n, n, D]."""
  return z.reshape(*z.shape[:-2], z.shape[-2] // n, n, z.shape[-1])


def diagonal_blocks(W, n):
  """The n x n blocks on the diagonal of W [..., C, C]: [..., C/n, n, n]."""
  p = W.shape[-1] // n
  if p == 1:
    return W[..., None, :, :]
  W = W.reshape(*W.shape[:-2], p, n, p, n)
  return jnp.moveaxis(jnp.diagonal(W, axis1=-4, axis2=-2), -1, -3)


def block_diagonal(M):
  """[..., p, n, n] -> [..., p n, p n] with those blocks on the diagonal."""
  *lead, p, n, _ = M.shape
  if p > 1:
    M = M[..., :, :, None, :] * jnp.eye(p, dtype=M.dtype)[:, None, :, None]
  return M.reshape(*lead, p * n, p * n)


# One level (n, h) of the hierarchy pairs token t of an h-sub-block with the tokens s of
# the earlier sub-blocks of its n-block, through a reference token r between them
# (exponents G_t - G_r and G_r - G_s, both <= 0). Below: the product, and the two products
# of its transpose for the backward pass; sub-block I starts at a, sub-block J ends at e.


def _cross(x, y, G, n, h, dt):
  """``M_ts = sum_k x_t y_s e^{G_t - G_s}`` over one level's pairs: [..., C, C]."""
  xb, yb, Gb = (blocks(z, n) for z in (x, y, G))
  rows = [jnp.zeros((*xb.shape[:-2], h, n), jnp.float32)]
  for a in range(h, n, h):
    ref = Gb[..., a - 1:a, :]
    xs = xb[..., a:a + h, :] * jnp.exp(Gb[..., a:a + h, :] - ref)
    ys = yb[..., :a, :] * jnp.exp(ref - Gb[..., :a, :])
    block = _mm(xs, ys.mT, dt)  # [..., h, a]
    rows.append(jnp.pad(block, [(0, 0)] * (block.ndim - 1) + [(0, n - a)]))
  return block_diagonal(jnp.concatenate(rows, axis=-2))


def _cross_rows(W, y, G, n, h, dt):
  """``out_t = sum_s W_ts y_s e^{G_t - G_s}`` over one level's pairs: [..., C, K]."""
  Wb, yb, Gb = diagonal_blocks(W, n), blocks(y, n), blocks(G, n)
  out = [jnp.zeros_like(yb[..., :h, :])]
  for a in range(h, n, h):
    ref = Gb[..., a - 1:a, :]
    ys = yb[..., :a, :] * jnp.exp(ref - Gb[..., :a, :])
    out.append(jnp.exp(Gb[..., a:a + h, :] - ref) * _mm(Wb[..., a:a + h, :a], ys, dt))
  return jnp.concatenate(out, axis=-2).reshape(y.shape)


def _cross_cols(W, x, G, n, h, dt):
  """``out_s = sum_t W_ts x_t e^{G_t - G_s}`` over one level's pairs: [..., C, K]."""
  Wb, xb, Gb = diagonal_blocks(W, n), blocks(x, n), blocks(G, n)
  out = []
  for e in range(h, n, h):
    ref = Gb[..., e - 1:e, :]
    xs = xb[..., e:, :] * jnp.exp(Gb[..., e:, :] - ref)
    out.append(jnp.exp(ref - Gb[..., e - h:e, :]) * _mm(Wb[..., e:, e - h:e].mT, xs, dt))
  out.append(jnp.zeros_like(xb[..., :h, :]))
  return jnp.concatenate(out, axis=-2).reshape(x.shape)


def across_leaves(x, y, G, dt):
  """The pair sums between different sub-blocks of the first level: [..., C, C]."""
  n, h = _levels(G.shape[-2])[0]
  return _cross(x, y, G, n, h, dt)


def across_leaves_grads(dM, x, y, G, dt):
  """``(dx, dy)``: the gradients of ``across_leaves`` for ``dM [..., C, C]``."""
  n, h = _levels(G.shape[-2])[0]
  return _cross_rows(dM, y, G, n, h, dt), _cross_cols(dM, x, G, n, h, dt)


def leaf_pairs(x, y, G, dt):
  """The strict pair sums within sub-blocks ``[..., n, K]`` of the first level (n = 16 at
  C = 64), by the rest of the hierarchy (16 -> 4 -> 1 tokens): ``M [..., n, n]``."""
  levels = _levels(G.shape[-2])
  if not levels:  # one-token blocks: no pairs
    return jnp.zeros(G.shape[:-1] + G.shape[-2:-1], jnp.float32)
  return sum(_cross(x, y, G, n, h, dt) for n, h in levels)


def leaf_pairs_grads(dM, x, y, G, dt):
  """``(dx, dy)``: the gradients of ``leaf_pairs`` (G's follows: ``x dx - y dy``)."""
  levels = _levels(G.shape[-2])
  if not levels:
    return jnp.zeros_like(x), jnp.zeros_like(y)
  return (sum(_cross_rows(dM, y, G, n, h, dt) for n, h in levels),
          sum(_cross_cols(dM, x, G, n, h, dt) for n, h in levels))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def strict_pair(x, y, G, dt):
  """``M_ts = sum_k x_t[k] y_s[k] e^{G_t[k] - G_s[k]}`` for s < t, per-channel G: the
  first level of the hierarchy, then the leaves within its sub-blocks."""
  h = leaf_size(G.shape[-2])
  inner = leaf_pairs(*(blocks(z, h) for z in (x, y, G)), dt)
  return across_leaves(x, y, G, dt) + block_diagonal(inner)


def _strict_pair_fwd(x, y, G, dt):
  return strict_pair(x, y, G, dt), (x, y, G)


def _strict_pair_bwd(dt, res, dM):
  x, y, G = res
  h = leaf_size(G.shape[-2])
  dx_in, dy_in = leaf_pairs_grads(diagonal_blocks(dM, h), *(blocks(z, h) for z in res), dt)
  dx_across, dy_across = across_leaves_grads(dM, x, y, G, dt)
  dx = dx_across + dx_in.reshape(x.shape)
  dy = dy_across + dy_in.reshape(y.shape)
  return dx, dy, x * dx - y * dy  # G enters as +G_t and -G_s


strict_pair.defvjp(_strict_pair_fwd, _strict_pair_bwd)


def with_diagonal(M, x, y):
  """``M`` plus the pairs t = s: ``sum_k x_t y_t`` on the diagonal."""
  return M + jnp.eye(M.shape[-1], dtype=M.dtype) * jnp.sum(x * y, -1)[..., :, None]


# The same pair sums as one product per 16-token sub-block: token t of sub-block i meets
# every token s up to the sub-block's end through r, the token just before the sub-block
# (G_r = 0 before the chunk): ``(x_t e^{G_t - G_r}) . (y_s e^{G_r - G_s})``. For s inside
# the sub-block the second factor exceeds 1, by up to e^span, span the decay over the
# sub-block and r. While every span is at most SPAN_LIMIT, every factor stays far inside
# float32's and bfloat16's range (e^+-60 ~ 1e+-26 against e^+-87) and the form is as exact
# as the hierarchy, with two products in place of its levels and plain autodiff for its
# gradients. ``intra(..., by_sub_blocks=True)`` takes it; ``by_span`` checks ``max_span``.
SUB = 16
SPAN_LIMIT = 60.0


def _sub_block_refs(G):
  """(G_r [..., C/SUB, Kg] for each sub-block's r, G as sub-blocks [..., C/SUB, SUB, Kg])."""
  Gb = blocks(G, SUB)
  return jnp.concatenate([jnp.zeros_like(Gb[..., :1, 0, :]), Gb[..., :-1, -1, :]], -2), Gb


def max_span(G):
  """The largest decay over a sub-block and the token before it, any chunk and channel."""
  Gr, Gb = _sub_block_refs(G)
  return jnp.max(Gr - Gb[..., -1, :], initial=0.0)


def pair_by_sub_blocks(x, y, G, dt):
  """``M_ts`` for every s up to the end of t's sub-block (above the diagonal too): [..., C, C]."""
  c = G.shape[-2]
  Gr, Gb = _sub_block_refs(G)
  xs = blocks(x, SUB) * jnp.exp(Gb - Gr[..., None, :])  # [..., C/SUB, SUB, K], factors <= 1
  upto = SUB * (jnp.arange(c // SUB)[:, None] + 1) > jnp.arange(c)  # [C/SUB, C]
  up = jnp.where(upto[:, :, None], Gr[..., None, :] - G[..., None, :, :], -jnp.inf)
  ys = y[..., None, :, :] * jnp.exp(up)  # [..., C/SUB, C, K], factors <= e^span
  return _mm(xs, ys.mT, dt).reshape(G.shape[:-2] + (c, c))


def pair(x, y, G, dt, diagonal, by_sub_blocks=False):
  """``M_ts = sum_k x_t[k] y_s[k] e^{G_t[k] - G_s[k]}`` for s < t (s <= t if diagonal)."""
  c = G.shape[-2]
  keep = _causal(c, strict=not diagonal)
  if G.shape[-1] == 1:  # scalar gate: the decay factors out of the sum
    return _mm(x, y.mT, dt) * jnp.exp(jnp.where(keep, G - G.mT, -jnp.inf))  # masked first
  if by_sub_blocks:
    return jnp.where(keep, pair_by_sub_blocks(x, y, G, dt), 0.0)
  M = strict_pair(x, y, G, dt)
  return with_diagonal(M, x, y) if diagonal else M


def _unit_lower_inverse(L):
  """Inverse of unit lower-triangular ``L [..., C, C]`` (C a power of two), by doubling
  the inverted diagonal blocks: ``[[X, 0], [Y, Z]]^-1 = [[X^-1, 0], [-Z^-1 Y X^-1, Z^-1]]``.
  Exact like substitution, but every step is a batched matmul (no triangular solve)."""
  c = L.shape[-1]
  lead = L.shape[:-2]
  prec = jax.lax.Precision.HIGHEST
  inv = jnp.ones(lead + (c, 1, 1), L.dtype)  # the 1x1 diagonal blocks
  size = 1
  while size < c:
    n = c // (2 * size)
    # Y: the lower-left size x size block of each 2size x 2size diagonal block.
    blocks = L.reshape(lead + (n, 2, size, n, 2, size))
    Y = jnp.diagonal(blocks[..., :, 1, :, :, 0, :], axis1=-4, axis2=-2)  # [..., size, size, n]
    Y = jnp.moveaxis(Y, -1, -3)
    X_inv, Z_inv = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
    off = -jnp.matmul(jnp.matmul(Z_inv, Y, precision=prec), X_inv, precision=prec)
    zero = jnp.zeros_like(off)
    inv = jnp.concatenate([jnp.concatenate([X_inv, zero], -1),
                           jnp.concatenate([off, Z_inv], -1)], -2)
    size *= 2
  return inv[..., 0, :, :]


@jax.custom_vjp
def _unit_lower_solve(L, R):
  """``L^-1 R`` for unit lower-triangular ``L [..., C, C]``; only L's strict lower
  triangle is read (and differentiated)."""
  return jnp.matmul(_unit_lower_inverse(L), R, precision=jax.lax.Precision.HIGHEST)


def _unit_lower_solve_fwd(L, R):
  T = _unit_lower_inverse(L)
  X = jnp.matmul(T, R, precision=jax.lax.Precision.HIGHEST)
  return X, (T, X)


def _unit_lower_solve_bwd(res, dX):
  T, X = res
  dR = jnp.matmul(T.mT, dX, precision=jax.lax.Precision.HIGHEST)
  dL = -jnp.matmul(dR, X.mT, precision=jax.lax.Precision.HIGHEST)
  return jnp.where(_causal(T.shape[-1], strict=True), dL, 0.0), dR


_unit_lower_solve.defvjp(_unit_lower_solve_fwd, _unit_lower_solve_bwd)


class Intra(NamedTuple):
  """What the state recurrence needs of each chunk."""
  w: jax.Array    # [..., C, K]  T (beta k e^G)
  U: jax.Array    # [..., C, V]  T (beta v)
  P: jax.Array    # [..., C, C]  causal q-k products with pair decays
  qg: jax.Array   # [..., C, K]  q e^G
  kd: jax.Array   # [..., C, K]  k e^{G_C - G}
  dec: jax.Array  # [..., Kg]    e^{G_C}


def solve_writes(k, v, b, eG, A):
  """``(w, U) = T (beta k e^G, beta v)``, ``T = (I + beta A)^-1``, from the strict k-k pair
  sums ``A`` (``pair``); ``b`` is beta [..., C, 1], ``eG`` is e^G."""
  L = jnp.eye(A.shape[-1], dtype=jnp.float32) + b * A
  wU = _unit_lower_solve(L, jnp.concatenate([b * k * eG, b * v], -1))
  return wU[..., :k.shape[-1]], wU[..., k.shape[-1]:]


def with_decays(q, k, G, eG, w, U, P):
  """The ``Intra`` of the solved writes and the causal q-k pair sums ``P``."""
  return Intra(w=w, U=U, P=P, qg=q * eG, kd=k * jnp.exp(G[..., -1:, :] - G),
               dec=jnp.exp(G[..., -1, :]))


@jax.named_scope("kda_intra")  # scopes name the stages in profiles
def intra(q, k, v, G, b, dt, by_sub_blocks=False):
  """Intra-chunk quantities. ``b`` is beta [..., C, 1]; ``dt`` the matmul operand dtype;
  ``by_sub_blocks``: the pair sums by sub-blocks instead of the hierarchy (exact only
  while ``max_span(G) <= SPAN_LIMIT``)."""
  eG = jnp.exp(G)
  w, U = solve_writes(k, v, b, eG, pair(k, k, G, dt, False, by_sub_blocks))
  return with_decays(q, k, G, eG, w, U, pair(q, k, G, dt, True, by_sub_blocks))


def by_span(stage, G):
  """``stage(by_sub_blocks)``: by sub-blocks when the gates allow (``max_span(G) <=
  SPAN_LIMIT``), by the hierarchy otherwise; one branch of a ``lax.cond`` runs."""
  if SPAN_LIMIT is None or G.shape[-1] == 1 or G.shape[-2] % SUB:
    return stage(False)
  return jax.lax.cond(max_span(G) <= SPAN_LIMIT, lambda: stage(True), lambda: stage(False))


# ---------------------------------------------------------------------------------------
# The chunked recurrence with its custom VJP. Layout [NC, B, HV, C, D], chunk-major.


class Segments(NamedTuple):
  """Packed sequences over the chunk axis (B = 1): which chunk starts / ends which one."""
  reset: jax.Array  # [NC, 1] bool: chunk starts a sequence
  seq: jax.Array    # [NC, 1] int32: the sequence a chunk belongs to
  last: jax.Array   # [NC, 1] bool: chunk ends a sequence
  empty: jax.Array  # [N] bool: zero-length sequences


def _bcast(flag, x):
  return flag.reshape(flag.shape + (1,) * (x.ndim - flag.ndim))


def _chunk_cumsum(x):
  """Cumulative sums along each chunk's token axis (-2): a matmul with a triangular ones
  matrix (XLA lowers cumsum to reduce-windows, slow on GPUs)."""
  c = x.shape[-2]
  return jnp.matmul(jnp.tril(jnp.ones((c, c), x.dtype)), x, precision=jax.lax.Precision.HIGHEST)


@jax.named_scope("kda_state_scan")
def state_scan(it: Intra, init, seg, dt):
  """Chunk-entry states [NC,B,HV,K,V] and final states [N,HV,K,V]; ``seg`` a ``Segments``
  (packed sequences, B = 1) or None (one sequence per batch row, N = B)."""
  prec = matmul_precision(dt)

  def step(carry, x):
    S, finals = carry
    w, U, kd, dec, reset, seq, last = x
    if seg is not None:
      S = jnp.where(_bcast(reset, S), init[seq], S)
    u = U - jnp.matmul(w, S, precision=prec)
    S_out = dec[..., :, None] * S + jnp.matmul(kd.mT, u, precision=prec)
    if seg is not None:
      finals = finals.at[seq].set(jnp.where(_bcast(last, S_out), S_out, finals[seq]))
    return (S_out, finals), S

  xs = (it.w, it.U, it.kd, it.dec)
  if seg is None:
    (final, _), states = jax.lax.scan(step, (init, None), xs + (None,) * 3)
    return states, final
  s0 = jnp.zeros((1,) + init.shape[1:], init.dtype)
  (_, finals), states = jax.lax.scan(step, (s0, init), xs + tuple(seg[:3]))
  return states, finals


@jax.named_scope("kda_output")
def outputs(it: Intra, S, dt):
  """The outputs ``o [B,NC*C,HV,V]`` in dt from the chunk-entry states ``S``."""
  u = it.U - jnp.matmul(it.w, S, precision=matmul_precision(dt))
  o = _mm(it.qg, S, dt) + _mm(it.P, u, dt)
  return from_chunk_layout(o.astype(dt))


@jax.named_scope("kda_state_scan_bwd")
def state_scan_bwd(it: Intra, do, dfinal, init, seg, dt):
  """``(dS, dinit)``: the gradients of the chunk-exit states [NC,B,HV,K,V] and of the
  initial states, for output gradients ``do`` (chunks [NC,B,HV,C,V], float32) and final
  state gradients ``dfinal``."""
  prec = matmul_precision(dt)

  def step(carry, x):
    dS, dinit = carry
    do, qg, w, kd, dec, P, reset, seq, last = x
    if seg is not None:
      dS = dS + jnp.where(_bcast(last, dS), dfinal[seq], 0.0)
    du = jnp.matmul(P.mT, do, precision=prec) + jnp.matmul(kd, dS, precision=prec)
    dS_in = (jnp.matmul(qg.mT, do, precision=prec) - jnp.matmul(w.mT, du, precision=prec)
             + dec[..., :, None] * dS)
    if seg is not None:
      dinit = dinit.at[seq].add(jnp.where(_bcast(reset, dS_in), dS_in, 0.0))
      dS_in = jnp.where(_bcast(reset, dS_in), 0.0, dS_in)
    return (dS_in, dinit), dS

  xs = (do, it.qg, it.w, it.kd, it.dec, it.P)
  if seg is None:
    (dinit, _), dS_out = jax.lax.scan(step, (dfinal, None), xs + (None,) * 3, reverse=True)
    return dS_out, dinit
  carry = (jnp.zeros((1,) + init.shape[1:], init.dtype),
           jnp.where(_bcast(seg.empty, dfinal), dfinal, 0.0))
  (_, dinit), dS_out = jax.lax.scan(step, carry, xs + tuple(seg[:3]), reverse=True)
  return dS_out, dinit


@jax.named_scope("kda_output_bwd")
def output_grads(it: Intra, S, do, dS, dt, du=None):
  """The gradients of ``Intra`` (an ``Intra`` of cotangents) from the output gradients
  ``do`` and the chunk-exit state gradients ``dS``; ``du`` (the gradients of the corrected
  writes ``u = U - w S``) when already known."""
  u = it.U - jnp.matmul(it.w, S, precision=matmul_precision(dt))
  if du is None:
    du = _mm(it.P.mT, do, dt) + _mm(it.kd, dS, dt)
  d = Intra(w=-_mm(du, S.mT, dt), U=du,
            P=_mm(do, u.mT, dt),  # P's upper triangle is constant 0
            qg=_mm(do, S.mT, dt), kd=_mm(u, dS.mT, dt),
            dec=jnp.sum(dS * S, -1))
  if it.dec.shape[-1] == 1:  # scalar gate
    d = d._replace(dec=jnp.sum(d.dec, -1, keepdims=True))
  return d


def _forward(dt, q, k, v, G, beta, init, seg):
  it = by_span(functools.partial(intra, q, k, v, G, beta, dt), G)
  S, final = state_scan(it, init, seg, dt)  # S: chunk-entry states [NC,B,HV,K,V]
  return (outputs(it, S, dt), final), (q, k, v, G, beta, init, seg, S)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunked(dt, q, k, v, G, beta, init, seg):
  """``o [B,NC*C,HV,V]`` in dt and final states ``[N,HV,K,V]`` float32.

  q (scaled), k [NC,B,HV,C,K]; v [NC,B,HV,C,V]; G [NC,B,HV,C,Kg] (the log decays summed
  along each chunk); beta [NC,B,HV,C,1]; init [N,HV,K,V]; seg a ``Segments`` (B = 1) or
  None (then N = B, one sequence per row); dt the dtype of the chunk-parallel matmul
  operands.
  """
  return _forward(dt, q, k, v, G, beta, init, seg)[0]


def _chunked_bwd(dt, res, cts):
  # The whole pass in each branch of the span's lax.cond: the residuals of the recomputed
  # intra stage stay inside the branch (a cond under jax.vjp would return both branches').
  return by_span(functools.partial(_backward, dt, res, cts), res[3])


# The intra stage's gradient of the gates is a difference of near-equal products (for a
# pair sum, ``x dx - y dy``) that d(a_log) and d(dt_bias) then sum over every token: with
# bfloat16 operands its rounding errors add up to percents (tens of them for a head). The
# backward pass recomputes that stage, and differentiates it, with float32 operands.
INTRA_GRAD_DTYPE = jnp.float32


def _backward(dt, res, cts, by_sub_blocks):
  q, k, v, G, beta, init, seg, S = res
  do, dfinal = cts
  do = to_chunk_layout(do, q.shape[-2]).astype(jnp.float32)
  it, intra_vjp = jax.vjp(lambda *a: intra(*a, INTRA_GRAD_DTYPE, by_sub_blocks),
                          q, k, v, G, beta)
  dS, dinit = state_scan_bwd(it, do, dfinal, init, seg, dt)
  d = output_grads(it, S, do, dS, dt)
  with jax.named_scope("kda_intra_bwd"):
    dq, dk, dv, dG, db = intra_vjp(d)
  return dq, dk, dv, dG, db, dinit, None


chunked.defvjp(_forward, _chunked_bwd)


# ---------------------------------------------------------------------------------------
# Layout: [B,T,HV,D] tokens <-> [NC,B,HV,C,D] chunks.


def to_chunk_layout(x, c):
  """Tokens ``[B,T,H,D]`` to chunks ``[NC,B,H,C,D]`` (T zero-padded to whole chunks)."""
  b, t = x.shape[:2]
  nc = -(-t // c)
  x = jnp.pad(x, ((0, 0), (0, nc * c - t)) + ((0, 0),) * (x.ndim - 2))
  x = x.reshape((b, nc, c) + x.shape[2:])
  return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)


def from_chunk_layout(x):
  """Chunks ``[NC,B,H,C,D]`` to tokens ``[B,NC*C,H,D]``."""
  nc, b, hv, c = x.shape[:4]
  x = jnp.moveaxis(jnp.moveaxis(x, 3, 2), 0, 1)
  return x.reshape((b, nc * c, hv) + x.shape[4:])


def to_chunks(q, k, v, g, beta, scale, l2norm_qk, c):
  """Tokens ``[B,T,*,D]`` to float32 chunks ``[NC,B,HV,C,D]``, what ``chunked`` takes: q
  and k (``[B,T,H,K]``, in q's dtype) l2-normalized when ``l2norm_qk``, q times ``scale``,
  both repeated to the HV value heads; v ``[B,T,HV,V]``; g ``[B,T,HV,Kg]`` as G, its
  cumulative sums along each chunk; beta ``[B,T,HV,1]``. T is zero-padded to whole
  chunks."""
  q, k, v, g, beta = (to_chunk_layout(x, c).astype(jnp.float32) for x in (q, k, v, g, beta))
  if l2norm_qk:
    q, k = l2norm(q), l2norm(k)
  q, k = (jnp.repeat(x, v.shape[2] // q.shape[2], axis=2) for x in (q * scale, k))
  return q, k, v, _chunk_cumsum(g), beta


class Packing(NamedTuple):
  token: jax.Array  # [NC*C] int32: the token each padded slot reads
  valid: jax.Array  # [NC*C] bool
  slot: jax.Array   # [T] int32: the padded slot of each token
  inside: jax.Array  # [T] bool: token lies in some sequence
  seg: Segments


def _packing(cu_seqlens, t, c):
  """Lays packed sequences out so each starts on a chunk boundary (no Python loops). Only
  the sequences ``_metadata.served_sequences`` serves take rows; the others are empty."""
  starts, lens = served_sequences(cu_seqlens, t)
  n = lens.shape[0]
  start = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(-(-lens // c))])
  nc = (t + n * (c - 1)) // c  # enough chunks for any served lengths (they sum to <= t)
  chunk = jnp.arange(nc, dtype=jnp.int32)
  in_use = chunk < start[-1]
  seq = jnp.minimum(jnp.searchsorted(start[1:], chunk, side="right"), n - 1).astype(jnp.int32)
  pos = (chunk - start[seq])[:, None] * c + jnp.arange(c, dtype=jnp.int32)
  valid = (in_use[:, None] & (pos < lens[seq][:, None])).reshape(-1)
  token = jnp.where(valid, (starts[seq][:, None] + pos).reshape(-1), t)
  slot, inside = row_slots(token, t)  # tokens no served sequence owns are not inside
  seg = Segments(reset=(in_use & (chunk == start[seq]))[:, None], seq=seq[:, None],
                 last=(in_use & (chunk == start[seq + 1] - 1))[:, None], empty=lens == 0)
  return Packing(jnp.minimum(token, max(t - 1, 0)), valid, slot, inside, seg)


def _gather(x, index, valid):
  """x [1,T,...] -> [1,len(index),...], zero where not valid."""
  y = jnp.take(x[0], index, axis=0)
  return jnp.where(_bcast(valid, y), y, jnp.zeros((), y.dtype))[None]


# ---------------------------------------------------------------------------------------
# The engine entry point: tokens in, tokens out.


class Tokens(NamedTuple):
  """The gated tokens of ``gated_tokens``, what ``to_chunks`` takes, and how to lay the
  outputs back out."""
  q: jax.Array     # [B,T',H,K]
  k: jax.Array     # [B,T',H,K]
  v: jax.Array     # [B,T',HV,V]
  g: jax.Array     # [B,T',HV,Kg] float32 log decays
  beta: jax.Array  # [B,T',HV,1] float32
  init: jax.Array  # [N,HV,K,V] float32 initial states
  pack: Packing | None  # packed sequences laid out on chunk boundaries (then T' != T)


def gated_tokens(q, k, v, g, beta, *, initial_state=None, gate_in_kernel=False, a_log=None,
                 dt_bias=None, lower_bound=None, beta_sigmoid=False, allow_neg_eigval=False,
                 cu_seqlens=None, chunk_size=64):
  """The per-token preprocessing of ``kda`` (its arguments): the gates and beta as float32
  log decays and write strengths, the initial states (zeros when None), and packed
  sequences laid out so each starts on a chunk boundary."""
  b, t, _, kdim = q.shape
  hv, vdim = v.shape[2], v.shape[3]
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
  init = (jnp.zeros((n, hv, kdim, vdim), jnp.float32) if initial_state is None
          else f32(initial_state))

  # The gates are elementwise: applied to the tokens, padding slots keep g = beta = 0.
  g, beta = f32(g), f32(beta)[..., None]
  if gate_in_kernel:
    g = gate(g, a_log, dt_bias, lower_bound)
  if beta_sigmoid:
    beta = (2.0 if allow_neg_eigval else 1.0) * jax.nn.sigmoid(beta)
  xs, pack = (q, k, v, g, beta), None
  if cu_seqlens is not None:
    pack = _packing(cu_seqlens, t, chunk_size)
    xs = tuple(_gather(x, pack.token, pack.valid) for x in xs)
  return Tokens(*xs, init, pack)


def token_outputs(o, t, pack):
  """The outputs ``o [B,T',HV,V]`` of the tokens of ``gated_tokens`` as ``[B,T,HV,V]``."""
  return o[:, :t] if pack is None else _gather(o, pack.slot, pack.inside)


def kda(q, k, v, g, beta, *, scale, initial_state=None, qk_l2norm=False,
        gate_in_kernel=False, a_log=None, dt_bias=None, lower_bound=None,
        beta_sigmoid=False, allow_neg_eigval=False, cu_seqlens=None, chunk_size=64):
  """Returns ``(o [B,T,HV,V] in q's dtype, final_state [N,HV,K,V] float32)``.

  Validated inputs: q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K] or, for a scalar gate,
  [B,T,HV,1]; beta [B,T,HV]; initial_state [N,HV,K,V] or None; a_log [HV] or None;
  dt_bias [HV,K] (scalar gate: [HV,1]) or None; cu_seqlens [N+1] or None.
  """
  x = gated_tokens(q, k, v, g, beta, initial_state=initial_state,
                   gate_in_kernel=gate_in_kernel, a_log=a_log, dt_bias=dt_bias,
                   lower_bound=lower_bound, beta_sigmoid=beta_sigmoid,
                   allow_neg_eigval=allow_neg_eigval, cu_seqlens=cu_seqlens,
                   chunk_size=chunk_size)
  chunks = to_chunks(x.q, x.k, x.v, x.g, x.beta, scale, qk_l2norm, chunk_size)
  o, final = chunked(q.dtype, *chunks, x.init, None if x.pack is None else x.pack.seg)
  return token_outputs(o, q.shape[1], x.pack), final
