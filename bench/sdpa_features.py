"""Benchmark of the cudnn engine on packed sequences and paged KV caches.

    python bench/sdpa_features.py [--cases varlen,paged] [--calls 20] [--out DIR] [--quick]
        [--paged-engines cudnn,triton]

varlen: a packed training batch of 16384 tokens in 16 sequences of Dirichlet-random
lengths (B=1 packed), 16 heads, head dim 128, causal, bfloat16. cudnn_jax.sdpa_varlen
(implementation="cudnn") on the packed rows against the same sequences padded to the
longest one through jax.nn.dot_product_attention(implementation="cudnn") with
query_seq_lengths and key_value_seq_lengths (padded once, outside the timing); forward and
forward+backward (the gradients of query, key and value). TFLOP/s count only each
sequence's own causal work, 4*N*H*L*(L+1)/2 forward (x3.5 forward+backward), for both.
Target: the packed call >= 1.5x faster.

paged: three row groups, bfloat16, head dim 128, every sequence holding S cached tokens
(the new query tokens among them) in a [P,page,K,H] cache on shuffled physical pages
(page table [B, S/page]):
  (a) B=64, 32 query / 8 kv heads, S=8192, page 64;
  (b) B=8, 64 query / 8 kv heads, S=32768, page 16;
  (c) B=256, 32 query / 8 kv heads, S=4096, page 16.
Per group, side by side in one run (cudnn_jax.sdpa_paged on each of --paged-engines,
default cudnn and triton, the others with implementation="cudnn"):
  decode, T=1 query row: cudnn_jax.sdpa_paged; cudnn_jax.sdpa_paged on the same caches
    quantized to float8_e4m3fn (k_scale / v_scale = max|x| / 448); JAX's Pallas kernel
    jax.experimental.pallas.ops.gpu.paged_attention on a [K,P,page,H] copy of the caches
    (the query pre-scaled by 1/sqrt(d): the kernel applies no scale; 128 keys per compute
    block, k_splits the largest divisor <= 16 of the pages per sequence); and the
    baseline, jax.nn.dot_product_attention on the same keys and values stored
    contiguously [B,S,K,H] with key_value_seq_lengths.
  multi-token decode (speculative decoding / MTP), T=2, 4, 8, and chunked prefill,
  T=16, 128, 512:
    cudnn_jax.sdpa_paged (bottom-right causal, query_seq_lengths all T) against the
    baseline cudnn_jax.sdpa on the contiguous keys and values with query_seq_lengths,
    key_value_seq_lengths, is_causal=True, causal_alignment="bottom_right".
Every layout, copy and quantization is made once, outside the timing. Rates: GB/s of the
cache read, 2*B*S*K*H*itemsize bytes (2 for bfloat16; FP8 rows count their 1-byte
elements, and also give "gbps_bf16eq": the bfloat16 cache's bytes over the same time);
TFLOP/s as well, 4*B*N*d*(T*(S-T) + T*(T+1)/2) (shown for chunked prefill).
Targets, per group and sdpa_paged engine: decode >= 0.95x jax.nn's GB/s on the contiguous
cache and >= 85% of the card's datasheet HBM bandwidth (H100 3350 GB/s, H200 4800 GB/s; another card is
"unknown card", not judged); FP8-cache decode time <= 0.6x the bfloat16 cache's; GB/s at
T=2, 4, 8 >= 0.9x the T=1 GB/s (the same cache bytes); chunked prefill at each T >= 0.95x
the speed of cudnn_jax.sdpa on the contiguous cache.

Two times per row: "ms", the median wall time of --calls single jitted calls, each
waited for; "b2b", per call of --calls calls issued back to back (device throughput,
harness.time_back_to_back). Targets are judged on b2b. Each row but a group's last is
compared with that last one, the baseline ("speedup", "rel_diff_vs_baseline" of the
outputs). An engine that fails or declines a call is reported with its reason and the run
goes on (every cudnn_jax row records cudnn_jax.explain's verdict).

With --quick: tiny shapes of the same structure, for a smoke test; on a CPU the xla
engines stand in for cuDNN, float32 for bfloat16, and the Pallas kernel runs with
interpret=True (off the GPU it is skipped for the full shapes, with the reason recorded).
Writes DIR/sdpa_features.json and DIR/sdpa_features.png (DIR defaults to bench/results):
the varlen panel, then the paged ones, grouped bars per row group and engine: GB/s back to
back at T=1, 2, 4, 8 (with 85% of the card's HBM bandwidth where the card is known), and
TFLOP/s back to back in chunked prefill.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import cudnn_jax
from harness import (arg_parser, error_text, pyplot, rel_diff, save_figure, time_back_to_back,
                     time_calls, write_results)

CASES = ("varlen", "paged")
VARLEN_SPEEDUP_TARGET = 1.5  # packed / padded, forward and forward+backward
# The paged targets, per row group, on back-to-back times.
PAGED_VS_JAX_NN_TARGET = 0.95  # decode GB/s / jax.nn's on the contiguous cache, at least
PAGED_HBM_TARGET = 0.85  # decode GB/s / the card's datasheet HBM GB/s, at least
PAGED_FP8_TIME_TARGET = 0.6  # FP8-cache decode time / the bf16 cache's, at most
PAGED_MTP_RATE_TARGET = 0.9  # GB/s at each of MTP_TS / T=DECODE_T GB/s, at least
PAGED_PREFILL_TARGET = 0.95  # chunked prefill speed / cudnn_jax.sdpa's contiguous, at least
HBM_GBPS = (("H200", 4800.0), ("H100", 3350.0))  # datasheet, by device_kind substring
DECODE_T, MTP_TS, PREFILL_TS = 1, (2, 4, 8), (16, 128, 512)  # query rows per sequence
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
PAGED_ENGINES = {True: ("cudnn", "triton"), False: ("xla",)}  # by "on a GPU"
PALLAS_BLOCK_KEYS = 128  # keys per compute block of the Pallas kernel
PALLAS_MAX_SPLITS = 16


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
  name: str  # the row group: a, b or c
  b: int
  n: int
  k: int
  h: int
  s: int  # cached tokens per sequence, the new query tokens among them
  page: int

  @property
  def pages_per_seq(self):
    return self.s // self.page

  @property
  def title(self):
    return f"({self.name}) B={self.b}, {self.n}/{self.k} heads, S={self.s}, page {self.page}"

  def kv_bytes(self, dtype):
    return 2 * self.b * self.s * self.k * self.h * jnp.dtype(dtype).itemsize

  def flops(self, t):
    """Bottom-right causal: query row i of ``t`` sees ``s - t + i + 1`` keys."""
    return 4.0 * self.b * self.n * self.h * (t * (self.s - t) + t * (t + 1) / 2)


def shapes(quick):
  """The varlen shape and the paged row groups."""
  if quick:
    return (VarlenShape(tokens=1024, seqs=8, n=2, h=64),
            (PagedShape("a", b=2, n=4, k=2, h=64, s=512, page=64),
             PagedShape("b", b=1, n=8, k=2, h=64, s=1024, page=16),
             PagedShape("c", b=4, n=4, k=2, h=64, s=256, page=16)))
  return (VarlenShape(tokens=16384, seqs=16, n=16, h=128),
          (PagedShape("a", b=64, n=32, k=8, h=128, s=8192, page=64),
           PagedShape("b", b=8, n=64, k=8, h=128, s=32768, page=16),
           PagedShape("c", b=256, n=32, k=8, h=128, s=4096, page=16)))


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


def explained(fn_name, *args, **kwargs):
  """verdict() of cudnn_jax.explain, with the chosen engine's own account where it gives
  one (pages read in place or gathered, say); the error where explain raises."""
  try:
    text = cudnn_jax.explain(fn_name, *args, **kwargs)
  except Exception as e:  # pylint: disable=broad-except
    return f"explain: {error_text(e)}"
  how = next((line.split(": chosen ", 1)[1] for line in text.splitlines()[1:]
              if ": chosen (" in line), "")
  return verdict(text) + (f" {how}" if how else "")


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
  """Speed-up of each row but the last (ours) over the last (the baseline) and their
  outputs' distance."""
  *ours, base = rows
  for row, out in zip(ours, outs):
    for key in ("ms", "ms_b2b"):
      if row.get(key) and base.get(key):
        row[key.replace("ms", "speedup")] = base[key] / row[key]
    if out is not None and outs[-1] is not None:
      row["rel_diff_vs_baseline"] = rel_diff(out, to_common(outs[-1]))


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


def paged_caches(shape, dtype):
  """Seeded keys and values of ``shape``: contiguous ``[B,S,K,H]`` and paged
  ``[P,page,K,H]`` on shuffled physical pages, the page table and the lengths (all S)."""
  pages = shape.b * shape.pages_per_seq
  perm = np.random.default_rng(1).permutation(pages)
  table = jnp.asarray(perm.reshape(shape.b, shape.pages_per_seq), jnp.int32)
  dense = [jax.random.normal(key, (shape.b, shape.s, shape.k, shape.h), dtype)
           for key in jax.random.split(jax.random.key(1), 2)]
  # Logical page j of sequence b lives in physical page perm[b * pages_per_seq + j].
  inverse = jnp.asarray(np.argsort(perm))
  caches = [x.reshape(pages, shape.page, shape.k, shape.h)[inverse] for x in dense]
  lens = jnp.full((shape.b,), shape.s, jnp.int32)
  return jax.block_until_ready((dense, caches, table, lens))


@jax.jit
def quantize(cache):
  """``cache`` as float8_e4m3fn and its float32 scale, max|cache| / 448 (real value =
  stored value * scale)."""
  x = cache.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x)) / FP8_MAX
  return (x / scale).astype(jnp.float8_e4m3fn), scale


def query_lengths(q):
  """All T query rows valid (``[B]``), or None for decode."""
  return None if q.shape[1] == 1 else jnp.full((q.shape[0],), q.shape[1], jnp.int32)


def paged_kwargs(q, engine, scales=()):
  """cudnn_jax.sdpa_paged's keywords (its default causal: bottom-right)."""
  k_scale, v_scale = scales or (None, None)
  return dict(query_seq_lengths=query_lengths(q), k_scale=k_scale, v_scale=v_scale,
              implementation=engine)


def contiguous_kwargs(q, lens, engine):
  """cudnn_jax.sdpa's keywords for the paged call's math on the contiguous cache."""
  return dict(is_causal=True, causal_alignment="bottom_right",
              query_seq_lengths=query_lengths(q), key_value_seq_lengths=lens,
              implementation=engine)


# An entry of a row group: (impl, engine, attn or None, args, note, cache dtype), attn
# called as attn(*args); an attn of None is skipped, its note saying why.

def paged_entry(engine, q, caches, table, lens, cache_dtype, scales=()):
  """cudnn_jax.sdpa_paged on ``caches`` (FP8 with ``scales``)."""
  def attn(q, key_cache, value_cache, table, lens, *scales):
    return cudnn_jax.sdpa_paged(q, key_cache, value_cache, table, lens,
                                **paged_kwargs(q, engine, scales))
  note = explained("sdpa_paged", q, *caches, table, lens, **paged_kwargs(q, engine, scales))
  return ("paged_fp8" if scales else "paged",
          f"cudnn_jax.sdpa_paged {engine}" + (" fp8 cache" if scales else ""), attn,
          (q, *caches, table, lens, *scales), note, cache_dtype)


def jax_nn_entry(engine, q, dense, lens, dtype):
  """jax.nn.dot_product_attention on the contiguous cache (decode)."""
  def attn(q, k, v, lens):
    return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lens,
                                        implementation=engine)
  return ("jax_nn", f"jax.nn {engine} (contiguous)", attn, (q, *dense, lens),
          "contiguous [B,S,K,H] cache", dtype)


def contiguous_entry(engine, q, dense, lens, dtype):
  """cudnn_jax.sdpa on the contiguous cache, bottom-right causal (T > 1)."""
  def attn(q, k, v, lens):
    return cudnn_jax.sdpa(q, k, v, **contiguous_kwargs(q, lens, engine))
  note = explained("sdpa", q, *dense, **contiguous_kwargs(q, lens, engine))
  return ("sdpa", f"cudnn_jax.sdpa {engine} (contiguous)", attn, (q, *dense, lens),
          f"contiguous [B,S,K,H] cache; {note}", dtype)


def pallas_settings(shape):
  """(pages_per_compute_block, k_splits): PALLAS_BLOCK_KEYS keys a block, the most splits
  up to PALLAS_MAX_SPLITS that divide the pages per sequence into whole blocks."""
  pages = shape.pages_per_seq
  block = max(1, min(PALLAS_BLOCK_KEYS // shape.page, pages))
  whole = lambda d: pages % d == 0 and (pages // d) % min(block, pages // d) == 0
  return block, max((d for d in range(1, PALLAS_MAX_SPLITS + 1) if whole(d)), default=1)


def pallas_entry(shape, q, caches, table, lens, dtype, interpret, skip):
  """JAX's Pallas paged-attention kernel (decode) on a ``[K,P,page,H]`` copy of the caches;
  the query pre-scaled by 1/sqrt(H), as the kernel applies no scale."""
  name = "jax.pallas paged_attention" + (" interpret" if interpret else "")
  if skip:
    return ("pallas", name, None, (), skip, dtype)
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)  # the module says it's deprecated
      # pylint: disable-next=g-import-not-at-top
      from jax.experimental.pallas.ops.gpu import paged_attention
  except Exception as e:  # pylint: disable=broad-except
    return ("pallas", name, None, (), error_text(e), dtype)
  block, splits = pallas_settings(shape)

  def attn(q, k_pages, v_pages, table, lens):
    return paged_attention.paged_attention(
        q[:, 0], k_pages, v_pages, table, lens, pages_per_compute_block=block,
        k_splits=splits, interpret=interpret)[:, None]

  pages = [jnp.moveaxis(c, 2, 0) for c in caches]
  scaled = (q * shape.h ** -0.5).astype(dtype)
  args = jax.block_until_ready((scaled, *pages, table, lens))
  return ("pallas", name, attn, args,
          f"[K,P,page,H] copy; pages_per_compute_block={block}, k_splits={splits}", dtype)


def run_paged_group(shape, t, dtype, entries, calls):
  """The rows of ``entries`` with ``t`` query rows on ``shape``; the last is the baseline
  the others are compared with."""
  group, outs = [], []
  for impl, name, attn, args, note, cache_dtype in entries:
    row = dict(case="paged", shape=shape.name, t=t, impl=impl, engine=name, backward=False,
               b=shape.b, s=shape.s, n=shape.n, k=shape.k, h=shape.h, page=shape.page,
               dtype=jnp.dtype(dtype).name, cache_dtype=jnp.dtype(cache_dtype).name,
               cache_bytes=shape.kv_bytes(cache_dtype), note=note)
    if attn is None:
      row["error"] = f"skipped: {note}"
      outs.append(None)
    else:  # step_fn's first argument (dout) is unused by a forward call
      outs.append(measure(row, step_fn(attn, False), (None, *args), calls))
    add_rates(row, row["cache_bytes"], "gbps", 1e9)
    add_rates(row, shape.flops(t), "tflops", 1e12)
    if jnp.dtype(cache_dtype) != jnp.dtype(dtype):
      add_rates(row, shape.kv_bytes(jnp.bfloat16), "gbps_bf16eq", 1e9)
    group.append(row)
  compare_rows(group, outs)
  return group


def run_paged_shape(shape, engine, paged_engines, dtype, calls, interpret, pallas_skip):
  """One row group: decode, multi-token decode and chunked prefill, ``sdpa_paged`` on each
  of ``paged_engines``; (rows, FP8 scales)."""
  dense, caches, table, lens = paged_caches(shape, dtype)
  fp8_caches, scales = zip(*jax.block_until_ready([quantize(c) for c in caches]))
  print(f"paged {shape.title}, d={shape.h}: {shape.b * shape.pages_per_seq} pages shuffled; "
        f"FP8 scales k {float(scales[0]):.3g}, v {float(scales[1]):.3g}")
  rows = []
  for t in (t for t in (DECODE_T, *MTP_TS, *PREFILL_TS) if t <= shape.s):
    q = jax.random.normal(jax.random.fold_in(jax.random.key(2), t),
                          (shape.b, t, shape.n, shape.h), dtype)
    entries = [paged_entry(e, q, caches, table, lens, dtype) for e in paged_engines]
    if t == DECODE_T:
      entries += [paged_entry(e, q, fp8_caches, table, lens, jnp.float8_e4m3fn, scales)
                  for e in paged_engines]
      entries += [pallas_entry(shape, q, caches, table, lens, dtype, interpret, pallas_skip),
                  jax_nn_entry(engine, q, dense, lens, dtype)]
    else:
      entries.append(contiguous_entry(engine, q, dense, lens, dtype))
    rows.extend(run_paged_group(shape, t, dtype, entries, calls))
  return rows, [float(s) for s in scales]


def run_paged(paged_shapes, paged_engines, quick, engine, dtype, calls):
  interpret = jax.default_backend() != "gpu"
  skip = ("Pallas interpret mode off the GPU: too slow for the full shapes"
          if interpret and not quick else None)
  rows, fp8_scales = [], {}
  for shape in paged_shapes:  # one shape's arrays at a time
    shape_rows, fp8_scales[shape.name] = run_paged_shape(shape, engine, paged_engines, dtype,
                                                         calls, interpret, skip)
    rows.extend(shape_rows)
  return rows, dict(fp8_scales=fp8_scales, query_rows=[DECODE_T, *MTP_TS, *PREFILL_TS],
                    pallas_interpret=interpret, engines=list(paged_engines))


def hbm_gbps():
  """(the datasheet HBM GB/s of this card or None, its device_kind)."""
  kind = jax.devices()[0].device_kind
  return next((gbps for name, gbps in HBM_GBPS if name in kind), None), kind


def measured(r, key):
  """(``r[key]``, None), or (None, why the row has none)."""
  if r is None:
    return None, "row missing"
  if not r.get(key):
    return None, f"{r['engine']}: {r.get('error', 'no time')}"
  return r[key], None


def ratio(a, b, key):
  """(``a[key] / b[key]``, None), or (None, why not)."""
  (x, why), (y, why_b) = measured(a, key), measured(b, key)
  return (x / y, None) if x and y else (None, why or why_b)


def judge(what, result, target, unit, at_most=False):
  """A target line: ``what``, the value of ``result`` (value, why none) and met / NOT met /
  not measured."""
  value, why = result
  if value is None:
    return f"{what}: not measured ({why})"
  met = value <= target if at_most else value >= target
  return (f"{what}: {value:.3g}{unit} (target {'<=' if at_most else '>='} {target:g}{unit}): "
          f"{'met' if met else 'NOT met'}")


def paged_engine(row):
  """The sdpa_paged engine of a ``cudnn_jax.sdpa_paged`` row, else None."""
  return row["engine"].split()[1] if row["impl"].startswith("paged") else None


def paged_targets(rows):
  """The paged case's target lines, per row group."""
  peak, card = hbm_gbps()
  paged = [r for r in rows if r["case"] == "paged"]
  lines = []
  engines = dict.fromkeys(paged_engine(r) for r in paged if paged_engine(r))
  for name, engine in itertools.product(dict.fromkeys(r["shape"] for r in paged), engines):
    def get(t, impl):
      return next((r for r in paged if (r["shape"], r["t"], r["impl"]) == (name, t, impl)
                   and paged_engine(r) in (None, engine)), None)
    decode = get(DECODE_T, "paged")
    gbps, why = measured(decode, "gbps_b2b")
    hbm = ((100 * gbps / peak, None) if peak and gbps
           else (None, why if peak else f"unknown card {card!r}"))
    what = f"paged ({name}) {engine}"
    lines += [
        judge(f"{what} decode GB/s vs jax.nn on the contiguous cache",
              ratio(decode, get(DECODE_T, "jax_nn"), "gbps_b2b"), PAGED_VS_JAX_NN_TARGET, "x"),
        judge(f"{what} decode GB/s, of the datasheet HBM bandwidth"
              + (f" ({peak:.0f} GB/s, {card})" if peak else ""), hbm,
              100 * PAGED_HBM_TARGET, "%"),
        judge(f"{what} FP8-cache decode time vs the {paged[0]['dtype']} cache's",
              ratio(get(DECODE_T, "paged_fp8"), decode, "ms_b2b"), PAGED_FP8_TIME_TARGET, "x",
              at_most=True)]
    lines += [judge(f"{what} T={t} GB/s of the cache vs T={DECODE_T}'s",
                    ratio(get(t, "paged"), decode, "gbps_b2b"), PAGED_MTP_RATE_TARGET, "x")
              for t in MTP_TS]
    lines += [judge(f"{what} chunked prefill T={t} speed vs cudnn_jax.sdpa contiguous",
                    ratio(get(t, "sdpa"), get(t, "paged"), "ms_b2b"), PAGED_PREFILL_TARGET,
                    "x")
              for t in PREFILL_TS]
  return lines


def targets(rows, quick):
  """Lines saying whether each target is met (on back-to-back times)."""
  lines = []
  for r in rows:
    if r["case"] != "varlen" or not r["engine"].startswith("cudnn_jax"):
      continue
    what = f"{r['case']} {'fwd+bwd' if r['backward'] else 'fwd'}"
    if r.get("error"):
      lines.append(f"{what}: not measured ({r['error']})")
    elif r.get("speedup_b2b"):
      met = r["speedup_b2b"] >= VARLEN_SPEEDUP_TARGET
      lines.append(f"{what}: {r['speedup_b2b']:.2f}x the padded jax.nn call (target >= "
                   f"{VARLEN_SPEEDUP_TARGET}x): {'met' if met else 'NOT met'}")
  lines += paged_targets(rows)
  if quick:
    lines = [line + " [--quick shapes: not the benchmark]" for line in lines]
  return lines


HEADER = (f"{'case':<7} {'pass':<8} {'engine':<36} {'ms':>8} {'ms(b2b)':>8} {'rate':>8} "
          f"{'rate(b2b)':>10} {'speed-up':>8} {'rel diff':>9}")


def print_row(r):
  def f(key, fmt):
    return format(r[key], fmt) if r.get(key) is not None else "-"
  paged = r["case"] == "paged"
  rate = "tflops" if r["case"] == "varlen" or (paged and r["t"] in PREFILL_TS) else "gbps"
  unit = "TFLOP/s" if rate == "tflops" else "GB/s"
  case = f"{r['case']} {r['shape']}" if paged else r["case"]
  what = f"T={r['t']}" if paged else ("fwd+bwd" if r["backward"] else "fwd")
  line = (f"{case:<7} {what:<8} {r['engine']:<36} "
          f"{f('ms', '.3f'):>8} {f('ms_b2b', '.3f'):>8} {f(rate, '.4g'):>8} "
          f"{f(rate + '_b2b', '.4g'):>10} {f('speedup_b2b', '.2f'):>8} "
          f"{f('rel_diff_vs_baseline', '.1e'):>9}  {unit}")
  note = r.get("error") or r.get("note")
  if r.get("gbps_bf16eq_b2b"):
    note = f"{r['gbps_bf16eq_b2b']:.4g} GB/s b2b bf16-equivalent; {note}"
  print(line + (f"  ({note})" if note else ""), flush=True)


def plot_varlen(ax, mine):
  """TFLOP/s back to back per pass and engine; the packed call's speed-up above its bars."""
  passes = list(dict.fromkeys(r["backward"] for r in mine))
  names = list(dict.fromkeys(r["engine"] for r in mine))
  width = 0.8 / len(names)
  for i, name in enumerate(names):
    values = [next((r.get("tflops_b2b") or 0.0 for r in mine
                    if r["engine"] == name and r["backward"] == b), 0.0) for b in passes]
    bars = ax.bar(np.arange(len(passes)) + i * width, values, width, label=name)
    if i == 0:
      for bar, b in zip(bars, passes):
        up = next((r.get("speedup_b2b") for r in mine
                   if r["engine"] == name and r["backward"] == b), None)
        if up:
          ax.annotate(f"{up:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                      ha="center", va="bottom", fontsize=8)
  ax.set_xticks(np.arange(len(passes)) + 0.4 - width / 2,
                ["fwd+bwd" if b else "fwd" for b in passes])
  ax.set_ylabel("effective TFLOP/s (back to back)")
  ax.set_title(f"packed causal, {mine[0]['tokens']} tokens in {mine[0]['seqs']} sequences")


def plot_paged(ax, mine, metric, line=None):
  """``metric`` per row group (grouped bars) and engine (T beside engines past decode where
  the panel shows several); ``line`` (value, label) a horizontal line."""
  several = len({r["t"] for r in mine}) > 1
  label = lambda r: r["engine"] + (f" T={r['t']}" if several and r["t"] != DECODE_T else "")
  groups = {r["shape"]: f"({r['shape']}) B={r['b']}\nS={r['s']}, page {r['page']}"
            for r in mine}
  names = list(dict.fromkeys(label(r) for r in mine))
  width = 0.8 / len(names)
  for i, name in enumerate(names):
    values = [next((r.get(metric) or 0.0 for r in mine
                    if label(r) == name and r["shape"] == g), 0.0) for g in groups]
    ax.bar(np.arange(len(groups)) + i * width, values, width, label=name)
  ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2, list(groups.values()), fontsize=8)
  if line:
    ax.axhline(line[0], color="k", linestyle="--", linewidth=1, label=line[1])


def plot(rows, path, with_target):
  """The varlen panel (TFLOP/s back to back per engine, the packed call's speed-up above
  its bars); the paged panels, per row group and engine: GB/s of the cache back to back at
  DECODE_T and MTP_TS (with PAGED_HBM_TARGET of the card's HBM bandwidth), TFLOP/s back to back in
  chunked prefill."""
  plt = pyplot()
  varlen = [r for r in rows if r["case"] == "varlen"]
  paged = [r for r in rows if r["case"] == "paged"]
  decode = [r for r in paged if r["t"] not in PREFILL_TS]
  prefill = [r for r in paged if r["t"] in PREFILL_TS]
  panels = [p for p, mine in (("varlen", varlen), ("decode", decode), ("prefill", prefill))
            if mine]
  fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
  for ax, panel in zip(axes[0], panels):
    if panel == "varlen":
      plot_varlen(ax, varlen)
    elif panel == "decode":
      peak, card = hbm_gbps()
      line = ((PAGED_HBM_TARGET * peak, f"{PAGED_HBM_TARGET:.0%} of {card} HBM "
               f"({PAGED_HBM_TARGET * peak:.0f} GB/s)") if with_target and peak else None)
      plot_paged(ax, decode, "gbps_b2b", line)
      ax.set_ylabel("GB/s of the cache read (back to back)")
      ax.set_title(f"paged decode, T={DECODE_T}, " + ", ".join(map(str, MTP_TS)))
    else:
      plot_paged(ax, prefill, "tflops_b2b")
      ax.set_ylabel("TFLOP/s (back to back)")
      ax.set_title("paged chunked prefill, T=" + ", ".join(map(str, PREFILL_TS)))
    ax.legend(fontsize=7)
  fig.suptitle(f"{rows[0]['dtype']}, {jax.devices()[0].device_kind}", fontsize=9)
  save_figure(fig, path)


def collect(cases, quick, calls, out, paged_engines=None):
  """Runs the cases, prints their tables and verdicts, writes DIR/sdpa_features.png;
  (rows, meta) for a results file."""
  on_gpu = jax.default_backend() == "gpu"
  engine = "cudnn" if on_gpu else "xla"
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  varlen_shape, paged_shapes = shapes(quick)
  runners = dict(varlen=functools.partial(run_varlen, varlen_shape),
                 paged=functools.partial(run_paged, paged_shapes,
                                         paged_engines or PAGED_ENGINES[on_gpu], quick))
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
  meta.update(engine=engine, calls=calls, targets=verdicts, hbm_gbps=hbm_gbps()[0],
              varlen_shape=dataclasses.asdict(varlen_shape),
              paged_shapes=[dataclasses.asdict(s) for s in paged_shapes])
  return rows, meta


def main():
  parser = arg_parser(__doc__)
  parser.add_argument("--cases", default=",".join(CASES),
                      help=f"comma-separated, of {', '.join(CASES)}")
  parser.add_argument("--calls", type=int, default=20, help="timed calls per measurement")
  parser.add_argument("--quick", action="store_true", help="small shapes (smoke test)")
  parser.add_argument("--paged-engines", default=None,
                      help="comma-separated sdpa_paged engines (default: "
                      f"{','.join(PAGED_ENGINES[True])} on a GPU, else "
                      f"{','.join(PAGED_ENGINES[False])})")
  args = parser.parse_args()
  cases = [c for c in args.cases.split(",") if c]
  if not cases or set(cases) - set(CASES):
    parser.error(f"--cases: expected some of {', '.join(CASES)}, got {args.cases!r}")
  if jax.default_backend() != "gpu" and not args.quick:
    parser.error(f"the full benchmark needs a GPU (backend is {jax.default_backend()!r}); "
                 "use --quick for a smoke test")
  os.makedirs(args.out, exist_ok=True)
  start = time.perf_counter()
  paged_engines = args.paged_engines and [e for e in args.paged_engines.split(",") if e]
  rows, meta = collect(cases, args.quick, args.calls, args.out, paged_engines)
  elapsed = time.perf_counter() - start
  json_path = write_results(args.out, "sdpa_features", rows, quick=args.quick,
                            seconds=elapsed, cache_info=cudnn_jax.cache_info(), **meta)
  print(f"{elapsed:.0f} s; wrote {json_path} and {os.path.join(args.out, 'sdpa_features.png')}")


if __name__ == "__main__":
  main()
