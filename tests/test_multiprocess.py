"""The GPT-style model (cudnn_jax/models/gpt.py) trained by bench/train.py on 2 processes x 4
CPU devices (jax.distributed, CPU collectives through gloo), each process placing only its
own shards of the batch: losses and final parameters equal the single-process run on the
8 devices of conftest.py, under every parallelism the model has.

One launch of the two processes trains on every mesh in turn (one compiled step per mesh);
the model is tiny, as compiling dominates on the CPU."""

import contextlib
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import train  # pylint: disable=g-import-not-at-top,wrong-import-position

TIMEOUT_S = 600
MESHES = (
    # data, tensor (heads), sequence (ring attention and KDA sequence parallel)
    "data=2,tensor=2,sequence=2",
    # expert (an Explicit axis; moe_mlp's expert parallelism) beside data
    "data=4,expert=2",
)
ARGS = [a for mesh in MESHES for a in ("--mesh", mesh)] + [
    "--steps", "3", "--batch", "4", "--length", "16", "--layers", "1", "--width", "32",
    "--heads", "2", "--head-dim", "8", "--fast-compile", "--results", ""]  # no chart


def _free_port():
  with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(out, log, port, process_id):
  env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
  command = [sys.executable, str(ROOT / "bench" / "train.py"), *ARGS, "--cpu-devices", "4",
             "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
             "--process-id", str(process_id), "--out", str(out)]
  return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait(procs, deadline):
  """Waits for every process; stops at the first failure (its peer would wait for it in a
  collective) or at ``deadline``. Returns the processes that failed or were still running."""
  while time.monotonic() < deadline:
    codes = [p.poll() for p in procs]
    if any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes):
      break
    time.sleep(0.2)
  return [p for p in procs if p.poll() != 0]


def test_two_processes_equal_one(tmp_path):
  deadline = time.monotonic() + TIMEOUT_S
  port = _free_port()
  procs = []
  with contextlib.ExitStack() as stack:
    logs = [stack.enter_context(open(tmp_path / f"process{i}.log", "w")) for i in range(2)]
    try:
      for i in range(2):
        procs.append(_start(tmp_path / "multi.npz", logs[i], port, i))
      # The single-process run, on this process's 8 devices, while the others compile.
      assert train.main([*ARGS, "--out", str(tmp_path / "single.npz")]) == 0
      failed = _wait(procs, deadline)
    finally:
      for p in procs:  # always reaped, whatever happened above
        if p.poll() is None:
          p.kill()
        p.wait()
  text = "\n".join((tmp_path / f"process{i}.log").read_text()[-3000:] for i in range(2))
  assert not failed, f"exit codes {[p.returncode for p in procs]}:\n{text}"
  single, multi = np.load(tmp_path / "single.npz"), np.load(tmp_path / "multi.npz")
  assert sorted(single.files) == sorted(multi.files)
  for mesh in MESHES:
    losses = multi[f"{mesh}:losses"]
    assert losses[-1] < losses[0], (mesh, losses)
  for name in single.files:
    np.testing.assert_allclose(multi[name], single[name], rtol=2e-4, atol=2e-5, err_msg=name)
