r"""torch's learning-rate schedulers as pure, jit-compatible schedules with torch's numbers.

Each factory here mirrors one class of ``torch.optim.lr_scheduler`` (and
``torch.optim.swa_utils.SWALR``) with the optimizer argument replaced by ``lr``, the
learning rate the optimizer was built with (torch's ``group["lr"]`` when the scheduler is
constructed). The result is a :class:`Schedule`, passed where an optimizer takes a
hyperparameter::

    tx = fo.sgd(lr=fo.schedules.cosine_annealing_lr(0.1, T_max=100), momentum=0.9)

The value then lives in the optimizer state and advances once per optimizer step (never
per ``grad_accumulate`` micro-step); ``fo.get_hparams(state)["lr"]`` is the value the next
step uses, i.e. torch's ``scheduler.get_last_lr()`` after as many ``scheduler.step()``
calls as optimizer steps taken.

How torch's numbers are reproduced:

* The schedule carries torch's scheduler state (``last_epoch``, ``_step_count``,
  ``base_lrs``, ``T_cur``, ...) and the scheduler's view of the param group (``lr``,
  ``initial_lr``, ``momentum``, ``max_lr``, ...) in the optimizer state, and each step
  runs torch's *chainable* ``get_lr`` on the current value, as torch does — so
  recursive forms (``CosineAnnealingLR`` past ``T_max``, ``PolynomialLR``), chains and
  sequences round exactly like torch.
* Arithmetic copies torch's Python expressions operation by operation in float64 (under
  x64). XLA rewrites a division by a constant into a multiplication by its reciprocal,
  which is not IEEE-exact; divisions here go through an optimization barrier to keep
  them true divisions.
* ``lr`` may be a sequence of per-group learning rates: the schedule then computes one
  value per group (an array), like torch's ``param_groups``. An optimizer hyperparameter
  takes a scalar schedule (one schedule per param group).

Momentum cycling: ``cyclic_lr`` and ``one_cycle_lr`` (and chains/sequences holding them)
cycle momentum with ``cycle_momentum=True`` (torch's default). Pass the companion
schedule ``sched.momentum`` as ``momentum=`` (SGD, RMSprop) or as beta1,
``betas=(sched.momentum, 0.999)`` (Adam family); an optimizer built with such an ``lr``
schedule but without the companion raises, as torch would otherwise change momentum
behind the optimizer's back.

``reduce_lr_on_plateau`` is driven by a metric: ``state = plateau.step(state, metric)``
is a pure function that updates the lr held in the optimizer state.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from functorch_optim._hyperparams import HParams, hparam_dtype
from functorch_optim._tree import PyTree

__all__ = [
    "PlateauState",
    "Schedule",
    "chained_scheduler",
    "constant_lr",
    "cosine_annealing_lr",
    "cosine_annealing_warm_restarts",
    "cyclic_lr",
    "exponential_lr",
    "lambda_lr",
    "linear_lr",
    "multi_step_lr",
    "multiplicative_lr",
    "one_cycle_lr",
    "polynomial_lr",
    "reduce_lr_on_plateau",
    "sequential_lr",
    "step_lr",
    "swalr",
]

Group = dict[str, Any]
SState = dict[str, Any]


# ----------------------------------------------------------------------------- arithmetic
def _f(x: Any) -> jax.Array:
    """A value as an array of the hyperparameter dtype (float64 under x64)."""
    return jnp.asarray(x, hparam_dtype())


def _i(x: Any) -> jax.Array:
    return jnp.asarray(x, jnp.int32)


def _div(a: Any, b: Any) -> jax.Array:
    """``a / b`` as an IEEE division (XLA turns ``x / c`` into ``x * (1/c)`` otherwise)."""
    a, b = _f(a), _f(b)
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    b = jax.lax.optimization_barrier(jnp.broadcast_to(b, shape))
    return a / b


def _pow(a: Any, b: Any) -> jax.Array:
    """``a ** b`` as C ``pow`` on doubles (Python's ``float ** number``)."""
    a, b = _f(a), _f(b)
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    return jax.lax.pow(jnp.broadcast_to(a, shape), jax.lax.optimization_barrier(jnp.broadcast_to(b, shape)))


def _cos(x: Any) -> jax.Array:
    return jnp.cos(_f(x))


def _where(c: Any, a: Any, b: Any) -> Any:
    return jax.tree.map(lambda x, y: jnp.where(c, x, y), a, b)


def _select(index: jax.Array, options: Sequence[Any]) -> Any:
    out = options[-1]
    for i in range(len(options) - 2, -1, -1):
        out = _where(index == i, options[i], out)
    return out


def _n_groups(lr: Any) -> int:
    return 1 if np.ndim(lr) == 0 else len(lr)


def _format_param(name: str, lr_shape: tuple, param: Any) -> jax.Array:
    """torch's ``_format_param``: one value, or one per param group."""
    n = 1 if lr_shape == () else lr_shape[0]
    if isinstance(param, list | tuple):
        if len(param) != n:
            raise ValueError(
                f"{name} must have the same length as optimizer.param_groups. "
                f"{name} has {len(param)} values, param_groups has {n}."
            )
        arr = _f(list(param))
        return arr.reshape(lr_shape)
    return jnp.broadcast_to(_f(param), lr_shape)


def _as_lr(lr: Any) -> jax.Array:
    if isinstance(lr, list | tuple):
        lr = list(lr)
    arr = _f(lr)
    if arr.ndim > 1:
        raise ValueError(f"lr must be a number or a sequence of per-group numbers, got shape {arr.shape}")
    return arr


# ----------------------------------------------------------------------------- equal by value
def _value_key(x: Any) -> Any:
    """A hashable stand-in for ``x``, equal for two values that a jitted step bakes in
    identically: numbers by type and exact value (``-0.0`` is not ``0.0``), sequences,
    mappings and arrays by content, a scheduler spec by its class and attributes,
    functions and other objects by identity.

    Raises:
      TypeError: ``x`` holds an unhashable object of another kind.
    """
    if x is None or isinstance(x, bool | int | str):
        return (type(x).__name__, x)
    if isinstance(x, float):
        return ("float", x.hex() if x == x else "nan")
    if isinstance(x, list | tuple):
        return ("seq", tuple(_value_key(v) for v in x))
    if isinstance(x, Mapping):
        return ("map", tuple(sorted((repr(k), _value_key(v)) for k, v in x.items())))
    if isinstance(x, np.ndarray | np.generic | jax.Array):
        a = np.asarray(x)
        return ("array", str(a.dtype), a.shape, a.tobytes())
    if isinstance(x, _Spec):
        return (type(x), _value_key(vars(x)))
    hash(x)
    return x


class _ByValue:
    """``obj`` as a static ``jax.jit`` argument that compares by ``key`` (default
    ``_value_key(obj)``): equal schedules (another instance, the same arguments) hit the
    same compiled step. An argument ``_value_key`` cannot hash makes it compare by
    identity (its own compilation, as before)."""

    def __init__(self, obj: Any, key: Any = None) -> None:
        self.obj = obj
        if key is None:
            try:
                key = _value_key(obj)
            except TypeError:
                key = ("identity", id(obj))  # ``obj`` lives as long as this key does
        self._key = key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ByValue) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)


# ----------------------------------------------------------------------------- torch's LRScheduler
class _Spec:
    """One torch scheduler class, emulated over a param-group dict of arrays.

    The methods mirror ``LRScheduler``'s: ``construct`` is ``__init__`` (including the
    initial step), ``step`` is ``step()``, ``update_lr`` is ``_update_lr(epoch)``,
    ``undo`` is ``SequentialLR.recursive_undo``. ``is_initial`` is torch's
    ``_initial_mode`` flag, a Python bool: it is only true at construction.
    """

    name = "LRScheduler"
    cycles_momentum = False

    def attach(self, group: Group) -> Group:
        """The subclass ``__init__`` part that runs before ``LRScheduler.__init__``."""
        return group

    def post_init(self, group: Group, st: SState) -> SState:
        """The subclass ``__init__`` part that runs after ``LRScheduler.__init__``."""
        return st

    def extra_state(self, group: Group) -> SState:
        return {}

    def get_lr(self, group: Group, st: SState, is_initial: bool) -> tuple[jax.Array, Group]:
        raise NotImplementedError

    def closed_form(self, group: Group, st: SState) -> jax.Array | None:
        return None

    def construct(self, group: Group) -> tuple[Group, SState]:
        group = self.attach(dict(group))
        if "initial_lr" not in group:
            group["initial_lr"] = group["lr"]
        st = {"last_epoch": _i(-1), "step_count": _i(0), "base_lrs": group["initial_lr"]}
        st.update(self.extra_state(group))
        group, st = self.initial_step(group, st)
        return group, self.post_init(group, st)

    def initial_step(self, group: Group, st: SState) -> tuple[Group, SState]:
        return self.step(group, {**st, "step_count": _i(0)}, is_initial=True)

    def step(self, group: Group, st: SState, is_initial: bool = False) -> tuple[Group, SState]:
        st = {**st, "step_count": st["step_count"] + 1}
        return self.update_lr(group, st, None, is_initial)

    def update_lr(
        self, group: Group, st: SState, epoch: int | None, is_initial: bool = False
    ) -> tuple[Group, SState]:
        group = dict(group)
        if epoch is None:
            st = {**st, "last_epoch": st["last_epoch"] + 1}
            values, group = self.get_lr(group, st, is_initial)
        else:
            st = {**st, "last_epoch": _i(epoch)}
            values = self.closed_form(group, st)
            if values is None:
                values, group = self.get_lr(group, st, False)
        group["lr"] = jnp.broadcast_to(_f(values), jnp.shape(group["lr"]))
        return group, st

    def undo(self, st: SState) -> SState:
        return {**st, "last_epoch": st["last_epoch"] - 1}


class Schedule:
    """A torch learning-rate scheduler bound to an initial learning rate, as pure functions.

    Pass it where an optimizer takes a hyperparameter (``lr=``; its ``momentum``
    companion as ``momentum=`` or beta1). Also usable on its own:

    * ``init_schedule() -> (value, state)``: the value after construction (torch's
      ``get_last_lr()`` right after building the scheduler) and the schedule state;
    * ``step_schedule(value, state, count) -> (value, state)``: one ``scheduler.step()``,
      jit-compatible (``count`` is ignored; the state has its own counters);
    * ``values(n)``: the first ``n + 1`` values (after 0..n steps) as a NumPy array;
    * ``schedule(count)``: the value after ``count`` steps (replays the steps, O(count):
      for optax optimizers, which take ``count -> value`` schedules).

    Attributes:
      name: torch's class name (``"CosineAnnealingLR"``).
      lr: the learning rate the scheduler starts from (None where the scheduler sets it).
      key: ``"lr"``, or ``"momentum"`` for a momentum companion.
    """

    def __init__(self, spec: _Spec, lr: Any, key: str = "lr", start_lr: Any = None) -> None:
        self._spec = spec
        self.lr = lr
        self.key = key
        self._start_lr = _as_lr(lr if start_lr is None else start_lr)

    @property
    def name(self) -> str:
        return self._spec.name

    def __repr__(self) -> str:
        return f"<Schedule {self.name} key={self.key!r} lr={self.lr!r}>"

    @property
    def step_key(self) -> Any:
        """Hashable, equal for two schedules whose ``step_schedule`` computes the same: the
        scheduler, its arguments and the driven key, not the learning rate it starts from
        (that is state). Optimizers whose schedules have equal keys share one compiled step.

        Raises:
          TypeError: an argument is unhashable (``_value_key``).
        """
        return (type(self), self.key, _value_key(self._spec))

    @property
    def momentum(self) -> Schedule:
        """The momentum (or beta1) companion: the momentum torch's scheduler writes."""
        if not self._spec.cycles_momentum:
            raise ValueError(f"{self.name} does not cycle momentum (build it with cycle_momentum=True)")
        return Schedule(self._spec, self.lr, "momentum", self._start_lr)

    def _group0(self) -> Group:
        group = {"lr": self._start_lr}
        if self._spec.cycles_momentum:
            group["momentum"] = jnp.zeros_like(self._start_lr)
        return group

    def _construct(self) -> tuple[Group, SState]:
        return self._spec.construct(self._group0())

    def init_schedule(self) -> tuple[jax.Array, tuple[Group, SState]]:
        group, st = self._construct()
        return group[self.key], (group, st)

    def step_schedule(self, value: Any, state: tuple[Group, SState], count: Any = None) -> tuple[Any, Any]:
        del count
        group, st = state
        group = {**group, self.key: jnp.asarray(value, jnp.result_type(group[self.key]))}
        group, st = self._spec.step(group, st)
        return group[self.key], (group, st)

    def check_hparams(self, name: str, hparams: Mapping[str, Any]) -> None:
        """torch's ``cycle_momentum`` rule, checked when an optimizer is built with it."""
        if self.key != "lr" or not self._spec.cycles_momentum:
            return
        if "momentum" not in hparams and "betas" not in hparams:
            raise ValueError("optimizer must support momentum or beta1 with `cycle_momentum` option enabled")
        linked = hparams.get("betas", (None,))[0] if "betas" in hparams else hparams.get("momentum")
        if getattr(linked, "_spec", None) is not self._spec:
            target = "betas=(lr.momentum, beta2)" if "betas" in hparams else "momentum=lr.momentum"
            raise ValueError(
                f"{self.name} cycles momentum (cycle_momentum=True), as torch does: pass its "
                f"companion as {target}, or build the schedule with cycle_momentum=False"
            )

    def values(self, n: int) -> np.ndarray:
        """The values after 0, 1, ..., ``n`` steps (torch's ``get_last_lr()`` sequence)."""
        value, state = self.init_schedule()
        if n <= 16:  # op by op: no compilation for a short look
            out = [value]
            for _ in range(n):
                value, state = self.step_schedule(value, state)
                out.append(value)
            return np.asarray(jnp.stack([jnp.asarray(v) for v in out]))
        return np.asarray(_run(self, value, state, int(n)))

    def __call__(self, count: Any) -> jax.Array:
        value, state = self.init_schedule()

        def body(_, carry):
            return self.step_schedule(*carry)

        return jax.lax.fori_loop(0, count, body, (value, state))[0]


def _run(sched: Schedule, value: Any, state: Any, n: int) -> jax.Array:
    def body(carry, _):
        v, s = sched.step_schedule(*carry)
        return (v, s), v

    @jax.jit
    def scan(value, state):
        return jax.lax.scan(body, (value, state), None, length=n)[1]

    rest = scan(value, state)
    return jnp.concatenate([jnp.asarray(value)[None], rest])


# ----------------------------------------------------------------------------- the schedulers
class _LambdaLR(_Spec):
    name = "LambdaLR"

    def __init__(self, lr_lambdas: list[Callable] | None, per_group: bool) -> None:
        self.lr_lambdas = lr_lambdas
        self.per_group = per_group

    def _factors(self, st: SState, shape: tuple) -> jax.Array:
        e = st["last_epoch"]
        if self.per_group:
            return _f([_f(fn(e)) for fn in self.lr_lambdas]).reshape(shape)
        return _f(self.lr_lambdas[0](e))

    def get_lr(self, group, st, is_initial):
        return st["base_lrs"] * self._factors(st, jnp.shape(group["lr"])), group


class _MultiplicativeLR(_LambdaLR):
    name = "MultiplicativeLR"

    def get_lr(self, group, st, is_initial):
        if is_initial:
            return group["lr"], group
        return group["lr"] * self._factors(st, jnp.shape(group["lr"])), group


class _StepLR(_Spec):
    name = "StepLR"

    def __init__(self, step_size: int, gamma: float) -> None:
        self.step_size, self.gamma = step_size, gamma

    def get_lr(self, group, st, is_initial):
        e = st["last_epoch"]
        keep = (e == 0) | (e % self.step_size != 0)
        return jnp.where(keep, group["lr"], group["lr"] * self.gamma), group

    def closed_form(self, group, st):
        return st["base_lrs"] * _pow(self.gamma, st["last_epoch"] // self.step_size)


class _MultiStepLR(_Spec):
    name = "MultiStepLR"

    def __init__(self, milestones: Counter, gamma: float) -> None:
        self.milestones, self.gamma = milestones, gamma
        keys = sorted(milestones)
        self._keys = np.asarray(keys if keys else [-(2**31)], np.int32)
        self._counts = np.asarray([milestones[k] for k in keys] if keys else [0], np.int32)
        self._sorted = np.asarray(sorted(milestones.elements()) or [2**31 - 1], np.int32)

    def get_lr(self, group, st, is_initial):
        e = st["last_epoch"]
        hit = jnp.asarray(self._keys) == e
        n = jnp.sum(jnp.where(hit, jnp.asarray(self._counts), 0))
        return jnp.where(n == 0, group["lr"], group["lr"] * _pow(self.gamma, n)), group

    def closed_form(self, group, st):
        n = jnp.searchsorted(jnp.asarray(self._sorted), st["last_epoch"], side="right")
        n = n if sum(self.milestones.values()) else 0
        return st["base_lrs"] * _pow(self.gamma, n)


class _ConstantLR(_Spec):
    name = "ConstantLR"

    def __init__(self, factor: float, total_iters: int) -> None:
        self.factor, self.total_iters = factor, total_iters

    def get_lr(self, group, st, is_initial):
        e, lr = st["last_epoch"], group["lr"]
        out = jnp.where(e != self.total_iters, lr, lr * _div(1.0, self.factor))
        return jnp.where(e == 0, lr * self.factor, out), group

    def closed_form(self, group, st):
        reached = (st["last_epoch"] >= self.total_iters).astype(hparam_dtype())
        return st["base_lrs"] * (self.factor + reached * (1 - self.factor))


class _LinearLR(_Spec):
    name = "LinearLR"

    def __init__(self, start_factor: float, end_factor: float, total_iters: int) -> None:
        self.start, self.end, self.total = start_factor, end_factor, total_iters

    def get_lr(self, group, st, is_initial):
        e, lr = st["last_epoch"], group["lr"]
        d = self.end - self.start
        ratio = 1.0 + _div(d, self.total * self.start + _f(e - 1) * d)
        out = lr if is_initial else jnp.where(e > self.total, lr, lr * ratio)
        return jnp.where(e == 0, lr * self.start, out), group

    def closed_form(self, group, st):
        m = jnp.minimum(self.total, st["last_epoch"])
        return st["base_lrs"] * (self.start + _div((self.end - self.start) * _f(m), self.total))


class _ExponentialLR(_Spec):
    name = "ExponentialLR"

    def __init__(self, gamma: float) -> None:
        self.gamma = gamma

    def get_lr(self, group, st, is_initial):
        if is_initial:
            return group["lr"], group
        return group["lr"] * self.gamma, group

    def closed_form(self, group, st):
        return st["base_lrs"] * _pow(self.gamma, st["last_epoch"])


class _PolynomialLR(_Spec):
    name = "PolynomialLR"

    def __init__(self, total_iters: int, power: float) -> None:
        self.total, self.power = total_iters, power

    def get_lr(self, group, st, is_initial):
        e, lr = st["last_epoch"], group["lr"]
        if is_initial:
            return lr, group
        num = 1.0 - _div(e, self.total)
        den = 1.0 - _div(e - 1, self.total)
        decay = _pow(_div(num, den), self.power)
        return jnp.where(e > self.total, lr, lr * decay), group

    def closed_form(self, group, st):
        m = jnp.minimum(self.total, st["last_epoch"])
        return st["base_lrs"] * _pow(1.0 - _div(m, self.total), self.power)


class _CosineAnnealingLR(_Spec):
    name = "CosineAnnealingLR"

    def __init__(self, T_max: int, eta_min: float) -> None:
        self.T_max, self.eta_min = T_max, eta_min

    def get_lr(self, group, st, is_initial):
        if is_initial:
            return group["lr"], group
        e, lr, base, eta, T = st["last_epoch"], group["lr"], st["base_lrs"], self.eta_min, self.T_max
        resumed = eta + _div((base - eta) * (1 + _cos(_div(_f(e) * math.pi, T))), 2)
        restart = lr + _div((base - eta) * (1 - _cos(_div(math.pi, T))), 2)
        ratio = _div(1 + _cos(_div(math.pi * _f(e), T)), 1 + _cos(_div(math.pi * _f(e - 1), T)))
        recursive = ratio * (lr - eta) + eta
        out = jnp.where((e - 1 - T) % (2 * T) == 0, restart, recursive)
        return jnp.where((st["step_count"] == 1) & (e > 0), resumed, out), group

    def closed_form(self, group, st):
        e, eta = st["last_epoch"], self.eta_min
        return eta + _div((st["base_lrs"] - eta) * (1 + _cos(_div(math.pi * _f(e), self.T_max))), 2)


class _CosineAnnealingWarmRestarts(_Spec):
    name = "CosineAnnealingWarmRestarts"

    def __init__(self, T_0: int, T_mult: int, eta_min: float) -> None:
        self.T_0, self.T_mult, self.eta_min = T_0, T_mult, eta_min

    def extra_state(self, group):
        return {"T_cur": _i(-1), "T_i": _i(self.T_0)}

    def get_lr(self, group, st, is_initial):
        cos = _cos(_div(math.pi * _f(st["T_cur"]), st["T_i"]))
        return self.eta_min + _div((st["base_lrs"] - self.eta_min) * (1 + cos), 2), group

    def step(self, group, st, is_initial=False):
        e = st["last_epoch"]
        # torch: ``if epoch is None and self.last_epoch < 0: epoch = 0`` -> T_i = T_0, T_cur = 0
        t_cur = st["T_cur"] + 1
        wrap = t_cur >= st["T_i"]
        t_cur_n = jnp.where(wrap, t_cur % st["T_i"], t_cur)
        t_i_n = jnp.where(wrap, st["T_i"] * self.T_mult, st["T_i"])
        first = e < 0
        st = {
            **st,
            "T_cur": jnp.where(first, 0, t_cur_n).astype(jnp.int32),
            "T_i": jnp.where(first, self.T_0, t_i_n).astype(jnp.int32),
            "last_epoch": jnp.where(first, 0, e + 1).astype(jnp.int32),
        }
        lr, group = self.get_lr(dict(group), st, is_initial)
        group["lr"] = jnp.broadcast_to(lr, jnp.shape(group["lr"]))
        return group, st


class _SWALR(_Spec):
    name = "SWALR"

    def __init__(self, swa_lr: Any, anneal_epochs: int, anneal_strategy: str) -> None:
        self.swa_lr, self.anneal_epochs, self.strategy = swa_lr, anneal_epochs, anneal_strategy

    def attach(self, group):
        group["swa_lr"] = _format_param("swa_lr", jnp.shape(group["lr"]), self.swa_lr)
        return group

    def _anneal(self, t):
        if self.strategy == "cos":
            return _div(1 - _cos(math.pi * t), 2)
        return t

    def get_lr(self, group, st, is_initial):
        step = st["step_count"] - 1
        if self.anneal_epochs == 0:
            step = jnp.maximum(1, step)
        denom = max(1, self.anneal_epochs)
        prev_t = jnp.clip(_div(step - 1, denom), 0, 1)
        prev_alpha = self._anneal(prev_t)
        swa, lr = group["swa_lr"], group["lr"]
        prev_lr = jnp.where(prev_alpha == 1, swa, _div(lr - prev_alpha * swa, 1 - prev_alpha))
        alpha = self._anneal(jnp.clip(_div(step, denom), 0, 1))
        return swa * alpha + prev_lr * (1 - alpha), group


class _CyclicLR(_Spec):
    name = "CyclicLR"

    def __init__(self, base_lr, max_lr, step_size_up, step_size_down, mode, gamma, scale_fn, scale_mode,
                 cycle_momentum, base_momentum, max_momentum):  # fmt: skip
        self.base_lr, self.max_lr = base_lr, max_lr
        up = float(step_size_up)
        down = float(step_size_down) if step_size_down is not None else up
        self.total_size = up + down
        self.step_ratio = up / self.total_size
        self.mode, self.gamma, self.custom = mode, gamma, scale_fn
        if scale_fn is None:
            scale_mode = "iterations" if mode == "exp_range" else "cycle"
        self.scale_mode = scale_mode
        self.cycles_momentum = cycle_momentum
        self.base_momentum, self.max_momentum = base_momentum, max_momentum

    def scale_fn(self, x):
        if self.custom is not None:
            return _f(self.custom(x))
        if self.mode == "triangular":
            return _f(1.0)
        if self.mode == "triangular2":
            return _div(1, _pow(2.0, _f(x) - 1))
        return _pow(self.gamma, x)

    def attach(self, group):
        shape = jnp.shape(group["lr"])
        group["lr"] = group["cyc_base_lr"] = _format_param("base_lr", shape, self.base_lr)
        group["cyc_max_lr"] = _format_param("max_lr", shape, self.max_lr)
        if self.cycles_momentum:
            group["cyc_base_momentum"] = _format_param("base_momentum", shape, self.base_momentum)
            group["cyc_max_momentum"] = _format_param("max_momentum", shape, self.max_momentum)
            group["momentum"] = group["cyc_max_momentum"]
        return group

    def extra_state(self, group):
        st = {"cyc_base_lrs": group.pop("cyc_base_lr"), "max_lrs": group.pop("cyc_max_lr")}
        return {**st, **self._momentum_state(group)}

    def _momentum_state(self, group):
        if not self.cycles_momentum:
            return {}
        return {
            "base_momentums": group.pop("cyc_base_momentum"),
            "max_momentums": group.pop("cyc_max_momentum"),
        }

    def post_init(self, group, st):
        st = dict(st)
        st["base_lrs"] = st.pop("cyc_base_lrs")  # torch reassigns base_lrs after the initial step
        return st

    def get_lr(self, group, st, is_initial):
        e = st["last_epoch"]
        cycle = jnp.floor(1 + _div(e, self.total_size))
        x = 1.0 + _div(e, self.total_size) - cycle
        scale_factor = jnp.where(
            x <= self.step_ratio, _div(x, self.step_ratio), _div(x - 1, self.step_ratio - 1)
        )
        arg = cycle.astype(jnp.int32) if self.scale_mode == "cycle" else e
        scale = self.scale_fn(arg)
        base_height = (st["max_lrs"] - st["base_lrs"]) * scale_factor
        lrs = st["base_lrs"] + base_height * scale
        if self.cycles_momentum:
            height = (st["max_momentums"] - st["base_momentums"]) * scale_factor
            group = {**group, "momentum": st["max_momentums"] - height * scale}
        return lrs, group


class _OneCycleLR(_Spec):
    name = "OneCycleLR"

    def __init__(self, max_lr, total_steps, pct_start, anneal_strategy, cycle_momentum, base_momentum,
                 max_momentum, div_factor, final_div_factor, phases):  # fmt: skip
        self.max_lr, self.total_steps, self.strategy = max_lr, total_steps, anneal_strategy
        self.cycles_momentum = cycle_momentum
        self.base_momentum, self.max_momentum = base_momentum, max_momentum
        self.div_factor, self.final_div_factor = div_factor, final_div_factor
        self.phases = phases

    def attach(self, group):
        shape = jnp.shape(group["lr"])
        max_lrs = _format_param("max_lr", shape, self.max_lr)
        group["initial_lr"] = _div(max_lrs, self.div_factor)
        group["max_lr"] = max_lrs
        group["min_lr"] = _div(group["initial_lr"], self.final_div_factor)
        if self.cycles_momentum:
            max_m = _format_param("max_momentum", shape, self.max_momentum)
            base_m = _format_param("base_momentum", shape, self.base_momentum)
            group["momentum"] = max_m
            group["max_momentum"] = max_m
            group["base_momentum"] = base_m
        return group

    def _anneal(self, start, end, pct):
        if self.strategy == "cos":
            cos_out = _cos(math.pi * pct) + 1
            return end + _div(start - end, 2.0) * cos_out
        return (end - start) * pct + start

    def get_lr(self, group, st, is_initial):
        step_num = st["last_epoch"]
        lrs, moms, start_step = [], [], 0.0
        conds = []
        for phase in self.phases:
            end_step = phase["end_step"]
            pct = _div(_f(step_num) - start_step, end_step - start_step)
            lrs.append(self._anneal(group[phase["start_lr"]], group[phase["end_lr"]], pct))
            if self.cycles_momentum:
                moms.append(self._anneal(group[phase["start_momentum"]], group[phase["end_momentum"]], pct))
            conds.append(step_num <= end_step)
            start_step = phase["end_step"]
        # the first phase whose end is not passed, else the last one
        index = jnp.int32(len(self.phases) - 1)
        for i in range(len(self.phases) - 2, -1, -1):
            index = jnp.where(conds[i], i, index)
        over = step_num > self.total_steps  # torch raises "Tried to step ..."
        lr = jnp.where(over, jnp.nan, _select(index, lrs))
        if self.cycles_momentum:
            group = {**group, "momentum": jnp.where(over, jnp.nan, _select(index, moms))}
        return lr, group


class _ChainedScheduler(_Spec):
    name = "ChainedScheduler"

    def __init__(self, specs: list[_Spec]) -> None:
        self.specs = specs
        self.cycles_momentum = any(s.cycles_momentum for s in specs)

    def construct(self, group):
        states = []
        for spec in self.specs:
            group, st = spec.construct(group)
            states.append(st)
        return group, {"subs": tuple(states)}

    def step(self, group, st, is_initial=False):
        states = []
        for spec, sub in zip(self.specs, st["subs"], strict=True):
            group, sub = spec.step(group, sub)
            states.append(sub)
        return group, {"subs": tuple(states)}

    def undo(self, st):
        return {"subs": tuple(spec.undo(s) for spec, s in zip(self.specs, st["subs"], strict=True))}


class _SequentialLR(_Spec):
    name = "SequentialLR"

    def __init__(self, specs: list[_Spec], milestones: list[int]) -> None:
        self.specs, self.milestones = specs, list(milestones)
        self.cycles_momentum = any(s.cycles_momentum for s in specs)

    def construct(self, group):
        states = []
        for spec in self.specs:
            group, st = spec.construct(group)
            states.append(st)
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


# ----------------------------------------------------------------------------- factories
def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _lambdas(lr: Any, lr_lambda: Any, check_callable: bool) -> tuple[list[Callable], bool]:
    n = _n_groups(lr)
    if not isinstance(lr_lambda, list | tuple):
        fns, per_group = [lr_lambda], False
    else:
        if len(lr_lambda) != n:
            raise ValueError(f"Expected {n} lr_lambdas, but got {len(lr_lambda)}")
        fns, per_group = list(lr_lambda), np.ndim(lr) != 0
    if check_callable:
        for fn in fns:
            if not callable(fn):
                raise TypeError(f"lr_lambda should be a function, but got {type(fn).__name__}")
    return fns, per_group


def lambda_lr(lr: Any, lr_lambda: Callable | Sequence[Callable]) -> Schedule:
    r"""``torch.optim.lr_scheduler.LambdaLR``: :math:`\eta_t = \eta_0 \cdot \lambda(t)`.

    Args:
      lr: the optimizer's learning rate :math:`\eta_0` (torch's ``base_lrs``); a number
        or one per param group.
      lr_lambda: ``epoch -> factor``, or one per group. It receives a traced int32
        ``last_epoch`` and must be written with ``jax.numpy`` (``jnp.minimum``, not
        ``min``).

    Returns:
      A :class:`Schedule`.

    Raises:
      ValueError: ``Expected {n} lr_lambdas, but got {m}`` (torch's text).

    Examples:
      >>> import functorch_optim as fo
      >>> fo.schedules.lambda_lr(0.1, lambda e: 0.5**e).values(3).round(4).tolist()
      [0.1, 0.05, 0.025, 0.0125]
    """
    fns, per_group = _lambdas(lr, lr_lambda, check_callable=False)
    return Schedule(_LambdaLR(fns, per_group), lr)


def multiplicative_lr(lr: Any, lr_lambda: Callable | Sequence[Callable]) -> Schedule:
    r"""``torch.optim.lr_scheduler.MultiplicativeLR``: :math:`\eta_t = \eta_{t-1} \lambda(t)`.

    Args:
      lr: the optimizer's learning rate (or one per group).
      lr_lambda: ``epoch -> factor`` (jax.numpy-traceable), or one per group.

    Returns:
      A :class:`Schedule`.

    Raises:
      ValueError: ``Expected {n} lr_lambdas, but got {m}``.
      TypeError: ``lr_lambda should be a function, but got {type}``.

    Examples:
      >>> import functorch_optim as fo
      >>> fo.schedules.multiplicative_lr(1.0, lambda e: 0.5).values(2).tolist()
      [1.0, 0.5, 0.25]
    """
    fns, per_group = _lambdas(lr, lr_lambda, check_callable=True)
    return Schedule(_MultiplicativeLR(fns, per_group), lr)


def step_lr(lr: Any, step_size: int, gamma: float = 0.1) -> Schedule:
    r"""``torch.optim.lr_scheduler.StepLR``: multiply by ``gamma`` every ``step_size`` steps.

    Args:
      lr: the optimizer's learning rate (or one per group).
      step_size: period of decay, an integer >= 1 (torch fails with a division by zero).
      gamma: multiplicative factor, default 0.1.

    Returns:
      A :class:`Schedule`.

    Raises:
      ValueError: ``step_size must be an integer >= 1, got …``.

    Examples:
      >>> import functorch_optim as fo
      >>> fo.schedules.step_lr(1.0, step_size=2, gamma=0.5).values(4).tolist()
      [1.0, 1.0, 0.5, 0.5, 0.25]
    """
    return Schedule(_StepLR(_check_count("step_size", step_size), gamma), lr)


def multi_step_lr(lr: Any, milestones: Sequence[int], gamma: float = 0.1) -> Schedule:
    r"""``torch.optim.lr_scheduler.MultiStepLR``: multiply by ``gamma`` at each milestone.

    A milestone listed ``n`` times multiplies by ``gamma ** n`` (torch's ``Counter``).

    Args:
      lr: the optimizer's learning rate (or one per group).
      milestones: step indices, e.g. ``[30, 80]``.
      gamma: multiplicative factor, default 0.1.

    Returns:
      A :class:`Schedule`.

    Examples:
      >>> import functorch_optim as fo
      >>> fo.schedules.multi_step_lr(1.0, [1, 3], gamma=0.5).values(4).tolist()
      [1.0, 0.5, 0.5, 0.25, 0.25]
    """
    return Schedule(_MultiStepLR(Counter(int(m) for m in milestones), gamma), lr)


def constant_lr(lr: Any, factor: float = 1.0 / 3, total_iters: int = 5) -> Schedule:
    r"""``torch.optim.lr_scheduler.ConstantLR``: ``lr * factor`` until ``total_iters``.

    Args:
      lr: the optimizer's learning rate (or one per group).
      factor: multiplier until the milestone, default 1/3.
      total_iters: steps with the factor applied, default 5.

    Returns:
      A :class:`Schedule`.

    Raises:
      ValueError: ``Constant multiplicative factor expected to be between 0 and 1.``

    Examples:
      >>> import functorch_optim as fo
      >>> fo.schedules.constant_lr(1.0, factor=0.5, total_iters=2).values(3).tolist()
      [0.5, 0.5, 1.0, 1.0]
    """
    if factor > 1.0 or factor < 0:
        raise ValueError("Constant multiplicative factor expected to be between 0 and 1.")
    return Schedule(_ConstantLR(factor, total_iters), lr)


def linear_lr(
    lr: Any, start_factor: float = 1.0 / 3, end_factor: float = 1.0, total_iters: int = 5
) -> Schedule:
    r"""``torch.optim.lr_scheduler.LinearLR``: a linear ramp of the factor over ``total_iters``.

    Computed recursively, as torch does:
    :math:`\eta_t = \eta_{t-1}\bigl(1 + \frac{e - s}{T s + (t - 1)(e - s)}\bigr)`.

    Args:
      lr: the optimizer's learning rate (or one per group).
      start_factor: factor at step 0, in (0, 1], default 1/3.
      end_factor: factor from ``total_iters`` on, in [0, 1], default 1.
      total_iters: length of the ramp, default 5.

    Returns:
      A :class:`Schedule`.

    Raises:
      ValueError: ``Starting multiplicative factor expected to be greater than 0 and less
        or equal to 1.``; ``Ending multiplicative factor expected to be between 0 and 1.``

    Examples:
      >>> import functorch_optim as fo
      >>> fo.schedules.linear_lr(1.0, 0.5, 1.0, total_iters=2).values(3).tolist()
      [0.5, 0.75, 1.0, 1.0]
    """
    if start_factor > 1.0 or start_factor <= 0:
        raise ValueError(
            "Starting multiplicative factor expected to be greater than 0 and less or equal to 1."
        )
    if end_factor > 1.0 or end_factor < 0:
        raise ValueError("Ending multiplicative factor expected to be between 0 and 1.")
    return Schedule(_LinearLR(start_factor, end_factor, total_iters), lr)


def exponential_lr(lr: Any, gamma: float) -> Schedule:
    r"""``torch.optim.lr_scheduler.ExponentialLR``: :math:`\eta_t = \gamma\,\eta_{t-1}`.

    Args:
      lr: the optimizer's learning rate (or one per group).
      gamma: multiplicative factor per step.

    Returns:
      A :class:`Schedule`.

    Examples:
      >>> import functorch_optim as fo
      >>> fo.schedules.exponential_lr(1.0, gamma=0.5).values(2).tolist()
      [1.0, 0.5, 0.25]
    """
    return Schedule(_ExponentialLR(gamma), lr)


def polynomial_lr(lr: Any, total_iters: int = 5, power: float = 1.0) -> Schedule:
    r"""``torch.optim.lr_scheduler.PolynomialLR``: decay to 0 over ``total_iters`` steps.

    Recursive, as torch: :math:`\eta_t = \eta_{t-1}\bigl(\frac{1 - t/T}{1 - (t-1)/T}\bigr)^p`
    for :math:`t \le T`, then constant.

    Args:
      lr: the optimizer's learning rate (or one per group).
      total_iters: decay steps :math:`T`, default 5.
      power: polynomial power :math:`p`, default 1.

    Returns:
      A :class:`Schedule`.

    Examples:
      >>> import functorch_optim as fo
      >>> fo.schedules.polynomial_lr(1.0, total_iters=4).values(5).round(6).tolist()
      [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    """
    return Schedule(_PolynomialLR(total_iters, power), lr)


def cosine_annealing_lr(lr: Any, T_max: int, eta_min: float = 0.0) -> Schedule:
    r"""``torch.optim.lr_scheduler.CosineAnnealingLR``, in torch's recursive form.

    .. math::

        \eta_{t} = \eta_{\min} + (\eta_{t-1} - \eta_{\min})
        \frac{1 + \cos(\pi t / T_{max})}{1 + \cos(\pi (t - 1) / T_{max})}

    with torch's restart branch where the denominator vanishes. Past ``T_max`` the value
    keeps following the cosine (period ``2 T_max``) as in torch.

    Args:
      lr: the optimizer's learning rate :math:`\eta_{max}` (or one per group).
      T_max: half period in steps.
      eta_min: minimum learning rate, default 0.

    Returns:
      A :class:`Schedule`.

    Examples:
      >>> import functorch_optim as fo
      >>> fo.schedules.cosine_annealing_lr(1.0, T_max=2).values(4).round(6).tolist()
      [1.0, 0.5, 0.0, 0.5, 1.0]

    Note:
      optax's ``cosine_decay_schedule`` stays at its final value after the decay; torch
      (and this) go back up.

    References:
      Loshchilov & Hutter, "SGDR: Stochastic Gradient Descent with Warm Restarts", ICLR
      2017. Mirrors ``torch.optim.lr_scheduler.CosineAnnealingLR``.
    """
    return Schedule(_CosineAnnealingLR(T_max, eta_min), lr)


def cosine_annealing_warm_restarts(lr: Any, T_0: int, T_mult: int = 1, eta_min: float = 0.0) -> Schedule:
    r"""``torch.optim.lr_scheduler.CosineAnnealingWarmRestarts`` (SGDR).

    :math:`\eta_t = \eta_{min} + \frac12(\eta_0 - \eta_{min})(1 + \cos(\pi T_{cur}/T_i))`,
    with :math:`T_{cur}` reset to 0 and :math:`T_i \leftarrow T_{mult} T_i` at each restart.

    Args:
      lr: the optimizer's learning rate (or one per group).
      T_0: steps until the first restart.
      T_mult: growth factor of the period after a restart, default 1.
      eta_min: minimum learning rate, default 0.

    Returns:
      A :class:`Schedule`.

    Raises:
      ValueError: ``Expected positive integer T_0, but got …``, ``Expected integer T_mult
        >= 1, but got …``, ``Expected float or int eta_min, but got … of type …``.

    Examples:
      >>> import functorch_optim as fo
      >>> fo.schedules.cosine_annealing_warm_restarts(1.0, T_0=2).values(4).round(6).tolist()
      [1.0, 0.5, 1.0, 0.5, 1.0]

    References:
      Loshchilov & Hutter, "SGDR: Stochastic Gradient Descent with Warm Restarts", ICLR
      2017. Mirrors ``torch.optim.lr_scheduler.CosineAnnealingWarmRestarts``.
    """
    if T_0 <= 0 or not isinstance(T_0, int):
        raise ValueError(f"Expected positive integer T_0, but got {T_0}")
    if T_mult < 1 or not isinstance(T_mult, int):
        raise ValueError(f"Expected integer T_mult >= 1, but got {T_mult}")
    if not isinstance(eta_min, float | int):
        raise ValueError(f"Expected float or int eta_min, but got {eta_min} of type {type(eta_min)}")
    return Schedule(_CosineAnnealingWarmRestarts(T_0, T_mult, eta_min), lr)


def cyclic_lr(
    base_lr: float | Sequence[float],
    max_lr: float | Sequence[float],
    step_size_up: int = 2000,
    step_size_down: int | None = None,
    mode: str = "triangular",
    gamma: float = 1.0,
    scale_fn: Callable[[Any], Any] | None = None,
    scale_mode: str = "cycle",
    cycle_momentum: bool = True,
    base_momentum: float | Sequence[float] = 0.8,
    max_momentum: float | Sequence[float] = 0.9,
    *,
    lr: Any = None,
) -> Schedule:
    r"""``torch.optim.lr_scheduler.CyclicLR`` (triangular, triangular2, exp_range).

    With :math:`c = \lfloor 1 + t / S \rfloor`, :math:`x = 1 + t/S - c` and the
    up-fraction :math:`r`, the scale is :math:`x / r` rising, :math:`(x - 1)/(r - 1)`
    falling, and :math:`\eta_t = \eta_{base} + (\eta_{max} - \eta_{base})\,
    \text{scale}\cdot f(c \text{ or } t)`; momentum cycles inversely between
    ``max_momentum`` and ``base_momentum``.

    Args:
      base_lr: lower boundary (or one per group); also the value after construction.
      max_lr: upper boundary (or one per group).
      step_size_up: steps in the rising half, default 2000.
      step_size_down: steps in the falling half, default ``step_size_up``.
      mode: ``"triangular"`` (default), ``"triangular2"`` or ``"exp_range"``.
      gamma: the ``exp_range`` base, default 1.
      scale_fn: a custom ``x -> scale`` (jax.numpy-traceable); overrides ``mode``.
      scale_mode: ``"cycle"`` (default) or ``"iterations"``, for ``scale_fn``.
      cycle_momentum: cycle momentum too (default True, as torch): pass
        ``momentum=sched.momentum`` or ``betas=(sched.momentum, beta2)`` to the
        optimizer.
      base_momentum: lower momentum boundary, default 0.8.
      max_momentum: upper momentum boundary, default 0.9.
      lr: the optimizer's learning rate before the scheduler (torch overwrites it with
        ``base_lr``); default ``base_lr``. Only matters inside chains and sequences.

    Returns:
      A :class:`Schedule`.

    Raises:
      ValueError: ``mode is invalid and scale_fn is None``; ``base_lr must have the same
        length as optimizer.param_groups. …``; and, when an optimizer is built with it,
        ``optimizer must support momentum or beta1 with `cycle_momentum` option enabled``.

    Examples:
      >>> import functorch_optim as fo
      >>> s = fo.schedules.cyclic_lr(0.1, 0.5, step_size_up=2, cycle_momentum=False)
      >>> s.values(4).round(6).tolist()
      [0.1, 0.3, 0.5, 0.3, 0.1]

    References:
      Smith, "Cyclical Learning Rates for Training Neural Networks", WACV 2017. Mirrors
      ``torch.optim.lr_scheduler.CyclicLR``.
    """
    start = lr
    if start is None:
        start = (
            base_lr
            if isinstance(base_lr, list | tuple) or not isinstance(max_lr, list | tuple)
            else ([base_lr] * len(max_lr))
        )
    spec = _CyclicLR(base_lr, max_lr, step_size_up, step_size_down, mode, gamma, scale_fn, scale_mode,
                     cycle_momentum, base_momentum, max_momentum)  # fmt: skip
    # torch's checks, in its order
    shape = jnp.shape(_as_lr(start))
    _format_param("base_lr", shape, base_lr)
    _format_param("max_lr", shape, max_lr)
    if mode not in ["triangular", "triangular2", "exp_range"] and scale_fn is None:
        raise ValueError("mode is invalid and scale_fn is None")
    if cycle_momentum:
        _format_param("base_momentum", shape, base_momentum)
        _format_param("max_momentum", shape, max_momentum)
    return Schedule(spec, lr, start_lr=start)


def one_cycle_lr(
    max_lr: float | Sequence[float],
    total_steps: int | None = None,
    epochs: int | None = None,
    steps_per_epoch: int | None = None,
    pct_start: float = 0.3,
    anneal_strategy: str = "cos",
    cycle_momentum: bool = True,
    base_momentum: float | Sequence[float] = 0.85,
    max_momentum: float | Sequence[float] = 0.95,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
    three_phase: bool = False,
    *,
    lr: Any = None,
) -> Schedule:
    r"""``torch.optim.lr_scheduler.OneCycleLR`` (cos or linear, two or three phases).

    Phases end at ``pct_start * total_steps - 1`` and ``total_steps - 1`` (torch's
    indices; optax's ``cosine_onecycle_schedule`` is one step off). Within a phase from
    step :math:`a` to :math:`b` the value anneals from its start to its end value with
    :math:`p = (t - a)/(b - a)`: ``cos``: :math:`e + \frac{s - e}{2}(1 + \cos \pi p)`,
    ``linear``: :math:`(e - s)p + s`. Momentum anneals inversely.

    Args:
      max_lr: peak learning rate (or one per group).
      total_steps: steps in the cycle; or give ``epochs`` and ``steps_per_epoch``.
      epochs: epochs, with ``steps_per_epoch``.
      steps_per_epoch: steps per epoch, with ``epochs``.
      pct_start: fraction of the cycle spent increasing, a float, default 0.3.
      anneal_strategy: ``"cos"`` (default) or ``"linear"``.
      cycle_momentum: cycle momentum too (default True): pass ``momentum=sched.momentum``
        or ``betas=(sched.momentum, beta2)`` to the optimizer.
      base_momentum: momentum at the peak, default 0.85.
      max_momentum: momentum at the start and end, default 0.95.
      div_factor: ``initial_lr = max_lr / div_factor``, default 25.
      final_div_factor: ``min_lr = initial_lr / final_div_factor``, default 1e4.
      three_phase: use torch's three-phase variant, default False.
      lr: the optimizer's learning rate before the scheduler (torch overwrites it);
        default ``max_lr / div_factor``. Only matters inside chains and sequences.

    Returns:
      A :class:`Schedule`. Stepping past ``total_steps`` makes the value NaN (torch
      raises ``Tried to step … times``; nothing can raise inside ``jit``).

    Raises:
      ValueError: torch's texts: ``Expected positive integer total_steps, but got …``,
        ``Expected positive integer epochs, …``, ``… steps_per_epoch …``, ``You must
        define either total_steps OR (epochs AND steps_per_epoch)``, ``Expected float
        between 0 and 1 pct_start, but got …``, ``anneal_strategy must be one of 'cos'
        or 'linear', instead got …``.
      ZeroDivisionError: where torch divides by a zero-length first phase.

    Examples:
      >>> import functorch_optim as fo
      >>> s = fo.schedules.one_cycle_lr(1.0, total_steps=5, pct_start=0.4, div_factor=10.0,
      ...                               final_div_factor=1.0, anneal_strategy="linear",
      ...                               cycle_momentum=False)
      >>> s.values(4).round(6).tolist()
      [0.1, 1.0, 0.7, 0.4, 0.1]

    References:
      Smith & Topin, "Super-Convergence: Very Fast Training of Neural Networks Using Large
      Learning Rates", 2017. Mirrors ``torch.optim.lr_scheduler.OneCycleLR``.
    """
    if total_steps is not None:
        if total_steps <= 0 or not isinstance(total_steps, int):
            raise ValueError(f"Expected positive integer total_steps, but got {total_steps}")
    elif epochs is not None and steps_per_epoch is not None:
        if not isinstance(epochs, int) or epochs <= 0:
            raise ValueError(f"Expected positive integer epochs, but got {epochs}")
        if not isinstance(steps_per_epoch, int) or steps_per_epoch <= 0:
            raise ValueError(f"Expected positive integer steps_per_epoch, but got {steps_per_epoch}")
        total_steps = epochs * steps_per_epoch
    else:
        raise ValueError("You must define either total_steps OR (epochs AND steps_per_epoch)")
    if three_phase:
        phases = [
            {"end_step": float(pct_start * total_steps) - 1, "start_lr": "initial_lr", "end_lr": "max_lr",
             "start_momentum": "max_momentum", "end_momentum": "base_momentum"},
            {"end_step": float(2 * pct_start * total_steps) - 2, "start_lr": "max_lr", "end_lr": "initial_lr",
             "start_momentum": "base_momentum", "end_momentum": "max_momentum"},
            {"end_step": total_steps - 1, "start_lr": "initial_lr", "end_lr": "min_lr",
             "start_momentum": "max_momentum", "end_momentum": "max_momentum"},
        ]  # fmt: skip
    else:
        phases = [
            {"end_step": float(pct_start * total_steps) - 1, "start_lr": "initial_lr", "end_lr": "max_lr",
             "start_momentum": "max_momentum", "end_momentum": "base_momentum"},
            {"end_step": total_steps - 1, "start_lr": "max_lr", "end_lr": "min_lr",
             "start_momentum": "base_momentum", "end_momentum": "max_momentum"},
        ]  # fmt: skip
    if pct_start < 0 or pct_start > 1 or not isinstance(pct_start, float):
        raise ValueError(f"Expected float between 0 and 1 pct_start, but got {pct_start}")
    if anneal_strategy not in ["cos", "linear"]:
        raise ValueError(f"anneal_strategy must be one of 'cos' or 'linear', instead got {anneal_strategy}")
    spec = _OneCycleLR(max_lr, total_steps, pct_start, anneal_strategy, cycle_momentum, base_momentum,
                       max_momentum, div_factor, final_div_factor, phases)  # fmt: skip
    start = lr
    if start is None:
        start = [m / div_factor for m in max_lr] if isinstance(max_lr, list | tuple) else max_lr / div_factor
    shape = jnp.shape(_as_lr(start))
    for name, value in [("max_lr", max_lr)] + (
        [("max_momentum", max_momentum), ("base_momentum", base_momentum)] if cycle_momentum else []
    ):
        _format_param(name, shape, value)  # torch's per-group length checks, in its order
    if phases[0]["end_step"] == 0.0:  # torch's initial step divides by the phase length
        raise ZeroDivisionError("float division by zero")
    return Schedule(spec, lr, start_lr=start)


def swalr(
    lr: Any, swa_lr: float | Sequence[float], anneal_epochs: int = 10, anneal_strategy: str = "cos"
) -> Schedule:
    r"""``torch.optim.swa_utils.SWALR``: anneal from ``lr`` to ``swa_lr`` over ``anneal_epochs``.

    With :math:`\alpha(t)` = :math:`\frac{1 - \cos \pi t}{2}` (cos) or :math:`t`
    (linear) and :math:`t = \min(1, s / \max(1, A))` at scheduler step :math:`s`, each
    step recovers the previous start value and returns
    :math:`\eta = \alpha\,\eta_{swa} + (1 - \alpha)\,\eta_{prev}`, as torch.

    Args:
      lr: the optimizer's learning rate (or one per group).
      swa_lr: the SWA learning rate (or one per group).
      anneal_epochs: steps of annealing, an integer >= 0, default 10.
      anneal_strategy: ``"cos"`` (default) or ``"linear"``.

    Returns:
      A :class:`Schedule`.

    Raises:
      ValueError: ``anneal_strategy must be one of 'cos' or 'linear', instead got …``;
        ``anneal_epochs must be equal or greater than 0, got …``; ``swa_lr must have
        the same length as optimizer.param_groups. …``.

    Examples:
      >>> import functorch_optim as fo
      >>> s = fo.schedules.swalr(1.0, swa_lr=0.5, anneal_epochs=2, anneal_strategy="linear")
      >>> s.values(3).round(6).tolist()
      [1.0, 0.75, 0.5, 0.5]

    References:
      Izmailov et al., "Averaging Weights Leads to Wider Optima and Better
      Generalization", UAI 2018. Mirrors ``torch.optim.swa_utils.SWALR``.
    """
    shape = jnp.shape(_as_lr(lr))
    _format_param("swa_lr", shape, swa_lr)
    if anneal_strategy not in ["cos", "linear"]:
        raise ValueError(f"anneal_strategy must be one of 'cos' or 'linear', instead got {anneal_strategy}")
    if not isinstance(anneal_epochs, int) or anneal_epochs < 0:
        raise ValueError(f"anneal_epochs must be equal or greater than 0, got {anneal_epochs}")
    return Schedule(_SWALR(swa_lr, anneal_epochs, anneal_strategy), lr)


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


# ----------------------------------------------------------------------------- ReduceLROnPlateau
class PlateauState(NamedTuple):
    """The state of ``reduce_lr_on_plateau``, torch's attribute names.

    Attributes:
      best: the best metric seen (``inf`` / ``-inf`` before the first).
      num_bad_epochs: consecutive steps without improvement (int32).
      cooldown_counter: steps of cooldown left (int32).
      last_epoch: metric steps taken (int32).
    """

    best: jax.Array
    num_bad_epochs: jax.Array
    cooldown_counter: jax.Array
    last_epoch: jax.Array


class _PlateauSchedule(Schedule):
    def __init__(
        self, lr, mode, factor, patience, threshold, threshold_mode, cooldown, min_lrs, eps
    ):  # fmt: skip
        self._spec = None
        self.lr, self.key = lr, "lr"
        self._start_lr = _as_lr(lr)
        self.mode, self.factor, self.patience = mode, factor, patience
        self.threshold, self.threshold_mode = threshold, threshold_mode
        self.cooldown, self.eps = cooldown, eps
        self.min_lrs = min_lrs
        self.mode_worse = math.inf if mode == "min" else -math.inf

    @property
    def name(self) -> str:
        return "ReduceLROnPlateau"

    @property
    def momentum(self) -> Schedule:
        raise ValueError("ReduceLROnPlateau does not cycle momentum")

    def init_state(self) -> PlateauState:
        return PlateauState(_f(self.mode_worse), _i(0), _i(0), _i(0))

    def init_schedule(self):
        return self._start_lr, self.init_state()

    def step_schedule(self, value, state, count=None):
        return value, state  # the lr moves only with a metric: ``step(state, metric)``

    @property
    def step_key(self) -> Any:
        return (type(self), self.key)  # the step leaves the lr alone, whatever the arguments

    @property
    def update_key(self) -> Any:
        """Hashable, equal for two plateau schedules whose ``update`` computes the same
        (every argument but the starting lr)."""
        return _value_key({k: v for k, v in vars(self).items() if k not in ("lr", "_start_lr")})

    def check_hparams(self, name, hparams):
        return None

    def _is_better(self, a, best):
        if self.mode == "min" and self.threshold_mode == "rel":
            return a < best * (1.0 - self.threshold)
        if self.mode == "min":
            return a < best - self.threshold
        if self.threshold_mode == "rel":
            return a > best * (self.threshold + 1.0)
        return a > best + self.threshold

    def update(self, lr: Any, state: PlateauState, metric: Any) -> tuple[jax.Array, PlateauState]:
        """torch's ``ReduceLROnPlateau.step(metrics)`` on a learning rate (or per-group lrs).

        Args:
          lr: the current learning rate(s).
          state: a ``PlateauState``.
          metric: the monitored quantity (a number or 0-d array; may be traced).

        Returns:
          ``(new_lr, new_state)``.
        """
        current = _f(metric)
        lr = jnp.asarray(lr)
        better = self._is_better(current, state.best)
        best = jnp.where(better, current, state.best)
        bad = jnp.where(better, 0, state.num_bad_epochs + 1)
        in_cooldown = state.cooldown_counter > 0
        cooldown = jnp.where(in_cooldown, state.cooldown_counter - 1, state.cooldown_counter)
        bad = jnp.where(in_cooldown, 0, bad)
        reduce = bad > self.patience
        old = _f(lr)
        new = jnp.maximum(old * self.factor, jnp.asarray(self.min_lrs).reshape(old.shape))
        new_lr = jnp.where(reduce & (old - new > self.eps), new, old).astype(lr.dtype)
        cooldown = jnp.where(reduce, self.cooldown, cooldown)
        bad = jnp.where(reduce, 0, bad)
        new_state = PlateauState(
            best, bad.astype(jnp.int32), cooldown.astype(jnp.int32), state.last_epoch + 1
        )
        return new_lr, new_state

    def step(self, opt_state: PyTree, metric: Any) -> PyTree:
        """``scheduler.step(metric)`` on an optimizer state: a new state with the lr updated.

        Every optimizer (sub-)state whose ``lr`` is driven by a ``reduce_lr_on_plateau``
        schedule is updated (one per param group; all see the same metric, as torch's
        groups do). Pure and jit-compatible.

        Raises:
          ValueError: if no ``lr`` in ``opt_state`` is driven by ``reduce_lr_on_plateau``.
        """
        found = []

        def visit(node):
            if isinstance(node, HParams) and isinstance(node.schedule_state.get("lr"), PlateauState):
                found.append(True)
                lr, st = self.update(node["lr"], node.schedule_state["lr"], metric)
                return node.replace(lr=lr).with_schedule_state({**node.schedule_state, "lr": st})
            return node

        new = jax.tree.map(visit, opt_state, is_leaf=lambda x: isinstance(x, HParams))
        if not found:
            raise ValueError(
                "ReduceLROnPlateau.step: no lr in the optimizer state is driven by reduce_lr_on_plateau; "
                "build the optimizer with lr=fo.schedules.reduce_lr_on_plateau(...)"
            )
        return new

    def values(self, n: int) -> np.ndarray:
        raise ValueError("ReduceLROnPlateau needs metrics: use update(lr, state, metric)")


def reduce_lr_on_plateau(
    lr: Any,
    mode: str = "min",
    factor: float = 0.1,
    patience: int = 10,
    threshold: float = 1e-4,
    threshold_mode: str = "rel",
    cooldown: int = 0,
    min_lr: float | Sequence[float] = 0,
    eps: float = 1e-8,
) -> Schedule:
    r"""``torch.optim.lr_scheduler.ReduceLROnPlateau``, a pure function of (state, metric).

    Each ``step(opt_state, metric)``: the metric is *better* if below ``best * (1 -
    threshold)`` (``min``/``rel``; ``best - threshold`` for ``abs``; mirrored for
    ``max``); otherwise ``num_bad_epochs`` grows. During cooldown bad epochs are
    ignored. When ``num_bad_epochs > patience`` (torch's strict ``>``) each lr becomes
    ``max(lr * factor, min_lr)`` unless that changes it by ``eps`` or less, and cooldown
    starts. Optimizer steps never move it.

    Args:
      lr: the optimizer's learning rate (or one per group).
      mode: ``"min"`` (default) or ``"max"``.
      factor: reduction factor, < 1, default 0.1.
      patience: tolerated bad steps, default 10.
      threshold: significance threshold, default 1e-4.
      threshold_mode: ``"rel"`` (default) or ``"abs"``.
      cooldown: steps to wait after a reduction, default 0.
      min_lr: lower bound, or one per group, default 0.
      eps: minimal change applied, default 1e-8.

    Returns:
      A :class:`Schedule` with ``step(opt_state, metric) -> opt_state`` and
      ``update(lr, state, metric) -> (lr, state)``.

    Raises:
      ValueError: torch's texts: ``Factor should be < 1.0.``, ``expected {n} min_lrs, got
        {m}``, ``mode … is unknown!``, ``threshold mode … is unknown!``.

    Examples:
      >>> import jax.numpy as jnp, functorch_optim as fo
      >>> plateau = fo.schedules.reduce_lr_on_plateau(0.1, patience=0)
      >>> tx = fo.sgd(lr=plateau)
      >>> state = tx.init({"w": jnp.zeros(1)})
      >>> for loss in [1.0, 2.0]:
      ...     state = plateau.step(state, loss)
      >>> round(float(fo.get_hparams(state)["lr"]), 6)
      0.01
    """
    if factor >= 1.0:
        raise ValueError("Factor should be < 1.0.")
    n = _n_groups(lr)
    shape = jnp.shape(_as_lr(lr))
    if isinstance(min_lr, list | tuple):
        if len(min_lr) != n:
            raise ValueError(f"expected {n} min_lrs, got {len(min_lr)}")
        min_lrs = _f(list(min_lr)).reshape(shape)
    else:
        min_lrs = jnp.broadcast_to(_f(min_lr), shape)
    if mode not in {"min", "max"}:
        raise ValueError("mode " + mode + " is unknown!")
    if threshold_mode not in {"rel", "abs"}:
        raise ValueError("threshold mode " + threshold_mode + " is unknown!")
    return _PlateauSchedule(lr, mode, factor, patience, threshold, threshold_mode, cooldown, min_lrs, eps)
