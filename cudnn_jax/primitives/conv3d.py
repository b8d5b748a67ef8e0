"""conv3d's cuDNN graphs as JAX primitives (``core.define``: batching, partitioning, CPU
emulation). The filter is ``w [K, kt, kh, kw, C]`` (input channels fastest: the layout
cuDNN reads beside channels-last activations).

- ``forward(config, x [N,T,H,W,C], w, [bias [K] f32], [residual [N,T',H',W',K]]) -> (y,
  [sumsq])``: ``y = act(conv(x, w) + bias + residual)`` in ``config.out_dtype``, and with
  ``config.with_sumsq`` ``sumsq [N,T',H',W'] f32 = sum_k y^2``.
- ``dgrad(config, dy [N,T',H',W',K], w) -> (dx [N,T,H,W,C],)``: the transposed convolution.
- ``wgrad(config, x [G,N,...], dy [G,N,...]) -> (dw [G,K,kt,kh,kw,C],)``: one weight
  gradient per group G (1, or the size of a vmap), summed over the group's pixels.

On NVIDIA GPUs they lower to the handlers of ffi/conv3d_cudnn.cc; elsewhere to the same
contracts in plain JAX. Batch-sharded operands are computed locally (the weight gradient's
shards are summed).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from cudnn_jax.primitives import _common, core
from cudnn_jax.reference import conv3d as ref

_AXES = ("t", "h", "w")


@dataclasses.dataclass(frozen=True)
class Conv3dConfig:
  """A conv3d call's static facts: the handlers' attributes (``attributes()``), and the
  shapes they cannot read from their operands."""
  padding: tuple  # ((lo, hi),) * 3
  strides: tuple
  dilation: tuple
  x_spatial: tuple  # (T, H, W) of x: dgrad's result
  kernel: tuple  # (kt, kh, kw): wgrad's result
  activation: str = "none"  # or a key of reference.conv3d.ACTIVATIONS
  has_bias: bool = False
  has_residual: bool = False
  with_sumsq: bool = False
  out_dtype: str = "bfloat16"  # the forward's y

  def attributes(self) -> dict:
    """The FFI attributes, named and typed as the handlers bind them."""
    out = {f"pad_{a}_{side}": np.int32(p) for a, pair in zip(_AXES, self.padding)
           for side, p in zip(("lo", "hi"), pair)}
    out.update({f"stride_{a}": np.int32(s) for a, s in zip(_AXES, self.strides)})
    out.update({f"dilation_{a}": np.int32(d) for a, d in zip(_AXES, self.dilation)})
    return dict(out, activation=self.activation, has_bias=self.has_bias,
                has_residual=self.has_residual, with_sumsq=self.with_sumsq)

  def check_config(self, pass_, *, dtype, n, c, k, out_spatial, residual_dtype=None) -> dict:
    """The dict ``cudnn_jax._ffi.conv3d_check`` takes for ``pass_`` ("forward", "dgrad",
    "wgrad"): the attributes, dtypes and shapes."""
    extents = zip(("t", "h", "w", "kt", "kh", "kw", "ot", "oh", "ow"),
                  self.x_spatial + self.kernel + tuple(out_spatial))
    return dict(self.attributes(), **dict(extents), n=n, c=c, k=k, dtype=dtype,
                out_dtype=self.out_dtype, residual_dtype=residual_dtype or dtype,
                **{"pass": pass_})


# ---------------------------------------------------------------------------------------
# The handlers' contracts in plain JAX.


def _conv(config, x, w):
  """Float32 ``conv(x, w)`` with ``w [K, kt, kh, kw, C]``."""
  return jax.lax.conv_general_dilated(
      x.astype(jnp.float32), w.astype(jnp.float32), window_strides=config.strides,
      padding=config.padding, rhs_dilation=config.dilation,
      dimension_numbers=("NDHWC", "ODHWI", "NDHWC"), precision=jax.lax.Precision.HIGHEST)


def _tail(config, extras):
  extras = list(extras)
  bias = extras.pop(0) if config.has_bias else None
  residual = extras.pop(0) if config.has_residual else None
  return bias, residual


def _forward_emulated(config, x, w, *extras):
  bias, residual = _tail(config, extras)
  y = _conv(config, x, w)
  if bias is not None:
    y = y + bias
  if residual is not None:
    y = y + residual.astype(jnp.float32)
  if config.activation != "none":
    y = ref.ACTIVATIONS[config.activation](y)
  sumsq = (jnp.sum(y * y, axis=-1),) if config.with_sumsq else ()
  return (y.astype(config.out_dtype),) + sumsq


def _dgrad_emulated(config, dy, w):
  x = jax.ShapeDtypeStruct((dy.shape[0],) + config.x_spatial + (w.shape[-1],), jnp.float32)
  (dx,) = jax.linear_transpose(lambda x: _conv(config, x, w), x)(dy.astype(jnp.float32))
  return (dx.astype(dy.dtype),)


def _wgrad_emulated(config, x, dy):
  def one(x, dy):
    w = jax.ShapeDtypeStruct(_filter_shape(config, x, dy), jnp.float32)
    (dw,) = jax.linear_transpose(lambda w: _conv(config, x, w), w)(dy.astype(jnp.float32))
    return dw
  return (jax.vmap(one)(x, dy).astype(x.dtype),)


def _filter_shape(config, x, dy):
  return (dy.shape[-1],) + config.kernel + (x.shape[-1],)


# ---------------------------------------------------------------------------------------
# The handlers' calls.


def _workspace(config, pass_, x_shape, y_shape, dtype, residual_dtype=None):
  from cudnn_jax import _extension  # pylint: disable=g-import-not-at-top
  query = config.check_config(pass_, dtype=jnp.dtype(dtype).name, n=x_shape[0], c=x_shape[-1],
                              k=y_shape[-1], out_spatial=y_shape[1:4],
                              residual_dtype=residual_dtype)
  return _common.workspace_result(_extension.module().conv3d_workspace(query))


def _forward_ffi(config, x, w, *extras):
  y, *sumsq = (_common.with_shape(a) for a in forward.abstract(config, x, w, *extras))
  _, residual = _tail(config, extras)
  residual_dtype = None if residual is None else jnp.dtype(residual.dtype).name
  workspace = _workspace(config, "forward", x.shape, y.shape, x.dtype, residual_dtype)
  y, _, *sumsq = jax.ffi.ffi_call("cudnn_jax_conv3d_fwd", (y, workspace, *sumsq))(
      x, w, *extras, **config.attributes())
  return (y, *sumsq)


def _dgrad_ffi(config, dy, w):
  (dx,) = (_common.with_shape(a) for a in dgrad.abstract(config, dy, w))
  workspace = _workspace(config, "dgrad", dx.shape, dy.shape, dy.dtype)
  dx, _ = jax.ffi.ffi_call("cudnn_jax_conv3d_dgrad", (dx, workspace))(
      dy, w, **config.attributes())
  return (dx,)


def _wgrad_ffi(config, x, dy):
  dw_shape = _filter_shape(config, x, dy)
  workspace = _workspace(config, "wgrad", x.shape[1:], dy.shape[1:], x.dtype)
  call = jax.ffi.ffi_call("cudnn_jax_conv3d_wgrad",
                          (jax.ShapeDtypeStruct(dw_shape, x.dtype), workspace))
  # One handler call per group: G is 1 unless the weight gradient itself is vmapped.
  return (jnp.stack([call(x[g], dy[g], **config.attributes())[0] for g in range(x.shape[0])]),)


# Factors: n batch, (t h w) x's spatial dims, (p q r) y's, (a e f) the kernel's taps, c and
# k the input and output channels. Only the batch is ever sharded.
def _forward_rule(config, *shapes):
  del shapes
  operands = ["n t h w c", "k a e f c"] + ["k"] * config.has_bias
  operands += ["n p q r k"] * config.has_residual
  return ", ".join(operands) + " -> n p q r k" + ", n p q r" * config.with_sumsq


forward = core.define("cudnn_jax_conv3d_fwd", impl=_forward_emulated, cuda=_forward_ffi,
                      rule=_forward_rule, shardable=("n",), broadcast_leads=False)
dgrad = core.define("cudnn_jax_conv3d_dgrad", impl=_dgrad_emulated, cuda=_dgrad_ffi,
                    rule="n p q r k, k a e f c -> n t h w c", shardable=("n",),
                    broadcast_leads=False)
wgrad = core.define("cudnn_jax_conv3d_wgrad", impl=_wgrad_emulated, cuda=_wgrad_ffi,
                    rule="g n t h w c, g n p q r k -> g k a e f c", shardable=("g", "n"),
                    broadcast_leads=False)
