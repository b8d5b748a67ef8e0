"""Attention of query rows over a paged KV cache (decode, speculative decoding, chunked
prefill), as one Pallas kernel compiled by XLA through Triton that reads the pages in
place, split along the keys (split-KV), then merged in XLA.

Shapes: ``q [B,K,R,H]``: kv head kh's query rows, row r = t*G + g being query token t of
query head kh*G + g (R = T*G padded to a power of two >= 16, the smallest tile a tensor
core product takes, or to whole blocks of ``BLOCK_ROWS`` when longer); ``key_cache
[P*page,K,H]`` and ``value_cache [P*page,K,Hv]``: the caches' rows, page p's row i at
``p*page + i``; ``page_table [B,max_pages]``.

One program per (sequence b, kv head kh, block of rows, split s) walks the key positions u
of split s (those the block's rows can see, under a causal mask or a window),
``KB`` at a time: each position's page id is read from the table and its key and value rows
gathered from the caches, so a kv head's pages are read once for its whole query group, and
long caches are spread over many programs when ``B*K`` alone would leave SMs idle. A
position counts when it is below the sequence's length on a page id in ``[0,P)`` (others
read row 0 and are masked, never clipped to another page). For the kept (row, position)
pairs, in base 2:

    s = scale k_scale q k^T (soft-capped: c tanh(s / c)),  mx' = max(mx, rowmax s)
    l = l 2^{mx - mx'} + rowsum 2^{s - mx'},  acc = acc 2^{mx - mx'} + 2^{s - mx'} v

Each split writes ``(acc, mx, l)``; ``combine`` merges them, with the sinks, in XLA. An FP8
cache is read as stored (one byte a value) and converted to the query's dtype in registers;
``k_scale`` joins the logits' scale and ``v_scale`` scales the merged output.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from cudnn_jax.triton.common import LN2, LOG2E, dot, launch, softmax_init, softmax_step

HEAD_DIMS = (16, 32, 64, 128, 256)
BLOCK_ROWS = 128  # query rows one program carries at most (64 for head dims of 256)
MIN_SPLIT = 256  # key positions a split walks at least
DTYPES = ("bfloat16", "float16", "float32")


def rows(t, group, h=128) -> tuple[int, int]:
  """(R, rows a program carries): ``t * group`` rounded up to a power of two >= 16, or
  to whole blocks when longer than one (head dim ``h`` above 128 halves the block)."""
  block = BLOCK_ROWS if h <= 128 else BLOCK_ROWS // 2
  r = max(16, 1 << (t * group - 1).bit_length())
  return (r, r) if r <= block else (-(-t * group // block) * block, block)


def supports(h, hv, dtype) -> str | None:
  """None when the kernel serves these sizes, else why not."""
  if h not in HEAD_DIMS or hv not in HEAD_DIMS:
    return f"head dims H={h}, Hv={hv}: the kernel takes {HEAD_DIMS}"
  if dtype not in DTYPES:
    return f"query dtype {dtype}: the kernel takes {', '.join(DTYPES)}"
  return None


@dataclasses.dataclass(frozen=True)
class Static:
  """Everything static about one launch."""
  t: int  # query rows per sequence
  group: int  # query heads per kv head
  pages: int  # P
  page: int
  scale: float
  causal: bool  # bottom-right aligned
  window: tuple | None  # (left, right), None = unbounded side
  soft_cap: float | None
  splits: int
  chunk: int  # key positions per split
  block: int  # query rows per program
  interpret: bool = False

  @property
  def kb(self) -> int:
    return 64


def splits_for(b, kv_heads, capacity, cores) -> tuple[int, int]:
  """(splits, key positions per split): enough programs for four per SM, no split shorter
  than MIN_SPLIT positions."""
  want = max(1, min(-(-4 * cores // (b * kv_heads)), -(-capacity // MIN_SPLIT)))
  chunk = -(-capacity // want)
  chunk = -(-chunk // 64) * 64
  return -(-capacity // chunk), chunk


def _kernel(lengths_ref, table_ref, scales_ref, q_ref, k_ref, v_ref, acc_ref, mx_ref, l_ref,
            *, st: Static):
  b, kh, block, split = (pl.program_id(i) for i in range(4))
  kv_len, q_len = lengths_ref[0, b], lengths_ref[1, b]
  q = q_ref[...]
  r = q.shape[0]
  row = block * r + jax.lax.broadcasted_iota(jnp.int32, (r, 1), 0)
  diag = row // st.group + (kv_len - q_len)  # the key aligned with each row (bottom-right)
  first, last = ((block * r + i) // st.group + (kv_len - q_len) for i in (0, r - 1))
  # Each row's keys [lo, hi], and the keys [start, end) some row of the block sees in this
  # split.
  hi = jnp.full((r, 1), kv_len - 1, jnp.int32)
  lo = jnp.zeros((r, 1), jnp.int32)
  start = split * st.chunk
  end = jnp.minimum(start + st.chunk, kv_len)
  if st.causal:
    hi, end = jnp.minimum(hi, diag), jnp.minimum(end, last + 1)
  if st.window is not None:
    left, right = st.window
    if left is not None:
      lo, start = jnp.maximum(lo, diag - left), jnp.maximum(start, first - left)
    if right is not None:
      hi, end = jnp.minimum(hi, diag + right), jnp.minimum(end, last + right + 1)
  hi = jnp.where(row < st.group * jnp.minimum(q_len, st.t), hi, -1)  # padding, rows >= q_len
  logit_scale = st.scale * scales_ref[0]
  max_pages = table_ref.shape[1]

  def step(i, carry):
    u = start + i * st.kb + jax.lax.broadcasted_iota(jnp.int32, (st.kb,), 0)
    ids = table_ref[b, jnp.minimum(u // st.page, max_pages - 1)]
    live = (u < end) & (ids >= 0) & (ids < st.pages)
    at = jnp.where(live, ids * st.page + u % st.page, 0)
    k = k_ref[at, kh, :].astype(q.dtype)
    v = jnp.where(live[:, None], v_ref[at, kh, :].astype(q.dtype), 0)
    s = logit_scale * dot(q, k, tb=True)
    if st.soft_cap is not None:
      s = st.soft_cap * jnp.tanh(s / st.soft_cap)
    u = u[None, :]
    keep = live[None, :] & (u >= lo) & (u <= hi)
    return softmax_step(carry, jnp.where(keep, LOG2E * s, -jnp.inf), v)

  steps = jnp.maximum(end - start + st.kb - 1, 0) // st.kb
  acc, mx, l = jax.lax.fori_loop(0, steps, step, softmax_init(r, acc_ref.shape[1]))
  acc_ref[...] = acc
  mx_ref[...] = mx
  l_ref[...] = l


def _params(r, h, hv, cache_bytes):
  # Four warps carry up to 32 rows; more take eight (the accumulator stays in registers).
  # Three stages keep two blocks of keys and values in flight behind the one in use.
  stage = 64 * (h + hv) * cache_bytes
  return pl_triton.CompilerParams(num_warps=4 if r <= 32 else 8,
                                  num_stages=3 if 3 * stage <= 160 * 1024 else 2)


@functools.partial(jax.jit, static_argnames=("st",))
def partials(q, key_cache, value_cache, page_table, lengths, scales, *, st: Static):
  """The splits' ``(acc [B,K,S,R,Hv], mx [B,K,S,R], l [B,K,S,R])`` float32, mx and l in
  base 2. ``lengths [2,B]``: kv lengths (clamped to the capacity), query lengths (clamped
  to T); ``scales [1]``: k_scale (1 for other caches)."""
  b, kv_heads, r, h = q.shape
  hv = value_cache.shape[-1]
  block = st.block
  whole = pl.no_block_spec
  per_split = lambda *tail: pl.BlockSpec(
      (None, None, None, block) + tail,
      lambda b_, k_, r_, s_: (b_, k_, s_, r_) + (0,) * len(tail))
  cache_bytes = max(key_cache.dtype.itemsize, value_cache.dtype.itemsize)
  return launch(
      functools.partial(_kernel, st=st),
      (lengths, page_table, scales, q, key_cache, value_cache),
      grid=(b, kv_heads, r // block, st.splits),
      in_specs=[whole, whole, whole,
                pl.BlockSpec((None, None, block, h), lambda b_, k_, r_, s_: (b_, k_, r_, 0)),
                whole, whole],
      out_specs=[per_split(hv), per_split(), per_split()],
      out_shape=[jax.ShapeDtypeStruct((b, kv_heads, st.splits, r, hv), jnp.float32),
                 jax.ShapeDtypeStruct((b, kv_heads, st.splits, r), jnp.float32),
                 jax.ShapeDtypeStruct((b, kv_heads, st.splits, r), jnp.float32)],
      compiler_params=_params(block, h, hv, cache_bytes), interpret=st.interpret,
      name="sdpa_paged")


def combine(acc, mx, l, sinks2, valid, v_scale=None):
  """The splits merged: ``(out [B,K,R,Hv]`` float32, ``lse [B,K,R])``. ``sinks2 [K,R]``
  the rows' sink logits in base 2 (None: no sinks); ``valid [B,1,R]`` the rows within the
  query lengths (others output 0 with lse -inf); ``v_scale`` multiplies the rows that keep
  a key (an inf or NaN scale makes them NaN, as a dequantized cache would)."""
  top = jnp.max(mx, axis=2)
  if sinks2 is not None:
    top = jnp.maximum(top, sinks2)
  base = jnp.where(top == -jnp.inf, 0.0, top)
  w = jnp.exp2(mx - base[:, :, None])
  total = jnp.sum(w * l, axis=2)
  if sinks2 is not None:
    total = total + jnp.exp2(sinks2 - base)
  kept = valid & (total != 0)  # a NaN total (from a non-finite k_scale) stays NaN
  out = jnp.sum(w[..., None] * acc, axis=2) / jnp.where(kept, total, 1.0)[..., None]
  if v_scale is not None:
    keyed = jnp.any(l != 0, axis=2)[..., None]  # rows of sinks alone output 0
    v_scale = jnp.where(jnp.isfinite(v_scale), v_scale, jnp.nan).astype(jnp.float32)
    out = jnp.where(keyed, out * v_scale, out)
  lse = jnp.where(kept, LN2 * (base + jnp.log2(jnp.where(kept, total, 1.0))), -jnp.inf)
  return jnp.where(kept[..., None], out, 0.0), lse


def sdpa_paged(query, key_cache, value_cache, page_table, kv_lengths, q_lengths, sinks,
               k_scale, v_scale, *, scale, causal, window, soft_cap, cores=132,
               interpret=False):
  """``(out [B,T,N,Hv]`` in the query's dtype, ``lse [B,N,T]`` float32``)``: the arguments
  as ``cudnn_jax.sdpa_paged`` takes them once validated (lengths clamped; ``q_lengths``,
  ``sinks``, the scales may be None). The sizes must pass ``supports``."""
  b, t, n, h = query.shape
  pages, page, kv_heads = key_cache.shape[:3]
  hv = value_cache.shape[3]
  group = n // kv_heads
  r, block = rows(t, group, max(h, hv))
  capacity = page_table.shape[1] * page
  if q_lengths is None:
    q_lengths = jnp.full((b,), t, jnp.int32)
  if not (b and t and n and capacity and pages):
    lse = jnp.full((b, n, t), -jnp.inf, jnp.float32)
    if sinks is not None:
      lse = jnp.where(jnp.arange(t) < q_lengths[:, None, None], sinks[None, :, None], lse)
    return jnp.zeros((b, t, n, hv), query.dtype), lse
  splits, chunk = splits_for(b * (r // block), kv_heads, capacity, cores)
  st = Static(t=t, group=group, pages=pages, page=page, scale=float(scale),
              causal=bool(causal), window=window, soft_cap=soft_cap, splits=splits,
              chunk=chunk, block=block, interpret=interpret)
  # [B,T,K,G,H] -> [B,K,T*G,H], padded to R rows.
  q = query.reshape(b, t, kv_heads, group, h).transpose(0, 2, 1, 3, 4)
  q = q.reshape(b, kv_heads, t * group, h)
  q = jnp.pad(q, ((0, 0), (0, 0), (0, r - t * group), (0, 0)))
  one = jnp.ones((1,), jnp.float32)
  scales = one if k_scale is None else jnp.reshape(k_scale, (1,)).astype(jnp.float32)
  lengths = jnp.stack([kv_lengths, q_lengths]).astype(jnp.int32)
  acc, mx, l = partials(q, key_cache.reshape(pages * page, kv_heads, h),
                        value_cache.reshape(pages * page, kv_heads, hv),
                        page_table.astype(jnp.int32), lengths, scales, st=st)

  row = jnp.arange(r)
  sinks2 = None
  if sinks is not None:  # sink of query head kh*G + g, on each row t*G + g
    per_head = LOG2E * sinks.astype(jnp.float32).reshape(kv_heads, group)
    sinks2 = jnp.where(row < t * group, per_head[:, row % group], -jnp.inf)
  valid = (row < t * group)[None, None, :] & (row // group < q_lengths[:, None, None])
  out, lse = combine(acc, mx, l, sinks2, valid, v_scale)
  out = out[:, :, :t * group].reshape(b, kv_heads, t, group, hv).transpose(0, 2, 1, 3, 4)
  lse = lse[:, :, :t * group].reshape(b, kv_heads, t, group).transpose(0, 1, 3, 2)
  return out.reshape(b, t, n, hv).astype(query.dtype), lse.reshape(b, n, t)
