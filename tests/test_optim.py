"""The torch.optim-shaped facade (functorch_optim.optim): loops, param groups, state dicts.

Parity is against real torch (foreach=False): the seed experiment on gradient
accumulation, a small MLP training loop, state-dict resumption in both directions, and
the error table; plus compile counting and checkpoint round trips.
"""

from __future__ import annotations

import copy
import inspect
import os
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import functorch_optim as fo
from functorch_optim._base import Algorithm, make_optimizer
from functorch_optim.interop.torch import flatten_names
from functorch_optim.optim import SGD, Optimizer, group_by, make_optimizer_class, state_dict_to_torch
from functorch_optim.optim._optimizer import _BACKWARD, _STEP
from tests.helpers import CompileCounter, rel_err

# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------


def leaves_np(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def snapshot(opt):
    """Everything a failed call must leave untouched, as host copies."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return (
        [np.array(x) for x in jax.tree.leaves(opt.params)],
        [np.array(x) for x in jax.tree.leaves(opt.state)],
        groups,
    )


def assert_same_snapshot(a, b):
    for x, y in zip(a[0] + a[1], b[0] + b[1], strict=True):
        np.testing.assert_array_equal(x, y)
    assert a[2] == b[2]


def torch_tensors(tree, dtype=None):
    out = []
    for leaf in jax.tree.leaves(tree):
        t = torch.tensor(np.array(leaf, dtype=dtype) if dtype else np.array(leaf))
        t.requires_grad_(True)
        out.append(t)
    return out


# ---------------------------------------------------------------------------------------
# signature and construction
# ---------------------------------------------------------------------------------------


def test_sgd_signature_is_torchs():
    ours = inspect.signature(SGD).parameters
    theirs = inspect.signature(torch.optim.SGD).parameters
    assert list(ours) == list(theirs)
    for name, p in theirs.items():
        assert ours[name].kind == p.kind, name
        if p.default is not inspect.Parameter.empty:
            assert ours[name].default == p.default, name
    assert SGD.__name__ == "SGD" and issubclass(SGD, Optimizer)


@pytest.mark.parametrize(
    "flags", [{"foreach": True, "differentiable": True}, {"fused": True}], ids=["torch-only", "fused"]
)
def test_implementation_flags_do_not_change_the_numbers(flags):
    params = {"w": jnp.array([1.0, -2.0])}
    grads = {"w": jnp.array([0.5, 0.25])}
    plain = SGD(params, lr=0.1, momentum=0.9)
    flagged = SGD(params, lr=0.1, momentum=0.9, **flags)
    for opt in (plain, flagged):
        opt.grad = grads
        opt.step()
    assert all(flagged.param_groups[0][k] is True for k in flags)
    np.testing.assert_array_equal(plain.params["w"], flagged.params["w"])
    np.testing.assert_array_equal(plain.params["w"], [1.0 - 0.05, -2.0 - 0.025])
    if "fused" not in flags:
        return
    # fused is a real switch: editing it in param_groups rebuilds the group's step
    flagged.param_groups[0]["fused"] = False
    for opt in (plain, flagged):
        opt.grad = grads
        opt.step()
    np.testing.assert_array_equal(plain.params["w"], flagged.params["w"])


@pytest.mark.parametrize("form", ["tree", "torch-groups", "group_by"])
def test_params_come_back_in_the_users_structure(form):
    tree = {"enc": {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}, "head": [jnp.full((3,), 2.0)]}
    if form == "tree":
        given, expect = tree, tree
    elif form == "torch-groups":
        given = [{"params": tree["enc"]}, {"params": tree["head"], "lr": 0.5}]
        expect = [tree["enc"], tree["head"]]
    else:
        given, expect = group_by(tree, {"where": r"^head\.", "lr": 0.5}), tree
    opt = SGD(given, lr=0.1)
    assert jax.tree.structure(opt.params) == jax.tree.structure(expect)
    assert jax.tree.structure(opt.grad, is_leaf=lambda x: x is None) == jax.tree.structure(
        jax.tree.map(lambda _: None, expect), is_leaf=lambda x: x is None
    )
    assert all(g is None for g in jax.tree.leaves(opt.grad, is_leaf=lambda x: x is None))
    opt.grad = jax.tree.map(jnp.ones_like, expect)
    opt.step()
    lrs = [0.1] if form == "tree" else [0.1, 0.5]
    head_lr = lrs[-1]
    got = opt.params[1][0] if form == "torch-groups" else opt.params["head"][0]
    np.testing.assert_allclose(got, 2.0 - head_lr, rtol=0, atol=1e-15)
    enc_w = opt.params[0]["w"] if form == "torch-groups" else opt.params["enc"]["w"]
    np.testing.assert_allclose(enc_w, 1.0 - 0.1, rtol=0, atol=1e-15)
    # the user's arrays were copied, not donated
    assert float(tree["head"][0][0]) == 2.0


def test_group_by_predicate_no_weight_decay_for_biases_and_norms():
    tree = {
        "dense": {"kernel": jnp.full((2, 2), 1.0), "bias": jnp.full((2,), 1.0)},
        "norm": {"scale": jnp.full((2,), 1.0)},
    }

    def no_decay(path, leaf):
        return leaf.ndim == 1

    opt = SGD(group_by(tree, {"where": no_decay, "weight_decay": 0.0}), lr=0.1, weight_decay=0.5)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.5]
    assert opt.state_dict()["param_groups"][0]["params"] == [0, 1]  # bias, norm.scale
    opt.grad = jax.tree.map(jnp.zeros_like, tree)
    opt.step()
    np.testing.assert_array_equal(opt.params["dense"]["bias"], [1.0, 1.0])
    np.testing.assert_array_equal(opt.params["norm"]["scale"], [1.0, 1.0])
    np.testing.assert_allclose(opt.params["dense"]["kernel"], 1.0 - 0.1 * 0.5, rtol=0, atol=1e-15)


# ---------------------------------------------------------------------------------------
# the seed experiment: gradients accumulate without zero_grad (a + c = b), as in torch
# ---------------------------------------------------------------------------------------

INPUT_1 = [-0.4507, 1.5306, 1.6414, -1.4976, -0.4955, 0.8670, 1.7535, 0.6661, -1.1307, 0.6601]
INPUT_2 = [-0.7951, 1.0476, 0.3908, 1.0368, -0.4870, 0.2596, 0.2631, 0.6549, -0.9619, -0.1810]
TARGET = [-0.4159]


def linear_mse(params, x, y):
    out = params["weight"] @ x + params["bias"]
    return jnp.mean((out - y) ** 2)


def test_seed_experiment_accumulation_matches_torch():
    torch.manual_seed(0)
    net1 = torch.nn.Linear(10, 1)
    net2 = torch.nn.Linear(10, 1)
    net2.load_state_dict(net1.state_dict())
    params = {"weight": net1.weight.detach().numpy().copy(), "bias": net1.bias.detach().numpy().copy()}
    x1, x2, y = (np.array(v, np.float32) for v in (INPUT_1, INPUT_2, TARGET))

    t_opt1 = torch.optim.SGD(net1.parameters(), lr=0.01, foreach=False)
    t_opt2 = torch.optim.SGD(net2.parameters(), lr=0.01, foreach=False)
    torch_grads = {}
    # network 1 never zeroes its gradients
    torch.nn.functional.mse_loss(net1(torch.tensor(x1)), torch.tensor(y)).backward()
    torch_grads["a"] = net1.weight.grad.numpy().copy()
    t_opt1.step()
    torch.nn.functional.mse_loss(net1(torch.tensor(x2)), torch.tensor(y)).backward()
    torch_grads["b"] = net1.weight.grad.numpy().copy()
    t_opt1.step()
    # network 2 zeroes them before each backward
    for x in (x1, x2):
        t_opt2.zero_grad()
        torch.nn.functional.mse_loss(net2(torch.tensor(x)), torch.tensor(y)).backward()
        torch_grads["c"] = net2.weight.grad.numpy().copy()
        t_opt2.step()

    opt1 = SGD(params, lr=0.01)
    opt2 = SGD(params, lr=0.01)
    opt1.backward(linear_mse, x1, y)
    a = np.asarray(opt1.grad["weight"])
    opt1.step()
    opt1.backward(linear_mse, x2, y)
    b = np.asarray(opt1.grad["weight"])
    opt1.step()
    opt2.zero_grad()
    opt2.backward(linear_mse, x1, y)
    np.testing.assert_array_equal(opt2.grad["weight"], a)
    opt2.step()
    opt2.zero_grad()
    opt2.backward(linear_mse, x2, y)
    c = np.asarray(opt2.grad["weight"])
    opt2.step()

    assert a.dtype == np.float32
    # the accumulated gradient is the sum; XLA fuses the addition into the gradient
    # computation (contracting to FMA), so equality holds to float32 rounding, not bitwise
    np.testing.assert_allclose(b, a + c, rtol=3e-7, atol=0)
    assert not np.allclose(b, c)  # and differs from the fresh one
    for name, ours in (("a", a), ("b", b), ("c", c)):
        np.testing.assert_allclose(ours, torch_grads[name], rtol=2e-6, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(opt1.params["weight"], net1.weight.detach().numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(opt2.params["bias"], net2.bias.detach().numpy(), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------
# porting a PyTorch training loop: MLP, SGD momentum, two groups, lr change mid-run
# ---------------------------------------------------------------------------------------


def mlp_loss(params, x, y):
    (w1, b1), (w2, b2) = params_pairs(params)
    h = jnp.tanh(x @ w1.T + b1[None, :])
    out = h @ w2.T + b2[None, :]
    return jnp.mean((out - y) ** 2)


def params_pairs(params):
    if isinstance(params, list):  # torch groups: [weights, biases]
        (w1, w2), (b1, b2) = params
    else:
        w1, b1, w2, b2 = (
            params["l1"]["weight"],
            params["l1"]["bias"],
            params["l2"]["weight"],
            params["l2"]["bias"],
        )
    return (w1, b1), (w2, b2)


@pytest.mark.parametrize("form", ["torch-groups", "group_by"])
def test_mlp_training_loop_matches_torch(form):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((30, 16, 4))
    ys = np.tanh(xs @ rng.standard_normal((4, 3)))  # a learnable target
    w1, b1, w2, b2 = (p.detach().numpy().copy() for p in model.parameters())

    weights = [model[0].weight, model[2].weight]
    biases = [model[0].bias, model[2].bias]
    t_opt = torch.optim.SGD(
        [{"params": weights}, {"params": biases, "lr": 0.05, "weight_decay": 0.0}],
        lr=0.1,
        momentum=0.9,
        dampening=0.1,
        weight_decay=1e-3,
        foreach=False,
    )
    if form == "torch-groups":
        given = [{"params": [w1, w2]}, {"params": [b1, b2], "lr": 0.05, "weight_decay": 0.0}]
    else:
        tree = {"l1": {"weight": w1, "bias": b1}, "l2": {"weight": w2, "bias": b2}}
        given = group_by(tree, {"where": r"bias$", "lr": 0.05, "weight_decay": 0.0})
    opt = SGD(given, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-3)
    bias_group = 1 if form == "torch-groups" else 0
    weight_group = 1 - bias_group

    torch_losses, losses = [], []
    for t in range(30):
        if t == 15:  # the lr change mid-run, on both sides
            t_opt.param_groups[0]["lr"] = 0.02
            opt.param_groups[weight_group]["lr"] = 0.02
        t_opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(torch.tensor(xs[t])), torch.tensor(ys[t]))
        loss.backward()
        t_opt.step()
        torch_losses.append(loss.item())

        opt.zero_grad()
        losses.append(float(opt.backward(mlp_loss, xs[t], ys[t])))
        opt.step()

    np.testing.assert_allclose(losses, torch_losses, rtol=1e-10, atol=0)
    assert losses[-1] < losses[0]
    (jw1, jb1), (jw2, jb2) = params_pairs(opt.params)
    ours = [jw1, jb1, jw2, jb2]
    theirs = [p.detach().numpy() for p in model.parameters()]
    assert rel_err(ours, theirs) <= 1e-10


# ---------------------------------------------------------------------------------------
# state_dict: torch -> JAX and JAX -> torch resumption
# ---------------------------------------------------------------------------------------

SD_TREE = {"enc": {"w": (3, 4), "b": (4,)}, "scale": ()}
SD_GROUP_KW = [
    {"lr": 0.1, "momentum": 0.9, "dampening": 0.2, "weight_decay": 0.01},
    {"lr": 0.05, "momentum": 0.5, "nesterov": True, "weight_decay": 0.0},
]


def sd_setup(dtype=np.float64):
    rng = np.random.default_rng(3)
    tree = jax.tree.map(
        lambda s: rng.standard_normal(s).astype(dtype),
        SD_TREE,
        is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x),
    )
    groups = [tree["enc"], {"scale": tree["scale"]}]
    stream = []
    for t in range(40):
        g_enc = jax.tree.map(lambda p: rng.standard_normal(np.shape(p)).astype(dtype), tree["enc"])
        if t % 4 == 1:
            g_enc["b"] = None  # skipped steps
        # "scale" receives its first gradient only at step 25: no state before that
        g_scale = {"scale": None if t < 25 else np.asarray(rng.standard_normal(), dtype)}
        stream.append([g_enc, g_scale])
    return groups, stream


def torch_run(groups_np, stream, start_sd=None):
    # built from named tensors, as from model.named_parameters(): torch's groups carry param_names
    tensors = [torch_tensors(g) for g in groups_np]
    named = [list(zip(flatten_names(g), ts, strict=True)) for g, ts in zip(groups_np, tensors, strict=True)]
    t_opt = torch.optim.SGD(
        [{"params": nts, **kw} for nts, kw in zip(named, SD_GROUP_KW, strict=True)], foreach=False
    )
    if start_sd is not None:
        t_opt.load_state_dict(start_sd)
    for grads in stream:
        for ts, g in zip(tensors, grads, strict=True):
            for t, gl in zip(ts, jax.tree.leaves(g, is_leaf=lambda x: x is None), strict=True):
                t.grad = None if gl is None else torch.tensor(np.asarray(gl))
        t_opt.step()
    return tensors, t_opt


def jax_groups(groups_np):
    return [{"params": g, **kw} for g, kw in zip(groups_np, SD_GROUP_KW, strict=True)]


@pytest.mark.parametrize(("dtype", "tol"), [(np.float64, 1e-12), (np.float32, 1e-6)], ids=["f64", "f32"])
def test_state_dict_torch_to_jax_resume(dtype, tol):
    groups, stream = sd_setup(dtype)
    ref_tensors, ref_opt = torch_run(groups, stream)
    half_tensors, half_opt = torch_run(groups, stream[:20])
    torch_sd = half_opt.state_dict()
    assert 2 not in torch_sd["state"]  # "scale" never stepped yet
    resumed = [
        jax.tree.unflatten(jax.tree.structure(g), [t.detach().numpy().copy() for t in ts])
        for g, ts in zip(groups, half_tensors, strict=True)
    ]
    opt = SGD(jax_groups(resumed), foreach=False)
    opt.load_state_dict(torch_sd)
    assert opt.param_groups[0]["dampening"] == 0.2
    for grads in stream[20:]:
        opt.grad = grads
        opt.step()
    ours = jax.tree.leaves(opt.params)
    theirs = [t.detach().numpy() for ts in ref_tensors for t in ts]
    assert all(x.dtype == dtype for x in ours)
    assert rel_err(ours, theirs) <= tol
    sd = opt.state_dict()
    ref_sd = ref_opt.state_dict()
    assert sorted(sd["state"]) == sorted(ref_sd["state"])
    for k, entry in ref_sd["state"].items():
        assert sorted(sd["state"][k]) == sorted(entry)
        assert rel_err(sd["state"][k]["momentum_buffer"], entry["momentum_buffer"].numpy()) <= tol
    assert sd["param_groups"] == ref_sd["param_groups"]


def test_state_dict_jax_to_torch_resume():
    groups, stream = sd_setup()
    ref = SGD(jax_groups(groups), foreach=False)
    half = SGD(jax_groups(groups), foreach=False)
    for t, grads in enumerate(stream):
        ref.grad = grads
        ref.step()
        if t < 20:
            half.grad = grads
            half.step()
    sd = half.state_dict()
    _, torch_half = torch_run(groups, stream[:20])
    torch_sd = torch_half.state_dict()
    # our layout is torch's: same ids, same entries, same group dicts
    assert sorted(sd["state"]) == sorted(torch_sd["state"]) == [0, 1]
    assert sd["param_groups"] == torch_sd["param_groups"]
    pickled = pickle.loads(pickle.dumps(sd))
    assert pickled["param_groups"] == sd["param_groups"]
    tensors, t_opt = torch_run(half.params, stream[20:], start_sd=state_dict_to_torch(pickled))
    ours = jax.tree.leaves(ref.params)
    theirs = [t.detach().numpy() for ts in tensors for t in ts]
    assert rel_err(theirs, ours) <= 1e-12
    buf = t_opt.state_dict()["state"][2]["momentum_buffer"].numpy()
    assert rel_err(buf, ref.state_dict()["state"][2]["momentum_buffer"]) <= 1e-12


# ---------------------------------------------------------------------------------------
# torch's `step` in the state: a test-only Adam-like algorithm exercises the generic path
# ---------------------------------------------------------------------------------------


def _adam_validate(hp, static):
    if hp["lr"] < 0.0:
        raise ValueError(f"Invalid learning rate: {hp['lr']}")


def _adam_init(param, static):
    return {"exp_avg": jnp.zeros_like(param), "exp_avg_sq": jnp.zeros_like(param)}


def _adam_step(param, grad, buffers, step, hp, static):
    beta1, beta2 = hp["betas"]
    m = buffers["exp_avg"] + (1 - beta1) * (grad - buffers["exp_avg"])  # torch's lerp_
    v = buffers["exp_avg_sq"] * beta2 + (1 - beta2) * grad * grad
    t = step.astype(param.dtype)
    step_size = hp["lr"] / (1 - beta1**t)
    denom = jnp.sqrt(v) / jnp.sqrt(1 - beta2**t) + hp["eps"]
    return param - step_size * (m / denom), {"exp_avg": m, "exp_avg_sq": v}


_ADAM_LIKE = Algorithm(name="Adam", validate=_adam_validate, init_leaf=_adam_init, step_leaf=_adam_step)


def adam_like(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, *, foreach=None):
    return make_optimizer(_ADAM_LIKE, {"lr": lr, "betas": tuple(betas), "eps": eps}, {})


AdamLike = make_optimizer_class(adam_like)


def test_adam_like_step_state_round_trips_with_torch_adam():
    assert AdamLike.__name__ == "Adam"
    rng = np.random.default_rng(5)
    params = [rng.standard_normal((3, 2)), rng.standard_normal(4)]
    stream = [[rng.standard_normal((3, 2)), None if t < 3 else rng.standard_normal(4)] for t in range(12)]
    ts = torch_tensors(params)
    t_opt = torch.optim.Adam(ts, lr=0.01, foreach=False)
    for t, grads in enumerate(stream):
        for tt, g in zip(ts, grads, strict=True):
            tt.grad = None if g is None else torch.tensor(g)
        t_opt.step()
        if t == 5:
            torch_sd = copy.deepcopy(t_opt.state_dict())  # torch's holds live tensors
            mid = [tt.detach().numpy().copy() for tt in ts]
    assert torch_sd["state"][0]["step"].dtype == torch.float32
    opt = AdamLike(mid, lr=0.01, foreach=False)
    opt.load_state_dict(torch_sd)
    assert [int(s) for s in jax.tree.leaves(opt.state.buffers["step"])] == [6, 3]
    for grads in stream[6:]:
        opt.grad = grads
        opt.step()
    assert rel_err(opt.params, [tt.detach().numpy() for tt in ts]) <= 1e-12
    sd = opt.state_dict()
    ref = t_opt.state_dict()
    assert sorted(sd["state"][1]) == sorted(ref["state"][1]) == ["exp_avg", "exp_avg_sq", "step"]
    assert sd["state"][0]["step"].dtype == torch.float32 and float(sd["state"][0]["step"]) == 12.0
    back = torch.optim.Adam(torch_tensors(params), lr=0.5, foreach=False)
    back.load_state_dict(sd)  # torch tensors already: no conversion
    assert back.param_groups[0]["lr"] == 0.01
    assert back.state_dict()["state"][1]["step"].item() == 9.0
    # never stepped -> no entry, like torch's lazy state
    fresh = AdamLike(params, lr=0.01)
    fresh.grad = [np.ones((3, 2)), None]
    fresh.step()
    assert sorted(fresh.state_dict()["state"]) == [0]


# ---------------------------------------------------------------------------------------
# grads: zero_grad, None skipping, set_to_none=False, step(closure)
# ---------------------------------------------------------------------------------------


def quad(params, x):
    return jnp.sum((params["w"] - x) ** 2) + jnp.sum(params["b"] ** 2)


def test_zero_grad_then_step_changes_nothing():
    opt = SGD({"w": jnp.array([1.0, 2.0]), "b": jnp.array([0.5])}, lr=0.1, momentum=0.9, weight_decay=0.1)
    opt.backward(quad, jnp.array([0.0, 0.0]))
    opt.step()
    before = snapshot(opt)
    opt.zero_grad()
    assert all(g is None for g in jax.tree.leaves(opt.grad, is_leaf=lambda x: x is None))
    opt.step()
    assert_same_snapshot(before, snapshot(opt))


def test_zero_grad_set_to_none_false_still_moves_like_torch():
    w0, b0 = np.array([1.0, 2.0]), np.array([0.5])
    opt = SGD({"w": w0, "b": b0}, lr=0.1, momentum=0.9, weight_decay=0.1)
    tw, tb = torch_tensors([w0, b0])
    t_opt = torch.optim.SGD([tw, tb], lr=0.1, momentum=0.9, weight_decay=0.1, foreach=False)
    x = np.array([0.3, -0.2])
    opt.backward(quad, x)
    opt.step()
    (((tw - torch.tensor(x)) ** 2).sum() + (tb**2).sum()).backward()
    t_opt.step()
    opt.zero_grad(set_to_none=False)
    t_opt.zero_grad(set_to_none=False)
    np.testing.assert_array_equal(opt.grad["w"], [0.0, 0.0])
    before = np.asarray(opt.params["w"]).copy()
    opt.step()
    t_opt.step()
    assert not np.array_equal(before, opt.params["w"])
    np.testing.assert_allclose(opt.params["w"], tw.detach().numpy(), rtol=1e-14)
    np.testing.assert_allclose(opt.params["b"], tb.detach().numpy(), rtol=1e-14)


def test_none_grad_skips_parameter_and_its_state():
    opt = SGD({"w": jnp.array([1.0, 2.0]), "b": jnp.array([0.5])}, lr=0.1, momentum=0.9)
    opt.grad = {"w": jnp.array([1.0, 1.0]), "b": None}
    opt.step()
    np.testing.assert_array_equal(opt.params["b"], [0.5])
    np.testing.assert_allclose(opt.params["w"], [0.9, 1.9], rtol=1e-15)
    sd = opt.state_dict()
    assert list(sd["state"]) == [1]  # leaves order: b (id 0) has no state, w (id 1) has
    np.testing.assert_array_equal(sd["state"][1]["momentum_buffer"], [1.0, 1.0])


def test_step_returns_the_closures_loss():
    opt = SGD({"w": jnp.array([1.0, 2.0]), "b": jnp.array([0.5])}, lr=0.1)
    x = jnp.array([0.0, 1.0])

    def closure():
        opt.zero_grad()
        return opt.backward(quad, x)

    loss = opt.step(closure)
    assert float(loss) == pytest.approx(1.0 + 1.0 + 0.25, abs=1e-15)
    np.testing.assert_allclose(opt.params["w"], [1.0 - 0.2, 2.0 - 0.2], rtol=1e-15)
    np.testing.assert_allclose(opt.params["b"], [0.5 - 0.1], rtol=1e-15)
    assert opt.step() is None


def test_backward_adds_into_a_written_grad_and_kwargs_pass_through():
    opt = SGD({"w": jnp.array([1.0, 2.0]), "b": jnp.array([0.5])}, lr=0.1)
    opt.grad = {"w": np.array([10.0, 20.0]), "b": None}

    def loss_fn(params, x, *, scale):
        return scale * quad(params, x)

    loss = opt.backward(loss_fn, jnp.array([0.0, 0.0]), scale=2.0)
    assert float(loss) == pytest.approx(2.0 * (1.0 + 4.0 + 0.25), abs=1e-14)
    np.testing.assert_allclose(opt.grad["w"], [10.0 + 4.0, 20.0 + 8.0], rtol=1e-15)
    np.testing.assert_allclose(opt.grad["b"], [2.0], rtol=1e-15)


# ---------------------------------------------------------------------------------------
# param_groups: assignments take effect without recompiling
# ---------------------------------------------------------------------------------------


def test_momentum_set_from_zero_through_param_groups_matches_torch():
    # torch lets param_groups turn SGD's momentum on in an optimizer built with momentum=0
    # (the buffer is created on the first step with momentum != 0, seeded with the raw
    # gradient); the compiled step kept no buffer, so the group is rebuilt with one.
    # (torch's RMSprop raises a KeyError there: its buffer exists only from its first step.)
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal(5)
    grads = [rng.standard_normal(5) for _ in range(6)]
    kwargs = {"lr": 0.1, "momentum": 0.0, "dampening": 0.5}
    tw = torch.tensor(w0.copy(), requires_grad=True)
    ref = torch.optim.SGD([tw], **kwargs, foreach=False)
    opt = SGD([jnp.asarray(w0)], **kwargs)
    for i, g in enumerate(grads):
        if i == 3:
            ref.param_groups[0]["momentum"] = 0.9
            opt.param_groups[0]["momentum"] = 0.9
        tw.grad = torch.tensor(g)
        ref.step()
        opt.grad = [jnp.asarray(g)]
        opt.step()
        assert rel_err(np.asarray(opt.params[0]), tw.detach().numpy()) < 1e-14, i
    theirs = ref.state_dict()["state"][0]["momentum_buffer"].numpy()
    ours = state_dict_to_torch(opt.state_dict())["state"][0]["momentum_buffer"].numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-14)


def test_param_group_assignment_takes_effect_without_recompiling():
    # a structure no other test uses, so the first step compiles here
    params = {"w_compile_count": jnp.array([1.0, -1.0])}
    grad = {"w_compile_count": jnp.array([1.0, 2.0])}
    opt = SGD(params, lr=0.1, momentum=0.5, weight_decay=0.0)
    opt.grad = grad
    before = _STEP._cache_size()
    opt.step()
    compiled = _STEP._cache_size()
    assert compiled == before + 1
    w = np.array([1.0, -1.0]) - 0.1 * np.array([1.0, 2.0])
    buf = np.array([1.0, 2.0])
    for lr, momentum, wd in [(0.2, 0.5, 0.0), (0.05, 0.9, 0.01), (0.3, 0.0, 0.1)]:
        opt.param_groups[0]["lr"] = lr
        opt.param_groups[0]["momentum"] = momentum
        opt.param_groups[0]["weight_decay"] = wd
        opt.step()
        g = np.array([1.0, 2.0]) + wd * w
        if momentum != 0:
            buf = momentum * buf + g
            g = buf
        w = w - lr * g
        np.testing.assert_allclose(opt.params["w_compile_count"], w, rtol=1e-14)
    # weight_decay=0 and momentum=0.5 were compiled in (Algorithm.fixed_zero/fixed_nonzero):
    # the first edit across them (weight_decay 0.01) rebuilt the group once, changeable;
    # every later value, momentum 0 included, is data again
    assert _STEP._cache_size() == compiled + 1
    assert float(fo.get_hparams(opt.state)["lr"]) == 0.3
    # a structural flag rebuilds the group: exactly one more compilation, buffers kept
    opt.param_groups[0]["momentum"] = 0.5
    opt.param_groups[0]["nesterov"] = True
    opt.param_groups[0]["weight_decay"] = 0.0
    opt.step()
    assert _STEP._cache_size() == compiled + 2
    buf = 0.5 * buf + np.array([1.0, 2.0])
    w = w - 0.3 * (np.array([1.0, 2.0]) + 0.5 * buf)
    np.testing.assert_allclose(opt.params["w_compile_count"], w, rtol=1e-14)
    # a fresh optimizer compiles its numbers' zero-ness in (the rebuilt group keeps them
    # changeable): one program more; a second one of the same configuration reuses it
    for lr in [0.7, 0.4]:
        twin = SGD({"w_compile_count": jnp.array([0.0, 0.0])}, lr=lr, momentum=0.5, nesterov=True)
        twin.grad = grad
        twin.step()
        assert _STEP._cache_size() == compiled + 3
        np.testing.assert_allclose(twin.params["w_compile_count"], [-lr * 1.5, -lr * 3.0], rtol=1e-15)


def test_backward_compiles_once_per_loss_function():
    opt = SGD({"w": jnp.array([1.0, 2.0]), "b": jnp.array([0.5])}, lr=0.1)
    opt.backward(quad, jnp.zeros(2))
    compiled = _BACKWARD._cache_size()
    for i in range(3):
        opt.zero_grad()
        opt.backward(quad, jnp.full(2, float(i)))
        opt.step()
    assert _BACKWARD._cache_size() == compiled + 1  # grads None -> arrays: one more signature


# ---------------------------------------------------------------------------------------
# checkpoints: orbax and pickle round trips, bit for bit
# ---------------------------------------------------------------------------------------


def trained_two_group_optimizer():
    groups, stream = sd_setup()
    opt = SGD(jax_groups(groups))
    for grads in stream[:27]:
        opt.grad = grads
        opt.step()
    return opt, groups, stream


def test_state_round_trips_through_pickle_bit_exactly():
    opt, _, _ = trained_two_group_optimizer()
    restored = pickle.loads(pickle.dumps(opt.state))
    assert jax.tree.structure(restored) == jax.tree.structure(opt.state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(opt.state), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def test_whole_optimizer_pickles_and_resumes_bit_exactly():
    opt, _, stream = trained_two_group_optimizer()
    copy_ = pickle.loads(pickle.dumps(opt))
    assert type(copy_) is SGD and copy_.param_groups[1]["nesterov"] is True
    for grads in stream[27:]:
        for o in (opt, copy_):
            o.grad = grads
            o.step()
    for a, b in zip(jax.tree.leaves(copy_.state), jax.tree.leaves(opt.state), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(copy_.params), jax.tree.leaves(opt.params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_state_round_trips_through_orbax_and_training_continues(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    opt, groups, stream = trained_two_group_optimizer()
    saved_params = jax.tree.map(np.array, opt.params)
    checkpointer = ocp.StandardCheckpointer()
    path = os.path.join(tmp_path, "state")
    checkpointer.save(path, {"state": opt.state, "params": opt.params})
    checkpointer.wait_until_finished()
    target = jax.eval_shape(lambda: {"state": opt.state, "params": opt.params})
    restored = checkpointer.restore(path, target)
    for a, b in zip(jax.tree.leaves(restored["state"]), jax.tree.leaves(opt.state), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)

    other = SGD(jax_groups(groups), lr=0.7)  # different lr: the restored state's wins
    other.params = restored["params"]
    other.state = restored["state"]
    assert other.param_groups[0]["lr"] == pytest.approx(0.1, abs=0)
    for grads in stream[27:]:
        opt.grad = grads
        opt.step()
        other.grad = grads
        other.step()
    for a, b in zip(jax.tree.leaves(other.params), jax.tree.leaves(opt.params), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(jax.tree.leaves(saved_params)[0], jax.tree.leaves(opt.params)[0])


# ---------------------------------------------------------------------------------------
# errors, raised before anything changes
# ---------------------------------------------------------------------------------------

W = jnp.ones(3)

CONSTRUCTION_ERRORS = {
    "duplicate-across-groups": (
        lambda: SGD([{"params": {"a": W}}, {"params": [W], "lr": 0.5}]),
        ValueError,
        "some parameters appear in more than one parameter group",
    ),
    "group_by-overlap": (
        lambda: SGD(group_by({"a": W, "b": jnp.ones(2)}, {"where": "a"}, {"where": lambda p, leaf: True})),
        ValueError,
        "some parameters appear in more than one parameter group",
    ),
    "empty-tree": (lambda: SGD({}), ValueError, "optimizer got an empty parameter list"),
    "empty-list": (lambda: SGD([]), ValueError, "optimizer got an empty parameter list"),
    "empty-groups": (lambda: SGD([{"params": []}]), ValueError, "optimizer got an empty parameter list"),
    "unknown-group-key": (
        lambda: SGD([{"params": [W], "lrr": 0.1}]),
        ValueError,
        "parameter group 0 has unknown hyperparameter\\(s\\) 'lrr'; SGD accepts: lr, momentum",
    ),
    "unknown-group_by-key": (
        lambda: SGD(group_by({"a": W}, {"where": "a", "betas": (0.9, 0.9)})),
        ValueError,
        "unknown hyperparameter\\(s\\) 'betas'",
    ),
    "unknown-keyword": (lambda: SGD([W], lrr=0.1), TypeError, "lrr"),
    "invalid-lr": (lambda: SGD([W], lr=-1.0), ValueError, "Invalid learning rate: -1.0"),
    "invalid-group-momentum": (
        lambda: SGD([{"params": [W]}, {"params": [jnp.ones(2)], "momentum": -0.5}]),
        ValueError,
        "Invalid momentum value: -0.5",
    ),
    "nesterov": (
        lambda: SGD([W], lr=0.1, nesterov=True),
        ValueError,
        "Nesterov momentum requires a momentum and zero dampening",
    ),
    "group_by-selects-nothing": (
        lambda: SGD(group_by({"a": W}, {"where": "zzz"})),
        ValueError,
        "group 0 \\(where='zzz'\\) selects no parameter",
    ),
    "integer-param": (lambda: SGD({"n": jnp.arange(3)}), ValueError, r"parameter at \['n'\] has dtype int"),
}


@pytest.mark.parametrize("case", list(CONSTRUCTION_ERRORS))
def test_construction_errors(case):
    make, exc, message = CONSTRUCTION_ERRORS[case]
    with pytest.raises(exc, match=message):
        make()


def two_group_opt():
    opt = SGD(
        [{"params": {"w": jnp.ones((2, 2))}}, {"params": [jnp.ones(3)], "lr": 0.5}], lr=0.1, momentum=0.9
    )
    opt.grad = [{"w": jnp.ones((2, 2))}, [jnp.ones(3)]]
    opt.step()
    return opt


def _sd_fewer_groups(sd):
    sd["param_groups"] = sd["param_groups"][:1]


def _sd_group_size(sd):
    sd["param_groups"][1]["params"] = [1, 2]


def _sd_shape(sd):
    sd["state"][1]["momentum_buffer"] = np.ones(4)


def _sd_unknown_buffer(sd):
    sd["state"][0]["exp_avg"] = np.ones((2, 2))


def _sd_unknown_id(sd):
    sd["state"][7] = {"momentum_buffer": np.ones(3)}


def _sd_invalid_lr(sd):
    sd["param_groups"][1]["lr"] = -2.0


LOAD_ERRORS = {
    "fewer-groups": (_sd_fewer_groups, "loaded state dict has a different number of parameter groups"),
    "group-size": (
        _sd_group_size,
        "loaded state dict contains a parameter group that doesn't match the size of optimizer's group",
    ),
    "shape": (
        _sd_shape,
        r"momentum_buffer of parameter 1 has shape \(4,\), but SGD keeps it with shape \(3,\)",
    ),
    "unknown-buffer": (
        _sd_unknown_buffer,
        "has state 'exp_avg', which SGD with these settings does not keep",
    ),
    "unknown-id": (_sd_unknown_id, "state for parameter id 7, which no parameter group lists"),
    "invalid-lr": (_sd_invalid_lr, "Invalid learning rate: -2.0"),
}


@pytest.mark.parametrize("case", list(LOAD_ERRORS))
def test_load_state_dict_errors_leave_the_optimizer_untouched(case):
    opt = two_group_opt()
    edit, message = LOAD_ERRORS[case]
    sd = opt.state_dict()
    sd["param_groups"][0]["lr"] = 0.123  # would change if anything were applied
    sd["state"][0]["momentum_buffer"] = sd["state"][0]["momentum_buffer"] + 1.0
    edit(sd)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(sd)
    assert_same_snapshot(before, snapshot(opt))


def test_invalid_param_group_assignment_raises_at_step_and_changes_nothing():
    opt = two_group_opt()
    before = snapshot(opt)
    opt.param_groups[0]["momentum"] = 0.5  # valid, but group 1 fails: neither is applied
    opt.param_groups[1]["lr"] = -1.0
    with pytest.raises(ValueError, match=r"Invalid learning rate: -1\.0"):
        opt.step()
    with pytest.raises(ValueError, match=r"Invalid learning rate: -1\.0"):
        opt.state  # noqa: B018  (reading the state applies pending edits too: the same refusal)
    after = leaves_np(opt.params) + leaves_np(opt._states)  # the held state, as it stands
    for x, y in zip(before[0] + before[1], after, strict=True):
        np.testing.assert_array_equal(x, y)
    assert float(fo.get_hparams(opt._states[0])["momentum"]) == 0.9


def test_add_param_group_like_torch():
    w0, b0, extra0 = np.array([1.0, 2.0]), np.array([0.5]), np.array([[1.0, -1.0]])
    opt = SGD([{"params": {"w": w0}}], lr=0.1, momentum=0.9, foreach=False)
    tw, tb, te = torch_tensors([w0, b0, extra0])
    t_opt = torch.optim.SGD([tw], lr=0.1, momentum=0.9, foreach=False)
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        opt.add_param_group({"params": [opt.params[0]["w"]]})
    with pytest.raises(ValueError, match="unknown hyperparameter"):
        opt.add_param_group({"params": [b0], "betas": (0.9, 0.9)})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [b0, extra0], "lr": 0.5})
    t_opt.add_param_group({"params": [tb, te], "lr": 0.5})
    grads = [{"w": np.array([1.0, -1.0])}, [np.array([2.0]), np.array([[0.5, 0.25]])]]
    for _ in range(3):
        opt.grad = grads
        opt.step()
        for t, g in zip([tw, tb, te], [grads[0]["w"], *grads[1]], strict=True):
            t.grad = torch.tensor(g)
        t_opt.step()
    assert rel_err(jax.tree.leaves(opt.params), [t.detach().numpy() for t in (tw, tb, te)]) <= 1e-15
    assert opt.state_dict()["param_groups"] == t_opt.state_dict()["param_groups"]
    with pytest.raises(TypeError, match="built from one pytree"):
        SGD({"w": w0}).add_param_group({"params": [b0]})


def test_adagrad_group_initial_accumulator_value_seeds_nothing_like_torch():
    # torch's Adagrad builds every ``sum`` in __init__ from the constructor's
    # initial_accumulator_value: a group's own value shows in param_groups, seeds nothing
    w0, b0 = np.array([1.0, -2.0]), np.array([0.5])
    groups = lambda w, b: [{"params": [w], "initial_accumulator_value": 0.7}, {"params": [b]}]
    opt = fo.optim.Adagrad(groups(w0, b0), lr=0.1, initial_accumulator_value=0.2)
    tw, tb = torch_tensors([w0, b0])
    t_opt = torch.optim.Adagrad(groups(tw, tb), lr=0.1, initial_accumulator_value=0.2, foreach=False)
    grads = [[np.array([0.3, -1.0])], [np.array([2.0])]]
    for _ in range(2):
        opt.grad = grads
        opt.step()
        for t, g in zip([tw, tb], [grads[0][0], grads[1][0]], strict=True):
            t.grad = torch.tensor(g)
        t_opt.step()
    assert rel_err(jax.tree.leaves(opt.params), [t.detach().numpy() for t in (tw, tb)]) <= 1e-15
    for i, t in enumerate((tw, tb)):
        np.testing.assert_allclose(
            opt.state_dict()["state"][i]["sum"], t_opt.state[t]["sum"].numpy(), rtol=1e-15
        )
    assert opt.param_groups[0]["initial_accumulator_value"] == 0.7


def test_grad_and_state_setters_validate():
    opt = two_group_opt()
    before = snapshot(opt)
    with pytest.raises(ValueError, match=r"grad at \[0\]\['w'\] has shape \(3,\)"):
        opt.grad = [{"w": jnp.ones(3)}, [jnp.ones(3)]]
    with pytest.raises(ValueError, match="has dtype float32, but the parameter has dtype float64"):
        opt.grad = [{"w": jnp.ones((2, 2), jnp.float32)}, [None]]
    with pytest.raises(ValueError, match="does not match the optimizer's structure"):
        opt.params = {"w": jnp.ones((2, 2))}
    with pytest.raises(ValueError, match="expected 2 group states, got 1"):
        opt.state = [opt.state[0]]
    assert_same_snapshot(before, snapshot(opt))


# ---------------------------------------------------------------------------------------
# every registered optimizer: a facade class, torch's state_dict layout, resumption
# ---------------------------------------------------------------------------------------


def registry_cases():
    from functorch_optim._registry import OPTIMIZERS

    cases = []
    for spec in OPTIMIZERS:
        if spec.torch_name == "LBFGS":  # closure-driven, its own state layout
            continue
        grid = list(spec.grid)
        picks = sorted({0, len(grid) // 2, len(grid) - 1})
        cases.extend(pytest.param(spec, grid[i], id=f"{spec.torch_name}-{i}") for i in picks)
    return cases


def torch_class_kwargs(cls, config):
    kwargs = dict(config)
    if "foreach" in inspect.signature(cls).parameters:
        kwargs["foreach"] = False
    return kwargs


@pytest.mark.parametrize(("spec", "config"), registry_cases())
def test_registered_optimizer_facade_state_dict_matches_torch(spec, config):
    import functorch_optim.optim as fo_optim

    cls = getattr(fo_optim, spec.torch_name)
    assert cls.factory is spec.factory
    torch_cls = getattr(torch.optim, spec.torch_name)
    assert list(inspect.signature(cls).parameters) == list(inspect.signature(torch_cls).parameters)

    rng = np.random.default_rng(11)
    # an optimizer restricted to some shapes (Muon: 2-D) says which in the registry
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)
    shapes = jax.tree.leaves(spec.shapes, is_leaf=is_shape) if spec.shapes else [(3, 2), (4,), ()]
    params = [rng.standard_normal(s) for s in shapes]
    stream = [
        [rng.standard_normal(shapes[0]), None if t < 2 else rng.standard_normal(shapes[1]), None]
        for t in range(8)
    ]
    kwargs = torch_class_kwargs(torch_cls, config)
    ts = torch_tensors(params)
    t_opt = torch_cls(ts, **kwargs)
    opt = cls(params, **kwargs)
    for t, grads in enumerate(stream):
        for tt, g in zip(ts, grads, strict=True):
            tt.grad = None if g is None else torch.tensor(g)
            if g is not None and spec.sparse_grad:
                tt.grad = tt.grad.to_sparse()
            if g is not None and spec.sparse_grad:
                tt.grad = tt.grad.to_sparse()
        t_opt.step()
        opt.grad = grads
        opt.step()
        if t == 3:
            mid_sd = copy.deepcopy(t_opt.state_dict())
            mid_params = [tt.detach().numpy().copy() for tt in ts]
    ours, theirs = opt.state_dict(), t_opt.state_dict()
    assert sorted(ours["state"]) == sorted(theirs["state"])
    for k, entry in theirs["state"].items():
        assert sorted(ours["state"][k]) == sorted(entry), k
        for name, value in entry.items():
            mine = ours["state"][k][name]
            if torch.is_tensor(value):
                assert np.asarray(mine).dtype == value.numpy().dtype, (k, name)
                assert rel_err(mine, value.numpy()) <= 1e-10, (k, name)
            else:
                assert mine == value, (k, name)
    assert set(ours["param_groups"][0]) == set(theirs["param_groups"][0])
    # resume from torch's mid-run state: equals torch's run
    resumed = cls(mid_params, **kwargs)
    resumed.load_state_dict(mid_sd)
    for grads in stream[4:]:
        resumed.grad = grads
        resumed.step()
    assert rel_err(resumed.params, [tt.detach().numpy() for tt in ts]) <= 1e-10


# ---------------------------------------------------------------------------------------
# LBFGS: the closure-driven facade, against torch.optim.LBFGS
# ---------------------------------------------------------------------------------------

_LB_RNG = np.random.default_rng(5)
_LB_M = _LB_RNG.standard_normal((6, 6))
_LB_A = _LB_M @ _LB_M.T + 0.5 * np.eye(6)
_LB_B = _LB_RNG.standard_normal(6)
_LB_X0 = [np.array([[-1.2, 1.0], [-0.5, 0.8]]), np.array([0.3, -0.7])]
_LB_CASES = [
    pytest.param({"lr": 0.5, "max_iter": 5, "history_size": 4}, 0.0, id="fixed-quadratic"),
    pytest.param(
        {"max_iter": 5, "history_size": 4, "line_search_fn": "strong_wolfe"}, 1.0, id="wolfe-rosenbrock"
    ),
]


def _lb_objective(x, rosen, xp):
    """A deterministic quadratic plus ``rosen`` times Rosenbrock, of the flat vector ``x``."""
    return (
        0.5 * x @ (xp.asarray(_LB_A) @ x)
        - xp.asarray(_LB_B) @ x
        + rosen * xp.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2)
    )


def _lb_closure(rosen):
    return lambda p: _lb_objective(jnp.concatenate([p[0].reshape(-1), p[1]]), rosen, jnp)


def _lb_torch(cfg, rosen, x0=_LB_X0):
    ts = [torch.tensor(x).requires_grad_(True) for x in x0]
    opt = torch.optim.LBFGS(ts, **cfg)

    def closure():
        opt.zero_grad()
        loss = _lb_objective(torch.cat([ts[0].reshape(-1), ts[1]]), rosen, torch)
        loss.backward()
        return loss

    return ts, opt, closure


def _lb_err(ours, ts):
    return max(
        float(np.max(np.abs(np.asarray(a) - t.detach().numpy()))) for a, t in zip(ours, ts, strict=True)
    )


@pytest.mark.parametrize(("cfg", "rosen"), _LB_CASES)
def test_lbfgs_facade_matches_torch_step_by_step(cfg, rosen):
    from functorch_optim.optim import LBFGS

    ts, t_opt, t_closure = _lb_torch(cfg, rosen)
    opt = LBFGS(_LB_X0, **cfg)
    closure = _lb_closure(rosen)
    for _ in range(5):
        t_loss = t_opt.step(t_closure)
        loss = opt.step(closure)
        assert abs(float(loss) - t_loss.item()) <= 1e-10 * max(1.0, abs(t_loss.item()))
        assert _lb_err(opt.params, ts) <= 1e-10
    ours, theirs = opt.state_dict(), t_opt.state_dict()
    assert sorted(ours["state"]) == sorted(theirs["state"]) == [0]
    assert ours["param_groups"] == theirs["param_groups"]
    o, t = ours["state"][0], theirs["state"][0]
    assert sorted(o) == sorted(t)
    assert (o["func_evals"], o["n_iter"]) == (t["func_evals"], t["n_iter"])
    for name in ("d", "prev_flat_grad", "H_diag"):
        assert rel_err(o[name], t[name].numpy()) <= 1e-8, name
    for name in ("old_dirs", "old_stps", "ro"):
        assert len(o[name]) == len(t[name])
        assert rel_err(np.stack(o[name]), torch.stack(t[name]).numpy()) <= 1e-8, name
    assert abs(o["t"] - float(t["t"])) <= 1e-10 and abs(o["prev_loss"] - t["prev_loss"]) <= 1e-10
    assert [a is None for a in o["al"]] == [a is None for a in t["al"]]


@pytest.mark.parametrize(("cfg", "rosen"), _LB_CASES)
def test_lbfgs_facade_resumes_torch_and_torch_resumes_it(cfg, rosen):
    from functorch_optim.optim import LBFGS

    closure = _lb_closure(rosen)
    # reference: six torch steps, state after three
    ts, t_opt, t_closure = _lb_torch(cfg, rosen)
    for _ in range(3):
        t_opt.step(t_closure)
    mid_sd = copy.deepcopy(t_opt.state_dict())
    mid_params = [t.detach().numpy().copy() for t in ts]
    for _ in range(3):
        t_opt.step(t_closure)
    # torch -> ours: three more steps from torch's state equal torch's six
    opt = LBFGS(mid_params, **cfg)
    opt.load_state_dict(mid_sd)
    for _ in range(3):
        opt.step(closure)
    assert _lb_err(opt.params, ts) <= 1e-10
    # ours -> torch: three of ours, exported, three in torch equal torch's six
    ours = LBFGS(_LB_X0, **cfg)
    for _ in range(3):
        ours.step(closure)
    ts2, t_opt2, t_closure2 = _lb_torch(cfg, rosen, [np.asarray(x) for x in ours.params])
    t_opt2.load_state_dict(state_dict_to_torch(ours.state_dict()))
    for _ in range(3):
        t_opt2.step(t_closure2)
    assert _lb_err([t.detach().numpy() for t in ts2], ts) <= 1e-10


def test_lbfgs_facade_groups_hparams_and_errors():
    from functorch_optim.optim import LBFGS

    assert list(inspect.signature(LBFGS).parameters) == list(inspect.signature(torch.optim.LBFGS).parameters)
    with pytest.raises(ValueError, match=r"LBFGS doesn't support per-parameter options \(parameter groups\)"):
        LBFGS([{"params": [jnp.ones(2)]}, {"params": [jnp.ones(2)], "lr": 0.1}])
    with pytest.raises(ValueError, match="Invalid learning rate: -1"):
        LBFGS([jnp.ones(2)], lr=-1)
    opt = LBFGS([{"params": {"x": jnp.zeros(3)}, "lr": 0.25}], max_iter=4)
    group = opt.param_groups[0]
    assert (group["lr"], group["max_iter"], group["max_eval"]) == (0.25, 4, 5)
    expected = {**opt.defaults, "lr": 0.25, "params": [0], "param_names": ["x"]}
    assert opt.state_dict() == {"state": {}, "param_groups": [expected]}
    opt.zero_grad()  # no gradients to reset: the closure computes them

    def closure(p):
        return jnp.sum((p["x"] - 1.0) ** 2)

    opt.step(closure)
    compiled = opt_compiles()
    opt.param_groups[0]["lr"] = 0.5  # numeric: same compiled step
    opt.step(closure)
    assert opt_compiles() == compiled
    assert float(fo.get_hparams(opt.state)["lr"]) == 0.5
    # structural: rebuilt, the history carried over into the new ring buffers
    before = opt.state_dict()["state"][0]
    opt.param_groups[0]["history_size"] = 7
    opt.param_groups[0]["line_search_fn"] = "strong_wolfe"
    opt.step(closure)
    assert opt.state.old_dirs.shape == (7, 3)
    assert int(opt.state.n_iter) > before["n_iter"]
    assert opt.state_dict()["param_groups"][0]["line_search_fn"] == "strong_wolfe"
    with pytest.raises(ValueError, match="loaded state dict has a different number of parameter groups"):
        opt.load_state_dict({"state": {}, "param_groups": []})


def opt_compiles():
    from functorch_optim.optim._lbfgs import _STEP as LBFGS_STEP

    return LBFGS_STEP._cache_size()


# ---------------------------------------------------------------------------------------
# step(closure): torch's zero-argument closure and the pure closure(params), every optimizer
# ---------------------------------------------------------------------------------------


def _closure_loss(params, x):
    return sum(jnp.sum(jnp.sin(p + x) ** 2) for p in jax.tree.leaves(params))


def _facade_names():
    from functorch_optim._registry import OPTIMIZERS

    return [s.torch_name for s in OPTIMIZERS if s.torch_name != "LBFGS"]


@pytest.mark.parametrize("name", _facade_names())
def test_step_takes_torchs_closure_and_the_pure_closure_for_every_optimizer(name):
    """``step(closure)`` with ``() -> loss`` (torch's) or ``(params) -> loss`` equals the plain loop."""
    import functorch_optim.optim as fo_optim
    from functorch_optim._registry import OPTIMIZERS

    cls = getattr(fo_optim, name)
    spec = next(s for s in OPTIMIZERS if s.torch_name == name)
    is_shape = lambda s: isinstance(s, tuple) and all(isinstance(i, int) for i in s)
    shapes = jax.tree.leaves(spec.shapes, is_leaf=is_shape) if spec.shapes else [(3, 2), (2,)]
    rng = np.random.default_rng(3)
    params = {f"p{i}": jnp.asarray(rng.standard_normal(s)) for i, s in enumerate(shapes)}
    xs = [jnp.asarray(rng.standard_normal()) for _ in range(3)]
    plain, torch_form, pure_form = cls(params), cls(params), cls(params)
    for x in xs:
        plain.zero_grad()
        expected = plain.backward(_closure_loss, x)
        plain.step()

        def closure():
            torch_form.zero_grad()
            return torch_form.backward(_closure_loss, x)

        assert float(torch_form.step(closure)) == float(expected)
        assert float(pure_form.step(jax.tree_util.Partial(_closure_loss, x=x))) == float(expected)
    for other in (torch_form, pure_form):
        for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(other.params), strict=True):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(jax.tree.leaves(pure_form.grad)[0], jax.tree.leaves(plain.grad)[0])


def test_step_rejects_a_closure_of_two_arguments():
    opt = SGD({"w": jnp.ones(2)}, lr=0.1)
    with pytest.raises(TypeError, match=r"closure must take no argument \(torch's"):
        opt.step(lambda a, b: 0.0)


@pytest.mark.parametrize(("cfg", "rosen"), _LB_CASES)
def test_lbfgs_facade_takes_torchs_zero_argument_closure(cfg, rosen):
    """torch's closure (zero_grad, backward, return loss), called as torch calls it."""
    from functorch_optim.optim import LBFGS

    ts, t_opt, t_closure = _lb_torch(cfg, rosen)
    opt = LBFGS(_LB_X0, **cfg)
    calls = {"torch": 0, "ours": 0}

    def counted_torch():
        calls["torch"] += 1
        return t_closure()

    def loss_fn(p):
        return _lb_objective(jnp.concatenate([p[0].reshape(-1), p[1]]), rosen, jnp)

    def closure():
        calls["ours"] += 1
        opt.zero_grad()
        loss = opt.backward(loss_fn)
        return loss

    for k in range(5):
        t_loss = t_opt.step(counted_torch)
        loss = opt.step(closure)
        assert calls["ours"] == calls["torch"], k
        assert abs(float(loss) - t_loss.item()) <= 1e-12 * max(1.0, abs(t_loss.item()))
        assert _lb_err(opt.params, ts) <= 1e-12
        o, t = opt.state_dict()["state"][0], t_opt.state_dict()["state"][0]
        assert (o["func_evals"], o["n_iter"]) == (t["func_evals"], t["n_iter"]), k
    # the gradient the last evaluation left, like torch's p.grad
    np.testing.assert_allclose(opt.grad[1], ts[1].grad.numpy(), rtol=1e-10, atol=1e-12)
    # the same run through the pure closure(params) form (one jitted step) agrees
    pure = LBFGS(_LB_X0, **cfg)
    for _ in range(5):
        pure.step(loss_fn)
    assert max(rel_err(a, b) for a, b in zip(pure.params, opt.params, strict=True)) <= 1e-10
    assert int(pure.state.func_evals) == int(opt.state.func_evals)


# ---------------------------------------------------------------------------------------
# backward(..., has_aux=True): the loss and the forward pass's other outputs
# ---------------------------------------------------------------------------------------


def _rnn_loss(params, x, hidden):
    """A loss that also returns what the next batch needs (the word LM's hidden state)."""
    new_hidden = jnp.tanh(params["w"] * x + hidden)
    return jnp.sum(new_hidden**2) + jnp.sum(params["b"] ** 2), {"hidden": new_hidden, "x_mean": jnp.mean(x)}


def test_backward_has_aux_returns_loss_and_aux_and_accumulates_the_same_gradient():
    params = {"w": jnp.array([0.5, -1.0]), "b": jnp.array([0.25])}
    plain, with_aux = SGD(params, lr=0.1), SGD(params, lr=0.1)
    hidden = jnp.zeros(2)

    def loss_only(p, x, h):
        return _rnn_loss(p, x, h)[0]

    for x in [jnp.array([1.0, 2.0]), jnp.array([-0.5, 0.3])]:
        plain.zero_grad()
        expected = plain.backward(loss_only, x, hidden)
        plain.step()
        with_aux.zero_grad()
        w = np.array(with_aux.params["w"])  # host copy: step() donates the params
        loss, aux = with_aux.backward(_rnn_loss, x, hidden, has_aux=True)
        with_aux.step()
        assert float(loss) == float(expected)
        np.testing.assert_array_equal(aux["hidden"], jnp.tanh(w * x + hidden))
        assert float(aux["x_mean"]) == float(jnp.mean(x))
        hidden = aux["hidden"]
    for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(with_aux.params), strict=True):
        np.testing.assert_array_equal(a, b)
    # inside torch's closure too, and on LBFGS
    from functorch_optim.optim import LBFGS

    lb = LBFGS({"w": jnp.array([0.5, -1.0]), "b": jnp.array([0.25])}, max_iter=2)
    seen = []

    def closure():
        lb.zero_grad()
        loss, aux = lb.backward(_rnn_loss, jnp.array([1.0, 2.0]), jnp.zeros(2), has_aux=True)
        seen.append(aux["hidden"])
        return loss

    lb.step(closure)
    assert len(seen) == int(lb.state.func_evals) and seen[0].shape == (2,)


# ---------------------------------------------------------------------------------------
# schedules: optimizers of one configuration share one compiled step
# ---------------------------------------------------------------------------------------


def _sweep(make_schedule, n=20, steps=3):
    """``n`` SGD facades, schedule ``make_schedule(i)``, ``steps`` steps each, against torch."""
    w0, grad = np.array([1.0, -2.0]), np.array([0.5, 1.0])
    with CompileCounter() as compiled:
        for i in range(n):
            sched, torch_sched = make_schedule(i)
            opt = SGD({"w_sweep": jnp.asarray(w0)}, lr=sched, momentum=0.9)
            tw = torch.tensor(w0, requires_grad=True)
            topt = torch.optim.SGD([tw], lr=1.0, momentum=0.9)
            tsched = torch_sched(topt)
            for _ in range(steps):
                opt.grad = {"w_sweep": jnp.asarray(grad)}
                opt.step()
                tw.grad = torch.tensor(grad)
                topt.step()
                tsched.step()
            np.testing.assert_allclose(opt.params["w_sweep"], tw.detach().numpy(), rtol=1e-15, atol=0)
    return compiled.count


def _torch_step_lr(lr, **kw):
    def make(topt):
        topt.param_groups[0]["lr"] = lr
        return torch.optim.lr_scheduler.StepLR(topt, **kw)

    return make


def test_facades_whose_schedules_differ_in_lr_share_one_compiled_step():
    _sweep(lambda i: (fo.schedules.step_lr(0.5, 1, 0.5), _torch_step_lr(0.5, step_size=1, gamma=0.5)), n=1)
    before = _STEP._cache_size()
    count = _sweep(
        lambda i: (
            fo.schedules.step_lr(0.1 + 0.01 * i, step_size=1, gamma=0.5),
            _torch_step_lr(0.1 + 0.01 * i, step_size=1, gamma=0.5),
        )
    )
    assert count == 0 and _STEP._cache_size() == before  # the warm-up's compiled step serves all 20


def test_facades_whose_schedules_differ_in_structure_do_not_share_a_step():
    # a different gamma or step size is another step: torch's numbers for each
    _sweep(
        lambda i: (
            fo.schedules.step_lr(0.1, step_size=1 + i % 2, gamma=(0.5, 0.25)[i // 2]),
            _torch_step_lr(0.1, step_size=1 + i % 2, gamma=(0.5, 0.25)[i // 2]),
        ),
        n=4,
    )


def test_a_schedule_holding_user_code_is_never_shared():
    # the lambda reads a variable that changes between two builds: each facade traces it anew
    factor = {"value": 0.5}
    fn = lambda e: factor["value"] ** e
    params = []
    for value in (0.5, 0.25):
        factor["value"] = value
        opt = SGD({"w_user_code": jnp.array([1.0])}, lr=fo.schedules.lambda_lr(0.1, fn))
        for _ in range(2):
            opt.grad = {"w_user_code": jnp.array([1.0])}
            opt.step()
        params.append(float(opt.params["w_user_code"][0]))
    assert params == [1.0 - 0.1 - 0.1 * 0.5, 1.0 - 0.1 - 0.1 * 0.25]  # lr 0.1, then 0.1 * factor
