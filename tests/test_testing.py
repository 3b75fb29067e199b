"""functorch_optim.testing: side-by-side reports and assert_matches_torch."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functorch_optim as fo
from functorch_optim._registry import OptimizerSpec
from functorch_optim.testing import (
    DEFAULT_RTOL,
    LeafError,
    assert_matches_torch,
    compare_with_torch,
)
from tests.helpers import TREE_SHAPES, grad_stream, make_tree, rel_err, run_torch

torch = pytest.importorskip("torch")

STEPS = 8


def _params(shape="nested", seed=0):
    return make_tree(TREE_SHAPES[shape], np.random.default_rng(seed))


def _spec_with(name, **override):
    """An SGD spec whose functorch_optim side silently uses other hyperparameters."""
    return OptimizerSpec(name, lambda **kw: fo.sgd(**{**kw, **override}), "SGD", ("momentum_buffer",), ({},))


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize(
    "config",
    [
        {"lr": 0.1},
        {"lr": 0.05, "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.05},
        {"lr": 0.1, "momentum": 0.9, "nesterov": True, "maximize": True},
    ],
    ids=["plain", "damped-wd", "nesterov-max"],
)
def test_sgd_matches_torch_on_a_gradient_stream(config, dtype):
    params = _params()
    grads = grad_stream(params, STEPS, seed=1, none_every=3)
    report = assert_matches_torch("sgd", params, grads, dtype=dtype, **config)
    assert report.steps == STEPS
    assert report.dtype == np.dtype(dtype).name
    assert report.max_rel <= DEFAULT_RTOL[report.dtype]
    # each record's scale is the largest |torch param| so far (initial value included),
    # from independent torch runs of every prefix of the stream
    running = [float(np.max(np.abs(x))) for x in jax.tree.leaves(params)]
    for t in range(1, STEPS + 1):
        prefix, _ = run_torch(
            lambda ts: torch.optim.SGD(ts, foreach=False, **config), params, grads[:t], dtype=dtype
        )
        running = [
            max(r, float(np.max(np.abs(x)))) for r, x in zip(running, jax.tree.leaves(prefix), strict=True)
        ]
        got = [r.scale for r in report.records if r.step == t and r.kind == "param"]
        np.testing.assert_allclose(got, running, rtol=1e-6 if dtype == np.float32 else 1e-15)


def test_records_cover_every_step_leaf_and_buffer():
    params = _params()
    grads = grad_stream(params, 4, seed=2)
    report = compare_with_torch("SGD", params, grads, lr=0.1, momentum=0.9)
    kinds = {(r.step, r.kind) for r in report.records}
    assert kinds == {(t, k) for t in range(1, 5) for k in ("param", "momentum_buffer")}
    assert len(report.records) == 4 * 3 * 2  # steps x leaves x (param, buffer)
    paths = sorted({r.path for r in report.records})
    assert paths == ["['layer']['b']", "['layer']['w']", "['scale']"]
    assert len(report.per_step()) == 4
    assert max(report.per_step()) == report.max_rel


def test_leaf_without_gradient_has_no_torch_state_to_compare():
    params = {"a": np.ones(3), "b": np.ones(2)}
    grads = [{"a": np.ones(3), "b": None}, {"a": np.ones(3), "b": np.full(2, 2.0)}]
    report = compare_with_torch("sgd", params, grads, lr=0.5, momentum=0.9)
    step1 = [(r.kind, r.path) for r in report.records if r.step == 1]
    assert step1 == [("param", "['a']"), ("param", "['b']"), ("momentum_buffer", "['a']")]
    # b's first gradient arrives at step 2: both libraries seed the buffer with it
    buf_b = [r for r in report.records if r.kind == "momentum_buffer" and r.path == "['b']"]
    assert [r.step for r in buf_b] == [2]
    assert buf_b[0].abs_err == 0.0 and buf_b[0].scale == 2.0


def test_errors_are_measured_exactly():
    # functorch_optim side steps with lr * (1 + 1e-3): the step-1 error is known in closed form
    params = {"w": np.array([1.0, -2.0, 3.0])}
    g = np.array([0.5, -4.0, 2.0])
    report = compare_with_torch(_spec_with("sgd_off", lr=0.1 * 1.001), params, [{"w": g}], lr=0.1)
    (rec,) = report.records
    expected_abs = float(np.max(np.abs(0.1 * 1e-3 * g)))
    torch_p = params["w"] - 0.1 * g  # [0.95, -1.6, 2.8]: the initial 3.0 is the larger scale
    assert np.max(np.abs(torch_p)) < 3.0
    assert rec.abs_err == pytest.approx(expected_abs, rel=1e-9)
    assert rec.scale == 3.0
    assert rec.rel_err == pytest.approx(expected_abs / 3.0, rel=1e-9)
    assert report.max_abs == rec.abs_err


def test_assert_names_the_first_step_and_leaf_that_diverge():
    # dampening acts from step 2 on (step 1 seeds the buffer with the raw gradient)
    params = _params()
    grads = grad_stream(params, 5, seed=3)
    spec = _spec_with("sgd_damped", dampening=0.5)
    with pytest.raises(AssertionError) as info:
        assert_matches_torch(spec, params, grads, lr=0.1, momentum=0.9)
    msg = str(info.value)
    assert "SGD(lr=0.1, momentum=0.9) diverges from torch.optim.SGD (float64) at step 2 of 5" in msg
    assert "param ['layer']['b']" in msg
    assert "> rtol 1e-10" in msg
    report = compare_with_torch(spec, params, grads, lr=0.1, momentum=0.9)
    assert max(report.per_step()[:1]) == 0.0
    assert report.per_step()[1] > 1e-3
    first = report.first_divergence()
    assert (first.step, first.kind, first.path) == (2, "param", "['layer']['b']")
    # a tolerance above the worst error accepts the same run
    assert_matches_torch(spec, params, grads, rtol=2 * report.max_rel, lr=0.1, momentum=0.9)


def test_loss_function_mode_closed_loop():
    rng = np.random.default_rng(4)
    params = {"w": rng.standard_normal((3, 2)), "b": rng.standard_normal(2)}
    data = [(rng.standard_normal((6, 3)), rng.standard_normal((6, 2))) for _ in range(6)]

    def loss(p, batch):
        x, y = batch
        return jnp.mean((x @ p["w"] + p["b"][None, :] - y) ** 2)

    def torch_loss(p, batch):
        x, y = batch
        return ((x @ p["w"] + p["b"] - y) ** 2).mean()

    for torch_fn in (None, torch_loss):
        report = assert_matches_torch(
            "sgd", params, loss_fn=loss, data=data, torch_loss_fn=torch_fn, lr=0.1, momentum=0.9
        )
        assert report.steps == 6
        assert report.max_rel < 1e-13
        # the parameters really moved: torch scale at the last step differs from the start
        assert report.records[-1].scale > 0


def test_float32_report_and_json():
    params = _params("mixed")
    grads = grad_stream(params, 3, seed=5)
    report = compare_with_torch("sgd", params, grads, dtype=np.float32, lr=0.1, momentum=0.9)
    assert report.dtype == "float32"
    assert 0.0 <= report.max_rel <= 1e-6
    data = json.loads(json.dumps(report.to_dict()))
    assert data["config"] == {"lr": 0.1, "momentum": 0.9}
    assert data["steps"] == 3 and len(data["per_step_max_rel_err"]) == 3
    assert data["max_rel_err"] == report.max_rel
    assert "vs torch.optim.SGD, float32, 3 steps" in str(report)


def test_nan_counts_as_divergence():
    rec = LeafError(1, "param", "['w']", float("nan"), float("nan"), 1.0)
    assert rec.exceeds(1.0, 1.0)
    ok = LeafError(1, "param", "['w']", 1e-12, 1e-12, 1.0)
    assert not ok.exceeds(1e-10) and ok.exceeds(1e-13)


def test_bad_arguments():
    params = {"w": np.ones(2)}
    with pytest.raises(ValueError, match="unknown optimizer 'nope'"):
        compare_with_torch("nope", params, [params])
    with pytest.raises(ValueError, match="either grads or loss_fn"):
        compare_with_torch("sgd", params)
    with pytest.raises(ValueError, match="loss_fn needs data"):
        compare_with_torch("sgd", params, loss_fn=lambda p, b: 0.0)
    with pytest.raises(ValueError, match=r"Invalid learning rate: -1\.0"):
        compare_with_torch("sgd", params, [params], lr=-1.0)
    assert rel_err({"w": np.ones(2)}, {"w": np.ones(2)}) == 0.0


def test_closure_driven_spec_runs_on_the_loss():
    # torch's SGD accepts step(closure) too: a closure spec built on it exercises the
    # closure path (torch: opt.step(closure); functorch_optim: a jitted step on value_fn)
    import types

    spec = types.SimpleNamespace(
        name="sgd_closure", factory=fo.sgd, torch_name="SGD", buffers=(), grid=({},), closure=True
    )
    rng = np.random.default_rng(6)
    params = {"w": rng.standard_normal(3), "b": rng.standard_normal(())}
    data = [{"c": rng.standard_normal(3)} for _ in range(4)]

    def loss(p, batch):
        return jnp.sum((p["w"] - batch["c"]) ** 2) + p["b"] ** 2

    def torch_loss(p, batch):
        return ((p["w"] - batch["c"]) ** 2).sum() + p["b"] ** 2

    for torch_fn in (None, torch_loss):
        report = assert_matches_torch(
            spec, params, loss_fn=loss, data=data, torch_loss_fn=torch_fn, lr=0.1, momentum=0.5
        )
        assert report.steps == 4 and {r.kind for r in report.records} == {"param"}
        assert report.max_rel <= 1e-15
    assert len(report.records) == 4 * 2
    with pytest.raises(ValueError, match="closure-driven: compare it on a loss function"):
        compare_with_torch(spec, params, [params], lr=0.1)


def test_hparams_at_changes_both_sides_mid_run():
    params = _params()
    grads = grad_stream(params, 5, seed=3, none_every=3)
    changes = {3: {"lr": 50.0, "betas": (0.5, 0.9)}, 5: {"weight_decay": 0.0}}
    report = assert_matches_torch("adam", params, grads, lr=0.1, weight_decay=0.1, hparams_at=changes)
    plain = compare_with_torch("adam", params, grads, lr=0.1, weight_decay=0.1)
    assert report.max_rel <= 1e-15 and plain.max_rel <= 1e-15

    def last_param_scale(r):  # the largest |torch param| seen: lr=50 from step 3 moves torch's far
        return max(x.scale for x in r.records if x.kind == "param")

    assert last_param_scale(report) > 10 * last_param_scale(plain)
    with pytest.raises(ValueError, match="hparams_at step 6 is outside the run"):
        compare_with_torch("adam", params, grads, hparams_at={6: {"lr": 0.1}})
    with pytest.raises(ValueError, match="Invalid learning rate"):
        compare_with_torch("adam", params, grads, hparams_at={2: {"lr": -1.0}})
