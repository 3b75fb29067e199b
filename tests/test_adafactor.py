"""fo.adafactor against torch.optim.Adafactor, a NumPy reference, and torch's validation."""

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
from tests.helpers import grad_stream, make_tree, rel_err, run_torch, to_jax
from tests.stepping import STEP, run_fo, shared_tx

SHAPES = {"w": (3, 4), "t": (2, 3, 4), "b": (5,), "s": ()}
BUFFERS = ("row_var", "col_var", "variance")
GRID = get_spec("adafactor").grid
STEPS = 50
STATIC = ("maximize",)


def _cfg_id(cfg):
    return "-".join(f"{k}={v}" for k, v in cfg.items()).replace(" ", "")


def _run_fo(cfg, params, grads):
    return run_fo(fo.adafactor, cfg, STATIC, params, grads)


@functools.cache
def _problem(dtype):
    rng = np.random.default_rng(0)
    params = make_tree(SHAPES, rng, dtype)
    return params, grad_stream(params, STEPS, seed=1, dtype=dtype)


# float32 on the configurations of one compiled flag combination (maximize=False)
CASES = [(c, np.float64, 1e-10) for c in GRID] + [(c, np.float32, 1e-5) for c in GRID if not c["maximize"]]


@pytest.mark.parametrize(
    "cfg,dtype,tol", CASES, ids=[f"{_cfg_id(c)}-{np.dtype(d).name}" for c, d, _ in CASES]
)
def test_parity_with_torch(cfg, dtype, tol):
    params, grads = _problem(dtype)
    t_params, t_bufs = run_torch(
        lambda ps: torch.optim.Adafactor(ps, foreach=False, **cfg), params, grads, BUFFERS
    )
    p, state = _run_fo(cfg, params, grads)
    assert rel_err(p, t_params) <= tol
    for name in BUFFERS:
        mine = jax.tree.leaves(state.buffers[name])
        theirs = jax.tree.leaves(t_bufs[name])
        assert len(mine) == len(theirs) > 0
        assert rel_err(mine, theirs) <= tol, name
        assert all(m.dtype == dtype for m in mine)
    assert int(state.step["w"]) == STEPS


def test_none_gradients_skip_like_torch():
    rng = np.random.default_rng(3)
    params = make_tree(SHAPES, rng)
    grads = grad_stream(params, 12, seed=4, none_every=2)
    cfg = {"lr": 0.1, "weight_decay": 0.05}
    t_params, t_bufs = run_torch(
        lambda ps: torch.optim.Adafactor(ps, foreach=False, **cfg), params, grads, BUFFERS
    )
    p, state = _run_fo(cfg, params, grads)
    assert rel_err(p, t_params) <= 1e-10
    assert rel_err(jax.tree.leaves(state.row_var), jax.tree.leaves(t_bufs["row_var"])) <= 1e-10
    # torch's per-parameter step counts the gradients each parameter received
    received = sum(gs["w"] is not None for gs in grads)
    assert 0 < int(state.step["w"]) == received < len(grads)


def _numpy_adafactor(params, grads, lr, beta2_decay, eps, d, weight_decay, maximize):
    """Adafactor's update rule written from the math, in NumPy float64."""
    params = {k: np.array(v, np.float64) for k, v in params.items()}
    state = {k: {} for k in params}
    for t, gs in enumerate(grads, start=1):
        for k, p in params.items():
            g = -gs[k] if maximize else gs[k]
            st = state[k]
            eps1 = np.finfo(np.float64).eps if eps[0] is None else eps[0]
            w = t**beta2_decay
            rho = min(lr, 1 / math.sqrt(t))
            alpha = max(eps[1], math.sqrt(np.mean(p**2))) * rho
            p = p * (1 - lr * weight_decay)
            if p.ndim > 1:
                st["row"] = (1 - w) * st.get("row", 0.0) + w * np.mean(g * g, axis=-1, keepdims=True)
                st["col"] = (1 - w) * st.get("col", 0.0) + w * np.mean(g * g, axis=-2, keepdims=True)
                v = st["row"] * st["col"] / np.maximum(np.mean(st["row"], axis=-2, keepdims=True), eps1)
            else:
                st["var"] = (1 - w) * st.get("var", 0.0) + w * g * g
                v = st["var"]
            u = g / np.sqrt(np.maximum(v, eps1 * eps1))
            params[k] = p - alpha / max(1.0, math.sqrt(np.mean(u**2)) / d) * u
    return params


@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"lr": 0.1, "weight_decay": 0.05, "d": 1.5, "maximize": True},
        {"beta2_decay": -0.5, "eps": (1e-4, 1e-2)},
    ],
    ids=["default", "wd-d-maximize", "beta2-eps"],
)
def test_numpy_reference(cfg):
    rng = np.random.default_rng(5)
    params = make_tree(SHAPES, rng)
    grads = grad_stream(params, 30, seed=6)
    full = {
        "lr": 1e-2,
        "beta2_decay": -0.8,
        "eps": (None, 1e-3),
        "d": 1.0,
        "weight_decay": 0.0,
        "maximize": False,
        **cfg,
    }
    expected = _numpy_adafactor(params, grads, **full)
    p, _ = _run_fo(cfg, params, grads)
    assert rel_err(p, expected) <= 1e-10


def test_factored_state_shapes_and_missing_buffers():
    state = fo.adafactor().init(to_jax(make_tree(SHAPES, np.random.default_rng(0))))
    assert state.row_var["t"].shape == (2, 3, 1) and state.col_var["t"].shape == (2, 1, 4)
    assert state.variance["t"] is None and state.row_var["b"] is None
    assert state.variance["b"].shape == (5,) and state.variance["s"].shape == ()


ERRORS = [
    ({"lr": -1.0}, "Learning rate should be >= 0 but is: -1.0"),
    ({"beta2_decay": 0.8}, "beta2_decay should be <= 0 but is: 0.8"),
    ({"eps": (-1e-30, 1e-3)}, "epsilon1 should be >= 0 but is: -1e-30"),
    ({"eps": (None, -1.0)}, "epsilon2 should be >= 0 but is: -1.0"),
    ({"d": 0.0}, "Clipping threshold d should be >= 1 but is: 0.0"),
    ({"weight_decay": -0.5}, "weight_decay should be >= 0 but is: -0.5"),
]


@pytest.mark.parametrize("kwargs,message", ERRORS, ids=[m.split(" ")[0] for _, m in ERRORS])
def test_validation_matches_torch(kwargs, message):
    with pytest.raises(ValueError) as theirs:
        torch.optim.Adafactor([torch.zeros(2, requires_grad=True)], **kwargs)
    assert str(theirs.value) == message
    with pytest.raises(ValueError) as mine:
        fo.adafactor(**kwargs)
    assert str(mine.value) == message
    # set_hparams runs the same checks on an existing state
    state = fo.adafactor().init({"w": jnp.zeros(2)})
    if "eps" in kwargs:  # the state stores eps1 = None as NaN
        kwargs = {"eps": tuple(float("nan") if e is None else e for e in kwargs["eps"])}
    with pytest.raises(ValueError) as again:
        fo.set_hparams(state, **kwargs)
    assert str(again.value) == message


def test_lr_change_does_not_recompile():
    params, grads = _problem(np.float64)
    params, grad = to_jax(params), to_jax(grads[0])
    tx = shared_tx(fo.adafactor, {"maximize": False})
    state = tx.init(params)
    p1, _ = STEP(tx, params, grad, state)
    compiled = STEP._cache_size()
    changed = {"lr": 0.001, "weight_decay": 0.1, "eps": (1e-5, 1e-3)}
    p2, _ = STEP(tx, params, grad, fo.set_hparams(state, **changed))
    assert STEP._cache_size() == compiled
    np_params = jax.tree.map(np.asarray, params)
    np_grads = jax.tree.map(np.asarray, grad)
    for p, cfg in ((p1, {}), (p2, changed)):
        expected, _ = run_torch(
            lambda ps, cfg=cfg: torch.optim.Adafactor(ps, foreach=False, **cfg), np_params, [np_grads]
        )
        assert rel_err(p, expected) <= 1e-12
    assert rel_err(p1, p2) > 1e-4
