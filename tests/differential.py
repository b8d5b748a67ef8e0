"""A randomized differential harness for every op: seeded random calls (shapes, dtypes,
options and value-dependent metadata, edge cases included: empty sequences, zero lengths,
invalid offsets, page ids, group sizes and expert indices) run on every engine available
on the machine, each compared with the xla engine and, on small shapes, with the float64
math of the op's oracle (which implements SPEC section 8 for invalid metadata on its own).

``sweep(op, n, seed, tier)`` returns one ``Row`` per (configuration, engine). Two tiers:
"cpu" (small shapes, float32 and bfloat16, tests/test_differential.py in CI) and "gpu"
(GPU-sized shapes in bfloat16 / float16; tests/gpu/test_differential_gpu.py runs >= 1000
configurations per op and writes the table, ``python tests/differential.py --tier gpu``
does the same from the command line).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import pathlib
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import cudnn_jax  # pylint: disable=wrong-import-position
import conv3d_oracle  # pylint: disable=wrong-import-position
import gemm_oracle  # pylint: disable=wrong-import-position
import kda_cases  # pylint: disable=wrong-import-position
import sdpa_oracle  # pylint: disable=wrong-import-position
from cudnn_jax import engines  # pylint: disable=wrong-import-position

# ||a - b|| / ||b|| over finite entries, by the dtype of the inputs; an op's factor scales it.
TOL = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}
ORACLE_MAX_ELEMENTS = 1 << 20  # the float64 math runs on calls at most this big


@dataclasses.dataclass
class Row:
  op: str
  config: dict
  engine: str
  vs_xla: float | None  # relative error against the xla engine (None for xla itself)
  vs_f64: float | None  # against the float64 math (None when not run)
  tol: float
  error: str | None = None  # an exception an engine raised

  @property
  def ok(self):
    errs = [e for e in (self.vs_xla, self.vs_f64) if e is not None]
    return self.error is None and all(e <= self.tol for e in errs)


@dataclasses.dataclass(frozen=True)
class Op:
  generate: Callable[[np.random.Generator, str], dict]  # (rng, tier) -> JSON-able config
  build: Callable[[dict, int], tuple]  # (config, seed) -> (args, kwargs)
  run: Callable[..., tuple]  # (args, kwargs, implementation) -> outputs
  oracle: Callable[..., tuple]  # (args, kwargs) -> float64 outputs
  factor: float = 1.0  # tolerance factor (long reductions)


def _rel(a, b):
  a = np.asarray(jnp.asarray(a, jnp.float32) if not isinstance(a, np.ndarray) else a, np.float64)
  b = np.asarray(b, np.float64)
  if a.shape != b.shape:
    return float("inf")
  fin = np.isfinite(b)
  if not np.array_equal(fin, np.isfinite(a)):
    return float("inf")
  if not fin.any():
    return 0.0
  return float(np.linalg.norm(a[fin] - b[fin]) / max(np.linalg.norm(b[fin]), 1e-6))


def _worst(got, want):
  return max((_rel(a, b) for a, b in zip(got, want)), default=0.0)


def _pick(rng, options):
  return options[int(rng.integers(len(options)))]


def _dtype(rng, tier):
  return _pick(rng, ("float32", "float32", "bfloat16") if tier == "cpu" else ("bfloat16", "float16"))


def _as(x, dtype):
  return jnp.asarray(x, dtype)


# ---------------------------------------------------------------------------------------
# sdpa: sdpa_oracle's random calls.


def _sdpa_generate(rng, tier):
  small = tier == "cpu"
  cfg = sdpa_oracle.random_config(
      rng, dtypes=("float32", "bfloat16") if small else ("bfloat16", "float16"),
      lengths=(0, 1, 3, 7, 16, 17) if small else (0, 1, 7, 64, 65, 128, 255, 512),
      head_dims=(8, 16) if small else (64, 128), max_b=2 if small else 4,
      max_n=4 if small else 16)
  if rng.random() < 0.2:
    cfg = dataclasses.replace(cfg, sinks=True)
  if 0 in (cfg.t, cfg.s):  # empty queries or keys: no lengths to draw
    cfg = dataclasses.replace(cfg, q_lengths=False, kv_lengths=False, zero_length=False)
  return dataclasses.asdict(cfg)


def _sdpa_build(cfg, seed):
  return sdpa_oracle.make_case(sdpa_oracle.Config(**cfg), seed)


def _sdpa_run(args, kwargs, implementation):
  return cudnn_jax.sdpa(*args, return_lse=True, implementation=implementation, **kwargs)


def _sdpa_oracle(args, kwargs):
  return sdpa_oracle.oracle(*args, **kwargs)


# ---------------------------------------------------------------------------------------
# sdpa_varlen: random lengths, offsets sometimes made invalid.

_CU_EDITS = ("none", "none", "swap", "negative", "past_rows", "short_max")


def _varlen_generate(rng, tier):
  n = int(rng.integers(1, 5))
  top = 12 if tier == "cpu" else 300
  return dict(q_lens=rng.integers(0, top, n).tolist(), kv_lens=rng.integers(0, top, n).tolist(),
              heads=_pick(rng, ((2, 1), (4, 2), (4, 4))), h=_pick(rng, (8, 16) if tier == "cpu"
                                                                   else (64, 128)),
              dtype=_dtype(rng, tier), edit=_pick(rng, _CU_EDITS),
              is_causal=bool(rng.random() < 0.5),
              alignment=_pick(rng, ("top_left", "bottom_right")),
              window=_pick(rng, (None, None, (3, 0), (2, 2))), sinks=bool(rng.random() < 0.3),
              softcap=_pick(rng, (None, None, 5.0)))


def _edit_cu(cu, edit, rows):
  cu = cu.copy()
  if edit == "swap" and len(cu) > 2:
    cu[1], cu[2] = cu[2], cu[1]
  elif edit == "negative":
    cu[0] = -3
  elif edit == "past_rows":
    cu[-1] = rows + 5
  return cu


def _varlen_build(cfg, seed):
  rng = np.random.default_rng(seed)
  n, k = cfg["heads"]
  q, kk, v, cu_q, cu_kv = sdpa_oracle.varlen_case(rng, cfg["q_lens"], cfg["kv_lens"], n=n, k=k,
                                                  h=cfg["h"], hv=cfg["h"])
  cu_q = _edit_cu(cu_q, cfg["edit"], q.shape[0])
  cu_kv = _edit_cu(cu_kv, cfg["edit"], kk.shape[0])
  cut = 2 if cfg["edit"] == "short_max" else 0
  kwargs = dict(max_seqlen_q=max(max(cfg["q_lens"]) - cut, 1),
                max_seqlen_kv=max(max(cfg["kv_lens"]) - cut, 1), is_causal=cfg["is_causal"],
                causal_alignment=cfg["alignment"], logits_soft_cap=cfg["softcap"],
                local_window_size=None if cfg["window"] is None else tuple(cfg["window"]))
  if cfg["sinks"]:
    kwargs["sinks"] = rng.standard_normal(n).astype(np.float32)
  dt = cfg["dtype"]
  return (_as(q, dt), _as(kk, dt), _as(v, dt), cu_q, cu_kv), kwargs


def _varlen_run(args, kwargs, implementation):
  return cudnn_jax.sdpa_varlen(*args, return_lse=True, implementation=implementation, **kwargs)


def _served(cu, rows):
  """Python's reading of SPEC section 8: [(start, end) or None] per sequence."""
  cu = [int(x) for x in cu]
  return [(cu[i], cu[i + 1]) if 0 <= cu[i] <= cu[i + 1] <= rows and cu[i] >= max(cu[:i] or [0])
          else None for i in range(len(cu) - 1)]


def _varlen_oracle(args, kwargs):
  q, k, v, cu_q, cu_kv = (np.asarray(jnp.asarray(x, jnp.float32) if x.dtype != np.int32 else x)
                          for x in args)
  kw = dict(kwargs)
  max_q, max_kv = kw.pop("max_seqlen_q"), kw.pop("max_seqlen_kv")
  out = np.zeros(q.shape[:2] + v.shape[2:])
  lse = np.full((q.shape[1], q.shape[0]), -np.inf)
  for qs, ks in zip(_served(cu_q, q.shape[0]), _served(cu_kv, k.shape[0])):
    if qs is None or qs[1] == qs[0]:
      continue
    rows = slice(qs[0], min(qs[1], qs[0] + max_q))
    keys = slice(0, 0) if ks is None else slice(ks[0], min(ks[1], ks[0] + max_kv))
    extra = {}
    ki, vi = k[keys][None], v[keys][None]
    if ki.shape[1] == 0:  # no keys: one masked key stands in
      ki, vi = np.zeros((1, 1) + k.shape[1:]), np.zeros((1, 1) + v.shape[1:])
      extra["key_value_seq_lengths"] = np.zeros(1, np.int32)
    o, l = sdpa_oracle.oracle(q[rows][None], ki, vi, **kw, **extra)
    out[rows], lse[:, rows] = o[0], l[0]
  return out, lse


# ---------------------------------------------------------------------------------------
# sdpa_paged: shuffled pages, ids sometimes out of range, lengths sometimes out of range.


def _paged_generate(rng, tier):
  b = int(rng.integers(1, 4))
  top = 20 if tier == "cpu" else 2000
  return dict(kv_lens=rng.integers(1, top, b).tolist(), t=_pick(rng, (1, 1, 3)),
              page=_pick(rng, (2, 4) if tier == "cpu" else (16, 64)),
              h=_pick(rng, (8, 16) if tier == "cpu" else (64, 128)), dtype=_dtype(rng, tier),
              bad_ids=bool(rng.random() < 0.4), bad_lengths=bool(rng.random() < 0.2),
              window=_pick(rng, (None, None, (4, 0))), softcap=_pick(rng, (None, 5.0)),
              sinks=bool(rng.random() < 0.3))


def _paged_build(cfg, seed):
  rng = np.random.default_rng(seed)
  q, kc, vc, table, lens, _, _ = sdpa_oracle.paged_case(rng, cfg["kv_lens"], t=cfg["t"],
                                                       h=cfg["h"], hv=cfg["h"],
                                                       page=cfg["page"])
  kc, vc = (np.where(np.isnan(x), rng.standard_normal(x.shape), x).astype(np.float32)
            for x in (kc, vc))  # real data everywhere: a page read in error shows
  if cfg["bad_ids"]:
    table = np.where(rng.random(table.shape) < 0.3, rng.choice([-1, kc.shape[0], 10 ** 6],
                                                                 table.shape), table)
  if cfg["bad_lengths"]:
    lens = lens + rng.choice([-100, 0, 100], lens.shape)
  kwargs = dict(logits_soft_cap=cfg["softcap"],
                local_window_size=None if cfg["window"] is None else tuple(cfg["window"]))
  if cfg["sinks"]:
    kwargs["sinks"] = rng.standard_normal(q.shape[2]).astype(np.float32)
  dt = cfg["dtype"]
  return (_as(q, dt), _as(kc, dt), _as(vc, dt), table.astype(np.int32), lens.astype(np.int32)), kwargs


def _paged_run(args, kwargs, implementation):
  return cudnn_jax.sdpa_paged(*args, return_lse=True, implementation=implementation, **kwargs)


def _paged_oracle(args, kwargs):
  q, kc, vc = (np.asarray(jnp.asarray(x, jnp.float32)) for x in args[:3])
  return sdpa_oracle.paged_oracle(q, kc, vc, *args[3:], **kwargs)


# ---------------------------------------------------------------------------------------
# kda / gdn: kda_cases' configurations, cu_seqlens sometimes made invalid.


def _kda_generate(op):
  def generate(rng, tier):
    small = tier == "cpu"
    cfg = dict(op=op, b=int(rng.integers(1, 3)), t=int(_pick(rng, (1, 17, 40) if small
                                                              else (64, 200, 1000))),
               h=1, hv=_pick(rng, (1, 2)), k=_pick(rng, (8, 16) if small else (64, 128)),
               v=_pick(rng, (8, 16) if small else (64, 128)), dtype=_dtype(rng, tier),
               initial_state=bool(rng.random() < 0.5), l2norm=bool(rng.random() < 0.5),
               gate=_pick(rng, (None, "softplus", "lower_bound")),
               beta_sigmoid=bool(rng.random() < 0.3),
               chunk_size=_pick(rng, (32, 64) + ((16,) if op == "gdn" else ())))
    cfg["dt_bias"] = cfg["gate"] is not None and bool(rng.random() < 0.5)
    if rng.random() < 0.4:
      cut = sorted(rng.integers(0, cfg["t"] + 1, int(rng.integers(1, 4))).tolist())
      cfg.update(b=1, cu_seqlens=[0] + cut + [cfg["t"]],
                 cu_edit=_pick(rng, ("none", "swap", "negative", "past_rows")))
    return cfg
  return generate


def _kda_build(cfg, seed):
  cfg = dict(cfg)
  edit = cfg.pop("cu_edit", "none")
  if "cu_seqlens" in cfg:
    cfg["cu_seqlens"] = tuple(cfg["cu_seqlens"])
  arrays, kwargs = kda_cases.make_case(kda_cases.Config(**cfg), seed)
  if "cu_seqlens" in arrays:
    arrays["cu_seqlens"] = _edit_cu(arrays["cu_seqlens"], edit, cfg["t"])
  return (cfg["op"], arrays), kwargs


def _kda_run(args, kwargs, implementation):
  op, arrays = args
  return kda_cases.call_op(op, arrays, kwargs, implementation)


def _kda_oracle(args, kwargs):
  return kda_cases.run_oracle(args[1], kwargs)


# ---------------------------------------------------------------------------------------
# gemm, grouped_gemm, moe_mlp.

_EPILOGUES = ((None, None), ("relu", None), ("gelu", None), ("silu", None), (None, "swiglu"),
              (None, "geglu"))


def _gemm_generate(rng, tier):
  dims = (0, 1, 8, 24) if tier == "cpu" else (8, 64, 256, 1024, 4096)
  act, glu = _pick(rng, _EPILOGUES)
  dt = _dtype(rng, tier)
  return dict(batch=_pick(rng, ((), (2,))), m=_pick(rng, dims), k=_pick(rng, dims),
              n=_pick(rng, dims[1:]), activation=act, glu=glu, bias=bool(rng.random() < 0.5),
              dtype=dt, out_dtype=_pick(rng, (None, "float32")))


def _gemm_build(cfg, seed):
  rng = np.random.default_rng(seed)
  cols = cfg["n"] * (2 if cfg["glu"] else 1)
  a = rng.standard_normal(tuple(cfg["batch"]) + (cfg["m"], cfg["k"]))
  b = rng.standard_normal((cfg["k"], cols)) / max(cfg["k"], 1) ** 0.5
  bias = rng.standard_normal(cols) if cfg["bias"] else None
  dt = cfg["dtype"]
  return (_as(a, dt), _as(b, dt)), dict(bias=None if bias is None else _as(bias, dt),
                                        activation=cfg["activation"], glu=cfg["glu"],
                                        out_dtype=cfg["out_dtype"])


def _gemm_run(args, kwargs, implementation):
  return (cudnn_jax.gemm(*args, implementation=implementation, **kwargs),)


def _f64(x):
  return None if x is None else np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _gemm_oracle(args, kwargs):
  return (gemm_oracle.gemm(*map(_f64, args), _f64(kwargs["bias"]), kwargs["activation"],
                           kwargs["glu"]),)


def _grouped_generate(rng, tier):
  cfg = _gemm_generate(rng, tier)
  del cfg["batch"]
  groups = int(rng.integers(1, 5))
  m = cfg["m"]
  sizes = rng.multinomial(m, np.ones(groups) / groups).tolist() if m else [0] * groups
  if rng.random() < 0.3:  # negative sizes and sizes past M: defined, every engine alike
    sizes[int(rng.integers(groups))] = int(_pick(rng, (-3, m + 5)))
  cfg.update(group_sizes=sizes)
  return cfg


def _grouped_build(cfg, seed):
  rng = np.random.default_rng(seed)
  groups, cols = len(cfg["group_sizes"]), cfg["n"] * (2 if cfg["glu"] else 1)
  dt = cfg["dtype"]
  lhs = rng.standard_normal((cfg["m"], cfg["k"]))
  rhs = rng.standard_normal((groups, cfg["k"], cols)) / max(cfg["k"], 1) ** 0.5
  bias = rng.standard_normal((groups, cols)) if cfg["bias"] else None
  return ((_as(lhs, dt), _as(rhs, dt), np.asarray(cfg["group_sizes"], np.int32)),
          dict(bias=None if bias is None else _as(bias, dt), activation=cfg["activation"],
               glu=cfg["glu"], out_dtype=cfg["out_dtype"]))


def _grouped_run(args, kwargs, implementation):
  return (cudnn_jax.grouped_gemm(*args, implementation=implementation, **kwargs),)


def _grouped_oracle(args, kwargs):
  lhs, rhs, sizes = args
  served = np.diff(np.minimum(np.cumsum(np.maximum(sizes, 0)), lhs.shape[0]), prepend=0)
  return (gemm_oracle.grouped_gemm(_f64(lhs), _f64(rhs), served, _f64(kwargs["bias"]),
                                   kwargs["activation"], kwargs["glu"]),)


def _moe_generate(rng, tier):
  small = tier == "cpu"
  act, glu = _pick(rng, ((None, "swiglu"), (None, "geglu"), ("relu", None)))
  return dict(tokens=_pick(rng, (0, 5, 16) if small else (64, 1024, 4096)),
              top_k=_pick(rng, (0, 1, 2)), experts=_pick(rng, (1, 3, 4) if small else (8, 64)),
              d=_pick(rng, (8, 16) if small else (256, 1024)),
              f=_pick(rng, (8, 12) if small else (256, 512)), activation=act, glu=glu,
              dtype=_dtype(rng, tier), bad_indices=bool(rng.random() < 0.3))


def _moe_build(cfg, seed):
  rng = np.random.default_rng(seed)
  t, k, e, d, f = (cfg[x] for x in ("tokens", "top_k", "experts", "d", "f"))
  idx = np.argsort(rng.random((t, e)), axis=1)[:, :k]  # k distinct experts per token
  idx = idx if k <= e else rng.integers(0, e, (t, k))
  if cfg["bad_indices"] and idx.size:
    idx = np.where(rng.random(idx.shape) < 0.3, rng.choice([-1, e, 99], idx.shape), idx)
  dt = cfg["dtype"]
  cols = 2 * f if cfg["glu"] else f
  return ((_as(rng.standard_normal((t, d)), dt), idx.astype(np.int32),
           _as(rng.random((t, k)), jnp.float32),
           _as(rng.standard_normal((e, d, cols)) / d ** 0.5, dt),
           _as(rng.standard_normal((e, f, d)) / f ** 0.5, dt)),
          dict(glu=cfg["glu"], activation=cfg["activation"]))


def _moe_run(args, kwargs, implementation):
  return (cudnn_jax.moe_mlp(*args, implementation=implementation, **kwargs),)


def _moe_oracle(args, kwargs):
  x, idx, w, wu, wd = args
  e = wu.shape[0]
  valid = (idx >= 0) & (idx < e)
  return (gemm_oracle.moe_mlp(_f64(x), np.where(valid, idx, 0), _f64(w) * valid, _f64(wu),
                              _f64(wd), **kwargs),)


# ---------------------------------------------------------------------------------------
# bsa and conv3d, through their public functions.


def _bsa_generate(rng, tier):
  small = tier == "cpu"
  bs = 16 if small else _pick(rng, (64, 128))
  return dict(b=int(rng.integers(1, 3)), sq=_pick(rng, (1, 20, 48) if small else (128, 1000)),
              skv=_pick(rng, (1, 20, 48) if small else (128, 2000)), heads=_pick(rng, ((2, 1), (4, 2))),
              h=_pick(rng, (8, 16) if small else (64, 128)), bs=bs, kmax=_pick(rng, (1, 3)),
              is_causal=bool(rng.random() < 0.5), dtype=_dtype(rng, tier))


def _bsa_build(cfg, seed):
  import test_bsa  # pylint: disable=g-import-not-at-top
  n, k = cfg["heads"]
  q, kk, v, index, counts = test_bsa.make_case(
      np.random.default_rng(seed), b=cfg["b"], sq=cfg["sq"], skv=cfg["skv"], n=n, k=k,
      h=cfg["h"], hv=cfg["h"], bs=cfg["bs"], kmax=cfg["kmax"])
  dt = cfg["dtype"]
  return ((_as(q, dt), _as(kk, dt), _as(v, dt), index, counts),
          dict(block_size=cfg["bs"], is_causal=cfg["is_causal"]))


def _bsa_run(args, kwargs, implementation):
  return cudnn_jax.bsa(*args, return_lse=True, implementation=implementation, **kwargs)


def _bsa_oracle(args, kwargs):
  import test_bsa  # pylint: disable=g-import-not-at-top
  q, k, v, index, counts = args
  bs = kwargs["block_size"]
  b, skv, kh = k.shape[0], k.shape[1], k.shape[2]
  mask = test_bsa.token_mask(index, counts, test_bsa.full_sizes(b, kh, skv, bs), q.shape[1],
                             skv, bs, group=q.shape[2] // kh)
  return sdpa_oracle.oracle(*map(_f64, (q, k, v)), mask=mask, is_causal=kwargs["is_causal"])


def _conv3d_generate(rng, tier):
  small = tier == "cpu"
  return dict(n=int(rng.integers(1, 3)), spatial=_pick(rng, ((3, 4, 5), (1, 6, 6)) if small
                                                        else ((5, 32, 32), (9, 64, 64))),
              cin=_pick(rng, (4, 8) if small else (64, 128)),
              cout=_pick(rng, (4, 8) if small else (64, 128)),
              kernel=_pick(rng, ((3, 3, 3), (1, 3, 3))),
              padding=_pick(rng, ("SAME", "VALID", "CAUSAL")),
              norm=_pick(rng, (None, "rms", "group")), activation=_pick(rng, (None, "silu")),
              dtype=_dtype(rng, tier))


def _conv3d_build(cfg, seed):
  kwargs = dict(padding=cfg["padding"], activation=cfg["activation"])
  if cfg["norm"]:
    kwargs.update(norm=cfg["norm"], num_groups=2 if cfg["norm"] == "group" else 32)
  arrays, kwargs = conv3d_oracle.case(seed, n=cfg["n"], spatial=tuple(cfg["spatial"]),
                                      cin=cfg["cin"], cout=cfg["cout"],
                                      kernel=tuple(cfg["kernel"]), dtype=jnp.dtype(cfg["dtype"]),
                                      **kwargs)
  return (arrays,), kwargs


def _conv3d_run(args, kwargs, implementation):
  return (cudnn_jax.conv3d(**args[0], implementation=implementation, **kwargs),)


def _conv3d_oracle(args, kwargs):
  return (conv3d_oracle.oracle(**{k: _f64(v) for k, v in args[0].items()}, **kwargs),)


OPS = {
    "sdpa": Op(_sdpa_generate, _sdpa_build, _sdpa_run, _sdpa_oracle),
    "sdpa_varlen": Op(_varlen_generate, _varlen_build, _varlen_run, _varlen_oracle),
    "sdpa_paged": Op(_paged_generate, _paged_build, _paged_run, _paged_oracle),
    "kda": Op(_kda_generate("kda"), _kda_build, _kda_run, _kda_oracle, factor=3.0),
    "gdn": Op(_kda_generate("gdn"), _kda_build, _kda_run, _kda_oracle, factor=3.0),
    "gemm": Op(_gemm_generate, _gemm_build, _gemm_run, _gemm_oracle),
    "grouped_gemm": Op(_grouped_generate, _grouped_build, _grouped_run, _grouped_oracle),
    "moe_mlp": Op(_moe_generate, _moe_build, _moe_run, _moe_oracle),
    "bsa": Op(_bsa_generate, _bsa_build, _bsa_run, _bsa_oracle),
    "conv3d": Op(_conv3d_generate, _conv3d_build, _conv3d_run, _conv3d_oracle),
}


def _size(tree):
  return sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(tree) if hasattr(x, "shape"))


def _tolerance(op, cfg, out_dtype=None):
  dtype = cfg.get("dtype", "float32")
  if out_dtype is None and cfg.get("out_dtype") == "float32" and op in ("gemm", "grouped_gemm"):
    # float32 out of bf16 / f16 inputs: the float32 sums, not values rounded to the inputs
    return TOL["float32"]
  return TOL[dtype] * OPS[op].factor


def _jitted(run, args, kwargs, implementation):
  """``run(args, kwargs, implementation)`` under one jit: arrays are its inputs, every other
  leaf (strings, Python numbers, None) is static."""
  leaves, tree = jax.tree.flatten((args, kwargs))
  is_array = [isinstance(x, (np.ndarray, jax.Array)) for x in leaves]

  def call(arrays):
    it = iter(arrays)
    a, kw = jax.tree.unflatten(tree, [next(it) if arr else x for x, arr in zip(leaves, is_array)])
    return run(a, kw, implementation)

  return jax.jit(call)([x for x, arr in zip(leaves, is_array) if arr])


def check(op, cfg, seed=0):
  """The rows of one configuration: every engine that serves it against the xla engine,
  and the xla engine against the float64 math on small calls."""
  spec = OPS[op]
  args, kwargs = spec.build(cfg, seed)
  tol = _tolerance(op, cfg)
  rows = []
  try:
    xla = _jitted(spec.run, args, kwargs, "xla")
  except Exception as e:  # pylint: disable=broad-except
    return [Row(op, cfg, "xla", None, None, tol, f"{type(e).__name__}: {e}")]
  vs_f64 = None
  if _size((args, kwargs)) <= ORACLE_MAX_ELEMENTS:
    vs_f64 = _worst(xla, spec.oracle(args, kwargs))
  rows.append(Row(op, cfg, "xla", None, vs_f64, tol))
  for name in engines.ENGINE_NAMES[:-1]:
    try:
      got = _jitted(spec.run, args, kwargs, name)
    except cudnn_jax.UnsupportedError:
      continue  # declined (on a CPU: every GPU engine)
    except Exception as e:  # pylint: disable=broad-except
      rows.append(Row(op, cfg, name, None, None, tol, f"{type(e).__name__}: {e}"))
      continue
    rows.append(Row(op, cfg, name, _worst(got, xla), None, tol))
  return rows


def sweep(op, n, seed=0, tier="cpu", shard=(0, 1), table=None):
  """``n`` random configurations of ``op`` (seeded), checked: a list of ``Row``.
  ``shard=(i, m)`` checks every m-th configuration from the i-th (the same configurations
  whatever the split); ``table``, a path, gets each configuration's rows as it ends."""
  rng = np.random.default_rng([seed, sorted(OPS).index(op)])
  index, shards = shard
  rows = []
  for i in range(n):
    cfg = OPS[op].generate(rng, tier)
    if i % shards != index:
      continue
    done = check(op, cfg, seed=seed * 100003 + i)
    if table is not None:
      write_table(done, table, append=True)
    rows += done
    if tier == "gpu":
      jax.clear_caches()  # hundreds of distinct programs: keep the compiled ones bounded
  return rows


COLUMNS = ["op", "engine", "ok", "vs_xla", "vs_f64", "tol", "error", "config"]


def write_table(rows, path, append=False):
  """The rows as CSV (one line per configuration and engine, the configuration as JSON);
  ``append`` adds them to the file (its header written once)."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  header = not (append and path.exists())
  with path.open("a" if append else "w", newline="") as f:
    w = csv.writer(f)
    if header:
      w.writerow(COLUMNS)
    for r in rows:
      w.writerow([r.op, r.engine, r.ok, r.vs_xla, r.vs_f64, r.tol, r.error,
                  json.dumps(r.config, sort_keys=True)])


def failures(rows):
  return "\n".join(f"{r.engine}: vs_xla={r.vs_xla} vs_f64={r.vs_f64} tol={r.tol} "
                   f"error={r.error} config={json.dumps(r.config)}" for r in rows if not r.ok)


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tier", default="gpu", choices=("cpu", "gpu"))
  parser.add_argument("--n", type=int, default=1000, help="configurations per op")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--ops", default=",".join(OPS))
  parser.add_argument("--out", default="differential.csv")
  opts = parser.parse_args()
  table = []
  for name in opts.ops.split(","):
    table += sweep(name, opts.n, opts.seed, opts.tier)
    print(f"{name}: {sum(r.ok for r in table if r.op == name)}/"
          f"{sum(r.op == name for r in table)} rows ok", flush=True)
  write_table(table, opts.out)
  sys.exit(0 if all(r.ok for r in table) else 1)
