"""The ``xla`` engine of ``cudnn_jax.conv3d``: ``lax.conv_general_dilated`` (float32
accumulation), then bias, residual, norm and activation in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cudnn_jax.reference import matmul_precision

ACTIVATIONS = {"silu": jax.nn.silu, "gelu": lambda y: jax.nn.gelu(y, approximate=False),
               "relu": jax.nn.relu}


def channel_normalize(y, sum_sq, norm, eps):
  """``y [..., C]`` normalized over channels from ``sum_sq [..., 1] = sum_c y^2``: "rms"
  ``y / sqrt(sum_sq / C + eps)``, "l2" ``y * sqrt(C) / max(sqrt(sum_sq), eps)``."""
  channels = y.shape[-1]
  if norm == "rms":
    return y * jax.lax.rsqrt(sum_sq / channels + eps)
  # max(sqrt(s), eps) as sqrt(max(s, eps^2)): the same value, no NaN gradient at s = 0.
  return y * jnp.sqrt(channels) / jnp.sqrt(jnp.maximum(sum_sq, eps * eps))


def normalize(y, norm, num_groups, eps):
  """``y [N, T, H, W, C]`` float32 normalized over channels ("rms", "l2") or over
  (T, H, W, C / num_groups) per sample and group ("group")."""
  if norm in ("rms", "l2"):
    return channel_normalize(y, jnp.sum(y * y, axis=-1, keepdims=True), norm, eps)
  groups = y.reshape(y.shape[:-1] + (num_groups, y.shape[-1] // num_groups))
  mean = jnp.mean(groups, axis=(1, 2, 3, 5), keepdims=True)
  var = jnp.mean(jnp.square(groups - mean), axis=(1, 2, 3, 5), keepdims=True)
  return ((groups - mean) * jax.lax.rsqrt(var + eps)).reshape(y.shape)


def affine_activation(y, norm_scale, norm_bias, activation):
  """``activation(y * norm_scale + norm_bias)`` in float32, each part when given."""
  f32 = lambda a: a.astype(jnp.float32)
  if norm_scale is not None:
    y = y * f32(norm_scale)
  if norm_bias is not None:
    y = y + f32(norm_bias)
  return ACTIVATIONS[activation](y) if activation is not None else y


def conv3d(x, w, bias=None, residual=None, norm_scale=None, norm_bias=None, *, padding,
           strides, dilation, norm, num_groups, eps, activation):
  """Validated inputs, explicit ``padding``; returns float32 ``[N, T', H', W', Cout]``."""
  y = jax.lax.conv_general_dilated(
      x, w, window_strides=strides, padding=padding, rhs_dilation=dilation,
      dimension_numbers=("NDHWC", "DHWIO", "NDHWC"), precision=matmul_precision(x.dtype),
      preferred_element_type=jnp.float32)
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  if residual is not None:
    y = y + residual.astype(jnp.float32)
  if norm is not None:
    y = normalize(y, norm, num_groups, eps)
  return affine_activation(y, norm_scale, norm_bias, activation)
