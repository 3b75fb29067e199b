"""nadam: parity with torch.optim.NAdam, NumPy reference, validation, meta-gradients."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import functorch_optim as fo
from functorch_optim._registry import get_spec
from tests import adam_family as af
from tests.helpers import leaf_buffers, numpy_per_leaf

NAME = "nadam"
GRID = get_spec(NAME).grid
DTYPES = [pytest.param(np.float64, id="float64"), pytest.param(np.float32, id="float32")]


def numpy_nadam(
    params, grads, lr, betas, eps, weight_decay, momentum_decay, decoupled_weight_decay, maximize
):
    """NAdam (Dozat 2016, torch's schedule) in float64; the running product mu_product is
    kept in float32, as torch keeps it in its default dtype."""
    b1, b2 = betas

    def rule(p, g, s, t):
        g = -g if maximize else g
        if decoupled_weight_decay:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        mu = b1 * (1 - 0.5 * 0.96 ** (t * momentum_decay))
        mu_next = b1 * (1 - 0.5 * 0.96 ** ((t + 1) * momentum_decay))
        s["mu_prod"] = np.float32(s["mu_prod"] * np.float32(mu))
        prod = float(s["mu_prod"])
        s["m"] = b1 * s["m"] + (1 - b1) * g
        s["v"] = b2 * s["v"] + (1 - b2) * g * g
        denom = np.sqrt(s["v"] / (1 - b2**t)) + eps
        p = p - lr * (1 - mu) / (1 - prod) * g / denom
        return p - lr * mu_next / (1 - prod * mu_next) * s["m"] / denom

    init = lambda p: dict(m=np.zeros_like(p), v=np.zeros_like(p), mu_prod=np.float32(1.0))
    ps, st, _ = numpy_per_leaf(params, grads, rule, init)
    for s in st:
        s["mu_prod"] = np.asarray(s["mu_prod"])
    return ps, leaf_buffers(params, st, {"exp_avg": "m", "exp_avg_sq": "v", "mu_product": "mu_prod"})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", GRID, ids=af.config_id)
def test_parity_with_torch(config, dtype):
    af.assert_parity(NAME, config, dtype)


@pytest.mark.parametrize("config", [c for c in GRID if c["weight_decay"] and c["maximize"]], ids=af.config_id)
def test_numpy_reference(config):
    af.assert_numpy_reference(NAME, config, numpy_nadam)


def test_mu_product_is_float32_even_for_float64_params():
    tx = fo.nadam(lr=0.1, momentum_decay=0.3)
    p = {"w": jnp.zeros(2, jnp.float64)}
    s = tx.init(p)
    expected = np.float32(1.0)
    for t in range(1, 4):
        p, s = fo.step(tx, p, {"w": jnp.ones(2)}, s)
        expected = np.float32(expected * np.float32(0.9 * (1 - 0.5 * 0.96 ** (t * 0.3))))
    assert s.mu_product["w"].dtype == jnp.float32 and s.mu_product["w"].shape == ()
    assert s.mu_product["w"].item() == float(expected)
    assert p["w"].dtype == jnp.float64


def test_none_gradients_follow_torch():
    af.none_gradients_vs_torch(NAME, {"lr": 0.05, "weight_decay": 0.1, "momentum_decay": 0.05})


def test_bfloat16_rounds_per_op_like_torch():
    max_ulp, differing = af.bf16_vs_torch(NAME, {"lr": 0.01, "weight_decay": 0.1})
    assert max_ulp <= 1 and differing <= 0.05, (max_ulp, differing)


@pytest.mark.parametrize("row", af.common_error_rows(momentum_decay=True), ids=af.row_id)
def test_validation_matches_torch(row):
    af.check_error_row(NAME, *row)


def test_signature_matches_torch():
    af.assert_signature_matches_torch(NAME)


def test_no_recompile_on_hparam_change():
    af.assert_no_recompile(
        NAME,
        {"weight_decay": 0.1},
        {"lr": 0.02, "betas": (0.8, 0.99), "momentum_decay": 0.1, "weight_decay": 0.2},
    )


META_CONFIGS = [{}, {"weight_decay": 0.1}, {"weight_decay": 0.1, "decoupled_weight_decay": True}]


@pytest.mark.parametrize("index", range(len(META_CONFIGS)), ids=[af.config_id(c) for c in META_CONFIGS])
def test_meta_gradients_match_torch_differentiable(index):
    # torch's default dtype left at float32: mu_product is float32, and nadam(differentiable=
    # True) rounds 1 - mu_product and mu_product * mu_next there as torch's path does
    af.assert_meta_grads(NAME, META_CONFIGS, index, lr=0.05, default_dtype=torch.float32)
