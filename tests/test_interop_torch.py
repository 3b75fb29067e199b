"""functorch_optim.interop.torch: torch weights <-> nested JAX pytrees by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functorch_optim as fo
from functorch_optim.interop.torch import (
    flatten_names,
    grads_from_module,
    load_tree_into_module,
    tree_from_module,
    tree_from_state_dict,
    tree_to_state_dict,
    unflatten_names,
)

torch = pytest.importorskip("torch")


def _model(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 3),
        torch.nn.BatchNorm1d(3),
        torch.nn.Tanh(),
        torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1, bias=False)),
    )
    return model.to(dtype)


def test_parameters_become_nested_dicts_by_name():
    model = _model()
    tree = tree_from_module(model)
    flat = flatten_names(tree)
    named = dict(model.named_parameters())
    assert sorted(flat) == sorted(named)
    assert set(tree) == {"0", "1", "3"}
    assert set(tree["3"]) == {"0", "1"} and set(tree["3"]["1"]) == {"weight"}
    for name, p in named.items():
        np.testing.assert_array_equal(np.asarray(flat[name]), p.detach().numpy())
        assert flat[name].dtype == jnp.float64


def test_buffers_and_state_dict():
    model = _model()
    with_buffers = flatten_names(tree_from_module(model, buffers=True))
    from_sd = flatten_names(tree_from_state_dict(model.state_dict()))
    assert sorted(with_buffers) == sorted(from_sd) == sorted(model.state_dict())
    assert from_sd["1.num_batches_tracked"].dtype == jnp.int64
    np.testing.assert_array_equal(np.asarray(from_sd["1.running_var"]), np.ones(3))


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_round_trip_is_exact(dtype):
    src = _model(seed=1)
    dst = _model(seed=2)
    tree = tree_from_state_dict(src.state_dict(), dtype=dtype)
    assert {x.dtype for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)} == {
        np.dtype(dtype)
    }
    ids_before = [id(p) for p in dst.parameters()]
    load_tree_into_module(dst, tree)
    assert [id(p) for p in dst.parameters()] == ids_before  # parameters keep identity
    for (n, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items(), strict=True):
        tol = 0 if dtype == np.float64 else 1e-7
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=tol, atol=0, err_msg=n)
    sd = tree_to_state_dict(tree, dtype=torch.float64)
    assert sorted(sd) == sorted(src.state_dict())
    assert sd["0.weight"].dtype == torch.float64
    assert sd["1.num_batches_tracked"].dtype == torch.int64
    model = _model(seed=3)
    model.load_state_dict(sd)
    x = torch.randn(5, 4, dtype=torch.float64)
    src.eval(), model.eval()
    np.testing.assert_allclose(src(x).detach().numpy(), model(x).detach().numpy(), rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("fused", [None, False], ids=["default", "rule"])
@pytest.mark.parametrize("jitted", [True, False], ids=["jit", "eager"])
def test_grads_and_a_step_from_identical_weights(dtype, fused, jitted):
    # a torch module's own parameters and backward() gradients, SGD with momentum: the
    # parameters equal torch's bit for bit after every step (their shapes (4, 3), (1, 4)
    # have short rows, where XLA's loop vectorizes across rows)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).to(dtype)
    model[2].bias.requires_grad_(False)  # a frozen parameter: grad None on both sides
    params = tree_from_module(model)
    x, y = torch.randn(8, 3, dtype=dtype), torch.randn(8, 1, dtype=dtype)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    tx = fo.sgd(lr=0.1, momentum=0.9, fused=fused)
    state = tx.init(params)
    # jitted, as a training loop runs it, and called as it is, as a notebook does (op by
    # op XLA would contract nothing: ``param.add_(buf, alpha=-lr)`` was then two
    # roundings where torch's is one; an eager step runs the compiled one)
    step = lambda p, g, s: fo.step(tx, p, g, s)
    if jitted:
        step = jax.jit(step)
    for _ in range(5):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads = grads_from_module(model)
        assert grads["2"]["bias"] is None
        opt.step()
        params, state = step(params, grads, state)
        back = flatten_names(tree_from_module(model))
        for name, value in flatten_names(params).items():
            np.testing.assert_array_equal(np.asarray(value), np.asarray(back[name]), err_msg=name)


def test_unflatten_and_flatten_are_inverse():
    flat = {"a.b.c": 1, "a.b.d": 2, "a.e": 3, "f": 4}
    tree = unflatten_names(flat)
    assert tree == {"a": {"b": {"c": 1, "d": 2}, "e": 3}, "f": 4}
    assert dict(flatten_names(tree)) == flat
    assert unflatten_names({"x/y": 1}, sep="/") == {"x": {"y": 1}}
    assert dict(flatten_names({"l": [1, (2, 3)]})) == {"l.0": 1, "l.1.0": 2, "l.1.1": 3}


def test_conflicting_names_are_reported():
    with pytest.raises(ValueError, match=r"'a\.b' lies under 'a', which is itself a value"):
        unflatten_names({"a": 1, "a.b": 2})
    with pytest.raises(ValueError, match="'a' is a prefix of other names"):
        unflatten_names({"a.b": 2, "a": 1})


def test_load_errors_name_the_problem_before_copying():
    lin = torch.nn.Linear(2, 1).double()
    before = lin.weight.detach().clone()
    with pytest.raises(ValueError, match=r"missing names \['bias'\], unexpected names \['extra'\]"):
        load_tree_into_module(lin, {"weight": jnp.zeros((1, 2)), "extra": jnp.zeros(1)})
    with pytest.raises(
        ValueError, match=r"'weight' has shape \(2, 1\), but the module's tensor has shape \(1, 2\)"
    ):
        load_tree_into_module(lin, {"weight": jnp.zeros((2, 1)), "bias": jnp.zeros(1)})
    assert torch.equal(lin.weight.detach(), before)
    load_tree_into_module(lin, {"weight": jnp.full((1, 2), 2.0)}, strict=False)
    assert lin.weight.detach().tolist() == [[2.0, 2.0]]
