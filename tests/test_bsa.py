"""cudnn_jax.bsa (block-sparse attention) on the xla engine against the float64 oracle of
sdpa with the equivalent token-level mask."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from jax.sharding import NamedSharding, PartitionSpec as P

import cudnn_jax
from cudnn_jax import _metadata
from mesh_cases import assert_no_collectives, mesh_or_skip
from sdpa_oracle import oracle, oracle_vjp, rel_err_finite as rel_err

F32_TOL = 2e-5  # ||a - b|| / ||b||


def make_case(rng, *, b=2, sq=100, skv=150, n=4, k=2, h=16, hv=8, bs=16, kmax=4):
  """q, k, v and a random block selection: unique indices that include some out of range
  (skipped), random counts (0 included)."""
  nq, nkv = -(-sq // bs), -(-skv // bs)
  q = rng.standard_normal((b, sq, n, h)).astype(np.float32)
  kk = rng.standard_normal((b, skv, k, h)).astype(np.float32)
  v = rng.standard_normal((b, skv, k, hv)).astype(np.float32)
  index = np.stack([rng.choice(np.arange(-2, nkv + 2), kmax, replace=False)
                    for _ in range(b * n * nq)]).reshape(b, n, nq, kmax).astype(np.int32)
  counts = rng.integers(0, kmax + 1, (b, n, nq)).astype(np.int32)
  return q, kk, v, index, counts


def token_mask(index, counts, sizes, sq, skv, bs, group):
  """[B,N,Sq,Skv] bool equivalent of a block selection; ``sizes [B,K,Nkv]``."""
  b, n, nq, kmax = index.shape
  nkv = -(-skv // bs)
  mask = np.zeros((b, n, sq, skv), bool)
  for i in range(b):
    for h in range(n):
      for m in range(nq):
        for j in range(min(counts[i, h, m], kmax)):
          blk = index[i, h, m, j]
          if 0 <= blk < nkv:
            cols = blk * bs + np.arange(sizes[i, h // group, blk])
            mask[i, h, m * bs:(m + 1) * bs, cols[cols < skv]] = True
  return mask


def full_sizes(b, k, skv, bs):
  nkv = -(-skv // bs)
  return np.broadcast_to(np.minimum(bs, skv - bs * np.arange(nkv)), (b, k, nkv))


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("sizes_form", [None, "nkv", "b_nkv", "b_k_nkv"])
def test_bsa_matches_the_masked_oracle(is_causal, sizes_form):
  rng = np.random.default_rng(0)
  q, k, v, index, counts = make_case(rng)
  b, kh, skv, bs = 2, 2, 150, 16
  nkv = -(-skv // bs)
  sizes = full_sizes(b, kh, skv, bs)
  kv_block_sizes = None
  if sizes_form is not None:
    shape = {"nkv": (nkv,), "b_nkv": (b, nkv), "b_k_nkv": (b, kh, nkv)}[sizes_form]
    kv_block_sizes = rng.integers(0, bs + 3, shape).astype(np.int32)  # past bs: clipped
    sizes = np.minimum(np.broadcast_to(
        kv_block_sizes.reshape({1: (1, 1, nkv), 2: (b, 1, nkv), 3: (b, kh, nkv)}[
            kv_block_sizes.ndim]), (b, kh, nkv)), sizes)
  out, lse = jax.jit(functools.partial(
      cudnn_jax.bsa, block_size=bs, is_causal=is_causal, return_lse=True,
      implementation="xla"))(q, k, v, index, counts, kv_block_sizes=kv_block_sizes)
  mask = token_mask(index, counts, sizes, q.shape[1], skv, bs, group=2)
  want_out, want_lse = oracle(q, k, v, mask=mask, is_causal=is_causal)
  assert rel_err(out, want_out) <= F32_TOL
  assert rel_err(lse, want_lse) <= F32_TOL
  assert np.any(~np.isfinite(want_lse))  # some rows keep no key: the case is covered


def test_bsa_gradients_match_the_oracle():
  rng = np.random.default_rng(1)
  q, k, v, index, counts = make_case(rng)
  d_out = rng.standard_normal((2, 100, 4, 8)).astype(np.float32)
  loss = lambda q, k, v: jnp.sum(cudnn_jax.bsa(q, k, v, index, counts, block_size=16,
                                               is_causal=True, implementation="xla") * d_out)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  mask = token_mask(index, counts, full_sizes(2, 2, 150, 16), 100, 150, 16, group=2)
  want = oracle_vjp(q, k, v, mask=mask, is_causal=True, d_out=d_out)
  for name, g in zip(("query", "key", "value"), grads):
    assert rel_err(g, want[name]) <= 1e-4, name


def test_bsa_from_mask_round_trip():
  rng = np.random.default_rng(2)
  q, k, v, _, _ = make_case(rng)
  block_mask = rng.random((2, 4, 7, 10)) < 0.3
  index, counts = cudnn_jax.bsa_from_mask(jnp.asarray(block_mask))
  assert index.shape == (2, 4, 7, 10) and counts.shape == (2, 4, 7)
  np.testing.assert_array_equal(counts, block_mask.sum(-1))
  for i, h, m in np.ndindex(2, 4, 7):
    row = np.asarray(index[i, h, m])
    np.testing.assert_array_equal(row[:counts[i, h, m]], np.flatnonzero(block_mask[i, h, m]))
    assert np.all(row[counts[i, h, m]:] == -1)
  out = cudnn_jax.bsa(q, k, v, index, counts, block_size=16, implementation="xla")
  mask = token_mask(np.asarray(index), np.asarray(counts), full_sizes(2, 2, 150, 16), 100, 150,
                    16, group=2)
  assert rel_err(out, oracle(q, k, v, mask=mask)[0]) <= F32_TOL


def test_bsa_under_vmap_matches_a_loop():
  rng = np.random.default_rng(3)
  cases = [make_case(rng, b=1) for _ in range(2)]
  stacked = [np.stack(xs) for xs in zip(*cases)]
  fn = functools.partial(cudnn_jax.bsa, block_size=16, is_causal=True, implementation="xla")
  out = jax.jit(jax.vmap(fn))(*stacked)
  for i, case in enumerate(cases):
    np.testing.assert_allclose(out[i], fn(*case), rtol=1e-6, atol=1e-6)


def test_bsa_explain_and_bad_inputs():
  q, k, v, index, counts = make_case(np.random.default_rng(4))
  text = cudnn_jax.explain("bsa", q, k, v, index, counts, block_size=16)
  assert "'xla' serves" in text
  call = functools.partial(cudnn_jax.bsa, block_size=16)
  with pytest.raises(ValueError, match="block_size"):
    cudnn_jax.bsa(q, k, v, index, counts, block_size=48)
  with pytest.raises(ValueError, match="block_index"):
    call(q, k, v, index[:, :, :3], counts)
  with pytest.raises(TypeError, match="block_index"):
    call(q, k, v, index.astype(np.float32), counts)
  with pytest.raises(ValueError, match="block_counts"):
    call(q, k, v, index, counts[0])
  with pytest.raises(ValueError, match="kv_block_sizes"):
    call(q, k, v, index, counts, kv_block_sizes=np.zeros(3, np.int32))
  with pytest.raises(ValueError, match="value"):
    call(q, k, v[:, :10], index, counts)
  with pytest.raises(TypeError, match="block_mask"):
    cudnn_jax.bsa_from_mask(jnp.zeros((1, 1, 2, 2), jnp.int32))


def test_nothing_to_attend():
  """Kmax = 0, Skv = 0, and no query, batch row or head: out 0, lse -inf, gradients 0."""
  fn = functools.partial(cudnn_jax.bsa, block_size=16, return_lse=True, implementation="xla")
  for b, sq, skv, n, width in ((1, 20, 20, 2, 0), (1, 20, 0, 2, 2), (1, 0, 20, 2, 2),
                               (0, 20, 20, 2, 2), (1, 20, 20, 0, 2)):
    q, k, v = (jnp.ones((b, s, heads, 8)) for s, heads in ((sq, n), (skv, 1), (skv, 1)))
    index = jnp.zeros((b, n, -(-sq // 16), width), jnp.int32)
    loss = lambda *a: jnp.sum(fn(*a, index)[0])
    (out, lse), grads = jax.jit(lambda *a: (fn(*a, index), jax.grad(loss, (0, 1, 2))(*a)))(
        q, k, v)
    assert out.shape == q.shape and lse.shape == (b, n, sq)
    assert np.all(out == 0) and np.all(lse == -np.inf)
    assert all(g.shape == x.shape and np.all(g == 0) for g, x in zip(grads, (q, k, v)))


def _valid_metadata_call():
  """A call whose metadata is valid: ``bsa_from_mask``'s lists (-1 past each count) and
  kv block sizes up to the block size (the last block's cut at Skv)."""
  q, k, v, _, _ = make_case(np.random.default_rng(6), b=1, sq=40, skv=40, n=2, k=1, h=8)
  mask = np.random.default_rng(7).random((1, 2, 3, 3)) < 0.5
  sizes = np.array([16, 3, 16], np.int32)
  return lambda: cudnn_jax.bsa(q, k, v, *cudnn_jax.bsa_from_mask(jnp.asarray(mask)),
                               block_size=16, kv_block_sizes=sizes, is_causal=True)


def test_checkify_passes_valid_metadata():
  err, _ = jax.jit(checkify.checkify(_valid_metadata_call(), errors=checkify.user_checks))()
  assert err.get() is None


def test_checkify_names_the_entry_under_vmap():
  q, k, v, index, counts = make_case(np.random.default_rng(8), b=1, sq=40, skv=40, h=8)
  counts = np.stack([counts, counts])
  counts[1, 0, 1, 2] = 7  # Kmax = 4
  fn = jax.vmap(functools.partial(cudnn_jax.bsa, q, k, v, index, block_size=16))
  err, _ = jax.jit(checkify.checkify(fn, errors=checkify.user_checks))(counts)
  assert re.search(r"block_counts\[0, 1, 2\] = 7: expected a count in \[0, 4\]", err.get())


def _compiled_ops(fn):
  text = jax.jit(fn).lower().compile().as_text()
  return sorted(re.findall(r"= \S+ ([a-z][\w-]*)\(", text))


def test_checks_cost_nothing_without_checkify(monkeypatch):
  """The compiled program is the same, operation for operation, with the checks taken out."""
  with_checks = _compiled_ops(_valid_metadata_call())
  monkeypatch.setattr(_metadata, "check_entries", lambda *a, **k: None)
  assert _compiled_ops(_valid_metadata_call()) == with_checks


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_bsa_batch_and_head_sharded_stays_local(axis_type):
  """Batch- and head-sharded inputs: the same results, no data movement between devices."""
  mesh = mesh_or_skip((4, 2), ("b", "h"), axis_type)
  with jax.set_mesh(mesh):
    _check_sharded_bsa(mesh)


def _check_sharded_bsa(mesh):
  q, k, v, index, counts = make_case(np.random.default_rng(5), b=4)
  tokens, rows = P("b", None, "h"), P("b", "h")
  args = [jax.device_put(x, NamedSharding(mesh, s))
          for x, s in ((q, tokens), (k, tokens), (v, tokens), (index, rows), (counts, rows))]
  call = functools.partial(cudnn_jax.bsa, block_size=16, is_causal=True, implementation="xla")
  fwd = jax.jit(call)
  out = fwd(*args)
  np.testing.assert_allclose(out, call(q, k, v, index, counts), rtol=1e-6, atol=1e-6)
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, tokens), out.ndim)
  grad = jax.jit(jax.grad(lambda *a: jnp.sum(call(*a) ** 2), argnums=(0, 1, 2)))
  want = jax.grad(lambda *a: jnp.sum(call(*a) ** 2), argnums=(0, 1, 2))(q, k, v, index, counts)
  for g, w in zip(grad(*args), want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
  for fn in (fwd, grad):
    assert_no_collectives(fn, *args)
