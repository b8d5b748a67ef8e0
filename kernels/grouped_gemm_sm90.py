"""Grouped GEMM for sm_90a: ``out[rows of g] = lhs[rows of g] @ rhs[g]`` with the group
sizes read on the device (no host sync), WGMMA fed by TMA through a multistage pipeline.

Layouts (CuTe mode order, ``L`` the batch mode):
  lhs ``(M, K, 1)`` K-fastest; rhs ``(N, K, G)`` N-fastest, i.e. ``rhs [G, K, N]`` as stored;
  out ``(M, N, 1)`` N-fastest; ``tile_starts [G+1]`` int32, the exclusive cumulative sum of
  ``ceil(size_g / TILE_M)``; ``row_starts [G+1]`` int32, the exclusive cumulative sum of
  the group sizes.

Grid: ``(ceil(M / TILE_M) + G, ceil(N / TILE_N))``, an upper bound of the row tiles of
every split. CTA ``(t, j)`` finds its group g with ``tile_starts[g] <= t <
tile_starts[g+1]`` (CTAs past the last tile do nothing), loads the 128 rows from
``row_starts[g] + (t - tile_starts[g]) * TILE_M`` by TMA (rows of the next group or past M
come along and are never stored), multiplies them with ``rhs[g]`` and stores the rows that
belong to g. Rows past ``sum(sizes)`` are not written (the caller zeroes them).
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90

TILE_M, TILE_N = 128, 256
THREADS = 256  # two consumer warpgroups, 64 rows each
SMEM_BYTES = 227 * 1024
BARRIER_BYTES = 1024


class GroupedGemm:
  """One compiled variant: ``dtype`` of lhs, rhs and out; float32 accumulation."""

  def __init__(self, dtype):
    self.dtype = dtype
    self.acc_dtype = cutlass.Float32

  def __repr__(self):  # part of the exported symbol names: keep them stable
    return f"GroupedGemm_{self.dtype.__name__}"

  @cute.jit
  def __call__(self, lhs: cute.Tensor, rhs: cute.Tensor, out: cute.Tensor,
               tile_starts: cute.Tensor, row_starts: cute.Tensor, stream: cuda.CUstream):
    a_major = utils.LayoutEnum.from_tensor(lhs)
    b_major = utils.LayoutEnum.from_tensor(rhs)
    self.tiled_mma = sm90.make_trivial_tiled_mma(
        self.dtype, self.dtype, a_major.sm90_mma_major_mode(), b_major.sm90_mma_major_mode(),
        self.acc_dtype, (2, 1, 1), tiler_mn=(64, TILE_N))
    tile_k = cute.size(self.tiled_mma.shape_mnk, mode=[2]) * 4
    self.tile_mnk = (TILE_M, TILE_N, tile_k)
    stage_bytes = (TILE_M + TILE_N) * tile_k * self.dtype.width // 8
    self.stages = (SMEM_BYTES - BARRIER_BYTES) // stage_bytes
    self.a_smem = sm90.make_smem_layout_a(a_major, self.tile_mnk, self.dtype, self.stages)
    self.b_smem = sm90.make_smem_layout_b(b_major, self.tile_mnk, self.dtype, self.stages)

    g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
    tma_a, tma_lhs = cute.nvgpu.cpasync.make_tiled_tma_atom(
        g2s, lhs, cute.slice_(self.a_smem, (None, None, 0)), (TILE_M, tile_k))
    tma_b, tma_rhs = cute.nvgpu.cpasync.make_tiled_tma_atom(
        g2s, rhs, cute.slice_(self.b_smem, (None, None, 0)), (TILE_N, tile_k))

    @cute.struct
    class Storage:
      barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
      a: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.a_smem)], 1024]
      b: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.b_smem)], 1024]

    self.storage = Storage
    groups = cute.size(row_starts, mode=[0]) - 1
    row_tiles = (cute.size(lhs, mode=[0]) + TILE_M - 1) // TILE_M + groups
    col_tiles = (cute.size(rhs, mode=[0]) + TILE_N - 1) // TILE_N
    self.kernel(tma_a, tma_lhs, tma_b, tma_rhs, out, tile_starts, row_starts,
                self.tiled_mma, self.a_smem, self.b_smem).launch(
                    grid=[row_tiles, col_tiles, 1], block=[THREADS, 1, 1], stream=stream)

  @cute.kernel
  def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom,
             mB: cute.Tensor, mC: cute.Tensor, tile_starts: cute.Tensor,
             row_starts: cute.Tensor, tiled_mma: cute.TiledMma,
             a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout):
    tidx, _, _ = cute.arch.thread_idx()
    row_tile, col_tile, _ = cute.arch.block_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    if warp == 0:
      cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
      cute.nvgpu.cpasync.prefetch_descriptor(tma_b)

    smem = cutlass.utils.SmemAllocator()
    storage = smem.allocate(self.storage)
    stage_bytes = (cute.size_in_bytes(self.dtype, cute.slice_(a_smem, (None, None, 0)))
                   + cute.size_in_bytes(self.dtype, cute.slice_(b_smem, (None, None, 0))))
    loads = pipeline.PipelineTmaAsync.create(
        barrier_storage=storage.barriers.data_ptr(), num_stages=self.stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, THREADS // 32),
        tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        defer_sync=True)
    pipeline.pipeline_init_arrive()
    pipeline.pipeline_init_wait()

    # The group of this row tile: the number of groups whose tiles end at or before it.
    groups = cute.size(row_starts, mode=[0]) - 1
    group = cutlass.Int32(0)
    for g in cutlass.range(groups, unroll=1):
      if tile_starts[g + 1] <= row_tile:
        group = g + 1
    if group < groups:
      # This tile's rows start at row_start (any row, not a multiple of TILE_M).
      row_start = row_starts[group] + (row_tile - tile_starts[group]) * TILE_M
      row_end = row_starts[group + 1]
      sA = storage.a.get_tensor(a_smem.outer, swizzle=a_smem.inner)
      sB = storage.b.get_tensor(b_smem.outer, swizzle=b_smem.inner)
      gA = cute.local_tile(cute.domain_offset((row_start, 0, 0), mA), self.tile_mnk,
                           (0, col_tile, None, 0), proj=(1, None, 1))
      gB = cute.local_tile(mB, self.tile_mnk, (0, col_tile, None, group), proj=(None, 1, 1))
      tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
          tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2),
          cute.group_modes(gA, 0, 2))
      tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
          tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2),
          cute.group_modes(gB, 0, 2))

      warpgroup = cute.arch.make_warp_uniform(tidx // 128)
      thr_mma = tiled_mma.get_slice(cute.make_layout(2, stride=128)(warpgroup))
      tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
      tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
      gC = cute.local_tile(cute.domain_offset((row_start, 0, 0), mC), self.tile_mnk,
                           (0, col_tile, None, 0), proj=(1, 1, None))
      tCgC = thr_mma.partition_C(gC)
      acc = cute.make_rmem_tensor(tCgC.shape, self.acc_dtype)
      acc.fill(0.0)
      tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)  # acc += A B throughout

      # Warp 0 keeps up to stages - 1 K tiles in flight; every warp consumes them in order,
      # with one tile's MMAs running while the next are issued, so a stage is released one
      # tile late, and the load refilling it is issued after that release.
      k_tiles = cute.size(gA, mode=[2])
      produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
      consume = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
      release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
      for k in cutlass.range(k_tiles + self.stages - 1, unroll=1):
        if k >= self.stages - 1:
          loads.consumer_wait(consume)
          cute.nvgpu.warpgroup.fence()
          for kb in cutlass.range(cute.size(tCrA, mode=[2]), unroll_full=True):
            cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, consume.index)],
                      tCrB[(None, None, kb, consume.index)], acc)
          cute.nvgpu.warpgroup.commit_group()
          cute.nvgpu.warpgroup.wait_group(1)  # the previous tile's MMAs are done
          if k >= self.stages:
            loads.consumer_release(release)
            release.advance()
          consume.advance()
        if warp == 0 and produce.count < k_tiles:
          loads.producer_acquire(produce)
          barrier = loads.producer_get_barrier(produce)
          cute.copy(tma_a, tAgA[(None, produce.count)], tAsA[(None, produce.index)],
                    tma_bar_ptr=barrier)
          cute.copy(tma_b, tBgB[(None, produce.count)], tBsB[(None, produce.index)],
                    tma_bar_ptr=barrier)
          loads.producer_commit(produce)
          produce.advance()
      cute.nvgpu.warpgroup.wait_group(0)

      # Epilogue: convert, then store only this group's rows (and columns inside N).
      rC = cute.make_rmem_tensor(tCgC.shape, self.dtype)
      rC.store(acc.load().to(self.dtype))
      tCcC = thr_mma.partition_C(cute.make_identity_tensor((TILE_M, TILE_N)))
      n = cute.size(mB, mode=[0])
      for i in cutlass.range_constexpr(cute.size(rC)):
        coord = tCcC[i]
        if row_start + coord[0] < row_end and col_tile * TILE_N + coord[1] < n:
          tCgC[i] = rC[i]


def variants():
  """(prefix, jit function, compile arguments): bf16 and f16."""
  for name, dtype in (("bf16", cutlass.BFloat16), ("f16", cutlass.Float16)):
    m, k, n = cute.sym_int32(symbol="m"), cute.sym_int32(8, "k"), cute.sym_int32(8, "n")
    groups_plus_one = cute.sym_int32(symbol="groups_plus_one")
    lhs = cute.runtime.make_fake_tensor(dtype, (m, k, 1), (k, 1, cute.sym_int64(8)),
                                        assumed_align=16)
    rhs = cute.runtime.make_fake_tensor(dtype, (n, k, cute.sym_int32()),
                                        (1, n, cute.sym_int64(8)), assumed_align=16)
    out = cute.runtime.make_fake_tensor(dtype, (m, n, 1), (n, 1, cute.sym_int64(8)),
                                        assumed_align=16)
    starts = lambda: cute.runtime.make_fake_compact_tensor(cutlass.Int32, (groups_plus_one,))
    yield (f"grouped_gemm_{name}", GroupedGemm(dtype),
           (lhs, rhs, out, starts(), starts(), cuda.CUstream(0)))
