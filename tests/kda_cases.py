"""Random cases for cudnn_jax.kda / cudnn_jax.gdn and how to run them on the engine and the
float64 oracle (shared by the CPU and GPU tests)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import cudnn_jax
from kda_oracle import oracle

DIFFERENTIABLE = ("q", "k", "v", "g", "beta", "initial_state", "a_log", "dt_bias")
TOL = {"float32": dict(rtol=2e-4, atol=2e-4), "bfloat16": dict(rtol=3e-2, atol=3e-2)}


@dataclasses.dataclass(frozen=True)
class Config:
  op: str = "kda"
  b: int = 2
  t: int = 40
  h: int = 2
  hv: int = 2
  k: int = 8
  v: int = 16
  dtype: str = "float32"
  scale: float | None = None
  initial_state: bool = False
  l2norm: bool = False
  gate: str | None = None  # None (g is the log decay), "softplus", "lower_bound"
  a_log: bool = True  # with gate="lower_bound", a_log may be left out
  dt_bias: bool = False
  lower_bound: float = -5.0
  beta_sigmoid: bool = False
  neg_eig: bool = False
  cu_seqlens: tuple | None = None  # then b is 1 and t is cu_seqlens[-1]
  chunk_size: int = 64
  engine: str = "xla"  # the implementation= the op runs on


def make_case(cfg: Config, seed=0):
  """(arrays, kwargs): the op's arguments, NumPy arrays for every array argument."""
  rng = np.random.default_rng(seed)
  b, t = (1, cfg.cu_seqlens[-1]) if cfg.cu_seqlens else (cfg.b, cfg.t)
  n = len(cfg.cu_seqlens) - 1 if cfg.cu_seqlens else b
  f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  q, k = f32(b, t, cfg.h, cfg.k), f32(b, t, cfg.h, cfg.k)
  if not cfg.l2norm:  # unit keys keep the delta rule contractive
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
  g_shape = (b, t, cfg.hv) + (() if cfg.op == "gdn" else (cfg.k,))
  g = (f32(*g_shape) if cfg.gate
       else -rng.uniform(0.02, 0.6, g_shape).astype(np.float32))
  beta = (f32(b, t, cfg.hv) if cfg.beta_sigmoid
          else rng.uniform(0.1, 1.0, (b, t, cfg.hv)).astype(np.float32))
  arrays = dict(q=q, k=k, v=f32(b, t, cfg.hv, cfg.v), g=g, beta=beta)
  if cfg.initial_state:
    arrays["initial_state"] = f32(n, cfg.hv, cfg.k, cfg.v)
  if cfg.gate and (cfg.a_log or cfg.gate == "softplus"):
    arrays["a_log"] = (0.5 * f32(cfg.hv)).astype(np.float32)
  if cfg.gate and cfg.dt_bias:
    arrays["dt_bias"] = f32(cfg.hv * (1 if cfg.op == "gdn" else cfg.k))
  kwargs = dict(scale=cfg.scale, output_final_state=True, use_qk_l2norm_in_kernel=cfg.l2norm,
                use_gate_in_kernel=cfg.gate is not None,
                lower_bound=cfg.lower_bound if cfg.gate == "lower_bound" else None,
                use_beta_sigmoid_in_kernel=cfg.beta_sigmoid, allow_neg_eigval=cfg.neg_eig,
                chunk_size=cfg.chunk_size)
  if cfg.cu_seqlens:
    arrays["cu_seqlens"] = np.asarray(cfg.cu_seqlens, np.int32)
  if cfg.dtype != "float32":
    for name in ("q", "k", "v"):
      arrays[name] = jnp.asarray(arrays[name], cfg.dtype)
  return arrays, kwargs


def call_op(op, arrays, kwargs, engine="xla"):
  q, k, v, g, beta = (arrays[n] for n in ("q", "k", "v", "g", "beta"))
  rest = {n: x for n, x in arrays.items() if n not in ("q", "k", "v", "g", "beta")}
  return getattr(cudnn_jax, op)(q, k, v, g, beta, implementation=engine, **rest, **kwargs)


@functools.lru_cache(maxsize=None)
def _jitted(op, engine, kwargs):
  return jax.jit(lambda arrays: call_op(op, arrays, dict(kwargs), engine))


def run(cfg, arrays, kwargs):
  """The op on ``arrays`` (a dict of its array arguments) on ``cfg.engine``, jitted, or
  traced when inside jit."""
  return _jitted(cfg.op, cfg.engine, tuple(sorted(kwargs.items())))(arrays)


def run_oracle(arrays, kwargs):
  as_f64 = lambda x: np.asarray(x if isinstance(x, np.ndarray) else jnp.asarray(x, jnp.float32),
                                np.float64)
  return oracle(**{n: as_f64(x) if n != "cu_seqlens" else x for n, x in arrays.items()},
                **kwargs)


def assert_close(actual, expected, dtype="float32", what=""):
  actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
  np.testing.assert_allclose(actual, expected, err_msg=what, **TOL[dtype])


def check_gradients(cfg, arrays, kwargs, *, rtol, atol, seed=0):
  """Gradients of a random linear loss of (o, final_state) against float64 central
  differences of the oracle, along one random direction per differentiable input:
  ``|got - expected| <= rtol |expected| + atol ||grad|| ||direction||``."""
  ref_o, ref_final = run_oracle(arrays, kwargs)
  rng = np.random.default_rng(seed + 100)
  w_o, w_f = rng.standard_normal(ref_o.shape), rng.standard_normal(ref_final.shape)
  diff = {n: x for n, x in arrays.items() if n in DIFFERENTIABLE}
  fixed = {n: x for n, x in arrays.items() if n not in DIFFERENTIABLE}

  def loss(d):
    o, final = run(cfg, {**d, **fixed}, kwargs)
    return jnp.sum(o * w_o.astype(np.float32)) + jnp.sum(final * w_f.astype(np.float32))

  grads = jax.jit(jax.grad(loss))(diff)

  def oracle_loss(d):
    o, final = run_oracle({**d, **fixed}, kwargs)
    return np.sum(o * w_o) + np.sum(final * w_f)

  eps = 1e-5
  for name, x in diff.items():
    x = np.asarray(x, np.float64)
    direction = rng.standard_normal(x.shape)
    expected = (oracle_loss({**diff, name: x + eps * direction})
                - oracle_loss({**diff, name: x - eps * direction})) / (2 * eps)
    got = float(np.sum(np.asarray(grads[name], np.float64) * direction))
    scale = np.linalg.norm(grads[name]) * np.linalg.norm(direction)
    assert np.all(np.isfinite(np.asarray(grads[name]))), name
    assert abs(got - expected) <= rtol * abs(expected) + atol * scale, (name, got, expected)


def check_intra_kernel(intra, c, kd, vd, dt, steep=False, lead=(2, 3)):
  """``intra(q, k, v, G, b, dt)`` (a kernel for ``reference.kda.intra``) against the
  reference on random chunks, every output: gates that decay gently, or by up to e^-5 a
  token (steep: pair factors that underflow)."""
  from cudnn_jax.reference import kda as ref  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(c + kd + steep)
  f32 = lambda *s: jnp.asarray(rng.standard_normal(lead + s), jnp.float32)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q, k, v = unit(f32(c, kd)) * kd**-0.5, unit(f32(c, kd)), f32(c, vd)
  decay = jnp.asarray(rng.random(lead + (c, kd)), jnp.float32) * (5.0 if steep else 0.5)
  G = jnp.cumsum(-decay, -2)
  b = jnp.asarray(rng.random(lead + (c, 1)), jnp.float32)
  dt = jnp.dtype(dt)
  want = ref.intra(q, k, v, G, b, dt)
  got = intra(q, k, v, G, b, dt)
  # bfloat16: both round the pair products' operands, at different points.
  tol = 1e-5 if dt == jnp.float32 else 1e-2
  for name, g_, w_ in zip(got._fields, got, want):
    assert g_.shape == w_.shape, name
    np.testing.assert_allclose(g_, w_, rtol=tol, atol=tol * float(jnp.max(jnp.abs(w_))),
                               err_msg=name)
