"""The installed extension links every ahead-of-time kernel variant kernels/aot.py declares.

Runs where the extension was built (nvcc on the PATH and ``cudnn_jax._ffi`` importable), so
a dependency change that drops the CuTe DSL from the build (the "cute" engines would then
decline, and MoE would fall back to ``lax.ragged_dot``) fails here instead of passing
silently. The declared list is computed by kernels/aot.py's own modules, in a separate
process (importing the DSL needs no GPU).
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from cudnn_jax import _extension

KERNELS = pathlib.Path(__file__).resolve().parent.parent / "kernels"

_LIST = """
import importlib, json, aot
print(json.dumps([p for m in aot.MODULES for p, *_ in importlib.import_module(m).variants()]))
"""


@pytest.mark.skipif(shutil.which("nvcc") is None or _extension.module() is None,
                    reason="no nvcc / no built extension: the AOT kernels are not built here")
def test_extension_links_every_declared_variant():
  env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
  done = subprocess.run([sys.executable, "-c", _LIST], cwd=KERNELS, env=env,
                        capture_output=True, text=True, timeout=600)
  if done.returncode and "No module named 'cutlass'" in done.stderr:
    pytest.fail("nvidia-cutlass-dsl is not importable here although the build needs it "
                "(pyproject.toml's build requirements): " + done.stderr[-500:])
  assert done.returncode == 0, done.stderr[-2000:]
  declared = json.loads(done.stdout.strip().splitlines()[-1])
  assert declared, "kernels/aot.py declares no variant"
  linked = _extension.aot_kernels()
  missing = sorted(set(declared) - set(linked))
  assert not missing, f"declared in kernels/aot.py but not linked into cudnn_jax._ffi: {missing}"
  assert sorted(linked) == sorted(declared)
