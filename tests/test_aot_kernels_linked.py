"""The installed extension links every ahead-of-time kernel variant the "cute" engines use.

Runs where the extension was built (``cudnn_jax._ffi`` importable: on Linux x86-64 every
install builds it, with the CUDA compiler the build requirements bring), so
a dependency change that drops the CuTe DSL from the build (the "cute" engines would then
decline, and MoE would fall back to ``lax.ragged_dot``) fails here instead of passing
silently. The variants are named from the kernels' constants (their epilogues, built
into the extension whether or not the kernels were) by the engine's own naming.
"""

import pytest

from cudnn_jax import _extension
from cudnn_jax.ops import gemm


@pytest.mark.skipif(_extension.module() is None,
                    reason="no built extension: the AOT kernels are not built here")
def test_extension_links_every_variant_the_engines_use():
  epilogues = _extension.kernel_constants()["grouped_gemm"]["epilogues"]
  used = {variant for dtype in ("bfloat16", "float16") for epilogue in epilogues
          for variant in gemm._cute_variants(dtype, epilogue)}  # pylint: disable=protected-access
  linked = set(_extension.aot_kernels())
  assert not used - linked, f"not linked into cudnn_jax._ffi: {sorted(used - linked)}"
  assert linked == used, f"linked but used by no engine: {sorted(linked - used)}"
