"""Shared pytest setup: an 8-device CPU mesh, and the `gpu` marker.

Tests under tests/gpu/ carry the `gpu` marker and run only where the default backend is
a GPU and the cuDNN engine is available; everywhere else they are skipped.
"""

import os
import pathlib
import sys

# Must happen before jax initializes its backends; it only affects the host platform.
_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

# Result buffers reach our GPU kernels NaN-filled, so an element left unwritten shows up.
os.environ.setdefault("CUDNN_JAX_POISON_OUTPUTS", "1")

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # makes `sdpa_oracle` importable

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

_GPU_DIR = pathlib.Path(__file__).parent / "gpu"


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "gpu: needs a GPU and the cuDNN engine; skipped elsewhere")


def _gpu_unavailable_reason():
  import jax  # pylint: disable=g-import-not-at-top
  if jax.default_backend() != "gpu":
    return f"needs a GPU (default backend is {jax.default_backend()!r})"
  from cudnn_jax import _extension  # pylint: disable=g-import-not-at-top
  return _extension.unavailable_reason()


def pytest_collection_modifyitems(config, items):
  del config
  reason = None
  for item in items:
    if _GPU_DIR in pathlib.Path(str(item.fspath)).parents:
      item.add_marker(pytest.mark.gpu)
    if item.get_closest_marker("gpu") is None:
      continue
    if reason is None:
      reason = _gpu_unavailable_reason() or ""
    if reason:
      item.add_marker(pytest.mark.skip(reason=f"gpu test: {reason}"))


@pytest.fixture
def emulated(monkeypatch):
  """``force(op, name)``: engine ``name`` serves ``op`` from then on, its support check
  skipped. Off the GPU a GPU engine's primitives lower to their handlers' contracts in
  plain JAX, so everything the engine does around its FFI calls runs on the CPU."""
  from cudnn_jax import engines  # pylint: disable=g-import-not-at-top
  original = engines.choose

  def force(op, name):
    forced = engines.engine(op, name)
    monkeypatch.setattr(engines, "choose", lambda op_, call, implementation: (
        forced if op_ == op else original(op_, call, implementation)))
  return force
