"""conv3d's cudnn engine on the CPU: its primitives lower to the handlers' contracts in plain
JAX (cudnn_jax/primitives/conv3d.py), so the engine's own work (the graph's tail, the sum of
squares the norm reads, the custom VJP over the dgrad and wgrad graphs, vmap, sharding)
runs here against the float64 oracle, the engine forced past its support check."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cudnn_jax
from conv3d_oracle import assert_gradients_match, case, normal, oracle
from cudnn_jax import _extension, engines
from cudnn_jax.ops import conv3d as conv3d_module
from cudnn_jax.primitives import conv3d as prim
from mesh_cases import assert_no_collectives, mesh_or_skip

OPTIONS = [
    ("same", dict()),
    ("valid_strided", dict(padding="VALID", strides=(1, 2, 2))),
    ("causal_dilated", dict(padding="CAUSAL", dilation=(2, 1, 2))),
    ("explicit_strided", dict(padding=((2, 0), (1, 2), (0, 1)), strides=(2, 1, 3))),
    ("silu", dict(activation="silu")),
    ("gelu_causal", dict(activation="gelu", padding="CAUSAL")),
    ("relu", dict(activation="relu", kernel=(1, 3, 3))),
    ("rms", dict(norm="rms", kernel=(3, 1, 1))),
    ("rms_silu", dict(norm="rms", activation="silu", padding="CAUSAL")),
    ("l2_gelu", dict(norm="l2", activation="gelu", strides=(2, 2, 1))),
    ("group_relu", dict(norm="group", num_groups=4, activation="relu")),
    ("group_silu_1x1x1", dict(norm="group", num_groups=2, activation="silu", kernel=(1, 1, 1))),
]


def _arrays(extras, dtype=jnp.float32, **kwargs):
  """A random call: with ``extras`` its bias, residual and the norm's scale and bias, else
  none of them."""
  arrays, kwargs = case(n=2, spatial=(4, 5, 6), cin=8, cout=16, dtype=dtype, **kwargs)
  if not extras:
    return dict(x=arrays["x"], w=arrays["w"]), kwargs
  shape = jax.eval_shape(functools.partial(cudnn_jax.conv3d, **kwargs), **arrays).shape
  return dict(arrays, residual=normal(11, shape, dtype=dtype)), kwargs


@pytest.mark.parametrize("extras,tail", [(True, None), (True, "cudnn"), (False, "cudnn"),
                                         (True, "xla")],
                         ids=["extras_by_use", "extras", "bare", "extras_tail_in_xla"])
@pytest.mark.parametrize("kwargs", [k for _, k in OPTIONS], ids=[n for n, _ in OPTIONS])
def test_values_and_gradients_match_float64(emulated, monkeypatch, kwargs, extras, tail):
  arrays, kwargs = _arrays(extras, **kwargs)
  emulated("conv3d", "cudnn")
  if tail is not None:  # else each use's own placement
    monkeypatch.setattr(conv3d_module, "TAIL", dict.fromkeys(conv3d_module.USES, tail))
  call = functools.partial(cudnn_jax.conv3d, **kwargs)
  got = jax.jit(lambda a: call(**a))(arrays)
  want = oracle(**arrays, **kwargs)
  assert got.shape == want.shape and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-4, atol=1e-4)
  weights = np.random.default_rng(5).standard_normal(want.shape)
  loss = lambda a: jnp.sum(call(**a) * weights.astype(np.float32))
  assert_gradients_match(arrays, kwargs, jax.jit(jax.grad(loss))(arrays), weights)


def _rel(a, b):
  a, b = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (a, b))
  assert np.all(np.isfinite(a)), "non-finite values"
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@pytest.mark.parametrize("out_dtype", [None, jnp.float32], ids=["bf16_out", "f32_out"])
@pytest.mark.parametrize("kwargs", [dict(norm="rms", activation="silu", padding="CAUSAL"),
                                    dict(activation="gelu"),
                                    dict(norm="group", num_groups=4)],
                         ids=["rms_silu", "gelu", "group"])
def test_bf16_matches_the_xla_engine(emulated, kwargs, out_dtype):
  """bf16 inputs, a float32 residual: values and every gradient against the xla engine."""
  arrays, kwargs = _arrays(True, dtype=jnp.bfloat16, **kwargs)
  arrays["residual"] = arrays["residual"].astype(jnp.float32)
  call = functools.partial(cudnn_jax.conv3d, out_dtype=out_dtype, **kwargs)
  loss = lambda a: jnp.sum(jnp.sin(call(**a).astype(jnp.float32)))
  run = jax.jit(lambda a: (call(**a), jax.grad(loss)(a)))
  want, want_grads = run(arrays)
  emulated("conv3d", "cudnn")
  got, grads = jax.jit(lambda a: (call(**a), jax.grad(loss)(a)))(arrays)
  assert got.dtype == want.dtype == (out_dtype or jnp.bfloat16)
  assert _rel(got, want) < (1e-2 if out_dtype is None else 5e-3)
  for name, g in grads.items():
    assert g.dtype == arrays[name].dtype, name
    assert _rel(g, want_grads[name]) < 2e-2, name


def test_float32_out_keeps_float32_precision(emulated):
  """out_dtype=float32 on bf16 inputs: the graph writes float32, nothing rounds to bf16."""
  arrays, kwargs = _arrays(True, dtype=jnp.bfloat16, norm="rms", activation="silu")
  emulated("conv3d", "cudnn")
  got = cudnn_jax.conv3d(**arrays, **kwargs, out_dtype=jnp.float32)
  err = np.abs(np.asarray(got, np.float64) - oracle(**arrays, **kwargs)).max()
  assert err < 1e-4, err


def test_l2_norm_of_a_zero_pixel_sends_wgrad_finite_cotangents(emulated, monkeypatch):
  """Output rows that see only padding (no bias, no residual) are 0: the l2 norm's clamp
  holds there, and no NaN from sqrt's derivative at 0 may reach the wgrad graph, which
  multiplies it by the padding's zeros (the CPU's convolution skips those; cuDNN's not)."""
  arrays, kwargs = case(spatial=(2, 4, 5), kernel=(1, 3, 3), norm="l2", activation="relu",
                        padding=((1, 2), (2, 2), (1, 0)))
  del arrays["bias"]
  emulated("conv3d", "cudnn")
  wgrad = prim.wgrad

  def checked_wgrad(config, x, dy):
    assert np.all(np.isfinite(np.asarray(dy))), "the wgrad's cotangent"
    return wgrad(config, x, dy)
  monkeypatch.setattr(prim, "wgrad", checked_wgrad)
  call = functools.partial(cudnn_jax.conv3d, **kwargs)
  grads = jax.grad(lambda a: jnp.sum(call(**a) ** 2))(arrays)
  for name, g in grads.items():
    assert np.all(np.isfinite(np.asarray(g))), name


def test_vmap_folds_into_the_batch(emulated):
  """vmapped x (folded into the graph's batch), vmapped weights (the contract vmapped), and
  per-example weight gradients (one wgrad per vmapped example)."""
  arrays, kwargs = _arrays(True, norm="rms", activation="silu")
  emulated("conv3d", "cudnn")
  call = lambda a: cudnn_jax.conv3d(**a, **kwargs)
  stacked = {k: jnp.stack([v, 0.5 * v]) for k, v in arrays.items()}
  for axes in ({k: 0 for k in arrays}, dict({k: None for k in arrays}, x=0, residual=0)):
    args = {k: v if axes[k] == 0 else arrays[k] for k, v in stacked.items()}
    out = jax.vmap(call, in_axes=(axes,))(args)
    for i in range(2):
      one = {k: v[i] if axes[k] == 0 else v for k, v in args.items()}
      np.testing.assert_allclose(out[i], call(one), rtol=1e-5, atol=1e-5)
  loss = lambda a: jnp.sum(jnp.sin(call(a)))
  per_example = jax.vmap(jax.grad(loss), in_axes=(dict({k: None for k in arrays}, x=0),))(
      dict(arrays, x=stacked["x"]))
  for i in range(2):
    want = jax.grad(loss)(dict(arrays, x=stacked["x"][i]))
    for name in arrays:
      np.testing.assert_allclose(per_example[name][i], want[name], rtol=1e-4, atol=1e-5,
                                 err_msg=name)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_batch_sharded_is_local(emulated, axis_type):
  arrays, kwargs = _arrays(True, norm="rms", activation="silu", padding="CAUSAL")
  arrays = {k: jnp.concatenate([v, -v]) if k in ("x", "residual") else v
            for k, v in arrays.items()}  # batch 4
  call = functools.partial(cudnn_jax.conv3d, **kwargs)
  loss = lambda a: jnp.sum(jnp.sin(call(**a)))
  emulated("conv3d", "cudnn")
  want, want_grads = call(**arrays), jax.grad(loss)(arrays)
  mesh = mesh_or_skip((4, 2), ("b", "h"), axis_type)
  with jax.set_mesh(mesh):
    batch = NamedSharding(mesh, P("b"))
    args = dict(arrays, x=jax.device_put(arrays["x"], batch),
                residual=jax.device_put(arrays["residual"], batch))
    out = jax.jit(lambda a: call(**a))(args)
    grads = jax.jit(jax.grad(loss))(args)
    assert_no_collectives(jax.jit(lambda a: call(**a)), args)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  assert out.sharding.spec[0] == "b", out.sharding
  for name, g in grads.items():
    np.testing.assert_allclose(g, want_grads[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_explain_says_how_the_engine_computes(monkeypatch):
  spec = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  x, w, c = spec((1, 4, 8, 8, 16)), spec((3, 3, 3, 16, 16)), spec((16,))
  text = cudnn_jax.explain("conv3d", x, w, c, norm="rms", norm_scale=c, activation="silu")
  assert "cudnn: declines" in text and "'xla' serves" in text
  x, w, c = (jnp.zeros(a.shape, a.dtype) for a in (x, w, c))
  prepare = lambda **kw: engines._OPS["conv3d"].prepare(x, w, c, **kw)  # pylint: disable=protected-access
  describe = engines.engine("conv3d", "cudnn").describe
  assert describe(prepare(norm="rms", activation="silu")) == (
      "inference: cuDNN graph: conv; then in XLA: bias + rms norm + silu; differentiated: "
      "cuDNN graph: conv + bias + each pixel's sum of squares; then in XLA: rms norm + silu")
  monkeypatch.setattr(conv3d_module, "TAIL", dict.fromkeys(conv3d_module.USES, "cudnn"))
  assert describe(prepare(activation="silu")) == "one cuDNN graph: conv + bias + silu"
  assert describe(prepare(norm="rms", activation="silu")) == (
      "cuDNN graph: conv + bias + each pixel's sum of squares; then in XLA: rms norm + silu")
  assert describe(prepare(norm="group", num_groups=4)) == (
      "cuDNN graph: conv + bias; then in XLA: group statistics, then group norm")
  monkeypatch.setattr(conv3d_module, "TAIL", dict.fromkeys(conv3d_module.USES, "xla"))
  assert describe(prepare(norm="group", num_groups=4)) == (
      "cuDNN graph: conv; then in XLA: group statistics, then bias + group norm")
  assert describe(prepare(activation="silu")) == "one cuDNN graph: conv + bias + silu"


def test_cudnn_declines_what_it_cannot_serve():
  arrays, kwargs = _arrays(False)
  call = engines._OPS["conv3d"].prepare(**arrays, **kwargs)  # pylint: disable=protected-access
  assert "bfloat16 and float16" in engines.engine("conv3d", "cudnn").supports(call)
  with pytest.raises(cudnn_jax.UnsupportedError, match="cudnn"):
    cudnn_jax.conv3d(**arrays, implementation="cudnn")


def test_config_attributes_are_the_handlers():
  config = prim.Conv3dConfig(padding=((2, 0), (1, 1), (1, 1)), strides=(1, 2, 2),
                             dilation=(1, 1, 1), x_spatial=(4, 8, 8), kernel=(3, 3, 3))
  attributes = config.attributes()
  assert attributes["pad_t_lo"] == 2 and attributes["stride_h"] == 2
  for target in ("cudnn_jax_conv3d_fwd", "cudnn_jax_conv3d_dgrad", "cudnn_jax_conv3d_wgrad"):
    names = _extension.handler_attributes().get(target)
    if names is not None:  # built with the extension
      assert names == tuple(attributes), target


def test_cuda_lowering_calls_the_three_handlers(emulated, monkeypatch):
  """The engine lowered for CUDA (exported, no GPU needed): the forward handler with the
  graph's tail as attributes, and under differentiation its activation-free twin, dgrad
  and wgrad."""

  class Sized:  # the extension's workspace query, without a device
    conv3d_workspace = staticmethod(lambda config: 256)

  monkeypatch.setattr(_extension, "module", lambda: Sized)
  emulated("conv3d", "cudnn")
  targets = [f"cudnn_jax_conv3d_{p}" for p in ("fwd", "dgrad", "wgrad")]
  export = functools.partial(
      jax.export.export, platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(t) for t in targets])
  arrays, kwargs = _arrays(True, dtype=jnp.bfloat16, activation="silu", padding="CAUSAL")
  call = lambda a: cudnn_jax.conv3d(**a, **kwargs)
  forward = export(jax.jit(call))(arrays).mlir_module()
  assert forward.count("cudnn_jax_conv3d_fwd") == 1 and "dgrad" not in forward
  assert 'activation = "silu"' in forward and "pad_t_lo = 2 : i32" in forward
  loss = lambda a: jnp.sum(call(a).astype(jnp.float32))
  backward = export(jax.jit(jax.grad(loss)))(arrays).mlir_module()
  for target in targets:
    assert backward.count(target) == 1, target
  assert 'activation = "none"' in backward


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_block_takes_the_cudnn_engine_where_it_serves(monkeypatch, api):
  """CausalConv3dBlock in bf16 where the cudnn engine serves (its support check told so,
  as on a GPU): every convolution of the block runs on it, by default, and the block's
  output is the xla engine's."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from cudnn_jax import flax_modules  # pylint: disable=g-import-not-at-top
  from cudnn_jax.flax_modules import nnx as nnx_modules  # pylint: disable=g-import-not-at-top

  class Serves:
    conv3d_check = staticmethod(lambda config: "")

  x = normal(0, (1, 4, 6, 6, 8), dtype=jnp.bfloat16)
  if api == "linen":
    block = lambda **kw: flax_modules.CausalConv3dBlock(features=16, **kw)
    params = block().init(jax.random.key(0), x)
    run = lambda **kw: block(**kw).apply(params, x)
  else:  # the same seed, the same parameters
    run = lambda **kw: nnx_modules.CausalConv3dBlock(8, 16, rngs=nnx.Rngs(0), **kw)(x)
  want = run(implementation="xla")
  monkeypatch.setattr(_extension, "unavailable_reason", lambda: None)
  monkeypatch.setattr(_extension, "module", lambda: Serves)
  chosen, choose = [], engines.choose
  monkeypatch.setattr(engines, "choose", lambda *a: chosen.append(choose(*a).name) or
                      engines.engine("conv3d", chosen[-1]))
  got = run()
  assert chosen == ["cudnn"] * 3, chosen  # conv1, the 1x1x1 skip, conv2
  assert _rel(got, want) < 2e-2


def test_placement_by_use(emulated, monkeypatch):
  """A call that is not differentiated runs the "inference" graph, a differentiated one the
  "training" graph (and its backward), with the same values."""
  arrays, kwargs = _arrays(True, norm="rms", activation="silu")
  emulated("conv3d", "cudnn")
  graphs = []
  original = prim.forward

  def recorded(config, *args):
    graphs.append((config.has_bias, config.with_sumsq))
    return original(config, *args)

  monkeypatch.setattr(prim, "forward", recorded)
  call = lambda a: cudnn_jax.conv3d(**a, **kwargs)
  y = jax.jit(call)(arrays)
  assert graphs == [(False, False)]  # the convolution alone; the tail in XLA
  graphs.clear()
  y_train, pull = jax.vjp(call, arrays)
  assert graphs == [(True, True)]  # bias and the norm's sums in the graph
  np.testing.assert_allclose(y_train, y, rtol=1e-5, atol=1e-5)
  weights = np.random.default_rng(6).standard_normal(y.shape).astype(np.float32)
  assert_gradients_match(arrays, kwargs, pull(jnp.asarray(weights))[0], weights)
