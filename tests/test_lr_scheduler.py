"""functorch_optim.optim.lr_scheduler (imperative classes) against torch, on a stand-in optimizer.

``StandInOptimizer`` is a test double for the facade (``functorch_optim.optim``), which is
built elsewhere: it has only what the schedulers use, ``param_groups`` (dicts whose
``lr`` / ``momentum`` / ``betas`` are read and assigned) and ``defaults``.
"""

from __future__ import annotations

import copy
import functools
import warnings

import numpy as np
import pytest
import torch
from torch.optim import lr_scheduler as TL
from torch.optim import swa_utils

from functorch_optim.optim import lr_scheduler as L
from tests.helpers import _get_linear_schedule_with_warmup_lr_lambda, get_linear_schedule_with_warmup

STEPS = 120
LRS = [0.1, 0.03]


class StandInOptimizer:
    """Test double: the facade's assumed ``param_groups`` / ``defaults`` surface only."""

    def __init__(self, groups, defaults):
        self.param_groups = groups
        self.defaults = defaults


def _pair(adam=False):
    if adam:
        topt = torch.optim.Adam([{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in LRS])
        groups = [{"lr": lr, "betas": (0.9, 0.999)} for lr in LRS]
        return topt, StandInOptimizer(groups, {"lr": 1e-3, "betas": (0.9, 0.999)})
    topt = torch.optim.SGD(
        [{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in LRS], momentum=0.9
    )
    groups = [{"lr": lr, "momentum": 0.9} for lr in LRS]
    return topt, StandInOptimizer(groups, {"lr": 1e-3, "momentum": 0.9})


def _momenta(opt):
    return [float(g["betas"][0]) if "betas" in g else float(g["momentum"]) for g in opt.param_groups]


CASES = {
    "CosineAnnealingLR": lambda M, o: M.CosineAnnealingLR(o, T_max=30, eta_min=0.001),
    "LambdaLR-per-group": lambda M, o: M.LambdaLR(o, [lambda e: 0.99**e, lambda e: 1.0 / (1 + e)]),
    "ChainedScheduler": lambda M, o: M.ChainedScheduler([M.ConstantLR(o, 0.1, 20), M.ExponentialLR(o, 0.98)]),
    "SequentialLR": lambda M, o: M.SequentialLR(
        o, [M.LinearLR(o, 0.1, 1.0, 10), M.CosineAnnealingLR(o, 40)], [10]
    ),
    "CyclicLR-momentum": lambda M, o: M.CyclicLR(o, 0.01, [0.1, 0.2], 7, mode="triangular2"),
    "OneCycleLR-betas": lambda M, o: M.OneCycleLR(o, [0.5, 0.2], total_steps=STEPS, three_phase=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_classes_drive_param_groups_like_torch(name):
    adam = name.endswith("betas")
    topt, opt = _pair(adam)
    make = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = make(TL, topt)
        ours = make(L, opt)
        for t in range(STEPS + 1):
            assert np.max(np.abs(np.asarray(ours.get_last_lr()) - ref.get_last_lr())) <= 1e-12, t
            assert [g["lr"] for g in opt.param_groups] == ours.get_last_lr()
            assert np.max(np.abs(np.asarray(_momenta(opt)) - _momenta(topt))) <= 1e-12, t
            if t < STEPS:
                topt.step()
                ref.step()
                ours.step()
    assert opt.param_groups[0]["initial_lr"] == topt.param_groups[0]["initial_lr"]
    if adam:
        assert [g["betas"][1] for g in opt.param_groups] == [0.999, 0.999]


def test_step_reads_the_groups_lr_like_torch_chainable_form():
    """A manual change of group["lr"] between steps is carried on, as in torch."""
    topt, opt = _pair()
    ref, ours = TL.ExponentialLR(topt, 0.5), L.ExponentialLR(opt, 0.5)
    for t in range(6):
        if t == 3:
            topt.param_groups[1]["lr"] = opt.param_groups[1]["lr"] = 1.0
        topt.step()
        ref.step()
        ours.step()
        assert ours.get_last_lr() == ref.get_last_lr()


def test_swalr_and_plateau_classes():
    topt, opt = _pair()
    ref, ours = swa_utils.SWALR(topt, [0.05, 0.01], 7), L.SWALR(opt, [0.05, 0.01], 7)
    for _ in range(12):
        topt.step()
        ref.step()
        ours.step()
        assert np.max(np.abs(np.asarray(ours.get_last_lr()) - ref.get_last_lr())) <= 1e-15
    topt, opt = _pair()
    ref = TL.ReduceLROnPlateau(topt, patience=1, cooldown=1, min_lr=[0.01, 0.001])
    ours = L.ReduceLROnPlateau(opt, patience=1, cooldown=1, min_lr=[0.01, 0.001])
    metrics = np.repeat([5.0, 4.0, 4.5, 4.2, 4.1, 3.0, 3.1], 2)
    for m in metrics:
        ref.step(m)
        ours.step(m)
        assert ours.get_last_lr() == ref.get_last_lr()
        assert ours.num_bad_epochs == ref.num_bad_epochs
    assert ours.get_last_lr()[0] < LRS[0]


def test_state_dict_resume_matches_torch():
    k = 25
    topt, opt = _pair()
    make = CASES["SequentialLR"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = make(TL, topt)
        ours = make(L, opt)
        for _ in range(k):
            topt.step()
            ref.step()
            ours.step()
        sd = ours.state_dict()
        groups = copy.deepcopy(opt.param_groups)  # what the optimizer's own state_dict carries
        _, opt2 = _pair()
        resumed = make(L, opt2)
        opt2.param_groups = groups
        resumed.load_state_dict(sd)
        for _ in range(40):
            topt.step()
            ref.step()
            resumed.step()
            assert np.max(np.abs(np.asarray(resumed.get_last_lr()) - ref.get_last_lr())) <= 1e-12
    assert resumed.last_epoch == k + 40


def test_errors_like_torch():
    _, opt = _pair()
    with pytest.raises(ValueError, match="does not support `ReduceLROnPlateau`"):
        L.SequentialLR(opt, [L.StepLR(opt, 2), L.ReduceLROnPlateau(opt)], [3])
    _, other = _pair()
    with pytest.raises(ValueError, match="expects all schedulers to belong to the same optimizer"):
        L.ChainedScheduler([L.StepLR(opt, 2), L.StepLR(other, 2)])
    plain = StandInOptimizer([{"lr": 0.1}], {"lr": 0.1})
    with pytest.raises(ValueError, match="optimizer must support momentum or beta1"):
        L.CyclicLR(plain, 0.01, 0.1)
    topt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    ref, ours = TL.OneCycleLR(topt, 1.0, total_steps=3), L.OneCycleLR(_pair()[1], 1.0, total_steps=3)
    for _ in range(3):
        topt.step()
        ref.step()
        ours.step()
    with pytest.raises(ValueError) as err:
        ref.step()
    with pytest.raises(ValueError, match=str(err.value)):
        ours.step()


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("CosineAnnealingLR", {"T_max": 7, "eta_min": 0.01}),
        ("StepLR", {"step_size": 4, "gamma": 0.5}),
        (
            "LambdaLR",
            {
                "lr_lambda": functools.partial(
                    _get_linear_schedule_with_warmup_lr_lambda, num_warmup_steps=4, num_training_steps=16
                )
            },
        ),
    ],
)
def test_drives_the_real_facade_like_torch(name, kwargs):
    """The classes over functorch_optim.optim.SGD (two groups) train like torch's pair."""
    import jax.numpy as jnp

    from functorch_optim.optim import SGD

    rng = np.random.default_rng(4)
    init = [rng.standard_normal((3, 2)), rng.standard_normal(2)]
    grads = [[rng.standard_normal((3, 2)), rng.standard_normal(2)] for _ in range(20)]
    ts = [torch.tensor(p, requires_grad=True) for p in init]
    t_opt = torch.optim.SGD(
        [{"params": [ts[0]]}, {"params": [ts[1]], "lr": 0.3}], lr=0.1, momentum=0.9, foreach=False
    )
    t_sched = getattr(TL, name)(t_opt, **kwargs)
    opt = SGD(
        [{"params": jnp.asarray(init[0])}, {"params": jnp.asarray(init[1]), "lr": 0.3}], lr=0.1, momentum=0.9
    )
    sched = getattr(L, name)(opt, **kwargs)
    for g in grads:
        for t, gl in zip(ts, g):
            t.grad = torch.tensor(gl)
        t_opt.step()
        t_sched.step()
        opt.grad = [jnp.asarray(gl) for gl in g]
        opt.step()
        sched.step()
        np.testing.assert_allclose(sched.get_last_lr(), t_sched.get_last_lr(), rtol=1e-12, atol=0)
    for ours, theirs in zip(opt.params, ts):
        np.testing.assert_allclose(np.asarray(ours), theirs.detach().numpy(), rtol=1e-12, atol=1e-15)


# ----------------------------------------------------------------------------- eager lambdas
def _recording(fn, calls):
    def lr_lambda(epoch):
        calls.append(epoch)
        return fn(epoch)

    return lr_lambda


def test_lambda_lr_calls_transformers_lambda_eagerly_like_torch():
    """transformers' warmup lambda (``if``, ``max``, ``float``) runs unchanged: same lrs, same calls."""
    topt, opt = _pair()
    ref = get_linear_schedule_with_warmup(topt, 5, 30, LambdaLR=TL.LambdaLR)
    ours = get_linear_schedule_with_warmup(opt, 5, 30, LambdaLR=L.LambdaLR)
    for _ in range(34):
        assert ours.get_last_lr() == ref.get_last_lr()  # float64, exactly
        assert [g["lr"] for g in opt.param_groups] == ref.get_last_lr()
        topt.step()
        ref.step()
        ours.step()
    assert ours.get_last_lr() == [0.0, 0.0]
    assert ours.last_epoch == ref.last_epoch == 34


@pytest.mark.parametrize("name", ["LambdaLR", "MultiplicativeLR"])
def test_lambda_receives_a_python_int_once_per_group_like_torch(name):
    def factor(epoch):
        return 0.5 if epoch % 3 == 0 else 1.0 - epoch / 100

    topt, opt = _pair()
    theirs, ours = [], []
    ref = getattr(TL, name)(topt, _recording(factor, theirs))
    sched = getattr(L, name)(opt, _recording(factor, ours))
    for _ in range(10):
        assert sched.get_last_lr() == ref.get_last_lr()
        topt.step()
        ref.step()
        sched.step()
    assert sched.get_last_lr() == ref.get_last_lr()
    assert ours == theirs and {type(e) for e in ours} == {int}


def test_eager_lambdas_inside_sequential_and_chained_like_torch():
    def warm(epoch):
        return float(epoch) / 3 if epoch < 3 else 1.0

    def cases(M, o, calls):
        warm_ = _recording(warm, calls)
        return {
            "SequentialLR": lambda: M.SequentialLR(
                o, [M.LambdaLR(o, warm_), M.ExponentialLR(o, 0.9), M.LambdaLR(o, warm_)], [3, 6]
            ),
            "ChainedScheduler": lambda: M.ChainedScheduler(
                [M.MultiplicativeLR(o, lambda e: 0.9 if e > 4 else 1.0), M.LambdaLR(o, [warm_, warm_])]
            ),
        }

    for name in ["SequentialLR", "ChainedScheduler"]:
        topt, opt = _pair()
        theirs, ours_calls = [], []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref, ours = cases(TL, topt, theirs)[name](), cases(L, opt, ours_calls)[name]()
            # (construction rebuilds the sub-schedules from their specs: more calls than torch's)
            del theirs[:], ours_calls[:]
            for t in range(12):
                assert ours.get_last_lr() == ref.get_last_lr(), (name, t)
                topt.step()
                ref.step()
                ours.step()
        assert ours_calls == theirs and len(theirs) > 12, name  # only the active scheduler's, as torch


def test_cyclic_lr_calls_a_python_scale_fn_eagerly_like_torch():
    def scale_fn(x):  # Python control flow on the cycle, as torch allows
        return 1.0 if x < 2 else 0.5 / float(x)

    topt, opt = _pair()
    ref = TL.CyclicLR(topt, 0.01, 0.1, 3, scale_fn=scale_fn)
    ours = L.CyclicLR(opt, 0.01, 0.1, 3, scale_fn=scale_fn)
    for t in range(20):
        assert ours.get_last_lr() == ref.get_last_lr(), t
        assert _momenta(opt) == _momenta(topt), t
        topt.step()
        ref.step()
        ours.step()
