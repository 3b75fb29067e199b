"""Donation: every jitted step updates params, state and accumulator in place."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functorch_optim as fo
from functorch_optim._jit import aliased_parameters, unaliased_paths
from functorch_optim._registry import OPTIMIZERS
from tests.helpers import kernel_table_bytes


def _params(shapes=None):
    shapes = shapes or {"layer": {"w": (20, 50)}, "b": (600,)}
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)
    return jax.tree.map(
        lambda s: jnp.linspace(-1.0, 1.0, int(np.prod(s)), dtype=jnp.float32).reshape(s) + 0.25,
        shapes,
        is_leaf=is_shape,
    )


def _grads(params, k):
    return jax.tree.map(lambda p: jnp.cos(p * (k + 1)), params)


def _scalar_positions(state, offset):
    # 0-d state leaves (counters, hyperparameters) may be passed through or aliased
    return {offset + i for i, x in enumerate(jax.tree.leaves(state)) if x.ndim == 0}


TRANSFORMS = {
    "sgd-momentum-wd": lambda: fo.sgd(lr=0.1, momentum=0.9, weight_decay=1e-2),
    "sgd-nesterov": lambda: fo.sgd(lr=0.1, momentum=0.9, nesterov=True, maximize=True),
    "sgd-plain": lambda: fo.sgd(lr=0.1),
    "sgd-fused": lambda: fo.sgd(lr=0.1, momentum=0.9, weight_decay=1e-2, fused=True),
    "adam-fused": lambda: fo.adam(lr=0.1, amsgrad=True, fused=True),
    "adamw-fused": lambda: fo.adamw(lr=0.1, fused=True),
    "accumulate-sgd": lambda: fo.grad_accumulate(fo.sgd(lr=0.1, momentum=0.9, weight_decay=1e-2), every=3),
    "accumulate-optax": lambda: fo.grad_accumulate(optax.sgd(0.1, momentum=0.9), every=2),
}
# every registered optimizer, over a spread of its configuration grid (LBFGS, driven by a
# loss function rather than gradients, has its own jitted step: tests/test_lbfgs.py)
SHAPES = {}
for _spec in OPTIMIZERS:
    if _spec.closure:
        continue
    for _config in _spec.grid[:: max(1, len(_spec.grid) // 4)]:
        _id = _spec.name + "-" + "-".join(f"{k}={v}" for k, v in sorted(_config.items()))
        TRANSFORMS[_id] = lambda spec=_spec, config=_config: spec.factory(**config)
        if _spec.shapes:  # Muon: 2-D parameters only
            SHAPES[_id] = {"layer": {"w": (20, 50)}, "b": (30, 20)}

# Algorithms whose compiled step still holds parameter-sized temporaries on XLA CPU, with
# the most it may hold (in units of the parameters' total size): donation is honoured
# (asserted), the bound is asserted, and the test xfails for them only on the "no
# temporaries" check. Each is known (issue 7):
# - adadelta: acc_delta and the parameter each need the other's old value (through the
#   delta) and XLA CPU has no multi-output loop fusion, so the old acc_delta is copied.
# - adafactor: its sums (of g*g, of the update squared) run as XLA CPU YNNPACK fusions.
#   XLA materializes the update they share with the parameter pass; recomputed in the
#   sum instead, YNNPACK takes the runtime eps1**2 as a materialized parameter-sized
#   broadcast (measured: as many temporaries, and more for 2-D parameters).
# - muon: the Newton-Schulz iteration needs matrix-sized temporaries by its nature
#   (torch's too): the bfloat16 iterate, its float32 copy for the norm, the products.
KNOWN_TEMPORARIES = {"adadelta": 1, "adafactor": 2, "muon": 3}


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_compiled_step_aliases_params_state_and_accumulator(name):
    tx = TRANSFORMS[name]()
    params = _params(SHAPES.get(name))
    state = tx.init(params)
    grads = _grads(params, 0)
    fn = jax.jit(lambda p, g, s: fo.step(tx, p, g, s), donate_argnums=(0, 2), keep_unused=True)
    compiled = fn.lower(params, grads, state).compile()
    assert unaliased_paths(compiled, (params, grads, state), (0, 2)) == []
    # params and state leaves are parameters 0..1 and 4.. (the two grads sit between)
    n_state = len(jax.tree.leaves(state))
    assert aliased_parameters(compiled) >= {0, 1} | {4 + i for i in range(n_state)} - _scalar_positions(
        state, 4
    )
    # peak memory: the inputs (params + grads + optimizer state + accumulator), nothing
    # more -- no parameter-sized temporaries or copies
    ma = compiled.memory_analysis()
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    extra = ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    smallest = min(x.nbytes for x in jax.tree.leaves(params))
    known = KNOWN_TEMPORARIES.get(name.split("-")[0])
    if extra >= smallest / 2 and known is not None:
        assert extra < known * param_bytes + smallest / 2, (name, extra / param_bytes)
        pytest.xfail(f"{name}: {extra} bytes of temporaries (known and bounded, see KNOWN_TEMPORARIES)")
    # below half the smallest parameter: scalars and small per-step values only (and
    # where the step calls a kernel, the table it reads)
    assert extra < smallest / 2 + kernel_table_bytes(compiled), (name, extra, ma.temp_size_in_bytes)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    assert ma.argument_size_in_bytes == 2 * param_bytes + state_bytes


def test_jit_step_matches_eager_steps_without_warning():
    tx = TRANSFORMS["accumulate-sgd"]()
    params = _params()
    eager_p, eager_s = params, tx.init(params)
    jit_p, jit_s = jax.tree.map(jnp.copy, params), tx.init(params)
    step = fo.jit_step(tx)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(6):
            eager_p, eager_s = fo.step(tx, eager_p, _grads(params, k), eager_s)
            jit_p, jit_s = step(jit_p, _grads(params, k), jit_s)
    assert int(jit_s.gradient_step) == 2
    for a, b in zip(jax.tree.leaves((jit_p, jit_s)), jax.tree.leaves((eager_p, eager_s)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0)
    assert float(jnp.max(jnp.abs(jit_p["b"] - params["b"]))) > 1e-3
    assert step.jitted._cache_size() == 1


def test_jit_step_warns_when_donation_cannot_be_honoured():
    # a state leaf whose dtype the step changes cannot be written in place
    def init(params):
        return {"scale": jnp.zeros(8, jnp.bfloat16), "count": jnp.zeros(8, jnp.float32)}

    def update(grads, state, params=None):
        return grads, {"scale": state["scale"].astype(jnp.float32) + 1, "count": state["count"] + 1}

    tx = optax.GradientTransformation(init, update)
    params = {"w": jnp.ones(8)}
    step = fo.jit_step(tx)
    with pytest.warns(UserWarning, match=r"not updated in place .*: state\['scale'\]$") as record:
        new_params, new_state = step(params, {"w": jnp.full(8, 0.5)}, tx.init(params))
    assert len(record) == 1
    np.testing.assert_array_equal(new_params["w"], np.full(8, 1.5))
    np.testing.assert_array_equal(new_state["scale"], np.ones(8))


def test_aliased_parameters_reads_the_compiled_alias_table():
    fn = jax.jit(lambda a, b, c: (a + b, c * 2, b), donate_argnums=(0, 2))
    x = jnp.ones(16)
    compiled = fn.lower(x, x, x).compile()
    assert aliased_parameters(compiled) == {0, 2}
    assert unaliased_paths(compiled, (x, x, x), (0, 2)) == []
    plain = jax.jit(lambda a, b: a + b).lower(x, x).compile()
    assert aliased_parameters(plain) == set()
    assert unaliased_paths(plain, ({"k": x}, x), (0,)) == ["arg0['k']"]
