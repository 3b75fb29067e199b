"""torch module weights ↔ nested JAX pytrees, by names.

A torch module names its tensors with dotted paths (``"encoder.0.weight"``); here they
become nested ``OrderedDict`` s (``{"encoder": {"0": {"weight": ...}}}``) of JAX arrays,
which JAX flattens in torch's ``named_parameters()`` order, and back.
Start a JAX port and its torch reference from identical weights, compare gradients or
trained weights leaf by leaf, or load JAX-trained weights into the torch module::

    from functorch_optim.interop.torch import tree_from_module, load_tree_into_module

    params = tree_from_module(model)        # named_parameters() -> nested OrderedDict
    ...                                     # train with functorch_optim
    load_tree_into_module(model, params)    # and back, by name

Arrays keep torch's layouts (a ``Linear`` weight stays ``(out_features, in_features)``);
values are copied, never shared. torch is imported on first use.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functorch_optim._tree import PyTree, is_none

__all__ = [
    "flatten_names",
    "grads_from_module",
    "load_tree_into_module",
    "tree_from_module",
    "tree_from_state_dict",
    "tree_to_state_dict",
    "unflatten_names",
]

SEP = "."


def unflatten_names(flat: Mapping[str, Any], sep: str = SEP) -> OrderedDict[str, Any]:
    """A flat ``{"a.b.c": x}`` mapping as nested ``OrderedDict`` s ``{"a": {"b": {"c": x}}}``.

    ``OrderedDict`` because JAX flattens it in insertion order (a plain ``dict`` in sorted
    key order: ``"0.bias"`` before ``"0.weight"``, ``"10"`` before ``"2"``), so
    ``jax.tree.leaves`` of the result lists the values in ``flat``'s order whenever the
    names sharing a prefix are contiguous there, as ``model.named_parameters()`` and
    ``model.state_dict()`` list them.

    Args:
      flat: names to values; names are split on ``sep``.
      sep: the separator, default ``"."`` (torch's).

    Returns:
      Nested ``OrderedDict`` s in the order the names first appear.

    Raises:
      ValueError: when a name is both a value and a prefix of another name
        (``"a"`` and ``"a.b"``), naming both.

    Examples:
      >>> from functorch_optim.interop.torch import unflatten_names
      >>> import jax
      >>> tree = unflatten_names({"fc.weight": 1, "fc.bias": 2, "scale": 3})
      >>> tree["fc"]["bias"], jax.tree.leaves(tree)
      (2, [1, 2, 3])
    """
    out: OrderedDict[str, Any] = OrderedDict()
    owner: dict[tuple[str, ...], str] = {}
    for name, value in flat.items():
        parts = name.split(sep)
        node = out
        for i, part in enumerate(parts[:-1]):
            prefix = tuple(parts[: i + 1])
            child = node.setdefault(part, OrderedDict())
            if not isinstance(child, dict) or prefix in owner:
                raise ValueError(
                    f"name {name!r} lies under {sep.join(prefix)!r}, which is itself a value; "
                    "names must not be prefixes of one another"
                )
            node = child
        last = parts[-1]
        if last in node:
            raise ValueError(f"name {name!r} is a prefix of other names (or repeated)")
        node[last] = value
        owner[tuple(parts)] = name
    return out


def flatten_names(tree: PyTree, sep: str = SEP) -> OrderedDict[str, Any]:
    """A nested pytree as a flat ``OrderedDict`` from dotted names to leaves.

    Dict keys, list/tuple indices and attribute names all become name parts, so the
    inverse of ``unflatten_names`` for nested dicts. ``None`` leaves are kept.

    Args:
      tree: a pytree (nested dicts, lists, tuples, named tuples, ...).
      sep: the separator, default ``"."``.

    Returns:
      ``OrderedDict`` of dotted name to leaf, in the tree's flattening order.

    Examples:
      >>> from functorch_optim.interop.torch import flatten_names
      >>> dict(flatten_names({"fc": {"weight": 1, "bias": 2}, "layers": [3, 4]}))
      {'fc.bias': 2, 'fc.weight': 1, 'layers.0': 3, 'layers.1': 4}
    """
    out: OrderedDict[str, Any] = OrderedDict()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_none)[0]:
        out[sep.join(_key_part(k) for k in path)] = leaf
    return out


def _key_part(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _is_tensor(x: Any) -> bool:
    """Whether ``x`` is a ``torch.Tensor`` (without importing torch)."""
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _to_numpy(x: Any) -> np.ndarray:
    """A host NumPy copy of an array: a torch tensor, a JAX or NumPy array, a scalar.

    bfloat16 tensors become ``ml_dtypes`` bfloat16 arrays (JAX's), which NumPy's own
    conversion of a tensor refuses.
    """
    if _is_tensor(x):
        import torch

        t = x.detach().cpu()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(jnp.bfloat16).copy()
        return t.numpy().copy()
    return np.array(x, copy=True)


def _to_tensor(x: Any) -> Any:
    """A ``torch.Tensor`` copy of an array (NumPy, JAX or torch), bfloat16 included."""
    import torch

    if _is_tensor(x):
        return x.detach().clone()
    arr = np.array(x, copy=True)
    if arr.dtype == jnp.bfloat16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def _to_jax(tensor: Any, dtype: Any) -> jax.Array:
    arr = _to_numpy(tensor)
    if dtype is not None and jnp.issubdtype(arr.dtype, jnp.floating):
        arr = arr.astype(dtype)
    return jnp.asarray(arr)


def tree_from_module(
    module: Any, *, buffers: bool = False, dtype: Any = None, sep: str = SEP
) -> OrderedDict[str, Any]:
    """A torch module's ``named_parameters()`` as nested ``OrderedDict`` s of JAX arrays.

    The tree flattens (``jax.tree.leaves``) in ``named_parameters()`` order, so an
    optimizer built from it numbers the parameters as ``torch.optim.X(model.parameters())``
    does: the facade's ``state_dict()`` ids and ``param_names`` are torch's, and state
    dicts move between the two without reordering.

    Args:
      module: a ``torch.nn.Module``.
      buffers: also include ``named_buffers()`` (running statistics, ...), default
        False: an optimizer sees only parameters.
      dtype: cast floating arrays to this dtype, default: keep torch's dtype.
      sep: the name separator, default ``"."``.

    Returns:
      Nested ``OrderedDict`` s by name parts, of JAX arrays (copies); with ``buffers``,
      the parameters keep ``named_parameters()`` order among themselves.

    Examples:
      >>> import jax, torch
      >>> from functorch_optim.interop.torch import flatten_names, tree_from_module
      >>> _ = torch.manual_seed(0)
      >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh(), torch.nn.Linear(2, 1))
      >>> params = tree_from_module(model)
      >>> {k: {n: v.shape for n, v in layer.items()} for k, layer in params.items()}
      {'0': {'weight': (2, 3), 'bias': (2,)}, '2': {'weight': (1, 2), 'bias': (1,)}}
      >>> list(flatten_names(params)) == [n for n, _ in model.named_parameters()]
      True
    """
    named = OrderedDict((n, _to_jax(p, dtype)) for n, p in module.named_parameters())
    if buffers:
        named.update((n, _to_jax(b, dtype)) for n, b in module.named_buffers())
    return unflatten_names(named, sep)


def tree_from_state_dict(
    state_dict: Mapping[str, Any], *, dtype: Any = None, sep: str = SEP
) -> OrderedDict[str, Any]:
    """A torch ``state_dict()`` (parameters and buffers) as a nested dict of JAX arrays.

    Args:
      state_dict: names to tensors, e.g. ``module.state_dict()``.
      dtype: cast floating arrays to this dtype, default: keep torch's dtype.
      sep: the name separator, default ``"."``.

    Returns:
      Nested ``OrderedDict`` s of JAX arrays in the state dict's order; integer buffers
      (``num_batches_tracked``) stay integer.

    Examples:
      >>> import torch
      >>> from functorch_optim.interop.torch import tree_from_state_dict
      >>> tree = tree_from_state_dict(torch.nn.BatchNorm1d(2).state_dict())
      >>> sorted(tree), tree["running_var"].tolist(), tree["num_batches_tracked"].dtype.name
      (['bias', 'num_batches_tracked', 'running_mean', 'running_var', 'weight'], [1.0, 1.0], 'int64')
    """
    return unflatten_names(OrderedDict((n, _to_jax(t, dtype)) for n, t in state_dict.items()), sep)


def tree_to_state_dict(tree: PyTree, *, dtype: Any = None, sep: str = SEP) -> OrderedDict[str, Any]:
    """A nested pytree of arrays as a torch ``state_dict``: dotted names to tensors.

    Args:
      tree: nested dicts (or any pytree) of arrays.
      dtype: a ``torch.dtype`` to cast floating tensors to, default: the arrays' dtype.
      sep: the name separator, default ``"."``.

    Returns:
      ``OrderedDict`` from names to ``torch.Tensor`` copies, ready for
      ``module.load_state_dict``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from functorch_optim.interop.torch import tree_to_state_dict
      >>> sd = tree_to_state_dict({"fc": {"weight": jnp.ones((1, 2)), "bias": jnp.zeros(1)}})
      >>> {k: tuple(v.shape) for k, v in sd.items()}
      {'fc.bias': (1,), 'fc.weight': (1, 2)}
    """
    out: OrderedDict[str, Any] = OrderedDict()
    for name, leaf in flatten_names(tree, sep).items():
        if leaf is None:
            continue
        t = _to_tensor(leaf)
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name] = t
    return out


def load_tree_into_module(module: Any, tree: PyTree, *, strict: bool = True, sep: str = SEP) -> Any:
    """Copy a nested pytree's arrays into a torch module's tensors, by name, in place.

    Values are cast to each destination tensor's dtype. Parameters keep their identity
    (so a torch optimizer built on them stays valid).

    Args:
      module: the ``torch.nn.Module`` to write into.
      tree: nested dicts of arrays named like ``module.state_dict()`` (parameters, and
        buffers if present).
      strict: require that the tree names exactly the module's parameters (buffers may
        be omitted), default True.
      sep: the name separator, default ``"."``.

    Returns:
      The module.

    Raises:
      ValueError: listing missing and unexpected names (strict), or a name whose shape
        differs from the module's tensor, before anything is copied.

    Examples:
      >>> import jax.numpy as jnp, torch
      >>> from functorch_optim.interop.torch import load_tree_into_module
      >>> lin = torch.nn.Linear(2, 1)
      >>> _ = load_tree_into_module(lin, {"weight": jnp.array([[1.0, 2.0]]), "bias": jnp.array([0.5])})
      >>> lin(torch.tensor([1.0, 1.0])).item()
      3.5
    """
    import torch

    flat = {k: v for k, v in flatten_names(tree, sep).items() if v is not None}
    targets = dict(module.state_dict(keep_vars=True))
    param_names = {n for n, _ in module.named_parameters()}
    unexpected = sorted(set(flat) - set(targets))
    missing = sorted(param_names - set(flat))
    if strict and (unexpected or missing):
        raise ValueError(f"load_tree_into_module: missing names {missing}, unexpected names {unexpected}")
    for name, value in flat.items():
        if name in targets and tuple(np.shape(value)) != tuple(targets[name].shape):
            raise ValueError(
                f"load_tree_into_module: {name!r} has shape {tuple(np.shape(value))}, but the "
                f"module's tensor has shape {tuple(targets[name].shape)}"
            )
    with torch.no_grad():
        for name, value in flat.items():
            if name in targets:
                dst = targets[name]
                dst.copy_(_to_tensor(value).to(dst.dtype))
    return module


def grads_from_module(module: Any, *, dtype: Any = None, sep: str = SEP) -> OrderedDict[str, Any]:
    """The ``.grad`` of every parameter of a torch module, as a nested dict.

    A parameter whose ``.grad`` is ``None`` gives a ``None`` leaf, which this package's
    optimizers treat as torch does (the parameter is skipped).

    Args:
      module: a ``torch.nn.Module`` after ``backward()``.
      dtype: cast floating arrays to this dtype, default: keep torch's dtype.
      sep: the name separator, default ``"."``.

    Returns:
      Nested ``OrderedDict`` s with ``tree_from_module(module)``'s structure.

    Examples:
      >>> import torch
      >>> from functorch_optim.interop.torch import grads_from_module
      >>> lin = torch.nn.Linear(2, 1)
      >>> lin.weight.grad = torch.ones(1, 2)
      >>> grads = grads_from_module(lin)
      >>> grads["weight"].tolist(), grads["bias"]
      ([[1.0, 1.0]], None)
    """
    named = OrderedDict(
        (n, None if p.grad is None else _to_jax(p.grad, dtype)) for n, p in module.named_parameters()
    )
    return unflatten_names(named, sep)
