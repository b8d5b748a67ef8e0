"""Device meshes for the sharding tests (the 8 CPU devices of conftest.py) and the check
that a sharded program moves no data between devices."""

import jax
import pytest

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute")


def mesh_or_skip(shape, names, axis_type="Auto"):
  """A mesh of the first prod(shape) devices with every axis of ``axis_type`` ("Auto" or
  "Explicit"); skips the test when there are not that many devices."""
  size = 1
  for s in shape:
    size *= s
  if len(jax.devices()) < size:
    pytest.skip(f"needs {size} devices (the CPU mesh of conftest.py)")
  return jax.make_mesh(shape, names, devices=jax.devices()[:size],
                       axis_types=(getattr(jax.sharding.AxisType, axis_type),) * len(shape))


def assert_no_collectives(jitted, *args, allowed=()):
  """The compiled ``jitted(*args)`` holds no collective but those ``allowed``; returns the
  compiled program (call it on ``args`` for the results without compiling again)."""
  compiled = jitted.lower(*args).compile()
  hlo = compiled.as_text()
  for collective in COLLECTIVES:
    if collective not in allowed:
      assert collective not in hlo, collective
  return compiled
