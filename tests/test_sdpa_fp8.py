"""cudnn_jax.sdpa_fp8 on CPU: the xla engine against a float64 NumPy oracle (dequantized
inputs, e4m3-rounded probabilities), its gradients against bf16 sdpa's, the cudnn engine's
Python side (its primitives lowered to the handlers' contract in plain JAX) against the xla
engine, its CUDA lowering, and bad inputs."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cudnn_jax
from cudnn_jax import _extension
from cudnn_jax.ops import sdpa_fp8 as op
from cudnn_jax.primitives import sdpa_fp8 as prim
from mesh_cases import mesh_or_skip

B, T, S, N, K, H = 2, 16, 24, 4, 2, 32
SCALES = dict(q_scale=0.25, k_scale=0.5, v_scale=0.125, out_scale=0.01)
P_SCALE = 256.0  # the fixed scale of the probabilities, as SPEC's kernels use


def _inputs(seed=0, b=B, t=T, s=S, n=N, k=K, h=H, hv=H):
  r = np.random.default_rng(seed)
  fp8 = lambda shape: jnp.asarray(r.normal(size=shape) * 6, jnp.float8_e4m3fn)
  scales = {name: jnp.float32(v) for name, v in SCALES.items()}
  return fp8((b, t, n, h)), fp8((b, s, k, h)), fp8((b, s, k, hv)), scales


# ---------------------------------------------------------------------------------------
# The float64 oracle, written apart from the library.


def _e4m3(x):
  return np.asarray(x, np.float64).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn).astype(
      np.float64)


def oracle(q8, k8, v8, q_scale, k_scale, v_scale, *, scale=None, is_causal=False,
           bottom_right=False, window=None, q_lens=None, kv_lens=None, softcap=None,
           rounded=True):
  """float64 (out [B,T,N,Hv], amax)."""
  q, k, v = (np.asarray(x).astype(np.float64) * float(sc) for x, sc in
             ((q8, q_scale), (k8, k_scale), (v8, v_scale)))
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  k = np.repeat(k, n // kh, axis=2)
  v = np.repeat(v, n // kh, axis=2)
  scale = 1 / np.sqrt(h) if scale is None else scale
  logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
  if softcap:
    logits = softcap * np.tanh(logits / softcap)
  tl = np.full(b, t) if q_lens is None else np.asarray(q_lens)
  sl = np.full(b, s) if kv_lens is None else np.asarray(kv_lens)
  out = np.zeros((b, t, n, v.shape[-1]))
  for i in range(b):
    tt, uu = np.arange(t)[:, None], np.arange(s)[None, :]
    keep = (tt < tl[i]) & (uu < sl[i])
    diag = tt + (sl[i] - tl[i] if bottom_right else 0)
    if is_causal:
      keep &= uu <= diag
    if window is not None:
      keep &= (uu >= diag - window[0]) & (uu <= diag + window[1])
    x = np.where(keep, logits[i], -np.inf)
    m = np.max(x, axis=-1, keepdims=True)
    e = np.where(keep, np.exp(x - np.where(np.isfinite(m), m, 0)), 0.0)
    p = _e4m3(e * P_SCALE) / P_SCALE if rounded else e
    denom = e.sum(-1, keepdims=True)
    o = np.einsum("nts,snd->tnd", p, v[i]) / np.where(denom > 0, denom, 1).transpose(1, 0, 2)
    out[i] = np.where(denom.transpose(1, 0, 2) > 0, o, 0)
  return out, np.abs(out).max()


def _oracle_of(q, k, v, sc, **kw):
  return oracle(q, k, v, sc["q_scale"], sc["k_scale"], sc["v_scale"], **kw)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


CASES = {
    "plain": {},
    "causal": dict(is_causal=True),
    "causal_bottom_right_window": dict(is_causal=True, causal_alignment="bottom_right",
                                       local_window_size=(5, 0)),
    "window_lengths_softcap": dict(local_window_size=(6, 3), logits_soft_cap=20.0,
                                   query_seq_lengths=np.array([16, 7], np.int32),
                                   key_value_seq_lengths=np.array([10, 24], np.int32)),
}


def _oracle_kwargs(kwargs):
  window = kwargs.get("local_window_size")
  return dict(is_causal=kwargs.get("is_causal", False),
              bottom_right=kwargs.get("causal_alignment") == "bottom_right", window=window,
              q_lens=kwargs.get("query_seq_lengths"), kv_lens=kwargs.get("key_value_seq_lengths"),
              softcap=kwargs.get("logits_soft_cap"))


@pytest.mark.parametrize("name", CASES)
def test_xla_engine_matches_float64_oracle(name):
  """f32 out and amax equal the oracle with rounded probabilities, closer than to exact
  attention: the rounding is modeled, not merely tolerated."""
  kwargs = CASES[name]
  q, k, v, sc = _inputs(1)
  out, amax = jax.jit(functools.partial(cudnn_jax.sdpa_fp8, out_dtype=jnp.float32,
                                        implementation="xla", **kwargs))(q, k, v, **sc)
  want, want_amax = _oracle_of(q, k, v, sc, **_oracle_kwargs(kwargs))
  exact, _ = _oracle_of(q, k, v, sc, rounded=False, **_oracle_kwargs(kwargs))
  assert out.dtype == jnp.float32 and out.shape == (B, T, N, H)
  assert _rel(out, want) < 2e-3, _rel(out, want)
  assert _rel(out, exact) > 4 * _rel(out, want)
  assert amax.dtype == jnp.float32 and amax.shape == ()
  np.testing.assert_allclose(float(amax), want_amax, rtol=2e-3)


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn])
def test_out_dtypes_and_out_scale(out_dtype):
  q, k, v, sc = _inputs(2)
  out, amax = cudnn_jax.sdpa_fp8(q, k, v, **sc, out_dtype=out_dtype, is_causal=True)
  want, want_amax = _oracle_of(q, k, v, sc, is_causal=True)
  assert out.dtype == jnp.dtype(out_dtype)
  got = np.asarray(out.astype(jnp.float32), np.float64)
  if out_dtype == jnp.float8_e4m3fn:  # holds out / out_scale, rounded to e4m3
    got = got * SCALES["out_scale"]
    np.testing.assert_allclose(got, want, rtol=2 ** -4, atol=1e-3 * want_amax)
  else:
    assert _rel(got, want) < 1e-2
  np.testing.assert_allclose(float(amax), want_amax, rtol=2e-3)  # before out_scale


def test_fp8_out_saturates():
  q, k, v, sc = _inputs(3)
  out, amax = cudnn_jax.sdpa_fp8(q, k, v, **dict(sc, out_scale=jnp.float32(1e-4)),
                                 out_dtype=jnp.float8_e4m3fn)
  got = np.asarray(out.astype(jnp.float32))
  assert np.isfinite(got).all() and np.abs(got).max() == 448
  assert float(amax) > 448 * 1e-4


def test_gqa_unbatched_and_head_dims():
  q, k, v, sc = _inputs(4, n=6, k=2, hv=16)
  out, _ = cudnn_jax.sdpa_fp8(q[0], k[0], v[0], **sc, out_dtype=jnp.float32)
  want, _ = _oracle_of(q[:1], k[:1], v[:1], sc)
  assert out.shape == (T, 6, 16)
  assert _rel(out, want[0]) < 2e-3


def _dequantized(x, s):
  return (x.astype(jnp.float32) * s).astype(jnp.bfloat16)


@pytest.mark.parametrize("kwargs", [dict(is_causal=True), dict(local_window_size=4)])
def test_gradients_close_to_bf16_sdpa_of_dequantized_inputs(kwargs):
  q, k, v, sc = _inputs(5)
  ct = jax.random.normal(jax.random.key(0), (B, T, N, H))
  loss = lambda q, k, v: jnp.sum(cudnn_jax.sdpa_fp8(q, k, v, **sc, **kwargs)[0] * ct)
  got = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
  deq = [_dequantized(x, sc[n]) for x, n in ((q, "q_scale"), (k, "k_scale"), (v, "v_scale"))]
  ref_loss = lambda *a: jnp.sum(cudnn_jax.sdpa(*a, **kwargs, implementation="xla") * ct)
  want = jax.grad(ref_loss, (0, 1, 2))(*deq)
  for g, w, name in zip(got, want, ("q_scale", "k_scale", "v_scale")):
    assert g.dtype == jnp.bfloat16 and g.shape == w.shape
    assert np.isfinite(np.asarray(g, np.float32)).all()
    # d/d(fp8 x) = d/d(x * scale) * scale
    w = np.asarray(w, np.float32) * float(sc[name])
    err = np.linalg.norm(np.asarray(g, np.float32) - w) / np.linalg.norm(w)
    assert err < 6e-2, (name, err)


def test_scales_and_amax_carry_no_gradient():
  q, k, v, sc = _inputs(6)
  f = lambda qs: cudnn_jax.sdpa_fp8(q, k, v, **dict(sc, q_scale=qs))[1]
  assert float(jax.grad(f)(sc["q_scale"])) == 0.0


# ---------------------------------------------------------------------------------------
# The cudnn engine, its handlers emulated.


@pytest.fixture
def cudnn_engine(emulated, monkeypatch):
  """Forces the cudnn engine; ``path(p)`` picks its backward ("fp8", "bf16", None)."""
  emulated("sdpa_fp8", "cudnn")
  paths = []
  monkeypatch.setattr(op, "backward_path", lambda call: paths[-1] if paths else None)
  return paths.append


@pytest.mark.parametrize("name", ["causal", "window_lengths_softcap"])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_cudnn_engine_forward_matches_xla(cudnn_engine, name, out_dtype):
  kwargs = dict(CASES[name])
  kwargs.pop("logits_soft_cap", None)  # not served by the cudnn engine
  q, k, v, sc = _inputs(7)
  run = lambda impl: jax.jit(functools.partial(cudnn_jax.sdpa_fp8, out_dtype=out_dtype,
                                               implementation=impl, **kwargs))(q, k, v, **sc)
  (out, amax), (want, want_amax) = run("cudnn"), run("xla")
  assert out.dtype == want.dtype
  np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)),
                                np.asarray(want.astype(jnp.float32)))
  assert float(amax) == float(want_amax)


@pytest.mark.parametrize("path,tol", [(None, 1e-6), ("bf16", 3e-2), ("fp8", 0.15)])
def test_cudnn_engine_gradients(cudnn_engine, path, tol):
  """Each backward of the engine against the xla engine's: the xla VJP exactly, cuDNN's
  bf16 backward within bf16 rounding, cuDNN's FP8 backward within e5m2 rounding of dout."""
  cudnn_engine(path)
  q, k, v, sc = _inputs(8)
  lens = dict(query_seq_lengths=np.array([16, 9], np.int32),
              key_value_seq_lengths=np.array([20, 12], np.int32))
  ct = jax.random.normal(jax.random.key(1), (B, T, N, H))
  grads = lambda impl: jax.jit(jax.grad(lambda q, k, v: jnp.sum(cudnn_jax.sdpa_fp8(
      q, k, v, **sc, is_causal=True, implementation=impl, **lens)[0].astype(jnp.float32) * ct),
                                        (0, 1, 2)))(q, k, v)
  for g, w in zip(grads("cudnn"), grads("xla")):
    assert g.dtype == jnp.bfloat16
    err = np.linalg.norm(np.asarray(g, np.float32) - np.asarray(w, np.float32))
    assert err <= tol * np.linalg.norm(np.asarray(w, np.float32)) + 1e-6, (path, err)


def test_cudnn_engine_vmap_keeps_each_entrys_amax(cudnn_engine):
  q, k, v, sc = _inputs(9)
  qv = jnp.stack([q, (q.astype(jnp.float32) * 0.25).astype(q.dtype)])
  f = lambda impl: jax.jit(jax.vmap(lambda q: cudnn_jax.sdpa_fp8(
      q, k, v, **sc, implementation=impl)))(qv)
  (out, amax), (want, want_amax) = f("cudnn"), f("xla")
  assert amax.shape == (2,) and float(amax[0]) != float(amax[1])
  np.testing.assert_array_equal(np.asarray(amax), np.asarray(want_amax))
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))


def test_cudnn_engine_batch_and_head_sharded(cudnn_engine):
  """Sharded by batch and heads, each shard's amax joins the global max."""
  mesh = mesh_or_skip((2, 2), ("data", "model"))
  q, k, v, sc = _inputs(10)
  spec = NamedSharding(mesh, P("data", None, "model", None))
  args = [jax.device_put(x, spec) for x in (q, k, v)]
  out, amax = jax.jit(lambda q, k, v: cudnn_jax.sdpa_fp8(q, k, v, **sc))(*args)
  want, want_amax = cudnn_jax.sdpa_fp8(q, k, v, **sc, implementation="xla")
  assert float(amax) == float(want_amax)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))


def test_cuda_lowering_calls_the_handlers(cudnn_engine, monkeypatch):
  """Exported for CUDA (no GPU needed): the forward handler with the attributes and the six
  scale operands; under differentiation the FP8 backward handler, or the bf16 one."""

  class Sized:  # the extension's workspace queries, without a device
    sdpa_fp8_workspace = staticmethod(lambda config: 512)
    sdpa_workspace = staticmethod(lambda config: 256)

  monkeypatch.setattr(_extension, "module", lambda: Sized)
  targets = ["cudnn_jax_sdpa_fp8_fwd", "cudnn_jax_sdpa_fp8_bwd", "cudnn_jax_sdpa_bwd"]
  export = functools.partial(
      jax.export.export, platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(t) for t in targets])
  q, k, v, sc = _inputs(11)
  call = lambda q, k, v: cudnn_jax.sdpa_fp8(q, k, v, **sc, is_causal=True, scale=0.5,
                                            out_dtype=jnp.float8_e4m3fn)
  forward = export(jax.jit(call))(q, k, v).mlir_module()
  assert forward.count("cudnn_jax_sdpa_fp8_fwd") == 1 and "bwd" not in forward
  assert "causal = true" in forward and "window_left = -1 : i32" in forward
  assert "scale = 5.000000e-01 : f32" in forward
  fwd_line = next(l for l in forward.splitlines() if "cudnn_jax_sdpa_fp8_fwd" in l)
  assert fwd_line.count("tensor<f32>") == 6  # descale q/k/v/s, scale s/o
  assert "tensor<2x4xf32>" in fwd_line  # amax [B,N]
  loss = lambda q, k, v: jnp.sum(call(q, k, v)[0].astype(jnp.float32))
  for path, target in (("fp8", "cudnn_jax_sdpa_fp8_bwd"), ("bf16", "cudnn_jax_sdpa_bwd")):
    cudnn_engine(path)
    backward = export(jax.jit(jax.grad(loss, (0, 1, 2))))(q, k, v).mlir_module()
    assert backward.count(target) == 1, (path, backward.count(target))
    if path == "fp8":
      line = next(l for l in backward.splitlines() if target in l)
      assert line.count("tensor<f32>") == 12 and "f8E5M2" in line


def test_explain_and_declines_off_gpu():
  q, k, v, sc = _inputs(12)
  text = cudnn_jax.explain("sdpa_fp8", q, k, v, **sc)
  assert "'xla' serves" in text and "cudnn: declines: default backend" in text
  with pytest.raises(cudnn_jax.UnsupportedError, match="cudnn"):
    cudnn_jax.sdpa_fp8(q, k, v, **sc, implementation="cudnn")


def test_cudnn_engine_declines_soft_cap(monkeypatch):
  monkeypatch.setattr(_extension, "unavailable_reason", lambda: None)
  call = op.Fp8Call(b=1, t=8, s=8, n=1, k=1, h=64, hv=64, out_dtype="bfloat16", scale=1.0,
                    logits_soft_cap=5.0)
  assert "logits_soft_cap" in op._supports_cudnn(call)


# ---------------------------------------------------------------------------------------
# Bad inputs.


@pytest.mark.parametrize("change,error,match", [
    (dict(query=jnp.zeros((B, T, N, H), jnp.bfloat16)), TypeError, "query: expected dtype"),
    (dict(value=jnp.zeros((B, S, K, H), jnp.float8_e5m2)), TypeError, "value: expected dtype"),
    (dict(q_scale=jnp.bfloat16(1)), TypeError, "q_scale: expected dtype"),
    (dict(k_scale=jnp.ones((2,), jnp.float32)), ValueError, "k_scale: expected a float32 scalar"),
    (dict(out_dtype=jnp.int8), TypeError, "out_dtype"),
    (dict(key=jnp.zeros((B, S, 3, H), jnp.float8_e4m3fn)), ValueError, "key"),
    (dict(bias=jnp.zeros((B, N, T, S))), ValueError, "bias: not supported by sdpa_fp8"),
    (dict(sinks=jnp.zeros((N,))), ValueError, "sinks: not supported"),
    (dict(dropout_rate=0.1), ValueError, "dropout_rate: not supported"),
    (dict(return_lse=True), ValueError, "return_lse: not supported"),
    (dict(q_segment_ids=jnp.zeros((B, T), jnp.int32)), ValueError, "q_segment_ids"),
    (dict(context_parallel_axis="x"), ValueError, "context_parallel_axis"),
    (dict(is_causal=1), TypeError, "is_causal"),
    (dict(causal_alignment="left"), ValueError, "causal_alignment"),
    (dict(query_seq_lengths=jnp.zeros((3,), jnp.int32)), ValueError, "query_seq_lengths"),
    (dict(windowsize=3), TypeError, "windowsize"),
])
def test_bad_inputs_are_named(change, error, match):
  q, k, v, sc = _inputs(13)
  args = dict(query=q, key=k, value=v, **sc)
  args.update(change)
  with pytest.raises(error, match=match):
    cudnn_jax.sdpa_fp8(**args)


def test_sdpa_defaults_of_unsupported_arguments_are_accepted():
  q, k, v, sc = _inputs(14)
  cudnn_jax.sdpa_fp8(q, k, v, **sc, bias=None, dropout_rate=0.0, return_lse=False)


# ---------------------------------------------------------------------------------------
# The extension agrees with the Python config.

_built = _extension.module() is not None and hasattr(_extension.module(), "sdpa_fp8_check")


@pytest.mark.skipif(not _built, reason="the extension (with sdpa_fp8) was not built")
@pytest.mark.parametrize("target", ["cudnn_jax_sdpa_fp8_fwd", "cudnn_jax_sdpa_fp8_bwd"])
def test_handler_attributes_are_the_config_fields(target):
  assert _extension.handler_attributes()[target] == prim.Fp8Config.attribute_names()


@pytest.mark.skipif(not _built, reason="the extension (with sdpa_fp8) was not built")
def test_check_names_a_missing_or_unknown_config_entry():
  config = prim.Fp8Config(scale=1.0).check_config(backward=False, b=1, t=8, s=8, n=1, k=1,
                                                  h=64, hv=64)
  for name in prim.Fp8Config.attribute_names():
    with pytest.raises(ValueError, match=f"'{name}'"):
      _extension.module().sdpa_fp8_check({k: v for k, v in config.items() if k != name})
  with pytest.raises(ValueError, match="out_dtype"):
    _extension.module().sdpa_fp8_check(dict(config, out_dtype="int8"))
  assert _extension.module().sdpa_fp8_check(config)  # no GPU here: a reason, not a crash


def test_config_fields_are_typed_for_the_handlers():
  attrs = prim.Fp8Config(scale=0.5, window_left=3).attributes()
  assert list(attrs) == list(prim.Fp8Config.attribute_names())
  assert attrs["scale"].dtype == np.float32 and attrs["window_left"].dtype == np.int32
  assert attrs["causal"].dtype == np.bool_ and "out_dtype" not in attrs
  assert dataclasses.replace(prim.Fp8Config(scale=1.0), out_dtype="bfloat16").fp8_out is False
