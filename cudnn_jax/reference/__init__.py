"""Pure-JAX engines: the readable definition of every op, the CPU path and the fallback."""

import jax
import jax.numpy as jnp


def matmul_precision(dtype):
  """HIGHEST for float32 (true float32 products, no TF32); narrower inputs are exact in
  float32 accumulation."""
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
