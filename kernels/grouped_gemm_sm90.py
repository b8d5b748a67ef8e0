"""Grouped GEMM for sm_90a with a fused epilogue: for the rows of group g,
``h = lhs @ rhs[g] + bias[g]`` (float32), then ``out = act(h)`` or, for a GLU,
``out = act(h[:, :N]) * h[:, N:]``; group sizes are read on the device (no host sync),
WGMMA is fed by TMA through a multistage pipeline.

Layouts (CuTe mode order, ``L`` the batch mode); C = N, or 2N for a GLU:
  lhs ``(M, K, 1)`` K-fastest; rhs ``(C, K, G)`` C-fastest, i.e. ``rhs [G, K, C]`` as stored;
  bias ``(C, G)`` float32, i.e. ``bias [G, C]``; out ``(M, N, 1)`` N-fastest;
  ``tile_starts [G+1]`` int32, the exclusive cumulative sum of ``ceil(size_g / TILE_M)``;
  ``row_starts [G+1]`` int32, the exclusive cumulative sum of the group sizes.

A GLU tile computes 128 output columns from 256 columns of B: the gate columns
``[j*128, j*128+128)`` and the matching up columns ``N + [j*128, ...)``, loaded by two TMA
copies side by side into one 256-wide stage, so that one 256-wide MMA multiplies both (as
wide as a plain tile's: two 128-wide MMAs would read A from shared memory twice). A
thread's accumulator holds a gate column and its up column 128 apart, in its first and
second half, so the product needs no data movement.

Persistent and warp-specialized: ``ctas`` CTAs (at most one per SM) walk the output tiles
``(t, j)`` (row tile t, column tile j; ``tile_starts[G] * ceil(N / tile width)`` of them,
read on the device) in steps of ``ctas``, in bands of row tiles (``tile_coords``).
Warpgroup 0 loads (one thread issues the TMA copies into a ring of shared-memory stages);
warpgroups 1 and 2 multiply 64 rows each and run the epilogue, while the loads of their
next tile are already in flight. For row tile t the group g satisfies ``tile_starts[g] <=
t < tile_starts[g+1]``; its 128 rows start at ``row_starts[g] + (t - tile_starts[g]) *
TILE_M`` (rows of the next group or past M come along and are never stored), and only the
rows that belong to g are stored. Rows past ``sum(sizes)`` (from ``row_starts[G]`` to M)
are set to zero by the three warps of warpgroup 0 that issue no loads, while the others
multiply.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90

TILE_M, TILE_N = 128, 256  # TILE_N: the B columns a tile multiplies (2 x 128 for a GLU)
GLU_TILE_N = TILE_N // 2  # the output columns of a GLU tile (its B tile: gate and up halves)
THREADS = 384  # warpgroup 0 loads; warpgroups 1 and 2 multiply, 64 rows each
MMA_WARPS = 8
ZERO_WARPS = 3  # warps 1-3: zeros past the last group
MAX_GROUPS = 1 << 16  # the group search below takes 16 steps
LOAD_REGS, MMA_REGS = 40, 232  # registers per thread after the warpgroups' setmaxnreg
SMEM_BYTES = 227 * 1024
BARRIER_BYTES = 1024
# The epilogue writes the tile through shared memory in (TILE_M, EPI_N) pieces, two buffers
# in turn, so that each row of a piece leaves as whole 16-byte vectors (128 bytes a row).
EPI_N = 64
EPI_BUFFERS = 2
STORE_BITS = 128
# Tiles are walked in bands of row tiles, column by column inside a band, so that the CTAs
# of one wave share a few B column tiles and a band of A that stays in L2 (row by row, a
# wave would read all of a wide B: 64 MB at N=8192, K=4096, more than the 50 MB L2).
BAND_BYTES = 16 << 20  # the A band's size at most
BAND_ROWS = 16  # row tiles per band at most

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "srelu")  # as cudnn_jax.epilogue
GLU_ACTIVATION = {"swiglu": "silu", "geglu": "gelu", "reglu": "relu"}
GLU_EPILOGUES = tuple(GLU_ACTIVATION)
EPILOGUES = ("none",) + ACTIVATIONS + GLU_EPILOGUES


def _activate(x, name):
  """One float32 value through an activation of cudnn_jax.epilogue (gelu: the erf form)."""
  if name is None:
    return x
  if name in ("relu", "srelu"):
    r = cute.math.max(x, cutlass.Float32(0.0))
    return r * r if name == "srelu" else r
  if name == "silu":  # the hardware's approximate 2^x and 1/x: a few ulp, far below bf16
    e = cute.math.exp2(x * -1.4426950408889634, approx=True, ftz=True)
    return x * cute.math.rcp(1.0 + e, approx=True, ftz=True)
  if name == "gelu":
    return 0.5 * x * (1.0 + cute.math.erf(x * 0.7071067811865476))
  assert name == "gelu_tanh", name
  return 0.5 * x * (1.0 + cute.math.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


class WarpSpecializedSm90:
  """What the grouped GEMM kernels share (this one and grouped_wgrad_sm90.py): a 128-row
  tile split between two MMA warpgroups, a ring of TMA-fed shared-memory stages, and one
  loader warpgroup. Subclasses set ``dtype``, ``acc_dtype`` and ``halves`` (the TMA copies
  that fill a stage's B tile side by side). Helpers without control flow on device values
  are plain Python."""

  halves = 1
  epi_smem = None  # the output staging buffers' layout, for kernels that stage the output

  def setup(self, lhs: cute.Tensor, rhs: cute.Tensor, tile_n: int):
    """Host side: the tiled MMA, tile shape, stage count, shared-memory layouts and
    storage struct (on self); returns the TMA (atom, tensor) pairs of lhs and rhs. The
    stages share shared memory with ``epi_smem`` when a subclass sets it."""
    a_major = utils.LayoutEnum.from_tensor(lhs)
    b_major = utils.LayoutEnum.from_tensor(rhs)
    self.tiled_mma = sm90.make_trivial_tiled_mma(
        self.dtype, self.dtype, a_major.sm90_mma_major_mode(), b_major.sm90_mma_major_mode(),
        self.acc_dtype, (2, 1, 1), tiler_mn=(64, tile_n))
    tile_k = cute.size(self.tiled_mma.shape_mnk, mode=[2]) * 4
    self.tile_mnk = (TILE_M, tile_n, tile_k)
    stage_bytes = (TILE_M + tile_n) * tile_k * self.dtype.width // 8
    epi_elems = 64 if self.epi_smem is None else cute.cosize(self.epi_smem)
    epi_bytes = epi_elems * self.dtype.width // 8
    self.stages = (SMEM_BYTES - BARRIER_BYTES - epi_bytes) // stage_bytes
    self.a_smem = sm90.make_smem_layout_a(a_major, self.tile_mnk, self.dtype, self.stages)
    # B as the MMAs read it, and as the TMA copies fill it: slot s * halves + h is half h of
    # stage s. Tiled in the same order (K first for an N-major B), the slots of a stage
    # are its tile's halves, so both layouts address one buffer.
    self.b_smem = sm90.make_smem_layout_b(b_major, self.tile_mnk, self.dtype, self.stages)
    self.slot_mnk = (TILE_M, tile_n // self.halves, tile_k)
    self.b_slots = sm90.make_smem_layout_b(b_major, self.slot_mnk, self.dtype,
                                           self.stages * self.halves)
    assert cute.cosize(self.b_slots) == cute.cosize(self.b_smem)
    g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
    tma_a = cute.nvgpu.cpasync.make_tiled_tma_atom(
        g2s, lhs, cute.slice_(self.a_smem, (None, None, 0)), (TILE_M, tile_k))
    tma_b = cute.nvgpu.cpasync.make_tiled_tma_atom(
        g2s, rhs, cute.slice_(self.b_slots, (None, None, 0)), self.slot_mnk[1:])

    @cute.struct
    class Storage:
      barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
      a: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.a_smem)], 1024]
      b: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.b_smem)], 1024]
      c: cute.struct.Align[cute.struct.MemRange[self.dtype, epi_elems], 1024]

    self.storage = Storage
    return tma_a, tma_b

  @cute.jit
  def prefetch_descriptors(self, tma_a: cute.CopyAtom, tma_b: cute.CopyAtom):
    if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
      cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
      cute.nvgpu.cpasync.prefetch_descriptor(tma_b)

  def shared_stages(self, tma_a: cute.CopyAtom, tma_b: cute.CopyAtom,
                    a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout):
    """Kernel side: the TMA descriptors prefetched, the initialized TMA pipeline over the
    stages, the stage tensors and the storage ``(loads, sA, sB, storage)``."""
    self.prefetch_descriptors(tma_a, tma_b)
    storage = cutlass.utils.SmemAllocator().allocate(self.storage)
    stage_bytes = (cute.size_in_bytes(self.dtype, cute.slice_(a_smem, (None, None, 0)))
                   + cute.size_in_bytes(self.dtype, cute.slice_(b_smem, (None, None, 0))))
    loads = pipeline.PipelineTmaAsync.create(
        barrier_storage=storage.barriers.data_ptr(), num_stages=self.stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, MMA_WARPS),
        tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        defer_sync=True)
    pipeline.pipeline_init_arrive()
    pipeline.pipeline_init_wait()
    return (loads, storage.a.get_tensor(a_smem.outer, swizzle=a_smem.inner),
            storage.b.get_tensor(b_smem.outer, swizzle=b_smem.inner), storage)

  def mma_k_tile(self, tiled_mma: cute.TiledMma, acc, tCrA, tCrB, stage):
    """Issues one K tile's MMAs from ``stage``, then waits for the previous K tile's MMAs:
    one K tile's MMAs run while the next are issued, so the caller may release the
    previous stage."""
    cute.nvgpu.warpgroup.fence()
    for kb in range(cute.size(tCrA, mode=[2])):  # static: unrolled
      cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, stage)], tCrB[(None, None, kb, stage)],
                acc)
    cute.nvgpu.warpgroup.commit_group()
    cute.nvgpu.warpgroup.wait_group(1)

  def mma_fragments(self, tiled_mma: cute.TiledMma, sA, sB, tidx, warpgroup):
    """For an MMA thread: the A and B fragments over all stages (per warpgroup), and the
    thread's slice for the accumulator (registers are per thread, so C is partitioned by
    the thread, not the warpgroup)."""
    thr_mma = tiled_mma.get_slice(cute.make_layout(2, stride=128)(warpgroup - 1))
    return (tiled_mma.make_fragment_A(thr_mma.partition_A(sA)),
            tiled_mma.make_fragment_B(thr_mma.partition_B(sB)),
            tiled_mma.get_slice(tidx - 128))


class GroupedGemm(WarpSpecializedSm90):
  """One compiled variant: ``dtype`` of lhs, rhs and out, float32 accumulation, and the
  epilogue: "none", an activation, or a GLU (``EPILOGUES``)."""

  def __init__(self, dtype, epilogue="none"):
    assert epilogue in EPILOGUES, epilogue
    self.dtype = dtype
    self.acc_dtype = cutlass.Float32
    self.epilogue = epilogue
    self.glu = epilogue in GLU_EPILOGUES
    self.activation = GLU_ACTIVATION.get(epilogue, None if epilogue == "none" else epilogue)
    self.halves = 2 if self.glu else 1  # B column blocks per tile: gate and up for a GLU

  def __repr__(self):  # part of the exported symbol names: keep them stable
    return f"GroupedGemm_{self.dtype.__name__}_{self.epilogue}"

  @cute.jit
  def __call__(self, lhs: cute.Tensor, rhs: cute.Tensor, bias: cute.Tensor, out: cute.Tensor,
               tile_starts: cute.Tensor, row_starts: cute.Tensor, ctas: cutlass.Int32,
               stream: cuda.CUstream):
    self.epi_smem = sm90.make_smem_layout_epi(self.dtype, utils.LayoutEnum.ROW_MAJOR,
                                              (TILE_M, EPI_N), EPI_BUFFERS)
    (tma_a, tma_lhs), (tma_b, tma_rhs) = self.setup(lhs, rhs, TILE_N)
    self.kernel(tma_a, tma_lhs, tma_b, tma_rhs, bias, out, tile_starts, row_starts,
                self.tiled_mma, self.a_smem, self.b_smem, self.b_slots,
                self.epi_smem).launch(
                    grid=[ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

  @cute.jit
  def tile_rows(self, tile_starts: cute.Tensor, row_starts: cute.Tensor, row_tile):
    """(group, first row, end row of the group) of a row tile; group = G past the last."""
    # group = the largest g <= G with tile_starts[g] <= row_tile (tile_starts is sorted and
    # starts at 0), by bisection on the bits of g.
    groups = cute.size(row_starts, mode=[0]) - 1
    group = cutlass.Int32(0)
    for i in cutlass.range_constexpr(MAX_GROUPS.bit_length() - 1):
      step = MAX_GROUPS >> (i + 1)
      if group + step <= groups:
        if tile_starts[group + step] <= row_tile:
          group = group + step
    row_start = cutlass.Int32(0)
    row_end = cutlass.Int32(0)
    if group < groups:
      row_start = row_starts[group] + (row_tile - tile_starts[group]) * TILE_M
      row_end = row_starts[group + 1]
    return group, row_start, row_end

  @cute.jit
  def tile_coords(self, tile, row_tiles, col_tiles, band):
    """(row tile, column tile) of the tile-th tile: bands of ``band`` row tiles one after the
    other, each walked column by column (the last band may have fewer rows)."""
    band_tiles = band * col_tiles
    first_row = (tile // band_tiles) * band
    rows = cutlass.min(band, row_tiles - first_row)
    local = tile - first_row * col_tiles
    return first_row + local % rows, local // rows

  @cute.jit
  def zero_tail(self, mC: cute.Tensor, row_starts: cute.Tensor, thread, cta, ctas):
    """Rows ``row_starts[G]`` to M of ``mC`` set to zero, in (rows, EPI_N) tiles of 16-byte
    row vectors, the tiles walked by ``thread`` of the ZERO_WARPS of every CTA."""
    first = row_starts[cute.size(row_starts, mode=[0]) - 1]
    m, n = cute.size(mC, mode=[0]), cute.size(mC, mode=[1])
    vector = STORE_BITS // self.dtype.width
    row_threads = EPI_N // vector
    rows = ZERO_WARPS * 32 // row_threads
    z2g = cute.make_tiled_copy_tv(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                            num_bits_per_copy=STORE_BITS),
        cute.make_layout((rows, row_threads), stride=(row_threads, 1)),
        cute.make_layout((1, vector)))
    thr = z2g.get_slice(thread)
    tZcZ = thr.partition_D(cute.make_identity_tensor((rows, EPI_N)))
    col_tiles = (n + EPI_N - 1) // EPI_N
    row_tiles = (m - first + rows - 1) // rows
    for t in cutlass.range(cta, row_tiles * col_tiles, ctas, unroll=1):
      row_tile = t // col_tiles
      col_tile = t - row_tile * col_tiles
      row_start = first + row_tile * rows
      tZgZ = thr.partition_D(cute.local_tile(cute.domain_offset((row_start, 0, 0), mC),
                                             (rows, EPI_N), (0, col_tile, 0)))
      zeros = cute.make_rmem_tensor_like(tZgZ[(None, 0, 0)])
      zeros.fill(0.0)
      coord = tZcZ[(0, 0, 0)]
      if row_start + coord[0] < m and col_tile * EPI_N + coord[1] < n:
        cute.copy(z2g, zeros, tZgZ[(None, 0, 0)])

  @cute.kernel
  def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom,
             mB: cute.Tensor, mBias: cute.Tensor, mC: cute.Tensor, tile_starts: cute.Tensor,
             row_starts: cute.Tensor, tiled_mma: cute.TiledMma,
             a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout,
             b_slots: cute.ComposedLayout, epi_smem: cute.ComposedLayout):
    tidx, _, _ = cute.arch.thread_idx()
    cta, _, _ = cute.arch.block_idx()
    ctas, _, _ = cute.arch.grid_dim()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    loads, sA, sB, storage = self.shared_stages(tma_a, tma_b, a_smem, b_smem)
    sB_slots = storage.b.get_tensor(b_slots.outer, swizzle=b_slots.inner)
    n = cute.size(mC, mode=[1])  # output columns; B's half h starts at column h * n
    out_n = self.slot_mnk[1]  # output columns of a tile
    col_tiles = (n + out_n - 1) // out_n
    row_tiles = tile_starts[cute.size(tile_starts, mode=[0]) - 1]
    tiles = row_tiles * col_tiles
    k_dim = cute.size(mA, mode=[1])
    band = cutlass.max(1, cutlass.min(
        BAND_ROWS, BAND_BYTES // (TILE_M * k_dim * (self.dtype.width // 8))))
    k_tiles = (k_dim + self.tile_mnk[2] - 1) // self.tile_mnk[2]
    warpgroup = cute.arch.make_warp_uniform(tidx // 128)

    if warpgroup == 0:
      # Loads: one thread keeps the ring of stages full, tile after tile.
      cute.arch.setmaxregister_decrease(LOAD_REGS)
      if warp == 0:
        produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                               self.stages)
        for tile in cutlass.range(cta, tiles, ctas, unroll=1):
          row_tile, col_tile = self.tile_coords(tile, row_tiles, col_tiles, band)
          group, row_start, _ = self.tile_rows(tile_starts, row_starts, row_tile)
          gA = cute.local_tile(cute.domain_offset((row_start, 0, 0), mA), self.tile_mnk,
                               (0, col_tile, None, 0), proj=(1, None, 1))
          tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
              tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2),
              cute.group_modes(gA, 0, 2))
          tBgB = []
          for h in cutlass.range_constexpr(self.halves):
            gB = cute.local_tile(cute.domain_offset((h * n, 0, 0), mB), self.slot_mnk,
                                 (0, col_tile, None, group), proj=(None, 1, 1))
            tBsB, tBgB_h = cute.nvgpu.cpasync.tma_partition(
                tma_b, 0, cute.make_layout(1), cute.group_modes(sB_slots, 0, 2),
                cute.group_modes(gB, 0, 2))
            tBgB.append(tBgB_h)
          for k in cutlass.range(k_tiles, unroll=1):
            loads.producer_acquire(produce)
            barrier = loads.producer_get_barrier(produce)
            cute.copy(tma_a, tAgA[(None, k)], tAsA[(None, produce.index)],
                      tma_bar_ptr=barrier)
            for h in cutlass.range_constexpr(self.halves):
              cute.copy(tma_b, tBgB[h][(None, k)],
                        tBsB[(None, produce.index * self.halves + h)], tma_bar_ptr=barrier)
            loads.producer_commit(produce)
            produce.advance()
        loads.producer_tail(produce)
      else:
        self.zero_tail(mC, row_starts, tidx - 32, cta, ctas)
    else:
      # Multiply-accumulate and epilogue: warpgroups 1 and 2, 64 rows of the tile each.
      cute.arch.setmaxregister_increase(MMA_REGS)
      tCrA, tCrB, thr_c = self.mma_fragments(tiled_mma, sA, sB, tidx, warpgroup)
      tCcC = thr_c.partition_C(cute.make_identity_tensor(self.tile_mnk[:2]))
      acc = cute.make_rmem_tensor(tCcC.shape, self.acc_dtype)
      # A thread's values run over the MMA's 8-column blocks last, so a GLU's gate half
      # (the tile's first 128 columns) is the first half of acc, its up half the second.
      half = cute.size(acc) // self.halves
      tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)  # acc += A B throughout

      # The epilogue's two copies: accumulator registers (acc, after the epilogue
      # math) to a shared-memory piece by stmatrix, then the piece to global memory as
      # 16-byte row vectors, skipping the rows past the group and the columns past N.
      sC = storage.c.get_tensor(epi_smem.outer, swizzle=epi_smem.inner)
      r2s = cute.make_tiled_copy_S(
          sm90.get_smem_store_op(utils.LayoutEnum.ROW_MAJOR, self.dtype, self.acc_dtype),
          cute.make_tiled_copy_C_atom(
              cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.dtype),
              tiled_mma))
      thr_r2s = r2s.get_slice(tidx - 128)
      tRS_sC = thr_r2s.partition_D(sC)
      tRS_acc = r2s.retile(acc)
      piece = cute.make_rmem_tensor(cute.shape(thr_r2s.partition_S(sC))[:3], self.dtype)
      vector = STORE_BITS // self.dtype.width
      row_threads = EPI_N // vector
      s2g = cute.make_tiled_copy_tv(
          cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                              num_bits_per_copy=STORE_BITS),
          cute.make_layout((MMA_WARPS * 32 // row_threads, row_threads),
                           stride=(row_threads, 1)),
          cute.make_layout((1, vector)))
      thr_s2g = s2g.get_slice(tidx - 128)
      tSG_sC = thr_s2g.partition_S(sC)
      tSG_cC = thr_s2g.partition_D(cute.make_identity_tensor((TILE_M, EPI_N)))
      pieces = out_n // EPI_N
      piece_written = pipeline.NamedBarrier(barrier_id=1, num_threads=MMA_WARPS * 32)

      consume = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
      release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
      for tile in cutlass.range(cta, tiles, ctas, unroll=1):
        row_tile, col_tile = self.tile_coords(tile, row_tiles, col_tiles, band)
        group, row_start, row_end = self.tile_rows(tile_starts, row_starts, row_tile)
        acc.fill(0.0)
        # A stage is released once the MMAs reading it are known complete.
        for k in cutlass.range(k_tiles, unroll=1):
          loads.consumer_wait(consume)
          self.mma_k_tile(tiled_mma, acc, tCrA, tCrB, consume.index)
          if k > 0:
            loads.consumer_release(release)
            release.advance()
          consume.advance()
        cute.nvgpu.warpgroup.wait_group(0)
        loads.consumer_release(release)
        release.advance()

        # Epilogue, in float32 in place: bias, activation or GLU.
        for i in cutlass.range_constexpr(half):
          col = col_tile * out_n + tCcC[i][1]
          if col < n:
            y = _activate(acc[i] + mBias[col, group], self.activation)
            if cutlass.const_expr(self.glu):
              y = y * (acc[i + half] + mBias[n + col, group])
            acc[i] = y
        # Then out, piece by piece, through the two shared-memory buffers in turn: the
        # barrier after a piece's stmatrix also tells that every thread has finished
        # storing the piece before (the other buffer), so one barrier a piece suffices.
        out_rows = cute.domain_offset((row_start, 0, 0), mC)
        for e in cutlass.range_constexpr(pieces):
          buffer = e % EPI_BUFFERS
          for v in cutlass.range_constexpr(cute.size(piece)):
            piece[v] = tRS_acc[e * cute.size(piece) + v].to(self.dtype)
          cute.copy(r2s, piece, tRS_sC[(None, None, None, buffer)])
          piece_written.arrive_and_wait()
          tSG_gC = thr_s2g.partition_D(
              cute.local_tile(out_rows, (TILE_M, EPI_N), (0, col_tile * pieces + e, 0)))
          col_start = col_tile * out_n + e * EPI_N
          for i in cutlass.range(cute.size(tSG_gC, mode=[1]), unroll=1):
            for j in cutlass.range_constexpr(cute.size(tSG_gC, mode=[2])):
              coord = tSG_cC[(0, i, j)]
              if row_start + coord[0] < row_end and col_start + coord[1] < n:
                cute.copy(s2g, tSG_sC[(None, i, j, buffer)], tSG_gC[(None, i, j)])


def variants():
  """(prefix, jit function, compile arguments): bf16 and f16, every epilogue;
  prefix ``grouped_gemm_<dtype>_<epilogue>``."""
  for name, dtype in (("bf16", cutlass.BFloat16), ("f16", cutlass.Float16)):
    for epilogue in EPILOGUES:
      m, k = cute.sym_int32(symbol="m"), cute.sym_int32(8, "k")
      n, c = cute.sym_int32(8, "n"), cute.sym_int32(8, "c")  # c = n, or 2n for a GLU
      groups = cute.sym_int32(symbol="groups")
      groups_plus_one = cute.sym_int32(symbol="groups_plus_one")
      lhs = cute.runtime.make_fake_tensor(dtype, (m, k, 1), (k, 1, cute.sym_int64(8)),
                                          assumed_align=16)
      rhs = cute.runtime.make_fake_tensor(dtype, (c, k, groups),
                                          (1, c, cute.sym_int64(8)), assumed_align=16)
      bias = cute.runtime.make_fake_tensor(cutlass.Float32, (c, groups), (1, c))
      out = cute.runtime.make_fake_tensor(dtype, (m, n, 1), (n, 1, cute.sym_int64(8)),
                                          assumed_align=16)
      starts = lambda: cute.runtime.make_fake_compact_tensor(cutlass.Int32,
                                                             (groups_plus_one,))
      yield (f"grouped_gemm_{name}_{epilogue}", GroupedGemm(dtype, epilogue),
             (lhs, rhs, bias, out, starts(), starts(), cutlass.Int32(1), cuda.CUstream(0)))
