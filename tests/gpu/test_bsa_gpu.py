"""The GPU engines of cudnn_jax.bsa against the xla engine (float32 math on the same
rounded inputs): "triton" (our Pallas kernels compiled by Triton) and "cudnn" (NVIDIA's
sm_90 kernels from the cuDNN frontend wheel, compiled ahead of time). For each, a seeded
random sweep over block sizes, head dims, GQA groups, lengths, densities from 0 to 1,
partial kv blocks, skipped entries and counts (CUDNN_JAX_SWEEP_N configurations, default
60; CUDNN_JAX_SWEEP_SHARD as in test_sdpa_gpu.py), plus named tests: an empty selection, a
deterministic triton backward (two runs bit-identical), a long sequence, the cudnn engine's
kernels named by explain and compute-sanitizer's memcheck. Outputs start NaN-filled
(CUDNN_JAX_POISON_OUTPUTS, set by conftest.py), so an element left unwritten fails.
"""

import collections
import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cudnn_jax
import gpu_sweep
from gpu_sweep import rel_err

pytestmark = pytest.mark.gpu

# ||a - b|| / ||b|| for out and every gradient, and max |a - b| over finite lse entries.
REL_TOL = {"bfloat16": 2e-2, "float16": 2e-2, "float32": 1e-4}
LSE_TOL = {"bfloat16": 2e-2, "float16": 2e-2, "float32": 1e-4}


@dataclasses.dataclass(frozen=True)
class Case:
  b: int = 1
  sq: int = 1000
  skv: int = 1000
  n: int = 4
  k: int = 2
  h: int = 128
  hv: int = 128
  bs: int = 128
  density: float = 0.3
  causal: bool = False
  partial: bool = False  # random kv_block_sizes
  sizes: str = "per_head"  # partial: kv_block_sizes [B,K,Nkv] ("per_head") or [B,Nkv]
  counts: bool = True  # block_counts given (else every entry read, invalid ones skipped)
  dtype: str = "bfloat16"
  lse_grad: bool = True  # the loss also differentiates lse


def selection(rng, c: Case):
  """``(block_index [B,N,Nq,L], block_counts [B,N,Nq] or None)``: each query block keeps
  each kv block with probability ``c.density``, listed in random order; out-of-range
  entries fill the rest (after the count, or mixed in when there are no counts)."""
  nq, nkv = -(-c.sq // c.bs), -(-c.skv // c.bs)
  keep = rng.random((c.b, c.n, nq, nkv)) < c.density
  width = int(keep.sum(-1).max()) + 2
  index = np.empty((c.b, c.n, nq, width), np.int32)
  for row in np.ndindex(c.b, c.n, nq):
    chosen = rng.permutation(np.flatnonzero(keep[row]))
    junk = rng.choice([-1, -7, nkv, nkv + 5], width - len(chosen))
    index[row] = np.concatenate([chosen, junk]) if c.counts else rng.permutation(
        np.concatenate([chosen, junk]))
  counts = keep.sum(-1).astype(np.int32) if c.counts else None
  return index, counts


def make_inputs(c: Case, seed):
  rng = np.random.default_rng(seed)
  dt = jnp.dtype(c.dtype)
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32).astype(dt)
  q, k, v = normal(c.b, c.sq, c.n, c.h), normal(c.b, c.skv, c.k, c.h), normal(c.b, c.skv, c.k, c.hv)
  index, counts = selection(rng, c)
  sizes = None
  if c.partial:
    shape = (c.b, c.k, -(-c.skv // c.bs)) if c.sizes == "per_head" else (c.b, -(-c.skv // c.bs))
    sizes = rng.integers(0, c.bs + 1, shape).astype(np.int32)
  d_out = normal(c.b, c.sq, c.n, c.hv)
  d_lse = jnp.asarray(rng.standard_normal((c.b, c.n, c.sq)), jnp.float32)
  return (q, k, v), (index, counts, sizes), (d_out, d_lse)


def run(c: Case, arrays, meta, cts, implementation):
  """``(out, lse, dq, dk, dv)`` as float32 NumPy, gradients of ``sum(out * d_out) +
  sum(lse * d_lse)`` over the finite lse entries (the lse term with ``c.lse_grad``)."""
  index, counts, sizes = meta
  fn = functools.partial(cudnn_jax.bsa, block_size=c.bs, kv_block_sizes=sizes,
                         is_causal=c.causal, return_lse=True, implementation=implementation)
  d_out, d_lse = cts

  def loss(q, k, v):
    out, lse = fn(q, k, v, index, counts)
    total = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))
    if c.lse_grad:
      total += jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * d_lse)
    return total, (out, lse)

  grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(*arrays)
  return tuple(np.asarray(jnp.asarray(x, jnp.float32)) for x in (out, lse, *grads))


def compare(c: Case, seed, engine="triton"):
  """``(errors, problems, seconds)`` of ``engine`` against the xla engine run on the
  float32 upcast of the same inputs."""
  arrays, meta, cts = make_inputs(c, seed)
  start = time.perf_counter()
  got = run(c, arrays, meta, cts, engine)
  seconds = time.perf_counter() - start
  want = run(c, [x.astype(jnp.float32) for x in arrays], meta, cts, "xla")
  errors, problems = {}, []
  names = ("out", "lse", "dq", "dk", "dv")
  for name, g, w in zip(names, got, want):
    if name == "lse":
      finite = np.isfinite(w)
      if not np.array_equal(finite, np.isfinite(g)):
        problems.append("lse: non-finite entries differ")
        continue
      errors[name] = float(np.max(np.abs(g[finite] - w[finite]), initial=0.0))
      if errors[name] > LSE_TOL[c.dtype]:
        problems.append(f"lse: max abs error {errors[name]:.2e}")
      continue
    if not np.all(np.isfinite(g)):
      problems.append(f"{name}: non-finite entries")
      continue
    errors[name] = rel_err(g, w)
    if errors[name] > REL_TOL[c.dtype]:
      problems.append(f"{name}: rel error {errors[name]:.2e}")
  return errors, problems, seconds


def _check(c: Case, seed=0, engine="triton"):
  errors, problems, _ = compare(c, seed, engine)
  assert not problems, (c, errors, problems)


# ---------------------------------------------------------------------------------------
# The cudnn engine: NVIDIA's kernels.

CUDNN_CASES = {
    # Forward and backward on the kernels (bf16, H = 128, K = N), lse not differentiated.
    "bs128_backward": Case(n=4, k=4, sq=1000, skv=1000, lse_grad=False),
    "bs64_backward_sq_tail": Case(bs=64, n=2, k=2, sq=777, skv=1500, density=0.2,
                                  lse_grad=False),
    "bs128_backward_sizes_by_batch": Case(b=2, n=2, k=2, sq=300, skv=2000, partial=True,
                                          sizes="batch", lse_grad=False),
    "bs128_backward_many_groups": Case(n=1, k=1, sq=40000, skv=4096, density=0.05,
                                       lse_grad=False),
    # lse differentiated: the gradients come from the triton engine.
    "bs128_lse_grad": Case(n=2, k=2, density=0.5, partial=True),
    # Forward only on the kernels; gradients from the triton engine.
    "bs64_gqa4_d96_f16": Case(bs=64, n=8, k=2, h=96, hv=96, sq=500, skv=900,
                              dtype="float16", counts=False, lse_grad=False),
    "bs128_gqa8_d64_partial": Case(n=8, k=1, h=64, hv=64, sq=1024, skv=1100, partial=True),
}


@pytest.mark.parametrize("name", list(CUDNN_CASES))
def test_cudnn_matches_xla_engine(name):
  _check(CUDNN_CASES[name], seed=11, engine="cudnn")


def test_cudnn_explain_names_the_kernels():
  c = CUDNN_CASES["bs128_backward"]
  arrays, (index, counts, _), _ = make_inputs(c, 1)
  text = cudnn_jax.explain("bsa", *arrays, index, counts, block_size=c.bs,
                           implementation="cudnn")
  assert "'cudnn' serves" in text and "bsa_fwd128_bf16_d128_g1_mask1" in text, text
  assert "bsa_bwd128_bf16_d128_direct1_mask1" in text, text


def test_cudnn_declines_causal_with_the_reason():
  c = CUDNN_CASES["bs128_backward"]
  arrays, (index, counts, _), _ = make_inputs(c, 1)
  with pytest.raises(cudnn_jax.UnsupportedError, match="token mask"):
    cudnn_jax.bsa(*arrays, index, counts, block_size=c.bs, is_causal=True,
                  implementation="cudnn")


def test_cudnn_empty_selection_outputs_zero():
  c = dataclasses.replace(CUDNN_CASES["bs128_backward"], density=0.0)
  arrays, meta, cts = make_inputs(c, 2)
  out, lse, dq, dk, dv = run(c, arrays, meta, cts, "cudnn")
  assert np.all(out == 0) and np.all(lse == -np.inf)
  assert np.all(dq == 0) and np.all(dk == 0) and np.all(dv == 0)


_SANITIZED = """
import jax, jax.numpy as jnp, numpy as np, cudnn_jax
rng = np.random.default_rng(0)
b, s, n, bs = 1, 300, 2, {bs}
bf = lambda *x: jnp.asarray(rng.standard_normal(x), jnp.bfloat16)
q, k, v = bf(b, s, n, 128), bf(b, s + 77, n, 128), bf(b, s + 77, n, 128)
nq, nkv = -(-s // bs), -(-(s + 77) // bs)
index = jnp.asarray(rng.integers(-1, nkv + 1, (b, n, nq, nkv + 1)), jnp.int32)
sizes = jnp.asarray(rng.integers(0, bs + 1, (b, nkv)), jnp.int32)
def loss(q, k, v):
  return jnp.sum(cudnn_jax.bsa(q, k, v, index, block_size=bs, kv_block_sizes=sizes,
                               implementation="cudnn").astype(jnp.float32))
print(jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))[0].shape)
"""


@pytest.mark.time_limit(600)
@pytest.mark.parametrize("bs", [64, 128])
def test_cudnn_compute_sanitizer_memcheck_is_clean(bs, tmp_path):
  """A small forward and backward on the kernels (tails, partial blocks, skipped entries)
  under compute-sanitizer's memcheck."""
  gpu_sweep.compute_sanitizer("memcheck", _SANITIZED.format(bs=bs), ".*", tmp_path)


# ---------------------------------------------------------------------------------------
# The triton engine: our Pallas kernels.


@pytest.mark.parametrize("c", [
    Case(bs=128, h=128, hv=128, causal=True, density=0.3),
    Case(bs=64, h=64, hv=128, n=8, k=2, sq=777, skv=1500, partial=True, density=0.2),
    Case(bs=64, h=128, hv=64, n=4, k=1, causal=True, counts=False, dtype="float16"),
    Case(bs=128, h=64, hv=64, b=2, sq=300, skv=2000, density=1.0, partial=True),
    # float32 (true float32 products): the largest tiles in shared memory.
    Case(bs=64, h=128, hv=128, causal=True, partial=True, dtype="float32"),
    Case(bs=64, h=128, hv=128, n=4, k=1, density=0.5, dtype="float32"),
], ids=["bs128_causal", "bs64_gqa4_partial", "bs64_mqa_no_counts_f16", "bs128_dense_b2",
        "bs64_f32", "bs64_f32_mqa"])
def test_matches_xla_engine(c):
  _check(c, seed=1)


def test_float32_at_block_size_128_declines():
  """Its 128 x 128 float32 tiles do not fit in shared memory: the engine says so rather
  than failing to compile, and the default dispatch falls back to the xla engine."""
  c = Case(bs=128, h=128, hv=128, dtype="float32")
  arrays, (index, counts, _), _ = make_inputs(c, 1)
  text = cudnn_jax.explain("bsa", *arrays, index, counts, block_size=c.bs,
                           implementation="triton")
  assert "shared memory" in text


def test_empty_selection_outputs_zero():
  c = Case(density=0.0, causal=True)
  arrays, meta, cts = make_inputs(c, 2)
  out, lse, dq, dk, dv = run(c, arrays, meta, cts, "triton")
  assert np.all(out == 0) and np.all(lse == -np.inf)
  assert np.all(dq == 0) and np.all(dk == 0) and np.all(dv == 0)


def test_backward_is_deterministic():
  """dk and dv sum over many query blocks and a GQA group of 4 heads: two runs give the
  same bits."""
  c = Case(sq=4096, skv=4096, n=8, k=2, bs=64, density=0.5, causal=True)
  arrays, meta, cts = make_inputs(c, 3)
  first = run(c, arrays, meta, cts, "triton")
  second = run(c, arrays, meta, cts, "triton")
  for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, second):
    assert np.array_equal(a, b), name


def test_long_sequence():
  _check(Case(sq=16384, skv=16384, n=2, k=1, bs=128, density=0.05, causal=True), seed=4)


def test_engine_is_opt_in():
  """Opt-in: without implementation= the xla engine serves."""
  c = Case()
  arrays, (index, counts, _), _ = make_inputs(c, 5)
  text = cudnn_jax.explain("bsa", *arrays, index, counts, block_size=c.bs)
  assert "'xla' serves" in text and "triton: declines: opt-in" in text
  assert "'triton' serves" in cudnn_jax.explain("bsa", *arrays, index, counts,
                                                block_size=c.bs, implementation="triton")


# ---------------------------------------------------------------------------------------
# The randomized sweep.


def random_case(rng) -> Case:
  bs = int(rng.choice([64, 128]))
  k = int(rng.choice([1, 2, 4]))
  return Case(
      b=int(rng.choice([1, 2])), sq=int(rng.integers(1, 2049)), skv=int(rng.integers(1, 2049)),
      n=k * int(rng.choice([1, 2, 4])), k=k, h=int(rng.choice([64, 128])),
      hv=int(rng.choice([64, 128])), bs=bs,
      density=float(rng.choice([0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0])),
      causal=bool(rng.random() < 0.5), partial=bool(rng.random() < 0.4),
      counts=bool(rng.random() < 0.7), dtype=str(rng.choice(["bfloat16", "float16"])))


def random_cudnn_case(rng) -> Case:
  """What the cudnn engine's kernels serve (no causal; H = Hv; 1, 2, 4 or 8 query heads per
  kv head), half of it also what its backward kernels serve (bf16, H = 128, K = N)."""
  k = int(rng.choice([1, 2, 4]))
  case = Case(
      b=int(rng.choice([1, 2])), sq=int(rng.integers(1, 2049)), skv=int(rng.integers(1, 2049)),
      n=k * int(rng.choice([1, 2, 4, 8])), k=k, h=int(rng.choice([64, 96, 128])),
      bs=int(rng.choice([64, 128])),
      density=float(rng.choice([0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0])),
      partial=bool(rng.random() < 0.4), sizes=str(rng.choice(["per_head", "batch"])),
      counts=bool(rng.random() < 0.7), dtype=str(rng.choice(["bfloat16", "float16"])),
      lse_grad=bool(rng.random() < 0.3))
  if rng.random() < 0.5:
    case = dataclasses.replace(case, dtype="bfloat16", h=128, n=case.k)
  return dataclasses.replace(case, hv=case.h)


SWEEPS = {"triton": (random_case, 20261205), "cudnn": (random_cudnn_case, 20261207)}


def sweep_cases(engine):
  make, seed = SWEEPS[engine]
  rng = np.random.default_rng(seed)
  count = int(os.environ.get("CUDNN_JAX_SWEEP_N", "60"))
  return gpu_sweep.shard([(make(rng), seed) for seed in range(count)])


@pytest.mark.parametrize("engine", list(SWEEPS))
def test_random_sweep(engine, capsys):
  def case(c, seed):
    def run():
      errors, problems, seconds = compare(c, seed, engine)
      return errors, problems, {engine: seconds}
    return dict(config=f"bsa {engine} {dataclasses.asdict(c)}", seed=seed), run

  log = os.environ.get("CUDNN_JAX_SWEEP_LOG")
  records = gpu_sweep.run([case(*c) for c in sweep_cases(engine)], capsys,
                          log and f"{log}.{engine}")
  status = collections.Counter(r["status"] for r in records)
  failed = [r for r in records if r["status"] == "failed"]
  with capsys.disabled():
    print(f"\nbsa {engine} sweep: {dict(status)}")
  assert not failed, "\n".join(f"{r['config']}: {r['problems']}" for r in failed)
  assert any(r["status"] == "ok" for r in records), f"{engine} served nothing: {status}"
