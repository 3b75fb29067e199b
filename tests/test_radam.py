"""radam: parity with torch.optim.RAdam, NumPy reference, validation, meta-gradients."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import functorch_optim as fo
from functorch_optim._registry import get_spec
from tests import adam_family as af
from tests.helpers import leaf_buffers, numpy_per_leaf

NAME = "radam"
GRID = get_spec(NAME).grid
DTYPES = [pytest.param(np.float64, id="float64"), pytest.param(np.float32, id="float32")]


def numpy_radam(params, grads, lr, betas, eps, weight_decay, decoupled_weight_decay, maximize):
    """RAdam (Liu et al. 2020, torch's form: eps scaled by sqrt(1 - beta2^t)) in float64."""
    b1, b2 = betas
    rho_inf = 2 / (1 - b2) - 1

    def rule(p, g, s, t):
        g = -g if maximize else g
        if decoupled_weight_decay:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        s["m"] = b1 * s["m"] + (1 - b1) * g
        s["v"] = b2 * s["v"] + (1 - b2) * g * g
        m_hat = s["m"] / (1 - b1**t)
        rho_t = rho_inf - 2 * t * b2**t / (1 - b2**t)
        if rho_t > 5:
            r = np.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
            return p - lr * m_hat * r * np.sqrt(1 - b2**t) / (np.sqrt(s["v"]) + eps)
        return p - lr * m_hat

    ps, st, _ = numpy_per_leaf(params, grads, rule, lambda p: dict(m=np.zeros_like(p), v=np.zeros_like(p)))
    return ps, leaf_buffers(params, st, {"exp_avg": "m", "exp_avg_sq": "v"})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", GRID, ids=af.config_id)
def test_parity_with_torch(config, dtype):
    af.assert_parity(NAME, config, dtype)


@pytest.mark.parametrize("config", [c for c in GRID if c["weight_decay"] and c["maximize"]], ids=af.config_id)
def test_numpy_reference(config):
    af.assert_numpy_reference(NAME, config, numpy_radam)


def test_rectification_starts_when_rho_exceeds_5():
    # betas (0.9, 0.999): rho_5 = 4.996 (plain step), rho_6 = 5.994 (rectified step)
    tx = fo.radam(lr=1.0, eps=0.0)
    p = {"w": jnp.zeros(2)}
    s = tx.init(p)
    moves = []
    for _ in range(6):
        new, s = fo.step(tx, p, {"w": jnp.ones(2)}, s)
        moves.append(float(p["w"][0] - new["w"][0]))
        p = new
    # g = 1 always: m_hat = 1, so a plain step moves by lr = 1 exactly
    assert np.allclose(moves[:5], 1.0, rtol=0, atol=1e-12)
    rho_inf, b2 = 1999.0, 0.999
    rho6 = rho_inf - 12 * b2**6 / (1 - b2**6)
    r = np.sqrt((rho6 - 4) * (rho6 - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho6))
    # v_6 = 1 - b2^6, so sqrt(1 - b2^6) / sqrt(v_6) = 1 and the move is r
    assert abs(moves[5] - r) <= 1e-12 and r < 0.1


def test_none_gradients_follow_torch():
    af.none_gradients_vs_torch(NAME, {"lr": 0.05, "weight_decay": 0.1, "decoupled_weight_decay": True})


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
        NAME, {"weight_decay": 0.1}, {"lr": 0.02, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.2}
    )


META_CONFIGS = [{}, {"weight_decay": 0.1, "decoupled_weight_decay": True, "maximize": True}]


@pytest.mark.parametrize("index", range(len(META_CONFIGS)), ids=[af.config_id(c) for c in META_CONFIGS])
def test_meta_gradients_match_torch_differentiable(index):
    # 8 steps: the rectified branch starts at step 6 with the default betas
    af.assert_meta_grads(NAME, META_CONFIGS, index, lr=0.05, default_dtype=torch.float32, steps=8)
