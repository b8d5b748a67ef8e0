"""Timing and comparison helpers shared by the benchmarks in this folder."""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np


def time_calls(fn, args, calls=20, warmup=3, warm_seconds=0.2):
  """Median wall seconds of ``fn(*args)``, each call waited for, after ``warmup`` calls and
  at least ``warm_seconds`` of calls (a GPU raises its clocks under load)."""
  start = time.perf_counter()
  done = 0
  while done < warmup or time.perf_counter() - start < warm_seconds:
    jax.block_until_ready(fn(*args))
    done += 1
  times = []
  for _ in range(calls):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def time_back_to_back(fn, args, calls=20, warmup=3):
  """Seconds per call of ``fn(*args)`` issued ``calls`` times without waiting in between
  (JAX dispatches asynchronously, so the GPU runs them back to back as in a model), one
  wait at the end: device throughput, without the per-call launch and wait latency that
  time_calls includes. Best of three such runs, after ``warmup`` waited calls."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(3):
    start = time.perf_counter()
    outs = [fn(*args) for _ in range(calls)]
    jax.block_until_ready(outs)
    best = min(best, (time.perf_counter() - start) / calls)
  return best


def load_torch():
  """``(torch, None)`` when torch imports and sees a CUDA device, else ``(None, reason)``."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except Exception as e:  # pylint: disable=broad-except
    return None, f"torch not importable ({type(e).__name__}: {e})"
  if not torch.cuda.is_available():
    return None, "torch has no CUDA device"
  return torch, None


def torch_time_ms(torch, step, calls=20, warmup=3, chained=1):
  """Median CUDA-event milliseconds of ``step()`` (``chained`` calls between two events,
  divided by ``chained``), after ``warmup`` calls."""
  for _ in range(warmup):
    step()
  torch.cuda.synchronize()
  times = []
  for _ in range(calls):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(chained):
      step()
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) / chained)
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


_HLO_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*)$')
_HLO_COMPUTATION = re.compile(r'^(?:ENTRY\s+)?%?([\w.\-]+) \(.*\{$')


def hlo_op_names(hlo_text):
  """{instruction: op_name} from compiled HLO text; an instruction without metadata (a
  fusion, say) takes the first op_name found in the computation it calls."""
  own, calls, inside, comp = {}, {}, collections.defaultdict(list), None
  for line in hlo_text.splitlines():
    if m := _HLO_COMPUTATION.match(line):
      comp = m.group(1)
    elif m := _HLO_INSTRUCTION.match(line):
      name, rest = m.groups()
      if op := re.search(r'op_name="([^"]*)"', rest):
        own[name] = op.group(1)
        inside[comp].append(op.group(1))
      if callee := re.search(r'calls=%?([\w.\-]+)', rest):
        calls[name] = callee.group(1)
  names = dict(own)
  for name, callee in calls.items():
    if name not in names and inside.get(callee):
      names[name] = inside[callee][0]
  return names


def device_events(fn, args, calls=3):
  """``(name, hlo_op, ms)`` of every device event (a kernel, memset or copy) that XLA
  attributes to an HLO instruction, over ``calls`` calls of the jitted ``fn(*args)`` under
  the JAX profiler; on a CPU backend, the host's."""
  jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp):
      for _ in range(calls):
        jax.block_until_ready(fn(*args))
    path = next(pathlib.Path(tmp).rglob("*.xplane.pb"))
    data = jax.profiler.ProfileData.from_file(str(path))
  planes = [p for p in data.planes if p.name.startswith("/device:")] or data.planes
  for plane in planes:
    for line in plane.lines:
      for event in line.events:
        op = dict(event.stats).get("hlo_op")
        if op is not None:
          yield event.name, op, event.duration_ns / 1e6


def profile_scopes(fn, args, scopes, calls=3, top=10):
  """Device time per call of ``fn(*args)`` (jitted) split by ``jax.named_scope`` names.

  Runs ``calls`` calls under the JAX profiler and charges each device event to the
  outermost of ``scopes`` in its HLO instruction's op_name (else "other"). Returns ``(by_scope,
  top_ops)``: ms per call for each scope, and the ten costliest HLO instructions as
  ``(ms per call, instruction, op_name)`` (``top`` of them).
  """
  op_names = hlo_op_names(fn.lower(*args).compile().as_text())
  per_op = collections.Counter()
  for _, op, ms in device_events(fn, args, calls):
    per_op[op] += ms / calls
  by_scope = collections.Counter()
  for op, ms in per_op.items():
    # Components look like "kda_intra" or, under autodiff, "transpose(jvp(kda_intra))".
    names = [re.sub(r"^(?:\w+\()+", "", c).rstrip(")") for c in op_names.get(op, "").split("/")]
    by_scope[next((n for n in names if n in scopes), "other")] += ms
  top = [(ms, op, op_names.get(op, "")) for op, ms in per_op.most_common(top)]
  return dict(by_scope), top


def device_ms(fn, args, calls=3):
  """Milliseconds of device work per call of ``fn(*args)`` (jitted), by the profiler: what
  CUDA events around the call would measure, without host dispatch gaps."""
  return sum(ms for _, _, ms in device_events(fn, args, calls)) / calls


RESULTS = str(pathlib.Path(__file__).parent / "results")


def arg_parser(doc: str) -> argparse.ArgumentParser:
  """A benchmark's parser: its docstring's first line, and --out (default bench/results)."""
  parser = argparse.ArgumentParser(description=doc.splitlines()[0])
  parser.add_argument("--out", default=RESULTS, help="where the JSON and the chart go")
  return parser


def pyplot():
  """matplotlib's pyplot, drawing off screen."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def save_figure(fig, path):
  """Lays ``fig`` out, writes it to ``path`` as a PNG and closes it."""
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  pyplot().close(fig)


def bar_chart(path, title, groups, series, ylabel, anchors=()):
  """Writes a PNG of grouped bars: one group per label in ``groups``, one bar per name in
  ``series`` ({name: [value or None per group]}) that has a value there; names in
  ``anchors`` (the baselines measured in the same run) are hatched, so ours and the
  anchor stand side by side. Returns ``path``."""
  plt = pyplot()
  names = list(series)
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  color = {n: colors[i % len(colors)] for i, n in enumerate(names)}
  bars = max([sum(series[n][g] is not None for n in names) for g in range(len(groups))] + [1])
  fig, ax = plt.subplots(figsize=(min(16.0, max(6.0, 0.3 * len(groups) * bars + 2)), 4.5))
  labelled = set()
  for g in range(len(groups)):
    present = [n for n in names if series[n][g] is not None]
    width = 0.8 / max(len(present), 1)
    for i, n in enumerate(present):
      ax.bar(g + (i - (len(present) - 1) / 2) * width, series[n][g], width=width,
             color=color[n], hatch="//" if n in anchors else None, edgecolor="black",
             linewidth=0.5, label=None if n in labelled else n)
      labelled.add(n)
  ax.set_xticks(range(len(groups)), groups, rotation=20 if len(groups) > 3 else 0,
                ha="right" if len(groups) > 3 else "center", fontsize=8)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=10)
  ax.grid(True, axis="y", alpha=0.3)
  ax.legend(fontsize=8)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  save_figure(fig, path)
  return path
