"""Engine registry: which implementation serves a call, and why the others decline.

Every op has engines registered under the name of the technology that runs them:
"cudnn" (cuDNN graphs), "cute" (our CuTe DSL kernels compiled ahead of time), "triton" /
"mosaic" (our Pallas kernels lowered through Triton / Mosaic GPU), "xla" (pure JAX). An
engine is a ``supports(call) -> str | None`` check over static facts (shapes, dtypes,
flags, backend, GPU generation) that returns ``None`` when it can serve the call and
otherwise the reason, plus ``run(call, *arrays)``. ``implementation=None`` tries engines in preference order and
ends at ``"xla"``, which serves every valid call. An engine registered ``opt_in`` (one not
yet validated on hardware) serves only calls that name it in ``implementation``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax

ENGINE_NAMES = ("cudnn", "cute", "triton", "mosaic", "xla")  # preference order


class UnsupportedError(NotImplementedError):
  """An engine that was asked for explicitly cannot serve the call."""


@dataclasses.dataclass(frozen=True)
class Engine:
  name: str
  supports: Callable[[Any], str | None]
  run: Callable[..., Any]
  opt_in: bool = False
  # call -> how the engine computes it (which kernels, what is fused), for explain()
  describe: Callable[[Any], str] | None = None


@dataclasses.dataclass(frozen=True)
class _Op:
  prepare: Callable[..., Any]  # (*args, **kwargs) -> call description
  engines: dict[str, Engine]
  # call -> (how it runs across devices or None, the call each device's engines serve)
  explained: Callable[[Any], tuple[str | None, Any]] = lambda call: (None, call)


_OPS: dict[str, _Op] = {}


def register_op(op: str, prepare: Callable[..., Any], *, engines_of: str | None = None,
                explained=None) -> None:
  """Declares an op; ``prepare`` validates user arguments into a static call description.
  With ``engines_of``, the op's calls are calls of that op (on rearranged arrays) and share
  its engines, present and future. ``explained(call) -> (how, device_call)``: for a call
  that runs as other calls on each device (context parallelism), how, and the call the
  engines serve there; ``explain`` reports on that one."""
  _OPS[op] = _Op(prepare, _OPS[engines_of].engines if engines_of else {},
                 *(() if explained is None else (explained,)))


def register_engine(op: str, name: str, *, supports, run, opt_in=False, describe=None) -> None:
  if name not in ENGINE_NAMES:
    raise ValueError(f"unknown engine name {name!r}; expected one of {ENGINE_NAMES}")
  _OPS[op].engines[name] = Engine(name, supports, run, opt_in, describe)


def engine(op: str, name: str) -> Engine:
  """The registered engine ``name`` of ``op``."""
  return _OPS[op].engines[name]


def _requested(implementation) -> tuple[tuple[str, ...], bool]:
  """Engine names to try, and whether the user named them explicitly."""
  if implementation is None:
    return ENGINE_NAMES, False
  names = (implementation,) if isinstance(implementation, str) else tuple(implementation)
  if not names:
    raise ValueError("implementation: expected None, an engine name or a non-empty sequence")
  for n in names:
    if n not in ENGINE_NAMES:
      raise ValueError(f"implementation: unknown engine {n!r}; expected one of {ENGINE_NAMES}")
  return names, True


def reasons(op: str, call, explicit: bool = False) -> dict[str, str | None]:
  """Each registered engine's verdict on ``call``: None (can serve) or why not;
  ``explicit``: the engines are named in ``implementation`` (opt-in engines may serve)."""
  return {name: _verdict(_OPS[op].engines.get(name), call, explicit) for name in ENGINE_NAMES}


def _verdict(engine: Engine | None, call, explicit: bool) -> str | None:
  if engine is None:
    return "no such engine for this op"
  if engine.opt_in and not explicit:
    return "opt-in engine: serves only calls that name it in implementation="
  try:
    return engine.supports(call)
  except Exception as e:  # a failing check is a decline, never a crash of the op
    return f"support check failed: {type(e).__name__}: {e}"


def choose(op: str, call, implementation) -> Engine:
  """The first engine of ``implementation`` that serves ``call``, else UnsupportedError."""
  names, explicit = _requested(implementation)
  declined = []
  for name in names:
    engine = _OPS[op].engines.get(name)
    why = _verdict(engine, call, explicit)
    if why is None:
      return engine
    declined.append(f"{name}: {why}")
  if not explicit:  # cannot happen while "xla" accepts every valid call
    raise AssertionError(f"{op}: no engine served the call: " + "; ".join(declined))
  raise UnsupportedError(f"{op}: no requested engine can serve this call: " + "; ".join(declined))


def dispatch(op: str, implementation, call, *arrays):
  return choose(op, call, implementation).run(call, *arrays)


def prepare_abstract(prepare, *args, **kwargs):
  """``prepare(*args, **kwargs)``'s call description, traced on shapes only (arrays may be
  ``jax.ShapeDtypeStruct``s), so nothing runs on a device."""
  leaves, tree = jax.tree.flatten((args, kwargs))
  where = [i for i, x in enumerate(leaves) if hasattr(x, "shape") and hasattr(x, "dtype")]
  calls = []

  def trace(*arrays):
    filled = list(leaves)
    for i, a in zip(where, arrays):
      filled[i] = a
    a, kw = jax.tree.unflatten(tree, filled)
    calls.append(prepare(*a, **kw))

  jax.eval_shape(trace, *[jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype)
                          for i in where])
  return calls[0]


def explain(fn_name: str, *args, **kwargs) -> str:
  """Says which engine would serve ``fn_name(*args, **kwargs)`` and why the others decline.

  Nothing runs on the device: only shapes, dtypes and static arguments are looked at (the
  arrays may be ``jax.ShapeDtypeStruct``s).
  """
  if fn_name not in _OPS:
    raise ValueError(f"fn_name: unknown op {fn_name!r}; known: {sorted(_OPS)}")
  op = _OPS[fn_name]
  implementation = kwargs.get("implementation")
  how, call = op.explained(prepare_abstract(op.prepare, *args, **kwargs))
  verdicts = reasons(fn_name, call, explicit=implementation is not None)
  which = "this call" if how is None else "each device's call"
  try:
    chosen = choose(fn_name, call, implementation).name
    head = f"{fn_name}: engine {chosen!r} serves {which}"
  except UnsupportedError as e:
    chosen, head = None, str(e)
  lines = ([] if how is None else [how]) + [head]
  for name, why in verdicts.items():
    mark = "chosen" if name == chosen else ("can serve" if why is None else f"declines: {why}")
    describe = op.engines[name].describe if why is None else None
    lines.append(f"  {name}: {mark}" + (f" ({describe(call)})" if describe else ""))
  return "\n".join(lines)
