"""The ``xla`` engine for FP8 attention (``cudnn_jax.sdpa_fp8``), in plain JAX.

Inputs are ``float8_e4m3fn`` with per-tensor dequantization factors: the real query is
``query * q_scale`` (likewise key, value). The math is attention of the real values in
float32, except that the unnormalized softmax probabilities ``e = exp(s - rowmax)`` (in
[0, 1]) are rounded to e4m3 after multiplying by the fixed scale ``P_SCALE`` and divided by
it again before the product with the values, as FP8 flash-attention kernels (cuDNN's,
FlashAttention-3's) quantize them; the row sum that normalizes the output is the sum of
the unrounded ``e``:

    out[t] = sum_u round_e4m3(e[t,u] * P_SCALE) / P_SCALE * v[u] / sum_u e[t,u]

Masks (causal, window, lengths) and soft-capping are those of ``reference/sdpa.py``. A row
with no kept key, or past its valid length, outputs 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cudnn_jax.reference.sdpa import band_keep, lengths_or_full, scaled_logits

# The probabilities' fixed quantization scale: e * P_SCALE lies in [0, 256], inside e4m3's
# range (448), and a power of two makes scale and descale exact, so e down to 2^-17 keeps
# a nonzero value (2^-9 without it). The cudnn engine passes the same scale to cuDNN.
P_SCALE = 256.0

E4M3_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448
E5M2_MAX = float(jnp.finfo(jnp.float8_e5m2).max)  # 57344


def round_e4m3(x):
  """float32 ``x`` rounded to the nearest e4m3 value (saturated at +-448), as float32."""
  return jnp.clip(x, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32)


def quantize(x, scale, dtype):
  """``x / scale`` in the fp8 ``dtype``, saturated to its finite range (an fp8 kernel's
  saturating conversion; a plain cast would turn overflow into NaN)."""
  big = float(jnp.finfo(dtype).max)
  return jnp.clip(x.astype(jnp.float32) / scale, -big, big).astype(dtype)


def attention(q, k, v, *, scale, is_causal=False, bottom_right=False, window=None,
              query_seq_lengths=None, key_value_seq_lengths=None, logits_soft_cap=None,
              scale_s=P_SCALE, descale_s=1.0 / P_SCALE):
  """``(out [B,T,N,Hv], lse [B,N,T])`` float32 for float32 (dequantized) q, k, v.

  ``scale_s``/``descale_s``: the probabilities are rounded as ``round_e4m3(e * scale_s) *
  descale_s``. Differentiable: the rounding passes gradients straight through, so dq and
  dk are those of attention with unrounded probabilities, and dv uses the rounded ones.
  """
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  g = n // kh
  hi = jax.lax.Precision.HIGHEST
  logits = scaled_logits(q, k, scale, logits_soft_cap=logits_soft_cap, precision=hi)
  q_len, kv_len = lengths_or_full(b, t, s, query_seq_lengths, key_value_seq_lengths)
  keep = band_keep(jnp.arange(t), jnp.arange(s), q_len, kv_len, is_causal=is_causal,
                   bottom_right=bottom_right, window=window)
  logits = jnp.where(keep, logits, -jnp.inf)
  row_max = jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf)
  row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  e = jnp.where(keep, jnp.exp(logits - row_max), 0.0)
  denom = jnp.sum(e, axis=-1, keepdims=True)
  safe = jnp.where(denom > 0, denom, 1.0)
  rounded = round_e4m3(e * scale_s) * descale_s
  p8 = e + jax.lax.stop_gradient(rounded - e)  # straight-through rounding
  out = jnp.einsum("bkgts,bskd->btkgd", p8.reshape(b, kh, g, t, s), v, precision=hi)
  out = out.reshape(b, t, n, v.shape[-1])
  out = out / jnp.swapaxes(safe, 1, 2).reshape(b, t, n, 1)
  lse = jnp.where(denom > 0, jnp.log(safe) + row_max, -jnp.inf)[..., 0]
  return out, lse


def dequantize(x, scale):
  return x.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)


def _forward(options, q8, k8, v8, q_scale, k_scale, v_scale, out_scale, q_lens, kv_lens):
  out_dtype, kwargs = options[0], dict(options[1])
  out, _ = attention(dequantize(q8, q_scale), dequantize(k8, k_scale), dequantize(v8, v_scale),
                     query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens, **kwargs)
  amax = jnp.max(jnp.abs(out), initial=0.0)
  if jnp.issubdtype(out_dtype, jnp.floating) and jnp.finfo(out_dtype).bits == 8:
    out = quantize(out, out_scale, out_dtype)
  else:
    out = out.astype(out_dtype)
  return out, amax


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sdpa_fp8(options, q8, k8, v8, q_scale, k_scale, v_scale, out_scale, q_lens, kv_lens):
  return _forward(options, q8, k8, v8, q_scale, k_scale, v_scale, out_scale, q_lens, kv_lens)


def _sdpa_fp8_fwd(options, *args):
  return _forward(options, *args), args


def gradients(attend, q8, k8, v8, q_scale, k_scale, v_scale, dout, grad_dtype=jnp.bfloat16):
  """(dquery, dkey, dvalue) in ``grad_dtype``: the VJP of ``attend(q, k, v) -> out`` (float32,
  dequantized inputs) at the fp8 inputs, times each input's scale."""
  scales = (q_scale, k_scale, v_scale)
  real = [dequantize(x, s) for x, s in zip((q8, k8, v8), scales)]
  _, vjp = jax.vjp(attend, *real)
  grads = vjp(dout.astype(jnp.float32))
  return tuple((g * jnp.asarray(s, jnp.float32)).astype(grad_dtype)
               for g, s in zip(grads, scales))


def scale_cotangents(*scales):
  return tuple(jnp.zeros(jnp.shape(s), jnp.float32) for s in scales)


def length_cotangents(q_lens, kv_lens):
  import numpy as np  # pylint: disable=g-import-not-at-top
  return tuple(None if x is None else np.zeros(x.shape, jax.dtypes.float0)
               for x in (q_lens, kv_lens))


def _sdpa_fp8_bwd(options, res, cts):
  q8, k8, v8, q_scale, k_scale, v_scale, out_scale, q_lens, kv_lens = res
  dout, _ = cts  # amax is a statistic: no gradient flows through it
  out_dtype, kwargs = options[0], dict(options[1])
  if jnp.finfo(out_dtype).bits == 8:  # the fp8 out is the real out divided by out_scale
    dout = dout.astype(jnp.float32) / jnp.asarray(out_scale, jnp.float32)
  attend = lambda q, k, v: attention(q, k, v, query_seq_lengths=q_lens,
                                     key_value_seq_lengths=kv_lens, **kwargs)[0]
  grads = gradients(attend, q8, k8, v8, q_scale, k_scale, v_scale, dout)
  return (*grads, *scale_cotangents(q_scale, k_scale, v_scale, out_scale),
          *length_cotangents(q_lens, kv_lens))


_sdpa_fp8.defvjp(_sdpa_fp8_fwd, _sdpa_fp8_bwd)


def sdpa_fp8(query, key, value, q_scale, k_scale, v_scale, out_scale, *, out_dtype, scale,
             is_causal=False, bottom_right=False, window=None, query_seq_lengths=None,
             key_value_seq_lengths=None, logits_soft_cap=None):
  """``(out [B,T,N,Hv] in out_dtype, amax float32 scalar)`` for 4-D e4m3 inputs.

  ``out = attention(query*q_scale, key*k_scale, value*value_scale)`` with e4m3-rounded
  probabilities (module docstring); an fp8 ``out_dtype`` holds ``out / out_scale``,
  saturated at its largest finite value; ``amax = max|out|`` before ``out_scale``.

  Gradients (query, key, value; in bfloat16): the VJP of that float32 math at the
  dequantized inputs, times each input's scale; the probability rounding passes gradients
  straight through (dq, dk are those of exact attention; dv uses the rounded
  probabilities). With an fp8 ``out_dtype`` the cotangent of ``out`` is divided by
  ``out_scale``. The scales and amax carry no gradient.
  """
  kwargs = (("scale", float(scale)), ("is_causal", bool(is_causal)),
            ("bottom_right", bool(bottom_right)),
            ("window", None if window is None else tuple(window)),
            ("logits_soft_cap", logits_soft_cap))
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return _sdpa_fp8((jnp.dtype(out_dtype), kwargs), query, key, value, f32(q_scale),
                   f32(k_scale), f32(v_scale), f32(out_scale), query_seq_lengths,
                   key_value_seq_lengths)
