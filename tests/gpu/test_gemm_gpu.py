"""The GPU engines of cudnn_jax.grouped_gemm ("cudnn": cuDNN's MoE grouped matmul
node; "cute": kernels/grouped_gemm_sm90.py) against the xla engine and the float64 oracle,
over random group splits: empty groups, rows past sum(group_sizes), every epilogue, bf16
and f16, gradients. Outputs are poisoned (CUDNN_JAX_POISON_OUTPUTS, set by conftest.py)."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cudnn_jax
import gemm_oracle as oracle
from gpu_sweep import rel_err

pytestmark = pytest.mark.gpu

REL_TOL = 2e-2  # ||a - b|| / ||b||
# Gradients through a kink (relu and its kin): where two engines' products differ in sign
# by rounding, the derivative differs by a whole term; those sparse, full-size differences
# make a norm-wise error of about sqrt(their fraction), a few percent in bf16.
KINK_GRAD_TOL = 8e-2
KINKED = ("relu", "srelu", "reglu")


def random_case(rng):
  """(lhs, rhs, group_sizes, bias or None, activation, glu) of one random call."""
  groups = int(rng.choice([1, 2, 8, 13, 64]))
  m = int(rng.choice([1, 7, 128, 1000, 4096]))
  k, n = (int(rng.choice([64, 128, 136, 512])) for _ in range(2))
  activation, glu = oracle.EPILOGUES[rng.integers(len(oracle.EPILOGUES))]
  dtype = rng.choice(["bfloat16", "float16"])
  used = int(m if rng.random() < 0.7 else rng.integers(0, m + 1))  # a tail past the groups
  weights = rng.dirichlet(np.full(groups, 0.5))
  sizes = np.floor(weights * used).astype(np.int64)
  sizes[rng.integers(groups)] += used - sizes.sum()
  if groups > 2 and rng.random() < 0.5:
    sizes[rng.integers(groups)] = 0  # an empty group
  cols = 2 * n if glu else n
  normal = lambda *shape, scale=1.0: jnp.asarray(scale * rng.standard_normal(shape), dtype)
  bias = normal(groups, cols) if rng.random() < 0.5 else None
  return (normal(m, k), normal(groups, k, cols, scale=k ** -0.5),
          jnp.asarray(sizes, jnp.int32), bias, activation, glu)


@functools.partial(jax.jit, static_argnames=("activation", "glu", "implementation"))
def run(lhs, rhs, sizes, bias, cotangent, *, activation, glu, implementation):
  """(out, gradients of lhs, rhs and bias for ``cotangent``) on one engine."""
  diff = dict(lhs=lhs, rhs=rhs) | ({} if bias is None else dict(bias=bias))

  def f(d):
    return cudnn_jax.grouped_gemm(d["lhs"], d["rhs"], sizes, bias=d.get("bias"),
                                  activation=activation, glu=glu,
                                  implementation=implementation)
  out, pull = jax.vjp(f, diff)
  return out, pull(cotangent.astype(out.dtype))[0]


@functools.partial(jax.jit, static_argnames=("activation", "glu", "implementation"))
def forward(lhs, rhs, sizes, bias, *, activation, glu, implementation):
  """The output alone: not differentiated, the cute engine runs its fused epilogue."""
  return cudnn_jax.grouped_gemm(lhs, rhs, sizes, bias=bias, activation=activation, glu=glu,
                                implementation=implementation)


@pytest.mark.time_limit(600)  # 40 configurations, three programs compiled for each
@pytest.mark.parametrize("engine", ["cudnn", "cute"])
def test_grouped_gemm_gpu_engine_sweep(engine, capsys):
  rng = np.random.default_rng(7)
  records = []
  for i in range(40):
    case = random_case(rng)
    lhs, rhs, sizes, bias, activation, glu = case
    record = dict(engine=engine, i=i, m=lhs.shape[0], k=lhs.shape[1], cols=rhs.shape[2],
                  groups=rhs.shape[0], sizes_sum=int(sizes.sum()), dtype=str(lhs.dtype),
                  bias=bias is not None, epilogue=activation or glu or "none")
    n = rhs.shape[2] // (2 if glu else 1)
    cotangent = jnp.asarray(rng.standard_normal((lhs.shape[0], n)), jnp.float32)
    on = lambda impl: run(lhs, rhs, sizes, bias, cotangent, activation=activation, glu=glu,
                          implementation=impl)
    try:
      out, grads = on(engine)
    except cudnn_jax.UnsupportedError as e:
      record.update(status="declined", reason=str(e)[:300])
    else:
      ref_out, ref_grads = on("xla")
      alone = forward(lhs, rhs, sizes, bias, activation=activation, glu=glu,
                      implementation=engine)
      errors = {"out": rel_err(out, ref_out), "out alone": rel_err(alone, ref_out),
                "out vs oracle": rel_err(out, oracle.grouped_gemm(*case[:4], activation, glu))}
      errors.update({f"d{k}": rel_err(g, ref_grads[k]) for k, g in grads.items()})
      tails = [np.asarray(o, np.float32)[int(sizes.sum()):] for o in (out, alone)]
      tol = lambda k: (KINK_GRAD_TOL if k.startswith("d") and record["epilogue"] in KINKED
                       else REL_TOL)
      problems = [f"{k}: {v:.3g}" for k, v in errors.items() if not v <= tol(k)]
      if any(np.any(tail != 0) for tail in tails):
        problems.append("rows past sum(group_sizes) are not 0")
      record.update(status="failed" if problems else "ok", errors=errors, problems=problems)
    records.append(record)
    with capsys.disabled():
      print(json.dumps(record), flush=True)
  failed = [r for r in records if r["status"] == "failed"]
  assert any(r["status"] == "ok" for r in records), records
  assert not failed, failed


def test_grouped_gemm_cudnn_recorded_in_a_cuda_graph():
  """XLA records the cuDNN handler into its CUDA graphs (command buffers; not on a
  program's first execution); replayed on other inputs the results match the xla engine."""
  graphed = jax.jit(run.__wrapped__, static_argnames=("activation", "glu", "implementation"),
                    compiler_options={"xla_gpu_graph_min_graph_size": 1})
  recorded = cudnn_jax.cache_info()["recorded"]
  for seed in range(3):
    rng = np.random.default_rng(seed)
    normal = lambda *shape, scale=1.0: jnp.asarray(scale * rng.standard_normal(shape),
                                                   jnp.bfloat16)
    lhs, rhs, bias = normal(1000, 128), normal(8, 128, 256, scale=128 ** -0.5), normal(8, 256)
    sizes = jnp.asarray([100, 0, 300, 50, 200, 150, 100, 60], jnp.int32)  # 40 rows past
    ct = jnp.asarray(rng.standard_normal((1000, 256)), jnp.float32)
    args = (lhs, rhs, sizes, bias, ct)
    out, grads = graphed(*args, activation="silu", glu=None, implementation="cudnn")
    ref_out, ref_grads = run(*args, activation="silu", glu=None, implementation="xla")
    assert rel_err(out, ref_out) <= REL_TOL
    for name, g in grads.items():
      assert rel_err(g, ref_grads[name]) <= REL_TOL, name
  assert cudnn_jax.cache_info()["recorded"] > recorded


@pytest.mark.parametrize("engine", ["cudnn", "cute"])
def test_moe_mlp_gpu_engine_matches_xla(engine):
  """moe_mlp with both projections on a GPU engine: output and gradients vs the xla engine
  (bf16, T=1000 top-2 of 8 experts, a few out-of-range choices)."""
  rng = np.random.default_rng(3)
  t, d, f, e, k = 1000, 256, 128, 8, 2
  bf16 = lambda *shape, scale=1.0: jnp.asarray(scale * rng.standard_normal(shape), jnp.bfloat16)
  x, w_up, w_down = bf16(t, d), bf16(e, d, 2 * f, scale=d ** -0.5), bf16(e, f, d, scale=f ** -0.5)
  idx = rng.integers(0, e, (t, k))
  idx[:5, 0] = e  # out of range: contributes 0
  idx = jnp.asarray(idx, jnp.int32)
  weights = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)

  @functools.partial(jax.jit, static_argnames="implementation")
  def run(x, weights, w_up, w_down, implementation):
    f = lambda *a: cudnn_jax.moe_mlp(a[0], idx, *a[1:], implementation=implementation)
    y, pull = jax.vjp(f, x, weights, w_up, w_down)
    return (y,) + pull(dy.astype(y.dtype))

  got = run(x, weights, w_up, w_down, implementation=engine)
  want = run(x, weights, w_up, w_down, implementation="xla")
  for name, g, w in zip(["y", "dx", "dweights", "dw_up", "dw_down"], got, want):
    assert rel_err(g, oracle.f64(w)) <= REL_TOL, name


@pytest.mark.parametrize("shape,glu,activation", [
    ((2, 1000, 512, 256), "swiglu", None),
    ((1, 4096, 1024, 1024), None, "gelu"),
    ((3, 7, 64, 136), None, None)])
def test_gemm_cute_engine_matches_xla(shape, glu, activation):
  """gemm on the grouped kernel (one group): output, amax and gradients vs the xla engine."""
  rng = np.random.default_rng(4)
  batch, m, k, n = shape
  cols = 2 * n if glu else n
  bf16 = lambda *s, scale=1.0: jnp.asarray(scale * rng.standard_normal(s), jnp.bfloat16)
  a, b, bias = bf16(batch, m, k), bf16(k, cols, scale=k ** -0.5), bf16(cols)
  ct = jnp.asarray(rng.standard_normal((batch, m, n)), jnp.float32)

  @functools.partial(jax.jit, static_argnames="implementation")
  def run(a, b, bias, implementation):
    f = lambda a, b, bias: cudnn_jax.gemm(a, b, bias=bias, glu=glu, activation=activation,
                                          return_amax=True, implementation=implementation)
    (out, amax), pull = jax.vjp(f, a, b, bias)
    return (out, amax) + pull((ct.astype(out.dtype), jnp.zeros((), jnp.float32)))

  got, want = run(a, b, bias, implementation="cute"), run(a, b, bias, implementation="xla")
  for name, g, w in zip(["out", "amax", "da", "db", "dbias"], got, want):
    assert rel_err(g, oracle.f64(w)) <= REL_TOL, name
  # Not differentiated and without amax, the epilogue runs fused in the kernel.
  alone = jax.jit(lambda a, b, bias: cudnn_jax.gemm(
      a, b, bias=bias, glu=glu, activation=activation, implementation="cute"))(a, b, bias)
  assert rel_err(alone, oracle.f64(want[0])) <= REL_TOL, "out, fused epilogue"


@pytest.mark.parametrize("engine", ["cudnn", "cute"])
@pytest.mark.parametrize("rhs_axis", [0, None], ids=["rhs_batched", "rhs_shared"])
def test_grouped_gemm_vmap_is_one_handler_call(engine, rhs_axis):
  """jax.vmap of grouped_gemm: the batch runs as one handler call on rows regrouped across
  it (primitives/grouped_gemm.py); values and gradients vs the xla engine, vmapped."""
  rng = np.random.default_rng(11)
  v, m, k, n, g = 3, 300, 128, 64, 5
  bf16 = lambda *s, scale=1.0: jnp.asarray(scale * rng.standard_normal(s), jnp.bfloat16)
  lhs = bf16(v, m, k)
  rhs = bf16(*((v,) if rhs_axis == 0 else ()), g, k, 2 * n, scale=k ** -0.5)
  sizes = jnp.asarray([[60, 0, 100, 40, 20], [300, 0, 0, 0, 0], [1, 2, 3, 4, 5]], jnp.int32)
  ct = jnp.asarray(rng.standard_normal((v, m, n)), jnp.float32)

  @functools.partial(jax.jit, static_argnames="implementation")
  def run(lhs, rhs, implementation):
    f = jax.vmap(lambda l, r, s: cudnn_jax.grouped_gemm(l, r, s, glu="swiglu",
                                                         implementation=implementation),
                 in_axes=(0, rhs_axis, 0))
    out, pull = jax.vjp(lambda l, r: f(l, r, sizes), lhs, rhs)
    return (out,) + pull(ct.astype(out.dtype))

  got, want = run(lhs, rhs, implementation=engine), run(lhs, rhs, implementation="xla")
  for name, a, b in zip(["out", "dlhs", "drhs"], got, want):
    assert rel_err(a, oracle.f64(b)) <= REL_TOL, name
