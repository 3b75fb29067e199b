"""functorch_optim.nn.utils (clip a facade's gradients in place) against torch.nn.utils."""

from __future__ import annotations

import math
import re

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from functorch_optim.nn.utils import clip_grad_norm_, clip_grad_value_
from functorch_optim.optim import SGD, AdamW

SHAPES = [(3, 2), (4,), (2, 2, 2)]


def _pair(dtype, seed=0, scale=3.0):
    """A facade and torch parameters holding the same gradients (the middle one: None)."""
    rng = np.random.default_rng(seed)
    grads = [scale * rng.standard_normal(s).astype(dtype) for s in SHAPES]
    opt = SGD([jnp.zeros(s, dtype) for s in SHAPES], lr=0.1)
    opt.grad = [jnp.asarray(grads[0]), None, jnp.asarray(grads[2])]
    ts = [torch.zeros(s, dtype=torch.from_numpy(grads[0]).dtype, requires_grad=True) for s in SHAPES]
    ts[0].grad, ts[2].grad = torch.tensor(grads[0]), torch.tensor(grads[2])
    return opt, ts


def _same_grads(opt, ts, ulps=0):
    for ours, t in zip(opt.grad, ts, strict=True):
        if t.grad is None:
            assert ours is None
        else:
            ref = t.grad.numpy()
            assert ours.dtype == ref.dtype
            if ulps == 0:
                np.testing.assert_array_equal(np.asarray(ours), ref)
            else:
                np.testing.assert_array_max_ulp(np.asarray(ours), ref, maxulp=ulps)


# The norm is a sum whose order torch (vectorized per CPU: lanes, then FMA tails) and XLA
# choose differently: equal to the last bit often, else within an ulp or two. The max norm
# and everything after the norm (torch's coefficient, the scaling) are bit for bit.
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3], ids=lambda p: f"p={p}")
@pytest.mark.parametrize("max_norm", [1.0, 1e4], ids=["clips", "no-clip"])
def test_clip_grad_norm_in_place_matches_torch(dtype, norm_type, max_norm):
    opt, ts = _pair(dtype)
    before = [None if g is None else np.asarray(g) for g in opt.grad]
    ref = torch.nn.utils.clip_grad_norm_(ts, max_norm, norm_type)
    total = clip_grad_norm_(opt, max_norm, norm_type)
    assert total.dtype == dtype and total.shape == ()
    exact = norm_type == math.inf
    np.testing.assert_array_max_ulp(np.asarray(total), ref.numpy(), maxulp=0 if exact else 2)
    _same_grads(opt, ts, ulps=0 if exact or max_norm == 1e4 else 2)
    # torch's coefficient on our norm, bit for bit: (1 / (N + 1e-6)) * max_norm, clamped to 1
    coef = np.minimum((dtype(1.0) / (np.asarray(total) + dtype(1e-6))) * dtype(max_norm), dtype(1.0))
    for g, new in zip(before, opt.grad, strict=True):
        if g is not None:
            np.testing.assert_array_equal(np.asarray(new), g * coef)


def test_clip_grad_norm_matches_torch_bit_for_bit_where_the_sums_agree():
    """Four leaves of four entries (float64): there torch sums in XLA's order, the sequential one."""
    rng = np.random.default_rng(7)
    for _ in range(20):
        grads = [5 * rng.standard_normal((2, 2)) for _ in range(4)]
        opt = SGD([jnp.zeros((2, 2)) for _ in grads], lr=0.1)
        opt.grad = [jnp.asarray(g) for g in grads]
        ts = [torch.zeros((2, 2), dtype=torch.float64, requires_grad=True) for _ in grads]
        for tt, g in zip(ts, grads, strict=True):
            tt.grad = torch.tensor(g)
        assert float(clip_grad_norm_(opt, 1.0)) == float(torch.nn.utils.clip_grad_norm_(ts, 1.0))
        _same_grads(opt, ts)


def test_clip_grad_norm_then_step_trains_like_torch():
    opt = AdamW([{"params": jnp.ones((2, 3))}, {"params": jnp.ones(3), "weight_decay": 0.0}], lr=0.1)
    tw, tb = (
        torch.ones((2, 3), dtype=torch.float64, requires_grad=True),
        torch.ones(3, dtype=torch.float64, requires_grad=True),
    )
    topt = torch.optim.AdamW([{"params": [tw]}, {"params": [tb], "weight_decay": 0.0}], lr=0.1, foreach=False)
    rng = np.random.default_rng(1)
    for _ in range(4):
        g = [5 * rng.standard_normal((2, 3)), 5 * rng.standard_normal(3)]
        opt.zero_grad()
        opt.grad = [jnp.asarray(x) for x in g]
        tw.grad, tb.grad = (torch.tensor(x) for x in g)
        ref = torch.nn.utils.clip_grad_norm_([tw, tb], 1.0)
        np.testing.assert_array_max_ulp(np.asarray(clip_grad_norm_(opt, 1.0)), ref.numpy(), maxulp=2)
        opt.step()
        topt.step()
    np.testing.assert_allclose(np.asarray(opt.params[0]), tw.detach().numpy(), rtol=1e-14)
    np.testing.assert_allclose(np.asarray(opt.params[1]), tb.detach().numpy(), rtol=1e-14)


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_error_if_nonfinite_uses_torchs_message_and_leaves_the_grads(bad):
    opt, ts = _pair(np.float64)
    opt.grad = [jnp.full((3, 2), bad), None, jnp.ones((2, 2, 2))]
    ts[0].grad = torch.full((3, 2), bad, dtype=torch.float64)
    ts[2].grad = torch.ones((2, 2, 2), dtype=torch.float64)
    with pytest.raises(RuntimeError) as ref:
        torch.nn.utils.clip_grad_norm_(ts, 1.0, error_if_nonfinite=True)
    with pytest.raises(RuntimeError, match=re.escape(str(ref.value))):
        clip_grad_norm_(opt, 1.0, error_if_nonfinite=True)
    _same_grads(opt, ts)  # untouched, like torch's
    assert math.isnan(float(clip_grad_norm_(opt, 1.0))) == math.isnan(
        float(torch.nn.utils.clip_grad_norm_(ts, 1.0))
    )
    _same_grads(opt, ts)  # without the flag: scaled by the non-finite norm, as torch


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
def test_clip_grad_value_in_place_like_torch(dtype):
    opt, ts = _pair(dtype)
    assert clip_grad_value_(opt, 0.7, foreach=None) is None
    torch.nn.utils.clip_grad_value_(ts, 0.7)
    _same_grads(opt, ts)
    assert np.max(np.abs(np.asarray(opt.grad[0]))) == dtype(0.7)


def test_no_gradient_and_a_non_optimizer():
    opt = SGD({"w": jnp.ones(2)}, lr=0.1)
    total = clip_grad_norm_(opt, 1.0)
    assert float(total) == float(torch.nn.utils.clip_grad_norm_([torch.ones(2, requires_grad=True)], 1.0))
    assert opt.grad == {"w": None}
    with pytest.raises(
        TypeError, match=r"clip_grad_norm_ clips the gradients of a functorch_optim\.optim optimizer"
    ):
        clip_grad_norm_([jnp.ones(2)], 1.0)
    with pytest.raises(TypeError, match="clip_grad_value_ clips"):
        clip_grad_value_({"w": jnp.ones(2)}, 1.0)


def test_clip_inside_lbfgs_torch_closure_like_torch():
    """torch's LBFGS uses whatever its closure leaves in p.grad: a clipped gradient too."""
    from functorch_optim.optim import LBFGS

    x0 = np.array([-1.2, 1.0, 0.5])

    def loss_fn(p):
        return jnp.sum(100 * (p[1:] - p[:-1] ** 2) ** 2 + (1 - p[:-1]) ** 2)

    opt = LBFGS(jnp.asarray(x0), lr=0.5, max_iter=6, history_size=3)
    t = torch.tensor(x0, requires_grad=True)
    topt = torch.optim.LBFGS([t], lr=0.5, max_iter=6, history_size=3)

    def closure():
        opt.zero_grad()
        loss = opt.backward(loss_fn)
        clip_grad_norm_(opt, 2.0)
        return loss

    def t_closure():
        topt.zero_grad()
        loss = torch.sum(100 * (t[1:] - t[:-1] ** 2) ** 2 + (1 - t[:-1]) ** 2)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([t], 2.0)
        return loss

    for _ in range(3):
        opt.step(closure)
        topt.step(t_closure)
    np.testing.assert_allclose(np.asarray(opt.params), t.detach().numpy(), rtol=1e-10)  # norms: ulps apart
    assert int(opt.state.func_evals) == topt.state[t]["func_evals"]
    assert np.max(np.abs(np.asarray(opt.params) - x0)) > 0.1
