"""cudnn_jax.sdpa_varlen and cudnn_jax.sdpa_paged on the cudnn engine (bf16), and sdpa_paged
on the triton engine (bf16 and FP8 caches), against the float64 oracle and the xla engine;
outputs poisoned (CUDNN_JAX_POISON_OUTPUTS, conftest)."""

import dataclasses
import functools
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cudnn_jax
import gpu_sweep
from sdpa_oracle import (oracle, paged_case, paged_oracle, rel_err_finite as rel_err,
                         varlen_case, varlen_oracle)

pytestmark = pytest.mark.gpu

REL_TOL = 2e-2  # ||a - b|| / ||b|| in bf16


bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)
Q_LENS, KV_LENS = [100, 0, 257, 64, 31], [130, 40, 257, 0, 300]


@pytest.mark.parametrize("kwargs", [dict(is_causal=True),
                                    dict(is_causal=True, causal_alignment="bottom_right"),
                                    dict(local_window_size=(64, 0))],
                         ids=["causal", "bottom_right", "window"])
def test_varlen_cudnn_matches_oracle_and_xla(kwargs):
  rng = np.random.default_rng(0)
  q, k, v, cu_q, cu_kv = varlen_case(rng, Q_LENS, KV_LENS, n=8, k=2, h=128, hv=128)
  q, k, v = bf16(q), bf16(k), bf16(v)
  d_out = bf16(rng.standard_normal((q.shape[0], 8, 128)))

  @functools.partial(jax.jit, static_argnames="implementation")
  def run(q, k, v, implementation):
    f = lambda q, k, v: cudnn_jax.sdpa_varlen(
        q, k, v, cu_q, cu_kv, max_seqlen_q=max(Q_LENS), max_seqlen_kv=max(KV_LENS),
        return_lse=True, implementation=implementation, **kwargs)
    (out, lse), pull = jax.vjp(f, q, k, v)
    return out, lse, pull((d_out, jnp.zeros_like(lse)))

  assert "'cudnn' serves" in cudnn_jax.explain(
      "sdpa_varlen", q, k, v, cu_q, cu_kv, max_seqlen_q=max(Q_LENS),
      max_seqlen_kv=max(KV_LENS), **kwargs)
  out, lse, grads = run(q, k, v, "cudnn")
  ref_out, ref_lse, ref_grads = run(q, k, v, "xla")
  want_out, want_lse = varlen_oracle(*(np.asarray(x, np.float32) for x in (q, k, v)),
                                     cu_q, cu_kv, **kwargs)
  assert rel_err(out, want_out) <= REL_TOL
  assert rel_err(out, ref_out) <= REL_TOL
  finite = np.isfinite(want_lse)
  assert np.array_equal(finite, np.isfinite(np.asarray(lse)))
  assert float(np.max(np.abs(np.asarray(lse)[finite] - want_lse[finite]))) <= 2e-2
  for name, g, r in zip(("query", "key", "value"), grads, ref_grads):
    assert rel_err(g, r) <= REL_TOL, name


@pytest.mark.parametrize("unused", [
    "zero", pytest.param("nan", marks=pytest.mark.xfail(
        strict=True, reason="cuDNN 9.19 let NaN in unused cache rows through (H100)"))])
def test_paged_in_place_chunked_prefill(monkeypatch, unused):
  """cuDNN's paged graph read in place with 16 query rows (the public path gathers the
  pages for T > 1): right when the caches' unused rows hold zeros; with NaN there, rows came
  out NaN on an H100, which is why the public path gathers. The "nan" case tells whether a
  cuDNN release stopped letting them through (then T > 1 may read in place again)."""
  from cudnn_jax.ops import sdpa_paged as paged_ops  # pylint: disable=g-import-not-at-top
  query, kc, vc, table, lens, keys, values = paged_case(
      np.random.default_rng(1), [700, 33, 1024, 250], t=16, n=16, k=4, h=128, hv=128,
      page=64)
  if unused == "zero":
    kc, vc = np.nan_to_num(kc), np.nan_to_num(vc)
  q_lens = np.array([16, 13, 16, 1], np.int32)
  args = (bf16(query), bf16(kc), bf16(vc), table, lens)
  monkeypatch.setattr(paged_ops, "_paged_reason", lambda call: None)
  text = cudnn_jax.explain("sdpa_paged", *args, query_seq_lengths=q_lens)
  assert "reading the pages in place" in text, text
  out = jax.jit(functools.partial(cudnn_jax.sdpa_paged, query_seq_lengths=q_lens,
                                  implementation="cudnn"))(*args)
  want, _ = oracle(np.asarray(args[0], np.float32), np.asarray(bf16(keys), np.float32),
                   np.asarray(bf16(values), np.float32), key_value_seq_lengths=lens,
                   query_seq_lengths=q_lens, is_causal=True, causal_alignment="bottom_right")
  rows = sorted({tuple(int(i) for i in r[:2]) for r in np.argwhere(np.isnan(
      np.asarray(out, np.float32)).any(-1))})
  assert not rows, f"NaN in (sequence, row) {rows[:20]}"
  assert rel_err(out, want) <= REL_TOL


@pytest.mark.parametrize("t", [1, 16])
def test_paged_cudnn_matches_oracle(t):
  query, kc, vc, table, lens, keys, values = paged_case(
      np.random.default_rng(1), [700, 33, 1024, 250], t=t, n=16, k=4, h=128, hv=128,
      page=64)
  q_lens = np.array([t, max(t - 3, 1), t, 1], np.int32)
  call = functools.partial(cudnn_jax.sdpa_paged, query_seq_lengths=q_lens)
  args = (bf16(query), bf16(kc), bf16(vc), table, lens)
  assert "'cudnn' serves" in cudnn_jax.explain("sdpa_paged", *args, query_seq_lengths=q_lens)
  out = jax.jit(functools.partial(call, implementation="cudnn"))(*args)
  ref = jax.jit(functools.partial(call, implementation="xla"))(*args)
  want, _ = oracle(np.asarray(args[0], np.float32), np.asarray(bf16(keys), np.float32),
                   np.asarray(bf16(values), np.float32), key_value_seq_lengths=lens,
                   query_seq_lengths=q_lens, is_causal=True, causal_alignment="bottom_right")
  assert rel_err(out, want) <= REL_TOL
  assert rel_err(out, ref) <= REL_TOL


# The triton engine: our split-KV kernel reading pages in place (decode, chunks).

TRITON_CASES = {  # (t, n, k, h, page, options)
    "decode": (1, 32, 8, 128, 64, {}),
    "mtp_t4_page16": (4, 32, 8, 128, 16, {}),
    "t8_ratio8_d64": (8, 64, 8, 64, 256, {}),
    "d256_sinks_softcap": (1, 8, 1, 256, 16, dict(
        logits_soft_cap=30.0, sinks=np.linspace(-1.0, 2.0, 8).astype(np.float32))),
    "window_lse": (2, 16, 4, 128, 64, dict(local_window_size=(300, 0), return_lse=True)),
    "chunk_t128": (128, 32, 8, 128, 64, {}),  # 512 rows a kv head: four blocks of rows
}


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("case", list(TRITON_CASES))
def test_paged_triton_matches_oracle(case, fp8):
  """bf16 query over bf16 or FP8 caches on shuffled pages with NaN in every unused row and
  out-of-range ids past the lengths; ragged lengths long enough to split the keys; every
  query head's rows against the float64 math."""
  t, n, k, h, page, options = TRITON_CASES[case]
  rng = np.random.default_rng(3)
  lens = [3000, 1, 1500, 0, 4096, 17]
  query, kc, vc, table, lens, _, _ = paged_case(rng, lens, t=t, n=n, k=k, h=h, hv=h,
                                                page=page)
  q_lens = np.array([t, 1, max(t - 1, 1), t, t, t], np.int32)
  kw = dict(query_seq_lengths=q_lens, **options)
  args = (bf16(query), bf16(kc), bf16(vc), table, lens)
  if fp8:
    k_scale, v_scale = np.float32(0.02), np.float32(0.03)
    fp8_cache = lambda c, s: jnp.asarray(np.asarray(c, np.float32) / s, jnp.float8_e4m3fn)
    args = (args[0], fp8_cache(kc, k_scale), fp8_cache(vc, v_scale), table, lens)
    kw.update(k_scale=k_scale, v_scale=v_scale)
  assert "'triton' serves" in cudnn_jax.explain("sdpa_paged", *args, implementation="triton",
                                                **kw)
  got = jax.jit(functools.partial(cudnn_jax.sdpa_paged, implementation="triton", **kw))(*args)
  caches = [np.asarray(jnp.asarray(c, jnp.float32)) for c in args[1:3]]
  if fp8:
    caches = [caches[0] * k_scale, caches[1] * v_scale]
  oracle_kw = {x: y for x, y in kw.items() if x not in ("return_lse", "k_scale", "v_scale")}
  want_out, want_lse = paged_oracle(np.asarray(args[0], np.float32), *caches, table, lens,
                                    **oracle_kw)
  out, lse = got if options.get("return_lse") else (got, None)
  assert rel_err(out, want_out) <= REL_TOL
  if lse is not None:
    finite = np.isfinite(want_lse)
    assert np.array_equal(finite, np.isfinite(np.asarray(lse)))
    assert float(np.max(np.abs(np.asarray(lse)[finite] - want_lse[finite]))) <= 2e-2


def test_paged_triton_bad_page_ids_read_nothing():
  """Page ids outside [0, P) among the used pages contribute no keys (SPEC section 8)."""
  query, kc, vc, table, lens, _, _ = paged_case(
      np.random.default_rng(4), [1000, 700, 64], n=32, k=8, h=128, hv=128, page=16)
  table = table.copy()
  table[0, 3], table[1, 10], table[2, 0] = -1, kc.shape[0], 2 ** 31 - 1
  args = (bf16(query), bf16(kc), bf16(vc), table, lens)
  out = jax.jit(functools.partial(cudnn_jax.sdpa_paged, implementation="triton"))(*args)
  want, _ = paged_oracle(*(np.asarray(x, np.float32) for x in args[:3]), table, lens)
  assert rel_err(out, want) <= REL_TOL


@pytest.mark.parametrize("engine", ["triton", "cudnn"])
def test_paged_decode_replays_in_command_buffers(engine, tmp_path):
  """A decode step of two layers (each reading its own bf16 or FP8 cache) recorded into
  XLA's command buffers, replayed on new queries, tables and lengths, matches the xla
  engine."""
  def layer_case(seed, fp8):
    query, kc, vc, table, lens, _, _ = paged_case(
        np.random.default_rng(seed), [900, 1, 2000, 64 * seed + 5], n=32, k=8, h=128,
        hv=128, page=16)
    caches = [bf16(np.nan_to_num(c)) for c in (kc, vc)]
    scales = {}
    if fp8:
      caches = [c.astype(jnp.float8_e4m3fn) for c in caches]
      scales = dict(k_scale=np.float32(1.0), v_scale=np.float32(1.0))
    return bf16(query), caches, table, lens, scales

  def step(query, layers, implementation):
    x = query
    for caches, table, lens, scales in layers:
      x = jnp.sin(cudnn_jax.sdpa_paged(x, *caches, table, lens,
                                       implementation=implementation, **scales))
    return x

  # XLA outlines command buffers into the optimized HLO (an HLO pass) or converts the thunks
  # (a later pass, seen in the dumps): either names them "command_buffer".
  graphed = jax.jit(functools.partial(step, implementation=engine),
                    compiler_options={"xla_gpu_graph_min_graph_size": 1,
                                      "xla_dump_to": str(tmp_path)})
  reference = jax.jit(functools.partial(step, implementation="xla"))
  recorded = cudnn_jax.cache_info()["recorded"]
  for seed in range(3):
    cases = [layer_case(2 * seed + i, fp8=i == 1) for i in range(2)]
    layers = [c[1:] for c in cases]
    query = cases[0][0]
    if seed == 0:
      texts = [graphed.lower(query, layers).compile().as_text()]
      texts += [f.read_text(errors="replace") for f in tmp_path.rglob("*.txt")]
      assert any("command_buffer" in t.lower() for t in texts), (
          "no command buffer in the compiled decode step or XLA's dumps")
    assert rel_err(graphed(query, layers), reference(query, layers)) <= 2 * REL_TOL
  if engine == "cudnn":  # our handler counts the calls it records
    assert cudnn_jax.cache_info()["recorded"] > recorded


# The triton engine's random sweep (CUDNN_JAX_PAGED_SWEEP_N configurations, default 300;
# CUDNN_JAX_SWEEP_SHARD="i/n" splits it over processes): batch 1..256, ragged cache lengths
# up to 128k, pages of 16, 64 or 256 rows, head ratios 8/1, 32/8, 64/8, head dims 64, 128,
# 256, T = 1..8, bf16 or FP8 caches, shuffled pages with NaN in every unused row, invalid
# page ids among the used pages and past the lengths, lengths past the capacity. Against
# the float64 math where it fits in host memory, else the xla engine on the GPU.

PAGED_SWEEP_TOKENS = 1 << 19  # cached tokens of one configuration, at most
PAGED_ORACLE_ELEMENTS = 1 << 22  # B*N*T*capacity up to which the float64 math is checked
PAGED_XLA_ELEMENTS = 1 << 27  # ... and the xla engine's logits fit in memory


@dataclasses.dataclass(frozen=True)
class TritonPagedConfig:
  b: int
  t: int
  n: int
  k: int
  h: int
  page: int
  max_pages: int
  kv_lens: tuple  # as passed (clamped by the op)
  q_lens: tuple | None
  invalid: tuple  # (b, j) used positions holding an id outside [0, P)
  fp8: bool
  is_causal: bool
  window: Any
  soft_cap: float | None
  sinks: bool

  @property
  def capacity(self):
    return self.max_pages * self.page


def random_triton_paged(rng) -> TritonPagedConfig:
  n, k = [(8, 1), (32, 8), (64, 8)][rng.integers(3)]
  h = int(rng.choice([64, 128, 256], p=[0.3, 0.5, 0.2]))
  page = int(rng.choice([16, 64, 256]))
  b = int(rng.choice([1, 2, 3, 8, 17, 64, 256], p=[0.15, 0.15, 0.1, 0.2, 0.15, 0.15, 0.1]))
  longest = int(min(rng.choice([1000, 4096, 16384, 65536, 131072]), PAGED_SWEEP_TOKENS // b))
  longest = max(longest, 1)
  max_pages = -(-longest // page) + int(rng.integers(0, 2))
  t = int(rng.choice([1, 1, 2, 3, 4, 8, 16, 48]))
  kv_lens = [int(rng.choice([0, 1, rng.integers(1, longest + 1), longest, longest],
                            p=[0.05, 0.05, 0.5, 0.2, 0.2])) for _ in range(b)]
  if rng.random() < 0.1:
    kv_lens[int(rng.integers(b))] = int(rng.choice([-3, max_pages * page + 77]))
  q_lens = tuple(int(x) for x in rng.integers(0, t + 1, b)) if rng.random() < 0.3 else None
  stored = np.clip(kv_lens, 0, max_pages * page)
  used = [(i, j) for i in range(b) for j in range(-(-int(stored[i]) // page))]
  invalid = ()
  if used and rng.random() < 0.2:
    picks = rng.choice(len(used), size=min(len(used), 3), replace=False)
    invalid = tuple(used[p] for p in picks)
  window = None
  if rng.random() < 0.15:
    window = (int(rng.integers(0, longest + 1)), 0)
  return TritonPagedConfig(
      b=b, t=t, n=n, k=k, h=h, page=page, max_pages=max_pages,
      kv_lens=tuple(int(x) for x in kv_lens), q_lens=q_lens, invalid=invalid,
      fp8=bool(rng.random() < 0.4), is_causal=bool(rng.random() < 0.9), window=window,
      soft_cap=30.0 if rng.random() < 0.15 else None, sinks=bool(rng.random() < 0.2))


def build_triton_paged(cfg: TritonPagedConfig, seed):
  """(args, kwargs) of sdpa_paged: caches made on the device, NaN in every row that holds
  no key; FP8 caches with their scales."""
  rng = np.random.default_rng(seed)
  stored = np.clip(np.asarray(cfg.kv_lens), 0, cfg.capacity)
  used = -(-stored // cfg.page)
  pages = int(used.sum()) + int(rng.integers(1, 4))
  order = rng.permutation(pages)
  table = rng.choice([-1, pages, 2 ** 31 - 1, 0], size=(cfg.b, cfg.max_pages)).astype(np.int64)
  rows = np.zeros(pages, np.int64)  # rows of each physical page that hold keys
  taken = 0
  for i in range(cfg.b):
    for j in range(int(used[i])):
      table[i, j] = order[taken]
      rows[order[taken]] = min(cfg.page, int(stored[i]) - j * cfg.page)
      taken += 1
  for i, j in cfg.invalid:
    table[i, j] = rng.choice([-1, pages, pages + 999, 2 ** 31 - 1])
  keys = jax.random.split(jax.random.key(seed), 4)
  holds = jnp.arange(cfg.page)[None, :] < jnp.asarray(rows)[:, None]

  def cache(key, scale):
    x = jax.random.normal(key, (pages, cfg.page, cfg.k, cfg.h), jnp.float32)
    x = jnp.where(holds[:, :, None, None], x, jnp.nan)
    if not cfg.fp8:
      return x.astype(jnp.bfloat16)
    return jnp.clip(x / scale, -448.0, 448.0).astype(jnp.float8_e4m3fn)  # e4m3's finite range

  k_scale, v_scale = (np.float32(0.02), np.float32(0.03)) if cfg.fp8 else (None, None)
  query = jax.random.normal(keys[2], (cfg.b, cfg.t, cfg.n, cfg.h), jnp.bfloat16)
  args = (query, cache(keys[0], k_scale or 1.0), cache(keys[1], v_scale or 1.0),
          jnp.asarray(table.astype(np.int32)), jnp.asarray(cfg.kv_lens, jnp.int32))
  kwargs = dict(is_causal=cfg.is_causal, local_window_size=cfg.window,
                logits_soft_cap=cfg.soft_cap, return_lse=True,
                query_seq_lengths=None if cfg.q_lens is None else np.asarray(cfg.q_lens,
                                                                            np.int32))
  if cfg.sinks:
    kwargs["sinks"] = jax.random.normal(keys[3], (cfg.n,), jnp.float32)
  if cfg.fp8:
    kwargs.update(k_scale=k_scale, v_scale=v_scale)
  return args, kwargs


def compare_triton_paged(cfg: TritonPagedConfig, seed):
  args, kwargs = build_triton_paged(cfg, seed)
  run = lambda engine: jax.block_until_ready(jax.jit(functools.partial(
      cudnn_jax.sdpa_paged, implementation=engine, **kwargs))(*args))
  start = time.perf_counter()
  out, lse = run("triton")
  seconds = dict(triton=time.perf_counter() - start)
  errors, problems = {}, []
  elements = cfg.b * cfg.n * cfg.t * cfg.capacity
  if elements <= PAGED_ORACLE_ELEMENTS:
    caches = [np.asarray(c.astype(jnp.float32)) for c in args[1:3]]
    if cfg.fp8:
      caches = [caches[0] * kwargs["k_scale"], caches[1] * kwargs["v_scale"]]
    oracle_kw = {x: y for x, y in kwargs.items()
                 if x not in ("return_lse", "k_scale", "v_scale")}
    if "sinks" in oracle_kw:
      oracle_kw["sinks"] = np.asarray(oracle_kw["sinks"])
    want = paged_oracle(np.asarray(args[0], np.float32), *caches, np.asarray(args[3]),
                        np.asarray(args[4]), **oracle_kw)
    reference = "float64"
  elif elements <= PAGED_XLA_ELEMENTS:
    want, reference = run("xla"), "xla"
  else:
    want, reference = None, "none (the xla engine's logits would not fit)"
  seconds["reference"] = time.perf_counter() - start - seconds["triton"]
  if not np.all(np.isfinite(np.asarray(out, np.float32))):
    problems.append(("out", "out: NaN or inf (an unused row or an unwritten element read)"))
  if want is not None:
    errors["out"] = gpu_sweep.rel_err(out, want[0])
    errors["lse"] = gpu_sweep.lse_err(lse, want[1])
    for name, tol in (("out", REL_TOL), ("lse", 2e-2)):
      if not errors[name] <= tol:
        problems.append((name, f"{name} vs {reference}: {errors[name]:.3g} > {tol}"))
  return errors, problems, dict(seconds, reference=reference)


def test_random_sweep_paged_triton(capsys):
  count = int(os.environ.get("CUDNN_JAX_PAGED_SWEEP_N", "300"))
  rng = np.random.default_rng(20261207)
  configs = gpu_sweep.shard([(random_triton_paged(rng), seed) for seed in range(count)])
  cases = [(dict(config=dataclasses.asdict(cfg), seed=seed),
            functools.partial(compare_triton_paged, cfg, seed)) for cfg, seed in configs]
  records = gpu_sweep.run(cases, capsys)
  failed = [r for r in records if r["status"] != "ok"]
  with capsys.disabled():
    print(f"\nsdpa_paged triton sweep: {len(records)} configurations, {len(failed)} not ok; "
          "max errors: " + ", ".join(
              f"{q} {max((r['errors'].get(q, 0) for r in records if 'errors' in r), default=0):.3g}"
              for q in ("out", "lse")))
  assert not failed, failed[:5]
