"""Lowering Pallas kernels to Triton for sm_90 without a GPU."""

import contextlib
import functools

import jax
import pytest


@contextlib.contextmanager
def sm90_export():
  """Yields ``jax.export.export`` for CUDA as an sm_90 GPU would lower (Pallas' Triton
  calls allowed); skips the test when this JAX has no Pallas Triton backend."""
  try:
    from jax._src.pallas.triton import pallas_call_registration as registration  # pylint: disable=g-import-not-at-top
  except ImportError:
    pytest.skip("this JAX has no Pallas Triton backend")

  class _Sm90:
    compute_capability = 90

  original = registration.gpu_info_lib.get_gpu_info
  registration.gpu_info_lib.get_gpu_info = lambda: _Sm90()
  try:
    yield functools.partial(
        jax.export.export, platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])
  finally:
    registration.gpu_info_lib.get_gpu_info = original
