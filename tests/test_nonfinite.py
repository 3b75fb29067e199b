"""skip_nonfinite: a NaN/Inf step changes nothing; with grad_accumulate it poisons only its window."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functorch_optim as fo
from functorch_optim import schedules as S
from tests.helpers import grad_stream, rel_err, to_jax

SHAPES = {"a": (3, 2), "b": (4,)}


def _params():
    rng = np.random.default_rng(0)
    return {k: rng.standard_normal(s) for k, s in SHAPES.items()}


def _poison(grads, steps, value):
    out = [jax.tree.map(np.array, g) for g in grads]
    for t in steps:
        out[t]["b"][1] = value
    return out


def _run(tx, params, grads):
    step = jax.jit(lambda p, g, s: fo.step(tx, p, g, s))
    state = tx.init(to_jax(params))
    params = to_jax(params)
    lrs = []
    for g in grads:
        params, state = step(params, to_jax(g), state)
        lrs.append(float(fo.get_hparams(state)["lr"]))
    return params, state, lrs


@pytest.mark.parametrize("bad", [np.nan, -np.inf], ids=["nan", "-inf"])
def test_bad_steps_change_nothing(bad):
    params = _params()
    grads = grad_stream(params, 12, seed=1)
    bad_steps = [0, 5, 6]
    sched = S.step_lr(0.1, step_size=2, gamma=0.5)
    tx = fo.skip_nonfinite(fo.sgd(lr=sched, momentum=0.9, dampening=0.2))
    got, state, lrs = _run(tx, params, _poison(grads, bad_steps, bad))
    # the same run without the bad steps at all
    clean = [g for t, g in enumerate(grads) if t not in bad_steps]
    ref, ref_state, ref_lrs = _run(
        fo.sgd(lr=S.step_lr(0.1, step_size=2, gamma=0.5), momentum=0.9, dampening=0.2), params, clean
    )
    assert rel_err(got, ref) == 0.0
    assert rel_err(state.inner_state.buffers, ref_state.buffers) == 0.0
    assert int(state.inner_state.count) == int(ref_state.count) == 9  # step counter
    assert int(state.inner_state.step["a"]) == 9
    assert lrs[-1] == ref_lrs[-1] and int(state.skipped) == 3  # schedule position
    assert bool(state.last_finite)  # the last step (11) was clean


def test_update_path_and_none_gradients():
    params = to_jax(_params())
    tx = fo.skip_nonfinite(fo.sgd(lr=0.5))
    state = tx.init(params)
    grads = {"a": jnp.full((3, 2), jnp.nan), "b": None}
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert updates["b"] is None and float(jnp.abs(updates["a"]).max()) == 0.0
    assert int(state.skipped) == 1 and int(state.inner_state.count) == 0
    updates, state = tx.update({"a": jnp.ones((3, 2)), "b": None}, state, params)
    assert updates["b"] is None and np.allclose(np.asarray(updates["a"]), -0.5)
    assert int(state.skipped) == 1 and bool(state.last_finite)
    # an optax optimizer inside: its state does not move on a skip either
    tx = fo.skip_nonfinite(optax.adam(1e-2))
    state = tx.init(params)
    _, state = tx.update({"a": jnp.ones((3, 2)), "b": jnp.full(4, jnp.inf)}, state, params)
    assert int(state.inner_state[0].count) == 0 and int(state.skipped) == 1


def test_with_grad_accumulate_a_bad_micro_batch_poisons_only_its_window():
    """grad_accumulate(skip_nonfinite(tx), k): window 1 holds a NaN micro-batch."""
    params = _params()
    k, windows = 3, 4
    grads = grad_stream(params, k * windows, seed=2)
    poisoned = _poison(grads, [k * 1 + 1], np.nan)  # second micro-batch of window 1
    sched = S.exponential_lr(0.2, gamma=0.9)
    tx = fo.grad_accumulate(fo.skip_nonfinite(fo.sgd(lr=sched, momentum=0.5)), every=k)
    got, state, _ = _run(tx, params, poisoned)
    # reference: the same optimizer stepped on the mean of windows 0, 2, 3 only
    means = [
        jax.tree.map(lambda *g: sum(g) / k, *grads[w * k : (w + 1) * k]) for w in range(windows) if w != 1
    ]
    ref, ref_state, _ = _run(fo.sgd(lr=S.exponential_lr(0.2, gamma=0.9), momentum=0.5), params, means)
    assert rel_err(got, ref) <= 1e-15
    inner = state.inner_state
    assert int(inner.skipped) == 1
    assert int(inner.inner_state.count) == 3  # the schedule moved 3 times, not 4
    assert float(fo.get_hparams(state)["lr"]) == float(fo.get_hparams(ref_state)["lr"])
    assert int(state.gradient_step) == windows  # grad_accumulate still counts the window
    # the next window starts clean: its first micro-step overwrites the accumulator
    g = grads[0]
    _, after = fo.step(tx, got, g, state)
    assert int(after.mini_step) == 1
    assert all(bool(jnp.all(a == b)) for a, b in zip(jax.tree.leaves(after.acc_grads), jax.tree.leaves(g)))
