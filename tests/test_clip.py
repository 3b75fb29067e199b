"""clip_grad_norm / clip_grad_value against torch.nn.utils, float64 and float32."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import functorch_optim as fo
from tests.helpers import TREE_SHAPES, make_tree, rel_err


def _torch_clip(grads, fn):
    leaves, treedef = jax.tree.flatten(grads, is_leaf=lambda x: x is None)
    params = []
    for g in leaves:
        g = None if g is None else np.array(g)
        p = torch.zeros(np.shape(g), dtype=None if g is None else torch.from_numpy(g).dtype)
        p.requires_grad_(True)
        p.grad = None if g is None else torch.tensor(g)
        params.append(p)
    out = fn(params)
    clipped = treedef.unflatten([None if p.grad is None else p.grad.numpy() for p in params])
    return clipped, out


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0, 0.5], ids=lambda p: f"p={p}")
@pytest.mark.parametrize("max_norm", [0.5, 1e4], ids=["clips", "no-clip"])
def test_clip_grad_norm_matches_torch(norm_type, max_norm, dtype):
    rng = np.random.default_rng(0)
    grads = make_tree(TREE_SHAPES["nested"], rng, dtype)
    grads["layer"]["b"] = None  # a parameter without gradient is skipped
    ref, ref_norm = _torch_clip(
        grads, lambda ps: torch.nn.utils.clip_grad_norm_(ps, max_norm, norm_type, foreach=False)
    )
    got, norm = fo.clip_grad_norm(jax.tree.map(jnp.asarray, grads), max_norm, norm_type)
    tol = 1e-15 if dtype == np.float64 else 1e-6
    assert got["layer"]["b"] is None
    assert got["layer"]["w"].dtype == dtype
    assert abs(float(norm) - float(ref_norm)) <= tol * float(ref_norm)
    assert rel_err(got, ref) <= 2 * tol
    if max_norm == 1e4:
        assert rel_err(got, grads) == 0.0  # coefficient clamped to exactly 1


def test_clip_grad_norm_uses_torchs_epsilon():
    g = {"w": jnp.array([3.0, 4.0])}
    got, norm = fo.clip_grad_norm(g, 5.0)
    # 5 / (5 + 1e-6) < 1: torch scales even at the limit; optax does not
    assert float(norm) == 5.0 and float(got["w"][0]) == 3.0 * ((1 / (5.0 + 1e-6)) * 5.0) < 3.0 - 1e-7
    ref, _ = _torch_clip(g, lambda ps: torch.nn.utils.clip_grad_norm_(ps, 5.0))
    assert np.array_equal(np.asarray(got["w"]), ref["w"])
    opt, _ = optax.clip_by_global_norm(5.0).update(g, optax.EmptyState())
    assert abs(float(opt["w"][0]) - 3.0) <= 1e-15


def test_clip_grad_value_matches_torch():
    rng = np.random.default_rng(1)
    grads = make_tree(TREE_SHAPES["mixed"], rng, np.float32)
    grads[0][0, 0] = np.nan
    ref, _ = _torch_clip(grads, lambda ps: torch.nn.utils.clip_grad_value_(ps, 0.3, foreach=False))
    got = fo.clip_grad_value(jax.tree.map(jnp.asarray, grads), 0.3)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)  # NaN stays NaN, as torch
    assert np.nanmax(np.abs(np.asarray(got[0]))) == np.float32(0.3)


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_error_if_nonfinite_raises_torchs_error(bad):
    g = {"w": np.array([1.0, bad])}
    with pytest.raises(RuntimeError) as ref:
        _torch_clip(g, lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0, error_if_nonfinite=True))
    with pytest.raises(RuntimeError, match=re.escape(str(ref.value))):
        fo.clip_grad_norm(jax.tree.map(jnp.asarray, g), 1.0, error_if_nonfinite=True)
    # under jit the check runs with the computation
    with pytest.raises(Exception, match=re.escape("is non-finite, so it cannot be clipped")):
        jax.block_until_ready(jax.jit(lambda g: fo.clip_grad_norm(g, 1.0, error_if_nonfinite=True))(g))
    # without the flag torch scales by the non-finite norm anyway; so do we
    ref_g, ref_n = _torch_clip(g, lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0))
    got, n = fo.clip_grad_norm(jax.tree.map(jnp.asarray, g), 1.0)
    np.testing.assert_array_equal(np.asarray(got["w"]), ref_g["w"])
    assert np.isnan(float(n)) == np.isnan(float(ref_n))


def test_no_gradients_gives_zero_norm():
    got, norm = fo.clip_grad_norm({"w": None}, 1.0)
    assert got == {"w": None} and float(norm) == 0.0


def test_transforms_in_optax_chain_match_torch_training():
    rng = np.random.default_rng(2)
    p0 = rng.standard_normal(5)
    grads = 3 * rng.standard_normal((20, 5))
    tx = optax.chain(
        fo.clip_grad_value_transform(2.0), fo.clip_grad_norm_transform(1.5), fo.sgd(lr=0.1, momentum=0.9)
    )
    params = {"w": jnp.asarray(p0)}
    state = tx.init(params)
    step = jax.jit(lambda p, g, s: fo.step(tx, p, g, s))
    t = torch.tensor(p0, requires_grad=True)
    opt = torch.optim.SGD([t], lr=0.1, momentum=0.9, foreach=False)
    for g in grads:
        params, state = step(params, {"w": jnp.asarray(g)}, state)
        t.grad = torch.tensor(g)
        torch.nn.utils.clip_grad_value_([t], 2.0)
        ref_norm = torch.nn.utils.clip_grad_norm_([t], 1.5)
        opt.step()
        assert abs(float(state[1].total_norm) - float(ref_norm)) <= 1e-6 * float(ref_norm)
    assert rel_err(params["w"], t.detach().numpy()) <= 1e-14


@pytest.mark.parametrize(
    "dtype", [np.float64, np.float32, jnp.bfloat16], ids=["float64", "float32", "bfloat16"]
)
def test_clip_transform_state_keeps_the_gradients_dtype(dtype):
    tx = fo.clip_grad_norm_transform(1.0)
    params = {"w": jnp.zeros(3, dtype)}
    state = tx.init(params)
    assert state.total_norm.dtype == dtype
    g = {"w": jnp.asarray(np.array([1.0, 2.0, 2.0]) / 3 + 1e-9, dtype)}
    _, state = tx.update(g, state)
    assert state.total_norm.dtype == dtype
    assert float(state.total_norm) == float(fo.get_total_norm(g))  # not rounded through float32
