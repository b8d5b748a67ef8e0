"""The "cudnn" engine of cudnn_jax.sdpa_fp8 against the "xla" engine, on a GPU.

A seeded random sweep (CUDNN_JAX_FP8_SWEEP_N configurations, default 40) of values, amax
and gradients, with every handler result poisoned first (CUDNN_JAX_POISON_OUTPUTS, set by
conftest.py) so that an element cuDNN leaves unwritten shows up; declines are counted with
their reasons. Set CUDNN_JAX_SWEEP_LOG=path.json to keep the per-configuration records.
"""

import collections
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cudnn_jax
from cudnn_jax.ops import sdpa_fp8 as op
import gpu_sweep
from gpu_sweep import rel_err

pytestmark = pytest.mark.gpu

# ||a - b|| / ||b|| against the xla engine. The kernels round the probabilities against a
# running row max (the xla engine against the final one) and, for an fp8 out, round the
# out: both are e4m3 rounding differences (2^-4 relative per element at most).
OUT_TOL = {"float8_e4m3fn": 8e-2, "bfloat16": 4e-2}
AMAX_TOL = 4e-2  # relative
GRAD_TOL = 6e-2


def make_case(rng, b, t, s, n, k, h, hv):
  fp8 = lambda shape: jnp.asarray(rng.normal(size=shape) * 8, jnp.float8_e4m3fn)
  scales = dict(q_scale=jnp.float32(rng.uniform(0.05, 0.3)),
                k_scale=jnp.float32(rng.uniform(0.05, 0.3)),
                v_scale=jnp.float32(rng.uniform(0.05, 0.5)), out_scale=jnp.float32(0.02))
  return fp8((b, t, n, h)), fp8((b, s, k, h)), fp8((b, s, k, hv)), scales


def random_config(rng):
  k = int(rng.choice([1, 2, 4]))
  h = int(rng.choice([64, 128, 128]))
  t = int(rng.choice([64, 128, 200, 512, 1024]))
  s = t if rng.random() < 0.6 else int(rng.choice([128, 256, 700, 1024]))
  kwargs = dict(is_causal=bool(rng.random() < 0.5))
  if rng.random() < 0.25:
    kwargs["local_window_size"] = (int(rng.integers(0, 200)), 0 if kwargs["is_causal"]
                                   else int(rng.integers(0, 200)))
  b = int(rng.choice([1, 2, 3]))
  if rng.random() < 0.25:
    kwargs["query_seq_lengths"] = rng.integers(1, t + 1, size=b).astype(np.int32)
    kwargs["key_value_seq_lengths"] = rng.integers(1, s + 1, size=b).astype(np.int32)
  out_dtype = str(rng.choice(["float8_e4m3fn", "float8_e4m3fn", "bfloat16"]))
  shape = dict(b=b, t=t, s=s, n=k * int(rng.choice([1, 2, 4])), k=k, h=h, hv=h)
  return shape, out_dtype, kwargs


def engine_fn(implementation, out_dtype, kwargs):
  def run(q, k, v, scales, ct):
    f = lambda q, k, v: cudnn_jax.sdpa_fp8(q, k, v, **scales, out_dtype=out_dtype,
                                           implementation=implementation, **kwargs)
    (out, amax), pull = jax.vjp(f, q, k, v)
    return out, amax, pull((ct.astype(out.dtype), jnp.zeros_like(amax)))
  return jax.jit(run)


def compare(shape, out_dtype, kwargs, seed):
  """Problems of the cudnn engine against the xla engine ([] when none); raises
  UnsupportedError when the cudnn engine declines."""
  rng = np.random.default_rng(seed)
  q, k, v, scales = make_case(rng, **shape)
  ct = jnp.asarray(rng.normal(size=(shape["b"], shape["t"], shape["n"], shape["hv"])),
                   jnp.float32)
  got = engine_fn("cudnn", out_dtype, kwargs)(q, k, v, scales, ct)
  want = engine_fn("xla", out_dtype, kwargs)(q, k, v, scales, ct)
  errors = {"out": rel_err(got[0].astype(jnp.float32), want[0].astype(jnp.float32)),
            "amax": abs(float(got[1]) - float(want[1])) / max(float(want[1]), 1e-30)}
  for name, g, w in zip(("dq", "dk", "dv"), got[2], want[2]):
    errors[name] = rel_err(g.astype(jnp.float32), w.astype(jnp.float32))
  tols = dict(out=OUT_TOL[out_dtype], amax=AMAX_TOL, dq=GRAD_TOL, dk=GRAD_TOL, dv=GRAD_TOL)
  problems = [f"{n}: {e:.3g} > {tols[n]}" for n, e in errors.items() if not e <= tols[n]]
  finite = all(np.isfinite(np.asarray(x, np.float32)).all() for x in (got[0], *got[2]))
  return errors, problems + ([] if finite else ["non-finite values (unwritten elements?)"])


def test_fp8_random_sweep(capsys):
  rng = np.random.default_rng(2024)
  configs = [(i, *random_config(rng))
             for i in range(int(os.environ.get("CUDNN_JAX_FP8_SWEEP_N", "40")))]

  def case(seed, shape, out_dtype, kwargs):
    record = dict(shape=shape, out_dtype=out_dtype, seed=seed,
                  kwargs={key: np.asarray(x).tolist() for key, x in kwargs.items()})

    def run():
      q, k, v, scales = make_case(np.random.default_rng(0), **shape)
      call = op.prepare(q, k, v, **scales, out_dtype=out_dtype, **kwargs)[0]
      record["backward"] = op.backward_path(call) if op._supports_cudnn(call) is None else None
      return (*compare(shape, out_dtype, kwargs, seed), None)
    return record, run

  records = gpu_sweep.run([case(*c) for c in gpu_sweep.shard(configs)], capsys,
                          os.environ.get("CUDNN_JAX_SWEEP_LOG"))
  counts = collections.Counter(r["status"] for r in records)
  reasons = collections.Counter(r.get("reason", "")[:120] for r in records
                                if r["status"] == "declined")
  with capsys.disabled():
    print(f"\nsdpa_fp8 sweep: {dict(counts)}; declines: {dict(reasons)}")
  failed = [r for r in records if r["status"] == "failed"]
  assert not failed, json.dumps(failed, indent=1, default=str)[:4000]
  # On Hopper and newer, cuDNN serves fp8-out calls with H of 64 or 128 and no
  # bottom-right mask: most of the sweep.
  assert counts["ok"] >= len(records) // 3, dict(counts)


def test_benchmark_shape_runs_cuDNNs_fp8_graph():
  """The benchmark's call (fp8 out, causal, S=4096, H=128) is served by the cudnn engine,
  forward and backward, and the plan cache holds the FP8 forward graph."""
  shape = dict(b=4, t=4096, s=4096, n=16, k=16, h=128, hv=128)
  q, k, v, scales = make_case(np.random.default_rng(1), **shape)
  kwargs = dict(is_causal=True, out_dtype=jnp.float8_e4m3fn)
  assert "'cudnn' serves" in cudnn_jax.explain("sdpa_fp8", q, k, v, **scales, **kwargs)
  out, amax = jax.jit(functools.partial(cudnn_jax.sdpa_fp8, implementation="cudnn",
                                        **kwargs))(q, k, v, **scales)
  want, want_amax = cudnn_jax.sdpa_fp8(q, k, v, **scales, implementation="xla", **kwargs)
  assert rel_err(out.astype(jnp.float32), want.astype(jnp.float32)) < OUT_TOL["float8_e4m3fn"]
  assert abs(float(amax) - float(want_amax)) <= AMAX_TOL * float(want_amax)
  plans = cudnn_jax.cache_info()["plans"]
  assert any(key.startswith("sdpa_fp8_fwd") for key in plans), list(plans)[:5]


def test_vmap_and_lengths_zero_rows():
  """vmap gives each entry its own amax; rows past the query lengths are 0 (the handler
  zero-fills what cuDNN leaves unwritten)."""
  shape = dict(b=2, t=128, s=128, n=4, k=4, h=128, hv=128)
  q, k, v, scales = make_case(np.random.default_rng(3), **shape)
  lens = dict(query_seq_lengths=jnp.array([100, 7], jnp.int32),
              key_value_seq_lengths=jnp.array([128, 50], jnp.int32))
  f = lambda impl: jax.jit(jax.vmap(lambda q: cudnn_jax.sdpa_fp8(
      q, k, v, **scales, out_dtype=jnp.float8_e4m3fn, implementation=impl, **lens)))
  qv = jnp.stack([q, (q.astype(jnp.float32) / 4).astype(q.dtype)])
  (out, amax), (want, want_amax) = f("cudnn")(qv), f("xla")(qv)
  np.testing.assert_allclose(np.asarray(amax), np.asarray(want_amax), rtol=AMAX_TOL)
  assert not np.asarray(out[:, 1, 7:].astype(jnp.float32)).any()
  assert rel_err(out.astype(jnp.float32), want.astype(jnp.float32)) < OUT_TOL["float8_e4m3fn"]
