"""The ahead-of-time compiled CuTe DSL kernels (kernels/aot.py) linked into cudnn_jax._ffi:
every grouped GEMM and block-sparse attention variant is there with its handlers, and a handler reports a bad call as
an error naming the op instead of launching. The kernels' results are tested through their
engines (test_gemm_gpu.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cudnn_jax import _extension
from cudnn_jax.primitives import bsa

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def linked():
  names = _extension.aot_kernels()
  if not names:
    pytest.skip("the extension was built without AOT kernels "
                "(no nvidia-cutlass-dsl at build time and no CUDNN_JAX_KERNELS_DIR)")
  return names


def test_every_variant_is_linked(linked):
  epilogues = _extension.kernel_constants()["grouped_gemm"]["epilogues"]
  dtypes = ("bf16", "f16")
  want = ([f"grouped_gemm_{d}_{e}" for d in dtypes for e in epilogues]
          + [f"grouped_wgrad_{d}" for d in dtypes])
  assert sorted(linked) == sorted(want + sorted(bsa.kernel_variants()))


def test_handlers_are_registered(linked):
  attributes = _extension.handler_attributes()
  assert attributes["cudnn_jax_cute_grouped_gemm"] == ("epilogue",)
  assert attributes["cudnn_jax_cute_grouped_wgrad"] == ()
  assert attributes["cudnn_jax_bsa_fwd"] == attributes["cudnn_jax_bsa_bwd"] == (
      "block_size", "scale", "mask")


def test_unknown_epilogue_is_an_error_naming_the_op(linked):
  m, k, n, groups = 128, 64, 64, 2
  call = jax.ffi.ffi_call("cudnn_jax_cute_grouped_gemm",
                          jax.ShapeDtypeStruct((m, n), jnp.bfloat16))
  starts = jnp.zeros(groups + 1, jnp.int32)
  args = (jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((groups, k, n), jnp.bfloat16),
          jnp.zeros((groups, n), jnp.float32), starts, starts)
  with pytest.raises(Exception, match="cute_grouped_gemm: arguments: epilogue"):
    jax.block_until_ready(jax.jit(lambda *a: call(*a, epilogue="no_such"))(*args))
  # The same call with a linked epilogue runs: no groups, so every row is zero.
  out = jax.jit(lambda *a: call(*a, epilogue="none"))(*args)
  np.testing.assert_array_equal(np.asarray(out, np.float32), 0)
