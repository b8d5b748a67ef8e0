"""Which GPU kernels one attention call runs, and for how long, on each path.

    python bench/sdpa_kernels.py [--s 4096] [--causal] [--backward]

For B*S = 16384 tokens, 16 heads, head dim 128, bf16: the device kernels of one call of
cudnn_jax.sdpa (cudnn engine), jax.nn.dot_product_attention (cudnn) and, when torch sees
the GPU, torch's cuDNN attention on the same buffers, each from its own profiler (ms per
call, kernel name). Also the cuDNN libraries this process loaded and the execution plan
cudnn_jax chose, so a difference in speed can be traced to a kernel, a plan or a library.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import pathlib
import tempfile

import jax
import jax.numpy as jnp

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
# One profiler event per kernel, not per CUDA graph.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="

import cudnn_jax  # pylint: disable=wrong-import-position
from harness import load_torch, time_calls  # pylint: disable=wrong-import-position
from sdpa import LOOP, make_fns  # pylint: disable=wrong-import-position

CALLS = 5


def jax_kernels(fn, args):
  """{kernel name: ms per call} of the jitted ``fn(*args)`` by the JAX profiler."""
  jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp):
      for _ in range(CALLS):
        jax.block_until_ready(fn(*args))
    path = next(pathlib.Path(tmp).rglob("*.xplane.pb"))
    data = jax.profiler.ProfileData.from_file(str(path))
  out = collections.Counter()
  for plane in data.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      for event in line.events:
        if "hlo_op" in dict(event.stats):  # kernels, not the per-stream summaries
          out[event.name] += event.duration_ns / 1e6 / CALLS
  return out


def torch_kernels(torch, step):
  """{kernel name: ms per call} of ``step()`` by torch's profiler."""
  step()
  torch.cuda.synchronize()
  with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(CALLS):
      step()
    torch.cuda.synchronize()
  out = collections.Counter()
  for e in prof.key_averages():
    ms = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
    if ms and e.device_type.name == "CUDA":
      out[e.key] += ms / 1e3 / CALLS
  return out


def show(title, kernels):
  print(f"\n== {title}: {sum(kernels.values()):.3f} ms per call")
  for name, ms in kernels.most_common(8):
    print(f"  {ms:8.3f} ms  {name[:150]}")


def loaded_cudnn():
  with open("/proc/self/maps") as f:
    return sorted({line.split()[-1] for line in f if "libcudnn" in line})


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--s", type=int, default=4096)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--backward", action="store_true")
  args = parser.parse_args()
  b, n, h = 16384 // args.s, 16, 128
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, dout = (jax.random.normal(kk, (b, args.s, n, h), jnp.bfloat16) for kk in keys)

  def jitted(attn):
    def step(q, k, v, dout):
      if not args.backward:
        return attn(q, k, v, is_causal=args.causal)
      loss = lambda q, k, v: jnp.sum(attn(q, k, v, is_causal=args.causal).astype(
          jnp.float32) * dout.astype(jnp.float32))
      return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    return jax.jit(step)

  ours = jitted(functools.partial(cudnn_jax.sdpa, implementation="cudnn"))
  theirs = jitted(functools.partial(jax.nn.dot_product_attention, implementation="cudnn"))
  print(f"B={b} S={args.s} N={n} H={h} causal={args.causal} backward={args.backward}")
  show("cudnn_jax.sdpa cudnn", jax_kernels(ours, (q, k, v, dout)))
  show("jax.nn cudnn", jax_kernels(theirs, (q, k, v, dout)))
  print(f"\nms per call, {LOOP} calls chained in one jitted function:")
  for name, impl in (("cudnn_jax", "cudnn_jax"), ("jax.nn", "jax.nn")):
    attn = (functools.partial(cudnn_jax.sdpa, implementation="cudnn") if impl == "cudnn_jax"
            else functools.partial(jax.nn.dot_product_attention, implementation="cudnn"))
    for unroll in (True, False):
      chain = make_fns(attn, args.causal, args.backward, unroll)[1]
      ms = 1e3 * time_calls(chain, (q, k, v, dout), 5, warmup=1) / LOOP
      print(f"  {name:10s} {'straight-line' if unroll else 'fori_loop':14s} {ms:.3f}")
  torch, why = load_torch()
  if torch is None:
    print(f"\n(no torch row: {why})")
  else:
    from torch.nn import attention as tattn  # pylint: disable=g-import-not-at-top
    tq, tk, tv, tdout = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v, dout))

    def attend(q, k, v):
      with tattn.sdpa_kernel(tattn.SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                is_causal=args.causal)
    if args.backward:
      leaves = [x.detach().requires_grad_() for x in (tq, tk, tv)]
      step = lambda: torch.autograd.grad(attend(*leaves), leaves, tdout)
    else:
      def step():
        with torch.no_grad():
          return attend(tq, tk, tv)
    show(f"torch {torch.__version__} cudnn {torch.backends.cudnn.version()}",
         torch_kernels(torch, step))
  print("\nlibcudnn loaded:", *loaded_cudnn(), sep="\n  ")
  print("\ncudnn_jax plans:")
  for key, plan in cudnn_jax.cache_info().get("plans", {}).items():
    print(f"  {plan}  <- {str(key)[:160]}")


if __name__ == "__main__":
  main()
