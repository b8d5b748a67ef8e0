"""Which GPU kernels one attention call runs, and for how long, on each path.

    python bench/sdpa_kernels.py [--s 4096] [--causal] [--backward] [--out DIR]

For B*S = 16384 tokens, 16 heads, head dim 128, bf16: the device kernels of one call of
cudnn_jax.sdpa (cudnn engine), jax.nn.dot_product_attention (cudnn) and, when torch sees
the GPU, torch's cuDNN attention on the same buffers, each from its own profiler (ms per
call, kernel name); the per-call time of 10 calls chained in one jitted function as
straight-line code and as a fori_loop. Also the cuDNN libraries this process loaded and
the execution plans cudnn_jax chose, so a difference in speed can be traced to a kernel,
a plan, a library or the launches between kernels. Writes DIR/sdpa_kernels.json and
DIR/sdpa_kernels.png (device ms per path, jax.nn's and torch's beside ours).
"""

from __future__ import annotations

import collections
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
# One profiler event per kernel, not per CUDA graph.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="

import cudnn_jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
from harness import (arg_parser, bar_chart, device_events, load_torch, time_calls,  # pylint: disable=wrong-import-position
                     write_results)
import sdpa  # pylint: disable=wrong-import-position

CALLS = 5


def jax_kernels(fn, args):
  """{kernel name: ms per call} of the jitted ``fn(*args)`` by the JAX profiler."""
  out = collections.Counter()
  for name, _, ms in device_events(fn, args, CALLS):
    out[name] += ms / CALLS
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
  parser = arg_parser(__doc__)
  parser.add_argument("--s", type=int, default=4096)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--backward", action="store_true")
  args = parser.parse_args()
  shape = sdpa.Shape(b=16384 // args.s, t=args.s, s=args.s, n=16, k=16, h=128,
                     causal=args.causal)
  tensors = sdpa.inputs(shape, jnp.bfloat16)
  print(f"{shape} backward={args.backward}")
  rows = []
  for name, attn in sdpa.engines(on_gpu=True, with_xla=False).items():
    single = sdpa.make_fns(attn, args.causal, args.backward)[0]
    kernels = jax_kernels(single, tensors)
    show(name, kernels)
    row = dict(path=name, device_ms=sum(kernels.values()), kernels=dict(kernels))
    for unroll in (True, False):
      chain = sdpa.make_fns(attn, args.causal, args.backward, unroll)[1]
      ms = 1e3 * time_calls(chain, tensors, 5, warmup=1) / sdpa.LOOP
      how = "straight-line" if unroll else "fori_loop"
      row[f"chained_{how}_ms"] = ms
      print(f"  {sdpa.LOOP} calls chained in one jit, {how}: {ms:.3f} ms per call")
    rows.append(row)
  torch, why = load_torch()
  if torch is None:
    print(f"\n(no torch row: {why})")
  else:
    kernels = torch_kernels(torch, sdpa.torch_step(torch, shape, args.backward, tensors))
    name = f"torch {torch.__version__} cudnn {torch.backends.cudnn.version()}"
    show(name, kernels)
    rows.append(dict(path=name, device_ms=sum(kernels.values()), kernels=dict(kernels)))
  print("\nlibcudnn loaded:", *loaded_cudnn(), sep="\n  ")
  print("\ncudnn_jax plans:")
  for key, plan in cudnn_jax.cache_info().get("plans", {}).items():
    print(f"  {plan}  <- {str(key)[:160]}")
  print("wrote", write_results(args.out, "sdpa_kernels", rows, shape=str(shape),
                               backward=args.backward, libcudnn=loaded_cudnn(),
                               cache_info=cudnn_jax.cache_info()))
  # Device time per path, torch's cuDNN call (when it ran) the hatched anchor.
  paths = [r["path"] for r in rows]
  series = {"device ms": [r["device_ms"] for r in rows]}
  for how in ("straight-line", "fori_loop"):
    series[f"chained {how} ms"] = [r.get(f"chained_{how}_ms") for r in rows]
  print("wrote", bar_chart(os.path.join(args.out, "sdpa_kernels.png"),
                           f"sdpa kernels, {shape}", paths, series,
                           "ms per call (lower is better)"))


if __name__ == "__main__":
  main()
