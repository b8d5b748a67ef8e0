"""Trains the small GPT-style model of cudnn_jax/models/gpt.py on generated data and reports
tokens/s and, per collective, the bytes one training step moves (read from the compiled
program) beside what the parallelism layout predicts.

  python bench/train.py                                  # CPU: 8 host devices, data=2,tensor=2,sequence=2
  python bench/train.py --mesh data=4,expert=2           # expert parallel (the expert axis is Explicit)
  python bench/train.py --mesh data=8 --steps 200        # 8 GPUs of one host
  python bench/train.py --coordinator host0:1234 --num-processes 2 --process-id 0   # on each host

With ``--num-processes`` the same script runs on several processes (``jax.distributed``):
each process places only its own shards of the batch. ``--mesh`` repeated trains on each
mesh in turn (one launch, one compiled step per mesh). ``--out FILE.npz`` saves the losses
and the final parameters, keyed ``<mesh>:<name>``. On a GPU ``--baseline`` also trains the
same model with attention on ``jax.nn.dot_product_attention`` and the experts on
``lax.ragged_dot`` (data parallel layouts only: jax.nn has no context parallelism).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys
import time


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--mesh", action="append", default=None,
                 help="axis=size,... with axes from data, tensor, sequence, expert, and "
                      "expert=AXIS to shard the experts on another axis (default: "
                      "data=2,tensor=2,sequence=2 on 8 devices, else data=<all>); repeat "
                      "it to train on several meshes in one run")
  p.add_argument("--expert-axis", default=None, help="the axis experts are sharded on")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--length", type=int, default=64)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--width", type=int, default=64)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--head-dim", type=int, default=16)
  p.add_argument("--bf16", action="store_true", help="compute in bfloat16 (params float32)")
  p.add_argument("--cpu-devices", type=int, default=8, help="host devices when on the CPU")
  p.add_argument("--coordinator", default=None, help="host:port of process 0")
  p.add_argument("--num-processes", type=int, default=1)
  p.add_argument("--process-id", type=int, default=0)
  p.add_argument("--kda-combine", choices=("gather", "log_depth"), default=None,
                 help="how KDA's sequence parallelism combines the spans' maps "
                      "(default: cudnn_jax.ops.kda_sequence_parallel.ENTERING)")
  p.add_argument("--baseline", action="store_true",
                 help="also jax.nn.dot_product_attention + lax.ragged_dot (GPU)")
  p.add_argument("--fast-compile", action="store_true",
                 help="compile the step with LLVM's cheaper passes only (tests: compiling "
                      "dominates their time on the CPU)")
  p.add_argument("--out", default=None, help="save losses and final params (.npz)")
  p.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "results"),
                 help="folder for train.json (tokens/s and collectives per mesh) and its chart")
  return p.parse_args(argv)


def start_jax(args):
  """Imports jax after setting what must precede it: the host device count, and CPU
  collectives through gloo when several processes share the CPU."""
  flag = f"--xla_force_host_platform_device_count={args.cpu_devices}"
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
  import jax  # pylint: disable=g-import-not-at-top
  if args.num_processes > 1:
    if jax.config.jax_platforms in (None, "", "cpu"):
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id)
  return jax


# ---------------------------------------------------------------------------------------
# Collectives of a compiled program: bytes of each op's result per device, every op
# counted as often as it runs (while loops by their known trip counts).

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_DTYPE_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "u64": 8, "s32": 4,
                "u32": 4, "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}
_ARRAY = re.compile(r"\b(f64|f32|bf16|f16|s64|u64|s32|u32|s16|u16|s8|u8|pred)\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP = re.compile(r"=\s*(.*?)\s([a-z\-]+)\(")
_CALLED = re.compile(r"(body|calls|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def _bytes(type_text):
  return sum(_DTYPE_BYTES[d] * math.prod(int(n) for n in dims.split(",") if n)
             for d, dims in _ARRAY.findall(type_text))


def collective_bytes(hlo_text):
  """{kind: bytes per step per device} of the collectives in ``hlo_text``."""
  comps, entry, current = {}, None, None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header and not line.startswith(" "):
      current = header.group(1)
      comps[current] = ([], [])  # (collectives, calls)
      entry = current if line.startswith("ENTRY") else entry
      continue
    op = _OP.search(line) if current else None
    if not op:
      continue
    type_text, name = op.groups()
    kind = name[:-5] if name.endswith("-done") else name
    if kind in KINDS and not name.endswith("-start"):
      comps[current][0].append((kind, _bytes(type_text)))
    trips = _TRIPS.search(line)
    for role, callee in _CALLED.findall(line):
      comps[current][1].append((callee, int(trips.group(1)) if role == "body" and trips else 1))
    for group in _BRANCHES.findall(line):
      comps[current][1].extend((c.strip().lstrip("%"), 1) for c in group.split(","))

  totals = dict.fromkeys(KINDS, 0)

  def visit(comp, times, depth=0):
    if comp not in comps or depth > 50:
      return
    for kind, nbytes in comps[comp][0]:
      totals[kind] += times * nbytes
    for callee, trips in comps[comp][1]:
      visit(callee, times * trips, depth + 1)

  visit(entry, 1)
  return totals


def expected_bytes(cfg, layout, mesh, batch, length, param_bytes):
  """{kind: bytes per step per device} the layout predicts (float32 activations):

  - all-reduce: the gradients of the weights replicated over the data and sequence axes
    (each device's shard of them); under tensor parallelism the partial sums of the
    attention and KDA output projections, and of their input projections' gradients;
    under expert parallelism the experts' partial outputs and their input gradients;
  - collective-permute: the ring attention's key/value shards, S - 1 steps;
  - all-gather: the KDA span maps (M [K,K] and B [K,V] per sequence and head of the
    device's batch rows and heads) of every device along the sequence axis, in the forward
    and the rematerialized forward; in the backward the cotangents of the states entering
    the spans ([K,V] each), gathered the same way;
  - reduce-scatter: none.
  Forward collectives run three times per step: forward, rematerialized forward, and
  transposed in the backward pass. (KDA combining the maps by the log-depth scan moves
  them by collective permutes instead, not predicted here.)
  """
  size = lambda role: mesh.shape[getattr(layout, role)] if getattr(layout, role) else 1
  d, t, s, e = (size(r) for r in ("data", "tensor", "sequence", "expert"))
  tokens = batch * length // (d * s)  # per device
  act = tokens * cfg.width * 4
  heads = cfg.heads // t
  kv = tokens * heads * cfg.head_dim * 4
  states = (batch // d) * heads * cfg.head_dim * cfg.head_dim * 4
  maps = 2 * states  # M and B
  passes = 3 * cfg.layers
  return {
      "all-reduce": (param_bytes if d * s > 1 else 0) + passes * act * (
          (2 if t > 1 else 0) + (1 if e > 1 else 0)),
      "all-gather": cfg.layers * s * (2 * maps + states) if s > 1 else 0,
      "reduce-scatter": 0,
      "collective-permute": passes * (s - 1) * 2 * kv,
      "all-to-all": 0,
  }


# ---------------------------------------------------------------------------------------
# The baseline model: the same layers with jax.nn's attention and lax.ragged_dot experts.


@contextlib.contextmanager
def baseline_ops():
  """While active, cudnn_jax.sdpa is jax.nn.dot_product_attention and cudnn_jax.moe_mlp
  a sort + two lax.ragged_dot (GPU comparisons; no context parallelism)."""
  import cudnn_jax  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def sdpa(q, k, v, *, is_causal=False, **unused):
    return jax.nn.dot_product_attention(q, k, v, is_causal=is_causal)

  def moe_mlp(x, idx, w, w_up, w_down, *, glu="swiglu", **unused):
    e, k = w_up.shape[0], idx.shape[1]
    order = jnp.argsort(idx.reshape(-1), stable=True)
    sizes = jnp.bincount(idx.reshape(-1), length=e).astype(jnp.int32)
    h = jax.lax.ragged_dot(x[order // k], w_up, sizes)
    gate, up = jnp.split(h, 2, -1)
    y = jax.lax.ragged_dot((jax.nn.silu(gate) * up).astype(x.dtype), w_down, sizes)
    y = y * w.reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[order // k].add(y.astype(x.dtype))

  saved = cudnn_jax.sdpa, cudnn_jax.moe_mlp
  cudnn_jax.sdpa, cudnn_jax.moe_mlp = sdpa, moe_mlp
  try:
    yield
  finally:
    cudnn_jax.sdpa, cudnn_jax.moe_mlp = saved


# ---------------------------------------------------------------------------------------


def train(jax, gpt, cfg, mesh, layout, args, label):
  """Trains ``args.steps`` steps; returns (losses, final params, tokens/s, compiled)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  trainer = gpt.Trainer(cfg, mesh, layout)
  state = trainer.init(seed=0)
  batches = [trainer.batch(*gpt.synthetic_batch(i, args.batch, args.length, cfg.vocab))
             for i in range(args.steps)]
  options = ({"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
             if args.fast_compile else None)
  compiled = trainer.lower(state, *batches[0]).compile(compiler_options=options)
  losses, start = [], None
  for i, (x, y) in enumerate(batches):
    if i == 1:  # the first step warms up
      jax.block_until_ready(state)
      start = time.perf_counter()
    with jax.set_mesh(mesh):
      state, loss = compiled(state, x, y)
    losses.append(loss)
  jax.block_until_ready(state)
  elapsed = time.perf_counter() - start if start else float("nan")
  tokens_per_s = (args.steps - 1) * args.batch * args.length / elapsed
  losses = [float(x) for x in losses]
  if jax.process_index() == 0:
    print(f"{label}: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps, "
          f"{tokens_per_s:,.0f} tokens/s")
  return np.array(losses), state[0], tokens_per_s, compiled


def parse_mesh(text, expert_axis=None):
  """"data=2,tensor=2,expert=tensor" -> ({axis: size}, the expert axis or None)."""
  sizes = {}
  for item in text.split(","):
    name, value = item.split("=")
    if name == "expert" and not value.isdigit():
      expert_axis = value
    else:
      sizes[name] = int(value)
  return sizes, expert_axis


def main(argv=None):
  args = parse_args(argv)
  jax = start_jax(args)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from cudnn_jax.models import gpt  # pylint: disable=g-import-not-at-top
  from cudnn_jax.ops import kda_sequence_parallel  # pylint: disable=g-import-not-at-top

  if args.kda_combine:
    kda_sequence_parallel.ENTERING = args.kda_combine

  n = jax.device_count()
  texts = args.mesh or ["data=2,tensor=2,sequence=2" if n == 8 else f"data={n}"]
  cfg = gpt.Config(width=args.width, layers=args.layers, heads=args.heads,
                   head_dim=args.head_dim, dtype=jnp.bfloat16 if args.bf16 else None)
  lead = jax.process_index() == 0
  if lead:
    print(f"{jax.process_count()} process(es), {n} {jax.devices()[0].platform} devices")
    print(f"model {cfg}, batch {args.batch} x {args.length} tokens")
  saved, status, rows = {}, 0, []
  for text in texts:
    sizes, expert = parse_mesh(text, args.expert_axis)
    mesh = gpt.make_mesh(sizes, expert=expert)
    layout = gpt.Layout.of(mesh, expert=expert)
    if lead:
      combine = f", KDA combine {kda_sequence_parallel.ENTERING}" if layout.sequence else ""
      print(f"\nmesh {dict(mesh.shape)}, {layout}{combine}")
    losses, params, tokens_per_s, compiled = train(jax, gpt, cfg, mesh, layout, args,
                                                    "cudnn_jax")
    param_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params))
    hlo = compiled.as_text()
    if os.environ.get("TRAIN_HLO"):
      with open(os.environ["TRAIN_HLO"], "w") as f:
        f.write(hlo)
    measured = collective_bytes(hlo)
    expected = expected_bytes(cfg, layout, mesh, args.batch, args.length, param_bytes)
    if lead:
      print(f"{'collective':20s} {'measured B/step/device':>24s} {'expected':>14s}")
      for kind in KINDS:
        print(f"{kind:20s} {measured[kind]:24,d} {expected[kind]:14,d}")
    rows.append(dict(mesh=text, model="cudnn_jax", tokens_per_s=tokens_per_s,
                     loss_first=float(losses[0]), loss_last=float(losses[-1]),
                     collective_bytes=dict(measured), expected_bytes=dict(expected)))
    if args.baseline and jax.devices()[0].platform == "gpu":
      if layout.sequence or layout.expert:
        print("baseline: data and tensor parallel layouts only")
      else:
        with baseline_ops():
          base_losses, _, base_tokens, _ = train(jax, gpt, cfg, mesh, layout, args,
                                                 "jax.nn + lax.ragged_dot")
        rows.append(dict(mesh=text, model="jax.nn + lax.ragged_dot", tokens_per_s=base_tokens,
                         loss_first=float(base_losses[0]), loss_last=float(base_losses[-1])))
    if args.out:
      # Keys "<mesh>:<parameter path>"; every process takes part in the gather.
      gathered = multihost_utils.process_allgather(params, tiled=True)
      saved[f"{text}:losses"] = losses
      for path, x in jax.tree_util.tree_flatten_with_path(gathered)[0]:
        saved[text + ":" + "/".join(str(getattr(k, "key", k)) for k in path)] = np.asarray(x)
    if lead and not losses[-1] < losses[0]:
      print(f"{text}: loss did not go down", file=sys.stderr)
      status = 1
  if args.out and lead:
    np.savez(args.out, **saved)
  if lead and args.results:
    write_chart(args.results, rows, cfg, args)
  return status


def write_chart(folder, rows, cfg, args):
  """``folder/train.json`` and ``train.png``: tokens/s per mesh, the baseline model (built
  on jax.nn and lax.ragged_dot, measured in the same run) hatched beside ours."""
  sys.path.insert(0, os.path.dirname(__file__))
  from harness import bar_chart, write_results  # pylint: disable=g-import-not-at-top
  path = write_results(folder, "train", rows, model=str(cfg), batch=args.batch,
                       length=args.length, steps=args.steps)
  meshes = list(dict.fromkeys(r["mesh"] for r in rows))
  models = list(dict.fromkeys(r["model"] for r in rows))
  series = {m: [next((r["tokens_per_s"] for r in rows if r["mesh"] == mesh and r["model"] == m),
                     None) for mesh in meshes] for m in models}
  chart = bar_chart(os.path.join(folder, "train.png"), "GPT-style model: training throughput",
                    meshes, series, "tokens/s (higher is better)",
                    anchors=[m for m in models if m != "cudnn_jax"])
  print(f"wrote {path} and {chart}")


if __name__ == "__main__":
  sys.exit(main())
