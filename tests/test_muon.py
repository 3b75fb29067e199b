"""fo.muon against torch.optim.Muon (bit-exact bfloat16 Newton–Schulz), a NumPy reference, errors."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

import functorch_optim as fo
from functorch_optim._muon import zeropower_via_newtonschulz
from functorch_optim._registry import MUON_SHAPES, get_spec
from tests.helpers import grad_stream, make_tree, rel_err, run_torch, to_jax
from tests.stepping import STEP, run_fo, shared_tx

GRID = get_spec("muon").grid
STEPS = 50
STATIC = ("nesterov", "adjust_lr_fn")
COEFFS = (3.4445, -4.7750, 2.0315)


def _cfg_id(cfg):
    return "-".join(f"{k}={v}" for k, v in cfg.items()).replace(" ", "")


@functools.cache
def _problem(dtype):
    params = make_tree(MUON_SHAPES, np.random.default_rng(0), dtype)
    return params, grad_stream(params, STEPS, seed=1, dtype=dtype)


# float32 on the configurations of one of the four compiled flag combinations
CASES = [(i, np.float64, 1e-10) for i in range(len(GRID))] + [
    (i, np.float32, 1e-5) for i in range(len(GRID)) if GRID[i]["nesterov"] and GRID[i]["adjust_lr_fn"] is None
]


@pytest.mark.parametrize(
    "index,dtype,tol", CASES, ids=[f"{_cfg_id(GRID[i])}-{np.dtype(d).name}" for i, d, _ in CASES]
)
def test_parity_with_torch(index, dtype, tol):
    cfg = GRID[index]
    params, grads = _problem(dtype)
    t_params, t_bufs = run_torch(lambda ps: torch.optim.Muon(ps, **cfg), params, grads, ("momentum_buffer",))
    p, state = run_fo(fo.muon, cfg, STATIC, params, grads)
    assert rel_err(p, t_params) <= tol
    assert rel_err(state.momentum_buffer, t_bufs["momentum_buffer"]) <= tol
    assert all(b.dtype == dtype for b in jax.tree.leaves(state.momentum_buffer))


@pytest.mark.parametrize(
    "shape,ns_steps,eps",
    [((6, 4), 5, 1e-7), ((2, 7), 7, 1e-3)],
    ids=["tall", "wide-7-steps-eps"],
)
def test_newton_schulz_bit_exact(shape, ns_steps, eps):
    rng = np.random.default_rng(7)
    ns = jax.jit(zeropower_via_newtonschulz, static_argnums=2)
    for _ in range(3):
        g = rng.standard_normal(shape)
        theirs = _zeropower_via_newtonschulz(torch.tensor(g), COEFFS, ns_steps, eps).float().numpy()
        mine = np.asarray(ns(jnp.asarray(g), COEFFS, ns_steps, eps).astype(jnp.float32))
        np.testing.assert_array_equal(mine, theirs)


def _numpy_newton_schulz(g, steps, eps, coeffs=COEFFS):
    """The quintic iteration in NumPy: bfloat16 storage, float32 products (BLAS sgemm)."""
    bf, f32 = ml_dtypes.bfloat16, np.float32
    a, b, c = (f32(v) for v in coeffs)
    x = g.astype(f32).astype(bf)
    tall = g.shape[0] > g.shape[1]
    if tall:
        x = x.T
    norm = np.sqrt(np.sum(x.astype(f32) ** 2)).astype(bf)
    x = (x.astype(f32) / max(norm.astype(f32), f32(eps)).astype(bf).astype(f32)).astype(bf)
    for _ in range(steps):
        x32 = x.astype(f32)
        gram = (x32 @ x32.T).astype(bf).astype(f32)
        update = (b * gram + c * (gram @ gram)).astype(bf).astype(f32)
        x = (a * x32 + update @ x32).astype(bf)
    return (x.T if tall else x).astype(np.float64)


def _numpy_muon(params, grads, lr, weight_decay, momentum, nesterov, adjust_lr_fn):
    out = {}
    for k, p0 in params.items():
        p, buf = np.array(p0, np.float64), np.zeros(np.shape(p0))
        rows, cols = p.shape
        ratio = math.sqrt(max(1, rows / cols)) if adjust_lr_fn is None else 0.2 * math.sqrt(max(rows, cols))
        for gs in grads:
            g = gs[k]
            buf = momentum * buf + (1 - momentum) * g
            update = momentum * buf + (1 - momentum) * g if nesterov else buf
            p = p * (1 - lr * weight_decay) - lr * ratio * _numpy_newton_schulz(update, 5, 1e-7)
        out[k] = p
    return out


@pytest.mark.parametrize("cfg", GRID[::3], ids=[_cfg_id(c) for c in GRID[::3]])
def test_numpy_reference(cfg):
    params, grads = _problem(np.float64)
    grads = grads[:5]
    expected = _numpy_muon(params, grads, **cfg)
    p, _ = run_fo(fo.muon, cfg, STATIC, params, grads)
    # the lerp formulas round differently from mu*b + (1-mu)*g; bfloat16 absorbs that
    assert rel_err(p, expected) <= 1e-10


ERRORS = [
    ({"lr": -1.0}, "Learning rate should be >= 0 but is: -1.0"),
    ({"momentum": -0.1}, "momentum should be >= 0 but is: -0.1"),
    ({"weight_decay": -0.5}, "weight decay should be >= 0 but is: -0.5"),
    ({"adjust_lr_fn": "arbitrary"}, "Adjust learning rate function arbitrary is not supported"),
]
# torch raises these two from its first step; here at construction
STEP_ERRORS = [
    ({"ns_steps": 100}, "Number of steps must be less than 100 for computational efficiency"),
    ({"ns_coefficients": (1.0, 2.0)}, "Coefficients must be a tuple of exactly 3 values"),
]


@pytest.mark.parametrize("kwargs,message", ERRORS + STEP_ERRORS, ids=[m for _, m in ERRORS + STEP_ERRORS])
def test_validation_matches_torch(kwargs, message):
    with pytest.raises(ValueError) as theirs:
        w = torch.zeros(2, 2, requires_grad=True)
        opt = torch.optim.Muon([w], **kwargs)
        w.grad = torch.ones(2, 2)
        opt.step()
    assert str(theirs.value) == message
    with pytest.raises(ValueError) as mine:
        fo.muon(**kwargs)
    assert str(mine.value) == message


@pytest.mark.parametrize("shape", [(3,), (2, 2, 2), ()], ids=["vector", "3d", "scalar"])
def test_only_2d_parameters(shape):
    with pytest.raises(ValueError) as theirs:
        torch.optim.Muon([torch.zeros(shape, requires_grad=True)])
    with pytest.raises(ValueError) as mine:
        fo.muon().init({"w": jnp.zeros((2, 2)), "b": jnp.zeros(shape)})
    assert str(mine.value) == str(theirs.value)
    assert "Muon only supports 2D parameters" in str(mine.value)


def test_lr_change_does_not_recompile():
    params, grads = _problem(np.float64)
    params, grad = to_jax(params), to_jax(grads[0])
    tx = shared_tx(fo.muon, {"nesterov": True, "adjust_lr_fn": None})
    state = tx.init(params)
    p1, _ = STEP(tx, params, grad, state)
    compiled = STEP._cache_size()
    changed = {"lr": 0.05, "weight_decay": 0.0, "momentum": 0.5, "ns_coefficients": (1.5, -0.5, 0.0)}
    p2, _ = STEP(tx, params, grad, fo.set_hparams(state, **changed))
    assert STEP._cache_size() == compiled
    np_params, np_grad = jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, grad)
    for p, cfg in ((p1, {}), (p2, changed)):
        expected, _ = run_torch(lambda ps, cfg=cfg: torch.optim.Muon(ps, **cfg), np_params, [np_grad])
        assert rel_err(p, expected) <= 1e-12
    assert rel_err(p1, p2) > 1e-3


# torch's tensor lr (``lr=torch.tensor(0.02)``, float32 unless given a dtype) keeps the
# adjusted lr ``lr * ratio`` and the decay factor ``1 - lr * weight_decay`` as tensors of
# its dtype; a float32 one rounds them to float32 even for float64 parameters (3e-7)
TENSOR_LR_CASES = [
    (dtype, lr_dtype, adjust)
    for dtype in (np.float64, np.float32)
    for lr_dtype in (torch.float32, torch.float64)
    for adjust in (None, "match_rms_adamw")
]


@pytest.mark.parametrize(
    "dtype,lr_dtype,adjust_lr_fn",
    TENSOR_LR_CASES,
    ids=[f"{np.dtype(d).name}-lr-{str(t).split('.')[1]}-{a}" for d, t, a in TENSOR_LR_CASES],
)
def test_tensor_lr_like_torch(dtype, lr_dtype, adjust_lr_fn):
    params, grads = _problem(dtype)
    grads = grads[:8]
    cfg = {"weight_decay": 0.1, "adjust_lr_fn": adjust_lr_fn}
    t_lr = torch.tensor(0.02, dtype=lr_dtype)
    t_params, t_bufs = run_torch(
        lambda ps: torch.optim.Muon(ps, lr=t_lr, **cfg), params, grads, ("momentum_buffer",)
    )
    tx = fo.muon(lr=jnp.asarray(t_lr.numpy()), **cfg)
    p = to_jax(params)
    state = tx.init(p)
    for g in grads:
        p, state = STEP(tx, p, to_jax(g), state)
    assert rel_err(p, t_params) == 0
    assert rel_err(state.momentum_buffer, t_bufs["momentum_buffer"]) == 0
    assert all(x.dtype == dtype for x in jax.tree.leaves(p))
