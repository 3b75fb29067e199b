"""get_hparams / set_hparams: values as data, torch validation, no recompilation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functorch_optim as fo


def test_changing_hparams_never_recompiles():
    params = {"w": jnp.ones(4), "b": jnp.ones(2)}
    tx = fo.sgd(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)
    step = jax.jit(functools.partial(fo.step, tx), donate_argnums=(0, 2))
    state = tx.init(params)
    grads = {"w": jnp.ones(4), "b": jnp.ones(2)}
    seen = []
    for i, (lr, mom, damp, wd) in enumerate(
        [(0.1, 0.9, 0.1, 0.01), (0.05, 0.5, 0.0, 0.0), (1.0, 0.99, 0.3, 0.2)]
    ):
        state = fo.set_hparams(state, lr=lr, momentum=mom, dampening=damp, weight_decay=wd)
        w_before = float(params["w"][0])
        params, state = step(params, grads, state)
        seen.append(w_before - float(params["w"][0]))
        assert step._cache_size() == 1, f"recompiled after change {i}"
    # the changed values took effect: the third step is much larger than the first
    assert seen[2] > 5 * seen[0]


def test_set_value_takes_effect_next_step_exactly():
    params = {"w": jnp.array([1.0])}
    tx = fo.sgd(lr=0.1)
    state = fo.set_hparams(tx.init(params), lr=0.25)
    params, _ = fo.step(tx, params, {"w": jnp.array([2.0])}, state)
    np.testing.assert_array_equal(params["w"], [0.5])


def test_get_hparams_reads_through_wrappers():
    params = {"w": jnp.zeros(2)}
    for tx in [fo.grad_accumulate(fo.sgd(lr=0.3), 2), optax.chain(optax.clip(1.0), fo.sgd(lr=0.3))]:
        state = tx.init(params)
        assert float(fo.get_hparams(state)["lr"]) == 0.3
        state = fo.set_hparams(state, lr=0.2)
        assert float(fo.get_hparams(state)["lr"]) == 0.2


def test_optax_inject_hyperparams_supported():
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    state = fo.set_hparams(tx.init({"w": jnp.zeros(2)}), learning_rate=0.5)
    assert float(fo.get_hparams(state)["learning_rate"]) == 0.5


def test_dtype_and_weak_type_preserved():
    state = fo.sgd(lr=0.1, momentum=0.9).init({"w": jnp.zeros(2, jnp.float32)})
    new = fo.set_hparams(state, lr=1)
    old_lr, new_lr = fo.get_hparams(state)["lr"], fo.get_hparams(new)["lr"]
    assert new_lr.dtype == old_lr.dtype == jnp.float64  # x64 is on in tests
    assert not new_lr.weak_type and not old_lr.weak_type


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"learning_rate": 0.1},
            "unknown hyperparameter(s) 'learning_rate'; known: dampening, lr, momentum, weight_decay",
        ),
        ({"lr": -2}, "Invalid learning rate: -2"),
    ],
)
def test_set_hparams_errors(kwargs, message):
    state = fo.sgd(lr=0.1, momentum=0.9).init({"w": jnp.zeros(2)})
    with pytest.raises(ValueError) as err:
        fo.set_hparams(state, **kwargs)
    assert message in str(err.value)


def test_schedule_driven_value_cannot_be_set():
    state = fo.sgd(lr=lambda c: 0.1 * 0.5**c).init({"w": jnp.zeros(2)})
    with pytest.raises(ValueError, match="lr is driven by a schedule"):
        fo.set_hparams(state, lr=0.2)


def test_several_optimizers_is_an_error_naming_paths():
    tx = optax.chain(fo.sgd(lr=0.1), fo.sgd(lr=0.2))
    state = tx.init({"w": jnp.zeros(2)})
    with pytest.raises(
        ValueError, match=r"hyperparameters of 2 optimizers \(at \[0\]\.hparams, \[1\]\.hparams\)"
    ):
        fo.get_hparams(state)
    assert float(fo.get_hparams(state[1])["lr"]) == 0.2


def test_no_hparams_is_an_error():
    with pytest.raises(ValueError, match="holds no hyperparameters"):
        fo.get_hparams(optax.sgd(0.1).init({"w": jnp.zeros(2)}))


def test_hparams_differentiable_under_grad():
    """jax.grad through a step with respect to lr (meta-learning); set_hparams takes tracers."""
    tx = fo.sgd(lr=0.1, momentum=0.9)
    params = {"w": jnp.array([1.0, -2.0])}
    g = {"w": jnp.array([0.5, 0.25])}

    def after_two_steps(lr):
        state = fo.set_hparams(tx.init(params), lr=lr)
        p, state = fo.step(tx, params, g, state)
        p, state = fo.step(tx, p, g, state)
        return jnp.sum(p["w"])

    # p2 = p0 - lr*g - lr*(0.9*g + g) => d/dlr sum = -(1 + 1.9) * sum(g)
    np.testing.assert_allclose(jax.grad(after_two_steps)(0.1), -2.9 * 0.75, rtol=1e-14)
