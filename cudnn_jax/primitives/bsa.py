"""The ``"cudnn"`` engine of ``bsa``: NVIDIA's sm_90 block-sparse attention kernels, which
the cuDNN frontend wheel ships in the CuTe DSL; kernels/bsa_sm90.py compiles them ahead of
time and ffi/aot_bsa.cc hosts them, as two primitives, and the op composed from them.

- ``forward``: ``(q [B,Sq,N,D], k, v [B,Skv,K,D], block_index [B,N,NQB,C], counts
  [B,N,NQB], kv_sizes [B,K,NKB]) -> (out [B,Sq,N,D], lse [B,N,Sq] f32)``; bf16 or f16,
  D in 64/96/128, N/K in 1/2/4/8, blocks of 64 (Sq % 64 == 0) or 128.
- ``backward``: ``(dout, q, k, v, out, lse, block_index, counts, kv_sizes [B,NKB]) -> (dq,
  dk, dv)``: bf16, D = 128, K = N; the K-to-Q index of the block lists is built on the
  device first.

The kernels trust their metadata, so the engine hands them rows compacted on the device
(every entry a row reads in range and of a non-empty block, the rest moved past its count;
SPEC section 3's skipped entries are dropped, never clamped onto a valid block). Off the
GPU the same contracts run in plain JAX on the reference (``cudnn_jax.reference.bsa``).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cudnn_jax import engines
from cudnn_jax.primitives import _common, core
from cudnn_jax.reference import bsa as ref

FRONTEND = "nvidia-cudnn-frontend 1.32.0"  # pinned in pyproject.toml
_DTYPES = {"bfloat16": "bf16", "float16": "f16"}  # the kernels' dtype names


class Config(NamedTuple):
  block_size: int
  scale: float
  mask: bool  # read kv_sizes; else every listed block is full (cut at Skv)

  def attributes(self):
    return dict(block_size=np.int32(self.block_size), scale=np.float32(self.scale),
                mask=np.bool_(self.mask))


def _constants():
  from cudnn_jax import _extension  # pylint: disable=g-import-not-at-top
  return _extension.kernel_constants()["bsa"]


# ---------------------------------------------------------------------------------------
# The handlers' contracts in plain JAX, and their calls.


def _forward_emulated(config, q, k, v, index, counts, sizes):
  return ref.bsa(q, k, v, index, counts, sizes, block_size=config.block_size,
                 scale=config.scale, is_causal=False)


def _backward_emulated(config, dout, q, k, v, out, lse, index, counts, sizes):
  del out, lse
  per_head = jnp.broadcast_to(sizes[:, None], (sizes.shape[0], q.shape[2], sizes.shape[1]))
  attend = lambda q, k, v: _forward_emulated(config, q, k, v, index, counts, per_head)[0]
  return jax.vjp(attend, q, k, v)[1](dout)


def _forward_ffi(config, q, k, v, index, counts, sizes):
  b, sq, n, _ = q.shape
  results = (jax.ShapeDtypeStruct((b, sq, n, v.shape[3]), q.dtype),
             jax.ShapeDtypeStruct((b, n, sq), jnp.float32))
  return jax.ffi.ffi_call("cudnn_jax_bsa_fwd", results)(q, k, v, index, counts, sizes,
                                                         **config.attributes())


def _backward_ffi(config, dout, q, k, v, out, lse, index, counts, sizes):
  from cudnn_jax import _extension  # pylint: disable=g-import-not-at-top
  b, sq, n, _ = q.shape
  workspace = _extension.module().bsa_bwd_workspace(b, n, sq, k.shape[1], index.shape[3],
                                                    config.block_size)
  results = tuple(_common.with_shape(x) for x in (q, k, v)) + (
      _common.workspace_result(workspace),)
  return jax.ffi.ffi_call("cudnn_jax_bsa_bwd", results)(
      dout, q, k, v, out, lse, index, counts, sizes, **config.attributes())[:3]


# Batch and heads are independent: each device computes its shard.
forward = core.define(
    "cudnn_jax_bsa_fwd", impl=_forward_emulated, cuda=_forward_ffi, shardable=("b", ("n", "k")),
    rule="b t n h, b s k h, b s k d, b n m j, b n m, b k l -> b t n d, b n t")
backward = core.define(
    "cudnn_jax_bsa_bwd", impl=_backward_emulated, cuda=_backward_ffi, shardable=("b", "n"),
    rule=("b t n d, b t n h, b s n h, b s n d, b t n d, b n t, b n m j, b n m, b l"
          " -> b t n h, b s n h, b s n d"))


# ---------------------------------------------------------------------------------------
# Which calls the kernels serve, and which kernels.


def _mask(call) -> bool:
  """Whether the kernels read kv_sizes: given by the user, or a last block of 128 cut."""
  return call.kv_sizes != "none" or (call.block_size == 128 and call.skv % 128 != 0)


def _fwd_name(block_size, dtype, d, group, mask):
  return f"bsa_fwd{block_size}_{dtype}_d{d}_g{group}_mask{int(mask)}"


def _k2q_name(bucket, tiles):
  return f"bsa_k2q_b{bucket}_t{tiles}"


def _bwd_name(block_size, dtype, direct, mask):
  direct = "" if int(block_size) == 64 else f"_direct{int(direct)}"
  return f"bsa_bwd{block_size}_{dtype}_d{_constants()['bwd_head_dim']}{direct}_mask{int(mask)}"


def kernel_variants() -> set[str]:
  """Every kernel variant the engine may launch, named from the kernels' constants."""
  c = _constants()
  buckets = (c["bwd_bucket_blk128"], c["bwd_bucket_blk64"])
  return ({_fwd_name(bs, dt, d, g, m) for bs in c["block_sizes"] for dt in c["dtypes"]
           for d in c["fwd_head_dims"] for g in c["fwd_gqa_ratios"] for m in (0, 1)}
          | {_k2q_name(b, t) for b in buckets for t in c["k2q_edge_tiles"]}
          | {_bwd_name(bs, dt, direct, m) for bs in c["block_sizes"] for dt in c["bwd_dtypes"]
             for direct in ((0, 1) if bs == "128" else (0,)) for m in (0, 1)})


def forward_kernel(call) -> str:
  return _fwd_name(call.block_size, _DTYPES.get(call.dtype), call.h, call.n // call.k,
                   _mask(call))


def supports(call) -> str | None:
  """None when the forward kernels serve ``call`` (ops/bsa.py's BsaCall), else why not."""
  from cudnn_jax import _extension  # pylint: disable=g-import-not-at-top
  if why := _extension.sm90_reason(
      "cudnn_jax_bsa_fwd", "kernels/aot.py compiles its kernels with nvidia-cutlass-dsl "
      f"4.8.1 from {FRONTEND}; the build had neither, or other versions"):
    return why
  c = _constants()
  if call.is_causal:
    return "is_causal: the kernels have no token mask inside a block"
  if call.dtype not in _DTYPES:
    return f"dtype {call.dtype}: the kernels take bfloat16 or float16"
  if str(call.block_size) not in c["block_sizes"]:
    return f"block_size {call.block_size}: the kernels take {', '.join(c['block_sizes'])}"
  if call.h != call.hv or str(call.h) not in c["fwd_head_dims"]:
    return (f"H={call.h}, Hv={call.hv}: the kernels take H = Hv in "
            f"{', '.join(c['fwd_head_dims'])}")
  if str(call.n // call.k) not in c["fwd_gqa_ratios"]:
    return (f"N/K={call.n // call.k}: the kernels take query heads per kv head in "
            f"{', '.join(c['fwd_gqa_ratios'])}")
  if not (math.isfinite(call.scale) and call.scale > 0):
    return f"scale={call.scale}: the kernels take a finite scale > 0"
  if call.b * call.n > 65535:
    return f"B*N={call.b * call.n}: the kernels' grid takes at most 65535"
  if (kernel := forward_kernel(call)) not in _extension.aot_kernels():
    return f"the extension was built without {kernel}"
  return None


def backward_reason(call) -> str | None:
  """None when the backward kernels serve ``call``, else why not (its gradients then come
  from the triton engine, or the xla engine's)."""
  c = _constants()
  if _DTYPES.get(call.dtype) not in c["bwd_dtypes"]:
    return f"dtype {call.dtype}: the backward kernels take bfloat16"
  if (call.h, call.hv) != (c["bwd_head_dim"],) * 2:
    return f"H={call.h}, Hv={call.hv}: the backward kernels take {c['bwd_head_dim']}"
  if call.n != call.k:
    return f"N={call.n}, K={call.k}: the backward kernels take equal head counts"
  if call.kv_sizes == "per_head":
    return "kv_block_sizes per kv head: the backward kernels take one per batch row"
  if call.kmax > c["max_index_width"]:
    return f"Kmax={call.kmax}: the backward kernels take at most {c['max_index_width']}"
  return None


def _backward_kernels(call) -> str:
  c = _constants()
  bucket = c["bwd_bucket_blk128"] if call.block_size == 128 else c["bwd_bucket_blk64"]
  tiles = next(t for t in c["k2q_edge_tiles"] if c["k2q_edge_tile"] * int(t) >= call.kmax)
  direct = -(-call.sq // call.block_size) <= bucket  # one CSR group
  return (f"{_k2q_name(bucket, tiles)} and "
          f"{_bwd_name(call.block_size, 'bf16', direct, _mask(call))}")


def describe(call) -> str:
  backward = (f"backward {_backward_kernels(call)}" if (why := backward_reason(call)) is None
              else f"backward on the {_fallback(call)} engine ({why})")
  return (f"NVIDIA's sm_90 block-sparse attention kernels from {FRONTEND} (CuTe DSL, "
          f"compiled ahead of time): forward {forward_kernel(call)} "
          f"(BlockSparseAttnForwardSm90Blk{call.block_size}), {backward}; block lists compacted on "
          "the device first")


def _fallback(call) -> str:
  """The engine whose gradients the cudnn engine uses where its backward cannot serve."""
  return "triton" if engines.engine("bsa", "triton").supports(call) is None else "xla"


# ---------------------------------------------------------------------------------------
# The op.


def compacted(block_index, block_counts, kv_block_sizes, nkv):
  """``(block_index, counts)`` with each row's readable entries first: those below its
  count, in ``[0, nkv)`` and of a block with at least one key (``kv_block_sizes
  [B,K,Nkv]``, query head n reading kv head ``n // (N/K)``), in their order; the rest 0
  and past the new count."""
  b, n, nq, kmax = block_index.shape
  group = n // kv_block_sizes.shape[1]
  slot = jnp.arange(kmax, dtype=jnp.int32)
  ok = (slot < block_counts[..., None]) & (block_index >= 0) & (block_index < nkv)
  index = jnp.where(ok, block_index, 0)
  sizes = jnp.repeat(kv_block_sizes, group, axis=1)  # [B,N,Nkv]
  ok &= jnp.take_along_axis(sizes, index.reshape(b, n, nq * kmax), axis=2).reshape(
      index.shape) > 0
  order = jnp.argsort(~ok, axis=-1, stable=True)
  counts = jnp.sum(ok, axis=-1, dtype=jnp.int32)
  index = jnp.take_along_axis(index, order, axis=-1)
  return jnp.where(slot < counts[..., None], index, 0).astype(jnp.int32), counts


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(call, q, k, v, index, counts, sizes):
  return tuple(forward(_config(call), q, k, v, index, counts, sizes))


def _config(call):
  return Config(call.block_size, call.scale, _mask(call))


def _attend_fwd(call, *operands):
  q, k, v, index, counts, sizes = (getattr(x, "value", x) for x in operands)  # symbolic zeros
  out, lse = forward(_config(call), q, k, v, index, counts, sizes)
  return (out, lse), (q, k, v, index, counts, sizes, out, lse)


def _attend_bwd(call, res, cts):
  q, k, v, index, counts, sizes, out, lse = res
  dout, dlse = cts
  no_grads = tuple(np.zeros(x.shape, jax.dtypes.float0) for x in (index, counts, sizes))

  def fallback(dout, dlse):
    from cudnn_jax.ops import bsa as ops  # pylint: disable=g-import-not-at-top
    run = engines.engine("bsa", _fallback(call)).run
    attend = lambda q, k, v: tuple(run(call, ops.BsaInputs(q, k, v, index, counts, sizes)))
    return jax.vjp(attend, q, k, v)[1]((dout, dlse))

  symbolic = lambda c: isinstance(c, jax.custom_derivatives.SymbolicZero)
  zero = lambda c, like: jnp.zeros(like.shape, like.dtype) if symbolic(c) else c
  dout = zero(dout, out).astype(out.dtype)
  if backward_reason(call) is not None:
    return fallback(dout, zero(dlse, lse)) + no_grads

  def kernels(dout, dlse=None):
    del dlse
    grads = backward(_config(call), dout, q, k, v, out, lse, index, counts, sizes[:, 0])
    return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))

  if symbolic(dlse):
    return kernels(dout) + no_grads
  # The kernels take no lse cotangent: a call whose lse is differentiated (one that is not
  # all zero) takes the other engine's gradients.
  return jax.lax.cond(jnp.any(dlse != 0), fallback, kernels, dout, dlse) + no_grads


_attend.defvjp(_attend_fwd, _attend_bwd, symbolic_zeros=True)


def bsa(call, x):
  """The engine on ``BsaInputs`` x (ops/bsa.py): ``(out [B,Sq,N,Hv], lse [B,N,Sq])``."""
  b, sq, n, _ = x.query.shape
  nq, nkv = -(-sq // call.block_size), -(-call.skv // call.block_size)
  if 0 in (b, sq, n, call.skv, call.kmax):  # the kernels need every dimension >= 1
    return (jnp.zeros((b, sq, n, call.hv), x.query.dtype),
            jnp.full((b, n, sq), -jnp.inf, jnp.float32))
  index, counts = compacted(x.block_index, x.block_counts, x.kv_block_sizes, nkv)
  # Blocks of 64 take whole query blocks: the last is padded with zero rows (which attend
  # like any other and are dropped), so their gradient terms are zero.
  q = jnp.pad(x.query, [(0, 0), (0, nq * call.block_size - sq), (0, 0), (0, 0)]
              ) if call.block_size == 64 else x.query
  out, lse = _attend(call, q, x.key, x.value, index, counts, x.kv_block_sizes)
  return out[:, :sq], lse[:, :, :sq]
