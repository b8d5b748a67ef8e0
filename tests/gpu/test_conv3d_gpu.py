"""The "cudnn" engine of cudnn_jax.conv3d against the "xla" engine (values and the
gradients of every differentiable input) and the float64 oracle of tests/conv3d_oracle.py.

A seeded random sweep over every option (CUDNN_JAX_SWEEP_N configurations, default 120;
CUDNN_JAX_SWEEP_SHARD="i/n" takes every n-th from the i-th; CUDNN_JAX_SWEEP_LOG=path.json
keeps the records) and named tests: the benchmark's block at a reduced size, determinism,
vmap, a batch-sharded call, and the flax blocks' default engine. Outputs are poisoned
(CUDNN_JAX_POISON_OUTPUTS, set by conftest.py), so an element left unwritten is a NaN.
"""

import collections
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cudnn_jax
from mesh_cases import mesh_or_skip
from conv3d_oracle import oracle
import gpu_sweep
from gpu_sweep import Declined, rel_err

pytestmark = pytest.mark.gpu

# ||a - b|| / ||b||. bf16 rounds at 2**-9 relative. The cudnn engine rounds the
# convolution to the output dtype before a norm, and the output gradient to x's dtype
# before its dgrad and wgrad graphs; the xla engine stays in float32 until the end: a few
# 1e-3 apart in norm (up to 3e-3 in the engine's CPU emulation).
REL_TOL = 2e-2
# Gradients through relu's kink: where the two engines' pre-activations differ in sign by
# rounding, the derivative differs by a whole term; those sparse, full-size differences
# make a norm-wise error of about sqrt(their fraction), a few percent in bf16 (1.4e-2 in
# the emulation, after an rms norm).
KINK_GRAD_TOL = 8e-2
# Calls of another plan (a batch folded by vmap) may round differently.
PLAN_TOL = 1e-2
ORACLE_MAX_MACS = 3e8  # multiply-adds up to which the forward is also checked in float64

KERNELS = ((1, 1, 1), (3, 3, 3), (3, 1, 1), (1, 3, 3))
CHANNELS = (16, 32, 64, 128, 136)
NORMS = (None, "rms", "l2", "group")
ACTIVATIONS = (None, "silu", "gelu", "relu")
HALF = ("bfloat16", "float16")
ENGINE = "cudnn"  # the engine under test; "xla" is the reference
SERVES = f"engine {ENGINE!r} serves"


@dataclasses.dataclass(frozen=True)
class Config:
  """One conv3d call. ``bias``, ``residual``, ``norm_scale``, ``norm_bias``: the dtype of
  that input, or None when absent."""
  n: int = 1
  spatial: tuple = (5, 8, 8)  # T, H, W
  cin: int = 128
  cout: int = 128
  kernel: tuple = (3, 3, 3)
  padding: object = "SAME"  # "SAME", "VALID", "CAUSAL" or ((lo, hi),) * 3
  strides: tuple = (1, 1, 1)
  dilation: tuple = (1, 1, 1)
  dtype: str = "bfloat16"
  bias: str | None = None
  residual: str | None = None
  norm: str | None = None
  num_groups: int = 32
  norm_scale: str | None = None
  norm_bias: str | None = None
  activation: str | None = None
  out_dtype: str | None = None

  @property
  def out_shape(self):
    """[N, T', H', W', Cout]; ValueError when the dilated kernel does not fit."""
    x = jax.ShapeDtypeStruct((self.n, *self.spatial, self.cin), self.dtype)
    w = jax.ShapeDtypeStruct((*self.kernel, self.cin, self.cout), self.dtype)
    conv = functools.partial(cudnn_jax.conv3d, padding=self.padding, strides=self.strides,
                             dilation=self.dilation, implementation="xla")
    return jax.eval_shape(conv, x, w).shape

  @property
  def common(self):
    """A video VAE's usual call, which the cudnn engine must serve."""
    return (self.kernel == (3, 3, 3) and self.padding in ("SAME", "CAUSAL")
            and self.strides == (1, 1, 1) and self.dilation == (1, 1, 1)
            and self.dtype == "bfloat16" and self.cin == self.cout == 128)

  def kwargs(self):
    """conv3d's static arguments."""
    return dict(padding=self.padding, strides=self.strides, dilation=self.dilation,
                norm=self.norm, num_groups=self.num_groups, activation=self.activation,
                out_dtype=self.out_dtype)

  def macs(self):
    return int(np.prod(self.out_shape)) * self.cin * int(np.prod(self.kernel))

  def describe(self):
    short = lambda d: {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}.get(d, d)
    parts = [short(self.dtype), f"x{[self.n, *self.spatial, self.cin]}",
             f"w{[*self.kernel, self.cin, self.cout]}", f"pad={self.padding}",
             f"s={self.strides}", f"d={self.dilation}"]
    for name in ("bias", "residual", "norm_scale", "norm_bias"):
      if getattr(self, name):
        parts.append(f"{name}={short(getattr(self, name))}")
    if self.norm:
      parts.append(f"norm={self.norm}" + (f"/{self.num_groups}" if self.norm == "group" else ""))
    if self.activation:
      parts.append(f"act={self.activation}")
    if self.out_dtype:
      parts.append(f"out={short(self.out_dtype)}")
    return " ".join(parts)


def make_case(cfg: Config, seed=0):
  """(inputs, cotangent): the differentiable inputs by conv3d's argument names, and a
  float32 cotangent of the output."""
  rng = np.random.default_rng(seed)
  normal = lambda shape, dtype, scale=1.0: jnp.asarray(
      scale * rng.standard_normal(shape), dtype)
  fan_in = cfg.cin * int(np.prod(cfg.kernel))
  inputs = dict(x=normal((cfg.n, *cfg.spatial, cfg.cin), cfg.dtype),
                w=normal((*cfg.kernel, cfg.cin, cfg.cout), cfg.dtype, fan_in ** -0.5))
  shapes = dict(bias=(cfg.cout,), residual=cfg.out_shape, norm_scale=(cfg.cout,),
                norm_bias=(cfg.cout,))
  for name, shape in shapes.items():
    if getattr(cfg, name):
      inputs[name] = normal(shape, getattr(cfg, name), 0.5 if name != "norm_scale" else 1.0)
  return inputs, jnp.asarray(rng.standard_normal(cfg.out_shape), jnp.float32)


def engine_fns(cfg: Config, implementation):
  """(forward alone, (out, gradients of every input) for a cotangent): one engine, jitted."""
  def forward(inputs):
    return cudnn_jax.conv3d(**inputs, **cfg.kwargs(), implementation=implementation)

  def with_grads(inputs, cotangent):
    out, pull = jax.vjp(forward, inputs)
    return out, pull(cotangent.astype(out.dtype))[0]
  return jax.jit(forward), jax.jit(with_grads)


def all_finite(x):
  return bool(np.all(np.isfinite(np.asarray(jnp.asarray(x, jnp.float32)))))


def compare(cfg: Config, seed=0, with_oracle=None):
  """{quantity: error} and a list of problems of the cudnn engine on ``cfg``; raises
  Declined (with the engine's reason) when it does not serve the call."""
  inputs, cotangent = make_case(cfg, seed)
  forward, with_grads = engine_fns(cfg, ENGINE)
  try:
    out, grads = jax.block_until_ready(with_grads(inputs, cotangent))
    alone = jax.block_until_ready(forward(inputs))
  except cudnn_jax.UnsupportedError as e:
    raise Declined(str(e)) from None
  ref_out, ref_grads = engine_fns(cfg, "xla")[1](inputs, cotangent)

  errors, problems = {}, []

  def check(name, value, tol):
    errors[name] = value
    if not value <= tol:
      problems.append(f"{name}: {value:.3g} > {tol}")

  want_dtype = jnp.dtype(cfg.out_dtype or cfg.dtype)
  if out.shape != cfg.out_shape or out.dtype != want_dtype or alone.dtype != want_dtype:
    problems.append(f"out: {out.shape} {out.dtype}, expected {cfg.out_shape} {want_dtype}")
  check("out", rel_err(out, ref_out), REL_TOL)
  check("out alone", rel_err(alone, ref_out), REL_TOL)
  grad_tol = KINK_GRAD_TOL if cfg.activation == "relu" else REL_TOL
  for name in inputs:
    check(f"d{name}", rel_err(grads[name], ref_grads[name]), grad_tol)
  for name, value in [("out", out), ("out alone", alone)] + [
      (f"d{k}", g) for k, g in grads.items()]:
    if not all_finite(value):
      problems.append(f"{name}: NaN or inf")
  if with_oracle is None:
    with_oracle = cfg.macs() <= ORACLE_MAX_MACS
  if with_oracle:
    kwargs = {k: v for k, v in cfg.kwargs().items() if k != "out_dtype"}
    check("out vs oracle", rel_err(out, oracle(**inputs, **kwargs)), REL_TOL)
  return errors, problems


def assert_matches(cfg, **kwargs):
  errors, problems = compare(cfg, **kwargs)
  assert not problems, f"{cfg.describe()}: {problems} (errors {errors})"


# ---------------------------------------------------------------------------------------
# Named tests.

# The benchmark's block (bench/conv3d.py) at its first shape [1, 17, 128, 128, 128],
# reduced in time and space.
BLOCK = Config(n=1, spatial=(9, 32, 32), cin=128, cout=128, padding="CAUSAL",
               bias="bfloat16", residual="bfloat16", norm="rms", norm_scale="bfloat16",
               activation="silu")


def test_benchmark_block_matches_xla_and_oracle():
  inputs, _ = make_case(BLOCK)
  assert SERVES in cudnn_jax.explain("conv3d", **inputs, **BLOCK.kwargs())
  assert_matches(BLOCK, with_oracle=True)


def test_two_identical_calls_are_identical():
  """The same call twice: bitwise the same output and gradients (no atomics-ordered sums
  in the plans chosen)."""
  inputs, cotangent = make_case(BLOCK, seed=1)
  with_grads = engine_fns(BLOCK, ENGINE)[1]
  first, second = (jax.device_get(with_grads(inputs, cotangent)) for _ in range(2))
  same = jax.tree.map(np.array_equal, first, second)
  assert all(jax.tree.leaves(same)), same


@pytest.mark.parametrize("shared_weights", [True, False], ids=["shared_w", "batched_w"])
def test_vmap_matches_loop(shared_weights):
  """jax.vmap over a leading axis of every input (or of x and residual, with the weights
  shared): values and gradients equal those of one call per element."""
  cfg = Config(n=2, spatial=(4, 8, 8), cin=64, cout=64, padding="CAUSAL", bias="bfloat16",
               residual="bfloat16", norm="group", num_groups=8, norm_scale="bfloat16",
               activation="silu")
  cases = [make_case(cfg, seed) for seed in range(3)]
  per_element = ("x", "residual") if shared_weights else tuple(cases[0][0])
  axes = {k: 0 if k in per_element else None for k in cases[0][0]}
  stacked = {k: jnp.stack([c[0][k] for c in cases]) if axes[k] == 0 else cases[0][0][k]
             for k in axes}
  cotangents = jnp.stack([c[1] for c in cases])
  forward = lambda d: cudnn_jax.conv3d(**d, **cfg.kwargs(), implementation=ENGINE)

  @jax.jit
  def batched(d, ct):
    out, pull = jax.vjp(jax.vmap(forward, in_axes=(axes,)), d)
    return out, pull(ct.astype(out.dtype))[0]

  out, grads = batched(stacked, cotangents)
  with_grads = engine_fns(cfg, ENGINE)[1]
  loop = [with_grads({k: v[i] if axes[k] == 0 else v for k, v in stacked.items()},
                     cotangents[i]) for i in range(len(cases))]
  for i, (out_i, grads_i) in enumerate(loop):
    assert rel_err(out[i], out_i) <= PLAN_TOL, f"out[{i}]"
    for k in per_element:
      assert rel_err(grads[k][i], grads_i[k]) <= PLAN_TOL, f"d{k}[{i}]"
  for k in set(axes) - set(per_element):  # shared: the gradient sums over the elements
    total = sum(jnp.asarray(g[k], jnp.float32) for _, g in loop)
    assert rel_err(grads[k], total) <= PLAN_TOL, f"d{k}"


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_batch_sharded_call_on_a_one_device_mesh(axis_type):
  """x, residual and the cotangent sharded along the batch on a mesh of one GPU: the
  values and gradients of the unsharded call, and the output keeps the sharding."""
  cfg = dataclasses.replace(BLOCK, n=2, spatial=(5, 16, 16), cin=64, cout=64)
  inputs, cotangent = make_case(cfg)
  with_grads = engine_fns(cfg, ENGINE)[1]
  want_out, want_grads = with_grads(inputs, cotangent)
  mesh = mesh_or_skip((1,), ("b",), axis_type)
  with jax.set_mesh(mesh):
    batch = NamedSharding(mesh, P("b"))
    sharded = dict(inputs, x=jax.device_put(inputs["x"], batch),
                   residual=jax.device_put(inputs["residual"], batch))
    out, grads = with_grads(sharded, jax.device_put(cotangent, batch))
  if axis_type == "Explicit":  # the sharding is the result's type (one device: under Auto
    assert out.sharding.spec[0] == "b", out.sharding  # axes any sharding is equivalent)
  assert rel_err(out, want_out) <= PLAN_TOL
  for k, g in grads.items():
    assert rel_err(g, want_grads[k]) <= PLAN_TOL, f"d{k}"


def recorded_conv3d_calls(monkeypatch, fn, *args):
  """``fn(*args)`` with every cudnn_jax.conv3d call's arguments recorded (arrays as
  ShapeDtypeStructs): (fn's result, [(args, kwargs)])."""
  calls, real = [], cudnn_jax.conv3d
  spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") else a

  def recording(*a, **kw):
    calls.append(jax.tree.map(spec, (a, kw)))
    return real(*a, **kw)

  with monkeypatch.context() as m:
    m.setattr(cudnn_jax, "conv3d", recording)
    out = fn(*args)
  return out, calls


def flax_block(api, in_features, features):
  """The CausalConv3dBlock of ``api`` ("linen" or "nnx") in bf16 as a function
  ``(x, implementation) -> y``, its parameters fixed."""
  if api == "linen":
    from cudnn_jax import flax_modules  # pylint: disable=g-import-not-at-top
    layer = flax_modules.CausalConv3dBlock(features, dtype=jnp.bfloat16)
    x = jnp.zeros((1, 3, 4, 4, in_features), jnp.bfloat16)
    params = layer.init(jax.random.key(0), x)
    return lambda x, impl: layer.clone(implementation=impl).apply(params, x)
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from cudnn_jax.flax_modules import nnx as fnnx  # pylint: disable=g-import-not-at-top
  layer = fnnx.CausalConv3dBlock(in_features, features, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))

  def run(x, impl):
    layer.implementation = impl
    return layer(x)
  return run


@pytest.mark.parametrize("in_features,features", [(128, 128), (64, 128)],
                         ids=["same_width", "projected_skip"])
@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_flax_block_chooses_cudnn_by_default(monkeypatch, api, in_features, features):
  """Every conv3d call of the block, as the block makes it, is served by the cudnn engine
  when no implementation is named; the block's output equals it on the xla engine."""
  block = flax_block(api, in_features, features)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 5, 16, 16, in_features)),
                  jnp.bfloat16)
  out, calls = recorded_conv3d_calls(monkeypatch, block, x, None)
  # Two 3x3x3 convolutions, and a 1x1x1 one projecting the skip when the widths differ.
  assert len(calls) == (2 if in_features == features else 3), calls
  for args, kwargs in calls:
    text = cudnn_jax.explain("conv3d", *args, **kwargs)
    assert SERVES in text, text
  assert out.shape == (*x.shape[:-1], features)
  assert all_finite(out)
  assert rel_err(out, block(x, "xla")) <= REL_TOL


# ---------------------------------------------------------------------------------------
# The randomized sweep.


def random_config(rng, common=False):
  """A random call over every option; ``common``: one of the usual VAE calls (3x3x3,
  SAME or CAUSAL, stride 1, bf16, 128 channels) with random other options."""
  pick = lambda options: options[rng.integers(len(options))]
  while True:
    kernel = pick(KERNELS)
    padding = pick(("SAME", "VALID", "CAUSAL", "explicit"))
    if padding == "explicit":  # asymmetric
      padding = tuple((int(rng.integers(0, 3)), int(rng.integers(0, 3))) for _ in range(3))
    cfg = Config(
        n=int(rng.integers(1, 3)),
        spatial=(pick((1, 2, 3, 5, 8)), pick((4, 5, 7, 8, 12, 16)), pick((4, 6, 8, 13, 16))),
        cin=3 if rng.random() < 0.04 else pick(CHANNELS), cout=pick(CHANNELS), kernel=kernel,
        padding=padding,
        strides=tuple(pick((1, 2)) for _ in range(3)) if rng.random() < 0.3 else (1, 1, 1),
        dilation=tuple(pick((1, 2)) for _ in range(3)) if rng.random() < 0.2 else (1, 1, 1),
        dtype="bfloat16" if rng.random() < 0.7 else "float16",
        activation=pick(ACTIVATIONS), norm=pick(NORMS),
        out_dtype="float32" if rng.random() < 0.25 else None)
    if common:
      cfg = dataclasses.replace(cfg, kernel=(3, 3, 3), padding=pick(("SAME", "CAUSAL")),
                                strides=(1, 1, 1), dilation=(1, 1, 1), dtype="bfloat16",
                                cin=128, cout=128)
    try:
      positions = int(np.prod(cfg.out_shape[1:4]))
      break
    except ValueError:  # the dilated kernel does not fit: draw again
      continue

  def dtype_of(p, dtypes):
    """One of ``dtypes`` with probability p, else None (the input is absent)."""
    return pick(dtypes) if rng.random() < p else None

  # bias and the norm's vectors mostly in x's dtype, sometimes float32; the residual also
  # in the other half type.
  vector = (cfg.dtype,) * 4 + ("float32",)
  other_half = HALF[1 - HALF.index(cfg.dtype)]
  options = dict(bias=dtype_of(0.6, vector),
                 residual=dtype_of(0.5, (cfg.dtype, cfg.dtype, "float32", other_half)))
  if cfg.norm:
    options.update(norm_scale=dtype_of(0.5, vector), norm_bias=dtype_of(0.5, vector))
  if cfg.norm == "group":
    # At least 2 channels a group (with one, the norm cancels the bias exactly: a zero
    # gradient compared relatively) and at least 64 values, so no statistic is degenerate.
    fits = [g for g in (1, 2, 4, 8, 16, 32)
            if cfg.cout % g == 0 and cfg.cout // g >= 2 and positions * cfg.cout // g >= 64]
    options.update(num_groups=pick(fits or [1]))
  return dataclasses.replace(cfg, **options)


def sweep_configs():
  rng = np.random.default_rng(20250307)
  count = int(os.environ.get("CUDNN_JAX_SWEEP_N", "120"))
  return gpu_sweep.shard([(i, random_config(rng, common=i % 8 == 0)) for i in range(count)])


def summary(records):
  """The counts, the decline reasons, the largest error of each quantity, and a table of
  the configurations that failed."""
  status = collections.Counter(r["status"] for r in records)
  lines = ["conv3d cudnn sweep: " + ", ".join(f"{k} {v}" for k, v in sorted(status.items()))]
  reasons = collections.Counter(r["reason"][:160] for r in records
                                if r["status"] == "declined")
  for reason, count in reasons.most_common():
    lines.append(f"  declined x{count}: {reason}")
  worst = collections.defaultdict(float)
  for r in records:
    for name, value in r.get("errors", {}).items():
      worst[name] = max(worst[name], value)
  lines.append("  max error: " + ", ".join(f"{k} {v:.2e}" for k, v in sorted(worst.items())))
  failed = [r for r in records if r["status"] == "failed"]
  if failed:
    lines.append(f"  {'seed':>4}  {'configuration':<90} problems")
    for r in failed:
      lines.append(f"  {r['seed']:>4}  {r['config']:<90} {'; '.join(r['problems'])}")
  return "\n".join(lines)


def test_conv3d_random_sweep(capsys):
  def case(seed, cfg):
    record = dict(config=cfg.describe(), seed=seed, common=cfg.common)
    return record, lambda: (*compare(cfg, seed), None)

  records = gpu_sweep.run([case(*c) for c in sweep_configs()], capsys,
                          os.environ.get("CUDNN_JAX_SWEEP_LOG"))
  text = summary(records)
  with capsys.disabled():
    print("\n" + text)

  failed = [r for r in records if r["status"] == "failed"]
  common_declined = [r for r in records if r["common"] and r["status"] == "declined"]
  assert any(r["status"] == "ok" for r in records), text
  assert not failed, f"{len(failed)} of {len(records)} configurations failed:\n{text}"
  assert not common_declined, (
      "the cudnn engine declined common configurations (3x3x3, SAME/CAUSAL, stride 1, "
      "bf16, 128 channels):\n" + "\n".join(f"{r['config']}: {r['reason']}"
                                           for r in common_declined))
