"""The GPU engines of grouped_gemm, gemm and moe_mlp on the CPU, against the xla engine.

Off the GPU their primitives (cudnn_jax/primitives/grouped_gemm.py) lower to the handlers'
contracts in plain JAX, so everything the engines do around the FFI calls (the batch's
regrouping, the custom VJPs, the fused/unfused split, routing) runs here, engine choice
forced past the support checks (which decline without a GPU) by conftest's ``emulated``.
"""



import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gemm_oracle as oracle
from cudnn_jax import engines

from cudnn_jax.ops import gemm as gemm_module
from cudnn_jax.ops import moe as moe_module


def _rel(a, b):
  a, b = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (a, b))
  assert np.all(np.isfinite(a)), "non-finite values"
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@pytest.mark.parametrize("engine", ["cute", "cudnn"])
@pytest.mark.parametrize("glu,activation", [("swiglu", None), (None, "gelu"), (None, None)])
def test_grouped_gemm_engine_matches_xla(emulated, engine, glu, activation):
  rng = np.random.default_rng(0)
  m, k, n, g = 40, 16, 24, 3
  cols = 2 * n if glu else n
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((g, k, cols)) / 4, jnp.bfloat16)
  bias = jnp.asarray(rng.standard_normal((g, cols)), jnp.bfloat16)
  sizes = jnp.asarray([9, 0, 23], jnp.int32)  # an empty group; 8 rows past the last
  ct = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)

  def value_and_grads(lhs, rhs, bias):
    f = lambda *a: gemm_module.grouped_gemm(*a[:2], sizes, bias=a[2], glu=glu,
                                             activation=activation)
    y, pull = jax.vjp(f, lhs, rhs, bias)
    return (f(lhs, rhs, bias), y) + pull(ct.astype(y.dtype))

  want = jax.jit(value_and_grads)(lhs, rhs, bias)
  emulated("grouped_gemm", engine)
  got = jax.jit(lambda *a: value_and_grads(*a))(lhs, rhs, bias)  # a new trace
  for name, a, b in zip(["out", "out (differentiated)", "dlhs", "drhs", "dbias"], got, want):
    assert _rel(a, b) < 2e-2, name
  np.testing.assert_array_equal(np.asarray(got[0][32:], np.float32), 0.0)


@pytest.mark.parametrize("engine", ["cute", "cudnn"])
def test_negative_and_overlong_group_sizes_agree_on_every_engine(emulated, engine):
  """A negative size counts as 0 and groups past M are cut there (SPEC section 8), on the
  GPU engines as on the xla engine, both equal to the float64 math of the served sizes."""
  rng = np.random.default_rng(2)
  lhs = jnp.asarray(rng.standard_normal((12, 16)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((3, 16, 8)) / 4, jnp.bfloat16)
  cases = {(5, -3, 4): (5, 0, 4), (5, 3, 9): (5, 3, 4), (-7, 20, 1): (0, 12, 0)}
  run = lambda: {given: jax.jit(lambda *a: gemm_module.grouped_gemm(*a))(  # a new trace
      lhs, rhs, jnp.asarray(given, jnp.int32)) for given in cases}
  xla = run()
  emulated("grouped_gemm", engine)
  got = run()
  for given, served in cases.items():
    want = oracle.grouped_gemm(lhs, rhs, np.asarray(served))
    assert _rel(xla[given], want) < 1e-2 and _rel(got[given], want) < 1e-2, given
    np.testing.assert_array_equal(np.asarray(got[given], np.float32)[sum(served):], 0.0)


@pytest.mark.parametrize("engine", ["cute", "cudnn"])
def test_moe_mlp_engine_matches_xla(emulated, engine):
  rng = np.random.default_rng(1)
  t, d, f, e, k = 50, 16, 8, 4, 2
  x = jnp.asarray(rng.standard_normal((t, d)), jnp.bfloat16)
  w_up = jnp.asarray(rng.standard_normal((e, d, 2 * f)) / 4, jnp.bfloat16)
  w_down = jnp.asarray(rng.standard_normal((e, f, d)) / 3, jnp.bfloat16)
  idx = rng.integers(0, e, (t, k))
  idx[:3, 0] = e  # out of range: contributes 0
  idx = jnp.asarray(idx, jnp.int32)
  weights = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)

  def value_and_grads(x, weights, w_up, w_down):
    f = lambda *a: moe_module.moe_mlp(a[0], idx, *a[1:])
    y, pull = jax.vjp(f, x, weights, w_up, w_down)
    return (y,) + pull(dy.astype(y.dtype))

  want = jax.jit(value_and_grads)(x, weights, w_up, w_down)
  emulated("moe_mlp", engine)
  got = jax.jit(lambda *a: value_and_grads(*a))(x, weights, w_up, w_down)  # a new trace
  for name, a, b in zip(["y", "dx", "dweights", "dw_up", "dw_down"], got, want):
    assert _rel(a, b) < 2e-2, name


def test_cudnn_ffi_call_takes_a_workspace_result(monkeypatch):
  """The cuDNN handler's workspace is an extra u8 result sized by the extension for the
  call's (regrouped) shapes; the call hands back the product alone."""
  from cudnn_jax import _extension  # pylint: disable=g-import-not-at-top
  from cudnn_jax.primitives import grouped_gemm as prim  # pylint: disable=g-import-not-at-top
  queries = []

  class FakeModule:
    @staticmethod
    def grouped_matmul_workspace(query):
      queries.append(query)
      return 512

  monkeypatch.setattr(_extension, "module", FakeModule)
  lhs = jax.ShapeDtypeStruct((2, 40, 16), jnp.bfloat16)  # a batch of two, weights shared
  rhs = jax.ShapeDtypeStruct((1, 3, 16, 24), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((2, 3), jnp.int32)
  out, = jax.eval_shape(lambda *a: prim._matmul_ffi(None, *a), lhs, rhs, sizes)  # pylint: disable=protected-access
  assert (out.shape, out.dtype) == ((2, 40, 24), jnp.bfloat16)
  assert queries == [dict(dtype="bfloat16", m=80, k=16, n=24, groups=3)]


@pytest.mark.parametrize("shared", [True, False], ids=["rhs_shared", "rhs_batched"])
def test_batch_regrouping_of_the_handler_calls(shared):
  """A batch runs as one handler call on rows regrouped across it: the regrouping (what the
  GPU lowering does around the FFI call) with a plain-JAX call in the handler's place."""
  from cudnn_jax.primitives import grouped_gemm as prim  # pylint: disable=g-import-not-at-top
  from cudnn_jax.reference import gemm as ref  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(3)
  b, m, k, n, g = 3, 12, 8, 5, 3
  lhs = jnp.asarray(rng.standard_normal((b, m, k)), jnp.float32)
  ct = jnp.asarray(rng.standard_normal((b, m, n)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((1 if shared else b, g, k, n)), jnp.float32)
  sizes = jnp.asarray([[4, 0, 5], [12, 3, 1], [-2, 6, 2]], jnp.int32)  # past M; negative
  weights = rhs.reshape(-1, k, n)
  product = lambda rows, s: ref.grouped_gemm(rows, weights, s)
  got = prim._regrouped(product, lhs, sizes, shared)  # pylint: disable=protected-access
  outer = lambda rows, c, s: ref.grouped_outer(rows, c, s)
  got_outer = prim._regrouped_outer(outer, lhs, ct, sizes)  # pylint: disable=protected-access
  for i in range(b):
    r = rhs[0 if shared else i]
    np.testing.assert_allclose(got[i], ref.grouped_gemm(lhs[i], r, sizes[i]), atol=1e-5)
    want = ref.grouped_outer(lhs[i], ct[i], ref.clamped_sizes(sizes[i], m))
    np.testing.assert_allclose(got_outer[i], want, atol=1e-5)


def test_kernel_epilogues_are_the_librarys():
  """The grouped GEMM kernel's epilogue names (read back from the extension's build) are
  cudnn_jax.epilogue's."""
  from cudnn_jax import _extension, epilogue  # pylint: disable=g-import-not-at-top
  constants = _extension.kernel_constants()
  if constants is None:
    pytest.skip("the extension is not built")
  kernel = constants["grouped_gemm"]
  assert tuple(kernel["epilogues"]) == ("none", *epilogue.ACTIVATIONS, *epilogue.GLU_ACTIVATION)
  assert tuple(kernel["glu_epilogues"]) == tuple(epilogue.GLU_ACTIVATION)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("engine", ["cute", "cudnn"])
def test_vmapped_engine_keeps_a_sharded_batch_local(emulated, engine, axis_type):
  """jax.vmap(grouped_gemm) of a batch-sharded lhs on a GPU engine's primitives: computed
  where the batch lives (no collective), the output sharded like it, values and gradients
  equal to the unsharded call."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from mesh_cases import assert_no_collectives, mesh_or_skip  # pylint: disable=g-import-not-at-top
  mesh = mesh_or_skip((4, 2), ("b", "x"), axis_type)
  rng = np.random.default_rng(5)
  v, m, k, n, g = 8, 12, 16, 8, 3
  lhs = jnp.asarray(rng.standard_normal((v, m, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((g, k, 2 * n)) / 4, jnp.bfloat16)
  sizes = jnp.asarray(rng.integers(0, 6, (v, g)), jnp.int32)
  f = jax.vmap(lambda l, s, r: gemm_module.grouped_gemm(l, r, s, glu="swiglu"),
               in_axes=(0, 0, None))
  loss = lambda l, s, r: jnp.sum(jnp.square(f(l, s, r).astype(jnp.float32)))
  emulated("grouped_gemm", engine)
  want = jax.jit(jax.value_and_grad(loss, (0, 2)))(lhs, sizes, rhs)
  with jax.set_mesh(mesh):
    batch = NamedSharding(mesh, P("b"))
    args = (jax.device_put(lhs, batch), jax.device_put(sizes, batch), rhs)
    out = jax.jit(f)(*args)
    got = jax.jit(jax.value_and_grad(loss, (0, 2)))(*args)
    assert_no_collectives(jax.jit(f), *args)
  assert out.sharding.spec[0] == "b"
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert _rel(a, b) < 1e-2
