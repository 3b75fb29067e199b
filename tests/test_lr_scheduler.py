"""functorch_optim.optim.lr_scheduler (imperative classes) against torch, on a stand-in optimizer.

``StandInOptimizer`` is a test double for the facade (``functorch_optim.optim``), which is
built elsewhere: it has only what the schedulers use, ``param_groups`` (dicts whose
``lr`` / ``momentum`` / ``betas`` are read and assigned) and ``defaults``.
"""

from __future__ import annotations

import copy
import functools
import io
import warnings

import numpy as np
import pytest
import torch
from torch.optim import lr_scheduler as TL
from torch.optim import swa_utils

from functorch_optim.optim import lr_scheduler as L
from tests.helpers import (
    CompileCounter,
    _get_linear_schedule_with_warmup_lr_lambda,
    get_linear_schedule_with_warmup,
)

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


# ----------------------------------------------------------------------------- state dicts in torch's layout
class Decay:
    """A callable-object lr_lambda: torch saves and restores its ``__dict__``."""

    def __init__(self, rate):
        self.rate = rate

    def __call__(self, epoch):
        return self.rate**epoch


class Scale:
    """A callable-object CyclicLR scale_fn."""

    def __init__(self, base):
        self.base = base

    def __call__(self, x):
        return self.base ** (x - 1)


# every torch scheduler and SWALR; the second entry: Adam (betas) instead of SGD (momentum)
ALL = {
    "LambdaLR": (False, lambda M, o: M.LambdaLR(o, lambda e: 0.9**e)),
    "LambdaLR-object": (False, lambda M, o: M.LambdaLR(o, [Decay(0.9), lambda e: 1.0 / (1 + e)])),
    "MultiplicativeLR": (False, lambda M, o: M.MultiplicativeLR(o, [Decay(0.95), Decay(0.8)])),
    "StepLR": (False, lambda M, o: M.StepLR(o, 3, 0.5)),
    "MultiStepLR": (False, lambda M, o: M.MultiStepLR(o, [2, 9, 9, 14], 0.5)),
    "ConstantLR": (False, lambda M, o: M.ConstantLR(o, 0.25, 10)),
    "LinearLR": (False, lambda M, o: M.LinearLR(o, 0.2, 0.9, 12)),
    "ExponentialLR": (False, lambda M, o: M.ExponentialLR(o, 0.9)),
    "PolynomialLR": (False, lambda M, o: M.PolynomialLR(o, 15, 2.0)),
    "CosineAnnealingLR": (False, lambda M, o: M.CosineAnnealingLR(o, 6, 0.001)),
    "CosineAnnealingWarmRestarts": (False, lambda M, o: M.CosineAnnealingWarmRestarts(o, 3, 2, 0.001)),
    "SWALR": (False, lambda M, o: _swalr(M)(o, [0.02, 0.01], 9, "linear")),
    "CyclicLR": (False, lambda M, o: M.CyclicLR(o, 0.01, [0.1, 0.2], 4, mode="exp_range", gamma=0.9)),
    "CyclicLR-betas-object": (True, lambda M, o: M.CyclicLR(o, 0.01, 0.1, 3, scale_fn=Scale(0.5))),
    "CyclicLR-no-momentum": (False, lambda M, o: M.CyclicLR(o, 0.01, 0.1, 5, cycle_momentum=False)),
    "OneCycleLR": (False, lambda M, o: M.OneCycleLR(o, [0.5, 0.2], total_steps=40, three_phase=True)),
    "OneCycleLR-betas": (True, lambda M, o: M.OneCycleLR(o, 0.3, epochs=8, steps_per_epoch=5)),
    "ReduceLROnPlateau": (
        False,
        lambda M, o: M.ReduceLROnPlateau(o, patience=1, cooldown=1, min_lr=[0.01, 0]),
    ),
    "SequentialLR": (
        False,
        lambda M, o: M.SequentialLR(o, [M.LinearLR(o, 0.1, 1.0, 5), M.CosineAnnealingLR(o, 8)], [9]),
    ),
    "ChainedScheduler": (
        False,
        lambda M, o: M.ChainedScheduler([M.ConstantLR(o, 0.1, 9), M.ExponentialLR(o, 0.9)]),
    ),
    "ChainedScheduler-nested": (
        True,
        lambda M, o: M.ChainedScheduler(
            [M.SequentialLR(o, [M.ConstantLR(o, 0.5, 3), M.StepLR(o, 2)], [10]), M.CyclicLR(o, 0.01, 0.1, 4)]
        ),
    ),
}
FIRST, THEN = 8, 14
METRICS = np.repeat(
    [5.0, 4.0, 4.5, 4.2, 4.1, 3.0, 3.1, 3.2, 3.3, 2.0, 2.1, 2.2, 2.3, 1.0, 1.1, 1.2, 1.3, 1.4], 2
)


def _swalr(M):
    return swa_utils.SWALR if M is TL else L.SWALR


def _facade(adam):
    import jax.numpy as jnp

    from functorch_optim.optim import SGD, Adam

    groups = [{"params": jnp.zeros(1), "lr": lr} for lr in LRS]
    return Adam(groups) if adam else SGD(groups, lr=1e-3, momentum=0.9)


def _torch_opt(adam):
    return _pair(adam)[0]


def _advance(sched, opt, t):
    if isinstance(sched, TL.ReduceLROnPlateau | L.ReduceLROnPlateau):
        sched.step(METRICS[t])
    else:
        if isinstance(opt, torch.optim.Optimizer):
            opt.step()
        sched.step()


def _same_layout(ours, theirs, path="sd"):
    """Same keys, same Python types, equal values (floats to 1e-15 relative)."""
    assert type(ours) is type(theirs), (path, type(ours), type(theirs))
    if isinstance(theirs, dict):
        assert set(ours) == set(theirs), (path, sorted(set(ours) ^ set(theirs)))
        for k in theirs:
            _same_layout(ours[k], theirs[k], f"{path}[{k!r}]")
    elif isinstance(theirs, list | tuple):
        assert len(ours) == len(theirs), path
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _same_layout(a, b, f"{path}[{i}]")
    elif isinstance(theirs, float):
        assert ours == theirs or abs(ours - theirs) <= 1e-15 * abs(theirs), (path, ours, theirs)
    else:
        assert ours == theirs, (path, ours, theirs)


def _close(a, b, what):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.abs(a - b) <= 1e-15 * np.abs(b)), (what, a.tolist(), b.tolist())


def _assert_same_run(ours, o_opt, theirs, t_opt, start, steps):
    for t in range(start, start + steps):
        _advance(theirs, t_opt, t)
        _advance(ours, o_opt, t)
        _close(ours.get_last_lr(), theirs.get_last_lr(), f"lr at step {t}")
        _close([g["lr"] for g in o_opt.param_groups], [g["lr"] for g in t_opt.param_groups], t)
        _close(_momenta(o_opt), _momenta(t_opt), f"momentum at step {t}")


@pytest.mark.parametrize("name", list(ALL))
def test_torch_scheduler_state_dict_resumes_in_ours_and_ours_in_torch(name):
    """torch N steps -> its state dicts (optimizer's and scheduler's) -> ours -> M more: equal to
    torch's uninterrupted run; then ours -> a fresh torch pair, M more: equal again."""
    adam, make = ALL[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t_opt = _torch_opt(adam)
        theirs = make(TL, t_opt)
        for t in range(FIRST):
            _advance(theirs, t_opt, t)
        saved_opt, saved = t_opt.state_dict(), copy.deepcopy(theirs.state_dict())

        o_opt = _facade(adam)
        ours = make(L, o_opt)
        if name == "LambdaLR-object":
            ours.lr_lambdas[0].rate = 0.5  # the saved __dict__ restores it, as in torch
        ours.load_state_dict(saved)
        o_opt.load_state_dict(saved_opt)
        _same_layout(ours.state_dict(), theirs.state_dict())
        _close(ours.get_last_lr(), theirs.get_last_lr(), "after load")
        _assert_same_run(ours, o_opt, theirs, t_opt, FIRST, THEN)

        t_opt2 = _torch_opt(adam)
        theirs2 = make(TL, t_opt2)
        t_opt2.load_state_dict(o_opt.state_dict())
        buf = io.BytesIO()
        torch.save(ours.state_dict(), buf)
        buf.seek(0)
        theirs2.load_state_dict(torch.load(buf))  # weights_only=True reads it
        _same_layout(theirs2.state_dict(), ours.state_dict())
        _assert_same_run(ours, o_opt, theirs2, t_opt2, FIRST + THEN, THEN)
        if name == "ReduceLROnPlateau":
            assert ours.get_last_lr()[1] < LRS[1] * 1e-3  # reduced after the load (group 0 floored)


def test_torch_state_dict_loads_where_it_raised_key_error_and_torch_loads_ours_as_its_own():
    """The reported failures: ``load_state_dict(torch_sd)`` raised ``KeyError: 'group'``, and
    torch "loaded" ours as attributes it never reads (its own kept going unchanged)."""
    t_opt = _torch_opt(False)
    theirs = TL.StepLR(t_opt, 2)
    for _ in range(3):
        t_opt.step()
        theirs.step()
    ours = L.StepLR(StandInOptimizer([{"lr": lr, "momentum": 0.9} for lr in LRS], {}), 2)
    ours.load_state_dict(theirs.state_dict())
    assert ours.last_epoch == 3
    assert set(ours.state_dict()) == set(theirs.state_dict())
    fresh = TL.StepLR(_torch_opt(False), 2)
    fresh.load_state_dict(ours.state_dict())
    assert fresh.state_dict() == theirs.state_dict()


def test_torch_load_weights_only_reads_our_scheduler_state(tmp_path):
    """Python numbers, lists, Counters: torch.load's safe default reads them."""
    _, opt = _pair()
    scheds = [L.MultiStepLR(opt, [2, 2, 5]), L.ReduceLROnPlateau(opt), L.OneCycleLR(opt, 0.1, 10)]
    for s in scheds:
        path = tmp_path / "s.pt"
        torch.save(s.state_dict(), path)
        assert torch.load(path) == s.state_dict()


@pytest.mark.parametrize(
    ("saved", "match"),
    [
        (lambda: L.ExponentialLR(_pair()[1], 0.9).state_dict(), r"StepLR.*missing \['step_size'\]"),
        (lambda: {**L.StepLR(_pair()[1], 3).state_dict(), "T_max": 3}, r"unexpected \['T_max'\]"),
        (
            lambda: L.StepLR(_pair()[1], 5).state_dict(),
            r"saved step_size is 5, but this StepLR was built with 3",
        ),
        (
            lambda: {**L.StepLR(_pair()[1], 3).state_dict(), "base_lrs": [0.1]},
            r"'base_lrs' must be a list of 2",
        ),
        (
            lambda: {**L.StepLR(_pair()[1], 3).state_dict(), "last_epoch": 1.5},
            r"'last_epoch' must be an integer",
        ),
        (lambda: {"group": {}, "state": {}, "_last_lr": LRS}, r"not a StepLR state dict"),
    ],
    ids=["other-class", "extra-key", "other-hparam", "groups", "non-integer", "old-layout"],
)
def test_foreign_state_dicts_are_refused_before_anything_changes(saved, match):
    _, opt = _pair()
    ours = L.StepLR(opt, 3)
    ours.step()
    before = ours.state_dict()
    with pytest.raises(ValueError, match=match):
        ours.load_state_dict(saved())
    assert ours.state_dict() == before


def test_composites_refuse_a_bad_child_and_keep_their_state():
    _, opt = _pair()
    chain = L.ChainedScheduler([L.ConstantLR(opt, 0.5, 3), L.ExponentialLR(opt, 0.9)])
    chain.step()
    before = chain.state_dict()
    bad = copy.deepcopy(before)
    bad["_schedulers"][1]["gamma"] = 0.5
    with pytest.raises(ValueError, match=r"ChainedScheduler._schedulers\[1\]: .*saved gamma is 0.5"):
        chain.load_state_dict(bad)
    with pytest.raises(ValueError, match=r"'_schedulers' must hold 2 state dicts"):
        chain.load_state_dict({**before, "_schedulers": before["_schedulers"][:1]})
    assert chain.state_dict() == before
    with pytest.raises(TypeError, match="expects a dict"):
        L.ReduceLROnPlateau(opt).load_state_dict([1, 2])


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
            assert ours_calls == theirs, name  # construction: torch's undo and initial step
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
