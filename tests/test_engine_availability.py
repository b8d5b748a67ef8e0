"""Never silently slow: on a GPU without working GPU engines (no extension, one that does
not load, no cuDNN it can load) the first call warns once with the cause and the fix, and
``explain`` says the same on every call; a process without a GPU stays silent.
``python -m cudnn_jax`` reports what the machine has."""

import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import pytest

import cudnn_jax
from cudnn_jax import _extension


@pytest.fixture
def on_a_gpu(monkeypatch):
  """``use(module, import_error)``: the process looks like a GPU one whose extension
  import gave ``module`` (None: failed with ``import_error``); no warning given yet."""
  def use(module, import_error=None):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(_extension, "module", lambda: module)
    monkeypatch.setattr(_extension, "_import_error", import_error)
    monkeypatch.setattr(_extension, "_warned", False)
  return use


class _Loaded:
  def __init__(self, cudnn):
    self.cudnn = cudnn

  def cudnn_version(self):
    return self.cudnn


def test_a_process_without_a_gpu_stays_silent():
  with warnings.catch_warnings():
    warnings.simplefilter("error", _extension.EngineWarning)
    assert "not 'gpu'" in _extension.unavailable_reason()
    x = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
    cudnn_jax.sdpa(x, x, x)


@pytest.mark.parametrize("module,import_error,cause,fix", [
    (None, "No module named 'cudnn_jax._ffi'", "installed without its compiled extension",
     "reinstall"),
    (None, "libcudart.so.13: cannot open shared object file", "cannot be loaded (libcudart",
     "jax[cuda13]"),
    (_Loaded(0), None, "no cuDNN library loads", "nvidia-cudnn-cu13"),
    (_Loaded(90100), None, "cuDNN 90100 loads", "nvidia-cudnn-cu13"),
], ids=["not_built", "does_not_load", "no_cudnn", "old_cudnn"])
def test_a_gpu_without_engines_warns_once_and_explain_says_why(on_a_gpu, module, import_error,
                                                                cause, fix):
  on_a_gpu(module, import_error)
  with pytest.warns(_extension.EngineWarning, match=re.escape(cause)) as record:
    first = _extension.unavailable_reason()
  assert len(record) == 1 and fix in str(record[0].message)
  with warnings.catch_warnings():
    warnings.simplefilter("error", _extension.EngineWarning)  # once only
    assert _extension.unavailable_reason() == first
  assert cause in first and fix in first
  spec = jax.ShapeDtypeStruct((1, 8, 2, 16), jnp.bfloat16)
  with warnings.catch_warnings():
    warnings.simplefilter("error", _extension.EngineWarning)
    text = cudnn_jax.explain("sdpa", spec, spec, spec)
  assert cause in text and fix in text


def test_working_engines_raise_no_warning(on_a_gpu):
  on_a_gpu(_Loaded(_extension.MIN_CUDNN))
  with warnings.catch_warnings():
    warnings.simplefilter("error", _extension.EngineWarning)
    assert _extension.unavailable_reason() is None


def test_python_m_cudnn_jax_reports_the_machine():
  out = subprocess.run([sys.executable, "-m", "cudnn_jax"], capture_output=True, text=True,
                       check=True).stdout
  assert f"JAX {jax.__version__}" in out and "extension:" in out
  assert "  sdpa: " in out and "xla (on)" in out
