"""cuDNN SDPA as JAX primitives.

``sdpa_fwd_p``: (q [B,T,N,H], k [B,S,K,H], v [B,S,K,Hv], [bias [Bb,Nb,T,S]],
[q_lens [B], kv_lens [B]]) -> (out [B,T,N,Hv], lse [B,N,T] f32), lse only with
``config.with_lse``.
``sdpa_bwd_p``: (q, k, v, out, dout, lse, [bias], [q_lens, kv_lens]) ->
(dq, dk, dv, [dbias]).

Each primitive has an abstract eval, a batching rule that folds vmapped axes into the batch,
and a lowering through a custom-partitioned FFI call: batch- and head-sharded operands are
computed locally with no communication.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend import core as jex_core
from jax._src import dispatch as jax_dispatch
from jax.interpreters import batching, mlir

from cudnn_jax.primitives import _common


@dataclasses.dataclass(frozen=True)
class SdpaConfig:
  """Static attributes of one cuDNN SDPA call (the FFI handler's attributes)."""
  scale: float
  causal: bool = False
  bottom_right: bool = False
  window_left: int = -1  # -1: unbounded
  window_right: int = -1
  softcap: float = 0.0  # 0: off
  has_bias: bool = False
  has_padding: bool = False
  has_dbias: bool = False  # backward: produce the bias gradient
  # Forward: also produce lse. Without it cuDNN runs its inference graph (no stats).
  with_lse: bool = True

  def ffi_attrs(self, backward: bool) -> dict:
    attrs = dict(scale=np.float32(self.scale), causal=np.bool_(self.causal),
                 bottom_right=np.bool_(self.bottom_right),
                 window_left=np.int32(self.window_left),
                 window_right=np.int32(self.window_right), softcap=np.float32(self.softcap),
                 has_bias=np.bool_(self.has_bias), has_padding=np.bool_(self.has_padding))
    if backward:
      attrs["has_dbias"] = np.bool_(self.has_dbias)
    else:
      attrs["with_lse"] = np.bool_(self.with_lse)
    return attrs

  def check_config(self, *, backward, dtype, b, t, s, n, k, h, hv, bias_shape) -> dict:
    """The dict ``cudnn_jax._ffi.sdpa_check`` takes (see ffi/README.md)."""
    bias_b, bias_n = (bias_shape[0], bias_shape[1]) if self.has_bias else (0, 0)
    return dict(self.ffi_attrs(backward=True), with_lse=self.with_lse or backward,
                backward=backward, dtype=dtype, b=b, t=t,
                s=s, n=n, k=k, h=h, hv=hv, bias_b=bias_b, bias_n=bias_n)


# ---------------------------------------------------------------------------------------
# FFI calls, custom-partitioned.


def _workspace(config, backward, q, k, v, extras):
  """The u8 workspace result the handler runs cuDNN in, sized for these (local) shapes."""
  from cudnn_jax import _extension  # pylint: disable=g-import-not-at-top
  b, t, n, h = q.shape
  query = config.check_config(
      backward=backward, dtype=jnp.dtype(q.dtype).name, b=b, t=t, s=k.shape[1], n=n,
      k=k.shape[2], h=h, hv=v.shape[3], bias_shape=extras[0].shape if config.has_bias else None)
  return _common.workspace_result(_extension.module().sdpa_workspace(query))


def _fwd_ffi(config, q, k, v, *extras):
  out, *lse = (jax.ShapeDtypeStruct(a.shape, a.dtype)
               for a in _fwd_abstract(q, k, v, config=config))
  out_types = (out, _workspace(config, False, q, k, v, extras), *lse)
  out, _, *lse = jax.ffi.ffi_call("cudnn_jax_sdpa_fwd", out_types)(
      q, k, v, *extras, **config.ffi_attrs(backward=False))
  return (out, *lse)


def _bwd_ffi(config, q, k, v, out, dout, lse, *extras):
  out_types = [_common.with_shape(q), _common.with_shape(k), _common.with_shape(v),
               _workspace(config, True, q, k, v, extras)]
  if config.has_dbias:
    out_types.append(_common.with_shape(extras[0]))
  dq, dk, dv, _, *dbias = jax.ffi.ffi_call("cudnn_jax_sdpa_bwd", tuple(out_types))(
      q, k, v, out, dout, lse, *extras, **config.ffi_attrs(backward=True))
  return (dq, dk, dv, *dbias)


def _operand_specs(config, mesh, q_sharding, shapes):
  """Per-operand shardings that keep batch and heads local; everything else replicated.

  ``shapes`` lists the operand shapes in the primitive's order (q, k, v first).
  """
  batch, heads = _common.batch_and_head_axes(mesh, q_sharding, shapes[0], shapes[1])
  bshd = _common.named(mesh, batch, (), heads, ())
  return batch, heads, bshd


def _extras_shardings(config, mesh, batch, heads, extra_shapes):
  out = []
  shapes = list(extra_shapes)
  if config.has_bias:
    bb, nb = shapes.pop(0)[:2]
    out.append(_common.named(mesh, batch if bb > 1 else (), heads if nb > 1 else (), (), ()))
  if config.has_padding:
    out += [_common.named(mesh, batch)] * 2
  return out


def _fwd_partition(impl, config, mesh, arg_shapes, result_shape):
  shapes = [a.shape for a in arg_shapes]
  batch, heads, bshd = _operand_specs(config, mesh, arg_shapes[0].sharding, shapes)
  args = [bshd, bshd, bshd] + _extras_shardings(config, mesh, batch, heads, shapes[3:])
  results = (bshd, _common.named(mesh, batch, heads, ()))[:1 + config.with_lse]
  return mesh, functools.partial(impl, config), results, tuple(args)


def _bwd_partition(impl, config, mesh, arg_shapes, result_shape):
  shapes = [a.shape for a in arg_shapes]
  batch, heads, bshd = _operand_specs(config, mesh, arg_shapes[0].sharding, shapes)
  lse = _common.named(mesh, batch, heads, ())
  extras = _extras_shardings(config, mesh, batch, heads, shapes[6:])
  args = [bshd] * 5 + [lse] + extras
  results = [bshd] * 3 + ([extras[0]] if config.has_dbias else [])
  return mesh, functools.partial(impl, config), tuple(results), tuple(args)


def _sharding_rule(backward, config, mesh, arg_types, result_types):
  """Einsum-like Shardy rule; sequence and feature dims stay whole (need replication)."""
  del mesh, result_types
  extras = []
  if config.has_bias:
    bb, nb = arg_types[6 if backward else 3].shape[:2]
    extras.append(f"{'b' if bb > 1 else 'bb'} {'n' if nb > 1 else 'nb'} t s")
  if config.has_padding:
    extras += ["b", "b"]
  qkv = ["b t n h", "b s k h", "b s k d"]
  if backward:
    operands = qkv + ["b t n d", "b t n d", "b n t"] + extras
    results = qkv + (extras[:1] if config.has_dbias else [])
  else:
    operands, results = qkv + extras, ["b t n d", "b n t"][:1 + config.with_lse]
  rule = ", ".join(operands) + " -> " + ", ".join(results)
  return _common.sharding_rule(rule, ("t", "s", "h", "d"))


def _partitioned(impl, partition, backward):
  fn = custom_partitioning(impl, static_argnums=(0,))
  fn.def_partition(
      partition=functools.partial(partition, impl),
      sharding_rule=functools.partial(_sharding_rule, backward))
  return fn


def _split_extras(config, extras):
  extras = list(extras)
  bias = extras.pop(0) if config.has_bias else None
  q_lens, kv_lens = extras if config.has_padding else (None, None)
  return bias, q_lens, kv_lens


def _fwd_emulated(config, q, k, v, *extras):
  """The forward in plain JAX: the primitive's lowering on platforms without cuDNN."""
  out_lse = _reference(config, q, k, v, *_split_extras(config, extras))
  return tuple(out_lse)[:1 + config.with_lse]


def _bwd_emulated(config, q, k, v, out, dout, lse, *extras):
  del out, lse
  bias, q_lens, kv_lens = _split_extras(config, extras)
  _, vjp = jax.vjp(lambda q, k, v, bias: _reference(config, q, k, v, bias, q_lens, kv_lens)[0],
                   q, k, v, bias)
  dq, dk, dv, dbias = vjp(dout)
  return (dq, dk, dv) + ((dbias,) if config.has_dbias else ())


def _register_lowering(prim, impl, partition, backward, platform):
  partitioned = _partitioned(impl, partition, backward)

  def lowering(ctx, *args, config):
    # A computation on one device (or not yet assigned to devices) has nothing to
    # partition; custom_partitioning cannot lower without a device assignment.
    devices = getattr(ctx.module_context.axis_context, "device_assignment", ())
    fn = impl if devices is None or len(devices) == 1 else partitioned
    return mlir.lower_fun(lambda *a: fn(config, *a), multiple_results=True)(ctx, *args)

  mlir.register_lowering(prim, lowering, platform=platform)


# ---------------------------------------------------------------------------------------
# Primitives.

sdpa_fwd_p = jex_core.Primitive("cudnn_jax_sdpa_fwd")
sdpa_fwd_p.multiple_results = True
sdpa_bwd_p = jex_core.Primitive("cudnn_jax_sdpa_bwd")
sdpa_bwd_p.multiple_results = True
for _p in (sdpa_fwd_p, sdpa_bwd_p):  # eager calls compile the primitive alone
  _p.def_impl(functools.partial(jax_dispatch.apply_primitive, _p))
  # Their lowering may be custom_partitioning's, which needs the devices: without this,
  # jit lowers them with no device assignment and they run unpartitioned (replicated).
  jax_dispatch.prim_requires_devices_during_lowering.add(_p)


@sdpa_fwd_p.def_abstract_eval
def _fwd_abstract(q, k, v, *extras, config):
  del extras
  b, t, n, _ = q.shape
  return (jax.core.ShapedArray((b, t, n, v.shape[-1]), q.dtype),
          jax.core.ShapedArray((b, n, t), jnp.float32))[:1 + config.with_lse]


@sdpa_bwd_p.def_abstract_eval
def _bwd_abstract(q, k, v, out, dout, lse, *extras, config):
  del out, dout, lse
  res = [jax.core.ShapedArray(x.shape, x.dtype) for x in (q, k, v)]
  if config.has_dbias:
    res.append(jax.core.ShapedArray(extras[0].shape, extras[0].dtype))
  return tuple(res)


_register_lowering(sdpa_fwd_p, _fwd_ffi, _fwd_partition, False, "cuda")
_register_lowering(sdpa_bwd_p, _bwd_ffi, _bwd_partition, True, "cuda")
# Elsewhere the same primitives lower to plain JAX, so their batching, partitioning and
# differentiation rules are exercised by the CPU tests.
_register_lowering(sdpa_fwd_p, _fwd_emulated, _fwd_partition, False, "cpu")
_register_lowering(sdpa_bwd_p, _bwd_emulated, _bwd_partition, True, "cpu")


def _fold_extras(config, extras, dims, size, batch):
  """Folds bias / lengths for a batch of ``size`` vmapped calls of batch ``batch``."""
  extras, dims = list(extras), list(dims)
  folded = []
  if config.has_bias:
    bias, bdim = extras.pop(0), dims.pop(0)
    if bdim is None and bias.shape[0] == 1:
      folded.append(bias)  # broadcasts over the folded batch as it did over the old one
    else:
      bias = _common.move_to_front(bias, bdim, size)
      bias = jnp.broadcast_to(bias, (size, batch) + bias.shape[2:])
      folded.append(bias.reshape((size * batch,) + bias.shape[2:]))
  for x, d in zip(extras, dims):  # lengths [B]
    folded.append(_common.fold(x, d, size))
  return folded


def _axis_size(args, dims):
  return next(x.shape[d] for x, d in zip(args, dims) if d is not None)


def _fwd_batch(args, dims, *, config):
  size = _axis_size(args, dims)
  q, k, v = (_common.fold(x, d, size) for x, d in zip(args[:3], dims[:3]))
  extras = _fold_extras(config, args[3:], dims[3:], size, q.shape[0] // size)
  res = sdpa_fwd_p.bind(q, k, v, *extras, config=config)
  return tuple(_common.unfold(x, size) for x in res), (0,) * len(res)


def _bwd_batch(args, dims, *, config):
  size = _axis_size(args, dims)
  folded = [_common.fold(x, d, size) for x, d in zip(args[:6], dims[:6])]
  batch = folded[0].shape[0] // size
  extras = _fold_extras(config, args[6:], dims[6:], size, batch)
  res = sdpa_bwd_p.bind(*folded, *extras, config=config)
  grads = [_common.unfold(x, size) for x in res[:3]]
  out_dims = [0, 0, 0]
  if config.has_dbias:
    bias, bdim = args[6], dims[6]
    dbias = res[3]
    if bdim is None and bias.shape[0] == 1:
      out_dims.append(None)  # already summed over every folded batch entry
    else:
      dbias = _common.unfold(dbias, size)
      if bdim is None:
        dbias, d = dbias.sum(0), None  # one bias shared by all vmapped calls
      else:
        d = 0
        if jnp.moveaxis(bias, bdim, 0).shape[1] == 1:
          dbias = dbias.sum(1, keepdims=True)  # it was broadcast over the batch
      out_dims.append(d)
    grads.append(dbias)
  return tuple(grads), tuple(out_dims)


batching.primitive_batchers[sdpa_fwd_p] = _fwd_batch
batching.primitive_batchers[sdpa_bwd_p] = _bwd_batch


def _extras(bias, q_lens, kv_lens):
  return ([] if bias is None else [bias]) + ([] if q_lens is None else [q_lens, kv_lens])


def sdpa_fwd(config, q, k, v, bias=None, q_lens=None, kv_lens=None):
  return sdpa_fwd_p.bind(q, k, v, *_extras(bias, q_lens, kv_lens), config=config)


def sdpa_bwd(config, q, k, v, out, dout, lse, bias=None, q_lens=None, kv_lens=None):
  return sdpa_bwd_p.bind(q, k, v, out, dout, lse, *_extras(bias, q_lens, kv_lens),
                         config=config)


# ---------------------------------------------------------------------------------------
# Differentiation: cuDNN backward for the cuDNN forward; the xla engine's VJP where the
# cuDNN backward cannot serve (its support check declines, or lse itself is differentiated).


def _reference(config, q, k, v, bias, q_lens, kv_lens):
  from cudnn_jax.reference import sdpa as ref  # pylint: disable=g-import-not-at-top
  left = None if config.window_left < 0 else config.window_left
  right = None if config.window_right < 0 else config.window_right
  return ref.sdpa(q, k, v, bias, scale=config.scale, is_causal=config.causal,
                  bottom_right=config.bottom_right,
                  window=None if left is None and right is None else (left, right),
                  query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens,
                  logits_soft_cap=config.softcap or None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def attention(config, backward_ok, q, k, v, bias, q_lens, kv_lens):
  """(out, lse) through cuDNN, or (out,) when ``config.with_lse`` is False; differentiable
  in q, k, v and bias.

  ``backward_ok``: a static callable returning None when the cuDNN backward serves this
  call, else the reason to fall back to the xla engine's VJP.
  """
  return tuple(sdpa_fwd(config, q, k, v, bias, q_lens, kv_lens))


def _attention_fwd(config, backward_ok, q, k, v, bias, q_lens, kv_lens):
  q, k, v, bias, q_lens, kv_lens = (
      getattr(x, "value", x) for x in (q, k, v, bias, q_lens, kv_lens))
  # The backward needs lse, so the forward always produces it.
  out, lse = sdpa_fwd(dataclasses.replace(config, with_lse=True), q, k, v, bias, q_lens,
                      kv_lens)
  return (out, lse)[:1 + config.with_lse], (q, k, v, bias, q_lens, kv_lens, out, lse)


def _attention_bwd(config, backward_ok, res, cts):
  q, k, v, bias, q_lens, kv_lens, out, lse = res
  dout, dlse = cts if config.with_lse else (cts[0], jax.custom_derivatives.SymbolicZero(
      jax.core.ShapedArray(lse.shape, lse.dtype)))
  zero_lens = (None if q_lens is None else
               tuple(np.zeros(x.shape, jax.dtypes.float0) for x in (q_lens, kv_lens)))
  if isinstance(dlse, jax.custom_derivatives.SymbolicZero) and backward_ok() is None:
    if isinstance(dout, jax.custom_derivatives.SymbolicZero):
      dout = jnp.zeros(dout.shape, dout.dtype)
    grads = sdpa_bwd(config, q, k, v, out, dout.astype(out.dtype), lse, bias, q_lens,
                     kv_lens)
    dbias = None
    if bias is not None:
      dbias = grads[3] if config.has_dbias else jnp.zeros_like(bias)
    return (*grads[:3], dbias) + (zero_lens or (None, None))
  dout, dlse = (jnp.zeros(c.shape, c.dtype) if isinstance(c, jax.custom_derivatives.SymbolicZero)
                else c for c in (dout, dlse))
  _, vjp = jax.vjp(lambda *a: _reference(config, *a, q_lens, kv_lens), q, k, v, bias)
  return tuple(vjp((dout, dlse))) + (zero_lens or (None, None))


attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)
