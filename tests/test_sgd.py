"""SGD: parity with torch.optim.SGD and with NumPy reference formulas; torch's errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import functorch_optim as fo
from functorch_optim._base import changeable_hparams
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
)

STEPS = 30
GRID = get_spec("sgd").grid
NUMERIC = ("lr", "momentum", "dampening", "weight_decay")


def _cid(c):
    return "-".join(f"{k}={v}" for k, v in c.items())


@functools.cache
def _jitted(nesterov: bool, maximize: bool, has_momentum: bool, decays: bool, damped: bool):
    """One transformation and one jitted step per static combination; numbers are data
    (but whether momentum, weight_decay and dampening are 0 is compiled in:
    ``Algorithm.fixed_zero``)."""
    tx = fo.sgd(
        lr=0.1,
        momentum=0.9 if has_momentum else 0.0,
        weight_decay=0.5 if decays else 0.0,
        dampening=0.5 if damped else 0.0,
        nesterov=nesterov,
        maximize=maximize,
    )
    return tx, jax.jit(functools.partial(fo.step, tx))


def _run_ours(config, params, grads):
    flags = (config["momentum"] != 0, config["weight_decay"] != 0, config["dampening"] != 0)
    tx, step = _jitted(config["nesterov"], config["maximize"], *flags)
    params = to_jax(params)
    state = fo.set_hparams(tx.init(params), **{k: config[k] for k in NUMERIC})
    for g in grads:
        params, state = step(params, to_jax(g), state)
    return params, state


def _torch_buffers_like(ours_buffers, torch_buffers):
    """Compare only where torch has a buffer (a parameter never stepped has none)."""
    o = jax.tree.leaves(ours_buffers)
    t = jax.tree.leaves(torch_buffers, is_leaf=lambda x: x is None)
    pairs = [(a, b) for a, b in zip(o, t) if b is not None]
    return [a for a, _ in pairs], [b for _, b in pairs]


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("shape", list(TREE_SHAPES), ids=list(TREE_SHAPES))
def test_parity_with_torch_over_grid(shape, dtype):
    rng = np.random.default_rng(0)
    params = make_tree(TREE_SHAPES[shape], rng, dtype)
    grads = grad_stream(params, STEPS, seed=1, none_every=4, dtype=dtype)
    tol = 1e-12 if dtype == np.float64 else 1e-6
    worst = 0.0
    for config in GRID:
        ours, state = _run_ours(config, params, grads)
        ref, ref_buf = run_torch(
            lambda ps, c=config: torch.optim.SGD(ps, foreach=False, **c), params, grads, ["momentum_buffer"]
        )
        err = rel_err(ours, ref)
        if config["momentum"]:
            a, b = _torch_buffers_like(state.momentum_buffer, ref_buf["momentum_buffer"])
            err = max(err, rel_err(a, b))
        assert jax.tree.leaves(ours)[0].dtype == dtype
        assert err <= tol, f"{_cid(config)}: relative error {err:.3g}"
        worst = max(worst, err)
    # the comparison is not vacuous: parameters moved
    assert rel_err(ours, params) > 1e-3
    print(f"max relative error vs torch ({shape}, {np.dtype(dtype).name}): {worst:.3g}")


def _numpy_sgd(params, grads, lr, momentum, dampening, weight_decay, nesterov, maximize):
    """Independent float64 reference: torch's documented rule with per-parameter state."""

    def rule(p, g, s, t):
        g = -np.asarray(g, np.float64) if maximize else np.asarray(g, np.float64)
        if weight_decay:
            g = g + weight_decay * p
        if momentum:
            s["buf"] = g.copy() if "buf" not in s else momentum * s["buf"] + (1 - dampening) * g
            g = g + momentum * s["buf"] if nesterov else s["buf"]
        return p - lr * g

    return numpy_per_leaf(params, grads, rule)[0]


@pytest.mark.parametrize("config", GRID[::3], ids=_cid)
def test_matches_numpy_reference(config):
    rng = np.random.default_rng(3)
    params = make_tree(TREE_SHAPES["nested"], rng)
    grads = grad_stream(params, STEPS, seed=4, none_every=3)
    ours, _ = _run_ours(config, params, grads)
    assert rel_err(ours, _numpy_sgd(params, grads, **config)) <= 1e-12


def test_first_gradient_seeds_buffer_without_dampening_even_when_late():
    params = {"a": jnp.array([1.0]), "b": jnp.array([1.0])}
    tx = fo.sgd(lr=0.1, momentum=0.9, dampening=0.5)
    state = tx.init(params)
    one = jnp.array([1.0])
    params, state = fo.step(tx, params, {"a": one, "b": None}, state)
    params, state = fo.step(tx, params, {"a": one, "b": one}, state)
    # "a": 0.9 * 1 + 0.5 * 1; "b" got its first gradient on step 2: the raw gradient
    np.testing.assert_array_equal(state.momentum_buffer["a"], [1.4])
    np.testing.assert_array_equal(state.momentum_buffer["b"], [1.0])
    assert state.step["a"] == 2 and state.step["b"] == 1


def test_none_gradient_leaves_parameter_and_state_bitwise_unchanged():
    params = {"a": jnp.array([-0.0, 1.5]), "b": jnp.array([2.0, 3.0])}
    tx = fo.sgd(lr=0.1, momentum=0.9, weight_decay=0.1)
    state = tx.init(params)
    state = fo.step(tx, params, {"a": jnp.ones(2), "b": jnp.ones(2)}, state)[1]
    new, new_state = jax.jit(functools.partial(fo.step, tx))(params, {"a": None, "b": jnp.ones(2)}, state)
    assert new["a"].tobytes() == params["a"].tobytes()
    assert new_state.momentum_buffer["a"].tobytes() == state.momentum_buffer["a"].tobytes()
    assert new_state.step["a"] == state.step["a"] == 1
    assert not np.array_equal(new["b"], params["b"])
    updates, _ = tx.update({"a": None, "b": jnp.ones(2)}, state, params)
    assert updates["a"] is None and updates["b"].shape == (2,)


def test_momentum_zero_keeps_no_buffer():
    # no momentum buffer and no step counters: nothing reads them (torch's SGD keeps no
    # state without momentum), and each would be an array in and out of every step
    tx = fo.sgd(lr=0.1)
    one, three = {"w": jnp.zeros(3)}, {"w": jnp.zeros(3), "b": jnp.zeros(()), "v": jnp.ones(2)}
    state = tx.init(three)
    assert state.buffers == {}
    assert len(jax.tree.leaves(state)) == len(jax.tree.leaves(tx.init(one)))
    new, new_state = jax.jit(functools.partial(fo.step, tx))(three, three, state)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    assert new["v"].tolist() == [0.9, 0.9] and int(new_state.count) == 1
    with pytest.raises(ValueError, match="built with momentum=0"):
        fo.set_hparams(state, momentum=0.9)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float64], ids=str)
def test_dtypes_and_state_keep_param_dtype(dtype):
    rng = np.random.default_rng(5)
    params = {"w": jnp.asarray(rng.standard_normal((4, 3)), dtype), "s": jnp.asarray(0.5, dtype)}
    tx = fo.sgd(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)
    state = tx.init(params)
    grads = [
        jax.tree.map(lambda p, i=i: jnp.asarray(rng.standard_normal(p.shape), dtype), params)
        for i in range(10)
    ]
    ours = params
    for g in grads:
        ours, state = fo.step(tx, ours, g, state)
    assert {x.dtype for x in jax.tree.leaves((ours, state.momentum_buffer))} == {jnp.dtype(dtype)}
    tdtype = {jnp.bfloat16: torch.bfloat16, jnp.float32: torch.float32, jnp.float64: torch.float64}[dtype]
    leaves, treedef = jax.tree.flatten(params)
    ts = [torch.tensor(np.asarray(p, np.float64)).to(tdtype).requires_grad_() for p in leaves]
    opt = torch.optim.SGD(ts, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01, foreach=False)
    for g in grads:
        for t, gl in zip(ts, treedef.flatten_up_to(g)):
            t.grad = torch.tensor(np.asarray(gl, np.float64)).to(tdtype)
        opt.step()
    ref = [t.detach().to(torch.float64).numpy() for t in ts]
    # bfloat16 rounds every torch op: allow two bf16 ulps (2**-7 relative); others near-exact
    tol = {jnp.bfloat16: 2 * 2.0**-7, jnp.float32: 1e-6, jnp.float64: 1e-12}[dtype]
    assert rel_err(jax.tree.leaves(ours), ref) <= tol


# (kwargs, torch's message): each row is checked against torch itself too.
ERRORS = [
    ({"lr": -1.0}, "Invalid learning rate: -1.0"),
    ({"lr": -0.5, "momentum": 0.9}, "Invalid learning rate: -0.5"),
    ({"momentum": -0.1}, "Invalid momentum value: -0.1"),
    ({"weight_decay": -1e-3}, "Invalid weight_decay value: -0.001"),
    ({"nesterov": True}, "Nesterov momentum requires a momentum and zero dampening"),
    (
        {"nesterov": True, "momentum": 0.9, "dampening": 0.1},
        "Nesterov momentum requires a momentum and zero dampening",
    ),
]


@pytest.mark.parametrize(("kwargs", "message"), ERRORS, ids=[m for _, m in ERRORS])
def test_validation_messages_equal_torch(kwargs, message):
    with pytest.raises(ValueError) as ours:
        fo.sgd(**kwargs)
    with pytest.raises(ValueError) as theirs:
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], **kwargs)
    assert str(ours.value) == str(theirs.value) == message


@pytest.mark.parametrize(("kwargs", "message"), ERRORS[:4], ids=[m for _, m in ERRORS[:4]])
def test_set_hparams_validates_like_construction(kwargs, message):
    state = fo.sgd(lr=0.1, momentum=0.5).init({"w": jnp.zeros(2)})
    with pytest.raises(ValueError) as err:
        fo.set_hparams(state, **{k: v for k, v in kwargs.items() if k != "nesterov"})
    assert str(err.value) == message
    assert float(fo.get_hparams(state)["lr"]) == 0.1


def test_nesterov_checked_by_set_hparams():
    state = fo.sgd(lr=0.1, momentum=0.9, nesterov=True).init({"w": jnp.zeros(2)})
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero dampening"):
        fo.set_hparams(state, dampening=0.5)


def test_empty_params_torch_error_in_facade_empty_tree_in_functional_api():
    # torch raises in its constructor (the facade's); optax's transformations, which the
    # functional API follows, accept a tree without parameters (an empty group or label)
    with pytest.raises(ValueError, match=r"^optimizer got an empty parameter list$"):
        fo.optim.SGD({})
    with pytest.raises(ValueError, match="optimizer got an empty parameter list"):
        torch.optim.SGD([])
    tx = fo.sgd(lr=0.1, momentum=0.9)
    params, state = fo.step(tx, {}, {}, tx.init({}))
    assert params == {} and int(state.count) == 1


def test_non_float_parameter_named_by_path():
    with pytest.raises(ValueError, match=r"parameter at \['b'\]\[0\] has dtype int32"):
        fo.sgd().init({"a": jnp.zeros(2), "b": [jnp.zeros(2, jnp.int32)]})


@pytest.mark.parametrize(
    ("grads", "message"),
    [
        ({"a": jnp.zeros(2)}, r"grads lack the parameter at \['b'\]"),
        ({"a": jnp.zeros(2), "c": jnp.zeros(2)}, r"params have \['b'\] where grads have \['c'\]"),
        ({"a": jnp.zeros(2), "b": jnp.zeros(3)}, r"grads at \['b'\] has shape \(3,\)"),
    ],
    ids=["missing", "renamed", "shape"],
)
def test_grad_structure_mismatch_names_first_path(grads, message):
    tx = fo.sgd(lr=0.1, momentum=0.9)
    params = {"a": jnp.ones(2), "b": jnp.ones(2)}
    state = tx.init(params)
    with pytest.raises(ValueError, match=message):
        fo.step(tx, params, grads, state)
    with pytest.raises(ValueError, match=message):
        jax.jit(functools.partial(fo.step, tx))(params, grads, state)


@pytest.mark.parametrize("fused", [False, True], ids=["jit", "fused"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_buffer_created_on_first_step_with_momentum_like_torch(fused, dtype):
    # torch seeds the buffer with the raw gradient when it creates it (the first step
    # with momentum != 0), not on a parameter's first step: momentum 0 on step 1, then
    # 0.9, and a parameter ("b") whose first gradient comes while momentum is 0
    rng = np.random.default_rng(3)
    params = {"a": rng.standard_normal(4).astype(dtype), "b": rng.standard_normal(3).astype(dtype)}
    grads = grad_stream(params, 6, seed=4, dtype=dtype)
    grads[3]["b"] = None
    momenta = [0.0, 0.9, 0.0, 0.9, 0.9, 0.0]
    tensors = [torch.tensor(params[k]) for k in ("a", "b")]
    opt = torch.optim.SGD(tensors, lr=0.1, momentum=0.9, dampening=0.5, foreach=False)
    # momentum moves across 0 at run time: the changeable build (the facade's, on such a
    # param_groups edit), since a nonzero number is compiled in (Algorithm.fixed_nonzero)
    with changeable_hparams():
        tx = fo.sgd(lr=0.1, momentum=0.9, dampening=0.5, fused=fused)
    ours = to_jax(params)
    state = tx.init(ours)
    step = jax.jit(functools.partial(fo.step, tx))
    tol = 1e-6 if dtype == np.float32 else 1e-14
    for t, (m, g) in enumerate(zip(momenta, grads)):
        if t == 1:
            # "b" gets its first gradient only now, "a" had one while momentum was 0
            g = {"a": g["a"], "b": None}
        opt.param_groups[0]["momentum"] = m
        for tensor, k in zip(tensors, ("a", "b")):
            tensor.grad = None if g[k] is None else torch.tensor(g[k])
        opt.step()
        state = fo.set_hparams(state, momentum=m)
        ours, state = step(ours, to_jax(g), state)
        for tensor, k in zip(tensors, ("a", "b")):
            np.testing.assert_allclose(ours[k], tensor.detach().numpy(), rtol=tol)
            ref = opt.state[tensor].get("momentum_buffer")
            if ref is not None:
                np.testing.assert_allclose(state.momentum_buffer[k], ref.numpy(), rtol=tol)
            assert (int(state.step[k]) > 0) == (ref is not None)


@pytest.mark.parametrize("fused", [None, False], ids=["default", "rule"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize(
    "config",
    [
        dict(lr=0.01, momentum=0.9),
        dict(lr=0.01, momentum=0.9, dampening=0.1, weight_decay=0.01),
        dict(lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.01),
    ],
    ids=["momentum", "dampening-decay", "nesterov-decay"],
)
def test_momentum_equals_torch_bit_for_bit(config, dtype, fused):
    # buf.mul_(momentum) is stored, then add_(grad, alpha=1 - dampening) is one FMA, as in
    # torch's CPU kernels; left to XLA, buf * momentum was the product contracted into
    # the add (and the gradient's rounded): about 40% of the elements an ulp or more off
    # after 30 steps. "k" has rows of 7 (XLA's loop vectorizes across them)
    rng = np.random.default_rng(5)
    params = {"b": rng.standard_normal(4099).astype(dtype), "k": rng.standard_normal((37, 7)).astype(dtype)}
    grads = [{k: rng.standard_normal(v.shape).astype(dtype) for k, v in params.items()} for _ in range(30)]
    make_torch = lambda ts: torch.optim.SGD(ts, foreach=False, **config)
    ref, ref_buffers = run_torch(make_torch, params, grads, ["momentum_buffer"])
    mine, state = run_jitted(fo.sgd(**config, fused=fused), params, grads)
    assert_bitwise_equal((mine, state.momentum_buffer), (ref, ref_buffers["momentum_buffer"]))
