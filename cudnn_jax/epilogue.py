"""GEMM epilogues shared by gemm, grouped_gemm and moe_mlp: bias, activation, GLU.

On the float32 accumulator ``h [..., N]`` (``[..., 2N]`` with a GLU):
``h = h + bias``; then either ``act(h)``, or a GLU ``act(h[..., :N]) * h[..., N:]`` (the
gate half first). Every epilogue maps 0 to 0, so rows that are 0 before the bias stay 0
without one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cudnn_jax import _checks

ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
    "srelu": lambda x: jnp.square(jax.nn.relu(x)),
}
GLU_ACTIVATION = {"swiglu": "silu", "geglu": "gelu", "reglu": "relu"}


def check(activation, glu):
  """Validates the epilogue names. A GLU names its own activation, so ``activation``
  must then be None."""
  _checks.one_of("activation", activation, (None, *ACTIVATIONS))
  _checks.one_of("glu", glu, (None, *GLU_ACTIVATION))
  if glu is not None and activation is not None:
    raise ValueError(f"activation: must be None with glu={glu!r} (the GLU sets the gate "
                     f"activation: {GLU_ACTIVATION[glu]!r}), got {activation!r}")


def out_columns(name, columns, glu):
  """N, the output width, for a weight with ``columns`` columns (``2N`` with a GLU)."""
  if glu is None:
    return columns
  if columns % 2:
    raise ValueError(f"{name}: with glu={glu!r} the last dim must be even (2N, gate half "
                     f"first), got {columns}")
  return columns // 2


def apply(h, bias=None, *, activation=None, glu=None):
  """``act(h + bias)`` or ``act(g) * u`` with ``[g, u] = h + bias``, computed in float32.

  ``h [..., C]``; ``bias`` broadcasts to h; returns ``[..., C]`` (``[..., C/2]`` with glu).
  """
  h = h.astype(jnp.float32)
  if bias is not None:
    h = h + bias.astype(jnp.float32)
  if glu is not None:
    gate, up = jnp.split(h, 2, axis=-1)
    return ACTIVATIONS[GLU_ACTIVATION[glu]](gate) * up
  if activation is not None:
    return ACTIVATIONS[activation](h)
  return h
