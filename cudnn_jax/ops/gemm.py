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

from cudnn_jax import _checks, _extension, _metadata, engines, epilogue
from cudnn_jax.primitives import core
from cudnn_jax.primitives import grouped_gemm as prim
from cudnn_jax.reference import gemm as ref

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
  return call, GemmInputs(*_checks.arrays(a, b, bias))


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
  return call, GroupedGemmInputs(*_checks.arrays(lhs, rhs, group_sizes, bias))


def grouped_gemm(lhs, rhs, group_sizes, *, bias=None, activation=None, glu=None,
                 out_dtype=None, implementation=None):
  """Grouped matrix product with a fused epilogue (``jax.lax.ragged_dot`` semantics).

  ``lhs [M, K]`` with rows sorted by group, ``rhs [G, K, N]`` (``[G, K, 2N]`` with
  ``glu``), ``group_sizes [G]`` int32 (group g owns the next ``group_sizes[g]`` rows),
  ``bias [G, N]`` (``[G, 2N]``). Row i of group g: ``epilogue(lhs[i] @ rhs[g] + bias[g])``
  with the epilogue of ``gemm`` (activation, or glu with activation None). Rows past
  ``sum(group_sizes)`` are 0; a negative group size counts as 0 and groups past row M are
  cut there, on every engine. Under ``jax.experimental.checkify.checkify`` (user checks)
  such a size raises an error naming ``group_sizes`` and the entry. Returns ``[M, N]`` in
  ``out_dtype`` (default: lhs's dtype). Differentiable in lhs, rhs, bias.

  Under ``jax.vmap`` the batch runs as one call (on the GPU engines, one kernel launch over
  the rows of every batch entry), and a batch sharded on a device mesh stays where it is.
  """
  call, inputs = _prepare_grouped(lhs, rhs, group_sizes, bias=bias, activation=activation,
                                  glu=glu, out_dtype=out_dtype)
  _metadata.check_group_sizes("group_sizes", inputs.group_sizes, call.m)  # under checkify
  engine = engines.choose("grouped_gemm", call, implementation)
  arrays = [x[None] for x in inputs if x is not None]
  return _grouped_per_shard((engine.name, call), *arrays)[0][0]


def _grouped_batch(config, lhs, rhs, group_sizes, *bias):
  """The engine's grouped_gemm over a batch: ``lhs [B, M, K]``, ``rhs [R, G, K, C]``,
  ``group_sizes [B, G]``, ``bias [R, G, C]`` (R = B, or 1: shared) -> ``[B, M, N]``."""
  name, call = config
  run = engines.engine("grouped_gemm", name).run
  shared = rhs.shape[0] != lhs.shape[0]
  one = lambda l, r, s, *b: run(call, GroupedGemmInputs(l, r, s, *b))
  if lhs.shape[0] == 1:  # (also what jax.vmap batches: nested, it would vmap ragged_dot twice)
    return (one(lhs[0], rhs[0], group_sizes[0], *[b[0] for b in bias])[None],)
  axes = (0, None if shared else 0, 0) + (None if shared else 0,) * len(bias)
  weights = [x[0] if shared else x for x in (rhs, *bias)]
  return (jax.vmap(one, in_axes=axes)(lhs, weights[0], group_sizes, *weights[1:]),)


def _grouped_rule(config, lhs, rhs, group_sizes, *bias):
  del config, group_sizes
  r = "b" if rhs[0] == lhs[0] else "r"
  return f"b m k, {r} g k c, b g{f', {r} g c' if bias else ''} -> b m n"


# Batches stay local on a mesh: grouped_gemm's own batch of one, or jax.vmap's.
_grouped_per_shard = core.per_shard("grouped_gemm", _grouped_batch, _grouped_rule,
                                    shardable=("b",))


def _run_grouped_xla(call: GroupedGemmCall, x: GroupedGemmInputs):
  y = ref.grouped_gemm(x.lhs, x.rhs, x.group_sizes, x.bias, activation=call.activation,
                       glu=call.glu)
  return y.astype(call.out_dtype)


engines.register_op("grouped_gemm", lambda *a, **kw: _prepare_grouped(*a, **kw)[0])
engines.register_engine("grouped_gemm", "xla", supports=lambda call: None,
                        run=_run_grouped_xla)


# GPU engines: "cute" (our CuTe DSL kernel, kernels/grouped_gemm_sm90.py, compiled ahead of
# time with the bias and the activation or GLU fused into its epilogue) serves grouped_gemm by
# default on sm_90; "cudnn" (cuDNN's MoE grouped matmul node, epilogues in XLA) is opt-in,
# and so is gemm's "cute": XLA's dense matmul is as fast without an epilogue. Measured
# speeds are in README.md and bench/NOTES.md. The handlers' calls are primitives over a
# batch (cudnn_jax/primitives/grouped_gemm.py); here a call is a batch of one.


def _grouped_product_on(matmul, outer=ref.grouped_outer):
  """``lhs @ rhs`` per group, float32 ``[M, N]``, 0 past the groups, on a GPU grouped
  matmul ``matmul(lhs, w, group_sizes)`` (``w [G, K, N]``; lhs's dtype out): the lhs
  gradient runs on the same matmul against the transposed weights, the rhs gradient on
  ``outer(lhs, ct, group_sizes)`` (float32 ``[G, K, N]``)."""

  @jax.custom_vjp
  def product(lhs, rhs, group_sizes):
    return matmul(lhs, rhs, group_sizes).astype(jnp.float32)

  def fwd(lhs, rhs, group_sizes):
    return product(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)

  def bwd(res, ct):
    lhs, rhs, group_sizes = res
    ct = ct.astype(lhs.dtype)
    d_lhs = matmul(ct, jnp.swapaxes(rhs, 1, 2), group_sizes)
    return d_lhs, outer(lhs, ct, group_sizes).astype(rhs.dtype), None

  product.defvjp(fwd, bwd)
  return product


def _grouped_on(product, lhs, rhs, group_sizes, bias=None, *, activation=None, glu=None):
  """``grouped_gemm``'s float32 value with the product on ``product``."""
  group_sizes = ref.clamped_sizes(group_sizes, lhs.shape[0])
  return ref.grouped_epilogue(product(lhs, rhs, group_sizes), group_sizes, bias,
                              activation=activation, glu=glu)


def _gpu_reason(call: GroupedGemmCall) -> str | None:
  if call.dtype not in ("bfloat16", "float16"):
    return f"dtype {call.dtype}: bfloat16 and float16 only"
  if jnp.finfo(call.out_dtype).nmant > jnp.finfo(call.dtype).nmant:
    return (f"out_dtype {call.out_dtype}: the GPU products come out in {call.dtype} (the xla "
            "engine keeps their float32 sums)")
  return _extension.unavailable_reason()


def _one(primitive, config, *arrays):
  """A primitive over a batch, called on one: ``arrays`` gain a leading batch of 1."""
  return primitive(config, *[x[None] for x in arrays])[0][0]


# "cudnn": cuDNN's MoE grouped matmul node.


def _grouped_matmul_check(dtype, m, k, n, groups):
  return _extension.module().grouped_matmul_check(
      dict(dtype=dtype, m=m, k=k, n=n, groups=groups)) or None


def _supports_grouped_cudnn(call: GroupedGemmCall) -> str | None:
  columns = call.n * (2 if call.glu else 1)
  # The forward product, and the lhs gradient (the same node against rhs as stored).
  return (_gpu_reason(call)
          or _grouped_matmul_check(call.dtype, call.m, call.k, columns, call.groups)
          or _grouped_matmul_check(call.dtype, call.m, columns, call.k, call.groups))


_cudnn_product = _grouped_product_on(functools.partial(_one, prim.matmul, None))


def _cudnn_grouped_gemm(lhs, rhs, group_sizes, bias=None, *, activation=None, glu=None):
  return _grouped_on(_cudnn_product, lhs, rhs, group_sizes, bias, activation=activation,
                     glu=glu)


def _run_grouped_cudnn(call: GroupedGemmCall, x: GroupedGemmInputs):
  return _cudnn_grouped_gemm(x.lhs, x.rhs, x.group_sizes, x.bias, activation=call.activation,
                             glu=call.glu).astype(call.out_dtype)


engines.register_engine("grouped_gemm", "cudnn", supports=_supports_grouped_cudnn,
                        run=_run_grouped_cudnn, opt_in=True)


# "cute": our kernel, the epilogue fused.


def _cute_variants(dtype, epilogue_name):
  """The kernel variants a call needs: the fused epilogue, the plain product (gradients,
  and every call under differentiation) and the weight gradient."""
  name = "bf16" if dtype == "bfloat16" else "f16"
  return (f"grouped_gemm_{name}_{epilogue_name}", f"grouped_gemm_{name}_none",
          f"grouped_wgrad_{name}")


def _supports_grouped_cute(call: GroupedGemmCall) -> str | None:
  if why := _gpu_reason(call):
    return why
  for variant in _cute_variants(call.dtype, call.glu or call.activation or "none"):
    if variant not in _extension.aot_kernels():
      return f"the extension was built without the AOT kernel {variant}"
  if call.k % 8 or call.n % 8:
    return f"K={call.k} and N={call.n} must be multiples of 8 (16-byte rows for TMA)"
  max_groups = _extension.kernel_constants()["grouped_gemm"]["max_groups"]
  if call.groups > max_groups:
    return f"{call.groups} groups: the kernel takes at most {max_groups}"
  return None


def _cute_kernel(lhs, rhs, group_sizes, bias=None, epilogue_name="none"):
  """The kernel: ``[M, N]`` in lhs's dtype, 0 past the groups."""
  bias = (jnp.zeros(rhs.shape[::2], jnp.float32) if bias is None
          else bias.astype(jnp.float32))
  return _one(prim.fused, epilogue_name, lhs, rhs, bias, group_sizes)


_cute_product = _grouped_product_on(
    _cute_kernel, outer=lambda lhs, ct, sizes: _one(prim.wgrad, None, lhs, ct, sizes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _cute_fused(lhs, rhs, group_sizes, bias, activation, glu):
  return _cute_kernel(lhs, rhs, group_sizes, bias, glu or activation or "none")


def _cute_fused_fwd(lhs, rhs, group_sizes, bias, activation, glu):
  # Differentiated: the plain product on the kernel and the epilogue in XLA, whose
  # intermediates (the product before the epilogue) the backward needs.
  unfused = lambda l, r, b: _grouped_on(_cute_product, l, r, group_sizes, b,
                                        activation=activation, glu=glu).astype(lhs.dtype)
  return jax.vjp(unfused, lhs, rhs, bias)


def _cute_fused_bwd(activation, glu, pull, ct):
  d_lhs, d_rhs, d_bias = pull(ct)
  return d_lhs, d_rhs, None, d_bias


_cute_fused.defvjp(_cute_fused_fwd, _cute_fused_bwd)


def _cute_grouped_gemm(lhs, rhs, group_sizes, bias=None, *, activation=None, glu=None):
  """``grouped_gemm`` on the kernel, epilogue fused: ``[M, N]`` in lhs's dtype, 0 past the
  groups. Differentiated, the forward runs the plain kernel and the epilogue in XLA
  (keeping the product for the backward); both gradients of the product run on kernels."""
  return _cute_fused(lhs, rhs, group_sizes, bias, activation, glu)


def _run_grouped_cute(call: GroupedGemmCall, x: GroupedGemmInputs):
  if call.out_dtype == call.dtype:
    return _cute_grouped_gemm(x.lhs, x.rhs, x.group_sizes, x.bias,
                              activation=call.activation, glu=call.glu)
  # Another output dtype: the epilogue's float32 result, cast once.
  return _grouped_on(_cute_product, x.lhs, x.rhs, x.group_sizes, x.bias,
                     activation=call.activation, glu=call.glu).astype(call.out_dtype)


engines.register_engine("grouped_gemm", "cute", supports=_supports_grouped_cute,
                        run=_run_grouped_cute)


def _as_one_group(call: GemmCall) -> GroupedGemmCall:
  rows = math.prod(call.batch) * call.m
  return GroupedGemmCall(m=rows, k=call.k, n=call.n, groups=1, dtype=call.dtype,
                         out_dtype=call.out_dtype, has_bias=call.has_bias,
                         activation=call.activation, glu=call.glu)


def _run_gemm_cute(call: GemmCall, x: GemmInputs):
  """gemm as a grouped GEMM of one group on the same kernel."""
  a = x.a.reshape(-1, call.k)
  sizes = jnp.full((1,), a.shape[0], jnp.int32)
  bias = None if x.bias is None else x.bias[None]
  if call.out_dtype == call.dtype and not call.return_amax:
    y = _cute_grouped_gemm(a, x.b[None], sizes, bias, activation=call.activation,
                           glu=call.glu)
    return y.reshape(*call.batch, call.m, call.n), None
  # amax and other output dtypes want the float32 epilogue result.
  h = _cute_product(a, x.b[None], sizes)
  h = h.reshape(*call.batch, call.m, x.b.shape[1])
  y = epilogue.apply(h, x.bias, activation=call.activation, glu=call.glu)
  return ref.finish(y, call.out_dtype, call.return_amax)


engines.register_engine("gemm", "cute",
                        supports=lambda call: _supports_grouped_cute(_as_one_group(call)),
                        run=_run_gemm_cute, opt_in=True)


# The grouped GEMMs of the GPU engines, by engine name (moe_mlp's engines run both
# projections on them): ``(lhs, rhs, group_sizes, bias=None, *, activation=None, glu=None)
# -> [M, N]``, float32 or lhs's dtype, 0 past the groups.
grouped_gemms = {"cudnn": _cudnn_grouped_gemm, "cute": _cute_grouped_gemm}
