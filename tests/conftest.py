"""Shared pytest setup: an 8-device CPU mesh, and the `gpu` marker.

Tests under tests/gpu/ carry the `gpu` marker and run only where the default backend is
a GPU and the cuDNN engine is available; everywhere else they are skipped.
"""

import json
import os
import pathlib
import sys
import time

# Must happen before jax initializes its backends; it only affects the host platform.
_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

# Result buffers reach our GPU kernels NaN-filled, so an element left unwritten shows up.
os.environ.setdefault("CUDNN_JAX_POISON_OUTPUTS", "1")

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # makes `sdpa_oracle` importable

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

_GPU_DIR = pathlib.Path(__file__).parent / "gpu"


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "gpu: needs a GPU and the cuDNN engine; skipped elsewhere")


def _gpu_unavailable_reason():
  import jax  # pylint: disable=g-import-not-at-top
  if jax.default_backend() != "gpu":
    return f"needs a GPU (default backend is {jax.default_backend()!r})"
  from cudnn_jax import _extension  # pylint: disable=g-import-not-at-top
  return _extension.unavailable_reason()


def pytest_collection_modifyitems(config, items):
  del config
  reason = None
  for item in items:
    if _GPU_DIR in pathlib.Path(str(item.fspath)).parents:
      item.add_marker(pytest.mark.gpu)
    if item.get_closest_marker("gpu") is None:
      continue
    if reason is None:
      reason = _gpu_unavailable_reason() or ""
    if reason:
      item.add_marker(pytest.mark.skip(reason=f"gpu test: {reason}"))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Each test module's compiled programs are dropped after it. XLA's CPU compiler maps
  memory for every program it loads; kept for the whole suite in one process they pass
  Linux's limit on mappings per process (vm.max_map_count, 65530), and a compile then
  crashes."""
  yield
  import gc  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  jax.clear_caches()
  gc.collect()


@pytest.fixture
def emulated(monkeypatch):
  """``force(op, name)``: engine ``name`` serves ``op`` from then on, its support check
  skipped. Off the GPU a GPU engine's primitives lower to their handlers' contracts in
  plain JAX, so everything the engine does around its FFI calls runs on the CPU."""
  from cudnn_jax import engines  # pylint: disable=g-import-not-at-top
  original = engines.choose

  def force(op, name):
    forced = engines.engine(op, name)
    monkeypatch.setattr(engines, "choose", lambda op_, call, implementation: (
        forced if op_ == op else original(op_, call, implementation)))
  return force


# A record per test, written as each test ends (CUDNN_JAX_TEST_RECORDS=path: one JSON line
# per phase report, plus a "started" line before each test), so a process killed by a time
# limit still leaves the outcome and first error lines of every test it finished, and names
# the one it was in. CUDNN_JAX_TEST_TIMEOUT=seconds limits each test: past it the test fails
# with a TimeoutError where Python code runs, and a process stuck in native code dumps every
# thread's stack into the records file and exits.
_RECORDS = os.environ.get("CUDNN_JAX_TEST_RECORDS")
_TIMEOUT = float(os.environ.get("CUDNN_JAX_TEST_TIMEOUT", "0"))


def _record(**fields):
  with open(_RECORDS, "a") as f:
    f.write(json.dumps({"time": round(time.time(), 1), **fields}, default=str) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  del nextitem
  if _RECORDS:
    _record(test=item.nodeid, when="started")
  # A test marked time_limit(seconds) (a sweep compiling many programs) may take longer.
  marked = item.get_closest_marker("time_limit")
  timeout = max(_TIMEOUT, marked.args[0]) if _TIMEOUT and marked else _TIMEOUT
  if not timeout:
    yield
    return
  import faulthandler  # pylint: disable=g-import-not-at-top
  import signal  # pylint: disable=g-import-not-at-top

  def expire(signum, frame):
    del signum, frame
    raise TimeoutError(f"{item.nodeid} ran past its time limit of {timeout:g} s")

  previous = signal.signal(signal.SIGALRM, expire)
  signal.setitimer(signal.ITIMER_REAL, timeout)
  stacks = open(_RECORDS, "a") if _RECORDS else sys.stderr
  faulthandler.dump_traceback_later(timeout + 60, exit=True, file=stacks)
  try:
    yield
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)
    faulthandler.cancel_dump_traceback_later()
    if stacks is not sys.stderr:
      stacks.close()


def pytest_runtest_logreport(report):
  if not _RECORDS or (report.when != "call" and report.outcome == "passed"):
    return
  error = None
  if report.failed or report.skipped:
    lines = str(report.longrepr).splitlines()
    error = "\n".join([l for l in lines if l.startswith("E ")][:12] or lines[-12:])[:2000]
  _record(test=report.nodeid, when=report.when, outcome=report.outcome,
          seconds=round(report.duration, 2), error=error)
