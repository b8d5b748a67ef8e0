"""The "triton" engine of block-sparse attention: flash attention whose work follows the
selection, as Pallas kernels compiled by XLA through Triton (cudnn_jax/triton/bsa_kernels.py).

Why Pallas on Triton: each program reads its list of kv blocks on the device and loops over
it with a trip count known only there, which Triton expresses directly (a loop over pointer
offsets), while the whole kernel still runs in the Pallas interpreter on a CPU, so its logic
is tested against the float64 oracle without a GPU. CuTe DSL kernels would come closer to
the hardware (warp specialization, TMA) but cannot be run without a GPU here.

Before the kernels, in XLA and on the device: each query block's list is compacted to the
kv blocks that can hold a kept key (``schedule``: entries past its count, out of range, of
empty kv blocks, or after the query block under ``is_causal`` are dropped), so the kernels
loop over exactly those. The backward pass builds the transposed lists (``by_kv_block``:
for each kv block, the query blocks of the kv head's group that list it) with one stable
sort, so that dk and dv are summed by one program per kv block in a fixed order: no
atomics, the same bits on every run.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from cudnn_jax.triton import bsa_kernels

BLOCK_SIZES = (64, 128)
HEAD_DIMS = (64, 128)
DTYPES = ("bfloat16", "float16", "float32")


def supports(block_size, h, hv, dtype, interpret=False) -> str | None:
  """None when the kernels serve these sizes (on a GPU, or in the interpreter), else why
  not."""
  if block_size not in BLOCK_SIZES:
    return f"block_size={block_size}: the kernels take {BLOCK_SIZES}"
  if h not in HEAD_DIMS or hv not in HEAD_DIMS:
    return f"head dims H={h}, Hv={hv}: the kernels take {HEAD_DIMS}"
  if dtype not in DTYPES:
    return f"dtype {dtype}: the kernels take {', '.join(DTYPES)}"
  if not interpret and dtype == "float32" and block_size == 128 and max(h, hv) == 128:
    return ("float32 at block size 128 and head dim 128: the kernels' tiles exceed an SM's "
            "shared memory (block size 64 or bfloat16/float16 inputs fit)")
  return None


def schedule(block_index, block_counts, kv_block_sizes, *, causal):
  """Each query block's list cut to the kv blocks that can hold a kept key, in the caller's
  order: ``(blocks [B,N,Nq,L], counts [B,N,Nq])`` int32, the first ``counts`` entries of a
  row valid kv block indices (the rest 0). ``kv_block_sizes [B,K,Nkv]``."""
  b, n, nq, width = block_index.shape
  kv_heads, nkv = kv_block_sizes.shape[1:]
  listed = jnp.arange(width) < block_counts[..., None]
  listed &= (block_index >= 0) & (block_index < nkv)
  c = jnp.where(listed, block_index, 0)
  per_head = jnp.repeat(kv_block_sizes, n // kv_heads, axis=1)  # [B,N,Nkv]
  size = jnp.take_along_axis(per_head, c.reshape(b, n, nq * width), axis=2).reshape(c.shape)
  keep = listed & (size > 0)
  if causal:  # kv block c holds a key u <= t for some row t of query block m iff c <= m
    keep &= c <= jnp.arange(nq)[:, None]
  order = jnp.argsort(~keep, axis=-1, stable=True)
  blocks = jnp.where(jnp.take_along_axis(keep, order, -1), jnp.take_along_axis(c, order, -1), 0)
  return blocks.astype(jnp.int32), jnp.sum(keep, axis=-1, dtype=jnp.int32)


def by_kv_block(blocks, counts, kv_heads, nkv):
  """The transposed selection: ``(pairs [B, N*Nq*L], starts [B,K,Nkv], totals [B,K,Nkv])``
  int32; the query rows ``n*Nq + m`` (heads n of kv head kh's group) whose lists hold kv
  block c are ``pairs[b, starts[b,kh,c] : starts[b,kh,c] + totals[b,kh,c]]``, in
  increasing order."""
  b, n, nq, width = blocks.shape
  listed = jnp.arange(width) < counts[..., None]
  kv_head = (jnp.arange(n) // (n // kv_heads))[:, None, None]
  key = jnp.where(listed, kv_head * nkv + blocks, kv_heads * nkv).reshape(b, -1)
  order = jnp.argsort(key, axis=1, stable=True)
  bounds = jax.vmap(functools.partial(jnp.searchsorted, v=jnp.arange(kv_heads * nkv + 1)))(
      jnp.take_along_axis(key, order, axis=1))
  starts = bounds[:, :-1].reshape(b, kv_heads, nkv)
  totals = (bounds[:, 1:] - bounds[:, :-1]).reshape(b, kv_heads, nkv)
  return (order // width).astype(jnp.int32), starts.astype(jnp.int32), totals.astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class _Static:
  bs: int
  scale: float
  causal: bool
  sq: int  # real query length (the arrays are padded to whole blocks)
  interpret: bool

  def kw(self):
    return dict(bs=self.bs, scale=self.scale, causal=self.causal, sq=self.sq,
                interpret=self.interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(st, q, k, v, blocks, counts, sizes):
  return tuple(bsa_kernels.forward(q, k, v, blocks, counts, sizes, **st.kw()))


def _attend_fwd(st, q, k, v, blocks, counts, sizes):
  out, lse = _attend(st, q, k, v, blocks, counts, sizes)
  return (out, lse), (q, k, v, blocks, counts, sizes, out, lse)


def _attend_bwd(st, res, cts):
  q, k, v, blocks, counts, sizes, out, lse = res
  do, dlse = cts
  do = do.astype(q.dtype)
  # d lse / d s = p, so the lse's cotangent joins the softmax's row term.
  delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  delta = delta.transpose(0, 2, 1) - dlse
  dq = bsa_kernels.dq(q, k, v, do, lse, delta, blocks, counts, sizes, **st.kw())
  pairs = by_kv_block(blocks, counts, k.shape[2], k.shape[1] // st.bs)
  dk, dv = bsa_kernels.dkdv(q, k, v, do, lse, delta, *pairs, sizes, **st.kw())
  return dq, dk, dv, None, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def _padded(x, rows):
  """``x [B,S,...]`` zero-padded to ``rows`` rows."""
  if x.shape[1] == rows:
    return x
  return jnp.pad(x, [(0, 0), (0, rows - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def bsa(query, key, value, block_index, block_counts, kv_block_sizes, *, block_size, scale,
        is_causal, interpret=False):
  """``reference.bsa.bsa`` on the kernels: same arguments (``kv_block_sizes [B,K,Nkv]``
  clipped to the blocks) and results, differentiable in query, key and value (the lse
  too). ``interpret``: run the kernels in the Pallas interpreter (any backend). The sizes
  must pass ``supports``."""
  b, sq, n = query.shape[:3]
  skv = key.shape[1]
  # No row keeps a key, or no row at all: no kernel to run (nor an empty grid to launch).
  if not (b and n and sq and skv and block_index.shape[3]):
    return (jnp.zeros((b, sq, n, value.shape[3]), query.dtype),
            jnp.full((b, n, sq), -jnp.inf, jnp.float32))
  bs = block_size
  nq, nkv = -(-sq // bs), -(-skv // bs)
  blocks, counts = schedule(block_index, block_counts, kv_block_sizes, causal=is_causal)
  st = _Static(bs=bs, scale=float(scale), causal=bool(is_causal), sq=sq, interpret=interpret)
  out, lse = _attend(st, _padded(query, nq * bs), _padded(key, nkv * bs),
                     _padded(value, nkv * bs), blocks, counts, kv_block_sizes)
  return out[:, :sq], lse[:, :, :sq]
