"""A float64 oracle for ``cudnn_jax.sdpa`` (SPEC section 1), independent of the library.

``oracle(...)`` takes ``sdpa``'s arguments and returns ``(out, lse)`` as float64 NumPy
arrays. ``oracle_vjp(...)`` returns float64 gradients through a JAX port of the same math
run with 64-bit types enabled. ``random_config`` / ``make_case`` build random calls shared
by the CPU tests and the GPU sweep. ``varlen_case`` / ``varlen_oracle`` and ``paged_case``
do the same for ``sdpa_varlen`` (sequence by sequence) and ``sdpa_paged``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

# Bias / mask broadcast forms, written over the dims of [B,N,T,S] ("1" = size one, a
# missing leading letter = a missing leading axis).
BROADCAST_FORMS = ("bnts", "1nts", "b1ts", "11ts", "nts", "ts", "111s", "b11s", "s")


def form_shape(form, b, n, t, s):
  sizes = dict(b=b, n=n, t=t, s=s)
  return tuple(sizes.get(c, 1) for c in form)


def _f64(x):
  return None if x is None else np.asarray(x).astype(np.float64)


def _int(x):
  return None if x is None else np.asarray(x).astype(np.int64).reshape(-1)


def _window(local_window_size):
  if local_window_size is None:
    return None, None
  if isinstance(local_window_size, int):
    return local_window_size, local_window_size
  return tuple(local_window_size)


def _to_4d(x, unbatched):
  """A bias / mask broadcastable to [B,N,T,S] (or [N,T,S] when unbatched), as rank 4."""
  if x is None:
    return None
  x = np.asarray(x)
  if x.ndim == 4:
    return x
  lead = 3 if unbatched else 4
  x = x.reshape((1,) * (lead - x.ndim) + x.shape)
  return x[None] if unbatched else x


def keep_mask(b, n, t, s, *, mask=None, is_causal=False, bottom_right=False, window=(None, None),
              q_len=None, kv_len=None, q_seg=None, kv_seg=None):
  """[B,N,T,S] bool: which logits survive every mask (SPEC: all combined with AND)."""
  tt = np.arange(t)[None, None, :, None]
  uu = np.arange(s)[None, None, None, :]
  tb = (np.full(b, t) if q_len is None else q_len)[:, None, None, None]
  sb = (np.full(b, s) if kv_len is None else kv_len)[:, None, None, None]
  diag = tt + (sb - tb) if bottom_right else tt
  keep = (tt < tb) & (uu < sb)
  if is_causal:
    keep = keep & (uu <= diag)
  left, right = window
  if left is not None:
    keep = keep & (uu >= diag - left)
  if right is not None:
    keep = keep & (uu <= diag + right)
  if mask is not None:
    keep = keep & mask
  if q_seg is not None:
    keep = keep & (q_seg[:, None, :, None] == kv_seg[:, None, None, :])
  return np.broadcast_to(keep, (b, n, t, s))


def _attend(xp, q, k, v, bias, sinks, keep, q_valid, scale, softcap, stop):
  """The softmax-attention math for NumPy or jax.numpy; q [B,T,N,H], keep [B,N,T,S]."""
  groups = q.shape[2] // k.shape[2]
  k = xp.repeat(k, groups, axis=2)  # query head n reads kv head n // groups
  v = xp.repeat(v, groups, axis=2)
  logits = xp.einsum("btnh,bsnh->bnts", q, k) * scale
  if bias is not None:
    logits = logits + bias
  if softcap is not None:
    logits = softcap * xp.tanh(logits / softcap)
  logits = xp.where(keep, logits, 0.0)
  row_max = xp.max(xp.where(keep, logits, -np.inf), axis=-1, keepdims=True,
                   initial=-np.inf)  # S = 0: no keys
  if sinks is not None:
    sink = sinks[None, :, None, None]
    row_max = xp.maximum(row_max, sink)
  row_max = stop(xp.where(xp.isfinite(row_max), row_max, 0.0))
  e = xp.where(keep, xp.exp(logits - row_max), 0.0)
  denom = xp.sum(e, axis=-1, keepdims=True)
  if sinks is not None:
    denom = denom + xp.exp(sink - row_max)
  has_key = denom > 0
  denom = xp.where(has_key, denom, 1.0)
  out = xp.einsum("bnts,bsnd->btnd", e / denom, v)
  out = xp.where(q_valid.transpose(0, 2, 1)[..., None], out, 0.0)
  lse = xp.where(has_key & q_valid[..., None], xp.log(denom) + row_max, -np.inf)[..., 0]
  return out, lse


@dataclasses.dataclass
class _Problem:
  """Arguments of one call in float64 / int64, batched, with the combined keep mask."""
  q: np.ndarray
  k: np.ndarray
  v: np.ndarray
  bias: np.ndarray | None
  sinks: np.ndarray | None
  keep: np.ndarray
  q_valid: np.ndarray  # [B,1,T]
  scale: float
  softcap: float | None
  unbatched: bool
  bias_shape: tuple | None


def _problem(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
             query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
             causal_alignment="top_left", logits_soft_cap=None, sinks=None,
             q_segment_ids=None, kv_segment_ids=None, **unused):
  del unused  # implementation, return_lse, dropout (rate 0), ...
  q, k, v = _f64(query), _f64(key), _f64(value)
  unbatched = q.ndim == 3
  if unbatched:
    q, k, v = q[None], k[None], v[None]
  b, t, n, h = q.shape
  s = k.shape[1]
  q_len, kv_len = _int(query_seq_lengths), _int(key_value_seq_lengths)
  q_seg = None if q_segment_ids is None else np.asarray(q_segment_ids).reshape(b, t)
  kv_seg = None if kv_segment_ids is None else np.asarray(kv_segment_ids).reshape(b, s)
  m = _to_4d(mask, unbatched)
  keep = keep_mask(b, n, t, s, mask=m, is_causal=is_causal,
                   bottom_right=causal_alignment == "bottom_right",
                   window=_window(local_window_size), q_len=q_len, kv_len=kv_len,
                   q_seg=q_seg, kv_seg=kv_seg)
  tb = np.full(b, t) if q_len is None else q_len
  q_valid = np.arange(t)[None, None, :] < tb[:, None, None]
  bias4 = _to_4d(_f64(bias), unbatched)
  return _Problem(q, k, v, bias4, _f64(sinks), keep, q_valid,
                  1.0 / math.sqrt(h) if scale is None else float(scale),
                  None if logits_soft_cap is None else float(logits_soft_cap), unbatched,
                  None if bias is None else tuple(np.shape(bias)))


def oracle(query, key, value, bias=None, mask=None, **kwargs):
  """(out [B,T,N,Hv], lse [B,N,T]) in float64 (unbatched inputs give unbatched results)."""
  p = _problem(query, key, value, bias, mask, **kwargs)
  out, lse = _attend(np, p.q, p.k, p.v, p.bias, p.sinks, p.keep, p.q_valid, p.scale,
                     p.softcap, stop=lambda x: x)
  return (out[0], lse[0]) if p.unbatched else (out, lse)


def oracle_vjp(query, key, value, bias=None, mask=None, *, d_out, d_lse=None, **kwargs):
  """float64 gradients of ``sum(out * d_out) + sum(lse * d_lse)`` (finite lse entries).

  Returns a dict with "query", "key", "value" and, when given, "bias" and "sinks", each
  shaped like the corresponding argument.
  """
  p = _problem(query, key, value, bias, mask, **kwargs)
  d_out = _f64(d_out)
  d_lse = None if d_lse is None else _f64(d_lse)
  if p.unbatched:
    d_out = d_out[None]
    d_lse = None if d_lse is None else d_lse[None]
  with jax.enable_x64(True):
    args = dict(query=p.q, key=p.k, value=p.v)
    if p.bias is not None:
      args["bias"] = _f64(bias)
    if p.sinks is not None:
      args["sinks"] = p.sinks

    def loss(a):
      b4 = None
      if "bias" in a:
        b4 = jnp.asarray(_to_4d_jnp(a["bias"], p.unbatched))
      out, lse = _attend(jnp, a["query"], a["key"], a["value"], b4, a.get("sinks"),
                         p.keep, p.q_valid, p.scale, p.softcap, stop=jax.lax.stop_gradient)
      total = jnp.sum(out * d_out)
      if d_lse is not None:
        total = total + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * d_lse)
      return total

    args = {name: jnp.asarray(x, jnp.float64) for name, x in args.items()}
    grads = jax.jit(jax.grad(loss))(args)
    grads = {name: np.asarray(g, np.float64) for name, g in grads.items()}
  if p.unbatched:
    for name in ("query", "key", "value"):
      grads[name] = grads[name][0]
  return grads


def _to_4d_jnp(x, unbatched):
  if x.ndim == 4:
    return x
  lead = 3 if unbatched else 4
  x = x.reshape((1,) * (lead - x.ndim) + x.shape)
  return x[None] if unbatched else x


# ---------------------------------------------------------------------------------------
# Random calls.


@dataclasses.dataclass(frozen=True)
class Config:
  """One random sdpa call, described by static facts only."""
  b: int = 2
  t: int = 16
  s: int = 16
  n: int = 4
  k: int = 2
  h: int = 32
  hv: int | None = None
  dtype: str = "float32"
  bias: str | None = None  # a BROADCAST_FORMS entry
  mask: str | None = None  # a BROADCAST_FORMS entry
  is_causal: bool = False
  causal_alignment: str = "top_left"
  window: object = None  # None, int or (left, right)
  q_lengths: bool = False
  kv_lengths: bool = False
  zero_length: bool = False  # some batch rows get q or kv length 0
  segments: bool = False
  softcap: float | None = None
  sinks: bool = False
  unbatched: bool = False
  scale: float | None = None

  @property
  def plain(self):
    """No bias, mask, window, lengths or extras; head dims 64/128 only."""
    return (self.bias is None and self.mask is None and self.window is None
            and not (self.q_lengths or self.kv_lengths or self.segments or self.sinks)
            and self.softcap is None and self.hv in (None, self.h) and self.h in (64, 128))

  def describe(self):
    fields = dataclasses.asdict(self)
    defaults = dataclasses.asdict(Config())
    keep = ("b", "t", "s", "n", "k", "h", "dtype")
    return {k: v for k, v in fields.items() if k in keep or v != defaults[k]}


def _normal(rng, shape, dtype, scale=1.0):
  """Random normal values, generated on the host (no per-shape device compilation)."""
  return (scale * rng.standard_normal(shape)).astype(jnp.dtype(dtype))


def make_case(cfg: Config, seed: int = 0):
  """(args, kwargs) for ``cudnn_jax.sdpa`` with random inputs (never zeros or ones)."""
  rng = np.random.default_rng(seed)
  b, t, s, n, k, h = cfg.b, cfg.t, cfg.s, cfg.n, cfg.k, cfg.h
  hv = cfg.hv or h
  dtype = jnp.dtype(cfg.dtype)
  q = _normal(rng, (b, t, n, h), dtype)
  kk = _normal(rng, (b, s, k, h), dtype)
  v = _normal(rng, (b, s, k, hv), dtype)
  kwargs = {}
  bias = mask = None
  if cfg.bias is not None:
    bias = _normal(rng, form_shape(cfg.bias, b, n, t, s), dtype, scale=0.5)
  if cfg.mask is not None:
    mask = rng.random(form_shape(cfg.mask, b, n, t, s)) < 0.8
  if cfg.is_causal:
    kwargs["is_causal"] = True
  if cfg.causal_alignment != "top_left":
    kwargs["causal_alignment"] = cfg.causal_alignment
  if cfg.window is not None:
    kwargs["local_window_size"] = cfg.window
  if cfg.q_lengths:
    q_len = rng.integers(1, t + 1, b)
    if cfg.zero_length:
      q_len[rng.integers(b)] = 0
    kwargs["query_seq_lengths"] = q_len.astype(np.int32)
  if cfg.kv_lengths:
    kv_len = rng.integers(1, s + 1, b)
    if cfg.zero_length:
      kv_len[rng.integers(b)] = 0
    kwargs["key_value_seq_lengths"] = kv_len.astype(np.int32)
  if cfg.segments:
    kwargs["q_segment_ids"] = np.sort(rng.integers(-3, 3, (b, t)), axis=1).astype(np.int32)
    kwargs["kv_segment_ids"] = np.sort(rng.integers(-3, 3, (b, s)), axis=1).astype(np.int32)
  if cfg.softcap is not None:
    kwargs["logits_soft_cap"] = cfg.softcap
  if cfg.sinks:
    kwargs["sinks"] = _normal(rng, (n,), jnp.float32)
  if cfg.scale is not None:
    kwargs["scale"] = cfg.scale
  if cfg.unbatched:
    q, kk, v = q[0], kk[0], v[0]
    if bias is not None and bias.ndim == 4:
      bias = bias[0]
    if mask is not None and mask.ndim == 4:
      mask = mask[0]
    for name in ("query_seq_lengths", "key_value_seq_lengths", "q_segment_ids",
                 "kv_segment_ids"):
      if name in kwargs:
        kwargs[name] = np.asarray(kwargs[name][0])
  args = (q, kk, v) + ((bias,) if bias is not None or mask is not None else ())
  if mask is not None:
    args = args + (mask,)
  as_jax = lambda x: x if x is None else jnp.asarray(x)
  return (tuple(as_jax(x) for x in args),
          {k: as_jax(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()})


def split_kwargs(kwargs):
  """(array keyword arguments, static keyword arguments) of a ``make_case`` call."""
  arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
  return arrays, {k: v for k, v in kwargs.items() if k not in arrays}


def jit_call(fn, args, kwargs):
  """``fn(*args, **kwargs)`` under ``jax.jit``, array arguments traced, the rest static."""
  arrays, static = split_kwargs(kwargs)
  return jax.jit(lambda a, kw: fn(*a, **kw, **static))(args, arrays)


def differentiable(args, kwargs):
  """Splits a ``make_case`` call for differentiation.

  Returns ``(diff, arrays, call)``: ``diff`` maps the differentiable arguments present
  (query, key, value, bias, sinks) to arrays, ``arrays`` holds the other array keyword
  arguments, and ``call(diff, arrays, **more)`` runs ``cudnn_jax.sdpa`` with the static
  arguments and ``more`` (e.g. ``implementation``, ``return_lse``).
  """
  import cudnn_jax  # pylint: disable=g-import-not-at-top
  names = ["query", "key", "value"] + (["bias"] if len(args) > 3 and args[3] is not None
                                       else [])
  diff = dict(zip(names, args))
  if "sinks" in kwargs:
    diff["sinks"] = kwargs["sinks"]
  rest = args[len(names):]
  arrays, static = split_kwargs({k: v for k, v in kwargs.items() if k != "sinks"})

  def call(d, arrays, **more):
    positional = [d[n] for n in names] + list(rest)
    extra = {"sinks": d["sinks"]} if "sinks" in d else {}
    return cudnn_jax.sdpa(*positional, **arrays, **static, **extra, **more)
  return diff, arrays, call


def cotangent(shape, dtype, seed):
  return _normal(np.random.default_rng(seed + 7919), shape, dtype)


def _choice(rng, options, p=None):
  return options[rng.choice(len(options), p=p)]


def random_config(rng: np.random.Generator, *, dtypes=("bfloat16", "float16"),
                  lengths=(1, 7, 32, 63, 64, 65, 100, 128, 129, 255, 256, 333, 512, 600),
                  head_dims=(64, 128), max_b=4, max_n=16) -> Config:
  """A random GPU-sized call; about half are plain (no masks or extras)."""
  b = int(rng.integers(1, max_b + 1))
  s = int(_choice(rng, lengths))
  t = s if rng.random() < 0.4 else int(_choice(rng, lengths))
  n = int(_choice(rng, [x for x in (1, 2, 4, 8, 12, 16) if x <= max_n]))
  ratio = _choice(rng, sorted({r for r in (1, 2, 4, n) if n % r == 0}))
  h = int(_choice(rng, head_dims))
  cfg = dict(b=b, t=t, s=s, n=n, k=n // ratio, h=h, dtype=str(_choice(rng, dtypes)))
  if rng.random() < 0.25:
    return Config(**cfg)
  if rng.random() < 0.1:
    cfg["hv"] = int(_choice(rng, [x for x in head_dims if x != h] or [h]))
  if rng.random() < 0.5:
    cfg["is_causal"] = True
  if rng.random() < 0.4:
    cfg["causal_alignment"] = "bottom_right"
  if rng.random() < 0.2:
    w = int(rng.integers(0, max(s, 2)))
    cfg["window"] = _choice(rng, [w, (w, 0), (w, None), (None, w), (w, int(rng.integers(0, 9)))])
  if rng.random() < 0.2:
    cfg["bias"] = _choice(rng, ("bnts", "1nts", "b1ts", "11ts"))
  if rng.random() < 0.1:
    cfg["mask"] = _choice(rng, ("bnts", "11ts", "b1ts"))
  if rng.random() < 0.3:
    cfg["q_lengths"] = bool(rng.random() < 0.6)
    cfg["kv_lengths"] = True
    cfg["zero_length"] = bool(rng.random() < 0.3)
  if rng.random() < 0.1:
    cfg["softcap"] = float(_choice(rng, (5.0, 30.0)))
  return Config(**cfg)


def keep_of(query, key, value, bias=None, mask=None, **kwargs):
  """The oracle's [B,N,T,S] keep mask and [B,1,T] valid-row mask (batched)."""
  p = _problem(query, key, value, bias, mask, **kwargs)
  return p.keep, p.q_valid


# ---------------------------------------------------------------------------------------
# Packed sequences (sdpa_varlen) and paged KV caches (sdpa_paged).


def _f32_normal(rng, *shape):
  return rng.standard_normal(shape).astype(np.float32)


def varlen_case(rng, q_lens, kv_lens, *, n=4, k=2, h=16, hv=8, tail=3):
  """Packed q [Tq,N,H], k [Tk,K,H], v [Tk,K,Hv] with ``tail`` rows past the last sequence,
  and the cu_seqlens."""
  cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  cu_kv = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
  q = _f32_normal(rng, cu_q[-1] + tail, n, h)
  kk = _f32_normal(rng, cu_kv[-1] + tail, k, h)
  v = _f32_normal(rng, cu_kv[-1] + tail, k, hv)
  return q, kk, v, cu_q, cu_kv


def varlen_oracle(q, k, v, cu_q, cu_kv, *, d_out=None, **kwargs):
  """(out [Tq,N,Hv], lse [N,Tq]) in float64 sequence by sequence, or with ``d_out`` the
  gradients of sum(out * d_out) for query, key and value (and sinks)."""
  tq, n = q.shape[:2]
  out = np.zeros((tq, n, v.shape[2]))
  lse = np.full((n, tq), -np.inf)
  grads = dict(query=np.zeros(q.shape), key=np.zeros(k.shape), value=np.zeros(v.shape))
  if kwargs.get("sinks") is not None:
    grads["sinks"] = np.zeros(np.shape(kwargs["sinks"]))
  for i in range(len(cu_q) - 1):
    qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_kv[i], cu_kv[i + 1])
    if qs.stop == qs.start:
      continue
    qi, ki, vi, extra = q[qs][None], k[ks][None], v[ks][None], {}
    if ks.stop == ks.start:  # no keys: one masked row stands in
      ki, vi = np.zeros((1, 1) + k.shape[1:]), np.zeros((1, 1) + v.shape[1:])
      extra["key_value_seq_lengths"] = np.zeros(1, np.int32)
    if d_out is None:
      o, l = oracle(qi, ki, vi, **kwargs, **extra)
      out[qs], lse[:, qs] = o[0], l[0]
      continue
    g = oracle_vjp(qi, ki, vi, d_out=np.asarray(d_out)[qs][None], **kwargs, **extra)
    grads["query"][qs] += g["query"][0]
    if ks.stop > ks.start:
      grads["key"][ks] += g["key"][0]
      grads["value"][ks] += g["value"][0]
    if "sinks" in g:
      grads["sinks"] += g["sinks"]
  return grads if d_out is not None else (out, lse)


def paged_case(rng, kv_lens, *, t=1, n=4, k=2, h=16, hv=8, page=4, spare_pages=3):
  """(query, key_cache, value_cache, page_table, kv_lens, contiguous keys, values): each
  sequence's keys scattered over shuffled physical pages; unused rows are NaN and unused
  table entries out of range, which the op must never let through."""
  b = len(kv_lens)
  max_pages = -(-max(kv_lens) // page) + 1
  keys, values = _f32_normal(rng, b, max_pages * page, k, h), _f32_normal(rng, b, max_pages * page, k, hv)
  pages = b * max_pages + spare_pages
  order = rng.permutation(pages)
  key_cache = np.full((pages, page, k, h), np.nan, np.float32)
  value_cache = np.full((pages, page, k, hv), np.nan, np.float32)
  table = np.full((b, max_pages), 10 ** 6, np.int32)
  for i, length in enumerate(kv_lens):
    for j in range(-(-length // page)):
      phys = order[i * max_pages + j]
      table[i, j] = phys
      rows = slice(j * page, min((j + 1) * page, length))
      key_cache[phys, : rows.stop - rows.start] = keys[i, rows]
      value_cache[phys, : rows.stop - rows.start] = values[i, rows]
  query = _f32_normal(rng, b, t, n, h)
  return (query, key_cache, value_cache, table, np.asarray(kv_lens, np.int32), keys, values)


def paged_oracle(query, key_cache, value_cache, page_table, kv_lens, *, is_causal=True,
                 **kwargs):
  """``sdpa_paged``'s float64 math, metadata read as SPEC section 8 says: lengths clamped
  to ``[0, max_pages * page]``, positions of page ids outside ``[0, P)`` masked."""
  pages, page = key_cache.shape[:2]
  table = np.asarray(page_table).astype(np.int64)
  b, max_pages = table.shape
  ids = np.clip(table, 0, pages - 1)  # read, then masked where invalid
  keys = _f64(key_cache)[ids].reshape(b, max_pages * page, *key_cache.shape[2:])
  values = _f64(value_cache)[ids].reshape(b, max_pages * page, *value_cache.shape[2:])
  lens = np.clip(np.asarray(kv_lens).astype(np.int64), 0, max_pages * page)
  keep = np.repeat((table >= 0) & (table < pages), page, axis=1)
  keep &= np.arange(max_pages * page)[None, :] < lens[:, None]
  keys, values = (np.where(keep[:, :, None, None], x, 0.0) for x in (keys, values))
  return oracle(query, keys, values, mask=keep[:, None, None, :], is_causal=is_causal,
                causal_alignment="bottom_right", key_value_seq_lengths=lens, **kwargs)


def rel_err_finite(actual, expected):
  """||a - b|| / ||b|| over the finite entries of ``expected``, which must be finite exactly
  where ``actual`` is (lse is -inf on rows with no kept key)."""
  a, b = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  finite = np.isfinite(b)
  assert np.array_equal(finite, np.isfinite(a)), "non-finite entries differ"
  return float(np.linalg.norm(a[finite] - b[finite]) / max(np.linalg.norm(b[finite]), 1e-30))
