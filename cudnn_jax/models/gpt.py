"""A small GPT-style language model on cudnn_jax's Flax layers, and its sharded training.

Every block is ``x + MultiHeadAttention(rms(x))`` (causal), ``x + KimiDeltaAttention(rms(x))``
and ``x + MoEMLP(rms(x))``; the blocks are stacked under ``jax.lax.scan`` (their weights
along a leading layer axis, one compiled body for every layer) and each is rematerialized
in the backward pass (``jax.checkpoint``), as TPU-style pipelines stack theirs. (Not
``nn.scan``: it traces its body once more to find broadcast variables and refuses the
metadata checks of ``moe_mlp`` inside it, effects that depend on the carry.)

Parallelism comes from one mesh description, its axes named after their roles (``Layout``):

- ``data``: the batch is sharded, the weights replicated (their gradients all-reduced);
- ``tensor``: attention and KDA heads, and their projections, are sharded (the output
  projections' partial sums all-reduced);
- ``sequence``: the tokens are sharded; attention runs as sdpa's context parallelism with
  the "ring" strategy, KDA as its sequence parallelism (``sequence_parallel_axis``), the
  experts on each device's own tokens (``_TokenOrder``);
- ``expert``: the experts' weights are sharded and each device serves its own experts
  (``moe_mlp``'s expert parallelism; that axis is made ``Explicit``). It may name the
  tensor axis (experts and heads on the same devices).

``make_mesh`` builds the mesh, ``Trainer`` the initialization and the jitted training step
with every array's sharding; the same code runs on one device, on the devices of one host
and on several processes (``jax.distributed``), where each process holds only its shards.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from cudnn_jax.flax_modules import KimiDeltaAttention, MoEMLP, MultiHeadAttention

ROLES = ("data", "tensor", "sequence", "expert")


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 64
  width: int = 64
  layers: int = 2
  heads: int = 4
  head_dim: int = 16
  experts: int = 4
  top_k: int = 2
  hidden: int = 64
  dtype: Any = None  # the layers' compute dtype (e.g. jnp.bfloat16); params stay float32
  implementation: Any = None


@dataclasses.dataclass(frozen=True)
class Layout:
  """The mesh axis that serves each parallelism (None: not used)."""
  data: str | None = None
  tensor: str | None = None
  sequence: str | None = None
  expert: str | None = None

  @classmethod
  def of(cls, mesh, expert=None):
    """Axes named after their roles; ``expert`` may name another axis (e.g. "tensor")."""
    roles = {r: r if r in mesh.axis_names else None for r in ROLES}
    if expert is not None:
      roles["expert"] = expert
    return cls(**roles)


def make_mesh(sizes, expert=None, devices=None):
  """A mesh with axes ``sizes`` ({name: devices}, names from ``ROLES``), the expert axis
  (``expert`` or the one named "expert") ``Explicit`` and the others ``Auto``."""
  expert = expert or ("expert" if "expert" in sizes else None)
  kinds = jax.sharding.AxisType
  types = tuple(kinds.Explicit if n == expert else kinds.Auto for n in sizes)
  devices = jax.devices() if devices is None else devices
  return jax.make_mesh(tuple(sizes.values()), tuple(sizes), axis_types=types,
                       devices=devices[:math.prod(sizes.values())])


class Block(nn.Module):
  """Attention, KDA and a mixture of experts, each residual around an RMS norm."""
  cfg: Config
  layout: Layout

  @nn.compact
  def __call__(self, x, _):
    c, seq = self.cfg, self.layout.sequence
    common = dict(dtype=c.dtype, implementation=c.implementation)
    norm = lambda name: nn.RMSNorm(dtype=c.dtype, name=name)
    attention = MultiHeadAttention(c.heads, c.head_dim, is_causal=True,
                                   context_parallel_axis=seq,
                                   context_parallel_strategy="ring", name="attention", **common)
    x = x + attention(norm("attention_norm")(x))
    kda = KimiDeltaAttention(c.heads, c.head_dim, sequence_parallel_axis=seq, name="kda",
                             **common)
    x = x + kda(norm("kda_norm")(x))[0]
    moe = MoEMLP(c.experts, c.top_k, c.hidden, name="moe", **common)
    tokens = _TokenOrder(self.layout, x.shape)
    y = tokens.restore(moe(tokens.flat(norm("moe_norm")(x))))
    return x + y.astype(x.dtype), None


class _TokenOrder:
  """``[B, T, D]`` <-> ``[B T, D]`` with each device's tokens contiguous: the batch and the
  sequence split into (their mesh axis' shards, the rest) and the shards' dims put first.
  The experts see every token once in any order; a plain reshape would interleave the
  sequence shards and make the compiler gather the tokens along the sequence axis."""

  def __init__(self, layout, shape):
    mesh = jax.sharding.get_abstract_mesh()
    size = lambda axis: mesh.shape[axis] if axis and axis in mesh.axis_names else 1
    self.d, self.s, self.shape = size(layout.data), size(layout.sequence), shape

  def flat(self, x):
    (b, t, w), d, s = self.shape, self.d, self.s
    x = x.reshape(d, b // d, s, t // s, w).transpose(0, 2, 1, 3, 4)
    return x.reshape(b * t, w)

  def restore(self, y):
    (b, t, w), d, s = self.shape, self.d, self.s
    y = y.reshape(d, s, b // d, t // s, w).transpose(0, 2, 1, 3, 4)
    return y.reshape(b, t, w)


class GPT(nn.Module):
  """``tokens [B, T]`` int32 -> next-token logits ``[B, T, vocab]`` float32."""
  cfg: Config
  layout: Layout = Layout()

  @nn.compact
  def __call__(self, tokens):
    c = self.cfg
    x = nn.Embed(c.vocab, c.width, name="embed")(tokens)
    if c.dtype is not None:
      x = x.astype(c.dtype)
    block = Block(c, self.layout)
    init = lambda key: jax.vmap(lambda k: block.init(k, x, None)["params"])(
        jax.random.split(key, c.layers))
    # Every block's weights along a leading axis. Read back as they are when applying
    # (flax's param would trace init again to check their shapes, on the current mesh).
    stacked = (self.param("blocks", init) if self.is_initializing()
               else self.variables["params"]["blocks"])
    layer = jax.checkpoint(lambda x, p: block.apply({"params": p}, x, None))
    x, _ = jax.lax.scan(layer, x, stacked)
    x = nn.RMSNorm(name="final_norm")(x.astype(jnp.float32))
    return nn.Dense(c.vocab, use_bias=False, name="unembed")(x)


# Weight shardings by name: (the parameter's path ends with, its spec after the layer axis).
# Heads' projections shard their head dimension on the tensor axis; experts on the expert axis.
_SPECS = (
    (("attention", "query", "kernel"), (None, "tensor", None)),
    (("attention", "key", "kernel"), (None, "tensor", None)),
    (("attention", "value", "kernel"), (None, "tensor", None)),
    (("attention", "query", "bias"), ("tensor", None)),
    (("attention", "key", "bias"), ("tensor", None)),
    (("attention", "value", "bias"), ("tensor", None)),
    (("attention", "out", "kernel"), ("tensor", None, None)),
    (("kda", "o_proj", "kernel"), ("tensor", None)),
    (("kda", "a_log"), ("tensor",)),
    (("kda", "dt_bias"), ("tensor",)),
    (("kda", "kernel"), (None, "tensor")),  # q/k/v/g/b/o_gate projections
    (("moe", "w_up"), ("expert", None, None)),
    (("moe", "w_down"), ("expert", None, None)),
)


def param_spec(path, ndim, layout: Layout):
  """The PartitionSpec of the parameter at ``path`` (its names) with ``ndim`` dims."""
  names = [n for n in path if n != "params"]
  for suffix, spec in _SPECS:
    if names[-1] == suffix[-1] and all(s in names for s in suffix[:-1]):
      if "blocks" in names:
        spec = (None,) + spec  # the layer axis
      if len(spec) == ndim:
        return P(*(getattr(layout, s) if s else None for s in spec))
  return P()


# Parameters whose gradient is zero in exact arithmetic, kept at their initial values: the
# attention key projection's bias adds ``q . bias`` to every logit of a query's row, which
# the softmax ignores. Its computed gradient is rounding noise (about 1e-8 where the other
# biases' are 0.1) whose signs follow the order of the reductions, and Adam's
# normalization would turn that noise into full-size steps (runs that sum in another order,
# e.g. one process and two, would then drift apart by the learning rate per step).
_FROZEN = (("attention", "key", "bias"),)


def _frozen(names):
  return any(names[-len(f):] == f for f in _FROZEN)


def synthetic_batch(seed, batch, length, vocab):
  """``(inputs, targets) [batch, length]`` int32: arithmetic sequences modulo ``vocab``,
  each with its own start and step, so the next token follows from the context."""
  rng = np.random.default_rng(seed)
  start = rng.integers(0, vocab, (batch, 1))
  step = rng.integers(1, 8, (batch, 1))
  seq = (start + step * np.arange(length + 1)) % vocab
  return seq[:, :-1].astype(np.int32), seq[:, 1:].astype(np.int32)


def process_local(global_array, sharding):
  """``jax.make_array_from_process_local_data`` over this process's slab of
  ``global_array`` (NumPy): the box its devices' shards cover. Each process puts only
  its own data on its devices (a real loader would read only that slab)."""
  index = sharding.addressable_devices_indices_map(global_array.shape).values()
  box = tuple(slice(min(i[d].start or 0 for i in index),
                    max(global_array.shape[d] if i[d].stop is None else i[d].stop
                        for i in index))
              for d in range(global_array.ndim))
  return jax.make_array_from_process_local_data(sharding, global_array[box],
                                                global_array.shape)


def cross_entropy(logits, targets):
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))


class Trainer:
  """The model on ``mesh``: ``init(seed)`` -> sharded state, ``step(state, inputs,
  targets)`` -> (state, loss), jitted with every sharding fixed."""

  def __init__(self, cfg: Config, mesh, layout: Layout, learning_rate=3e-3):
    self.cfg, self.mesh, self.layout = cfg, mesh, layout
    self.model = GPT(cfg, layout)
    self.optimizer = optax.adam(learning_rate)
    self.tokens = NamedSharding(mesh, P(layout.data, layout.sequence))
    example = jnp.zeros((1, 8), jnp.int32)
    abstract = jax.eval_shape(lambda: self._fresh(jax.random.key(0), example))
    self.state_sharding = jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, param_spec(_names(path), x.ndim, layout)),
        abstract)
    self._init = jax.jit(self._fresh, out_shardings=self.state_sharding)
    self._step = jax.jit(self._train_step, donate_argnums=(0,),
                         out_shardings=(self.state_sharding, NamedSharding(mesh, P())))

  def _fresh(self, key, example):
    # The weights do not depend on the layout: initialized without any parallelism.
    params = GPT(self.cfg).init(key, example)["params"]
    return params, self.optimizer.init(params)

  def init(self, seed=0):
    """(params, optimizer state), each array sharded as ``state_sharding`` says."""
    return self._init(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))

  def loss(self, params, inputs, targets):
    return cross_entropy(self.model.apply({"params": params}, inputs), targets)

  def _train_step(self, state, inputs, targets):
    params, opt_state = state
    loss, grads = jax.value_and_grad(self.loss)(params, inputs, targets)
    grads = jax.tree_util.tree_map_with_path(
        lambda path, g: jnp.zeros_like(g) if _frozen(_names(path)) else g, grads)
    updates, opt_state = self.optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  def batch(self, inputs, targets):
    """Global NumPy batches -> arrays sharded over (data, sequence), each process
    placing only its own slab."""
    return process_local(inputs, self.tokens), process_local(targets, self.tokens)

  def step(self, state, inputs, targets):
    with jax.set_mesh(self.mesh):
      return self._step(state, inputs, targets)

  def lower(self, state, inputs, targets):
    with jax.set_mesh(self.mesh):
      return self._step.lower(state, inputs, targets)


def _names(path):
  return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
