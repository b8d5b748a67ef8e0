"""One way for every engine to reach XLA: a primitive that computes on each device's shard.

An op's local computation is declared once, by an einsum-like ``rule`` over its arrays
(``"b t n h, b s k h, b s k d -> b t n d, b n t"``: one term per operand, then per result)
and the factors that may stay sharded (``shardable``: the batch, the heads; a tuple of
factors is sharded together, e.g. query heads and kv heads). From that:

- ``define`` makes a primitive whose abstract eval is its ``impl`` traced on shapes; whose
  lowering is ``cuda`` (an FFI call) on NVIDIA GPUs and ``impl`` (plain JAX: the handler's
  contract emulated, or the computation itself) everywhere else; whose batching rule folds a
  vmapped axis into the batch factor (no loop); and which, on a device mesh, is custom
  partitioned: shardable factors stay sharded and every other factor is whole on each device,
  with a Shardy rule from the same ``rule``. On meshes with explicitly typed axes the call
  runs under ``auto_axes`` with the result shardings the rule gives, so it keeps its sharding
  there too.
- ``per_shard`` wraps a differentiable pure-JAX computation: on one device it is called as
  it is; on a mesh it runs as a primitive per shard, differentiated by a second primitive
  (its VJP, recomputed per shard). Where a result lacks a factor its operands are sharded on
  (a weight's gradient over batch shards), the shards' results are summed.

No ``jax.ffi.ffi_call`` happens outside this package.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend import core as jex_core
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding, PartitionSpec as P
from jax._src import dispatch as jax_dispatch  # pylint: disable=g-bad-import-order


# ---------------------------------------------------------------------------------------
# Rules.


@dataclasses.dataclass(frozen=True)
class Rule:
  """Factor names of every operand and result dim, and the factors that may stay sharded."""
  operands: tuple[tuple[str, ...], ...]
  results: tuple[tuple[str, ...], ...]
  shardable: tuple[tuple[str, ...], ...]  # groups of factors sharded together

  @classmethod
  def parse(cls, text: str, shardable) -> Rule:
    lhs, rhs = text.split("->")
    terms = lambda side: tuple(tuple(t.split()) for t in side.split(","))
    groups = tuple((g,) if isinstance(g, str) else tuple(g) for g in shardable)
    return cls(terms(lhs), terms(rhs), groups)

  @property
  def batch(self) -> str:
    return self.operands[0][0]

  def text(self) -> str:
    join = lambda terms: ", ".join(" ".join(t) for t in terms)
    return f"{join(self.operands)} -> {join(self.results)}"

  def whole(self) -> tuple[str, ...]:
    """Factors that are never sharded, in order of first appearance."""
    free = {f for g in self.shardable for f in g}
    seen = []
    for f in (f for t in self.operands + self.results for f in t):
      if f not in free and f not in seen:
        seen.append(f)
    return tuple(seen)

  def assign(self, mesh_shape, operand_shapes, operand_specs, result_shapes):
    """Mesh axes for each shardable factor: those of the first operand dim that is sharded
    along it, kept where they divide every dim of the group and no other group uses them."""
    axes_of, used = {}, set()
    for group in self.shardable:
      axes = ()
      for term, spec in zip(self.operands, operand_specs):
        for dim, factor in enumerate(term):
          if factor in group and not axes:
            axes = _spec_axes(spec, dim)
      size = math.prod(mesh_shape[a] for a in axes)
      dims = [shape[i] for terms, shapes in ((self.operands, operand_shapes),
                                             (self.results, result_shapes))
              for term, shape in zip(terms, shapes)
              for i, f in enumerate(term) if f in group]
      if any(d % size for d in dims) or set(axes) & used:
        axes = ()
      used |= set(axes)
      for f in group:
        axes_of[f] = axes
    return axes_of

  def specs(self, terms, axes_of):
    return tuple(P(*[_entry(axes_of.get(f, ())) for f in term]) for term in terms)

  def reductions(self, axes_of):
    """Per result: the mesh axes its operands are sharded on but it is not (summed)."""
    sharded = {a for t in self.operands for f in t for a in axes_of.get(f, ())}
    return tuple(tuple(sorted(sharded - {a for f in t for a in axes_of.get(f, ())}))
                 for t in self.results)


def _entry(axes):
  return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def _spec_axes(spec, dim):
  """The mesh axes (a tuple, maybe empty) of dimension ``dim`` in PartitionSpec ``spec``."""
  if spec is None or dim >= len(spec) or spec[dim] is None:
    return ()
  entry = spec[dim]
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _sharding_spec(sharding):
  return sharding.spec if isinstance(sharding, NamedSharding) else None


# ---------------------------------------------------------------------------------------
# Primitives.


class Local:
  """A primitive computed on each device's shard; ``local(config, *arrays)`` binds it."""

  def __init__(self, name, *, impl, rule, shardable, cuda=None, broadcast_leads=True):
    self.name, self.impl, self.cuda = name, impl, cuda
    self._broadcast_leads = broadcast_leads
    self._rule, self._shardable = rule, shardable
    self.p = jex_core.Primitive(name)
    self.p.multiple_results = True
    self.p.def_impl(functools.partial(jax_dispatch.apply_primitive, self.p))
    self.p.def_abstract_eval(self._abstract)
    # Lowered through custom_partitioning on a mesh, which needs the devices.
    jax_dispatch.prim_requires_devices_during_lowering.add(self.p)
    batching.primitive_batchers[self.p] = self._batch
    for platform, fn in (("cuda", cuda or impl), ("cpu", impl), ("rocm", impl), ("tpu", impl)):
      mlir.register_lowering(self.p, self._lowering(fn), platform=platform)

  def rule(self, config, *shapes) -> Rule:
    text = self._rule(config, *shapes) if callable(self._rule) else self._rule
    return Rule.parse(text, self._shardable)

  def __call__(self, config, *arrays):
    arrays = [jnp.asarray(a) for a in arrays]
    mesh = explicit_mesh(arrays)
    partition = not exporting()
    if mesh is None:
      return tuple(self.p.bind(*arrays, config=config, partition=partition))
    # Explicit axes: run with automatic axes inside, and type the results as the rule says.
    shapes = [a.shape for a in arrays]
    rule = self.rule(config, *shapes)
    results = self._abstract(*arrays, config=config)
    specs = [jax.typeof(a).sharding.spec for a in arrays]
    axes_of = rule.assign(mesh.shape, shapes, specs, [r.shape for r in results])
    out = rule.specs(rule.results, axes_of)
    run = lambda *a: tuple(self.p.bind(*a, config=config, partition=partition))
    return jax.sharding.auto_axes(run, out_sharding=out)(*arrays)

  @functools.lru_cache(maxsize=4096)
  def _abstract_of(self, config, avals):
    structs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in avals]
    out = jax.eval_shape(functools.partial(self.impl, config), *structs)
    return tuple(jax.core.ShapedArray(o.shape, o.dtype) for o in out)

  def abstract(self, config, *arrays):
    """The results' shapes and dtypes for these operands (anything with shape and dtype)."""
    return self._abstract(*arrays, config=config)

  def _abstract(self, *avals, config, partition=True):
    del partition
    return self._abstract_of(config, tuple((tuple(a.shape), jnp.dtype(a.dtype)) for a in avals))

  def _lowering(self, fn):
    def lowering(ctx, *args, config, partition=True):
      devices = getattr(ctx.module_context.axis_context, "device_assignment", None)
      # Traced under ``exporting()``: no custom_partitioning (its Python callback cannot be
      # serialized); the SPMD partitioner then partitions ``fn`` like any other code.
      many = devices and len(devices) > 1 and partition
      run = self._partitioned(fn) if many else fn
      # ``fn`` computes on plain local arrays: traced without the operands' mesh types.
      with _no_mesh():
        plain = lambda avals: [jax.core.ShapedArray(a.shape, a.dtype) for a in avals]
        ctx = ctx.replace(avals_in=plain(ctx.avals_in), avals_out=plain(ctx.avals_out))
        return mlir.lower_fun(lambda *a: run(config, *a), multiple_results=True)(ctx, *args)
    return lowering

  @functools.lru_cache(maxsize=None)  # pylint: disable=method-cache-max-size-none
  def _partitioned(self, fn):
    def partition(config, mesh, arg_shapes, result_shape):
      rule = self.rule(config, *[a.shape for a in arg_shapes])
      results = jax.tree.leaves(result_shape)
      axes_of = rule.assign(mesh.shape, [a.shape for a in arg_shapes],
                            [_sharding_spec(a.sharding) for a in arg_shapes],
                            [r.shape for r in results])
      named = lambda specs: tuple(NamedSharding(mesh, s) for s in specs)
      sums = rule.reductions(axes_of)

      def local(*args):
        # Traced at compile time, maybe inside the caller's jax.set_mesh: the shards are
        # plain arrays here, with no mesh of their own.
        with _no_mesh():
          outs = fn(config, *args)
          return tuple(jax.lax.psum(o, s) if s else o for o, s in zip(outs, sums))

      return (mesh, local, named(rule.specs(rule.results, axes_of)),
              named(rule.specs(rule.operands, axes_of)))

    def sharding_rule(config, mesh, arg_types, result_types):
      del mesh, result_types
      rule = self.rule(config, *[tuple(t.shape) for t in arg_types])
      summed = tuple(f for g in rule.shardable for f in g
                     if any(f in t for t in rule.operands)
                     and not any(f in t for t in rule.results))
      return rule.text(), dict(need_replication_factors=rule.whole(),
                               reduction_factors=summed)

    partitioned = custom_partitioning(fn, static_argnums=(0,))
    partitioned.def_partition(partition=partition, sharding_rule=sharding_rule)
    return partitioned

  def _batch(self, args, dims, *, config, partition=True):
    """Folds the vmapped axis into the batch factor of every operand that has it."""
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    unbatched = [x.shape if d is None else x.shape[:d] + x.shape[d + 1:]
                 for x, d in zip(args, dims)]
    rule = self.rule(config, *unbatched)
    batch = rule.batch
    batch_size = unbatched[0][0]
    # A leading factor of size 1 that also leads a result (a broadcast batch whose result,
    # like a bias gradient, differs between the vmapped calls) is broadcast to the batch.
    leads = {t[0] for t in rule.results if t}
    folded = []
    for x, d, shape, term in zip(args, dims, unbatched, rule.operands):
      lead = term[0] if term else None
      if lead == batch or (self._broadcast_leads and lead is not None and shape[0] == 1 and
                           (d is not None or lead in leads)):
        x = _move_to_front(x, d, size)
        x = jnp.broadcast_to(x, (size, batch_size) + shape[1:])
        folded.append(x.reshape((size * batch_size,) + shape[1:]))
      elif d is None:
        folded.append(x)
      else:
        # No batch factor to fold into (a vmapped weight): vmap the plain-JAX contract
        # itself, which XLA compiles on any backend; correct, without the handler.
        outs = jax.vmap(functools.partial(self.impl, config), in_axes=tuple(dims))(*args)
        return tuple(outs), (0,) * len(outs)
    outs = self.p.bind(*folded, config=config, partition=partition)
    want = self._abstract(*[jax.core.ShapedArray(s, x.dtype) for s, x in zip(unbatched, args)],
                          config=config)
    results, out_dims = [], []
    for o, w, term in zip(outs, want, self.rule(config, *[x.shape for x in folded]).results):
      if not term or term[0] != batch:
        results.append(o)
        out_dims.append(None)
        continue
      o = o.reshape((size, o.shape[0] // size) + o.shape[1:])
      if w.shape[0] != o.shape[1]:  # a broadcast batch: its results sum
        o = o.sum(axis=1, keepdims=True).astype(o.dtype)
      results.append(o)
      out_dims.append(0)
    return tuple(results), tuple(out_dims)


_EXPORTING = [0]


@contextlib.contextmanager
def exporting_scope():
  """Inside it, primitives bind for ``jax.export``: see ``cudnn_jax.export``."""
  _EXPORTING[0] += 1
  try:
    yield
  finally:
    _EXPORTING[0] -= 1


def exporting() -> bool:
  return _EXPORTING[0] > 0


def define(name, *, impl, rule, shardable, cuda=None, broadcast_leads=True) -> Local:
  """A primitive computed per shard; see the module docstring. ``impl(config, *arrays)`` and
  ``cuda(config, *arrays)`` return tuples of arrays with equal shapes and dtypes. Under
  vmap an operand led by a dim of 1 counts as a batch shared by every batch entry (a
  grouped product's weights) unless ``broadcast_leads`` is False; then only operands led
  by the batch factor fold into it."""
  return Local(name, impl=impl, rule=rule, shardable=shardable, cuda=cuda,
               broadcast_leads=broadcast_leads)


def _move_to_front(x, bdim, size):
  """x with its vmapped axis first; an unbatched x is broadcast to ``size`` copies."""
  if bdim is None:
    return jnp.broadcast_to(x, (size,) + x.shape)
  return jnp.moveaxis(x, bdim, 0)


# ---------------------------------------------------------------------------------------
# Meshes.


def _meshes(arrays):
  yield jax.sharding.get_abstract_mesh()
  for a in arrays:
    yield jax.typeof(a).sharding.mesh


def _no_mesh():
  return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ()))


def explicit_mesh(arrays):
  """The mesh with explicitly typed axes the arrays (or jax.set_mesh) live on, else None."""
  for mesh in _meshes(arrays):
    if not mesh.empty and mesh._any_axis_explicit:  # pylint: disable=protected-access
      return mesh
  return None


def on_mesh(arrays) -> bool:
  """Whether the arrays are traced on a mesh of several devices (or inside one set by
  jax.set_mesh)."""
  return any(not m.empty and m.size > 1 for m in _meshes(arrays))


# ---------------------------------------------------------------------------------------
# Differentiable pure-JAX computations per shard.


def _is_float(x):
  return jnp.issubdtype(x.dtype, jnp.inexact)


def per_shard(name, impl: Callable, rule, *, shardable) -> Callable:
  """``run(config, *arrays)``: ``impl(config, *arrays)`` (a tuple of arrays), computed on
  each device's shard when the arrays are on a mesh; differentiable in its float arrays."""
  fwd = define(f"cudnn_jax_{name}", impl=impl, rule=rule, shardable=shardable)

  # The backward primitive's config: (the op's config, the float operands' positions,
  # the operand count); its operands: the op's operands, then the results' cotangents.
  def vjp_impl(config, *args):
    inner, floats, n = config
    primals, cts = args[:n], args[n:]

    def f(*xs):
      full = list(primals)
      for i, x in zip(floats, xs):
        full[i] = x
      return tuple(impl(inner, *full))

    _, pull = jax.vjp(f, *[primals[i] for i in floats])
    return tuple(pull(tuple(cts)))

  def vjp_rule(config, *shapes):
    inner, floats, n = config
    r = fwd.rule(inner, *shapes[:n])
    join = lambda terms: ", ".join(" ".join(t) for t in terms)
    return f"{join(r.operands + r.results)} -> {join([r.operands[i] for i in floats])}"

  bwd = define(f"cudnn_jax_{name}_vjp", impl=vjp_impl, rule=vjp_rule, shardable=shardable)

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
  def on_shards(config, *arrays):
    return fwd(config, *arrays)

  def on_shards_fwd(config, *arrays):
    return on_shards(config, *arrays), arrays

  def on_shards_bwd(config, arrays, cts):
    floats = tuple(i for i, x in enumerate(arrays) if _is_float(x))
    grads = iter(bwd((config, floats, len(arrays)), *arrays, *cts))
    return tuple(next(grads) if i in floats else np.zeros(x.shape, jax.dtypes.float0)
                 for i, x in enumerate(arrays))

  on_shards.defvjp(on_shards_fwd, on_shards_bwd)

  def run(config, *arrays):
    arrays = [jnp.asarray(a) for a in arrays]
    if not on_mesh(arrays):
      return tuple(impl(config, *arrays))
    return on_shards(config, *arrays)

  return run
