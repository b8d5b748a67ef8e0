"""The "triton" engine of Kimi Delta Attention and Gated DeltaNet: the chunked WY form of
``reference.kda`` with its costliest stages as Pallas kernels compiled by XLA through
Triton, and the reference's own functions for the rest.

Forward: the preprocessing, tokens to normalized float32 chunks with the gates summed
along each chunk (kda_scan.py); the intra-chunk stage, one program per chunk and head
(kda_intra.py); the state recurrence with the outputs, one program per sequence, head and
64 (or 32) value columns (kda_scan.py; packed sequences take the reference's scan).

Backward: the intra-chunk stage recomputed and differentiated in XLA (a kernel for its VJP
was slower than XLA's), with the pair sums within 16-token sub-blocks as kernels
(kda_intra.py) when the gates decay too fast for one product per sub-block; the
recurrence backwards as a kernel (kda_scan.py; packed sequences: the reference's scan);
the output and input gradients as in the reference.

GDN's per-head decay is KDA's per-channel decay, the same on every key channel: with a
scalar gate a_t, a_t (I - b k k^T) = (I - b k k^T) diag(a_t). So a scalar gate is
broadcast over the key channels (before the gating: dt_bias [HV, 1] broadcasts too) and
runs as KDA; the gradient of g sums over the channels.

Timings against FLA and the xla engine are in bench/NOTES.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cudnn_jax.reference import kda as ref
from cudnn_jax.reference import matmul_precision
from cudnn_jax.triton import kda_intra, kda_scan


def supports(chunk_size, k, v) -> str | None:
  """None when the kernels serve these sizes, else why not."""
  # Triton blocks are powers of two in every dimension, 16 at least for its dots.
  if any(d < 16 or d & (d - 1) for d in (chunk_size, k, v)):
    return f"chunk_size={chunk_size}, K={k}, V={v}: powers of two from 16 only"
  return None


# ---------------------------------------------------------------------------------------
# The backward's intra-chunk stage by the hierarchy, its leaves as kernels.


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _strict_pair(x, y, G, dt, interpret):
  """``reference.kda.strict_pair`` with the pairs within sub-blocks by kda_intra.py."""
  h = ref.leaf_size(G.shape[-2])
  inner = kda_intra.pairs(*(ref.blocks(z, h) for z in (x, y, G)), interpret=interpret)
  return ref.across_leaves(x, y, G, dt) + ref.block_diagonal(inner)


def _strict_pair_fwd(x, y, G, dt, interpret):
  return _strict_pair(x, y, G, dt, interpret), (x, y, G)


def _strict_pair_bwd(dt, interpret, res, dM):
  x, y, G = res
  h = ref.leaf_size(G.shape[-2])
  dx_in, dy_in = kda_intra.pairs_bwd(ref.diagonal_blocks(dM, h),
                                     *(ref.blocks(z, h) for z in res), interpret=interpret)
  dx_across, dy_across = ref.across_leaves_grads(dM, x, y, G, dt)
  dx = dx_across + dx_in.reshape(x.shape)
  dy = dy_across + dy_in.reshape(y.shape)
  return dx, dy, x * dx - y * dy  # G enters as +G_t and -G_s


_strict_pair.defvjp(_strict_pair_fwd, _strict_pair_bwd)


@jax.named_scope("kda_intra")
def _intra_by_hierarchy(q, k, v, G, b, dt, interpret):
  """``reference.kda.intra`` by the hierarchy, its leaves as kernels."""
  eG = jnp.exp(G)
  w, U = ref.solve_writes(k, v, b, eG, _strict_pair(k, k, G, dt, interpret))
  P = ref.with_diagonal(_strict_pair(q, k, G, dt, interpret), q, k)
  return ref.with_decays(q, k, G, eG, w, U, P)


# ---------------------------------------------------------------------------------------
# The chunked recurrence with its custom VJP (``reference.kda.chunked``'s contract).


def _forward(dt, interpret, q, k, v, G, beta, init, seg, with_states=True):
  with jax.named_scope("kda_intra"):
    it = kda_intra.intra(q, k, v, G, beta, dt, interpret=interpret)
  if seg is None:
    o, S, final = kda_scan.scan_output(it.w, it.U, it.kd, it.dec, it.qg, it.P, init,
                                       o_dtype=dt, precision=matmul_precision(dt),
                                       with_states=with_states, interpret=interpret)
  else:
    S, final = ref.state_scan(it, init, seg, dt)
    o = ref.outputs(it, S, dt)
  return (o, final), (q, k, v, G, beta, init, seg, S)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def chunked(dt, interpret, q, k, v, G, beta, init, seg):
  """``reference.kda.chunked`` (same arguments but ``interpret``, the Pallas interpreter
  in place of the GPU; same results), G per channel."""
  # Not differentiated: the scan writes no chunk states.
  return _forward(dt, interpret, q, k, v, G, beta, init, seg, with_states=False)[0]


def _chunked_bwd(dt, interpret, res, cts):
  # As in the reference: the whole pass in each branch of the span's lax.cond.
  return ref.by_span(functools.partial(_backward, dt, interpret, res, cts), res[3])


def _backward(dt, interpret, res, cts, by_sub_blocks):
  q, k, v, G, beta, init, seg, S = res
  do, dfinal = cts
  do = ref.to_chunk_layout(do, q.shape[-2]).astype(jnp.float32)
  # The intra stage recomputed with float32 operands, as in the reference (see there).
  if by_sub_blocks:
    stage = lambda *a: ref.intra(*a, ref.INTRA_GRAD_DTYPE, by_sub_blocks=True)
  else:
    stage = lambda *a: _intra_by_hierarchy(*a, ref.INTRA_GRAD_DTYPE, interpret)
  it, intra_vjp = jax.vjp(stage, q, k, v, G, beta)
  if seg is None:
    with jax.named_scope("kda_state_scan_bwd"):
      dS, du, dinit = kda_scan.scan_bwd(do, it.qg, it.w, it.kd, it.dec, it.P, dfinal,
                                        precision=matmul_precision(dt), interpret=interpret)
  else:
    (dS, dinit), du = ref.state_scan_bwd(it, do, dfinal, init, seg, dt), None
  d = ref.output_grads(it, S, do, dS, dt, du)
  with jax.named_scope("kda_intra_bwd"):
    dq, dk, dv, dG, db = intra_vjp(d)
  return dq, dk, dv, dG, db, dinit, None


chunked.defvjp(_forward, _chunked_bwd)


# ---------------------------------------------------------------------------------------
# The engine entry point.


def kda(q, k, v, g, beta, *, scale, qk_l2norm=False, chunk_size=64, interpret=False,
        **gating):
  """``reference.kda.kda`` on the kernels: same arguments (``gating``: its
  ``initial_state``, ``gate_in_kernel``, ``a_log``, ``dt_bias``, ``lower_bound``,
  ``beta_sigmoid``, ``allow_neg_eigval``, ``cu_seqlens``) and results. ``interpret``: run
  the kernels in the Pallas interpreter (any backend). ``chunk_size``, K and V must pass
  ``supports``."""
  if g.shape[-1] == 1:  # GDN's scalar gate, broadcast over the key channels
    g = jnp.broadcast_to(g, g.shape[:-1] + q.shape[-1:])
  x = ref.gated_tokens(q, k, v, g, beta, chunk_size=chunk_size, **gating)
  chunks = kda_scan.chunks(x.q, x.k, x.v, x.g, x.beta, scale, qk_l2norm, chunk_size,
                             interpret)
  o, final = chunked(q.dtype, interpret, *chunks, x.init,
                     None if x.pack is None else x.pack.seg)
  return ref.token_outputs(o, q.shape[1], x.pack), final
