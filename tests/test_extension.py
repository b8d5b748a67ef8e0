"""What the compiled extension reports about itself agrees with the sources it was built
from: the kernels' constants with kernels/*.py, the handlers' attributes with the Python
side that passes them. Runs on CPU; skipped when the extension was not built."""

import dataclasses
import importlib.util
import pathlib

import numpy as np
import pytest

from cudnn_jax import _extension
from cudnn_jax.primitives.sdpa import SdpaConfig

pytestmark = pytest.mark.skipif(_extension.module() is None,
                                reason="the extension cudnn_jax._ffi was not built")

KERNELS = pathlib.Path(__file__).resolve().parents[1] / "kernels"


def _aot():
  """kernels/aot.py, which reads the kernel modules' constants without the CuTe DSL."""
  spec = importlib.util.spec_from_file_location("cudnn_jax_kernels_aot", KERNELS / "aot.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_kernel_constants_are_the_kernel_modules():
  assert _extension.kernel_constants() == _aot().constants(KERNELS)


def test_grouped_gemm_constants():
  gemm = _extension.kernel_constants()["grouped_gemm"]
  assert gemm["epilogues"][0] == "none"
  assert set(gemm["glu_epilogues"]) <= set(gemm["epilogues"])
  assert gemm["glu_tile_n"] * 2 == gemm["tile_n"]


def test_every_registered_target_lists_its_attributes():
  attributes = _extension.handler_attributes()
  assert set(attributes) == set(_extension.module().registrations())
  assert attributes["cudnn_jax_grouped_matmul"] == ()
  if "cudnn_jax_cute_grouped_gemm" in attributes:
    assert attributes["cudnn_jax_cute_grouped_gemm"] == ("epilogue",)


@pytest.mark.parametrize("target", ["cudnn_jax_sdpa_fwd", "cudnn_jax_sdpa_bwd"])
def test_sdpa_attributes_are_the_config_fields(target):
  names = _extension.handler_attributes()[target]
  assert names == tuple(f.name for f in dataclasses.fields(SdpaConfig))


def _sdpa_config(**changes):
  config = dict(SdpaConfig(scale=1.0).attributes(), backward=False, dtype="bfloat16", b=1,
                t=8, s=8, n=1, k=1, h=64, hv=64, bias_b=0, bias_n=0)
  config.update(changes)
  return {name: value for name, value in config.items() if value is not None}


@pytest.mark.parametrize("name", _extension.handler_attributes().get("cudnn_jax_sdpa_fwd", ()))
def test_sdpa_check_names_a_missing_attribute(name):
  with pytest.raises(ValueError, match=f"'{name}'"):
    _extension.module().sdpa_check(_sdpa_config(**{name: None}))


def test_sdpa_check_names_a_mistyped_attribute():
  with pytest.raises(TypeError, match="'causal'.* a bool"):
    _extension.module().sdpa_check(_sdpa_config(causal="yes"))
  with pytest.raises(TypeError, match="'window_left'.* an int"):
    _extension.module().sdpa_check(_sdpa_config(window_left=1.5))


@pytest.mark.parametrize("flag", [True, np.bool_(True)], ids=["python", "numpy"])
def test_sdpa_check_takes_python_and_numpy_bools(flag):
  """Past the attribute reading (on a CPU the check then fails for want of a device), and
  an int is no bool."""
  try:
    _extension.module().sdpa_check(_sdpa_config(causal=flag))
  except (ValueError, RuntimeError) as e:
    assert "'causal'" not in str(e)
  with pytest.raises(TypeError, match="'causal'.* a bool"):
    _extension.module().sdpa_check(_sdpa_config(causal=1))
