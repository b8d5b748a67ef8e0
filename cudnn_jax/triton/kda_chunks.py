"""KDA's preprocessing as one Pallas (Triton) kernel: ``reference.kda.to_chunks``, tokens
``[B,T,*,D]`` to float32 chunks ``[NC,B,HV,C,D]`` with q and k l2-normalized, q scaled and
the gates summed along each chunk, in one pass over the inputs (XLA takes a transpose,
a normalization and a triangular matmul for the sums, each a round trip through memory).
One program per chunk, batch row and value head. The VJP is that of the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from cudnn_jax.reference import kda as ref

NUM_WARPS = 4


def _kernel(q_ref, k_ref, v_ref, g_ref, b_ref, qo_ref, ko_ref, vo_ref, go_ref, bo_ref, *,
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
      functools.partial(_kernel, scale=scale, l2norm_qk=l2norm_qk), grid=(nc, b, hv),
      in_specs=[per_head(x.shape[-1], rep) for x, rep in zip(inputs, reps)],
      out_specs=[per_chunk(x.shape[-1]) for x in inputs],
      out_shape=[jax.ShapeDtypeStruct((nc, b, hv, c, x.shape[-1]), jnp.float32)
                 for x in inputs],
      interpret=interpret,
      compiler_params=pl_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=1))(*inputs)


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
