"""Benchmark of cudnn_jax.sdpa_fp8 against our bf16 cudnn_jax.sdpa.

    python bench/sdpa_fp8.py [--out DIR] [--quick]

On a GPU: B*S = 16384 tokens, 16 heads, head dim 128, S in {4k, 8k, 16k}, causal and not,
forward and forward+backward, for sdpa_fp8 (e4m3 inputs, implementation="cudnn", out in
float8_e4m3fn and in bfloat16; cuDNN serves a bf16 out on Blackwell only) and sdpa
(bfloat16, implementation="cudnn"). Timing: the median wall time of single jitted calls,
and the time per call of 10 calls issued back to back (device throughput). FLOPs:
4*B*N*S^2*H forward (half when causal), x3.5 for forward+backward.
Target: the FP8 forward at least 1.45x our bf16 forward at S >= 8k.

With --quick: a tiny shape on the xla engines (CPU), for a smoke test.
Writes DIR/sdpa_fp8.json and DIR/sdpa_fp8.png (DIR defaults to bench/results).
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import cudnn_jax
from harness import (arg_parser, error_text, pyplot, save_figure, time_back_to_back, time_calls,
                     write_results)

TOKENS, HEADS, HEAD_DIM = 16384, 16, 128
TARGET = 1.45  # FP8 forward over bf16 forward, S >= 8k
SCALES = dict(q_scale=0.05, k_scale=0.05, v_scale=0.05, out_scale=0.01)


def flops(b, s, causal, backward):
  f = 4.0 * b * HEADS * s * s * HEAD_DIM * (0.5 if causal else 1.0)
  return f * (3.5 if backward else 1.0)


def engines(impl):
  """name -> (function of (q, k, v), input dtype)."""
  scales = {k: jnp.float32(v) for k, v in SCALES.items()}
  fp8 = lambda out_dtype: lambda q, k, v, causal: cudnn_jax.sdpa_fp8(
      q, k, v, **scales, out_dtype=out_dtype, is_causal=causal, implementation=impl)[0]
  return {
      "sdpa_fp8 (out e4m3)": (fp8(jnp.float8_e4m3fn), jnp.float8_e4m3fn),
      "sdpa_fp8 (out bf16)": (fp8(jnp.bfloat16), jnp.float8_e4m3fn),
      "sdpa bf16": (lambda q, k, v, causal: cudnn_jax.sdpa(
          q, k, v, is_causal=causal, implementation=impl), jnp.bfloat16),
  }


def step(fn, causal, backward):
  if not backward:
    return jax.jit(lambda q, k, v: fn(q, k, v, causal))

  def fwd_bwd(q, k, v):
    out, pull = jax.vjp(lambda q, k, v: fn(q, k, v, causal), q, k, v)
    return pull(jnp.ones_like(out))
  return jax.jit(fwd_bwd)


def run(quick):
  impl = "xla" if quick else "cudnn"
  lengths = (128,) if quick else (4096, 8192, 16384)
  tokens = 256 if quick else TOKENS
  rng = np.random.default_rng(0)
  rows = []
  for s in lengths:
    b = tokens // s
    base = rng.normal(size=(3, b, s, HEADS, HEAD_DIM)).astype(np.float32) * 4
    for causal in (False, True):
      for backward in (False, True):
        for name, (fn, dtype) in engines(impl).items():
          row = dict(engine=name, s=s, b=b, causal=causal, backward=backward,
                     tflop=flops(b, s, causal, backward) / 1e12)
          try:
            args = [jnp.asarray(x, dtype) for x in base]
            f = step(fn, causal, backward)
            row["ms"] = time_calls(f, args, calls=5 if quick else 20) * 1e3
            row["ms_back_to_back"] = time_back_to_back(f, args, calls=5 if quick else 10) * 1e3
            row["tflops"] = row["tflop"] / (row["ms_back_to_back"] / 1e3)
          except cudnn_jax.UnsupportedError as e:
            row["skipped"] = str(e).split("cudnn: ")[-1][:200]
          except Exception as e:  # pylint: disable=broad-except
            row["error"] = error_text(e)
          rows.append(row)
          print_row(row)
  return rows


def print_row(r):
  tf = f"{r['tflops']:.1f}" if "tflops" in r else "-"
  ms = f"{r['ms_back_to_back']:.3f}" if "ms_back_to_back" in r else "-"
  note = r.get("skipped") or r.get("error") or ""
  print(f"{r['s']:>6} {str(r['causal']):>6} {'fwd+bwd' if r['backward'] else 'fwd':>8} "
        f"{r['engine']:<20} {ms:>9} {tf:>8}  {note}", flush=True)


def speedups(rows):
  """(s, causal, backward) -> FP8 (e4m3 out) TFLOP/s over bf16 sdpa's."""
  out = {}
  for r in rows:
    if r["engine"] == "sdpa_fp8 (out e4m3)" and "tflops" in r:
      bf16 = next((x for x in rows if x["engine"] == "sdpa bf16" and "tflops" in x and
                   (x["s"], x["causal"], x["backward"]) == (r["s"], r["causal"], r["backward"])),
                  None)
      if bf16:
        out[(r["s"], r["causal"], r["backward"])] = r["tflops"] / bf16["tflops"]
  return out


def plot(rows, path):
  plt = pyplot()
  groups = list(dict.fromkeys((r["s"], r["causal"], r["backward"]) for r in rows))
  names = list(dict.fromkeys(r["engine"] for r in rows))
  width = 0.8 / len(names)
  fig, ax = plt.subplots(figsize=(max(8, 1.0 * len(groups)), 4.5))
  for i, name in enumerate(names):
    values = [next((r.get("tflops", 0.0) for r in rows if r["engine"] == name and
                    (r["s"], r["causal"], r["backward"]) == g), 0.0) for g in groups]
    ax.bar(np.arange(len(groups)) + i * width, values, width, label=name)
  labels = [f"S={s}\n{'causal ' if c else ''}{'fwd+bwd' if b else 'fwd'}"
            for s, c, b in groups]
  ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2, labels, fontsize=7)
  ax.set_ylabel("TFLOP/s (10 calls back to back)")
  ax.set_title(f"sdpa_fp8 vs bf16 sdpa, B*S={rows[0]['b'] * rows[0]['s']}, {HEADS} heads, "
               f"d={HEAD_DIM}, {jax.devices()[0].device_kind}")
  ax.legend(fontsize=8)
  save_figure(fig, path)


def collect(quick, out):
  """Runs the table, prints it and the target's verdict, writes DIR/sdpa_fp8.png;
  (rows, meta) for a results file."""
  if not quick:
    probe = jax.ShapeDtypeStruct((1, 4096, HEADS, HEAD_DIM), jnp.float8_e4m3fn)
    print(cudnn_jax.explain("sdpa_fp8", probe, probe, probe,
                            **{k: jnp.float32(v) for k, v in SCALES.items()},
                            out_dtype=jnp.float8_e4m3fn, is_causal=True))
  print(f"{'S':>6} {'causal':>6} {'pass':>8} {'engine':<20} {'ms':>9} {'TFLOP/s':>8}")
  rows = run(quick)
  ratios = speedups(rows)
  met = None
  print("\nFP8 (out e4m3) over bf16 sdpa, TFLOP/s:")
  for (s, causal, backward), ratio in ratios.items():
    print(f"  S={s:>6} {'causal' if causal else 'full':>6} {'fwd+bwd' if backward else 'fwd':>8}:"
          f" {ratio:.2f}x")
  forward = [r for (s, _, backward), r in ratios.items() if s >= 8192 and not backward]
  if forward:
    met = min(forward) >= TARGET
    print(f"target: FP8 forward >= {TARGET}x bf16 forward at S >= 8k: "
          f"{'met' if met else 'NOT met'} (lowest {min(forward):.2f}x)")
  plot(rows, os.path.join(out, "sdpa_fp8.png"))
  speedup_names = {f"{s}/{'causal' if c else 'full'}/{'fwd+bwd' if b else 'fwd'}": v
                   for (s, c, b), v in ratios.items()}
  return rows, dict(target=TARGET, target_met=met, speedups=speedup_names)


def main():
  parser = arg_parser(__doc__)
  parser.add_argument("--quick", action="store_true", help="a tiny shape (smoke test)")
  args = parser.parse_args()
  if jax.default_backend() != "gpu" and not args.quick:
    parser.error(f"the full benchmark needs a GPU (backend is {jax.default_backend()!r}); "
                 "use --quick for a smoke test")
  os.makedirs(args.out, exist_ok=True)
  start = time.perf_counter()
  rows, meta = collect(args.quick, args.out)
  elapsed = time.perf_counter() - start
  json_path = write_results(args.out, "sdpa_fp8", rows, quick=args.quick, seconds=elapsed,
                            cache_info=cudnn_jax.cache_info(), **meta)
  print(f"{elapsed:.0f} s; wrote {json_path} and {os.path.join(args.out, 'sdpa_fp8.png')}")


if __name__ == "__main__":
  main()
