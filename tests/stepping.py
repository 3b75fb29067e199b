"""Run a functorch_optim optimizer over a gradient stream with few compilations.

Configurations that share their structural (static) flags differ only in the
hyperparameter arrays held in the state, so one transformation per flag combination (and
one jitted ``fo.step``) serves them all: its update reads the numbers from the state that
each configuration's own ``init`` built.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch

import functorch_optim as fo
from tests.helpers import zero_ness

# torch's intra-op thread pool spins on a loaded 2-core machine: its small per-step ops
# ran 5-50x slower (CPU time) with the default thread count than with one thread.
torch.set_num_threads(1)

#: The one jitted step every configuration runs through (``STEP._cache_size()`` counts
#: its compilations).
STEP = jax.jit(fo.step, static_argnums=0)
_TX: dict[tuple, Any] = {}


def shared_tx(factory: Callable[..., Any], static: Mapping[str, Any]) -> Any:
    """The transformation shared by every configuration with these structural flags."""
    key = (factory.__name__, tuple((k, repr(v)) for k, v in sorted(static.items())))
    return _TX.setdefault(key, factory(**static))


def run_fo(
    factory: Callable[..., Any],
    cfg: Mapping[str, Any],
    static_keys: Sequence[str],
    params: Any,
    grads: Sequence[Any],
) -> tuple[Any, Any]:
    """``(final_params, final_state)`` of ``factory(**cfg)`` after stepping through ``grads``.

    ``None`` gradient leaves are allowed. ``static_keys`` names the keywords that are
    structural flags; the transformation (and the compiled step) is shared by every
    configuration with the same values of them.
    """
    defaults = {k: v.default for k, v in inspect.signature(factory).parameters.items()}
    static = {k: cfg.get(k, defaults[k]) for k in static_keys}
    # a number's zero-ness is compiled in (``Algorithm.fixed_zero``): part of the key
    full = {**defaults, **cfg}
    tx = shared_tx(factory, {**static, **{k: v for k, v in zero_ness(full).items() if k in defaults}})
    p = jax.tree.map(jnp.asarray, params)
    state = factory(**cfg).init(p)
    for g in grads:
        p, state = STEP(tx, p, jax.tree.map(jnp.asarray, g), state)
    return p, state
