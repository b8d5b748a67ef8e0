"""cudnn_jax.flax_modules (linen) against flax's own layers and plain-JAX definitions."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cudnn_jax import flax_modules as fm

TOL = dict(rtol=2e-5, atol=2e-5)


def normal(seed, shape, scale=1.0):
  return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("batch", [(3,), (2, 3)])
def test_attention_fn_in_flax_multi_head_attention(batch):
  x = normal(0, batch + (10, 16))
  mask = nn.make_causal_mask(jnp.ones(batch + (10,)))
  make = lambda **kw: nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=16, **kw)
  params = make().init(jax.random.key(0), x, mask=mask)
  want = make().apply(params, x, mask=mask)
  got = make(attention_fn=fm.dot_product_attention).apply(params, x, mask=mask)
  np.testing.assert_allclose(got, want, **TOL)


def test_attention_fn_dropout_is_off_when_deterministic():
  q, k, v = (normal(i, (2, 8, 2, 4)) for i in range(3))
  rng = jax.random.key(3)
  plain = fm.dot_product_attention(q, k, v)
  off = fm.dot_product_attention(q, k, v, dropout_rng=rng, dropout_rate=0.5, deterministic=True)
  on = fm.dot_product_attention(q, k, v, dropout_rng=rng, dropout_rate=0.5)
  np.testing.assert_array_equal(off, plain)
  assert on.shape == plain.shape and not np.allclose(on, plain)


def _heads(dense_params, x):
  return jnp.einsum("...d,dnh->...nh", x, dense_params["kernel"]) + dense_params["bias"]


@pytest.mark.parametrize("with_segments", [False, True])
def test_multi_head_attention_matches_its_definition(with_segments):
  x = normal(1, (2, 12, 16))
  seg = jnp.asarray([[0] * 5 + [1] * 7, [0] * 12], jnp.int32) if with_segments else None
  layer = fm.MultiHeadAttention(num_heads=4, head_dim=8, num_kv_heads=2, is_causal=True)
  params = layer.init(jax.random.key(0), x, segment_ids=seg)
  got = layer.apply(params, x, segment_ids=seg)
  p = params["params"]
  q, k, v = (_heads(p[n], x) for n in ("query", "key", "value"))
  mask = None if seg is None else (seg[:, None, :, None] == seg[:, None, None, :])
  o = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)
  want = jnp.einsum("btnh,nhd->btd", o, p["out"]["kernel"]) + p["out"]["bias"]
  np.testing.assert_allclose(got, want, **TOL)


def decode_in_steps(layer, x, *, prompt):
  """The linen ``layer`` on ``x [B, T, F]``: ``(params, output over the whole x, the
  jitted decode step, the outputs of a ``prompt``-token chunk then one token at a time
  through the paged cache, the final cache)``."""
  params = layer.init(jax.random.key(0), x)["params"]
  full = layer.apply({"params": params}, x)
  cache = layer.init(jax.random.key(0), x, decode=True)["cache"]
  step = jax.jit(lambda cache, x: layer.apply({"params": params, "cache": cache}, x,
                                              decode=True, mutable=["cache"]))
  outs = []
  for lo, hi in [(0, prompt)] + [(t, t + 1) for t in range(prompt, x.shape[1])]:
    y, variables = step(cache, x[:, lo:hi])
    outs.append(y)
    cache = variables["cache"]
  return params, full, step, jnp.concatenate(outs, 1), cache


@pytest.mark.parametrize("window", [None, (5, 0)])
def test_multi_head_attention_decodes_from_a_paged_cache(window):
  """A chunk of the prompt, then one token at a time through the paged KV cache, equals
  attention over the whole sequence."""
  x = normal(7, (2, 20, 16))
  layer = fm.MultiHeadAttention(num_heads=4, head_dim=8, num_kv_heads=2, is_causal=True,
                                local_window_size=window, page_size=4)
  params, full, step, out, cache = decode_in_steps(layer, x, prompt=7)
  assert cache["key_pages"].shape == (2 * 5, 4, 2, 8)  # room for 20 tokens
  np.testing.assert_allclose(out, full, **TOL)
  np.testing.assert_array_equal(cache["lengths"], [20, 20])
  with pytest.raises(ValueError, match="decode"):
    step(cache, x[:, :2, None])


def fp8_rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


FP8_TOL = 0.08  # ||a - b|| / ||b|| of a layer's output over an e4m3 cache


def test_multi_head_attention_decodes_from_an_fp8_cache():
  """cache_dtype=float8_e4m3fn: the cache stores k / k_scale and v / v_scale in e4m3 and
  decoding matches attention over the whole sequence within FP8's precision."""
  x = normal(9, (2, 12, 16))
  layer = fm.MultiHeadAttention(num_heads=4, head_dim=8, num_kv_heads=2, is_causal=True,
                                page_size=4, cache_dtype=jnp.float8_e4m3fn, k_scale=0.02,
                                v_scale=0.05)
  params, full, _, out, cache = decode_in_steps(layer, x, prompt=5)
  assert cache["key_pages"].dtype == jnp.float8_e4m3fn
  assert fp8_rel_err(out, full) <= FP8_TOL
  # The first token's key, stored at logical page 0 of sequence 0, is k / k_scale.
  k = nn.DenseGeneral((2, 8)).apply({"params": params["key"]}, x[:1, :1])
  stored = np.asarray(cache["key_pages"][cache["page_table"][0, 0], 0], np.float32)
  np.testing.assert_allclose(stored * 0.02, np.asarray(k[0, 0]), rtol=0.07, atol=1e-3)
  with pytest.raises(ValueError, match="cache_dtype"):
    fm.MultiHeadAttention(num_heads=4, head_dim=8, cache_dtype=jnp.int8).init(
        jax.random.key(0), x, decode=True)


def test_kimi_delta_attention_state_continues_a_sequence():
  x = normal(2, (2, 16, 24))
  layer = fm.KimiDeltaAttention(num_heads=2, head_dim=8, num_v_heads=4)
  params = layer.init(jax.random.key(0), x)
  y, state = layer.apply(params, x)
  y1, s1 = layer.apply(params, x[:, :10])
  y2, s2 = layer.apply(params, x[:, 10:], s1)
  assert y.shape == x.shape and state.shape == (2, 4, 8, 8)
  np.testing.assert_allclose(jnp.concatenate([y1, y2], 1), y, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(s2, state, rtol=1e-4, atol=1e-4)


def test_moe_mlp_layer_matches_dense_experts():
  x = normal(3, (2, 7, 16))
  layer = fm.MoEMLP(num_experts=4, top_k=2, hidden_dim=8)
  params = layer.init(jax.random.key(0), x)
  got = layer.apply(params, x)
  p = params["params"]
  tokens = x.reshape(-1, 16)
  top, idx = jax.lax.top_k(tokens @ p["router"]["kernel"], 2)
  weights = jax.nn.softmax(top, -1)
  h = jnp.einsum("td,edc->tec", tokens, p["w_up"])
  gate, up = jnp.split(h, 2, -1)
  out = jnp.einsum("tef,efd->ted", jax.nn.silu(gate) * up, p["w_down"])  # every expert
  picked = jnp.take_along_axis(out, idx[:, :, None], axis=1)
  want = jnp.einsum("tkd,tk->td", picked, weights).reshape(x.shape)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layer", [
    fm.MultiHeadAttention(num_heads=2, head_dim=4, local_window_size=(3, 0)),
    fm.KimiDeltaAttention(num_heads=2, head_dim=4),
    fm.MoEMLP(num_experts=3, top_k=1, hidden_dim=4, glu=None, activation="gelu")],
    ids=["mha", "kda", "moe"])
def test_layers_train_under_jit(layer):
  x = normal(4, (2, 9, 8))
  params = layer.init(jax.random.key(0), x)

  def loss(params):
    y = layer.apply(params, x)
    return jnp.sum(jnp.sin(y[0] if isinstance(y, tuple) else y))

  grads = jax.jit(jax.grad(loss))(params)
  leaves = jax.tree.leaves(grads)
  assert leaves and all(np.all(np.isfinite(g)) for g in leaves)
  assert any(np.any(g != 0) for g in leaves)


def _load(module, params):
  """Copies a linen parameter tree into the nnx module of the same layer."""
  for name, value in params.items():
    attr = getattr(module, name)
    if isinstance(value, dict):
      _load(attr, value)
    else:
      attr[...] = value


@pytest.mark.parametrize("name", ["mha", "kda", "moe", "conv"])
def test_nnx_layers_equal_linen_layers(name):
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from cudnn_jax.flax_modules import nnx as fnnx  # pylint: disable=g-import-not-at-top
  x = normal(5, (2, 9, 16))
  rngs = nnx.Rngs(0)
  linen, nnx_layer = {
      "mha": (fm.MultiHeadAttention(4, 8, num_kv_heads=2, is_causal=True),
              fnnx.MultiHeadAttention(16, 4, 8, num_kv_heads=2, is_causal=True, rngs=rngs)),
      "kda": (fm.KimiDeltaAttention(2, 8, num_v_heads=4),
              fnnx.KimiDeltaAttention(16, 2, 8, num_v_heads=4, rngs=rngs)),
      "moe": (fm.MoEMLP(4, 2, 8), fnnx.MoEMLP(16, 4, 2, 8, rngs=rngs)),
      "conv": (fm.CausalConv3dBlock(12, norm="l2"),
               fnnx.CausalConv3dBlock(16, 12, norm="l2", rngs=rngs)),
  }[name]
  if name == "conv":
    x = normal(5, (1, 3, 4, 4, 16))
  params = linen.init(jax.random.key(1), x)
  _load(nnx_layer, params["params"])
  for got, want in zip(jax.tree.leaves(nnx_layer(x)), jax.tree.leaves(linen.apply(params, x))):
    np.testing.assert_allclose(got, want, **TOL)


def test_nnx_multi_head_attention_decodes_from_a_paged_cache():
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from cudnn_jax.flax_modules import nnx as fnnx  # pylint: disable=g-import-not-at-top
  x = normal(8, (2, 11, 16))
  layer = fnnx.MultiHeadAttention(16, 4, 8, num_kv_heads=2, is_causal=True, rngs=nnx.Rngs(0))
  full = layer(x)
  with pytest.raises(ValueError, match="init_cache"):
    layer(x[:, :1], decode=True)
  layer.init_cache(2, 11, page_size=4)
  outs = [layer(x[:, :4], decode=True)] + [layer(x[:, t:t + 1], decode=True)
                                           for t in range(4, 11)]
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, **TOL)


def test_nnx_multi_head_attention_decodes_from_an_fp8_cache():
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from cudnn_jax.flax_modules import nnx as fnnx  # pylint: disable=g-import-not-at-top
  x = normal(10, (2, 9, 16))
  layer = fnnx.MultiHeadAttention(16, 4, 8, num_kv_heads=2, is_causal=True,
                                  cache_dtype=jnp.float8_e4m3fn, k_scale=0.02, v_scale=0.05,
                                  rngs=nnx.Rngs(0))
  full = layer(x)
  layer.init_cache(2, 9, page_size=4)
  assert layer.cache.get_value()["value_pages"].dtype == jnp.float8_e4m3fn
  outs = [layer(x[:, :3], decode=True)] + [layer(x[:, t:t + 1], decode=True)
                                           for t in range(3, 9)]
  assert fp8_rel_err(jnp.concatenate(outs, 1), full) <= FP8_TOL


@pytest.mark.parametrize("features,norm", [(8, "rms"), (12, "group")])
def test_causal_conv3d_block_matches_its_definition(features, norm):
  x = normal(6, (2, 4, 5, 5, 8))
  layer = fm.CausalConv3dBlock(features, norm=norm)
  params = layer.init(jax.random.key(0), x)
  got = layer.apply(params, x)
  p = params["params"]

  def conv(x, w):  # causal in time, SAME in space, stride 1: plain lax, padded by hand
    kt, kh, kw = w.shape[:3]
    x = jnp.pad(x, ((0, 0), (kt - 1, 0), (kh // 2, kh // 2), (kw // 2, kw // 2), (0, 0)))
    return jax.lax.conv_general_dilated(x, w, (1, 1, 1), "VALID",
                                        dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
                                        precision=jax.lax.Precision.HIGHEST)

  h = conv(x, p["conv1"]) + p["bias1"]
  if norm == "rms":
    h = h / jnp.sqrt(jnp.mean(h ** 2, -1, keepdims=True) + 1e-6)
  else:
    g = h.reshape(h.shape[:-1] + (features, 1))  # min(32, 12) = 12 groups of 1 channel
    g = (g - g.mean((1, 2, 3, 5), keepdims=True)) / jnp.sqrt(
        g.var((1, 2, 3, 5), keepdims=True) + 1e-6)
    h = g.reshape(h.shape)
  h = jax.nn.silu(h * p["norm_scale"])
  skip = x if features == 8 else conv(x, p["skip"])
  want = conv(h, p["conv2"]) + p["bias2"] + skip
  assert got.shape == x.shape[:-1] + (features,)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
