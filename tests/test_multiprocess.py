"""The GPT-style model (cudnn_jax/models/gpt.py) trained by bench/train.py on 2 processes x 4
CPU devices (jax.distributed, CPU collectives through gloo), each process placing only its
own shards of the batch: losses and final parameters equal the single-process run on the
8 devices of conftest.py."""

import contextlib
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import train  # pylint: disable=g-import-not-at-top,wrong-import-position

TIMEOUT_S = 420
# data, tensor (heads), sequence (ring attention and KDA sequence parallel) in one program.
# Expert parallelism (data=4,expert=2) trains on one process but its parameters differ
# between 2 processes and 1 (under investigation), so it is not listed yet.
LAYOUTS = {"data_tensor_sequence": "data=2,tensor=2,sequence=2"}
COMMON = ["--steps", "3", "--batch", "8", "--length", "32"]


def _free_port():
  with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(mesh, out, port, process_id):
  env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
  command = [sys.executable, str(ROOT / "bench" / "train.py"), "--mesh", mesh, *COMMON,
             "--cpu-devices", "4", "--coordinator", f"127.0.0.1:{port}",
             "--num-processes", "2", "--process-id", str(process_id)]
  if process_id == 0:
    command += ["--out", str(out)]
  return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_processes_equal_one(layout, tmp_path):
  mesh = LAYOUTS[layout]
  port = _free_port()
  procs = [_start(mesh, tmp_path / "multi.npz", port, i) for i in range(2)]
  try:
    # The single-process run, on this process's 8 devices, while the others compile.
    assert train.main(["--mesh", mesh, *COMMON, "--out", str(tmp_path / "single.npz")]) == 0
    logs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
  single, multi = np.load(tmp_path / "single.npz"), np.load(tmp_path / "multi.npz")
  assert sorted(single.files) == sorted(multi.files)
  assert multi["losses"][-1] < multi["losses"][0]
  for name in single.files:
    np.testing.assert_allclose(multi[name], single[name], rtol=2e-4, atol=2e-5, err_msg=name)
