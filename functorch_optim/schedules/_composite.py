"""Schedules built from the user's callables or from other schedules.

``LambdaLR`` and ``MultiplicativeLR`` (a user's ``epoch -> factor``), ``SequentialLR`` and
``ChainedScheduler`` (other schedules).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functorch_optim.schedules._core import (
    Group,
    Schedule,
    SState,
    _check_count,
    _f,
    _i,
    _n_groups,
    _select,
    _Spec,
    _where,
    python_arithmetic,
)
from functorch_optim.schedules._plateau import _PlateauSchedule

_UNTRACEABLE = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
)


def _describe(fn: Callable) -> str:
    """``name (file:line)`` of a user's callable (a function, a ``functools.partial``, an object)."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    code = getattr(target, "__code__", None) or getattr(type(target).__call__, "__code__", None)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name


class _LambdaLR(_Spec):
    """torch's ``LambdaLR``: ``base_lr * lr_lambda(last_epoch)`` per group.

    ``eager=False`` (the functional schedules): the lambdas are traced with the step
    counter as an integer array of JAX's default int dtype (int64 under x64, so ``e / n``
    is float64 as Python's ``int / int``). ``eager=True`` (the facade's classes): each step
    runs outside jit and calls every group's lambda with a Python int, as torch does.
    """

    name = "LambdaLR"

    def __init__(self, lr_lambdas: list[Callable], per_group: bool, eager: bool = False) -> None:
        self.lr_lambdas = lr_lambdas
        self.per_group = per_group
        self.eager = eager

    def _call(self, fn: Callable, epoch: Any) -> jax.Array:
        if self.eager:
            return _f(fn(int(epoch)))
        try:
            return _f(python_arithmetic(fn, jnp.asarray(epoch, jnp.result_type(int))))
        except _UNTRACEABLE as err:
            raise TypeError(
                f"{self.name}: lr_lambda {_describe(fn)} cannot be traced by JAX "
                f"({type(err).__name__}): functorch_optim.schedules calls it inside jit with a "
                "traced integer step, where Python's `if`, `max()`, `float()` and `int()` need a "
                "concrete value. Write it with jax.numpy (`jnp.where(e < n, a, b)` for `if`, "
                "`jnp.maximum` for `max`, no `float()`), or keep it as it is and use "
                f"functorch_optim.optim.lr_scheduler.{self.name} with the facade, which calls it "
                "with a Python int, as torch does."
            ) from None

    def _factors(self, st: SState, shape: tuple) -> jax.Array:
        e = st["last_epoch"]
        if self.per_group:
            return _f([self._call(fn, e) for fn in self.lr_lambdas]).reshape(shape)
        if self.eager and shape != ():  # torch calls the one lambda once per group
            return _f([self._call(self.lr_lambdas[0], e) for _ in range(shape[0])])
        return self._call(self.lr_lambdas[0], e)

    def check_traceable(self, shape: tuple) -> None:
        """Trace the lambdas once, abstractly, so an untraceable one fails at construction."""
        jax.eval_shape(lambda e: self._factors({"last_epoch": e}, shape), jax.ShapeDtypeStruct((), jnp.int32))

    def get_lr(self, group, st, is_initial):
        return st["base_lrs"] * self._factors(st, jnp.shape(group["lr"])), group


class _MultiplicativeLR(_LambdaLR):
    name = "MultiplicativeLR"

    def get_lr(self, group, st, is_initial):
        if is_initial:
            return group["lr"], group
        return group["lr"] * self._factors(st, jnp.shape(group["lr"])), group


class _Composite(_Spec):
    """A scheduler over others: it cycles momentum when one of them does."""

    def __init__(self, specs: list[_Spec]) -> None:
        self.specs = specs
        self.cycles_momentum = any(s.cycles_momentum for s in specs)

    def construct_subs(self, group: Group) -> tuple[Group, list[SState]]:
        """Build the sub-schedulers in order on the same group, as torch's on one optimizer."""
        states = []
        for spec in self.specs:
            group, st = spec.construct(group)
            states.append(st)
        return group, states


class _ChainedScheduler(_Composite):
    name = "ChainedScheduler"

    def construct(self, group):
        group, states = self.construct_subs(group)
        return group, {"subs": tuple(states)}

    def step(self, group, st, is_initial=False):
        states = []
        for spec, sub in zip(self.specs, st["subs"], strict=True):
            group, sub = spec.step(group, sub)
            states.append(sub)
        return group, {"subs": tuple(states)}

    def undo(self, st):
        return {"subs": tuple(spec.undo(s) for spec, s in zip(self.specs, st["subs"], strict=True))}


class _SequentialLR(_Composite):
    name = "SequentialLR"

    def __init__(self, specs: list[_Spec], milestones: list[int]) -> None:
        super().__init__(specs)
        self.milestones = list(milestones)

    def construct(self, group):
        group, states = self.construct_subs(group)
        group = {**group, "lr": group["initial_lr"]}
        states = [spec.undo(s) for spec, s in zip(self.specs, states, strict=True)]
        idx = bisect.bisect_right(self.milestones, 0)
        group, states[idx] = self.specs[idx].initial_step(group, states[idx])
        return group, {"last_epoch": _i(0), "subs": tuple(states)}

    def step(self, group, st, is_initial=False):
        e = st["last_epoch"] + 1
        ms = jnp.asarray(self.milestones if self.milestones else [2**31 - 1], jnp.int32)
        idx = jnp.searchsorted(ms, e, side="right") if self.milestones else jnp.int32(0)
        groups, states = [], []
        for i, (spec, sub) in enumerate(zip(self.specs, st["subs"], strict=True)):
            g_step, s_step = spec.step(group, sub)
            if i > 0:
                g_reset, s_reset = spec.update_lr(group, sub, 0)
                at = self.milestones[i - 1] == e
                g_step, s_step = _where(at, g_reset, g_step), _where(at, s_reset, s_step)
            groups.append(g_step)
            states.append(_where(idx == i, s_step, sub))
        return _select(idx, groups), {"last_epoch": e, "subs": tuple(states)}

    def undo(self, st):
        return {**st, "subs": tuple(spec.undo(s) for spec, s in zip(self.specs, st["subs"], strict=True))}


class _PerEpoch(_Spec):
    """Another scheduler stepped once every ``steps_per_epoch`` steps: torch's per-epoch loop."""

    def __init__(self, inner: _Spec, steps_per_epoch: int) -> None:
        self.inner, self.steps_per_epoch = inner, steps_per_epoch
        self.name = inner.name
        self.cycles_momentum = inner.cycles_momentum

    def construct(self, group):
        group, st = self.inner.construct(group)
        return group, {"inner": st, "epoch_step": _i(0)}

    def step(self, group, st, is_initial=False):
        k = st["epoch_step"] + 1
        boundary = k == self.steps_per_epoch
        stepped, inner = self.inner.step(group, st["inner"])
        return _where(boundary, stepped, group), {
            "inner": _where(boundary, inner, st["inner"]),
            "epoch_step": jnp.where(boundary, 0, k).astype(jnp.int32),
        }


def _lambda_schedule(lr: Any, lr_lambda: Any, spec: type[_LambdaLR], eager: bool = False) -> Schedule:
    """A LambdaLR/MultiplicativeLR schedule: torch's checks, then (traced) one abstract call."""
    n = _n_groups(lr)
    if not isinstance(lr_lambda, list | tuple):
        fns, per_group = [lr_lambda], False
    else:
        if len(lr_lambda) != n:
            raise ValueError(f"Expected {n} lr_lambdas, but got {len(lr_lambda)}")
        fns, per_group = list(lr_lambda), np.ndim(lr) != 0
    if spec is _MultiplicativeLR:  # torch checks MultiplicativeLR's lambdas only
        for fn in fns:
            if not callable(fn):
                raise TypeError(f"lr_lambda should be a function, but got {type(fn).__name__}")
    sched = Schedule(spec(fns, per_group, eager), lr)
    if not eager:
        sched._spec.check_traceable(jnp.shape(sched._start_lr))
    return sched


def lambda_lr(lr: Any, lr_lambda: Callable | Sequence[Callable]) -> Schedule:
    r"""``torch.optim.lr_scheduler.LambdaLR``: :math:`\eta_t = \eta_0 \cdot \lambda(t)`.

    Args:
      lr: the optimizer's learning rate :math:`\eta_0` (torch's ``base_lrs``); a number
        or one per param group.
      lr_lambda: ``epoch -> factor``, or one per group. Inside jit it receives the step
        as a traced integer array (int64 under x64, so ``e / n`` is float64 like
        Python's), its products and quotients round as Python's (``_core.python_arithmetic``),
        and it must be written with ``jax.numpy``: ``jnp.where(e < n, a, b)``,
        not ``a if e < n else b``; ``jnp.maximum``, not ``max``; no ``float()``. The
        facade's ``functorch_optim.optim.lr_scheduler.LambdaLR`` calls torch-style
        Python lambdas unchanged, with a Python int.

    Returns:
      A :class:`Schedule`.

    Raises:
      ValueError: ``Expected {n} lr_lambdas, but got {m}`` (torch's text).
      TypeError: ``LambdaLR: lr_lambda {name} ({file}:{line}) cannot be traced by JAX
        …``, when a lambda needs a concrete value (raised here, by one abstract call).

    Examples:
      >>> import jax.numpy as jnp, functorch_optim as fo
      >>> fo.schedules.lambda_lr(0.1, lambda e: 0.5**e).values(3).round(4).tolist()
      [0.1, 0.05, 0.025, 0.0125]
      >>> warmup = lambda e: jnp.where(e < 2, e / 2, 1.0)  # not: e / 2 if e < 2 else 1.0
      >>> fo.schedules.lambda_lr(1.0, warmup).values(3).tolist()
      [0.0, 0.5, 1.0, 1.0]
    """
    return _lambda_schedule(lr, lr_lambda, _LambdaLR)


def multiplicative_lr(lr: Any, lr_lambda: Callable | Sequence[Callable]) -> Schedule:
    r"""``torch.optim.lr_scheduler.MultiplicativeLR``: :math:`\eta_t = \eta_{t-1} \lambda(t)`.

    Args:
      lr: the optimizer's learning rate (or one per group).
      lr_lambda: ``epoch -> factor``, or one per group, written with ``jax.numpy`` as
        for :func:`lambda_lr` (the facade's ``MultiplicativeLR`` takes Python lambdas).

    Returns:
      A :class:`Schedule`.

    Raises:
      ValueError: ``Expected {n} lr_lambdas, but got {m}``.
      TypeError: ``lr_lambda should be a function, but got {type}``; ``MultiplicativeLR:
        lr_lambda {name} ({file}:{line}) cannot be traced by JAX …``.

    Examples:
      >>> import functorch_optim as fo
      >>> fo.schedules.multiplicative_lr(1.0, lambda e: 0.5).values(2).tolist()
      [1.0, 0.5, 0.25]
    """
    return _lambda_schedule(lr, lr_lambda, _MultiplicativeLR)


def _check_subs(name: str, schedulers: Sequence[Any], allow_composite: bool) -> tuple[list[_Spec], Any]:
    lr = None
    for i, s in enumerate(schedulers):
        if isinstance(s, _PlateauSchedule):
            raise ValueError(
                f"{name} does not support `ReduceLROnPlateau` scheduler as it "
                "requires additional kwargs to be specified when calling `step`, "
                f"but got one at index {i} in the given schedulers sequence."
            )
        if not isinstance(s, Schedule) or s.key != "lr":
            raise TypeError(
                f"{name} at index {i} should be a learning-rate schedule from "
                f"functorch_optim.schedules, got {type(s).__name__}"
            )
        if isinstance(s._spec, _PerEpoch):
            raise ValueError(
                f"{name} at index {i} is a per_epoch schedule: the schedules of a {name} step "
                f"together, so wrap the whole {name} in per_epoch instead"
            )
        if not allow_composite and isinstance(s._spec, _SequentialLR | _ChainedScheduler):
            raise ValueError(
                f"{name} at index {i} is a {s.name}, which torch cannot restart at a milestone "
                "(it has no get_lr); nest it in a ChainedScheduler instead"
            )
        if s.lr is not None:
            if lr is None:
                lr = s.lr
            elif not np.array_equal(np.asarray(s.lr, np.float64), np.asarray(lr, np.float64)):
                raise ValueError(
                    f"{name} expects all schedulers to belong to the same optimizer, but got scheduler "
                    f"{s.name} at index {i} with lr {s.lr}, which is different from lr {lr}."
                )
    specs = [s._spec for s in schedulers]
    start = lr if lr is not None else schedulers[0]._start_lr
    return specs, start


def sequential_lr(schedulers: Sequence[Schedule], milestones: Sequence[int]) -> Schedule:
    r"""``torch.optim.lr_scheduler.SequentialLR``: switch schedules at milestones.

    At step ``milestones[i]`` schedule ``i + 1`` restarts from its closed form at epoch 0
    (torch's ``_update_lr(0)``); between milestones the active schedule steps. The
    sub-schedules are built in list order on the same learning rate, as torch's are on
    the same optimizer.

    Args:
      schedulers: at least one schedule, all from the same ``lr``.
      milestones: ``len(schedulers) - 1`` increasing step indices.

    Returns:
      A :class:`Schedule`.

    Raises:
      ValueError: torch's texts: ``SequentialLR expects at least one scheduler, but got
        no scheduler.``, ``… does not support `ReduceLROnPlateau` …``, ``Sequential
        Schedulers expects number of schedulers provided to be one more than the number
        of milestone points, …``; schedules from different ``lr``.

    Examples:
      >>> import functorch_optim as fo
      >>> warm = fo.schedules.linear_lr(1.0, start_factor=0.5, total_iters=2)
      >>> decay = fo.schedules.exponential_lr(1.0, gamma=0.5)
      >>> fo.schedules.sequential_lr([warm, decay], milestones=[2]).values(4).tolist()
      [0.5, 0.75, 1.0, 0.5, 0.25]
    """
    name = "SequentialLR"
    if len(schedulers) < 1:
        raise ValueError(f"{name} expects at least one scheduler, but got no scheduler.")
    specs, start = _check_subs(name, schedulers, allow_composite=False)
    if len(milestones) != len(schedulers) - 1:
        raise ValueError(
            "Sequential Schedulers expects number of schedulers provided to be one more "
            f"than the number of milestone points, but got number of schedulers {len(schedulers)} and the "
            f"number of milestones to be equal to {len(milestones)}"
        )
    lr = next((s.lr for s in schedulers if s.lr is not None), None)
    return Schedule(_SequentialLR(specs, [int(m) for m in milestones]), lr, start_lr=start)


def chained_scheduler(schedulers: Sequence[Schedule]) -> Schedule:
    r"""``torch.optim.lr_scheduler.ChainedScheduler``: step every schedule, in order, each step.

    Each schedule's chainable step acts on the value the previous one left, so
    multiplicative schedules compose (``constant_lr`` then ``exponential_lr`` multiply).
    The sub-schedules are built in list order on the same learning rate.

    Args:
      schedulers: at least one schedule, all from the same ``lr``.

    Returns:
      A :class:`Schedule`.

    Raises:
      ValueError: ``ChainedScheduler expects at least one scheduler to be chained, but
        got no scheduler.``; ``… does not support `ReduceLROnPlateau` …``.

    Examples:
      >>> import functorch_optim as fo
      >>> a = fo.schedules.constant_lr(1.0, factor=0.5, total_iters=2)
      >>> b = fo.schedules.exponential_lr(1.0, gamma=0.5)
      >>> fo.schedules.chained_scheduler([a, b]).values(3).tolist()
      [0.5, 0.25, 0.25, 0.125]
    """
    name = "ChainedScheduler"
    if len(schedulers) < 1:
        raise ValueError(f"{name} expects at least one scheduler to be chained, but got no scheduler.")
    specs, start = _check_subs(name, schedulers, allow_composite=True)
    lr = next((s.lr for s in schedulers if s.lr is not None), None)
    return Schedule(_ChainedScheduler(specs), lr, start_lr=start)


def per_epoch(schedule: Schedule, steps_per_epoch: int) -> Schedule:
    r"""A schedule stepped once per epoch of ``steps_per_epoch`` optimizer steps, as torch loops do.

    torch code often steps its scheduler after each epoch, not after each batch::

        for epoch in range(epochs):
            for x, y in loader:            # len(loader) == steps_per_epoch
                ...; opt.step()
            scheduler.step()

    Functional schedules advance once per optimizer step; ``per_epoch(schedule,
    len(loader))`` runs the wrapped scheduler's own ``step()`` once every
    ``steps_per_epoch`` optimizer steps and holds its value in between, so after
    :math:`t` optimizer steps the value is torch's after :math:`\lfloor t /
    \text{steps\_per\_epoch} \rfloor` ``scheduler.step()`` calls, exactly, for every
    scheduler (recursive, cyclic, sequential and chained ones too; ``step_size``,
    ``T_max``, milestones, ... stay in epochs, as in the torch code). Steps here are
    optimizer steps: ``grad_accumulate``'s micro-steps do not count.

    Args:
      schedule: a schedule from ``functorch_optim.schedules`` (its ``momentum``
        companion, when it cycles momentum, is per epoch too: take it from the result).
      steps_per_epoch: optimizer steps per epoch, an integer >= 1 (``len(loader)``;
        an epoch with fewer steps, e.g. a last partial batch the loader does not drop,
        counts the same ``steps_per_epoch``).

    Returns:
      A :class:`Schedule`.

    Raises:
      ValueError: ``steps_per_epoch must be an integer >= 1, got …``; for
        ``reduce_lr_on_plateau``, which moves only with its ``step(state, metric)``
        (call that once per epoch).
      TypeError: for anything but a learning-rate schedule of this module.

    Examples:
      >>> import functorch_optim as fo
      >>> s = fo.schedules.per_epoch(fo.schedules.step_lr(1.0, step_size=1, gamma=0.5), 3)
      >>> s.values(7).tolist()
      [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25]
      >>> tx = fo.sgd(lr=s, momentum=0.9)  # as any schedule
    """
    if isinstance(schedule, _PlateauSchedule):
        raise ValueError(
            "per_epoch: ReduceLROnPlateau moves only with plateau.step(opt_state, metric); call that "
            "once per epoch instead"
        )
    if not isinstance(schedule, Schedule) or schedule.key != "lr":
        raise TypeError(
            "per_epoch takes a schedule from functorch_optim.schedules (the lr schedule, not its "
            f"momentum companion), got {type(schedule).__name__}"
        )
    spec = _PerEpoch(schedule._spec, _check_count("steps_per_epoch", steps_per_epoch))
    return Schedule(spec, schedule.lr, start_lr=schedule._start_lr)
