"""Trace-time argument checks shared by every op: clear errors that name the argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# The dtypes an op accepts when its xla engine takes float64 too (as jax.nn does under
# x64); the GPU engines decline float64 with a reason.
XLA_FLOAT_DTYPES = FLOAT_DTYPES + (jnp.float64,)


def shape_of(name, x, rank=None):
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
  if rank is not None and x.ndim not in ((rank,) if isinstance(rank, int) else rank):
    raise ValueError(f"{name}: expected rank {rank}, got shape {tuple(x.shape)}")
  return tuple(x.shape)


def float_dtype(name, x, allowed=FLOAT_DTYPES):
  if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in allowed]:
    names = ", ".join(jnp.dtype(d).name for d in allowed)
    raise TypeError(f"{name}: expected dtype in ({names}), got {jnp.dtype(x.dtype).name}")


def int_dtype(name, x):
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name}: expected an integer (int32) array, got {jnp.dtype(x.dtype).name}")


def bool_dtype(name, x):
  if jnp.dtype(x.dtype) != jnp.bool_:
    raise TypeError(f"{name}: expected a bool array, got {jnp.dtype(x.dtype).name}")


def expect_shape(name, x, expected):
  if tuple(x.shape) != tuple(expected):
    raise ValueError(f"{name}: expected shape {tuple(expected)}, got {tuple(x.shape)}")


def broadcastable(name, x, target):
  """x must broadcast (NumPy rules, no more dims than target) to ``target``."""
  shape = tuple(x.shape)
  ok = len(shape) <= len(target) and all(
      d in (1, e) for d, e in zip(shape[::-1], target[::-1]))
  if not ok:
    raise ValueError(f"{name}: shape {shape} does not broadcast to {tuple(target)}")


def real_scalar(name, value):
  """A static real number (``scale``): a Python, NumPy or concrete JAX scalar, as a float."""
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name}: expected a real number, got {value!r}")
  if isinstance(value, jax.core.Tracer):
    raise TypeError(f"{name}: expected a concrete real number (it is static), got a traced "
                    f"value; pass a Python or NumPy number")
  shape = getattr(value, "shape", ())
  dtype = getattr(value, "dtype", None)
  if shape != () or (dtype is not None and not (jnp.issubdtype(dtype, jnp.floating)
                                                or jnp.issubdtype(dtype, jnp.integer))):
    raise TypeError(f"{name}: expected a real scalar, got {type(value).__name__}"
                    + (f" of shape {tuple(shape)} and dtype {dtype}" if dtype is not None else ""))
  try:
    return float(value)
  except (TypeError, ValueError):
    raise TypeError(f"{name}: expected a real number, got {type(value).__name__}") from None


def scale_scalar(name, value):
  """A float32 scalar that may be traced (a dequantization factor): a Python number or a
  one-element float32 array, as a ``()`` array."""
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    value = jnp.asarray(value, jnp.float32)
  shape_of(name, value)
  if value.size != 1:
    raise ValueError(f"{name}: expected a float32 scalar, got shape {tuple(value.shape)}")
  float_dtype(name, value, (jnp.float32,))
  return jnp.asarray(value).reshape(())


def static_int(name, value, *, minimum=None):
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name}: expected a Python int, got {value!r}")
  if minimum is not None and value < minimum:
    raise ValueError(f"{name}: expected >= {minimum}, got {value}")
  return int(value)


def one_of(name, value, choices):
  if value not in choices:
    raise ValueError(f"{name}: expected one of {choices}, got {value!r}")
  return value


def same_dtype(names, *arrays):
  """All ``arrays`` share one dtype; ``names`` is how the message refers to them."""
  dtypes = [jnp.dtype(x.dtype) for x in arrays]
  if len(set(dtypes)) > 1:
    raise TypeError(f"{names}: expected one dtype, got {', '.join(d.name for d in dtypes)}")


def dtype_arg(name, value, allowed):
  """A static dtype argument (``out_dtype``): one of ``allowed``, returned as a jnp.dtype."""
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    raise TypeError(f"{name}: expected a dtype, got {value!r}") from None
  if dtype not in [jnp.dtype(d) for d in allowed]:
    names = ", ".join(jnp.dtype(d).name for d in allowed)
    raise TypeError(f"{name}: expected one of ({names}), got {dtype.name}")
  return dtype


def arrays(*xs):
  """Validated array arguments as JAX arrays (NumPy arrays too, so that a constant captured
  by jit is indexed and sharded like any other input); None stays None."""
  return tuple(None if x is None else jnp.asarray(x) for x in xs)


def flag(name, value):
  """A static bool argument (``is_causal``): True or False, not a truthy stand-in."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name}: expected a bool, got {value!r}")
  return bool(value)


def prng_key(name, x):
  """A PRNG key: one typed key (``jax.random.key``) or a raw uint32 key
  (``jax.random.PRNGKey``)."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name}: expected a PRNG key (jax.random.key(...)), got "
                    f"{type(x).__name__}")
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    if x.shape:
      raise ValueError(f"{name}: expected a single key of shape (), got shape {x.shape}")
  elif jnp.dtype(x.dtype) != jnp.uint32 or x.ndim != 1:
    raise TypeError(f"{name}: expected a PRNG key (jax.random.key(...) or a uint32 "
                    f"jax.random.PRNGKey), got {jnp.dtype(x.dtype).name} of shape {x.shape}")
