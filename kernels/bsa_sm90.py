"""Block-sparse attention (BSA) for sm_90a: NVIDIA's CuTe DSL kernels from the pinned
``nvidia-cudnn-frontend`` wheel (``cudnn.block_sparse_attention.csrc``), compiled ahead of
time. Nothing of NVIDIA's source is copied here: the kernel classes are imported from the
installed wheel (a build requirement, pinned exactly in pyproject.toml; the submodules used
import no torch); this module only chooses their compile-time configurations, builds fake
arguments, and wraps each in a small ``@cute.jit`` adapter that a C caller can call (flat
tensors and scalars: no nested tuple, no None) in our layouts.

Every tensor argument is row-major in our JAX layout, unit stride on its last dim (static);
D is static; every other shape and stride is a runtime value of the generated C struct
(``data``, then the dynamic shapes, then the dynamic strides, each in dim order). The
adapters permute the modes into the kernels' orders (as NVIDIA's ``_interface.py`` does
with ``permute``):

  q [B,Sq,N,D], k/v [B,Skv,K,D], out [B,Sq,N,D] (the inputs' dtype), lse [B,N,Sq] f32
  (natural log), block_index [B,N,NQB,C] i32, counts [B,N,NQB] i32, kv_sizes [B,K,NKB] i32
  (forward) or [B,NKB] i32 (backward); NQB = ceil(Sq/bs), NKB = ceil(Skv/bs), bs the
  sparse block size; scale > 0 (a runtime float: no variant for scale <= 0).

Families (``group`` names the X-macro ``CUDNN_JAX_AOT_BSA_SM90_<GROUP>(X)`` of
aot_kernels.h that lists them; one C signature per group):

* ``bsa_fwd128_<dt>_d<D>_g<G>_mask<M>`` and ``bsa_fwd64_<dt>_d<D>_g<G>_mask<M>`` (group
  FWD): ``(q, k, v, out, lse, block_index, counts, kv_sizes, float scale, stream)``, D = Dv,
  G = N/K. Query block m of head n attends to kv blocks ``block_index[b,n,m,:counts[b,n,m]]``
  (entries in [0, NKB), counts in [0, C]; a count of 0 gives out 0, lse -inf). M=1 masks key
  j of kv block i when ``j >= kv_sizes[b, n // G, i]`` (per kv head; sizes at most
  ``min(bs, Skv - i*bs)``, which fwd128 also applies itself); M=0 never reads kv_sizes:
  every listed block is full, so Skv % 128 == 0 for fwd128 (fwd64 cuts the last block at
  Skv itself). One split (no float32 partials, no combine kernel); fwd64 needs Sq % 64 == 0
  (NVIDIA's interface requires it).
* ``bsa_k2q_b<bucket>_t<T>`` (group K2Q): the backward's bucketed K-to-Q CSR of the block
  lists, ``(block_index, counts, offsets, k2q_indices, scratch, stream)``; bucket 256 for
  the blk128 backward, 384 for blk64 (NVIDIA's defaults); T edge tiles of 256 list entries:
  C <= 256*T.
* ``bsa_bwd128_<dt>_d128_direct<0|1>_mask<M>`` and ``bsa_bwd64_<dt>_d128_mask<M>`` (group
  BWD): ``(dout, q, k, v, out, lse, dq, dk, dv, offsets, k2q_indices, kv_sizes, workspace,
  float scale, stream)``; MHA (K = N), D = Dv = 128, bf16. One call launches the chain
  (preprocess, the main kernel, the dQ and, unless direct, the dK and dV conversions).
  direct1 (blk128 with one CSR group) stores dK/dV from the kernel. M=1 masks by kv_sizes
  [B,NKB] (per batch row, not per head); M=0: bwd128 needs Skv % 128 == 0, bwd64 cuts the
  last block at Skv itself.

The constants below are literals (kernels/aot.py exports them to C++ and Python: ints, or
tuples of str, so the block sizes, head dims, ratios and tile counts are decimal strings, as
in the prefixes).
"""

import importlib.metadata

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
# NVIDIA's kernel classes, from the wheel (these submodules import no torch).
from cudnn.block_sparse_attention.csrc.bwd.bucketed_k2q_csr import BucketedK2QCsrUniversal
from cudnn.block_sparse_attention.csrc.bwd.sm90_blk128.bsa_bwd_sm90 import BlockSparseAttnBackwardSm90Blk128
from cudnn.block_sparse_attention.csrc.bwd.sm90_blk64.bsa_bwd_sm90 import BlockSparseAttnBackwardSm90Blk64
from cudnn.block_sparse_attention.csrc.fwd.sm90_blk128.bsa_fwd_sm90 import BlockSparseAttnForwardSm90Blk128
from cudnn.block_sparse_attention.csrc.fwd.sm90_blk64.bsa_fwd_sm90 import BlockSparseAttnForwardSm90Blk64


# The versions these kernels were validated with (pinned in pyproject.toml): kernels/aot.py
# leaves this module out, saying why, when the installed ones differ.
REQUIRES = {"nvidia-cudnn-frontend": "1.32.0", "nvidia-cutlass-dsl": "4.8.1"}

DTYPES = ("bf16", "f16")  # forward
BLOCK_SIZES = ("64", "128")
FWD_HEAD_DIMS = ("64", "96", "128")  # D = Dv
FWD_GQA_RATIOS = ("1", "2", "4", "8")  # N / K
BWD_DTYPES = ("bf16",)
BWD_HEAD_DIM = 128  # D = Dv; MHA only
BWD_BUCKET_BLK128 = 256  # query blocks per K-to-Q CSR group (NVIDIA's defaults)
BWD_BUCKET_BLK64 = 384
K2Q_EDGE_TILE = 256  # block_index columns per CSR edge tile (the builder's threads per CTA)
K2Q_EDGE_TILES = ("1", "2", "4", "8", "16")
MAX_INDEX_WIDTH = 4096  # C <= K2Q_EDGE_TILE * the largest edge tile count
FWD64_SQ_MULTIPLE = 64  # NVIDIA's blk64 forward requires Sq % 64 == 0

_DTYPE = {"bf16": cutlass.BFloat16, "f16": cutlass.Float16}


def _modes(t, order):
  """A view of ``t`` with its modes in ``order`` (a stride permutation, no copy)."""
  return cute.make_tensor(t.iterator, cute.select(t.layout, mode=order))


def _per_query_head(sizes, gqa, head_mode):
  """``sizes`` (kv_sizes [B,K,NKB] in some mode order, its kv-head mode ``head_mode``)
  indexed by query head: that mode becomes (G, K) with strides (0, kv-head stride), so
  query head n reads kv head n // G."""
  if gqa == 1:
    return sizes
  shape, stride = list(sizes.shape), list(sizes.stride)
  shape[head_mode] = (gqa, shape[head_mode])
  stride[head_mode] = (0, stride[head_mode])
  return cute.make_tensor(sizes.iterator, cute.make_layout(tuple(shape), stride=tuple(stride)))


class BsaForward:
  """The forward of one (block size, dtype, D, G, mask) on NVIDIA's sm_90 kernel."""

  def __init__(self, block: int, dtype: str, d: int, gqa: int, mask: bool):
    self.block, self.dtype, self.d, self.gqa, self.mask = block, dtype, d, gqa, mask
    if block == 128:
      # Variable counts (stages 2, as NVIDIA's interface picks for them), one split, a
      # positive scale; kv_sizes mode 3 ([B,H,NKB] by query head) masks the Skv tail too.
      self.kernel = BlockSparseAttnForwardSm90Blk128(
          d, d, gqa, variable_count=True, block_sizes_mode=3 if mask else 0, num_splits=1,
          stages=2, scale_nonpositive=False, has_kv_tail=mask)
    else:
      # One split (no FP32 partials, no combine); empty rows allowed (count 0: O=0, lse -inf).
      self.kernel = BlockSparseAttnForwardSm90Blk64(
          gqa, d, d, 64, 64, _DTYPE[dtype], cutlass.Float32, has_block_sizes=mask,
          num_splits=1, allow_empty_block_nums=True)

  def __repr__(self):
    return f"BsaForward{self.block}_{self.dtype}_d{self.d}_g{self.gqa}_mask{int(self.mask)}"

  @cute.jit
  def __call__(self, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, out: cute.Tensor,
               lse: cute.Tensor, block_index: cute.Tensor, counts: cute.Tensor,
               kv_sizes: cute.Tensor, scale: cutlass.Float32, stream: cuda.CUstream):
    # The kernels' orders: q/k/out (S, D, H, B), v (D, S, H, B), lse (S, H, B), block_index
    # (C, NQB, H, B), counts (NQB, H, B).
    qs, ks, vs, outs = (_modes(q, [1, 3, 2, 0]), _modes(k, [1, 3, 2, 0]),
                        _modes(v, [3, 1, 2, 0]), _modes(out, [1, 3, 2, 0]))
    lses, index, count = _modes(lse, [2, 1, 0]), _modes(block_index, [3, 2, 1, 0]), _modes(
        counts, [2, 1, 0])
    if cutlass.const_expr(self.block == 128):
      # sizes[b, h, block] with h the query head; the fixed count is unused (variable).
      self.kernel(qs, ks, vs, outs, lses, index, count, _per_query_head(kv_sizes, self.gqa, 1),
                  scale, cutlass.Int32(0), stream)
    else:
      # sizes[block, h, b] with h the query head; split offsets unused (one split).
      sizes = _per_query_head(_modes(kv_sizes, [2, 1, 0]), self.gqa, 1)
      self.kernel(qs, ks, vs, outs, lses, index, count, sizes, count, scale, stream)


class BsaK2QCsr:
  """The backward's bucketed K-to-Q CSR, built on the GPU by NVIDIA's
  ``BucketedK2QCsrUniversal`` (count edges, local offsets, finalize, scatter)."""

  def __init__(self, bucket: int, tiles: int):
    self.bucket, self.tiles = bucket, tiles
    # Variable counts always; the edge width (a compile-time constant of the builder) is
    # T*256 >= C: entries past a row's count are never read, so any C up to it works.
    self.kernel = BucketedK2QCsrUniversal(0, bucket, True, tiles * K2Q_EDGE_TILE,
                                          parallel_offsets=True)

  def __repr__(self):
    return f"BsaK2QCsr_b{self.bucket}_t{self.tiles}"

  @cute.jit
  def __call__(self, block_index: cute.Tensor, counts: cute.Tensor, offsets: cute.Tensor,
               k2q_indices: cute.Tensor, scratch: cute.Tensor, stream: cuda.CUstream):
    # block_index [B,H,NQB,C], counts [B,H,NQB]; offsets [B,H,G,NKB+1] and k2q_indices
    # [B,H,NQB*C] are written. scratch (int32) holds, in order: the per-group edge counts
    # [B,H,G,NKB] (zeroed by the caller), the cursors [B,H,G,NKB], the local offsets
    # [B,H,G,NKB+1] and the group totals [B,H,G], each compact.
    b, h = offsets.shape[0], offsets.shape[1]
    groups, nkb = offsets.shape[2], offsets.shape[3] - 1
    per_group = cute.make_layout((b, h, groups, nkb),
                                 stride=(h * groups * nkb, groups * nkb, nkb, 1))
    local = cute.make_layout((b, h, groups, nkb + 1),
                             stride=(h * groups * (nkb + 1), groups * (nkb + 1), nkb + 1, 1))
    totals = cute.make_layout((b, h, groups), stride=(h * groups, groups, 1))
    cells = cutlass.Int64(b) * cutlass.Int64(h) * cutlass.Int64(groups) * cutlass.Int64(nkb)
    base = scratch.iterator
    edge_counts = cute.make_tensor(base, per_group)
    cursors = cute.make_tensor(base + cells, per_group)
    local_offsets = cute.make_tensor(base + 2 * cells, local)
    group_totals = cute.make_tensor(
        base + 2 * cells + cutlass.Int64(b) * cutlass.Int64(h) * cutlass.Int64(groups)
        * cutlass.Int64(nkb + 1), totals)
    self.kernel(edge_counts, local_offsets, group_totals, offsets, cursors, k2q_indices,
                block_index, counts, stream)


class BsaBackward:
  """The backward of one (block size, dtype, direct, mask) on NVIDIA's sm_90 kernels."""

  def __init__(self, block: int, dtype: str, direct: bool, mask: bool):
    self.block, self.dtype, self.direct, self.mask = block, dtype, direct, mask
    if block == 128:
      self.kernel = BlockSparseAttnBackwardSm90Blk128(
          _DTYPE[dtype], BWD_HEAD_DIM, BWD_HEAD_DIM, scale_nonpositive=False, direct_kv=direct,
          has_kv_tail=mask)
    else:
      assert not direct, "the blk64 backward always accumulates dK/dV in float32"
      self.kernel = BlockSparseAttnBackwardSm90Blk64(_DTYPE[dtype], BWD_HEAD_DIM, BWD_HEAD_DIM)

  def __repr__(self):
    return (f"BsaBackward{self.block}_{self.dtype}_direct{int(self.direct)}"
            f"_mask{int(self.mask)}")

  @cute.jit
  def __call__(self, dout: cute.Tensor, q: cute.Tensor, k: cute.Tensor, v: cute.Tensor,
               out: cute.Tensor, lse: cute.Tensor, dq: cute.Tensor, dk: cute.Tensor,
               dv: cute.Tensor, offsets: cute.Tensor, k2q_indices: cute.Tensor,
               kv_sizes: cute.Tensor, workspace: cute.Tensor, scale: cutlass.Float32,
               stream: cuda.CUstream):
    # The kernels take BHSD views and the problem shape (Sq, Skv, D, (H, B)).
    bhsd = lambda t: _modes(t, [0, 2, 1, 3])
    problem = (q.shape[1], k.shape[1], BWD_HEAD_DIM, (q.shape[2], q.shape[0]))
    sizes = kv_sizes if cutlass.const_expr(self.mask) else None
    self.kernel(problem, bhsd(dout), bhsd(out), bhsd(q), bhsd(k), bhsd(v), lse, bhsd(dq),
                bhsd(dk), bhsd(dv), offsets, k2q_indices, sizes, workspace, scale, stream)


def _strided(dtype, shape, align):
  """A fake row-major tensor: unit last stride, every other stride a runtime int64 (16-byte
  multiples for 16-bit data, as TMA needs)."""
  div = 8 if dtype.width == 16 else 1
  stride = tuple(cute.sym_int64(div) for _ in shape[:-1]) + (1,)
  return cute.runtime.make_fake_tensor(dtype, shape, stride, assumed_align=align)


def _sym(name):
  return cute.sym_int32(symbol=name)


def _forward_args(dtype, d):
  b, sq, skv, n, kh = _sym("b"), _sym("sq"), _sym("skv"), _sym("n"), _sym("kh")
  nqb, c, nkb = _sym("nqb"), _sym("c"), _sym("nkb")
  return (_strided(dtype, (b, sq, n, d), 16), _strided(dtype, (b, skv, kh, d), 16),
          _strided(dtype, (b, skv, kh, d), 16), _strided(dtype, (b, sq, n, d), 16),
          _strided(cutlass.Float32, (b, n, sq), 4),
          _strided(cutlass.Int32, (b, n, nqb, c), 4), _strided(cutlass.Int32, (b, n, nqb), 4),
          _strided(cutlass.Int32, (b, kh, nkb), 4), cutlass.Float32(1.0), cuda.CUstream(0))


def _k2q_args():
  b, n, nqb, c = _sym("b"), _sym("n"), _sym("nqb"), _sym("c")
  groups, nkb1, edges = _sym("groups"), _sym("nkb_plus_one"), _sym("edges")
  scratch = cute.runtime.make_fake_tensor(cutlass.Int32, (_sym("scratch"),), (1,),
                                          assumed_align=4)
  return (_strided(cutlass.Int32, (b, n, nqb, c), 4), _strided(cutlass.Int32, (b, n, nqb), 4),
          _strided(cutlass.Int32, (b, n, groups, nkb1), 4),
          _strided(cutlass.Int32, (b, n, edges), 4), scratch, cuda.CUstream(0))


def _backward_args(dtype):
  b, sq, skv, n, d = _sym("b"), _sym("sq"), _sym("skv"), _sym("n"), BWD_HEAD_DIM
  groups, nkb1, edges, nkb = _sym("groups"), _sym("nkb_plus_one"), _sym("edges"), _sym("nkb")
  qlike = lambda: _strided(dtype, (b, sq, n, d), 16)
  kvlike = lambda: _strided(dtype, (b, skv, n, d), 16)
  workspace = cute.runtime.make_fake_tensor(cutlass.Float32, (_sym("workspace"),), (1,),
                                            assumed_align=16)
  return (qlike(), qlike(), kvlike(), kvlike(), qlike(), _strided(cutlass.Float32, (b, n, sq), 4),
          qlike(), kvlike(), kvlike(), _strided(cutlass.Int32, (b, n, groups, nkb1), 4),
          _strided(cutlass.Int32, (b, n, edges), 4), _strided(cutlass.Int32, (b, nkb), 4),
          workspace, cutlass.Float32(1.0), cuda.CUstream(0))


def requirement_error() -> str | None:
  """Why the installed packages are not the ones these kernels were validated with."""
  for name, want in REQUIRES.items():
    try:
      have = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      have = None
    if have != want:
      return f"{name} {have or 'is not installed'}: these kernels were validated with {want}"
  return None


def variants():
  """(prefix, jit function, compile arguments, group) for every variant (module doc)."""
  for block in BLOCK_SIZES:
    for dtype in DTYPES:
      for d in FWD_HEAD_DIMS:
        for gqa in FWD_GQA_RATIOS:
          for mask in (0, 1):
            yield (f"bsa_fwd{block}_{dtype}_d{d}_g{gqa}_mask{mask}",
                   BsaForward(int(block), dtype, int(d), int(gqa), bool(mask)),
                   _forward_args(_DTYPE[dtype], int(d)), "fwd")
  for bucket in (BWD_BUCKET_BLK128, BWD_BUCKET_BLK64):
    for tiles in K2Q_EDGE_TILES:
      yield f"bsa_k2q_b{bucket}_t{tiles}", BsaK2QCsr(bucket, int(tiles)), _k2q_args(), "k2q"
  for dtype in BWD_DTYPES:
    for direct in (0, 1):
      for mask in (0, 1):
        yield (f"bsa_bwd128_{dtype}_d{BWD_HEAD_DIM}_direct{direct}_mask{mask}",
               BsaBackward(128, dtype, bool(direct), bool(mask)), _backward_args(_DTYPE[dtype]),
               "bwd")
    for mask in (0, 1):
      yield (f"bsa_bwd64_{dtype}_d{BWD_HEAD_DIM}_mask{mask}",
             BsaBackward(64, dtype, False, bool(mask)), _backward_args(_DTYPE[dtype]), "bwd")
