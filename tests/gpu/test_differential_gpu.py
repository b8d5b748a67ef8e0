"""The GPU tier of the differential harness (tests/differential.py): CUDNN_JAX_DIFF_N
(default 1000) seeded random GPU-sized configurations per op, every engine the GPU serves
against the xla engine and (on calls small enough) the float64 math. Each op's table is
written to CUDNN_JAX_DIFF_DIR (default differential-gpu/) as <op>.csv, a configuration's
rows as it ends, so a run cut short keeps what it did. CUDNN_JAX_SWEEP_SHARD="i/m" (as
bench/gpu_check.sh sets it) checks every m-th configuration from the i-th, into
<op>.<i>of<m>.csv: processes sharing the GPU, or runs on several machines, split one sweep.

  pytest tests/gpu/test_differential_gpu.py -m gpu
"""

import os
import pathlib

import pytest

import differential
import gpu_sweep

pytestmark = pytest.mark.gpu

N = int(os.environ.get("CUDNN_JAX_DIFF_N", "1000"))
OUT = pathlib.Path(os.environ.get("CUDNN_JAX_DIFF_DIR", "differential-gpu"))
SHARD = gpu_sweep.shard_of_process()


@pytest.mark.parametrize("op", sorted(differential.OPS))
def test_gpu_tier(op):
  name = op if SHARD == (0, 1) else f"{op}.{SHARD[0]}of{SHARD[1]}"
  table = OUT / f"{name}.csv"
  table.unlink(missing_ok=True)
  rows = differential.sweep(op, N, seed=1, tier="gpu", shard=SHARD, table=table)
  assert all(r.ok for r in rows), differential.failures(rows)
