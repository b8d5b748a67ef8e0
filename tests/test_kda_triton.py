"""The Pallas kernels of the kda "triton" engine (cudnn_jax/triton/), run by the Pallas
interpreter on any backend, alone against float64 NumPy and inside the whole engine (values
and gradients) against the xla engine, and lowered to Triton for an sm_90 GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cudnn_jax
from cudnn_jax.triton import kda as triton_kda
from cudnn_jax.triton import kda_intra, kda_scan
from cudnn_jax.reference import kda as ref
from kda_cases import check_intra_kernel
from triton_lowering import sm90_export


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
  got = kda_intra.pairs(f32(x), f32(y), f32(G), interpret=True)
  got_dx, got_dy = kda_intra.pairs_bwd(f32(dM), f32(x), f32(y), f32(G), interpret=True)
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
  kernel = lambda *a: kda_scan.chunks(*a, *static, interpret=True)
  got, want = kernel(*args), ref.to_chunks(*args, *static)
  for g_, w_ in zip(got, want):
    assert g_.shape == w_.shape and g_.dtype == jnp.float32
    np.testing.assert_allclose(g_, w_, rtol=1e-6, atol=1e-6)
  cts = tuple(x(*w_.shape) for w_ in want)
  got_grads = jax.vjp(kernel, *args)[1](cts)
  want_grads = jax.vjp(lambda *a: ref.to_chunks(*a, *static), *args)[1](cts)
  for g_, w_ in zip(got_grads, want_grads):
    np.testing.assert_array_equal(g_, w_)


# The backward's pair sums: by 16-token sub-blocks while the gates allow (gentle gates
# here), else by the hierarchy with its leaves as kernels (kda_intra.py; forced by a span
# limit of 0).
@pytest.mark.parametrize("span_limit", [ref.SPAN_LIMIT, 0.0], ids=["sub_blocks", "hierarchy"])
@pytest.mark.parametrize("vd", [8, 128])  # one value block, and two
def test_engine_matches_xla_engine(vd, span_limit, monkeypatch):
  """The triton engine, its kernels interpreted, against the xla engine: output, final
  state, and gradients of every differentiable input, with a partial last chunk; the
  forward pass alone too."""
  monkeypatch.setattr(ref, "SPAN_LIMIT", span_limit)
  rng = np.random.default_rng(1)
  b, t, h, kd = 2, 80, 2, 16
  f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  q, k, v = f32(b, t, h, kd), f32(b, t, h, kd), f32(b, t, h, vd)
  g, beta = f32(b, t, h, kd), f32(b, t, h)
  a_log, init = 0.5 * f32(h), f32(b, h, kd, vd)
  kw = dict(scale=kd ** -0.5, qk_l2norm=True, gate_in_kernel=True, a_log=a_log,
            beta_sigmoid=True, initial_state=init)
  w_o, w_f = f32(b, t, h, vd), f32(b, h, kd, vd)
  engines = dict(triton=functools.partial(triton_kda.kda, interpret=True), xla=ref.kda)

  def loss(engine, q, k, v, g, beta):
    o, final = engines[engine](q, k, v, g, beta, **kw)
    return jnp.sum(o * w_o) + jnp.sum(final * w_f)

  args = (q, k, v, g, beta)
  grad = jax.value_and_grad(loss, argnums=(1, 2, 3, 4, 5))
  got, want = grad("triton", *args), grad("xla", *args)
  got += engines["triton"](*args, **kw),  # not differentiated: no states written
  want += ref.kda(*args, **kw),
  for g_, w_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g_, w_, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("op", ["kda", "gdn"])
def test_engine_packed_sequences_and_scalar_gate(op):
  """Packed sequences (the reference's scans around the kernels) and gdn's scalar gate
  (broadcast over the key channels), values and gradients, against the xla engine."""
  rng = np.random.default_rng(2)
  t, h, kd, vd = 70, 2, 16, 16
  f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  gate_dims = (kd,) if op == "kda" else (1,)
  cu = jnp.asarray([0, 5, 5, 50, t], jnp.int32)
  q, k, v = f32(1, t, h, kd), f32(1, t, h, kd), f32(1, t, h, vd)
  g, beta = f32(1, t, h, *gate_dims), f32(1, t, h)
  kw = dict(scale=0.3, qk_l2norm=True, gate_in_kernel=True, a_log=0.5 * f32(h),
            dt_bias=f32(h, gate_dims[0]), beta_sigmoid=True, initial_state=f32(4, h, kd, vd),
            cu_seqlens=cu)
  engines = dict(triton=functools.partial(triton_kda.kda, interpret=True), xla=ref.kda)

  def loss(engine, *args):
    o, final = engines[engine](*args, **kw)
    return jnp.sum(jnp.sin(o)) + jnp.sum(jnp.sin(final))

  grad = jax.value_and_grad(loss, argnums=(1, 2, 3, 4, 5))
  got, want = (grad(e, q, k, v, g, beta) for e in ("triton", "xla"))
  for g_, w_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g_, w_, rtol=1e-4, atol=1e-4)


def test_engine_declines_off_gpu():
  if jax.default_backend() == "gpu":
    pytest.skip("on a GPU the engine serves")
  q = jnp.ones((1, 16, 1, 8), jnp.float32)
  with pytest.raises(cudnn_jax.UnsupportedError, match="triton: default backend"):
    cudnn_jax.kda(q, q, q, -jnp.ones((1, 16, 1, 8)), jnp.ones((1, 16, 1)),
                  implementation="triton")


def test_kernels_lower_to_triton_for_sm90():
  """The Pallas-to-Triton lowering (what XLA compiles on the GPU) succeeds without a GPU,
  at K = V = 128 and a chunk count that is not a power of two, kernel by kernel and for the
  whole engine."""
  with sm90_export() as export:
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    nc, b, hv, c, d = 13, 2, 3, 64, 128
    scan, scan_alone = (export(jax.jit(functools.partial(kda_scan.scan_output, with_states=x)))(
        s(nc, b, hv, c, d), s(nc, b, hv, c, d), s(nc, b, hv, c, d), s(nc, b, hv, d),
        s(nc, b, hv, c, d), s(nc, b, hv, c, c), s(b, hv, d, d)) for x in (True, False))
    scan_bwd = export(jax.jit(kda_scan.scan_bwd))(
        s(nc, b, hv, c, d), s(nc, b, hv, c, d), s(nc, b, hv, c, d), s(nc, b, hv, c, d),
        s(nc, b, hv, d), s(nc, b, hv, c, c), s(b, hv, d, d))
    block = s(nc, b, hv, c // 16, 16, d)
    pairs = export(kda_intra.pairs)(block, block, block)
    pairs_bwd = export(kda_intra.pairs_bwd)(s(nc, b, hv, c // 16, 16, 16), block, block, block)
    chunk = s(nc, b, hv, c, d)
    bf16 = jnp.dtype(jnp.bfloat16)
    beta = s(nc, b, hv, c, 1)
    intra = export(jax.jit(functools.partial(kda_intra.intra, dt=bf16)))(
        chunk, chunk, chunk, chunk, beta)
    tokens = lambda heads, dt=jnp.float32: jax.ShapeDtypeStruct((b, nc * c - 5, heads, d), dt)
    chunks = export(jax.jit(lambda *x: kda_scan.chunks(*x, 0.1, True, c)))(
        tokens(1, bf16), tokens(1, bf16), tokens(hv, bf16), tokens(hv),
        s(b, nc * c - 5, hv, 1))
    # The whole engine, forward and gradients (both branches of the span's cond).
    engine = lambda *x: jnp.sum(triton_kda.kda(*x, scale=0.1, qk_l2norm=True)[0])
    whole = export(jax.jit(jax.value_and_grad(engine, argnums=(0, 1, 2, 3, 4))))(
        tokens(1, bf16), tokens(1, bf16), tokens(hv, bf16), tokens(hv), s(b, nc * c - 5, hv))
  for exported in (scan, scan_alone, scan_bwd, pairs, pairs_bwd, intra, chunks, whole):
    assert "xla.gpu.triton" in exported.mlir_module()


def test_scan_tiling_by_program_count():
  # (bv, warps, stages): 64 value columns per program while B x HV x V/64 fills an H200's
  # SMs, else 32; what the caller names wins.
  assert kda_scan._tiling(8, 16, 128, None, None, None, True) == (64, 4, 1)
  assert kda_scan._tiling(2, 16, 128, None, None, None, True) == (32, 4, 2)
  assert kda_scan._tiling(2, 16, 128, None, None, None, False) == (32, 4, 1)
  assert kda_scan._tiling(2, 16, 128, 16, 8, None, False) == (16, 8, 1)
  assert kda_scan._tiling(1, 1, 16, None, None, None, True) == (64, 4, 1)  # one block of 16
