"""The bad-input catalogue (tests/bad_inputs.py, docs/bad_inputs.md): every entry gets its
error or its defined result; metadata entries fail under checkify naming the argument and
the entry, valid metadata passes, and without checkify the checks compile away."""

import pathlib
import re

import jax
import numpy as np
import pytest
from jax.experimental import checkify

import cudnn_jax
from bad_inputs import CATALOGUE, render
from cudnn_jax import _metadata

_IDS = [f"{c.op}-{i}" for i, c in enumerate(CATALOGUE)]


@pytest.mark.parametrize("case", CATALOGUE, ids=_IDS)
def test_catalogue_entry(case):
  if case.raises is not None:
    with pytest.raises(case.raises, match=case.match):
      case.run()
  else:
    case.expect(case.run())


_CHECKED = [c for c in CATALOGUE if c.checkify is not None]


@pytest.mark.parametrize("case", _CHECKED, ids=[f"{c.op}-{i}" for i, c in enumerate(_CHECKED)])
def test_checkify_names_the_argument_and_entry(case):
  err, _ = checkify.checkify(case.run, errors=checkify.user_checks)()
  message = err.get()
  assert message is not None and re.search(case.checkify, message), message


def _valid_calls():
  rng = np.random.default_rng(0)
  f = lambda *s: rng.standard_normal(s).astype(np.float32)
  cu = np.array([0, 6, 6, 16], np.int32)
  q, k, v = f(16, 2, 8), f(16, 2, 8), f(16, 2, 8)
  table = np.array([[1, 3], [0, 2]], np.int32)
  g = -np.abs(f(1, 16, 2, 8))
  return {
      "sdpa": lambda: cudnn_jax.sdpa(q[None], k[None], v[None],
                                     query_seq_lengths=np.array([16], np.int32),
                                     key_value_seq_lengths=np.array([0], np.int32)),
      "sdpa_varlen": lambda: cudnn_jax.sdpa_varlen(q, k, v, cu, cu, max_seqlen_q=10,
                                                   max_seqlen_kv=10),
      "sdpa_paged": lambda: cudnn_jax.sdpa_paged(
          f(2, 1, 2, 8), f(4, 4, 1, 8), f(4, 4, 1, 8), np.array([[1, -1], [0, 2]], np.int32),
          np.array([4, 8], np.int32)),  # the -1 lies past sequence 0's length: never read
      "kda": lambda: cudnn_jax.kda(q[None], k[None], v[None], g, np.abs(f(1, 16, 2)),
                                   cu_seqlens=cu),
      "grouped_gemm": lambda: cudnn_jax.grouped_gemm(f(12, 8), f(3, 8, 4),
                                                     np.array([5, 0, 7], np.int32)),
      "moe_mlp": lambda: cudnn_jax.moe_mlp(f(3, 8), np.array([[0, 2], [1, 1], [2, 0]], np.int32),
                                           f(3, 2), f(3, 8, 12), f(3, 6, 8)),
  }


@pytest.mark.parametrize("op", ["sdpa", "sdpa_varlen", "sdpa_paged", "kda", "grouped_gemm",
                                "moe_mlp"])
def test_checkify_passes_valid_metadata(op):
  err, _ = jax.jit(checkify.checkify(_valid_calls()[op], errors=checkify.user_checks))()
  assert err.get() is None


def _compiled_ops(fn):
  text = jax.jit(fn).lower().compile().as_text()
  return sorted(re.findall(r"= \S+ ([a-z][\w-]*)\(", text))


@pytest.mark.parametrize("op", ["sdpa_varlen", "sdpa_paged", "grouped_gemm"])
def test_checks_cost_nothing_without_checkify(op, monkeypatch):
  """The compiled program is the same, operation for operation, with the checks taken out."""
  with_checks = _compiled_ops(_valid_calls()[op])
  monkeypatch.setattr(_metadata, "check_entries", lambda *a, **k: None)
  assert _compiled_ops(_valid_calls()[op]) == with_checks


def test_docs_page_is_the_catalogue():
  page = pathlib.Path(__file__).parent.parent / "docs" / "bad_inputs.md"
  assert page.read_text() == render(), "run: python tests/bad_inputs.py > docs/bad_inputs.md"
