"""adamax: parity with torch.optim.Adamax, NumPy reference, validation, meta-gradients."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import functorch_optim as fo
from functorch_optim._registry import get_spec
from tests import adam_family as af
from tests.helpers import leaf_buffers, numpy_per_leaf

NAME = "adamax"
GRID = get_spec(NAME).grid
DTYPES = [pytest.param(np.float64, id="float64"), pytest.param(np.float32, id="float32")]


def numpy_adamax(params, grads, lr, betas, eps, weight_decay, maximize):
    """Adamax (Kingma & Ba, section 7) in float64, eps inside the maximum as torch has it."""
    b1, b2 = betas

    def rule(p, g, s, t):
        g = (-g if maximize else g) + weight_decay * p
        s["m"] = b1 * s["m"] + (1 - b1) * g
        s["u"] = np.maximum(b2 * s["u"], np.abs(g) + eps)
        return p - lr / (1 - b1**t) * s["m"] / s["u"]

    ps, st, _ = numpy_per_leaf(params, grads, rule, lambda p: dict(m=np.zeros_like(p), u=np.zeros_like(p)))
    return ps, leaf_buffers(params, st, {"exp_avg": "m", "exp_inf": "u"})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", GRID, ids=af.config_id)
def test_parity_with_torch(config, dtype):
    af.assert_parity(NAME, config, dtype)


@pytest.mark.parametrize(
    "config", [c for c in GRID if c["weight_decay"] and c["betas"][0] == 0.5], ids=af.config_id
)
def test_numpy_reference(config):
    af.assert_numpy_reference(NAME, config, numpy_adamax)


def test_eps_inside_the_maximum():
    # a zero gradient leaves exp_inf = max(beta2 * 0, |0| + eps) = eps, not 0
    tx = fo.adamax(eps=1e-3)
    p = {"w": jnp.array([1.0, -1.0])}
    p, s = fo.step(tx, p, {"w": jnp.array([0.0, 0.0])}, tx.init(p))
    assert s.exp_inf["w"].tolist() == [1e-3, 1e-3]
    assert p["w"].tolist() == [1.0, -1.0]


def test_none_gradients_follow_torch():
    af.none_gradients_vs_torch(NAME, {"lr": 0.05, "weight_decay": 0.1})


def test_bfloat16_rounds_per_op_like_torch():
    max_ulp, differing = af.bf16_vs_torch(NAME, {"lr": 0.01, "weight_decay": 0.1})
    assert max_ulp <= 1 and differing <= 0.05, (max_ulp, differing)


@pytest.mark.parametrize("row", af.common_error_rows(), ids=af.row_id)
def test_validation_matches_torch(row):
    af.check_error_row(NAME, *row)


def test_signature_matches_torch():
    af.assert_signature_matches_torch(NAME)


def test_no_recompile_on_hparam_change():
    af.assert_no_recompile(
        NAME, {"weight_decay": 0.1}, {"lr": 0.02, "betas": (0.8, 0.99), "eps": 1e-4, "weight_decay": 0.2}
    )


META_CONFIGS = [{}, {"weight_decay": 0.1, "maximize": True}]


@pytest.mark.parametrize("index", range(len(META_CONFIGS)), ids=[af.config_id(c) for c in META_CONFIGS])
def test_meta_gradients_match_torch_differentiable(index):
    # torch's differentiable Adamax rejects a tensor lr (addcdiv_'s value must be a Number):
    # d loss / d params only
    af.assert_meta_grads(NAME, META_CONFIGS, index, lr=0.05, default_dtype=torch.float32, lr_grad=False)
