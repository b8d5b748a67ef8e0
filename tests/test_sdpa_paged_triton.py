"""The "triton" engine of cudnn_jax.sdpa_paged (cudnn_jax/triton/sdpa_paged.py), its kernel
run by the Pallas interpreter on any backend: against the float64 math of SPEC section 8
(shuffled pages, NaN in every unused row, out-of-range page ids), decode and several query
rows, every option, FP8 caches, keys split across programs, poisoned results, a
head- and batch-sharded mesh; and lowered to Triton for an sm_90 GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cudnn_jax
from cudnn_jax import engines
from cudnn_jax.ops import sdpa_paged as ops_paged
from cudnn_jax.triton import sdpa_paged as kernel
from mesh_cases import assert_no_collectives, mesh_or_skip
from sdpa_oracle import paged_case, paged_oracle, rel_err_finite as rel_err
from triton_lowering import sm90_export

F32_TOL = 2e-5  # ||a - b|| / ||b||
E4M3 = jnp.float8_e4m3fn


@pytest.fixture(autouse=True)
def interpreted():
  """The triton engine with its kernel in the Pallas interpreter, on any backend."""
  original = engines.engine("sdpa_paged", "triton")
  engines.register_engine(
      "sdpa_paged", "triton", opt_in=True,
      supports=functools.partial(ops_paged._supports_triton, interpret=True),  # pylint: disable=protected-access
      run=functools.partial(ops_paged._run_triton, interpret=True))  # pylint: disable=protected-access
  yield
  engines.register_engine("sdpa_paged", "triton", supports=original.supports, run=original.run,
                          opt_in=original.opt_in, describe=original.describe)


def case(rng, kv_lens, **kwargs):
  """``paged_case`` at head dims the kernel takes."""
  return paged_case(rng, kv_lens, **{"h": 32, "hv": 16, **kwargs})[:5]


def check(args, *, dequantized=None, **kwargs):
  """The triton engine's (out, lse) against the float64 oracle on the same (dequantized)
  caches."""
  out, lse = jax.jit(functools.partial(cudnn_jax.sdpa_paged, implementation="triton",
                                       return_lse=True, **kwargs))(*args)
  caches = dequantized or args[1:3]
  oracle_kwargs = {k: v for k, v in kwargs.items() if k not in ("k_scale", "v_scale")}
  want_out, want_lse = paged_oracle(args[0], *caches, *args[3:], **oracle_kwargs)
  assert out.dtype == args[0].dtype
  assert rel_err(out, want_out) <= F32_TOL
  assert rel_err(lse, want_lse) <= F32_TOL
  return out, lse


OPTIONS = {
    "plain": dict(),
    "not_causal": dict(is_causal=False),
    "window": dict(local_window_size=(6, 0)),
    "window_both_sides": dict(local_window_size=(5, 2), is_causal=False),
    "softcap_sinks": dict(logits_soft_cap=2.0,
                          sinks=np.array([0.1, -0.5, 1.0, 0.0], np.float32)),
    "scale": dict(scale=0.3),
}


@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("t", [1, 3])
def test_matches_the_oracle(t, name):
  """Decode and three query rows (with query lengths: a row past its length outputs 0),
  over sequences with no key, one key, part of a page and several pages."""
  args = case(np.random.default_rng(t), [9, 1, 16, 0, 5], t=t)
  kwargs = dict(OPTIONS[name])
  if t > 1:
    kwargs["query_seq_lengths"] = np.array([3, 1, 2, 3, 0], np.int32)
  out, _ = check(args, **kwargs)
  if t > 1:
    assert np.all(np.asarray(out)[1, 1:] == 0) and np.all(np.asarray(out)[4] == 0)


def test_keys_split_across_programs():
  """Long ragged caches over several splits of the keys (splits with no key of a short
  sequence included), a query group of 8 heads, page ids outside [0, P) among the used
  pages (masked) and past the lengths, lengths past the capacity (clamped)."""
  rng = np.random.default_rng(11)
  query, kc, vc, table, lens = case(rng, [1200, 3, 700, 1, 1300], n=16, k=2, page=16)
  assert kernel.splits_for(5, 2, table.shape[1] * 16, 132)[0] > 1
  table = table.copy()
  table[0, 5], table[2, 0], table[4, 40] = -3, kc.shape[0], 2 ** 31 - 1
  lens = lens.copy()
  lens[4] = 10 ** 6
  check((query, kc, vc, table, lens), local_window_size=(900, None))


@pytest.mark.parametrize("name", ["plain", "window", "window_both_sides"])
def test_prefill_chunks_over_blocks_of_rows(name):
  """Chunks of 70 query rows (140 rows a kv head: two programs' blocks) against caches
  longer and shorter than the chunk, with query lengths; each block skips the keys none of
  its rows sees."""
  rng = np.random.default_rng(19)
  query, kc, vc, table, lens = case(rng, [300, 70, 90, 5], t=70, n=4, k=2, page=16)
  assert kernel.rows(70, 2) == (256, 128)
  check((query, kc, vc, table, lens), query_seq_lengths=np.array([70, 70, 33, 2], np.int32),
        **OPTIONS[name])


def test_fp8_caches_match_the_dequantized_oracle():
  """FP8 key and value caches (and an FP8 value cache beside a float32 key cache), read as
  stored and scaled inside: the oracle on ``stored * scale``."""
  query, kc, vc, table, lens = case(np.random.default_rng(12), [9, 1, 70, 5], t=2)
  k_scale, v_scale = np.float32(0.05), np.float32(3.0)
  kq, vq = (jnp.asarray(c / s, E4M3) for c, s in ((kc, k_scale), (vc, v_scale)))
  dequantized = [np.asarray(jnp.asarray(c, jnp.float32)) * s
                 for c, s in ((kq, k_scale), (vq, v_scale))]
  check((query, kq, vq, table, lens), dequantized=dequantized, k_scale=k_scale,
        v_scale=v_scale, logits_soft_cap=3.0)
  check((query, kc, vq, table, lens), dequantized=[kc, dequantized[1]], v_scale=v_scale)


def test_fp8_scales_as_given():
  """A scale of 0 zeroes that cache; an inf value scale makes the rows that read keys NaN
  while a row with no key (with a sink) still outputs 0, as on the xla engine."""
  query, kc, vc, table, lens = case(np.random.default_rng(13), [9, 0, 16])
  kq, vq = jnp.asarray(kc, E4M3), jnp.asarray(vc, E4M3)
  call = lambda engine, **kw: np.asarray(cudnn_jax.sdpa_paged(
      query, kq, vq, table, lens, implementation=engine, **kw))
  sinks = np.array([0.1, -0.5, 1.0, 0.0], np.float32)
  for kw in (dict(k_scale=0.0, v_scale=1.0), dict(k_scale=1.0, v_scale=0.0),
             dict(k_scale=1.0, v_scale=np.float32(np.inf), sinks=sinks)):
    got, want = call("triton", **kw), call("xla", **kw)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(want), rtol=1e-5, atol=1e-6)
  assert np.all(np.isnan(got[[0, 2]])) and np.all(got[1] == 0)


def test_poisoned_results_are_all_written(monkeypatch):
  """Every element of the kernel's results is written (they start NaN-filled)."""
  monkeypatch.setenv("CUDNN_JAX_POISON_OUTPUTS", "1")
  check(case(np.random.default_rng(14), [9, 0, 40, 2], t=2))


def test_bfloat16():
  query, kc, vc, table, lens = case(np.random.default_rng(15), [30, 7, 64])
  bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)
  out = cudnn_jax.sdpa_paged(bf16(query), bf16(kc), bf16(vc), table, lens,
                             implementation="triton")
  want, _ = paged_oracle(*(np.asarray(bf16(x), np.float32) for x in (query, kc, vc)), table, lens)
  assert out.dtype == jnp.bfloat16
  assert rel_err(out, want) <= 2e-2


def test_verdicts():
  query, kc, vc, table, lens = case(np.random.default_rng(16), [9, 3])
  text = cudnn_jax.explain("sdpa_paged", query, kc, vc, table, lens, implementation="triton")
  assert "'triton' serves" in text, text
  odd = case(np.random.default_rng(17), [9, 3], h=24)
  with pytest.raises(cudnn_jax.UnsupportedError, match="head dims"):
    cudnn_jax.sdpa_paged(*odd, implementation="triton")
  assert kernel.rows(1, 4) == (16, 16) and kernel.rows(3, 8) == (32, 32)
  assert kernel.rows(16, 8) == (128, 128) and kernel.rows(70, 2) == (256, 128)
  assert kernel.rows(40, 4, h=256) == (192, 64)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_head_and_batch_sharded_stay_local(axis_type):
  """The cache sharded by kv head, the table and lengths by sequence: each device reads
  only its own pages and heads, and the result matches the oracle."""
  mesh = mesh_or_skip((2, 2), ("b", "h"), axis_type)
  query, kc, vc, table, lens = case(np.random.default_rng(18), [9, 1, 16, 5], n=4, k=2)
  with jax.set_mesh(mesh):
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    args = (put(query, P("b", None, "h")), put(kc, P(None, None, "h")),
            put(vc, P(None, None, "h")), put(table, P("b")), put(lens, P("b")))
    run = jax.jit(functools.partial(cudnn_jax.sdpa_paged, implementation="triton"))
    out = assert_no_collectives(run, *args)(*args)
  want, _ = paged_oracle(query, kc, vc, table, lens)
  assert rel_err(out, want) <= F32_TOL


def test_lowers_to_triton_for_sm90():
  """The kernel lowers for an sm_90 GPU: bf16 and FP8 caches, several query rows, every
  option, one Triton call."""
  s = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)
  with sm90_export() as export:
    for cache_dtype, t, hd in ((jnp.bfloat16, 1, 128), (E4M3, 4, 64), (jnp.bfloat16, 2, 256),
                               (jnp.bfloat16, 64, 128)):
      fn = functools.partial(kernel.sdpa_paged, scale=0.1, causal=True, window=(100, 0),
                             soft_cap=30.0)
      text = export(jax.jit(fn))(
          s(4, t, 32, hd), s(300, 16, 8, hd, dt=cache_dtype), s(300, 16, 8, hd, dt=cache_dtype),
          s(4, 70, dt=jnp.int32), s(4, dt=jnp.int32), s(4, dt=jnp.int32), s(32, dt=jnp.float32),
          s(dt=jnp.float32), s(dt=jnp.float32)).mlir_module()
      assert text.count("xla.gpu.triton") == 1
