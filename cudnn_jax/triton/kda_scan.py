"""KDA's state recurrence over chunks, forward (with the chunk outputs) and backward, as
Pallas (Triton) kernels, and the preprocessing kernel that lays tokens out in chunks for it.

Forward: one program per (sequence, value head, block of BV value columns) walks the
chunks in order with its slice of the state ``S [K, BV]`` (float32) in registers:

    u   = U - w S                      (the chunk's corrected writes)
    o   = (q e^G) S + P u              (the chunk's outputs)
    S  <- diag(e^{G_C}) S + (k e^{G_C - G})^T u

``reference.kda.state_scan`` and ``outputs`` (one sequence per batch row; no
packed sequences), writing the chunk-entry states the backward pass reads. Backward: the
same programs walk the chunks in reverse with the gradient dS of the chunk's exit state:

    du  = P^T do + (k e^{G_C - G}) dS
    dS <- (q e^G)^T do - w^T du + diag(e^{G_C}) dS

``reference.kda.state_scan_bwd``, writing each chunk's dS and du.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from cudnn_jax.reference import kda as ref

BV = 64  # value columns per program
NUM_WARPS = 4
# Triton software-pipelines the loop's loads of the float32 [C, K] operands (w, q e^G and
# the decayed k: 96 KiB a step at C = 64, K = 128). Three stages asked for 288 KiB of shared
# memory on an H200 (227 KiB available), so the loads are not multi-buffered.
NUM_STAGES = 1
# Fewer programs than this at BV columns each leave streaming multiprocessors idle (an
# H100's or H200's count): then half as many columns per program, twice the programs (B=2
# HV=16 V=128 on an H200: forward 2.07 -> 1.40 ms, backward 3.07 -> 1.86 ms).
FEW_PROGRAMS = 132


def _tiling(b, hv, v, bv, num_warps, num_stages, forward):
  """The tiling asked for; None entries by the program count (see FEW_PROGRAMS)."""
  few = b * hv * max(v // BV, 1) < FEW_PROGRAMS and v % (BV // 2) == 0
  default = (BV // 2, NUM_WARPS, 2 if forward else 1) if few else (BV, NUM_WARPS, NUM_STAGES)
  return tuple(d if x is None else x for x, d in zip((bv, num_warps, num_stages), default))


def _kernel(w_ref, u_ref, kd_ref, dec_ref, qg_ref, p_ref, init_ref,
            o_ref, final_ref, states_ref=None, *, bv, precision):
  b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  cols = pl.ds(vb * bv, bv)
  c = w_ref.shape[3]
  dot = functools.partial(jnp.dot, precision=precision, preferred_element_type=jnp.float32)

  def step(i, S):
    if states_ref is not None:
      states_ref[i, b, h, :, cols] = S
    u = u_ref[i, b, h, :, cols] - dot(w_ref[i, b, h], S)
    o = dot(qg_ref[i, b, h], S) + dot(p_ref[i, b, h], u)
    o_ref[b, pl.ds(i * c, c), h, cols] = o.astype(o_ref.dtype)
    return dec_ref[i, b, h][:, None] * S + dot(kd_ref[i, b, h].T, u)

  final = jax.lax.fori_loop(0, w_ref.shape[0], step, init_ref[b, h, :, cols])
  final_ref[b, h, :, cols] = final


_TILING = ("bv", "num_warps", "num_stages")


@functools.partial(jax.jit, static_argnames=("o_dtype", "precision", "with_states",
                                             "interpret") + _TILING)
def scan_output(w, U, kd, dec, qg, P, init, *, o_dtype=jnp.float32, precision=None,
                with_states=True, interpret=False, bv=None, num_warps=None,
                num_stages=None):
  """``(o [B,NC*C,HV,V], chunk-entry states [NC,B,HV,K,V], final [B,HV,K,V])``: the
  outputs token by token in ``o_dtype``, the states float32; the states None unless
  ``with_states`` (the backward pass reads them; a forward pass alone saves writing [K, V]
  floats per chunk).

  w, kd, qg [NC,B,HV,C,K]; U [NC,B,HV,C,V]; dec [NC,B,HV,K]; P [NC,B,HV,C,C]; init
  [B,HV,K,V]. V must be a multiple of ``bv``, or at most ``bv`` (one block). ``precision``
  of the products (None: the backend's default, TF32 on NVIDIA GPUs for float32
  operands). ``bv``, ``num_warps``, ``num_stages``: the tiling (value columns per program)
  and Triton's options, None: by the program count."""
  nc, b, hv, c, _ = w.shape
  bv, num_warps, num_stages = _tiling(b, hv, U.shape[-1], bv, num_warps, num_stages, True)
  outs = [jax.ShapeDtypeStruct((b, nc * c, hv, U.shape[-1]), o_dtype), _f32(init.shape)]
  if with_states:
    outs.append(_f32((nc, *init.shape)))
  o, final, *states = _per_value_block(_kernel, (w, U, kd, dec, qg, P, init), outs,
                                       precision=precision, interpret=interpret, bv=bv,
                                       num_warps=num_warps, num_stages=num_stages)
  return o, (states[0] if with_states else None), final


def _f32(shape):
  return jax.ShapeDtypeStruct(shape, jnp.float32)


def _per_value_block(kernel, operands, outs, *, precision, interpret, bv, num_warps,
                     num_stages):
  """``kernel`` (bv and precision bound) on whole-array refs, one program per (sequence,
  head, bv value columns); the last operand is ``[B, HV, K, V]``; ``outs`` the results'
  shapes and dtypes."""
  b, hv, _, v = operands[-1].shape
  bv = min(bv, v)
  if v % bv:
    raise ValueError(f"V={v} is not a multiple of {bv}")
  return pl.pallas_call(
      functools.partial(kernel, bv=bv, precision=precision), grid=(b, hv, v // bv),
      out_shape=outs,
      in_specs=[pl.no_block_spec] * len(operands),
      out_specs=[pl.no_block_spec] * len(outs),
      interpret=interpret,
      compiler_params=pl_triton.CompilerParams(num_warps=num_warps,
                                               num_stages=num_stages))(*operands)


def _bwd_kernel(do_ref, qg_ref, w_ref, kd_ref, dec_ref, p_ref, dfinal_ref,
                ds_ref, du_ref, dinit_ref, *, bv, precision):
  b, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  cols = pl.ds(vb * bv, bv)
  dot = functools.partial(jnp.dot, precision=precision, preferred_element_type=jnp.float32)
  last = w_ref.shape[0] - 1

  def step(n, dS):
    i = last - n
    ds_ref[i, b, h, :, cols] = dS
    do = do_ref[i, b, h, :, cols]
    du = dot(p_ref[i, b, h].T, do) + dot(kd_ref[i, b, h], dS)
    du_ref[i, b, h, :, cols] = du
    return (dot(qg_ref[i, b, h].T, do) - dot(w_ref[i, b, h].T, du)
            + dec_ref[i, b, h][:, None] * dS)

  dinit_ref[b, h, :, cols] = jax.lax.fori_loop(0, last + 1, step,
                                               dfinal_ref[b, h, :, cols])


@functools.partial(jax.jit, static_argnames=("precision", "interpret") + _TILING)
def scan_bwd(do, qg, w, kd, dec, P, dfinal, *, precision=None, interpret=False, bv=None,
             num_warps=None, num_stages=None):
  """``(dS [NC,B,HV,K,V], du [NC,B,HV,C,V], dinit [B,HV,K,V])`` float32: the gradients of
  the chunk-exit states, of the chunks' corrected writes, and of the initial states.

  do [NC,B,HV,C,V]; qg, w, kd [NC,B,HV,C,K]; dec [NC,B,HV,K]; P [NC,B,HV,C,C]; dfinal
  [B,HV,K,V]. V, ``precision`` and the tiling as for ``scan_output``."""
  nc, b, hv, c, v = do.shape
  bv, num_warps, num_stages = _tiling(b, hv, v, bv, num_warps, num_stages, False)
  outs = [_f32((nc, *dfinal.shape)), _f32((nc, b, hv, c, v)), _f32(dfinal.shape)]
  return _per_value_block(_bwd_kernel, (do, qg, w, kd, dec, P, dfinal), outs,
                          precision=precision, interpret=interpret, bv=bv,
                          num_warps=num_warps, num_stages=num_stages)


# ---------------------------------------------------------------------------------------
# The preprocessing that feeds the recurrence, as one kernel: ``reference.kda.to_chunks``,
# tokens ``[B,T,*,D]`` to float32 chunks ``[NC,B,HV,C,D]`` with q and k l2-normalized, q
# scaled and the gates summed along each chunk, in one pass over the inputs (XLA takes a
# transpose, a normalization and a triangular matmul for the sums, each a round trip
# through memory). One program per chunk, batch row and value head. The VJP is that of the
# reference.

CHUNKS_WARPS = 4


def _chunks_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, qo_ref, ko_ref, vo_ref, go_ref, bo_ref, *,
            scale, l2norm_qk):
  q, k = q_ref[...].astype(jnp.float32), k_ref[...].astype(jnp.float32)
  if l2norm_qk:
    q, k = ref.l2norm(q), ref.l2norm(k)
  qo_ref[...] = q * scale
  ko_ref[...] = k
  vo_ref[...] = v_ref[...].astype(jnp.float32)
  go_ref[...] = jnp.cumsum(g_ref[...], axis=0)
  bo_ref[...] = b_ref[...]


def _chunks(q, k, v, g, beta, scale, l2norm_qk, c, interpret):
  b, t, h = q.shape[:3]
  hv = v.shape[2]
  if t % c:
    q, k, v, g, beta = (jnp.pad(x, ((0, 0), (0, -t % c)) + ((0, 0),) * (x.ndim - 2))
                        for x in (q, k, v, g, beta))
  nc = q.shape[1] // c
  per_head = lambda d, rep: pl.BlockSpec((None, c, None, d), lambda n, i, j: (i, n, j // rep, 0))
  per_chunk = lambda d: pl.BlockSpec((None, None, None, c, d), lambda n, i, j: (n, i, j, 0, 0))
  inputs = (q, k, v, g, beta)
  reps = (hv // h, hv // h, 1, 1, 1)
  return pl.pallas_call(
      functools.partial(_chunks_kernel, scale=scale, l2norm_qk=l2norm_qk), grid=(nc, b, hv),
      in_specs=[per_head(x.shape[-1], rep) for x, rep in zip(inputs, reps)],
      out_specs=[per_chunk(x.shape[-1]) for x in inputs],
      out_shape=[jax.ShapeDtypeStruct((nc, b, hv, c, x.shape[-1]), jnp.float32)
                 for x in inputs],
      interpret=interpret,
      compiler_params=pl_triton.CompilerParams(num_warps=CHUNKS_WARPS, num_stages=1))(*inputs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def chunks(q, k, v, g, beta, scale, l2norm_qk, c, interpret=False):
  """``reference.kda.to_chunks`` (same arguments and results; g [B,T,HV,Kg] and beta
  [B,T,HV,1] float32). ``c`` and every last dimension powers of two."""
  return _chunks(q, k, v, g, beta, scale, l2norm_qk, c, interpret)


def _chunks_fwd(q, k, v, g, beta, scale, l2norm_qk, c, interpret):
  return _chunks(q, k, v, g, beta, scale, l2norm_qk, c, interpret), (q, k, v, g, beta)


def _chunks_bwd(scale, l2norm_qk, c, interpret, inputs, cts):
  del interpret
  _, vjp = jax.vjp(lambda *x: ref.to_chunks(*x, scale, l2norm_qk, c), *inputs)
  return vjp(cts)


chunks.defvjp(_chunks_fwd, _chunks_bwd)
