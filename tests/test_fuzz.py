"""Property-based fuzzing against torch: every registered optimizer, float64.

For each optimizer of the registry, hypothesis draws a configuration (one of the
registry's grid entries, its numeric hyperparameters redrawn within torch's valid
ranges), a parameter pytree (nested dicts, lists and tuples; 0-d, empty and ordinary
leaves), a gradient stream with ``None`` leaves (parameters that miss steps, or never get
a gradient), and mid-run ``set_hparams`` changes; ``functorch_optim.testing.
assert_matches_torch`` then runs torch's optimizer beside the library's and compares the
parameters and every state buffer after every step (float64, rtol 1e-10). LBFGS, driven
by a closure, runs on a loss instead of a gradient stream.

The examples are derandomized (the same ones on every run) and bounded:
``EXAMPLES_PER_OPTIMIZER`` each in the normal suite; ``FUNCTORCH_OPTIM_FUZZ=1`` (``make
fuzz``) runs ten times as many.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import functorch_optim as fo
from functorch_optim._registry import OPTIMIZERS, OptimizerSpec
from functorch_optim.testing import assert_matches_torch

pytest.importorskip("torch")

FUZZ = bool(os.environ.get("FUNCTORCH_OPTIM_FUZZ"))
EXAMPLES_PER_OPTIMIZER = 3 * (10 if FUZZ else 1)

FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES_PER_OPTIMIZER,
    derandomize=True,
    deadline=None,
    database=None,
    # shrinking a failure costs minutes (each example compiles): only under make fuzz
    phases=[Phase.explicit, Phase.generate, *([Phase.shrink] if FUZZ else [])],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# --------------------------------------------------------------------------- hyperparameters

_unit = st.floats(0.05, 0.95)

#: Valid ranges of the numeric hyperparameters, by torch's names (what both libraries
#: accept for every optimizer that has the name). A value the grid entry holds as 0 (no
#: momentum, no weight decay) stays 0: whether it is zero is a structural choice.
HPARAM_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "lr": st.floats(1e-3, 0.3),
    "momentum": _unit,
    "dampening": st.floats(0.0, 0.9),
    "weight_decay": st.floats(1e-3, 0.2),
    "betas": st.tuples(st.floats(0.0, 0.95), st.floats(0.5, 0.999)),
    "alpha": st.floats(0.5, 0.99),
    "rho": st.floats(0.05, 0.95),
    "lr_decay": st.floats(1e-3, 0.1),
    "momentum_decay": st.floats(1e-3, 0.1),
    "lambd": st.floats(1e-4, 0.1),
    "t0": st.floats(0.0, 20.0),
    "etas": st.tuples(st.floats(0.3, 0.9), st.floats(1.1, 1.8)),
    "step_sizes": st.tuples(st.floats(1e-6, 1e-3), st.floats(1.0, 50.0)),
    "beta2_decay": st.floats(-1.0, -0.5),
    "d": st.floats(1.0, 2.0),
    "initial_accumulator_value": st.floats(1e-3, 0.5),
}


def _redrawable(name: str, value: Any) -> bool:
    if name not in HPARAM_VALUES or isinstance(value, bool) or value is None:
        return False
    if isinstance(value, tuple):
        return all(isinstance(v, int | float) for v in value)
    return isinstance(value, int | float) and value != 0


@st.composite
def configs(draw, spec: OptimizerSpec) -> dict[str, Any]:
    """A grid entry of ``spec`` with its numeric hyperparameters redrawn."""
    config = dict(draw(st.sampled_from(spec.grid)))
    for name, value in config.items():
        if _redrawable(name, value):
            config[name] = draw(HPARAM_VALUES[name])
    if config.get("nesterov") and "dampening" in config:
        config["dampening"] = 0.0  # torch: Nesterov needs zero dampening
    return config


@st.composite
def hparam_changes(draw, config: Mapping[str, Any], steps: int, settable: set[str]) -> dict[int, dict]:
    """``set_hparams`` changes before some steps: new values for nonzero numeric ones."""
    names = sorted(k for k, v in config.items() if k in settable and _redrawable(k, v))
    if not names or steps < 2:
        return {}
    changes = {}
    for step in draw(st.sets(st.integers(2, steps), max_size=2)):
        chosen = draw(st.lists(st.sampled_from(names), min_size=1, max_size=2, unique=True))
        changes[step] = {k: draw(HPARAM_VALUES[k]) for k in chosen}
    return changes


# --------------------------------------------------------------------------- pytrees

_SHAPES = st.sampled_from([(), (0,), (3,), (2, 3), (1, 2, 2), (2, 0)])
#: torch's Adafactor divides by a parameter's numel (ZeroDivisionError for an empty one).
_NONEMPTY_SHAPES = st.sampled_from([(), (3,), (2, 3), (1, 2, 2)])
#: Muon takes 2-D parameters only.
_MUON_SHAPES = st.sampled_from([(2, 3), (3, 2), (4, 4), (1, 5)])


def trees(shapes: st.SearchStrategy[tuple[int, ...]]) -> st.SearchStrategy[Any]:
    """Nested dicts, lists and tuples whose leaves are shapes (tuples of ints), at least one."""
    leaf = shapes.map(lambda s: ("shape", s))
    nested = st.recursive(
        leaf,
        lambda children: st.one_of(
            st.lists(children, min_size=1, max_size=3),
            st.tuples(children, children),
            st.dictionaries(st.sampled_from(["w", "b", "layer", "scale"]), children, min_size=1, max_size=3),
        ),
        max_leaves=5,
    )
    return st.one_of(
        st.dictionaries(st.sampled_from(["a", "b", "c"]), nested, min_size=1, max_size=3), nested
    )


def _build(tree: Any, make) -> Any:
    if isinstance(tree, tuple) and len(tree) == 2 and tree[0] == "shape":
        return make(tree[1])
    if isinstance(tree, dict):
        return {k: _build(v, make) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_build(v, make) for v in tree]
    return tuple(_build(v, make) for v in tree)


def _leaf_shapes(tree: Any) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    _build(tree, lambda s: out.append(s))
    return out


# --------------------------------------------------------------------------- the properties

_STEP_OPTIMIZERS = [s for s in OPTIMIZERS if not s.closure]
_CLOSURE_OPTIMIZERS = [s for s in OPTIMIZERS if s.closure]


def _settable(spec: OptimizerSpec, config: Mapping[str, Any]) -> set[str]:
    """The hyperparameters ``set_hparams`` takes for this configuration."""
    return set(fo.get_hparams(spec.factory(**config).init({"w": jnp.zeros((2, 2))})))


@pytest.mark.parametrize("spec", _STEP_OPTIMIZERS, ids=[s.name for s in _STEP_OPTIMIZERS])
@FUZZ_SETTINGS
@given(data=st.data())
def test_random_runs_match_torch(spec: OptimizerSpec, data: st.DataObject) -> None:
    config = data.draw(configs(spec), label="config")
    shapes = {"muon": _MUON_SHAPES, "adafactor": _NONEMPTY_SHAPES}.get(spec.name, _SHAPES)
    shape_tree = data.draw(trees(shapes), label="tree")
    steps = data.draw(st.integers(1, 5), label="steps")
    n_leaves = len(_leaf_shapes(shape_tree))
    # per step and leaf: does it get a gradient? (a leaf may miss its first steps or all)
    has_grad = data.draw(
        st.lists(
            st.lists(st.booleans(), min_size=n_leaves, max_size=n_leaves), min_size=steps, max_size=steps
        ),
        label="gradient pattern",
    )
    changes = data.draw(hparam_changes(config, steps, _settable(spec, config)), label="set_hparams")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    params = _build(shape_tree, lambda s: rng.standard_normal(s))
    grads = []
    for mask in has_grad:
        it = iter(mask)
        grads.append(_build(shape_tree, lambda s, it=it: rng.standard_normal(s) if next(it) else None))
    assert_matches_torch(spec, params, grads, hparams_at=changes, **config)


@pytest.mark.parametrize("spec", _CLOSURE_OPTIMIZERS, ids=[s.name for s in _CLOSURE_OPTIMIZERS])
@FUZZ_SETTINGS
@given(data=st.data())
def test_random_closure_runs_match_torch(spec: OptimizerSpec, data: st.DataObject) -> None:
    config = data.draw(configs(spec), label="config")
    # torch's LBFGS takes the max of the flat gradient: it raises when every leaf is empty
    nonempty = trees(_SHAPES).filter(lambda t: any(np.prod(s) > 0 for s in _leaf_shapes(t)))
    shape_tree = data.draw(nonempty, label="tree")
    steps = data.draw(st.integers(1, 3), label="steps")
    changes = data.draw(hparam_changes(config, steps, _settable(spec, config)), label="set_hparams")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    params = _build(shape_tree, lambda s: rng.standard_normal(s))
    # a well-conditioned quadratic per batch: sum(c * (p - target)^2), c in [0.5, 2]
    batches = [
        (_build(shape_tree, lambda s: rng.uniform(0.5, 2.0, s)), _build(shape_tree, rng.standard_normal))
        for _ in range(steps)
    ]

    def loss_fn(p, batch):
        terms = [
            jnp.sum(c * (x - t) ** 2)
            for x, c, t in zip(jax.tree.leaves(p), jax.tree.leaves(batch[0]), jax.tree.leaves(batch[1]))
        ]
        return sum(terms[1:], terms[0])

    assert_matches_torch(spec, params, loss_fn=loss_fn, data=batches, hparams_at=changes, **config)
