"""sdpa's cudnn engine on the CPU over its handlers' emulated contracts: packed rows
(sdpa_varlen, ragged offsets), sinks with their gradient, paged caches (sdpa_paged),
against the xla engine. The engine is forced past its support checks, and so is the
choice of the cuDNN backward (the checks decline without a GPU)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cudnn_jax
from cudnn_jax import _extension
from cudnn_jax.ops import sdpa as sdpa_ops
from cudnn_jax.ops import sdpa_paged as paged_ops
from cudnn_jax.ops import sdpa_varlen as varlen_ops


@pytest.fixture
def cudnn_serves(emulated, monkeypatch):
  """``serve(op)``: the cudnn engine serves ``op`` as it would where cuDNN serves every
  configuration: packed rows and paged caches in place, the cuDNN backward."""
  monkeypatch.setattr(sdpa_ops, "_cudnn_check", lambda call, backward: None)
  monkeypatch.setattr(varlen_ops, "_packed_reason", lambda call, backward=False: None)
  monkeypatch.setattr(varlen_ops, "packed_reason", lambda padded, backward=False: None)
  monkeypatch.setattr(paged_ops, "_paged_reason", lambda call: None)
  return lambda op: emulated(op, "cudnn")


def _rel(a, b):
  a, b = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (a, b))
  finite = np.isfinite(b)
  np.testing.assert_array_equal(np.isfinite(a), finite)
  a, b = np.where(finite, a, 0), np.where(finite, b, 0)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _normal(rng, shape, dtype=jnp.float32):
  return jnp.asarray(rng.standard_normal(shape), dtype)


def _both(run, args, op, cudnn_serves, argnums):
  """(value and grads on the xla engine, on the forced cudnn engine) of ``run(*args)``:
  grads of sum(out * w) for the args at ``argnums``."""
  def value_and_grads(*a):
    out = run(*a)
    out0 = out[0] if isinstance(out, tuple) else out
    w = jnp.cos(jnp.arange(out0.size, dtype=jnp.float32)).reshape(out0.shape)
    loss = lambda *d: jnp.sum(run(*[d[argnums.index(i)] if i in argnums else x
                                    for i, x in enumerate(a)])[0].astype(jnp.float32) * w)
    return out, jax.grad(loss, argnums=tuple(range(len(argnums))))(*[a[i] for i in argnums])
  want = jax.jit(value_and_grads)(*args)
  cudnn_serves(op)
  got = jax.jit(lambda *a: value_and_grads(*a))(*args)
  return want, got


@pytest.mark.parametrize("causal,sinks", [(True, False), (False, True), (True, True)])
def test_varlen_packed_rows_match_the_xla_engine(cudnn_serves, causal, sinks):
  rng = np.random.default_rng(0)
  lengths_q, lengths_kv = [5, 0, 1, 9, 3], [5, 2, 1, 9, 4]
  cu_q, cu_kv = (jnp.asarray(np.concatenate([[0], np.cumsum(x)]), jnp.int32)
                 for x in (lengths_q, lengths_kv))
  rows_q, rows_kv = sum(lengths_q) + 3, sum(lengths_kv) + 2  # rows past the last sequence
  q = _normal(rng, (rows_q, 4, 16))
  k, v = _normal(rng, (rows_kv, 2, 16)), _normal(rng, (rows_kv, 2, 8))
  s = _normal(rng, (4,)) if sinks else None

  def run(q, k, v, s):
    return cudnn_jax.sdpa_varlen(q, k, v, cu_q, cu_kv, max_seqlen_q=8, max_seqlen_kv=9,
                                 is_causal=causal, sinks=s, return_lse=True)

  argnums = [0, 1, 2] + ([3] if sinks else [])
  (want, want_grads), (got, grads) = _both(run, (q, k, v, s), "sdpa_varlen", cudnn_serves,
                                           argnums)
  for name, a, b in zip(["out", "lse"], got, want):
    assert _rel(a, b) < 1e-5, name
  np.testing.assert_array_equal(np.asarray(got[0][sum(lengths_q):]), 0.0)
  for name, a, b in zip(["dq", "dk", "dv", "dsinks"], grads, want_grads):
    assert _rel(a, b) < 1e-5, name


def test_varlen_explain_names_the_path():
  q, k = jnp.zeros((12, 2, 16), jnp.bfloat16), jnp.zeros((12, 2, 16), jnp.bfloat16)
  cu = jnp.asarray([0, 5, 12], jnp.int32)
  text = cudnn_jax.explain("sdpa_varlen", q, k, k, cu, cu, max_seqlen_q=7, max_seqlen_kv=7)
  assert "'xla' serves" in text and "cudnn: declines: packed rows:" in text


@pytest.mark.parametrize("lengths", [False, True])
def test_sdpa_sinks_and_their_gradient(cudnn_serves, lengths):
  """The sinks' gradient from lse (the cuDNN backward takes no sinks), rows past the
  lengths and rows with no key included."""
  rng = np.random.default_rng(1)
  q, k, v = (_normal(rng, (2, 6, 4, 16)), _normal(rng, (2, 7, 2, 16)),
             _normal(rng, (2, 7, 2, 16)))
  s = _normal(rng, (4,))
  q_len = jnp.asarray([6, 3], jnp.int32) if lengths else None
  kv_len = jnp.asarray([0, 5], jnp.int32) if lengths else None

  def run(q, k, v, s):
    return cudnn_jax.sdpa(q, k, v, is_causal=True, sinks=s, query_seq_lengths=q_len,
                          key_value_seq_lengths=kv_len, return_lse=True)

  (want, want_grads), (got, grads) = _both(run, (q, k, v, s), "sdpa", cudnn_serves,
                                           [0, 1, 2, 3])
  for name, a, b in zip(["out", "lse"], got, want):
    assert _rel(a, b) < 1e-5, name
  for name, a, b in zip(["dq", "dk", "dv", "dsinks"], grads, want_grads):
    assert _rel(a, b) < 1e-5, name


def _query_rows_seen(monkeypatch, name):
  """The T of every query the primitive ``name`` is called with, appended as it is."""
  from cudnn_jax.primitives import sdpa as prim  # pylint: disable=g-import-not-at-top
  seen, original = [], getattr(prim, name)

  def recording(config, *args, **kwargs):
    seen.append(args[1 if name == "attention" else 0].shape[1])
    return original(config, *args, **kwargs)
  monkeypatch.setattr(prim, name, recording)
  return seen


@pytest.mark.parametrize("causal,alignment,lengths", [
    (False, "top_left", False), (True, "top_left", False), (True, "bottom_right", False),
    (True, "bottom_right", True), (True, "bottom_right", "one key"),
    (True, "bottom_right", "more rows than keys")])
def test_one_query_row_with_sinks_goes_in_twice(cudnn_serves, monkeypatch, causal,
                                                alignment, lengths):
  """cuDNN serves sinks with two or more query rows only: a single row goes in repeated,
  and the row whose keys are the single row's answers (values and every gradient)."""
  rng = np.random.default_rng(4)
  s_len = 1 if lengths in ("one key", "more rows than keys") else 9
  t_len = 5 if lengths == "more rows than keys" else 1  # rows without keys are cut: one left
  q, k, v = (_normal(rng, (3, t_len, 4, 16)), _normal(rng, (3, s_len, 2, 16)),
             _normal(rng, (3, s_len, 2, 16)))
  sinks = _normal(rng, (4,))
  q_len = jnp.asarray([1, 0, 1], jnp.int32) if lengths is True else None
  kv_len = jnp.asarray([9, 4, 0], jnp.int32) if lengths is True else None

  def run(q, k, v, s):
    return cudnn_jax.sdpa(q, k, v, is_causal=causal, causal_alignment=alignment, sinks=s,
                          query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
                          return_lse=True)

  seen = _query_rows_seen(monkeypatch, "attention")
  (want, want_grads), (got, grads) = _both(run, (q, k, v, sinks), "sdpa", cudnn_serves,
                                           [0, 1, 2, 3])
  assert seen and set(seen) == {2}, seen
  for name, a, b in zip(["out", "lse"], got, want):
    assert a.shape == b.shape and _rel(a, b) < 1e-5, name
  for name, a, b in zip(["dq", "dk", "dv", "dsinks"], grads, want_grads):
    assert _rel(a, b) < 1e-5, name


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_varlen_sequences_of_one_query_row_with_sinks(cudnn_serves, monkeypatch, alignment):
  """Packed sequences of at most one query row with sinks go into cuDNN as pairs of rows
  (cuDNN serves sinks with two or more), in place; the answering row of each pair matches
  the xla engine, values and every gradient."""
  from cudnn_jax.primitives import sdpa as prim  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(5)
  # A sequence without rows, one without keys (its row's lse is the sink) and rows past
  # the last sequence (lse -inf).
  lengths_q, lengths_kv = [1, 1, 0, 1, 1], [7, 1, 3, 0, 4]
  cu_q, cu_kv = (jnp.asarray(np.concatenate([[0], np.cumsum(x)]), jnp.int32)
                 for x in (lengths_q, lengths_kv))
  q = _normal(rng, (sum(lengths_q) + 3, 4, 16))
  k, v = _normal(rng, (sum(lengths_kv) + 1, 2, 16)), _normal(rng, (sum(lengths_kv) + 1, 2, 8))
  sinks = _normal(rng, (4,))

  def run(q, k, v, s):
    return cudnn_jax.sdpa_varlen(q, k, v, cu_q, cu_kv, max_seqlen_q=1, max_seqlen_kv=7,
                                 is_causal=True, causal_alignment=alignment, sinks=s,
                                 return_lse=True)

  seen, original = [], prim.attention
  monkeypatch.setattr(prim, "attention", lambda config, *a, **kw: (
      seen.append(config.packed_max_q), original(config, *a, **kw))[1])
  (want, want_grads), (got, grads) = _both(run, (q, k, v, sinks), "sdpa_varlen",
                                           cudnn_serves, [0, 1, 2, 3])
  assert seen and set(seen) == {2}, seen
  for name, a, b in zip(["out", "lse"], got, want):
    assert a.shape == b.shape and _rel(a, b) < 1e-5, name
  for name, a, b in zip(["dq", "dk", "dv", "dsinks"], grads, want_grads):
    assert _rel(a, b) < 1e-5, name


@pytest.mark.parametrize("t", [1, 3], ids=["decode", "prefill"])
def test_paged_in_place_matches_the_xla_engine(cudnn_serves, monkeypatch, t):
  rng = np.random.default_rng(2)
  pages, page, b, max_pages = 9, 4, 3, 3
  q = _normal(rng, (b, t, 4, 16))
  kc, vc = _normal(rng, (pages, page, 2, 16)), _normal(rng, (pages, page, 2, 16))
  table = jnp.asarray(rng.permutation(pages)[:b * max_pages].reshape(b, max_pages), jnp.int32)
  lengths = jnp.asarray([12, 5, 0], jnp.int32)
  s = _normal(rng, (4,))
  run = lambda table: cudnn_jax.sdpa_paged(q, kc, vc, table, lengths, sinks=s,
                                           return_lse=True)
  want = jax.jit(run)(table)
  cudnn_serves("sdpa_paged")
  seen = _query_rows_seen(monkeypatch, "sdpa_fwd")
  got = jax.jit(lambda tb: run(tb))(table)
  assert seen == [max(t, 2)]  # decode with sinks: the row goes in twice
  for name, a, c in zip(["out", "lse"], got, want):
    assert a.shape == c.shape and _rel(a, c) < 1e-5, name
  # An id outside [0, P) among the used pages: masked (the gathered path), never clipped.
  bad = table.at[0, 1].set(pages + 3).at[1, 0].set(-1)
  want_bad = jax.jit(lambda tb: paged_ops._on_sdpa_engine("xla")(  # pylint: disable=protected-access
      *paged_ops._prepare(q, kc, vc, tb, lengths, sinks=s, return_lse=True)))(bad)  # pylint: disable=protected-access
  got_bad = jax.jit(lambda tb: run(tb))(bad)
  for name, a, c in zip(["out", "lse"], got_bad, want_bad):
    assert _rel(a, c) < 1e-5, name


def test_cuda_lowering_passes_offsets_page_tables_and_sinks(cudnn_serves, monkeypatch):
  class Sized:
    sdpa_workspace = staticmethod(lambda config: 256)

  monkeypatch.setattr(_extension, "module", lambda: Sized)
  export = functools.partial(
      jax.export.export, platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(f"cudnn_jax_sdpa_{d}")
                       for d in ("fwd", "bwd")])
  q, k = jnp.zeros((12, 4, 16), jnp.bfloat16), jnp.zeros((10, 2, 16), jnp.bfloat16)
  cu = jnp.asarray([0, 5, 10], jnp.int32)
  sinks = jnp.zeros((4,), jnp.float32)
  varlen = lambda q, k, s: cudnn_jax.sdpa_varlen(q, k, k, cu, cu, max_seqlen_q=6,
                                                 max_seqlen_kv=6, is_causal=True, sinks=s)
  cudnn_serves("sdpa_varlen")
  text = export(jax.jit(jax.grad(lambda *a: jnp.sum(varlen(*a).astype(jnp.float32)),
                                 argnums=(0, 1, 2))))(q, k, sinks).mlir_module()
  assert "packed_max_q = 6 : i32" in text and "has_sinks = true" in text
  assert text.count("cudnn_jax_sdpa_bwd") == 1


def test_dropout_on_the_cudnn_engine(cudnn_serves):
  """Deterministic for a key (the handlers draw their mask from the key's seed words),
  inverted, differentiable; rate 0 is no dropout."""
  rng = np.random.default_rng(3)
  q, k, v = (_normal(rng, (2, 6, 4, 16)), _normal(rng, (2, 7, 2, 16)),
             _normal(rng, (2, 7, 2, 16)))
  cudnn_serves("sdpa")
  drop = jax.jit(lambda q, key, rate: cudnn_jax.sdpa(q, k, v, is_causal=True, dropout_rate=rate,
                                                      dropout_rng=key), static_argnums=2)
  a = drop(q, jax.random.key(7), 0.4)
  np.testing.assert_array_equal(a, drop(q, jax.random.key(7), 0.4))
  assert not np.array_equal(a, drop(q, jax.random.key(8), 0.4))
  np.testing.assert_array_equal(drop(q, jax.random.key(7), 0.0),
                                cudnn_jax.sdpa(q, k, v, is_causal=True, implementation="xla"))
  grads = jax.grad(lambda q: jnp.sum(drop(q, jax.random.key(7), 0.4) ** 2))(q)
  assert np.all(np.isfinite(grads)) and np.any(grads != 0)


@pytest.mark.parametrize("ids", ["runs", "too_many_runs", "repeated_id"])
def test_segment_ids_as_packed_sequences(cudnn_serves, monkeypatch, ids):
  """Runs of equal ids become packed sequences on cuDNN; rows with more runs than
  SEGMENT_RUNS, or an id in two runs, take the xla engine (a branch on the device): every
  case equals the xla engine, values and gradients."""
  monkeypatch.setattr(sdpa_ops, "SEGMENT_RUNS", 3)
  rng = np.random.default_rng(4)
  q, k, v = (_normal(rng, (2, 9, 4, 16)), _normal(rng, (2, 9, 2, 16)),
             _normal(rng, (2, 9, 2, 16)))
  seg = {"runs": [[5, 5, 5, 9, 9, 2, 2, 2, 2], [0] * 9],
         "too_many_runs": [[1, 1, 2, 2, 3, 3, 4, 4, 4], [0] * 9],
         "repeated_id": [[1, 1, 2, 2, 1, 1, 1, 1, 1], [0] * 9]}[ids]
  seg = jnp.asarray(seg, jnp.int32)
  if ids == "runs":
    starts, lengths, served = sdpa_ops.segment_runs(seg, seg, 3)
    np.testing.assert_array_equal(starts, [0, 3, 5, 9, 18, 18])
    np.testing.assert_array_equal(lengths, [3, 2, 4, 9, 0, 0])
    assert served
  run = lambda q, k, v: cudnn_jax.sdpa(q, k, v, is_causal=True, q_segment_ids=seg,
                                       kv_segment_ids=seg, return_lse=True)
  (want, want_grads), (got, grads) = _both(run, (q, k, v), "sdpa", cudnn_serves, [0, 1, 2])
  for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], got + grads, want + want_grads):
    assert _rel(a, b) < 1e-5, name


def test_varlen_rows_past_the_sequences_have_lse_minus_inf_with_sinks(cudnn_serves):
  """Rows no sequence owns: lse -inf; a sequence's row without keys: the sink logit."""
  rng = np.random.default_rng(5)
  lengths_q, lengths_kv = [1, 1, 0, 1, 1], [300, 1, 17, 0, 64]
  cu_q, cu_kv = (jnp.asarray(np.concatenate([[0], np.cumsum(x)]), jnp.int32)
                 for x in (lengths_q, lengths_kv))
  q = _normal(rng, (sum(lengths_q) + 3, 4, 16))
  k, v = (_normal(rng, (sum(lengths_kv) + 1, 2, 16)) for _ in range(2))
  sinks = _normal(rng, (4,))
  run = lambda: cudnn_jax.sdpa_varlen(q, k, v, cu_q, cu_kv, max_seqlen_q=1, max_seqlen_kv=300,
                                      is_causal=True, sinks=sinks, return_lse=True)
  _, want = run()
  cudnn_serves("sdpa_varlen")
  _, got = run()
  np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
  assert np.all(np.isneginf(np.asarray(got)[:, 4:]))
  assert _rel(got, want) < 1e-5
