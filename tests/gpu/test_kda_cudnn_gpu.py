"""The "cudnn" engine of kda / gdn on a Hopper GPU: NVIDIA's sm_90 kernels from the cuDNN
frontend wheel (cudnn_jax/primitives/kda.py, ffi/kda_cudnn.cc) against the float64
recurrence on small calls and the xla engine on large ones, values and every gradient,
both gate regimes, the truncation bound's edges, bad cu_seqlens, XLA's command buffers.

A random sweep of CUDNN_JAX_KDA_SWEEP_N configurations (default 300) runs as
``test_random_sweep`` (sharded by CUDNN_JAX_SWEEP_SHARD like the other sweeps)."""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cudnn_jax
import gpu_sweep
from gpu_sweep import rel_err
from kda_cases import Config, call_op, make_case, run_oracle

pytestmark = pytest.mark.gpu

REL_TOL = 2e-2  # ||a - b|| / ||b||, bf16 inputs
GRAPH_EVERYTHING = {"xla_gpu_graph_min_graph_size": 1}
DIFFERENTIABLE = ("q", "k", "v", "g", "beta", "initial_state", "a_log", "dt_bias")
ORACLE_MAX_TOKENS = 4096  # B*T*HV up to which the float64 recurrence is also checked


def _gates(arrays, regime, rng):
  """Replace g by one of the two regimes: "slow" (log_sigmoid(n)/8, decays mostly in
  (0.9, 1)), "fla" (log_sigmoid(n), FLA's tests), or "zero" (no decay)."""
  g = arrays["g"]
  n = rng.standard_normal(np.shape(g)).astype(np.float32)
  arrays["g"] = {"slow": jax.nn.log_sigmoid(n) / 8, "fla": jax.nn.log_sigmoid(n),
                 "zero": np.zeros_like(n)}[regime]
  arrays["g"] = np.asarray(arrays["g"], np.float32)


def _values_and_grads(op, arrays, kwargs, engine, seed=0):
  diff = {n: x for n, x in arrays.items() if n in DIFFERENTIABLE}
  fixed = {n: x for n, x in arrays.items() if n not in DIFFERENTIABLE}

  def loss(d):
    o, final = call_op(op, {**d, **fixed}, kwargs, engine)
    w = jax.random.normal(jax.random.key(seed), o.shape, jnp.float32)
    return jnp.sum(o.astype(jnp.float32) * w) + jnp.sum(final * 0.1), (o, final)

  return jax.jit(jax.grad(loss, has_aux=True))(diff)


def _err(actual, expected):
  """``rel_err`` with a floor under the norm: a gradient that is 0 in exact math (of the gate
  at a sequence's first token from a zero state) is compared by its absolute error."""
  b = np.asarray(expected, np.float64)
  diff = np.linalg.norm(np.asarray(actual, np.float64) - b)
  return float(diff / max(np.linalg.norm(b), 1e-4 * np.sqrt(b.size)))


def compare(cfg, regime="slow", seed=0, grads=True):
  """``{name: rel err}`` of the cudnn engine against the xla engine (and the float64
  recurrence on small calls) for o, final_state and every gradient."""
  rng = np.random.default_rng(seed)
  arrays, kwargs = make_case(cfg, seed)
  _gates(arrays, regime, rng)
  errors = {}
  if grads:
    got_g, (got_o, got_f) = _values_and_grads(cfg.op, arrays, kwargs, "cudnn", seed)
    want_g, (want_o, want_f) = _values_and_grads(cfg.op, arrays, kwargs, "xla", seed)
    errors.update({f"d{n}": _err(got_g[n], want_g[n]) for n in got_g})
  else:
    got_o, got_f = jax.jit(lambda a: call_op(cfg.op, a, kwargs, "cudnn"))(arrays)
    want_o, want_f = jax.jit(lambda a: call_op(cfg.op, a, kwargs, "xla"))(arrays)
  errors.update(o=_err(got_o, want_o), final=_err(got_f, want_f))
  tokens = np.shape(arrays["v"])[1] * np.shape(arrays["v"])[0] * cfg.hv
  if tokens <= ORACLE_MAX_TOKENS:
    ref_o, ref_f = run_oracle(arrays, kwargs)
    errors.update(o_f64=_err(got_o, ref_o), final_f64=_err(got_f, ref_f))
  return errors


BF16 = dict(dtype="bfloat16", k=128, v=128)
CASES = {
    "long, l2norm, initial state": Config(b=2, t=1000, h=4, hv=4, l2norm=True,
                                          initial_state=True, **BF16),
    "segmented (beta sigmoid)": Config(b=1, t=4000, h=2, hv=2, l2norm=True,
                                       beta_sigmoid=True, **BF16),
    "gva, lower-bound gate": Config(b=2, t=777, h=2, hv=4, l2norm=True, gate="lower_bound",
                                    dt_bias=True, beta_sigmoid=True, **BF16),
    "softplus gate, scale 0.2": Config(b=2, t=300, h=2, hv=2, gate="softplus", dt_bias=True,
                                       scale=0.2, **BF16),
    "allow_neg_eigval": Config(b=1, t=500, h=2, hv=2, l2norm=True, beta_sigmoid=True,
                               neg_eig=True, **BF16),
    "varlen, empty and one-token": Config(cu_seqlens=(0, 1, 1, 300, 301, 365, 1100), h=2,
                                          hv=2, initial_state=True, l2norm=True, **BF16),
    "gdn": Config(op="gdn", b=2, t=900, h=2, hv=4, l2norm=True, gate="softplus",
                  dt_bias=True, initial_state=True, **BF16),
}


@pytest.mark.parametrize("regime", ["slow", "fla"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_xla_and_float64(name, regime):
  errors = compare(CASES[name], regime)
  assert max(errors.values()) <= REL_TOL, errors


def test_no_decay_and_unnormalised_keys():
  """g = 0 (nothing decays: a segment replays its whole sequence) and q/k as given."""
  errors = compare(Config(b=1, t=2000, h=2, hv=2, beta_sigmoid=True, **BF16), "zero")
  assert max(errors.values()) <= REL_TOL, errors


@pytest.mark.parametrize("cu", [(0, 16, 8, 24), (0, 10, 30, 30), (3, 12, 12, 24),
                                (-4, 9, 2, 40)])
def test_bad_cu_seqlens_follow_spec(cu):
  cfg = Config(cu_seqlens=(0, 8, 16, 24), h=1, hv=2, initial_state=True, l2norm=True, **BF16)
  arrays, kwargs = make_case(cfg, seed=5)
  arrays["cu_seqlens"] = np.asarray(cu, np.int32)
  got = jax.jit(lambda a: call_op("kda", a, kwargs, "cudnn"))(arrays)
  want = run_oracle(arrays, kwargs)
  for name, a, b in zip(("o", "final"), got, want):
    assert rel_err(a, b) <= REL_TOL, name


def test_command_buffers_replay_forward_and_backward():
  """A jitted step recorded in XLA's command buffers, replayed on new inputs, matches the
  xla engine."""
  cfg = Config(b=2, t=512, h=2, hv=2, l2norm=True, initial_state=True, **BF16)

  def step(arrays, engine):
    diff = {n: x for n, x in arrays.items() if n in DIFFERENTIABLE}
    def loss(d):
      o, final = call_op("kda", d, dict(kwargs), engine)
      return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final ** 2)
    return jax.grad(loss)(diff)

  _, kwargs = make_case(cfg)
  graphed = jax.jit(functools.partial(step, engine="cudnn"), compiler_options=GRAPH_EVERYTHING)
  reference = jax.jit(functools.partial(step, engine="xla"))
  for seed in range(3):
    arrays, _ = make_case(cfg, seed=seed)
    got, want = graphed(arrays), reference(arrays)
    for name in got:
      assert rel_err(got[name], want[name]) <= REL_TOL, name


def test_explain_names_the_kernels():
  arrays, kwargs = make_case(CASES["long, l2norm, initial state"])
  text = cudnn_jax.explain("kda", *(arrays[n] for n in ("q", "k", "v", "g", "beta")),
                           initial_state=arrays["initial_state"], implementation="cudnn",
                           **kwargs)
  assert "'cudnn' serves" in text and "kda_fused" in text and "k_bwd" in text, text


def _sweep_cases():
  rng = np.random.default_rng(7)
  n = int(os.environ.get("CUDNN_JAX_KDA_SWEEP_N", "300"))
  for i in range(n):
    t = int(rng.choice([1, 15, 64, 333, 1000, 4096, 16384, 65536]))
    b = 1 if t >= 16384 else int(rng.integers(1, 3))
    h = int(rng.choice([1, 2, 4]))
    cfg = dict(op=str(rng.choice(["kda", "gdn"])), b=b, t=t, h=h,
               hv=h * int(rng.choice([1, 2])), initial_state=bool(rng.random() < 0.5),
               l2norm=bool(rng.random() < 0.7), gate=rng.choice([None, "softplus",
                                                               "lower_bound"]),
               beta_sigmoid=bool(rng.random() < 0.5),
               scale=None if rng.random() < 0.8 else float(rng.choice([0.05, 0.3, 1.0])),
               **BF16)
    cfg["gate"] = None if cfg["gate"] is None else str(cfg["gate"])
    cfg["dt_bias"] = cfg["gate"] is not None and bool(rng.random() < 0.5)
    cfg["neg_eig"] = cfg["beta_sigmoid"] and bool(rng.random() < 0.2)
    if rng.random() < 0.4 and t > 1:
      cut = sorted(rng.integers(0, t + 1, int(rng.integers(1, 5))).tolist())
      cfg.update(b=1, cu_seqlens=tuple([0] + cut + [t]))
    regime = str(rng.choice(["slow", "fla", "zero"]))
    grads = t * b * cfg["hv"] <= 65536
    record = dict(config=dict(cfg, regime=regime, grads=grads), index=i)
    yield record, functools.partial(_sweep_one, Config(**cfg), regime, i, grads)


def _sweep_one(cfg, regime, seed, grads):
  errors = compare(cfg, regime, seed=seed, grads=grads)
  problems = [f"{k}={v:.3g}" for k, v in errors.items() if not v <= REL_TOL]
  return errors, problems, None


def test_random_sweep(capsys):
  records = gpu_sweep.run(gpu_sweep.shard(list(_sweep_cases())), capsys)
  failed = [r for r in records if r["status"] != "ok"]
  assert not failed, failed[:5]


_SANITIZED = """
import jax, jax.numpy as jnp, numpy as np, cudnn_jax
rng = np.random.default_rng(0)
t, h = 100, 2
bf = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
q, k, v = bf(1, t, h, 128), bf(1, t, h, 128), bf(1, t, h, 128)
g = jnp.asarray(jax.nn.log_sigmoid(rng.standard_normal((1, t, h, 128))), jnp.float32)
beta = jnp.asarray(rng.standard_normal((1, t, h)), jnp.float32)
cu = jnp.asarray([0, 1, 1, 70, 90], jnp.int32)
def loss(q, k, v, g, beta):
  o, final = cudnn_jax.kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                           use_beta_sigmoid_in_kernel=True, cu_seqlens=cu,
                           output_final_state=True, implementation="cudnn")
  return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)
print(jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, k, v, g, beta))[0].shape)
"""


@pytest.mark.time_limit(600)
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer_is_clean(tool, tmp_path):
  """A small packed forward and backward (an empty and a one-token sequence, tokens past
  the last one) under compute-sanitizer: no error in the kernels."""
  gpu_sweep.compute_sanitizer(tool, _SANITIZED,
                              "kda|k_prep|k_scan|k_bwd|k_meta|zero_unserved", tmp_path)
