"""Block-sparse attention: ``cudnn_jax.bsa`` and ``cudnn_jax.bsa_from_mask``.

Query block m (rows ``m*block_size ...``) of head n attends to the key/value blocks listed
in ``block_index[b, n, m]``. Three engines, all with work and memory that follow the
selected blocks rather than the full ``Sq x Skv`` square: ``"cudnn"``
(cudnn_jax/primitives/bsa.py: NVIDIA's sm_90 kernels from the cuDNN frontend wheel,
compiled ahead of time; opt-in until validated on a Hopper GPU), ``"triton"``
(cudnn_jax/triton/bsa.py: flash-attention kernels that walk each query block's list on the
device; NVIDIA GPUs, opt-in until validated there) and ``"xla"`` (cudnn_jax/reference/bsa.py:
each query block gathers its kv blocks). Batch rows and heads are independent, so on a
device mesh the chosen engine runs on each device's shard of them (``core.per_shard``),
with no communication.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cudnn_jax import _checks, _metadata, engines
from cudnn_jax.primitives import core

BLOCK_SIZES = (16, 32, 64, 128)


class BsaInputs(NamedTuple):
  query: jax.Array
  key: jax.Array
  value: jax.Array
  block_index: jax.Array  # [B,N,Nq,Kmax] int32
  block_counts: jax.Array  # [B,N,Nq] int32
  kv_block_sizes: jax.Array  # [B,K,Nkv] int32


@dataclasses.dataclass(frozen=True)
class BsaCall:
  b: int
  sq: int
  skv: int
  n: int
  k: int
  h: int
  hv: int
  kmax: int
  dtype: str
  block_size: int
  scale: float
  is_causal: bool
  return_lse: bool
  kv_sizes: str = "none"  # kv_block_sizes: "none", "shared" by the heads, or "per_head"


def _prepare(query, key, value, block_index, block_counts=None, *, block_size=128,
             kv_block_sizes=None, scale=None, is_causal=False, return_lse=False,
             implementation=None):
  """Validates the user's arguments into (BsaCall, BsaInputs)."""
  del implementation
  _checks.shape_of("query", query, 4)
  ks = _checks.shape_of("key", key, 4)
  vs = _checks.shape_of("value", value, 4)
  for name, x in (("query", query), ("key", key), ("value", value)):
    _checks.float_dtype(name, x)
  _checks.same_dtype("query, key, value", query, key, value)
  b, sq, n, h = query.shape
  skv, k, hv = key.shape[1], key.shape[2], value.shape[3]
  if ks != (b, skv, k, h):
    raise ValueError(f"key: expected [B,Skv,K,H] with B={b}, H={h}, got {ks}")
  if vs[:3] != (b, skv, k):
    raise ValueError(f"value: expected [B,Skv,K,Hv] with key's B, Skv, K {(b, skv, k)}, "
                     f"got {vs}")
  if k < 1 or n % k:
    raise ValueError(f"query/key: query heads N={n} must be a multiple of kv heads K={k} "
                     "(K >= 1)")
  if h < 1:
    raise ValueError(f"query: head dim H must be >= 1 (the logits' scale is 1/sqrt(H)), got "
                     f"shape {tuple(query.shape)}")
  bs = _checks.one_of("block_size", block_size, BLOCK_SIZES)
  nq, nkv = -(-sq // bs), -(-skv // bs)

  _checks.shape_of("block_index", block_index, 4)
  _checks.int_dtype("block_index", block_index)
  if block_index.shape[:3] != (b, n, nq):
    raise ValueError(f"block_index: expected [B,N,Nq,Kmax] with B={b}, N={n}, Nq={nq}, got "
                     f"{tuple(block_index.shape)}")
  kmax = block_index.shape[3]
  if block_counts is None:
    block_counts = jnp.full((b, n, nq), kmax, jnp.int32)
  else:
    _checks.int_dtype("block_counts", block_counts)
    _checks.expect_shape("block_counts", block_counts, (b, n, nq))
    block_counts = _metadata.clamp_lengths(block_counts, kmax)
  full = jnp.minimum(bs, skv - bs * jnp.arange(nkv, dtype=jnp.int32))  # the last block is cut
  if kv_block_sizes is None:
    kv_block_sizes = full
  else:
    _checks.int_dtype("kv_block_sizes", kv_block_sizes)
    if kv_block_sizes.shape not in ((nkv,), (b, nkv), (b, k, nkv)):
      raise ValueError(f"kv_block_sizes: expected [Nkv], [B,Nkv] or [B,K,Nkv] with Nkv={nkv}, "
                       f"got {tuple(kv_block_sizes.shape)}")
    kv_block_sizes = jnp.clip(kv_block_sizes.astype(jnp.int32), 0, full)
  as_bkn = {1: lambda s: s[None, None], 2: lambda s: s[:, None], 3: lambda s: s}
  sizes = jnp.broadcast_to(as_bkn[kv_block_sizes.ndim](kv_block_sizes), (b, k, nkv))

  if scale is None:
    scale = 1.0 / math.sqrt(h)
  elif not isinstance(scale, (int, float)) or isinstance(scale, bool):
    raise TypeError(f"scale: expected a Python float or None, got {type(scale).__name__}")
  kv_sizes = ("none" if kv_block_sizes is None
              else "per_head" if kv_block_sizes.ndim == 3 and k > 1 else "shared")
  call = BsaCall(b=b, sq=sq, skv=skv, n=n, k=k, h=h, hv=hv, kmax=kmax,
                 dtype=jnp.dtype(query.dtype).name, block_size=bs, scale=float(scale),
                 is_causal=bool(is_causal), return_lse=bool(return_lse), kv_sizes=kv_sizes)
  inputs = BsaInputs(*_checks.arrays(query, key, value, block_index.astype(jnp.int32),
                                     block_counts.astype(jnp.int32), sizes))
  return call, inputs


def _check(call: BsaCall, block_index, block_counts, kv_block_sizes):
  """The metadata checks (the caller's arrays, shapes validated), under ``checkify`` only:
  counts in ``[0, Kmax]``, the indices they read in ``[0, Nkv)``, block sizes in
  ``[0, block_size]``."""
  nkv = -(-call.skv // call.block_size)
  read = None
  if block_counts is not None:
    counts = jnp.asarray(block_counts)
    _metadata.check_entries("block_counts", counts, (counts < 0) | (counts > call.kmax),
                            f"expected a count in [0, {call.kmax}] (Kmax)")
    read = jnp.arange(call.kmax) < _metadata.clamp_lengths(counts, call.kmax)[..., None]
  _metadata.check_indices("block_index", block_index, nkv, read)
  if kv_block_sizes is not None:
    sizes = jnp.asarray(kv_block_sizes)
    _metadata.check_entries("kv_block_sizes", sizes, (sizes < 0) | (sizes > call.block_size),
                            f"expected a size in [0, {call.block_size}] (block_size)")


def bsa(query, key, value, block_index, block_counts=None, *, block_size=128,
        kv_block_sizes=None, scale=None, is_causal=False, return_lse=False,
        implementation=None):
  """Block-sparse attention.

  ``query [B,Sq,N,H]``, ``key [B,Skv,K,H]``, ``value [B,Skv,K,Hv]``, ``N % K == 0``. Query
  block m holds rows ``m*block_size ...`` (``Nq = ceil(Sq/block_size)``, likewise ``Nkv``
  for keys); it attends to the kv blocks ``block_index[b, n, m, :block_counts[b, n, m]]``
  (``block_index [B,N,Nq,Kmax]`` int32; ``block_counts [B,N,Nq]`` int32, None = all Kmax;
  indices are assumed unique). ``kv_block_sizes`` (``[Nkv]``, ``[B,Nkv]`` or ``[B,K,Nkv]``
  int32) counts the valid tokens of each kv block (None = full blocks, the last cut at
  Skv). ``is_causal`` also keeps only ``u <= t``. Logits ``scale * q.k`` (scale defaults
  to ``1/sqrt(H)``), softmax over the kept keys; a row with none outputs 0 (lse -inf), as
  does every row when Kmax = 0 or Skv = 0.

  Invalid metadata has a defined result, the same on every engine: an index outside
  ``[0, Nkv)`` selects nothing (it is skipped, never clipped onto another block), counts
  are clamped to ``[0, Kmax]`` and block sizes to ``[0, block_size]`` (the last block also
  cut at Skv). Under ``jax.experimental.checkify.checkify`` (user checks) each of those
  raises an error naming the argument and the entry (indices past a row's count are never
  read, nor checked); without checkify the checks cost nothing.

  Returns ``out [B,Sq,N,Hv]`` in the input dtype and, with ``return_lse=True``, also
  ``lse [B,N,Sq]`` float32. Differentiable in query, key and value.

  ``implementation``: None (the xla engine), "cudnn" (NVIDIA's sm_90 kernels, opt-in:
  not causal, block_size 64 or 128, H = Hv in 64/96/128, N/K in 1/2/4/8, bf16 or f16; the
  backward on the kernels for bf16, H = 128, N = K and kv_block_sizes shared by the heads,
  else from "triton" or "xla"), "triton" (flash-attention kernels through Triton on an
  NVIDIA GPU, opt-in: block_size 64 or 128, H and Hv 64 or 128, bf16, f16 or f32;
  gradients summed in a fixed order, the same bits on every run), "xla", or a sequence of
  those, as for every op. Batch- and head-sharded inputs are computed on each
  device's shard, with no communication.
  """
  call, inputs = _prepare(query, key, value, block_index, block_counts, block_size=block_size,
                          kv_block_sizes=kv_block_sizes, scale=scale, is_causal=is_causal,
                          return_lse=return_lse)
  _check(call, block_index, block_counts, kv_block_sizes)  # under checkify
  engine = engines.choose("bsa", call, implementation)
  out, lse = _per_shard((engine.name, call), *inputs)
  return (out, lse) if call.return_lse else out


def bsa_from_mask(block_mask):
  """``block_mask [B,N,Nq,Nkv]`` bool -> ``(block_index [B,N,Nq,Nkv], block_counts
  [B,N,Nq])`` int32: the selected kv blocks of each query block in ascending order, the
  unused tail of each row -1."""
  _checks.shape_of("block_mask", block_mask, 4)
  _checks.bool_dtype("block_mask", block_mask)
  counts = jnp.sum(block_mask, axis=-1, dtype=jnp.int32)
  order = jnp.argsort(~block_mask, axis=-1, stable=True).astype(jnp.int32)
  slot = jnp.arange(block_mask.shape[-1], dtype=jnp.int32)
  return jnp.where(slot < counts[..., None], order, -1), counts


def _run_xla(call: BsaCall, x: BsaInputs):
  from cudnn_jax.reference import bsa as ref  # pylint: disable=g-import-not-at-top
  # Differentiated, the gathered blocks are recomputed rather than kept.
  run = jax.checkpoint(functools.partial(ref.bsa, block_size=call.block_size,
                                         scale=call.scale, is_causal=call.is_causal))
  return run(*x)


# "triton": our Pallas kernels compiled by XLA through Triton. Opt-in until the GPU tests
# (tests/gpu/test_bsa_gpu.py) have passed on hardware; their logic is tested on CPU in
# the Pallas interpreter (tests/test_bsa_triton.py).


def _supports_triton(call: BsaCall) -> str | None:
  if (backend := jax.default_backend()) != "gpu":
    return f"default backend is {backend!r}, not 'gpu'"
  from cudnn_jax.triton import bsa as triton_bsa  # pylint: disable=g-import-not-at-top
  return triton_bsa.supports(call.block_size, call.h, call.hv, call.dtype)


def _run_triton(call: BsaCall, x: BsaInputs, interpret=False):
  from cudnn_jax.triton import bsa as triton_bsa  # pylint: disable=g-import-not-at-top
  return triton_bsa.bsa(*x, block_size=call.block_size, scale=call.scale,
                        is_causal=call.is_causal, interpret=interpret)


def _on_shard(config, *arrays):
  """What one device computes: the engine named in ``config`` on its shard of the batch
  and heads (on one device, the whole call)."""
  name, call = config
  return tuple(engines.engine("bsa", name).run(call, BsaInputs(*arrays)))


# Batch and heads stay local: on a mesh each device reads only its own kv blocks.
_per_shard = core.per_shard(
    "bsa", _on_shard, "b t n h, b s k h, b s k d, b n m j, b n m, b k l -> b t n d, b n t",
    shardable=("b", ("n", "k")))


engines.register_op("bsa", lambda *a, **kw: _prepare(*a, **kw)[0])
def _supports_cudnn(call: BsaCall) -> str | None:
  from cudnn_jax.primitives import bsa as cudnn_bsa  # pylint: disable=g-import-not-at-top
  return cudnn_bsa.supports(call)


def _run_cudnn(call: BsaCall, x: BsaInputs):
  from cudnn_jax.primitives import bsa as cudnn_bsa  # pylint: disable=g-import-not-at-top
  return cudnn_bsa.bsa(call, x)


def _describe_cudnn(call: BsaCall) -> str:
  from cudnn_jax.primitives import bsa as cudnn_bsa  # pylint: disable=g-import-not-at-top
  return cudnn_bsa.describe(call)


engines.register_engine("bsa", "cudnn", supports=_supports_cudnn, run=_run_cudnn,
                        describe=_describe_cudnn, opt_in=True)
engines.register_engine("bsa", "triton", supports=_supports_triton, run=_run_triton,
                        opt_in=True)
engines.register_engine("bsa", "xla", supports=lambda call: None, run=_run_xla)
