"""The registry of every optimizer: factory, torch counterpart, state names, config grid.

One list drives the common test suite, the parity report and the facade, so no optimizer
escapes them; ``tests/test_registry.py`` checks it against ``__all__``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from functorch_optim._sgd import sgd


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """How to build, compare and exercise one optimizer.

    Attributes:
      name: the functional factory's name (``"sgd"``).
      factory: the functional factory.
      torch_name: the ``torch.optim`` class name (``"SGD"``).
      buffers: torch's per-parameter state names to compare after a run.
      grid: keyword configurations to test, each valid for both libraries.
      differentiable: whether torch supports ``differentiable=True`` for it.
    """

    name: str
    factory: Callable[..., Any]
    torch_name: str
    buffers: tuple[str, ...]
    grid: tuple[Mapping[str, Any], ...]
    differentiable: bool = True


def product_grid(**axes: Sequence[Any]) -> tuple[dict[str, Any], ...]:
    """Every combination of the given keyword values, as dicts."""
    names = list(axes)
    return tuple(dict(zip(names, values)) for values in itertools.product(*axes.values()))


def _sgd_grid() -> tuple[dict[str, Any], ...]:
    grid = product_grid(
        lr=(0.1, 0.01),
        momentum=(0.0, 0.9),
        dampening=(0.0, 0.3),
        nesterov=(False, True),
        weight_decay=(0.0, 0.05),
        maximize=(False, True),
    )
    # torch rejects Nesterov without momentum or with dampening
    return tuple(c for c in grid if not c["nesterov"] or (c["momentum"] > 0 and c["dampening"] == 0))


OPTIMIZERS: tuple[OptimizerSpec, ...] = (OptimizerSpec("sgd", sgd, "SGD", ("momentum_buffer",), _sgd_grid()),)


def get_spec(name: str) -> OptimizerSpec:
    """The registry entry of the optimizer named ``name`` (factory or torch class name)."""
    for spec in OPTIMIZERS:
        if name in (spec.name, spec.torch_name):
            return spec
    known = ", ".join(s.name for s in OPTIMIZERS)
    raise ValueError(f"unknown optimizer {name!r}; known: {known}")
