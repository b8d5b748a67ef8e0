"""Compiles the CuTe DSL kernels of this folder ahead of time into C-callable objects.

    python kernels/aot.py OUT_DIR
    python kernels/aot.py --constants OUT_DIR

Each kernel module (``MODULES``) has ``variants()`` yielding ``(prefix, jit function,
compile arguments)``; every variant becomes ``OUT_DIR/<prefix>.o`` (an x86-64 object
holding the sm_90a cubin) and ``<prefix>.h`` (its C API: ``<prefix>_Kernel_Module_Load``
and ``cute_dsl_<prefix>_wrapper``). Next to them go the DSL's small static runtime that
the objects call, and ``aot_kernels.h``, which includes every variant header and names
them in ``CUDNN_JAX_AOT_KERNELS``, and lists each module's variants as an X-macro,
``CUDNN_JAX_AOT_<MODULE>(X)`` expanding to ``X(<prefix>)`` for each (so a handler can
build its table of variants). A module whose variants have several C signatures yields
``(prefix, function, arguments, group)``: each group also gets its own X-macro,
``CUDNN_JAX_AOT_<MODULE>_<GROUP>(X)``. CMake links the folder into ``cudnn_jax._ffi``
(``CUDNN_JAX_KERNELS_DIR``).

Both forms also write ``OUT_DIR/kernel_constants.h``: the constants each kernel module
shares with its FFI handler and the Python engines (``CONSTANTS``), read from the
modules' source without importing them, so the DSL is not needed for it.

Compiling needs ``nvidia-cutlass-dsl`` (build time only), not a GPU, and exits with status
3 when the DSL cannot be imported, so a build can go on without these kernels.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import pathlib
import shutil
import sys

ARCH = "sm_90a"
MODULES = ("grouped_gemm_sm90", "grouped_wgrad_sm90", "bsa_sm90")
# The top-level constants of a kernel module that its FFI handler and the Python engines
# use. kernel_constants.h and cudnn_jax._extension.kernel_constants() name them in lower
# case under the module's name less its architecture suffix ("grouped_gemm").
CONSTANTS = {
    "grouped_gemm_sm90": ("TILE_M", "TILE_N", "GLU_TILE_N", "MAX_GROUPS", "EPILOGUES",
                          "GLU_EPILOGUES"),
    "bsa_sm90": ("DTYPES", "BLOCK_SIZES", "FWD_HEAD_DIMS", "FWD_GQA_RATIOS", "BWD_DTYPES",
                 "BWD_HEAD_DIM", "BWD_BUCKET_BLK128", "BWD_BUCKET_BLK64", "K2Q_EDGE_TILE",
                 "K2Q_EDGE_TILES", "MAX_INDEX_WIDTH", "FWD64_SQ_MULTIPLE"),
}
# The device attributes the DSL reads from the build machine's GPU while compiling, with
# sm_90a's values: a launch with min_blocks_per_mp > 1 and no preferred carveout (NVIDIA's
# blk64 BSA forward) sizes its shared-memory carveout from the shared memory per SM. The
# objects run on sm_90a whatever GPU (if any) compiles them, so the target's values are
# used, never the build machine's. H100 and H200: 228 KiB per SM (of which 227 KiB, 232448
# bytes, is a block's opt-in maximum: CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN).
TARGET_DEVICE_ATTRIBUTES = {
    "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR": 233472,
    "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 232448,
    "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR": 9,
    "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR": 0,
}
NO_DSL = 3
HERE = pathlib.Path(__file__).resolve().parent


def _top_level_values(path: pathlib.Path) -> dict:
  """The values of a module's top-level assignments that plain Python can evaluate
  without the module's imports: literals and expressions over earlier such values."""
  values = {}
  for node in ast.parse(path.read_text(), str(path)).body:
    if not isinstance(node, ast.Assign):
      continue
    try:
      value = eval(compile(ast.Expression(node.value), str(path), "eval"),  # pylint: disable=eval-used
                   {"__builtins__": {"tuple": tuple}}, dict(values))
    except NameError:  # needs an import (the DSL) or a function of the module
      continue
    for target in node.targets:
      if isinstance(target, ast.Tuple):
        values.update((t.id, v) for t, v in zip(target.elts, value) if isinstance(t, ast.Name))
      elif isinstance(target, ast.Name):
        values[target.id] = value
  return values


def constants(kernels_dir: pathlib.Path = HERE) -> dict[str, dict[str, int | tuple[str, ...]]]:
  """``CONSTANTS`` with their values, by kernel ("grouped_gemm") and lower-case name."""
  out = {}
  for module, names in CONSTANTS.items():
    values = _top_level_values(kernels_dir / f"{module}.py")
    kernel = module.rsplit("_", 1)[0]
    out[kernel] = {}
    for name in names:
      value = values.get(name)
      if not (type(value) is int or (isinstance(value, tuple) and value
                                     and all(isinstance(v, str) for v in value))):
        raise ValueError(f"kernels/{module}.py: {name} must be an int or a tuple of str "
                         f"computed from literals, got {value!r}")
      out[kernel][name.lower()] = value
  return out


def constants_header(values: dict[str, dict[str, int | tuple[str, ...]]]) -> str:
  """kernel_constants.h: each constant as ``cudnn_jax::kernel_constants::<kernel>::<name>``
  (an int64_t, or an array of C strings), and ``CUDNN_JAX_KERNEL_CONSTANTS(X)`` expanding
  to ``X(kernel, name)`` for each."""
  lines = ["// Generated by kernels/aot.py from the kernel modules' constants (CONSTANTS there).",
           "#pragma once", "", "#include <cstdint>", ""]
  for kernel, named in values.items():
    lines.append(f"namespace cudnn_jax::kernel_constants::{kernel} {{")
    for name, value in named.items():
      if isinstance(value, int):
        lines.append(f"inline constexpr int64_t {name} = {value};")
      else:
        items = ", ".join(f'"{v}"' for v in value)
        lines.append(f"inline constexpr const char* {name}[] = {{{items}}};")
    lines += [f"}}  // namespace cudnn_jax::kernel_constants::{kernel}", ""]
  pairs = " ".join(f"X({kernel}, {name})" for kernel, named in values.items() for name in named)
  lines.append(f"#define CUDNN_JAX_KERNEL_CONSTANTS(X) {pairs}")
  return "\n".join(lines) + "\n"


def write_constants(out_dir: pathlib.Path):
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / "kernel_constants.h").write_text(constants_header(constants()))


def _dsl_root() -> pathlib.Path | None:
  spec = importlib.util.find_spec("nvidia_cutlass_dsl")
  if spec is None or not spec.submodule_search_locations:
    return None
  return pathlib.Path(list(spec.submodule_search_locations)[0])


def _reexec_for_dsl(root: pathlib.Path):
  """Without a GPU driver the DSL's object dumper needs its runtime preloaded and the
  target architecture spelled out; both must be in place before the process starts."""
  runtime = root / "cu13" / "lib" / "libcute_dsl_runtime.so"
  if os.environ.get("CUTE_DSL_ARCH") == ARCH and str(runtime) in os.environ.get(
      "LD_PRELOAD", ""):
    return
  env = dict(os.environ, CUTE_DSL_ARCH=ARCH,
             LD_PRELOAD=":".join(p for p in (str(runtime), os.environ.get("LD_PRELOAD")) if p))
  os.execve(sys.executable, [sys.executable] + sys.argv, env)


def _answer_device_attributes_for_target():
  """Makes the DSL's device-attribute queries answer with TARGET_DEVICE_ATTRIBUTES (and
  fail, naming the attribute, for any other), instead of asking the build machine's driver
  (absent without a GPU; another GPU's values with one)."""
  from cutlass.base_dsl.runtime import cuda as runtime  # pylint: disable=g-import-not-at-top

  def get_device_attribute(attribute, device_id=0):
    del device_id
    name = getattr(attribute, "name", str(attribute))
    if name not in TARGET_DEVICE_ATTRIBUTES:
      raise RuntimeError(f"kernels/aot.py: the DSL asked for the device attribute {name} "
                         f"while compiling for {ARCH}; add its {ARCH} value to "
                         "TARGET_DEVICE_ATTRIBUTES")
    return TARGET_DEVICE_ATTRIBUTES[name]

  runtime.get_device_attribute = get_device_attribute


def build(out_dir: pathlib.Path, root: pathlib.Path) -> list[str]:
  import cutlass.cute as cute  # pylint: disable=g-import-not-at-top
  _answer_device_attributes_for_target()
  sys.path.insert(0, str(HERE))
  out_dir.mkdir(parents=True, exist_ok=True)
  prefixes, by_module, by_group = [], {}, {}
  for name in MODULES:
    try:
      module = importlib.import_module(name)
      why = getattr(module, "requirement_error", lambda: None)()
    except ImportError as e:  # a kernel source package (a build requirement) is missing
      module, why = None, f"{type(e).__name__}: {e}"
    if why:
      print(f"kernels/aot.py: WARNING: leaving out {name}: {why}", flush=True)
      continue
    for prefix, fn, args, *group in module.variants():
      compiled = cute.compile(fn, *args, options=f"--gpu-arch {ARCH}")
      compiled.export_to_c(str(out_dir), prefix, function_prefix=prefix)
      prefixes.append(prefix)
      by_module.setdefault(name, []).append(prefix)
      if group:
        by_group.setdefault(f"{name}_{group[0]}", []).append(prefix)
      print(f"kernels/aot.py: {prefix} ({name})", flush=True)
  shutil.copy2(root / "cu13" / "lib" / "libcuda_dialect_runtime_static.a", out_dir)
  lines = ["// Generated by kernels/aot.py: the ahead-of-time kernels linked into _ffi.",
           "#pragma once"]
  lines += [f'#include "{p}.h"' for p in prefixes]
  lines.append(f'#define CUDNN_JAX_AOT_KERNELS "{",".join(prefixes)}"')
  for name, module_prefixes in (*by_module.items(), *by_group.items()):
    lines.append(f"#define CUDNN_JAX_AOT_{name.upper()}(X) "
                 + " ".join(f"X({p})" for p in module_prefixes))
  (out_dir / "aot_kernels.h").write_text("\n".join(lines) + "\n")
  write_constants(out_dir)
  return prefixes


def main():
  if len(sys.argv) == 3 and sys.argv[1] == "--constants":
    write_constants(pathlib.Path(sys.argv[2]))
    return
  if len(sys.argv) != 2:
    sys.exit(__doc__)
  root = _dsl_root()
  if root is None:
    print("kernels/aot.py: nvidia-cutlass-dsl is not installed", file=sys.stderr)
    sys.exit(NO_DSL)
  _reexec_for_dsl(root)
  build(pathlib.Path(sys.argv[1]).resolve(), root)


if __name__ == "__main__":
  main()
