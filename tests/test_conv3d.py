"""cudnn_jax.conv3d ("xla" engine) against a float64 NumPy oracle written apart from it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from scipy.special import erf

import cudnn_jax
from mesh_cases import assert_no_collectives, mesh_or_skip


def oracle_pads(padding, spatial, kernel, strides, dilation):
  if not isinstance(padding, str):
    return [tuple(p) for p in padding]
  if padding == "VALID":
    return [(0, 0)] * 3
  pads = []
  for size, k, s, d in zip(spatial, kernel, strides, dilation):
    out = -(-size // s)
    total = max((out - 1) * s + d * (k - 1) + 1 - size, 0)
    pads.append((total // 2, total - total // 2))
  if padding == "CAUSAL":
    pads[0] = ((kernel[0] - 1) * dilation[0], 0)
  return pads


def oracle(x, w, bias=None, residual=None, norm_scale=None, norm_bias=None, *, padding="SAME",
           strides=(1, 1, 1), dilation=(1, 1, 1), norm=None, num_groups=32, eps=1e-6,
           activation=None):
  """Float64: a sum of shifted, strided slices of the padded input, one per kernel tap."""
  def f64(a):  # float64 NumPy input as is (finite differences); arrays via float32
    if a is None or (isinstance(a, np.ndarray) and a.dtype == np.float64):
      return a
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  x, w, bias, residual, norm_scale, norm_bias = map(
      f64, (x, w, bias, residual, norm_scale, norm_bias))
  kernel = w.shape[:3]
  pads = oracle_pads(padding, x.shape[1:4], kernel, strides, dilation)
  xp = np.pad(x, [(0, 0)] + pads + [(0, 0)])
  out = [(xp.shape[1 + i] - dilation[i] * (kernel[i] - 1) - 1) // strides[i] + 1
         for i in range(3)]
  y = np.zeros((x.shape[0], *out, w.shape[-1]))
  for a in range(kernel[0]):
    for b in range(kernel[1]):
      for c in range(kernel[2]):
        start = (a * dilation[0], b * dilation[1], c * dilation[2])
        sl = tuple(slice(s0, s0 + st * (o - 1) + 1, st)
                   for s0, st, o in zip(start, strides, out))
        y += xp[(slice(None),) + sl] @ w[a, b, c]
  if bias is not None:
    y += bias
  if residual is not None:
    y += residual
  if norm == "rms":
    y = y / np.sqrt(np.mean(y ** 2, -1, keepdims=True) + eps)
  elif norm == "l2":
    y = y * np.sqrt(y.shape[-1]) / np.maximum(np.linalg.norm(y, axis=-1, keepdims=True), eps)
  elif norm == "group":
    g = y.reshape(y.shape[:-1] + (num_groups, -1))
    mean = g.mean(axis=(1, 2, 3, 5), keepdims=True)
    var = ((g - mean) ** 2).mean(axis=(1, 2, 3, 5), keepdims=True)
    y = ((g - mean) / np.sqrt(var + eps)).reshape(y.shape)
  if norm_scale is not None:
    y = y * norm_scale
  if norm_bias is not None:
    y = y + norm_bias
  if activation == "silu":
    y = y / (1 + np.exp(-y))
  elif activation == "gelu":
    y = 0.5 * y * (1 + erf(y / np.sqrt(2)))
  elif activation == "relu":
    y = np.maximum(y, 0)
  return y


def normal(seed, shape, scale=1.0, dtype=jnp.float32):
  return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), dtype)


def case(seed=0, n=2, spatial=(5, 6, 7), cin=8, cout=8, kernel=(3, 3, 3), dtype=jnp.float32,
         **kwargs):
  x = normal(seed, (n, *spatial, cin), dtype=dtype)
  w = normal(seed + 1, (*kernel, cin, cout), (np.prod(kernel) * cin) ** -0.5, dtype)
  arrays = dict(x=x, w=w, bias=normal(seed + 2, (cout,), dtype=dtype))
  if kwargs.get("norm"):
    arrays.update(norm_scale=normal(seed + 3, (cout,), dtype=dtype),
                  norm_bias=normal(seed + 4, (cout,), dtype=dtype))
  return arrays, kwargs


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
  rng, eps = np.random.default_rng(6), 1e-5
  f64 = {k: np.asarray(v, np.float64) for k, v in arrays.items()}
  for name, x in f64.items():
    direction = rng.standard_normal(x.shape)
    at = lambda s: np.sum(oracle(**{**f64, name: x + s * direction}, **kwargs) * weights)
    expected = (at(eps) - at(-eps)) / (2 * eps)
    got = float(np.sum(np.asarray(grads[name], np.float64) * direction))
    scale = np.linalg.norm(grads[name]) * np.linalg.norm(direction)
    assert abs(got - expected) <= 1e-3 * abs(expected) + 1e-4 * scale, (name, got, expected)


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
