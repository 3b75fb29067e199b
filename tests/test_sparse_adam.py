"""fo.sparse_adam against torch.optim.SparseAdam fed ``grad.to_sparse()``, and a NumPy reference."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import functorch_optim as fo
from functorch_optim._registry import get_spec
from tests.helpers import make_tree, rel_err, to_jax
from tests.stepping import STEP, run_fo, shared_tx

SHAPES = {"emb": (6, 3), "v": (5,), "s": ()}
BUFFERS = ("exp_avg", "exp_avg_sq")
GRID = get_spec("sparse_adam").grid
STEPS = 50
STATIC = ("maximize",)


def _cfg_id(cfg):
    return "-".join(f"{k}={v}" for k, v in cfg.items()).replace(" ", "")


def _sparse_stream(params, steps, seed, dtype):
    """Gradients with about half their entries exactly zero; every 7th step a leaf is all zero."""
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree.flatten(params)
    out = []
    for t in range(steps):
        gs = []
        for i, p in enumerate(leaves):
            g = rng.standard_normal(np.shape(p)) * (rng.random(np.shape(p)) < 0.5)
            if (t + i) % 7 == 0:
                g = np.zeros(np.shape(p))
            gs.append(g.astype(dtype))
        out.append(treedef.unflatten(gs))
    return out


@functools.cache
def _problem(dtype):
    params = make_tree(SHAPES, np.random.default_rng(0), dtype)
    return params, _sparse_stream(params, STEPS, seed=1, dtype=dtype)


def _run_torch(cfg, params, grads):
    leaves, treedef = jax.tree.flatten(params)
    tensors = [torch.tensor(np.asarray(p)).requires_grad_(True) for p in leaves]
    opt = torch.optim.SparseAdam(tensors, **cfg)
    for g in grads:
        for t, gl in zip(tensors, treedef.flatten_up_to(g), strict=True):
            t.grad = torch.tensor(np.asarray(gl)).to_sparse()
        opt.step()
    final = treedef.unflatten([t.detach().numpy().copy() for t in tensors])
    bufs = {n: treedef.unflatten([opt.state[t][n].numpy().copy() for t in tensors]) for n in BUFFERS}
    steps = treedef.unflatten([opt.state[t]["step"] for t in tensors])
    return final, bufs, steps


# float32 on the configurations of one compiled flag combination (maximize=False)
CASES = [(c, np.float64, 1e-10) for c in GRID] + [(c, np.float32, 1e-5) for c in GRID if not c["maximize"]]


@pytest.mark.parametrize(
    "cfg,dtype,tol", CASES, ids=[f"{_cfg_id(c)}-{np.dtype(d).name}" for c, d, _ in CASES]
)
def test_parity_with_torch_sparse_gradients(cfg, dtype, tol):
    params, grads = _problem(dtype)
    t_params, t_bufs, t_steps = _run_torch(cfg, params, grads)
    p, state = run_fo(fo.sparse_adam, cfg, STATIC, params, grads)
    assert rel_err(p, t_params) <= tol
    for name in BUFFERS:
        assert rel_err(state.buffers[name], t_bufs[name]) <= tol, name
        assert all(b.dtype == dtype for b in jax.tree.leaves(state.buffers[name]))
    # torch counts a step for an all-zero (empty) sparse gradient too
    assert jax.tree.map(int, state.step) == t_steps == jax.tree.map(lambda _: STEPS, t_steps)


def test_untouched_entries_stay_bit_for_bit():
    params, grads = _problem(np.float64)
    p, state = run_fo(fo.sparse_adam, {"lr": 0.1}, STATIC, params, grads[1:2])
    touched = grads[1]["emb"] != 0
    assert touched.any() and (~touched).any()
    np.testing.assert_array_equal(np.asarray(p["emb"])[~touched], params["emb"][~touched])
    np.testing.assert_array_equal(np.asarray(state.exp_avg["emb"])[~touched], 0.0)
    assert np.all(np.asarray(p["emb"])[touched] != params["emb"][touched])


def _numpy_sparse_adam(params, grads, lr, betas, eps, maximize):
    """Adam on the nonzero entries, written from the math, in NumPy float64."""
    b1, b2 = betas
    out = {}
    for k, p0 in params.items():
        p, m, v = np.array(p0, np.float64), np.zeros(np.shape(p0)), np.zeros(np.shape(p0))
        for t, gs in enumerate(grads, start=1):
            g = -gs[k] if maximize else gs[k]
            on = g != 0
            m = np.where(on, b1 * m + (1 - b1) * g, m)
            v = np.where(on, b2 * v + (1 - b2) * g * g, v)
            step_size = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
            p = np.where(on, p - step_size * m / (np.sqrt(v) + eps), p)
        out[k] = p
    return out


@pytest.mark.parametrize("cfg", GRID[::3], ids=[_cfg_id(c) for c in GRID[::3]])
def test_numpy_reference(cfg):
    params, grads = _problem(np.float64)
    expected = _numpy_sparse_adam(
        params, grads, **{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "maximize": False, **cfg}
    )
    p, _ = run_fo(fo.sparse_adam, cfg, STATIC, params, grads)
    assert rel_err(p, expected) <= 1e-10


ERRORS = [
    ({"lr": 0.0}, "Invalid learning rate: 0.0"),
    ({"lr": -1.0}, "Invalid learning rate: -1.0"),
    ({"eps": 0.0}, "Invalid epsilon value: 0.0"),
    ({"betas": (1.0, 0.999)}, "Invalid beta parameter at index 0: 1.0"),
    ({"betas": (-0.1, 0.999)}, "Invalid beta parameter at index 0: -0.1"),
    ({"betas": (0.9, 1.0)}, "Invalid beta parameter at index 1: 1.0"),
]


@pytest.mark.parametrize("kwargs,message", ERRORS, ids=[m for _, m in ERRORS])
def test_validation_matches_torch(kwargs, message):
    with pytest.raises(ValueError) as theirs:
        torch.optim.SparseAdam([torch.zeros(2, requires_grad=True)], **kwargs)
    assert str(theirs.value) == message
    with pytest.raises(ValueError) as mine:
        fo.sparse_adam(**kwargs)
    assert str(mine.value) == message
    state = fo.sparse_adam().init({"w": jnp.zeros(2)})
    with pytest.raises(ValueError) as again:
        fo.set_hparams(state, **kwargs)
    assert str(again.value) == message


def test_lr_change_does_not_recompile():
    params, grads = _problem(np.float64)
    params, grad = to_jax(params), to_jax(grads[1])
    tx = shared_tx(fo.sparse_adam, {"maximize": False})
    state = tx.init(params)
    p1, _ = STEP(tx, params, grad, state)
    compiled = STEP._cache_size()
    p2, _ = STEP(tx, params, grad, fo.set_hparams(state, lr=0.01))
    assert STEP._cache_size() == compiled
    # step 1: the update is lr * sign(g) * |g| / (|g| + eps): ten times larger with lr ten times
    d1 = jax.tree.map(lambda a, b: a - b, p1, params)
    d2 = jax.tree.map(lambda a, b: a - b, p2, params)
    assert rel_err(jax.tree.map(lambda x: 10 * x, d1), d2) <= 1e-10


# torch's tensor lr (``lr=torch.tensor(0.01)``, float32 unless given a dtype) keeps the
# step size ``lr * sqrt(bias_correction2) / bias_correction1`` a tensor of its dtype: a
# float32 one rounds it to float32 even for float64 parameters (4e-10)
TENSOR_LR_CASES = [
    (dtype, lr_dtype) for dtype in (np.float64, np.float32) for lr_dtype in (torch.float32, torch.float64)
]


@pytest.mark.parametrize(
    "dtype,lr_dtype",
    TENSOR_LR_CASES,
    ids=[f"{np.dtype(d).name}-lr-{str(t).split('.')[1]}" for d, t in TENSOR_LR_CASES],
)
def test_tensor_lr_like_torch(dtype, lr_dtype):
    params, grads = _problem(dtype)
    grads = grads[:12]
    t_lr = torch.tensor(0.01, dtype=lr_dtype)
    t_params, t_bufs, _ = _run_torch({"lr": t_lr}, params, grads)
    tx = fo.sparse_adam(lr=jnp.asarray(t_lr.numpy()))
    p = to_jax(params)
    state = tx.init(p)
    for g in grads:
        p, state = STEP(tx, p, to_jax(g), state)
    assert rel_err(p, t_params) == 0
    for name in BUFFERS:
        assert rel_err(state.buffers[name], t_bufs[name]) == 0, name
    assert all(x.dtype == dtype for x in jax.tree.leaves(p))
