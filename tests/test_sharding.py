"""Every op under jax.jit on a (4, 2) mesh of the 8 CPU devices, inside jax.set_mesh, on
axes of either type (Auto, Explicit), for every placement of its inputs that the op serves
(SPEC section 7): values and gradients equal the call without any mesh; where nothing needs
to move (batch- or head-sharded, replicated or NumPy inputs) the compiled forward holds no
collective and the outputs keep the inputs' batch and head sharding.

One table describes the ops (``OpCase``: inputs, the call, its differentiable arguments,
which dims are the batch, heads, sequence or experts); one test body runs every cell.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cudnn_jax
from mesh_cases import assert_no_collectives, mesh_or_skip

MESH_SHAPE, MESH_AXES = (4, 2), ("b", "h")

# A placement gives each role of an input's dims the mesh axis that shards it; every other
# dim is whole on each device. The inputs it shards along no axis are placed whole on every
# device, or, in the placements named "numpy" or "...+numpy", stay NumPy arrays that the
# jitted functions capture as constants (the differentiable ones are passed to the
# gradient as NumPy arguments).
PLACEMENTS = {
    "batch": {"batch": "b"},
    "heads": {"heads": "h"},
    "replicated": {},
    "numpy": {},
    # Batch-sharded inputs among NumPy constants (weights, lengths, tables, sinks).
    "batch+numpy": {"batch": "b"},
    # Context parallelism (along "h") over a batch sharded along "b".
    "sequence": {"batch": "b", "seq": "h"},
    # Expert parallelism: the experts along "b", tokens whole or sharded along "h".
    "experts": {"experts": "b"},
    "experts_tokens": {"experts": "b", "batch": "h"},
}
# Placements whose point is communication: values and gradients only.
COMMUNICATING = ("sequence", "experts", "experts_tokens")


@dataclasses.dataclass(frozen=True)
class OpCase:
  """One op call: ``build(rng)`` its NumPy inputs by name, ``call(**inputs)`` an array or
  a tuple of arrays (``unsharded_call`` the same without a mesh, where ``call`` needs one);
  ``roles[name]`` the dims of an input by role ("batch", "heads", "seq", "experts"),
  ``out_roles`` the same for each output."""
  name: str
  build: Callable[[np.random.Generator], dict]
  call: Callable[..., object]
  diff: tuple[str, ...]
  roles: dict
  out_roles: tuple
  placements: tuple[str, ...] = ()  # default: every one its roles allow (``cells``)
  communicates: bool = False  # context parallelism: every placement moves data
  unsharded_call: Callable[..., object] | None = None  # the call without a mesh, if not call

  def cells(self):
    if self.placements:
      return self.placements
    present = {role for dims in self.roles.values() for role in dims}
    return (tuple(p for p in ("batch", "heads") if p in present) + ("replicated", "numpy")
            + (("batch+numpy",) if "batch" in present else ()))


def normal(rng, *shape, scale=1.0):
  return (scale * rng.standard_normal(shape)).astype(np.float32)


BH = lambda b, h: {"batch": b, "heads": h}  # pylint: disable=invalid-name


# ---------------------------------------------------------------------------------------
# Inputs of each op (tiny shapes: B = 4 for the "b" axis, head counts even for "h").


def sdpa_inputs(rng):
  return dict(query=normal(rng, 4, 8, 4, 8), key=normal(rng, 4, 8, 2, 8),
              value=normal(rng, 4, 8, 2, 8), sinks=normal(rng, 4),
              key_value_seq_lengths=np.array([8, 5, 3, 8], np.int32))


def varlen_inputs(rng):
  return dict(query=normal(rng, 16, 4, 8), key=normal(rng, 16, 2, 8),
              value=normal(rng, 16, 2, 8), sinks=normal(rng, 4),
              cu_seqlens_q=np.array([0, 5, 11, 16], np.int32),
              cu_seqlens_kv=np.array([0, 6, 10, 16], np.int32))


def paged_inputs(rng):
  table = np.stack([rng.permutation(8)[:3] for _ in range(4)]).astype(np.int32)
  return dict(query=normal(rng, 4, 2, 4, 8), key_cache=normal(rng, 8, 4, 2, 8),
              value_cache=normal(rng, 8, 4, 2, 8), page_table=table,
              key_value_seq_lengths=np.array([12, 7, 3, 9], np.int32))


def context_parallel_inputs(rng):
  return dict(query=normal(rng, 4, 8, 4, 8), key=normal(rng, 4, 8, 2, 8),
              value=normal(rng, 4, 8, 2, 8), sinks=normal(rng, 4))


def delta_inputs(rng, scalar_gate):
  b, t, h, hv, k, v = 4, 16, 2, 4, 8, 8
  gate = (b, t, hv) if scalar_gate else (b, t, hv, k)
  return dict(q=normal(rng, b, t, h, k), k=normal(rng, b, t, h, k), v=normal(rng, b, t, hv, v),
              g=normal(rng, *gate), beta=normal(rng, b, t, hv),
              initial_state=normal(rng, b, hv, k, v, scale=0.1),
              a_log=normal(rng, hv, scale=0.5),
              dt_bias=normal(rng, hv if scalar_gate else hv * k, scale=0.5))


def bsa_inputs(rng):
  mask = rng.random((4, 4, 2, 2)) < 0.5
  mask[..., [0, 1], [0, 1]] = True  # every query block sees its own block
  index, counts = cudnn_jax.bsa_from_mask(mask)
  return dict(query=normal(rng, 4, 32, 4, 8), key=normal(rng, 4, 32, 2, 8),
              value=normal(rng, 4, 32, 2, 8), block_index=np.asarray(index),
              block_counts=np.asarray(counts))


def gemm_inputs(rng):
  return dict(a=normal(rng, 4, 4, 8), b=normal(rng, 8, 16, scale=0.3), bias=normal(rng, 16))


def grouped_inputs(rng, batch=None):
  lead = () if batch is None else (batch,)
  sizes = [4, 5, 2] if batch is None else [[4, 5, 2], [0, 12, 0], [3, 3, 3], [7, 0, 4]]
  return dict(lhs=normal(rng, *lead, 12, 8), rhs=normal(rng, 3, 8, 6, scale=0.3),
              group_sizes=np.array(sizes, np.int32), bias=normal(rng, 3, 6))


def moe_inputs(rng):
  return dict(x=normal(rng, 16, 8), expert_indices=rng.integers(0, 4, (16, 2)).astype(np.int32),
              expert_weights=normal(rng, 16, 2), w_up=normal(rng, 4, 8, 16, scale=0.3),
              w_down=normal(rng, 4, 8, 8, scale=0.3))


def conv3d_inputs(rng):
  return dict(x=normal(rng, 4, 3, 4, 4, 4), w=normal(rng, 2, 3, 3, 4, 4, scale=0.2),
              bias=normal(rng, 4), residual=normal(rng, 4, 3, 4, 4, 4),
              norm_scale=normal(rng, 4), norm_bias=normal(rng, 4))


# ---------------------------------------------------------------------------------------
# The calls.


def grouped_gemm_vmapped(lhs, rhs, group_sizes, bias):
  """grouped_gemm over a leading batch of lhs and group sizes, the weights shared."""
  one = lambda l, g: cudnn_jax.grouped_gemm(l, rhs, g, bias=bias, activation="silu")
  return jax.vmap(one)(lhs, group_sizes)


def context_parallel(strategy):
  return functools.partial(cudnn_jax.sdpa, is_causal=True, return_lse=True,
                           context_parallel_axis="h", context_parallel_strategy=strategy)


ATTENTION = dict(query=BH(0, 2), key=BH(0, 2), value=BH(0, 2), sinks={"heads": 0})
DELTA = dict(q=BH(0, 2), k=BH(0, 2), v=BH(0, 2), g=BH(0, 2), beta=BH(0, 2),
             initial_state=BH(0, 1), a_log={"heads": 0}, dt_bias={"heads": 0})
DELTA_OPTIONS = dict(output_final_state=True, use_qk_l2norm_in_kernel=True,
                     use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, chunk_size=32)
CONTEXT_PARALLEL = dict(query={"batch": 0, "seq": 1}, key={"batch": 0, "seq": 1},
                        value={"batch": 0, "seq": 1})
MOE = dict(x={"batch": 0}, expert_indices={"batch": 0}, expert_weights={"batch": 0},
           w_up={"experts": 0}, w_down={"experts": 0})

CASES = [
    OpCase("sdpa", sdpa_inputs,
           functools.partial(cudnn_jax.sdpa, is_causal=True, return_lse=True),
           diff=("query", "key", "value", "sinks"),
           roles=dict(ATTENTION, key_value_seq_lengths={"batch": 0}),
           out_roles=(BH(0, 2), BH(0, 1))),
    OpCase("sdpa_varlen", varlen_inputs,
           functools.partial(cudnn_jax.sdpa_varlen, max_seqlen_q=6, max_seqlen_kv=6,
                             is_causal=True, return_lse=True),
           diff=("query", "key", "value", "sinks"),
           roles=dict(query={"heads": 1}, key={"heads": 1}, value={"heads": 1},
                      sinks={"heads": 0}),
           out_roles=({"heads": 1}, {"heads": 0})),
    OpCase("sdpa_paged", paged_inputs,
           functools.partial(cudnn_jax.sdpa_paged, return_lse=True), diff=(),
           roles=dict(query=BH(0, 2), key_cache={"heads": 2}, value_cache={"heads": 2},
                      page_table={"batch": 0}, key_value_seq_lengths={"batch": 0}),
           out_roles=(BH(0, 2), BH(0, 1))),
    *[OpCase(f"sdpa_context_parallel_{strategy}", context_parallel_inputs,
             context_parallel(strategy), diff=("query", "key", "value", "sinks"),
             roles=CONTEXT_PARALLEL, out_roles=({"batch": 0, "seq": 1}, {"batch": 0, "seq": 2}),
             placements=("sequence", "batch", "replicated", "numpy"), communicates=True,
             unsharded_call=functools.partial(cudnn_jax.sdpa, is_causal=True, return_lse=True))
      for strategy in ("all_gather", "ring")],
    OpCase("kda", functools.partial(delta_inputs, scalar_gate=False),
           functools.partial(cudnn_jax.kda, **DELTA_OPTIONS), diff=tuple(DELTA), roles=DELTA,
           out_roles=(BH(0, 2), BH(0, 1))),
    OpCase("gdn", functools.partial(delta_inputs, scalar_gate=True),
           functools.partial(cudnn_jax.gdn, **DELTA_OPTIONS), diff=tuple(DELTA), roles=DELTA,
           out_roles=(BH(0, 2), BH(0, 1))),
    OpCase("bsa", bsa_inputs,
           functools.partial(cudnn_jax.bsa, block_size=16, is_causal=True, return_lse=True),
           diff=("query", "key", "value"),
           roles=dict(query=BH(0, 2), key=BH(0, 2), value=BH(0, 2), block_index=BH(0, 1),
                      block_counts=BH(0, 1)),
           out_roles=(BH(0, 2), BH(0, 1))),
    OpCase("gemm", gemm_inputs, functools.partial(cudnn_jax.gemm, glu="swiglu"),
           diff=("a", "b", "bias"), roles=dict(a={"batch": 0}), out_roles=({"batch": 0},)),
    OpCase("grouped_gemm", grouped_inputs,
           functools.partial(cudnn_jax.grouped_gemm, activation="silu"),
           diff=("lhs", "rhs", "bias"), roles={}, out_roles=({},)),
    OpCase("grouped_gemm_vmap", functools.partial(grouped_inputs, batch=4),
           grouped_gemm_vmapped, diff=("lhs", "rhs", "bias"),
           roles=dict(lhs={"batch": 0}, group_sizes={"batch": 0}), out_roles=({"batch": 0},)),
    OpCase("moe_mlp", moe_inputs, cudnn_jax.moe_mlp,
           diff=("x", "expert_weights", "w_up", "w_down"), roles=MOE,
           out_roles=({"batch": 0},),
           placements=("batch", "experts", "experts_tokens", "replicated", "numpy")),
    OpCase("conv3d", conv3d_inputs,
           functools.partial(cudnn_jax.conv3d, norm="group", num_groups=2, activation="silu",
                             padding="CAUSAL"),
           diff=("x", "w", "bias", "residual", "norm_scale", "norm_bias"),
           roles=dict(x={"batch": 0}, residual={"batch": 0}), out_roles=({"batch": 0},)),
]
BY_NAME = {case.name: case for case in CASES}


# ---------------------------------------------------------------------------------------
# The test body.


def as_tuple(outputs):
  return outputs if isinstance(outputs, tuple) else (outputs,)


def loss(case, arrays, cotangents):
  """A weighted sum of every output (infinite entries, as lse of a row without keys, out)."""
  outputs = as_tuple(case.call(**arrays))
  return sum(jnp.sum(jnp.where(jnp.isfinite(o), o, 0.0) * ct)
             for o, ct in zip(outputs, cotangents))


@functools.cache
def unsharded(name):
  """(inputs, outputs, cotangents, gradients) of case ``name`` computed without any mesh."""
  case = BY_NAME[name]
  case = dataclasses.replace(case, call=case.unsharded_call or case.call)
  arrays = case.build(np.random.default_rng(0))
  outputs = tuple(np.asarray(o) for o in as_tuple(jax.jit(case.call)(**arrays)))
  rng = np.random.default_rng(1)
  cotangents = tuple(normal(rng, *o.shape) for o in outputs)
  grads = {}
  if case.diff:
    def of_diff(diff):
      return loss(case, {**arrays, **diff}, cotangents)
    grads = jax.jit(jax.grad(of_diff))({n: arrays[n] for n in case.diff})
  return arrays, outputs, cotangents, {n: np.asarray(g) for n, g in grads.items()}


def spec_for(roles, ndim, placement):
  spec = [None] * ndim
  for role, dim in roles.items():
    spec[dim] = placement.get(role)
  return P(*spec)


def padded_spec(x):
  spec = tuple(x.sharding.spec)
  return spec + (None,) * (x.ndim - len(spec))


MATRIX = [(case.name, placement) for case in CASES for placement in case.cells()]


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("name,placement", MATRIX, ids=[f"{n}-{p}" for n, p in MATRIX])
def test_sharded_equals_unsharded(name, placement, axis_type):
  case = BY_NAME[name]
  arrays, want, cotangents, want_grads = unsharded(name)
  mesh = mesh_or_skip(MESH_SHAPE, MESH_AXES, axis_type)
  local = not case.communicates and placement not in COMMUNICATING
  roles = PLACEMENTS[placement]
  keep_numpy = placement.endswith("numpy")
  with jax.set_mesh(mesh):
    # Inputs passed to the jitted functions (placed on the mesh), and NumPy constants.
    placed, constants = {}, {}
    for n, x in arrays.items():
      spec = spec_for(case.roles.get(n, {}), x.ndim, roles)
      if keep_numpy and not any(spec):
        constants[n] = x
      else:
        placed[n] = jax.device_put(x, NamedSharding(mesh, spec))
    forward = jax.jit(lambda a: case.call(**constants, **a))
    if local:
      outputs = assert_no_collectives(forward, placed)(placed)
    else:
      outputs = forward(placed)
    every = {**constants, **placed}
    diff = {n: every[n] for n in case.diff}
    rest = {n: x for n, x in placed.items() if n not in case.diff}
    gradient = jax.jit(jax.grad(lambda d, r: loss(case, {**constants, **r, **d}, cotangents)))
    grads = gradient(diff, rest) if case.diff else {}

  outputs = as_tuple(outputs)
  assert len(outputs) == len(want)
  for i, (got, expected) in enumerate(zip(outputs, want)):
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5,
                               err_msg=f"output {i}")
  for n in case.diff:
    np.testing.assert_allclose(np.asarray(grads[n]), want_grads[n], rtol=1e-4, atol=1e-5,
                               err_msg=f"gradient of {n}")
  if local:  # the outputs keep the inputs' batch and head sharding
    for i, (got, out_roles) in enumerate(zip(outputs, case.out_roles)):
      spec = padded_spec(got)
      for role, dim in out_roles.items():
        assert spec[dim] == roles.get(role), (f"output {i} dim {dim} ({role}): expected "
                                              f"{roles.get(role)!r}, got {got.sharding.spec}")
