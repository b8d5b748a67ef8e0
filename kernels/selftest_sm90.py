"""The smallest ahead-of-time kernel: ``out = alpha * x + y`` over float32 vectors of any
length. It proves the AOT path on a machine (compiled here, linked into cudnn_jax._ffi,
launched from an XLA FFI handler on XLA's stream) and is exposed as ``cudnn_jax_aot_axpy``.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

THREADS = 256


@cute.kernel
def _axpy_kernel(x: cute.Tensor, y: cute.Tensor, out: cute.Tensor, alpha: cutlass.Float32,
                 n: cutlass.Int32):
  tidx, _, _ = cute.arch.thread_idx()
  bidx, _, _ = cute.arch.block_idx()
  i = bidx * THREADS + tidx
  if i < n:
    out[i] = alpha * x[i] + y[i]


@cute.jit
def axpy(x: cute.Tensor, y: cute.Tensor, out: cute.Tensor, alpha: cutlass.Float32,
         stream: cuda.CUstream):
  n = cute.size(x, mode=[0])
  _axpy_kernel(x, y, out, alpha, n).launch(
      grid=[(n + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1], stream=stream)


def variants():
  """(prefix, jit function, compile arguments) of every variant to build."""
  n = cute.sym_int32(symbol="n")
  vector = lambda: cute.runtime.make_fake_compact_tensor(cutlass.Float32, (n,),
                                                         assumed_align=4)
  yield "aot_axpy_f32", axpy, (vector(), vector(), vector(), cutlass.Float32(1.0),
                               cuda.CUstream(0))
