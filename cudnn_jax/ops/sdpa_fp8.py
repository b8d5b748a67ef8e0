"""FP8 attention: ``cudnn_jax.sdpa_fp8``.

``query``, ``key``, ``value`` in ``float8_e4m3fn`` with per-tensor dequantization factors;
the probabilities are quantized to e4m3 with a fixed scale inside (reference/sdpa_fp8.py
defines the math). Engines: "cudnn" (cuDNN's FP8 flash-attention graphs, Hopper and
newer) and "xla" (the math in plain JAX, which serves every call).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cudnn_jax import _checks, _metadata, engines
from cudnn_jax.ops.sdpa import _window, checked_lengths, checked_qkv, checked_scales

FP8 = jnp.dtype(jnp.float8_e4m3fn)
OUT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn)
_SCALES = ("q_scale", "k_scale", "v_scale", "out_scale")

# sdpa's keyword arguments sdpa_fp8 does not take, with the value that means "not used".
_UNSUPPORTED = dict(bias=None, mask=None, sinks=None, q_segment_ids=None,
                    kv_segment_ids=None, dropout_rate=0.0, dropout_rng=None, return_lse=False,
                    return_residual=False, context_parallel_axis=None)


class Fp8Inputs(NamedTuple):
  """The array arguments, 4-D and validated; absent lengths are None."""
  query: jax.Array
  key: jax.Array
  value: jax.Array
  q_scale: jax.Array
  k_scale: jax.Array
  v_scale: jax.Array
  out_scale: jax.Array
  query_seq_lengths: jax.Array | None = None
  key_value_seq_lengths: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Fp8Call:
  """Everything static about one call: what engines decide on."""
  b: int
  t: int
  s: int
  n: int
  k: int
  h: int
  hv: int
  out_dtype: str
  scale: float
  is_causal: bool = False
  bottom_right: bool = False
  window: tuple | None = None  # (left, right), None = unbounded side
  has_q_lengths: bool = False
  has_kv_lengths: bool = False
  logits_soft_cap: float | None = None
  unbatched: bool = False


def prepare(query, key, value, *, q_scale, k_scale, v_scale, out_scale,
            out_dtype=jnp.bfloat16, scale=None, is_causal=False, query_seq_lengths=None,
            key_value_seq_lengths=None, local_window_size=None, implementation=None,
            causal_alignment="top_left", logits_soft_cap=None, **unsupported):
  """Validates the user's arguments into (Fp8Call, Fp8Inputs)."""
  del implementation
  for name, value_ in unsupported.items():
    if name not in _UNSUPPORTED:
      raise TypeError(f"sdpa_fp8() got an unexpected keyword argument {name!r}")
    default = _UNSUPPORTED[name]
    if value_ is not default and not (default is not None and value_ == default):
      raise ValueError(f"{name}: not supported by sdpa_fp8 (supported: scale, is_causal, "
                       "causal_alignment, local_window_size, query_seq_lengths, "
                       "key_value_seq_lengths, logits_soft_cap)")
  query, key, value, unbatched = checked_qkv(query, key, value, (FP8,))
  scales = [_checks.scale_scalar(name, x)
            for name, x in zip(_SCALES, (q_scale, k_scale, v_scale, out_scale))]
  out_dtype = _checks.dtype_arg("out_dtype", out_dtype, OUT_DTYPES)
  b, t, n, h = query.shape
  _, s, k, hv = value.shape
  q_lens = checked_lengths("query_seq_lengths", query_seq_lengths, b, t, unbatched)
  kv_lens = checked_lengths("key_value_seq_lengths", key_value_seq_lengths, b, s, unbatched)
  scale, logits_soft_cap = checked_scales(scale, h, causal_alignment, logits_soft_cap)
  call = Fp8Call(
      b=b, t=t, s=s, n=n, k=k, h=h, hv=hv, out_dtype=out_dtype.name, scale=scale,
      is_causal=_checks.flag("is_causal", is_causal),
      bottom_right=causal_alignment == "bottom_right", window=_window(local_window_size),
      has_q_lengths=q_lens is not None, has_kv_lengths=kv_lens is not None,
      logits_soft_cap=logits_soft_cap, unbatched=unbatched)
  inputs = Fp8Inputs(*_checks.arrays(query, key, value), *scales, q_lens, kv_lens)
  return call, inputs


def sdpa_fp8(query, key, value, *, q_scale, k_scale, v_scale, out_scale,
             out_dtype=jnp.bfloat16, scale=None, is_causal=False, query_seq_lengths=None,
             key_value_seq_lengths=None, local_window_size=None, implementation=None,
             causal_alignment="top_left", logits_soft_cap=None, **unsupported):
  """FP8 scaled dot-product attention: ``(out, amax)``.

  ``query [B,T,N,H]``, ``key [B,S,K,H]``, ``value [B,S,K,Hv]`` (or unbatched ``[T,N,H]``
  ...) in ``float8_e4m3fn``, ``N % K == 0``. ``q_scale``, ``k_scale``, ``v_scale``,
  ``out_scale``: float32 scalars, the dequantization factors (the real query is
  ``query * q_scale``). Computes ``attention(query*q_scale, key*k_scale, value*v_scale)``
  with the softmax probabilities quantized to e4m3 under a fixed scale (256) before the
  product with the values, as FP8 flash-attention kernels do (reference/sdpa_fp8.py).

  Returns ``out [B,T,N,Hv]`` in ``out_dtype`` (bfloat16, float16, float32, or
  float8_e4m3fn, which holds ``out / out_scale`` saturated at +-448; ``out_scale`` is read
  only then) and ``amax``, the float32 scalar ``max|out|`` before ``out_scale``, for
  delayed scaling.

  Masks as in ``cudnn_jax.sdpa``: ``is_causal`` with ``causal_alignment``,
  ``local_window_size``, ``query_seq_lengths`` / ``key_value_seq_lengths`` (clamped to
  ``[0, T]`` / ``[0, S]``); also ``scale`` and ``logits_soft_cap``. A row with no kept key,
  or past its valid length, outputs 0. sdpa's other arguments (bias, mask, sinks, segment
  ids, dropout, return_lse, context parallelism) raise ValueError.

  Differentiable in query, key, value; their gradients are bfloat16: the gradients of the
  float32 math at the dequantized inputs, times each input's scale, the probability
  rounding passing gradients straight through. Scales and amax carry no gradient.

  ``implementation``: None (the fastest engine that serves the call, else "xla"),
  "cudnn", "xla", or a sequence; ``cudnn_jax.explain("sdpa_fp8", ...)`` says which runs.
  On Hopper cuDNN's FP8 graph writes fp8 outputs only (out_dtype=float8_e4m3fn) and no
  bottom-right causal mask; its backward runs cuDNN's bf16 attention backward on the
  dequantized inputs there (the FP8 backward graph with bf16 gradients needs Blackwell).
  """
  call, inputs = prepare(
      query, key, value, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
      out_scale=out_scale, out_dtype=out_dtype, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, causal_alignment=causal_alignment,
      logits_soft_cap=logits_soft_cap, **unsupported)
  for name, x, size in (("query_seq_lengths", query_seq_lengths, call.t),
                        ("key_value_seq_lengths", key_value_seq_lengths, call.s)):
    if x is not None:
      _metadata.check_lengths(name, x, size)
  out, amax = engines.dispatch("sdpa_fp8", implementation, call, inputs)
  return (out[0] if call.unbatched else out), amax


def _run_xla(call: Fp8Call, x: Fp8Inputs):
  from cudnn_jax.reference import sdpa_fp8 as ref  # pylint: disable=g-import-not-at-top
  return ref.sdpa_fp8(
      x.query, x.key, x.value, x.q_scale, x.k_scale, x.v_scale, x.out_scale,
      out_dtype=call.out_dtype, scale=call.scale, is_causal=call.is_causal,
      bottom_right=call.bottom_right, window=call.window,
      query_seq_lengths=x.query_seq_lengths, key_value_seq_lengths=x.key_value_seq_lengths,
      logits_soft_cap=call.logits_soft_cap)


engines.register_op("sdpa_fp8", lambda *a, **kw: prepare(*a, **kw)[0])
engines.register_engine("sdpa_fp8", "xla", supports=lambda call: None, run=_run_xla)


# ---------------------------------------------------------------------------------------
# The cudnn engine.


def _cudnn_config(call: Fp8Call):
  from cudnn_jax.primitives import sdpa_fp8 as prim  # pylint: disable=g-import-not-at-top
  left, right = call.window if call.window is not None else (None, None)
  return prim.Fp8Config(
      scale=call.scale, causal=call.is_causal, bottom_right=call.bottom_right,
      window_left=-1 if left is None else left, window_right=-1 if right is None else right,
      has_padding=call.has_q_lengths or call.has_kv_lengths, out_dtype=call.out_dtype)


@functools.lru_cache(maxsize=1024)
def _cudnn_check(call: Fp8Call, backward: bool) -> str | None:
  from cudnn_jax import _extension  # pylint: disable=g-import-not-at-top
  config = _cudnn_config(call)
  query = config.check_config(backward=backward, b=call.b, t=call.t, s=call.s, n=call.n,
                              k=call.k, h=call.h, hv=call.hv)
  return _extension.module().sdpa_fp8_check(query) or None


@functools.lru_cache(maxsize=1024)
def _bf16_backward_check(call: Fp8Call) -> str | None:
  """Whether cuDNN's bf16 attention backward serves this call's dequantized inputs."""
  from cudnn_jax import _extension  # pylint: disable=g-import-not-at-top
  config = _cudnn_config(call).bf16_config()
  query = config.check_config(backward=True, dtype="bfloat16", b=call.b, t=call.t, s=call.s,
                              n=call.n, k=call.k, h=call.h, hv=call.hv, bias_shape=None)
  return _extension.module().sdpa_check(query) or None


def backward_path(call: Fp8Call) -> str | None:
  """How the cudnn engine differentiates ``call``: "fp8" (cuDNN's FP8 backward graph, bf16
  gradients: Blackwell), "bf16" (cuDNN's bf16 attention backward on the dequantized
  inputs), or None (the xla engine's VJP)."""
  if _cudnn_check(call, True) is None:
    return "fp8"
  if _bf16_backward_check(call) is None:
    return "bf16"
  return None


def _supports_cudnn(call: Fp8Call) -> str | None:
  from cudnn_jax import _extension  # pylint: disable=g-import-not-at-top
  why = _extension.unavailable_reason()
  if why:
    return why
  if call.logits_soft_cap is not None:
    return "logits_soft_cap: not served by cuDNN's FP8 attention graph"
  if call.is_causal and call.bottom_right and call.t > call.s:
    return ("causal_alignment='bottom_right' with T > S: cuDNN needs T <= S (rows without "
            "keys)")
  return _cudnn_check(call, False)


def _describe_cudnn(call: Fp8Call) -> str:
  path = {"fp8": "cuDNN's FP8 backward graph",
          "bf16": "cuDNN's bf16 attention backward on the dequantized inputs",
          None: "the xla engine's VJP"}[backward_path(call)]
  return f"cuDNN FP8 attention graph, out in {call.out_dtype}; gradients by {path}"


def _row_valid(call: Fp8Call, x: Fp8Inputs):
  """[B,T,1,1] bool: rows that keep at least one key (None when all do). cuDNN leaves rows
  without keys ill-defined; SPEC makes them 0. Row t keeps the keys [lo, hi]."""
  lengths = call.has_q_lengths or call.has_kv_lengths
  if not (lengths or call.window is not None
          or (call.is_causal and call.bottom_right and call.t > call.s)):
    return None
  b, t, s = call.b, call.t, call.s
  q_len = x.query_seq_lengths if x.query_seq_lengths is not None else jnp.full((b,), t)
  kv_len = (x.key_value_seq_lengths if x.key_value_seq_lengths is not None
            else jnp.full((b,), s))
  tt = jnp.arange(t)[None, :]
  tb, sb = q_len[:, None], kv_len[:, None]
  diag = tt + (sb - tb if call.bottom_right else 0)
  lo, hi = jnp.zeros_like(diag), sb - 1
  left, right = call.window if call.window is not None else (None, None)
  if call.is_causal:
    hi = jnp.minimum(hi, diag)
  if right is not None:
    hi = jnp.minimum(hi, diag + right)
  if left is not None:
    lo = jnp.maximum(lo, diag - left)
  return ((tt < tb) & (lo <= hi))[:, :, None, None]


def _run_cudnn(call: Fp8Call, x: Fp8Inputs):
  from cudnn_jax.primitives import sdpa_fp8 as prim  # pylint: disable=g-import-not-at-top
  q_lens = k_lens = None
  if call.has_q_lengths or call.has_kv_lengths:
    q_lens = (x.query_seq_lengths if x.query_seq_lengths is not None
              else jnp.full((call.b,), call.t, jnp.int32))
    k_lens = (x.key_value_seq_lengths if x.key_value_seq_lengths is not None
              else jnp.full((call.b,), call.s, jnp.int32))
  out, amax = prim.attention(_cudnn_config(call), functools.partial(backward_path, call),
                             x.query, x.key, x.value, x.q_scale, x.k_scale, x.v_scale,
                             x.out_scale, q_lens, k_lens)
  valid = _row_valid(call, x)
  if valid is not None:
    out = jnp.where(valid, out, jnp.zeros((), out.dtype))
  return out, amax


engines.register_engine("sdpa_fp8", "cudnn", supports=_supports_cudnn, run=_run_cudnn,
                        describe=_describe_cudnn)
