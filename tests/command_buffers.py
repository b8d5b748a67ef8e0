"""Helpers for GPU tests of calls that XLA records into CUDA graphs (command buffers)."""

import re

import jax

# Every run of two or more commands becomes a CUDA graph.
GRAPH_EVERYTHING = {"xla_gpu_graph_min_graph_size": 1}


def jit_in_graphs(fn, **kwargs):
  """``jax.jit(fn)`` with command buffers formed around any two adjacent commands."""
  return jax.jit(fn, compiler_options=GRAPH_EVERYTHING, **kwargs)


def targets_in_command_buffers(jitted, *args):
  """The custom-call targets inside XLA's command-buffer computations of the compiled
  ``jitted(*args)`` (the computations XLA records into CUDA graphs)."""
  text = jitted.lower(*args).compile().as_text()
  found, current = set(), None
  for line in text.splitlines():
    header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
    if header:
      current = header.group(1)
    elif current and current.startswith("command_buffer"):
      found.update(re.findall(r'custom_call_target="([^"]+)"', line))
  return found
