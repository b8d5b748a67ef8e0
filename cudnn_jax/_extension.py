"""Loads the compiled extension ``cudnn_jax._ffi`` and registers its FFI handlers with XLA.

Without the extension (installed without it, or unable to load), or without a cuDNN it
can load, every op runs on the pure-JAX ``xla`` engine: on a GPU the first call warns once
(``EngineWarning``), naming the cause and the fix, and ``explain`` says the same; a process
without a GPU stays silent. ``python -m cudnn_jax`` prints what this machine has.
"""

from __future__ import annotations

import functools
import logging
import warnings

import jax

_log = logging.getLogger("cudnn_jax")

# The oldest cuDNN the handlers are built and tested against.
MIN_CUDNN = 91900
# The engines whose kernels live in the extension (the Pallas ones need only a GPU).
EXTENSION_ENGINES = ("cudnn", "cute")


class EngineWarning(RuntimeWarning):
  """The GPU engines are off on a GPU: every op runs on the (slower) ``xla`` engine."""


_import_error: str | None = None
_warned = False


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


def gpu_problem() -> tuple[str, str] | None:
  """``(cause, fix)`` when the GPU engines cannot run on a GPU: no extension, one that does
  not load, or no cuDNN it can load; None when they can."""
  m = module()
  if m is None:
    if _import_error and "No module named" in _import_error:
      return ("cudnn_jax was installed without its compiled extension (cudnn_jax._ffi)",
              "reinstall it on Linux x86-64 (pip install --force-reinstall --no-deps "
              "cudnn-jax, or the wheel); README, Set up, says how")
    return (f"the compiled extension cudnn_jax._ffi cannot be loaded ({_import_error})",
            "install JAX for CUDA 13 (pip install -U 'jax[cuda13]'), whose CUDA runtime and "
            "cuDNN the extension loads, then reinstall cudnn-jax")
  version = m.cudnn_version()
  if version < MIN_CUDNN:
    found = f"cuDNN {version}" if version else "no cuDNN library"
    least = f"{MIN_CUDNN // 10000}.{MIN_CUDNN // 100 % 100}"
    return (f"{found} loads; the GPU engines need cuDNN >= {least}",
            f"pip install -U 'nvidia-cudnn-cu13>={least}' (JAX's CUDA 13 plugin brings it)")
  return None


def unavailable_reason() -> str | None:
  """None when the GPU engines can run here, else why not. On a GPU, the first time they
  cannot, warns once (EngineWarning) with the cause and the fix."""
  global _warned
  if jax.default_backend() != "gpu":
    return f"default backend is {jax.default_backend()!r}, not 'gpu'"
  problem = gpu_problem()
  if problem is None:
    return None
  text = f"{problem[0]}; to fix: {problem[1]}"
  if not _warned:
    _warned = True
    warnings.warn(f"cudnn_jax: {text}. Every op runs on the 'xla' engine.", EngineWarning,
                  stacklevel=2)
  return text


def sm90_reason(target: str, missing: str = "its kernel sources were not found in the "
                "build's nvidia-cudnn-frontend wheel, or their hashes differ") -> str | None:
  """None when FFI ``target``'s sm_90a kernels can run here, else why not: the GPU engines
  off, an extension built without them (``missing`` says what causes that), or a GPU other
  than Hopper (compute capability 9.0)."""
  if why := unavailable_reason():
    return why
  if target not in module().registrations():
    return f"the extension was built without {target} ({missing})"
  capability = getattr(jax.devices()[0], "compute_capability", None)
  if capability != "9.0":
    return f"compute capability {capability}: the kernels are built for sm_90a (Hopper) only"
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


def report() -> str:
  """What this machine gives cudnn_jax: JAX's backend and devices, the extension, cuDNN's
  version, the linked kernels, and each op's engines here."""
  from cudnn_jax import engines  # pylint: disable=g-import-not-at-top
  import cudnn_jax  # pylint: disable=g-import-not-at-top
  m = module()
  lines = [f"cudnn_jax {getattr(cudnn_jax, '__version__', '')} with JAX {jax.__version__}",
           f"backend: {jax.default_backend()}; devices: "
           + ", ".join(sorted({d.device_kind for d in jax.devices()}))]
  if m is None:
    lines.append(f"extension: not loaded ({_import_error})")
  else:
    lines.append(f"extension: {m.__file__}")
    version = m.cudnn_version()
    lines.append(f"cuDNN: {version}" if version else "cuDNN: none loads")
    kernels = aot_kernels()
    lines.append(f"ahead-of-time kernels: {len(kernels)}"
                 + (f" ({', '.join(kernels)})" if kernels else ""))
    hosted = dict(m.frontend_kernels())
    lines.append("NVIDIA's kernels from the cuDNN frontend: "
                 + ("; ".join(f"{k} ({v})" for k, v in hosted.items()) or "none"))
  on_gpu = jax.default_backend() == "gpu"
  gpu_off = unavailable_reason()
  if gpu_off:
    lines.append(f"GPU engines: off: {gpu_off}")
  lines.append("engines by op (first that serves a call wins; 'xla' serves every call):")
  for op in sorted(engines._OPS):  # pylint: disable=protected-access
    names = []
    registered = engines._OPS[op].engines  # pylint: disable=protected-access
    for name, engine in sorted(registered.items(),
                               key=lambda item: engines.ENGINE_NAMES.index(item[0])):
      off = name != "xla" and (not on_gpu or (gpu_off and name in EXTENSION_ENGINES))
      state = "off" if off else "opt-in" if engine.opt_in else "on"
      names.append(f"{name} ({state})")
    lines.append(f"  {op}: " + ", ".join(names))
  return "\n".join(lines)
