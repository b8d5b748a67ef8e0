"""cudnn_jax.sdpa with context parallelism (the sequence sharded over a mesh axis) on the
8-device CPU mesh: equal to the unsharded call, gradients included."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cudnn_jax
from mesh_cases import mesh_or_skip

CASES = {
    "full": dict(),
    "causal": dict(is_causal=True),
    "causal_window": dict(is_causal=True, local_window_size=(5, 0)),
    "causal_sinks_softcap": dict(is_causal=True, logits_soft_cap=2.0,
                                 sinks=np.array([0.5, -1.0, 0.0, 1.5], np.float32)),
}


def inputs(seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((2, 32, 4, 16)).astype(np.float32)
  k = rng.standard_normal((2, 32, 2, 16)).astype(np.float32)
  v = rng.standard_normal((2, 32, 2, 8)).astype(np.float32)
  return q, k, v


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
@pytest.mark.parametrize("name", CASES)
def test_context_parallel_equals_unsharded(strategy, name):
  mesh = mesh_or_skip((2, 4), ("data", "cp"))
  kwargs = CASES[name]
  q, k, v = inputs()
  ct = np.random.default_rng(1).standard_normal((2, 32, 4, 8)).astype(np.float32)
  attention = functools.partial(cudnn_jax.sdpa, return_lse=True, implementation="xla",
                                **kwargs)

  def loss(attend, q, k, v):
    out, lse = attend(q, k, v)
    return jnp.sum(out * ct) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

  parallel = functools.partial(attention, context_parallel_axis="cp",
                               context_parallel_strategy=strategy)
  with jax.set_mesh(mesh):
    tokens = NamedSharding(mesh, P("data", "cp"))
    args = [jax.device_put(x, tokens) for x in (q, k, v)]
    out, lse = jax.jit(parallel)(*args)
    grads = jax.jit(jax.grad(functools.partial(loss, parallel), argnums=(0, 1, 2)))(*args)
  want_out, want_lse = attention(q, k, v)
  want_grads = jax.grad(functools.partial(loss, attention), argnums=(0, 1, 2))(q, k, v)
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
  assert out.sharding.is_equivalent_to(tokens, out.ndim)
  for g, w in zip(grads, want_grads):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_context_parallel_declines_what_it_does_not_serve():
  mesh = mesh_or_skip((2, 4), ("data", "cp"))
  q, k, v = inputs()
  call = functools.partial(cudnn_jax.sdpa, context_parallel_axis="cp")
  with jax.set_mesh(mesh):
    with pytest.raises(cudnn_jax.UnsupportedError, match="bias"):
      call(q, k, v, bias=np.zeros((1, 4, 32, 32), np.float32))
    with pytest.raises(cudnn_jax.UnsupportedError, match="window"):
      call(q, k, v, local_window_size=(3, 3))
    with pytest.raises(ValueError, match="context_parallel_axis"):
      call(q, k, v, context_parallel_axis="nope")
    with pytest.raises(ValueError, match="context_parallel_strategy"):
      call(q, k, v, context_parallel_strategy="tree")
