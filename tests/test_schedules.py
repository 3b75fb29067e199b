"""Parity of functorch_optim.schedules with torch.optim.lr_scheduler (and swa_utils.SWALR).

Every sequence is compared with torch's ``get_last_lr()`` after each ``scheduler.step()``
(and after construction), per param group, in float64, over N >= 300 steps.
"""

from __future__ import annotations

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.optim import lr_scheduler as L
from torch.optim.swa_utils import SWALR

import functorch_optim as fo
from functorch_optim import schedules as S
from tests.helpers import _get_linear_schedule_with_warmup_lr_lambda

N = 320
SPE = 7  # optimizer steps per epoch, for the per-epoch schedules
LRS = [0.1, 0.03]  # two param groups with different base lrs
TOL = 1e-12


def _torch_groups(lrs, optimizer=torch.optim.SGD, **kw):
    groups = [{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in lrs]
    return optimizer(groups, **kw)


def _momenta(opt):
    return [g["betas"][0] if "betas" in g else g["momentum"] for g in opt.param_groups]


def torch_sequence(make, lrs=LRS, n=N, optimizer=torch.optim.SGD, **kw):
    """torch's lr (and momentum) per group after construction and after each step."""
    opt = _torch_groups(lrs, optimizer, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = make(opt)
        lrs_out, moms = [list(sched.get_last_lr())], [_momenta(opt)]
        for _ in range(n):
            opt.step()
            sched.step()
            lrs_out.append(list(sched.get_last_lr()))
            moms.append(_momenta(opt))
    return np.asarray(lrs_out, np.float64), np.asarray(moms, np.float64)


# (torch constructor, our constructor), both of the per-group lrs
CASES = {
    "LambdaLR": (lambda o: L.LambdaLR(o, lambda e: 0.97**e), lambda lr: S.lambda_lr(lr, lambda e: 0.97**e)),
    "LambdaLR-per-group": (
        lambda o: L.LambdaLR(o, [lambda e: 0.99**e, lambda e: 1.0 / (1 + e)]),
        lambda lr: S.lambda_lr(lr, [lambda e: 0.99**e, lambda e: 1.0 / (1 + e)]),
    ),
    "MultiplicativeLR": (
        lambda o: L.MultiplicativeLR(o, lambda e: 0.995),
        lambda lr: S.multiplicative_lr(lr, lambda e: 0.995),
    ),
    "StepLR": (lambda o: L.StepLR(o, 7, 0.5), lambda lr: S.step_lr(lr, 7, 0.5)),
    "MultiStepLR": (
        lambda o: L.MultiStepLR(o, [5, 30, 30, 200], 0.3),
        lambda lr: S.multi_step_lr(lr, [5, 30, 30, 200], 0.3),
    ),
    "ConstantLR": (lambda o: L.ConstantLR(o, 0.3, 17), lambda lr: S.constant_lr(lr, 0.3, 17)),
    "LinearLR": (lambda o: L.LinearLR(o, 0.1, 0.9, 50), lambda lr: S.linear_lr(lr, 0.1, 0.9, 50)),
    "ExponentialLR": (lambda o: L.ExponentialLR(o, 0.99), lambda lr: S.exponential_lr(lr, 0.99)),
    "PolynomialLR": (lambda o: L.PolynomialLR(o, 100, 1.7), lambda lr: S.polynomial_lr(lr, 100, 1.7)),
    # past T_max: torch's recursive form keeps following the cosine (period 2*T_max)
    "CosineAnnealingLR": (
        lambda o: L.CosineAnnealingLR(o, 37, 0.001),
        lambda lr: S.cosine_annealing_lr(lr, 37, 0.001),
    ),
    "CosineAnnealingLR-T100": (
        lambda o: L.CosineAnnealingLR(o, 100),
        lambda lr: S.cosine_annealing_lr(lr, 100),
    ),
    "CosineAnnealingWarmRestarts": (
        lambda o: L.CosineAnnealingWarmRestarts(o, 10, 2, 0.001),
        lambda lr: S.cosine_annealing_warm_restarts(lr, 10, 2, 0.001),
    ),
    "SWALR-cos": (lambda o: SWALR(o, 0.05, 20, "cos"), lambda lr: S.swalr(lr, 0.05, 20, "cos")),
    "SWALR-linear-0": (
        lambda o: SWALR(o, [0.05, 0.01], 0, "linear"),
        lambda lr: S.swalr(lr, [0.05, 0.01], 0, "linear"),
    ),
    "CyclicLR-triangular": (
        lambda o: L.CyclicLR(o, 0.01, 0.1, 20),
        lambda lr: S.cyclic_lr(0.01, 0.1, 20, lr=lr),
    ),
    "CyclicLR-triangular2": (
        lambda o: L.CyclicLR(o, 0.01, [0.1, 0.2], 13, 7, "triangular2"),
        lambda lr: S.cyclic_lr(0.01, [0.1, 0.2], 13, 7, "triangular2", lr=lr),
    ),
    "CyclicLR-exp_range": (
        lambda o: L.CyclicLR(o, [0.01, 0.02], 0.1, 10, None, "exp_range", gamma=0.995),
        lambda lr: S.cyclic_lr([0.01, 0.02], 0.1, 10, None, "exp_range", gamma=0.995, lr=lr),
    ),
    "CyclicLR-scale_fn-iterations": (
        lambda o: L.CyclicLR(o, 0.01, 0.1, 9, scale_fn=lambda x: 1 / (1 + 0.01 * x), scale_mode="iterations"),
        lambda lr: S.cyclic_lr(
            0.01, 0.1, 9, scale_fn=lambda x: 1 / (1 + 0.01 * x), scale_mode="iterations", lr=lr
        ),
    ),
    "OneCycleLR-cos": (
        lambda o: L.OneCycleLR(o, [0.5, 0.2], total_steps=N),
        lambda lr: S.one_cycle_lr([0.5, 0.2], total_steps=N, lr=lr),
    ),
    "OneCycleLR-linear-three_phase": (
        lambda o: L.OneCycleLR(
            o, 0.5, epochs=16, steps_per_epoch=20, three_phase=True, anneal_strategy="linear"
        ),
        lambda lr: S.one_cycle_lr(
            0.5, epochs=16, steps_per_epoch=20, three_phase=True, anneal_strategy="linear", lr=lr
        ),
    ),
    "SequentialLR": (
        lambda o: L.SequentialLR(
            o,
            [L.LinearLR(o, 0.1, 1.0, 10), L.CosineAnnealingLR(o, 50, 0.001), L.ExponentialLR(o, 0.99)],
            [10, 150],
        ),
        lambda lr: S.sequential_lr(
            [S.linear_lr(lr, 0.1, 1.0, 10), S.cosine_annealing_lr(lr, 50, 0.001), S.exponential_lr(lr, 0.99)],
            [10, 150],
        ),
    ),
    "SequentialLR-restarts-swalr": (
        lambda o: L.SequentialLR(
            o, [L.ConstantLR(o, 0.5, 5), L.CosineAnnealingWarmRestarts(o, 7, 2), SWALR(o, 0.02, 5)], [20, 100]
        ),
        lambda lr: S.sequential_lr(
            [S.constant_lr(lr, 0.5, 5), S.cosine_annealing_warm_restarts(lr, 7, 2), S.swalr(lr, 0.02, 5)],
            [20, 100],
        ),
    ),
    "SequentialLR-cyclic": (
        lambda o: L.SequentialLR(o, [L.StepLR(o, 3, 0.9), L.CyclicLR(o, 0.01, 0.1, 10)], [30]),
        lambda lr: S.sequential_lr([S.step_lr(lr, 3, 0.9), S.cyclic_lr(0.01, 0.1, 10, lr=lr)], [30]),
    ),
    # every closed form / restart at a milestone (torch's ``_update_lr(0)``)
    "SequentialLR-restart-each": (
        lambda o: L.SequentialLR(
            o,
            [
                L.ExponentialLR(o, 0.99),
                L.LinearLR(o, 0.2, 0.8, 15),
                L.ConstantLR(o, 0.4, 10),
                L.MultiStepLR(o, [3, 20], 0.5),
                L.PolynomialLR(o, 30, 2.0),
                L.MultiplicativeLR(o, lambda e: 0.98),
                L.LambdaLR(o, lambda e: 1.0 / (1.0 + 0.1 * e)),
                L.StepLR(o, 4, 0.8),
            ],
            [20, 60, 100, 150, 200, 240, 280],
        ),
        lambda lr: S.sequential_lr(
            [
                S.exponential_lr(lr, 0.99),
                S.linear_lr(lr, 0.2, 0.8, 15),
                S.constant_lr(lr, 0.4, 10),
                S.multi_step_lr(lr, [3, 20], 0.5),
                S.polynomial_lr(lr, 30, 2.0),
                S.multiplicative_lr(lr, lambda e: 0.98),
                S.lambda_lr(lr, lambda e: 1.0 / (1.0 + 0.1 * e)),
                S.step_lr(lr, 4, 0.8),
            ],
            [20, 60, 100, 150, 200, 240, 280],
        ),
    ),
    "ChainedScheduler": (
        lambda o: L.ChainedScheduler(
            [L.ConstantLR(o, 0.1, 20), L.ExponentialLR(o, 0.99), L.CosineAnnealingLR(o, 40)]
        ),
        lambda lr: S.chained_scheduler(
            [S.constant_lr(lr, 0.1, 20), S.exponential_lr(lr, 0.99), S.cosine_annealing_lr(lr, 40)]
        ),
    ),
    "ChainedScheduler-of-SequentialLR": (
        lambda o: L.ChainedScheduler(
            [
                L.SequentialLR(o, [L.LinearLR(o, 0.5, 1.0, 4), L.StepLR(o, 10)], [4]),
                L.MultiplicativeLR(o, lambda e: 0.999),
            ]
        ),
        lambda lr: S.chained_scheduler(
            [
                S.sequential_lr([S.linear_lr(lr, 0.5, 1.0, 4), S.step_lr(lr, 10)], [4]),
                S.multiplicative_lr(lr, lambda e: 0.999),
            ]
        ),
    ),
}


@pytest.fixture(scope="module")
def our_sequences():
    """Every case's lr (and momentum) sequence, construction included, in one compilation."""
    scheds = {}
    for name, (_, make_ours) in CASES.items():
        sched = make_ours(LRS)
        scheds[name, "lr"] = sched
        epochs = scheds[name, "per_epoch"] = S.per_epoch(make_ours(LRS), SPE)
        if sched._spec.cycles_momentum:
            scheds[name, "momentum"] = sched.momentum
            scheds[name, "per_epoch_momentum"] = epochs.momentum

    def run(sched):
        def body(carry, _):
            value, state = sched.step_schedule(*carry)
            return (value, state), value

        value, state = sched.init_schedule()
        rest = jax.lax.scan(body, (value, state), None, length=N)[1]
        return jnp.concatenate([value[None], rest])

    out = jax.jit(lambda: {key: run(s) for key, s in scheds.items()})()
    return {key: np.asarray(v) for key, v in out.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_lr_sequence_matches_torch_per_group(name, our_sequences):
    """Bit for bit: each product that torch's Python expression rounds before a sum is
    rounded (``_core._mul``), each new lr stored as torch's param group stores it
    (``_core._stored_lr``), each division a division (``_core._div``) and a user's lambda
    evaluated with Python's rounding (``_core.python_arithmetic``); before, 15 of these
    cases differed, e.g. CosineAnnealingLR on 537 of 642 values, by up to 1.6e-15 relative."""
    make_torch = CASES[name][0]
    ref_lr, ref_mom = torch_sequence(make_torch, momentum=0.9)
    got = our_sequences[name, "lr"]
    assert got.shape == (N + 1, 2)
    np.testing.assert_array_equal(got, ref_lr)
    assert np.any(ref_lr[:, 0] != LRS[0])  # the schedule really moves
    if (name, "momentum") in our_sequences:
        np.testing.assert_array_equal(our_sequences[name, "momentum"], ref_mom)
        assert np.any(ref_mom[:, 0] != ref_mom[0, 0])


@pytest.mark.parametrize("name", list(CASES))
def test_per_epoch_schedule_steps_torchs_scheduler_once_per_epoch(name, our_sequences):
    """``per_epoch(s, k)`` after ``t`` optimizer steps is torch's lr after ``t // k`` scheduler steps."""
    n_epochs = N // SPE
    ref_lr, ref_mom = torch_sequence(CASES[name][0], n=n_epochs, momentum=0.9)
    got = our_sequences[name, "per_epoch"]
    epoch = np.arange(N + 1) // SPE
    np.testing.assert_array_equal(got, ref_lr[epoch])
    if (name, "momentum") in our_sequences:
        np.testing.assert_array_equal(our_sequences[name, "per_epoch_momentum"], ref_mom[epoch])


def test_per_epoch_trains_like_the_facade_and_torch_stepping_per_epoch():
    """mnist's loop: Adadelta, StepLR stepped after each epoch; functional, facade and torch agree."""
    from functorch_optim.optim import Adadelta
    from functorch_optim.optim import lr_scheduler as FL

    rng = np.random.default_rng(3)
    p0, grads = rng.standard_normal(4), rng.standard_normal((4, 5, 4))  # 4 epochs of 5 steps
    tx = fo.adadelta(lr=S.per_epoch(S.step_lr(1.0, step_size=1, gamma=0.7), steps_per_epoch=5))
    step = fo.jit_step(tx)
    params = {"w": jnp.asarray(p0)}
    state = tx.init(params)
    opt = Adadelta({"w": jnp.asarray(p0)}, lr=1.0)
    sched = FL.StepLR(opt, step_size=1, gamma=0.7)
    t = torch.tensor(p0, requires_grad=True)
    topt = torch.optim.Adadelta([t], lr=1.0, foreach=False)
    tsched = L.StepLR(topt, step_size=1, gamma=0.7)
    for epoch in grads:
        for g in epoch:
            assert (
                float(fo.get_hparams(state)["lr"]) == opt.param_groups[0]["lr"] == topt.param_groups[0]["lr"]
            )
            params, state = step(params, {"w": jnp.asarray(g)}, state)
            opt.grad = {"w": jnp.asarray(g)}
            opt.step()
            t.grad = torch.tensor(g)
            topt.step()
        sched.step()
        tsched.step()
    assert float(fo.get_hparams(state)["lr"]) == sched.get_last_lr()[0] == tsched.get_last_lr()[0]
    np.testing.assert_array_equal(np.asarray(params["w"]), np.asarray(opt.params["w"]))
    np.testing.assert_allclose(np.asarray(params["w"]), t.detach().numpy(), rtol=1e-14)


def test_per_epoch_validation():
    with pytest.raises(ValueError, match="steps_per_epoch must be an integer >= 1, got 0"):
        S.per_epoch(S.step_lr(0.1, 2), 0)
    with pytest.raises(ValueError, match=r"ReduceLROnPlateau .* once per epoch"):
        S.per_epoch(S.reduce_lr_on_plateau(0.1), 10)
    with pytest.raises(TypeError, match=r"per_epoch takes a schedule from functorch_optim\.schedules"):
        S.per_epoch(lambda count: 0.1, 10)
    with pytest.raises(ValueError, match="wrap the whole SequentialLR in per_epoch"):
        S.sequential_lr([S.per_epoch(S.step_lr(0.1, 2), 3), S.step_lr(0.1, 2)], [4])


def test_eager_construction_and_jitted_steps_match_the_batched_run(our_sequences):
    """The production path (construction op by op, a jitted step) gives the same numbers."""
    for name in ["SequentialLR-restarts-swalr"]:
        sched = CASES[name][1](LRS)
        got = sched.values(N)
        assert np.max(np.abs(got - our_sequences[name, "lr"])) <= 1e-15


def test_values_of_many_schedules_equals_each_values():
    """One compiled program for the steps of many schedules: each one's numbers, bit for bit."""
    from functorch_optim.schedules._core import values_of

    scheds = [
        S.cosine_annealing_lr(LRS, 7, 0.01),
        S.one_cycle_lr(0.5, total_steps=60, anneal_strategy="linear", three_phase=True),
        S.cyclic_lr(0.01, 0.1, step_size_up=5, mode="exp_range", gamma=0.9),
        S.step_lr(0.1, 3, gamma=0.5),
    ]
    for n in (5, 16, 17, 40):
        got = values_of(scheds, n)
        assert len(got) == len(scheds)
        for sched, values in zip(scheds, got, strict=True):
            alone = sched.values(n)
            assert values.dtype == alone.dtype and values.shape == alone.shape == (n + 1, *alone.shape[1:])
            assert values.tobytes() == alone.tobytes()
    assert values_of([], 20) == []


def test_scalar_schedule_equals_group_entry_and_count_replay():
    both = S.cosine_annealing_lr(LRS, 37, 0.001).values(100)
    one = S.cosine_annealing_lr(LRS[1], 37, 0.001)
    assert np.array_equal(one.values(100), both[:, 1])
    assert float(jax.jit(one)(77)) == both[77, 1]


def test_resumed_scheduler_matches_torch_state_dict_resume():
    """Stop mid-run, checkpoint the state (to NumPy and back), resume: same as torch's resume."""
    k = 137

    def make_torch(o):
        return L.SequentialLR(o, [L.LinearLR(o, 0.2, 1.0, 15), L.CosineAnnealingLR(o, 60, 1e-4)], [15])

    # torch: run k steps, save scheduler and optimizer, rebuild both, load, continue
    opt = _torch_groups(LRS, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = make_torch(opt)
        ref = [sched.get_last_lr()]
        for _ in range(k):
            opt.step()
            sched.step()
            ref.append(sched.get_last_lr())
        sd, osd = sched.state_dict(), opt.state_dict()
        opt2 = _torch_groups(LRS, momentum=0.9)
        sched2 = make_torch(opt2)
        opt2.load_state_dict(osd)
        sched2.load_state_dict(sd)
        for _ in range(N - k):
            opt2.step()
            sched2.step()
            ref.append(sched2.get_last_lr())
    ref = np.asarray(ref)
    full, _ = torch_sequence(make_torch, momentum=0.9)
    assert np.array_equal(ref, full)  # torch's own resume is seamless here

    ours = S.sequential_lr([S.linear_lr(LRS, 0.2, 1.0, 15), S.cosine_annealing_lr(LRS, 60, 1e-4)], [15])
    step = jax.jit(ours.step_schedule)
    value, state = ours.init_schedule()
    got = [np.asarray(value)]
    for _ in range(k):
        value, state = step(value, state)
        got.append(np.asarray(value))
    saved = jax.tree.map(np.asarray, (value, state))  # a checkpoint
    value, state = jax.tree.map(jnp.asarray, saved)
    for _ in range(N - k):
        value, state = step(value, state)
        got.append(np.asarray(value))
    assert np.max(np.abs(np.asarray(got) - ref)) <= TOL


# ----------------------------------------------------------------------------- ReduceLROnPlateau
PLATEAU = [
    dict(mode="min", threshold_mode="rel"),
    dict(mode="min", threshold_mode="abs", threshold=0.05, cooldown=3, patience=2),
    dict(mode="max", threshold_mode="rel", factor=0.5, patience=0, min_lr=[0.02, 0.001]),
    dict(mode="max", threshold_mode="abs", threshold=0.01, cooldown=1, patience=4, eps=1e-3, min_lr=1e-3),
]


@pytest.mark.parametrize("kw", PLATEAU, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_reduce_lr_on_plateau_matches_torch(kw):
    rng = np.random.default_rng(3)
    # a noisy walk with long flat stretches, so every branch runs
    metrics = np.repeat(rng.standard_normal(60).cumsum(), 5) + 1e-3 * rng.standard_normal(300)
    opt = _torch_groups(LRS)
    sched = L.ReduceLROnPlateau(opt, **kw)
    plateau = S.reduce_lr_on_plateau(LRS, **kw)
    update = jax.jit(plateau.update)
    lr, state = plateau.init_schedule()
    ref, got = [], []
    for m in metrics:
        sched.step(m)
        lr, state = update(lr, state, m)
        ref.append(sched.get_last_lr())
        got.append(np.asarray(lr))
        assert int(state.num_bad_epochs) == sched.num_bad_epochs
        assert int(state.cooldown_counter) == sched.cooldown_counter
    ref = np.asarray(ref)
    assert np.max(np.abs(np.asarray(got) - ref)) <= TOL
    assert len(set(ref[:, 0])) >= 3  # it did reduce, more than once


def test_reduce_lr_on_plateau_updates_the_optimizer_state_and_training_matches_torch():
    rng = np.random.default_rng(0)
    p0 = rng.standard_normal(4)
    grads = rng.standard_normal((40, 4))
    metrics = [1.0, 0.9, 0.95, 0.97, 0.99, 0.8, 0.85, 0.9, 0.91, 0.93]
    plateau = S.reduce_lr_on_plateau(0.1, patience=1, factor=0.5)
    tx = fo.sgd(lr=plateau, momentum=0.9)
    step = jax.jit(lambda p, g, s: fo.step(tx, p, g, s))
    pstep = jax.jit(plateau.step)
    params = {"w": jnp.asarray(p0)}
    state = tx.init(params)
    t = torch.tensor(p0, requires_grad=True)
    opt = torch.optim.SGD([t], lr=0.1, momentum=0.9)
    tsched = L.ReduceLROnPlateau(opt, patience=1, factor=0.5)
    for epoch, m in enumerate(metrics):
        for g in grads[4 * epoch : 4 * epoch + 4]:
            params, state = step(params, {"w": jnp.asarray(g)}, state)
            t.grad = torch.tensor(g)
            opt.step()
        state = pstep(state, m)
        tsched.step(m)
        assert float(fo.get_hparams(state)["lr"]) == opt.param_groups[0]["lr"]
    assert opt.param_groups[0]["lr"] < 0.05
    np.testing.assert_allclose(np.asarray(params["w"]), t.detach().numpy(), rtol=1e-13, atol=0)
    assert step._cache_size() == 1 and pstep._cache_size() == 1
    with pytest.raises(ValueError, match="no lr in the optimizer state is driven"):
        plateau.step(fo.sgd(lr=0.1).init(params), 1.0)
    # found inside chains (and in every param-group optimizer of a multi_transform)
    chained = (fo.clip_grad_value_transform(1.0).init(params), state)
    chained = plateau.step(plateau.step(chained, 100.0), 100.0)
    assert float(fo.get_hparams(chained)["lr"]) == 0.5 * opt.param_groups[0]["lr"]


# ----------------------------------------------------------------------------- in an optimizer
def _train(tx, p0, grads, dtype):
    step = jax.jit(lambda p, g, s: fo.step(tx, p, g, s))  # a fresh cache per call
    params = {"w": jnp.asarray(p0, dtype)}
    state = tx.init(params)
    lrs = [float(fo.get_hparams(state)["lr"])]
    for g in grads:
        params, state = step(params, {"w": jnp.asarray(g, dtype)}, state)
        lrs.append(float(fo.get_hparams(state)["lr"]))
    assert step._cache_size() == 1  # the schedule never recompiles the step
    return np.asarray(params["w"]), np.asarray(lrs)


def _train_torch(make_sched, p0, grads, dtype, **kw):
    t = torch.tensor(np.asarray(p0, dtype), requires_grad=True)
    opt = torch.optim.SGD([t], foreach=False, **kw)
    sched = make_sched(opt)
    lrs = [sched.get_last_lr()[0]]
    for g in grads:
        t.grad = torch.tensor(np.asarray(g, dtype))
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    return t.detach().numpy(), np.asarray(lrs)


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("kind", ["cosine", "onecycle-momentum", "lambda-warmup"])
def test_sgd_with_schedule_trains_like_torch(kind, dtype):
    rng = np.random.default_rng(1)
    p0, grads = rng.standard_normal(6), rng.standard_normal((60, 6))
    if kind == "lambda-warmup":  # a user's lambda: traced here, Python in torch
        sched = S.lambda_lr(0.1, lambda e: jnp.where(e < 10, (e + 1) / 10, 1.0 / (1.0 + 0.1 * (e - 9))))
        tx = fo.sgd(lr=sched, momentum=0.9, weight_decay=1e-2)
        ref = _train_torch(
            lambda o: L.LambdaLR(o, lambda e: (e + 1) / 10 if e < 10 else 1.0 / (1.0 + 0.1 * (e - 9))),
            p0,
            grads,
            dtype,
            lr=0.1,
            momentum=0.9,
            weight_decay=1e-2,
        )
    elif kind == "cosine":
        sched = S.cosine_annealing_lr(0.1, T_max=25, eta_min=0.01)
        tx = fo.sgd(lr=sched, momentum=0.9, nesterov=True)
        ref = _train_torch(
            lambda o: L.CosineAnnealingLR(o, 25, 0.01), p0, grads, dtype, lr=0.1, momentum=0.9, nesterov=True
        )
    else:
        sched = S.one_cycle_lr(0.5, total_steps=60)
        tx = fo.sgd(lr=sched, momentum=sched.momentum, dampening=0.1)
        ref = _train_torch(
            lambda o: L.OneCycleLR(o, 0.5, total_steps=60),
            p0,
            grads,
            dtype,
            lr=0.1,
            momentum=0.5,
            dampening=0.1,
        )
    params, lrs = _train(tx, p0, grads, dtype)
    np.testing.assert_array_equal(lrs, ref[1])
    np.testing.assert_array_equal(params, ref[0])
    assert np.max(np.abs(params - p0)) > 0.1


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_family_with_one_cycle_beta1_trains_like_torch(name, dtype):
    # the documented ``betas=(sched.momentum, beta2)``: a schedule counts as a float in
    # torch's "betas must be either both floats or both Tensors" check
    rng = np.random.default_rng(2)
    p0, grads = rng.standard_normal(6), rng.standard_normal((40, 6))
    sched = S.one_cycle_lr(0.05, total_steps=40)
    tx = getattr(fo, name)(lr=sched, betas=(sched.momentum, 0.99), weight_decay=0.1)
    step = jax.jit(lambda p, g, s: fo.step(tx, p, g, s))
    params = {"w": jnp.asarray(p0, dtype)}
    state = tx.init(params)
    t = torch.tensor(np.asarray(p0, dtype), requires_grad=True)
    cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    opt = cls([t], lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, foreach=False)
    tsched = L.OneCycleLR(opt, 0.05, total_steps=40)
    beta1, beta1_torch = [], []
    for g in grads:
        params, state = step(params, {"w": jnp.asarray(g, dtype)}, state)
        t.grad = torch.tensor(np.asarray(g, dtype))
        opt.step()
        tsched.step()
        beta1.append(float(fo.get_hparams(state)["betas"][0]))
        beta1_torch.append(opt.param_groups[0]["betas"][0])
    assert np.max(np.abs(np.subtract(beta1, beta1_torch))) <= TOL
    assert min(beta1) < 0.86 and max(beta1) > 0.94  # it did cycle
    tol = 1e-13 if dtype == np.float64 else 2e-6
    np.testing.assert_allclose(np.asarray(params["w"]), t.detach().numpy(), rtol=tol, atol=tol)
    assert step._cache_size() == 1


def test_schedule_advances_per_optimizer_step_not_per_micro_step():
    sched = S.step_lr(1.0, step_size=1, gamma=0.5)
    tx = fo.grad_accumulate(fo.sgd(lr=sched), every=3)
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    step = jax.jit(lambda p, g, s: fo.step(tx, p, g, s))
    seen = []
    for _ in range(9):
        params, state = step(params, {"w": jnp.ones(2)}, state)
        seen.append(float(fo.get_hparams(state)["lr"]))
    assert seen == [1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.125]
    # steps used lr 1, 0.5, 0.25 on a mean gradient of 1
    assert np.asarray(params["w"]).tolist() == [-1.75, -1.75]


def test_betas_tuple_with_beta1_companion():
    sched = S.cyclic_lr(0.01, 0.1, step_size_up=4)
    from functorch_optim._base import _driver

    driver = _driver((sched.momentum, 0.999))
    value, state = driver.init_schedule()
    _, ref_mom = torch_sequence(lambda o: L.CyclicLR(o, 0.01, 0.1, 4), [0.05], 12, torch.optim.Adam)
    got = [value[0]]
    for _ in range(12):
        value, state = driver.step_schedule(value, state, None)
        got.append(value[0])
        assert float(value[1]) == 0.999
    assert np.max(np.abs(np.asarray(got) - ref_mom[:, 0])) <= TOL
    assert ref_mom[:, 0].min() == 0.8


def test_cycle_momentum_needs_the_companion():
    sched = S.one_cycle_lr(0.5, total_steps=10)
    with pytest.raises(ValueError, match=re.escape("pass its companion as momentum=lr.momentum")):
        fo.sgd(lr=sched, momentum=0.9)
    fo.sgd(lr=S.one_cycle_lr(0.5, total_steps=10, cycle_momentum=False))  # fine
    with pytest.raises(ValueError, match="does not cycle momentum"):
        _ = S.step_lr(0.1, 3).momentum


def test_one_cycle_past_total_steps_is_nan_where_torch_raises():
    vals = S.one_cycle_lr(0.5, total_steps=10, cycle_momentum=False).values(11)
    assert np.all(np.isfinite(vals[:11])) and np.isnan(vals[11])
    opt = _torch_groups([0.1])
    sched = L.OneCycleLR(opt, 0.5, total_steps=10, cycle_momentum=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(10):
            sched.step()
        with pytest.raises(ValueError, match="Tried to step 11 times"):
            sched.step()


# ----------------------------------------------------------------------------- validation
def _torch_error(make):
    opt = _torch_groups(LRS)
    try:
        make(opt)
    except (ValueError, TypeError, ZeroDivisionError) as e:
        return type(e), str(e)
    raise AssertionError("torch accepted it")


ERRORS = {
    "lambda-count": (lambda o: L.LambdaLR(o, [lambda e: 1.0]), lambda: S.lambda_lr(LRS, [lambda e: 1.0])),
    "multiplicative-not-callable": (
        lambda o: L.MultiplicativeLR(o, [1.0, 2.0]),
        lambda: S.multiplicative_lr(LRS, [1.0, 2.0]),
    ),
    "constant-factor": (lambda o: L.ConstantLR(o, 1.5), lambda: S.constant_lr(LRS, 1.5)),
    "linear-start": (lambda o: L.LinearLR(o, 0.0), lambda: S.linear_lr(LRS, 0.0)),
    "linear-end": (lambda o: L.LinearLR(o, 0.5, 1.5), lambda: S.linear_lr(LRS, 0.5, 1.5)),
    "warm-T_0": (
        lambda o: L.CosineAnnealingWarmRestarts(o, 0),
        lambda: S.cosine_annealing_warm_restarts(LRS, 0),
    ),
    "warm-T_mult": (
        lambda o: L.CosineAnnealingWarmRestarts(o, 5, 0),
        lambda: S.cosine_annealing_warm_restarts(LRS, 5, 0),
    ),
    "warm-eta_min": (
        lambda o: L.CosineAnnealingWarmRestarts(o, 5, 1, "x"),
        lambda: S.cosine_annealing_warm_restarts(LRS, 5, 1, "x"),
    ),
    "cyclic-mode": (
        lambda o: L.CyclicLR(o, 0.1, 1.0, mode="x"),
        lambda: S.cyclic_lr(0.1, 1.0, mode="x", lr=LRS),
    ),
    "cyclic-base_lr-len": (
        lambda o: L.CyclicLR(o, [0.1, 0.2, 0.3], 1.0),
        lambda: S.cyclic_lr([0.1, 0.2, 0.3], 1.0, lr=LRS),
    ),
    "onecycle-total": (
        lambda o: L.OneCycleLR(o, 1.0, total_steps=0),
        lambda: S.one_cycle_lr(1.0, total_steps=0),
    ),
    "onecycle-epochs": (
        lambda o: L.OneCycleLR(o, 1.0, epochs=0, steps_per_epoch=2),
        lambda: S.one_cycle_lr(1.0, epochs=0, steps_per_epoch=2),
    ),
    "onecycle-steps_per_epoch": (
        lambda o: L.OneCycleLR(o, 1.0, epochs=2, steps_per_epoch=0),
        lambda: S.one_cycle_lr(1.0, epochs=2, steps_per_epoch=0),
    ),
    "onecycle-none": (lambda o: L.OneCycleLR(o, 1.0), lambda: S.one_cycle_lr(1.0)),
    "onecycle-pct": (
        lambda o: L.OneCycleLR(o, 1.0, total_steps=10, pct_start=1.5),
        lambda: S.one_cycle_lr(1.0, total_steps=10, pct_start=1.5),
    ),
    "onecycle-anneal": (
        lambda o: L.OneCycleLR(o, 1.0, total_steps=10, anneal_strategy="x"),
        lambda: S.one_cycle_lr(1.0, total_steps=10, anneal_strategy="x"),
    ),
    "onecycle-max_lr-len": (
        lambda o: L.OneCycleLR(o, [1.0, 2.0, 3.0], total_steps=10),
        lambda: S.one_cycle_lr([1.0, 2.0, 3.0], total_steps=10, lr=LRS),
    ),
    "onecycle-zero-phase": (
        lambda o: L.OneCycleLR(o, 1.0, total_steps=10, pct_start=0.1),
        lambda: S.one_cycle_lr(1.0, total_steps=10, pct_start=0.1),
    ),
    "swalr-anneal": (
        lambda o: SWALR(o, 0.1, anneal_strategy="x"),
        lambda: S.swalr(LRS, 0.1, anneal_strategy="x"),
    ),
    "swalr-epochs": (lambda o: SWALR(o, 0.1, anneal_epochs=-1), lambda: S.swalr(LRS, 0.1, anneal_epochs=-1)),
    "swalr-len": (lambda o: SWALR(o, [0.1, 0.2, 0.3]), lambda: S.swalr(LRS, [0.1, 0.2, 0.3])),
    "plateau-factor": (
        lambda o: L.ReduceLROnPlateau(o, factor=1.0),
        lambda: S.reduce_lr_on_plateau(LRS, factor=1.0),
    ),
    "plateau-min_lr": (
        lambda o: L.ReduceLROnPlateau(o, min_lr=[0.1]),
        lambda: S.reduce_lr_on_plateau(LRS, min_lr=[0.1]),
    ),
    "plateau-mode": (
        lambda o: L.ReduceLROnPlateau(o, mode="x"),
        lambda: S.reduce_lr_on_plateau(LRS, mode="x"),
    ),
    "plateau-threshold_mode": (
        lambda o: L.ReduceLROnPlateau(o, threshold_mode="x"),
        lambda: S.reduce_lr_on_plateau(LRS, threshold_mode="x"),
    ),
    "sequential-empty": (lambda o: L.SequentialLR(o, [], []), lambda: S.sequential_lr([], [])),
    "sequential-milestones": (
        lambda o: L.SequentialLR(o, [L.StepLR(o, 2), L.StepLR(o, 3)], [1, 2]),
        lambda: S.sequential_lr([S.step_lr(LRS, 2), S.step_lr(LRS, 3)], [1, 2]),
    ),
    "sequential-plateau": (
        lambda o: L.SequentialLR(o, [L.StepLR(o, 2), L.ReduceLROnPlateau(o)], [1]),
        lambda: S.sequential_lr([S.step_lr(LRS, 2), S.reduce_lr_on_plateau(LRS)], [1]),
    ),
    "chained-empty": (lambda o: L.ChainedScheduler([]), lambda: S.chained_scheduler([])),
    "chained-plateau": (
        lambda o: L.ChainedScheduler([L.ReduceLROnPlateau(o)]),
        lambda: S.chained_scheduler([S.reduce_lr_on_plateau(LRS)]),
    ),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_validation_uses_torchs_messages(name):
    make_torch, make_ours = ERRORS[name]
    kind, message = _torch_error(make_torch)
    with pytest.raises(kind) as info:
        make_ours()
    assert str(info.value) == message


def test_sub_schedules_must_share_the_lr():
    with pytest.raises(ValueError, match="expects all schedulers to belong to the same optimizer"):
        S.chained_scheduler([S.step_lr(0.1, 2), S.step_lr(0.2, 2)])
    with pytest.raises(TypeError, match="should be a learning-rate schedule"):
        S.sequential_lr([S.step_lr(0.1, 2), lambda c: 0.1], [3])
    with pytest.raises(ValueError, match="step_size must be an integer >= 1, got 0"):
        S.step_lr(0.1, 0)


def test_donated_steps_and_repeated_init():
    """State leaves never share buffers, so a donated step works and init stays reusable."""
    sched = S.sequential_lr([S.linear_lr(0.1, 0.1, 1.0, 5), S.cyclic_lr(0.01, 0.1, 3, lr=0.1)], [5])
    tx = fo.sgd(lr=sched, momentum=sched.momentum)
    step = jax.jit(lambda p, g, s: fo.step(tx, p, g, s), donate_argnums=(0, 2))
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    for _ in range(8):
        params, state = step(params, {"w": jnp.ones(3)}, state)
    ref = sched.values(8)
    assert float(fo.get_hparams(state)["lr"]) == ref[8]
    assert float(fo.get_hparams(tx.init({"w": jnp.ones(3)}))["lr"]) == ref[0]


# ----------------------------------------------------------------------------- traced lambdas
def test_lambda_that_cannot_be_traced_names_the_lambda_and_the_fix():
    hf = functools.partial(
        _get_linear_schedule_with_warmup_lr_lambda, num_warmup_steps=5, num_training_steps=30
    )
    with pytest.raises(TypeError, match=r"lr_lambda _get_linear_schedule_with_warmup_lr_lambda \(") as info:
        S.lambda_lr(0.1, hf)
    text = str(info.value)
    assert "helpers.py:" in text and "jnp.where" in text
    assert "functorch_optim.optim.lr_scheduler.LambdaLR" in text

    def decay(epoch):
        return 1.0 if epoch < 3 else 0.5

    with pytest.raises(TypeError, match=r"lr_lambda .*decay \(.*MultiplicativeLR"):
        S.multiplicative_lr(LRS, [lambda e: 0.9, decay])


def test_traced_lambda_counter_gives_float64_arithmetic():
    """``e / n`` with an integer counter is float64 under x64, as Python's int / int."""

    def warmup(e):  # transformers' warmup lambda in jax.numpy
        return jnp.where(e < 5, e / 5, jnp.maximum(0.0, (30 - e) / 25))

    ref = torch_sequence(
        lambda o: L.LambdaLR(
            o,
            functools.partial(
                _get_linear_schedule_with_warmup_lr_lambda, num_warmup_steps=5, num_training_steps=30
            ),
        ),
        n=34,
    )[0]
    sched = S.lambda_lr(LRS, warmup)
    got = sched.values(34)  # one jitted scan
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, ref)  # an int32 counter: 4.8e-9 off
    ref = torch_sequence(lambda o: L.MultiplicativeLR(o, lambda e: 1 - e / 70), n=16)[0]
    assert np.array_equal(S.multiplicative_lr(LRS, lambda e: 1 - e / 70).values(16), ref)


def test_cyclic_scale_fn_gets_a_float64_counter():
    """A custom ``scale_fn`` sees the cycle (or iteration) as JAX's default int: ``x / 3`` is float64."""

    def scale_fn(x):
        return 0.5 ** (x / 3)

    for mode in ["cycle", "iterations"]:
        kw = {"scale_fn": scale_fn, "scale_mode": mode}
        ref = torch_sequence(lambda o, kw=kw: L.CyclicLR(o, 0.01, 0.1, 4, **kw), n=16)[0]
        got = S.cyclic_lr(0.01, 0.1, 4, **kw, cycle_momentum=False, lr=LRS)
        np.testing.assert_array_equal(got.values(16), ref, err_msg=mode)  # int32: 1e-9 off


#: a user's lambda, and the same function on Python numbers (``if`` for ``jnp.where``)
PYTHON_LAMBDAS = {
    "e / 10": (lambda e: e / 10, lambda e: e / 10),
    "1 / (1 + 0.1 e)": (lambda e: 1.0 / (1.0 + 0.1 * e), lambda e: 1.0 / (1.0 + 0.1 * e)),
    "0.3 e - 0.1 e": (lambda e: 0.3 * e - 0.1 * e, lambda e: 0.3 * e - 0.1 * e),
    "1 + 0.01 e e": (lambda e: 1 + 0.01 * e * e, lambda e: 1 + 0.01 * e * e),
    "1 - (e / 3000) ** 2": (lambda e: 1 - (e / 3000) ** 2, lambda e: 1 - (e / 3000) ** 2),
    "warmup, then linear": (
        lambda e: jnp.where(e < 50, e / 50, 1.0 - 0.7 * (e - 50) / 1950),
        lambda e: e / 50 if e < 50 else 1.0 - 0.7 * (e - 50) / 1950,
    ),
}


@pytest.mark.parametrize("name", list(PYTHON_LAMBDAS))
def test_traced_lambda_rounds_as_python(name):
    """A traced lambda's products and quotients round as Python's: XLA contracted
    ``0.1 * e`` into the add after it and made ``e / 10`` a multiply by 0.1 (701 of
    2000 values an ulp off); ``python_arithmetic`` evaluates them as Python does."""
    traced, python = PYTHON_LAMBDAS[name]
    got = S.lambda_lr(1.0, traced).values(1999)
    np.testing.assert_array_equal(got, [float(python(e)) for e in range(2000)])
    # the same lambda as a CyclicLR scale_fn
    cyc = S.cyclic_lr(0.0, 1.0, 1, scale_fn=traced, scale_mode="iterations", cycle_momentum=False)
    ref = [_torch_cyclic_lr(e, python) for e in range(400)]
    np.testing.assert_array_equal(cyc.values(399), ref)


def _torch_cyclic_lr(e, scale_fn):
    """torch's CyclicLR lr at ``last_epoch = e`` for base 0, max 1, one step up and down."""
    cycle = np.floor(1 + e / 2.0)
    x = 1.0 + e / 2.0 - cycle
    scale_factor = x / 0.5 if x <= 0.5 else (x - 1) / (0.5 - 1)
    return 0.0 + (1.0 - 0.0) * scale_factor * scale_fn(e)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rounded_keeps_every_value(dtype):
    """``_core._rounded`` (a signed ``min`` on the bits) is the identity on every number,
    infinity and signed zero, a NaN on a NaN, and has the identity's derivative."""
    from functorch_optim.schedules._core import _rounded

    info = np.finfo(dtype)
    x = np.concatenate(
        [
            np.array([0.0, -0.0, np.inf, -np.inf, info.max, -info.max, info.smallest_subnormal], dtype),
            np.array([info.tiny, -info.smallest_subnormal], dtype),
            np.random.default_rng(0).standard_normal(1000).astype(dtype)
            * 10.0 ** np.arange(-20, 20, 0.04)[:1000].astype(dtype),
        ]
    )
    got = np.asarray(jax.jit(_rounded)(jnp.asarray(x)))
    assert got.dtype == dtype
    np.testing.assert_array_equal(got.view(f"int{info.bits}"), x.view(f"int{info.bits}"))
    nans = np.array([np.nan, -np.nan], dtype)
    nans = np.concatenate([nans, (nans.view(f"uint{info.bits}") | 1).view(dtype)])
    assert np.isnan(np.asarray(jax.jit(_rounded)(jnp.asarray(nans)))).all()
    assert jax.grad(lambda v: _rounded(v * v))(dtype(3.0)) == 6.0


def test_a_lambda_is_traced_anew_for_each_schedule():
    """``python_arithmetic`` traces the lambda on every build (``make_jaxpr`` would reuse a
    cached trace of the same function, with the value its closure read the first time)."""
    factor = {"value": 0.5}
    fn = lambda e: factor["value"] ** e
    first = S.lambda_lr(1.0, fn).values(2)
    factor["value"] = 0.25
    np.testing.assert_array_equal(first, [1.0, 0.5, 0.25])
    np.testing.assert_array_equal(S.lambda_lr(1.0, fn).values(2), [1.0, 0.25, 0.0625])
