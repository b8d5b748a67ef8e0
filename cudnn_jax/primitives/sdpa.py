"""cuDNN SDPA as JAX primitives (``core.define``: batching, partitioning, CPU emulation).

``sdpa_fwd``: (q [B,T,N,H], k [B,S,K,H], v [B,S,K,Hv], [bias [Bb,Nb,T,S]],
[q_lens [B], kv_lens [B]]) -> (out [B,T,N,Hv], lse [B,N,T] f32), lse only with
``config.with_lse``.
``sdpa_bwd``: (q, k, v, out, dout, lse, [bias], [q_lens, kv_lens]) -> (dq, dk, dv, [dbias]).

On NVIDIA GPUs they lower to the handlers of ffi/sdpa_cudnn.cc; elsewhere to the same
contract in plain JAX, so their batching, partitioning and differentiation run on any
backend. Batch- and head-sharded operands are computed locally.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from cudnn_jax.primitives import _common, core

# Field annotation (a string under postponed evaluation) -> the FFI attribute type.
_FFI_TYPES = {"float": np.float32, "bool": np.bool_, "int": np.int32}


@dataclasses.dataclass(frozen=True)
class SdpaConfig:
  """The attributes of the SDPA handlers, both of which take all of them (ffi/README.md)."""
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

  def attributes(self) -> dict:
    """The FFI attributes, typed as the handlers bind them."""
    return {f.name: _FFI_TYPES[f.type](getattr(self, f.name)) for f in dataclasses.fields(self)}

  def check_config(self, *, backward, dtype, b, t, s, n, k, h, hv, bias_shape) -> dict:
    """The dict ``cudnn_jax._ffi.sdpa_check`` takes: the attributes and the shapes."""
    bias_b, bias_n = (bias_shape[0], bias_shape[1]) if self.has_bias else (0, 0)
    return dict(self.attributes(), backward=backward, dtype=dtype, b=b, t=t, s=s, n=n, k=k,
                h=h, hv=hv, bias_b=bias_b, bias_n=bias_n)


# ---------------------------------------------------------------------------------------
# The handlers' calls (cuda) and their contract in plain JAX (everywhere else).


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
               for a in _fwd.abstract(config, q, k, v, *extras))
  out_types = (out, _workspace(config, False, q, k, v, extras), *lse)
  out, _, *lse = jax.ffi.ffi_call("cudnn_jax_sdpa_fwd", out_types)(
      q, k, v, *extras, **config.attributes())
  return (out, *lse)


def _bwd_ffi(config, q, k, v, out, dout, lse, *extras):
  out_types = [_common.with_shape(q), _common.with_shape(k), _common.with_shape(v),
               _workspace(config, True, q, k, v, extras)]
  if config.has_dbias:
    out_types.append(_common.with_shape(extras[0]))
  dq, dk, dv, _, *dbias = jax.ffi.ffi_call("cudnn_jax_sdpa_bwd", tuple(out_types))(
      q, k, v, out, dout, lse, *extras, **config.attributes())
  return (dq, dk, dv, *dbias)


def _split_extras(config, extras):
  extras = list(extras)
  bias = extras.pop(0) if config.has_bias else None
  q_lens, kv_lens = extras if config.has_padding else (None, None)
  return bias, q_lens, kv_lens


def _fwd_emulated(config, q, k, v, *extras):
  out_lse = _reference(config, q, k, v, *_split_extras(config, extras))
  return tuple(out_lse)[:1 + config.with_lse]


def _bwd_emulated(config, q, k, v, out, dout, lse, *extras):
  del out, lse
  bias, q_lens, kv_lens = _split_extras(config, extras)
  _, vjp = jax.vjp(lambda q, k, v, bias: _reference(config, q, k, v, bias, q_lens, kv_lens)[0],
                   q, k, v, bias)
  dq, dk, dv, dbias = vjp(dout)
  return (dq, dk, dv) + ((dbias,) if config.has_dbias else ())


def _rule(backward, config, *shapes):
  """Batch and heads stay local; sequence and feature dims are whole on each device."""
  extras = []
  if config.has_bias:
    bb, nb = shapes[6 if backward else 3][:2]
    extras.append(f"{'b' if bb > 1 else 'bb'} {'n' if nb > 1 else 'nb'} t s")
  if config.has_padding:
    extras += ["b", "b"]
  qkv = ["b t n h", "b s k h", "b s k d"]
  if backward:
    operands = qkv + ["b t n d", "b t n d", "b n t"] + extras
    results = qkv + (extras[:1] if config.has_dbias else [])
  else:
    operands, results = qkv + extras, ["b t n d", "b n t"][:1 + config.with_lse]
  return ", ".join(operands) + " -> " + ", ".join(results)


_SHARDABLE = ("b", ("n", "k"))
_fwd = core.define("cudnn_jax_sdpa_fwd", impl=_fwd_emulated, cuda=_fwd_ffi, shardable=_SHARDABLE,
                   rule=functools.partial(_rule, False))
_bwd = core.define("cudnn_jax_sdpa_bwd", impl=_bwd_emulated, cuda=_bwd_ffi, shardable=_SHARDABLE,
                   rule=functools.partial(_rule, True))


def _extras(bias, q_lens, kv_lens):
  return ([] if bias is None else [bias]) + ([] if q_lens is None else [q_lens, kv_lens])


def sdpa_fwd(config, q, k, v, bias=None, q_lens=None, kv_lens=None):
  return _fwd(config, q, k, v, *_extras(bias, q_lens, kv_lens))


def sdpa_bwd(config, q, k, v, out, dout, lse, bias=None, q_lens=None, kv_lens=None):
  return _bwd(config, q, k, v, out, dout, lse, *_extras(bias, q_lens, kv_lens))


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
