"""microbatch_grad and variable-length accumulation against torch: token-weighted windows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import functorch_optim as fo
from functorch_optim.interop.torch import tree_from_module
from tests.helpers import rel_err


def _mlp(rng, width=16):
    return {
        "w1": jnp.asarray(rng.standard_normal((5, width)) * 0.5),
        "b1": jnp.zeros(width),
        "w2": jnp.asarray(rng.standard_normal((width, 1)) * 0.5),
    }


def _mse(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"][None, :])
    return jnp.mean((h @ params["w2"] - y) ** 2)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((24, 5)))
    return _mlp(rng), (x, jnp.sin(x.sum(-1, keepdims=True)))


@pytest.mark.parametrize("m", [1, 3, 8])
def test_equals_the_whole_batch(data, m):
    params, batch = data
    loss, grads = jax.jit(fo.microbatch_grad(_mse, m))(params, batch)
    ref_loss, ref_grads = jax.value_and_grad(_mse)(params, batch)
    assert abs(float(loss) - float(ref_loss)) <= 1e-14 * abs(float(ref_loss))
    assert rel_err(grads, ref_grads) <= 1e-13


def test_has_aux_stacks_each_part(data):
    params, batch = data
    loss_aux = lambda p, b: (_mse(p, b), {"n": b[0].shape[0], "first": b[0][0, 0]})
    (loss, aux), grads = jax.jit(fo.microbatch_grad(loss_aux, 4, has_aux=True))(params, batch)
    assert abs(float(loss) - float(_mse(params, batch))) <= 1e-14 * float(loss)
    np.testing.assert_array_equal(aux["n"], [6, 6, 6, 6])
    np.testing.assert_array_equal(aux["first"], batch[0][::6, 0])
    assert rel_err(grads, jax.grad(_mse)(params, batch)) <= 1e-13


def test_weighted_is_the_mean_over_all_tokens(data):
    # rows carry a 0/1 mask; each part's loss is the mean over its real rows, weighted by
    # their number: the result is the mean over all real rows of the batch
    params, (x, y) = data
    mask = jnp.asarray(np.random.default_rng(1).random(24) < 0.6, jnp.float64)

    def token_mean(p, b, weighted):
        x, y, mask = b
        h = jnp.tanh(x @ p["w1"] + p["b1"][None, :])
        per = ((h @ p["w2"] - y) ** 2)[:, 0] * mask
        n = jnp.sum(mask)
        loss = jnp.sum(per) / jnp.maximum(n, 1)
        return (loss, n) if weighted else loss

    batch = (x, y, mask)
    loss, grads = jax.jit(fo.microbatch_grad(lambda p, b: token_mean(p, b, True), 4, weighted=True))(
        params, batch
    )
    ref_loss, ref_grads = jax.value_and_grad(lambda p: token_mean(p, batch, False))(params)
    assert abs(float(loss) - float(ref_loss)) <= 1e-13 * abs(float(ref_loss))
    assert rel_err(grads, ref_grads) <= 1e-12
    # with aux as well, and a batch whose weights are all 0: zeros
    fn = fo.microbatch_grad(lambda p, b: (token_mean(p, b, True), 1.0), 4, has_aux=True, weighted=True)
    (loss0, aux), grads0 = jax.jit(fn)(params, (x, y, jnp.zeros(24)))
    assert float(loss0) == 0.0 and all(float(jnp.max(jnp.abs(g))) == 0.0 for g in jax.tree.leaves(grads0))
    np.testing.assert_array_equal(aux, [1.0] * 4)


def test_peak_memory_is_one_micro_batch():
    # activations dominate: 2048 examples x 256 hidden, float32
    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.standard_normal((32, 256)), jnp.float32)}
    params["w2"] = jnp.asarray(rng.standard_normal((256, 256)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2048, 32)), jnp.float32)

    def loss(p, x):
        h = jnp.tanh(jnp.tanh(x @ p["w1"]) @ p["w2"])
        return jnp.mean(h**2)

    def temp(m):
        compiled = jax.jit(fo.microbatch_grad(loss, m)).lower(params, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    one, eight = temp(1), temp(8)
    activations = 2048 * 256 * 4  # one hidden layer of the whole batch
    param_bytes = sum(p.nbytes for p in jax.tree.leaves(params))
    assert one >= 2 * activations, one
    # an eighth of the activations, and the gradient sum the scan carries (and its update)
    assert eight <= one / 8 + 2 * param_bytes, (one, eight, param_bytes)
    assert eight <= one / 4, (one, eight)


def test_errors():
    with pytest.raises(ValueError, match=r"micro_batches must be an integer >= 1, got 0"):
        fo.microbatch_grad(_mse, 0)
    fn = fo.microbatch_grad(lambda p, b: jnp.sum(b["x"]) * p, 4)
    with pytest.raises(
        ValueError, match=r"the batch leaf at \['x'\] has leading dimension 6, not divisible by 4"
    ):
        fn(1.0, {"x": jnp.ones(6)})


# ------------------------------------------------------------- variable lengths, against torch
# A per-token model on padded sequences: each window of micro-batches has a different
# number of real tokens per micro-batch. torch takes (a) one batch of the window and (b)
# transformers' accumulation (each micro-batch's token-loss sum over the window's
# num_items_in_batch, backward without zero_grad, one step); here (c) grad_accumulate
# with reduction="weighted" and (d) microbatch_grad(weighted=True) over the window.

LENGTHS = [[5, 2, 7], [1, 3, 6], [4, 4, 8], [2, 8, 8]]  # per sequence: 4 micro-batches of 3
T, D = 8, 4


def _torch_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1)).double()


def _sequences(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((12, T, D))
    y = rng.standard_normal((12, T, 1))
    mask = (np.arange(T)[None, :] < np.asarray(LENGTHS).reshape(-1)[:, None]).astype(np.float64)
    return x, y, mask


def _jax_token_losses(params, x, y, mask):
    h = jnp.tanh(x @ params["0"]["weight"].T + params["0"]["bias"][None, None, :])
    pred = h @ params["2"]["weight"].T + params["2"]["bias"][None, None, :]
    return ((pred - y) ** 2)[..., 0] * mask


def _torch_token_losses(model, x, y, mask):
    return ((model(torch.tensor(x)) - torch.tensor(y)) ** 2)[..., 0] * torch.tensor(mask)


def _torch_run(micro, windows, sizes):
    model = _torch_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for seed in range(windows):
        x, y, mask = _sequences(seed)
        n_items = mask[: 3 * sizes].sum()
        opt.zero_grad()
        for i in range(sizes if micro else 1):
            part = slice(3 * i, 3 * i + 3) if micro else slice(0, 3 * sizes)
            (_torch_token_losses(model, x[part], y[part], mask[part]).sum() / n_items).backward()
        opt.step()
    return tree_from_module(model)


def _micro_mean(params, batch):
    x, y, mask = batch
    n = jnp.sum(mask)
    return jnp.sum(_jax_token_losses(params, x, y, mask)) / n, n


@pytest.fixture(scope="module")
def torch_runs():
    return {"one batch": _torch_run(False, 2, 4), "num_items_in_batch": _torch_run(True, 2, 4)}


def test_torch_one_batch_equals_num_items_in_batch(torch_runs):
    assert rel_err(torch_runs["num_items_in_batch"], torch_runs["one batch"]) <= 1e-12


@pytest.mark.parametrize("fused", [False, True], ids=["jitted", "fused"])
def test_weighted_accumulation_equals_torch(torch_runs, fused):
    params = tree_from_module(_torch_model())
    tx = fo.grad_accumulate(fo.sgd(lr=0.1, momentum=0.9, fused=fused), every=4, reduction="weighted")
    state = tx.init(params)
    grad = jax.jit(jax.grad(_micro_mean, has_aux=True))
    step = jax.jit(lambda p, g, s, w: fo.step(tx, p, g, s, weight=w))
    for seed in range(2):
        x, y, mask = _sequences(seed)
        for i in range(4):
            part = slice(3 * i, 3 * i + 3)
            g, n = grad(params, (x[part], y[part], mask[part]))
            params, state = step(params, g, state, n)
        assert bool(state.stepped)
    for name, ref in torch_runs.items():
        assert rel_err(params, ref) <= 1e-12, (name, rel_err(params, ref))


def test_microbatch_grad_weighted_equals_torch(torch_runs):
    params = tree_from_module(_torch_model())
    tx = fo.sgd(lr=0.1, momentum=0.9)
    state = tx.init(params)
    grad_fn = jax.jit(fo.microbatch_grad(_micro_mean, 4, weighted=True))
    for seed in range(2):
        _, grads = grad_fn(params, tuple(map(jnp.asarray, _sequences(seed))))
        params, state = fo.step(tx, params, grads, state)
    for name, ref in torch_runs.items():
        assert rel_err(params, ref) <= 1e-12, (name, rel_err(params, ref))


@pytest.mark.parametrize("reduction", ["mean", "weighted"])
def test_a_flushed_partial_window_equals_one_batch_of_its_real_size(reduction):
    # every=4, but the epoch ends after 3 micro-batches: flush steps on those 3 as one batch
    params = tree_from_module(_torch_model())
    tx = fo.grad_accumulate(fo.sgd(lr=0.1, momentum=0.9), every=4, reduction=reduction)
    state = tx.init(params)
    x, y, mask = _sequences(0)
    if reduction == "mean":
        mask = np.ones_like(mask)  # equal sizes: the mean of means is the batch mean
    grad = jax.jit(jax.grad(_micro_mean, has_aux=True))
    for i in range(3):
        part = slice(3 * i, 3 * i + 3)
        g, n = grad(params, (x[part], y[part], mask[part]))
        params, state = fo.step(tx, params, g, state, **({"weight": n} if reduction == "weighted" else {}))
    assert not bool(state.stepped)
    params, state = jax.jit(lambda p, s: fo.flush(tx, p, s))(params, state)
    assert bool(state.stepped)
    model = _torch_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    (_torch_token_losses(model, x[:9], y[:9], mask[:9]).sum() / mask[:9].sum()).backward()
    opt.step()
    assert rel_err(params, tree_from_module(model)) <= 1e-12
