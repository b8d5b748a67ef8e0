"""Benchmark of the cudnn engine on packed sequences and paged KV caches.

    python bench/sdpa_features.py [--cases varlen,paged] [--calls 20] [--out DIR] [--quick]

varlen: a packed training batch of 16384 tokens in 16 sequences of Dirichlet-random
lengths (B=1 packed), 16 heads, head dim 128, causal, bfloat16. cudnn_jax.sdpa_varlen
(implementation="cudnn") on the packed rows against the same sequences padded to the
longest one through jax.nn.dot_product_attention(implementation="cudnn") with
query_seq_lengths and key_value_seq_lengths (padded once, outside the timing); forward and
forward+backward (the gradients of query, key and value). TFLOP/s count only each
sequence's own causal work, 4*N*H*L*(L+1)/2 forward (x3.5 forward+backward), for both.
Target: the packed call >= 1.5x faster.

paged: decode, B=64, 32 query heads, 8 kv heads, head dim 128, 8192 cached tokens per
sequence in pages of 64 rows on shuffled physical pages, bfloat16. cudnn_jax.sdpa_paged
(implementation="cudnn") against jax.nn.dot_product_attention(implementation="cudnn") on
the same keys and values in a contiguous [B,S,K,H] cache with key_value_seq_lengths.
GB/s of K+V read (2*B*S*K*H*2 bytes). Target: >= 3.4 TB/s (jax.nn dense about 2.9).

Two times per row: "ms", the median wall time of --calls single jitted calls, each
waited for; "b2b", per call of --calls calls issued back to back (device throughput,
harness.time_back_to_back). Targets are judged on b2b. An engine that declines a call is
reported with its reason (cudnn_jax.explain's verdict is recorded with every row).

With --quick: small shapes, for a smoke test; on a CPU the xla engines stand in for cuDNN.
Writes DIR/sdpa_features.json and DIR/sdpa_features.png (DIR defaults to bench/results).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import cudnn_jax
from harness import (arg_parser, error_text, pyplot, rel_diff, save_figure, time_back_to_back,
                     time_calls, write_results)

CASES = ("varlen", "paged")
VARLEN_SPEEDUP_TARGET = 1.5  # packed / padded, forward and forward+backward
PAGED_GBPS_TARGET = 3400.0
PAGED_GBPS_JAX_NN = 2900.0  # jax.nn's cudnn engine on a dense cache, for reference


@dataclasses.dataclass(frozen=True)
class VarlenShape:
  tokens: int
  seqs: int
  n: int
  h: int
  alpha: float = 1.0  # Dirichlet concentration of the lengths

  def lengths(self, seed=0):
    """``seqs`` lengths >= 1 summing to ``tokens``."""
    p = np.random.default_rng(seed).dirichlet(np.full(self.seqs, self.alpha))
    lengths = 1 + np.floor(p * (self.tokens - self.seqs)).astype(np.int64)
    lengths[np.argmax(lengths)] += self.tokens - lengths.sum()
    return lengths

  def flops(self, lengths, backward):
    """Each sequence's causal logits (the diagonal included), nothing of the padding."""
    pairs = float(np.sum(lengths * (lengths + 1) / 2))
    return 4.0 * self.n * self.h * pairs * (3.5 if backward else 1.0)


@dataclasses.dataclass(frozen=True)
class PagedShape:
  b: int
  n: int
  k: int
  h: int
  s: int  # cached tokens per sequence
  page: int

  def kv_bytes(self, dtype):
    return 2 * self.b * self.s * self.k * self.h * jnp.dtype(dtype).itemsize


def shapes(quick):
  if quick:
    return VarlenShape(tokens=1024, seqs=8, n=2, h=64), PagedShape(b=4, n=4, k=2, h=64,
                                                                   s=512, page=16)
  return VarlenShape(tokens=16384, seqs=16, n=16, h=128), PagedShape(b=64, n=32, k=8, h=128,
                                                                     s=8192, page=64)


def step_fn(attn, backward):
  """jitted ``(dout, q, k, v, *meta)`` -> ``attn(q, k, v, *meta)``, or the gradients of
  ``sum(out * dout)`` for q, k and v."""
  def step(dout, q, k, v, *meta):
    if not backward:
      return attn(q, k, v, *meta)
    loss = lambda q, k, v: jnp.sum(attn(q, k, v, *meta).astype(jnp.float32)
                                   * dout.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  return jax.jit(step)


def verdict(text):
  """The line of cudnn_jax.explain that says which engine serves, or why none does."""
  return text.splitlines()[0] if text else ""


def measure(row, fn, args, calls):
  """Fills ``row`` with "ms" and "ms_b2b" (or "error") and returns the first output."""
  try:
    first = jax.tree.leaves(jax.block_until_ready(fn(*args)))[0]
    row["ms"] = 1e3 * time_calls(fn, args, calls)
    row["ms_b2b"] = 1e3 * time_back_to_back(fn, args, calls)
    return first
  except Exception as e:  # pylint: disable=broad-except
    row["error"] = error_text(e)
    return None


def add_rates(row, amount, unit, scale):
  """``unit`` (e.g. "tflops") beside each time: ``amount / seconds / scale``."""
  for key in ("ms", "ms_b2b"):
    if row.get(key):
      row[key.replace("ms", unit)] = amount / (row[key] * 1e-3) / scale
  return row


def compare_rows(rows, outs, to_common=lambda x: x):
  """Speed-up of rows[0] (ours) over rows[1] (the baseline) and their outputs' distance."""
  ours, base = rows
  for key in ("ms", "ms_b2b"):
    if ours.get(key) and base.get(key):
      ours[key.replace("ms", "speedup")] = base[key] / ours[key]
  if outs[0] is not None and outs[1] is not None:
    ours["rel_diff_vs_baseline"] = rel_diff(outs[0], to_common(outs[1]))


def run_varlen(shape, engine, dtype, calls):
  lengths = shape.lengths()
  longest = int(lengths.max())
  cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
  print(f"varlen: {shape.seqs} sequences, {shape.tokens} tokens, longest {longest}: "
        f"{lengths.tolist()}")
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, dout = (jax.random.normal(key, (shape.tokens, shape.n, shape.h), dtype)
                   for key in keys)
  # Packed row r is row pos[r] of sequence seq[r]; padded slots past a length are 0.
  seq = np.repeat(np.arange(shape.seqs), lengths)
  pos = np.arange(shape.tokens) - cu[seq]
  slots = np.full((shape.seqs, longest), shape.tokens, np.int64)
  slots[seq, pos] = np.arange(shape.tokens)
  pad = lambda x: jnp.take(x, slots, axis=0, mode="fill", fill_value=0)
  padded = jax.block_until_ready([pad(x) for x in (q, k, v, dout)])
  lens = jnp.asarray(lengths, jnp.int32)
  cu = jnp.asarray(cu)

  def ours(q, k, v, cu):
    return cudnn_jax.sdpa_varlen(q, k, v, cu, cu, max_seqlen_q=longest, max_seqlen_kv=longest,
                                 is_causal=True, implementation=engine)

  def base(q, k, v, lens):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lens,
                                        key_value_seq_lengths=lens, implementation=engine)

  served = verdict(cudnn_jax.explain("sdpa_varlen", q, k, v, cu, cu, max_seqlen_q=longest,
                                     max_seqlen_kv=longest, is_causal=True,
                                     implementation=engine))
  rows = []
  for backward in (False, True):
    group, outs = [], []
    for name, attn, args, note in (
        (f"cudnn_jax.sdpa_varlen {engine}", ours, (dout, q, k, v, cu), served),
        (f"jax.nn {engine} (padded)", base, tuple(padded[3:]) + tuple(padded[:3]) + (lens,),
         f"padded to [{shape.seqs}, {longest}]")):
      row = dict(case="varlen", engine=name, backward=backward, tokens=shape.tokens,
                 seqs=shape.seqs, longest=longest, n=shape.n, h=shape.h,
                 dtype=jnp.dtype(dtype).name, note=note)
      outs.append(measure(row, step_fn(attn, backward), args, calls))
      group.append(add_rates(row, shape.flops(lengths, backward), "tflops", 1e12))
    # The padded baseline's out (or dq) back in packed rows, for the distance.
    compare_rows(group, outs, lambda x: x[seq, pos])
    rows.extend(group)
  return rows, dict(lengths=lengths.tolist())


def run_paged(shape, engine, dtype, calls):
  pages_per_seq = shape.s // shape.page
  pages = shape.b * pages_per_seq
  perm = np.random.default_rng(1).permutation(pages)
  table = jnp.asarray(perm.reshape(shape.b, pages_per_seq), jnp.int32)
  keys = jax.random.split(jax.random.key(1), 3)
  query = jax.random.normal(keys[0], (shape.b, 1, shape.n, shape.h), dtype)
  dense = [jax.random.normal(key, (shape.b, shape.s, shape.k, shape.h), dtype)
           for key in keys[1:]]
  # Logical page j of sequence b lives in physical page perm[b * pages_per_seq + j].
  inverse = jnp.asarray(np.argsort(perm))
  caches = jax.block_until_ready(
      [x.reshape(pages, shape.page, shape.k, shape.h)[inverse] for x in dense])
  lens = jnp.full((shape.b,), shape.s, jnp.int32)
  print(f"paged: B={shape.b}, {shape.n}/{shape.k} heads, d={shape.h}, {shape.s} cached "
        f"tokens, page {shape.page}, {pages} pages shuffled")

  def ours(q, key_cache, value_cache, table, lens):
    return cudnn_jax.sdpa_paged(q, key_cache, value_cache, table, lens, implementation=engine)

  def base(q, k, v, lens):
    return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lens,
                                        implementation=engine)

  served = verdict(cudnn_jax.explain("sdpa_paged", query, *caches, table, lens,
                                     implementation=engine))
  group, outs = [], []
  for name, attn, args, note in (
      (f"cudnn_jax.sdpa_paged {engine}", ours, (query, query, *caches, table, lens), served),
      (f"jax.nn {engine} (dense cache)", base, (query, query, *dense, lens),
       "contiguous [B,S,K,H] cache")):
    row = dict(case="paged", engine=name, backward=False, b=shape.b, s=shape.s, n=shape.n,
               k=shape.k, h=shape.h, page=shape.page, dtype=jnp.dtype(dtype).name, note=note)
    outs.append(measure(row, step_fn(attn, False), args, calls))
    group.append(add_rates(row, shape.kv_bytes(dtype), "gbps", 1e9))
  compare_rows(group, outs)
  return group, {}


def targets(rows, quick):
  """Lines saying whether each target is met (on back-to-back times)."""
  lines = []
  for r in rows:
    if not r["engine"].startswith("cudnn_jax"):
      continue
    what = f"{r['case']} {'fwd+bwd' if r['backward'] else 'fwd'}"
    if r.get("error"):
      lines.append(f"{what}: not measured ({r['error']})")
    elif r["case"] == "varlen" and r.get("speedup_b2b"):
      met = r["speedup_b2b"] >= VARLEN_SPEEDUP_TARGET
      lines.append(f"{what}: {r['speedup_b2b']:.2f}x the padded jax.nn call (target >= "
                   f"{VARLEN_SPEEDUP_TARGET}x): {'met' if met else 'NOT met'}")
    elif r["case"] == "paged" and r.get("gbps_b2b"):
      met = r["gbps_b2b"] >= PAGED_GBPS_TARGET
      lines.append(f"{what}: {r['gbps_b2b']:.0f} GB/s of K+V (target >= "
                   f"{PAGED_GBPS_TARGET:.0f}; jax.nn dense about {PAGED_GBPS_JAX_NN:.0f}): "
                   f"{'met' if met else 'NOT met'}")
  if quick:
    lines = [line + " [--quick shapes: not the benchmark]" for line in lines]
  return lines


HEADER = (f"{'case':<7} {'pass':<8} {'engine':<36} {'ms':>8} {'ms(b2b)':>8} {'rate':>8} "
          f"{'rate(b2b)':>10} {'speed-up':>8} {'rel diff':>9}")


def print_row(r):
  def f(key, fmt):
    return format(r[key], fmt) if r.get(key) is not None else "-"
  rate = "tflops" if r["case"] == "varlen" else "gbps"
  unit = "TFLOP/s" if rate == "tflops" else "GB/s"
  line = (f"{r['case']:<7} {'fwd+bwd' if r['backward'] else 'fwd':<8} {r['engine']:<36} "
          f"{f('ms', '.3f'):>8} {f('ms_b2b', '.3f'):>8} {f(rate, '.4g'):>8} "
          f"{f(rate + '_b2b', '.4g'):>10} {f('speedup_b2b', '.2f'):>8} "
          f"{f('rel_diff_vs_baseline', '.1e'):>9}  {unit}")
  note = r.get("error") or r.get("note")
  print(line + (f"  ({note})" if note else ""), flush=True)


def plot(rows, path, with_target):
  """One panel per case: TFLOP/s (varlen) or GB/s (paged), back to back, per engine; the
  packed call's speed-up over the padded one above its bars."""
  plt = pyplot()

  cases = [c for c in CASES if any(r["case"] == c for r in rows)]
  fig, axes = plt.subplots(1, len(cases), figsize=(5.5 * len(cases), 4.2), squeeze=False)
  for ax, case in zip(axes[0], cases):
    mine = [r for r in rows if r["case"] == case]
    passes = list(dict.fromkeys(r["backward"] for r in mine))
    names = list(dict.fromkeys(r["engine"] for r in mine))
    metric = "tflops_b2b" if case == "varlen" else "gbps_b2b"
    width = 0.8 / len(names)
    for i, name in enumerate(names):
      values = [next((r.get(metric) or 0.0 for r in mine
                      if r["engine"] == name and r["backward"] == b), 0.0) for b in passes]
      bars = ax.bar(np.arange(len(passes)) + i * width, values, width, label=name)
      if case == "varlen" and i == 0:
        for bar, b in zip(bars, passes):
          up = next((r.get("speedup_b2b") for r in mine
                     if r["engine"] == name and r["backward"] == b), None)
          if up:
            ax.annotate(f"{up:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
    ax.set_xticks(np.arange(len(passes)) + 0.4 - width / 2,
                  ["fwd+bwd" if b else "fwd" for b in passes])
    if case == "paged" and with_target:
      ax.axhline(PAGED_GBPS_TARGET, color="k", linestyle="--", linewidth=1,
                 label=f"target {PAGED_GBPS_TARGET:.0f} GB/s")
    if case == "paged":
      ax.set_ylabel("GB/s of K+V (back to back)")
      ax.set_title(f"paged decode, B={mine[0]['b']}, S={mine[0]['s']}, page {mine[0]['page']}")
    else:
      ax.set_ylabel("effective TFLOP/s (back to back)")
      ax.set_title(f"packed causal, {mine[0]['tokens']} tokens in {mine[0]['seqs']} sequences")
    ax.legend(fontsize=7)
  fig.suptitle(f"{rows[0]['dtype']}, {jax.devices()[0].device_kind}", fontsize=9)
  save_figure(fig, path)


def collect(cases, quick, calls, out):
  """Runs the cases, prints their tables and verdicts, writes DIR/sdpa_features.png;
  (rows, meta) for a results file."""
  on_gpu = jax.default_backend() == "gpu"
  engine = "cudnn" if on_gpu else "xla"
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  varlen_shape, paged_shape = shapes(quick)
  runners = dict(varlen=functools.partial(run_varlen, varlen_shape),
                 paged=functools.partial(run_paged, paged_shape))
  rows, meta = [], {}
  for case in cases:
    case_rows, case_meta = runners[case](engine, dtype, calls)
    print(HEADER)
    for r in case_rows:
      print_row(r)
    rows.extend(case_rows)
    meta.update({f"{case}_{k}": v for k, v in case_meta.items()})
  verdicts = targets(rows, quick)
  print("\n".join(verdicts))
  plot(rows, os.path.join(out, "sdpa_features.png"), with_target=not quick)
  meta.update(engine=engine, calls=calls, targets=verdicts,
              varlen_shape=dataclasses.asdict(varlen_shape),
              paged_shape=dataclasses.asdict(paged_shape))
  return rows, meta


def main():
  parser = arg_parser(__doc__)
  parser.add_argument("--cases", default=",".join(CASES),
                      help=f"comma-separated, of {', '.join(CASES)}")
  parser.add_argument("--calls", type=int, default=20, help="timed calls per measurement")
  parser.add_argument("--quick", action="store_true", help="small shapes (smoke test)")
  args = parser.parse_args()
  cases = [c for c in args.cases.split(",") if c]
  if not cases or set(cases) - set(CASES):
    parser.error(f"--cases: expected some of {', '.join(CASES)}, got {args.cases!r}")
  if jax.default_backend() != "gpu" and not args.quick:
    parser.error(f"the full benchmark needs a GPU (backend is {jax.default_backend()!r}); "
                 "use --quick for a smoke test")
  os.makedirs(args.out, exist_ok=True)
  start = time.perf_counter()
  rows, meta = collect(cases, args.quick, args.calls, args.out)
  elapsed = time.perf_counter() - start
  json_path = write_results(args.out, "sdpa_features", rows, quick=args.quick,
                            seconds=elapsed, cache_info=cudnn_jax.cache_info(), **meta)
  print(f"{elapsed:.0f} s; wrote {json_path} and {os.path.join(args.out, 'sdpa_features.png')}")


if __name__ == "__main__":
  main()
