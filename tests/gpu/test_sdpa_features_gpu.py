"""The cudnn engine's packed rows, paged caches and attention sinks against the xla engine.

Covers ``cudnn_jax.sdpa_varlen`` (ragged offsets: values and gradients of query, key,
value and sinks), ``cudnn_jax.sdpa_paged`` (page tables: decode and chunked prefill,
out-of-range page ids in used positions, which must be masked as SPEC section 8 says) and
``cudnn_jax.sdpa`` with ``sinks`` (values and gradients, sinks included).

A seeded random sweep (CUDNN_JAX_FEATURES_SWEEP_N configurations in all, default 240:
two fifths varlen, two fifths paged, one fifth dense with sinks; CUDNN_JAX_SWEEP_SHARD="i/n"
splits it over processes as in test_sdpa_gpu.py; CUDNN_JAX_FEATURES_SWEEP_LOG=path.json
keeps the records) prints one JSON line per configuration and a mismatch table. Calls the
cudnn engine declines are counted with their reasons, not failed, except the common ones
(bfloat16, head dim 128, causal, no window), which it must serve. Outputs are poisoned
(CUDNN_JAX_POISON_OUTPUTS, set by conftest.py), so an element left unwritten is a NaN.
Named tests: varlen equals per-sequence ``sdpa`` calls, paged equals ``sdpa`` on the
gathered cache, the float64 oracle for sinks, determinism, and the default engine.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cudnn_jax
import gpu_sweep
from gpu_sweep import Declined, lse_err, rel_err
from sdpa_oracle import (Config, cotangent, differentiable, keep_mask, keep_of, make_case,
                         oracle, oracle_vjp, paged_case, random_config, varlen_case)

pytestmark = pytest.mark.gpu

REL_TOL = 2e-2  # ||a - b|| / ||b|| for out and every gradient (as in test_sdpa_gpu.py)
LSE_TOL = 2e-2  # max |a - b| over finite lse entries
# Two runs of one call: cuDNN's backward may add partial sums of dq in an order that varies
# between runs (atomics); anything beyond rounding is a bug.
REPEAT_TOL = 1e-3
INT32 = np.iinfo(np.int32)


def _window_pair(window):
  if window is None:
    return None, None
  if isinstance(window, int):
    return window, window
  return tuple(window)


def _random_window(rng, extent):
  w = int(rng.integers(0, max(extent, 2)))
  forms = [w, (w, 0), (w, None), (None, w), (w, int(rng.integers(0, 9)))]
  return forms[rng.integers(len(forms))]


def _head_counts(rng, common):
  n = int(rng.choice((1, 2, 4, 8, 16)))
  ratio = int(rng.choice([r for r in (1, 2, 4, n) if n % r == 0]))
  if common and n == 1:
    n, ratio = 8, 4
  return n, n // ratio


def _head_dims(rng, common):
  if common:
    return 128, 128
  h = int(rng.choice((64, 128)))
  hv = (192 - h) if rng.random() < 0.15 else h  # Hv != H: the other of 64 and 128
  return h, hv


def _bf16_first(rng, common):
  return "bfloat16" if common else str(rng.choice(("bfloat16", "float16")))


# ---------------------------------------------------------------------------------------
# One call of an op, both engines.


@dataclasses.dataclass
class Case:
  """Arrays and a call of one op: ``call(diff, meta, implementation, return_lse)``."""
  call: Callable[..., Any]
  diff: dict  # the arrays to differentiate ({} for an op without gradients)
  meta: dict  # every other array (traced, as in a real call)
  return_lse: bool
  lse_cotangent: bool
  # Boolean, broadcastable to out.shape[:-1]: rows with no kept key (out and dquery 0).
  empty_rows: np.ndarray
  # Boolean over key rows that no served sequence owns (dkey and dvalue 0); None: all owned.
  unowned_kv: np.ndarray | None = None


@dataclasses.dataclass
class Result:
  errors: dict = dataclasses.field(default_factory=dict)  # quantity -> error
  problems: list = dataclasses.field(default_factory=list)  # (quantity, message)
  seconds: dict = dataclasses.field(default_factory=dict)

  def check(self, name, value, tol):
    self.errors[name] = value
    if not value <= tol:
      self.problems.append((name, f"{name}: {value:.3g} > {tol}"))


def engine_fn(case: Case, implementation: str):
  """One jitted function of (diff, meta, d_out, d_lse) -> (out, lse, gradients)."""
  def both(diff, meta):
    res = case.call(diff, meta, implementation, case.return_lse)
    return res if case.return_lse else (res, None)

  def run(diff, meta, d_out, d_lse):
    if not case.diff:
      out, lse = both(diff, meta)
      return out, lse, {}
    if case.lse_cotangent:
      (out, lse), pull = jax.vjp(lambda d: both(d, meta), diff)
      return out, lse, pull((d_out, d_lse))[0]
    # out alone: lse's cotangent is a symbolic zero, so the cuDNN backward serves it.
    out, pull, lse = jax.vjp(lambda d: both(d, meta), diff, has_aux=True)
    return out, lse, pull(d_out)[0]
  return jax.jit(run)


def compare(case: Case, seed: int) -> Result:
  """Runs ``case`` on the cudnn and the xla engine; Declined when cudnn declines it."""
  out_shape, lse_shape = jax.eval_shape(
      lambda d, m: case.call(d, m, "xla", True), case.diff, case.meta)
  d_out = cotangent(out_shape.shape, out_shape.dtype, seed)
  d_lse = cotangent(lse_shape.shape, jnp.float32, seed + 1) if case.lse_cotangent else None
  args = (case.diff, case.meta, d_out, d_lse)
  res = Result()
  start = time.perf_counter()
  try:
    out, lse, grads = jax.block_until_ready(engine_fn(case, "cudnn")(*args))
  except cudnn_jax.UnsupportedError as e:
    raise Declined(str(e)) from None
  res.seconds["cudnn"] = time.perf_counter() - start
  ref_out, ref_lse, ref_grads = jax.block_until_ready(engine_fn(case, "xla")(*args))
  res.seconds["xla"] = time.perf_counter() - start - res.seconds["cudnn"]

  res.check("out", rel_err(out, ref_out), REL_TOL)
  if case.return_lse:
    res.check("lse", lse_err(lse, ref_lse), LSE_TOL)
  for name in case.diff:
    res.check(f"d{name}", rel_err(grads[name], ref_grads[name]), REL_TOL)

  named = [("out", out)] + [(f"d{n}", g) for n, g in grads.items()]
  if case.return_lse:
    named.append(("lse", jnp.where(jnp.isneginf(lse), 0, lse)))
  for name, x in named:
    if not np.all(np.isfinite(np.asarray(x, np.float32))):
      res.problems.append((name, f"{name}: NaN or inf"))

  out = np.asarray(out, np.float32)
  empty = np.broadcast_to(case.empty_rows, out.shape[:-1])
  if np.any(out[empty] != 0):
    res.problems.append(("out", "out: rows with no kept key are not exactly 0"))
  if "query" in grads and np.any(np.asarray(grads["query"], np.float32)[empty] != 0):
    res.problems.append(("dquery", "dquery: rows with no kept key are not exactly 0"))
  if case.unowned_kv is not None and case.diff:
    for name in ("key", "value"):
      if np.any(np.asarray(grads[name], np.float32)[case.unowned_kv] != 0):
        res.problems.append((f"d{name}", f"d{name}: rows no sequence owns are not exactly 0"))
  return res


# ---------------------------------------------------------------------------------------
# sdpa_varlen: random packed batches.


def _random_lengths(rng, count, longest=400):
  """Sequence lengths: 0, 1, short, long, and multiples of the 64-row tile."""
  kinds = rng.choice(5, size=count, p=[0.1, 0.1, 0.15, 0.5, 0.15])
  options = [lambda: 0, lambda: 1, lambda: int(rng.integers(2, 17)),
             lambda: int(rng.integers(17, longest + 1)), lambda: 64 * int(rng.integers(1, 5))]
  return tuple(options[k]() for k in kinds)


def _max_seqlen(rng, lengths):
  """max_seqlen: the longest length, a loose bound above it, or a cut below it."""
  longest = max(max(lengths), 1)
  r = rng.random()
  if r < 0.15 and longest > 1:
    return int(rng.integers(1, longest))  # longer sequences are cut to this many rows
  if r < 0.4:
    return longest + int(rng.integers(1, 65))
  return longest


@dataclasses.dataclass(frozen=True)
class VarlenConfig:
  q_lens: tuple
  kv_lens: tuple
  tail: int  # rows past cu_seqlens[-1] in query and key
  max_q: int
  max_kv: int
  n: int
  k: int
  h: int
  hv: int
  dtype: str
  is_causal: bool
  causal_alignment: str
  window: Any
  sinks: bool
  return_lse: bool
  lse_cotangent: bool

  @property
  def common(self):
    return (self.dtype == "bfloat16" and self.h == self.hv == 128 and self.is_causal
            and self.window is None)

  def describe(self):
    return dataclasses.asdict(self)

  def build(self, seed):
    return varlen_sweep_case(self, seed)


def random_varlen(rng, common) -> VarlenConfig:
  count = int(rng.integers(1, 9))
  q_lens = _random_lengths(rng, count)
  kv_lens = q_lens if rng.random() < 0.5 else _random_lengths(rng, count)
  n, k = _head_counts(rng, common)
  h, hv = _head_dims(rng, common)
  is_causal = common or rng.random() < 0.6
  window = None if common or rng.random() >= 0.25 else _random_window(rng, max(kv_lens))
  return_lse = bool(rng.random() < 0.75)
  return VarlenConfig(
      q_lens=q_lens, kv_lens=kv_lens, tail=int(rng.choice((0, 0, 1, 5, 64))),
      max_q=_max_seqlen(rng, q_lens), max_kv=_max_seqlen(rng, kv_lens), n=n, k=k, h=h, hv=hv,
      dtype=_bf16_first(rng, common), is_causal=bool(is_causal),
      causal_alignment=str(rng.choice(("top_left", "bottom_right"))), window=window,
      sinks=bool(rng.random() < 0.4), return_lse=return_lse,
      lse_cotangent=bool(return_lse and rng.random() < 0.1))


def varlen_rows(cfg, cu_q, cu_kv, rows_q, rows_kv):
  """(query rows with no kept key [Tq, 1], key rows no served sequence owns [Tk])."""
  empty = np.ones(rows_q, bool)
  owned_kv = np.zeros(rows_kv, bool)
  for i in range(len(cfg.q_lens)):
    lq, lk = min(cfg.q_lens[i], cfg.max_q), min(cfg.kv_lens[i], cfg.max_kv)
    owned_kv[cu_kv[i]:cu_kv[i] + lk] = True
    if lq and lk:
      keep = keep_mask(1, 1, lq, lk, is_causal=cfg.is_causal,
                       bottom_right=cfg.causal_alignment == "bottom_right",
                       window=_window_pair(cfg.window))
      empty[cu_q[i]:cu_q[i] + lq] = ~keep[0, 0].any(-1)
  return empty[:, None], ~owned_kv


def varlen_sweep_case(cfg: VarlenConfig, seed: int) -> Case:
  rng = np.random.default_rng(seed)
  q, k, v, cu_q, cu_kv = varlen_case(rng, cfg.q_lens, cfg.kv_lens, n=cfg.n, k=cfg.k,
                                     h=cfg.h, hv=cfg.hv, tail=cfg.tail)
  dtype = jnp.dtype(cfg.dtype)
  diff = dict(query=jnp.asarray(q, dtype), key=jnp.asarray(k, dtype),
              value=jnp.asarray(v, dtype))
  if cfg.sinks:
    diff["sinks"] = jnp.asarray(2 * rng.standard_normal(cfg.n), jnp.float32)
  meta = dict(cu_q=jnp.asarray(cu_q), cu_kv=jnp.asarray(cu_kv))
  static = dict(max_seqlen_q=cfg.max_q, max_seqlen_kv=cfg.max_kv, is_causal=cfg.is_causal,
                causal_alignment=cfg.causal_alignment, local_window_size=cfg.window)

  def call(d, m, implementation, return_lse):
    return cudnn_jax.sdpa_varlen(d["query"], d["key"], d["value"], m["cu_q"], m["cu_kv"],
                                 sinks=d.get("sinks"), return_lse=return_lse,
                                 implementation=implementation, **static)

  empty, unowned = varlen_rows(cfg, cu_q, cu_kv, q.shape[0], k.shape[0])
  return Case(call, diff, meta, cfg.return_lse, cfg.lse_cotangent, empty, unowned)


# ---------------------------------------------------------------------------------------
# sdpa_paged: random page tables.

# Out-of-range ids written into used positions of the table (P = physical pages).
BAD_IDS = ("P", "P+12345", "-1", "int32_min", "int32_max")


def _bad_id(kind, pages):
  return {"P": pages, "P+12345": pages + 12345, "-1": -1, "int32_min": INT32.min,
          "int32_max": INT32.max}[kind]


@dataclasses.dataclass(frozen=True)
class PagedConfig:
  kv_lens: tuple  # as passed: may lie outside [0, max_pages * page] (clamped by the op)
  q_lens: tuple | None
  t: int
  n: int
  k: int
  h: int
  hv: int
  page: int
  max_pages: int
  spare: int  # physical pages no table entry below a length refers to
  invalid: tuple  # ((b, j, BAD_IDS entry), ...) in used positions
  fill: str  # what the cache holds outside the sequences' keys: "nan" or "large"
  dtype: str
  is_causal: bool
  window: Any
  sinks: bool
  return_lse: bool

  @property
  def common(self):
    return (self.dtype == "bfloat16" and self.h == self.hv == 128 and self.is_causal
            and self.window is None)

  def describe(self):
    return dataclasses.asdict(self)

  def build(self, seed):
    return paged_sweep_case(self, seed)

  def stored(self):
    """Cached tokens per sequence: the lengths clamped to the table's capacity."""
    return np.clip(np.asarray(self.kv_lens, np.int64), 0, self.max_pages * self.page)


def random_paged(rng, common) -> PagedConfig:
  b = int(rng.integers(1, 9))
  t = 1 if rng.random() < 0.5 else int(rng.choice((2, 7, 16, 33, 64, 128)))
  page = int(rng.choice((16, 64)))
  longest = int(rng.choice((16, 100, 300, 700, 1500, 3000)))
  max_pages = -(-longest // page) + int(rng.integers(0, 3))
  capacity = max_pages * page

  def length():
    kind = rng.choice(5, p=[0.1, 0.45, 0.15, 0.15, 0.15])
    if kind == 0:
      return 0
    if kind == 1:  # partial last page
      return int(rng.integers(1, longest + 1))
    if kind == 2:  # whole pages
      return page * int(rng.integers(1, -(-longest // page) + 1))
    if kind == 3:  # the table's capacity
      return capacity
    return min(capacity, max(t, int(rng.integers(1, longest + 1))))  # at least the new tokens

  kv_lens = [length() for _ in range(b)]
  if not common and rng.random() < 0.1:  # invalid lengths, clamped to [0, capacity]
    kv_lens[int(rng.integers(b))] = int(rng.choice((-5, capacity + 1, capacity + 999)))
  q_lens = None
  if rng.random() < 0.4:
    q_lens = tuple(int(x) for x in rng.integers(0, t + 1, b))
  stored = np.clip(kv_lens, 0, capacity)
  used = [(i, j) for i in range(b) for j in range(-(-int(stored[i]) // page))]
  invalid = ()
  if used and rng.random() < 0.25:
    picks = rng.choice(len(used), size=min(len(used), int(rng.integers(1, 4))), replace=False)
    invalid = tuple((used[p][0], used[p][1], str(rng.choice(BAD_IDS))) for p in picks)
  n, k = _head_counts(rng, common)
  h, hv = _head_dims(rng, common)
  return PagedConfig(
      kv_lens=tuple(int(x) for x in kv_lens), q_lens=q_lens, t=t, n=n, k=k, h=h, hv=hv,
      page=page, max_pages=max_pages, spare=int(rng.integers(0, 5)), invalid=invalid,
      fill="nan" if rng.random() < 0.7 else "large", dtype=_bf16_first(rng, common),
      is_causal=bool(common or rng.random() < 0.85),
      window=None if common or rng.random() >= 0.15 else _random_window(rng, longest),
      sinks=bool(rng.random() < 0.4), return_lse=bool(rng.random() < 0.75))


def build_paged(cfg: PagedConfig, rng):
  """(query, key_cache, value_cache, page_table, kv_lens, q_lens, valid positions
  [B, max_pages*page]) as NumPy arrays. Pages are shuffled; table entries past a length
  hold other sequences' page ids, 0, or ids outside [0, P); cache rows that hold no key
  are NaN or large ("fill")."""
  b = len(cfg.kv_lens)
  stored = cfg.stored()
  used = -(-stored // cfg.page)
  pages = max(int(used.sum()) + cfg.spare, 1)
  order = rng.permutation(pages)
  filler = (lambda *s: np.full(s, np.nan, np.float32)) if cfg.fill == "nan" else (
      lambda *s: (1e3 * rng.standard_normal(s)).astype(np.float32))
  key_cache = filler(pages, cfg.page, cfg.k, cfg.h)
  value_cache = filler(pages, cfg.page, cfg.k, cfg.hv)
  table = np.zeros((b, cfg.max_pages), np.int64)
  taken = 0
  for i in range(b):
    for j in range(cfg.max_pages):
      if j < used[i]:
        phys = order[taken]
        taken += 1
        table[i, j] = phys
        rows = min(cfg.page, int(stored[i]) - j * cfg.page)
        key_cache[phys, :rows] = rng.standard_normal((rows, cfg.k, cfg.h))
        value_cache[phys, :rows] = rng.standard_normal((rows, cfg.k, cfg.hv))
      else:  # past the length: never read
        table[i, j] = rng.choice([int(rng.integers(pages)), 0, pages + int(rng.integers(1000)),
                                  -1 - int(rng.integers(5))])
  for i, j, kind in cfg.invalid:
    table[i, j] = _bad_id(kind, pages)
  valid = np.repeat((table >= 0) & (table < pages), cfg.page, axis=1)
  valid &= np.arange(cfg.max_pages * cfg.page)[None, :] < stored[:, None]
  query = rng.standard_normal((b, cfg.t, cfg.n, cfg.h)).astype(np.float32)
  q_lens = None if cfg.q_lens is None else np.asarray(cfg.q_lens, np.int32)
  return (query, key_cache, value_cache, table.astype(np.int32),
          np.asarray(cfg.kv_lens, np.int32), q_lens, valid)


def paged_sweep_case(cfg: PagedConfig, seed: int) -> Case:
  rng = np.random.default_rng(seed)
  query, kc, vc, table, kv_lens, q_lens, valid = build_paged(cfg, rng)
  dtype = jnp.dtype(cfg.dtype)
  meta = dict(query=jnp.asarray(query, dtype), key_cache=jnp.asarray(kc, dtype),
              value_cache=jnp.asarray(vc, dtype), page_table=jnp.asarray(table),
              kv_lens=jnp.asarray(kv_lens))
  if q_lens is not None:
    meta["q_lens"] = jnp.asarray(q_lens)
  if cfg.sinks:
    meta["sinks"] = jnp.asarray(2 * rng.standard_normal(cfg.n), jnp.float32)

  def call(d, m, implementation, return_lse):
    del d  # not differentiable
    return cudnn_jax.sdpa_paged(
        m["query"], m["key_cache"], m["value_cache"], m["page_table"], m["kv_lens"],
        query_seq_lengths=m.get("q_lens"), sinks=m.get("sinks"), is_causal=cfg.is_causal,
        local_window_size=cfg.window, return_lse=return_lse, implementation=implementation)

  b, capacity = len(cfg.kv_lens), cfg.max_pages * cfg.page
  q_valid = np.full(b, cfg.t) if q_lens is None else np.clip(q_lens, 0, cfg.t)
  keep = keep_mask(b, 1, cfg.t, capacity, is_causal=cfg.is_causal, bottom_right=True,
                   window=_window_pair(cfg.window), q_len=q_valid, kv_len=cfg.stored())
  keep = keep & valid[:, None, None, :]
  empty = ~keep.any(-1)[:, 0, :, None]  # [B, T, 1]
  return Case(call, {}, meta, cfg.return_lse, False, empty)


# ---------------------------------------------------------------------------------------
# sdpa with sinks: random dense calls.


@dataclasses.dataclass(frozen=True)
class SinksConfig:
  config: Config  # sdpa_oracle's random call, with sinks
  return_lse: bool
  lse_cotangent: bool

  @property
  def common(self):
    c = self.config
    return (c.dtype == "bfloat16" and c.h == 128 and c.hv in (None, 128) and c.is_causal
            and c.window is None and c.bias is None and c.mask is None
            and c.softcap is None and not c.segments)

  def describe(self):
    return dict(self.config.describe(), return_lse=self.return_lse,
                lse_cotangent=self.lse_cotangent)

  def build(self, seed):
    return sinks_sweep_case(self, seed)


def random_sinks(rng, common) -> SinksConfig:
  if common:
    n, k = _head_counts(rng, True)
    s = int(rng.choice((64, 128, 255, 512, 600)))
    t = s if rng.random() < 0.5 else int(rng.choice((1, 64, 129, 512)))
    lengths = bool(rng.random() < 0.3)
    cfg = Config(b=int(rng.integers(1, 5)), t=t, s=s, n=n, k=k, h=128, dtype="bfloat16",
                 is_causal=True, causal_alignment=str(rng.choice(("top_left", "bottom_right"))),
                 q_lengths=lengths, kv_lengths=lengths,
                 zero_length=bool(lengths and rng.random() < 0.3), sinks=True)
  else:
    cfg = dataclasses.replace(random_config(rng), sinks=True)
  return_lse = bool(rng.random() < 0.75)
  return SinksConfig(cfg, return_lse, bool(return_lse and rng.random() < 0.1))


def sinks_sweep_case(cfg: SinksConfig, seed: int) -> Case:
  args, kwargs = make_case(cfg.config, seed)
  diff, arrays, call_sdpa = differentiable(args, kwargs)

  def call(d, m, implementation, return_lse):
    return call_sdpa(d, m, implementation=implementation, return_lse=return_lse)

  keep, _ = keep_of(*args, **kwargs)
  empty = np.moveaxis(~keep.any(-1), -1, -2)  # [B,T,N]
  if cfg.config.unbatched:
    empty = empty[0]
  return Case(call, diff, arrays, cfg.return_lse, cfg.lse_cotangent, empty)


# ---------------------------------------------------------------------------------------
# Named tests.

bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)


def vjp_out(f, *args):
  """(out, lse, pull) of ``f(*args) -> (out, lse)`` with lse as an auxiliary result, so
  the backward sees only out's cotangent (the cuDNN backward)."""
  out, pull, lse = jax.vjp(f, *args, has_aux=True)
  return out, lse, pull


def test_varlen_equals_per_sequence_sdpa():
  """Packed rows, sequence by sequence: values, lse and every gradient (sinks' summed)."""
  q_lens, kv_lens = [77, 1, 300, 128, 64], [77, 9, 300, 200, 1]
  n, heads_kv, h = 8, 2, 128
  rng = np.random.default_rng(3)
  q, k, v, cu_q, cu_kv = varlen_case(rng, q_lens, kv_lens, n=n, k=heads_kv, h=h, hv=h)
  q, k, v = bf16(q), bf16(k), bf16(v)
  sinks = jnp.asarray(rng.standard_normal(n), jnp.float32)
  d_out = jnp.asarray(cotangent((q.shape[0], n, h), jnp.bfloat16, 3))
  kw = dict(is_causal=True, causal_alignment="bottom_right", return_lse=True,
            implementation="cudnn")

  @jax.jit
  def packed(q, k, v, sinks):
    f = lambda *a: cudnn_jax.sdpa_varlen(*a[:3], cu_q, cu_kv, max_seqlen_q=max(q_lens),
                                         max_seqlen_kv=max(kv_lens), sinks=a[3], **kw)
    out, lse, pull = vjp_out(f, q, k, v, sinks)
    return out, lse, pull(d_out)

  @jax.jit
  def single(q, k, v, sinks, d_out):
    f = lambda q, k, v, sinks: cudnn_jax.sdpa(q[None], k[None], v[None], sinks=sinks, **kw)
    out, lse, pull = vjp_out(f, q, k, v, sinks)
    return out[0], lse[0], pull(d_out[None])

  out, lse, (dq, dk, dv, dsinks) = packed(q, k, v, sinks)
  dsinks_sum = np.zeros(n)
  for i in range(len(q_lens)):
    qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_kv[i], cu_kv[i + 1])
    o, l, (gq, gk, gv, gs) = single(q[qs], k[ks], v[ks], sinks, d_out[qs])
    assert rel_err(out[qs], o) <= REL_TOL, i
    assert lse_err(lse[:, qs], l) <= LSE_TOL, i
    assert rel_err(dq[qs], gq) <= REL_TOL, i
    assert rel_err(dk[ks], gk) <= REL_TOL, i
    assert rel_err(dv[ks], gv) <= REL_TOL, i
    dsinks_sum += np.asarray(gs, np.float64)
  assert rel_err(dsinks, dsinks_sum) <= REL_TOL
  tail_q, tail_kv = slice(int(cu_q[-1]), None), slice(int(cu_kv[-1]), None)
  assert np.all(np.asarray(out[tail_q], np.float32) == 0)
  assert np.all(np.isneginf(np.asarray(lse[:, tail_q])))
  assert np.all(np.asarray(dq[tail_q], np.float32) == 0)
  assert np.all(np.asarray(dk[tail_kv], np.float32) == 0)
  assert np.all(np.asarray(dv[tail_kv], np.float32) == 0)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_varlen_one_row_sequences_with_sinks(alignment):
  """Packed sequences of at most one query row (decoding in varlen form) with sinks: the
  cudnn engine serves them in place (each row goes in twice), equal to the xla engine in
  values, lse and every gradient."""
  q_lens, kv_lens = [1, 1, 0, 1, 1], [300, 1, 17, 0, 64]
  rng = np.random.default_rng(11)
  q, k, v, cu_q, cu_kv = varlen_case(rng, q_lens, kv_lens, n=8, k=2, h=128, hv=128)
  q, k, v = bf16(q), bf16(k), bf16(v)
  sinks = jnp.asarray(rng.standard_normal(8), jnp.float32)
  d_out = jnp.asarray(cotangent((q.shape[0], 8, 128), jnp.bfloat16, 5))

  def run(implementation):
    f = lambda *a: cudnn_jax.sdpa_varlen(
        *a[:3], cu_q, cu_kv, max_seqlen_q=1, max_seqlen_kv=max(kv_lens), sinks=a[3],
        is_causal=True, causal_alignment=alignment, return_lse=True,
        implementation=implementation)
    return jax.jit(lambda *a: (lambda o, l, p: (o, l, p(d_out)))(*vjp_out(f, *a)))(
        q, k, v, sinks)

  assert "in place" in cudnn_jax.explain(
      "sdpa_varlen", q, k, v, cu_q, cu_kv, max_seqlen_q=1, max_seqlen_kv=max(kv_lens),
      sinks=sinks, is_causal=True, causal_alignment=alignment, implementation="cudnn")
  (out, lse, grads), (want, want_lse, want_grads) = run("cudnn"), run("xla")
  assert rel_err(out, want) <= REL_TOL
  assert lse_err(lse, want_lse) <= LSE_TOL
  for name, g, w in zip(["dq", "dk", "dv", "dsinks"], grads, want_grads):
    assert rel_err(g, w) <= REL_TOL, name


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("t", [1, 16])
def test_paged_equals_sdpa_on_gathered_cache(t, page):
  """The same keys read through the page table and from a contiguous dense cache."""
  kv_lens = [700, 0, 1024, 250, 64]
  query, kc, vc, table, lens, keys, values = paged_case(
      np.random.default_rng(5), kv_lens, t=t, n=16, k=4, h=128, hv=128, page=page)
  q_lens = np.array([t, t, max(t - 3, 1), 1, t], np.int32)
  sinks = jnp.asarray(np.random.default_rng(6).standard_normal(16), jnp.float32)
  kw = dict(query_seq_lengths=q_lens, sinks=sinks, return_lse=True, implementation="cudnn")
  out, lse = jax.jit(functools.partial(cudnn_jax.sdpa_paged, **kw))(
      bf16(query), bf16(kc), bf16(vc), table, lens)
  ref_out, ref_lse = jax.jit(functools.partial(
      cudnn_jax.sdpa, key_value_seq_lengths=lens, is_causal=True,
      causal_alignment="bottom_right", **kw))(bf16(query), bf16(keys), bf16(values))
  assert rel_err(out, ref_out) <= REL_TOL
  assert lse_err(lse, ref_lse) <= LSE_TOL
  assert np.all(np.isfinite(np.asarray(out, np.float32)))


def test_sdpa_sinks_match_the_float64_oracle():
  """Values, lse and the gradients of query, key, value and sinks against float64 NumPy."""
  cfg = Config(b=2, t=128, s=192, n=8, k=2, h=128, dtype="bfloat16", is_causal=True,
               causal_alignment="bottom_right", kv_lengths=True, zero_length=True,
               sinks=True)
  args, kwargs = make_case(cfg, seed=7)
  diff, arrays, call = differentiable(args, kwargs)
  d_out = jnp.asarray(cotangent((2, 128, 8, 128), jnp.bfloat16, 7))

  @jax.jit
  def run(diff, arrays):
    out, lse, pull = vjp_out(
        lambda d: call(d, arrays, implementation="cudnn", return_lse=True), diff)
    return out, lse, pull(d_out)[0]

  out, lse, grads = run(diff, arrays)
  want_out, want_lse = oracle(*args, **kwargs)
  want = oracle_vjp(*args, d_out=d_out, **kwargs)
  assert rel_err(out, want_out) <= REL_TOL
  assert lse_err(lse, want_lse) <= LSE_TOL
  for name in ("query", "key", "value", "sinks"):
    assert rel_err(grads[name], want[name]) <= REL_TOL, name


def test_identical_calls_give_identical_results():
  """Two runs of one jitted call: forward bits equal, gradients equal up to the order of
  cuDNN's partial sums."""
  rng = np.random.default_rng(11)
  q_lens = [513, 0, 1, 1000, 250]
  q, k, v, cu_q, cu_kv = varlen_case(rng, q_lens, q_lens, n=16, k=4, h=128, hv=128)
  sinks = jnp.asarray(rng.standard_normal(16), jnp.float32)
  d_out = jnp.asarray(cotangent((q.shape[0], 16, 128), jnp.bfloat16, 11))

  @jax.jit
  def varlen(q, k, v, sinks):
    f = lambda *a: cudnn_jax.sdpa_varlen(
        *a[:3], cu_q, cu_kv, max_seqlen_q=1000, max_seqlen_kv=1000, sinks=a[3],
        is_causal=True, return_lse=True, implementation="cudnn")
    out, lse, pull = vjp_out(f, q, k, v, sinks)
    return out, lse, pull(d_out)

  first, second = (varlen(bf16(q), bf16(k), bf16(v), sinks) for _ in range(2))
  assert np.array_equal(np.asarray(first[0]), np.asarray(second[0])), "out"
  assert np.array_equal(np.asarray(first[1]), np.asarray(second[1])), "lse"
  for name, a, b in zip(("dquery", "dkey", "dvalue", "dsinks"), first[2], second[2]):
    assert rel_err(a, b) <= REPEAT_TOL, name

  query, kc, vc, table, lens, _, _ = paged_case(
      rng, [4000, 17, 64, 900], t=1, n=32, k=8, h=128, hv=128, page=64)
  masked = table.copy()
  masked[0, 3] = -1  # an invalid id below a length: its keys are masked
  paged = jax.jit(functools.partial(cudnn_jax.sdpa_paged, sinks=jnp.repeat(sinks, 2),
                                    return_lse=True, implementation="cudnn"))
  for name, ids in (("paged", table), ("paged, invalid id", masked)):
    args = (bf16(query), bf16(kc), bf16(vc), ids, lens)
    first, second = paged(*args), paged(*args)
    assert np.array_equal(np.asarray(first[0]), np.asarray(second[0])), f"{name}: out"
    assert np.array_equal(np.asarray(first[1]), np.asarray(second[1])), f"{name}: lse"


def test_common_calls_are_served_by_cudnn():
  """With no implementation named, the cudnn engine serves packed rows, paged caches and
  sinks in bfloat16 at head dim 128."""
  rng = np.random.default_rng(13)
  q, k, v, cu_q, cu_kv = varlen_case(rng, [100, 200], [100, 200], n=8, k=2, h=128, hv=128)
  sinks = jnp.zeros(8, jnp.float32)
  assert "engine 'cudnn' serves" in cudnn_jax.explain(
      "sdpa_varlen", bf16(q), bf16(k), bf16(v), cu_q, cu_kv, max_seqlen_q=200,
      max_seqlen_kv=200, is_causal=True, sinks=sinks)
  for t in (1, 16):
    query, kc, vc, table, lens, _, _ = paged_case(rng, [300, 64], t=t, n=8, k=2, h=128,
                                                  hv=128, page=64)
    assert "engine 'cudnn' serves" in cudnn_jax.explain(
        "sdpa_paged", bf16(query), bf16(kc), bf16(vc), table, lens, sinks=sinks)
  (q, k, v), _ = make_case(Config(b=2, t=128, s=128, n=8, k=2, h=128, dtype="bfloat16"))
  assert "engine 'cudnn' serves" in cudnn_jax.explain("sdpa", q, k, v, is_causal=True,
                                                      sinks=sinks)


# ---------------------------------------------------------------------------------------
# The randomized sweep.

GENERATORS = {"sdpa_varlen": random_varlen, "sdpa_paged": random_paged, "sdpa": random_sinks}
SHARE = {"sdpa_varlen": 0.4, "sdpa_paged": 0.4, "sdpa": 0.2}  # of the configurations
COMMON_FRACTION = 0.3  # configurations drawn among the common ones


def sweep_cases(op):
  """[(config, seed)] of ``op``'s share of the sweep, this process's shard of it."""
  count = int(os.environ.get("CUDNN_JAX_FEATURES_SWEEP_N", "240"))
  rng = np.random.default_rng(20261205 + sorted(GENERATORS).index(op))
  return gpu_sweep.shard([(GENERATORS[op](rng, bool(rng.random() < COMMON_FRACTION)), seed)
                          for seed in range(max(1, round(SHARE[op] * count)))])


def _summary(op, records):
  lines = []
  status = collections.Counter(r["status"] for r in records)
  common = [r for r in records if r["common"]]
  served = sum(r["status"] != "declined" for r in common)
  lines.append(f"{op} cudnn sweep: {len(records)} configurations: "
               + ", ".join(f"{k} {v}" for k, v in sorted(status.items()))
               + f"; common served {served} of {len(common)}; outputs poisoned: "
               + os.environ.get("CUDNN_JAX_POISON_OUTPUTS", "unset"))
  reasons = collections.Counter(r["reason"][:160] for r in records if r["status"] == "declined")
  for reason, count in reasons.most_common():
    lines.append(f"  declined x{count}: {reason}")
  checked, mismatched, worst = (collections.Counter(), collections.Counter(),
                                collections.defaultdict(float))
  for r in records:
    for name, value in r.get("errors", {}).items():
      checked[name] += 1
      worst[name] = max(worst[name], value)
    for name in {p[0] if isinstance(p, (list, tuple)) else "error"
                 for p in r.get("problems", [])}:
      mismatched[name] += 1
  lines.append(f"  {'quantity':<12} {'checked':>8} {'mismatched':>11} {'max error':>10}")
  for name in sorted(set(checked) | set(mismatched)):
    lines.append(f"  {name:<12} {checked[name]:>8} {mismatched[name]:>11} "
                 f"{worst.get(name, float('nan')):>10.2e}")
  for r in records:
    if r["status"] == "failed":
      lines.append(f"  FAILED seed {r['seed']} {r['config']}: " + "; ".join(
          p[1] if isinstance(p, (list, tuple)) else p for p in r["problems"]))
  return "\n".join(lines)


@pytest.mark.parametrize("op", sorted(GENERATORS))
def test_random_sweep_features(op, capsys):
  def case(cfg, seed):
    def run():
      res = compare(cfg.build(seed), seed)
      return res.errors, res.problems, res.seconds
    return dict(config=cfg.describe(), op=op, seed=seed, common=cfg.common), run

  log = os.environ.get("CUDNN_JAX_FEATURES_SWEEP_LOG")
  records = gpu_sweep.run([case(*c) for c in sweep_cases(op)], capsys,
                          log and log.replace(".json", f"_{op}.json"))
  summary = _summary(op, records)
  with capsys.disabled():
    print("\n" + summary)

  failed = [r for r in records if r["status"] == "failed"]
  common_declined = [r for r in records if r["common"] and r["status"] == "declined"]
  assert any(r["status"] != "declined" for r in records), f"cudnn served nothing:\n{summary}"
  assert not failed, f"{len(failed)} of {len(records)} configurations mismatched:\n{summary}"
  assert not common_declined, (
      f"cudnn declined {len(common_declined)} common configurations (bfloat16, d=128, "
      f"causal, no window):\n{summary}")


def test_dropout_on_cudnn_is_deterministic_inverted_and_differentiable():
  """cuDNN's Philox dropout keyed by the call's key: the same key gives the same bits,
  another key other bits; the kept probabilities are scaled by 1 / (1 - rate), so the
  output's mean over many keys approaches the undropped output; gradients finite."""
  args, kwargs = make_case(Config(b=2, t=256, s=256, n=4, k=2, h=64, is_causal=True,
                                  dtype="bfloat16"))
  q, k, v = args[:3]
  drop = jax.jit(lambda q, key: cudnn_jax.sdpa(q, k, v, is_causal=True, dropout_rate=0.25,
                                               dropout_rng=key, implementation="cudnn"))
  a = drop(q, jax.random.key(1))
  np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(drop(q, jax.random.key(1)),
                                                                       np.float32))
  assert not np.array_equal(np.asarray(a, np.float32),
                            np.asarray(drop(q, jax.random.key(2)), np.float32))
  mean = sum(np.asarray(drop(q, jax.random.key(i)), np.float64) for i in range(64)) / 64
  plain = np.asarray(cudnn_jax.sdpa(q, k, v, is_causal=True, implementation="xla"), np.float64)
  assert rel_err(mean, plain) < 0.1
  grads = jax.grad(lambda q: jnp.sum(drop(q, jax.random.key(1)).astype(jnp.float32) ** 2))(q)
  assert np.all(np.isfinite(np.asarray(grads, np.float32)))


@pytest.mark.parametrize("runs", [[300, 1, 211], [64] * 8])
def test_segment_ids_on_cudnn_match_the_xla_engine(runs):
  """Packed rows given as segment ids: each run a sequence on cuDNN, values and gradients
  as on the xla engine; a row with an id in two runs takes the xla engine."""
  t = sum(runs)
  args, _ = make_case(Config(b=2, t=t, s=t, n=4, k=2, h=128, dtype="bfloat16"))
  q, k, v = args[:3]
  seg = jnp.asarray(np.repeat(np.arange(len(runs)), runs)[None].repeat(2, 0), jnp.int32)
  seg = seg.at[1, -5:].set(0)  # row 1: id 0 in two runs

  def run(implementation, q, k, v):
    return cudnn_jax.sdpa(q, k, v, is_causal=True, q_segment_ids=seg, kv_segment_ids=seg,
                          implementation=implementation)

  for implementation in ("cudnn", "xla"):
    assert "declines" not in cudnn_jax.explain("sdpa", q, k, v, is_causal=True,
                                               q_segment_ids=seg, kv_segment_ids=seg,
                                               implementation=implementation).split("\n")[0]
  def value_and_grads(implementation):
    out, pull = jax.vjp(functools.partial(run, implementation), q, k, v)
    return out, pull(jnp.cos(out.astype(jnp.float32)).astype(out.dtype))

  got, got_grads = jax.jit(lambda: value_and_grads("cudnn"))()
  want, want_grads = jax.jit(lambda: value_and_grads("xla"))()
  assert rel_err(got, want) < 2e-2
  for a, b in zip(got_grads, want_grads):
    assert rel_err(a, b) < 2e-2
