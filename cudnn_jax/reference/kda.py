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
``lax.scan`` of matmuls. Pair decays ``e^{G_t - G_s}`` are taken as exp of differences
masked to the causal triangle first, so no exponent is ever positive (no overflow, and an
underflow only rounds a vanishing term to 0).

The custom VJP keeps the inputs and the chunk-entry states; the backward pass recomputes
the intra-chunk quantities, runs the state gradient backwards through the chunks, and
then forms every input gradient in parallel over chunks.

Packed sequences (``cu_seqlens``) are laid out so each sequence starts on a chunk
boundary (zero padding: g = 0, beta = 0, k = 0 leave the state unchanged); the scan resets
the state at each sequence's first chunk and records it after its last.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular


def matmul_precision(dtype):
  # float32 inputs get true float32 products (no TF32); narrower inputs are exact in f32.
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


# ---------------------------------------------------------------------------------------
# Preprocessing (plain JAX; autodiff differentiates it).


def l2norm(x):
  """``x / sqrt(sum x^2 + 1e-6)`` over the last axis."""
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def gate(g, a_log, dt_bias, lower_bound):
  """Raw gate ``g [B,T,HV,Kg]`` -> log decay; ``a_log [HV]``, ``dt_bias [HV*Kg]`` or None.

  ``-exp(a_log) * softplus(g + dt_bias)``, or with ``lower_bound`` lb
  ``lb * sigmoid(exp(a_log) * (g + dt_bias))`` (no ``exp(a_log)`` factor when a_log is None).
  """
  hv = g.shape[2]
  if dt_bias is not None:
    g = g + dt_bias.reshape(hv, -1)
  a = None if a_log is None else jnp.exp(a_log)[:, None]
  if lower_bound is None:
    return -a * jax.nn.softplus(g)
  return lower_bound * jax.nn.sigmoid(g if a is None else a * g)


# ---------------------------------------------------------------------------------------
# Intra-chunk quantities. Arrays are [..., C, D]: one chunk of one head per leading index;
# G [..., C, Kg] with Kg = K (per-channel gate) or 1 (scalar gate).


def _causal(c, strict):
  return jnp.tril(jnp.ones((c, c), bool), -1 if strict else 0)


def _pair_decay(G):
  """``E_ts = exp(G_t - G_s)`` for s < t, 0 elsewhere: [..., C, C, Kg]."""
  keep = _causal(G.shape[-2], strict=True)[..., None]
  diff = G[..., :, None, :] - G[..., None, :, :]
  return jnp.exp(jnp.where(keep, diff, -jnp.inf))  # masked first: no positive exponent


def _pair(x, y, E, prec):
  """``M_ts = sum_k x_t[k] y_s[k] E_ts[k]``: [..., C, C]."""
  if E.shape[-1] == 1:
    return jnp.matmul(x, y.mT, precision=prec) * E[..., 0]
  return jnp.sum(x[..., :, None, :] * y[..., None, :, :] * E, axis=-1)


def _pair_bwd(x, y, E, dM, prec):
  """Gradients of ``_pair`` for cotangent dM: (dx, dy, dG)."""
  if E.shape[-1] == 1:
    W = dM * E[..., 0]
    Z = W * jnp.matmul(x, y.mT, precision=prec)
    dG = jnp.sum(Z, -1) - jnp.sum(Z, -2)
    return (jnp.matmul(W, y, precision=prec), jnp.matmul(W.mT, x, precision=prec),
            dG[..., None])
  F = dM[..., None] * E
  Z = F * x[..., :, None, :] * y[..., None, :, :]
  return (jnp.sum(F * y[..., None, :, :], -2), jnp.sum(F * x[..., :, None, :], -3),
          jnp.sum(Z, -2) - jnp.sum(Z, -3))


def _to_gate(x, G):
  """Reduces a [..., K] gradient to G's channel count (sums over K for a scalar gate)."""
  return jnp.sum(x, -1, keepdims=True) if G.shape[-1] == 1 else x


class Intra(NamedTuple):
  """What the state recurrence needs of each chunk."""
  w: jax.Array    # [..., C, K]  T (beta k e^G)
  U: jax.Array    # [..., C, V]  T (beta v)
  P: jax.Array    # [..., C, C]  causal q-k products with pair decays
  qg: jax.Array   # [..., C, K]  q e^G
  kd: jax.Array   # [..., C, K]  k e^{G_C - G}
  dec: jax.Array  # [..., Kg]    e^{G_C}


def _intra(q, k, v, G, b, prec):
  """Intra-chunk quantities and what their backward pass needs. ``b`` is beta [..., C, 1]."""
  c = G.shape[-2]
  eG = jnp.exp(G)
  ed = jnp.exp(G[..., -1:, :] - G)
  Ek = _pair_decay(G)
  Eq = Ek + jnp.eye(c, dtype=Ek.dtype)[:, :, None]  # the diagonal's decay is exp(0)
  Kk = _pair(k, k, Ek, prec)
  L = jnp.eye(c, dtype=Kk.dtype) + b * Kk
  Tinv = solve_triangular(L, jnp.broadcast_to(jnp.eye(c, dtype=L.dtype), L.shape),
                          lower=True, unit_diagonal=True)
  kg = k * eG
  out = Intra(w=jnp.matmul(Tinv, b * kg, precision=prec),
              U=jnp.matmul(Tinv, b * v, precision=prec),
              P=_pair(q, k, Eq, prec), qg=q * eG, kd=k * ed, dec=jnp.exp(G[..., -1, :]))
  return out, (eG, ed, Ek, Eq, Kk, Tinv, kg)


def _intra_bwd(q, k, v, G, b, prec, d: Intra):
  """Gradients (dq, dk, dv, dG, db) of ``_intra`` for cotangents ``d``."""
  out, (eG, ed, Ek, Eq, Kk, Tinv, kg) = _intra(q, k, v, G, b, prec)
  dYw = jnp.matmul(Tinv.mT, d.w, precision=prec)
  dYu = jnp.matmul(Tinv.mT, d.U, precision=prec)
  dA = -(jnp.matmul(dYw, out.w.mT, precision=prec) + jnp.matmul(dYu, out.U.mT, precision=prec))
  dA = jnp.where(_causal(G.shape[-2], strict=True), dA, 0.0)
  db = (jnp.sum(dA * Kk, -1, keepdims=True) + jnp.sum(dYw * kg, -1, keepdims=True)
        + jnp.sum(dYu * v, -1, keepdims=True))
  dv = b * dYu
  dkg = b * dYw
  dk1, dk2, dGk = _pair_bwd(k, k, Ek, b * dA, prec)
  dq1, dk3, dGq = _pair_bwd(q, k, Eq, d.P, prec)
  dq = d.qg * eG + dq1
  dk = dkg * eG + d.kd * ed + dk1 + dk2 + dk3
  dkd = _to_gate(d.kd * out.kd, G)
  dG = _to_gate(dkg * kg + d.qg * out.qg, G) - dkd + dGk + dGq
  dG_last = jnp.sum(dkd, -2) + d.dec * out.dec  # G_C enters kd and dec
  dG = dG.at[..., -1, :].add(dG_last)
  return dq, dk, dv, dG, db


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


def _state_scan(it: Intra, init, seg, prec):
  """Chunk-entry states [NC,B,HV,K,V] and final states [N,HV,K,V]."""
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


_PAIR_BYTES = 1 << 30  # bound on one [.., C, C, Kg] float32 temporary


def _over_chunks(fn, *xs):
  """``fn`` applied to groups of chunks in turn (axis 0 of [NC,B,HV,C,...] arrays).

  The per-channel pair decays are [C, C, K] per chunk; taking all chunks at once would
  hold B*HV*T*C*K floats, so groups are sized to keep that under ``_PAIR_BYTES``.
  """
  nc, b, hv, c = xs[0].shape[:4]
  per_chunk = 4 * b * hv * c * c * xs[3].shape[-1]  # xs[3] is G
  group = max(1, min(nc, _PAIR_BYTES // per_chunk))
  if group >= nc:
    return fn(*xs)
  return jax.lax.map(lambda a: fn(*a), xs, batch_size=group)


def _chunked_fwd(prec, q, k, v, g, beta, init, seg):
  G = jnp.cumsum(g, axis=-2)
  it = _over_chunks(lambda *a: _intra(*a, prec)[0], q, k, v, G, beta)
  S, final = _state_scan(it, init, seg, prec)  # S: chunk-entry states [NC,B,HV,K,V]
  u = it.U - jnp.matmul(it.w, S, precision=prec)
  o = jnp.matmul(it.qg, S, precision=prec) + jnp.matmul(it.P, u, precision=prec)
  return (o, final), (q, k, v, g, beta, init, seg, S)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunked(prec, q, k, v, g, beta, init, seg):
  """``o [NC,B,HV,C,V]`` and final states ``[N,HV,K,V]``, all float32.

  q (scaled), k [NC,B,HV,C,K]; v [NC,B,HV,C,V]; g [NC,B,HV,C,Kg]; beta [NC,B,HV,C,1];
  init [N,HV,K,V]; seg a ``Segments`` (B = 1) or None (then N = B, one sequence per row).
  """
  return _chunked_fwd(prec, q, k, v, g, beta, init, seg)[0]


def _chunked_bwd(prec, res, cts):
  q, k, v, g, beta, init, seg, S = res
  do, dfinal = cts
  G = jnp.cumsum(g, axis=-2)
  it = _over_chunks(lambda *a: _intra(*a, prec)[0], q, k, v, G, beta)

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

  xs = (do, it.qg, it.w, it.kd, it.dec, it.P)  # dS_out below: grads of chunk-exit states
  if seg is None:
    (dinit, _), dS_out = jax.lax.scan(step, (dfinal, None), xs + (None,) * 3, reverse=True)
  else:
    xs += tuple(seg[:3])
    carry = (jnp.zeros((1,) + init.shape[1:], init.dtype),
             jnp.where(_bcast(seg.empty, dfinal), dfinal, 0.0))
    (_, dinit), dS_out = jax.lax.scan(step, carry, xs, reverse=True)

  u = it.U - jnp.matmul(it.w, S, precision=prec)
  du = jnp.matmul(it.P.mT, do, precision=prec) + jnp.matmul(it.kd, dS_out, precision=prec)
  d = Intra(w=-jnp.matmul(du, S.mT, precision=prec), U=du,
            P=jnp.where(_causal(G.shape[-2], strict=False),
                        jnp.matmul(do, u.mT, precision=prec), 0.0),
            qg=jnp.matmul(do, S.mT, precision=prec),
            kd=jnp.matmul(u, dS_out.mT, precision=prec),
            dec=_to_gate(jnp.sum(dS_out * S, -1), G))
  dq, dk, dv, dG, db = _over_chunks(lambda *a: _intra_bwd(*a[:5], prec, Intra(*a[5:])),
                                    q, k, v, G, beta, *d)
  dg = jnp.flip(jnp.cumsum(jnp.flip(dG, -2), -2), -2)  # G = cumsum(g)
  return dq, dk, dv, dg, db, dinit, None


chunked.defvjp(_chunked_fwd, _chunked_bwd)


# ---------------------------------------------------------------------------------------
# Layout: [B,T,HV,D] tokens <-> [NC,B,HV,C,D] chunks.


def _to_chunks(x, c):
  b, t = x.shape[:2]
  nc = -(-t // c)
  x = jnp.pad(x, ((0, 0), (0, nc * c - t)) + ((0, 0),) * (x.ndim - 2))
  x = x.reshape((b, nc, c) + x.shape[2:])
  return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)


def _from_chunks(x, t):
  nc, b, hv, c = x.shape[:4]
  x = jnp.moveaxis(jnp.moveaxis(x, 3, 2), 0, 1)
  return x.reshape((b, nc * c, hv) + x.shape[4:])[:, :t]


class Packing(NamedTuple):
  token: jax.Array  # [NC*C] int32: the token each padded slot reads
  valid: jax.Array  # [NC*C] bool
  slot: jax.Array   # [T] int32: the padded slot of each token
  inside: jax.Array  # [T] bool: token lies in some sequence
  seg: Segments


def _packing(cu_seqlens, t, c):
  """Lays packed sequences out so each starts on a chunk boundary (no Python loops)."""
  cu = jnp.asarray(cu_seqlens, jnp.int32)
  n = cu.shape[0] - 1
  lens = cu[1:] - cu[:-1]
  start = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(-(-lens // c))])
  nc = (t + n * (c - 1)) // c  # enough chunks for any lengths summing to <= t
  chunk = jnp.arange(nc, dtype=jnp.int32)
  in_use = chunk < start[-1]
  seq = jnp.minimum(jnp.searchsorted(start[1:], chunk, side="right"), n - 1).astype(jnp.int32)
  pos = (chunk - start[seq])[:, None] * c + jnp.arange(c, dtype=jnp.int32)
  valid = in_use[:, None] & (pos < lens[seq][:, None])
  token = jnp.clip(cu[seq][:, None] + pos, 0, max(t - 1, 0))
  i = jnp.arange(t, dtype=jnp.int32)
  s = jnp.minimum(jnp.searchsorted(cu[1:], i, side="right"), n - 1)
  seg = Segments(reset=(in_use & (chunk == start[seq]))[:, None], seq=seq[:, None],
                 last=(in_use & (chunk == start[seq + 1] - 1))[:, None], empty=lens == 0)
  return Packing(token.reshape(-1), valid.reshape(-1), start[s] * c + i - cu[s],
                 (i >= cu[0]) & (i < cu[-1]), seg)


def _gather(x, index, valid):
  """x [1,T,...] -> [1,len(index),...], zero where not valid."""
  y = jnp.take(x[0], index, axis=0)
  return jnp.where(_bcast(valid, y), y, jnp.zeros((), y.dtype))[None]


# ---------------------------------------------------------------------------------------
# The engine entry point.


def kda(q, k, v, g, beta, *, scale, initial_state=None, qk_l2norm=False,
        gate_in_kernel=False, a_log=None, dt_bias=None, lower_bound=None,
        beta_sigmoid=False, allow_neg_eigval=False, cu_seqlens=None, chunk_size=64):
  """Returns ``(o [B,T,HV,V] in q's dtype, final_state [N,HV,K,V] float32)``.

  Validated inputs: q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K] or, for a scalar gate,
  [B,T,HV,1]; beta [B,T,HV]; initial_state [N,HV,K,V] or None; cu_seqlens [N+1] or None.
  """
  b, t, h, kdim = q.shape
  hv, vdim = v.shape[2], v.shape[3]
  dtype, prec = q.dtype, matmul_precision(q.dtype)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  q, k, v, g, beta = map(f32, (q, k, v, g, beta))
  if qk_l2norm:
    q, k = l2norm(q), l2norm(k)
  q, k = (jnp.repeat(x, hv // h, axis=2) for x in (q * scale, k))  # value head -> q/k head
  if gate_in_kernel:
    g = gate(g, a_log, dt_bias, lower_bound)
  if beta_sigmoid:
    beta = (2.0 if allow_neg_eigval else 1.0) * jax.nn.sigmoid(beta)
  beta = beta[..., None]

  n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
  init = (jnp.zeros((n, hv, kdim, vdim), jnp.float32) if initial_state is None
          else f32(initial_state))
  seg = None
  xs = (q, k, v, g, beta)
  if cu_seqlens is not None:
    pack = _packing(cu_seqlens, t, chunk_size)
    xs = tuple(_gather(x, pack.token, pack.valid) for x in xs)
    seg = pack.seg
  xs = tuple(_to_chunks(x, chunk_size) for x in xs)
  o, final = chunked(prec, *xs, init, seg)
  o = _from_chunks(o, xs[0].shape[0] * chunk_size)
  o = o[:, :t] if cu_seqlens is None else _gather(o, pack.slot, pack.inside)
  return o.astype(dtype), final
