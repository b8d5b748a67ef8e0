"""The ``"cudnn"`` engine of ``kda`` and ``gdn``: NVIDIA's sm_90 KDA kernels, which the cuDNN
frontend wheel ships as CUDA sources (``cudnn/linear_attention/hopper/cuda_kernels``) and
the extension compiles and hosts (ffi/kda_cudnn.cc), as two primitives, and the op
composed from them.

The kernels' layout: S streams (1 unless vmapped) of T packed tokens, K = V = 128,
``q, k [S,T,HQ,128]``, ``v [S,T,HV,128]`` bfloat16, ``g [S,T,HV,128]`` (log decay) and
``beta [S,T,HV]`` float32, sequences ``cu [S,N+1]`` int32 (never decreasing, within
``[0, T]``) with ``served [S,N]`` int32, states ``[S,N,HV,V,K]`` float32 (V-major: the
transpose of the op's ``[K,V]``).

- ``forward``: one fused kernel (``kda_fused``), with the l2 norm of q and k, the
  lower-bound gate ``lb sigmoid(exp(a_log) (g + dt_bias))`` and beta's sigmoid fused as
  the ``flags`` say, any query scale, value heads grouped over q/k heads. ``segmented``
  splits each sequence into pieces that start from a state rebuilt over earlier chunks
  until the gates' decay makes what is dropped negligible: exact within 1e-6 of the state
  only for l2-normalised q and k, beta in [0, 1] and a scale of at most 1/sqrt(128).
- ``backward``: four kernels (``k_meta``, ``k_prep``, ``k_scan_t``, ``k_bwd``; chunk 64) on
  inputs already normalised, gated and scaled (their scale fixed at 1/sqrt(128)), equal
  head counts.

With ``zero_unserved`` the handlers zero every token outside a served sequence (the
kernels run on each ``cu`` range, served or not). Off the GPU the same contracts run in
plain JAX on the reference (``cudnn_jax.reference.kda``).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cudnn_jax import _metadata
from cudnn_jax.primitives import _common, core
from cudnn_jax.reference import kda as ref

HEAD_DIM = 128  # K and V: the kernels' only head dim
KERNEL_SCALE = HEAD_DIM ** -0.5  # the backward's fixed query scale; the bound's largest
# The forward kernel's input fusions (its KDA_FUSED_FLAGS bits).
L2NORM, SAFE_GATE, BETA_SIGMOID = 1, 2, 4


class ForwardConfig(NamedTuple):
  flags: int = 0
  segmented: bool = False
  gate_lower_bound: float = -5.0
  q_scale: float = KERNEL_SCALE
  zero_unserved: bool = False

  def attributes(self):
    return dict(flags=np.int32(self.flags), segmented=np.bool_(self.segmented),
                gate_lower_bound=np.float32(self.gate_lower_bound),
                q_scale=np.float32(self.q_scale), zero_unserved=np.bool_(self.zero_unserved))


class BackwardConfig(NamedTuple):
  whole: bool = False  # one sequence of all T tokens: the kernels' path that reads no cu
  zero_unserved: bool = False

  def attributes(self):
    return dict(whole=np.bool_(self.whole), zero_unserved=np.bool_(self.zero_unserved))


def transposed(state):
  """``[..., K, V]`` <-> ``[..., V, K]``."""
  return jnp.swapaxes(state, -1, -2)


def owned(cu, served, t):
  """``[T]`` bool: token t lies in a served sequence (``cu`` never decreases)."""
  seq = jnp.searchsorted(cu, jnp.arange(t, dtype=cu.dtype), side="right") - 1
  n = served.shape[0]
  return (seq >= 0) & (seq < n) & (served[jnp.clip(seq, 0, n - 1)] != 0)


def sequences(cu_seqlens, t):
  """``cu_seqlens [N+1]`` (any entries) -> ``(cu [N+1], served [N])`` int32 as the kernels
  take them: ``cu`` its running maximum clipped to ``[0, T]``, so every served sequence
  (``_metadata.served_sequences``) keeps its range, the others get some range between
  them, and no kernel reads past the tokens."""
  cu = jnp.clip(jax.lax.cummax(cu_seqlens.astype(jnp.int32)), 0, t)
  _, lengths = _metadata.served_sequences(cu_seqlens, t)
  return cu, (lengths > 0).astype(jnp.int32)


def _zeroed(x, keep):
  return jnp.where(keep.reshape(keep.shape + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))


# ---------------------------------------------------------------------------------------
# Plain JAX: the handlers' contracts on any backend.


def _streams(fn, shared, *arrays):
  """``fn`` over the S streams; operands led by 1 (``shared``) are the same for each."""
  s = arrays[0].shape[0]
  return jax.vmap(fn)(*[jnp.broadcast_to(x, (s,) + x.shape[1:]) if i in shared else x
                        for i, x in enumerate(arrays)])


def _forward_emulated(config, q, k, v, g, beta, cu, served, s0, a_log, dt_bias):
  gate = bool(config.flags & SAFE_GATE)

  def one(q, k, v, g, beta, cu, served, s0, a_log, dt_bias):
    o, final = ref.kda(
        q[None], k[None], v[None], g[None], beta[None], scale=config.q_scale,
        initial_state=transposed(s0), qk_l2norm=bool(config.flags & L2NORM),
        gate_in_kernel=gate, a_log=a_log if gate else None,
        dt_bias=dt_bias if gate else None,
        lower_bound=config.gate_lower_bound if gate else None,
        beta_sigmoid=bool(config.flags & BETA_SIGMOID), cu_seqlens=cu)
    if config.zero_unserved:
      o = _zeroed(o[0], owned(cu, served, q.shape[0]))[None]
    return o[0].astype(jnp.bfloat16), transposed(final)

  return _streams(one, (8, 9), q, k, v, g, beta, cu, served, s0, a_log, dt_bias)


def _backward_emulated(config, do, q, k, v, g, beta, cu, served, s0, dfinal):
  def one(do, q, k, v, g, beta, cu, served, s0, dfinal):
    t = q.shape[0]
    ranges = jnp.array([0, t], jnp.int32) if config.whole else cu

    def forward(q, k, v, g, beta, s0):
      o, final = ref.kda(q[None], k[None], v[None], g[None], beta[None],
                         scale=KERNEL_SCALE, initial_state=transposed(s0), cu_seqlens=ranges)
      return o[0], transposed(final)

    _, vjp = jax.vjp(forward, q, k, v, g, beta, s0)
    grads = vjp((do, dfinal))
    if config.zero_unserved:
      keep = owned(cu, served, t)
      grads = tuple(_zeroed(x, keep) for x in grads[:5]) + grads[5:]
    return grads

  return _streams(one, (), do, q, k, v, g, beta, cu, served, s0, dfinal)


# ---------------------------------------------------------------------------------------
# The handlers' calls, one per stream.


def _per_stream(call, *arrays):
  s = arrays[0].shape[0]
  outs = [call(*[x[min(i, x.shape[0] - 1)] for x in arrays]) for i in range(s)]
  return tuple(jnp.stack(parts) for parts in zip(*outs))


def _forward_ffi(config, *arrays):
  def call(q, k, v, g, beta, cu, served, s0, a_log, dt_bias):
    results = (jax.ShapeDtypeStruct(v.shape, jnp.bfloat16), _common.with_shape(s0))
    return jax.ffi.ffi_call("cudnn_jax_kda_fwd", results)(
        q, k, v, g, beta, cu, served, s0, a_log, dt_bias, **config.attributes())

  return _per_stream(call, *arrays)


def _backward_ffi(config, *arrays):
  from cudnn_jax import _extension  # pylint: disable=g-import-not-at-top

  def call(do, q, k, v, g, beta, cu, served, s0, dfinal):
    t, h, _ = q.shape
    workspace = _extension.module().kda_bwd_workspace(t, h, served.shape[0])
    results = (*(_common.with_shape(x) for x in (q, k, v)),
               _common.with_shape(g), _common.with_shape(beta), _common.with_shape(s0),
               _common.workspace_result(workspace))
    return jax.ffi.ffi_call("cudnn_jax_kda_bwd", results)(
        do, q, k, v, g, beta, cu, served, s0, dfinal, **config.attributes())[:-1]

  return _per_stream(call, *arrays)


forward = core.define(
    "cudnn_jax_kda_fwd", impl=_forward_emulated, cuda=_forward_ffi, shardable=("s",),
    rule=("s t h k, s t h k, s t v e, s t v k, s t v, s c, s n, s n v e k, r v, r v k"
          " -> s t v e, s n v e k"))
backward = core.define(
    "cudnn_jax_kda_bwd", impl=_backward_emulated, cuda=_backward_ffi, shardable=("s",),
    broadcast_leads=False,
    rule=("s t v e, s t v k, s t v k, s t v e, s t v k, s t v, s c, s n, s n v e k, "
          "s n v e k -> s t v k, s t v k, s t v e, s t v k, s t v, s n v e k"))


# ---------------------------------------------------------------------------------------
# The op: preprocessing the kernels lack in XLA around them, gradients of all of it.


class Options(NamedTuple):
  """What is static about one call of the engine."""
  scale: float
  qk_l2norm: bool
  gate_in_kernel: bool
  lower_bound: float | None
  beta_sigmoid: bool
  allow_neg_eigval: bool
  varlen: bool

  @property
  def bound_holds(self) -> bool:
    """Whether the segmented forward's truncation bound holds whatever the values: q and k
    normalised in the kernel, beta a sigmoid in (0, 1), a scale of at most 1/sqrt(128)."""
    return (self.qk_l2norm and self.beta_sigmoid and not self.allow_neg_eigval
            and self.scale <= KERNEL_SCALE * (1 + 1e-6))

  @property
  def beta_checked(self) -> bool:
    """Whether the bound holds when beta, given as is, lies in [0, 1]: checked on the
    device, each call taking the segmented forward when it does and one piece per
    sequence when not."""
    return (self.qk_l2norm and not self.beta_sigmoid
            and self.scale <= KERNEL_SCALE * (1 + 1e-6))


def rule(options: Options) -> str:
  """How the engine runs a call, for ``explain``."""
  pieces = ("each sequence split in pieces across the GPU (the truncation bound holds: "
            "q/k l2-normalised in the kernel, beta a sigmoid, scale <= 1/sqrt(128))"
            if options.bound_holds else
            "each sequence split in pieces across the GPU when every beta is in [0, 1] "
            "(checked on the device), else one piece per sequence"
            if options.beta_checked else
            "one piece per sequence (the truncation bound needs q/k l2-normalised in the "
            "kernel, beta in [0, 1] and scale <= 1/sqrt(128))")
  fused = [n for n, on in zip(("l2norm", "lower-bound gate", "beta sigmoid"),
                              (options.qk_l2norm, *_fusions(options))) if on]
  return (f"NVIDIA's sm_90 kernels from nvidia-cudnn-frontend: kda_fused forward"
          f"{' with ' + ', '.join(fused) + ' fused' if fused else ''}, {pieces}; backward "
          "k_meta/k_prep/k_scan_t/k_bwd, its inputs' preprocessing and GVA in XLA")


def _gate_and_beta(o: Options, g, beta, a_log, dt_bias, *, fused):
  """``(g, beta)`` float32 as the kernels take them, g the log decay per channel (gdn: the
  head's gate on every channel); with ``fused``, the lower-bound gate and beta's sigmoid
  are left to the forward kernel where it has them (``_fusions``)."""
  safe_gate, sigmoid = _fusions(o) if fused else (False, False)
  g = g.astype(jnp.float32)
  if o.gate_in_kernel and not safe_gate:
    g = ref.gate(g, a_log, dt_bias, o.lower_bound)
  g = jnp.broadcast_to(g, g.shape[:-1] + (HEAD_DIM,))
  beta = beta.astype(jnp.float32)
  if o.beta_sigmoid and not sigmoid:
    beta = (2.0 if o.allow_neg_eigval else 1.0) * jax.nn.sigmoid(beta)
  return g, beta


def _fusions(o: Options):
  """Whether the forward kernel applies the lower-bound gate, and beta's sigmoid (not
  doubled for allow_neg_eigval)."""
  return (o.gate_in_kernel and o.lower_bound is not None,
          o.beta_sigmoid and not o.allow_neg_eigval)


def _kernel_inputs(o: Options, g, beta, a_log, dt_bias, hv):
  """``(flags, g, beta, a_log, dt_bias)`` as the forward kernel takes them: the fusions it
  has, the others applied here (a_log and dt_bias are read only by its gate)."""
  safe_gate, sigmoid = _fusions(o)
  flags = L2NORM * o.qk_l2norm | SAFE_GATE * safe_gate | BETA_SIGMOID * sigmoid
  g, beta = _gate_and_beta(o, g, beta, a_log, dt_bias, fused=True)
  a_log = jnp.zeros((hv,), jnp.float32) if a_log is None or not safe_gate else a_log
  dt_bias = (jnp.zeros((hv, HEAD_DIM), jnp.float32) if dt_bias is None or not safe_gate
             else jnp.broadcast_to(dt_bias, (hv, HEAD_DIM)))
  return flags, g, beta, a_log, dt_bias


def _preprocessed(o: Options, hv, q, k, g, beta, a_log, dt_bias):
  """The backward kernel's inputs from the op's: q and k normalised (q scaled so that the
  kernel's 1/sqrt(128) gives ``scale``) and repeated over grouped value heads, g and beta
  as ``_gate_and_beta`` with nothing fused; differentiable."""
  if o.qk_l2norm:
    q, k = ref.l2norm(q.astype(jnp.float32)), ref.l2norm(k.astype(jnp.float32))
  q = q * (o.scale / KERNEL_SCALE)
  group = hv // q.shape[-2]
  q, k = (jnp.repeat(x, group, axis=-2).astype(jnp.bfloat16) for x in (q, k))
  return (q, k, *_gate_and_beta(o, g, beta, a_log, dt_bias, fused=False))


def segmented_forward(o: Options, beta):
  """Whether the forward splits sequences into pieces: a Python bool, or a traced one
  when it depends on ``beta`` (the kernel's input), checked on the device."""
  if o.bound_holds:
    return True
  if o.beta_checked:
    return jnp.all((beta >= 0) & (beta <= 1))
  return False


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(o: Options, q, k, v, g, beta, s0, a_log, dt_bias, cu, served):
  """``(out [1,T,HV,V], final [1,N,HV,V,K])`` of one stream (the kernels' layout)."""
  return _attend_fwd(o, q, k, v, g, beta, s0, a_log, dt_bias, cu, served)[0]


def _attend_fwd(o, q, k, v, g, beta, s0, a_log, dt_bias, cu, served):
  hv = v.shape[-2]
  flags, gk, bk, ak, dk = _kernel_inputs(o, g, beta, a_log, dt_bias, hv)
  zero = o.varlen

  def run(segmented, *_):
    config = ForwardConfig(flags, segmented, -5.0 if o.lower_bound is None
                           else o.lower_bound, o.scale, zero)
    return forward(config, q, k, v, gk, bk, cu, served, s0, ak[None], dk[None])

  segmented = segmented_forward(o, bk)
  if isinstance(segmented, bool):
    out = run(segmented)
  else:
    out = jax.lax.cond(segmented, functools.partial(run, True), functools.partial(run, False))
  return tuple(out), (q, k, v, g, beta, s0, a_log, dt_bias, cu, served)


def _attend_bwd(o, res, cts):
  q, k, v, g, beta, s0, a_log, dt_bias, cu, served = res
  do, dfinal = cts
  hv = v.shape[-2]
  pre = functools.partial(_preprocessed, o, hv)
  (qk, kk, gk, bk), pre_vjp = jax.vjp(pre, q, k, g, beta, a_log, dt_bias)
  whole = not o.varlen and served.shape[-1] == 1
  config = BackwardConfig(whole=whole, zero_unserved=o.varlen)
  dq, dk, dv, dg, dbeta, ds0 = backward(config, do.astype(jnp.bfloat16), qk, kk, v, gk, bk,
                                        cu, served, s0, dfinal.astype(jnp.float32))
  dq, dk, dg, dbeta, da, ddt = pre_vjp((dq, dk, dg, dbeta))
  if o.varlen:  # an unserved sequence's final state is its initial state
    ds0 = jnp.where(served[..., None, None, None] != 0, ds0, dfinal)
  return (dq, dk, dv.astype(v.dtype), dg, dbeta, ds0, da, ddt, None, None)


_attend.defvjp(_attend_fwd, _attend_bwd)


def kda(options: Options, x):
  """The engine on ``KdaInputs`` x (ops/kda.py): ``(o [B,T,HV,V], final [N,HV,K,V])``."""
  b, t, _, _ = x.q.shape
  hv = x.v.shape[2]
  n = b if x.cu_seqlens is None else x.cu_seqlens.shape[0] - 1
  tokens = lambda a: a.reshape((1, b * t) + a.shape[2:])
  if x.cu_seqlens is None:  # the batch's rows as packed sequences, all served
    cu = jnp.arange(b + 1, dtype=jnp.int32) * t
    served = jnp.ones((b,), jnp.int32)
  else:
    cu, served = sequences(x.cu_seqlens, t)
  init = (jnp.zeros((n, hv, HEAD_DIM, HEAD_DIM), jnp.float32) if x.initial_state is None
          else x.initial_state.astype(jnp.float32))
  out, final = _attend(options, tokens(x.q), tokens(x.k), tokens(x.v), tokens(x.g),
                       tokens(x.beta), transposed(init)[None], x.a_log, x.dt_bias, cu[None],
                       served[None])
  final = transposed(final[0])
  if x.cu_seqlens is not None:  # an unserved sequence keeps its initial state
    final = jnp.where(served[:, None, None, None] != 0, final, init)
  return out.reshape(x.v.shape).astype(x.q.dtype), final


def supports(call) -> str | None:
  """None when the kernels serve the call (``call``: ops/kda.py's KdaCall), else why not."""
  from cudnn_jax import _extension  # pylint: disable=g-import-not-at-top
  if call.dtype != "bfloat16":
    return f"dtype {call.dtype}: the kernels take bfloat16 q, k, v"
  if (call.k, call.v) != (HEAD_DIM, HEAD_DIM):
    return f"K={call.k}, V={call.v}: the kernels take K = V = {HEAD_DIM}"
  if not math.isfinite(call.scale):
    return f"scale={call.scale}: not finite"
  return _extension.sm90_reason("cudnn_jax_kda_fwd")
