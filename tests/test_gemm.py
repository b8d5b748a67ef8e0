"""gemm and grouped_gemm on the "xla" engine (CPU) against the float64 oracle of SPEC 4."""

import functools


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cudnn_jax
import gemm_oracle as oracle
from cudnn_jax.ops.gemm import gemm, grouped_gemm

TOL = {
    "float32": dict(rtol=1e-5, atol=1e-5),
    "bfloat16": dict(rtol=1e-2, atol=2e-2),
    "float16": dict(rtol=2e-3, atol=2e-3),
    "float8_e4m3fn": dict(rtol=7e-2, atol=2e-2),
}
GRAD_TOL = dict(rtol=1e-4, atol=1e-4)  # float32 inputs against float64


def assert_close(actual, expected, dtype, what=""):
  np.testing.assert_allclose(oracle.f64(actual), expected, err_msg=what,
                             **TOL[jnp.dtype(dtype).name])


def normal(seed, shape, dtype=jnp.float32, scale=1.0):
  # NumPy draws: jax.random would compile a program for every shape.
  return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), dtype)


def gemm_case(dtype, glu, batch=(2,), m=5, k=16, n=8, seed=0):
  """(a, b, bias) with unit-size products (so every activation sees both signs)."""
  cols = 2 * n if glu else n
  return (normal(seed, (*batch, m, k), dtype), normal(seed + 1, (k, cols), dtype, k**-0.5),
          normal(seed + 2, (cols,), dtype))


def grouped_case(dtype, glu, group_sizes, m, g=None, k=16, n=8, seed=0):
  """(lhs, rhs, group_sizes, bias)."""
  g = len(group_sizes) if g is None else g
  cols = 2 * n if glu else n
  return (normal(seed, (m, k), dtype), normal(seed + 1, (g, k, cols), dtype, k**-0.5),
          jnp.asarray(group_sizes, jnp.int32), normal(seed + 2, (g, cols), dtype))


# ---------------------------------------------------------------------------------------
# gemm.


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("activation,glu", oracle.EPILOGUES, ids=oracle.EPILOGUE_IDS)
def test_gemm_matches_oracle(activation, glu, with_bias, dtype):
  a, b, bias = gemm_case(dtype, glu)
  bias = bias if with_bias else None
  out = gemm(a, b, bias=bias, activation=activation, glu=glu)
  assert out.dtype == a.dtype and out.shape == (2, 5, 8)
  assert_close(out, oracle.gemm(a, b, bias, activation, glu), dtype)


@pytest.mark.parametrize("dtype,out_dtype", [
    ("float32", "bfloat16"), ("bfloat16", "float32"), ("float16", "float16"),
    ("bfloat16", "float8_e4m3fn")])
def test_gemm_out_dtype_and_amax(dtype, out_dtype):
  a, b, bias = gemm_case(dtype, "swiglu", batch=(3,))
  out, amax = gemm(a, b, bias=bias, glu="swiglu", out_dtype=out_dtype, return_amax=True)
  expected = oracle.gemm(a, b, bias, glu="swiglu")
  assert out.dtype == jnp.dtype(out_dtype) and amax.dtype == jnp.float32 and amax.shape == ()
  assert_close(out, expected, out_dtype)
  assert_close(amax, np.abs(expected).max(), dtype)
  # amax is taken before the cast: it equals the float32 result's, bit for bit.
  full = gemm(a, b, bias=bias, glu="swiglu", out_dtype=jnp.float32)
  assert amax == jnp.max(jnp.abs(full))


def test_gemm_return_amax_false_returns_only_out():
  a, b, _ = gemm_case("float32", None)
  assert isinstance(gemm(a, b), jax.Array)


def test_gemm_amax_of_empty_output_is_zero():
  a, b, _ = gemm_case("float32", None, m=0)
  out, amax = gemm(a, b, activation="relu", return_amax=True)
  assert out.shape == (2, 0, 8) and amax == 0


@pytest.mark.parametrize("activation,glu,with_bias", [
    ("gelu", None, True), ("gelu_tanh", None, False), ("srelu", None, True),
    (None, "swiglu", True), (None, "geglu", False), (None, "reglu", True)])
def test_gemm_grads_match_oracle(activation, glu, with_bias):
  a, b, bias = gemm_case("float32", glu)
  args = (a, b, bias) if with_bias else (a, b)
  ct = normal(9, (2, 5, 8))
  kw = dict(activation=activation, glu=glu)
  loss = lambda a, b, bias=None: jnp.sum(gemm(a, b, bias=bias, **kw) * ct)
  got = jax.grad(loss, argnums=tuple(range(len(args))))(*args)
  dense = lambda a, b, bias=None: oracle.epilogue(a @ b, bias, xp=jnp, **kw)
  want = oracle.grads64(dense, args, tuple(range(len(args))), ct)
  for name, g, w in zip("a b bias".split(), got, want):
    np.testing.assert_allclose(g, w, err_msg=name, **GRAD_TOL)


def test_gemm_unbatched_and_deep_batch():
  for batch in ((), (2, 3)):
    a, b, bias = gemm_case("float32", None, batch=batch)
    out = gemm(a, b, bias=bias, activation="silu")
    assert out.shape == (*batch, 5, 8)
    assert_close(out, oracle.gemm(a, b, bias, "silu"), "float32")


# ---------------------------------------------------------------------------------------
# grouped_gemm.

TAIL = ([3, 0, 5, 2, 0], 12)  # (group_sizes, M): empty groups and a tail past the sum
GROUPED_CASES = [
    # (group_sizes, M, activation, glu, with_bias, dtype)
    *[(*TAIL, *epi) for epi in [
        (None, None, False, "float32"), (None, None, True, "bfloat16"),
        ("gelu", None, True, "float32"), ("srelu", None, False, "bfloat16"),
        (None, "swiglu", True, "float32"), (None, "geglu", True, "bfloat16"),
        (None, "reglu", False, "float16")]],
    ([0, 0, 0], 4, None, None, True, "float32"),  # every group empty
    ([0, 0, 0], 4, None, "swiglu", True, "bfloat16"),
    ([4, 1, 3], 8, "relu", None, True, "float32"),  # an exact fit
    ([4, 1, 3], 8, None, "geglu", False, "bfloat16"),
]


@pytest.mark.parametrize("sizes,m,activation,glu,with_bias,dtype", GROUPED_CASES)
def test_grouped_gemm_matches_oracle(sizes, m, activation, glu, with_bias, dtype):
  lhs, rhs, group_sizes, bias = grouped_case(dtype, glu, sizes, m)
  bias = bias if with_bias else None
  out = grouped_gemm(lhs, rhs, group_sizes, bias=bias, activation=activation, glu=glu)
  assert out.dtype == lhs.dtype and out.shape == (m, 8)
  assert_close(out, oracle.grouped_gemm(lhs, rhs, sizes, bias, activation, glu), dtype)
  assert np.all(np.asarray(out[sum(sizes):]) == 0)  # exactly 0, bias and all


def test_grouped_gemm_without_epilogue_is_ragged_dot():
  lhs, rhs, group_sizes, _ = grouped_case("bfloat16", None, [3, 0, 5, 2], 12)
  expected = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
  np.testing.assert_array_equal(grouped_gemm(lhs, rhs, group_sizes, out_dtype=jnp.float32),
                                expected)


def test_grouped_gemm_group_sizes_past_m():
  lhs, rhs, group_sizes, bias = grouped_case("float32", None, [3, 4, 9], 10)
  out = grouped_gemm(lhs, rhs, group_sizes, bias=bias, activation="relu")
  assert_close(out, oracle.grouped_gemm(lhs, rhs, [3, 4, 9], bias, "relu"), "float32")


@pytest.mark.parametrize("activation,glu,with_bias", [
    (None, None, True), ("gelu_tanh", None, True), ("silu", None, False),
    (None, "swiglu", True)])
def test_grouped_gemm_grads_match_oracle(activation, glu, with_bias):
  sizes, m = [3, 0, 5, 2, 0], 12
  lhs, rhs, group_sizes, bias = grouped_case("float32", glu, sizes, m)
  kw = dict(activation=activation, glu=glu)
  ct = normal(9, (m, 8))
  argnums = (0, 1, 3) if with_bias else (0, 1)

  def loss(lhs, rhs, group_sizes, bias=None):
    return jnp.sum(grouped_gemm(lhs, rhs, group_sizes, bias=bias, **kw) * ct)

  args = (lhs, rhs, group_sizes, bias)[:4 if with_bias else 3]
  got = jax.jit(jax.grad(loss, argnums=argnums))(*args)
  want = oracle.grads64(oracle.grouped_gemm_dense, args, argnums, ct, **kw)
  for name, g, w in zip(("lhs", "rhs", "bias"), got, want):
    np.testing.assert_allclose(g, w, err_msg=name, **GRAD_TOL)
  assert np.all(np.asarray(got[0][sum(sizes):]) == 0)  # tail rows get no gradient


def test_grouped_gemm_bf16_bias_grad_sums_in_float32():
  """The bias gradient sums over each group's rows: in bf16 those sums would lose digits
  (a gather of the bf16 bias once scattered bf16 cotangents); it must stay near float64."""
  sizes, m = [600, 0, 424], 1024
  lhs, rhs, group_sizes, bias = grouped_case("bfloat16", "swiglu", sizes, m)
  ct = normal(9, (m, 8))

  def loss(bias):
    return jnp.sum(grouped_gemm(lhs, rhs, group_sizes, bias=bias, glu="swiglu") * ct)

  got = jax.jit(jax.grad(loss))(bias)
  args = (lhs, rhs, group_sizes, bias)
  want = oracle.grads64(oracle.grouped_gemm_dense, args, (3,), ct, glu="swiglu")[0]
  err = np.linalg.norm(oracle.f64(got) - want) / np.linalg.norm(want)
  assert err < 1e-2, err


# ---------------------------------------------------------------------------------------
# Transformations and sharding.


def test_gemm_vmap_matches_loop():
  cases = [gemm_case("float32", "geglu", batch=(), seed=3 * i) for i in range(3)]
  stacked = jax.tree.map(lambda *x: jnp.stack(x), *cases)
  f = lambda a, b, bias: gemm(a, b, bias=bias, glu="geglu", return_amax=True)
  out, amax = jax.jit(jax.vmap(f))(*stacked)
  for i, case in enumerate(cases):
    want_out, want_amax = f(*case)
    np.testing.assert_allclose(out[i], want_out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(amax[i], want_amax, rtol=1e-6)


@pytest.mark.parametrize("rhs_axis", [0, None], ids=["rhs_batched", "rhs_shared"])
def test_grouped_gemm_vmap_matches_loop(rhs_axis):
  cases = [grouped_case("float32", "swiglu", sizes, 10, g=3, seed=4 * i)
           for i, sizes in enumerate(([3, 0, 5], [10, 0, 0], [0, 1, 2]))]
  if rhs_axis is None:
    cases = [(c[0], cases[0][1], *c[2:]) for c in cases]
  stacked = jax.tree.map(lambda *x: jnp.stack(x), *cases)
  if rhs_axis is None:
    stacked = (stacked[0], cases[0][1], *stacked[2:])
  in_axes = (0, rhs_axis, 0, 0)
  f = lambda lhs, rhs, gs, bias: grouped_gemm(lhs, rhs, gs, bias=bias, glu="swiglu")
  grad = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 3))
  batched = jax.jit(jax.vmap(f, in_axes))(*stacked)
  grads = jax.jit(jax.vmap(grad, in_axes))(*stacked)
  f, grad = jax.jit(f), jax.jit(grad)
  for i, case in enumerate(cases):
    np.testing.assert_allclose(batched[i], f(*case), rtol=1e-6, atol=1e-6)
    for g, w in zip(grads, grad(*case)):
      np.testing.assert_allclose(g[i], w, rtol=1e-5, atol=1e-5)
  # The gradient of the batched op with the weights shared sums over the batch.
  total = lambda *a: jnp.sum(jax.vmap(f, in_axes)(*a) ** 2)
  d_rhs = jax.grad(total, argnums=1)(*stacked)
  want = grads[1].sum(0) if rhs_axis is None else grads[1]
  np.testing.assert_allclose(d_rhs, want, rtol=1e-5, atol=1e-5)


def test_jit_matches_eager():
  lhs, rhs, group_sizes, bias = grouped_case("bfloat16", None, [3, 0, 5, 2], 12)
  f = functools.partial(grouped_gemm, activation="gelu")
  np.testing.assert_array_equal(jax.jit(f)(lhs, rhs, group_sizes, bias=bias),
                                f(lhs, rhs, group_sizes, bias=bias))
  a, b, bias = gemm_case("bfloat16", "swiglu")
  g = functools.partial(gemm, glu="swiglu", return_amax=True)
  for x, y in zip(jax.jit(g)(a, b, bias=bias), g(a, b, bias=bias)):
    np.testing.assert_array_equal(x, y)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
def test_gemm_batch_sharded_matches_unsharded():
  mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
  a, b, bias = gemm_case("float32", "swiglu", batch=(8,))

  def loss(a, b, bias):
    out = gemm(a, b, bias=bias, glu="swiglu")
    return jnp.sum(out * out), out

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  replicated = NamedSharding(mesh, P())
  (_, out), grads = fn(jax.device_put(a, NamedSharding(mesh, P("data"))),
                       jax.device_put(b, replicated), jax.device_put(bias, replicated))
  (_, ref_out), ref_grads = fn(a, b, bias)
  assert out.sharding.spec[0] == "data", out.sharding
  np.testing.assert_allclose(out, ref_out, rtol=1e-6, atol=1e-6)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# Bad input and engine selection.

_A, _B = jnp.ones((4, 8)), jnp.ones((8, 6))
_L, _R, _G = jnp.ones((5, 8)), jnp.ones((2, 8, 6)), jnp.array([2, 3], jnp.int32)

GEMM_BAD = [
    ("a_rank", dict(a=jnp.ones((8,))), ValueError, "a"),
    ("a_int", dict(a=jnp.ones((4, 8), jnp.int32)), TypeError, "a"),
    ("a_list", dict(a=[[1.0]]), TypeError, "a"),
    ("b_rank", dict(b=jnp.ones((2, 8, 6))), ValueError, "b"),
    ("b_k", dict(b=jnp.ones((7, 6))), ValueError, "b: .*K=8"),
    ("b_dtype", dict(b=jnp.ones((8, 6), jnp.bfloat16)), TypeError, "a, b"),
    ("b_glu_odd", dict(b=jnp.ones((8, 5)), glu="swiglu"), ValueError, "b: .*even"),
    ("bias_shape", dict(bias=jnp.ones((3,))), ValueError, "bias: expected shape \\(6,\\)"),
    ("bias_int", dict(bias=jnp.ones((6,), jnp.int32)), TypeError, "bias"),
    ("activation", dict(activation="tanh"), ValueError, "activation"),
    ("glu", dict(glu="gated"), ValueError, "glu"),
    ("glu_and_activation", dict(glu="swiglu", activation="relu"), ValueError, "activation"),
    ("out_dtype", dict(out_dtype=jnp.int8), TypeError, "out_dtype"),
    ("out_dtype_junk", dict(out_dtype="fast"), TypeError, "out_dtype"),
    ("implementation", dict(implementation="pallas"), ValueError, "implementation"),
]


@pytest.mark.parametrize("change,error,match", [c[1:] for c in GEMM_BAD],
                         ids=[c[0] for c in GEMM_BAD])
def test_gemm_bad_input_names_the_argument(change, error, match):
  with pytest.raises(error, match=match):
    gemm(**(dict(a=_A, b=_B) | change))


GROUPED_BAD = [
    ("lhs_rank", dict(lhs=jnp.ones((1, 5, 8))), ValueError, "lhs"),
    ("rhs_rank", dict(rhs=jnp.ones((8, 6))), ValueError, "rhs"),
    ("rhs_k", dict(rhs=jnp.ones((2, 7, 6))), ValueError, "rhs: .*K=8"),
    ("rhs_dtype", dict(rhs=jnp.ones((2, 8, 6), jnp.float16)), TypeError, "lhs, rhs"),
    ("rhs_glu_odd", dict(rhs=jnp.ones((2, 8, 5)), glu="geglu"), ValueError, "rhs: .*even"),
    ("group_sizes_shape", dict(group_sizes=jnp.array([5], jnp.int32)), ValueError,
     "group_sizes: expected shape \\(2,\\)"),
    ("group_sizes_float", dict(group_sizes=jnp.array([2.0, 3.0])), TypeError, "group_sizes"),
    ("bias_shape", dict(bias=jnp.ones((6,))), ValueError, "bias: expected shape \\(2, 6\\)"),
    ("glu_and_activation", dict(glu="reglu", activation="gelu"), ValueError, "activation"),
]


@pytest.mark.parametrize("change,error,match", [c[1:] for c in GROUPED_BAD],
                         ids=[c[0] for c in GROUPED_BAD])
def test_grouped_gemm_bad_input_names_the_argument(change, error, match):
  with pytest.raises(error, match=match):
    grouped_gemm(**(dict(lhs=_L, rhs=_R, group_sizes=_G) | change))


@pytest.mark.parametrize("impl", ["cudnn", "cute", ("cudnn", "cute")])
def test_unregistered_engines_raise_unsupported(impl):
  bf16 = lambda x: x.astype(jnp.bfloat16)
  with pytest.raises(cudnn_jax.UnsupportedError, match="cudnn: no such engine|cute: default"):
    gemm(bf16(_A), bf16(_B), implementation=impl)
  with pytest.raises(cudnn_jax.UnsupportedError, match="default backend is 'cpu'"):
    grouped_gemm(bf16(_L), bf16(_R), _G, implementation=impl)
  with pytest.raises(cudnn_jax.UnsupportedError, match="dtype float32: bfloat16 and float16"):
    grouped_gemm(_L, _R, _G, implementation=impl)


def test_grouped_gemm_cudnn_engine_is_opt_in():
  s = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  args = [s(x.astype(jnp.bfloat16)) for x in (_L, _R)] + [s(_G)]
  text = cudnn_jax.explain("grouped_gemm", *args)
  assert "'xla' serves" in text and "cudnn: declines: opt-in engine" in text
  assert "cute: declines: default backend is 'cpu'" in text  # not opt-in: a CPU decline
  text = cudnn_jax.explain("grouped_gemm", *args, implementation="cudnn")
  assert "opt-in" not in text  # named explicitly: its own check decides


@pytest.mark.parametrize("op", ["grouped_gemm", "gemm"])
def test_gpu_engines_decline_a_wider_out_dtype(op):
  """The GPU products come out in the input dtype: a float32 out_dtype of bf16 inputs is
  the xla engine's (which keeps the float32 sums), never a rounded value upcast."""
  s = lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
  args = [s(_L), s(_R), _G] if op == "grouped_gemm" else [s(_A), s(_B)]
  text = cudnn_jax.explain(op, *args, out_dtype=jnp.float32, implementation=("cute", "xla"))
  assert "cute: declines: out_dtype float32: the GPU products come out in bfloat16" in text
  text = cudnn_jax.explain(op, *args, out_dtype=jnp.float8_e4m3fn, implementation="cute")
  assert "out_dtype" not in text  # narrower: served (where a GPU is)


def test_engine_sequence_falls_back_to_xla():
  np.testing.assert_array_equal(gemm(_A, _B, implementation=("cudnn", "xla")), gemm(_A, _B))
  np.testing.assert_array_equal(grouped_gemm(_L, _R, _G, implementation=("cute", "xla")),
                                grouped_gemm(_L, _R, _G))


def test_explain_with_shape_structs():
  s = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  text = cudnn_jax.explain("gemm", s(_A), s(_B), bias=s(jnp.ones(6)), glu="swiglu")
  assert "'xla' serves" in text and "cudnn: declines" in text
  text = cudnn_jax.explain("grouped_gemm", s(_L), s(_R), s(_G), implementation="cudnn")
  assert "no requested engine" in text
  with pytest.raises(ValueError, match="b"):
    cudnn_jax.explain("gemm", s(_A), s(jnp.ones((7, 6))))


@pytest.mark.parametrize("engine", ["cudnn", "cute"])
@pytest.mark.parametrize("glu,activation,with_bias", [
    ("swiglu", None, True), (None, "gelu_tanh", True), (None, None, False)])
def test_grouped_gemm_gpu_engine_python_side(engine, glu, activation, with_bias):
  """A GPU engine's wiring (weight layouts, offsets, epilogue, masked tail, VJP) on its
  primitives' CPU emulation of the handlers, against the xla engine: the value alone (the
  cute engine's fused epilogue) and under differentiation."""
  from cudnn_jax.ops import gemm as gemm_module
  run = gemm_module.grouped_gemms[engine]
  from cudnn_jax.reference import gemm as ref  # pylint: disable=g-import-not-at-top
  lhs, rhs, sizes, bias = grouped_case(jnp.float32, glu, [3, 0, 4], m=9, k=6, n=5)
  bias = bias if with_bias else None
  ct = normal(7, (9, 5))

  def grads(run):
    f = lambda lhs, rhs, bias: run(lhs, rhs, sizes, bias, glu=glu, activation=activation)
    out, pull = jax.vjp(f, lhs, rhs, bias)
    return (f(lhs, rhs, bias), out) + pull(ct)

  got, want = grads(run), grads(ref.grouped_gemm)
  assert np.all(np.asarray(got[0])[7:] == 0)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("glu", [None, "swiglu"])
def test_gemm_cute_engine_python_side(glu):
  """gemm's cute engine (one group on the grouped kernel) on the handler's CPU emulation,
  against the xla engine: batch dims, bias, epilogue, amax, gradients."""
  from cudnn_jax.ops import gemm as gemm_module
  a, b, bias = gemm_case(jnp.float32, glu, batch=(2, 3), m=5, k=16, n=8)
  call, inputs = gemm_module._prepare_gemm(  # pylint: disable=protected-access
      a, b, bias=bias, glu=glu, activation=None if glu else "gelu", return_amax=True)

  def value(run, a, b, bias):
    out, amax = run(call, inputs._replace(a=a, b=b, bias=bias))
    return jnp.sum(jnp.sin(out)) + amax

  for f in (value, jax.grad(value, argnums=(1, 2, 3))):
    got = f(gemm_module._run_gemm_cute, a, b, bias)  # pylint: disable=protected-access
    want = f(gemm_module._run_gemm_xla, a, b, bias)  # pylint: disable=protected-access
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
