"""``param_groups``: torch's parameter groups in the functional API, against torch."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import functorch_optim as fo
from functorch_optim.interop.torch import tree_from_module

NO_DECAY = r"bias|LayerNorm\.weight"  # transformers' ["bias", "LayerNorm.weight"] substrings
K = 2  # micro-batches per step
STEPS = 3


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = torch.nn.Linear(4, 5, dtype=torch.float64)
        self.LayerNorm = torch.nn.LayerNorm(5, dtype=torch.float64)
        self.head = torch.nn.Linear(5, 3, dtype=torch.float64)

    def forward(self, x):
        return self.head(torch.tanh(self.LayerNorm(self.dense(x))))


def jax_forward(p, x):
    h = x @ p["dense"]["weight"].T + p["dense"]["bias"][None, :]
    mu = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.mean((h - mu) ** 2, axis=-1, keepdims=True)
    h = (h - mu) / jnp.sqrt(var + 1e-5) * p["LayerNorm"]["weight"][None, :] + p["LayerNorm"]["bias"][None, :]
    return jnp.tanh(h) @ p["head"]["weight"].T + p["head"]["bias"][None, :]


def jax_loss(p, x, y):
    return jnp.mean((jax_forward(p, x) - y) ** 2)


def batches():
    rng = np.random.default_rng(1)
    return [(rng.standard_normal((4, 4)), rng.standard_normal((4, 3))) for _ in range(STEPS * K)]


# the torch groups, in the order the functional groups are given ("default" last)
RULES = {
    "no_decay": {"where": NO_DECAY, "weight_decay": 0.0},
    "head": {"where": r"^head\.weight$", "lr": 0.02},
    "embeddings": {"where": r"embed", "lr": 1.0},  # selects nothing in this model
}


def torch_groups(model):
    named = list(model.named_parameters())
    pick = {
        "no_decay": [p for n, p in named if re.search(NO_DECAY, n)],
        "head": [p for n, p in named if n == "head.weight"],
        "embeddings": [],
        "default": [p for n, p in named if not re.search(NO_DECAY, n) and n != "head.weight"],
    }
    overrides = {"no_decay": {"weight_decay": 0.0}, "head": {"lr": 0.02}, "embeddings": {"lr": 1.0}}
    return [
        {"params": pick[g], **overrides.get(g, {})} for g in ("no_decay", "head", "embeddings", "default")
    ]


def test_groups_with_clip_and_accumulation_equal_torch():
    """transformers' AdamW groups, ``loss / k`` accumulation and ``clip_grad_norm_``, a
    group's lr changed mid-run, an empty group: every step equal to torch's."""
    torch.manual_seed(0)
    model = Net()
    params = tree_from_module(model)
    opt = torch.optim.AdamW(torch_groups(model), lr=0.01, weight_decay=0.1)
    groups = fo.param_groups(fo.adamw, RULES, lr=0.01, weight_decay=0.1)
    tx = fo.grad_accumulate(optax.chain(fo.clip_grad_norm_transform(0.5), groups), every=K)
    state = tx.init(params)
    step = jax.jit(fo.step, static_argnums=0)
    data = batches()
    for s in range(STEPS):
        if s == 2:  # the head's lr, in both
            opt.param_groups[1]["lr"] = 0.005
            state = fo.set_hparams(state, group="head", lr=0.005)
        opt.zero_grad()
        for x, y in data[s * K : (s + 1) * K]:
            loss = torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y)) / K
            loss.backward()
            value, grads = jax.value_and_grad(jax_loss)(params, x, y)
            np.testing.assert_allclose(float(value) / K, loss.item(), rtol=1e-12)
            params, state = step(tx, params, grads, state)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        assert bool(state.stepped)
        theirs = tree_from_module(model)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(theirs), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-15)
    inner = state.inner_state[1]
    assert set(inner.groups) == {"no_decay", "head", "embeddings", "default"}
    assert inner.groups["no_decay"].exp_avg["head"]["weight"] is None
    assert int(inner.groups["no_decay"].step["LayerNorm"]["weight"]) == STEPS
    assert float(fo.get_hparams(state, group="head")["lr"]) == 0.005
    assert float(fo.get_hparams(state, group="no_decay")["weight_decay"]) == 0.0
    assert float(fo.get_hparams(state, group="embeddings")["lr"]) == 1.0


def test_none_gradient_and_grad_mask_skip_within_a_group():
    tx = fo.param_groups(fo.sgd, {"b": {"where": r"\.b$", "lr": 1.0}}, lr=0.1, momentum=0.9)
    params = {"l": {"w": jnp.ones(2), "b": jnp.ones(2)}, "m": {"w": jnp.ones(2), "b": jnp.ones(2)}}
    state = tx.init(params)
    grads = {"l": {"w": jnp.ones(2), "b": None}, "m": {"w": jnp.ones(2), "b": jnp.ones(2)}}
    mask = {"l": {"w": True, "b": True}, "m": {"w": False, "b": True}}
    new, state = fo.step(tx, params, grads, state, grad_mask=jax.tree.map(jnp.asarray, mask))
    assert new["l"]["b"].tolist() == [1.0, 1.0] and new["m"]["w"].tolist() == [1.0, 1.0]
    assert new["m"]["b"].tolist() == [0.0, 0.0] and new["l"]["w"].tolist() == [0.9, 0.9]
    assert int(state.groups["b"].step["m"]["b"]) == 1 and int(state.groups["b"].step["l"]["b"]) == 0
    updates, _ = tx.update(grads, tx.init(params), params)
    assert updates["l"]["b"] is None


def test_predicate_rule_and_default_overrides():
    # "no decay for every vector" as a predicate; the remaining group's own overrides
    tx = fo.param_groups(
        fo.adamw,
        {"vectors": {"where": lambda path, p: p.ndim <= 1, "weight_decay": 0.0}, "default": {"lr": 0.5}},
        lr=0.1,
        weight_decay=0.3,
    )
    state = tx.init({"w": jnp.ones((2, 2)), "b": jnp.ones(2)})
    assert state.groups["vectors"].exp_avg["w"] is None and state.groups["default"].exp_avg["b"] is None
    assert float(fo.get_hparams(state, group="default")["lr"]) == 0.5
    assert float(fo.get_hparams(state, group="vectors")["weight_decay"]) == 0.0


def test_errors_name_the_problem():
    params = {"fc": {"weight": jnp.ones(2), "bias": jnp.ones(2)}}
    tx = fo.param_groups(fo.sgd, {"a": {"where": "fc"}, "b": {"where": "bias"}})
    with pytest.raises(ValueError, match=r"'fc.bias' is selected by group 'a' and group 'b'"):
        tx.init(params)
    with pytest.raises(ValueError, match="group 'x' must have a 'where' key"):
        fo.param_groups(fo.sgd, {"x": {"lr": 0.1}})
    with pytest.raises(ValueError, match="'default' holds the parameters no other group selects"):
        fo.param_groups(fo.sgd, {"default": {"where": "fc"}})
    with pytest.raises(ValueError, match="'where' must be a regex string or a callable, got 3"):
        fo.param_groups(fo.sgd, {"x": {"where": 3}})
    with pytest.raises(ValueError, match=r"Invalid learning rate: -1\.0"):
        fo.param_groups(fo.sgd, {"x": {"where": "fc", "lr": -1.0}})
    state = fo.param_groups(fo.sgd, {"x": {"where": "bias"}}).init(params)
    with pytest.raises(ValueError, match="no parameter group 'y'; the groups are: 'x', 'default'"):
        fo.get_hparams(state, group="y")
    with pytest.raises(ValueError, match="pass group= one of 'x', 'default'"):
        fo.set_hparams(state, lr=0.1)
    with pytest.raises(ValueError, match="needs a state with one set of parameter groups"):
        fo.get_hparams(fo.sgd().init(params), group="x")


def test_optax_factory_and_equinox_model():
    """Any factory (here optax's) over an equinox model's filtered tree: optax's own
    multi_transform on the same labels gives the same updates."""
    import equinox as eqx

    model = eqx.nn.MLP(2, 2, 3, 1, key=jax.random.PRNGKey(0), dtype=jnp.float64)
    params = eqx.filter(model, eqx.is_inexact_array)
    grads = jax.tree.map(jnp.ones_like, params)
    ours = fo.param_groups(optax.sgd, {"b": {"where": r"bias$", "learning_rate": 1.0}}, learning_rate=0.1)
    labels = eqx.tree_at(
        lambda m: [lin.bias for lin in m.layers], jax.tree.map(lambda _: "w", params), ["b", "b"]
    )
    theirs = optax.multi_transform({"w": optax.sgd(0.1), "b": optax.sgd(1.0)}, lambda _: labels)
    u_ours, _ = ours.update(grads, ours.init(params), params)
    u_theirs, _ = theirs.update(grads, theirs.init(params), params)
    for a, b in zip(jax.tree.leaves(u_ours), jax.tree.leaves(u_theirs), strict=True):
        np.testing.assert_array_equal(a, b)
    assert u_ours.layers[0].bias.tolist() == [-1.0] * 3 and u_ours.layers[0].weight[0, 0] == -0.1
