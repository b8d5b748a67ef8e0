"""cudnn_jax.conv3d ("xla" engine) against a float64 NumPy oracle written apart from it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cudnn_jax
from conv3d_oracle import assert_gradients_match, case, normal, oracle
from mesh_cases import assert_no_collectives, mesh_or_skip


CASES = [
    ("same", dict()),
    ("valid_strided", dict(padding="VALID", strides=(1, 2, 2))),
    ("causal_dilated", dict(padding="CAUSAL", dilation=(2, 1, 2))),
    ("explicit", dict(padding=((2, 0), (1, 2), (0, 1)), strides=(2, 1, 3))),
    ("rms_silu", dict(norm="rms", activation="silu")),
    ("l2_gelu", dict(norm="l2", activation="gelu", padding="CAUSAL")),
    ("group_relu", dict(norm="group", num_groups=4, activation="relu")),
]


@pytest.mark.parametrize("kwargs", [k for _, k in CASES], ids=[n for n, _ in CASES])
def test_matches_oracle(kwargs):
  arrays, kwargs = case(**kwargs)
  got = cudnn_jax.conv3d(**arrays, **kwargs)
  want = oracle(**arrays, **kwargs)
  assert got.shape == want.shape and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-4, atol=1e-4)


def test_residual_and_bf16():
  arrays, kwargs = case(dtype=jnp.bfloat16, norm="group", num_groups=2, activation="silu")
  arrays["residual"] = normal(9, (2, 5, 6, 7, 8), dtype=jnp.bfloat16)
  got = cudnn_jax.conv3d(**arrays, **kwargs)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float64), oracle(**arrays, **kwargs),
                             rtol=3e-2, atol=3e-2)
  out32 = cudnn_jax.conv3d(**arrays, **kwargs, out_dtype=jnp.float32)
  assert out32.dtype == jnp.float32


@pytest.mark.parametrize("kwargs", [dict(padding="CAUSAL", strides=(1, 2, 1)),
                                    dict(norm="group", num_groups=2, activation="gelu")],
                         ids=["causal", "group_gelu"])
def test_gradients_match_finite_differences(kwargs):
  arrays, kwargs = case(spatial=(3, 4, 4), cin=4, cout=4, kernel=(2, 3, 3), **kwargs)
  arrays["residual"] = normal(8, cudnn_jax.conv3d(**arrays, **kwargs).shape)
  weights = np.random.default_rng(5).standard_normal(arrays["residual"].shape)
  loss = lambda a: jnp.sum(cudnn_jax.conv3d(**a, **kwargs) * weights.astype(np.float32))
  grads = jax.jit(jax.grad(loss))(arrays)
  assert_gradients_match(arrays, kwargs, grads, weights)


def test_vmap_and_explain():
  arrays, kwargs = case(norm="rms")
  stacked = {k: jnp.stack([v, v * 0.5]) for k, v in arrays.items()}
  out = jax.vmap(lambda a: cudnn_jax.conv3d(**a, **kwargs))(stacked)
  np.testing.assert_allclose(out[1], cudnn_jax.conv3d(**{k: v * 0.5 for k, v in
                                                         arrays.items()}, **kwargs),
                             rtol=1e-5, atol=1e-5)
  spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
  text = cudnn_jax.explain("conv3d", spec(arrays["x"]), spec(arrays["w"]))
  assert "'xla' serves" in text


X, W = jnp.ones((1, 4, 4, 4, 8)), jnp.ones((3, 3, 3, 8, 16))
BAD_INPUTS = [
    (dict(x=jnp.ones((4, 4, 4, 8))), ValueError, "x"),
    (dict(w=jnp.ones((3, 3, 3, 4, 16))), ValueError, "w"),
    (dict(w=jnp.ones((3, 3, 3, 8, 16), jnp.bfloat16)), TypeError, "x, w"),
    (dict(bias=jnp.ones((8,))), ValueError, "bias"),
    (dict(residual=jnp.ones((1, 4, 4, 4, 8))), ValueError, "residual"),
    (dict(norm="batch"), ValueError, "norm"),
    (dict(norm="group", num_groups=5), ValueError, "num_groups"),
    (dict(norm_scale=jnp.ones((16,))), ValueError, "norm_scale"),
    (dict(activation="tanh"), ValueError, "activation"),
    (dict(padding="FULL"), ValueError, "padding"),
    (dict(padding=((1, 1), (1, 1))), ValueError, "padding"),
    (dict(strides=(1, 0, 1)), ValueError, "strides"),
    (dict(dilation=(1, 1)), ValueError, "dilation"),
    (dict(padding="VALID", w=jnp.ones((5, 3, 3, 8, 16))), ValueError, "x"),
    (dict(eps=0.0, norm="rms"), ValueError, "eps"),
    (dict(implementation="cute"), cudnn_jax.UnsupportedError, "cute"),
]


@pytest.mark.parametrize("change,error,match", BAD_INPUTS,
                         ids=[f"{m}-{i}" for i, (_, _, m) in enumerate(BAD_INPUTS)])
def test_bad_inputs_name_the_argument(change, error, match):
  args = dict(x=X, w=W) | change
  with pytest.raises(error, match=match):
    cudnn_jax.conv3d(**args)


def test_numpy_inputs_are_jax_numpy_inputs():
  """NumPy arrays, float64 ones too, act as jnp.asarray of them (float32 without x64)."""
  arrays, kwargs = case(norm="group", num_groups=2, activation="silu")
  as_numpy = {k: np.asarray(v, np.float64) for k, v in arrays.items()}
  got = cudnn_jax.conv3d(**as_numpy, **kwargs)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, cudnn_jax.conv3d(**arrays, **kwargs), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_batch_sharded_with_numpy_weights(axis_type, jit):
  """A batch-sharded x (and residual) with NumPy weights, differentiated in all of them:
  the values and gradients of the unsharded call; the forward moves no data between
  devices and keeps x's batch sharding."""
  arrays, kwargs = case(n=4, spatial=(3, 4, 4), cin=4, cout=4, kernel=(2, 3, 3),
                        norm="group", num_groups=2, activation="silu", padding="CAUSAL")
  arrays = {k: np.asarray(v) for k, v in arrays.items()}
  arrays["residual"] = np.asarray(normal(7, (4, 3, 4, 4, 4)))
  call = functools.partial(cudnn_jax.conv3d, **kwargs)
  loss = lambda a: jnp.sum(jnp.sin(call(**a)))
  want, want_grads = call(**arrays), jax.grad(loss)(arrays)
  mesh = mesh_or_skip((4, 2), ("b", "h"), axis_type)
  wrap = jax.jit if jit else (lambda f: f)
  with jax.set_mesh(mesh):
    batch = NamedSharding(mesh, P("b"))
    args = dict(arrays, x=jax.device_put(arrays["x"], batch),
                residual=jax.device_put(arrays["residual"], batch))
    out = wrap(lambda a: call(**a))(args)
    grads = wrap(jax.grad(loss))(args)
    assert_no_collectives(jax.jit(lambda a: call(**a)), args)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  assert out.sharding.spec[0] == "b", out.sharding
  for name, g in grads.items():
    np.testing.assert_allclose(g, want_grads[name], rtol=1e-4, atol=1e-5, err_msg=name)
