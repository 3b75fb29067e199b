"""The engine under every schedule: torch's scheduler protocol, ``Schedule``, the arithmetic.

``_Spec`` emulates one ``LRScheduler`` class over a param-group dict of arrays;
:class:`Schedule` binds it to an initial learning rate as the value an optimizer takes; the
helpers compute in float64 and round like torch's Python expressions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal

from functorch_optim._hyperparams import hparam_dtype
from functorch_optim._torch_ops import true_divide

Group = dict[str, Any]
SState = dict[str, Any]


# ----------------------------------------------------------------------------- arithmetic
def _f(x: Any) -> jax.Array:
    """A value as an array of the hyperparameter dtype (float64 under x64)."""
    return jnp.asarray(x, hparam_dtype())


def _i(x: Any) -> jax.Array:
    return jnp.asarray(x, jnp.int32)


def _div(a: Any, b: Any) -> jax.Array:
    """``a / b`` as an IEEE division: ``_torch_ops.true_divide``'s, whose divisor is
    never a constant to XLA (which turns ``x / c`` into ``x * (1/c)``, also through an
    ``optimization_barrier`` it removes: ``(0.2 / 25) / 1e4`` was ``8.000000000000001e-07``
    in OneCycleLR's ``min_lr``)."""
    a, b = _f(a), _f(b)
    return true_divide(jnp.broadcast_to(a, jnp.broadcast_shapes(a.shape, b.shape)), b)


@jax.custom_jvp
def _rounded(x: jax.Array) -> jax.Array:
    """``x`` as Python holds a float: rounded on its own, never contracted into what reads it.

    XLA's CPU code generator contracts a product into the add or subtract that takes it
    (one FMA, one rounding where Python rounds twice). ``_torch_ops.stored``'s select stops
    it where the product might be NaN, but LLVM proves a product of an integer's
    conversion and a constant never is (``0.1 * e``: 21 of 400 values ``1 / (1 + 0.1 *
    e)`` differed) and drops the select. Here the bits go through a signed ``min`` with
    the positive quiet NaN's: every number, infinity and negative NaN is its own bits
    (their signed integers are smaller), a positive NaN is a NaN; no analysis of a float
    bounds its bits, so the product reaches the add only as a ``min`` of integers. (Not
    for the rules' arrays: there LLVM vectorizes across short rows, and which of a
    ``stored`` and this keeps every lane's FMA depends on the shape, e.g. a vmapped
    AdamW's ``(2, 3)`` moment; the select is what their tests pin.)"""
    signed = jnp.dtype(f"int{jnp.finfo(x.dtype).bits}")
    quiet_nan = np.asarray(np.nan, x.dtype).view(signed)
    i = jax.lax.bitcast_convert_type(x, signed)
    return jax.lax.bitcast_convert_type(jnp.minimum(i, quiet_nan), x.dtype)


_rounded.defjvp(lambda primals, tangents: (_rounded(*primals), *tangents))  # the identity's


def _mul(a: Any, b: Any) -> jax.Array:
    """``a * b`` rounded on its own, as Python's float product is before the sum that
    takes it."""
    return _rounded(_f(a) * _f(b))


def _stored_lr(values: Any, like: Any) -> jax.Array:
    """A scheduler's new lr as torch stores it, a float in the param group: rounded on its
    own, so that no product computing it is contracted into what reads it (the next
    scheduler of a chain, the step)."""
    return jnp.broadcast_to(_rounded(_f(values)), jnp.shape(like))


def python_arithmetic(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` traced, with its float arithmetic rounded as Python's: each product
    on its own (``_rounded``), each quotient a division.

    A user's ``lr_lambda`` or ``scale_fn`` is Python that torch runs on Python floats,
    where every operation rounds. Traced as it is, XLA contracts a product into the sum
    that takes it (``1 / (1 + 0.1 * e)``: one FMA) and turns a division by a constant
    into a multiplication by its reciprocal (``e / 10``: 701 of the quotients of 0..1999
    an ulp off). Here ``fn`` is traced to a jaxpr and evaluated again: every floating
    ``mul``, ``integer_pow`` and ``square`` ``_rounded``, every floating ``div`` ``_div``'s
    division, inside nested ``jit`` calls too (``jnp.where``'s); any other primitive is
    bound as traced. Transcendentals stay XLA's: on 200,000 arguments in [0, pi)
    ``jnp.cos``, ``jnp.log`` and ``jnp.power`` gave C's bits, ``jnp.exp`` differed on 13%."""
    # a fresh function each call: ``make_jaxpr`` caches traces by function, and a lambda
    # may read a value that changed since (a schedule built again after it did)
    closed, shape = jax.make_jaxpr(lambda *a: fn(*a), return_shape=True)(*args)
    out = _eval_rounded(closed.jaxpr, closed.consts, jax.tree.leaves(args))
    return jax.tree.unflatten(jax.tree.structure(shape), out)


_ROUNDED = frozenset({"mul", "integer_pow", "square"})


def _eval_rounded(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name, inner = eqn.primitive.name, eqn.params.get("jaxpr")
        floating = all(jnp.issubdtype(v.aval.dtype, jnp.floating) for v in eqn.outvars)
        if isinstance(inner, ClosedJaxpr) and name in ("jit", "pjit", "closed_call"):
            outs = _eval_rounded(inner.jaxpr, inner.consts, invals)
        elif name == "div" and floating:
            outs = [true_divide(*invals)]
        else:
            outs = eqn.primitive.bind(*invals, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
            if name in _ROUNDED and floating:
                outs = [_rounded(x) for x in outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


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


# ----------------------------------------------------------------------------- torch's LRScheduler
def _value_key(x: Any) -> Any:
    """A hashable stand-in for ``x``, equal for two values that a jitted step bakes in
    identically: numbers by type and exact value (``-0.0`` is not ``0.0``), sequences,
    mappings and arrays by content, a scheduler spec by its class and attributes.

    Raises:
      TypeError: ``x`` holds anything else, user code in particular (a ``lr_lambda``, a
        ``scale_fn``): it may read values that change, so it is never shared.
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
    raise TypeError(f"a {type(x).__name__} in a schedule is not compared by value")


class _ByValue:
    """``obj`` as a static ``jax.jit`` argument that compares by ``key`` (default
    ``_value_key(obj)``): equal schedules (another instance, the same arguments) hit the
    same compiled step. Where ``_value_key`` refuses (user code), it equals only itself:
    its own compilation, as a fresh ``jax.jit`` would have."""

    def __init__(self, obj: Any, key: Any = None) -> None:
        self.obj = obj
        if key is None:
            try:
                key = _value_key(obj)
            except TypeError:
                key = ("unshared", object())
        self._key = key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ByValue) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)


class _Spec:
    """One torch scheduler class, emulated over a param-group dict of arrays.

    The methods mirror ``LRScheduler``'s: ``construct`` is ``__init__`` (including the
    initial step), ``step`` is ``step()``, ``update_lr`` is ``_update_lr(epoch)``,
    ``undo`` is ``SequentialLR.recursive_undo``. ``is_initial`` is torch's
    ``_initial_mode`` flag, a Python bool: it is only true at construction.
    """

    name = "LRScheduler"
    cycles_momentum = False
    eager = False  # True: calls user Python code with concrete values; steps run outside jit

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
        group["lr"] = _stored_lr(values, group["lr"])
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
          TypeError: the schedule holds user code or another value ``_value_key`` does
            not compare (such a schedule is not shared).
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
        return values_of([self], n)[0]

    def __call__(self, count: Any) -> jax.Array:
        value, state = self.init_schedule()

        def body(_, carry):
            return self.step_schedule(*carry)

        return jax.lax.fori_loop(0, count, body, (value, state))[0]


def values_of(schedules: Sequence[Schedule], n: int) -> list[np.ndarray]:
    """``[s.values(n) for s in schedules]``, the steps of all in one compiled program.

    Each schedule starts op by op (``init_schedule``, as an optimizer built with it does)
    and takes its ``n`` steps in a ``lax.scan`` of its own; the scans of all schedules
    are one program, compiled once, where a program per schedule costs a compilation
    each (the parity report's scheduler rows). Up to 16 steps run op by op: no
    compilation for a short look.
    """
    starts = [s.init_schedule() for s in schedules]
    if not starts:
        return []
    if n <= 16:
        out = []
        for sched, (value, state) in zip(schedules, starts, strict=True):
            seq = [value]
            for _ in range(n):
                value, state = sched.step_schedule(value, state)
                seq.append(value)
            out.append(np.asarray(jnp.stack([jnp.asarray(v) for v in seq])))
        return out
    rests = _run(list(schedules), starts, int(n))
    return [
        np.asarray(jnp.concatenate([jnp.asarray(value)[None], rest]))
        for (value, _), rest in zip(starts, rests, strict=True)
    ]


def _run(schedules: list[Schedule], starts: list[tuple[Any, Any]], n: int) -> list[jax.Array]:
    def steps(sched, value, state):
        def body(carry, _):
            v, s = sched.step_schedule(*carry)
            return (v, s), v

        return jax.lax.scan(body, (value, state), None, length=n)[1]

    @jax.jit
    def scan(starts):
        return [steps(s, v, st) for s, (v, st) in zip(schedules, starts, strict=True)]

    return scan(starts)


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)
