"""A jitted optimizer step whose donation of params and state is checked, not assumed."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax

from functorch_optim._base import step as _step
from functorch_optim._tree import PyTree, keystr

_ALIAS_BLOCK = re.compile(r"input_output_alias=\{(.*?)\}, entry_computation_layout", re.S)
_ALIAS_ENTRY = re.compile(r"\{[0-9,]*\}: \((\d+), \{[0-9,]*\}, (?:may|must)-alias\)")


def aliased_parameters(compiled: Any) -> set[int]:
    """Numbers of the entry parameters that a compiled XLA computation writes in place.

    ``compiled`` is a ``jax.stages.Compiled``; with ``keep_unused=True`` parameter ``i``
    is the ``i``-th leaf of the flattened arguments.
    """
    text = compiled.as_text()
    head = text[: text.find("\n")] if "\n" in text else text
    block = _ALIAS_BLOCK.search(head)
    if block is None:
        return set()
    return {int(m.group(1)) for m in _ALIAS_ENTRY.finditer(block.group(1))}


def unaliased_paths(compiled: Any, args: Sequence[PyTree], donated: Sequence[int]) -> list[str]:
    """Paths of donated array leaves that the compiled step does not update in place.

    Args:
      compiled: the ``Compiled`` of a function jitted with ``keep_unused=True``.
      args: its positional arguments (arrays or ``jax.ShapeDtypeStruct`` leaves).
      donated: positions of the donated arguments.

    Returns:
      ``keystr`` paths, prefixed by the argument position (``arg0['w']``), of every
      donated leaf with at least one element that XLA could not alias to an output.
    """
    aliased = aliased_parameters(compiled)
    missing, offset = [], 0
    for i, arg in enumerate(args):
        leaves = jax.tree_util.tree_flatten_with_path(arg)[0]
        if i in donated:
            for j, (path, leaf) in enumerate(leaves):
                if getattr(leaf, "size", 0) and offset + j not in aliased:
                    missing.append(f"arg{i}{keystr(path) if path else ''}")
        offset += len(leaves)
    return missing


def jit_step(
    tx: optax.GradientTransformation, *, donate: bool = True
) -> Callable[..., tuple[PyTree, PyTree]]:
    """``functorch_optim.step`` for ``tx``, jitted with params and state donated.

    The returned function ``(params, grads, state, **extra_args) -> (params, state)``
    is ``jax.jit(step, donate_argnums=(0, 2), keep_unused=True)``: ``keep_unused`` keeps
    every donated buffer an input of the computation, so XLA can write the new params,
    buffers, step counters and accumulators over the old ones (no fresh allocation and
    page faults per step). After each compilation it reads XLA's input/output aliasing
    and warns, naming the leaves, when some donated array could not be updated in place
    (for instance a state leaf whose dtype or shape the step changes).

    Args:
      tx: any optax-compatible transformation (this package's or optax's).
      donate: donate params and state, default True. Donated arrays are consumed:
        use the returned ones.

    Returns:
      The jitted step; its ``jitted`` attribute is the underlying ``jax.jit`` object.

    Warns:
      UserWarning: ``jit_step: donated buffers not updated in place (each step
        allocates them anew): params['w'], ...``.

    Examples:
      >>> import jax.numpy as jnp, functorch_optim as fo
      >>> tx = fo.sgd(lr=0.1, momentum=0.9)
      >>> step = fo.jit_step(tx)
      >>> params = {"w": jnp.array([1.0, 2.0])}
      >>> params, state = step(params, {"w": jnp.array([1.0, 1.0])}, tx.init(params))
      >>> params["w"].tolist()
      [0.9, 1.9]
    """

    def fn(params, grads, state, **extra_args):
        return _step(tx, params, grads, state, **extra_args)

    jitted = jax.jit(fn, donate_argnums=(0, 2) if donate else (), keep_unused=True)

    def check(params, grads, state, extra_args):
        compiled = jitted.lower(params, grads, state, **extra_args).compile()
        names = {"arg0": "params", "arg2": "state"}
        missing = [names[p[:4]] + p[4:] for p in unaliased_paths(compiled, (params, grads, state), (0, 2))]
        if missing:
            shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
            warnings.warn(
                f"jit_step: donated buffers not updated in place (each step allocates them anew): {shown}",
                UserWarning,
                stacklevel=3,
            )

    def spec(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)

    def call(params, grads, state, **extra_args):
        compiled_before = jitted._cache_size()
        if donate and compiled_before == 0:
            # the first call: check before the donated inputs are consumed (the call
            # below then reuses this compilation)
            check(params, grads, state, extra_args)
        new_params, new_state = jitted(params, grads, state, **extra_args)
        if donate and 0 < compiled_before < jitted._cache_size():
            # a recompilation (new shapes): the donated inputs are gone, their shapes
            # live on in the outputs; lowering again hits the compilation cache
            check(spec(new_params), grads, spec(new_state), extra_args)
        return new_params, new_state

    call.jitted = jitted
    call.__doc__ = f"Jitted step of {tx!r} (params and state donated={donate})."
    return call
