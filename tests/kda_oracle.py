"""A float64 NumPy oracle for ``cudnn_jax.kda`` / ``cudnn_jax.gdn`` (SPEC section 2).

The token-by-token recurrence, independent of the library: ``oracle(q, k, v, g, beta,
**kwargs)`` takes the op's arguments (``g [B,T,HV]`` means the scalar gate of ``gdn``) and
returns ``(o [B,T,HV,V], final_state [N,HV,K,V])`` as float64 arrays.
"""

from __future__ import annotations

import numpy as np


def _f64(x):
  return None if x is None else np.asarray(x, np.float64)


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _softplus(x):
  return np.logaddexp(0.0, x)


def _l2norm(x):
  return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _gate(g, a_log, dt_bias, lower_bound):
  """g [B,T,HV,Kg] raw -> log decay (SPEC's use_gate_in_kernel)."""
  hv = g.shape[2]
  x = g if dt_bias is None else g + dt_bias.reshape(hv, -1)
  if lower_bound is None:
    return -np.exp(a_log)[:, None] * _softplus(x)
  if a_log is not None:
    x = np.exp(a_log)[:, None] * x
  return lower_bound * _sigmoid(x)


def _run(q, k, v, g, beta, S):
  """One sequence: q, k [T,HV,K] (q scaled), v [T,HV,V], g [T,HV,Kg], beta [T,HV]."""
  o = np.zeros(v.shape)
  S = S.copy()
  for t in range(q.shape[0]):
    S = np.exp(g[t])[:, :, None] * S
    err = v[t] - np.einsum("hk,hkv->hv", k[t], S)
    S = S + beta[t][:, None, None] * k[t][:, :, None] * err[:, None, :]
    o[t] = np.einsum("hk,hkv->hv", q[t], S)
  return o, S


def oracle(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
           use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, a_log=None,
           dt_bias=None, lower_bound=None, use_beta_sigmoid_in_kernel=False,
           allow_neg_eigval=False, cu_seqlens=None, chunk_size=64, implementation=None):
  del output_final_state, chunk_size, implementation
  q, k, v, g, beta = map(_f64, (q, k, v, g, beta))
  a_log, dt_bias = _f64(a_log), _f64(dt_bias)
  if g.ndim == 3:
    g = g[..., None]
  b, t, h, kdim = q.shape
  hv = v.shape[2]
  if use_qk_l2norm_in_kernel:
    q, k = _l2norm(q), _l2norm(k)
  q = q * (kdim ** -0.5 if scale is None else scale)
  q, k = np.repeat(q, hv // h, axis=2), np.repeat(k, hv // h, axis=2)
  if use_gate_in_kernel:
    g = _gate(g, a_log, dt_bias, lower_bound)
  if use_beta_sigmoid_in_kernel:
    beta = (2.0 if allow_neg_eigval else 1.0) * _sigmoid(beta)

  if cu_seqlens is None:
    spans = [(i, 0, t) for i in range(b)]
  else:
    cu = np.asarray(cu_seqlens).astype(np.int64)
    # SPEC section 8: a sequence out of order or out of the rows is empty.
    served = lambda i: 0 <= cu[i] <= cu[i + 1] <= t and cu[i] >= max(cu[:i], default=0)
    spans = [(0, cu[i], cu[i + 1]) if served(i) else (0, 0, 0) for i in range(len(cu) - 1)]
  n = len(spans)
  S0 = (np.zeros((n, hv, kdim, v.shape[3])) if initial_state is None
        else _f64(initial_state))
  o = np.zeros(v.shape)
  final = np.zeros(S0.shape)
  for i, (row, lo, hi) in enumerate(spans):
    part = lambda x: x[row, lo:hi]
    o[row, lo:hi], final[i] = _run(*map(part, (q, k, v, g, beta)), S0[i])
  return o, final
