"""What the Pallas kernels compiled through Triton share: base-2 exponent constants, the
float32 product, and ``launch`` (``pallas_call`` with poisoned results when asked)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from cudnn_jax.reference import matmul_precision

# Exponentials are taken base 2 (one ex2 instruction each on the GPU): logits are scaled by
# log2(e) and the lse converted at the ends.
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def poisoned() -> bool:
  """CUDNN_JAX_POISON_OUTPUTS set (not "0"): results start NaN-filled, as for the FFI
  handlers, so a test sees any element the programs leave unwritten."""
  return os.environ.get("CUDNN_JAX_POISON_OUTPUTS", "0") not in ("", "0")


def launch(kernel, args, *, grid, in_specs, out_specs, out_shape, compiler_params, interpret,
           name):
  """``pallas_call`` of ``kernel`` over ``grid`` on ``args``: a list of results."""
  aliases = {}
  if poisoned():
    # NaN-filled buffers passed in and written in place; the kernel never reads them.
    n_in, n_out = len(args), len(out_shape)
    args = [*args, *(jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape)]
    in_specs = [*in_specs, *out_specs]
    aliases = {n_in + i: i for i in range(n_out)}
    body = kernel
    kernel = lambda *refs: body(*refs[:n_in], *refs[n_in + n_out:])
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      input_output_aliases=aliases, interpret=interpret, compiler_params=compiler_params,
      name=name)(*args)


def dot(a, b, *, ta=False, tb=False):
  """``a @ b`` (``a^T``, ``b^T`` where asked) in float32, true float32 products for float32
  operands."""
  dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims, precision=matmul_precision(a.dtype),
                             preferred_element_type=jnp.float32)


def softmax_init(rows, dv):
  """The running ``(acc [rows, dv], mx [rows], l [rows])`` before any key: 0, -inf, 0."""
  return (jnp.zeros((rows, dv), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
          jnp.zeros((rows,), jnp.float32))


def softmax_step(carry, s2, v):
  """One block of keys into the running base-2 softmax: ``s2 [rows, keys]`` the logits
  times log2(e) (-inf where not kept), ``v [keys, dv]``; returns the new ``(acc, mx, l)``:
  ``mx' = max(mx, rowmax s2)``, ``l' = l 2^{mx - mx'} + rowsum 2^{s2 - mx'}``,
  ``acc' = acc 2^{mx - mx'} + 2^{s2 - mx'} v``."""
  acc, mx, l = carry
  mx_new = jnp.maximum(mx, jnp.max(s2, axis=1))
  base = jnp.where(mx_new == -jnp.inf, 0.0, mx_new)  # rows with no kept key so far
  p = jnp.exp2(s2 - base[:, None])
  alpha = jnp.exp2(mx - base)
  acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
  return acc, mx_new, l * alpha + jnp.sum(p, axis=1)
