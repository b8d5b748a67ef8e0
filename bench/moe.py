"""Benchmark of cudnn_jax.grouped_gemm, gemm (+SwiGLU) and moe_mlp against plain XLA.

    python bench/moe.py [--out DIR] [--quick] [--cases grouped,square,swiglu,moe] [--device-time]

On a GPU, bfloat16:
- grouped GEMM forward, m32768 k4096 n2048 g8 and m65536 k2048 n1408 g64, with equal and
  Dirichlet-random group sizes: cudnn_jax.grouped_gemm (default engine, and the opt-in
  cudnn and cute engines), jax.lax.ragged_dot, and a dense matmul of the same FLOPs
  (2*m*k*n);
- square (only when asked for): one group of m = k = n = 8192, the grouped GEMM engines
  beside a dense matmul of the same shape;
- GEMM + SwiGLU, m16384 n4096 k4096: cudnn_jax.gemm(glu="swiglu") (default and the
  opt-in cute engine) against XLA's two dots and the gating; effective FLOPs 2*m*k*2n;
- moe_mlp forward+backward, T=16384 D=4096 F=2048 E=64 top-4 (SwiGLU), default and opt-in
  engines, against the same layer written with jax.lax.ragged_dot; FLOPs 3 * 6*T*k*D*F.
Each row: the median wall time of 20 jitted calls (block_until_ready around each) after
warm-up, and TFLOP/s; then "b2b": 20 calls issued back to back with one wait at the end
(best of three), the device throughput a model sees, without each call's launch and wait
latency (about 0.1 ms, which is 10% of a 1 ms GEMM); only for calls under 10 ms.
With --device-time, also "dev": the profiler's device time of a call (the sum of its kernels'
durations: what CUDA events around the call measure), for calls under 10 ms.
With --quick: tiny shapes (float32 on CPU), a smoke test.
Writes DIR/moe.json and DIR/moe.png (TFLOP/s per case, each engine beside the XLA anchors;
DIR defaults to bench/results).
"""

from __future__ import annotations

import functools
import os
import sys
import time

# The moe_mlp anchor (its lax.ragged_dot gradients) asks XLA for much memory at once; it
# runs at fewer tokens where even this does not hold it (ragged_dot_tokens).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
if "--device-time" in sys.argv:  # one profiler event per kernel, not per CUDA graph
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp
import numpy as np

import cudnn_jax
from harness import (arg_parser, bar_chart, device_ms, error_text, rel_diff, time_back_to_back,
                     time_calls, write_results)
from cudnn_jax.ops.gemm import gemm, grouped_gemm
from cudnn_jax.ops.moe import moe_mlp

WARMUP = 3
CALLS = 20
B2B_BELOW_MS = 10  # longer calls: the per-call latency is noise, no back-to-back timing
DEVICE_TIME = False  # --device-time


def normal(key, shape, dtype, scale=1.0):
  return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def measure(case, engines, args, flops, forward=True, compare=None):
  """Rows for one case: each engine's ms and TFLOP/s, and (forward) the difference of the
  outputs of ``compare`` (default: all engines) from the first engine's."""
  rows, first = [], None
  for name, fn in engines.items():
    row = dict(case=case, engine=name)
    fn = jax.jit(fn)
    try:
      row["ms"] = 1e3 * time_calls(fn, args, CALLS, WARMUP)
      row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
      if row["ms"] < B2B_BELOW_MS:
        row["ms_b2b"] = 1e3 * time_back_to_back(fn, args, CALLS, WARMUP)
        row["tflops_b2b"] = flops / (row["ms_b2b"] * 1e-3) / 1e12
        if DEVICE_TIME:
          row["ms_device"] = device_ms(fn, args)
          row["tflops_device"] = flops / (row["ms_device"] * 1e-3) / 1e12
      if forward and (compare is None or name in compare):
        out = fn(*args)
        if first is None:
          first = out
        else:
          row["rel_diff_vs_first"] = rel_diff(out, first)
    except Exception as e:  # pylint: disable=broad-except
      row["error"] = error_text(e)
    print_row(row)
    rows.append(row)
  return rows


# ---------------------------------------------------------------------------------------
# Cases.


def group_sizes(m, g, split, seed=0):
  """[g] int32 summing to m: equal, or drawn from a flat Dirichlet."""
  if split == "equal":
    sizes = np.full(g, m // g)
  else:
    p = np.random.default_rng(seed).dirichlet(np.ones(g))
    sizes = np.floor(p * m).astype(np.int64)
  sizes[-1] += m - sizes.sum()
  return jnp.asarray(sizes, jnp.int32)


def grouped_cases(shapes, dtype, splits=("equal", "dirichlet")):
  rows = []
  for m, k, n, g in shapes:
    keys = jax.random.split(jax.random.key(m + g), 3)
    lhs, rhs = normal(keys[0], (m, k), dtype), normal(keys[1], (g, k, n), dtype, k**-0.5)
    dense_rhs = rhs[0]
    for split in splits:
      sizes = group_sizes(m, g, split)
      engines = {
          "cudnn_jax.grouped_gemm": lambda l, r, s, d: grouped_gemm(l, r, s),
          "cudnn_jax.grouped_gemm cudnn": lambda l, r, s, d: grouped_gemm(
              l, r, s, implementation="cudnn"),
          "cudnn_jax.grouped_gemm cute": lambda l, r, s, d: grouped_gemm(
              l, r, s, implementation="cute"),
          "lax.ragged_dot": lambda l, r, s, d: jax.lax.ragged_dot(l, r, s),
          "dense matmul": lambda l, r, s, d: l @ d,
      }
      case = f"grouped m{m} k{k} n{n} g{g} {split}"
      rows += measure(case, engines, (lhs, rhs, sizes, dense_rhs), 2.0 * m * k * n,
                      compare=list(engines)[:4])
  return rows


def swiglu_case(m, n, k, dtype):
  keys = jax.random.split(jax.random.key(1), 2)
  a, b = normal(keys[0], (m, k), dtype), normal(keys[1], (k, 2 * n), dtype, k**-0.5)

  def two_dots(a, b):
    gate, up = a @ b[:, :n], a @ b[:, n:]
    return jax.nn.silu(gate) * up

  engines = {"cudnn_jax.gemm swiglu": lambda a, b: gemm(a, b, glu="swiglu"),
             "cudnn_jax.gemm swiglu cute": lambda a, b: gemm(a, b, glu="swiglu",
                                                             implementation="cute"),
             "xla two dots": two_dots}
  return measure(f"gemm+swiglu m{m} n{n} k{k}", engines, (a, b), 2.0 * m * k * 2 * n)


def ragged_dot_moe(x, expert_indices, expert_weights, w_up, w_down):
  """The same layer as moe_mlp (SwiGLU), written directly with jax.lax.ragged_dot."""
  t, k = expert_indices.shape
  flat = expert_indices.reshape(-1)
  order = jnp.argsort(flat)
  sizes = jnp.bincount(flat, length=w_up.shape[0]).astype(jnp.int32)
  h = jax.lax.ragged_dot(x[order // k], w_up, sizes)
  gate, up = jnp.split(h, 2, axis=-1)
  y = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, sizes)
  y = y[jnp.argsort(order)].reshape(t, k, -1)
  return jnp.einsum("tkd,tk->td", y, expert_weights.astype(y.dtype))


def device_bytes() -> int | None:
  """The memory XLA may use on the default device (None where it does not say)."""
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("bytes_limit")


def ragged_dot_tokens(t, d, e, top_k, itemsize):
  """The most tokens (``t`` halved until it fits) for which the ragged_dot layer's
  backward fits: XLA differentiates ragged_dot's weights through a dense
  ``[E, T*top_k, D]`` operand, which must fit in a quarter of the device's memory."""
  limit = device_bytes()
  if limit is None:
    return t
  while t > 1024 and e * t * top_k * d * itemsize > limit // 4:
    t //= 2
  return t


def moe_case(t, d, f, e, top_k, dtype):
  rows = []
  anchor_t = ragged_dot_tokens(t, d, e, top_k, jnp.dtype(dtype).itemsize)
  layers = {"cudnn_jax.moe_mlp cute": functools.partial(moe_mlp, implementation="cute"),
            "cudnn_jax.moe_mlp cudnn": functools.partial(moe_mlp, implementation="cudnn"),
            "cudnn_jax.moe_mlp": moe_mlp}
  if anchor_t == t:
    layers["lax.ragged_dot layer"] = ragged_dot_moe
  else:
    print(f"lax.ragged_dot layer: its weight gradient's dense [E, T*top_k, D] operand "
          f"({e * t * top_k * d * jnp.dtype(dtype).itemsize / 2**30:.0f} GiB at T={t}) does "
          f"not fit beside the rest; measured at T={anchor_t} (TFLOP/s comparable, ms not)")
    rows += moe_layers(anchor_t, d, f, e, top_k, dtype, {"lax.ragged_dot layer": ragged_dot_moe})
  return moe_layers(t, d, f, e, top_k, dtype, layers) + rows


def moe_layers(t, d, f, e, top_k, dtype, layers):
  """Rows of each layer's forward+backward at T=t tokens."""
  keys = jax.random.split(jax.random.key(2), 5)
  x = normal(keys[0], (t, d), dtype)
  logits = jax.random.normal(keys[1], (t, e))
  weights, idx = jax.lax.top_k(jax.nn.softmax(logits), top_k)
  w_up = normal(keys[2], (e, d, 2 * f), dtype, d**-0.5)
  w_down = normal(keys[3], (e, f, d), dtype, f**-0.5)
  dy = normal(keys[4], (t, d), dtype)
  weights = weights.astype(dtype)

  def fwd_bwd(layer):
    def step(x, idx, weights, w_up, w_down, dy):
      loss = lambda x, w, u, dn: jnp.vdot(layer(x, idx, w, u, dn).astype(jnp.float32),
                                          dy.astype(jnp.float32))
      return jax.grad(loss, argnums=(0, 1, 2, 3))(x, weights, w_up, w_down)
    return step

  engines = {name: fwd_bwd(layer) for name, layer in layers.items()}
  flops = 3 * 6.0 * t * top_k * d * f
  return measure(f"moe_mlp fwd+bwd T{t} D{d} F{f} E{e} top{top_k}", engines,
                 (x, idx.astype(jnp.int32), weights, w_up, w_down, dy), flops, forward=False)


CASES = ("grouped", "swiglu", "moe")


def run(quick, dtype, cases=CASES):
  if quick:
    grouped = [(256, 64, 32, 4), (512, 32, 48, 16)]
    swiglu, moe, square = (128, 64, 64), (128, 64, 32, 8, 2), (256, 256, 256, 1)
  else:
    grouped = [(32768, 4096, 2048, 8), (65536, 2048, 1408, 64)]
    swiglu, moe, square = (16384, 4096, 4096), (16384, 4096, 2048, 64, 4), (8192,) * 3 + (1,)
  rows = grouped_cases(grouped, dtype) if "grouped" in cases else []
  # One group of a square GEMM: the grouped kernels beside a plain matmul of one shape.
  rows += grouped_cases([square], dtype, ("equal",)) if "square" in cases else []
  rows += swiglu_case(*swiglu, dtype) if "swiglu" in cases else []
  rows += moe_case(*moe, dtype) if "moe" in cases else []
  return rows


HEADER = (f"{'case':<44} {'engine':<30} {'ms':>9} {'TFLOP/s':>8} {'ms(b2b)':>9} "
          f"{'TFLOP/s':>8} {'ms(dev)':>9} {'TFLOP/s':>8} {'rel diff':>9}")


def print_row(r):
  f = lambda key, fmt: format(r[key], fmt) if r.get(key) is not None else "-"
  line = (f"{r['case']:<44} {r['engine']:<30} {f('ms', '.3f'):>9} {f('tflops', '.3g'):>8} "
          f"{f('ms_b2b', '.3f'):>9} {f('tflops_b2b', '.3g'):>8} "
          f"{f('ms_device', '.3f'):>9} {f('tflops_device', '.3g'):>8} "
          f"{f('rel_diff_vs_first', '.1e'):>9}")
  print(line + (f"  ({r['error']})" if r.get("error") else ""), flush=True)


def plot(rows, path, title):
  """TFLOP/s (back to back where measured) per case and engine; the engines that are not
  ours (XLA's ragged_dot, dense matmuls, the unfused layer) are the hatched anchors."""
  cases = list(dict.fromkeys(r["case"] for r in rows))
  engines = list(dict.fromkeys(r["engine"] for r in rows))
  value = {(r["case"], r["engine"]): r.get("tflops_b2b") or r.get("tflops") for r in rows}
  series = {e: [value.get((c, e)) for c in cases] for e in engines}
  return bar_chart(path, title, cases, series, "TFLOP/s (higher is better)",
                   anchors=[e for e in engines if not e.startswith("cudnn_jax")])


def main():
  parser = arg_parser(__doc__)
  parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
  parser.add_argument("--cases", default=",".join(CASES),
                      help=f"comma-separated subset of {','.join(CASES)}")
  parser.add_argument("--device-time", action="store_true",
                      help="also the profiler's device time of a call (calls under 10 ms)")
  args = parser.parse_args()
  global DEVICE_TIME
  DEVICE_TIME = args.device_time
  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu and not args.quick:
    parser.error(f"the full benchmark needs a GPU (backend is {jax.default_backend()!r}); "
                 "use --quick for a smoke test")
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  probe = jax.ShapeDtypeStruct((128, 64), dtype)
  print(cudnn_jax.explain("grouped_gemm", probe, jax.ShapeDtypeStruct((2, 64, 64), dtype),
                          jax.ShapeDtypeStruct((2,), jnp.int32)))
  print(HEADER)
  start = time.perf_counter()
  rows = run(args.quick, dtype, args.cases.split(","))
  elapsed = time.perf_counter() - start
  path = write_results(args.out, "moe", rows, quick=args.quick, dtype=jnp.dtype(dtype).name,
                       seconds=elapsed, warmup=WARMUP, calls=CALLS)
  png = plot(rows, os.path.join(args.out, "moe.png"),
             f"moe, {jnp.dtype(dtype).name}, {jax.devices()[0].device_kind}")
  print(f"{elapsed:.0f} s; wrote {path} and {png}")


if __name__ == "__main__":
  main()
