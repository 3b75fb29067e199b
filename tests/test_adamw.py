"""adamw: parity with torch.optim.AdamW, NumPy reference, validation, meta-gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import functorch_optim as fo
from functorch_optim._registry import get_spec
from tests import adam_family as af
from tests.helpers import assert_bitwise_equal, leaf_buffers, numpy_per_leaf, rel_err, run_jitted, run_torch

NAME = "adamw"
GRID = get_spec(NAME).grid
DTYPES = [pytest.param(np.float64, id="float64"), pytest.param(np.float32, id="float32")]


def numpy_adamw(params, grads, lr, betas, eps, weight_decay, amsgrad, maximize):
    """AdamW (Loshchilov & Hutter) in float64: decay the parameter, then the Adam step."""
    b1, b2 = betas

    def rule(p, g, s, t):
        g = -g if maximize else g
        p = p * (1 - lr * weight_decay)
        s["m"] = b1 * s["m"] + (1 - b1) * g
        s["v"] = b2 * s["v"] + (1 - b2) * g * g
        s["vmax"] = np.maximum(s["vmax"], s["v"])
        v_hat = (s["vmax"] if amsgrad else s["v"]) / (1 - b2**t)
        return p - lr * (s["m"] / (1 - b1**t)) / (np.sqrt(v_hat) + eps)

    init = lambda p: dict(m=np.zeros_like(p), v=np.zeros_like(p), vmax=np.zeros_like(p))
    ps, st, _ = numpy_per_leaf(params, grads, rule, init)
    names = {"exp_avg": "m", "exp_avg_sq": "v"}
    if amsgrad:
        names["max_exp_avg_sq"] = "vmax"
    return ps, leaf_buffers(params, st, names)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", GRID, ids=af.config_id)
def test_parity_with_torch(config, dtype):
    af.assert_parity(NAME, config, dtype)


@pytest.mark.parametrize(
    "config", [c for c in GRID if c["weight_decay"] and c["betas"][0] == 0.5], ids=af.config_id
)
def test_numpy_reference(config):
    af.assert_numpy_reference(NAME, config, numpy_adamw)


def test_is_adam_with_decoupled_weight_decay():
    # one rule: adamw(...) and adam(..., decoupled_weight_decay=True) give identical numbers
    params, grads = af.stream(np.float64, seed=4, shape=af.EAGER_SHAPE, steps=6, none_every=0)
    kw = {"lr": 0.1, "weight_decay": 0.3, "amsgrad": True}
    pw, sw = af.run_jax_eager(fo.adamw(**kw), params, grads)
    pa, sa = af.run_jax_eager(fo.adam(decoupled_weight_decay=True, **kw), params, grads)
    assert jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.all(x == y)), (pw, sw.buffers), (pa, sa.buffers)))
    pc, _ = af.run_jax_eager(fo.adam(**kw), params, grads)  # coupled L2: different numbers
    assert rel_err(pc, pw) > 1e-3
    assert (sw.hparams.kind, sa.hparams.kind) == ("AdamW", "Adam")


# hyperparameters whose bias corrections, step size and decay factor are exact (powers
# of two, eps 0): torch's first step then rounds only where the rules round, and the
# decayed parameter ``param.mul_(1 - lr * wd)`` is stored before the update is added
EXACT = {"lr": 2**-4, "betas": (0.5, 0.75), "eps": 0.0, "weight_decay": 0.5}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("torch_name", "make"),
    [
        ("AdamW", lambda **kw: fo.adamw(**kw)),
        ("AdamW", lambda **kw: fo.adamw(fused=False, **kw)),
        ("NAdam", lambda **kw: fo.nadam(decoupled_weight_decay=True, **kw)),
        ("RAdam", lambda **kw: fo.radam(decoupled_weight_decay=True, **kw)),
    ],
    ids=["adamw", "adamw-rule", "nadam", "radam"],
)
def test_decoupled_decay_is_stored_before_the_update_as_torch(torch_name, make, dtype):
    # every element of the first step equals torch's: the decayed parameter rounded, then
    # the update added (contracted into one multiply-add, as the rules did, 2-30 % of
    # the elements differed by a rounding); "k" has rows of 7 (XLA's loops vectorize
    # across its rows)
    rng = np.random.default_rng(2)
    params = {"b": rng.standard_normal(4099) * 3, "k": rng.standard_normal((37, 7)) * 3}
    params = {k: v.astype(dtype) for k, v in params.items()}
    grads = [{k: rng.standard_normal(v.shape).astype(dtype) for k, v in params.items()}]
    decoupled = {} if torch_name == "AdamW" else {"decoupled_weight_decay": True}
    make_torch = lambda ts: getattr(torch.optim, torch_name)(ts, foreach=False, **EXACT, **decoupled)
    assert_bitwise_equal(run_jitted(make(**EXACT), params, grads)[0], run_torch(make_torch, params, grads)[0])


def test_none_gradients_follow_torch():
    af.none_gradients_vs_torch(NAME, {"lr": 0.05, "amsgrad": True})


def test_bfloat16_rounds_per_op_like_torch():
    max_ulp, differing = af.bf16_vs_torch(NAME, {"lr": 0.01, "amsgrad": True})
    assert max_ulp <= 1 and differing <= 0.05, (max_ulp, differing)


@pytest.mark.parametrize("row", af.common_error_rows(adam_rules=True), ids=af.row_id)
def test_validation_matches_torch(row):
    af.check_error_row(NAME, *row)


def test_signature_matches_torch():
    af.assert_signature_matches_torch(NAME)
    assert float(fo.get_hparams(fo.adamw().init({"w": jnp.zeros(1)}))["weight_decay"]) == 1e-2


def test_no_recompile_on_hparam_change():
    af.assert_no_recompile(NAME, {}, {"lr": 0.02, "betas": (0.8, 0.99), "weight_decay": 0.2})


META_CONFIGS = [{}, {"weight_decay": 0.1, "maximize": True}]


@pytest.mark.parametrize("index", range(len(META_CONFIGS)), ids=[af.config_id(c) for c in META_CONFIGS])
def test_meta_gradients_match_torch_differentiable(index):
    # torch's differentiable path computes the step's scalars from its float32 step tensor
    af.assert_meta_grads(NAME, META_CONFIGS, index, lr=0.05, default_dtype=torch.float32)
