"""Programs that use cudnn_jax ops survive jax.export: export, serialize, deserialize,
call, and the same results as the jitted program, on one device and on a sharded mesh.

The sharded cases are the ones plain ``jax.export`` cannot serialize (our per-shard
primitives lower through custom_partitioning, a Python callback); ``cudnn_jax.export``
traces them without it. GPU engines (their FFI targets, Pallas's Triton call) are covered
by ``disabled_checks``, derived from the targets the extension registers.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cudnn_jax
import cudnn_jax.export
from cudnn_jax import _extension
from cudnn_jax.primitives import core


def _round_trip(fn, *args, platforms=None):
  exported = cudnn_jax.export.export(fn, platforms=platforms)(*args)
  restored = jax.export.deserialize(exported.serialize())
  return exported, restored


def _qkv(b=2, t=32, n=4, k=2, h=16, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(ks[0], (b, t, n, h), dtype),
          jax.random.normal(ks[1], (b, t, k, h), dtype),
          jax.random.normal(ks[2], (b, t, k, h), dtype))


def test_single_device_round_trip_with_gradients():
  q, k, v = _qkv()

  def fn(q, k, v):
    loss = lambda q, k, v: cudnn_jax.sdpa(q, k, v, is_causal=True).sum()
    return cudnn_jax.sdpa(q, k, v, is_causal=True), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  _, restored = _round_trip(fn, q, k, v)
  got, want = restored.call(q, k, v), jax.jit(fn)(q, k, v)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), got, want)


def test_exports_for_cpu_and_cuda_at_once():
  """Lowering for the GPU needs no GPU: the program carries both platforms."""
  q, k, v = _qkv()
  fn = lambda q, k, v: cudnn_jax.sdpa(q, k, v, is_causal=True)
  exported, restored = _round_trip(fn, q, k, v, platforms=["cpu", "cuda"])
  assert exported.platforms == ("cpu", "cuda")
  np.testing.assert_allclose(restored.call(q, k, v), jax.jit(fn)(q, k, v), rtol=1e-6)


def _mesh():
  return jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


@pytest.mark.parametrize("op", ["bsa", "kda", "moe_mlp"])
def test_sharded_round_trip(op):
  """Batch- (and head-) sharded inputs of ops that run per shard through custom
  partitioning: the export serializes and runs on the same mesh, equal to the jitted
  program."""
  mesh = _mesh()
  if op == "bsa":
    q, k, v = _qkv(b=4, t=64, n=2, k=2)
    mask = jax.random.bernoulli(jax.random.key(1), 0.5, (4, 2, 1, 1)) | True
    index, counts = cudnn_jax.bsa_from_mask(jnp.broadcast_to(mask, (4, 2, 1, 1)))
    fn = lambda q, k, v, i, c: cudnn_jax.bsa(q, k, v, i, c, block_size=64, is_causal=True)
    args = (q, k, v, index, counts)
    specs = (P("data", None, "model"),) * 3 + (P("data", "model"),) * 2
  elif op == "kda":
    ks = jax.random.split(jax.random.key(2), 5)
    b, t, h, d = 4, 32, 2, 8
    q, k, v = (jax.random.normal(x, (b, t, h, d)) for x in ks[:3])
    g = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, h, d)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h)))
    fn = lambda q, k, v, g, beta: cudnn_jax.kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    args = (q, k, v, g, beta)
    specs = (P("data", None, "model"),) * 4 + (P("data", None, "model"),)
  else:
    ks = jax.random.split(jax.random.key(3), 5)
    t, d, f, e = 64, 8, 16, 4
    x = jax.random.normal(ks[0], (t, d))
    idx = jax.random.randint(ks[1], (t, 2), 0, e, jnp.int32)
    w = jax.nn.softmax(jax.random.normal(ks[2], (t, 2)), -1)
    up, down = jax.random.normal(ks[3], (e, d, 2 * f)) / 3, jax.random.normal(ks[4], (e, f, d)) / 4
    fn = lambda x, i, w, u, dn: cudnn_jax.moe_mlp(x, i, w, u, dn)
    args = (x, idx, w, up, down)
    specs = (P("data"),) * 3 + (P(),) * 2
  args = tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs))
  want = jax.jit(fn)(*args)
  exported, restored = _round_trip(fn, *args)
  assert exported.nr_devices == 8
  got = restored.call(*args)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert got.sharding.is_equivalent_to(want.sharding, got.ndim)


def test_export_scope_is_left_afterwards():
  q, k, v = _qkv()
  cudnn_jax.export.export(lambda q: cudnn_jax.sdpa(q, k, v))(q)
  assert not core.exporting()


def test_disabled_checks_cover_every_registered_target():
  targets = cudnn_jax.export.custom_call_targets()
  assert set(_extension.handler_attributes()) <= set(targets)
  assert "__gpu$xla.gpu.triton" in targets
  checks = cudnn_jax.export.disabled_checks()
  assert len(checks) == len(targets)
  if _extension.module() is not None:  # the extension registers the cuDNN / CuTe targets
    assert "cudnn_jax_sdpa_fwd" in targets and "cudnn_jax_cute_grouped_gemm" in targets


@pytest.mark.skipif(jax.default_backend() != "gpu" or _extension.unavailable_reason() is not None,
                    reason="needs a GPU and the extension")
def test_gpu_round_trip_with_custom_calls():
  """On a GPU the program contains our FFI calls: exported with the disabled checks."""
  q, k, v = _qkv(dtype=jnp.bfloat16, h=64)
  fn = lambda q, k, v: cudnn_jax.sdpa(q, k, v, is_causal=True)
  exported, restored = _round_trip(fn, q, k, v)
  assert "cudnn_jax_sdpa_fwd" in exported.mlir_module()
  np.testing.assert_allclose(np.asarray(restored.call(q, k, v), np.float32),
                             np.asarray(jax.jit(fn)(q, k, v), np.float32), rtol=2e-2, atol=2e-2)
