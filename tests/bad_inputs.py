"""The bad-input catalogue: every invalid call we define, with the error or the defined
result it gets (SPEC conventions and section 8). tests/test_bad_inputs.py runs each entry;
docs/bad_inputs.md is ``render()`` of this list (a test keeps the two equal; regenerate
with ``python tests/bad_inputs.py > docs/bad_inputs.md``).

An entry is either an error (``raises`` and a ``match`` on its message) or a defined
result (``expect``: a function of the output that asserts it, usually against a float64
oracle). Entries with ``checkify`` hold invalid metadata: under
``jax.experimental.checkify.checkify`` (user checks) the same call fails with that message.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import cudnn_jax  # pylint: disable=wrong-import-position
import gemm_oracle  # pylint: disable=wrong-import-position
import kda_oracle  # pylint: disable=wrong-import-position
import sdpa_oracle  # pylint: disable=wrong-import-position


@dataclasses.dataclass(frozen=True)
class Case:
  op: str
  call: str  # the call as a user writes it (the docs' first column)
  run: Callable[[], Any]
  outcome: str  # what happens, in words
  raises: type | None = None
  match: str = ""
  expect: Callable[[Any], None] | None = None
  checkify: str | None = None  # the message under checkify (invalid metadata)


def _rng(seed=0):
  return np.random.default_rng(seed)


def _normal(*shape, seed=0):
  return _rng(seed).standard_normal(shape).astype(np.float32)


def _close(got, want, tol=2e-5):
  err = sdpa_oracle.rel_err_finite(np.asarray(got, np.float64), want)
  assert err <= tol, err


# ---------------------------------------------------------------------------------------
# sdpa

_Q = _normal(2, 4, 2, 8)
_K = _normal(2, 5, 2, 8, seed=1)
_V = _normal(2, 5, 2, 8, seed=2)


def _sdpa(q=_Q, k=_K, v=_V, **kw):
  return lambda: cudnn_jax.sdpa(q, k, v, **kw)


def _empty_keys(result):
  out, lse = result
  assert out.shape == (2, 4, 2, 8) and not np.any(np.asarray(out))
  assert np.all(np.asarray(lse) == -np.inf)


def _sink_only(result):
  out, lse = result
  assert not np.any(np.asarray(out))
  sinks = np.array([1.0, -2.0])[None, :, None]  # lse [B,N,T]: head n's sink logit
  np.testing.assert_array_equal(np.asarray(lse), np.broadcast_to(sinks, (2, 2, 4)))


def _sdpa_lengths(result):
  want, _ = sdpa_oracle.oracle(_Q, _K, _V, query_seq_lengths=[0, 4], key_value_seq_lengths=[5, 0])
  _close(result, want)


SDPA = [
    Case("sdpa", 'sdpa(q, k, v, is_causal="no")', _sdpa(is_causal="no"),
         "TypeError: is_causal must be a bool", TypeError, "is_causal: expected a bool"),
    Case("sdpa", "sdpa(q, k, v, return_lse=1)", _sdpa(return_lse=1),
         "TypeError: return_lse must be a bool", TypeError, "return_lse: expected a bool"),
    Case("sdpa", "sdpa(q, k, v, sinks=<bfloat16 [N]>)",
         _sdpa(sinks=jnp.zeros((2,), jnp.bfloat16)), "TypeError: sinks are float32",
         TypeError, r"sinks: expected dtype in \(float32\)"),
    Case("sdpa", "sdpa(q, k, v, dropout_rate=0.1, dropout_rng=3.0)",
         _sdpa(dropout_rate=0.1, dropout_rng=np.float32(3.0)),
         "TypeError: dropout_rng must be a PRNG key", TypeError, "dropout_rng: expected a PRNG key"),
    Case("sdpa", "sdpa(q, k, v, dropout_rate=0.1)", _sdpa(dropout_rate=0.1),
         "ValueError: dropout_rng is required", ValueError, "dropout_rng: required"),
    Case("sdpa", "sdpa(q, k, v) with head dim H = 0",
         _sdpa(q=np.zeros((2, 4, 2, 0), np.float32), k=np.zeros((2, 5, 2, 0), np.float32)),
         "ValueError: head dim must be >= 1 (the scale is 1/sqrt(H))", ValueError,
         "query: head dim H must be >= 1"),
    Case("sdpa", "sdpa(q, k, v) with K = 0 kv heads",
         _sdpa(k=np.zeros((2, 5, 0, 8), np.float32), v=np.zeros((2, 5, 0, 8), np.float32)),
         "ValueError: kv heads must be >= 1 and divide N", ValueError, "kv heads K=0"),
    Case("sdpa", "sdpa(q, k, v, return_lse=True) with S = 0 keys",
         _sdpa(k=np.zeros((2, 0, 2, 8), np.float32), v=np.zeros((2, 0, 2, 8), np.float32),
               return_lse=True),
         "every row outputs 0, lse = -inf", expect=_empty_keys),
    Case("sdpa", "sdpa(q, k, v, sinks=s, return_lse=True) with S = 0 keys",
         _sdpa(k=np.zeros((2, 0, 2, 8), np.float32), v=np.zeros((2, 0, 2, 8), np.float32),
               sinks=np.array([1.0, -2.0], np.float32), return_lse=True),
         "every row outputs 0, lse = the sink logit", expect=_sink_only),
    Case("sdpa", "sdpa(q, k, v) with T = 0, B = 0, N = 0 or Hv = 0",
         lambda: [cudnn_jax.sdpa(np.zeros(qs, np.float32), np.zeros(ks, np.float32),
                                 np.zeros(vs, np.float32)).shape
                  for qs, ks, vs in (((2, 0, 2, 8), (2, 5, 2, 8), (2, 5, 2, 8)),
                                     ((0, 4, 2, 8), (0, 5, 2, 8), (0, 5, 2, 8)),
                                     ((2, 4, 0, 8), (2, 5, 1, 8), (2, 5, 1, 8)),
                                     ((2, 4, 2, 8), (2, 5, 2, 8), (2, 5, 2, 0)))],
         "the empty output", expect=lambda shapes: _eq(
             shapes, [(2, 0, 2, 8), (0, 4, 2, 8), (2, 4, 0, 8), (2, 4, 2, 0)])),
    Case("sdpa", "sdpa(q, k, v, query_seq_lengths=[-1, 9], key_value_seq_lengths=[7, -3])",
         _sdpa(query_seq_lengths=np.array([-1, 9], np.int32),
               key_value_seq_lengths=np.array([7, -3], np.int32)),
         "lengths clamped to [0, T] and [0, S]", expect=_sdpa_lengths,
         checkify=r"query_seq_lengths\[0\] = -1: expected a length in \[0, 4\]"),
]


def _eq(got, want):
  assert got == want, (got, want)


# ---------------------------------------------------------------------------------------
# sdpa_varlen

_TQ = 16
_PQ, _PK, _PV = _normal(_TQ, 2, 8), _normal(_TQ, 2, 8, seed=1), _normal(_TQ, 2, 8, seed=2)


def _varlen(cu_q, cu_kv=None, max_q=16, max_kv=16, **kw):
  cu_q = np.asarray(cu_q, np.int32)
  cu_kv = cu_q if cu_kv is None else np.asarray(cu_kv, np.int32)
  return lambda: cudnn_jax.sdpa_varlen(_PQ, _PK, _PV, cu_q, cu_kv, max_seqlen_q=max_q,
                                       max_seqlen_kv=max_kv, **kw)


def _varlen_as(cu_q, cu_kv=None):
  """The result equals sdpa_varlen's float64 math on these (valid) offsets."""
  cu_kv = cu_q if cu_kv is None else cu_kv
  def expect(out):
    want, _ = sdpa_oracle.varlen_oracle(_PQ, _PK, _PV, np.asarray(cu_q), np.asarray(cu_kv))
    _close(out, want)
  return expect


VARLEN = [
    Case("sdpa_varlen", "sdpa_varlen(..., cu_seqlens_q=cu_seqlens_kv=[0, 12, 6, 16])",
         _varlen([0, 12, 6, 16]),
         "sequences 1 and 2 (out of order) are empty: rows 12:16 output 0",
         expect=_varlen_as([0, 12]),
         checkify=r"cu_seqlens_q\[2\] = 6: expected offsets that never decrease"),
    Case("sdpa_varlen", "sdpa_varlen(..., cu_seqlens_q=cu_seqlens_kv=[-5, 6, 16])",
         _varlen([-5, 6, 16]), "sequence 0 is empty (rows 0:6 output 0); sequence 1 is served",
         expect=_varlen_as([6, 16]),
         checkify=r"cu_seqlens_q\[0\] = -5: expected the first offset >= 0"),
    Case("sdpa_varlen", "sdpa_varlen(..., cu_seqlens_q=cu_seqlens_kv=[0, 10, 20]) with 16 rows",
         _varlen([0, 10, 20]), "sequence 1 ends past the rows: empty, rows 10:16 output 0",
         expect=_varlen_as([0, 10]),
         checkify=r"cu_seqlens_q\[2\] = 20: expected offsets <= 16"),
    Case("sdpa_varlen", "sdpa_varlen(..., [0, 10, 16], [0, 10, 16], max_seqlen_q=6)",
         _varlen([0, 10, 16], max_q=6),
         "each sequence cut to its first 6 query rows; rows 6:10 output 0",
         expect=_varlen_as([0, 6, 10, 16], [0, 10, 10, 16]),
         checkify=r"cu_seqlens_q\[1\] = 10: the sequence ending here is longer than "
                  r"max_seqlen_q=6"),
    Case("sdpa_varlen", "sdpa_varlen(..., max_seqlen_kv=0)", _varlen([0, 16], max_kv=0),
         "ValueError: max_seqlen_kv must be >= 1", ValueError, "max_seqlen_kv: expected >= 1"),
    Case("sdpa_varlen", "sdpa_varlen(..., cu_seqlens_q=[0])", _varlen([0], [0]),
         "ValueError: at least one sequence", ValueError, "cu_seqlens_q: expected"),
]


# ---------------------------------------------------------------------------------------
# sdpa_paged

_PAGE = 4


def _paged_case():
  """Two sequences of 6 and 8 keys on pages [[1, 3], [0, 2]] of a 5-page cache whose every
  row holds real data (so a page read where it must not be would show)."""
  rng = _rng(3)
  kc, vc = (rng.standard_normal((5, _PAGE, 1, 8)).astype(np.float32) for _ in range(2))
  table = np.array([[1, 3], [0, 2]], np.int32)
  return _normal(2, 1, 2, 8, seed=4), kc, vc, table, np.array([6, 8], np.int32)


def _paged(table=None, lengths=None, kc=None, vc=None):
  q, kc_, vc_, t, lens = _paged_case()
  t = t if table is None else np.asarray(table, np.int32)
  lens = lens if lengths is None else np.asarray(lengths, np.int32)
  kc, vc = kc_ if kc is None else kc, vc_ if vc is None else vc
  return lambda: cudnn_jax.sdpa_paged(q, kc, vc, t, lens)


def _paged_masked(table, lengths=(6, 8)):
  """Expected: keys of valid page ids only (positions of ids outside [0, P) masked)."""
  def expect(out):
    q, kc, vc, _, _ = _paged_case()
    want, _ = sdpa_oracle.paged_oracle(q, kc, vc, table, lengths)
    _close(out, want)
  return expect


PAGED = [
    Case("sdpa_paged", "sdpa_paged(..., page_table=[[1, -1], [0, 7]]) with P = 5 pages",
         _paged([[1, -1], [0, 7]]),
         "ids outside [0, P) contribute no keys (masked, never clipped to a page)",
         expect=_paged_masked([[1, -1], [0, 7]]),
         checkify=r"page_table\[0, 1\] = -1: expected an index in \[0, 5\)"),
    Case("sdpa_paged", "sdpa_paged(..., key_value_seq_lengths=[-2, 100])",
         _paged(lengths=[-2, 100]), "lengths clamped to [0, max_pages * page]",
         expect=_paged_masked([[1, 3], [0, 2]], lengths=(0, 8)),
         checkify=r"key_value_seq_lengths\[0\] = -2: expected a length in \[0, 8\]"),
    Case("sdpa_paged", "sdpa_paged(..., page_table=[[1, 9], [0, 2]], key_value_seq_lengths=[4, 8])",
         _paged([[1, 9], [0, 2]], [4, 8]), "ids of pages past the length are never read",
         expect=_paged_masked([[1, 9], [0, 2]], lengths=(4, 8))),
    Case("sdpa_paged", "sdpa_paged(q, key_cache with H != query's, ...)",
         _paged(kc=np.zeros((5, _PAGE, 1, 4), np.float32)),
         "ValueError naming key_cache and its shape", ValueError,
         r"key_cache: expected \[P,page,K,H\] with query's H=8, got \(5, 4, 1, 4\)"),
    Case("sdpa_paged", "sdpa_paged(q, <bfloat16 key_cache>, ...)",
         _paged(kc=np.zeros((5, _PAGE, 1, 8), jnp.bfloat16)),
         "TypeError naming query, key_cache, value_cache", TypeError,
         "query, key_cache, value_cache: expected one dtype"),
    Case("sdpa_paged", "sdpa_paged(q, key_cache with K = 3 not dividing N = 2, ...)",
         _paged(kc=np.zeros((5, _PAGE, 3, 8), np.float32),
                vc=np.zeros((5, _PAGE, 3, 8), np.float32)),
         "ValueError naming key_cache", ValueError, "key_cache: kv heads K=3"),
]


# ---------------------------------------------------------------------------------------
# kda / gdn

_B, _T, _H, _KD, _VD = 1, 24, 2, 8, 8


def _kda_arrays(t=_T, kd=_KD, h=_H, op="kda", b=_B):
  rng = _rng(5)
  q = rng.standard_normal((b, t, h, kd)).astype(np.float32)
  k = rng.standard_normal((b, t, h, kd)).astype(np.float32)
  k /= np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-6)
  v = rng.standard_normal((b, t, h, _VD)).astype(np.float32)
  g = -rng.uniform(0.05, 0.5, (b, t, h) + (() if op == "gdn" else (kd,))).astype(np.float32)
  beta = rng.uniform(0.1, 1.0, (b, t, h)).astype(np.float32)
  return q, k, v, g, beta


def _kda(op="kda", shape=None, **kw):
  def run():
    arrays = _kda_arrays(**(shape or {}), op=op)
    return getattr(cudnn_jax, op)(*arrays, **kw)
  return run


_INIT = _normal(3, _H, _KD, _VD, seed=6)


def _kda_served(cu):
  def expect(result):
    o, final = result
    want_o, want_final = kda_oracle.oracle(*_kda_arrays(), initial_state=_INIT, cu_seqlens=cu)
    np.testing.assert_allclose(np.asarray(o), want_o, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(final), want_final, rtol=2e-4, atol=2e-4)
  return expect


def _kda_cu(cu):
  return _kda(cu_seqlens=np.asarray(cu, np.int32), initial_state=_INIT, output_final_state=True)


KDA = [
    Case("kda", "kda(..., cu_seqlens=[0, 10, 30, 30]) with T = 24",
         _kda_cu([0, 10, 30, 30]),
         "sequence 1 ends past T: empty (final state = its initial state), rows 10:24 output "
         "0; sequence 2 (at 30 > T) is empty too",
         expect=_kda_served([0, 10, 30, 30]),
         checkify=r"cu_seqlens\[2\] = 30: expected offsets <= 24"),
    Case("kda", "kda(..., cu_seqlens=[0, 16, 8, 24])", _kda_cu([0, 16, 8, 24]),
         "sequences 1 and 2 (out of order) are empty", expect=_kda_served([0, 16, 8, 24]),
         checkify=r"cu_seqlens\[2\] = 8: expected offsets that never decrease"),
    Case("kda", "kda(q, k, ...) with head dim K = 0", _kda(shape=dict(kd=0)),
         "ValueError: head dim must be >= 1 (the scale is K**-0.5)", ValueError,
         "q: expected .* head dim K >= 1"),
    Case("kda", "kda(...) with T = 0 and an initial state",
         _kda(shape=dict(t=0), initial_state=_INIT[:1], output_final_state=True),
         "o is empty; the final state is the initial state",
         expect=lambda r: (_eq(r[0].shape, (1, 0, _H, _VD)),
                           np.testing.assert_array_equal(r[1], _INIT[:1]))),
    Case("kda", "kda(..., a_log=a) without use_gate_in_kernel",
         _kda(a_log=np.zeros((_H,), np.float32)),
         "ValueError (FLA would ignore a_log and read g as the log decay)", ValueError,
         "a_log: only used with use_gate_in_kernel=True .FLA would ignore it"),
    Case("kda", "kda(..., allow_neg_eigval=True) without use_beta_sigmoid_in_kernel",
         _kda(allow_neg_eigval=True),
         "ValueError (FLA would ignore it and use beta as given)", ValueError,
         "allow_neg_eigval: .*FLA would ignore it"),
    Case("kda", "kda(..., a_log=a, A_log=a, use_gate_in_kernel=True)",
         _kda(a_log=np.zeros((_H,), np.float32), A_log=np.zeros((_H,), np.float32),
              use_gate_in_kernel=True),
         "ValueError: one argument under two spellings", ValueError, "a_log, A_log"),
    Case("kda", "kda(..., dt_bias=<[HV, K+1]>, use_gate_in_kernel=True, A_log=a)",
         _kda(dt_bias=np.zeros((_H, _KD + 1), np.float32), A_log=np.zeros((_H,), np.float32),
              use_gate_in_kernel=True),
         "ValueError: dt_bias is [HV*K] or [HV,K]", ValueError,
         r"dt_bias: expected shape \(16,\) \(\[HV\*K\]\) or \(2, 8\)"),
    Case("kda", "kda(..., chunk_size=16)", _kda(chunk_size=16),
         "ValueError: kda takes chunk_size 32 or 64 (gdn also 16)", ValueError, "chunk_size"),
]


# ---------------------------------------------------------------------------------------
# gemm, grouped_gemm, moe_mlp

_LHS, _RHS = _normal(12, 8), _normal(3, 8, 4, seed=1)


def _grouped(sizes, rhs=_RHS):
  return lambda: cudnn_jax.grouped_gemm(_LHS, rhs, np.asarray(sizes, np.int32))


def _grouped_as(served):
  return lambda out: _close(out, gemm_oracle.grouped_gemm(_LHS, _RHS, np.asarray(served)), 1e-6)


_X, _WU, _WD = _normal(5, 8), _normal(3, 8, 12, seed=1), _normal(3, 6, 8, seed=2)


def _moe(indices, k=2):
  weights = _normal(5, k, seed=3)
  indices = np.asarray(indices, np.int32).reshape(5, k)
  return lambda: cudnn_jax.moe_mlp(_X, indices, weights, _WU, _WD)


def _moe_as(indices):
  def expect(out):
    idx = np.asarray(indices).reshape(5, 2)
    w = _normal(5, 2, seed=3) * ((idx >= 0) & (idx < 3))
    want = gemm_oracle.moe_mlp(_X, np.clip(idx, 0, 2), w, _WU, _WD)
    _close(out, want, 1e-5)
  return expect


_MOE_IDX = [[0, 1], [2, 3], [0, 0], [1, 1], [-1, 2]]

GEMM = [
    Case("grouped_gemm", "grouped_gemm(lhs [12,K], rhs, group_sizes=[5, -3, 4])",
         _grouped([5, -3, 4]), "a negative size counts as 0, on every engine",
         expect=_grouped_as([5, 0, 4]),
         checkify=r"group_sizes\[1\] = -3: expected >= 0"),
    Case("grouped_gemm", "grouped_gemm(lhs [12,K], rhs, group_sizes=[5, 3, 9])",
         _grouped([5, 3, 9]), "groups cut at row M (the last holds 4 rows)",
         expect=_grouped_as([5, 3, 4]),
         checkify=r"group_sizes\[2\] = 9: the groups so far hold more than the 12 rows"),
    Case("grouped_gemm", "grouped_gemm(lhs, rhs [0,K,N], group_sizes=[])",
         _grouped([], rhs=np.zeros((0, 8, 4), np.float32)),
         "ValueError: at least one group", ValueError, "rhs: expected .* G >= 1"),
    Case("grouped_gemm", "grouped_gemm(lhs [0,K], ...) / K = 0 / N = 0",
         lambda: [cudnn_jax.grouped_gemm(np.zeros(l, np.float32), np.zeros(r, np.float32),
                                         np.array([2, 2, 2], np.int32)).shape
                  for l, r in (((0, 8), (3, 8, 4)), ((6, 0), (3, 0, 4)), ((6, 8), (3, 8, 0)))],
         "the empty output, or the epilogue of a zero product when K = 0",
         expect=lambda shapes: _eq(shapes, [(0, 4), (6, 4), (6, 0)])),
    Case("gemm", "gemm(a [0,K], b) / K = 0 / N = 0 / batch 0",
         lambda: [cudnn_jax.gemm(np.zeros(a, np.float32), np.zeros(b, np.float32)).shape
                  for a, b in (((0, 8), (8, 4)), ((3, 0), (0, 4)), ((3, 8), (8, 0)),
                               ((0, 3, 8), (8, 4)))],
         "the empty output, or zeros (plus bias and epilogue) when K = 0",
         expect=lambda shapes: _eq(shapes, [(0, 4), (3, 4), (3, 0), (0, 3, 4)])),
    Case("moe_mlp", "moe_mlp(..., expert_indices with -1 and E) with E = 3 experts",
         _moe(_MOE_IDX), "out-of-range choices contribute 0", expect=_moe_as(_MOE_IDX),
         checkify=r"expert_indices\[1, 1\] = 3: expected an index in \[0, 3\)"),
    Case("moe_mlp", "moe_mlp(x, expert_indices [T,0], expert_weights [T,0], ...)",
         _moe(np.zeros((5, 0)), k=0), "top-k 0: y = 0",
         expect=lambda y: _eq((y.shape, bool(np.any(np.asarray(y)))), ((5, 8), False))),
    Case("moe_mlp", "moe_mlp(x [0,D], ...)",
         lambda: cudnn_jax.moe_mlp(np.zeros((0, 8), np.float32), np.zeros((0, 2), np.int32),
                                   np.zeros((0, 2), np.float32), _WU, _WD),
         "no tokens: the empty output", expect=lambda y: _eq(y.shape, (0, 8))),
]


# ---------------------------------------------------------------------------------------
# bsa: Sq = Skv = 40 in blocks of 16 (Nq = Nkv = 3, the last block 8 tokens), N = 2, K = 1

_BS = 16
_BQ = _normal(1, 40, 2, 8, seed=7)
_BK, _BV = _normal(1, 40, 1, 8, seed=8), _normal(1, 40, 1, 8, seed=9)
# block_index [1, N, Nq, Kmax=2]: query block m of head n lists kv blocks _SEL[n][m].
_SEL = [[[0, 1], [1, 2], [2, 0]], [[2, 1], [0, 2], [1, 0]]]
_BSA = jax.jit(lambda *a, **kw: cudnn_jax.bsa(*a, **kw, block_size=_BS, return_lse=True))


def _bsa(index=None, counts=None, sizes=None):
  index = np.asarray(_SEL if index is None else index, np.int32).reshape(1, 2, 3, -1)
  counts = None if counts is None else np.asarray(counts, np.int32).reshape(1, 2, 3)
  sizes = None if sizes is None else np.asarray(sizes, np.int32)
  return lambda: _BSA(_BQ, _BK, _BV, index, counts, kv_block_sizes=sizes)


def _bsa_as(selected, sizes=(16, 16, 8)):
  """Expected: query block m of head n attends the first ``sizes[c]`` keys of each kv block
  c of ``selected[n][m]`` (the float64 oracle of the equivalent token mask)."""
  def expect(result):
    mask = np.zeros((1, 2, 40, 40), bool)
    for n, rows in enumerate(selected):
      for m, blocks in enumerate(rows):
        for c in blocks:
          mask[0, n, m * _BS:(m + 1) * _BS, c * _BS:c * _BS + sizes[c]] = True
    want_out, want_lse = sdpa_oracle.oracle(_BQ, _BK, _BV, mask=mask)
    _close(result[0], want_out)
    _close(result[1], want_lse)
  return expect


def _bsa_empty(shape):
  def expect(result):
    out, lse = result
    _eq((out.shape, lse.shape), (shape, (shape[0], shape[2], shape[1])))
    assert not np.any(np.asarray(out)) and np.all(np.asarray(lse) == -np.inf)
  return expect


def _bsa_shapes(*shapes):
  """``bsa`` on zeros of these (query, key, value, block_index) shapes: the output shapes."""
  def run():
    results = []
    for qs, ks, vs, index in shapes:
      z = lambda shape, dtype=np.float32: np.zeros(shape, dtype)
      results.append(_BSA(z(qs), z(ks), z(vs), z(index, np.int32))[0].shape)
    return results
  return run


BSA = [
    Case("bsa", "bsa(..., block_index with 9 and -1) with Nkv = 3",
         _bsa([[[0, 9], [1, 2], [2, 0]], [[2, 1], [-1, 2], [1, 0]]]),
         "indices outside [0, Nkv) select nothing (skipped, never clipped onto a block), "
         "on every engine",
         expect=_bsa_as([[[0], [1, 2], [2, 0]], [[2, 1], [2], [1, 0]]]),
         checkify=r"block_index\[0, 0, 0, 1\] = 9: expected an index in \[0, 3\)"),
    Case("bsa", "bsa(..., block_counts=[[-2, 5, 1], [2, 0, 2]]) with Kmax = 2",
         _bsa(counts=[[-2, 5, 1], [2, 0, 2]]), "counts clamped to [0, Kmax], on every engine",
         expect=_bsa_as([[[], [1, 2], [2]], [[2, 1], [], [1, 0]]]),
         checkify=r"block_counts\[0, 0, 0\] = -2: expected a count in \[0, 2\]"),
    Case("bsa", "bsa(..., block_index with 9 and -1 past block_counts)",
         _bsa([[[0, 9], [1, 2], [2, 0]], [[2, 1], [0, -1], [1, 0]]],
              counts=[[1, 2, 2], [2, 1, 2]]),
         "entries past a row's count are never read (nor checked)",
         expect=_bsa_as([[[0], [1, 2], [2, 0]], [[2, 1], [0], [1, 0]]])),
    Case("bsa", "bsa(..., block_size=16, kv_block_sizes=[-3, 20, 5])",
         _bsa(sizes=[-3, 20, 5]),
         "sizes clamped to [0, block_size] (and the last block cut at Skv), on every engine",
         expect=_bsa_as(_SEL, sizes=(0, 16, 5)),
         checkify=r"kv_block_sizes\[0\] = -3: expected a size in \[0, 16\]"),
    Case("bsa", "bsa(q, k, v, ...) with head dim H = 0",
         _bsa_shapes(((1, 40, 2, 0), (1, 40, 1, 0), (1, 40, 1, 8), (1, 2, 3, 2))),
         "ValueError: head dim must be >= 1 (the scale is 1/sqrt(H))", ValueError,
         "query: head dim H must be >= 1"),
    Case("bsa", "bsa(q, k, v, ...) with K = 0 kv heads",
         _bsa_shapes(((1, 40, 2, 8), (1, 40, 0, 8), (1, 40, 0, 8), (1, 2, 3, 2))),
         "ValueError: kv heads must be >= 1 and divide N", ValueError, "kv heads K=0"),
    Case("bsa", "bsa(q, k, v, block_index [B,N,Nq,0], return_lse=True)",
         _bsa(np.zeros((1, 2, 3, 0), np.int32)),
         "Kmax = 0: every row outputs 0, lse = -inf, on every engine",
         expect=_bsa_empty((1, 40, 2, 8))),
    Case("bsa", "bsa(q, k, v, block_index, return_lse=True) with Skv = 0 keys",
         lambda: _BSA(_BQ, _BK[:, :0], _BV[:, :0], np.zeros((1, 2, 3, 2), np.int32)),
         "every row outputs 0, lse = -inf, on every engine", expect=_bsa_empty((1, 40, 2, 8))),
    Case("bsa", "bsa(q, k, v, block_index) with B = 0, N = 0, Sq = 0 or Hv = 0",
         _bsa_shapes(((0, 40, 2, 8), (0, 40, 1, 8), (0, 40, 1, 8), (0, 2, 3, 2)),
                     ((1, 40, 0, 8), (1, 40, 1, 8), (1, 40, 1, 8), (1, 0, 3, 2)),
                     ((1, 0, 2, 8), (1, 40, 1, 8), (1, 40, 1, 8), (1, 2, 0, 2)),
                     ((1, 40, 2, 8), (1, 40, 1, 8), (1, 40, 1, 0), (1, 2, 3, 2))),
         "the empty output, on every engine (the triton engine declines Hv = 0)",
         expect=lambda shapes: _eq(shapes, [(0, 40, 2, 8), (1, 40, 0, 8), (1, 0, 2, 8),
                                            (1, 40, 2, 0)])),
    Case("bsa", "bsa_from_mask(block_mask [B,N,Nq,0])",
         lambda: cudnn_jax.bsa_from_mask(np.zeros((1, 2, 3, 0), bool)),
         "block_index [B,N,Nq,0] and block_counts 0 (bsa then outputs 0, lse = -inf)",
         expect=lambda r: _eq((r[0].shape, r[1].shape, int(np.sum(np.asarray(r[1])))),
                              ((1, 2, 3, 0), (1, 2, 3), 0))),
]

CATALOGUE = SDPA + VARLEN + PAGED + KDA + GEMM + BSA


def render():
  """The catalogue as Markdown (docs/bad_inputs.md)."""
  lines = [
      "# Bad inputs and what they get",
      "",
      "Every invalid call the library defines, with the error it raises or the result it",
      "returns. Shape, dtype and static-argument errors are raised at trace time and name",
      "the argument. Value-dependent metadata (lengths, offsets, page ids, indices, group",
      "sizes) cannot be checked at trace time: each op defines its result (SPEC section 8),",
      "nothing is read or written out of bounds or across sequences, and every engine gives",
      "the same answer. Under `jax.experimental.checkify.checkify(f,",
      "errors=checkify.user_checks)` such metadata raises the error in the last column,",
      "naming the argument and the offending entry; without checkify the checks cost",
      "nothing (they compile away).",
      "",
      "Each row is a test: `tests/bad_inputs.py` holds the catalogue and",
      "`tests/test_bad_inputs.py` runs it (`python tests/bad_inputs.py > docs/bad_inputs.md`",
      "regenerates this page).",
      "",
  ]
  for op in dict.fromkeys(c.op for c in CATALOGUE):
    lines += [f"## {op}", "", "| call | result | under checkify |", "|---|---|---|"]
    for c in CATALOGUE:
      if c.op == op:
        check = "" if c.checkify is None else "`" + c.checkify.replace("\\", "") + "`"
        lines.append(f"| `{c.call}` | {c.outcome} | {check} |")
    lines.append("")
  return "\n".join(lines)


if __name__ == "__main__":
  print(render(), end="")
