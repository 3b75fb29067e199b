"""The flat layout: one buffer per dtype, recovered exactly, stepped bit-for-bit like the tree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functorch_optim as fo


def _params():
    rng = np.random.default_rng(0)
    return {
        "enc": {"w": jnp.asarray(rng.standard_normal((4, 5)), jnp.float32), "b": jnp.zeros(5, jnp.float32)},
        "head": [jnp.asarray(rng.standard_normal(3)), jnp.asarray(rng.standard_normal((2, 2)), jnp.float32)],
        "scale": jnp.asarray(0.5, jnp.bfloat16),
    }


def _grads(params, k):
    return jax.tree.map(lambda p: jnp.sin(p * (k + 1) + k).astype(p.dtype), params)


def test_ravel_round_trip_keeps_structure_dtypes_and_order():
    params = _params()
    flat, unravel = fo.ravel_by_dtype(params)
    assert sorted(flat) == ["bfloat16", "float32", "float64"]
    assert flat["float32"].shape == (20 + 5 + 4,)
    # leaves in jax.tree.leaves order: enc.b, enc.w, head[1] for float32
    np.testing.assert_array_equal(flat["float32"][:5], np.zeros(5))
    np.testing.assert_array_equal(flat["float32"][5:25], np.asarray(params["enc"]["w"]).ravel())
    back = unravel(flat)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64))


TRANSFORMS = {
    "sgd-momentum-wd": lambda: fo.sgd(lr=0.1, momentum=0.9, weight_decay=0.01, dampening=0.2),
    "sgd-nesterov-maximize": lambda: fo.sgd(lr=0.05, momentum=0.8, nesterov=True, maximize=True),
    "accumulate-sgd": lambda: fo.grad_accumulate(fo.sgd(lr=0.1, momentum=0.9, weight_decay=0.01), every=2),
}
if hasattr(fo, "adam"):
    TRANSFORMS["adam"] = lambda: fo.adam(lr=1e-2)


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_flat_step_is_bit_identical_to_the_tree_step(name):
    tx = TRANSFORMS[name]()
    params = _params()
    flat, unravel = fo.ravel_by_dtype(params)
    tree_state, flat_state = tx.init(params), tx.init(flat)
    step = jax.jit(fo.step, static_argnums=0)
    for k in range(4):
        params, tree_state = step(tx, params, _grads(params, k), tree_state)
        flat, flat_state = step(tx, flat, unravel.ravel(_grads(unravel(flat), k)), flat_state)
    for a, b in zip(jax.tree.leaves(unravel(flat)), jax.tree.leaves(params), strict=True):
        assert a.dtype == b.dtype
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert float(jnp.max(jnp.abs(params["enc"]["w"] - _params()["enc"]["w"]))) > 1e-2


def test_gradient_through_unravel_is_flat():
    params = _params()
    flat, unravel = fo.ravel_by_dtype(params)

    def loss(tree):
        return sum(
            jnp.sum(jnp.sin(x.astype(jnp.float64)) * (i + 1)) for i, x in enumerate(jax.tree.leaves(tree))
        )

    g_flat = jax.grad(lambda f: loss(unravel(f)))(flat)
    g_tree = unravel.ravel(jax.grad(loss)(params))
    assert set(g_flat) == set(g_tree)
    for k in g_flat:
        np.testing.assert_array_equal(np.asarray(g_flat[k], np.float64), np.asarray(g_tree[k], np.float64))
    # per dtype one split forward and one concatenate back: a slice per leaf would come
    # back as a pad per leaf, each the whole buffer's size, summed (3x slower end to end)
    program = str(jax.make_jaxpr(jax.grad(lambda f: loss(unravel(f))))(flat))
    several = sum(len([x for x in jax.tree.leaves(params) if x.dtype == v.dtype]) > 1 for v in flat.values())
    assert several >= 1
    assert program.count("split[") == len(flat) and program.count("concatenate[") == several
    assert " pad[" not in program and "add_any" not in program


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="optimizer got an empty parameter list"):
        fo.ravel_by_dtype({})
    with pytest.raises(ValueError, match=r"parameter at \['n'\] has dtype int32"):
        fo.ravel_by_dtype({"n": jnp.zeros(2, jnp.int32)})
    _, unravel = fo.ravel_by_dtype({"w": jnp.zeros(3)})
    with pytest.raises(ValueError, match=r"a leaf has shape \(4,\), expected \(3,\)"):
        unravel.ravel({"w": jnp.zeros(4)})


def test_a_torch_modules_parameters_flat_step_like_torch_bit_for_bit():
    # the layout as a port uses it: a torch module's own parameters (two dtypes, in
    # named_parameters() order) and backward() gradients, packed with ravel, AdamW
    # stepped in the flat buffers; unravelled, the parameters equal torch's after every step
    torch = pytest.importorskip("torch")
    from functorch_optim.interop.torch import flatten_names, grads_from_module, tree_from_module

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(
                torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)
            ).double()
            self.temperature = torch.nn.Parameter(torch.linspace(0.5, 1.5, 2, dtype=torch.float32))

        def forward(self, x):
            return self.body(x) * self.temperature.double()

    torch.manual_seed(0)
    model = Model()
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    flat, unravel = fo.ravel_by_dtype(tree_from_module(model))
    assert sorted(flat) == ["float32", "float64"] and flat["float64"].shape == (4 * 3 + 4 + 2 * 4 + 2,)
    tx = fo.adamw(lr=0.05)
    state = tx.init(flat)
    step = jax.jit(lambda p, g, s: fo.step(tx, p, g, s))
    for _ in range(5):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        flat, state = step(flat, unravel.ravel(grads_from_module(model)), state)
        opt.step()
        back = flatten_names(tree_from_module(model))
        ours = flatten_names(unravel(flat))
        assert list(ours) == list(back)
        for name, value in ours.items():
            np.testing.assert_array_equal(np.asarray(value), np.asarray(back[name]), err_msg=name)
