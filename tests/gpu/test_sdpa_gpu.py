"""The "cudnn" engine of cudnn_jax.sdpa against the "xla" engine and the float64 oracle.

A seeded random sweep (CUDNN_JAX_SWEEP_N configurations, default 200) plus a few named
tests. Set CUDNN_JAX_SWEEP_LOG=path.json to keep the per-configuration errors.
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
from gpu_sweep import Declined, lse_err, rel_err
from sdpa_oracle import (Config, cotangent, differentiable, keep_of, make_case, oracle,
                         oracle_vjp, random_config)

pytestmark = pytest.mark.gpu

# XLA forms a CUDA graph (command buffer) around any two adjacent commands.
GRAPH_EVERYTHING = {"xla_gpu_graph_min_graph_size": 1}
REL_TOL = 2e-2  # ||a - b|| / ||b|| for out and every gradient
LSE_TOL = 2e-2  # max |a - b| over finite lse entries
ORACLE_MAX_ELEMENTS = 4_000_000  # B*N*T*S up to which the float64 oracle is also checked
MAX_PLAIN_DECLINED = 0.25


@dataclasses.dataclass
class Result:
  errors: dict = dataclasses.field(default_factory=dict)  # "out vs xla" -> error
  problems: list = dataclasses.field(default_factory=list)
  seconds: dict = dataclasses.field(default_factory=dict)  # wall time per stage, compiles included

  def check(self, name, value, tol):
    self.errors[name] = value
    if not value <= tol:
      self.problems.append(f"{name}: {value:.3g} > {tol}")


def engine_fn(call, implementation, with_lse_cotangent):
  """One jitted function: (out, lse, gradients) of an engine for given cotangents."""
  def run(d, a, d_out, d_lse):
    f = lambda d: call(d, a, implementation=implementation, return_lse=True)
    if with_lse_cotangent:
      (out, lse), pull = jax.vjp(f, d)
      return out, lse, pull((d_out, d_lse))[0]
    # out alone: lse's cotangent is a symbolic zero, so the cuDNN backward serves it.
    out, pull, lse = jax.vjp(f, d, has_aux=True)
    return out, lse, pull(d_out)[0]
  return jax.jit(run)


def compare(cfg: Config, seed: int = 0, *, with_oracle=None, with_lse_cotangent=False):
  """Runs cfg on both engines; raises Declined when the cudnn engine declines it."""
  args, kwargs = make_case(cfg, seed)
  diff, arrays, call = differentiable(args, kwargs)
  out_shape, lse_shape = jax.eval_shape(
      lambda d: call(d, arrays, implementation="xla", return_lse=True), diff)
  d_out = cotangent(out_shape.shape, out_shape.dtype, seed)
  d_lse = cotangent(lse_shape.shape, jnp.float32, seed + 1)
  res = Result()
  start = time.perf_counter()
  try:
    out, lse, grads = jax.block_until_ready(
        engine_fn(call, "cudnn", with_lse_cotangent)(diff, arrays, d_out, d_lse))
  except cudnn_jax.UnsupportedError as e:
    raise Declined(str(e)) from None
  res.seconds["cudnn"] = time.perf_counter() - start
  ref_out, ref_lse, ref_grads = jax.block_until_ready(
      engine_fn(call, "xla", with_lse_cotangent)(diff, arrays, d_out, d_lse))
  res.seconds["xla"] = time.perf_counter() - start - res.seconds["cudnn"]

  res.check("out", rel_err(out, ref_out), REL_TOL)
  res.check("lse", lse_err(lse, ref_lse), LSE_TOL)
  for name in diff:
    res.check(f"d{name}", rel_err(grads[name], ref_grads[name]), REL_TOL)
  for name, x in [("out", out), ("lse", jnp.where(jnp.isneginf(lse), 0, lse))] + [
      (f"d{n}", g) for n, g in grads.items()]:
    if not np.all(np.isfinite(np.asarray(x, np.float32))):
      res.problems.append(f"{name}: NaN or inf")

  keep, _ = keep_of(*args, **kwargs)
  empty = ~keep.any(-1)  # [B,N,T]: rows with no kept key
  if cfg.unbatched:
    empty = empty[0]
  if empty.any():
    rows = np.moveaxis(empty, -1, -2)  # [(B),T,N]
    if np.any(np.asarray(out)[rows] != 0):
      res.problems.append("out: rows with no kept key are not exactly 0")
    if np.any(np.asarray(grads["query"])[rows] != 0):
      res.problems.append("dquery: rows with no kept key are not exactly 0")
    if not cfg.sinks and not np.all(np.isneginf(np.asarray(lse)[empty])):
      res.problems.append("lse: rows with no kept key are not -inf")

  b, n, t, s = keep.shape
  if with_oracle is None:
    with_oracle = b * n * t * s <= ORACLE_MAX_ELEMENTS
  if with_oracle:
    start = time.perf_counter()
    exact_out, exact_lse = oracle(*args, **kwargs)
    res.check("out vs oracle", rel_err(out, exact_out), REL_TOL)
    res.check("lse vs oracle", lse_err(lse, exact_lse), LSE_TOL)
    exact = oracle_vjp(*args, d_out=d_out, d_lse=d_lse if with_lse_cotangent else None,
                       **kwargs)
    for name in diff:
      res.check(f"d{name} vs oracle", rel_err(grads[name], exact[name]), REL_TOL)
    res.seconds["oracle"] = time.perf_counter() - start
  return res


def assert_matches(cfg, **kwargs):
  res = compare(cfg, **kwargs)
  assert not res.problems, f"{cfg.describe()}: {res.problems}"
  return res


# ---------------------------------------------------------------------------------------
# Named tests.

BF16 = dict(dtype="bfloat16", h=64)


def test_basic_forward_backward():
  assert_matches(Config(b=2, t=128, s=128, n=4, k=4, **BF16), with_oracle=True)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("t,s", [(256, 256), (100, 300), (300, 100)])
def test_causal(alignment, t, s):
  assert_matches(Config(b=2, t=t, s=s, n=4, k=2, is_causal=True, causal_alignment=alignment,
                        **BF16), with_oracle=True)


@pytest.mark.parametrize("n,k", [(8, 2), (8, 1), (16, 4)])
def test_gqa(n, k):
  assert_matches(Config(b=2, t=192, s=192, n=n, k=k, dtype="float16", h=128))


@pytest.mark.parametrize("form", ["bnts", "1nts", "b1ts", "11ts"])
def test_bias_and_dbias(form):
  assert_matches(Config(b=2, t=128, s=192, n=4, k=4, bias=form, **BF16), with_oracle=True)


def test_lengths_with_empty_rows():
  assert_matches(Config(b=4, t=160, s=200, n=4, k=2, q_lengths=True, kv_lengths=True,
                        zero_length=True, is_causal=True, causal_alignment="bottom_right",
                        **BF16), with_oracle=True)


def test_lse_cotangent_uses_a_correct_backward():
  assert_matches(Config(b=2, t=128, s=128, n=4, k=2, is_causal=True, **BF16),
                 with_oracle=True, with_lse_cotangent=True)


def test_default_implementation_picks_cudnn():
  args, kwargs = make_case(Config(b=1, t=64, s=64, n=2, k=2, **BF16))
  assert "engine 'cudnn' serves" in cudnn_jax.explain("sdpa", *args, **kwargs)


def test_unserved_features_decline_with_reason():
  """float32 is not a cuDNN SDPA dtype: naming the engine raises the reason, while the
  default choice falls back to the xla engine with the same result."""
  args, kwargs = make_case(Config(b=1, t=64, s=64, n=2, k=2, dtype="float32", h=64))
  with pytest.raises(cudnn_jax.UnsupportedError, match="dtype float32"):
    cudnn_jax.sdpa(*args, implementation="cudnn", **kwargs)
  assert "dtype float32" in cudnn_jax.explain("sdpa", *args, **kwargs)
  fallback = cudnn_jax.sdpa(*args, **kwargs)
  assert rel_err(fallback, cudnn_jax.sdpa(*args, implementation="xla", **kwargs)) <= 1e-6


def test_vmap_under_jit_matches_loop():
  cases = [make_case(Config(b=2, t=96, s=128, n=4, k=2, bias="1nts", is_causal=True,
                            **BF16), seed=i)[0] for i in range(3)]
  stacked = jax.tree.map(lambda *x: jnp.stack(x), *cases)
  f = functools.partial(cudnn_jax.sdpa, is_causal=True, implementation="cudnn",
                        return_lse=True)
  out, lse = jax.jit(jax.vmap(f))(*stacked)
  for i, args in enumerate(cases):
    ref_out, ref_lse = jax.jit(f)(*args)
    assert rel_err(out[i], ref_out) <= 1e-2  # the folded batch may get another plan
    assert lse_err(lse[i], ref_lse) <= 1e-3


def test_grad_under_jit_matches_xla_engine():
  (q, k, v, bias), _ = make_case(Config(b=2, t=128, s=128, n=4, k=2, bias="bnts", **BF16))

  def grads(implementation):
    loss = lambda *a: jnp.sum(jnp.sin(cudnn_jax.sdpa(
        *a, is_causal=True, implementation=implementation).astype(jnp.float32)))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)

  for name, g, r in zip("qkvb", grads("cudnn"), grads("xla")):
    assert rel_err(g, r) <= REL_TOL, name


def test_calls_recorded_in_a_cuda_graph_match_the_xla_engine():
  """XLA records the handlers into its CUDA graphs (command buffers) with the kernels
  around them; replayed on other inputs they match the xla engine."""
  def chain(q, k, v, implementation):
    def loss(q, k, v):
      out = q
      for _ in range(3):  # out has q's shape: feed it back as the next query
        out = cudnn_jax.sdpa(jnp.sin(out), k, v, is_causal=True,
                             implementation=implementation)
      return jnp.sum(out.astype(jnp.float32) ** 2), out
    return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

  graphed = jax.jit(functools.partial(chain, implementation="cudnn"),
                    compiler_options=GRAPH_EVERYTHING)
  reference = jax.jit(functools.partial(chain, implementation="xla"))
  config = Config(b=2, t=256, s=256, n=4, k=4, **BF16)
  recorded = cudnn_jax.cache_info()["recorded"]
  for seed in range(3):
    (q, k, v), _ = make_case(config, seed=seed)
    grads, out = graphed(q, k, v)
    ref_grads, ref_out = reference(q, k, v)
    # Three bf16 calls deep: twice the tolerance of one call.
    assert rel_err(out, ref_out) <= 2 * REL_TOL
    for name, g, r in zip("qkv", grads, ref_grads):
      assert rel_err(g, r) <= 2 * REL_TOL, name
  # Three forward and three backward calls, each recorded at least once.
  assert cudnn_jax.cache_info()["recorded"] - recorded >= 6


def test_cache_info_counters_grow():
  before = cudnn_jax.cache_info()
  args, _ = make_case(Config(b=3, t=77, s=91, n=2, k=1, **BF16))
  jax.block_until_ready(cudnn_jax.sdpa(*args, implementation="cudnn"))
  after = cudnn_jax.cache_info()
  assert after["hits"] + after["misses"] > before["hits"] + before["misses"]
  assert after["size"] >= 1 and after["capacity"] >= after["size"]
  # The executed forward's entry names the plan autotuning chose.
  assert any(key.startswith("sdpa_fwd") and name for key, name in after["plans"].items())


# ---------------------------------------------------------------------------------------
# The randomized sweep.


def sweep_configs():
  rng = np.random.default_rng(20240611)
  count = int(os.environ.get("CUDNN_JAX_SWEEP_N", "200"))
  configs = [random_config(rng) for _ in range(count)]
  return gpu_sweep.shard([(cfg, seed, bool(rng.random() < 0.1))
                          for seed, cfg in enumerate(configs)])


def _summary(records):
  lines = []
  status = collections.Counter(r["status"] for r in records)
  lines.append("sdpa cudnn sweep: " + ", ".join(f"{k} {v}" for k, v in sorted(status.items())))
  reasons = collections.Counter(r["reason"][:120] for r in records if r["status"] == "declined")
  for reason, count in reasons.most_common():
    lines.append(f"  declined x{count}: {reason}")
  worst = collections.defaultdict(float)
  for r in records:
    for name, value in r.get("errors", {}).items():
      worst[name] = max(worst[name], value)
  lines.append("  max error: " + ", ".join(f"{k} {v:.2e}" for k, v in sorted(worst.items())))
  for r in records:
    if r["status"] == "failed":
      lines.append(f"  FAILED {r['config']}: {r['problems']}")
  return "\n".join(lines)


def test_random_sweep(capsys):
  def case(cfg, seed, with_lse):
    def run():
      res = compare(cfg, seed, with_lse_cotangent=with_lse)
      return res.errors, res.problems, res.seconds
    return dict(config=cfg.describe(), seed=seed, lse_cotangent=with_lse, plain=cfg.plain), run

  records = gpu_sweep.run([case(*c) for c in sweep_configs()], capsys,
                          os.environ.get("CUDNN_JAX_SWEEP_LOG"))
  summary = _summary(records)
  with capsys.disabled():
    print("\n" + summary)

  failed = [r for r in records if r["status"] == "failed"]
  plain = [r for r in records if r["plain"]]
  plain_declined = [r for r in plain if r["status"] == "declined"]
  assert len(records) - len([r for r in records if r["status"] == "declined"]) > 0
  assert not failed, f"{len(failed)} of {len(records)} configurations failed:\n{summary}"
  assert len(plain_declined) <= MAX_PLAIN_DECLINED * len(plain), (
      f"cudnn declined {len(plain_declined)} of {len(plain)} plain configurations:\n{summary}")
