"""sdpa's xla engine block by block (cudnn_jax/xla/sdpa.py) against the whole-logits
definition (cudnn_jax/reference/sdpa.py) and the float64 oracle: every mask, bias forms,
sinks, soft cap, lengths and GQA, values and gradients (lse's included), blocks smaller
than the sequences so that every edge is crossed; and memory that grows linearly in S."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cudnn_jax
from cudnn_jax.ops import sdpa as sdpa_ops
from cudnn_jax.reference import sdpa as ref
from cudnn_jax.xla import sdpa as blockwise
from sdpa_oracle import oracle


@pytest.fixture
def small_blocks(monkeypatch):
  """Blocks of 4 query and 3 key rows, and every call of the xla engine blockwise."""
  monkeypatch.setattr(blockwise, "BLOCK_Q", 4)
  monkeypatch.setattr(blockwise, "BLOCK_K", 3)
  monkeypatch.setattr(sdpa_ops, "BLOCKWISE_ABOVE", 0)


CASES = [
    ("plain", dict()),
    ("causal_gqa", dict(is_causal=True)),
    ("bottom_right_lengths", dict(is_causal=True, causal_alignment="bottom_right",
                                  query_seq_lengths=[10, 6], key_value_seq_lengths=[0, 9])),
    ("window_softcap", dict(local_window_size=(3, 1), logits_soft_cap=4.0)),
    ("bias_mask", dict(bias="1ntS", mask="b1tS")),
    ("broadcast_bias", dict(bias="b11S", is_causal=True)),
    ("segments_sinks", dict(segments=True, sinks=True)),
    ("sinks_lengths", dict(sinks=True, query_seq_lengths=[3, 10], key_value_seq_lengths=[11, 0])),
]


def _arrays(rng, kwargs, dtype=jnp.float32):
  b, t, s, n, k = 2, 10, 11, 4, 2
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  args = [normal(b, t, n, 8), normal(b, s, k, 8), normal(b, s, k, 6)]
  kwargs = dict(kwargs)
  shape = lambda form: tuple({"b": b, "n": n, "t": t, "S": s, "1": 1}[c] for c in form)
  for name in ("bias", "mask"):
    if name in kwargs:
      form = kwargs.pop(name)
      kwargs[name] = (normal(*shape(form)) if name == "bias"
                      else jnp.asarray(rng.random(shape(form)) < 0.8))
  for name in ("query_seq_lengths", "key_value_seq_lengths"):
    if name in kwargs:
      kwargs[name] = jnp.asarray(kwargs[name], jnp.int32)
  if kwargs.pop("segments", False):
    kwargs["q_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (b, t))), jnp.int32)
    kwargs["kv_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (b, s))), jnp.int32)
  if kwargs.pop("sinks", False):
    kwargs["sinks"] = normal(n).astype(jnp.float32)
  return args, kwargs


@pytest.mark.parametrize("kwargs", [k for _, k in CASES], ids=[n for n, _ in CASES])
def test_blockwise_matches_the_whole_logits(small_blocks, kwargs):
  args, kwargs = _arrays(np.random.default_rng(0), kwargs)
  differentiable = {k: v for k, v in kwargs.items() if k in ("bias", "sinks")}
  rest = {k: v for k, v in kwargs.items() if k not in differentiable}

  def loss(args, diff):
    out, lse = cudnn_jax.sdpa(*args, **diff, **rest, return_lse=True, implementation="xla")
    return jnp.sum(out * jnp.cos(out)) + jnp.sum(jnp.where(jnp.isfinite(lse), 0.3 * lse, 0.0))

  run = jax.jit(lambda a, d: (cudnn_jax.sdpa(*a, **d, **rest, return_lse=True,
                                             implementation="xla"),
                              jax.grad(loss, argnums=(0, 1))(a, d)))
  (out, lse), grads = run(args, differentiable)
  want_out, want_lse = oracle(*args, **kwargs)
  np.testing.assert_allclose(out, want_out, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(lse, want_lse, rtol=2e-5, atol=2e-5)
  with pytest.MonkeyPatch.context() as m:
    m.setattr(sdpa_ops, "BLOCKWISE_ABOVE", 1 << 60)
    want_grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(args, differentiable)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_blockwise_bf16_and_dropout(small_blocks):
  args, _ = _arrays(np.random.default_rng(1), {}, jnp.bfloat16)
  out = cudnn_jax.sdpa(*args, is_causal=True, implementation="xla")
  want = ref.sdpa(*args, scale=8 ** -0.5, is_causal=True)[0]
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                             rtol=2e-2, atol=2e-2)
  drop = jax.jit(lambda *a, key: cudnn_jax.sdpa(*a, dropout_rate=0.5, dropout_rng=key,
                                                 implementation="xla"))
  a, b = drop(*args, key=jax.random.key(3)), drop(*args, key=jax.random.key(3))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, drop(*args, key=jax.random.key(4)))
  grads = jax.grad(lambda q: jnp.sum(drop(q, *args[1:], key=jax.random.key(3)).astype(
      jnp.float32) ** 2))(args[0])
  assert np.all(np.isfinite(np.asarray(grads, np.float32)))


def test_memory_grows_linearly_in_the_sequence():
  """Causal with sinks, B=1, 8 heads, d=64, S=32k, forward and backward: the compiled
  program's peak (temporaries, arguments and results) under 2 GB; all logits at once would
  take 34 GB."""
  s = 32768
  q = jax.ShapeDtypeStruct((1, s, 8, 64), jnp.float32)
  sinks = jax.ShapeDtypeStruct((8,), jnp.float32)
  loss = lambda q, k, v, sinks: jnp.sum(cudnn_jax.sdpa(q, k, v, is_causal=True, sinks=sinks))
  memory = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))).lower(
      q, q, q, sinks).compile().memory_analysis()
  peak = memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes
  assert peak < 2e9, peak
