"""What the ops ask of the shardings they are traced under."""

from __future__ import annotations

import jax


def explicit_mesh(x):
  """Whether ``x`` is sharded, or traced, on a mesh with explicitly typed axes
  (``AxisType.Explicit``): there gathers must name their output sharding, and
  ``custom_partitioning`` does not serve."""
  meshes = (jax.typeof(x).sharding.mesh, jax.sharding.get_abstract_mesh())
  return any(m._any_axis_explicit for m in meshes)  # pylint: disable=protected-access
