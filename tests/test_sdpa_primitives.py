"""The cuDNN SDPA primitives' own rules (VJP, batching, partitioning), on any backend.

Off the GPU the primitives lower to plain JAX, so these tests check the rules around the
FFI call against the xla engine with no GPU present.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from cudnn_jax.primitives import sdpa as prim
from mesh_cases import assert_no_collectives, mesh_or_skip

B, T, S, N, K, H = 4, 16, 24, 4, 2, 32


def _inputs(seed=0):
  ks = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(ks[0], (B, T, N, H))
  k = jax.random.normal(ks[1], (B, S, K, H))
  v = jax.random.normal(ks[2], (B, S, K, H + 8))
  bias = jax.random.normal(ks[3], (1, N, T, S))
  return q, k, v, bias


Q_LENS = jnp.array([16, 10, 5, 1], jnp.int32)
KV_LENS = jnp.array([24, 3, 20, 0], jnp.int32)
CONFIG = prim.SdpaConfig(scale=0.2, causal=True, bottom_right=True, window_left=7,
                         has_bias=True, has_padding=True, has_dbias=True)


def _prim(q, k, v, bias):
  return prim.attention(CONFIG, lambda: None, q, k, v, bias, Q_LENS, KV_LENS)


def _ref(q, k, v, bias):
  return prim._reference(CONFIG, q, k, v, bias, Q_LENS, KV_LENS)


def _close(a, b, tol=1e-5):
  a, b = np.asarray(a), np.asarray(b)
  finite = np.isfinite(b)
  np.testing.assert_array_equal(np.isfinite(a), finite)
  np.testing.assert_allclose(a[finite], b[finite], atol=tol, rtol=tol)


def _loss(fn, ct):
  return lambda *a: jnp.sum(fn(*a)[0] * ct)


def _check_gradients(fn, seed, q, k, v, bias):
  """Gradients of every input of ``fn`` against the reference's, under jit."""
  ct = jax.random.normal(jax.random.key(seed), (B, T, N, H + 8))
  got = jax.jit(jax.grad(_loss(fn, ct), argnums=(0, 1, 2, 3)))(q, k, v, bias)
  want = jax.grad(_loss(_ref, ct), argnums=(0, 1, 2, 3))(q, k, v, bias)
  for a, b in zip(got, want):
    _close(a, b)


def test_forward_and_vjp_match_reference():
  q, k, v, bias = _inputs()
  for a, b in zip(jax.jit(_prim)(q, k, v, bias), _ref(q, k, v, bias)):
    _close(a, b)
  _check_gradients(_prim, 9, q, k, v, bias)


def test_without_lse_returns_out_alone_and_same_gradients():
  q, k, v, bias = _inputs(5)
  config = dataclasses.replace(CONFIG, with_lse=False)
  no_lse = lambda *a: prim.attention(config, lambda: None, *a, Q_LENS, KV_LENS)
  got = jax.jit(no_lse)(q, k, v, bias)
  assert len(got) == 1
  _close(got[0], _ref(q, k, v, bias)[0])
  # vmapped: the batching rule keeps the single result
  got_v = jax.jit(jax.vmap(no_lse, in_axes=(0, None, None, None)))(q[None], k, v, bias)
  _close(got_v[0][0], got[0])
  _check_gradients(no_lse, 8, q, k, v, bias)


def test_lse_cotangent_falls_back_to_reference_vjp():
  q, k, v, bias = _inputs(1)
  loss = lambda fn: lambda q: jnp.sum(jnp.where(jnp.isfinite(fn(q, k, v, bias)[1]),
                                                fn(q, k, v, bias)[1], 0.0))
  _close(jax.grad(loss(_prim))(q), jax.grad(loss(_ref))(q))


@pytest.mark.parametrize("bias_batched", [False, True])
def test_vmap_folds_into_batch(bias_batched):
  q, k, v, bias = _inputs(2)
  V = 3
  qv = jax.random.normal(jax.random.key(3), (V,) + q.shape)
  bv = jax.random.normal(jax.random.key(4), (V,) + bias.shape) if bias_batched else bias
  in_axes = (0, 0 if bias_batched else None)
  f = lambda fn: lambda q, b: jnp.sum(jax.vmap(lambda q, b: fn(q, k, v, b)[0],
                                               in_axes=in_axes)(q, b) ** 2)
  got = jax.jit(jax.grad(f(_prim), (0, 1)))(qv, bv)
  want = jax.grad(f(_ref), (0, 1))(qv, bv)
  for a, b in zip(got, want):
    _close(a, b, 1e-4)


@pytest.mark.parametrize("with_lse", [True, False])
def test_batch_and_head_sharding_stay_local(with_lse):
  mesh = mesh_or_skip((4, 2), ("data", "model"), "Explicit")
  q, k, v, bias = _inputs(5)
  bshd = NamedSharding(mesh, P("data", None, "model", None))
  args = [jax.device_put(x, bshd) for x in (q, k, v)]
  args.append(jax.device_put(bias, NamedSharding(mesh, P(None, "model", None, None))))
  config = dataclasses.replace(CONFIG, with_lse=with_lse)
  fwd = jax.jit(lambda *a: prim.attention(config, lambda: None, *a, Q_LENS, KV_LENS))
  out, *lse = fwd(*args)
  assert len(lse) == with_lse
  _close(out, _ref(q, k, v, bias)[0])
  assert tuple(out.sharding.spec)[:3] == ("data", None, "model")
  assert_no_collectives(fwd, *args)


def test_ffi_calls_take_a_workspace_result_sized_by_the_extension(monkeypatch):
  """The handlers' workspace is an extra u8 result sized by ``_ffi.sdpa_workspace`` for the
  call's own (local) shapes, and the primitives hand back only the real results."""
  from cudnn_jax import _extension  # pylint: disable=g-import-not-at-top
  queries = []

  class FakeModule:
    @staticmethod
    def sdpa_workspace(query):
      queries.append(query)
      return 3000 if query["backward"] else 0

  monkeypatch.setattr(_extension, "module", FakeModule)
  q, k, v, bias = _inputs()
  extras = (bias, Q_LENS, KV_LENS)
  outs = jax.eval_shape(lambda *a: prim._fwd_ffi(CONFIG, *a), q, k, v, *extras)
  assert [o.shape for o in outs] == [(B, T, N, H + 8), (B, N, T)]
  grads = jax.eval_shape(lambda *a: prim._bwd_ffi(CONFIG, *a), q, k, v, outs[0], outs[0],
                         outs[1], *extras)
  assert [g.shape for g in grads] == [q.shape, k.shape, v.shape, bias.shape]
  fwd, bwd = queries
  assert (fwd["backward"], bwd["backward"]) == (False, True)
  assert {key: fwd[key] for key in ("b", "t", "s", "n", "k", "h", "hv", "bias_b", "bias_n")} == (
      dict(b=B, t=T, s=S, n=N, k=K, h=H, hv=H + 8, bias_b=1, bias_n=N))
