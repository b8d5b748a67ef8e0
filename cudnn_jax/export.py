"""Exporting programs that use cudnn_jax ops with ``jax.export``.

``jax.export`` refuses custom calls it does not know to be stable, and cannot serialize
``custom_partitioning`` (a Python callback). Two helpers cover both:

- ``disabled_checks()``: the ``jax.export.DisabledSafetyCheck.custom_call(...)`` entries
  for every FFI target the compiled extension registers (derived from it, so none can be
  forgotten) and for Pallas's Triton call, which our Triton engines lower to. Pass them to
  ``jax.export.export(..., disabled_checks=...)`` for a program traced where the GPU engines
  run. Without the extension (or on a CPU) the GPU targets do not occur and the list still
  does no harm.
- ``export(fn, ...)``: ``jax.export.export`` of ``jax.jit(fn)`` with those checks disabled,
  traced so that our primitives lower without ``custom_partitioning``: a sharded program
  (batch- or head-sharded inputs on a mesh, ``bsa``, the cuDNN ``sdpa``...) then exports,
  and XLA's SPMD partitioner partitions each op's body like any other code. Its contract
  is our ops' own; on a GPU the partitioner may gather an FFI call's operands instead of
  computing it per shard, so a sharded export can communicate more than the jitted
  program does.

Example::

    exported = cudnn_jax.export.export(model_fn, platforms=["cpu", "cuda"])(params, x)
    blob = exported.serialize()
    restored = jax.export.deserialize(blob)
    y = restored.call(params, x)

``fn`` should be a plain Python function (not already jitted): it is traced afresh for the
export. Exported programs embed the custom call targets by name; the process that calls
them must import ``cudnn_jax`` (which registers the targets) before ``call``.
"""

from __future__ import annotations

import functools

import jax

from cudnn_jax import _extension
from cudnn_jax.primitives import core

# Pallas's Triton kernels (our "triton" engines) lower to this custom call.
TRITON_CALL_TARGET = "__gpu$xla.gpu.triton"


def custom_call_targets() -> tuple[str, ...]:
  """Every custom call target a program using cudnn_jax may contain: the extension's FFI
  targets (none without the extension) and Pallas's Triton call."""
  return tuple(sorted(_extension.handler_attributes())) + (TRITON_CALL_TARGET,)


def disabled_checks() -> list:
  """``jax.export.DisabledSafetyCheck.custom_call(name)`` for each of
  ``custom_call_targets()``."""
  return [jax.export.DisabledSafetyCheck.custom_call(name) for name in custom_call_targets()]


def export(fn, *, platforms=None, disabled_checks=(), **jit_kwargs):
  """``jax.export.export`` of ``jax.jit(fn, **jit_kwargs)``, our targets' checks disabled
  (plus ``disabled_checks``) and our primitives lowered without ``custom_partitioning``.

  Returns a function of example arguments (arrays or ``jax.ShapeDtypeStruct``s) that
  returns the ``jax.export.Exported``, like ``jax.export.export`` does.
  """
  jitted = jax.jit(_fresh(fn), **jit_kwargs)
  checks = [*_disabled(), *disabled_checks]

  @functools.wraps(fn)
  def exporter(*args, **kwargs):
    with core.exporting_scope():
      return jax.export.export(jitted, platforms=platforms, disabled_checks=checks)(
          *args, **kwargs)

  return exporter


_disabled = disabled_checks


def _fresh(fn):
  """A new function object around ``fn``, so that no earlier trace of it is reused."""
  return lambda *args, **kwargs: fn(*args, **kwargs)
