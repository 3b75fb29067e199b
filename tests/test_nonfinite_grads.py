"""NaN and Inf gradient elements: every optimizer does what torch does with them.

One NaN, one +Inf and one -Inf element are injected into a random gradient stream (at
different steps and parameters, matrix and vector); after every step the parameters and
every state buffer must equal torch's: NaN where torch has NaN, the same infinities, the
finite values to float64 rounding. ``docs/guide/parity.md`` tabulates the outcomes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import functorch_optim as fo
from functorch_optim._registry import OPTIMIZERS
from functorch_optim.testing import _FoRunner, _TorchRunner

SPECS = [s for s in OPTIMIZERS if not s.closure]
STEPS = 5
# (step, leaf, flat element, value): the matrix first, then the vector
INJECTED = ((1, 0, 1, np.nan), (2, -1, 0, np.inf), (3, 0, 2, -np.inf))


def _stream(spec, injected=INJECTED):
    rng = np.random.default_rng(0)
    shapes = spec.shapes or {"m": (4, 3), "v": (3,)}
    params = jax.tree.map(lambda s: rng.standard_normal(s), shapes, is_leaf=lambda x: isinstance(x, tuple))
    grads = [jax.tree.map(lambda p: rng.standard_normal(p.shape), params) for _ in range(STEPS)]
    for step, leaf, element, value in injected:
        grads[step][sorted(grads[step])[leaf]].flat[element] = value
    return params, grads


def _assert_same(ours, ref, what):
    ours, ref = np.asarray(ours), np.asarray(ref)
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(ref), err_msg=f"{what}: NaN positions")
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(ref), err_msg=f"{what}: Inf positions")
    np.testing.assert_allclose(ours, ref, rtol=1e-10, atol=1e-300, err_msg=what)


@pytest.mark.parametrize("which", [0, -1], ids=["first-config", "last-config"])
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_nan_and_inf_gradient_elements_like_torch(spec, which):
    config = dict(spec.grid[which])
    params, grads = _stream(spec)
    ours, theirs = _FoRunner(spec, config, params), _TorchRunner(spec, config, params)
    treedef = theirs.treedef
    for t, g in enumerate(grads):
        ours.step(g)
        theirs.step(treedef.flatten_up_to(g))
        for i, (a, b) in enumerate(zip(treedef.flatten_up_to(ours.params), theirs.params(), strict=True)):
            _assert_same(a, b, f"step {t + 1}, param {i}")
        for name in spec.buffers:
            if name not in ours.buffers():
                continue
            for i, a in enumerate(treedef.flatten_up_to(ours.buffers()[name])):
                b = theirs.buffer(name, i)
                if a is not None and b is not None and np.ndim(b) == np.ndim(a):
                    _assert_same(a, b, f"step {t + 1}, {name} of param {i}")


def test_rprop_nan_element_skips_that_element_like_torch():
    # torch.sign(nan) is 0 on the CPU: the element does not move, its step size is kept,
    # and the next gradient sees prev = NaN, a product whose sign is 0 again
    tx = fo.rprop(lr=0.1)
    params = {"w": jnp.array([1.0, 2.0, 3.0])}
    state = tx.init(params)
    params, state = fo.step(tx, params, {"w": jnp.array([np.nan, 1.0, 1.0])}, state)
    params, state = fo.step(tx, params, {"w": jnp.array([1.0, 1.0, 1.0])}, state)
    np.testing.assert_allclose(params["w"], [0.9, 1.78, 2.78], rtol=1e-15)
    np.testing.assert_allclose(state.step_size["w"], [0.1, 0.12, 0.12], rtol=1e-15)


def test_adafactor_nan_element_of_a_vector_stays_in_that_element_like_torch():
    # torch computes the update's scale with Python's max(1.0, norm): a NaN norm gives 1
    p = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adafactor([p], lr=0.1)
    tx = fo.adafactor(lr=0.1)
    params = {"w": jnp.array([1.0, 2.0, 3.0])}
    state = tx.init(params)
    for g in ([np.nan, 1.0, -1.0], [0.5, 1.0, -1.0]):
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        params, state = fo.step(tx, params, {"w": jnp.array(g)}, state)
        _assert_same(params["w"], p.detach().numpy(), "param")
    assert np.isnan(params["w"][0]) and np.isfinite(params["w"][1:]).all()


def test_lbfgs_nan_gradient_element_like_torch():
    # torch scales the first step by Python's min(1.0, 1 / |g|_1): a NaN norm gives lr
    target = np.array([1.0, np.nan, -1.0])
    x0 = np.array([0.5, 0.5, 0.5])
    w = torch.tensor(x0, requires_grad=True)
    opt = torch.optim.LBFGS([w], lr=1.0, max_iter=3)

    def closure():
        opt.zero_grad()
        loss = ((w - torch.tensor(target)) ** 2).sum()
        loss.backward()
        return loss

    tx = fo.lbfgs(lr=1.0, max_iter=3)
    params = {"w": jnp.asarray(x0)}
    state = tx.init(params)
    value_fn = lambda p: jnp.sum((p["w"] - jnp.asarray(target)) ** 2)
    for _ in range(2):
        opt.step(closure)
        params, state, _ = fo.lbfgs_step(tx, value_fn, params, state)
        _assert_same(params["w"], w.detach().numpy(), "param")
