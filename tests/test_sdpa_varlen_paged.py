"""cudnn_jax.sdpa_varlen (packed sequences) and cudnn_jax.sdpa_paged (paged KV cache) on the
xla engine against the float64 oracle of sdpa, applied sequence by sequence."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from jax.sharding import NamedSharding, PartitionSpec as P

import cudnn_jax
from mesh_cases import assert_no_collectives, mesh_or_skip
from sdpa_oracle import (oracle, paged_case, rel_err_finite as rel_err, varlen_case,
                         varlen_oracle)

F32_TOL = 2e-5  # ||a - b|| / ||b||


def normal(rng, *shape):
  return rng.standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------------------------------
# sdpa_varlen


VARLEN_CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "causal_bottom_right": dict(is_causal=True, causal_alignment="bottom_right"),
    "window": dict(local_window_size=(3, 1)),
    "causal_window_softcap": dict(is_causal=True, local_window_size=(5, 0), logits_soft_cap=3.0),
    "sinks": dict(sinks=np.array([0.5, -1.0, 2.0, 0.0], np.float32), is_causal=True),
}
# Lengths: an empty sequence, a sequence with no keys, q and kv lengths that differ.
Q_LENS, KV_LENS = [5, 0, 9, 4, 7], [7, 3, 9, 0, 12]


@pytest.mark.parametrize("name", VARLEN_CASES)
def test_varlen_matches_the_oracle_sequence_by_sequence(name):
  kwargs = VARLEN_CASES[name]
  q, k, v, cu_q, cu_kv = varlen_case(np.random.default_rng(0), Q_LENS, KV_LENS)
  fn = jax.jit(functools.partial(cudnn_jax.sdpa_varlen, max_seqlen_q=max(Q_LENS),
                                 max_seqlen_kv=max(KV_LENS), return_lse=True,
                                 implementation="xla", **kwargs))
  out, lse = fn(q, k, v, cu_q, cu_kv)
  want_out, want_lse = varlen_oracle(q, k, v, cu_q, cu_kv, **kwargs)
  assert out.shape == want_out.shape and lse.shape == want_lse.shape
  assert rel_err(out, want_out) <= F32_TOL
  assert rel_err(lse, want_lse) <= F32_TOL
  assert np.all(np.asarray(out)[cu_q[-1]:] == 0)  # rows past the last sequence


@pytest.mark.parametrize("name", ["causal_bottom_right", "sinks"])
def test_varlen_gradients_match_the_oracle(name):
  kwargs = VARLEN_CASES[name]
  rng = np.random.default_rng(1)
  q, k, v, cu_q, cu_kv = varlen_case(rng, Q_LENS, KV_LENS)
  d_out = normal(rng, q.shape[0], q.shape[1], v.shape[2])
  args = dict(query=q, key=k, value=v) | ({"sinks": kwargs["sinks"]} if "sinks" in kwargs else {})

  def loss(a):
    rest = {n: x for n, x in kwargs.items() if n != "sinks"}
    out = cudnn_jax.sdpa_varlen(a["query"], a["key"], a["value"], cu_q, cu_kv,
                                max_seqlen_q=max(Q_LENS), max_seqlen_kv=max(KV_LENS),
                                sinks=a.get("sinks"), implementation="xla", **rest)
    return jnp.sum(out * d_out)

  grads = jax.jit(jax.grad(loss))(args)
  want = varlen_oracle(q, k, v, cu_q, cu_kv, d_out=d_out, **kwargs)
  for name_, g in grads.items():
    assert rel_err(g, want[name_]) <= 1e-4, name_


def test_varlen_rows_past_max_seqlen_and_bad_offsets_stay_in_bounds():
  """A sequence longer than max_seqlen_q outputs 0 past the bound; offsets beyond the
  arrays are clipped, never read out of bounds."""
  q, k, v, cu_q, cu_kv = varlen_case(np.random.default_rng(2), [6, 4], [6, 4], tail=0)
  out = cudnn_jax.sdpa_varlen(q, k, v, cu_q, cu_kv, max_seqlen_q=4, max_seqlen_kv=6,
                              implementation="xla")
  want, _ = varlen_oracle(q, k, v, cu_q, cu_kv)
  assert np.all(np.asarray(out)[4:6] == 0)
  assert rel_err(np.asarray(out)[:4], want[:4]) <= F32_TOL
  bad = np.array([0, 5, 1000], np.int32)  # past the end
  out = cudnn_jax.sdpa_varlen(q, k, v, bad, bad, max_seqlen_q=8, max_seqlen_kv=8,
                              implementation="xla")
  assert np.all(np.isfinite(np.asarray(out)))


def test_varlen_under_vmap_matches_a_loop():
  rng = np.random.default_rng(3)
  cases = [varlen_case(rng, [3, 5], [4, 2], tail=1) for _ in range(2)]
  stacked = [np.stack(xs) for xs in zip(*cases)]
  fn = functools.partial(cudnn_jax.sdpa_varlen, max_seqlen_q=5, max_seqlen_kv=4,
                         is_causal=True, implementation="xla")
  out = jax.jit(jax.vmap(fn))(*stacked)
  for i, case in enumerate(cases):
    np.testing.assert_allclose(out[i], fn(*case), rtol=1e-6, atol=1e-6)


def test_varlen_explain_and_bad_inputs():
  q, k, v, cu_q, cu_kv = varlen_case(np.random.default_rng(4), [3, 5], [4, 2])
  text = cudnn_jax.explain("sdpa_varlen", q, k, v, cu_q, cu_kv, max_seqlen_q=5,
                           max_seqlen_kv=4)
  assert "xla" in text and "cudnn" in text
  call = functools.partial(cudnn_jax.sdpa_varlen, max_seqlen_q=5, max_seqlen_kv=4)
  with pytest.raises(ValueError, match="query"):
    call(q[None], k, v, cu_q, cu_kv)
  with pytest.raises(TypeError, match="cu_seqlens_q"):
    call(q, k, v, cu_q.astype(np.float32), cu_kv)
  with pytest.raises(ValueError, match="cu_seqlens_kv"):
    call(q, k, v, cu_q, cu_kv[:2])
  with pytest.raises(ValueError, match="max_seqlen_kv"):
    cudnn_jax.sdpa_varlen(q, k, v, cu_q, cu_kv, max_seqlen_q=5, max_seqlen_kv=0)
  with pytest.raises(TypeError, match="max_seqlen_q"):
    cudnn_jax.sdpa_varlen(q, k, v, cu_q, cu_kv, max_seqlen_q=5.0, max_seqlen_kv=4)
  with pytest.raises(ValueError, match="value"):
    call(q, k, v[:-1], cu_q, cu_kv)


# ---------------------------------------------------------------------------------------
# sdpa_paged


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(local_window_size=(6, 0)),
    dict(logits_soft_cap=2.0, sinks=np.array([0.1, -0.5, 1.0, 0.0], np.float32)),
], ids=["decode", "window", "softcap_sinks"])
def test_paged_decode_matches_the_oracle(kwargs):
  query, kc, vc, table, lens, keys, values = paged_case(np.random.default_rng(5), [9, 1, 16, 5])
  out, lse = jax.jit(functools.partial(cudnn_jax.sdpa_paged, return_lse=True,
                                       implementation="xla", **kwargs))(query, kc, vc, table, lens)
  want_out, want_lse = oracle(query, keys, values, key_value_seq_lengths=lens, is_causal=True,
                              causal_alignment="bottom_right", **kwargs)
  assert rel_err(out, want_out) <= F32_TOL
  assert rel_err(lse, want_lse) <= F32_TOL


def test_paged_chunked_prefill_with_query_lengths():
  query, kc, vc, table, lens, keys, values = paged_case(np.random.default_rng(6), [12, 7, 3],
                                                        t=5)
  q_lens = np.array([5, 2, 3], np.int32)
  out = cudnn_jax.sdpa_paged(query, kc, vc, table, lens, query_seq_lengths=q_lens,
                             implementation="xla")
  want, _ = oracle(query, keys, values, key_value_seq_lengths=lens, query_seq_lengths=q_lens,
                   is_causal=True, causal_alignment="bottom_right")
  assert rel_err(out, want) <= F32_TOL
  assert np.all(np.asarray(out)[1, 2:] == 0)  # rows past the query length


def test_paged_explain_and_bad_inputs():
  query, kc, vc, table, lens, _, _ = paged_case(np.random.default_rng(7), [4, 6])
  assert "xla" in cudnn_jax.explain("sdpa_paged", query, kc, vc, table, lens)
  with pytest.raises(ValueError, match="page_table"):
    cudnn_jax.sdpa_paged(query, kc, vc, table[:1], lens)
  with pytest.raises(TypeError, match="page_table"):
    cudnn_jax.sdpa_paged(query, kc, vc, table.astype(np.float32), lens)
  with pytest.raises(ValueError, match="value_cache"):
    cudnn_jax.sdpa_paged(query, kc, vc[:, :2], table, lens)
  with pytest.raises(ValueError, match="key_value_seq_lengths"):
    cudnn_jax.sdpa_paged(query, kc, vc, table, lens[:1])


# An FP8 cache: float8_e4m3fn pages with float32 scales, dequantized as they are read.

E4M3 = jnp.float8_e4m3fn


def fp8_case(rng, kv_lens, **kwargs):
  """``paged_case`` with both caches quantized to e4m3 under their scales, and the
  contiguous keys and values the oracle reads: the dequantized cache (stored * scale)."""
  query, kc, vc, table, lens, _, _ = paged_case(rng, kv_lens, **kwargs)
  k_scale, v_scale = np.float32(0.05), np.float32(3.0)
  kq, vq = (np.asarray(jnp.asarray(c / s, E4M3)) for c, s in ((kc, k_scale), (vc, v_scale)))
  keys, values = (np.asarray(jnp.asarray(c, jnp.float32)) * s
                  for c, s in ((kq, k_scale), (vq, v_scale)))
  # Positions past the lengths (NaN in the cache) are masked: the oracle reads zeros there.
  gather = lambda c: np.nan_to_num(
      c[np.clip(table, 0, len(c) - 1)].reshape(len(lens), -1, *c.shape[2:]))
  return query, kq, vq, table, lens, k_scale, v_scale, gather(keys), gather(values)


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(local_window_size=(6, 0), return_lse=True),
    dict(logits_soft_cap=2.0, sinks=np.array([0.1, -0.5, 1.0, 0.0], np.float32)),
    dict(query_seq_lengths=np.array([3, 1, 2, 3], np.int32)),
], ids=["decode", "window_lse", "softcap_sinks", "query_lengths"])
def test_paged_fp8_cache_matches_the_dequantized_oracle(kwargs):
  t = 3 if "query_seq_lengths" in kwargs else 1
  query, kq, vq, table, lens, k_scale, v_scale, keys, values = fp8_case(
      np.random.default_rng(8), [9, 1, 16, 5], t=t)
  got = jax.jit(functools.partial(cudnn_jax.sdpa_paged, implementation="xla", **kwargs))(
      query, kq, vq, table, lens, k_scale=k_scale, v_scale=v_scale)
  oracle_kwargs = {k: v for k, v in kwargs.items() if k != "return_lse"}
  want_out, want_lse = oracle(query, keys, values, key_value_seq_lengths=lens, is_causal=True,
                              causal_alignment="bottom_right", **oracle_kwargs)
  out = got[0] if kwargs.get("return_lse") else got
  assert out.dtype == query.dtype
  assert rel_err(out, want_out) <= F32_TOL
  if kwargs.get("return_lse"):
    assert rel_err(got[1], want_lse) <= F32_TOL


def test_paged_fp8_cache_scales_as_given():
  """A scale of 0 zeroes that cache (keys: uniform weights; values: output 0); an inf
  scale makes the rows that read it NaN, and is an error under checkify."""
  query, kq, vq, table, lens, k_scale, v_scale, keys, values = fp8_case(
      np.random.default_rng(9), [9, 0, 16])
  call = functools.partial(cudnn_jax.sdpa_paged, query, kq, vq, table, lens,
                           implementation="xla")
  out = call(k_scale=0.0, v_scale=v_scale)
  want, _ = oracle(query, keys * 0, values, key_value_seq_lengths=lens, is_causal=True,
                   causal_alignment="bottom_right")
  assert rel_err(out, want) <= F32_TOL
  assert np.all(np.asarray(call(k_scale=k_scale, v_scale=0.0)) == 0)
  out = np.asarray(call(k_scale=k_scale, v_scale=np.float32(np.inf)))
  assert np.all(np.isnan(out[[0, 2]])) and np.all(out[1] == 0)  # sequence 1 has no keys
  err, _ = checkify.checkify(lambda s: call(k_scale=k_scale, v_scale=s),
                             errors=checkify.user_checks)(jnp.float32(np.inf))
  with pytest.raises(checkify.JaxRuntimeError, match="v_scale"):
    err.throw()


def test_paged_fp8_cache_bad_inputs():
  query, kq, vq, table, lens, k_scale, v_scale, _, _ = fp8_case(np.random.default_rng(10),
                                                                [4, 6])
  with pytest.raises(ValueError, match="k_scale: required"):
    cudnn_jax.sdpa_paged(query, kq, vq, table, lens, v_scale=v_scale)
  with pytest.raises(ValueError, match="v_scale: only for a float8_e4m3fn value_cache"):
    cudnn_jax.sdpa_paged(query, kq, vq.astype(np.float32), table, lens, k_scale=k_scale,
                         v_scale=v_scale)
  with pytest.raises(ValueError, match="k_scale: expected a float32 scalar"):
    cudnn_jax.sdpa_paged(query, kq, vq, table, lens, k_scale=np.ones(2, np.float32),
                         v_scale=v_scale)
  with pytest.raises(TypeError, match="query, value_cache: expected one dtype"):
    cudnn_jax.sdpa_paged(query, kq, vq.astype(jnp.bfloat16).astype(np.float16), table, lens,
                         k_scale=k_scale)
  text = cudnn_jax.explain("sdpa_paged", query, kq, vq, table, lens, k_scale=k_scale,
                           v_scale=v_scale)
  assert "'xla' serves" in text


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_head_and_batch_sharded_stay_local(axis_type):
  """Head-sharded packed sequences, and batch- and head-sharded paged decode (the cache
  sharded by kv head): no data movement between devices."""
  mesh = mesh_or_skip((4, 2), ("b", "h"), axis_type)
  with jax.set_mesh(mesh):
    _check_sharded_layouts(mesh)


def _check_sharded_layouts(mesh):
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  q, k, v, cu_q, cu_kv = varlen_case(np.random.default_rng(8), Q_LENS, KV_LENS)
  varlen = jax.jit(functools.partial(cudnn_jax.sdpa_varlen, max_seqlen_q=max(Q_LENS),
                                     max_seqlen_kv=max(KV_LENS), is_causal=True))
  heads = P(None, "h")
  varlen_args = (put(q, heads), put(k, heads), put(v, heads), cu_q, cu_kv)
  query, kc, vc, table, lens, _, _ = paged_case(np.random.default_rng(9), [9, 1, 16, 5])
  paged = jax.jit(cudnn_jax.sdpa_paged)
  paged_args = (put(query, P("b", None, "h")), put(kc, P(None, None, "h")),
                put(vc, P(None, None, "h")), put(table, P("b")), put(lens, P("b")))
  for fn, args, local in ((varlen, varlen_args, (q, k, v, cu_q, cu_kv)),
                          (paged, paged_args, (query, kc, vc, table, lens))):
    np.testing.assert_allclose(fn(*args), fn(*local), rtol=1e-6, atol=1e-6)
    assert_no_collectives(fn, *args)
