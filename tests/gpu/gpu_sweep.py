"""What the GPU tests share: their error measures and the loop of a randomized sweep.

A sweep prints one JSON line per configuration as it goes (a run cut short still reports
what it did), drops compiled programs between configurations, and splits over processes
with CUDNN_JAX_SWEEP_SHARD="i/n" (this process takes every n-th configuration from the
i-th), as bench/gpu_check.sh runs it.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

import cudnn_jax


class Declined(Exception):
  """The engine under test does not serve the configuration (with its reason)."""


def as_f64(x) -> np.ndarray:
  return np.asarray(x).astype(np.float64)


def rel_err(actual, expected) -> float:
  """||a - b|| / ||b|| in float64; ||a - b|| where b is 0."""
  a, b = as_f64(actual), as_f64(expected)
  denom, diff = np.linalg.norm(b), np.linalg.norm(a - b)
  return float(diff / denom) if denom > 0 else float(diff)


def lse_err(actual, expected) -> float:
  """Max |a - b| over finite entries; inf where the -inf entries disagree."""
  a, b = as_f64(actual), as_f64(expected)
  if not np.array_equal(np.isneginf(a), np.isneginf(b)):
    return float("inf")
  finite = np.isfinite(b)
  return float(np.max(np.abs(a[finite] - b[finite]), initial=0.0))


def shard_of_process() -> tuple[int, int]:
  """``(i, n)`` of CUDNN_JAX_SWEEP_SHARD="i/n": this process's shard of ``n`` (default
  ``(0, 1)``: everything)."""
  index, shards = map(int, os.environ.get("CUDNN_JAX_SWEEP_SHARD", "0/1").split("/"))
  return index, shards


def shard(cases: list) -> list:
  """This process's share of ``cases`` (CUDNN_JAX_SWEEP_SHARD)."""
  index, shards = shard_of_process()
  return cases[index::shards]


def run(cases, capsys, log_path: str | None = None) -> list[dict]:
  """The records of ``(record, compare)`` pairs: ``compare()`` returns ``(errors,
  problems, seconds)`` (``seconds`` a dict or None); raising Declined or
  cudnn_jax.UnsupportedError marks the configuration declined with the reason, raising
  anything else failed. ``log_path``: where to write the records as JSON."""
  records = []
  for record, compare in cases:
    try:
      errors, problems, seconds = compare()
    except (Declined, cudnn_jax.UnsupportedError) as e:
      record.update(status="declined", reason=str(e))
    except Exception as e:  # pylint: disable=broad-except
      record.update(status="failed", problems=[f"{type(e).__name__}: {e}"[:500]])
    else:
      record.update(status="failed" if problems else "ok", errors=errors, problems=problems)
      if seconds is not None:
        record["seconds"] = seconds
    records.append(record)
    with capsys.disabled():
      print(json.dumps(record, default=str), flush=True)
    jax.clear_caches()  # hundreds of distinct programs: keep the compiled ones bounded
  if log_path:
    with open(log_path, "w") as f:
      json.dump(records, f, indent=1, default=str)
  return records


def compute_sanitizer(tool: str, script: str, kernels: str, tmp_path) -> None:
  """Runs the Python ``script`` under ``compute-sanitizer --tool tool``, checking only the
  kernels whose names match the regex ``kernels``; fails the test on any error found
  (skips it where compute-sanitizer is absent)."""
  import shutil  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import pytest  # pylint: disable=g-import-not-at-top
  sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
  if not os.path.exists(sanitizer):
    pytest.skip("compute-sanitizer not found")
  path = tmp_path / "case.py"
  path.write_text(script)
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
             XLA_FLAGS="--xla_gpu_autotune_level=0")
  done = subprocess.run([sanitizer, "--tool", tool, "--error-exitcode", "3", "--kernel-name",
                         f"regex:{kernels}", sys.executable, str(path)],
                        capture_output=True, text=True, env=env, timeout=600, check=False)
  text = done.stdout + done.stderr
  assert done.returncode == 0, text[-3000:]
  summary = {"memcheck": "ERROR SUMMARY: 0 errors", "racecheck": "RACECHECK SUMMARY: 0 hazards"}
  assert summary[tool] in text, text[-3000:]
