"""Benchmark of cudnn_jax.conv3d on a video VAE block against the same block in plain JAX.

    python bench/conv3d.py [--shapes NxTxHxWxC,...] [--engines cudnn,xla] [--calls 20]
                           [--padding CAUSAL] [--device-time] [--out DIR]

The block: ``conv3d(x, w, bias, residual=r, norm="rms", norm_scale=s, activation="silu")``,
x ``[N, T, H, W, C]``, w ``[3, 3, 3, C, C]``, stride 1, bf16, padded CAUSAL as a causal
video VAE pads (time padded in front only, so no frame sees a later one; height and width
SAME; --padding SAME for the symmetric block). Shapes, by default: [1,17,128,128,128],
[1,9,256,256,128], [1,5,64,64,512].
Rows per shape, forward and forward+backward (the gradients of x, w, bias and norm_scale):
- "cudnn_jax <engine>": cudnn_jax.conv3d on each engine of --engines (for "cudnn", the
  placement of its pointwise tail by use: ``cudnn_jax.ops.conv3d.TAIL``); for "cudnn" also
  "cudnn_jax cudnn, tail in xla", the same engine with its pointwise tail after a graph of
  the convolution alone for every use, and "cudnn_jax cudnn, tail in cudnn", with bias,
  residual and the norm's sums fused into the graph for every use: the two placements
  measured in one run, from which TAIL is chosen;
- anchors, always in the same run: "jax block" (the baseline), the block written in plain
  JAX as a user would (lax.conv_general_dilated in x's dtype, then bias, residual, RMSNorm
  and SiLU in float32, one jit), and "lax conv", lax.conv_general_dilated alone (the
  gradients of x and w).
Times: "ms", the median wall time of --calls jitted calls, each waited for; "b2b", --calls
calls issued back to back with one wait at the end (best of three), the device throughput a
model sees, without each call's launch and wait latency; with --device-time, "dev", the
profiler's device time of a call. TFLOP/s: 2*N*T'*H'*W'*Cout*Cin*27 for the forward, 3x
that for forward+backward. Speed-up: the baseline's time over the row's, both on the same
clock (dev where measured, else b2b). "rel diff": the forward's ||y - y_block|| / ||y_block||.
Targets, printed beside the numbers: the cudnn engine's forward <= 0.45 ms at
[1,17,128,128,128] and >= 2.2x the jax block at every shape; forward+backward >= 1.5x.
Engines that decline a call are reported with their reason. Writes DIR/conv3d.json and
DIR/conv3d.png, ms per shape and engine (DIR defaults to bench/results). Without a GPU only
with --shapes (small ones): a smoke test.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time

if "--device-time" in sys.argv:  # one profiler event per kernel, not per CUDA graph
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp
import numpy as np

import cudnn_jax
from cudnn_jax.engines import ENGINE_NAMES
from cudnn_jax.ops import conv3d as conv3d_ops
from harness import (arg_parser, device_ms, error_text, pyplot, rel_diff, save_figure,
                     time_back_to_back, time_calls, write_results)

WARMUP = 3
KERNEL = (3, 3, 3)
DIMENSIONS = ("NDHWC", "DHWIO", "NDHWC")
BASELINE = "jax block"
SHAPES = "1x17x128x128x128,1x9x256x256x128,1x5x64x64x512"
TARGET_FORWARD_MS = 0.45  # at the first of SHAPES
TARGET_SPEEDUP = {False: 2.2, True: 1.5}  # over the baseline; key: backward
TIMES = ("ms_device", "ms_b2b", "ms")  # preferred clock first


@dataclasses.dataclass(frozen=True)
class Shape:
  """x [n, t, h, w, c]; the block maps c channels to c."""
  n: int
  t: int
  h: int
  w: int
  c: int

  @classmethod
  def parse(cls, text):
    return cls(*map(int, text.lower().split("x")))

  @property
  def label(self):
    return "x".join(map(str, dataclasses.astuple(self)))

  def flops(self, backward):
    """2*N*T'*H'*W'*Cout*Cin*27 (stride 1: the output keeps x's extents); 3x with the
    backward (the data and the weight gradient)."""
    forward = 2.0 * self.n * self.t * self.h * self.w * self.c * self.c * np.prod(KERNEL)
    return forward * (3 if backward else 1)


def lax_padding(padding, kernel):
  """Explicit padding of a stride-1 convolution: SAME, or CAUSAL (time's all in front)."""
  same = [((k - 1) // 2, (k - 1) - (k - 1) // 2) for k in kernel]
  return [(kernel[0] - 1, 0)] + same[1:] if padding == "CAUSAL" else same


def lax_conv(x, w, padding):
  return jax.lax.conv_general_dilated(x, w, (1, 1, 1), lax_padding(padding, w.shape[:3]),
                                      dimension_numbers=DIMENSIONS)


def jax_block(x, w, b, r, s, *, padding, eps=1e-6):
  """The block in plain JAX: the convolution in x's dtype, then bias, residual, RMSNorm
  (times s) and SiLU in float32, cast back to x's dtype."""
  f32 = lambda a: a.astype(jnp.float32)
  y = f32(lax_conv(x, w, padding)) + f32(b) + f32(r)
  y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + eps) * f32(s)
  return jax.nn.silu(y).astype(x.dtype)


def tail_in(tail, block):
  """``block`` traced with the cudnn engine's pointwise tail placed in ``tail`` for every
  use."""
  def traced(*args):
    saved, conv3d_ops.TAIL = conv3d_ops.TAIL, dict.fromkeys(conv3d_ops.USES, tail)
    try:
      return block(*args)
    finally:
      conv3d_ops.TAIL = saved
  return traced


def contenders(engines, padding):
  """name -> (block (x, w, b, r, s) -> y, the positions of the inputs its backward
  differentiates)."""
  out = {}
  for engine in engines:
    conv = functools.partial(cudnn_jax.conv3d, padding=padding, norm="rms",
                             activation="silu", implementation=engine)
    block = lambda x, w, b, r, s, conv=conv: conv(x, w, b, residual=r, norm_scale=s)
    out[f"cudnn_jax {engine}"] = (block, (0, 1, 2, 4))
    if engine == "cudnn":
      for tail in ("cudnn", "xla"):
        out[f"cudnn_jax cudnn, tail in {tail}"] = (tail_in(tail, block), (0, 1, 2, 4))
  out[BASELINE] = (functools.partial(jax_block, padding=padding), (0, 1, 2, 4))
  out["lax conv"] = (lambda x, w, b, r, s: lax_conv(x, w, padding), (0, 1))
  return out


def make_step(block, argnums, backward):
  """One jitted call of (x, w, b, r, s, dy): the block's output, or the gradients of the
  inputs at ``argnums`` for the output cotangent dy."""
  def step(x, w, b, r, s, dy):
    args = (x, w, b, r, s)
    if not backward:
      return block(*args)

    def of(*diff):
      full = list(args)
      for i, a in zip(argnums, diff):
        full[i] = a
      return block(*full)
    y, pull = jax.vjp(of, *(args[i] for i in argnums))
    return pull(dy.astype(y.dtype))
  return jax.jit(step)


def inputs(shape, dtype=jnp.bfloat16, seed=0):
  """(x, w, bias, residual, norm_scale, dy), random."""
  keys = jax.random.split(jax.random.key(seed), 6)
  normal = lambda key, dims, scale=1.0: (scale * jax.random.normal(key, dims)).astype(dtype)
  x_shape = dataclasses.astuple(shape)
  w = normal(keys[1], (*KERNEL, shape.c, shape.c), (np.prod(KERNEL) * shape.c) ** -0.5)
  args = (normal(keys[0], x_shape), w, normal(keys[2], (shape.c,), 0.1),
          normal(keys[3], x_shape), (1 + 0.1 * jax.random.normal(keys[4], (shape.c,))).astype(
              dtype), normal(keys[5], x_shape))
  return jax.block_until_ready(args)


def measure(name, step, args, shape, backward, calls, device_time):
  """One row: times in ms and TFLOP/s, the forward's output (``_out``), or the error."""
  row = dict(shape=shape.label, backward=backward, engine=name)
  try:
    row["ms"] = 1e3 * time_calls(step, args, calls, WARMUP)
    row["ms_b2b"] = 1e3 * time_back_to_back(step, args, calls, WARMUP)
    if device_time:
      row["ms_device"] = device_ms(step, args)
    if not backward:
      row["_out"] = step(*args)
  except Exception as e:  # pylint: disable=broad-except
    row["error"] = error_text(e)
  for key in TIMES:
    if row.get(key):
      row[key.replace("ms", "tflops")] = shape.flops(backward) / (row[key] * 1e-3) / 1e12
  return row


def clock(row, base):
  """The preferred time measured in both rows: (key, row's ms, base's ms), or None."""
  for key in TIMES:
    if row.get(key) and base.get(key):
      return key, row[key], base[key]
  return None


def best_time(row):
  """(key, ms) of the row's preferred time, or None when it has none."""
  return next(((key, row[key]) for key in TIMES if row.get(key)), None)


def run(shapes, engines, padding, calls, device_time):
  rows = []
  table = contenders(engines, padding)
  for shape in shapes:
    args = inputs(shape)
    for backward in (False, True):
      group = [measure(name, make_step(block, argnums, backward), args, shape, backward,
                       calls, device_time)
               for name, (block, argnums) in table.items()]
      base = next(r for r in group if r["engine"] == BASELINE)
      for r in group:
        if (both := clock(r, base)) is not None:
          r["speedup"] = both[2] / both[1]  # > 1: faster than the baseline
          r["speedup_clock"] = both[0]
        if "_out" in r and "_out" in base and r["engine"] != "lax conv":
          r["rel_diff"] = rel_diff(r["_out"], base["_out"])
      for r in group:
        r.pop("_out", None)
        print_row(r)
      rows.extend(group)
    del args
  return rows


def target_checks(rows, engine="cudnn_jax cudnn"):
  """The targets of ``engine``'s rows: [{what, value, target, met}]; value None when the
  row has no time (declined or failed)."""
  checks = []
  for r in rows:
    if r["engine"] != engine:
      continue
    pass_ = "fwd+bwd" if r["backward"] else "fwd"
    measured = best_time(r)
    if not r["backward"] and r["shape"] == SHAPES.split(",")[0]:
      checks.append(dict(what=f"{r['shape']} {pass_} ms ({measured[0] if measured else '-'})",
                         value=measured[1] if measured else None,
                         target=f"<= {TARGET_FORWARD_MS}",
                         met=bool(measured) and measured[1] <= TARGET_FORWARD_MS))
    goal = TARGET_SPEEDUP[r["backward"]]
    checks.append(dict(what=f"{r['shape']} {pass_} speed-up over the {BASELINE}",
                       value=r.get("speedup"), target=f">= {goal}x",
                       met=r.get("speedup") is not None and r["speedup"] >= goal))
    if not measured:
      checks[-1]["note"] = r.get("error", "not measured")
  return checks


def print_targets(checks):
  print("targets (cudnn_jax cudnn):")
  if not checks:
    print("  - (the cudnn engine was not run)")
  for c in checks:
    value = "-" if c["value"] is None else f"{c['value']:.3f}"
    note = f"  ({c['note']})" if c.get("note") else ""
    print(f"  {c['what']:<60} {value:>8}  target {c['target']:<8} "
          f"{'met' if c['met'] else 'MISSED'}{note}")


HEADER = (f"{'shape':<18} {'pass':>7} {'engine':<16} {'ms':>8} {'TFLOP/s':>8} {'ms(b2b)':>8} "
          f"{'TFLOP/s':>8} {'ms(dev)':>8} {'TFLOP/s':>8} {'speedup':>8} {'rel diff':>9}")


def print_row(r):
  f = lambda key, fmt: format(r[key], fmt) if r.get(key) is not None else "-"
  pass_ = "fwd+bwd" if r["backward"] else "fwd"
  line = (f"{r['shape']:<18} {pass_:>7} {r['engine']:<16} {f('ms', '.3f'):>8} "
          f"{f('tflops', '.3g'):>8} {f('ms_b2b', '.3f'):>8} {f('tflops_b2b', '.3g'):>8} "
          f"{f('ms_device', '.3f'):>8} {f('tflops_device', '.3g'):>8} "
          f"{f('speedup', '.2f'):>8} {f('rel_diff', '.1e'):>9}")
  print(line + (f"  ({r['error']})" if r.get("error") else ""), flush=True)


def plot(rows, path, padding):
  """ms per shape and engine (the speed-up's clock), forward and forward+backward."""
  plt = pyplot()

  shapes = list(dict.fromkeys(r["shape"] for r in rows))
  names = list(dict.fromkeys(r["engine"] for r in rows))
  key = next((k for k in TIMES if any(r.get(k) for r in rows)), "ms")
  width = 0.8 / len(names)
  fig, axes = plt.subplots(1, 2, figsize=(max(9, 3 * len(shapes)), 4.5))
  for ax, backward in zip(axes, (False, True)):
    for i, name in enumerate(names):
      for j, shape in enumerate(shapes):
        r = next((r for r in rows if r["engine"] == name and r["shape"] == shape
                  and r["backward"] == backward), {})
        x = j + i * width
        if r.get(key):
          ax.bar(x, r[key], width, color=f"C{i}", label=name if j == 0 else None)
        else:  # declined or failed
          ax.text(x, 0.02, "n/a", rotation=90, ha="center", va="bottom", fontsize=7,
                  transform=ax.get_xaxis_transform())
    ax.set_xticks(np.arange(len(shapes)) + 0.4 - width / 2, shapes, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel(f"ms per call ({key.replace('ms_', '') if key != 'ms' else 'waited'})")
    ax.set_title("forward+backward" if backward else "forward")
    ax.legend(fontsize=8)
  fig.suptitle(f"conv3d VAE block (3x3x3 {padding}, RMSNorm, SiLU), bf16, "
               f"{jax.devices()[0].device_kind}")
  save_figure(fig, path)


def main():
  parser = arg_parser(__doc__)
  parser.add_argument("--shapes", default=None,
                      help=f"comma-separated NxTxHxWxC (default: {SHAPES})")
  parser.add_argument("--engines", default="cudnn,xla",
                      help="cudnn_jax engines, comma-separated (the anchors always run)")
  parser.add_argument("--calls", type=int, default=20, help="timed calls per measurement")
  parser.add_argument("--padding", default="CAUSAL", choices=("CAUSAL", "SAME"))
  parser.add_argument("--device-time", action="store_true",
                      help="also the profiler's device time of a call")
  args = parser.parse_args()
  engines = [e for e in args.engines.split(",") if e]
  if unknown := set(engines) - set(ENGINE_NAMES):
    parser.error(f"--engines: unknown {sorted(unknown)}; expected some of {ENGINE_NAMES}")
  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu and args.shapes is None:
    parser.error(f"the default shapes need a GPU (backend is {jax.default_backend()!r}); "
                 "give small --shapes for a smoke test")
  shapes = [Shape.parse(s) for s in (args.shapes or SHAPES).split(",")]
  x = jax.ShapeDtypeStruct(dataclasses.astuple(shapes[0]), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((*KERNEL, shapes[0].c, shapes[0].c), jnp.bfloat16)
  c = jax.ShapeDtypeStruct((shapes[0].c,), jnp.bfloat16)
  print(cudnn_jax.explain("conv3d", x, w, c, residual=x, norm="rms", norm_scale=c,
                          activation="silu", padding=args.padding))
  print(HEADER)
  start = time.perf_counter()
  rows = run(shapes, engines, args.padding, args.calls, args.device_time)
  elapsed = time.perf_counter() - start
  checks = target_checks(rows)
  print_targets(checks)
  json_path = write_results(args.out, "conv3d", rows, dtype="bfloat16", padding=args.padding,
                            kernel=KERNEL, baseline=BASELINE, targets=checks,
                            seconds=elapsed, warmup=WARMUP, calls=args.calls,
                            cache_info=cudnn_jax.cache_info())
  png_path = os.path.join(args.out, "conv3d.png")
  plot(rows, png_path, args.padding)
  print(f"{elapsed:.0f} s; wrote {json_path} and {png_path}")


if __name__ == "__main__":
  main()
