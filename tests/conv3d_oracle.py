"""A float64 NumPy oracle of cudnn_jax.conv3d, written apart from the library, and the
random cases the conv3d tests share."""

import numpy as np
import jax.numpy as jnp
from scipy.special import erf


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


def assert_gradients_match(arrays, kwargs, grads, weights, rtol=1e-3, atol=1e-4):
  """``grads`` of ``sum(conv3d(**arrays, **kwargs) * weights)`` against central finite
  differences of the oracle along a random direction, for every array."""
  rng, eps = np.random.default_rng(6), 1e-5
  f64 = {k: np.asarray(jnp.asarray(v, jnp.float32), np.float64) for k, v in arrays.items()}
  for name, x in f64.items():
    direction = rng.standard_normal(x.shape)
    at = lambda s: np.sum(oracle(**{**f64, name: x + s * direction}, **kwargs) * weights)
    expected = (at(eps) - at(-eps)) / (2 * eps)
    g = np.asarray(jnp.asarray(grads[name], jnp.float32), np.float64)
    got = float(np.sum(g * direction))
    scale = np.linalg.norm(g) * np.linalg.norm(direction)
    assert abs(got - expected) <= rtol * abs(expected) + atol * scale, (name, got, expected)
