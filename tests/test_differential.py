"""The CPU tier of the differential harness (tests/differential.py): a few seeded random
calls of every op, edge cases and invalid metadata among them, on every engine this machine
serves, against the xla engine and the float64 math. About two minutes on two cores."""

import pytest

import differential

# Configurations per op: what fits the tier's budget (kda/gdn compile slowest).
CPU_TIER = {"sdpa": 12, "sdpa_varlen": 8, "sdpa_paged": 8, "kda": 3, "gdn": 3, "gemm": 12,
            "grouped_gemm": 10, "moe_mlp": 8, "bsa": 6, "conv3d": 8}


def test_the_tier_covers_every_op():
  assert set(CPU_TIER) == set(differential.OPS)


@pytest.mark.parametrize("op", sorted(CPU_TIER))
def test_cpu_tier(op):
  rows = differential.sweep(op, CPU_TIER[op], seed=0, tier="cpu")
  assert any(r.vs_f64 is not None for r in rows), "no configuration reached the float64 math"
  assert all(r.ok for r in rows), differential.failures(rows)


def test_the_harness_catches_a_wrong_engine(monkeypatch):
  """A harness that cannot fail is no check: an xla engine off by 1% is caught."""
  real = differential.OPS["gemm"].run
  spec = differential.OPS["gemm"]
  monkeypatch.setitem(differential.OPS, "gemm", differential.Op(
      spec.generate, spec.build, lambda *a: tuple(1.01 * y for y in real(*a)), spec.oracle))
  cfg = dict(batch=(), m=8, k=8, n=8, activation=None, glu=None, bias=False,
             dtype="float32", out_dtype=None)
  assert not all(r.ok for r in differential.check("gemm", cfg))
