"""GEMM with a fused epilogue, and grouped GEMM: ``cudnn_jax.gemm``, ``cudnn_jax.grouped_gemm``.

The epilogue (``bias``, then ``activation`` or a ``glu``) is defined in
``cudnn_jax.epilogue``; products accumulate in float32 and the result is cast once, at the
end, to ``out_dtype`` (default: the input dtype).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cudnn_jax import _checks, engines, epilogue

# out_dtype may also be a float8 type: that is what return_amax is for (scaling is left to
# the caller; the cast neither scales nor saturates).
OUT_DTYPES = _checks.FLOAT_DTYPES + (jnp.float8_e4m3fn, jnp.float8_e5m2)


class GemmInputs(NamedTuple):
  a: jax.Array  # [..., M, K]
  b: jax.Array  # [K, C], C = N or 2N with glu
  bias: jax.Array | None = None  # [C]


@dataclasses.dataclass(frozen=True)
class GemmCall:
  """Everything static about one gemm call."""
  batch: tuple  # a's leading dims
  m: int
  k: int
  n: int  # output columns (b has 2n with glu)
  dtype: str
  out_dtype: str
  has_bias: bool = False
  activation: str | None = None
  glu: str | None = None
  return_amax: bool = False


def _weights(name, x, like, rank):
  """Checks a weight operand: rank, and the dtype of ``like`` (the left operand)."""
  _checks.shape_of(name, x, rank)
  _checks.float_dtype(name, x)
  _checks.same_dtype(f"{like[0]}, {name}", like[1], x)


def _bias(name, bias, expected):
  if bias is None:
    return None
  _checks.shape_of(name, bias)
  _checks.float_dtype(name, bias)
  _checks.expect_shape(name, bias, expected)
  return bias


def _out_dtype(out_dtype, dtype):
  return _checks.dtype_arg("out_dtype", dtype if out_dtype is None else out_dtype,
                           OUT_DTYPES).name


def _prepare_gemm(a, b, *, bias=None, activation=None, glu=None, out_dtype=None,
                  return_amax=False, implementation=None):
  """Validates the user's arguments into (GemmCall, GemmInputs)."""
  del implementation
  shape = _checks.shape_of("a", a)
  if len(shape) < 2:
    raise ValueError(f"a: expected rank >= 2 [..., M, K], got shape {shape}")
  _checks.float_dtype("a", a)
  _weights("b", b, ("a", a), 2)
  epilogue.check(activation, glu)
  *batch, m, k = shape
  if b.shape[0] != k:
    raise ValueError(f"b: expected [K, N] with K={k} (a's last dim), got shape {b.shape}")
  n = epilogue.out_columns("b", b.shape[1], glu)
  bias = _bias("bias", bias, (b.shape[1],))
  call = GemmCall(batch=tuple(batch), m=m, k=k, n=n, dtype=jnp.dtype(a.dtype).name,
                  out_dtype=_out_dtype(out_dtype, a.dtype), has_bias=bias is not None,
                  activation=activation, glu=glu, return_amax=bool(return_amax))
  return call, GemmInputs(a, b, bias)


def gemm(a, b, *, bias=None, activation=None, glu=None, out_dtype=None, return_amax=False,
         implementation=None):
  """Matrix product with a fused epilogue.

  ``a [..., M, K]``, ``b [K, N]`` (``[K, 2N]`` with ``glu``), ``bias [N]`` (``[2N]``).
  ``h = a @ b + bias`` accumulated in float32, then
  ``activation`` in {None, "relu", "gelu" (erf), "gelu_tanh", "silu", "srelu" (relu^2)}, or
  ``glu`` in {None, "swiglu", "geglu" (erf gelu), "reglu"}:
  ``out = act(h[..., :N]) * h[..., N:]`` (gate half first); a GLU names its activation, so
  ``activation`` must then be None (else ValueError).

  Returns ``out [..., M, N]`` in ``out_dtype`` (default: a's dtype; a float8 type is cast
  to as is, without scaling), and with ``return_amax=True`` also ``amax = max|out|``
  (float32 scalar, of the value before the cast). Differentiable in a, b, bias.

  ``implementation``: None, "cudnn", "cute", "xla" or a sequence, as for every op;
  ``cudnn_jax.explain("gemm", ...)`` tells which engine would run.
  """
  call, inputs = _prepare_gemm(a, b, bias=bias, activation=activation, glu=glu,
                               out_dtype=out_dtype, return_amax=return_amax)
  out, amax = engines.dispatch("gemm", implementation, call, inputs)
  return (out, amax) if call.return_amax else out


def _run_gemm_xla(call: GemmCall, x: GemmInputs):
  from cudnn_jax.reference import gemm as ref  # pylint: disable=g-import-not-at-top
  y = ref.gemm(x.a, x.b, x.bias, activation=call.activation, glu=call.glu)
  return ref.finish(y, call.out_dtype, call.return_amax)


engines.register_op("gemm", lambda *a, **kw: _prepare_gemm(*a, **kw)[0])
engines.register_engine("gemm", "xla", supports=lambda call: None, run=_run_gemm_xla)


# ---------------------------------------------------------------------------------------
# Grouped GEMM.


class GroupedGemmInputs(NamedTuple):
  lhs: jax.Array  # [M, K], rows sorted by group
  rhs: jax.Array  # [G, K, C], C = N or 2N with glu
  group_sizes: jax.Array  # [G] int32
  bias: jax.Array | None = None  # [G, C]


@dataclasses.dataclass(frozen=True)
class GroupedGemmCall:
  """Everything static about one grouped_gemm call."""
  m: int
  k: int
  n: int
  groups: int
  dtype: str
  out_dtype: str
  has_bias: bool = False
  activation: str | None = None
  glu: str | None = None


def _group_sizes(group_sizes, groups):
  _checks.shape_of("group_sizes", group_sizes, 1)
  _checks.int_dtype("group_sizes", group_sizes)
  _checks.expect_shape("group_sizes", group_sizes, (groups,))
  return group_sizes.astype(jnp.int32)


def _prepare_grouped(lhs, rhs, group_sizes, *, bias=None, activation=None, glu=None,
                     out_dtype=None, implementation=None):
  """Validates the user's arguments into (GroupedGemmCall, GroupedGemmInputs)."""
  del implementation
  m, k = _checks.shape_of("lhs", lhs, 2)
  _checks.float_dtype("lhs", lhs)
  _weights("rhs", rhs, ("lhs", lhs), 3)
  epilogue.check(activation, glu)
  groups, rhs_k, columns = rhs.shape
  if groups < 1 or rhs_k != k:
    raise ValueError(f"rhs: expected [G, K, N] with G >= 1 and K={k} (lhs's last dim), "
                     f"got shape {rhs.shape}")
  n = epilogue.out_columns("rhs", columns, glu)
  group_sizes = _group_sizes(group_sizes, groups)
  bias = _bias("bias", bias, (groups, columns))
  call = GroupedGemmCall(m=m, k=k, n=n, groups=groups, dtype=jnp.dtype(lhs.dtype).name,
                         out_dtype=_out_dtype(out_dtype, lhs.dtype),
                         has_bias=bias is not None, activation=activation, glu=glu)
  return call, GroupedGemmInputs(lhs, rhs, group_sizes, bias)


def grouped_gemm(lhs, rhs, group_sizes, *, bias=None, activation=None, glu=None,
                 out_dtype=None, implementation=None):
  """Grouped matrix product with a fused epilogue (``jax.lax.ragged_dot`` semantics).

  ``lhs [M, K]`` with rows sorted by group, ``rhs [G, K, N]`` (``[G, K, 2N]`` with
  ``glu``), ``group_sizes [G]`` int32 (group g owns the next ``group_sizes[g]`` rows),
  ``bias [G, N]`` (``[G, 2N]``). Row i of group g: ``epilogue(lhs[i] @ rhs[g] + bias[g])``
  with the epilogue of ``gemm`` (activation, or glu with activation None). Rows past
  ``sum(group_sizes)`` are 0. Returns ``[M, N]`` in ``out_dtype`` (default: lhs's dtype).
  Differentiable in lhs, rhs, bias.
  """
  call, inputs = _prepare_grouped(lhs, rhs, group_sizes, bias=bias, activation=activation,
                                  glu=glu, out_dtype=out_dtype)
  return engines.dispatch("grouped_gemm", implementation, call, inputs)


def _run_grouped_xla(call: GroupedGemmCall, x: GroupedGemmInputs):
  from cudnn_jax.reference import gemm as ref  # pylint: disable=g-import-not-at-top
  y = ref.grouped_gemm(x.lhs, x.rhs, x.group_sizes, x.bias, activation=call.activation,
                       glu=call.glu)
  return y.astype(call.out_dtype)


engines.register_op("grouped_gemm", lambda *a, **kw: _prepare_grouped(*a, **kw)[0])
engines.register_engine("grouped_gemm", "xla", supports=lambda call: None,
                        run=_run_grouped_xla)


# GPU engines. "cute" (our kernel) serves grouped_gemm by default on sm_90: about 730
# TFLOP/s back to back at m32768 k4096 n2048 g8 on an H200, where lax.ragged_dot runs at
# 95. "cudnn" (cuDNN's grouped matmul node, about 230) is opt-in, and so is gemm's "cute":
# XLA's dense matmul is faster without an epilogue (810 vs 740), so also differentiated
# (the kernel then runs without its epilogue); with a GLU the kernel's forward only
# matches XLA's (730).


def _grouped_product_on(matmul, outer=None):
  """``grouped_product``'s contract on a GPU grouped matmul ``matmul(lhs, w, group_sizes)``
  (``w [G, K, N]``; lhs's dtype out, 0 past the last group): the lhs gradient runs on the
  same matmul against the transposed weights, the rhs gradient on ``outer(lhs, ct,
  group_sizes)`` (float32 ``[G, K, N]``), by default XLA's."""

  @jax.custom_vjp
  def product(lhs, rhs, group_sizes):
    return matmul(lhs, rhs, group_sizes).astype(jnp.float32)

  def fwd(lhs, rhs, group_sizes):
    return product(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)

  def bwd(res, ct):
    from cudnn_jax.reference import gemm as ref  # pylint: disable=g-import-not-at-top
    lhs, rhs, group_sizes = res
    ct = ct.astype(lhs.dtype)
    d_lhs = matmul(ct, jnp.swapaxes(rhs, 1, 2), group_sizes)
    d_rhs = (outer or ref.grouped_outer)(lhs, ct, group_sizes)
    return d_lhs, d_rhs.astype(rhs.dtype), None

  product.defvjp(fwd, bwd)
  return product


def _past_groups_zero(out, group_sizes):
  rows = jnp.arange(out.shape[0]) < jnp.sum(group_sizes)
  return jnp.where(rows[:, None], out, jnp.zeros((), out.dtype))


def _run_grouped_on(product):
  def run(call: GroupedGemmCall, x: GroupedGemmInputs):
    from cudnn_jax.reference import gemm as ref  # pylint: disable=g-import-not-at-top
    y = ref.grouped_gemm(x.lhs, x.rhs, x.group_sizes, x.bias, activation=call.activation,
                         glu=call.glu, product=product)
    return y.astype(call.out_dtype)
  return run


def _gpu_reason(call: GroupedGemmCall) -> str | None:
  from cudnn_jax import _extension  # pylint: disable=g-import-not-at-top
  if why := _extension.unavailable_reason():
    return why
  if call.dtype not in ("bfloat16", "float16"):
    return f"dtype {call.dtype}: bfloat16 and float16 only"
  return None


# "cudnn": cuDNN's MoE grouped matmul node.


def _grouped_matmul_check(dtype, m, k, n, groups):
  from cudnn_jax import _extension  # pylint: disable=g-import-not-at-top
  return _extension.module().grouped_matmul_check(
      dict(dtype=dtype, m=m, k=k, n=n, groups=groups)) or None


def _grouped_matmul_workspace(lhs, rhs_nk):
  """The u8 workspace result the handler runs cuDNN in."""
  from cudnn_jax import _extension  # pylint: disable=g-import-not-at-top
  from cudnn_jax.primitives import _common  # pylint: disable=g-import-not-at-top
  (m, k), (groups, n, _) = lhs.shape, rhs_nk.shape
  return _common.workspace_result(_extension.module().grouped_matmul_workspace(
      dict(dtype=jnp.dtype(lhs.dtype).name, m=m, k=k, n=n, groups=groups)))


def _supports_grouped_cudnn(call: GroupedGemmCall) -> str | None:
  columns = call.n * (2 if call.glu else 1)
  # The forward product, and the lhs gradient (the same node against rhs as stored).
  return (_gpu_reason(call)
          or _grouped_matmul_check(call.dtype, call.m, call.k, columns, call.groups)
          or _grouped_matmul_check(call.dtype, call.m, columns, call.k, call.groups))


def _grouped_matmul_ffi(lhs, rhs_nk, offsets):
  """The FFI handler: group g's rows start at ``offsets[g]``; the last group runs to M."""
  out, _ = jax.ffi.ffi_call(
      "cudnn_jax_grouped_matmul",
      (jax.ShapeDtypeStruct((lhs.shape[0], rhs_nk.shape[1]), lhs.dtype),
       _grouped_matmul_workspace(lhs, rhs_nk)),
      vmap_method="sequential")(lhs, rhs_nk, offsets)
  return out


def _cudnn_matmul(lhs, rhs, group_sizes):
  # The node reads weights K-fastest ([G, N, K]); XLA cancels the transpose where rhs
  # already comes transposed (the lhs gradient).
  offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes)[:-1]])
  out = _grouped_matmul_ffi(lhs, jnp.swapaxes(rhs, 1, 2), offsets.astype(jnp.int32))
  return _past_groups_zero(out, group_sizes)


_cudnn_grouped_product = _grouped_product_on(_cudnn_matmul)
engines.register_engine("grouped_gemm", "cudnn", supports=_supports_grouped_cudnn,
                        run=_run_grouped_on(_cudnn_grouped_product), opt_in=True)


# "cute": our CuTe DSL kernel (kernels/grouped_gemm_sm90.py), compiled ahead of time, with
# the bias and the activation or GLU fused into its epilogue.

_CUTE_TILE_M = 128  # the kernel's row tile
_CUTE_MAX_GROUPS = 1 << 16  # the kernel's group search covers this many
_GLUS = tuple(epilogue.GLU_ACTIVATION)


def _cute_variants(dtype, activation=None, glu=None):
  """The kernel variants a call needs: the fused epilogue, the plain product (gradients,
  and every call under differentiation) and the weight gradient."""
  name = "bf16" if dtype == "bfloat16" else "f16"
  return (f"grouped_gemm_{name}_{glu or activation or 'none'}", f"grouped_gemm_{name}_none",
          f"grouped_wgrad_{name}")


def _supports_grouped_cute(call: GroupedGemmCall) -> str | None:
  from cudnn_jax import _extension  # pylint: disable=g-import-not-at-top
  if why := _gpu_reason(call):
    return why
  for variant in _cute_variants(call.dtype, call.activation, call.glu):
    if variant not in _extension.aot_kernels():
      return f"the extension was built without the AOT kernel {variant}"
  if call.k % 8 or call.n % 8:
    return f"K={call.k} and N={call.n} must be multiples of 8 (16-byte rows for TMA)"
  if call.groups > _CUTE_MAX_GROUPS:
    return f"{call.groups} groups: the kernel takes at most {_CUTE_MAX_GROUPS}"
  return None


def _cute_grouped_gemm_ffi(lhs, rhs, bias, tile_starts, row_starts, *, epilogue):
  """The FFI handler: ``epilogue(lhs @ rhs[g] + bias[g])`` ([M, N], lhs's dtype) for the
  rows of each group; rows past the last group are zero."""
  columns = rhs.shape[2] // (2 if epilogue in _GLUS else 1)
  return jax.ffi.ffi_call(
      "cudnn_jax_cute_grouped_gemm",
      jax.ShapeDtypeStruct((lhs.shape[0], columns), lhs.dtype),
      vmap_method="sequential")(lhs, rhs, bias, tile_starts, row_starts,
                                epilogue=epilogue)


def _row_starts(group_sizes, rows):
  """[G+1] int32: where each group's rows start (and the last ends), clamped to ``rows``."""
  ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), rows)
  return jnp.concatenate([jnp.zeros((1,), ends.dtype), ends]).astype(jnp.int32)


def _cute_kernel(lhs, rhs, group_sizes, bias=None, activation=None, glu=None):
  """The kernel with its group tables; ``[M, N]`` in lhs's dtype, 0 past the last group (the
  kernel writes those zeros)."""
  zero = jnp.zeros((1,), jnp.int32)
  row_starts = _row_starts(group_sizes, lhs.shape[0])
  tiles = -(-jnp.diff(row_starts) // _CUTE_TILE_M)
  tile_starts = jnp.concatenate([zero, jnp.cumsum(tiles)]).astype(jnp.int32)
  bias = (jnp.zeros(rhs.shape[::2], jnp.float32) if bias is None
          else bias.astype(jnp.float32))
  return _cute_grouped_gemm_ffi(lhs, rhs, bias, tile_starts, row_starts,
                                epilogue=glu or activation or "none")


def _cute_grouped_wgrad_ffi(lhs, ct, row_starts):
  """The FFI handler: ``out[g] = lhs[rows of g]^T ct[rows of g]``, float32 [G, K, N]."""
  groups = row_starts.shape[0] - 1
  return jax.ffi.ffi_call(
      "cudnn_jax_cute_grouped_wgrad",
      jax.ShapeDtypeStruct((groups, lhs.shape[1], ct.shape[1]), jnp.float32),
      vmap_method="sequential")(lhs, ct, row_starts)


def _cute_wgrad(lhs, ct, group_sizes):
  return _cute_grouped_wgrad_ffi(lhs, ct, _row_starts(group_sizes, lhs.shape[0]))


_cute_grouped_product = _grouped_product_on(_cute_kernel, outer=_cute_wgrad)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _cute_fused(lhs, rhs, group_sizes, bias, activation, glu):
  return _cute_kernel(lhs, rhs, group_sizes, bias, activation, glu)


def _cute_unfused(lhs, rhs, group_sizes, bias, activation, glu):
  """The same value as the plain product on the kernel and the epilogue in XLA, whose
  intermediates (the product before the epilogue) the VJP needs."""
  from cudnn_jax.reference import gemm as ref  # pylint: disable=g-import-not-at-top
  y = ref.grouped_gemm(lhs, rhs, group_sizes, bias, activation=activation, glu=glu,
                       product=_cute_grouped_product)
  return y.astype(lhs.dtype)


def _cute_fused_fwd(lhs, rhs, group_sizes, bias, activation, glu):
  out, pull = jax.vjp(lambda l, r, b: _cute_unfused(l, r, group_sizes, b, activation, glu),
                      lhs, rhs, bias)
  return out, pull


def _cute_fused_bwd(activation, glu, pull, ct):
  d_lhs, d_rhs, d_bias = pull(ct)
  return d_lhs, d_rhs, None, d_bias


_cute_fused.defvjp(_cute_fused_fwd, _cute_fused_bwd)


def _cute_grouped_gemm(lhs, rhs, group_sizes, bias=None, *, activation=None, glu=None):
  """``grouped_gemm`` on the kernel, epilogue fused: ``[M, N]`` in lhs's dtype, 0 past the
  last group. Differentiated, the forward runs the plain kernel and the epilogue in XLA
  (keeping the product for the backward); the lhs gradient runs on the kernel, the rhs
  gradient on XLA."""
  return _cute_fused(lhs, rhs, group_sizes, bias, activation, glu)


def _run_grouped_cute(call: GroupedGemmCall, x: GroupedGemmInputs):
  if call.out_dtype == call.dtype:
    return _cute_grouped_gemm(x.lhs, x.rhs, x.group_sizes, x.bias,
                              activation=call.activation, glu=call.glu)
  # Another output dtype: the epilogue's float32 result, cast once.
  return _run_grouped_on(_cute_grouped_product)(call, x)


engines.register_engine("grouped_gemm", "cute", supports=_supports_grouped_cute,
                        run=_run_grouped_cute)


def _as_one_group(call: GemmCall) -> GroupedGemmCall:
  rows = math.prod(call.batch) * call.m
  return GroupedGemmCall(m=rows, k=call.k, n=call.n, groups=1, dtype=call.dtype,
                         out_dtype=call.out_dtype, has_bias=call.has_bias,
                         activation=call.activation, glu=call.glu)


def _run_gemm_cute(call: GemmCall, x: GemmInputs):
  """gemm as a grouped GEMM of one group on the same kernel."""
  from cudnn_jax.reference import gemm as ref  # pylint: disable=g-import-not-at-top
  a = x.a.reshape(-1, call.k)
  sizes = jnp.full((1,), a.shape[0], jnp.int32)
  bias = None if x.bias is None else x.bias[None]
  if call.out_dtype == call.dtype and not call.return_amax:
    y = _cute_grouped_gemm(a, x.b[None], sizes, bias, activation=call.activation,
                           glu=call.glu)
    return y.reshape(*call.batch, call.m, call.n), None
  # amax and other output dtypes want the float32 epilogue result.
  h = _cute_grouped_product(a, x.b[None], sizes)
  h = h.reshape(*call.batch, call.m, x.b.shape[1])
  y = epilogue.apply(h, x.bias, activation=call.activation, glu=call.glu)
  return ref.finish(y, call.out_dtype, call.return_amax)


engines.register_engine("gemm", "cute",
                        supports=lambda call: _supports_grouped_cute(_as_one_group(call)),
                        run=_run_gemm_cute, opt_in=True)


def _cudnn_grouped_gemm(lhs, rhs, group_sizes, bias=None, *, activation=None, glu=None):
  from cudnn_jax.reference import gemm as ref  # pylint: disable=g-import-not-at-top
  return ref.grouped_gemm(lhs, rhs, group_sizes, bias, activation=activation, glu=glu,
                          product=_cudnn_grouped_product)


# The grouped GEMMs of the GPU engines, by engine name (moe_mlp's engines use them too):
# ``(lhs, rhs, group_sizes, bias=None, *, activation=None, glu=None) -> [M, N]``, with
# ``reference.gemm.grouped_gemm``'s contract (float32 or lhs's dtype).
grouped_gemms = {"cudnn": _cudnn_grouped_gemm, "cute": _cute_grouped_gemm}
