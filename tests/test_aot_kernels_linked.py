"""The installed extension links every ahead-of-time kernel variant the engines use: the
"cute" grouped GEMM's, and the "cudnn" block-sparse attention's (NVIDIA's kernels).

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
from cudnn_jax.primitives import bsa


@pytest.mark.skipif(_extension.module() is None,
                    reason="no built extension: the AOT kernels are not built here")
def test_extension_links_every_variant_the_engines_use():
  epilogues = _extension.kernel_constants()["grouped_gemm"]["epilogues"]
  used = {variant for dtype in ("bfloat16", "float16") for epilogue in epilogues
          for variant in gemm._cute_variants(dtype, epilogue)}  # pylint: disable=protected-access
  used |= bsa.kernel_variants()
  linked = set(_extension.aot_kernels())
  assert not used - linked, f"not linked into cudnn_jax._ffi: {sorted(used - linked)}"
  assert linked == used, f"linked but used by no engine: {sorted(linked - used)}"


@pytest.mark.skipif(_extension.module() is None,
                    reason="no built extension: the frontend's KDA kernels are not built here")
def test_extension_hosts_the_frontends_kda_kernels():
  """The build compiles NVIDIA's sm_90 KDA kernels from the pinned nvidia-cudnn-frontend
  wheel (their hashes checked): the "cudnn" engine of kda and gdn needs both targets."""
  m = _extension.module()
  assert {"cudnn_jax_kda_fwd", "cudnn_jax_kda_bwd"} <= set(m.registrations())
  kernels = m.frontend_kernels()
  assert {"kda_fused", "k_meta", "k_prep", "k_scan_t", "k_bwd"} <= set(kernels), kernels
  assert all("nvidia-cudnn-frontend 1.32.0" in source for source in kernels.values()), kernels
