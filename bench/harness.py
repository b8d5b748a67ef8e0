"""Timing and comparison helpers shared by the benchmarks in this folder."""

from __future__ import annotations

import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def time_calls(fn, args, calls=20, warmup=3):
  """Median wall seconds of ``fn(*args)``, each call waited for, after ``warmup`` calls."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(calls):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def rel_diff(a, b):
  """||a - b|| / ||b|| in float64."""
  a, b = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (a, b))
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def write_results(out_dir, name, rows, **meta):
  """Writes ``out_dir/name.json`` with the rows and where they were measured; its path."""
  os.makedirs(out_dir, exist_ok=True)
  meta = dict(device=str(jax.devices()[0].device_kind), backend=jax.default_backend(),
              jax=jax.__version__, **meta)
  path = os.path.join(out_dir, f"{name}.json")
  with open(path, "w") as f:
    json.dump(dict(meta=meta, rows=rows), f, indent=1)
  return path


def error_text(e: Exception) -> str:
  """One short line naming an exception, for a results row."""
  return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
