"""cudnn_jax.sdpa on the "xla" engine (CPU) against the float64 oracle of SPEC section 1."""

import functools


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cudnn_jax
from sdpa_oracle import (Config, cotangent, differentiable, jit_call, keep_of, make_case,
                         oracle, oracle_vjp, split_kwargs)

TOL = {
    "float32": dict(rtol=2e-5, atol=2e-5),
    "bfloat16": dict(rtol=2e-2, atol=2e-2),
    "float16": dict(rtol=4e-3, atol=4e-3),
}
GRAD_TOL = {
    "float32": dict(rtol=1e-4, atol=1e-4),
    "bfloat16": dict(rtol=5e-2, atol=5e-2),
}


def sdpa_xla(*args, **kwargs):
  return cudnn_jax.sdpa(*args, implementation="xla", **kwargs)


def assert_close(actual, expected, dtype, tol=TOL, what=""):
  actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
  np.testing.assert_allclose(actual, expected, err_msg=what, **tol[jnp.dtype(dtype).name])


def check_forward(cfg, seed=0):
  args, kwargs = make_case(cfg, seed)
  out, lse = jit_call(functools.partial(sdpa_xla, return_lse=True), args, kwargs)
  ref_out, ref_lse = oracle(*args, **kwargs)
  assert out.dtype == args[0].dtype and out.shape == ref_out.shape
  assert lse.dtype == jnp.float32 and lse.shape == ref_lse.shape
  assert_close(out, ref_out, cfg.dtype, what="out")
  assert_close(lse, ref_lse, "float32" if cfg.dtype == "float32" else cfg.dtype, what="lse")
  return args, kwargs, out, lse


# (name, Config) pairs, each exercising one feature; float32 unless stated.
FORWARD_CASES = [
    ("mha", Config(n=4, k=4)),
    ("gqa", Config(n=4, k=2)),
    ("mqa", Config(n=4, k=1)),
    ("hv_ne_h", Config(h=32, hv=16, k=1)),
    ("t_ne_s", Config(t=5, s=11)),
    ("unbatched", Config(b=1, unbatched=True, bias="nts", is_causal=True)),
    ("unbatched_lengths", Config(b=1, unbatched=True, q_lengths=True, kv_lengths=True)),
    ("scale", Config(scale=0.37)),
    *[(f"bias_{f}", Config(t=6, s=10, bias=f)) for f in
      ("bnts", "1nts", "b1ts", "11ts", "nts", "ts", "111s", "b11s", "s")],
    *[(f"mask_{f}", Config(t=6, s=10, mask=f)) for f in ("bnts", "b1ts", "ts", "111s")],
    ("bias_and_mask", Config(bias="1nts", mask="b1ts")),
    *[(f"causal_{a}_{t}x{s}", Config(t=t, s=s, is_causal=True, causal_alignment=a))
      for a in ("top_left", "bottom_right") for t, s in ((8, 8), (5, 12), (12, 5))],
    ("causal_bottom_right_lengths", Config(t=9, s=12, is_causal=True, q_lengths=True,
                                           kv_lengths=True, causal_alignment="bottom_right")),
    ("window_int", Config(t=12, s=12, window=2)),
    ("window_left_only", Config(t=12, s=12, window=(3, None))),
    ("window_right_only", Config(t=12, s=12, window=(None, 1))),
    ("window_causal", Config(t=12, s=12, window=(3, 0), is_causal=True)),
    ("window_bottom_right", Config(t=6, s=12, window=(2, 1), causal_alignment="bottom_right",
                                   kv_lengths=True)),
    ("lengths", Config(q_lengths=True, kv_lengths=True, b=3)),
    ("lengths_zero", Config(q_lengths=True, kv_lengths=True, zero_length=True, b=3)),
    ("kv_lengths_zero", Config(kv_lengths=True, zero_length=True, b=3)),
    ("segments", Config(segments=True)),
    ("segments_causal", Config(segments=True, is_causal=True, window=(4, None))),
    ("softcap", Config(softcap=2.0, bias="bnts")),
    ("sinks", Config(sinks=True)),
    ("sinks_empty_rows", Config(sinks=True, kv_lengths=True, q_lengths=True, zero_length=True,
                                is_causal=True, causal_alignment="bottom_right", t=10, s=4)),
    ("everything", Config(t=9, s=13, n=4, k=2, bias="b1ts", mask="11ts", is_causal=True,
                          causal_alignment="bottom_right", window=(5, None), q_lengths=True,
                          kv_lengths=True, segments=True, softcap=3.0, sinks=True)),
    ("bf16_gqa_causal", Config(dtype="bfloat16", is_causal=True, t=24, s=24)),
    ("bf16_everything", Config(dtype="bfloat16", bias="1nts", mask="b1ts", window=4,
                               kv_lengths=True, softcap=5.0, sinks=True)),
    ("f16_lengths", Config(dtype="float16", q_lengths=True, kv_lengths=True, zero_length=True)),
]


@pytest.mark.parametrize("cfg", [c for _, c in FORWARD_CASES],
                         ids=[name for name, _ in FORWARD_CASES])
def test_forward_matches_oracle(cfg):
  check_forward(cfg)


def test_empty_rows_are_zero_with_lse_minus_inf():
  cfg = Config(b=3, t=10, s=4, q_lengths=True, kv_lengths=True, zero_length=True,
               is_causal=True, causal_alignment="bottom_right", mask="bnts")
  args, kwargs, out, lse = check_forward(cfg)
  keep, valid = keep_of(*args, **kwargs)
  empty = ~keep.any(-1)  # [B,N,T]
  assert empty.any() and (~valid).any()
  assert np.all(np.asarray(lse)[empty] == -np.inf)
  assert np.all(np.asarray(out).transpose(0, 2, 1, 3)[empty] == 0)


def test_unbatched_takes_rank4_bias_and_mask_like_jax_nn():
  (q, k, v, bias), _ = make_case(Config(b=1, unbatched=True, t=5, s=7, bias="nts"))
  bias4 = bias[None]
  mask4 = jnp.asarray(np.random.default_rng(0).random((1, 1, 5, 7)) < 0.8)
  out = sdpa_xla(q, k, v, bias4, mask4)
  assert out.shape == q.shape
  assert_close(out, oracle(q, k, v, bias4, mask4)[0], "float32")
  np.testing.assert_allclose(out, sdpa_xla(q, k, v, bias, mask4[0]), rtol=1e-6, atol=1e-6)
  grads = jax.grad(lambda b: jnp.sum(jnp.sin(sdpa_xla(q, k, v, b, mask4))))(bias4)
  assert grads.shape == bias4.shape


def test_return_lse_false_returns_only_out():
  args, kwargs = make_case(Config())
  out = sdpa_xla(*args, **kwargs)
  out2, _ = sdpa_xla(*args, return_lse=True, **kwargs)
  np.testing.assert_array_equal(out, out2)


# ---------------------------------------------------------------------------------------
# Gradients.

GRAD_CASES = [
    ("gqa", Config(n=4, k=2)),
    ("hv_ne_h", Config(h=32, hv=16)),
    *[(f"bias_{f}", Config(t=6, s=10, bias=f)) for f in ("bnts", "1nts", "b1ts", "ts", "111s")],
    ("causal_bottom_right_zero_lengths", Config(
        b=3, t=10, s=6, is_causal=True, causal_alignment="bottom_right", q_lengths=True,
        kv_lengths=True, zero_length=True)),
    ("mask_window_softcap", Config(mask="bnts", window=(3, 1), softcap=2.5, bias="bnts")),
    ("segments", Config(segments=True, is_causal=True)),
    ("sinks", Config(sinks=True, kv_lengths=True, zero_length=True, b=3)),
    ("unbatched", Config(b=1, unbatched=True, bias="ts", mask="nts")),
    ("bf16", Config(dtype="bfloat16", bias="1nts", is_causal=True)),
]


def check_grads(cfg, *, with_lse, seed=0):
  args, kwargs = make_case(cfg, seed)
  diff, arrays, call = differentiable(args, kwargs)
  fn = lambda d, arrays: call(d, arrays, implementation="xla", return_lse=True)
  out, lse = jax.eval_shape(fn, diff, arrays)
  d_out = cotangent(out.shape, out.dtype, seed)
  d_lse = cotangent(lse.shape, jnp.float32, seed + 1) if with_lse else jnp.zeros_like(lse)
  vjp = lambda d, a, do, dl: jax.vjp(functools.partial(fn, arrays=a), d)[1]((do, dl))[0]
  grads = jax.jit(vjp)(diff, arrays, d_out, d_lse)
  expected = oracle_vjp(*args, d_out=d_out, d_lse=d_lse if with_lse else None, **kwargs)
  assert set(grads) == set(expected)
  for name, g in grads.items():
    assert g.shape == diff[name].shape and g.dtype == diff[name].dtype, name
    assert_close(g, expected[name], cfg.dtype, tol=GRAD_TOL, what=f"d{name}")
  return args, kwargs, grads


@pytest.mark.parametrize("cfg", [c for _, c in GRAD_CASES], ids=[n for n, _ in GRAD_CASES])
def test_grads_match_oracle(cfg):
  check_grads(cfg, with_lse=cfg.dtype == "float32")


def test_grads_of_fully_masked_rows_and_unused_keys_are_zero():
  cfg = Config(b=3, t=10, s=6, n=4, k=2, is_causal=True, causal_alignment="bottom_right",
               q_lengths=True, kv_lengths=True, zero_length=True, bias="bnts")
  args, kwargs, grads = check_grads(cfg, with_lse=True)
  keep, _ = keep_of(*args, **kwargs)
  empty_rows = ~keep.any(-1).transpose(0, 2, 1)  # [B,T,N]
  b, n, t, s = keep.shape
  by_kv_head = keep.reshape(b, cfg.k, n // cfg.k, t, s)
  unused_keys = ~by_kv_head.any((2, 3)).transpose(0, 2, 1)  # [B,S,K]
  assert empty_rows.any() and unused_keys.any()
  assert np.all(np.asarray(grads["query"])[empty_rows] == 0)
  assert np.all(np.asarray(grads["key"])[unused_keys] == 0)
  assert np.all(np.asarray(grads["value"])[unused_keys] == 0)
  assert np.all(np.asarray(grads["bias"])[~keep] == 0)


def test_grad_under_jit_matches_eager_grad():
  (q, k, v, bias), _ = make_case(Config(is_causal=True, bias="b1ts"))
  loss = lambda *a: jnp.sum(jnp.sin(sdpa_xla(*a, is_causal=True)))
  grad = jax.grad(loss, argnums=(0, 1, 2, 3))
  for a, b in zip(grad(q, k, v, bias), jax.jit(grad)(q, k, v, bias)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------
# jax.nn.dot_product_attention's argument subset: the same results.

JAX_NN_CASES = [
    ("plain", Config()),
    ("gqa_scale", Config(n=4, k=1, scale=0.3)),
    ("bias_mask", Config(bias="b1ts", mask="1nts")),
    ("causal_t_ne_s", Config(t=6, s=10, is_causal=True)),
    ("lengths", Config(q_lengths=True, kv_lengths=True, b=3)),
    ("window", Config(t=12, s=12, window=(3, 1))),
    ("window_int_causal", Config(t=12, s=12, window=2, is_causal=True)),
    ("unbatched", Config(b=1, unbatched=True)),
    ("bf16", Config(dtype="bfloat16", is_causal=True, bias="bnts")),
]


@pytest.mark.parametrize("cfg", [c for _, c in JAX_NN_CASES], ids=[n for n, _ in JAX_NN_CASES])
def test_matches_jax_nn(cfg):
  args, kwargs = make_case(cfg)
  ours = jit_call(sdpa_xla, args, kwargs)
  with jax.default_matmul_precision("highest"):  # jax.nn's float32 default may be TF32
    theirs = jit_call(functools.partial(jax.nn.dot_product_attention, implementation="xla"),
                      args, kwargs)
  keep, valid = keep_of(*args, **kwargs)
  rows = (keep.any(-1) & valid).transpose(0, 2, 1)  # [B,T,N]: rows jax.nn also defines
  if cfg.unbatched:
    rows = rows[0]
  tol = dict(rtol=1e-5, atol=1e-5) if cfg.dtype == "float32" else dict(rtol=1e-2, atol=1e-2)
  np.testing.assert_allclose(np.asarray(ours, np.float32)[rows],
                             np.asarray(theirs, np.float32)[rows], **tol)


# ---------------------------------------------------------------------------------------
# Dropout.


def test_dropout_is_inverted_and_deterministic():
  b, t, s, n, rate = 2, 6, 8, 2, 0.3
  q, k, _ = make_case(Config(b=b, t=t, s=s, n=n, k=n))[0][:3]
  # value u carries a distinct positive scale in channel u, so out[..., u] = p'[..., u] * d_u.
  d = 1.0 + np.random.default_rng(3).random(s)
  v = jnp.asarray(np.broadcast_to(np.eye(s) * d, (b, n, s, s)).transpose(0, 2, 1, 3),
                  jnp.float32)
  drop = jax.jit(functools.partial(sdpa_xla, dropout_rate=rate))
  out = np.asarray(drop(q, k, v, dropout_rng=jax.random.key(11)), np.float64)
  np.testing.assert_array_equal(out, drop(q, k, v, dropout_rng=jax.random.key(11)))
  assert not np.array_equal(out, drop(q, k, v, dropout_rng=jax.random.key(12)))
  p = oracle(q, k, v)[0] / d  # [B,T,N,S]: the undropped probabilities
  kept = out != 0
  np.testing.assert_allclose(out[kept] / d[np.nonzero(kept)[-1]], p[kept] / (1 - rate),
                             rtol=1e-5)
  assert 0.5 * rate < 1 - kept.mean() < 1.5 * rate


def test_dropout_rate_zero_is_bit_identical():
  args, kwargs = make_case(Config(is_causal=True, bias="bnts"))
  plain = jit_call(functools.partial(sdpa_xla, return_lse=True), args, kwargs)
  zero = jit_call(functools.partial(sdpa_xla, return_lse=True, dropout_rate=0.0),
                  args, kwargs | dict(dropout_rng=jax.random.key(1)))
  for a, b in zip(plain, zero):
    np.testing.assert_array_equal(a, b)


def test_dropout_grads_are_finite_and_deterministic():
  args, _ = make_case(Config())
  loss = lambda q, k, v: jnp.sum(sdpa_xla(q, k, v, dropout_rate=0.5,
                                          dropout_rng=jax.random.key(5)) ** 2)
  grad = jax.jit(jax.grad(loss, (0, 1, 2)))
  for a, b in zip(grad(*args[:3]), grad(*args[:3])):
    assert np.all(np.isfinite(a)) and np.any(a != 0)
    np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------
# Bad input: ValueError / TypeError naming the argument.


def _qkv(b=2, t=4, s=4, n=4, k=2, h=8, dtype="float32"):
  return make_case(Config(b=b, t=t, s=s, n=n, k=k, h=h, dtype=dtype))[0]


_Q, _K, _V = _qkv()
BAD_INPUTS = [
    ("query_rank", dict(query=_Q[0, 0]), ValueError, "query"),
    ("key_rank", dict(key=_K[0]), ValueError, "key"),
    ("heads_do_not_divide", dict(key=_qkv(k=3)[1], value=_qkv(k=3)[2]), ValueError, "N=4"),
    ("head_dim_mismatch", dict(key=_qkv(h=16)[1]), ValueError, "key"),
    ("kv_length_mismatch", dict(key=_qkv(s=5)[1]), ValueError, "key"),
    ("batch_mismatch", dict(key=_qkv(b=3)[1], value=_qkv(b=3)[2]), ValueError, "batch"),
    ("int_query", dict(query=_Q.astype(jnp.int32)), TypeError, "query"),
    ("mixed_dtypes", dict(key=_K.astype(jnp.bfloat16)), TypeError, "dtype"),
    ("mask_not_bool", dict(mask=jnp.ones((4, 4), jnp.int32)), TypeError, "mask"),
    ("mask_shape", dict(mask=jnp.ones((3, 4), bool)), ValueError, "mask"),
    ("bias_shape", dict(bias=jnp.ones((2, 4, 4, 5))), ValueError, "bias"),
    ("bias_rank", dict(bias=jnp.ones((1, 2, 4, 4, 4))), ValueError, "bias"),
    ("bias_int", dict(bias=jnp.ones((4, 4), jnp.int32)), TypeError, "bias"),
    ("q_lengths_float", dict(query_seq_lengths=jnp.ones((2,))), TypeError, "query_seq_lengths"),
    ("kv_lengths_shape", dict(key_value_seq_lengths=jnp.ones((3,), jnp.int32)), ValueError,
     "key_value_seq_lengths"),
    ("segments_alone", dict(q_segment_ids=jnp.ones((2, 4), jnp.int32)), ValueError,
     "segment_ids"),
    ("segments_shape", dict(q_segment_ids=jnp.ones((2, 5), jnp.int32),
                            kv_segment_ids=jnp.ones((2, 4), jnp.int32)), ValueError,
     "q_segment_ids"),
    ("sinks_shape", dict(sinks=jnp.ones((2,))), ValueError, "sinks"),
    ("dropout_without_rng", dict(dropout_rate=0.1), ValueError, "dropout_rng"),
    ("dropout_rate_range", dict(dropout_rate=1.5, dropout_rng=jax.random.key(0)), ValueError,
     "dropout_rate"),
    ("causal_alignment", dict(causal_alignment="top_right"), ValueError, "causal_alignment"),
    ("window_negative", dict(local_window_size=-1), ValueError, "local_window_size"),
    ("window_triple", dict(local_window_size=(1, 2, 3)), TypeError, "local_window_size"),
    ("window_float", dict(local_window_size=(1.5, 2)), TypeError, "local_window_size"),
    ("softcap", dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
    ("scale_array", dict(scale=jnp.ones((2,))), TypeError, "scale"),
    ("implementation", dict(implementation="pallas"), ValueError, "implementation"),
]


@pytest.mark.parametrize("change,error,name", [c[1:] for c in BAD_INPUTS],
                         ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_names_the_argument(change, error, name):
  kwargs = dict(query=_Q, key=_K, value=_V) | change
  with pytest.raises(error, match=name):
    cudnn_jax.sdpa(**kwargs)


# ---------------------------------------------------------------------------------------
# Engine selection.

on_cpu = pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU decline")


@on_cpu
def test_cudnn_on_cpu_raises_unsupported_with_reason():
  q, k, v = _qkv(dtype="bfloat16")
  with pytest.raises(cudnn_jax.UnsupportedError, match="cudnn: .+") as info:
    cudnn_jax.sdpa(q, k, v, implementation="cudnn")
  assert isinstance(info.value, NotImplementedError)


def test_float32_is_declined_by_cudnn_everywhere():
  with pytest.raises(cudnn_jax.UnsupportedError, match="cudnn"):
    cudnn_jax.sdpa(_Q, _K, _V, implementation="cudnn")


def test_engine_sequence_falls_back():
  args, kwargs = make_case(Config(is_causal=True))
  expected = sdpa_xla(*args, **kwargs)
  for impl in (("cudnn", "xla"), None):
    np.testing.assert_array_equal(cudnn_jax.sdpa(*args, implementation=impl, **kwargs),
                                  expected)


def test_all_declined_lists_every_reason():
  with pytest.raises(cudnn_jax.UnsupportedError, match="cudnn: .*cute: "):
    cudnn_jax.sdpa(_Q, _K, _V, implementation=("cudnn", "cute"))


def test_explain_with_shape_structs():
  structs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (_Q, _K, _V)]
  text = cudnn_jax.explain("sdpa", *structs, is_causal=True,
                           key_value_seq_lengths=jax.ShapeDtypeStruct((2,), jnp.int32))
  for engine in ("cudnn", "cute", "xla"):
    assert engine in text
  assert "'xla' serves" in text and "declines" in text
  forced = cudnn_jax.explain("sdpa", *structs, implementation="cudnn")
  assert "no requested engine" in forced and "cudnn: declines: " in forced


def test_explain_reports_bad_input():
  with pytest.raises(ValueError, match="key"):
    cudnn_jax.explain("sdpa", _Q, _K[0], _V)


# ---------------------------------------------------------------------------------------
# Transformations.


def test_jit_matches_eager():
  args, kwargs = make_case(Config(is_causal=True, bias="b1ts", kv_lengths=True, sinks=True))
  eager = sdpa_xla(*args, return_lse=True, **kwargs)
  jitted = jit_call(functools.partial(sdpa_xla, return_lse=True), args, kwargs)
  for a, b in zip(eager, jitted):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bias_axis", [0, None])
def test_vmap_matches_loop(bias_axis):
  cases = [make_case(Config(b=2, bias="1nts", kv_lengths=True, is_causal=True), seed=i)
           for i in range(3)]
  stacked = jax.tree.map(lambda *x: jnp.stack(x), *[(a, kw) for a, kw in cases])
  args, kwargs = stacked
  if bias_axis is None:
    args = args[:3] + (cases[0][0][3],)
    cases = [(c[0][:3] + (cases[0][0][3],), c[1]) for c in cases]
  f = functools.partial(sdpa_xla, is_causal=True, return_lse=True)
  in_axes = (0, 0, 0, bias_axis)
  batched = jax.jit(jax.vmap(lambda a, kv: f(*a, key_value_seq_lengths=kv),
                             in_axes=(in_axes, 0)))(args, kwargs["key_value_seq_lengths"])
  for i, (a, kw) in enumerate(cases):
    out, lse = f(*a, key_value_seq_lengths=kw["key_value_seq_lengths"])
    np.testing.assert_allclose(batched[0][i], out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(batched[1][i], lse, rtol=1e-5, atol=1e-6)


def test_vmap_of_grad():
  cases = [make_case(Config(bias="bnts"), seed=i)[0] for i in range(2)]
  stacked = jax.tree.map(lambda *x: jnp.stack(x), *cases)
  loss = lambda q, k, v, b: jnp.sum(jnp.sin(sdpa_xla(q, k, v, b)))
  grad = jax.grad(loss, argnums=(0, 1, 2, 3))
  batched = jax.jit(jax.vmap(grad))(*stacked)
  for i, args in enumerate(cases):
    for got, want in zip(batched, grad(*args)):
      np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------
# Sharding on an 8-device CPU mesh.

needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")

SHARDINGS = [
    # (mesh shape, mesh axes, spec for [B,T,N,H] inputs, Config)
    ((8,), ("data",), P("data"), Config(b=8, n=4, k=2, bias="b1ts", kv_lengths=True)),
    ((2, 4), ("data", "model"), P("data", None, "model"),
     Config(b=2, n=8, k=4, bias="1nts", is_causal=True)),
]


@needs_8
@pytest.mark.parametrize("mesh_shape,axes,spec,cfg", SHARDINGS, ids=["batch", "batch_heads"])
def test_sharded_matches_unsharded(mesh_shape, axes, spec, cfg):
  mesh = jax.make_mesh(mesh_shape, axes, devices=jax.devices()[:8])
  (q, k, v, bias), kwargs = make_case(cfg)
  lengths, static = split_kwargs(kwargs)
  # bias [B,N,T,S] takes the batch / head axes of the [B,T,N,H] spec where it is not 1.
  bias_spec = P(*[spec[i] if i < len(spec) and bias.shape[j] > 1 else None
                  for j, i in enumerate((0, 2, 1, 3))])
  shardings = ((NamedSharding(mesh, spec),) * 3 + (NamedSharding(mesh, bias_spec),),
               {name: NamedSharding(mesh, P(spec[0])) for name in lengths})

  def loss(qkvb, lengths):
    out = sdpa_xla(*qkvb, **lengths, **static)
    return jnp.sum(out * out), out

  fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
  (_, out), grads = fn(*jax.device_put(((q, k, v, bias), lengths), shardings))
  (_, ref_out), ref_grads = fn((q, k, v, bias), lengths)
  assert out.sharding.spec[0] == spec[0], out.sharding
  np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("t,s,lengths,view_t,skip,bottom_right", [
    (64, 64, False, 64, 0, False),   # corners aligned: served as top-left
    (96, 64, False, 64, 32, False),  # keyless leading rows cut, then aligned
    (64, 96, False, 64, 0, True),
    (64, 64, True, 64, 0, True),     # per-batch lengths move the corner
])
def test_cudnn_view_of_bottom_right_causal(t, s, lengths, view_t, skip, bottom_right):
  from cudnn_jax.ops import sdpa as sdpa_module
  args, kwargs = make_case(Config(b=2, t=t, s=s, n=2, k=2, is_causal=True, bias="11ts",
                                  causal_alignment="bottom_right", q_lengths=lengths,
                                  kv_lengths=lengths))
  call = sdpa_module.prepare(*args, **kwargs)[0]
  view, cut = sdpa_module._cudnn_view(call)  # pylint: disable=protected-access
  assert (view.t, cut, view.bottom_right) == (view_t, skip, bottom_right)
  assert view.bias_shape[2] == view_t


@pytest.mark.parametrize("t,s", [(64, 64), (96, 64), (64, 96)])
def test_cudnn_engine_python_side_matches_xla(monkeypatch, t, s):
  """The cudnn engine's views (row cut, alignment, mask folded into the bias, empty-row
  fix-up) over the primitives' emulated CPU lowering, against the xla engine."""
  from cudnn_jax.ops import sdpa as sdpa_module
  monkeypatch.setattr(sdpa_module, "_cudnn_check", lambda *a, **kw: None)
  args, kwargs = make_case(Config(b=2, t=t, s=s, n=4, k=2, is_causal=True, bias="1nts",
                                  mask="b1ts", causal_alignment="bottom_right"))
  kwargs = {**kwargs, "return_lse": True}
  w = cotangent((2, t, 4, args[2].shape[-1]), np.float32, 0)

  def loss(run, q, k, v, bias):
    out, lse = run(q, k, v, bias)
    return jnp.sum(out.astype(jnp.float32) * w), (out, jnp.where(jnp.isneginf(lse), 0, lse))

  def via_cudnn_engine(q, k, v, bias):
    call, inputs = sdpa_module.prepare(q, k, v, bias, **kwargs)
    return sdpa_module._run_cudnn(call, inputs)  # pylint: disable=protected-access

  xla = functools.partial(cudnn_jax.sdpa, implementation="xla", **kwargs)
  grad = lambda run: jax.jit(jax.grad(functools.partial(loss, run), argnums=(0, 1, 2, 3),
                                      has_aux=True))(*args[:4])
  (got, (out, lse)), (ref, (ref_out, ref_lse)) = grad(via_cudnn_engine), grad(xla)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                             rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(lse, ref_lse, rtol=1e-3, atol=1e-3)
  for g, r in zip(got, ref):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                               rtol=2e-2, atol=2e-2)


def test_cache_info_reports_counters_and_plans():
  info = cudnn_jax.cache_info()
  assert {"size", "capacity", "hits", "misses", "evictions", "recorded", "plans"} <= set(info)
  assert isinstance(info["plans"], dict) and len(info["plans"]) == info["size"]
