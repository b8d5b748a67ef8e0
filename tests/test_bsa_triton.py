"""The "triton" engine of cudnn_jax.bsa (cudnn_jax/triton/bsa*.py), its kernels run by the
Pallas interpreter on any backend: through cudnn_jax.bsa against the float64 oracle of
sdpa with the equivalent token-level mask (values, lse and gradients; both block sizes,
GQA, partial and empty kv blocks, causal, skipped entries, rows with no key), under vmap
and on batch- and head-sharded meshes; its block lists against NumPy; its verdicts; and
lowered to Triton for an sm_90 GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cudnn_jax
from cudnn_jax import engines
from cudnn_jax.ops import bsa as ops_bsa
from cudnn_jax.triton import bsa as triton_bsa
from mesh_cases import assert_no_collectives, mesh_or_skip
from sdpa_oracle import oracle, oracle_vjp, rel_err_finite as rel_err
from test_bsa import full_sizes, make_case, token_mask
from triton_lowering import sm90_export

F32_TOL = 2e-5  # ||a - b|| / ||b||
GRAD_TOL = 1e-4


@pytest.fixture
def interpreted():
  """The triton engine with its kernels in the Pallas interpreter, on any backend."""
  original = engines.engine("bsa", "triton")
  engines.register_engine(
      "bsa", "triton", opt_in=True,
      supports=lambda c: triton_bsa.supports(c.block_size, c.h, c.hv, c.dtype, interpret=True),
      run=functools.partial(ops_bsa._run_triton, interpret=True))  # pylint: disable=protected-access
  yield
  engines.register_engine("bsa", "triton", supports=original.supports, run=original.run,
                          opt_in=original.opt_in)


def sized_case(rng, bs, *, b=1, sq, skv, n=4, k=2, hv=64, kmax=3, dtype=np.float32):
  """``make_case`` at H=64 with random kv block sizes (0 and past the block included):
  ``(args, kv_block_sizes, mask)``, mask the equivalent ``[B,N,Sq,Skv]`` token mask."""
  q, kk, v, index, counts = make_case(rng, b=b, sq=sq, skv=skv, n=n, k=k, h=64, hv=hv, bs=bs,
                                      kmax=kmax)
  nkv = -(-skv // bs)
  kv_block_sizes = rng.integers(0, bs + 8, (b, k, nkv)).astype(np.int32)
  kv_block_sizes[:, :, 0] = bs  # a full block too
  sizes = np.minimum(kv_block_sizes, full_sizes(b, k, skv, bs))
  mask = token_mask(index, counts, sizes, sq, skv, bs, group=n // k)
  args = tuple(x.astype(dtype) for x in (q, kk, v)) + (index, counts)
  return args, kv_block_sizes, mask


# Query and key lengths that are not multiples of the block (a partial last block each).
LENGTHS = {64: (150, 200), 128: (200, 300)}


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("bs", [64, 128])
def test_matches_the_masked_oracle(bs, is_causal, interpreted):
  """Output, lse and the gradients of query, key and value (through out and lse) against
  float64, with GQA, partial blocks, skipped entries and rows that keep no key."""
  del interpreted
  rng = np.random.default_rng(bs + is_causal)
  sq, skv = LENGTHS[bs]
  args, kv_block_sizes, mask = sized_case(rng, bs, b=2 if bs == 64 else 1, sq=sq, skv=skv)
  fn = functools.partial(cudnn_jax.bsa, block_size=bs, kv_block_sizes=kv_block_sizes,
                         is_causal=is_causal, return_lse=True, implementation="triton")
  out, lse = jax.jit(fn)(*args)
  want_out, want_lse = oracle(*args[:3], mask=mask, is_causal=is_causal)
  assert rel_err(out, want_out) <= F32_TOL
  assert rel_err(lse, want_lse) <= F32_TOL
  empty = ~np.isfinite(want_lse)
  assert np.any(empty) and np.all(np.asarray(out).transpose(0, 2, 1, 3)[empty] == 0)

  d_out = rng.standard_normal(out.shape).astype(np.float32)
  d_lse = np.where(empty, 0, rng.standard_normal(lse.shape)).astype(np.float32)

  def loss(q, k, v):
    o, l = fn(q, k, v, *args[3:])
    return jnp.sum(o * d_out) + jnp.sum(jnp.where(jnp.isfinite(l), l, 0) * d_lse)

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args[:3])
  want = oracle_vjp(*args[:3], mask=mask, is_causal=is_causal, d_out=d_out, d_lse=d_lse)
  for name, g in zip(("query", "key", "value"), grads):
    assert rel_err(g, want[name]) <= GRAD_TOL, name


def test_bfloat16_and_wide_values(interpreted):
  """bfloat16 inputs, Hv = 128 beside H = 64, a causal selection over four kv blocks, whole
  query blocks: out and gradients within bfloat16 accuracy of float64 on the same (rounded)
  inputs."""
  del interpreted
  rng = np.random.default_rng(7)
  args, kv_block_sizes, mask = sized_case(rng, 64, sq=256, skv=250, n=4, k=1, hv=128,
                                          kmax=4)
  args = tuple(jnp.asarray(x, jnp.bfloat16) for x in args[:3]) + args[3:]
  fn = functools.partial(cudnn_jax.bsa, block_size=64, kv_block_sizes=kv_block_sizes,
                         is_causal=True, implementation="triton")
  d_out = rng.standard_normal((1, 256, 4, 128)).astype(np.float32)
  out, pull = jax.vjp(lambda *x: fn(*x, *args[3:]), *args[:3])
  grads = pull(jnp.asarray(d_out, jnp.bfloat16))
  f32 = [np.asarray(x, np.float32) for x in args[:3]]
  assert out.dtype == jnp.bfloat16
  assert rel_err(out, oracle(*f32, mask=mask, is_causal=True)[0]) <= 1e-2
  want = oracle_vjp(*f32, mask=mask, is_causal=True, d_out=d_out)
  for name, g in zip(("query", "key", "value"), grads):
    assert g.dtype == jnp.bfloat16
    assert rel_err(g, want[name]) <= 2e-2, name


@pytest.mark.parametrize("b,sq,skv,n,width", [(1, 0, 70, 2, 2), (1, 70, 0, 2, 2),
                                               (1, 70, 70, 2, 0), (0, 70, 70, 2, 2),
                                               (1, 70, 70, 0, 2)])
def test_nothing_to_attend(b, sq, skv, n, width, interpreted):
  """No query, key, batch row or head, or empty lists: out 0, lse -inf, gradients 0."""
  del interpreted
  q, k, v = (jnp.ones((b, s, heads, 64)) for s, heads in ((sq, n), (skv, 1), (skv, 1)))
  index = jnp.zeros((b, n, -(-sq // 64), width), jnp.int32)
  fn = functools.partial(cudnn_jax.bsa, block_size=64, return_lse=True,
                         implementation="triton")
  out, lse = fn(q, k, v, index)
  assert np.all(out == 0) and np.all(lse == -np.inf)
  grads = jax.grad(lambda *a: jnp.sum(fn(*a, index)[0]), argnums=(0, 1, 2))(q, k, v)
  assert all(np.all(g == 0) for g in grads)


def test_invalid_metadata_as_on_xla(interpreted):
  """Indices outside [0, Nkv), counts outside [0, Kmax] and kv block sizes outside
  [0, block_size] get the xla engine's answer (the defined result, SPEC section 8)."""
  del interpreted
  rng = np.random.default_rng(9)
  args, _, _ = sized_case(rng, 64, sq=130, skv=130, n=2, k=1, kmax=3)
  index, counts = args[3], rng.integers(-3, 7, args[4].shape).astype(np.int32)
  index[0, :, :, 0] = [[-5, 3, 1 << 30], [9, -(1 << 30), -1]]
  sizes = np.array([-4, 80, 40], np.int32)
  fn = lambda engine: jax.jit(functools.partial(
      cudnn_jax.bsa, block_size=64, is_causal=True, return_lse=True,
      implementation=engine))(*args[:3], index, counts, kv_block_sizes=sizes)
  (out, lse), (want_out, want_lse) = fn("triton"), fn("xla")
  assert np.any(lse == -np.inf) and np.any(np.isfinite(lse))
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_block_lists_match_numpy():
  """``schedule`` keeps, in the caller's order, exactly the listed kv blocks that can hold a
  kept key; ``by_kv_block`` lists, for each kv block, the query rows that keep it."""
  rng = np.random.default_rng(3)
  b, n, kv_heads, nq, nkv, width = 2, 6, 2, 5, 7, 4
  index = np.stack([rng.choice(np.arange(-2, nkv + 2), width, replace=False)
                    for _ in range(b * n * nq)]).reshape(b, n, nq, width).astype(np.int32)
  counts = rng.integers(0, width + 2, (b, n, nq)).astype(np.int32)
  sizes = rng.integers(0, 3, (b, kv_heads, nkv)).astype(np.int32)
  group = n // kv_heads
  for causal in (False, True):
    blocks, kept = map(np.asarray, triton_bsa.schedule(index, counts, sizes, causal=causal))
    rows = {}
    for i, h, m in np.ndindex(b, n, nq):
      want = [c for c in index[i, h, m, :counts[i, h, m]] if 0 <= c < nkv
              and sizes[i, h // group, c] > 0 and (not causal or c <= m)]
      assert list(blocks[i, h, m, :kept[i, h, m]]) == want
      for c in want:
        rows.setdefault((i, h // group, c), []).append(h * nq + m)
    pairs, starts, totals = map(np.asarray, triton_bsa.by_kv_block(blocks, kept, kv_heads,
                                                                    nkv))
    for i, kh, c in np.ndindex(b, kv_heads, nkv):
      got = pairs[i, starts[i, kh, c]:starts[i, kh, c] + totals[i, kh, c]]
      assert list(got) == rows.get((i, kh, c), [])


def test_under_vmap_matches_a_loop(interpreted):
  del interpreted
  rng = np.random.default_rng(4)
  cases = [sized_case(rng, 64, sq=100, skv=130, k=1)[0] for _ in range(2)]
  stacked = [np.stack(xs) for xs in zip(*cases)]
  fn = functools.partial(cudnn_jax.bsa, block_size=64, is_causal=True, implementation="triton")
  out = jax.jit(jax.vmap(fn))(*stacked)
  for i, case in enumerate(cases):
    np.testing.assert_allclose(out[i], fn(*case), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_batch_and_head_sharded_stays_local(axis_type, interpreted):
  """Batch- and head-sharded inputs: each device runs the kernels on its shard (same
  results and gradients, no data movement between devices)."""
  del interpreted
  mesh = mesh_or_skip((4, 2), ("b", "h"), axis_type)
  args, _, _ = sized_case(np.random.default_rng(5), 64, b=4, sq=70, skv=90, kmax=2)
  fn = functools.partial(cudnn_jax.bsa, block_size=64, is_causal=True, implementation="triton")
  loss = lambda *a: jnp.sum(fn(*a) ** 2)
  want_out = fn(*args)
  want_grads = jax.grad(loss, argnums=(0, 1, 2))(*args)
  with jax.set_mesh(mesh):
    tokens, rows = P("b", None, "h"), P("b", "h")
    sharded = [jax.device_put(x, NamedSharding(mesh, s))
               for x, s in zip(args, (tokens, tokens, tokens, rows, rows))]
    fwd, grad = jax.jit(fn), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    out = fwd(*sharded)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, tokens), out.ndim)
    np.testing.assert_allclose(out, want_out, rtol=1e-6, atol=1e-6)
    for g, w in zip(grad(*sharded), want_grads):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    for f in (fwd, grad):
      assert_no_collectives(f, *sharded)


def test_verdicts(monkeypatch):
  """Opt-in, GPU only, and the sizes the kernels take, each decline with its reason."""
  q, k, v, index, counts = make_case(np.random.default_rng(6), sq=128, skv=128, h=64, hv=64,
                                     bs=64)
  if jax.default_backend() != "gpu":
    assert "triton: declines: default backend" in cudnn_jax.explain(
        "bsa", q, k, v, index, counts, block_size=64, implementation=("triton", "xla"))
    with pytest.raises(cudnn_jax.UnsupportedError, match="triton: default backend"):
      cudnn_jax.bsa(q, k, v, index, counts, block_size=64, implementation="triton")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  explain = functools.partial(cudnn_jax.explain, "bsa", q, k, v, index, counts)
  assert "'xla' serves" in explain(block_size=64)
  assert "triton: declines: opt-in engine" in explain(block_size=64)
  assert "'triton' serves" in explain(block_size=64, implementation="triton")
  for why, size, kw in (("block_size=32: the kernels take (64, 128)", 32, {}),
                        ("head dims H=32, Hv=64", 64, dict(h=32))):
    case = make_case(np.random.default_rng(6), sq=128, skv=128, **{"h": 64, "hv": 64, **kw},
                     bs=size)
    text = cudnn_jax.explain("bsa", *case, block_size=size, implementation="triton")
    assert f"triton: declines: {why}" in text
  assert "dtype float64" in triton_bsa.supports(64, 64, 64, "float64")
  assert "shared memory" in triton_bsa.supports(128, 64, 128, "float32")
  assert triton_bsa.supports(128, 64, 128, "float32", interpret=True) is None
  assert triton_bsa.supports(64, 128, 128, "float32") is None


def test_kernels_lower_to_triton_for_sm90():
  """The Pallas-to-Triton lowering (what XLA compiles on the GPU) of the forward and both
  backward kernels succeeds without a GPU, for both block sizes and head dims 64 and 128."""
  with sm90_export() as export:
    modules = []
    for bs, h, hv in ((64, 128, 64), (128, 64, 128)):
      b, sq, skv, n, kh, width = 1, 1000, 1100, 4, 2, 5
      nq, nkv = -(-sq // bs), -(-skv // bs)
      s = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)
      fn = functools.partial(triton_bsa.bsa, block_size=bs, scale=0.1, is_causal=True)
      loss = lambda q, k, v, *rest: jnp.sum(fn(q, k, v, *rest)[0].astype(jnp.float32))
      modules.append(export(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))))(
          s(b, sq, n, h), s(b, skv, kh, h), s(b, skv, kh, hv), s(b, n, nq, width, dt=jnp.int32),
          s(b, n, nq, dt=jnp.int32), s(b, kh, nkv, dt=jnp.int32)).mlir_module())
  for text in modules:
    assert text.count("xla.gpu.triton") == 3  # forward, dq, dk/dv
