"""cudnn_jax.sdpa with context parallelism (the sequence sharded over a mesh axis) on the
8-device CPU mesh: equal to the unsharded call, gradients included, under jax.jit and
called eagerly, on meshes of either axis type, with inputs sharded along the axis or not."""

import dataclasses
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

# Where the inputs live: sharded along the batch and the context-parallel axis, along the
# batch only, or NumPy arrays (placed by the call itself).
PLACEMENTS = {"sequence": P("data", "cp"), "batch": P("data"), "numpy": None}


def inputs(seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((2, 32, 4, 16)).astype(np.float32)
  k = rng.standard_normal((2, 32, 2, 16)).astype(np.float32)
  v = rng.standard_normal((2, 32, 2, 8)).astype(np.float32)
  return q, k, v


def check_equals_unsharded(mesh, strategy, kwargs, placement, jit):
  """Values, lse and gradients of the context-parallel call (inside jax.set_mesh, jitted
  or eager) against the unsharded one; out is sharded along the sequence on ``cp``."""
  q, k, v = inputs()
  ct = np.random.default_rng(1).standard_normal((2, 32, 4, 8)).astype(np.float32)
  attention = functools.partial(cudnn_jax.sdpa, return_lse=True, implementation="xla",
                                **kwargs)

  def loss(attend, q, k, v):
    out, lse = attend(q, k, v)
    return jnp.sum(out * ct) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

  parallel = functools.partial(attention, context_parallel_axis="cp",
                               context_parallel_strategy=strategy)
  wrap = jax.jit if jit else (lambda f: f)
  with jax.set_mesh(mesh):
    spec = PLACEMENTS[placement]
    args = [x if spec is None else jax.device_put(x, NamedSharding(mesh, spec))
            for x in (q, k, v)]
    out, lse = wrap(parallel)(*args)
    grads = wrap(jax.grad(functools.partial(loss, parallel), argnums=(0, 1, 2)))(*args)
  want_out, want_lse = attention(q, k, v)
  want_grads = jax.grad(functools.partial(loss, attention), argnums=(0, 1, 2))(q, k, v)
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
  assert out.sharding.spec[1] == "cp", out.sharding
  if placement != "numpy":
    assert out.sharding.spec[0] == "data", out.sharding
  for g, w in zip(grads, want_grads):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
@pytest.mark.parametrize("name", CASES)
def test_context_parallel_equals_unsharded(strategy, name):
  mesh = mesh_or_skip((2, 4), ("data", "cp"))
  check_equals_unsharded(mesh, strategy, CASES[name], "sequence", jit=True)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_context_parallel_eager(strategy, axis_type, placement):
  """Called outside jax.jit: the same values and gradients, whatever the inputs' sharding."""
  mesh = mesh_or_skip((2, 4), ("data", "cp"), axis_type)
  check_equals_unsharded(mesh, strategy, CASES["causal_sinks_softcap"], placement, jit=False)


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_context_parallel_on_explicit_mesh_under_jit(strategy):
  mesh = mesh_or_skip((2, 4), ("data", "cp"), "Explicit")
  check_equals_unsharded(mesh, strategy, CASES["causal_window"], "batch", jit=True)


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_context_parallel_along_an_automatic_axis_beside_explicit_ones(strategy):
  """A model's mesh may type its batch axis explicitly and leave the context axis
  automatic: values and gradients are the unsharded call's."""
  axis_types = (jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto)
  mesh = jax.make_mesh((2, 4), ("data", "cp"), axis_types=axis_types)
  q, k, v = inputs()
  call = functools.partial(cudnn_jax.sdpa, is_causal=True, implementation="xla")
  loss = lambda f, q: jnp.sum(jnp.sin(f(q, k, v)))
  with jax.set_mesh(mesh):
    q_sharded = jax.device_put(q, NamedSharding(mesh, P("data")))
    parallel = functools.partial(call, context_parallel_axis="cp",
                                 context_parallel_strategy=strategy)
    out = jax.jit(parallel)(q_sharded, k, v)
    grad = jax.jit(jax.grad(functools.partial(loss, parallel)))(q_sharded)
  np.testing.assert_allclose(out, call(q, k, v), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(grad, jax.grad(functools.partial(loss, call))(q), rtol=1e-4,
                             atol=1e-5)


def test_context_parallel_takes_the_mesh_of_sharded_inputs():
  """Without jax.set_mesh, the mesh the inputs are sharded on names the axis."""
  for axis_type in ("Auto", "Explicit"):
    mesh = mesh_or_skip((2, 4), ("data", "cp"), axis_type)
    q, k, v = inputs()
    args = [jax.device_put(x, NamedSharding(mesh, P("data", "cp"))) for x in (q, k, v)]
    call = functools.partial(cudnn_jax.sdpa, is_causal=True, implementation="xla")
    want = call(q, k, v)
    for wrap in (lambda f: f, jax.jit):
      out = wrap(functools.partial(call, context_parallel_axis="cp"))(*args)
      np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


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
  with pytest.raises(ValueError, match="context_parallel_axis"):
    call(q, k, v)  # no mesh anywhere


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
@pytest.mark.parametrize("case", ["full", "causal", "causal_window"])
def test_explain_judges_each_devices_call(monkeypatch, strategy, case):
  """explain describes the context-parallel call and judges the engines on the call each
  device makes, which is the call the op dispatches there."""
  from cudnn_jax import engines  # pylint: disable=g-import-not-at-top
  mesh = mesh_or_skip((2, 4), ("data", "cp"))
  q, k, v = inputs()
  kwargs = dict(CASES[case], context_parallel_axis="cp", context_parallel_strategy=strategy)
  with jax.set_mesh(mesh):
    structs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    text = cudnn_jax.explain("sdpa", *structs, **kwargs)
    dispatched = []
    choose = engines.choose
    monkeypatch.setattr(engines, "choose", lambda op, call, impl: (
        dispatched.append(call), choose(op, call, impl))[1])
    jax.jit(functools.partial(cudnn_jax.sdpa, **kwargs)).lower(q, k, v)
  assert f"context parallel along mesh axis 'cp' (4 devices), strategy {strategy!r}" in text
  assert "'xla' serves each device's call" in text
  from cudnn_jax.ops import sdpa as sdpa_module  # pylint: disable=g-import-not-at-top
  call, _ = sdpa_module.prepare(q, k, v, **{n: a for n, a in kwargs.items()
                                            if n != "context_parallel_axis"})
  want = sdpa_module._explained(  # pylint: disable=protected-access
      dataclasses.replace(call, context_parallel=("cp", strategy, 4)))[1]
  assert set(dispatched) == {want}
