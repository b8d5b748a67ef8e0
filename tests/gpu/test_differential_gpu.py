"""The GPU tier of the differential harness (tests/differential.py): CUDNN_JAX_DIFF_N
(default 1000) seeded random GPU-sized configurations per op, every engine the GPU serves
against the xla engine and (on calls small enough) the float64 math. Each op's table is
written to CUDNN_JAX_DIFF_DIR (default differential-gpu/) as <op>.csv.

  pytest tests/gpu/test_differential_gpu.py -m gpu
"""

import os
import pathlib

import pytest

import differential

pytestmark = pytest.mark.gpu

N = int(os.environ.get("CUDNN_JAX_DIFF_N", "1000"))
OUT = pathlib.Path(os.environ.get("CUDNN_JAX_DIFF_DIR", "differential-gpu"))


@pytest.mark.parametrize("op", sorted(differential.OPS))
def test_gpu_tier(op):
  rows = differential.sweep(op, N, seed=1, tier="gpu")
  differential.write_table(rows, OUT / f"{op}.csv")
  assert all(r.ok for r in rows), differential.failures(rows)
