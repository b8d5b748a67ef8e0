"""cuDNN SDPA as JAX primitives (``core.define``: batching, partitioning, CPU emulation).

``sdpa_fwd``: (q [B,T,N,H], k [B,S,K,H], v [B,S,K,Hv], [bias [Bb,Nb,T,S]],
[q_lens [B], kv_lens [B]], [cu_q [B+1], cu_kv [B+1]], [page_table [B,M]], [sinks [N]])
-> (out [B,T,N,Hv], lse [B,N,T] f32), lse only with ``config.with_lse``.
- packed rows (``config.packed_max_q > 0``): q [Tq,N,H], k [Tk,K,H], v [Tk,K,Hv] and out
  [Tq,N,Hv]; sequence b owns rows ``cu[b] : cu[b] + lens[b]`` (int32 row starts, the
  lengths at most the packed maxima, which are T and S); rows no sequence owns are 0.
- paged (``config.paged``): k [P,page,K,H], v [P,page,K,Hv] caches; logical page j of
  sequence b is page ``page_table[b, j]`` (every id in ``[0, P)``), S = M * page.
- sinks (``config.has_sinks``): a per-head logit in every row's softmax denominator.
``sdpa_bwd``: (q, k, v, out, dout, lse, [bias], [q_lens, kv_lens], [cu_q, cu_kv], [sinks])
-> (dq, dk, dv, [dbias]). The cuDNN backward reads the sinks through lse only (the handler
takes none); the sinks' own gradient follows from lse (``attention`` computes it).

On NVIDIA GPUs they lower to the handlers of ffi/sdpa_cudnn.cc; elsewhere to the same
contract in plain JAX, so their batching, partitioning and differentiation run on any
backend. Batch- and head-sharded operands are computed locally.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cudnn_jax.primitives import _common, core

# Field annotation (a string under postponed evaluation) -> the FFI attribute type.
_FFI_TYPES = {"float": np.float32, "bool": np.bool_, "int": np.int32}


@dataclasses.dataclass(frozen=True)
class SdpaConfig:
  """The attributes of the SDPA handlers, both of which take all of them (ffi/README.md)."""
  scale: float
  causal: bool = False
  bottom_right: bool = False
  window_left: int = -1  # -1: unbounded
  window_right: int = -1
  softcap: float = 0.0  # 0: off
  has_bias: bool = False
  has_padding: bool = False
  has_dbias: bool = False  # backward: produce the bias gradient
  # Forward: also produce lse. Without it cuDNN runs its inference graph (no stats).
  with_lse: bool = True
  # > 0: rows packed (THD), sequences of at most this many rows; 0: a [B,T,N,H] layout.
  packed_max_q: int = 0
  packed_max_kv: int = 0
  paged: bool = False  # forward: keys and values in paged caches
  has_sinks: bool = False  # forward: a sinks operand
  dropout: float = 0.0  # > 0: probabilities dropped (inverted) by a Philox mask of the seed

  def attributes(self) -> dict:
    """The FFI attributes, typed as the handlers bind them."""
    return {f.name: _FFI_TYPES[f.type](getattr(self, f.name)) for f in dataclasses.fields(self)}

  def check_config(self, *, backward, dtype, b, t, s, n, k, h, hv, bias_shape, pages=0,
                   page=0) -> dict:
    """The dict ``cudnn_jax._ffi.sdpa_check`` takes: the attributes and the shapes (paged:
    the caches' page count and page size)."""
    bias_b, bias_n = (bias_shape[0], bias_shape[1]) if self.has_bias else (0, 0)
    return dict(self.attributes(), backward=backward, dtype=dtype, b=b, t=t, s=s, n=n, k=k,
                h=h, hv=hv, bias_b=bias_b, bias_n=bias_n, pages=pages, page=page)


class Extras(NamedTuple):
  """The optional operands, in the handlers' order; absent ones None."""
  bias: jax.Array | None = None
  q_lens: jax.Array | None = None
  kv_lens: jax.Array | None = None
  cu_q: jax.Array | None = None  # packed: the sequences' first rows
  cu_kv: jax.Array | None = None
  page_table: jax.Array | None = None
  sinks: jax.Array | None = None
  seed: jax.Array | None = None  # dropout: [2] int32, the words of an int64 (and an offset)
  offset: jax.Array | None = None

  def present(self):
    return [x for x in self if x is not None]

  @classmethod
  def of(cls, config, operands, backward=False):
    """The operands after q, k, v (and out, dout, lse) as the config announces them."""
    flags = (config.has_bias, config.has_padding, config.has_padding,
             config.packed_max_q > 0, config.packed_max_q > 0,
             config.paged and not backward, config.has_sinks, config.dropout > 0,
             config.dropout > 0)
    operands = iter(operands)
    return cls(*(next(operands) if flag else None for flag in flags))


# ---------------------------------------------------------------------------------------
# The handlers' calls (cuda) and their contract in plain JAX (everywhere else).


def _dims(config, q, k, v, page_table):
  """(b, t, s, n, kv heads, h, hv, pages, page) of a call."""
  if config.packed_max_q:
    return (None, config.packed_max_q, config.packed_max_kv, q.shape[1], k.shape[1],
            q.shape[2], v.shape[2], 0, 0)
  b, t, n, h = q.shape
  if config.paged:
    pages, page = k.shape[:2]
    return b, t, page * page_table.shape[1], n, k.shape[2], h, v.shape[3], pages, page
  return b, t, k.shape[1], n, k.shape[2], h, v.shape[3], 0, 0


def _workspace(config, backward, q, k, v, extras: Extras):
  """The u8 workspace result the handler runs cuDNN in, sized for these (local) shapes."""
  from cudnn_jax import _extension  # pylint: disable=g-import-not-at-top
  b, t, s, n, kh, h, hv, pages, page = _dims(config, q, k, v, extras.page_table)
  if b is None:
    b = extras.q_lens.shape[0]
  query = config.check_config(
      backward=backward, dtype=jnp.dtype(q.dtype).name, b=b, t=t, s=s, n=n, k=kh, h=h, hv=hv,
      bias_shape=None if extras.bias is None else extras.bias.shape, pages=pages, page=page)
  return _common.workspace_result(_extension.module().sdpa_workspace(query))


def _handler_operands(config, q, k, v, extras: Extras):
  """The handler's trailing operands: packed row starts become the element offsets of q,
  k, v and out (one row of q is ``N * H`` elements)."""
  if not config.packed_max_q:
    return extras.present()
  n, kh = q.shape[1], k.shape[1]
  offsets = [(cu * per_row).astype(jnp.int32) for cu, per_row in (
      (extras.cu_q, n * q.shape[2]), (extras.cu_kv, kh * k.shape[2]),
      (extras.cu_kv, kh * v.shape[2]), (extras.cu_q, n * v.shape[2]))]
  rest = Extras(sinks=extras.sinks, seed=extras.seed, offset=extras.offset).present()
  return Extras(extras.bias, extras.q_lens, extras.kv_lens).present() + offsets + rest


def _fwd_ffi(config, q, k, v, *operands):
  extras = Extras.of(config, operands)
  out, *lse = (jax.ShapeDtypeStruct(a.shape, a.dtype)
               for a in _fwd.abstract(config, q, k, v, *operands))
  out_types = (out, _workspace(config, False, q, k, v, extras), *lse)
  out, _, *lse = jax.ffi.ffi_call("cudnn_jax_sdpa_fwd", out_types)(
      q, k, v, *_handler_operands(config, q, k, v, extras), **config.attributes())
  return (out, *lse)


def _bwd_ffi(config, q, k, v, out, dout, lse, *operands):
  extras = Extras.of(config, operands, backward=True)._replace(sinks=None)
  config = dataclasses.replace(config, has_sinks=False)
  out_types = [_common.with_shape(q), _common.with_shape(k), _common.with_shape(v),
               _workspace(config, True, q, k, v, extras)]
  if config.has_dbias:
    out_types.append(_common.with_shape(extras.bias))
  dq, dk, dv, _, *dbias = jax.ffi.ffi_call("cudnn_jax_sdpa_bwd", tuple(out_types))(
      q, k, v, out, dout, lse, *_handler_operands(config, q, k, v, extras),
      **config.attributes())
  return (dq, dk, dv, *dbias)


def _unpacked(config, q, k, v, extras: Extras):
  """Packed rows as a padded batch: ``(q [B,T,N,H], k, v, q_index, q_rows)`` with each
  sequence's rows first, or the operands unchanged (q_index None) when not packed; paged
  caches gathered into contiguous keys and values."""
  from cudnn_jax import _metadata  # pylint: disable=g-import-not-at-top
  if config.paged:
    gather = lambda cache: jnp.take(cache, extras.page_table, axis=0).reshape(
        (extras.page_table.shape[0], -1) + cache.shape[2:])
    return q, gather(k), gather(v), None
  if not config.packed_max_q:
    return q, k, v, None
  slots = lambda cu, lens, width, x: _metadata.packed_slots(cu[:-1], lens, width, x.shape[0])[0]
  q_index = slots(extras.cu_q, extras.q_lens, config.packed_max_q, q)
  kv_index = slots(extras.cu_kv, extras.kv_lens, config.packed_max_kv, k)
  pad = lambda x, index: jnp.take(x, index, axis=0, mode="fill", fill_value=0)
  return pad(q, q_index), pad(k, kv_index), pad(v, kv_index), q_index


def _packed(y, q_index, rows):
  """``y [B, T, ...]`` back to packed ``[rows, ...]``; rows no slot holds 0."""
  flat = y.reshape((-1,) + y.shape[2:])
  return jnp.zeros((rows,) + y.shape[2:], y.dtype).at[q_index.reshape(-1)].set(
      flat, mode="drop")


def _fwd_emulated(config, q, k, v, *operands):
  extras = Extras.of(config, operands)
  qp, kp, vp, q_index = _unpacked(config, q, k, v, extras)
  out, lse = _reference(config, qp, kp, vp, extras.bias, extras.q_lens, extras.kv_lens,
                        extras.sinks, extras.seed)
  if q_index is not None:
    out = _packed(out, q_index, q.shape[0])
  return (out, lse)[:1 + config.with_lse]


def _bwd_emulated(config, q, k, v, out, dout, lse, *operands):
  del out, lse
  extras = Extras.of(config, operands, backward=True)

  def forward(q, k, v, bias):
    return _fwd_emulated(config, q, k, v, *extras._replace(bias=bias).present())[0]

  dq, dk, dv, dbias = jax.vjp(forward, q, k, v, extras.bias)[1](dout)
  return (dq, dk, dv) + ((dbias,) if config.has_dbias else ())


def _rule(backward, config, *shapes):
  """Batch and heads stay local; sequence and feature dims are whole on each device.
  Packed rows (r, u) and paged caches (p g) are whole too."""
  packed = config.packed_max_q > 0
  q, kv = ("r n", "u k") if packed else ("b t n", "b s k")
  if config.paged and not backward:
    kv = "p g k"
  extras = []
  if config.has_bias:
    bb, nb = shapes[6 if backward else 3][:2]
    extras.append(f"{'b' if bb > 1 else 'bb'} {'n' if nb > 1 else 'nb'} t s")
  if config.has_padding:
    extras += ["b", "b"]
  if packed:
    extras += ["c", "c"]
  if config.paged and not backward:
    extras.append("b m")
  if config.has_sinks:
    extras.append("n")
  if config.dropout > 0:
    extras += ["e", "e"]
  qkv = [f"{q} h", f"{kv} h", f"{kv} d"]
  if backward:
    operands = qkv + [f"{q} d", f"{q} d", "b n t"] + extras
    results = qkv + (extras[:1] if config.has_dbias else [])
  else:
    operands, results = qkv + extras, [f"{q} d", "b n t"][:1 + config.with_lse]
  return ", ".join(operands) + " -> " + ", ".join(results)


_SHARDABLE = ("b", ("n", "k"))
_fwd = core.define("cudnn_jax_sdpa_fwd", impl=_fwd_emulated, cuda=_fwd_ffi, shardable=_SHARDABLE,
                   rule=functools.partial(_rule, False))
_bwd = core.define("cudnn_jax_sdpa_bwd", impl=_bwd_emulated, cuda=_bwd_ffi, shardable=_SHARDABLE,
                   rule=functools.partial(_rule, True))


def sdpa_fwd(config, q, k, v, bias=None, q_lens=None, kv_lens=None, **extras):
  """The forward primitive; ``extras``: cu_q, cu_kv, page_table, sinks as the config says."""
  return _fwd(config, q, k, v, *Extras(bias, q_lens, kv_lens, **extras).present())


def sdpa_bwd(config, q, k, v, out, dout, lse, bias=None, q_lens=None, kv_lens=None, **extras):
  return _bwd(config, q, k, v, out, dout, lse,
              *Extras(bias, q_lens, kv_lens, **extras).present())


# ---------------------------------------------------------------------------------------
# Differentiation: cuDNN backward for the cuDNN forward; the xla engine's VJP where the
# cuDNN backward cannot serve (its support check declines, or lse itself is differentiated).


def _reference(config, q, k, v, bias, q_lens, kv_lens, sinks=None, seed=None):
  """The handlers' math; dropout (emulated) keyed by the seed's words."""
  from cudnn_jax.reference import sdpa as ref  # pylint: disable=g-import-not-at-top
  left = None if config.window_left < 0 else config.window_left
  right = None if config.window_right < 0 else config.window_right
  rng = None
  if config.dropout > 0:
    rng = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), seed[0]), seed[1])
  return ref.sdpa(q, k, v, bias, scale=config.scale, is_causal=config.causal,
                  bottom_right=config.bottom_right,
                  window=None if left is None and right is None else (left, right),
                  query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens,
                  logits_soft_cap=config.softcap or None, sinks=sinks,
                  dropout_rate=config.dropout, dropout_rng=rng)


def seed_words(key):
  """A PRNG key's dropout seed for the handlers: ``(seed, offset)``, [2] int32 each."""
  seed = jax.lax.bitcast_convert_type(jax.random.bits(key, (2,), jnp.uint32), jnp.int32)
  return seed, jnp.zeros((2,), jnp.int32)


def attention(config, backward_ok, q, k, v, bias, q_lens, kv_lens, cu_q=None, cu_kv=None,
              sinks=None, seed=None, offset=None):
  """(out, lse) through cuDNN, or (out,) when ``config.with_lse`` is False; differentiable
  in q, k, v, bias and sinks (packed rows: ``cu_q``, ``cu_kv``; dropout: ``seed_words``).

  ``backward_ok``: a static callable returning None when the cuDNN backward serves this
  call, else the reason to fall back to the xla engine's VJP.
  """
  return _attention(config, backward_ok, q, k, v, bias, q_lens, kv_lens, cu_q, cu_kv, sinks,
                    seed, offset)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(config, backward_ok, q, k, v, bias, q_lens, kv_lens, cu_q, cu_kv, sinks, seed,
               offset):
  del backward_ok
  return tuple(sdpa_fwd(config, q, k, v, bias, q_lens, kv_lens, cu_q=cu_q, cu_kv=cu_kv,
                        sinks=sinks, seed=seed, offset=offset))


def _attention_fwd(config, backward_ok, *operands):
  del backward_ok
  operands = [getattr(x, "value", x) for x in operands]
  q, k, v, bias, q_lens, kv_lens, cu_q, cu_kv, sinks, seed, offset = operands
  # The backward needs lse, so the forward always produces it.
  out, lse = sdpa_fwd(dataclasses.replace(config, with_lse=True), q, k, v, bias, q_lens,
                      kv_lens, cu_q=cu_q, cu_kv=cu_kv, sinks=sinks, seed=seed, offset=offset)
  return (out, lse)[:1 + config.with_lse], (*operands, out, lse)


def _sinks_grad(config, sinks, out, dout, lse, q_lens, cu_q):
  """d sinks [N]: a sink's probability in row t is ``p = exp(sink - lse_t)`` and it scales
  the row's output by ``1 - p``, so ``d sink = -sum_rows p * (dout . out)``."""
  from cudnn_jax import _metadata  # pylint: disable=g-import-not-at-top
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # rows x N
  if config.packed_max_q:
    index = _metadata.packed_slots(cu_q[:-1], q_lens, config.packed_max_q, out.shape[0])[0]
    delta = jnp.take(delta, index, axis=0, mode="fill", fill_value=0)
  delta = jnp.swapaxes(delta, 1, 2)  # [B, N, T]
  p = jnp.exp(jnp.minimum(sinks[None, :, None] - lse, 0.0))  # lse >= sink where defined
  if q_lens is not None:  # lse past a row's length is not defined
    p = jnp.where(jnp.arange(lse.shape[-1]) < q_lens[:, None, None], p, 0.0)
  return -jnp.sum(p * delta, axis=(0, 2))


def _attention_bwd(config, backward_ok, res, cts):
  q, k, v, bias, q_lens, kv_lens, cu_q, cu_kv, sinks, seed, offset, out, lse = res
  dout, dlse = cts if config.with_lse else (cts[0], jax.custom_derivatives.SymbolicZero(
      jax.core.ShapedArray(lse.shape, lse.dtype)))
  no_grads = tuple(None if x is None else np.zeros(x.shape, jax.dtypes.float0)
                   for x in (q_lens, kv_lens, cu_q, cu_kv))
  no_seed = tuple(None if x is None else np.zeros(x.shape, jax.dtypes.float0)
                  for x in (seed, offset))
  if isinstance(dlse, jax.custom_derivatives.SymbolicZero) and backward_ok() is None:
    if isinstance(dout, jax.custom_derivatives.SymbolicZero):
      dout = jnp.zeros(dout.shape, dout.dtype)
    dout = dout.astype(out.dtype)
    grads = sdpa_bwd(config, q, k, v, out, dout, lse, bias, q_lens, kv_lens, cu_q=cu_q,
                     cu_kv=cu_kv, sinks=sinks, seed=seed, offset=offset)
    dbias = None
    if bias is not None:
      dbias = grads[3] if config.has_dbias else jnp.zeros_like(bias)
    dsinks = None if sinks is None else _sinks_grad(config, sinks, out, dout, lse, q_lens, cu_q)
    return (*grads[:3], dbias) + no_grads + (dsinks,) + no_seed
  dout, dlse = (jnp.zeros(c.shape, c.dtype) if isinstance(c, jax.custom_derivatives.SymbolicZero)
                else c for c in (dout, dlse))

  def forward(q, k, v, bias, sinks):
    extras = Extras(bias, q_lens, kv_lens, cu_q, cu_kv, None, sinks, seed, offset)
    return _fwd_emulated(dataclasses.replace(config, with_lse=True), q, k, v, *extras.present())

  dq, dk, dv, dbias, dsinks = jax.vjp(forward, q, k, v, bias, sinks)[1]((dout, dlse))
  return (dq, dk, dv, dbias) + no_grads + (dsinks,) + no_seed


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)
