"""functorch_optim.optim.lr_scheduler (imperative classes) against torch, on a stand-in optimizer.

``StandInOptimizer`` is a test double for the facade (``functorch_optim.optim``), which is
built elsewhere: it has only what the schedulers use, ``param_groups`` (dicts whose
``lr`` / ``momentum`` / ``betas`` are read and assigned) and ``defaults``.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from torch.optim import lr_scheduler as TL
from torch.optim import swa_utils

from functorch_optim.optim import lr_scheduler as L
from tests.helpers import CompileCounter

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
    [("CosineAnnealingLR", {"T_max": 7, "eta_min": 0.01}), ("StepLR", {"step_size": 4, "gamma": 0.5})],
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


def _scheduler_sweep(make, n, steps=3):
    """``n`` schedulers ``make(i, module, optimizer)`` over fresh optimizers, each stepped
    ``steps`` times beside torch's; returns the compilations they caused."""
    with CompileCounter() as compiled:
        for i in range(n):
            topt, opt = _pair()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ref, ours = make(i, TL, topt), make(i, L, opt)
                for _ in range(steps):
                    topt.step()
                    ref.step()
                    ours.step()
            assert np.max(np.abs(np.asarray(ours.get_last_lr()) - ref.get_last_lr())) <= 1e-15
    return compiled.count


@pytest.mark.parametrize(
    "make",
    [
        lambda i, M, o: M.StepLR(o, step_size=2, gamma=0.5),
        lambda i, M, o: M.CosineAnnealingLR(o, T_max=10),
        lambda i, M, o: M.SequentialLR(o, [M.LinearLR(o, 0.1, 1.0, 2), M.ExponentialLR(o, 0.9)], [2]),
    ],
    ids=["StepLR", "CosineAnnealingLR", "SequentialLR"],
)
def test_schedulers_of_one_configuration_compile_once(make):
    _scheduler_sweep(make, 1)  # compiles its step
    assert _scheduler_sweep(make, 20) == 0


def test_reduce_lr_on_plateau_of_one_configuration_compiles_once():
    def sweep(n):
        with CompileCounter() as compiled:
            for i in range(n):
                topt, opt = _pair()
                ref, ours = TL.ReduceLROnPlateau(topt, patience=1), L.ReduceLROnPlateau(opt, patience=1)
                for metric in (1.0, 1.0, 1.0, 0.5 - i / 100):
                    ref.step(metric)
                    ours.step(metric)
                assert ours.get_last_lr() == ref.get_last_lr() == [lr * 0.1 for lr in LRS]
        return compiled.count

    sweep(1)
    assert sweep(20) == 0
