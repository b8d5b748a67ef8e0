"""Benchmark of cudnn_jax.kda (or gdn) against FLA's chunk_kda (chunk_gated_delta_rule).

    python bench/kda.py [--out DIR] [--quick] [--profile | --intra | --scan]
                        [--engine cudnn,triton,xla] [--shapes 8x4096] [--op kda|gdn]
                        [--gates slow,fla]

On a GPU: B=8 T=4096 and B=2 T=16384, H=16, K=V=128, bfloat16 q/k/v/beta, float32 g,
l2-normalized q/k in the kernel; forward and forward+backward (gradients of q, k, v, g,
beta), median ms of single jitted calls, then "b2b": 10 calls issued back to back with
one wait (JAX) or between two CUDA events (FLA), per call, the throughput of a training
loop without each call's launch-and-wait latency. When ``torch`` and ``fla`` import (``from
fla.ops.kda import chunk_kda``), FLA runs the same inputs in the same process (CUDA
tensors, torch.cuda.Event timing) and its outputs are compared with ours. With --op gdn:
cudnn_jax.gdn (a float32 log decay per head, g [B,T,H]) against FLA's
chunk_gated_delta_rule, in the table.

With --quick: tiny shapes on the default backend, cudnn_jax only (a smoke test).
--engine picks the cudnn_jax engines, comma-separated (default xla; "triton": the Pallas
kernels of cudnn_jax/triton/; "cudnn": NVIDIA's sm_90 kernels from the cuDNN frontend),
each a row beside the same FLA timing; --gates the decay regimes, each a set of rows:
"slow" (g = log_sigmoid(n) / 8, decays mostly in (0.9, 1)) and "fla" (log_sigmoid(n), as
FLA's tests draw them); the cudnn engine's segmented forward costs more the slower the
decay; --forward-only
leaves out forward+backward; --shapes takes a subset of the B x T pairs (comma-separated,
e.g. 8x4096). With --profile: instead of the table, device time by engine stage (the
``jax.named_scope`` names of cudnn_jax/reference/kda.py and cudnn_jax/triton/kda.py) and
the costliest HLO instructions at B=8 T=4096, XLA's command buffers turned off so that
every kernel is seen. With --intra: instead of the table, the forward's intra-chunk stage
alone at B=8 T=4096 (device time): XLA's (the reference) against the Pallas kernel
(cudnn_jax/triton/kda_intra.py) by warps, K block and span limit. With --scan: the state
scan kernels (cudnn_jax/triton/kda_scan.py) alone by tiling, at --shapes.
Writes DIR/<op>_<engines>.json and .png (ms per shape and pass, each engine beside FLA when
FLA ran; DIR defaults to bench/results).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time

# FLA (torch) shares the GPU with JAX in this process: leave it room.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")
if {"--profile", "--intra"} & set(sys.argv):  # one profiler event per kernel, not per graph
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp
import numpy as np

import cudnn_jax
from harness import (arg_parser, bar_chart, device_ms, error_text, load_torch, profile_scopes,
                     rel_diff, time_back_to_back, time_calls, torch_time_ms, write_results)

WARMUP = 3
CALLS = 10
B2B_CALLS = 10


@dataclasses.dataclass(frozen=True)
class Shape:
  b: int
  t: int
  h: int
  k: int
  v: int


GATES = {"slow": 1 / 8, "fla": 1.0}  # --gates: g = log_sigmoid(n) * scale


def inputs(shape, seed=0, gates="slow"):
  """q, k, v, beta bfloat16; g float32 log decays (per channel, or per head for gdn) of
  regime ``gates``; do (output cotangent) bfloat16."""
  keys = jax.random.split(jax.random.key(seed), 6)
  b, t, h = shape.b, shape.t, shape.h
  normal = lambda key, *dims: jax.random.normal(key, (b, t, h) + dims, jnp.float32)
  q, k = normal(keys[0], shape.k), normal(keys[1], shape.k)
  v, do = normal(keys[2], shape.v), normal(keys[5], shape.v)
  gate_dims = () if OP == "gdn" else (shape.k,)
  g = jax.nn.log_sigmoid(normal(keys[3], *gate_dims)) * GATES[gates]
  beta = jax.nn.sigmoid(normal(keys[4]))
  bf16 = lambda x: x.astype(jnp.bfloat16)
  return jax.block_until_ready(dict(q=bf16(q), k=bf16(k), v=bf16(v), g=g, beta=bf16(beta),
                                    do=bf16(do)))


ENGINE = "xla"  # --engine
OP = "kda"  # --op


def jitted(x, backward, chunk_size=64, engine=None):
  """(jitted cudnn_jax.kda or gdn (OP) on ``engine`` (default ENGINE), forward or
  gradients, its arguments)."""
  attn = lambda q, k, v, g, beta: getattr(cudnn_jax, OP)(
      q, k, v, g, beta, use_qk_l2norm_in_kernel=True, chunk_size=chunk_size,
      implementation=engine or ENGINE)[0]
  args = [x[n] for n in ("q", "k", "v", "g", "beta")]
  if backward:
    loss = lambda *a: jnp.sum(attn(*a).astype(jnp.float32) * x["do"].astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))), args
  return jax.jit(attn), args


def ours(x, backward, engine):
  """(ms, back-to-back ms, forward output or None) for cudnn_jax.kda or gdn on ``engine``."""
  fn, args = jitted(x, backward, engine=engine)
  return (1e3 * time_calls(fn, args, CALLS, WARMUP),
          1e3 * time_back_to_back(fn, args, B2B_CALLS, WARMUP),
          None if backward else fn(*args))


# The engines' jax.named_scope stages (cudnn_jax/reference/kda.py, cudnn_jax/triton/kda.py).
STAGES = ("kda_intra", "kda_state_scan", "kda_output", "kda_state_scan_bwd", "kda_output_bwd",
          "kda_intra_bwd")


def print_profile(shape):
  """Device ms per call of each engine stage, and the costliest HLO instructions."""
  x = inputs(shape)
  for chunk_size, backward in ((64, False), (64, True)):
    by_stage, top = profile_scopes(*jitted(x, backward, chunk_size), STAGES, top=25)
    total = sum(by_stage.values())
    print(f"\nprofile {shape} chunk {chunk_size} {'fwd+bwd' if backward else 'fwd'}: "
          f"{total:.3f} ms of kernels")
    for stage, ms in sorted(by_stage.items(), key=lambda kv: -kv[1]):
      print(f"  {stage:<20} {ms:8.3f} ms  {100 * ms / total:5.1f}%")
    for ms, op, op_name in top:
      print(f"    {ms:8.3f} ms  {op:<28} {op_name[-90:]}")


# (num_warps, bk, span_limit): span_limit None sums the pairs inside sub-blocks directly.
INTRA_VARIANTS = ((4, 32, None), (4, 32, 60.0), (8, 32, 60.0), (4, 64, 60.0), (2, 32, 60.0))


def print_intra(shape, variants=INTRA_VARIANTS):
  """The forward's intra-chunk stage alone: XLA's (the reference) against the kernel's
  (num_warps, bk, span_limit) variants; device ms and output differences."""
  from cudnn_jax.triton import kda_intra  # pylint: disable=g-import-not-at-top
  from cudnn_jax.reference import kda as ref  # pylint: disable=g-import-not-at-top
  c = 64
  dims = (shape.t // c, shape.b, shape.h, c)
  keys = jax.random.split(jax.random.key(0), 5)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(keys[0], dims + (shape.k,))) * shape.k**-0.5
  k = unit(jax.random.normal(keys[1], dims + (shape.k,)))
  v = jax.random.normal(keys[2], dims + (shape.v,))
  G = jnp.cumsum(jax.nn.log_sigmoid(jax.random.normal(keys[3], dims + (shape.k,))) / 8, -2)
  beta = jax.random.uniform(keys[4], dims + (1,))
  args, dt = (q, k, v, G, beta), jnp.dtype(jnp.bfloat16)
  reference = lambda *a: ref.intra(*a, dt)
  by_sub_blocks = lambda *a: ref.intra(*a, dt, by_sub_blocks=True)
  fwd = jax.jit(reference)
  want = fwd(*args)
  print(f"intra-chunk stage {shape}, chunk {c}, bf16 pair products")
  print(f"{'engine':<28} {'fwd ms':>8}  rel diff (w U P qg kd dec)")
  print(f"{'XLA (reference)':<28} {device_ms(fwd, args):8.3f}")
  print_variant("XLA, by sub-blocks", jax.jit(by_sub_blocks), args, want)
  # The stage's VJP (recompute included), as the backward pass takes it.
  cts = jax.tree.map(lambda x: jnp.ones_like(x) / x.shape[-1], want)
  vjp = lambda f: jax.jit(lambda *a: jax.vjp(f, *a)[1](cts))
  grads = vjp(reference)(*args)
  print(f"{'XLA VJP (reference)':<28} {device_ms(vjp(reference), args):8.3f}")
  print_variant("XLA VJP, by sub-blocks", vjp(by_sub_blocks), args, grads)
  for warps, bk, span_limit in variants:
    options = dict(dt=dt, num_warps=warps, bk=bk, span_limit=span_limit,
                   interpret=jax.default_backend() != "gpu")
    print_variant(f"{warps} warps, bk {bk}, span {span_limit}",
                  jax.jit(functools.partial(kda_intra.intra, **options)), args, want)


def print_variant(name, fn, args, want):
  """One row: device ms of ``fn(*args)`` and the relative differences of its outputs from
  ``want``'s, or the error."""
  try:
    diffs = [rel_diff(a, b) for a, b in zip(fn(*args), want) if b is not None]
    print(f"{name:<28} {device_ms(fn, args):8.3f}  {' '.join(f'{x:.0e}' for x in diffs)}",
          flush=True)
  except Exception as e:  # pylint: disable=broad-except
    print(f"{name:<28} {'-':>8}  ({error_text(e)})", flush=True)


# (bv, num_warps, num_stages) of the state scans.
SCAN_VARIANTS = ((64, 4, 1), (32, 4, 1), (16, 4, 1), (64, 4, 2), (32, 4, 2), (128, 8, 1))


def print_scan(shape, variants=SCAN_VARIANTS):
  """The state scans alone, forward (the outputs, states not written: the forward pass
  alone) and backward, by tiling; device ms and differences from the first variant."""
  from cudnn_jax.triton import kda_scan  # pylint: disable=g-import-not-at-top
  c = 64
  nc = shape.t // c
  chunk = lambda key, d: jax.random.normal(key, (nc, shape.b, shape.h, c, d)) / 8
  keys = jax.random.split(jax.random.key(0), 8)
  # w and the decayed k small enough that the states stay bounded over 256 chunks.
  w, kd = (chunk(key, shape.k) / 2 for key in keys[:2])
  qg = chunk(keys[2], shape.k)
  U, do = chunk(keys[3], shape.v), chunk(keys[4], shape.v)
  P = jnp.tril(chunk(keys[5], c))
  dec = jax.random.uniform(keys[6], (nc, shape.b, shape.h, shape.k), minval=0.9, maxval=1.0)
  state = jax.random.normal(keys[7], (shape.b, shape.h, shape.k, shape.v))
  interpret = jax.default_backend() != "gpu"
  print(f"state scans {shape}, chunk {c}")
  print(f"{'pass, bv, warps, stages':<28} {'ms':>8}  rel diff")
  for name, fn, args in (
      ("fwd", functools.partial(kda_scan.scan_output, with_states=False),
       (w, U, kd, dec, qg, P, state)),
      ("bwd", kda_scan.scan_bwd, (do, qg, w, kd, dec, P, state))):
    want = None
    for bv, warps, stages in variants:
      kernel = jax.jit(functools.partial(fn, bv=bv, num_warps=warps, num_stages=stages,
                                         interpret=interpret))
      want = want or kernel(*args)
      print_variant(f"{name}, {bv}, {warps}, {stages}", kernel, args, want)


def load_fla():
  """(torch, FLA's chunk function for OP), or (None, reason) when either is missing or there
  is no CUDA."""
  torch, why = load_torch()
  if torch is None:
    return None, why
  try:
    # pylint: disable=g-import-not-at-top
    if OP == "gdn":
      from fla.ops.gated_delta_rule import chunk_gated_delta_rule as chunk
    else:
      from fla.ops.kda import chunk_kda as chunk
  except Exception as e:  # pylint: disable=broad-except
    return None, f"FLA not importable ({type(e).__name__}: {e})"
  return torch, chunk


def fla(torch, chunk, x, backward):
  """(ms, forward output as NumPy) for FLA's chunk function on the same inputs."""
  t = {n: torch.from_numpy(np.array(a, np.float32)).cuda() for n, a in x.items()}
  for n in ("q", "k", "v", "beta", "do"):
    t[n] = t[n].to(torch.bfloat16)
  args = [t[n].requires_grad_(backward) for n in ("q", "k", "v", "g", "beta")]

  def step():
    o, _ = chunk(*args, use_qk_l2norm_in_kernel=True)
    if backward:
      torch.autograd.grad(o, args, t["do"])
    return o

  ms = torch_time_ms(torch, step, CALLS, WARMUP)
  ms_b2b = torch_time_ms(torch, step, 3, WARMUP, chained=B2B_CALLS)
  out = None if backward else step().detach().float().cpu().numpy()
  return ms, ms_b2b, out


def run(shapes, anchor, engines, passes=(False, True), regimes=("slow",)):
  """One row per shape, gate regime, pass and engine; FLA (when ``anchor`` has it) once
  per shape, regime and pass, beside every engine."""
  rows = []
  for shape, gates in ((s, g) for s in shapes for g in regimes):
    x = inputs(shape, gates=gates)
    for backward in passes:
      theirs = {}
      if anchor[0] is not None:
        try:
          theirs["fla_ms"], theirs["fla_ms_b2b"], fla_out = fla(*anchor, x, backward)
        except Exception as e:  # pylint: disable=broad-except
          theirs["fla_error"] = error_text(e)
      for engine in engines:
        row = dict(dataclasses.asdict(shape), gates=gates, backward=backward, engine=engine,
                   **theirs)
        try:
          row["ms"], row["ms_b2b"], out = ours(x, backward, engine)
        except Exception as e:  # pylint: disable=broad-except
          row["error"], out = error_text(e), None
        if row.get("ms") and row.get("fla_ms"):
          row["fla_speedup"] = row["ms"] / row["fla_ms"]  # > 1: FLA is faster
          row["fla_speedup_b2b"] = row["ms_b2b"] / row["fla_ms_b2b"]
          if out is not None:
            row["rel_diff_vs_fla"] = rel_diff(out, fla_out)
        print_row(row)
        rows.append(row)
    del x
  return rows


HEADER = (f"{'B':>3} {'T':>6} {'H':>3} {'K':>4} {'V':>4} {'gates':>5} {'pass':>8} "
          f"{'engine':>6} "
          f"{'cudnn_jax ms':>13} "
          f"{'FLA ms':>9} {'ratio':>6} {'b2b ms':>8} {'FLA b2b':>8} {'ratio':>6} "
          f"{'rel diff':>9}")


def print_row(r):
  f = lambda key, fmt: format(r[key], fmt) if r.get(key) is not None else "-"
  pass_ = "fwd+bwd" if r["backward"] else "fwd"
  line = (f"{r['b']:>3} {r['t']:>6} {r['h']:>3} {r['k']:>4} {r['v']:>4} "
          f"{r.get('gates', 'slow'):>5} {pass_:>8} "
          f"{r['engine']:>6} "
          f"{f('ms', '.3f'):>13} {f('fla_ms', '.3f'):>9} {f('fla_speedup', '.2f'):>6} "
          f"{f('ms_b2b', '.3f'):>8} {f('fla_ms_b2b', '.3f'):>8} "
          f"{f('fla_speedup_b2b', '.2f'):>6} {f('rel_diff_vs_fla', '.1e'):>9}")
  note = r.get("error") or r.get("fla_error")
  print(line + (f"  ({note})" if note else ""), flush=True)


def main():
  parser = arg_parser(__doc__)
  parser.add_argument("--quick", action="store_true", help="tiny shapes, no FLA (smoke test)")
  parser.add_argument("--profile", action="store_true",
                      help="instead of the table, where the device time goes by engine stage")
  parser.add_argument("--intra", action="store_true",
                      help="instead of the table, the intra-chunk stage: XLA against the kernel")
  parser.add_argument("--scan", action="store_true",
                      help="instead of the table, the state scan kernels by tiling")
  parser.add_argument("--engine", default="xla",
                      help="cudnn_jax engines, comma-separated: cudnn, triton, xla (the "
                           "table runs each; the other modes the first)")
  parser.add_argument("--gates", default="slow,fla",
                      help="gate regimes of the table, comma-separated: slow, fla")
  parser.add_argument("--forward-only", action="store_true", help="leave out fwd+bwd")
  parser.add_argument("--shapes", default="8x4096,2x16384",
                      help="comma-separated BxT pairs (H=16, K=V=128)")
  parser.add_argument("--op", default="kda", choices=("kda", "gdn"),
                      help="the op of the table (the other modes run kda)")
  args = parser.parse_args()
  engines = args.engine.split(",")
  if unknown := set(engines) - {"cudnn", "triton", "xla"}:
    parser.error(f"--engine: unknown {sorted(unknown)}")
  regimes = args.gates.split(",")
  if unknown := set(regimes) - set(GATES):
    parser.error(f"--gates: unknown {sorted(unknown)}")
  global ENGINE, OP  # pylint: disable=global-statement
  ENGINE = engines[0]
  print(f"cudnn_jax engines: {', '.join(engines)}")
  if args.profile:
    print_profile(Shape(b=2, t=256, h=2, k=32, v=32) if args.quick
                  else Shape(b=8, t=4096, h=16, k=128, v=128))
    return
  if args.intra:
    print_intra(Shape(b=2, t=256, h=2, k=32, v=32) if args.quick
                else Shape(b=8, t=4096, h=16, k=128, v=128))
    return
  if args.scan:
    for b, t in ((2, 256),) if args.quick else (pair.split("x") for pair in args.shapes.split(",")):
      print_scan(Shape(b=int(b), t=int(t), h=2 if args.quick else 16, k=128, v=128))
    return
  OP = args.op
  print(f"op: {OP}")
  if args.quick:
    shapes = [Shape(b=2, t=256, h=2, k=32, v=32)]
    anchor = (None, "--quick")
  else:
    shapes = [Shape(b=int(b), t=int(t), h=16, k=128, v=128)
              for b, t in (pair.split("x") for pair in args.shapes.split(","))]
    anchor = load_fla()
  if anchor[0] is None:
    print(f"FLA column left out: {anchor[1]}")
  print("ratio = cudnn_jax ms / FLA ms (> 1: FLA is faster)")
  print(HEADER)
  start = time.perf_counter()
  rows = run(shapes, anchor, engines, (False,) if args.forward_only else (False, True),
             regimes)
  elapsed = time.perf_counter() - start
  path = write_results(args.out, OP + "_" + "_".join(engines), rows, quick=args.quick, seconds=elapsed,
                       warmup=WARMUP, calls=CALLS, fla=anchor[0] is not None or anchor[1],
                       engines=engines)
  png = plot(rows, path[:-len(".json")] + ".png",
             f"{OP}, {jax.devices()[0].device_kind}")
  print(f"{elapsed:.0f} s; wrote {path} and {png}")


def plot(rows, path, title):
  """Milliseconds (back to back where measured) per shape and pass: each engine, and FLA's
  chunk function (the anchor, hatched) where it ran."""
  label = lambda r: (f"B{r['b']} T{r['t']} {r.get('gates', 'slow')} "
                     f"{'fwd+bwd' if r['backward'] else 'fwd'}")
  groups = list(dict.fromkeys(label(r) for r in rows))
  series = {}
  for r in rows:
    ms = r.get("ms_b2b") or r.get("ms")
    series.setdefault(f"cudnn_jax {r['engine']}", {})[label(r)] = ms
    if r.get("fla_ms"):
      series.setdefault("FLA", {})[label(r)] = r.get("fla_ms_b2b") or r["fla_ms"]
  series = {name: [v.get(g) for g in groups] for name, v in series.items()}
  return bar_chart(path, title, groups, series, "ms per call (lower is better)",
                   anchors=["FLA"])


if __name__ == "__main__":
  main()
