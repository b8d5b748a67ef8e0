"""Loads the compiled extension ``cudnn_jax._ffi`` and registers its FFI handlers with XLA.

The extension is optional: a build without a CUDA toolkit has none, and every op then runs
on the pure-JAX ``xla`` engine (one notice, logged once).
"""

from __future__ import annotations

import functools
import logging

import jax

_log = logging.getLogger("cudnn_jax")


_import_error: str | None = None


@functools.cache
def module():
  """The extension module, or None (with one logged notice) when it cannot be loaded."""
  global _import_error
  try:
    from cudnn_jax import _ffi  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    _import_error = str(e)
    _log.info("cudnn_jax: compiled extension not available (%s); GPU engines are off, "
              "every op runs on the 'xla' engine.", e)
    return None
  for name, capsule in _ffi.registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
  return _ffi


def unavailable_reason() -> str | None:
  """None when the GPU engines can run here, else why not."""
  if jax.default_backend() != "gpu":
    return f"default backend is {jax.default_backend()!r}, not 'gpu'"
  if module() is None:
    return f"the compiled extension cudnn_jax._ffi cannot be loaded ({_import_error})"
  return None


def cache_info() -> dict:
  """Process-wide cuDNN plan cache counters (size, capacity, hits, misses, evictions),
  ``recorded`` (plan runs XLA recorded into its CUDA graphs) and ``plans``: for each cached
  key, the name of the execution plan chosen for it (cuDNN's engine and knobs; empty
  before its first run or when cuDNN cannot serve the key)."""
  m = module()
  if m is None:
    return dict(size=0, capacity=0, hits=0, misses=0, evictions=0, recorded=0, plans={})
  return dict(m.cache_info())


def aot_kernels() -> tuple[str, ...]:
  """Names of the ahead-of-time compiled kernel variants in the extension (may be none)."""
  m = module()
  return () if m is None else tuple(m.aot_kernels())


def handler_attributes() -> dict[str, tuple[str, ...]]:
  """FFI target name -> the names of the attributes its handler takes (all of them, and no
  other), for every target the extension registers; empty without the extension."""
  m = module()
  return {} if m is None else dict(m.handler_attributes())


def kernel_constants() -> dict[str, dict[str, int | tuple[str, ...]]] | None:
  """The constants of the ahead-of-time kernels (kernels/aot.py ``CONSTANTS``) the
  extension was built with, by kernel: ``{"grouped_gemm": {"tile_m": 128, "tile_n": 256,
  "glu_tile_n": 128, "max_groups": 65536, "epilogues": ("none", ...), "glu_epilogues":
  ("swiglu", ...)}}``, also when the kernels themselves were not linked in; None without
  the extension."""
  m = module()
  return None if m is None else {kernel: dict(values)
                                 for kernel, values in m.kernel_constants().items()}
