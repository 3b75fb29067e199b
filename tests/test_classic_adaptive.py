"""Adagrad, Adadelta, RMSprop, Rprop, ASGD: parity with torch.optim and NumPy references.

One parametrized module for the five (they share the harness): torch parity over each
registry grid (float64 and float32, params and every state buffer), independent NumPy
float64 formulas, torch's ValueError texts, hyperparameter changes without
recompilation, literal ``None`` gradients, bfloat16, differentiable steps, and each
algorithm's own quirks (Adagrad's constructor-time ``sum``, Rprop's lazy ``lr``, ASGD's
float32 ``eta``/``mu``).
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import functorch_optim as fo
from functorch_optim._registry import get_spec
from tests.helpers import (
    TREE_SHAPES,
    assert_bitwise_equal,
    grad_stream,
    make_tree,
    numpy_per_leaf,
    rel_err,
    run_jitted,
    run_torch,
    to_jax,
    zero_ness,
)

ALGOS = ("adagrad", "adadelta", "rmsprop", "rprop", "asgd")
STEPS = 50
TOL = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 1e-5}


def _mixed_params(seed):
    """One float64 and one float32 leaf in one tree: each structural flag combination
    compiles once for both dtypes (XLA's compile time, not the steps, dominates here).
    Trees with more leaves, 0-d leaves and literal ``None`` leaves run in the eager tests.
    """
    rng = np.random.default_rng(seed)
    return {"f32": rng.standard_normal((3, 4)).astype(np.float32), "f64": rng.standard_normal((3, 4))}


def _stream(params, steps, seed, none_every=0):
    """``grad_stream`` with each gradient in its parameter's dtype."""
    return [
        jax.tree.map(
            lambda g, p: None if g is None else g.astype(p.dtype), g, params, is_leaf=lambda x: x is None
        )
        for g in grad_stream(params, steps, seed=seed, none_every=none_every)
    ]


def _cid(c):
    return "-".join(f"{k}={v}" for k, v in c.items()) or "defaults"


def _defaults(name):
    sig = inspect.signature(get_spec(name).factory)
    return {k: p.default for k, p in sig.parameters.items()}


def _static_key(name, config):
    """The structural part of a config: what a transformation must be rebuilt for."""
    full = {**_defaults(name), **config}
    key = {"maximize": full["maximize"]}
    if name == "adagrad":
        key["initial_accumulator_value"] = full["initial_accumulator_value"]
    if name == "rmsprop":
        key["centered"] = full["centered"]
        key["momentum"] = 0.9 if full["momentum"] > 0 else 0.0
    # a number's zero-ness is compiled in (``Algorithm.fixed_zero``)
    key.update({k: v for k, v in zero_ness(full).items() if k not in key})
    return tuple(sorted(key.items()))


@functools.cache
def _jitted(name, static_key):
    """One transformation and one jitted step per static combination; numbers are data."""
    tx = get_spec(name).factory(**dict(static_key))
    return tx, jax.jit(functools.partial(fo.step, tx))


def _numeric(name, config, state):
    full = {**_defaults(name), **config}
    return {k: full[k] for k in fo.get_hparams(state)}


def _prepare(params, grads):
    """Device arrays once per stream; a ``None`` leaf is zeros plus ``grad_mask=False``."""
    treedef = jax.tree.structure(params)
    p_leaves = treedef.flatten_up_to(params)
    out = []
    for g in grads:
        leaves = treedef.flatten_up_to(g)
        vals = [np.zeros_like(p) if x is None else x for x, p in zip(leaves, p_leaves, strict=True)]
        mask = [np.asarray(x is not None) for x in leaves]
        out.append(jax.device_put((treedef.unflatten(vals), treedef.unflatten(mask))))
    return out


def _run_ours(name, config, params, prepared, state=None):
    """Run ``config`` through the cached jitted step (one compilation per static combination)."""
    tx, step = _jitted(name, _static_key(name, config))
    p = to_jax(params)
    if state is None:
        state = fo.set_hparams(tx.init(p), **_numeric(name, config, tx.init(p)))
    for g, mask in prepared:
        p, state = step(p, g, state, grad_mask=mask)
    return p, state


def _torch_opt(name, tensors, config):
    return getattr(torch.optim, get_spec(name).torch_name)(tensors, foreach=False, **config)


def _run_torch(name, config, params, grads, dtype=None, changes=None):
    """torch on the same stream; ``changes`` maps a step index to new param_group values."""
    leaves, treedef = jax.tree.flatten(params)
    ts = [torch.tensor(np.asarray(p)).to(dtype or torch.tensor(np.asarray(p)).dtype) for p in leaves]
    for t in ts:
        t.requires_grad_(True)
    opt = _torch_opt(name, ts, config)
    for i, g in enumerate(grads):
        for k, v in (changes or {}).get(i, {}).items():
            opt.param_groups[0][k] = v
        for t, gl in zip(ts, treedef.flatten_up_to(g), strict=True):
            t.grad = None if gl is None else torch.tensor(np.asarray(gl)).to(t.dtype)
        opt.step()
    final = treedef.unflatten(
        [t.detach().float().numpy() if t.dtype == torch.bfloat16 else t.detach().numpy() for t in ts]
    )
    buffers = {}
    for b in get_spec(name).buffers:
        vals = [opt.state[t][b].detach() if b in opt.state.get(t, {}) else None for t in ts]
        if any(v is not None for v in vals):
            buffers[b] = [
                None if v is None else v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy()
                for v in vals
            ]
    return final, buffers


def _errors(ours_params, ours_state, ref_params, ref_buffers):
    """Per parameter dtype, the max relative error over params and every buffer torch has.

    Buffer shapes and dtypes must match torch's (``step``: torch keeps a float tensor).
    """
    assert set(ref_buffers) <= set(ours_state.buffers), (sorted(ref_buffers), sorted(ours_state.buffers))
    p_ours, p_ref = jax.tree.leaves(ours_params), jax.tree.leaves(ref_params)
    errs = {}
    for i, (po, pr) in enumerate(zip(p_ours, p_ref, strict=True)):
        key = np.dtype(pr.dtype)
        assert np.dtype(po.dtype) == key
        err = rel_err(po, pr)
        for b, ref in ref_buffers.items():
            o, r = jax.tree.leaves(ours_state.buffers[b])[i], ref[i]
            if r is None:
                continue
            assert o.shape == r.shape, b
            if b != "step":
                assert np.dtype(o.dtype) == np.dtype(r.dtype), (b, o.dtype, r.dtype)
            err = max(err, rel_err(o, r))
        errs[key] = max(errs.get(key, 0.0), err)
    return errs


def _compare(ours_params, ours_state, ref_params, ref_buffers):
    """Max relative error over all leaves (params and buffers)."""
    return max(_errors(ours_params, ours_state, ref_params, ref_buffers).values())


# --------------------------------------------------------------------------- parity grid


@pytest.mark.parametrize("name", ALGOS)
def test_parity_with_torch_over_grid(name):
    """Every grid config, 50 steps, a float64 and a float32 parameter, some ``None`` steps."""
    params = _mixed_params(0)
    grads = _stream(params, STEPS, seed=1, none_every=4)
    prepared = _prepare(params, grads)
    worst, moved = dict.fromkeys(TOL, 0.0), np.inf
    for config in get_spec(name).grid:
        ours, state = _run_ours(name, config, params, prepared)
        ref, ref_buffers = _run_torch(name, config, params, grads)
        for dtype, err in _errors(ours, state, ref, ref_buffers).items():
            assert err <= TOL[dtype], f"{_cid(config)} {dtype}: relative error {err:.3g}"
            worst[dtype] = max(worst[dtype], err)
        moved = min(moved, rel_err(ours, params))
    # the comparison is not vacuous: every configuration moved the parameters
    assert moved > 1e-4
    print(f"{name}: max relative error vs torch " + ", ".join(f"{d}: {e:.3g}" for d, e in worst.items()))


@pytest.mark.parametrize("name", ALGOS)
def test_construction_and_set_hparams_give_the_same_state(name):
    """The grid runs through ``set_hparams`` on a cached transformation: that is the factory."""
    params = to_jax(_mixed_params(0))
    for config in get_spec(name).grid:
        tx, _ = _jitted(name, _static_key(name, config))
        via_set = fo.set_hparams(tx.init(params), **_numeric(name, config, tx.init(params)))
        direct = get_spec(name).factory(**config).init(params)
        assert jax.tree.structure(via_set) == jax.tree.structure(direct)
        for a, b in zip(jax.tree.leaves(via_set), jax.tree.leaves(direct), strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b)


# --------------------------------------------------------------------------- NumPy references


def _np_adagrad(p, g, s, t, hp):
    if "sum" not in s:
        s["sum"] = np.full_like(p, hp["initial_accumulator_value"])
    if hp["weight_decay"]:
        g = g + hp["weight_decay"] * p
    clr = hp["lr"] / (1 + (t - 1) * hp["lr_decay"])
    s["sum"] = s["sum"] + g * g
    return p - clr * g / (np.sqrt(s["sum"]) + hp["eps"])


def _np_adadelta(p, g, s, t, hp):
    rho, eps = hp["rho"], hp["eps"]
    v, u = s.get("square_avg", np.zeros_like(p)), s.get("acc_delta", np.zeros_like(p))
    if hp["weight_decay"]:
        g = g + hp["weight_decay"] * p
    v = rho * v + (1 - rho) * g * g
    dx = np.sqrt(u + eps) / np.sqrt(v + eps) * g
    s["square_avg"], s["acc_delta"] = v, rho * u + (1 - rho) * dx * dx
    return p - hp["lr"] * dx


def _np_rmsprop(p, g, s, t, hp):
    a = hp["alpha"]
    if hp["weight_decay"]:
        g = g + hp["weight_decay"] * p
    v = a * s.get("square_avg", np.zeros_like(p)) + (1 - a) * g * g
    s["square_avg"] = v
    if hp["centered"]:
        s["grad_avg"] = a * s.get("grad_avg", np.zeros_like(p)) + (1 - a) * g
        denom = np.sqrt(v - s["grad_avg"] ** 2) + hp["eps"]
    else:
        denom = np.sqrt(v) + hp["eps"]
    if hp["momentum"] > 0:
        s["momentum_buffer"] = hp["momentum"] * s.get("momentum_buffer", np.zeros_like(p)) + g / denom
        return p - hp["lr"] * s["momentum_buffer"]
    return p - hp["lr"] * g / denom


def _np_rprop(p, g, s, t, hp):
    (em, ep), (lo, hi) = hp["etas"], hp["step_sizes"]
    size = s.get("step_size", np.full_like(p, hp["lr"]))
    prod = g * s.get("prev", np.zeros_like(p))
    size = np.clip(np.where(prod > 0, size * ep, np.where(prod < 0, size * em, size)), lo, hi)
    g = np.where(prod < 0, 0.0, g)
    s["step_size"], s["prev"] = size, g
    return p - np.sign(g) * size


def _np_asgd(p, g, s, t, hp):
    f32 = lambda x: float(np.float32(x))  # torch's default dtype holds eta and mu
    eta, mu = s.get("eta", f32(hp["lr"])), s.get("mu", 1.0)
    if hp["weight_decay"]:
        g = g + hp["weight_decay"] * p
    p = p * (1 - hp["lambd"] * eta) - eta * g
    s["ax"] = p.copy() if mu == 1 else s["ax"] + mu * (p - s["ax"])
    s["eta"] = f32(hp["lr"] / (1 + hp["lambd"] * hp["lr"] * t) ** hp["alpha"])
    s["mu"] = f32(1 / max(1, t - hp["t0"]))
    return p


NUMPY_RULES = {
    "adagrad": _np_adagrad,
    "adadelta": _np_adadelta,
    "rmsprop": _np_rmsprop,
    "rprop": _np_rprop,
    "asgd": _np_asgd,
}


def _numpy_run(name, config, params, grads):
    """Independent float64 reference: the documented rule, per parameter, lazy state."""
    hp = {**_defaults(name), **config}

    def rule(p, g, s, t):
        g = -np.asarray(g, np.float64) if hp["maximize"] else np.asarray(g, np.float64)
        return NUMPY_RULES[name](p, g, s, t, hp)

    if name == "adagrad":  # torch builds Adagrad's state in its constructor
        return numpy_per_leaf(
            params, grads, rule, lambda p: {"sum": np.full_like(p, hp["initial_accumulator_value"])}
        )
    return numpy_per_leaf(params, grads, rule)


@pytest.mark.parametrize("name", ALGOS)
def test_matches_numpy_reference(name):
    """float64 formulas; the float32 parameter is held to float32's tolerance."""
    params = _mixed_params(3)
    grads = _stream(params, STEPS, seed=4, none_every=3)
    prepared = _prepare(params, grads)
    worst = dict.fromkeys(TOL, 0.0)
    for config in get_spec(name).grid[::2]:
        ours, state = _run_ours(name, config, params, prepared)
        ref, ref_states, ref_steps = _numpy_run(name, config, params, grads)
        assert [int(s) for s in jax.tree.leaves(state.step)] == ref_steps
        for i, (o, r) in enumerate(zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True)):
            err = rel_err(o, r)
            for b in ref_states[i]:
                err = max(err, rel_err(jax.tree.leaves(state.buffers[b])[i], ref_states[i][b]))
            dtype = np.dtype(o.dtype)
            assert err <= TOL[dtype], f"{_cid(config)} {dtype}: relative error {err:.3g}"
            worst[dtype] = max(worst[dtype], err)
    print(f"{name}: max relative error vs NumPy " + ", ".join(f"{d}: {e:.3g}" for d, e in worst.items()))


# --------------------------------------------------------------------------- None, set_hparams, jit


RICH = {
    "adagrad": {"lr": 0.1, "lr_decay": 0.05, "weight_decay": 0.1, "initial_accumulator_value": 0.5},
    "adadelta": {"lr": 0.5, "rho": 0.8, "weight_decay": 0.1},
    "rmsprop": {"lr": 0.01, "alpha": 0.9, "weight_decay": 0.1, "momentum": 0.9, "centered": True},
    "rprop": {"lr": 0.05, "etas": (0.4, 1.3), "step_sizes": (1e-4, 1.0)},
    "asgd": {"lr": 0.05, "lambd": 0.1, "t0": 3.0, "weight_decay": 0.1},
}
# new values for every numeric hyperparameter, set mid-run in both libraries
CHANGES = {
    "adagrad": {"lr": 0.03, "lr_decay": 0.2, "weight_decay": 0.0, "eps": 1e-6},
    "adadelta": {"lr": 0.2, "rho": 0.6, "eps": 1e-4, "weight_decay": 0.0},
    "rmsprop": {"lr": 0.002, "alpha": 0.95, "eps": 1e-5, "weight_decay": 0.0, "momentum": 0.5},
    "rprop": {"lr": 0.2, "etas": (0.6, 1.1), "step_sizes": (1e-3, 0.1)},
    "asgd": {"lr": 0.2, "lambd": 0.01, "alpha": 0.6, "t0": 1.0, "weight_decay": 0.0},
}


@pytest.mark.parametrize("name", ALGOS)
def test_set_hparams_mid_run_matches_torch_without_recompiling(name):
    params = _mixed_params(5)
    grads = _stream(params, 2 * STEPS, seed=6, none_every=5)
    config = RICH[name]
    _, step = _jitted(name, _static_key(name, config))
    p, state = _run_ours(name, config, params, _prepare(params, grads[:1]))
    compiled = step._cache_size()
    p, state = _run_ours(name, config, p, _prepare(params, grads[1:STEPS]), state)
    state = fo.set_hparams(state, **CHANGES[name])
    p, state = _run_ours(name, config, p, _prepare(params, grads[STEPS:]), state)
    assert step._cache_size() == compiled  # numbers are data: nothing compiled after step 1
    ref, ref_buffers = _run_torch(name, config, params, grads, changes={STEPS: CHANGES[name]})
    for dtype, err in _errors(p, state, ref, ref_buffers).items():
        assert err <= TOL[dtype], f"{dtype}: relative error {err:.3g}"
    # and the change mattered: without it the run ends elsewhere
    unchanged, _ = _run_torch(name, config, params, grads)
    assert rel_err(p, unchanged) > 1e-4


@pytest.mark.parametrize("name", ALGOS)
def test_literal_none_gradients_skip_bitwise_and_match_torch(name):
    """``None`` leaves (not a mask): late first gradient, skipped steps, state untouched."""
    params = {"a": np.array([-0.0, 1.5]), "b": np.array(2.0)}
    g = [np.array([0.5, -1.0]), np.array([0.25, 0.75]), np.array([-0.5, 2.0]), np.array([1.0, 1.0])]
    grads = [
        {"a": None, "b": g[0][1]},
        {"a": g[1], "b": g[2][1]},
        {"a": g[3], "b": None},
        {"a": g[0], "b": g[1][1]},
    ]
    tx = get_spec(name).factory(**RICH[name])
    p, state = to_jax(params), tx.init(to_jax(params))
    for grad in grads:
        missing = next(k for k in ("a", "b", None) if k is None or grad[k] is None)
        new_p, new_state = fo.step(tx, p, to_jax(grad), state)
        if missing is not None:
            assert new_p[missing].tobytes() == p[missing].tobytes()
            for b in state.buffers:
                assert new_state.buffers[b][missing].tobytes() == state.buffers[b][missing].tobytes(), b
        p, state = new_p, new_state
    assert [int(s) for s in jax.tree.leaves(state.step)] == [3, 3]
    ref, ref_buffers = _run_torch(name, RICH[name], params, grads)
    assert _compare(p, state, ref, ref_buffers) <= 1e-12
    assert rel_err(p, params) > 1e-3
    updates, _ = tx.update({"a": None, "b": to_jax(g[0][1])}, state, p)
    assert updates["a"] is None and updates["b"].shape == ()


# --------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("name", ALGOS)
def test_bfloat16_rounds_per_torch_op(name):
    """bf16 params compute in float32 per torch op and round after each op, as torch's CPU kernels."""
    rng = np.random.default_rng(9)
    params = {"w": rng.standard_normal((8, 16)), "s": np.asarray(0.5)}
    grads = grad_stream(params, 8, seed=10)
    config = {k: v for k, v in RICH[name].items() if k != "weight_decay"} | {"lr": 0.05}
    tx = get_spec(name).factory(**config)
    step = jax.jit(functools.partial(fo.step, tx))
    p = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), params)
    state = tx.init(p)
    for g in grads:
        p, state = step(p, jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), g), state)
    assert {x.dtype for x in jax.tree.leaves(p)} == {jnp.dtype(jnp.bfloat16)}
    bf16_params = jax.tree.map(lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32), params)
    bf16_grads = [
        jax.tree.map(lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32), g) for g in grads
    ]
    ref, ref_buffers = _run_torch(name, config, bf16_params, bf16_grads, dtype=torch.bfloat16)
    ours = jax.tree.map(lambda x: np.asarray(x, np.float32), p)
    # torch's scalar tail loop (the 0-d leaf) reads an ``add`` alpha as float32 where its
    # vector loop (and this package) rounds it to bf16 first: one bf16 ulp (2**-8) apart
    assert rel_err(ours, ref) <= 2 * 2.0**-8
    for b, r in ref_buffers.items():
        assert (
            rel_err([np.asarray(x, np.float32) for x in jax.tree.leaves(state.buffers[b])], r) <= 2 * 2.0**-8
        )
    # and the reference is really bf16: float32 arithmetic ends elsewhere
    ref32, _ = _run_torch(name, config, bf16_params, bf16_grads, dtype=torch.float32)
    assert rel_err(ours, ref32) > rel_err(ours, ref)


# --------------------------------------------------------------------------- quirks


def test_adagrad_sum_exists_from_construction_for_every_parameter():
    params = {"a": jnp.ones(2), "b": jnp.ones(3)}
    tx = fo.adagrad(lr=0.1, initial_accumulator_value=0.25)
    state = tx.init(params)
    _, state = fo.step(tx, params, {"a": jnp.ones(2), "b": None}, state)
    ta, tb = (
        torch.ones(2, dtype=torch.float64, requires_grad=True),
        torch.ones(3, dtype=torch.float64, requires_grad=True),
    )
    opt = torch.optim.Adagrad([ta, tb], lr=0.1, initial_accumulator_value=0.25)
    ta.grad = torch.ones(2, dtype=torch.float64)
    opt.step()
    # torch holds state for "b" although it never had a gradient: step 0, sum filled
    assert float(opt.state[tb]["step"]) == 0 and int(state.step["b"]) == 0
    np.testing.assert_array_equal(state.sum["b"], opt.state[tb]["sum"].numpy())
    np.testing.assert_array_equal(state.sum["a"], opt.state[ta]["sum"].numpy())  # 0.25 + 1


def test_adagrad_lr_decay_per_parameter_step_and_eps_outside_sqrt():
    tx = fo.adagrad(lr=1.0, lr_decay=0.5, eps=0.5)
    params = {"a": jnp.array([0.0]), "b": jnp.array([0.0])}
    state = tx.init(params)
    params, state = fo.step(tx, params, {"a": jnp.array([3.0]), "b": None}, state)
    params, state = fo.step(tx, params, {"a": jnp.array([4.0]), "b": jnp.array([4.0])}, state)
    # a: -3/(3+0.5) then -(1/1.5) * 4/(5+0.5); b's first step has clr = lr: -4/(4+0.5)
    np.testing.assert_allclose(params["a"], [-3 / 3.5 - 4 / 1.5 / 5.5], rtol=1e-15)
    np.testing.assert_allclose(params["b"], [-4 / 4.5], rtol=1e-15)


def test_rmsprop_applies_lr_after_the_momentum_buffer():
    """torch: ``buf = m*buf + g/avg; p -= lr*buf`` — a changed lr rescales the whole buffer."""
    tx = fo.rmsprop(lr=1.0, alpha=0.0, eps=0.0, momentum=0.5)
    p = {"w": jnp.array([0.0])}
    state = tx.init(p)
    p, state = fo.step(tx, p, {"w": jnp.array([2.0])}, state)  # buf 1, p -1
    state = fo.set_hparams(state, lr=0.1)
    p, state = fo.step(tx, p, {"w": jnp.array([2.0])}, state)  # buf 1.5, p -1 - 0.15
    np.testing.assert_allclose(p["w"], [-1.15], rtol=1e-15)
    assert state.momentum_buffer["w"].tolist() == [1.5]


@pytest.mark.parametrize("momentum", [0.0, 0.5], ids=["plain", "momentum"])
@pytest.mark.parametrize("alpha", [0.1, 0.0, 0.5], ids=lambda a: f"alpha={a}")
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_rmsprop_centered_under_cancellation_rounds_like_torch(dtype, alpha, momentum):
    # a constant gradient: square_avg - grad_avg**2 cancels to its rounding errors, which
    # the step then divides by; torch's addcmul, lerp and add(alpha=) round once (FMAs on
    # the CPU), so a second rounding was 3.4e-2 off at alpha=0.1, and finite where torch
    # gives NaN at alpha=0
    p0 = np.array([0.3, -1.2, 2.0, 0.7, 0.05], dtype)
    g = np.array([0.1, -0.37, 1.3, 1e-3, 3.0], dtype)
    # weight decay feeds the params back into the buffers; in float32 torch's sqrt (MKL) is
    # 1 ulp off on some CPUs, which then reaches the buffers too, so float32 runs without it
    wd = 0.1 if dtype == np.float64 else 0.0
    kwargs = {"lr": 1e-3, "alpha": alpha, "centered": True, "momentum": momentum, "weight_decay": wd}
    t = torch.tensor(p0, requires_grad=True)
    opt = torch.optim.RMSprop([t], foreach=False, **kwargs)
    tx = fo.rmsprop(**kwargs)
    eager = jitted = {"w": jnp.asarray(p0)}
    se = sj = tx.init(eager)
    step = jax.jit(functools.partial(fo.step, tx))
    for _ in range(15):
        t.grad = torch.tensor(g)
        opt.step()
        eager, se = fo.step(tx, eager, {"w": jnp.asarray(g)}, se)
        jitted, sj = step(jitted, {"w": jnp.asarray(g)}, sj)
    ref = t.detach().numpy()
    for ours, state in ((eager, se), (jitted, sj)):
        np.testing.assert_array_equal(np.isnan(ours["w"]), np.isnan(ref))
        for name in ("square_avg", "grad_avg"):
            np.testing.assert_array_equal(state.buffers[name]["w"], opt.state[t][name].numpy())
        if dtype == np.float64:
            np.testing.assert_array_equal(ours["w"], ref)
        else:
            # torch's float32 sqrt on the CPU is not always correctly rounded (1 ulp)
            np.testing.assert_allclose(ours["w"], ref, rtol=1e-5)
    if alpha == 0.0:
        assert np.isnan(ref).any()


def _fma_cases(dtype):
    """(a, b, c) of ``dtype`` where one rounding differs from two: near-cancellations,
    exact cancellations of the rounded product, near-ties, subnormal and overflowing
    results, products too small for the emulation (below tiny / u**2), signed zeros,
    infinities and NaNs."""
    rng = np.random.default_rng(1)
    info = np.finfo(dtype)
    a = rng.standard_normal(600).astype(dtype)
    b = rng.standard_normal(600).astype(dtype)
    c = (-(a.astype(np.float64) * b) * (1 + 1e-7 * rng.standard_normal(600))).astype(dtype)
    c[:60] = (-(a[:60] * b[:60])).astype(dtype)  # the rounded product cancelled
    # a * b + c = 1 + eps/2 + eps**2, just above the tie between 1 and 1 + eps: rounding
    # the product first (to 1 + 2 eps) puts the sum on the tie, which goes to 1
    eps = dtype(info.eps)
    a[60:70] = b[60:70] = 1 + eps
    c[60:70] = -(eps + eps / 2)
    small = dtype(np.sqrt(info.tiny)) * dtype(1e-3)  # subnormal results (flushed)
    a[70:80] = rng.standard_normal(10).astype(dtype) * small
    b[70:80] = rng.standard_normal(10).astype(dtype) * small
    c[70:80] = rng.standard_normal(10).astype(dtype) * small * small
    # normal products below tiny / u**2 (u the unit roundoff), nearly cancelled by c: the
    # plain expression, rounded twice (the emulation's partial products would be subnormal)
    scale = dtype(np.sqrt(_fma_floor(dtype))) / 8
    a[80:90] = rng.standard_normal(10).astype(dtype) * scale
    b[80:90] = rng.standard_normal(10).astype(dtype) * scale
    c[80:90] = (-(a[80:90].astype(np.float64) * b[80:90]) * (1 + 1e-3 * rng.standard_normal(10))).astype(
        dtype
    )
    a[90:95] = b[90:95] = dtype(np.sqrt(info.max)) * 2  # the result overflows
    c[90:95] = 1
    a[95], b[95], c[95] = -0.0, 1.0, -0.0
    a[96], b[96], c[96] = np.inf, 2.0, 1.0
    a[97], b[97], c[97] = np.inf, 0.0, 1.0
    a[98], b[98], c[98] = np.nan, 1.0, 1.0
    a[99], b[99], c[99] = np.inf, 1.0, -np.inf
    return a, b, c


@pytest.mark.parametrize("program", ["fma", "emulation"])
@pytest.mark.parametrize(
    "dtype, x64",
    [(np.float64, True), (np.float32, True), (np.float32, False)],
    ids=["f64", "f32-x64", "f32-x32"],
)
def test_fma_is_rounded_once_in_eager_and_jit(dtype, x64, program):
    # ``fma`` is XLA's contracted a * b + c on this CPU (one instruction, exact
    # everywhere), the emulation elsewhere (exact but for its plain fallback)
    from functorch_optim import _torch_ops

    a, b, c = _fma_cases(dtype)
    fn = _torch_ops.fma if program == "fma" else _torch_ops._fma
    with jax.enable_x64(x64):
        fallback = program == "emulation" or not _torch_ops.cpu_contracts_fma(dtype)
        outs = [np.asarray(f(jnp.asarray(a), jnp.asarray(b), jnp.asarray(c))) for f in (fn, jax.jit(fn))]
    for out in outs:
        assert out.dtype == dtype
        for x, y, z, o in zip(a, b, c, out):
            _check_fma(x, y, z, o, fallback)
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_true_divide_is_torchs_correctly_rounded_division(dtype):
    # torch's ``tensor / number`` divides; XLA turns ``x / b`` by a broadcast ``b`` into
    # ``x * (1 / b)``: 17 000 of these 100 000 quotients an ulp off, in both dtypes
    from functorch_optim import _torch_ops

    rng = np.random.default_rng(0)
    x = np.abs(rng.standard_normal(100_000)).astype(dtype)
    # (XLA flushes subnormal results to zero: the smallest quotient here is normal)
    x[:6] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 4 * np.finfo(dtype).tiny]
    for divisor in (np.sqrt(1 - 0.999**3), 0.1, 3.0, 0.0, -np.inf):
        theirs = (torch.tensor(x) / float(divisor)).numpy()
        with jax.enable_x64(True):
            d = jnp.asarray(divisor, dtype)
            outs = [
                np.asarray(f(jnp.asarray(x), d))
                for f in (_torch_ops.true_divide, jax.jit(_torch_ops.true_divide))
            ]
            plain = np.asarray(jax.jit(lambda a, b: a / b)(jnp.asarray(x), d))
        for out in outs:
            assert out.dtype == dtype
            np.testing.assert_array_equal(out, theirs)
        if divisor == 0.1:  # the rewrite this avoids
            assert np.sum(plain != theirs) > 1000


def test_adagrad_decayed_lr_is_torchs_python_arithmetic():
    # torch: ``clr = lr / (1 + (step - 1) * lr_decay)`` in Python floats, the product
    # rounded before the add; left to XLA the two were one FMA (2 of these 3000 rates
    # an ulp off, and every parameter with them)
    from functorch_optim import _torch_ops

    rng = np.random.default_rng(0)
    lr_decay, step = rng.uniform(0, 1, 3000), rng.integers(1, 10_000, 3000).astype(np.float64)
    theirs = np.array([0.1 / (1 + (t - 1) * d) for t, d in zip(step, lr_decay)])
    with jax.enable_x64(True):
        ours = jax.jit(lambda t, d: _torch_ops.decayed_lr(jnp.asarray(0.1), t, d, {}))(step, lr_decay)
    np.testing.assert_array_equal(np.asarray(ours), theirs)


def _cpu_has_fma() -> bool | None:
    """Whether this machine's CPU has fused multiply-add instructions (None: unknown here)."""
    import platform

    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return True  # part of every ARMv8 floating-point unit
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return None
    # XLA's x86 code generation takes FMA with AVX2 (x86-64-v3)
    return "fma" in flags and "avx2" in flags


def test_cpu_contracts_fma_only_where_the_cpu_has_fma_instructions():
    from functorch_optim import _torch_ops

    has_fma = _cpu_has_fma()
    if has_fma is None:
        pytest.skip("no /proc/cpuinfo to read the CPU's flags from")
    # where it has them the probe may still find a loop that XLA does not contract (an
    # AVX-512 CPU's short rows): then the emulation, as without them
    assert _torch_ops.cpu_contracts_fma(np.float32) in ((True, False) if has_fma else (False,))
    with jax.enable_x64(True):
        assert _torch_ops.cpu_contracts_fma(np.float64) in ((True, False) if has_fma else (False,))
    with jax.enable_x64(False):
        assert _torch_ops.cpu_contracts_fma(np.float64) is False  # no float64 arrays then
    for other in (jnp.bfloat16, np.float16, np.int32):
        assert _torch_ops.cpu_contracts_fma(other) is False


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_fma_is_rounded_once_in_rows_of_every_length(dtype):
    # arrays of short rows, which LLVM may vectorize across rows (on an AVX-512 CPU it
    # dropped the contraction there, one rounding lost on rows of 3 to 8 elements), with
    # the addend or the multiplicand computed in the same loop, as the rules have them
    from functorch_optim import _torch_ops

    eps = np.finfo(dtype).eps
    shapes = [(67,), (4099,), *((37, k) for k in range(1, 25)), (3, 5, 7), (129, 37)]
    a = [np.full(shape, 1 + eps, dtype) for shape in shapes]
    c = [np.full(shape, -(1 + 2 * eps), dtype) for shape in shapes]

    def probes(a, c, one):
        fma = _torch_ops.fma
        out = []
        for x, z in zip(a, c):
            out += [fma(x, x, z), fma(x * one, x, z * one), fma(x, x * one, z)]
            out += [fma(x, x, jnp.where(one > 0, z * one, x)), fma(one * x, x, z) * one]
        return out

    with jax.enable_x64(True):
        outs = jax.jit(probes)(a, c, np.ones((), dtype))
    want = dtype(eps) * dtype(eps)
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(np.asarray(out), np.full(shapes[i // 5], want), f"{shapes[i // 5]}")


def test_fma_without_cpu_fma_instructions_is_the_exact_emulation(tmp_path):
    # XLA limited to AVX (no FMA instructions): the probe says so, and fma is the
    # emulation, rounded once (with its plain fallback), eager and jitted; centered
    # RMSprop under cancellation still rounds like torch
    import os
    import subprocess
    import sys

    script = tmp_path / "no_fma.py"
    script.write_text(
        "import jax, numpy as np\n"
        "jax.config.update('jax_enable_x64', True)\n"
        "from functorch_optim import _torch_ops\n"
        "from tests.test_classic_adaptive import _fma_cases, _check_fma, "
        "test_rmsprop_centered_under_cancellation_rounds_like_torch as centered\n"
        "assert not _torch_ops.cpu_contracts_fma(np.float32)\n"
        "assert not _torch_ops.cpu_contracts_fma(np.float64)\n"
        "for dtype in (np.float64, np.float32):\n"
        "    a, b, c = _fma_cases(dtype)\n"
        "    for f in (_torch_ops.fma, jax.jit(_torch_ops.fma)):\n"
        "        out = np.asarray(f(a, b, c))\n"
        "        for x, y, z, o in zip(a, b, c, out):\n"
        "            _check_fma(x, y, z, o, True)\n"
        "    centered(dtype, 0.1, 0.5)\n"
        "print('ok')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "XLA_FLAGS": "--xla_cpu_max_isa=AVX", "JAX_PLATFORMS": "cpu", "PYTHONPATH": root}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_the_rmsprop_rule_has_no_fma_emulation_where_the_cpu_contracts():
    # the jitted rule (fused=False: what a GPU runs) pays no emulation work on this CPU:
    # no integer bit manipulation in its compiled step, two loops over memory
    from functorch_optim import _torch_ops
    from functorch_optim._rmsprop import rmsprop_variant

    if not _torch_ops.cpu_contracts_fma(np.float32):
        pytest.skip("XLA uses no FMA instructions on this CPU")
    params = {"w": jnp.ones(4096, jnp.float32)}
    for config in (dict(), dict(centered=True, momentum=0.9, weight_decay=0.1)):
        tx = rmsprop_variant(False, **config)
        hlo = (
            jax.jit(functools.partial(fo.step, tx)).lower(params, params, tx.init(params)).compile().as_text()
        )
        assert "bitcast-convert" not in hlo, config


def _fma_floor(dtype):
    """``tiny / u**2``: at or below it (in magnitude) ``_torch_ops.fma`` is the plain
    ``a * b + c`` (2**-78 in float32, 2**-916 in float64)."""
    info = np.finfo(dtype)
    return info.tiny / (info.eps / 2) ** 2


@np.errstate(invalid="ignore", over="ignore")  # inf * 0 and the overflowing cases
def _check_fma(x, y, z, o, fallback):
    """``o`` is ``x * y + z`` rounded once to its dtype (to nearest, ties to even), or,
    with ``fallback`` (the emulation's), where the rounded product is finite and at most
    ``_fma_floor`` in magnitude, the product rounded and then the sum."""
    from fractions import Fraction

    dtype = o.dtype.type
    info = np.finfo(dtype)
    product = x * y
    if fallback and np.isfinite(product) and abs(product) <= _fma_floor(dtype) and np.isfinite(z):
        plain = product + z
        assert o == (plain if abs(plain) >= info.tiny else 0)
        return
    if not (np.isfinite(x) and np.isfinite(y) and np.isfinite(z)):
        np.testing.assert_equal(o, dtype(np.longdouble(x) * np.longdouble(y) + np.longdouble(z)))
        return
    exact = Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))
    half_ulp = Fraction(2) ** (info.maxexp - 1 - info.nmant - 1)  # of the largest binade
    if abs(exact) >= Fraction(float(info.max)) + half_ulp:  # rounds to infinity
        assert o == (np.inf if exact > 0 else -np.inf)
    elif exact == 0:
        assert o == 0 and np.signbit(o) == (np.signbit(x * y) and np.signbit(z))
    elif abs(exact) < Fraction(float(info.tiny)):
        assert o == 0  # XLA on the CPU flushes subnormal results to zero, as in every op
    else:
        err = abs(Fraction(float(o)) - exact)
        bits = o.view(np.int64 if dtype == np.float64 else np.int32)
        for n in (np.nextafter(o, dtype(np.inf)), np.nextafter(o, dtype(-np.inf))):
            gap = abs(Fraction(float(n)) - exact) if np.isfinite(n) else None
            assert gap is None or err < gap or (err == gap and int(bits) % 2 == 0)


def test_fma_inside_jit_is_traced_once_per_shape_and_dtype_into_the_same_program(monkeypatch):
    from functorch_optim import _torch_ops

    calls = []
    body = _torch_ops._fma_program.__wrapped__

    def counted(a, b, c):
        calls.append(a.shape)
        return body(a, b, c)

    def new_program():  # a new function each time: no trace of it is cached
        def program(a, b):
            x = _torch_ops.fma(a, b, a)
            for _ in range(3):
                x = _torch_ops.fma(x, b, a)
            return x, _torch_ops.fma(a[0], b[0], a[0])

        return program

    args = (jnp.arange(3.0), jnp.ones(3))
    monkeypatch.setattr(_torch_ops, "_fma_program", jax.jit(counted, inline=True))
    staged = jax.jit(new_program()).lower(*args).as_text()
    assert calls == [(3,), ()]  # five calls, two shapes
    # traced at every call instead: the same program, op for op
    monkeypatch.setattr(_torch_ops, "_fma_program", counted)
    assert jax.jit(new_program()).lower(*args).as_text() == staged
    assert len(calls) == 7


def test_rmsprop_momentum_zero_keeps_no_buffer():
    state = fo.rmsprop(lr=0.1).init({"w": jnp.zeros(3)})
    assert set(state.buffers) == {"step", "square_avg"}
    with pytest.raises(ValueError, match="built with momentum=0"):
        fo.set_hparams(state, momentum=0.9)
    centered = fo.rmsprop(momentum=0.9, centered=True).init({"w": jnp.zeros(3)})
    assert set(centered.buffers) == {"step", "square_avg", "momentum_buffer", "grad_avg"}


def test_rprop_reads_lr_only_at_a_parameters_first_gradient():
    params = {"a": np.zeros(3), "b": np.zeros(3)}
    rng = np.random.default_rng(11)
    grads = [{"a": rng.standard_normal(3), "b": None if i < 2 else rng.standard_normal(3)} for i in range(4)]
    tx = fo.rprop(lr=0.1)
    p, state = to_jax(params), tx.init(to_jax(params))
    for i, g in enumerate(grads):
        if i == 1:
            state = fo.set_hparams(state, lr=0.01)
        p, state = fo.step(tx, p, to_jax(g), state)
    ref, ref_buffers = _run_torch("rprop", {"lr": 0.1}, params, grads, changes={1: {"lr": 0.01}})
    assert _compare(p, state, ref, ref_buffers) <= 1e-15
    # "a" got its state under lr=0.1 and ignores the change; "b" starts from lr=0.01
    unchanged, _ = _run_torch("rprop", {"lr": 0.1}, params, grads)
    np.testing.assert_array_equal(p["a"], unchanged["a"])
    assert rel_err(p["b"], unchanged["b"]) > 0.1


def test_rprop_zeroes_the_gradient_where_the_sign_flipped():
    tx = fo.rprop(lr=0.1, etas=(0.5, 2.0))
    p = {"w": jnp.array([0.0, 0.0])}
    state = tx.init(p)
    for g in ([1.0, 1.0], [1.0, -1.0], [1.0, -1.0]):
        p, state = fo.step(tx, p, {"w": jnp.array(g)}, state)
    # w0: steps 0.1, 0.2, 0.4; w1: 0.1, flip (no move, prev 0), then sign 0 -> size kept
    np.testing.assert_allclose(p["w"], [-0.7, -0.1 + 0.05], rtol=1e-15)
    np.testing.assert_allclose(state.step_size["w"], [0.4, 0.05], rtol=1e-15)
    assert state.prev["w"].tolist() == [1.0, -1.0]


def test_asgd_keeps_eta_and_mu_in_torch_default_dtype():
    """float64 params see a float32-rounded eta, as torch's default dtype stores it."""
    params = make_tree(TREE_SHAPES["single"], np.random.default_rng(12))
    grads = grad_stream(params, 20, seed=13)
    config = {"lr": 0.0123456789, "lambd": 0.01, "t0": 2.0}
    tx = fo.asgd(**config)
    p, state = to_jax(params), tx.init(to_jax(params))
    for g in grads:
        p, state = fo.step(tx, p, to_jax(g), state)
    assert state.eta.dtype == state.mu.dtype == jnp.float32 and p.dtype == jnp.float64
    assert torch.get_default_dtype() == torch.float32
    ref, ref_buffers = _run_torch("asgd", config, params, grads)
    assert _compare(p, state, ref, ref_buffers) <= 1e-14
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        ref64, _ = _run_torch("asgd", config, params, grads)
    finally:
        torch.set_default_dtype(previous)
    # the quirk is measurable: a float64 eta ends 1e-10-ish away
    assert rel_err(p, ref64) > 1e-12


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_asgd_equals_torch_bit_for_bit(dtype):
    # param.mul_(1 - lambd * eta) is stored and add_(grad, alpha=-eta) is one FMA, and
    # ax.add_(param.sub(ax).mul_(mu)) stores its product: left to XLA, the decayed
    # parameter's product was contracted into the add (27% of the elements an ulp off
    # after one step) and mu's product into the average's. "k" has rows of 7.
    rng = np.random.default_rng(8)
    params = {"b": rng.standard_normal(4099).astype(dtype), "k": rng.standard_normal((37, 7)).astype(dtype)}
    grads = [{k: rng.standard_normal(v.shape).astype(dtype) for k, v in params.items()} for _ in range(12)]
    config = {"lr": 0.01, "lambd": 1e-3, "t0": 3.0, "weight_decay": 0.01}
    ref, ref_buffers = run_torch(
        lambda ts: torch.optim.ASGD(ts, foreach=False, **config), params, grads, ["ax"]
    )
    mine, state = run_jitted(fo.asgd(**config), params, grads)
    assert_bitwise_equal((mine, state.ax), (ref, ref_buffers["ax"]))


# --------------------------------------------------------------------------- errors

VALIDATION = [
    # mirrors torch/testing/_internal/common_optimizers.py optim_error_inputs_func_*
    ("adagrad", {"lr": 1e-2, "lr_decay": -0.5}, "Invalid lr_decay value: -0.5"),
    ("adadelta", {"lr": 1e-2, "rho": 1.1}, "Invalid rho value: 1.1"),
    ("rmsprop", {"lr": 1e-2, "momentum": -1.0}, "Invalid momentum value: -1.0"),
    ("rprop", {"lr": 1e-2, "etas": (1.0, 0.5)}, "Invalid eta values: 1.0, 0.5"),
    ("asgd", {"lr": 1e-2, "weight_decay": -0.5}, "Invalid weight_decay value: -0.5"),
    # every other check of each constructor
    ("adagrad", {"lr": -1.0}, "Invalid learning rate: -1.0"),
    ("adagrad", {"lr": float("nan")}, "Invalid learning rate: nan"),
    ("adagrad", {"weight_decay": -0.1}, "Invalid weight_decay value: -0.1"),
    ("adagrad", {"initial_accumulator_value": -1.0}, "Invalid initial_accumulator_value value: -1.0"),
    ("adagrad", {"eps": -1e-10}, "Invalid epsilon value: -1e-10"),
    ("adagrad", {"lr": -1, "eps": -1.0}, "Invalid learning rate: -1"),
    ("adadelta", {"lr": -0.5}, "Invalid learning rate: -0.5"),
    ("adadelta", {"rho": -0.1}, "Invalid rho value: -0.1"),
    ("adadelta", {"eps": -1e-6}, "Invalid epsilon value: -1e-06"),
    ("adadelta", {"weight_decay": -1}, "Invalid weight_decay value: -1"),
    ("rmsprop", {"lr": -0.01}, "Invalid learning rate: -0.01"),
    ("rmsprop", {"eps": -1.0, "momentum": -1.0}, "Invalid epsilon value: -1.0"),
    ("rmsprop", {"weight_decay": -0.1}, "Invalid weight_decay value: -0.1"),
    ("rmsprop", {"alpha": -0.5}, "Invalid alpha value: -0.5"),
    ("rprop", {"lr": -0.01}, "Invalid learning rate: -0.01"),
    ("rprop", {"etas": (0.0, 1.2)}, "Invalid eta values: 0.0, 1.2"),
    ("rprop", {"etas": (0.5, 1.0)}, "Invalid eta values: 0.5, 1.0"),
    ("asgd", {"lr": -0.01}, "Invalid learning rate: -0.01"),
]
VALIDATION += [(name, {"lr": "two-element"}, "Tensor lr must be 1-element") for name in ALGOS]


def _lr_arg(kwargs, lib):
    if kwargs.get("lr") != "two-element":
        return kwargs
    return {**kwargs, "lr": jnp.array([1e-3, 1e-3]) if lib == "jax" else torch.tensor([1e-3, 1e-3])}


@pytest.mark.parametrize(
    ("name", "kwargs", "message"), VALIDATION, ids=[f"{n}-{m}" for n, _, m in VALIDATION]
)
def test_validation_messages_equal_torch(name, kwargs, message):
    with pytest.raises(ValueError) as ours:
        get_spec(name).factory(**_lr_arg(kwargs, "jax"))
    with pytest.raises(ValueError) as theirs:
        _torch_opt(name, [torch.zeros(1, requires_grad=True)], _lr_arg(kwargs, "torch"))
    assert str(ours.value) == str(theirs.value) == message


SETTABLE = [
    (n, k, m)
    for n, k, m in VALIDATION
    if "initial_accumulator_value" not in k and k.get("lr") != "two-element"
]


@pytest.mark.parametrize(("name", "kwargs", "message"), SETTABLE, ids=[f"{n}-{m}" for n, _, m in SETTABLE])
def test_set_hparams_validates_like_construction(name, kwargs, message):
    state = get_spec(name).factory(**RICH[name]).init({"w": jnp.zeros(2)})
    with pytest.raises(ValueError) as err:
        fo.set_hparams(state, **kwargs)
    assert str(err.value) == message
    assert float(fo.get_hparams(state)["lr"]) == RICH[name]["lr"]


@pytest.mark.parametrize(
    "kwargs",
    [{"fused": True, "differentiable": True}, {"fused": True, "foreach": True}],
    ids=["diff", "foreach"],
)
def test_adagrad_fused_conflicts_are_torch_errors(kwargs):
    with pytest.raises(RuntimeError) as ours:
        fo.adagrad(**kwargs)
    with pytest.raises(RuntimeError) as theirs:
        torch.optim.Adagrad([torch.zeros(1, requires_grad=True)], **kwargs)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("name", ALGOS)
def test_one_element_lr_array_is_squeezed_like_torch(name):
    params = {"w": jnp.array([1.0, -2.0])}
    grads = {"w": jnp.array([0.5, 0.25])}
    a = get_spec(name).factory(lr=jnp.array([0.05]))
    b = get_spec(name).factory(lr=0.05)
    pa, sa = fo.step(a, params, grads, a.init(params))
    pb, _ = fo.step(b, params, grads, b.init(params))
    assert fo.get_hparams(sa)["lr"].shape == ()
    np.testing.assert_array_equal(pa["w"], pb["w"])
    assert not np.array_equal(pa["w"], params["w"])


# --------------------------------------------------------------------------- differentiable

K = 5
W = np.array([0.5, 1.0, 2.0, -0.3])


def _grad_fn_np(p):
    return W * p + np.tanh(p)


def _jax_loss(name, config):
    tx = get_spec(name).factory(**config)
    w = jnp.asarray(W)

    def loss(p0, lr):
        params = {"p": p0}
        state = fo.set_hparams(tx.init(params), lr=lr)
        for _ in range(K):
            g = {"p": w * params["p"] + jnp.tanh(params["p"])}
            params, state = fo.step(tx, params, g, state)
        return jnp.sum(params["p"] ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def _torch_loss(name, config, p0, lr=None, requires_grad=True):
    p0 = torch.tensor(p0, requires_grad=requires_grad)
    p = p0.clone()
    opt = _torch_opt(name, [p], {**config, "differentiable": True} | ({"lr": lr} if lr is not None else {}))
    w = torch.tensor(W)
    for _ in range(K):
        p.grad = w * p + torch.tanh(p)
        opt.step()
        # an identity for values and gradients; it only keeps torch's in-place version
        # check from rejecting a graph over several steps (RMSprop's lerp_, Rprop's clamp_)
        state = opt.state[p]
        for k, v in list(state.items()):
            if torch.is_tensor(v) and k != "step":
                state[k] = v.clone()
    return p0, (p**2).sum()


DIFF = {
    "adagrad": {"lr": 0.1, "lr_decay": 0.05, "weight_decay": 0.1, "initial_accumulator_value": 0.5},
    "adadelta": {"lr": 0.5, "rho": 0.8, "weight_decay": 0.1},
    "rmsprop": {"lr": 0.01, "alpha": 0.9, "weight_decay": 0.1, "momentum": 0.9, "centered": True},
    "rprop": {"lr": 0.05},
    "asgd": {"lr": 0.05, "lambd": 0.1, "t0": 2.0, "weight_decay": 0.1},
}


@pytest.mark.parametrize("name", ALGOS)
def test_grad_through_steps_equals_torch_differentiable(name):
    config = DIFF[name]
    p0 = np.array([0.3, -1.2, 0.8, 2.0])
    g_p0, g_lr = _jax_loss(name, config)(jnp.asarray(p0), jnp.asarray(config["lr"]))
    # torch: autograd through step() with differentiable=True, w.r.t. the initial params
    leaf, loss = _torch_loss(name, config, p0)
    (ref_p0,) = torch.autograd.grad(loss, [leaf])
    assert rel_err(g_p0, ref_p0.numpy()) <= 1e-10
    assert np.abs(np.asarray(g_p0)).max() > 1e-3
    if name == "asgd":
        # torch reads eta with .item(): lr has no path into the params; neither here
        lr = torch.tensor(config["lr"], dtype=torch.float64, requires_grad=True)
        _, loss = _torch_loss(name, config, p0, lr=lr, requires_grad=False)
        assert loss.grad_fn is None and float(g_lr) == 0.0
        return
    # torch rejects a tensor lr in these steps (addcdiv_/add_/full_like need a number), so
    # the lr derivative is checked against central differences of torch's own steps
    with pytest.raises(TypeError):
        _torch_loss(name, config, p0, lr=torch.tensor(config["lr"], dtype=torch.float64, requires_grad=True))
    h = 1e-6 * config["lr"]
    hi = _torch_loss(name, {**config, "lr": config["lr"] + h}, p0, requires_grad=False)[1].item()
    lo = _torch_loss(name, {**config, "lr": config["lr"] - h}, p0, requires_grad=False)[1].item()
    fd = (hi - lo) / (2 * h)
    assert abs(float(g_lr) - fd) <= 1e-6 * max(1.0, abs(fd))
    assert abs(fd) > 1e-3


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_adadelta_divides_by_the_square_root(dtype):
    """``delta.div_(std)`` with ``std = square_avg.add(eps).sqrt_()``: XLA rewrote the
    division by a square root into a multiplication by ``rsqrt`` (an ulp off on some
    elements from the first step, ``eps=1e-3``). From zero state with ``lr=1`` (``-1 *
    delta`` exact) the first step is these IEEE operations, each rounded: NumPy's."""
    rng = np.random.default_rng(0)
    p, g = (rng.standard_normal(4096).astype(dtype) for _ in range(2))
    one_minus_rho, eps = dtype(1 - 0.9), dtype(1e-3)  # torch's Python scalars, cast
    tx = fo.adadelta(lr=1.0, rho=0.9, eps=1e-3)
    got, state = jax.jit(functools.partial(fo.step, tx))({"w": p}, {"w": g}, tx.init({"w": jnp.asarray(p)}))
    square_avg = (one_minus_rho * g) * g  # fma((1 - rho) * g, g, 0 * rho): one product, rounded
    delta = np.sqrt(dtype(0) + eps) / np.sqrt(square_avg + eps) * g
    np.testing.assert_array_equal(state.buffers["square_avg"]["w"], square_avg)
    np.testing.assert_array_equal(got["w"], p - delta)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32], ids=["f64", "f32"])
def test_no_rule_computes_a_reciprocal_square_root(dtype):
    """torch divides by square roots (and its CPU ``rsqrt_`` is ``1 / sqrt``); XLA's
    ``rsqrt`` is another rounding (float32: an approximation, 32% of its values off):
    no compiled step of a rule holds one (Adadelta's and Adafactor's did)."""
    params = {"w": jnp.ones((3, 4), dtype), "b": jnp.ones((4,), dtype)}
    for name in (
        "adadelta",
        "adafactor",
        "adagrad",
        "adam",
        "adamax",
        "nadam",
        "radam",
        "rmsprop",
        "rprop",
        "asgd",
    ):
        tx = getattr(fo, name)()
        hlo = (
            jax.jit(functools.partial(fo.step, tx)).lower(params, params, tx.init(params)).compile().as_text()
        )
        assert " rsqrt(" not in hlo, name
