"""cuDNN FP8 attention as JAX primitives (``core.define``: batching, partitioning, CPU
emulation).

``sdpa_fp8_fwd``: (q, k, v [e4m3], descale_q, descale_k, descale_v, descale_s, scale_s,
scale_o [f32 scalars], [q_lens [B], kv_lens [B]]) -> (out [B,T,N,Hv] in ``out_dtype``,
lse [B,N,T] f32, amax [B,N] f32: every entry the call's max|O| before scale_o).
``sdpa_fp8_bwd``: (q, k, v [e4m3], o [e4m3], dout [e5m2], lse, descale_q, descale_k,
descale_v, descale_o, descale_do, descale_s, descale_dp, scale_s, scale_dq, scale_dk,
scale_dv, scale_dp, [q_lens, kv_lens]) -> (dq, dk, dv) bf16.

Scales follow cuDNN: a descale multiplies an fp8 operand into real values, a scale
multiplies a real value into the stored one (out = O * scale_o; the probabilities are
stored as round(P * scale_s), then multiplied by descale_s). On NVIDIA GPUs the primitives
lower to the handlers of ffi/sdpa_fp8_cudnn.cc; elsewhere to the same contract in plain
JAX, so their batching, partitioning and differentiation run on any backend.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import batching

from cudnn_jax.primitives import _common, core
from cudnn_jax.reference import sdpa_fp8 as ref

_FFI_TYPES = {"float": np.float32, "bool": np.bool_, "int": np.int32}
_ATTRIBUTE = {"attribute": True}
FP8 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)
GRAD_DTYPE = jnp.dtype(jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class Fp8Config:
  """The handlers' attributes (fields marked as such; both handlers take all of them, see
  ffi/README.md) and the forward's out dtype, which the handler reads off its out buffer."""
  scale: float = dataclasses.field(metadata=_ATTRIBUTE)
  causal: bool = dataclasses.field(default=False, metadata=_ATTRIBUTE)
  bottom_right: bool = dataclasses.field(default=False, metadata=_ATTRIBUTE)
  window_left: int = dataclasses.field(default=-1, metadata=_ATTRIBUTE)  # -1: unbounded
  window_right: int = dataclasses.field(default=-1, metadata=_ATTRIBUTE)
  has_padding: bool = dataclasses.field(default=False, metadata=_ATTRIBUTE)
  out_dtype: str = "float8_e4m3fn"

  @classmethod
  def attribute_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("attribute"))

  def attributes(self) -> dict:
    """The FFI attributes, typed as the handlers bind them."""
    return {f.name: _FFI_TYPES[f.type](getattr(self, f.name))
            for f in dataclasses.fields(self) if f.metadata.get("attribute")}

  def check_config(self, *, backward, b, t, s, n, k, h, hv) -> dict:
    """The dict ``cudnn_jax._ffi.sdpa_fp8_check`` takes: the attributes, out dtype, shapes."""
    return dict(self.attributes(), backward=backward, out_dtype=self.out_dtype, b=b, t=t, s=s,
                n=n, k=k, h=h, hv=hv)

  @property
  def fp8_out(self) -> bool:
    return jnp.dtype(self.out_dtype).itemsize == 1

  def bf16_config(self):
    """The same attention for cuDNN's bf16 SDPA handlers (primitives/sdpa.py)."""
    from cudnn_jax.primitives import sdpa  # pylint: disable=g-import-not-at-top
    return sdpa.SdpaConfig(scale=self.scale, causal=self.causal,
                           bottom_right=self.bottom_right, window_left=self.window_left,
                           window_right=self.window_right, has_padding=self.has_padding)

  def reference_kwargs(self) -> dict:
    left = None if self.window_left < 0 else self.window_left
    right = None if self.window_right < 0 else self.window_right
    return dict(scale=self.scale, is_causal=self.causal, bottom_right=self.bottom_right,
                window=None if left is None and right is None else (left, right))


# ---------------------------------------------------------------------------------------
# The handlers' calls (cuda) and their contract in plain JAX (everywhere else).

_FWD_SCALES = 6  # descale_q, descale_k, descale_v, descale_s, scale_s, scale_o
_BWD_SCALES = 12  # descale q k v o do s dp, scale s dq dk dv dp


def _workspace(config, backward, q, k, v):
  from cudnn_jax import _extension  # pylint: disable=g-import-not-at-top
  b, t, n, h = q.shape
  query = config.check_config(backward=backward, b=b, t=t, s=k.shape[1], n=n, k=k.shape[2],
                              h=h, hv=v.shape[3])
  return _common.workspace_result(_extension.module().sdpa_fp8_workspace(query))


def _fwd_ffi(config, q, k, v, *rest):
  out, lse, amax = (jax.ShapeDtypeStruct(a.shape, a.dtype)
                    for a in _fwd.abstract(config, q, k, v, *rest))
  out, lse, amax, _ = jax.ffi.ffi_call(
      "cudnn_jax_sdpa_fp8_fwd", (out, lse, amax, _workspace(config, False, q, k, v)))(
          q, k, v, *rest, **config.attributes())
  return out, lse, amax


def _bwd_ffi(config, q, k, v, *rest):
  out_types = (_common.with_shape(q, GRAD_DTYPE), _common.with_shape(k, GRAD_DTYPE),
               _common.with_shape(v, GRAD_DTYPE), _workspace(config, True, q, k, v))
  dq, dk, dv, _ = jax.ffi.ffi_call("cudnn_jax_sdpa_fp8_bwd", out_types)(
      q, k, v, *rest, **config.attributes())
  return dq, dk, dv


def _lengths(config, rest):
  return tuple(rest) if config.has_padding else (None, None)


def _emulated_attention(config, q, k, v, descale_q, descale_k, descale_v, descale_s, scale_s,
                        q_lens, kv_lens):
  return ref.attention(ref.dequantize(q, descale_q), ref.dequantize(k, descale_k),
                       ref.dequantize(v, descale_v), query_seq_lengths=q_lens,
                       key_value_seq_lengths=kv_lens, scale_s=scale_s, descale_s=descale_s,
                       **config.reference_kwargs())


def _fwd_emulated(config, q, k, v, *rest):
  dq_, dk_, dv_, descale_s, scale_s, scale_o = rest[:_FWD_SCALES]
  out, lse = _emulated_attention(config, q, k, v, dq_, dk_, dv_, descale_s, scale_s,
                                 *_lengths(config, rest[_FWD_SCALES:]))
  amax = jnp.max(jnp.abs(out), initial=0.0)
  out = out * scale_o
  if config.fp8_out:
    out = ref.quantize(out, 1.0, FP8)
  b, _, n, _ = q.shape
  return out.astype(config.out_dtype), lse, jnp.broadcast_to(amax, (b, n))


def _bwd_emulated(config, q, k, v, o, dout, lse, *rest):
  del o, lse
  (descale_q, descale_k, descale_v, _, descale_do, descale_s, _, scale_s, scale_dq, scale_dk,
   scale_dv, _) = rest[:_BWD_SCALES]
  q_lens, kv_lens = _lengths(config, rest[_BWD_SCALES:])
  real = [ref.dequantize(x, s) for x, s in ((q, descale_q), (k, descale_k), (v, descale_v))]
  attend = lambda *a: ref.attention(*a, query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens,
                                    scale_s=scale_s, descale_s=descale_s,
                                    **config.reference_kwargs())[0]
  _, vjp = jax.vjp(attend, *real)
  grads = vjp(ref.dequantize(dout, descale_do))
  return tuple((g * s).astype(GRAD_DTYPE) for g, s in zip(grads, (scale_dq, scale_dk, scale_dv)))


def _rule(backward, config, *shapes):
  """Batch and heads stay local; sequence and feature dims are whole; scales are scalars."""
  qkv = ["b t n h", "b s k h", "b s k d"]
  lens = ["b", "b"] if config.has_padding else []
  if backward:
    operands = qkv + ["b t n d", "b t n d", "b n t"] + [""] * _BWD_SCALES + lens
    results = qkv
  else:
    operands = qkv + [""] * _FWD_SCALES + lens
    results = ["b t n d", "b n t", "b n"]
  del shapes
  return ", ".join(operands) + " -> " + ", ".join(results)


_SHARDABLE = ("b", ("n", "k"))
_fwd = core.define("cudnn_jax_sdpa_fp8_fwd", impl=_fwd_emulated, cuda=_fwd_ffi,
                   shardable=_SHARDABLE, rule=functools.partial(_rule, False),
                   broadcast_leads=False)
_bwd = core.define("cudnn_jax_sdpa_fp8_bwd", impl=_bwd_emulated, cuda=_bwd_ffi,
                   shardable=_SHARDABLE, rule=functools.partial(_rule, True),
                   broadcast_leads=False)


def _batch_fwd(args, dims, *, config, partition=True):
  """vmap of the forward: one call per vmapped entry (lax.map), since cuDNN's amax covers a
  whole call and folding the entries into the batch would mix their amax."""
  moved = [None if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(args, dims)]

  def one(mapped):
    it = iter(mapped)
    return tuple(_fwd.p.bind(*[x if m is None else next(it) for x, m in zip(args, moved)],
                             config=config, partition=partition))

  outs = jax.lax.map(one, [m for m in moved if m is not None])
  return tuple(outs), (0,) * len(outs)


batching.primitive_batchers[_fwd.p] = _batch_fwd


# ---------------------------------------------------------------------------------------
# Differentiation: cuDNN's FP8 backward graph where it serves bf16 gradients, else cuDNN's
# bf16 attention backward on the dequantized inputs, else the xla engine's VJP.


def _f32(x):
  return jnp.asarray(x, jnp.float32)


def _scale_o(config, out_scale):
  return 1.0 / out_scale if config.fp8_out else jnp.ones((), jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def attention(config, backward_path, q, k, v, q_scale, k_scale, v_scale, out_scale, q_lens,
              kv_lens):
  """(out, amax) through cuDNN's FP8 graph; differentiable in q, k, v (bf16 gradients).

  ``backward_path``: a static callable returning "fp8", "bf16" or None, the backward that
  serves this call (see the section comment).
  """
  return _attention_fwd(config, backward_path, q, k, v, q_scale, k_scale, v_scale, out_scale,
                        q_lens, kv_lens)[0]


def _forward(config, q, k, v, q_scale, k_scale, v_scale, out_scale, q_lens, kv_lens):
  lens = () if q_lens is None else (q_lens, kv_lens)
  return _fwd(config, q, k, v, q_scale, k_scale, v_scale, _f32(1.0 / ref.P_SCALE),
              _f32(ref.P_SCALE), _scale_o(config, out_scale), *lens)


def _attention_fwd(config, backward_path, q, k, v, q_scale, k_scale, v_scale, out_scale,
                   q_lens, kv_lens):
  del backward_path
  out, lse, amax = _forward(config, q, k, v, q_scale, k_scale, v_scale, out_scale, q_lens,
                            kv_lens)
  amax = jnp.max(amax)
  res = (q, k, v, q_scale, k_scale, v_scale, out_scale, q_lens, kv_lens, out, lse, amax)
  return (out, amax), res


def _tiny(x):
  return jnp.maximum(x, jnp.finfo(jnp.float32).tiny)


def _fp8_backward(config, q, k, v, q_scale, k_scale, v_scale, out_scale, q_lens, kv_lens,
                  out, lse, amax, dout):
  """cuDNN's FP8 backward graph: dout quantized to e5m2 by its own amax, the out to e4m3
  (as it is when fp8), dP's scale from the bound hv * max|dout| * max|v|."""
  do_scale = _tiny(jnp.max(jnp.abs(dout))) / ref.E5M2_MAX
  do8 = ref.quantize(dout, do_scale, E5M2)
  if config.fp8_out:
    o8, descale_o = out, out_scale
  else:
    descale_o = _tiny(amax) / ref.E4M3_MAX
    o8 = ref.quantize(out, descale_o, FP8)
  v_max = jnp.max(jnp.abs(v.astype(jnp.float32))) * v_scale
  dp_bound = _tiny(v.shape[-1] * do_scale * ref.E5M2_MAX * v_max)
  scale_dp = ref.E5M2_MAX / dp_bound
  lens = () if q_lens is None else (q_lens, kv_lens)
  return _bwd(config, q, k, v, o8, do8, lse, q_scale, k_scale, v_scale, _f32(descale_o),
              do_scale, _f32(1.0 / ref.P_SCALE), 1.0 / scale_dp, _f32(ref.P_SCALE), q_scale,
              k_scale, v_scale, scale_dp, *lens)


def _bf16_backward(config, q, k, v, q_scale, k_scale, v_scale, q_lens, kv_lens, out, lse,
                   dout):
  """cuDNN's bf16 attention backward on the dequantized inputs (the probabilities' rounding
  passed straight through), times each input's scale."""
  from cudnn_jax.primitives import sdpa  # pylint: disable=g-import-not-at-top
  bf16 = lambda x, s: ref.dequantize(x, s).astype(jnp.bfloat16)
  grads = sdpa.sdpa_bwd(config.bf16_config(), bf16(q, q_scale), bf16(k, k_scale),
                        bf16(v, v_scale), out.astype(jnp.bfloat16), dout.astype(jnp.bfloat16),
                        lse, None, q_lens, kv_lens)
  return tuple((g.astype(jnp.float32) * s).astype(GRAD_DTYPE)
               for g, s in zip(grads[:3], (q_scale, k_scale, v_scale)))


def _attention_bwd(config, backward_path, res, cts):
  q, k, v, q_scale, k_scale, v_scale, out_scale, q_lens, kv_lens, out, lse, amax = res
  dout, _ = cts  # amax is a statistic: no gradient flows through it
  real_out = out.astype(jnp.float32)
  dout = dout.astype(jnp.float32)
  if config.fp8_out:  # the stored out is the real one times 1 / out_scale
    real_out, dout = real_out * out_scale, dout / out_scale
  path = backward_path()
  if path == "fp8":
    grads = _fp8_backward(config, q, k, v, q_scale, k_scale, v_scale, out_scale, q_lens,
                          kv_lens, out if config.fp8_out else real_out, lse, amax, dout)
  elif path == "bf16":
    grads = _bf16_backward(config, q, k, v, q_scale, k_scale, v_scale, q_lens, kv_lens,
                           real_out, lse, dout)
  else:
    attend = lambda *a: ref.attention(*a, query_seq_lengths=q_lens,
                                      key_value_seq_lengths=kv_lens,
                                      **config.reference_kwargs())[0]
    grads = ref.gradients(attend, q, k, v, q_scale, k_scale, v_scale, dout)
  return (*grads, *ref.scale_cotangents(q_scale, k_scale, v_scale, out_scale),
          *ref.length_cotangents(q_lens, kv_lens))


attention.defvjp(_attention_fwd, _attention_bwd)
