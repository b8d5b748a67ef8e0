"""Mixture-of-experts MLP: ``cudnn_jax.moe_mlp``."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from cudnn_jax import _checks, _metadata, engines, epilogue
from cudnn_jax.ops.gemm import GroupedGemmCall, grouped_gemms
from cudnn_jax.primitives import core
from cudnn_jax.reference import moe as ref


class MoeInputs(NamedTuple):
  x: jax.Array  # [T, D]
  expert_indices: jax.Array  # [T, k] int32
  expert_weights: jax.Array  # [T, k]
  w_up: jax.Array  # [E, D, C], C = 2F with glu, else F
  w_down: jax.Array  # [E, F, D]


@dataclasses.dataclass(frozen=True)
class MoeCall:
  """Everything static about one moe_mlp call."""
  tokens: int
  top_k: int
  d: int
  f: int
  experts: int
  dtype: str
  weights_dtype: str
  glu: str | None = "swiglu"
  activation: str | None = None


def _prepare(x, expert_indices, expert_weights, w_up, w_down, *, glu="swiglu",
             activation=None, implementation=None):
  """Validates the user's arguments into (MoeCall, MoeInputs)."""
  del implementation
  t, d = _checks.shape_of("x", x, 2)
  _checks.float_dtype("x", x)
  _checks.shape_of("expert_indices", expert_indices, 2)
  _checks.int_dtype("expert_indices", expert_indices)
  if expert_indices.shape[0] != t:
    raise ValueError(f"expert_indices: expected [T, k] with T={t} (x's tokens), got shape "
                     f"{expert_indices.shape}")
  k = expert_indices.shape[1]
  _checks.shape_of("expert_weights", expert_weights)
  _checks.float_dtype("expert_weights", expert_weights)
  _checks.expect_shape("expert_weights", expert_weights, (t, k))
  epilogue.check(activation, glu)
  for name, w in (("w_up", w_up), ("w_down", w_down)):
    _checks.shape_of(name, w, 3)
    _checks.float_dtype(name, w)
    _checks.same_dtype(f"x, {name}", x, w)
  e, up_d, columns = w_up.shape
  if e < 1 or up_d != d:
    raise ValueError(f"w_up: expected [E, D, {'2F' if glu else 'F'}] with E >= 1 and "
                     f"D={d} (x's last dim), got shape {w_up.shape}")
  f = epilogue.out_columns("w_up", columns, glu)
  _checks.expect_shape("w_down", w_down, (e, f, d))
  call = MoeCall(tokens=t, top_k=k, d=d, f=f, experts=e, dtype=jnp.dtype(x.dtype).name,
                 weights_dtype=jnp.dtype(expert_weights.dtype).name, glu=glu,
                 activation=activation)
  inputs = MoeInputs(*_checks.arrays(x, expert_indices.astype(jnp.int32), expert_weights,
                                      w_up, w_down))
  return call, inputs


def moe_mlp(x, expert_indices, expert_weights, w_up, w_down, *, glu="swiglu",
            activation=None, implementation=None):
  """Dropless mixture-of-experts MLP.

  ``x [T, D]``, ``expert_indices [T, k]`` int32 in ``[0, E)``, ``expert_weights [T, k]``,
  ``w_up [E, D, 2F]`` (``[E, D, F]`` when ``glu`` is None), ``w_down [E, F, D]``:
  ``y_t = sum_j expert_weights[t,j] * (epi(x_t @ w_up[e]) @ w_down[e])``,
  ``e = expert_indices[t,j]``, where ``epi`` is the ``glu`` ("swiglu", "geglu", "reglu";
  ``activation`` must then be None) or, with ``glu=None``, ``activation`` (see
  ``cudnn_jax.gemm``). An out-of-range expert index contributes 0 (nothing is read or
  written out of bounds; under ``jax.experimental.checkify.checkify`` with user checks it
  raises an error naming ``expert_indices`` and the entry). Every token is served (no
  capacity limit); with k = 0 choices, ``y = 0``.

  Routing (a stable sort of the pairs by expert), both grouped GEMMs and the weighted
  combine run inside this one function, so it jits whole. Returns ``y [T, D]`` in x's
  dtype. Differentiable in x, expert_weights, w_up, w_down.

  Sharding: token-sharded inputs (on meshes of either axis type) route and run on each
  device's own tokens with no communication, and the output keeps their sharding; experts
  (``w_up``, ``w_down``) sharded explicitly along another axis run expert parallel, each
  shard serving its own experts for every token and the partial outputs summed over that
  axis.
  """
  call, inputs = _prepare(x, expert_indices, expert_weights, w_up, w_down, glu=glu,
                          activation=activation)
  _metadata.check_indices("expert_indices", inputs.expert_indices, call.experts)
  if call.top_k == 0 or call.tokens == 0:  # y = 0 (an empty sum) on every engine
    return jnp.zeros_like(inputs.x)
  tokens, experts = _explicit_axes(inputs.x), _explicit_axes(inputs.w_up)
  if experts is not None and not set(_names(experts)) & set(_names(tokens)):
    run = lambda call, inputs: engines.dispatch("moe_mlp", implementation, call, inputs)
    return _per_expert_shard(run, call, inputs, experts, tokens)
  engine = engines.choose("moe_mlp", call, implementation)
  return _moe_per_shard((engine.name, call), *inputs)[0]


def _run_engine(config, *arrays):
  name, call = config
  return (engines.engine("moe_mlp", name).run(call, MoeInputs(*arrays)),)


# Tokens are independent: token-sharded inputs route and run on each device's own tokens,
# with the whole expert weights (their gradients sum over the token shards).
_moe_per_shard = core.per_shard("moe_mlp", _run_engine, "t d, t j, t j, e d c, e f d -> t d",
                                shardable=("t",))


def _explicit_axes(a):
  """The mesh axes that shard ``a``'s first dimension explicitly (``AxisType.Explicit``),
  else None (x: the tokens; w_up: the experts)."""
  spec = jax.typeof(a).sharding.spec
  return spec[0] if spec and spec[0] is not None else None


def _names(axes):
  return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def _per_expert_shard(run, call, inputs, experts, tokens):
  """Expert parallelism: each shard of the experts serves every token's choices among its
  own experts (the others are out of its range, so they contribute 0 there) and the
  partial outputs are summed over the expert shards. Tokens stay sharded as they are."""
  mesh = jax.typeof(inputs.w_up).sharding.mesh
  size = math.prod(mesh.shape[a] for a in _names(experts))
  local = dataclasses.replace(call, experts=call.experts // size)

  def per_shard(x, indices, weights, w_up, w_down):
    first = jax.lax.axis_index(_names(experts)) * local.experts
    y = run(local, MoeInputs(x, indices - first, weights, w_up, w_down))
    return jax.lax.psum(y, _names(experts))

  token_spec, expert_spec = P(tokens), P(experts)
  specs = MoeInputs(token_spec, token_spec, token_spec, expert_spec, expert_spec)
  # check_vma=False: the grouped products' custom_vjps do not track which values vary
  # across shards; unchecked, the expert shards' cotangents of x sum, which is its gradient.
  shard_fn = jax.shard_map(per_shard, mesh=mesh, in_specs=tuple(specs), out_specs=token_spec,
                           check_vma=False)
  return shard_fn(*inputs)


def _run_xla(call: MoeCall, x: MoeInputs):
  return ref.moe_mlp(*x, glu=call.glu, activation=call.activation)


engines.register_op("moe_mlp", lambda *a, **kw: _prepare(*a, **kw)[0])
engines.register_engine("moe_mlp", "xla", supports=lambda call: None, run=_run_xla)


# GPU engines: the grouped GEMM engines of the same name run both projections, opt-in where
# those are ("cudnn"). "cute" serves by default: an H200 runs the forward+backward of T=16384
# D=4096 F=2048 E=64 top-4 in 30 ms; the same layer on lax.ragged_dot takes 916 ms with 0.95
# of the GPU's memory and runs out of it with JAX's default 0.75 (it asks for about 100 GiB).


def _projections(call: MoeCall):
  """The two grouped GEMMs of ``call`` as grouped_gemm calls (for their engines' checks)."""
  rows = call.tokens * call.top_k
  up = GroupedGemmCall(m=rows, k=call.d, n=call.f, groups=call.experts, dtype=call.dtype,
                       out_dtype=call.dtype, activation=call.activation, glu=call.glu)
  down = GroupedGemmCall(m=rows, k=call.f, n=call.d, groups=call.experts, dtype=call.dtype,
                         out_dtype=call.dtype)
  return up, down


def _moe_on(grouped, call: MoeCall, x: MoeInputs):
  """``moe_mlp`` with both projections on ``grouped`` (a GPU engine's grouped GEMM)."""
  order, group_sizes, valid = ref.route(x.expert_indices, call.experts)
  rows = x.x[order // call.top_k]
  hidden = grouped(rows, x.w_up, group_sizes, activation=call.activation, glu=call.glu)
  out_rows = grouped(hidden.astype(x.x.dtype), x.w_down, group_sizes)
  return ref.combine(out_rows, order, valid, x.expert_weights).astype(x.x.dtype)


def _register_gpu_engine(name):
  grouped = engines.engine("grouped_gemm", name)

  def supports(call: MoeCall):
    up, down = _projections(call)
    return grouped.supports(up) or grouped.supports(down)

  engines.register_engine("moe_mlp", name, supports=supports, opt_in=grouped.opt_in,
                          run=functools.partial(_moe_on, grouped_gemms[name]))


for _name in ("cudnn", "cute"):
  _register_gpu_engine(_name)
