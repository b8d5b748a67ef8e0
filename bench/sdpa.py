"""Benchmark of cudnn_jax.sdpa against jax.nn.dot_product_attention.

    python bench/sdpa.py [--out DIR] [--quick] [--no-loop] [--tables dense,varlen,paged,fp8]

On a GPU: B*S = 16384 tokens, 16 heads, head dim 128, bfloat16, S in {1k, 4k, 8k, 16k},
causal and not, forward and forward+backward, for cudnn_jax.sdpa (implementation="cudnn")
and jax.nn.dot_product_attention with implementation "cudnn" and "xla"; plus a decode
row (B=64, 32 query heads, 8 kv heads, kv length 8192, one query token). Two timings per
case: the median wall time of single jitted calls (block_until_ready around each), and
the median per-call time of 10 calls chained inside one jitted function (straight-line
code: no dispatch gaps).
When torch imports and sees the GPU, torch's cuDNN attention runs on the same buffers
(shared through DLPack; the forward without autograd, as inference), timed by CUDA events:
one call, and 10 calls between two events.
FLOPs: 4*B*N*S^2*H forward (half when causal), x3.5 for forward+backward.

The varlen, paged and fp8 tables are those of bench/sdpa_features.py (packed sequences
against padded jax.nn, paged decode in GB/s) and bench/sdpa_fp8.py (FP8 against bf16),
whose docstrings describe them; here they land in the same results file.

With --quick: tiny shapes (on CPU, the xla engines only), for a smoke test.
Writes DIR/sdpa.json and DIR/sdpa.png, and the charts of the other tables
(sdpa_features.png, sdpa_fp8.png); DIR defaults to bench/results.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

# torch shares the GPU with JAX in this process when it is there: leave it room.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")

import cudnn_jax  # pylint: disable=wrong-import-position
import sdpa_features  # pylint: disable=wrong-import-position
import sdpa_fp8  # pylint: disable=wrong-import-position
from harness import (arg_parser, device_ms, error_text, load_torch, pyplot, rel_diff, save_figure,
                     time_calls, torch_time_ms, write_results)

WARMUP = 3
CALLS = 20
LOOP = 10  # calls inside one jitted loop
LOOP_REPEATS = 5
TABLES = ("dense",) + sdpa_features.CASES + ("fp8",)


@dataclasses.dataclass(frozen=True)
class Shape:
  b: int
  t: int
  s: int
  n: int
  k: int
  h: int
  causal: bool = False

  def flops(self, backward):
    f = 4.0 * self.b * self.n * self.t * self.s * self.h
    if self.causal:
      f /= 2
    return f * (3.5 if backward else 1.0)

  def kv_bytes(self, dtype):
    return 2 * self.b * self.s * self.k * self.h * jnp.dtype(dtype).itemsize


def engines(on_gpu, with_xla=True):
  """name -> attention function (q, k, v, is_causal) -> out; the first is ours."""
  ours = "cudnn_jax cudnn" if on_gpu else "cudnn_jax xla"
  out = {ours: functools.partial(cudnn_jax.sdpa, implementation=ours.split()[1])}
  if on_gpu:
    out["jax.nn cudnn"] = functools.partial(jax.nn.dot_product_attention,
                                            implementation="cudnn")
  if with_xla or not on_gpu:
    out["jax.nn xla"] = functools.partial(jax.nn.dot_product_attention, implementation="xla")
  return out


def skip_reason(engine, shape, backward, on_gpu):
  if not on_gpu or "xla" not in engine:
    return None
  if shape.s >= 16384 or (backward and shape.s >= 8192):
    return "too slow / too much memory for the xla engine"
  return None


def make_fns(attn, causal, backward, unroll=True):
  """(single call, LOOP chained calls) as jitted functions of (q, k, v, dout). The chain
  is straight-line code (``unroll``) or a ``fori_loop``, whose every iteration waits for the
  host to launch the next one (XLA reads the loop predicate back from the device)."""
  def step(q, k, v, dout):
    if not backward:
      return attn(q, k, v, is_causal=causal)
    loss = lambda q, k, v: jnp.sum(attn(q, k, v, is_causal=causal).astype(jnp.float32)
                                   * dout.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  def first(x):
    return jax.tree.leaves(x)[0].reshape(-1)[0].astype(jnp.float32)

  def loop(q, k, v, dout):
    def body(_, carry):
      # The inputs pass an optimization barrier together with the previous call's first
      # output element, so XLA can neither merge, hoist nor overlap the calls, and no
      # data is copied for it.
      q, k, v, acc = jax.lax.optimization_barrier(carry)
      return q, k, v, acc + first(step(q, k, v, dout))

    carry = (q, k, v, jnp.float32(0))
    if not unroll:
      return jax.lax.fori_loop(0, LOOP, body, carry)[3]
    for i in range(LOOP):
      carry = body(i, carry)
    return carry[3]

  return jax.jit(step), jax.jit(loop)


def inputs(shape, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (shape.b, shape.t, shape.n, shape.h), dtype)
  k = jax.random.normal(keys[1], (shape.b, shape.s, shape.k, shape.h), dtype)
  v = jax.random.normal(keys[2], (shape.b, shape.s, shape.k, shape.h), dtype)
  dout = jax.random.normal(keys[3], q.shape, dtype)
  return jax.block_until_ready((q, k, v, dout))


def new_row(name, shape, dtype, backward):
  return dict(engine=name, b=shape.b, t=shape.t, s=shape.s, n=shape.n, k=shape.k, h=shape.h,
              causal=shape.causal, backward=backward, dtype=jnp.dtype(dtype).name)


def add_rates(row, shape, dtype, backward):
  """TFLOP/s (and GB/s of K+V for decode) beside each time of ``row``."""
  for key in ("ms", "ms_in_jit", "ms_device"):
    if row.get(key):
      row[key.replace("ms", "tflops")] = shape.flops(backward) / (row[key] * 1e-3) / 1e12
      if shape.t == 1:
        row[key.replace("ms", "gbps")] = shape.kv_bytes(dtype) / (row[key] * 1e-3) / 1e9
  return row


def measure(name, attn, shape, dtype, backward, use_loop, args, device_time=False):
  """One row: times in ms (None when the engine cannot run it) and the error, if any."""
  row = new_row(name, shape, dtype, backward)
  single, looped = make_fns(attn, shape.causal, backward)
  try:
    row["ms"] = 1e3 * time_calls(single, args, CALLS)
    if device_time:
      row["ms_device"] = device_ms(single, args)
    if use_loop:
      row["ms_in_jit"] = 1e3 * time_calls(looped, args, LOOP_REPEATS, warmup=1) / LOOP
    if not backward:
      row["_out"] = single(*args)
  except Exception as e:  # pylint: disable=broad-except
    row["error"] = error_text(e)
  return add_rates(row, shape, dtype, backward)


def torch_step(torch, shape, backward, args):
  """A call of torch's cuDNN attention on BHSD views of the same BSHD buffers: forward
  without autograd, or forward and the input gradients for ``dout``."""
  from torch.nn import attention as tattn  # pylint: disable=g-import-not-at-top
  q, k, v, dout = (torch.from_dlpack(x).transpose(1, 2) for x in args)
  gqa = dict(enable_gqa=True) if shape.k != shape.n else {}

  def attend(q, k, v):
    with tattn.sdpa_kernel(tattn.SDPBackend.CUDNN_ATTENTION):
      return torch.nn.functional.scaled_dot_product_attention(
          q, k, v, is_causal=shape.causal, **gqa)

  if backward:
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    return lambda: torch.autograd.grad(attend(*leaves), leaves, dout)

  def step():
    with torch.no_grad():
      return attend(q, k, v)
  return step


def measure_torch(torch, shape, dtype, backward, args):
  """The row of torch's cuDNN attention."""
  row = new_row("torch cudnn", shape, dtype, backward)
  step = torch_step(torch, shape, backward, args)
  try:
    row["ms"] = torch_time_ms(torch, step, CALLS, WARMUP)
    row["ms_in_jit"] = torch_time_ms(torch, step, LOOP_REPEATS, 1, chained=LOOP)
    if not backward:
      row["_out"] = step().transpose(1, 2).float().cpu().numpy()
  except Exception as e:  # pylint: disable=broad-except
    row["error"] = error_text(e)
  return add_rates(row, shape, dtype, backward)


def run(quick, on_gpu, use_loop, with_xla=True, device_time=False):
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  if quick:
    tokens, n, h, seqs = 512, 2, 32, (64, 256)
    decode = Shape(b=4, t=1, s=256, n=4, k=2, h=32)
  else:
    tokens, n, h, seqs = 16384, 16, 128, (1024, 4096, 8192, 16384)
    decode = Shape(b=64, t=1, s=8192, n=32, k=8, h=128)
  cases = [(Shape(b=tokens // s, t=s, s=s, n=n, k=n, h=h, causal=c), bwd)
           for s in seqs for c in (False, True) for bwd in (False, True)]
  cases.append((decode, False))
  table = engines(on_gpu, with_xla)
  torch = load_torch()[0] if on_gpu else None
  baseline = "jax.nn cudnn" if on_gpu else "jax.nn xla"
  rows = []
  for shape, backward in cases:
    args = inputs(shape, dtype)
    group = []
    for name, attn in table.items():
      why = skip_reason(name, shape, backward, on_gpu)
      if why:
        group.append(dict(engine=name, s=shape.s, t=shape.t, causal=shape.causal,
                          backward=backward, skipped=why))
        continue
      group.append(measure(name, attn, shape, dtype, backward, use_loop, args, device_time))
    if torch is not None:
      group.append(measure_torch(torch, shape, dtype, backward, args))
    base = next((r for r in group if r["engine"] == baseline and r.get("ms")), None)
    for r in group:
      if base and r.get("ms"):
        r["ratio"] = base["ms"] / r["ms"]  # > 1: faster than the baseline
      if base and "_out" in r and "_out" in base:
        r["rel_diff_vs_baseline"] = rel_diff(r["_out"], base["_out"])
    for r in group:
      r.pop("_out", None)
      print_row(r)
    rows.extend(group)
    del args
  return rows, baseline


HEADER = (f"{'S':>6} {'T':>5} {'causal':>6} {'pass':>8} {'engine':<16} {'ms':>9} "
          f"{'TFLOP/s':>8} {'ms(jit10)':>10} {'TFLOP/s':>8} {'ms(dev)':>8} {'TFLOP/s':>8} "
          f"{'GB/s':>7} {'ratio':>6}")


def print_row(r):
  def f(key, fmt):
    return format(r[key], fmt) if r.get(key) is not None else "-"
  pass_ = "fwd+bwd" if r["backward"] else "fwd"
  line = (f"{r['s']:>6} {r['t']:>5} {str(r['causal']):>6} {pass_:>8} {r['engine']:<16} "
          f"{f('ms', '.3f'):>9} {f('tflops', '.1f'):>8} {f('ms_in_jit', '.3f'):>10} "
          f"{f('tflops_in_jit', '.1f'):>8} {f('ms_device', '.3f'):>8} "
          f"{f('tflops_device', '.1f'):>8} {f('gbps', '.0f'):>7} {f('ratio', '.2f'):>6}")
  note = r.get("skipped") or r.get("error")
  print(line + (f"  ({note})" if note else ""), flush=True)


def plot(rows, path, baseline):
  plt = pyplot()

  groups = []
  for r in rows:
    key = (r["s"], r["t"], r["causal"], r["backward"])
    if key not in groups:
      groups.append(key)
  names = list(dict.fromkeys(r["engine"] for r in rows))
  # Calls chained inside one jit carry no dispatch gaps: chart those when measured.
  metric = "tflops_in_jit" if any(r.get("tflops_in_jit") for r in rows) else "tflops"
  width = 0.8 / len(names)
  fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(groups)), 4.5))
  for i, name in enumerate(names):
    values = []
    for key in groups:
      r = next((r for r in rows if r["engine"] == name
                and (r["s"], r["t"], r["causal"], r["backward"]) == key), {})
      values.append(r.get(metric) or 0.0)
    ax.bar(np.arange(len(groups)) + i * width, values, width, label=name)
  labels = [f"{'decode ' if t == 1 else ''}S={s}\n{'causal ' if c else ''}"
            f"{'fwd+bwd' if b else 'fwd'}" for s, t, c, b in groups]
  ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2, labels, fontsize=7)
  ax.set_ylabel("TFLOP/s (" + ("10 calls in one jit" if metric == "tflops_in_jit"
                                else "single jitted call") + ")")
  ax.set_title(f"sdpa, {rows[0]['dtype']}, {jax.devices()[0].device_kind} "
               f"(baseline: {baseline})")
  ax.legend(fontsize=8)
  save_figure(fig, path)


def main():
  parser = arg_parser(__doc__)
  parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
  parser.add_argument("--no-xla", action="store_true", help="leave out jax.nn's xla engine")
  parser.add_argument("--no-loop", action="store_true",
                      help="skip the 10-calls-in-one-jit timing")
  parser.add_argument("--device-time", action="store_true",
                      help="also the profiler's device time of a single call (JAX rows)")
  parser.add_argument("--tables", default=",".join(TABLES),
                      help=f"comma-separated, of {', '.join(TABLES)}")
  args = parser.parse_args()
  tables = [t for t in args.tables.split(",") if t]
  if not tables or set(tables) - set(TABLES):
    parser.error(f"--tables: expected some of {', '.join(TABLES)}, got {args.tables!r}")
  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu and not args.quick:
    parser.error(f"the full benchmark needs a GPU (backend is {jax.default_backend()!r}); "
                 "use --quick for a smoke test")
  os.makedirs(args.out, exist_ok=True)
  start = time.perf_counter()
  rows, baseline, meta = [], None, {}
  if "dense" in tables:
    if on_gpu:
      probe = jax.ShapeDtypeStruct((1, 128, 16, 128), jnp.bfloat16)
      print(cudnn_jax.explain("sdpa", probe, probe, probe, implementation="cudnn"))
    print(HEADER)
    rows, baseline = run(args.quick, on_gpu, not args.no_loop, not args.no_xla,
                         args.device_time)
    plot(rows, os.path.join(args.out, "sdpa.png"), baseline)
  cases = [t for t in tables if t in sdpa_features.CASES]
  if cases:
    feature_rows, feature_meta = sdpa_features.collect(cases, args.quick, CALLS, args.out)
    meta["features"] = dict(rows=feature_rows, **feature_meta)
  if "fp8" in tables:
    fp8_rows, fp8_meta = sdpa_fp8.collect(args.quick, args.out)
    meta["fp8"] = dict(rows=fp8_rows, **fp8_meta)
  elapsed = time.perf_counter() - start
  json_path = write_results(args.out, "sdpa", rows, quick=args.quick, baseline=baseline,
                            seconds=elapsed, cache_info=cudnn_jax.cache_info(),
                            warmup=WARMUP, calls=CALLS, loop=LOOP, tables=tables, **meta)
  print(f"{elapsed:.0f} s; wrote {json_path} and the charts beside it")


if __name__ == "__main__":
  main()
