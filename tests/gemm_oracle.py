"""Float64 oracles for gemm, grouped_gemm and moe_mlp (SPEC section 4), written apart from
the library: NumPy loops for values, dense jax.numpy forms (run under x64) for gradients.
"""

import jax
import jax.numpy as jnp
import numpy as np
import scipy.special

# Every epilogue as (activation, glu); "none" is the plain product.
EPILOGUES = [(None, None), ("relu", None), ("gelu", None), ("gelu_tanh", None),
             ("silu", None), ("srelu", None), (None, "swiglu"), (None, "geglu"),
             (None, "reglu")]
EPILOGUE_IDS = [act or glu or "none" for act, glu in EPILOGUES]


def f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _activations(xp, erf):
  def gelu_tanh(x):
    return 0.5 * x * (1 + xp.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
  return {
      "relu": lambda x: xp.maximum(x, 0),
      "gelu": lambda x: 0.5 * x * (1 + erf(x / np.sqrt(2))),
      "gelu_tanh": gelu_tanh,
      "silu": lambda x: x / (1 + xp.exp(-x)),
      "srelu": lambda x: xp.maximum(x, 0) ** 2,
  }


_GLU_GATE = {"swiglu": "silu", "geglu": "gelu", "reglu": "relu"}


def epilogue(h, bias=None, activation=None, glu=None, xp=np):
  """``act(h + bias)`` or ``act(gate) * up``; NumPy, or jax.numpy with ``xp=jnp``."""
  acts = _activations(xp, scipy.special.erf if xp is np else jax.scipy.special.erf)
  if bias is not None:
    h = h + bias
  if glu is not None:
    n = h.shape[-1] // 2
    return acts[_GLU_GATE[glu]](h[..., :n]) * h[..., n:]
  return h if activation is None else acts[activation](h)


def gemm(a, b, bias=None, activation=None, glu=None):
  a, b = f64(a), f64(b)
  return epilogue(a @ b, None if bias is None else f64(bias), activation, glu)


def grouped_gemm(lhs, rhs, group_sizes, bias=None, activation=None, glu=None):
  """Group by group, NumPy float64; rows past sum(group_sizes) are 0."""
  lhs, rhs = f64(lhs), f64(rhs)
  n = rhs.shape[2] // (2 if glu else 1)
  out = np.zeros((lhs.shape[0], n))
  start = 0
  for g, size in enumerate(np.asarray(group_sizes)):
    rows = slice(start, min(start + int(size), lhs.shape[0]))
    b = None if bias is None else f64(bias)[g]
    out[rows] = epilogue(lhs[rows] @ rhs[g], b, activation, glu)
    start += int(size)
  return out


def grouped_gemm_dense(lhs, rhs, group_sizes, bias=None, activation=None, glu=None):
  """jax.numpy form for autodiff (call under x64): each row gathers its group's weights."""
  g = rhs.shape[0]
  gid = jnp.sum(jnp.arange(lhs.shape[0])[:, None] >= jnp.cumsum(group_sizes)[None, :], 1)
  valid = gid < g
  gid = jnp.minimum(gid, g - 1)
  h = jnp.einsum("mk,mkn->mn", lhs, rhs[gid])
  y = epilogue(h, None if bias is None else bias[gid], activation, glu, xp=jnp)
  return jnp.where(valid[:, None], y, 0)


def moe_mlp(x, expert_indices, expert_weights, w_up, w_down, glu="swiglu", activation=None):
  """Token by token, choice by choice, NumPy float64."""
  x, w, w_up, w_down = (f64(v) for v in (x, expert_weights, w_up, w_down))
  idx = np.asarray(expert_indices)
  out = np.zeros_like(x)
  for t in range(x.shape[0]):
    for j in range(idx.shape[1]):
      e = idx[t, j]
      if 0 <= e < w_up.shape[0]:
        out[t] += w[t, j] * (epilogue(x[t] @ w_up[e], None, activation, glu) @ w_down[e])
  return out


def moe_mlp_dense(x, expert_indices, expert_weights, w_up, w_down, glu="swiglu",
                  activation=None):
  """jax.numpy form for autodiff (call under x64): each pair gathers its expert."""
  e = w_up.shape[0]
  valid = (expert_indices >= 0) & (expert_indices < e)
  idx = jnp.clip(expert_indices, 0, e - 1)
  h = epilogue(jnp.einsum("td,tkdc->tkc", x, w_up[idx]), None, activation, glu, xp=jnp)
  y = jnp.einsum("tkf,tkfd->tkd", h, w_down[idx])
  return jnp.einsum("tkd,tk->td", y, jnp.where(valid, expert_weights, 0))


def grads64(fn, args, argnums, cotangent, **kwargs):
  """Float64 gradients of ``sum(fn(*args) * cotangent)`` with respect to ``argnums``."""
  with jax.enable_x64(True):
    args = [jnp.asarray(f64(a)) if i in argnums else jnp.asarray(a)
            for i, a in enumerate(args)]
    loss = lambda *a: jnp.sum(fn(*a, **kwargs) * jnp.asarray(f64(cotangent)))
    return [np.asarray(g) for g in jax.grad(loss, argnums=argnums)(*args)]
