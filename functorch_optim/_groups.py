"""Parameter groups in the functional API: torch's ``param_groups`` as one transformation.

The selection rules (a regex searched in a leaf's dotted name, or a predicate on its key
path and value) are the facade's ``group_by`` rules; both use ``select_groups``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import optax

from functorch_optim._base import STEP_ATTR
from functorch_optim._base import step as _step
from functorch_optim._hyperparams import ParamGroupsState
from functorch_optim._tree import PyTree, is_none

#: The group that takes the leaves no rule selects.
DEFAULT_GROUP = "default"


def path_name(path: tuple) -> str:
    """A key path as a dotted name, like torch's ``named_parameters()``: ``"layers.0.bias"``.

    Args:
      path: a ``jax.tree_util`` key path (dict keys, sequence indices, attributes).

    Returns:
      The keys joined by ``"."``; the names ``group_by`` regexes are matched against.
    """
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.FlattenedIndexKey):
            parts.append(str(key.key))
        else:
            parts.append(str(key))
    return ".".join(parts)


def _selector(where: Any, label: str) -> Callable[[tuple, Any], bool]:
    if isinstance(where, str):
        pattern = re.compile(where)
        return lambda path, leaf: pattern.search(path_name(path)) is not None
    if callable(where):
        return where
    raise ValueError(f"{label}'s 'where' must be a regex string or a callable, got {where!r}")


def select_groups(
    leaves: Sequence[tuple[tuple, Any]], wheres: Sequence[Any], labels: Sequence[str]
) -> list[int]:
    """The group of each leaf under ``wheres`` (one rule per group, in group order).

    Args:
      leaves: ``(key path, leaf)`` pairs.
      wheres: per group, a regex searched (``re.search``) in the leaf's dotted name
        (``path_name``) or a predicate ``(path, leaf) -> bool``.
      labels: per group, how error messages name it (``"group_by: group 0"``).

    Returns:
      Per leaf, the index of the one group that selects it, or ``len(wheres)`` when none
      does (the group of the remaining leaves).

    Raises:
      ValueError: ``some parameters appear in more than one parameter group`` (torch's
        words), naming the leaf and the groups; a rule that is neither a string nor a
        callable.
    """
    selectors = [_selector(w, label) for w, label in zip(wheres, labels, strict=True)]
    owner = []
    for path, leaf in leaves:
        chosen = [i for i, sel in enumerate(selectors) if sel(path, leaf)]
        if len(chosen) > 1:
            raise ValueError(
                "some parameters appear in more than one parameter group: "
                f"{path_name(path)!r} is selected by {' and '.join(labels[i] for i in chosen)}"
            )
        owner.append(chosen[0] if chosen else len(wheres))
    return owner


def param_groups(
    factory: Callable[..., optax.GradientTransformation],
    groups: Mapping[str, Mapping[str, Any]],
    /,
    **defaults: Any,
) -> optax.GradientTransformationExtraArgs:
    r"""torch's parameter groups as one transformation: per-group hyperparameters by rule.

    ``torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay,
    "weight_decay": 0.0}], lr=lr)`` is, for a parameter pytree::

        fo.param_groups(fo.adamw, {"no_decay": {"where": r"bias|LayerNorm\.weight",
                                                "weight_decay": 0.0}}, lr=lr, weight_decay=0.01)

    Each group runs ``factory(**{**defaults, **overrides})`` on its own parameters; a
    parameter belongs to the group whose ``"where"`` selects it (the facade's
    ``group_by`` rules: a regex searched in the dotted name, ``"layers.0.bias"``, or a
    predicate ``(path, leaf) -> bool``, e.g. ``lambda path, p: p.ndim <= 1``), or, when
    none does, to the group ``"default"``. The groups are decided from the tree's
    structure and shapes, so they are static under ``jit``. A group may hold no
    parameter at all (a rule that matches nothing in this model): its optimizer gets an
    empty tree, as optax's do. Each parameter's step is the group optimizer's, so the
    run equals torch's optimizer with the same groups.

    It is an optax transformation like any other: a global-norm clip goes before it in
    one chain, and ``grad_accumulate`` goes around that chain::

        tx = fo.grad_accumulate(optax.chain(fo.clip_grad_norm_transform(1.0), groups), every=k)

    The clip belongs inside ``grad_accumulate``: torch clips once per optimizer step, the
    accumulated gradient (``backward()`` k times, then ``clip_grad_norm_``, then
    ``step()``); outside, it would clip every micro-batch's gradient on its own.

    Args:
      factory: makes one group's transformation from hyperparameters: any factory of
        this package (``fo.adamw``), an optax one, or a ``functools.partial``.
      groups: group name to ``{"where": regex_or_predicate, **overrides}``, in torch's
        group order. The entry ``"default"``, if given, has no ``"where"`` (it holds the
        remaining parameters) and only overrides.
      **defaults: the hyperparameters every group starts from (the optimizer's
        constructor arguments in torch).

    Returns:
      An optax ``GradientTransformationExtraArgs`` whose state is a ``ParamGroupsState``;
      ``state.groups[name]`` is that group's state. Extra arguments (``grad_mask``) are
      split by group like the gradients.

    Raises:
      ValueError: a group that is not a dict, lacks ``"where"`` (or has one, for
        ``"default"``), or whose ``where`` is not a regex or callable; ``some parameters
        appear in more than one parameter group`` (naming the parameter) at ``init``
        when two rules select the same parameter; what ``factory`` raises for a group's
        hyperparameters (torch's messages), at construction.

    Examples:
      >>> import jax.numpy as jnp, functorch_optim as fo
      >>> tx = fo.param_groups(fo.sgd, {"bias": {"where": r"\.b$", "lr": 1.0}}, lr=0.1)
      >>> params = {"dense": {"w": jnp.ones(2), "b": jnp.ones(2)}}
      >>> grads = {"dense": {"w": jnp.ones(2), "b": jnp.ones(2)}}
      >>> params, state = fo.step(tx, params, grads, tx.init(params))
      >>> params["dense"]["b"].tolist(), params["dense"]["w"].tolist()
      ([0.0, 0.0], [0.9, 0.9])
      >>> [float(fo.get_hparams(state, group=g)["lr"]) for g in ("bias", "default")]
      [1.0, 0.1]
    """
    if not isinstance(groups, Mapping):
        raise ValueError(
            "param_groups: groups must be a dict from group name to {'where': regex_or_predicate, "
            f"**overrides}}, got {groups!r}"
        )
    names, wheres, overrides = [], [], []
    for name, spec in groups.items():
        if not isinstance(spec, Mapping):
            raise ValueError(f"param_groups: group {name!r} must be a dict, got {spec!r}")
        if name == DEFAULT_GROUP:
            if "where" in spec:
                raise ValueError(
                    f"param_groups: group {DEFAULT_GROUP!r} holds the parameters no other group "
                    "selects; it takes overrides only, not 'where'"
                )
            continue
        if "where" not in spec:
            raise ValueError(
                f"param_groups: group {name!r} must have a 'where' key (a regex or a predicate "
                f"(path, leaf) -> bool), got {spec!r}"
            )
        _selector(spec["where"], f"param_groups: group {name!r}")
        names.append(name)
        wheres.append(spec["where"])
        overrides.append({k: v for k, v in spec.items() if k != "where"})
    names.append(DEFAULT_GROUP)
    overrides.append(dict(groups.get(DEFAULT_GROUP, {})))
    txs = [optax.with_extra_args_support(factory(**{**defaults, **o})) for o in overrides]
    labels = [f"group {n!r}" for n in names[:-1]]

    def split(params: PyTree) -> tuple[Any, list[int]]:
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        return jax.tree.structure(params), select_groups(leaves, wheres, labels)

    def part(treedef: Any, owner: list[int], tree: PyTree, g: int) -> PyTree:
        # group g's view of a tree shaped like the params: None at the others' parameters
        leaves = treedef.flatten_up_to(tree)
        return treedef.unflatten([x if o == g else None for x, o in zip(leaves, owner, strict=True)])

    def merge(treedef: Any, owner: list[int], parts: list[PyTree]) -> PyTree:
        flat = [treedef.flatten_up_to(p) for p in parts]
        return treedef.unflatten([flat[o][i] for i, o in enumerate(owner)])

    def split_extra(treedef, owner, extra_args, g):
        mask = extra_args.get("grad_mask")
        if mask is None:
            return extra_args
        return {**extra_args, "grad_mask": part(treedef, owner, mask, g)}

    def init(params: PyTree) -> ParamGroupsState:
        treedef, owner = split(params)
        return ParamGroupsState(
            {n: tx.init(part(treedef, owner, params, g)) for g, (n, tx) in enumerate(zip(names, txs))}
        )

    def update(grads, state, params=None, **extra_args):
        if params is None:
            raise ValueError("param_groups: update() needs params (the groups are chosen from them)")
        treedef, owner = split(params)
        outs, new = [], {}
        for g, (n, tx) in enumerate(zip(names, txs)):
            updates, new[n] = tx.update(
                part(treedef, owner, grads, g),
                state.groups[n],
                part(treedef, owner, params, g),
                **split_extra(treedef, owner, extra_args, g),
            )
            outs.append(updates)
        updates = merge(treedef, owner, outs)
        updates = jax.tree.map(lambda g, u: None if g is None else u, grads, updates, is_leaf=is_none)
        return updates, ParamGroupsState(new)

    def step_fn(params, grads, state, **extra_args):
        # each group by its own exact step (torch's operation order for this package's)
        treedef, owner = split(params)
        outs, new = [], {}
        for g, (n, tx) in enumerate(zip(names, txs)):
            p, new[n] = _step(
                tx,
                part(treedef, owner, params, g),
                part(treedef, owner, grads, g),
                state.groups[n],
                **split_extra(treedef, owner, extra_args, g),
            )
            outs.append(p)
        return merge(treedef, owner, outs), ParamGroupsState(new)

    setattr(update, STEP_ATTR, step_fn)
    return optax.GradientTransformationExtraArgs(init, update)
