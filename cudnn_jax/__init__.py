"""cudnn_jax: cuDNN-grade fused GPU ops for JAX, with a pure-JAX engine everywhere.

Every op takes ``implementation=None | "cudnn" | "cute" | "triton" | "mosaic" | "xla" |
sequence``, engines named after the technology that runs them; None picks the fastest
engine that serves the call and falls back to "xla".
"""

from cudnn_jax._extension import cache_info
from cudnn_jax.ops.bsa import bsa, bsa_from_mask
from cudnn_jax.ops.conv3d import conv3d
from cudnn_jax.engines import UnsupportedError, explain
from cudnn_jax.ops.gemm import gemm, grouped_gemm
from cudnn_jax.ops.kda import gdn, kda
from cudnn_jax.ops.moe import moe_mlp
from cudnn_jax.ops.sdpa import sdpa
from cudnn_jax.ops.sdpa_fp8 import sdpa_fp8
from cudnn_jax.ops.sdpa_paged import sdpa_paged
from cudnn_jax.ops.sdpa_varlen import sdpa_varlen

__all__ = ["UnsupportedError", "bsa", "bsa_from_mask", "cache_info", "conv3d", "explain", "gdn",
           "gemm", "grouped_gemm", "kda", "moe_mlp", "sdpa", "sdpa_fp8", "sdpa_paged",
           "sdpa_varlen"]
__version__ = "0.1.0"
