"""Weight gradient of a grouped GEMM for sm_90a: ``out[g] = lhs[rows of g]^T @ ct[rows of
g]`` (float32), contracting over each group's rows, with the group sizes read on the device.
Warp-specialized like kernels/grouped_gemm_sm90.py (whose tiles and constants it shares).
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline

from grouped_gemm_sm90 import (LOAD_REGS, MMA_REGS, THREADS, TILE_M, TILE_N,
                               WarpSpecializedSm90)


class GroupedWgrad(WarpSpecializedSm90):
  """The weight gradient of a grouped GEMM: ``out[g] = lhs[rows of g]^T @ ct[rows of g]``
  (float32 ``[G, K, N]``; 0 for an empty group), contracting over each group's rows.

  Layouts: lhs ``(K, M, 1)`` and ct ``(N, M, 1)``, i.e. ``lhs [M, K]`` and ``ct [M, N]`` as
  stored, read transposed (MN-major operands); out ``(K, N, G)`` N-fastest; ``row_starts
  [G+1]`` int32. Grid ``(ceil(K / 128), ceil(N / 256), G)``, warp-specialized as
  ``GroupedGemm``. A group's last block of 64 rows reaches into the next group: before its
  MMAs the MMA warpgroups zero those rows of the ct tile in shared memory.
  """

  def __init__(self, dtype):
    self.dtype = dtype
    self.acc_dtype = cutlass.Float32

  def __repr__(self):  # part of the exported symbol names: keep them stable
    return f"GroupedWgrad_{self.dtype.__name__}"

  @cute.jit
  def __call__(self, lhs: cute.Tensor, ct: cute.Tensor, out: cute.Tensor,
               row_starts: cute.Tensor, stream: cuda.CUstream):
    (tma_a, tma_lhs), (tma_b, tma_ct) = self.setup(lhs, ct, TILE_N)
    grid = [(cute.size(lhs, mode=[0]) + TILE_M - 1) // TILE_M,
            (cute.size(ct, mode=[0]) + TILE_N - 1) // TILE_N,
            cute.size(row_starts, mode=[0]) - 1]
    self.kernel(tma_a, tma_lhs, tma_b, tma_ct, out, row_starts, self.tiled_mma,
                self.a_smem, self.b_smem).launch(grid=grid, block=[THREADS, 1, 1],
                                                 stream=stream)

  @cute.kernel
  def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom,
             mB: cute.Tensor, mC: cute.Tensor, row_starts: cute.Tensor,
             tiled_mma: cute.TiledMma, a_smem: cute.ComposedLayout,
             b_smem: cute.ComposedLayout):
    tidx, _, _ = cute.arch.thread_idx()
    tile_i, tile_j, group = cute.arch.block_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    loads, sA, sB, _ = self.shared_stages(tma_a, tma_b, a_smem, b_smem)
    row_start = row_starts[group]
    rows = row_starts[group + 1] - row_start
    tile_k = self.tile_mnk[2]
    k_tiles = (rows + tile_k - 1) // tile_k
    warpgroup = cute.arch.make_warp_uniform(tidx // 128)

    if warpgroup == 0:
      cute.arch.setmaxregister_decrease(LOAD_REGS)
      if warp == 0:
        gA = cute.local_tile(cute.domain_offset((0, row_start, 0), mA), self.tile_mnk,
                             (tile_i, tile_j, None, 0), proj=(1, None, 1))
        gB = cute.local_tile(cute.domain_offset((0, row_start, 0), mB), self.tile_mnk,
                             (tile_i, tile_j, None, 0), proj=(None, 1, 1))
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2),
            cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2),
            cute.group_modes(gB, 0, 2))
        produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                               self.stages)
        for k in cutlass.range(k_tiles, unroll=1):
          loads.producer_acquire(produce)
          barrier = loads.producer_get_barrier(produce)
          cute.copy(tma_a, tAgA[(None, k)], tAsA[(None, produce.index)], tma_bar_ptr=barrier)
          cute.copy(tma_b, tBgB[(None, k)], tBsB[(None, produce.index)], tma_bar_ptr=barrier)
          loads.producer_commit(produce)
          produce.advance()
        loads.producer_tail(produce)
    else:
      cute.arch.setmaxregister_increase(MMA_REGS)
      mma_tidx = tidx - 128
      tCrA, tCrB, thr_c = self.mma_fragments(tiled_mma, sA, sB, tidx, warpgroup)
      tCcC = thr_c.partition_C(cute.make_identity_tensor((TILE_M, TILE_N)))
      acc = cute.make_rmem_tensor(tCcC.shape, self.acc_dtype)
      acc.fill(0.0)
      tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
      consume = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
      release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
      tail = rows - (k_tiles - 1) * tile_k  # rows of the last block that are the group's
      for k in cutlass.range(k_tiles, unroll=1):
        loads.consumer_wait(consume)
        if k == k_tiles - 1 and tail < tile_k:
          # Zero the ct rows past the group (generic-proxy stores, then made visible to
          # the MMAs' async proxy, then all 256 MMA threads meet).
          for e in cutlass.range(mma_tidx, TILE_N * tile_k, 256, unroll=1):
            r = e // TILE_N
            if r >= tail:
              sB[(e - r * TILE_N, r, consume.index)] = self.dtype(0.0)
          cute.arch.fence_proxy("async.shared", space="cta")
          cute.arch.barrier(barrier_id=1, number_of_threads=256)
        self.mma_k_tile(tiled_mma, acc, tCrA, tCrB, consume.index)
        if k > 0:
          loads.consumer_release(release)
          release.advance()
        consume.advance()
      cute.nvgpu.warpgroup.wait_group(0)
      if k_tiles > 0:
        loads.consumer_release(release)

      gC = cute.local_tile(mC, (TILE_M, TILE_N), (tile_i, tile_j, group))
      tCgC = thr_c.partition_C(gC)
      k_dim, n = cute.size(mC, mode=[0]), cute.size(mC, mode=[1])
      for i in cutlass.range_constexpr(cute.size(tCgC)):
        coord = tCcC[i]
        if tile_i * TILE_M + coord[0] < k_dim and tile_j * TILE_N + coord[1] < n:
          tCgC[i] = acc[i]


def variants():
  """(prefix, jit function, compile arguments): ``grouped_wgrad_<bf16|f16>``."""
  for name, dtype in (("bf16", cutlass.BFloat16), ("f16", cutlass.Float16)):
    m, k, n = cute.sym_int32(symbol="m"), cute.sym_int32(8, "k"), cute.sym_int32(8, "n")
    lhs = cute.runtime.make_fake_tensor(dtype, (k, m, 1), (1, k, cute.sym_int64(8)),
                                        assumed_align=16)
    ct = cute.runtime.make_fake_tensor(dtype, (n, m, 1), (1, n, cute.sym_int64(8)),
                                       assumed_align=16)
    out = cute.runtime.make_fake_tensor(cutlass.Float32, (k, n, cute.sym_int32()),
                                        (n, 1, cute.sym_int64(8)), assumed_align=16)
    starts = cute.runtime.make_fake_compact_tensor(cutlass.Int32, (cute.sym_int32(),))
    yield (f"grouped_wgrad_{name}", GroupedWgrad(dtype),
           (lhs, ct, out, starts, cuda.CUstream(0)))
