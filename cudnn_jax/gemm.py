"""GEMM with a fused epilogue, and grouped GEMM: ``cudnn_jax.gemm``, ``cudnn_jax.grouped_gemm``.

The epilogue (``bias``, then ``activation`` or a ``glu``) is defined in
``cudnn_jax.epilogue``; products accumulate in float32 and the result is cast once, at the
end, to ``out_dtype`` (default: the input dtype).
"""

from __future__ import annotations

import dataclasses
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


# The cudnn engine: cuDNN's MoE grouped matmul node for the products, the epilogue in XLA.
# Opt-in until measured on hardware.


def _grouped_matmul_check(dtype, m, k, n, groups):
  from cudnn_jax import _extension  # pylint: disable=g-import-not-at-top
  return _extension.module().grouped_matmul_check(
      dict(dtype=dtype, m=m, k=k, n=n, groups=groups)) or None


def _supports_grouped_cudnn(call: GroupedGemmCall) -> str | None:
  from cudnn_jax import _extension  # pylint: disable=g-import-not-at-top
  if why := _extension.unavailable_reason():
    return why
  if call.dtype not in ("bfloat16", "float16"):
    return f"dtype {call.dtype}: cuDNN's grouped matmul runs bfloat16 and float16 only"
  columns = call.n * (2 if call.glu else 1)
  # The forward product, and the lhs gradient (the same node against rhs as stored).
  return (_grouped_matmul_check(call.dtype, call.m, call.k, columns, call.groups)
          or _grouped_matmul_check(call.dtype, call.m, columns, call.k, call.groups))


def _grouped_matmul_ffi(lhs, rhs_nk, offsets):
  """The FFI handler: group g's rows start at ``offsets[g]``; the last group runs to M."""
  return jax.ffi.ffi_call(
      "cudnn_jax_grouped_matmul",
      jax.ShapeDtypeStruct((lhs.shape[0], rhs_nk.shape[1]), lhs.dtype),
      vmap_method="sequential")(lhs, rhs_nk, offsets)


def _cudnn_matmul(lhs, rhs_nk, group_sizes):
  """``[M, N]`` in lhs's dtype: rows of group g times ``rhs_nk[g].T`` (``rhs_nk [G, N, K]``);
  rows past ``sum(group_sizes)`` are 0."""
  offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes)[:-1]])
  out = _grouped_matmul_ffi(lhs, rhs_nk, offsets.astype(jnp.int32))
  rows = jnp.arange(lhs.shape[0]) < jnp.sum(group_sizes)
  return jnp.where(rows[:, None], out, jnp.zeros((), out.dtype))


@jax.custom_vjp
def _cudnn_grouped_product(lhs, rhs, group_sizes):
  """``grouped_product`` on cuDNN: float32 ``[M, N]`` (the node rounds to lhs's dtype)."""
  # The node reads weights K-fastest; rhs [G, K, N] is N-fastest, so it is transposed once.
  return _cudnn_matmul(lhs, jnp.swapaxes(rhs, 1, 2), group_sizes).astype(jnp.float32)


def _cudnn_grouped_product_fwd(lhs, rhs, group_sizes):
  return _cudnn_grouped_product(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _cudnn_grouped_product_bwd(res, ct):
  from cudnn_jax.reference import gemm as ref  # pylint: disable=g-import-not-at-top
  lhs, rhs, group_sizes = res
  ct = ct.astype(lhs.dtype)
  d_lhs = _cudnn_matmul(ct, rhs, group_sizes)  # rhs [G, K, N] is [G][K][N]: N-fastest
  d_rhs = ref.grouped_outer(lhs, ct, group_sizes)
  return d_lhs, d_rhs.astype(rhs.dtype), None


_cudnn_grouped_product.defvjp(_cudnn_grouped_product_fwd, _cudnn_grouped_product_bwd)


def _run_grouped_cudnn(call: GroupedGemmCall, x: GroupedGemmInputs):
  from cudnn_jax.reference import gemm as ref  # pylint: disable=g-import-not-at-top
  y = ref.grouped_gemm(x.lhs, x.rhs, x.group_sizes, x.bias, activation=call.activation,
                       glu=call.glu, product=_cudnn_grouped_product)
  return y.astype(call.out_dtype)


engines.register_engine("grouped_gemm", "cudnn", supports=_supports_grouped_cudnn,
                        run=_run_grouped_cudnn, opt_in=True)
