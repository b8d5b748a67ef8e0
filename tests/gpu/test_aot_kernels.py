"""Ahead-of-time compiled CuTe DSL kernels (kernels/aot.py) linked into cudnn_jax._ffi and
launched through XLA FFI on XLA's stream."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cudnn_jax import _extension

pytestmark = pytest.mark.gpu


def require_kernel(name):
  if name not in _extension.aot_kernels():
    pytest.skip(f"the extension was built without the AOT kernel {name} "
                "(no nvidia-cutlass-dsl at build time and no CUDNN_JAX_KERNELS_DIR)")


@pytest.mark.parametrize("n", [1, 255, 256, 100_003])
def test_axpy_kernel_matches_jnp(n):
  require_kernel("aot_axpy_f32")
  rng = np.random.default_rng(n)
  x, y = (jnp.asarray(rng.standard_normal(n), jnp.float32) for _ in range(2))
  axpy = jax.ffi.ffi_call("cudnn_jax_aot_axpy", jax.ShapeDtypeStruct(x.shape, x.dtype))
  out = jax.jit(lambda x, y: axpy(x, y, alpha=np.float32(-1.5)))(x, y)
  np.testing.assert_allclose(np.asarray(out), -1.5 * np.asarray(x) + np.asarray(y),
                             rtol=1e-6, atol=1e-6)
