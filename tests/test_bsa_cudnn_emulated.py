"""The "cudnn" engine of bsa on the CPU, against the float64 oracle.

Off the GPU its primitives (cudnn_jax/primitives/bsa.py) lower to the handlers' contracts in
plain JAX, so everything the engine does around NVIDIA's kernels runs here: the block
lists compacted on the device (skipped entries dropped, never clamped), the query padded
to whole blocks of 64, the one-per-batch-row block sizes of the backward, the gradients
of a differentiated lse taken from another engine, and empty calls. Engine choice is
forced past the support check (which declines without a Hopper GPU) by conftest's
``emulated``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cudnn_jax
from cudnn_jax.ops import bsa as ops
from cudnn_jax.primitives import bsa as cudnn_bsa
from sdpa_oracle import oracle, oracle_vjp, rel_err_finite as rel_err
from test_bsa import full_sizes, make_case, token_mask

TOL = {"float32": 2e-5, "bfloat16": 2e-2}  # ||a - b|| / ||b||


def _sizes(rng, form, b, k, nkv, bs):
  """``(kv_block_sizes as passed, [B,K,Nkv] as the oracle reads them)``."""
  if form is None:
    return None, None
  shape = {"batch": (b, nkv), "per_head": (b, k, nkv)}[form]
  sizes = rng.integers(0, bs + 1, shape).astype(np.int32)
  return sizes, np.broadcast_to(sizes.reshape((b, -1, nkv)), (b, k, nkv))


_KERNEL_SHAPES = dict(n=2, k=2, h=128, hv=128)  # what the backward kernels take, in bf16
CASES = {  # (make_case arguments, kv_block_sizes form, dtype, backward on the kernels)
    "block 128, sizes per batch row": (dict(sq=300, skv=400, bs=128, **_KERNEL_SHAPES),
                                       "batch", "bfloat16", True),
    "block 64, Sq not a multiple of 64": (dict(sq=100, skv=150, bs=64, **_KERNEL_SHAPES),
                                          None, "bfloat16", True),
    "gqa, sizes per kv head": (dict(sq=130, skv=200, n=4, k=2, h=16, hv=16, bs=64),
                               "per_head", "float32", False),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("lse_grad", [False, True])
def test_values_and_gradients_match_float64(emulated, name, lse_grad):
  emulated("bsa", "cudnn")
  kwargs, form, dtype, on_kernels = CASES[name]
  rng = np.random.default_rng(3)
  q, k, v, index, counts = make_case(rng, **kwargs)
  q, k, v = (np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (q, k, v))
  b, sq, n, _ = q.shape
  skv, kh, hv, bs = k.shape[1], k.shape[2], v.shape[3], kwargs["bs"]
  passed, sizes = _sizes(rng, form, b, kh, -(-skv // bs), bs)
  full = full_sizes(b, kh, skv, bs)
  sizes = full if sizes is None else np.minimum(full, sizes)
  d_out = rng.standard_normal((b, sq, n, hv)).astype(np.float32)
  d_lse = rng.standard_normal((b, n, sq)).astype(np.float32) if lse_grad else None
  call = functools.partial(cudnn_jax.bsa, block_size=bs, kv_block_sizes=passed,
                           return_lse=True)

  def loss(q, k, v):
    out, lse = call(q, k, v, index, counts)
    total = jnp.sum(out.astype(jnp.float32) * d_out)
    if lse_grad:
      total += jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * d_lse)
    return total, (out, lse)

  grad = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
  arrays = [jnp.asarray(x, dtype) for x in (q, k, v)]
  # Without an lse cotangent the backward is the kernels' alone; with one, a branch on the
  # device picks the other engine's gradients when it is not all zero.
  assert ("cudnn_jax_bsa_bwd" in str(jax.make_jaxpr(grad)(*arrays))) == on_kernels
  grads, (out, lse) = jax.jit(grad)(*arrays)
  mask = token_mask(index, counts, sizes, sq, skv, bs, group=n // kh)
  want_out, want_lse = oracle(q, k, v, mask=mask)
  tol = TOL[dtype]
  assert rel_err(np.asarray(out, np.float32), want_out) <= tol
  assert rel_err(lse, want_lse) <= tol
  want = oracle_vjp(q, k, v, mask=mask, d_out=d_out, d_lse=d_lse)
  for got, key in zip(grads, ("query", "key", "value")):
    assert rel_err(np.asarray(got, np.float32), want[key]) <= 5 * tol, key


def test_compaction_drops_skipped_entries_in_order():
  index = jnp.asarray([[[[3, -1, 9, 1, 0, 2]]]], jnp.int32)  # Nkv = 4: -1 and 9 skipped
  counts = jnp.asarray([[[5]]], jnp.int32)  # the 2 past the count is never read
  sizes = jnp.asarray([[[5, 0, 5, 5]]], jnp.int32)  # block 1 is empty
  got, n = cudnn_bsa.compacted(index, counts, sizes, 4)
  assert n.tolist() == [[[2]]]
  assert got.tolist() == [[[[3, 0, 0, 0, 0, 0]]]]


def test_backward_reasons_name_what_the_kernels_lack():
  q, k, v, index, counts = make_case(np.random.default_rng(0), n=4, k=2, h=128, hv=128)
  prepare = functools.partial(ops._prepare, block_size=16)  # pylint: disable=protected-access
  bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)
  call = prepare(bf16(q), bf16(k), bf16(v), index, counts)[0]
  assert "equal head counts" in cudnn_bsa.backward_reason(call)
  assert "bfloat16" in cudnn_bsa.backward_reason(prepare(q, k, v, index, counts)[0])
  call = prepare(bf16(q), bf16(k), bf16(v), index, counts,
                 kv_block_sizes=np.full((2, 2, 10), 16, np.int32))[0]
  assert call.kv_sizes == "per_head"


def test_nothing_to_attend(emulated):
  emulated("bsa", "cudnn")
  q = jnp.ones((1, 8, 2, 16))
  kv = jnp.ones((1, 0, 2, 16))
  out, lse = cudnn_jax.bsa(q, kv, kv, jnp.zeros((1, 2, 1, 0), jnp.int32), return_lse=True)
  assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))


def test_declines_off_hopper_with_the_reason():
  q, k, v, index, counts = make_case(np.random.default_rng(0))
  text = cudnn_jax.explain("bsa", q, k, v, index, counts, block_size=16,
                           implementation="cudnn")
  assert "cudnn: declines" in text


def test_under_vmap_matches_a_loop(emulated):
  """vmap folds into the primitives' batch: values and gradients as one call per entry."""
  emulated("bsa", "cudnn")
  rng = np.random.default_rng(4)
  cases = [make_case(rng, b=1, sq=100, skv=150, bs=64, **_KERNEL_SHAPES) for _ in range(3)]
  q, k, v, index, counts = (jnp.stack([jnp.asarray(c[i]) for c in cases]) for i in range(5))
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  loss = lambda q, k, v, i, c: jnp.sum(cudnn_jax.bsa(q, k, v, i, c, block_size=64).astype(
      jnp.float32) ** 2)
  grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
  batched = jax.jit(jax.vmap(grad))(q, k, v, index, counts)
  for j in range(len(cases)):
    one = jax.jit(grad)(q[j], k[j], v[j], index[j], counts[j])
    for got, want in zip(jax.tree.leaves(batched), jax.tree.leaves(one)):
      np.testing.assert_array_equal(np.asarray(got[j], np.float32), np.asarray(want, np.float32))
