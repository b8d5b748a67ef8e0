"""The Pallas kernels of the kda "triton" engine (cudnn_jax/triton/), run by the Pallas
interpreter on any backend, alone against float64 NumPy and inside the whole op (values and
gradients) against the xla engine, and lowered to Triton for an sm_90 GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cudnn_jax
from cudnn_jax.triton import kda_chunks, kda_intra, kda_pairs, kda_scan
from cudnn_jax.reference import kda as ref
from kda_cases import check_intra_kernel

leaves_interpreted = ref.PairLeaves(fwd=functools.partial(kda_pairs.pairs, interpret=True),
                                    bwd=functools.partial(kda_pairs.pairs_bwd, interpret=True))
# The kernels in the interpreter: the scan with the pair leaves, or with the preprocessing
# and the whole intra-chunk stage.
with_leaves = ref.FusedKernels(
    scan_output=functools.partial(kda_scan.scan_output, interpret=True),
    scan_bwd=functools.partial(kda_scan.scan_bwd, interpret=True),
    pair_leaves=leaves_interpreted)
with_intra = with_leaves._replace(intra=functools.partial(kda_intra.intra, interpret=True),
                                  chunks=functools.partial(kda_chunks.chunks, interpret=True))


@pytest.mark.parametrize("n,kd", [(16, 8), (8, 32)])
def test_pair_leaves_match_float64(n, kd):
  """M_ts = sum_k x_t y_s e^{G_t - G_s} (s < t) and its gradients, against float64 NumPy,
  with gates that span e^-40 within a sub-block (the exponents never overflow)."""
  rng = np.random.default_rng(n)
  lead = (3, 2)
  x, y = (rng.standard_normal(lead + (n, kd)) for _ in range(2))
  G = np.cumsum(-5.0 * rng.random(lead + (n, kd)), -2)
  dM = rng.standard_normal(lead + (n, n))
  decay = np.exp(G[..., :, None, :] - G[..., None, :, :]) * np.tril(np.ones((n, n)), -1)[
      :, :, None]
  want = np.einsum("...tk,...sk,...tsk->...ts", x, y, decay)
  want_dx = np.einsum("...ts,...sk,...tsk->...tk", dM, y, decay)
  want_dy = np.einsum("...ts,...tk,...tsk->...sk", dM, x, decay)
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  got = leaves_interpreted.fwd(f32(x), f32(y), f32(G))
  got_dx, got_dy = leaves_interpreted.bwd(f32(dM), f32(x), f32(y), f32(G))
  for g_, w_ in ((got, want), (got_dx, want_dx), (got_dy, want_dy)):
    np.testing.assert_allclose(g_, w_, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("span_limit", [None, kda_intra.SPAN_LIMIT, 80.0])
@pytest.mark.parametrize("c,steep", [(64, False), (64, True), (16, False)])
@pytest.mark.parametrize("dt", [jnp.float32, jnp.bfloat16])
def test_intra_kernel_matches_reference(c, steep, dt, span_limit):
  """The intra-chunk kernel, interpreted, against the reference's stage: pairs inside
  sub-blocks summed directly (None), as products where the gates allow (steep gates span
  about 40-60 over a sub-block: both ways), or as products with factors up to e^80."""
  check_intra_kernel(functools.partial(kda_intra.intra, interpret=True, span_limit=span_limit),
                     c, 32, 16, dt, steep)


@pytest.mark.parametrize("l2norm_qk", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kg", [1, 16])
def test_chunks_kernel_matches_reference(kg, dtype, l2norm_qk):
  """The preprocessing kernel, interpreted, against ``reference.kda.to_chunks``: two value
  heads per q/k head, a partial last chunk, per-channel and scalar gates; gradients too."""
  rng = np.random.default_rng(kg)
  b, t, h, hv, kd, vd, c = 2, 40, 1, 2, 16, 8, 16
  x = lambda *s, dt=jnp.float32: jnp.asarray(rng.standard_normal(s), dt)
  args = (x(b, t, h, kd, dt=dtype), x(b, t, h, kd, dt=dtype), x(b, t, hv, vd, dt=dtype),
          -jnp.abs(x(b, t, hv, kg)), x(b, t, hv, 1))
  static = (0.3, l2norm_qk, c)
  kernel = lambda *a: kda_chunks.chunks(*a, *static, interpret=True)
  got, want = kernel(*args), ref.to_chunks(*args, *static)
  for g_, w_ in zip(got, want):
    assert g_.shape == w_.shape and g_.dtype == jnp.float32
    np.testing.assert_allclose(g_, w_, rtol=1e-6, atol=1e-6)
  cts = tuple(x(*w_.shape) for w_ in want)
  got_grads = jax.vjp(kernel, *args)[1](cts)
  want_grads = jax.vjp(lambda *a: ref.to_chunks(*a, *static), *args)[1](cts)
  for g_, w_ in zip(got_grads, want_grads):
    np.testing.assert_array_equal(g_, w_)


@pytest.mark.parametrize("fused", [with_leaves, with_intra], ids=["leaves", "intra"])
@pytest.mark.parametrize("vd", [8, 128])  # one value block, and two
def test_engine_with_kernels_matches_xla_engine(vd, fused):
  """The op with the kernels against the xla engine: output, final state, and gradients
  of every differentiable input, with a partial last chunk; the forward pass alone too."""
  rng = np.random.default_rng(1)
  b, t, h, kd = 2, 80, 2, 16
  f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  q, k, v = f32(b, t, h, kd), f32(b, t, h, kd), f32(b, t, h, vd)
  g, beta = f32(b, t, h, kd), f32(b, t, h)
  a_log, init = 0.5 * f32(h), f32(b, h, kd, vd)
  kw = dict(scale=kd ** -0.5, qk_l2norm=True, gate_in_kernel=True, a_log=a_log,
            beta_sigmoid=True, initial_state=init)
  w_o, w_f = f32(b, t, h, vd), f32(b, h, kd, vd)

  def loss(fused, q, k, v, g, beta):
    o, final = ref.kda(q, k, v, g, beta, fused=fused, **kw)
    return jnp.sum(o * w_o) + jnp.sum(final * w_f)

  args = (q, k, v, g, beta)
  grad = jax.value_and_grad(loss, argnums=(1, 2, 3, 4, 5))
  got, want = grad(fused, *args), grad(None, *args)
  got += ref.kda(*args, fused=fused, **kw),  # not differentiated: no states written
  want += ref.kda(*args, **kw),
  for g_, w_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g_, w_, rtol=1e-4, atol=1e-4)


def test_fused_engine_declines_off_gpu():
  if jax.default_backend() == "gpu":
    pytest.skip("on a GPU the engine serves")
  q = jnp.ones((1, 16, 1, 8), jnp.float32)
  with pytest.raises(cudnn_jax.UnsupportedError, match="triton: default backend"):
    cudnn_jax.kda(q, q, q, -jnp.ones((1, 16, 1, 8)), jnp.ones((1, 16, 1)),
                  implementation="triton")


def test_kernels_lower_to_triton_for_sm90():
  """The Pallas-to-Triton lowering (what XLA compiles on the GPU) succeeds without a GPU,
  at K = V = 128 and a chunk count that is not a power of two."""
  try:
    from jax._src.pallas.triton import pallas_call_registration as registration  # pylint: disable=g-import-not-at-top
  except ImportError:
    pytest.skip("this JAX has no Pallas Triton backend")

  class _Sm90:
    compute_capability = "9.0"

  original = registration.gpu_info_lib.get_gpu_info
  registration.gpu_info_lib.get_gpu_info = lambda: _Sm90()
  try:
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    export = functools.partial(
        jax.export.export, platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])
    nc, b, hv, c, d = 13, 2, 3, 64, 128
    scan, scan_alone = (export(jax.jit(functools.partial(kda_scan.scan_output, with_states=x)))(
        s(nc, b, hv, c, d), s(nc, b, hv, c, d), s(nc, b, hv, c, d), s(nc, b, hv, d),
        s(nc, b, hv, c, d), s(nc, b, hv, c, c), s(b, hv, d, d)) for x in (True, False))
    scan_bwd = export(jax.jit(kda_scan.scan_bwd))(
        s(nc, b, hv, c, d), s(nc, b, hv, c, d), s(nc, b, hv, c, d), s(nc, b, hv, c, d),
        s(nc, b, hv, d), s(nc, b, hv, c, c), s(b, hv, d, d))
    block = s(nc, b, hv, c // 16, 16, d)
    pairs = export(kda_pairs.pairs)(block, block, block)
    pairs_bwd = export(kda_pairs.pairs_bwd)(s(nc, b, hv, c // 16, 16, 16), block, block, block)
    chunk = s(nc, b, hv, c, d)
    bf16 = jnp.dtype(jnp.bfloat16)
    beta = s(nc, b, hv, c, 1)
    intra = export(jax.jit(functools.partial(kda_intra.intra, dt=bf16)))(
        chunk, chunk, chunk, chunk, beta)
    tokens = lambda heads, dt=jnp.float32: jax.ShapeDtypeStruct((b, nc * c - 5, heads, d), dt)
    chunks = export(jax.jit(lambda *x: kda_chunks.chunks(*x, 0.1, True, c)))(
        tokens(1, bf16), tokens(1, bf16), tokens(hv, bf16), tokens(hv),
        s(b, nc * c - 5, hv, 1))
  finally:
    registration.gpu_info_lib.get_gpu_info = original
  for exported in (scan, scan_alone, scan_bwd, pairs, pairs_bwd, intra, chunks):
    assert "xla.gpu.triton" in exported.mlir_module()


def test_scan_tiling_by_program_count():
  # (bv, warps, stages): 64 value columns per program while B x HV x V/64 fills an H200's
  # SMs, else 32; what the caller names wins.
  assert kda_scan._tiling(8, 16, 128, None, None, None, True) == (64, 4, 1)
  assert kda_scan._tiling(2, 16, 128, None, None, None, True) == (32, 4, 2)
  assert kda_scan._tiling(2, 16, 128, None, None, None, False) == (32, 4, 1)
  assert kda_scan._tiling(2, 16, 128, 16, 8, None, False) == (16, 8, 1)
  assert kda_scan._tiling(1, 1, 16, None, None, None, True) == (64, 4, 1)  # one block of 16
