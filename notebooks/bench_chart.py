"""The last cell of every notebook: a benchmark's measured figures as a chart.

The figures are never typed into a notebook: they are read from the JSON that the
benchmark in ``bench/`` wrote (``python bench/<name>.py`` on a GPU writes
``bench/results/<name>.json``). ``bench/results`` is not committed, so on a fresh clone
there is nothing to draw, and the cell says how to make it.
"""

from __future__ import annotations

import json
import pathlib

RESULTS = pathlib.Path(__file__).resolve().parent.parent / "bench" / "results"


def load(name):
  """``(meta, rows)`` of ``bench/results/<name>.json``, or None when it does not exist."""
  path = RESULTS / f"{name}.json"
  if not path.exists():
    return None
  data = json.loads(path.read_text())
  return data.get("meta", {}), data.get("rows", [])


def show(name, *, label, value, series="engine", anchors=(), how_to_run=None, ylabel=None):
  """Grouped bars of ``bench/results/<name>.json``: one group per ``label(row)``, one bar
  per ``row[series]``, the height the first of the keys ``value`` (a key or a tuple of
  keys) that the row has; ``anchors(series name) -> bool`` marks the baselines measured in
  the same run (hatched). Returns the matplotlib figure, or None (and says why) when the
  file is absent or has no values."""
  loaded = load(name)
  if loaded is None:
    print(f"No bench/results/{name}.json here: run `{how_to_run or f'python bench/{name}.py'}`"
          " on a GPU to draw the measured figures.")
    return None
  meta, rows = loaded
  keys = (value,) if isinstance(value, str) else tuple(value)
  pick = lambda r: next((r[k] for k in keys if r.get(k) is not None), None)
  rows = [r for r in rows if pick(r) is not None]
  if not rows:
    print(f"bench/results/{name}.json has no {keys} values (every engine declined?)")
    return None
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  groups = list(dict.fromkeys(label(r) for r in rows))
  names = list(dict.fromkeys(str(r.get(series)) for r in rows))
  width = 0.8 / len(names)
  fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(groups) * max(1, len(names) / 2)), 4))
  for i, n in enumerate(names):
    pts = [(groups.index(label(r)) + (i - (len(names) - 1) / 2) * width, pick(r))
           for r in rows if str(r.get(series)) == n]
    ax.bar(*zip(*pts), width=width, label=n, edgecolor="black", linewidth=0.5,
           hatch="//" if anchors and anchors(n) else None)
  ax.set_xticks(range(len(groups)), groups, rotation=20, ha="right", fontsize=8)
  ax.set_ylabel(ylabel or keys[0])
  ax.set_title(f"{name}: {meta.get('device', '?')} ({meta.get('backend', '?')}), "
               f"jax {meta.get('jax', '?')}", fontsize=10)
  ax.grid(True, axis="y", alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  return fig
