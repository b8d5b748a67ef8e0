"""cudnn_jax.sdpa as a drop-in for jax.nn.dot_product_attention, and our attention_fn as a
drop-in for flax's (linen and nnx), checked the way their own attention tests check them:
the same calls through both, outputs and gradients compared.

Cases are what users rely on: GQA, vmap, every mask jax.nn has (bias, causal, padding,
custom, windows and their combinations), the residual, float64 under x64 with
``jax.debug_infs``, scalar scales, and the flax layers (masks, causal, dtypes, decoding
with a cache). Not covered on purpose: sowing attention weights (never formed) and complex
inputs. One documented difference: a query row with no kept key outputs 0 here.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import cudnn_jax
from cudnn_jax import flax_modules
from cudnn_jax.flax_modules import nnx as flax_nnx
from cudnn_jax.ops import sdpa as sdpa_ops

B, T, S, N, H = 2, 16, 16, 4, 8


def _qkv(dtype, groups=1, t=T, s=S, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (B, t, N, H), dtype)
  k = jax.random.normal(ks[1], (B, s, N // groups, H), dtype)
  v = jax.random.normal(ks[2], (B, s, N // groups, H), dtype)
  dout = jax.random.normal(ks[3], (B, t, N, H), dtype)
  return q, k, v, dout


def _close(a, b, tol):
  np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                             rtol=tol, atol=tol)


@pytest.fixture(params=["whole", "blockwise"])
def engine_path(request, monkeypatch):
  """The xla engine's two implementations: all logits at once, or block by block."""
  if request.param == "blockwise":
    monkeypatch.setattr(sdpa_ops, "BLOCKWISE_ABOVE", 0)
    monkeypatch.setattr("cudnn_jax.xla.sdpa.BLOCK_Q", 16)
    monkeypatch.setattr("cudnn_jax.xla.sdpa.BLOCK_K", 8)
  return request.param


@pytest.mark.parametrize("dtype,tol,groups,use_vmap", [
    # (float16 too, but jax.nn's float16 under jit has no CPU lowering to compare with.)
    (jnp.bfloat16, 2e-2, 2, True), (jnp.bfloat16, 2e-2, 1, False),
    (jnp.float32, 2e-5, 2, False), (jnp.float32, 2e-5, 1, True)])
def test_matches_jax_nn_with_gradients(dtype, tol, groups, use_vmap):
  """Outputs and the gradients of query, key and value (GQA summed over the group)."""
  q, k, v, dout = _qkv(dtype, groups)

  @functools.partial(jax.jit, static_argnums=0)
  def run(fn):
    if use_vmap:  # over the batch, each call unbatched [T, N, H]
      fn = jax.vmap(fn, in_axes=(0, 0, 0))
    out, pull = jax.vjp(fn, q, k, v)
    return (out,) + pull(dout)

  for got, want in zip(run(cudnn_jax.sdpa), run(jax.nn.dot_product_attention)):
    assert got.dtype == want.dtype and got.shape == want.shape
    _close(got, want, 2 * tol)


_MASK_MODES = ["bias", "causal", "padding", "custom", ("causal", "padding"),
               ("custom", "padding"), ("bias", "causal"), ("causal", "window"), "window"]


@pytest.mark.parametrize("mode", _MASK_MODES, ids=lambda m: "+".join(np.atleast_1d(m)))
def test_masks_match_jax_nn(mode):
  """Each of jax.nn's masks, forward, residual and every gradient (bias included)."""
  _check_masks(mode)


@pytest.mark.parametrize("mode", [("causal", "padding"), ("bias", "causal"), "window"],
                         ids=lambda m: "+".join(np.atleast_1d(m)))
def test_masks_match_jax_nn_blockwise(mode, engine_path):
  """The same on the block-by-block implementation of the xla engine."""
  if engine_path == "whole":
    pytest.skip("test_masks_match_jax_nn")
  _check_masks(mode)


def _check_masks(mode):
  mode = (mode,) if isinstance(mode, str) else mode
  q, k, v, dout = _qkv(jnp.float32)
  bias = mask = q_len = kv_len = window = None
  if "bias" in mode:
    bias = jax.random.normal(jax.random.key(7), (1, N, T, S), jnp.float32)
  if "custom" in mode:
    mask = jnp.tril(jnp.ones((T, S), jnp.bool_))[None, None]
  if "padding" in mode:
    q_len = jnp.array([T // 2, T // 4], jnp.int32)
    kv_len = jnp.array([S // 4, S // 2], jnp.int32)
  if "window" in mode:
    window = (3, 2) if "causal" not in mode else (3, 0)
  kwargs = dict(is_causal="causal" in mode, local_window_size=window)

  def run(fn, q, k, v, bias):
    return fn(q, k, v, bias, mask, query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
              return_residual=True, **kwargs)

  @functools.partial(jax.jit, static_argnums=0)
  def grads(fn):
    (out, res), pull = jax.vjp(functools.partial(run, fn), q, k, v, bias)
    return out, res, pull((dout, jnp.zeros_like(res)))

  out, res, grads_ours = grads(cudnn_jax.sdpa)
  ref, res_ref, grads_ref = grads(jax.nn.dot_product_attention)
  _close(out, ref, 2e-5)
  # The residual of a padded query row: -inf here (no kept key), a large negative there.
  rows = (np.arange(T)[None, :, None] < (T if q_len is None else np.asarray(q_len)[:, None, None]))
  assert res.shape == res_ref.shape == (B, T, N) and res.dtype == res_ref.dtype
  _close(np.where(rows, res, 0), np.where(rows, res_ref, 0), 2e-5)
  assert np.all(np.isneginf(np.asarray(res)[~np.broadcast_to(rows, res.shape)]))
  for got, want in zip(grads_ours, grads_ref):
    if want is not None:
      _close(got, want, 1e-4)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("use_vmap", [False, True])
def test_bias_gradient_matches_jax_nn(batch, use_vmap):
  """Self-attention with a full [B, N, S, S] bias and an all-True mask, as jax.nn's bias
  gradient test builds it."""
  x = jax.random.normal(jax.random.key(0), (batch, S, N, H), jnp.float32)
  bias = jax.random.normal(jax.random.key(1), (batch, N, S, S), jnp.float32)
  mask = jnp.ones((1, 1, S), jnp.bool_)

  def attend(fn, x, bias):
    return fn(x, x, x, bias, mask)

  def grads(fn):
    f = functools.partial(attend, fn)
    if use_vmap:
      f = jax.vmap(f)
    out, pull = jax.vjp(f, x, bias)
    return (out,) + pull(x)

  for got, want in zip(jax.jit(lambda: grads(cudnn_jax.sdpa))(),
                       jax.jit(lambda: grads(jax.nn.dot_product_attention))()):
    _close(got, want, 1e-4)


def test_residual_is_jax_nns_and_has_no_gradient():
  q, k, v, _ = _qkv(jnp.bfloat16, groups=2)
  out, res = cudnn_jax.sdpa(q, k, v, is_causal=True, return_residual=True)
  ref, res_ref = jax.nn.dot_product_attention(q, k, v, is_causal=True, return_residual=True)
  assert res.dtype == jnp.bfloat16 and res.shape == (B, T, N)
  _close(out, ref, 2e-2)
  _close(res, res_ref, 2e-2)
  out, res, lse = cudnn_jax.sdpa(q, k, v, return_residual=True, return_lse=True)
  assert lse.shape == (B, N, T) and lse.dtype == jnp.float32
  _close(res, jnp.swapaxes(lse, 1, 2), 2e-2)
  grad = jax.grad(lambda q: cudnn_jax.sdpa(q, k, v, return_residual=True)[1]
                  .astype(jnp.float32).sum())(q)
  assert not np.any(np.asarray(grad, np.float32))
  # Unbatched: [T, N] as in jax.nn.
  _, res = cudnn_jax.sdpa(q[0], k[0], v[0], return_residual=True)
  _, res_ref = jax.nn.dot_product_attention(q[0], k[0], v[0], return_residual=True)
  assert res.shape == res_ref.shape == (T, N)


@pytest.mark.parametrize("jit", [False, True])
def test_float64_masked_call_raises_no_inf(jit, engine_path):
  """Float64 under x64 with a mask, GQA and unbatched inputs, under ``jax.debug_infs``: no
  FloatingPointError, and jax.nn's result."""
  del engine_path
  t, s, k_heads, n, h = 5, 7, 3, 6, 11
  mask = np.arange(s) <= s // 2
  with jax.enable_x64(True), jax.debug_infs(True):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape) for shape in ((t, n, h), (s, k_heads, h),
                                                          (s, k_heads, h)))
    fn = cudnn_jax.sdpa
    if jit:
      fn = lambda *a, **kw: jax.jit(functools.partial(cudnn_jax.sdpa, **kw))(*a)
    out = fn(q, k, v, mask=mask)
    assert out.dtype == jnp.float64
    ref = jax.nn.dot_product_attention(q, k, v, mask=mask)
    _close(out, ref, 1e-6)
    for kwargs in (dict(is_causal=True), dict(is_causal=True, local_window_size=(1, 1))):
      _close(fn(q, k, v, **kwargs), jax.nn.dot_product_attention(q, k, v, **kwargs), 1e-6)
    grads = jax.grad(lambda q: fn(q, k, v, is_causal=True).sum())(q)
    assert grads.dtype == jnp.float64 and np.all(np.isfinite(grads))


def test_debug_infs_quiet_with_lengths_unless_lse_is_asked_for():
  """Padded query rows have no kept key: their lse is -inf by definition, so that inf
  exists only when the caller asks for the lse."""
  q, k, v, _ = _qkv(jnp.float32)
  q_len = jnp.array([T // 2, T], jnp.int32)
  with jax.debug_infs(True):
    out = cudnn_jax.sdpa(q, k, v, query_seq_lengths=q_len, is_causal=True)
    with pytest.raises(FloatingPointError):
      cudnn_jax.sdpa(q, k, v, query_seq_lengths=q_len, return_lse=True)
  _close(out, jax.nn.dot_product_attention(q, k, v, query_seq_lengths=q_len, is_causal=True),
         2e-5)


def test_any_real_scalar_scale():
  q, k, v, _ = _qkv(jnp.float32, t=8, s=8)
  ref = jax.nn.dot_product_attention(q, k, v, scale=0.25)
  for scale in (0.25, np.float32(0.25), np.float64(0.25), jnp.float32(0.25),
                jnp.bfloat16(0.25), np.array(0.25), jnp.array(0.25)):
    _close(cudnn_jax.sdpa(q, k, v, scale=scale), ref, 2e-5)
  _close(cudnn_jax.sdpa(q, k, v, scale=1), jax.nn.dot_product_attention(q, k, v, scale=1.0),
         2e-5)


def test_traced_scale_is_refused_with_a_reason():
  q, k, v, _ = _qkv(jnp.float32, t=8, s=8)
  with pytest.raises(TypeError, match="scale: .*traced"):
    jax.jit(lambda q, c: cudnn_jax.sdpa(q, k, v, scale=c))(q, 0.5)


def test_fully_masked_row_outputs_zero():
  """The documented difference: jax.nn's xla path gives such a row the mean of the values."""
  q, k, v, _ = _qkv(jnp.float32, t=4, s=4)
  mask = jnp.ones((T, S), jnp.bool_)[:4, :4].at[1].set(False)[None, None]
  out = cudnn_jax.sdpa(q, k, v, mask=mask)
  ref = jax.nn.dot_product_attention(q, k, v, mask=mask)
  assert not np.any(np.asarray(out[:, 1]))
  _close(ref[:, 1], jnp.broadcast_to(v.mean(axis=1), ref[:, 1].shape), 1e-5)
  _close(jnp.delete(out, 1, axis=1), jnp.delete(ref, 1, axis=1), 2e-5)


# ---------------------------------------------------------------------------------------
# flax.linen: ours as MultiHeadDotProductAttention's attention_fn, against flax's default.


def _linen(dtype=None, **kw):
  make = functools.partial(nn.MultiHeadDotProductAttention, num_heads=4, qkv_features=16,
                           dtype=dtype, **kw)
  return make(attention_fn=flax_modules.dot_product_attention), make()


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 5e-2)])
@pytest.mark.parametrize("masked", [False, True])
def test_linen_layer_matches_flax(dtype, tol, masked):
  x = jax.random.normal(jax.random.key(0), (2, 3, 6, 16))  # two batch dims
  ours, theirs = _linen(dtype, force_fp32_for_softmax=True)
  params = theirs.init(jax.random.key(1), x)
  mask = nn.make_causal_mask(jnp.ones(x.shape[:-1])) if masked else None
  got, pull = jax.vjp(lambda p: ours.apply(p, x, mask=mask), params)
  want, pull_ref = jax.vjp(lambda p: theirs.apply(p, x, mask=mask), params)
  _close(got, want, tol)
  jax.tree.map(lambda a, b: _close(a, b, 10 * tol), pull(jnp.ones_like(got)),
               pull_ref(jnp.ones_like(want)))


def test_linen_float64_and_decode_match_flax():
  """Float64 under x64, then autoregressive decoding with flax's own cache (its mask keeps
  the filled cache slots)."""
  with jax.enable_x64(True):
    x = jax.random.normal(jax.random.key(0), (2, 4, 8), jnp.float64)
    ours, theirs = _linen(jnp.float64, decode=True)
    variables = theirs.init(jax.random.key(1), x)
    params, cache = variables["params"], variables["cache"]
    cache_ours = cache
    for t in range(x.shape[1]):
      step = x[:, t:t + 1]
      y, upd = ours.apply({"params": params, "cache": cache_ours}, step, mutable=["cache"])
      y_ref, upd_ref = theirs.apply({"params": params, "cache": cache}, step,
                                    mutable=["cache"])
      assert y.dtype == jnp.float64
      _close(y, y_ref, 1e-6)
      cache_ours, cache = upd["cache"], upd_ref["cache"]


@pytest.mark.parametrize("arg", ["einsum_dot_general", "qk_attn_weights_einsum", "module"])
def test_linen_refuses_what_it_cannot_honour(arg):
  q, k, v, _ = _qkv(jnp.float32, t=4, s=4)
  with pytest.raises(cudnn_jax.UnsupportedError, match=arg):
    flax_modules.dot_product_attention(q, k, v, **{arg: object()})
  with pytest.raises(cudnn_jax.UnsupportedError, match="module"):  # sow_weights passes module
    ours, _ = _linen()
    x = jnp.ones((1, 4, 16))
    ours.apply(ours.init(jax.random.key(0), x), x, sow_weights=True)


def test_linen_force_fp32_for_softmax_is_passed_and_accepted():
  """Linen filters attention_fn's keyword arguments by its signature: ours names every
  argument linen passes, so none is silently dropped."""
  import inspect  # pylint: disable=g-import-not-at-top
  ours = set(inspect.signature(flax_modules.dot_product_attention).parameters)
  theirs = set(inspect.signature(nn.dot_product_attention).parameters)
  assert theirs <= ours
  ours = set(inspect.signature(flax_nnx.dot_product_attention).parameters)
  theirs = set(inspect.signature(nnx.dot_product_attention).parameters)
  assert theirs <= ours


# ---------------------------------------------------------------------------------------
# flax.nnx: ours as MultiHeadAttention's attention_fn, against nnx's default.


def _nnx(dtype=None, **kw):
  make = lambda **a: nnx.MultiHeadAttention(num_heads=4, in_features=16, qkv_features=16,
                                            dtype=dtype, param_dtype=dtype or jnp.float32,
                                            rngs=nnx.Rngs(0), **kw, **a)
  return make(attention_fn=flax_nnx.dot_product_attention), make()


@pytest.mark.parametrize("dtype,tol", [(None, 1e-5), (jnp.bfloat16, 5e-2)])
@pytest.mark.parametrize("how", ["plain", "mask", "is_causal"])
def test_nnx_layer_matches_flax(dtype, tol, how):
  x = jax.random.normal(jax.random.key(0), (2, 6, 16))
  ours, theirs = _nnx(dtype, decode=False)
  kwargs = dict(mask=nnx.make_causal_mask(jnp.ones(x.shape[:-1]))) if how == "mask" else (
      dict(is_causal=True) if how == "is_causal" else {})
  _close(ours(x, **kwargs), theirs(x, **kwargs), tol)
  grad = lambda m: nnx.grad(lambda m: m(x, **kwargs).astype(jnp.float32).sum())(m)
  jax.tree.map(lambda a, b: _close(a, b, 10 * tol), nnx.state(grad(ours)),
               nnx.state(grad(theirs)))


def test_nnx_float64_decode_matches_flax():
  with jax.enable_x64(True):
    x = jax.random.normal(jax.random.key(0), (2, 4, 16), jnp.float64)
    ours, theirs = _nnx(jnp.float64, decode=True)
    for m in (ours, theirs):
      m.init_cache(x.shape, dtype=jnp.float64)
    for t in range(x.shape[1]):
      y, y_ref = ours(x[:, t:t + 1]), theirs(x[:, t:t + 1])
      assert y.dtype == jnp.float64
      _close(y, y_ref, 1e-6)


def test_nnx_refuses_sowing_weights():
  ours, _ = _nnx(decode=False)
  with pytest.raises(cudnn_jax.UnsupportedError, match="module"):
    ours(jnp.ones((1, 4, 16)), sow_weights=True)
