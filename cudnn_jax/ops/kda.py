"""Kimi Delta Attention and Gated DeltaNet: ``cudnn_jax.kda`` and ``cudnn_jax.gdn``.

Argument names follow FLA's ``chunk_kda``. Both ops are linear attention with a delta-rule
state update and a decay gate: per channel (``kda``, ``g [B,T,HV,K]``) or per head
(``gdn``, ``g [B,T,HV]``).

The op's path: this module (arguments, engine choice, sharding), then an engine:
``"cudnn"`` (NVIDIA's sm_90 kernels from the cuDNN frontend wheel, hosted by the extension:
cudnn_jax/primitives/kda.py, ffi/kda_cudnn.cc), ``"triton"`` (cudnn_jax/triton/kda.py,
Pallas kernels composed with the reference's stages) or ``"xla"``
(cudnn_jax/reference/kda.py, pure JAX). Sequences and value heads are
independent, so on a device mesh the engine runs on each device's shard of the batch and
the heads (``core.per_shard``), with no communication.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cudnn_jax import _checks, _metadata, engines
from cudnn_jax.ops import kda_sequence_parallel
from cudnn_jax.primitives import core
from cudnn_jax.primitives import kda as cudnn_kda

CHUNK_SIZES = {"kda": (32, 64), "gdn": (16, 32, 64)}  # gdn's 16 as FLA's chunk_gated_delta_rule


class KdaInputs(NamedTuple):
  """The array arguments as the engines take them; absent ones are None."""
  q: jax.Array
  k: jax.Array
  v: jax.Array
  g: jax.Array  # [B,T,HV,K], or [B,T,HV,1] for the scalar gate
  beta: jax.Array
  initial_state: jax.Array | None = None
  a_log: jax.Array | None = None
  dt_bias: jax.Array | None = None  # [HV,K], or [HV,1] for the scalar gate
  cu_seqlens: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class KdaCall:
  """Everything static about one call: what engines decide on."""
  op: str  # "kda" or "gdn"
  b: int
  t: int
  h: int
  hv: int
  k: int
  v: int
  n: int  # sequences: B, or len(cu_seqlens) - 1
  dtype: str
  scale: float
  has_initial_state: bool = False
  output_final_state: bool = False
  qk_l2norm: bool = False
  gate_in_kernel: bool = False
  has_a_log: bool = False
  has_dt_bias: bool = False
  lower_bound: float | None = None
  beta_sigmoid: bool = False
  allow_neg_eigval: bool = False
  varlen: bool = False
  chunk_size: int = 64


def _float32(name, x, shape):
  _checks.shape_of(name, x)
  _checks.float_dtype(name, x, (jnp.float32,))
  _checks.expect_shape(name, x, shape)


# What FLA's chunk_kda / chunk_gated_delta_rule do with an argument their flags leave
# unused: silently ignore it. Here it raises, saying so.
_FLA_IGNORES = {
    "a_log": "FLA would ignore it and read g as the log decay",
    "dt_bias": "FLA would ignore it and read g as the log decay",
    "lower_bound": "FLA would ignore it and read g as the log decay",
    "allow_neg_eigval": "FLA would ignore it and use beta as given",
}


def _a_log(a_log, A_log):  # pylint: disable=invalid-name
  """``a_log``, also under FLA's spelling ``A_log`` (not both)."""
  if A_log is None:
    return a_log
  if a_log is not None:
    raise ValueError("a_log, A_log: the same argument under two spellings; give one")
  return A_log


def _prepare(q, k, v, g, beta, *, op, scale=None, initial_state=None,
             output_final_state=False, use_qk_l2norm_in_kernel=False,
             use_gate_in_kernel=False, a_log=None, dt_bias=None, lower_bound=None,
             use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, cu_seqlens=None,
             chunk_size=64, sequence_parallel_axis=None, implementation=None,
             A_log=None):  # pylint: disable=invalid-name
  """Validates the user's arguments into ``(KdaCall, operands)``: the arrays present, in
  the order of ``_rule``, as JAX arrays, ``dt_bias`` as ``[HV,K]`` (kda) or ``[HV]`` (gdn)."""
  del implementation
  if sequence_parallel_axis is not None and not isinstance(sequence_parallel_axis, str):
    raise TypeError("sequence_parallel_axis: expected a mesh axis name (str) or None, got "
                    f"{sequence_parallel_axis!r}")
  a_log = _a_log(a_log, A_log)
  scalar_gate = op == "gdn"
  _checks.shape_of("q", q, 4)
  _checks.shape_of("k", k, 4)
  _checks.shape_of("v", v, 4)
  for name, x in (("q", q), ("k", k), ("v", v)):
    _checks.float_dtype(name, x)
  if not q.dtype == k.dtype == v.dtype:
    raise TypeError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  b, t, h, kdim = q.shape
  _checks.expect_shape("k", k, q.shape)
  if h < 1 or kdim < 1:
    raise ValueError(f"q: expected [B,T,H,K] with H >= 1 heads and head dim K >= 1 (the "
                     f"scale is K**-0.5), got {tuple(q.shape)}")
  hv, vdim = v.shape[2], v.shape[3]
  if v.shape[:2] != (b, t):
    raise ValueError(f"v: expected [B,T,HV,V] with B={b}, T={t}, got {tuple(v.shape)}")
  if hv % h:
    raise ValueError(f"v: value heads HV={hv} must be a multiple of q/k heads H={h}")
  _checks.shape_of("g", g)
  _checks.float_dtype("g", g)
  _checks.expect_shape("g", g, (b, t, hv) if scalar_gate else (b, t, hv, kdim))
  _checks.shape_of("beta", beta)
  _checks.float_dtype("beta", beta)
  _checks.expect_shape("beta", beta, (b, t, hv))

  n = b
  if cu_seqlens is not None:
    _checks.shape_of("cu_seqlens", cu_seqlens, 1)
    _checks.int_dtype("cu_seqlens", cu_seqlens)
    if cu_seqlens.shape[0] < 2:
      raise ValueError(f"cu_seqlens: expected [N+1] with N >= 1, got {tuple(cu_seqlens.shape)}")
    if b != 1:
      raise ValueError(f"cu_seqlens: packed sequences need batch size 1, got B={b}")
    n = cu_seqlens.shape[0] - 1
  if initial_state is not None:
    _float32("initial_state", initial_state, (n, hv, kdim, vdim))

  _checks.flag("use_gate_in_kernel", use_gate_in_kernel)
  for name, x in (("a_log", a_log), ("dt_bias", dt_bias), ("lower_bound", lower_bound)):
    if x is not None and not use_gate_in_kernel:
      raise ValueError(f"{name}: only used with use_gate_in_kernel=True ({_FLA_IGNORES[name]})")
  if a_log is not None:
    _float32("a_log", a_log, (hv,))
  if dt_bias is not None:
    _dt_bias(dt_bias, hv, 1 if scalar_gate else kdim)
  if lower_bound is not None:
    if not isinstance(lower_bound, (int, float)) or isinstance(lower_bound, bool):
      raise TypeError(f"lower_bound: expected a Python float or None, got {lower_bound!r}")
    if not -5.0 <= lower_bound < 0.0:
      raise ValueError(f"lower_bound: expected a value in [-5, 0), got {lower_bound}")
    lower_bound = float(lower_bound)
  elif use_gate_in_kernel and a_log is None:
    raise ValueError("a_log: required with use_gate_in_kernel=True (unless lower_bound is set)")
  _checks.flag("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel)
  if _checks.flag("allow_neg_eigval", allow_neg_eigval) and not use_beta_sigmoid_in_kernel:
    raise ValueError("allow_neg_eigval: only used with use_beta_sigmoid_in_kernel=True "
                     f"({_FLA_IGNORES['allow_neg_eigval']})")

  if scale is None:
    scale = kdim ** -0.5
  elif not isinstance(scale, (int, float)) or isinstance(scale, bool):
    raise TypeError(f"scale: expected a Python float or None, got {type(scale).__name__}")
  _checks.one_of("chunk_size", chunk_size, CHUNK_SIZES[op])

  call = KdaCall(
      op=op, b=b, t=t, h=h, hv=hv, k=kdim, v=vdim, n=n, dtype=jnp.dtype(q.dtype).name,
      scale=float(scale), has_initial_state=initial_state is not None,
      output_final_state=_checks.flag("output_final_state", output_final_state),
      qk_l2norm=_checks.flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel),
      gate_in_kernel=use_gate_in_kernel, has_a_log=a_log is not None,
      has_dt_bias=dt_bias is not None, lower_bound=lower_bound,
      beta_sigmoid=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
      varlen=cu_seqlens is not None, chunk_size=int(chunk_size))
  if dt_bias is not None:  # with the value heads it belongs to
    dt_bias = jnp.reshape(dt_bias, (hv,) if scalar_gate else (hv, kdim))
  operands = (q, k, v, g, beta, initial_state, a_log, dt_bias, cu_seqlens)
  return call, tuple(jnp.asarray(x) for x in operands if x is not None)


def _dt_bias(dt_bias, hv, kg):
  """``dt_bias`` float32 ``[HV*Kg]`` or ``[HV, Kg]`` (FLA takes either), ``Kg`` = K (kda)
  or 1 (gdn: ``[HV]``, ``[HV, 1]``)."""
  _checks.shape_of("dt_bias", dt_bias)
  _checks.float_dtype("dt_bias", dt_bias, (jnp.float32,))
  if tuple(dt_bias.shape) not in ((hv * kg,), (hv, kg)):
    forms = f"({hv * kg},)" + ("" if kg == 1 else f" ([HV*K]) or ({hv}, {kg}) ([HV,K])")
    raise ValueError(f"dt_bias: expected shape {forms}, got {tuple(dt_bias.shape)}")


def _rule(config, *shapes):
  """``core.per_shard``'s rule: the factors of every operand, then of (o, final_state).
  Batch rows (b) and heads (q/k heads h with value heads v) are independent; packed
  sequences (n) share the one batch row, so only their heads may be sharded."""
  del shapes
  _, call = config
  n = "n" if call.varlen else "b"
  gate = "b t v k" if call.op == "kda" else "b t v"
  terms = ["b t h k", "b t h k", "b t v e", gate, "b t v"]
  terms += [f"{n} v k e"] * call.has_initial_state + ["v"] * call.has_a_log
  terms += ["v k" if call.op == "kda" else "v"] * call.has_dt_bias + ["c"] * call.varlen
  return f"{', '.join(terms)} -> b t v e, {n} v k e"


def _inputs(call: KdaCall, operands) -> KdaInputs:
  """The operands (maybe one device's shard of them) as the engines take them."""
  it = iter(operands)
  q, k, v, g, beta = (next(it) for _ in range(5))
  take = lambda present: next(it) if present else None
  initial_state, a_log, dt_bias, cu_seqlens = (
      take(call.has_initial_state), take(call.has_a_log), take(call.has_dt_bias),
      take(call.varlen))
  if call.op == "gdn":
    g = g[..., None]
    dt_bias = None if dt_bias is None else dt_bias[:, None]
  return KdaInputs(q, k, v, g, beta, initial_state, a_log, dt_bias, cu_seqlens)


def _on_shard(config, *operands):
  """What one device computes: the engine named in ``config`` on its shard. The call's
  sizes are the whole call's; the engines read the shard's from the arrays."""
  name, call = config
  return tuple(engines.engine(call.op, name).run(call, _inputs(call, operands)))


_per_shard = core.per_shard("kda", _on_shard, _rule, shardable=("b", ("h", "v")))


def _apply(op, q, k, v, g, beta, kwargs):
  call, operands = _prepare(q, k, v, g, beta, op=op, **kwargs)
  if call.varlen:  # under checkify only
    _metadata.check_cu_seqlens("cu_seqlens", kwargs["cu_seqlens"], call.t)
  if kwargs["sequence_parallel_axis"] is not None:
    return _sequence_parallel(op, call, operands, kwargs)
  engine = engines.choose(op, call, kwargs.get("implementation"))
  o, final_state = _per_shard((engine.name, call), *operands)
  return o, (final_state if call.output_final_state else None)


def _sequence_parallel(op, call, operands, kwargs):
  """``_apply`` over the token shards along ``sequence_parallel_axis``
  (kda_sequence_parallel.py): each device calls the op on its span."""
  x = _inputs(call, operands)
  g = x.g[..., 0] if op == "gdn" else x.g
  implementation = kwargs["implementation"]
  options = (("scale", call.scale), ("use_qk_l2norm_in_kernel", call.qk_l2norm),
             ("use_gate_in_kernel", call.gate_in_kernel), ("lower_bound", call.lower_bound),
             ("use_beta_sigmoid_in_kernel", call.beta_sigmoid),
             ("allow_neg_eigval", call.allow_neg_eigval), ("chunk_size", call.chunk_size),
             ("implementation", implementation if implementation is None
              or isinstance(implementation, str) else tuple(implementation)))
  dt_bias = x.dt_bias if x.dt_bias is None or op == "kda" else x.dt_bias[:, 0]
  o, final_state = kda_sequence_parallel.sequence_parallel(
      {"kda": kda, "gdn": gdn}[op], x.q, x.k, x.v, g, x.beta,
      axis=kwargs["sequence_parallel_axis"], initial_state=x.initial_state, a_log=x.a_log,
      dt_bias=dt_bias, cu_seqlens=x.cu_seqlens, options=options)
  return o, (final_state if call.output_final_state else None)


def kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, a_log=None, dt_bias=None,
        lower_bound=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
        cu_seqlens=None, chunk_size=64, sequence_parallel_axis=None, implementation=None,
        A_log=None):  # pylint: disable=invalid-name
  """Kimi Delta Attention (chunked; argument names as in FLA's ``chunk_kda``).

  ``q, k [B,T,H,K]``, ``v [B,T,HV,V]`` with ``HV % H == 0`` (value head h reads q/k head
  ``h // (HV // H)``), ``g [B,T,HV,K]`` log-space per-channel decay, ``beta [B,T,HV]``.
  Per sequence and value head, with a float32 state ``S [K,V]``::

      S <- diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T (scale q_t)

  ``scale`` defaults to ``K**-0.5``. Preprocessing: ``use_qk_l2norm_in_kernel`` normalizes
  q and k (``x / sqrt(sum x^2 + 1e-6)``); ``use_beta_sigmoid_in_kernel`` takes
  ``beta <- sigmoid(beta)`` (``2 sigmoid(beta)`` with ``allow_neg_eigval``);
  ``use_gate_in_kernel`` takes a raw g: ``g <- -exp(a_log)[h] softplus(g + dt_bias[h,k])``
  (``a_log [HV]``, also spelled ``A_log`` as in FLA; optional ``dt_bias [HV*K]`` or
  ``[HV,K]``; both float32), or with ``lower_bound`` lb in [-5, 0):
  ``g <- lb sigmoid(exp(a_log)[h] (g + dt_bias))`` (a_log optional there). An argument its
  flag leaves unused (a_log, dt_bias, lower_bound without ``use_gate_in_kernel``,
  ``allow_neg_eigval`` without ``use_beta_sigmoid_in_kernel``) raises ValueError, where
  FLA would ignore it.

  ``initial_state [N,HV,K,V]`` float32 (zeros when None). ``cu_seqlens [N+1]`` int32 packs
  N sequences along T (B must be 1); each starts from its own initial state, and a
  zero-length one returns its initial state. Sequence i is served only when
  ``0 <= cu[i] <= cu[i+1] <= T`` and ``cu[i]`` is at least every earlier entry; any other
  is empty (its final state is its initial state, or zeros) and tokens no served sequence
  owns output 0. Under ``jax.experimental.checkify.checkify`` (user checks) such an entry
  raises an error naming ``cu_seqlens`` and the entry. ``chunk_size`` (32 or 64; gdn also
  16) only tunes speed.

  Under ``jax.jit`` with inputs sharded on a device mesh (either axis type, inside
  ``jax.set_mesh`` or not), each device computes on its shard of the batch (of N for
  ``initial_state``; not with ``cu_seqlens``) and of the heads (q/k heads and value heads
  on the same mesh axes, where H divides), with no communication; the outputs keep that
  sharding. Other dimensions are made whole on each device.

  ``sequence_parallel_axis``: the name of a mesh axis (of ``jax.set_mesh``'s mesh, or the
  one the inputs are explicitly sharded on) along which the tokens (T) are sharded; T must
  divide into its devices. Each device runs the op over its span from a zero state, which
  also gives its span's state map ``S_out = M S_in + B``; the maps are combined in device
  order and each device runs its span again from the state entering it. Values, final
  states and gradients equal the unsharded call's, with ``initial_state`` and with
  ``cu_seqlens`` (sequences may cross span boundaries); o is sharded along T on that axis.
  It costs two passes over each device's tokens (cudnn_jax/ops/kda_sequence_parallel.py).

  Returns ``(o [B,T,HV,V]`` in q's dtype, ``final_state [N,HV,K,V]`` float32 or None unless
  ``output_final_state``). Differentiable in q, k, v, g, beta, initial_state, a_log,
  dt_bias. ``implementation``: None, "cudnn" (NVIDIA's sm_90 kernels from the cuDNN
  frontend; bfloat16, K = V = 128, Hopper), "triton" (Pallas kernels through Triton; NVIDIA
  GPUs), "xla", or a sequence of those, as for every op.
  """
  kwargs = {k_: v_ for k_, v_ in locals().items() if k_ not in ("q", "k", "v", "g", "beta")}
  return _apply("kda", q, k, v, g, beta, kwargs)


def gdn(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, a_log=None, dt_bias=None,
        lower_bound=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
        cu_seqlens=None, chunk_size=64, sequence_parallel_axis=None, implementation=None,
        A_log=None):  # pylint: disable=invalid-name
  """Gated DeltaNet: ``cudnn_jax.kda`` with a scalar gate per head.

  ``g [B,T,HV]`` (``diag(exp(g_t))`` becomes ``exp(g_t) I``), ``dt_bias [HV]`` (or
  ``[HV,1]``) and ``chunk_size`` 16, 32 or 64; every other argument and the result are as
  in ``cudnn_jax.kda``.
  """
  kwargs = {k_: v_ for k_, v_ in locals().items() if k_ not in ("q", "k", "v", "g", "beta")}
  return _apply("gdn", q, k, v, g, beta, kwargs)


def _options(call: KdaCall, x: KdaInputs):
  """The engines' keyword arguments."""
  return dict(scale=call.scale, initial_state=x.initial_state, qk_l2norm=call.qk_l2norm,
              gate_in_kernel=call.gate_in_kernel, a_log=x.a_log, dt_bias=x.dt_bias,
              lower_bound=call.lower_bound, beta_sigmoid=call.beta_sigmoid,
              allow_neg_eigval=call.allow_neg_eigval, cu_seqlens=x.cu_seqlens,
              chunk_size=call.chunk_size)


def _run_xla(call: KdaCall, x: KdaInputs):
  from cudnn_jax.reference import kda as ref  # pylint: disable=g-import-not-at-top
  return ref.kda(x.q, x.k, x.v, x.g, x.beta, **_options(call, x))


# "triton": our Pallas kernels compiled by XLA through Triton (cudnn_jax/triton/kda.py
# composes them with the xla engine's stages), the default on a GPU. gdn runs as kda, its
# per-head gate broadcast over the key channels.


def _supports_triton(call: KdaCall) -> str | None:
  if (backend := jax.default_backend()) != "gpu":
    return f"default backend is {backend!r}, not 'gpu'"
  from cudnn_jax.triton import kda as triton_kda  # pylint: disable=g-import-not-at-top
  return triton_kda.supports(call.chunk_size, call.k, call.v)


def _run_triton(call: KdaCall, x: KdaInputs):
  from cudnn_jax.triton import kda as triton_kda  # pylint: disable=g-import-not-at-top
  return triton_kda.kda(x.q, x.k, x.v, x.g, x.beta, **_options(call, x))


# "cudnn": NVIDIA's sm_90 KDA kernels (cudnn_jax/primitives/kda.py): the fused forward
# and the four-kernel backward, the preprocessing they lack in XLA around them.


def _cudnn_options(call: KdaCall) -> cudnn_kda.Options:
  return cudnn_kda.Options(
      scale=call.scale, qk_l2norm=call.qk_l2norm,
      gate_in_kernel=call.gate_in_kernel, lower_bound=call.lower_bound,
      beta_sigmoid=call.beta_sigmoid, allow_neg_eigval=call.allow_neg_eigval,
      varlen=call.varlen)


def _run_cudnn(call: KdaCall, x: KdaInputs):
  return cudnn_kda.kda(_cudnn_options(call), x)


for _op in ("kda", "gdn"):
  engines.register_op(_op, lambda *a, _op=_op, **kw: _prepare(*a, op=_op, **kw)[0])
  engines.register_engine(_op, "cudnn", supports=cudnn_kda.supports, run=_run_cudnn,
                          opt_in=True, describe=lambda c: cudnn_kda.rule(_cudnn_options(c)))
  engines.register_engine(_op, "triton", supports=_supports_triton, run=_run_triton)
  engines.register_engine(_op, "xla", supports=lambda call: None, run=_run_xla)
