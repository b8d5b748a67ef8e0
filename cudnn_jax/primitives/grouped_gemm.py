"""The grouped matmuls of the GPU engines as primitives (``core.define``), over a batch.

Operands: ``lhs [B, M, K]`` (each batch's rows sorted by group), ``rhs [R, G, K, C]``
(R = 1: shared by the batch, or B), ``group_sizes [B, G]`` int32 (negative sizes count as
0, and a batch's groups end at M):

- ``matmul(lhs, rhs, group_sizes) -> [B, M, C]``: cuDNN's MoE grouped matmul node
  (ffi/grouped_matmul_cudnn.cc), lhs's dtype.
- ``fused(epilogue, lhs, rhs, bias [R, G, C] float32, group_sizes) -> [B, M, N]``: our CuTe
  DSL kernel (kernels/grouped_gemm_sm90.py) with the epilogue fused: ``epilogue(lhs @
  rhs[g] + bias[g])``, lhs's dtype; C = N, or 2N for a GLU.
- ``wgrad(lhs, ct [B, M, N], group_sizes) -> [B, G, K, N]`` float32: ``lhs[rows of g]^T
  ct[rows of g]`` (kernels/grouped_wgrad_sm90.py).

Rows past a batch's groups are 0. A handler call serves one batch; for B > 1 the rows of
every batch are gathered into one group order (batch b's group g is group b*G + g, or g
when rhs is shared), run as one call, and put back. Off the GPU the same contracts run in
plain JAX (``lax.ragged_dot``). Batches stay local on a mesh, and so do the output columns
of a product without a GLU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cudnn_jax import epilogue as epilogues
from cudnn_jax.primitives import _common, core
from cudnn_jax.reference import gemm as ref


# ---------------------------------------------------------------------------------------
# Plain JAX: the handlers' contracts on any backend.


def _per_batch(fn, rhs_like, *arrays):
  """``fn`` vmapped over the batch; operands whose batch is 1 (``rhs_like``) broadcast."""
  b = arrays[0].shape[0]
  return jax.vmap(fn)(*[jnp.broadcast_to(x, (b,) + x.shape[1:]) if i in rhs_like else x
                        for i, x in enumerate(arrays)])


def _product(lhs, rhs, group_sizes):
  return jax.lax.ragged_dot(lhs, rhs, ref.clamped_sizes(group_sizes, lhs.shape[0]),
                            precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)


def _matmul_emulated(config, lhs, rhs, group_sizes):
  del config
  return (_per_batch(_product, (1,), lhs, rhs, group_sizes).astype(lhs.dtype),)


def _glu_or_activation(name):
  glu = name if name in epilogues.GLU_ACTIVATION else None
  return dict(glu=glu, activation=None if glu or name == "none" else name)


def _fused_emulated(epilogue, lhs, rhs, bias, group_sizes):
  def one(lhs, rhs, bias, sizes):
    sizes = ref.clamped_sizes(sizes, lhs.shape[0])
    return ref.grouped_epilogue(_product(lhs, rhs, sizes), sizes, bias,
                                **_glu_or_activation(epilogue))
  return (_per_batch(one, (1, 2), lhs, rhs, bias, group_sizes).astype(lhs.dtype),)


def _wgrad_emulated(config, lhs, ct, group_sizes):
  del config
  outer = lambda l, c, s: ref.grouped_outer(l, c, ref.clamped_sizes(s, l.shape[0]))
  return (jax.vmap(outer)(lhs, ct.astype(lhs.dtype), group_sizes),)


# ---------------------------------------------------------------------------------------
# The handlers' calls.


def _regrouped(call, lhs, group_sizes, shared, *rows):
  """``call(lhs_rows [B*M, K], sizes [G'], *rows_like) -> [B*M, N]`` over every batch at
  once: rows gathered by (batch, group), or by group when ``shared``; results back in
  place, each batch's rows past its groups 0 (they sort last, past every group)."""
  b, m, _ = lhs.shape
  g = group_sizes.shape[1]
  sizes = ref.clamped_sizes(group_sizes, m)
  if b == 1:
    return call(lhs[0], sizes[0], *[x[0] for x in rows])[None]
  gid = jax.vmap(ref.group_ids, (0, None))(sizes, m)  # [B, M], G past the groups
  groups = g if shared else b * g
  key = jnp.where(gid < g, gid if shared else gid + g * jnp.arange(b)[:, None], groups)
  order = jnp.argsort(key.reshape(-1), stable=True)
  counts = jnp.bincount(key.reshape(-1), length=groups + 1)[:groups].astype(jnp.int32)
  gather = lambda x: x.reshape((b * m,) + x.shape[2:])[order]
  out = call(gather(lhs), counts, *[gather(x) for x in rows])
  return out[ref.inverse_permutation(order)].reshape((b, m) + out.shape[1:])


def _matmul_ffi(config, lhs, rhs, group_sizes):
  del config

  def call(rows, sizes):
    from cudnn_jax import _extension  # pylint: disable=g-import-not-at-top
    weights = jnp.swapaxes(rhs.reshape((-1,) + rhs.shape[2:]), 1, 2)  # [G', N, K], K fastest
    (m, k), (groups, n, _) = rows.shape, weights.shape
    workspace = _extension.module().grouped_matmul_workspace(
        dict(dtype=jnp.dtype(rows.dtype).name, m=m, k=k, n=n, groups=groups))
    offsets = jnp.cumsum(sizes) - sizes  # first row of each group; the last runs to M
    out, _ = jax.ffi.ffi_call(
        "cudnn_jax_grouped_matmul",
        (jax.ShapeDtypeStruct((m, n), rows.dtype), _common.workspace_result(workspace)))(
            rows, weights, offsets.astype(jnp.int32))
    return jnp.where((jnp.arange(m) < jnp.sum(sizes))[:, None], out, jnp.zeros((), out.dtype))

  return (_regrouped(call, lhs, group_sizes, rhs.shape[0] == 1),)


def _starts(sizes):
  """``[G+1]`` int32 row starts and row-tile starts of groups of ``sizes [G]``."""
  from cudnn_jax import _extension  # pylint: disable=g-import-not-at-top
  tiles = -(-sizes // _extension.kernel_constants()["grouped_gemm"]["tile_m"])
  return tuple(jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(x)]).astype(jnp.int32)
               for x in (sizes, tiles))


def _fused_ffi(epilogue, lhs, rhs, bias, group_sizes):
  weights, bias = (x.reshape((-1,) + x.shape[2:]) for x in (rhs, bias))
  columns = rhs.shape[3] // (2 if epilogue in epilogues.GLU_ACTIVATION else 1)

  def call(rows, sizes):
    row_starts, tile_starts = _starts(sizes)
    return jax.ffi.ffi_call(
        "cudnn_jax_cute_grouped_gemm", jax.ShapeDtypeStruct((rows.shape[0], columns), rows.dtype))(
            rows, weights, bias, tile_starts, row_starts, epilogue=epilogue)

  return (_regrouped(call, lhs, group_sizes, rhs.shape[0] == 1),)


def _regrouped_outer(call, lhs, ct, group_sizes):
  """``call(lhs_rows [B*M, K], ct_rows [B*M, N], sizes [G']) -> [G', K, N]`` over every
  batch at once, one group per (batch, group) so that their sums stay apart: ``[B, G, K,
  N]``."""
  b, m, _ = lhs.shape
  g = group_sizes.shape[1]
  sizes = ref.clamped_sizes(group_sizes, m)
  if b == 1:
    return call(lhs[0], ct[0], sizes[0])[None]
  # Each batch's rows are its groups in order: with the rows past each batch's groups
  # moved last, group b*G + g owns the next sizes[b, g] rows.
  past = jax.vmap(ref.group_ids, (0, None))(sizes, m) >= g
  order = jnp.argsort(past.reshape(-1), stable=True)
  rows = lambda x: x.reshape((b * m,) + x.shape[2:])[order]
  out = call(rows(lhs), rows(ct), sizes.reshape(-1))
  return out.reshape((b, g) + out.shape[1:])


def _wgrad_ffi(config, lhs, ct, group_sizes):
  del config

  def call(rows, ct_rows, sizes):
    k, n = rows.shape[1], ct_rows.shape[1]
    return jax.ffi.ffi_call(
        "cudnn_jax_cute_grouped_wgrad", jax.ShapeDtypeStruct((sizes.shape[0], k, n), jnp.float32))(
            rows, ct_rows.astype(rows.dtype), _starts(sizes)[0])

  return (_regrouped_outer(call, lhs, ct, group_sizes),)


def _rule(shared_index, columns_whole, config, *shapes):
  """``b m k, r g k c, ... -> b m n``: the batch stays local, and the columns too unless a
  GLU pairs them."""
  b, r = shapes[0][0], shapes[shared_index][0]
  rhs_batch = "b" if r == b else "r"
  c, n = ("c", "n") if columns_whole(config) else ("n", "n")
  operands = ["b m k", f"{rhs_batch} g k {c}"]
  if len(shapes) == 4:  # fused: the bias
    operands.append(f"{rhs_batch} g {c}")
  operands.append("b g")
  return ", ".join(operands) + f" -> b m {n}"


_SHARDABLE = ("b", "n")
matmul = core.define("cudnn_jax_grouped_matmul", impl=_matmul_emulated, cuda=_matmul_ffi,
                     shardable=_SHARDABLE, rule=functools.partial(_rule, 1, lambda _: False))
fused = core.define("cudnn_jax_cute_grouped_gemm", impl=_fused_emulated, cuda=_fused_ffi,
                    shardable=_SHARDABLE,
                    rule=functools.partial(_rule, 1, lambda e: e in epilogues.GLU_ACTIVATION))
wgrad = core.define("cudnn_jax_cute_grouped_wgrad", impl=_wgrad_emulated, cuda=_wgrad_ffi,
                    shardable=("b", "k", "n"), rule="b m k, b m n, b g -> b g k n")
