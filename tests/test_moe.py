"""moe_mlp on the "xla" engine (CPU) against a dense float64 loop over tokens and experts."""

import functools


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cudnn_jax
from cudnn_jax import engines
import gemm_oracle as oracle
from cudnn_jax.ops.moe import moe_mlp

TOL = {
    "float32": dict(rtol=1e-5, atol=1e-5),
    "bfloat16": dict(rtol=2e-2, atol=2e-2),
    "float16": dict(rtol=4e-3, atol=4e-3),
}
GRAD_TOL = dict(rtol=1e-4, atol=1e-4)  # float32 inputs against float64

T, K, E, D, F = 12, 3, 4, 8, 6


def moe_case(dtype="float32", glu="swiglu", t=T, k=K, e=E, d=D, f=F, seed=0,
             out_of_range=True):
  """(x, expert_indices, expert_weights, w_up, w_down). With ``out_of_range``, some
  choices name experts -1, E and E+5; some tokens pick one expert twice."""
  rng = np.random.default_rng(seed)  # not jax.random: that compiles for every shape
  x = jnp.asarray(rng.standard_normal((t, d)), dtype)
  idx = rng.integers(0, e, (t, k))
  if out_of_range:
    idx[1, 0], idx[2, 1], idx[3, :], idx[4, 2] = -1, e, e + 5, -7
  idx = jnp.asarray(idx, jnp.int32)
  weights = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), dtype)
  cols = 2 * f if glu else f
  w_up = jnp.asarray(d**-0.5 * rng.standard_normal((e, d, cols)), dtype)
  w_down = jnp.asarray(f**-0.5 * rng.standard_normal((e, f, d)), dtype)
  return x, idx, weights, w_up, w_down


def assert_close(actual, expected, dtype, what=""):
  np.testing.assert_allclose(oracle.f64(actual), expected, err_msg=what,
                             **TOL[jnp.dtype(dtype).name])


@pytest.mark.parametrize("glu,activation,dtype", [
    ("swiglu", None, "float32"), ("geglu", None, "float32"), ("reglu", None, "float32"),
    (None, "gelu_tanh", "float32"), (None, "srelu", "float32"), (None, None, "float32"),
    ("swiglu", None, "bfloat16"), (None, "relu", "float16")])
def test_moe_matches_dense_loop(glu, activation, dtype):
  args = moe_case(dtype, glu)
  out = jax.jit(functools.partial(moe_mlp, glu=glu, activation=activation))(*args)
  assert out.dtype == args[0].dtype and out.shape == (T, D)
  assert_close(out, oracle.moe_mlp(*args, glu=glu, activation=activation), dtype)
  np.testing.assert_array_equal(out[3], 0)  # every choice of token 3 is out of range


def test_moe_top1_and_one_expert():
  for k, e in ((1, 4), (2, 1)):
    args = moe_case(k=k, e=e, out_of_range=False)
    assert_close(moe_mlp(*args), oracle.moe_mlp(*args), "float32")


def test_out_of_range_choices_contribute_nothing_even_with_inf_weights():
  x, idx, weights, w_up, w_down = moe_case()
  bad = (idx < 0) | (idx >= E)
  weights = jnp.where(bad, jnp.inf, weights)
  out = moe_mlp(x, idx, weights, w_up, w_down)
  assert np.all(np.isfinite(out))
  assert_close(out, oracle.moe_mlp(x, idx, jnp.where(bad, 0, weights), w_up, w_down),
               "float32")
  everything_out = jnp.full_like(idx, E)
  np.testing.assert_array_equal(moe_mlp(x, everything_out, weights, w_up, w_down), 0)


@pytest.mark.parametrize("glu,activation", [("swiglu", None), (None, "gelu")])
def test_moe_grads_match_oracle(glu, activation):
  args = moe_case(glu=glu)
  kw = dict(glu=glu, activation=activation)
  ct = jnp.asarray(np.random.default_rng(7).standard_normal((T, D)), jnp.float32)
  argnums = (0, 2, 3, 4)
  loss = lambda *a: jnp.sum(moe_mlp(*a, **kw) * ct)
  got = jax.jit(jax.grad(loss, argnums=argnums))(*args)
  want = oracle.grads64(oracle.moe_mlp_dense, args, argnums, ct, **kw)
  for name, g, w in zip(("x", "expert_weights", "w_up", "w_down"), got, want):
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, w, err_msg=name, **GRAD_TOL)
  bad = (args[1] < 0) | (args[1] >= E)
  np.testing.assert_array_equal(got[1][bad], 0)


def test_moe_bf16_grads_are_close():
  args = moe_case("bfloat16")
  loss = lambda *a: jnp.sum(moe_mlp(*a).astype(jnp.float32) ** 2)
  got = jax.grad(loss, argnums=(0, 2, 3, 4))(*args)
  want = oracle.grads64(lambda *a: oracle.moe_mlp_dense(*a) ** 2, args, (0, 2, 3, 4),
                        np.ones((T, D)))
  for g, w, a in zip(got, want, (args[0],) + args[2:]):
    assert g.dtype == a.dtype
    np.testing.assert_allclose(oracle.f64(g), w, rtol=5e-2, atol=5e-2)


# ---------------------------------------------------------------------------------------
# Transformations and sharding.


def test_jit_matches_eager():
  args = moe_case("bfloat16")
  np.testing.assert_array_equal(jax.jit(moe_mlp)(*args), moe_mlp(*args))


def test_vmap_matches_loop():
  cases = [moe_case(seed=i) for i in range(3)]
  xs, idxs, ws = (jnp.stack([c[i] for c in cases]) for i in range(3))
  w_up, w_down = cases[0][3:]
  f = lambda x, i, w: moe_mlp(x, i, w, w_up, w_down)
  grad = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 2))
  batched = jax.jit(jax.vmap(f))(xs, idxs, ws)
  grads = jax.jit(jax.vmap(grad))(xs, idxs, ws)
  f, grad = jax.jit(f), jax.jit(grad)
  for i in range(3):
    np.testing.assert_allclose(batched[i], f(xs[i], idxs[i], ws[i]), rtol=1e-6, atol=1e-6)
    for g, w in zip(grads, grad(xs[i], idxs[i], ws[i])):
      np.testing.assert_allclose(g[i], w, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_token_sharded_matches_unsharded(axis_type):
  mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8],
                       axis_types=(getattr(jax.sharding.AxisType, axis_type),))
  args = moe_case(t=16)

  def loss(x, idx, weights, w_up, w_down):
    out = moe_mlp(x, idx, weights, w_up, w_down)
    return jnp.sum(out * out), out

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3, 4), has_aux=True))
  tokens, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  sharded = jax.device_put(args, (tokens,) * 3 + (replicated,) * 2)
  (_, out), grads = fn(*sharded)
  (_, ref_out), ref_grads = fn(*args)
  if axis_type == "Explicit":  # run shard by shard: y keeps x's token sharding
    assert out.sharding.spec[0] == "data", out.sharding
  np.testing.assert_allclose(out, ref_out, rtol=1e-6, atol=1e-6)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
@pytest.mark.parametrize("token_axis", ["data", None])
def test_expert_sharded_matches_unsharded(token_axis):
  """Expert parallelism: w_up / w_down sharded by expert (explicitly), tokens sharded on
  another axis or replicated; outputs and gradients equal the unsharded call."""
  explicit = (jax.sharding.AxisType.Explicit,) * 2
  mesh = jax.make_mesh((2, 4), ("data", "expert"), devices=jax.devices()[:8],
                       axis_types=explicit)
  args = moe_case(t=16)  # 4 experts, a few out-of-range choices

  def loss(x, idx, weights, w_up, w_down):
    out = moe_mlp(x, idx, weights, w_up, w_down)
    return jnp.sum(out * out), out

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3, 4), has_aux=True))
  tokens, experts = NamedSharding(mesh, P(token_axis)), NamedSharding(mesh, P("expert"))
  sharded = jax.device_put(args, (tokens,) * 3 + (experts,) * 2)
  (_, out), grads = fn(*sharded)
  (_, ref_out), ref_grads = fn(*args)
  assert out.sharding.spec[0] == token_axis, out.sharding
  assert grads[2].sharding.spec[0] == "expert", grads[2].sharding
  np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# Bad input and engine selection.

_ARGS = dict(zip(("x", "expert_indices", "expert_weights", "w_up", "w_down"), moe_case()))

MOE_BAD = [
    ("x_rank", dict(x=jnp.ones((1, T, D))), ValueError, "x"),
    ("x_int", dict(x=jnp.ones((T, D), jnp.int32)), TypeError, "x"),
    ("indices_float", dict(expert_indices=jnp.ones((T, K))), TypeError, "expert_indices"),
    ("indices_tokens", dict(expert_indices=jnp.ones((T + 1, K), jnp.int32)), ValueError,
     "expert_indices: .*T=12"),
    ("weights_shape", dict(expert_weights=jnp.ones((T, K + 1))), ValueError,
     "expert_weights: expected shape \\(12, 3\\)"),
    ("weights_int", dict(expert_weights=jnp.ones((T, K), jnp.int32)), TypeError,
     "expert_weights"),
    ("w_up_rank", dict(w_up=jnp.ones((D, 2 * F))), ValueError, "w_up"),
    ("w_up_d", dict(w_up=jnp.ones((E, D + 1, 2 * F))), ValueError, "w_up: .*D=8"),
    ("w_up_odd", dict(w_up=jnp.ones((E, D, 2 * F + 1))), ValueError, "w_up: .*even"),
    ("w_up_dtype", dict(w_up=jnp.ones((E, D, 2 * F), jnp.bfloat16)), TypeError, "x, w_up"),
    ("w_down_shape", dict(w_down=jnp.ones((E, 2 * F, D))), ValueError,
     "w_down: expected shape \\(4, 6, 8\\)"),
    ("w_down_experts", dict(w_down=jnp.ones((E + 1, F, D))), ValueError, "w_down"),
    ("glu", dict(glu="gegelu"), ValueError, "glu"),
    ("glu_and_activation", dict(activation="relu"), ValueError, "activation"),
]


@pytest.mark.parametrize("change,error,match", [c[1:] for c in MOE_BAD],
                         ids=[c[0] for c in MOE_BAD])
def test_bad_input_names_the_argument(change, error, match):
  with pytest.raises(error, match=match):
    moe_mlp(**(_ARGS | change))


def test_engines_and_explain():
  with pytest.raises(cudnn_jax.UnsupportedError, match="cudnn: dtype float32: bfloat16 and"):
    moe_mlp(**_ARGS, implementation="cudnn")
  bf16 = {k: v.astype(jnp.bfloat16) if v.dtype == jnp.float32 else v for k, v in _ARGS.items()}
  with pytest.raises(cudnn_jax.UnsupportedError, match="cudnn: default backend"):
    moe_mlp(**bf16, implementation="cudnn")
  np.testing.assert_array_equal(moe_mlp(**_ARGS, implementation=("cute", "xla")),
                                moe_mlp(**_ARGS))
  structs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in _ARGS.items()}
  text = cudnn_jax.explain("moe_mlp", *structs.values(), glu="geglu")
  assert "'xla' serves" in text and "cute: declines" in text


@pytest.mark.parametrize("engine", ["cudnn", "cute"])
def test_gpu_engine_python_side(engine):
  """moe_mlp's GPU engines (both projections on a GPU grouped product) on their primitives'
  CPU emulation of the handlers, against the xla engine: values and gradients."""
  from cudnn_jax.ops import moe as moe_module  # pylint: disable=g-import-not-at-top
  x, idx, weights, w_up, w_down = moe_case()

  def loss(name, x, weights, w_up, w_down):
    call, inputs = moe_module._prepare(x, idx, weights, w_up, w_down)  # pylint: disable=protected-access
    return jnp.sum(jnp.sin(engines.engine("moe_mlp", name).run(call, inputs)))

  value_and_grad = jax.value_and_grad(loss, argnums=(1, 2, 3, 4))
  got = value_and_grad(engine, x, weights, w_up, w_down)
  want = value_and_grad("xla", x, weights, w_up, w_down)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
