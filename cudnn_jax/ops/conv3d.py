"""Fused 3-D convolution for video VAE blocks: ``cudnn_jax.conv3d``.

``y = conv(x, w) + bias + residual``, then an optional norm over channels (``"rms"``,
``"l2"``) or channel groups (``"group"``), its scale and bias, and an activation; products
accumulate in float32 and the result is cast once to ``out_dtype``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cudnn_jax import _checks, _extension, engines
from cudnn_jax.primitives import conv3d as prim
from cudnn_jax.reference import conv3d as ref

NORMS = (None, "rms", "l2", "group")
ACTIVATIONS = (None, "silu", "gelu", "relu")


class Conv3dInputs(NamedTuple):
  x: jax.Array  # [N, T, H, W, Cin]
  w: jax.Array  # [kt, kh, kw, Cin, Cout]
  bias: jax.Array | None = None  # [Cout]
  residual: jax.Array | None = None  # [N, T', H', W', Cout]
  norm_scale: jax.Array | None = None  # [Cout]
  norm_bias: jax.Array | None = None  # [Cout]


@dataclasses.dataclass(frozen=True)
class Conv3dCall:
  """Everything static about one conv3d call."""
  in_shape: tuple  # x's shape
  kernel: tuple  # w's shape
  out_shape: tuple
  padding: tuple  # ((lo, hi),) * 3, explicit
  strides: tuple
  dilation: tuple
  dtype: str
  out_dtype: str
  norm: str | None
  num_groups: int
  eps: float
  activation: str | None
  has_bias: bool = False
  residual_dtype: str | None = None  # None: no residual


def _triple(name, value):
  values = tuple(value) if isinstance(value, (tuple, list)) else (value,) * 3
  if len(values) != 3:
    raise ValueError(f"{name}: expected 3 values (time, height, width), got {value!r}")
  return tuple(_checks.static_int(name, v, minimum=1) for v in values)


def _same_pads(size, k, stride, dilation):
  """XLA's SAME padding of one spatial dim: output ceil(size / stride)."""
  window = dilation * (k - 1) + 1
  out = -(-size // stride)
  total = max((out - 1) * stride + window - size, 0)
  return total // 2, total - total // 2


def _explicit_padding(padding, spatial, kernel, strides, dilation):
  if isinstance(padding, str):
    _checks.one_of("padding", padding, ("SAME", "VALID", "CAUSAL"))
    if padding == "VALID":
      return ((0, 0),) * 3
    pads = [_same_pads(*dims) for dims in zip(spatial, kernel, strides, dilation)]
    if padding == "CAUSAL":  # all of time's padding in front
      pads[0] = ((kernel[0] - 1) * dilation[0], 0)
    return tuple(pads)
  try:
    pads = tuple((int(lo), int(hi)) for lo, hi in padding)
  except (TypeError, ValueError):
    pads = ()
  if len(pads) != 3 or any(p < 0 for pair in pads for p in pair):
    raise ValueError("padding: expected 'SAME', 'VALID', 'CAUSAL' or ((lo, hi),) * 3 with "
                     f"non-negative ints, got {padding!r}")
  return pads


def _channel_vector(name, x, channels):
  if x is None:
    return None
  _checks.shape_of(name, x, 1)
  _checks.float_dtype(name, x)
  _checks.expect_shape(name, x, (channels,))
  return x


def _as_array(x):
  """NumPy arrays (and other arrays) as JAX arrays, with jax.numpy's dtypes (float64 is
  float32 unless x64 is on): a constant captured by jit is then an input like any other.
  Anything that is not an array is left for the checks to name."""
  if x is None or not (hasattr(x, "shape") and hasattr(x, "dtype")):
    return x
  return jnp.asarray(x)


def _prepare(x, w, bias=None, *, residual=None, norm=None, norm_scale=None, norm_bias=None,
             num_groups=32, eps=1e-6, activation=None, strides=(1, 1, 1), padding="SAME",
             dilation=(1, 1, 1), out_dtype=None, implementation=None):
  """Validates the user's arguments into (Conv3dCall, Conv3dInputs)."""
  del implementation
  x, w, bias, residual, norm_scale, norm_bias = map(
      _as_array, (x, w, bias, residual, norm_scale, norm_bias))
  n, *spatial, cin = _checks.shape_of("x", x, 5)
  _checks.float_dtype("x", x)
  kt, kh, kw, w_cin, cout = _checks.shape_of("w", w, 5)
  _checks.float_dtype("w", w)
  _checks.same_dtype("x, w", x, w)
  if w_cin != cin:
    raise ValueError(f"w: expected [kt, kh, kw, Cin, Cout] with Cin={cin} (x's channels), "
                     f"got shape {w.shape}")
  strides, dilation = _triple("strides", strides), _triple("dilation", dilation)
  kernel = (kt, kh, kw)
  pads = _explicit_padding(padding, spatial, kernel, strides, dilation)
  out_spatial = tuple((size + lo + hi - d * (k - 1) - 1) // s + 1 for size, (lo, hi), k, s, d
                      in zip(spatial, pads, kernel, strides, dilation))
  if min(out_spatial) < 1:
    raise ValueError(f"x: spatial dims {tuple(spatial)} are smaller than the dilated kernel "
                     f"{kernel} with padding {pads}")
  out_shape = (n,) + out_spatial + (cout,)
  bias = _channel_vector("bias", bias, cout)
  if residual is not None:
    _checks.shape_of("residual", residual, 5)
    _checks.float_dtype("residual", residual)
    _checks.expect_shape("residual", residual, out_shape)
  _checks.one_of("norm", norm, NORMS)
  norm_scale = _channel_vector("norm_scale", norm_scale, cout)
  norm_bias = _channel_vector("norm_bias", norm_bias, cout)
  if norm is None and (norm_scale is not None or norm_bias is not None):
    raise ValueError("norm_scale, norm_bias: given without a norm")
  num_groups = _checks.static_int("num_groups", num_groups, minimum=1)
  if norm == "group" and cout % num_groups:
    raise ValueError(f"num_groups: {num_groups} does not divide the {cout} output channels")
  if not isinstance(eps, (int, float)) or not eps > 0:
    raise ValueError(f"eps: expected a positive float, got {eps!r}")
  _checks.one_of("activation", activation, ACTIVATIONS)
  out_dtype = _checks.dtype_arg("out_dtype", x.dtype if out_dtype is None else out_dtype,
                                _checks.FLOAT_DTYPES).name
  call = Conv3dCall(in_shape=tuple(x.shape), kernel=tuple(w.shape), out_shape=out_shape,
                    padding=pads, strides=strides, dilation=dilation,
                    dtype=jnp.dtype(x.dtype).name, out_dtype=out_dtype, norm=norm,
                    num_groups=num_groups, eps=float(eps), activation=activation,
                    has_bias=bias is not None,
                    residual_dtype=None if residual is None else jnp.dtype(residual.dtype).name)
  return call, Conv3dInputs(x, w, bias, residual, norm_scale, norm_bias)


def conv3d(x, w, bias=None, *, residual=None, norm=None, norm_scale=None, norm_bias=None,
           num_groups=32, eps=1e-6, activation=None, strides=(1, 1, 1), padding="SAME",
           dilation=(1, 1, 1), out_dtype=None, implementation=None):
  """3-D convolution with a fused bias, residual, norm and activation (channels last).

  ``x [N, T, H, W, Cin]``, ``w [kt, kh, kw, Cin, Cout]``, ``bias [Cout]``. ``padding``:
  "SAME", "VALID", "CAUSAL" (time padded by ``(kt-1)*dilation_t`` in front only, height
  and width SAME) or explicit ``((lo, hi),) * 3``. ``y = conv(x, w) + bias + residual``
  (``residual`` shaped like the output), then ``norm``: "rms" ``y / sqrt(mean_c y^2 +
  eps)``, "l2" ``y * sqrt(C) / max(||y||_c, eps)``, or "group" ``(y - mean) / sqrt(var +
  eps)`` per sample over (T, H, W, C / num_groups); times ``norm_scale`` plus
  ``norm_bias`` when given; then ``activation`` in {None, "silu", "gelu" (erf), "relu"}.
  Returns ``[N, T', H', W', Cout]`` in ``out_dtype`` (default x's dtype). Differentiable in
  x, w, bias, residual, norm_scale, norm_bias. NumPy arrays are taken as ``jnp.asarray``
  of them. Sharded along the batch (x, residual), on meshes of either axis type, the call
  computes locally and the result keeps that sharding.
  """
  call, inputs = _prepare(x, w, bias, residual=residual, norm=norm, norm_scale=norm_scale,
                          norm_bias=norm_bias, num_groups=num_groups, eps=eps,
                          activation=activation, strides=strides, padding=padding,
                          dilation=dilation, out_dtype=out_dtype)
  return engines.dispatch("conv3d", implementation, call, inputs)


def _on_one_mesh(inputs: Conv3dInputs) -> Conv3dInputs:
  """On a mesh with explicitly typed axes, the inputs sharded along no axis (weights, NumPy
  arrays) are placed on it, replicated: there JAX cannot give the weight gradient of a
  convolution a sharding unless every operand is on the mesh."""
  meshes = [jax.typeof(a).sharding.mesh for a in inputs if a is not None]
  mesh = next((m for m in meshes if not m.empty), jax.sharding.get_abstract_mesh())
  if mesh.empty or jax.sharding.AxisType.Explicit not in mesh.axis_types:
    return inputs
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  unsharded = lambda a: not any(jax.typeof(a).sharding.spec)
  return Conv3dInputs(*(jax.sharding.reshard(a, whole) if a is not None and unsharded(a)
                        else a for a in inputs))


def _run_xla(call: Conv3dCall, x: Conv3dInputs):
  x = _on_one_mesh(x)
  y = ref.conv3d(*x, padding=call.padding, strides=call.strides, dilation=call.dilation,
                 norm=call.norm, num_groups=call.num_groups, eps=call.eps,
                 activation=call.activation)
  return y.astype(call.out_dtype)


engines.register_op("conv3d", lambda *a, **kw: _prepare(*a, **kw)[0])
engines.register_engine("conv3d", "xla", supports=lambda call: None, run=_run_xla)


# "cudnn": the convolution on a cuDNN graph, and its pointwise tail (bias, residual, and
# the activation when no norm follows) fused into that graph. cuDNN cannot fuse a norm into
# a convolution on sm_90, so the graph also writes what the norm needs (a norm over
# channels: each pixel's sum of squares) and the norm, its scale and bias and the
# activation run as XLA fusions on the graph's output. Gradients: cuDNN's dgrad and wgrad
# graphs; the pointwise backward in XLA.

# Where the tail runs, by use: "cudnn" (fused into the convolution's graph, as above) or
# "xla" (a graph of the convolution alone, the whole tail as XLA fusions after it). A cuDNN
# graph with a tail may run on a slower convolution kernel than the convolution alone, so
# the faster placement depends on the GPU and on the use: bench/conv3d.py times both. On
# the H100 (bench/NOTES.md) a forward alone is faster with the tail in XLA, forward and
# backward together with the norm's sums in the graph. A call that is differentiated runs
# the "training" placement (its forward and the backward that fits it); one that is not,
# the "inference" placement. A call with no norm runs whole in one graph for either use:
# its tail in XLA would only add a pass over the output.
TAIL = {"inference": "xla", "training": "cudnn"}
USES = tuple(TAIL)


def _placement(call: Conv3dCall, use: str) -> str:
  return TAIL[use] if call.norm is not None else "cudnn"


def _graph_config(call: Conv3dCall, tail: str) -> prim.Conv3dConfig:
  fused = tail == "cudnn"
  activation = call.activation if fused and call.norm is None else None
  return prim.Conv3dConfig(
      padding=call.padding, strides=call.strides, dilation=call.dilation,
      x_spatial=call.in_shape[1:4], kernel=call.kernel[:3], activation=activation or "none",
      has_bias=fused and call.has_bias, has_residual=fused and call.residual_dtype is not None,
      with_sumsq=fused and call.norm in ("rms", "l2"), out_dtype=call.out_dtype)


def _graph(config, x, w, bias, residual):
  """The forward graph: ``(y, sumsq or None)``."""
  y, *sumsq = prim.forward(config, x, w, *[a for a in (bias, residual) if a is not None])
  return y, (sumsq[0] if sumsq else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _conv_tail(config, x, w, bias, residual):
  """``(act(conv(x, w) + bias + residual), sum_k of its square or None)``; ``w [K, kt, kh,
  kw, C]``, ``bias`` float32."""
  return _graph(config, x, w, bias, residual)


def _conv_tail_fwd(config, x, w, bias, residual):
  # The activation's backward needs its input: the graph stops before the activation and
  # XLA applies it.
  z, sumsq = _graph(dataclasses.replace(config, activation="none"), x, w, bias, residual)
  y = z
  if config.activation != "none":
    y = ref.ACTIVATIONS[config.activation](z.astype(jnp.float32)).astype(z.dtype)
  residual_like = None if residual is None else jnp.zeros((), residual.dtype)
  return (y, sumsq), (x, w, z, residual_like)


def _conv_tail_bwd(config, saved, cts):
  x, w, z, residual_like = saved
  dy, dsumsq = cts
  z = z.astype(jnp.float32)
  dz = dy.astype(jnp.float32)
  if config.activation != "none":
    dz = jax.vjp(ref.ACTIVATIONS[config.activation], z)[1](dz)[0]
  if config.with_sumsq:
    dz = dz + 2 * z * dsumsq[..., None]
  dbias = jnp.sum(dz, axis=(0, 1, 2, 3)) if config.has_bias else None
  dresidual = None if residual_like is None else dz.astype(residual_like.dtype)
  dz = dz.astype(x.dtype)
  (dx,) = prim.dgrad(config, dz, w)
  (dw,) = prim.wgrad(config, x[None], dz[None])
  return dx, dw[0], dbias, dresidual


_conv_tail.defvjp(_conv_tail_fwd, _conv_tail_bwd)


def _run_placed(tail: str, call: Conv3dCall, x: Conv3dInputs):
  """The cudnn engine with the pointwise tail placed in ``tail``."""
  config = _graph_config(call, tail)
  w = jnp.transpose(x.w, (4, 0, 1, 2, 3))  # [K, kt, kh, kw, C]
  bias = x.bias.astype(jnp.float32) if config.has_bias else None
  y, sumsq = _conv_tail(config, x.x, w, bias, x.residual if config.has_residual else None)
  if tail == "cudnn" and call.norm is None:
    return y  # the whole computation ran in the graph
  # The rest of the tail, in float32.
  y = y.astype(jnp.float32)
  if x.bias is not None and not config.has_bias:
    y = y + x.bias.astype(jnp.float32)
  if x.residual is not None and not config.has_residual:
    y = y + x.residual.astype(jnp.float32)
  if sumsq is not None:
    y = ref.channel_normalize(y, sumsq[..., None], call.norm, call.eps)
  elif call.norm is not None:
    y = ref.normalize(y, call.norm, call.num_groups, call.eps)
  activation = call.activation if config.activation == "none" else None
  return ref.affine_activation(y, x.norm_scale, x.norm_bias, activation).astype(call.out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _by_use(call: Conv3dCall, x: Conv3dInputs):
  """The "inference" placement; under differentiation, the "training" one (a custom VJP
  whose primal and forward rule compute the same function in different graphs)."""
  return _run_placed(_placement(call, "inference"), call, x)


def _by_use_fwd(call, x):
  return jax.vjp(functools.partial(_run_placed, _placement(call, "training"), call), x)


def _by_use_bwd(call, pull, dy):
  del call
  return pull(dy)


_by_use.defvjp(_by_use_fwd, _by_use_bwd)


def _run_cudnn(call: Conv3dCall, x: Conv3dInputs):
  inference, training = (_placement(call, use) for use in USES)
  return _run_placed(training, call, x) if inference == training else _by_use(call, x)


def _supports_cudnn(call: Conv3dCall) -> str | None:
  if call.dtype not in ("bfloat16", "float16"):
    return f"dtype {call.dtype}: bfloat16 and float16 only"
  if 0 in call.in_shape + call.kernel + call.out_shape:
    return "an empty extent: nothing to run"
  if why := _extension.unavailable_reason():
    return why
  n, c, k = call.in_shape[0], call.in_shape[-1], call.kernel[-1]
  # The graphs a call may run: the inference forward; the training forward (without its
  # activation, which the backward needs the input of) and the two gradients.
  inference, training = (_graph_config(call, _placement(call, use)) for use in USES)
  for config, pass_ in ((inference, "forward"),
                        (dataclasses.replace(training, activation="none"), "forward"),
                        (training, "dgrad"), (training, "wgrad")):
    query = config.check_config(pass_, dtype=call.dtype, n=n, c=c, k=k,
                                out_spatial=call.out_shape[1:4],
                                residual_dtype=call.residual_dtype)
    if why := _extension.module().conv3d_check(query):
      return why
  return None


def _describe_placed(call: Conv3dCall, tail: str) -> str:
  config = _graph_config(call, tail)
  graph = " + ".join(["conv"] + ["bias"] * config.has_bias + ["residual"] * config.has_residual
                     + [config.activation] * (config.activation != "none")
                     + ["each pixel's sum of squares"] * config.with_sumsq)
  rest = (["bias"] * (call.has_bias and not config.has_bias)
          + ["residual"] * (call.residual_dtype is not None and not config.has_residual)
          + [f"{call.norm} norm"] * (call.norm is not None)
          + [call.activation] * (call.activation is not None and config.activation == "none"))
  if not rest:
    return f"one cuDNN graph: {graph}"
  how = "group statistics, then " if call.norm == "group" else ""
  return f"cuDNN graph: {graph}; then in XLA: {how}{' + '.join(rest)}"


def _describe_cudnn(call: Conv3dCall) -> str:
  inference, training = (_describe_placed(call, _placement(call, use)) for use in USES)
  if inference == training:
    return inference
  return f"inference: {inference}; differentiated: {training}"


engines.register_engine("conv3d", "cudnn", supports=_supports_cudnn, run=_run_cudnn,
                        describe=_describe_cudnn)
