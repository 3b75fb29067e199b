"""fo.lbfgs against torch.optim.LBFGS on a quadratic and Rosenbrock, step by step and state by state."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.tree_util import Partial

import functorch_optim as fo
from functorch_optim._registry import get_spec
from tests import stepping  # noqa: F401  (runs torch single-threaded)

GRID = get_spec("lbfgs").grid
OUTER_STEPS = 4
CURVATURE_TOL = 1e-6
N = 4


def _objective(a, b, c, x, xp=jnp):
    """``x'Ax/2 - b'x + c * rosenbrock(x)``: the quadratic (c = 0) or Rosenbrock (A = b = 0)."""
    rosen = xp.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2)
    return 0.5 * x @ (a @ x) - b @ x + c * rosen


def _tree_objective(a, b, c, params):
    return _objective(a, b, c, jnp.concatenate([params["a"], params["b"]]))


def _problems():
    rng = np.random.default_rng(0)
    m = rng.standard_normal((N, N))
    quad = (m @ m.T + 0.5 * np.eye(N), rng.standard_normal(N), 0.0, np.zeros(N))
    rosen = (np.zeros((N, N)), np.zeros(N), 1.0, np.array([-1.2, 1.0, -0.5, 0.8]))
    return {"quadratic": quad, "rosenbrock": rosen}


PROBLEMS = _problems()
ROSEN32 = tuple(np.asarray(v, np.float32) for v in PROBLEMS["rosenbrock"][:3])


def _split(x):
    return {"a": jnp.asarray(x[:2]), "b": jnp.asarray(x[2:])}


# Each compiled group drives the step through a different entry point, so all three are
# held to torch's numbers without compiling any of them twice.
API = {(None, 10): "step", ("strong_wolfe", 3): "lbfgs_step", ("strong_wolfe", 10): "update"}


@functools.cache
def _jitted(line_search_fn, history_size):
    """One transformation and one compiled step per structural flag combination."""
    tx = fo.lbfgs(line_search_fn=line_search_fn, history_size=history_size)
    api = API[(line_search_fn, history_size)]

    def run(value_fn, params, state):
        if api == "lbfgs_step":
            return fo.lbfgs_step(tx, value_fn, params, state)
        loss, grads = jax.value_and_grad(value_fn)(params)
        if api == "step":
            params, state = fo.step(tx, params, grads, state, value_fn=value_fn, value=loss)
        else:
            updates, state = tx.update(grads, state, params, value_fn=value_fn)
            params = fo.apply_updates(params, updates)
        return params, state, loss

    return tx, jax.jit(run)


def _run_torch(problem, cfg, steps):
    a, b, c, x0 = (torch.tensor(v) for v in PROBLEMS[problem])
    pa = x0[:2].clone().requires_grad_(True)
    pb = x0[2:].clone().requires_grad_(True)
    opt = torch.optim.LBFGS([pa, pb], **cfg)

    def closure():
        opt.zero_grad()
        loss = _objective(a, b, c, torch.cat([pa, pb]), xp=torch)
        loss.backward()
        return loss

    trace = []
    for _ in range(steps):
        loss = float(opt.step(closure).detach())
        st = opt.state[pa]
        trace.append(
            {
                "x": torch.cat([pa, pb]).detach().numpy().copy(),
                "loss": loss,
                "n_iter": st["n_iter"],
                "func_evals": st["func_evals"],
            }
        )
    return trace, opt.state[pa]


def _run_fo(problem, cfg, steps):
    _, step = _jitted(cfg.get("line_search_fn"), cfg.get("history_size", 100))
    a, b, c, x0 = PROBLEMS[problem]
    value_fn = Partial(_tree_objective, jnp.asarray(a), jnp.asarray(b), jnp.asarray(c))
    params = _split(x0)
    state = fo.lbfgs(**cfg).init(params)
    trace = []
    for _ in range(steps):
        params, state, loss = step(value_fn, params, state)
        trace.append(
            {
                "x": np.concatenate([params["a"], params["b"]]),
                "loss": float(loss),
                "n_iter": int(state.n_iter),
                "func_evals": int(state.func_evals),
            }
        )
    return trace, state


def _close(mine, theirs, tol=1e-10, floor=1.0):
    """``max|mine - theirs| <= tol * max(floor, max|theirs|)``."""
    mine, theirs = np.asarray(mine, np.float64), np.asarray(theirs, np.float64)
    return np.max(np.abs(mine - theirs)) <= tol * max(floor, np.max(np.abs(theirs)))


def _cfg_id(cfg):
    return "-".join(f"{k}={v}" for k, v in cfg.items())


@pytest.mark.parametrize("problem", list(PROBLEMS))
@pytest.mark.parametrize("cfg", GRID, ids=[_cfg_id(c) for c in GRID])
def test_parity_with_torch(problem, cfg):
    theirs, t_state = _run_torch(problem, cfg, OUTER_STEPS)
    mine, state = _run_fo(problem, cfg, OUTER_STEPS)
    for k, (m, t) in enumerate(zip(mine, theirs, strict=True)):
        # the control flow is torch's: same iteration and evaluation counts at every step
        assert (m["n_iter"], m["func_evals"]) == (t["n_iter"], t["func_evals"]), k
        assert _close(m["x"], t["x"]), (k, m["x"], t["x"])
        assert _close(m["loss"], t["loss"]), k
    # the state, by torch's names
    assert _close(state.d, t_state["d"])
    assert _close(state.t, float(t_state["t"]))
    # H_diag = y's / y'y and ro = 1 / y's are quotients of differences of nearly equal
    # gradients once a run has converged (|y| ~ 1e-5 |g|): the last-bit differences of
    # the gradients (autodiff and dot-product order differ between torch and XLA) reach
    # them amplified, measured up to 3e-7 relative, while the trajectory stays within 1e-10
    assert _close(state.H_diag, float(t_state["H_diag"]), tol=CURVATURE_TOL)
    assert _close(state.prev_flat_grad, t_state["prev_flat_grad"])
    assert _close(state.prev_loss, t_state["prev_loss"])
    old_dirs, old_stps, ro = state.history()
    assert len(ro) == len(t_state["ro"]) <= cfg["history_size"]
    if len(ro):
        assert _close(old_dirs, torch.stack(t_state["old_dirs"]))
        assert _close(old_stps, torch.stack(t_state["old_stps"]))
        assert _close(ro, torch.stack(t_state["ro"]), tol=CURVATURE_TOL, floor=0.0)


def test_history_ring_buffer_wraps_like_torch_lists():
    cfg = {"line_search_fn": "strong_wolfe", "max_iter": 20, "history_size": 3}
    _, t_state = _run_torch("quadratic", cfg, 2)
    _, state = _run_fo("quadratic", cfg, 2)
    assert int(state.history_count) > cfg["history_size"]  # it wrapped around
    old_dirs, old_stps, _ = state.history()
    assert _close(old_dirs, torch.stack(t_state["old_dirs"]))
    assert _close(old_stps, torch.stack(t_state["old_stps"]))


def test_first_step_scaled_by_l1_norm():
    # no line search, one iteration: x1 = x0 - min(1, 1/|g|_1) * lr * g
    cfg = {"max_iter": 1, "history_size": 10, "lr": 1.0}
    mine, state = _run_fo("rosenbrock", cfg, 1)
    x0 = PROBLEMS["rosenbrock"][3]
    x = torch.tensor(x0, requires_grad=True)
    _objective(*(torch.tensor(v) for v in PROBLEMS["rosenbrock"][:3]), x, xp=torch).backward()
    g = x.grad.numpy()
    assert np.abs(g).sum() > 1
    np.testing.assert_allclose(mine[0]["x"], x0 - g / np.abs(g).sum(), rtol=1e-14)
    assert float(state.t) == pytest.approx(1 / np.abs(g).sum(), rel=1e-14)


def test_optimal_start_returns_at_once():
    # at the minimum of Rosenbrock the gradient is zero: torch evaluates once and returns
    cfg = {"line_search_fn": "strong_wolfe", "history_size": 3}
    _, step = _jitted("strong_wolfe", 3)
    a, b, c, _ = PROBLEMS["rosenbrock"]
    value_fn = Partial(_tree_objective, jnp.asarray(a), jnp.asarray(b), jnp.asarray(c))
    params = _split(np.ones(N))
    new, state, loss = step(value_fn, params, fo.lbfgs(**cfg).init(params))
    assert float(loss) == 0.0
    assert (int(state.func_evals), int(state.n_iter)) == (1, 0)
    np.testing.assert_array_equal(np.asarray(new["a"]), 1.0)


def test_step_needs_value_fn():
    tx, _ = _jitted("strong_wolfe", 3)
    params = _split(np.zeros(N))
    with pytest.raises(ValueError, match="lbfgs needs the loss function"):
        fo.step(tx, params, params, tx.init(params))
    with pytest.raises(TypeError, match=r"tx must be built by functorch_optim\.lbfgs"):
        fo.lbfgs_step(fo.sgd(), lambda p: 0.0, params, tx.init(params))


def test_hyperparameter_change_does_not_recompile():
    tx, step = _jitted("strong_wolfe", 3)
    a, b, c, x0 = PROBLEMS["rosenbrock"]
    value_fn = Partial(_tree_objective, jnp.asarray(a), jnp.asarray(b), jnp.asarray(c))
    params = _split(x0)
    state = tx.init(params)
    step(value_fn, params, state)
    compiled = step._cache_size()
    _, one_iter, _ = step(value_fn, params, fo.set_hparams(state, lr=0.5, max_iter=1, max_eval=2))
    assert step._cache_size() == compiled
    assert int(one_iter.n_iter) == 1
    theirs, _ = _run_torch(
        "rosenbrock",
        {"line_search_fn": "strong_wolfe", "history_size": 3, "lr": 0.5, "max_iter": 1, "max_eval": 2},
        1,
    )
    assert int(one_iter.func_evals) == theirs[0]["func_evals"]


def test_validation_matches_torch():
    with pytest.raises(ValueError) as theirs:
        torch.optim.LBFGS([torch.zeros(2, requires_grad=True)], lr=-1.0)
    with pytest.raises(ValueError) as mine:
        fo.lbfgs(lr=-1.0)
    assert str(mine.value) == str(theirs.value) == "Invalid learning rate: -1.0"
    # torch raises this one from its first step; here at construction
    w = torch.ones(2, requires_grad=True)
    opt = torch.optim.LBFGS([w], line_search_fn="backtracking")

    def closure():
        opt.zero_grad()
        loss = (w**2).sum()
        loss.backward()
        return loss

    with pytest.raises(RuntimeError) as theirs:
        opt.step(closure)
    with pytest.raises(RuntimeError) as mine:
        fo.lbfgs(line_search_fn="backtracking")
    assert str(mine.value) == str(theirs.value) == "only 'strong_wolfe' is supported"
    with pytest.raises(ValueError, match=r"history_size must be an integer >= 1, got 0"):
        fo.lbfgs(history_size=0)
    state = fo.lbfgs().init({"w": jnp.zeros(2)})
    with pytest.raises(ValueError, match=r"Invalid learning rate: -2\.0"):
        fo.set_hparams(state, lr=-2.0)


def test_float32_close_to_torch():
    # torch mixes float32 0-d tensors into its Python-float scalars, so float32 is close,
    # not last-bit: same control flow, trajectory within float32 resolution
    cfg = {"max_iter": 5, "history_size": 10}
    tx = fo.lbfgs(**cfg)
    step = jax.jit(lambda p, s: fo.lbfgs_step(tx, lambda q: _tree_objective(*ROSEN32, q), p, s))
    x0 = PROBLEMS["rosenbrock"][3].astype(np.float32)
    params = _split(x0)
    state = tx.init(params)
    xt = torch.tensor(x0, requires_grad=True)
    opt = torch.optim.LBFGS([xt], **cfg)
    t_args = [torch.tensor(v) for v in ROSEN32]

    def closure():
        opt.zero_grad()
        loss = _objective(*t_args, xt, xp=torch)
        loss.backward()
        return loss

    for _ in range(3):
        params, state, _ = step(params, state)
        opt.step(closure)
        mine = np.concatenate([params["a"], params["b"]])
        assert mine.dtype == np.float32
        assert _close(mine, xt.detach().numpy(), tol=1e-5)
        assert int(state.func_evals) == opt.state[xt]["func_evals"]


def test_facade_duplicate_parameters_warn_and_shared_groups_raise_like_torch():
    import warnings

    w = jnp.ones(3)
    t = torch.ones(3, requires_grad=True)
    for make in (lambda: torch.optim.LBFGS([t, t]), lambda: fo.optim.LBFGS([w, w])):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make()
        assert any("duplicate parameters" in str(c.message) for c in caught)
    message = "some parameters appear in more than one parameter group"
    with pytest.raises(ValueError, match=message):
        torch.optim.LBFGS([{"params": [t]}, {"params": [t]}])
    with pytest.raises(ValueError, match=message):
        fo.optim.LBFGS([{"params": [w]}, {"params": [w]}])
    with pytest.raises(ValueError, match="doesn't support per-parameter options"):
        fo.optim.LBFGS([{"params": [w]}, {"params": [jnp.ones(2)]}])
