"""The engine behind every torch-parity optimizer: one per-parameter rule, tree-mapped.

An algorithm is written once, as torch's ``_single_tensor_<name>`` loop body for one
parameter (``Algorithm.step_leaf``). ``make_optimizer`` turns it into an optax
``GradientTransformationExtraArgs`` whose state is a ``TorchState``:

* ``hparams``: an ``HParams`` node, numeric hyperparameters as arrays;
* ``count``: optimizer steps taken (schedules index with it);
* ``buffers``: torch's per-parameter state by torch's names (``step``,
  ``momentum_buffer``, ``exp_avg``, ...), each a tree shaped like the params.

Semantics shared by all algorithms:

* a ``None`` gradient leaf skips that parameter: its value and state stay bit-for-bit
  unchanged (torch's ``if p.grad is None: continue``), and its update is ``None``;
* ``step`` counts the gradients a parameter has received, so a parameter whose first
  gradient arrives late starts from step 1 (torch's lazy state). Parameters whose steps
  are equal by construction (they have stepped together since ``init``) hold one counter
  array, which the state flattens to once (``TorchState.step_groups``,
  ``advance_counters``): a step over many parameters moves one counter, as optax's
  ``count``, and their step-dependent scalars (Adam's bias corrections) are computed
  once;
* the optional extra argument ``grad_mask`` (a tree of boolean scalars) marks leaves as
  "no gradient" dynamically, with the same effect as a ``None`` leaf.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import operator
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax._src.interpreters.partial_eval import DynamicJaxprTracer as _STAGED

from functorch_optim._checks import squeeze_lr
from functorch_optim._hyperparams import (
    FIXED,
    HParams,
    Validator,
    as_hparam,
    check_number,
    has_tracer,
    to_python,
    warn_float32_hparams,
)
from functorch_optim._sharding import sharded_init
from functorch_optim._tree import PyTree, check_like_params, check_params, grad_mask_leaves, is_none

StepFn = Callable[..., tuple[PyTree, PyTree]]

#: Attribute name under which a transformation's ``update`` function carries its exact
#: ``(params, grads, state) -> (params, state)`` step (see ``step``).
STEP_ATTR = "fo_step"

#: Attribute name under which a transformation's ``update`` function carries its
#: ``Algorithm`` (the imperative facade reads torch's state layout from it).
ALGORITHM_ATTR = "fo_algorithm"

#: Attribute name under which a ``fused=True`` transformation's ``update`` function
#: carries ``grad_accumulate``'s one-kernel call (``window_step`` in ``make_optimizer``).
WINDOW_ATTR = "fo_window_step"


class TorchState(NamedTuple):
    """State of a torch-parity optimizer.

    Attributes:
      hparams: the numeric hyperparameters (``get_hparams`` / ``set_hparams``).
      count: number of optimizer steps taken, an int32 scalar.
      buffers: torch's per-parameter state by name; each value is a tree shaped like
        the params. Also readable as attributes: ``state.momentum_buffer``.
      step_groups: which parameters share one ``step`` counter, recorded when the
        state is unflattened (``None``: read from the arrays' identity). Parameters
        that have received the same gradients since ``init`` have equal steps; the
        engine gives them one counter array, which ``buffers["step"]`` holds at each of
        their places, and the state flattens to that array once (``advance_counters``,
        ``own_counters``). Never needed by a reader.
    """

    hparams: HParams
    count: jax.Array
    buffers: dict[str, PyTree]
    step_groups: Any = None

    def __getattr__(self, name: str) -> PyTree:
        if name.startswith("__"):
            raise AttributeError(name)
        buffers = tuple.__getitem__(self, 2)
        if name in buffers:
            return buffers[name]
        raise AttributeError(f"{type(self).__name__} has no buffer {name!r}; it has {sorted(buffers)}")


@dataclasses.dataclass(frozen=True)
class _Counters:
    """How a ``TorchState``'s ``step`` tree holds its counters (its ``step_groups``, and
    its pytree metadata): per place of the tree (``where``, its structure with ``None``
    places as leaves: not a parameter), the index of the counter it holds among the
    distinct ones (-1 at a ``None``). ``shared``: some places hold one counter, and
    ``buffers["step"]`` flattens to the list of distinct counters; else to itself."""

    groups: tuple[int, ...]
    where: Any
    shared: bool

    def __getstate__(self) -> dict[str, Any]:
        # the fields; not the pickers below (cached on first use: functions)
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    # the record is the pytree metadata of every state it describes: these pickers turn
    # the Python loops of each jitted call's flatten and unflatten into C calls
    @functools.cached_property
    def _first(self) -> dict[int, int]:
        # per counter, the place where it first appears
        first: dict[int, int] = {}
        for i, g in enumerate(self.groups):
            if g >= 0:
                first.setdefault(g, i)
        return first

    @functools.cached_property
    def pick_first(self) -> Callable[[list], tuple]:
        """Per place, the place where its counter first appears (-1: ``None``)."""
        return _picker([self._first[g] if g >= 0 else -1 for g in self.groups])

    @functools.cached_property
    def pick_counters(self) -> Callable[[list], tuple]:
        """The distinct counters from the places, in group order."""
        return _picker([self._first[g] for g in range(len(self._first))])

    @functools.cached_property
    def pick_places(self) -> Callable[[list], tuple]:
        """The places from ``[*counters, None]``."""
        return _picker(self.groups)

    def __repr__(self) -> str:
        if not self.shared:
            return "<a step counter per parameter>"
        # shown in JAX's structure-mismatch errors (a loop carry): say what to do
        return (
            f"<step counters shared by parameters: {self.groups}; a step that skips some "
            "parameters or takes a grad_mask gives them their own, fo.own_counters(state) "
            "does so beforehand>"
        )


def _held(record: Any, steps: PyTree) -> list | None:
    """The places of ``steps`` if ``record`` (a state's ``step_groups``) still describes
    them: every place holds its counter's object (a tree map may have put ``None`` or one
    constant at several places: they keep their counters). ``None`` otherwise."""
    if not isinstance(record, _Counters):
        return None
    try:
        positions = record.where.flatten_up_to(steps)
    except (ValueError, TypeError):
        return None
    # each place against the object at its counter's first place (None at -1), in C
    expected = record.pick_first([*positions, None])
    return positions if all(map(operator.is_, positions, expected)) else None


def _record(steps: PyTree) -> tuple[_Counters, list]:
    """The counters of a ``step`` tree the engine or a user built: places that hold one
    array are one counter (the engine puts one array object wherever the counters are
    equal by construction, never elsewhere)."""
    positions, where = jax.tree.flatten(steps, is_leaf=_counter_place)
    first: dict[Any, int] = {}
    groups = tuple(-1 if x is None else first.setdefault(_place_key(x), len(first)) for x in positions)
    return _Counters(groups, where, len(first) < sum(g >= 0 for g in groups)), positions


def _picker(indices: list[int] | tuple[int, ...]) -> Callable[[list], tuple]:
    """``seq -> tuple(seq[i] for i in indices)``, run in C (``operator.itemgetter``, which
    returns a bare item for one index)."""
    if len(indices) == 1:
        (i,) = indices
        return lambda seq: (seq[i],)
    return operator.itemgetter(*indices) if indices else lambda seq: ()


def _place_key(x: Any) -> Any:
    # a counter is its array (in wrappers of one structure, so that either wrapper can
    # stand at both places)
    if isinstance(x, jax.Array):
        return id(x)
    leaves, structure = jax.tree.flatten(x)
    return (id(leaves[0]) if leaves else None, structure)


def _counter_place(x: Any) -> bool:
    """Whether ``x`` is one place of a ``step`` tree: ``None`` (not a parameter), an
    array, or any other node holding one leaf (an nnx ``Variable`` around the counter in
    ``nnx.Optimizer``'s state: it stays the child that holds it, so that the container
    that made it can write it back)."""
    if x is None or isinstance(x, jax.Array):
        return True
    return not isinstance(x, Mapping | list | tuple) and len(jax.tree.leaves(x)) == 1


def _flatten_state(state: TorchState) -> tuple[list, Any]:
    """The children (hparams, count, buffers with each shared counter once) and the
    counters' record: run at every jitted call, so no keys and no Python loops."""
    hparams, count, buffers = state[:3]
    steps = buffers.get("step")
    if steps is None:
        return [hparams, count, buffers], None
    record = state.step_groups
    positions = _held(record, steps)
    if positions is None:
        record, positions = _record(steps)
    if not record.shared:
        return [hparams, count, buffers], record
    return [hparams, count, {**buffers, "step": list(record.pick_counters(positions))}], record


def _flatten_state_with_keys(state: TorchState) -> tuple[list, Any]:
    children, record = _flatten_state(state)
    return list(zip((_HPARAMS, _COUNT, _BUFFERS), children)), record


def _unflatten_state(record: Any, children: Any) -> TorchState:
    hparams, count, buffers = children
    if record is None or not record.shared:
        return TorchState(hparams, count, buffers, record)
    counters = buffers["step"]
    steps = record.where.unflatten(record.pick_places([*counters, None]))
    return TorchState(hparams, count, {**buffers, "step": steps}, record)


_HPARAMS, _COUNT, _BUFFERS = (jax.tree_util.GetAttrKey(n) for n in ("hparams", "count", "buffers"))
jax.tree_util.register_pytree_with_keys(
    TorchState, _flatten_state_with_keys, _unflatten_state, _flatten_state
)


def own_counters(tree: PyTree) -> PyTree:
    """Give every parameter its own ``step`` counter in each optimizer state of ``tree``,
    or, given a transformation, one whose ``init`` does.

    Parameters that have received the same gradients since ``init`` share one counter
    array (``TorchState``): a step every parameter takes moves one scalar, not one per
    parameter. A step where some parameters skip (a ``None`` gradient) or under a
    ``grad_mask`` gives the parameters whose steps may now differ counters of their
    own, so the state's tree structure changes once. ``jax.jit`` and the facade simply
    trace again; a ``jax.lax.scan``, ``fori_loop`` or ``while_loop`` needs one structure
    for its carry: give it ``own_counters(state)``, the layout such a step returns. A
    container that updates its state in place needs it from ``init`` on (flax's
    ``nnx.Optimizer`` under a ``grad_mask``: ``nnx.Optimizer(model, own_counters(tx),
    wrt=nnx.Param)``). The values and every later step are the same bits either way.

    Args:
      tree: any pytree holding optimizer states (a ``TorchState``, a
        ``grad_accumulate`` state, an ``optax.chain`` of them, ``(params, state)``), or
        an ``optax.GradientTransformation``.

    Returns:
      ``tree`` with each ``TorchState``'s counters as one array per parameter; for a
      transformation, the same transformation with an ``init`` that returns its state so.

    Examples:
      >>> import jax, jax.numpy as jnp, functorch_optim as fo
      >>> tx = fo.adam(lr=0.1)
      >>> params = {"a": jnp.ones(2), "b": jnp.ones(3)}
      >>> state = tx.init(params)
      >>> len(jax.tree.leaves(fo.own_counters(state))) - len(jax.tree.leaves(state))  # a counter more
      1
      >>> def body(carry, mask):  # a grad_mask step in a scan
      ...     params, state = carry
      ...     grads = jax.tree.map(jnp.ones_like, params)
      ...     return fo.step(tx, params, grads, state, grad_mask={"a": mask, "b": True}), None
      >>> (params, state), _ = jax.lax.scan(body, (params, fo.own_counters(state)), jnp.array([True, False]))
      >>> jax.tree.map(int, state.step)
      {'a': 1, 'b': 2}
    """

    if isinstance(tree, optax.GradientTransformation):
        init = tree.init
        return tree._replace(init=lambda params: own_counters(init(params)))

    def own(x: Any) -> Any:
        if not isinstance(x, TorchState) or not getattr(_flatten_state(x)[1], "shared", False):
            return x  # nothing shared
        steps = jax.tree.map(lambda s: jnp.array(s, copy=True), x.buffers["step"])
        return x._replace(buffers={**x.buffers, "step": steps}, step_groups=_record(steps)[0])

    return jax.tree.map(own, tree, is_leaf=lambda x: isinstance(x, TorchState))


def share_counters(values: list, treedef: Any) -> PyTree:
    """A ``step`` tree of ``treedef`` (the params') from per-parameter values (Python
    ints or arrays): one int32 array per distinct value, at every place that has it, so
    the state keeps one counter for parameters with equal steps (``TorchState``)."""
    arrays: dict[Any, jax.Array] = {}
    out = []
    for v in values:
        key = int(v)
        if key not in arrays:
            arrays[key] = jnp.asarray(key, jnp.int32)
        out.append(arrays[key])
    return treedef.unflatten(out)


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One torch algorithm, as a rule for a single parameter.

    Attributes:
      name: torch's class name (``"SGD"``).
      validate: ``(hparams, static) -> None``; raises torch's ValueError texts.
      init_leaf: ``(param, static) -> dict`` of initial buffers besides ``step``. A
        buffer that only some parameters have is ``None`` in the others' state (and
        ``step_leaf`` gets and returns ``None`` for it there).
      step_leaf: ``(param, grad, buffers, step, hparams, static) -> (new_param,
        new_buffers)``, torch's loop body for one parameter. ``step`` is the int32 count
        of gradients this parameter has received including this one (1 on its first
        step); ``hparams`` are arrays in the hyperparameter dtype (cast them to the
        parameter's compute dtype where torch would). ``step`` counts only the
        steps that ``advances`` allows, where it is set.
      torch_step: how torch's per-parameter state holds ``step`` (used by the facade's
        ``state_dict``): ``"tensor"`` (default), a 0-d float tensor of torch's default
        dtype, as Adam, AdamW, RMSprop, Adagrad, … keep it; ``"int"``, a Python int
        (SparseAdam); ``None``, no ``step`` at all (SGD).
      torch_state_at_init: whether torch creates a parameter's state in ``__init__``
        (Adagrad) rather than on its first gradient; default False.
      fused_step: optional; the rule for all parameters with a gradient at once,
        ``(leaves, hparams_of, static, one, delta) -> [(new_param, new_buffers), ...]``
        (with ``delta``, ``update``'s call, ``new_param - param`` in place of
        ``new_param``) with one
        ``(param, grad, buffers, step, grad_mask flag or None)`` per parameter (``step``
        the counter before this step, ``buffers`` without it), ``hparams_of(dtype)`` what
        ``step_leaf`` gets as ``hparams`` for that dtype and ``one`` the runtime 1 the
        counters advance by; the new buffers include the advanced ``step``, and it
        applies the masks itself (``masked``): kernels that update params, buffers and
        counters in place (``fused=True``, ``_fused.py``). When set, the engine calls it
        instead of ``step_leaf``.
      fused_window: optional, with ``fused_step``: ``(leaves, window, hparams_of, static,
        one) -> [(new_param, new_buffers, new_accumulator), ...]``, ``grad_accumulate``'s
        call in the same kernels (``_fused.Window``): it adds the gradient into the
        accumulator, or on the call that closes the window steps on the window's mean,
        in one pass. ``leaves`` holds every parameter (a ``None`` gradient: none in this
        call), each with its ``active`` flag (has a gradient in the window and the call
        steps).
      prepare: optional ``(hparams, dtype, static) -> mapping``: the scalar work of the
        rule that depends only on the hyperparameters and the parameter dtype (casts to
        the compute dtype, ``weight_decay != 0`` flags, ``-lr``, ...). The engine calls it
        once per parameter dtype and step and passes its result to ``step_leaf`` as
        ``hparams``, instead of each parameter repeating the same scalar ops (a step over
        1000 leaves would trace, lower and optimize them 1000 times). Default None:
        ``step_leaf`` gets the hyperparameters themselves.
      advances: optional ``(hparams, static) -> bool scalar``, from the state's
        hyperparameters: whether this step advances the per-parameter ``step``
        counters (the ``one`` that ``step_leaf``'s ``step`` and ``fused_step``'s
        counters advance by is 0 where not); default None, always (``step`` counts
        gradients). SGD with a buffer counts only the steps taken with momentum != 0
        (torch's buffer exists after the first of them).
      reads_step: whether ``step_leaf`` reads ``step`` (a bool, or ``static -> bool``);
        default True. Where it does not and every step advances the counters, each
        counter advances by the constant 1, one add per counter (a rule that reads
        ``step`` gets the runtime 1 of ``_runtime_one``). Only the compiled step's
        structure depends on it, never a value. Where nothing reads the counters (not
        the rule, not torch's state: ``torch_step`` None, and no buffer whose presence
        they would tell: SGD without momentum) the state keeps none (``keeps_step``).
      fused_fmas: whether ``step_leaf`` computes torch's fused multiply-adds
        (``_torch_ops.fma``: the exact emulation on a CPU that does not contract them),
        a bool or ``static -> bool``; default True. Where it does not (SGD without
        momentum, Adagrad: plain expressions), ``update`` on given gradients runs the
        rule at every size (``_fused.rule_for_update``).
    """

    name: str
    validate: Validator
    init_leaf: Callable[[jax.Array, Mapping[str, Any]], dict[str, jax.Array]]
    step_leaf: Callable[..., tuple[jax.Array, dict[str, jax.Array]]]
    torch_step: str | None = "tensor"
    torch_state_at_init: bool = False
    prepare: Callable[[Mapping[str, Any], Any, Mapping[str, Any]], Mapping[str, Any]] | None = None
    fused_step: Callable[..., list[tuple[jax.Array, dict[str, jax.Array]]]] | None = None
    fused_window: Callable[..., list[tuple[jax.Array, dict[str, jax.Array], jax.Array]]] | None = None
    advances: Callable[[Mapping[str, Any], Mapping[str, Any]], Any] | None = None
    reads_step: bool | Callable[[Mapping[str, Any]], bool] = True
    fixed_zero: tuple[str, ...] | Callable[[Mapping[str, Any]], tuple[str, ...]] = ()
    fixed_nonzero: tuple[str, ...] = ()
    fused_fmas: bool | Callable[[Mapping[str, Any]], bool] = True

    def for_static(self, name: str, static: Mapping[str, Any]) -> Any:
        """Field ``name`` (``reads_step``, ``fixed_zero``, ``fused_fmas``) for a step built
        with ``static``: its value, or where it is a function of ``static``, its result."""
        value = getattr(self, name)
        return value(static) if callable(value) else value


_CHANGEABLE: contextvars.ContextVar[bool] = contextvars.ContextVar("fo_changeable", default=False)


@contextlib.contextmanager
def changeable_hparams():
    """Within this context, optimizers are built as if every number could change: no
    hyperparameter's zero-ness is fixed (``Algorithm.fixed_zero``), and SGD and RMSprop
    keep a momentum buffer for a momentum of 0. The torch-shaped facade builds a group
    so when its ``param_groups`` edits cross what the compiled step fixed."""
    token = _CHANGEABLE.set(True)
    try:
        yield
    finally:
        _CHANGEABLE.reset(token)


def changeable() -> bool:
    """Whether ``changeable_hparams`` is active (factories read it for their buffers)."""
    return _CHANGEABLE.get()


def is_number(value: Any) -> bool:
    """Whether a hyperparameter value is a concrete number kept in the state (not a
    schedule, not a JAX array given as an input, not a tracer): its zero-ness may be
    fixed at construction."""
    return not (_is_scheduled(value) or isinstance(value, jax.Array) or has_tracer(value))


def _fixed_flags(
    algorithm: Algorithm, hparams: Mapping[str, Any], static: Mapping[str, Any]
) -> tuple[tuple[str, str], ...]:
    # the guard for a mismatched restored state poisons ``lr``: no lr, nothing is fixed
    if changeable() or "lr" not in hparams:
        return ()
    zeros = algorithm.for_static("fixed_zero", static)
    flags = {}
    for name, zero in [(n, True) for n in zeros] + [(n, False) for n in algorithm.fixed_nonzero]:
        value = hparams.get(name)
        if name in hparams and is_number(value) and (to_python(value) == 0) == zero:
            flags[name] = "zero" if zero else "nonzero"
    return tuple(sorted(flags.items()))


def fixed_guard(hp: Mapping[str, Any], static: Mapping[str, Any]) -> Mapping[str, Any]:
    """``hp`` with ``lr`` NaN where a value disagrees with the zero-ness the compiled step
    fixes (a state restored into a transformation built otherwise): such a step makes
    every parameter NaN instead of silently computing another rule. One scalar select
    per step; ``hp`` itself where nothing is fixed."""
    flags = dict(static.get(FIXED, ()))
    if not flags:
        return hp
    bad = [(hp[n] != 0) if how == "zero" else (hp[n] == 0) for n, how in flags.items()]
    mismatch = functools.reduce(jnp.logical_or, bad)
    lr = hp["lr"]
    return {**hp, "lr": jnp.where(mismatch, jnp.asarray(jnp.nan, jnp.result_type(lr)), lr)}


def make_optimizer(
    algorithm: Algorithm, hparams: Mapping[str, Any], static: Mapping[str, Any]
) -> optax.GradientTransformationExtraArgs:
    """Build the optax transformation of ``algorithm`` with validated hyperparameters.

    A hyperparameter given as a callable is a schedule: ``value = fn(count)``, where
    ``count`` is the number of optimizer steps taken; it is stored in the state and
    advances once per step. A stateful schedule (an object with ``init_schedule()`` and
    ``step_schedule(value, state, count)``, e.g. from ``functorch_optim.schedules``)
    keeps its own state in ``HParams.schedule_state`` and steps from the current value
    (torch's chainable form). A tuple hyperparameter (``betas``) may hold schedules
    among its entries; each entry is driven on its own.

    A numeric hyperparameter given as a JAX array (concrete or traced) is an input of
    this transformation rather than state: every ``update`` steps with the value the
    transformation was built with and records it in the state. That is the contract of
    ``optax.inject_hyperparams``, which rebuilds the transformation with the current
    values before each update. ``set_hparams`` refuses such a name (give a Python number
    to keep the value in the state instead). Construction-time checks are skipped for
    traced values.

    Raises:
      ValueError: torch's message for an invalid hyperparameter, raised here, at
        construction, before any state exists.
    """
    if "lr" in hparams:
        # torch's first check in every constructor: "Tensor lr must be 1-element"
        hparams = {**hparams, "lr": squeeze_lr(hparams["lr"])}
    schedules = {k: _driver(v) for k, v in hparams.items() if _is_scheduled(v)}
    injected = {k: v for k, v in hparams.items() if isinstance(v, jax.Array)}
    first, schedule_state = dict(hparams), {}
    for k, driver in schedules.items():
        first[k], schedule_state[k] = driver.init_schedule()
    if not has_tracer(first):
        algorithm.validate({k: to_python(v) for k, v in first.items()}, dict(static))
    for k, v in first.items():  # what no check of torch compared (a string dampening)
        check_number(algorithm.name, k, v)
    for k, driver in schedules.items():
        check = getattr(driver, "check_hparams", None)
        if check is not None:
            check(k, hparams)
    static = dict(static)
    flags = _fixed_flags(algorithm, hparams, static)
    if flags:
        static[FIXED] = flags

    def init(params: PyTree) -> TorchState:
        check_params(params, allow_empty=True)
        warn_float32_hparams()
        leaf_buffers = jax.tree.map(lambda p: algorithm.init_leaf(p, static), params)
        names = _buffer_names(leaf_buffers, params)
        buffers = {}
        if keeps_step(algorithm, static, names):
            # one counter for all: every parameter starts at step 0 (``TorchState``)
            zero = jnp.zeros((), jnp.int32)
            buffers["step"] = jax.tree.map(lambda p: zero, params)
        for name in names:
            buffers[name] = jax.tree.map(lambda _, b, n=name: b.get(n), params, leaf_buffers)
        # fresh buffers per init: a donated state must not alias another state, itself, or
        # the construction-time values every init starts from
        values = {k: as_hparam(v) for k, v in first.items()}
        values = jax.tree.map(lambda x: jnp.array(x, copy=True), values)
        sched_state = jax.tree.map(lambda x: jnp.array(x, copy=True), schedule_state)
        return TorchState(
            HParams(
                values,
                algorithm.name,
                algorithm.validate,
                static,
                tuple(sorted({*schedules, *injected})),
                sched_state,
            ),
            jnp.zeros((), jnp.int32),
            buffers,
        )

    def unpack(params, grads, state, grad_mask):
        # per leaf: (param, grad, buffers without step, step (None: no counters), grad_mask
        # flag or None)
        treedef = jax.tree.structure(params)
        p_leaves = treedef.flatten_up_to(params)
        g_leaves = treedef.flatten_up_to(grads)
        m_leaves = grad_mask_leaves(params, grad_mask) if grad_mask is not None else [None] * len(p_leaves)
        names = list(state.buffers)
        b_leaves = [
            _one_object_per_counter(treedef.flatten_up_to(b)) if n == "step" else treedef.flatten_up_to(b)
            for n, b in zip(names, state.buffers.values())
        ]
        olds = [{n: b_leaves[j][i] for j, n in enumerate(names)} for i in range(len(p_leaves))]
        leaves = [
            (p, g, {n: v for n, v in old.items() if n != "step"}, old.get("step"), m)
            for p, g, old, m in zip(p_leaves, g_leaves, olds, m_leaves)
        ]
        return treedef, leaves, olds

    def prepared(hp):
        # Algorithm.prepare's scalars, once per parameter dtype
        cache: dict[Any, Mapping[str, Any]] = {}

        def hparams_of(dtype: Any) -> Mapping[str, Any]:
            dtype = jnp.dtype(dtype)
            if algorithm.prepare is None:
                return hp
            if dtype not in cache:
                cache[dtype] = algorithm.prepare(hp, dtype, static)
            return cache[dtype]

        return hparams_of

    def advances_always(hp):
        return algorithm.advances is None or algorithm.advances(hp, static) is True

    def counter_one(state, hp):
        # what the counters advance by: 1, or 0 on a step ``algorithm.advances`` excludes
        one = _runtime_one(state.count)
        if advances_always(hp):
            return one
        return jnp.where(algorithm.advances(hp, static), one, jnp.zeros_like(one))

    # the rule reads no counter: each one advances by the constant 1, one add (the runtime
    # 1 of ``_runtime_one`` only keeps a rule that reads ``step`` from copying the counters)
    constant_counter = not _reads_step(algorithm, static)

    def current(state):
        # the values this step uses: the state's, with the injected ones replaced
        hparams = state.hparams
        if injected:
            hparams = hparams.replace(
                **{k: as_hparam(v, _hparam_dtype(hparams[k])) for k, v in injected.items()}
            )
        return hparams

    def advance(state, hparams, stepping=None):
        # the step count and the schedules move by one step (only where ``stepping``)
        count = state.count + 1
        hp = dict(hparams)
        if schedules:
            values, sched_state = {}, dict(hparams.schedule_state)
            for k, driver in schedules.items():
                value, sched_state[k] = driver.step_schedule(hp[k], sched_state[k], count)
                values[k] = as_hparam(value, _hparam_dtype(hp[k]))
            if stepping is not None:
                keep = lambda new, old: jnp.where(stepping, new, old)
                values = {k: jax.tree.map(keep, v, hp[k]) for k, v in values.items()}
                sched_state = jax.tree.map(keep, sched_state, dict(hparams.schedule_state))
            hparams = hparams.replace(**values).with_schedule_state(sched_state)
        if stepping is not None and injected:
            keep = lambda new, old: jnp.where(stepping, new, old)
            hparams = hparams.replace(
                **{k: jax.tree.map(keep, hparams[k], state.hparams[k]) for k in injected}
            )
        if stepping is not None:
            count = jnp.where(stepping, count, state.count)
        return hparams, count

    def rebuild(treedef, names, new_p, new_b, hparams, count):
        buffers = {n: treedef.unflatten([b[n] for b in new_b]) for n in names}
        return treedef.unflatten(new_p), TorchState(hparams, count, buffers)

    def run(params, grads, state, grad_mask, delta):
        # (new params, state); with ``delta`` (``update``) the updates ``new - param`` in
        # place of the new params, None where the gradient is None
        check_like_params(params, grads)
        treedef, leaves, olds = unpack(params, grads, state, grad_mask)
        hparams = current(state)
        hp = fixed_guard(dict(hparams), static)
        hparams_of = prepared(hp)
        one = counter_one(state, hp)
        rule_one = 1 if constant_counter and advances_always(hp) else one
        stepping = [i for i, leaf in enumerate(leaves) if leaf[1] is not None]
        if algorithm.fused_step is not None:
            outs = algorithm.fused_step([leaves[i] for i in stepping], hparams_of, static, one, delta)
        else:
            outs = [rule_step(algorithm, leaves[i], hparams_of, static, rule_one) for i in stepping]
            if delta:
                outs = [(new - leaves[i][0], b) for i, (new, b) in zip(stepping, outs)]
        results = dict(zip(stepping, outs))
        counters = advance_counters(leaves, [leaf[1] is not None for leaf in leaves], rule_one)
        # a None gradient: nothing moves
        new = [
            (results[i][0], {**results[i][1], **_counter(c)})
            if i in results
            else (None if delta else leaf[0], olds[i])
            for i, (leaf, c) in enumerate(zip(leaves, counters))
        ]
        hparams, count = advance(state, hparams)
        return rebuild(treedef, list(state.buffers), [p for p, _ in new], [b for _, b in new], hparams, count)

    def step_fn(params, grads, state, *, grad_mask=None, **extra_args):
        del extra_args
        return run(params, grads, state, grad_mask, delta=False)

    def window_step(params, grads, state, window, active):
        """``grad_accumulate``'s call through ``algorithm.fused_window``: ``window`` a
        ``_fused.Window`` (its ``accs`` a tree like ``params``), ``active`` a tree of
        flags like ``params``, each "has a gradient in the window and the call steps".
        Returns ``(params, acc, state)``; on a call that does not step, params, state,
        counters and schedules keep their bits."""
        treedef, leaves, _ = unpack(params, grads, state, active)
        hparams = current(state)
        hp = fixed_guard(dict(hparams), static)
        window = window._replace(accs=treedef.flatten_up_to(window.accs))
        one = counter_one(state, hp)
        outs = algorithm.fused_window(leaves, window, prepared(hp), static, one)
        counters = advance_counters(leaves, [True] * len(leaves), one)
        hparams, count = advance(state, hparams, window.stepping)
        new_params, new_state = rebuild(
            treedef,
            list(state.buffers),
            [p for p, _, _ in outs],
            [{**b, **_counter(c)} for (_, b, _), c in zip(outs, counters)],
            hparams,
            count,
        )
        return new_params, treedef.unflatten([a for _, _, a in outs]), new_state

    def update(grads, state, params=None, *, grad_mask=None, **extra_args):
        del extra_args
        if params is None:
            raise ValueError(f"{algorithm.name}: update() needs params (torch's rule reads them)")
        return run(params, grads, state, grad_mask, delta=True)

    step_fn, update = compiled_when_eager(step_fn), compiled_when_eager(update)
    setattr(update, STEP_ATTR, step_fn)
    setattr(update, ALGORITHM_ATTR, algorithm)
    if algorithm.fused_window is not None:
        window_step.ready = algorithm.fused_window.ready  # whether a call over given params can take it
        setattr(update, WINDOW_ATTR, window_step)
    # sharded or abstract params: each state leaf is created with its parameter's sharding
    return optax.GradientTransformationExtraArgs(sharded_init(init), update)


def compiled_when_eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, called through its own ``jax.jit`` when its arguments are concrete.

    Outside ``jit`` a rule would run op by op, each operation rounded on its own, where
    the compiled step contracts a product into the add that consumes it (one rounding,
    as torch's ``add_(alpha=)``, ``addcmul_`` and ``lerp_`` do): an eager step came out
    an ulp away from the jitted one, and from torch, on up to 64% of the elements. Through
    the jitted function an eager call runs the very program ``jax.jit(fo.step)`` runs,
    compiled once per transformation and argument structure. Called with a tracer
    (inside ``jit``, ``vmap``, ``grad``) or with a leaf that is not an array (a Python
    number among the params or grads, which the checks reject by name; a keyword's
    Python bool or number, a ``grad_mask`` flag or ``grad_accumulate``'s ``weight=``,
    is let through, traced as ``jit`` traces it, so a new value compiles nothing),
    ``fn`` runs as it is. A check of a keyword's value that a tracer would skip must
    run before the call (``grad_accumulate``'s weight)."""
    jitted = jax.jit(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if _all_concrete(args, kwargs):
            return jitted(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


def _all_concrete(args: Any, kwargs: Mapping[str, Any]) -> bool:
    return all(map(_concrete, jax.tree.leaves(args))) and all(
        isinstance(x, int | float) or _concrete(x)
        for x in jax.tree.leaves(kwargs)  # bools are ints
    )


def _concrete(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic) and not isinstance(x, jax.core.Tracer)


def rule_step(
    algorithm: Algorithm, leaf: tuple, hparams_of: Callable[[Any], Mapping[str, Any]], static, one: jax.Array
) -> tuple[jax.Array, dict[str, Any]]:
    """One parameter's step by ``algorithm.step_leaf``: ``leaf`` is ``(param, grad,
    buffers, step, grad_mask flag or None)`` as ``fused_step`` gets it. The rule reads
    ``step + one``; the mask keeps the parameter and its buffers where it is off. Returns
    ``(new_param, new_buffers)`` without the counter, which the engine advances
    (``advance_counters``).

    Inside ``jit`` the rule is traced once per parameter shape and dtype, not once per
    parameter: it is called as a nested ``jax.jit`` (``_staged_rule``), which a step over
    1000 equal leaves traces and lowers once and calls 1000 times; XLA inlines the calls
    before it optimizes, so the compiled step, and every bit it computes, is the same.
    """
    param, grad, buffers, step, active = leaf
    # ``one`` may be the Python int 1 (``make_optimizer``'s constant counter increment)
    const = one if isinstance(one, int) else None
    # a Python bool among the prepared scalars (a flag the compiled step fixes, as
    # ``in_use`` gives it) is part of the nested call's key, not an operand: an operand
    # would be a constant at every call site
    hp = hparams_of(param.dtype)
    flags = tuple(sorted((k, v) for k, v in hp.items() if isinstance(v, bool)))
    hp = {k: v for k, v in hp.items() if not isinstance(v, bool)}
    args = (param, grad, buffers, step, hp, None if const is not None else one, active)
    key = _static_key(static) if _all_staged(args) else None
    if key is not None:
        return _staged_rule(algorithm, key, const, flags, *args)
    return _rule(algorithm, static, const, flags, *args)


def _rule(algorithm: Algorithm, static, const, flags, param, grad, buffers, step, hp, one, active):
    hp = {**hp, **dict(flags)}
    # the rule reads the advanced counter; the engine stores it (``advance_counters``)
    new_step = None if step is None else step + (const if one is None else one)
    if active is None:
        new_param, new = algorithm.step_leaf(param, grad, buffers, new_step, hp, static)
        return new_param, dict(new)
    return _masked_rule(algorithm, static, param, grad, buffers, new_step, hp, active)


def _masked_rule(algorithm: Algorithm, static, param, grad, buffers, new_step, hp, active):
    """The rule under a ``grad_mask`` flag ``active``: ``masked``'s values. On the CPU
    the step is a ``lax.cond`` on the flag. Selected elementwise (``masked``), each new
    buffer has two readers, its select and the parameter's update, and XLA's CPU fusion
    computes it in both: twice the flops, and a copy of each donated buffer that the
    first pass overwrites and the second still reads (Adam over one array of 1M float32
    with a traced mask: 3.1 ms a step, 1.3 ms without the mask; with the cond 1.4 ms).
    Elsewhere the select, as before: a GPU's conditional waits for its flag on the host.
    """
    from functorch_optim._fused import kernel_or_rule  # it imports this module

    def stepped(param, grad, buffers, new_step, hp):
        new_param, new = algorithm.step_leaf(param, grad, buffers, new_step, hp, static)
        # a buffer this parameter does not have stays None (as in ``masked``)
        return new_param, {n: None if buffers[n] is None else new[n] for n in buffers}

    def kept(param, grad, buffers, new_step, hp):
        return param, dict(buffers)

    def branched(param, grad, buffers, new_step, hp, active):
        return jax.lax.cond(active, stepped, kept, param, grad, buffers, new_step, hp)

    def selected(param, grad, buffers, new_step, hp, active):
        return masked(active, *stepped(param, grad, buffers, new_step, hp), param, buffers)

    args = (param, grad, buffers, new_step, hp, active)
    return kernel_or_rule(branched, selected, *args, like=(param, dict(buffers)))


def advance_counters(leaves: list, stepping: list[bool], one: Any) -> list:
    """Each leaf's ``step`` counter after this step (``leaves`` as ``rule_step`` gets
    them): ``step + one`` where ``stepping`` and its mask flag (``None``: no mask) is on,
    its old counter where not, ``None`` for a state without counters.

    One array per distinct (counter, flag) pair: parameters that shared a counter and step
    alike share the new one, so a step every parameter takes keeps one counter, which the
    state flattens to once (``TorchState``): one scalar in and out of a jitted step and
    one add, where a counter per parameter was an array in and out (about a microsecond
    each on the CPU) and scalar kernels per parameter (Adam's bias corrections). A
    parameter that skips (a ``None`` gradient) keeps its counter object; one under a
    ``grad_mask`` gets its own.
    """
    memo: dict[tuple[int, int], Any] = {}
    out = []
    for (_, _, _, step, active), steps in zip(leaves, stepping):
        if step is None or not steps:
            out.append(step)
            continue
        key = (id(step), id(active))
        if key not in memo:
            new = step + one
            memo[key] = new if active is None else jnp.where(active, new, step)
        out.append(memo[key])
    return out


def _one_object_per_counter(steps: list) -> list:
    """The per-parameter counters with one object for each shared one. A container may
    hand each place a wrapper of its own around the shared array (an nnx ``Variable``
    in ``nnx.Optimizer``'s state): counters are the same where their arrays are."""
    first: dict[tuple[int, ...], Any] = {}
    return [s if s is None else first.setdefault(tuple(map(id, jax.tree.leaves(s))), s) for s in steps]


def _counter(step: Any) -> dict[str, Any]:
    return {} if step is None else {"step": step}


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _staged_rule(algorithm: Algorithm, static_key: tuple, const: int | None, flags: tuple, *args: Any):
    return _rule(algorithm, dict(static_key), const, flags, *args)


def _static_key(static: Mapping[str, Any]) -> tuple | None:
    """``static`` as a hashable key for ``_staged_rule``'s cache; None where a value is
    not hashable (the rule is then traced inline, as outside ``jit``)."""
    key = tuple(sorted(static.items()))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _all_staged(args: Any) -> bool:
    """Whether every array of ``args`` is a value being staged into a ``jit`` (and nothing
    else: no transformation's tracer, no concrete array, no Python number). Only then is
    the nested ``jit`` the same computation: outside ``jit`` the rule runs op by op, and a
    concrete value is computed at trace time, where a nested ``jit`` would compile it."""
    return all(isinstance(x, _STAGED) for x in jax.tree.leaves(args))


def masked(
    active: Any, new_param: jax.Array, new: Mapping[str, Any], param: jax.Array, old: Mapping[str, Any]
) -> tuple[jax.Array, dict[str, Any]]:
    """A parameter's step result under its ``grad_mask`` flag ``active`` (``None``: no
    mask): the new values where active, the old ones (bit for bit) where not. A buffer
    this parameter does not have (``None``) stays ``None``."""
    if active is None:
        return new_param, dict(new)
    where = lambda a, b: None if b is None else jnp.where(active, a, b)
    return where(new_param, param), {n: where(v, old[n]) for n, v in new.items()}


def keeps_step(algorithm: Algorithm, static: Mapping[str, Any], names: Any) -> bool:
    """Whether a state of ``algorithm`` keeps per-parameter ``step`` counters, given its
    other buffers' ``names``: unless nothing would read them. The rule does not
    (``reads_step``), torch's state has no ``step`` (``torch_step`` None), and there is no
    buffer whose presence in torch's state they would tell (torch creates a buffer on a
    parameter's first step: the facade exports it only where the counter moved). A
    counter per parameter is an array in and out of every jitted step (about a
    microsecond each on the CPU: a plain SGD step over 100 parameters of 1000 elements
    took half again as long as optax's with them)."""
    return algorithm.torch_step is not None or _reads_step(algorithm, static) or bool(names)


def _reads_step(algorithm: Algorithm, static: Mapping[str, Any]) -> bool:
    return bool(algorithm.for_static("reads_step", static))


def _runtime_one(count: jax.Array) -> jax.Array:
    """The int32 scalar 1, computed from ``count`` so that XLA cannot fold it to a constant.

    Each parameter's counter advances as ``step + one`` (the value of ``step + 1``).
    With a constant 1, XLA's CPU fusion re-derives ``step + 1`` from the old counter
    inside every fusion that reads it; the old counter then has readers besides the
    kernel that overwrites it in place (the counters are donated), and XLA copies every
    counter first: one more kernel per parameter, and more copy-insertion work, in the
    compile time of a step over many leaves. An add of two runtime scalars is not
    duplicated into its consumers, so each counter gets one scalar kernel, which the
    fusions read after it ran (``tests/test_base.py`` checks that no copies remain).
    ``(count | 1) & 1`` is 1 for every ``count``.
    """
    return (jnp.asarray(count).astype(jnp.int32) | 1) & 1


def _is_scheduled(value: Any) -> bool:
    if isinstance(value, tuple | list):
        return any(_is_scheduled(v) for v in value)
    return callable(value) or hasattr(value, "init_schedule")


def schedule_key(value: Any) -> Any:
    """Hashable, equal for two hyperparameter values whose schedules step identically: a
    schedule's ``step_key`` (``functorch_optim.schedules``), per entry for a tuple;
    ``None`` for a value without a schedule (its value is state). Two transformations
    of one algorithm whose states have one structure and whose hyperparameters have
    equal keys compute the same step.

    Raises:
      TypeError: the value holds user code (a plain ``count -> value`` function, a
        schedule built on a lambda): it may read values that change, so it is not
        compared; or it is a JAX array, an input the transformation holds (see
        ``make_optimizer``).
    """
    if isinstance(value, jax.Array):
        raise TypeError("a hyperparameter given as a JAX array is in the transformation: not compared")
    if not _is_scheduled(value):
        return None
    if isinstance(value, tuple | list):
        return tuple(schedule_key(v) for v in value)
    if not hasattr(value, "step_key"):
        raise TypeError(f"{value!r} is a plain function schedule: not compared by value")
    return value.step_key


def _hparam_dtype(value: Any) -> Any:
    return jnp.result_type(value[0] if isinstance(value, tuple) else value)


class _CountSchedule:
    """A plain ``count -> value`` function as a (stateless) schedule driver."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def init_schedule(self) -> tuple[Any, tuple]:
        return self.fn(0), ()

    def step_schedule(self, value: Any, state: tuple, count: jax.Array) -> tuple[Any, tuple]:
        del value
        return self.fn(count), state


class _TupleSchedule:
    """A tuple hyperparameter (``betas``) whose entries are constants or schedules."""

    def __init__(self, entries: tuple) -> None:
        self.entries = tuple(_driver(e) if _is_scheduled(e) else None for e in entries)
        self.constants = tuple(entries)

    def init_schedule(self) -> tuple[tuple, tuple]:
        entries = zip(self.entries, self.constants, strict=True)
        pairs = [d.init_schedule() if d is not None else (c, ()) for d, c in entries]
        return tuple(v for v, _ in pairs), tuple(s for _, s in pairs)

    def step_schedule(self, value: tuple, state: tuple, count: jax.Array) -> tuple[tuple, tuple]:
        pairs = [
            d.step_schedule(v, s, count) if d is not None else (v, s)
            for d, v, s in zip(self.entries, value, state, strict=True)
        ]
        return tuple(v for v, _ in pairs), tuple(s for _, s in pairs)

    def check_hparams(self, name: str, hparams: Mapping[str, Any]) -> None:
        for d in self.entries:
            check = getattr(d, "check_hparams", None)
            if check is not None:
                check(name, hparams)


def _driver(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return _TupleSchedule(tuple(value))
    if hasattr(value, "init_schedule"):
        return value
    return _CountSchedule(value)


def _buffer_names(leaf_buffers: PyTree, params: PyTree) -> list[str]:
    # The union over leaves: a buffer that only some parameters have (Adafactor's
    # ``row_var`` for matrices, ``variance`` for vectors) is ``None`` for the others.
    per_leaf = jax.tree.structure(params).flatten_up_to(leaf_buffers)
    return sorted({name for bufs in per_leaf for name in bufs})


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """``params + updates`` leafwise, keeping a parameter whose update is ``None``.

    Like ``optax.apply_updates``, but a ``None`` update (a parameter without gradient)
    leaves the parameter untouched instead of failing. Results keep the params' dtypes.
    """
    return jax.tree.map(
        lambda u, p: p if u is None else jnp.asarray(p + u).astype(jnp.asarray(p).dtype),
        updates,
        params,
        is_leaf=is_none,
    )


def step(
    tx: optax.GradientTransformation, params: PyTree, grads: PyTree, state: PyTree, **extra_args: Any
) -> tuple[PyTree, PyTree]:
    """One optimizer step: update and apply, as a pure function.

    For this package's transformations the new parameters are computed in torch's own
    operation order (``param.add_(buf, alpha=-lr)``, not ``param + (new - param)``);
    any other optax transformation goes through ``tx.update`` and ``apply_updates``.
    Called outside ``jit`` with concrete arrays, the step runs compiled (one ``jax.jit``
    per transformation: ``compiled_when_eager`` for this package's, a static ``tx`` for
    any other hashable one), so its bits are the jitted step's. Meant to be jitted with
    params and state donated::

        step = jax.jit(fo.step, static_argnums=0, donate_argnums=(1, 3))
        params, state = step(tx, params, grads, state)

    Args:
      tx: any optax-compatible gradient transformation.
      params: the parameter pytree.
      grads: gradients shaped like ``params``; a ``None`` leaf skips that parameter.
      state: ``tx``'s state.
      **extra_args: passed on to ``tx.update`` when it accepts extra arguments.

    Returns:
      ``(new_params, new_state)``.

    Examples:
      >>> import jax.numpy as jnp, functorch_optim as fo
      >>> tx = fo.sgd(lr=0.1)
      >>> params = {"w": jnp.array([1.0, 2.0])}
      >>> params, state = fo.step(tx, params, {"w": jnp.array([1.0, 1.0])}, tx.init(params))
      >>> params["w"].tolist()
      [0.9, 1.9]
    """
    fast = getattr(tx.update, STEP_ATTR, None)
    if fast is not None:
        return fast(params, grads, state, **extra_args)
    if _all_concrete((params, grads, state), extra_args) and _hashable(tx):
        # outside jit another transformation (an ``optax.chain`` around this package's)
        # runs compiled too: op by op, its own products and sums round otherwise
        return _compiled_update_step(tx, params, grads, state, **extra_args)
    return _update_step(tx, params, grads, state, **extra_args)


def _update_step(tx: optax.GradientTransformation, params, grads, state, **extra_args):
    if isinstance(tx, optax.GradientTransformationExtraArgs):
        updates, state = tx.update(grads, state, params, **extra_args)
    else:
        updates, state = tx.update(grads, state, params)
    return apply_updates(params, updates), state


_compiled_update_step = jax.jit(_update_step, static_argnums=0)


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True
