"""The registry of every optimizer: factory, torch counterpart, state names, config grid.

One list drives the common test suite, the parity report and the facade, so no optimizer
escapes them; ``tests/test_registry.py`` checks it against ``__all__``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from functorch_optim._adadelta import adadelta
from functorch_optim._adafactor import adafactor
from functorch_optim._adagrad import adagrad
from functorch_optim._adam import adam
from functorch_optim._adamax import adamax
from functorch_optim._adamw import adamw
from functorch_optim._asgd import asgd
from functorch_optim._lbfgs import lbfgs
from functorch_optim._muon import muon
from functorch_optim._nadam import nadam
from functorch_optim._radam import radam
from functorch_optim._rmsprop import rmsprop
from functorch_optim._rprop import rprop
from functorch_optim._sgd import sgd
from functorch_optim._sparse_adam import sparse_adam


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
      closure: whether the optimizer is closure-driven (LBFGS): its step needs the loss
        function (``value_fn``), and its state is global rather than per parameter.
      shapes: the parameter shapes (a pytree of shape tuples) it accepts, for an
        optimizer that cannot take any tree (Muon: 2-D only); None for any.
      sparse_grad: whether torch's counterpart wants sparse gradients (SparseAdam):
        feed torch ``grad.to_sparse()``.
    """

    name: str
    factory: Callable[..., Any]
    torch_name: str
    buffers: tuple[str, ...]
    grid: tuple[Mapping[str, Any], ...]
    differentiable: bool = True
    closure: bool = False
    shapes: Any = None
    sparse_grad: bool = False


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


# The Adam family: betas as data, both weight-decay modes, every structural flag.
_BETAS = ((0.9, 0.999), (0.5, 0.9))


def _adam_grid() -> tuple[dict[str, Any], ...]:
    return product_grid(
        lr=(0.05,),
        betas=_BETAS,
        weight_decay=(0.0, 0.1),
        amsgrad=(False, True),
        maximize=(False, True),
        decoupled_weight_decay=(False, True),
    )


def _adamw_grid() -> tuple[dict[str, Any], ...]:
    return product_grid(
        lr=(0.05,), betas=_BETAS, weight_decay=(0.0, 0.1), amsgrad=(False, True), maximize=(False, True)
    )


def _adamax_grid() -> tuple[dict[str, Any], ...]:
    return product_grid(lr=(0.05,), betas=_BETAS, weight_decay=(0.0, 0.1), maximize=(False, True))


def _nadam_grid() -> tuple[dict[str, Any], ...]:
    grid = product_grid(
        lr=(0.05,),
        betas=_BETAS,
        weight_decay=(0.0, 0.1),
        momentum_decay=(4e-3, 0.1),
        maximize=(False, True),
        decoupled_weight_decay=(False, True),
    )
    # momentum_decay is data like betas: half the product covers it
    return tuple(c for c in grid if (c["momentum_decay"] == 4e-3) == (c["betas"] == _BETAS[0]))


def _radam_grid() -> tuple[dict[str, Any], ...]:
    return product_grid(
        lr=(0.05,),
        betas=_BETAS,
        weight_decay=(0.0, 0.1),
        maximize=(False, True),
        decoupled_weight_decay=(False, True),
    )


# The product axes are numeric (no recompilation between them); every structural flag
# (maximize, centered, momentum > 0, Adagrad's initial_accumulator_value) gets its own
# entries, each a new compilation.


def _adagrad_grid() -> tuple[dict[str, Any], ...]:
    grid = product_grid(
        lr=(0.1, 0.01), lr_decay=(0.0, 0.05), weight_decay=(0.0, 0.1), initial_accumulator_value=(0.0, 0.5)
    )
    return (
        *grid,
        {"lr": 0.01, "eps": 1e-3},
        {"lr": 0.05, "eps": 0.0, "initial_accumulator_value": 0.5},
        {"lr": 0.05, "lr_decay": 0.01, "weight_decay": 0.1, "maximize": True},
    )


def _adadelta_grid() -> tuple[dict[str, Any], ...]:
    grid = product_grid(lr=(1.0, 0.3), rho=(0.9, 0.5), eps=(1e-6, 1e-3), weight_decay=(0.0, 0.1))
    return (*grid, {"rho": 1.0}, {"rho": 0.0, "lr": 0.5}, {"lr": 0.5, "weight_decay": 0.1, "maximize": True})


def _rmsprop_grid() -> tuple[dict[str, Any], ...]:
    grid = product_grid(
        lr=(0.01, 0.002),
        alpha=(0.99, 0.8),
        weight_decay=(0.0, 0.1),
        momentum=(0.0, 0.9),
        centered=(False, True),
    )
    return (
        *grid,
        {"lr": 0.002, "eps": 1e-3, "centered": True, "momentum": 0.5},
        {"lr": 0.01, "alpha": 0.9, "weight_decay": 0.1, "momentum": 0.9, "centered": True, "maximize": True},
    )


def _rprop_grid() -> tuple[dict[str, Any], ...]:
    grid = product_grid(lr=(0.01, 0.1), etas=((0.5, 1.2), (0.3, 1.6)), step_sizes=((1e-6, 50), (1e-3, 0.05)))
    return (*grid, {"lr": 0.05, "etas": (0.4, 1.3), "step_sizes": (1e-4, 1.0), "maximize": True})


def _asgd_grid() -> tuple[dict[str, Any], ...]:
    grid = product_grid(lr=(0.01, 0.1), lambd=(1e-4, 0.1), t0=(1e6, 5.0), weight_decay=(0.0, 0.1))
    return (
        *grid,
        {"lr": 0.1, "alpha": 0.5, "t0": 0.0},
        {"lr": 0.05, "alpha": 1.0, "lambd": 0.5, "t0": 10.0},
        {"lr": 0.05, "lambd": 0.1, "t0": 3.0, "weight_decay": 0.1, "maximize": True},
    )


def covering_grid(
    primary: Mapping[str, Sequence[Any]], secondary: Mapping[str, Sequence[Any]]
) -> tuple[dict[str, Any], ...]:
    """Every combination of the ``primary`` axes; each ``secondary`` axis cycles along them.

    Keeps a grid small (and its torch runs fast) while every value of every axis occurs:
    secondary axis ``j`` takes value ``popcount(i & (j + 3)) % len(values)`` in
    configuration ``i`` (a fractional-factorial pattern, so two secondary axes are not
    simply locked together).
    """
    grid = product_grid(**primary)
    return tuple(
        {
            **cfg,
            **{
                k: values[bin(i & (j + 3)).count("1") % len(values)]
                for j, (k, values) in enumerate(secondary.items())
            },
        }
        for i, cfg in enumerate(grid)
    )


def _adafactor_grid() -> tuple[dict[str, Any], ...]:
    return covering_grid(
        {"maximize": (False, True), "weight_decay": (0.0, 0.05), "eps": ((None, 1e-3), (1e-4, 1e-2))},
        {"lr": (0.01, 0.1), "beta2_decay": (-0.8, -0.5), "d": (1.0, 1.5)},
    )


def _muon_grid() -> tuple[dict[str, Any], ...]:
    return covering_grid(
        {"nesterov": (True, False), "adjust_lr_fn": (None, "match_rms_adamw"), "momentum": (0.95, 0.0)},
        {"lr": (0.02, 0.005), "weight_decay": (0.1, 0.0)},
    )


def _sparse_adam_grid() -> tuple[dict[str, Any], ...]:
    return covering_grid(
        {"maximize": (False, True), "betas": ((0.9, 0.999), (0.5, 0.9)), "eps": (1e-8, 1e-3)},
        {"lr": (1e-3, 0.1)},
    )


def _lbfgs_grid() -> tuple[dict[str, Any], ...]:
    # Chosen so that torch's own trajectory is not chaotic: fixed steps (no line search)
    # with many iterations on Rosenbrock amplify last-bit differences (dot-product order,
    # FMA) to 1e-9..1e-3 within a few outer steps; see tests/test_lbfgs.py.
    none, wolfe = None, "strong_wolfe"
    return (
        {"line_search_fn": none, "max_iter": 1, "lr": 1.0, "history_size": 10},
        {"line_search_fn": none, "max_iter": 5, "lr": 0.5, "history_size": 10},
        {"line_search_fn": none, "max_iter": 10, "lr": 1.0, "history_size": 10, "tolerance_change": 1e-4},
        {"line_search_fn": wolfe, "max_iter": 1, "lr": 1.0, "history_size": 3, "max_eval": 4},
        {"line_search_fn": wolfe, "max_iter": 5, "lr": 0.5, "history_size": 10},
        {"line_search_fn": wolfe, "max_iter": 20, "lr": 1.0, "history_size": 3},
        {"line_search_fn": wolfe, "max_iter": 20, "lr": 1.0, "history_size": 10, "tolerance_grad": 1e-5},
    )


#: Muon takes 2-D parameters only.
MUON_SHAPES = {"w": (3, 4), "tall": (5, 3), "square": (4, 4)}

LBFGS_BUFFERS = (
    "d",
    "t",
    "old_dirs",
    "old_stps",
    "ro",
    "H_diag",
    "prev_flat_grad",
    "prev_loss",
    "n_iter",
    "func_evals",
)

# ``buffers`` lists every state name the algorithm may keep; ``max_exp_avg_sq`` exists only
# with ``amsgrad=True`` (in torch and here).
OPTIMIZERS: tuple[OptimizerSpec, ...] = (
    OptimizerSpec("sgd", sgd, "SGD", ("momentum_buffer",), _sgd_grid()),
    OptimizerSpec("adam", adam, "Adam", ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"), _adam_grid()),
    OptimizerSpec(
        "adamw", adamw, "AdamW", ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"), _adamw_grid()
    ),
    OptimizerSpec("adamax", adamax, "Adamax", ("step", "exp_avg", "exp_inf"), _adamax_grid()),
    OptimizerSpec("nadam", nadam, "NAdam", ("step", "exp_avg", "exp_avg_sq", "mu_product"), _nadam_grid()),
    OptimizerSpec("radam", radam, "RAdam", ("step", "exp_avg", "exp_avg_sq"), _radam_grid()),
    OptimizerSpec("adagrad", adagrad, "Adagrad", ("step", "sum"), _adagrad_grid()),
    OptimizerSpec("adadelta", adadelta, "Adadelta", ("step", "square_avg", "acc_delta"), _adadelta_grid()),
    OptimizerSpec(
        "rmsprop", rmsprop, "RMSprop", ("step", "square_avg", "momentum_buffer", "grad_avg"), _rmsprop_grid()
    ),
    OptimizerSpec("rprop", rprop, "Rprop", ("step", "prev", "step_size"), _rprop_grid()),
    OptimizerSpec("asgd", asgd, "ASGD", ("step", "eta", "mu", "ax"), _asgd_grid()),
    OptimizerSpec(
        "adafactor",
        adafactor,
        "Adafactor",
        ("row_var", "col_var", "variance"),
        _adafactor_grid(),
        differentiable=False,
    ),
    OptimizerSpec(
        "muon", muon, "Muon", ("momentum_buffer",), _muon_grid(), differentiable=False, shapes=MUON_SHAPES
    ),
    OptimizerSpec(
        "sparse_adam",
        sparse_adam,
        "SparseAdam",
        ("exp_avg", "exp_avg_sq"),
        _sparse_adam_grid(),
        differentiable=False,
        sparse_grad=True,
    ),
    OptimizerSpec("lbfgs", lbfgs, "LBFGS", LBFGS_BUFFERS, _lbfgs_grid(), differentiable=False, closure=True),
)


def get_spec(name: str) -> OptimizerSpec:
    """The registry entry of the optimizer named ``name`` (factory or torch class name)."""
    for spec in OPTIMIZERS:
        if name in (spec.name, spec.torch_name):
            return spec
    known = ", ".join(s.name for s in OPTIMIZERS)
    raise ValueError(f"unknown optimizer {name!r}; known: {known}")
