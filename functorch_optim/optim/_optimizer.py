"""The imperative, ``torch.optim``-shaped shell over the functional optimizers.

``Optimizer`` holds the parameters, their gradients and one functional state per
parameter group, and calls the jitted functional core: ``functorch_optim.step`` with
params and state donated for ``step()``, a jitted ``value_and_grad`` for ``backward()``.
``make_optimizer_class(factory)`` turns any functional factory of this package into a
class with torch's signature (``SGD(params, lr=1e-3, momentum=0, …)``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functorch_optim._base import (
    ALGORITHM_ATTR,
    Algorithm,
    TorchState,
    changeable_hparams,
    own_counters,
    schedule_key,
    share_counters,
)
from functorch_optim._base import step as functional_step
from functorch_optim._groups import path_name, select_groups
from functorch_optim._hyperparams import fixed_conflicts, set_hparams, to_python
from functorch_optim._tree import PyTree, check_like_params, check_params, is_none, keystr
from functorch_optim.interop.torch import _is_tensor, _to_numpy, _to_tensor

#: torch's implementation switches: accepted everywhere, no effect here (XLA fuses).
#: ``fused`` is not among them: SGD, Adam, AdamW and Adagrad honour it (a one-pass CPU kernel), and
#: changing it in ``param_groups`` rebuilds the group's transformation like any flag.
TORCH_ONLY_FLAGS = ("foreach", "differentiable", "capturable")

#: Keys a parameter-group dict may hold besides the optimizer's arguments.
_GROUP_KEYS = ("params", "param_names")


# ---------------------------------------------------------------------------------------
# How the groups' parameter trees map to the structure the user gave
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Maps per-group parameter trees to the user's structure and back.

    Hashable (a static argument of the jitted ``backward``). Three kinds:

    * ``"tree"``: one pytree, one group;
    * ``"groups"``: torch's list of group dicts; the user's structure is the list of the
      groups' trees;
    * ``"partition"``: one pytree split by ``group_by``; each group's tree is the tuple
      of its leaves, in ``jax.tree.leaves`` order (torch's list of tensors).
    """

    kind: str
    n_groups: int = 1
    treedef: Any = None
    owner: tuple[int, ...] = ()

    def to_user(self, groups: Sequence[PyTree]) -> PyTree:
        if self.kind == "tree":
            return groups[0]
        if self.kind == "groups":
            return list(groups)
        its = [iter(g) for g in groups]
        return self.treedef.unflatten([next(its[o]) for o in self.owner])

    def to_groups(self, user: PyTree) -> tuple[PyTree, ...]:
        if self.kind == "tree":
            return (user,)
        if self.kind == "groups":
            return tuple(user)
        leaves = self.treedef.flatten_up_to(user)
        return tuple(
            tuple(x for x, o in zip(leaves, self.owner, strict=True) if o == g) for g in range(self.n_groups)
        )


def _leaf_names(paths: Sequence[tuple]) -> list[str] | None:
    """torch's ``param_names`` for leaves at these key paths, or None when they have none.

    A leaf is named when its path holds a dict key or an attribute (``"0.weight"``,
    ``"enc.w"``); a bare list or tuple of arrays (torch's ``model.parameters()``) is not.
    """
    named = (jax.tree_util.DictKey, jax.tree_util.GetAttrKey)
    if all(any(isinstance(k, named) for k in path) for path in paths):
        return [path_name(path) for path in paths]
    return None


@dataclasses.dataclass(frozen=True, eq=False)
class GroupedParams:
    """One pytree split into parameter groups; built by ``group_by``, passed as ``params``.

    Attributes:
      tree: the parameter pytree.
      owner: per leaf (``jax.tree.leaves`` order), the index of its group.
      overrides: per group, the hyperparameters it overrides.
    """

    tree: PyTree
    owner: tuple[int, ...]
    overrides: tuple[dict[str, Any], ...]


def group_by(params: PyTree, *groups: Mapping[str, Any]) -> GroupedParams:
    """Split one parameter pytree into parameter groups by key-path regex or predicate.

    Each group is a dict with ``"where"`` — a regular expression searched
    (``re.search``) in the leaf's dotted name (``"layer.0.bias"``, see ``path_name``), or
    a predicate ``(path, leaf) -> bool`` on the ``jax.tree_util`` key path — and the
    hyperparameters that group overrides. Leaves no group selects form one last group
    with the optimizer's defaults. ``opt.params`` keeps the single pytree.

    Args:
      params: the parameter pytree.
      *groups: dicts ``{"where": regex_or_predicate, **overrides}``, in group order.

    Returns:
      A ``GroupedParams`` to pass as an optimizer's ``params``; its group order is the
      given order, then the group of the remaining leaves (if any).

    Raises:
      ValueError: ``optimizer got an empty parameter list`` for a tree without leaves;
        ``some parameters appear in more than one parameter group`` (naming the leaf)
        when two groups select the same leaf; a group without ``"where"`` or that selects
        no leaf.

    Examples:
      >>> import jax.numpy as jnp
      >>> from functorch_optim.optim import SGD, group_by
      >>> params = {"dense": {"kernel": jnp.ones(2), "bias": jnp.ones(2)}}
      >>> opt = SGD(group_by(params, {"where": r"bias$", "weight_decay": 0.0}), lr=0.1, weight_decay=0.5)
      >>> [g["weight_decay"] for g in opt.param_groups]
      [0.0, 0.5]
    """
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    if not leaves:
        raise ValueError("optimizer got an empty parameter list")
    for i, spec in enumerate(groups):
        if not isinstance(spec, Mapping) or "where" not in spec:
            raise ValueError(
                f"group_by: group {i} must be a dict with a 'where' key (a regex or a predicate "
                f"(path, leaf) -> bool), got {spec!r}"
            )
    labels = [f"group {i}" for i in range(len(groups))]
    owner = select_groups(leaves, [spec["where"] for spec in groups], labels)
    overrides = [{k: v for k, v in spec.items() if k != "where"} for spec in groups]
    for i, spec in enumerate(groups):
        if i not in owner:
            names = ", ".join(path_name(p) for p, _ in leaves)
            raise ValueError(
                f"group_by: group {i} (where={spec['where']!r}) selects no parameter; the "
                f"parameters are: {names}"
            )
    if len(groups) in owner:
        overrides.append({})
    return GroupedParams(params, tuple(owner), tuple(overrides))


# ---------------------------------------------------------------------------------------
# The jitted core calls (module level: one compilation cache shared by all instances)
# ---------------------------------------------------------------------------------------


def _multi_step(txs, params, grads, states):
    out = [functional_step(tx, p, g, s) for tx, p, g, s in zip(txs, params, grads, states, strict=True)]
    return tuple(o[0] for o in out), tuple(o[1] for o in out)


def _backward(loss_fn, layout, has_aux, params, grads, args, kwargs):
    def loss_of(groups):
        return loss_fn(layout.to_user(groups), *args, **kwargs)

    out, new = jax.value_and_grad(loss_of, has_aux=has_aux)(params)
    # torch's ``loss.backward()`` adds into ``.grad``: old + new
    acc = jax.tree.map(lambda old, g: g if old is None else old + g, grads, new, is_leaf=is_none)
    return out, acc


#: Transformations by (algorithm, state structure, schedules): two with equal keys step
#: identically (the step reads numeric hyperparameters, a schedule's learning rate and
#: counters from the state; everything else it uses is the algorithm, the static flags,
#: which the state's structure carries, and the schedules' ``step_key``), so optimizers
#: of the same configuration share one compiled step, across instances too.
_TX_CACHE: dict[tuple[Any, Any, Any], Any] = {}


def _shared(tx: Any, state: TorchState, config: Mapping[str, Any]) -> Any:
    """The cached transformation equivalent to ``tx`` (``tx`` itself the first time)."""
    algorithm = getattr(tx.update, ALGORITHM_ATTR)
    try:
        keys = {k: schedule_key(v) for k, v in config.items()}
        schedules = tuple(sorted((k, key) for k, key in keys.items() if key is not None))
        return _TX_CACHE.setdefault((algorithm, jax.tree.structure(state), schedules), tx)
    except TypeError:  # unhashable static metadata or schedule argument: no sharing
        return tx


_STEP = jax.jit(_multi_step, static_argnums=0, donate_argnums=(1, 3))
_BACKWARD = jax.jit(_backward, static_argnums=(0, 1, 2), donate_argnums=(4,))


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------


def closure_takes_params(closure: Callable[..., Any]) -> bool:
    """Whether a ``step(closure)`` closure is the pure ``closure(params)`` form, by its signature.

    A closure that can be called without arguments is torch's ``closure() -> loss``
    (it evaluates the model and calls ``backward`` itself); one with exactly one required
    positional parameter is the pure ``closure(params) -> loss``.

    Args:
      closure: the closure given to ``step``.

    Returns:
      True for ``closure(params)``, False for ``closure()``.

    Raises:
      TypeError: for a closure with two or more required positional parameters, or one
        whose signature cannot be read.
    """
    try:
        sig = inspect.signature(closure)
    except (TypeError, ValueError):
        raise TypeError(
            f"step: cannot read the signature of closure {closure!r}; pass a function "
            "closure() -> loss (torch's) or closure(params) -> loss"
        ) from None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p.name for p in sig.parameters.values() if p.kind in positional and p.default is p.empty]
    if len(required) > 1:
        raise TypeError(
            "closure must take no argument (torch's closure() -> loss, which calls "
            "opt.zero_grad() and opt.backward(...) itself) or one, the parameters "
            f"(closure(params) -> loss); got one that requires {', '.join(required)}"
        )
    return len(required) == 1


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic) or _is_tensor(x)


def _torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _python(v: Any) -> Any:
    """A param-group value as plain Python: 0-d arrays and NumPy scalars become numbers."""
    if _is_array(v) and np.ndim(v) == 0:
        return _to_numpy(v).item()
    if isinstance(v, list | tuple):
        return type(v)(_python(x) for x in v)
    return copy.deepcopy(v)


def export_state_dict(state_dict: Mapping[str, Any], tensors: bool) -> dict[str, Any]:
    """A copy of a torch-layout state dict: arrays as torch tensors or NumPy, groups as Python.

    Every array of ``state`` (inside lists too: LBFGS's history) becomes a torch tensor
    (``tensors=True``) or a NumPy array, bfloat16 included; every 0-d array or NumPy
    scalar in ``param_groups`` becomes a Python number. The result is what torch's
    ``torch.load`` reads with its default ``weights_only=True``.
    """

    def array(v: Any) -> Any:
        if _is_array(v):
            return _to_tensor(v) if tensors else _to_numpy(v)
        if isinstance(v, list | tuple):
            return type(v)(array(x) for x in v)
        return v

    return {
        "state": {k: {n: array(v) for n, v in e.items()} for k, e in state_dict["state"].items()},
        "param_groups": [{k: _python(v) for k, v in g.items()} for g in state_dict["param_groups"]],
    }


def _ids(key: Any) -> Any:
    """A saved parameter id as torch's int: orbax stores dict keys as strings, ints as arrays."""
    if isinstance(key, str) and key.isdigit():
        return int(key)
    if _is_array(key) and np.ndim(key) == 0:
        return int(_to_numpy(key))
    return key


def read_state_dict(state_dict: Mapping[str, Any]) -> tuple[list[dict[str, Any]], dict[Any, Any]]:
    """The groups and per-id state of a torch-layout state dict, as torch writes them.

    Undoes what a round trip through orbax (or another pytree store) does to torch's
    layout: string ids become ints again, 0-d arrays in the groups Python numbers; lists
    stay lists (the caller turns them into tuples where its hyperparameters are tuples).
    """
    groups = []
    for saved in state_dict["param_groups"]:
        group = {k: _python(v) for k, v in saved.items() if k != "params"}
        group["params"] = [_ids(i) for i in saved["params"]]
        groups.append(group)
    return groups, {_ids(k): v for k, v in dict(state_dict["state"]).items()}


def check_names(g: int, saved: Mapping[str, Any], ours: Sequence[str] | None) -> None:
    """Refuse a saved group whose ``param_names`` differ from this group's, position by position.

    Args:
      g: the group's index.
      saved: the saved group (torch's layout: ``params`` ids, maybe ``param_names``).
      ours: this optimizer's names for the group's parameters, or None without names.

    Raises:
      ValueError: naming the first id whose saved name differs from ours.
    """
    theirs = saved.get("param_names")
    if theirs is None:
        return
    if not isinstance(theirs, list | tuple) or len(theirs) != len(saved["params"]):
        raise ValueError(
            f"loaded state dict: param_names of parameter group {g} must be a list of "
            f"{len(saved['params'])} names, one per id, got {theirs!r}"
        )
    if ours is None:
        return
    for j, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        if a != b:
            order = " (the same names in another order)" if sorted(theirs) == sorted(ours) else ""
            raise ValueError(
                f"loaded state dict: parameter {saved['params'][j]!r} of group {g} is {a!r}, but "
                f"this optimizer's parameter at that position is {b!r}{order}; ids match by "
                "position, so its state would load into another parameter. Give the optimizer "
                "its parameters in the saved order (interop.torch.tree_from_module(model) "
                "follows model.named_parameters()), or remove 'param_names' from the dict's "
                "groups to load by position regardless"
            )


def group_entries(
    saved_groups: Sequence[Mapping[str, Any]], saved_state: Mapping[Any, Any]
) -> list[dict[int, tuple[Any, Any]]]:
    """Per saved group, ``{position: (id, entry)}``: torch's ids mapped to positions.

    Raises:
      ValueError: for an id listed twice, or state for an id no group lists.
    """
    id_map: dict[Any, tuple[int, int]] = {}
    for g, saved in enumerate(saved_groups):
        for j, sid in enumerate(saved["params"]):
            if sid in id_map:
                raise ValueError(f"loaded state dict lists parameter id {sid!r} more than once")
            id_map[sid] = (g, j)
    entries: list[dict[int, tuple[Any, Any]]] = [{} for _ in saved_groups]
    for key, value in saved_state.items():
        if key not in id_map:
            raise ValueError(
                f"loaded state dict has state for parameter id {key!r}, which no parameter group lists"
            )
        g, j = id_map[key]
        entries[g][j] = (key, value)
    return entries


@functools.cache
def _hyperparameter_owners() -> dict[str, tuple[str, ...]]:
    """Every registered optimizer's hyperparameter names, each with the classes taking it."""
    from functorch_optim._registry import OPTIMIZERS

    owners: dict[str, list[str]] = {}
    for spec in OPTIMIZERS:
        for p in _factory_parameters(spec.factory):
            owners.setdefault(p.name, []).append(spec.torch_name)
    return {k: tuple(v) for k, v in owners.items()}


def check_foreign_keys(cls: str, g: int, saved: Mapping[str, Any], own: set[str]) -> None:
    """Refuse a saved group holding another optimizer class's hyperparameter.

    torch's dicts do not name their class; their groups do hold every hyperparameter of
    it. A key that is some registered optimizer's hyperparameter, but neither one of
    ``own`` nor of the registered class named ``cls``, means the dict is another
    optimizer's (an Adam dict has ``amsgrad``, which NAdam lacks). Keys no optimizer
    takes (a scheduler's ``initial_lr``) are kept, as torch keeps them.

    Args:
      cls: this optimizer's class name, for the message.
      g: the group's index.
      saved: the saved group.
      own: every key this optimizer's groups hold.

    Raises:
      ValueError: naming the first foreign key and the classes that take it.
    """
    owners = _hyperparameter_owners()
    for k in saved:
        # a class of torch's name (a custom one built by make_optimizer_class) takes its keys
        if k not in own and k not in _GROUP_KEYS and k in owners and cls not in owners[k]:
            raise ValueError(
                f"loaded state dict: parameter group {g} has {k!r}, a hyperparameter of "
                f"{', '.join(owners[k])} that {cls} does not take: is it another optimizer's state dict?"
            )


def whole_count(value: Any, who: str, key: str = "step") -> int:
    """A saved counter (``step``; LBFGS's ``n_iter``), a tensor, array or number, as an int.

    Raises:
      ValueError: naming ``key`` and ``who`` for anything but a whole number >= 0.
    """
    arr = _to_numpy(value)
    ok = arr.shape in ((), (1,)) and (
        jnp.issubdtype(arr.dtype, jnp.integer) or jnp.issubdtype(arr.dtype, jnp.floating)
    )
    number = float(arr.reshape(())) if ok else None
    if number is None or not np.isfinite(number) or number < 0 or number != int(number):
        raise ValueError(f"loaded state dict: {key!r} of {who} is {value!r}; it must be a whole number >= 0")
    return int(number)


def _as_tuples(value: Any, like: Any) -> Any:
    """``value`` with lists turned into tuples where ``like`` (the current value) has tuples."""
    if isinstance(like, tuple) and isinstance(value, list | tuple) and len(value) == len(like):
        return tuple(_as_tuples(v, w) for v, w in zip(value, like, strict=True))
    return value


def _same(new: Any, old: Any) -> bool:
    """Whether a param-group value is unchanged, without touching device arrays."""
    if new is old:
        return True
    plain = (bool, int, float, str, type(None))
    if isinstance(new, plain) and isinstance(old, plain):
        return type(new) is type(old) and new == old
    if isinstance(new, tuple) and isinstance(old, tuple) and len(new) == len(old):
        return all(_same(a, b) for a, b in zip(new, old, strict=True))
    return False


def _copy_leaf(x: Any) -> jax.Array:
    return jnp.array(x, copy=True)


def _checked_grad(params: PyTree, value: PyTree) -> tuple[PyTree, bool]:
    """An assigned ``opt.grad``, checked against the parameters and copied; and whether all are None."""
    # structure, shapes and dtypes (torch: assigned grad has data of a different type)
    check_like_params(params, value, "grad")
    g_leaves = jax.tree.structure(params).flatten_up_to(value)
    copied = jax.tree.map(lambda g: None if g is None else _copy_leaf(g), value, is_leaf=is_none)
    return copied, all(g is None for g in g_leaves)


def _factory_parameters(factory: Callable[..., Any]) -> list[inspect.Parameter]:
    skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p for p in inspect.signature(factory).parameters.values() if p.kind not in skip]


def _algorithm_of(tx: Any, factory: Callable[..., Any]) -> Algorithm:
    algorithm = getattr(getattr(tx, "update", None), ALGORITHM_ATTR, None)
    if algorithm is None:
        raise TypeError(
            f"{getattr(factory, '__name__', factory)!r} did not return a functorch_optim "
            "optimizer (one built by make_optimizer); the facade needs its TorchState"
        )
    return algorithm


# ---------------------------------------------------------------------------------------
# The facade
# ---------------------------------------------------------------------------------------


class Optimizer:
    """``torch.optim.Optimizer`` on JAX: parameters, gradients and state held for you.

    Subclasses are made by ``make_optimizer_class(factory)``; their constructor is
    torch's (``SGD(params, lr=1e-3, momentum=0, …)``). Each step runs the jitted
    functional core (``functorch_optim.step``, params and state donated); nothing of
    the algorithm lives here.

    ``params`` is either one pytree of floating point arrays, torch's list of
    parameter-group dicts ``[{"params": pytree, "lr": 0.01, …}, …]`` (each overriding
    any hyperparameter), or ``group_by(pytree, {"where": regex_or_predicate, …})``.
    The optimizer copies the parameters; ``opt.params`` returns the current ones in the
    structure given (for a list of groups: the list of the groups' pytrees). Under
    ``group_by``, each group's own tree (``param_groups[i]["params"]``, and the buffers
    of its state) is the tuple of its leaves, like torch's list of tensors.

    Parameter order (the integer ids of ``state_dict()``, torch's numbering): group by
    group in ``param_groups`` order; within a group, ``jax.tree.leaves`` order of its
    parameters. For one pytree, id ``i`` is ``jax.tree.leaves(params)[i]``. Build the
    parameters with ``interop.torch.tree_from_module(model)`` (it flattens in
    ``model.named_parameters()`` order) and the ids are those of
    ``torch.optim.X(model.parameters())``; a plain ``dict`` flattens in sorted key order
    (``"0.bias"`` before ``"0.weight"``), which torch's numbering is not.

    Parameter names (torch's ``param_names`` entry of a group, which torch writes when
    built from ``model.named_parameters()``): a group whose parameters all sit under
    dict keys or attributes is named by their dotted paths (``"0.weight"``; under
    ``group_by``, paths in the whole tree); a group dict may give ``"param_names"``
    itself. A bare list of arrays has none, and names are kept only while every group
    has them. ``load_state_dict`` compares the names where both sides have them.

    Attributes:
      param_groups: a list of dicts, one per group: ``"params"`` (that group's current
        parameters) and every argument of the constructor. Assigning a numeric
        hyperparameter (``opt.param_groups[0]["lr"] = 0.01``) takes effect on the next
        ``step()`` without recompiling; assigning a structural flag (``nesterov``)
        rebuilds that group's transformation (one recompilation). Keys the optimizer
        does not know (a scheduler's ``initial_lr``) are kept and ignored.
      defaults: the constructor's arguments, like torch's ``defaults``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from functorch_optim.optim import SGD
      >>> opt = SGD({"w": jnp.array([1.0, 2.0])}, lr=0.1, momentum=0.9)
      >>> def loss_fn(params, x):
      ...     return jnp.sum(params["w"] * x)
      >>> opt.zero_grad()
      >>> float(opt.backward(loss_fn, jnp.array([1.0, 1.0])))
      3.0
      >>> opt.grad["w"].tolist()
      [1.0, 1.0]
      >>> opt.step()
      >>> opt.params["w"].tolist()
      [0.9, 1.9]
      >>> opt.state_dict()["state"][0]["momentum_buffer"].tolist()
      [1.0, 1.0]

    Note:
      Parameters and state are donated to the jitted step: arrays read from
      ``opt.params``, ``opt.grad`` or ``opt.state`` before a ``step()`` (or a
      ``backward()``, for ``opt.grad``) are deleted by it — read them again afterwards,
      as torch's in-place update would show the new values.
    """

    factory: Callable[..., Any] | None = None

    def __init__(self, params: Any, defaults: Mapping[str, Any]) -> None:
        factory = type(self).factory
        if factory is None:
            raise TypeError("Optimizer is abstract; make a class with make_optimizer_class(factory)")
        self.defaults = dict(defaults)
        self._factory_params = tuple(p.name for p in _factory_parameters(factory))
        self._factory_defaults = {p.name: p.default for p in _factory_parameters(factory)}
        layout, trees, overrides, derived = self._split(params)
        for i, over in enumerate(overrides):
            self._check_keys(i, over)
        for tree in trees:
            check_params(tree)
        self._check_duplicates(trees)
        names, self._explicit_names = self._resolve_names(trees, overrides, derived)
        txs, groups, algorithms = [], [], []
        for over in overrides:
            config = {**self.defaults, **{k: v for k, v in over.items() if k != "param_names"}}
            tx = factory(**{k: config[k] for k in self._factory_params})
            algorithms.append(_algorithm_of(tx, factory))
            txs.append(tx)
            groups.append(config)
        # everything validated: now copy the parameters and build the states
        self._layout = layout
        self._params = [jax.tree.map(_copy_leaf, tree) for tree in trees]
        self._states = [
            self._initial_state(tx, alg, tree)
            for tx, alg, tree in zip(txs, algorithms, self._params, strict=True)
        ]
        self._txs = [_shared(tx, st, g) for tx, st, g in zip(txs, self._states, groups, strict=True)]
        self._algorithms = algorithms
        self._numeric = [frozenset(s.hparams) for s in self._states]
        self._none_grads = [jax.tree.map(lambda _: None, tree) for tree in self._params]
        self._grads = list(self._none_grads)
        self._grads_all_none = True
        self._sizes = [len(jax.tree.leaves(tree)) for tree in self._params]
        self.param_groups: list[dict[str, Any]] = [
            {"params": tree, **({} if n is None else {"param_names": n}), **config}
            for tree, n, config in zip(self._params, names, groups, strict=True)
        ]
        self._applied = [{k: g[k] for k in self._factory_params} for g in self.param_groups]
        # groups built under ``changeable_hparams``: an edit crossed what a compiled step
        # fixed (a weight_decay built as 0 set nonzero, a momentum set to 0)
        self._changeable: set[int] = set()

    # -- construction helpers -----------------------------------------------------------

    def _build(self, g: int, config: Mapping[str, Any]) -> Any:
        """Group ``g``'s transformation for ``config`` (changeable where it was before)."""
        factory = type(self).factory
        kwargs = {k: config[k] for k in self._factory_params}
        if g in getattr(self, "_changeable", ()):
            with changeable_hparams():
                return factory(**kwargs)
        return factory(**kwargs)

    def _initial_state(self, tx: Any, algorithm: Algorithm, tree: PyTree) -> TorchState:
        """``tx.init(tree)``; for an algorithm whose state torch creates in ``__init__``
        (Adagrad), the buffers come from the constructor's arguments, as torch's loop there
        reads them: a group's own ``initial_accumulator_value`` shows in ``param_groups``
        but does not seed its ``sum``."""
        state = tx.init(tree)
        if not algorithm.torch_state_at_init:
            return state
        factory = type(self).factory
        fresh = factory(**{k: self.defaults[k] for k in self._factory_params}).init(tree)
        buffers = {n: b if n == "step" else fresh.buffers[n] for n, b in state.buffers.items()}
        return TorchState(state.hparams, state.count, buffers)

    def _check_keys(self, index: int, overrides: Mapping[str, Any]) -> None:
        unknown = sorted(set(overrides) - set(self._factory_params) - set(_GROUP_KEYS))
        if unknown:
            raise ValueError(
                f"parameter group {index} has unknown hyperparameter(s) "
                f"{', '.join(map(repr, unknown))}; {type(self).__name__} accepts: "
                f"{', '.join(self._factory_params)}"
            )

    def add_param_group(self, param_group: Mapping[str, Any]) -> None:
        """Append a parameter group, as torch's ``add_param_group`` (e.g. to unfreeze layers).

        Only for an optimizer built from torch's list of group dicts: ``opt.params``,
        ``opt.grad`` and ``param_groups`` grow by one entry; the new parameters get ids
        after the existing ones.

        Args:
          param_group: ``{"params": pytree, **overrides}``; missing hyperparameters take
            the optimizer's defaults.

        Raises:
          TypeError: for an optimizer built from one pytree, or a group that is not a
            dict with ``"params"``.
          ValueError: unknown hyperparameter keys, torch's messages for invalid values,
            ``optimizer got an empty parameter list`` for a group without leaves, or
            ``some parameters appear in more than one parameter group`` for arrays this
            optimizer already holds. Nothing changes when it raises.
        """
        if self._layout.kind != "groups":
            raise TypeError(
                "add_param_group needs an optimizer built from torch's list of parameter-group "
                "dicts; this one was built from one pytree"
            )
        if not isinstance(param_group, Mapping) or "params" not in param_group:
            raise TypeError(f"param_group must be a dict with a 'params' entry, got {param_group!r}")
        overrides = {k: v for k, v in param_group.items() if k != "params"}
        self._check_keys(len(self.param_groups), overrides)
        tree = param_group["params"]
        check_params(tree)
        named = "param_names" in self.param_groups[0]
        names, explicit = self._resolve_names(
            [tree], [overrides], [self._tree_names(tree) if named or "param_names" in overrides else None]
        )
        if (names[0] is not None) != named:
            if explicit or self._explicit_names:
                kind = "with" if names[0] is not None else "without"
                raise ValueError(
                    "all optimizer param groups should be with/without names. "
                    f"cannot add param group {kind} names to the optimizer"
                )
            names = [None]  # names derived from paths are kept only while every group has them
        held = {id(x) for t in self._params for x in jax.tree.leaves(t)}
        self._check_duplicates([tree])
        if any(id(x) in held for x in jax.tree.leaves(tree)):
            raise ValueError("some parameters appear in more than one parameter group")
        factory = type(self).factory
        config = {**self.defaults, **{k: v for k, v in overrides.items() if k != "param_names"}}
        tx = factory(**{k: config[k] for k in self._factory_params})
        algorithm = _algorithm_of(tx, factory)
        if named and names[0] is None:
            for group in self.param_groups:
                del group["param_names"]
        self._explicit_names = self._explicit_names or explicit
        params = jax.tree.map(_copy_leaf, tree)
        state = tx.init(params)
        self._layout = _Layout("groups", len(self.param_groups) + 1)
        self._params.append(params)
        self._states.append(state)
        self._txs.append(_shared(tx, state, config))
        self._algorithms.append(algorithm)
        self._numeric.append(frozenset(state.hparams))
        self._none_grads.append(jax.tree.map(lambda _: None, params))
        self._grads.append(self._none_grads[-1])
        self._sizes.append(len(jax.tree.leaves(params)))
        self.param_groups.append(
            {"params": params, **({} if names[0] is None else {"param_names": names[0]}), **config}
        )
        self._applied.append({k: config[k] for k in self._factory_params})

    @staticmethod
    def _split(params: Any) -> tuple[_Layout, list[PyTree], list[dict[str, Any]], list[list[str] | None]]:
        """The layout, the groups' trees, their overrides and their leaves' names (or None)."""
        if isinstance(params, GroupedParams):
            n = len(params.overrides)
            treedef = jax.tree.structure(params.tree)
            layout = _Layout("partition", n, treedef, params.owner)
            paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(params.tree)[0]]
            names = _leaf_names(paths)
            per_group = [
                None if names is None else [m for m, o in zip(names, params.owner, strict=True) if o == g]
                for g in range(n)
            ]
            return layout, list(layout.to_groups(params.tree)), [dict(o) for o in params.overrides], per_group
        is_group_list = (
            isinstance(params, list | tuple)
            and len(params) > 0
            and all(isinstance(g, Mapping) and "params" in g for g in params)
        )
        if is_group_list:
            trees = [g["params"] for g in params]
            overrides = [{k: v for k, v in g.items() if k != "params"} for g in params]
            if not any(jax.tree.leaves(t) for t in trees):
                raise ValueError("optimizer got an empty parameter list")
            names = [Optimizer._tree_names(t) for t in trees]
            return _Layout("groups", len(trees)), trees, overrides, names
        if not jax.tree.leaves(params):
            raise ValueError("optimizer got an empty parameter list")
        return _Layout("tree"), [params], [{}], [Optimizer._tree_names(params)]

    @staticmethod
    def _tree_names(tree: PyTree) -> list[str] | None:
        return _leaf_names([p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]])

    @staticmethod
    def _resolve_names(
        trees: Sequence[PyTree], overrides: Sequence[Mapping[str, Any]], derived: Sequence[list[str] | None]
    ) -> tuple[list[list[str] | None], bool]:
        """Every group's ``param_names``, for all groups or none, and whether the user gave them.

        A group's ``"param_names"`` entry wins over the names of its tree's paths. Derived
        names are dropped unless every group has names; names the user gave must be given
        for every group (torch's rule for groups with and without names).
        """
        names: list[list[str] | None] = []
        for g, (tree, over, own) in enumerate(zip(trees, overrides, derived, strict=True)):
            if "param_names" not in over:
                names.append(own)
                continue
            given, n = over["param_names"], len(jax.tree.leaves(tree))
            if not isinstance(given, list | tuple) or not all(isinstance(x, str) for x in given):
                raise ValueError(
                    f"param_names of parameter group {g} must be a list of strings, got {given!r}"
                )
            if len(given) != n:
                raise ValueError(
                    f"param_names of parameter group {g} has {len(given)} names for {n} parameters"
                )
            names.append(list(given))
        explicit = any("param_names" in over for over in overrides)
        if all(x is not None for x in names):
            return names, explicit
        if explicit:
            kind = "without" if names[0] is not None else "with"
            raise ValueError(
                "all optimizer param groups should be with/without names. "
                f"cannot add param group {kind} names to the optimizer"
            )
        return [None] * len(names), False

    @staticmethod
    def _check_duplicates(trees: Sequence[PyTree]) -> None:
        seen: dict[int, int] = {}
        for g, tree in enumerate(trees):
            ids = [id(leaf) for leaf in jax.tree.leaves(tree)]
            if len(ids) != len(set(ids)):
                warnings.warn(
                    "optimizer contains a parameter group with duplicate parameters; "
                    "in future, this will cause an error; "
                    "see github.com/pytorch/pytorch/issues/40967 for more information",
                    stacklevel=4,
                )
            for i in set(ids):
                if seen.setdefault(i, g) != g:
                    raise ValueError("some parameters appear in more than one parameter group")

    # -- parameters, gradients, state ----------------------------------------------------

    @property
    def params(self) -> PyTree:
        """The current parameters, in the structure given to the constructor."""
        return self._layout.to_user(self._params)

    @params.setter
    def params(self, value: PyTree) -> None:
        self._check_same_tree(value, "params")
        groups = [jax.tree.map(_copy_leaf, t) for t in self._layout.to_groups(value)]
        self._params = groups
        for group, tree in zip(self.param_groups, groups, strict=True):
            group["params"] = tree

    @property
    def grad(self) -> PyTree:
        """The accumulated gradients, shaped like ``params``; ``None`` leaves after ``zero_grad()``.

        Writable: assign a pytree like ``params`` (``None`` leaves allowed, dtypes equal
        to the parameters'), as torch allows assigning ``p.grad``.
        """
        return self._layout.to_user(self._grads)

    @grad.setter
    def grad(self, value: PyTree) -> None:
        copied, all_none = _checked_grad(self.params, value)
        self._grads = list(self._layout.to_groups(copied))
        self._grads_all_none = all_none

    @property
    def state(self) -> TorchState | tuple[TorchState, ...]:
        """The functional state: a ``TorchState`` for one parameter group, else a tuple of them.

        ``param_groups`` and the state are one source of truth: reading the state first
        applies pending ``param_groups`` edits (yours, or a scheduler's ``step()`` before
        the next ``opt.step()``), as ``step()`` would, so a state saved with orbax or
        pickle right after ``scheduler.step()`` holds the new lr; an invalid edit raises
        here with torch's message, changing nothing.

        Writable with a state of the same structure, shapes and dtypes (e.g. one
        restored by orbax): assigning restores it whole, and the groups' numeric
        hyperparameters take the assigned state's values (pending edits included: a
        scheduler built before the restore, as torch's resume order has it, may have set
        its start lr; the restored state's lr wins). Pending structural flags stay
        pending and apply at the next ``step()``.
        """
        self._sync_groups()
        return self._states[0] if len(self._states) == 1 else tuple(self._states)

    @state.setter
    def state(self, value: TorchState | Sequence[TorchState]) -> None:
        states = [value] if len(self._states) == 1 else list(value)
        if len(states) != len(self._states):
            raise ValueError(f"expected {len(self._states)} group states, got {len(states)}")
        for g, (new, old) in enumerate(zip(states, self._states, strict=True)):
            self._check_same_tree(new, f"state of group {g}", reference=old)
        self._states = [jax.tree.map(_copy_leaf, s) for s in states]
        for g, st in enumerate(self._states):
            if fixed_conflicts(st.hparams.static, dict(st.hparams)):
                # restored values the compiled step fixed otherwise (a state saved after a
                # param_groups edit, restored into a fresh optimizer): rebuild the group
                # with changeable hyperparameters, so the step computes torch's rule
                self._changeable.add(g)
                config = {k: self.param_groups[g][k] for k in self._factory_params}
                config.update({k: to_python(v) for k, v in st.hparams.items() if k in config})
                tx = self._build(g, config)
                fresh = tx.init(self._params[g]).hparams
                hp = fresh.replace(**dict(st.hparams)).with_schedule_state(st.hparams.schedule_state)
                self._txs[g] = _shared(tx, TorchState(hp, st.count, st.buffers), config)
                self._states[g] = st = TorchState(hp, st.count, st.buffers)
            for k, v in st.hparams.items():
                if k in self._applied[g] and k not in st.hparams.scheduled:
                    value_py = to_python(v)
                    self.param_groups[g][k] = value_py
                    self._applied[g][k] = value_py

    def _check_same_tree(self, value: PyTree, what: str, reference: PyTree | None = None) -> None:
        ref = self.params if reference is None else reference
        # whether parameters share their step counters is a layout, not a structure:
        # a state saved after steps that some parameters skipped restores into a fresh
        # optimizer (the next step is traced for it)
        value, ref = own_counters(value), own_counters(ref)
        if jax.tree.structure(value) != jax.tree.structure(ref):
            raise ValueError(
                f"{what} does not match the optimizer's structure.\n"
                f"  expected: {jax.tree.structure(ref)}\n  got: {jax.tree.structure(value)}"
            )
        for (path, new), old in zip(
            jax.tree_util.tree_flatten_with_path(value)[0], jax.tree.leaves(ref), strict=True
        ):
            if jnp.shape(new) != jnp.shape(old) or jnp.result_type(new) != jnp.result_type(old):
                raise ValueError(
                    f"{what} at {keystr(path)} has shape {jnp.shape(new)} and dtype "
                    f"{jnp.result_type(new)}, expected {jnp.shape(old)} and {jnp.result_type(old)}"
                )

    # -- the loop -------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients, as torch's ``zero_grad``.

        Args:
          set_to_none: default True, every gradient becomes ``None`` (``step()`` then
            skips the parameter). With False, gradients that exist become zeros (so
            weight decay and momentum still move their parameters); ``None`` ones stay.
        """
        if set_to_none:
            self._grads = list(self._none_grads)
            self._grads_all_none = True
        else:
            self._grads = [
                jax.tree.map(lambda g: None if g is None else jnp.zeros_like(g), t, is_leaf=is_none)
                for t in self._grads
            ]

    def backward(
        self, loss_fn: Callable[..., Any], *args: Any, has_aux: bool = False, **kwargs: Any
    ) -> jax.Array | tuple[jax.Array, Any]:
        """Compute ``loss_fn(opt.params, *args, **kwargs)`` and ADD its gradient into ``opt.grad``.

        As torch's ``loss.backward()`` accumulates into ``.grad``: call ``zero_grad()``
        first for a fresh gradient. The loss and gradient are computed by one jitted
        ``value_and_grad``, compiled once per ``loss_fn`` (pass the same function object
        every step; ``args``/``kwargs`` are traced arrays).

        Args:
          loss_fn: ``(params, *args, **kwargs) -> scalar loss``, or ``-> (loss, aux)``
            with ``has_aux=True``; ``params`` comes in the structure ``opt.params`` has.
          *args: positional arguments for ``loss_fn`` (a batch, targets, …).
          has_aux: ``loss_fn`` returns ``(loss, aux)``, ``aux`` any pytree of arrays
            (an RNN's hidden state, a discriminator's outputs) that is not
            differentiated (``jax.value_and_grad``'s ``has_aux``). Not passed to
            ``loss_fn``.
          **kwargs: keyword arguments for ``loss_fn``.

        Returns:
          The loss, a 0-d array; with ``has_aux=True``, ``(loss, aux)``.

        Examples:
          >>> import jax.numpy as jnp
          >>> from functorch_optim.optim import SGD
          >>> opt = SGD({"w": jnp.array([1.0, 2.0])}, lr=0.1)
          >>> def loss_fn(params, x):
          ...     out = params["w"] * x
          ...     return jnp.sum(out**2), out
          >>> loss, out = opt.backward(loss_fn, jnp.array([1.0, 1.0]), has_aux=True)
          >>> float(loss), out.tolist(), opt.grad["w"].tolist()
          (5.0, [1.0, 2.0], [2.0, 4.0])
        """
        out, grads = _BACKWARD(
            loss_fn, self._layout, bool(has_aux), tuple(self._params), tuple(self._grads), args, kwargs
        )
        self._grads = list(grads)
        self._grads_all_none = False
        return out

    def step(self, closure: Callable[..., Any] | None = None) -> Any:
        """One optimizer step over every parameter that has a gradient.

        First applies changed ``param_groups`` values (validated with torch's messages;
        on an error nothing changes), then runs the jitted functional step. A parameter
        whose gradient is ``None`` is left untouched, state included.

        Args:
          closure: optional; told apart by its signature (see ``closure_takes_params``):

            * torch's ``closure() -> loss``, which re-evaluates the model itself
              (``opt.zero_grad(); loss = opt.backward(loss_fn, x, y); return loss``),
              called first, as in torch;
            * a pure ``closure(params) -> loss``: the gradients become its gradient at
              the current parameters (``zero_grad()`` then ``backward(closure)``).

        Returns:
          The closure's loss, or ``None`` without a closure.

        Raises:
          TypeError: a closure that needs more than one argument.
        """
        loss = None
        if closure is not None:
            if closure_takes_params(closure):
                self.zero_grad()
                loss = self.backward(closure)
            else:
                loss = closure()
        self._sync_groups()
        if self._grads_all_none:
            return loss
        params, states = _STEP(tuple(self._txs), tuple(self._params), tuple(self._grads), tuple(self._states))
        self._params = list(params)
        self._states = list(states)
        for group, tree in zip(self.param_groups, params, strict=True):
            group["params"] = tree
        return loss

    def _sync_groups(self) -> None:
        """Push assigned ``param_groups`` values into the states (all groups or none)."""
        updates = []
        for g, group in enumerate(self.param_groups):
            applied = self._applied[g]
            numeric, rebuild = {}, False
            for k in self._factory_params:
                try:
                    value = group[k]
                except KeyError:
                    raise ValueError(f"param_groups[{g}] lacks the hyperparameter {k!r}") from None
                if _same(value, applied[k]) or k in TORCH_ONLY_FLAGS:
                    continue
                if k in self._numeric[g]:
                    numeric[k] = value
                else:
                    rebuild = True
            if numeric and fixed_conflicts(self._states[g].hparams.static, numeric):
                # torch lets param_groups take any value: a value the compiled step fixed
                # otherwise (weight_decay 0 -> nonzero, SGD's momentum -> 0) rebuilds the
                # group with changeable hyperparameters, once (later edits are data again)
                self._changeable.add(g)
                rebuild = True
            if rebuild:
                updates.append((g, *self._rebuilt(g, group)))
            elif numeric:
                updates.append((g, self._txs[g], set_hparams(self._states[g], **numeric)))
        for g, tx, state in updates:
            self._txs[g], self._states[g] = tx, state
            self._applied[g] = {k: self.param_groups[g][k] for k in self._factory_params}

    def _rebuilt(self, g: int, config: Mapping[str, Any]) -> tuple[Any, TorchState]:
        """A new transformation for group ``g`` (a structural flag changed), keeping its buffers."""
        tx = self._build(g, config)
        fresh = tx.init(self._params[g])
        old = self._states[g]
        buffers = {n: old.buffers.get(n, b) for n, b in fresh.buffers.items()}
        return _shared(tx, fresh, config), TorchState(fresh.hparams, old.count, buffers)

    # -- torch's state_dict ---------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The state in torch's layout, with torch tensors (host copies): torch's own dict.

        ``{"state": {id: {"momentum_buffer": tensor, …}}, "param_groups": [{"lr": …, …,
        "params": [ids]}]}``, ids as in the class docstring. A parameter that never
        received a gradient has no entry (except for algorithms torch initializes
        eagerly, Adagrad). ``step`` appears where torch keeps it: a 0-d float32 tensor
        (torch's default scalar dtype) for Adam-like algorithms; SGD keeps none. The
        groups hold Python values only, like torch's.

        It is what ``torch.optim.<Same>(...).state_dict()`` would be: it loads into the
        torch optimizer as it is (``torch_opt.load_state_dict(opt.state_dict())``), and
        ``torch.save`` writes it so that ``torch.load(path)`` reads it back with torch's
        default ``weights_only=True``. Without torch installed the arrays are NumPy
        arrays (``state_dict_to_torch`` converts them later). For orbax, store
        ``state_dict_to_numpy(opt.state_dict())``; ``load_state_dict`` reads back the
        string ids and lists orbax returns.

        Returns:
          The state dict; it can be pickled, and loaded by ``load_state_dict``.
        """
        state: dict[int, dict[str, Any]] = {}
        groups = []
        start = 0
        for g, group in enumerate(self.param_groups):
            st, algorithm = self._states[g], self._algorithms[g]
            names = [n for n in st.buffers if n != "step"]
            # flattened up to the params: a buffer only some parameters keep (Adafactor's
            # row_var / variance) is None for the others
            pdef = jax.tree.structure(self._params[g])
            # a state without counters (``_base.keeps_step``: no buffer, nothing of torch's)
            counters = st.buffers.get("step")
            steps = [0] * pdef.num_leaves
            if counters is not None:
                steps = [int(s) for s in jax.device_get(pdef.flatten_up_to(counters))]
            host = {n: jax.device_get(pdef.flatten_up_to(st.buffers[n])) for n in names}
            for j, s in enumerate(steps):
                if s == 0 and not algorithm.torch_state_at_init:
                    continue
                entry: dict[str, Any] = {}
                if algorithm.torch_step == "tensor":
                    entry["step"] = np.array(float(s), dtype=np.float32)
                elif algorithm.torch_step == "int":
                    entry["step"] = s
                for n in names:
                    if host[n][j] is not None:
                        entry[n] = host[n][j]
                if entry:
                    state[start + j] = entry
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(start, start + len(steps)))
            groups.append(packed)
            start += len(steps)
        return export_state_dict({"state": state, "param_groups": groups}, tensors=_torch_available())

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict in torch's layout: this class's own, or a real torch one.

        Accepts ``state_dict()``'s output, ``torch.optim.<Same>(...).state_dict()``
        holding torch tensors, and either after ``torch.save``/``torch.load``, pickle or
        orbax (string ids, lists for tuples, NumPy arrays). Like torch, saved ids are
        matched to this optimizer's parameters by position, group by group; where the
        saved group and this one both have ``param_names``, they must agree position by
        position (a permuted dict is refused instead of loading each state into another
        parameter); saved names replace missing ones, as in torch. The saved groups'
        hyperparameters replace the current ones (extra keys such as ``initial_lr`` are
        kept); a flag a group lacks (``maximize``, ``foreach``, …: a dict of an older
        torch) takes its default, as torch's ``__setstate__`` gives it. A parameter
        without an entry gets fresh state. ``count`` becomes the largest per-parameter
        ``step``; for SGD, whose torch state has no ``step``, a parameter with a momentum
        buffer resumes as already stepped (all SGD's rule reads), one whose
        ``momentum_buffer`` is ``None`` (torch's SGD with momentum 0) as not stepped.

        Stricter than torch, which loads anything of the right length and fails (or
        silently computes with another optimizer's state) later: every entry must hold
        exactly what this optimizer keeps for that parameter, ``step`` a whole number
        >= 0, each buffer the shape and, where it has the parameter's dtype, the dtype
        this optimizer keeps (scalars torch keeps in its default dtype, NAdam's
        ``mu_product``, ASGD's ``eta`` and ``mu``, are cast); the groups must hold no
        other optimizer's hyperparameter and every numeric one of this optimizer's.

        Args:
          state_dict: ``{"state": {...}, "param_groups": [...]}``.

        Raises:
          ValueError: ``loaded state dict has a different number of parameter groups``,
            ``loaded state dict contains a parameter group that doesn't match the size
            of optimizer's group`` (torch's texts); a saved parameter name that differs
            from this optimizer's at its position (naming both); an id listed twice, or
            state for an id no group lists; an entry without ``step`` or a buffer this
            optimizer keeps, with a buffer it does not keep, a buffer of another shape or
            dtype, a negative or fractional ``step`` (each naming the parameter's id,
            name and the key); a group with another optimizer's hyperparameter, without
            one of this optimizer's numeric ones, or with another value of a constant
            (AdamW's ``decoupled_weight_decay``); torch's message for an invalid
            hyperparameter. Raised before anything changes: the optimizer is untouched
            after a failed load.
        """
        saved_groups, saved_state = read_state_dict(state_dict)
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(s["params"]) != n for s, n in zip(saved_groups, self._sizes, strict=True)):
            raise ValueError(
                "loaded state dict contains a parameter group "
                "that doesn't match the size of optimizer's group"
            )
        completed = []
        for g, saved in enumerate(saved_groups):
            check_names(g, saved, self.param_groups[g].get("param_names"))
            completed.append(self._completed(g, saved))
        entries = group_entries(saved_groups, saved_state)
        new = []
        for g, group in enumerate(self.param_groups):
            config = {k: v for k, v in group.items() if k != "params"}
            config.update({k: _as_tuples(v, config.get(k)) for k, v in completed[g].items()})
            candidate = self._build(g, config)
            fresh = candidate.init(self._params[g])
            same = jax.tree.structure(fresh) == jax.tree.structure(self._states[g])
            tx = self._txs[g] if same else _shared(candidate, fresh, config)
            state = self._state_from_entries(g, fresh, entries[g], config.get("param_names"))
            new.append((g, tx, state, config))
        for g, tx, state, config in new:
            self._txs[g], self._states[g] = tx, state
            self.param_groups[g] = {"params": self._params[g], **config}
            self._applied[g] = {k: config[k] for k in self._factory_params}
            self._numeric[g] = frozenset(state.hparams)

    def _completed(self, g: int, saved: Mapping[str, Any]) -> dict[str, Any]:
        """A saved group (without ``params``), checked and completed as torch completes it.

        torch's ``__setstate__`` gives a group that lacks a flag (``maximize``, ``foreach``,
        ``amsgrad``, …: dicts of older versions) the flag's default; so does this. A
        missing numeric hyperparameter, another class's hyperparameter or another value
        of a constant (AdamW's ``decoupled_weight_decay``) means another optimizer's dict.
        """
        cls = type(self).__name__
        check_foreign_keys(cls, g, saved, set(self.defaults))
        group = {k: v for k, v in saved.items() if k != "params"}
        for k, value in self.defaults.items():
            if k not in self._factory_params:  # a constant entry (group_extras)
                if k in group and not _same(group[k], value):
                    raise ValueError(
                        f"loaded state dict: parameter group {g} has {k}={group[k]!r}, but "
                        f"{cls}'s is always {value!r}: is it another optimizer's state dict?"
                    )
                group.setdefault(k, value)
            elif k not in group:
                default = self._factory_defaults[k]
                if not (default is None or isinstance(default, bool)):
                    raise ValueError(
                        f"loaded state dict: parameter group {g} lacks {k!r}, which {cls} keeps in "
                        "every group: is it another optimizer's state dict?"
                    )
                group[k] = default
        return group

    def _state_from_entries(
        self, g: int, fresh: TorchState, entries: Mapping[int, tuple], names: Sequence[str] | None
    ) -> TorchState:
        """Group ``g``'s state from its saved entries, every entry checked against ``fresh``."""
        algorithm, cls = self._algorithms[g], type(self).__name__
        kept = [n for n in fresh.buffers if n != "step"]
        pdef = jax.tree.structure(self._params[g])
        bufs = {n: pdef.flatten_up_to(fresh.buffers[n]) for n in kept}
        param_dtypes = [p.dtype for p in jax.tree.leaves(self._params[g])]
        steps = [0] * self._sizes[g]
        for j, (key, entry) in entries.items():
            who = f"parameter {key!r}" + ("" if names is None else f" ({names[j]!r})")
            if not isinstance(entry, Mapping):
                raise ValueError(f"loaded state dict: the state of {who} must be a dict, got {entry!r}")
            required = [n for n in kept if bufs[n][j] is not None]
            expected = ["step"] * (algorithm.torch_step is not None) + required
            for name, value in entry.items():
                if name == "step" and algorithm.torch_step is not None:
                    steps[j] = whole_count(value, who)
                elif name not in required and value is not None:
                    where = "with these settings" if name not in bufs else "for a parameter of this shape"
                    raise ValueError(
                        f"loaded state dict: {who} has state {name!r}, which {cls} {where} does "
                        f"not keep (it keeps: {', '.join(expected) or 'nothing'})"
                    )
            if algorithm.torch_step is None and all(n in entry and entry[n] is None for n in required):
                continue  # torch's SGD with momentum_buffer=None (momentum was 0): not stepped
            missing = [n for n in expected if entry.get(n) is None]
            if missing:
                raise ValueError(
                    f"loaded state dict: {who} has no {missing[0]!r}; {cls} with these settings "
                    f"keeps {', '.join(expected)} for every parameter with state"
                )
            for name in required:
                ref, value = bufs[name][j], _to_numpy(entry[name])
                if value.shape != ref.shape:
                    raise ValueError(
                        f"loaded state dict: {name} of {who} has shape {value.shape}, but "
                        f"{cls} keeps it with shape {ref.shape}"
                    )
                # a buffer of the parameter's dtype must have it (torch's state always does);
                # scalars torch keeps in its default dtype (eta, mu, mu_product) are cast
                exact = ref.dtype == param_dtypes[j]
                if (exact and value.dtype != ref.dtype) or not jnp.issubdtype(value.dtype, jnp.floating):
                    raise ValueError(
                        f"loaded state dict: {name} of {who} has dtype {value.dtype}, but {cls} "
                        f"keeps it in {ref.dtype}" + (" (the parameter's dtype)" if exact else "")
                    )
                bufs[name][j] = jnp.asarray(value, dtype=ref.dtype)
            if algorithm.torch_step is None:
                steps[j] = 1  # all SGD's rule reads: stepped before
        # parameters with equal steps share one counter, as in a state the engine stepped
        buffers = {"step": share_counters(steps, pdef)}
        for n in kept:
            buffers[n] = pdef.unflatten(bufs[n])
        count = jnp.asarray(max(steps, default=0), jnp.int32)
        return TorchState(fresh.hparams, count, {n: buffers[n] for n in fresh.buffers})

    def __getstate__(self) -> dict[str, Any]:
        self._sync_groups()  # pending param_groups edits are part of the state
        # the transformations are closures: rebuilt from the applied configuration on load
        state = dict(self.__dict__)
        del state["_txs"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_changeable", set())
        self._txs = [
            _shared(self._build(g, applied), st, applied)
            for g, (applied, st) in enumerate(zip(self._applied, self._states, strict=True))
        ]

    def __repr__(self) -> str:
        lines = [type(self).__name__ + " ("]
        for i, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            lines.extend(f"    {k}: {group[k]}" for k in sorted(group) if k != "params")
        return "\n".join(lines) + "\n)"


def state_dict_to_torch(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a torch-layout state dict with every array as a torch tensor.

    ``Optimizer.state_dict()`` already holds torch tensors where torch is installed, so
    this is needed only for a dict written without torch, or read back from orbax
    (NumPy arrays, string ids): arrays (NumPy, JAX, torch; inside lists too) become
    tensors, 0-d arrays in ``param_groups`` Python numbers, string ids ints again.

    Args:
      state_dict: a state dict in torch's layout.

    Returns:
      A new state dict, ready for ``torch_optimizer.load_state_dict``.
    """
    groups, state = read_state_dict(state_dict)
    return export_state_dict({"state": state, "param_groups": groups}, tensors=True)


def state_dict_to_numpy(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a torch-layout state dict with every array as a NumPy array, for orbax.

    orbax's ``PyTreeCheckpointer`` stores NumPy arrays, numbers, strings (``param_names``)
    and ``None``, but not torch tensors; this converts the tensors (bfloat16 included)
    and leaves everything else as it is. ``load_state_dict`` takes what orbax restores
    (string ids, lists for tuples), and ``state_dict_to_torch`` makes a torch dict of it::

        ocp.PyTreeCheckpointer().save(path, state_dict_to_numpy(opt.state_dict()))
        opt.load_state_dict(ocp.PyTreeCheckpointer().restore(path))

    Args:
      state_dict: a state dict in torch's layout.

    Returns:
      A new state dict with NumPy arrays and Python groups.
    """
    groups, state = read_state_dict(state_dict)
    return export_state_dict({"state": state, "param_groups": groups}, tensors=False)


def make_optimizer_class(
    factory: Callable[..., Any],
    name: str | None = None,
    module: str = "functorch_optim.optim",
    group_extras: Mapping[str, Any] | None = None,
) -> type[Optimizer]:
    """The ``torch.optim``-shaped class of a functional factory: ``Adam = make_optimizer_class(adam)``.

    The class's constructor is ``Name(params, <the factory's arguments>)`` — torch's
    signature, because the factory has torch's names and defaults. Every argument can be
    overridden per parameter group; numeric ones are hyperparameters in the state.

    Args:
      factory: a functional factory of this package (``functorch_optim.sgd``, …) that
        returns a transformation built by ``make_optimizer``.
      name: the class name; default torch's class name, read from the factory's
        ``Algorithm``.
      module: the ``__module__`` the class reports; default ``functorch_optim.optim``.
      group_extras: constant entries torch keeps in every parameter group without taking
        them as arguments (AdamW's ``decoupled_weight_decay=True``); default none.

    Returns:
      A subclass of ``Optimizer``.

    Raises:
      TypeError: if the factory does not build a functorch_optim optimizer.
    """
    fparams = _factory_parameters(factory)
    factory_sig = inspect.Signature(fparams)
    extras = dict(group_extras or {})
    if name is None:
        name = _algorithm_of(factory(), factory).name
    fname = getattr(factory, "__name__", name)

    def __init__(self: Optimizer, params: Any, *args: Any, **kwargs: Any) -> None:
        bound = factory_sig.bind(*args, **kwargs)
        bound.apply_defaults()
        Optimizer.__init__(self, params, {**bound.arguments, **extras})

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    __init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("self", kind), inspect.Parameter("params", kind), *fparams]
    )
    plain = inspect.Signature([p.replace(annotation=inspect.Parameter.empty) for p in fparams])
    shown = str(plain)[1:-1]
    flags = ", ".join(f"``{f}``" for f in TORCH_ONLY_FLAGS if f in factory_sig.parameters)
    doc = (
        f"``torch.optim.{name}`` on JAX: the imperative facade over ``functorch_optim.{fname}``.\n\n"
        f"``{name}(params, {shown})``\n\n"
        f"torch's arguments, names and defaults. The update rule, every hyperparameter and\n"
        f"torch's error messages are ``functorch_optim.{fname}``'s; parameters, groups,\n"
        "``zero_grad``/``backward``/``step`` and ``state_dict`` are\n"
        "``functorch_optim.optim.Optimizer``'s.\n\n"
        "Args:\n"
        "  params: one pytree of floating point arrays, torch's list of parameter-group\n"
        "    dicts (each may override any argument below), or ``group_by(tree, ...)``.\n"
        f"  **hyperparameters: as ``functorch_optim.{fname}``"
        + (f"; {flags} are accepted for torch\n    compatibility and have no effect.\n" if flags else ".\n")
    )
    namespace = {
        "__init__": __init__,
        "factory": staticmethod(factory),
        "__doc__": doc,
        "__module__": module,
        "__qualname__": name,
    }
    return type(name, (Optimizer,), namespace)
