"""cudnn_jax.kda / gdn with sequence parallelism (the tokens sharded over a mesh axis) on the
8-device CPU mesh: values, final states and gradients equal the unsharded call, with
initial states and with packed sequences that cross the devices' span boundaries (so the
span maps the module derives from the op are right: a wrong M or B, or a reset inside a
span not cutting the map, would change the states entering the later spans)."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cudnn_jax
from cudnn_jax.ops import kda_sequence_parallel
from kda_cases import Config, make_case
from mesh_cases import mesh_or_skip

# bench/train.py's collective_bytes reads the collectives of a compiled program.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import train  # pylint: disable=g-import-not-at-top,wrong-import-position

TOKENS = ("q", "k", "v", "g", "beta")

CASES = {
    # every batch row crosses every span, starting from its own initial state
    "initial_state": Config(t=64, initial_state=True, l2norm=True),
    # spans of 8 tokens: sequences start, end and run through spans; an empty sequence
    "varlen": Config(cu_seqlens=(0, 5, 5, 30, 50, 64), initial_state=True, h=2, hv=4),
}


def _split(arrays):
  return [arrays[n] for n in TOKENS], {n: x for n, x in arrays.items() if n not in TOKENS}


def _loss_and_grads(cfg, arrays, kwargs, axis):
  """(o, final_state), and the gradients of a fixed nonlinear loss of both, jitted."""
  op = getattr(cudnn_jax, cfg.op)
  fixed = {n: arrays[n] for n in ("cu_seqlens",) if n in arrays}

  def loss(diff):
    tokens, rest = _split(diff)
    o, final = op(*tokens, **rest, **fixed, **kwargs, implementation="xla",
                  sequence_parallel_axis=axis)
    return jnp.sum(jnp.sin(o)) + jnp.sum(final * final), (o, final)

  diff = {n: x for n, x in arrays.items() if n not in fixed}
  (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(diff)
  return out, grads


def _assert_equal(got, want):
  (o, final), grads = got
  (want_o, want_final), want_grads = want
  np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(final, want_final, rtol=1e-5, atol=1e-5)
  for name, g in grads.items():
    scale = float(np.max(np.abs(want_grads[name])))
    np.testing.assert_allclose(g, want_grads[name], rtol=1e-4, atol=1e-5 * scale, err_msg=name)


@pytest.mark.parametrize("name", CASES)
def test_equals_unsharded(name):
  """Under jax.set_mesh, tokens sharded along "sp" (and the batch along "data" where
  there is one), gradients of every differentiable input included."""
  cfg = CASES[name]
  arrays, kwargs = make_case(cfg)
  varlen = cfg.cu_seqlens is not None
  mesh = mesh_or_skip((1, 8) if varlen else (2, 4), ("data", "sp"))
  want = _loss_and_grads(cfg, arrays, kwargs, None)
  with jax.set_mesh(mesh):
    placed = {n: jax.device_put(x, NamedSharding(mesh, P("data", "sp"))) if n in TOKENS else x
              for n, x in arrays.items()}
    got = _loss_and_grads(cfg, placed, kwargs, "sp")
  _assert_equal(got, want)
  assert got[0][0].sharding.spec[1] == "sp", got[0][0].sharding


@pytest.mark.parametrize("entering", ["gather", "log_depth"])
def test_gdn_packed_both_combines(monkeypatch, entering):
  """gdn, packed sequences over 8 spans of 8 tokens; the spans' maps combined by one
  all-gather or by the log-depth scan of collective permutes."""
  monkeypatch.setattr(kda_sequence_parallel, "ENTERING", entering)
  cfg = Config(op="gdn", cu_seqlens=(0, 3, 20, 20, 41, 64), gate="softplus", dt_bias=True,
               initial_state=True)
  arrays, kwargs = make_case(cfg, seed=1)
  want = _loss_and_grads(cfg, arrays, kwargs, None)
  with jax.set_mesh(mesh_or_skip((8,), ("sp",))):
    got = _loss_and_grads(cfg, arrays, kwargs, "sp")
  _assert_equal(got, want)


def test_explicit_mesh_eager_invalid_metadata():
  """Explicitly sharded inputs named by the axis alone (no jax.set_mesh), called eagerly;
  cu_seqlens with an entry below an earlier one (its sequences are empty: they return
  their initial states, their rows output 0) and a sequence over three spans."""
  cfg = Config(op="gdn", cu_seqlens=(0, 2, 40, 30, 64), initial_state=True)
  arrays, kwargs = make_case(cfg, seed=2)
  mesh = mesh_or_skip((4,), ("sp",), axis_type="Explicit")
  tokens, rest = _split(arrays)
  want = cudnn_jax.gdn(*tokens, **rest, **kwargs, implementation="xla")
  placed = [jax.device_put(x, NamedSharding(mesh, P(None, "sp"))) for x in tokens]
  got = cudnn_jax.gdn(*placed, **rest, **kwargs, implementation="xla",
                      sequence_parallel_axis="sp")
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
  assert got[0].sharding.spec[1] == "sp", got[0].sharding


def test_bad_arguments():
  cfg = Config(t=60)
  arrays, kwargs = make_case(cfg)
  tokens, _ = _split(arrays)
  with jax.set_mesh(mesh_or_skip((8,), ("sp",))):
    with pytest.raises(ValueError, match="sequence_parallel_axis: the sequence"):
      cudnn_jax.kda(*tokens, **kwargs, sequence_parallel_axis="sp")
    with pytest.raises(ValueError, match="sequence_parallel_axis: 'tp' is not an axis"):
      cudnn_jax.kda(*tokens, **kwargs, sequence_parallel_axis="tp")
  with pytest.raises(TypeError, match="sequence_parallel_axis"):
    cudnn_jax.kda(*tokens, **kwargs, sequence_parallel_axis=1)


def test_maps_gathered_along_the_sequence_axis_only():
  """Batch on "data", heads on "tp", tokens on "sp": each device receives the maps of its
  own batch rows and heads from the spans along "sp" (M [K,K] and B [K,V] each), and
  nothing else is gathered (an all_gather inside a shard_map manual over "sp" alone would
  first replicate the maps over "data" and "tp")."""
  cfg = Config(b=2, t=32, h=2, hv=2)
  arrays, kwargs = make_case(cfg)
  tokens, rest = _split(arrays)
  mesh = mesh_or_skip((2, 2, 2), ("data", "tp", "sp"))
  with jax.set_mesh(mesh):
    placed = [jax.device_put(x, NamedSharding(mesh, P("data", "sp", "tp"))) for x in tokens]
    run = jax.jit(lambda *t: cudnn_jax.kda(*t, **rest, **kwargs, implementation="xla",
                                           sequence_parallel_axis="sp"))
    hlo = run.lower(*placed).compile().as_text()
  sp, rows, heads = 2, cfg.b // 2, cfg.hv // 2
  maps = sp * rows * heads * cfg.k * (cfg.k + cfg.v) * 4
  assert train.collective_bytes(hlo)["all-gather"] == maps
