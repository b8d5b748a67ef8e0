"""Pieces the FFI calls share: result types, and the workspace result of the cuDNN handlers."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def workspace_result(size):
  """The u8 result a cuDNN handler runs its plan in: ``size`` bytes (at least one), sized
  by the extension's ``*_workspace`` query when the call is lowered."""
  return jax.ShapeDtypeStruct((max(size, 1),), jnp.uint8)


def with_shape(x, dtype=None):
  return jax.ShapeDtypeStruct(x.shape, dtype or x.dtype)
