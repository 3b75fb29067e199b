"""Hyperparameters as data: the ``HParams`` pytree node, ``get_hparams``, ``set_hparams``.

Every optimizer state of this package holds one ``HParams`` node: its children are the
numeric hyperparameters as arrays (so a changed value is a changed *input* to a jitted
step and never a recompilation); its static part names the optimizer, its structural
flags, the validator that enforces torch's rules and the hyperparameters driven by a
schedule.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from functorch_optim._tree import PyTree, keystr

Validator = Callable[[Mapping[str, Any], Mapping[str, Any]], None]


def hparam_dtype() -> jnp.dtype:
    """float64 when ``jax_enable_x64`` is on (torch's Python floats are doubles), else float32."""
    return jnp.dtype(jnp.result_type(float))


def warn_float32_hparams() -> None:
    """Warn, once per process, where the hyperparameters are float32 (``jax_enable_x64``
    off): torch computes with them as Python doubles (``1 - beta2``, the bias
    corrections, ``lr / bias_correction1``, ``1 - dampening``), here they are computed in
    float32, so results can differ from torch's beyond rounding."""
    if hparam_dtype() != jnp.float64:
        _warn_float32_hparams()


@functools.cache
def _warn_float32_hparams() -> None:
    warnings.warn(
        "jax_enable_x64 is off, so functorch_optim's hyperparameters are float32 and what torch computes "
        "from them in Python doubles (1 - beta2, bias corrections, lr / bias_correction1, 1 - dampening, "
        "...) is computed in float32: results can differ from torch's beyond rounding (Adam's second "
        "moment takes 1 - float32(0.999) = 9.9998713e-04 of the squared gradient where torch takes "
        "1e-03). For torch's numbers call jax.config.update('jax_enable_x64', True) before building "
        "optimizers (and give arrays a float32 dtype where you want float32).",
        UserWarning,
        stacklevel=_outside_package(),
    )


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _outside_package() -> int:
    """The ``stacklevel`` of the first frame outside this package, for a warning raised
    by the function that calls this one (whatever wrappers are between: an ``init``
    under ``sharded_init``, ``grad_accumulate``, a facade)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def as_hparam(value: Any, dtype: Any | None = None) -> Any:
    """A hyperparameter value (a number, 0-d array or tuple of them) as strong-typed arrays."""
    dtype = hparam_dtype() if dtype is None else dtype
    if isinstance(value, tuple | list):
        return tuple(as_hparam(v, dtype) for v in value)
    arr = jnp.asarray(value, dtype=dtype)
    if arr.ndim != 0:
        raise ValueError(f"a hyperparameter must be a scalar, got an array of shape {arr.shape}")
    return arr


def to_python(value: Any) -> Any:
    """Concrete hyperparameter value(s) as Python floats; tracers are returned as they are.

    A value that is not a real number (a string, ``None``, a complex number) is returned
    as it is, so that torch's checks (``if not 0.0 <= lr``) raise torch's ``TypeError``
    on it; ``check_number`` rejects what no check compares."""
    if isinstance(value, tuple | list):
        return tuple(to_python(v) for v in value)
    if isinstance(value, jax.core.Tracer):
        return value
    if isinstance(value, bool | int | float | str | complex) or value is None:
        return value
    if jnp.iscomplexobj(value) or np.size(value) != 1:
        return value
    return float(value)


def check_number(where: str, name: str, value: Any) -> None:
    """Reject a hyperparameter value that is not a real scalar, naming it.

    Raises:
      TypeError: ``{where}: {name} must be a real number or a 0-d real array, got ...``
        for a string, ``None``, a complex number or a non-numeric array.
      ValueError: ``{where}: {name} must be a scalar, got an array of shape ...``.
    """
    if isinstance(value, tuple | list):
        for i, v in enumerate(value):
            check_number(where, f"{name}[{i}]", v)
        return
    if isinstance(value, jax.core.Tracer | bool | int | float):
        return
    dtype = getattr(value, "dtype", None)
    real = dtype is not None and (
        jnp.issubdtype(dtype, jnp.floating)
        or jnp.issubdtype(dtype, jnp.integer)
        or jnp.issubdtype(dtype, jnp.bool_)
    )
    if not real:
        raise TypeError(f"{where}: {name} must be a real number or a 0-d real array, got {value!r}")
    if np.size(value) != 1:
        raise ValueError(f"{where}: {name} must be a scalar, got an array of shape {np.shape(value)}")


#: The static key under which an optimizer records the hyperparameters whose zero-ness its
#: compiled step fixes: ``((name, "zero" | "nonzero"), ...)`` (``Algorithm.fixed_zero``).
FIXED = "fixed"


def fixed(static: Mapping[str, Any], name: str) -> str | None:
    """``"zero"`` or ``"nonzero"`` where the compiled step fixes whether ``name`` is 0,
    else None (the value is data, read every step)."""
    return dict(static.get(FIXED, ())).get(name)


def in_use(static: Mapping[str, Any], hp: Mapping[str, Any], name: str) -> Any:
    """Whether the term of hyperparameter ``name`` (torch's ``if weight_decay != 0``) is
    in this step: ``False``/``True`` (Python bools) where the compiled step fixes it,
    else the traced ``hp[name] != 0``."""
    how = fixed(static, name)
    if how is not None:
        return how == "nonzero"
    return hp[name] != 0


def fixed_conflicts(static: Mapping[str, Any], values: Mapping[str, Any]) -> list[str]:
    """The names among ``values`` (concrete numbers) whose zero-ness differs from what
    the compiled step fixes."""
    bad = []
    for name, how in dict(static.get(FIXED, ())).items():
        # a string has no zero-ness: ``check_number`` names it (after torch's checks)
        if name in values and not has_tracer(values[name]) and not isinstance(values[name], str):
            value = to_python(values[name])
            if (value == 0) != (how == "zero"):
                bad.append(name)
    return bad


def check_fixed(kind: str, static: Mapping[str, Any], values: Mapping[str, Any]) -> None:
    """Refuse a value whose zero-ness the compiled step fixes otherwise.

    Raises:
      ValueError: naming the hyperparameter, the value, and how to keep it changeable.
    """
    for name in fixed_conflicts(static, values):
        value = to_python(values[name])
        if fixed(static, name) == "zero":
            raise ValueError(
                f"{kind}: {name}={value} for an optimizer built with {name}=0 (a number), whose "
                f"compiled step leaves the {name} term out; build it with a nonzero {name} (it "
                "can be set to 0 later), or give it as a JAX array (optax.inject_hyperparams) or "
                "a schedule to keep it changeable"
            )
        raise ValueError(
            f"{kind}: {name}={value} for an optimizer built with a nonzero {name} (a number), "
            f"whose compiled step always applies it; give {name} as a JAX array "
            "(optax.inject_hyperparams) or a schedule to change it to 0 at run time"
        )


def has_tracer(value: Any) -> bool:
    """Whether any leaf of ``value`` is a tracer (a value under a JAX transformation)."""
    return any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves(value))


@jax.tree_util.register_pytree_with_keys_class
class HParams(Mapping):
    """The numeric hyperparameters of one optimizer, as a read-only mapping of arrays.

    Attributes:
      kind: the optimizer's name (torch's class name, e.g. ``"SGD"``).
      static: structural flags fixed at construction (e.g. ``nesterov``), as a dict.
      scheduled: names of hyperparameters that a schedule drives.
      schedule_state: per scheduled name, the state a stateful schedule carries
        (``functorch_optim.schedules``; an empty tuple for a plain ``count -> value``
        function). A pytree child, so it is jitted, donated and checkpointed with the
        values; ``get_hparams`` does not show it.
    """

    def __init__(
        self,
        values: Mapping[str, Any],
        kind: str,
        validator: Validator | None = None,
        static: Mapping[str, Any] | tuple = (),
        scheduled: tuple[str, ...] = (),
        schedule_state: Mapping[str, Any] | None = None,
    ) -> None:
        self._values = dict(sorted(dict(values).items()))  # the order of the flattened tree
        self.kind = kind
        self.validator = validator
        self._static = tuple(sorted(dict(static).items()))
        self.scheduled = tuple(scheduled)
        self.schedule_state = dict(schedule_state or {})

    @property
    def static(self) -> dict[str, Any]:
        return dict(self._static)

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"HParams({self.kind}, {self._values})"

    def replace(self, **values: Any) -> HParams:
        """A copy with some values replaced (no validation; see ``set_hparams``)."""
        return HParams(
            {**self._values, **values},
            self.kind,
            self.validator,
            self._static,
            self.scheduled,
            self.schedule_state,
        )

    def with_schedule_state(self, schedule_state: Mapping[str, Any]) -> HParams:
        """A copy whose schedule state is ``schedule_state`` (values unchanged)."""
        return HParams(self._values, self.kind, self.validator, self._static, self.scheduled, schedule_state)

    def validate(self, values: Mapping[str, Any]) -> None:
        """Run torch's checks on ``values`` merged over the current values.

        Skipped when a value is a tracer (hyperparameters differentiated under
        ``jax.grad``): concrete checks cannot run on abstract values.
        """
        if self.validator is None:
            return
        merged = {k: to_python(v) for k, v in {**self._values, **values}.items()}
        if has_tracer(merged):
            return
        self.validator(merged, self.static)
        check_fixed(self.kind, self.static, merged)

    def tree_flatten(self):
        # run at every jitted call: ``_values`` is kept in sorted order (``__init__``,
        # ``tree_unflatten``), so no sort and no keys here
        keys = tuple(self._values)
        return [*self._values.values(), self.schedule_state], (
            keys,
            self.kind,
            self.validator,
            self._static,
            self.scheduled,
        )

    def tree_flatten_with_keys(self):
        children, aux = self.tree_flatten()
        names = [jax.tree_util.DictKey(k) for k in aux[0]] + [jax.tree_util.GetAttrKey("schedule_state")]
        return list(zip(names, children)), aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        keys, kind, validator, static, scheduled = aux
        obj = object.__new__(cls)
        children = list(children)
        obj._values = dict(zip(keys, children[: len(keys)], strict=True))
        obj.kind, obj.validator, obj._static, obj.scheduled = kind, validator, static, scheduled
        obj.schedule_state = children[len(keys)]
        return obj

    def __reduce__(self):
        return (
            HParams,
            (self._values, self.kind, self.validator, self._static, self.scheduled, self.schedule_state),
        )


class ParamGroupsState(NamedTuple):
    """State of ``param_groups`` (here, where ``get_hparams`` looks for it).

    Attributes:
      groups: per group name, the state of that group's transformation (for this
        package's optimizers a ``TorchState`` whose buffers are shaped like the params,
        ``None`` at the other groups' parameters). ``get_hparams(state, group=name)``
        and ``set_hparams(state, group=name, ...)`` read and change one group's values.
    """

    groups: dict[str, PyTree]


def _is_hparams_node(x: Any) -> bool:
    return isinstance(x, HParams | optax.InjectHyperparamsState | optax.InjectStatefulHyperparamsState)


def _find(state: PyTree) -> list[tuple[tuple, Any]]:
    nodes = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_hparams_node)[0]
    return [(path, n) for path, n in nodes if _is_hparams_node(n)]


def _is_groups_node(x: Any) -> bool:
    return isinstance(x, ParamGroupsState)


def _group_nodes(state: PyTree, group: str, fn: str) -> list[tuple[tuple, Any]]:
    """The hyperparameter nodes of parameter group ``group`` (``param_groups``), with
    their paths in ``state``."""
    holders = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_groups_node)[0]
    holders = [(path, n) for path, n in holders if _is_groups_node(n)]
    if len(holders) != 1:
        raise ValueError(
            f"{fn}: group={group!r} needs a state with one set of parameter groups "
            f"(functorch_optim.param_groups); this one has {len(holders)}"
        )
    path, holder = holders[0]
    if group not in holder.groups:
        raise ValueError(
            f"{fn}: no parameter group {group!r}; the groups are: {', '.join(map(repr, holder.groups))}"
        )
    prefix = (jax.tree_util.GetAttrKey("groups"), jax.tree_util.DictKey(group))
    return [(path + p, n) for p, n in _find(holder) if p[:2] == prefix]


def _only_node(state: PyTree, fn: str, group: str | None = None) -> tuple[tuple, Any]:
    nodes = _find(state) if group is None else _group_nodes(state, group, fn)
    if not nodes:
        raise ValueError(
            f"{fn}: the state holds no hyperparameters (neither a functorch_optim optimizer "
            "state nor optax.inject_hyperparams)"
        )
    if len(nodes) > 1:
        where = ", ".join(keystr(path) for path, _ in nodes)
        hint = "pass the sub-state of the one you mean"
        groups = [n for _, n in jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_groups_node)[0]]
        groups = [n for n in groups if _is_groups_node(n)]
        if group is None and len(groups) == 1:
            hint = f"pass group= one of {', '.join(map(repr, groups[0].groups))}"
        raise ValueError(
            f"{fn}: the state holds hyperparameters of {len(nodes)} optimizers (at {where}); {hint}"
        )
    return nodes[0]


def get_hparams(state: PyTree, group: str | None = None) -> dict[str, Any]:
    """The numeric hyperparameters held in an optimizer state.

    Finds the one ``HParams`` node in ``state`` (also inside ``optax.chain`` tuples and
    ``grad_accumulate`` states), or an ``optax.inject_hyperparams`` state. A value that a
    schedule drives is the one the *next* step uses (torch's ``get_last_lr()``).

    Args:
      state: an optimizer state, e.g. from ``tx.init(params)``.
      group: with ``param_groups``, the name of the parameter group to read (its
        state holds one optimizer per group); default None, the state's only one.

    Returns:
      A dict from hyperparameter name to a 0-d array (a tuple of them for ``betas``).

    Raises:
      ValueError: if the state holds no hyperparameters, or those of several optimizers
        (the message lists the group names when they are parameter groups), or no
        group of that name.

    Examples:
      >>> import jax.numpy as jnp, functorch_optim as fo
      >>> state = fo.sgd(lr=0.5).init({"w": jnp.zeros(2)})
      >>> float(fo.get_hparams(state)["lr"])
      0.5
    """
    _, node = _only_node(state, "get_hparams", group)
    if isinstance(node, HParams):
        return dict(node)
    return dict(node.hyperparams)


def set_hparams(state: PyTree, group: str | None = None, **values: Any) -> PyTree:
    """A new state with some numeric hyperparameters changed, validated like torch.

    The new values keep the dtype and shape of the old ones, so a jitted step that takes
    the state sees the same input types and does not recompile. Values may be tracers
    (e.g. under ``jax.grad`` for meta-learning); torch's checks then cannot run.

    Args:
      state: an optimizer state holding exactly one set of hyperparameters, or
        parameter groups (``param_groups``) with ``group``.
      group: with ``param_groups``, the name of the parameter group to change;
        default None, the state's only optimizer.
      **values: new values by torch's names (``lr=0.01``, ``betas=(0.9, 0.99)``).

    Returns:
      The state with the values replaced; the input state is not modified.

    Raises:
      ValueError: for an unknown name (the message lists the known ones), a value torch
        would reject (torch's message, e.g. ``Invalid learning rate: -1.0``), a
        hyperparameter driven by a schedule, a value across 0 where the optimizer was
        built with a number whose zero-ness its step compiles in (``weight_decay=0``,
        SGD's and RMSprop's nonzero ``momentum``: ``check_fixed``), or a state without
        (or with several sets of) hyperparameters. Nothing is changed when it raises.

    Examples:
      >>> import jax.numpy as jnp, functorch_optim as fo
      >>> state = fo.sgd(lr=0.1, momentum=0.9).init({"w": jnp.zeros(2)})
      >>> state = fo.set_hparams(state, lr=0.01)
      >>> round(float(fo.get_hparams(state)["lr"]), 6)
      0.01
    """
    path, node = _only_node(state, "set_hparams", group)
    known = tuple(node) if isinstance(node, HParams) else tuple(node.hyperparams)
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(
            f"set_hparams: unknown hyperparameter(s) {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(known)}"
        )
    current = dict(node) if isinstance(node, HParams) else dict(node.hyperparams)
    for name, value in values.items():
        if not isinstance(value, str):  # a string: torch's own check raises (below)
            check_number("set_hparams", name, value)
    if isinstance(node, HParams):
        driven = sorted(set(values) & set(node.scheduled))
        if driven:
            raise ValueError(
                f"set_hparams: {', '.join(driven)} is driven by a schedule, or was given to the "
                "constructor as a JAX array (an input of the transformation, as "
                "optax.inject_hyperparams passes it), and cannot be set"
            )
        node.validate(values)

    for name, value in values.items():
        check_number("set_hparams", name, value)  # a string no check of torch compared

    def convert(name: str, new: Any) -> Any:
        old = current[name]
        if isinstance(old, tuple):
            if not isinstance(new, tuple | list) or len(new) != len(old):
                raise ValueError(f"set_hparams: {name} must be a sequence of {len(old)} numbers")
            return tuple(jnp.asarray(n, dtype=o.dtype).reshape(o.shape) for n, o in zip(new, old))
        return jnp.asarray(new, dtype=old.dtype).reshape(jnp.shape(old))

    new_values = {k: convert(k, v) for k, v in values.items()}
    if isinstance(node, HParams):
        new_node = node.replace(**new_values)
    else:
        new_node = node._replace(hyperparams={**node.hyperparams, **new_values})
    return _replace_at(state, path, new_node)


def _replace_at(tree: PyTree, path: tuple, new: Any) -> PyTree:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_hparams_node)
    return jax.tree_util.tree_unflatten(treedef, [new if p == path else x for p, x in leaves])
