"""Every notebook in notebooks/ runs top to bottom on the CPU.

The notebooks are stored as .ipynb JSON without outputs; this test executes their code
cells in order in one namespace, from the notebooks folder (as Jupyter would), with
matplotlib drawing off screen. A failing cell fails the test with the cell's number and
source. The last cell of each reads bench/results/<name>.json when it exists and says how
to make it otherwise, so both paths are run: without the file, and with one written here.
"""

import json
import os
import pathlib
import traceback

import pytest

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))


def code_cells(path):
  cells = json.loads(path.read_text())["cells"]
  return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def run_notebook(path):
  """Executes the code cells of ``path``; returns the namespace."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  namespace = {"__name__": "__main__"}
  cwd = os.getcwd()
  os.chdir(path.parent)
  try:
    for i, source in enumerate(code_cells(path)):
      assert not source.lstrip().startswith(("%", "!")), f"cell {i}: no magics, please"
      try:
        exec(compile(source, f"{path.name}[cell {i}]", "exec"), namespace)  # pylint: disable=exec-used
      except Exception:  # pylint: disable=broad-except
        pytest.fail(f"{path.name}, code cell {i} failed:\n{source}\n\n{traceback.format_exc()}")
  finally:
    os.chdir(cwd)
    plt.close("all")
  return namespace


def test_every_notebook_is_found():
  assert len(PATHS) >= 6, PATHS


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs(path, monkeypatch, tmp_path):
  import bench_chart  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(bench_chart, "RESULTS", tmp_path)  # a fresh clone: no results yet
  namespace = run_notebook(path)
  assert namespace.get("fig") is None  # nothing to draw, and the cell said so


@pytest.fixture(autouse=True)
def _importable_helper(monkeypatch):
  monkeypatch.syspath_prepend(str(NOTEBOOKS))


def test_chart_cell_draws_the_results_file(tmp_path, monkeypatch):
  """With a results file (as a benchmark writes it), the closing cell draws its rows."""
  import bench_chart  # pylint: disable=g-import-not-at-top
  rows = [dict(case="c1", engine="cudnn_jax.moe_mlp", tflops=3.0),
          dict(case="c1", engine="lax.ragged_dot", tflops=1.0),
          dict(case="c2", engine="cudnn_jax.moe_mlp", tflops=None, error="declined")]
  (tmp_path / "moe.json").write_text(json.dumps(dict(meta=dict(device="H200"), rows=rows)))
  monkeypatch.setattr(bench_chart, "RESULTS", tmp_path)
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  fig = bench_chart.show("moe", label=lambda r: r["case"], value="tflops",
                         anchors=lambda name: not name.startswith("cudnn_jax"))
  heights = sorted(p.get_height() for p in fig.axes[0].patches)
  assert heights == [1.0, 3.0]
  assert "H200" in fig.axes[0].get_title()
