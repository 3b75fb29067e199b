"""The engine: step, apply_updates, the optax contract, TorchState."""

from __future__ import annotations

import functools
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functorch_optim as fo
from tests.helpers import rel_err


def _setup(seed=0):
    rng = np.random.default_rng(seed)
    params = {"a": jnp.asarray(rng.standard_normal((3, 2))), "b": [jnp.asarray(rng.standard_normal(4))]}
    grads = [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape)), params) for _ in range(10)]
    return params, grads


def test_update_then_optax_apply_equals_step():
    params, grads = _setup()
    tx = fo.sgd(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    p1, s1 = params, tx.init(params)
    p2, s2 = params, tx.init(params)
    for g in grads:
        p1, s1 = fo.step(tx, p1, g, s1)
        u, s2 = tx.update(g, s2, p2)
        p2 = optax.apply_updates(p2, u)
    # new - p is exact for small steps (Sterbenz), so p + (new - p) == new here
    assert rel_err(p2, p1) <= 1e-15
    assert rel_err(s2.momentum_buffer, s1.momentum_buffer) == 0.0


def test_inside_optax_chain():
    params, grads = _setup(1)
    chained = optax.chain(optax.identity(), fo.sgd(lr=0.1, momentum=0.9))
    plain = fo.sgd(lr=0.1, momentum=0.9)
    p1, s1 = params, chained.init(params)
    p2, s2 = params, plain.init(params)
    for g in grads:
        p1, s1 = fo.step(chained, p1, g, s1)
        p2, s2 = fo.step(plain, p2, g, s2)
    assert rel_err(p1, p2) <= 1e-15


def test_step_accepts_any_optax_transformation():
    params, grads = _setup(2)
    tx = optax.adam(1e-2)
    p1, s1 = params, tx.init(params)
    p2, s2 = params, tx.init(params)
    for g in grads:
        p1, s1 = jax.jit(functools.partial(fo.step, tx))(p1, g, s1)
        u, s2 = tx.update(g, s2, p2)
        p2 = optax.apply_updates(p2, u)
    # jit may fuse differently from eager optax: equal to rounding
    assert rel_err(p1, p2) <= 1e-15
    assert rel_err(p1, params) > 1e-3


def test_apply_updates_keeps_parameters_with_none_update():
    params = {"a": jnp.array([-0.0, 1.0]), "b": jnp.array([1.0], jnp.float32)}
    out = fo.apply_updates(params, {"a": None, "b": jnp.array([0.5], jnp.float32)})
    assert out["a"].tobytes() == params["a"].tobytes()
    assert out["b"].dtype == jnp.float32 and float(out["b"][0]) == 1.5


def test_update_requires_params():
    tx = fo.sgd(lr=0.1)
    state = tx.init({"w": jnp.zeros(2)})
    with pytest.raises(ValueError, match=r"SGD: update\(\) needs params"):
        tx.update({"w": jnp.zeros(2)}, state)


def test_state_buffers_by_torch_name_and_pickle_round_trip():
    params, grads = _setup(3)
    tx = fo.sgd(lr=0.1, momentum=0.9)
    state = tx.init(params)
    params, state = fo.step(tx, params, grads[0], state)
    assert state.momentum_buffer is state.buffers["momentum_buffer"]
    with pytest.raises(AttributeError, match="has no buffer 'exp_avg'; it has"):
        _ = state.exp_avg
    restored = pickle.loads(pickle.dumps(state))
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    # the restored state drives the same next step
    p1, _ = fo.step(tx, params, grads[1], state)
    p2, _ = fo.step(tx, params, grads[1], restored)
    assert rel_err(p1, p2) == 0.0


def test_donated_step_runs_and_state_keeps_shapes():
    params, grads = _setup(4)
    tx = fo.sgd(lr=0.1, momentum=0.9)
    step = jax.jit(functools.partial(fo.step, tx), donate_argnums=(0, 2))
    state = tx.init(params)
    shapes = jax.tree.map(jnp.shape, (params, state))
    for g in grads:
        params, state = step(params, g, state)
    assert jax.tree.map(jnp.shape, (params, state)) == shapes
    assert step._cache_size() == 1
