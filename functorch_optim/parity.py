"""The parity report: every optimizer of the registry, over its config grid, against torch.

``python -m functorch_optim parity`` (or the console script ``functorch-optim parity``)
runs each ``OptimizerSpec`` of ``functorch_optim._registry.OPTIMIZERS`` over every
configuration of its ``grid`` on a fixed random gradient stream over a matrix, a vector
and a 0-d parameter (``--quick``: a few configurations that together cover every value
of every argument, on the matrix alone), in float64 and in float32, next to
``torch.optim`` (``foreach=False``, the reference loop), and prints:

1. config, steps, the largest relative error of params and state over all steps in
   float64 and float32, and a verdict (``match`` within the tolerances of
   ``functorch_optim.testing.DEFAULT_RTOL``);
2. beside each row, optax's closest construction on the same steps (float64) and how
   far it lands from torch, so the reason for this package is visible in numbers.

When ``functorch_optim.schedules`` exists, every scheduler of ``SCHEDULER_GRID`` it
provides is compared with ``torch.optim.lr_scheduler`` as well: the learning rate after
0, 1, ..., ``steps`` scheduler steps, in float64. The exit status is 1 when any row
mismatches or errors, else 0.

A ``SCHEDULERS`` registry in ``functorch_optim.schedules``, if it appears, replaces
``SCHEDULER_GRID``; its entries are read duck-typed: ``name``, ``torch_name`` (the class
in ``torch.optim.lr_scheduler``), ``grid`` (keyword configurations valid for both), and
``factory(lr, **config)`` returning a schedule with ``values(n)`` or a ``count -> lr``
callable; or a ``parity(config, steps) -> (ours, torch)`` method returning both
learning-rate sequences.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import json
import math
import os
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from functorch_optim._base import step as _fo_step
from functorch_optim._hyperparams import HParams
from functorch_optim._registry import OPTIMIZERS, OptimizerSpec
from functorch_optim.testing import (
    DEFAULT_RTOL,
    _FoRunner,
    _GradFeed,
    _run,
    _TorchRunner,
    compare_with_torch,
)

__all__ = [
    "OPTAX_CLOSEST",
    "SCHEDULER_GRID",
    "ParityResult",
    "ParityRow",
    "ProgramCount",
    "SchedulerSpec",
    "default_workers",
    "format_report",
    "optax_closest",
    "param_shapes",
    "quick_configs",
    "run_parity",
]

#: The parameter tree of every row: a matrix, a vector and a 0-d scalar, nested
#: (``--quick``: its first leaf; an ``OptimizerSpec`` with ``shapes`` uses its own).
PARAM_SHAPES = {"layer": {"w": (3, 4), "b": (4,)}, "scale": ()}
FULL_STEPS = 50
QUICK_STEPS = 20
#: Steps of a closure-driven optimizer (LBFGS: each step runs up to ``max_iter`` iterations).
CLOSURE_STEPS = 5
SEED = 0

# --------------------------------------------------------------------------- optax


def _betas(config: Mapping[str, Any]) -> tuple[float, float]:
    b1, b2 = config.get("betas", (0.9, 0.999))
    return float(b1), float(b2)


def _with_prefix(config: Mapping[str, Any], text: str, tx: Any, l2: bool = True) -> tuple[str, Any]:
    """Prepend torch's ``maximize`` (negate) and L2 ``weight_decay`` (``g + wd p``) stages."""
    parts, stages = [], []
    if config.get("maximize", False):
        parts.append("optax.scale(-1.0)")
        stages.append(optax.scale(-1.0))
    wd = float(config.get("weight_decay", 0.0))
    if l2 and wd:
        parts.append(f"optax.add_decayed_weights({wd:g})")
        stages.append(optax.add_decayed_weights(wd))
    if not stages:
        return text, tx
    if text.startswith("optax.chain(") and text.endswith(")"):
        text = text[len("optax.chain(") : -1]  # one flat chain in the text
    return f"optax.chain({', '.join([*parts, text])})", optax.chain(*stages, tx)


def _sgd(c):
    lr, mom = float(c.get("lr", 1e-3)), float(c.get("momentum", 0.0))
    nesterov = bool(c.get("nesterov", False))
    text = (
        f"optax.sgd({lr:g}" + (f", momentum={mom:g}" if mom else "") + (", nesterov=True" if nesterov else "")
    )
    text += ")"
    return _with_prefix(c, text, optax.sgd(lr, momentum=mom or None, nesterov=nesterov))


def _adam(c):
    lr, (b1, b2), eps = float(c.get("lr", 1e-3)), _betas(c), float(c.get("eps", 1e-8))
    wd = float(c.get("weight_decay", 0.0))
    decoupled = bool(c.get("decoupled_weight_decay", False))
    if c.get("amsgrad", False):
        core = optax.scale_by_amsgrad(b1, b2, eps)
        if decoupled and wd:
            text = (
                f"optax.chain(optax.scale_by_amsgrad({b1:g}, {b2:g}, {eps:g}), "
                f"optax.add_decayed_weights({wd:g}), optax.scale(-{lr:g}))"
            )
            return _with_prefix(
                c, text, optax.chain(core, optax.add_decayed_weights(wd), optax.scale(-lr)), l2=False
            )
        return _with_prefix(
            c, f"optax.amsgrad({lr:g}, {b1:g}, {b2:g}, {eps:g})", optax.amsgrad(lr, b1, b2, eps)
        )
    if decoupled:
        return _with_prefix(
            c,
            f"optax.adamw({lr:g}, {b1:g}, {b2:g}, {eps:g}, weight_decay={wd:g})",
            optax.adamw(lr, b1, b2, eps, weight_decay=wd),
            l2=False,
        )
    return _with_prefix(c, f"optax.adam({lr:g}, {b1:g}, {b2:g}, {eps:g})", optax.adam(lr, b1, b2, eps))


def _adamw(c):
    return _adam({"weight_decay": 1e-2, **c, "decoupled_weight_decay": True})


def _adagrad(c):
    lr, decay = float(c.get("lr", 1e-2)), float(c.get("lr_decay", 0.0))
    iav, eps = float(c.get("initial_accumulator_value", 0.0)), float(c.get("eps", 1e-10))
    if decay:
        lr_arg = lambda count: lr / (1 + count * decay)
        lr_text = f"lambda t: {lr:g} / (1 + t * {decay:g})"
    else:
        lr_arg, lr_text = lr, f"{lr:g}"
    text = f"optax.adagrad({lr_text}, initial_accumulator_value={iav:g}, eps={eps:g})"
    return _with_prefix(c, text, optax.adagrad(lr_arg, initial_accumulator_value=iav, eps=eps))


def _rmsprop(c):
    lr, alpha, eps = float(c.get("lr", 1e-2)), float(c.get("alpha", 0.99)), float(c.get("eps", 1e-8))
    mom, centered = float(c.get("momentum", 0.0)), bool(c.get("centered", False))
    text = f"optax.rmsprop({lr:g}, decay={alpha:g}, eps={eps:g}, eps_in_sqrt=False"
    text += (f", momentum={mom:g}" if mom else "") + (", centered=True" if centered else "") + ")"
    tx = optax.rmsprop(lr, decay=alpha, eps=eps, eps_in_sqrt=False, centered=centered, momentum=mom or None)
    return _with_prefix(c, text, tx)


def _adadelta(c):
    lr, rho, eps = float(c.get("lr", 1.0)), float(c.get("rho", 0.9)), float(c.get("eps", 1e-6))
    return _with_prefix(
        c, f"optax.adadelta({lr:g}, rho={rho:g}, eps={eps:g})", optax.adadelta(lr, rho=rho, eps=eps)
    )


def _adamax(c):
    lr, (b1, b2), eps = float(c.get("lr", 2e-3)), _betas(c), float(c.get("eps", 1e-8))
    return _with_prefix(c, f"optax.adamax({lr:g}, {b1:g}, {b2:g}, {eps:g})", optax.adamax(lr, b1, b2, eps))


def _nadam(c):
    lr, (b1, b2), eps = float(c.get("lr", 2e-3)), _betas(c), float(c.get("eps", 1e-8))
    wd = float(c.get("weight_decay", 0.0))
    if c.get("decoupled_weight_decay", False):
        text = f"optax.nadamw({lr:g}, {b1:g}, {b2:g}, {eps:g}, weight_decay={wd:g})"
        return _with_prefix(c, text, optax.nadamw(lr, b1, b2, eps, weight_decay=wd), l2=False)
    return _with_prefix(c, f"optax.nadam({lr:g}, {b1:g}, {b2:g}, {eps:g})", optax.nadam(lr, b1, b2, eps))


def _radam(c):
    lr, (b1, b2), eps = float(c.get("lr", 1e-3)), _betas(c), float(c.get("eps", 1e-8))
    wd = float(c.get("weight_decay", 0.0))
    if c.get("decoupled_weight_decay", False) and wd:
        text = (
            f"optax.chain(optax.scale_by_radam({b1:g}, {b2:g}, {eps:g}), "
            f"optax.add_decayed_weights({wd:g}), optax.scale(-{lr:g}))"
        )
        tx = optax.chain(optax.scale_by_radam(b1, b2, eps), optax.add_decayed_weights(wd), optax.scale(-lr))
        return _with_prefix(c, text, tx, l2=False)
    return _with_prefix(c, f"optax.radam({lr:g}, {b1:g}, {b2:g}, {eps:g})", optax.radam(lr, b1, b2, eps))


def _rprop(c):
    lr = float(c.get("lr", 1e-2))
    em, ep = (float(x) for x in c.get("etas", (0.5, 1.2)))
    smin, smax = (float(x) for x in c.get("step_sizes", (1e-6, 50.0)))
    text = (
        f"optax.rprop({lr:g}, eta_minus={em:g}, eta_plus={ep:g}, "
        f"min_step_size={smin:g}, max_step_size={smax:g})"
    )
    return _with_prefix(c, text, optax.rprop(lr, em, ep, smin, smax), l2=False)


def _asgd(c):
    # optax has no averaged SGD: the closest is SGD with lambd as decoupled shrinkage
    lr, lambd = float(c.get("lr", 1e-2)), float(c.get("lambd", 1e-4))
    text = f"optax.chain(optax.add_decayed_weights({lambd:g}), optax.sgd({lr:g}))"
    return _with_prefix(c, text, optax.chain(optax.add_decayed_weights(lambd), optax.sgd(lr)))


OPTAX_CLOSEST: dict[str, Callable[[Mapping[str, Any]], tuple[str, Any]]] = {
    "SGD": _sgd,
    "Adam": _adam,
    "AdamW": _adamw,
    "Adagrad": _adagrad,
    "RMSprop": _rmsprop,
    "Adadelta": _adadelta,
    "Adamax": _adamax,
    "NAdam": _nadam,
    "RAdam": _radam,
    "Rprop": _rprop,
    "ASGD": _asgd,
}
"""torch class name -> ``config -> (text, optax transformation)``: optax's closest
construction of the same optimizer. A registry spec may carry its own ``optax_closest``
attribute (same signature), which takes precedence."""


def optax_closest(spec: OptimizerSpec, config: Mapping[str, Any]) -> tuple[str, Any] | None:
    """optax's closest construction of ``spec`` with ``config``, as ``(text, transformation)``.

    Args:
      spec: a registry entry.
      config: torch keyword arguments.

    Returns:
      ``(text, tx)``, or ``None`` when optax has nothing comparable (LBFGS, ...).

    Examples:
      >>> from functorch_optim._registry import get_spec
      >>> from functorch_optim.parity import optax_closest
      >>> optax_closest(get_spec("SGD"), {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.05})[0]
      'optax.chain(optax.add_decayed_weights(0.05), optax.sgd(0.1, momentum=0.9))'
    """
    build = getattr(spec, "optax_closest", None) or OPTAX_CLOSEST.get(spec.torch_name)
    return None if build is None else build(config)


# --------------------------------------------------------------------------- configs


def quick_configs(grid: Sequence[Mapping[str, Any]], limit: int = 3) -> list[dict[str, Any]]:
    """A few configurations of ``grid`` that together show every value of every argument.

    Greedy: the first configuration, then repeatedly the one that adds the most
    (argument, value) pairs not yet seen (ties: the one with more non-zero, non-False
    values, so that arguments act together), until all are seen or ``limit`` are taken.

    Args:
      grid: the full configuration grid.
      limit: the most configurations to take, default 3.

    Returns:
      The chosen configurations, in grid order.

    Examples:
      >>> from functorch_optim.parity import quick_configs
      >>> quick_configs([{"a": 1, "b": 1}, {"a": 1, "b": 2}, {"a": 2, "b": 2}])
      [{'a': 1, 'b': 1}, {'a': 2, 'b': 2}]
    """
    grid = [dict(c) for c in grid]
    if not grid:
        return []

    def pairs(c):
        return {(k, repr(v)) for k, v in c.items()}

    wanted = set().union(*(pairs(c) for c in grid))
    chosen = [0]
    seen = pairs(grid[0])
    while seen != wanted and len(chosen) < limit:
        best = max(range(len(grid)), key=lambda i: (len(pairs(grid[i]) - seen), _active(grid[i]), -i))
        if not pairs(grid[best]) - seen:
            break
        chosen.append(best)
        seen |= pairs(grid[best])
    return [grid[i] for i in sorted(chosen)]


def _active(config: Mapping[str, Any]) -> int:
    return sum(bool(v) for v in config.values())


def _torch_defaults(torch_name: str) -> dict[str, Any]:
    import inspect

    try:
        import torch

        cls = getattr(torch.optim, torch_name, None) or getattr(torch.optim.lr_scheduler, torch_name)
        params = inspect.signature(cls).parameters.values()
    except (ImportError, AttributeError, TypeError, ValueError):
        return {}
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def _short_config(name: str, config: Mapping[str, Any]) -> str:
    """The arguments that differ from torch's defaults, as ``k=v`` text."""
    defaults = _torch_defaults(name)
    shown = {k: v for k, v in config.items() if k not in defaults or defaults[k] != v}
    return ", ".join(f"{k}={getattr(v, '__name__', v)}" for k, v in shown.items()) or "(defaults)"


# --------------------------------------------------------------------------- rows


@dataclasses.dataclass
class ParityRow:
    """One row of the report.

    Attributes:
      kind: ``"optimizer"`` or ``"scheduler"``.
      name: torch's class name.
      config: the keyword arguments.
      steps: the number of steps compared.
      rel_f64: the largest relative error in float64 (params and state; lrs for a
        scheduler), or ``None`` if not run.
      rel_f32: the same in float32 (``None`` for schedulers).
      verdict: ``"match"``, ``"MISMATCH"`` or ``"ERROR"``.
      error: the exception text of an ``ERROR`` row.
      optax: optax's closest construction as text (``None``: none exists).
      optax_rel_f64: how far optax lands from torch (params, float64).
      seconds: wall time of the row.
    """

    kind: str
    name: str
    config: dict[str, Any]
    steps: int
    rel_f64: float | None = None
    rel_f32: float | None = None
    verdict: str = "match"
    error: str | None = None
    optax: str | None = None
    optax_rel_f64: float | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether the row matches torch."""
        return self.verdict == "match"

    def to_dict(self) -> dict[str, Any]:
        """The row as JSON-ready data."""
        out = dataclasses.asdict(self)
        out["config"] = _jsonable(self.config)
        for key in ("rel_f64", "rel_f32", "optax_rel_f64"):
            if out[key] is not None and not math.isfinite(out[key]):
                out[key] = str(out[key])
        return out


@dataclasses.dataclass
class ParityResult:
    """All rows of one report, with what produced them.

    Attributes:
      rows: optimizer rows first (registry order), then scheduler rows.
      steps: steps per row.
      quick: whether the quick subset ran.
      rtol: the tolerances by dtype name.
      versions: torch, jax, optax, functorch_optim versions.
      seconds: total wall time.
      workers: the threads that ran the rows.
      compiled: XLA programs compiled while the rows ran (steps, and the single
        operations that run op by op); ``None`` where not counted.
      cache_loaded: XLA programs loaded from the persistent compilation cache instead.
    """

    rows: list[ParityRow]
    steps: int
    quick: bool
    rtol: dict[str, float]
    versions: dict[str, str]
    seconds: float = 0.0
    workers: int = 1
    compiled: int | None = None
    cache_loaded: int = 0

    @property
    def ok(self) -> bool:
        """Whether every row matches torch."""
        return all(r.ok for r in self.rows)

    def summary(self) -> dict[str, int]:
        """Row counts: total, match, mismatch, error, and optax rows within tolerance."""
        opt_rows = [r for r in self.rows if r.optax_rel_f64 is not None]
        return {
            "rows": len(self.rows),
            "match": sum(r.verdict == "match" for r in self.rows),
            "mismatch": sum(r.verdict == "MISMATCH" for r in self.rows),
            "error": sum(r.verdict == "ERROR" for r in self.rows),
            "optax_rows": len(opt_rows),
            "optax_exact": sum(r.optax_rel_f64 <= self.rtol["float64"] for r in opt_rows),
        }

    def to_dict(self) -> dict[str, Any]:
        """The whole report as JSON-ready data."""
        return {
            "ok": self.ok,
            "steps": self.steps,
            "quick": self.quick,
            "rtol": self.rtol,
            "versions": self.versions,
            "seconds": self.seconds,
            "workers": self.workers,
            "compiled": self.compiled,
            "cache_loaded": self.cache_loaded,
            "summary": self.summary(),
            "rows": [r.to_dict() for r in self.rows],
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if callable(value):
        return getattr(value, "__name__", repr(value))
    return value


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def param_shapes(spec: Any = None, quick: bool = False) -> Any:
    """The parameter shapes of ``spec``'s rows: its ``shapes``, else ``PARAM_SHAPES``.

    ``quick`` keeps only the first leaf of that (nested dict) tree: one parameter tensor
    per row, so a quick report compiles one parameter's rule per step where the full
    report compiles one per shape (most of a cold report is XLA compiling steps).

    Args:
      spec: an ``OptimizerSpec`` (its ``shapes``, if any), default None: the default tree.
      quick: keep the first leaf only, default False.

    Returns:
      A nested dict of shape tuples, as ``PARAM_SHAPES``.

    Examples:
      >>> from functorch_optim.parity import param_shapes
      >>> param_shapes(quick=True)
      {'layer': {'w': (3, 4)}}
    """
    shapes = getattr(spec, "shapes", None)
    shapes = PARAM_SHAPES if shapes is None else shapes
    if not quick:
        return shapes
    first = shapes
    keys = []
    while not _is_shape(first):
        keys.append(next(iter(first)))
        first = first[keys[-1]]
    for key in reversed(keys):
        first = {key: first}
    return first


def _stream(steps: int, dtype: Any, shapes: Any = None) -> tuple[Any, list[Any]]:
    """Random initial params and ``steps`` gradient trees (seed ``SEED``) of ``shapes``."""
    rng = np.random.default_rng(SEED)
    shapes = PARAM_SHAPES if shapes is None else shapes

    def draw(_):
        return jax.tree.map(lambda s: rng.standard_normal(s).astype(dtype), shapes, is_leaf=_is_shape)

    params = draw(None)
    return params, [draw(None) for _ in range(steps)]


def _quartic(params: Any, batch: Any) -> Any:
    """``sum 0.5 a (p - c)^2 + 0.25 (p - c)^4``: the loss of closure-driven rows (JAX)."""
    terms = jax.tree.map(
        lambda p, a, c: jnp.sum(0.5 * a * (p - c) ** 2 + 0.25 * (p - c) ** 4), params, batch["a"], batch["c"]
    )
    return sum(jax.tree.leaves(terms))


def _torch_quartic(params: Any, batch: Any) -> Any:
    """``_quartic`` in torch, for torch's ``closure()``."""
    terms = jax.tree.map(
        lambda p, a, c: (0.5 * a * (p - c) ** 2 + 0.25 * (p - c) ** 4).sum(), params, batch["a"], batch["c"]
    )
    return sum(jax.tree.leaves(terms))


def _closure_problem(params: Any, dtype: Any) -> dict[str, Any]:
    rng = np.random.default_rng(SEED + 1)
    return {
        "a": jax.tree.map(lambda p: rng.uniform(0.5, 2.0, np.shape(p)).astype(dtype), params),
        "c": jax.tree.map(lambda p: rng.standard_normal(np.shape(p)).astype(dtype), params),
    }


class _OptaxRunner:
    """optax's side of one row, op by op: where ``_OptaxSteps``' program fails, so that
    the error shows on the row that causes it."""

    def __init__(self, tx: Any, params: Any):
        self.params = jax.tree.map(jnp.asarray, params)
        self.state = tx.init(self.params)
        self.step_fn = functools.partial(_optax_step, tx)

    def step(self, grads: Any) -> None:
        grads = jax.tree.map(jnp.asarray, grads)
        self.params, self.state = self.step_fn(self.params, grads, self.state)

    def buffers(self) -> dict[str, Any]:
        return {}


def _step_program(tx: Any) -> Callable:
    """``tx``'s jitted step, ``(params, grads, state) -> (params, state)``.

    Named ``parity_step`` in XLA's compile log and in ``_count_programs``.
    """

    def parity_step(params, grads, state):
        return _fo_step(tx, params, grads, state)

    return jax.jit(parity_step)


class _StepCache:
    """Compiled steps shared by configurations that differ only in numeric values.

    Numeric hyperparameters live in the state (``HParams``), so two configurations with
    the same structure (same static flags, same buffers) have states of one tree
    structure and one compiled step serves both — exactly what ``set_hparams`` relies
    on. Transformations whose state holds no ``HParams`` are compiled per config.
    """

    def __init__(self):
        self.fns: dict[Any, Callable] = {}

    def runner(self, spec: OptimizerSpec, config: Mapping[str, Any], params: Any) -> _FoRunner:
        runner = _FoRunner(spec, config, params)
        has_hparams = any(
            isinstance(x, HParams)
            for x in jax.tree.leaves(runner.state, is_leaf=lambda x: isinstance(x, HParams))
        )
        if not has_hparams:
            runner.step_fn = _step_program(runner.tx)
            return runner
        key = (spec.name, jax.tree.structure(runner.state))
        if key not in self.fns:
            self.fns[key] = _step_program(runner.tx)
        runner.step_fn = self.fns[key]
        return runner


class _Replay:
    """functorch_optim's side of one row, computed ahead: the state after each step.

    ``_run`` drives it like a ``_FoRunner``: ``step`` moves to the next precomputed
    params and state (computed from the same gradients ``_run`` feeds).
    """

    def __init__(self, params: Any, state: Any, after: list[tuple[Any, Any]]):
        self.params, self.state = params, state
        self._after = after
        self._t = 0

    def step(self, grads: Any) -> None:
        self.params, self.state = self._after[self._t]
        self._t += 1

    def buffers(self) -> Mapping[str, Any]:
        return getattr(self.state, "buffers", {})


class _BatchedSteps:
    """The steps of all rows of one optimizer, in one compiled program.

    XLA compiles one program with many small steps in much less time than as many
    programs with one step each (each program costs its own passes, code generation and
    loading: 50 steps of ten optimizers, 8.2 s of CPU time as one program and 12.8 s as
    50). The program takes one slot per distinct step (state structure and dtypes: the
    configurations that ``_StepCache`` would share one step between share a slot, each
    slot computed with the first of its configurations' transformation, the others'
    numbers being data in their state) and returns every slot's next params and state;
    the rows of a slot take turns, a pass of ``steps`` calls each. ``runner`` hands each
    (configuration, dtype) its precomputed trajectory.

    A configuration that fails to build is reported by its own row; if the program
    itself fails, every row falls back to its own compiled step (``_StepCache``), so an
    error shows on the row that causes it.
    """

    def __init__(
        self, spec: OptimizerSpec, configs: Sequence[Mapping[str, Any]], steps: int, shapes: Any = None
    ):
        self.spec, self.configs, self.steps = spec, [dict(c) for c in configs], steps
        self.shapes = param_shapes(spec) if shapes is None else shapes
        self._runners: dict[tuple[int, str], Any] | None = None
        self._fallback: _StepCache | None = None
        #: the (configuration index, dtype name) rows of each slot, once computed
        self.slots: list[list[tuple[int, str]]] = []

    def runner(self, spec: OptimizerSpec, config: Mapping[str, Any], params: Any) -> Any:
        if self._fallback is not None:
            return self._fallback.runner(spec, config, params)
        if self._runners is None:
            try:
                self._runners = self._compute()
            except Exception:  # attribute the failure to its row: each row on its own step
                self._fallback = _StepCache()
                return self._fallback.runner(spec, config, params)
        dtype = str(np.result_type(*jax.tree.leaves(params)))
        found = self._runners[(self.configs.index(dict(config)), dtype)]
        if isinstance(found, Exception):
            raise found
        return found

    def _compute(self) -> dict[tuple[int, str], Any]:
        shapes = self.shapes
        out: dict[tuple[int, str], Any] = {}
        members: dict[tuple[int, str], tuple[_FoRunner, list[Any]]] = {}
        slots: dict[Any, list[tuple[int, str]]] = {}
        for i, config in enumerate(self.configs):
            for dtype in (np.float64, np.float32):
                name = np.dtype(dtype).name
                params, grads = _stream(self.steps, dtype, shapes)
                try:
                    runner = _FoRunner(self.spec, config, params)
                except Exception as exc:  # reported by the row
                    out[(i, name)] = exc
                    continue
                members[(i, name)] = (runner, grads)
                slots.setdefault(_slot_key(runner, (i, name), grads), []).append((i, name))
        self.slots = list(slots.values())
        if not slots:
            return out
        firsts = [members[slot[0]][0].tx for slot in slots.values()]

        def parity_steps(args):
            return [_fo_step(tx, p, g, s) for tx, (p, g, s) in zip(firsts, args, strict=True)]

        program = jax.jit(parity_steps)
        for j in range(max(len(slot) for slot in slots.values())):
            # a slot without a j-th row computes its first row again, unread
            chosen = [slot[j] if j < len(slot) else slot[0] for slot in slots.values()]
            real = [j < len(slot) for slot in slots.values()]
            carry = [(members[m][0].params, members[m][0].state) for m in chosen]
            after: list[list[tuple[Any, Any]]] = [[] for _ in chosen]
            for t in range(self.steps):
                args = [(p, members[m][1][t], st) for m, (p, st) in zip(chosen, carry, strict=True)]
                carry = [tuple(x) for x in program(args)]
                for k, x in enumerate(carry):
                    after[k].append(x)
            for m, is_real, trajectory in zip(chosen, real, after, strict=True):
                if is_real:
                    runner = members[m][0]
                    out[m] = _Replay(runner.params, runner.state, trajectory)
        return out


def _slot_key(runner: _FoRunner, member: Any, grads: list[Any]) -> Any:
    """Equal for two rows that one compiled step serves (``member``: unique otherwise)."""
    has_hparams = any(
        isinstance(x, HParams)
        for x in jax.tree.leaves(runner.state, is_leaf=lambda x: isinstance(x, HParams))
    )
    if not has_hparams:
        return ("own", member)
    tree = (runner.params, grads[0], runner.state)
    avals = tuple(
        (np.shape(x), str(x.dtype), bool(getattr(x, "weak_type", False))) for x in jax.tree.leaves(tree)
    )
    return (jax.tree.structure(tree), avals)


class _OptaxSteps:
    """optax's side of all rows of one optimizer: every row's closest construction
    stepped in one compiled program (float64, the rows' shared gradient stream), as
    ``_BatchedSteps`` does for functorch_optim's side.

    ``runner(config)`` gives ``(text, runner)`` for ``_run`` (a ``_Replay``), or ``None``
    where optax has nothing comparable; a construction that fails raises on its own
    row. If the program itself fails, every row steps on its own (``_OptaxRunner``), so
    an error shows on the row that causes it.
    """

    def __init__(
        self, spec: OptimizerSpec, configs: Sequence[Mapping[str, Any]], steps: int, shapes: Any = None
    ):
        self.spec, self.configs, self.steps = spec, [dict(c) for c in configs], steps
        self.shapes = param_shapes(spec) if shapes is None else shapes
        self._rows: dict[int, Any] | None = None

    def runner(self, config: Mapping[str, Any]) -> tuple[str, Any] | None:
        if self._rows is None:
            self._rows = self._compute()
        found = self._rows[self.configs.index(dict(config))]
        if isinstance(found, Exception):
            raise found
        return found

    def _compute(self) -> dict[int, Any]:
        shapes = self.shapes
        out: dict[int, Any] = {}
        members: dict[int, tuple[str, Any, Any, Any]] = {}
        grads: list[Any] = []
        for i, config in enumerate(self.configs):
            try:
                built = optax_closest(self.spec, config)
                if built is None:
                    out[i] = None
                    continue
                params, grads = _stream(self.steps, np.float64, shapes)
                params = jax.tree.map(jnp.asarray, params)
                members[i] = (built[0], built[1], params, built[1].init(params))
            except Exception as exc:  # reported by the row
                out[i] = exc
        if not members:
            return out
        txs = [tx for _, tx, _, _ in members.values()]

        def optax_steps(carry, g):
            return [_optax_step(tx, p, g, s) for tx, (p, s) in zip(txs, carry, strict=True)]

        try:
            program = jax.jit(optax_steps)
            carry = [(p, s) for _, _, p, s in members.values()]
            after: list[list[tuple[Any, Any]]] = [[] for _ in carry]
            for t in range(self.steps):
                carry = [tuple(x) for x in program(carry, jax.tree.map(jnp.asarray, grads[t]))]
                for k, x in enumerate(carry):
                    after[k].append(x)
        except Exception:  # attribute the failure to its row: each row on its own
            for i, (text, tx, params, _) in members.items():
                out[i] = (text, _OptaxRunner(tx, params))
            return out
        for (i, (text, _, params, state)), trajectory in zip(members.items(), after, strict=True):
            out[i] = (text, _Replay(params, state, trajectory))
        return out


def _optax_step(tx: Any, params: Any, grads: Any, state: Any) -> tuple[Any, Any]:
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


class ProgramCount:
    """XLA programs built while ``_count_programs`` was open, by jitted function name.

    Attributes:
      built: name (``"jit(parity_step)"``, ``"jit(multiply)"`` for an operation run op
        by op) -> how many programs were built: compiled or loaded from the cache.
      loaded: how many of them came from XLA's persistent compilation cache.
    """

    def __init__(self) -> None:
        self.built: collections.Counter[str] = collections.Counter()
        self.loaded = 0

    @property
    def compiled(self) -> int:
        """Programs compiled (built, less those loaded from the cache)."""
        return sum(self.built.values()) - self.loaded


_COUNTERS: list[ProgramCount] = []
_COUNT_LOCK = threading.Lock()
_LISTENING: list[bool] = []
_BUILD_EVENT = "/jax/core/compile/backend_compile_duration"  # compiled or loaded from the cache
_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def _on_duration(event: str, duration: float, **kwargs: Any) -> None:
    if event == _BUILD_EVENT:
        name = str(kwargs.get("fun_name", "?"))
        with _COUNT_LOCK:
            for counter in _COUNTERS:
                counter.built[name] += 1


def _on_event(event: str, **kwargs: Any) -> None:
    if event == _HIT_EVENT:
        with _COUNT_LOCK:
            for counter in _COUNTERS:
                counter.loaded += 1


@contextlib.contextmanager
def _count_programs() -> Iterator[ProgramCount]:
    """Count the XLA programs this process builds inside the block (any thread)."""
    with _COUNT_LOCK:
        if not _LISTENING:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            jax.monitoring.register_event_listener(_on_event)
            _LISTENING.append(True)
        counter = ProgramCount()
        _COUNTERS.append(counter)
    try:
        yield counter
    finally:
        with _COUNT_LOCK:
            _COUNTERS.remove(counter)


def _optimizer_row(spec, config, steps, cache, optax_steps, rtol, shapes=None) -> ParityRow:
    shapes = param_shapes(spec) if shapes is None else shapes
    closure = bool(getattr(spec, "closure", False))
    if closure:
        steps = min(steps, CLOSURE_STEPS)
    row = ParityRow("optimizer", spec.torch_name, dict(config), steps)
    t0 = time.perf_counter()
    try:
        rels = {}
        for dtype in (np.float64, np.float32):
            params, grads = _stream(steps, dtype, shapes)
            if closure:
                # closure-driven (LBFGS): each step minimises a fixed smooth loss; params only
                batch = _closure_problem(params, dtype)
                report = compare_with_torch(
                    spec,
                    params,
                    loss_fn=_quartic,
                    data=[batch] * steps,
                    torch_loss_fn=_torch_quartic,
                    buffers=(),
                    **config,
                )
            else:
                report = _run(
                    spec,
                    config,
                    np.dtype(dtype).name,
                    cache.runner(spec, config, params),
                    _TorchRunner(spec, config, params),
                    _GradFeed(grads),
                    spec.buffers,
                )
            rels[np.dtype(dtype).name] = report.max_rel
        row.rel_f64, row.rel_f32 = rels["float64"], rels["float32"]
        bad = not (row.rel_f64 <= rtol["float64"] and row.rel_f32 <= rtol["float32"])
        row.verdict = "MISMATCH" if bad else "match"
    except Exception as exc:  # a row that cannot run is reported, never hides the others
        row.verdict, row.error = "ERROR", f"{type(exc).__name__}: {exc}"
    if optax_steps is not None:
        try:
            built = optax_steps.runner(config)
            if built is not None:
                row.optax, runner = built
                params, grads = _stream(steps, np.float64, shapes)
                report = _run(
                    spec, config, "float64", runner, _TorchRunner(spec, config, params), _GradFeed(grads), ()
                )
                row.optax_rel_f64 = report.max_rel
        except Exception as exc:  # optax's side is informative only
            row.optax = f"{row.optax or 'optax'} (failed: {type(exc).__name__}: {exc})"
    row.seconds = time.perf_counter() - t0
    return row


# --------------------------------------------------------------------------- schedulers


def _exp_decay(epoch: Any) -> Any:
    """``0.95 ** epoch``: the multiplier of the ``LambdaLR`` rows."""
    return 0.95**epoch


@dataclasses.dataclass(frozen=True)
class SchedulerSpec:
    """One scheduler row source: torch's class, this package's factory, a config grid.

    Attributes:
      torch_name: the class in ``torch.optim.lr_scheduler``.
      factory: ``factory(lr, **config)`` returning a schedule with ``values(n)`` (the
        values after 0..n steps) or a plain ``count -> value`` callable.
      grid: keyword configurations valid for both.
    """

    torch_name: str
    factory: Callable[..., Any]
    grid: tuple[Mapping[str, Any], ...]

    @property
    def name(self) -> str:
        """The factory's name (``"step_lr"``)."""
        return getattr(self.factory, "__name__", self.torch_name)


SCHEDULER_GRID: dict[str, tuple[str, tuple[dict[str, Any], ...]]] = {
    "StepLR": ("step_lr", ({"step_size": 3, "gamma": 0.5}, {"step_size": 7})),
    "MultiStepLR": ("multi_step_lr", ({"milestones": [3, 8, 12], "gamma": 0.3},)),
    "ConstantLR": ("constant_lr", ({}, {"factor": 0.5, "total_iters": 8})),
    "LinearLR": ("linear_lr", ({}, {"start_factor": 0.1, "end_factor": 0.9, "total_iters": 10})),
    "ExponentialLR": ("exponential_lr", ({"gamma": 0.9},)),
    "PolynomialLR": ("polynomial_lr", ({}, {"total_iters": 10, "power": 2.0})),
    "CosineAnnealingLR": ("cosine_annealing_lr", ({"T_max": 10}, {"T_max": 7, "eta_min": 0.01})),
    "CosineAnnealingWarmRestarts": (
        "cosine_annealing_warm_restarts",
        ({"T_0": 5}, {"T_0": 3, "T_mult": 2, "eta_min": 0.001}),
    ),
    "CyclicLR": (
        "cyclic_lr",
        (
            {"base_lr": 0.01, "max_lr": 0.1, "step_size_up": 4},
            {"base_lr": 0.01, "max_lr": 0.1, "step_size_up": 3, "mode": "triangular2"},
            {"base_lr": 0.01, "max_lr": 0.1, "step_size_up": 5, "mode": "exp_range", "gamma": 0.9},
        ),
    ),
    "OneCycleLR": (
        "one_cycle_lr",
        (
            {"max_lr": 0.5, "total_steps": 60},
            {
                "max_lr": 0.5,
                "total_steps": 60,
                "pct_start": 0.25,
                "anneal_strategy": "linear",
                "three_phase": True,
            },
        ),
    ),
    "LambdaLR": ("lambda_lr", ({"lr_lambda": _exp_decay},)),
}
"""torch scheduler class -> (factory name in ``functorch_optim.schedules``, config grid).

Used when ``functorch_optim.schedules`` has no ``SCHEDULERS`` registry of its own.
``ReduceLROnPlateau`` (metric-driven), ``SequentialLR`` and ``ChainedScheduler`` (built
from other schedulers) and ``SWALR`` are left to the schedules' own tests."""


def _scheduler_specs() -> list[Any]:
    try:
        module = importlib.import_module("functorch_optim.schedules")
    except ImportError:
        return []
    registry = getattr(module, "SCHEDULERS", None)
    if registry is not None:
        return list(registry)
    out = []
    for torch_name, (factory_name, grid) in SCHEDULER_GRID.items():
        factory = getattr(module, factory_name, None)
        if factory is not None:
            out.append(SchedulerSpec(torch_name, factory, grid))
    return out


def _torch_lrs(torch_name: str, config: Mapping[str, Any], base_lr: float, steps: int) -> list[float]:
    import torch

    p = torch.zeros(1, requires_grad=True)
    # momentum > 0: the cycling schedulers (CyclicLR, OneCycleLR) need it by default
    opt = torch.optim.SGD([p], lr=base_lr, momentum=0.9)
    sched = getattr(torch.optim.lr_scheduler, torch_name)(opt, **config)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(steps):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


def _build_schedule(factory: Callable[..., Any], base_lr: float, config: Mapping[str, Any]) -> Any:
    """``factory`` with torch's optimizer lr as ``lr`` (positional first, or keyword)."""
    import inspect

    params = inspect.signature(factory).parameters
    if "lr" not in params:
        return factory(**config)
    first = next(iter(params))
    if first == "lr" and params["lr"].kind is not inspect.Parameter.KEYWORD_ONLY:
        return factory(base_lr, **config)
    return factory(**config, lr=base_lr)


def _scheduler_rows(work, steps, rtol, done) -> list[ParityRow]:
    """The scheduler rows of ``work`` (``(spec, config)`` pairs), in order.

    The schedules of ``functorch_optim.schedules`` take their steps in one compiled
    program (``schedules._core.values_of``: a scan each), where ``values`` compiles one
    per row; the same numbers. Anything else (a ``parity`` method, another ``values``,
    a plain callable), and every row if that program fails, runs on its own.
    """
    from functorch_optim.schedules._core import Schedule, values_of

    built: dict[int, Any] = {}
    for i, (spec, config) in enumerate(work):
        if hasattr(spec, "parity"):
            continue
        try:
            schedule = _build_schedule(spec.factory, float(getattr(spec, "base_lr", 0.1)), config)
        except Exception:  # reported by its row
            continue
        if getattr(type(schedule), "values", None) is Schedule.values:
            built[i] = schedule
    try:
        ours = dict(zip(built, values_of(list(built.values()), steps), strict=True))
    except Exception:  # attribute the failure to its row: each row on its own
        ours = {}
    rows = []
    for i, (spec, config) in enumerate(work):
        rows.append(_scheduler_row(spec, config, steps, rtol, ours.get(i)))
        done(spec.torch_name)
    return rows


def _scheduler_row(spec, config, steps, rtol, ours=None) -> ParityRow:
    """One scheduler row; ``ours``: our learning rates, computed already (else here)."""
    row = ParityRow("scheduler", spec.torch_name, dict(config), steps)
    t0 = time.perf_counter()
    try:
        if hasattr(spec, "parity"):
            ours, ref = spec.parity(dict(config), steps)
        else:
            base_lr = float(getattr(spec, "base_lr", 0.1))
            if ours is None:
                schedule = _build_schedule(spec.factory, base_lr, config)
                if hasattr(schedule, "values"):
                    ours = np.asarray(schedule.values(steps), np.float64).reshape(-1)
                else:
                    ours = [float(schedule(jnp.asarray(t))) for t in range(steps + 1)]
            else:
                ours = np.asarray(ours, np.float64).reshape(-1)
            ref = _torch_lrs(spec.torch_name, config, base_lr, steps)
        a, b = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
        row.rel_f64 = float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-300))
        row.verdict = "match" if row.rel_f64 <= rtol["float64"] else "MISMATCH"
    except Exception as exc:
        row.verdict, row.error = "ERROR", f"{type(exc).__name__}: {exc}"
    row.seconds = time.perf_counter() - t0
    return row


# --------------------------------------------------------------------------- driver


def _versions() -> dict[str, str]:
    import functorch_optim

    out = {"functorch_optim": functorch_optim.__version__, "jax": jax.__version__, "optax": optax.__version__}
    try:
        import torch

        out["torch"] = torch.__version__
    except ImportError:
        out["torch"] = "missing"
    return out


def run_parity(
    *,
    quick: bool = False,
    only: Sequence[str] | None = None,
    steps: int | None = None,
    with_optax: bool = True,
    progress: bool = True,
    rtol: Mapping[str, float] | None = None,
    workers: int | None = None,
) -> ParityResult:
    """Run the parity report and return its rows.

    torch runs on one thread meanwhile (its tensors here have a few elements; a second
    thread only waits for a busy core), restored afterwards.

    The rows run on ``workers`` threads, one optimizer (all its rows, which share
    compiled steps) or all scheduler rows (one program) at a time each: most of a cold
    report is XLA compiling steps, which releases Python's lock, so one thread compiles
    while another runs torch and compares. Every row computes the same numbers on any number of
    threads; the rows come back in registry order.

    Args:
      quick: run ``quick_configs`` of each grid, ``QUICK_STEPS`` steps and one parameter
        (``param_shapes(spec, quick=True)``) instead of the whole grid, ``FULL_STEPS``
        steps and the whole parameter tree, default False.
      only: restrict to these optimizers/schedulers (factory or torch names), default all.
      steps: override the number of steps.
      with_optax: also run optax's closest constructions, default True.
      progress: show a progress bar on stderr (tqdm), default True.
      rtol: tolerances by dtype name, default ``testing.DEFAULT_RTOL``.
      workers: threads running the rows, default ``default_workers()`` (the CPUs this
        process may use, at most 8); 1 runs every row in the calling thread.

    Returns:
      A ``ParityResult``; ``result.ok`` is False if any row mismatches or errors.

    Raises:
      ValueError: if ``only`` names nothing known, ``workers`` is not an integer >= 1,
        or ``jax_enable_x64`` is off.
      ImportError: if torch is not installed.
    """
    if importlib.util.find_spec("torch") is None:  # fail early, with the hint's error
        raise ModuleNotFoundError("No module named 'torch'", name="torch")
    workers = default_workers() if workers is None else workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    if not jax.config.jax_enable_x64:
        raise ValueError('the parity report needs jax_enable_x64: jax.config.update("jax_enable_x64", True)')
    rtol = dict(DEFAULT_RTOL if rtol is None else rtol)
    steps = steps or (QUICK_STEPS if quick else FULL_STEPS)
    specs = list(OPTIMIZERS)
    scheds = _scheduler_specs()
    if only:
        wanted = {n.lower() for n in only}
        specs = [s for s in specs if {s.name.lower(), s.torch_name.lower()} & wanted]
        scheds = [s for s in scheds if {str(s.name).lower(), str(s.torch_name).lower()} & wanted]
        if not specs and not scheds:
            known = ", ".join([s.name for s in OPTIMIZERS] + [s.name for s in _scheduler_specs()])
            raise ValueError(f"--only {', '.join(only)}: nothing by these names; known: {known}")
    tasks: list[tuple[Any, list[dict[str, Any]]]] = []
    for spec in specs:
        # a closure-driven optimizer compiles a whole minimisation per step: fewer quick rows
        limit = 2 if getattr(spec, "closure", False) else 3
        tasks.append((spec, quick_configs(spec.grid, limit) if quick else [dict(c) for c in spec.grid]))
    sched_work = []
    for spec in scheds:
        grid = list(getattr(spec, "grid", ({},)))
        configs = quick_configs(grid, limit=2) if quick else [dict(c) for c in grid]
        sched_work += [(spec, c) for c in configs]

    # torch imports (~2 s, and torch._dynamo at the first optimizer built, ~2 s more) on
    # a thread of their own while the first rows trace and compile functorch_optim's side
    preload = threading.Thread(target=_import_torch, name="parity-torch", daemon=True)
    preload.start()
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the bar is a convenience: run without it
        progress = False

        def tqdm(*args, **kwargs):
            return _NoBar()

    t0 = time.perf_counter()
    total = sum(len(c) for _, c in tasks) + len(sched_work)
    bar = tqdm(total=total, disable=not progress, file=sys.stderr, unit="row", desc="parity")
    bar_lock = threading.Lock()

    def done(name: str) -> None:
        with bar_lock:
            bar.set_postfix_str(name, refresh=False)
            bar.update()

    def optimizer_rows(spec: Any, configs: list[dict[str, Any]]) -> list[ParityRow]:
        # an optimizer's rows run in one compiled program (closure-driven: a step each)
        shapes = param_shapes(spec, quick)
        cache = _StepCache() if _is_closure(spec) else _BatchedSteps(spec, configs, steps, shapes)
        optax_side = _OptaxSteps(spec, configs, steps, shapes) if with_optax else None
        out = []
        for config in configs:
            out.append(_optimizer_row(spec, config, steps, cache, optax_side, rtol, shapes))
            done(spec.torch_name)
        return out

    jobs = [functools.partial(optimizer_rows, spec, configs) for spec, configs in tasks]
    if sched_work:  # every scheduler row in one job: their steps are one compiled program
        jobs.append(functools.partial(_scheduler_rows, sched_work, steps, rtol, done))

    # the largest first (a closure-driven optimizer compiles a whole minimisation per
    # step; then the schedulers), so that no thread is left with a long job while the
    # others idle at the end
    def rank(i: int) -> int:
        if i >= len(tasks):
            return 1
        return 0 if _is_closure(tasks[i][0]) else 2

    order = sorted(range(len(jobs)), key=rank)
    with _torch_threads(1), _count_programs() as programs:
        if workers == 1:
            results = {i: jobs[i]() for i in order}
        else:
            with ThreadPoolExecutor(workers, thread_name_prefix="parity") as pool:
                futures = {i: pool.submit(jobs[i]) for i in order}
                results = {i: f.result() for i, f in futures.items()}
    bar.close()
    preload.join()
    rows = [row for i in range(len(jobs)) for row in results[i]]
    return ParityResult(
        rows,
        steps,
        quick,
        rtol,
        _versions(),
        time.perf_counter() - t0,
        workers=workers,
        compiled=programs.compiled,
        cache_loaded=programs.loaded,
    )


def _import_torch() -> None:
    """Import what the rows' torch side imports: torch, and the ``torch._dynamo`` that
    ``torch.optim.Optimizer()`` imports when the first one is built. A failure is left
    to the rows' own imports to report."""
    try:
        import torch._dynamo
        import torch.optim  # noqa: F401
    except Exception:  # reported where the rows import it
        pass


def _is_closure(spec: Any) -> bool:
    return bool(getattr(spec, "closure", False))


def default_workers() -> int:
    """The threads ``run_parity`` uses by default: the CPUs this process may run on, 1 to 8.

    Returns:
      ``len(os.sched_getaffinity(0))`` (``os.cpu_count()`` where that is missing),
      clamped to 1..8: more threads than cores only wait for Python's lock.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8))


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """Run torch on ``n`` threads inside the block, as many as before afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _NoBar:
    def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        pass

    def update(self, *args: Any) -> None:
        pass

    def close(self) -> None:
        pass


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    return f"{x:.2e}"


def _table(header: Sequence[str], body: Sequence[Sequence[str]], right: Sequence[int] = ()) -> list[str]:
    """Aligned columns (those in ``right`` flush right), a dashed rule under the header."""
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)]

    def line(cells):
        out = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(out).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in body)]


def format_report(result: ParityResult, *, wide: bool = False, width: int = 100) -> str:
    """The report as text: a summary line per optimizer, or every row with ``wide``.

    The default fits ``width`` columns: for each optimizer (and scheduler) its row count,
    how many match, the largest errors, how often optax's closest construction lands on
    torch, and the configuration with the largest error (relative to its tolerance);
    every row that mismatches or errors is listed in full below. ``wide`` prints the
    tables of every row instead (torch parity, then optax beside torch).

    Args:
      result: what ``run_parity`` returned.
      wide: one line per row, as wide as the configurations need, default False.
      width: the column limit of the default report (wrapped text), default 100.

    Returns:
      The report, ending with a one-line summary.
    """
    v = result.versions
    rows = result.rows
    intro = (
        f"{result.steps} steps of random gradients on params {param_shapes(quick=result.quick)} "
        f"(seed {SEED}); "
        f"max relative error over all steps of params and state; configurations show the "
        f"arguments that differ from torch's defaults; tolerance "
        f"{result.rtol['float64']:g} (float64), {result.rtol['float32']:g} (float32)"
        + ("; quick subset" if result.quick else "")
    )
    lines = [
        f"functorch_optim {v['functorch_optim']} vs torch {v['torch']} (foreach=False); jax {v['jax']}, "
        f"optax {v['optax']}",
        *(textwrap.wrap(intro, width) if not wide else [intro]),
        "",
    ]
    lines += (_wide_tables if wide else _summary_tables)(result, width)
    bad = [r for r in rows if not r.ok]
    if bad:
        lines += ["", "rows that do not match torch:"]
    for r in bad:
        text = f"{r.verdict} {r.name}({_short_config(r.name, r.config)})"
        text += f": {r.error}" if r.error else f": max rel err f64 {_num(r.rel_f64)}, f32 {_num(r.rel_f32)}"
        lines += [text] if wide else textwrap.wrap(text, width, subsequent_indent="    ")
    s = result.summary()
    summary = (
        f"{s['match']}/{s['rows']} rows match torch ({s['mismatch']} mismatch, {s['error']} error); "
        f"optax's closest construction matches torch in {s['optax_exact']}/{s['optax_rows']}; "
        f"{result.seconds:.1f} s"
    )
    if result.compiled is not None:
        threads = "1 thread" if result.workers == 1 else f"{result.workers} threads"
        summary += (
            f" on {threads}; XLA programs: {result.compiled} compiled, "
            f"{result.cache_loaded} loaded from the compilation cache"
        )
    lines += ["", *([summary] if wide else textwrap.wrap(summary, width))]
    return "\n".join(lines)


def _badness(row: ParityRow, rtol: Mapping[str, float]) -> float:
    """How far a row is from failing: its errors over their tolerances (inf: not run)."""
    if row.rel_f64 is None:
        return math.inf
    f32 = 0.0 if row.rel_f32 is None else row.rel_f32 / rtol["float32"]
    return max(row.rel_f64 / rtol["float64"], f32)


def _largest(values: Sequence[float | None]) -> float | None:
    known = [x for x in values if x is not None]
    return max(known) if known else None


def _summary_tables(result: ParityResult, width: int) -> list[str]:
    """One line per optimizer and per scheduler, each followed by its worst configuration."""
    groups: dict[tuple[str, str], list[ParityRow]] = {}
    for r in result.rows:
        groups.setdefault((r.kind, r.name), []).append(r)
    lines: list[str] = []
    for kind in ("optimizer", "scheduler"):
        named = [(name, rs) for (k, name), rs in groups.items() if k == kind]
        if not named:
            continue
        body, worst = [], []
        for name, rs in named:
            cells = [name, str(len(rs)), str(sum(r.ok for r in rs)), _num(_largest([r.rel_f64 for r in rs]))]
            if kind == "optimizer":
                cells.append(_num(_largest([r.rel_f32 for r in rs])))
                with_optax = [r for r in rs if r.optax_rel_f64 is not None]
                same = sum(r.optax_rel_f64 <= result.rtol["float64"] for r in with_optax)
                cells += [
                    f"{same}/{len(with_optax)}" if with_optax else "-",
                    _num(_largest([r.optax_rel_f64 for r in with_optax])),
                ]
            body.append(cells)
            worst.append(max(rs, key=lambda r: _badness(r, result.rtol)))
        if kind == "optimizer":
            header = ["optimizer", "rows", "match", "max f64", "max f32", "optax = torch", "optax max"]
        else:
            lines += [
                "",
                "learning-rate schedulers vs torch.optim.lr_scheduler (lr after each step, float64)",
            ]
            header = ["scheduler", "rows", "match", "max rel err"]
        table = _table(header, body, right=range(1, len(header)))
        lines += table[:2]
        for line, w in zip(table[2:], worst, strict=True):
            lines.append(line)
            lines += textwrap.wrap(
                f"worst: {_short_config(w.name, w.config)}",
                width,
                initial_indent="  ",
                subsequent_indent="    ",
            )
    if groups:
        lines += [
            "",
            "max f64 / f32: the largest relative error from torch; optax = torch: rows where optax's "
            "closest construction lands within the float64 tolerance (optax max: its largest error); "
            "worst: the configuration farthest from torch relative to the tolerance. "
            "--wide: every row; --json: all numbers.",
        ]
        lines[-1:] = textwrap.wrap(lines[-1], width)
    return lines


def _wide_tables(result: ParityResult, width: int) -> list[str]:
    """Every row: torch parity, schedulers, then optax's closest construction beside torch."""
    rows = result.rows
    lines: list[str] = []
    opt_rows = [r for r in rows if r.kind == "optimizer"]
    sched_rows = [r for r in rows if r.kind == "scheduler"]
    body = [
        [r.name, _short_config(r.name, r.config), str(r.steps), _num(r.rel_f64), _num(r.rel_f32), r.verdict]
        for r in opt_rows
    ]
    lines += _table(["optimizer", "config", "steps", "max rel err f64", "max rel err f32", "verdict"], body)
    if sched_rows:
        lines += [
            "",
            "learning-rate schedulers vs torch.optim.lr_scheduler (lr after each step, float64)",
            "",
        ]
        body = [
            [r.name, _short_config(r.name, r.config), str(r.steps), _num(r.rel_f64), r.verdict]
            for r in sched_rows
        ]
        lines += _table(["scheduler", "config", "steps", "max rel err", "verdict"], body)
    if any(r.optax is not None for r in opt_rows):
        lines += ["", "optax's closest construction on the same steps (float64, params only)", ""]
        body = [
            [
                r.name,
                _short_config(r.name, r.config),
                r.optax or "(none in optax)",
                _num(r.optax_rel_f64),
                "-"
                if r.optax_rel_f64 is None
                else ("same as torch" if r.optax_rel_f64 <= result.rtol["float64"] else "differs"),
            ]
            for r in opt_rows
        ]
        lines += _table(["optimizer", "config", "optax construction", "max rel err f64", "vs torch"], body)
    return lines


# --------------------------------------------------------------------------- CLI


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``parity`` subcommand on an ``argparse`` subparsers object."""
    p = subparsers.add_parser(
        "parity",
        help="compare every optimizer (and scheduler) with torch; exit 1 on any mismatch",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--quick", action="store_true", help="a few configs per optimizer, fewer steps, one parameter"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.add_argument("--wide", action="store_true", help="every row in full (lines as wide as the configs)")
    p.add_argument("--only", nargs="+", metavar="NAME", help="only these optimizers/schedulers")
    p.add_argument("--steps", type=int, default=None, help="steps per row (default 50, quick 20)")
    p.add_argument("--no-optax", action="store_true", help="skip optax's closest constructions")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="threads running the rows (default: the CPUs available, at most 8; 1: no threads)",
    )
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="compile every step afresh (default: XLA's persistent compilation cache in "
        "$FUNCTORCH_OPTIM_CACHE/xla, default ~/.cache/functorch_optim/xla)",
    )
    p.set_defaults(func=cli)
    return p


def cli(args: argparse.Namespace) -> int:
    """Run the ``parity`` subcommand; returns the exit status (1 on any mismatch)."""
    jax.config.update("jax_enable_x64", True)
    if not args.no_cache:
        _enable_compilation_cache()
    try:
        result = run_parity(
            quick=args.quick,
            only=args.only,
            steps=args.steps,
            with_optax=not args.no_optax,
            progress=not args.no_progress,
            workers=args.workers,
        )
    except ValueError as exc:
        print(f"functorch-optim parity: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_report(result, wide=args.wide))
    return 0 if result.ok else 1


def _enable_compilation_cache() -> str:
    """Turn on XLA's persistent compilation cache, unless one is configured already.

    Most of a report's time is XLA compiling the steps of its configurations (each a
    different program); the cache keeps the compiled programs on disk, keyed by the
    program, jaxlib's version and the compiler options, so a later run loads what an
    earlier one compiled. The same programs run either way.

    Returns:
      The cache directory: ``jax_compilation_cache_dir`` when set, else
      ``$FUNCTORCH_OPTIM_CACHE/xla`` (default ``~/.cache/functorch_optim/xla``).
    """
    if not jax.config.jax_compilation_cache_dir:
        root = Path(os.environ.get("FUNCTORCH_OPTIM_CACHE", Path.home() / ".cache" / "functorch_optim"))
        jax.config.update("jax_compilation_cache_dir", str(root / "xla"))
        # a step compiles in well under the default threshold of one second
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return jax.config.jax_compilation_cache_dir
