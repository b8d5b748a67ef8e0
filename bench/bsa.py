"""Benchmark of cudnn_jax.bsa (block-sparse attention) against dense attention.

    python bench/bsa.py [--out DIR] [--quick]

On a GPU: B=1, S=8192 and 16384, 16 heads, head dim 128, bfloat16, block size 128, random
block selections at densities 5%, 15% and 50% (each query block keeps that fraction of
the kv blocks), not causal; forward and forward+backward of cudnn_jax.bsa, beside
forward and forward+backward of dense cudnn_jax.sdpa and jax.nn.dot_product_attention
(cuDNN) on the same q, k, v. Median wall time of single jitted calls. TFLOP/s for bsa are
effective: the dense FLOPs of the selected blocks (4*B*N*S^2*H*density forward, x3.5 with
the backward). Published anchor (ANCHORS.md): a Hopper 64x64 block-sparse kernel at 317
effective TFLOP/s at 3.7% density on an H200.

With --quick: tiny shapes on the default backend (a smoke test).
Writes DIR/bsa.json (DIR defaults to bench/results).
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

import cudnn_jax
from harness import error_text, time_calls, write_results

DENSITIES = (0.05, 0.15, 0.5)


def inputs(b, s, n, h, bs, density, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  q, k, v, do = (jax.random.normal(key, (b, s, n, h), jnp.bfloat16) for key in keys)
  nb = s // bs
  rng = np.random.default_rng(seed)
  keep = max(1, round(density * nb))
  chosen = np.argsort(rng.random((b, n, nb, nb)), axis=-1)[..., :keep]
  mask = np.zeros((b, n, nb, nb), bool)
  np.put_along_axis(mask, chosen, True, axis=-1)
  index, counts = cudnn_jax.bsa_from_mask(jnp.asarray(mask))
  # Only the first `keep` slots are ever used: a narrower index is what a caller would pass.
  return jax.block_until_ready((q, k, v, do, index[..., :keep], counts)), keep / nb


def timed(fn, args, backward, do):
  """Median ms of ``fn(*args)`` jitted, or of its gradients in the first three arguments."""
  if backward:
    loss = lambda q, k, v, *rest: jnp.sum(fn(q, k, v, *rest).astype(jnp.float32)
                                          * do.astype(jnp.float32))
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  else:
    step = jax.jit(fn)
  return 1e3 * time_calls(step, args, 10, 2)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args()
  on_gpu = jax.default_backend() == "gpu"
  n, h, bs = (2, 32, 32) if args.quick else (16, 128, 128)
  lengths = (256,) if args.quick else (8192, 16384)
  print(f"{'S':>6} {'density':>8} {'pass':>8} {'engine':>22} {'ms':>9} {'TFLOP/s':>8}")
  rows, start = [], time.perf_counter()
  for s in lengths:
    dense = {"cudnn_jax.sdpa": functools.partial(cudnn_jax.sdpa)}
    if on_gpu:
      dense["jax.nn cudnn"] = functools.partial(jax.nn.dot_product_attention,
                                                implementation="cudnn")
    for backward in (False, True):
      flops = 4.0 * s * s * n * h * (3.5 if backward else 1.0)
      (q, k, v, do, _, _), _ = inputs(1, s, n, h, bs, DENSITIES[0])
      for name, fn in dense.items():
        row = dict(s=s, density=1.0, backward=backward, engine=name)
        try:
          row["ms"] = timed(fn, (q, k, v), backward, do)
          row["tflops"] = flops / row["ms"] / 1e9
        except Exception as e:  # pylint: disable=broad-except
          row["error"] = error_text(e)
        rows.append(row)
        print_row(row)
      for density in DENSITIES:
        (q, k, v, do, index, counts), kept = inputs(1, s, n, h, bs, density)
        # The selection is an argument: as a constant, XLA would fold the masks into the
        # program at compile time.
        fn = functools.partial(cudnn_jax.bsa, block_size=bs)
        row = dict(s=s, density=kept, backward=backward, engine="cudnn_jax.bsa xla")
        try:
          row["ms"] = timed(fn, (q, k, v, index, counts), backward, do)
          row["tflops"] = flops * kept / row["ms"] / 1e9
        except Exception as e:  # pylint: disable=broad-except
          row["error"] = error_text(e)
        rows.append(row)
        print_row(row)
  elapsed = time.perf_counter() - start
  path = write_results(args.out, "bsa", rows, quick=args.quick, seconds=elapsed)
  print(f"{elapsed:.0f} s; wrote {path}")


def print_row(r):
  ms = f"{r['ms']:.3f}" if r.get("ms") else "-"
  tf = f"{r['tflops']:.0f}" if r.get("tflops") else "-"
  note = f"  ({r['error']})" if r.get("error") else ""
  print(f"{r['s']:>6} {r['density']:>8.3f} {'fwd+bwd' if r['backward'] else 'fwd':>8} "
        f"{r['engine']:>22} {ms:>9} {tf:>8}{note}", flush=True)


if __name__ == "__main__":
  main()
