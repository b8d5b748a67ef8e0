"""Benchmark of cudnn_jax.bsa (block-sparse attention) against dense attention.

    python bench/bsa.py [--out DIR] [--quick] [--lengths S ...] [--block-size 64|128]
                        [--engines cudnn triton xla]

On a GPU: B=1, 16 heads, head dim 128, bfloat16, block size 128, S=16384 and 65536, random
block selections at densities 5, 10, 20, 50 and 100% (each query block keeps that fraction
of the kv blocks), not causal; forward and forward+backward of cudnn_jax.bsa on its
"cudnn" engine (NVIDIA's sm_90 kernels), its "triton" engine and its "xla" engine (where
the blocks it gathers fit in memory),
beside forward and forward+backward of dense cudnn_jax.sdpa and
jax.nn.dot_product_attention (cuDNN) on the same q, k, v, in the same run. Median wall
time of single jitted calls. TFLOP/s for bsa are effective: the dense FLOPs of the
selected blocks (4*B*N*S^2*H*density forward, x3.5 with the backward); "x dense" is dense
cudnn_jax.sdpa's time over bsa's. Targets: forward at least 0.7/density times faster than
dense (fwd+bwd 0.5/density), 300 effective TFLOP/s forward at 10% density or less, within
1.25x of dense at 100%. Published anchor (ANCHORS.md): a Hopper 64x64 block-sparse kernel
at 317 effective TFLOP/s at 3.7% density on an H200.

With --quick: tiny shapes on the default backend (a smoke test; off the GPU the triton
engine declines and its rows say why).
Writes DIR/bsa_b<block size>.json and .png (DIR defaults to bench/results): each block size
keeps its own results.
"""

from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import cudnn_jax
from harness import arg_parser, error_text, pyplot, save_figure, time_calls, write_results

DENSITIES = (0.05, 0.1, 0.2, 0.5, 1.0)
ENGINES = ("cudnn", "triton", "xla")
# The xla engine gathers each query block's kv blocks and forms its logits in float32:
# rows whose gathered blocks and logits (x3 with the backward) pass this are skipped.
XLA_MAX_BYTES = 32 << 30


def tensors(b, s, n, h, seed=0):
  """q, k, v and the output cotangent ``[B,S,N,H]`` bfloat16."""
  keys = jax.random.split(jax.random.key(seed), 4)
  return jax.block_until_ready(
      [jax.random.normal(key, (b, s, n, h), jnp.bfloat16) for key in keys])


def selection(b, n, nb, density, seed=0):
  """``(block_index [B,N,nb,keep], block_counts, kept density)``: each query block keeps
  ``keep = round(density * nb)`` random kv blocks (at least one), in ascending order."""
  rng = np.random.default_rng(seed)
  keep = max(1, round(density * nb))
  chosen = np.argsort(rng.random((b, n, nb, nb)), axis=-1)[..., :keep]
  mask = np.zeros((b, n, nb, nb), bool)
  np.put_along_axis(mask, chosen, True, axis=-1)
  index, counts = cudnn_jax.bsa_from_mask(jnp.asarray(mask))
  # Only the first `keep` slots are ever used: a narrower index is what a caller would pass.
  return jax.block_until_ready((index[..., :keep], counts)), keep / nb


def timed(fn, args, backward, do):
  """Median ms of ``fn(*args)`` jitted, or of its gradients in the first three arguments."""
  if backward:
    loss = lambda q, k, v, *rest: jnp.sum(fn(q, k, v, *rest).astype(jnp.float32)
                                          * do.astype(jnp.float32))
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  else:
    step = jax.jit(fn)
  return 1e3 * time_calls(step, args, 10, 2)


def xla_bytes(s, n, h, density, bs, backward):
  """Rough peak bytes of the xla engine: gathered k and v blocks (bf16) and the logits
  (float32) of the selected blocks."""
  selected = n * s * s * density
  return (selected * 2 * h * 2 // bs + 4 * selected) * (3 if backward else 1)


def measure(row, fn, args, backward, do, flops):
  """Fills ``row`` with ms and TFLOP/s, or the error."""
  try:
    row["ms"] = timed(fn, args, backward, do)
    row["tflops"] = flops / row["ms"] / 1e9
  except cudnn_jax.UnsupportedError as e:  # the engine declines here (off the GPU, say)
    row["skipped"] = error_text(e)
  except Exception as e:  # pylint: disable=broad-except
    row["error"] = error_text(e)


def run(lengths, n, h, bs, on_gpu, engines):
  rows = []
  for s in lengths:
    q, k, v, do = tensors(1, s, n, h)
    dense = {"cudnn_jax.sdpa": cudnn_jax.sdpa}
    if on_gpu:
      dense["jax.nn cudnn"] = functools.partial(jax.nn.dot_product_attention,
                                                implementation="cudnn")
    for backward in (False, True):
      flops = 4.0 * s * s * n * h * (3.5 if backward else 1.0)
      dense_ms = None
      for name, fn in dense.items():
        row = dict(s=s, density=1.0, backward=backward, engine=name)
        measure(row, fn, (q, k, v), backward, do, flops)
        dense_ms = dense_ms or row.get("ms")
        rows.append(row)
        print_row(row)
      for density in DENSITIES:
        (index, counts), kept = selection(1, n, s // bs, density)
        for engine in engines:
          row = dict(s=s, density=kept, backward=backward, engine=f"cudnn_jax.bsa {engine}")
          if engine == "xla" and xla_bytes(s, n, h, kept, bs, backward) > XLA_MAX_BYTES:
            row["skipped"] = "its gathered blocks and logits would not fit"
          else:
            # The selection is an argument: as a constant, XLA would fold the masks into
            # the program at compile time.
            fn = functools.partial(cudnn_jax.bsa, block_size=bs, implementation=engine)
            measure(row, fn, (q, k, v, index, counts), backward, do, flops * kept)
            if row.get("ms") and dense_ms:
              row["x_dense"] = dense_ms / row["ms"]
          rows.append(row)
          print_row(row)
  return rows


HEADER = (f"{'S':>6} {'density':>8} {'pass':>8} {'engine':>22} {'ms':>9} {'TFLOP/s':>8} "
          f"{'x dense':>8}")


def print_row(r):
  ms = f"{r['ms']:.3f}" if r.get("ms") else "-"
  tf = f"{r['tflops']:.0f}" if r.get("tflops") else "-"
  xd = f"{r['x_dense']:.2f}" if r.get("x_dense") else "-"
  note = r.get("skipped") or r.get("error")
  print(f"{r['s']:>6} {r['density']:>8.3f} {'fwd+bwd' if r['backward'] else 'fwd':>8} "
        f"{r['engine']:>22} {ms:>9} {tf:>8} {xd:>8}" + (f"  ({note})" if note else ""),
        flush=True)


def plot(rows, path, title):
  """Effective TFLOP/s against density, forward and forward+backward side by side: a line
  per bsa engine and length, dense attention dashed."""
  plt = pyplot()

  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
  lengths = list(dict.fromkeys(r["s"] for r in rows))
  colors = dict(zip(lengths, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
  for ax, backward in zip(axes, (False, True)):
    for r in rows:
      if r["backward"] == backward and r["engine"] == "cudnn_jax.sdpa" and r.get("tflops"):
        ax.axhline(r["tflops"], color=colors[r["s"]], linestyle="--", linewidth=1,
                   label=f"dense cudnn_jax.sdpa S={r['s']}")
    styles = {"cudnn": ("s", "-"), "triton": ("o", "-."), "xla": ("x", ":")}
    for s in lengths:
      for engine, (marker, line) in styles.items():
        name = f"cudnn_jax.bsa {engine}"
        pts = [(r["density"], r["tflops"]) for r in rows if r["s"] == s and r["engine"] ==
               name and r["backward"] == backward and r.get("tflops")]
        if pts:
          ax.plot(*zip(*pts), marker=marker, color=colors[s], label=f"{name} S={s}",
                  linestyle=line)
    ax.set_xscale("log")
    ax.set_xticks(DENSITIES, [f"{d:.0%}" for d in DENSITIES])
    ax.minorticks_off()
    ax.set_xlabel("density (fraction of kv blocks each query block keeps)")
    ax.set_title("fwd+bwd" if backward else "fwd")
    ax.grid(True, alpha=0.3)
  axes[0].set_ylabel("effective TFLOP/s (dense FLOPs x density)")
  axes[1].legend(fontsize=7)
  fig.suptitle(title)
  save_figure(fig, path)


def main():
  parser = arg_parser(__doc__)
  parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
  parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536])
  parser.add_argument("--block-size", type=int, default=128, choices=(64, 128))
  parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
  args = parser.parse_args()
  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu and not args.quick:
    parser.error(f"the full benchmark needs a GPU (backend is {jax.default_backend()!r}); "
                 "use --quick for a smoke test")
  n, h, bs = (2, 64, 64) if args.quick else (16, 128, args.block_size)
  lengths = (256,) if args.quick else tuple(args.lengths)
  probe = jax.ShapeDtypeStruct((1, lengths[0], n, h), jnp.bfloat16)
  nb = lengths[0] // bs
  print(cudnn_jax.explain("bsa", probe, probe, probe,
                          jax.ShapeDtypeStruct((1, n, nb, nb), jnp.int32), block_size=bs,
                          implementation=tuple(args.engines)))
  print(HEADER)
  start = time.perf_counter()
  rows = run(lengths, n, h, bs, on_gpu, args.engines)
  elapsed = time.perf_counter() - start
  name = f"bsa_b{bs}"
  json_path = write_results(args.out, name, rows, quick=args.quick, seconds=elapsed,
                            heads=n, head_dim=h, block_size=bs, dtype="bfloat16")
  png_path = os.path.join(args.out, f"{name}.png")
  plot(rows, png_path, f"bsa, B=1, N={n}, d={h}, block {bs}, bf16, "
       f"{jax.devices()[0].device_kind}")
  print(f"{elapsed:.0f} s; wrote {json_path} and {png_path}")


if __name__ == "__main__":
  main()
